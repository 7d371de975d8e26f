"""X-Ray: one decoder layer of the selected request's newest step, with shapes, math, costs and real values.

What it says is computed from the step's ``LayerTrace`` events by ``nanovllm_core.educational.xray_facts``,
the same sentences ``nanovllm --xray`` prints: the step's flat batch and the request's slice of
it, the attention backend that ran, each operation's FLOPs, bytes and FLOP/byte against the
machine's measured ridge point of the kernel that ran it (a block projection's block kernel, the
float matmul for the rest), in a block mode how the weights sit in a block with a real one
(``educational/xray_blocks``), grouped-query attention as the engine does it, and what
each captured tensor is; and, when the engine is split over ranks, each rank's shard of the
layer and the bytes of its two all-reduces (``educational/tp_facts``).

A split engine (``--tensor-parallel-size N``, N > 1) captures no layer (the capture reads
whole-model tensors; a rank holds a shard): the tab then says so in one line and shows, for the
newest step and the chosen layer, each rank's shard shapes, the bytes of the step's all-reduces
for its token count and each rank's measured time, from ``model_info()`` and ``StepTimed``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.reactive import reactive

from nanovllm_core import events as ev
from nanovllm_core.educational import tp_facts, xray_blocks
from nanovllm_core.educational import xray_facts as facts
from nanovllm_core.educational.commentary import plural
from nanovllm_core.sampling_params import contiguous_reservation as reservation_tokens
from nanovllm_tui import hints
from nanovllm_tui.state import EngineState
from nanovllm_tui.views.base import EngineView
from nanovllm_tui.widgets.format import fmt_bytes, fmt_count
from nanovllm_tui.widgets.heatmap import AttentionHeatmap
from nanovllm_tui.widgets.live import LiveStatic

NARROW, SHORT = 100, 30  # below these sizes panels fold away (see app.tcss)
HEATMAP_ROWS, NARROW_HEATMAP_ROWS = 12, 5  # query rows the heatmap shows at once (it scrolls)

shape = facts.shape_str
tensor = facts.tensor


def no_trace_words(state: EngineState, selected: str | None, live: bool, every_step: bool = False) -> str:
    """Why the X-Ray has nothing to show, true for the selection: X-Ray traces the selected request's
    next step (a step it is not in: the step's first request's), so a finished selection never gets one (trial 7: it said
    "No trace yet: ... press n while paused" with a finished request selected). Names the keys that
    select another request (``]`` / ``[``, commands.py), and ``n`` only while it runs a step (trial 14a:
    "press n again while paused" while the engine ran; :mod:`nanovllm_tui.hints`). A replay shows
    only the traces it recorded and takes no prompts. ``every_step``: the app traces every step whether the
    tab shows or not (``--trace-xray``), so no sentence says a step is traced only while it shows."""
    req = state.requests.get(selected) if selected else None
    plan = state.plan
    step = hints.next_step(state, live)
    if req is not None and req.live and plan is not None and not state.step_open \
            and all(s.request_id != selected for s in plan.scheduled):
        # trial 11: after n the hint still said "send a prompt, or press n" when the step had not run it
        why = {"waiting": "it is waiting to be admitted", "preempted": "it is preempted, waiting to be readmitted",
               "submitted": "the engine has not added it yet"}.get(req.state, "the step's token budget went to others")
        records = "X-Ray records the next step that runs it" if live else \
            "the recording's next step that runs it shows here if it was traced"
        return f"No trace yet: request {selected} was not in step {plan.step} ({why}); {records} ({step})."
    if req is None or req.live:
        if live:
            return (f"No trace yet: X-Ray records the selected request's next step, or the step's first request "
                    f"if it did not run, {WHEN_TRACED[every_step]}: {step}.")
        return ("No trace yet: a replay shows the X-Ray traces its recording holds (of steps run while the X-Ray "
                f"tab was open, or every step with --trace-xray): {step}.")
    running = [rid for rid, r in state.requests.items() if r.live]
    if running:
        shown = ", ".join(running[:4]) + (" ..." if len(running) > 4 else "")
        pick = f"select a running one with ] or [ (running: {shown}); {step}"
    elif live:
        pick = f"no request is running: {step}"
    else:
        pick = "no request of this recording is running now"
    instead = ("X-Ray records the next step's first request instead" if live
               else "the recording holds only the traces made while it was recorded")
    if req.state == "rejected":  # it never ran: nothing to trace, nothing to ask the engine for (trial 22b)
        return (f"No trace: request {selected} was rejected ({rejected_reason(req)}): it never ran, so it has "
                f"nothing to trace; {pick}.")
    return (f"No trace: request {selected} is {req.state} (no longer running), so no step of it will come; "
            f"{instead}; {pick}.")


def rejected_reason(req) -> str:
    """The engine's (or server's) reason for refusing ``req``, one line, or "no reason given"."""
    reason = " ".join(str(getattr(req, "error", None) or "").split())
    return reason or "no reason given"


# When the live app traces a step: while the X-Ray tab shows, or at every step with --trace-xray (the app's
# ``record_xray``); the sentences below say the one that is true (fix29x's note: with the flag they said the first)
WHEN_TRACED = {False: "while this tab is open", True: "at every step (--trace-xray), whichever tab shows"}


def trace_age(state: EngineState, step: int, live: bool, why: bool = True, every_step: bool = False) -> str:
    """"" while ``step``'s trace is of the newest ended step; else how old it is (and, with ``why``,
    why): a step is traced only while the X-Ray tab shows (or with ``--trace-xray``), so the trace
    last seen comes back when the tab is shown again (trial 21d: step 66 shown at step 116, no word
    of its age). The app's next step traces afresh; a replay has only what was recorded."""
    timings = getattr(state, "timings", None)
    newest = timings[-1].step if timings else None
    if newest is None or step >= newest:
        return ""
    if not live:
        return f"recorded {plural(newest - step, 'step')} before step {newest}" + (
            "; the recording holds no newer trace" if why else "")
    return f"captured {plural(newest - step, 'step')} ago, step {newest} has ended" + (
        "" if not why or every_step else "; steps run while this tab was hidden are not traced, the next step will be")


