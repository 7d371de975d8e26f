"""``nanovllm-tui --connect``: the app attached to a running server sees its clients and drives its engine.

The server is the shared in-process ``tiny_server``; the app talks to it only over HTTP, through
``RemoteController``, exactly as ``nanovllm-tui --connect URL`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import openai
import pytest

from nanovllm_core import SamplingParams
from nanovllm_core import events as ev
from nanovllm_core.engine.controller import EngineController
from nanovllm_core.entrypoints.api_server import APIServer, build_app
from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.remote import RemoteController
from nanovllm_tui.widgets.prompt_bar import PromptSettings
from nanovllm_tui.widgets.request_table import RequestTable
from tests.conftest import poll_until
from tests.serve_helpers import start_server
from tests.tui_helpers import Notes, send_prompt, wait_until


class Streamer:
    """An ``openai`` client streaming one long completion on its own thread, counting tokens as they arrive."""

    def __init__(self, server, max_tokens: int):
        self.tokens: list[int] = []
        self.id = None
        self.finish = None
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)
        self.stream = client.completions.create(
            model=server.controller.engine.model_name, prompt="Once upon a time", max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for chunk in self.stream:
            self.id = chunk.id
            for c in chunk.choices:
                self.tokens += c.model_extra["token_ids"]
                self.finish = c.finish_reason or self.finish


@pytest.fixture
def paced(tiny_server):
    """The tiny model's steps last at least 20 ms, so a 100-token stream is still running when keys arrive."""
    engine = tiny_server.controller.engine
    engine.fault_injector = lambda plan: time.sleep(0.02)  # the engine's per-step test hook
    yield engine
    engine.fault_injector = None


@pytest.mark.anyio
async def test_attached_app_sees_a_client_and_pauses_steps_and_resumes_the_server(tiny_server, paced, tmp_path):
    engine = paced
    app = NanoVLLMApp(RemoteController(tiny_server.url, tiny_server.api_key), tutorial_path=tmp_path / "t.json",
                      settings=PromptSettings(max_tokens=5))
    notes = Notes()
    async with app.run_test(size=(120, 36), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, 30, "the server's model facts")
        assert app.state.model_name == engine.model_name
        client = Streamer(tiny_server, max_tokens=100)
        await wait_until(pilot, lambda: client.id in app.state.requests and app.state.requests[client.id].num_output > 3,
                         30, "the client's request streaming in the app")
        assert client.id in app.query_one(RequestTable).rows  # in the request table, as any request
        assert app.state.requests[client.id].prompt == "Once upon a time"

        await pilot.press("escape", "space")
        await wait_until(pilot, lambda: tiny_server.controller.state == "paused", 10, "the server to pause")
        await pilot.pause(0.5)  # what was already on its way arrives
        held, step = len(client.tokens), engine.step_index
        await pilot.pause(0.8)
        assert len(client.tokens) == held and engine.step_index == step  # the client's stream stopped
        assert "paused" in str(app.query_one("#header").render())

        await pilot.press("n")
        await wait_until(pilot, lambda: len(client.tokens) == held + 1, 10, "one more token")
        await pilot.pause(0.5)
        assert engine.step_index == step + 1 and len(client.tokens) == held + 1  # exactly one step

        await pilot.press("space")
        await wait_until(pilot, lambda: client.finish is not None, 120, "the client's stream to finish")
        assert client.finish == "length" and len(client.tokens) == 100
        await wait_until(pilot, lambda: app.state.requests[client.id].state == "finished", 10, "the app to see it end")
        assert app.state.requests[client.id].num_output == 100

        # A prompt typed into the attached app runs on the server like any client's; a refusal is shown.
        await send_prompt(pilot, "Hello there")
        typed = app.selected
        await wait_until(pilot, lambda: app.state.requests[typed].state == "finished", 30, "the typed prompt to end")
        assert typed.startswith("tui-") and app.state.requests[typed].num_output >= 1
        await send_prompt(pilot, "word " * 600)  # longer than the model holds
        # refused by the server before queueing, in /v1/completions' words
        await wait_until(pilot, lambda: notes.find("maximum context length", severity="error"), 30, "the refusal")
        await wait_until(pilot, lambda: app.query_one("#prompt").value == "word " * 600, 5, "the refused prompt kept")


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["q", "signal"])
async def test_an_app_that_paused_the_server_resumes_it_when_it_quits(tiny_server, tmp_path, how):
    """Issue 29: space then q left the server paused and its clients waiting forever. The app
    resumes what it paused, on every way out (q; a signal's path, ``stop_engine`` then exit)."""
    app = NanoVLLMApp(RemoteController(tiny_server.url, tiny_server.api_key), tutorial_path=tmp_path / "t.json")
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.state.ready and app.controller.connected, 30, "the attached server")
        await pilot.press("escape", "space")
        await wait_until(pilot, lambda: tiny_server.controller.state == "paused", 10, "the server to pause")
        if how == "q":
            await pilot.press("q")
        else:  # what lifetime.quit_on_signals runs on SIGTERM / SIGINT / SIGHUP
            app.stop_engine()
            app.exit(return_code=143)
    assert poll_until(lambda: tiny_server.controller.state != "paused", 5), "the server stayed paused after quit"


