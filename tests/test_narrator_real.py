"""The narrator on the real default model, in the cases where textbook sentences used to be wrong.

Each test runs the engine in one unusual case (a penalty under greedy decoding, an n-gram
speculative step, a priority-ordered chunked prefill with a 32-token budget, a preemption
readmitted from the prefix cache) and checks the narration against the step's own events.
"""

from __future__ import annotations

import io

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
        assert f"{s.num_cached_tokens} of its {s.total_len} tokens" in hit.text
        assert f"{recomputed} recomputed, their keys and values lost with its blocks" in hit.text
    (pre,) = readmitted.entries("preemption")
    assert "the blocks still in the prefix cache are reused and only the rest is recomputed" in pre.text
