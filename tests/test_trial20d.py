"""Newcomer trial 20d: the server's shutdown ends every request it holds, and each watcher of the
event stream (or in-process subscriber) gets the top choices it asked for, not another's."""

from __future__ import annotations

import threading

import httpx

from nanovllm_core import events as ev
from nanovllm_core.engine.controller import EngineController
from tests.conftest import poll_until
from tests.serve_helpers import start_server


class Watcher:
    """``GET /v1/engine/events`` read on its own thread until the server closes the stream."""

    def __init__(self, server, query: str = "") -> None:
        self.events: list[ev.Event] = []
        self.opened = threading.Event()
        self.closed = threading.Event()
        self.url = f"{server.url}/v1/engine/events{query}"
        self.headers = server.headers
        threading.Thread(target=self._read, daemon=True).start()
        assert self.opened.wait(30)

    def _read(self) -> None:
        try:
            with httpx.stream("GET", self.url, headers=self.headers, timeout=60) as r:
                self.opened.set()
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"type"' in line:
                        self.events.append(ev.from_json(line[6:]))
        finally:
            self.opened.set()
            self.closed.set()

    def finished(self) -> dict[str, ev.RequestFinished]:
        return {e.request_id: e for e in self.events if isinstance(e, ev.RequestFinished)}


def control(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/engine/control", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_shutdown_publishes_an_abort_for_every_request_whoever_submitted_it(make_tiny_engine):
    """Trial 20d, bug 2: Ctrl-C ended the /v1/completions requests with RequestFinished(abort) but not
    those submitted through /v1/engine/control (every prompt typed in an attached app): the apps kept a
    "running" request holding KV blocks while the server was down. Running, waiting and n>1 requests
    from control, a completion stream and a chat request all end before the event stream closes, and
    the last one says 0 blocks in use."""
    controller = EngineController.from_engine(make_tiny_engine(num_kv_blocks=64), start_paused=True)
    server = start_server(controller, api_key=None)
    watcher = Watcher(server, "?blocks=1")
    streams: list[threading.Thread] = []
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            control(http, command="submit", prompt="Once upon a time", request_id="ctl1x",
                    params={"max_tokens": 300, "ignore_eos": True})
            control(http, command="submit", prompt="Two of them", request_id="app-n2",
                    params={"max_tokens": 300, "n": 2, "ignore_eos": True})
            assert poll_until(lambda: {"ctl1x", "app-n2"} <= server.http.app.state.server.hub.live_request_ids(), 30)
            control(http, command="step", n=2)  # both prefilled and decoding: they hold blocks
            assert poll_until(lambda: sum(isinstance(e, ev.StepTimed) for e in watcher.events) >= 2, 30)
            control(http, command="submit", prompt="Still waiting", request_id="app-wait", params={"max_tokens": 5})
            for path, body in (("/v1/completions", {"prompt": "Hello there", "max_tokens": 300, "stream": True}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 300})):
                def post(path=path, body=body) -> None:
                    try:
                        httpx.post(server.url + path, json=body, timeout=60)
                    except httpx.HTTPError:
                        pass
                streams.append(threading.Thread(target=post, daemon=True))
                streams[-1].start()
            assert poll_until(lambda: len(server.http.app.state.server.hub.live_request_ids()) == 5, 30)
            assert controller.engine.block_manager.num_used_blocks > 0
        assert server.stop(timeout=30)
        assert watcher.closed.wait(30)
        finished = watcher.finished()
        assert len(finished) == 5, sorted(finished)
        assert {"ctl1x", "app-n2", "app-wait"} <= set(finished)
        assert all(f.finish_reason == "abort" for f in finished.values())
        assert [s.finish_reason for s in finished["app-n2"].samples] == ["abort", "abort"]
        last = [e for e in watcher.events if isinstance(e, ev.RequestFinished)][-1]
        assert last.kv_blocks_used == 0
        blocks = [e for e in watcher.events if isinstance(e, ev.BlocksChanged)][-1]
        assert "u" not in blocks.states
    finally:
        controller.shutdown(timeout=5)
        for t in streams:
            t.join(10)
