"""Small Rich building blocks shared by the CLI's teaching views: indentation, probability bars, top-k tables."""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from nanovllm_core.educational.narrator import show_piece

BAR_WIDTH = 24


class Indent:
    """``renderable`` shifted right by ``width`` spaces, without padding lines with trailing spaces
    (``rich.padding.Padding`` fills every line to the full width, which litters logs and pasted notes)."""

    def __init__(self, renderable: RenderableType, width: int = 2) -> None:
        self.renderable = renderable
        self.width = width

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        inner = options.update_width(max(1, options.max_width - self.width))
        for line in console.render_lines(self.renderable, inner, pad=False):
            while line and not line[-1].control and not line[-1].text.strip():
                line = line[:-1]  # drop trailing blank segments
            if line and not line[-1].control:
                last = line[-1]  # and the space a word wrap leaves at the end
                line = [*line[:-1], Segment(last.text.rstrip(), last.style)]
            if line:
                yield Segment(" " * self.width)
                yield from line
            yield Segment.line()


def prob_bar(p: float, width: int = BAR_WIDTH) -> Text:
    """A horizontal bar for a probability 0..1: full blocks plus one partial eighth."""
    eighths = max(0, min(width * 8, round(p * width * 8)))
    full, part = divmod(eighths, 8)
    return Text("█" * full + (" ▏▎▍▌▋▊▉"[part] if part else ""), style="green")


def topk_table(rows, chosen: str | None = None, title: str | None = None, notes: tuple[str, ...] = ()) -> Table:
    """Top-k candidates ``[(token text, probability 0..1), ...]``: rank, token (made visible),
    probability in percent with 2 decimals, bar. ``chosen``: the text of the token taken (marked);
    ``notes``: one note per row instead ("chosen" shows as ``← chosen``); ``title``: the caption
    saying which distribution the probabilities are, printed above the rows."""
    table = Table(title=title or None, title_justify="left", title_style="italic", show_header=True,
                  header_style="bold", box=None, padding=(0, 1))
    table.add_column("#", justify="right")
    table.add_column("token")
    table.add_column("prob", justify="right")
    table.add_column("", no_wrap=True)
    marked = False
    for rank, (label, p) in enumerate(rows, 1):
        mark = ""
        if notes:
            note = notes[rank - 1] if rank <= len(notes) else ""
            mark = " ← chosen" if note == "chosen" else f" {note}" if note else ""
        elif chosen is not None and label == chosen and not marked:
            mark, marked = " ← chosen", True
        table.add_row(str(rank), Text(show_piece(label)), f"{p * 100:.2f}%", Text.assemble(prob_bar(p), (mark, "bold")))
    return table
