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
        app.query_one("#max-tokens", Input).value = "510"
        app.query_one("#prompt").focus()
        _paste(app, "Tell me\na story")
        await wait_until(pilot, lambda: app.query_one("#prompt", Input).value, 10, "the paste")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.state.requests, 10, "the prompt sent")
        rid = app.selected
        assert app.state.requests[rid].prompt == "Tell me\na story"
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


# ---------------------------------------------------------------- 2: a recording cut in the middle of a step


def _trace_cut_before_step_timed(tmp_path, want_prefill: bool = True):
    """The test trace written up to (not including) the StepTimed of a step that prefilled: as a
    recording stopped by `q` during that step. Returns (path, the step's number, its StepPlanned)."""
    import gzip
    import json

    from nanovllm_core import events as ev
    from nanovllm_core.tracing import decode_event
    from tests.tui_helpers import TRACE

    lines = gzip.open(TRACE, "rt", encoding="utf-8").read().splitlines(keepends=True)
    events = [decode_event(line) for line in lines]
    for i in range(len(events) - 1, -1, -1):  # the newest such step: steps before it finished
        e = events[i]
        if isinstance(e, ev.StepTimed) and (e.num_prefill_tokens > 0) == want_prefill:
            plan = next(p for p in events[:i] if isinstance(p, ev.StepPlanned) and p.step == e.step)
            path = tmp_path / "cut_step.jsonl"
            path.write_text("".join(lines[:i]), encoding="utf-8")
            assert json.loads(lines[i - 1])  # whole lines only: not a cut line
            return path, e.step, plan
    raise AssertionError("the test trace has no such step")


def test_a_trace_cut_inside_a_step_leaves_that_step_out_and_says_so(tmp_path):
    from nanovllm_core import events as ev
    from nanovllm_tui.replay import load_trace

    path, step, _ = _trace_cut_before_step_timed(tmp_path)
    trace = load_trace(path)
    assert trace.cut_step == step and trace.cut_line is None
    assert not [e for e in trace if getattr(e, "step", None) == step and not isinstance(e, ev.RequestFinished)]
    assert max(e.step for e in trace if isinstance(e, ev.StepPlanned)) < step
    whole_steps = _trace_cut_before_step_timed(tmp_path)[0].read_text().splitlines()
    assert len(whole_steps) > len(trace)  # something was left out


async def test_the_replay_of_a_cut_step_ends_on_the_last_whole_step(tmp_path):
    """Trial 10: "last step 486: 512/512 tok" and the table counting the unfinished chunk as
    prefilled, beside a KV panel without its blocks. Now the end screen is the last finished step's."""
    from nanovllm_core import events as ev
    from nanovllm_tui.replay import load_trace

    path, step, plan = _trace_cut_before_step_timed(tmp_path)
    whole = [e for e in load_trace(path)]
    app, notes = replay_app(tmp_path, start_paused=False, trace=path), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.controller.state == "idle", 60, "the replay's end")
        await pilot.pause(0.2)
        assert notes.find(f"The recording stopped during step {step}, before it finished")
        assert app.state.step < step and app.state.plan.step < step
        for s in plan.scheduled:  # the cut chunk is not counted as prefilled
            req = app.state.requests.get(s.request_id)
            if req is not None and s.kind == "prefill" and req.prompt_len:
                assert req.prefilled <= s.start, (s, req.prefilled)
    assert whole and all(not (isinstance(e, ev.StepPlanned) and e.step >= step) for e in whole)


def test_a_step_that_failed_before_it_ended_is_not_counted_as_prefilled():
    """The live side of the same: the engine failing mid-step (a device failure sends EngineError and
    no StepTimed) left the planned chunk counted as prefilled and the step called "last step N"."""
    import dataclasses

    from nanovllm_core import events as ev
    from nanovllm_tui.replay import load_trace, split_steps
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.views.dashboard import phase_text
    from tests.tui_helpers import TRACE

    prologue, groups = split_steps(load_trace(TRACE))
    state = EngineState()
    for e in prologue + groups[0]:
        state.apply(e)
    plan = groups[1][0]
    assert isinstance(plan, ev.StepPlanned) and state.requests["0"].prefilled == 2
    state.apply(plan)
    assert state.requests["0"].prefilled == 2 and state.step_open  # in flight: counted when it ends (trial 11)
    state.apply(ev.EngineError(step=plan.step, message="the cpu device failed (RuntimeError: x)"))
    assert state.requests["0"].prefilled == 2 and state.failed_step == plan.step
    assert f"step {plan.step} failed" in phase_text(state, 60).plain
    assert f"last step {plan.step}" not in phase_text(state, 60).plain
    timed = next(e for e in groups[1] if isinstance(e, ev.StepTimed))
    state.apply(dataclasses.replace(timed))  # a failure the engine recovered from: retried alone, then timed
    assert state.requests["0"].prefilled == 9 and state.failed_step is None


