"""The model runner: turn one step's plan into flat tensors and run the model once.

For a plan of S sequences with ``n_i`` new tokens each (``T = sum n_i``):

- ``input_ids [T]`` and ``positions [T]``: the new tokens and their positions (prefill chunks
  continue at ``num_computed_tokens``; a decode's position is its length - 1);
- ``slot_mapping [T]``: the KV slot each new token writes (from its block table);
- per decode, its block table (padded) and an additive mask over the padding; per prefill
  chunk that continues a cached context, its block table and causal mask offset by the
  cached tokens (a chunk starting at position 0 needs neither);
- ``sample_rows``: the index in ``[T]`` of the last token of each sequence that samples;
  only those rows go through the LM head, giving ``logits [num_sampling, vocab]``.

Decodes are placed first so attention can batch them. The paged pool is allocated here;
the contiguous baseline keeps one :class:`ContiguousKVCache` per running sequence instead.

Nothing here waits for the device: the step's integers are built as Python lists (bounds
checked as Python ints) and copied to the device from pinned memory with
``non_blocking=True`` (see ``nanovllm_core.transfer``); metadata the chosen attention kernel
never reads is not built (flash-attn reads ``cu_seqlens`` and block tables, the gather path
reads decode groups and prefill chunks).

Why this file runs past ~400 lines: the three attention kernels' metadata builders read the
same plan entries the same way, and belong beside the one ``execute`` that picks among them
(a tensor-parallel worker runs that same ``execute``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from nanovllm_core.attention import cpu_paged
from nanovllm_core.attention.contiguous import ContiguousKVCache
from nanovllm_core.attention.ops import causal_mask
from nanovllm_core.attention.paged import (
    DecodeGroup,
    PagedAttention,
    PagedAttentionMetadata,
    PagedKVCache,
    PrefillChunk,
)
from nanovllm_core.attention.selector import contiguous_attention_kernel, flash_attn_available, paged_attention_kernel
from nanovllm_core.engine.scheduler import ScheduledSequence
from nanovllm_core.model.llama import LlamaForCausalLM
from nanovllm_core.model.loader import warm_up
from nanovllm_core.transfer import Staging, to_device

# Decodes attended together (one gather, one attention call per layer). Groups of similar
# context length pad little; measured on 2 CPU cores with 64 decodes of 16-384 tokens, one
# group per 16 halves decode attention time against one group for all, and smaller groups
# gain nothing more.
DECODE_GROUP_SIZE = 16


@dataclass(frozen=True)
class PlanEntry:
    """One sequence's part of a step, as the forward pass reads it: what every tensor-parallel rank receives.

    ``token_ids``: its new tokens (``num_new_tokens`` of them, positions ``start``...);
    ``block_table``: the KV blocks covering positions ``[0, start + num_new_tokens)``. The same
    block ids name the same blocks on every rank (each rank's pool holds its own KV heads).
    """

    seq_id: int
    start: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


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
            writes its early layers into the target's pool, and reads it as the target does).
        workers: rank 0's handle on tensor-parallel workers (``engine.tensor_parallel.WorkerGroup``),
            or None. ``model`` is then this rank's shard (``model.tp`` set) and the pool holds its KV heads.
    """

    def __init__(self, model: LlamaForCausalLM, block_size: int, num_blocks: int, paged: bool,
                 attention_backend: str, max_model_len: int, kv_cache: PagedKVCache | None = None,
                 workers=None) -> None:
        self.model = model
        self.workers = workers
        self.tp_timing = None  # the last tensor-parallel step's per-rank timing (engine.tensor_parallel.StepTiming)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.block_size = block_size
        self.paged = paged
        self.backend = attention_backend
        self.max_model_len = max_model_len
        # K/V are kept in the model's dtype; a shared pool (self-speculative drafting) sets it.
        self.use_cpu_paged = (cpu_paged.available(self.device, self.dtype, attention_backend)
                              and (kv_cache is None or (kv_cache.heads_major and kv_cache.k[0].dtype == self.dtype)))
        self.kv_dtype = self.dtype if kv_cache is None else kv_cache.k[0].dtype
        # On the CPU each decode attends alone (no padding), so its sums run over its own context in
        # the same shapes whatever shares its batch: greedy output stays batch-invariant on the PyTorch
        # paths too (trial 21c: grouped, padded decodes moved float sums by ~1e-6, and block-format
        # weights' int8 activations turned that into other tokens). A GPU keeps the groups.
        self.decode_group_size = 1 if self.device.type == "cpu" else DECODE_GROUP_SIZE
        if kv_cache is not None:
            self.use_flash_attn = not kv_cache.heads_major
        else:
            self.use_flash_attn = (paged and attention_backend == "flash"
                                   and flash_attn_available(self.device, self.dtype, model.config.head_dim, block_size))
        if kv_cache is None and paged:
            # flash-attn's paged kernel reads blocks-first pages; the gather path wants heads first.
            # A tensor-parallel rank's pool holds its own KV heads only (model.parallel).
            cfg = model.tp.local_config(model.config) if getattr(model, "tp", None) is not None else model.config
            kv_cache = PagedKVCache(cfg, num_blocks, block_size, self.kv_dtype, self.device,
                                    heads_major=not self.use_flash_attn)
        self.kv_cache = kv_cache
        self.contiguous: dict[int, ContiguousKVCache] = {}

    @property
    def attention_kernel(self) -> str:
        """The kernel attention runs on: ``"flash-attn"``, ``"cpu-paged"``, ``"sdpa"`` or ``"math"``; the contiguous
        baseline's ``"cpu-contiguous"``, ``"sdpa"`` or ``"math"`` (see ``attention.selector``)."""
        if not self.paged:
            return contiguous_attention_kernel(self.backend, self.use_cpu_paged)
        return paged_attention_kernel(self.use_flash_attn, self.backend, self.use_cpu_paged)

    @staticmethod
    def batch_order(scheduled: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """The order of sequences in the flat batch: single-token decodes first, shortest context
        first (so :data:`DECODE_GROUP_SIZE` neighbours pad little), then the rest in plan order."""
        return sorted(scheduled, key=lambda s: (0, s.start) if s.num_new_tokens == 1 else (1, 0))

    def release(self, seq_id: int) -> None:
        """Drop a finished or preempted sequence's contiguous cache (baseline mode)."""
        self.contiguous.pop(seq_id, None)

    def run(self, scheduled: list[ScheduledSequence], tracer=None,
            extra_rows: dict[int, list[int]] | None = None) -> ForwardResult:
        """Run the model on one step's scheduled sequences.

        ``extra_rows`` (seq_id -> indices among its new tokens) asks for logits at more rows
        than the last one (speculative verification). Rows are returned in ``scheduled``
        order; within a sequence, in increasing index order.

        With tensor-parallel workers (``workers``), the step's plan (:class:`PlanEntry` list and
        the sampled rows) is sent to every worker once, every rank runs :meth:`execute` on it,
        and rank 0 (this process) gets the logits; ``tp_timing`` then holds each rank's
        compute and communication seconds for the step.

        Raises:
            ValueError: a position is beyond the model's rotary table.
            RuntimeError: (``TensorParallelError``) a worker died, hung or failed: the engine must stop.

        Builds no tensors itself: the forward passes it calls run under ``torch.inference_mode``
        (:meth:`execute`, :meth:`_run_contiguous`), entered once a step.
        """
        order = self.batch_order(scheduled)
        rows, flat_rows = self._sample_rows(order, extra_rows)
        if order:
            self.model.check_positions(max(s.start + s.num_new_tokens for s in order) - 1)
        if not self.paged:
            return self._run_contiguous(order, tracer, rows, flat_rows)
        bs = self.block_size
        entries = [PlanEntry(s.seq.seq_id, s.start, tuple(s.seq.token_ids[s.start:s.start + s.num_new_tokens]),
                             tuple(s.seq.block_table[: -(-(s.start + s.num_new_tokens) // bs)])) for s in order]
        if self.workers is None:
            logits = self.execute(entries, flat_rows, tracer)
        else:
            logits = self._execute_parallel(entries, flat_rows)
        return ForwardResult(logits=logits, rows=rows, num_tokens=sum(e.num_new_tokens for e in entries))

    def _execute_parallel(self, entries: list["PlanEntry"], flat_rows: list[int]) -> torch.Tensor:
        """One tensor-parallel step from rank 0: plan out to the workers, the same forward here, timings back."""
        tp, workers = self.model.tp, self.workers
        self.tp_timing = None
        workers.begin_step(entries, flat_rows)
        tp.reset_stats()
        t0 = time.perf_counter()
        try:
            logits = self.execute(entries, flat_rows)
        except Exception as e:  # a collective failed (a worker died or hung), or this rank did: the group is out of step
            raise workers.failure(e) from e
        wall = time.perf_counter() - t0
        mine = tp.reset_stats()
        self.tp_timing = workers.end_step(wall, mine)
        return logits

    @torch.inference_mode()
    def execute(self, entries: list["PlanEntry"], flat_rows: list[int], tracer=None) -> torch.Tensor | None:
        """The forward pass of a plan, on this rank: flat tensors, attention metadata, model, LM head.

        ``entries`` in batch order (decodes first); ``flat_rows``: indices in ``[T]`` that need
        logits. Returns logits ``[len(flat_rows), vocab]`` float32 (None on a tensor-parallel
        worker, whose slice of the vocabulary went to rank 0).
        """
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for e in entries:
            table, end = e.block_table, e.start + e.num_new_tokens
            ids.extend(e.token_ids)
            positions.extend(range(e.start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(e.start, end))
        staged = Staging(torch.long)
        for values in (ids, positions, slots, flat_rows):
            staged.add(values)
        input_ids, pos, slot_mapping, sample_index = staged.upload(self.device)
        if self.use_flash_attn:
            meta = self._flash_attn_metadata(entries, slot_mapping)
        elif self.use_cpu_paged:
            meta = self._cpu_paged_metadata(entries, slot_mapping)
        else:
            meta = self._gather_metadata(entries, slot_mapping)
        attn = PagedAttention(self.kv_cache, meta, self.backend, self.use_flash_attn, self.use_cpu_paged)
        hidden = self.model(input_ids, pos, attn, tracer)
        if not flat_rows:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        if len(flat_rows) == len(ids) and flat_rows == list(range(len(ids))):  # every row in order (decodes): no copy
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden.index_select(0, sample_index))

    def warm_up(self) -> None:
        """The first forward pass's one-time costs (``loader.warm_up``), on every rank together."""
        if self.workers is not None:
            self.workers.warm_up()
        warm_up(self.model)
        if self.workers is not None:
            self.model.tp.reset_stats()
            self.workers.wait_all("warm_up")

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.workers is not None:
            self.workers.shutdown()

    @staticmethod
    def _sample_rows(order, extra_rows) -> tuple[list[tuple[ScheduledSequence, int]], list[int]]:
        """Which rows need logits: (sequence, index among its new tokens) and the row's index in ``[T]``."""
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
        return rows, flat

    def _logits(self, hidden: torch.Tensor, rows, sample_index: torch.Tensor, num_tokens: int) -> ForwardResult:
        if rows:
            logits = self.model.compute_logits(hidden.index_select(0, sample_index))
        else:
            logits = hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return ForwardResult(logits=logits, rows=rows, num_tokens=num_tokens)

    @staticmethod
    def _num_decodes(order: list) -> int:
        num_dec = 0
        while num_dec < len(order) and order[num_dec].num_new_tokens == 1:
            num_dec += 1
        return num_dec

    def _gather_metadata(self, order: list["PlanEntry"], slot_mapping: torch.Tensor) -> PagedAttentionMetadata:
        """The gather path's metadata, built once (one host-to-device copy) and shared by every layer.

        ``order``: decodes (one new token each) first; ``slot_mapping`` ``[T]`` on the model's device.
        """
        bs, dev = self.block_size, self.device
        num_dec = self._num_decodes(order)
        staged = Staging(torch.long)
        groups = []  # (first, size, width in blocks, handle of the padded tables, handle of the context lengths, longest)
        size = self.decode_group_size
        for first in range(0, num_dec, size):
            members = order[first:min(first + size, num_dec)]
            ctx_lens = [s.start + 1 for s in members]
            width = -(-max(ctx_lens) // bs)  # blocks of the group's longest context
            rows: list[int] = []
            for s, ctx in zip(members, ctx_lens):
                used = list(s.block_table[: -(-ctx // bs)])
                rows.extend(used)
                rows.extend([0] * (width - len(used)))  # padding reads block 0; the mask hides it
            groups.append((first, len(members), width, staged.add(rows), staged.add(ctx_lens), max(ctx_lens)))
        chunks = []  # (token_start, num_tokens, start, handle of the block table or None, index in order)
        token_start = num_dec
        for i, s in enumerate(order[num_dec:], start=num_dec):
            ctx = s.start + s.num_new_tokens
            # A chunk continuing a cached context gathers it; one starting at 0 attends over its own K/V.
            table = staged.add(list(s.block_table[: -(-ctx // bs)])) if s.start > 0 else None
            chunks.append((token_start, s.num_new_tokens, s.start, table, i))
            token_start += s.num_new_tokens
        t = staged.upload(dev)
        decode_groups = []
        mask_dtype = self.dtype  # the dtype attention adds it in: no layer converts it
        for first, size, width, blocks, lens, longest in groups:
            mask = None  # a lone decode: no padding, its gathered keys are cut to its context
            if size > 1:
                mask = torch.zeros((size, width * bs), dtype=mask_dtype, device=dev)
                mask.masked_fill_(torch.arange(width * bs, device=dev)[None, :] >= t[lens][:, None], float("-inf"))
            decode_groups.append(DecodeGroup(first, size, t[blocks], mask, longest))
        prefills = [
            PrefillChunk(a, n, start, None if table is None else t[table],
                         None if table is None else causal_mask(start, n, start + n, dev), seq_index=i)
            for a, n, start, table, i in chunks
        ]
        return PagedAttentionMetadata(slot_mapping=slot_mapping, num_decodes=num_dec,
                                      decode_groups=decode_groups, prefills=prefills)

    def _flash_attn_metadata(self, order: list["PlanEntry"], slot_mapping: torch.Tensor) -> PagedAttentionMetadata:
        """flash-attn's varlen arguments: int32 ``cu_seqlens_q``/``cu_seqlens_k`` ``[S + 1]`` and
        ``block_tables`` ``[S, max_blocks]`` (rows padded with block 0, never read past ``seqlen_k``)."""
        bs = self.block_size
        q_lens = [s.num_new_tokens for s in order]
        k_lens = [s.start + s.num_new_tokens for s in order]
        width = max(-(-k // bs) for k in k_lens)
        tables: list[int] = []
        for s, k in zip(order, k_lens):
            used = s.block_table[: -(-k // bs)]
            tables.extend(used)
            tables.extend([0] * (width - len(used)))
        staged = Staging(torch.int32)
        for values in (list(itertools.accumulate(q_lens, initial=0)), list(itertools.accumulate(k_lens, initial=0)),
                       tables):
            staged.add(values)
        cu_q, cu_k, block_tables = staged.upload(self.device)
        return PagedAttentionMetadata(slot_mapping=slot_mapping, num_decodes=self._num_decodes(order),
                                      cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      block_tables=block_tables.view(len(order), width),
                                      max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens))

    def _cpu_paged_metadata(self, order: list["PlanEntry"], slot_mapping: torch.Tensor) -> PagedAttentionMetadata:
        """The CPU paged kernel's arguments, one copy for every layer: ``block_tables`` ``[S, max_blocks]``
        int32 (rows padded with block 0, never read past a token's context), and per token its row
        (``token_rows [T]``) and its context length, position + 1 (``token_context [T]``).

        Raises:
            ValueError: a block table too short for its sequence's context or naming a block
                outside the pool (the kernel reads raw memory, so this is checked here, once a step).
        """
        bs, nb = self.block_size, self.kv_cache.num_blocks
        k_lens = [s.start + s.num_new_tokens for s in order]
        width = max(-(-k // bs) for k in k_lens)
        tables: list[int] = []
        rows: list[int] = []
        context: list[int] = []
        for i, (s, k) in enumerate(zip(order, k_lens)):
            used = s.block_table[: -(-k // bs)]
            if len(used) * bs < k or any(not 0 <= b < nb for b in used):
                raise ValueError(f"sequence {s.seq_id}'s block table {used} cannot hold its {k} token{'s' if k != 1 else ''} "
                                 f"in a pool of {nb} block{'s' if nb != 1 else ''}")
            tables.extend(used)
            tables.extend([0] * (width - len(used)))
            rows.extend([i] * s.num_new_tokens)
            context.extend(range(s.start + 1, k + 1))
        staged = Staging(torch.int32)
        for values in (tables, rows, context):
            staged.add(values)
        block_tables, token_rows, token_context = staged.upload(self.device)
        return PagedAttentionMetadata(slot_mapping=slot_mapping, num_decodes=self._num_decodes(order),
                                      block_tables=block_tables.view(len(order), width), token_rows=token_rows,
                                      token_context=token_context, max_seqlen_k=max(k_lens))

    @torch.inference_mode()
    def _run_contiguous(self, order, tracer, rows, flat_rows) -> ForwardResult:
        """Baseline: each sequence runs alone against its own contiguous cache."""
        hiddens = []
        for s in order:
            seq = s.seq
            cache = self.contiguous.get(seq.seq_id)
            if cache is None or s.start == 0:
                # Reserved up front for the longest this sequence may grow, as pre-paging servers did: the
                # slots the scheduler took for it at admission (Scheduler.reservation, rounded up to whole
                # blocks of the pool's accounting), so stats() counts exactly the memory held here.
                reserve = len(seq.block_table) * self.block_size
                cache = ContiguousKVCache(self.model.config, reserve, self.kv_dtype, self.device, self.backend,
                                          self.use_cpu_paged)
                self.contiguous[seq.seq_id] = cache
            ids = to_device(seq.token_ids[s.start:s.start + s.num_new_tokens], torch.long, self.device)
            positions = torch.arange(s.start, s.start + s.num_new_tokens, device=self.device)
            hiddens.append(self.model(ids, positions, cache.context(s.start, s.num_new_tokens), tracer))
        hidden = torch.cat(hiddens) if hiddens else torch.empty(0)
        return self._logits(hidden, rows, to_device(flat_rows, torch.long, self.device), sum(q.num_new_tokens for q in order))