def test_a_server_paused_by_someone_else_stays_paused_when_a_watcher_quits(tiny_server):
    """Only what this app paused is resumed: a pause from another watcher is kept."""
    other = RemoteController(tiny_server.url, tiny_server.api_key)
    watcher = RemoteController(tiny_server.url, tiny_server.api_key)
    try:
        other.start(), watcher.start()
        assert _until(lambda: other.connected and watcher.connected)
        other.pause()
        assert _until(lambda: tiny_server.controller.state == "paused")
        assert watcher.shutdown(timeout=2)
        time.sleep(0.3)
        assert tiny_server.controller.state == "paused"
    finally:
        other.shutdown(timeout=2)  # it paused the server: its shutdown resumes it
    assert _until(lambda: tiny_server.controller.state != "paused")


def test_a_pause_another_client_made_after_the_apps_own_stays_when_the_app_quits(tiny_server):
    """Newcomer trial 3: the app paused, a curl client resumed and paused again, the app quit and
    resumed the curl client's pause. The server keeps who made the pause it holds; the app's
    resume on quitting ends only its own (a restarted server's pause, made by nobody, is kept too)."""
    import httpx

    control = tiny_server.url + "/v1/engine/control"
    app_side = RemoteController(tiny_server.url, tiny_server.api_key)
    try:
        app_side.start()
        assert _until(lambda: app_side.connected)
        app_side.pause()
        assert _until(lambda: tiny_server.controller.state == "paused")
        # another client, as curl would; a resume says that it resumed (newcomer trial, issue 29: a
        # successful resume answered only {"ok": true}, a refused one {"ok": true, "resumed": false})
        assert httpx.post(control, json={"command": "resume"}, headers=tiny_server.headers).json() == {
            "ok": True, "resumed": True}
        assert httpx.post(control, json={"command": "pause"}, headers=tiny_server.headers).json() == {"ok": True}
        assert _until(lambda: tiny_server.controller.state == "paused")
        assert app_side.shutdown(timeout=2)
        time.sleep(0.3)
        assert tiny_server.controller.state == "paused", "the app's quit resumed another client's pause"
        # a resume naming an owner that does not hold the pause says so and changes nothing
        r = httpx.post(control, json={"command": "resume", "owner": "someone"}, headers=tiny_server.headers)
        assert r.json()["resumed"] is False and "not made by this owner" in r.json()["reason"]
        assert tiny_server.controller.state == "paused"
        # ... and a resume naming the owner that holds it ends it, saying so
        httpx.post(control, json={"command": "pause", "owner": "someone"}, headers=tiny_server.headers)
        r = httpx.post(control, json={"command": "resume", "owner": "someone"}, headers=tiny_server.headers)
        assert r.json() == {"ok": True, "resumed": True}
        assert _until(lambda: tiny_server.controller.state != "paused")
        # with no pause held, any owner's resume finds the engine running: resumed, no pause claimed (trial 6)
        r = httpx.post(control, json={"command": "resume", "owner": "x"}, headers=tiny_server.headers)
        assert r.json() == {"ok": True, "resumed": True}
    finally:
        httpx.post(control, json={"command": "resume"}, headers=tiny_server.headers)
    assert _until(lambda: tiny_server.controller.state != "paused")


