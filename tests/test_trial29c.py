"""Trial 29c: with ``--trace-xray`` the app recorded every step's X-Ray traces but its X-Ray tab,
opened afterwards, said "No trace yet ... press n" (its own view asked for traces only while the tab
showed, and the recorder's traces never reached it); an app attached mid-request recorded a step of
a request its recording never introduced."""

from __future__ import annotations

import pytest

from tests.tui_helpers import attached_and_paused, wait_until

pytestmark = pytest.mark.anyio


def xray_title(app) -> str:
    return " ".join(app.query_one("#xray-title")._shown.plain.split())


async def steps(pilot, app, n: int) -> None:
    for _ in range(n):
        before = app.state.step
        await pilot.press("n")
        await wait_until(pilot, lambda: app.state.step != before and not app.state.step_open, 10, "a step")


async def test_attached_app_with_trace_xray_shows_the_traces_it_recorded(tiny_server, tmp_path):
    """Bug 2 under --connect: steps run on the Dashboard are recorded with their layers, and the
    X-Ray opened after them shows the newest one, not "No trace yet"."""
    from nanovllm_core.sampling_params import SamplingParams
    from nanovllm_core.tracing import JsonlTraceWriter, read_jsonl

    path = tmp_path / "conn.jsonl"
    writer = JsonlTraceWriter(path)
    async with attached_and_paused(tiny_server, tmp_path, recorders=[writer], record_xray=True) as (app, pilot, _):
        rid = app.submit_request("one two three four", SamplingParams(max_tokens=20, ignore_eos=True))
        await wait_until(pilot, lambda: rid in app.state.requests, 10, "the request")
        await steps(pilot, app, 3)
        await pilot.pause(0.5)
        await pilot.press("2")
        await pilot.pause(0.3)
        title = xray_title(app)
        writer.close()
        traced = {e.step for e in read_jsonl(path) if type(e).__name__ == "LayerTrace"}
        assert app.state.step in traced, (traced, app.state.step)
        assert "No trace yet" not in title, title
        assert f"step {app.state.step}" in title, title
        app.controller.abort(rid)


async def test_local_app_with_trace_xray_shows_the_traces_it_recorded(tiny_llama_dir, tmp_path):
    """Bug 2 on a local engine (same kind): the X-Ray opened after steps recorded with
    --trace-xray shows the newest traced step."""
    from nanovllm_core.tracing import JsonlTraceWriter
    from tests.tui_helpers import send_prompt, tiny_app

    writer = JsonlTraceWriter(tmp_path / "local.jsonl")
    app = tiny_app(tiny_llama_dir, tmp_path, start_paused=True, max_tokens=20, recorders=[writer],
                   record_xray=True)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, 60, "the engine")
        await send_prompt(pilot, "one two three four")
        await wait_until(pilot, lambda: app.state.requests, 10, "the request")
        await pilot.press("escape")
        await steps(pilot, app, 3)
        await pilot.pause(0.3)
        await pilot.press("2")
        await pilot.pause(0.3)
        title = xray_title(app)
        assert "No trace yet" not in title, title
        assert f"step {app.state.step}" in title, title


def attach_and_record(server, path):
    """What an app started with ``--connect URL --trace path`` records on attaching: its recorder
    subscribes to the controller before the stream opens; returns the events, read back."""
    from nanovllm_core.tracing import JsonlTraceWriter, read_jsonl
    from nanovllm_tui.remote import RemoteController
    from tests.conftest import poll_until

    writer = JsonlTraceWriter(path)
    remote = RemoteController(server.url, server.api_key)
    remote.subscribe(writer, topk=5, blocks=True, xray=False)
    remote.start()
    try:
        assert poll_until(lambda: remote.connected and writer.count >= 3, 10)
        poll_until(lambda: False, 0.5)  # let the snapshot arrive whole
    finally:
        remote.shutdown(timeout=5)
        writer.close()
    return read_jsonl(path)


