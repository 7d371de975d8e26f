"""A replay's live figures leave out the time the recorded engine was held paused, as the engine's
own figures do, and never count the replay's own pauses of its playback (issue 29)."""

from __future__ import annotations

import time

import pytest

from nanovllm_core import events as ev
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.tracing import JsonlTraceWriter
from nanovllm_tui.replay import RecordedPaused, ReplayController, load_trace, split_steps
from nanovllm_tui.state import EngineState
from tests.conftest import poll_until

HELD_S = 0.6  # each recorded pause: far above the tolerance (0.1 s) for how the live and the engine clocks differ on a busy host


@pytest.fixture(scope="module")
def paused_recording(make_tiny_engine, tmp_path_factory):
    """A session recorded with two pauses: the request arrives while the engine is paused (its wait
    for the first step is paused time), runs two single steps with a pause between them, then is
    resumed and generates to its end."""
    from nanovllm_core.engine.controller import EngineController

    path = tmp_path_factory.mktemp("trace") / "paused.jsonl"
    controller = EngineController.from_engine(make_tiny_engine(num_kv_blocks=64), start_paused=True)
    writer = JsonlTraceWriter(path)
    timed = []
    controller.subscribe(lambda e: (writer(e), isinstance(e, ev.StepTimed) and timed.append(e)), topk=0)
    try:
        rid = controller.submit("one two three", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        time.sleep(HELD_S)
        for n in (1, 2):
            controller.step(1)
            assert poll_until(lambda: len(timed) >= n), "a single step did not run"
            time.sleep(HELD_S)
        controller.resume()
        assert controller.wait(rid, timeout=120) is not None, "the recorded request did not finish"
    finally:
        controller.shutdown(timeout=5)
        writer.close()
    return path


def test_a_replay_counts_the_recorded_pauses_and_not_its_own_so_live_and_finished_figures_agree(paused_recording):
    """Before the fix the recorded pauses were dropped: the live TTFT held the HELD_S the request
    waited paused, and the TPOT the pause between its single steps. The replay is also paused
    and resumed by its watcher here: that takes no recorded time."""
    trace = load_trace(paused_recording)
    assert sum(isinstance(e, ev.EnginePaused) for e in trace) >= 1  # the recording does hold its pauses
    prologue, steps = split_steps(trace)
    assert any(isinstance(e, RecordedPaused) for e in prologue + [e for g in steps for e in g])
    replay = ReplayController(trace, start_paused=True, pace=(0.0, 0.0))
    got: list[ev.Event] = []
    played = []
    replay.subscribe(lambda e: (got.append(e), isinstance(e, ev.StepTimed) and played.append(e)))
    state = EngineState()
    checked = []

    def fold() -> None:
        while got:
            e = got.pop(0)
            if isinstance(e, ev.RequestFinished):  # the live figures just before the engine's own
                req = state.requests[e.request_id]
                checked.append(e.request_id)
                assert req.ttft == pytest.approx(e.ttft_s, abs=0.1), "live TTFT counts a recorded pause"
                assert req.tpot == pytest.approx(e.tpot_s, abs=0.1), "live TPOT counts a recorded pause"
                assert req.paused_s == pytest.approx(e.paused_s, abs=0.1)
                assert e.paused_s > HELD_S  # it did span the recorded pauses
            state.apply(e)

    try:
        for n in (1, 2, 3):  # three steps by hand while the playback is held
            replay.step(1)
            assert poll_until(lambda: len(played) >= n)
            fold()
        assert not state.paused  # a recorded pause is accounting: the playback was never shown paused by it
        replay.resume()  # the playback's own pause and resume: no recorded time
        replay.pause()
        replay.resume()
        assert poll_until(lambda: replay.state == "idle")
        fold()
    finally:
        replay.shutdown()
    assert checked, "the request never finished in the replay"

