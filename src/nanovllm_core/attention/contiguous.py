"""The non-paged baseline: one contiguous KV buffer per sequence, reserved up front.

This is how inference worked before PagedAttention (Kwon et al. 2023, section 3): each
sequence gets ``max_len`` slots of K and V per layer the moment it starts, used or
not. It is kept for comparison (``--no-paged-attention``) and as the reference the paged
engine's outputs are checked against.
"""

from __future__ import annotations

import torch

from nanovllm_core.attention import cpu_paged
from nanovllm_core.attention.ops import attend_sequence, causal_mask
from nanovllm_core.config import ModelConfig


class ContiguousKVCache:
    """K and V for one sequence, ``[num_layers, max_len, num_kv_heads, head_dim]`` each (``k``, ``v``).

    Stored head-major, ``[num_layers, num_kv_heads, max_len, head_dim]``, with ``k``/``v``
    views in token order: to the CPU paged kernel each layer is then a pool of one block of
    ``max_len`` tokens, read through the one-entry block table ``[0]``.

    ``use_cpu_paged``: attend with the CPU paged kernel
    (``attention.cpu_paged``, float32) instead of ``attend_sequence``.
    Use :meth:`context` to get the attention context for a forward pass that processes
    positions ``start .. start + num_tokens - 1``.

    Raises:
        ValueError: a forward pass would write beyond ``max_len``.
    """

    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device, backend: str = "flash",
                 use_cpu_paged: bool = False):
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k_by_head = torch.zeros(shape, dtype=dtype, device=device)
        self.v_by_head = torch.zeros(shape, dtype=dtype, device=device)
        self.k = self.k_by_head.transpose(1, 2)
        self.v = self.v_by_head.transpose(1, 2)
        self.max_len = max_len
        self.backend = backend
        self.use_cpu_paged = use_cpu_paged

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
        dev = cache.k.device
        self.mask = None if start == 0 or cache.use_cpu_paged else causal_mask(start, num_tokens, self.end, dev)
        if cache.use_cpu_paged:  # one block, table [0]; each token attends its position + 1 keys
            self.table = torch.zeros((1, 1), dtype=torch.int32, device=dev)
            self.rows = torch.zeros(num_tokens, dtype=torch.int32, device=dev)
            self.context_lens = torch.arange(start + 1, self.end + 1, dtype=torch.int32, device=dev)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, num_heads, head_dim]``, k/v ``[T, num_kv_heads, head_dim]`` -> ``[T, num_heads, head_dim]``."""
        c = self.cache
        c.k[layer_idx, self.start:self.end] = k
        c.v[layer_idx, self.start:self.end] = v
        if c.use_cpu_paged:
            nkv, n, hd = c.k_by_head.shape[1:]
            return cpu_paged.paged_attention(q, c.k_by_head[layer_idx].view(nkv, 1, n, hd),
                                             c.v_by_head[layer_idx].view(nkv, 1, n, hd),
                                             self.table, self.rows, self.context_lens, self.end)
        return attend_sequence(q, c.k[layer_idx, : self.end], c.v[layer_idx, : self.end], self.mask, c.backend)
