"""Prefill and decode throughput (tokens/s), each with a sparkline of recent steps."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline

from nanovllm_tui.state import EngineState
from nanovllm_tui.widgets.format import fmt_count


class ThroughputPanel(Vertical):
    """Tokens per second of engine time over the last ``RATE_WINDOW`` steps; sparklines show each step's rate."""

    def compose(self) -> ComposeResult:
        yield Label("prefill", id="prefill-rate")
        yield Sparkline([], id="prefill-spark", summary_function=max)
        yield Label("decode", id="decode-rate")
        yield Sparkline([], id="decode-spark", summary_function=max)

    def show(self, state: EngineState) -> None:
        prefill, decode = state.throughput()
        timings = list(state.timings)
        self.query_one("#prefill-rate", Label).update(
            f"[b]prefill[/b] {fmt_count(prefill)} tok/s")
        self.query_one("#decode-rate", Label).update(
            f"[b]decode[/b]  {fmt_count(decode)} tok/s")
        self.query_one("#prefill-spark", Sparkline).data = [t.prefill_tokens_per_s for t in timings]
        self.query_one("#decode-spark", Sparkline).data = [t.decode_tokens_per_s for t in timings]
