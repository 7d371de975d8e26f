"""Refusals that advise raising ``max_model_len`` do so only where it can be raised: once it is the
model's whole context (``max_position_embeddings``), loading refuses a larger one, so the advice is
to shorten or lower instead (trial 20e: ``nanovllm --prompt hi --max-tokens 9000`` said "or raise
--max-model-len" at 8192, the model's context, and ``--max-model-len 10000`` is refused).
"""

from __future__ import annotations

from nanovllm_core.sampling_params import (OVERFLOW_FIX, OVERFLOW_FIX_FULL, SamplingParams, max_tokens_overflow,
                                           overflow_with_options)

TINY_CONTEXT = 512  # the tiny LLaMA's max_position_embeddings (tests/conftest.py)


def test_the_overflow_advice_depends_on_whether_the_context_can_grow():
    below = max_tokens_overflow(5, 600, 256, model_context=512)
    full = max_tokens_overflow(5, 600, 512, model_context=512)
    unknown = max_tokens_overflow(5, 600, 512)
    assert below.endswith("; " + OVERFLOW_FIX) and unknown.endswith("; " + OVERFLOW_FIX)
    assert full.endswith("; " + OVERFLOW_FIX_FULL) and "raise" not in full
    # the command line's wording of each keeps which advice it was
    assert overflow_with_options(below).endswith("; lower --max-tokens or raise --max-model-len")
    assert overflow_with_options(full) == ("--max-tokens 600 does not fit: the prompt has 5 tokens and the context "
                                           "(max_model_len) is 512, so at most 507 can follow; lower --max-tokens "
                                           "(--max-model-len is already the model's whole context)")


def test_the_engine_advises_raising_max_model_len_only_below_the_models_context(make_tiny_engine):
    params = SamplingParams(max_tokens=600)
    ids = [1, 2, 3, 4, 5]
    full = make_tiny_engine(num_kv_blocks=64)  # max_model_len defaults to the model's context
    assert full.max_model_len == TINY_CONTEXT
    field, why = full.request_problem(ids, params, fit_context=True)
    assert field == "max_tokens" and "raise" not in why and why.endswith(OVERFLOW_FIX_FULL)
    field, why = full.request_problem(list(range(1, TINY_CONTEXT + 1)), params)
    assert field == "prompt" and "raise" not in why, why
    assert why.endswith("shorten the prompt (max_model_len is already the model's whole context)")

    short = make_tiny_engine(num_kv_blocks=64, max_model_len=256)
    field, why = short.request_problem(ids, params, fit_context=True)
    assert field == "max_tokens" and why.endswith(OVERFLOW_FIX)
    field, why = short.request_problem(list(range(1, 257)), params)
    assert field == "prompt" and why.endswith("shorten the prompt or raise max_model_len (--max-model-len)")
    assert short.model_info()["max_position_embeddings"] == TINY_CONTEXT
