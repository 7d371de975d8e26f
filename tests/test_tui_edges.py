"""The app under load and at its edges (issue 15): the last key wins, every figure is current,
nothing is clipped, no input is lost. Most run on the recorded replay; the key-order test on a
tiny random LLaMA whose loading is held back."""

from __future__ import annotations

import random
import re
import threading

import pytest
from textual.widgets import Input, RichLog

from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.widgets.request_table import RequestTable
from tests.tui_helpers import Notes, keys_at_once, replay_app, tiny_app, visible_tab, wait_until

pytestmark = pytest.mark.anyio
TABS = {"1": "dashboard", "2": "xray", "3": "narrator", "4": "tutorial", "5": "blocks"}


def plain(app, selector: str) -> str:
    return str(app.query_one(selector).render())


# ---------------------------------------------------------------------------------------------- 1


async def test_the_last_tab_key_wins_however_fast_tab_keys_come(tmp_path):
    rng = random.Random(15)
    app = replay_app(tmp_path, start_paused=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("escape")
        for burst in range(8):
            keys = [rng.choice("12345") for _ in range(rng.randint(2, 7))]
            keys_at_once(app, *keys)
            want = TABS[keys[-1]]
            await wait_until(pilot, lambda: visible_tab(app) == want, timeout=10, what=f"tab {want} after {keys}")
            await pilot.pause(0.3)  # nothing may switch it back without a key
            assert visible_tab(app) == want, f"burst {burst}: {keys} ended on {visible_tab(app)}"
            assert app.focused in app.query_one(f"#{want}-view").query("*").nodes + [app.query_one(f"#{want}-view")]
            assert app.bridge.subscription.xray == (want == "xray")
            assert app.bridge.subscription.blocks == (want in ("blocks", "narrator"))


# ---------------------------------------------------------------------------------------------- 2


async def test_keys_pressed_while_the_model_loads_act_in_order_in_the_right_widget(
        tiny_llama_dir, tmp_path, monkeypatch):
    from nanovllm_core.engine.controller import EngineController
    from nanovllm_core.engine.llm_engine import LLMEngine
    from nanovllm_tui.starter import BackgroundController
    from nanovllm_tui.widgets.prompt_bar import PromptSettings

    loading = threading.Event()
    load = LLMEngine.from_config.__func__
    monkeypatch.setattr(LLMEngine, "from_config",
                        classmethod(lambda cls, *a, **kw: loading.wait(30) and load(cls, *a, **kw)))
    app = NanoVLLMApp(BackgroundController(lambda: EngineController(model=str(tiny_llama_dir), num_kv_blocks=32)),
                      settings=PromptSettings(max_tokens=3), tutorial_path=tmp_path / "t.json")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        # type a prompt, send it, leave the bar, pause, ask for one step, then tabs: all before any is handled
        keys_at_once(app, *"Hello", "enter", "escape", "space", "n", "2", "3", "5", "1")
        await wait_until(pilot, lambda: visible_tab(app) == "dashboard" and app.state.requests, timeout=10,
                         what="the keys to be handled")
        await pilot.pause(0.3)
        [req] = app.state.requests.values()
        assert req.prompt == "Hello" and app.query_one("#prompt", Input).value == ""
        assert isinstance(app.focused, RequestTable) and visible_tab(app) == "dashboard"
        # asked for, confirmed by the engine once it exists (issue 29: the header shows what the engine confirmed)
        assert app.state.pending == "pausing" and "will start paused" in plain(app, "#header")
        loading.set()  # the engine starts paused and runs the one step asked for
        await wait_until(pilot, lambda: req.num_output == 1 and app.controller.state == "paused", timeout=60,
                         what="exactly one step")
        await pilot.pause(0.3)
        assert req.num_output == 1


async def test_a_paste_then_enter_sends_the_pasted_prompt(tiny_llama_dir, tmp_path):
    from textual import events

    app = tiny_app(tiny_llama_dir, tmp_path, start_paused=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        paste = events.Paste("Once upon a time\nand more")
        paste.set_sender(app)
        app._driver.send_message(paste)
        keys_at_once(app, "enter", "escape", "2")
        await wait_until(pilot, lambda: app.state.requests and visible_tab(app) == "xray", timeout=10,
                         what="the prompt sent and the X-Ray tab")
        assert app.state.requests[app.selected].prompt == "Once upon a time\nand more"  # every line (trial 10)
        assert app.query_one("#prompt", Input).value == "" and visible_tab(app) == "xray"


# ---------------------------------------------------------------------------------------------- 3, 4


@pytest.mark.parametrize("field, typed, why", [
    ("temperature", "1e999", "temperature must be a number from 0 (greedy) to 3.4e+38, float32's largest, not '1e999'"),
    # trial 39a: within float but past the engine's float32 bound, refused after Enter instead of at the field
    ("temperature", "1e308", "temperature must be a number from 0 (greedy) to 3.4e+38, float32's largest, not '1e308'"),
    ("temperature", "0.5[red]", "temperature must be a number from 0 (greedy) to 3.4e+38, float32's largest, not "
                                "'0.5[red]'"),  # not markup
    ("priority", "1.5", "priority must be a whole number from -1000 to 1000 (higher runs first; vLLM's priority is the opposite), not '1.5'"),
    ("priority", "99999999999999999999999", "priority must be a whole number from -1000 to 1000"),
    ("max-tokens", "100000", "max tokens must be a whole number from 1 to 512 (the max_model_len of the engine it goes to: here or the server's)"),
])
async def test_a_wrong_setting_is_marked_at_its_field_and_the_prompt_is_kept(tiny_llama_dir, tmp_path, field,
                                                                             typed, why):
    app, notes = tiny_app(tiny_llama_dir, tmp_path), Notes()
    async with app.run_test(size=(80, 24), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        recorded = set(app.state.requests)
        await pilot.click(f"#{field}")
        await pilot.press("end", "ctrl+u", *typed)  # typed as a person would: nothing dropped
        setting = app.query_one(f"#{field}", Input)
        assert setting.value == typed and setting.has_class("-invalid")
        assert why in plain(app, "#prompt-error") and app.query_one("#prompt-error").display
        await pilot.click("#prompt")
        await pilot.press(*"Once upon a time", "enter")
        assert app.query_one("#prompt", Input).value == "Once upon a time"  # not sent, so not cleared
        assert set(app.state.requests) == recorded and notes.find(why, "error")
        assert app.focused is setting  # the field to fix


async def test_fixing_the_setting_clears_its_mark_and_enter_sends(tiny_llama_dir, tmp_path):
    app = tiny_app(tiny_llama_dir, tmp_path, start_paused=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await pilot.click("#priority")
        await pilot.press("end", "ctrl+u", *"1.5")
        assert app.query_one("#prompt-bar").has_class("-invalid")
        await pilot.press("backspace", "backspace")
        assert not app.query_one("#prompt-bar").has_class("-invalid") and not app.query_one("#prompt-error").display
        await pilot.click("#prompt")
        await pilot.press(*"Hi", "enter")
        await wait_until(pilot, lambda: app.state.requests, timeout=10, what="the prompt sent")
        assert app.query_one("#prompt", Input).value == ""
        assert app.state.requests[app.selected].priority == 1 and app.state.requests[app.selected].prompt == "Hi"


def test_every_table_cell_shows_its_whole_value():
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.widgets.request_table import column_widths, join_cells, row_cells

    state = EngineState()
    req = state.submitted("req-1234567", "a prompt", 99999999999999999999999, 100000)
    req.state, req.prompt_len, req.prefilled, req.num_output = "running", 12345, 12345, 1570
    req.added_time, req.first_token_time, req.last_token_time = 0.0, 123.4, 200.0
    cells = [row_cells(r) for r in state.requests.values()]
    line = join_cells(cells[0], column_widths(cells)).plain
    for whole in ("req-1234567", "99999999999999999999999", "12345/12345", "1570/100000", "123.4 s", "49 ms"):
        assert whole in line, (whole, line)


# ---------------------------------------------------------------------------------------------- 5, 10


async def test_idle_says_idle_not_a_rate_and_labels_the_last_run(tmp_path):
    """Trial 24d #4: the headline read "0 tok/s", as if measured, beside the last steps' measured rate."""
    app = replay_app(tmp_path, start_paused=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.controller.state == "idle" and app.state.engine_state == "idle",
                         timeout=20, what="the recording's end")
        await pilot.pause(0.2)
        decode = plain(app, "#decode-rate") + plain(app, "#decode-spark")
        assert "decode  idle" in decode and "0 tok/s" not in decode, decode
        assert re.search(r" last \d+ steps? [1-9]", decode), decode
        assert "last step 7:" in plain(app, "#phase") and "IDLE" in plain(app, "#phase")


async def test_the_decode_sparkline_starts_at_zero(tmp_path):
    app = replay_app(tmp_path)  # paused: step 0 is a prefill, so no decode happened yet
    async with app.run_test(size=(120, 40)) as pilot:
        app.controller.step(1)
        await wait_until(pilot, lambda: app.state.step == 0 and app.state.timings, timeout=10)
        await pilot.pause(0.2)
        # paused, one step taken with n: each headline says paused (trial 24d #4: "prefill 0 tok/s" beside
        # the step's measured rate), the measured rate is named as the last step's
        assert plain(app, "#decode-rate").strip() == "decode  paused"
        assert plain(app, "#prefill-rate").strip() == "prefill paused"
        assert re.search(r" last 1 step [0-9.,k]+ tok/s", plain(app, "#prefill-spark")), plain(app, "#prefill-spark")
        decode = plain(app, "#decode-spark")  # no bar for a 0 tok/s step, and no decode step kept (trial 33a)
        assert "none in the last 1 step" in decode and not set(decode.split(" none ")[0]) - {" "}, decode
        assert set(plain(app, "#prefill-spark").split(" last ")[0].strip()) == {"█"}


async def test_holding_n_while_running_says_its_warning_once(tmp_path):
    from nanovllm_tui.replay import ReplayController, load_trace
    from tests.tui_helpers import TRACE

    app = NanoVLLMApp(ReplayController(load_trace(TRACE), pace=(5.0, 5.0)), tutorial_path=tmp_path / "t.json")
    notes = Notes()
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await pilot.press("escape", *"n" * 8)
        await pilot.pause(0.2)
        assert len(notes.find("n runs one step while the engine is paused")) == 1


@pytest.mark.parametrize("size", [(60, 20), (80, 24), (99, 30), (200, 60)])
async def test_the_header_keeps_the_app_name_and_the_state_at_any_width(tmp_path, size):
    app = replay_app(tmp_path)
    async with app.run_test(size=size) as pilot:
        app.controller.step(2)
        await wait_until(pilot, lambda: app.state.step == 1, timeout=10)
        await pilot.pause(0.2)
        header = plain(app, "#header")
        assert header.startswith("nano-vLLM replay │") and "● paused" in header
        assert len(header) <= size[0] - 2


# ---------------------------------------------------------------------------------------------- 8


@pytest.mark.parametrize("size", [(60, 20), (80, 24)])
async def test_the_narrator_wraps_and_never_cuts_a_line(tmp_path, size):
    app = replay_app(tmp_path, start_paused=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.controller.state == "idle", timeout=20)
        await pilot.press("escape", "3")
        await pilot.pause(0.2)
        await pilot.resize_terminal(*size)  # written at 120 columns, then the terminal narrows
        await pilot.pause(0.3)
        log = app.query_one("#narration", RichLog)
        width = log.scrollable_content_region.width
        assert len(log.lines) > 20 and max(strip.cell_length for strip in log.lines) <= width
        assert log.max_scroll_x == 0


def _backlog_note(i: int):
    """A decode-like narrator entry of ~10 lines (headline, wrapped text, a 5-row table); the table's last
    row names the entry, so the bottom row of a log scrolled to its end says which entry is newest."""
    from nanovllm_core.educational.commentary import Commentary

    return Commentary(kind="decode", title=f"Entry {i}", text="word " * 40, request_id=None, step=i,
                      table=tuple((f"e{i}-tok{k}", 0.1 * k) for k in range(4)) + ((f"newest-check-{i}", 0.5),),
                      table_title="top", table_notes=("",) * 5)


# Newcomer trial 10: once the Narrator had been shown, entries that came while another tab was shown
# were written on its next showing before the tab was laid out (the log's width still 0), and
# RichLog wrapped them at its min_width: the whole entry one character a line, for good.
@pytest.mark.parametrize("at_once", [False, True])
async def test_entries_that_came_while_the_narrator_was_hidden_are_wrapped_at_its_width(tmp_path, at_once):
    from nanovllm_tui.views.narrator import NarratorView

    app = replay_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.paused, timeout=20, what="the paused replay")
        await pilot.press("escape", "3")
        log, view = app.query_one("#narration", RichLog), app.query_one(NarratorView)
        await wait_until(pilot, lambda: len(log.lines) > 3, timeout=10, what="the first entries")
        await pilot.press("1")
        await pilot.pause()
        view.add([_backlog_note(i) for i in range(3)])  # as the engine narrates while the Dashboard shows
        if at_once:
            keys_at_once(app, "2", "3")
        else:
            await pilot.press("3")
        await wait_until(pilot, lambda: not view.pending, timeout=10, what="the hidden entries written")
        width = log.scrollable_content_region.width
        assert width > 80 and min(strip.cell_length for strip in log.lines) > 2  # none wrapped at 1 cell
        assert any("word word word word" in strip.text for strip in log.lines)
        await wait_until(pilot, lambda: any("newest-check-2" in row for row in _log_rows(app)), timeout=10,
                         what="the newest hidden entry on screen")


def _log_rows(app) -> list[str]:
    """The narrator log's rows as the screen shows them (the compositor's full render, borders cut off)."""
    log = app.query_one("#narration", RichLog)
    region = log.scrollable_content_region
    lines = app.screen._compositor.render_strips()  # the whole screen, as a full repaint draws it
    return [line.text[region.x:region.right] for line in lines[region.y:region.bottom]]


# The "blank Narrator" (trials 7, 11, 12; reproduced in a terminal on 2026-12-07: a prompt answered on the
# Dashboard, then Esc 3: the Narrator stayed blank, the engine idle): the tab just shown was not laid out when
# its first slice came due, and the one later look found it not yet on screen; with no engine event after
# it, nothing looked again. Here the first looks find it off screen, as the terminal did; the entries must
# still come, with no event and no key.
async def test_the_narrator_just_shown_fills_itself_though_its_first_looks_find_it_not_laid_out(tmp_path,
                                                                                                monkeypatch):
    from nanovllm_tui.views.narrator import NarratorView

    app = replay_app(tmp_path)  # paused: no engine event comes meanwhile
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.paused, timeout=20, what="the paused replay")
        view = app.query_one(NarratorView)
        view.add([_backlog_note(i) for i in range(20)])
        real = NarratorView.is_on_screen
        looks = []

        def late_layout(self) -> bool:
            looks.append(1)
            return len(looks) > 3 and real.fget(self)

        monkeypatch.setattr(NarratorView, "is_on_screen", property(late_layout))
        await pilot.press("escape", "3")
        await wait_until(pilot, lambda: any("newest-check-19" in row for row in _log_rows(app)), timeout=10,
                         what="the queued entries on the Narrator with the engine idle")
        assert len(looks) > 3 and not view.pending


# Newcomer trial 7: the Narrator tab, hidden all session (its queue full: MAX_PENDING entries, more lines than
# the log's MAX_LINES), was once shown blank when first opened with 2 then 3 while paused; End, Home, f and n
# left it blank, 1 then 3 brought the text back. Not reproduced here (see the report); this holds the case.
@pytest.mark.parametrize("size,at_once", [((120, 40), False), ((60, 20), True)])
async def test_the_narrator_shown_first_after_a_full_hidden_queue_shows_its_newest_entries(tmp_path, size, at_once):
    from nanovllm_tui.views.narrator import MAX_LINES, MAX_PENDING, WRITE_SLICE, NarratorView

    app = replay_app(tmp_path)  # paused, as in the trial
    async with app.run_test(size=size) as pilot:
        await wait_until(pilot, lambda: app.state.paused, timeout=20, what="the paused replay")
        view = app.query_one(NarratorView)
        count = MAX_PENDING + 150
        for start in range(0, count, 50):  # queued while the tab is hidden, a frame's worth at a time
            view.add([_backlog_note(i) for i in range(start, start + 50)])
            await pilot.pause(0.01)
        assert len(view.pending) == MAX_PENDING and view.skipped >= 150  # (and the replay's own first notes)
        await pilot.press("escape", "1")
        if at_once:
            keys_at_once(app, "2", "3")  # as a terminal delivers them to a busy app
        else:
            await pilot.press("2")
            await pilot.pause(0.2)
            await pilot.press("3")
        log = app.query_one("#narration", RichLog)
        newest = f"newest-check-{count - 1}"

        def shows_newest() -> bool:
            rows = _log_rows(app)
            return log.scroll_y == log.max_scroll_y > 0 and bool(rows) and newest in rows[-1]

        await wait_until(pilot, shows_newest, timeout=30, what="the newest entry at the log's bottom row")
        assert visible_tab(app) == "narrator" and len(log.lines) == MAX_LINES
        assert sum(1 for row in _log_rows(app) if row.strip()) == log.scrollable_content_region.height  # no blank row
        await pilot.press("home")
        await wait_until(pilot, lambda: log.scroll_y == 0 and any(r.strip() for r in _log_rows(app)), timeout=10,
                         what="the oldest kept lines at the top")
        await pilot.press("end")
        await wait_until(pilot, shows_newest, timeout=10, what="the newest entry again after End")
        if not at_once:  # (once is enough: each f writes the whole history again)
            await pilot.press("f", "f")  # written again from the kept history: still the newest at the bottom
            await wait_until(pilot, shows_newest, timeout=30, what="the newest entry after f f")
        # A backlog is written a slice a frame, so the window keeps answering keys meanwhile (writing all
        # MAX_PENDING entries at once held the UI thread for seconds on a busy 2-core host, the box drawn empty).
        assert not view.pending
        view.add([_backlog_note(i) for i in range(count, count + 3 * WRITE_SLICE)])
        view.update_view(app.state, app.selected)
        assert len(view.pending) == 2 * WRITE_SLICE  # one slice now, the rest on the frames that follow
        newest = f"newest-check-{count + 3 * WRITE_SLICE - 1}"
        await wait_until(pilot, shows_newest, timeout=30, what="the whole backlog written, newest at the bottom")
        assert not view.pending


def test_the_header_names_block_weights_beside_the_dtype():
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.widgets.status_header import StatusHeader

    shown = []
    header = StatusHeader()
    header.show_content = shown.append
    state = EngineState()
    state.ready, state.model_name, state.device, state.dtype = True, "SmolLM2", "cpu", "float32"
    header.show(state)
    assert "cpu · float32 │" in shown[-1].plain and "weights" not in shown[-1].plain
    state.model_info = {"quantization": "q8_0"}
    header.show(state)
    assert "SmolLM2 · cpu · float32 · q8_0 weights │" in shown[-1].plain


@pytest.mark.parametrize("size", [(120, 40), (60, 20)])
async def test_an_error_toast_leaves_the_prompt_bars_reason_in_view(tiny_llama_dir, tmp_path, size):
    from textual.widgets._toast import Toast

    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=size, notifications=True) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await pilot.click("#max-tokens")
        await pilot.press("end", "ctrl+u", *"abc")
        await pilot.click("#prompt")
        await pilot.press(*"Hi", "enter")  # not sent: the toast and the red line both say why
        await wait_until(pilot, lambda: list(app.screen.query(Toast)), timeout=10, what="the toast")
        await pilot.pause(0.3)
        toasts = [t for t in app.screen.query(Toast) if t.parent.display]  # the ones in view
        assert toasts and "Not sent: max tokens" in str(toasts[-1].render())  # the newest among them
        reason = app.query_one("#prompt-error").region
        assert reason.height and all(not t.region.overlaps(reason) for t in toasts)
        assert all(not t.region.overlaps(app.query_one("#prompt-bar").region) for t in toasts)


async def test_slash_in_the_prompt_bar_types_a_slash(tiny_llama_dir, tmp_path):
    """Issue 29: '/' is the key that moves to the prompt; in the prompt it is text, in a number field
    (priority, max tokens, temperature) it moves to the prompt as everywhere else."""
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await pilot.press("escape", "slash")  # from a view: '/' moves to the prompt and types nothing
        assert app.focused is app.query_one("#prompt") and app.focused.value == ""
        await pilot.press(*"a/b", "slash")
        assert app.query_one("#prompt", Input).value == "a/b/"
        await pilot.click("#max-tokens")
        await pilot.press("end", "slash")  # a number field takes no '/': it goes to the prompt, as the footer says
        assert app.focused is app.query_one("#prompt") and app.query_one("#max-tokens").value == "3"
        assert app.query_one("#prompt", Input).value == "a/b/"  # and types nothing there


@pytest.mark.parametrize("size", [(60, 20), (79, 40), (80, 24), (120, 40)])
async def test_the_prompt_keeps_a_usable_width_and_every_setting_stays_in_view(tiny_llama_dir, tmp_path, size):
    """Issue 29: at 60x20 the settings and the chat box left the prompt 5 characters wide. Below
    80 columns they take a line of their own under the prompt; every one stays on screen."""
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=size) as pilot:
        await pilot.pause(0.2)
        prompt = app.query_one("#prompt").region
        screen = app.screen.region
        assert prompt.width >= min(size[0], 80) - 54, prompt  # the settings take 54 columns beside it at most
        assert prompt.width >= 26 and screen.contains_region(prompt)
        for part in ("#priority", "#max-tokens", "#temperature", "#chat"):
            region = app.query_one(part).region
            assert region.width and screen.contains_region(region), (part, region)
            assert not region.overlaps(prompt), part
        one_line = app.query_one("#chat").region.y == prompt.y + (0 if size[1] < 30 else 1)
        assert one_line == (size[0] >= 80)
        await pilot.press(*"Once upon a time there was")
        assert app.query_one("#prompt", Input).value == "Once upon a time there was"


