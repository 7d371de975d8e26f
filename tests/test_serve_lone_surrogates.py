"""A lone surrogate in any client text the server repeats is a 400 in OpenAI's shape (trial 29b).

JSON's ``\\udc00`` escape carries a character with no UTF-8 form. Where an error message, its
``param``, an SSE error event or a control answer repeats the client's text, the response could not
be encoded: a bare 500 and a traceback. Each body below is sent as raw JSON text, as curl sends it.
The server is the shared in-process ``tiny_server`` (tiny random LLaMA, SmolLM2's tokenizer).
"""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
CONTROL = "/v1/engine/control"
U = '{"role":"user","content":"a"}'
# trial 29b's reproductions, the \udc00 a JSON escape sent as it is written here
REPROS = [
    ("/v1/completions", '{"prompt":"a","\\udc00":1}'),
    ("/v1/completions", '{"prompt":"a","stream":true,"\\udc00":1}'),
    ("/v1/completions", '{"prompt":"a","model":"\\udc00","max_tokens":1}'),
    ("/v1/completions", '{"prompt":"a","stream":true,"model":"\\udc00","max_tokens":1}'),
    ("/v1/completions", '{"prompt":"a","logit_bias":{"\\udc00":1},"max_tokens":1}'),
    ("/v1/completions", '{"prompt":"a","temperature":"\\udc00"}'),
    ("/v1/completions", '{"prompt":"a","max_tokens":"\\udc00"}'),
    (CHAT, '{"messages":[' + U + '],"\\udc00":1}'),
    (CHAT, '{"messages":[' + U + '],"model":"x\\udc00","stream":true}'),
    (CHAT, '{"messages":[{"role":"\\udc00","content":"a"}]}'),
    (CHAT, '{"messages":[{"role":"user","content":"a","\\udc00":1}]}'),
    (CHAT, '{"messages":[{"role":"user","content":[{"type":"\\udc00","text":"a"}]}],"max_tokens":1}'),
    (CHAT, '{"messages":[' + U + '],"stream":true,"stream_options":{"\\udc00":1}}'),
    (CHAT, '{"messages":[' + U + '],"stream":true,"\\udc00":1}'),
    (CONTROL, '{"command":"\\udc00"}'),
    (CONTROL, '{"command":"pause","\\udc00":1}'),
    (CONTROL, '{"command":"submit","prompt":"a","params":{"\\udc00":1}}'),
    (CONTROL, '{"command":"submit","prompt":"a","params":{"temperature":"\\udc00"}}'),
    (CONTROL, '{"command":"xray","request_id":"\\udc00","layer":0,"head":0}'),
    (CONTROL, '{"command":"abort","request_id":"\\udc00"}'),
]


def _post(server, path: str, raw: str) -> httpx.Response:
    headers = {**server.headers, "Content-Type": "application/json"}
    with httpx.stream("POST", server.url + path, content=raw.encode("ascii"), headers=headers, timeout=60) as r:
        r.read()
        return r


@pytest.mark.parametrize("path, raw", REPROS)
def test_a_lone_surrogate_the_error_repeats_is_a_400_in_openai_shape(tiny_server, path, raw):
    r = _post(tiny_server, path, raw)
    # a model no one serves is OpenAI's 404 model_not_found, whatever its name
    assert r.status_code == (404 if '"model"' in raw else 400), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "\n" not in error["message"]
    # nothing the server wrote back holds a character with no UTF-8 form: the surrogate is shown escaped
    for text in (error["message"], error["param"] or ""):
        assert not any("\ud800" <= ch <= "\udfff" for ch in text), error
    assert "\\udc00" in error["message"] + (error["param"] or ""), error
    assert httpx.get(tiny_server.url + "/health", timeout=10).status_code == 200


def test_an_answer_holding_a_lone_surrogate_is_encoded_escaped():
    """The central guard: any body the server builds can be encoded (a lone surrogate becomes its
    ``\\udc00`` spelling), in a JSON response and in an SSE event."""
    import json

    from nanovllm_core.entrypoints.api_server import EncodableJSONResponse
    from nanovllm_core.entrypoints.openai_serving import sse

    body = {"error": {"message": "bad \udc00", "param": ["\ud800x"], "code": None}}
    assert json.loads(EncodableJSONResponse(body).body) == {
        "error": {"message": "bad \\udc00", "param": ["\\ud800x"], "code": None}}
    assert sse({"a": "\udc00"}).encode("utf-8") == b'data: {"a":"\\\\udc00"}\n\n'


