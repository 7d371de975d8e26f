"""A stand-in for the ``flash_attn`` package that runs on the CPU and refuses what the real one refuses.

``flash_attn_varlen_func`` checks its arguments as flash-attn 2.8 does (the Python wrapper
``flash_attn_interface.py`` and ``mha_varlen_fwd`` in ``csrc/flash_attn/flash_api.cpp``),
with the real error messages, then computes the reference result: each sequence's keys and
values gathered through ``block_table``, a causal mask aligned to the bottom-right corner,
query head ``h`` reading KV head ``h // (num_heads / num_kv_heads)``.

Two of the real wrapper's conveniences are refused here instead, because on a GPU they would
copy the whole KV cache on every call: a K/V whose last dimension is not contiguous
(``maybe_contiguous``) and a head size that is not a multiple of 8 (the wrapper pads it).

Install it with :func:`install` (a ``monkeypatch``), so ``import flash_attn`` finds it.
"""

from __future__ import annotations

import sys
import types

import torch

PAGE_MULTIPLE = 256
calls: list[dict] = []  # one entry per call: what a test may want to assert on


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2.8's ``flash_attn_varlen_func`` for the arguments this engine passes (paged K/V, no dropout)."""
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    _check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _check(cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    _check(all(t.device == q.device for t in (k, v, cu_seqlens_q, cu_seqlens_k)), "all tensors must be on one device")
    _check(block_table is not None, "this engine always passes a block_table (paged KV cache)")
    _check(block_table.device == q.device, "block_table must be on the device of q")
    _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    _check(q.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(k.stride(-1) == 1 and v.stride(-1) == 1,
           "k/v must have a contiguous last dimension (the real wrapper would copy the whole cache)")
    _check(cu_seqlens_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    _check(cu_seqlens_k.is_contiguous(), "cu_seqlens_k must be contiguous")
    _check(isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int), "max_seqlen_q/k must be Python ints")
    _check(dropout_p == 0.0 and window_size == (-1, -1) and softcap == 0.0 and alibi_slopes is None,
           "this stand-in models inference only (no dropout, window, softcap, alibi)")

    total_q, num_heads, head_size = q.shape
    batch_size = cu_seqlens_q.numel() - 1
    num_blocks, page_block_size, num_heads_k, _ = k.shape
    _check(page_block_size % PAGE_MULTIPLE == 0, "Paged KV cache block size must be divisible by 256")
    _check(batch_size > 0, "batch size must be positive")
    _check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(head_size % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8 "
                               "(the real wrapper would pad, copying the whole cache)")
    _check(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    _check(tuple(k.shape) == (num_blocks, page_block_size, num_heads_k, head_size),
           "k must have shape (num_blocks, page_block_size, num_heads_k, head_size)")
    _check(tuple(v.shape) == tuple(k.shape), "v must have shape (num_blocks, page_block_size, num_heads_k, head_size)")
    _check(block_table.dim() == 2 and block_table.shape[0] == batch_size,
           "block_table must have shape (batch_size, max_num_blocks_per_seq)")
    _check(cu_seqlens_k.shape == (batch_size + 1,), "cu_seqlens_k must have shape (batch_size + 1)")

    cq, ck, table = cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), block_table.long()
    _check(cq[0] == 0 and ck[0] == 0 and cq[-1] == total_q, "cu_seqlens must start at 0 and cu_seqlens_q end at total_q")
    q_lens = [b - a for a, b in zip(cq, cq[1:])]
    k_lens = [b - a for a, b in zip(ck, ck[1:])]
    _check(max(q_lens) <= max_seqlen_q and max(k_lens) <= max_seqlen_k, "max_seqlen_q/k below a real length")
    _check(max(k_lens) <= block_table.shape[1] * page_block_size, "block_table too short for seqlen_k")
    calls.append({"batch_size": batch_size, "q_lens": q_lens, "k_lens": k_lens, "page_block_size": page_block_size})

    scale = softmax_scale if softmax_scale is not None else head_size ** -0.5
    group = num_heads // num_heads_k
    out = torch.empty_like(q)
    for b in range(batch_size):
        lq, lk = q_lens[b], k_lens[b]
        blocks = table[b, : -(-lk // page_block_size)]
        _check(bool(((blocks >= 0) & (blocks < num_blocks)).all()), "block_table entry out of range")
        kb = k[blocks].reshape(-1, num_heads_k, head_size)[:lk].float().repeat_interleave(group, dim=1)
        vb = v[blocks].reshape(-1, num_heads_k, head_size)[:lk].float().repeat_interleave(group, dim=1)
        qb = q[cq[b]:cq[b + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        if causal:  # bottom-right: query i is position lk - lq + i and sees keys 0 .. lk - lq + i
            keep = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]
            scores = scores.masked_fill(~keep, float("-inf"))
        out[cq[b]:cq[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vb).to(q.dtype)
    return out


def install(monkeypatch) -> types.ModuleType:
    """Put this stand-in in ``sys.modules["flash_attn"]`` for one test; returns the module."""
    module = types.ModuleType("flash_attn")
    module.__version__ = "2.8.3+fake"
    module.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    calls.clear()
    return module
