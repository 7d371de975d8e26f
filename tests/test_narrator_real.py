"""The narrator on the real default model, in the cases where textbook sentences used to be wrong.

Each test runs the engine in one unusual case (a penalty under greedy decoding, an n-gram
speculative step, a priority-ordered chunked prefill with a 32-token budget, a preemption
readmitted from the prefix cache) and checks the narration against the step's own events.
"""

from __future__ import annotations

import io
import math

import pytest
from rich.console import Console

from nanovllm_core import SamplingParams
from nanovllm_core import events as ev
from nanovllm_core.educational.narrate_view import NarrateView
from nanovllm_core.educational.tutorial import _LONG_PROMPT

pytestmark = pytest.mark.real_model
GREEDY = dict(temperature=0.0, ignore_eos=True)


class Run:
    """A narrator and a log of every event, both subscribed to one engine."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.view = NarrateView(Console(file=io.StringIO(), width=120), engine.model_info(), max_decode_steps=None)
        self.view.subscribe(engine)
        self.events: list[ev.Event] = []
        engine.subscribe(self.events.append, topk=5, blocks=False)

    def finish(self) -> "Run":
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.view.close()
        return self

    def entries(self, kind: str, step: int | None = None):
        return [c for c in self.view.entries if c.kind == kind and (step is None or c.step == step)]

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture(scope="module")
def penalised(make_engine):
    run = Run(make_engine(num_kv_blocks=16))
    run.engine.add_request("The cat sat on the mat. The cat sat on the",
                           SamplingParams(max_tokens=2, repetition_penalty=1.8, **GREEDY))
    return run.finish()


def test_greedy_with_a_repetition_penalty_never_takes_a_token_below_the_top_of_the_shown_table(penalised):
    decodes = penalised.entries("decode")
    tokens = penalised.of(ev.TokenSampled)
    assert len(decodes) == len(tokens) == 2
    for c, t in zip(decodes, tokens):
        assert "repetition penalty 1.8" in c.table_title + c.text
        chosen = c.table_notes.index("chosen") if "chosen" in c.table_notes else None
        if "takes it" in c.text:
            assert chosen == 0 and c.table[0][1] == pytest.approx(t.top[0].prob)
        else:  # the table is the model's own and the penalty moved the choice: said so, with the ranks
            assert c.table_title.startswith("the model's own probabilities, before repetition penalty 1.8")
            assert "but greedy decoding took" in c.text and "changed the scores" in c.text


def test_greedy_with_a_repetition_penalty_names_the_taken_token_as_argmax_of_the_shown_distribution(penalised):
    first = penalised.entries("decode")[0]
    token = penalised.of(ev.TokenSampled)[0]
    assert token.model_top and token.top[0].token_id == token.token_id
    assert first.table_notes[0] == "chosen" and first.table_title == "probabilities after repetition penalty 1.8"
    assert "Greedy decoding takes it" in first.text and "the model's own favourite was" in first.text


@pytest.fixture(scope="module")
def speculated(make_engine):
    run = Run(make_engine(num_kv_blocks=16, speculative_model="ngram", num_speculative_tokens=3))
    run.engine.add_request("one two three one two three one two three one two", SamplingParams(max_tokens=5, **GREEDY))
    return run.finish()


def test_ngram_verification_tells_the_1_plus_k_tokens_it_ran_and_the_greedy_rule(speculated):
    steps = speculated.of(ev.SpecDecodeStep)
    told = speculated.entries("speculative")
    assert steps and len(told) == len(steps)
    for e, c in zip(steps, told):
        k = len(e.draft_tokens)
        assert f"ran {1 + k} tokens of this sequence through all its layers in one forward pass" in c.text
        assert "Greedy verification" in c.text and "min(1" not in c.text
        kept = [d for d in speculated.entries("decode", e.step)]
        assert kept and f"{1 + k} tokens of this sequence went through the layers" in kept[0].text
        assert not any("one new token" in d.text for d in kept)


@pytest.fixture(scope="module")
def prioritised(make_engine):
    run = Run(make_engine(num_kv_blocks=32, block_size=8, max_num_batched_tokens=32, scheduling_policy="priority"))
    run.engine.add_request("Python is a", SamplingParams(max_tokens=4, **GREEDY), priority=0, request_id="low")
    run.engine.step()
    run.engine.step()  # "low" is decoding now
    run.engine.add_request(_LONG_PROMPT, SamplingParams(max_tokens=1, **GREEDY), priority=10, request_id="high")
    return run.finish()


def test_priority_chunked_prefill_claims_others_decoded_only_when_the_plan_shows_it(prioritised):
    starved = 0
    for plan in prioritised.of(ev.StepPlanned):
        chunk = next((s for s in plan.scheduled if s.request_id == "high" and s.kind == "prefill"), None)
        if chunk is None:
            continue
        (told,) = prioritised.entries("chunked_prefill", plan.step)
        low_decoded = any(s.request_id == "low" for s in plan.scheduled)
        assert ("request low decoded" in told.text) == low_decoded
        if not low_decoded:
            starved += 1
            assert "decoded" not in told.text and "Request low is running but got no token in this step" in told.text
            assert "served in priority order, the highest priority value first" in told.text
    assert starved >= 1  # the 32-token budget went to the high-priority chunk while "low" waited


@pytest.fixture(scope="module")
def readmitted(make_engine):
    run = Run(make_engine(num_kv_blocks=6, block_size=4))
    run.engine.add_request("The capital of France is a city where many", SamplingParams(max_tokens=6, **GREEDY))
    run.engine.add_request("Python is a programming language that is", SamplingParams(max_tokens=6, **GREEDY))
    return run.finish()


def test_a_preemption_readmitted_from_the_prefix_cache_is_told_with_reused_and_recomputed_counts(readmitted):
    back = [(plan, s) for plan in readmitted.of(ev.StepPlanned) for s in plan.scheduled
            if s.request_id in plan.admitted and any(q.seq_id == s.seq_id and q.num_preemptions for q in plan.running)]
    assert back, "the pool of 6 blocks must preempt one request and readmit it"
    plans = readmitted.of(ev.StepPlanned)
    for plan, s in back:
        assert s.num_cached_tokens > 0  # its full blocks were still in the prefix cache
        # What it had computed when it was preempted: its last step's start plus what that step ran.
        last = [x for p in plans if p.step < plan.step and not any(q.seq_id == s.seq_id for q in p.preempted)
                for x in p.scheduled if x.seq_id == s.seq_id][-1]
        lost = last.start + (last.num_tokens if last.kind == "prefill" else 1)
        recomputed = max(0, min(lost, s.total_len) - s.num_cached_tokens)
        (hit,) = readmitted.entries("prefix_cache", plan.step)
        assert recomputed > 0 and hit.title.endswith(
            f"readmitted, {s.num_cached_tokens} tokens reused, {recomputed} recomputed")
        assert f"of its {s.total_len} tokens" in hit.text and f"), {s.num_cached_tokens} (" in hit.text
        assert f"{recomputed} recomputed, their keys and values lost with its blocks" in hit.text
    (pre,) = readmitted.entries("preemption")
    assert "the blocks still in the prefix cache are reused and only the rest is computed: recomputed where" in pre.text


def test_a_readmitted_requests_finish_tells_both_hits_and_the_dashboard_shows_vllms(readmitted):
    """Trial 14c #2: the finish told only the first admission's hits (none here) while the Dashboard's
    cached column and the readmission entry told the readmission's. Trial 24d #3: the column showed
    the readmission's figure (40 beside a 38-token prompt); it shows vLLM's num_cached_tokens, the
    first admission's prompt tokens, at every step, and the finish entry tells the readmission's apart."""
    from nanovllm_tui.state import EngineState

    state = EngineState()
    firsts = {s.request_id: s.num_cached_tokens for plan in readmitted.of(ev.StepPlanned) for s in plan.scheduled
              if s.request_id in plan.admitted and s.num_cached_blocks_own is None}
    for e in readmitted.events:
        state.apply(e)
        for rid, req in state.requests.items():
            assert req.num_cached == (firsts[rid] if rid in firsts and req.first_step is not None else 0)
    back = [s for plan in readmitted.of(ev.StepPlanned) for s in plan.scheduled
            if s.request_id in plan.admitted and any(q.seq_id == s.seq_id and q.num_preemptions for q in plan.running)]
    (rid,) = {s.request_id for s in back}
    again = max(s.num_cached_tokens for s in back)
    (done,) = [e for e in readmitted.of(ev.RequestFinished) if e.request_id == rid]
    assert done.num_preemptions >= 1 and done.num_cached_tokens_readmitted == again > 0
    assert state.requests[rid].num_cached == done.num_cached_prompt_tokens == firsts[rid] < again
    (told,) = [c for c in readmitted.entries("finished") if c.request_id == rid]
    made = again - min(again, done.num_prompt_tokens)  # a hit is a prefix: the prompt's tokens first (trial 17b #2)
    what = f"{again - made} prompt + {made} generated" if made else "all of them prompt tokens"
    assert f"found {again} tokens there ({what})" in told.text and "alike" not in told.text


# ---------------------------------------------------------------------- teaching truth, by kind (issue 28)

FILTERED = dict(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, seed=7, logprobs=20, ignore_eos=True)


@pytest.fixture(scope="module")
def filtered(make_engine):
    run = Run(make_engine(num_kv_blocks=16))
    run.engine.add_request("The capital of France is", SamplingParams(max_tokens=3, **FILTERED), request_id="f")
    outputs = []
    while run.engine.has_unfinished_requests():
        outputs += [o for o in run.engine.step() if o.finished]
    run.view.close()
    return run, outputs[0]


def _after_filters(raw: dict[int, float], t: float, top_k: int, top_p: float, min_p: float) -> dict[int, float]:
    """Recompute the sampler's distribution from the model's raw top-20 log-probabilities (enough for top-k 20)."""
    best = max(raw.values())
    w = {i: math.exp((lp - best) / t) for i, lp in raw.items()}  # relative to the favourite, after temperature
    w = {i: x for i, x in w.items() if x >= min_p}  # min-p: at least min_p x the favourite
    kept = sorted(w, key=w.get, reverse=True)[:top_k]
    total = sum(w[i] for i in kept)
    out, mass = {}, 0.0
    for i in kept:  # top-p: keep while the mass strictly better is below top_p
        if mass < top_p or not out:
            out[i] = w[i] / total
        mass += w[i] / total
    total = sum(out.values())
    return {i: x / total for i, x in out.items()}


def test_a_sampled_tables_caption_names_temperature_min_p_top_k_and_top_p_and_its_numbers_are_after_all_of_them(filtered):
    run, output = filtered
    decodes = run.entries("decode")
    assert len(decodes) == 3
    for c, lp in zip(decodes, output.outputs[0].logprobs):
        assert c.table_title == "probabilities after temperature 0.9, min-p 0.02, top-k 20 and top-p 0.95, renormalised"
        want = _after_filters({i: x.logprob for i, x in lp.items()}, 0.9, 20, 0.95, 0.02)
        fav = max(want, key=want.get)
        assert c.table[0][1] == pytest.approx(want[fav], rel=1e-3)
        # the same favourite after temperature alone is smaller: the caption must not stop at temperature
        alone = math.exp(lp[fav].logprob / 0.9) / sum(math.exp(x.logprob / 0.9) for x in lp.values())
        assert alone < want[fav]


@pytest.fixture(scope="module")
def chatted(make_engine):
    run = Run(make_engine(num_kv_blocks=32))
    tok = run.engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer with one number."}],
                                     tokenize=False, add_generation_prompt=True)
    run.engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0))
    return run.finish()


def test_the_end_of_turn_token_of_a_chat_reply_is_named_as_a_special_token_not_part_of_a_character(chatted):
    last = chatted.of(ev.TokenSampled)[-1]
    (finished,) = chatted.of(ev.RequestFinished)
    assert finished.finish_reason == "stop" and last.token_id in chatted.engine.eos_token_ids
    assert last.special == chatted.engine.tokenizer.convert_ids_to_tokens(last.token_id) and not last.token_text
    told = chatted.entries("decode")[-1]
    assert told.title.endswith(f": {last.special}")
    assert f"the special token {last.special} (id {last.token_id})" in told.text
    assert "part of a character" not in told.title + told.text and "leaves it out" in told.text


@pytest.fixture(scope="module")
def speculated_sampling(make_engine):
    run = Run(make_engine(num_kv_blocks=16, speculative_model="ngram", num_speculative_tokens=3))
    run.engine.add_request("one two three one two three one two three one two",
                           SamplingParams(max_tokens=12, temperature=0.3, seed=3, ignore_eos=True))
    return run.finish()


def test_a_verified_token_is_told_by_the_mechanism_that_produced_it_not_as_a_draw(speculated_sampling):
    run = speculated_sampling
    steps = {e.step: e for e in run.of(ev.SpecDecodeStep)}
    assert steps
    seen = {"accepted": 0, "after": 0}
    for step, v in steps.items():
        n_ok = next((i for i, ok in enumerate(v.accepted) if not ok), len(v.accepted))
        told = run.entries("decode", step)
        assert told
        for i, c in enumerate(told):
            assert "Sampling drew" not in c.text
            if i < n_ok:
                seen["accepted"] += 1
                chance = min(1.0, v.p[i] / v.q[i])
                assert "drafted" in c.text and "accepted it, with probability min(1, p/q) = " in c.text
                assert f"= {chance:.3f}." in c.text
            elif n_ok < len(v.draft_tokens):
                seen["after"] += 1
                assert "was rejected, and" in c.text and "drawn in its place" in c.text
            else:
                seen["after"] += 1
                k = len(v.draft_tokens)  # (one draft: "The 1 draft was kept", not "All 1 drafts were kept")
                assert (f"All {k} drafts were kept" if k > 1 else "The 1 draft was kept") in c.text
    assert seen["accepted"] and seen["after"]


# ---------------------------------------------------------------------- trial 14c #3: drafts under KV pressure

_P16 = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
_CONTENDED = (f"{_P16} {_P16}", "one two three four five six seven eight nine ten", "a b c d e f g h i j k")


def _contended(make_engine, **spec) -> Run:
    run = Run(make_engine(num_kv_blocks=8, block_size=8, **spec))
    for prompt in _CONTENDED:
        run.engine.add_request(prompt, SamplingParams(max_tokens=12, **GREEDY))
    return run.finish()


@pytest.fixture(scope="module")
def contended(make_engine):
    return _contended(make_engine, speculative_model="ngram", num_speculative_tokens=4)


def test_drafts_are_sized_after_a_preemption_and_every_step_short_of_drafts_says_why(make_engine, contended):
    plain = _contended(make_engine)
    texts = lambda run: {e.request_id: e.output_token_ids for e in run.of(ev.RequestFinished)}  # noqa: E731
    assert texts(contended) == texts(plain)  # greedy output never depends on the drafts
    plans = contended.of(ev.StepPlanned)
    (first,) = [p for p in plans if p.preempted and p.step == 1]
    # the report's step: request 2's blocks freed for request 0's newest token hold its 4 drafts too
    assert next(s for s in first.scheduled if s.request_id == "0").num_drafts == 4
    short = [(p, s) for p in plans for s in p.scheduled if s.max_drafts and s.num_drafts < s.max_drafts]
    assert short and all(s.draft_limits for _, s in short)
    assert {"proposer", "max_tokens"} <= {why for _, s in short for why in s.draft_limits}
    for plan, s in short:
        token = next(e for e in contended.of(ev.TokenSampled) if e.step == plan.step and e.seq_id == s.seq_id)
        if s.num_drafts:  # a verification: its entry tells why it had fewer
            (told,) = [c for c in contended.entries("speculative", plan.step) if c.request_id == s.request_id]
        else:  # no verification: the decode entry of its token tells it
            (told,) = [c for c in contended.entries("decode", plan.step) if c.request_id == s.request_id
                       and f"token #{token.num_output_tokens}" in c.title]
            assert "It ran without drafts." in told.text
        assert "Speculative decoding verifies up to 4 drafts a step; " in told.text
        if "max_tokens" in s.draft_limits:
            assert "held down by its max_tokens" in told.text
        if "proposer" in s.draft_limits:
            assert "the n-gram proposer" in told.text


def test_a_readmission_names_whose_cached_free_block_it_hit(make_tiny_engine):
    """Trial 17b #2: three requests share a 16-token prefix in a 6-block pool. Request 2 is preempted; its own
    copy of the prefix block duplicated request 0's, so it was simply freed; at its readmission the hit is request
    0's block, left cached-free when request 0 finished. The narrator said the tokens "come back" (its own blocks
    surviving) and the finish said "prompt and generated tokens alike" of 16 prompt tokens. Now the readmission
    names each cached-free hit block's owner from the engine's count, and the finish splits the hit by the prompt."""
    p = "Once upon a time in a small village near the mountains there lived an old man who"
    run = Run(make_tiny_engine(num_kv_blocks=6, block_size=16))
    for i, end in enumerate((" loved", " hated", " sang")):
        run.engine.add_request(p + end, SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0),
                               request_id=str(i))
    run.finish()
    back = [(plan, s) for plan in run.of(ev.StepPlanned) for s in plan.scheduled
            if s.request_id in plan.admitted and s.num_cached_blocks_own is not None]
    assert back, "the pool of 6 blocks must preempt a request and readmit it"
    for plan, s in back:
        hit = s.num_cached_tokens // 16
        own, shared = s.num_cached_blocks_own, s.num_cached_blocks_in_use
        assert 0 <= own <= hit - shared
        (told,) = [c for c in run.entries("prefix_cache", plan.step) if c.request_id == s.request_id]
        assert "come back" not in told.text and "are found in the prefix cache" in told.text
        if hit - shared - own:
            assert "that another request left cached-free with the same tokens" in told.text
        if own:
            assert "from before the preemption, kept cached-free" in told.text
    # the report's case: a hit that was another request's block, not its own
    assert any(s.num_cached_blocks_own == 0 and s.num_cached_tokens for _, s in back), [s for _, s in back]
    for done in run.of(ev.RequestFinished):
        again = done.num_cached_tokens_readmitted
        if again:
            (told,) = [c for c in run.entries("finished") if c.request_id == done.request_id]
            assert "alike" not in told.text
            if again <= done.num_prompt_tokens:
                assert f"found {again} tokens there (all of them prompt tokens)" in told.text


def test_a_budget_limit_names_the_draft_slots_reserved_before_the_proposer_ran(make_engine):
    """Trial 24d #1: k draft slots are taken from the budget before the proposer runs; a chunk cut short, a
    decode with no draft slot and the step's spend must name the unfilled reservation, or their own numbers
    (budget 6, 2 taken by others) leave room they say was not there."""
    run = Run(make_engine(num_kv_blocks=40, block_size=4, max_num_batched_tokens=6, speculative_model="ngram",
                          num_speculative_tokens=4))
    params = dict(max_tokens=20, temperature=0.8, ignore_eos=True)
    run.engine.add_request("a b c a b c a b c a b", SamplingParams(seed=1, **params))
    run.engine.add_request("The capital of France is", SamplingParams(seed=2, **params))
    run.finish()
    named = 0
    for plan in run.of(ev.StepPlanned):
        by_id = {s.request_id: s for s in plan.scheduled}
        empty = sum(s.num_spec_tokens - s.num_drafts for s in plan.scheduled if s.num_spec_tokens)
        for c in run.entries("chunked_prefill", plan.step):
            if "more than this step could give it" not in c.text:
                continue
            s = by_id[c.request_id]
            others = plan.num_batched_tokens - s.num_tokens
            if plan.token_budget - others > s.num_own_tokens:  # its own figures leave room: the text must say why
                assert f"only {s.num_own_tokens} of them" in c.text and "reserved before the proposer ran" in c.text
                reserved = plan.token_budget - s.budget_left
                assert f"had {reserved}, its newest token and {reserved - 1} draft slots" in c.text, c.text
                named += 1
        (line,) = run.entries("scheduler", plan.step) or [None]
        if line is not None and empty:
            assert (f"spends {plan.num_batched_tokens} of its {plan.token_budget}-token budget (it had planned "
                    f"{plan.num_batched_tokens + empty}: {empty} draft slot") in line.text, line.text
        for c in run.entries("decode", plan.step):
            if "held down by the step's token budget" in c.text and empty:
                assert "reserved before the proposer ran" in c.text, c.text
    assert named, "the configuration no longer cuts a chunk short behind an unfilled reservation"


def test_llm_chat_tells_the_conversation_not_token_ids(make_engine):
    """Trial 24d #2's kind: LLM.chat renders the template before the engine; the narrator must still say so."""
    from nanovllm_core.llm import LLM

    engine = make_engine(num_kv_blocks=64)
    run = Run(engine)
    LLM.from_engine(engine).chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), use_tqdm=False)
    run.view.close()
    (told,) = run.entries("tokenization")
    assert told.text.startswith("The user's message 'Hi', put through the model's chat template, becomes"), told.text
    (added,) = run.of(ev.RequestAdded)
    assert added.chat == (("user", "Hi"),)
