"""The narrator on hand-made events: each entry tells the real numbers of the events it came from."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from nanovllm_core import events as ev
from nanovllm_core.educational.narrator import Commentary, Narrator

INFO = {"model_name": "m", "device": "cpu", "dtype": "float32", "num_layers": 30, "hidden_size": 576,
        "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "vocab_size": 49152, "num_parameters": 134_515_008,
        "kv_bytes_per_token": 46080, "block_size": 16, "num_kv_blocks": 8, "max_num_seqs": 2,
        "token_budget": 32, "scheduling_policy": "priority"}


def added(rid="0", ids=(504, 3575, 314), pieces=("The", " capital", " is"), sampling=(("temperature", 0.0),), max_tokens=8, priority=0):
    return ev.RequestAdded(request_id=rid, prompt="".join(pieces), prompt_token_ids=ids, prompt_pieces=pieces,
                           priority=priority, max_tokens=max_tokens, sampling=sampling)


def entry(rid="0", kind="prefill", num=3, start=0, prompt_len=3, total_len=3, cached=0, priority=0):
    return ev.ScheduledEntry(request_id=rid, seq_id=int(rid), index=0, kind=kind, num_tokens=num, start=start,
                             prompt_len=prompt_len, total_len=total_len, num_cached_tokens=cached, samples=True,
                             priority=priority)


def queued(rid, priority=0, num_tokens=3, preemptions=0):
    return ev.QueueEntry(request_id=rid, seq_id=int(rid), index=0, priority=priority, status="waiting",
                         num_tokens=num_tokens, num_computed_tokens=0, num_preemptions=preemptions)


def planned(step, scheduled, waiting=(), running=None, preempted=(), admitted=None, budget=32, max_num_seqs=2):
    running = running if running is not None else tuple(queued(s.request_id) for s in scheduled)
    admitted = admitted if admitted is not None else tuple(s.request_id for s in scheduled if s.kind == "prefill")
    return ev.StepPlanned(step=step, token_budget=budget, num_batched_tokens=sum(s.num_tokens for s in scheduled),
                          scheduled=tuple(scheduled), preempted=tuple(preempted), admitted=tuple(admitted),
                          waiting=tuple(waiting), running=tuple(running), max_num_seqs=max_num_seqs)


def timed(step, wall=0.05, tokens=3, blocks=1, total=8, cached=0, per_block=16 * 46080):
    return ev.StepTimed(step=step, wall_time_s=wall, num_tokens=tokens, num_prefill_tokens=tokens, num_decode_tokens=0,
                        prefill_tokens_per_s=tokens / wall, decode_tokens_per_s=0.0, kv_bytes_used=blocks * per_block,
                        kv_bytes_total=total * per_block, num_running=1, num_waiting=0, num_blocks_used=blocks,
                        num_blocks_cached=cached, num_blocks_total=total)


def sampled(step, rid="0", token=7042, text=" Paris", n_out=1, greedy=True, temperature=1.0,
            top=((7042, " Paris", 0.7725), (260, " the", 0.0645), (4, " London", 0.0125))):
    return ev.TokenSampled(step=step, request_id=rid, seq_id=int(rid), index=0, token_id=token, text=text, token_text=text,
                           position=2 + n_out, num_output_tokens=n_out,
                           top=tuple(ev.TopToken(*t) for t in top), greedy=greedy, temperature=temperature)


def finished(rid="0", n_out=2, step=1):
    return ev.RequestFinished(request_id=rid, step=step, index=0, finish_reason="length", stop_reason=None,
                              output_text=" Paris.", output_token_ids=(7042, 30)[:n_out], num_prompt_tokens=3,
                              num_output_tokens=n_out, ttft_s=0.05, tpot_s=0.02, e2e_s=0.07, num_preemptions=0,
                              num_cached_prompt_tokens=0)


def fresh(**kwargs) -> Narrator:
    """A narrator that knows the model and has already introduced it."""
    n = Narrator(INFO, **kwargs)
    assert kinds(n.introduction()) == ["model"]
    return n


def feed_all(narrator, events) -> list[Commentary]:
    out = []
    for e in events:
        out.extend(narrator.feed(e))
    return out


def kinds(entries):
    return [c.kind for c in entries]


def test_tokenization_lists_each_piece_with_its_id():
    (tok, samp) = Narrator().feed(added())
    assert tok.kind == "tokenization" and tok.request_id == "0"
    assert "[The]=504 [␣capital]=3575 [␣is]=314" in tok.text
    assert "Token ids: [504, 3575, 314]" in tok.text
    assert samp.kind == "sampling" and "Greedy" in samp.text and "or after 8 tokens" in samp.text


def test_sampling_entry_explains_temperature_top_k_and_top_p():
    n = Narrator()
    _, samp = n.feed(added(sampling=(("seed", 7), ("temperature", 0.5), ("top_k", 20), ("top_p", 0.9))))
    assert "temperature 0.5" in samp.text and "sharper" in samp.text
    assert "20 most likely" in samp.text and "add up to at least 0.9" in samp.text and "seed 7" in samp.text


def test_model_entry_comes_first_from_the_ready_loading_event():
    n = Narrator()
    out = n.feed(ev.ModelLoading(stage="ready", done=1, total=1, ready=True, model_info=tuple(INFO.items())))
    assert kinds(out) == ["model"]
    assert "30 decoder layers" in out[0].text and "9 query heads sharing 3 KV heads" in out[0].text
    assert "46,080 bytes" in out[0].text
    assert n.feed(ev.EnginePaused(step=0)) == []  # told once


def test_prefill_is_told_when_its_step_ends_with_the_step_time():
    n = fresh()
    n.feed(added())
    assert n.feed(planned(0, [entry()])) == []  # one request alone: no scheduler entry
    assert n.feed(sampled(0)) == []  # held until the step's time is known
    out = n.feed(timed(0, wall=0.0421))
    assert kinds(out) == ["embedding", "prefill", "decode", "kv_cache"]
    prefill = out[1]
    assert "All 3 prompt tokens" in prefill.text and "all 30 layers" in prefill.text
    assert "42.1 ms" in prefill.text and "3 x 46,080 = 138,240 bytes" in prefill.text


def test_embedding_shows_real_values_from_the_xray_trace():
    n = fresh()
    n.feed(added())
    n.feed(planned(0, [entry()]))
    trace = ev.LayerTrace(step=0, request_id="0", layer=0, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          hidden_size=576, kv_bytes_per_token=46080, ops=(),
                          tensors=(ev.TensorInfo("token_embeddings", (1, 3, 576), (0.0123, -0.4567, 0.5, 0.25)),
                                   ev.TensorInfo("q", (1, 9, 3, 64), ()), ev.TensorInfo("k", (1, 3, 3, 64), ()),
                                   ev.TensorInfo("scores", (1, 9, 3, 3), ())))
    n.feed(trace)
    out = n.feed(timed(0))
    emb = next(c for c in out if c.kind == "embedding")
    assert "[49152, 576]" in emb.text and "[3, 576]" in emb.text
    assert "+0.0123, -0.4567, +0.5000, +0.2500" in emb.text
    att = next(c for c in out if c.kind == "attention")
    assert "[1, 9, 3, 64]" in att.text and "3 per KV head" in att.text and "[1, 9, 3, 3]" in att.text


def test_decode_entry_carries_the_top_k_table_and_the_chosen_token():
    n = fresh()
    n.feed(added())
    n.feed(planned(0, [entry()]))
    n.feed(sampled(0))
    out = n.feed(timed(0))
    dec = next(c for c in out if c.kind == "decode")
    assert dec.table == ((" Paris", 0.7725), (" the", 0.0645), (" London", 0.0125))
    assert "[␣Paris] at 77.25%" in dec.text and "Greedy decoding takes it" in dec.text and "id 7042" in dec.text


def test_a_sampled_token_is_placed_by_its_rank_in_the_labelled_table():
    n = fresh()
    n.feed(added(sampling=(("temperature", 0.9),)))
    n.feed(planned(0, [entry()]))
    n.feed(sampled(0, token=260, text=" the", greedy=False, temperature=0.9))
    dec = next(c for c in n.feed(timed(0)) if c.kind == "decode")
    assert "Sampling drew [␣the] (id 260), 2nd in the table at 6.45%" in dec.text
    assert dec.table_title == "probabilities after temperature 0.9"  # the contract: top is what the sampler used
    assert dec.table_notes == ("", "chosen", "")


def test_a_table_of_the_models_own_probabilities_is_labelled_so():
    # Traces recorded before TokenSampled.top was the processed distribution: the chosen
    # token's logprob (always the model's own) equals its probability in the table.
    n = fresh()
    n.feed(added(sampling=(("temperature", 0.9),)))
    n.feed(planned(0, [entry()]))
    n.feed(replace(sampled(0, token=260, text=" the", greedy=False, temperature=0.9), logprob=math.log(0.0645)))
    dec = next(c for c in n.feed(timed(0)) if c.kind == "decode")
    assert dec.table_title == "the model's own probabilities, before temperature 0.9"


def test_kv_cache_bytes_are_blocks_times_bytes_per_block():
    n = fresh()
    n.feed(added())
    n.feed(planned(0, [entry()]))
    n.feed(ev.BlocksChanged(step=0, block_size=16, bytes_per_block=737280, states="uff", ref_counts=(1, 0, 0),
                            tables=(ev.SeqBlocks("0", 0, 0, (0,), 4, 3),)))
    kv = next(c for c in n.feed(timed(0, blocks=1, total=3, per_block=737280)) if c.kind == "kv_cache")
    assert "1 block x 737,280 bytes = 737,280 bytes" in kv.text
    assert "keeps 3 tokens in blocks [0] (13 slots still empty)" in kv.text


def test_kv_cache_says_what_blocks_reserve_and_what_tokens_store_with_shared_blocks_counted_once():
    n = fresh()
    n.feed(added())
    n.feed(planned(0, [entry()]))
    # two samples share prompt block 5 (16 tokens) and each has its own second block: 20 and 18 tokens computed
    tables = (ev.SeqBlocks("0", 0, 0, (5, 1), 21, 20), ev.SeqBlocks("0", 1, 1, (5, 2), 19, 18))
    n.feed(ev.BlocksChanged(step=0, block_size=16, bytes_per_block=737280, states="fuuuuu", ref_counts=(0, 1, 1, 0, 0, 2),
                            tables=tables))
    kv = next(c for c in n.feed(timed(0, blocks=3, total=6, per_block=737280)) if c.kind == "kv_cache")
    per_token = 737280 // 16
    stored = (16 + 4 + 2) * per_token  # block 5 counted once, then the 4 and 2 tokens past it
    assert f"3 blocks x 737,280 bytes = {3 * 737280:,} bytes (2.1 MiB) reserved" in kv.text
    assert f"store 22 tokens x {per_token:,} bytes = {stored:,} bytes" in kv.text
    assert "the other 26 slots are reserved but still empty" in kv.text
    assert kv.title.endswith("reserved in 3 blocks, 990.0 KiB stored")


def test_a_demo_that_promises_the_kv_cache_after_each_step_tells_it_every_step():
    from nanovllm_core.educational.tutorial import DEMOS

    assert DEMOS["kv_cache"].kv_every_step and "After each step" in DEMOS["kv_cache"].watch
    n = fresh(kv_every_step=True)
    n.feed(added())
    told = []
    for step in range(4):  # one prefill, then decodes inside the same block
        e = entry() if step == 0 else entry(kind="decode", num=1, start=2 + step, total_len=3 + step)
        blocks = ev.BlocksChanged(step=step, block_size=16, bytes_per_block=737280, states="uf", ref_counts=(1, 0),
                                  tables=(ev.SeqBlocks("0", 0, 0, (0,), 4 + step, 3 + step),))
        told += [c for c in feed_all(n, [planned(step, [e]), blocks, timed(step, blocks=1, total=2, per_block=737280)])
                 if c.kind == "kv_cache"]
    assert [c.step for c in told] == [0, 1, 2, 3]
    assert all("No block was taken or freed in this step" in c.text for c in told[1:])
    assert [f"store {3 + s} tokens" in c.text for s, c in enumerate(told)] == [True] * 4


def test_kv_cache_is_told_only_when_its_block_count_changes():
    n = fresh()
    n.feed(added())
    feed_all(n, [planned(0, [entry()]), timed(0, blocks=1)])
    out = feed_all(n, [planned(1, [entry(kind="decode", num=1, start=3, total_len=4)]), timed(1, blocks=1)])
    assert "kv_cache" not in kinds(out)


def test_waiting_request_is_explained_by_max_num_seqs():
    n = fresh()
    plan = planned(0, [entry("0"), entry("1")], waiting=[queued("2"), queued("3")], max_num_seqs=2)
    (sched,) = n.feed(plan)
    assert sched.kind == "scheduler"
    assert "request 2 (max_num_seqs: 2 sequences are already running (a request with n samples runs n))" in sched.text
    assert "behind it, in priority order: request 3" in sched.text


def test_waiting_request_is_explained_by_the_token_budget():
    plan = planned(0, [entry("0", num=32, prompt_len=40, total_len=40)], waiting=[queued("1")], max_num_seqs=4)
    (sched,) = fresh().feed(plan)
    assert "the step's token budget of 32 is used up" in sched.text


def test_waiting_request_is_explained_by_missing_kv_blocks():
    plan = planned(0, [entry("0")], waiting=[queued("1")], max_num_seqs=4)
    (sched,) = fresh().feed(plan)
    assert "not enough free KV blocks" in sched.text


def test_preemption_names_the_victim_and_why_it_was_chosen():
    plan = planned(5, [entry("0", kind="decode", num=1, start=9, total_len=10)],
                   preempted=[queued("1", priority=0, num_tokens=12, preemptions=1)], waiting=[queued("1")],
                   admitted=())
    out = fresh().feed(plan)
    assert kinds(out) == ["scheduler", "preemption"]
    assert "this step had to preempt" in out[0].text
    pre = out[1]
    assert pre.request_id == "1" and "lowest-priority running request" in pre.text and "its 12 tokens" in pre.text


@pytest.mark.parametrize("running, policy, rule", [
    ((("0", 5), ("2", 1)), "priority", "it was the lowest-priority running request. "),
    ((("0", 0), ("2", 5)), "priority", "it was the lowest-priority running request, and of the 2 requests at "
                                       "priority 0 the latest to arrive. "),
    ((), "priority", "it was the only running request. "),
    ((("0", 0),), "fcfs", "it was the running request that arrived last. "),
])
def test_a_preemption_names_only_the_part_of_the_rule_that_decided_this_step(running, policy, rule):
    """Trial 38e: priorities 0, 5 and 1; request 0 (priority 0, the first to arrive, alone at its priority) was
    preempted and the entry said "the lowest-priority running request, the latest to arrive among equals"."""
    why = ev.Shortfall(request_id="1", seq_id=1, index=0, blocks_needed=1, blocks_free=0)
    plan = replace(planned(9, [entry("0", kind="decode", num=1, start=9, total_len=10)],
                           running=[queued(rid, priority=p) for rid, p in running],
                           preempted=[queued("1", priority=0, num_tokens=12, preemptions=1)], waiting=[queued("1")],
                           admitted=()), shortfalls=(why,))
    pre = next(c for c in Narrator({**INFO, "scheduling_policy": policy}).feed(plan) if c.kind == "preemption")
    assert rule in pre.text, pre.text
    assert "among equals" not in pre.text


def test_a_readmission_that_runs_as_a_decode_is_called_one():
    """Trial 41e: readmitted with all but its newest token in the prefix cache, the request ran as "decode, 1 token"
    in the scheduler line while the same step's prefix-cache entry told its 16 tokens reused."""
    back = replace(entry("1", kind="decode", num=1, start=16, total_len=17, cached=16))
    other = entry("0", kind="decode", num=1, start=9, total_len=10)
    running = [queued("0", num_tokens=10), queued("1", num_tokens=17, preemptions=2)]
    plan = planned(12, [other, back], running=running, admitted=("1",))
    sched = next(c for c in fresh().feed(plan) if c.kind == "scheduler")
    assert "request 1: decode, 1 token, readmitted after preemption (16 tokens from the prefix cache)" in sched.text, \
        sched.text
    plain = planned(13, [other, back], running=running, admitted=())
    assert all("readmitted" not in c.text for c in fresh().feed(plain) if c.kind == "scheduler")