async def test_tab_goes_through_the_settings_in_order_and_keys_on_the_chat_box_are_not_app_keys(
        tiny_llama_dir, tmp_path):
    """Issue 29: the first Tab went to the chat box, not to priority as the docs say, and digits
    typed there switched tabs (Tab then 5000 showed the Block Map)."""
    app, notes = tiny_app(tiny_llama_dir, tmp_path), Notes()
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await pilot.pause(0.1)
        assert app.focused is app.query_one("#prompt")
        for expected in ("priority", "max-tokens", "temperature", "chat"):
            await pilot.press("tab")
            assert app.focused is app.query_one(f"#{expected}"), (expected, app.focused)
        # trial 37a: a Tab past the chat box left the bar, and an Enter typed next sent nothing, saying nothing
        await pilot.press("tab")
        assert app.focused is app.query_one("#prompt"), app.focused
        await pilot.press("shift+tab")
        assert app.focused is app.query_one("#chat"), app.focused
        await pilot.press(*"5000", "q", "n")
        assert visible_tab(app) == "dashboard" and app.is_running and app.focused is app.query_one("#chat")
        assert notes.find("Esc leaves the prompt bar", "warning")
        chat = app.query_one("#chat").value
        await pilot.press("space")
        assert app.query_one("#chat").value != chat and not app.state.paused  # space ticks the box there
        await pilot.press("slash")
        assert app.focused is app.query_one("#prompt")


