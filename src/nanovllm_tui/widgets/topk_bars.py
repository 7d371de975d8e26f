"""Top-k bars: the model's most likely next tokens and their probabilities, the sampled one marked."""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text

from nanovllm_core import events as ev
from nanovllm_tui.widgets.format import bar, visible_piece
from nanovllm_tui.widgets.live import LiveStatic

LABEL_CELLS = (12, 18)  # a token's column: at least (aligned bars), at most (three bytes, <0xE3><0x81><0xAE>)


def chosen_piece(top: tuple[ev.TopToken, ...], token_id: int | None, token_text: str) -> str:
    """The sampled token as the heading names it, the way its bar shows it: its row's text when it
    is a row, then `` → `` and what it spelled where that differs (the character its bytes
    completed); else what it spelled, or its id while it holds only part of a character. Trial
    14a: the heading read "∅" (the token spelled nothing yet) above five bars reading "�"."""
    row = next((t for t in top if t.token_id == token_id), None)
    if row is not None:
        shown = visible_piece(row.text)
        return shown if not token_text or token_text == row.text else f"{shown} → {visible_piece(token_text)}"
    if token_text:
        return visible_piece(token_text)
    return f"id {token_id} (part of a character)"


class TopKBars(LiveStatic):
    """``Paris  87.3% ██████████ ◀ sampled`` for each candidate of the newest token."""

    def show(self, top: tuple[ev.TopToken, ...], sampled_id: int | None, label: str = "") -> None:
        if not top:
            self.show_content(Text("Top-k next tokens appear here once the selected request samples a token.", style="dim"))
            return
        labels = [visible_piece(t.text) for t in top]
        cells = max(LABEL_CELLS[0], min(LABEL_CELLS[1], max(cell_len(s) for s in labels)))
        width = max(6, self.size.width - 12 - cells)
        text = Text(label + "\n" if label else "", style="bold")
        for t, piece in zip(top, labels):
            chosen = t.token_id == sampled_id
            cell = Text(piece, style="bold" if chosen else "")
            cell.truncate(cells, overflow="ellipsis", pad=True)  # in cells: a wide character counts two
            text.append_text(cell + " ")
            text.append(f"{t.prob * 100:5.1f}% ")
            text.append_text(bar(t.prob, width, "green" if chosen else "#4ea1ff"))
            if chosen:
                text.append(" ◀", style="bold green")
            text.append("\n")
        text.rstrip()
        self.show_content(text)
