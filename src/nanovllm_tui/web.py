"""``nanovllm-tui --web``: the same app in a web browser, served by textual-serve.

textual-serve starts one app process per browser tab and draws it with a terminal emulator
in the page, so a classroom can open the app without installing anything. Every other option
is passed on to those app processes: with ``--connect URL`` each visitor attaches to one
shared server (and sees the others' prompts); without it each visitor gets an engine of
its own. The options are checked once here, so a mistake ends the command at once.
"""

from __future__ import annotations

import shlex
import socket
import sys
from typing import Sequence

DEFAULT_PORT = 8001


def app_arguments(argv: Sequence[str]) -> list[str]:
    """``argv`` without the options that belong to the web server (``--web``, ``--host``, ``--port``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--web":
            continue
        if arg in ("--host", "--port"):
            skip = True
            continue
        if arg.startswith(("--host=", "--port=")):
            continue
        out.append(arg)
    return out


def serve_in_browser(argv: Sequence[str] | None = None) -> int:
    """Check the options, then serve the app on ``--host``/``--port`` until Ctrl-C. Bad options: status 2."""
    from textual_serve.server import Server

    from nanovllm_core.entrypoints.api_server import is_loopback
    from nanovllm_tui.options import build_parser, parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    host, port = args.host or "127.0.0.1", args.port or DEFAULT_PORT
    try:  # one line now rather than a traceback from the web server later
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as e:
        build_parser().error(f"--web cannot listen on {host}:{port}: {e.strerror or e}; choose another --port")
    if not is_loopback(host):
        print(f"warning: --web on {host}: anyone who can reach this machine can open the app (it has no login)",
              file=sys.stderr)
    command = shlex.join([sys.executable, "-m", "nanovllm_tui.app", *app_arguments(argv)])
    public = f"http://{socket.getfqdn() if host in ('0.0.0.0', '::') else host}:{port}"
    print(f"nanovllm-tui --web: open {public} in a browser (Ctrl-C stops)", file=sys.stderr, flush=True)
    Server(command, host=host, port=port, title="nano-vLLM", public_url=public).serve()
    return 0