@pytest.mark.anyio
async def test_an_attached_app_says_demonstrations_need_a_local_engine(tiny_server, tmp_path):
    """Issue 29: under --connect, r in the Tutorial said "the model is still loading" forever (no
    engine in the app's process). It says what is true: a demonstration needs a local engine."""
    app, notes = NanoVLLMApp(RemoteController(tiny_server.url, tiny_server.api_key), tutorial_path=tmp_path / "t.json"), Notes()
    async with app.run_test(size=(120, 36), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, 30, "the attached server")
        await pilot.press("escape", "4")
        await pilot.pause(0.2)
        tutorial = app.query_one("#tutorial-view")
        # r can only refuse here, so it is not offered (issue 29); reached anyway (the palette), it says why
        assert tutorial.check_action("run_demo", ()) is False
        await pilot.press("r")  # the hidden key pressed anyway: the refusal names the demonstration (trial 7)
        await wait_until(pilot, lambda: notes.find("No demonstration under --connect", "warning"), 10,
                         "the refusal of the hidden key")
        tutorial.action_run_demo()  # (the same words, still on screen, are not shown twice)
        await wait_until(pilot, lambda: notes.find("start nanovllm-tui without --connect", "warning"), 10, "the note")
        assert not notes.find("still loading")


@pytest.mark.anyio
async def test_an_attached_app_follows_a_new_clients_request_once_the_selected_one_has_finished(
        tiny_server, paced, tmp_path):
    """Issue 29: the X-Ray said "No trace yet" while the server generated for another client, whose
    request was not selected (only ``]`` selected it). A new request is selected when the selected one
    has finished; one still running stays selected."""
    app = NanoVLLMApp(RemoteController(tiny_server.url, tiny_server.api_key), tutorial_path=tmp_path / "t.json")
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, 30, "the attached server")
        await pilot.press("escape", "2")
        first = Streamer(tiny_server, max_tokens=3)
        await wait_until(pilot, lambda: first.finish is not None, 30, "the first client's stream")
        await wait_until(pilot, lambda: first.id in app.state.requests and not app.state.requests[first.id].live,
                         10, "the app to see it end")
        assert app.selected == first.id
        second = Streamer(tiny_server, max_tokens=40)
        await wait_until(pilot, lambda: app.selected == second.id, 10, "the new request selected")
        await wait_until(pilot, lambda: any(t.request_id == second.id for t in app.state.xray.values()), 10,
                         "the X-Ray tracing it")
        third = Streamer(tiny_server, max_tokens=3)  # while the selected one still runs: it stays selected
        await wait_until(pilot, lambda: third.finish is not None, 30, "the third client's stream")
        await pilot.pause(0.3)
        assert app.selected == second.id
        await wait_until(pilot, lambda: second.finish is not None, 30, "the second stream")


def test_two_watchers_one_pauses_both_see_it(tiny_server):
    a, b = RemoteController(tiny_server.url, tiny_server.api_key), RemoteController(tiny_server.url, tiny_server.api_key)
    seen = {"a": [], "b": []}
    a.subscribe(seen["a"].append, topk=0, blocks=False)
    b.subscribe(seen["b"].append, topk=0, blocks=False)
    try:
        a.start(), b.start()
        assert _until(lambda: a.connected and b.connected)
        a.pause()
        assert _until(lambda: all(any(isinstance(e, ev.EnginePaused) for e in s) for s in seen.values()))
        assert _until(lambda: b.state == "paused")
        b.resume()
        assert _until(lambda: all(any(isinstance(e, ev.EngineResumed) for e in s) for s in seen.values()))
        # (an EngineResumed of an earlier test may be among the first events a new watcher gets)
        assert _until(lambda: tiny_server.controller.state != "paused")
    finally:
        assert a.shutdown(timeout=2) and b.shutdown(timeout=2)


