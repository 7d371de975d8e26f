"""Command-line pieces both CLIs share: ``nanovllm`` (``cli.py``) and ``nanovllm serve``
(``entrypoints/cli.py``), and the app's options (``nanovllm_tui/options.py``).

Below both CLIs, so neither imports the other for them: argument types that fail with
argparse's one-line usage error (status 2), the model and engine option groups, and the
translation of parsed options into ``LLM(...)`` keyword arguments and ``SamplingParams``.
Imports only the standard library and `nanovllm_core.prompts` (standard library only) at import
time (torch waits until an engine is built).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

from nanovllm_core import untrusted
from nanovllm_core.prompts import unicode_problem


# model.quantization.QUANTIZATION_CHOICES, written out: parsing options must not import torch (a test holds them equal)
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "q8_0", "q4_0", "q4_1")
# config.INT8_REMOVED, written out for the same reason (a test holds them equal)
INT8_REMOVED = ("quantization int8 was removed; use q8_0 (int8 weights in 32-weight blocks, each block with its "
                "own scale), which is faster and closer to float32")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


# Numbers on the command line are written in ASCII: int() and float() also take '٥', '０８' and
# '1_0' (issue 29, trial 6). The app's prompt bar uses the same two patterns.
WHOLE = re.compile(r"[+-]?[0-9]+", re.ASCII)
DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def ascii_int(text: str) -> int:
    """``int(text)`` for a whole number in ASCII digits (spaces around it ignored). Raises ValueError otherwise."""
    if not WHOLE.fullmatch(text.strip()):
        raise ValueError(f"not a whole number in ASCII digits: {text!r}")
    return int(text.strip())


def ascii_float(text: str) -> float:
    """``float(text)`` for a decimal number in ASCII digits (``inf``, ``nan`` and ``1_0`` refused). Raises ValueError otherwise."""
    if not DECIMAL.fullmatch(text.strip()):
        raise ValueError(f"not a decimal number in ASCII digits: {text!r}")
    return float(text.strip())


def decimal(text: str) -> float:
    """argparse ``type``: a decimal number in ASCII digits (sampling settings; their ranges are
    checked by ``SamplingParams``).

    Raises:
        argparse.ArgumentTypeError: anything else (``inf``, ``nan``, ``٥``, ``1_0``).
    """
    try:
        return ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a decimal number in ASCII digits, got {text!r}") from None


def sampling_decimal(field: str):
    """argparse ``type`` for a decimal sampling setting (``--temperature``, ``--top-p``, ...): a decimal
    number in ASCII digits within ``SamplingParams``' range for ``field``.

    Checked here, not after parsing, so a bad value is argparse's one line naming the option and the
    text typed (``argument --temperature: must be a finite number >= 0 (0 means greedy), got '-1'``):
    ``SamplingParams`` would name its field and the parsed number (``temperature=inf`` for ``1e400``).
    Text that is no number (``nan``, ``inf``, ``٥``) gets the same range (trial 14d: it said only
    "expected a decimal number in ASCII digits").

    Raises:
        argparse.ArgumentTypeError: not such a number, or outside the field's range.
    """

    def rule(value: float) -> str | None:
        """The field's range in ``SamplingParams``' words when ``value`` breaks it, else None."""
        from nanovllm_core.sampling_params import SamplingParams

        try:
            SamplingParams(**{field: value})
        except ValueError as e:
            return str(e).split(" is invalid: ", 1)[-1]
        return None

    def parse(text: str) -> float:
        try:
            value = ascii_float(text)
        except ValueError:  # NaN breaks every range: its rule is the field's range
            raise argparse.ArgumentTypeError(f"{rule(math.nan)}, written in ASCII digits, got {text!r}") from None
        problem = rule(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{problem}, got {text!r}")
        return value

    parse.__name__ = field  # argparse names a type by it in its own messages
    return parse


def stop_text(text: str) -> str:
    """argparse ``type`` for ``--stop``: a non-empty stop string of valid UTF-8 (``SamplingParams``'
    rule; a byte that is not UTF-8 could never match a decoded text).

    Raises:
        argparse.ArgumentTypeError: an empty string, or one ``prompt_text`` refuses.
    """
    if not text:
        raise argparse.ArgumentTypeError(f"a stop string must not be empty, got {text!r}")
    return prompt_text(text)


def model_name(text: str) -> str:
    """argparse ``type`` for ``--model`` and its kin: a repo id, folder or ``.gguf`` file, never empty
    (``--model ""`` used to load the embedded default without a word, issue 29, trial 12).

    Raises:
        argparse.ArgumentTypeError: an empty or blank name, or text that is not valid UTF-8.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"a model name must not be empty, got {text!r}; leave the option out for "
                                         "the embedded default model")
    return prompt_text(text)