# ---------------------------------------------------------------- 3: the footer shows the keys that work where the focus is


def _footer_keys(app, typed: bool = False) -> list[str]:
    """The footer's labels; ``typed``: only those of keys that are characters (not ctrl+...): in a
    field these would type themselves (ctrl+q Quit is offered there since trial 12e)."""
    from textual.widgets._footer import FooterKey

    return [k.description for k in app.query(FooterKey)
            if not k.has_class("-command-palette") and not (typed and k.key.startswith("ctrl+"))]


async def test_the_footer_follows_the_tab_after_the_terminal_lost_focus(tmp_path):
    """Trial 10: at 60x20, Narrator -> X-Ray -> Narrator left X-Ray's keys (Layer -, Layer +) in the
    footer. A terminal that reports focus (tmux does) sends a focus-out; Textual's footer ignores
    binding changes until a key gives the app its focus back, and the app handles keys itself, so
    the key never did."""
    app = replay_app(tmp_path)
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.press("3")
        await wait_until(pilot, lambda: "Only selected" in _footer_keys(app), 10, "the Narrator's keys")
        blur = events.AppBlur()
        blur.set_sender(app)
        app._driver.send_message(blur)
        await pilot.pause(0.2)
        for key, want, gone in (("2", "Layer -", "Only selected"), ("3", "Only selected", "Layer -")):
            await pilot.press(key)
            await wait_until(pilot, lambda: want in _footer_keys(app), 10, f"{want} in the footer after {key}")
            assert gone not in _footer_keys(app)


async def test_the_footer_in_the_prompt_bar_offers_no_key_that_types_itself(tiny_llama_dir, tmp_path):
    """Trial 10: the footer showed "/ Prompt" in the prompt, where `/` types a slash (and a user sent
    "/Python is a"); space, n, a, q, [ ] type themselves in any field too."""
    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("escape")  # a live app starts in the prompt
        await wait_until(pilot, lambda: "Prompt" in _footer_keys(app), 10, "the Dashboard's keys")
        assert {"Pause/Resume", "Step", "Quit", "Chat/raw"} <= set(_footer_keys(app))
        app.query_one("#prompt").focus()
        await wait_until(pilot, lambda: "Leave prompt" in _footer_keys(app), 10, "the prompt's keys")
        keys = set(_footer_keys(app, typed=True))
        assert not keys & {"Prompt", "Pause/Resume", "Step", "Abort", "Quit", "Prev req", "Next req"}, keys
        assert "Chat/raw" in _footer_keys(app)
        app.query_one("#priority").focus()  # from a setting, / does go to the prompt: offered
        await wait_until(pilot, lambda: "Prompt" in _footer_keys(app), 10, "/ offered in a setting")
        assert not set(_footer_keys(app, typed=True)) & {"Pause/Resume", "Step", "Quit"}
        app.query_one("#chat").focus()
        await wait_until(pilot, lambda: app.focused.id == "chat", 10, "the chat box")
        await pilot.pause(0.2)
        assert "Prompt" in _footer_keys(app) and not set(_footer_keys(app, typed=True)) & {"Pause/Resume", "Step", "Quit"}
        await pilot.press("slash")
        await wait_until(pilot, lambda: app.focused.id == "prompt", 10, "/ from the chat box")
        await pilot.press("slash")
        assert app.query_one("#prompt", Input).value == "/"  # typed, as the docs say


# ---------------------------------------------------------------- 4: the selected request's title fits its panel


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_the_selected_requests_title_fits_and_keeps_its_meaning(tmp_path, size):
    """Trial 10: "req-6 · running · paused now, 17.9 s before its last token (not in TTFT/T…" at 120
    columns. The title takes the longest note that fits: the state, and that the time held is not in TTFT/TPOT."""
    app = replay_app(tmp_path)
    async with app.run_test(size=size) as pilot:
        await pilot.press("n", "n")
        await wait_until(pilot, lambda: app.selected and app.state.requests[app.selected].live, 10, "a live request")
        await wait_until(pilot, lambda: app.controller.state == "paused", 10, "the steps to end")
        await pilot.pause(0.3)
        from tests.test_tui_newcomer import screen_text

        req = app.state.requests[app.selected]
        req.request_id = "req-6"  # the id of the app's own requests, as in the report
        req.paused_at_last = req.paused_at_added + 17.9  # held 17.9 s before its newest token
        app.state.paused = True
        app.view("dashboard").update_view(app.state, app.selected)
        await pilot.pause(0.2)
        top = screen_text(app).splitlines()[app.query_one("#output").region.y]  # the panel's top border
        assert f"{req.request_id} · {req.state} · paused now" in top, top
        assert "17.9 s" in top and "not in TTFT/TPOT)" in top and "…" not in top, top