def test_prefix_cache_hit_counts_the_reused_tokens():
    plan = planned(3, [entry("1", num=8, start=32, prompt_len=40, total_len=40, cached=32)])
    (hit,) = fresh().feed(plan)
    assert hit.kind == "prefix_cache" and "first 32 of 40 tokens" in hit.text and "2 full blocks" in hit.text
    assert "only the other 8 are computed" in hit.text


def test_a_long_prompt_is_told_chunk_by_chunk():
    n = fresh()
    n.feed(added(ids=tuple(range(70)), pieces=tuple("x" * 70)))
    feed_all(n, [planned(0, [entry(num=32, prompt_len=70, total_len=70)])])
    out = n.feed(timed(0, tokens=32))
    chunk = next(c for c in out if c.kind == "chunked_prefill")
    assert "tokens 0..31 (32)" in chunk.text and "38 tokens remain" in chunk.text
    n.feed(planned(2, [entry(num=6, start=64, prompt_len=70, total_len=70)], admitted=()))
    last = next(c for c in n.feed(timed(2, tokens=6)) if c.kind == "chunked_prefill")
    assert "last chunk" in last.text


def test_steady_decode_steps_add_no_scheduler_entries():
    n = fresh()
    decodes = [entry("0", kind="decode", num=1), entry("1", kind="decode", num=1)]
    first = n.feed(planned(4, decodes, admitted=()))
    again = n.feed(planned(5, decodes, admitted=()))
    assert kinds(first) == ["scheduler"] and again == []


def test_decode_entries_are_capped_per_request_and_summed_up_at_the_end():
    n = fresh(max_decode_steps_per_request=2)
    n.feed(added())
    told = []
    for step in range(4):
        told += feed_all(n, [planned(step, [entry(kind="decode", num=1)], admitted=()),
                             sampled(step, n_out=step + 1), timed(step)])
    assert kinds(told).count("decode") == 2
    (end,) = n.feed(finished(n_out=4, step=4))
    assert "2 of its tokens were not narrated one by one" in end.text
    assert "TTFT" not in end.text and "Time to first token 50.0 ms" in end.text


def test_the_cap_promises_later_tokens_only_when_the_request_goes_on():
    """Trial 37e: the capped request's last narrated token was also its last token (max_tokens = the cap),
    and the entry still said "Later tokens of this request are summed up when it finishes"."""
    promise = "Later tokens of this request are summed up"
    for max_tokens, promised in ((3, False), (4, True)):
        n = fresh(max_decode_steps_per_request=3)
        n.feed(added())
        told = []
        for step in range(max_tokens):
            ends = [finished(n_out=max_tokens, step=step)] if step == max_tokens - 1 else []
            told += feed_all(n, [planned(step, [entry(kind="decode", num=1)], admitted=()),
                                 sampled(step, n_out=step + 1), *ends, timed(step)])
        capped = [c for c in told if c.kind == "decode"][-1]
        assert (promise in capped.text) is promised, (max_tokens, capped.text)
        end = next(c for c in told if c.kind == "finished")
        assert ("not narrated one by one" in end.text) is promised, end.text


def test_a_ttft_shorter_than_its_first_step_says_why():
    """Trial 37a: "The step took 876.5 ms" for the step that made the first token, then "Time to first token
    867.8 ms" with no word why the token came before its step ended."""
    import dataclasses

    # 0.04999 s and the step's 0.05 s both read "50.0 ms": no sentence says one is shorter (trial 38a: "3.7 s")
    for ttft, explained in ((0.045, True), (0.060, False), (0.04999, False)):
        n = fresh()
        n.feed(added())
        told = feed_all(n, [planned(0, [entry()]), sampled(0), timed(0, wall=0.05),
                            dataclasses.replace(finished(n_out=1, step=1), ttft_s=ttft)])
        end = next(c for c in told if c.kind == "finished")
        assert ("TTFT is shorter than the 50.0 ms of the step that made the first token" in end.text) is explained, \
            end.text


def test_rejection_and_engine_error_are_told_at_once():
    n = Narrator()
    (rej,) = n.feed(ev.RequestRejected(request_id="9", reason="the prompt is empty; give at least one token of text"))
    assert rej.kind == "rejected" and "prompt is empty" in rej.text
    (err,) = n.feed(ev.EngineError(step=None, message="RuntimeError: boom", request_id="9"))
    assert err.kind == "error" and "boom" in err.text and "request 9" in err.text


def test_negative_cap_is_refused():
    with pytest.raises(ValueError, match="max_decode_steps_per_request"):
        Narrator(max_decode_steps_per_request=-1)


def test_model_info_given_at_construction_is_told_before_the_first_event():
    assert kinds(Narrator(INFO).feed(added())) == ["model", "tokenization", "sampling"]


# ------------------------------------------------------------------ teaching truth (issue 13)


def greedy_took_the_top_row(entries) -> bool:
    """No decode entry says greedy takes a token that does not head the table it shows."""
    return all(c.table_notes[:1] == ("chosen",) for c in entries if c.kind == "decode" and "takes it" in c.text)


MAT = ((1000, " mat", 0.1467), (1001, " cat", 0.1239), (1002, " bed", 0.0304))  # the model's own
BED = ((1002, " bed", 0.3120), (1003, " couch", 0.2901), (1004, " floor", 0.2850))  # after the penalty


def test_greedy_with_a_penalty_shows_the_distribution_it_chose_from_and_the_models_own_beside_it():
    n = fresh()
    n.feed(added(sampling=(("repetition_penalty", 1.8), ("temperature", 0.0))))
    n.feed(planned(0, [entry()]))
    e = sampled(0, token=1002, text=" bed", top=BED)
    n.feed(replace(e, model_top=tuple(ev.TopToken(*t) for t in MAT)))
    dec = next(c for c in n.feed(timed(0)) if c.kind == "decode")
    assert dec.table[0] == (" bed", 0.3120) and dec.table_notes[0] == "chosen"
    assert dec.table_title == "probabilities after repetition penalty 1.8"
    assert "after repetition penalty 1.8 the highest is [␣bed] at 31.20%. Greedy decoding takes it: [␣bed]" in dec.text
    assert "the model's own favourite was [␣mat] at 14.67%" in dec.text
    assert greedy_took_the_top_row([dec])


def test_greedy_never_takes_a_token_below_the_top_of_the_table_it_shows():
    # A trace whose table is the model's own distribution, before the penalty moved the choice.
    n = fresh()
    n.feed(added(sampling=(("repetition_penalty", 1.8), ("temperature", 0.0))))
    n.feed(planned(0, [entry()]))
    n.feed(sampled(0, token=1002, text=" bed", top=MAT))
    dec = next(c for c in n.feed(timed(0)) if c.kind == "decode")
    assert "takes it" not in dec.text and greedy_took_the_top_row([dec])
    assert dec.table_title == "the model's own probabilities, before repetition penalty 1.8"
    assert ("the model's own favourite is [␣mat] at 14.67%, but greedy decoding took [␣bed] (id 1002), 3rd in the "
            "table at 3.04%: repetition penalty 1.8 changed the scores") in dec.text


def test_greedy_sampling_entry_names_the_penalty_applied_before_the_argmax():
    _, samp = Narrator().feed(added(sampling=(("repetition_penalty", 1.3), ("temperature", 0.0))))
    assert "highest-scoring token is taken, after these changes to the scores: repetition penalty 1.3" in samp.text


def spec(step=1, rid="0", accepted=(True, False, False), p=(0.9, 0.2, 0.5), q=(1.0, 1.0, 1.0), **kw):
    return ev.SpecDecodeStep(step=step, request_id=rid, seq_id=int(rid), proposer="ngram", draft_tokens=(5, 6, 7),
                             draft_texts=(" a", " b", " c"), p=p, q=q, accepted=accepted, bonus_token=11,
                             bonus_text=" d", **kw)


