"""The top line: model, device, dtype and engine state, or the model's loading progress."""

from __future__ import annotations

from rich.text import Text
from nanovllm_tui.widgets.live import LiveStatic

from nanovllm_tui.state import EngineState
from nanovllm_tui.widgets.format import bar

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
STATE_STYLES = {
    "running": "bold green", "idle": "bold cyan", "paused": "bold yellow", "loading": "bold magenta",
    "failed": "bold red", "stopped": "bold red", "disconnected": "bold red",
}


class StatusHeader(LiveStatic):
    """One line: ``nano-vLLM │ model · device · dtype │ ● state · step N``.

    While the model loads it shows the loading stage and a progress bar instead.
    """

    def show(self, state: EngineState, replay: bool = False, loading_s: float | None = None,
             compact: bool = False) -> None:
        """Draw from ``state``; ``loading_s``: seconds since loading began; ``compact``: a narrow terminal."""
        text = Text("" if compact else "nano-vLLM ", style="bold")
        if replay:
            text.append("replay ", style="bold magenta")
        text.append("│ ", style="dim")
        if state.load_error is not None:
            text.append("model failed to load: ", style="bold red")
            text.append(state.load_error, style="red")
        elif not state.ready:
            loading = state.loading
            text.append("loading model", style="bold magenta")
            if loading_s is not None:
                text.append(f" {SPINNER[int(loading_s * 2) % len(SPINNER)]} {loading_s:.0f} s", style="magenta")
            if loading is not None:
                text.append(f" · {loading.stage} ")
                text.append_text(bar(loading.done / max(loading.total, 1), 10, "magenta"))
                text.append(f" {loading.done}/{loading.total}")
            text.append("  (prompts sent now wait in the queue)", style="dim")
        else:
            text.append(state.model_name or "model", style="bold")
            if not compact:
                text.append(f" · {state.device} · {state.dtype}")
            text.append(" │ ", style="dim")
            # A server out of reach may have resumed meanwhile: say what is known, the lost connection.
            lost = state.engine_state in ("stopped", "disconnected")
            engine_state = "paused" if state.paused and not lost else state.engine_state
            text.append(f"● {engine_state}", style=STATE_STYLES.get(engine_state, "bold"))
            if state.step is not None:
                text.append(f" · step {state.step}")
            active = len(state.active_requests)
            if not compact:
                text.append(f" · {active} active request{'s' if active != 1 else ''}")
        self.show_content(text)
