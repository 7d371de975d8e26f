"""What comes from outside the process: JSON parsed without a crash, and values quoted short in errors.

A request body, a server's answer, a file on disk may be anything. :func:`loads` is
``json.loads`` whose every failure is a ``ValueError``: a text nested past the interpreter's
recursion limit (``[[[[...]]]]`` 2000 deep, 4 KB) raises ``RecursionError`` in ``json.loads``,
which an ``except ValueError`` does not catch (trial 14b: a 500 and a traceback on every POST
endpoint of ``nanovllm serve``). :func:`shown`, :func:`clipped` and :func:`listed` quote a value,
a name or a list of names in a one-line error a few dozen characters long at most, with its size
when cut (trial 14b: a 900 KB ``temperature`` came back as a 900 KB error).
"""

from __future__ import annotations

import json
import reprlib
import sys
from typing import Any

SHOWN_CHARS = 40  # the most characters of a value an error quotes (then "…" and its size)
NAME_CHARS = 60  # the most characters of a field or path name an error repeats


class JSONTooDeep(ValueError):
    """JSON text with arrays or objects nested deeper than the parser can follow (Python's recursion limit)."""


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads(data)``, with every failure a ``ValueError``.

    Raises:
        JSONTooDeep: arrays or objects nested past the recursion limit (about
            ``sys.getrecursionlimit()`` levels, fewer the deeper the caller's own stack).
        ValueError: anything else that is not JSON (``json.JSONDecodeError``, bytes that are not UTF-8).
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise JSONTooDeep(f"arrays or objects nested inside one another more than about {sys.getrecursionlimit()} "
                          "levels deep, past what the JSON parser follows") from None


# A repr of bounded cost and length: nested containers, long lists and long texts inside a value
# are elided with "..." (a repr of the whole value could take as long as the value is, or recurse
# past the limit on a deeply nested one).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 4, 8, 8, 6
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = SHOWN_CHARS


def shown(value: Any, limit: int = SHOWN_CHARS, *, as_json: bool = False) -> str:
    """``value`` quoted for a one-line error: its ``repr`` (``as_json``: its JSON text) when that is at
    most ``limit`` characters, else its start, "…" and its size (``'xxxx…' (900000 characters)``,
    ``[0, 1, 2, 3, 4, 5, 6, 7, ...] (a list of 5000 items)``, ``1000… (4001 digits)``). Never longer
    than about ``limit`` + 30 characters, and quick for any value JSON can hold (no full repr of a
    big or deeply nested one)."""
    if isinstance(value, str):
        quote = (lambda s: json.dumps(s, ensure_ascii=False)) if as_json else repr
        return quote(value) if len(value) <= limit else f"{quote(value[:limit])}… ({len(value)} characters)"
    if isinstance(value, int) and not isinstance(value, bool) and not -10 ** limit < value < 10 ** limit:
        try:
            text = str(value)
        except ValueError:  # past int's 4300-digit str limit (JSON refuses such a number already)
            return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
        return f"{text[:limit]}… ({len(text)} digits)"
    if as_json and (value is None or isinstance(value, (bool, int, float))):
        return json.dumps(value)
    text = _REPR.repr(value)
    if len(text) <= limit and "..." not in text:
        return text
    size = len(value) if isinstance(value, (list, tuple, dict)) else None
    kind = "an object" if isinstance(value, dict) else f"a {type(value).__name__}"
    unit = "key" if isinstance(value, dict) else "item"
    tail = f" ({kind} of {size} {unit}{'s' if size != 1 else ''})" if size is not None else ""
    return (text[:limit] + "…" if len(text) > limit else text) + tail


def clipped(name: str, limit: int = NAME_CHARS) -> str:
    """A field name, path or other text an error repeats bare: itself when at most ``limit``
    characters, else its start, "…" and its length."""
    return name if len(name) <= limit else f"{name[:limit]}… ({len(name)} characters)"


def listed(names: Any, most: int = 5) -> str:
    """Names (unknown fields, query parameters) joined with ", " for an error: each :func:`clipped`,
    at most ``most`` of them, then "and N more"."""
    names = list(names)
    head = ", ".join(clipped(str(n)) for n in names[:most])
    return head if len(names) <= most else f"{head} and {len(names) - most} more"
