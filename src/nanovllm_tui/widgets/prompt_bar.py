"""The prompt bar: a prompt, and its priority, max tokens and temperature, all from the keyboard."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Input, Label


@dataclass
class PromptSettings:
    """What the prompt bar sends with a prompt: priority (higher runs first), max tokens, temperature (0 = greedy)."""

    priority: int = 0
    max_tokens: int = 50
    temperature: float = 0.0


class PromptBar(Horizontal):
    """``prompt ▏ prio ▏ max ▏ temp``: Enter in any field sends, Tab moves between fields, Esc leaves.

    Posts :class:`PromptBar.Submitted`; bad input (an empty prompt, a setting that is not a
    number) is answered with a notification and nothing is sent.
    """

    BINDINGS = [Binding("escape", "app.focus_view", "Leave prompt")]

    @dataclass
    class Submitted(Message):
        prompt: str
        settings: PromptSettings

    def __init__(self, settings: PromptSettings | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.defaults = settings or PromptSettings()

    def compose(self) -> ComposeResult:
        d = self.defaults
        yield Input(placeholder="Type a prompt, Enter sends it  (Esc: engine keys · / comes back)", id="prompt")
        yield Label("prio", classes="setting-label")
        yield Input(str(d.priority), id="priority", type="integer", classes="setting")
        yield Label("max", classes="setting-label")
        yield Input(str(d.max_tokens), id="max-tokens", type="integer", classes="setting")
        yield Label("temp", classes="setting-label")
        yield Input(str(d.temperature), id="temperature", type="number", classes="setting")

    def focus_prompt(self) -> None:
        self.query_one("#prompt", Input).focus()

    def read_settings(self) -> PromptSettings | None:
        """The settings as typed, or None after notifying what is wrong."""
        raw = {name: self.query_one(f"#{name}", Input).value.strip() for name in ("priority", "max-tokens", "temperature")}
        try:
            priority = int(raw["priority"] or 0)
        except ValueError:
            self.notify(f"priority must be a whole number, not {raw['priority']!r}", severity="error")
            return None
        try:
            max_tokens = int(raw["max-tokens"])
            if max_tokens < 1:
                raise ValueError
        except ValueError:
            self.notify(f"max tokens must be a whole number >= 1, not {raw['max-tokens']!r}", severity="error")
            return None
        try:
            temperature = float(raw["temperature"] or 0)
            if temperature < 0:
                raise ValueError
        except ValueError:
            self.notify(f"temperature must be a number >= 0 (0 = greedy), not {raw['temperature']!r}", severity="error")
            return None
        return PromptSettings(priority, max_tokens, temperature)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        prompt_input = self.query_one("#prompt", Input)
        prompt = prompt_input.value
        if not prompt.strip():
            self.notify("The prompt is empty: type some text, then press Enter.", severity="warning")
            prompt_input.focus()
            return
        settings = self.read_settings()
        if settings is None:
            return
        prompt_input.value = ""
        prompt_input.focus()
        self.post_message(self.Submitted(prompt, settings))