def ran_after(req, step: int) -> str:
    """"" unless ``req`` ran after ``step`` (the trace shown): then which steps it ran in, for a reason
    that is true of it (trial 21d: "req-6 is finished, so no step of it will capture layer 2" of a
    step 66 when req-6 ran in steps 67-116, all while the tab was hidden)."""
    last = getattr(req, "last_step", None)
    if last is None or last <= step:
        return ""
    first = max(req.first_step if req.first_step is not None else req.last_step, step + 1)
    return f"step {first}" if first == req.last_step else f"steps {first}-{req.last_step}"


def hidden_words(selected: str, req, step: int, live: bool, every_step: bool = False) -> str:
    """Why no step of a finished ``selected`` request that ran after ``step`` was traced, or ""."""
    ran = ran_after(req, step)
    if not ran:
        return ""
    if live and every_step:  # every step is traced: the steps it ran in traced it, but the app keeps the newest only
        return (f"{selected} ran in {ran}, after step {step}, and is {req.state} now; the app keeps only the newest "
                "step's trace (every step is traced with --trace-xray, the recording holds them all), so select a "
                "running one with ] or [")
    if live:
        return (f"{selected} ran in {ran}, after step {step}, while this tab was hidden (a step is traced only "
                f"while it shows) and is {req.state} now, so no step of it will be traced: select a running one "
                "with ] or [")
    return (f"{selected} ran in {ran}, after step {step}, and the recording holds no trace of them (a step is "
            "traced only while the X-Ray tab shows, or every step with --trace-xray)")


