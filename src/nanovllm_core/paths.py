"""Where nanovllm keeps what it makes once and reuses: converted models, compiled kernels,
the measured roofline, tutorial progress.

A ground-floor module (standard library only), so that the kernels (``native.py``), the
model loader and the roofline can all name the same folder without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/nanovllm`` if set, else ``~/.cache/nanovllm`` (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nanovllm"
