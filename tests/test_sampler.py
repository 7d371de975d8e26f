"""The sampler on hand-made logits: each knob changes the next-token distribution as vLLM's does."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm_core.engine.sequence import Sequence
from nanovllm_core.sampling.sampler import Sampler, apply_min_tokens, apply_penalties, filter_probs, row_tensors
from nanovllm_core.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 2
_ids = itertools.count()


def row(prompt=(7,), output=(), seed=None, **params) -> Sequence:
    """One sequence as the sampler sees it: its tokens, its SamplingParams, its generator."""
    seq = Sequence(seq_id=next(_ids), request_id="r", token_ids=list(prompt) + list(output),
                   num_prompt_tokens=len(prompt), params=SamplingParams(**params), eos_token_ids=(EOS,))
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(seed)
    return seq


def sampling_probs(probs: list[float], **params) -> torch.Tensor:
    """The distribution a row samples from, given its model probabilities and settings."""
    logits = torch.tensor([probs]).log()
    return filter_probs(logits, *row_tensors([row(**params)], CPU))[0]


# ---------------------------------------------------------------- top-p, top-k, min-p


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = sampling_probs([0.1, 0.2, 0.3, 0.4], top_p=0.6)
    assert torch.nonzero(probs).flatten().tolist() == [2, 3]  # 0.4 alone is < 0.6; 0.4 + 0.3 reaches it
    assert probs[2:].tolist() == pytest.approx([0.3 / 0.7, 0.4 / 0.7])


def test_top_p_never_removes_the_most_likely_token():
    probs = sampling_probs([0.1, 0.2, 0.3, 0.4], top_p=0.05)  # smaller than the top token's own mass
    assert probs.tolist() == pytest.approx([0, 0, 0, 1])


@settings(max_examples=60, deadline=None)
@given(logits=st.lists(st.floats(-8, 8), min_size=2, max_size=12), p=st.floats(0.01, 1.0))
def test_top_p_set_is_minimal_and_contains_the_argmax(logits, p):
    model = torch.tensor(logits).softmax(0)
    kept = sampling_probs(model.tolist(), top_p=p) > 0
    assert kept[model.argmax()]
    kept_mass = model[kept].sum()
    assert kept_mass >= p - 1e-5
    smallest_kept = model[kept].min()
    assert kept_mass - smallest_kept < p + 1e-5  # dropping any kept token would fall short of p


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_or_minus_one_is_off(top_k):
    assert sampling_probs([0.1, 0.2, 0.3, 0.4], top_k=top_k).tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_top_k_keeps_the_k_most_likely_renormalised():
    assert sampling_probs([0.1, 0.2, 0.3, 0.4], top_k=2).tolist() == pytest.approx([0, 0, 3 / 7, 4 / 7])


def test_min_p_drops_tokens_below_min_p_times_the_top_probability():
    probs = [0.5, 0.3, 0.15, 0.05]
    assert torch.nonzero(sampling_probs(probs, min_p=0.2)).flatten().tolist() == [0, 1, 2]  # threshold 0.1
    assert sampling_probs(probs, min_p=0.5).tolist() == pytest.approx([0.625, 0.375, 0, 0])  # threshold 0.25


def test_temperature_sharpens_or_flattens_the_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    for t in (0.5, 2.0):
        probs = filter_probs(logits, *row_tensors([row(temperature=t)], CPU))
        assert torch.allclose(probs, (logits / t).softmax(-1))


def test_top_k_one_and_a_tiny_top_p_both_equal_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0)) * 3
    greedy = logits.argmax(-1).tolist()
    sampler = Sampler()
    rows_k = [row(temperature=1.0, top_k=1, seed=i) for i in range(8)]
    rows_p = [row(temperature=1.0, top_p=1e-6, seed=i) for i in range(8)]
    rows_t0 = [row(temperature=0.0) for _ in range(8)]
    assert sampler(logits, rows_k).token_ids == greedy
    assert sampler(logits, rows_p).token_ids == greedy
    assert sampler(logits, rows_t0).token_ids == greedy


# ---------------------------------------------------------------- penalties and min_tokens


def test_repetition_penalty_divides_positive_logits_and_multiplies_negative_ones():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    seq = row(prompt=(0,), output=(1,), repetition_penalty=2.0)  # token 0 in the prompt, token 1 generated
    assert apply_penalties(logits, [seq]).tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_repetition_penalty_below_one_encourages_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seq = row(prompt=(0, 1), repetition_penalty=0.5)
    assert apply_penalties(logits, [seq]).tolist() == [[4.0, -1.0, 1.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros((2, 4))
    presence = row(prompt=(2,), output=(0, 0, 1), presence_penalty=0.5)
    frequency = row(prompt=(2,), output=(0, 0, 1), frequency_penalty=0.25)
    out = apply_penalties(logits, [presence, frequency])
    assert out[0].tolist() == [-0.5, -0.5, 0.0, 0.0]  # once per distinct generated token; prompt token 2 untouched
    assert out[1].tolist() == [-0.5, -0.25, 0.0, 0.0]  # per occurrence: token 0 twice, token 1 once


def test_no_penalty_leaves_the_logits_untouched():
    logits = torch.randn(1, 5)
    assert apply_penalties(logits, [row(output=(1, 1))]) is logits


def test_min_tokens_forbids_eos_and_stop_tokens_until_reached():
    logits = torch.zeros((2, 6))
    early = row(output=(4,), min_tokens=2, stop_token_ids=[5])  # 1 of 2 tokens so far
    done = row(output=(4, 4), min_tokens=2, stop_token_ids=[5])
    out = apply_min_tokens(logits, [early, done])
    assert out[0].tolist() == [0, 0, -math.inf, 0, 0, -math.inf]
    assert out[1].tolist() == [0] * 6


def test_min_tokens_keeps_a_greedy_row_from_choosing_eos():
    logits = torch.tensor([[0.0, 0.0, 5.0, 1.0]])  # EOS (2) is the argmax
    assert Sampler()(logits, [row(temperature=0, min_tokens=1)]).token_ids == [3]
    assert Sampler()(logits, [row(temperature=0)]).token_ids == [2]


# ---------------------------------------------------------------- drawing a token

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.5])
N_SAMPLES = 20_000
# chi2.ppf(0.999, df): the test fails by chance once in a thousand seeds; the seed is fixed.
CHI2_CRITICAL_0999 = {2: 13.82, 5: 20.52}


def sample_counts(n: int, seed: int, **params) -> torch.Tensor:
    """Token counts from ``n`` rows of the same logits, all drawing from one seeded generator."""
    rows = [row(**params) for _ in range(n)]
    generator = torch.Generator().manual_seed(seed)
    for r in rows:
        r.generator = generator
    tokens = Sampler()(LOGITS.expand(n, -1).contiguous(), rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=LOGITS.numel()).double()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the categories the distribution allows, and its degrees of freedom."""
    allowed = probs > 0
    expected = probs[allowed].double() * counts.sum()
    return float(((counts[allowed] - expected) ** 2 / expected).sum()), int(allowed.sum()) - 1


