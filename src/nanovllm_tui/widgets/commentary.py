"""How one narrator entry (``Commentary``) looks on screen; shared by the Narrator and Tutorial tabs."""

from __future__ import annotations

from rich.text import Text

from nanovllm_core.educational.narrator import Commentary
from nanovllm_tui.widgets.format import bar, visible_piece

KIND_STYLES = {
    "model": "bold magenta", "tokenization": "bold #f5a524", "embedding": "bold #c2d94c",
    "attention": "bold #b06cf2", "prefill": "bold #4ea1ff", "decode": "bold #3ecf8e", "sampling": "bold #2ec4d6",
    "kv_cache": "bold #8fa8ff", "scheduler": "bold yellow", "chunked_prefill": "bold #ff8a5b",
    "preemption": "bold red", "prefix_cache": "bold #f37de0", "finished": "bold green", "rejected": "bold red",
    "speculative": "bold #c2d94c", "error": "bold red", "roofline": "bold #8fa8ff",
    "communication": "bold #ffd166",
}


def commentary_text(note: Commentary, bar_width: int = 20) -> Text:
    """``▍ decode · step 4 · request 0 — title``, the explanation, then its table as bars."""
    style = KIND_STYLES.get(note.kind, "bold")
    text = Text("▍ ", style=style)
    text.append(note.heading or note.kind.replace("_", " "), style=style)
    where = []
    if note.step is not None:
        where.append(f"step {note.step}")
    if note.request_id is not None:
        where.append(f"request {note.request_id}")
    if where:
        text.append(" · " + " · ".join(where), style="dim")
    text.append(f" — {note.title}\n", style="bold")
    text.append(note.text)
    if note.table and note.table_title:
        text.append(f"\n   {note.table_title}", style="italic dim")
    width = min(24, max((len(visible_piece(label)) for label, _ in note.table), default=14))
    for i, (label, prob) in enumerate(note.table):  # labels as wide as the widest (up to 24)
        text.append(f"\n   {visible_piece(label)[:width]:<{width}} {prob * 100:5.1f}% ")
        text.append_text(bar(prob, bar_width, style.replace("bold ", "")))
        row_note = note.table_notes[i] if i < len(note.table_notes) else ""
        if row_note:
            text.append(" ← chosen" if row_note == "chosen" else f" {row_note}", style="bold")
    return text
