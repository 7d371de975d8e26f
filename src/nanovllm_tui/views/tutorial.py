"""Tutorial (placeholder until nanovllm_core.educational.tutorial lands)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Static

from nanovllm_tui.views.base import EngineView


class TutorialView(EngineView):
    def compose(self) -> ComposeResult:
        yield Static("tutorial")

    def update_view(self, state, selected) -> None:
        pass