@pytest.mark.parametrize("field", ["temperature", "priority", "max-tokens"])
async def test_a_huge_bad_value_is_quoted_short(tiny_llama_dir, tmp_path, field):
    """Issue 29: a 54 KB paste into temp was quoted whole under the bar and covered the screen."""
    from textual import events

    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.click(f"#{field}")
        await pilot.press("end", "ctrl+u")
        app.post_message(events.Paste("x" * 54_000))
        await wait_until(pilot, lambda: len(app.query_one(f"#{field}", Input).value) == 54_000, 10, "the paste")
        await pilot.pause(0.1)
        why = plain(app, "#prompt-error")
        assert "not 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'…" in why and len(why) < 200, why
        assert app.query_one("#prompt-error").region.height <= 2


async def test_the_selected_requests_paused_note_is_true_while_paused_and_after(tiny_llama_dir, tmp_path):
    """Issue 29: "2479 ms paused" in the selected request's title did not move while the engine was
    held (it counts at each token). While paused it says "paused now"; once the request ends, the
    whole time held, the pause included."""
    from nanovllm_tui.widgets.live import LiveStatic

    app = tiny_app(tiny_llama_dir, tmp_path, start_paused=True, max_tokens=3)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await pilot.press(*"Hi", "enter", "escape", "n")  # one step: its prefill and first token
        rid = app.selected
        await wait_until(pilot, lambda: app.state.requests[rid].num_output == 1, 10, "the first token")
        title = lambda: app.query_one("#output", LiveStatic).border_title  # noqa: E731
        await wait_until(pilot, lambda: "paused now" in title(), 5, "the note")
        assert "(not in TTFT/TPOT)" in title() and "ms paused" not in title()
        await pilot.pause(0.4)
        await pilot.press("space")
        await wait_until(pilot, lambda: app.state.requests[rid].state == "finished", 10, "the request to finish")
        await wait_until(pilot, lambda: "paused now" not in title(), 5, "the note to change")
        held = re.search(r"([\d.]+) (m?s) paused \(not in TTFT/TPOT\)", title())
        assert held, title()
        assert float(held.group(1)) * (1 if held.group(2) == "s" else 1e-3) >= 0.4  # the pause is counted


