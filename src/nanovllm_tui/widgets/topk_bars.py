"""Top-k bars: the model's most likely next tokens and their probabilities, the sampled one marked."""

from __future__ import annotations

from rich.text import Text

from nanovllm_core import events as ev
from nanovllm_tui.widgets.format import bar, visible_piece
from nanovllm_tui.widgets.live import LiveStatic


class TopKBars(LiveStatic):
    """``Paris  87.3% ██████████ ◀ sampled`` for each candidate of the newest token."""

    def show(self, top: tuple[ev.TopToken, ...], sampled_id: int | None, label: str = "") -> None:
        if not top:
            self.show_content(Text("Top-k next tokens appear here once the selected request samples a token.", style="dim"))
            return
        width = max(6, self.size.width - 24)
        text = Text(label + "\n" if label else "", style="bold")
        for t in top:
            chosen = t.token_id == sampled_id
            text.append(f"{visible_piece(t.text)[:12]:<12} ", style="bold" if chosen else "")
            text.append(f"{t.prob * 100:5.1f}% ")
            text.append_text(bar(t.prob, width, "green" if chosen else "#4ea1ff"))
            if chosen:
                text.append(" ◀", style="bold green")
            text.append("\n")
        text.rstrip()
        self.show_content(text)
