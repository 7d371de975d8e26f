"""The non-paged baseline: one contiguous KV buffer per sequence, reserved up front.

This is how inference worked before PagedAttention (Kwon et al. 2023, section 3): each
sequence gets ``[max_len, num_kv_heads, head_dim]`` per layer the moment it starts, used or
not. It is kept for comparison (``--no-paged-attention``) and as the reference the paged
engine's outputs are checked against.
"""

from __future__ import annotations

import torch

from nanovllm_core.attention.ops import attend_sequence, causal_mask
from nanovllm_core.model.llama import ModelConfig


class ContiguousKVCache:
    """K and V for one sequence: two tensors ``[num_layers, max_len, num_kv_heads, head_dim]``.

    ``sum_dtype``: None, or a wider dtype the attention arithmetic runs in (float64 in int8 mode).
    Use :meth:`context` to get the attention context for a forward pass that processes
    positions ``start .. start + num_tokens - 1``.

    Raises:
        ValueError: a forward pass would write beyond ``max_len``.
    """

    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device, backend: str = "flash",
                 sum_dtype: torch.dtype | None = None):
        shape = (cfg.num_hidden_layers, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.backend = backend
        self.sum_dtype = sum_dtype

    @property
    def nbytes(self) -> int:
        """Bytes reserved for this sequence, whether filled or not."""
        return self.k.numel() * self.k.element_size() * 2

    def context(self, start: int, num_tokens: int) -> "_ContiguousContext":
        if start + num_tokens > self.max_len:
            raise ValueError(f"sequence of {start + num_tokens} tokens exceeds the reserved cache of {self.max_len}")
        return _ContiguousContext(self, start, num_tokens)


class _ContiguousContext:
    def __init__(self, cache: ContiguousKVCache, start: int, num_tokens: int) -> None:
        self.cache = cache
        self.start = start
        self.end = start + num_tokens
        self.mask = None if start == 0 else causal_mask(start, num_tokens, self.end, cache.k.device)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, num_heads, head_dim]``, k/v ``[T, num_kv_heads, head_dim]`` -> ``[T, num_heads, head_dim]``."""
        self.cache.k[layer_idx, self.start:self.end] = k
        self.cache.v[layer_idx, self.start:self.end] = v
        return attend_sequence(
            q, self.cache.k[layer_idx, : self.end], self.cache.v[layer_idx, : self.end], self.mask, self.cache.backend,
            self.cache.sum_dtype,
        )
