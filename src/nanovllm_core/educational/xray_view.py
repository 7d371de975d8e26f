"""``--xray``: the tensors and the math inside each decoder layer, from the engine's ``LayerTrace`` events.

For each prompt, two steps are traced: its prefill (the first chunk when it is chunked) and
its first decode step. Layer 0 is shown in full: every operation with its math, its shapes
as the engine holds them (the step's flat batch ``[T, 576]``, ``[T, 9, 64]``; attention per
sequence, query heads grouped by the KV head they read), FLOPs, bytes as the attention
backend moves them and the arithmetic intensity against this machine's measured ridge point of
the kernel that ran each (a block projection's block kernel, the float matmul for the rest);
in a block mode, how its weights sit in a block, with a real block of the running model
(``educational/xray_blocks.py``); the named tensors with what each one is and a few real values; grouped-query attention and
the KV bytes; and layer 0's attention weights for head 0. The other layers get one compact
line each with their own real values. Everything comes from the capture in
``educational/xray.py`` and the sentences of ``educational/xray_facts.py``; Rich only.

The engine traces at most one request per step (see ``XRayCapture``), so when two prompts
are prefilled in the same step only the first is traced; the output says so.

Split over ranks (``--tensor-parallel-size N``, N > 1) the engine captures nothing (the capture
reads whole-model tensors; a rank holds a shard): for the same steps the view then says so in
one line and shows each rank's shard shapes of the detail layer, the bytes of the step's
all-reduces for its token count, and where each rank's time went (``educational/tp_facts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console, Group, RenderableType
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from nanovllm_core import events as ev
from nanovllm_core.educational import xray_facts as facts
from nanovllm_core.educational.commentary import agree, ms, plural
from nanovllm_core.educational.narrator import human_bytes, show_piece
from nanovllm_core.educational.rich_parts import Indent
from nanovllm_core.educational import tp_facts, xray_blocks
from nanovllm_core.educational.xray_costs import model_edge_ops, sampled_rows
from nanovllm_core.model.block_quant import BLOCK_SIZE

HEATMAP_MAX = 10  # rows/columns of the attention-weight table


def si(n: float, unit: str = "") -> str:
    """``5_530_000`` -> ``"5.53 M"``: decimal prefixes, three significant digits."""
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


shape_str = facts.shape_str


class Header:
    """A step's heading: ``text`` inside a cyan rule when it fits the width, else wrapped in full over as
    many lines as it needs with the rule below it, so nothing that matters is cut (trial 10: at 80
    columns "... 1 + 3 tokens at positi… ─" and "... split over 3 ran… ─")."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __rich_console__(self, console: Console, options):
        if len(self.text) + 4 <= options.max_width:  # the rule's own margin: "── " is not drawn for align="left"
            yield Rule(Text(self.text, style="bold cyan"), align="left", style="cyan")
        else:
            yield Text(self.text, style="bold cyan")
            yield Rule(style="cyan")


def op_cost(t: ev.LayerTrace, o: ev.OpInfo) -> str:
    """``"5.53 MFLOP, 2.2 MiB, 2.4 FLOP/B, memory-bound"``: an operation's cost against the ridge point of
    the kernel that ran it (:func:`~nanovllm_core.educational.xray_facts.bound`)."""
    parts = [si(o.flops, "FLOP")] if o.flops else []
    parts.append(human_bytes(o.bytes))
    if o.flops and o.bytes:
        parts.append(f"{facts.op_intensity(o):.1f} FLOP/B")
        bound = facts.bound(t, o)
        if bound:
            parts.append(bound)
    return ", ".join(parts)


