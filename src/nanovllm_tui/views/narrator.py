"""Narrator (placeholder until nanovllm_core.educational.narrator lands)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Static

from nanovllm_tui.views.base import EngineView


class NarratorView(EngineView):
    def compose(self) -> ComposeResult:
        yield Static("narrator")

    def feed(self, events, state) -> None:
        pass

    def update_view(self, state, selected) -> None:
        pass
