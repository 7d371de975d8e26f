"""Tensor parallelism on this machine: tokens/s at each N, and where a step's time went.

For each tensor-parallel size N (default: every N up to max(cores, 3) that splits the model's
heads; SmolLM2: 1 and 3) the same greedy prompts run on one engine, and the table shows:

- tokens/s (output tokens over the generation's wall time) and its ratio to N = 1 measured in
  the same run (machines differ, ratios travel better);
- communication per output token: rank 0's seconds inside collectives (``time.perf_counter``
  around each all-reduce and the logits gather, a wait for the slowest rank included) over
  the output tokens, and its share of rank 0's forward time;
- the all-reduces per step and the p50 / p99 latency of one all-reduce (rank 0's, every
  all-reduce of the run).

Every figure comes from the ``StepTiming`` the runner measured for each step, the numbers
``StepTimed`` carries to the app (the table says so only when the two sums agree). On one CPU
N > 1 is slower: the ranks share the cores and the memory bandwidth, and every token waits
for ``2 * layers + 1`` all-reduces. Not a test: nothing is asserted.

    python benchmarks/benchmark_tensor_parallel.py            # N = 1 and 3, 4 prompts x 32 tokens
    python benchmarks/benchmark_tensor_parallel.py --quick    # 2 prompts x 8 tokens (smoke run)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.common, when run as a script

import torch  # noqa: E402

from benchmarks.common import HostCheck, check_json_path, cpu_name, fmt, percentile, table, write_json  # noqa: E402

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "Explain what a KV cache is.",
           "List three prime numbers:"]


@dataclass
class Row:
    """One tensor-parallel size, measured (seconds, tokens, bytes)."""

    tp_size: int
    threads_per_rank: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    steps: int
    batch_tokens: int  # tokens through the model over the steps (prompt and decode), as StepTimed counts them
    forward_s_rank0: float
    comm_s_rank0: float
    comm_s_max_rank: float
    comm_per_token_s: float
    comm_share: float
    all_reduces: int
    all_reduce_bytes: int
    p50_all_reduce_s: float | None
    p99_all_reduce_s: float | None
    events_agree: bool
    weight_format: str  # what the weights ran as (model_info's weight_format; N > 1: rank 0's shard)


def measure(model: str | None, n: int, prompts: list[str], max_tokens: int) -> Row:
    """Run ``prompts`` greedily at tensor-parallel size ``n``; every figure from the runner's per-step timing."""
    from nanovllm_core import LLM, SamplingParams
    from nanovllm_core import events as ev

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Float weights at every N: tensor parallelism splits float weights only, so N = 1 in the file's blocks
    # (the default on the CPU) would compare weight formats, not sizes.
    with LLM(model, device="cpu", num_kv_blocks=64, tensor_parallel_size=n, quantization="none",
             progress=lambda *a: None) as llm:
        engine = llm.engine
        weight_format = engine.model_info()["weight_format"]
        workers = engine.runner.workers
        threads = workers.worker_threads if workers is not None else torch.get_num_threads()
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm
        timed: list[ev.StepTimed] = []
        engine.subscribe(lambda e: timed.append(e) if isinstance(e, ev.StepTimed) else None, topk=0)
        timings = []
        for p in prompts:
            engine.add_request(p, params)
        tokens = 0
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
            if engine.runner.tp_timing is not None:
                timings.append(engine.runner.tp_timing)
                engine.runner.tp_timing = None
        wall = time.perf_counter() - t0
    forward0 = sum(t.wall_s[0] for t in timings)
    comm0 = sum(t.comm_s[0] for t in timings)
    comm_max = max((sum(t.comm_s[r] for t in timings) for r in range(n)), default=0.0) if timings else 0.0
    latencies = [x for t in timings for x in t.latencies_s]
    agree = (not timings and all(t.tp_size == 1 for t in timed)) or (
        len(timed) == len(timings) and all(e.tp_comm_s == t.comm_s and e.tp_forward_s == t.wall_s
                                           for e, t in zip(timed, timings)))
    return Row(tp_size=n, threads_per_rank=threads, output_tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, steps=len(timed),
               batch_tokens=sum(e.num_tokens for e in timed),
               forward_s_rank0=forward0, comm_s_rank0=comm0, comm_s_max_rank=comm_max,
               comm_per_token_s=comm0 / max(tokens, 1), comm_share=comm0 / forward0 if forward0 else 0.0,
               all_reduces=sum(t.all_reduces for t in timings), all_reduce_bytes=sum(t.all_reduce_bytes for t in timings),
               p50_all_reduce_s=percentile(latencies, 50), p99_all_reduce_s=percentile(latencies, 99),
               events_agree=agree, weight_format=weight_format)


