"""Attention arithmetic shared by the paged and contiguous KV caches.

Two backends compute the same thing:

- ``"flash"``: PyTorch's fused ``scaled_dot_product_attention`` (on the CPU its flash
  kernel; on CUDA flash/memory-efficient kernels). The score matrix is never stored whole.
  On CUDA each call is shaped so that a fused kernel accepts it (no mask together with GQA,
  see :func:`masked_attention_folded`), never leaving SDPA to fall back to its math kernel.
- ``"math"``: the textbook formula, ``softmax(Q @ K^T / sqrt(d) + mask) @ V``, which
  materialises the ``[heads, q_len, k_len]`` score matrix. Slower and larger, but it is
  the one to read, and the one the X-Ray view takes attention weights from.

Grouped-query attention (Ainslie et al. 2023): query head ``h`` reads KV head
``h // (num_heads / num_kv_heads)``, the grouping transformers' ``repeat_kv`` uses. No KV
head is copied: queries are regrouped as ``[num_kv_heads, group, ...]`` instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("flash", "math")


def causal_mask(start: int, num_queries: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Boolean mask ``[num_queries, context_len]``, True where query may attend key.

    Query i sits at position ``start + i`` and sees keys ``0 .. start + i``: a prefill chunk
    that begins mid-prompt attends to everything cached before it and causally within itself.
    """
    q_pos = torch.arange(start, start + num_queries, device=device)
    k_pos = torch.arange(context_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def attend_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    backend: str = "flash",
) -> torch.Tensor:
    """Attention for one sequence's queries over its whole context.

    Args:
        q: ``[num_queries, num_heads, head_dim]``.
        k, v: ``[context_len, num_kv_heads, head_dim]``, the cached context including the queries' own keys.
        mask: ``[num_queries, context_len]`` bool (True = attend), or None for a plain causal
            square (``num_queries == context_len``, the prompt's first chunk).
        backend: ``"flash"`` or ``"math"``.

    Returns:
        ``[num_queries, num_heads, head_dim]``.
    """
    nq, nh, hd = q.shape
    nkv = k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, nh, nq, hd]
    kh = k.transpose(0, 1).unsqueeze(0)  # [1, nkv, ctx, hd]
    vh = v.transpose(0, 1).unsqueeze(0)
    if backend == "math":
        group = nh // nkv
        qg = qh.reshape(1, nkv, group * nq, hd)
        scores = torch.matmul(qg, kh.transpose(-1, -2)) * (hd ** -0.5)  # [1, nkv, group*nq, ctx]
        scores = scores.view(1, nkv, group, nq, -1)
        if mask is None:
            mask = causal_mask(0, nq, k.shape[0], q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(_at_least_float32(scores), dim=-1).to(q.dtype).view(1, nkv, group * nq, -1)
        out = torch.matmul(probs, vh).view(1, nh, nq, hd)
    elif mask is None:
        # A causal square: every fused kernel takes is_causal; flash (CUDA and CPU) also takes GQA.
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=nkv != nh)
    elif q.device.type == "cpu":
        # The CPU's flash kernel takes a mask and GQA together (and is faster so than folded).
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=nkv != nh)
    else:
        out = masked_attention_folded(qh, kh, vh, mask)
    return out[0].transpose(0, 1)


def masked_attention_folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked GQA as plain multi-head attention: the query heads sharing a KV head become more query rows of it.

    On CUDA, released PyTorch's flash kernel refuses any mask and its memory-efficient kernel
    refuses GQA, so ``attn_mask`` with ``enable_gqa`` falls back to the math kernel (K/V copied
    per query head, the whole score matrix stored). Folded, the call is dense multi-head
    attention with a mask, which the memory-efficient kernel runs; the grouped decode path
    (:func:`attend_decode_grouped`) folds the same way.

    Args:
        q: ``[1, num_heads, num_queries, head_dim]``; k, v: ``[1, num_kv_heads, context_len, head_dim]``.
        mask: ``[num_queries, context_len]`` bool, True = attend.

    Returns:
        ``[1, num_heads, num_queries, head_dim]``.
    """
    _, nh, nq, hd = q.shape
    group = nh // k.shape[1]
    qg = q.reshape(1, k.shape[1], group * nq, hd)  # row g * nq + i: head kv * group + g, query i
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.repeat(group, 1))
    return out.reshape(1, nh, nq, hd)


def attend_decode_grouped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    backend: str = "flash",
) -> torch.Tensor:
    """Attention for a batch of decode tokens, one per sequence, over padded contexts stored heads-first.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``, each sequence's newest token.
        k, v: ``[num_kv_heads, num_seqs, max_context_len, head_dim]`` (the paged pool's
            head-major gather, no copy needed to get here).
        mask: ``[num_seqs, max_context_len]`` float, added to the scores: 0 on each
            sequence's context, -inf on its padding; or None when no sequence is padded
            (K/V hold exactly each one's context). Built in the dtype attention computes in,
            once per step, so that no layer converts it.
        backend: ``"flash"`` (fused SDPA) or ``"math"`` (explicit scores).

    Returns:
        ``[num_seqs, num_heads, head_dim]``.
    """
    s, nh, hd = q.shape
    nkv = k.shape[0]
    # The query heads that share a KV head become that head's "query positions" (GQA without copying K/V).
    qg = q.view(s, nkv, nh // nkv, hd).transpose(0, 1)  # [nkv, S, group, hd]
    m = None if mask is None else mask[None, :, None, :].to(q.dtype)  # no copy when built in q's dtype
    if backend == "math":
        scores = torch.matmul(qg, k.transpose(-1, -2)) * (hd ** -0.5)
        scores = scores if m is None else scores + m
        out = torch.matmul(torch.softmax(_at_least_float32(scores), dim=-1).to(q.dtype), v)
    else:
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m)
    return out.transpose(0, 1).reshape(s, nh, hd)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or as it is when already wider (float64): softmax never narrows."""
    return x if x.dtype == torch.float64 else x.float()


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, head: int) -> torch.Tensor:
    """Softmax attention weights of one query head, ``[num_queries, context_len]`` float32.

    Used by X-Ray to draw the heatmap; q ``[num_queries, num_heads, head_dim]``,
    k ``[context_len, num_kv_heads, head_dim]``.
    """
    nq, nh, hd = q.shape
    kv_head = head // (nh // k.shape[1])
    scores = (q[:, head, :].float() @ k[:, kv_head, :].float().T) * (hd ** -0.5)
    if mask is None:
        mask = causal_mask(0, nq, k.shape[0], q.device)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
