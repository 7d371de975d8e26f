"""Dashboard: phase, requests, KV memory, throughput, and the selected request streaming in."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Static

from nanovllm_tui.state import EngineState
from nanovllm_tui.views.base import EngineView
from nanovllm_tui.widgets.format import request_color, visible_piece
from nanovllm_tui.widgets.kv_bar import KVMemoryBar
from nanovllm_tui.widgets.request_table import RequestTable
from nanovllm_tui.widgets.throughput import ThroughputPanel
from nanovllm_tui.widgets.topk_bars import TopKBars

PHASE_STYLES = {"prefill": "bold #f5a524", "decode": "bold #3ecf8e", "prefill+decode": "bold #4ea1ff",
                "idle": "bold cyan", "paused": "bold yellow", "loading": "bold magenta", "failed": "bold red"}


def phase_text(state: EngineState) -> Text:
    """The phase, and what the newest step did with its token budget and queues."""
    phase = state.phase
    text = Text.assemble((phase.upper(), PHASE_STYLES.get(phase, "bold")))
    plan = state.plan
    if plan is None:
        text.append("\nno step yet", style="dim")
        return text
    prefill = sum(1 for s in plan.scheduled if s.kind == "prefill")
    decode = len(plan.scheduled) - prefill
    if phase == "paused" and plan.scheduled:
        text.append(f" after step {plan.step}", style="dim")
    text.append(f"\nstep {plan.step}: ")
    text.append(f"{plan.num_batched_tokens}/{plan.token_budget}", style="bold")
    text.append(" tokens")
    text.append(f"\n{prefill} prefill · {decode} decode")
    preempted = sum(1 for q in plan.waiting if q.status == "preempted")
    text.append(f"\n{len(plan.running)} running · {len(plan.waiting) - preempted} waiting")
    if preempted:
        text.append(f" · {preempted} preempted", style="bold red")
    return text


class DashboardView(EngineView):
    """The engine at a glance. The request table's highlighted row is the selected request."""

    def compose(self) -> ComposeResult:
        with Horizontal(id="dash-top"):
            yield Static(id="phase", classes="panel")
            yield KVMemoryBar(id="kv", classes="panel")
            yield ThroughputPanel(id="throughput", classes="panel")
        yield RequestTable(id="requests")
        with Horizontal(id="dash-bottom"):
            with VerticalScroll(id="output-scroll", classes="panel"):
                yield Static(id="output")
            yield TopKBars(id="topk", classes="panel")

    def on_mount(self) -> None:
        self.query_one("#phase").border_title = "Engine"
        self.query_one("#kv").border_title = "KV cache memory"
        self.query_one("#throughput").border_title = "Throughput"
        self.query_one("#output-scroll").border_title = "Selected request"
        self.query_one("#topk").border_title = "Top-k next tokens"

    def focus_main(self) -> None:
        self.query_one(RequestTable).focus()

    def update_view(self, state: EngineState, selected: str | None) -> None:
        self.query_one("#phase", Static).update(phase_text(state))
        self.query_one(KVMemoryBar).show(state)
        self.query_one(ThroughputPanel).show(state)
        self.query_one(RequestTable).sync(state, selected)
        req = state.requests.get(selected) if selected else None
        scroll = self.query_one("#output-scroll", VerticalScroll)
        topk = self.query_one(TopKBars)
        if req is None:
            scroll.border_title = "Selected request"
            self.query_one("#output", Static).update(
                Text("Type a prompt below and press Enter; its text streams in here.", style="dim"))
            topk.show((), None)
            return
        scroll.border_title = f"{req.request_id} · {req.state}"
        text = Text()
        text.append(req.prompt, style="dim")
        text.append(req.text, style=f"bold {request_color(req.order)}")
        if req.state == "running":
            text.append("▌", style="bold")
        if req.error:
            text.append(f"\n{req.error}", style="red")
        self.query_one("#output", Static).update(text)
        scroll.scroll_end(animate=False)
        label = f"token #{req.num_output}: {visible_piece(req.last_token)!s}" if req.num_output else ""
        topk.show(req.top, req.last_token_id, label)
