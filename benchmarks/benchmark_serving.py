"""Serving over HTTP against offline ``LLM.generate``, on the same workload, in the same run.

    python -m benchmarks.benchmark_serving [--num-requests 64] [--request-rate inf] [--workload default]
                                           [--rounds 1] [--model M] [--num-kv-blocks N] [--url URL] [--quick]

Like vLLM's ``benchmark_serving``: N requests, arriving as a Poisson process of the given rate
(``inf``: all at once, the server saturated), each from its own concurrent streaming client,
against ``nanovllm serve`` (started here as a separate process on 127.0.0.1 with the same
engine settings, unless ``--url`` names one already running). Every request is greedy with
``ignore_eos`` and a drawn output length, so both systems produce exactly the same tokens.
Reported: output tokens/s, TTFT and TPOT p50/p99 as the clients measure them (TTFT from
sending the request to its first token; TPOT the mean gap between later tokens), then the
same workload through ``LLM.generate`` in this process, and serving's throughput as a
fraction of offline's. The offline engine is idle while the server runs and the other way
round; with several ``--rounds`` the two alternate and medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import (HostCheck, check_json_path, fmt, machine_summary, make_workload, percentile, table, WORKLOADS,
                               Workload, write_json)
from nanovllm_core.cli import positive_int


def request_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests per second or 'inf', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a rate > 0 (or 'inf'), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.benchmark_serving", description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=positive_int, default=64)
    ap.add_argument("--request-rate", type=request_rate, default=math.inf,
                    help="requests per second, Poisson arrivals (default inf: all at once, saturation)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="default",
                    help="prompt and output length ranges (benchmarks/common.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=positive_int, default=1, help="serving and offline runs, alternating")
    ap.add_argument("--model", default=None, help="as for nanovllm (default: the embedded model)")
    ap.add_argument("--num-kv-blocks", type=positive_int, default=2048, help="KV pool of both engines (default 2048)")
    ap.add_argument("--url", default=None, help="a running nanovllm serve with the same settings (default: start one)")
    ap.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"), help="the --url server's key")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 6 requests of 8-16 prompt and 4-8 output tokens")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    return ap


# ---------------------------------------------------------------------- the server


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """``nanovllm serve`` in its own process on a free 127.0.0.1 port; (process, URL) once it answers."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "nanovllm_core.cli", "serve", "--port", str(port), "--num-kv-blocks",
           str(args.num_kv_blocks), "--no-access-log", "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"benchmark_serving: the server did not start: {proc.stderr.read().strip()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("benchmark_serving: the server did not answer /health within 600 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# ---------------------------------------------------------------------- the clients


async def one_request(http: Any, prompt: list[int], max_tokens: int, delay: float) -> dict[str, Any]:
    """Wait ``delay`` seconds, then stream one completion; its times (seconds) and token count."""
    await asyncio.sleep(delay)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": (await r.aread()).decode()[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                if choice["token_ids"]:
                    last = time.perf_counter()
                    first = first or last
                    tokens += len(choice["token_ids"])
    return {"ttft": first - sent if first else None, "latency": (last or sent) - sent, "tokens": tokens,
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else None, "expected": max_tokens}


async def serve_workload(url: str, api_key: str | None, w: Workload, rate: float, seed: int) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in w.prompts:
        delays.append(t)
        t += rng.expovariate(rate) if math.isfinite(rate) else 0.0
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=w.num_requests + 8, max_keepalive_connections=w.num_requests + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=3600, limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(http, p, n, d)
                                         for p, n, d in zip(w.prompts, w.output_lens, delays)))
        wall = time.perf_counter() - start
    failed = [r for r in results if "error" in r or r["tokens"] != r["expected"]]
    if failed:
        raise SystemExit(f"benchmark_serving: {len(failed)} request(s) did not get their tokens, e.g. {failed[0]}")
    return summarize(wall, [r["ttft"] for r in results], [r["tpot"] for r in results], w.output_tokens)


def offline_workload(llm: Any, w: Workload) -> dict[str, Any]:
    from nanovllm_core import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w.output_lens]
    start = time.perf_counter()
    outs = llm.generate(w.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == w.output_tokens
    return summarize(wall, [o.metrics.time_to_first_token for o in outs],
                     [o.metrics.time_per_output_token for o in outs], w.output_tokens)


def summarize(wall: float, ttfts: list, tpots: list, output_tokens: int) -> dict[str, Any]:
    return {"wall_s": wall, "output_tokens_per_s": output_tokens / wall,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "tpot_p50_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99)}


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_json_path(ap, args.json)
    try:
        import httpx  # noqa: F401  (the clients)
    except ImportError:
        ap.error("the clients need httpx: pip install -e '.[dev]'")
    from nanovllm_core import LLM

    host = HostCheck()
    llm = LLM(args.model, num_kv_blocks=args.num_kv_blocks, progress=lambda *a: None)
    if args.quick:
        w = make_workload(llm.tokenizer, args.workload, 6, args.seed, prompt_range=(8, 16), output_range=(4, 8))
    else:
        w = make_workload(llm.tokenizer, args.workload, args.num_requests, args.seed)
    proc, url = (None, args.url.rstrip("/")) if args.url else start_server(args)
    rounds = []
    try:
        # Warm-up of both: first-call costs (thread pools, buffers) stay out of the figures.
        warm = make_workload(llm.tokenizer, args.workload, 2, args.seed + 1, output_range=(4, 4))
        offline_workload(llm, warm)
        asyncio.run(serve_workload(url, args.api_key, warm, math.inf, args.seed))
        for _ in range(args.rounds):
            serving = asyncio.run(serve_workload(url, args.api_key, w, args.request_rate, args.seed))
            offline = offline_workload(llm, w)
            rounds.append({"serving": serving, "offline": offline,
                           "ratio": serving["output_tokens_per_s"] / offline["output_tokens_per_s"]})
    finally:
        if proc is not None:
            stop_server(proc)

    def median(system: str, key: str) -> float | None:
        values = [r[system][key] for r in rounds if r[system][key] is not None]
        return statistics.median(values) if values else None

    keys = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
    rows = [[name] + [fmt(median(system, k)) for k in keys] for name, system in
            (("nanovllm serve (HTTP, streaming clients)", "serving"), ("LLM.generate (offline)", "offline"))]
    ratio = statistics.median(r["ratio"] for r in rounds)
    rate = "inf (all at once)" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    print(f"{w.num_requests} requests ({w.prompt_tokens} prompt + {w.output_tokens} output tokens), "
          f"rate {rate}, {args.rounds} round(s), on {machine_summary()['cpu']}")
    print(table(["system", "output tok/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 s", "TPOT p99 s"], rows))
    each = ", ".join(f"{r['ratio']:.1%}" for r in rounds)
    print(f"serving / offline throughput: {ratio:.1%}" + (f" (rounds: {each})" if len(rounds) > 1 else ""))
    data = {"machine": machine_summary(), "workload": w.summary(),
            "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
            "rounds": rounds, "serving": {k: median("serving", k) for k in keys},
            "offline": {k: median("offline", k) for k in keys}, "ratio": ratio,
            "host_warnings": host.report({system: [r[system]["output_tokens_per_s"] for r in rounds]
                                          for system in ("serving", "offline")})}
    write_json(args.json, data)
    return data


if __name__ == "__main__":
    main()
