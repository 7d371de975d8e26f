"""Trial 16b: ``logit_bias`` (vLLM's field, refused here before), the Content-Type of POST bodies,
JSON spelling and a ``code`` on every error, and how ``n`` counts in the prompt metrics."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from nanovllm_core.llm import LLM
from nanovllm_core.sampling_params import SamplingParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = [1, 2, 3, 4, 5]


def post(server, path: str, **fields) -> httpx.Response:
    body = {"prompt": "Hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "Say hi"}]}
    return httpx.post(server.url + path, json={**body, "max_tokens": 1, **fields}, headers=server.headers, timeout=60)


def greedy(llm: LLM, prompt=PROMPT, **fields) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, **fields)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


# ---------------------------------------------------------------------- 1. logit_bias

def test_logit_bias_plus_100_makes_greedy_pick_a_token_and_minus_100_bans_the_greedy_one(make_tiny_engine):
    llm = LLM.from_engine(make_tiny_engine())
    plain = greedy(llm)
    target = next(t for t in range(7, 100) if t not in plain)
    assert greedy(llm, logit_bias={target: 100}) == [target] * 3
    banned = greedy(llm, logit_bias={plain[0]: -100})
    assert banned[0] != plain[0]
    assert greedy(llm, logit_bias={target: 1e9}) == [target] * 3  # clamped to 100, still a huge push
    assert SamplingParams(logit_bias={5: 1e9, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}


@pytest.mark.parametrize("spec", [{}, {"speculative_model": "ngram", "num_speculative_tokens": 3}],
                         ids=["plain", "ngram-speculation"])
def test_biased_and_unbiased_requests_in_one_batch_each_get_their_own_tokens(make_tiny_engine, spec):
    llm = LLM.from_engine(make_tiny_engine(**spec))
    alone = greedy(llm, prompt=[9, 9, 9, 9, 9, 9])
    target = next(t for t in range(7, 100) if t not in alone)
    biased = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={target: 100})
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, logit_bias={target: 100})
    outs = llm.generate([[9, 9, 9, 9, 9, 9]] * 3, [biased, plain, sampled], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [target] * 6
    assert outs[1].outputs[0].token_ids == alone
    assert outs[2].outputs[0].token_ids == [target] * 6  # +100 outweighs any temperature-0.8 draw here


def test_logprobs_are_those_of_the_raw_unbiased_logits(make_tiny_engine):
    """vLLM's default logprobs_mode "raw_logprobs": the bias changes the choice, not the logprobs."""
    llm = LLM.from_engine(make_tiny_engine())
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=2), use_tqdm=False)[0]
    token = plain.outputs[0].token_ids[0]
    target = next(t for t in range(7, 100) if t != token)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=2, logit_bias={target: 100}),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [target]
    assert out.logprobs[0][target].rank > 1  # its raw rank, not first
    assert abs(out.logprobs[0][token].logprob - plain.outputs[0].logprobs[0][token].logprob) < 1e-5


@pytest.mark.parametrize("bias, words", [({-1: 1}, "integers >= 0"), ({True: 1}, "integers >= 0"),
                                         ({"5": 1}, "integers >= 0"), ({5: float("nan")}, "finite number"),
                                         ({5: "1"}, "finite number"), ([5], "map of token id")])
def test_bad_logit_bias_is_refused_in_one_line(bias, words):
    with pytest.raises(ValueError, match=words) as e:
        SamplingParams(logit_bias=bias)
    assert "\n" not in str(e.value)


