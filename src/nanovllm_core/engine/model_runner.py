"""The model runner: turn one step's plan into flat tensors and run the model once.

For a plan of S sequences with ``n_i`` new tokens each (``T = sum n_i``):

- ``input_ids [T]`` and ``positions [T]``: the new tokens and their positions (prefill chunks
  continue at ``num_computed_tokens``; a decode's position is its length - 1);
- ``slot_mapping [T]``: the KV slot each new token writes (from its block table);
- per decode, its context's slots (padded) and mask; per prefill chunk, its context's slots
  and causal mask offset by the cached tokens;
- ``sample_rows``: the index in ``[T]`` of the last token of each sequence that samples;
  only those rows go through the LM head, giving ``logits [num_sampling, vocab]``.

Decodes are placed first so attention can batch them. The paged pool is allocated here;
the contiguous baseline keeps one :class:`ContiguousKVCache` per running sequence instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm_core.attention.contiguous import ContiguousKVCache
from nanovllm_core.attention.ops import causal_mask
from nanovllm_core.attention.paged import (
    PagedAttention,
    PagedAttentionMetadata,
    PagedKVCache,
    PrefillChunk,
    flash_attn_available,
)
from nanovllm_core.engine.scheduler import ScheduledSequence
from nanovllm_core.model.llama import LlamaForCausalLM


@dataclass
class ForwardResult:
    """What one forward pass produced.

    ``logits [num_sampling_rows, vocab]`` float32, one row per entry of ``rows``;
    ``rows``: (scheduled sequence, index of the row's token among that sequence's new tokens).
    A plain step has one row per sampling sequence (its last token); a speculative
    verification asks for several rows of one sequence.
    """

    logits: torch.Tensor
    rows: list[tuple[ScheduledSequence, int]]
    num_tokens: int


class ModelRunner:
    """Owns the model and the KV cache; runs a step's batch.

    Args:
        model: our LLaMA.
        block_size, num_blocks: the paged pool's geometry (``paged=True``).
        paged: False uses one contiguous cache per sequence (the baseline).
        attention_backend: ``"flash"`` or ``"math"``.
        max_model_len: size of each contiguous cache.
        kv_cache: a paged pool to share instead of allocating one (self-speculative drafting
            writes its early layers into the target's pool).
    """

    def __init__(self, model: LlamaForCausalLM, block_size: int, num_blocks: int, paged: bool,
                 attention_backend: str, max_model_len: int, kv_cache: PagedKVCache | None = None) -> None:
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.block_size = block_size
        self.paged = paged
        self.backend = attention_backend
        self.max_model_len = max_model_len
        if kv_cache is None and paged:
            kv_cache = PagedKVCache(model.config, num_blocks, block_size, self.dtype, self.device)
        self.kv_cache = kv_cache
        self.contiguous: dict[int, ContiguousKVCache] = {}
        self.use_flash_attn = paged and flash_attn_available(self.device, block_size)
        self._block_offsets = torch.arange(block_size, device=self.device)

    @staticmethod
    def batch_order(scheduled: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """The order of sequences in the flat batch: single-token decodes first (stable otherwise)."""
        return sorted(scheduled, key=lambda s: s.num_new_tokens != 1)

    def release(self, seq_id: int) -> None:
        """Drop a finished or preempted sequence's contiguous cache (baseline mode)."""
        self.contiguous.pop(seq_id, None)

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSequence], tracer=None,
            extra_rows: dict[int, list[int]] | None = None) -> ForwardResult:
        """Run the model on one step's scheduled sequences.

        ``extra_rows`` (seq_id -> indices among its new tokens) asks for logits at more rows
        than the last one (speculative verification). Rows are returned in ``scheduled``
        order; within a sequence, in increasing index order.
        """
        order = self.batch_order(scheduled)
        if not self.paged:
            return self._run_contiguous(order, tracer, extra_rows)
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        for s in order:
            seq = s.seq
            ids.extend(seq.token_ids[s.start:s.start + s.num_new_tokens])
            pos.append(torch.arange(s.start, s.start + s.num_new_tokens))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions_cpu = torch.cat(pos)
        positions = positions_cpu.to(self.device)
        meta = self._build_metadata(order, positions_cpu)
        attn = PagedAttention(self.kv_cache, meta, self.backend, self.use_flash_attn)
        hidden = self.model(input_ids, positions, attn, tracer)
        return self._logits(order, hidden, extra_rows)

    def _logits(self, order, hidden, extra_rows) -> ForwardResult:
        rows: list[tuple[ScheduledSequence, int]] = []
        flat: list[int] = []
        offset = 0
        for s in order:
            wanted = sorted(set(extra_rows.get(s.seq.seq_id, [])) if extra_rows else set())
            if s.samples and s.num_new_tokens - 1 not in wanted:
                wanted.append(s.num_new_tokens - 1)
            for i in wanted:
                rows.append((s, i))
                flat.append(offset + i)
            offset += s.num_new_tokens
        if flat:
            sel = hidden.index_select(0, torch.tensor(flat, device=hidden.device))
            logits = self.model.compute_logits(sel)
        else:
            logits = hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return ForwardResult(logits=logits, rows=rows, num_tokens=offset)

    def _build_metadata(self, order: list[ScheduledSequence], positions: torch.Tensor) -> PagedAttentionMetadata:
        """positions ``[T]`` on the CPU -> the step's attention metadata on the model's device."""
        bs = self.block_size
        dev = self.device
        tables = [torch.tensor(s.seq.block_table, dtype=torch.long) for s in order]
        # slot of each new token: block_table[pos // bs] * bs + pos % bs
        slots = []
        offset = 0
        for s, table in zip(order, tables):
            p = positions[offset:offset + s.num_new_tokens]
            slots.append(table[p // bs] * bs + p % bs)
            offset += s.num_new_tokens
        slot_mapping = torch.cat(slots).to(dev)
        decodes = [i for i, s in enumerate(order) if s.num_new_tokens == 1]
        num_dec = len(decodes)
        decode_slots = decode_mask = None
        if num_dec:
            ctx_lens = torch.tensor([order[i].start + 1 for i in decodes], device=dev)
            max_ctx = int(ctx_lens.max())
            max_blocks = -(-max_ctx // bs)
            table = torch.zeros((num_dec, max_blocks), dtype=torch.long)
            for row, i in enumerate(decodes):
                t = tables[i][:max_blocks]
                table[row, : t.numel()] = t
            table = table.to(dev)
            decode_slots = (table[:, :, None] * bs + self._block_offsets).reshape(num_dec, -1)[:, :max_ctx]
            decode_mask = (torch.arange(max_ctx, device=dev)[None, :] < ctx_lens[:, None])[:, None, None, :]
        prefills = []
        token_start = num_dec
        for i, s in enumerate(order[num_dec:], start=num_dec):
            ctx = s.start + s.num_new_tokens
            t = tables[i].to(dev)
            ctx_slots = (t[:, None] * bs + self._block_offsets).reshape(-1)[:ctx]
            mask = None if s.start == 0 else causal_mask(s.start, s.num_new_tokens, ctx, dev)
            prefills.append(PrefillChunk(token_start, s.num_new_tokens, ctx_slots, mask, seq_index=i))
            token_start += s.num_new_tokens
        meta = PagedAttentionMetadata(slot_mapping=slot_mapping, num_decodes=num_dec,
                                      decode_slots=decode_slots, decode_mask=decode_mask, prefills=prefills)
        if self.use_flash_attn:  # pragma: no cover - needs CUDA + flash-attn
            q_lens = [s.num_new_tokens for s in order]
            k_lens = [s.start + s.num_new_tokens for s in order]
            meta.cu_seqlens_q = torch.tensor([0] + q_lens, device=dev).cumsum(0).to(torch.int32)
            meta.cu_seqlens_k = torch.tensor([0] + k_lens, device=dev).cumsum(0).to(torch.int32)
            width = max(t.numel() for t in tables)
            bt = torch.zeros((len(order), width), dtype=torch.int32)
            for r, t in enumerate(tables):
                bt[r, : t.numel()] = t
            meta.block_tables = bt.to(dev)
            meta.max_seqlen_q, meta.max_seqlen_k = max(q_lens), max(k_lens)
        return meta

    def _run_contiguous(self, order, tracer, extra_rows) -> ForwardResult:
        """Baseline: each sequence runs alone against its own contiguous cache."""
        hiddens = []
        for s in order:
            seq = s.seq
            cache = self.contiguous.get(seq.seq_id)
            if cache is None or s.start == 0:
                # Reserved up front for the longest this sequence may grow, as pre-paging servers did.
                limit = seq.params.max_tokens or self.max_model_len
                reserve = min(self.max_model_len, seq.num_prompt_tokens + limit)
                cache = ContiguousKVCache(self.model.config, reserve, self.dtype, self.device, self.backend)
                self.contiguous[seq.seq_id] = cache
            ids = torch.tensor(seq.token_ids[s.start:s.start + s.num_new_tokens], dtype=torch.long, device=self.device)
            positions = torch.arange(s.start, s.start + s.num_new_tokens, device=self.device)
            hiddens.append(self.model(ids, positions, cache.context(s.start, s.num_new_tokens), tracer))
        hidden = torch.cat(hiddens) if hiddens else torch.empty(0)
        return self._logits(order, hidden, extra_rows)