def _cut_trace(tmp_path, keep_lines: int, cut_at: int = 30):
    """The recorded trace's first ``keep_lines`` lines, then the next one cut after ``cut_at`` characters."""
    import gzip

    from tests.tui_helpers import TRACE

    lines = gzip.open(TRACE, "rt", encoding="utf-8").read().splitlines(keepends=True)
    path = tmp_path / "cut.jsonl"
    path.write_text("".join(lines[:keep_lines]) + lines[keep_lines][:cut_at], encoding="utf-8")
    return path, lines


def test_a_trace_cut_mid_line_plays_up_to_its_last_whole_line_and_a_bad_middle_line_is_an_error(tmp_path):
    from nanovllm_tui.replay import load_trace

    path, lines = _cut_trace(tmp_path, keep_lines=len(lines_of_trace()) // 2)
    trace = load_trace(path)
    assert trace.cut_line == len(lines) // 2 + 1 and len(trace) == len(lines) // 2
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(lines), encoding="utf-8")
    assert load_trace(whole).cut_line is None
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(lines[:5]) + lines[5][:30] + "\n" + "".join(lines[6:]), encoding="utf-8")
    with pytest.raises(ValueError, match="line 6: "):
        load_trace(broken)


def lines_of_trace():
    import gzip

    from tests.tui_helpers import TRACE

    return gzip.open(TRACE, "rt", encoding="utf-8").read().splitlines()


