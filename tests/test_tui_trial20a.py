"""Newcomer trial 20a: every quiz's question, options and both verdicts are whole and reachable at
60x20 to 120x80 (a long verdict was cut mid-sentence by the box's fixed heights, with no way to
scroll to the rest); Enter on an empty prompt says why nothing was sent."""

from __future__ import annotations

import pytest
from textual.geometry import Region

from tests.tui_helpers import replay_app

pytestmark = pytest.mark.anyio

SIZES = [(60, 20), (80, 24), (120, 40), (120, 80)]


def words(text: str) -> str:
    return " ".join(text.split())


def laid_out(widget) -> str:
    """The text of every line ``widget`` lays out at its size (what can be scrolled into view)."""
    size = widget.size
    strips = widget.render_lines(Region(0, 0, size.width, size.height))
    return words(" ".join(strip.text for strip in strips))


def reachable(quiz, widget) -> bool:
    """``widget`` lies wholly inside the quiz box's scrollable space, which can scroll to its bottom."""
    bottom = widget.virtual_region.bottom  # in the box's scrolled space
    return bottom <= quiz.virtual_size.height <= quiz.scrollable_content_region.height + quiz.max_scroll_y


async def check_verdict(pilot, app, quiz, expected: str, where, walk: bool) -> None:
    feedback = app.query_one("#feedback")
    await pilot.pause(0.2)
    assert laid_out(feedback) == words(expected), where
    assert reachable(quiz, feedback), where
    # the answer brings its verdict's first line into view
    shown = quiz.scrollable_content_region
    assert shown.y <= feedback.region.y < shown.bottom, (where, feedback.region, shown)
    if not walk:
        return
    # and ↓ (past D) scrolls the box on to the verdict's end, ↑ (above A) back to the question
    await pilot.press("end")  # to D
    await pilot.pause(0.1)
    for _ in range(quiz.max_scroll_y + 4):
        if quiz.scroll_y >= quiz.max_scroll_y:
            break
        await pilot.press("down")
    assert (quiz.scroll_y, app.query_one("#choices").highlighted) == (quiz.max_scroll_y, 3), where
    await pilot.press("home")  # to A
    await pilot.pause(0.1)
    for _ in range(quiz.max_scroll_y + 4):
        if quiz.scroll_y <= 0:
            break
        await pilot.press("up")
    assert (quiz.scroll_y, app.query_one("#choices").highlighted) == (0, 0), where


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_every_quiz_and_both_verdicts_are_whole_and_reachable(tmp_path, size):
    from nanovllm_core.educational import tutorial as tut
    from nanovllm_tui.views.tutorial import TutorialView

    app = replay_app(tmp_path)
    async with app.run_test(size=size) as pilot:
        await pilot.press("escape", "4")
        await pilot.pause(0.3)
        view = app.query_one(TutorialView)
        quiz, choices = app.query_one("#quiz"), app.query_one("#choices")
        for c in tut.CHAPTERS:
            where = (size, c.number)
            assert view.chapter is c
            assert laid_out(app.query_one("#question")) == words(c.quiz.question), where
            assert choices.max_scroll_y == 0, where  # every option whole in the box's own scroll
            assert reachable(quiz, choices), where
            wrong = next(i for i in range(4) if i != c.quiz.answer)
            await pilot.press(tut.LETTERS[wrong].lower())
            await check_verdict(pilot, app, quiz, view._feedback(wrong).plain, where, walk=False)
            await pilot.press("x", tut.LETTERS[c.quiz.answer].lower())
            await check_verdict(pilot, app, quiz, view._feedback(c.quiz.answer).plain, where, walk=True)
            assert "Press x to clear this answer and try again." in laid_out(app.query_one("#feedback"))
            await pilot.press("right")
            await pilot.pause(0.2)


# ---------------------------------------------------------------------------------------------- 2


async def check_empty_prompt_is_said_under_the_bar(pilot, app, notes) -> None:
    """Enter on an empty prompt: the reason under the bar (and a toast), nothing sent; it goes once
    the prompt has text. With an empty setting too, both reasons."""
    from nanovllm_tui.widgets.prompt_bar import PromptBar

    bar, error, prompt = app.query_one(PromptBar), app.query_one("#prompt-error"), app.query_one("#prompt")
    before = len(app.state.requests)
    prompt.focus()
    prompt.value = ""
    await pilot.press("enter")
    await pilot.pause(0.2)
    line = str(error.render())
    assert error.display and bar.has_class("-invalid"), line
    assert line == "the prompt is empty: type some text, then press Enter", line
    assert prompt.has_class("-invalid") and app.focused is prompt
    assert notes.find("Not sent: the prompt is empty", "warning")
    assert len(app.state.requests) == before
    await pilot.press("h")
    await pilot.pause(0.2)
    assert not bar.has_class("-invalid") and not prompt.has_class("-invalid")
    # an empty setting as well: both reasons under the bar
    app.query_one("#max-tokens").value = ""
    prompt.value = ""
    prompt.focus()
    await pilot.press("enter")
    await pilot.pause(0.2)
    line = str(error.render())
    assert line.startswith("the prompt is empty: type some text") and "max tokens must be" in line, line
    # the cursor goes to the wrong setting, and the line says so (trial 25b: it went to the prompt, unsaid)
    assert line.endswith("; the cursor is in max now, its value selected: fix it, then / returns to the prompt")
    assert app.focused.id == "max-tokens"
    app.query_one("#max-tokens").value = "3"
    await pilot.pause(0.1)
    assert str(error.render()) == "the prompt is empty: type some text, then press Enter"
    await pilot.press("slash", "h", "i", "enter")
    await pilot.pause(0.3)
    assert not bar.has_class("-invalid")


async def test_enter_on_an_empty_prompt_says_why_under_the_bar(tiny_llama_dir, tmp_path):
    from tests.tui_helpers import Notes, tiny_app, wait_until

    app, notes = tiny_app(tiny_llama_dir, tmp_path), Notes()
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await check_empty_prompt_is_said_under_the_bar(pilot, app, notes)
        await wait_until(pilot, lambda: len(app.state.requests) == 1, 10, "the prompt sent once it had text")


async def test_enter_on_an_empty_prompt_says_why_under_the_bar_when_attached(tiny_server, tmp_path):
    from tests.tui_helpers import attached_and_paused, wait_until

    async with attached_and_paused(tiny_server, tmp_path) as (app, pilot, notes):
        before = len(app.state.requests)  # the newest step's requests an earlier test ran (trial 29c)
        await check_empty_prompt_is_said_under_the_bar(pilot, app, notes)
        await wait_until(pilot, lambda: len(app.state.requests) == before + 1, 10, "the prompt sent once it had text")