def test_a_dropped_stream_reconnects_and_misses_no_event(tiny_server, paced):
    remote = RemoteController(tiny_server.url, tiny_server.api_key, reconnect_s=(0.05, 0.2))
    events: list[ev.Event] = []
    remote.subscribe(events.append, topk=0, blocks=False)
    remote.start()
    try:
        assert _until(lambda: remote.connected)
        rid = remote.submit("The quick brown fox", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        assert _until(lambda: sum(isinstance(e, ev.TokenSampled) for e in events) >= 5)
        remote._stream_conn.sock.shutdown(2)  # the network drops mid-request
        assert _until(lambda: any(isinstance(e, ev.EngineError) and "lost the connection" in e.message
                                  for e in events))
        assert _until(lambda: any(isinstance(e, ev.RequestFinished) and e.request_id == rid for e in events), 60)
        assert remote.connected
        tokens = [e for e in events if isinstance(e, ev.TokenSampled) and e.request_id == rid]
        done = next(e for e in events if isinstance(e, ev.RequestFinished) and e.request_id == rid)
        assert [t.num_output_tokens for t in tokens] == list(range(1, 61))  # none lost, none twice
        assert "".join(t.text for t in tokens) == done.output_text
    finally:
        remote.shutdown(timeout=2)


@contextlib.asynccontextmanager
async def attached_app_losing_its_server(make_tiny_engine, tmp_path, api_key: str | None = None):
    """An app attached to a tiny server, run until the server has stopped and the header says
    ``disconnected``; yields ``(pilot, app, notes, header, restart)`` where ``restart(api_key)``
    starts a new server on the same port over the same engine."""
    controller = EngineController.from_engine(make_tiny_engine(num_kv_blocks=32))
    server = start_server(controller, api_key=api_key)
    port = int(server.url.rsplit(":", 1)[1])
    remote = RemoteController(server.url, api_key=api_key, reconnect_s=(0.05, 0.2))
    app, notes, started = NanoVLLMApp(remote, tutorial_path=tmp_path / "t.json"), Notes(), []

    def restart(key: str | None = None) -> None:
        again = APIServer(build_app(controller, api_key=key), log_level="warning", access_log=False)
        again.start_in_thread(socket.create_server(("127.0.0.1", port)))
        started.append(again)

    try:
        async with app.run_test(size=(120, 36), message_hook=notes) as pilot:
            header = lambda: str(app.query_one("#header").render())  # noqa: E731
            await wait_until(pilot, lambda: "idle" in header(), 30, "the header to show the server idle")
            assert server.stop()
            await wait_until(pilot, lambda: "disconnected" in header(), 10, "the header to show the lost server")
            yield pilot, app, notes, header, restart
    finally:
        for again in started:
            again.stop()
        controller.shutdown(timeout=5)


@pytest.mark.anyio
async def test_losing_the_server_shows_in_the_header_the_app_stays_live_and_reconnects(make_tiny_engine, tmp_path):
    async with attached_app_losing_its_server(make_tiny_engine, tmp_path) as (pilot, app, notes, header, restart):
        url = app.controller.url
        assert len(notes.find("lost the connection to " + url)) == 1
        await pilot.press("escape", "5")  # the window still answers while the server is gone
        assert app.active_tab == "blocks"
        await pilot.pause(0.5)
        assert len(notes.find("lost the connection")) == 1  # said once, not at every attempt
        restart()
        await wait_until(pilot, lambda: "idle" in header(), 30, "the app to reconnect to the new server")
        assert app.controller.connected


@pytest.mark.anyio
async def test_a_server_back_with_another_api_key_shows_key_refused_without_a_key_press(make_tiny_engine, tmp_path):
    """Trial 7: a server restarted with another --api-key under the app left it 'disconnected' for
    good, retrying; nothing said the key was refused until space was pressed."""
    async with attached_app_losing_its_server(make_tiny_engine, tmp_path, "first") as (pilot, _, notes, header, restart):
        restart("other")
        await wait_until(pilot, lambda: "key refused" in header(), 30, "the header to say the key is refused")
        await wait_until(pilot, lambda: notes.find("refused the API key"), 10, "a note saying why")
        said = notes.find("refused the API key")[0].message
        assert "$NANOVLLM_API_KEY is not the server's" in said
        # trial 10: it read "...(... is not the server's)); reconnecting", a retry that cannot succeed alone
        assert "))" not in said and "reconnecting" not in said and "restart the app with the server's key" in said
        assert notes.find("refused the API key")[0].title == "Connection"
        await pilot.pause(0.6)
        assert len(notes.find("refused the API key")) == 1  # said once, not at every attempt


def test_a_prompt_sent_as_token_ids_shows_as_its_pieces():
    from nanovllm_tui.state import EngineState

    state = EngineState()
    state.apply(ev.RequestAdded(request_id="chat-0", prompt=None, prompt_token_ids=(1, 2, 3),
                                prompt_pieces=("<|im_start|>", "user", "\nHi"), priority=0, max_tokens=4))
    assert state.requests["chat-0"].prompt == "<|im_start|>user\nHi"


def test_a_new_watchers_snapshot_gives_the_pool_as_it_is_after_an_abort_between_steps():
    """Newcomer trial 3: a stream aborted by its client's disconnect freed its blocks after the
    newest step; an app attached then showed "used 2 ... free 2743" beside an empty Block Map.
    The snapshot's StepTimed carries the pool as the last finished request left it."""
    from types import SimpleNamespace

    from nanovllm_core.entrypoints.event_hub import EventHub, _Watcher
    from nanovllm_tui.state import EngineState

    hub = EventHub(SimpleNamespace(state="idle"))
    hub.publish(ev.StepTimed(step=7, wall_time_s=0.01, num_tokens=1, num_prefill_tokens=0, num_decode_tokens=1,
                             prefill_tokens_per_s=0.0, decode_tokens_per_s=100.0, kv_bytes_used=2 * 1024,
                             kv_bytes_total=2746 * 1024, num_running=1, num_waiting=0, num_blocks_used=2,
                             num_blocks_cached=0, num_blocks_total=2746))
    hub.publish(ev.RequestFinished(request_id="cmpl-1", step=None, index=0, finish_reason="abort", stop_reason=None,
                                   output_text="", output_token_ids=(),
                                   num_prompt_tokens=5, num_output_tokens=3, ttft_s=0.1, tpot_s=0.01, e2e_s=0.2,
                                   num_preemptions=0, num_cached_prompt_tokens=0, kv_blocks_used=0,
                                   kv_blocks_cached=1))
    state = EngineState()
    for event in hub._snapshot(_Watcher(topk=0, blocks=True, xray=False)):
        state.apply(event)
    assert (state.kv.num_blocks_used, state.kv.num_blocks_cached, state.kv.kv_bytes_used) == (0, 1, 0)
    assert state.kv.step == 7 and state.kv.wall_time_s == 0.01  # the step's own figures are kept


def test_an_app_attached_late_leaves_out_the_pauses_it_did_not_see(make_tiny_engine):
    """Newcomer trial 3: attached to a ``serve --paused`` server 12 s after a request came, the app
    showed a live TTFT of 11.7 s where the engine counted 2.58. The snapshot sends the pauses that
    overlap a live request, dated when they happened (also ones that ended: here single steps), so
    the live figures leave them out as the engine's do."""
    import httpx

    from nanovllm_tui.state import EngineState

    controller = EngineController.from_engine(make_tiny_engine(num_kv_blocks=64), start_paused=True)
    server = start_server(controller, api_key=None)
    watcher = None
    try:
        control = server.url + "/v1/engine/control"
        body = {"command": "submit", "request_id": "late", "prompt": "Once upon a time",
                "params": {"max_tokens": 20, "ignore_eos": True, "temperature": 0}}
        assert httpx.post(control, json=body).json()["ok"]
        time.sleep(0.8)  # held paused with the request waiting
        assert httpx.post(control, json={"command": "step", "n": 2}).json()["ok"]  # prefill, one decode
        assert _until(lambda: server.stats()["num_running"] == 1)
        time.sleep(0.8)  # held again between the steps and the attach
        state, lock = EngineState(), threading.Lock()

        def apply(event):
            with lock:
                state.apply(event)

        watcher = RemoteController(server.url)
        watcher.subscribe(apply, topk=0, blocks=False)
        watcher.start()
        assert _until(lambda: "late" in state.requests and state.requests["late"].num_output >= 2)
        with lock:
            req = state.requests["late"]
            assert state.paused and req.ttft is not None and req.ttft < 0.5, req.ttft
            assert req.tpot < 0.5, req.tpot
            assert req.paused_s > 0.7, req.paused_s  # the wait before its first token, seen as a pause
    finally:
        if watcher is not None:
            watcher.shutdown(timeout=2)
        server.stop()
        controller.shutdown(timeout=5)


def _until(cond, timeout: float = 30.0) -> bool:
    return poll_until(cond, timeout)


def test_a_watcher_that_attaches_mid_run_starts_from_the_engine_as_it_is(tiny_server, paced):
    """Issue 29: right after attaching, the Dashboard said "no step yet" while the server was at
    step 156. A new watcher's snapshot holds the newest step, its timing, and each live request's
    tokens so far; the app's state then equals that of a watcher that saw everything."""
    from nanovllm_tui.state import EngineState

    early = RemoteController(tiny_server.url, tiny_server.api_key)
    watched = EngineState()
    early.subscribe(watched.apply, topk=0, blocks=False)
    early.start()
    client = Streamer(tiny_server, max_tokens=200)
    late = None
    try:
        assert _until(lambda: len(client.tokens) > 5, 60)
        tiny_server.controller.pause()
        assert _until(lambda: tiny_server.controller.state == "paused")
        time.sleep(0.5)  # the last step's events reach the early watcher
        late = RemoteController(tiny_server.url, tiny_server.api_key)
        attached = EngineState()
        late.subscribe(attached.apply, topk=0, blocks=False)
        late.start()
        assert watched.step is not None
        assert _until(lambda: attached.step == watched.step and attached.timings, 10), (attached.step, watched.step)
        mine, theirs = attached.requests[client.id], watched.requests[client.id]
        assert mine.state == theirs.state == "running"
        assert (mine.num_output, mine.text) == (theirs.num_output, theirs.text) == (len(client.tokens), mine.text)
        assert attached.kv.num_blocks_used == watched.kv.num_blocks_used > 0
        assert attached.paused
    finally:
        tiny_server.controller.resume()
        for c in (early, late):
            if c is not None:
                c.shutdown(timeout=2)
        assert _until(lambda: client.finish is not None, 120)


class _NoAborts:
    """A controller whose ``abort_all`` does nothing, as a killed server sends no aborts."""

    def __init__(self, controller) -> None:
        self._controller = controller

    def abort_all(self) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self._controller, name)


