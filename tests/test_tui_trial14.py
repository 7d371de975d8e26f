"""Newcomer trials 14a and 14e: a tab in the prompt bar, key hints true of the engine's state, a Block
Map no older than it says, the Top-k panel's byte pieces, and the Dashboard at 100 columns."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from rich.text import Text
from textual.app import App, ComposeResult
from textual.widgets import Input

from nanovllm_core import events as ev
from nanovllm_core.engine.detokenizer import byte_text
from nanovllm_tui import hints
from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.replay import ReplayController, load_trace
from nanovllm_tui.state import EngineState, RequestView
from nanovllm_tui.views.block_map import summary_text
from nanovllm_tui.views.dashboard import phase_text
from nanovllm_tui.views.xray import no_trace_words
from nanovllm_tui.widgets.prompt_bar import TAB_MARK, PromptBar, prompt_from_bar
from nanovllm_tui.widgets.topk_bars import chosen_piece
from tests.test_tui_newcomer import screen_text
from tests.tui_helpers import TRACE, Notes, replay_app, wait_until

pytestmark = pytest.mark.anyio


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


# ---------------------------------------------------------------- 14a item 4: key hints true of the state


def state_after_step_0(paused: bool, pending: str | None = None) -> EngineState:
    """The test recording folded up to the end of step 0, and a request "late" waiting behind it
    (not in step 0); the engine paused or running."""
    state = EngineState()
    for e in load_trace(TRACE):
        state.apply(e)
        if isinstance(e, ev.StepTimed):
            break
    state.requests["late"] = RequestView("late", "a prompt", state="waiting")
    state.paused, state.pending = paused, pending
    return state


def test_the_xray_names_n_only_while_n_runs_a_step():
    """Trial 14a: "X-Ray records the next step that runs it: press n again while paused" while the
    engine ran unpaused (n does nothing then)."""
    running = no_trace_words(state_after_step_0(paused=False), "late", live=True)
    assert "was not in step 0 (it is waiting to be admitted)" in running
    assert "press n" not in running and "steps come on their own while the engine runs" in running
    resuming = no_trace_words(state_after_step_0(paused=True, pending="resuming"), "late", live=True)
    assert "press n" not in resuming
    for paused in (state_after_step_0(paused=True), state_after_step_0(paused=False, pending="pausing")):
        assert "press n to run a step" in no_trace_words(paused, "late", live=True)
    assert "press n to play a step" in no_trace_words(state_after_step_0(paused=True), "late", live=False)


def test_next_step_hints_per_state():
    state = state_after_step_0(paused=False)
    assert hints.next_step(state, live=True) == "steps come on their own while the engine runs"
    assert hints.next_step(state, live=False) == "the replay plays its steps on its own"
    state.requests.clear()
    assert hints.next_step(state, live=True) == "send a prompt first"
    # no request known is not the end of a replay (one recorded by an attached app starts so; trial 20d)
    assert hints.next_step(state, live=False) == "the replay plays its steps on its own"
    state.recording_ended()
    assert hints.next_step(state, live=False) == "the recording has no more steps"
    state.unfinished = None
    state.paused = True
    assert hints.next_step(state, live=True) == "send a prompt first (it waits while paused: then n runs one step)"


async def test_a_replay_never_hints_at_prompts_or_keys_it_refuses(tmp_path):
    """A replay takes no prompts and runs no demonstration: its X-Ray and Block Map said "send a
    prompt", its Tutorial "Press r to run it", and n at its end "send a prompt first"."""
    app, notes = replay_app(tmp_path), Notes()
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, 20, "the recording's model facts")
        seen = {}
        for key in ("2", "5", "4"):
            await pilot.press("escape", key)
            await pilot.pause(0.2)
            seen[key] = screen_text(app)
        assert "press n to play a step" in seen["2"] and "press n to play a step" in seen["5"]
        assert "No demonstration in a replay" in seen["4"] and "Press r" not in seen["4"]
        for text in seen.values():
            assert "send a prompt" not in text and "while paused" not in text
        app.controller.step(app.controller.num_steps)
        await wait_until(pilot, lambda: app.controller.ended and app.state.unfinished is not None, 30, "the end")
        await pilot.press("n")
        await wait_until(pilot, lambda: notes.items, 10, "a toast")
        assert [n.message for n in notes.items] == ["Nothing to step: the recording has no more steps."]


