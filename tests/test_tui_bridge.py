"""The bridge, the replay and the background starter: what stands between the engine thread and the UI."""

from __future__ import annotations

import threading
import time
import types
from pathlib import Path

import pytest

from nanovllm_core import events as ev
from nanovllm_tui.bridge import EngineBridge
from nanovllm_tui.replay import NO_NEW_PROMPTS, ReplayController, load_trace
from nanovllm_tui.starter import BackgroundController
from tests.conftest import poll_until

TRACE = Path(__file__).parent / "data" / "tui_trace.jsonl.gz"


class Target:
    """Stands in for the app: counts the EventsReady messages it is sent (from any thread)."""

    def __init__(self):
        self.posted = 0

    def post_message(self, message):
        assert isinstance(message, EngineBridge.EventsReady)
        self.posted += 1
        return True


def blocks(step):
    return ev.BlocksChanged(step=step, block_size=4, bytes_per_block=1, states="uf", ref_counts=(1, 0), tables=())


def trace(step, layer):
    return ev.LayerTrace(step=step, request_id="0", layer=layer, num_layers=2, tensors=(), ops=(), num_heads=1,
                         num_kv_heads=1, head_dim=1, hidden_size=1, kv_bytes_per_token=8)


def test_one_wake_up_message_per_drain_however_many_events():
    target = Target()
    bridge = EngineBridge(target)
    for step in range(50):
        bridge(ev.StepTimed(step=step, wall_time_s=0.1, num_tokens=1, num_prefill_tokens=0, num_decode_tokens=1,
                            prefill_tokens_per_s=0, decode_tokens_per_s=10, kv_bytes_used=0, kv_bytes_total=1,
                            num_running=1, num_waiting=0))
    assert target.posted == 1 and len(bridge.drain()) == 50
    bridge(blocks(51))
    assert target.posted == 2


def test_only_each_steps_newest_block_snapshot_is_kept_in_its_place():
    """Trial 25c: a step whose snapshot a later step's had replaced was narrated without its block tables."""
    bridge = EngineBridge(Target())
    bridge(blocks(1))
    bridge(ev.EnginePaused(step=1))
    bridge(blocks(1))  # the same step's pool again (an abort while paused): it supersedes the first
    bridge(blocks(2))
    bridge(ev.EngineResumed(step=2))
    kinds = [(type(e).__name__, e.step) for e in bridge.drain()]
    assert kinds == [("EnginePaused", 1), ("BlocksChanged", 1), ("BlocksChanged", 2), ("EngineResumed", 2)]


def test_layer_traces_of_an_older_step_are_dropped():
    bridge = EngineBridge(Target())
    bridge(trace(1, 0))
    bridge(trace(1, 1))
    bridge(trace(2, 0))
    assert [(e.step, e.layer) for e in bridge.drain()] == [(2, 0)]


def test_a_bridge_that_does_not_coalesce_keeps_every_steps_snapshot_and_traces():
    bridge = EngineBridge(Target(), coalesce=False)  # a Tutorial demonstration's: its notes tell every step
    for e in (blocks(1), trace(1, 0), blocks(2), trace(2, 0)):
        bridge(e)
    assert [(type(e).__name__, e.step) for e in bridge.drain()] == [
        ("BlocksChanged", 1), ("LayerTrace", 1), ("BlocksChanged", 2), ("LayerTrace", 2)]


def test_events_from_another_thread_all_arrive():
    bridge = EngineBridge(Target())
    n = 2000

    def engine():
        for i in range(n):
            bridge(ev.EnginePaused(step=i))

    thread = threading.Thread(target=engine)
    thread.start()
    got = []
    while thread.is_alive() or len(got) < n:
        got.extend(bridge.drain())
        time.sleep(0.001)
    thread.join()
    assert [e.step for e in got] == list(range(n))


def test_delay_keeps_drains_to_the_frame_rate():
    bridge = EngineBridge(Target(), fps=10)
    bridge.drain()
    assert 0.05 < bridge.delay() <= 0.1


class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, e):
        self.events.append(e)

    def wait_for(self, cond, timeout=5.0):
        return poll_until(cond, timeout, interval=0.01)


@pytest.fixture
def replay():
    controllers = []

    def build(**kw):
        c = ReplayController(load_trace(TRACE), **kw)
        controllers.append(c)
        rec = Recorder()
        c.subscribe(rec)
        return c, rec

    yield build
    for c in controllers:
        assert c.shutdown(timeout=1.0)


