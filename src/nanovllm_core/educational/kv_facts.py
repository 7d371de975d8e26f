"""The KV cache's two sizes after a step: what its blocks reserve and what its tokens store.

A request takes whole blocks (``block_size`` slots each) but fills them one token at a time,
so the bytes it *reserves* (blocks x bytes per block) exceed the bytes its tokens *store*
(tokens x bytes per token) by its last block's empty slots. A block that several block
tables point at (prefix cache, parallel samples) is counted once, with the most tokens any
of them has in it. Every view that prints a KV size takes it from :func:`kv_footprint`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm_core import events as ev


@dataclass(frozen=True)
class KVFootprint:
    """Live blocks and their contents after one step (``BlocksChanged``).

    ``blocks``: distinct physical blocks in live block tables; ``slots``: their slots
    (``blocks x block_size``); ``tokens``: filled slots (tokens whose keys and values were
    computed, ``num_computed_tokens``); ``bytes_per_block`` / ``bytes_per_token`` across
    all layers, K and V.
    """

    blocks: int
    slots: int
    tokens: int
    bytes_per_block: int
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size if self.block_size else 0

    @property
    def reserved_bytes(self) -> int:
        """What the blocks take from the pool, empty slots included."""
        return self.blocks * self.bytes_per_block

    @property
    def stored_bytes(self) -> int:
        """What the tokens' keys and values fill."""
        return self.tokens * self.bytes_per_token

    @property
    def empty_slots(self) -> int:
        return self.slots - self.tokens


def kv_footprint(blocks: ev.BlocksChanged) -> KVFootprint:
    """Reserved and stored sizes of the live block tables in ``blocks`` (shared blocks counted once)."""
    bs = blocks.block_size
    filled: dict[int, int] = {}
    for t in blocks.tables:
        for i, b in enumerate(t.block_table):
            n = max(0, min(bs, t.num_computed_tokens - i * bs))
            filled[b] = max(filled.get(b, 0), n)
    return KVFootprint(blocks=len(filled), slots=len(filled) * bs, tokens=sum(filled.values()),
                       bytes_per_block=blocks.bytes_per_block, block_size=bs)