def spec_step(sampling, event, kept=2):
    n = fresh()
    n.feed(added(sampling=sampling))
    feed_all(n, [planned(0, [entry()]), sampled(0), timed(0)])
    n.feed(planned(1, [entry(kind="decode", num=4, start=3, total_len=4)], admitted=()))
    n.feed(event)
    for i in range(kept):
        n.feed(sampled(1, token=5 + i, text=" x", n_out=2 + i, top=()))
    return n.feed(timed(1, tokens=4))


def test_greedy_verification_is_told_by_its_rule_and_the_tokens_it_ran():
    # An old trace: num_query_tokens 0 and greedy unset; the request's temperature 0 decides.
    out = spec_step((("temperature", 0.0),), spec())
    (v,) = [c for c in out if c.kind == "speculative"]
    assert "ran 4 tokens of this sequence through all its layers in one forward pass" in v.text
    assert "Greedy verification" in v.text and "min(1" not in v.text
    assert "The 2nd draft [␣b] is not the target's choice there" in v.text and "[␣d] takes its place" in v.text
    assert v.table_notes == ("accepted", "rejected", "dropped") and v.table[0] == (" a", 0.9)
    decodes = [c for c in out if c.kind == "decode"]
    assert len(decodes) == 2 and not any("one new token" in c.text for c in decodes)
    assert "4 tokens of this sequence went through the layers in this step's one forward pass" in decodes[0].text
    assert "The step, drafting included, took" in decodes[0].text  # the wall time holds the drafter's passes too


def test_sampled_verification_of_a_fixed_guess_keeps_it_with_probability_p():
    out = spec_step((("temperature", 0.8),), spec(greedy=False, num_query_tokens=4))
    (v,) = [c for c in out if c.kind == "speculative"]
    assert "kept with probability min(1, p(x)/q(x))" in v.text and "kept with probability p" in v.text
    assert "(p = 0.2, q = 1) had a 0.2 chance and was rejected" in v.text
    assert "from the target's distribution without the rejected token" in v.text


def test_the_rule_of_a_recorded_verification_wins_over_the_temperature():
    out = spec_step((("temperature", 0.8),), spec(greedy=True, num_query_tokens=4, q=(0.9, 0.8, 0.7)))
    (v,) = [c for c in out if c.kind == "speculative"]
    assert "Greedy verification" in v.text and "min(1" not in v.text


def test_a_stop_inside_the_kept_run_is_told():
    out = spec_step((("temperature", 0.0),), spec(accepted=(True, True, True)), kept=1)
    (v,) = [c for c in out if c.kind == "speculative"]
    assert "4 tokens from one forward pass. A stop condition ended the sequence after 1 of them." in v.text


def test_a_chunk_that_takes_the_whole_budget_is_not_told_as_letting_others_decode():
    # Priority policy: the running high-priority prompt's chunk is served first and uses all 32 tokens.
    n = fresh()
    n.feed(added("1", ids=tuple(range(70)), pieces=tuple("x" * 70), priority=10))
    chunk = entry("1", num=32, start=32, prompt_len=70, total_len=70, priority=10)
    running = (queued("1", priority=10), queued("0"))
    (sched,) = n.feed(planned(5, [chunk], running=running, admitted=()))
    assert "Request 0 is running but got no token" in sched.text and sched.title == "Step 5: 2 running, 0 waiting"
    told = next(c for c in n.feed(timed(5, tokens=32)) if c.kind == "chunked_prefill")
    assert "decod" not in told.text
    assert "Request 0 is running but got no token in this step" in told.text
    assert "served in priority order, the highest priority value first (vLLM's: the lowest)" in told.text


def test_decodes_beside_a_chunk_are_told_only_when_the_plan_has_them():
    n = fresh()
    n.feed(added("1", ids=tuple(range(70)), pieces=tuple("x" * 70)))
    plan = planned(2, [entry("0", kind="decode", num=1, start=5, total_len=6),
                       entry("1", num=31, start=0, prompt_len=70, total_len=70)])
    n.feed(plan)
    told = next(c for c in n.feed(timed(2, tokens=32)) if c.kind == "chunked_prefill")
    assert "In the same step request 0 decoded (1 token)" in told.text
    assert "1 of them taken by other sequences" in told.text


def readmitted_narrator(watched_before: bool = True):
    """Request 1 (7 prompt tokens) decodes until step 7 (14 tokens computed), is preempted in step 8
    holding 15 tokens, and is readmitted in step 9 with 12 of them in the prefix cache."""
    n = fresh()
    n.feed(added("1", ids=tuple(range(7)), pieces=tuple("y" * 7)))
    if watched_before:
        feed_all(n, [planned(7, [entry("1", kind="decode", num=1, start=13, prompt_len=7, total_len=14)], admitted=()),
                     sampled(7, rid="1", token=8, text=" w", n_out=8), timed(7)])
        feed_all(n, [planned(8, [entry("0", kind="decode", num=1, start=9, total_len=10)], admitted=(),
                             preempted=[queued("1", num_tokens=15, preemptions=1)], waiting=[queued("1")]), timed(8)])
    back = entry("1", num=3, start=12, prompt_len=7, total_len=15, cached=12)
    hit = n.feed(planned(9, [back], running=(queued("1", num_tokens=15, preemptions=1),), admitted=("1",)))
    n.feed(sampled(9, rid="1", token=9, text=" z", n_out=9))
    return hit, n.feed(timed(9))


def test_a_readmission_tells_reused_and_recomputed_tokens():
    planned_entries, told = readmitted_narrator()
    hit = next(c for c in planned_entries if c.kind == "prefix_cache")
    # trial 29d: each split beside its own count ("12 of its 15 tokens (7 prompt + 8 generated) are found"
    # read as 7 + 8 found)
    assert ("readmitted after its preemption: of its 15 tokens (7 prompt + 8 generated), 12 (7 prompt + 5 generated) "
            "are found in the prefix cache") in hit.text
    assert ("only the other 3 are computed: 2 recomputed, their keys and values lost with its blocks, and 1 "
            "computed for the first time") in hit.text
    assert hit.title.endswith("readmitted, 12 tokens reused, 2 recomputed")
    pre = next(c for c in told if c.kind == "prefill")
    assert "It computes tokens 12..14 (3) of its 15 (7 prompt + 8 generated)" in pre.text
    assert "the 12 before them were found in the prefix cache" in pre.text
    assert pre.title == "Request 1: recompute of 2 tokens and 1 new"
    dec = next(c for c in told if c.kind == "decode")
    assert "token #9, after the recompute" in dec.title and "one new token" not in dec.text
    assert dec.heading == "token after recompute"  # a prefill entry made it, not a decode step (trial 42a)


def test_a_repeated_preemption_counts_itself_and_the_tokens_recomputed_so_far():
    """Trial 12: a request preempted 7 times, recomputing each time, and no entry said so."""
    n = fresh()
    n.feed(added("1", ids=tuple(range(7)), pieces=tuple("y" * 7)))
    feed_all(n, [planned(7, [entry("1", kind="decode", num=1, start=13, prompt_len=7, total_len=14)], admitted=()),
                 sampled(7, rid="1", token=8, text=" w", n_out=8), timed(7)])

    def preempt(step, tokens, times):
        out = n.feed(planned(step, [entry("0", kind="decode", num=1, start=9, total_len=10)], admitted=(),
                             preempted=[queued("1", num_tokens=tokens, preemptions=times)], waiting=[queued("1")]))
        n.feed(timed(step))
        return next(c for c in out if c.kind == "preemption")

    first = preempt(8, 15, 1)  # 14 computed, lost
    assert "Preemptions of this request so far: 1." in first.text and "2nd" not in first.text
    feed_all(n, [planned(9, [entry("1", num=3, start=12, prompt_len=7, total_len=15, cached=12)],
                         running=(queued("1", num_tokens=15, preemptions=1),), admitted=("1",)),
                 sampled(9, rid="1", token=9, text=" z", n_out=9), timed(9)])  # 12, 13 recomputed
    second = preempt(10, 16, 2)
    assert "This is its 2nd preemption: after the earlier 1 preemption it recomputed 2 tokens" in second.text
    assert "vLLM also preempts by recompute" in second.text and "More KV blocks" in second.text
    feed_all(n, [planned(11, [entry("1", num=4, start=12, prompt_len=7, total_len=16, cached=12)],
                         running=(queued("1", num_tokens=16, preemptions=2),), admitted=("1",)),
                 sampled(11, rid="1", token=9, text=" z", n_out=10), timed(11)])  # 12, 13, 14 recomputed
    third = preempt(12, 17, 3)
    assert "This is its 3rd preemption: after the earlier 2 preemptions it recomputed 5 tokens" in third.text
    unseen = next(c for c in fresh().feed(planned(4, [entry("0", kind="decode", num=1, start=9, total_len=10)],
                                                  admitted=(), waiting=[queued("1")],
                                                  preempted=[queued("1", num_tokens=16, preemptions=2)]))
                  if c.kind == "preemption")
    assert "This is its 2nd preemption." in unseen.text and "it recomputed" not in unseen.text  # earlier ones unseen


def test_a_readmission_the_narrator_did_not_watch_claims_no_recompute_count():
    planned_entries, _ = readmitted_narrator(watched_before=False)
    hit = next(c for c in planned_entries if c.kind == "prefix_cache")
    assert hit.title.endswith("readmitted, 12 tokens reused, 3 computed") and "recomputed" not in hit.text


def test_a_prompt_preempted_during_its_prefill_computes_the_rest_for_the_first_time():
    n = fresh()
    n.feed(added("0", ids=tuple(range(83)), pieces=tuple("x" * 83)))
    feed_all(n, [planned(1, [entry("0", num=31, start=25, prompt_len=83, total_len=83)], admitted=()), timed(1)])
    feed_all(n, [planned(2, [entry("1", kind="decode", num=1, start=8, total_len=9)], admitted=(),
                         preempted=[queued("0", num_tokens=83, preemptions=1)], waiting=[queued("0")]), timed(2)])
    back = entry("0", num=27, start=56, prompt_len=83, total_len=83, cached=56)
    hit = next(c for c in n.feed(planned(5, [back], running=(queued("0", num_tokens=83, preemptions=1),),
                                         admitted=("0",))) if c.kind == "prefix_cache")
    assert "only the other 27 are computed, none of them computed before its preemption" in hit.text
    pre = next(c for c in n.feed(timed(5, tokens=27)) if c.kind == "prefill")
    assert pre.title == "Request 0: 27 new tokens after its readmission" and "recompute" not in pre.title


def test_preemption_says_blocks_may_come_back_from_the_prefix_cache_and_names_vllms_opposite_priority():
    plan = planned(5, [entry("0", kind="decode", num=1, start=9, total_len=10)],
                   preempted=[queued("1", num_tokens=12, preemptions=1)], waiting=[queued("1")], admitted=())
    pre = next(c for c in fresh().feed(plan) if c.kind == "preemption")
    assert "A running request needed more KV blocks for this step than were free" in pre.text  # a plan without shortfalls
    assert "the blocks still in the prefix cache are reused and only the rest is computed: recomputed where" in pre.text
    assert "often" not in pre.text
    assert "vLLM's is the opposite: lower values run first, and its default policy is fcfs" in pre.text


