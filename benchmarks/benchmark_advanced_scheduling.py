"""What each scheduling feature does, in numbers, on the default model on the CPU.

    python -m benchmarks.benchmark_advanced_scheduling --all
    python -m benchmarks.benchmark_advanced_scheduling --priority | --preemption | --chunked-prefill | --prefix-caching
    add --quick for a small smoke run, --json FILE to keep the figures

Each experiment runs the same requests twice, with the feature and without it (or with
two settings), on engines that share one loaded model (float32, greedy, ``ignore_eos``):

- ``--priority``: a small KV pool is busy with low-priority requests when high-priority
  ones arrive. Time to first token (TTFT) of each class under the ``priority`` policy
  (the urgent ones preempt) and under ``fcfs`` (they queue).
- ``--preemption``: the same requests with a pool that holds them all, and with one that
  holds about a third of them. How often sequences are preempted, how many tokens are
  computed again (recompute), and what that costs in time.
- ``--chunked-prefill``: requests are decoding when a long prompt arrives. The longest gap
  between two tokens of a running request (the decode stall) and the long request's TTFT,
  with the prompt prefilled in chunks of the token budget and in one piece.
- ``--prefix-caching``: requests sharing a long system prompt, the first alone, the rest
  together. Prefix-cache hit rate and the TTFT of the later requests, caching on and off.

Timings are wall-clock (``time.perf_counter``) on a possibly shared machine; compare the
two columns of one experiment, which ran one after the other in the same process.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from nanovllm_core import events as ev
from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_core.sampling_params import SamplingParams

from benchmarks.common import HostCheck, check_json_path, compared, corpus_token_ids, fmt, machine_summary, percentile, table, write_json

FEATURES = ("priority", "preemption", "chunked_prefill", "prefix_caching")


class Bench:
    """The default model loaded once; engines over it with different settings; prompts from the corpus."""

    def __init__(self, quick: bool) -> None:
        from nanovllm_core.model.loader import load_model

        self.model, self.tokenizer, self.resolved = load_model(None, torch.device("cpu"), torch.float32)
        self.quick = quick
        self.text = corpus_token_ids(self.tokenizer)
        self._cursor = 0

    def engine(self, **cfg: Any) -> LLMEngine:
        return LLMEngine(EngineConfig(**cfg), self.model, self.tokenizer, self.resolved)

    def prompt(self, length: int) -> list[int]:
        """``length`` tokens of real text, a new stretch each call (no accidental shared prefixes)."""
        ring = self.text * (length // len(self.text) + 2)
        out = ring[self._cursor:self._cursor + length]
        self._cursor = (self._cursor + 97) % len(self.text)
        return out


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def drain(engine: LLMEngine) -> dict[str, Any]:
    """Step until every request finishes; return finished outputs by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for out in engine.step():  # outputs of the last step (rejections would come here too)
        done[out.request_id] = out
    return done


# ---------------------------------------------------------------------------------- priority