def test_seeded_temperature_one_samples_follow_the_softmax():
    counts = sample_counts(N_SAMPLES, seed=0, temperature=1.0)
    stat, df = chi_square(counts, LOGITS.softmax(0))
    assert stat < CHI2_CRITICAL_0999[df], (stat, counts.tolist())


def test_the_chi_square_check_rejects_a_wrong_distribution():
    counts = sample_counts(N_SAMPLES, seed=0, temperature=1.0)
    wrong = (LOGITS / 1.2).softmax(0)  # what temperature 1.2 would give
    stat, df = chi_square(counts, wrong)
    assert stat > CHI2_CRITICAL_0999[df], stat


def test_temperature_and_top_k_samples_follow_the_renormalised_softmax():
    counts = sample_counts(N_SAMPLES, seed=1, temperature=0.7, top_k=3)
    expected = (LOGITS / 0.7).softmax(0)
    expected[3:] = 0
    expected /= expected.sum()
    assert counts[3:].sum() == 0
    stat, df = chi_square(counts, expected)
    assert stat < CHI2_CRITICAL_0999[df], (stat, counts.tolist())


def test_a_seeded_row_draws_the_same_tokens_alone_and_in_any_batch():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    alone = row(temperature=1.0, seed=123)
    in_batch = row(temperature=1.0, seed=123)
    others = [row(temperature=1.0), row(temperature=0.0), row(temperature=0.8, top_k=5, seed=9)]
    sampler = Sampler()
    tokens_alone, tokens_in_batch = [], []
    for _ in range(20):
        tokens_alone += sampler(logits, [alone]).token_ids
        batch = [others[0], in_batch, *others[1:]]
        tokens_in_batch.append(sampler(logits.expand(len(batch), -1).contiguous(), batch).token_ids[1])
    assert tokens_alone == tokens_in_batch
    assert len(set(tokens_alone)) > 1  # the row really samples


