"""The scheduler and block manager alone: how many steps per second they can plan, and what a step costs.

    python -m benchmarks.benchmark_scheduler_unit [--quick] [--json FILE]

No model runs. A stand-in model runner does the engine's bookkeeping after each planned
step (``num_computed_tokens`` advanced, newly full blocks hashed for the prefix cache, one
made-up token appended to each sequence that samples, finished sequences removed and
their blocks freed), so the figures are the cost of scheduling itself:

1. steps/s with 100, 1,000 and 10,000 requests queued at once (prompts 16-256 tokens,
   outputs 16-128, token budget 512, ``max_num_seqs`` 64): the planning overhead an
   engine step pays on top of its forward pass, and how it grows with the waiting queue;
2. the cost of one decode step against the number of running sequences (1 to 1,024):
   the per-sequence work of planning (block checks, allocation, hashing).

For scale: one forward pass of the default model on 2 CPU cores takes tens to hundreds of
milliseconds, so a planning cost of a few hundred microseconds is noise.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from nanovllm_core.engine.block_manager import BlockManager
from nanovllm_core.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm_core.engine.sequence import Sequence, SequenceStatus
from nanovllm_core.sampling_params import SamplingParams

from benchmarks.common import HostCheck, check_json_path, fmt, percentile, table, write_json

BLOCK_SIZE = 16


def make_requests(n: int, seed: int, prompt_range=(16, 256), output_range=(16, 128)) -> list[Sequence]:
    """``n`` sequences with random token ids (no shared prefixes) and drawn lengths."""
    rng = random.Random(seed)
    seqs = []
    for i in range(n):
        prompt = [rng.randrange(100, 49000) for _ in range(rng.randint(*prompt_range))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(*output_range), ignore_eos=True)
        seqs.append(Sequence(seq_id=i, request_id=str(i), token_ids=prompt, num_prompt_tokens=len(prompt),
                             params=params))
    return seqs


class StandInRunner:
    """Does what the engine does after a forward pass, without one: advance, hash, append, finish."""

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.finished = 0

    def step(self, plan: SchedulerOutput) -> None:
        for s in plan.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if s.samples:
                seq.token_ids.append(7)  # the stand-in model always answers token 7
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.scheduler.remove(seq)
                    seq.status = SequenceStatus.FINISHED
                    self.finished += 1


def run_queue(num_requests: int, num_blocks: int, max_num_seqs: int = 64, token_budget: int = 512,
              seed: int = 0, **req_kwargs) -> dict[str, Any]:
    """Queue ``num_requests`` at once and plan steps until all finish; return timing figures."""
    bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, token_budget=token_budget, policy="priority")
    runner = StandInRunner(sched, bm)
    seqs = make_requests(num_requests, seed, **req_kwargs)
    t0 = time.perf_counter()
    for seq in seqs:
        sched.add(seq)
    add_s = time.perf_counter() - t0
    step_times = []
    t0 = time.perf_counter()
    while sched.has_unfinished():
        t = time.perf_counter()
        plan = sched.schedule()
        runner.step(plan)
        step_times.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - t0
    if runner.finished != num_requests or bm.num_used_blocks:
        raise RuntimeError(f"stand-in run ended with {runner.finished}/{num_requests} finished, "
                           f"{bm.num_used_blocks} blocks held")
    return {
        "num_requests": num_requests,
        "steps": len(step_times),
        "steps_per_s": len(step_times) / elapsed,
        "step_p50_s": percentile(step_times, 50),
        "step_p99_s": percentile(step_times, 99),
        "add_all_s": add_s,
        "elapsed_s": elapsed,
        "preemptions": sched.num_preemptions,
    }


def step_cost_vs_running(running: int, steps: int = 50, seed: int = 0) -> dict[str, Any]:
    """Cost of a decode step (schedule + stand-in bookkeeping) with ``running`` sequences decoding, in seconds."""
    out_len = steps + 10
    bm = BlockManager(running * (-(-(64 + out_len) // BLOCK_SIZE) + 1), BLOCK_SIZE)
    sched = Scheduler(bm, max_num_seqs=running, token_budget=max(512, running * 64), policy="priority")
    runner = StandInRunner(sched, bm)
    for seq in make_requests(running, seed, prompt_range=(32, 64), output_range=(out_len, out_len)):
        sched.add(seq)
    runner.step(sched.schedule())  # all prompts in one step; from here every step is pure decode
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        plan = sched.schedule()
        runner.step(plan)
        times.append(time.perf_counter() - t)
        if len(plan.scheduled) != running or any(s.kind != "decode" for s in plan.scheduled):
            raise RuntimeError("expected a pure decode step of every running sequence")
    p50 = percentile(times, 50)
    return {"running": running, "step_mean_s": sum(times) / len(times), "step_p50_s": p50,
            "per_sequence_s": p50 / running, "step_p99_s": percentile(times, 99)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.benchmark_scheduler_unit",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (10 and 100 requests; up to 64 running)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    args = ap.parse_args(argv)
    check_json_path(ap, args.json)
    sizes = (10, 100) if args.quick else (100, 1_000, 10_000)
    running = (1, 8, 64) if args.quick else (1, 8, 64, 256, 1024)
    host = HostCheck()
    queue = [run_queue(n, num_blocks=2048) for n in sizes]
    costs = [step_cost_vs_running(r, steps=10 if args.quick else 50) for r in running]
    print("Planning whole workloads (token budget 512, max_num_seqs 64, 2,048 KV blocks of 16 tokens):")
    print(table(["requests", "steps", "steps/s", "step p50 ms", "step p99 ms", "queueing all ms", "preemptions"],
                [[f"{q['num_requests']:,}", f"{q['steps']:,}", fmt(q["steps_per_s"]), fmt(q["step_p50_s"] * 1e3),
                  fmt(q["step_p99_s"] * 1e3), fmt(q["add_all_s"] * 1e3), str(q["preemptions"])] for q in queue]))
    print("\nOne decode step against the number of running sequences:")
    print(table(["running", "step p50 ms", "step mean ms", "step p99 ms", "per sequence us (p50)"],
                [[f"{c['running']:,}", fmt(c["step_p50_s"] * 1e3), fmt(c["step_mean_s"] * 1e3),
                  fmt(c["step_p99_s"] * 1e3), fmt(c["per_sequence_s"] * 1e6)] for c in costs]))
    result = {"queue": queue, "step_cost_vs_running": costs, "host_warnings": host.report()}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
