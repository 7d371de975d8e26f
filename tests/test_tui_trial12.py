"""Newcomer trial 12 (issue 29): a cut recording's end shows the queues the last step played left
(it said "0 running" beside "2 decode") and keeps the header of the whole recording (it dropped the
weights' formats), naming the unfinished requests as requests; the Dashboard says when its
request table has columns off-screen; every quiz option is reachable at 60x20; the ready toast
names the weight format as the header does (12b)."""

from __future__ import annotations

import gzip
import json

import pytest

from nanovllm_core import events as ev
from nanovllm_tui.views.dashboard import phase_text
from nanovllm_tui.widgets.request_table import RequestTable
from nanovllm_tui.widgets.status_header import unfinished_text
from tests.tui_helpers import TRACE, Notes, replay_app, tiny_app, wait_until

pytestmark = pytest.mark.anyio


def plain(app, selector: str) -> str:
    return str(app.query_one(selector).render())


def gguf_trace(tmp_path):
    """The recorded trace with its model's weights said to be a q4_1+q8_0 gguf file (as trial 12's
    trace was): the whole trace, and the same cut in the middle of a step's first line."""
    lines = gzip.open(TRACE, "rt", encoding="utf-8").read().splitlines(keepends=True)
    first = json.loads(lines[0])
    first["model_info"] = sorted(first["model_info"] + [["quantization", "gguf"], ["weight_kinds", "q4_1+q8_0"]])
    lines[0] = json.dumps(first) + "\n"
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(lines), encoding="utf-8")
    keep = next(i for i, line in enumerate(lines) if i > len(lines) // 3 and '"StepPlanned"' in line)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:keep]) + lines[keep][:30], encoding="utf-8")
    return whole, cut, sum('"StepPlanned"' in line for line in lines[:keep])


async def test_a_cut_replays_end_shows_the_last_step_played_as_the_whole_replay_does(tmp_path):
    whole, cut, steps = gguf_trace(tmp_path)
    app = replay_app(tmp_path, start_paused=True, trace=whole)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("escape")
        app.controller.step(steps)
        await wait_until(pilot, lambda: app.controller.steps_played == steps and app.state.step is not None
                         and app.state.step_open is False, 10, "the same step in the whole replay")
        await pilot.pause(0.3)
        whole_header, whole_engine = plain(app, "#header"), phase_text(app.state).plain
    app = replay_app(tmp_path, start_paused=False, trace=cut)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.state.unfinished is not None, 30, "the cut replay's end")
        await pilot.pause(0.3)
        header, engine = plain(app, "#header"), phase_text(app.state).plain
        unfinished = app.state.unfinished
        rows = app.query_one(RequestTable).rows
        row_states = {rid: rows[rid][1].plain for rid in unfinished}
    assert unfinished, "the cut should fall while requests run"
    # the Engine panel: the last step's queues, as the whole replay at that step (it said 0 running)
    assert engine.startswith("RECORDING ENDED"), engine
    assert engine.splitlines()[1:] == whole_engine.splitlines()[1:], (engine, whole_engine)
    running = int(engine.splitlines()[-1].split(" running")[0])
    assert running and running == sum(state == "unfinished (running)" for state in row_states.values()), row_states
    # the header: the model's facts as the whole replay shows them, less the weights' formats only where
    # the unfinished requests' names need their room (trial 16: counted while the names fit without them)
    assert "q4_1+q8_0 gguf" in whole_header
    assert header.split(" │ ●")[0] in (whole_header.split(" │ ●")[0],
                                       whole_header.split(" │ ●")[0].replace(" · q4_1+q8_0 gguf", "")), \
        (header, whole_header)
    assert "ended" in header and f"{len(unfinished)} requests unfinished" in header or \
        unfinished_text(unfinished) in header, header
    if "q4_1+q8_0 gguf" not in header:
        assert unfinished_text(unfinished) in header, header
    assert f"{', '.join(unfinished)} unfinished in it" not in header


