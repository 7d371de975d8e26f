"""Newcomer trial 16a: the pausing frame drew "paused" ahead of the last step's events, the Tutorial's
``a`` replaced a saved quiz answer, the cut replay's end counted requests whose names fit, and a prompt
of spaces was refused as empty."""

from __future__ import annotations

import pytest

from nanovllm_core import events as ev
from nanovllm_tui.state import EngineState
from nanovllm_tui.widgets.status_header import StatusHeader, unfinished_text

pytestmark = pytest.mark.anyio


def header_line(state: EngineState, width: int, replay: bool = True) -> str:
    header = StatusHeader()
    shown = []
    header.show_content = shown.append
    header.show(state, replay=replay, width=width)
    return shown[-1].plain


def test_a_cut_replays_end_names_the_unfinished_requests_where_they_fit_at_120_columns():
    """At 120 columns the header said "2 requests unfinished" while "requests 0 and 1 unfinished" fit once
    the weights' formats (a less needed part) went; docs/app.md: the count only where there is no room."""
    state = EngineState()
    state.apply(ev.ModelLoading(stage="ready", done=1, total=1, ready=True, model_name="SmolLM2-135M-Instruct",
                                device="cpu", dtype="float32",
                                model_info=(("quantization", "gguf"), ("weight_kinds", "q4_1+q8_0"))))
    state.engine_state, state.step, state.unfinished = "idle", 4, ["0", "1"]
    line = header_line(state, 118)  # 120 columns less the header's padding
    assert "● recording ended · step 4 · requests 0 and 1 unfinished" in line and len(line) <= 118, line
    assert "SmolLM2-135M-Instruct" in line
    wide = header_line(state, 198)
    assert "q4_1+q8_0 gguf" in wide and unfinished_text(["0", "1"]) in wide, wide
    for width in (60, 80, 100):  # narrower: the names (or their count) and the model stay as long as they fit
        line = header_line(state, width)
        assert len(line) <= width and "SmolLM2-135M-Instruct" in line and "ended" in line, line


# ---------------------------------------------------------------- 7: a prompt of only spaces is a prompt


async def test_a_prompt_of_only_spaces_is_sent_from_the_bar_as_vllm_takes_it(tiny_llama_dir, tmp_path):
    """Trial 16: "   " was refused as "The prompt is empty"; vLLM tokenizes it and generates."""
    from tests.tui_helpers import Notes, send_prompt, tiny_app, wait_until

    app, notes = tiny_app(tiny_llama_dir, tmp_path), Notes()
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await send_prompt(pilot, "   ")
        await wait_until(pilot, lambda: any(r.state == "finished" for r in app.state.requests.values()),
                         30, "the spaces' request to finish")
        assert not notes.find("prompt is empty"), [n.message for n in notes.items]