def tcp_port(text: str) -> int:
    """argparse ``type``: a TCP port, 1..65535; anything else becomes argparse's one-line usage error.

    Raises:
        argparse.ArgumentTypeError: not an integer, or outside 1..65535.
    """
    try:
        value = ascii_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a TCP port is a whole number from 1 to 65535, got {text!r}") from None
    if not 1 <= value <= 65535:  # one message for both ends (trial 12b: -1 said "expected a positive integer")
        shown = str(value) if len(str(value)) <= 40 else str(value)[:37] + "..."
        raise argparse.ArgumentTypeError(f"a TCP port is 1 to 65535, got {shown}")
    return value


def served_name(text: str) -> str:
    """argparse ``type`` of ``--served-model-name``: a name clients can send as ``model``.

    Raises:
        argparse.ArgumentTypeError: an empty (or blank) name, which served the model's own name silently.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"the name clients send as model must not be empty, got {text!r}; "
                                         "leave the option out to serve under the model's own name")
    return prompt_text(text)  # bytes that are not UTF-8 could never be sent back in a JSON answer


def non_negative_int(text: str) -> int:
    """argparse ``type``: an integer from 0 up, in ASCII digits.

    Raises:
        argparse.ArgumentTypeError: not a whole number in ASCII digits, or below 0 (one message for both).
    """
    return _whole(text, 0, None, "an integer >= 0")


def screen_rate(text: str) -> float:
    """argparse ``type`` of the app's ``--fps``: 1 to 60 screen updates per second.

    Raises:
        argparse.ArgumentTypeError: not a number in ASCII digits, or outside 1..60 (one message for all).
    """
    try:
        value = ascii_float(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= 60:  # NaN fails the comparison too
        raise argparse.ArgumentTypeError(f"must be between 1 and 60 (screen updates per second), got {text!r}")
    return value


def text_list(text: str) -> list[str]:
    """argparse ``type`` of ``nanovllm serve``'s CORS lists: a JSON list of strings, as vLLM's
    ``--allowed-origins '["http://localhost:3000"]'`` takes it, or the same comma-separated
    (``http://localhost:3000,http://x``).

    A JSON ``[]`` is an empty list, as vLLM reads it (``--allowed-origins '[]'``: no page on another
    origin may call the server); an empty comma-separated text is refused (a value left out by mistake).

    Raises:
        argparse.ArgumentTypeError: JSON that is not a list of non-empty strings, or an empty text.
    """
    if text.lstrip().startswith(("[", "{")):
        try:
            value = untrusted.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
        if not value:  # trial 45b: vLLM takes '[]'
            return []
    else:
        value = text.split(",")
    value = [v.strip() for v in value]
    if not value or not all(value):
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated values (or a JSON list), got {text!r}")
    return value


ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s?#]+")  # scheme://host[:port], as a browser sends Origin


DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def origin_list(text: str) -> list[str]:
    """argparse ``type`` of ``--allowed-origins``: :func:`text_list` whose items are ``*`` or origins
    (``scheme://host[:port]``, no path), as a browser's ``Origin`` header names a page's origin.

    Each origin is written as a browser sends it (RFC 6454 section 6.1: scheme and host in lower
    case, no port where it is the scheme's default), since CORS compares the texts: ``HTTP://A.B:80``
    is kept as ``http://a.b``, where it would never have matched (trial 45b).

    Raises:
        argparse.ArgumentTypeError: what :func:`text_list` refuses, or an item that is no origin
            (a path, user info, a port that is not 1 to 65535).
    """
    origins = text_list(text)
    out = []
    for o in origins:
        origin = o if o == "*" else _browser_origin(o) if ORIGIN.fullmatch(o) else None
        if origin is None:
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin: give '*' or scheme://host[:port] such as "
                                             "http://localhost:3000, in a JSON list or comma-separated")
        out.append(origin)
    return out


def _browser_origin(text: str) -> str | None:
    """``scheme://host[:port]`` as a browser serializes it (lower case, no default port), or None when it
    is no origin (user info, an empty host, a port that is not a number from 1 to 65535)."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname
    if not host or "@" in parts.netloc or port == 0:
        return None
    scheme = parts.scheme.lower()
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}" + (f":{port}" if port is not None and port != DEFAULT_PORTS.get(scheme) else "")


def api_key(text: str) -> str | None:
    """``--api-key``: the key, or None for an empty one (no key, as an empty ``$NANOVLLM_API_KEY``
    already means): a server that required the empty key would refuse every client that sends one."""
    return text or None


def api_key_default() -> str | None:
    """``$NANOVLLM_API_KEY``, None when unset or empty."""
    return os.environ.get("NANOVLLM_API_KEY") or None


def _whole(text: str, least: int, most: int | None, noun: str) -> int:
    """``text`` (ASCII digits) as an integer from ``least`` to ``most`` (None: no top), or argparse's
    one-line error naming ``noun`` ("a positive integer")."""
    try:
        value = ascii_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {noun}, got {value}")
    if most is not None and value > most:
        shown = str(value) if len(str(value)) <= 40 else str(value)[:37] + "..."
        raise argparse.ArgumentTypeError(f"expected {noun} up to {most}, got {shown}")
    return value


def positive_int(text: str) -> int:
    """argparse ``type``: an integer from 1 to 2**31 - 1 (``COUNT_MAX``: every engine count fits 32 bits);
    anything else becomes argparse's one-line usage error (status 2).

    Raises:
        argparse.ArgumentTypeError: not an integer, below 1, or above 2**31 - 1.
    """
    from nanovllm_core.sampling_params import COUNT_MAX

    return _whole(text, 1, COUNT_MAX, "a positive integer")


def positive_bytes(text: str) -> int:
    """argparse ``type``: a number of bytes from 1 to 2**63 - 1 (``BYTES_MAX``: a byte count needs 64 bits,
    unlike the counts :func:`positive_int` takes).

    Raises:
        argparse.ArgumentTypeError: not an integer, below 1, or above 2**63 - 1.
    """
    from nanovllm_core.sampling_params import BYTES_MAX

    return _whole(text, 1, BYTES_MAX, "a positive number of bytes")


def positive_float(text: str) -> float:
    """argparse ``type``: a finite number above 0 (seconds); anything else becomes argparse's one-line usage error.

    Raises:
        argparse.ArgumentTypeError: not a number, not finite, or not above 0.
    """
    try:
        value = ascii_float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:  # one message for all, the range in each (trial 14d)
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, in ASCII digits, got {text!r}")
    return value


def seed_int(text: str) -> int:
    """argparse ``type``: a random seed, a 64-bit signed integer (what torch's generators take).

    Raises:
        argparse.ArgumentTypeError: not an integer, or outside -2**63 .. 2**63 - 1.
    """
    from nanovllm_core.sampling_params import SEED_MAX, SEED_MIN

    rule = f"a seed is a 64-bit integer ({SEED_MIN} to {SEED_MAX})"
    try:
        value = ascii_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{rule} in ASCII digits, got {text!r}") from None
    if not SEED_MIN <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{rule}, got {value}")
    return value


def quantization_name(text: str) -> str:
    """argparse ``type`` of ``--quantization``: the name in lower case (``choices`` then checks it).

    Raises:
        argparse.ArgumentTypeError: ``int8``, a mode this engine had: :data:`INT8_REMOVED` (q8_0 replaces it).
    """
    name = text.lower()
    if name == "int8":
        raise argparse.ArgumentTypeError(INT8_REMOVED)
    return name


def bounded_int(low: int, high: int, what: str = "") :
    """An argparse ``type``: an integer in ``[low, high]`` (``sampling_params.check_int``'s rule);
    anything else becomes argparse's one-line usage error (status 2). ``what`` names the meaning."""

    def parse(text: str) -> int:
        try:
            value = ascii_int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}, got {text!r}") from None
        if not low <= value <= high:
            shown = str(value) if len(str(value)) <= 40 else str(value)[:37] + "..."
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}"
                                             f"{' (' + what + ')' if what else ''}, got {shown}")
        return value

    return parse


