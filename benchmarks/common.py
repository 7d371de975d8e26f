"""What the benchmark programs share: the workload, statistics, peak memory, table printing.

The matmul peak (``gemm_peaks``) and ``cpu_name`` live in ``nanovllm_core.roofline``, where the
X-Ray measures the machine's ridge point with them; they are re-exported here.

A *workload* is N requests whose prompt and output lengths are drawn with a fixed seed.
Prompts are real English text: ``corpus.txt`` tokenized once, each prompt a window of the
drawn length starting at its own offset (all offsets distinct, so no two prompts share a
first KV block and the prefix cache cannot make our engine look better than it is).
"""

from __future__ import annotations

import json
import os
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanovllm_core import host_load
from nanovllm_core.roofline import cpu_name, gemm_peaks  # noqa: F401 (the benchmarks import them from here)

CORPUS = Path(__file__).with_name("corpus.txt")

# name -> (prompt length range, output length range), in tokens, inclusive.
WORKLOADS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "default": ((16, 256), (16, 128)),
    "chat": ((16, 64), (32, 256)),  # short prompts, long answers: the decode-heavy case
}


@dataclass
class Workload:
    """N requests: ``prompts[i]`` (token ids) must produce exactly ``output_lens[i]`` tokens."""

    name: str
    seed: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def summary(self) -> dict[str, Any]:
        """The workload as JSON-ready numbers (lengths in tokens)."""
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "seed": self.seed,
            "prompt_tokens_range": list(self.prompt_range),
            "output_tokens_range": list(self.output_range),
            "total_prompt_tokens": self.prompt_tokens,
            "total_output_tokens": self.output_tokens,
        }


def corpus_token_ids(tokenizer: Any) -> list[int]:
    """Token ids of ``corpus.txt`` (no special tokens)."""
    return tokenizer.encode(CORPUS.read_text(encoding="utf-8"), add_special_tokens=False)


