"""Newcomer trial 25b: fast keyboard bursts. Esc, a key and an arrow key read at once typed "^1" into
the prompt (#2); Enter with a wrong setting and an empty prompt put the cursor in the prompt without a
word (#3)."""

from __future__ import annotations

import time

import pytest

from tests.tui_helpers import tiny_app, visible_tab, wait_until

SIZE = (120, 40)
pytestmark = pytest.mark.anyio


def _keys(data: str) -> list[tuple[str, str | None]]:
    """(key, character) of each key event (a paste as ("paste", text)) Textual's terminal parser makes of
    ``data`` read at once, with the app's reading (``lifetime``) in place; an ESC left waiting is flushed."""
    from textual import events
    from textual._xterm_parser import XTermParser

    from nanovllm_tui.lifetime import filter_escapes_in_pastes, read_esc_key_as_alt

    read_esc_key_as_alt()
    filter_escapes_in_pastes()
    parser = XTermParser()
    out = list(parser.feed(data))
    time.sleep(0.15)  # past textual's ESCAPE_DELAY
    out += list(parser.tick()) + list(parser.feed(""))
    return [("paste", e.text) if isinstance(e, events.Paste) else (e.key, e.character) for e in out]


@pytest.mark.parametrize("data, keys", [
    ("\x1b1\x1b[A", [("alt+1", "1"), ("up", None)]),  # tmux send-keys Escape 1 Up
    ("\x1b2\x1b[B", [("alt+2", "2"), ("down", None)]),
    ("\x1b1\x1b[D", [("alt+1", "1"), ("left", None)]),
    ("\x1b[\x1b[A", [("alt+left_square_bracket", "["), ("up", None)]),  # ESC [ begins a CSI: cut short
    ("\x1b]\x1b[B", [("alt+right_square_bracket", "]"), ("down", None)]),  # ESC ] begins an OSC
    ("\x1bO\x1b[A", [("alt+shift+o", "O"), ("up", None)]),  # ESC O begins an SS3
    ("\x1bn\x1b[A", [("alt+n", "n"), ("up", None)]),
    ("\x1b \x1b[A", [("alt+space", " "), ("up", None)]),
    ("\x1b12\x1b[A", [("alt+1", "1"), ("2", "2"), ("up", None)]),  # the report's "^12"
    ("\x1b1\x1b[H", [("alt+1", "1"), ("home", None)]),
    ("\x1b1\x1b[F", [("alt+1", "1"), ("end", None)]),
    ("\x1b1\x1b[5~", [("alt+1", "1"), ("pageup", None)]),
    ("\x1b1\x1bOP", [("alt+1", "1"), ("f1", None)]),
    ("\x1b1\x1b[15~", [("alt+1", "1"), ("f5", None)]),
    ("\x1b1\x1b[3~", [("alt+1", "1"), ("delete", None)]),
    ("\x1b1\x1b", [("alt+1", "1"), ("escape", "\x1b")]),
    ("\x1b\x1b", [("escape", "\x1b"), ("escape", "\x1b")]),
    ("\x1b\x1b1\x1b[A", [("escape", "\x1b"), ("alt+1", "1"), ("up", None)]),
    ("\x1b1\x1b[200~hi\x1b[201~", [("alt+1", "1"), ("paste", "hi")]),
    ("\x1b1", [("alt+1", "1")]),  # as before
    ("\x1b", [("escape", "\x1b")]),
    ("a^b", [("a", "a"), ("circumflex_accent", "^"), ("b", "b")]),  # a caret typed as such stays one
])
def test_esc_a_key_and_an_escape_sequence_key_read_at_once_are_esc_the_key_then_the_other(data, keys):
    """The second ESC cut the first sequence short and Textual re-issued it with the ESC as a typed "^"."""
    assert _keys(data) == keys


def test_no_esc_is_ever_read_as_a_caret():
    """Every way the parser re-issues a sequence cut short (by an ESC, or past 32 characters): no "^"."""
    for data in ("\x1b" + "1" * 40, "\x1b[" + "9" * 40, "\x1b[99\x1b[A", "\x1bx\x1bOQ"):
        assert "circumflex_accent" not in [key for key, _ in _keys(data)], repr(data)


async def test_esc_1_up_at_once_in_the_prompt_bar_leaves_it_shows_tab_1_and_types_nothing(tmp_path, tiny_llama_dir):
    """`tmux send-keys Escape 1 Up` in the prompt: "^1" was typed (and sent to the model with Enter)."""
    from textual import events

    app = tiny_app(tiny_llama_dir, tmp_path)
    app.get_driver_class()  # what `nanovllm-tui` does before its driver starts: the parser's reading is set
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        app.query_one("#prompt").focus()
        await pilot.press("escape", "2")
        await wait_until(pilot, lambda: visible_tab(app) == "xray", timeout=10, what="tab 2")
        app.query_one("#prompt").focus()
        await pilot.press("h", "i")
        for key, character in _keys("\x1b1\x1b[A"):
            event = events.Key(key, character)
            event.set_sender(app)
            app._driver.send_message(event)
        await wait_until(pilot, lambda: visible_tab(app) == "dashboard", timeout=10, what="tab 1")
        await pilot.pause()
        assert app.query_one("#prompt").value == "hi" and app.focused.id != "prompt"
        app.query_one("#prompt").focus()  # a control character is never typed, whatever key brings it
        for key, character in [("ctrl+z", "\x1a"), ("escape", "\x1b"), ("ctrl+at", "\x00")]:
            event = events.Key(key, character)
            event.set_sender(app)
            app._driver.send_message(event)
            await pilot.pause()
            app.query_one("#prompt").focus()
        assert app.query_one("#prompt").value == "hi"


async def test_enter_with_a_wrong_setting_and_an_empty_prompt_puts_the_cursor_in_the_setting_and_says_so(
        tmp_path, tiny_llama_dir):
    """`1 / Tab abc Enter`: the cursor went to the empty prompt, unsaid; `BSpace BSpace BSpace 5 / Hello
    Enter` then typed "5/Hello" into the prompt instead of fixing prio and sending Hello."""
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        app.query_one("#prompt").focus()
        await pilot.press("escape")  # in a view, as the report began
        await pilot.press("1", "slash", "tab", "a", "b", "c", "enter")
        await pilot.pause()
        line = str(app.query_one("#prompt-error").render())
        assert app.focused.id == "priority"
        assert line.startswith("the prompt is empty: type some text, then press Enter; priority must be")
        assert line.endswith("; the cursor is in prio now, its value selected: fix it, then / returns to the prompt")
        await pilot.press("backspace", "backspace", "backspace", "5", "slash", *"Hello", "enter")
        await wait_until(pilot, lambda: app.state.requests, timeout=30, what="the prompt to be sent")
        [req] = app.state.requests.values()
        assert req.priority == 5 and app.query_one("#prompt").value == ""


async def test_enter_in_a_setting_with_an_empty_prompt_says_the_cursor_went_to_the_prompt(tmp_path, tiny_llama_dir):
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        app.query_one("#prompt").focus()
        await pilot.press("tab", "tab", "enter")  # in max, every setting right
        await pilot.pause()
        assert app.focused.id == "prompt"
        assert str(app.query_one("#prompt-error").render()) == (
            "the prompt is empty: type some text, then press Enter; the cursor is in the prompt now")
        await pilot.press("x")  # the prompt has text: nothing more to say
        await pilot.pause()
        assert str(app.query_one("#prompt-error").render()) == ""
