"""Counts of 1 read as English in every teaching text: "1 token remains", never "1 tokens" or "1 token remain"."""

from __future__ import annotations

import re

from nanovllm_core import events as ev
from nanovllm_core.educational.commentary import agree, plural
from nanovllm_core.educational.narrator_sampling import speculative_entry
from nanovllm_core.educational.xray_facts import gqa_lines, roofline_commentary
from tests.test_narrator import added, entry, feed_all, finished, fresh, planned, sampled, timed

ONE_PLURAL = re.compile(r"(?<![\d.,])1 (tokens|rows|drafts|draft tokens|prompt tokens|blocks|times|steps|sequences|keys)\b")


def no_bad_one(text: str) -> None:
    assert not ONE_PLURAL.search(text), text


def test_the_helpers_agree_with_the_count():
    assert plural(1, "token") == "1 token" and plural(2, "token") == "2 tokens" and plural(0, "row") == "0 rows"
    assert agree(1, "remains", "remain") == "remains" and agree(3, "remains", "remain") == "remain"


def test_one_token_left_of_a_chunked_prompt_remains():
    n = fresh()
    n.feed(added(ids=tuple(range(33)), pieces=tuple("x" * 33)))
    n.feed(planned(0, [entry(num=32, prompt_len=33, total_len=33)]))
    chunk = next(c for c in n.feed(timed(0, tokens=32)) if c.kind == "chunked_prefill")
    assert "1 token remains for later steps" in chunk.text
    no_bad_one(chunk.text)


def test_one_row_joins_the_other_rows_of_the_step():
    n = fresh()
    n.feed(added(rid="0"))
    n.feed(added(rid="1", ids=(7,), pieces=("x",)))
    plan = planned(0, [entry("0", num=15, prompt_len=15, total_len=15), entry("1", num=1, prompt_len=1, total_len=1)])
    n.feed(plan)
    trace = ev.LayerTrace(step=0, request_id="1", layer=0, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          hidden_size=576, kv_bytes_per_token=46080, ops=(),
                          tensors=(ev.TensorInfo("token_embeddings", (1, 1, 576), (0.5,)),))
    n.feed(trace)
    out = n.feed(timed(0, tokens=16))
    emb = next(c for c in out if c.kind == "embedding" and c.request_id == "1")
    assert "its 1 row joins 15 rows" in emb.text
    prefill = next(c for c in out if c.kind == "prefill" and c.request_id == "1")
    assert "It is 1 of the step's 16 token rows" in prefill.text
    for c in out:
        no_bad_one(c.text)


def test_one_untold_decode_token_was_not_narrated():
    n = fresh(max_decode_steps_per_request=2)
    n.feed(added())
    for step in range(3):
        feed_all(n, [planned(step, [entry(kind="decode", num=1)], admitted=()), sampled(step, n_out=step + 1),
                     timed(step)])
    (end,) = n.feed(finished(n_out=3, step=3))
    assert "1 of its tokens was not narrated one by one" in end.text


def test_xray_one_token_in_context():
    trace = ev.LayerTrace(step=0, request_id="0", layer=0, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          hidden_size=576, kv_bytes_per_token=46080, ops=(),
                          tensors=(ev.TensorInfo("q", (1, 9, 1, 64), ()), ev.TensorInfo("k_cache", (1, 3, 1, 64), ()),
                                   ev.TensorInfo("scores", (1, 9, 1, 1), ())))
    text = " ".join(gqa_lines(trace))
    assert "This request: 1 token in context" in text
    no_bad_one(text)
    no_bad_one(roofline_commentary(trace).title)


def test_one_draft_kept_reads_singular():
    e = ev.SpecDecodeStep(step=1, request_id="0", seq_id=0, proposer="ngram", draft_tokens=(5,),
                          draft_texts=(" a",), accepted=(True,), p=(0.9,), q=(1.0,), bonus_token=6,
                          bonus_text=" b", num_query_tokens=2)
    c = speculative_entry(e, "request 0", True, None)
    assert "drafted 1 token" in c.text and "2 tokens" in c.text and "All 1" not in c.text
    no_bad_one(c.text)


