"""The top line: the app's name, model, device, dtype and engine state, or the model's loading progress."""

from __future__ import annotations

from rich.text import Text

from nanovllm_core.educational.commentary import plural, weights_label
from nanovllm_tui.state import LOST, EngineState
from nanovllm_tui.widgets.format import bar
from nanovllm_tui.widgets.live import LiveStatic

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
STATE_STYLES = {
    "running": "bold green", "idle": "bold cyan", "paused": "bold yellow", "loading": "bold magenta",
    "failed": "bold red", "stopped": "bold red", "disconnected": "bold red",
    "key refused": "bold red", "key needed": "bold red",
}


Part = tuple  # (text, rank) or (text, rank, the same said shorter[, shorter still ...]); a shorter one may be (text, gate)


def fit(parts: list[Part], width: int | None) -> Text:
    """Join ``parts`` (text, rank[, shorter texts]) in ``width`` cells: the whole line if it fits, else
    the whole line with the parts that have a shorter wording in it (each round the next shorter one,
    while a part has any), else the highest ranks are left out, whole, one rank at a time, each time
    trying the full words and then the shorter ones again (trial 13: at 80 columns the unfinished count
    went with the full words while its shorter wording fit); rank 0 is always kept. What is left is
    never cut silently: a last part still too long ends in an ellipsis.

    A shorter wording given as ``(text, gate)`` is used only once every part ranked above ``gate`` has
    gone (trial 16: at 120 columns the unfinished requests were counted, "2 requests unfinished", while
    their names fit once the weights' formats, a less needed part, went)."""
    def too_long(line: list[tuple[Text, int]]) -> bool:
        return width is not None and sum(t.cell_len for t, _ in line) > width

    def wording(p: Part, level: int, top: int) -> Text:
        chosen = p[0]
        for shorter in p[2:2 + level]:
            text, gate = shorter if isinstance(shorter, tuple) else (shorter, None)
            if gate is not None and top > gate:  # kept until the parts less needed than ``gate`` are gone
                break
            chosen = text
        return chosen

    def worded(ps: list[Part], level: int) -> list[tuple[Text, int]]:
        top = max((p[1] for p in ps), default=0)
        return [(wording(p, level, top), p[1]) for p in ps]

    rounds = max((len(p) - 2 for p in parts), default=0)
    alive = list(parts)
    kept = worded(alive, 0)
    while too_long(kept):
        fitting = next((w for w in (worded(alive, level) for level in range(1, rounds + 1)) if not too_long(w)), None)
        if fitting is not None:
            kept = fitting
            break
        if not any(p[1] for p in alive):
            break
        worst = max(p[1] for p in alive)
        alive = [p for p in alive if p[1] != worst]
        kept = worded(alive, 0)
    line = Text().join(t for t, _ in kept)
    if width is not None and line.cell_len > width:
        line.truncate(width, overflow="ellipsis")
    return line


def unfinished_text(ids: list[str]) -> str:
    """The requests a recording left unfinished, named as ids (the first three, then how many
    more): ``request 0 unfinished``, ``requests 0 and 1 unfinished``, ``requests 0, 1, 2 and 4
    more unfinished``. Trial 12: "0, 1 unfinished in it" read as two counts."""
    names = ids[:3] + ([f"{len(ids) - 3} more"] if len(ids) > 3 else [])
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"{'request' if len(ids) == 1 else 'requests'} {listed} unfinished"