def render_layer_detail(t: ev.LayerTrace, info: dict[str, Any] | None = None) -> RenderableType:
    """Everything layer ``t.layer`` did: operations, tensors, GQA arithmetic, roofline, attention weights;
    with ``info`` (``model_info()``) of a split engine, each rank's shards and the layer's all-reduce bytes."""
    ops = Table(title=f"Layer {t.layer} of {t.num_layers}: operations (math and cost: FLOPs, the bytes the operation "
                      "reads plus those it writes, FLOP per byte; then the shapes)",
                title_justify="left", box=None, header_style="bold", padding=(0, 1), show_header=False)
    ops.add_column("op", style="bold", no_wrap=True)
    ops.add_column("what")
    for o in t.ops:
        ops.add_row(o.name, Text.assemble(o.math, (f"   ({op_cost(t, o)})", "dim"), "\n", (o.shapes, "cyan")))
    tens = Table(title=f"Layer {t.layer}: tensors ([T, ...]: the step's flat batch; slice: this request's own; "
                       "values: this request's last token, head 0 where there are heads; the first ones, "
                       "scores and probs its newest keys)", title_justify="left",
                 box=None, header_style="bold", padding=(0, 1))
    tens.add_column("tensor", style="bold", no_wrap=True)
    tens.add_column("shape, real values; what it is")
    for x in t.tensors:
        if x.name in (xray_blocks.BLOCK_TENSOR, xray_blocks.BLOCK_TENSOR_AT_LOAD):  # drawn on its own below the operations
            continue
        tens.add_row(x.name, Text.assemble((f"{shape_str(x.shape):<13}", "cyan"), " ", facts.sample_text(x),
                                           "\n", (facts.LABELS.get(x.name, ""), "dim")))
    parts: list[RenderableType] = [Text(facts.batch_line(t))]
    if t.attention_backend:
        parts.append(Text(facts.backend_line(t)))
    parts += [Text(""), ops]
    verdicts = facts.verdict_line(t)
    if verdicts:
        parts.append(Text(verdicts, style="dim"))
    parts.append(Text(""))
    block = xray_blocks.block_lines(t)
    if block:
        parts += [Text(line) for line in block] + [Text("")]
    parts += [tens, Text("")]
    parts += [Text(line) for line in facts.gqa_lines(t)]
    tp = tp_facts.xray_lines(t, info or {})
    if tp:
        parts += [Text("")] + [Text(line) for line in tp]
    parts += [Text("")] + [Text(line) for line in facts.roofline_lines(t)]
    if t.attention:
        group = t.num_heads // max(1, t.num_kv_heads)
        parts += [Text(""), Text(f"Layer {t.layer}, head {t.head} (reads KV head {t.head // group} = {t.head} // "
                                 f"{group}): attention weights (rows: queries, "
                                 f"columns: keys; {heatmap_caption(t)})"), attention_table(t)]
    return Group(*parts)


def _key_span(t: ev.LayerTrace, first_column: int, last_column: int) -> str:
    """The key positions columns ``first_column..last_column`` of the trace's heatmap stand for: ``"0-2"`` or ``"5"``."""
    per = max(1, t.keys_per_column)
    a, b = t.key_start + first_column * per, t.key_start + last_column * per + per - 1
    return str(a) if a == b else f"{a}-{b}"


def heatmap_caption(t: ev.LayerTrace) -> str:
    """What :func:`attention_table` leaves out, in words: each row sums to 1 over all its keys, and when only
    the newest ``HEATMAP_MAX`` key columns fit, which keys are hidden and that the shown rows sum to less
    (trial 10: 10 of 13 keys shown under "each row sums to 1 over all its keys", rows summing to 0.68-0.84);
    likewise the earlier query rows left out."""
    rows = t.attention[-HEATMAP_MAX:]
    n_cols = len(rows[-1]) if rows else 0
    first = max(0, n_cols - HEATMAP_MAX)
    words = "each row sums to 1 over all its keys"
    if first:
        words += (f"; only the newest keys, {_key_span(t, first, n_cols - 1)}, are shown: keys "
                  f"{_key_span(t, 0, first - 1)} are hidden, so a row's shown weights sum to less than 1 "
                  "(the hidden keys hold the rest)")
    if len(t.attention) > len(rows):
        words += f"; only the newest {len(rows)} query rows are shown"
    return words


