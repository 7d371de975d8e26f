"""Trial 26b: under --connect, ``2 n`` in one burst ran the step before the server had this app's
wish to trace it (a false "steps run while this tab was hidden are not traced"); in a replay, a
layer chosen in the X-Ray promised a heatmap "(yours from the next step)" that the recording never
holds, beside a layer-0 heatmap under a "layer 2/29" header."""

from __future__ import annotations

import pytest

from tests.tui_helpers import keys_at_once, visible_tab, wait_until

pytestmark = pytest.mark.anyio


async def test_under_connect_a_step_pressed_right_after_opening_the_xray_is_traced(tiny_server, tmp_path):
    """Bug 1: the wish to trace (the event stream's ``xray=1``) reached the server only after the
    step that followed it had run: keys act in the order pressed, so ``2 n`` traces the step."""
    from nanovllm_core.sampling_params import SamplingParams
    from tests.tui_helpers import attached_and_paused

    async with attached_and_paused(tiny_server, tmp_path) as (app, pilot, notes):
        rid = app.submit_request("one two three four", SamplingParams(max_tokens=50, ignore_eos=True))
        await wait_until(pilot, lambda: rid in app.state.requests, 10, "the request")
        app.select(rid)
        for _ in range(2):  # steps on the Dashboard: untraced, as nobody watches the X-Ray
            before = app.state.step
            await pilot.press("n")
            await wait_until(pilot, lambda: app.state.step != before and not app.state.step_open, 10, "a step")
        assert not app.state.xray
        before = app.state.step
        keys_at_once(app, "2", "n")
        await wait_until(pilot, lambda: app.state.step != before and not app.state.step_open, 10, "the step")
        await pilot.pause(0.5)
        assert visible_tab(app) == "xray"
        traced = {e.step for e in app.state.xray.values()}
        assert traced == {app.state.step}, (traced, app.state.step)
        title = " ".join(app.query_one("#xray-title")._shown.plain.split())
        assert "hidden" not in title, title


def layer_moved_trace(tmp_path, from_step: int):
    """``tui_trace.jsonl.gz`` with the heatmap on layer 2 instead of layer 0 from ``from_step`` on,
    as a recording whose X-Ray chose layer 2 then."""
    import gzip
    import json

    from tests.tui_helpers import TRACE

    lines = [json.loads(line) for line in gzip.open(TRACE, "rt") if line.strip()]
    heat = ("attention", "query_pieces", "key_pieces", "key_start", "keys_per_column")
    by = {(d["step"], d["request_id"], d["layer"]): d for d in lines if d.get("type") == "LayerTrace"}
    for (step, rid, layer), d in by.items():
        if layer == 0 and step >= from_step and (step, rid, 2) in by:
            other = by[(step, rid, 2)]
            for k in heat:
                if k in d or k in other:
                    d[k], other[k] = other.get(k, d.get(k)), d.get(k, other.get(k))
            other["head"], d["head"] = d["head"], other["head"]
    path = tmp_path / "moved.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    return path


def heatmap_title(app) -> str:
    from nanovllm_tui.widgets.heatmap import AttentionHeatmap

    return " ".join(str(app.query_one(AttentionHeatmap).border_title).split())


async def step_replay(app, pilot, to_step: int) -> None:
    while app.state.step is None or app.state.step < to_step:
        before = app.state.step
        await pilot.press("n")
        await wait_until(pilot, lambda: app.state.step != before and not app.state.step_open, 10, "a replayed step")
    await pilot.pause(0.2)


async def test_a_replay_says_when_the_recording_holds_the_chosen_layers_heatmap_never_the_next_step(tmp_path):
    """Bug 2: "(yours from the next step)" at every replayed step, while the recording had layer 2's
    heatmap only from a later step (or never): a replay traces nothing new."""
    from nanovllm_tui.views.xray import XRayView
    from tests.tui_helpers import replay_app

    for trace, later in ((layer_moved_trace(tmp_path, 5), 5), (None, None)):
        app = replay_app(tmp_path, **({"trace": trace} if trace else {}))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("2")
            await wait_until(pilot, lambda: visible_tab(app) == "xray", 10, "the X-Ray tab")
            await step_replay(app, pilot, 1)
            view = app.query_one(XRayView)
            view.layer_index = 2  # as ↓ ↓ choose it
            await pilot.pause(0.2)
            title = heatmap_title(app)
            assert "next step" not in title, title
            assert "Attention · layer 0 · head 0" in title, title  # the layer it shows, named
            if later is not None:
                assert f"no heatmap of layer 2 · head 0 at step 1; its next is at step {later}" in title, title
                await step_replay(app, pilot, later)
                assert heatmap_title(app).startswith(f"Attention · layer 2 · head 0 (kv 0) · step {later}"), \
                    heatmap_title(app)
            else:
                assert "no heatmap of layer 2 · head 0 at step 1 or after" in title, title
