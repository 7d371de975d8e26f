"""The app as a process: what it imports, how fast a bad option ends it, and that it ends when asked.

Each test starts ``nanovllm-tui`` (``python -m nanovllm_tui.app``) as a person or textual-serve
would, with bounded waits, and kills what it started if a wait runs out.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.tui_helpers import TRACE

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), *sys.path) if p)}
WEB_DRIVER = "textual.drivers.web_driver:WebDriver"  # what textual-serve sets for each page's app


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=ENV, capture_output=True, text=True,
                          timeout=timeout)


@contextlib.contextmanager
def app_in_a_terminal(*argv: str):
    """``python *argv`` in a pseudo-terminal of its own (100x30): yields ``(pid, fd)``; killed at the end."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the app in a terminal of its own
        os.execve(sys.executable, [sys.executable, *argv],
                  {**ENV, "TERM": "xterm-256color", "COLUMNS": "100", "LINES": "30"})
    try:
        yield pid, fd
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass


def read_terminal(fd: int, act, timeout: float = 120, poll: float = 0.2) -> tuple[bytearray, bool]:
    """Read what the app draws until its terminal closes, ``act(seen)`` returns True, or ``timeout`` s pass.

    ``act`` runs before each read (it may press keys, signal, or clear ``seen``). Returns what was
    read and whether the time ran out."""
    seen, deadline = bytearray(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if act(seen):
            return seen, False
        ready, _, _ = select.select([fd], [], [], poll)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the app ended and closed the terminal
                return seen, False
            if not chunk:
                return seen, False
            seen += chunk
    return seen, True


def test_a_bad_option_ends_with_one_line_before_torch_is_imported():
    out = run_python("""
        import sys
        from nanovllm_tui.app import main
        try:
            main(["--bogus"])
        except SystemExit as e:
            print("status", e.code, "torch" in sys.modules)
    """)
    assert out.stdout.strip() == "status 2 False"
    lines = out.stderr.strip().splitlines()
    assert lines[-1] == "nanovllm-tui: error: unrecognized arguments: --bogus"
    assert "Traceback" not in out.stderr


APP_WITHOUT_TORCH = """
    import asyncio, sys
    from nanovllm_tui.options import build_app

    async def visit(argv):
        app = build_app(argv)
        async with app.run_test(size=(120, 40)) as pilot:
            for _ in range(200):  # until the first event has been drawn (bounded)
                if app.state.requests or app.state.ready:
                    break
                await pilot.pause(0.05)
            for key in "23451":
                await pilot.press(key)
                await pilot.pause(0.2)
        return len(app.state.requests)

    print("requests", asyncio.run(visit(sys.argv[1:])) > 0, "torch", "torch" in sys.modules,
          "transformers", "transformers" in sys.modules)
"""


@pytest.mark.parametrize("chapter", [None, 12])
def test_a_replay_never_imports_torch(tmp_path, chapter):
    # The Tutorial tab opens where the learner stopped: chapter 13's facts imported torch through the
    # engine's split rule (model.parallel), which only a full run whose progress file another test had
    # left at chapter 13 showed. A cache of its own, with the progress at that chapter or none.
    if chapter is not None:
        (tmp_path / "nanovllm").mkdir()
        (tmp_path / "nanovllm" / "tutorial_progress.json").write_text(json.dumps({"current": chapter, "answers": {}}))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(APP_WITHOUT_TORCH), "--replay", str(TRACE)],
                         env={**ENV, "XDG_CACHE_HOME": str(tmp_path)}, capture_output=True, text=True, timeout=180)
    assert out.stdout.strip() == "requests True torch False transformers False", out.stderr[-2000:]


def test_an_attached_app_never_imports_torch(tiny_server):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(APP_WITHOUT_TORCH), "--connect", tiny_server.url,
                          "--api-key", tiny_server.api_key or ""], env=ENV, capture_output=True, text=True,
                         timeout=180)
    assert out.stdout.strip().split()[2:] == ["torch", "False", "transformers", "False"], out.stderr[-2000:]