async def test_a_wide_header_names_the_unfinished_requests(tmp_path):
    _, cut, _ = gguf_trace(tmp_path)
    app = replay_app(tmp_path, start_paused=False, trace=cut)
    async with app.run_test(size=(160, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.unfinished is not None, 30, "the cut replay's end")
        await pilot.pause(0.3)
        header = plain(app, "#header")
    assert "recording ended" in header and f"· {unfinished_text(app.state.unfinished)}" in header, header
    assert "q4_1+q8_0 gguf" in header


@pytest.mark.parametrize("ids, text", [
    (["0"], "request 0 unfinished"),
    (["0", "1"], "requests 0 and 1 unfinished"),
    (["0", "1", "2"], "requests 0, 1 and 2 unfinished"),
    (["a", "b", "c", "d"], "requests a, b, c and 1 more unfinished"),
    ([str(i) for i in range(7)], "requests 0, 1, 2 and 4 more unfinished"),
])
def test_the_unfinished_requests_read_as_ids_not_counts(ids, text):
    assert unfinished_text(ids) == text


async def test_the_prompt_bar_marks_a_priority_the_engines_fcfs_policy_refuses(make_tiny_engine, tmp_path):
    """Trial 12: under `--scheduling-policy fcfs` the bar sent priority 1 and the engine ignored it;
    vLLM refuses it. The bar marks the field by the engine's rule, as it marks any wrong setting."""
    from textual.widgets import Input

    from tests.tui_helpers import Notes, engine_app

    app, notes = engine_app(make_tiny_engine, tmp_path, scheduling_policy="fcfs"), Notes()
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, 30, "the engine")
        await pilot.pause(0.2)
        field = app.query_one("#priority", Input)
        assert not field.has_class("-invalid")  # 0 is fcfs's own
        await pilot.click("#priority")
        await pilot.press("end", "ctrl+u", "2")
        why = plain(app, "#prompt-error")
        assert field.has_class("-invalid") and "priority must be 0 while the engine schedules fcfs" in why, why
        assert "--scheduling-policy priority" in why and app.query_one("#prompt-error").display
        await pilot.click("#prompt")
        await pilot.press(*"Hi", "enter")
        assert not app.state.requests and app.query_one("#prompt", Input).value == "Hi"  # not sent
        await pilot.click("#priority")
        await pilot.press("end", "ctrl+u", "0")
        assert not field.has_class("-invalid") and not app.query_one("#prompt-error").display


# ---------------------------------------------------------------------------------------------- 3


def table_lines(app) -> list[str]:
    """The request table's lines as drawn now."""
    table = app.query_one(RequestTable)
    return ["".join(seg.text for seg in table.render_line(y)) for y in range(table.scrollable_content_region.height)]


async def _three_requests_on_the_dashboard(pilot) -> RequestTable:
    """Show the Dashboard of a paused replay, play three steps (three requests), return its request table."""
    app = pilot.app
    await pilot.press("escape", "1")
    app.controller.step(3)
    await wait_until(pilot, lambda: app.controller.steps_played == 3 and len(app.state.requests) == 3, 10,
                     "three requests")
    await pilot.pause(0.3)
    return app.query_one(RequestTable)


