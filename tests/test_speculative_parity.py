"""Speculative decoding changes nothing but speed: every sampling option behaves as it does without it.

A verification row goes through the same logits processors, sampler and output processor
as a plain decode row. The matrix runs every option, alone and in a few combinations,
through each proposer (prompt lookup, the target's first layer, a separate draft model) at
k = 1, 3 and 5, and compares with the same requests decoded without speculation: token ids,
text, finish and stop reasons, logprobs (values within 1e-4, ranks equal). After every run
no KV block is held and the counters agree with the events.

The matrix runs on a tiny random LLaMA with the real tokenizer (tied embeddings: left alone
it repeats its last token, so prompt lookup has something to accept; penalties make it
wander). The draft model is a one-layer LLaMA made with the same seed, so it shares the
target's embedding and first layer and agrees with it often but not always. The two
failing inputs of issue 14 run on the real model.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm_core import events as ev
from nanovllm_core.config import EngineConfig
from nanovllm_core.engine import llm_engine
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_core.model.loader import load_model
from nanovllm_core.outputs import CompletionOutput, RequestOutput
from nanovllm_core.sampling_params import SamplingParams
from tests.conftest import save_tiny_llama

MAX_MODEL_LEN = 64
EOS = 2  # <|im_end|>, the tiny LLaMA's end-of-sequence id

# ---------------------------------------------------------------------------- the failing inputs

FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
COUNTING = "one two three four five six seven eight nine ten one two three four five six seven eight"


@pytest.mark.real_model
@pytest.mark.parametrize("proposer", ["ngram", "self:8"])
def test_min_tokens_holds_eos_back_under_speculation(make_llm, proposer):
    llm = make_llm(speculative_model=proposer, num_speculative_tokens=3, num_kv_blocks=64)
    prompt = llm.get_tokenizer().apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=12), use_tqdm=False)
    c = out[0].outputs[0]
    # the plain run's tokens: no EOS (2) before the 12th token, then the answer ends with EOS
    assert c.token_ids == [504, 3575, 282, 4649, 314, 7042, 30, 339, 5248, 5587, 288, 724, 351, 338, 30, 2]
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.real_model
def test_logprobs_0_under_speculation_give_the_chosen_tokens_logprob_and_rank(make_llm):
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0)
    plain = make_llm(num_kv_blocks=64).generate([COUNTING], params, use_tqdm=False)[0].outputs[0]
    llm = make_llm(speculative_model="ngram", num_speculative_tokens=3, num_kv_blocks=64)
    spec = llm.generate([COUNTING], params, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == [7462, 582, 827, 1296, 1876, 2531, 2976, 4962, 4475, 7462]
    assert llm.stats()["spec_accepted_tokens"] > 0  # some of these tokens were kept by a verification
    assert_same_completion(plain, spec)
    assert all(list(entry) == [token] for token, entry in zip(spec.token_ids, spec.logprobs))  # logprobs=0: the chosen one


@pytest.mark.real_model
@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_tokens_kept_by_verification_have_their_raw_logprob_and_rank(make_llm, real_model, seed):
    llm = make_llm(speculative_model="ngram", num_speculative_tokens=3, num_kv_blocks=64)
    params = SamplingParams(temperature=0.8, seed=seed, max_tokens=8, logprobs=1, ignore_eos=True)
    out = llm.generate([COUNTING], params, use_tqdm=False)[0]
    c = out.outputs[0]
    model = real_model[0]
    ids = out.prompt_token_ids + c.token_ids
    with torch.no_grad():
        from nanovllm_core.attention.contiguous import ContiguousKVCache

        cache = ContiguousKVCache(model.config, len(ids), torch.float32, torch.device("cpu"))
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), cache.context(0, len(ids)))
        ref = model.compute_logits(hidden[len(out.prompt_token_ids) - 1:-1]).log_softmax(-1)
    assert len(c.logprobs) == len(c.token_ids) == 8
    for step, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert entry[token].logprob == pytest.approx(ref[step, token].item(), abs=1e-4)
        assert entry[token].rank == 1 + int((ref[step] > ref[step, token]).sum())
        assert {t for t, lp in entry.items() if lp.rank == 1} == {int(ref[step].argmax())}


# ---------------------------------------------------------------------------- the matrix (tiny LLaMA)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    """(model, tokenizer, resolved) of the tiny target, and the folder of its one-layer draft."""
    root = tmp_path_factory.mktemp("spec-parity")
    target = save_tiny_llama(root / "target", default_model_dir)
    draft = save_tiny_llama(root / "draft", default_model_dir, num_hidden_layers=1)  # same seed: same embedding, layer 0
    return load_model(str(target), torch.device("cpu"), torch.float32), str(draft)


@pytest.fixture(scope="module")
def draft_models():
    """Loaded draft models by name: each (proposer, k) engine reuses the one load."""
    return {}


def build_engine(tiny, draft_models, monkeypatch, proposer: str | None = None, k: int = 0) -> LLMEngine:
    (model, tokenizer, resolved), draft_dir = tiny
    spec = {}
    if proposer is not None:
        spec = dict(speculative_model=draft_dir if proposer == "draft" else proposer, num_speculative_tokens=k)
        load = llm_engine.load_draft_model

        def cached(name, *args):
            if name not in draft_models:
                draft_models[name] = load(name, *args)
            return draft_models[name]

        monkeypatch.setattr(llm_engine, "load_draft_model", cached)
    config = EngineConfig(model=str(resolved.path), num_kv_blocks=160, max_model_len=MAX_MODEL_LEN, **spec)
    return LLMEngine(config, model, tokenizer, resolved)


def run(engine: LLMEngine, requests: dict[str, tuple]) -> tuple[dict[str, RequestOutput], list[ev.Event]]:
    """Run the named (prompt, params) requests to the end; check the pool after every step and the counters after all."""
    events: list[ev.Event] = []
    engine.subscribe(events.append, topk=3, blocks=False)
    ids = {engine.add_request(prompt, params): name for name, (prompt, params) in requests.items()}
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[ids[out.request_id]] = out
        engine.block_manager.check_invariants(engine.scheduler.running + engine.scheduler.waiting)
    assert set(done) == set(requests)
    assert_counters_agree(engine, done, events)
    return done, events


def assert_counters_agree(engine: LLMEngine, done: dict[str, RequestOutput], events: list[ev.Event]) -> None:
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0, "a KV block is still held after every request finished"
    outputs = [c for out in done.values() for c in out.outputs]
    assert stats["total_output_tokens"] == sum(len(c.token_ids) for c in outputs)
    sampled = [e for e in events if isinstance(e, ev.TokenSampled)]
    assert len(sampled) == stats["total_output_tokens"]
    for e in sampled:
        if e.greedy:
            assert e.top[0].token_id == e.token_id  # greedy takes the first of what it chose from
    steps = [e for e in events if isinstance(e, ev.SpecDecodeStep)]
    assert len(steps) == stats["spec_verifications"]
    assert sum(len(e.draft_tokens) for e in steps) == stats["spec_draft_tokens"]
    assert sum(sum(e.accepted) for e in steps) == stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    for e in steps:
        assert e.num_query_tokens == 1 + len(e.draft_tokens)
    # a stop inside an accepted run drops the rest of the run: at most every kept token is appended
    kept = sum(sum(e.accepted) + 1 for e in steps)
    assert sum(e.speculative for e in sampled) <= kept
    assert sum(e.speculative for e in sampled) >= len(steps)  # each verification kept at least one token


def assert_same_completion(a: CompletionOutput, b: CompletionOutput, name: str = "") -> None:
    """``b`` (with speculation) is ``a`` (without): tokens, text, reasons, logprobs within 1e-4 with equal ranks."""
    assert b.token_ids == a.token_ids, name
    assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason), name
    assert (a.logprobs is None) == (b.logprobs is None), name
    if a.logprobs is None:
        return
    assert len(b.logprobs) == len(a.logprobs) == len(a.token_ids), name
    for la, lb in zip(a.logprobs, b.logprobs):
        assert list(lb) == list(la), name  # the same candidates, in the same order
        for token in la:
            assert lb[token].rank == la[token].rank, name
            assert lb[token].logprob == pytest.approx(la[token].logprob, abs=1e-4), name
    assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4 * len(a.token_ids)), name


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 12, **kw})


@pytest.fixture(scope="module")
def cases(tiny, draft_models):
    """name -> (prompt, params). Stop ids and strings come from free runs, so that each one really fires."""
    (_, tokenizer, _), _ = tiny
    fox = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    fruit = tokenizer.encode("A list of fruits: apple, banana, cherry, apple,")
    long = (fox * 8)[: MAX_MODEL_LEN - 5]
    with pytest.MonkeyPatch.context() as mp:
        free, _ = run(build_engine(tiny, draft_models, mp), {
            "repeats": (fox, greedy()),
            "wanders": (fox, greedy(repetition_penalty=2.0)),
        })
    wander = free["wanders"].outputs[0]
    stop_id, early_id = wander.token_ids[5], wander.token_ids[2]
    stop_str = tokenizer.decode(wander.token_ids[6:8]).strip()[:4]
    assert stop_str and stop_str in wander.text
    penalty = dict(repetition_penalty=2.0)
    return {
        # alone
        "greedy": (fox, greedy()),
        "max_tokens": (fruit, greedy(max_tokens=3)),
        "max_model_len": (long, greedy(max_tokens=16)),
        "logprobs": (fox, greedy(logprobs=3)),
        "logprobs_0": (fruit, greedy(logprobs=0)),
        "repetition_penalty": (fox, greedy(**penalty)),
        "presence_frequency": (fruit, greedy(presence_penalty=1.0, frequency_penalty=0.3)),
        "stop_token_ids": (fox, greedy(stop_token_ids=[stop_id], **penalty)),
        "min_tokens": (fox, greedy(stop_token_ids=[early_id], min_tokens=6, **penalty)),
        "stop_string": (fox, greedy(stop=[stop_str], **penalty)),
        "include_stop_str": (fox, greedy(stop=[stop_str], include_stop_str_in_output=True, **penalty)),
        "top_k": (fox, SamplingParams(temperature=0.8, top_k=1, seed=1, max_tokens=12)),
        "top_p": (fox, SamplingParams(temperature=1.5, top_p=1e-6, seed=2, max_tokens=12)),
        "min_p": (fox, SamplingParams(temperature=0.7, min_p=1.0, seed=3, max_tokens=12)),
        "n": (fox, greedy(n=2)),
        # the tiny model repeats its last token: after EOS it proposes EOS
        "eos": (fox + [EOS], greedy()),
        "min_tokens_eos": (fox + [EOS], greedy(min_tokens=4)),
        "ignore_eos_special_tokens": (fox + [EOS], greedy(ignore_eos=True, skip_special_tokens=False, max_tokens=8)),
        # together
        "ban_penalties_logprobs": (fox, greedy(stop_token_ids=[early_id], min_tokens=6, frequency_penalty=0.3,
                                               logprobs=2, **penalty)),
        "sampled_stop_included": (fox, SamplingParams(temperature=0.9, top_k=1, seed=4, max_tokens=12,
                                                      stop_token_ids=[stop_id], include_stop_str_in_output=True,
                                                      **penalty)),
        "n_logprobs_stop": (fox, greedy(n=2, logprobs=1, stop=[stop_str], **penalty)),
        "max_model_len_penalties": (long, greedy(max_tokens=16, presence_penalty=0.4, logprobs=1)),
    }


@pytest.fixture(scope="module")
def reference(tiny, draft_models, cases):
    with pytest.MonkeyPatch.context() as mp:
        done, _ = run(build_engine(tiny, draft_models, mp), cases)
    return done


def test_every_option_of_the_matrix_takes_effect_without_speculation(cases, reference):
    """The matrix is only worth running if each option changes something: check it on the plain run."""
    out = {name: reference[name].outputs[0] for name in cases}
    plain = out["greedy"].token_ids
    assert out["repetition_penalty"].token_ids != plain
    assert out["presence_frequency"].token_ids != out["logprobs_0"].token_ids  # the same prompt, no penalty
    assert out["max_tokens"].finish_reason == "length" and len(out["max_tokens"].token_ids) == 3
    lengths = {name: len(reference[name].prompt_token_ids) + len(out[name].token_ids)
               for name in ("max_model_len", "max_model_len_penalties")}
    assert lengths == dict.fromkeys(lengths, MAX_MODEL_LEN)
    stop_id = cases["stop_token_ids"][1].stop_token_ids[0]
    assert (out["stop_token_ids"].finish_reason, out["stop_token_ids"].stop_reason) == ("stop", stop_id)
    assert out["stop_token_ids"].token_ids[-1] == stop_id and len(out["stop_token_ids"].token_ids) == 6
    early_id = cases["min_tokens"][1].stop_token_ids[0]
    assert early_id not in out["min_tokens"].token_ids[:6]  # banned until 6 tokens exist
    assert out["min_tokens"].token_ids[:2] == out["repetition_penalty"].token_ids[:2]  # the same until the ban bites
    stop_str = cases["stop_string"][1].stop[0]
    assert out["stop_string"].stop_reason == stop_str and stop_str not in out["stop_string"].text
    assert out["include_stop_str"].text.endswith(stop_str)
    for name in ("top_k", "top_p", "min_p"):
        assert out[name].token_ids == plain  # the kept set is the argmax alone, through the sampling path
    assert [c.token_ids for c in reference["n"].outputs] == [plain, plain]
    assert out["logprobs"].logprobs and len(out["logprobs"].logprobs[0]) >= 3
    assert (out["eos"].token_ids, out["eos"].finish_reason) == ([EOS], "stop")
    assert EOS not in out["min_tokens_eos"].token_ids[:4]
    assert out["ignore_eos_special_tokens"].token_ids == [EOS] * 8
    assert out["ignore_eos_special_tokens"].text == "<|im_end|>" * 8


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("proposer", ["ngram", "self:1", "draft"])
def test_every_option_gives_the_same_output_with_speculation(tiny, draft_models, monkeypatch, cases, reference,
                                                             proposer, k):
    done, events = run(build_engine(tiny, draft_models, monkeypatch, proposer, k), cases)
    for name in cases:
        assert len(done[name].outputs) == len(reference[name].outputs)
        for a, b in zip(reference[name].outputs, done[name].outputs):
            assert_same_completion(a, b, name)
    steps = [e for e in events if isinstance(e, ev.SpecDecodeStep)]
    assert sum(sum(e.accepted) for e in steps) > 0  # speculation really kept drafts
    assert any(not all(e.accepted) for e in steps) or proposer == "ngram"  # and rejected some
    assert {e.greedy for e in steps} == {True, False}  # both verification rules ran
