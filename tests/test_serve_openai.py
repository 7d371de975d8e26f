"""``nanovllm serve`` speaks OpenAI's API: the official client and raw HTTP get what ``LLM.generate`` gives.

A server runs in this process on a tiny random LLaMA (the ``tiny_server`` fixture, bound to
127.0.0.1 on a free port, API key ``test-key``); references come from a second engine over
the same weights, while the server is idle.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from nanovllm_core import LLM, SamplingParams
from tests.conftest import poll_until

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def reference(make_tiny_engine):
    return LLM.from_engine(make_tiny_engine())


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=tiny_server.api_key, max_retries=0,
                       timeout=60) as c:
        yield c


def model_name(client) -> str:
    return client.models.list().data[0].id


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_completion_equals_llm_generate_with_usage(client, reference):
    want = reference.generate(PROMPTS[:2], greedy(12, ignore_eos=True), use_tqdm=False)
    for prompt, ref in zip(PROMPTS[:2], want):
        got = client.completions.create(model=model_name(client), prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == ref.outputs[0].text
        assert got.choices[0].finish_reason == "length"
        assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert got.usage.completion_tokens == 12
        assert got.usage.total_tokens == len(ref.prompt_token_ids) + 12


def test_streamed_completion_concatenates_to_the_same_text(client, reference):
    ref = reference.generate(PROMPTS[2], greedy(10, ignore_eos=True), use_tqdm=False)[0]
    chunks = list(client.completions.create(model=model_name(client), prompt=PROMPTS[2], max_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == ref.outputs[0].token_ids
    # the prompt's ids come once, with the choice's first chunk (vLLM's return_token_ids)
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert not any("prompt_token_ids" in c.choices[0].model_extra for c in chunks[1:] if c.choices)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_whole_and_streamed_equal_llm_chat(client, reference):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]
    ref = reference.chat(messages, greedy(8, ignore_eos=True), use_tqdm=False)[0]
    whole = client.chat.completions.create(model=model_name(client), messages=messages, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == ref.outputs[0].text
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids) and whole.usage.completion_tokens == 8
    # return_token_ids: vLLM puts a chat's prompt ids on the response, the generated ones on the choice
    assert whole.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert whole.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
    stream = client.chat.completions.create(messages=messages, model=whole.model, max_completion_tokens=8,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["prompt_token_ids"] == ref.prompt_token_ids  # the first chunk only, as vLLM
    assert not any("prompt_token_ids" in c.model_extra for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_http_several_prompts_n_and_logprobs(tiny_server, reference):
    body = {"prompt": PROMPTS[:2], "max_tokens": 5, "temperature": 0, "n": 2, "logprobs": 3,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(tiny_server.url + "/v1/completions", json=body, headers=tiny_server.headers, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    want = reference.generate(PROMPTS[:2], greedy(5, ignore_eos=True, logprobs=3), use_tqdm=False)
    for i, choice in enumerate(data["choices"]):
        ref = want[i // 2].outputs[0]  # greedy: both samples of a prompt are the same
        assert choice["token_ids"] == ref.token_ids and choice["text"] == ref.text
        assert choice["prompt_token_ids"] == want[i // 2].prompt_token_ids
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
        assert all(len(top) <= 3 for top in lp["top_logprobs"])
        assert lp["token_logprobs"] == pytest.approx([e[t].logprob for e, t in zip(ref.logprobs, ref.token_ids)],
                                                     abs=1e-5)
    usage = data["usage"]
    assert usage["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in want)
    assert usage["completion_tokens"] == 4 * 5


def test_chat_logprobs_and_stop_string(tiny_server, reference):
    ref = reference.generate(PROMPTS[0], greedy(8, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = ref[3:5]  # a stop string the greedy text is known to contain
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stop": [stop], "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, headers=tiny_server.headers,
                      timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref[:ref.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["stop_reason"] == stop

    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 3,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json=chat, headers=tiny_server.headers, timeout=60)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)


# Every bad request gets its status and OpenAI's error shape, and the server keeps serving.
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_token": 3}, 400, "Unrecognized request argument supplied: max_token"),
    ("/v1/completions", {"max_tokens": 3}, 400, "Missing required parameter: prompt"),
    # 404, as OpenAI and vLLM answer (it was 400: newcomer trial, issue 29)
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404,
     "The model `gpt-4` does not exist"),
    ("/v1/completions", {"prompt": "word " * 600}, 400, "maximum context length is 512 tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400, "maximum context length is 512 tokens"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt is empty"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("/v1/completions", "not json", 400, "not valid JSON"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages is empty"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "tools"),  # ([] asks for nothing and is served: trial 11)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs=2 needs logprobs: true; send \"logprobs\": true, or leave top_logprobs out"),
    ("/v1/engine/control", {"command": "explode"}, 400, 'unknown command "explode"'),
    ("/v1/engine/control", {}, 400, "the command is missing"),
    ("/v1/engine/control", [1], 400, "must be a JSON object"),
    ("/v1/engine/control", {"command": "abort", "request_id": "nope"}, 404, 'no running or waiting request "nope"'),
    ("/v1/engine/control", {"command": "step"}, 409, "pause first"),
    ("/v1/engine/control", {"command": "submit", "prompt": "hi", "params": {"temprature": 0}}, 400, "temprature"),
]


def test_bad_requests_get_their_status_and_the_next_request_succeeds(tiny_server):
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=60) as http:
        for path, body, status, message in BAD_REQUESTS:
            if isinstance(body, str):
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert message in error["message"] and set(error) == {"message", "type", "param", "code"}, error
            ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        r = http.get("/v1/engine/events", params={"topk": "many"})
        assert r.status_code == 400 and "topk" in r.json()["error"]["message"]


def test_api_key_is_required_on_v1_but_not_on_health(tiny_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for path in ("/v1/models", "/v1/engine/events"):
            assert httpx.get(tiny_server.url + path, headers=headers).status_code == 401
        assert httpx.post(tiny_server.url + "/v1/engine/control", json={"command": "pause"},
                          headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    assert tiny_server.controller.state != "paused"  # the refused pause did nothing


def test_an_empty_api_key_is_no_key_on_every_path(tiny_server, monkeypatch):
    """Newcomer trial (issue 29): `nanovllm serve --api-key ""` refused every client that sent a key
    (401) while its start-up line and the 0.0.0.0 warning said there was none."""
    from starlette.testclient import TestClient

    from nanovllm_core.entrypoints import cli as serve_cli
    from nanovllm_core.entrypoints.api_server import bind_warning, build_app
    from nanovllm_tui import options

    monkeypatch.delenv("NANOVLLM_API_KEY", raising=False)
    assert serve_cli.build_parser().parse_args(["--api-key", ""]).api_key is None
    assert options.build_parser().parse_args(["--api-key", ""]).api_key is None
    monkeypatch.setenv("NANOVLLM_API_KEY", "")
    assert serve_cli.build_parser().parse_args([]).api_key is None
    assert bind_warning("0.0.0.0", None) is not None  # the warning says what the server does: no key
    http = TestClient(build_app(tiny_server.controller, api_key=""))  # no lifespan: /v1/models needs none
    for headers in ({}, {"Authorization": "Bearer anything"}):
        r = http.get("/v1/models", headers=headers)
        assert r.status_code == 200 and r.json()["data"][0]["id"], r.text


def test_models_lists_the_served_model(client, tiny_server):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == tiny_server.controller.engine.model_name
    assert models[0].model_extra["max_model_len"] == 512
    # what runs: the tiny model is a safetensors checkpoint, so auto chose float
    assert models[0].model_extra["quantization"] == "none"
    assert models[0].model_extra["weight_format"].startswith("float32 ")


def test_shutdown_ends_streams_at_once_with_abort_while_the_engine_is_paused(make_tiny_engine):
    """Even when the engine cannot confirm the abort soon (here: paused), clients get their end and [DONE]."""
    from nanovllm_core.engine.controller import EngineController
    from tests.serve_helpers import start_server

    controller = EngineController.from_engine(make_tiny_engine(num_kv_blocks=32), start_paused=True)
    server = start_server(controller, api_key=None)
    try:
        body = {"prompt": "hi", "max_tokens": 50, "stream": True, "return_token_ids": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert server.stop(timeout=30)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])["choices"][0]
        assert last["finish_reason"] == "abort" and last["token_ids"] == []
    finally:
        controller.shutdown(timeout=5)


def test_control_abort_stops_a_request_that_exists_and_refuses_one_that_does_not(tiny_server):
    """Newcomer trial 3: aborting an id that names no request answered {"ok": true}. It is now a 404
    naming the id; a prompt submitted through control can be aborted before the engine has added it."""
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=60) as http:
        assert http.post("/v1/engine/control", json={"command": "pause"}).json()["ok"]
        try:
            body = {"command": "submit", "request_id": "to-abort", "prompt": "hi", "params": {"max_tokens": 5}}
            assert http.post("/v1/engine/control", json=body).json()["ok"]
            assert http.post("/v1/engine/control", json={"command": "abort", "request_id": "to-abort"}).json() == {
                "ok": True}
            assert poll_until(lambda: http.post("/v1/engine/control", json={
                "command": "abort", "request_id": "to-abort"}).status_code == 404, 10)  # finished: gone
        finally:
            http.post("/v1/engine/control", json={"command": "resume"})
    tiny_server.wait_idle()


def test_openai_client_reads_n_choices_streamed_one_per_chunk(client):
    """Trial 7: the chunks hold one choice each (vLLM's layout); the client gathers them by index."""
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(messages=messages, model=model_name(client), max_completion_tokens=5,
                                           temperature=0, n=2, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(messages=messages, model=whole.model, max_completion_tokens=5,
                                                 temperature=0, n=2, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert all(len(c.choices) == 1 for c in chunks)
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [(0, "assistant"), (1, "assistant")]
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(m.delta.content or "" for m in mine) == choice.message.content
        assert [m.finish_reason for m in mine if m.finish_reason] == ["length"] and mine[-1].finish_reason
    completion = client.completions.create(model=whole.model, prompt=PROMPTS[:2], max_tokens=3, temperature=0, n=2,
                                           stream=True, extra_body={"ignore_eos": True})
    got = {}
    for c in completion:
        assert len(c.choices) == 1
        got[c.choices[0].index] = got.get(c.choices[0].index, "") + c.choices[0].text
    assert sorted(got) == [0, 1, 2, 3]
