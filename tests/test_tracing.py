"""Trace recorders closed while the engine still sends (trial 14a): late events are dropped, the
step keeps running, and the recorder says once what the recording lacks."""

from __future__ import annotations

import json
import threading

import pytest

from nanovllm_core import events as ev
from nanovllm_core.engine.controller import EngineController
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.tracing import ChromeTraceRecorder, JsonlTraceWriter


def close_inside_step(engine, recorders, step: int):
    """Subscribe ``recorders``, then a listener that closes them as step ``step`` begins (after they
    recorded its StepPlanned), as the app's quit does while the engine thread runs that step."""

    def closer(event: ev.Event) -> None:
        if isinstance(event, ev.StepPlanned) and event.step == step:
            for r in recorders:
                r.close()

    for r in recorders:
        engine.subscribe(r, topk=5, blocks=True, xray=True)
    engine.subscribe(closer, topk=0, blocks=False)


def test_a_trace_closed_inside_a_step_drops_the_rest_and_the_step_finishes(make_tiny_engine, tmp_path):
    from nanovllm_tui.replay import load_trace

    engine = make_tiny_engine(num_kv_blocks=32)
    writer, chrome = JsonlTraceWriter(tmp_path / "run.jsonl"), ChromeTraceRecorder(tmp_path / "run.json")
    writer(EngineController.ready_event(engine))  # the model's facts first, as nanovllm --trace writes them
    close_inside_step(engine, [writer, chrome], step=1)
    engine.add_request("Hello there", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()  # before: ValueError (I/O operation on closed file), three times chained
    finished = [o for o in outputs if o.finished]
    assert len(finished) == 1 and finished[0].outputs[0].finish_reason == "length"  # not "error"
    assert writer.dropped > 0 and writer.unfinished_step == 1
    assert writer.ended_early() == (f"the trace {writer.path} ends during step 1, which was still running when the "
                                    "recording closed: --replay plays the steps before it")
    assert chrome.ended_early().startswith(f"the trace {chrome.path} ends during step 1")
    assert json.loads(chrome.path.read_text())["traceEvents"]
    trace = load_trace(writer.path)  # the recording still replays, up to the step it stopped in
    assert trace.cut_step == 1 and [e.step for e in trace if isinstance(e, ev.StepTimed)] == [0]


def _traced_run(make_tiny_engine, tmp_path) -> JsonlTraceWriter:
    """A 2-token request run to its end on a tiny engine, recorded into ``run.jsonl`` (the writer left open)."""
    engine = make_tiny_engine(num_kv_blocks=32)
    writer = JsonlTraceWriter(tmp_path / "run.jsonl")
    engine.subscribe(writer, topk=5, blocks=True)
    engine.add_request("Hello", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return writer


def test_a_trace_closed_between_steps_ends_whole_and_says_nothing(make_tiny_engine, tmp_path):
    writer = _traced_run(make_tiny_engine, tmp_path)
    writer.close()
    writer.close()  # twice: nothing more
    assert writer.ended_early() is None and writer.dropped == 0


def test_an_open_trace_holds_every_whole_step_while_the_engine_idles(make_tiny_engine, tmp_path):
    """Trial 36c: an attached app's --trace kept its last StepTimed in the file's buffer until the next event or
    quit; a copy taken while the app idled replayed "the recording stopped during step N". Each step's end
    (and any event between steps) now reaches the file at once."""
    from nanovllm_core.tracing import decode_event

    writer = _traced_run(make_tiny_engine, tmp_path)
    on_disk = [decode_event(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]  # not closed
    timed = [e.step for e in on_disk if isinstance(e, ev.StepTimed)]
    planned = [e.step for e in on_disk if isinstance(e, ev.StepPlanned)]
    assert timed and timed == planned and any(isinstance(e, ev.RequestFinished) for e in on_disk), on_disk
    writer.close()


def test_late_events_after_close_are_counted_and_said(tmp_path):
    writer = JsonlTraceWriter(tmp_path / "t.jsonl")
    writer(ev.EnginePaused(step=3))
    writer.close()
    writer(ev.EngineResumed(step=3))  # a remote app's reader thread, one event late
    assert writer.count == 1 and writer.dropped == 1
    assert writer.ended_early().endswith("ends early: 1 event that came after the recording closed is not in it")


def test_a_write_that_fails_ends_the_recording_and_close_says_why(make_tiny_engine, tmp_path):
    engine = make_tiny_engine(num_kv_blocks=32)
    writer = JsonlTraceWriter(tmp_path / "run.jsonl")

    class FullDisk:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    writer._f = FullDisk()
    engine.subscribe(writer, topk=0, blocks=False)
    engine.add_request("Hello", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()  # the step is not failed by its listener's disk
    assert [o.outputs[0].finish_reason for o in outputs if o.finished] == ["length"]
    with pytest.raises(OSError, match="No space left"):
        writer.close()


def test_closing_from_another_thread_while_the_engine_writes_loses_no_line(tmp_path):
    writer = JsonlTraceWriter(tmp_path / "run.jsonl")
    sent = 0

    def engine_thread():
        nonlocal sent
        for i in range(20000):
            writer(ev.EnginePaused(step=i))
            sent += 1

    t = threading.Thread(target=engine_thread)
    t.start()
    writer.close()
    t.join()
    lines = (tmp_path / "run.jsonl").read_text().splitlines()
    assert len(lines) == writer.count and writer.count + writer.dropped == sent == 20000
    assert all(ev.from_json(line) for line in lines)  # every line whole
