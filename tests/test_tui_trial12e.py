"""Newcomer trial 12e (issue 29): what a small terminal shows of the footer's keys."""

from __future__ import annotations

import pytest

from tests.tui_helpers import replay_app, wait_until

pytestmark = pytest.mark.anyio


def _footer_line(app) -> str:
    """The screen's last line, as a full repaint draws it: the footer, cut where the terminal ends."""
    return app.screen._compositor.render_strips()[-1].text


# Every key the footer shows at 120x40 on each tab of a replay (trial 12: `q Quit` must stay among them).
KEYS_AT_120 = {
    "1": ("space Pause/Resume", "n Step", "[ Prev req", "] Next req", "q Quit"),
    "3": ("space Pause/Resume", "n Step", "[ Prev req", "] Next req", "q Quit", "f Only selected"),
}


@pytest.mark.parametrize("tab", ["1", "2", "3", "4", "5"])
async def test_quit_is_visible_in_the_footer_of_a_60x20_terminal(tmp_path, tab):
    """Trial 12: at 60x20 the footer read `space Pause/Resume  n Step  [ Prev req  ] Next ▏^p palette`:
    `q Quit` was cut off, and a newcomer on a small terminal saw no way out."""
    app = replay_app(tmp_path)
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.press("escape", tab)
        await pilot.pause(0.3)
        await wait_until(pilot, lambda: "Quit" in _footer_line(app), 5, f"q Quit in the footer on tab {tab}")
        line = _footer_line(app)
        assert "q Quit" in line, line


@pytest.mark.parametrize("tab", sorted(KEYS_AT_120))
async def test_the_120x40_footer_still_shows_every_key(tmp_path, tab):
    app = replay_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("escape", tab)
        await pilot.pause(0.3)
        want = KEYS_AT_120[tab]
        await wait_until(pilot, lambda: all(k in _footer_line(app) for k in want), 5, f"every key on tab {tab}")
        assert "^p palette" in _footer_line(app)


@pytest.mark.parametrize("size", [(60, 20), (120, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
async def test_the_prompt_bar_shows_ctrl_q_quit_where_q_types_itself(tiny_llama_dir, tmp_path, size):
    """Trial 12e: the app opens in the prompt bar, where `q` types a q; its footer read
    `esc Leave prompt  ^t Chat/raw`, no way out shown although ctrl+q quits from there."""
    from tests.tui_helpers import tiny_app

    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=size) as pilot:
        for field in ("#prompt", "#priority"):
            app.query_one(field).focus()
            await wait_until(pilot, lambda: "^q Quit" in _footer_line(app), 10, f"^q Quit in the footer in {field}")
            assert "q Quit " not in _footer_line(app).replace("^q Quit", ""), _footer_line(app)  # bare q types here
        await pilot.press("ctrl+q")
        await wait_until(pilot, lambda: not app.is_running, 10, "the app to quit on ctrl+q")
