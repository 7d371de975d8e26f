"""Our LLaMA against transformers' ``LlamaForCausalLM`` on the same weights (float32)."""

from __future__ import annotations

import pytest
import torch

from nanovllm_core.attention.contiguous import ContiguousKVCache
from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_core.engine.scheduler import ScheduledSequence
from nanovllm_core.engine.sequence import Sequence
from nanovllm_core.model.loader import load_model
from nanovllm_core.sampling_params import SamplingParams
from tests.conftest import save_tiny_llama

PROMPTS = [
    [1, 504, 3575, 282, 4649, 314],
    [330, 1456, 17, 905, 28, 2, 44, 1209, 77, 3021, 19, 4, 8],
    [42],
    list(range(100, 140)),
]

VARIANTS = {
    "gqa_tied": {},
    "mha_untied": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "gqa_llama3_rope": dict(
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64),
    ),
    "mqa_bias": dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
}


def hf_logits(path, prompt):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]


def contiguous_logits(model, prompt):
    cache = ContiguousKVCache(model.config, len(prompt), torch.float32, torch.device("cpu"), "flash")
    with torch.no_grad():
        ids = torch.tensor(prompt)
        hidden = model(ids, torch.arange(len(prompt)), cache.context(0, len(prompt)))
        return model.compute_logits(hidden)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_one_prompt_at_a_time(tmp_path, variant):
    path = save_tiny_llama(tmp_path, seed=sorted(VARIANTS).index(variant), **VARIANTS[variant])
    model, _, _ = _load_without_tokenizer(path)
    for prompt in PROMPTS:
        ours = contiguous_logits(model, prompt)
        ref = hf_logits(path, prompt)
        assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (variant, (ours - ref).abs().max())


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("variant", ["gqa_tied", "gqa_llama3_rope"])
def test_paged_batch_logits_match_transformers(tmp_path, variant, backend):
    """All prompts in one mixed paged batch, logits at every position, block size 4 (many blocks per prompt)."""
    path = save_tiny_llama(tmp_path, seed=7, **VARIANTS[variant])
    model, _, _ = _load_without_tokenizer(path)
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=4, attention_backend=backend), model, _NoTokenizer())
    scheduled, extra = [], {}
    for i, prompt in enumerate(PROMPTS):
        seq = Sequence(seq_id=i, request_id=str(i), token_ids=list(prompt), num_prompt_tokens=len(prompt),
                       params=SamplingParams(temperature=0))
        assert engine.block_manager.allocate(seq, len(prompt))
        scheduled.append(ScheduledSequence(seq=seq, num_new_tokens=len(prompt), kind="prefill", samples=True, start=0))
        extra[i] = list(range(len(prompt)))
    result = engine.runner.run(scheduled, extra_rows=extra)
    for i, prompt in enumerate(PROMPTS):
        rows = [r for r, (s, _) in enumerate(result.rows) if s.seq.seq_id == i]
        ours = result.logits[rows]
        ref = hf_logits(path, prompt)
        assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (i, (ours - ref).abs().max())


def test_chunked_prefill_logits_match_whole_prefill(tmp_path):
    """A prompt processed as chunks 5 + 7 + rest attends correctly to what the earlier chunks cached."""
    path = save_tiny_llama(tmp_path, seed=3)
    model, _, _ = _load_without_tokenizer(path)
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=4), model, _NoTokenizer())
    prompt = PROMPTS[3]
    seq = Sequence(seq_id=0, request_id="0", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                   params=SamplingParams(temperature=0))
    rows = []
    for start, n in [(0, 5), (5, 7), (12, len(prompt) - 12)]:
        assert engine.block_manager.allocate(seq, start + n)
        s = ScheduledSequence(seq=seq, num_new_tokens=n, kind="prefill", samples=start + n == len(prompt), start=start)
        result = engine.runner.run([s], extra_rows={0: list(range(n))})
        rows.append(result.logits)
    ours = torch.cat(rows)
    ref = hf_logits(path, prompt)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_mixed_step_with_many_decode_groups_matches_transformers(tmp_path, backend):
    """One step of 40 decodes (several decode groups, contexts 1-60 tokens) and a prefill chunk that
    continues a cached context: every row's logits equal transformers' on the whole sequence."""
    from nanovllm_core.engine import model_runner

    path = save_tiny_llama(tmp_path, seed=11)
    model, _, _ = _load_without_tokenizer(path)
    engine = LLMEngine(EngineConfig(num_kv_blocks=512, block_size=4, attention_backend=backend), model, _NoTokenizer())
    engine.runner.decode_group_size = model_runner.DECODE_GROUP_SIZE  # a GPU's padded groups (the CPU's are 1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 60, (40,), generator=gen)]
    assert len(prompts) > 2 * model_runner.DECODE_GROUP_SIZE
    chunked = torch.randint(3, 200, (30,), generator=gen).tolist()
    seqs = [Sequence(seq_id=i, request_id=str(i), token_ids=list(p), num_prompt_tokens=len(p),
                     params=SamplingParams(temperature=0)) for i, p in enumerate(prompts + [chunked])]
    first = []  # step 1: every prompt whole, and the first 10 tokens of the chunked one
    for seq in seqs:
        n = 10 if seq.seq_id == len(prompts) else seq.num_tokens
        assert engine.block_manager.allocate(seq, n)
        first.append(ScheduledSequence(seq=seq, num_new_tokens=n, kind="prefill", samples=False, start=0))
    engine.runner.run(first)
    step = []  # step 2: one new token for each prompt (decodes), the rest of the chunked prompt
    for seq in seqs[:-1]:
        seq.token_ids.append(7)
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        step.append(ScheduledSequence(seq=seq, num_new_tokens=1, kind="decode", samples=True, start=seq.num_tokens - 1))
    last = seqs[-1]
    assert engine.block_manager.allocate(last, last.num_tokens)
    step.append(ScheduledSequence(seq=last, num_new_tokens=20, kind="prefill", samples=True, start=10))
    result = engine.runner.run(step)
    for row, (s, _) in enumerate(result.rows):
        ref = hf_logits(path, s.seq.token_ids)[-1]
        assert torch.allclose(result.logits[row], ref, atol=1e-4, rtol=1e-4), (s.seq.seq_id, (result.logits[row] - ref).abs().max())
    assert len(result.rows) == len(seqs)


class _NoTokenizer:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def _load_without_tokenizer(path):
    """Load a tiny model saved without tokenizer files (the logits need none)."""
    from nanovllm_core.model import loader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "load_tokenizer", lambda p: _NoTokenizer())
        return load_model(str(path), torch.device("cpu"), torch.float32)
