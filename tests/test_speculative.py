"""Speculative decoding inside the paged engine: greedy output never changes, nothing leaks.

Each proposer (prompt lookup ``ngram``, early-exit ``self:N``, and a draft model, here the
target itself) must give token-identical greedy output to the engine without speculation,
for k = 1, 3 and 5, in a batch, with prefix-cache hits, and when the KV pool is so small that
sequences get preempted. The distribution-level checks for sampling live in
``test_speculative_sampling.py``.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm_core import events as ev
from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.block_manager import BlockManager
from nanovllm_core.engine.scheduler import Scheduler
from nanovllm_core.engine.sequence import Sequence, SequenceStatus
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.speculative.ngram import propose_ngram
from nanovllm_core.speculative.metrics import expected_accepted_length
from tests.conftest import save_tiny_llama

SHARED = ("You are a careful assistant. Answer in one short sentence, and be precise about facts, "
          "names and numbers. Question: ")
PROMPTS = [
    SHARED + "What is the largest planet?",
    "A list of fruits: apple, banana, cherry, apple, banana, cherry, apple,",
    SHARED + "Who wrote Hamlet?",
]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROPOSERS = ["ngram", "self:26", "target"]


# ---------------------------------------------------------------------------- no model


def test_ngram_proposes_what_followed_the_latest_match():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6]
    # the suffix (5, 6) last occurred at 4..5, followed by 7, 2, 5, 6
    assert propose_ngram(tokens, 3) == [7, 2, 5]
    assert propose_ngram(tokens, 10) == [7, 2, 5, 6]  # fewer when the match is near the end


def test_ngram_prefers_the_longest_matching_ngram():
    tokens = [1, 2, 3, 9, 8, 3, 4, 1, 2, 3]
    # 3-gram (1, 2, 3) matches at 0 -> 9; the 1-gram (3) alone would match later, at 5 -> 4
    assert propose_ngram(tokens, 1) == [9]


def test_ngram_proposes_nothing_without_a_match():
    assert propose_ngram([1, 2, 3, 4], 5) == []
    assert propose_ngram([7], 5) == []


def test_expected_accepted_length_formula():
    assert expected_accepted_length(0.0, 5) == 1.0  # only the target's own token
    assert expected_accepted_length(1.0, 5) == 6.0  # every draft plus the bonus
    assert expected_accepted_length(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def _decoding_seq(seq_id: int, prompt: int, outputs: int, max_tokens: int) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), token_ids=[3] * (prompt + outputs), num_prompt_tokens=prompt,
                    params=SamplingParams(max_tokens=max_tokens))


def test_scheduler_counts_draft_slots_against_budget_and_caps_them_by_max_tokens():
    bm = BlockManager(num_blocks=100, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, token_budget=8, policy="fcfs", num_speculative_tokens=5)
    a, b = _decoding_seq(0, 6, 1, max_tokens=50), _decoding_seq(1, 6, 1, max_tokens=3)
    for s in (a, b):
        sched.add(s)
    sched.schedule()  # admit both (prefill of their 7 tokens), as the engine would then compute them
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens - 1
    plan = sched.schedule()
    slots = {s.seq.seq_id: s.num_spec_tokens for s in plan.scheduled}
    assert slots[0] == 5  # 1 + 5 tokens of the 8-token budget
    assert slots[1] == 1  # max_tokens=3 with one output: two more tokens at most, so one draft
    assert plan.num_batched_tokens == 6 + 2
    assert len(a.block_table) == bm.blocks_needed(a.num_tokens + 5)  # blocks reserved for the drafts
    # what held each below k, for the views (trial 14c #3): b's 1 slot is all the budget and max_tokens leave
    limits = {s.seq.seq_id: (s.max_drafts, s.draft_limits) for s in plan.scheduled}
    assert limits == {0: (5, ()), 1: (5, ("budget", "max_tokens"))}


def test_scheduler_trims_draft_slots_to_the_free_slots_rather_than_preempt():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, token_budget=64, policy="fcfs", num_speculative_tokens=5)
    a = _decoding_seq(0, 4, 1, max_tokens=50)  # 5 tokens: 2 blocks; 5 drafts would need a third
    sched.add(a)
    sched.schedule()
    a.num_computed_tokens = 4
    plan = sched.schedule()
    (s,) = plan.scheduled
    assert plan.preempted == [] and len(a.block_table) == 2
    assert (s.num_spec_tokens, s.num_new_tokens, s.draft_limits) == (3, 4, ("kv_blocks",))  # positions 5..7 fit
    assert plan.num_batched_tokens == 4


def _running(sched: Scheduler, seq: Sequence) -> Sequence:
    """Put ``seq`` in the running set with every token but its newest computed, as after a decode."""
    seq.num_computed_tokens = seq.num_tokens - 1
    assert sched.block_manager.allocate(seq, seq.num_computed_tokens)
    seq.status = SequenceStatus.RUNNING
    sched.running.append(seq)
    return seq


def test_draft_slots_are_sized_after_the_preemption_that_freed_blocks():
    """Trial 14c #3: sized before the preemption loop, request 0's drafts were dropped though the
    block freed for its newest token had room for them all."""
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, token_budget=64, policy="fcfs", num_speculative_tokens=3)
    a = _running(sched, _decoding_seq(0, 8, 1, max_tokens=50))  # 8 computed in 2 blocks; position 8 needs a third
    b = _running(sched, _decoding_seq(1, 8, 1, max_tokens=50))  # the other 2 blocks: none free
    plan = sched.schedule()
    assert plan.preempted == [b]
    (s,) = plan.scheduled
    assert (s.seq, s.num_spec_tokens) == (a, 3)  # positions 9..11 share position 8's block
    assert s.draft_limits == ()


def test_drafts_never_take_the_block_a_later_running_sequence_needs():
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, token_budget=64, policy="fcfs", num_speculative_tokens=3)
    a = _running(sched, _decoding_seq(0, 4, 2, max_tokens=50))  # position 5 fits its 2 blocks; drafts past 7 do not
    b = _running(sched, _decoding_seq(1, 8, 1, max_tokens=50))  # position 8 needs the one free block
    plan = sched.schedule()
    assert plan.preempted == [] and {s.seq for s in plan.scheduled} == {a, b}
    by = {s.seq.seq_id: s for s in plan.scheduled}
    assert (by[0].num_spec_tokens, by[0].draft_limits) == (2, ("kv_blocks",))  # positions 6, 7
    assert (by[1].num_spec_tokens, by[1].draft_limits) == (3, ())  # 9..11 in the block it took for 8
    bm.check_invariants([a, b])


@pytest.mark.parametrize("bad,message", [
    (dict(speculative_model="ngram", num_speculative_tokens=0), "num_speculative_tokens=0"),
    (dict(num_speculative_tokens=3), "speculative_model is None"),
    (dict(speculative_model="self:x"), "'self:N' needs a layer count"),
    (dict(speculative_model="self:0"), "'self:N' needs a layer count"),
    (dict(speculative_model="ngram", paged=False), "needs the paged engine"),
])
def test_bad_speculative_settings_raise_one_line(bad, message):
    with pytest.raises(ValueError, match=message) as info:
        EngineConfig(**bad)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------- real model

def generate(make_llm, prompts=PROMPTS, params=GREEDY, **engine):
    """Outputs in prompt order, the engine's stats and the LLM; the pool's invariants are checked after every step."""
    llm = make_llm(**engine)
    eng = llm.engine
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.block_manager.check_invariants(eng.scheduler.running + eng.scheduler.waiting)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0, "a block is still held after every request finished"
    return [done[i] for i in ids], stats, llm


@pytest.fixture(scope="module")
def reference(make_llm):
    outs, _, _ = generate(make_llm)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.real_model
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_output_is_identical_with_speculation(make_llm, reference, proposer, k):
    # a 48-token budget admits the prompts over several steps: the third finds the first's shared prefix cached
    outs, stats, _ = generate(make_llm, speculative_model=proposer, num_speculative_tokens=k,
                              max_num_batched_tokens=48)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert stats["prefix_cache_hits"] > 0
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0


@pytest.mark.real_model
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_output_is_identical_when_a_small_pool_forces_preemption(make_llm, reference, proposer):
    outs, stats, _ = generate(make_llm, speculative_model=proposer, num_speculative_tokens=3,
                              num_kv_blocks=8, block_size=8)
    assert stats["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.real_model
def test_draft_equal_to_target_accepts_every_draft_at_temperature_0(make_llm, reference):
    outs, stats, _ = generate(make_llm, prompts=PROMPTS[:1], speculative_model="target", num_speculative_tokens=4)
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0
    assert stats["spec_acceptance_rate"] == 1.0
    # 12 tokens: 1 from the prefill, twice 4 accepted drafts + 1 bonus, then 1 plain decode (no room for drafts)
    assert stats["spec_verifications"] == 2
    assert stats["spec_mean_accepted_length"] == 5.0
    assert stats["steps"] == 4
    assert outs[0].outputs[0].token_ids == reference[0]


@pytest.mark.real_model
@pytest.mark.parametrize("stop", [dict(max_tokens=7), dict(stop=[" apple, apple"]), dict(stop_token_ids=[28])])
def test_a_stop_inside_an_accepted_run_ends_the_sequence_there(make_llm, stop):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True).clone(**stop)
    prompt = [PROMPTS[1]]
    plain, _, _ = generate(make_llm, prompts=prompt, params=params)
    spec, stats, _ = generate(make_llm, prompts=prompt, params=params, speculative_model="target",
                              num_speculative_tokens=5)
    assert stats["spec_accepted_tokens"] > 1  # the stop fell inside an accepted run
    a, b = plain[0].outputs[0], spec[0].outputs[0]
    assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason, a.stop_reason)
    assert len(b.token_ids) < MAX_TOKENS


@pytest.mark.real_model
def test_spec_decode_events_describe_each_verification(make_llm):
    llm = make_llm(speculative_model="ngram", num_speculative_tokens=3)
    seen: list[ev.Event] = []
    llm.engine.subscribe(seen.append, topk=0, blocks=False)
    out = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0]
    steps = [e for e in seen if isinstance(e, ev.SpecDecodeStep)]
    stats = llm.stats()
    assert len(steps) == stats["spec_verifications"] > 0
    assert sum(sum(e.accepted) for e in steps) == stats["spec_accepted_tokens"]
    for e in steps:
        n_ok = sum(e.accepted)
        assert list(e.accepted) == [True] * n_ok + [False] * (len(e.accepted) - n_ok)  # a prefix is accepted
        assert e.proposer == "ngram" and all(q == 1.0 for q in e.q)  # prompt lookup is a point mass
        assert len(e.p) == len(e.draft_tokens) == len(e.draft_texts)
    # every kept token appears in the output, in order: the accepted drafts then the bonus token
    kept = [t for e in steps for t in (*e.draft_tokens[:sum(e.accepted)], e.bonus_token)]
    assert all(t in out.token_ids for t in kept)
    sampled = [e.token_id for e in seen if isinstance(e, ev.TokenSampled)]
    assert sampled == out.token_ids  # one TokenSampled per kept token, none for rejected drafts


@pytest.mark.real_model
def test_logprobs_are_reported_for_tokens_kept_by_verification(make_llm):
    params = GREEDY.clone(logprobs=2, max_tokens=6)
    plain, _, _ = generate(make_llm, prompts=[PROMPTS[1]], params=params)
    spec, _, _ = generate(make_llm, prompts=[PROMPTS[1]], params=params, speculative_model="target",
                          num_speculative_tokens=3)
    a, b = plain[0].outputs[0], spec[0].outputs[0]
    assert len(b.logprobs) == len(b.token_ids) == 6
    for token, la, lb in zip(b.token_ids, a.logprobs, b.logprobs):
        assert lb[token].rank == la[token].rank
        assert lb[token].logprob == pytest.approx(la[token].logprob, abs=1e-3)


@pytest.mark.real_model
def test_seeded_sampling_with_speculation_is_reproducible(make_llm):
    params = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=8, ignore_eos=True)
    runs = [generate(make_llm, prompts=PROMPTS[1:2], params=params, speculative_model="self:26",
                     num_speculative_tokens=3) for _ in range(2)]
    first, second = ([o.outputs[0].token_ids for o in outs] for outs, _, _ in runs)
    assert first == second and len(first[0]) == 8
    stats = runs[0][1]
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # both accept and reject happened


@pytest.mark.real_model
def test_self_speculation_needs_fewer_layers_than_the_target(make_llm):
    with pytest.raises(ValueError, match="N must be between 1 and 29"):
        make_llm(speculative_model="self:30")


@pytest.mark.real_model
def test_a_draft_model_with_another_vocabulary_is_refused(make_llm, tmp_path, default_model_dir):
    draft = save_tiny_llama(tmp_path / "small-vocab", default_model_dir, vocab_size=1000, max_position_embeddings=8192)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens but the target has 49152"):
        make_llm(speculative_model=str(draft))


@pytest.mark.real_model
def test_a_draft_model_with_a_shorter_context_is_refused(make_llm, tiny_llama_dir):
    with pytest.raises(ValueError, match="draft model .*: max_model_len=8192 is longer than the model's context"):
        make_llm(speculative_model=str(tiny_llama_dir))
    make_llm(speculative_model=str(tiny_llama_dir), max_model_len=256)  # fine within the draft's context


@pytest.mark.real_model
def test_a_failed_step_drops_the_drafts_and_the_output_is_unchanged(make_llm, reference):
    llm = make_llm(speculative_model="target", num_speculative_tokens=3)
    failed = []

    def fail_once(plan):
        if any(s.spec_tokens for s in plan.scheduled) and not failed:
            failed.append(plan.step)
            raise RuntimeError("injected fault")

    llm.engine.fault_injector = fail_once
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert failed, "the fault was never injected"
    assert [o.outputs[0].token_ids for o in outs] == reference[:2]  # the step was redone as plain decodes
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_loaded_draft_model_is_warmed_up_before_the_first_verification(tiny_model, tiny_llama_dir, monkeypatch):
    from nanovllm_core.model import loader
    from nanovllm_core.speculative import proposer

    warmed = []
    real = loader.warm_up
    monkeypatch.setattr(loader, "warm_up", lambda model, *a: warmed.append(model) or real(model, *a))
    target = tiny_model[0]
    draft = proposer.load_draft_model(str(tiny_llama_dir), target, torch.device("cpu"), torch.float32, 64)
    assert warmed == [draft] and draft is not target
    assert proposer.load_draft_model("target", target, torch.device("cpu"), torch.float32, 64) is target
    assert warmed == [draft]  # the target itself was warmed when its engine was built
