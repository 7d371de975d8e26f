"""The block manager: a fixed pool of KV blocks, reference counts, and the prefix cache.

PagedAttention (Kwon et al. 2023, section 4.2) treats KV memory like virtual memory: a
sequence's *block table* maps its logical blocks to physical ones, allocated on demand as
it grows and returned when it finishes, is aborted or is preempted.

Prefix caching (vLLM's automatic prefix caching; SGLang's RadixAttention does the same
with a tree): the hash of a *full* block chains its parent's hash with its own token ids,
so equal hashes mean equal prefixes. A new sequence reuses cached blocks for its longest
cached prefix (the reference count goes up, nothing is recomputed). A hit is confirmed by
comparing the stored tokens, so a hash collision can never serve the wrong K/V.

A block is in exactly one of three states:

- **used**: ``ref_count > 0``, in some block tables;
- **cached-free**: ``ref_count == 0`` but still holds a hashed, reusable prefix; evicted
  least-recently-used, and only when a block is needed;
- **free**: empty.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from nanovllm_core.engine.sequence import Sequence


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a full block given its parent's hash and its own token ids.

    Python's tuple hash of ints is deterministic across runs (no hash randomisation for ints).
    """
    return hash((parent if parent is not None else -1, tokens))


@dataclass
class Block:
    """One physical block: ``block_size`` slots of K/V in every layer."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens a hashed block holds (to confirm hits)


class BlockManager:
    """Allocates, shares, caches and frees KV blocks for sequences.

    Args:
        num_blocks: size of the physical pool.
        block_size: tokens per block.
        enable_prefix_caching: keep full blocks' hashes and reuse them.

    All allocation is all-or-nothing: a call that cannot be satisfied changes nothing.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # empty blocks, used first
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self.hash_to_block: dict[int, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, tokens found cached

    # ------------------------------------------------------------------ accounting

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty + cached-free)."""
        return len(self.free_ids) + len(self.cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (ceil)."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache

    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Chained hashes of ``seq``'s first ``num_full_blocks`` full blocks (memoised on the sequence)."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(chain_hash(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
        return hashes[:num_full_blocks]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Physical ids of the cached blocks that hold ``seq``'s longest cached prefix.

        At most ``(num_tokens - 1) // block_size`` blocks: when the whole sequence is
        cached, its last block is recomputed anyway, because sampling needs the logits of
        the last token. Looks only; takes nothing (see :meth:`allocate`).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        for i, h in enumerate(self._hashes(seq, (seq.num_tokens - 1) // bs)):
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break  # a hash collision: treat as a miss
            hits.append(block_id)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup (for ``prefix_cache_hit_rate``); nothing when prefix caching is off.

        With caching off nothing is looked up, so nothing is counted (as vLLM's
        ``KVCacheManager.get_computed_blocks`` returns before its stats when caching is disabled).
        """
        if not self.enable_prefix_caching:
            return
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ------------------------------------------------------------------ allocation

    def can_allocate(self, seq: Sequence, num_tokens: int, cached: list[int] = ()) -> bool:
        """Would :meth:`allocate` succeed for ``seq`` to hold ``num_tokens`` tokens?"""
        return self.new_blocks_needed(seq, num_tokens, cached) <= self.free_blocks_after_hits(cached)

    def new_blocks_needed(self, seq: Sequence, num_tokens: int, cached: list[int] = ()) -> int:
        """Blocks ``seq`` must take from the free pool to hold ``num_tokens`` tokens.

        Its block table's blocks and the prefix-cache hits ``cached`` (shared, not taken
        anew) count towards the ``ceil(num_tokens / block_size)`` it needs; 0 when it has them.
        """
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table) - len(cached))

    def free_blocks_after_hits(self, cached: list[int] = ()) -> int:
        """Free blocks (empty or cached-free) left once the prefix-cache hits ``cached`` are shared.

        Hitting a cached-free block takes it out of the free pool too (its ref count goes 0 -> 1).
        """
        taken = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return self.num_free_blocks - taken

    def allocate(self, seq: Sequence, num_tokens: int, cached: list[int] = ()) -> bool:
        """Grow ``seq``'s block table so it can hold ``num_tokens`` tokens.

        ``cached`` (from :meth:`find_cached_prefix`, only for a sequence with an empty block
        table) are shared first; then new blocks are taken, empty ones before cached-free
        ones, the least recently used cached-free block first.

        Returns False, changing nothing, when not enough blocks are free.
        """
        if cached and seq.block_table:
            raise ValueError("cached prefix blocks can only start an empty block table")
        needed = self.new_blocks_needed(seq, num_tokens, cached)
        if needed > self.free_blocks_after_hits(cached):
            return False
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached_free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(needed):
            seq.block_table.append(self._take_block())
        return True

    def free_runs(self, also_free: frozenset[int] | set[int] = frozenset()) -> list[tuple[int, int]]:
        """Runs of adjacent physical blocks that are free (empty or cached-free), as ``(first id, length)``
        in id order; ``also_free``: block ids to count as free too (those a preemption would release).

        The contiguous baseline (``paged=False``) reserves a request's KV as one such run: a pool with
        enough free blocks in all but no run long enough cannot admit it (external fragmentation,
        Kwon et al. 2023, section 3), which block tables avoid.
        """
        runs: list[tuple[int, int]] = []
        start = None
        for b in range(self.num_blocks + 1):
            free = b < self.num_blocks and (self.blocks[b].ref_count == 0 or b in also_free)
            if free and start is None:
                start = b
            elif not free and start is not None:
                runs.append((start, b - start))
                start = None
        return runs

    def find_free_run(self, num_blocks: int, also_free: frozenset[int] | set[int] = frozenset()) -> int | None:
        """The first id of the first run of ``num_blocks`` adjacent free blocks (first fit), or None;
        0 blocks need no run (0). See :meth:`free_runs`."""
        if num_blocks <= 0:
            return 0
        return next((first for first, length in self.free_runs(also_free) if length >= num_blocks), None)

    def longest_free_run(self) -> int:
        """Length in blocks of the longest run of adjacent free blocks (0 when none is free)."""
        return max((length for _, length in self.free_runs()), default=0)

    def allocate_run(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` (an empty block table) the first run of adjacent free blocks that holds
        ``num_tokens`` tokens: the contiguous baseline's one KV region (first fit). Cached-free blocks
        in the run lose their cached prefix (the baseline runs with prefix caching off).

        Returns False, changing nothing, when no run is long enough, even if enough blocks are free in all.

        Raises:
            ValueError: ``seq`` already holds blocks (a region is reserved once, whole).
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks; a contiguous region is reserved once")
        n = self.blocks_needed(num_tokens)
        first = self.find_free_run(n)
        if first is None:
            return False
        for block_id in range(first, first + n):
            if block_id in self.cached_free:
                del self.cached_free[block_id]
                self._uncache(self.blocks[block_id])
            else:
                self.free_ids.remove(block_id)
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)
        return True

    def _take_block(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.cached_free.popitem(last=False)  # evict the LRU cached block
            self._uncache(self.blocks[block_id])
        block = self.blocks[block_id]
        block.ref_count = 1
        return block_id

    def _uncache(self, block: Block) -> None:
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash = None
        block.token_ids = None

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks (finish, abort or preemption).

        Hashed blocks whose count drops to 0 become cached-free; the sequence's tail
        blocks are put at the LRU end first so they are evicted before its shared prefix.
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.cached_free[block_id] = None
                else:
                    self.free_ids.append(block_id)
        seq.block_table = []

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink ``seq``'s blocks to what its first ``num_tokens`` tokens need (speculative-decoding rollback).

        Blocks past the end are released; a hashed block cut in the middle loses its hash
        (it no longer holds that full block of tokens).

        Raises:
            ValueError: the cut falls inside a block shared with another sequence.
        """
        keep = self.blocks_needed(num_tokens)
        bs = self.block_size
        if num_tokens % bs and keep <= len(seq.block_table):
            last = self.blocks[seq.block_table[keep - 1]]
            if last.hash is not None:
                if last.ref_count > 1:
                    raise ValueError(f"cannot roll back into block {last.block_id}: it is shared")
                self._uncache(last)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.cached_free[block.block_id] = None
                else:
                    self.free_ids.append(block.block_id)
        del seq.block_hashes[num_tokens // bs:]

    def cache_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register the hashes of ``seq``'s blocks that are full of computed tokens.

        ``num_tokens`` (default ``num_computed_tokens``) lowers that limit, for K/V that is
        not complete everywhere yet (a speculative draft model's pool lagging one token).
        A block whose content is already cached elsewhere (two sequences computed the same
        prefix in one step) stays unregistered; the first copy serves future hits.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        limit = seq.num_computed_tokens if num_tokens is None else min(num_tokens, seq.num_computed_tokens)
        num_full = min(limit // bs, len(seq.block_table))
        hashes = self._hashes(seq, num_full)
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            h = hashes[i]
            if h in self.hash_to_block:
                continue
            block.hash = h
            block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            self.hash_to_block[h] = block.block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block (used blocks keep their hashes)."""
        while self.cached_free:
            block_id, _ = self.cached_free.popitem(last=False)
            self._uncache(self.blocks[block_id])
            self.free_ids.append(block_id)

    # ------------------------------------------------------------------ inspection

    def block_state(self, block_id: int) -> str:
        """``"used"``, ``"cached"`` (cached-free) or ``"free"``."""
        block = self.blocks[block_id]
        if block.ref_count > 0:
            return "used"
        return "cached" if block_id in self.cached_free else "free"

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Assert the pool is consistent with the given live sequences (tests and debugging).

        Raises:
            AssertionError: with what is inconsistent.
        """
        refs = [0] * self.num_blocks
        for s in seqs:
            for b in s.block_table:
                refs[b] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref {block.ref_count} != {refs[block.block_id]} references"
        free, cached = set(self.free_ids), set(self.cached_free)
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert len(free) == len(self.free_ids), "a block is twice in the free list"
        assert not (free & cached) and not (free & used) and not (cached & used), "a block is in two places"
        assert len(free) + len(cached) + len(used) == self.num_blocks, "free + cached + used != total"
        for h, block_id in self.hash_to_block.items():
            block = self.blocks[block_id]
            assert block.hash == h, f"hash entry points at block {block_id} holding another hash"
            assert block.token_ids is not None and len(block.token_ids) == self.block_size
        for block_id in cached:
            assert self.blocks[block_id].hash is not None, f"cached-free block {block_id} has no hash"
        bs = self.block_size
        for s in seqs:
            for i, block_id in enumerate(s.block_table):
                held = self.blocks[block_id].token_ids
                assert held is None or held == tuple(s.token_ids[i * bs:(i + 1) * bs]), (
                    f"block {block_id} is hashed with tokens other than {s!r}'s block {i}")
