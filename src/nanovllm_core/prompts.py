"""What a prompt may be: text, token ids, or a conversation (chat messages the model's template renders).

A value-type module (no torch): the engine, the server and the app's controllers all ask it.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

Prompt = str | list[int] | list[dict[str, str]]

# The roles a chat message may have: OpenAI's (vLLM's server takes the same). The server's request body
# (``entrypoints.protocol.ChatMessage``) and ``LLM.chat`` both refuse any other, from this one list;
# ``developer`` reaches the chat template as ``system`` (``template_role``).
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)


def is_conversation(prompt: Any) -> bool:
    """True for a non-empty list of chat messages: dicts with a text ``role`` and a text ``content``."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def template_role(role: str) -> str:
    """The role a chat template is given for ``role``: ``developer`` (OpenAI's newer name) becomes ``system``."""
    return "system" if role == "developer" else role


def conversation_problem(conversation: Any) -> str | None:
    """Why ``conversation`` is not a list of chat messages the server would take; None when it is.

    Each message is a dict with a ``role`` from ``CHAT_ROLES`` and a text ``content`` (an
    ``assistant`` message that carries ``tool_calls`` may leave content out, as OpenAI allows).
    One line, naming the message by its index (``messages[1]``).
    """
    if not isinstance(conversation, (list, tuple)) or not conversation:
        return "a conversation must be a non-empty list of chat messages ({'role': ..., 'content': text})"
    for i, m in enumerate(conversation):
        if not isinstance(m, dict):
            return f"messages[{i}] must be a dict {{'role': ..., 'content': text}}, not {type(m).__name__}"
        role = m.get("role")
        if role not in CHAT_ROLES:
            return f"messages[{i}] has role {role!r}; a role is one of {', '.join(CHAT_ROLES)}"
        content = m.get("content")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            return (f"messages[{i}] ({role}) has no content; every message needs content, except an "
                    "assistant message that carries tool_calls")
        if content is not None and not isinstance(content, str):
            return f"messages[{i}] ({role}) content must be text, not {type(content).__name__}"
    return None


def user_message(text: str) -> list[dict[str, str]]:
    """``text`` as a one-message conversation from the user (what ``--chat`` and the app's chat toggle send)."""
    return [{"role": "user", "content": text}]
