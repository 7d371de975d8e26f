"""``nanovllm-tui --web``: a real browser (headless Chromium) opens the app and gets the Dashboard.

The app replays the recorded trace (no model is needed). Chromium is driven over the Chrome
DevTools protocol: it loads the page, the page's terminal opens its websocket to the app,
and the frames the browser receives carry the Dashboard's screen. Skipped, with the reason,
only where no Chromium binary exists (``.ci/run`` installs Debian's ``chromium`` when it can).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import end_process_group
from tests.tui_helpers import TRACE

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "chrome")
                 if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary on PATH (apt-get install chromium)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"nanovllm-tui --web ended with status {proc.returncode}: {proc.stderr.read()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"nothing listened on port {port} within {timeout} s")


def start_chromium(profile) -> tuple[subprocess.Popen, int]:
    """Headless Chromium with the DevTools protocol on a port it chose; (process, that port)."""
    proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1280,800",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    for line in proc.stderr:  # Chromium prints where its DevTools endpoint listens
        found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
        if found:
            return proc, int(found.group(1))
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError("Chromium did not start its DevTools endpoint")


async def screen_text_in_browser(devtools_port: int, url: str, wanted: str, timeout: float) -> tuple[str, str]:
    """Open ``url`` in the page; (text of the app's screen the browser received, the page's body classes)."""
    import aiohttp  # comes with textual-serve

    async with aiohttp.ClientSession() as http:
        targets = await (await http.get(f"http://127.0.0.1:{devtools_port}/json/list")).json()
        page = next(t for t in targets if t["type"] == "page")
        async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 1000))

            async def send(method: str, **params) -> int:
                n = next(ids)
                await ws.send_json({"id": n, "method": method, "params": params})
                return n

            await send("Network.enable")
            await send("Page.navigate", url=url)
            screen, deadline = "", time.monotonic() + timeout
            while wanted not in screen and time.monotonic() < deadline:
                msg = await asyncio.wait_for(ws.receive_json(), timeout)
                if msg.get("method") == "Network.webSocketFrameReceived":
                    frame = msg["params"]["response"]
                    data = frame["payloadData"]
                    screen += base64.b64decode(data).decode("utf-8", "replace") if frame["opcode"] == 2 else data
            ask = await send("Runtime.evaluate", expression="document.body.className")
            while True:
                msg = await asyncio.wait_for(ws.receive_json(), timeout)
                if msg.get("id") == ask:
                    return screen, msg["result"]["result"]["value"]


@contextlib.contextmanager
def replay_served_to_chromium(tmp_path):
    """``nanovllm-tui --web --replay TRACE`` on a free port and a headless Chromium; yields (the page's URL,
    Chromium's DevTools port). Both end afterwards: the web server with the app it started for the page."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), *sys.path) if p)}
    web = subprocess.Popen([sys.executable, "-m", "nanovllm_tui.app", "--web", "--port", str(port),
                            "--replay", str(TRACE)], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    browser = None
    try:
        wait_for_port(port, web, timeout=60)
        browser, devtools = start_chromium(tmp_path / "profile")
        yield f"http://127.0.0.1:{port}/", devtools
    finally:
        if browser is not None:
            browser.kill()
            browser.wait(10)
        end_process_group(web)


def test_the_app_served_to_a_browser_shows_the_dashboard(tmp_path):
    with replay_served_to_chromium(tmp_path) as (url, devtools):
        screen, body = asyncio.run(screen_text_in_browser(devtools, url, "Dashboard", 90))
    assert "Dashboard" in screen and "Block Map" in screen  # the app's tabs, drawn in the page's terminal
    assert "-first-byte" in body  # the page shows the terminal (the intro dialog is gone)

async def keys_reach_the_app(devtools_port: int, url: str, key: str, wanted: str, timeout: float) -> str:
    """Open ``url`` in a page that has the window's focus, wait for the Dashboard, type ``key`` with no
    click first (as a person types into a page just opened), and return the app's screen text after it."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        targets = await (await http.get(f"http://127.0.0.1:{devtools_port}/json/list")).json()
        page = next(t for t in targets if t["type"] == "page")
        async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 100000))
            screen = ""

            async def call(method: str, **params) -> dict:
                nonlocal screen
                n = next(ids)
                await ws.send_json({"id": n, "method": method, "params": params})
                while True:
                    msg = await asyncio.wait_for(ws.receive_json(), timeout)
                    if msg.get("method") == "Network.webSocketFrameReceived":
                        frame = msg["params"]["response"]
                        data = frame["payloadData"]
                        screen += base64.b64decode(data).decode("utf-8", "replace") if frame["opcode"] == 2 else data
                    if msg.get("id") == n:
                        return msg

            await call("Emulation.setFocusEmulationEnabled", enabled=True)  # a page in a window that has the focus
            await call("Network.enable")
            await call("Page.navigate", url=url)
            deadline = time.monotonic() + timeout
            while "Dashboard" not in screen and time.monotonic() < deadline:
                await call("Runtime.evaluate", expression="1")
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # the page focuses its terminal 0.3 s after the first frame
            screen = ""
            await call("Input.insertText", text=key)
            while wanted not in screen and time.monotonic() < deadline:
                await call("Runtime.evaluate", expression="1")
                await asyncio.sleep(0.2)
            return screen


def test_keys_typed_into_a_page_just_opened_reach_the_app(tmp_path):
    """textual-serve's page never focused its terminal: keys typed before a click went nowhere, and the
    first Tab only moved the browser's focus into the page (trial 32b). The page now focuses it."""
    with replay_served_to_chromium(tmp_path) as (url, devtools):
        screen = asyncio.run(keys_reach_the_app(devtools, url, "5", "Physical KV blocks", 60))
    assert "Physical KV blocks" in screen  # key 5 reached the app, which drew the Block Map