async def test_a_cut_replay_says_so_and_its_end_names_the_unfinished_requests(tmp_path):
    """Issue 29: a trace cut mid-line was refused whole, and at a replay's end the header said
    "idle" beside requests listed "running"."""
    lines = lines_of_trace()
    keep = next(i for i, line in enumerate(lines) if i > len(lines) // 3 and '"StepPlanned"' in line)
    path, _ = _cut_trace(tmp_path, keep_lines=keep)
    app, notes = replay_app(tmp_path, start_paused=False, trace=path), Notes()
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: notes.find(f"ends in a cut line (line {keep + 1}"), 10, "the note")
        assert not notes.find("", "error")
        await wait_until(pilot, lambda: app.controller.state == "idle", timeout=30, what="the replay's end")
        await wait_until(pilot, lambda: app.state.unfinished is not None, 5, "the header's next look")
        unfinished = app.state.unfinished
        assert unfinished, "the cut should fall while requests run"
        header = plain(app, "#header")
        # trial 11: it gave only a count; the rows still said running and the Engine panel DECODE
        # (trial 12: named as requests where the line has room, else counted; test_tui_trial12)
        from nanovllm_tui.widgets.status_header import unfinished_text
        assert "ended" in header and (unfinished_text(unfinished) in header
                                      or f"{len(unfinished)} requests unfinished" in header), header
        assert "idle" not in header
        assert not app.state.active_requests
        assert all(app.state.requests[rid].state == "unfinished" for rid in unfinished)
        from nanovllm_tui.views.dashboard import phase_text
        engine = phase_text(app.state).plain
        # the queues as the last step left them (trial 12: "0 running" beside "2 decode")
        assert engine.startswith("RECORDING ENDED") and "DECODE" not in engine and "0 running" not in engine, engine