# ---------------------------------------------------------------- log-probabilities


def test_logprobs_are_those_of_the_raw_distribution_with_ranks():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    seq = row(prompt=(0,), temperature=0, repetition_penalty=4.0, logprobs=2)  # penalty makes token 1 win
    out = Sampler()(logits, [seq])
    raw = logits.log_softmax(-1)[0]
    assert out.token_ids == [1]
    assert out.chosen_logprobs == pytest.approx([raw[1].item()])
    assert out.chosen_ranks == [2]
    assert [t for t, _ in out.top[0]] == [0, 1]


def test_the_rank_of_a_chosen_token_counts_the_whole_vocabulary():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    seq = row(prompt=(0, 1, 2, 3), temperature=0, repetition_penalty=100.0, logprobs=1)
    out = Sampler()(logits, [seq])
    assert out.token_ids == [4] and out.chosen_ranks == [5]
    assert len(out.top[0]) == 1


def test_nothing_is_computed_when_no_logprobs_are_asked_for():
    out = Sampler()(torch.randn(2, 10), [row(temperature=0), row(temperature=0)])
    assert out.chosen_logprobs is None and out.top is None and out.chosen_ranks is None


def test_argmax_rows_gives_torch_argmax_indices_first_maximum_and_first_nan():
    """The greedy pick through NumPy on the CPU: the first of tied maxima, the first NaN of a row
    holding one, an all -inf row's first index; the same list as torch.argmax, in any dtype."""
    from nanovllm_core.sampling.sampler import argmax_rows

    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 9.0], [1.0, nan, 5.0, nan],
                         [-inf, -inf, -inf, -inf], [inf, 1.0, inf, 0.0]])
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(3, 49152, generator=g)
    wide[1, 17] = wide[1, 40000] = wide[1].max() + 1  # a tie far apart
    for t in (rows, wide, wide[:, ::2], rows.double(), rows.bfloat16()):
        assert argmax_rows(t) == t.argmax(dim=-1).tolist()


def test_min_tokens_ban_writes_the_same_logits_on_the_numpy_path():
    """The ban on EOS and stop tokens, written through NumPy on the CPU: -inf exactly where the
    index-tensor write puts it, the input left as it was."""
    seqs = [row(min_tokens=3, stop_token_ids=[5, 7]), row(min_tokens=0), row(min_tokens=1, stop_token_ids=[9])]
    logits = torch.randn(3, 10)
    before = logits.clone()
    out = apply_min_tokens(logits, seqs)
    expected = before.clone()
    expected[0, [EOS, 5, 7]] = float("-inf")
    expected[2, [EOS, 9]] = float("-inf")
    assert torch.equal(out, expected) and torch.equal(logits, before)


@pytest.mark.parametrize("value", [1e-300, 1e-31, 1e31, 1e300])
def test_a_repetition_penalty_that_float32_logits_cannot_take_is_refused(value):
    """Trial 31b: repetition_penalty 1e-300 passed "> 0" but is 0 in float32: the seen tokens' logits
    became inf/NaN and every sampled token read as id 0. The range keeps any logit up to 1e8 finite."""
    with pytest.raises(ValueError, match=r"repetition_penalty=.* must be from 1e-30 to 1e\+30, so the float32 logits"):
        SamplingParams(repetition_penalty=value)
    for ok in (1e-30, 1e30):
        seq = row(prompt=(0, 1), repetition_penalty=ok)
        out = apply_penalties(torch.tensor([[2.0, -2.0, 1.0]]), [seq])
        assert torch.isfinite(out).all(), (ok, out)


def test_a_temperature_past_float32s_range_is_refused():
    with pytest.raises(ValueError, match="temperature=.* must be at most 3.4e"):
        SamplingParams(temperature=1e308)
    assert SamplingParams(temperature=1e30).temperature == 1e30
