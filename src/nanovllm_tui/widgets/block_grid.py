"""The block grid: every physical KV block as one cell, drawn with the Line API.

A pool can hold thousands of blocks, so the grid is a ``ScrollView`` that renders only the
rows on screen (``render_line`` returning a ``Strip``), as in Textual's checkerboard example.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from nanovllm_core import events as ev

CELL = 3  # two glyphs and a gap
LABEL = 6  # "  128 " before each row
LEVELS = "▁▂▃▄▅▆▇█"
FREE_COLOR, CACHED_COLOR = "grey35", "#2ec4d6"


def fill_glyph(filled: int, block_size: int) -> str:
    """The glyph of a used block with ``filled`` of ``block_size`` slots written (``filled`` > 0):
    eighths rounded up, so any KV shows at least ``▁``, but ``█`` (the legend's "full") only when
    every slot is: 15/16 rounded up to ``█`` too and looked full (newcomer trial 18a)."""
    if filled >= block_size:
        return LEVELS[-1]
    return LEVELS[max(0, min(len(LEVELS) - 2, -(-filled * 8 // max(block_size, 1)) - 1))]


@dataclass(frozen=True)
class BlockCell:
    """How one physical block looks: its state (``u``/``c``/``f``), owner, ref count and tokens filled."""

    state: str
    owner: str | None
    ref_count: int
    filled: int
    selected: bool


def block_cells(blocks: ev.BlocksChanged, selected: str | None) -> list[BlockCell]:
    """One :class:`BlockCell` per physical block, from a ``BlocksChanged`` snapshot.

    ``filled``: KV slots written (``num_computed_tokens`` spread over the block table), so a
    sequence's last block shows its unfilled slots.
    """
    bs = blocks.block_size
    owner: dict[int, str] = {}
    filled: dict[int, int] = {}
    chosen: set[int] = set()
    for table in blocks.tables:
        for i, b in enumerate(table.block_table):
            owner.setdefault(b, table.request_id)
            filled[b] = max(filled.get(b, 0), min(bs, max(0, table.num_computed_tokens - i * bs)))
            if table.request_id == selected:
                chosen.add(b)
    return [BlockCell(state, owner.get(b), blocks.ref_counts[b], filled.get(b, 0), b in chosen)
            for b, state in enumerate(blocks.states)]


class BlockGrid(ScrollView, can_focus=True):
    """Cells coloured by owning request; ◆ shared (ref count > 1); ░ cached-free; · free.

    A used block's glyph height shows how full it is (``▂▂`` = a quarter of its slots hold
    KV, ``╌╌`` = allocated, nothing written yet); the selected request's blocks are underlined.
    """

    DEFAULT_CSS = "BlockGrid { height: 1fr; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cells: list[BlockCell] = []
        self.block_size = 16
        self.owner_colors: dict[str, str] = {}
        self._styles: dict[tuple, Style] = {}
        self._rows: dict[tuple, Strip] = {}  # rendered rows by content: most rows do not change between steps

    def set_data(self, blocks: ev.BlocksChanged | None, colors: dict[str, str], selected: str | None) -> None:
        self.cells = block_cells(blocks, selected) if blocks is not None else []
        self.block_size = blocks.block_size if blocks is not None else self.block_size
        self.owner_colors = colors
        if len(self._rows) > 1024:
            self._rows.clear()
        self._resize()
        self.refresh()

    @property
    def per_row(self) -> int:
        return max(1, (self.scrollable_content_region.width - LABEL) // CELL)

    def _resize(self) -> None:
        rows = -(-len(self.cells) // self.per_row) if self.cells else 0
        self.virtual_size = Size(LABEL + self.per_row * CELL, rows)

    def on_resize(self) -> None:
        self._resize()

    def _style(self, color: str, underline: bool = False, bold: bool = False) -> Style:
        key = (color, underline, bold)
        if key not in self._styles:
            self._styles[key] = Style(color=color, underline=underline, bold=bold)
        return self._styles[key]

    def glyphs(self, cell: BlockCell) -> tuple[str, Style]:
        if cell.state == "f":
            return "··", self._style(FREE_COLOR)
        if cell.state == "c":
            return "░░", self._style(CACHED_COLOR)
        color = self.owner_colors.get(cell.owner or "", "white")
        if cell.ref_count > 1:
            return "◆◆", self._style(color, cell.selected, bold=True)
        if not cell.filled:  # allocated for this step's tokens, nothing written yet
            return "╌╌", self._style(color, cell.selected)
        return fill_glyph(cell.filled, self.block_size) * 2, self._style(color, cell.selected)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        row = y + scroll_y
        per_row = self.per_row
        start = row * per_row
        if start >= len(self.cells):
            return Strip.blank(self.size.width)
        cells = tuple(self.cells[start:start + per_row])
        key = (start, cells, scroll_x, self.size.width)
        strip = self._rows.get(key)
        if strip is None:
            segments = [Segment(f"{start:>{LABEL - 1}} ", self._style("grey50"))]
            for cell in cells:
                text, style = self.glyphs(cell)
                segments.append(Segment(text, style))
                segments.append(Segment(" "))
            strip = Strip(segments).crop(scroll_x, scroll_x + self.size.width).extend_cell_length(self.size.width)
            self._rows[key] = strip
        return strip
