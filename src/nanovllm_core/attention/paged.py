"""PagedAttention: the KV cache as a pool of fixed-size blocks, read through block tables.

Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", section 4.1. The cache of each layer is ``[num_blocks, block_size,
num_kv_heads, head_dim]``; a sequence's logical token ``i`` lives in physical block
``block_table[i // block_size]`` at offset ``i % block_size``, i.e. in *slot*
``block_table[i // block_size] * block_size + i % block_size``.

Per step, the model runner builds one :class:`PagedAttentionMetadata` for the whole flat
batch; every layer reuses it:

1. the new tokens' K/V are written to their slots (``slot_mapping``);
2. decode tokens (one per sequence, put first in the batch) gather their contexts into a
   padded ``[num_decodes, num_kv_heads, max_context, head_dim]`` and run one batched attention;
3. each prefill chunk (or multi-token verification) gathers its sequence's context and
   attends with a causal mask offset by the tokens already cached.

On CUDA with flash-attn installed and ``block_size`` a multiple of 256, flash-attn's
varlen kernel reads the blocks in place instead (it needs pages of 256 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanovllm_core.attention.ops import attend_decode_batch, attend_sequence
from nanovllm_core.model.llama import ModelConfig


def flash_attn_available(device: torch.device, block_size: int) -> bool:
    """True when flash-attn's paged varlen kernel can serve this cache (CUDA, importable, 256-token pages)."""
    if device.type != "cuda" or block_size % 256 != 0:
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class PagedKVCache:
    """The physical KV pool: per layer, K and V tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Zero-initialised, so padded reads of never-written slots are finite (masked scores of
    NaN would poison the softmax).
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        # Flat slot views ``[num_blocks * block_size, num_kv_heads, head_dim]``; same storage.
        self.k_slots = [t.view(-1, shape[2], shape[3]) for t in self.k]
        self.v_slots = [t.view(-1, shape[2], shape[3]) for t in self.v]

    @property
    def nbytes(self) -> int:
        """Bytes held by the whole pool (all layers, K and V)."""
        t = self.k[0]
        return t.numel() * t.element_size() * 2 * len(self.k)

    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.nbytes // self.num_blocks


@dataclass
class PrefillChunk:
    """One sequence's multi-token slice of the flat batch.

    ``token_start``: index of its first token in the batch; ``num_tokens``: its length;
    ``context_slots`` ``[context_len]``: slots of all its tokens so far, this chunk's included;
    ``mask`` ``[num_tokens, context_len]``: causal mask offset by the cached tokens, or None
    when the chunk is the whole context (a plain causal square).
    """

    token_start: int
    num_tokens: int
    context_slots: torch.Tensor
    mask: torch.Tensor | None
    seq_index: int = 0


@dataclass
class PagedAttentionMetadata:
    """Everything attention needs about one step's flat batch of ``T`` tokens.

    - ``slot_mapping`` ``[T]``: where each new token's K/V is written.
    - ``num_decodes``: the first ``num_decodes`` tokens are decodes, one per sequence.
    - ``decode_slots`` ``[num_decodes, max_context]``: slots of each decode's context (padded with 0).
    - ``decode_mask`` ``[num_decodes, 1, 1, max_context]``: False on padding.
    - ``prefills``: the multi-token chunks after the decodes.
    - flash-attn fields (``cu_seqlens_q``, ``cu_seqlens_k``, ``block_tables``, maxima), filled
      only when that kernel is used.
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk] = field(default_factory=list)
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


class PagedAttention:
    """The attention context handed to the model for one step over the paged pool."""

    def __init__(self, cache: PagedKVCache, meta: PagedAttentionMetadata, backend: str = "flash", use_flash_attn: bool = False):
        self.cache = cache
        self.meta = meta
        self.backend = backend
        self.use_flash_attn = use_flash_attn and backend == "flash"

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, num_heads, head_dim]``, k/v ``[T, num_kv_heads, head_dim]`` -> ``[T, num_heads, head_dim]``."""
        meta = self.meta
        k_slots, v_slots = self.cache.k_slots[layer_idx], self.cache.v_slots[layer_idx]
        k_slots.index_copy_(0, meta.slot_mapping, k)
        v_slots.index_copy_(0, meta.slot_mapping, v)
        if self.use_flash_attn:
            return self._flash_attn(layer_idx, q)
        out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            s, ctx = meta.decode_slots.shape
            nkv, hd = k.shape[1], k.shape[2]
            idx = meta.decode_slots.reshape(-1)
            kd = k_slots.index_select(0, idx).view(s, ctx, nkv, hd).transpose(1, 2)
            vd = v_slots.index_select(0, idx).view(s, ctx, nkv, hd).transpose(1, 2)
            out[:d] = attend_decode_batch(q[:d], kd, vd, meta.decode_mask, self.backend)
        for chunk in meta.prefills:
            a, b = chunk.token_start, chunk.token_start + chunk.num_tokens
            kc = k_slots.index_select(0, chunk.context_slots)
            vc = v_slots.index_select(0, chunk.context_slots)
            out[a:b] = attend_sequence(q[a:b], kc, vc, chunk.mask, self.backend)
        return out

    def _flash_attn(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:  # pragma: no cover - needs CUDA
        from flash_attn import flash_attn_varlen_func

        m = self.meta
        return flash_attn_varlen_func(
            q, self.cache.k[layer_idx], self.cache.v[layer_idx],
            cu_seqlens_q=m.cu_seqlens_q, cu_seqlens_k=m.cu_seqlens_k,
            max_seqlen_q=m.max_seqlen_q, max_seqlen_k=m.max_seqlen_k,
            causal=True, block_table=m.block_tables,
        )
