"""What comes from outside the process: JSON parsed without a crash.

A request body, a server's answer, a file on disk may be anything. :func:`loads` is
``json.loads`` whose every failure is a ``ValueError``: a text nested past the interpreter's
recursion limit (``[[[[...]]]]`` 2000 deep, 4 KB) raises ``RecursionError`` in ``json.loads``,
which an ``except ValueError`` does not catch (trial 14b: a 500 and a traceback on every POST
endpoint of ``nanovllm serve``).
"""

from __future__ import annotations

import json
import sys
from typing import Any


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