def test_preemption_says_how_many_blocks_were_needed_and_how_many_were_free():
    """Trial 12: "needed a new KV block ... and none was free" for a chunk that needed 4 with 3 free."""
    chunk = entry("1", num=1, start=8, prompt_len=1, total_len=9, priority=10)
    why = ev.Shortfall(request_id="0", seq_id=0, index=0, blocks_needed=4, blocks_free=3)
    plan = replace(planned(2, [chunk], preempted=[queued("0", num_tokens=83, preemptions=1)], waiting=[queued("0")],
                           admitted=()), shortfalls=(why,))
    pre = next(c for c in fresh().feed(plan) if c.kind == "preemption")
    assert pre.text.startswith("Request 0 needed 4 more KV blocks for this step and only 3 were free, so the "
                               "scheduler preempted request 0 itself"), pre.text
    assert "none was free" not in pre.text
    other = ev.Shortfall(request_id="1", seq_id=1, index=0, blocks_needed=1, blocks_free=0)
    pre = next(c for c in fresh().feed(replace(plan, shortfalls=(other,))) if c.kind == "preemption")
    assert pre.text.startswith("Request 1 needed 1 more KV block for this step and none was free, so the scheduler "
                               "preempted request 0 (priority 0)"), pre.text
    waiting = ev.Shortfall(request_id="1", seq_id=1, index=0, blocks_needed=2, blocks_free=1, waiting=True)
    pre = next(c for c in fresh().feed(replace(plan, shortfalls=(waiting,))) if c.kind == "preemption")
    assert pre.text.startswith("Request 1 (priority 10) was waiting and needed 2 more KV blocks to be admitted, and "
                               "only 1 was free"), pre.text
    assert ev.from_json(ev.to_json(plan)) == plan


def test_a_waiting_high_priority_request_that_preempts_is_named():
    urgent = entry("2", num=5, prompt_len=5, total_len=5, priority=10)
    plan = planned(3, [urgent], preempted=[queued("0", priority=0, num_tokens=9, preemptions=1)],
                   waiting=[queued("0")], admitted=("2",))
    pre = next(c for c in fresh().feed(plan) if c.kind == "preemption")
    assert pre.text.startswith("Request 2 (priority 10) was waiting and too few KV blocks were free for it")  # a sentence (trial 11)


def test_samples_of_one_prompt_share_only_full_blocks_through_the_prefix_cache():
    n = Narrator({**INFO, "block_size": 8})  # a 9-token prompt: one full block to share before the last token's
    n.introduction()
    tok, _ = n.feed(replace(added(ids=tuple(range(9)), pieces=tuple("z" * 9)), n=2))
    assert "the other sample waits until its full prompt blocks are in the prefix cache" in tok.text
    assert "copying it on write" in tok.text
    assert "except the block that holds the prompt's last token, which each sample computes itself" in tok.text
    sibling = replace(entry("0", num=1, start=8, prompt_len=9, total_len=9, cached=8), seq_id=1, index=1)
    out = n.feed(planned(1, [entry("0", kind="decode", num=1, start=9, total_len=10), sibling]))
    hit = next(c for c in out if c.kind == "prefix_cache")
    assert "Sample 1 shares the first 8 of the 9 prompt tokens with sample 0 through the prefix cache" in hit.text
    assert "only full blocks are cached" in hit.text
    n.feed(replace(sampled(1), seq_id=1, index=1))
    dec = next(c for c in n.feed(timed(1)) if c.kind == "decode")
    assert dec.title.startswith("Request 0, sample 1, first token")


def test_waiting_with_chunked_prefill_off_is_not_blamed_on_blocks():
    n = Narrator({**INFO, "chunked_prefill": False})
    n.introduction()
    plan = planned(0, [entry("0", num=20, prompt_len=20, total_len=20)], waiting=[queued("1", num_tokens=40)],
                   max_num_seqs=4)
    (sched,) = n.feed(plan)
    assert "its 40 tokens do not fit the 12 left of the budget, and chunked prefill is off" in sched.text


def test_equal_query_and_kv_heads_are_not_called_grouped():
    (intro,) = Narrator({**INFO, "num_kv_heads": 9}).introduction()
    assert "multi-head attention" in intro.text and "grouped" not in intro.text


@pytest.mark.parametrize("kernel, said", [("sdpa", "never stores the whole score matrix"),
                                          ("flash-attn", "never stores the whole score matrix"),
                                          ("math", "writes the score matrix to memory")])
def test_attention_says_whether_the_kernel_that_ran_stores_the_score_matrix(kernel, said):
    n = Narrator({**INFO, "attention_backend": kernel})  # model_info's names (ModelRunner.attention_kernel)
    n.introduction()
    n.feed(added())
    n.feed(planned(0, [entry()]))
    n.feed(ev.LayerTrace(step=0, request_id="0", layer=0, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         hidden_size=576, kv_bytes_per_token=46080, ops=(), tensors=()))
    att = next(c for c in n.feed(timed(0)) if c.kind == "attention")
    assert said in att.text


def test_a_repetition_penalty_below_1_is_said_to_raise_repeated_tokens():
    n = fresh()
    _, intro = n.feed(added(sampling=(("temperature", 0.0), ("repetition_penalty", 0.8))))
    assert "repetition penalty 0.8 raises every token already in the prompt" in intro.text


def test_the_model_entry_names_block_weights_and_not_float_ones():
    plain = Narrator(INFO).feed(added())[0].text
    assert "GGUF blocks" not in plain and f"costs {INFO['kv_bytes_per_token']:,} bytes; the pool" in plain
    gguf = {**INFO, "quantization": "gguf", "weight_format": "q4_1 66 MB + q8_0 30 MB (96 MB of weights)"}
    text = Narrator(gguf).feed(added())[0].text
    assert "in float32, weights kept in GGUF blocks as q4_1 66 MB + q8_0 30 MB (96 MB of weights):" in text


def test_the_dashboards_top_predictions_caption_names_every_processor_and_marks_a_special_token():
    import io

    from rich.console import Console

    from nanovllm_core.educational.dashboard_view import DashboardView

    console = Console(file=io.StringIO(), width=140)
    view = DashboardView(console, INFO)
    view(added(sampling=(("temperature", 0.9), ("top_k", 20), ("top_p", 0.9))))
    top = ((7042, " Paris", 0.6), (260, " the", 0.4))
    view(sampled(0, greedy=False, temperature=0.9, top=top))
    console.print(view.render())
    out = " ".join(console.file.getvalue().split())
    assert "probabilities after temperature 0.9, top-k 20 and top-p 0.9, renormalised" in out
    end = replace(sampled(1, token=2, text="", n_out=2, top=((2, "<|im_end|>", 0.9), (28, ",", 0.1))),
                  special="<|im_end|>")
    view(end)
    assert view.top_chosen == "<|im_end|>"


def test_a_lone_decode_step_says_what_share_of_the_measured_bandwidth_its_weights_took():
    """Weight bytes / step time against the measured bandwidth, recomputed here; only for a step of one token."""
    weights, bw, wall = 96_000_000, 8e9, 0.030  # reading them takes 12 ms at 8 GB/s
    n = Narrator({**INFO, "linear_weight_bytes": weights, "memory_bandwidth": bw}, kv_every_step=False)
    n.feed(added())
    n.feed(planned(0, [entry()]))
    n.feed(sampled(0))
    n.feed(timed(0))
    n.feed(planned(1, [entry(kind="decode", num=1, start=3, total_len=4)]))
    n.feed(sampled(1, n_out=2))
    dec = next(c for c in n.feed(timed(1, wall=wall, tokens=1)) if c.kind == "decode")
    assert f"at {weights / wall / 1e9:,.2f} GB/s, {weights / wall / bw:.0%} of this machine's measured 8.0 GB/s" \
        in dec.text  # 3.20 GB/s, 40%
    assert "reading them at 8.0 GB/s takes 12.0 ms, so the other 18.0 ms of the step" in dec.text
    assert "busy" not in dec.text
    # A bandwidth measured while the host was busy says so where the share rests on it.
    busy = Narrator({**INFO, "linear_weight_bytes": weights, "memory_bandwidth": bw, "machine": "a CPU (2 threads), "
                     "float32; measured while the host was busy (its threads got 24% of their cores)"})
    for e in (added(), planned(0, [entry()]), sampled(0), timed(0),
              planned(1, [entry(kind="decode", num=1, start=3, total_len=4)]), sampled(1, n_out=2)):
        busy.feed(e)
    dec = next(c for c in busy.feed(timed(1, wall=wall, tokens=1)) if c.kind == "decode")
    assert "of this machine's measured 8.0 GB/s (measured while the host was busy, so likely low):" in dec.text
    n2 = Narrator({**INFO, "linear_weight_bytes": weights, "memory_bandwidth": bw})
    n2.feed(added())
    n2.feed(planned(0, [entry()]))
    n2.feed(sampled(0))
    n2.feed(timed(0))
    n2.feed(planned(1, [entry(kind="decode", num=1, start=3, total_len=4)]))
    n2.feed(sampled(1, n_out=2))
    dec = next(c for c in n2.feed(timed(1, wall=wall, tokens=2)) if c.kind == "decode")  # shared with another token
    assert "GB/s" not in dec.text


def test_a_step_the_xray_traced_names_the_capture_in_its_time_and_tells_no_rate_over_it():
    """Trial 12: a traced decode step of 1.3 s was put down to "norms, RoPE, attention..." beside 56 ms
    untraced ones; the capture ran inside the step and is named, and no bandwidth or prefill rate is told."""
    weights, bw = 96_000_000, 8e9
    n = Narrator({**INFO, "linear_weight_bytes": weights, "memory_bandwidth": bw}, kv_every_step=False)
    n.feed(added())
    n.feed(planned(0, [entry()]))
    n.feed(sampled(0))
    pre = next(c for c in n.feed(replace(timed(0, wall=1.2), traced=True)) if c.kind == "prefill")
    assert "with the X-Ray's capture of its layers inside it, so not the engine's own prefill rate" in pre.text
    assert "a prefill rate of" not in pre.text
    n.feed(planned(1, [entry(kind="decode", num=1, start=3, total_len=4)]))
    n.feed(sampled(1, n_out=2))
    dec = next(c for c in n.feed(replace(timed(1, wall=1.3, tokens=1), traced=True)) if c.kind == "decode")
    assert "The step took 1.3 s. That time includes the X-Ray's capture of this step's layers" in dec.text
    assert "norms, RoPE" not in dec.text and "GB/s" not in dec.text
    assert "No weight-reading rate is told for this step: the X-Ray's capture is in its time" in dec.text
    assert ev.from_json(ev.to_json(replace(timed(1), traced=True))).traced
    assert not ev.from_json(ev.to_json(timed(1)).replace(',"traced":false', "")).traced  # older recordings


def test_grouped_score_shape_is_explained_from_its_numbers():
    """Trial 7: Q [5, 9, 64], K [5, 3, 64] and then scores [3, 15, 5] with no word of why; a learner expects
    [9, 5, 5]. The entry names each axis of the grouped layout, with the numbers of this trace."""
    n = fresh()
    n.feed(added(ids=(1, 2, 3, 4, 5), pieces=("a", "b", "c", "d", "e")))
    n.feed(planned(0, [entry(num=5, prompt_len=5, total_len=5)]))
    trace = ev.LayerTrace(step=0, request_id="0", layer=0, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          hidden_size=576, kv_bytes_per_token=46080, ops=(),
                          tensors=(ev.TensorInfo("token_embeddings", (5, 576), (0.5,)), ev.TensorInfo("q", (5, 9, 64), ()),
                                   ev.TensorInfo("k", (5, 3, 64), ()), ev.TensorInfo("scores", (3, 15, 5), ())))
    n.feed(trace)
    att = next(c for c in n.feed(timed(0, tokens=5)) if c.kind == "attention")
    assert "[3, 15, 5], [KV head, its 3 query heads x 5 tokens, 5 keys]" in att.text
    assert "3 x 5 = 15 rows" in att.text and "not [9, 5, 5]" in att.text


def test_long_times_are_told_in_seconds_and_short_ones_in_milliseconds():
    """Newcomer trial (issue 29): "Time to first token 178924.0 ms" is hard to read; from 1 s up it is seconds."""
    import dataclasses

    from nanovllm_core.educational.commentary import ms

    assert (ms(0.0421), ms(0.9994), ms(0.99996), ms(1.0), ms(178.924), ms(3725.0), ms(None)) == (
        "42.1 ms", "999.4 ms", "1.0 s", "1.0 s", "178.9 s", "3,725.0 s", "n/a")
    assert ms(0.00123, digits=2) == "1.23 ms"
    n = fresh()
    n.feed(added())
    slow = dataclasses.replace(finished(), ttft_s=178.924, tpot_s=10.9849, e2e_s=200.8943)
    (end,) = n.feed(slow)
    assert "Time to first token 178.9 s, time per output token 11.0 s, end to end 200.9 s." in end.text, end.text
    n.feed(added(rid="1"))
    (end,) = n.feed(finished(rid="1"))  # below 1 s: milliseconds, as before
    assert "Time to first token 50.0 ms, time per output token 20.0 ms, end to end 70.0 ms." in end.text, end.text