@pytest.mark.parametrize("source", ["--replay", "--connect"])
def test_the_web_launcher_never_imports_torch(source, request):
    """Trial 29c: ``nanovllm-tui --web`` itself (it serves pages and starts one app per visitor) held
    566 MB with torch and CUDA's libraries mapped, for a host-name check (``is_loopback``, then in the
    API server's module). It reaches the page server with neither torch nor transformers imported."""
    out = run_python("""
        import socket, sys
        from nanovllm_tui import app, web

        class Pages:
            def serve(self):
                print("torch", "torch" in sys.modules, "transformers", "transformers" in sys.modules)

        web.page_server = lambda command, **kwargs: Pages()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        app.main(["--web", "--port", str(port), *SOURCE])
    """.replace("SOURCE", repr(web_source(source, request))))
    assert out.stdout.strip() == "torch False transformers False", out.stderr[-2000:]


def web_source(source: str, request) -> list[str]:
    """What the app watches: the test trace, or a tiny in-process server (with its API key, if any)."""
    if source == "--replay":
        return ["--replay", str(TRACE)]
    server = request.getfixturevalue("tiny_server")
    return ["--connect", server.url, *(["--api-key", server.api_key] if server.api_key else [])]


def start_web_app(*args: str) -> subprocess.Popen:
    """The app as textual-serve starts it for one page: the web driver on stdin/stdout pipes."""
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm_tui.app", "--replay", str(TRACE), *args],
                            env={**ENV, "TEXTUAL_DRIVER": WEB_DRIVER, "COLUMNS": "100", "ROWS": "30"},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # textual-serve too waits for this line before it shows the page
        line = proc.stdout.readline()
        if line == b"__GANGLION__\n" or not line:
            break
    assert line == b"__GANGLION__\n", "the app did not start its web driver"
    return proc


def ends_within(proc: subprocess.Popen, seconds: float) -> int | None:
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        return None


@pytest.mark.parametrize("how, server", [
    ("stdin closes", "gone"),  # the web server that started it is gone: both its pipes close
    ("SIGTERM", "reading"),  # textual-serve alive, reading the page's frames as it does
    ("SIGINT", "reading"),
    ("SIGTERM", "stalled"),  # a server that stopped reading: the app's writes to a full pipe block
])
def test_a_web_page_app_ends_when_its_server_goes_away_or_a_signal_comes(how, server):
    proc = start_web_app()
    if server == "reading":
        threading.Thread(target=proc.stdout.read, daemon=True).start()
    time.sleep(1.0)  # the app is up and playing the trace
    if how == "stdin closes":
        proc.stdin.close()
        proc.stdout.close()
    else:
        os.kill(proc.pid, getattr(signal, how))
    status = ends_within(proc, 15)
    assert status is not None, f"the page's app process was still running 15 s after {how} (server {server})"


def test_sigterm_quits_the_terminal_app_and_gives_the_terminal_back():
    signalled = False

    def act(seen: bytearray) -> bool:
        nonlocal signalled
        if not signalled and b"Dashboard" in seen:
            os.kill(pid, signal.SIGTERM)
            signalled = True
            seen.clear()
        return False

    with app_in_a_terminal("-m", "nanovllm_tui.app", "--replay", str(TRACE)) as (pid, fd):
        seen, _ = read_terminal(fd, act)
        _, status = os.waitpid(pid, 0) if signalled else (None, None)
    assert signalled, "the app never drew its Dashboard"
    assert b"\x1b[?1049l" in seen  # left the alternate screen
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGTERM


def test_pasting_invalid_utf8_into_the_terminal_app_does_not_end_it():
    sent, alive = None, None

    def act(seen: bytearray) -> bool:
        nonlocal sent, alive
        if sent is None and b"Dashboard" in seen:
            os.write(fd, b"\x1b[200~abc\xff\xfe def\x1b[201~")  # a bracketed paste of invalid UTF-8
            sent = time.monotonic()
        if sent is not None and time.monotonic() - sent > 3:
            alive = os.waitpid(pid, os.WNOHANG) == (0, 0)
            return True
        return False

    with app_in_a_terminal("-m", "nanovllm_tui.app", "--replay", str(TRACE)) as (pid, fd):
        read_terminal(fd, act)
    assert sent is not None, "the app never drew its Dashboard"
    assert alive, "the app ended after invalid UTF-8 was pasted"