def other_request_words(state: EngineState, trace: ev.LayerTrace, selected: str | None, live: bool,
                        every_step: bool = False) -> str:
    """The title's note when the trace shown is not the selected request's: which one it is and why
    (trial 11: "(traced: req-8, not req-9)" said nothing of why or what to do). A step the selected
    request is not in traces the step's first request; only a shown tab (or ``--trace-xray``) traces."""
    if selected in (None, trace.request_id):
        return ""
    req = state.requests.get(selected)
    if req is not None and not req.live and ran_after(req, trace.step):
        why = hidden_words(selected, req, trace.step, live, every_step)
    elif req is not None and not req.live and getattr(req, "last_step", None) == trace.step:
        why = (f"{selected} ran in step {trace.step} but was chosen after it was traced" if live else
               f"the recording traced only {trace.request_id} in that step") + f"; {selected} is {req.state} now"
    elif req is not None and req.state == "rejected":  # never ran (trial 22b)
        why = f"{selected} was rejected ({rejected_reason(req)}): it never ran, so it has nothing to trace"
    elif req is not None and not req.live:
        why = f"{selected} is {req.state}, so steps trace a running request"
    elif live and state.step is not None and trace.step < state.step:
        why = (f"step {trace.step} is the newest traced" + ("" if every_step else
               " (steps run while this tab was hidden are not traced for it)") + f"; the next step traces {selected}" + (", press n" if hints.steps_on_n(state) else ""))
    else:
        plan = state.plan
        ran = plan is not None and plan.step == trace.step and any(s.request_id == selected for s in plan.scheduled)
        if not ran:
            why = f"{selected} did not run in step {trace.step}"
        elif live:
            why = f"{selected} was chosen after step {trace.step}; the next step traces it" + (
                ", press n" if hints.steps_on_n(state) else "")
        else:
            why = f"the recording traced only {trace.request_id} in that step"
    return f"  (traced: {trace.request_id}, not {selected}: {why})"


def pipeline_text(trace: ev.LayerTrace) -> Text:
    """The step's batch and backend, the layer's operations in order (math, shapes, FLOPs, bytes,
    FLOP/byte against the ridge point), the layer's total and the machine's roofline."""
    text = Text()
    text.append(facts.batch_line(trace) + "\n", style="italic")
    if trace.attention_backend:
        text.append(facts.backend_line(trace) + "\n", style="dim")
    text.append("\n")
    for op in trace.ops:
        text.append(f"▸ {op.name} ", style="bold #4ea1ff")
        text.append(op.math, style="italic")
        text.append(f"\n    {op.shapes}", style="#f5a524")
        cost = f"{fmt_count(op.flops)} FLOPs · " if op.flops else ""
        text.append(f"\n    {cost}{fmt_bytes(op.bytes)} read + written", style="dim")  # (trial 44c: "moved" read as written)
        if op.flops and op.bytes:
            bound = facts.bound(trace, op)
            text.append(f" · {facts.op_intensity(op):.1f} FLOP/B", style="dim")
            if bound:
                text.append(f" {bound}", style="#3ecf8e" if bound == "compute-bound" else "#ff8a5b")
        text.append("\n")
    flops, moved = sum(o.flops for o in trace.ops), sum(o.bytes for o in trace.ops)
    text.append(f"  layer total: {fmt_count(flops)} FLOPs · {fmt_bytes(moved)} read + written\n", style="bold")
    verdicts = facts.verdict_line(trace)
    if verdicts:
        text.append(f"  {verdicts}\n", style="dim")
    block = xray_blocks.block_lines(trace)  # block modes: how the weights sit in a block, a real one
    if block:
        text.append("\n" + "\n".join(block) + "\n\n", style="#c9b8ff")
    text.append("\n".join(facts.roofline_lines(trace)), style="#8fa8ff")
    return text


