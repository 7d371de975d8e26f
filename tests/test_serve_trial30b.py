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


# ---------------------------------------------------------------------- 3. error edges


def _raw(server, path: str, content: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={**server.headers, "Content-Type": "application/json"})


def test_an_integer_past_pythons_digit_limit_is_named_as_too_large(tiny_server):
    """Trial 30b: a 5,001-digit max_tokens was "not valid JSON (... use sys.set_int_max_str_digits() ...)":
    the body is JSON (RFC 8259 sets no digit limit) and that advice is for the server's author."""
    big = "1" + "0" * 5000
    r = _raw(tiny_server, "/v1/completions", b'{"prompt": "Hi", "max_tokens": %s}' % big.encode())
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"] == ("max_tokens: a number of 5001 digits is too large (at most 4300 digits are read, and "
                                "no field takes a number anywhere near that long); send a smaller number")
    assert error["param"] == "max_tokens" and error["code"] == "invalid_value"
    # in a list or nested: its place, as a request's fields are named (trial 41b: "param": null, and "5" for logit_bias.5)
    r = _raw(tiny_server, "/v1/completions", b'{"prompt": [1, -%s]}' % big.encode())
    assert r.json()["error"]["message"].startswith("prompt.1: a number of 5001 digits is too large")
    assert r.json()["error"]["param"] == "prompt.1"
    r = _raw(tiny_server, "/v1/completions", b'{"prompt": "a", "logit_bias": {"5": %s}}' % big.encode())
    assert r.json()["error"]["param"] == "logit_bias.5", r.text
    assert "set_int_max_str_digits" not in r.text
    r = _raw(tiny_server, "/v1/engine/control", b'{"command": "step", "n": %s}' % big.encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_a_body_that_is_not_utf8_says_so(tiny_server):
    """Trial 30b: raw bytes ff fe got "not valid JSON (Expecting value: line 1 column 1 (char 0))" (json.loads
    read them as UTF-16), a stray ff inside a text the codec's own words."""
    for content, offset in ((b"\xff\xfe", 0), (b'{"prompt": "\xff"}', 12)):
        r = _raw(tiny_server, "/v1/completions", content)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (f"the request body is not UTF-8 text (byte 0xff at offset {offset} "
                                                "is not valid UTF-8); send the JSON body encoded as UTF-8")
    # a UTF-8 byte order mark is still skipped, as before
    r = _raw(tiny_server, "/v1/completions", b'\xef\xbb\xbf{"prompt": "Hi", "max_tokens": 1}')
    assert r.status_code == 200, r.text


def test_control_takes_null_for_an_optional_field_as_left_out(tiny_server):
    """Trial 30b: {"command": "resume", "owner": null} was "owner must be a string ..., got null", while the
    docs call owner optional and xray took request_id: null as left out."""
    try:
        assert control(tiny_server, {"command": "pause", "owner": None}).json() == {"ok": True}
        assert control(tiny_server, {"command": "resume", "owner": None}).json() == {"ok": True, "resumed": True}
        assert control(tiny_server, {"command": "pause", "owner": "me"}).json() == {"ok": True}
        # a resume with owner null is a resume without owner: it ends any pause
        assert control(tiny_server, {"command": "resume", "owner": None}).json() == {"ok": True, "resumed": True}
        r = control(tiny_server, {"command": "submit", "prompt": "hi", "params": {"max_tokens": 1},
                                  "priority": None, "request_id": None})
        assert r.status_code == 200, r.text
        # a required field stays required
        r = control(tiny_server, {"command": "abort", "request_id": None})
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    finally:
        control(tiny_server, {"command": "resume"})
    assert poll_until(lambda: not tiny_server.controller.engine.has_unfinished_requests())


# ---------------------------------------------------------------------- 4. include_usage: null


def _stream_usage(server, path: str, body: dict) -> list:
    """The ``usage`` of every streamed chunk that has one."""
    import json

    usages = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, headers=server.headers,
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usages.append(chunk["usage"])
    return usages


def test_include_usage_null_turns_usage_off_as_in_vllm(tiny_server):
    """Trial 30b: "stream_options": {"include_usage": null} sent a usage chunk; vLLM's StreamOptions field is
    ``bool | None`` and ``bool(include_usage)`` is false for null. Left out, it stays on (vLLM's default)."""
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": HI, "max_tokens": 2})):
        assert _stream_usage(tiny_server, path, {**body, "stream_options": {"include_usage": None}}) == []
        assert _stream_usage(tiny_server, path, {**body, "stream_options": {
            "include_usage": None, "continuous_usage_stats": True}}) == []
        assert len(_stream_usage(tiny_server, path, {**body, "stream_options": {}})) == 1
        assert len(_stream_usage(tiny_server, path, {**body, "stream_options": {"continuous_usage_stats": None}})) == 1


# ---------------------------------------------------------------------- trial 30c: TTFT observed at the first token


def test_ttft_is_observed_in_the_step_that_gives_the_first_token_not_at_the_finish(tiny_server):
    """Trial 30c: with two requests running, each holding its first token, vllm:time_to_first_token_seconds
    counted 0 (observed only when a sample finished) while prompt_tokens_total counted both; vLLM V1
    records TTFT in the iteration that produced it. Each is counted once, also after it finishes."""
    def ttft_count() -> float:
        text = httpx.get(tiny_server.url + "/metrics", timeout=30).text
        return _gauge(text, "vllm:time_to_first_token_seconds_count")

    before = ttft_count()
    control(tiny_server, {"command": "pause"}).raise_for_status()
    ids = []
    try:
        for _ in range(2):
            r = control(tiny_server, {"command": "submit", "prompt": "Once upon a time",
                                      "params": {"max_tokens": 30, "ignore_eos": True, "temperature": 0}})
            ids.append(r.json()["request_id"])
        control(tiny_server, {"command": "step"}).raise_for_status()  # one step: both prefill, one token each
        assert poll_until(lambda: ttft_count() == before + 2), ttft_count()
        assert tiny_server.controller.engine.has_unfinished_requests()  # still running: counted at the token
    finally:
        for rid in ids:
            control(tiny_server, {"command": "abort", "request_id": rid})
        control(tiny_server, {"command": "resume"})
    assert poll_until(lambda: not tiny_server.controller.engine.has_unfinished_requests())
    tiny_server.wait_idle()
    assert ttft_count() == before + 2  # not again at the finish


def test_control_submit_params_other_than_an_object_or_null_are_refused(tiny_server):
    """Trial 31b: "params": [] ran with the default settings (an empty list read as left out), where [1], 5
    and "x" were refused. Only null is left out."""
    for params in ([], "", 0, False):
        r = control(tiny_server, {"command": "submit", "prompt": "hi", "params": params})
        assert r.status_code == 400 and r.json()["error"]["param"] == "params", (params, r.text)
    r = httpx.post(tiny_server.url + "/v1/completions", headers=tiny_server.headers, timeout=30,
                   json={"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e-300})
    assert r.status_code == 400 and "repetition_penalty" in r.json()["error"]["message"], r.text