def attention_table(t: ev.LayerTrace) -> Table:
    """Softmax weights of head ``t.head``: one row per query token, one column per key (the last ones if many)."""
    rows = t.attention[-HEATMAP_MAX:]
    n_cols = len(rows[-1]) if rows else 0
    first = max(0, n_cols - HEATMAP_MAX)
    per = max(1, t.keys_per_column)
    if t.key_pieces and per == 1:
        keys = [show_piece(p) for p in list(t.key_pieces)[-n_cols:]]
    else:
        keys = [f"{t.key_start + c * per}-{t.key_start + c * per + per - 1}" if per > 1 else str(t.key_start + c)
                for c in range(n_cols)]
    queries = list(t.query_pieces)[-len(rows):] if t.query_pieces else [str(i) for i in range(len(rows))]
    table = Table(box=None, header_style="bold", padding=(0, 1))
    table.add_column("query \\ key")
    for label in keys[first:]:  # Text, not markup: a piece such as "[one]" is no style tag (trial 10)
        table.add_column(Text(label), justify="right")
    for piece, row in zip(queries, rows):
        cells = []
        for w in row[first:]:
            style = "bold green" if w >= 0.5 else "green" if w >= 0.2 else "dim" if w < 0.05 else ""
            cells.append(Text(f"{w:.2f}", style=style))
        table.add_row(Text(show_piece(piece)), *cells)
    return table


def render_other_layers(traces: list[ev.LayerTrace]) -> Table:
    """One compact line per layer: its real values at three points and its cost."""
    table = Table(title="The other layers: same shapes and operations as above, their own weights and values "
                        "(first two numbers of the last token)", title_justify="left", box=None,
                  header_style="bold", padding=(0, 1),
                  caption="residual in: the layer's input; self-weight: the last token's softmax weight on "
                          "itself, head 0", caption_justify="left")
    for col in ("layer", "residual in", "attn_out", "mlp_out", "self-weight", "FLOPs"):
        table.add_column(col, justify="right" if col in ("layer", "self-weight", "FLOPs") else "left", no_wrap=True)

    def two(x: ev.TensorInfo | None) -> str:
        return " ".join(f"{v:+.3f}" for v in x.sample[:2]) if x is not None else ""

    for t in traces:
        x = {i.name: i for i in t.tensors}
        probs = x.get("probs")
        table.add_row(str(t.layer), two(x.get("residual") or x.get("token_embeddings")),
                      two(x.get("attn_out") or x.get("attn_output")), two(x.get("mlp_out") or x.get("mlp_output")),
                      f"{probs.sample[-1]:.3f}" if probs and probs.sample else "", si(sum(o.flops for o in t.ops)))
    return table


def step_total(traces: list[ev.LayerTrace], edges: tuple[ev.OpInfo, ...] = ()) -> str:
    """The step's totals, saying what they include: the decoder layers, then (when ``edges`` are
    given, :func:`~nanovllm_core.educational.xray_costs.model_edge_ops`) the embedding lookup,
    final norm and LM head, and their sum."""
    first = traces[0]
    flops = sum(o.flops for t in traces for o in t.ops)
    moved = sum(o.bytes for t in traces for o in t.ops)
    n = first.num_batch_tokens
    batch = (f"the step's batch of {plural(n, 'token')}" if facts.is_flat(first)
             else "this request's tokens")
    layers = (f"All {len(traces)} decoder layers: {si(flops, 'FLOP')} and about {human_bytes(moved)} read and written "
              f"for {batch} (K/V writes and attention reads included)")
    if not edges:
        return layers + "; the embedding lookup, final norm and LM head are not counted"
    head = next((o for o in edges if o.name == "lm_head"), None)
    rows = head.shapes.split("]")[0].strip("[").split(",")[0] if head is not None else "?"
    ef, eb = sum(o.flops for o in edges), sum(o.bytes for o in edges)
    if rows == "0":  # the engine skips the LM head when no row samples (ModelRunner.execute): nothing read
        outside = ("Embedding lookup (the step's rows of the table, not the table) and final norm; the LM head "
                   "does not run, as no row samples in this step")
    else:
        outside = (f"Embedding lookup (the step's rows of the table), final norm and the LM head over the "
                   f"{'1 row that samples' if rows == '1' else rows + ' rows that sample'} (its whole weight "
                   "matrix read once)")
    return (f"{layers}. {outside}: {si(ef, 'FLOP')} and about {human_bytes(eb)}. The whole "
            f"forward pass: {si(flops + ef, 'FLOP')} and about {human_bytes(moved + eb)}")


