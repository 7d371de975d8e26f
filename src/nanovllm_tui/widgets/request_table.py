"""One row per request: state, priority, prefill and decode progress, TTFT, TPOT.

Every cell shows its whole value (a column is as wide as its widest cell; the table scrolls
sideways when the terminal is narrower), except a request id longer than ``ID_CELLS``: a server's
ids (``chatcmpl-`` and 32 hex digits) are shown as their prefix, ``…`` and as many last characters
as keep every row's label distinct (``short_ids``); the selected request's panel title shows
the whole id.

A Line API widget: each row is rendered once per change and kept as a ``Strip``, so a busy
engine (every running row changes every step) costs one row render per changed row, not a
redraw of the whole table. ↑/↓ (or a click) move the cursor; the cursor's row is the
selected request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from nanovllm_tui.state import EngineState, RequestView
from nanovllm_tui.widgets.format import fmt_ms, progress, request_color

STATE_STYLES = {"submitted": "magenta", "waiting": "yellow", "running": "green", "preempted": "bold red",
                "finished": "dim", "rejected": "red", "lost": "red",
                "unfinished": "yellow"}
# (title, least width in cells, a separating space included)
COLUMNS = (("request", 9), ("state", 18), ("prio", 5), ("prefill (prompt)", 19), ("decode (output)", 19),
           ("TTFT", 9), ("TPOT", 8), ("preempted", 10), ("cached", 7))
CURSOR = Style(bgcolor="#264f78", bold=True)
HEADER = Style(bold=True, color="#c0c0c0")


ID_CELLS = 16  # the longest request label shown whole: the engine's "req-12", a client's short ids


def short_ids(ids: list[str], limit: int = ID_CELLS) -> dict[str, str]:
    """Each id's label in the table: itself when at most ``limit`` cells, else its prefix up to the
    first ``-`` (at most 9 characters: ``chatcmpl-``), ``…`` and its last characters, as many as
    make every label in ``ids`` distinct (at least enough to fill ``limit``).

    ``short_ids(["chatcmpl-0f3a…9e21c4"])`` -> ``{...: "chatcmpl-…9e21c4"}``. Labels of ids that
    differ only in their middle grow their tails until they differ (the whole id at worst).
    """
    def head(rid: str) -> str:
        cut = rid.find("-")
        return rid[:cut + 1] if 0 <= cut < 9 else ""

    def label(rid: str, keep: int) -> str:
        return rid if len(head(rid)) + 1 + keep >= len(rid) else f"{head(rid)}…{rid[-keep:]}"

    keep = {rid: limit - len(head(rid)) - 1 for rid in ids if len(rid) > limit}
    labels = {rid: label(rid, keep[rid]) if rid in keep else rid for rid in ids}
    while True:  # every round lengthens each colliding label by one character; whole ids never collide
        seen: dict[str, list[str]] = {}
        for rid, text in labels.items():
            seen.setdefault(text, []).append(rid)
        clashing = [rid for group in seen.values() if len(group) > 1 for rid in group if rid in keep and labels[rid] != rid]
        if not clashing:
            return labels
        for rid in clashing:
            keep[rid] += 1
            labels[rid] = label(rid, keep[rid])


def row_cells(req: RequestView, label: str | None = None) -> tuple[Text, ...]:
    """The row's cells; ``label``: how the id is shown (``short_ids``; default the whole id)."""
    state = req.state
    if state == "finished" and req.finish_reason:
        state = f"finished ({req.finish_reason})"
    if state == "unfinished" and req.ended_as:  # a replay's end: as the last step played left it
        state = f"unfinished ({req.ended_as})"
    if req.n > 1:  # every figure of the row is sample 0's (trial 30e: "preempted 0" beside 3 preemptions of
        state += f" · sample 0 of {req.n}"  # its other samples, said only in a panel title cut at 120 columns)
        if req.sample0_done and req.live:  # its figures are final while the others run (trial 35e)
            state += " done"
    return (
        Text.assemble(("■ ", request_color(req.order)), label or req.request_id),
        Text(state, style=STATE_STYLES.get(req.state, "")),
        Text(str(req.priority) if req.priority is not None else "-"),
        progress(req.prefilled, req.prompt_len, 8, "cyan") if req.prompt_len else Text("-"),
        progress(req.num_output, req.max_tokens, 8, "green"),
        Text(fmt_ms(req.ttft)),
        Text(fmt_ms(req.tpot)),
        Text(str(req.num_preemptions)),
        Text(str(req.num_cached)),
    )