def tensors_text(trace: ev.LayerTrace) -> Text:
    """Named tensors: shape as the engine holds it ([T, ...] the flat batch, slices marked), what each
    one is, and real values of this request's last token (the first ones; scores and probs: its newest keys)."""
    text = Text("Tensors: shape, values of this request's last token (head 0; the first ones, scores and probs "
                "its newest keys); what it is\n", style="bold")
    for t in trace.tensors:
        if t.name in (xray_blocks.BLOCK_TENSOR, xray_blocks.BLOCK_TENSOR_AT_LOAD):  # drawn in the pipeline
            continue
        text.append(f"  {t.name:<17}", style="bold")
        text.append(f"{shape(t.shape):<14}", style="#f5a524")
        text.append(facts.sample_text(t), style="dim")
        label = facts.LABELS.get(t.name)
        if label:
            text.append(f"\n  {'':<17}{label}", style="italic grey58")
        text.append("\n")
    text.rstrip()
    return text


def contiguous_reservation(info: dict, req) -> int | None:
    """Tokens the contiguous baseline (``paged`` False) reserved for ``req`` (a ``RequestView``) at
    admission: prompt + ``max_tokens``, capped at ``max_model_len`` (``Scheduler.reservation``); None
    for a paged engine or a request whose prompt length is not known."""
    if info.get("paged", True) or req is None or req.prompt_len is None or not info.get("max_model_len"):
        return None
    return reservation_tokens(req.prompt_len, req.max_tokens, int(info["max_model_len"]))


