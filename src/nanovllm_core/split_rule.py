"""Which tensor-parallel sizes split a model evenly: pure arithmetic, without torch.

The engine (``model/parallel.py``, its load-time check) and the teaching (``educational/tp_facts.py``,
chapter 13's rule, drawn in the app even for a replay, which must not import torch) share this one
rule, so the two cannot disagree. Megatron-LM's split (Shoeybi et al. 2019, section 3) needs N to
divide the query heads, the KV heads (a rank holds whole KV heads and the query heads that read
them), the MLP's intermediate size and the vocabulary (the embedding and LM head are split by rows).
"""

from __future__ import annotations

SPLIT_SIZES = ("query heads", "KV heads", "intermediate size", "vocabulary")


def split_sizes(limit: int, num_heads: int, num_kv_heads: int, intermediate_size: int | None = None,
                vocab_size: int | None = None) -> list[int]:
    """Every N in 1..``limit`` that divides each of the :data:`SPLIT_SIZES` given (None: not
    given, so not checked; pure arithmetic). SmolLM2-135M (9, 3, 1536, 49152): ``[1, 3]``."""
    sizes = [s for s in (num_heads, num_kv_heads, intermediate_size, vocab_size) if s is not None]
    return [n for n in range(1, limit + 1) if all(s % n == 0 for s in sizes)]