def make_workload(tokenizer: Any, name: str = "default", num_requests: int = 64, seed: int = 0,
                  prompt_range: tuple[int, int] | None = None,
                  output_range: tuple[int, int] | None = None) -> Workload:
    """Draw a workload: lengths uniform in their ranges (inclusive), prompts cut from real text.

    Raises:
        ValueError: unknown workload name, empty ranges, or more requests than the corpus has offsets.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; use one of {', '.join(WORKLOADS)}")
    p_range, o_range = WORKLOADS[name]
    p_range, o_range = prompt_range or p_range, output_range or o_range
    if not (1 <= p_range[0] <= p_range[1]) or not (1 <= o_range[0] <= o_range[1]):
        raise ValueError(f"length ranges must be 1 <= low <= high, got prompts {p_range}, outputs {o_range}")
    stream = corpus_token_ids(tokenizer)
    if num_requests > len(stream):
        raise ValueError(f"at most {len(stream)} requests (one per corpus offset); got {num_requests}")
    rng = random.Random(seed)
    offsets = rng.sample(range(len(stream)), num_requests)
    ring = stream * (p_range[1] // len(stream) + 2)  # a window may wrap around the end of the text
    prompts, outputs = [], []
    for off in offsets:
        p = rng.randint(*p_range)
        prompts.append(ring[off:off + p])
        outputs.append(rng.randint(*o_range))
    return Workload(name, seed, p_range, o_range, prompts, outputs)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation, or None for no values."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    k = (len(vals) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


class PeakRSS:
    """Peak resident memory (bytes) of this process while the ``with`` block runs.

    On Linux the kernel's high-water mark (``VmHWM``) is reset on entry through
    ``/proc/self/clear_refs`` and read on exit; elsewhere a thread samples the RSS every 20 ms.
    The figure includes everything resident: model weights, KV cache, the Python heap.
    """

    def __init__(self) -> None:
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _status(field_name: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(field_name + ":"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    @staticmethod
    def _rss_now() -> int:
        rss = PeakRSS._status("VmRSS")
        if rss is not None:
            return rss
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def __enter__(self) -> "PeakRSS":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._hwm = True
        except OSError:
            self._hwm = False
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        self.peak_bytes = self._rss_now()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_bytes = max(self.peak_bytes, self._rss_now())

    def __exit__(self, *exc) -> None:
        if self._hwm:
            self.peak_bytes = max(self.peak_bytes, self._status("VmHWM") or 0)
        else:
            self._stop.set()
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._rss_now())


def default_model_dir() -> Path:
    """The folder of the embedded default model (SmolLM2-135M-Instruct, converted from its GGUF once)."""
    from nanovllm_core.model.loader import resolve_model

    return Path(resolve_model(None).path)


def machine_summary() -> dict[str, Any]:
    """Where the figures were measured: CPU, core count, torch threads, versions."""
    import transformers

    load = load_average()
    return {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": "cpu",
        "dtype": "float32",
        "load_average_1_5_15_min": load,  # other processes share the cores when this exceeds ~1
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


# Above this, a speed figure is more the host's than the code's (a shared machine, another job).
MAX_ROUND_SPREAD = 1.15  # fastest round / slowest round of one measured thing
# The load limit and the note are nanovllm_core.host_load's, the same in every benchmark and the
# speculative CLI (trial 29d: this file's own 1.5 per core kept benchmark_comparison quiet at a load the
# CLI called busy).
MAX_LOAD_PER_CORE = host_load.BUSY_LOAD_PER_CORE
load_average = host_load.load_average


def busy_host_warnings(rounds: dict[str, list[float]] | None = None, load_at_start: list[float] | None = None,
                       load_at_end: list[float] | None = None, cores: int | None = None,
                       unit: str = "tok/s", own: int = 0) -> list[str]:
    """Warnings that speed figures were measured on a busy host (empty when nothing says so).

    Args:
        rounds: name -> the same figure measured in several rounds (e.g. tokens/s); a name whose
            rounds differ by more than :data:`MAX_ROUND_SPREAD` (fastest / slowest) is named.
        load_at_start, load_at_end: :func:`load_average` before and after the measurements; a
            1-minute figure above the cores gives ``host_load.busy_host_note``'s line.
        cores: the CPU's cores (default ``os.cpu_count()``).
        unit: the unit of the rounds' figures, for the message.
        own: the compute threads the measured run kept busy (taken out of the load at the end).
    """
    out = []
    for name, values in (rounds or {}).items():
        if len(values) > 1 and min(values) > 0 and max(values) / min(values) > MAX_ROUND_SPREAD:
            out.append(f"warning: {name} rounds range {min(values):.1f}-{max(values):.1f} {unit} "
                       f"({max(values) / min(values):.2f}x): the host was busy; read the medians with care, or run again")
    note = host_load.busy_host_note(load_at_start, load_at_end, cores, own)
    return out + ([note] if note else [])


class HostCheck(host_load.HostCheck):
    """Was the host busy while a benchmark ran? Make one before measuring, call :meth:`report` last.

    It reads the load average at both ends (``nanovllm_core.host_load``, the note every benchmark and
    the speculative CLI print) and compares repeated rounds (:func:`busy_host_warnings`), so no
    benchmark prints a ratio measured under load without saying so.
    """

    def warnings(self, rounds: dict[str, list[float]] | None = None, unit: str = "tok/s") -> list[str]:
        note = self.note()
        return busy_host_warnings(rounds, unit=unit) + ([note] if note else [])

    def report(self, rounds: dict[str, list[float]] | None = None, unit: str = "tok/s") -> list[str]:
        """Print the warnings (stdout, after the figures) and return them, e.g. for the JSON."""
        found = self.warnings(rounds, unit)
        for line in found:
            print(line)
        return found


def fmt(value: float | None, unit: str = "", digits: int = 3) -> str:
    """A number for a table cell; ``-`` when missing."""
    if value is None:
        return "-"
    return f"{value:.{digits}g}{unit}" if abs(value) < 1000 else f"{value:,.0f}{unit}"


def compared(ratio: float, better: str, worse: str) -> str:
    """A ratio of baseline to new (``baseline_s / new_s``) in words that read the right way round:
    ``compared(1.5, "faster", "slower")`` is "1.50x faster", ``compared(0.34, "shorter", "longer")``
    is "2.94x longer" (a ratio under 1 printed as "0.34x shorter" read as a gain; trial 20e), and
    a ratio that is not a positive number is "not comparable"."""
    if not ratio > 0 or ratio == float("inf"):
        return "not comparable"
    return f"{ratio:.2f}x {better}" if ratio >= 1 else f"{1 / ratio:.2f}x {worse}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain fixed-width text table (first column left-aligned, the rest right-aligned)."""
    cols = [headers] + rows
    widths = [max(len(r[i]) for r in cols) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        return "  ".join(cells)

    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def write_json(path: str | None, data: Any) -> None:
    """Write a benchmark's figures to ``path`` as indented JSON; nothing when ``path`` is None (no ``--json``)."""
    if path:
        Path(path).write_text(json.dumps(data, indent=2))


def check_json_path(parser: Any, path: str | None) -> None:
    """Fail at once, with one line (``nanovllm_core.cli_args.output_path_problem``: what is wrong with the
    path and what to do), when ``--json FILE`` could not be written after the run; None: not given."""
    from nanovllm_core.cli_args import check_output_paths

    check_output_paths(parser, ("--json", path))


def cpu_flags() -> list[str]:
    """The CPU's int8/matmul-relevant instruction sets, from /proc/cpuinfo."""
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


def llamacpp_model(n_ctx: int, threads: int = 2) -> Any:
    """llama-cpp-python's ``Llama`` on the shipped GGUF (SmolLM2-135M-Instruct, Q4_1), ``n_ctx`` tokens of context.

    On a CPU with AMX, llama.cpp repacks the weights for its AMX matmul by default; with
    llama-cpp-python 0.3.36 on the 2-core AMX Xeon here that matmul segfaults on the first
    prompt (ggml-org/llama.cpp#20824 reports the same crash). There the repack ("extra
    buffer types") is turned off, so llama.cpp runs its AVX-512 Q4_1 kernels; elsewhere its
    defaults stand. The caller's figures should say so (``llamacpp_notes``).

    Raises:
        ImportError: llama-cpp-python is not installed (``pip install -e ".[llamacpp]"``).
    """
    import llama_cpp.llama_cpp as low_level
    from llama_cpp import Llama

    from nanovllm_core.model.loader import default_gguf_path

    default_params = low_level.llama_model_default_params

    def without_amx_repack():
        params = default_params()
        params.use_extra_bufts = False
        return params

    if "amx_int8" in cpu_flags():
        low_level.llama_model_default_params = without_amx_repack
    try:
        return Llama(model_path=str(default_gguf_path()), n_ctx=n_ctx, n_threads=threads,
                     n_threads_batch=threads, verbose=False)
    finally:
        low_level.llama_model_default_params = default_params


def llamacpp_notes(threads: int = 2) -> dict[str, Any]:
    """What a llama.cpp figure ran with: the weights, threads and whether AMX repacking was off."""
    import llama_cpp

    return {"weights": "GGUF Q4_1 (the shipped file)", "threads": threads,
            "llama_cpp_python": llama_cpp.__version__,
            "amx_repack": "off (it crashes here, ggml-org/llama.cpp#20824)" if "amx_int8" in cpu_flags()
            else "not applicable (this CPU has no AMX)"}