def render_step(traces: list[ev.LayerTrace], entry: ev.ScheduledEntry | None = None,
                wall_time_s: float | None = None, detail_layer: int = 0,
                edges: tuple[ev.OpInfo, ...] = (), info: dict[str, Any] | None = None) -> RenderableType:
    """A traced step: a header, ``detail_layer`` in full, one line per other layer, the totals
    (:func:`step_total`; ``edges``: the ops outside the layers, when known; ``info``: ``model_info()``,
    for a split engine's shards)."""
    traces = sorted(traces, key=lambda t: t.layer)
    first = traces[0]
    new, ctx = facts.new_and_context(first)
    kind = facts.step_kind(first, entry)
    start = entry.start if entry is not None else ctx - new
    of = facts.trace_chunk_of(first)
    if not of and entry is not None and kind == "prefill":  # a trace recorded before it carried the lengths
        of = facts.chunk_of(start, new, entry.prompt_len, entry.total_len, entry.num_cached_tokens)
    if of:
        where = f"position {start}" if new == 1 else f"positions {start}..{start + new - 1}"
        what = f"prefill chunk, {plural(new, 'new token')} at {where} of {of}"
    elif kind == "speculative verification":
        what = f"{kind}, 1 + {new - 1} tokens at positions {start}..{start + new - 1}"
    elif new == 1:
        what = f"{kind}, 1 new token at position {start}"
    else:
        what = f"{kind}, {new} new tokens at positions {start}..{start + new - 1}"
    head = Header(f"X-RAY · request {first.request_id} · step {first.step} · {what}")
    detail = next((t for t in traces if t.layer == detail_layer), first)
    others = [t for t in traces if t is not detail]
    total = step_total(traces, edges)
    if wall_time_s is not None:
        total += f"; the step took {ms(wall_time_s)} (with the X-Ray capture itself)"
    parts: list[RenderableType] = [head, Indent(render_layer_detail(detail, info))]
    if others:
        parts += [Text(""), Indent(render_other_layers(others))]
    parts += [Text(""), Indent(Text(total + ".")), Text("")]
    return Group(*parts)


def render_split_step(info: dict[str, Any], timed: ev.StepTimed, entry: ev.ScheduledEntry | None = None,
                      layer: int = 0) -> RenderableType | None:
    """A step of an engine split over ranks, where nothing is captured: a header, the line saying
    so, each rank's shard shapes of decoder ``layer`` and the bytes of the step's all-reduces for
    its ``timed.num_tokens`` tokens (:func:`~nanovllm_core.educational.tp_facts.untraced_lines`),
    then where each rank's time went (:func:`~nanovllm_core.educational.tp_facts.dashboard_lines`,
    when the step measured it). None at N = 1 or when ``info`` lacks a size the shapes need."""
    lines = tp_facts.untraced_lines(info, timed.step, timed.num_tokens, layer)
    if not lines:
        return None
    what = ""
    if entry is not None:
        what = (f" · request {entry.request_id}'s {'decode' if entry.kind == 'decode' else 'prefill'}, "
                f"{entry.num_tokens} of them" if not entry.num_drafts else  # the newest or the prompt's last, + drafts
                f" · request {entry.request_id}'s {'decode' if entry.kind == 'decode' else 'prefill'} "
                f"1 + {plural(entry.num_drafts, 'draft')}")
    head = Header(f"X-RAY · step {timed.step} · {plural(timed.num_tokens, 'token')}"
                  f"{what} · split over {tp_facts.tp_size(info)} ranks")
    body: list[RenderableType] = [Text(lines[0], style="yellow")] + [Text(line) for line in lines[1:]]
    kv = tp_facts.rank_kv_lines(info)
    if kv:
        body += [Text("")] + [Text(line) for line in kv]
    measured = tp_facts.dashboard_lines(timed)
    if measured:
        body += [Text(""), Text("Measured in this step:")] + [Text(line) for line in measured]
    return Group(head, Indent(Group(*body)), Text(""))


