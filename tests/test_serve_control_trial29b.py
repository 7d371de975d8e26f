"""The control API checks what /v1/chat/completions checks, and refuses what it does not take (trial 29b).

A chat conversation sent to ``submit`` is validated by the chat route's own model: an unknown key
in a message is refused naming it, a message without content or with content 5 gets the chat
route's line, an assistant message with ``tool_calls`` is taken. The shared in-process ``tiny_server``.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.conftest import poll_until

CHAT = "/v1/chat/completions"
CONTROL = "/v1/engine/control"
CALL = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def post(server, path: str, body: dict) -> httpx.Response:
    """JSON written with ASCII escapes, as most clients send it (a lone surrogate travels as ``\\ud800``)."""
    return httpx.post(server.url + path, content=json.dumps(body), timeout=60,
                      headers={**server.headers, "Content-Type": "application/json"})


@pytest.mark.parametrize("messages, param, message", [
    ([{"role": "user", "content": "hi", "bad": 1}], "0.bad", "Unrecognized request argument supplied: {}.0.bad"),
    ([{"role": "user"}], "0.content", "message 0 (user) has no content"),
    ([{"role": "user", "content": 5}], "0.content", "{}.0.content: content must be text or a list"),
    ([{"role": "user", "content": "a"}, {"role": "bogus", "content": "b"}], "1.role", "Invalid value for {}.1.role"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}], "1.content", "message 1 (assistant)"),
    ([{"role": "user", "content": "a", "name": "\ud800"}], "0.name", "lone surrogate"),
])
def test_submit_refuses_a_chat_message_as_the_chat_route_does(tiny_server, messages, param, message):
    chat = post(tiny_server, CHAT, {"messages": messages, "max_tokens": 1})
    ctl = post(tiny_server, CONTROL, {"command": "submit", "prompt": messages, "params": {"max_tokens": 1}})
    assert chat.status_code == ctl.status_code == 400, (chat.text, ctl.text)
    chat_error, error = chat.json()["error"], ctl.json()["error"]
    assert chat_error["param"] == f"messages.{param}" and message.format("messages") in chat_error["message"]
    assert error["param"] == f"prompt.{param}" and message.format("prompt") in error["message"], error
    # the same line, the list named as each route names it
    assert error["message"] == chat_error["message"].replace("messages.", "prompt."), error


def test_submit_takes_an_assistant_message_with_tool_calls_as_the_chat_route_does(tiny_server):
    messages = [{"role": "user", "content": "call f"}, {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "1", "content": "42"}]
    assert post(tiny_server, CHAT, {"messages": messages, "max_tokens": 1}).status_code == 200
    r = post(tiny_server, CONTROL, {"command": "submit", "prompt": messages, "params": {"max_tokens": 1}})
    assert r.status_code == 200 and r.json()["ok"] is True, r.text
    idle = re.compile(r"^vllm:num_requests_running\{[^}]*\} 0(\.0)?$", re.M)  # left idle for the next test
    assert poll_until(lambda: idle.search(httpx.get(tiny_server.url + "/metrics", timeout=10).text), 30)


def test_abort_without_request_id_is_a_missing_parameter(tiny_server):
    r = post(tiny_server, CONTROL, {"command": "abort"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "missing_required_parameter" and error["param"] == "request_id", error
    assert error["message"].startswith("abort needs request_id"), error


@pytest.mark.parametrize("body, param", [({"command": "abort"}, "request_id"), ({"command": "submit"}, "prompt"),
                                         ({}, "command")])
def test_every_missing_required_control_field_is_a_missing_parameter(tiny_server, body, param):
    """Trial 34b: submit without prompt answered invalid_value where every other missing field is
    missing_required_parameter, as docs/serving.md says; a prompt sent as null stays invalid_value."""
    error = post(tiny_server, CONTROL, body).json()["error"]
    assert error["code"] == "missing_required_parameter" and error["param"] == param, error
    if param == "prompt":
        error = post(tiny_server, CONTROL, {**body, "prompt": None}).json()["error"]
        assert error["code"] == "invalid_value" and error["param"] == "prompt", error


def test_xray_without_request_id_traces_each_steps_first_request_as_the_app_asks(tiny_server):
    """The attached app sends request_id null for "whichever request runs first in each step"
    (app._choose_xray, remote.RemoteController.xray); docs/serving.md says so."""
    for body in ({"command": "xray", "request_id": None, "layer": 0, "head": 0}, {"command": "xray"}):
        assert post(tiny_server, CONTROL, body).json() == {"ok": True}


def test_a_repeated_events_query_parameter_is_refused_naming_it(tiny_server):
    url = tiny_server.url + "/v1/engine/events?topk=3&topk=4"
    with httpx.stream("GET", url, headers=tiny_server.headers, timeout=30) as r:  # an accepted one never ends
        assert r.status_code == 400
        error = json.loads(r.read())["error"]
    assert error["param"] == "topk" and "given 2 times" in error["message"], error


def test_the_404_lists_every_route(tiny_server):
    r = httpx.get(tiny_server.url + "/v1/nothing", headers=tiny_server.headers, timeout=30)
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/engine/events", "/v1/engine/control",
                  "/health", "/metrics"):
        assert route in message, message
