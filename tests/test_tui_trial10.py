"""Newcomer trial 10: a multi-line paste, a recording cut mid-step, the footer's keys, the request
panel's title and the Narrator's wrap width."""

from __future__ import annotations

import pytest
from textual import events
from textual.widgets import Input

from nanovllm_tui.widgets.prompt_bar import NEWLINE_MARK, bar_from_prompt, pasted_text, prompt_from_bar
from tests.tui_helpers import Notes, replay_app, send_prompt, tiny_app, wait_until

SIZE = (120, 40)
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _paste(app, text: str) -> None:
    """A bracketed paste, as the terminal's driver delivers it."""
    paste = events.Paste(text)
    paste.set_sender(app)
    app._driver.send_message(paste)


# ---------------------------------------------------------------- 1: a multi-line paste keeps every line


def test_a_paste_keeps_its_lines_as_marks_and_drops_escape_sequences():
    assert pasted_text("first line\nsecond line\nthird line") == ("first line⏎second line⏎third line", 0)
    assert pasted_text("a\r\nb\rc") == ("a⏎b⏎c", 0)  # CRLF and CR are one line break each
    assert pasted_text("line one\twith tab\nred \x1b[31mred\x1b[0m end\x07") == ("line one\twith tab⏎red red end", 10)
    assert pasted_text("title \x1b]0;x\x07ok \x1b") == ("title ok ", 7)  # OSC whole, a lone ESC at the end
    assert prompt_from_bar("a⏎b") == "a\nb" and bar_from_prompt("a\r\nb\nc") == "a⏎b⏎c"
    assert prompt_from_bar(bar_from_prompt("x\ny\n")) == "x\ny\n"


@pytest.mark.parametrize("chat", [False, True])
async def test_a_multi_line_paste_is_sent_whole_with_real_newlines(tiny_llama_dir, tmp_path, chat):
    """Trial 10: the bar held `first line` and Enter sent it alone; an escape sequence in a paste
    garbled the prompt. Now: every line, ⏎ in the bar, "\\n" in what is sent; control codes dropped and said."""
    app, notes = tiny_app(tiny_llama_dir, tmp_path, start_paused=True), Notes()
    sent = []
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        if chat:
            app.query_one("#prompt-bar").toggle_chat()
        submit = app.controller.submit
        app.controller.submit = lambda prompt, *a, **kw: (sent.append(prompt), submit(prompt, *a, **kw))[1]
        app.query_one("#prompt").focus()
        _paste(app, "first line\r\nsecond \x1b[31mline\x1b[0m\nthird line")
        await wait_until(pilot, lambda: app.query_one("#prompt", Input).value, 10, "the paste")
        assert app.query_one("#prompt", Input).value == f"first line{NEWLINE_MARK}second line{NEWLINE_MARK}third line"
        assert notes.find("9 characters of control codes", "warning")
        await pilot.press("enter")
        await wait_until(pilot, lambda: sent, 10, "the prompt sent")
        text = "first line\nsecond line\nthird line"
        if chat:
            assert sent[0] == [{"role": "user", "content": text}]
        else:
            assert sent[0] == text
        assert app.state.requests[app.selected].prompt == text


async def test_a_refused_multi_line_prompt_comes_back_with_its_marks(tiny_llama_dir, tmp_path):
    """The refusal path puts the prompt back as the bar shows it (⏎), not with raw newlines."""
    app, notes = tiny_app(tiny_llama_dir, tmp_path), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await send_prompt(pilot, f"Tell me{NEWLINE_MARK}a story", max_tokens=510)
        rid = app.selected
        await wait_until(pilot, lambda: notes.find(f"{rid} was rejected: max_tokens 510 does not fit", "error"),
                         timeout=30, what="the refusal")
        assert app.query_one("#prompt", Input).value == f"Tell me{NEWLINE_MARK}a story"
        assert notes.find("the prompt is back in the bar")


async def test_a_typed_mark_is_a_line_break_and_a_setting_paste_keeps_one_rule(tiny_llama_dir, tmp_path):
    """The documented rule: a typed ⏎ is sent as a line break too; a paste into a setting is cleaned
    the same way and then checked by the setting's own rule (refused, not cut)."""
    app, notes = tiny_app(tiny_llama_dir, tmp_path, start_paused=True), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        app.query_one("#max-tokens", Input).focus()
        app.query_one("#max-tokens", Input).value = ""
        _paste(app, "5\n6")
        await wait_until(pilot, lambda: app.query_one("#max-tokens", Input).value, 10, "the paste")
        assert app.query_one("#max-tokens", Input).value == f"5{NEWLINE_MARK}6"
        await pilot.press("enter")  # nothing typed in the prompt: refused as empty, nothing sent
        app.query_one("#max-tokens", Input).value = "3"
        await send_prompt(pilot, f"a {NEWLINE_MARK} b")
        await wait_until(pilot, lambda: app.state.requests, 10, "the prompt sent")
        assert app.state.requests[app.selected].prompt == "a \n b"
