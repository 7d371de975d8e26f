"""What comes from outside the process: JSON parsed without a crash, and values quoted short in errors.

A request body, a server's answer, a file on disk may be anything. :func:`loads` is
``json.loads`` whose every failure is a ``ValueError``: a text nested past the interpreter's
recursion limit (``[[[[...]]]]`` 2000 deep, 4 KB) raises ``RecursionError`` in ``json.loads``,
which an ``except ValueError`` does not catch (trial 14b: a 500 and a traceback on every POST
endpoint of ``nanovllm serve``). :func:`shown`, :func:`clipped` and :func:`listed` quote a value
(in JSON's spelling), a name or a list of names in a one-line error a few dozen characters long at most, with its size
when cut (trial 14b: a 900 KB ``temperature`` came back as a 900 KB error). A lone surrogate (JSON's
``\\udc00`` escape carries one; it has no UTF-8 form) is quoted as its escape text, and :func:`encodable`
does the same to every text of an answer, so no answer the server builds fails to encode (trial 29b:
an unknown key ``"\\udc00"`` was a bare 500 and a traceback).
"""

from __future__ import annotations

import json
import re
import reprlib
import sys
from typing import Any

SHOWN_CHARS = 40  # the most characters of a value an error quotes (then "…" and its size)
NAME_CHARS = 60  # the most characters of a field or path name an error repeats


class JSONTooDeep(ValueError):
    """JSON text with arrays or objects nested deeper than the parser can follow (Python's recursion limit)."""


class JSONNumberTooLong(ValueError):
    """Valid JSON holding an integer with more digits than Python converts (``sys.get_int_max_str_digits()``,
    4300 by default; RFC 8259 sets no limit, so the text *is* JSON). ``digits``: how many the number has;
    ``key``: its place in the document as a request's fields are named, ``"max_tokens"``, ``"logit_bias.5"``,
    ``"prompt.2"`` (trial 41b: a nested one was named by its last key alone, one in a list by nothing), or None
    (the document itself, or not found)."""

    def __init__(self, digits: int, key: str | None) -> None:
        self.digits, self.key = digits, key
        at = "" if key is None else f"{clipped(key)}: "
        super().__init__(f"{at}a number of {digits} digits is too large (at most {sys.get_int_max_str_digits()} "
                         "digits are read, and no field takes a number anywhere near that long); send a smaller number")


_LONG_INT = re.compile(r'(?:"((?:[^"\\]|\\.)*)"\s*:\s*)?-?(\d+)')


