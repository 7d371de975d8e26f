"""What ``TokenSampled`` and ``SpecDecodeStep`` say is what the sampler did (issues 13 and 14).

``TokenSampled.top`` lists the distribution the token was chosen from (after penalties and
the ``min_tokens`` ban; after temperature when sampling), so a greedy token is always its
first entry; ``model_top`` holds the model's own candidates only when a processor changed
them. ``SpecDecodeStep`` names the rule that decided and how many tokens the target ran.
"""

from __future__ import annotations

import pytest

from nanovllm_core import events as ev
from nanovllm_core.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

COUNTING = "one two three four five six seven eight nine ten one two three"


def record(llm, prompts, params) -> list[ev.Event]:
    seen: list[ev.Event] = []
    llm.engine.subscribe(seen.append, topk=5, blocks=False)
    llm.generate(prompts, params, use_tqdm=False)
    return seen


def tokens_of(events: list[ev.Event], request_id: str) -> list[ev.TokenSampled]:
    return [e for e in events if isinstance(e, ev.TokenSampled) and e.request_id == request_id]


@pytest.fixture(scope="module")
def plain_events(make_llm):
    """One batch: greedy with a repetition penalty, plain greedy, sampling at temperature 0.5."""
    llm = make_llm(num_kv_blocks=64)
    params = [SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.5),
              SamplingParams(temperature=0, max_tokens=4),
              SamplingParams(temperature=0.5, seed=0, max_tokens=4)]
    seen = record(llm, [COUNTING] * 3, params)
    ids = [e.request_id for e in seen if isinstance(e, ev.RequestAdded)]
    return {name: tokens_of(seen, rid) for name, rid in zip(("penalty", "greedy", "sampled"), ids)}


def test_a_greedy_token_is_the_first_of_the_distribution_it_was_chosen_from(plain_events):
    penalised = plain_events["penalty"]
    for e in penalised:
        assert e.token_id == e.top[0].token_id
        assert e.model_top and e.model_top != e.top  # the penalty changed the row: both are shown
    # the penalty made greedy take a token that was not the model's own favourite
    assert any(e.model_top[0].token_id != e.token_id for e in penalised)


def test_model_top_is_empty_when_no_processor_changed_the_row(plain_events):
    for e in plain_events["greedy"]:
        assert e.token_id == e.top[0].token_id and e.model_top == ()


def test_sampled_top_is_after_temperature(plain_events):
    for e in plain_events["sampled"]:
        assert not e.greedy and e.model_top
        assert e.top[0].prob > e.model_top[0].prob  # temperature 0.5 sharpens the distribution


def test_an_ngram_verification_says_it_used_the_greedy_rule_on_1_plus_k_tokens(make_llm):
    llm = make_llm(speculative_model="ngram", num_speculative_tokens=3, num_kv_blocks=64)
    params = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0.7, seed=1, max_tokens=8)]
    seen = record(llm, [COUNTING] * 2, params)
    greedy_id, sampled_id = [e.request_id for e in seen if isinstance(e, ev.RequestAdded)]
    steps = [e for e in seen if isinstance(e, ev.SpecDecodeStep)]
    assert {e.request_id for e in steps} == {greedy_id, sampled_id}
    for e in steps:
        assert e.greedy == (e.request_id == greedy_id)  # argmax equality for greedy, min(1, p/q) for sampling
        assert e.num_query_tokens == 1 + len(e.draft_tokens)
    for rid in (greedy_id, sampled_id):
        verified_steps = {e.step for e in steps if e.request_id == rid}
        for t in tokens_of(seen, rid):
            assert t.speculative == (t.step in verified_steps)
            if t.greedy:
                assert t.token_id == t.top[0].token_id
    assert any(t.speculative for t in tokens_of(seen, greedy_id))
