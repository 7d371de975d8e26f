"""Trial 20c: yes/no options refuse anything but True/False (bug 2)."""

from __future__ import annotations

import pytest

from nanovllm_core import LLM, SamplingParams
from nanovllm_core.config import FLAG_FIELDS, EngineConfig

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