def test_the_cli_memory_stats_and_speculation_notes_say_one_token_and_one_time(capsys):
    from nanovllm_core.cli import print_memory_stats
    from nanovllm_core.speculative.cli import slower_note

    print_memory_stats(dict(kv_bytes_per_block=1 << 20, kv_blocks_total=4, block_size=16, kv_bytes_total=4 << 20,
                            kv_blocks_used=1, kv_blocks_cached=0, kv_blocks_free=3, kv_slots_wasted=2,
                            prefix_cache_hits=0, prefix_cache_queries=1, prefix_cache_hit_rate=0.0,
                            num_preemptions=0, steps=1))
    out = capsys.readouterr().out
    assert "0 of 1 token looked up hit" in out
    assert "ran the draft model 1 time;" in slower_note("model", 1, 4, 4)
    assert "layers 1 time to draft" in slower_note("self:8", 1, 4, 4)


def test_the_cli_memory_stats_size_the_pool_as_the_narrator_does_never_a_rounded_whole_mib(capsys):
    """Trial 10: `--num-kv-blocks 3 --block-size 4` printed "(0.18 MiB each, 1 MiB in all)" for a 540 KiB pool
    the narrator called "540.0 KiB"."""
    from nanovllm_core.cli import print_memory_stats
    from nanovllm_core.educational.commentary import human_bytes

    per = 4 * 46080  # 4 tokens of SmolLM2's K/V
    print_memory_stats(dict(kv_bytes_per_block=per, kv_blocks_total=3, block_size=4, kv_bytes_total=3 * per,
                            kv_blocks_used=1, kv_blocks_cached=0, kv_blocks_free=2, kv_slots_wasted=2,
                            prefix_cache_hits=0, prefix_cache_queries=1, prefix_cache_hit_rate=0.0,
                            num_preemptions=0, steps=1))
    out = capsys.readouterr().out
    assert f"blocks: 3 x 4 tokens ({human_bytes(per)} each, 540.0 KiB in all)" in out and "1 MiB" not in out
    assert human_bytes(per) == "180.0 KiB"


def test_memory_stats_say_the_prefix_cache_is_off_instead_of_counting_lookups(capsys):
    """Trial 10: --no-prefix-caching printed '0 of 22 tokens looked up hit'; nothing is looked up."""
    from nanovllm_core.cli import print_memory_stats

    stats = dict(kv_bytes_per_block=1 << 20, kv_blocks_total=4, block_size=16, kv_bytes_total=4 << 20,
                 kv_blocks_used=1, kv_blocks_cached=0, kv_blocks_free=3, kv_slots_wasted=2, prefix_caching=False,
                 prefix_cache_hits=0, prefix_cache_queries=22, prefix_cache_hit_rate=0.0, num_preemptions=0, steps=1)
    print_memory_stats(stats)
    out = capsys.readouterr().out
    assert "prefix cache: off (--no-prefix-caching" in out and "looked up hit" not in out
    print_memory_stats(dict(stats, prefix_caching=True))
    assert "0 of 22 tokens looked up hit" in capsys.readouterr().out


def test_engine_stats_say_whether_prefix_caching_is_on(make_tiny_engine):
    assert make_tiny_engine(enable_prefix_caching=False).stats()["prefix_caching"] is False
    assert make_tiny_engine().stats()["prefix_caching"] is True


def test_xray_attention_shapes_and_samples_of_one_token_read_singular():
    """Trial 25a: a decode's X-Ray said "3 query heads x 1 tokens a KV head"; a one-key sample would
    have said "the newest 1 keys"."""
    from nanovllm_core.educational.xray_costs import LayerDims, SeqAttention, layer_ops
    from nanovllm_core.educational.xray_facts import sample_text

    dims = LayerDims(576, 1536, 9, 3, 64, 4)
    one = SeqAttention(num_tokens=1, context_len=1, keys_read=1)
    for backend in ("fused", "math"):
        for op in layer_ops(dims, [one], backend, this=one):
            no_bad_one(op.shapes)
            no_bad_one(op.math)
    fused = " ".join(op.shapes for op in layer_ops(dims, [one], "fused", this=one))
    assert "3 query heads x 1 token a KV head" in fused
    assert sample_text(ev.TensorInfo("probs", (1, 9, 1, 1), (1.0,))) == "..., +1.0000 (the newest key, its own)"
    assert "the newest 2 keys, its own last" in sample_text(ev.TensorInfo("probs", (1, 9, 1, 2), (0.5, 0.5)))


def test_serves_pool_refusal_reads_singular_for_one_token_blocks():
    from types import SimpleNamespace

    from nanovllm_core.entrypoints.cli import pool_problem

    engine = SimpleNamespace(block_manager=SimpleNamespace(num_blocks=1, block_size=1), max_model_len=8)
    line = pool_problem(SimpleNamespace(engine=engine))
    assert "holds 1 block x 1 token = 1 token, fewer than one sequence" in line, line
    no_bad_one(line)