@pytest.mark.parametrize("size", [(60, 40), (60, 20), (120, 40)])
async def test_the_block_maps_summary_and_legend_wrap_instead_of_being_cut(tmp_path, size):
    """Newcomer trial 3: below ~116 columns the Block Map's summary lost "cached-free ... free ...
    hit rate ... step" and the legend stopped at "◆◆ shared" (fixed heights of 1 and 2 lines)."""
    from nanovllm_tui.views.block_map import legend_text, summary_text

    app = replay_app(tmp_path)
    async with app.run_test(size=size) as pilot:
        app.controller.step(3)
        await wait_until(pilot, lambda: app.state.step == 2 and app.state.blocks is not None, timeout=10,
                         what="three recorded steps")
        await pilot.press("escape", "5")
        await pilot.pause(0.3)
        blocks = app.state.blocks
        for wid, text in (("#blocks-summary", summary_text(blocks)), ("#legend", legend_text(blocks, {}))):
            widget = app.query_one(wid)
            needed = len(text.wrap(app.console, widget.content_region.width))
            assert widget.content_region.height >= needed > 0, (wid, widget.content_region, needed)
        assert "hit rate" in summary_text(blocks).plain and "selected" in legend_text(blocks, {}).plain


@pytest.mark.parametrize("size", [(120, 40), (60, 40), (60, 20)])
async def test_the_prompt_bars_settings_show_every_allowed_value_whole(tmp_path, size):
    """Newcomer trial 3: at 120 columns priority 1000 read "prio 000", max 8192 "max 192", also
    after the focus left. The fields hold the widest allowed value and the cursor."""
    from nanovllm_tui.starter import BackgroundController
    from nanovllm_core.engine.controller import EngineController

    app = NanoVLLMApp(BackgroundController(lambda: EngineController(model=str(tmp_path / "none"))),
                      tutorial_path=tmp_path / "t.json")
    async with app.run_test(size=size) as pilot:
        async def typed(name: str, value: str) -> Input:
            field = app.query_one(f"#{name}", Input)
            field.focus()
            field.value = ""
            await pilot.press(*value)
            return field

        for name, value in (("priority", "-1000"), ("priority", "1000"), ("max-tokens", "131072"),
                            ("temperature", "0.75")):
            field = await typed(name, value)
            await pilot.press("tab")  # the focus leaves
            await pilot.pause(0.1)
            shown = "".join(seg.text for seg in field.render_line(field.size.height // 2))
            assert shown.strip() == value, (name, value, shown)
        # Trial 21d: any value, also while focused: a 7-cell field scrolled one cell for the cursor,
        # so "---5000" showed as "--5000" beside the line under the bar saying '---5000'. A field
        # shows its value whole or marks the side where text is hidden with "…".
        for name, value in (("priority", "---5000"), ("max-tokens", "9999999"), ("priority", "12345678901"),
                            ("temperature", "0.125")):
            field = await typed(name, value)
            for moves in ((), ("home",), ("tab",)):  # the cursor at the end, at the start, the focus gone
                await pilot.press(*moves)
                await pilot.pause(0.1)
                shown = "".join(seg.text for seg in field.render_line(field.size.height // 2)).strip()
                whole = shown == value
                start_hidden = shown.startswith("…") and value.endswith(shown[1:].rstrip("…"))
                end_hidden = shown.endswith("…") and value.startswith(shown[:-1].lstrip("…"))
                assert whole or start_hidden or end_hidden, (name, value, moves, shown)
                assert whole or len(value) > 6, (name, value, moves, shown)
                if moves == ("tab",):
                    app.query_one("#prompt").focus()
        assert app.query_one("#prompt-settings").region.right <= size[0]  # the settings still fit
