"""Every weight format of the default model against float32: quality, memory, bytes per token and speed, in one process.

    python -m benchmarks.benchmark_quantization            # full: 3 interleaved rounds of each speed figure
    python -m benchmarks.benchmark_quantization --quick    # a smoke run: tiny inputs, one round
    python -m benchmarks.benchmark_quantization --quick --skip-hf --skip-llamacpp   # shorter: no transformers, no llama.cpp
    python -m benchmarks.benchmark_quantization --modes float32,gguf,q8_0 --threads 2 --json quant.json

Modes (``--modes``, default ``float32,gguf,q8_0,q4_0``; float32 is always one, every ratio
is against it): ``float32`` (``--quantization none``), ``gguf`` (the shipped file's own Q4_1
blocks and its Q8_0 embedding) and ``q8_0`` / ``q4_0`` / ``q4_1`` (the float weights quantized
at load, embedding in Q8_0). Each mode's model is loaded once and
shared by every figure below. The report names the CPU, its flags, cores and threads beside the figures.

Memory (per mode):
- weights as built (``weight_formats``): bytes per format over the linear layers, LM head and
  embedding, a tied head counted once;
- resident growth: the process's RSS after loading the mode minus before, MB, both read after
  ``gc.collect()`` and ``malloc_trim`` (Linux; ``-`` elsewhere), with one throwaway load first
  so that no mode carries the first load's one-time costs (imports, thread pools, allocator
  arenas; a mode's own first use, e.g. building its C kernel, stays in its figure). It counts all the load leaves
  resident: weights, packed copies (float32 keeps its weight and oneDNN's packed copy),
  rotary tables, a tokenizer; the peak during the load (``load_peak_rss_growth_bytes``)
  shows transient copies (the quantize-at-load modes, ``q8_0``/``q4_0``/``q4_1``, are built from
  float32 weights first; ``gguf`` builds its blocks straight from the file's tensors, so its peak
  is the mapped blocks beside their packed copy, docs/cpu-kernels.md);
- bytes a decode token reads: the linear layers' and LM head's weights with their scales
  (``linear_weight_bytes``); the embedding row and the KV cache are left out.

Memory bandwidth: a streaming read (``torch.sum``) of a 512 MiB float32 buffer, many times the
last-level cache, in this process's threads (``nanovllm_core.roofline.memory_bandwidth``, as
the X-Ray measures it), best of several; measured once per run and used for every mode.

Quality, each mode against float32 on ``benchmarks/corpus.txt`` and a held-out text (the
repository's ``README.md``, which the model was not tuned on, or ``--held-out FILE``; left out
with a note when absent; the figures in docs/cpu-kernels.md used the project's seed README,
which is not shipped):
- perplexity (windows of 512 tokens, our model run directly; the first 129 tokens with
  ``--quick``) and its relative change;
- greedy agreement: prompts of 16-64 tokens cut from the text, greedy tokens each (32 x 32;
  2 x 4 with ``--quick``); per prompt, the tokens equal to float32's before the first
  difference; the share is their sum over all tokens.

Speed (wall time; each round runs every system once, the order rotating between rounds;
medians over rounds, so a burst of load on a shared machine hits one round of one system):
- batch-1 decode: one prompt of 32 tokens, 128 greedy tokens (8 with ``--quick``); decode
  tokens/s = (n - 1) / (time of the last token - time of the first), for each mode, transformers
  ``generate`` (``--skip-hf`` leaves it out) and, where llama-cpp-python is installed
  (``pip install -e ".[llamacpp]"``), llama.cpp on the shipped Q4_1 file with as many threads
  as ours (the same prompt ids; ``--skip-llamacpp`` leaves it out). Ratios: each mode / float32,
  each mode / llama.cpp (``gguf`` / llama.cpp runs the same blocks);
- bandwidth share: bytes a decode token reads x decode tokens/s / memory bandwidth, per mode
  (and llama.cpp, credited with ``gguf``'s bytes: the same blocks); 1.0 would be every token
  limited by weight reads alone;
- the 64-request default workload (``benchmarks.common.make_workload``; 4 short requests with
  ``--quick``), useful output tokens/s of each mode, each round on a fresh engine (no prefix
  cache carried over), each mode / float32;
- float32 on that workload as a fraction of the measured float32 matmul peak
  (2 x parameters x tokens / time / peak, as ``benchmark_comparison`` computes it).

The report ends with a warning for every system whose rounds (or bandwidth samples) differ
by more than 15%, and for a load average above the cores at the start or end
(``noise_warnings``); the JSON keeps them as ``host_warnings``.

``--gather-ab`` adds, for both speed figures, each mode with the CPU paged attention kernel
turned off (``NANOVLLM_CPU_PAGED_ATTENTION=0``: gather + PyTorch SDPA),
interleaved with the rest, and prints the kernel's speed-up over that path.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import importlib.util
import math
import os
import random
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from benchmarks.common import (  # noqa: F401 (MAX_*: the limits, read by the tests)
    CORPUS,
    MAX_LOAD_PER_CORE,
    MAX_ROUND_SPREAD,
    HostCheck,
    PeakRSS,
    busy_host_warnings,
    check_json_path,
    corpus_token_ids,
    cpu_flags,
    fmt,
    gemm_peaks,
    llamacpp_model,
    llamacpp_notes,
    machine_summary,
    make_workload,
    table,
    write_json,
)
from nanovllm_core.cli import positive_int

MODE_CHOICES = ("float32", "gguf", "q8_0", "q4_0", "q4_1")  # what --modes accepts
DEFAULT_MODES = ("float32", "gguf", "q8_0", "q4_0")
QUANT = {m: ("none" if m == "float32" else m) for m in MODE_CHOICES}  # mode -> LLM(quantization=...); "none": float32 (no flag would pick the file's blocks)
BANDWIDTH_BYTES = 512 * 2**20  # the streaming-read buffer: many times any CPU's last-level cache
# The repository's own README: English the model was not tuned on, in every clone. The figures in
# docs/cpu-kernels.md used the project's seed README (shared/seed/original-readme.txt beside the
# repository), which is not shipped.
HELD_OUT = Path(__file__).resolve().parents[1] / "README.md"


def load(quantization: str | None):
    """(model, tokenizer, resolved) of the default model on the CPU in float32 activations."""
    from nanovllm_core.model.loader import load_model

    return load_model(None, torch.device("cpu"), torch.float32, quantization=quantization)


def rss_bytes() -> int | None:
    """This process's resident set (bytes) after a garbage collection and ``malloc_trim(0)``
    (freed heap pages given back), from /proc/self/status; None where Linux's is unavailable."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return PeakRSS._status("VmRSS")


