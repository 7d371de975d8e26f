"""One row per request: state, priority, prefill and decode progress, TTFT, TPOT."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.message import Message
from textual.widgets import DataTable

from nanovllm_tui.state import EngineState, RequestView
from nanovllm_tui.widgets.format import fmt_ms, progress, request_color

STATE_STYLES = {"submitted": "magenta", "waiting": "yellow", "running": "green", "preempted": "bold red",
                "finished": "dim", "rejected": "red"}
COLUMNS = ("request", "state", "prio", "prefill (prompt tokens)", "decode (output tokens)", "TTFT", "TPOT",
           "preempted", "cached")


class RequestTable(DataTable):
    """The requests of this session; the highlighted row is the selected request.

    Rows are updated cell by cell (only what changed) so a busy engine costs little to show.
    """

    @dataclass
    class Selected(Message):
        request_id: str

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)
        self._shown: dict[str, tuple] = {}

    def on_mount(self) -> None:
        for name in COLUMNS:
            self.add_column(name, key=name)

    @staticmethod
    def cells(req: RequestView) -> tuple:
        state = req.state
        if state == "finished" and req.finish_reason:
            state = f"finished ({req.finish_reason})"
        return (
            Text.assemble(("■ ", request_color(req.order)), req.request_id),
            Text(state, style=STATE_STYLES.get(req.state, "")),
            str(req.priority),
            progress(req.prefilled, req.prompt_len, 8, "cyan") if req.prompt_len else Text("-"),
            progress(req.num_output, req.max_tokens, 8, "green"),
            fmt_ms(req.ttft),
            fmt_ms(req.tpot),
            str(req.num_preemptions),
            str(req.num_cached),
        )

    def sync(self, state: EngineState, selected: str | None) -> None:
        """Make the rows match ``state.requests`` and the cursor match ``selected``."""
        for rid in [r for r in self._shown if r not in state.requests]:
            self.remove_row(rid)
            del self._shown[rid]
        for rid, req in state.requests.items():
            cells = self.cells(req)
            plain = tuple(str(c) for c in cells)
            old = self._shown.get(rid)
            if old is None:
                self.add_row(*cells, key=rid)
            elif old != plain:
                for name, cell, before, now in zip(COLUMNS, cells, old, plain):
                    if before != now:
                        self.update_cell(rid, name, cell, update_width=True)
            self._shown[rid] = plain
        if selected in self._shown:
            row = self.get_row_index(selected)
            if row != self.cursor_row:
                self.move_cursor(row=row, animate=False)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        if event.row_key.value is not None:
            self.post_message(self.Selected(event.row_key.value))