def _app_processes(parent: int) -> list[int]:
    """Ids of the ``nanovllm_tui.app`` processes below ``parent`` (textual-serve starts one per page)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines() if line.strip()]
    found, frontier = [], {str(parent)}
    while frontier:
        children = [r for r in rows if r[1] in frontier]
        found += [int(r[0]) for r in children if "nanovllm_tui.app" in r[2] and not r[2].startswith("/bin/sh")]
        frontier = {r[0] for r in children}
    return found


def _web_replay(cwd) -> tuple[subprocess.Popen, int]:
    """``nanovllm-tui --web --replay TRACE`` on a free port, in its own session: (process, port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = subprocess.Popen([sys.executable, "-m", "nanovllm_tui.app", "--web", "--port", str(port), "--replay",
                            str(TRACE)], env=ENV, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    return web, port


def _any_alive(pids: list[int]) -> bool:
    """Whether any of ``pids`` still runs (a zombie, ended but not yet reaped, does not)."""
    return any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z" for p in pids)


def _end_group(web: subprocess.Popen) -> None:
    """Kill what is left of ``web``'s process group and reap the web server."""
    try:
        os.killpg(web.pid, signal.SIGKILL)
    except OSError:
        pass
    web.wait(10)


def test_web_visitors_apps_end_with_their_page_and_with_the_web_server(tmp_path):
    """Issue 29: two visits left two app processes alive for minutes. Here a visitor opens the
    page's websocket as the browser does and leaves; then another stays while the web server is
    killed outright. Each app process is gone within seconds, and none imported torch (a replay)."""
    import asyncio
    import socket

    import aiohttp  # comes with textual-serve

    web, port = _web_replay(tmp_path)

    frames: list[int] = []

    async def visit(until) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(f"http://127.0.0.1:{port}/ws?width=100&height=30") as ws:
                deadline = time.monotonic() + 120
                while not until() and time.monotonic() < deadline:
                    try:
                        message = await asyncio.wait_for(ws.receive(), 0.5)
                    except asyncio.TimeoutError:
                        continue
                    if message.type == aiohttp.WSMsgType.BINARY:  # the app's screen
                        frames.append(len(message.data))
                    elif message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                        return

    def wait_for(condition, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.2)
        return condition()

    try:
        assert wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 60), "--web did not listen"
        seen: set[int] = set()
        asyncio.run(visit(lambda: bool(seen.update(_app_processes(web.pid))) or len(frames) >= 3))  # drawn, then left
        assert seen and len(frames) >= 3, "the page's app did not draw"
        assert wait_for(lambda: not _app_processes(web.pid), 20), "the app outlived its page"
        rss: list[int] = []

        async def stay() -> None:
            frames.clear()
            task = asyncio.create_task(visit(lambda: False))
            deadline = time.monotonic() + 120
            while len(frames) < 3 and time.monotonic() < deadline:  # the app is drawing the page
                await asyncio.sleep(0.2)
            apps.extend(_app_processes(web.pid))
            rss.extend(int(open(f"/proc/{p}/status").read().split("VmRSS:")[1].split()[0]) for p in apps)
            os.kill(web.pid, signal.SIGKILL)  # the web server only: its apps see their stdin end
            task.cancel()

        apps: list[int] = []
        asyncio.run(stay())
        assert len(frames) >= 3 and apps and max(rss) < 300_000  # kB: no torch in a replay's app (530 MB with it)
        assert wait_for(lambda: not _any_alive(apps), 20), "an app outlived its web server"
    finally:
        _end_group(web)


def test_ctrl_c_ends_the_web_server_and_an_open_pages_app_within_seconds(tmp_path):
    """Trials 10 and 12: with a page open, Ctrl-C on ``nanovllm-tui --web`` took 6-23 s to end (textual-
    serve left the page's websocket handler to aiohttp's shutdown grace period). Now the shutdown
    ends each page at once: the web server exits within seconds and the page's app with it."""
    import asyncio
    import socket

    import aiohttp  # comes with textual-serve

    web, port = _web_replay(tmp_path)
    took: list[float] = []
    apps: list[int] = []

    async def visit_then_interrupt() -> None:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(f"http://127.0.0.1:{port}/ws?width=100&height=30") as ws:
                frames, deadline = 0, time.monotonic() + 120
                while frames < 3 and time.monotonic() < deadline:  # the page's app is drawing
                    try:
                        message = await asyncio.wait_for(ws.receive(), 0.5)
                    except asyncio.TimeoutError:
                        continue
                    frames += message.type == aiohttp.WSMsgType.BINARY
                assert frames >= 3, "the page's app did not draw"
                apps.extend(_app_processes(web.pid))
                start = time.monotonic()
                web.send_signal(signal.SIGINT)  # Ctrl-C, with the page still open
                while web.poll() is None and time.monotonic() - start < 30:
                    if not ws.closed:  # read on, as a browser does (it answers the server's close)
                        try:
                            await asyncio.wait_for(ws.receive(), 0.05)
                        except asyncio.TimeoutError:
                            pass
                    else:
                        await asyncio.sleep(0.05)
                took.append(time.monotonic() - start)

    try:
        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        asyncio.run(visit_then_interrupt())
        assert apps, "no app process served the page"
        assert web.returncode is not None and took[0] < 12, f"--web took {took[0]:.1f} s to end after Ctrl-C"
        deadline = time.monotonic() + 10
        while _any_alive(apps) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _any_alive(apps), "the page's app outlived the web server"
    finally:
        _end_group(web)


@pytest.mark.parametrize("stuck", [False, True])
def test_after_the_app_ends_an_engine_thread_still_in_a_step_is_not_torn_down(monkeypatch, stuck):
    """An engine thread that outlives the app's one-second stop (a long step) must not meet the
    interpreter's teardown of native thread pools (status 134 once in issue 29's trial): the
    process ends with os._exit after a grace period; with no engine thread left it ends normally,
    and an engine thread that was there before the app (a test process's own) is left alone."""
    import threading

    from nanovllm_core import yield_gate
    from nanovllm_tui import lifetime

    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(30,), name="nanovllm-engine", daemon=True)
    thread.start()
    if not stuck:
        release.set()
        thread.join(5)
    exits = []
    monkeypatch.setattr(lifetime.os, "_exit", exits.append)
    others = frozenset(t for t in threading.enumerate() if t is not thread)  # e.g. this session's test servers
    try:
        lifetime.leave_when_engines_stop(4, seconds=0.1, ignore=others | {thread})
        assert exits == []
        lifetime.leave_when_engines_stop(3, seconds=0.2, ignore=others)
    finally:
        release.set()
        thread.join(5)
        yield_gate.GATE.release()  # closed for good only in a process that ends: this one's engines go on
    assert exits == ([3] if stuck else [])


