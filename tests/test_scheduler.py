"""Scheduler rules on hand-made sequences (no model): budget, chunking, policy order, preemption."""

from __future__ import annotations

from nanovllm_core.engine.block_manager import BlockManager
from nanovllm_core.engine.scheduler import Scheduler
from nanovllm_core.engine.sequence import Sequence, SequenceStatus
from nanovllm_core.sampling_params import SamplingParams

_ids = iter(range(10**6))


def seq(n_prompt: int, priority: int = 0) -> Sequence:
    i = next(_ids)
    return Sequence(seq_id=i, request_id=f"r{i}", token_ids=[7] * n_prompt, num_prompt_tokens=n_prompt,
                    params=SamplingParams(), priority=priority)


def run_step(sched: Scheduler):
    """Apply a plan as the engine would: computed tokens advance, sampling sequences get a token."""
    plan = sched.schedule()
    for s in plan.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.samples:
            s.seq.token_ids.append(1)
    return plan


def make(num_blocks=100, block_size=4, budget=16, policy="fcfs", max_num_seqs=8, chunked=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=False), max_num_seqs, budget,
                     policy, chunked)


def test_long_prompt_is_chunked_while_decodes_continue():
    s = make(budget=16)
    short, long_ = seq(3), seq(40)
    s.add(short)
    run_step(s)  # short prefills whole
    s.add(long_)
    plan = run_step(s)
    kinds = {p.seq.seq_id: (p.kind, p.num_new_tokens) for p in plan.scheduled}
    assert kinds[short.seq_id] == ("decode", 1)
    assert kinds[long_.seq_id] == ("prefill", 15)  # the rest of the budget
    plan = run_step(s)
    assert {p.seq.seq_id: p.num_new_tokens for p in plan.scheduled} == {short.seq_id: 1, long_.seq_id: 15}
    assert plan.num_batched_tokens <= 16


def test_without_chunking_a_prompt_waits_for_a_whole_step():
    s = make(budget=16, chunked=False)
    a, b = seq(10), seq(10)
    s.add(a)
    s.add(b)
    plan = run_step(s)
    assert [p.seq for p in plan.scheduled] == [a]  # b does not fit the remaining 6 tokens


def test_priority_policy_admits_higher_priority_first_fcfs_by_arrival():
    for policy, expected in (("priority", "high"), ("fcfs", "low")):
        s = make(budget=4, policy=policy)
        low, high = seq(4, priority=0), seq(4, priority=5)
        low.request_id, high.request_id = "low", "high"
        s.add(low)
        s.add(high)
        plan = run_step(s)
        assert plan.scheduled[0].seq.request_id == expected


def test_max_num_seqs_caps_running_set():
    s = make(max_num_seqs=2, budget=100)
    for _ in range(4):
        s.add(seq(3))
    run_step(s)
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_preemption_picks_lowest_priority_latest_arrival_and_keeps_its_tokens():
    s = make(num_blocks=4, block_size=2, budget=64, policy="priority")
    keep, victim = seq(4, priority=1), seq(4, priority=0)
    s.add(keep)
    s.add(victim)
    run_step(s)  # both prefilled: 2 blocks each, pool full
    assert s.block_manager.num_free_blocks == 0
    generated = victim.num_output_tokens
    plan = run_step(s)  # keep needs a third block for its 5th token
    assert plan.preempted == [victim]
    assert victim.status is SequenceStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.num_output_tokens == generated and victim.block_table == []
    assert s.waiting[0] is victim
    assert victim.metrics.num_preemptions == 1


def test_waiting_high_priority_preempts_running_low_priority():
    s = make(num_blocks=4, block_size=4, budget=64, policy="priority")
    low = seq(12, priority=0)
    s.add(low)
    run_step(s)  # low holds 3 blocks + 1 token grows to 13 tokens -> 4 blocks on next step
    high = seq(8, priority=9)
    s.add(high)
    plan = run_step(s)
    assert low in plan.preempted
    assert high in [p.seq for p in plan.scheduled]


def test_fcfs_never_preempts_for_a_waiting_request():
    s = make(num_blocks=4, block_size=4, budget=64, policy="fcfs")
    low = seq(12)
    s.add(low)
    run_step(s)
    high = seq(8, priority=9)
    s.add(high)
    plan = run_step(s)
    assert plan.preempted == [] and high in s.waiting


def test_each_preemption_records_how_many_blocks_were_needed_and_how_many_were_free():
    """Trial 12: the narrator said "none was free" for every preemption; a chunk can need 3 with 1 free."""
    s = make(num_blocks=5, block_size=2, budget=6, policy="priority")
    hi, lo = seq(2, priority=1), seq(12, priority=0)
    s.add(hi)
    s.add(lo)
    run_step(s)  # hi: 2 tokens (1 block); lo: chunk of 4 (2 blocks); 2 free
    plan = run_step(s)  # hi's 3rd token takes 1 block; lo's chunk of 5 needs 3 more with 1 free: lo itself goes
    assert plan.preempted == [lo]
    (why,) = plan.shortfalls
    assert (why.needer, why.blocks_needed, why.blocks_free, why.waiting) == (lo, 3, 1, False)


def test_a_waiting_request_that_preempts_records_its_shortfall():
    s = make(num_blocks=4, block_size=4, budget=64, policy="priority")
    low = seq(12, priority=0)
    s.add(low)
    run_step(s)  # low: 3 blocks, 1 free
    high = seq(8, priority=9)
    s.add(high)
    plan = run_step(s)  # low's 13th token takes the last block; high needs 2 with none free
    assert plan.preempted == [low]
    (why,) = plan.shortfalls
    assert (why.needer, why.blocks_needed, why.blocks_free, why.waiting) == (high, 2, 0, True)


def test_each_plan_says_why_the_head_of_the_waiting_queue_was_not_admitted():
    """Trial 14c #4: the views told why a request waits by guessing from the plan's figures."""
    s = make(max_num_seqs=2, budget=100)
    for _ in range(3):
        s.add(seq(3))
    assert run_step(s).wait_reason == "max_num_seqs"
    s = make(budget=8)
    s.add(seq(32))
    s.add(seq(2))
    assert [run_step(s).wait_reason for _ in range(4)] == ["budget"] * 4  # a 32-token prompt in chunks of 8
    assert run_step(s).wait_reason == ""  # the short one is admitted beside the first decode
    s = make(budget=16, chunked=False)
    s.add(seq(10))
    s.add(seq(10))
    assert run_step(s).wait_reason == "chunked_prefill_off"
    s = make(num_blocks=3, block_size=4, budget=64)
    s.add(seq(8))
    s.add(seq(8))
    assert run_step(s).wait_reason == "kv_blocks"
    s = make(num_blocks=4, block_size=2, budget=64, policy="priority")
    s.add(seq(4, priority=1))
    s.add(seq(4, priority=0))
    run_step(s)
    plan = run_step(s)  # the first needs a block: the second is preempted and waits
    assert plan.preempted and plan.wait_reason == "preempted"
