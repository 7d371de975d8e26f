"""Many clients at once: every stream gets exactly its tokens, disconnects abort, no KV block is left held;
``/metrics`` agrees with the engine's own counters."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanovllm_core import events as ev

WORDS = "the cat sat on a mat while seven blue birds sang over quiet green hills near old stone walls".split()


class Finished:
    """Keeps the engine's ``RequestFinished`` events (engine thread) by request id."""

    def __init__(self):
        self.by_id: dict[str, ev.RequestFinished] = {}
        self.lock = threading.Lock()

    def __call__(self, event):
        if isinstance(event, ev.RequestFinished):
            with self.lock:
                self.by_id[event.request_id] = event


async def one_client(http: httpx.AsyncClient, rng: random.Random, leave_after: int | None) -> dict:
    """One streaming request; ``leave_after``: disconnect after that many chunks (None: read to the end)."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
    max_tokens = rng.randint(48, 64) if leave_after else rng.randint(1, 32)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    got = {"max_tokens": max_tokens, "tokens": [], "text": "", "usage": None, "finish": None, "id": None,
           "done": False}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                got["done"] = True
                break
            chunk = json.loads(line[6:])
            got["id"] = chunk["id"]
            if chunk.get("usage"):
                got["usage"] = chunk["usage"]
            for c in chunk["choices"]:
                got["tokens"] += c["token_ids"]
                got["text"] += c["text"]
                got["finish"] = c["finish_reason"] or got["finish"]
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                break  # leaving the block closes the connection mid-stream
    return got


async def many_clients(url: str, headers: dict, n: int, leaving: set[int], seed: int) -> list[dict]:
    rng = random.Random(seed)
    plans = [(random.Random(rng.random()), (i % 3) + 1 if i in leaving else None) for i in range(n)]
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as http:
        return await asyncio.wait_for(asyncio.gather(*(one_client(http, r, k) for r, k in plans)), timeout=240)


def test_64_streams_get_exactly_their_tokens_and_16_disconnects_free_their_blocks(tiny_server):
    finished = Finished()
    sub = tiny_server.controller.subscribe(finished, topk=0, blocks=False)
    try:
        leaving = set(range(3, 64, 4))  # 16 of the 64
        start = time.perf_counter()
        results = asyncio.run(many_clients(tiny_server.url, tiny_server.headers, 64, leaving, seed=7))
        wall = time.perf_counter() - start
        stats = tiny_server.wait_idle()
        deadline = time.monotonic() + 30
        while len([r for r in results if r["id"] in finished.by_id]) < 64 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        tiny_server.controller.unsubscribe(sub)
    assert len({r["id"] for r in results}) == 64
    for i, r in enumerate(results):
        engine_view = finished.by_id[r["id"]]
        if i in leaving:
            assert not r["done"] and engine_view.finish_reason == "abort", (i, engine_view.finish_reason)
            assert engine_view.num_output_tokens < r["max_tokens"]
            assert r["tokens"] == list(engine_view.output_token_ids[: len(r["tokens"])])
        else:
            assert r["done"] and r["finish"] == "length"
            assert r["tokens"] == list(engine_view.output_token_ids) and len(r["tokens"]) == r["max_tokens"]
            assert r["text"] == engine_view.output_text
            assert r["usage"]["completion_tokens"] == r["max_tokens"]
            assert r["usage"]["prompt_tokens"] == engine_view.num_prompt_tokens
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    tokens = sum(len(r["tokens"]) for r in results)
    print(f"\n64 concurrent streams, 16 left early: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tokens/s")


def scrape(server) -> dict[str, float]:
    """``/metrics`` parsed by prometheus_client: sample name (+ finished_reason) -> value."""
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (f"[{s.labels['finished_reason']}]" if "finished_reason" in s.labels else "")
            if s.name.endswith("_bucket"):
                key += f"[le={s.labels['le']}]"
            out[key] = s.value
    return out


def test_metrics_parse_and_match_the_engine_stats(tiny_server):
    before = scrape(tiny_server)
    shared = "You are a helpful assistant. " * 6  # a shared prefix: later requests hit the prefix cache
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=60) as http:
        for i in range(3):
            r = http.post("/v1/completions", json={"prompt": shared + WORDS[i], "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200
    stats = tiny_server.wait_idle()
    m = scrape(tiny_server)
    assert m["vllm:prompt_tokens_total"] == stats["total_prompt_tokens"]
    assert m["vllm:generation_tokens_total"] == stats["total_output_tokens"]
    assert m["vllm:prefix_cache_queries_total"] == stats["prefix_cache_queries"]
    assert m["vllm:prefix_cache_hits_total"] == stats["prefix_cache_hits"]
    assert m["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= 2 * 16  # cached blocks
    assert m["vllm:num_preemptions_total"] == stats["num_preemptions"]
    assert m["vllm:num_requests_running"] == stats["num_running"] == 0
    assert m["vllm:num_requests_waiting"] == stats["num_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == stats["kv_cache_usage"]
    assert m["nanovllm:steps_total"] == stats["steps"]
    assert m["vllm:request_success_total[length]"] - before.get("vllm:request_success_total[length]", 0) == 3
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert m[f"vllm:{name}_count"] - before.get(f"vllm:{name}_count", 0) == 3
        assert m[f"vllm:{name}_sum"] > before.get(f"vllm:{name}_sum", 0)


def test_n_samples_are_each_counted_in_metrics_with_their_own_finish_reason_and_times(tiny_server):
    """Trial 17a: with ``n`` > 1, ``/metrics`` counted sample 0 alone (its finish reason for the whole
    request, its TTFT and its e2e) while ``vllm:prompt_tokens`` counted every sample. vLLM V1 records
    each child request: 3 successes under their own reasons, 3 observations per histogram."""
    body = {"prompt": "the cat sat on the mat", "max_tokens": 8, "temperature": 1.0, "seed": 4, "n": 3,
            "ignore_eos": True, "return_token_ids": True}
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=60) as http:
        first = http.post("/v1/completions", json=body).json()
        ids = [c["token_ids"] for c in sorted(first["choices"], key=lambda c: c["index"])]
        # a token sample 0 makes second and the others never make: stopping on it ends sample 0 early
        stop = next(t for t in ids[0][1:4] if t not in ids[1] and t not in ids[2] and t not in ids[0][:1])
        tiny_server.wait_idle()
        before = scrape(tiny_server)
        r = http.post("/v1/completions", json={**body, "stop_token_ids": [stop]}).json()
    tiny_server.wait_idle()
    m = scrape(tiny_server)
    reasons = sorted(c["finish_reason"] for c in r["choices"])
    assert reasons == ["length", "length", "stop"], r["choices"]

    def delta(key):
        return m.get(key, 0) - before.get(key, 0)

    assert delta("vllm:request_success_total[stop]") == 1
    assert delta("vllm:request_success_total[length]") == 2
    assert delta("vllm:prompt_tokens_total") == 3 * r["usage"]["prompt_tokens"]
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"vllm:{name}_count") == 3, name


def test_metrics_observe_each_samples_own_latency():
    """Each sample's own e2e and TTFT go into the histograms (not sample 0's three times)."""
    from nanovllm_core.entrypoints.metrics import ServerMetrics
    from nanovllm_core.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def sample(i, reason, first, last, finished, tokens):
        return CompletionOutput(index=i, text="", token_ids=[1] * tokens, finish_reason=reason, metrics=RequestMetrics(
            arrival_time=10.0, first_token_time=first, last_token_time=last, finished_time=finished,
            num_output_tokens=tokens))

    metrics = ServerMetrics("m")
    # every finish reason's series exists from the first scrape, at 0, as vLLM creates them (trial 35c)
    for reason in ("stop", "length", "abort", "error"):
        assert metrics.registry.get_sample_value("vllm:request_success_total",
                                                 {"model_name": "m", "finished_reason": reason}) == 0
    outs = [sample(0, "stop", 10.5, 11.0, 11.0, 2), sample(1, "length", 11.0, 19.0, 19.0, 9),
            sample(2, "length", 11.5, 17.5, 17.5, 7)]
    metrics.observe(RequestOutput("r", "p", [1], outs, True, metrics=outs[0].metrics))
    text = metrics.registry
    get = text.get_sample_value
    assert get("vllm:e2e_request_latency_seconds_sum", {"model_name": "m"}) == 1.0 + 9.0 + 7.5
    assert get("vllm:time_to_first_token_seconds_sum", {"model_name": "m"}) == 0.5 + 1.0 + 1.5
    assert get("vllm:time_per_output_token_seconds_sum", {"model_name": "m"}) == 0.5 + 1.0 + 1.0
    assert get("vllm:request_success_total", {"model_name": "m", "finished_reason": "length"}) == 2
    assert get("vllm:request_success_total", {"model_name": "m", "finished_reason": "stop"}) == 1


def test_a_whole_answer_client_that_leaves_gets_a_quiet_499_and_its_blocks_are_freed(tiny_server, caplog):
    """Issue 29: a non-streaming request whose client disconnects is aborted, its KV blocks freed, and
    nothing is logged as an error (the server answers 499 to nobody). The engine is paused and stepped
    once, so the request holds blocks (prefilled, running) when its client gives up."""
    import logging

    finished = Finished()
    sub = tiny_server.controller.subscribe(finished, topk=0)
    caplog.set_level(logging.ERROR)
    server_log = logging.getLogger("uvicorn")  # uvicorn's loggers do not propagate to the root's handler
    server_log.addHandler(caplog.handler)
    tiny_server.controller.pause()
    left = threading.Event()

    def client():
        body = {"prompt": "the cat sat", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        try:
            httpx.post(f"{tiny_server.url}/v1/completions", json=body, headers=tiny_server.headers, timeout=3.0)
        except httpx.TimeoutException:
            left.set()  # the client gave up: its connection is closed

    try:
        thread = threading.Thread(target=client)
        thread.start()
        deadline = time.monotonic() + 30
        while tiny_server.stats()["num_waiting"] == 0:
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)
        tiny_server.controller.step(1)  # prefill: the request now holds KV blocks
        while not (held := tiny_server.stats())["kv_blocks_used"]:
            assert time.monotonic() < deadline, "the request was never prefilled"
            time.sleep(0.02)
        assert held["num_running"] == 1
        thread.join(30)
        assert left.is_set() and not thread.is_alive()
        while not finished.by_id:
            assert time.monotonic() < deadline, "the request was not aborted after its client left"
            time.sleep(0.02)
        (event,) = finished.by_id.values()
        assert event.finish_reason == "abort" and event.num_output_tokens <= 1
        stats = tiny_server.stats()
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a leaving client is not an error"
    finally:
        server_log.removeHandler(caplog.handler)
        tiny_server.controller.resume()
        tiny_server.controller.unsubscribe(sub)
