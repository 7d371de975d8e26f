"""Moving into a prompt-bar field loses no key and overwrites nothing (trial 20e).

Typed straight after ``/`` (the focus moving from a setting to the prompt), the first characters
were sometimes lost ("Tell me" became "me"; a prompt went out as "ell me a long story ..."), and
after a refused prompt was put back in the bar, ``/`` then typing replaced the whole prompt: the
field selected all its text when the focus arrived, so the next key replaced what was there.
"""

from __future__ import annotations

import pytest

from tests.tui_helpers import keys_at_once, tiny_app, wait_until

SIZE = (120, 40)
pytestmark = pytest.mark.anyio


async def test_keys_typed_at_once_after_slash_all_reach_the_prompt(tiny_llama_dir, tmp_path):
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.focused is not None and app.focused.id == "prompt", 30, "the prompt")
        prompt = app.query_one("#prompt")
        seen = []
        for start in ("", "Write a poem"):
            for _ in range(3):
                prompt.value = start
                app.query_one("#max-tokens").focus()
                await wait_until(pilot, lambda: app.focused.id == "max-tokens", 10, "the max tokens field")
                keys_at_once(app, "/", "T", "e", "l", "l")
                await wait_until(pilot, lambda: len(prompt.value) >= len(start) + 4, 10, "the keys to arrive")
                await pilot.pause(0.2)  # the Focus message, handled after the keys, changes nothing
                seen.append(prompt.value)
        assert seen == ["Tell"] * 3 + ["Write a poemTell"] * 3, seen


async def test_entering_a_setting_selects_its_value_and_the_prompt_continues_at_any_speed(tiny_llama_dir, tmp_path):
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.focused is not None and app.focused.id == "prompt", 30, "the prompt")
        prompt, max_tokens = app.query_one("#prompt"), app.query_one("#max-tokens")
        for at_once in (True, False):
            max_tokens.value = "300"
            app.query_one("#priority").focus()
            await wait_until(pilot, lambda: app.focused.id == "priority", 10, "the priority field")
            await pilot.pause(0.1)
            keys = ("tab", "6", "4")  # Tab into max tokens and type: the value is replaced, no key lost
            keys_at_once(app, *keys) if at_once else await pilot.press(*keys)
            await wait_until(pilot, lambda: max_tokens.value != "300", 10, "the keys to arrive")
            await pilot.pause(0.2)
            assert max_tokens.value == "64", (at_once, max_tokens.value)

            prompt.value = "Write a poem"  # as a refused prompt is put back in the bar
            keys = ("slash", "X")  # from a setting, / goes back to the prompt: typing continues it
            keys_at_once(app, *keys) if at_once else await pilot.press(*keys)
            await wait_until(pilot, lambda: prompt.value != "Write a poem", 10, "the keys to arrive")
            await pilot.pause(0.2)
            assert prompt.value == "Write a poemX", (at_once, prompt.value)


async def test_a_refused_enter_says_it_put_the_cursor_in_the_wrong_setting(tiny_llama_dir, tmp_path):
    """Trial 21d: Enter refused for a wrong setting moved the focus to it and selected its value
    without a word, so a `/` typed next was taken as "go to the prompt" and a letter replaced the
    setting. The move stays (a form focuses the field to fix); the line under the bar and the toast
    say where the cursor is, until the setting is right or the cursor leaves it."""
    from tests.tui_helpers import Notes

    notes = Notes()
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.focused is not None and app.focused.id == "prompt", 30, "the prompt")
        error = app.query_one("#prompt-error")
        priority, prompt = app.query_one("#priority"), app.query_one("#prompt")
        priority.value, app.query_one("#temperature").value = "-5000", "nan"
        prompt.value = "bad settings prompt"
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.focused.id == "priority", 10, "the cursor in prio")
        line = str(error.render())
        assert "not '-5000'" in line and "not 'nan'" in line, line
        assert line.endswith("the cursor is in prio now, its value selected: fix it, then / returns to the prompt"), line
        assert notes.find("The prompt is kept; the cursor is in prio now", "error")
        assert priority.selection == (0, len("-5000")) and prompt.value == "bad settings prompt"

        await pilot.press("5")  # fixed: the reason goes, and with it the word about the cursor
        assert priority.value == "5" and "cursor" not in str(error.render()) and "not 'nan'" in str(error.render())

        priority.value = "x"
        await pilot.press("enter")  # refused again, then the cursor leaves: the line no longer says it is there
        assert "the cursor is in prio" in str(error.render())
        await pilot.press("slash")
        await wait_until(pilot, lambda: app.focused.id == "prompt", 10, "the prompt")
        assert "cursor" not in str(error.render()) and "not 'x'" in str(error.render())


async def test_enter_refused_in_the_wrong_setting_itself_selects_its_value(tiny_llama_dir, tmp_path):
    """Trial 23a: the line under the bar says "the cursor is in temp now, its value selected", but with
    Enter pressed in that very field (no focus moved) nothing was selected: typing gave "abcQQ"."""
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.focused is not None and app.focused.id == "prompt", 30, "the prompt")
        app.query_one("#prompt").value = "Hello"
        temp = app.query_one("#temperature")
        temp.focus()
        await wait_until(pilot, lambda: app.focused.id == "temperature", 10, "the temperature field")
        temp.value = ""
        await pilot.press("a", "b", "c", "enter")
        await wait_until(pilot, lambda: "its value selected" in str(app.query_one("#prompt-error").render()), 10,
                         "the refusal under the bar")
        await pilot.press("Q", "Q")
        await pilot.pause(0.2)
        assert temp.value == "QQ" and app.focused.id == "temperature"


async def test_an_enter_typed_while_the_app_starts_sends_the_prompt(tiny_llama_dir, tmp_path):
    """Trials 42e, 46e: a prompt typed with its Enter a moment after launch, before the app had the terminal,
    arrived without its Enter: the terminal's cooked mode turns Enter into a line feed, which reaches the app
    as ctrl+j. In the prompt bar it sends, as Enter does."""
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.focused is not None and app.focused.id == "prompt", 30, "the prompt")
        keys_at_once(app, "N", "a", "m", "e", "ctrl+j")
        await wait_until(pilot, lambda: len(app.state.requests) == 1, 30, "the prompt to be sent")
        assert app.query_one("#prompt").value == ""
