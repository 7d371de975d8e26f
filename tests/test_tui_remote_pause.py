"""``nanovllm-tui --connect``: the header shows the pause the server confirmed, never only the key
pressed; a refused pause or resume is a toast with the server's reason, the state as it was (issue 29)."""

from __future__ import annotations

import threading

import pytest

from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.remote import RemoteController
from tests.tui_helpers import Notes, wait_until


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_an_attached_app_shows_the_pause_the_server_confirmed_and_a_refusal_keeps_the_state(tiny_server, tmp_path):
    """Before the fix the header said paused as soon as space was pressed, and kept saying it when
    the server refused. The refusal here is the real server's: the command channel's key is made
    wrong after the event stream has connected (HTTP 401); the commands are held at a gate so the
    header is seen while the server has not answered yet."""
    remote = RemoteController(tiny_server.url, tiny_server.api_key)
    gate = threading.Event()
    post = remote._server.request  # the command channel (the stream has its own connection)

    def held(*args, **kwargs):
        assert gate.wait(10), "the test never opened the gate"
        return post(*args, **kwargs)

    remote._server.request = held
    app = NanoVLLMApp(remote, tutorial_path=tmp_path / "t.json")
    notes = Notes()
    header = lambda: str(app.query_one("#header").render())  # noqa: E731
    try:
        async with app.run_test(size=(120, 36), message_hook=notes) as pilot:
            await wait_until(pilot, lambda: app.state.ready and remote.connected and "idle" in header(), 30,
                             "the attached server, idle")
            remote._server.api_key = "not-the-key"
            await pilot.press("escape", "space")
            assert "pausing…" in header() and not app.state.paused  # asked, not confirmed
            gate.set()
            await wait_until(pilot, lambda: notes.find("refused the API key"), 10, "the server's refusal")
            await pilot.pause(0.2)
            assert "(the engine is still running)" in notes.find("refused the API key")[0].message
            assert not app.state.paused and app.state.pending is None and tiny_server.controller.state != "paused"
            assert "paused" not in header() and "pausing" not in header() and "idle" in header()

            remote._server.api_key = tiny_server.api_key  # now the pause goes through: shown once confirmed
            await pilot.press("space")
            await wait_until(pilot, lambda: "● paused" in header(), 10, "the confirmed pause")
            assert tiny_server.controller.state == "paused" and app.state.paused

            gate.clear()
            remote._server.api_key = "not-the-key"  # a refused resume: still paused
            await pilot.press("space")
            assert "resuming…" in header()
            gate.set()
            await wait_until(pilot, lambda: len(notes.find("refused the API key")) == 2, 10, "the refused resume")
            await pilot.pause(0.2)
            assert "(the engine is still paused)" in notes.find("refused the API key")[1].message
            assert "● paused" in header() and app.state.paused and tiny_server.controller.state == "paused"

            remote._server.api_key = tiny_server.api_key
            await pilot.press("space")
            await wait_until(pilot, lambda: "paused" not in header() and "resuming" not in header(), 10,
                             "the confirmed resume")
            assert tiny_server.controller.state != "paused"
    finally:
        gate.set()
        remote._server.api_key = tiny_server.api_key
        tiny_server.controller.resume()  # the shared server is left unpaused, whatever happened here
