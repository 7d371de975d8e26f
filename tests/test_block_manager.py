"""Property tests of the block manager: random interleavings keep the pool consistent."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanovllm_core.engine.block_manager import BlockManager
from nanovllm_core.engine.sequence import Sequence
from nanovllm_core.sampling_params import SamplingParams

BLOCK = 4
# A small alphabet makes shared prefixes (and prefix-cache hits) common.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)


def make_seq(i: int, ids: list[int]) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), token_ids=list(ids), num_prompt_tokens=len(ids), params=SamplingParams())


class BlockPool(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=10, block_size=BLOCK, enable_prefix_caching=True)
        self.live: list[Sequence] = []
        self.next_id = 0

    @rule(ids=tokens)
    def admit(self, ids):
        seq = make_seq(self.next_id, ids)
        self.next_id += 1
        cached = self.bm.find_cached_prefix(seq)
        free_before = self.bm.num_free_blocks
        if self.bm.allocate(seq, seq.num_tokens, cached):
            seq.num_computed_tokens = seq.num_tokens
            self.bm.cache_full_blocks(seq)
            self.live.append(seq)
        else:
            assert seq.block_table == [] and self.bm.num_free_blocks == free_before, "failed allocation took blocks"

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.integers(0, 2))
    def append(self, data, new):
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(new)
        if self.bm.allocate(seq, seq.num_tokens):
            seq.num_computed_tokens = seq.num_tokens
            self.bm.cache_full_blocks(seq)
        else:
            seq.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt_and_readmit(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        cached = self.bm.find_cached_prefix(seq)
        if self.bm.allocate(seq, seq.num_tokens, cached):
            seq.num_computed_tokens = seq.num_tokens
            self.bm.cache_full_blocks(seq)
        else:
            self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), keep=st.integers(1, 14))
    def rollback(self, data, keep):
        seq = data.draw(st.sampled_from(self.live))
        shared = [i for i, b in enumerate(seq.block_table) if self.bm.blocks[b].ref_count > 1]
        keep = max(min(keep, seq.num_tokens), (max(shared) + 1) * BLOCK if shared else 1)
        keep = min(keep, seq.num_tokens)
        del seq.token_ids[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, keep)
        self.bm.truncate(seq, keep)

    @invariant()
    def consistent(self):
        self.bm.check_invariants(self.live)

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        self.bm.check_invariants([])
        assert self.bm.num_used_blocks == 0, "blocks held after every sequence ended"


TestBlockPool = BlockPool.TestCase
TestBlockPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_shared_prefix_is_reused_and_refcounted():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    b = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 0, 0])
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, b.num_tokens, hits)
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in hits] == [1, 1]
    bm.check_invariants([b])


def cached_then_freed(bm: BlockManager, token_ids: list[int]) -> Sequence:
    """A sequence computed in full, its full blocks cached, then freed: its blocks are cached-free."""
    seq = make_seq(0, token_ids)
    bm.allocate(seq, len(token_ids))
    seq.num_computed_tokens = len(token_ids)
    bm.cache_full_blocks(seq)
    bm.free(seq)
    return seq


def test_freed_cached_block_is_evicted_lru_only_when_needed():
    bm = BlockManager(num_blocks=3, block_size=2)
    cached_then_freed(bm, [1, 2, 3, 4])
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 3
    c = make_seq(1, [9, 9])
    bm.allocate(c, 2)  # takes the empty block first
    assert bm.num_cached_free_blocks == 2
    d = make_seq(2, [8, 8])
    bm.allocate(d, 2)  # now one cached block must be evicted: a's tail goes first
    assert bm.num_cached_free_blocks == 1
    assert bm.find_cached_prefix(make_seq(3, [1, 2, 7])) != []


def test_a_cached_free_hit_is_shared_not_taken_anew_but_leaves_the_free_pool():
    """The two counts a preemption's shortfall is told in (Shortfall: needed vs free)."""
    bm = BlockManager(num_blocks=4, block_size=2)
    cached_then_freed(bm, [1, 2, 3, 4])  # both blocks cached-free: still in the free pool of 4
    b = make_seq(1, [1, 2, 3, 4, 5, 6])
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    assert bm.new_blocks_needed(b, 6) == 3          # nothing shared: ceil(6 / 2)
    assert bm.new_blocks_needed(b, 6, hits) == 1    # the two hits count towards the three
    assert bm.free_blocks_after_hits() == 4
    assert bm.free_blocks_after_hits(hits) == 2     # sharing a cached-free block takes it from the pool
    assert bm.can_allocate(b, 6, hits) and bm.allocate(b, 6, hits)
    assert bm.num_free_blocks == 1
    bm.check_invariants([b])


def test_hash_collision_is_a_miss(monkeypatch):
    from nanovllm_core.engine import block_manager as mod

    monkeypatch.setattr(mod, "chain_hash", lambda parent, toks: 42)  # every block collides
    bm = mod.BlockManager(num_blocks=4, block_size=2)
    a = make_seq(0, [1, 2, 3])
    bm.allocate(a, 3)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    assert bm.find_cached_prefix(make_seq(1, [5, 6, 7])) == []  # same hash, other tokens
    assert bm.find_cached_prefix(make_seq(2, [1, 2, 7])) == a.block_table[:1]
