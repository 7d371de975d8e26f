"""Newcomer trials 14a and 14e: a tab in the prompt bar, key hints true of the engine's state, a Block
Map no older than it says, the Top-k panel's byte pieces, and the Dashboard at 100 columns."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Input

from nanovllm_tui.widgets.prompt_bar import TAB_MARK, PromptBar, prompt_from_bar

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class BarApp(App):
    """The prompt bar alone, 100 columns wide: the prompt field is 94 cells."""

    def compose(self) -> ComposeResult:
        yield PromptBar(id="prompt-bar")


def shown(field: Input) -> str:
    """The prompt field's line as drawn (the scrolled view)."""
    return field.render_line(0).text


# ---------------------------------------------------------------- 14a item 3: a tab in the prompt bar

TABBED = "START " + "".join(f"w{i:02d}\t" for i in range(40)) + "END"


async def test_end_shows_and_edits_the_end_of_a_prompt_with_tabs():
    """Trial 14a: End stopped at `w14     w1` of a 40-tab prompt (Input scrolled by a tab of 0 cells
    and drew it as up to 8). A tab is one cell ⇥ in the bar and a real tab in what is sent."""
    app = BarApp()
    async with app.run_test(size=(100, 10)) as pilot:
        field = app.query_one("#prompt", Input)
        field.focus()
        field.paste("x")  # not the field's first value (see the next test)
        await pilot.press("backspace")
        field.paste(TABBED)
        await pilot.press("home", "end")
        assert shown(field).rstrip().endswith(f"w38{TAB_MARK}w39{TAB_MARK}END")
        await pilot.press("backspace", "backspace", "!")
        assert shown(field).rstrip().endswith(f"w39{TAB_MARK}E!")
        assert prompt_from_bar(field.value).endswith("w39\tE!") and field.value.count("\t") == 40
        x, y = field.content_region.x + shown(field).index(f"w39{TAB_MARK}") + 3, field.content_region.y
        await pilot.click(offset=(x, y))  # on the tab mark after w39
        assert field.value[field.cursor_position] == "\t" and field.value[field.cursor_position - 3:field.cursor_position] == "w39"


async def test_a_first_paste_into_the_field_shows_its_end_with_the_cursor():
    """Input takes a field's first value for the one it was built with and does not scroll to the
    cursor: a long first paste left the cursor past the right edge, and End (already there) did nothing."""
    app = BarApp()
    async with app.run_test(size=(100, 10)) as pilot:
        field = app.query_one("#prompt", Input)
        field.focus()
        field.paste(TABBED.replace("\t", " "))
        await pilot.pause()
        assert shown(field).rstrip().endswith("w39 END")
