"""X-Ray of a request id no request has is refused with one line, at each layer that takes it: the
engine (``select_xray``, and its controller's ``EngineError``), the server's control ``xray``
(404, as abort of an unknown id) and the app (a "Not done" toast). A finished request stays
selectable, as the app selects finished rows (issue 29)."""

from __future__ import annotations

import httpx
import pytest

from nanovllm_core import events as ev
from nanovllm_core.engine.controller import EngineController
from nanovllm_core.sampling_params import SamplingParams
from tests.conftest import poll_until
from tests.tui_helpers import Notes, tiny_app, wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


def test_the_engine_refuses_an_unknown_id_and_keeps_live_and_finished_ones(make_tiny_engine):
    engine = make_tiny_engine(num_kv_blocks=32)
    with pytest.raises(ValueError, match='no running, waiting or recently finished request "nope"'):
        engine.select_xray("nope")
    engine.add_request("one two", GREEDY, request_id="r")
    rid = "r"
    engine.select_xray(rid)  # waiting
    while engine.has_unfinished_requests():
        engine.step()
    engine.select_xray(rid)  # finished: still known
    engine.add_request([10**8], GREEDY, request_id="refused")  # outside the vocabulary: rejected
    engine.select_xray("refused")
    engine.select_xray(None)


def test_the_known_finished_ids_are_bounded(make_tiny_engine, monkeypatch):
    from nanovllm_core.engine import llm_engine

    monkeypatch.setattr(llm_engine, "FINISHED_IDS_KEPT", 2)
    engine = make_tiny_engine(num_kv_blocks=32)
    for rid in ("a", "b", "c"):
        engine.add_request([10**8], GREEDY, request_id=rid)  # each rejected at once: ended
    assert list(engine.finished_ids) == ["b", "c"]
    with pytest.raises(ValueError, match='"a"'):
        engine.select_xray("a")


def test_the_controller_answers_an_unknown_id_with_an_engine_error_naming_it(make_tiny_engine):
    controller = EngineController.from_engine(make_tiny_engine(num_kv_blocks=32))
    got: list[ev.Event] = []
    controller.subscribe(got.append)
    try:
        rid = controller.submit("one two", GREEDY)
        assert controller.wait(rid, timeout=30) is not None
        controller.xray(rid)  # finished: no error
        controller.xray("nope")
        assert poll_until(lambda: any(isinstance(e, ev.EngineError) for e in got), 10)
        errors = [e for e in got if isinstance(e, ev.EngineError)]
        assert len(errors) == 1 and errors[0].request_id == "nope" and errors[0].step is None
        assert errors[0].message.startswith("xray: ") and '"nope"' in errors[0].message
    finally:
        controller.shutdown(timeout=5)


def test_the_servers_control_xray_refuses_an_unknown_id_with_404(tiny_server):
    def control(body):
        return httpx.post(tiny_server.url + "/v1/engine/control", json=body, headers=tiny_server.headers, timeout=30)

    r = control({"command": "xray", "request_id": "nope", "layer": 0, "head": 0})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["code"] == "request_not_found" and error["param"] == "request_id" and '"nope"' in error["message"]
    r = control({"command": "submit", "prompt": "one two", "params": {"max_tokens": 2}})
    rid = r.json()["request_id"]
    assert control({"command": "xray", "request_id": rid}).status_code == 200  # just submitted
    tiny_server.wait_idle()  # read on the engine thread after the request ended (the hub has its RequestFinished)
    assert control({"command": "xray", "request_id": rid}).status_code == 200  # finished: still known
    assert control({"command": "xray", "request_id": None}).status_code == 200


@pytest.mark.anyio
async def test_the_app_shows_a_refused_xray_as_not_done_and_a_finished_row_stays_selectable(tiny_llama_dir, tmp_path):
    app = tiny_app(tiny_llama_dir, tmp_path, max_tokens=2)
    notes = Notes()
    async with app.run_test(size=(120, 36), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, 60, "the tiny model")
        rid = app.submit_request("one two", GREEDY)
        await wait_until(pilot, lambda: app.state.requests[rid].state == "finished", 30, "the request to end")
        await pilot.press("escape", "2")
        await pilot.pause(0.3)
        app.select(None)
        app.select(rid)  # a finished row, selected in the X-Ray: no refusal
        await pilot.pause(0.5)
        assert not notes.find("xray:")
        app.select("nope")  # an id no request has (the table never offers one; the controller is asked)
        await wait_until(pilot, lambda: notes.find("xray:"), 10, "the refusal")
        note = notes.find("xray:")[0]
        assert note.title == "Not done" and '"nope"' in note.message and note.severity == "warning"


