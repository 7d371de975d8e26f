"""Prefill and decode throughput (tokens/s) now, each with a sparkline of recent steps."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical

from nanovllm_core.educational.commentary import plural
from nanovllm_tui.state import RATE_WINDOW, EngineState, mixed_step
from nanovllm_tui.widgets.format import fmt_ms, fmt_rate, sparkline
from nanovllm_tui.widgets.live import LiveStatic

STYLES = {"prefill": "#f5a524", "decode": "#3ecf8e"}


class ThroughputPanel(Vertical):
    """Tokens per second of engine time over the newest ``RATE_WINDOW`` steps that did prefill
    (decode) work while the engine runs (``EngineState.rate``: what the Narrator tells for a step),
    0 while it is idle or paused, with the rate of those steps beside the sparkline ("last 3
    steps 1,234 tok/s"); sparklines show each step's rate, one cell a step.

    The rates leave out the time steps waited while the app drew a key's frame (``StepTimed.yielded_s``,
    ``nanovllm_core/yield_gate.py``); once there was any, the panel's bottom border says how much in all.
    Steps the X-Ray traced keep their capture in their rates (it runs inside the step); while any is among
    the newest ``RATE_WINDOW``, the border says so too. A step that prefilled and decoded together
    (``mixed_step``) is in neither rate nor sparkline (its time is shared by both kinds of rows); while any
    is among the newest ``RATE_WINDOW``, the border says so (trial 13b)."""

    def compose(self) -> ComposeResult:
        for kind in STYLES:
            yield LiveStatic(kind, id=f"{kind}-rate")
            yield LiveStatic(id=f"{kind}-spark")

    def show(self, state: EngineState) -> None:
        traced = sum(1 for t in list(state.timings)[-RATE_WINDOW:] if getattr(t, "traced", False))  # a deque
        width = self.size.width - 4
        mixed = sum(1 for t in list(state.timings)[-RATE_WINDOW:] if mixed_step(t))
        parts = [c for c in (yielded_caption(state.yielded_s, width), traced_caption(traced, width),
                             mixed_caption(mixed, width)) if c]
        both = " · ".join(parts)
        self.border_subtitle = both if len(both) <= width else parts[0] if parts else ""
        rates = {kind: state.rate(kind) for kind in STYLES}
        per_step = {"prefill": [0.0 if mixed_step(t) else t.prefill_tokens_per_s for t in state.timings],
                    "decode": [0.0 if mixed_step(t) else t.decode_tokens_per_s for t in state.timings]}
        busy = state.busy
        for kind, style in STYLES.items():
            rate, steps = rates[kind]
            now = rate if busy else 0.0
            figure = "- (only mixed steps)" if busy and not steps and mixed else f"{fmt_rate(now)} tok/s"
            self.query_one(f"#{kind}-rate", LiveStatic).show_content(Text.assemble((f"{kind:<8}", "bold"), figure))
            spark = self.query_one(f"#{kind}-spark", LiveStatic)
            width = spark.content_region.width
            last = Text()
            if not busy and steps:
                last = Text(f" last {plural(steps, 'step')} {fmt_rate(rate)} tok/s", style="dim")
            line = sparkline(per_step[kind], max(0, width - len(last)), style)
            spark.show_content(line + last)


def traced_caption(steps: int, width: int) -> str:
    """The bottom border when X-Ray-traced steps are among the newest ones: their capture ran inside the step
    and is in their rates (trial 12: rates over traced steps read as the engine's); "" when none."""
    if not steps:
        return ""
    variants = [f"X-Ray capture counted in {plural(steps, 'recent step')}' rates"
                if steps > 1 else "X-Ray capture counted in a recent step's rate",
                "X-Ray capture counted in rates", "X-Ray in rates"]
    return next((v for v in variants if len(v) <= width), variants[-1])


def mixed_caption(steps: int, width: int) -> str:
    """The bottom border when steps that prefilled and decoded together are among the newest ones: their time
    is shared by both kinds of rows, so they are in neither rate (trial 13b); "" when none."""
    if not steps:
        return ""
    variants = [f"{plural(steps, 'mixed prefill+decode step')} not in rates", "mixed steps not in rates",
                "mixed not in rates"]
    return next((v for v in variants if len(v) <= width), variants[-1])


def yielded_caption(seconds: float, width: int) -> str:
    """The Throughput panel's bottom border: the steps' waits for this app's keys (``StepTimed.yielded_s``),
    in the longest wording that fits ``width`` cells; "" when there were none."""
    if seconds < 0.0005:
        return ""
    figure = fmt_ms(seconds)
    variants = [f"{figure} waited for your keys (not in rates)", f"{figure} for keys, not in rates",
                f"keys {figure}, not in rates", f"keys {figure}"]
    return next((v for v in variants if len(v) <= width), variants[-1])