def test_a_logit_bias_id_outside_the_vocabulary_is_refused_by_the_library(make_tiny_engine):
    llm = LLM.from_engine(make_tiny_engine())
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias has the token id .* outside the vocabulary"):
        llm.generate([PROMPT], SamplingParams(logit_bias={vocab: 5}), use_tqdm=False)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_the_server_takes_logit_bias_on_both_routes(tiny_server, path):
    plain = post(tiny_server, path, temperature=0, max_tokens=3, return_token_ids=True).json()["choices"][0]
    ids = plain["token_ids"]
    target = next(t for t in range(7, 100) if t not in ids)
    r = post(tiny_server, path, temperature=0, max_tokens=3, return_token_ids=True, ignore_eos=True,
             logit_bias={str(target): 100, str(ids[0]): -100}, presence_penalty=2, frequency_penalty=2,
             repetition_penalty=1.5)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"][0] == target


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("bias, words", [({"abc": 1}, "not a token id"), ({"-3": 1}, "integers >= 0"),
                                         ({"99999999": 1}, "outside the vocabulary"),
                                         ({"5": "x"}, "Input should be a valid number")])
def test_the_server_refuses_bad_logit_bias_keys_with_a_400_naming_the_field(tiny_server, path, bias, words):
    r = post(tiny_server, path, logit_bias=bias)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"].startswith("logit_bias") and error["code"], error


def test_the_narrator_names_the_logit_bias_among_the_processors():
    from nanovllm_core.educational.narrator_sampling import processors

    assert processors({"logit_bias": [[5, 100.0], [6, -100.0]]}, 0) == ["the logit bias on 2 tokens"]


# ---------------------------------------------------------------------- 2. the Content-Type of a POST body

@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/v1/engine/control"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None,
                                          "application/jsonx", "multipart/form-data; boundary=x"])
def test_a_body_not_sent_as_application_json_is_refused_naming_the_content_type(tiny_server, path, content_type):
    """Trial 16b: a JSON body sent as text/plain was served (vLLM's validate_json_request refuses it), and a
    form body got "not valid JSON", never naming the Content-Type."""
    body = {"prompt": "Hi", "max_tokens": 1} if path == COMPLETIONS else (
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1} if path == CHAT else {"command": "pause"})
    headers = {**tiny_server.headers, **({"Content-Type": content_type} if content_type else {})}
    r = httpx.post(tiny_server.url + path, content=json.dumps(body), headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_media_type" and error["param"] == "Content-Type"
    assert "Only 'application/json' is allowed" in error["message"]
    assert (json.dumps(content_type) if content_type else "no Content-Type header") in error["message"]
    assert "Content-Type: application/json" in error["message"] and "\n" not in error["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_application_json_with_or_without_a_charset_is_served(tiny_server, content_type):
    r = httpx.post(tiny_server.url + COMPLETIONS, content=json.dumps({"prompt": "Hi", "max_tokens": 1}),
                   headers={**tiny_server.headers, "Content-Type": content_type}, timeout=60)
    assert r.status_code == 200, r.text


def test_every_curl_with_a_body_in_the_docs_sends_the_json_content_type():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = doc.read_text()
        for command in re.findall(r"curl\b(?:[^\n]*\\\n)*[^\n]*", text):
            if re.search(r"\s(-d|--data\S*)\s", command):
                assert 'Content-Type: application/json' in command, f"{doc.name}: {command}"


# ---------------------------------------------------------------------- 3. JSON spelling and a code on every error

CONTROL = "/v1/engine/control"
HI = [{"role": "user", "content": "Hi"}]
ERRORS = [  # (path, body, extra headers): each a 4xx the server answers before any work
    (CONTROL, {"command": "step", "n": True}, {}), (CONTROL, {"command": "step", "n": 0}, {}),
    (CONTROL, {"command": "step", "n": None}, {}), (CONTROL, {"command": "fly"}, {}), (CONTROL, {}, {}),
    (CONTROL, [1], {}), (CONTROL, {"command": "submit"}, {}), (CONTROL, {"command": "submit", "prompt": "hi", "params": 5}, {}),
    (CONTROL, {"command": "submit", "prompt": "hi", "params": {"n": True}}, {}),
    (CONTROL, {"command": "submit", "prompt": "hi", "params": {"bogus": 1}}, {}),
    (CONTROL, {"command": "submit", "prompt": "hi", "request_id": "cmpl-1"}, {}),
    (CONTROL, {"command": "submit", "prompt": "hi", "params": {"logit_bias": {"x": 1}}}, {}),
    (CONTROL, {"command": "abort", "request_id": "nobody"}, {}),
    (CONTROL, {"command": "xray", "request_id": None, "layer": "a", "head": 0}, {}),
    (CONTROL, {"command": "xray", "request_id": None, "layer": 999, "head": 0}, {}),
    (CONTROL, {"command": "pause", "extra": True}, {}),
    (CHAT, {"messages": HI, "top_logprobs": 2}, {}), (CHAT, {"messages": []}, {}),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, {}), (CHAT, {"messages": HI, "stream_options": {}}, {}),
    (COMPLETIONS, {"prompt": []}, {}), (COMPLETIONS, {"prompt": ""}, {}), (COMPLETIONS, {"prompt": [99999999]}, {}),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, {}), (COMPLETIONS, {"prompt": "hi", "n": True}, {}),
    (COMPLETIONS, {"prompt": "hi", "max_token": 1}, {}), (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [99999999]}, {}),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"1": None, "2": True}}, {}), (COMPLETIONS, {"prompt": "hi", "model": "x"}, {}),
    (COMPLETIONS, {"prompt": "hi"}, {"X-Request-Id": "x" * 129}), (COMPLETIONS, {"prompt": "hi"}, {"X-Request-Id": ""}),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 99999}, {}), (COMPLETIONS, {"prompt": "hi", "echo": True}, {}),
    (COMPLETIONS, {"prompt": "hi", "priority": True}, {}), (COMPLETIONS, {"prompt": "hi", "suffix": "x"}, {}),
]