class _Long:
    """An integer too long to convert, in place of its value while :func:`_too_long` finds where it stands."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _first_long(value: Any, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], _Long] | None:
    """The first :class:`_Long` in ``value`` in document order (a parsed object keeps its keys' order), and its path."""
    if isinstance(value, _Long):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _first_long(item, (*path, str(key)))
        if found is not None:
            return found
    return None


def _too_long(text: str, limit: int) -> JSONNumberTooLong:
    """The first integer of ``text`` longer than ``limit`` digits, as a :class:`JSONNumberTooLong` naming its place
    (parsed again with such integers held as :class:`_Long`, so nothing is converted)."""
    def parse_int(digits: str) -> Any:
        n = len(digits.lstrip("-"))
        return _Long(n) if n > limit else int(digits)

    try:
        found = _first_long(json.loads(text, parse_int=parse_int))
    except (ValueError, RecursionError):
        found = None
    if found is not None:
        path, long = found
        return JSONNumberTooLong(long.digits, ".".join(path) or None)
    for m in _LONG_INT.finditer(text):  # (not found so: the key before it, as far as the text shows)
        if len(m.group(2)) > limit:
            return JSONNumberTooLong(len(m.group(2)), m.group(1))
    return JSONNumberTooLong(limit + 1, None)  # (not found again: say what is known)


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads(data)``, with every failure a ``ValueError``.

    Raises:
        JSONTooDeep: arrays or objects nested past the recursion limit (about
            ``sys.getrecursionlimit()`` levels, fewer the deeper the caller's own stack).
        JSONNumberTooLong: an integer past Python's digit limit (trial 30b: Python's own message advised
            ``sys.set_int_max_str_digits()``, which only the server's author can act on).
        ValueError: anything else that is not JSON (``json.JSONDecodeError``, bytes that are not UTF-8).
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise JSONTooDeep(f"arrays or objects nested inside one another more than about {sys.getrecursionlimit()} "
                          "levels deep, past what the JSON parser follows") from None
    except ValueError as e:
        limit = sys.get_int_max_str_digits()
        if isinstance(e, json.JSONDecodeError) or "integer string conversion" not in str(e) or not limit:
            raise
        text = data if isinstance(data, str) else bytes(data).decode("utf-8", "replace")
        raise _too_long(text, limit) from None


# Bounds on what a quoted value shows: nested containers, long lists and long texts inside a value
# are elided with "..." (quoting the whole value could take as long as the value is, or recurse past
# the limit on a deeply nested one).
_MAX_LEVEL, _MAX_ITEMS, _MAX_KEYS = 4, 8, 6
_REPR = reprlib.Repr()  # for values JSON has no spelling for (an object a library caller passed)
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = _MAX_LEVEL, _MAX_ITEMS, _MAX_ITEMS, _MAX_KEYS
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = SHOWN_CHARS


def _spelled(value: Any, level: int) -> str:
    """``value`` in JSON's spelling (``true``, ``null``, ``"text"``, ``[1, 2]``, ``{"a": 1}``), bounded:
    at most ``_MAX_ITEMS`` items and ``_MAX_KEYS`` keys, ``_MAX_LEVEL`` levels, ``SHOWN_CHARS``
    characters of a text or digits of a number, the rest ``...``. A tuple or set reads as a list, a
    non-text key as its text; any other object as its bounded ``repr``."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        text = str(value) if -10 ** SHOWN_CHARS < value < 10 ** SHOWN_CHARS else None
        return text if text is not None else "..."
    if isinstance(value, float):
        return json.dumps(value)  # nan, inf: NaN, Infinity (what Python's JSON parser reads)
    if isinstance(value, str):
        cut = len(value) > SHOWN_CHARS
        return escaped(json.dumps(value[:SHOWN_CHARS], ensure_ascii=False)) + ("..." if cut else "")
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        if level >= _MAX_LEVEL:
            return "{...}" if isinstance(value, dict) else "[...]"
        if isinstance(value, dict):
            items = [f"{escaped(json.dumps(k if isinstance(k, str) else str(k), ensure_ascii=False))}: "
                     f"{_spelled(v, level + 1)}"
                     for k, v in list(value.items())[:_MAX_KEYS]]
            return "{" + ", ".join(items + (["..."] if len(value) > _MAX_KEYS else [])) + "}"
        head = list(value)[:_MAX_ITEMS] if not isinstance(value, (list, tuple)) else value[:_MAX_ITEMS]
        items = [_spelled(v, level + 1) for v in head]
        return "[" + ", ".join(items + (["..."] if len(value) > _MAX_ITEMS else [])) + "]"
    return _REPR.repr(value)


_SURROGATES = re.compile("[\ud800-\udfff]")


def escaped(text: str) -> str:
    """``text`` with each lone surrogate (U+D800..U+DFFF, which has no UTF-8 form) written as its
    escape text ``\\udc00`` (six characters), as ``json.dumps`` spells it; any other text unchanged."""
    return _SURROGATES.sub(lambda m: f"\\u{ord(m.group()):04x}", text) if _SURROGATES.search(text) else text


def has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (so has no UTF-8 form)."""
    return _SURROGATES.search(text) is not None


def encodable(value: Any) -> Any:
    """``value`` (what an answer's JSON is made of: dicts, lists, texts, numbers) with every text and
    key :func:`escaped`, so it encodes as UTF-8; the value itself when it holds no lone surrogate."""
    if isinstance(value, str):
        return escaped(value)
    if isinstance(value, dict):
        return {encodable(k): encodable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encodable(v) for v in value]
    return value


def shown(value: Any, limit: int = SHOWN_CHARS, *, as_json: bool = True) -> str:
    """``value`` quoted for a one-line error in JSON's spelling (``true``, ``null``, ``"text"``: what a
    client sent, not Python's ``True``/``None``/``'text'``; trial 16b) when that is at most ``limit``
    characters, else its start, "…" and its size (``"xxxx"… (900000 characters)``,
    ``[0, 1, 2, 3, 4, 5, 6, 7, ...] (a list of 5000 items)``, ``1000… (4001 digits)``). Never longer
    than about ``limit`` + 30 characters, and quick for any value JSON can hold (no full rendering of
    a big or deeply nested one). ``as_json=False``: Python's ``repr`` spelling (for a Python value
    named in Python, e.g. a keyword argument's default)."""
    if isinstance(value, str):
        quote = (lambda s: escaped(json.dumps(s, ensure_ascii=False))) if as_json else repr
        return quote(value) if len(value) <= limit else f"{quote(value[:limit])}… ({len(value)} characters)"
    if isinstance(value, int) and not isinstance(value, bool) and not -10 ** limit < value < 10 ** limit:
        try:
            text = str(value)
        except ValueError:  # past int's 4300-digit str limit (JSON refuses such a number already)
            return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
        return f"{text[:limit]}… ({len(text)} digits)"
    text = _spelled(value, 0) if as_json else _REPR.repr(value)
    if len(text) <= limit and "..." not in text:
        return text
    size = len(value) if isinstance(value, (list, tuple, dict, set, frozenset)) else None
    kind = "an object" if isinstance(value, dict) else ("a list" if as_json and size is not None
                                                        else f"a {type(value).__name__}")
    unit = "key" if isinstance(value, dict) else "item"
    tail = f" ({kind} of {size} {unit}{'s' if size != 1 else ''})" if size is not None else ""
    return (text[:limit] + "…" if len(text) > limit else text) + tail


def clipped(name: str, limit: int = NAME_CHARS) -> str:
    """A field name, path or other text an error repeats bare: itself when at most ``limit``
    characters, else its start, "…" and its length; a lone surrogate in it :func:`escaped`."""
    return escaped(name) if len(name) <= limit else f"{escaped(name[:limit])}… ({len(name)} characters)"


def listed(names: Any, most: int = 5) -> str:
    """Names (unknown fields, query parameters) joined with ", " for an error: each :func:`clipped`,
    at most ``most`` of them, then "and N more"."""
    names = list(names)
    head = ", ".join(clipped(str(n)) for n in names[:most])
    return head if len(names) <= most else f"{head} and {len(names) - most} more"