@dataclass
class _Target:
    entry: ev.ScheduledEntry
    skipped: list[str] = field(default_factory=list)


def phase_words(s: ev.ScheduledEntry) -> str:
    """What a step ran of a request, for the not-traced note: ``decode``, ``prefill`` (its whole prefill in
    this step), or ``prefill chunk, tokens 3..6 of 7`` (trial 35e: a 3-of-7 chunk read as the whole prefill)."""
    if s.kind == "decode":
        return "decode"
    end = s.start + s.num_tokens
    if s.start == s.num_cached_tokens and end >= s.total_len:
        return "prefill"
    return f"prefill chunk, tokens {s.start}..{end - 1} of {s.total_len}"


def skipped_note(skipped: list[tuple[str, str]], ended: set[str]) -> str:
    """Which requests of the step were not traced and what becomes of them. One request is traced
    a step, so one still running waits for a later step (its decode; a missed prefill is not
    traced again, its first decode may be); one that ended in this step is never traced (trial 10:
    the note promised a trace to a request that had just finished)."""
    names = ", ".join(f"{rid} ({phase})" for rid, phase in skipped)
    later = list(dict.fromkeys(rid for rid, _ in skipped if rid not in ended))
    gone = list(dict.fromkeys(rid for rid, _ in skipped if rid in ended))
    fate = []
    if later:
        fate.append(f"request {', '.join(later)} may have {agree(len(later), 'its', 'their')} decode traced at a "
                    "later step")
    if gone:
        fate.append(f"request {', '.join(gone)} finished in this step and will not be traced")
    return f"Not traced in this step: request {names}. The engine traces one request per step: {'; '.join(fate)}."


