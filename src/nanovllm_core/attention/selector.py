"""Which attention kernel serves a paged KV cache, and which block size lets the fastest one run.

Three kernels read the paged pool:

- ``"cpu-paged"``: this engine's C kernel (``attention.cpu_paged``) on the CPU in float32:
  every query token reads its keys and values in place through its block table, and its
  sums run in an order that no batch, chunking or thread count changes. It needs a C
  compiler with OpenMP on first use; where it cannot run (``cpu_paged.FALLBACK_CONDITIONS``),
  the engine falls back to ``"sdpa"`` (``"math"`` with ``--no-flash-attn``).
- ``"flash-attn"``: flash-attn 2's varlen kernel (``flash_attn_varlen_func`` with a
  ``block_table``) reads the blocks where they lie: no gather, no padding. It runs only where
  ``mha_varlen_fwd`` (flash-attn 2.8, ``csrc/flash_attn/flash_api.cpp``) accepts the call:
  a CUDA GPU of compute capability 8.0 (Ampere) or newer, float16 or bfloat16, a head size
  that is a multiple of 8 and at most 256, and pages (blocks) whose token count is divisible
  by 256. Anywhere else it refuses every forward pass, so it is chosen only when all hold.
- ``"sdpa"``: each step gathers the blocks it reads into a padded buffer and calls PyTorch's
  ``scaled_dot_product_attention`` (a fused kernel: on CUDA flash or memory-efficient, on the
  CPU its flash kernel). ``"math"`` is the same gather with the textbook formula instead.

vLLM makes the same choice per platform (its attention backend selector); here it is one
function, :func:`paged_attention_kernel`, and its answer is what ``LLMEngine.model_info()``
reports.
"""

from __future__ import annotations

import torch

# flash-attn 2's paged KV cache reads pages whose token count is divisible by this (FLASH_ATTN_PAGE_SIZE).
from nanovllm_core.attention.fallbacks import FLASH_ATTN_FALLBACK_CONDITIONS, FLASH_ATTN_PAGE_SIZE  # noqa: F401

# Tokens per block when flash-attn's paged kernel is not used: small blocks waste little of
# each sequence's last block and let the prefix cache share at a fine grain (vLLM's default).
DEFAULT_BLOCK_SIZE = 16
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """Compute capability ``(major, minor)`` of the configured CUDA device (not the current one)."""
    return torch.cuda.get_device_capability(device)


def _flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # ImportError, or an OSError/RuntimeError from a wheel built for another torch
        return False
    return True


def flash_attn_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> str | None:
    """Why flash-attn's paged varlen kernel cannot serve this cache, or None when it can.

    Mirrors the checks of ``mha_varlen_fwd`` in flash-attn 2.8 that depend on the
    configuration (device, dtype, head size, page size); the per-call ones (int32
    ``cu_seqlens`` and ``block_table``, contiguity) are the model runner's to meet.

    Args:
        device: where the KV cache lives.
        dtype: the model's and the cache's dtype.
        head_dim: elements per attention head.
        block_size: tokens per KV block (flash-attn's page size).
    """
    if device.type != "cuda":
        return f"it needs a CUDA GPU (the device is {device.type})"
    if dtype not in FLASH_ATTN_DTYPES:
        return f"it runs float16 and bfloat16 only (the dtype is {str(dtype).replace('torch.', '')})"
    major, minor = cuda_capability(device)
    if major < 8:
        return f"it needs compute capability 8.0 (Ampere) or newer (this GPU is {major}.{minor})"
    if head_dim % 8 or head_dim > 256:
        return f"it needs a head size that is a multiple of 8 and at most 256 (this model's is {head_dim})"
    if block_size % FLASH_ATTN_PAGE_SIZE:
        return f"it needs blocks of a multiple of {FLASH_ATTN_PAGE_SIZE} tokens (the block size is {block_size})"
    if not _flash_attn_importable():
        return "flash-attn is not installed (pip install flash-attn)"
    return None


def flash_attn_available(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """True when flash-attn's paged varlen kernel can serve this cache (see :func:`flash_attn_unsupported`)."""
    return flash_attn_unsupported(device, dtype, head_dim, block_size) is None


def default_block_size(device: torch.device, dtype: torch.dtype, head_dim: int, backend: str = "flash") -> int:
    """Tokens per block when none was asked for: 256 where flash-attn's paged kernel would run, else 16.

    flash-attn 2 reads pages of 256 tokens only; with smaller blocks every decode would
    gather its context instead, so on such a GPU the large block is the fast default. The
    ``"math"`` backend (explicit scores, for teaching) never uses flash-attn.
    """
    if backend == "flash" and flash_attn_available(device, dtype, head_dim, FLASH_ATTN_PAGE_SIZE):
        return FLASH_ATTN_PAGE_SIZE
    return DEFAULT_BLOCK_SIZE


def paged_attention_kernel(use_flash_attn: bool, backend: str, use_cpu_paged: bool = False) -> str:
    """The kernel a paged step runs: ``"flash-attn"``, ``"cpu-paged"``, ``"sdpa"`` (gather + fused SDPA) or ``"math"``."""
    if use_flash_attn:
        return "flash-attn"
    if use_cpu_paged:
        return "cpu-paged"
    return "sdpa" if backend == "flash" else "math"


def contiguous_attention_kernel(backend: str, use_cpu_paged: bool = False) -> str:
    """The kernel the contiguous baseline (``paged=False``) runs on each request's one KV region:
    ``"cpu-contiguous"`` (the CPU C kernel, handed the region as a single block), ``"sdpa"`` (fused
    SDPA over the region) or ``"math"``. Nothing is gathered: the region is already contiguous."""
    if use_cpu_paged:
        return "cpu-contiguous"
    return "sdpa" if backend == "flash" else "math"
