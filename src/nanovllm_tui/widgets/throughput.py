"""Prefill and decode throughput (tokens/s), each with a sparkline of recent steps."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from rich.text import Text
from textual.widgets import Sparkline

from nanovllm_tui.state import EngineState
from nanovllm_tui.widgets.format import fmt_count
from nanovllm_tui.widgets.live import LiveStatic


class ThroughputPanel(Vertical):
    """Tokens per second of engine time over the last ``RATE_WINDOW`` steps; sparklines show each step's rate."""

    _last_step: int | None = None

    def compose(self) -> ComposeResult:
        yield LiveStatic("prefill", id="prefill-rate")
        yield Sparkline([], id="prefill-spark", summary_function=max)
        yield LiveStatic("decode", id="decode-rate")
        yield Sparkline([], id="decode-spark", summary_function=max)

    def show(self, state: EngineState) -> None:
        prefill, decode = state.throughput()
        timings = list(state.timings)
        self.query_one("#prefill-rate", LiveStatic).show_content(
            Text.assemble(("prefill ", "bold"), f"{fmt_count(prefill)} tok/s"))
        self.query_one("#decode-rate", LiveStatic).show_content(
            Text.assemble(("decode  ", "bold"), f"{fmt_count(decode)} tok/s"))
        last = timings[-1].step if timings else None
        if last != self._last_step:  # the sparklines change only with a new step
            self._last_step = last
            self.query_one("#prefill-spark", Sparkline).data = [t.prefill_tokens_per_s for t in timings]
            self.query_one("#decode-spark", Sparkline).data = [t.decode_tokens_per_s for t in timings]
