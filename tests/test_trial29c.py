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
