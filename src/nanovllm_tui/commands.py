"""The app's actions in one table: key bindings (shown in the footer) and the command palette (ctrl+p).

Keeping both in one list means the palette always offers exactly what the keys do.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider


@dataclass(frozen=True)
class AppAction:
    """One action: its key, the ``action_*`` it runs, the footer label, the palette title and help."""

    key: str
    action: str
    label: str
    title: str
    help: str
    show: bool = True


TABS = (("dashboard", "Dashboard"), ("xray", "X-Ray"), ("narrator", "Narrator"), ("tutorial", "Tutorial"),
        ("blocks", "Block Map"))

ACTIONS: tuple[AppAction, ...] = (
    AppAction("slash", "focus_prompt", "Prompt", "Type a prompt",
              "Move to the prompt bar (Enter sends, Tab reaches priority, max tokens, temperature, chat)"),
    AppAction("ctrl+t", "toggle_chat", "Chat/raw", "Send prompts as chat or as raw text",
              "Chat: the prompt goes through the model's chat template as a user's message; raw: text to continue"),
    AppAction("space", "toggle_pause", "Pause/Resume", "Pause or resume the engine",
              "Pausing takes effect at the next step boundary"),
    AppAction("n", "step", "Step", "Run one scheduler step", "While paused: exactly one engine step"),
    AppAction("a", "abort", "Abort", "Abort the selected request",
              "It finishes now and its KV blocks are released (a block another request shares stays in use)"),
    AppAction("left_square_bracket", "select(-1)", "Prev req", "Select the previous request", "Also ↑ in the table"),
    AppAction("right_square_bracket", "select(1)", "Next req", "Select the next request", "Also ↓ in the table"),
    *(AppAction(str(i), f"show_tab('{tab}')", title, f"Show the {title} tab", f"Key {i}", show=False)
      for i, (tab, title) in enumerate(TABS, 1)),
    AppAction("q", "quit", "Quit", "Quit", "Stop the engine thread and leave"),
)


def app_bindings() -> list[Binding]:
    return [Binding(a.key, a.action, a.label, show=a.show) for a in ACTIONS]


class EngineCommands(Provider):
    """Command palette entries for every action in :data:`ACTIONS`."""

    def _offered(self) -> list[AppAction]:
        """The actions the app can carry out now (a replay has no prompt, chat toggle or abort)."""
        return [a for a in ACTIONS if self.app.check_action(a.action.partition("(")[0], ()) is not False]

    async def discover(self) -> Hits:
        for a in self._offered():
            yield DiscoveryHit(a.title, partial(self.app.run_action, a.action), help=a.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for a in self._offered():
            score = matcher.match(a.title)
            if score > 0:
                yield Hit(score, matcher.highlight(a.title), partial(self.app.run_action, a.action), help=a.help)