@pytest.mark.anyio
async def test_an_app_attached_to_a_server_that_restarts_marks_its_old_requests_lost_and_clears_ended_ones(make_tiny_engine, tmp_path):
    """Issue 29: after the server restarted, the app kept four "running" ghost requests and their
    blocks. A new engine behind the same address ends them in the app, with a notice."""
    first = EngineController.from_engine(make_tiny_engine(num_kv_blocks=32))
    first.engine.fault_injector = lambda plan: time.sleep(0.05)  # still running when the server goes
    server = start_server(first, api_key=None)
    port = int(server.url.rsplit(":", 1)[1])
    remote = RemoteController(server.url, reconnect_s=(0.05, 0.2))
    app = NanoVLLMApp(remote, tutorial_path=tmp_path / "t.json", settings=PromptSettings(max_tokens=200, chat=False))
    notes, second, again = Notes(), None, None
    try:
        async with app.run_test(size=(120, 36), message_hook=notes) as pilot:
            await wait_until(pilot, lambda: app.state.ready, 30, "the server's model facts")
            await send_prompt(pilot, "Hi", max_tokens=2)
            done = app.selected
            await wait_until(pilot, lambda: app.state.requests[done].state == "finished", 30, "a short request")
            await send_prompt(pilot, "Once upon a time", max_tokens=200)
            rid = app.selected
            await wait_until(pilot, lambda: app.state.requests[rid].num_output > 2, 30, "the request to run")
            await pilot.press("escape", "5")  # the Block Map open across the restart (trial 40c: it stayed empty)
            # a server that dies without its shutdown's aborts (SIGKILL, a crash): a graceful stop ends
            # the request with RequestFinished(abort) (trial 20d), and only a killed one leaves it running
            server.http.app.state.server.controller = _NoAborts(first)
            assert server.stop()
            first.shutdown(timeout=5)
            second = EngineController.from_engine(make_tiny_engine(num_kv_blocks=32))
            again = APIServer(build_app(second), log_level="warning", access_log=False)
            again.start_in_thread(socket.create_server(("127.0.0.1", port)))
            # (a stop that could not apply its aborts names the request unfinished: lost from then on, trial 30c)
            await wait_until(pilot, lambda: notes.find("restarted with a new engine", "warning"), 30, "the restart")
            assert app.state.requests[rid].state == "lost"
            assert not app.state.active_requests and app.state.step is None
            # trial 8: the old engine's finished rows stayed beside the new server's, which knows none of them
            assert done not in app.state.requests and list(app.state.requests) == [rid]
            # the tab shown asks the new engine for its pool at once, not at its first step
            await wait_until(pilot, lambda: app.state.blocks is not None, 10, "the new engine's block map")
            assert not app.state.blocks.tables and app.state.blocks.num_blocks == 32
            assert app.selected == rid
            await pilot.press("2")  # X-Ray of the lost request: not asked of the new server (trial 9: a 404 toast)
            await pilot.pause(1.0)
            assert not notes.find("xray:") and not notes.find("X-Ray")
    finally:
        if again is not None:
            again.stop()
        for c in (first, second):
            if c is not None:
                c.shutdown(timeout=5)


