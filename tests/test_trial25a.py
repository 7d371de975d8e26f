"""Newcomer trial 25a: a whole chat response's ``message`` held ``role`` and ``content`` only where vLLM's
carries null ``refusal``, ``annotations``, ``audio``, ``function_call`` and ``reasoning``; and this server
refused those fields when a client sent a vLLM response's message back in ``messages``."""

from __future__ import annotations

import httpx
import pytest

from nanovllm_core.entrypoints.protocol import MESSAGE_UNSUPPORTED


def _chat(server, messages, **extra):
    return httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60,
                      json={"messages": messages, "max_tokens": 2, "temperature": 0, **extra})


def test_a_chat_message_carries_vllms_null_fields_and_can_be_sent_back(tiny_server):
    first = _chat(tiny_server, [{"role": "user", "content": "Hi"}])
    assert first.status_code == 200, first.text
    message = first.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": message["content"], "refusal": None, "annotations": None,
                       "audio": None, "function_call": None, "reasoning": None}
    # a client keeps the conversation going with the message as it came, and as older vLLM sent it
    again = _chat(tiny_server, [{"role": "user", "content": "Hi"}, dict(message, tool_calls=[], reasoning_content=None),
                                {"role": "user", "content": "More"}])
    assert again.status_code == 200, again.text


@pytest.mark.parametrize("field", sorted(MESSAGE_UNSUPPORTED))
def test_a_value_in_a_messages_unsupported_field_is_a_400_saying_why(tiny_server, field):
    r = _chat(tiny_server, [{"role": "assistant", "content": "x", field: "something"}, {"role": "user", "content": "y"}])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"messages.0.{field}" and error["code"] == "invalid_value"
    assert error["message"].startswith(f"messages.0.{field} is not supported by this server (")
    assert error["message"].endswith("leave it out or send null")
