"""X-Ray: one decoder layer of the selected request's newest step, with shapes, math and real values."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from nanovllm_tui.widgets.live import LiveStatic

from nanovllm_core import events as ev
from nanovllm_tui.state import EngineState
from nanovllm_tui.views.base import EngineView
from nanovllm_tui.widgets.format import fmt_bytes, fmt_count
from nanovllm_tui.widgets.heatmap import AttentionHeatmap


def shape(dims: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def tensor(trace: ev.LayerTrace, name: str) -> ev.TensorInfo | None:
    return next((t for t in trace.tensors if t.name == name), None)


def pipeline_text(trace: ev.LayerTrace) -> Text:
    """The layer's operations in order: the math, then operand shapes, FLOPs and bytes moved."""
    text = Text()
    for op in trace.ops:
        text.append(f"▸ {op.name:<17}", style="bold #4ea1ff")
        text.append(op.math, style="italic")
        text.append(f"\n    {op.shapes}", style="#f5a524")
        text.append(f"   {fmt_count(op.flops)} FLOPs · {fmt_bytes(op.bytes)} moved\n", style="dim")
    text.append(f"  layer total: {fmt_count(sum(o.flops for o in trace.ops))} FLOPs · "
                f"{fmt_bytes(sum(o.bytes for o in trace.ops))} moved", style="bold")
    return text


def tensors_text(trace: ev.LayerTrace) -> Text:
    """Named tensors with their shapes (a batch of one) and the first real values of the last token."""
    text = Text("Tensors (first values of the last token)\n", style="bold")
    for t in trace.tensors:
        text.append(f"  {t.name:<17}", style="bold")
        text.append(f"{shape(t.shape):<18}", style="#f5a524")
        text.append(", ".join(f"{v:+.4f}" for v in t.sample) + ", …\n", style="dim")
    text.rstrip()
    return text


