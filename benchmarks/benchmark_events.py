"""What listening to the engine costs: throughput with no subscriber, a minimal one, and full detail.

    python -m benchmarks.benchmark_events [--requests 32] [--max-tokens 64] [--repeats 5] [--quick]

Each configuration runs the same greedy workload on the default model in the same process,
interleaved over several repeats, prefix caching off (so no run finds an earlier run's
prompts cached). Reported: the best and the median output tokens/s of each, and the best's
difference to "none" (the best run removes most of a shared machine's noise).

- none: no subscriber; the engine builds no event at all.
- minimal: one subscriber with ``topk=0, blocks=False`` (plans, tokens, timings only).
- full: ``topk=5, blocks=True`` (what the app's dashboard and block map ask for).
- xray: full plus the X-Ray of one request per step as the app's X-Ray tab (and a server's X-Ray
  watcher) asks for it: one chosen layer (``select_xray(None, layer=L)``), the other layers run
  untraced through the fused C layers where the model has them.
- xray_all: full plus every layer's trace of one request per step (``every_layer=True``): what the
  CLI's ``--xray`` asks for, and what every X-Ray capture cost before issue 29 (all layers step by
  step in Python).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanovllm_core import LLM, SamplingParams

from benchmarks.common import HostCheck, check_json_path, cpu_name, write_json
from nanovllm_core.cli import positive_int

CONFIGS = {
    "none": None,
    "minimal": dict(topk=0, blocks=False, xray=False),
    "full": dict(topk=5, blocks=True, xray=False),
    "xray": dict(topk=5, blocks=True, xray=True),
    "xray_all": dict(topk=5, blocks=True, xray=True),
}
SELECT = {"xray": dict(every_layer=False), "xray_all": dict(every_layer=True)}  # what each X-Ray captures


def run_once(llm: LLM, prompts: list[str], params: SamplingParams, listen: dict | None,
             select: dict | None = None) -> float:
    sub = llm.engine.subscribe(lambda e: None, **listen) if listen is not None else None
    if select is not None:  # the middle layer: layers run fused before and after it
        llm.engine.select_xray(None, layer=llm.engine.model_config.num_hidden_layers // 2, head=0, **select)
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        if sub is not None:
            llm.engine.unsubscribe(sub)
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=positive_int, default=32)
    ap.add_argument("--max-tokens", type=positive_int, default=64)
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--quick", action="store_true", help="a small smoke run (4 requests x 4 tokens, once; overrides the three above)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    check_json_path(ap, args.json)
    if args.quick:
        args.requests, args.max_tokens, args.repeats = 4, 4, 1
    host = HostCheck()
    llm = LLM(num_kv_blocks=1024, enable_prefix_caching=False, progress=lambda *a: None)
    prompts = [f"Write a short note number {i} about the sea and the sky." for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    run_once(llm, prompts, params, None)  # warm-up: the whole workload once, not timed
    runs: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(args.repeats):
        for name, listen in CONFIGS.items():
            runs[name].append(run_once(llm, prompts, params, listen, SELECT.get(name)))
    best = {name: max(r) for name, r in runs.items()}
    median = {name: statistics.median(r) for name, r in runs.items()}
    base = best["none"]
    print(f"{args.requests} requests x {args.max_tokens} tokens, {args.repeats} interleaved repeats, "
          f"{torch.get_num_threads()} threads, {cpu_name()}")
    print(f"{'subscriber':<10} {'best tok/s':>10} {'median':>8} {'best vs none':>13}")
    for name, tps in best.items():
        print(f"{name:<10} {tps:>10.1f} {median[name]:>8.1f} {100 * (tps / base - 1):>+12.1f}%")
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "tokens_per_s": best, "median_tokens_per_s": median,
              "relative_to_none": {k: v / base for k, v in best.items()},
              "host_warnings": host.report({f"subscriber {name}": r for name, r in runs.items()})}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