# ---------------------------------------------------------------- 5: the Narrator rewraps at the width it is shown at


async def test_narrator_lines_rewrap_when_the_window_widened_while_it_was_hidden(tmp_path):
    """Trial 10: after widening 100 -> 120 columns while another tab was shown, old entries stayed
    wrapped at 100 (the view's own resize came before its log had the new width)."""
    from textual.widgets import RichLog

    app = replay_app(tmp_path)
    # (60 -> 100 columns: a headless console measures text at most 80 cells wide, so wider would not show it)
    async with app.run_test(size=(60, 24)) as pilot:
        await pilot.press("3", "n", "n", "n")
        log = app.query_one("#narration", RichLog)
        await wait_until(pilot, lambda: len(log.lines) > 5, 10, "the Narrator's entries")
        await pilot.pause(0.3)
        narrow = log.scrollable_content_region.width
        assert max(line.cell_length for line in log.lines) <= narrow
        await pilot.press("1")
        await pilot.resize_terminal(100, 24)
        await pilot.pause(0.3)
        await pilot.press("3")
        await wait_until(pilot, lambda: log.scrollable_content_region.width > narrow, 10, "the wider log")
        await pilot.pause(0.5)
        wide = log.scrollable_content_region.width
        assert max(line.cell_length for line in log.lines) > narrow, "old entries kept their old wrap width"
        assert max(line.cell_length for line in log.lines) <= wide


