"""The attention heatmap: softmax weights of one layer and head, queries down, every key across."""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.color import Color
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from nanovllm_tui.widgets.format import visible_piece

LABEL = 11  # query piece column
NOTE = 17  # " →piece    0.53": the key each row attends to most
SHADES = 16
LOW, HIGH = Color.parse("#0d1b2a"), Color.parse("#ffd166")


def column_layout(num_columns: int, width: int) -> tuple[int, int]:
    """(cell width in characters, columns summed per cell) so ``num_columns`` fit ``width`` characters.

    Two characters a key when they fit, one when only that fits, else several keys per cell.
    """
    room = max(1, width - LABEL - NOTE)
    if 2 * num_columns <= room:
        return 2, 1
    if num_columns <= room:
        return 1, 1
    return 1, -(-num_columns // room)


class AttentionHeatmap(ScrollView):
    """Rows: the query tokens of this step; columns: every key they may attend to (later keys are masked).

    A cell's brightness is the attention weight (each row sums to 1). Every key position is
    on screen at any width: when the keys do not fit, neighbouring keys share a cell whose
    weight is their sum, and the subtitle says how many. After each row, the key it attends
    to most and that weight. Line API: only visible rows are rendered.
    """


    DEFAULT_CSS = "AttentionHeatmap { overflow-x: hidden; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.weights: tuple[tuple[float, ...], ...] = ()
        self.queries: tuple[str, ...] = ()
        self.keys: tuple[str, ...] = ()
        self.key_offset = 0
        self.keys_per_column = 1
        self._shades = [Style(bgcolor=LOW.blend(HIGH, (i / (SHADES - 1)) ** 0.5).rich_color) for i in range(SHADES)]
        self._label = Style(color="grey70")
        self._note = Style(color="grey58")

    @property
    def num_keys(self) -> int:
        """Key positions covered by the weights."""
        return len(self.weights[0]) * self.keys_per_column if self.weights else 0

    def set_data(self, weights, queries, keys, key_offset: int = 0, keys_per_column: int = 1) -> None:
        """``weights [queries][columns]`` (0..1), each column summing ``keys_per_column`` keys; token pieces
        of the queries and of the keys (one per key, or none); position of the first key."""
        self.weights, self.queries, self.keys = tuple(weights), tuple(queries), tuple(keys)
        self.key_offset, self.keys_per_column = key_offset, max(1, keys_per_column)
        self.virtual_size = Size(self.scrollable_content_region.width, len(self.weights) + 1)
        self._describe()
        self.refresh()
        self.call_after_refresh(self.scroll_end, animate=False)  # the newest queries in view

    def on_resize(self, event: events.Resize) -> None:
        self.virtual_size = Size(self.scrollable_content_region.width, len(self.weights) + 1)
        self._describe()

    def _describe(self) -> None:
        """The subtitle: which keys are shown, and how many share a cell."""
        if not self.weights:
            self.border_subtitle = ""
            return
        _, per_cell = column_layout(len(self.weights[0]), self.scrollable_content_region.width)
        first = self.key_offset
        last = first + self.num_keys - 1
        per = per_cell * self.keys_per_column
        self.border_subtitle = f"keys {first}-{last}" + (f" · {per} keys per cell (summed)" if per > 1 else "")

    def _cells(self, row: tuple[float, ...], per_cell: int) -> list[float]:
        return [sum(row[i:i + per_cell]) for i in range(0, len(row), per_cell)]

    def _key_name(self, column: int) -> str:
        """The key a column stands for: its piece, or its positions when it sums several."""
        per = self.keys_per_column
        if per == 1 and column < len(self.keys):
            return visible_piece(self.keys[column])
        first = self.key_offset + column * per
        return str(first) if per == 1 else f"{first}-{first + per - 1}"

    def render_line(self, y: int) -> Strip:
        # Line 0 always shows the key positions; the query rows scroll beneath it.
        row = 0 if y == 0 else y + self.scroll_offset.y
        width = self.scrollable_content_region.width
        if not self.weights or row > len(self.weights):
            return Strip.blank(width)
        n = len(self.weights[0])
        cell, per_cell = column_layout(n, width)
        cells = -(-n // per_cell)
        if row == 0:  # key positions: a label every few cells, each one whole or not at all
            every = max(1, -(-6 // cell))
            keys_per_cell = per_cell * self.keys_per_column
            ticks = ""
            for c in range(0, cells, every):
                label = str(self.key_offset + c * keys_per_cell)
                if c * cell + len(label) <= cells * cell:
                    ticks = ticks.ljust(c * cell) + label
            segments = [Segment(" " * LABEL + ticks, self._label)]
        else:
            weights = self.weights[row - 1]
            piece = self.queries[row - 1] if row - 1 < len(self.queries) else ""
            segments = [Segment(f"{visible_piece(piece)[: LABEL - 1]:>{LABEL - 1}} ", self._label)]
            for w in self._cells(weights, per_cell):
                segments.append(Segment(" " * cell, self._shades[min(SHADES - 1, int(w * (SHADES - 1) + 0.5))]))
            if weights:
                best = max(range(len(weights)), key=weights.__getitem__)
                segments.append(Segment(f" →{self._key_name(best)[:8]:<8} {weights[best]:.2f}", self._note))
        return Strip(segments).crop(0, width).extend_cell_length(width)