CLI_FCFS_FIX = "use --scheduling-policy priority or --priority 0"


def priorities_problem(priorities: list[int] | None, policy: str | None) -> str | None:
    """Why the engine's ``policy`` (``--scheduling-policy``) refuses one of ``priorities`` (``--priority``),
    as one line, by the engine's own rule (``sampling_params.check_priority``: under ``fcfs`` only 0,
    as vLLM); None when it takes them all. Shared by ``nanovllm`` and ``nanovllm-tui``."""
    from nanovllm_core.sampling_params import check_priority

    for priority in priorities or ():
        try:
            check_priority(priority, "--priority", policy=policy, fix=CLI_FCFS_FIX)
        except ValueError as e:
            return str(e)
    return None


def priority_int(text: str) -> int:
    """argparse ``type``: a request priority, -1000 to 1000 (``PRIORITY_MIN``..``PRIORITY_MAX``).

    Raises:
        argparse.ArgumentTypeError: not an integer, or outside the range.
    """
    from nanovllm_core.sampling_params import PRIORITY_MAX, PRIORITY_MIN

    return bounded_int(PRIORITY_MIN, PRIORITY_MAX, "higher runs first")(text)


def count_int(low: int):
    """argparse ``type`` for a count (max tokens, top-k): an integer from ``low`` to 2**31 - 1."""
    from nanovllm_core.sampling_params import COUNT_MAX

    return bounded_int(low, COUNT_MAX)


