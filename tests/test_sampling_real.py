"""Stopping, samples, seeds, log-probabilities and streamed text on the real SmolLM2-135M-Instruct.

Most cases run greedily together in one batch (greedy outputs do not depend on batching,
see test_engine_equivalence.py); each test then checks one rule on one of them.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm_core import events as ev
from nanovllm_core.attention.contiguous import ContiguousKVCache
from nanovllm_core.engine.detokenizer import detokenize_new_token, start_detokenizer
from nanovllm_core.engine.sequence import Sequence
from nanovllm_core.llm import LLM
from nanovllm_core.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

PARIS = "The capital of France is"  # greedy: " Paris.\n\nThe answer is: 2018-01"
EOS = 2  # <|im_end|>


def chat(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": 10, **kw})


@pytest.fixture(scope="module")
def cases(make_engine):
    """name -> (RequestOutput, ``text`` and ``token_text`` of its TokenSampled events), all run in one batch."""
    engine = make_engine(num_kv_blocks=64)
    tok = engine.tokenizer
    yes_no = chat(tok, "Is the sky blue? Answer yes or no.")  # greedy: "No." then EOS
    cat = chat(tok, "Write the Chinese word for cat.")  # greedy: 'The Chinese word for cat is "婉' (3 byte tokens)
    requests = {
        "stop_string_across_tokens": (PARIS, greedy(stop=["answer is"])),  # ' answer' + ' is'
        "stop_string_included": (PARIS, greedy(stop=["answer is"], include_stop_str_in_output=True)),
        "stop_token": (PARIS, greedy(stop_token_ids=[30])),  # 30 = "."
        "one_token": (PARIS, greedy(max_tokens=1)),
        "eos": (yes_no, greedy()),
        "min_tokens": (yes_no, greedy(min_tokens=6, max_tokens=8)),
        "ignore_eos": (yes_no, greedy(ignore_eos=True, max_tokens=6)),
        "special_tokens_shown": (yes_no, greedy(ignore_eos=True, max_tokens=6, skip_special_tokens=False)),
        "multibyte": (cat, greedy()),
    }
    pieces: dict[str, list[str]] = {}
    token_texts: dict[str, list[str]] = {}

    def listen(e: ev.Event) -> None:
        if isinstance(e, ev.TokenSampled):
            pieces.setdefault(e.request_id, []).append(e.text)
            token_texts.setdefault(e.request_id, []).append(e.token_text)

    engine.subscribe(listen, topk=0, blocks=False)
    llm = LLM.from_engine(engine)
    outs = llm.generate([p for p, _ in requests.values()], [s for _, s in requests.values()], use_tqdm=False)
    return {name: (out, pieces[out.request_id], token_texts[out.request_id]) for name, out in zip(requests, outs)}


def test_a_stop_string_spanning_two_tokens_ends_the_text_before_it(cases, real_model):
    out, _, _ = cases["stop_string_across_tokens"]
    c = out.outputs[0]
    tok = real_model[1]
    assert not any("answer is" in tok.decode([t]) for t in c.token_ids)  # no single token holds it
    assert (c.text, c.finish_reason, c.stop_reason) == (" Paris.\n\nThe ", "stop", "answer is")


def test_include_stop_str_in_output_keeps_the_stop_string(cases):
    c = cases["stop_string_included"][0].outputs[0]
    assert (c.text, c.stop_reason) == (" Paris.\n\nThe answer is", "answer is")


def test_a_stop_token_id_ends_generation_and_is_the_stop_reason(cases):
    c = cases["stop_token"][0].outputs[0]
    assert c.token_ids == [7042, 30]  # " Paris", "."; the stop token stays in the ids...
    assert (c.text, c.finish_reason, c.stop_reason) == (" Paris", "stop", 30)  # ...but not in the text


def test_max_tokens_one_gives_exactly_one_token(cases):
    c = cases["one_token"][0].outputs[0]
    assert (len(c.token_ids), c.finish_reason, c.stop_reason) == (1, "length", None)


def test_eos_stops_with_finish_reason_stop_and_no_stop_reason(cases):
    c = cases["eos"][0].outputs[0]
    assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
    assert (c.text, c.finish_reason, c.stop_reason) == ("No.", "stop", None)


def test_min_tokens_suppresses_eos_until_reached(cases):
    c = cases["min_tokens"][0].outputs[0]
    assert len(c.token_ids) >= 6 and EOS not in c.token_ids[:6]  # without min_tokens, EOS was the 3rd token


def test_ignore_eos_generates_past_eos_up_to_max_tokens(cases):
    c = cases["ignore_eos"][0].outputs[0]
    assert len(c.token_ids) == 6 and c.finish_reason == "length"
    assert c.token_ids[2] == EOS  # the model did end here
    assert c.text.startswith("No.") and "<|im_end|>" not in c.text  # special tokens are skipped by default


def test_skip_special_tokens_false_keeps_their_text(cases):
    c = cases["special_tokens_shown"][0].outputs[0]
    assert c.text.startswith("No.<|im_end|>")


@pytest.mark.parametrize("name", ["stop_string_across_tokens", "stop_string_included", "stop_token", "one_token", "eos",
                                  "min_tokens", "ignore_eos", "special_tokens_shown", "multibyte"])
def test_streamed_pieces_concatenate_to_the_final_text(cases, name):
    out, pieces, _ = cases[name]
    assert len(pieces) == len(out.outputs[0].token_ids)  # one TokenSampled per token
    assert "".join(pieces) == out.outputs[0].text


def test_streaming_holds_back_text_that_could_start_a_stop_string(cases):
    out, pieces, token_texts = cases["stop_string_across_tokens"]
    assert not any("answer" in p for p in pieces)  # " answer" waited for " is" and was then cut
    assert token_texts[-2:] == [" answer", " is"]  # while each token's own text is still shown


def test_a_character_split_over_several_tokens_streams_whole(cases, real_model):
    out, pieces, _ = cases["multibyte"]
    c = out.outputs[0]
    tok = real_model[1]
    assert any(ord(ch) > 0x2E80 for ch in c.text)  # a CJK character...
    assert "\ufffd" in "".join(tok.decode([t]) for t in c.token_ids)  # ...made of byte tokens that alone are not text
    assert "" in pieces and not any("\ufffd" in p for p in pieces)
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_incremental_detokenization_of_known_multibyte_tokens(real_model):
    tok = real_model[1]
    prompt = tok.encode("In Japanese:", add_special_tokens=False)
    output = tok.encode(" 日本の首都は東京です 🍕", add_special_tokens=False)
    seq = Sequence(seq_id=0, request_id="r", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                   params=SamplingParams())
    start_detokenizer(seq)
    pieces = []
    for t in output:
        seq.token_ids.append(t)
        pieces.append(detokenize_new_token(tok, seq))
    assert "".join(pieces) == " 日本の首都は東京です 🍕"
    assert pieces.count("") >= 5 and not any("\ufffd" in p for p in pieces)


# ---------------------------------------------------------------- samples, seeds, logprobs


def test_n_samples_share_the_prompt_blocks_and_come_back_in_index_order(make_engine):
    engine = make_engine(num_kv_blocks=64)
    prompt = chat(engine.tokenizer, "Name a color.")  # 34 tokens: two full 16-token blocks
    tables: list[dict[int, tuple[int, ...]]] = []
    engine.subscribe(lambda e: tables.append({t.index: t.block_table for t in e.tables})
                     if isinstance(e, ev.BlocksChanged) else None, topk=0, blocks=True)
    llm = LLM.from_engine(engine)
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({c.text for c in out.outputs}) > 1  # each sample has its own seed (seed + index)
    all_three = [t for t in tables if len(t) == 3]
    assert all_three and all(t[0][:2] == t[1][:2] == t[2][:2] for t in all_three)  # same physical prompt blocks


def test_a_seeded_request_gives_the_same_tokens_alone_and_inside_a_batch(make_llm):
    llm = make_llm(num_kv_blocks=64)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=5, ignore_eos=True)
    alone = llm.generate(PARIS, seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(
        ["Once upon a time", PARIS, "def fibonacci(n):"],
        [SamplingParams(temperature=1.0, max_tokens=5), seeded, SamplingParams(temperature=0, max_tokens=5)],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone


def test_logprobs_match_a_recomputation_with_our_model(make_llm, real_model):
    llm = make_llm(num_kv_blocks=64)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=6, logprobs=5, ignore_eos=True)
    out = llm.generate(PARIS, params, use_tqdm=False)[0]
    c = out.outputs[0]
    model = real_model[0]
    ids = out.prompt_token_ids + c.token_ids[:-1]
    cache = ContiguousKVCache(model.config, len(ids), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), cache.context(0, len(ids)))
        ref = model.compute_logits(hidden[len(out.prompt_token_ids) - 1:]).log_softmax(-1)
    assert len(c.logprobs) == len(c.token_ids)
    for step, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        top_lp, top_ids = ref[step].topk(5)
        top5 = {t: lp for t, lp in entry.items() if lp.rank <= 5}
        assert list(top5) == top_ids.tolist()
        assert [lp.logprob for lp in top5.values()] == pytest.approx(top_lp.tolist(), abs=1e-3)
        assert set(entry) == set(top5) | {token}  # the top 5 plus the chosen token
        assert entry[token].logprob == pytest.approx(ref[step, token].item(), abs=1e-3)
        assert entry[token].rank == 1 + int((ref[step] > ref[step, token]).sum())
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_samples_still_run_when_the_first_sample_fails_before_its_prompt_is_cached(make_engine):
    engine = make_engine(num_kv_blocks=64)
    real_run = engine.runner.run

    def run_failing_sample_0(scheduled, *args, **kwargs):
        if any(s.seq.index == 0 for s in scheduled):
            raise RuntimeError("injected fault")
        return real_run(scheduled, *args, **kwargs)

    engine.runner.run = run_failing_sample_0
    engine.add_request(PARIS, SamplingParams(n=3, temperature=0, max_tokens=2))
    finished = []
    for _ in range(10):  # bounded: a request left waiting forever would fail here, not hang
        finished += [o for o in engine.step() if o.finished]
        if finished:
            break
    assert [c.finish_reason for c in finished[0].outputs] == ["error", "length", "length"]
    assert engine.stats()["kv_blocks_used"] == 0


def test_stop_token_ids_outside_the_vocabulary_are_rejected(make_engine):
    engine = make_engine(num_kv_blocks=64)
    engine.add_request(PARIS, SamplingParams(stop_token_ids=[49152]))
    out = engine.step()[0]
    assert out.outputs[0].finish_reason == "rejected"
    assert out.error == "stop_token_ids contains 49152, outside the vocabulary (0..49151)"
