"""What a prompt may be: text, token ids, or a conversation (chat messages the model's template renders).

A value-type module (no torch): the engine, the server and the app's controllers all ask it.
"""

from __future__ import annotations

import json
from typing import Any, Literal, get_args

from nanovllm_core import untrusted
from nanovllm_core.untrusted import shown

Prompt = str | list[int] | list[dict[str, str]]

# The roles a chat message may have: OpenAI's (vLLM's server takes the same). The server's request body
# (``entrypoints.protocol.ChatMessage``) and ``LLM.chat`` both refuse any other, from this one list;
# ``developer`` reaches the chat template as ``system`` (``template_role``).
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)

# The content parts a chat message may carry instead of text: OpenAI's text parts, joined into one
# text (vLLM's behaviour; images and other parts are not supported). The server's request body
# (``entrypoints.protocol.TextPart``) and ``LLM.chat`` both take these, from this one definition, and
# both flatten them with ``content_text``.
# As vLLM's chat_utils reads them: "text" and the Responses API's "input_text" carry "text", an assistant's
# "refusal" part carries "refusal", and a bare string in the list is text (trial 36c: these were refused); an
# assistant's "output_text" part (the Responses API's) carries "text" too (trial 38c).
TextPartType = Literal["text", "input_text", "output_text", "refusal"]
TEXT_PART_TYPES: tuple[str, ...] = get_args(TextPartType)
PART_TEXT_KEY = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}  # its text's key
CONTENT_SHAPE = 'text or a list of text parts ({"type": "text", "text": ...})'


def is_conversation(prompt: Any) -> bool:
    """True for a non-empty list of chat messages: dicts with a text ``role`` and a text ``content``."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
        for m in prompt)


def _type_name(value: Any) -> str:
    """``None``, or ``a str`` / ``an int``: what a value is, for an error message."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def describe(value: Any) -> str:
    """What a wrongly typed prompt or message list is, for a one-line error: ``None``, ``a dict``,
    ``a list of int and str``, ``an empty list`` (the types of a list's items, in first-seen order)."""
    if isinstance(value, (list, tuple)):
        kinds = list(dict.fromkeys("None" if v is None else type(v).__name__ for v in value))
        if not kinds:
            return f"an empty {type(value).__name__}"
        return f"a {type(value).__name__} of {' and '.join(kinds[:3])}{' and more' if len(kinds) > 3 else ''}"
    return _type_name(value)


def content_problem(content: Any) -> str | None:
    """Why ``content`` is not text or a list of text parts (``CONTENT_SHAPE``); None when it is (or is None).

    One line naming the offending part by index and type (``content[1] is an 'image_url' part``).
    """
    if content is None or isinstance(content, str):
        return None
    if not isinstance(content, (list, tuple)):
        return f"content must be {CONTENT_SHAPE}, not {type(content).__name__}"
    for j, part in enumerate(content):
        if isinstance(part, str):  # a bare string in the list is text, as vLLM reads it
            continue
        if not isinstance(part, dict):
            return (f"content[{j}] must be a text part ({{'type': 'text', 'text': ...}}) or a string, "
                    f"not {type(part).__name__}")
        kind = part.get("type")
        if "type" not in part:  # trial 38c: read "is a null part" (vLLM: "Missing 'type' field")
            return (f"content[{j}] has no 'type' field; a text part is {{'type': 'text', 'text': ...}} "
                    "('input_text', 'output_text' and 'refusal' parts too)")
        if kind not in TEXT_PART_TYPES:
            return (f"content[{j}] is {'an' if str(kind)[:1] in 'aeiou' else 'a'} {shown(kind)} part; only text parts "
                    f"({{'type': 'text', 'text': ...}}, 'input_text', 'output_text' and 'refusal' too) are supported")
        key = PART_TEXT_KEY[kind]
        extra = sorted(str(k) for k in set(part) - {"type", key})
        if extra:
            return (f"content[{j}] has unknown field(s) {', '.join(shown(k) for k in extra)}; a {kind!r} part has "
                    f"only type and {key}")
        if key not in part:  # trial 40c: read "text must be text, not NoneType"
            return f"content[{j}] has no {key!r} field; a {kind!r} part is {{'type': {kind!r}, {key!r}: ...}}"
        if not isinstance(part[key], str):
            return f"content[{j}] {key} must be a string, not {describe(part[key])}"
    return None