def test_a_prompts_last_token_with_drafts_is_told_as_the_last_chunk_and_drafts_not_as_a_recompute():
    """Trial 10: a chunk left only the prompt's last token, which ran with 3 n-gram drafts (kind
    prefill, 1 + 3 tokens, total_len counting the drafts); nothing was preempted or recomputed."""
    pieces = tuple(f" w{i}" for i in range(9))
    n = fresh()
    n.feed(added(ids=tuple(range(100, 109)), pieces=pieces))
    first = entry(num=8, prompt_len=9, total_len=9)
    feed_all(n, [planned(0, [first], budget=8), timed(0, tokens=8)])
    last = replace(entry(num=4, start=8, prompt_len=9, total_len=12), num_spec_tokens=3)
    out = feed_all(n, [planned(1, [last], admitted=(), budget=8), spec(accepted=(True, True, True))]
                   + [sampled(1, token=5 + i, text=" x", n_out=1 + i, top=()) for i in range(4)]
                   + [timed(1, tokens=4)])
    text = " ".join(c.title + " " + c.text for c in out)
    assert "recompute" not in text and "preempted" not in text and "generated" not in text, text
    (chunk,) = [c for c in out if c.kind == "chunked_prefill"]
    assert chunk.title == "Request 0: prefill chunk 8..8 of 9, then 3 drafts"
    assert "last chunk of request 0's 9-token prompt: token 8 through" in chunk.text
    assert "Its keys and values, 46,080 bytes" in chunk.text and "3 drafted tokens in the same pass" in chunk.text
    tokens = [c.title for c in out if c.kind == "decode"]
    assert tokens[0].startswith("Request 0, first token, from the prefill") and "token #2: " in tokens[1], tokens


def test_the_scheduler_entry_counts_a_prompts_last_token_apart_from_its_drafts():
    n = fresh()
    n.feed(added(ids=tuple(range(100, 109)), pieces=tuple(f" w{i}" for i in range(9))))
    feed_all(n, [planned(0, [entry(num=8, prompt_len=9, total_len=9)], budget=8,
                         waiting=(queued("1", num_tokens=1),)), timed(0, tokens=8)])
    last = replace(entry(num=4, start=8, prompt_len=9, total_len=12), num_spec_tokens=3)
    other = entry(rid="1", num=1, prompt_len=1, total_len=1)
    (sched,) = [c for c in n.feed(planned(1, [last, other], admitted=("1",), budget=8)) if c.kind == "scheduler"]
    assert ("request 0: prefill chunk of 1 token (token 8 of 9) and 3 draft tokens after it, 4 tokens; "
            "request 1: prefill of 1 token, newly admitted") in sched.text, sched.text


def test_a_block_reserved_for_drafts_that_never_came_is_explained_in_the_kv_entry():
    """Trial 10: 14 tokens in blocks [0, 2] with 18 slots empty, unexplained. Step 7 reserved slots for
    the newest token and 4 drafts (positions 13..17, a second block); the proposer drafted none."""
    n = fresh()
    n.feed(added(max_tokens=20))
    n.feed(planned(7, [replace(entry(kind="decode", num=1, start=13, total_len=14), num_spec_tokens=4)],
                   admitted=()))
    n.feed(sampled(7, n_out=11))
    n.feed(ev.BlocksChanged(step=7, block_size=16, bytes_per_block=737280, states="uuf", ref_counts=(1, 0, 1),
                            tables=(ev.SeqBlocks("0", 0, 0, (0, 2), 15, 14),)))
    kv = next(c for c in n.feed(timed(7, tokens=1, blocks=2, total=3, per_block=737280)) if c.kind == "kv_cache")
    assert ("keeps 14 tokens in blocks [0, 2] (18 slots still empty; block 2 holds none of its tokens yet: before "
            "step 7 the scheduler reserved slots for 1 + 4 tokens, positions 13..17, the newest and up to 4 drafts, "
            "and took it before block 0 was full; the proposer drafted none") in kv.text, kv.text


def test_a_block_table_without_blocks_ahead_of_its_tokens_gets_no_reservation_clause():
    n = fresh()
    n.feed(added(max_tokens=20))
    n.feed(planned(7, [replace(entry(kind="decode", num=5, start=13, total_len=18), num_spec_tokens=4)],
                   admitted=()))
    n.feed(ev.BlocksChanged(step=7, block_size=16, bytes_per_block=737280, states="uff", ref_counts=(1, 0, 0),
                            tables=(ev.SeqBlocks("0", 0, 0, (0,), 16, 15),)))
    kv = next(c for c in n.feed(timed(7, tokens=5, blocks=1, total=3, per_block=737280)) if c.kind == "kv_cache")
    assert "keeps 15 tokens in blocks [0] (1 slot still empty)." in kv.text and "reserved slots" not in kv.text


def test_a_prefix_hit_that_stops_before_the_last_tokens_full_block_names_that_block():
    """Trial 10: 'found its first 16 of 32 tokens' read as if only one block was cached; a hit never
    includes the full block holding the prompt's last token, cached or not."""
    (hit,) = fresh().feed(planned(3, [entry("1", num=16, start=16, prompt_len=32, total_len=32, cached=16)]))
    assert hit.text.endswith("only the other 16 are computed; the block holding the last token (tokens 16..31) is "
                             "never a hit, even when the cache holds it: sampling needs that token's scores, so it "
                             "is computed here."), hit.text
    # a partial last block (40 = 2 x 16 + 8) is never cached: nothing to explain; a hit that stopped early neither
    (partial,) = fresh().feed(planned(3, [entry("1", num=8, start=32, prompt_len=40, total_len=40, cached=32)]))
    (early,) = fresh().feed(planned(3, [entry("1", num=32, start=16, prompt_len=48, total_len=48, cached=16)]))
    assert "never a hit" not in partial.text and "never a hit" not in early.text


def test_the_stop_rule_lists_alternatives_with_or():
    """Trial 10: 'It stops at an end-of-sequence token and a stop string ('United') or after 20 tokens'."""
    from nanovllm_core.educational.narrator_sampling import sampling_intro

    greedy = sampling_intro("request 0", "0", {"temperature": 0.0, "stop": ("United",)}, 20).text
    assert "It stops at an end-of-sequence token, at a stop string ('United') or after 20 tokens." in greedy
    plain = sampling_intro("request 0", "0", {"temperature": 0.0}, 4).text
    assert "It stops at an end-of-sequence token or after 4 tokens." in plain
    no_eos = sampling_intro("request 0", "0", {"temperature": 0.0, "ignore_eos": True}, 4).text
    assert "It stops after 4 tokens." in no_eos


def test_speculative_verifications_past_the_decode_cap_are_summed_up_not_told():
    """Trial 10: with --narrate-steps 2 every later SPECULATIVE DECODING entry was still printed
    while FINISHED said the tokens were not narrated one by one."""
    n = fresh(max_decode_steps_per_request=1)
    n.feed(added(sampling=(("temperature", 0.0),), max_tokens=20))
    feed_all(n, [planned(0, [entry()]), sampled(0), timed(0)])
    told = []
    for step, start in ((1, 3), (2, 6)):
        n.feed(planned(step, [replace(entry(kind="decode", num=4, start=start, total_len=start + 4),
                                      num_spec_tokens=3)], admitted=()))
        n.feed(spec(step=step, accepted=(True, True, False)))
        for i in range(3):
            n.feed(sampled(step, token=5 + i, text=" x", n_out=2 + 3 * (step - 1) + i, top=()))
        told += n.feed(timed(step, tokens=4))
    told += n.feed(finished(n_out=7, step=2))
    assert kinds(told).count("speculative") == 0 and kinds(told).count("decode") == 0
    (end,) = [c for c in told if c.kind == "finished"]
    assert "6 of its tokens were not narrated one by one, nor 2 later speculative verifications." in end.text, end.text


def test_a_chat_message_is_told_as_the_users_text_through_the_chat_template_not_as_token_ids():
    """Trial 10: the app's chat mode sent 'Hi' and the narrator said 'The prompt (given as token ids)'."""
    ids, pieces = (1, 9690, 198, 22557, 2), ("<|im_start|>", "user", "\n", "Hi", "<|im_end|>")
    chat = ev.RequestAdded(request_id="0", prompt=None, prompt_token_ids=ids, prompt_pieces=pieces, priority=0,
                           max_tokens=4, chat=(("user", "Hi"),))
    (tok, _) = fresh().feed(chat)
    assert tok.text.startswith("The user's message 'Hi', put through the model's chat template, becomes 5 tokens:")
    assert "given as token ids" not in tok.text and "marks a space" not in tok.text  # no piece has a space
    (two, _) = fresh().feed(replace(chat, chat=(("system", "Be brief."), ("user", "Hi"))))
    assert two.text.startswith("The conversation of 2 messages (the last, the user's: 'Hi'), put through")
    (raw, _) = fresh().feed(replace(chat, chat=()))
    assert raw.text.startswith("The prompt (given as token ids) becomes 5 tokens")
    (spaced, _) = fresh().feed(added())
    assert "(␣ marks a space.)" in spaced.text


def test_the_engine_says_a_request_came_as_a_chat(make_tiny_engine):
    engine = make_tiny_engine()
    seen = []
    engine.subscribe(lambda e: seen.append(e) if isinstance(e, ev.RequestAdded) else None)
    try:
        engine.add_request([{"role": "user", "content": "Hi"}])
    except ValueError as e:  # the tiny tokenizer may lack a chat template
        pytest.skip(str(e))
    engine.add_request("Hi")
    assert [e.chat for e in seen] == [(("user", "Hi"),), ()] and seen[0].prompt is None


@pytest.mark.parametrize("sampling,greedy,caption", [
    ((("temperature", 0.8), ("top_k", 5), ("top_p", 0.9)), False,
     "the target's probability p of each draft, after temperature 0.8, top-k 5 and top-p 0.9, renormalised"),
    ((("temperature", 0.0), ("repetition_penalty", 1.3)), True,
     "the target's probability p of each draft, after repetition penalty 1.3"),
    ((("temperature", 0.0),), True, "the target's probability p of each draft (its own probabilities)"),
])
def test_a_verifications_table_of_p_names_every_processor_behind_it(sampling, greedy, caption):
    """Trial 11: under temperature 0.8, top-k 5 and top-p 0.9 the table read "the target's probability
    p of each draft" beside 100.0% figures that were the processed, renormalised distribution's."""
    out = spec_step(sampling, spec(greedy=greedy, num_query_tokens=4))
    (v,) = [c for c in out if c.kind == "speculative"]
    assert v.table_title == caption


def test_end_to_end_says_how_much_of_it_the_engine_was_held_paused():
    """Trial 11: "TTFT 3.3 s, TPOT 125.1 ms, end to end 40.6 s": the 34 s held paused were in e2e only."""
    n = fresh()
    n.feed(added())
    held = replace(finished(), e2e_s=40.6, paused_s=33.7)
    (done,) = [c for c in n.feed(held) if c.kind == "finished"]
    assert ("end to end 40.6 s (wall time, 33.7 s of it with the engine held paused, which TTFT and TPOT leave out)."
            in done.text)
    (plain,) = [c for c in fresh().feed(finished()) if c.kind == "finished"]
    assert "end to end 70.0 ms." in plain.text and "paused" not in plain.text


def test_a_rejection_is_told_as_a_sentence():
    """Trial 11: the rejected entry was the engine's raw line, lower case and without a full stop."""
    (note,) = fresh().feed(ev.RequestRejected(request_id="3", reason="the prompt is empty"))
    assert note.kind == "rejected" and note.text == "The prompt is empty."
    (kept,) = fresh().feed(ev.RequestRejected(request_id="4", reason="Already a sentence."))
    assert kept.text == "Already a sentence."


