"""Newcomer trial 24a: a key that chooses something (a quiz answer, a request in the table) and the key
after it, arriving in one terminal read, acted in the wrong order: the choice went out as a message
handled after the next key, so ``b →`` answered the NEXT chapter's quiz, and ``↓ a`` aborted the
request that was selected before ``↓``."""

from __future__ import annotations

import pytest

from nanovllm_tui.views.tutorial import TutorialView
from tests.tui_helpers import keys_at_once, replay_app, send_prompt, tiny_app, wait_until

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("keys", [("b", "right"), ("down", "enter", "right")], ids=["letter", "enter"])
async def test_an_answer_then_next_chapter_in_one_read_answers_the_chapter_shown(tmp_path, keys):
    app = replay_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("escape", "4")
        tutorial = app.query_one(TutorialView)
        await wait_until(pilot, lambda: app.focused is not None and tutorial in app.focused.ancestors_with_self,
                         what="the tutorial's focus")
        shown = tutorial.chapter.key
        keys_at_once(app, *keys)
        await wait_until(pilot, lambda: tutorial.chapter.key != shown, timeout=10, what="the next chapter")
        await pilot.pause(0.3)
        answers = dict(tutorial.progress.answers)
        assert answers == {shown: 1}, f"{keys} on {shown!r} recorded {answers}"
        assert not tutorial.answered  # the next chapter's quiz is still open


async def test_down_then_abort_in_one_read_aborts_the_request_moved_to(tiny_llama_dir, tmp_path):
    app = tiny_app(tiny_llama_dir, tmp_path, start_paused=True, max_tokens=20)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        for text in ("first prompt", "second prompt"):
            await send_prompt(pilot, text)
        await wait_until(pilot, lambda: len(app.state.requests) == 2, what="two requests")
        await pilot.press("escape", "1", "home")
        first, second = app.state.request_ids()
        await wait_until(pilot, lambda: app.selected == first, timeout=10, what="the first request selected")
        keys_at_once(app, "down", "a")
        await wait_until(pilot, lambda: any(not r.live for r in app.state.requests.values()), timeout=20,
                         what="an abort")
        await pilot.pause(0.3)
        states = {rid: (r.state, r.finish_reason) for rid, r in app.state.requests.items()}
        assert app.state.requests[second].finish_reason == "abort" and app.state.requests[first].live, states


async def test_the_tutorial_score_names_right_answers_apart_from_answered_ones(tmp_path):
    """Trial 26b: "Score 12/13 answered" beside "0 to go" read as 12 of 13 answered when all 13 were,
    12 of them right."""
    app = replay_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("escape", "4")
        tutorial = app.query_one(TutorialView)
        wrong = (tutorial.chapter.quiz.answer + 1) % 4
        await pilot.press("abcd"[wrong])
        await pilot.pause(0.2)
        listing = str(app.query_one("#chapter-list").render())
        assert "Score 0 right of 1 answered" in listing, listing
        assert f"{13 - 1} to go" in listing
