"""The CPU PagedAttention kernel: reads K/V in place through block tables, in a batch-invariant order.

The kernel is ``paged_attention_cpu.c`` beside this file, about a hundred lines of C: for
each (query token, KV head) it walks the token's context key by key through its sequence's
block table (Kwon et al. 2023, section 4.1, as vLLM's CPU backend does), so no step copies
a sequence's blocks into a contiguous buffer first. Against the gather + SDPA path it reads
each cached number once instead of three times (read, write the copy, read the copy).

Every sum in it runs in an order fixed by the token alone (see the C file's header), so a
token gets the same bits alone or in any batch, chunk or thread count.

It is compiled on first use with the system's C compiler and OpenMP, for this CPU, and
cached (``nanovllm_core.native``). Where it cannot run (no compiler, a failed build, a
dtype other than float32, a GPU, the ``math`` backend, or
``NANOVLLM_CPU_PAGED_ATTENTION=0``), the engine gathers and uses SDPA as before, and
:func:`unsupported_reason` says why.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from nanovllm_core import native
from nanovllm_core.attention.fallbacks import ENV_SWITCH, FALLBACK_CONDITIONS  # noqa: F401  (kept where the tutorial reads them)

SOURCE = Path(__file__).with_name("paged_attention_cpu.c")

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    "paged_attention": (ctypes.c_int, [_p, _i64] + [_p] * 6 + [_i32] * 8 + [ctypes.c_float, _i32]),
    "write_kv": (ctypes.c_int, [_p, _i64, _p, _i64, _p, _i64, _i32, _i32, _i64, _p, _p]),
}


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    return native.load(SOURCE, SIGNATURES)


def unsupported_reason(device: torch.device, dtype: torch.dtype, backend: str) -> str | None:
    """Why the CPU paged kernel cannot serve this cache, or None when it can (compiling it if needed).

    Args:
        device: where the model and the KV cache live.
        dtype: the model's dtype (the kernel reads and writes float32).
        backend: ``"flash"`` (fused attention) or ``"math"`` (explicit score matrix, for teaching).
    """
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0 turned it off"
    if device.type != "cpu":
        return f"it runs on the CPU (the device is {device.type})"
    if dtype != torch.float32:
        return f"it runs float32 only (the dtype is {str(dtype).replace('torch.', '')})"
    if backend != "flash":
        return "the math backend keeps the explicit score matrix"
    return _load()[1]


def available(device: torch.device, dtype: torch.dtype, backend: str) -> bool:
    """True when the CPU paged kernel can serve this cache (see :func:`unsupported_reason`)."""
    return unsupported_reason(device, dtype, backend) is None


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    token_rows: torch.Tensor, token_context: torch.Tensor, max_context: int) -> torch.Tensor:
    """Attention for a flat batch of query tokens, each over its own context in the paged pool.

    Args:
        q: ``[T, num_heads, head_dim]`` float32; its token rows may be strided (a view of the packed
            qkv projection), its heads and elements dense (else it is copied).
        k_pool, v_pool: one layer's pool, head-major ``[num_kv_heads, num_blocks, block_size, head_dim]``
            float32, contiguous (``PagedKVCache.k_by_head[layer]``).
        block_tables: ``[S, max_blocks]`` int32, one padded row per sequence.
        token_rows: ``[T]`` int32, the row of ``block_tables`` each token's sequence uses.
        token_context: ``[T]`` int32, keys each token attends (its position + 1: causal).
        max_context: the largest entry of ``token_context`` (sizes the kernel's scratch).

    Returns:
        ``[T, num_heads, head_dim]`` float32: ``softmax(q k^T / sqrt(head_dim)) v`` per token, query
        head ``h`` reading KV head ``h // (num_heads / num_kv_heads)`` (GQA).

    Raises:
        RuntimeError: the kernel is not available here (see :func:`unsupported_reason`) or ran out of memory.
        ValueError: a tensor of the wrong dtype, layout or shape.
    """
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"the CPU paged attention kernel is not available: {why}")
    t, nh, hd = q.shape
    if q.stride(2) != 1 or q.stride(1) != hd:
        q = q.contiguous()
    nkv, nb, bs, hd2 = k_pool.shape
    if q.dtype != torch.float32 or k_pool.dtype != torch.float32 or v_pool.dtype != torch.float32:
        raise ValueError("the CPU paged attention kernel takes float32 q, K and V")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()) or v_pool.shape != k_pool.shape or hd2 != hd:
        raise ValueError(f"K/V pools must be contiguous [num_kv_heads, num_blocks, block_size, {hd}] alike; "
                         f"got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    if nh % nkv:
        raise ValueError(f"{nh} query heads cannot share {nkv} KV heads evenly")
    for name, x in (("block_tables", block_tables), ("token_rows", token_rows), ("token_context", token_context)):
        if x.dtype != torch.int32 or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor")
    out = torch.empty((t, nh, hd), dtype=q.dtype)
    if t == 0:
        return out
    rc = lib.paged_attention(q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(),
                             block_tables.data_ptr(), token_rows.data_ptr(), token_context.data_ptr(),
                             t, nh, nkv, hd, nb, bs, block_tables.shape[1], max(1, max_context),
                             hd ** -0.5, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("the CPU paged attention kernel could not allocate its scratch memory")
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_pool: torch.Tensor,
             v_pool: torch.Tensor) -> None:
    """Write the step's new K/V into their slots of one layer's head-major pool (the cache write
    before attention), in C: one call instead of two ``index_copy_`` into a strided view.

    Args:
        k, v: ``[T, num_kv_heads, head_dim]`` float32; token rows may be strided (views of the packed
            qkv projection), heads and elements dense (else they are copied).
        slot_mapping: ``[T]`` int64, slot = block id * block_size + offset in the block.
        k_pool, v_pool: ``[num_kv_heads, num_blocks, block_size, head_dim]`` float32, contiguous.

    Raises:
        RuntimeError: the kernel is not available here.
        ValueError: wrong dtypes or shapes, or a slot outside the pool (nothing is written then).
    """
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"the CPU paged attention kernel is not available: {why}")
    nkv, nb, bs, hd = k_pool.shape
    k, v = (x if x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous() for x in (k, v))
    if (k.dtype != torch.float32 or v.dtype != torch.float32 or k_pool.dtype != torch.float32
            or v_pool.dtype != torch.float32 or slot_mapping.dtype != torch.int64):
        raise ValueError("write_kv takes float32 K/V and pools and int64 slots")
    if (k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (nkv, hd) or v_pool.shape != k_pool.shape
            or not (k_pool.is_contiguous() and v_pool.is_contiguous()) or slot_mapping.shape != (k.shape[0],)):
        raise ValueError(f"K/V {tuple(k.shape)} and slots {tuple(slot_mapping.shape)} do not fit pools {tuple(k_pool.shape)}")
    slot_mapping = slot_mapping.contiguous()
    if lib.write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), k.shape[0], nkv, hd, nb * bs,
                    k_pool.data_ptr(), v_pool.data_ptr()) != 0:
        raise ValueError(f"a slot in the slot mapping lies outside the pool's {nb * bs} slots")