def test_an_abort_tells_which_blocks_went_back_and_which_a_shared_prefix_keeps():
    """Trial 12: "its blocks are free" while block 0 stayed with request 1; the narrator said nothing of KV."""
    n = fresh()
    pool = ev.BlocksChanged(step=3, block_size=16, bytes_per_block=737280, states="uuuuff",
                            ref_counts=(2, 1, 1, 1, 0, 0),
                            tables=(ev.SeqBlocks("1", 1, 0, (0, 1), 20, 19), ev.SeqBlocks("0", 0, 0, (0, 2, 3), 40, 39)))
    n.feed(pool)
    done = next(c for c in n.feed(replace(finished("0"), finish_reason="abort")) if c.kind == "finished")
    assert ("Its 3 KV blocks [0, 2, 3] were released at once: 1 block [0] is shared with another request through "
            "the prefix cache and stays in use by it, the other 2 went back to the pool") in done.text, done.text
    alone = next(c for c in n.feed(replace(finished("1"), finish_reason="abort")) if c.kind == "finished")
    assert "Its 2 KV blocks [0, 1] were released at once: all went back to the pool" in alone.text  # ref 2 = 1 + req 0
    # trial 19a: a full block duplicating another's tokens (the same prefix prefilled in one step) went back
    # empty while the sentence said every full block keeps its contents as cached-free
    assert "unless another block already holds the same tokens: then it is simply freed" in alone.text
    waiting = next(c for c in n.feed(replace(finished("5"), finish_reason="abort")) if c.kind == "finished")
    assert "It held no KV blocks (it was waiting)" in waiting.text


# ------------------------------------------------------------------ trial 14c #2: cached tokens, one definition


@pytest.mark.parametrize("first,again,preemptions,told,not_told", [
    # the report's case: the Dashboard showed 16, the finish said "8 of its 32 prompt tokens" and stopped
    (8, 16, 1, ["At its first admission 8 of its 32 prompt tokens came from the prefix cache; after its preemption, "
                "its readmission found 16 tokens there (all of them prompt tokens)."], ["generated"]),
    # trial 17b #2: only a hit longer than the prompt holds generated tokens, and the sentence says how many
    (8, 40, 1, ["its readmission found 40 tokens there (32 prompt + 8 generated)."], ["alike"]),
    (0, 1, 1, ["its readmission found 1 token there (a prompt token)."], ["generated"]),
    (0, 16, 2, ["At its first admission none of its 32 prompt tokens were in the prefix cache; after its preemption, "
                "the readmission that found the most found 16 tokens there"], []),
    (8, 0, 1, ["8 of its 32 prompt tokens came from the prefix cache; after its preemption, its readmission found "
               "none there."], []),
    (8, None, 0, [" 8 of its 32 prompt tokens came from the prefix cache."], ["admission", "readmission"]),
    (8, None, 1, ["8 of its 32 prompt tokens came from the prefix cache at its first admission."], ["readmission"]),
    (0, 0, 1, [], ["prefix cache"]),
])
def test_a_finish_tells_the_first_admissions_and_a_readmissions_cached_tokens_apart(first, again, preemptions, told,
                                                                                     not_told):
    e = replace(finished(), num_prompt_tokens=32, num_preemptions=preemptions, num_cached_prompt_tokens=first,
                num_cached_tokens_readmitted=again)
    (c,) = [c for c in feed_all(fresh(), [e]) if c.kind == "finished"]
    for text in told:
        assert text in c.text
    for text in not_told:
        assert text not in c.text



# ------------------------------------------------------------------ trial 14c #3: why a step had fewer drafts


@pytest.mark.parametrize("limits,slots,drafts,told", [
    (("kv_blocks",), 0, 0, "this step reserved no draft slot for it, held down by the free KV slots (drafts get only "
                           "the blocks still free once every running request's own tokens have theirs"),
    (("budget",), 0, 0, "held down by the step's token budget (a token is kept for each running request served "
                        "after it)"),
    (("max_model_len",), 0, 0, "held down by the model's length limit, max_model_len"),
    (("proposer",), 3, 0, "the ngram proposer found no earlier occurrence of the sequence's last tokens"),
    (("proposer", "min_tokens"), 3, 0, "the n-gram proposer proposes what followed the latest earlier occurrence of "
                                       "the sequence's last tokens, and fewer followed it and a drafted token was one "
                                       "the request may not produce yet (min_tokens"),
    (("kv_blocks", "failed_step"), 0, 0, "the free KV slots (drafts get only the blocks still free once every "
                                         "running request's own tokens have theirs, and never take one by "
                                         "preemption); the step's batched forward pass failed"),
])
def test_a_decode_without_drafts_says_why_from_the_engines_reasons(limits, slots, drafts, told):
    info = {**INFO, "speculative_model": "ngram", "num_speculative_tokens": 4}
    s = replace(entry(kind="decode", num=1, start=3, total_len=4), max_drafts=4, num_spec_tokens=slots,
                draft_limits=limits)
    n = Narrator(info)
    n.introduction()
    out = feed_all(n, [added(), planned(1, [s], waiting=(queued("1"),), admitted=()),
                       sampled(1, n_out=2), timed(1, tokens=1)])
    (decode,) = [c for c in out if c.kind == "decode"]
    assert "It ran without drafts. Speculative decoding verifies up to 4 drafts a step; " in decode.text
    assert told.replace("ngram proposer", "n-gram proposer") in decode.text
    (plan,) = [c for c in out if c.kind == "scheduler"]
    assert "request 0: decode, 1 token (no drafts, limited by " in plan.text


def test_a_decode_with_all_its_drafts_or_without_the_engines_reasons_says_nothing_of_them():
    for s in (replace(entry(kind="decode", num=1, start=3, total_len=4), max_drafts=0),  # no speculation
              replace(entry(kind="decode", num=1, start=3, total_len=4), max_drafts=4, num_spec_tokens=4)):  # old trace
        out = feed_all(fresh(), [added(), planned(1, [s]), sampled(1, n_out=2), timed(1, tokens=1)])
        assert not any("without drafts" in c.text or "limited by" in c.text for c in out)


def test_a_verification_with_fewer_drafts_than_k_says_why():
    s = replace(entry(kind="decode", num=3, start=3, total_len=6), max_drafts=4, num_spec_tokens=2,
                draft_limits=("max_tokens",))
    v = ev.SpecDecodeStep(step=1, request_id="0", seq_id=0, proposer="ngram", draft_tokens=(5, 6),
                          draft_texts=(" a", " b"), p=(0.9, 0.8), q=(1.0, 1.0), accepted=(True, True), bonus_token=7,
                          bonus_text=" c", greedy=True, num_query_tokens=3)
    out = feed_all(fresh(), [added(), planned(1, [s]), v, sampled(1, n_out=2), timed(1, tokens=3)])
    (spec,) = [c for c in out if c.kind == "speculative"]
    assert ("Speculative decoding verifies up to 4 drafts a step; this step reserved slots for 2 drafts for it, held "
            "down by its max_tokens (a draft gets a slot only if it could be kept).") in spec.text


# ------------------------------------------------------------------ trial 14c #4: every step a request waits


def test_every_step_in_which_a_request_keeps_waiting_says_so():
    """Steps 1..3 of a chunked 32-token prompt gave the whole budget of 8 to it while request 1 waited:
    only step 0 said so."""
    n = fresh()
    n.feed(added("0", ids=tuple(range(32)), pieces=tuple("x" * 32)))
    n.feed(added("1"))
    told = []
    for step in range(4):
        chunk = entry("0", num=8, start=8 * step, prompt_len=32, total_len=32)
        plan = replace(planned(step, [chunk], waiting=(queued("1"),), admitted=("0",) if step == 0 else (),
                               budget=8, max_num_seqs=4), wait_reason="budget")
        told.append([c for c in n.feed(plan) if c.kind == "scheduler"])
        n.feed(timed(step, tokens=8))
    assert "Waiting: request 1 (the step's token budget of 8 is used up)" in told[0][0].text
    for step, entries in enumerate(told[1:], 1):
        (c,) = entries
        assert (c.title, c.text) == (f"Step {step}: request 1 keeps waiting",
                                     "Request 1 keeps waiting (the step's token budget of 8 is used up).")


def test_a_running_request_that_again_gets_no_token_is_told_each_step():
    n = fresh()
    for rid in "01":
        n.feed(added(rid))
    running = (queued("0"), queued("1"))
    told = []
    for step in range(2):
        plan = planned(step, [entry("0", num=8, start=8 * step, prompt_len=40, total_len=40)], running=running,
                       admitted=(), budget=8, max_num_seqs=4)
        told.append([c for c in n.feed(plan) if c.kind == "scheduler"])
    assert "Request 1 is running but got no token" in told[0][0].text
    (c,) = told[1]
    assert c.title == "Step 1: request 1 again got no token"
    assert c.text == "Request 1 is running but again got no token (the budget was used up before its turn)."


@pytest.mark.parametrize("wait_reason", ["budget", ""])
def test_a_budget_taken_by_draft_slots_the_proposer_left_empty_is_still_used_up(wait_reason):
    """The plan's tokens (1: the proposer drafted none) are fewer than the budget its 1 + 4 slots took:
    "not enough free KV blocks" was said. The engine's reason decides; an older trace counts the slots."""
    s = replace(entry("0", kind="decode", num=1, start=3, total_len=4), num_spec_tokens=4, max_drafts=4,
                draft_limits=("proposer",))
    plan = replace(planned(1, [s], waiting=(queued("1"),), admitted=(), budget=5, max_num_seqs=4),
                   wait_reason=wait_reason)
    (sched,) = [c for c in fresh().feed(plan) if c.kind == "scheduler"]
    assert ("Waiting: request 1 (the step's token budget of 5 is used up, counting 4 draft slots of request 0 "
            "reserved before the proposer ran and left empty)") in sched.text  # spent: 1 of 5 (trial 24d #1)


def test_a_reservation_waiting_for_adjacent_blocks_says_so():
    """Trial 21a bug 1: the contiguous baseline's head can wait with enough blocks free in all, none side by side."""
    n = fresh()
    n.feed(added("0"))
    n.feed(added("1"))
    plan = replace(planned(3, [entry("0", kind="decode", num=1, start=3, total_len=4)], waiting=(queued("1"),),
                           admitted=(), budget=64, max_num_seqs=4), wait_reason="kv_run", wait_blocks=(4, 3, 2))
    (sched,) = [c for c in n.feed(plan) if c.kind == "scheduler"]
    assert "4 KV blocks are free in all but no run of 3 adjacent ones (the longest is 2)" in sched.text
    assert "external fragmentation" in sched.text


def test_the_scheduler_line_of_a_readmission_counts_recomputed_and_new_tokens_as_the_entries_below():
    """Trial 21a bug 2: the scheduler line said "recompute of 9 tokens (0..8 of 9)" while the entries below
    said 8 recomputed and 1 computed for the first time (the newest sampled token never had KV)."""
    n = fresh()
    n.feed(added("0"))
    n.feed(added("1", ids=tuple(range(7)), pieces=tuple("y" * 7)))
    feed_all(n, [planned(7, [entry("1", kind="decode", num=1, start=7, prompt_len=7, total_len=8)], admitted=()),
                 sampled(7, rid="1", token=8, text=" w", n_out=1), timed(7)])
    feed_all(n, [planned(8, [entry("0", kind="decode", num=1, start=9, total_len=10)], admitted=(),
                         preempted=[queued("1", num_tokens=9, preemptions=1)], waiting=[queued("1")]), timed(8)])
    back = entry("1", num=9, start=0, prompt_len=7, total_len=9)
    plan = planned(9, [entry("0", kind="decode", num=1, start=10, total_len=11), back],
                   running=(queued("0"), queued("1", num_tokens=9, preemptions=1)), admitted=("1",))
    (sched,) = [c for c in n.feed(plan) if c.kind == "scheduler"]
    assert "request 1: 9 tokens (0..8 of 9): 8 recomputed, 1 new, readmitted after preemption" in sched.text
    assert "recompute of 9" not in sched.text


