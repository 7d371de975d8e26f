"""int8 against float32 weights on the default model: quality, bytes per token and speed, in one process.

    python -m benchmarks.benchmark_quantization            # full: 3 interleaved rounds of each speed figure
    python -m benchmarks.benchmark_quantization --quick    # a smoke run: tiny inputs, one round
    python -m benchmarks.benchmark_quantization --rounds 5 --threads 2 --json quant.json

Quality:
- perplexity on ``benchmarks/corpus.txt`` (windows of 512 tokens, our model run directly),
  int8's relative to float32's;
- greedy agreement: 32 prompts cut from the corpus, 32 greedy tokens each (4 prompts of 8
  tokens with ``--quick``); per prompt, the tokens equal to float32's before the first difference; the
  share is their sum over all tokens.

Bytes: the linear layers' weights one decode step reads (``linear_weight_bytes``).

Speed (wall time; each round runs every system once, the order rotating between rounds;
medians over rounds, so a burst of load on a shared machine hits one round of one system):
- batch-1 decode: one prompt, 128 greedy tokens; decode tokens/s = 127 / (time of the last
  token - time of the first), for our float32, our int8, transformers ``generate`` and, where
  llama-cpp-python is installed (``pip install -e ".[llamacpp]"``), llama.cpp on the shipped
  Q4_1 file with as many threads as ours (the same prompt ids; ``--skip-llamacpp`` leaves it out);
- the 64-request default workload (``benchmarks.common.make_workload``), useful output
  tokens/s for our float32 and int8, each round on a fresh engine (no prefix cache carried over);
- float32 on that workload as a fraction of the measured float32 matmul peak
  (2 x parameters x tokens / time / peak, as ``benchmark_comparison`` computes it).

The report ends with a warning for every system whose rounds differ by more than 15%, and
for a load average above 1.5 per core at the end (``noise_warnings``).

``--gather-ab`` adds, for both speed figures, each mode with the CPU paged attention kernel
turned off (``NANOVLLM_CPU_PAGED_ATTENTION=0``: gather + PyTorch SDPA, float64 under int8),
interleaved with the rest, and prints the kernel's speed-up over that path.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from benchmarks.common import (  # noqa: F401 (MAX_*: the limits, read by the tests)
    MAX_LOAD_PER_CORE,
    MAX_ROUND_SPREAD,
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

MODES = ("float32", "int8")


def load(quantization: str | None):
    """(model, tokenizer, resolved) of the default model on the CPU in float32 activations."""
    from nanovllm_core.model.loader import load_model

    return load_model(None, torch.device("cpu"), torch.float32, quantization=quantization)


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
    paged kernel where it is available, else SDPA with int8's float64 K/V and sums.
    """
    from nanovllm_core.attention import cpu_paged
    from nanovllm_core.attention.contiguous import ContiguousKVCache
    from nanovllm_core.engine.model_runner import kv_cache_dtype

    p = next(model.parameters())
    use_kernel = cpu_paged.available(p.device, p.dtype, "flash")
    kv_dtype = kv_cache_dtype(model, "flash")
    sum_dtype = kv_dtype if kv_dtype != p.dtype else None
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        n = len(chunk) - 1
        cache = ContiguousKVCache(model.config, n, kv_dtype, p.device, "flash", sum_dtype, use_kernel)
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
    from nanovllm_core.model.int8_linear import weight_range
    from nanovllm_core.model.quantization import linear_weight_bytes

    load_start = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    peaks = gemm_peaks()
    loaded = {"float32": load(None), "int8": load("int8")}
    quant = {"float32": None, "int8": "int8"}
    summary_kernel = {m: fresh_llm(loaded[m], quant[m], num_kv_blocks=8).engine.model_info()["attention_backend"]
                      for m in MODES}
    tokenizer = loaded["float32"][1]
    corpus = corpus_token_ids(tokenizer)
    summary: dict[str, Any] = {"machine": machine_summary(), "cpu_flags": cpu_flags(),
                               "int8_weight_range": weight_range(), "rounds": args.rounds}
    summary["machine"]["load_average_at_start"] = load_start
    summary["attention_kernel"] = summary_kernel

    # -- bytes
    summary["linear_weight_bytes"] = {m: linear_weight_bytes(loaded[m][0]) for m in MODES}

    # -- quality
    ppl_ids = corpus[:129] if args.quick else corpus
    ppl = {m: perplexity(loaded[m][0], ppl_ids) for m in MODES}
    num_prompts, gen = (4, 8) if args.quick else (32, 32)
    prompts = make_workload(tokenizer, num_requests=num_prompts, seed=1, prompt_range=(16, 64), output_range=(1, 1)).prompts
    greedy = {m: greedy_tokens(fresh_llm(loaded[m], quant[m]), prompts, gen) for m in MODES}
    summary["quality"] = {
        "perplexity": ppl, "perplexity_tokens": len(ppl_ids),
        "perplexity_change": ppl["int8"] / ppl["float32"] - 1.0,
        "greedy_agreement_until_first_difference": agreement(greedy["float32"], greedy["int8"]),
        "greedy_prompts": num_prompts, "greedy_tokens_per_prompt": gen,
    }
    print("quality done", file=sys.stderr, flush=True)

    # -- batch-1 decode
    n = 16 if args.quick else 128
    prompt = corpus[100:132]
    hf = None if args.skip_hf else _hf_model(CPU)
    systems: dict[str, Callable[[], float]] = {
        m: (lambda m=m: decode_rate_ours(fresh_llm(loaded[m], quant[m], num_kv_blocks=64), prompt, n)) for m in MODES}
    if hf is not None:
        systems["transformers"] = lambda: decode_rate_hf(hf, prompt, n)
    lcpp = None
    if not args.skip_llamacpp and importlib.util.find_spec("llama_cpp") is not None:
        threads = torch.get_num_threads()  # as many as ours (--threads, else torch's choice)
        lcpp = llamacpp_model(n_ctx=len(prompt) + n + 8, threads=threads)
        systems["llama.cpp"] = lambda: decode_rate_llamacpp(lcpp, prompt, n)
        summary["llamacpp"] = llamacpp_notes(threads)
    if args.gather_ab:
        systems.update({f"{m} gather": on_gather_path(systems[m]) for m in MODES})
    for name in systems:  # warm-up, outside the figures
        systems[name]()
    b1 = interleaved(systems, args.rounds)
    med = {k: statistics.median(v) for k, v in b1.items()}
    summary["batch1_decode"] = {
        "tokens": n, "tokens_per_s": med, "all_rounds": b1,
        "int8_over_float32": med["int8"] / med["float32"],
        "float32_over_transformers": med["float32"] / med["transformers"] if hf is not None else None,
        "int8_over_transformers": med["int8"] / med["transformers"] if hf is not None else None,
        "int8_over_llamacpp": med["int8"] / med["llama.cpp"] if lcpp is not None else None,
    }
    del hf, lcpp
    print("batch-1 decode done", file=sys.stderr, flush=True)

    # -- the 64-request workload
    if args.quick:
        workload = make_workload(tokenizer, num_requests=4, prompt_range=(8, 24), output_range=(3, 6))
    else:
        workload = make_workload(tokenizer, num_requests=64)
    elapsed: dict[str, list[float]] = {m: [] for m in MODES}

    def one(m: str) -> float:
        rate, secs = workload_rate(loaded[m], quant[m], workload)
        elapsed[m].append(secs)
        return rate

    def one_gather(m: str) -> float:
        rate, secs = workload_rate(loaded[m], quant[m], workload)
        elapsed[f"{m} gather"].append(secs)
        return rate

    wl_systems = {m: (lambda m=m: one(m)) for m in MODES}
    if args.gather_ab:
        elapsed.update({f"{m} gather": [] for m in MODES})
        wl_systems.update({f"{m} gather": on_gather_path(lambda m=m: one_gather(m)) for m in MODES})
    wl = interleaved(wl_systems, args.rounds)
    peaks = {k: max(v, peaks.get(k, 0.0)) for k, v in gemm_peaks().items()}
    peak = max(peaks.values())
    params = num_parameters()
    med_wl = {k: statistics.median(v) for k, v in wl.items()}
    best_f32 = statistics.median(elapsed["float32"])
    summary["workload"] = {
        **workload.summary(), "useful_tokens_per_s": med_wl, "all_rounds": wl,
        "int8_over_float32": med_wl["int8"] / med_wl["float32"],
        "float32_roofline_fraction": 2.0 * params * (workload.prompt_tokens + workload.output_tokens) / best_f32 / peak,
    }
    if args.gather_ab:
        summary["cpu_paged_over_gather"] = {
            m: {"batch1_decode": med[m] / med[f"{m} gather"], "workload": med_wl[m] / med_wl[f"{m} gather"]}
            for m in MODES}
    summary["gemm_peak_flops"] = peak
    summary["gemm_peaks_flops_by_path"] = peaks
    summary["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return summary


def noise_warnings(s: dict[str, Any]) -> list[str]:
    """Warnings that the speed figures of summary ``s`` were measured on a busy host: a system whose
    rounds differ by more than :data:`MAX_ROUND_SPREAD`, or a 1-minute load average above
    :data:`MAX_LOAD_PER_CORE` per core at the start or end of the run (``common.busy_host_warnings``)."""
    rounds = {f"{name} {label}": values
              for section, label in (("batch1_decode", "batch-1 decode"), ("workload", "workload"))
              for name, values in s[section].get("all_rounds", {}).items()}
    m = s["machine"]
    return busy_host_warnings(rounds, m.get("load_average_at_start"), m.get("load_average_at_end"), m.get("cpu_count"))


def report(s: dict[str, Any]) -> str:
    m = s["machine"]
    q, b1, wl = s["quality"], s["batch1_decode"], s["workload"]
    lines = [
        f"machine: {m['cpu']} ({', '.join(s['cpu_flags']) or 'flags unknown'}), {m['cpu_count']} cores, "
        f"torch {m['torch']} threads {m['torch_threads']}; load average {m['load_average_at_start']} at start, "
        f"{m['load_average_at_end']} at end; int8 weights in [-{s['int8_weight_range']}, {s['int8_weight_range']}]; "
        f"medians of {s['rounds']} interleaved round(s); attention kernel: "
        + ", ".join(f"{m} {k}" for m, k in s["attention_kernel"].items()),
        "",
        table(["weights", "linear bytes/step", "perplexity", "greedy = float32", "batch-1 decode tok/s",
               f"{wl['num_requests']}-request tok/s"],
              [[mode, f"{s['linear_weight_bytes'][mode] / 1e6:,.1f} MB", f"{q['perplexity'][mode]:.3f}",
                "-" if mode == "float32" else f"{100 * q['greedy_agreement_until_first_difference']:.1f}%",
                fmt(b1["tokens_per_s"][mode]), fmt(wl["useful_tokens_per_s"][mode])] for mode in MODES]
              + ([["transformers fp32", "-", "-", "-", fmt(b1["tokens_per_s"]["transformers"]), "-"]]
                 if "transformers" in b1["tokens_per_s"] else [])
              + ([["llama.cpp Q4_1", "-", "-", "-", fmt(b1["tokens_per_s"]["llama.cpp"]), "-"]]
                 if "llama.cpp" in b1["tokens_per_s"] else [])),
        "",
        f"int8 perplexity {100 * q['perplexity_change']:+.2f}% vs float32 ({q['perplexity_tokens']} corpus tokens); "
        f"greedy agreement until first difference over {q['greedy_prompts']} prompts x {q['greedy_tokens_per_prompt']} tokens",
        f"batch-1 decode ({b1['tokens']} tokens): int8 / float32 = {b1['int8_over_float32']:.2f}x"
        + (f"; float32 / transformers = {b1['float32_over_transformers']:.2f}x; int8 / transformers = "
           f"{b1['int8_over_transformers']:.2f}x" if b1["float32_over_transformers"] is not None else "")
        + (f"; int8 / llama.cpp = {b1['int8_over_llamacpp']:.2f}x (llama-cpp-python "
           f"{s['llamacpp']['llama_cpp_python']}, shipped Q4_1, {s['llamacpp']['threads']} threads, AMX repack "
           f"{s['llamacpp']['amx_repack']})" if b1.get("int8_over_llamacpp") is not None else ""),
        f"{wl['num_requests']}-request workload: int8 / float32 = {wl['int8_over_float32']:.2f}x; float32 at "
        f"{100 * wl['float32_roofline_fraction']:.1f}% of the float32 matmul peak "
        f"({s['gemm_peak_flops'] / 1e9:.0f} GFLOP/s, 2048^3)",
    ]
    if "cpu_paged_over_gather" in s:
        lines.append("CPU paged kernel / gather path: " + "; ".join(
            f"{m} batch-1 {r['batch1_decode']:.2f}x, {wl['num_requests']}-request {r['workload']:.2f}x "
            f"(gather: {fmt(b1['tokens_per_s'][m + ' gather'])} and {fmt(wl['useful_tokens_per_s'][m + ' gather'])} tok/s)"
            for m, r in s["cpu_paged_over_gather"].items()))
    lines += noise_warnings(s)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.benchmark_quantization", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny inputs, one round")
    ap.add_argument("--rounds", type=positive_int, default=None, help="interleaved rounds per speed figure (default 3; 1 with --quick)")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's own choice)")
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