def prompt_text(text: str) -> str:
    """argparse ``type``: prompt text that is valid UTF-8.

    Python hands over command-line bytes that are not UTF-8 as lone surrogates
    (``\\udcff`` for the byte 0xff); no tokenizer can take them.

    Raises:
        argparse.ArgumentTypeError: the text holds such a byte (or any lone surrogate).
    """
    for i, ch in enumerate(text):
        if "\udc80" <= ch <= "\udcff":
            raise argparse.ArgumentTypeError(
                f"not valid UTF-8: byte 0x{ord(ch) - 0xDC00:02x} at character {i}; pass UTF-8 text "
                "(check the terminal's or the file's encoding)")
    problem = unicode_problem(text)  # any other lone surrogate (the bytes case is named above)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"not valid Unicode: {problem}")
    return text


def load_progress(prog: str):
    """A loader progress callback for a command: on a terminal, one ``prog: stage...`` line on
    stderr as each loading stage begins (as ``nanovllm serve`` prints them) and the long stages'
    bars; elsewhere (a pipe, a script) only the bars of :func:`console_progress`, so an error
    stays the one line on stderr."""
    from nanovllm_core.llm import console_progress

    bars = console_progress()
    if not sys.stderr.isatty():
        return bars
    seen: set[str] = set()

    def progress(stage: str, done: int, total: int) -> None:
        if stage not in seen:
            seen.add(stage)
            print(f"{prog}: {stage}...", file=sys.stderr, flush=True)
        bars(stage, done, total)

    progress.close = bars.close
    return progress


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--device``, ``--dtype`` (shared by ``nanovllm``, ``nanovllm serve`` and the app)."""
    m = p.add_argument_group("model")
    m.add_argument("--model", type=model_name, default=None,
                   help="Hugging Face repo id, local folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    m.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    m.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    m.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None, type=quantization_name,
                   help="how the linear layers hold their weights. auto (the default): a .gguf file's own "
                        "blocks on the CPU where the block kernel runs (the embedded model: its Q4_1), else float; "
                        "none: float (float32 on the CPU); gguf keeps a .gguf file's own blocks; q8_0, q4_0, q4_1 "
                        "cut float weights into those blocks at load (all but auto and none: CPU only)")


def add_engine_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The engine settings that :func:`engine_kwargs` reads; returns the group so callers can add to it."""
    e = p.add_argument_group("engine")
    e.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="priority",
                   help="priority (default here: higher priority first, then arrival) or fcfs (arrival order; "
                        "vLLM's default)")
    # default None: told apart from a given value, which --no-paged-attention refuses (contiguous_problem)
    # vLLM's name for it is an alias (docs/engine.md says the vLLM names are kept; trial 24d)
    e.add_argument("--max-prefill-tokens", "--max-num-batched-tokens", dest="max_prefill_tokens", type=positive_int,
                   default=None, help="per-step token budget; longer prompts are prefilled in chunks (default 512)")
    e.add_argument("--max-num-seqs", type=positive_int, default=None, help="most sequences running at once (default 64)")
    e.add_argument("--max-model-len", type=positive_int, default=None)
    e.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per KV block (default 16; 256 on a GPU where flash-attn runs)")
    e.add_argument("--num-kv-blocks", type=positive_int, default=None, help="size of the KV pool in blocks")
    e.add_argument("--no-paged-attention", action="store_true", help="the contiguous baseline: one request at a time, its KV in one region reserved up front "
                   "for prompt + max tokens, in whole blocks (no prefix cache, no chunked prefill)")
    e.add_argument("--no-flash-attn", action="store_true", help="explicit score-matrix attention instead of the fused kernel")
    e.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="no_prefix_caching", action="store_true",
                   help="turn the prefix cache off (it is on by default, as in vLLM)")
    e.add_argument("--enable-prefix-caching", dest="no_prefix_caching", action="store_false", default=False,
                   help="vLLM's flag, accepted: the prefix cache is on by default (the last of it and "
                        "--no-prefix-caching given wins)")
    e.add_argument("--speculative-model", type=model_name, default=None, metavar="PROPOSER",
                   help="speculative decoding: 'ngram', 'self:N' (first N layers), 'target', or a draft model path/repo")
    e.add_argument("--num-speculative-tokens", type=positive_int, default=None, metavar="K",
                   help="draft tokens per step with --speculative-model (default 5)")
    e.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                   help="split the model over N processes (Megatron tensor parallelism on torch.distributed: gloo on "
                        "cpu, NCCL on N GPUs); N must divide the heads, intermediate size and vocabulary (SmolLM2: 1 or 3); float weights only")
    e.add_argument("--tp-master-addr", default=None, metavar="ADDR",
                   help="tensor parallelism across hosts: the address this rank 0 listens on for its workers "
                        "(default 127.0.0.1; 0.0.0.0: every interface)")
    e.add_argument("--tp-master-port", type=tcp_port, default=None, metavar="PORT",
                   help="the port it listens on (default: a free one); `nanovllm worker --master-port PORT` connects")
    e.add_argument("--tp-local-ranks", type=positive_int, default=None, metavar="K",
                   help="ranks 0..K-1 run on this host, K..N-1 join from others with `nanovllm worker` (default: all N)")
    e.add_argument("--tp-rendezvous-timeout", type=positive_float, default=None, metavar="S",
                   help="seconds every rank may take to join (default 300)")
    return e


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``LLM(...)`` keyword arguments from parsed CLI options (shared with the TUI)."""
    kwargs = dict(
        model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_prefill_tokens, max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy, enable_prefix_caching=not args.no_prefix_caching,
        paged=not args.no_paged_attention, attention_backend="math" if args.no_flash_attn else "flash",
        speculative_model=args.speculative_model, num_speculative_tokens=args.num_speculative_tokens,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        tp_master_addr=getattr(args, "tp_master_addr", None), tp_master_port=getattr(args, "tp_master_port", None),
        tp_local_ranks=getattr(args, "tp_local_ranks", None),
        tp_rendezvous_timeout=getattr(args, "tp_rendezvous_timeout", None),  # None: EngineConfig's default (300 s)
    )
    return kwargs


def contiguous_problem(args: argparse.Namespace) -> str | None:
    """One line when ``--no-paged-attention`` comes with a ``--max-num-seqs`` or ``--max-prefill-tokens`` it
    would ignore (``config.contiguous_conflict``), else None; shared by nanovllm, nanovllm serve and the app."""
    from nanovllm_core.sampling_params import contiguous_conflict

    return contiguous_conflict(not args.no_paged_attention, args.max_num_seqs, args.max_prefill_tokens, cli=True)


def sampling_params(args: argparse.Namespace):
    from nanovllm_core.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop, max_tokens=args.max_tokens,
        logprobs=args.logprobs, ignore_eos=args.ignore_eos,
    )


def output_path_problem(option: str, path: str, make_folders: bool = False) -> str | None:
    """Why the file ``path``, given as ``option`` (``"--trace"``), cannot be written: one line naming the
    option and what to do; None when it can.

    Asked while the options are parsed, before the model loads, so a mistyped folder costs a second
    rather than the minute a load takes (trial 16e). It leaves nothing behind: an existing file is
    opened for appending and closed (its bytes unchanged), a new one is created and removed at once,
    so a run that then fails on another option leaves no empty file. ``make_folders``: the writer
    creates missing folders (the tutorial's progress file), so the nearest existing folder must be
    one this process may write in (checked with ``os.access``; nothing is created).
    """
    from pathlib import Path

    if not path.strip():
        return f"{option} needs a file name"
    p = Path(path)
    if p.is_dir():
        return f"{option} {path} is a folder; give a file name in it, e.g. {p / 'out'}"
    folder = p.parent
    if make_folders:
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    if not folder.exists():
        return f"{option} {path}: the folder {folder} does not exist; create it first or choose another path"
    if not folder.is_dir():
        return f"{option} {path}: {folder} is not a folder; choose another path"
    if make_folders and not p.exists() and folder != p.parent:  # folders to create: nothing to try yet
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"{option} {path}: the folder {folder} is not writable; choose another path"
        return None
    try:
        if p.exists():
            open(p, "a").close()
        else:
            open(p, "x").close()
            p.unlink()
    except OSError as e:
        return output_file_error(option, path, e)
    return None


def output_file_error(option: str, path: str, e: OSError) -> str:
    """One line for the file ``path`` of ``option`` that could not be written (``e``): the option, the
    path, the system's reason in words (not its errno text) and what to do."""
    return f"{option} {path} cannot be written ({e.strerror or type(e).__name__}); choose a path you can write"


def check_output_paths(parser: argparse.ArgumentParser, *given: tuple[str, str | None],
                       make_folders: tuple[str, ...] = ()) -> None:
    """Refuse, with argparse's one-line error (status 2), the first output file of ``given``
    (``(option, path)`` pairs; None: not given) that cannot be written (:func:`output_path_problem`),
    or two options naming the same file (each would overwrite the other). ``make_folders``: the
    options whose writer creates missing folders."""
    from pathlib import Path

    seen: dict = {}
    for option, path in given:
        if path is None:
            continue
        problem = output_path_problem(option, path, make_folders=option in make_folders)
        if problem is not None:
            parser.error(problem)
        key = Path(path).resolve()
        if key in seen:
            parser.error(f"{seen[key]} and {option} name the same file {path}; give each its own")
        seen[key] = option
