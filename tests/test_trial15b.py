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
