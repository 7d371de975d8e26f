"""Newcomer trial 16a: the pausing frame drew "paused" ahead of the last step's events, the Tutorial's
``a`` replaced a saved quiz answer, the cut replay's end counted requests whose names fit, and a prompt
of spaces was refused as empty."""

from __future__ import annotations

import pytest

from nanovllm_core import events as ev
from nanovllm_tui.state import EngineState
from nanovllm_tui.widgets.status_header import StatusHeader, unfinished_text

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


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
        assert not notes.find("The prompt is empty"), [n.message for n in notes.items]


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