def content_text(content: Any) -> str:
    """The text a chat template is given for ``content``: the text itself, its text parts joined by
    newlines, or ``""`` for None. vLLM's rule for a template that takes content as one text
    (``vllm/entrypoints/chat_utils.py``, ``"\\n".join(texts)``): two parts "A" and "B" are "A\\nB", and
    the same request gets the same prompt here as there (trial 33b: they were joined with nothing).
    ``content`` must have passed ``content_problem``: parts are strings or dicts (``PART_TEXT_KEY`` names
    the key holding a part's text)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part if isinstance(part, str) else part[PART_TEXT_KEY[part["type"]]] for part in content)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` as a chat template takes it: role through ``template_role``, content as ``content_text``,
    and each tool call's ``function.arguments`` as the object its JSON text holds (:func:`tool_arguments`).

    Raises:
        ValueError: a tool call's arguments are text that is not JSON (:func:`tool_arguments`).
    """
    out = dict(message)
    if "role" in out:
        out["role"] = template_role(out["role"])
    if "content" in out and out["content"] is not None:
        out["content"] = content_text(out["content"])
    if isinstance(out.get("tool_calls"), (list, tuple)):
        out["tool_calls"] = [{**call, "function": {**call["function"],
                                                    "arguments": tool_arguments(call["function"].get("arguments"))}}
                             if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
                             for call in out["tool_calls"]]
    return out


def tool_arguments(arguments: Any) -> Any:
    """A tool call's ``function.arguments`` as a chat template is given them: JSON text (OpenAI's form) parsed to
    its object, ``{}`` for none or ``""``, an object already parsed as it is. vLLM's rule
    (``chat_utils._postprocess_messages``, after transformers' documentation: templates take the arguments as
    a mapping; the LLaMA 3.1 template writes ``arguments | tojson``, which on the text would encode it twice).

    Raises:
        ValueError: text that is not JSON (vLLM answers it with a 400 too), saying where it failed, also JSON
            nested too deeply or a number too long to read (``untrusted.loads``; trial 47b's kind: Python's
            RecursionError was a 500); JSON whose text holds a lone surrogate (a ``\udc00`` escape), refused
            as any text with no UTF-8 form is.
    """
    if not arguments:
        return {}
    if not isinstance(arguments, str):
        return arguments
    try:
        value = untrusted.loads(arguments)
    except ValueError as e:
        raise ValueError(f"is not valid JSON ({e}); send the arguments as a JSON object written as text, such as "
                         '"{\"city\": \"Paris\"}"') from None
    bad = surrogate_text(value)
    if bad is not None:
        raise ValueError(f"holds a text that is not valid Unicode once read as JSON: {bad[2]}")
    return value


def surrogate_text(value: Any, path: tuple = (), keys_only: bool = False) -> tuple[list, str, str] | None:
    """The first key or text in ``value`` (JSON: dicts, lists, texts), in document order, that holds a lone
    surrogate: ``(path to it, "key" or "value", unicode_problem's line)``; None when there is none.
    ``keys_only``: object keys only (pydantic names a bad text itself, never a bad key). Walked with a stack,
    not recursion: JSON as deep as ``untrusted.loads`` reads is walked whole."""
    stack: list[tuple[bool, Any, tuple]] = [(False, value, tuple(path))]  # (is a key, item, its path)
    while stack:
        is_key, item, at = stack.pop()
        if isinstance(item, str) and (is_key or not keys_only):
            problem = unicode_problem(item)
            if problem is not None:
                return [*at], "key" if is_key else "value", problem
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):  # popped in order: each key, then what it holds
                stack.append((False, child, (*at, key)))
                stack.append((True, key, (*at, key)))
        elif isinstance(item, list):
            stack.extend((False, child, (*at, i)) for i, child in reversed(list(enumerate(item))))
    return None


def template_role(role: str) -> str:
    """The role a chat template is given for ``role``: ``developer`` (OpenAI's newer name) becomes ``system``."""
    return "system" if role == "developer" else role