def introduced_before_their_steps(events) -> list[str]:
    """Problems: a step that schedules a request the recording has not introduced (no RequestAdded before)."""
    added, bad = set(), []
    for e in events:
        if type(e).__name__ == "RequestAdded":
            added.add(e.request_id)
        elif type(e).__name__ == "StepPlanned":
            bad += [f"step {e.step} runs {s.request_id}" for s in e.scheduled if s.request_id not in added]
    return bad


def test_recording_attached_after_a_request_ended_introduces_the_newest_steps_requests(tiny_server, tmp_path):
    """Bug 3: the newest step ran a request aborted after it (an app quit while its prompt ran):
    the attach snapshot sent that step but not the request, so the recording (and its replay) began
    with a decode of a request it never introduced. Same kind: one that finished in that step."""
    from nanovllm_core.sampling_params import SamplingParams
    from tests.conftest import poll_until

    ctl = tiny_server.controller
    ctl.pause()
    try:
        long_id = ctl.submit("one two three four", SamplingParams(max_tokens=30, ignore_eos=True))
        short_id = ctl.submit("five six seven", SamplingParams(max_tokens=2, ignore_eos=True))
        for _ in range(2):  # prefill both, then the short one's second token ends it
            ctl.step()
        assert poll_until(lambda: ctl.steps_pending() == 0, 10)
        poll_until(lambda: False, 0.3)  # the steps' events reach the server's log
        ctl.abort(long_id)  # between steps, as an app that quits while its prompt runs
        poll_until(lambda: False, 0.3)
        events = attach_and_record(tiny_server, tmp_path / "late.jsonl")
    finally:
        ctl.resume()
    assert not introduced_before_their_steps(events), introduced_before_their_steps(events)
    ended = {e.request_id for e in events if type(e).__name__ == "RequestFinished"}
    steps = [e for e in events if type(e).__name__ == "StepPlanned"]
    assert steps and {s.request_id for s in steps[-1].scheduled} <= ended
    assert {long_id, short_id} <= ended


def test_recording_attached_mid_request_introduces_it_first(tiny_server, tmp_path):
    """Bug 3's other case: a request still running when the app attaches is introduced (its
    RequestAdded and tokens so far) before the first recorded step that runs it."""
    from nanovllm_core.sampling_params import SamplingParams
    from tests.conftest import poll_until

    ctl = tiny_server.controller
    ctl.pause()
    try:
        rid = ctl.submit("one two three four", SamplingParams(max_tokens=30, ignore_eos=True))
        for _ in range(3):
            ctl.step()
        assert poll_until(lambda: ctl.steps_pending() == 0, 10)
        poll_until(lambda: False, 0.3)
        events = attach_and_record(tiny_server, tmp_path / "mid.jsonl")
        ctl.abort(rid)
    finally:
        ctl.resume()
    assert not introduced_before_their_steps(events), introduced_before_their_steps(events)
    assert any(type(e).__name__ == "StepPlanned" for e in events)


async def test_attached_app_with_trace_keeps_the_block_snapshots_it_records(tiny_server, tmp_path):
    """Bug 2's kind for block snapshots: docs/app.md says the app asks for them "all the time while
    --trace records"; an attached app's views got them only while the Blocks or Narrator tab showed,
    so steps run on the Dashboard were narrated without the KV bytes and tables the file held."""
    from nanovllm_core.sampling_params import SamplingParams
    from nanovllm_core.tracing import JsonlTraceWriter

    writer = JsonlTraceWriter(tmp_path / "blocks.jsonl")
    async with attached_and_paused(tiny_server, tmp_path, recorders=[writer]) as (app, pilot, _):
        rid = app.submit_request("one two three four", SamplingParams(max_tokens=20, ignore_eos=True))
        await wait_until(pilot, lambda: rid in app.state.requests, 10, "the request")
        await steps(pilot, app, 2)
        await wait_until(pilot, lambda: app.state.blocks is not None and app.state.blocks.step == app.state.step,
                         5, lambda: f"the block snapshot of step {app.state.step}, have {app.state.blocks}")
        app.controller.abort(rid)