def load_modes(modes: list[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Load every mode once: ``({mode: (model, tokenizer, resolved)}, {mode: memory figures})``.

    Memory figures, bytes: ``weight_formats`` / ``weight_bytes`` (the weights as built),
    ``linear_weight_bytes`` (what a decode token reads), ``rss_growth_bytes`` (resident set
    after the load minus before) and ``load_peak_rss_growth_bytes`` (the peak during the load
    minus before); the last two None where they cannot be read. A throwaway load of a
    small block mode comes first, so that the first load's one-time costs land on no mode:
    ``q4_0``, or ``gguf`` when no mode is quantized at load (the file's blocks, a load a few
    seconds cheaper than quantizing, e.g. ``--modes float32,gguf``).
    """
    from nanovllm_core.model.quantization import linear_weight_bytes, weight_formats

    loaded: dict[str, Any] = {}
    memory: dict[str, dict[str, Any]] = {}
    if rss_bytes() is not None:
        at_load = [m for m in modes if m not in ("float32", "gguf")]  # modes quantized from float at load
        load("q4_0" if at_load else "gguf")  # the throwaway load: its result is dropped at once
    for m in modes:
        before = rss_bytes()
        with PeakRSS() as peak:
            loaded[m] = load(QUANT[m])
        after = rss_bytes()
        formats = weight_formats(loaded[m][0])
        memory[m] = {
            "weight_formats": formats, "weight_bytes": sum(formats.values()),
            "linear_weight_bytes": linear_weight_bytes(loaded[m][0]),
            "rss_growth_bytes": None if before is None or after is None else after - before,
            "load_peak_rss_growth_bytes": None if before is None else peak.peak_bytes - before,
        }
        print(f"loaded {m}", file=sys.stderr, flush=True)
    return loaded, memory


def measure_bandwidth(samples: int) -> list[float]:
    """``samples`` streaming-read bandwidths, bytes/s, each a fresh :data:`BANDWIDTH_BYTES` buffer
    summed once after a warm-up sum (``roofline.memory_bandwidth``); the run takes the best."""
    from nanovllm_core.roofline import memory_bandwidth

    return [memory_bandwidth(BANDWIDTH_BYTES, repeats=1) for _ in range(samples)]


def held_out_ids(tokenizer, path: Path) -> list[int] | None:
    """Token ids of the held-out text at ``path``, or None when the file is not there."""
    if not path.is_file():
        return None
    return tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)


def cut_prompts(ids: list[int], count: int, seed: int = 1, lengths: tuple[int, int] = (16, 64)) -> list[list[int]]:
    """``count`` prompts cut from ``ids`` at distinct offsets, lengths uniform in ``lengths`` (inclusive)."""
    rng = random.Random(seed)
    starts = rng.sample(range(max(1, len(ids) - lengths[1])), count)
    return [ids[s:s + rng.randint(*lengths)] for s in starts]


@contextmanager
def gather_path() -> Iterator[None]:
    """Engines built inside run attention on the gather path (the CPU paged kernel turned off)."""
    from nanovllm_core.attention.cpu_paged import ENV_SWITCH

    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_SWITCH, None)
        else:
            os.environ[ENV_SWITCH] = before


def on_gather_path(measure: Callable[[], float]) -> Callable[[], float]:
    """``measure`` run with engines on the gather path."""
    def run() -> float:
        with gather_path():
            return measure()
    return run


def fresh_llm(loaded, quantization: str | None, num_kv_blocks: int = 512, **engine_kwargs: Any):
    """An ``LLM`` over an already loaded model, with its own empty KV pool and prefix cache."""
    from nanovllm_core.config import EngineConfig
    from nanovllm_core.engine.llm_engine import LLMEngine
    from nanovllm_core.llm import LLM

    config = EngineConfig(device="cpu", dtype="float32", quantization=quantization, num_kv_blocks=num_kv_blocks,
                          **engine_kwargs)
    return LLM.from_engine(LLMEngine(config, *loaded))


@torch.inference_mode()
def perplexity(model, ids: list[int], window: int = 512) -> float:
    """exp(mean next-token negative log-likelihood) over ``ids`` in non-overlapping windows.

    Attention runs as the engine runs it for this model (``ModelRunner``'s choices): the CPU
    paged kernel where it is available, else SDPA.
    """
    from nanovllm_core.attention import cpu_paged
    from nanovllm_core.attention.contiguous import ContiguousKVCache

    p = next(model.parameters())
    use_kernel = cpu_paged.available(p.device, p.dtype, "flash")
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        n = len(chunk) - 1
        cache = ContiguousKVCache(model.config, n, p.dtype, p.device, "flash", use_kernel)
        hidden = model(torch.tensor(chunk[:-1]), torch.arange(n), cache.context(0, n))
        logits = model.compute_logits(hidden)
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()
        count += n
    return math.exp(nll / count)


def greedy_tokens(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from nanovllm_core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """Share of tokens equal to the reference's before each prompt's first difference."""
    same = 0
    for a, b in zip(reference, other):
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
    return same / sum(len(a) for a in reference)


def decode_rate_ours(llm, prompt: list[int], n: int) -> float:
    """Batch-1 decode tokens/s: (n - 1) / (last token time - first token time)."""
    from nanovllm_core.sampling_params import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0]
    return 1.0 / out.metrics.time_per_output_token


def decode_rate_hf(hf_model, prompt: list[int], n: int) -> float:
    from benchmarks.benchmark_comparison import _hf_generation_config, _StepClock

    clock = _StepClock()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), streamer=clock,
                          generation_config=_hf_generation_config(hf_model, n))
    return (n - 1) / (clock.times[n - 1] - clock.times[0])


def decode_rate_llamacpp(llm, prompt: list[int], n: int) -> float:
    """llama.cpp's batch-1 decode tokens/s on the same prompt ids, timed as ``decode_rate_ours``."""
    times: list[float] = []
    llm.reset()
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # greedy; never stops at EOS by itself
        times.append(time.perf_counter())
        if len(times) == n:
            break
    return (n - 1) / (times[-1] - times[0])


def workload_rate(loaded, quantization: str | None, workload) -> tuple[float, float]:
    """(useful output tokens/s, wall seconds) of the whole workload on a fresh default engine."""
    from nanovllm_core.sampling_params import SamplingParams

    bs = 16
    need = sum(-(-(len(p) + n) // bs) for p, n in zip(workload.prompts, workload.output_lens))
    llm = fresh_llm(loaded, quantization, num_kv_blocks=need + workload.num_requests + 8)
    greedy_tokens(llm, [workload.prompts[0][:8]], 2)  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in workload.output_lens]
    t0 = time.perf_counter()
    llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return workload.output_tokens / elapsed, elapsed


def interleaved(systems: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run every system once per round, rotating the order; all figures per system."""
    names = list(systems)
    figures: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            figures[name].append(systems[name]())
    return figures


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.benchmark_comparison import CPU, _hf_model, num_parameters

    modes = args.modes
    host = HostCheck()  # the load at the start; noise_warnings gives its note from both ends
    load_start = host.load_at_start
    peaks = gemm_peaks()
    samples = measure_bandwidth(3 if args.quick else 7)
    bandwidth = max(samples)
    loaded, memory = load_modes(modes)
    summary_kernel = {m: fresh_llm(loaded[m], QUANT[m], num_kv_blocks=8).engine.model_info()["attention_backend"]
                      for m in modes}
    tokenizer = loaded["float32"][1]
    summary: dict[str, Any] = {"machine": machine_summary(), "cpu_flags": cpu_flags(), "modes": modes,
                               "rounds": args.rounds, "attention_kernel": summary_kernel}
    summary["machine"]["load_average_at_start"] = load_start
    summary["memory_bandwidth"] = {"bytes_per_s": bandwidth, "samples": samples, "buffer_bytes": BANDWIDTH_BYTES}
    summary["memory"] = memory
    bytes_per_token = {m: memory[m]["linear_weight_bytes"] for m in modes}
    summary["linear_weight_bytes"] = bytes_per_token

    # -- quality
    texts = {"corpus": corpus_token_ids(tokenizer)}
    held = held_out_ids(tokenizer, args.held_out)
    held_out_note = None
    if held is None:
        held_out_note = f"held-out text {args.held_out} not found: quality on the corpus only"
        print(held_out_note, file=sys.stderr, flush=True)
    else:
        texts["held-out"] = held
    num_prompts, gen = (2, 4) if args.quick else (32, 32)
    quality: dict[str, Any] = {"texts": {}, "greedy_prompts": num_prompts, "greedy_tokens_per_prompt": gen,
                               "held_out_note": held_out_note}
    for name, ids in texts.items():
        ppl_ids = ids[:129] if args.quick else ids
        ppl = {m: perplexity(loaded[m][0], ppl_ids) for m in modes}
        prompts = cut_prompts(ids, num_prompts)
        greedy = {m: greedy_tokens(fresh_llm(loaded[m], QUANT[m]), prompts, gen) for m in modes}
        quality["texts"][name] = {
            "path": str(CORPUS if name == "corpus" else args.held_out), "perplexity_tokens": len(ppl_ids),
            "perplexity": ppl, "perplexity_change": {m: ppl[m] / ppl["float32"] - 1.0 for m in modes},
            "greedy_agreement_until_first_difference": {m: agreement(greedy["float32"], greedy[m]) for m in modes},
        }
    summary["quality"] = quality
    print("quality done", file=sys.stderr, flush=True)

    # -- batch-1 decode
    n = 8 if args.quick else 128  # --quick: 7 decode intervals still make a rate
    prompt = texts["corpus"][100:132]
    hf = None if args.skip_hf else _hf_model(CPU)
    systems: dict[str, Callable[[], float]] = {
        m: (lambda m=m: decode_rate_ours(fresh_llm(loaded[m], QUANT[m], num_kv_blocks=64), prompt, n)) for m in modes}
    if hf is not None:
        systems["transformers"] = lambda: decode_rate_hf(hf, prompt, n)
    lcpp = None
    if not args.skip_llamacpp and importlib.util.find_spec("llama_cpp") is not None:
        threads = torch.get_num_threads()  # as many as ours (--threads, else torch's choice)
        lcpp = llamacpp_model(n_ctx=len(prompt) + n + 8, threads=threads)
        systems["llama.cpp"] = lambda: decode_rate_llamacpp(lcpp, prompt, n)
        summary["llamacpp"] = llamacpp_notes(threads)
    if args.gather_ab:
        systems.update({f"{m} gather": on_gather_path(systems[m]) for m in modes})
    for name in systems:  # warm-up, outside the figures
        systems[name]()
    b1 = interleaved(systems, args.rounds)
    med = {k: statistics.median(v) for k, v in b1.items()}
    lc = med.get("llama.cpp")
    share = {m: bytes_per_token[m] * med[m] / bandwidth for m in modes}
    if lc is not None and "gguf" in modes:
        share["llama.cpp"] = bytes_per_token["gguf"] * lc / bandwidth  # the same blocks as gguf reads
    summary["batch1_decode"] = {
        "tokens": n, "prompt_tokens": len(prompt), "tokens_per_s": med, "all_rounds": b1,
        "over_float32": {m: med[m] / med["float32"] for m in modes},
        "over_llamacpp": {m: med[m] / lc for m in modes} if lc is not None else None,
        "gguf_over_llamacpp": med["gguf"] / lc if lc is not None and "gguf" in modes else None,
        "q8_0_over_float32": med["q8_0"] / med["float32"] if "q8_0" in modes else None,
        "bandwidth_share": share,
        "over_transformers": {m: med[m] / med["transformers"] for m in modes} if hf is not None else None,
    }
    systems.clear()
    hf = lcpp = None  # free transformers' model and llama.cpp's before the workload
    print("batch-1 decode done", file=sys.stderr, flush=True)

    # -- the 64-request workload
    if args.quick:
        workload = make_workload(tokenizer, num_requests=4, prompt_range=(8, 24), output_range=(3, 6))
    else:
        workload = make_workload(tokenizer, num_requests=64)
    elapsed: dict[str, list[float]] = {}

    def one(m: str, key: str) -> float:
        rate, secs = workload_rate(loaded[m], QUANT[m], workload)
        elapsed.setdefault(key, []).append(secs)
        return rate

    wl_systems = {m: (lambda m=m: one(m, m)) for m in modes}
    if args.gather_ab:
        wl_systems.update({f"{m} gather": on_gather_path(lambda m=m: one(m, f"{m} gather")) for m in modes})
    wl = interleaved(wl_systems, args.rounds)
    peaks = {k: max(v, peaks.get(k, 0.0)) for k, v in gemm_peaks().items()}
    peak = max(peaks.values())
    params = num_parameters()
    med_wl = {k: statistics.median(v) for k, v in wl.items()}
    f32_secs = statistics.median(elapsed["float32"])
    summary["workload"] = {
        **workload.summary(), "useful_tokens_per_s": med_wl, "all_rounds": wl,
        "over_float32": {m: med_wl[m] / med_wl["float32"] for m in modes},
        "float32_roofline_fraction": 2.0 * params * (workload.prompt_tokens + workload.output_tokens) / f32_secs / peak,
    }
    if args.gather_ab:
        summary["cpu_paged_over_gather"] = {
            m: {"batch1_decode": med[m] / med[f"{m} gather"], "workload": med_wl[m] / med_wl[f"{m} gather"]}
            for m in modes}
    summary["gemm_peak_flops"] = peak
    summary["gemm_peaks_flops_by_path"] = peaks
    host.note()
    summary["machine"]["load_average_at_end"] = host.load_at_end
    summary["host_warnings"] = noise_warnings(summary)
    return summary


def noise_warnings(s: dict[str, Any]) -> list[str]:
    """Warnings that the speed figures of summary ``s`` were measured on a busy host: a system whose
    rounds differ by more than :data:`MAX_ROUND_SPREAD`, bandwidth samples that do, or a 1-minute
    load average above the cores at the start or end of the run (``common.busy_host_warnings``: the
    busy-host note every benchmark prints, ``nanovllm_core.host_load``)."""
    rounds = {f"{name} {label}": values
              for section, label in (("batch1_decode", "batch-1 decode"), ("workload", "workload"))
              for name, values in s[section].get("all_rounds", {}).items()}
    m = s["machine"]
    out = busy_host_warnings(rounds, m.get("load_average_at_start"), m.get("load_average_at_end"), m.get("cpu_count"),
                             own=m.get("torch_threads") or 0)  # the run's own threads are not other work
    gb = [x / 1e9 for x in s.get("memory_bandwidth", {}).get("samples", [])]
    return out + busy_host_warnings({"memory bandwidth": gb} if gb else None, unit="GB/s")


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.0f} MB"


def _pct(x: float | None, signed: bool = False) -> str:
    return "-" if x is None else (f"{100 * x:+.2f}%" if signed else f"{100 * x:.1f}%")


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def report(s: dict[str, Any]) -> str:
    m = s["machine"]
    modes, q, b1, wl, mem = s["modes"], s["quality"], s["batch1_decode"], s["workload"], s["memory"]
    bw = s["memory_bandwidth"]
    lc = b1["tokens_per_s"].get("llama.cpp")
    lines = [
        f"machine: {m['cpu']} ({', '.join(s['cpu_flags']) or 'flags unknown'}), {m['cpu_count']} cores, "
        f"torch {m['torch']} threads {m['torch_threads']}; load average {m['load_average_at_start']} at start, "
        f"{m['load_average_at_end']} at end; medians of {s['rounds']} interleaved round(s); attention kernel: "
        + ", ".join(f"{mode} {k}" for mode, k in s["attention_kernel"].items()),
        f"memory read bandwidth: {bw['bytes_per_s'] / 1e9:.1f} GB/s (best of {len(bw['samples'])} sums over "
        f"{bw['buffer_bytes'] / 2**20:.0f} MiB, {m['torch_threads']} threads; measured once, used for every mode)",
        "",
        "memory (MB = 10^6 bytes)",
        table(["mode", "weights as built", "total", "resident growth", "load peak", "read per token"],
              [[mode, " + ".join(f"{k} {v / 1e6:,.0f}" for k, v in mem[mode]["weight_formats"].items()),
                _mb(mem[mode]["weight_bytes"]), _mb(mem[mode]["rss_growth_bytes"]),
                _mb(mem[mode]["load_peak_rss_growth_bytes"]), _mb(mem[mode]["linear_weight_bytes"])] for mode in modes]),
        "",
        f"quality against float32 (greedy: {q['greedy_prompts']} prompts x {q['greedy_tokens_per_prompt']} tokens a text, "
        "share equal before the first difference)",
    ]
    texts = q["texts"]
    headers = ["mode"]
    for name, t in texts.items():
        headers += [f"{name} ppl ({t['perplexity_tokens']} tok)", "vs float32", "greedy = float32"]
    lines.append(table(headers, [
        [mode] + [cell for t in texts.values() for cell in (
            f"{t['perplexity'][mode]:.3f}", _pct(t["perplexity_change"][mode], signed=True),
            _pct(t["greedy_agreement_until_first_difference"][mode]))]
        for mode in modes]))
    if q.get("held_out_note"):
        lines.append(q["held_out_note"])
    rows = [[mode, fmt(b1["tokens_per_s"][mode]), _x(b1["over_float32"][mode]),
             _x(b1["over_llamacpp"][mode]) if b1["over_llamacpp"] else "-", _pct(b1["bandwidth_share"][mode]),
             fmt(wl["useful_tokens_per_s"][mode]), _x(wl["over_float32"][mode])] for mode in modes]
    if "transformers" in b1["tokens_per_s"]:
        rows.append(["transformers fp32", fmt(b1["tokens_per_s"]["transformers"]), "-", "-", "-", "-", "-"])
    if lc is not None:
        rows.append(["llama.cpp Q4_1", fmt(lc), "-", "1.00x", _pct(b1["bandwidth_share"].get("llama.cpp")), "-", "-"])
    lines += [
        "",
        f"speed: batch-1 decode of {b1['tokens']} greedy tokens after a {b1['prompt_tokens']}-token prompt; "
        f"{wl['num_requests']}-request workload, useful output tokens/s",
        table(["mode", "batch-1 tok/s", "/ float32", "/ llama.cpp", "of bandwidth", f"{wl['num_requests']}-request tok/s",
               "/ float32"], rows),
        "",
        "of bandwidth = bytes read per token (weights) x tokens/s / measured bandwidth",
    ]
    over = [mode for mode, share in b1["bandwidth_share"].items() if share is not None and share > 1]
    if over:  # trial 45a: "158.3%" printed with nothing to say it cannot be a rate the memory reached
        lines.append(f"({', '.join(over)} above 100%: no decode reads faster than memory, so the bandwidth was "
                     "measured low, on a busy host; rerun when it is quiet)")
    goals = []
    if b1.get("gguf_over_llamacpp") is not None:
        goals.append(f"gguf / llama.cpp = {b1['gguf_over_llamacpp']:.2f}x (llama-cpp-python "
                     f"{s['llamacpp']['llama_cpp_python']}, shipped Q4_1, {s['llamacpp']['threads']} threads, AMX repack "
                     f"{s['llamacpp']['amx_repack']})")
    if b1["over_float32"].get("gguf") is not None:  # the default mode, which the README quotes (trial 45a)
        goals.append(f"gguf / float32 = {b1['over_float32']['gguf']:.2f}x")
    if b1.get("q8_0_over_float32") is not None:
        goals.append(f"q8_0 / float32 = {b1['q8_0_over_float32']:.2f}x")
    if goals:
        lines.append(f"batch-1 decode on {m['cpu']}: " + "; ".join(goals))
    lines.append(f"{wl['num_requests']}-request workload: float32 at {100 * wl['float32_roofline_fraction']:.1f}% of the "
                 f"float32 matmul peak ({s['gemm_peak_flops'] / 1e9:.0f} GFLOP/s, 2048^3)")
    if "cpu_paged_over_gather" in s:
        lines.append("CPU paged kernel / gather path: " + "; ".join(
            f"{mode} batch-1 {r['batch1_decode']:.2f}x, {wl['num_requests']}-request {r['workload']:.2f}x "
            f"(gather: {fmt(b1['tokens_per_s'][mode + ' gather'])} and {fmt(wl['useful_tokens_per_s'][mode + ' gather'])} tok/s)"
            for mode, r in s["cpu_paged_over_gather"].items()))
    lines += noise_warnings(s)
    return "\n".join(lines)


def parse_modes(text: str) -> list[str]:
    """``--modes`` as a list: known names, float32 among them, none twice (argparse's one-line error otherwise)."""
    modes = [t.strip().lower() for t in text.split(",") if t.strip()]
    unknown = [t for t in modes if t not in MODE_CHOICES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(unknown)}; use {', '.join(MODE_CHOICES)}")
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError("a mode is listed more than once")
    if "float32" not in modes:
        raise argparse.ArgumentTypeError("float32 must be one of the modes: every ratio and quality figure is against it")
    return modes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.benchmark_quantization", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny inputs, one round")
    ap.add_argument("--modes", type=parse_modes, default=list(DEFAULT_MODES),
                    help=f"comma-separated weight formats, float32 among them (default {','.join(DEFAULT_MODES)}; "
                         f"choices {', '.join(MODE_CHOICES)})")
    ap.add_argument("--rounds", type=positive_int, default=None, help="interleaved rounds per speed figure (default 3; 1 with --quick)")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's own choice)")
    ap.add_argument("--held-out", type=Path, default=HELD_OUT,
                    help="a held-out text for perplexity and greedy agreement (default: the repository's README.md, "
                         "which the model was not tuned on)")
    ap.add_argument("--skip-hf", action="store_true", help="leave transformers out of the batch-1 decode figures")
    ap.add_argument("--skip-llamacpp", action="store_true",
                    help="leave llama.cpp out of the batch-1 decode figures (it is in them when llama-cpp-python "
                         "is installed: pip install -e \".[llamacpp]\")")
    ap.add_argument("--json", metavar="FILE", help="also write all figures to FILE as JSON")
    ap.add_argument("--gather-ab", action="store_true",
                    help="also run both speed figures with the CPU paged attention kernel off (gather + SDPA)")
    args = ap.parse_args(argv)
    check_json_path(ap, args.json)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    summary = run(args)
    print(report(summary))
    write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