@pytest.mark.parametrize("backend, exact", [("cpu-paged", True), ("math", False), ("sdpa", False), ("flash-attn", False)])
def test_greedy_verification_claims_bit_equal_text_only_on_the_exact_kernel(backend, exact):
    """Trial 24c: on the PyTorch attention paths a verification scores its k + 1 positions in other matrix
    shapes than one-at-a-time decodes (equal up to float rounding), so "exactly what greedy decoding
    without speculation gives" is said only of the default CPU C kernel."""
    n = fresh()
    n.info["attention_backend"] = backend
    n.feed(added(sampling=(("temperature", 0.0),)))
    feed_all(n, [planned(0, [entry()]), sampled(0), timed(0)])
    n.feed(planned(1, [entry(kind="decode", num=4, start=3, total_len=4)], admitted=()))
    n.feed(spec())
    out = feed_all(n, [sampled(1, token=5 + i, text=" x", n_out=2 + i, top=()) for i in range(2)] + [timed(1, tokens=4)])
    (v,) = [c for c in out if c.kind == "speculative"]
    assert ("exactly what greedy decoding without speculation gives" in v.text) is exact, v.text
    assert ("up to float rounding" in v.text and f"({backend})" in v.text) is not exact, v.text


def test_a_budget_used_up_by_unfilled_draft_slots_says_so():
    """Trial 24d #1's kind: request 0 reserved 1 + 4 of a 5-token budget before the proposer ran and drafted 1;
    'the budget is used up' beside 'spends 2 of its 5' must name the 3 empty slots."""
    n = fresh()
    feed_all(n, [added(), added(rid="1")])
    dec = replace(entry(kind="decode", num=2, start=3, total_len=5), num_spec_tokens=4, max_drafts=4,
                  draft_limits=("proposer",), budget_left=5, plan_order=0)
    told = n.feed(planned(1, [dec], waiting=(queued("1"),), admitted=(), budget=5))
    (line,) = [c for c in told if c.kind == "scheduler"]
    assert "spends 2 of its 5-token budget (it had planned 5: 3 draft slots of request 0" in line.text, line.text
    assert ("the step's token budget of 5 is used up, counting 3 draft slots of request 0 reserved before the "
            "proposer ran and left empty") in line.text, line.text


def _budget_held_drafts(later: bool):
    """Request 0 decodes with 1 + k=4 wanted and a 4-token budget; ``later``: request 1 decodes after it."""
    n = fresh()
    feed_all(n, [added(), added(rid="1")])
    drafts = 2 if later else 3
    dec = replace(entry(kind="decode", num=1 + drafts, start=3, total_len=4 + drafts), num_spec_tokens=drafts,
                  max_drafts=4, draft_limits=("budget",), budget_left=4, plan_order=0)
    scheduled = [dec]
    if later:
        scheduled.append(replace(entry("1", kind="decode", num=1, start=3, total_len=4), budget_left=1, plan_order=1))
    n.feed(planned(1, scheduled, waiting=() if later else (queued("1"),), admitted=(), budget=4))
    v = ev.SpecDecodeStep(step=1, request_id="0", seq_id=0, proposer="ngram", draft_tokens=(5, 6, 7)[:drafts],
                          draft_texts=(" a", " b", " c")[:drafts], p=(0.9, 0.8, 0.7)[:drafts],
                          q=(1.0, 1.0, 1.0)[:drafts], accepted=(True,) * drafts, bonus_token=11, bonus_text=" d",
                          greedy=True, num_query_tokens=1 + drafts)
    out = feed_all(n, [v] + [sampled(1, token=5 + i, text=" x", n_out=2 + i, top=()) for i in range(drafts + 1)]
                   + [timed(1, tokens=1 + drafts + later)])
    (told,) = [c for c in out if c.kind == "speculative"]
    return told.text


def test_a_budget_limit_on_draft_slots_gives_this_steps_figures():
    """Trial 25c #2: 'a token is kept for each running request served after it' was told where none was
    served after it; the slots were the budget less the sequence's own token. The reason is the step's own."""
    alone = _budget_held_drafts(later=False)
    assert ("held down by the step's token budget of 4: 1 went to its newest token, which left 3.") in alone, alone
    assert "served after it" not in alone
    beside = _budget_held_drafts(later=True)
    assert ("held down by the step's token budget of 4: 1 went to its newest token and 1 was kept for the running "
            "request served after it (a token each, request 1), which left 2.") in beside, beside


def test_the_budget_others_took_counts_their_empty_draft_slots_in_every_entry_of_the_step():
    """Trial 25c #3: request 0 reserved 1 + 4 of a 12-token budget and ran 2; request 1's last chunk (3) said
    '6 of them taken by other sequences' (tokens run) while request 2's said 'request 0 had 5' (reserved), leaving
    3 tokens unexplained. Both count what was reserved, and name the empty slots."""
    n = fresh()
    feed_all(n, [added(), added("1", ids=tuple(range(9)), pieces=tuple("y" * 9)),
                 added("2", ids=tuple(range(10)), pieces=tuple("z" * 10))])
    dec = replace(entry(kind="decode", num=2, start=3, total_len=5), num_spec_tokens=4, max_drafts=4,
                  draft_limits=("proposer",), budget_left=12, plan_order=0)
    last = replace(entry("1", num=3, start=6, prompt_len=9, total_len=9), budget_left=7, plan_order=1)
    new = replace(entry("2", num=4, start=0, prompt_len=10, total_len=10), budget_left=4, plan_order=2)
    n.feed(planned(3, [dec, last, new], admitted=("2",), budget=12, max_num_seqs=3))
    out = n.feed(timed(3, tokens=9))
    told = {c.request_id: c.text for c in out if c.kind == "chunked_prefill"}
    assert ("The step's budget is 12 tokens, 9 of them taken by other sequences, counting 3 draft slots of request 0 "
            "reserved before the proposer ran and left empty.") in told["1"], told["1"]
    assert "only 4 of them were left when request 2's turn came: request 0 had 5" in told["2"], told["2"]


def test_a_kv_entry_without_a_block_snapshot_says_so():
    """Trial 25c: the app's Narrator told some steps' KV cache without the bytes the tokens store or the
    block tables (the snapshot was not asked for, or a later step's had replaced it), saying nothing of why."""
    n = fresh()
    n.feed(added())
    out = feed_all(n, [planned(0, [entry()]), sampled(0), timed(0)])
    (kv,) = [c for c in out if c.kind == "kv_cache"]
    assert "No snapshot of the block tables came with this step" in kv.text, kv.text
    assert "Their tokens store" not in kv.text


def test_a_preemption_in_the_middle_of_a_prefill_tells_the_prompt_tokens_it_never_computed():
    """Trial 29e: chapter 11's demo preempted a request that had prefilled 56 of its 83 prompt tokens, and the
    entry said it kept "its 83 tokens (prompt and generated)" and would compute "its newest token at least"
    for the first time: it had generated nothing, and what it never computed was prompt tokens 56..82."""
    n = fresh()
    n.feed(added("0", ids=tuple(range(8)), pieces=tuple("x" * 8)))
    feed_all(n, [planned(0, [entry("0", num=5, start=0, prompt_len=8, total_len=8)]), timed(0, tokens=5)])
    told = n.feed(planned(1, [], preempted=[queued("0", num_tokens=8, preemptions=1)], waiting=[queued("0")],
                          running=(), admitted=()))
    (pre,) = [c for c in told if c.kind == "preemption"]
    assert "keeping its 8 prompt tokens, 5 of them computed, none generated yet:" in pre.text, pre.text
    assert "(prompt tokens 5..7, which its prefill had not reached)" in pre.text, pre.text
    assert "generated)" not in pre.text and "newest token" not in pre.text
    # preempted while decoding: prompt and generated tokens, the newest sampled but never run
    decoding = fresh()
    decoding.feed(added("1", ids=tuple(range(7)), pieces=tuple("y" * 7)))
    feed_all(decoding, [planned(7, [entry("1", kind="decode", num=1, start=13, prompt_len=7, total_len=14)], admitted=()),
                        sampled(7, rid="1", token=8, text=" w", n_out=8), timed(7)])
    told = decoding.feed(planned(8, [entry("0", kind="decode", num=1, start=9, total_len=10)], admitted=(),
                                 preempted=[queued("1", num_tokens=15, preemptions=1)], waiting=[queued("1")]))
    (pre,) = [c for c in told if c.kind == "preemption"]
    assert "keeping its 15 tokens (7 prompt + 8 generated):" in pre.text, pre.text
    assert "(its newest token at least, sampled but not yet run through the model)" in pre.text


