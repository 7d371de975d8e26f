"""Greedy outputs never depend on how they were scheduled.

The same dozen prompts (varied lengths, several sharing a long prefix) run greedily with
``ignore_eos`` through: the contiguous baseline one by one, the paged engine in one batch,
a 32-token budget (every long prompt chunked), prefix caching off, a KV pool so small that
preemption happens, FCFS and priority policies, and the math attention backend. Token ids
must be identical everywhere.
"""

from __future__ import annotations

import pytest

from nanovllm_core.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

SHARED = ("You are a careful assistant. Answer in one short sentence, and be precise about facts, "
          "names and numbers. Question: ")
PROMPTS = [
    "The capital of France is",
    "Hi",
    SHARED + "What is the largest planet in the solar system?",
    SHARED + "Who wrote the play Romeo and Juliet?",
    SHARED + "How many legs does a spider have?",
    "In 1492, Christopher Columbus",
    "def add(a, b):\n    return",
    "A list of fruits: apple, banana, cherry, " * 3,
    SHARED + "What is the boiling point of water at sea level?",
    "The mitochondria is",
    "Translate to French: good morning",
    "Once upon a time there was a dragon who " * 4,
]
MAX_TOKENS = 12
PRIORITIES = [i % 3 for i in range(len(PROMPTS))]


def run(make_llm, priority=None, **engine):
    llm = make_llm(**engine)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, priority=priority, use_tqdm=False)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0, "blocks held after every request finished"
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.fixture(scope="module")
def reference(make_llm):
    tokens, _ = run(make_llm, paged=False)
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


def test_paged_batch_equals_contiguous_one_by_one(make_llm, reference):
    tokens, stats = run(make_llm)
    assert tokens == reference
    assert stats["prefix_cache_hits"] == 0  # all admitted in one step: nothing was cached yet


def test_small_token_budget_chunks_every_long_prompt(make_llm, reference):
    tokens, _ = run(make_llm, max_num_batched_tokens=32)
    assert tokens == reference


def test_prefix_caching_off(make_llm, reference):
    tokens, _ = run(make_llm, enable_prefix_caching=False, max_num_batched_tokens=32)
    assert tokens == reference


def test_prefix_cache_hits_when_shared_prompts_arrive_later(make_llm, reference):
    # max_num_seqs=2: later prompts are admitted after earlier ones cached the shared prefix
    tokens, stats = run(make_llm, max_num_seqs=2)
    assert tokens == reference
    assert stats["prefix_cache_hits"] > 0


def test_small_pool_forces_preemption(make_llm, reference):
    tokens, stats = run(make_llm, num_kv_blocks=12, max_num_batched_tokens=64)
    assert stats["num_preemptions"] > 0
    assert tokens == reference


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_policies_with_priorities_and_preemption(make_llm, reference, policy):
    # fcfs takes priority 0 only (as vLLM; trial 12): there the requests run in arrival order
    priority = PRIORITIES if policy == "priority" else None
    tokens, _ = run(make_llm, priority=priority, scheduling_policy=policy, num_kv_blocks=14, block_size=8)
    assert tokens == reference


def test_math_attention_backend(make_llm, reference):
    tokens, _ = run(make_llm, attention_backend="math", max_num_batched_tokens=48)
    assert tokens == reference


def test_full_prefix_hit_on_block_aligned_prompt(make_llm):
    llm = make_llm(block_size=16)
    ids = llm.tokenizer.encode("word " * 40)[:32]  # exactly two blocks
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([ids], params, use_tqdm=False)[0]
    second = llm.generate([ids], params, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.metrics.num_cached_prompt_tokens == 16  # the last block is recomputed for its logits
    assert second.num_cached_tokens == 16 and first.num_cached_tokens == 0  # vLLM's RequestOutput field
    assert llm.stats()["kv_blocks_used"] == 0


# Trial 12: stats()["kv_blocks_free"] counted the cached-free blocks too, so used + cached + free
# came to more than the pool (11 of 10); the CLI and the app call "free" only what holds nothing.
def test_stats_kv_blocks_used_cached_and_free_add_up_to_the_pool(make_tiny_engine):
    from nanovllm_core.sampling_params import SamplingParams

    engine = make_tiny_engine(num_kv_blocks=10, block_size=4)
    engine.add_request(list(range(1, 14)), SamplingParams(temperature=0, max_tokens=2))
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and stats["kv_blocks_used"] == 0
    assert stats["kv_blocks_cached"] >= 3, stats  # the prompt's three full blocks stay cached
    assert stats["kv_blocks_used"] + stats["kv_blocks_cached"] + stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def test_math_backend_on_block_weights_is_batch_invariant(make_llm):
    """Trial 21c: with the math attention backend and the GGUF blocks, "Python is a" alone and in a
    batch of five ended differently (logprobs moved by up to 0.15): decodes were attended in padded
    groups, whose float sums moved by ~1e-6, and the int8 activations of the block matmuls turned
    that into other tokens. On the CPU each decode now attends alone: bit-identical logprobs."""
    llm = make_llm(quantization="gguf", attention_backend="math")
    prompts = ["The capital of France is", "Python is a", "def add(a, b):",
               "Once upon a time, in a land far away, there lived a", "1, 2, 3, 4, 5,"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    batched = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(alone, batched):
        assert a.token_ids == b.token_ids
        assert [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)] == \
               [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)]
