"""Command line: ``nanovllm`` / ``python -m nanovllm_core.cli``.

Prints each prompt and its completion; engine and sampling options mirror ``LLM`` and
``SamplingParams``. Bad arguments end with exit status 2 and one line on stderr, never a
traceback. A run that fails at run time ends with status 1 and one line on stderr: a request
that ended with an error (a tensor-parallel worker died, the device failed; the reason is
printed once, after the completions), every prompt rejected, or a trace file that could not be
written. Ctrl-C ends with 130.

Teaching modes (``nanovllm_core.educational``): ``--narrate`` tells each act of inference
with the run's real numbers, ``--xray`` shows the tensors and math inside the layers,
``--dashboard`` draws a live view while generating; they combine. ``--tutorial`` runs the
thirteen chapters and quizzes on their own (``--no-demos`` never loads the model).

``nanovllm worker`` runs one tensor-parallel rank for a rank 0 on another host
(:func:`worker_main`; ``engine/tensor_parallel.py`` describes the launch).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from nanovllm_core.cli_args import (  # noqa: F401  (re-exported: the app, benchmarks and tests import them from here)
    decimal,
    QUANTIZATION_CHOICES,
    _Parser,
    add_engine_arguments,
    add_model_arguments,
    ascii_int,
    bounded_int,
    check_output_paths,
    contiguous_problem,
    output_file_error,
    count_int,
    engine_kwargs,
    load_progress,
    non_negative_int,
    positive_float,
    model_name,
    positive_int,
    priorities_problem,
    priority_int,
    prompt_text,
    sampling_decimal,
    sampling_params,
    seed_int,
    stop_text,
    tcp_port,
)

DEFAULT_PROMPT = "The capital of France is"


_non_negative_int = non_negative_int  # ASCII digits, as every other number option (trial 12b)


def _chapter_number(text: str) -> int:
    from nanovllm_core.educational.tutorial import CHAPTERS  # the text only: no torch, no model

    last = len(CHAPTERS)
    try:
        value = ascii_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a chapter number 1-{last}, got {text!r}") from None
    if not 1 <= value <= last:
        raise argparse.ArgumentTypeError(f"expected a chapter number 1-{last}, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nanovllm", description="Generate with the nano-vLLM engine on a LLaMA-family model. "
                "`nanovllm serve --help`: the OpenAI-compatible HTTP server.")
    add_model_arguments(p)
    g = p.add_argument_group("prompts and sampling")
    g.add_argument("--prompt", action="append", default=None, type=prompt_text,
                   help=f"a prompt (repeat for several; default: {DEFAULT_PROMPT!r})")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--max-tokens", type=count_int(1), default=50, help="tokens to generate per prompt (default 50)")
    g.add_argument("--temperature", type=sampling_decimal("temperature"), default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=count_int(-1), default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=sampling_decimal("top_p"), default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--min-p", type=sampling_decimal("min_p"), default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--repetition-penalty", type=sampling_decimal("repetition_penalty"), default=1.0)
    g.add_argument("--seed", type=seed_int, default=None, help="per-request random seed")
    g.add_argument("--stop", action="append", default=None, type=stop_text, help="a stop string (repeatable)")
    g.add_argument("--logprobs", type=bounded_int(0, 20), default=None, metavar="N", help="show the top-N log-probabilities per token")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    e = add_engine_arguments(p)
    e.add_argument("--priority", type=priority_int, action="append", default=None,
                   help="priority of each --prompt, in order: a higher value runs first (vLLM's priority is the "
                        "opposite: lower values first)")
    e.add_argument("--show-memory-stats", action="store_true", help="print KV block usage, waste, hit rate, preemptions")
    teach = p.add_argument_group("teaching modes")
    teach.add_argument("--narrate", action="store_true",
                       help="explain each act of inference (tokens, prefill, decode, KV cache, scheduler) with real values")
    teach.add_argument("--narrate-steps", type=_non_negative_int, default=None, metavar="N",
                       help="sampled tokens narrated one by one per prompt (its n samples together), the first "
                            "(from the prefill) included; the rest are summed up (0 = all; default 10)")
    teach.add_argument("--xray", action="store_true",
                       help="show tensor shapes and the math of every layer for each prompt's prefill and first decode")
    teach.add_argument("--dashboard", action="store_true",
                       help="a live view while generating (a final snapshot when output is not a terminal)")
    teach.add_argument("--tutorial", action="store_true",
                       help="thirteen chapters with quizzes (A-D); answers are read line by line from a pipe")
    teach.add_argument("--no-demos", action="store_true",
                       help="tutorial without live demonstrations (the model is not loaded)")
    teach.add_argument("--tutorial-chapter", type=_chapter_number, default=None, metavar="N",
                       help="start the tutorial at chapter N (1-13; default: where you stopped last time)")
    teach.add_argument("--progress-file", default=None, metavar="FILE.json",
                       help="where tutorial progress is kept (default: ~/.cache/nanovllm/tutorial_progress.json)")
    t = p.add_argument_group("traces")
    t.add_argument("--trace", metavar="FILE.jsonl", default=None,
                   help="record every engine event as JSON lines (replay with nanovllm-tui --replay)")
    t.add_argument("--trace-xray", action="store_true",
                   help="with --trace: also record X-Ray layer traces of each step (large: ~156 KB a step for the default model)")
    t.add_argument("--trace-chrome", metavar="FILE.json", default=None,
                   help="write a Chrome trace-event file (open in ui.perfetto.dev or chrome://tracing)")
    return p


# What --tutorial reads besides its own options: the model its demonstrations load (run_tutorial).
_TUTORIAL_USES = {"tutorial", "no_demos", "tutorial_chapter", "progress_file", "model", "device", "dtype",
                  "quantization", "narrate", "xray", "dashboard", "help"}


def _ignored_by_tutorial(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The options given (a value other than their default) that ``--tutorial`` would not use."""
    return [a.option_strings[0] for a in parser._actions
            if a.option_strings and a.dest not in _TUTORIAL_USES and getattr(args, a.dest, None) != a.default]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # vLLM's spelling: `vllm serve`
        from nanovllm_core.entrypoints.cli import main as serve

        return serve(argv[1:])
    if argv[:1] == ["worker"]:  # one tensor-parallel rank joining a rank 0 elsewhere, as torchrun's workers do
        return worker_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tutorial:
        if args.narrate or args.xray or args.dashboard:
            parser.error("--tutorial runs on its own; leave out --narrate, --xray and --dashboard")
        ignored = _ignored_by_tutorial(parser, args)
        if ignored:  # trial 18b: --prompt, --max-tokens, --trace ... were accepted and did nothing
            parser.error(f"--tutorial runs its own demonstrations and uses only the model options (--model, --device, "
                         f"--dtype, --quantization); leave out {', '.join(ignored)}")
        check_output_paths(parser, ("--progress-file", args.progress_file), make_folders=("--progress-file",))
        return run_tutorial(args, parser)
    # The tutorial's own options do nothing without it: say so rather than ignore them (trial 16d #9)
    alone = [o for o, v in (("--progress-file", args.progress_file), ("--tutorial-chapter", args.tutorial_chapter),
                            ("--no-demos", args.no_demos)) if v not in (None, False)]
    if alone:
        parser.error(f"{' and '.join(alone)} {'apply' if len(alone) > 1 else 'applies'} only with --tutorial; "
                     "add --tutorial or leave it out")
    prompts = args.prompt or [DEFAULT_PROMPT]
    if any(p == "" for p in prompts):  # only spaces is a prompt: it tokenizes to tokens, as vLLM takes it
        parser.error("--prompt must not be empty")
    if args.priority is not None and len(args.priority) != len(prompts):
        parser.error(f"got {len(args.priority)} --priority values for {len(prompts)} --prompt values; give one per prompt")
    if contiguous_problem(args):  # a setting the contiguous baseline would ignore
        parser.error(contiguous_problem(args))
    if priorities_problem(args.priority, args.scheduling_policy):  # the engine's rule: fcfs takes priority 0 only
        parser.error(priorities_problem(args.priority, args.scheduling_policy))
    if args.max_model_len is not None and args.max_tokens >= args.max_model_len:  # before loading: no prompt fits
        parser.error(f"--max-tokens {args.max_tokens} leaves no room for a prompt in --max-model-len "
                     f"{args.max_model_len} (prompt plus output must fit, as the server requires); "
                     "lower --max-tokens or raise --max-model-len (up to the model's context)")
    if args.trace_xray and not args.trace:
        parser.error("--trace-xray records into the --trace file; add --trace FILE.jsonl")
    if args.narrate_steps is not None and not args.narrate:  # it did nothing, silently (trial 43d)
        parser.error("--narrate-steps applies only with --narrate; add --narrate or leave it out")
    check_output_paths(parser, ("--trace", args.trace), ("--trace-chrome", args.trace_chrome))  # before the load
    try:
        params = sampling_params(args)
    except ValueError as e:
        parser.error(str(e))

    if sys.stderr.isatty():  # importing PyTorch alone takes seconds: say what is happening
        print(f"nanovllm: loading {args.model or 'the embedded default model'}...", file=sys.stderr, flush=True)
    from nanovllm_core.engine.tensor_parallel import TensorParallelError
    from nanovllm_core.llm import LLM
    from nanovllm_core.model.loader import ModelLoadError

    try:
        llm = LLM(**engine_kwargs(args), progress=load_progress("nanovllm"))
    except (ModelLoadError, ValueError, TensorParallelError) as e:
        parser.error(str(e))
    try:
        return _generate(llm, args, parser, prompts, params)
    finally:
        llm.close()  # tensor-parallel workers: stopped and joined before the command returns


