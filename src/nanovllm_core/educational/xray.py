"""X-Ray capture: what each decoder layer computed in one step, seen from one request.

The model calls a ``LayerTracer``'s hooks while it runs (only when one is passed, so normal
steps pay nothing). Shapes are reported as the engine really holds them: every operation but
attention runs on the step's flat batch (``[T, hidden]``, ``[T, heads, head_dim]`` over all
the scheduled sequences' tokens, the heart of continuous batching), and attention per
sequence over that sequence's context. The traced request's rows are a slice of the batch;
the sampled values are its last token's. The tracer recomputes that request's attention
weights from its query and cached keys (the fused kernel never stores them) for the heatmap,
and emits one ``LayerTrace`` event per layer with each operation's math, FLOPs and bytes as
the chosen attention backend moves them (``educational/xray_costs.py``) and the machine's
measured roofline (``nanovllm_core.roofline``).

What is captured: the selected layer only once a viewer chose one with ``select`` (the app's
X-Ray tab, a server's X-Ray watcher, the tutorial), every layer before any choice or when the
chooser asks for all (the CLI's ``--xray`` prints them all). The model runs the layers it does
not trace through its one-call C layers where it has them (``model/llama.py``), so the same
bits come out either way.

Cost: the captured layers run step by step in Python, and each recomputes one score matrix for
one request, about the cost of that request's own attention. With one layer captured a traced
step took 1.26x-1.41x an untraced one, with every layer (``--xray``) 3.4x-4.2x (a shared
2-core AMD EPYC, default model Q4_1; docs/serving.md says how it was measured).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

from nanovllm_core import events as ev
from nanovllm_core import roofline
from nanovllm_core.educational.xray_blocks import block_tensor
from nanovllm_core.educational.xray_costs import LayerDims, SeqAttention, compute_bound_tokens, layer_ops

if TYPE_CHECKING:  # pragma: no cover
    from nanovllm_core.engine.llm_engine import LLMEngine
    from nanovllm_core.engine.scheduler import ScheduledSequence, SchedulerOutput

HEATMAP_MAX_QUERIES = 48  # the newest query rows kept for the heatmap
HEATMAP_MAX_COLUMNS = 1024  # key columns kept; a longer context is summed into this many bins
SAMPLE_VALUES = 4


def _sample(t: torch.Tensor) -> tuple[float, ...]:
    return tuple(round(float(v), 5) for v in t.reshape(-1)[:SAMPLE_VALUES].tolist())


def backend_of(engine: "LLMEngine") -> str:
    """``"fused"``, ``"math"``, ``"cpu_paged"``, ``"cpu_contiguous"`` or ``"flash_attn"``: what computes
    attention in this engine (``cpu_contiguous``: the contiguous baseline's region read by the C kernel)."""
    if engine.runner.paged and engine.runner.use_flash_attn:
        return "flash_attn"
    if engine.runner.use_cpu_paged:
        return "cpu_paged" if engine.runner.paged else "cpu_contiguous"
    return "math" if engine.config.attention_backend == "math" else "fused"


def layer_dims(engine: "LLMEngine") -> LayerDims:
    """The engine model's decoder-layer sizes and element size (bytes)."""
    c = engine.model_config
    layer = engine.model.layers[0]
    linears = [m for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
               if hasattr(m, "weight_bytes")]
    weight_elem = (sum(m.weight_bytes for m in linears) / sum(m.out_features * m.in_features for m in linears)
                   if linears else 0.0)  # before the loader built the layers: the dtype's size
    kv_dtype = getattr(engine, "kv_dtype", engine.dtype)
    return LayerDims(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                     torch.empty((), dtype=engine.dtype).element_size(), weight_elem,
                     torch.empty((), dtype=kv_dtype).element_size(),
                     tuple(m.weight_bytes for m in linears) if len(linears) == 4 else (),
                     tuple(_kind(m) for m in linears) if len(linears) == 4 else ())


def _kind(module) -> str:
    """A linear module's weight format: its ``kind`` (``"q4_1"``, ``"q8_0"``) or its weight's dtype (``"float32"``)."""
    kind = getattr(module, "kind", None)
    if kind:
        return str(kind)
    weight = module._parameters.get("weight")
    return str(weight.dtype).replace("torch.", "") if weight is not None else ""


def roofline_key(engine: "LLMEngine") -> tuple:
    """(device, dtype, path, quantization): the arguments naming this engine's float roofline in
    ``nanovllm_core.roofline`` (the float matmul's peak serves every mode; the mode names the weights)."""
    return engine.device, engine.dtype, None, getattr(engine.model, "quantization", None)


def block_modules(engine: "LLMEngine") -> list:
    """What ``roofline.block_peak`` times for each block format's kernel: layer 0's projections, the
    largest of each format, and the LM head when its format is none of theirs (a Q8_0 head tied to
    the embedding beside Q4_1 layers: the decode chapter places its weights too). Empty for float weights."""
    model = engine.model
    layer = model.layers[0]
    largest: dict[str, object] = {}
    for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        if getattr(m, "packed", None) is None or not getattr(m, "kind", None):
            continue
        best = largest.get(m.kind)
        if best is None or m.out_features * m.in_features > best.out_features * best.in_features:
            largest[m.kind] = m
    head = model._modules.get("lm_head")
    if getattr(head, "packed", None) is not None and getattr(head, "kind", None) and head.kind not in largest:
        # its first rows, as many as a layer's widest projection has: the same kernel over a slice, not
        # 49,152 rows of vocabulary (7 GFLOP a run at 128 tokens)
        rows = max([m.out_features for m in largest.values()] + [4 * engine.model_config.hidden_size])
        largest[head.kind] = head.first_rows(rows) if hasattr(head, "first_rows") else head
    return list(largest.values())


def engine_roofline(engine: "LLMEngine", measure: bool = True) -> roofline.Roofline | None:
    """This engine's roofline: the float matmul's peak and the bandwidth (``roofline.machine_roofline``)
    with, under a block mode, the peak of each block kernel its projections run, timed on layer 0's
    weights (``roofline.block_peak``), so each operation is judged against the kernel that ran it.

    ``measure`` False: only what was measured before (this process, or kept on a quiet host); None
    when the float roofline was not (a block kernel not measured yet is left out, and the views say
    its peak is not known)."""
    key = roofline_key(engine)
    roof = roofline.machine_roofline(*key) if measure else roofline.cached(*key)
    if roof is None:
        return None
    device = engine.device
    peaks = [roofline.block_peak(m, device, float_peak=roof.peak_flops) if measure else roofline.cached_block_peak(m, device)
             for m in block_modules(engine)]
    return roofline.with_block_peaks(roof, [p for p in peaks if p is not None])


def block_ridges(roof: roofline.Roofline) -> tuple[tuple[str, float], ...]:
    """``(format, FLOP/byte)``: each block kernel's ridge point, its peak over the bandwidth."""
    return tuple((k, v / roof.bandwidth) for k, v in roof.block_peaks)


def roofline_info(engine: "LLMEngine") -> dict:
    """The machine's roofline for ``model_info()`` when it was measured before (never measures):
    ``peak_flops`` FLOP/s (the float matmul's), ``block_peaks`` (``(format, FLOP/s)`` of the block
    kernels measured), ``memory_bandwidth`` bytes/s, ``machine``, ``compute_bound_tokens``."""
    roof = engine_roofline(engine, measure=False)
    if roof is None:
        return {}
    return {"peak_flops": roof.peak_flops, "block_peaks": roof.block_peaks, "memory_bandwidth": roof.bandwidth,
            "machine": roof.machine,
            "compute_bound_tokens": compute_bound_tokens(layer_dims(engine), roof.ridge, backend_of(engine),
                                                         block_ridges=block_ridges(roof))}


def bin_columns(probs: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    """``probs [rows, keys]`` summed into at most ``width`` columns of equal key count (the last may
    hold fewer): returns (``[rows, columns]``, keys per column). Sums keep each row's total at 1."""
    keys = probs.shape[-1]
    per = max(1, -(-keys // width))
    if per == 1:
        return probs, 1
    pad = (-keys) % per
    padded = torch.nn.functional.pad(probs, (0, pad))
    return padded.view(probs.shape[0], -1, per).sum(-1), per


class XRayCapture:
    """Chooses what to trace: one request (or the first scheduled one), and the heatmap's layer and head.

    The engine's layer observer (``engine.observer.StepObserver``), installed by
    ``nanovllm_core/__init__.py``: the engine makes one when a subscriber first asks for X-Ray.

    Made when a subscriber first asks for X-Ray (outside any step): it measures the machine's
    roofline then, once per process (:func:`engine_roofline`: the float matmul, the bandwidth and
    any block kernel the weights run), so no step's time includes it.
    """

    def __init__(self, engine: "LLMEngine", measure: bool = True) -> None:
        self.engine = engine
        self.request_id: str | None = None
        self.layer = 0
        self.head = 0
        self.layers: frozenset[int] | None = None  # the layers captured; None: every layer
        self.roofline: roofline.Roofline | None = None
        self._pieces: dict[int, tuple[list[int], list[str]]] = {}  # seq id -> (token ids, their pieces)
        if measure:
            self.measure_roofline()

    def pieces(self, seq) -> list[str]:
        """Each token's text of ``seq``: decoded once and kept, redone only from where its ids changed
        (speculative rollbacks), so a long context's heatmap labels cost nothing per step."""
        ids, known = self._pieces.pop(seq.seq_id, ([], []))
        tokens = seq.token_ids
        same, n = 0, min(len(ids), len(tokens))
        while same < n and ids[same] == tokens[same]:
            same += 1
        known = known[:same] + self.engine.token_pieces(tokens[same:])
        self._pieces[seq.seq_id] = (list(tokens), known)
        while len(self._pieces) > 8:  # the few sequences traced lately
            del self._pieces[next(iter(self._pieces))]
        return known

    def measure_roofline(self) -> None:
        """Measure (or read back) this machine's roofline for the engine's device, dtype and weights."""
        if self.roofline is None:
            self.roofline = engine_roofline(self.engine)

    prepare = measure_roofline  # the engine's observer hook calls this between steps (engine/observer.py)

    def select(self, request_id: str | None, layer: int = 0, head: int = 0, every_layer: bool = False) -> None:
        """Trace ``request_id`` (None, or a step it is not in: the step's first request); heatmap of ``layer``/``head``.

        Captures only ``layer`` from the next traced step on (one ``LayerTrace`` per step), or every
        layer with ``every_layer`` (the heatmap still only for ``layer``).

        Raises:
            ValueError: layer or head out of range.
        """
        cfg = self.engine.model_config
        if not 0 <= layer < cfg.num_hidden_layers:
            raise ValueError(f"x-ray layer {layer} is out of range 0..{cfg.num_hidden_layers - 1}")
        if not 0 <= head < cfg.num_attention_heads:
            raise ValueError(f"x-ray head {head} is out of range 0..{cfg.num_attention_heads - 1}")
        self.request_id, self.layer, self.head = request_id, layer, head
        self.layers = None if every_layer else frozenset((layer,))

    def tracer_for(self, plan: "SchedulerOutput") -> "LayerTracer | None":
        """A tracer for this step's chosen request, or, when that one is not in the step (it ended,
        waits or was preempted), for the step's first request; None for a step with no sample 0.

        The fallback keeps every step traced (trial 11: once the chosen request finished, no step
        was traced until the app chose again, and ``--trace-xray`` recordings lost those steps);
        the trace names its request, so a view can say it is another one."""
        from nanovllm_core.engine.model_runner import ModelRunner

        order = ModelRunner.batch_order(plan.scheduled)
        offsets, offset = [], 0
        for s in order:
            offsets.append(offset)
            offset += s.num_new_tokens
        firsts = [i for i, s in enumerate(order) if s.seq.index == 0]
        chosen = [i for i in firsts if order[i].seq.request_id == self.request_id]
        pick = (chosen or firsts or [None])[0]
        if pick is None:
            return None
        return LayerTracer(self.engine, plan.step, order[pick], offsets[pick], order, self.layer, self.head,
                           self.engine._emit, self.roofline or engine_roofline(self.engine, measure=False),
                           pieces=self.pieces, layers=self.layers)


class LayerTracer:
    """Hooks called by ``LlamaForCausalLM.forward``; emits one ``LayerTrace`` per layer.

    ``start`` is the first row of the traced sequence in the flat batch ``[num_tokens, ...]``;
    ``order`` the step's sequences in batch order; ``layers`` the layers the model traces
    (None: every layer; the model runs the others untraced).
    """

    def __init__(self, engine: "LLMEngine", step: int, scheduled: "ScheduledSequence", start: int,
                 order: list["ScheduledSequence"], heat_layer: int, heat_head: int,
                 emit: Callable[[ev.Event], None], roof: roofline.Roofline | None = None,
                 pieces: Callable | None = None, layers: frozenset[int] | None = None) -> None:
        self.engine = engine
        self.layers = layers
        self.cfg = engine.model_config
        self.step = step
        self.sched = scheduled
        self.order = order
        self.first_row = start
        self.rows = slice(start, start + scheduled.num_new_tokens)
        self.heat_layer, self.heat_head = heat_layer, heat_head
        self.emit = emit
        self.roof = roof
        self.pieces = pieces or (lambda seq: engine.token_pieces(seq.token_ids))
        self.dims = layer_dims(engine)
        self.backend = backend_of(engine)
        self.num_tokens = sum(s.num_new_tokens for s in order)
        self._ops: tuple[ev.OpInfo, ...] | None = None
        self._tensors: list[ev.TensorInfo] = []
        self._q: torch.Tensor | None = None
        self._attention: tuple = ()
        self._key_start, self._keys_per_column = 0, 1
        self._embedding: ev.TensorInfo | None = None
        self._compute_bound = (compute_bound_tokens(self.dims, roof.ridge, self.backend, block_ridges=block_ridges(roof))
                               if roof else 0)

    # ------------------------------------------------------------------ hooks

    def _batch(self, name: str, x: torch.Tensor) -> ev.TensorInfo:
        """A flat-batch tensor: its whole shape, and the traced request's last row (head 0) as the sample."""
        last = x[self.rows][-1]
        return ev.TensorInfo(name, tuple(x.shape), _sample(last[0] if last.dim() > 1 else last), "batch")

    def embedding(self, input_ids: torch.Tensor, x: torch.Tensor) -> None:
        self._embedding = self._batch("token_embeddings", x)

    def layer_input(self, layer: int, x: torch.Tensor) -> None:
        """The residual stream entering ``layer``, ``[T, hidden]`` (layer 0: the token embeddings)."""
        self._tensors = [self._embedding] if layer == 0 and self._embedding else [self._batch("residual", x)]
        block = block_tensor(self.engine.model.layers[layer].self_attn.qkv_proj)  # block modes: a real block
        if block is not None:
            self._tensors.append(block)

    def qkv(self, layer: int, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            attn=None) -> None:
        """``x``: input_layernorm's output ``[T, hidden]``; q ``[T, heads, hd]``; k, v ``[T, kv_heads, hd]``."""
        if self._ops is None:
            self._ops = self._layer_ops(attn)
        self._tensors += [self._batch("attn_norm", x), self._batch("q", q), self._batch("k", k),
                          self._batch("v", v)]
        self._q = q[self.rows].float().clone()

    def attention_output(self, layer: int, out: torch.Tensor) -> None:
        """``out``: the attention block's output after o_proj, ``[T, hidden]``."""
        c = self.cfg
        keys = self._context_keys(layer)  # [ctx, nkv, hd], this step's tokens included
        ctx = keys.shape[0]
        q = self._q  # [t, nh, hd]
        t = q.shape[0]
        nkv, group = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads
        # Grouped as the engine groups them: query head h = kv * group + j reads KV head kv; nothing is copied.
        qg = q.view(t, nkv, group, c.head_dim).permute(1, 2, 0, 3)  # [nkv, group, t, hd]
        scores = torch.einsum("kgtd,ckd->kgtc", qg, keys.float()) / math.sqrt(c.head_dim)  # [nkv, group, t, ctx]
        q_pos = torch.arange(self.sched.start, self.sched.start + t)
        mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        self._tensors += [
            ev.TensorInfo("k_context", (ctx, nkv, c.head_dim), _sample(keys[-1, 0]), "request"),
            ev.TensorInfo("scores", (nkv, group * t, ctx), _sample(scores[0, 0, -1, -SAMPLE_VALUES:]), "request"),
            ev.TensorInfo("probs", (nkv, group * t, ctx), _sample(probs[0, 0, -1, -SAMPLE_VALUES:]), "request"),
            self._batch("attn_out", out),
        ]
        if layer == self.heat_layer:
            head = probs.reshape(nkv * group, t, ctx)[self.heat_head, -HEATMAP_MAX_QUERIES:]
            cols, per = bin_columns(head, HEATMAP_MAX_COLUMNS)
            self._attention = tuple(tuple(round(float(x), 5) for x in row) for row in cols.tolist())
            self._key_start, self._keys_per_column = 0, per
        else:
            self._attention = ()

    def mlp(self, layer: int, x, gate, up, act, out) -> None:
        """``x``: post_attention_layernorm's output; gate, up, act ``[T, intermediate]``; out ``[T, hidden]``."""
        self._tensors += [self._batch("mlp_norm", x), self._batch("gate", gate), self._batch("up", up),
                          self._batch("act", act), self._batch("mlp_out", out)]

    def layer_output(self, layer: int, mid: torch.Tensor, out: torch.Tensor) -> None:
        """``mid``: the residual after attention; ``out``: after the MLP (the next layer's input)."""
        i = next(n for n, x in enumerate(self._tensors) if x.name == "attn_out") + 1
        self._tensors.insert(i, self._batch("residual_mid", mid))
        self._tensors.append(self._batch("residual_out", out))
        self._emit(layer)

    # ------------------------------------------------------------------ helpers

    def _emit(self, layer: int) -> None:
        c, s, seq = self.cfg, self.sched, self.sched.seq
        t, ctx = s.num_new_tokens, s.start + s.num_new_tokens
        heat = layer == self.heat_layer
        pieces = self.pieces(seq)[:ctx] if heat else []
        q_from = max(s.start, ctx - HEATMAP_MAX_QUERIES)
        roof = self.roof
        self.emit(ev.LayerTrace(
            step=self.step, request_id=seq.request_id, layer=layer, num_layers=c.num_hidden_layers,
            tensors=tuple(self._tensors), ops=self._ops or (), num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_size=c.hidden_size,
            kv_bytes_per_token=c.kv_bytes_per_token(getattr(self.engine, "kv_dtype", self.engine.dtype)),
            head=self.heat_head if heat else None, attention=self._attention if heat else (),
            query_pieces=tuple(pieces[q_from:ctx]),
            key_pieces=tuple(pieces) if self._keys_per_column == 1 else (),
            part=self.kind, num_new_tokens=t, context_len=ctx, first_row=self.first_row,
            num_batch_tokens=self.num_tokens, num_batch_seqs=len(self.order),
            attention_backend=self.backend, peak_flops=roof.peak_flops if roof else 0.0,
            memory_bandwidth=roof.bandwidth if roof else 0.0, machine=roof.machine if roof else "",
            compute_bound_tokens=self._compute_bound, key_start=self._key_start,
            keys_per_column=self._keys_per_column if heat else 1,
            prompt_len=seq.num_prompt_tokens, total_len=seq.num_tokens, num_cached_tokens=s.num_cached_tokens,
            kernel_peaks=roof.block_peaks if roof else (),
        ))

    @property
    def kind(self) -> str:
        """``prefill``, ``decode``, or ``verify`` (a speculative verification: the newest token plus drafts)."""
        if self.sched.spec_tokens:
            return "verify"
        return "decode" if self.sched.kind == "decode" else "prefill"

    def _layer_ops(self, attn) -> tuple[ev.OpInfo, ...]:
        seqs = self._seq_attention(attn)
        this = seqs[next(i for i, s in enumerate(self.order) if s is self.sched)]
        return layer_ops(self.dims, seqs, self.backend, this)

    def _seq_attention(self, attn) -> list[SeqAttention]:
        """Each scheduled sequence's attention as this step ran it (batch order): keys read, slots gathered.

        From the paged attention's metadata when there is one: decodes are gathered with their
        group, padded to its longest context (on the CPU each decode is a group of its own, so it
        reads exactly its context: ``ModelRunner.decode_group_size``); a prefill chunk continuing a cached
        context gathers its blocks; a chunk from position 0 gathers nothing, and neither do the
        kernels that read the blocks in place (the CPU paged kernel, flash-attn).
        """
        meta = getattr(attn, "meta", None)
        out = [SeqAttention(s.num_new_tokens, s.start + s.num_new_tokens, s.start + s.num_new_tokens)
               for s in self.order]
        if meta is None or getattr(attn, "reads_in_place", False):
            return out
        bs = self.engine.runner.block_size
        for g in meta.decode_groups:
            keys, gathered = g.keys_read, g.blocks.numel() // g.num * bs
            for i in range(g.first, g.first + g.num):
                out[i] = SeqAttention(1, out[i].context_len, keys, gathered)
        for chunk in meta.prefills:
            if chunk.block_table is not None:
                i = chunk.seq_index
                out[i] = SeqAttention(chunk.num_tokens, chunk.context_len, chunk.context_len,
                                      chunk.block_table.numel() * bs)
        return out

    def _context_keys(self, layer: int) -> torch.Tensor:
        """This sequence's cached keys in ``layer``: ``[context_len, num_kv_heads, head_dim]``."""
        runner = self.engine.runner
        seq = self.sched.seq
        ctx = self.sched.start + self.sched.num_new_tokens
        if runner.paged:
            bs = runner.block_size
            table = torch.tensor(seq.block_table, dtype=torch.long, device=runner.device)
            slots = (table[:, None] * bs + torch.arange(bs, device=runner.device)).reshape(-1)[:ctx]
            return runner.kv_cache.k_slots[layer].index_select(0, slots)
        return runner.contiguous[seq.seq_id].k[layer, :ctx]