def print_table(rows: list[Row]) -> None:
    base = next((r for r in rows if r.tp_size == 1), None)
    body = []
    for r in rows:
        body.append([str(r.tp_size), str(r.threads_per_rank), str(r.output_tokens), fmt(r.tokens_per_s),
                     fmt(r.tokens_per_s / base.tokens_per_s, "x") if base else "-",
                     fmt(r.comm_per_token_s * 1e3, " ms") if r.tp_size > 1 else "-",
                     f"{r.comm_share:.0%}" if r.tp_size > 1 else "-",
                     fmt(r.all_reduces / r.steps, "") if r.tp_size > 1 and r.steps else "-",
                     fmt(r.p50_all_reduce_s * 1e6, " us") if r.p50_all_reduce_s is not None else "-",
                     fmt(r.p99_all_reduce_s * 1e6, " us") if r.p99_all_reduce_s is not None else "-",
                     "yes" if r.events_agree else "NO"])
    print(table(["N", "threads/rank", "tokens", "tokens/s", "vs N=1", "comm/token", "comm share", "all-reduces/step",
                 "p50 all-reduce", "p99 all-reduce", "StepTimed = measured"], body))
    print("comm: rank 0's seconds inside all-reduces and the logits gather (waits for the slowest rank included); "
          "share: of rank 0's forward time (model + LM head; scheduling and sampling excluded)")


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 prompts x 8 tokens: a smoke run")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--sizes", default=None,
                   help="comma-separated tensor-parallel sizes (default: every size up to max(cores, 3) that splits "
                        "the model: 1 and 3 for SmolLM2)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 32, quick 8)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the cores); each of N ranks gets min(this, cores // N), at least 1")
    args = p.parse_args(argv)
    check_json_path(p, args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    from nanovllm_core.config import ModelConfig
    from nanovllm_core.model.loader import load_hf_config, resolve_model
    from nanovllm_core.model.parallel import valid_sizes

    cfg = ModelConfig.from_hf(load_hf_config(resolve_model(args.model).path))
    if args.sizes:
        try:
            sizes = [int(s) for s in args.sizes.split(",")]
        except ValueError:
            p.error(f"--sizes takes integers separated by commas, got {args.sizes!r}")
    else:
        sizes = valid_sizes(cfg, max(os.cpu_count() or 1, 3))
    prompts = PROMPTS[:2] if args.quick else PROMPTS
    max_tokens = args.max_tokens or (8 if args.quick else 32)
    host = HostCheck()
    print(f"tensor parallelism, {cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads, cpu, float weights "
          f"at every N (--quantization none; N > 1 splits float weights only), gloo, {len(prompts)} prompts x "
          f"{max_tokens} tokens, {cpu_name()} ({os.cpu_count()} cores)", flush=True)
    rows = []
    for n in sizes:
        rows.append(measure(args.model, n, prompts, max_tokens))
        print(f"  measured N={n}", file=sys.stderr, flush=True)
    print_table(rows)
    print("weights: " + "; ".join(f"N={r.tp_size} {r.weight_format}" + (" (rank 0's shard)" if r.tp_size > 1 else "")
                                  for r in rows))
    host.report()
    write_json(args.json, [asdict(r) for r in rows])
    return rows


if __name__ == "__main__":
    main()
