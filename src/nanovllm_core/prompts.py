"""What a prompt may be: text, token ids, or a conversation (chat messages the model's template renders).

A value-type module (no torch): the engine, the server and the app's controllers all ask it.
"""

from __future__ import annotations

from typing import Any

Prompt = str | list[int] | list[dict[str, str]]


def is_conversation(prompt: Any) -> bool:
    """True for a non-empty list of chat messages: dicts with a text ``role`` and a text ``content``."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def user_message(text: str) -> list[dict[str, str]]:
    """``text`` as a one-message conversation from the user (what ``--chat`` and the app's chat toggle send)."""
    return [{"role": "user", "content": text}]