def gqa_text(trace: ev.LayerTrace, head: int, block_size: int | None, reserved: int | None = None) -> Text:
    """Grouped-query attention as the engine does it (query head h reads KV head h // group, nothing
    copied) and the KV-cache arithmetic, with this model's and this request's numbers.

    ``reserved``: in the contiguous baseline, the tokens of room the request reserved at admission
    (:func:`contiguous_reservation`): its region is those whole blocks, filled or not, not the
    blocks its context fills (trial 22b: "34 tokens fill 3 blocks" beside a 6-block region)."""
    nh, nkv = trace.num_heads, max(1, trace.num_kv_heads)
    group = nh // nkv
    text = Text.assemble(("GQA ", "bold"), f"{nh} query heads share {nkv} KV heads\n")
    for kv in range(nkv):
        text.append("  ")
        for q in range(kv * group, (kv + 1) * group):
            text.append(f"q{q}", style="bold reverse" if q == head else "#4ea1ff")
            text.append(" ")
        text.append(f"→ kv{kv}\n", style="bold reverse" if head // group == kv else "#3ecf8e")
    text.append("query head h reads KV head h // " + str(group), style="bold")
    text.append(f": head {head} reads KV head {head // group}. K and V stay [ctx, {nkv}, {trace.head_dim}] "
                f"beside Q [t, {nh}, {trace.head_dim}], never copied per query head; the scores are grouped "
                f"[{nkv}, {group} x t, ctx].\n")
    lines = facts.gqa_lines(trace)[1:]  # bytes per token, and this request's
    text.append("\n".join(lines))
    _, ctx = facts.new_and_context(trace)
    if ctx and block_size and reserved is not None:
        blocks = -(-max(reserved, ctx) // block_size)
        unfilled = blocks * block_size - ctx
        text.append(f"\n{plural(ctx, 'token')} in a region reserved up front (the contiguous baseline): "
                    f"{plural(blocks, 'block')} of {block_size} = {plural(blocks * block_size, 'slot')}, "
                    f"{plural(unfilled, 'slot')} unfilled")
    elif ctx and block_size:
        blocks = -(-ctx // block_size)
        unfilled = blocks * block_size - ctx
        text.append(f"\n{plural(ctx, 'token')} fill{'s' if ctx == 1 else ''} {plural(blocks, 'block')} of "
                    f"{block_size} ({plural(unfilled, 'slot')} unfilled)")
    return text


class XRayView(EngineView, can_focus=True):
    """The selected request's newest traced step, one layer at a time; the heatmap of one head.

    ↑/↓ (k/j) move between layers, ←/→ (h/l) between heads, PageUp/PageDown scroll the
    pipeline, Home/End show the heatmap's first or newest query rows. The engine traces only
    while this tab is visible (at every step with ``--trace-xray``, :attr:`every_step`), and only
    the layer shown (the others run untraced, in C where the model can); a new layer/head choice
    shows from the next traced step.
    """

    @property
    def every_step(self) -> bool:
        """The live app traces every step, whichever tab shows (``--trace-xray``, the app's ``record_xray``)."""
        return bool(getattr(self.app, "record_xray", False)) and getattr(self.app, "live", True)

    BINDINGS = [
        Binding("up,k", "layer(-1)", "Layer -"),
        Binding("down,j", "layer(1)", "Layer +"),
        Binding("left,h", "head(-1)", "Head -"),
        Binding("right,l", "head(1)", "Head +"),
        Binding("pageup", "scroll_pipeline(-1)", "Scroll", show=False),
        Binding("pagedown", "scroll_pipeline(1)", "Scroll", show=False),
        Binding("home", "heatmap_rows(-1)", "First queries", show=False),
        Binding("end", "heatmap_rows(1)", "Newest queries", show=False),
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
        with Horizontal(id="xray-body"):
            with VerticalScroll(id="xray-left", classes="panel"):
                yield LiveStatic(id="pipeline")
            with VerticalScroll(id="xray-right", classes="panel"):
                yield LiveStatic(id="gqa")
        yield AttentionHeatmap(id="heatmap", classes="panel")

    def on_mount(self) -> None:
        self.query_one("#xray-left").border_title = "Layer pipeline"
        self.query_one("#xray-right").border_title = "GQA and KV memory"
        self.query_one("#heatmap").border_title = "Attention"

    def action_layer(self, delta: int) -> None:
        self.layer_index = (self.layer_index + delta) % self.num_layers

    def action_head(self, delta: int) -> None:
        self.head_index = (self.head_index + delta) % self.num_heads

    def action_heatmap_rows(self, direction: int) -> None:
        heatmap = self.query_one(AttentionHeatmap)
        (heatmap.scroll_end if direction > 0 else heatmap.scroll_home)(animate=False)

    def action_scroll_pipeline(self, direction: int) -> None:
        scroll = self.query_one("#xray-left", VerticalScroll)
        (scroll.scroll_page_down if direction > 0 else scroll.scroll_page_up)(animate=False)

    def on_resize(self) -> None:
        if self._state is not None:  # folding panels in or out changes what the pipeline holds
            self.update_view(self._state, self._selected)

    def watch_layer_index(self) -> None:
        self._changed()

    def watch_head_index(self) -> None:
        self._changed()

    def _changed(self) -> None:
        self.post_message(self.Choice(self.layer_index, self.head_index))
        if self._state is not None:
            self.update_view(self._state, self._selected)

    @property
    def narrow(self) -> bool:
        """Below 100 columns the heatmap folds under the pipeline."""
        return self.app.size.width < NARROW

    @property
    def folded(self) -> bool:
        """The GQA panel is hidden (narrow or short terminal, see app.tcss): its facts join the pipeline."""
        return self.narrow or self.app.size.height < SHORT

    def update_view(self, state: EngineState, selected: str | None) -> None:
        self._state, self._selected = state, selected
        info = state.model_info
        self.num_layers = max(1, info.get("num_layers", 1))
        self.num_heads = max(1, info.get("num_heads", 1))
        title = self.query_one("#xray-title", LiveStatic)
        trace = state.xray.get(self.layer_index)
        heatmap = self.query_one(AttentionHeatmap)
        if state.no_engine:  # no model: no layers to choose and no step to come (trial 13: "layer 0/0 ... send a prompt")
            title.show_content(Text.assemble(("X-Ray ", "bold"), (state.no_engine, "dim")))
            self.query_one("#pipeline", LiveStatic).show_content("")
            self.query_one("#gqa", LiveStatic).show_content("")
            heatmap.set_data((), (), ())
            return
        if trace is None and tp_facts.tp_size(info) > 1:
            self._show_split(state, title, heatmap)
            return
        if trace is None:
            newest = next(iter(state.xray.values()), None)
            if newest is not None:  # the newest traced step captured other layers (the engine traces the chosen one)
                captured = ", ".join(str(n) for n in sorted(state.xray))
                why = f"Layer {self.layer_index} was not captured in step {newest.step} (it captured layer" \
                      f"{'s' if len(state.xray) > 1 else ''} {captured}). "
                req = state.requests.get(selected) if selected else None
                hidden = req is not None and not req.live and ran_after(req, newest.step)  # trial 21d
                age = trace_age(state, newest.step, getattr(self.app, "live", True), why=not hidden,
                                every_step=self.every_step)
                if age:
                    why += f"Step {newest.step} was {age}. "  # (trial 21d: no word of its age)
                if hidden:
                    said = hidden_words(selected, req, newest.step, getattr(self.app, "live", True), self.every_step)
                    why += f"Request {said}."
                elif req is not None and not req.live:  # no next step of it will come (trial 9 said one would)
                    why += (f"Request {selected} is {req.state} (no longer running), so no step of it will capture "
                            f"layer {self.layer_index}; select a running one with ] or [ to see it.")
                elif getattr(self.app, "live", True):
                    why += (f"The engine captures only the chosen layer: the next traced step captures layer "
                            f"{self.layer_index} (unless another app watching the same server chooses another).")
                else:
                    why += "This recording holds only the layers captured while it was made."
            else:
                why = no_trace_words(state, selected, getattr(self.app, "live", True), self.every_step)
            title.show_content(Text.assemble(
                ("X-Ray ", "bold"), f"layer {self.layer_index}/{self.num_layers - 1} (↑↓) · head {self.head_index}/"
                f"{self.num_heads - 1} (←→)\n", (why, "dim")))
            self.query_one("#pipeline", LiveStatic).show_content("")
            self.query_one("#gqa", LiveStatic).show_content("")
            heatmap.set_data((), (), ())
            return
        other = other_request_words(state, trace, selected, getattr(self.app, "live", True), self.every_step)
        # how old the trace is (trial 21d); why, unless the note on the request says it already
        age = trace_age(state, trace.step, getattr(self.app, "live", True), every_step=self.every_step,
                        why="hidden" not in other and "recording holds no" not in other)
        if age:
            other += f"  (step {trace.step} {age})"
        title.show_content(Text.assemble(
            ("X-Ray ", "bold"), ("request ", "dim"), (trace.request_id, "bold #4ea1ff"), f" · step {trace.step} · ",
            (facts.what_ran(trace), "bold"), " · ",
            (f"layer {self.layer_index}/{trace.num_layers - 1}", "bold reverse"), " (↑↓) · ",
            (f"head {self.head_index}/{trace.num_heads - 1}", "bold reverse"), " (←→)", (other, "yellow")))
        gqa = gqa_text(trace, self.head_index, info.get("block_size"),
                       contiguous_reservation(info, state.requests.get(trace.request_id)))
        tp = tp_facts.xray_lines(trace, info)  # a split engine: each rank's shards, the all-reduce bytes
        if tp:
            gqa.append("\n\n" + "\n".join(tp), style="#c9b8ff")
        body = Text.assemble(pipeline_text(trace), "\n\n")
        if self.folded:  # the GQA panel is hidden: its facts go into the pipeline
            body.append_text(Text.assemble(gqa, "\n\n"))
        body.append_text(tensors_text(trace))
        self.query_one("#pipeline", LiveStatic).show_content(body)
        self.query_one("#gqa", LiveStatic).show_content(gqa)
        self._show_heatmap(state, trace, heatmap)

    def _show_split(self, state: EngineState, title: LiveStatic, heatmap: AttentionHeatmap) -> None:
        """No layer captured by a split engine: the line saying so, then the chosen layer's shards,
        the newest step's all-reduce bytes and where each rank's time went (nothing before a step)."""
        info = state.model_info
        last = state.timings[-1] if state.timings else None
        n = tp_facts.tp_size(info)
        title.show_content(Text.assemble(
            ("X-Ray ", "bold"), f"layer {self.layer_index}/{self.num_layers - 1} (↑↓) · split over {n} ranks"
            + (f" · step {last.step}" if last is not None else "") + "\n",
            (tp_facts.capture_off_line(n), "yellow")))
        lines = tp_facts.untraced_lines(info, last.step, last.num_tokens, self.layer_index) if last is not None else []
        body = Text()
        if lines:
            body.append("\n".join(lines[1:]) + "\n", style="#c9b8ff")
            measured = tp_facts.dashboard_lines(last)
            if measured:
                body.append("\nMeasured in this step:\n" + "\n".join(measured), style="#8fa8ff")
        else:
            body.append(f"No step has run yet: {hints.next_step(state, getattr(self.app, 'live', True))}.", style="dim")
            shards = tp_facts.shard_lines(info, self.layer_index, self.num_layers, 0)
            if shards:
                body.append("\n\n" + "\n".join(shards), style="#c9b8ff")
        kv = tp_facts.rank_kv_lines(info)
        gqa = Text("\n".join(kv) if kv else "GQA and KV memory: not shown, the model's sizes are not known yet.",
                   style="#c9b8ff" if kv else "dim")
        if self.folded and kv:  # the GQA panel is hidden: its facts go into the pipeline
            body.append_text(Text.assemble("\n\n", gqa))
        self.query_one("#pipeline", LiveStatic).show_content(body)
        self.query_one("#gqa", LiveStatic).show_content(gqa)
        heatmap.border_title = "Attention (not captured when split over ranks)"
        heatmap.set_data((), (), ())

    def _not_yours(self, step: int) -> str:
        """The heatmap title's note when the heatmap shown is not of the chosen layer and head: a live
        engine traces the chosen ones from its next step; a replay only has what was recorded (trial
        26b: "(yours from the next step)" at every step of a replay that held layer 2's heatmap only
        from step 16, beside a header saying "layer 2/29")."""
        if getattr(self.app, "live", True):
            return " (yours from the next step)"
        chosen = f"layer {self.layer_index} · head {self.head_index}"
        find = getattr(self.app.controller, "next_heatmap_step", None)
        first = find(self.layer_index, self.head_index, step) if find is not None else None
        if first is None:
            return f" (the recording holds no heatmap of {chosen} at step {step} or after)"
        return f" (the recording holds no heatmap of {chosen} at step {step}; its next is at step {first})"

    def _show_heatmap(self, state: EngineState, trace: ev.LayerTrace, heatmap: AttentionHeatmap) -> None:
        heat = state.heat
        if heat is None:
            heatmap.border_title = "Attention"
            heatmap.set_data((), (), ())
            return
        if facts.is_flat(heat):
            key_offset = heat.key_start
        else:  # an older trace kept only the newest keys
            _, ctx = facts.new_and_context(trace)
            key_offset = max(0, ctx - len(heat.key_pieces)) if heat.step == trace.step else 0
        heatmap.set_data(heat.attention, heat.query_pieces, heat.key_pieces, key_offset, heat.keys_per_column)
        group = max(1, heat.num_heads // max(1, heat.num_kv_heads))
        title_text = f"Attention · layer {heat.layer} · head {heat.head} (kv {heat.head // group}) · step {heat.step}"
        if (heat.layer, heat.head) != (self.layer_index, self.head_index):
            title_text += self._not_yours(trace.step)
        heatmap.border_title = title_text
        rows = NARROW_HEATMAP_ROWS if self.folded else HEATMAP_ROWS
        heatmap.styles.height = min(len(heat.attention), rows) + 3  # + the key positions and the border