@pytest.mark.parametrize("path, body, headers", ERRORS, ids=[f"{p.rsplit('/', 1)[-1]}-{json.dumps(b)[:40]}-{list(h)}"
                                                               for p, b, h in ERRORS])
def test_every_error_carries_a_code_and_spells_values_as_json(tiny_server, path, body, headers):
    """Trial 16b: "step needs a whole n from 1 to 1000, got True" (the client sent true), and code null
    on control errors, top_logprobs without logprobs, an empty prompt, X-Request-Id errors and an
    out-of-vocabulary prompt. A client must be able to branch on code."""
    r = httpx.post(tiny_server.url + path, json=body, headers={**tiny_server.headers, **headers}, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert isinstance(error["code"], str) and error["code"], error
    assert not re.search(r"\b(True|False|None)\b(?!,? JSON null| \(JSON null)|(got|=|key|id|command|n) '", error["message"]), error["message"]

def test_shown_spells_values_as_json():
    from nanovllm_core.untrusted import shown

    assert [shown(v) for v in (True, None, "a", [1, False, None], {"k": "v"}, 2.5)] == \
        ["true", "null", '"a"', "[1, false, null]", '{"k": "v"}', "2.5"]
    assert shown(list(range(5000))) == "[0, 1, 2, 3, 4, 5, 6, 7, ...] (a list of 5000 items)"


# ---------------------------------------------------------------------- 4. how n counts in the prompt metrics

def test_n_samples_count_their_prompt_once_each_in_both_prompt_metrics_as_vllm_does(make_tiny_engine):
    """Trial 16b: an n=2 request counted its prompt once in vllm:prompt_tokens but twice in
    vllm:prefix_cache_queries. vLLM V1 runs n as n child requests, and both counters add each child's
    prompt (vllm/v1/metrics/stats.py IterationStats.update_from_output; vllm/v1/core/kv_cache_manager.py
    get_computed_blocks), so both count it twice."""
    llm = LLM.from_engine(make_tiny_engine())
    before = llm.stats()
    out = llm.generate([PROMPT, [7, 8, 9]], [SamplingParams(n=2, max_tokens=2, seed=0), SamplingParams(max_tokens=2)],
                       use_tqdm=False)
    after = llm.stats()
    assert after["total_prompt_tokens"] - before["total_prompt_tokens"] == 2 * len(PROMPT) + 3
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 2 * len(PROMPT) + 3
    assert len(out[0].prompt_token_ids) == len(PROMPT)  # what usage counts: the prompt once
