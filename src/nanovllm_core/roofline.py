"""The machine's roofline: its measured matrix-multiply peak and memory bandwidth.

Williams, Waterman and Patterson 2009, "Roofline: an insightful visual performance model".
An operation that does ``F`` FLOPs while moving ``B`` bytes has arithmetic intensity
``I = F / B`` (FLOP/byte). On a machine with peak ``P`` FLOP/s and memory bandwidth ``W``
bytes/s it takes at least ``max(F / P, B / W)`` seconds, so it is *memory-bound* while
``I < P / W`` and *compute-bound* above it. ``P / W`` is the *ridge point*.

Both figures are measured here, on this machine, in this process's thread count, never
taken from a data sheet: ``P`` is the best of PyTorch's matrix-multiply paths on square
matrices (the one our linear layers take among them), ``W`` a streaming read of a buffer
larger than the last-level cache. The measurement takes about a second; it is kept in memory
and in ``<cache_root()>/roofline.json``, so later runs read it back. The bandwidth is a
property of the machine: it is measured once per device (CPU model and thread count, or GPU)
and reused in every dtype and quantization mode; the float matmul's peak once per (device,
dtype), in every mode (float and the block modes share one entry). The X-Ray and the
tutorial show it as the machine's ridge point for float operations.

A CPU measurement is only as good as the cores it got: with other work on the host the peak
comes out low (39 GFLOP/s measured under load where the same host reached 78-85, issue 29).
So the measurement also records ``cpu_share``, the CPU time its threads got over wall time x
threads (about 1 on a quiet host). Below ``QUIET_CPU_SHARE`` the figures are used by this
process only, never kept (neither the peak nor the bandwidth), and ``machine`` says the host
was busy and how to measure again: ``python -m nanovllm_core.roofline`` (it measures both now
and keeps a quiet result, replacing what was kept).

Under a block mode (``gguf``, ``q8_0``, ``q4_0``, ``q4_1``) the projections do not run the float
matmul: they run ``model/block_quant.py``'s block kernel, whose peak is its own (int8 products
over 4- and 8-bit weights: 1.6-3x the float matmul's in measurements on a shared 2-core AMD EPYC
(Zen 4, AVX-512 with VNNI)). Judged against
the float peak, a Q4_1 decode of 2 tokens came out "compute-bound" (trial 14c). So the block
kernel is timed too (:func:`block_peak`: the loaded model's largest projection of each format in
layer 0, at ``BLOCK_PEAK_TOKENS`` rows, far past its crossing, the best of the runs that fit in
``BLOCK_PEAK_SECONDS``: about half a second for two formats), kept per device, format, shape and kernel source like the float peak (not when the
host was busy), and :func:`with_block_peaks` adds it to the roofline: an operation is judged
against the peak of the kernel that ran it (``educational.xray_costs.kernel_peak``), the
block-format projections against their block kernel's, every other operation against the
float matmul's, and the views say so.

Where a layer crosses the ridge moves by less than the ridge does. A linear layer ``[N, K]``
over ``T`` tokens does ``2 T N K`` FLOPs and moves ``N K b`` bytes of weights (``b`` bytes a
weight as stored, scales included) plus ``T (N + K) e`` bytes of activations (``e`` bytes each),
so it reaches a ridge ``R`` from

    T* = R b N K / (2 N K - R (N + K) e)  tokens,  about  R b / 2  while  R (N + K) e << 2 N K,

and never when ``R >= 2 N K / ((N + K) e)``, the intensity its float activations cap it at.
Narrower weights lower ``b`` as a wider peak raises ``R``: the crossing moves by the ratio of
ridges divided by the ratio of bytes per weight, not by the ridge ratio alone (for example, a
kernel with 12x the float32 peak over weights of 1.1 bytes, 3.6x fewer than float32's 4: ~3.3x
more tokens, fewer still once the activation term counts;
``educational.xray_costs.linear_crossing_tokens`` computes it, and ``compute_bound_tokens`` the
whole layer's crossing, attention included).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from nanovllm_core import untrusted
from nanovllm_core.native import cpu_name  # noqa: F401 (the machine a figure is from; benchmarks import it here)
from nanovllm_core.paths import cache_root

GEMM_N = 2048  # square matmul side for the peak: large enough to reach it on CPUs and small GPUs
STREAM_MIN_BYTES = 256 * 2**20
STREAM_MAX_BYTES = 2**30
QUIET_CPU_SHARE = 0.8  # below this share of its threads' CPU time, a measurement shared the cores
REMEASURE = "python -m nanovllm_core.roofline"
# Rows a block kernel is timed at: a projection of SmolLM2 over 128 tokens does over 100 FLOP a
# byte, past any ridge point measured here (the Q4_1 kernel's is 17-36 FLOP/byte on a 2-core AMD
# EPYC, docs/cpu-kernels.md), so the time is the kernel's arithmetic, not its reading of the weights.
BLOCK_PEAK_TOKENS = 128
BLOCK_PEAK_SECONDS = 0.25  # per format timed: the best of the runs that fit (two formats: about half a second)
# A block kernel's peak below this fraction of the float matmul's (measured in the same run) is not
# trusted: the int8 kernels run about 1-3x the float matmul on a quiet host (docs/cpu-kernels.md), while a
# shared host gave the Q4_1 kernel 26-41 GFLOP/s one run and 382 the next beside a float 213 (trial 15a).
BLOCK_TRUST_FRACTION = 0.5
UNRELIABLE = "could not be measured reliably on this busy host"


@dataclass(frozen=True)
class Roofline:
    """Measured limits of one device for one dtype.

    ``peak_flops``: FLOP/s of the fastest matrix multiply measured; ``bandwidth``: bytes/s
    of a streaming read; ``machine``: where (CPU or GPU name, threads, dtype).
    """

    peak_flops: float
    bandwidth: float
    machine: str
    cpu_share: float = 1.0  # CPU time its threads got / (wall time x threads) while measuring (1.0 on a GPU)
    # (format, FLOP/s) of each block kernel the loaded weights run, measured by block_peak (empty: none
    # measured, or float weights); ``peak_flops`` stays the float matmul's, for every other operation.
    block_peaks: tuple[tuple[str, float], ...] = ()

    @property
    def quiet(self) -> bool:
        """The float measurement had the cores to itself (``cpu_share >= QUIET_CPU_SHARE``)."""
        return self.cpu_share >= QUIET_CPU_SHARE

    @property
    def ridge(self) -> float:
        """FLOP/byte at which an operation stops being memory-bound (``peak_flops / bandwidth``)."""
        return self.peak_flops / self.bandwidth

    def bound(self, flops: float, nbytes: float) -> str:
        """``"memory"`` or ``"compute"``: which limit an operation of this size hits first, at the float
        matmul's peak (a block projection is judged against its block kernel's:
        ``educational.xray_costs.kernel_peak``)."""
        return "compute" if nbytes <= 0 or flops / nbytes >= self.ridge else "memory"

    def min_time_s(self, flops: float, nbytes: float) -> float:
        """The roofline's lower bound on the time of an operation, seconds."""
        return max(flops / self.peak_flops, nbytes / self.bandwidth)


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":  # pragma: no cover - needs CUDA
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