def column_widths(rows) -> tuple[int, ...]:
    """Each column's width: its least width, or its widest cell and a space."""
    widths = [max(least, len(title) + 1) for title, least in COLUMNS]
    for cells in rows:
        widths = [max(w, cell.cell_len + 1) for w, cell in zip(widths, cells)]
    return tuple(widths)


def join_cells(cells: tuple[Text, ...], widths: tuple[int, ...]) -> Text:
    line = Text(" ")
    for cell, width in zip(cells, widths):
        line.append_text(cell)
        line.append(" " * (width - cell.cell_len))
    return line


class RequestTable(ScrollView, can_focus=True):
    """The requests of this session, oldest first; the cursor row is the selected request."""

    BINDINGS = [
        Binding("up", "move(-1)", "Up", show=False),
        Binding("down", "move(1)", "Down", show=False),
        Binding("home", "move(-1000000)", "First", show=False),
        Binding("end", "move(1000000)", "Last", show=False),
        # a column a press, as the hint counts them (trial 13: one character a press, ~50 to see TTFT at 60x20)
        Binding("left", "column(-1)", "Column left", show=False),
        Binding("right", "column(1)", "Column right", show=False),
    ]
    # No horizontal scrollbar: while columns are off-screen its line says so in words (scroll_hint)
    DEFAULT_CSS = "RequestTable { height: 1fr; scrollbar-size-horizontal: 0; }"

    @dataclass
    class Selected(Message):
        request_id: str

    def __init__(self, chosen: Callable[[str], None] | None = None, **kwargs) -> None:
        """``chosen(request_id)``: called at once when the cursor moves to a row (the app's selection);
        without it a ``Selected`` message is posted. At once, not by message: a key right behind ↓ in
        the same terminal read (``↓ a``) acts before a message is handled, and aborted the request
        selected before ↓ (trial 24a)."""
        super().__init__(**kwargs)
        self.chosen = chosen or (lambda request_id: self.post_message(self.Selected(request_id)))
        self.ids: list[str] = []
        self.rows: dict[str, tuple[Text, ...]] = {}
        self.cursor = -1  # no request selected
        self.widths = column_widths(())
        self._cache: dict[tuple, Strip] = {}

    def sync(self, state: EngineState, selected: str | None) -> None:
        """Take the rows from ``state.requests`` and the cursor from ``selected``; redraw if anything changed."""
        labels = short_ids(list(state.requests))
        rows = {rid: row_cells(req, labels[rid]) for rid, req in state.requests.items()}
        cursor = list(rows).index(selected) if selected in rows else -1
        if rows == self.rows and cursor == self.cursor and list(rows) == self.ids:
            return
        self.ids, self.rows, self.cursor = list(rows), rows, cursor
        self.widths = column_widths(rows.values())
        self._size_to_rows()
        self._keep_cursor_visible()
        if len(self._cache) > 4 * len(rows) + 64:
            self._cache.clear()
        self.refresh()

    # ------------------------------------------------------------------ columns off-screen

    def hidden_columns(self) -> tuple[int, int]:
        """(columns cut or off-screen at the left, at the right) at the current width and scroll:
        (0, 0) when every column is shown whole."""
        width, start = self.scrollable_content_region.width, int(self.scroll_x)
        if width <= 0:
            return 0, 0
        left = right = 0
        x = 1  # the line's leading space
        for w in self.widths:
            left += x < start
            right += x + w - 1 > start + width  # the column's cells, its separating space left out
            x += w
        return left, right

    def scroll_hint(self) -> Text | None:
        """The table's last line while columns are off-screen (trial 12: at 60x20 it ended at
        "decode (" and nothing said it scrolls): how many, on which side, and the keys; else None."""
        left, right = self.hidden_columns()
        if not left and not right:
            return None
        sides = ([f"← {left}"] if left else []) + ([f"→ {right}"] if right else [])
        keys = "←/→ scroll" if self.has_focus else "Esc, then ←/→ scroll"
        n = left + right
        return Text(f"{' · '.join(sides)} more column{'s' if n != 1 else ''} off-screen: {keys}", style="dim italic")

    def _hint_line(self) -> int | None:
        """The viewport line the scroll hint takes (under the last row, or the last line), or None."""
        if self.scroll_hint() is None:
            return None
        return min(len(self.ids) + 1, max(1, self.scrollable_content_region.height - 1))

    def _size_to_rows(self) -> None:
        cut = any(self.hidden_columns()) if self.is_mounted else False
        self.virtual_size = Size(sum(self.widths) + 1, len(self.ids) + 1 + cut)  # + the hint's line

    def on_resize(self) -> None:
        self._size_to_rows()
        self._cache.clear()
        self.refresh()

    def on_focus(self) -> None:
        self.refresh()  # the hint's keys

    def on_blur(self) -> None:
        self.refresh()

    def _keep_cursor_visible(self) -> None:
        if self.cursor < 0:
            return
        visible = max(1, self.scrollable_content_region.height - 1 - (self._hint_line() is not None))
        if self.cursor < self.scroll_y:
            self.scroll_to(y=self.cursor, animate=False, immediate=True)
        elif self.cursor >= self.scroll_y + visible:
            self.scroll_to(y=self.cursor - visible + 1, animate=False, immediate=True)

    def column_starts(self) -> list[int]:
        """The scroll positions that put each column at the left edge (the first: 0, its leading space shown)."""
        starts, x = [0], 1
        for w in self.widths[:-1]:
            x += w
            starts.append(x)
        return starts

    def action_column(self, delta: int) -> None:
        """Scroll sideways by a whole column: the next (or previous) column's start to the left edge."""
        now, last = int(self.scroll_x), int(self.max_scroll_x)
        if delta > 0:
            target = next((x for x in self.column_starts() if x > now), last)
        else:
            target = next((x for x in reversed(self.column_starts()) if x < now), 0)
        self.scroll_to(x=max(0, min(last, target)), animate=False, immediate=True)
        self.refresh()

    def action_move(self, delta: int) -> None:
        if self.ids:
            start = self.cursor if self.cursor >= 0 else (-1 if delta > 0 else len(self.ids))
            self._select(max(0, min(len(self.ids) - 1, start + delta)))

    def on_click(self, event: events.Click) -> None:
        row = int(self.scroll_y) + event.y - 1
        if 0 <= row < len(self.ids):
            self._select(row)

    def _select(self, row: int) -> None:
        self.cursor = row
        self._keep_cursor_visible()
        self.refresh()
        self.chosen(self.ids[row])

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        scroll_x = int(self.scroll_x)
        at_cursor = False
        if y and y == self._hint_line():
            hint = self.scroll_hint()
            hint.truncate(max(0, width - 1), overflow="ellipsis")
            return Strip(list((Text(" ") + hint).render(self.app.console))).extend_cell_length(width).crop(0, width)
        if y == 0:
            cells = tuple(Text(name, style=HEADER) for name, _ in COLUMNS)
            key: tuple = ("header", width, scroll_x, self.widths)
        else:
            row = int(self.scroll_y) + y - 1
            if not 0 <= row < len(self.ids):
                return Strip.blank(width)
            cells = self.rows[self.ids[row]]
            at_cursor = row == self.cursor
            key = (tuple(c.markup for c in cells), at_cursor, width, scroll_x, self.widths)
        strip = self._cache.get(key)
        if strip is None:
            segments = list(join_cells(cells, self.widths).render(self.app.console))
            strip = Strip(segments).crop(scroll_x, scroll_x + width).extend_cell_length(width)
            if at_cursor:
                strip = strip.apply_style(CURSOR)
            self._cache[key] = strip
        return strip