def test_samples_of_a_prompt_with_no_shareable_block_prefill_side_by_side(make_tiny_engine):
    """Trial 29f: a 4-token prompt with n=2 prefilled sample 1 a step after sample 0 "until its full prompt
    blocks are in the prefix cache", though such a prompt has no block to share (the block holding its last
    token is never a hit): a step of latency for nothing. Both now run in the first step, and the narrator
    says why they share nothing; a prompt with a shareable block keeps the wait."""
    from nanovllm_core.sampling_params import SamplingParams as ev_params

    engine = make_tiny_engine(num_kv_blocks=32, block_size=16)
    plans = []
    engine.subscribe(lambda e: plans.append(e) if isinstance(e, ev.StepPlanned) else None, topk=0)
    for prompt_len, together in ((4, True), (16, True), (17, False)):
        plans.clear()
        engine.add_request([7] * prompt_len, ev_params(n=2, max_tokens=2, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        first = plans[0]
        assert sorted(s.index for s in first.scheduled) == ([0, 1] if together else [0]), (prompt_len, first.scheduled)
    n = fresh()
    tok, _ = n.feed(replace(added(ids=tuple(range(4)), pieces=tuple("z" * 4)), n=2))
    bs = INFO["block_size"]
    assert (f"Its 4 tokens fill no block before the one holding the prompt's last token (blocks hold {bs})"
            in tok.text), tok.text
    assert "waits until" not in tok.text


def test_the_contiguous_region_entry_gives_its_reservation_and_credits_paging_only_with_what_it_avoids():
    """Trial 30e: under --no-paged-attention a 5-token prompt with max_tokens 4 held "16 slots ... reserved
    for its prompt plus max_tokens" (9, rounded up to a block) and its 11 empty slots were "the waste that
    paged attention avoids", though a paged engine holds the same block with the same slots empty."""
    n = Narrator({**INFO, "paged": False, "max_model_len": 8192, "num_kv_blocks": 64})
    n.introduction()
    n.feed(added(ids=(1, 2, 3, 4, 5), pieces=tuple("abcde"), max_tokens=4))
    n.feed(planned(0, [entry(num=5, prompt_len=5, total_len=5)]))
    n.feed(ev.BlocksChanged(step=0, block_size=16, bytes_per_block=737280, states="u" + "f" * 63,
                            ref_counts=(1,) + (0,) * 63, tables=(ev.SeqBlocks("0", 0, 0, (0,), 5, 5),)))
    kv = next(c for c in n.feed(timed(0, tokens=5, blocks=1, total=64, per_block=737280)) if c.kind == "kv_cache")
    assert "for its prompt plus max_tokens (5 + 4 = 9 tokens, rounded up to 1 whole block of 16)" in kv.text, kv.text
    assert "the waste that paged attention avoids" not in kv.text
    assert "Paged attention would hold the same 1 block for these tokens now, with the same slots empty" in kv.text
    # max_tokens 40: 45 tokens in 3 blocks, of which paging would hold 1 now
    n = Narrator({**INFO, "paged": False, "max_model_len": 8192, "num_kv_blocks": 64})
    n.introduction()
    n.feed(added(ids=(1, 2, 3, 4, 5), pieces=tuple("abcde"), max_tokens=40))
    n.feed(planned(0, [entry(num=5, prompt_len=5, total_len=5)]))
    n.feed(ev.BlocksChanged(step=0, block_size=16, bytes_per_block=737280, states="uuu" + "f" * 61,
                            ref_counts=(1, 1, 1) + (0,) * 61, tables=(ev.SeqBlocks("0", 0, 0, (0, 1, 2), 5, 5),)))
    kv = next(c for c in n.feed(timed(0, tokens=5, blocks=3, total=64, per_block=737280)) if c.kind == "kv_cache")
    assert "(5 + 40 = 45 tokens, rounded up to 3 whole blocks of 16)" in kv.text, kv.text
    assert ("Paged attention would hold only 1 block (16 slots) for these tokens now, taking a block only when one "
            "fills: 32 of the empty slots are the waste it avoids; the other 11, in its last block, it would leave "
            "empty too.") in kv.text, kv.text


def test_a_samples_preemption_count_is_the_samples_own():
    """Trial 30e: "Preemptions of this request so far: 1" right after a sibling's "This is its 2nd
    preemption": the count is each sample's own, and the entry says so."""
    n = fresh()
    n.feed(replace(added(ids=tuple(range(3))), n=2))
    told = n.feed(planned(1, [], preempted=[replace(queued("0", num_tokens=4, preemptions=1), seq_id=1, index=1)],
                          waiting=[queued("0")], running=(), admitted=()))
    (pre,) = [c for c in told if c.kind == "preemption"]
    assert "Preemptions of this sample so far: 1." in pre.text, pre.text


def test_an_empty_one_block_pool_is_not_all_1_blocks():
    """Trial 35e: a one-block pool was told as "all 1 blocks are free"."""
    n = Narrator({"block_size": 16})
    one = n.feed(timed(0, blocks=0, total=1))
    texts = [c.text for c in one if c.kind == "kv_cache"]
    assert texts and "the pool's one block is free" in texts[0] and "all 1" not in texts[0], texts
    many = Narrator({"block_size": 16}).feed(timed(0, blocks=0, total=8))
    assert any("all 8 blocks are free" in c.text for c in many if c.kind == "kv_cache")


def test_an_empty_pool_with_cached_free_blocks_is_split_as_the_dashboard_splits_it():
    """Trial 35c: "all 512 blocks are free. 2 freed blocks keep their contents ..." beside the Dashboard's
    "cached-free 2 · free 510" in the same step: a reader adding up the legend got 510."""
    [kv] = [c for c in Narrator({"block_size": 16}).feed(timed(0, blocks=0, total=512, cached=2)) if c.kind == "kv_cache"]
    assert kv.text.startswith("No request holds KV blocks now: 510 blocks are free and 2 cached-free"), kv.text
    assert "all 512" not in kv.text


def test_the_finish_entry_says_tpot_holds_the_time_between_steps():
    """Trial 36a: `--narrate` gave a 64.2 ms TPOT beside decode steps of 26.6 and 52.9 ms with no word why:
    TPOT is a wall-clock span between tokens, so it holds what runs between steps too."""
    [done] = [c for c in Narrator({}).feed(finished()) if c.kind == "finished"]
    assert "time per output token 20.0 ms" in done.text and "also hold the time between steps" in done.text
    [one] = [c for c in Narrator({}).feed(replace(finished(n_out=1), tpot_s=None)) if c.kind == "finished"]
    assert "between steps" not in one.text


def test_the_seed_of_each_sample_is_told_as_the_engine_sets_it():
    """Trial 36e: an n=3 request with seed 1 was told "with seed 1", while sample i draws with seed 1 + i
    (its samples 1 and 2 equal n=1 runs with seeds 2 and 3)."""
    seeded = (("temperature", 0.8), ("seed", 1))
    one = [c.text for c in Narrator({}).feed(added("0", sampling=seeded)) if c.kind == "sampling"]
    assert one and "with seed 1 so the draw is repeatable" in one[0], one
    three = [c.text for c in Narrator({}).feed(replace(added("0", sampling=seeded), n=3)) if c.kind == "sampling"]
    assert three and "sample i with seed 1 + i (1 to 3 for its 3 samples)" in three[0], three


def test_narrate_steps_counts_the_first_token_as_its_help_says(capsys):
    """Trial 36e: `--narrate-steps 1` narrated no decode step, against a help of "decode steps narrated": the
    cap counts every sampled token, the prefill's first included, and the help now says so."""
    from nanovllm_core import cli

    n = Narrator({}, max_decode_steps_per_request=1)
    n.feed(added("0"))
    told = [c for step in (1, 2) for c in n.feed(sampled(step, n_out=step)) if c.kind == "decode"]
    assert len(told) == 1 and "first token" in told[0].title.lower() + told[0].text.lower(), told
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "the first (from the prefill) included" in " ".join(capsys.readouterr().out.split())


def test_an_abort_without_block_tables_tells_the_pools_counts_before_and_after():
    """Trial 40e: aborted mid-prefill while no tab asked for block tables, the finish entry said "Its KV blocks, if
    it held any, were released" though the KV entry before it had said 2 blocks were in use."""
    n = fresh()
    n.feed(added())
    feed_all(n, [planned(0, [entry(num=3)]), timed(0, blocks=2, total=8)])
    aborted = replace(finished(n_out=0, step=0), finish_reason="abort", kv_blocks_used=0, kv_blocks_cached=1)
    (end,) = [c for c in n.feed(aborted) if c.kind == "finished"]
    assert "if it held any" not in end.text
    assert ("The pool's blocks in use went from 2 to 0: 2 KV blocks released at once, 1 of them kept as "
            "cached-free for prefix-cache reuse") in end.text, end.text
    n2 = fresh()
    n2.feed(added())
    feed_all(n2, [planned(0, [entry(num=3)]), timed(0, blocks=2, total=8)])
    (end,) = [c for c in n2.feed(replace(aborted, kv_blocks_used=2, kv_blocks_cached=0)) if c.kind == "finished"]
    assert "No block in use went back to the pool" in end.text, end.text


def test_an_abort_in_the_middle_of_a_prefill_tells_how_far_its_prompt_got():
    """Trial 43e: aborted after two 8-token chunks of a 72-token prompt (16 found in the prefix cache), the finish
    entry said "aborted after 0 tokens: ''" and nothing of the 32 prompt tokens its chunks had computed, which the
    Dashboard row showed as 48/72."""
    n = fresh()
    ids = tuple(range(100, 172))
    n.feed(added(ids=ids, pieces=tuple(f"t{i}" for i in ids)))
    feed_all(n, [planned(0, [entry(num=8, start=16, prompt_len=72, total_len=72, cached=16)]), timed(0, blocks=2),
                 planned(1, [entry(num=8, start=24, prompt_len=72, total_len=72)]), timed(1, blocks=2),
                 planned(2, [entry(num=24, start=32, prompt_len=72, total_len=72)]), timed(2, blocks=3)])
    aborted = replace(finished(n_out=0, step=2), finish_reason="abort", output_text="", output_token_ids=(),
                      num_prompt_tokens=72, num_cached_prompt_tokens=16, kv_blocks_used=0, kv_blocks_cached=3)
    (end,) = [c for c in n.feed(aborted) if c.kind == "finished"]
    assert ("It was aborted in the middle of its prefill: 56 of its 72 prompt tokens had their keys and values in the "
            "KV cache (16 found in the prefix cache, 40 computed by its prefill); prompt tokens 56..71 were never run, "
            "and no token was sampled.") in end.text, end.text
    # one that had made a token, or whose prefill ran whole, says none of it
    n2 = fresh()
    n2.feed(added())
    feed_all(n2, [planned(0, [entry(num=3)]), timed(0, blocks=1)])
    (end,) = [c for c in n2.feed(replace(finished(n_out=1, step=0), finish_reason="abort")) if c.kind == "finished"]
    assert "middle of its prefill" not in end.text


def test_an_abort_in_the_middle_of_a_readmitted_prefill_makes_no_claim_of_prefix_hits():
    """The prefix-cache hits a finish counts are the first admission's: after a preemption the split of what its
    new prefill found and computed is not known, so the entry gives the count alone."""
    n = fresh()
    ids = tuple(range(100, 172))
    n.feed(added(ids=ids, pieces=tuple(f"t{i}" for i in ids)))
    feed_all(n, [planned(0, [entry(num=24, start=16, prompt_len=72, total_len=72, cached=16)]), timed(0, blocks=3)])
    aborted = replace(finished(n_out=0, step=0), finish_reason="abort", output_text="", output_token_ids=(),
                      num_prompt_tokens=72, num_cached_prompt_tokens=16, num_preemptions=1)
    (end,) = [c for c in n.feed(aborted) if c.kind == "finished"]
    assert "40 of its 72 prompt tokens had their keys and values in the KV cache; prompt tokens 40..71" in end.text
    assert "computed by its prefill" not in end.text


def test_narrate_steps_counts_the_tokens_of_all_a_prompts_samples_together():
    """Trial 44e: docs/teaching.md said N tokens "per prompt" without saying how n > 1 counts; the cap is the
    prompt's, its samples' tokens together (the docs and --help now say so)."""
    n = Narrator({}, max_decode_steps_per_request=3)
    n.feed(replace(added("0"), n=2))
    told = []
    for step in (1, 2, 3):
        for index in (0, 1):
            told += [c for c in n.feed(replace(sampled(step, n_out=step), index=index)) if c.kind == "decode"]
    assert len(told) == 3, [c.title for c in told]


def test_a_kv_entry_without_block_tables_says_why_speculation_may_hold_an_empty_block():
    """Trial 44e: with ngram drafting and no block-table snapshot, the KV entry said 4 blocks were reserved for a
    48-token request that "ran without drafts", and nothing said a block is taken ahead for the draft slots."""
    def kv_text(info):
        n = Narrator(info)
        n.feed(added())
        out = feed_all(n, [planned(0, [entry(num=3)]), timed(0, blocks=2)])
        (kv,) = [c for c in out if c.kind == "kv_cache"]
        return kv.text

    assert "up to k drafts" in kv_text({**INFO, "speculative_model": "ngram", "num_speculative_tokens": 3})
    assert "drafts" not in kv_text(INFO)  # no speculation: no such block, nothing said


def test_an_abort_after_steps_with_no_snapshot_does_not_name_an_older_steps_blocks():
    """Trial 45e: the app asks for block tables only while a tab shows them; a snapshot from step 0 was still the
    narrator's newest when the request was aborted after step 2, and the entry said "Its 2 KV blocks [0, 1]
    were released" where the KV entry above had said 3 blocks were in use."""
    n = fresh()
    n.feed(added())
    n.feed(planned(0, [entry(num=2, prompt_len=52, total_len=52)]))
    n.feed(ev.BlocksChanged(step=0, block_size=16, bytes_per_block=737280, states="uuf", ref_counts=(1, 1, 0),
                            tables=(ev.SeqBlocks("0", 0, 0, (0, 1), 32, 32),)))
    feed_all(n, [timed(0, blocks=2, total=8), planned(1, [entry(num=8, start=32, prompt_len=52, total_len=52)]),
                 timed(1, blocks=3, total=8)])  # no snapshot came with step 1
    aborted = replace(finished(n_out=0, step=1), finish_reason="abort", output_text="", output_token_ids=(),
                      num_prompt_tokens=52, kv_blocks_used=0, kv_blocks_cached=2)
    (end,) = [c for c in n.feed(aborted) if c.kind == "finished"]
    assert "[0, 1]" not in end.text, end.text
    assert "The pool's blocks in use went from 3 to 0: 3 KV blocks released at once, 2 of them kept" in end.text


def test_an_abort_before_any_step_ran_names_no_step():
    """Trial 45e: aborted while the model loaded, the entry was headed "finished · step 0" (its event carries the
    first step's number) though no step had run."""
    n = fresh()
    n.feed(added())
    aborted = replace(finished(n_out=0, step=0), finish_reason="abort", output_text="", output_token_ids=())
    (end,) = [c for c in n.feed(aborted) if c.kind == "finished"]
    assert end.step is None
    n2 = fresh()
    n2.feed(added())
    feed_all(n2, [planned(0, [entry(num=3)]), timed(0, blocks=1)])
    (end,) = [c for c in n2.feed(replace(finished(n_out=1, step=0), finish_reason="abort")) if c.kind == "finished"]
    assert end.step == 0  # after step 0 ran
