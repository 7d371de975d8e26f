"""Trial 20c: yes/no options refuse anything but True/False (bug 2), and a per-step budget below
``max_model_len`` with chunked prefill off is refused when the engine is built (minor)."""

from __future__ import annotations

import pytest

from nanovllm_core import LLM, SamplingParams
from nanovllm_core.config import FLAG_FIELDS, EngineConfig, SettingError

NOT_BOOLS = ["no", "false", "False", 0, 1, 0.0, None, [True]]


@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
@pytest.mark.parametrize("name", FLAG_FIELDS)
def test_engine_flags_take_only_true_or_false(name, value):
    with pytest.raises(ValueError) as err:
        LLM(**{name: value})  # refused before any model is loaded
    assert str(err.value) == f"{name}={value!r} is invalid: it must be True or False"


@pytest.mark.parametrize("name", FLAG_FIELDS)
def test_engine_flags_true_and_false_still_work(name):
    for value in (True, False):
        if name == "paged" and not value:
            continue  # paged=False alone is valid too, but needs nothing else here
        assert getattr(EngineConfig(**{name: value}), name) is value


def test_flag_refusal_comes_before_the_truthiness_checks():
    # 'false' used to be read as True, so the budget check below it was skipped and chunked prefill ran
    with pytest.raises(ValueError, match=r"^enable_chunked_prefill='false' is invalid: it must be True or False$"):
        EngineConfig(max_num_batched_tokens=8, max_model_len=64, enable_chunked_prefill="false")


@pytest.mark.parametrize("value", ["no", 0, None], ids=repr)
@pytest.mark.parametrize("name", ["ignore_eos", "include_stop_str_in_output", "skip_special_tokens"])
def test_sampling_flags_take_only_true_or_false(name, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{name}=.* is invalid: must be true or false$"):
        SamplingParams(**{name: value})


@pytest.fixture(scope="module")
def tiny_llm(make_tiny_engine):
    return LLM.from_engine(make_tiny_engine())


@pytest.mark.parametrize("value", ["no", 0, None], ids=repr)
@pytest.mark.parametrize("name", ["use_tqdm", "reject_bad_prompts"])
def test_generate_flags_take_only_true_or_false(tiny_llm, name, value):
    with pytest.raises(ValueError, match=rf"^{name}=.* is invalid: it must be True or False$"):
        tiny_llm.generate(["hello"], SamplingParams(max_tokens=1), **{name: value})
    assert tiny_llm.engine.block_manager.num_free_blocks == tiny_llm.engine.block_manager.num_blocks
    assert not tiny_llm.engine.requests  # nothing queued


@pytest.mark.parametrize("value", ["no", 0, None], ids=repr)
@pytest.mark.parametrize("name", ["add_generation_prompt", "continue_final_message"])
def test_chat_flags_take_only_true_or_false(tiny_llm, name, value):
    conversation = [{"role": "user", "content": "hi"}]
    for call in (lambda: tiny_llm.chat(conversation, **{name: value}),
                 lambda: tiny_llm.apply_chat_template(conversation, **{name: value}),
                 lambda: tiny_llm.chat(conversation, use_tqdm=value)):
        with pytest.raises(ValueError, match=r"=.* is invalid: it must be True or False$"):
            call()
    assert not tiny_llm.engine.requests


# ---------------------------------------------------------------- minor: the budget with chunked prefill off

def test_budget_below_the_models_context_is_refused_at_construction(make_tiny_engine):
    context = make_tiny_engine().model_config.max_position_embeddings
    with pytest.raises(SettingError) as err:  # a ValueError the app and serve report as "engine setting refused"
        make_tiny_engine(max_num_batched_tokens=8, enable_chunked_prefill=False)
    assert str(err.value) == (
        f"max_num_batched_tokens=8 is below max_model_len ({context}) with enable_chunked_prefill=False, so a "
        f"prompt over 8 tokens could never run (a whole prompt must fit one step); raise max_num_batched_tokens to "
        f"{context}, lower max_model_len, or drop enable_chunked_prefill=False")


def test_budget_below_a_given_max_model_len_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens=8 is below max_model_len \(64\) "):
        LLM(max_num_batched_tokens=8, max_model_len=64, enable_chunked_prefill=False)


def test_budget_with_a_lowered_max_model_len_runs_and_refuses_long_prompts_by_max_model_len(make_tiny_engine):
    # Decided: with max_model_len lowered to the budget the setting is valid; a prompt that would not fit a
    # step is then already too long for max_model_len, which is the refusal that names the real limit.
    llm = LLM.from_engine(make_tiny_engine(max_num_batched_tokens=8, max_model_len=8, enable_chunked_prefill=False))
    (out,) = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=2))
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"^the prompt has 14 tokens but max_model_len is 8"):
        llm.generate([1] * 14, SamplingParams(max_tokens=1))
    assert not llm.engine.requests


def test_budget_check_skips_chunked_prefill_on(make_tiny_engine):
    engine = make_tiny_engine(max_num_batched_tokens=8)
    assert engine.scheduler.token_budget == 8 and engine.scheduler.enable_chunked_prefill