def gqa_text(trace: ev.LayerTrace, head: int, block_size: int | None) -> Text:
    """Grouped-query attention sharing and the KV-cache arithmetic, with this model's numbers."""
    nh, nkv, hd, layers = trace.num_heads, trace.num_kv_heads, trace.head_dim, trace.num_layers
    group = nh // max(nkv, 1)
    text = Text.assemble(("GQA ", "bold"), f"{nh} query heads share {nkv} KV heads ({group} per KV head)\n")
    for kv in range(nkv):
        for q in range(kv * group, (kv + 1) * group):
            text.append(f"q{q} ", style="bold reverse" if q == head else "#4ea1ff")
        text.append(f"→ kv{kv}", style="bold reverse" if head // group == kv else "#3ecf8e")
        text.append("   ")
    per_token = trace.kv_bytes_per_token
    elem = per_token // max(2 * layers * nkv * hd, 1)
    text.append("\n\n")
    text.append("KV bytes per token ", style="bold")
    text.append(f"= 2 (K and V) × {layers} layers × {nkv} KV heads × {hd} dims × {elem} B = {per_token:,} B "
                f"({fmt_bytes(per_token)})")
    k_cache = tensor(trace, "k_cache")
    if k_cache is not None:
        ctx = k_cache.shape[2]
        text.append(f"\nthis request: {ctx} tokens in context → {fmt_bytes(ctx * per_token)}")
        if block_size:
            blocks = -(-ctx // block_size)
            text.append(f" in {blocks} blocks of {block_size} ({blocks * block_size - ctx} slots unfilled)")
    if group > 1:
        text.append(f"\nwith one KV head per query head (MHA) it would be {fmt_bytes(per_token * group)} per token",
                    style="dim")
    return text


class XRayView(EngineView, can_focus=True):
    """The selected request's newest traced step, one layer at a time; the heatmap of one head.

    ↑/↓ (k/j) move between layers, ←/→ (h/l) between heads. The engine traces only while
    this tab is visible; a new layer/head choice shows in the heatmap from the next step.
    """

    BINDINGS = [
        Binding("up,k", "layer(-1)", "Layer -"),
        Binding("down,j", "layer(1)", "Layer +"),
        Binding("left,h", "head(-1)", "Head -"),
        Binding("right,l", "head(1)", "Head +"),
    ]

    layer_index = reactive(0, init=False)
    head_index = reactive(0, init=False)

    @dataclass
    class Choice(Message):
        """The X-Ray layer or head changed: the app asks the engine to trace them."""

        layer: int
        head: int

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_layers = 1
        self.num_heads = 1
        self._state: EngineState | None = None
        self._selected: str | None = None

    def compose(self) -> ComposeResult:
        yield LiveStatic(id="xray-title")
        with Horizontal():
            with VerticalScroll(id="xray-left", classes="panel"):
                yield LiveStatic(id="pipeline")
            with Vertical(id="xray-right"):
                yield LiveStatic(id="gqa", classes="panel")
                yield AttentionHeatmap(id="heatmap", classes="panel")

    def on_mount(self) -> None:
        self.query_one("#xray-left").border_title = "Layer pipeline"
        self.query_one("#gqa").border_title = "GQA and KV memory"
        self.query_one("#heatmap").border_title = "Attention"

    def action_layer(self, delta: int) -> None:
        self.layer_index = (self.layer_index + delta) % self.num_layers

    def action_head(self, delta: int) -> None:
        self.head_index = (self.head_index + delta) % self.num_heads

    def watch_layer_index(self) -> None:
        self._changed()

    def watch_head_index(self) -> None:
        self._changed()

    def _changed(self) -> None:
        self.post_message(self.Choice(self.layer_index, self.head_index))
        if self._state is not None:
            self.update_view(self._state, self._selected)

    def update_view(self, state: EngineState, selected: str | None) -> None:
        self._state, self._selected = state, selected
        info = state.model_info
        self.num_layers = max(1, info.get("num_layers", 1))
        self.num_heads = max(1, info.get("num_heads", 1))
        title = self.query_one("#xray-title", LiveStatic)
        trace = state.xray.get(self.layer_index)
        if trace is None:
            title.show_content(Text.assemble(
                ("X-Ray ", "bold"), f"layer {self.layer_index}/{self.num_layers - 1} (↑↓) · head {self.head_index}/"
                f"{self.num_heads - 1} (←→)\n",
                ("No trace yet. X-Ray records the selected request's next step while this tab is open: "
                 "send a prompt, or press n while paused.", "dim")))
            self.query_one("#pipeline", LiveStatic).show_content("")
            self.query_one("#gqa", LiveStatic).show_content("")
            self.query_one(AttentionHeatmap).set_data((), (), ())
            return
        hidden = tensor(trace, "hidden_states")
        k_cache = tensor(trace, "k_cache")
        new = hidden.shape[1] if hidden else 0
        ctx = k_cache.shape[2] if k_cache else 0
        kind = "decode" if new == 1 and ctx > 1 else "prefill"
        other = "" if selected in (None, trace.request_id) else f"  (traced: {trace.request_id}, not {selected})"
        title.show_content(Text.assemble(
            ("X-Ray ", "bold"), ("request ", "dim"), (trace.request_id, "bold #4ea1ff"), f" · step {trace.step} · {kind}: ",
            (f"{new} new token{'s' if new != 1 else ''}", "bold"), f" over {ctx} in context · ",
            (f"layer {self.layer_index}/{trace.num_layers - 1}", "bold reverse"), " (↑↓) · ",
            (f"head {self.head_index}/{trace.num_heads - 1}", "bold reverse"), " (←→)", (other, "yellow")))
        self.query_one("#pipeline", LiveStatic).show_content(
            Text.assemble(pipeline_text(trace), "\n\n", tensors_text(trace)))
        self.query_one("#gqa", LiveStatic).show_content(gqa_text(trace, self.head_index, info.get("block_size")))
        heat = state.heat
        heatmap = self.query_one(AttentionHeatmap)
        if heat is None:
            heatmap.border_title = "Attention"
            heatmap.set_data((), (), ())
            return
        key_offset = ctx - len(heat.key_pieces) if heat.step == trace.step else 0
        heatmap.set_data(heat.attention, heat.query_pieces, heat.key_pieces, max(0, key_offset))
        title_text = f"Attention · layer {heat.layer} · head {heat.head} · step {heat.step}"
        if (heat.layer, heat.head) != (self.layer_index, self.head_index):
            title_text += " (yours from the next step)"
        heatmap.border_title = title_text
