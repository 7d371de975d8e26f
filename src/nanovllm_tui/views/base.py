"""What every tab shares: it draws itself from the engine state, and only while it is visible."""

from __future__ import annotations

from textual.containers import Container

from nanovllm_tui.state import EngineState


class EngineView(Container):
    """A tab's content. The app calls :meth:`update_view` once a frame for the visible tab only,
    and once more when a tab becomes visible, so hidden tabs cost nothing to keep.
    """

    def update_view(self, state: EngineState, selected: str | None) -> None:
        raise NotImplementedError

    def focus_main(self) -> None:
        """Put the keyboard focus where this tab's keys work."""
        self.focus()
