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