@pytest.mark.parametrize("size", [(60, 20), (80, 24), (120, 40)])
async def test_the_request_table_says_when_columns_are_off_screen_and_how_to_reach_them(tmp_path, size):
    """Trial 12: at 60x20 the table ended at "decode (" and nothing said it scrolls sideways."""
    app = replay_app(tmp_path, start_paused=True)
    async with app.run_test(size=size) as pilot:
        table = await _three_requests_on_the_dashboard(pilot)
        lines = table_lines(app)
        whole = sum(table.widths) + 1 <= table.scrollable_content_region.width
        if whole:  # every column shown: no hint (and no line taken for one)
            assert not any("off-screen" in line for line in lines), lines
            assert "cached" in lines[0]
            return
        hidden = table.hidden_columns()[1]
        assert hidden and "cached" not in lines[0]
        assert lines[4].strip() == f"→ {hidden} more columns off-screen: ←/→ scroll", lines
        assert all(f"■ {i}" in lines[1 + i] for i in range(3)), lines  # the hint takes no request's row
        assert app.focused is table
        for _ in range(60):
            await pilot.press("right")
        await pilot.pause(0.2)
        lines = table_lines(app)
        assert "cached" in lines[0] and table.hidden_columns()[1] == 0
        assert lines[4].strip().startswith(f"← {table.hidden_columns()[0]} more column"), lines
        app.set_focus(None)  # elsewhere (a live app opens in the prompt bar): the keys say how to get there
        await pilot.pause(0.2)
        assert "Esc, then ←/→ scroll" in table_lines(app)[4]


async def test_every_quiz_option_is_brought_into_view_at_60x20(tmp_path):
    """Trial 12: at 60x20 the quiz box cut option D, and ↓ to it moved the highlight out of sight."""
    from nanovllm_core.educational import tutorial as tut

    app = replay_app(tmp_path)
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.press("escape", "4")
        await pilot.pause(0.3)
        quiz, choices = app.query_one("#quiz"), app.query_one("#choices")
        cut = 0
        for chapter in range(len(tut.CHAPTERS)):
            for index in range(1, 4):
                await pilot.press("down")
                await pilot.pause(0.1)
                assert choices.highlighted == index
                where = choices.option_region(index)
                shown = quiz.scrollable_content_region
                rows = range(shown.y + where.y - int(quiz.scroll_y), shown.y + where.bottom - int(quiz.scroll_y))
                assert shown.y <= rows.start and rows.stop <= shown.bottom, (chapter + 1, index, rows, shown)
                cut += index == 3 and quiz.scroll_y > 0
            await pilot.press("right")
            await pilot.pause(0.2)
        assert cut, "some chapter's option D should lie below the box's fold at 60x20"


# ---------------------------------------------------------------------------------------------- 4


async def test_the_readme_says_the_prompt_bar_takes_the_keys_and_ctrl_q_quits_from_it(tiny_llama_dir, tmp_path):
    """Trial 12: the README's key table listed `1`-`5` and `q` with no word that the app opens in the
    prompt bar, where they type themselves ("3q"); nor that ctrl+q quits (what ctrl+c points to)."""
    import re
    from pathlib import Path

    from textual.widgets import Input

    from tests.tui_helpers import tiny_app, visible_tab

    root = Path(__file__).parents[1]
    readme = " ".join((root / "README.md").read_text(encoding="utf-8").split())
    said = readme[:readme.index("| key | action |")].rsplit("|", 1)[1]  # the sentence above the key table
    assert "opens in the prompt bar" in said and "`Esc` leaves it" in said and "`ctrl+q` quits from anywhere" in said
    app_doc = " ".join((root / "docs" / "app.md").read_text(encoding="utf-8").split())
    assert "opens with the focus in the prompt bar" in app_doc and "`ctrl+q` quits from anywhere" in app_doc
    typed = re.findall(r"`([^`]+)`", said[:said.index("type into")])
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, 30, "the tiny model")
        prompt = app.query_one("#prompt", Input)
        assert app.focused is prompt  # where the app opens
        assert typed[:2] == ["1", "5"], typed  # `1`-`5`
        text = "12345" + "".join({"space": " "}.get(k, k) for k in typed[2:])
        assert set("3q/na[]") <= set(text), typed
        await pilot.press(*[{" ": "space"}.get(c, c) for c in text])
        await pilot.pause(0.2)
        assert prompt.value == text and visible_tab(app) == "dashboard" and app.is_running
        await pilot.press("ctrl+q")  # from the prompt bar
        await pilot.pause(0.5)
        assert not app.is_running