def test_paused_replay_plays_exactly_the_steps_asked_for(replay):
    c, rec = replay(start_paused=True)
    assert rec.wait_for(lambda: any(isinstance(e, ev.ModelLoading) for e in rec.events))
    time.sleep(0.1)
    assert not any(isinstance(e, ev.StepPlanned) for e in rec.events)
    c.step(2)
    assert rec.wait_for(lambda: c.steps_played == 2)
    time.sleep(0.1)
    assert [e.step for e in rec.events if isinstance(e, ev.StepTimed)] == [0, 1]


def test_running_replay_reaches_the_end_and_goes_idle(replay):
    c, rec = replay(pace=(0.0, 0.01))
    assert rec.wait_for(lambda: c.state == "idle")
    assert sum(isinstance(e, ev.RequestFinished) for e in rec.events) == 3


def test_replay_refuses_new_prompts_and_aborts_with_events(replay):
    c, rec = replay(start_paused=True)
    rid = c.submit("Hello")
    c.abort("0")
    assert rec.wait_for(lambda: any(isinstance(e, ev.EngineError) for e in rec.events))
    rejected = [e for e in rec.events if isinstance(e, ev.RequestRejected)]
    assert rejected[0].request_id == rid and rejected[0].reason == NO_NEW_PROMPTS


def test_a_file_that_is_not_a_trace_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "Nope"}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_trace(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no engine steps"):
        load_trace(empty)


class FakeController:
    """Records the commands it is given, in order."""

    def __init__(self):
        self.calls = []

    def subscribe(self, callback, topk=5, xray=False, blocks=True):
        self.calls.append(("subscribe", topk, xray, blocks))
        return types.SimpleNamespace(topk=topk, xray=xray, blocks=blocks)

    def submit(self, prompt, params=None, priority=0, request_id=None, fit_context=False):
        self.calls.append(("submit", prompt, request_id))
        return request_id

    def pause(self):
        self.calls.append(("pause",))

    def shutdown(self, timeout=1.0):
        self.calls.append(("shutdown",))
        return True


def test_commands_given_before_the_engine_exists_reach_it_in_order():
    gate, fake = threading.Event(), FakeController()
    starter = BackgroundController(lambda: gate.wait(5) and fake)
    starter.start()
    sub = starter.subscribe(lambda e: None, topk=5, xray=False, blocks=False)
    rid = starter.submit("Hello")
    starter.pause()
    sub.xray = True  # changed while waiting: the real subscription is made with it
    assert starter.state == "loading" and rid == "req-0" and fake.calls == []
    gate.set()
    assert Recorder().wait_for(lambda: starter.real is fake)
    assert fake.calls == [("subscribe", 5, True, False), ("submit", "Hello", "req-0"), ("pause",)]
    sub.blocks = True  # changed afterwards: forwarded
    assert sub.real.blocks is True


def test_an_engine_that_cannot_be_built_is_a_failed_load():
    def broken():
        raise RuntimeError("no such device")

    starter = BackgroundController(broken)
    rec = Recorder()
    starter.subscribe(rec)
    starter.start()
    assert rec.wait_for(lambda: starter.state == "failed" and rec.events)  # (the state turns first, then the event)
    assert starter.load_error == "no such device"
    assert [e.message for e in rec.events] == ["model failed to load: no such device"]
    starter.submit("Hello")
    assert isinstance(rec.events[-1], ev.RequestRejected)


def test_a_prompt_sent_while_an_engine_that_cannot_be_built_loads_is_rejected_not_dropped():
    """A prompt queued while the engine was being built waited for good when the build failed: no
    rejection, no finish (a request silently dropped; the app showed it submitted forever)."""
    go = threading.Event()

    def broken():
        go.wait(10)
        raise RuntimeError("no such device")

    starter = BackgroundController(broken)
    rec = Recorder()
    starter.subscribe(rec)
    starter.start()
    rid = starter.submit("Hello")  # queued: the engine does not exist yet
    go.set()
    assert rec.wait_for(lambda: any(isinstance(e, ev.RequestRejected) for e in rec.events))
    rejected = [e for e in rec.events if isinstance(e, ev.RequestRejected)]
    assert [(e.request_id, e.reason) for e in rejected] == [(rid, "no model loaded: no such device")]
    assert isinstance(rec.events[0], ev.EngineError)  # the failure first, then what it means for the prompt


def test_an_event_after_the_apps_loop_has_closed_is_kept_quietly():
    """The app quit inside a step: Textual's post_message from the engine thread meets a closed event
    loop (RuntimeError). The engine's step must not fail for it (a listener's error fails the step)."""

    class Gone:
        def post_message(self, message):
            raise RuntimeError("Event loop is closed")

    bridge = EngineBridge(Gone())
    bridge(ev.EnginePaused(step=1))  # before: RuntimeError into the engine's step
    assert bridge.received == 1