# ---------------------------------------------------------------- 14a item 5: a Block Map older than the engine


def folded(until, drop_blocks_after: int | None = None) -> EngineState:
    """The test recording folded until ``until(event)`` holds (that event included), leaving out its
    BlocksChanged after step ``drop_blocks_after`` (as a hidden Block Map gets none)."""
    state = EngineState()
    for e in load_trace(TRACE):
        if not (isinstance(e, ev.BlocksChanged) and drop_blocks_after is not None and e.step > drop_blocks_after):
            state.apply(e)
        if until(e):
            break
    return state


def test_a_block_map_older_than_the_newest_step_says_so_and_when_it_refreshes():
    """Trial 14a: opened on a busy engine at step 119, the map read "after step 53" for seconds, its
    counts beside the Dashboard's newer ones, with nothing saying it was old."""
    running = folded(lambda e: isinstance(e, ev.StepPlanned) and e.step == 4, drop_blocks_after=1)
    line = summary_text(running.blocks, True, running, live=True).plain
    assert line.endswith("after step 1 · old (the engine is at step 4): a new map comes at the end of that step")
    between = folded(lambda e: isinstance(e, ev.StepTimed) and e.step == 3, drop_blocks_after=1)
    assert summary_text(between.blocks, True, between).plain.endswith(
        "after step 1 · old (step 3 has ended): a new map is on its way")
    fresh = folded(lambda e: isinstance(e, ev.StepTimed) and e.step == 3)
    assert summary_text(fresh.blocks, True, fresh).plain.endswith("after step 3")  # nothing to add


async def test_a_replay_without_newer_maps_says_its_map_is_old(tmp_path):
    events = [e for e in load_trace(TRACE) if not (isinstance(e, ev.BlocksChanged) and e.step > 1)]
    app = NanoVLLMApp(ReplayController(events, start_paused=True), tutorial_path=tmp_path / "tutorial.json")
    async with app.run_test(size=(120, 40)) as pilot:
        app.controller.step(4)
        await wait_until(pilot, lambda: app.state.kv is not None and app.state.kv.step == 3, 20, "step 3")
        await pilot.press("escape", "5")
        await pilot.pause(0.3)
        assert "after step 1 · the recording holds no map after it (step 3 has ended)" in \
            " ".join(screen_text(app).split())


# ---------------------------------------------------------------- 14a, not counted 1: a token that is bytes of a character

JAPANESE = "日本語のテキストです"


def test_byte_text_writes_each_byte_of_an_unfinished_character():
    assert byte_text(b" \xe3\x81") == " <0xE3><0x81>" and byte_text("の".encode()) == "の"


def test_a_token_holding_part_of_a_character_shows_its_bytes_not_a_replacement_character(make_tiny_engine):
    """Trial 14a: a Japanese reply's top-k rows all read "�" (each token decoded alone). The engine's
    pieces (top-k candidates, prompt pieces, drafts) now show those bytes, each token its own."""
    engine = make_tiny_engine(num_kv_blocks=16)
    ids = engine.tokenizer.encode(JAPANESE)
    pieces = engine.token_pieces(ids)
    assert pieces[:4] == ["<0xE6><0x97>", "<0xA5>", "本", "<0xE8>"] and "\ufffd" not in "".join(pieces)
    sampled = SimpleNamespace(sampled_top=[[(ids[0], 0.5), (ids[1], 0.3), (ids[2], 0.2)]], processed=[False])
    top, _ = engine.output._candidates(sampled, 0, 5)
    assert [t.text for t in top] == ["<0xE6><0x97>", "<0xA5>", "本"]


BYTE_ROWS = (ev.TopToken(101, "<0xE3><0x81>", 0.6), ev.TopToken(102, "<0xE3><0x82>", 0.3), ev.TopToken(103, "、", 0.1))