QUIT_INSIDE_A_TRACED_STEP = """
    import pathlib, sys, time
    from nanovllm_core import events as ev
    from nanovllm_core import tracing

    flag, argv = pathlib.Path(sys.argv[1]), sys.argv[2:]
    record = tracing.JsonlTraceWriter.__call__

    def slow_layer(self, event):  # the first layer trace takes 3 s, as a layer of a long prefill on a busy host
        if isinstance(event, ev.LayerTrace) and not flag.exists():
            flag.write_text("inside step")
            time.sleep(3)
        record(self, event)

    tracing.JsonlTraceWriter.__call__ = slow_layer
    from nanovllm_tui.app import main
    sys.exit(main(argv))
"""


@pytest.mark.real_model
def test_quitting_the_terminal_app_inside_a_traced_step_ends_it_without_a_traceback(tiny_llama_dir, tmp_path):
    """Trial 14a: ``nanovllm-tui --trace F --trace-xray``, ctrl+q while a step ran: the app closed
    the trace and ended, and its engine thread, still in the step, wrote to the closed file: three
    chained tracebacks ("Exception in thread nanovllm-engine") after the app, and status 0. Now
    the late events are dropped, one line says where the recording ends, and the status is 0."""
    from nanovllm_tui.replay import load_trace

    flag, trace = tmp_path / "inside", tmp_path / "run.jsonl"
    quit_at = None

    def act(seen: bytearray) -> bool:
        nonlocal quit_at
        if quit_at is None and flag.exists():
            os.write(fd, b"\x11")  # ctrl+q, from the prompt bar
            quit_at = time.monotonic()
        return False

    with app_in_a_terminal("-c", textwrap.dedent(QUIT_INSIDE_A_TRACED_STEP), str(flag),
                           "--model", str(tiny_llama_dir), "--trace", str(trace), "--trace-xray",
                           "--prompt", "Hello there", "--max-tokens", "3",
                           "--progress-file", str(tmp_path / "p.json")) as (pid, fd):
        seen, timed_out = read_terminal(fd, act, poll=0.1)
        _, status = os.waitpid(pid, 0) if not timed_out else (None, None)
    text = seen.decode(errors="replace")
    assert quit_at is not None, "the step never reached its first layer trace"
    assert "Traceback" not in text and "Exception in thread" not in text, text[-3000:]
    assert f"nanovllm-tui: the trace {trace} ends during step 0" in text.replace("\r\n", "\n")
    assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    with pytest.raises(ValueError, match="the recording stopped during step 0"):
        load_trace(trace)  # whole lines only: what it holds reads back
