"""Network addresses, with nothing heavy imported: ``nanovllm-tui --web``'s launcher serves pages and
starts one app per visitor, and must not pay for torch (about 500 MB) to check a host name (trial 29c)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True when ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
