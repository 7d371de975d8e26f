"""A narrator entry (:class:`Commentary`) and the small text helpers every entry is written with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Commentary:
    """One narrator entry.

    ``kind``: one of ``narrator.KINDS`` (the subject); ``title``: a short headline; ``text``:
    the explanation with this event's real numbers; ``table``: (label, probability 0..1)
    rows, e.g. a decode step's top-k candidates; ``table_title``: which distribution the
    table shows (e.g. "after repetition penalty 1.3"); ``table_notes``: one note per row
    ("chosen", "accepted", ...; empty strings for none); ``heading``: the words shown for the entry
    where they differ from its kind's (a ``decode`` entry for the token the prefill's last position
    chose is headed "first token": no decode step made it; empty for the kind's own heading).
    """

    kind: str
    title: str
    text: str
    request_id: str | None = None
    step: int | None = None
    table: tuple[tuple[str, float], ...] = ()
    table_title: str = ""
    table_notes: tuple[str, ...] = ()
    heading: str = ""


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def ms(seconds: float | None, digits: int = 1) -> str:
    """A duration for reading: milliseconds below 1 s (``0.0421`` -> ``"42.1 ms"``, ``digits``
    decimals), seconds with one decimal from 1 s up (``178.924`` -> ``"178.9 s"``, ``3725`` ->
    ``"3,725.0 s"``); ``"n/a"`` for None. The one duration format of the teaching text and the CLI
    summary (a raw ``178924.0 ms`` is hard to read)."""
    if seconds is None:
        return "n/a"
    if round(abs(seconds) * 1000, digits) < 1000:
        return f"{seconds * 1000:,.{digits}f} ms"
    return f"{seconds:,.1f} s"


def show_piece(text: str) -> str:
    """A token's text made visible inside brackets: a space as ``␣`` (so a piece never breaks at a line
    wrap and a leading space shows), newlines and tabs escaped."""
    return "[" + text.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t") + "]"


def plural(n: int, word: str) -> str:
    """``plural(1, "token")`` -> ``"1 token"``; ``plural(3, "token")`` -> ``"3 tokens"``."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def agree(n: int, one: str, many: str) -> str:
    """The verb (or pronoun) that agrees with a count: ``agree(1, "remains", "remain")`` -> ``"remains"``,
    ``agree(2, "remains", "remain")`` -> ``"remain"``. Used beside :func:`plural` so "1 token remains" reads right."""
    return one if n == 1 else many


def ordinal(n: int) -> str:
    """``1`` -> ``"1st"``, ``12`` -> ``"12th"``, ``23`` -> ``"23rd"``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def join_words(items: list[str], last: str = "and") -> str:
    """``["a"]`` -> ``"a"``; ``["a", "b", "c"]`` -> ``"a, b and c"``; ``last="or"`` for alternatives: ``"a, b or c"``."""
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + f" {last} " + items[-1]


def who(request_id: str, index: int = 0, n: int = 1) -> str:
    """How an entry names a sequence: ``"request 3"``, or ``"request 3, sample 1"`` when the request has ``n`` > 1 samples."""
    return f"request {request_id}" if n <= 1 and index == 0 else f"request {request_id}, sample {index}"


def weights_label(model_info: dict) -> str:
    """The weight format beside the dtype, or "" for float weights: "q4_1+q8_0 gguf" (the formats of
    a gguf file's blocks), else "q8_0 weights" (``model_info``: ``LLMEngine.model_info()``). Shared by the
    app's header and ready toast and the tensor-parallel chapter's words (trial 12b:
    the toast said "(float32)" alone while GGUF blocks ran). At 120 columns "gguf weights
    (q4_1+q8_0)" was dropped once the step number showed (issue 29, trial 7)."""
    quantization = model_info.get("quantization")
    kinds = model_info.get("weight_kinds")
    if not quantization:
        return ""
    return f"{kinds} {quantization}" if kinds and kinds != quantization else f"{quantization} weights"
