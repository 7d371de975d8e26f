"""The embedded default model (SmolLM2-135M-Instruct) against transformers on the same converted weights."""

from __future__ import annotations

import pytest
import torch

from nanovllm_core.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three primary colors:",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt_ids, n):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                                pad_token_id=2, eos_token_id=2)
    return out[0, len(prompt_ids):].tolist()


def test_default_model_is_llama_with_gqa(real_model):
    cfg = real_model[0].config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (30, 9, 3, 49152)
    assert cfg.tie_word_embeddings


def test_greedy_32_tokens_match_transformers_generate(make_llm, hf_model):
    llm = make_llm()
    chat = llm.apply_chat_template([{"role": "user", "content": "Name a large ocean."}])
    prompts = PROMPTS + [chat]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(hf_model, out.prompt_token_ids, 32)
        assert out.outputs[0].token_ids == ref, prompt


def test_capital_of_france_names_paris(make_llm):
    out = make_llm().generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in out[0].outputs[0].text


def test_last_position_logits_match_transformers(make_engine, hf_model):
    engine = make_engine()
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy")
    from nanovllm_core.engine.scheduler import ScheduledSequence
    from nanovllm_core.engine.sequence import Sequence

    seq = Sequence(seq_id=0, request_id="x", token_ids=ids, num_prompt_tokens=len(ids), params=SamplingParams())
    engine.block_manager.allocate(seq, len(ids))
    result = engine.runner.run([ScheduledSequence(seq, len(ids), "prefill", True, 0)])
    engine.block_manager.free(seq)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(result.logits[0], ref, atol=1e-3, rtol=1e-4), (result.logits[0] - ref).abs().max()
