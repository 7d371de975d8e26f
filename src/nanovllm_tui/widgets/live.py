"""A Static for content that changes every frame: redraws only when the content changed, and
asks for a new layout only when its size follows its content and its line count changed (a
layout pass costs the whole screen)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class LiveStatic(Static):
    """``show(content)`` instead of ``update``: nothing happens when the content is unchanged.

    A widget sized by its content is laid out again when its wrapped line count may have changed:
    when that count differs from the one shown, when the width changed since (the count shown is
    a count at the old width), and when it had no width to wrap at (a hidden tab: the count then is
    unknown, so the next content laid out at a real width must lay out too; trial 22b: a 3-line
    title counted as 1 line while hidden kept its 3 rows under the 1-line title that followed)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._shown: object = None
        self._lines = -1
        self._width = -1

    def show_content(self, content) -> None:
        if isinstance(content, str):
            content = Text(content)
        if isinstance(content, Text) and isinstance(self._shown, Text) and content == self._shown \
                and content.spans == self._shown.spans:
            return
        height = self.styles.height
        sized_by_content = height is None or height.is_auto
        width = self.content_region.width
        if not isinstance(content, Text):
            lines = -2
        elif sized_by_content and width > 0:  # lines as wrapped: a longer line may need one more
            lines = len(content.wrap(self.app.console, width))
        elif sized_by_content:  # not laid out (a hidden tab): the count is unknown until it is
            lines = -1
        else:
            lines = content.plain.count("\n")
        layout = sized_by_content and (lines != self._lines or lines < 0 or width != self._width)
        self.update(content, layout=layout)
        self._shown, self._lines, self._width = content, lines, width


def tail(text: Text, width: int, height: int, console) -> Text:
    """The last ``height`` lines of ``text`` wrapped at ``width`` cells (a terminal-like view of a stream)."""
    if width <= 0 or height <= 0:
        return text
    lines = text.wrap(console, width)
    if len(lines) <= height:
        return text
    return Text("\n").join(lines[-height:])