@contextlib.contextmanager
def _watching(server):
    """A RemoteController attached to ``server`` and connected, with the events it has seen; shut down after."""
    remote = RemoteController(server.url, server.api_key)
    seen: list[ev.Event] = []
    remote.subscribe(seen.append, topk=0, blocks=False)
    try:
        remote.start()
        assert _until(lambda: remote.connected)
        yield remote, seen
    finally:
        remote.shutdown(timeout=2)


def test_an_attached_app_sends_chat_through_the_servers_template(tiny_server):
    """The prompt bar's chat reaches a server too: its control submit takes a conversation and
    renders it with the model's chat template, as the local engine does."""
    from nanovllm_core.prompts import user_message

    with _watching(tiny_server) as (remote, seen):
        rid = remote.submit(user_message("Write a poem about the sea."), SamplingParams(max_tokens=2))
        assert _until(lambda: any(isinstance(e, ev.RequestFinished) and e.request_id == rid for e in seen), 60)
        added = next(e for e in seen if isinstance(e, ev.RequestAdded) and e.request_id == rid)
        expected = tiny_server.controller.engine.chat_token_ids(user_message("Write a poem about the sea."))
        assert list(added.prompt_token_ids) == expected and "<|im_start|>" in added.prompt_pieces
        bad = remote.submit([{"role": "user"}], SamplingParams(max_tokens=2))  # no content: refused, with why
        assert _until(lambda: any(isinstance(e, ev.RequestRejected) and e.request_id == bad for e in seen), 30)