def _env_default(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def build_worker_parser() -> argparse.ArgumentParser:
    """``nanovllm worker``: torchrun's ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK`` stand in for the options they name."""
    p = _Parser(prog="nanovllm worker",
                description="Run one tensor-parallel rank (1..N-1) for a rank 0 on another host, which was started "
                            "with --tensor-parallel-size N --tp-master-addr ADDR --tp-master-port PORT "
                            "--tp-local-ranks K. The dtype, context length and device type are rank 0's.")
    p.add_argument("--master-addr", default=_env_default("MASTER_ADDR"), metavar="ADDR",
                   help="rank 0's host name or IP address (default: $MASTER_ADDR)")
    p.add_argument("--master-port", type=tcp_port, default=_env_default("MASTER_PORT"), metavar="PORT",
                   help="rank 0's --tp-master-port (default: $MASTER_PORT)")
    p.add_argument("--rank", type=_non_negative_int, default=_env_default("RANK"), metavar="R",
                   help="this worker's rank, K..N-1 (default: $RANK)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=_env_default("WORLD_SIZE"), metavar="N",
                   help="rank 0's --tensor-parallel-size (default: $WORLD_SIZE)")
    p.add_argument("--model", type=model_name, default=None,
                   help="this host's copy of rank 0's model (repo id, folder or .gguf; its config must match rank "
                        "0's); default: rank 0's path, read from a shared disk")
    p.add_argument("--local-rank", type=_non_negative_int, default=_env_default("LOCAL_RANK"), metavar="I",
                   help="CUDA only: this worker's GPU on its host (default: $LOCAL_RANK or 0)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--rendezvous-timeout", type=positive_float, default=300.0, metavar="S",
                   help="seconds to keep trying to reach rank 0 and to wait for its answer (default 300)")
    return p


def worker_main(argv: Sequence[str]) -> int:
    """``nanovllm worker``: join rank 0, serve its steps until it stops (exit 0) or goes away (exit 1).

    A wrong rank or size, an unreachable rank 0 (after ``--rendezvous-timeout``), another key, or a
    refusal by rank 0 (another world size or model, a rank taken) ends with one line and status 2.
    """
    parser = build_worker_parser()
    args = parser.parse_args(list(argv))
    for dest, flag, env in (("master_addr", "--master-addr", "MASTER_ADDR"), ("master_port", "--master-port", "MASTER_PORT"),
                            ("rank", "--rank", "RANK"), ("tensor_parallel_size", "--tensor-parallel-size", "WORLD_SIZE")):
        if getattr(args, dest) is None:
            parser.error(f"{flag} is required (or set {env}): the worker must know where rank 0 is and which rank it is")
    from nanovllm_core.engine.tensor_parallel import run_worker
    from nanovllm_core.engine.tp_launch import TensorParallelError, WorkerOptions, check_worker_rank
    from nanovllm_core.model.loader import ModelLoadError

    try:
        check_worker_rank(args.rank, args.tensor_parallel_size)
    except ValueError as e:
        parser.error(str(e))
    opts = WorkerOptions(args.rank, args.tensor_parallel_size, args.master_addr, args.master_port, model=args.model,
                         local_rank=args.local_rank, threads=args.threads, rendezvous_timeout_s=args.rendezvous_timeout)
    print(f"nanovllm worker: rank {args.rank} of {args.tensor_parallel_size} joining rank 0 at "
          f"{args.master_addr}:{args.master_port}", file=sys.stderr, flush=True)
    try:
        code, why = run_worker(opts)
    except (ValueError, TensorParallelError, ModelLoadError) as e:
        parser.error(str(e))
    print(f"nanovllm worker: rank {args.rank}: {why}", file=sys.stderr, flush=True)
    return code


def check_max_tokens(llm, args: argparse.Namespace, parser: argparse.ArgumentParser, inputs: list,
                     params=None) -> None:
    """Refuse (argparse's one line, status 2) a ``--max-tokens`` that does not fit after a prompt in the
    context, as the server's ``check_length`` does (vLLM's rule), rather than stop short of it unasked;
    and a prompt the KV pool could never hold with ``params`` (``--num-kv-blocks``), in the words
    ``nanovllm-tui`` ends with for its ``--prompt`` (trial 36e: here it was several lines and status 1).

    A prompt that alone fills the context is left to the engine, which rejects it and says so.
    """
    from nanovllm_core.sampling_params import max_tokens_overflow, pool_with_options

    limit = llm.engine.max_model_len
    for i, text in enumerate(inputs):
        try:
            _, ids = llm.engine.encode_prompt(text)
        except ValueError:
            continue  # the engine rejects it with its reason
        why = max_tokens_overflow(len(ids), args.max_tokens, limit, option="--max-tokens",
                                  prompt=f"prompt {i + 1} has" if len(inputs) > 1 else "the prompt has",
                                  fix="lower --max-tokens or raise --max-model-len",
                                  model_context=llm.engine.model_config.max_position_embeddings,
                                  fix_full="lower --max-tokens (--max-model-len is already the model's whole context)")
        if why is not None:
            parser.error(why)
        problem = llm.engine.request_problem(ids, params) if params is not None else None
        if problem is not None and "the pool has only" in problem[1]:  # a pool too small for it, whatever runs
            which = f"--prompt {i + 1}" if len(inputs) > 1 else "--prompt"
            parser.error(f"{which} was refused: {pool_with_options(problem[1])}")


def _generate(llm, args: argparse.Namespace, parser: argparse.ArgumentParser, prompts: list[str], params) -> int:
    """Run ``prompts`` on ``llm`` and print the completions (``main``'s second half)."""
    from nanovllm_core.educational.commentary import ms, plural
    from nanovllm_core.outputs import error_summary

    try:
        recorders = open_trace_recorders(llm, args)
    except TraceFileError as e:
        parser.error(str(e))
    conversations = [[{"role": "user", "content": p}] for p in prompts] if args.chat else None
    inputs = [llm.apply_chat_template(c) for c in conversations] if conversations else prompts
    check_max_tokens(llm, args, parser, inputs, params if not isinstance(params, list) else None)
    views = attach_teaching_views(llm, args)
    start = time.perf_counter()
    outputs = None
    try:
        # the conversations too: the narrator tells each prompt as the message put through the template (24d #2)
        outputs = llm.generate(inputs, params, priority=args.priority, use_tqdm=views is None,
                               reject_bad_prompts=True, conversations=conversations)  # each bad prompt reported as rejected; the others run
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    finally:
        if views is not None:
            views.close()
        written = close_trace_recorders(recorders)
    if outputs is None:
        return 130
    elapsed = time.perf_counter() - start
    tok = llm.tokenizer
    for prompt, out in zip(prompts, outputs):
        shown = prompt if len(prompt) <= 300 else f"{prompt[:300]}... ({len(prompt):,} characters)"
        print(f"Prompt: {shown!r}")
        for c in out.outputs:
            if c.finish_reason == "rejected":
                print(f"  rejected: {out.error}")
                continue
            print(f"Completion: {c.text!r}")
            ttft = out.metrics.time_to_first_token
            print(f"  [{plural(len(c.token_ids), 'token')}, finish_reason={c.finish_reason}"
                  + (f", stop_reason={c.stop_reason!r}" if c.stop_reason is not None else "")
                  + (f", TTFT {ms(ttft)}" if ttft is not None else "") + "]")
            if c.logprobs:
                for token_id, entry in zip(c.token_ids, c.logprobs):
                    cands = ", ".join(f"{tok.decode([t])!r} {lp.logprob:.2f}"
                                      for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank))
                    print(f"    {tok.decode([token_id])!r}: {cands}")
        print()
    total = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    info = llm.engine.model_info()
    # Wall time around generate(): tokenizing, adding the requests, every step, detokenizing and any
    # teaching view's printing; the dashboard's Overall counts engine steps only, so it is shorter.
    included = "tokenizing, detokenizing" + (" and the teaching views' output" if views is not None else "")
    print(f"{len(outputs)} prompt(s), {plural(total, 'token')} in {elapsed:.2f} s of wall time "
          f"({total / max(elapsed, 1e-9):.1f} tokens/s, {included} included) "
          f"on {llm.engine.device.type}, {str(llm.engine.dtype).replace('torch.', '')}"
          + f", {llm.engine.model.quantization or 'float'} weights ("
          + ("rank 0's shard: " if info.get("tensor_parallel_size", 1) > 1 else "") + f"{info['weight_format']})"
          + f", model {llm.engine.model_name}"
          + (f", tensor parallel over {info['tensor_parallel_size']} ranks ({info['tensor_parallel_backend']})"
             if info.get("tensor_parallel_size", 1) > 1 else ""))
    for key, what in (("block_native_unavailable", "block-quantized layers dequantize and run PyTorch's matmul, not "
                                                   "the C kernels (slower, and rows depend on their batch)"),
                      ("quantization_note", "weights"),
                      ("cpu_paged_unavailable", "the CPU paged attention kernel is not used (K/V are gathered for SDPA)"),
                      ("native_ops_unavailable", "RMSNorm and RoPE run as PyTorch ops, not in C")):
        if llm.engine.device.type == "cpu" and info.get(key):
            print(f"note: {what}: {info[key]}")
    stats = llm.stats()
    if args.show_memory_stats:
        print_memory_stats(stats)
    elif stats.get("spec_proposer"):  # how the drafts fared, also without the memory stats (trial 39a: a
        print(speculative_summary(stats))  # run with drafts said nothing of them)
    failed = error_summary(outputs)
    if failed is not None:  # the completions above were cut short: say why once, and fail the command
        print(f"nanovllm: error: {failed}", file=sys.stderr, flush=True)
        return 1
    if all(c.finish_reason == "rejected" for o in outputs for c in o.outputs):
        print("nanovllm: every prompt was rejected (reasons above)", file=sys.stderr)
        return 1
    return 0 if written else 1  # the completions are shown; the trace's failure was said when it closed