async def test_narrator_lines_rewrap_when_the_log_width_changed_without_the_views_resize(tmp_path):
    """The same fault at its root: the view rewrote on its own resize only, and a log whose width
    changed when the view's did not (or before the view's resize reached it) kept its old wrap."""
    from textual.widgets import RichLog

    app = replay_app(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("3")
        log = app.query_one("#narration", RichLog)
        was = log.styles.width
        log.styles.width = 40
        await pilot.pause(0.3)
        await pilot.press("n", "n", "n")
        await wait_until(pilot, lambda: len(log.lines) > 5, 10, "the Narrator's entries")
        await pilot.pause(0.3)
        narrow = log.scrollable_content_region.width
        assert narrow < 40 and max(line.cell_length for line in log.lines) <= narrow
        log.styles.width = was
        await pilot.pause(0.3)
        app.view("narrator").update_view(app.state, app.selected)  # as the next event or showing does
        await pilot.pause(0.5)
        assert log.scrollable_content_region.width > narrow
        assert max(line.cell_length for line in log.lines) > narrow, "old entries kept their old wrap width"


async def test_a_request_with_several_samples_says_the_dashboard_shows_sample_0(tmp_path):
    """Trial 11: an attached server's n=3 request showed one row and one text with nothing saying the
    client got three choices; the panel title names the sample shown and where the others are."""
    import dataclasses

    from nanovllm_core import events as ev
    from nanovllm_tui.app import NanoVLLMApp
    from nanovllm_tui.replay import ReplayController, load_trace
    from tests.tui_helpers import TRACE

    trace = load_trace(TRACE)
    trace[:] = [dataclasses.replace(e, n=3) if isinstance(e, ev.RequestAdded) and e.request_id == "0" else e
                for e in trace]
    app = NanoVLLMApp(ReplayController(trace, start_paused=True), tutorial_path=tmp_path / "t.json")
    async with app.run_test(size=(120, 40)) as pilot:
        app.controller.step(2)
        await wait_until(pilot, lambda: app.state.step == 1, timeout=10, what="two recorded steps")
        await pilot.press("escape", "1")
        app.selected = "0"
        app._redraw()
        await pilot.pause()
        assert app.state.requests["0"].n == 3 and app.state.requests["1"].n == 1
        assert "sample 0 of 3 (all in the Narrator)" in str(app.query_one("#output").border_title)
        app.selected = "1"
        app._redraw()
        assert "sample" not in str(app.query_one("#output").border_title)
        # trial 30e: the row's figures (preempted, cached, decode) are sample 0's, and the row says so itself
        from nanovllm_tui.widgets.request_table import row_cells

        assert row_cells(app.state.requests["0"])[1].plain.endswith(" · sample 0 of 3")
        assert "sample" not in row_cells(app.state.requests["1"])[1].plain


def test_the_row_of_several_samples_says_when_sample_0_is_done_and_others_run():
    """Trial 35e: attached to a server, an n=3 request's row read "running · sample 0 of 3" beside sample 0's
    30/30, finished, while samples 1 and 2 still decoded: the figures are sample 0's, the state the request's."""
    import dataclasses

    from nanovllm_core import events as ev
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.widgets.request_table import row_cells
    from tests.test_narrator import added, entry, planned, queued, sampled

    state = EngineState()
    state.apply(dataclasses.replace(added("0"), n=3))
    samples = [dataclasses.replace(queued("0"), index=i, seq_id=i, status="running") for i in range(3)]
    decode = [dataclasses.replace(entry("0", kind="decode", num=1, start=3, total_len=4), index=i, seq_id=i)
              for i in range(3)]
    state.apply(planned(1, decode, running=samples))
    state.apply(sampled(1))
    assert row_cells(state.requests["0"])[1].plain == "running · sample 0 of 3"
    state.apply(planned(2, decode[1:], running=samples[1:]))  # sample 0 ended: in no queue of the plan
    assert state.requests["0"].state == "running"
    assert row_cells(state.requests["0"])[1].plain == "running · sample 0 of 3 done"


@pytest.mark.parametrize("reads", [
    ["\x1b[200~abc\x1b[31mdef\x1b[201~"],
    ["\x1b[20", "0~abc\x1b", "[3", "1mdef\x1b[2", "01~"],  # every marker and sequence split across reads
])
def test_a_paste_holding_escape_sequences_reaches_the_prompt_bar_whole_and_in_order(reads):
    """Trial 11: Textual's parser ended a bracketed paste at its first ESC: `abc ESC[31m def` gave the
    keys `[31mdef` first (typed into the bar, or acting as the app's keys elsewhere), then a paste of
    `abc`. Filtered in front of the parser, the paste arrives whole; the bar drops the sequence, counted."""
    from textual._xterm_parser import XTermParser

    from nanovllm_tui.lifetime import filter_escapes_in_pastes, read_esc_key_as_alt

    read_esc_key_as_alt()
    filter_escapes_in_pastes()
    filter_escapes_in_pastes()  # twice is harmless
    parser = XTermParser()
    got = [e for chunk in [*reads, "x"] for e in parser.feed(chunk)]
    assert [type(e).__name__ for e in got] == ["Paste", "Key"], got
    assert pasted_text(got[0].text) == ("abcdef", 5) and got[1].key == "x"
    alone = XTermParser()  # outside a paste nothing is held or changed: a lone Esc is Esc
    keys = list(alone.feed("q")) + list(alone.feed("\x1b")) + list(alone.feed(""))
    assert [e.key for e in keys] == ["q", "escape"], keys


def test_a_step_in_flight_is_not_shown_done_and_a_readmissions_cache_hit_is_counted():
    """Trial 11: while a step taken with n ran (seconds on a busy host), the Dashboard said "last step 7:
    14/16 tokens" with the chunks' prompts shown prefilled, and the KV panel still the step before; and a
    preempted request readmitted with 128 tokens from the prefix cache (planned as a 1-token decode) showed
    0 in the cached column (since trial 24d #3 that column is the first admission's, vLLM's
    num_cached_tokens, so a readmission leaves it as it was)."""
    import dataclasses

    from nanovllm_core import events as ev
    from nanovllm_tui.replay import load_trace, split_steps
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.views.dashboard import phase_text
    from tests.tui_helpers import TRACE

    prologue, groups = split_steps(load_trace(TRACE))
    state = EngineState()
    for e in prologue + groups[0]:
        state.apply(e)
    state.paused = True  # a single step while paused, as n takes it
    state.engine_state = "paused"
    plan = groups[1][0]
    state.apply(plan)
    assert state.requests["0"].prefilled == 2 and f"step {plan.step} running" in phase_text(state, 60).plain
    for e in groups[1][1:]:
        state.apply(e)
    assert state.requests["0"].prefilled == 9 and not state.step_open
    assert f"last step {plan.step}" in phase_text(state, 60).plain
    readmit = dataclasses.replace(groups[3][0], scheduled=tuple(  # request 2 as if readmitted: 7 from the cache
        dataclasses.replace(s, num_cached_tokens=7) if s.request_id == "2" else s for s in groups[3][0].scheduled))
    assert any(s.request_id == "2" and s.kind == "decode" for s in readmit.scheduled)
    before = state.requests["2"].num_cached
    state.apply(readmit)
    # trial 24d #3: the column is vLLM's num_cached_tokens, the first admission's; a readmission's hit is not it
    assert before == 0 and state.requests["2"].num_cached == 0