_timed = [0.0, 0.0]  # CPU seconds and wall seconds of the timed runs (measure() reads their ratio)


def _best_time(run: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    run()  # warm-up: thread pool, buffers, kernel choice
    sync()
    best = float("inf")
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - t)
    _timed[0] += time.process_time() - cpu
    _timed[1] += time.perf_counter() - wall
    return best


def gemm_peaks(n: int = GEMM_N, repeats: int = 5, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Measured matrix-multiply FLOP/s per path: the best of ``repeats`` timed ``[n, n] @ [n, n]``.

    ``"mkl"`` / ``"cublas"``: ``torch.mm`` on the CPU / on CUDA. On the CPU in float32 also
    ``"onednn"``: oneDNN with a pre-packed weight, the path our linear layers take (see
    ``nanovllm_core.model.cpu_linear``). Callers take the faster as the peak. The best run,
    not the mean, so a moment of contention on a shared machine does not lower the peak and
    make every fraction of it look better than it is.
    """
    from nanovllm_core.model import cpu_linear

    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    paths: dict[str, Callable[[], object]] = {
        "cublas" if device.type == "cuda" else "mkl": lambda: torch.mm(a, b, out=c)}
    packed = cpu_linear.packed_weight(b) if device.type == "cpu" else None
    if packed is not None:
        paths["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    sync = _sync(device)
    return {name: 2.0 * n ** 3 / _best_time(run, sync, repeats) for name, run in paths.items()}


def last_level_cache_bytes() -> int:
    """The largest CPU cache (bytes) Linux reports for cpu0, or 0 when unknown."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
        try:
            best = max(best, int(text.rstrip("KMGkmg")) * scale)
        except ValueError:
            continue
    return best


def memory_bandwidth(nbytes: int | None = None, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Measured streaming read bandwidth, bytes/s: the best of ``repeats`` sums over a float32 buffer.

    ``nbytes`` (default: twice the last-level cache, 256 MiB to 1 GiB) is large enough that the
    buffer comes from memory, not from a cache, as a model's weights do in a decode step.
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = STREAM_MAX_BYTES if device.type == "cuda" else \
            min(STREAM_MAX_BYTES, max(STREAM_MIN_BYTES, 2 * last_level_cache_bytes()))
    x = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    return x.numel() * 4 / _best_time(lambda: x.sum(), _sync(device), repeats)


def machine_name(device: torch.device | str, dtype: torch.dtype, quantization: str | None = None) -> str:
    """Where a roofline holds: ``"Intel Xeon ... (2 threads), float32"`` (``", q4_1 weights"`` and
    the like added under a block mode: its ``peak_flops`` is still the float matmul's, for the
    operations that are no block projection; :func:`with_block_peaks` adds the block kernels') or
    the GPU's name."""
    weights = f", {quantization} weights" if quantization else ""
    return f"{device_name(device)}, {str(dtype).replace('torch.', '')}{weights}"


def device_name(device: torch.device | str) -> str:
    """The device a bandwidth holds for: ``"AMD EPYC ... (2 threads)"`` or the GPU's name."""
    device = torch.device(device)
    if device.type == "cuda":  # pragma: no cover - needs CUDA
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} ({torch.get_num_threads()} threads)"


def measure(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, gemm_n: int = GEMM_N,
            stream_bytes: int | None = None, repeats: int = 3, quantization: str | None = None,
            bandwidth: float | None = None) -> Roofline:
    """Measure the roofline now (about a second on a CPU): the best float matmul path and a
    streaming read, unless ``bandwidth`` (bytes/s, measured before on this device) is given.
    ``quantization`` only names the weights in ``machine``."""
    _timed[:] = [0.0, 0.0]
    peak = max(gemm_peaks(gemm_n, repeats, device, dtype).values())
    bandwidth = bandwidth or memory_bandwidth(stream_bytes, repeats, device)
    share = 1.0
    if torch.device(device).type == "cpu":  # the timed runs' CPU time over what their threads could have had
        share = _timed[0] / max(1e-9, _timed[1] * torch.get_num_threads())
    return Roofline(peak, bandwidth, machine_name(device, dtype, quantization), cpu_share=round(min(share, 1.0), 3))


def busy_note(roof: Roofline) -> Roofline:
    """``roof`` with ``machine`` saying the host was busy while it was measured (when it was)."""
    if roof.quiet or "host was busy" in roof.machine:
        return roof
    return replace(roof, machine=f"{roof.machine}; measured while the host was busy (its threads got "
                                 f"{roof.cpu_share:.0%} of their cores), so likely low and not kept: "
                                 f"`{REMEASURE}` measures again")


@dataclass(frozen=True)
class BlockPeak:
    """A block kernel's measured peak: ``kind`` (``"q4_1"``), ``peak_flops`` (FLOP/s, a multiply-add
    counted as 2 as the X-Ray counts it), ``timed_on`` (what ran: ``"[3072, 576] at 128 tokens"``) and
    ``cpu_share`` as :class:`Roofline`'s."""

    kind: str
    peak_flops: float
    timed_on: str
    cpu_share: float = 1.0

    @property
    def quiet(self) -> bool:
        return self.cpu_share >= QUIET_CPU_SHARE


def measure_block_peak(module, tokens: int = BLOCK_PEAK_TOKENS, seconds: float = BLOCK_PEAK_SECONDS) -> BlockPeak:
    """Time ``module`` (a ``model.block_quant.BlockLinear``: whatever kernel it runs, the C one or its
    PyTorch fallback) on ``tokens`` rows of random activations: ``2 x tokens x out x in`` FLOPs over
    the best run of as many as fit in ``seconds`` (at least 3). One run of the default model's
    ``[3072, 576]`` Q4_1 gate/up projection takes about 0.6 ms on a 2-core AMD EPYC, so a quiet host
    gives hundreds of runs; a busy one still a few clean ones (there, of 20 runs in 0.3 s the best
    reached 242 GFLOP/s, the median 19: a fixed few runs would have kept a low figure)."""
    x = torch.randn(tokens, module.in_features, generator=torch.Generator().manual_seed(0))
    best, runs = float("inf"), 0
    with torch.no_grad():
        module(x)  # warm-up: thread pool, scratch buffer
        cpu, wall = time.process_time(), time.perf_counter()
        while runs < 3 or (time.perf_counter() - wall < seconds and runs < 1000):
            t = time.perf_counter()
            module(x)
            best, runs = min(best, time.perf_counter() - t), runs + 1
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    share = cpu / max(1e-9, wall * torch.get_num_threads())
    flops = 2.0 * tokens * module.out_features * module.in_features / best
    return BlockPeak(str(module.kind), flops, f"[{module.out_features}, {module.in_features}] at {tokens} tokens",
                     round(min(share, 1.0), 3))


@functools.cache
def _block_kernel_id() -> str:
    """Which block kernel runs: a hash of ``block_quant_cpu.c`` (a changed kernel is measured again), or
    its PyTorch fallback when the C library is not loaded."""
    from nanovllm_core.model import block_quant

    if block_quant.library() is None:
        return "PyTorch fallback"
    return hashlib.sha256(block_quant.SOURCE.read_bytes()).hexdigest()[:12]


def _block_key(kind: str, shape: str, device: torch.device | str) -> str:
    """The cache key of a block kernel's peak: device (CPU and threads), format, shape timed, kernel."""
    return f"block kernel peak · {device_name(device)} · {kind} {shape} · {_block_kernel_id()}"


_block_peaks: dict[str, BlockPeak] = {}


def cached_block_peak(module, device: torch.device | str = "cpu", path: Path | None = None,
                      tokens: int = BLOCK_PEAK_TOKENS) -> BlockPeak | None:
    """``module``'s block kernel peak measured earlier (in this process, or kept in ``path`` from a quiet
    host), or None; never measures."""
    shape = f"[{module.out_features}, {module.in_features}] at {tokens} tokens"
    key = _block_key(str(module.kind), shape, device)
    with _lock:
        mine = _block_peaks.get(key)
    if mine is not None and mine.quiet:
        return mine
    entry = _read_cache(path or default_cache_path()).get(key)
    try:
        peak = BlockPeak(str(entry["kind"]), float(entry["peak_flops"]), str(entry["timed_on"]),
                         float(entry["cpu_share"]))
    except (TypeError, KeyError, ValueError):
        return mine  # this process's busy measurement, if any (the views say it is not used)
    if peak.peak_flops <= 0 or not peak.quiet:
        return mine
    with _lock:  # a quiet host's kept measurement wins over this process's busy one
        _block_peaks[key] = peak
    return peak


def block_peak(module, device: torch.device | str = "cpu", path: Path | None = None,
               tokens: int = BLOCK_PEAK_TOKENS, float_peak: float = 0.0, again: bool = False) -> BlockPeak:
    """``module``'s block kernel peak: read back when a trusted one was kept or measured in this process
    (:func:`trusted` against ``float_peak``), else measured now (:func:`measure_block_peak`, also with
    ``again``) and kept in ``path`` when trusted (any other serves this process only, and the views give
    no verdict from it)."""
    peak = None if again else cached_block_peak(module, device, path, tokens)
    if peak is not None and trusted(peak, float_peak):
        return peak
    peak = measure_block_peak(module, tokens)
    key = _block_key(peak.kind, peak.timed_on, device)
    with _lock:
        _block_peaks[key] = peak
    if trusted(peak, float_peak):
        _keep(path or default_cache_path(), {key: asdict(peak)})
    return peak


def trusted(peak: BlockPeak, float_peak: float = 0.0) -> bool:
    """Whether a block kernel's measured peak can judge a verdict: measured on a quiet host, and (for the
    C kernel, whose int8 products run at least about as fast as the float matmul on a quiet host) not
    below ``BLOCK_TRUST_FRACTION`` of the float matmul's peak ``float_peak`` measured in the same run (0:
    not checked). The PyTorch fallback dequantizes first and may be slower than the float matmul."""
    if not peak.quiet or peak.peak_flops <= 0:
        return False
    return float_peak <= 0 or _block_kernel_id() == "PyTorch fallback" or \
        peak.peak_flops >= BLOCK_TRUST_FRACTION * float_peak


def with_block_peaks(roof: Roofline, peaks: list[BlockPeak] | tuple[BlockPeak, ...]) -> Roofline:
    """``roof`` with the trusted block kernels' peaks added (``block_peaks``; :func:`trusted`). A peak
    that is not trusted is left out, so the views give its projections no compute/memory verdict, and
    ``machine`` says why: ``UNRELIABLE`` and how to measure on a quiet host (trial 15a: a busy host's
    26 GFLOP/s Q4_1 peak made a batch-1 decode "compute-bound", a quiet one's 382 "memory-bound")."""
    if not peaks:
        return roof
    machine = roof.machine
    bad = [p for p in peaks if not trusted(p, roof.peak_flops)]
    if bad and UNRELIABLE not in machine:
        names = " and ".join(p.kind.upper() for p in bad)
        whose = "kernels' peaks" if len(bad) > 1 else "kernel's peak"
        why = "; ".join(f"{p.kind.upper()} {p.peak_flops / 1e9:,.1f} GFLOP/s with its threads getting "
                        f"{p.cpu_share:.0%} of their cores" for p in bad)
        machine += (f"; the {names} {whose} {UNRELIABLE} ({why}, beside the float matmul's "
                    f"{roof.peak_flops / 1e9:,.1f} GFLOP/s), so not used or kept: run `{REMEASURE}` when the machine "
                    "is quiet")
    return replace(roof, machine=machine,
                   block_peaks=tuple((p.kind, p.peak_flops) for p in peaks if p not in bad))


def default_cache_path() -> Path:
    return cache_root() / "roofline.json"


_lock = threading.Lock()
_measured: dict[str, Roofline] = {}
_bandwidths: dict[str, float] = {}


def _key(device: torch.device | str, dtype: torch.dtype, quantization: str | None = None) -> str:
    """The cache key of a roofline: device and dtype, not the mode (its float matmul peak is every mode's;
    a block kernel's peak is kept under its own key, :func:`_block_key`)."""
    return f"{machine_name(device, dtype)} · torch {torch.__version__}"


def _named_for(roof: Roofline, device: torch.device | str, dtype: torch.dtype, quantization: str | None) -> Roofline:
    """``roof`` (kept under device and dtype) with ``machine`` naming ``quantization``'s weights."""
    base_name, name = machine_name(device, dtype), machine_name(device, dtype, quantization)
    if name == base_name or roof.machine.startswith(name) or not roof.machine.startswith(base_name):
        return roof
    return replace(roof, machine=name + roof.machine[len(base_name):])


def _bandwidth_key(device: torch.device | str) -> str:
    """The cache key of a device's bandwidth: the same in every dtype and mode."""
    return f"memory bandwidth · {device_name(device)}"


def cached_bandwidth(device: torch.device | str = "cpu", path: Path | None = None) -> float | None:
    """This device's memory bandwidth (bytes/s) measured earlier on a quiet host, or None; never measures.

    From this process's measurements or ``path`` (default ``<cache_root()>/roofline.json``)."""
    key = _bandwidth_key(device)
    with _lock:
        if key in _bandwidths:
            return _bandwidths[key]
    data = _read_cache(path or default_cache_path())
    entry = data.get(key)
    try:
        value = float(entry["bandwidth"]) if float(entry["cpu_share"]) >= QUIET_CPU_SHARE else 0.0
    except (TypeError, KeyError, ValueError):
        value = 0.0
    if value <= 0:
        return None
    with _lock:
        _bandwidths[key] = value
    return value


def _read_cache(path: Path) -> dict:
    try:
        data = untrusted.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cached(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
           path: Path | None = None, quantization: str | None = None) -> Roofline | None:
    """The roofline measured earlier (in this process, or kept in ``path``), or None; never measures."""
    key = _key(device, dtype, quantization)
    with _lock:
        if key in _measured:
            return _named_for(_measured[key], device, dtype, quantization)
    entry = _read_cache(path or default_cache_path()).get(key)
    try:  # an entry without cpu_share predates the check: it may have been measured under load
        roof = Roofline(float(entry["peak_flops"]), float(entry["bandwidth"]), str(entry["machine"]),
                        float(entry["cpu_share"]))
    except (TypeError, KeyError, ValueError):
        return None
    if roof.peak_flops <= 0 or roof.bandwidth <= 0 or not roof.quiet:
        return None
    with _lock:
        _measured[key] = roof
    return _named_for(roof, device, dtype, quantization)


def machine_roofline(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     path: Path | None = None, quantization: str | None = None) -> Roofline:
    """This machine's roofline for ``device``, ``dtype`` and ``quantization``: measured the
    first time, then kept.

    The file at ``path`` (default ``<cache_root()>/roofline.json``) keeps one entry per
    machine, thread count, dtype and torch version, and one
    bandwidth per device, reused by every entry: a mode measured second only times its peak.
    A file that cannot be written only means the next process measures again.
    """
    roof = cached(device, dtype, path, quantization)
    if roof is not None:
        return roof
    return remeasure(device, dtype, path, quantization, bandwidth=cached_bandwidth(device, path))


def remeasure(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              path: Path | None = None, quantization: str | None = None,
              bandwidth: float | None = None) -> Roofline:
    """Measure now, whatever was kept (the bandwidth too, unless ``bandwidth`` is given); keep
    the result in ``path`` only if the host was quiet (else this process uses it, and its
    ``machine`` says the host was busy and how to measure again)."""
    roof = busy_note(measure(device, dtype, bandwidth=bandwidth))
    key = _key(device, dtype, quantization)
    with _lock:
        _measured[key] = roof
    if not roof.quiet:
        return _named_for(roof, device, dtype, quantization)
    path = path or default_cache_path()
    data = _read_cache(path)
    data[key] = asdict(roof)
    # The device's bandwidth for every mode: replaced when measured now (on a quiet host), else
    # written back where the file lost it (the value came from a quiet measurement before).
    if bandwidth is None or _bandwidth_key(device) not in data:
        data[_bandwidth_key(device)] = {"bandwidth": roof.bandwidth, "cpu_share": roof.cpu_share}
    with _lock:
        _bandwidths[_bandwidth_key(device)] = roof.bandwidth
    _write(path, data)
    return _named_for(roof, device, dtype, quantization)


def _write(path: Path, data: dict) -> None:
    """Replace ``path`` with ``data`` as JSON (a file that cannot be written only means measuring again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def _keep(path: Path, entries: dict) -> None:
    """Add ``entries`` to the file at ``path``, keeping what it holds."""
    data = _read_cache(path)
    data.update(entries)
    _write(path, data)


def default_block_modules() -> list:
    """Block layers of the default model's projection shapes (random weights), one per block format and
    shape ``educational.xray.block_modules`` may time for it (layer 0's q/k/v, o, gate/up and down, and an
    LM head's first rows), so :func:`main` keeps the block kernels' peaks the X-Ray reads back. Empty when
    the default model's config cannot be read."""
    from nanovllm_core.model.block_formats import FORMATS
    from nanovllm_core.model.block_quant import PACK_ROWS, BlockLinear
    from nanovllm_core.model.loader import resolve_model

    try:
        cfg = untrusted.loads((Path(resolve_model(None).path) / "config.json").read_text(encoding="utf-8"))
        h, i, heads = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_attention_heads"])
        kv, hd = int(cfg.get("num_key_value_heads") or heads), int(cfg.get("head_dim") or h // heads)
    except Exception:  # noqa: BLE001 - no default model: the X-Ray measures on its own model
        return []
    up = lambda r: -(-r // PACK_ROWS) * PACK_ROWS  # noqa: E731 - an LM head's slice rounds up
    shapes = {((heads + 2 * kv) * hd, h), (h, heads * hd), (2 * i, h), (h, i), (up(4 * h), h),
              (up(max(2 * i, 4 * h)), h), (up(max((heads + 2 * kv) * hd, 4 * h)), h)}
    gen = torch.Generator().manual_seed(0)
    return [BlockLinear.from_float(torch.randn(n, k, generator=gen) * 0.02, kind)
            for kind in FORMATS for n, k in sorted(shapes)]


def main() -> int:
    """``python -m nanovllm_core.roofline``: measure this machine's roofline now (CPU, float32,
    torch's thread count) and each block kernel's peak on the default model's projection shapes, and
    keep each when it can be trusted (a quiet host; :func:`trusted`)."""
    roof = remeasure()
    print(f"{roof.machine}\n  matmul peak {roof.peak_flops / 1e9:,.1f} GFLOP/s, memory {roof.bandwidth / 1e9:,.1f} GB/s, "
          f"ridge point {roof.ridge:.1f} FLOP/byte; its threads got {roof.cpu_share:.0%} of their cores")
    ok = roof.quiet  # a block peak is kept when trusted, even when the float one was not
    best: dict[str, BlockPeak] = {}
    for module in default_block_modules():
        peak = block_peak(module, float_peak=roof.peak_flops if roof.quiet else 0.0, again=True)
        good = trusted(peak, roof.peak_flops if roof.quiet else 0.0)
        ok = ok and good
        if peak.kind not in best or peak.peak_flops > best[peak.kind].peak_flops:
            best[peak.kind] = peak
        if not good:
            print(f"  {peak.kind.upper()} block kernel {peak.timed_on}: {peak.peak_flops / 1e9:,.1f} GFLOP/s, "
                  f"its threads got {peak.cpu_share:.0%} of their cores: not trusted", file=sys.stderr)
    for p in best.values():
        print(f"  {p.kind.upper()} block kernel peak {p.peak_flops / 1e9:,.1f} GFLOP/s ({p.timed_on}), ridge point "
              f"{p.peak_flops / roof.bandwidth:.1f} FLOP/byte")
    if ok:
        print(f"kept in {default_cache_path()} for the X-Ray and the tutorial")
        return 0
    print("not all kept: other work shared the cores; run it again when the host is quiet", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