def conversation_problem(conversation: Any) -> str | None:
    """Why ``conversation`` is not a list of chat messages the server would take; None when it is.

    Each message is a dict with a ``role`` from ``CHAT_ROLES`` and a ``content`` that is text or a list
    of text parts (``content_problem``; an
    ``assistant`` message that carries ``tool_calls`` may leave content out, as OpenAI allows).
    One line, naming the message by its index (``messages[1]``).
    """
    if not isinstance(conversation, (list, tuple)):
        return ("a conversation must be a non-empty list of chat messages ({'role': ..., 'content': text}), "
                f"got {describe(conversation)}")
    if not conversation:
        return "a conversation must be a non-empty list of chat messages ({'role': ..., 'content': text}), got []"
    for i, m in enumerate(conversation):
        if not isinstance(m, dict):
            return f"messages[{i}] must be a dict {{'role': ..., 'content': text}}, not {type(m).__name__}"
        role = m.get("role")
        if role not in CHAT_ROLES:
            return f"messages[{i}] has role {shown(role)}; a role is one of {', '.join(CHAT_ROLES)}"
        content = m.get("content")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            return (f"messages[{i}] ({role}) has no content; every message needs content, except an "
                    "assistant message that carries tool_calls")
        problem = content_problem(content)
        if problem is not None:
            return f"messages[{i}] ({role}) {problem}"
        for j, call in enumerate(m.get("tool_calls") or ()):
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                try:
                    tool_arguments(call["function"].get("arguments"))
                except ValueError as e:
                    return f"messages[{i}] ({role}) tool_calls[{j}].function.arguments {e}"
    return None


def user_message(text: str) -> list[dict[str, str]]:
    """``text`` as a one-message conversation from the user (what ``--chat`` and the app's chat toggle send)."""
    return [{"role": "user", "content": text}]


def unicode_problem(text: str) -> str | None:
    """Why ``text`` has no UTF-8 form (a lone surrogate such as ``"\\ud800"``, which JSON's
    ``\\ud800`` escape can carry), or None when it is valid Unicode."""
    bad = next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)
    if bad is None:
        return None
    return f"character {bad} is a lone surrogate {json.dumps(text[bad])}, which has no UTF-8 form; send UTF-8 text"


# What a chat template's renderer (transformers' ``apply_chat_template``) takes as its own settings or
# fills itself: ``chat_template_kwargs`` may not set them (they would change what the call returns,
# not what the template sees); add_generation_prompt and continue_final_message are fields of their own.
CHAT_TEMPLATE_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})
# Why each reserved key may not be set, and what to do instead (trial 21b: every key was pointed to
# add_generation_prompt, the wrong way for tools and documents); a key not named here is one of the
# renderer's own tokenizing settings (RENDERER_SETTING).
CHAT_TEMPLATE_RESERVED_WHY = {
    "conversation": "the template gets the messages sent; send them as messages",
    "messages": "the template gets the messages sent; send them as messages",
    "tools": "tool calling is not supported here, so no tools reach the template; leave it out (a system "
             "message can describe tools in words)",
    "documents": "the template is given no documents; leave it out and put the documents' text in a message",
    "chat_template": "only the model's own chat template is used; leave it out",
    "add_generation_prompt": "it is an option of its own; send add_generation_prompt beside chat_template_kwargs",
    "continue_final_message": "it is an option of its own; send continue_final_message beside chat_template_kwargs",
}
RENDERER_SETTING = ("it is a setting of the template renderer, not a template variable (the engine renders and "
                    "tokenizes the prompt itself); leave it out")


def chat_template_problem(add_generation_prompt: Any, continue_final_message: Any,
                          chat_template_kwargs: Any) -> tuple[str, str] | None:
    """(field, one-line reason) when these chat template options cannot go together, else None.

    vLLM's rules: ``continue_final_message`` (leave the last message open for the model to go
    on with, as transformers renders it) and ``add_generation_prompt`` (open a new assistant
    turn) may not both be true; ``chat_template_kwargs`` is an object of extra template
    variables (``{"enable_thinking": false}``), none of them a renderer setting
    (:data:`CHAT_TEMPLATE_RESERVED`). The two options are True or False only: ``'no'`` would be
    read as true (the server's fields are strict booleans already; this is the Python API's check).
    """
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            return (name, f"{name}={shown(value, as_json=False)} is invalid: it must be True or False")
    if continue_final_message and add_generation_prompt:
        return ("continue_final_message", "continue_final_message and add_generation_prompt cannot both be true "
                "(add_generation_prompt is true unless sent false): send add_generation_prompt: false to continue "
                "the last message")
    if chat_template_kwargs is None:
        return None
    if not isinstance(chat_template_kwargs, dict):
        return ("chat_template_kwargs", f"chat_template_kwargs must be an object of template variables "
                f'(e.g. {{"enable_thinking": false}}) or null, got {shown(chat_template_kwargs)}')
    reserved = sorted(k for k in chat_template_kwargs if k in CHAT_TEMPLATE_RESERVED)
    if reserved:
        why = CHAT_TEMPLATE_RESERVED_WHY.get(reserved[0], RENDERER_SETTING)
        return ("chat_template_kwargs", f"chat_template_kwargs may not set {reserved[0]!r}: {why}")
    return None