M = '"max_tokens":1'
# every client text that reaches the chat template (or is kept) is refused as content is (trial 29b: these were 200)
TEMPLATE_TEXTS = [
    ('{"messages":[{"role":"user","content":"a","name":"\\udc00"}],' + M + '}', "messages.0.name"),
    ('{"messages":[' + U + ',{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function",'
     '"function":{"name":"f","arguments":"{}"}}]},{"role":"tool","content":"r","tool_call_id":"\\udc00"}],' + M + '}',
     "messages.2.tool_call_id"),
    ('{"messages":[' + U + ',{"role":"assistant","tool_calls":[{"id":"1","type":"function",'
     '"function":{"name":"f\\udc00","arguments":"{}"}}]}],' + M + '}', "messages.1.tool_calls.0.function.name"),
    ('{"messages":[' + U + ',{"role":"assistant","tool_calls":[{"id":"1","type":"function",'
     '"function":{"name":"f","arguments":"{\\udc00}"}}]}],' + M + '}', "messages.1.tool_calls.0.function.arguments"),
    ('{"messages":[' + U + '],"chat_template_kwargs":{"\\udc00":1},' + M + '}', "chat_template_kwargs.\\udc00"),
    ('{"messages":[' + U + '],"chat_template_kwargs":{"x":["\\udc00"]},' + M + '}', "chat_template_kwargs.x.0"),
    ('{"messages":[' + U + '],"metadata":{"\\udc00":"v"},' + M + '}', "metadata"),
    ('{"messages":[' + U + '],"metadata":{"k":"\\udc00"},' + M + '}', "metadata"),
]


@pytest.mark.parametrize("raw, param", TEMPLATE_TEXTS)
def test_a_lone_surrogate_in_any_text_the_template_gets_is_refused_as_in_content(tiny_server, raw, param):
    for body in (raw, raw[:-1] + ',"stream":true}'):
        r = _post(tiny_server, CHAT, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "lone surrogate" in error["message"], error


def test_a_lone_surrogate_in_metadata_is_refused_on_completions_too(tiny_server):
    r = _post(tiny_server, "/v1/completions", '{"prompt":"a","metadata":{"k":"\\udc00"},' + M + '}')
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text


def _text_fields(model) -> list[str]:
    """The top-level fields of a request body that take a text (found from the model, so a field added
    later is covered too)."""
    import typing

    def takes_text(annotation) -> bool:
        if annotation is str:
            return True
        if typing.get_origin(annotation) is dict:  # keys are texts too, but the value is no text
            return False
        return any(takes_text(a) for a in typing.get_args(annotation))

    return sorted(name for name, info in model.model_fields.items() if takes_text(info.annotation))


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_a_lone_surrogate_in_any_text_field_of_a_request_is_refused(tiny_server, path):
    """Trial 33b: ``user`` took a lone surrogate (200) where every other text was refused."""
    import json

    from nanovllm_core.entrypoints.protocol import ChatCompletionRequest, CompletionRequest

    model = CompletionRequest if path != CHAT else ChatCompletionRequest
    base = {"prompt": "a"} if path != CHAT else {"messages": [{"role": "user", "content": "a"}]}
    fields = _text_fields(model)
    assert {"user", "stop", "request_id", "model"} <= set(fields)
    for field in fields:
        raw = json.dumps({**base, "max_tokens": 1, field: "x\udc00"})  # json.dumps writes it as \udc00
        for body in (raw, raw[:-1] + ',"stream":true}'):
            r = _post(tiny_server, path, body)
            assert r.status_code == (404 if field == "model" else 400), (field, r.text)
            error = r.json()["error"]
            assert "\n" not in error["message"], (field, error)
            if field not in ("model", "suffix"):  # a model no one serves; suffix: not supported at all
                assert "lone surrogate" in error["message"] and error["param"].startswith(field), (field, error)


def test_a_fields_own_refusal_has_no_pydantic_prefix(tiny_server):
    """Trial 36b: user's and metadata's refusals read "Value error, ...", pydantic's prefix."""
    for raw in ('{"prompt":"a","user":"\\udc00","max_tokens":1}', '{"prompt":"a","metadata":{"k":"\\udc00"},"max_tokens":1}',
                '{"prompt":"a","metadata":{"k":"' + "v" * 600 + '"},"max_tokens":1}'):
        error = _post(tiny_server, "/v1/completions", raw).json()["error"]
        assert "Value error" not in error["message"] and error["message"].startswith("Invalid value for "), error