def teaching_console():
    """The Rich console every teaching view prints through (one, so live output and prints interleave cleanly)."""
    from rich.console import Console

    return Console(highlight=False)


NARRATE_STEPS = 10  # --narrate-steps when not given


def narrate_steps(given: int | None) -> int | None:
    """The narrator's cap from ``--narrate-steps``: ``NARRATE_STEPS`` when not given, None (every token) for 0."""
    return NARRATE_STEPS if given is None else given or None


def attach_teaching_views(llm, args: argparse.Namespace):
    """Subscribe the ``--narrate`` / ``--xray`` / ``--dashboard`` views; None when none was asked for."""
    if not (args.narrate or args.xray or args.dashboard):
        return None
    from nanovllm_core.educational.teaching import TeachingViews

    return TeachingViews.attach(llm.engine, teaching_console(), narrate=args.narrate, xray=args.xray,
                                dashboard=args.dashboard,
                                narrate_steps=narrate_steps(args.narrate_steps))


def run_tutorial(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--tutorial``: chapters and quizzes; demonstrations on the model unless ``--no-demos``."""
    from pathlib import Path

    from nanovllm_core.educational.tutorial_demos import EngineDemos
    from nanovllm_core.educational.tutorial_view import run_tutorial as run
    from nanovllm_core.model.loader import ModelLoadError

    console = teaching_console()
    demos, info = None, None
    if not args.no_demos:
        console.print("Loading the model for the live demonstrations (--no-demos skips them)...", style="dim")
        demos = EngineDemos(args.model, args.device, args.dtype, args.quantization)
        try:
            info = demos.load()
        except (ModelLoadError, ValueError) as e:
            console.print(f"No live demonstrations: {e}", style="yellow", markup=False)
            demos = None
    start = args.tutorial_chapter - 1 if args.tutorial_chapter else None
    path = Path(args.progress_file) if args.progress_file else None
    try:
        run(console, sys.stdin, progress_path=path, start=start, demo_runner=demos, model_info=info)
    except KeyboardInterrupt:
        console.print("\ninterrupted")
        return 130
    return 0


class TraceFileError(ValueError):
    """A ``--trace`` / ``--trace-chrome`` file that could not be created; the message is one line
    naming the option and what to do (:func:`cli_args.output_file_error`)."""


def open_trace_file(option: str, path: str):
    """The recorder of ``option`` (``--trace``: JSON lines; ``--trace-chrome``: Chrome's format) writing
    ``path``. Raises :class:`TraceFileError` when the file cannot be created (the paths are checked
    before the model loads, so only a file that changed since gets here)."""
    from nanovllm_core.tracing import ChromeTraceRecorder, JsonlTraceWriter

    try:
        return (JsonlTraceWriter if option == "--trace" else ChromeTraceRecorder)(path)
    except OSError as e:
        raise TraceFileError(output_file_error(option, path, e)) from None


def open_trace_recorders(llm, args: argparse.Namespace) -> list:
    """Subscribe the ``--trace`` / ``--trace-chrome`` recorders to the engine; returns them (close when done).

    Raises:
        TraceFileError: a trace file cannot be created (its message names the option).
    """
    from nanovllm_core.engine.controller import EngineController

    recorders = []
    if args.trace:
        writer = open_trace_file("--trace", args.trace)
        writer(EngineController.ready_event(llm.engine))  # a replay needs the model's facts first
        llm.engine.subscribe(writer, topk=5, blocks=True, xray=args.trace_xray)
        recorders.append(writer)
    if args.trace_chrome:
        chrome = open_trace_file("--trace-chrome", args.trace_chrome)
        llm.engine.subscribe(chrome, topk=0, blocks=False)
        recorders.append(chrome)
    return recorders


def close_trace_recorders(recorders: list, prog: str = "nanovllm") -> bool:
    """Close the recorders of :func:`open_trace_recorders`; say on stderr, one line each, a recording
    that ends early (Ctrl-C inside a step: ``_Recording.ended_early``) or could not be written.
    Returns False when one could not be written (the command then ends with status 1)."""
    written = True
    for r in recorders:
        try:
            r.close()
        except OSError as e:
            written = False
            print(f"{prog}: the trace {r.path} could not be written: {e}", file=sys.stderr, flush=True)
            continue
        ended = r.ended_early()
        if ended:
            print(f"{prog}: {ended}", file=sys.stderr, flush=True)
    return written


def print_memory_stats(stats: dict) -> None:
    from nanovllm_core.educational.commentary import human_bytes, plural
    from nanovllm_core.educational.tp_facts import across_ranks

    # the narrator's byte format: a 540 KiB pool is not "1 MiB in all" (trial 10)
    print("KV cache memory:")
    n = stats.get("tensor_parallel_size", 1) or 1
    if n > 1:  # the engine's byte figures are whole-pool totals; each rank holds its KV heads' slice
        print(f"  blocks: {stats['kv_blocks_total']} x {stats['block_size']} tokens ({human_bytes(stats['kv_bytes_per_block'])} "
              f"a block{across_ranks(stats['kv_bytes_per_block'], n, human_bytes)}; "
              f"{human_bytes(stats['kv_bytes_total'])} in all{across_ranks(stats['kv_bytes_total'], n, human_bytes)})")
    else:
        print(f"  blocks: {stats['kv_blocks_total']} x {stats['block_size']} tokens ({human_bytes(stats['kv_bytes_per_block'])} "
              f"each, {human_bytes(stats['kv_bytes_total'])} in all)")
    print(f"  in use now: {stats['kv_blocks_used']}, cached-free: {stats['kv_blocks_cached']}, "
          f"free: {stats['kv_blocks_free']}")
    peak = stats.get("kv_slots_wasted_peak", 0)
    print(f"  slots allocated but unfilled: {stats['kv_slots_wasted']} now" +
          (f", at most {peak} (at the end of step {stats['kv_slots_wasted_peak_step']})" if peak else ""))
    if stats.get("prefix_caching") is False:  # nothing is looked up (trial 10: "0 of 22 tokens looked up hit")
        print("  prefix cache: off (--no-prefix-caching, or a backend without paged blocks): nothing is looked up")
    else:
        print(f"  prefix cache: {stats['prefix_cache_hits']} of {plural(stats['prefix_cache_queries'], 'token')} looked "
              "up hit (prompts, and tokens re-admitted after a preemption) "
              f"({stats['prefix_cache_hit_rate']:.1%})")
    print(f"  preemptions: {stats['num_preemptions']}, steps: {stats['steps']}")
    if stats.get("spec_proposer"):
        print(f"  {speculative_summary(stats)}")


def speculative_summary(stats: dict) -> str:
    """One line on the run's drafts from ``LLM.stats()``: accepted of drafted, the acceptance rate and the mean
    tokens a verification kept (Leviathan et al. 2023's figures)."""
    return (f"speculative ({stats['spec_proposer']}, k={stats['spec_num_speculative_tokens']}): "
            f"{stats['spec_accepted_tokens']} of {stats['spec_draft_tokens']} draft tokens accepted "
            f"({stats['spec_acceptance_rate']:.1%}), {stats['spec_mean_accepted_length']:.2f} tokens per verification")


if __name__ == "__main__":
    sys.exit(main())
