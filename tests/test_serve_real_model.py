"""``nanovllm serve`` on the embedded default model: the official client gets ``LLM.generate``'s greedy text."""

from __future__ import annotations

import openai
import pytest

from nanovllm_core import SamplingParams
from nanovllm_core.engine.controller import EngineController
from tests.serve_helpers import start_server

pytestmark = pytest.mark.real_model


def test_default_model_greedy_text_and_usage_equal_llm_generate_and_chat(make_engine, make_llm):
    params = SamplingParams(temperature=0, max_tokens=6)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reference = make_llm(num_kv_blocks=64)
    want_text = reference.generate("The capital of France is", params, use_tqdm=False)[0]
    want_chat = reference.chat(messages, params, use_tqdm=False)[0]
    controller = EngineController.from_engine(make_engine(num_kv_blocks=64))
    server = start_server(controller)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct"
        got = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0)
        assert got.choices[0].text == want_text.outputs[0].text
        assert got.choices[0].finish_reason == want_text.outputs[0].finish_reason
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
            len(want_text.prompt_token_ids), len(want_text.outputs[0].token_ids))
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat.outputs[0].text
        assert chunks[-1].usage.prompt_tokens == len(want_chat.prompt_token_ids)
        assert chunks[-1].usage.completion_tokens == len(want_chat.outputs[0].token_ids)
    finally:
        server.stop()
        controller.shutdown(timeout=5)


def test_llm_chat_continue_final_message_equals_generate_on_the_open_prompt(make_llm):
    """Trial 20b #3: LLM.chat takes vLLM's continue_final_message and chat_template_kwargs, on the
    embedded model's real chat template: continuing the assistant's words generates what the
    same prompt, rendered open and sent as token ids, generates (greedy, 2 tokens)."""
    llm = make_llm(num_kv_blocks=64)
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    ids = llm.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert llm.tokenizer.decode(ids).endswith("The capital of France is")
    got = llm.chat(messages, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True,
                   chat_template_kwargs={"enable_thinking": False})[0]
    assert got.prompt_token_ids == ids
    want = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(messages, params, use_tqdm=False, continue_final_message=True)
