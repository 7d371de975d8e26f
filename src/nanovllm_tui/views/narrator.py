"""Narrator: running plain-English commentary written from the engine's events.

The words come from ``nanovllm_core.educational.narrator`` (the CLI's ``--narrate`` uses the
same module); the app feeds it every event and this tab shows its entries. While the tab is
hidden, entries wait in a bounded queue and are written when it is shown again, ``WRITE_SLICE``
at a time, one slice a frame, so a full queue never holds the window still. Entries are
wrapped at the log's width, and written again from the kept history when that width changes
(checked at each showing and update, also after a resize while the tab was hidden), so no line
is ever cut at the edge; nothing is written before the log has a width (a tab
just shown is laid out at the next frame).
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
# Entries written per frame. Writing a full queue (MAX_PENDING decode entries, ~4,000 wrapped lines) at once held
# the UI thread 1.2 s at 120x40 and 1.9 s at 60x20 (2-core AMD EPYC, load ~5; 3-5 ms an entry), the log's box
# drawn empty and keys unanswered meanwhile (newcomer trial 7: a Narrator first shown blank); 50 take ~0.2 s.
WRITE_SLICE = 50
LAYOUT_POLL_S = 0.05  # how soon a tab just shown, not yet laid out, is looked at again
SLICE_GAP_S = 0.02  # between slices: a frame, and keys, get their turn


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
        self._draining = False  # a slice of pending entries is due after the next frame

    def compose(self) -> ComposeResult:
        yield LiveStatic(id="narrator-title")
        # min_width=1: RichLog renders at least 78 cells wide by default, which cut the lines of a
        # narrower log (issue 15); the log's CSS keeps its scrollbar, so the width never changes with it.
        yield RichLog(id="narration", wrap=True, max_lines=MAX_LINES, auto_scroll=True, min_width=1, classes="panel")

    def main_widget(self) -> RichLog:
        return self.query_one(RichLog)

    def on_resize(self) -> None:
        if self._width_changed():
            self.update_view(self.app.state, self.app.selected)

    def _width_changed(self) -> bool:
        """When the log's width is not the one its lines were wrapped at, queue every kept entry to be
        written again (:meth:`_rewrite`); True if so. Checked at each showing and update, not only on
        this view's resize: a window widened while the tab was hidden reached the view before its
        log had the new width, and the old lines kept the old wrap (trial 10)."""
        width = self.query_one(RichLog).scrollable_content_region.width
        if not width or width == self._width:
            return False
        known, self._width = self._width, width
        if known is None:  # the first width: nothing was written before it (see _write_slice)
            return False
        self._rewrite()
        return True

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
        self._write_slice()
        who = f"request {selected} and the scheduler" if self.only_selected else "every request"
        self.query_one("#narrator-title", LiveStatic).show_content(Text.assemble(
            ("Narrator ", "bold"), ("what the engine just did, told from its events · showing ", "dim"), who,
            ("  (f: toggle)", "dim")))

    def _write_slice(self) -> None:
        """Write the oldest ``WRITE_SLICE`` pending entries; the rest follow one slice a frame while the
        tab stays on screen (and wait for its next showing if it is hidden meanwhile)."""
        log = self.query_one(RichLog)
        if not log.scrollable_content_region.width:
            # Hidden, or just shown and not laid out yet: RichLog would wrap at its min_width, one
            # character a line, for good (trial 10). Wait for the layout.
            if (self.pending or self.skipped) and not self._draining:
                self._draining = True
                self.set_timer(LAYOUT_POLL_S, self._drain)
            return
        self._width_changed()
        if self.skipped:
            log.write(Text(f"… {self.skipped} earlier entries skipped while this tab was hidden", style="dim"))
            self.skipped = 0
        for _ in range(min(WRITE_SLICE, len(self.pending))):
            note = self.pending.popleft()
            if self._shows(note):
                log.write(commentary_text(note, BAR_WIDTH))
        if self.pending and not self._draining:  # the next slice on a timer: it runs with the app idle too
            self._draining = True
            self.set_timer(SLICE_GAP_S, self._drain)

    def _drain(self) -> None:
        """Write the next slice while the tab is on screen. A tab just shown may not be laid out yet
        when this runs: then try again shortly for as long as the tab is the one shown. Before, the
        entries waited for the next engine event, and with the engine idle the tab stayed blank until
        a key or a resize (the "blank Narrator" of trials 7, 11 and 12)."""
        self._draining = False
        if not (self.pending or self.skipped) or not self.is_attached:
            return
        laid_out = self.is_on_screen and self.query_one(RichLog).scrollable_content_region.width
        if laid_out:
            self._write_slice()
        elif self.app.view() is self:  # shown, not laid out yet
            self._draining = True
            self.set_timer(LAYOUT_POLL_S, self._drain)

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
