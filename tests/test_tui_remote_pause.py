"""``nanovllm-tui --connect``: the header shows the pause the server confirmed, never only the key
pressed; a refused pause or resume is a toast with the server's reason, the state as it was (issue 29)."""

from __future__ import annotations

import threading

import pytest

from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.remote import RemoteController
from tests.tui_helpers import Notes, wait_until


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


def test_prompts_sent_from_an_attached_app_that_quits_are_aborted_on_the_server(tiny_server):
    """Trial 11: a prompt typed in an attached app ran on to its 2,000 tokens on the server after the app
    quit, holding a batch slot and KV blocks nobody would read; the server aborts a client's request when
    the client goes away, and the app now does the same for its own on the way out. Others' requests run on."""
    from nanovllm_core import events as ev
    from nanovllm_core.sampling_params import SamplingParams
    from tests.conftest import poll_until

    ended: dict[str, str] = {}
    sub = tiny_server.controller.subscribe(
        lambda e: ended.__setitem__(e.request_id, e.finish_reason) if isinstance(e, ev.RequestFinished) else None,
        topk=0, blocks=False)
    other = RemoteController(tiny_server.url, tiny_server.api_key)  # another client, staying
    remote = RemoteController(tiny_server.url, tiny_server.api_key)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    try:
        other.start()
        remote.start()
        theirs = other.submit("one two three", long)
        short = remote.submit("Hi", SamplingParams(temperature=0, max_tokens=1))
        mine = remote.submit("one two three", long)
        engine = tiny_server.controller.engine
        assert poll_until(lambda: mine in engine.requests and short in ended, timeout=20), "the app's prompt running"
        assert remote.shutdown(timeout=5)
        assert poll_until(lambda: mine in ended, timeout=10), "the quitting app's prompt ended"
        assert ended[mine] == "abort" and ended[short] == "length"
        assert theirs in engine.requests or ended.get(theirs) == "length"  # another client's is left alone
    finally:
        other.abort(theirs)
        other.shutdown(timeout=5)
        remote.shutdown(timeout=1)
        tiny_server.controller.unsubscribe(sub)
        poll_until(lambda: not tiny_server.controller.engine.has_unfinished_requests(), timeout=10)
