"""Trial 30b (``nanovllm serve`` as a vLLM client developer uses it): /metrics during a long step,
chat ``top_logprobs`` without ``logprobs``, ``stream_options.include_usage: null``, and error edges."""

from __future__ import annotations

import threading

import httpx

from tests.conftest import poll_until


def control(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/engine/control", json=body, headers=server.headers, timeout=30)


def _gauge(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


# ---------------------------------------------------------------------- 1. /metrics never waits for a step


def test_metrics_answers_during_a_step_with_the_last_steps_figures(tiny_server, monkeypatch):
    """Trial 30b: /metrics took 1 to 5 s during a long prefill (it read stats() on the engine thread
    after the step), and one scrape timed out; /health answered at once. Now it answers from the
    snapshot taken at the last step boundary, while the step still runs."""
    engine = tiny_server.controller.engine
    entered, release = threading.Event(), threading.Event()
    real_step = engine.step

    def slow_step():  # the step in progress waits until the test has scraped
        entered.set()
        release.wait(60)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    try:
        control(tiny_server, {"command": "submit", "prompt": "hi", "params": {"max_tokens": 2}}).raise_for_status()
        assert entered.wait(30)
        r = httpx.get(tiny_server.url + "/metrics", timeout=30)  # old code: answered only after release
        assert not release.is_set()  # answered before the step ended
        assert r.status_code == 200
        # the figures are those of the boundary before the step: the request waits, none runs yet
        assert _gauge(r.text, "vllm:num_requests_waiting") == 1
        assert _gauge(r.text, "vllm:num_requests_running") == 0
        assert _gauge(r.text, "nanovllm:kv_blocks_used") == 0
    finally:
        release.set()
    monkeypatch.undo()
    assert poll_until(lambda: not tiny_server.controller.engine.has_unfinished_requests())
    stats = tiny_server.wait_idle()
    r = httpx.get(tiny_server.url + "/metrics", timeout=30)
    assert _gauge(r.text, "nanovllm:steps_total") == stats["steps"]
    assert _gauge(r.text, "vllm:num_requests_waiting") == 0


def test_a_finished_request_is_counted_by_the_next_scrape(tiny_server):
    """The snapshot is taken before outputs go to their listeners: a client told its request finished
    scrapes figures that count it (no race with the engine thread's next pass)."""
    before = tiny_server.stats()["total_output_tokens"]
    r = httpx.post(tiny_server.url + "/v1/completions", headers=tiny_server.headers, timeout=60,
                   json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    text = httpx.get(tiny_server.url + "/metrics", timeout=30).text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total{"))
    assert float(line.rsplit(" ", 1)[1]) == before + 3


# ---------------------------------------------------------------------- 2. chat top_logprobs without logprobs

HI = [{"role": "user", "content": "Hi"}]


def _chat(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60,
                      json={"messages": HI, "max_tokens": 1, **body})


def test_top_logprobs_0_without_logprobs_is_served_as_vllm_serves_it(tiny_server):
    """Trial 30b: ``top_logprobs: 0`` with ``logprobs`` missing, false or null was a 400; vLLM's
    ``check_logprobs`` refuses only -1 or a count > 0 without ``logprobs`` (some SDKs always send 0)."""
    for extra in ({}, {"logprobs": False}, {"logprobs": None}):
        r = _chat(tiny_server, top_logprobs=0, **extra)
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["logprobs"] is None
    r = _chat(tiny_server, top_logprobs=0, logprobs=True)  # the sampled token only
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_top_logprobs_refusals_say_what_to_send(tiny_server):
    cases = [
        ({"top_logprobs": 3}, 'top_logprobs=3 needs logprobs: true; send "logprobs": true, or leave top_logprobs out'),
        ({"top_logprobs": 3, "logprobs": False}, "top_logprobs=3 needs logprobs: true"),
        ({"top_logprobs": -2, "logprobs": True}, "top_logprobs=-2 is negative; send an integer in [0, 20], or leave it out"),
        ({"top_logprobs": -1, "logprobs": True}, "top_logprobs=-1 (every token of the vocabulary, as vLLM reads it) "
                                                 "is more than the 20 this server returns per token; send an integer in [0, 20]"),
        ({"top_logprobs": -1}, "top_logprobs=-1 (every token"),
    ]
    for body, message in cases:
        r = _chat(tiny_server, **body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["message"].startswith(message) and error["param"] == "top_logprobs", (body, error)