def test_only_spaces_is_a_prompt_for_the_engine_the_server_and_both_command_lines(make_tiny_engine, tiny_server,
                                                                                 capsys):
    import httpx

    from nanovllm_core import SamplingParams, cli
    from nanovllm_core.speculative import cli as spec_cli
    from nanovllm_tui.options import parse_args
    from tests.conftest import run_main
    from tests.serve_helpers import API_KEY

    engine = make_tiny_engine()
    assert engine.request_problem(engine.encode_prompt("   ")[1], SamplingParams()) is None
    r = httpx.post(tiny_server.url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt": "   ", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert parse_args(["--prompt", "   "]).prompt == ["   "]
    for main in (cli.main, spec_cli.main):  # gets past the prompt check to the (missing) model
        code, _, err = run_main(main, capsys, "--prompt", "   ", "--model" if main is cli.main else "--target-model",
                                "/does/not/exist")
        assert code == 2 and "--prompt must not be empty" not in err, err
        code, _, err = run_main(main, capsys, "--prompt", "")
        assert code == 2 and "--prompt must not be empty" in err, err


# ---------------------------------------------------------------- 4: an answered quiz keeps its answer


async def test_an_answered_quiz_keeps_its_answer_and_x_clears_it_to_try_again(tmp_path):
    """Trial 16: on an answered chapter ``a`` (Abort everywhere else) answered A and replaced a correct,
    saved answer (13/13 became 12/13) without a word."""
    from textual.widgets import Static

    from nanovllm_tui.views.tutorial import QuizChoices, TutorialView
    from nanovllm_tui.widgets.footer import shown_keys
    from tests.tui_helpers import replay_app, wait_until

    app = replay_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("escape", "4")
        await wait_until(pilot, lambda: isinstance(app.focused, QuizChoices), what="the quiz to have the focus")
        tutorial = app.query_one(TutorialView)
        quiz = tutorial.chapter.quiz
        right, wrong = "abcd"[quiz.answer], "abcd"[(quiz.answer + 1) % 4]
        footer = lambda: [(k[0], k[1]) for k in shown_keys(app.screen)]  # noqa: E731
        assert ("a", "Answer A-D") in footer() and not any(k == "x" for k, _ in footer())
        await pilot.press(right)
        await pilot.pause()
        assert (tutorial.progress.score, tutorial.progress.answered) == (1, 1)
        assert ("x", "Retry quiz") in footer() and ("a", "Answer A-D") not in footer(), footer()
        for key in (wrong, "enter"):  # another letter, or Enter on another option: the answer stays
            if key == "enter":
                await pilot.press("down")
            await pilot.press(key)
            await pilot.pause()
            feedback = str(app.query_one("#feedback", Static).render())
            assert "Already answered" in feedback and "x to clear" in feedback and "Right" in feedback, feedback
            assert (tutorial.progress.score, tutorial.progress.answered) == (1, 1)
            assert tutorial.progress.answers[tutorial.chapter.key] == quiz.answer
        await pilot.press("x")  # clear it: a-d answer again
        await pilot.pause()
        assert (tutorial.progress.score, tutorial.progress.answered) == (0, 0)
        assert ("a", "Answer A-D") in footer() and not any(k == "x" for k, _ in footer())
        await pilot.press(wrong)
        await pilot.pause()
        assert "Not quite" in str(app.query_one("#feedback", Static).render())
        assert (tutorial.progress.score, tutorial.progress.answered) == (0, 1)
    again = replay_app(tmp_path)  # the kept answer is the one saved
    async with again.run_test(size=(120, 40)):
        assert again.query_one(TutorialView).progress.answered == 1


# ---------------------------------------------------------------- 1: every panel from the same point of the stream


def _entry(rid: str) -> ev.ScheduledEntry:
    return ev.ScheduledEntry(request_id=rid, seq_id=int(rid), index=0, kind="decode", num_tokens=1, start=9,
                             prompt_len=5, total_len=10, num_cached_tokens=0, samples=True, priority=0)


def _planned(step: int, rids=("6", "7", "8")) -> ev.StepPlanned:
    return ev.StepPlanned(step=step, token_budget=512, num_batched_tokens=len(rids),
                          scheduled=tuple(_entry(r) for r in rids), preempted=(), admitted=(), waiting=(), running=(),
                          max_num_seqs=8)


def _token(step: int, rid: str, n: int) -> ev.TokenSampled:
    return ev.TokenSampled(step=step, request_id=rid, seq_id=int(rid), index=0, token_id=1, text="x", position=9,
                           num_output_tokens=n)


def _timed(step: int) -> ev.StepTimed:
    return ev.StepTimed(step=step, wall_time_s=0.1, num_tokens=3, num_prefill_tokens=0, num_decode_tokens=3,
                        prefill_tokens_per_s=0.0, decode_tokens_per_s=30.0, kv_bytes_used=0, kv_bytes_total=1,
                        num_running=3, num_waiting=0)


def _blocks(step: int) -> ev.BlocksChanged:
    return ev.BlocksChanged(step=step, block_size=4, bytes_per_block=1, states="uf", ref_counts=(1, 0), tables=())


class _Target:
    def post_message(self, message):
        return True


def test_a_drain_never_hands_over_part_of_a_steps_results():
    """Trial 16: a frame showed req-7 with step 111's token beside req-6 and req-8 without theirs."""
    from nanovllm_tui.bridge import EngineBridge

    bridge = EngineBridge(_Target())
    bridge(_planned(111))
    bridge(_token(111, "6", 11))
    bridge(_token(111, "7", 10))
    # a frame now: the plan (step 111 running) is drawn, none of its tokens
    assert [type(e).__name__ for e in bridge.drain()] == ["StepPlanned"] and bridge.pending()
    bridge(_token(111, "8", 10))
    bridge(_blocks(111))
    assert bridge.drain() == []  # still open
    bridge(_timed(111))
    assert [(type(e).__name__, getattr(e, "request_id", None)) for e in bridge.drain()] == [
        ("TokenSampled", "6"), ("TokenSampled", "7"), ("TokenSampled", "8"), ("BlocksChanged", None),
        ("StepTimed", None)]
    assert not bridge.pending()
    # an abort between steps (its step is the last one, ended) and an empty plan hold nothing
    bridge(ev.StepPlanned(step=112, token_budget=512, num_batched_tokens=0, scheduled=(), preempted=(), admitted=(),
                          waiting=(), running=(), max_num_seqs=8))
    bridge(ev.RequestFinished(request_id="6", step=112, index=0, finish_reason="abort", stop_reason=None,
                              output_text="", output_token_ids=(), num_prompt_tokens=5, num_output_tokens=11,
                              ttft_s=None, tpot_s=None, e2e_s=None, num_preemptions=0,
                              num_cached_prompt_tokens=0))
    bridge(_blocks(112))
    assert len(bridge.drain()) == 3
    # a step that stops without its StepTimed (a device failure: an error, then its requests end): not held
    bridge(_planned(113))
    bridge(_token(113, "7", 11))
    bridge(ev.EngineError(step=113, message="the cpu device failed"))
    assert len(bridge.drain()) == 3
    # one whose engine went silent inside it: held until flushed (the app does when it is stale)
    bridge(_planned(114))
    bridge(_token(114, "7", 12))
    assert len(bridge.drain()) == 1 and bridge.stale(0.0) and not bridge.stale(60.0)
    assert [type(e).__name__ for e in bridge.drain(flush=True)] == ["TokenSampled"] and not bridge.pending()


async def test_the_paused_header_waits_until_the_last_steps_events_are_drawn(tiny_llama_dir, tmp_path, monkeypatch):
    """Trial 16: the header said "● paused" (the controller's flag, polled) while the last step's events
    still waited in the bridge: the Engine panel said "step 111 running" and the rows mixed two steps."""
    from tests.tui_helpers import send_prompt, tiny_app, wait_until

    app = tiny_app(tiny_llama_dir, tmp_path, max_tokens=400)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await send_prompt(pilot, "Once upon a time")
        await send_prompt(pilot, "The capital of France is")
        await wait_until(pilot, lambda: sum(r.num_output for r in app.state.requests.values()) >= 4, 30,
                         "a few tokens")
        drains, drain = [], app.bridge.drain

        def counted(*args, **kwargs):
            drains.append(1)
            return drain(*args, **kwargs)

        monkeypatch.setattr(app.bridge, "drain", counted)
        armed = app._flush_pending  # a frame timer set before the slow frames began would still drain
        monkeypatch.setattr(app.bridge, "delay", lambda: 3600.0)  # a slow frame: the events wait in the bridge
        if armed:  # let it fire first (under load it came after the pause and drew everything)
            await wait_until(pilot, lambda: drains, 30, "the frame armed before")
        await pilot.press("escape", "space")
        await wait_until(pilot, lambda: app.controller.state == "paused" and app.bridge._events, 30,
                         "the engine to pause with its events undrawn")
        app._poll_engine_state()  # the twice-a-second look at the controller
        await pilot.pause()
        header = str(app.query_one("#header").render())
        assert "● paused" not in header and "pausing…" in header, header
        monkeypatch.undo()
        app._take_events()  # the frame comes: the step's events and the EnginePaused
        await pilot.pause()
        header = str(app.query_one("#header").render())
        assert "● paused" in header, header
        assert not app.state.step_open and app.state.timings[-1].step == app.state.step, "the last step is drawn whole"
        await pilot.press("space")  # resume: the same for "running"