def bench_priority(b: Bench) -> dict[str, Any]:
    n_low, n_high = (4, 2) if b.quick else (12, 4)
    prompt_len, out_len = (24, 8) if b.quick else (96, 32)
    per_seq = -(-(prompt_len + out_len) // 16)
    results = {}
    prompts_low = [b.prompt(prompt_len) for _ in range(n_low)]
    prompts_high = [b.prompt(prompt_len) for _ in range(n_high)]
    for policy in ("priority", "fcfs"):
        # A pool for about a third of the low-priority requests at once: the engine is busy.
        engine = b.engine(scheduling_policy=policy, num_kv_blocks=per_seq * max(2, n_low // 3),
                          enable_prefix_caching=False)
        low = [engine.add_request(p, params(out_len), priority=0) for p in prompts_low]
        for _ in range(3):  # the low-priority requests are running when the urgent ones arrive
            engine.step()
        # fcfs takes priority 0 only (as vLLM): there the urgent ones are urgent in name only and queue
        urgent = 10 if policy == "priority" else 0
        high = [engine.add_request(p, params(out_len), priority=urgent) for p in prompts_high]
        done = drain(engine)
        ttft = {rid: done[rid].metrics.time_to_first_token for rid in low + high}
        results[policy] = {
            "ttft_high_p50_s": percentile([ttft[r] for r in high], 50),
            "ttft_high_max_s": max(ttft[r] for r in high),
            "ttft_low_p50_s": percentile([ttft[r] for r in low], 50),
            "ttft_low_max_s": max(ttft[r] for r in low),
            "num_preemptions": engine.stats()["num_preemptions"],
        }
    results["high_priority_ttft_speedup"] = results["fcfs"]["ttft_high_p50_s"] / results["priority"]["ttft_high_p50_s"]
    results["setup"] = (f"{n_low} low-priority requests, then after 3 steps {n_high} high-priority ones; "
                        f"prompts {prompt_len} tokens, outputs {out_len}; KV pool for ~{max(2, n_low // 3)} requests")
    return results


def print_priority(r: dict[str, Any]) -> None:
    rows = [[pol, fmt(r[pol]["ttft_high_p50_s"]), fmt(r[pol]["ttft_high_max_s"]), fmt(r[pol]["ttft_low_p50_s"]),
             fmt(r[pol]["ttft_low_max_s"]), str(r[pol]["num_preemptions"])] for pol in ("priority", "fcfs")]
    print(f"Priority scheduling ({r['setup']}):")
    print(table(["policy", "high TTFT p50 s", "high TTFT max s", "low TTFT p50 s", "low TTFT max s",
                 "preemptions"], rows))
    print(f"high-priority TTFT p50: {compared(r['high_priority_ttft_speedup'], 'faster', 'slower')} under the "
          "priority policy\n")


# -------------------------------------------------------------------------------- preemption

def count_tokens(engine: LLMEngine) -> list[int]:
    """A subscriber that adds up the tokens each step runs through the model (recomputation included)."""
    total = [0]

    def on_event(e: ev.Event) -> None:
        if isinstance(e, ev.StepPlanned):
            total[0] += e.num_batched_tokens

    engine.subscribe(on_event, topk=0, blocks=False)
    return total


def bench_preemption(b: Bench) -> dict[str, Any]:
    n, prompt_len, out_len = (4, 24, 16) if b.quick else (16, 128, 64)
    per_seq = -(-(prompt_len + out_len) // 16)
    prompts = [b.prompt(prompt_len) for _ in range(n)]
    results = {}
    for name, blocks in (("pool holds all", per_seq * n + n), ("pool holds ~1/3", max(per_seq + 1, per_seq * n // 3))):
        engine = b.engine(num_kv_blocks=blocks, scheduling_policy="fcfs")
        tokens = count_tokens(engine)
        t0 = time.perf_counter()
        ids = [engine.add_request(p, params(out_len)) for p in prompts]
        done = drain(engine)
        elapsed = time.perf_counter() - t0
        stats = engine.stats()
        needed = n * prompt_len + n * (out_len - 1)  # every prompt once, every output token but the last once
        results[name] = {
            "kv_blocks": blocks,
            "num_preemptions": stats["num_preemptions"],
            "tokens_computed": tokens[0],
            "tokens_recomputed": tokens[0] - needed,
            "prefix_cache_hits": stats["prefix_cache_hits"],
            "elapsed_s": elapsed,
            "output_tokens_per_s": sum(len(done[i].outputs[0].token_ids) for i in ids) / elapsed,
            "steps": stats["steps"],
        }
    a, t = results["pool holds all"], results["pool holds ~1/3"]
    results["time_cost"] = t["elapsed_s"] / a["elapsed_s"]
    results["setup"] = f"{n} requests, prompts {prompt_len} tokens, outputs {out_len}, FCFS, prefix caching on"
    return results


def print_preemption(r: dict[str, Any]) -> None:
    names = ("pool holds all", "pool holds ~1/3")
    print(f"Preemption by recompute ({r['setup']}):")
    print(table(["KV pool", "blocks", "preemptions", "tokens computed", "recomputed", "prefix-cache hit tokens",
                 "steps", "time s", "output tok/s"],
                [[n, str(r[n]["kv_blocks"]), str(r[n]["num_preemptions"]), f"{r[n]['tokens_computed']:,}",
                  f"{r[n]['tokens_recomputed']:,}", f"{r[n]['prefix_cache_hits']:,}", str(r[n]["steps"]),
                  fmt(r[n]["elapsed_s"]), fmt(r[n]["output_tokens_per_s"])] for n in names]))
    print(f"the small pool takes {r['time_cost']:.2f}x the time\n")


# --------------------------------------------------------------------------- chunked prefill

def bench_chunked_prefill(b: Bench) -> dict[str, Any]:
    n_run, run_prompt, run_out = (2, 16, 12) if b.quick else (4, 32, 48)
    long_len, budget, max_len = (300, 128, 512) if b.quick else (1800, 512, 2048)
    run_prompts = [b.prompt(run_prompt) for _ in range(n_run)]
    long_prompt = b.prompt(long_len)
    results = {}
    for name, chunked in (("chunked", True), ("one piece", False)):
        cfg = dict(max_model_len=max_len, enable_chunked_prefill=chunked,
                   max_num_batched_tokens=budget if chunked else max_len)
        engine = b.engine(**cfg)
        stamps: dict[str, list[float]] = {}

        def on_event(e: ev.Event, stamps=stamps) -> None:
            if isinstance(e, ev.TokenSampled):
                stamps.setdefault(e.request_id, []).append(time.perf_counter())

        engine.subscribe(on_event, topk=0, blocks=False)
        running = [engine.add_request(p, params(run_out)) for p in run_prompts]
        for _ in range(3):  # the short requests are decoding when the long prompt arrives
            engine.step()
        arrival = len(stamps[running[0]])
        long_id = engine.add_request(long_prompt, params(4))
        done = drain(engine)
        # Gaps between consecutive tokens of the running requests from the long prompt's arrival on.
        gaps = [t1 - t0 for r in running for t0, t1 in zip(stamps[r][arrival - 1:], stamps[r][arrival:])]
        results[name] = {
            "decode_stall_max_s": max(gaps),
            "itl_p50_s": percentile(gaps, 50),
            "long_prompt_ttft_s": done[long_id].metrics.time_to_first_token,
            "token_budget": engine.scheduler.token_budget,
        }
    results["stall_reduction"] = results["one piece"]["decode_stall_max_s"] / results["chunked"]["decode_stall_max_s"]
    results["setup"] = (f"{n_run} requests decoding (prompts {run_prompt}, outputs {run_out}) when a "
                        f"{long_len}-token prompt arrives; token budget {budget} when chunked")
    return results


def print_chunked(r: dict[str, Any]) -> None:
    print(f"Chunked prefill ({r['setup']}):")
    print(table(["prefill", "budget", "decode stall (max ITL) s", "ITL p50 s", "long prompt TTFT s"],
                [[n, str(r[n]["token_budget"]), fmt(r[n]["decode_stall_max_s"]), fmt(r[n]["itl_p50_s"]),
                  fmt(r[n]["long_prompt_ttft_s"])] for n in ("chunked", "one piece")]))
    print(f"the longest decode stall is {compared(r['stall_reduction'], 'shorter', 'longer')} with chunking\n")


# ---------------------------------------------------------------------------- prefix caching

def bench_prefix_caching(b: Bench) -> dict[str, Any]:
    n, system_len, question_len, out_len = (3, 64, 8, 4) if b.quick else (16, 384, 24, 16)
    system = b.prompt(system_len)
    questions = [b.prompt(question_len) for _ in range(n)]
    results = {}
    for name, caching in (("on", True), ("off", False)):
        engine = b.engine(enable_prefix_caching=caching)
        first = engine.add_request(system + questions[0], params(out_len))
        drain(engine)  # the first request fills the cache with the system prompt's blocks
        rest = [engine.add_request(system + q, params(out_len)) for q in questions[1:]]
        done = drain(engine)
        stats = engine.stats()
        ttfts = [done[r].metrics.time_to_first_token for r in rest]
        results[name] = {
            "hit_rate": stats["prefix_cache_hit_rate"],
            "cached_prompt_tokens_p50": percentile([done[r].metrics.num_cached_prompt_tokens for r in rest], 50),
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_max_s": max(ttfts),
        }
        del first
    results["ttft_speedup"] = results["off"]["ttft_p50_s"] / results["on"]["ttft_p50_s"]
    results["setup"] = (f"a {system_len}-token system prompt shared by {n} requests (+{question_len}-token "
                        f"questions, {out_len} output tokens); one request first, then {n - 1} together")
    return results


def print_prefix(r: dict[str, Any]) -> None:
    print(f"Prefix caching ({r['setup']}):")
    print(table(["prefix caching", "hit rate", "cached prompt tokens p50", "TTFT p50 s", "TTFT max s"],
                [[n, f"{100 * r[n]['hit_rate']:.1f}%", fmt(r[n]["cached_prompt_tokens_p50"]), fmt(r[n]["ttft_p50_s"]),
                  fmt(r[n]["ttft_max_s"])] for n in ("on", "off")]))
    print(f"TTFT p50 of the later requests: {compared(r['ttft_speedup'], 'faster', 'slower')} with prefix caching\n")


RUNS = {
    "priority": (bench_priority, print_priority),
    "preemption": (bench_preemption, print_preemption),
    "chunked_prefill": (bench_chunked_prefill, print_chunked),
    "prefix_caching": (bench_prefix_caching, print_prefix),
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.benchmark_advanced_scheduling",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--all", action="store_true", help="every experiment")
    for f in FEATURES:
        ap.add_argument("--" + f.replace("_", "-"), action="store_true", dest=f)
    ap.add_argument("--quick", action="store_true", help="a small smoke run of each chosen experiment")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    args = ap.parse_args(argv)
    check_json_path(ap, args.json)
    chosen = [f for f in FEATURES if args.all or getattr(args, f)]
    if not chosen:
        ap.error("choose --all or at least one of " + ", ".join("--" + f.replace("_", "-") for f in FEATURES))
    host = HostCheck()
    b = Bench(args.quick)
    results: dict[str, Any] = {"machine": machine_summary()}
    for f in chosen:
        bench, show = RUNS[f]
        results[f] = bench(b)
        show(results[f])
    results["host_warnings"] = host.report()
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
