"""Small text helpers shared by the widgets: units, bars, request colours."""

from __future__ import annotations

import math
import re

from rich.text import Text

# One colour per request, in arrival order (cycled). Shared by the request table and the block map.
REQUEST_COLORS = ("#4ea1ff", "#f5a524", "#3ecf8e", "#e5484d", "#b06cf2", "#2ec4d6", "#f37de0", "#c2d94c",
                  "#ff8a5b", "#8fa8ff")
BAR_FULL, BAR_EMPTY = "█", "░"
EIGHTHS = " ▏▎▍▌▋▊▉█"
COLUMN_EIGHTHS = " ▁▂▃▄▅▆▇█"


def request_color(index: int) -> str:
    """The colour of the ``index``-th request of the session."""
    return REQUEST_COLORS[index % len(REQUEST_COLORS)]


def request_colors(requests: dict) -> dict[str, str]:
    """request id -> colour, for ``EngineState.requests``."""
    return {rid: request_color(r.order) for rid, r in requests.items()}


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_count(n: float) -> str:
    """12345 -> '12.3k', 2.5e9 -> '2.5G' (for FLOPs and token rates)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def fmt_rate(per_s: float) -> str:
    """Tokens a second: '0', '0.3' (a busy CPU can decode below 1 tok/s: not shown as 0), '42', '1.2k'."""
    if per_s == 0 or per_s >= 10:
        return fmt_count(per_s)
    return f"{per_s:.1f}"


def fmt_ms(seconds: float | None) -> str:
    """0.0421 -> '42 ms'; from 1 s on in seconds ('1.2 s', '12.3 s', '1234 s'), as the teaching text
    (``commentary.ms``) switches, so one figure never reads '1242 ms' in a table and '1.2 s' beside it."""
    if seconds is None:
        return "-"
    if round(seconds * 1000) < 1000:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.1f} s" if seconds < 1000 else f"{seconds:.0f} s"


def first_fitting(width: int, *variants: Text) -> Text:
    """The first of ``variants`` (longest first) that fits ``width`` cells, else the last; width 0
    (not laid out yet): the first. A panel of fixed height then never wraps a line out of sight."""
    for text in variants:
        if not width or text.cell_len <= width:
            return text
    return variants[-1]


def bar(fraction: float, width: int, style: str = "", empty_style: str = "dim") -> Text:
    """A horizontal bar ``width`` cells wide, filled to ``fraction`` (0..1) with eighth-cell precision;
    filled to its end only at 1 (a rounded 0.999 read as done, as a 15/16 KV block read as full)."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    if fraction < 1:
        eighths = max(0, min(eighths, width * 8 - 1))
    full, part = divmod(eighths, 8)
    text = Text(BAR_FULL * full, style=style)
    if part and full < width:
        text.append(EIGHTHS[part], style=style)
        full += 1
    text.append(BAR_EMPTY * (width - full), style=empty_style)
    return text


def sparkline(values: list[float], width: int, style: str = "") -> Text:
    """The newest ``width`` of ``values`` as columns one cell a value, the newest at the right.

    The scale starts at 0 and the largest value is full height (Textual's ``Sparkline`` scales
    from the smallest value, so a lone 0 tok/s step drew a full-height bar): a 0 is a blank
    cell, anything above it at least ``▁``.
    """
    values = values[-width:] if width > 0 else []
    top = max(values, default=0)
    cells = "".join(COLUMN_EIGHTHS[math.ceil(v / top * 8)] if top > 0 and v > 0 else " " for v in values)
    return Text(cells.rjust(max(width, 0)), style=style)


def progress(done: int, total: int | None, width: int = 10, style: str = "") -> Text:
    """``████░░ 12/20`` (``total`` None: just the count)."""
    if not total:
        return Text(f"{done}", style=style)
    text = bar(done / total, width, style)
    text.append(f" {done}/{total}")
    return text


def visible_piece(piece: str) -> str:
    """A token piece made printable: spaces as '␣', newlines as '↵'."""
    return piece.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥") or "∅"


def quoted(text: str, limit: int = 40) -> str:
    """``text`` as an error message quotes what a person typed: ``repr`` of at most ``limit``
    characters, with "…" after a cut (a 54 KB paste quoted whole covered the screen, issue 29)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}…"


# What a terminal would act on rather than show: C0 controls but tab and newline (which the panels
# lay out themselves), DEL, and C1 controls (U+0080-U+009F: U+009B is a one-character CSI).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _control_picture(match: re.Match) -> str:
    code = ord(match.group())
    if code < 0x20:
        return chr(0x2400 + code)  # Unicode's control pictures: ESC -> '␛', BEL -> '␇', CR -> '␍'
    return "␡" if code == 0x7F else f"\\x{code:02x}"  # C1 has no pictures: '\x9b'


def visible_text(text: str) -> str:
    """``text`` with every control character a terminal would act on made visible (issue 29: an ESC
    in a prompt turned the panel red and drew its border 7 columns early). Tab and newline are kept
    (the panels lay them out); returns ``text`` itself when there is nothing to replace."""
    return _CONTROL.sub(_control_picture, text) if _CONTROL.search(text) else text
