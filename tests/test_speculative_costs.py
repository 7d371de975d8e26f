"""Chapter 12's speed-up: Leviathan et al. 2023's formula, and the costs measured on this machine."""

from __future__ import annotations

import pytest

from nanovllm_core import SamplingParams
from nanovllm_core import events as ev
from nanovllm_core.educational import speculative_costs as sc


def _spec(accepted: tuple[bool, ...]) -> ev.SpecDecodeStep:
    k = len(accepted)
    return ev.SpecDecodeStep(step=1, request_id="r", seq_id=0, proposer="ngram", draft_tokens=(1,) * k,
                             draft_texts=("a",) * k, p=(0.5,) * k, q=(1.0,) * k, accepted=accepted, bonus_token=2)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("gamma", [1, 4])
def test_expected_tokens_per_step_is_the_mean_of_the_truncated_geometric_run(alpha, gamma):
    # n drafts kept (each with probability alpha, stopping at the first rejection), then one token of the target's
    mean = sum((n + 1) * alpha ** n * (1 - alpha) for n in range(gamma)) + (gamma + 1) * alpha ** gamma
    assert sc.expected_tokens(alpha, gamma) == pytest.approx(mean)


def test_the_speed_up_divides_by_the_drafters_cost_and_the_verifications_cost():
    # Theorem 3.8 at v = 1: alpha 0.8, gamma 4, c 0.05 -> 3.3616 / 1.2
    assert sc.speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.2)
    assert sc.speedup(0.8, 4, 0.05, v=1.5) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.7)
    assert sc.speedup(0.0, 4, 0.0, v=1.5) < 1  # nothing accepted and a dearer pass: slower than plain decoding


def test_the_acceptance_rate_counts_judged_drafts_not_the_ones_dropped_after_a_rejection():
    steps = [_spec((True, True, False, False)), _spec((True, True, True, True))]
    assert sc.acceptance_rate(steps) == 6 / 7  # the 4th draft of the first step was dropped, never judged
    assert sc.acceptance_rate([]) is None


@pytest.mark.real_model
def test_the_measured_costs_come_from_the_runs_own_steps(make_engine):
    from nanovllm_core.educational.tutorial import _SPECULATIVE_PROMPT

    seen: list[ev.Event] = []
    m = sc.measure(lambda **kw: make_engine(num_kv_blocks=32, **kw), _SPECULATIVE_PROMPT,
                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), gamma=4, on_event=seen.append)
    assert m is not None
    spec = [e for e in seen if isinstance(e, ev.SpecDecodeStep)]
    kept = sum(1 for e in seen if isinstance(e, ev.TokenSampled) and e.step in {s.step for s in spec})
    assert m.tokens_per_verify == pytest.approx(kept / len(spec))
    made = [next((i for i, ok in enumerate(s.accepted) if not ok), len(s.accepted)) + 1 for s in spec]
    assert m.tokens_per_verify == pytest.approx(sum(made) / len(made))
    assert m.decode_s > 0 and m.verify_s > m.draft_s > 0 and 0 <= m.alpha <= 1
    words = sc.cost_words(m)
    assert f"v = {m.v:.2f}" in words and f"alpha = {m.alpha:.2f}" in words
    if m.v >= 1:
        assert f"{sc.speedup(m.alpha, m.gamma, m.c, m.v):.2f}x" in words
    else:  # a busy host's two medians: told as noise (trial 16c), no speed-up claimed from it
        assert "is below 1" in words and f"{sc.speedup(m.alpha, m.gamma, m.c, m.v):.2f}x" not in words