@pytest.mark.parametrize("live", [True, False])
def test_the_xray_hint_says_a_finished_selection_gets_no_trace_and_how_to_pick_a_running_one(live):
    """Trial 7: with a finished request selected, paused, n ran a step but the tab still said "No trace
    yet: send a prompt, or press n while paused". The hint says the selection has finished and names ] / [."""
    from nanovllm_tui.state import EngineState, RequestView
    from nanovllm_tui.views.xray import no_trace_words

    state = EngineState()
    state.ready = True
    state.requests["0"] = RequestView("0", "hi", state="finished")
    alone = no_trace_words(state, "0", live)
    assert "request 0 is finished" in alone and "press n while paused" not in alone.split(";")[0]
    assert ("send a prompt" in alone) == live and "No trace yet" not in alone
    state.requests["1"] = RequestView("1", "yo", state="running")
    two = no_trace_words(state, "0", live)
    assert "select a running one with ] or [ (running: 1)" in two
    assert no_trace_words(state, "1", live).startswith("No trace yet: X-Ray records" if live else "No trace yet: a replay")


def test_the_xray_hint_says_the_selection_was_not_in_the_step_just_run():
    """Trial 11: after n, with the selected request left out of the step (its budget used by others), the
    X-Ray still said "No trace yet: send a prompt, or press n while paused"."""
    from nanovllm_core import events as ev
    from nanovllm_tui.state import EngineState, RequestView
    from nanovllm_tui.views.xray import no_trace_words

    state = EngineState()
    state.ready = True
    state.requests["0"] = RequestView("0", "hi", state="running")
    state.requests["1"] = RequestView("1", "yo", state="waiting")
    entry = ev.ScheduledEntry(request_id="0", seq_id=0, index=0, kind="decode", num_tokens=1, start=5, prompt_len=5,
                              total_len=6, num_cached_tokens=0, samples=True, priority=0)
    state.apply(ev.StepPlanned(step=7, token_budget=1, num_batched_tokens=1, scheduled=(entry,), preempted=(),
                               admitted=(), waiting=(), running=(), max_num_seqs=2))
    general = "No trace yet: X-Ray records the selected request's next step"
    assert no_trace_words(state, "1", True).startswith(general)  # the step is still running
    state.step_open = False  # (its StepTimed)
    state.paused = True
    said = no_trace_words(state, "1", True)
    assert said == ("No trace yet: request 1 was not in step 7 (it is waiting to be admitted); X-Ray records the next "
                    "step that runs it (press n to run a step).")
    assert no_trace_words(state, "0", True).startswith(general)  # it was in the step


def test_with_trace_xray_no_sentence_says_a_step_is_traced_only_while_the_tab_shows():
    """fix29x's note: with ``--trace-xray`` the app traces every step whichever tab shows, but the X-Ray's
    sentences said steps are traced "while this tab is open" and that steps run while it was hidden are not."""
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.views.xray import no_trace_words, trace_age
    from tests.test_narrator import added

    state = EngineState()
    state.ready, state.engine_state = True, "running"
    state.apply(added("0"))
    assert "while this tab is open" in no_trace_words(state, "0", True)  # without the flag: true, and said
    flagged = no_trace_words(state, "0", True, every_step=True)
    assert "tab is open" not in flagged and "every step (--trace-xray)" in flagged, flagged
    state.timings.append(ev.StepTimed(step=9, wall_time_s=0.02, num_tokens=1, num_prefill_tokens=0,
                                      num_decode_tokens=1, prefill_tokens_per_s=0.0, decode_tokens_per_s=50.0,
                                      kv_bytes_used=0, kv_bytes_total=0, num_running=1, num_waiting=0))
    assert "hidden are not traced" in trace_age(state, 7, True)
    assert trace_age(state, 7, True, every_step=True) == "captured 2 steps ago, step 9 has ended"
