"""Trial 30a: the Narrator stayed blank when first opened after PageDown in the X-Ray.

A scroll anywhere left Textual's record of laid-out widgets stale; a focus change rebuilt it with the
new tab's pane already displayed, so the pane's widgets never got their first ``Resize``, and the
Narrator's ``RichLog`` kept every write deferred until a resize or another tab switch (see
``nanovllm_tui.app.settle_layout_baseline``)."""

from __future__ import annotations

import pytest
from textual.widgets import RichLog

from tests.tui_helpers import replay_app, visible_tab, wait_until

pytestmark = pytest.mark.anyio


def screen_text(app) -> str:
    """The text of the whole screen as a fresh full render draws it."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


@pytest.mark.parametrize("scrolled, opened_by", [
    ("2", "key"),  # the trial: X-Ray's PageDown scrolls its layer pipeline
    ("4", "key"),  # the Tutorial's PageDown scrolls its chapter
    ("2", "click"),  # a click on the Narrator's tab title
])
async def test_the_narrator_first_opened_after_a_scroll_in_another_tab_shows_its_commentary(
        tmp_path, scrolled, opened_by):
    app = replay_app(tmp_path, start_paused=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: (app.state.step or 0) >= 5, 30, "a few replayed steps")
        await pilot.press(scrolled)
        await pilot.pause(0.5)
        await pilot.press("pagedown", "pagedown")
        await pilot.pause(0.3)
        if opened_by == "key":
            await pilot.press("3")
        else:
            await pilot.click("#--content-tab-narrator")
        await wait_until(pilot, lambda: visible_tab(app) == "narrator", 10, "the Narrator tab")
        log = app.query_one("#narration", RichLog)
        await wait_until(pilot, lambda: len(log.lines) > 0, 10, "the commentary written into the log")
        await pilot.pause(0.3)
        text = screen_text(app)
        assert "Step " in text or "prefill" in text.lower() or "decode" in text.lower(), text


async def test_end_and_home_in_the_tutorial_go_to_a_chapters_end_and_start(tmp_path):
    """Trial 44e: End did not move a chapter longer than the screen (only PageDown did, and no help said so)."""
    from textual.containers import VerticalScroll

    app = replay_app(tmp_path, start_paused=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, 30, "the recording's model")
        await pilot.press("escape", "4")
        await wait_until(pilot, lambda: visible_tab(app) == "tutorial", 10, "the Tutorial tab")
        scroll = app.screen.query_one("#chapter-scroll", VerticalScroll)
        await wait_until(pilot, lambda: scroll.max_scroll_y > 0, 10, "a chapter longer than the screen")
        await pilot.press("end")
        await wait_until(pilot, lambda: scroll.scroll_y == scroll.max_scroll_y, 10, "the chapter's end")
        assert app.query_one("#choices").highlighted == 3  # and the last answer, as OptionList's End
        await pilot.press("home")
        await wait_until(pilot, lambda: scroll.scroll_y == 0, 10, "the chapter's start")
        assert app.query_one("#choices").highlighted == 0


async def test_a_web_visitors_tutorial_progress_lasts_the_visit_and_leaves_the_shared_file_alone(tmp_path,
                                                                                               monkeypatch):
    """Trial 48a: a new --web visitor's Tutorial showed "Score 11 right of 13" and chapter 5 answered: every
    visitor's app read and wrote the one default progress file."""
    import nanovllm_core.educational.tutorial as tut
    from nanovllm_tui.options import VISIT_ONLY, WEB_VISITOR, build_app
    from tests.tui_helpers import TRACE

    shared = tmp_path / "tutorial_progress.json"
    earlier = tut.TutorialProgress()
    earlier.record(tut.CHAPTERS[0], 0)
    earlier.save(shared)
    before = shared.read_text()
    monkeypatch.setattr(tut, "_default_path", lambda: shared)
    monkeypatch.setenv(WEB_VISITOR, "1")
    app = build_app(["--replay", str(TRACE), "--paused"])
    assert app.tutorial_path is VISIT_ONLY
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, 30, "the recording's model")
        await pilot.press("escape", "4")
        await wait_until(pilot, lambda: visible_tab(app) == "tutorial", 10, "the Tutorial tab")
        view = app.screen.query_one("TutorialView")
        assert view.progress.answered == 0  # not the earlier learner's answer
        await pilot.press("a")
        await wait_until(pilot, lambda: view.progress.answered == 1, 10, "the answer")
    assert shared.read_text() == before
