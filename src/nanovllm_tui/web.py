"""``nanovllm-tui --web``: the same app in a web browser, served by textual-serve.

textual-serve starts one app process per browser tab and draws it with a terminal emulator
in the page, so a classroom can open the app without installing anything. Every other option
is passed on to those app processes (the API key through ``$NANOVLLM_API_KEY``, so it shows
neither in textual-serve's banner nor on a command line): with ``--connect URL`` each visitor
attaches to one shared server (and sees the others' prompts); without it each visitor gets an
engine of its own. The options are checked once here, so a mistake ends the command at once.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from typing import Sequence

DEFAULT_PORT = 8001


# Options of the web server itself: not passed on to the app processes. The API key is passed
# to them in $NANOVLLM_API_KEY instead, so it is neither in textual-serve's "Serving ..."
# banner nor on every app process's command line (``ps`` shows those to every user).
WEB_ONLY = ("web", "host", "port", "api_key")


def option_dest(arg: str, parser: argparse.ArgumentParser) -> argparse.Action | None:
    """The long option ``arg`` names (``--port``, ``--port=1``, or a prefix argparse accepts,
    ``--po``), or None for a value or an unknown/ambiguous name."""
    name = arg.partition("=")[0]
    if not name.startswith("--") or name == "--":
        return None
    actions = {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}
    if name in actions:
        return actions[name]
    matches = {a for s, a in actions.items() if s.startswith(name)} if parser.allow_abbrev else set()
    return matches.pop() if len(matches) == 1 else None


def app_arguments(argv: Sequence[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """``argv`` without the options in ``WEB_ONLY`` (``--web``, ``--host``, ``--port``, ``--api-key``),
    written in full, with ``=`` or abbreviated as argparse allows."""
    if parser is None:
        from nanovllm_tui.options import build_parser

        parser = build_parser()
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--":
            out += [arg, *args]
            break
        action = option_dest(arg, parser)
        if action is None or action.dest not in WEB_ONLY:
            out.append(arg)
            continue
        if "=" not in arg and action.nargs != 0:
            next(args, None)  # its value
    return out


def app_environment(api_key: str | None) -> dict[str, str | None]:
    """What to set in the environment the app processes inherit: ``NANOVLLM_API_KEY`` is the key,
    or removed (None) when there is none, so ``--api-key ""`` also overrides a key in the environment;
    ``NANOVLLM_WEB_VISITOR`` marks each as a visitor's app (its tutorial progress lasts the visit)."""
    from nanovllm_tui.options import WEB_VISITOR

    # each visitor's app keeps its tutorial progress for the visit only (options.VISIT_ONLY)
    return {"NANOVLLM_API_KEY": api_key or None, WEB_VISITOR: "1"}


# Added to textual-serve's page: its terminal takes the keyboard once the app has drawn, as a terminal
# window has it when opened. textual-serve's page never focuses its terminal, so keys typed before a
# click went nowhere, and the first Tab only moved the browser's focus into the page (a newcomer
# reported that Tab did not reach the prompt bar's fields, trial 32b). The focus reaches the app as
# textual-serve's "focus" message: Textual gives the prompt back the focus its web driver's start
# took away (and the app takes any key as the focus coming back, ``NanoVLLMApp.on_event``).
FOCUS_TERMINAL = b"""<script>
(function () {
  const wait = setInterval(function () {
    const input = document.querySelector("#terminal .xterm-helper-textarea");
    if (input && document.body.classList.contains("-first-byte")) {
      clearInterval(wait);
      setTimeout(function () { if (!document.querySelector(".xterm-helper-textarea:focus")) input.focus(); }, 300);
    }
  }, 100);
})();
</script>
"""


def page_server(command: str, **kwargs):
    """textual-serve's ``Server`` running ``command`` for each page, ending every page's app at once on
    Ctrl-C or SIGTERM, with a page whose terminal takes the keyboard when the app has drawn
    (``FOCUS_TERMINAL``).

    textual-serve leaves a page's websocket handler running through aiohttp's shutdown, so each open
    page held the web server's exit for its grace period (6-23 s seen, trials 10 and 12). Here the
    shutdown cancels each page's handler, whose own cleanup closes the socket and tells that page's
    app to quit (the app process ends as when its page closes).
    """
    import asyncio

    from aiohttp import web
    from textual_serve.server import Server

    @web.middleware
    async def focus_terminal(request, handler):
        response = await handler(request)
        if request.path == "/" and isinstance(response, web.Response) and isinstance(response.body, bytes):
            response.body = response.body.replace(b"</body>", FOCUS_TERMINAL + b"</body>", 1)
        return response

    class PageServer(Server):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.pages: set[asyncio.Task] = set()  # the running websocket handlers, one per open page

        async def handle_websocket(self, request):
            task = asyncio.current_task()
            self.pages.add(task)
            try:
                return await super().handle_websocket(request)
            finally:
                self.pages.discard(task)

        async def _make_app(self):
            app = await super()._make_app()
            app.middlewares.append(focus_terminal)
            return app

        async def on_shutdown(self, app) -> None:
            pages = set(self.pages)
            for task in pages:
                task.cancel()
            if pages:
                await asyncio.wait(pages, timeout=10)

    return PageServer(command, **kwargs)


def serve_in_browser(argv: Sequence[str] | None = None) -> int:
    """Check the options, then serve the app on ``--host``/``--port`` until Ctrl-C. Bad options: status 2."""
    from nanovllm_core.entrypoints.addresses import is_loopback
    from nanovllm_tui.options import build_parser, parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)  # refuses --trace with --web too (one file for every visitor's app)
    host, port = args.host or "127.0.0.1", args.port or DEFAULT_PORT
    try:  # one line now rather than a traceback from the web server later
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as e:
        build_parser().error(f"--web cannot listen on {host}:{port}: {e.strerror or e}; choose another --port")
    if not is_loopback(host):
        print(f"warning: --web on {host}: anyone who can reach this machine can open the app (it has no login)",
              file=sys.stderr)
    for name, value in app_environment(args.api_key).items():  # textual-serve's app processes inherit it
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    command = shlex.join([sys.executable, "-m", "nanovllm_tui.app", *app_arguments(argv, build_parser())])
    public = f"http://{socket.getfqdn() if host in ('0.0.0.0', '::') else host}:{port}"
    print(f"nanovllm-tui --web: open {public} in a browser (Ctrl-C stops)", file=sys.stderr, flush=True)
    page_server(command, host=host, port=port, title="nano-vLLM", public_url=public).serve()
    return 0