class StatusHeader(LiveStatic):
    """One line: ``nano-vLLM │ model · device · dtype [· q8_0 weights | · q4_1+q8_0 gguf] │ ● state · step N · k active requests``
    (``k active`` where only that shorter wording lets the line fit, once less needed parts went; see ``fit``).

    The state is the one the engine confirmed (its events); ``pausing…`` / ``resuming…`` while the
    app's own pause or resume has not been answered yet. While the model loads it shows the loading stage and a progress bar instead, and a model that
    failed to load, the whole reason. On a narrow terminal the least needed parts go first (the
    weights' formats, device and dtype, the request count, the step; while loading the hint first);
    the app's name and the engine's state always stay.
    """

    def show(self, state: EngineState, replay: bool = False, loading_s: float | None = None,
             width: int | None = None) -> None:
        """Draw from ``state``; ``loading_s``: seconds since loading began; ``width``: cells available."""
        parts: list[Part] = [(Text("nano-vLLM ", style="bold"), 0)]
        if replay:
            parts.append((Text("replay ", style="bold magenta"), 0))
        parts.append((Text("│ ", style="dim"), 0))
        if state.load_error is not None:  # the whole reason, wrapped over a few lines
            parts.append((Text.assemble((f"{state.load_failure}: ", "bold red"), (state.load_error, "red")), 0))
            width = None
        elif not state.ready and replay:
            # a replay loads no model and takes no prompts: its first events (the model's facts, which
            # load_trace requires before the first step) are on their way (trial 20d: "loading model ...
            # (prompts sent now wait in the queue)" under a replay)
            parts.append((Text("reading the recording", style="bold magenta"), 0))
        elif not state.ready:
            parts.append((Text("loading model", style="bold magenta"), 0))
            if state.pending == "pausing" or (state.paused and state.pending is None):  # space pressed while loading
                parts.append((Text(" · will start paused", style="bold yellow"), 1))
            if loading_s is not None:
                parts.append((Text(f" {SPINNER[int(loading_s * 2) % len(SPINNER)]} {loading_s:.0f} s",
                                   style="magenta"), 2))
            loading = state.loading
            if loading is not None:
                parts.append((Text(f" · {loading.stage}"), 3))
                parts.append((Text.assemble(" ", bar(loading.done / max(loading.total, 1), 10, "magenta"),
                                            f" {loading.done}/{loading.total}"), 4))
            parts.append((Text("  (prompts sent now wait in the queue)", style="dim"), 5))
        else:
            # The model and the separator after it go together: "│  │" was left at 60 columns (trial 13)
            parts.append((Text(state.model_name or "model", style="bold"), 1))
            # Quantized weights: say which formats run beside the dtype (gguf: the file's own blocks).
            weights = weights_label(state.model_info)
            weights = f" · {weights}" if weights else ""
            # dropped before the request count (at 120 columns the count went first, issue 29)
            parts.append((Text(f" · {state.device} · {state.dtype}"), 5))
            if weights:
                parts.append((Text(weights), 6))
            # A server out of reach may have resumed meanwhile: say what is known, the lost connection.
            lost = state.engine_state in LOST
            engine_state = "paused" if state.paused and not lost else state.engine_state
            active = len(state.active_requests)
            unfinished = state.unfinished or []  # a replay at its end: the requests the recording stopped in
            cut_short = replay and bool(unfinished)
            shown = "recording ended" if cut_short and engine_state == "idle" else engine_state
            style = STATE_STYLES.get(engine_state, "bold")
            if state.pending is not None and not lost:  # asked for, not yet confirmed by the engine
                shown, style = f"{state.pending}…", "bold yellow"
            parts.append((Text(" │ ", style="dim"), 1))
            state_part = Text(f"● {shown}", style=style)
            if shown == "recording ended":  # "ended" where the whole line does not fit otherwise: at 120
                # columns the weights' formats went first (trial 12: shown in the full replay, not the cut one)
                parts.append((state_part, 0, Text("● ended", style=style)))
            else:
                parts.append((state_part, 0))
            if state.step is not None:
                parts.append((Text(f" · step {state.step}"), 3))
            if cut_short:  # they will never finish: the header said "idle" beside requests listed running
                n = len(unfinished)
                # named where the line has room: counted only once the less needed parts (weights' formats,
                # device, step) have gone and the names still do not fit (trial 16: counted at 120 columns
                # while the weights' formats stayed). (rank 2: after the step, before the model; trial 13
                # saw both dropped at once at 80 columns)
                parts.append((Text(f" · {unfinished_text(unfinished)}"), 2, Text(f" · {unfinished_text(unfinished)}"),
                              (Text(f" · {plural(n, 'request')} unfinished"), 2), (Text(f" · {n} unfinished"), 2)))
            else:  # "N active" where the whole line does not fit otherwise (a long model name in a replay)
                parts.append((Text(f" · {active} active request{'s' if active != 1 else ''}"), 4,
                              Text(f" · {active} active")))
        self.show_content(fit(parts, width))