class XRayView:
    """Chooses which steps the engine traces and prints each traced step.

    For every request: the step of its prefill (first chunk) and its first decode step. It
    turns its own subscription's ``xray`` on only for those steps, so other steps run untraced.

    Args:
        console: where to print.
        engine: the ``LLMEngine`` (for ``subscribe`` and ``select_xray``).
        detail_layer: the layer shown in full (its attention weights too).
        on_traced: called with each traced step's renderable instead of printing (tests, tutorial).
    """

    def __init__(self, console: Console, engine: Any, detail_layer: int = 0, on_traced=None) -> None:
        self.console = console
        self.engine = engine
        self.detail_layer = detail_layer
        self.on_traced = on_traced
        self.sub = None
        self._done: set[tuple[str, str]] = set()  # (request id, "prefill" | "decode") already traced
        self._target: _Target | None = None
        self._ended: set[str] = set()  # requests seen finishing (RequestFinished)
        self._traces: list[ev.LayerTrace] = []
        self._edges: tuple[ev.OpInfo, ...] = ()
        self.num_traced_steps = 0
        self.num_split_steps = 0  # steps shown from the split's sizes (N > 1: nothing captured)
        self._tp = 1

    def _info(self) -> dict[str, Any]:
        try:
            return self.engine.model_info()
        except AttributeError:  # a stand-in engine without facts: no shards to show
            return {}

    def subscribe(self) -> Any:
        """Subscribe to the engine; the subscription's ``xray`` flag is then switched per step.

        Selecting now makes the engine measure the machine's roofline before any step runs (not when
        the engine is split over ranks: it captures nothing then)."""
        self._tp = tp_facts.tp_size(self._info())
        if self._tp == 1:
            self.engine.select_xray(None, layer=self.detail_layer, head=0, every_layer=True)
        self.sub = self.engine.subscribe(self, topk=0, blocks=False, xray=False)
        return self.sub

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.StepPlanned):
            self._plan(event)
        elif isinstance(event, ev.LayerTrace):
            if self._target is not None and event.request_id == self._target.entry.request_id:
                self._traces.append(event)
        elif isinstance(event, ev.RequestFinished):
            self._ended.add(event.request_id)
        elif isinstance(event, ev.StepTimed):
            self._finish(event.wall_time_s, event)

    def _plan(self, plan: ev.StepPlanned) -> None:
        if self._traces:
            self._finish(None)
        self._edges = self._edge_ops(plan)
        wanted = []
        for s in plan.scheduled:
            if s.index != 0:
                continue
            phase = "decode" if s.kind == "decode" else "prefill"
            first_chunk = s.kind == "decode" or s.start == s.num_cached_tokens
            if first_chunk and (s.request_id, phase) not in self._done:
                wanted.append((s, phase))
        self._target = None
        # Requests not seen yet first, then prefill (it shows more); a missed decode is traced at the next step.
        seen = {rid for rid, _ in self._done}
        wanted.sort(key=lambda w: (w[0].request_id in seen, w[1] != "prefill"))
        if wanted:
            s, phase = wanted[0]
            passed = {id(w) for w, _ in wanted[1:]}
            # every other request the step ran that is not traced: those wanted too, and any prefill chunk
            # (trial 35e: a prompt's later chunk, in the step beside another's decode, was not listed)
            self._target = _Target(s, [(w.request_id, phase_words(w)) for w in plan.scheduled
                                       if w.index == 0 and w is not s and (id(w) in passed or w.kind != "decode")])
            self._done.add((s.request_id, phase))
            if self._tp == 1:
                self.engine.select_xray(s.request_id, layer=self.detail_layer, head=0, every_layer=True)
        if self.sub is not None:
            self.sub.xray = self._target is not None and self._tp == 1

    def _edge_ops(self, plan: ev.StepPlanned) -> tuple[ev.OpInfo, ...]:
        """The step's embedding lookup, final norm and LM head (empty when the engine does not say its sizes)."""
        try:
            info = self.engine.model_info()
            model = self.engine.model
            head = model._modules.get("lm_head")
            head_bytes = int(getattr(head, "weight_bytes", 0))  # as stored: float or blocks
            if not head_bytes:
                matrix = model.lm_head_matrix
                head_bytes = matrix.numel() * matrix.element_size()
            elem = torch.empty((), dtype=self.engine.dtype).element_size()
            emb = model.embed_tokens
            fmt = getattr(emb, "format", None)  # a BlockEmbedding: rows of blocks
            row = (info["hidden_size"] // BLOCK_SIZE * fmt.block_bytes) if fmt is not None else 0
            return model_edge_ops(info["hidden_size"], info["vocab_size"], elem, head_bytes,
                                  plan.num_batched_tokens, sampled_rows(plan.scheduled), row,
                                  fmt.name if fmt is not None else "")
        except (AttributeError, KeyError, StopIteration, TypeError):
            return ()

    def _finish(self, wall: float | None, timed: ev.StepTimed | None = None) -> None:
        target, traces = self._target, self._traces
        self._target, self._traces = None, []
        if self.sub is not None:
            self.sub.xray = False
        if target is not None and not traces and self._tp > 1 and timed is not None:
            split = render_split_step(self._info(), timed, target.entry, self.detail_layer)
            if split is not None:
                self.num_split_steps += 1
                self._show(split)
            return
        if target is None or not traces:
            return
        self.num_traced_steps += 1
        info = self._info()
        parts: list[RenderableType] = [render_step(traces, target.entry, wall, self.detail_layer, self._edges, info)]
        if target.skipped:
            parts += [Indent(Text(skipped_note(target.skipped, self._ended), style="dim")), Text("")]
        self._show(Group(*parts))

    def _show(self, group: RenderableType) -> None:
        if self.on_traced is not None:
            self.on_traced(group)
        else:
            self.console.print(group)

    def close(self) -> None:
        """Print a step left unfinished and unsubscribe."""
        if self._traces:
            self._finish(None)
        if self.sub is not None:
            self.engine.unsubscribe(self.sub)
            self.sub = None