def test_the_heading_names_the_sampled_token_as_its_bar_does():
    assert chosen_piece(BYTE_ROWS, 101, "") == "<0xE3><0x81>"  # it spelled nothing yet: was "∅"
    assert chosen_piece(BYTE_ROWS, 102, "の") == "<0xE3><0x82> → の"  # completed a character
    assert chosen_piece(BYTE_ROWS, 103, "、") == "、"
    assert chosen_piece(BYTE_ROWS, 999, "") == "id 999 (part of a character)"  # not a row
    assert chosen_piece((), 7, " Paris") == "␣Paris"


async def test_the_top_k_panel_heading_and_its_bars_agree_on_a_byte_token(tmp_path):
    """Trial 14a: "token #4: ∅" above five bars reading "�"."""
    events = list(load_trace(TRACE))
    last = max(i for i, e in enumerate(events) if isinstance(e, ev.TokenSampled) and e.request_id == "0" and e.step <= 2)
    events[last] = dataclasses.replace(events[last], token_id=101, token_text="", text="", top=BYTE_ROWS)
    app = NanoVLLMApp(ReplayController(events, start_paused=True), tutorial_path=tmp_path / "tutorial.json")
    async with app.run_test(size=(120, 40)) as pilot:
        app.controller.step(3)
        await wait_until(pilot, lambda: app.state.kv is not None and app.state.kv.step == 2, 20, "step 2")
        app.select("0")
        await pilot.pause(0.3)
        panel = str(app.query_one("#topk").render())
        n = events[last].num_output_tokens
        assert f"token #{n}: <0xE3><0x81>\n" in panel and "∅" not in panel
        assert "<0xE3><0x81>  60.0%" in panel and "<0xE3><0x82>  30.0%" in panel


def test_the_cli_dashboard_and_narrator_mark_a_byte_token_by_its_id():
    """The same kind in ``nanovllm --dashboard``: the chosen row was found by its text, so a token that
    spelled nothing yet ("") marked no row (and of rows alike, the first); the Narrator named it by id alone."""
    import io

    from rich.console import Console

    from nanovllm_core.educational.dashboard_view import DashboardView
    from nanovllm_core.educational.narrator_sampling import token_words
    from tests.test_narrator import INFO, added, sampled

    console = Console(file=io.StringIO(), width=140)
    view = DashboardView(console, INFO)
    view(added())
    e = sampled(0, token=102, text="", top=[(t.token_id, t.text, t.prob) for t in BYTE_ROWS])
    view(e)
    console.print(view.render())
    rows = [line for line in console.file.getvalue().splitlines() if "<0xE3>" in line]
    assert ["← chosen" in line for line in rows] == [False, True], rows
    assert token_words(e) == "[<0xE3><0x82>] (id 102) (bytes of a character that is not complete yet)"


# ---------------------------------------------------------------- 14e item 2: the Dashboard's top panels at 100x30


def scaled_trace(scale: float) -> list[ev.Event]:
    """The test recording with every step ``scale`` times as long (its rates 1/``scale`` as high)."""
    out = []
    for e in load_trace(TRACE):
        if isinstance(e, ev.StepTimed):
            e = dataclasses.replace(e, wall_time_s=e.wall_time_s * scale,
                                    prefill_tokens_per_s=e.prefill_tokens_per_s / scale,
                                    decode_tokens_per_s=e.decode_tokens_per_s / scale)
        out.append(e)
    return out


def lines_needed(app, panel) -> int:
    """Rows the panel's text takes wrapped at its width (each LiveStatic inside it, or itself)."""
    statics = [panel] if hasattr(panel, "_shown") else list(panel.query("LiveStatic"))
    return sum(len(s._shown.wrap(app.console, s.content_region.width)) for s in statics
               if isinstance(s._shown, Text) and s.display)


