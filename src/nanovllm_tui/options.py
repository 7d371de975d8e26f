"""Command-line options of ``nanovllm-tui``: the engine options of ``nanovllm`` plus the app's own."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from nanovllm_core.cli import build_parser as build_engine_parser
from nanovllm_core.cli import engine_kwargs, narrate_steps, sampling_params, tcp_port
from nanovllm_core.cli_args import (api_key, api_key_default, check_output_paths, contiguous_problem, priorities_problem,
                                    screen_rate)
from nanovllm_tui.bridge import DEFAULT_FPS

# Set by `nanovllm-tui --web` for the app process it starts for each visitor (web.app_environment)
WEB_VISITOR = "NANOVLLM_WEB_VISITOR"
# ``NanoVLLMApp.tutorial_path`` of a --web visitor's app: progress kept in memory for the visit, never read or
# written to a file (trial 48a: every visitor read and wrote the one default file, a classroom's answers mixed)
VISIT_ONLY = "visit only"

DEFAULT_KV_BLOCKS = 512  # 8,192 tokens at block size 16: room to play, and a block map that fits a screen
# nanovllm options with no meaning here: the app's tabs do what the teaching modes print.
NOT_IN_APP = ("show_memory_stats", "narrate", "xray", "dashboard", "tutorial", "no_demos", "tutorial_chapter")
# Options that act on a live engine, so not on a replay: it loads no model, runs no new prompt,
# and is itself a recording.
NOT_WITH_REPLAY = ("chat", "raw", "model", "device", "dtype", "prompt", "priority", "max_tokens", "temperature", "top_k", "top_p",
                   "min_p", "repetition_penalty", "seed", "stop", "logprobs", "ignore_eos", "scheduling_policy",
                   "max_prefill_tokens", "max_num_seqs", "max_model_len", "block_size", "num_kv_blocks",
                   "no_paged_attention", "no_flash_attn", "no_prefix_caching", "speculative_model",
                   "num_speculative_tokens", "quantization", "tensor_parallel_size", "tp_master_addr", "tp_master_port",
                   "tp_local_ranks", "tp_rendezvous_timeout", "trace", "trace_xray", "trace_chrome")


def build_parser() -> argparse.ArgumentParser:
    """``nanovllm``'s parser (model, sampling, engine, trace options) with the app's options added."""
    p = build_engine_parser()
    p.prog = "nanovllm-tui"
    # What nanovllm's help says that the app does not: its teaching modes are the app's tabs (typed,
    # they are refused with a line that says so, parse_args), and it sends no prompt unless given one.
    for action in p._actions:
        if action.dest in NOT_IN_APP:
            action.help = argparse.SUPPRESS  # left out of --help and its usage line (trial 14e)
        elif action.dest == "prompt":
            action.help = "a prompt sent when the app starts (repeat for several; default: none, type one in the app)"
        elif action.dest == "chat":  # the app's default differs from nanovllm's (trial 29e)
            action.help = ("send --prompt and the prompt bar's prompts as chat for any model (the default already "
                           "for a model with a chat template; --raw sends raw text, as nanovllm does without --chat)")
        elif action.dest == "logprobs":  # the engine computes them; the app's own Top-k panel is what it shows
            action.help = ("have the engine compute the top-N log-probabilities of each token, as nanovllm does "
                           "(the app does not show them: its Top-k panel shows the top 5 either way)")
    for group in p._action_groups:
        if group.title == "teaching modes":
            group.title = "narrator and tutorial tabs"
    p.description = ("Watch the nano-vLLM engine serve your prompts: dashboard, X-Ray, narrator, tutorial and "
                     "block map. --prompt, --priority, --max-tokens and --temperature seed the prompt bar; the "
                     "other sampling options apply to every prompt you send; --narrate-steps and --progress-file "
                     "set the Narrator and Tutorial tabs.")
    a = p.add_argument_group("app")
    a.add_argument("--replay", metavar="FILE.jsonl", default=None,
                   help="play a trace recorded with `nanovllm --trace FILE.jsonl` (no model is loaded)")
    a.add_argument("--raw", action="store_true",
                   help="send --prompt and the prompt bar's prompts as raw text for the model to continue, as nanovllm "
                        "does without --chat (ctrl+t in the app switches either way)")
    a.add_argument("--paused", action="store_true", help="start with the engine (or the replay) paused")
    a.add_argument("--fps", type=screen_rate, default=DEFAULT_FPS,
                   help=f"most screen updates per second from engine events (default {DEFAULT_FPS:g})")
    r = p.add_argument_group("attach and share")
    r.add_argument("--connect", metavar="URL", default=None,
                   help="watch and drive the engine of a running `nanovllm serve` (e.g. http://127.0.0.1:8000) "
                        "instead of loading a model here")
    r.add_argument("--api-key", type=api_key, default=api_key_default(),
                   help="with --connect: the server's --api-key (default: $NANOVLLM_API_KEY)")
    r.add_argument("--web", action="store_true",
                   help="serve this app to web browsers (textual-serve), one app per visitor; "
                        "add --connect URL so every visitor watches one server")
    r.add_argument("--host", default=None, help="with --web: address to listen on (default 127.0.0.1)")
    r.add_argument("--port", type=tcp_port, default=None, help="with --web: TCP port (default 8001)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in NOT_IN_APP:
        if getattr(args, name, None):
            parser.error(f"--{name.replace('_', '-')} is a nanovllm option and not available in the app "
                         "(its tabs show the same: 1 Dashboard, 2 X-Ray, 3 Narrator, 4 Tutorial, 5 Block Map)")
    if args.replay:
        given = given_options(argv, NOT_WITH_REPLAY)
        if given:
            parser.error(f"{option_as_typed(argv, given[0])} does nothing with --replay: a replay plays a recorded "
                         "trace (no model, no new prompts); leave it out, or start without --replay")
    if args.chat and args.raw:
        parser.error("--chat and --raw ask for opposite things: give one of them (ctrl+t in the app switches)")
    if args.prompt and any(p == "" for p in args.prompt):  # only spaces is a prompt (vLLM takes it), "" is none
        parser.error("--prompt must not be empty")
    if args.priority is not None and len(args.priority) != len(args.prompt or []):
        parser.error(f"got {len(args.priority)} --priority values for {len(args.prompt or [])} --prompt values; "
                     "give one per prompt")
    if contiguous_problem(args):  # a setting the contiguous baseline would ignore
        parser.error(contiguous_problem(args))
    if priorities_problem(args.priority, args.scheduling_policy):  # the engine's rule: fcfs takes priority 0 only
        parser.error(priorities_problem(args.priority, args.scheduling_policy))
    if args.trace_xray and not args.trace:
        parser.error("--trace-xray records into the --trace file; add --trace FILE.jsonl")
    if args.replay and args.connect is not None:
        parser.error("--replay and --connect are two sources for the app: play a recording, or watch a running "
                     "server; give one of them")
    try:
        args.sampling = sampling_params(args)
    except ValueError as e:
        parser.error(str(e))
    if not args.replay:  # the prompt bar's defaults and the prompts sent at start: the bar's own rules
        from nanovllm_tui.widgets.prompt_bar import PromptSettings, fitting_max_tokens, settings_errors

        if (args.max_model_len is not None and args.max_tokens > args.max_model_len
                and not given_options(argv, ("max_tokens",))):
            # the default nobody typed: lowered to half the context, room left for a prompt, not refused as
            # if --max-tokens had been given (trial 30e's kind: `--max-model-len 24` alone was an error)
            args.max_tokens = fitting_max_tokens(args.max_model_len)
            args.sampling = sampling_params(args)

        wrong = settings_errors(PromptSettings(max_tokens=args.max_tokens, temperature=args.temperature),
                                args.priority or (), limit=args.max_model_len)
        if wrong:
            parser.error(f"--{wrong[0][0]}: {wrong[0][1]}")
    # Output files before anything starts (a model load, a --connect wait, a --web server whose every
    # visitor's app would fail on them), with the rule and the words of `nanovllm` (trial 17a)
    check_output_paths(parser, ("--trace", args.trace), ("--trace-chrome", args.trace_chrome),
                       ("--progress-file", args.progress_file), make_folders=("--progress-file",))
    if (args.host is not None or args.port is not None) and not args.web:
        parser.error("--host and --port are where --web listens; add --web (the server you attach to is --connect URL)")
    recorded = [o for o, v in (("--trace", args.trace), ("--trace-chrome", args.trace_chrome),
                               ("--progress-file", args.progress_file)) if v]
    if args.web and recorded:  # before --connect's wait for a server (trial 46c: the key was asked for first)
        # one app process per visitor: each would start the same file afresh over the others'
        parser.error(f"{recorded[0]} cannot be used with --web: every visitor's app would write the same "
                     "file over the others'; " + (
                         "each visitor's tutorial progress lasts the visit; leave it out" if recorded[0] ==
                         "--progress-file" else "record one session with nanovllm-tui (no --web) or nanovllm --trace"))
    if args.connect is not None:  # "" too: an empty address is refused, not read as "no --connect"
        check_connect(parser, args, given_options(argv, SERVER_SIDE), argv)
    if args.replay:
        from nanovllm_tui.replay import load_trace

        try:
            args.replay_events = load_trace(args.replay)
        except (OSError, ValueError) as e:
            parser.error(f"cannot replay {args.replay}: {e}")
    return args


class _Unset(list):
    """The default that marks an option as not given. A list, because an append option (``--prompt``,
    ``--stop``) appends to its default: argparse copies it first, so a given one is no longer this
    object (a plain ``object()`` raised AttributeError: no ``append``)."""


_UNSET = _Unset()


def option_as_typed(argv: Sequence[str] | None, name: str) -> str:
    """The flag the command line used for the option ``name`` (a dest): an alias such as vLLM's
    ``--max-num-batched-tokens`` or ``--enable-prefix-caching``, or an abbreviation, spelled out in full
    as --help lists it; ``--`` + ``name`` with dashes when none is found."""
    import sys

    parser = build_parser()
    for token in (sys.argv[1:] if argv is None else argv):
        if not token.startswith("--"):
            continue
        key = token.partition("=")[0]
        action = parser._option_string_actions.get(key)
        if action is None:  # an abbreviation argparse took (allow_abbrev): the one option it starts
            found = [a for flag, a in parser._option_string_actions.items() if flag.startswith(key)]
            action, key = (found[0], next(f for f in found[0].option_strings if f.startswith(key))) \
                if len({id(a) for a in found}) == 1 else (None, key)
        if action is not None and action.dest == name:
            return key
    return f"--{name.replace('_', '-')}"


def given_options(argv: Sequence[str] | None, names: Sequence[str]) -> list[str]:
    """Which of ``names`` (dests) the command line gives, in ``names``' order, also when given
    with their default value (``--scheduling-policy priority`` says something too)."""
    p = build_parser()
    p.set_defaults(**{name: _UNSET for name in names})
    given, _ = p.parse_known_args(argv)
    return [name for name in names if getattr(given, name) is not _UNSET]


# Options of the engine that a server attached with --connect has already chosen (every one of
# them is an option of `nanovllm serve`: tests/test_serve_cli.py checks it).
SERVER_SIDE = ("model", "device", "dtype", "quantization", "scheduling_policy", "max_prefill_tokens", "max_num_seqs",
               "max_model_len", "block_size", "num_kv_blocks", "no_paged_attention", "no_flash_attn",
               "no_prefix_caching", "speculative_model", "num_speculative_tokens", "tensor_parallel_size",
               "tp_master_addr", "tp_master_port", "tp_local_ranks", "tp_rendezvous_timeout", "paused")


LOADING_WAIT_S = 180  # how long --connect waits for a server still loading its model (a real one takes 20-40 s)
# how long --connect waits for an address that refuses the connection: `nanovllm serve` started with the
# app opens its port ~6 s later (its imports and set-up; 2-core AMD EPYC), issue 29 trial 7
REFUSED_WAIT_S = 60


def check_connect(parser: argparse.ArgumentParser, args: argparse.Namespace, given: Sequence[str] = (),
                  argv: Sequence[str] | None = ()) -> None:
    """``--connect``: no engine options of our own (``given``: those the command line gives), and a
    server that answers with the right key (else status 2). A server still loading its model is
    waited for (one line says so), at most ``LOADING_WAIT_S`` seconds; so is an address that refuses
    the connection (a server still starting), at most ``REFUSED_WAIT_S`` seconds, then the same
    "cannot reach" line. Another failure to reach it (an unknown host) ends at once."""
    from nanovllm_tui.remote import RemoteError, check_server

    for name in given:
        option = option_as_typed(argv, name)  # as typed: an alias is named as the person wrote it
        if name == "paused":
            tail = ("a server starts paused with `nanovllm serve --paused`; press space in the app to pause the one "
                    "you watch")
        else:
            tail = f"the server chose it when it started; set it there: `nanovllm serve {option}`"
        parser.error(f"{option} cannot be used with --connect: the server runs the engine ({tail})")
    waited_for = []  # what was waited for when Ctrl-C came

    def waiting() -> None:
        waited_for.append("to load its model")
        print(f"{parser.prog}: the server at {args.connect} is loading its model; waiting for it (at most "
              f"{LOADING_WAIT_S} s; Ctrl-C stops)", file=sys.stderr, flush=True)

    def refused() -> None:
        waited_for.append("to open its port")
        print(f"{parser.prog}: nothing answers at {args.connect} yet (connection refused); waiting up to "
              f"{REFUSED_WAIT_S:g} s for a server starting there (Ctrl-C stops)", file=sys.stderr, flush=True)

    try:
        check_server(args.connect, args.api_key, wait_loading_s=LOADING_WAIT_S, on_loading=waiting,
                     wait_refused_s=REFUSED_WAIT_S, on_refused=refused)
    except RemoteError as e:
        parser.error(f"--connect: {e}")
    except KeyboardInterrupt:
        what = f" {waited_for[-1]}" if waited_for else ""
        parser.exit(130, f"{parser.prog}: stopped while waiting for the server at {args.connect}{what}\n")


def build_app(argv: Sequence[str] | None = None):
    """The app as the options describe it (the engine starts loading once the window is up).

    Exits with status 2 and one line on bad options or an unreadable ``--replay`` file.
    """
    from nanovllm_tui.app import NanoVLLMApp
    from nanovllm_tui.widgets.prompt_bar import PromptSettings

    args = parse_args(argv)
    settings = PromptSettings(priority=0, max_tokens=args.max_tokens, temperature=args.temperature,
                              chat=True if args.chat else False if args.raw else None,
                              max_tokens_given=bool(given_options(argv, ("max_tokens",))))
    prompts = list(zip(args.prompt or [], args.priority or [0] * len(args.prompt or [])))
    common = dict(sampling=args.sampling, settings=settings, prompts=prompts, fps=args.fps, freeze_gc=True,
                  record_xray=args.trace_xray,
                  tutorial_path=VISIT_ONLY if os.environ.get(WEB_VISITOR) else getattr(args, "progress_file", None),
                  narrate_steps=narrate_steps(getattr(args, "narrate_steps", None)))
    if args.replay:
        from nanovllm_tui.replay import ReplayController

        return NanoVLLMApp(ReplayController(args.replay_events, start_paused=args.paused), **common)
    if args.connect:
        from nanovllm_tui.remote import RemoteController

        return NanoVLLMApp(RemoteController(args.connect, args.api_key), recorders=open_recorders(args), **common)

    from nanovllm_tui.starter import BackgroundController

    kwargs = engine_kwargs(args)
    if kwargs.get("num_kv_blocks") is None:
        kwargs["num_kv_blocks"] = DEFAULT_KV_BLOCKS

    def start_engine():  # on the starter's thread: torch is imported there, not before the window
        from nanovllm_core.engine.controller import EngineController

        return EngineController(start_paused=args.paused, **kwargs)

    recorders = open_recorders(args)
    return NanoVLLMApp(BackgroundController(start_engine, start_paused=args.paused), recorders=recorders, **common)


def open_recorders(args: argparse.Namespace) -> list:
    """``--trace`` / ``--trace-chrome`` recorders for this session (closed when the app quits).

    The paths were checked by :func:`parse_args`; a file that still cannot be created ends the
    command with status 2 and one line naming its option."""
    from nanovllm_core.cli import TraceFileError, open_trace_file

    recorders = []
    try:
        for option, path in (("--trace", args.trace), ("--trace-chrome", args.trace_chrome)):
            if path:
                recorders.append(open_trace_file(option, path))
    except TraceFileError as e:
        for recorder in recorders:
            recorder.close()
        build_parser().error(str(e))
    return recorders
