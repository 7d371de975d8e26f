"""Our engine against Hugging Face transformers on one workload, in one process, one system after another.

    python -m benchmarks.benchmark_comparison                      # default workload, all four systems
    python -m benchmarks.benchmark_comparison --workload chat      # short prompts, long outputs
    python -m benchmarks.benchmark_comparison --systems ours,hf-padded --quick --json out.json
    python -m benchmarks.benchmark_comparison --quick --device cuda   # on a GPU, in its default dtype

Systems (the same model, float32 on the CPU except ``ours-gguf`` and ``llamacpp``, greedy, every request
produces exactly its own output length; ``--device cuda`` runs every system on the GPU in
``EngineConfig``'s default dtype there):

- ``hf-sequential``: ``model.generate`` one request at a time, in arrival order.
- ``hf-padded``: ``model.generate`` on left-padded batches of ``--hf-batch-size`` requests;
  each batch runs to its longest output, the tokens past a request's own length are waste.
- ``hf-generate-batch``: transformers' continuous batching, the manager that
  ``model.generate_batch`` drives. ``generate_batch`` takes one ``max_new_tokens`` for all
  requests, so we drive its manager the same way it does (``add_request`` then
  ``get_result``) with each request's own ``max_new_tokens``; nothing is generated past a
  request's length.
- ``ours``: ``nanovllm_core.LLM.generate`` with the default engine settings but float32 weights
  (``quantization="none"``: the same weights as transformers'; the CPU default keeps a GGUF's blocks).
- ``ours-gguf``: the same with ``quantization="gguf"``: the shipped file's own Q4_1/Q8_0 blocks,
  the engine's CPU default for it.
- ``llamacpp`` (optional, when ``llama_cpp`` is importable: ``pip install -e ".[llamacpp]"``,
  which compiles llama.cpp for minutes): llama-cpp-python on the GGUF file we ship (its own
  4-bit Q4_1 weights), 2 threads, one request after another like ``hf-sequential``. On an AMX
  CPU its AMX weight repack is off (``benchmarks.common.llamacpp_model`` says why).

How each figure is measured (all times ``time.perf_counter``, all N requests arrive at the
start of a system's run, so TTFT includes the time a request waits for earlier ones):

- useful output tokens/s: sum of the requests' own output lengths / the run's wall time.
  Padding and tokens past a request's length are not counted.
- TTFT: run start -> the request's first output token. hf-sequential and hf-padded: a
  streamer records the time of every generated step (for a padded batch its first step is
  every member's first token); hf-generate-batch: the manager's per-token timestamps;
  ours: ``RequestOutput.metrics``.
- TPOT: (time of the request's last own token - time of its first) / (its tokens - 1).
- peak RSS: the process's resident-memory high-water mark during the run (reset before it),
  weights and KV cache included, and whatever earlier systems in the same process still hold:
  ask for one system alone (``--systems llamacpp``) for its own figure.
- roofline fraction: 2 x parameters x (prompt tokens + useful output tokens) / wall time /
  the measured peak of the kernel that ran the row's matmuls. Padding is not real work. The float
  rows: the float32 2048^3 matmul's. ``ours-gguf``: its projections run the block kernels (int8
  products over the GGUF's Q4_1/Q8_0 blocks, a higher peak; attention stays float), so its peak is
  the fastest of the kernels it ran, each timed as the X-Ray times it
  (``nanovllm_core.roofline.block_peak`` on layer 0's projections): the run cannot beat that, so the
  figure is a true fraction (the float32 peak gave 114.5%, trial 29d). Where no trusted peak is known
  (``llamacpp``'s own kernels, a block peak timed on a busy host) the column reads ``-``.
- ``ours is``: each baseline's useful tokens/s against ``ours`` (the float32 weights, the same as
  transformers'); ``-`` on our own rows (``ours-gguf`` is the engine's default on the CPU, not a baseline).

Model loading, KV-pool allocation and one short warm-up request are outside the timed run.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from nanovllm_core.config import default_dtype
from benchmarks.common import (
    HostCheck,
    check_json_path,
    PeakRSS,
    Workload,
    default_model_dir,
    fmt,
    gemm_peaks,
    llamacpp_model,
    llamacpp_notes,
    machine_summary,
    make_workload,
    percentile,
    table,
    write_json,
)

SYSTEMS = ("hf-sequential", "hf-padded", "hf-generate-batch", "ours", "ours-gguf")
OURS = ("ours", "ours-gguf")  # our own rows: no "ours is" ratio against themselves
OPTIONAL_SYSTEMS = ("llamacpp",)  # asked for by name; never in the default list
HF_SYSTEMS = SYSTEMS[:3]


@dataclass
class SystemResult:
    """One system's run of the workload.

    ``ttft_s``/``tpot_s``: per request, seconds; ``outputs``: per request, its generated token
    ids (exactly its own length); ``computed_tokens``: tokens the system ran through the
    model, padding included.
    """

    name: str
    elapsed_s: float
    ttft_s: list[float]
    tpot_s: list[float | None]
    outputs: list[list[int]]
    peak_rss_bytes: int = 0
    computed_tokens: int = 0
    cpu_s: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)
    kernel_peaks: dict[str, float | None] | None = None  # kernel -> its peak FLOP/s (None: not known); None: the float matmul's


class _StepClock:
    """A transformers streamer that only records when each generated step's tokens arrive.

    ``generate`` first hands the streamer the prompt, then one tensor per decoding step
    (``[batch]`` token ids); the first is skipped.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class Target:
    """Where every system runs: ``device`` and ``dtype`` (float32 on the CPU; see ``--device``)."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32

    def tensor(self, data) -> torch.Tensor:
        return torch.tensor(data, device=self.device)


CPU = Target()


def _hf_model(target: Target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=target.dtype)
    return model.to(target.device).eval()


def _hf_generation_config(model, max_new_tokens: int):
    from transformers import GenerationConfig

    # min_new_tokens = max_new_tokens: end-of-sequence cannot stop a request early, so every
    # request produces exactly its length (ours gets min_tokens to match: the same logits).
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                            pad_token_id=pad, eos_token_id=model.config.eos_token_id)


def run_hf_sequential(workload: Workload, target: Target = CPU) -> SystemResult:
    """transformers ``generate``, one request after another."""
    model = _hf_model(target)
    with torch.inference_mode():
        model.generate(target.tensor([workload.prompts[0][:8]]), generation_config=_hf_generation_config(model, 2))
        ttft, tpot, outputs = [], [], []
        with PeakRSS() as mem:
            t0, c0 = time.perf_counter(), time.process_time()
            for prompt, n in zip(workload.prompts, workload.output_lens):
                clock = _StepClock()
                ids = target.tensor([prompt])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=clock,
                                     generation_config=_hf_generation_config(model, n))
                outputs.append(out[0, len(prompt):].tolist())
                ttft.append(clock.times[0] - t0)
                tpot.append((clock.times[n - 1] - clock.times[0]) / (n - 1) if n > 1 else None)
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return SystemResult("hf-sequential", elapsed, ttft, tpot, outputs, mem.peak_bytes, cpu_s=cpu,
                        computed_tokens=workload.prompt_tokens + workload.output_tokens)


def run_hf_padded(workload: Workload, batch_size: int, target: Target = CPU) -> SystemResult:
    """transformers ``generate`` on left-padded batches, in arrival order."""
    model = _hf_model(target)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    n_req = workload.num_requests
    ttft: list[float] = [0.0] * n_req
    tpot: list[float | None] = [None] * n_req
    outputs: list[list[int]] = [[] for _ in range(n_req)]
    computed = 0
    with torch.inference_mode():
        model.generate(target.tensor([workload.prompts[0][:8]]), generation_config=_hf_generation_config(model, 2))
        with PeakRSS() as mem:
            t0, c0 = time.perf_counter(), time.process_time()
            for start in range(0, n_req, batch_size):
                idx = list(range(start, min(start + batch_size, n_req)))
                width = max(len(workload.prompts[i]) for i in idx)
                steps = max(workload.output_lens[i] for i in idx)
                ids = torch.full((len(idx), width), pad, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for row, i in enumerate(idx):
                    p = workload.prompts[i]
                    ids[row, width - len(p):] = torch.tensor(p)
                    mask[row, width - len(p):] = 1
                clock = _StepClock()
                ids, mask = ids.to(target.device), mask.to(target.device)
                out = model.generate(ids, attention_mask=mask, streamer=clock,
                                     generation_config=_hf_generation_config(model, steps))
                computed += len(idx) * (width + steps)
                for row, i in enumerate(idx):
                    n = workload.output_lens[i]
                    outputs[i] = out[row, width:width + n].tolist()
                    ttft[i] = clock.times[0] - t0
                    tpot[i] = (clock.times[n - 1] - clock.times[0]) / (n - 1) if n > 1 else None
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return SystemResult("hf-padded", elapsed, ttft, tpot, outputs, mem.peak_bytes, computed_tokens=computed, cpu_s=cpu,
                        notes={"batch_size": batch_size})


def run_hf_generate_batch(workload: Workload, max_batch_tokens: int | None, page_size: int = 256,
                          target: Target = CPU) -> SystemResult:
    """transformers continuous batching (the manager behind ``generate_batch``), each request its own length."""
    from transformers import ContinuousBatchingConfig

    model = _hf_model(target)
    # A KV pool that holds the whole workload at once (no eviction); the token budget per step
    # given, or transformers' default when None.
    pages = sum(-(-(len(p) + n) // page_size) for p, n in zip(workload.prompts, workload.output_lens))
    cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=pages + 2, max_batch_tokens=max_batch_tokens)
    gen_config = _hf_generation_config(model, max(workload.output_lens))
    gen_config.eos_token_id = -1  # the manager stops a request at its own max_new_tokens; no EOS stop
    n_req = workload.num_requests
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=30) as manager:
        manager_budget = getattr(getattr(manager, "cache", None), "max_batch_tokens", max_batch_tokens)
        manager.add_request(workload.prompts[0][:8], request_id="warmup", max_new_tokens=2)
        while not ((r := manager.get_result(timeout=1)) and r.is_finished()):
            pass
        results: dict[str, Any] = {}
        with PeakRSS() as mem:
            t0, c0 = time.perf_counter(), time.process_time()
            for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True)
            while len(results) < n_req:
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                elif r is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped before finishing")
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    ttft, tpot, outputs = [], [], []
    for i, n in enumerate(workload.output_lens):
        r = results[f"r{i}"]
        if r.error:
            raise RuntimeError(f"transformers' continuous batching failed request {i}: {r.error}")
        ts = r.timestamps
        outputs.append(list(r.generated_tokens))
        ttft.append(ts[0] - t0)
        tpot.append((ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else None)
    return SystemResult("hf-generate-batch", elapsed, ttft, tpot, outputs, mem.peak_bytes, cpu_s=cpu,
                        computed_tokens=workload.prompt_tokens + workload.output_tokens,
                        notes={"max_batch_tokens": manager_budget, "page_size": page_size})


def run_ours(workload: Workload, target: Target = CPU, name: str = "ours", **engine_kwargs: Any) -> SystemResult:
    """``nanovllm_core.LLM.generate`` over the whole workload, default engine settings unless given."""
    from nanovllm_core import LLM, SamplingParams
    from nanovllm_core.attention.selector import default_block_size
    from nanovllm_core.model.llama import ModelConfig
    from nanovllm_core.model.loader import load_hf_config

    if "num_kv_blocks" not in engine_kwargs and "kv_cache_memory" not in engine_kwargs:
        # A KV pool that holds the whole workload at once, like hf-generate-batch's: no
        # preemption, and a peak RSS comparable with the others' (the default pool is 2 GiB).
        head_dim = ModelConfig.from_hf(load_hf_config(default_model_dir())).head_dim
        bs = engine_kwargs.get("block_size") or default_block_size(target.device, target.dtype, head_dim)
        need = sum(-(-(len(p) + n) // bs) for p, n in zip(workload.prompts, workload.output_lens))
        engine_kwargs["num_kv_blocks"] = need + workload.num_requests + 8
    llm = LLM(device=target.device.type, dtype=str(target.dtype).replace("torch.", ""), **engine_kwargs)
    llm.generate([workload.prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    before = llm.stats()
    with PeakRSS() as mem:
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(workload.prompts, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = llm.stats()
    ttft = [o.metrics.time_to_first_token for o in outs]
    tpot = [o.metrics.time_per_output_token for o in outs]
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    return SystemResult(name, elapsed, ttft, tpot, outputs, mem.peak_bytes, cpu_s=cpu, kernel_peaks=block_kernel_peaks(llm.engine),
                        computed_tokens=workload.prompt_tokens + workload.output_tokens,
                        notes={"steps": stats["steps"] - before["steps"],
                               "num_preemptions": stats["num_preemptions"] - before["num_preemptions"],
                               "prefix_cache_hits": stats["prefix_cache_hits"] - before["prefix_cache_hits"],
                               "max_num_batched_tokens": llm.engine.scheduler.token_budget,
                               "max_num_seqs": llm.engine.scheduler.max_num_seqs})


def block_kernel_peaks(engine: Any, float_peak: float = 0.0) -> dict[str, float | None] | None:
    """The block kernels ``engine``'s projections run, each with its measured peak in FLOP/s, as the X-Ray
    times it (``educational.xray.block_modules``, ``roofline.block_peak``), None where the peak is not
    trusted (a busy host: ``roofline.trusted``) or the weights are not on the CPU; None for float weights
    (the float matmul's peak is theirs)."""
    from nanovllm_core import roofline
    from nanovllm_core.educational.xray import block_modules

    modules = block_modules(engine)
    if not modules:
        return None
    out: dict[str, float | None] = {}
    for m in modules:
        name = f"{str(m.kind).upper()} block kernel"
        if engine.device.type != "cpu":
            out[name] = None
            continue
        peak = roofline.block_peak(m, engine.device, float_peak=float_peak)
        out[name] = peak.peak_flops if roofline.trusted(peak, float_peak) else None
    return out


def row_peak(result: SystemResult, float_peak: float) -> float | None:
    """The FLOP/s a system's run is measured against: the fastest kernel that ran its matmuls (the run
    cannot beat it, so the fraction stays a fraction); the float matmul's for float weights; None when a
    kernel's peak is not known (llama.cpp's own, an untrusted block peak)."""
    if result.kernel_peaks is None:
        return float_peak
    peaks = list(result.kernel_peaks.values())
    if not peaks or any(p is None for p in peaks):
        return None
    return max([float_peak, *peaks])  # attention and the float ops run the float kernels beside them


def cuda_gemm_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> dict[str, float]:
    """The GPU's measured ``[n, n] @ [n, n]`` FLOP/s in ``dtype``, best of ``repeats`` (the roofline there)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        torch.mm(a, b)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return {"cuda": 2.0 * n ** 3 / best}


def run_llamacpp(workload: Workload, threads: int = 2) -> SystemResult:
    """llama-cpp-python on the shipped GGUF (Q4_1), greedy, one request after another, each its own length."""
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    llm = llamacpp_model(max(512, longest + 8), threads)

    def generate(prompt: list[int], n: int, times: list[float]) -> list[int]:
        out: list[int] = []
        llm.reset()
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # never stops at EOS by itself
            times.append(time.perf_counter())
            out.append(int(token))
            if len(out) == n:
                break
        return out

    generate(workload.prompts[0][:8], 2, [])  # warm-up
    ttft, tpot, outputs = [], [], []
    with PeakRSS() as mem:
        t0, c0 = time.perf_counter(), time.process_time()
        for prompt, n in zip(workload.prompts, workload.output_lens):
            times: list[float] = []
            outputs.append(generate(prompt, n, times))
            ttft.append(times[0] - t0)
            tpot.append((times[-1] - times[0]) / (n - 1) if n > 1 else None)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return SystemResult("llamacpp", elapsed, ttft, tpot, outputs, mem.peak_bytes, cpu_s=cpu,
                        kernel_peaks={"llama.cpp's kernels": None},
                        computed_tokens=workload.prompt_tokens + workload.output_tokens,
                        notes=llamacpp_notes(threads))


def num_parameters() -> int:
    """Parameters of the default model (tied embedding counted once)."""
    from nanovllm_core.model.loader import load_hf_config
    from nanovllm_core.model.llama import ModelConfig

    return ModelConfig.from_hf(load_hf_config(default_model_dir())).num_parameters()


def summarize(workload: Workload, results: dict[str, SystemResult], peak: float, params: int) -> dict[str, Any]:
    """All figures in the JSON shape of issue 9 (plus per-system detail)."""
    real_flop = 2.0 * params * (workload.prompt_tokens + workload.output_tokens)
    systems: dict[str, Any] = {}
    for name, r in results.items():
        for i, (out, n) in enumerate(zip(r.outputs, workload.output_lens)):
            if len(out) != n:
                raise RuntimeError(f"{name}: request {i} produced {len(out)} tokens, expected {n}")
        tput = workload.output_tokens / r.elapsed_s
        ceiling = row_peak(r, peak)
        systems[name] = {
            "useful_tokens_per_s": tput,
            "ttft_p50_s": percentile(r.ttft_s, 50),
            "ttft_p99_s": percentile(r.ttft_s, 99),
            "tpot_p50_s": percentile(r.tpot_s, 50),
            "tpot_p99_s": percentile(r.tpot_s, 99),
            "peak_rss_bytes": r.peak_rss_bytes,
            "elapsed_s": r.elapsed_s,
            "cpu_s": r.cpu_s,
            "roofline_fraction": real_flop / r.elapsed_s / ceiling if ceiling else None,
            "roofline_peak_flops": ceiling,
            "kernel_peaks_flops": r.kernel_peaks,
            "computed_tokens": r.computed_tokens,
            **r.notes,
        }
    if "ours" in results:
        ours = results["ours"]
        for name, r in results.items():
            if name not in OURS:
                systems[name]["ours_speedup"] = systems["ours"]["useful_tokens_per_s"] / systems[name]["useful_tokens_per_s"]
            if name != "ours":
                same = sum(a == b for a, b in zip(r.outputs, ours.outputs))
                systems[name]["same_tokens_as_ours"] = same / workload.num_requests
    hf = [systems[n]["useful_tokens_per_s"] for n in HF_SYSTEMS if n in systems]
    return {
        "workload": workload.summary(),
        "systems": systems,
        "gemm_peak_flops": peak,
        "roofline_fraction": systems["ours"]["roofline_fraction"] if "ours" in systems else None,
        "speedup_vs_best_hf": systems["ours"]["useful_tokens_per_s"] / max(hf) if "ours" in systems and hf else None,
        "machine": machine_summary(),
        "num_parameters": params,
    }


def peaks_line(summary: dict[str, Any]) -> str:
    """Which peak each row's roofline fraction divides by: the float matmul's for float rows, the fastest
    kernel that ran it for a block row, none known (``-``) for the others."""
    dtype = summary["machine"]["dtype"]
    words = [f"roofline against the {dtype} matmul peak {summary['gemm_peak_flops'] / 1e9:.1f} GFLOP/s (2048^3)"]
    for name, s in summary["systems"].items():
        kernels = s.get("kernel_peaks_flops")
        if not kernels:
            continue
        known = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" if v else f"{k}'s not known" for k, v in kernels.items())
        if s.get("roofline_peak_flops"):
            words.append(f"{name} against the fastest kernel it ran, {s['roofline_peak_flops'] / 1e9:.1f} GFLOP/s "
                         f"({known})")
        else:
            words.append(f"{name}: no trusted peak ({known}), so no roofline")
    return "; ".join(words)


def report(summary: dict[str, Any]) -> str:
    """The figures as a text table with the ratios under it."""
    w = summary["workload"]
    head = (f"workload {w['name']}: {w['num_requests']} requests, prompts {w['prompt_tokens_range']} tokens, "
            f"outputs {w['output_tokens_range']} tokens (total {w['total_prompt_tokens']} prompt + "
            f"{w['total_output_tokens']} output), seed {w['seed']}, greedy, {summary['machine']['dtype']} "
            f"on {summary['machine']['device']}"
            + ("".join(f"; {n}: {what}" for n, what in (("ours-gguf", "the GGUF's own blocks"), ("llamacpp", "the GGUF's Q4_1"))
                       if n in summary["systems"]))
            + "\n"
            f"machine: {summary['machine']['cpu']}, {summary['machine']['cpu_count']} cores, "
            f"torch threads {summary['machine']['torch_threads']}; "
            f"{peaks_line(summary)}")
    rows = []
    for name, s in summary["systems"].items():
        rows.append([name, fmt(s["useful_tokens_per_s"]), fmt(s["ttft_p50_s"]), fmt(s["ttft_p99_s"]),
                     fmt(s["tpot_p50_s"] and s["tpot_p50_s"] * 1e3), fmt(s["tpot_p99_s"] and s["tpot_p99_s"] * 1e3),
                     f"{s['peak_rss_bytes'] / 2**20:,.0f}",
                     "-" if s["roofline_fraction"] is None else f"{100 * s['roofline_fraction']:.1f}%",
                     fmt(s.get("ours_speedup"), "x")])
    body = table(["system", "useful tok/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms",
                  "peak RSS MiB", "roofline", "ours is"], rows)
    tail = ""
    if summary["speedup_vs_best_hf"] is not None:
        tail = f"\nours / best transformers baseline: {summary['speedup_vs_best_hf']:.2f}x useful throughput"
    return f"{head}\n\n{body}{tail}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.benchmark_comparison", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("default", "chat"), default="default")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of {', '.join(SYSTEMS + OPTIONAL_SYSTEMS)} (run in this order; "
                         "llamacpp only when llama-cpp-python is installed)")
    ap.add_argument("--num-requests", type=int, default=None, help="requests in the workload (default 64; 4 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a small smoke run: 4 short requests")
    ap.add_argument("--hf-batch-size", type=int, default=32,
                    help="hf-padded batch size (default 32, its fastest of 8/16/32/64 on the default workload here)")
    ap.add_argument("--hf-max-batch-tokens", type=int, default=None,
                    help="hf-generate-batch token budget per step (default: transformers' own choice, 8192 "
                         "here, its fastest of 512/2048/8192)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for every system (default: torch's own choice, left as is)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where every system runs (default cpu, float32; cuda: the engine's default dtype there)")
    ap.add_argument("--json", metavar="FILE", help="also write all figures to FILE as JSON")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda was asked for but no CUDA GPU is available")
    check_json_path(ap, args.json)
    if args.hf_max_batch_tokens is not None and args.hf_max_batch_tokens < 1:
        ap.error("--hf-max-batch-tokens must be at least 1")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be at least 1")
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    twice = sorted({s for s in names if names.count(s) > 1})
    if twice:
        ap.error(f"system(s) listed more than once: {', '.join(twice)}")
    bad = [s for s in names if s not in SYSTEMS + OPTIONAL_SYSTEMS]
    if bad or not names:
        ap.error(f"unknown system(s) {', '.join(bad) or '(none given)'}; choose from "
                 f"{', '.join(SYSTEMS + OPTIONAL_SYSTEMS)}")
    if "llamacpp" in names:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            ap.error("system llamacpp needs llama-cpp-python: pip install -e \".[llamacpp]\" (it compiles for minutes)")
    args.system_list = names
    if args.num_requests is not None and args.num_requests < 1:
        ap.error("--num-requests must be at least 1")
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        ap.error("--hf-batch-size must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from nanovllm_core.model.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir())
    if args.quick:
        workload = make_workload(tokenizer, args.workload, args.num_requests or 4, args.seed,
                                 prompt_range=(8, 24), output_range=(3, 6))
    else:
        workload = make_workload(tokenizer, args.workload, args.num_requests or 64, args.seed)
    device = torch.device(args.device)
    target = Target(device, default_dtype(device))
    runners: dict[str, Callable[[], SystemResult]] = {
        "hf-sequential": lambda: run_hf_sequential(workload, target),
        "hf-padded": lambda: run_hf_padded(workload, min(args.hf_batch_size, workload.num_requests), target),
        "hf-generate-batch": lambda: run_hf_generate_batch(workload, args.hf_max_batch_tokens, target=target),
        "ours": lambda: run_ours(workload, target, quantization="none"),
        "ours-gguf": lambda: run_ours(workload, target, name="ours-gguf", quantization="gguf"),
        "llamacpp": lambda: run_llamacpp(workload),
    }
    host = HostCheck()
    measure_peaks = (lambda: gemm_peaks()) if device.type == "cpu" else (lambda: cuda_gemm_peak(target.dtype))
    peaks = measure_peaks()
    results = {}
    for name in args.system_list:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = runners[name]()
        print(f"  {name}: {results[name].elapsed_s:.1f} s", file=sys.stderr, flush=True)
        gc.collect()
        # Re-measured between systems: the best seen, over both matmul paths, is the peak.
        peaks = {k: max(v, peaks.get(k, 0.0)) for k, v in measure_peaks().items()}
    summary = summarize(workload, results, max(peaks.values()), num_parameters())
    summary["gemm_peaks_flops_by_path"] = peaks
    summary["machine"].update(device=str(device), dtype=str(target.dtype).replace("torch.", ""))
    if device.type == "cuda":
        summary["machine"]["gpu"] = torch.cuda.get_device_name(device)
    summary["machine"]["load_average_at_start"] = host.load_at_start
    print(report(summary))
    summary["host_warnings"] = host.report()
    write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
