"""Trial 21d: the X-Ray said why it showed another request's (or no) trace with a reason false of
the step it showed. A request that ran while the X-Ray tab was hidden got "req-6 is finished ...
no step of it will capture layer 2" of a step 66 captured before req-6 ran (steps 67-116), and
nothing said the capture was 50 steps old."""

from __future__ import annotations

import pytest

from tests.tui_helpers import send_prompt, tiny_app, visible_tab, wait_until

pytestmark = pytest.mark.anyio


async def test_the_xray_says_how_old_its_capture_is_and_why_a_request_run_while_hidden_has_none(tiny_llama_dir,
                                                                                                 tmp_path):
    app = tiny_app(tiny_llama_dir, tmp_path, start_paused=True, max_tokens=3)
    async with app.run_test(size=(160, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the model")
        await send_prompt(pilot, "one two three")
        first = app.selected
        await pilot.press("escape", "2")
        await wait_until(pilot, lambda: visible_tab(app) != "dashboard", 10, "the X-Ray tab")
        await pilot.press("n")
        await wait_until(pilot, lambda: app.state.xray and not app.state.step_open, 30, "a traced step")
        traced = next(iter(app.state.xray.values())).step

        await pilot.press("1")  # the X-Ray hidden: the steps that run now are not traced
        await send_prompt(pilot, "four five six")
        second = app.selected
        assert second != first
        await pilot.press("escape")
        for _ in range(12):
            if not any(r.live for r in app.state.requests.values()):
                break
            await pilot.press("n")
            await wait_until(pilot, lambda: not app.state.step_open, 30, "the step")
        assert not any(r.live for r in app.state.requests.values())
        newest = app.state.timings[-1].step  # second ran from the step after the traced one to the newest

        await pilot.press("2")
        await pilot.pause(0.3)
        assert next(iter(app.state.xray.values())).step == traced  # nothing traced while it was hidden
        title = " ".join(str(app.query_one("#xray-title").render()).split())
        assert f"step {traced} captured {newest - traced} steps ago" in title, title
        assert (f"{second} ran in steps {traced + 1}-{newest}, after step {traced}, while this tab was "
                "hidden") in title, title
        assert "so steps trace a running request" not in title, title

        await pilot.press("down")  # a layer the step did not capture: the same, in the layer's words
        await pilot.pause(0.3)
        title = " ".join(str(app.query_one("#xray-title").render()).split())
        assert f"Step {traced} was captured {newest - traced} steps ago" in title, title
        assert f"Request {second} ran in steps {traced + 1}-{newest}, after step {traced}" in title, title
        assert "no step of it will capture layer" not in title, title
        req = app.state.requests[second]
        assert (req.first_step, req.last_step) == (traced + 1, newest)

        app.select(first)  # first ran in the traced step and after it: its own trace, then old
        await pilot.pause(0.3)
        title = " ".join(str(app.query_one("#xray-title").render()).split())
        assert f"Step {traced} was captured" in title, title


def test_the_xray_reasons_are_true_of_the_step_shown_also_in_a_replay():
    """Each "why" of ``other_request_words`` for a finished selection, by when it ran against the step shown."""
    from types import SimpleNamespace

    from nanovllm_tui.views.xray import other_request_words, trace_age

    trace = SimpleNamespace(request_id="req-8", step=66)
    state = SimpleNamespace(requests={}, step=116, paused=True, pending=None, plan=None,
                            timings=[SimpleNamespace(step=116)])
    before = SimpleNamespace(live=False, state="finished", first_step=20, last_step=60)
    same = SimpleNamespace(live=False, state="finished", first_step=60, last_step=66)
    after = SimpleNamespace(live=False, state="aborted", first_step=67, last_step=116)
    state.requests = {"req-1": before, "req-2": same, "req-3": after}
    assert "req-1 is finished, so steps trace a running request" in other_request_words(state, trace, "req-1", True)
    assert "req-2 ran in step 66 but was chosen after it was traced; req-2 is finished now" in \
        other_request_words(state, trace, "req-2", True)
    assert "req-3 ran in steps 67-116, after step 66, while this tab was hidden" in \
        other_request_words(state, trace, "req-3", True)
    replayed = other_request_words(state, trace, "req-3", False)
    assert "req-3 ran in steps 67-116, after step 66, and the recording holds no trace of them" in replayed
    assert "hidden" not in replayed.split("(a step")[0]
    assert trace_age(state, 66, True) == ("captured 50 steps ago, step 116 has ended; steps run while this tab was "
                                          "hidden are not traced, the next step will be")
    assert trace_age(state, 66, False) == "recorded 50 steps before step 116; the recording holds no newer trace"
    assert trace_age(state, 116, True) == ""
