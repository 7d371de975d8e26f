"""Trial 15b: a newcomer's run of ``nanovllm serve``'s OpenAI routes and control API, and of GGUF files."""

from __future__ import annotations

import httpx
import pytest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Say hi"}]


def post(server, path: str, **fields) -> httpx.Response:
    body = {"prompt": "Hi"} if path == COMPLETIONS else {"messages": MESSAGES}
    return httpx.post(server.url + path, json={**body, "max_tokens": 1, **fields}, headers=server.headers, timeout=60)


def control(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/engine/control", json=body, headers=server.headers, timeout=30)


# ---------------------------------------------------------------------- 4. the same OpenAI fields on both routes

@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("fields", [
    {"parallel_tool_calls": True, "metadata": {"a": "b"}, "store": False},
    {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "store": None},
], ids=["parallel_tool_calls,metadata,store", "tools,tool_choice,response_format"])
def test_openai_fields_that_ask_for_nothing_are_served_on_completions_as_on_chat(tiny_server, path, fields):
    """Trial 15b: completions answered "Unrecognized request argument supplied: parallel_tool_calls"
    where chat took it, while docs/serving.md said both take it (vLLM takes any extra field)."""
    r = post(tiny_server, path, **fields)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


@pytest.mark.parametrize("fields", [{"metadata": {"n": 1}}, {"parallel_tool_calls": "yes"}, {"store": True},
                                    {"tools": [{"type": "function", "function": {"name": "f"}}]}])
def test_completions_refuse_those_fields_bad_values_in_chats_words(tiny_server, fields):
    completion, chat = post(tiny_server, COMPLETIONS, **fields), post(tiny_server, CHAT, **fields)
    assert completion.status_code == chat.status_code == 400, completion.text
    assert completion.json() == chat.json()


# ---------------------------------------------------------------------- 5. a non-boolean store is a type error

@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("value, shown", [("false", '"false"'), (1, "1"), ([], "[]")])
def test_a_store_that_is_no_boolean_gets_the_type_error_other_booleans_get(tiny_server, path, value, shown):
    """Trial 15b: "store": "false" was told "store is not supported ...; leave it out or send false"."""
    error = post(tiny_server, path, store=value).json()["error"]
    assert error == {"message": f"Invalid value for store: Input should be a valid boolean (got {shown})",
                     "type": "invalid_request_error", "param": "store", "code": "invalid_value"}
    stream = post(tiny_server, path, stream="false").json()["error"]  # the wording every boolean field has
    assert stream["message"].startswith("Invalid value for stream: Input should be a valid boolean")


@pytest.mark.parametrize("path, fields", [(COMPLETIONS, {"echo": True}), (CHAT, {"echo": True}),
                                          (COMPLETIONS, {"suffix": "x"}), (COMPLETIONS, {"best_of": 2}),
                                          (CHAT, {"store": True})])
def test_every_value_this_server_does_not_support_carries_the_code_invalid_value(tiny_server, path, fields):
    """Trial 15b: echo=true answered "code": null where store and tools answer "invalid_value"."""
    r = post(tiny_server, path, **fields)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text


# ---------------------------------------------------------------------- 8. an abort asked twice before it applies

def test_a_second_abort_before_the_first_is_applied_is_a_409_that_says_so(make_tiny_engine):
    """Trial 15b: four aborts of one running request during a step all answered {"ok": true}. The
    engine thread is held inside a step here, so the first abort is not applied until it ends."""
    import threading

    from nanovllm_core.engine.controller import EngineController
    from tests.conftest import poll_until
    from tests.serve_helpers import start_server

    engine = make_tiny_engine(num_kv_blocks=64)
    controller = EngineController.from_engine(engine, start_paused=True)
    server = start_server(controller, api_key=None)
    entered, release = threading.Event(), threading.Event()
    real_step = engine.step

    def held_step():
        entered.set()
        release.wait(30)
        return real_step()

    try:
        rid = control(server, {"command": "submit", "prompt": "Tell me a story", "params": {"max_tokens": 50},
                               "request_id": "long1"}).json()["request_id"]
        engine.step = held_step
        assert control(server, {"command": "step", "n": 1}).json() == {"ok": True}
        assert entered.wait(30)
        assert control(server, {"command": "abort", "request_id": rid}).json() == {"ok": True}
        for _ in range(2):
            r = control(server, {"command": "abort", "request_id": rid})
            assert r.status_code == 409, r.text
            assert r.json()["error"] == {
                "message": 'an abort of request "long1" was already asked and is not applied yet; it takes effect '
                           "at the end of the engine's step in progress",
                "type": "invalid_request_error", "param": "request_id", "code": "abort_pending"}
        release.set()
        assert poll_until(lambda: not controller.abort_pending(rid))
        r = control(server, {"command": "abort", "request_id": rid})  # ended: the documented 404
        assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found", r.text
    finally:
        release.set()
        engine.step = real_step
        server.stop()
        controller.shutdown(timeout=5)


# ---------------------------------------------------------------------- 2. steps never wait for work that does not exist

def test_a_step_with_no_request_is_refused_and_banks_nothing(tiny_server):
    """Trial 15b: pause, step n=1000 with nothing to run answered {"ok": true}; the next request then
    ran all its tokens while the server said "paused"."""
    assert control(tiny_server, {"command": "pause"}).json() == {"ok": True}
    try:
        r = control(tiny_server, {"command": "step", "n": 1000})
        assert r.status_code == 409, r.text
        assert r.json()["error"] == {"message": "nothing to step: no request is running or waiting; submit one first",
                                     "type": "invalid_request_error", "param": None, "code": "nothing_to_step"}
        assert tiny_server.controller.steps_pending() == 0
        before = tiny_server.stats()["steps"]
        rid = control(tiny_server, {"command": "submit", "prompt": "hi", "params": {"max_tokens": 20}}).json()["request_id"]
        assert tiny_server.stats()["steps"] == before and tiny_server.controller.state == "paused"
        assert control(tiny_server, {"command": "step", "n": 1}).json() == {"ok": True}  # with a request: taken
        control(tiny_server, {"command": "abort", "request_id": rid})
    finally:
        control(tiny_server, {"command": "resume"})
    tiny_server.wait_idle(30)


def test_steps_left_when_the_last_request_finishes_are_dropped_and_the_pause_holds(make_tiny_engine):
    """The kind of trial 15b's #2 in the controller: steps asked for while a request ran, left over
    when it finished, ran the next request while the engine said "paused"."""
    from nanovllm_core.engine.controller import EngineController
    from nanovllm_core.sampling_params import SamplingParams
    from tests.conftest import poll_until

    c = EngineController.from_engine(make_tiny_engine(), start_paused=True)
    try:
        first = c.submit("hi", SamplingParams(max_tokens=3, ignore_eos=True))
        c.step(50)
        assert c.wait(first, timeout=30) is not None
        assert poll_until(lambda: c.steps_pending() == 0, 10)
        second = c.submit("hello", SamplingParams(max_tokens=3, ignore_eos=True))
        steps = []
        c.call(lambda engine: steps.append(engine.scheduler.step_index))  # after the submit: applied in order
        c.call(lambda engine: steps.append(engine.scheduler.step_index))  # a pass of the engine loop later
        assert poll_until(lambda: len(steps) == 2, 10)
        assert steps[0] == steps[1] and c.state == "paused" and second not in c.results
        c.step(1)  # steps run again once a request waits
        assert poll_until(lambda: c.engine.scheduler.step_index == steps[0] + 1, 10)
    finally:
        c.shutdown(timeout=5)


@pytest.mark.anyio
async def test_n_under_connect_shows_the_nothing_to_step_refusal_as_one_line(tiny_server, tmp_path):
    """The app sends no step with nothing to run; one that reaches the server anyway (the app had not
    seen the last request end) is a "Not done" toast of one line."""
    from tests.tui_helpers import attached_and_paused, wait_until

    try:
        async with attached_and_paused(tiny_server, tmp_path) as (app, pilot, notes):
            app.controller.step(1)  # what n sends once the app believes a request is there
            await wait_until(pilot, lambda: notes.find("nothing to step"), 10, "the refusal")
            (note,) = notes.find("nothing to step")
            assert note.message == ("step: nothing to step: no request is running or waiting; submit one first "
                                    "(HTTP 409)")
            assert note.title == "Not done" and note.severity == "warning"
    finally:
        if tiny_server.controller.state == "paused":
            control(tiny_server, {"command": "resume"})