def test_a_chat_completion_is_told_to_a_watcher_as_the_users_message_not_token_ids(tiny_server):
    """Trial 24d #2's kind: the server renders /v1/chat/completions with the template before the engine; a
    watching app's narrator (``--connect``) said 'The prompt (given as token ids)' of the user's message."""
    import httpx

    from nanovllm_core.educational.narrator import Narrator

    with _watching(tiny_server) as (remote, seen):
        r = httpx.post(tiny_server.url + "/v1/chat/completions", headers=tiny_server.headers, timeout=60,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]  # (the attach snapshot may introduce an earlier test's requests: trial 29c)
        assert _until(lambda: any(isinstance(e, ev.RequestFinished) and e.request_id == rid for e in seen), 60)
        (added,) = [e for e in seen if isinstance(e, ev.RequestAdded) and e.request_id == rid]
        assert added.chat == (("user", "Hi"),)
        told = Narrator({}).feed(added)[0]
        assert told.text.startswith("The user's message 'Hi', put through the model's chat template, becomes"), told.text


def test_pause_steps_and_resume_arriving_at_one_step_boundary_run_exactly_the_steps_accepted(tiny_server):
    """Trial 25b: ``space n n n`` under --connect. Every order of pause, step and resume that reaches
    the engine thread at one step boundary runs exactly the steps answered 200; a step sent after a
    resume that has not applied yet is refused (409), not answered 200 and dropped."""
    import requests

    c = tiny_server.controller
    rec: list[ev.Event] = []
    sub = c.subscribe(rec.append, topk=0, blocks=False)

    def post(body):
        return requests.post(tiny_server.url + "/v1/engine/control", json=body, headers=tiny_server.headers, timeout=30)

    def hold():  # the engine thread waits between steps until released; commands queue behind it
        entered, release = threading.Event(), threading.Event()
        c.call(lambda engine: (entered.set(), release.wait(30)))
        assert entered.wait(30)
        return release

    def timed():
        return sum(isinstance(e, ev.StepTimed) for e in list(rec))

    rid = post({"command": "submit", "prompt": "Once upon a time",
                "params": {"max_tokens": 400, "ignore_eos": True}}).json()["request_id"]
    try:
        assert poll_until(lambda: timed() >= 2, 30)
        release = hold()  # running: pause and three steps arrive before the engine's next boundary
        assert [post(b).status_code for b in ({"command": "pause", "owner": "app"}, {"command": "step"},
                                               {"command": "step"}, {"command": "step"})] == [200] * 4
        ran = timed()
        release.set()
        assert poll_until(lambda: c.state == "paused" and c.steps_pending() == 0 and timed() >= ran + 3, 30)
        hold().set()  # one more pass of the engine thread's loop: the pause holds
        assert timed() == ran + 3

        release = hold()  # paused: a step, a resume, a step after it, a pause and a step
        assert post({"command": "step", "n": 2}).status_code == 200
        assert post({"command": "resume"}).json()["resumed"] is True
        refused = post({"command": "step"})  # the state still reads "paused": was 200, then dropped
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_paused"
        assert "pause first" in refused.json()["error"]["message"]
        assert post({"command": "pause"}).status_code == 200
        assert post({"command": "step"}).status_code == 200
        ran = timed()
        release.set()
        assert poll_until(lambda: c.state == "paused" and c.steps_pending() == 0 and timed() >= ran + 1, 30)
        hold().set()
        assert timed() == ran + 1  # the resume dropped the 2 asked before it (documented); the last one ran
        assert not [e for e in rec if isinstance(e, ev.EngineError)]
    finally:
        post({"command": "resume"})
        post({"command": "abort", "request_id": rid})
        c.unsubscribe(sub)
        tiny_server.wait_idle()


