"""What every tab shares: it draws itself from the engine state, and only while it is visible."""

from __future__ import annotations

from textual.containers import Container
from textual.widget import Widget

from nanovllm_tui.state import EngineState


class EngineView(Container):
    """A tab's content. The app calls :meth:`update_view` once a frame for the visible tab only,
    and once more when a tab becomes visible, so hidden tabs cost nothing to keep.

    A view draws nothing of its own under its widgets (``BLANK``, see ``nanovllm_tui.app.Pane``):
    give it no border or padding.
    """

    BLANK = True

    def update_view(self, state: EngineState, selected: str | None) -> None:
        raise NotImplementedError

    def main_widget(self) -> Widget:
        """Where this tab's keys work: the widget that takes the focus when the tab is shown."""
        return self

    def focus_main(self) -> None:
        """Put the keyboard focus on :meth:`main_widget` at once (not deferred as ``Widget.focus`` is,
        so keys pressed right after a tab key already reach this tab)."""
        self.screen.set_focus(self.main_widget())
