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


def test_each_subscriber_gets_the_top_choices_and_detail_it_asked_for(make_tiny_engine):
    """Trial 20d, bug 3, in process: the engine computes the most top choices any subscriber asked for,
    and sent that list to every subscriber; each now gets its own topk. (Block maps and layer traces
    made for one subscriber reach the others in this process: the teaching views use them.)"""
    from nanovllm_core import LLM, SamplingParams

    engine = make_tiny_engine(num_kv_blocks=64)
    got: dict[str, list[ev.Event]] = {"none": [], "two": [], "seven": []}
    engine.subscribe(got["none"].append, topk=0, blocks=False)
    engine.subscribe(got["two"].append, topk=2, blocks=False)
    engine.subscribe(got["seven"].append, topk=7, blocks=True)
    LLM.from_engine(engine).generate(["Once upon a time"], SamplingParams(max_tokens=4, ignore_eos=True),
                                     use_tqdm=False)
    for name, k in (("none", 0), ("two", 2), ("seven", 7)):
        tokens = [e for e in got[name] if isinstance(e, ev.TokenSampled)]
        assert len(tokens) == 4 and all(len(t.top) == k and len(t.model_top) <= k for t in tokens), name
    assert all(any(isinstance(e, ev.BlocksChanged) for e in got[name]) for name in got)


def test_each_event_stream_watcher_gets_the_topk_it_asked_for(make_tiny_engine):
    """Trial 20d, bug 3: /v1/engine/events?topk=0 got the 5 an attached app asked for, topk=2 got 10:
    every watcher got the largest topk any watcher asked for. Each now gets its own number (default 0),
    in the live stream and in the snapshot a watcher joining mid-request gets."""
    controller = EngineController.from_engine(make_tiny_engine(num_kv_blocks=64), start_paused=True)
    server = start_server(controller, api_key=None)
    try:
        watchers = {k: Watcher(server, "" if k is None else f"?topk={k}") for k in (None, 0, 2, 10)}
        hub = server.http.app.state.server.hub
        assert poll_until(lambda: hub.num_watchers == 4 and hub._sub.topk == 10, 30)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            control(http, command="submit", prompt="Once upon a time", request_id="topk-run",
                    params={"max_tokens": 50, "ignore_eos": True})
            assert poll_until(lambda: "topk-run" in hub.live_request_ids(), 30)
            control(http, command="step", n=3)
            three = lambda w: sum(isinstance(e, ev.TokenSampled) for e in w.events) >= 3  # noqa: E731
            assert poll_until(lambda: all(three(w) for w in watchers.values()), 30)
            late = Watcher(server, "?topk=1")  # joins mid-request: the snapshot holds the tokens so far
            assert poll_until(lambda: three(late), 30)
            control(http, command="resume")
        assert server.stop(timeout=30)
        for k, w in [*watchers.items(), (1, late)]:
            assert w.closed.wait(30)
            tokens = [e for e in w.events if isinstance(e, ev.TokenSampled)]
            assert tokens and {len(t.top) for t in tokens} == {k or 0}, (k, {len(t.top) for t in tokens})
            assert all(len(t.model_top) <= (k or 0) for t in tokens)
    finally:
        controller.shutdown(timeout=5)