@pytest.mark.anyio
async def test_a_server_stopped_during_a_long_step_leaves_no_request_running_in_the_app(make_tiny_engine, tmp_path):
    """Trial 30c: Ctrl-C on the server while a step ran (a long prefill on a busy host) closed the event
    stream before the engine reached the shutdown's aborts: no RequestFinished came, and the attached app
    showed the requests running against a dead server for good. The stream's last frame now names the
    requests that end unfinished (state "stopped"), and the app marks them lost with a notice."""
    import threading

    held = threading.Event()
    first = EngineController.from_engine(make_tiny_engine(num_kv_blocks=32))
    server = start_server(first, api_key=None)
    remote = RemoteController(server.url, reconnect_s=(0.05, 0.2))
    app = NanoVLLMApp(remote, tutorial_path=tmp_path / "t.json", settings=PromptSettings(max_tokens=200, chat=False))
    notes = Notes()
    try:
        async with app.run_test(size=(120, 36), message_hook=notes) as pilot:
            await wait_until(pilot, lambda: app.state.ready, 30, "the server's model facts")
            # the step after a request's third token does not end (a long step on a busy host)
            first.engine.fault_injector = lambda plan: any(s.seq.num_output_tokens >= 3 for s in plan.scheduled) \
                and held.wait(30)
            await send_prompt(pilot, "Once upon a time", max_tokens=200)
            rid = app.selected
            await wait_until(pilot, lambda: app.state.requests[rid].num_output >= 3, 30, "the request to run")
            assert await asyncio.to_thread(server.stop)
            await wait_until(pilot, lambda: app.state.requests[rid].state == "lost", 30, "the request marked lost")
            assert "stopped during step" in app.state.requests[rid].error
            assert notes.find("stopped while a step ran", "warning")
            assert not app.state.active_requests
    finally:
        held.set()
        first.shutdown(timeout=5)


@pytest.mark.anyio
async def test_a_watcher_is_told_the_state_when_it_changes_not_only_at_the_heartbeat():
    """Trials 42c, 43c: an attached app's header said "running · 0 active requests" beside an IDLE Engine panel
    for seconds: the hub told a watcher the controller's state only at its heartbeat. Running with no request
    left, the controller goes idle a moment after the last step's events, and the watcher is told then."""
    import json
    from types import SimpleNamespace

    from nanovllm_core.entrypoints.event_hub import EventHub

    controller = SimpleNamespace(state="running")
    hub = EventHub(controller, heartbeat_s=60.0)  # no heartbeat within the test
    hub._loop = asyncio.get_running_loop()
    stream = hub.stream()

    def states(frame: str) -> list[str]:
        return [json.loads(line[6:])["state"] for line in frame.splitlines()
                if line.startswith("data: {\"state\"")]

    async def next_frame() -> str:
        return await asyncio.wait_for(stream.__anext__(), 20.0)

    assert states(await next_frame()) == ["running"]
    hub.publish(ev.RequestAdded(request_id="r", prompt="a", prompt_token_ids=(1,), prompt_pieces=("a",),
                                priority=0, max_tokens=1, sampling=()))
    hub.publish(ev.RequestFinished(request_id="r", step=1, index=0, finish_reason="length", stop_reason=None,
                                   output_text="b", output_token_ids=(2,), num_prompt_tokens=1, num_output_tokens=1,
                                   ttft_s=0.1, tpot_s=None, e2e_s=0.1, num_preemptions=0, num_cached_prompt_tokens=0))
    seen: list[str] = []
    for _ in range(20):  # the finish's frame, then the state once the controller has gone idle
        frame = await next_frame()
        seen += states(frame)
        if '"RequestFinished"' in frame:
            controller.state = "idle"  # as the engine thread sets it after the last step's events
        if "idle" in seen:
            break
    assert seen[-1:] == ["idle"], seen
    await stream.aclose()
