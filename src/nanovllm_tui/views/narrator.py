"""Narrator: running plain-English commentary written from the engine's events.

The words come from ``nanovllm_core.educational.narrator`` (the CLI's ``--narrate`` uses the
same module); the app feeds it every event and this tab shows its entries. While the tab is
hidden, entries wait in a bounded queue and are written when it is shown again. Entries are
wrapped at the log's width, and written again from the kept history when that width changes,
so no line is ever cut at the edge.
"""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import RichLog

from nanovllm_core.educational.narrator import Commentary
from nanovllm_tui.state import EngineState
from nanovllm_tui.views.base import EngineView
from nanovllm_tui.widgets.commentary import commentary_text
from nanovllm_tui.widgets.live import LiveStatic

MAX_PENDING = 400
MAX_LINES = 3000
BAR_WIDTH = 20  # cells for a probability of 1 (fixed: the log's width is not known before its first layout)


class NarratorView(EngineView):
    """The narrator's log. ``f`` shows only the selected request (and the scheduler's decisions)."""

    BINDINGS = [Binding("f", "toggle_filter", "Only selected")]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pending: deque[Commentary] = deque(maxlen=MAX_PENDING)
        self.history: deque[Commentary] = deque(maxlen=MAX_PENDING)
        self.only_selected = False
        self.skipped = 0
        self._selected: str | None = None
        self._width: int | None = None  # the log's width its lines were wrapped at

    def compose(self) -> ComposeResult:
        yield LiveStatic(id="narrator-title")
        # min_width=1: RichLog renders at least 78 cells wide by default, which cut the lines of a
        # narrower log (issue 15); the log's CSS keeps its scrollbar, so the width never changes with it.
        yield RichLog(id="narration", wrap=True, max_lines=MAX_LINES, auto_scroll=True, min_width=1, classes="panel")

    def main_widget(self) -> RichLog:
        return self.query_one(RichLog)

    def on_resize(self) -> None:
        width = self.query_one(RichLog).scrollable_content_region.width
        if width and width != self._width:
            if self._width is not None:
                self._rewrite()
                self.update_view(self.app.state, self.app.selected)
            self._width = width

    def add(self, notes: list[Commentary]) -> None:
        """Queue new entries (shown the next time the tab is drawn)."""
        if len(notes) + len(self.pending) > MAX_PENDING:
            self.skipped += len(notes) + len(self.pending) - MAX_PENDING
        self.pending.extend(notes)
        self.history.extend(notes)

    def _shows(self, note: Commentary) -> bool:
        return not self.only_selected or note.request_id in (None, self._selected)

    def update_view(self, state: EngineState, selected: str | None) -> None:
        if selected != self._selected and self.only_selected:
            self._selected = selected
            self._rewrite()
        self._selected = selected
        log = self.query_one(RichLog)
        if self.skipped:
            log.write(Text(f"… {self.skipped} earlier entries skipped while this tab was hidden", style="dim"))
            self.skipped = 0
        for note in self.pending:
            if self._shows(note):
                log.write(commentary_text(note, BAR_WIDTH))
        self.pending.clear()
        who = f"request {selected} and the scheduler" if self.only_selected else "every request"
        self.query_one("#narrator-title", LiveStatic).show_content(Text.assemble(
            ("Narrator ", "bold"), ("what the engine just did, told from its events · showing ", "dim"), who,
            ("  (f: toggle)", "dim")))

    def action_toggle_filter(self) -> None:
        self.only_selected = not self.only_selected
        self._rewrite()
        self.update_view(self.app.state, self.app.selected)

    def _rewrite(self) -> None:
        """Redraw the log from the kept history under the current filter."""
        log = self.query_one(RichLog)
        log.clear()
        self.pending.clear()
        self.pending.extend(self.history)
