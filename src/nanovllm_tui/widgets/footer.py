"""The bottom line of keys: Textual's ``Footer``, rebuilt only when the keys it shows change.

Textual's ``Footer`` throws away and mounts again every one of its key widgets whenever the
screen's bindings are "updated", and they are updated on every change of focus. A tab key
moves the focus into the tab it shows, so each tab switch rebuilt the footer: about a dozen
widgets mounted, styled and laid out again for the same keys. Profiled on a 2-core AMD EPYC
while the engine generated, that rebuild (CSS matching, layout) was most of the UI thread's
work for a key press (issue 29, item 10: key-to-screen p95 of seconds on a busy host).
"""

from __future__ import annotations

from typing import Any

from textual.screen import Screen
from textual.widgets import Footer
from textual.widgets._footer import FooterKey


def shown_keys(screen: Screen) -> tuple[tuple[Any, ...], ...]:
    """What a footer on ``screen`` draws: (key, label, enabled, tooltip, action) of every shown binding, in order."""
    return tuple((binding.key, binding.description, enabled, tooltip, binding.action)
                 for _node, binding, enabled, tooltip in screen.active_bindings.values() if binding.show)


class SteadyFooter(Footer):
    """A ``Footer`` that recomposes only when :func:`shown_keys` differs from what it last drew,
    with ``q Quit`` as its first key.

    The footer cuts off the keys that do not fit, and a tab's own keys come before the app's: on a
    60-column terminal `q Quit` was the key cut (trial 12), and a newcomer saw no way out.
    """

    drawn: tuple[tuple[Any, ...], ...] | None = None  # shown_keys at the last compose (None: not yet)
    rebuilds = 0  # composes with bindings shown (a test counts them)

    def bindings_changed(self, screen: Screen) -> None:
        if self.drawn is not None and screen is self.screen and shown_keys(screen) == self.drawn:
            return  # the same keys: nothing to redraw
        super().bindings_changed(screen)

    async def recompose(self) -> None:
        # Two binding changes in a row each schedule a recompose before either runs; the second
        # finds the keys already drawn by the first and is skipped.
        if self.drawn is not None and self.is_attached and shown_keys(self.screen) == self.drawn:
            return
        await super().recompose()

    def compose(self):
        if self._bindings_ready:
            self.drawn = shown_keys(self.screen)
            self.rebuilds += 1
        keys = list(super().compose())
        first = [w for w in keys if isinstance(w, FooterKey) and w.action == "quit"]
        if not first and keys:
            first = self._ctrl_q()
        yield from first + [w for w in keys if not any(w is f for f in first)]

    def _ctrl_q(self) -> list[FooterKey]:
        """``^q Quit`` where ``q`` is not offered: in a field, where q types itself. The app opens in
        the prompt, whose footer offered no way out although ctrl+q (Textual's own, hidden) quits
        from there (trial 12e)."""
        found = self.screen.active_bindings.get("ctrl+q")
        if found is None or not found[2]:
            return []
        binding = found[1]
        return [FooterKey(binding.key, self.app.get_key_display(binding), "Quit", binding.action,
                          tooltip="Quit from anywhere").data_bind(compact=Footer.compact)]