@pytest.mark.parametrize("size", [(100, 30), (80, 24), (120, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("scale", [14.0, 1 / 500], ids=["slow", "fast"])
@pytest.mark.parametrize("steps", [3, 6])
async def test_every_dashboard_top_panel_fits_its_text(tmp_path, size, scale, steps):
    """Trial 14e: at the README's 100x30 the Throughput panel wrapped " last 1 step 1.9 tok/s" (its
    unit on a row of its own) and its 4 rows cut the decode sparkline and rate; at 80x24 the Engine
    panel had 2 rows for its 4 lines. Slow (1.9 tok/s) and fast (13.5k tok/s) rates, mixed and
    decode-only steps: each panel's text fits its rows."""
    app = NanoVLLMApp(ReplayController(scaled_trace(scale), start_paused=True), tutorial_path=tmp_path / "t.json")
    async with app.run_test(size=size) as pilot:
        app.controller.step(steps)
        await wait_until(pilot, lambda: app.state.kv is not None and app.state.kv.step == steps - 1, 20, "the steps")
        await pilot.press("escape")
        await pilot.pause(0.3)
        for name in ("#phase", "#kv", "#throughput"):
            panel = app.query_one(name)
            if panel.display:
                assert lines_needed(app, panel) <= panel.content_region.height, (name, screen_text(app))
        if app.query_one("#throughput").display and steps == 6:
            spark = str(app.query_one("#decode-spark").render())
            assert spark.endswith("tok/s") and spark.strip()[0] in "▁▂▃▄▅▆▇█", spark  # its rate and a sparkline


def test_the_engine_panel_joins_lines_to_fit_its_rows():
    """A verification adds a fifth line to the Engine panel's four rows: two neighbours share a line
    where they fit the width, so none is left below the panel's edge."""
    state = folded(lambda e: isinstance(e, ev.StepTimed) and e.step == 5)
    plan = state.plan
    state.plan = dataclasses.replace(plan, scheduled=tuple(
        dataclasses.replace(s, num_spec_tokens=4, num_tokens=5) if s.kind == "decode" else s for s in plan.scheduled))
    five = phase_text(state, 21).plain.splitlines()
    assert len(five) == 5 and "verify" in five[3]
    four = phase_text(state, 21, rows=4).plain.splitlines()
    assert len(four) == 4 and all(len(line) <= 21 for line in four), four
    assert four[0].startswith("VERIFY · last step 5") and four[-1] == "2 running · 0 waiting"


@pytest.mark.parametrize("given", [False, True])
async def test_a_default_max_tokens_the_engine_refuses_is_lowered_and_a_typed_one_is_kept(given):
    """Trial 30e: attached to a server with --max-model-len 24, the app opened with its own default of 50
    in red, refused before anything was typed. A default is lowered to half the engine's limit (room for a
    prompt); a --max-tokens the user typed is kept and refused with the reason, as before."""
    from nanovllm_tui.widgets.prompt_bar import PromptSettings

    class Bar(App):
        def compose(self) -> ComposeResult:
            yield PromptBar(PromptSettings(max_tokens=50, max_tokens_given=given), id="prompt-bar")

    app = Bar()
    async with app.run_test(size=(100, 10)) as pilot:
        bar = app.query_one(PromptBar)
        lowered = bar.limit_max_tokens(24)
        await pilot.pause()
        field = app.query_one("#max-tokens", Input)
        if given:
            assert lowered is None and field.value == "50"
            assert bar.errors() and "from 1 to 24" in bar.errors()[0][1]
        else:
            assert lowered == 12 and field.value == "12" and not bar.errors()


def test_max_model_len_alone_lowers_the_default_max_tokens_instead_of_refusing_it(capsys):
    """The same kind on the command line: `nanovllm-tui --max-model-len 24` ended with "--max-tokens: ... not
    '50'" though no --max-tokens was typed; a typed one that does not fit is still refused."""
    from nanovllm_tui.options import parse_args

    args = parse_args(["--max-model-len", "24"])
    assert args.max_tokens == 12 and args.sampling.max_tokens == 12
    with pytest.raises(SystemExit):
        parse_args(["--max-model-len", "24", "--max-tokens", "50"])
    assert "--max-tokens: max tokens must be a whole number from 1 to 24" in capsys.readouterr().err
