"""Newcomer trial 16a: the pausing frame drew "paused" ahead of the last step's events, the Tutorial's
``a`` replaced a saved quiz answer, the cut replay's end counted requests whose names fit, and a prompt
of spaces was refused as empty."""

from __future__ import annotations

from nanovllm_core import events as ev
from nanovllm_tui.state import EngineState
from nanovllm_tui.widgets.status_header import StatusHeader, unfinished_text


def header_line(state: EngineState, width: int, replay: bool = True) -> str:
    header = StatusHeader()
    shown = []
    header.show_content = shown.append
    header.show(state, replay=replay, width=width)
    return shown[-1].plain


def test_a_cut_replays_end_names_the_unfinished_requests_where_they_fit_at_120_columns():
    """At 120 columns the header said "2 requests unfinished" while "requests 0 and 1 unfinished" fit once
    the weights' formats (a less needed part) went; docs/app.md: the count only where there is no room."""
    state = EngineState()
    state.apply(ev.ModelLoading(stage="ready", done=1, total=1, ready=True, model_name="SmolLM2-135M-Instruct",
                                device="cpu", dtype="float32",
                                model_info=(("quantization", "gguf"), ("weight_kinds", "q4_1+q8_0"))))
    state.engine_state, state.step, state.unfinished = "idle", 4, ["0", "1"]
    line = header_line(state, 118)  # 120 columns less the header's padding
    assert "● recording ended · step 4 · requests 0 and 1 unfinished" in line and len(line) <= 118, line
    assert "SmolLM2-135M-Instruct" in line
    wide = header_line(state, 198)
    assert "q4_1+q8_0 gguf" in wide and unfinished_text(["0", "1"]) in wide, wide
    for width in (60, 80, 100):  # narrower: the names (or their count) and the model stay as long as they fit
        line = header_line(state, width)
        assert len(line) <= width and "SmolLM2-135M-Instruct" in line and "ended" in line, line