@pytest.mark.parametrize("info, shown", [
    ({"quantization": "gguf", "weight_kinds": "q4_1+q8_0"}, "is ready on cpu (float32 · q4_1+q8_0 gguf)"),
    ({"quantization": "q8_0", "weight_kinds": "q8_0"}, "is ready on cpu (float32 · q8_0 weights)"),
    ({}, "is ready on cpu (float32)"),
])
async def test_the_ready_toast_names_the_weight_format_as_the_header_does(tiny_llama_dir, tmp_path, info, shown):
    """Trial 12b: "SmolLM2-135M-Instruct is ready on cpu (float32)" while Q4_1/Q8_0 GGUF blocks ran
    (the header beside it said "float32 · q4_1+q8_0 gguf"); the local and the attached app alike
    announce the engine's ready event so."""
    notes = Notes()
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the model")
        app._announce(ev.ModelLoading(stage="ready", done=1, total=1, ready=True, model_name="M", device="cpu",
                                      dtype="float32", model_info=tuple(info.items())))
        await pilot.pause(0.1)
        assert notes.find(f"M {shown}"), [n.message for n in notes.items]


@pytest.mark.parametrize("width", [60, 80, 100])
async def test_a_narrow_header_of_a_cut_replay_never_shows_an_empty_segment(tmp_path, width):
    """Trial 13: at 60 and 80 columns the cut replay's header read ``nano-vLLM replay │  │ ● recording ended``:
    the model and the unfinished count were dropped together, the separators kept. Parts now go whole
    (the model with its separator), the count first, and a shorter wording is tried after each drop."""
    _, cut, _ = gguf_trace(tmp_path)
    app = replay_app(tmp_path, start_paused=False, trace=cut)
    async with app.run_test(size=(width, 24)) as pilot:
        await wait_until(pilot, lambda: app.state.unfinished is not None, 30, "the cut replay's end")
        await pilot.pause(0.3)
        header = plain(app, "#header")
        n, names = len(app.state.unfinished), unfinished_text(app.state.unfinished)
    assert "│  │" not in header and not header.rstrip().endswith("│"), header
    assert "ended" in header and len(header.rstrip()) <= width - 2, header
    if width >= 80:  # the line has room for the model and the count (trial 13), or the names (trial 16)
        assert "SmolLM2-135M-Instruct" in header and " │ ● " in header and (
            f"{n} unfinished" in header.replace(f"{n} requests", f"{n}") or names in header), header


async def test_right_and_left_scroll_the_request_table_a_column_a_press(tmp_path):
    """Trial 13: at 60x20 ten presses of → moved the table ten characters (the hint counted columns: about 50
    presses to reach TTFT). Each press now brings the next column to the left edge, and the hint's count drops by one."""
    app = replay_app(tmp_path, start_paused=True)
    async with app.run_test(size=(60, 20)) as pilot:
        table = await _three_requests_on_the_dashboard(pilot)
        assert app.focused is table
        starts = table.column_starts()
        hidden = table.hidden_columns()
        await pilot.press("right")
        await pilot.pause()
        assert int(table.scroll_x) == starts[1] and table.hidden_columns()[0] == 1, (table.scroll_x, starts)
        assert table.hidden_columns()[1] <= hidden[1]
        for _ in range(len(starts)):  # at most a press a column reaches the end
            await pilot.press("right")
        await pilot.pause()
        assert table.hidden_columns()[1] == 0 and table.scroll_x == table.max_scroll_x
        await pilot.press("left")
        await pilot.pause()
        assert int(table.scroll_x) in starts and table.scroll_x < table.max_scroll_x
        for _ in range(len(starts)):
            await pilot.press("left")
        await pilot.pause()
        assert table.scroll_x == 0 and table.hidden_columns()[0] == 0
