"""The attention heatmap: softmax weights of one layer and head, queries down, keys across."""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.color import Color
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from nanovllm_tui.widgets.format import visible_piece

LABEL = 11
CELL = 2
SHADES = 16
LOW, HIGH = Color.parse("#0d1b2a"), Color.parse("#ffd166")


class AttentionHeatmap(ScrollView):
    """Rows: the query tokens of this step; columns: the keys they attend to (causal: later keys are masked).

    A cell's brightness is the attention weight (each row sums to 1); after each row, the key
    it attends to most and that weight. Line API: only visible rows are rendered.
    """

    DEFAULT_CSS = "AttentionHeatmap { height: 1fr; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.weights: tuple[tuple[float, ...], ...] = ()
        self.queries: tuple[str, ...] = ()
        self.keys: tuple[str, ...] = ()
        self.key_offset = 0
        self._shades = [Style(bgcolor=LOW.blend(HIGH, (i / (SHADES - 1)) ** 0.5).rich_color) for i in range(SHADES)]
        self._label = Style(color="grey70")
        self._note = Style(color="grey58")

    def set_data(self, weights, queries, keys, key_offset: int = 0) -> None:
        """``weights [queries][keys]`` (0..1); token pieces of both; position of the first key shown."""
        self.weights, self.queries, self.keys = tuple(weights), tuple(queries), tuple(keys)
        self.key_offset = key_offset
        width = LABEL + CELL * max((len(r) for r in self.weights), default=0) + 16
        self.virtual_size = Size(width, len(self.weights) + 1)
        self.refresh()

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        row = y + scroll_y
        if not self.weights or row > len(self.weights):
            return Strip.blank(self.size.width)
        if row == 0:  # key positions, every 4th
            n = len(self.weights[0])
            ticks = "".join(f"{self.key_offset + k:<{CELL * 4}}" for k in range(0, n, 4))
            segments = [Segment(" " * LABEL + ticks[: n * CELL], self._label)]
        else:
            weights = self.weights[row - 1]
            piece = self.queries[row - 1] if row - 1 < len(self.queries) else ""
            segments = [Segment(f"{visible_piece(piece)[: LABEL - 1]:>{LABEL - 1}} ", self._label)]
            for w in weights:
                segments.append(Segment(" " * CELL, self._shades[min(SHADES - 1, int(w * (SHADES - 1) + 0.5))]))
            if weights:
                best = max(range(len(weights)), key=weights.__getitem__)
                key = self.keys[best] if best < len(self.keys) else str(best)
                segments.append(Segment(f" →{visible_piece(key)[:8]} {weights[best]:.2f}", self._note))
        strip = Strip(segments)
        return strip.crop(scroll_x, scroll_x + self.size.width).extend_cell_length(self.size.width)
