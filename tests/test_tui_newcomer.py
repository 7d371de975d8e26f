"""Issue 29, the newcomers' trials: the app never shows a stale or wrong state, nor writes a
client's or the model's text raw to the terminal."""

from __future__ import annotations

import dataclasses
import re

import pytest

from nanovllm_core import events as ev
from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.bridge import visible_event
from nanovllm_tui.replay import ReplayController, load_trace
from nanovllm_tui.widgets.format import visible_text
from tests.tui_helpers import TRACE, wait_until

pytestmark = pytest.mark.anyio
# ESC (an SGR colour), BEL, CR and C1's one-character CSI: what a client may put in a prompt
NASTY = "Only escape \x1b[31mRED\x1b[0m bell\x07 cr\r csi\x9b2J end"
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def screen_text(app) -> str:
    """What the terminal shows, line by line (the text of every segment drawn)."""
    return "\n".join("".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips())


def test_visible_text_shows_every_control_but_tab_and_newline():
    assert visible_text(NASTY) == "Only escape ␛[31mRED␛[0m bell␇ cr␍ csi\\x9b2J end"
    assert visible_text("a\tb\nc\x7f") == "a\tb\nc␡"
    plain = "nothing to do ✓"
    assert visible_text(plain) is plain


def test_visible_event_reaches_nested_text_and_leaves_clean_events_alone():
    top = (ev.TopToken(token_id=1, text="\x1b[2J", prob=0.5),)
    e = ev.TokenSampled(time=0.0, request_id="r\x07", step=1, index=0, seq_id=0, position=3, token_id=1, text="\x9bX",
                        num_output_tokens=1, top=top, token_text="\x1b")
    shown = visible_event(e)
    assert (shown.request_id, shown.text, shown.token_text, shown.top[0].text) == ("r␇", "\\x9bX", "␛", "␛[2J")
    clean = dataclasses.replace(e, request_id="r", text="x", token_text="x", top=())
    assert visible_event(clean) is clean


def nasty_trace() -> list[ev.Event]:
    """The test trace with request 0's prompt, token pieces and output holding control characters."""
    out = []
    for e in load_trace(TRACE):
        if getattr(e, "request_id", None) == "0":
            if isinstance(e, ev.RequestAdded):
                e = dataclasses.replace(e, prompt=NASTY, prompt_pieces=("\x1b[31m",) + e.prompt_pieces[1:],
                                        sampling=e.sampling + (("stop", ("\x1b[0m",)),))
            elif isinstance(e, ev.TokenSampled):
                e = dataclasses.replace(e, text=e.text + "\x1b[31m\x07", token_text=e.token_text + "\x9b")
            elif isinstance(e, ev.RequestFinished):
                e = dataclasses.replace(e, output_text=e.output_text + "\x1b[31m\x07\r\x9b")
            elif isinstance(e, ev.LayerTrace):
                e = dataclasses.replace(e, query_pieces=tuple(p + "\x1b" for p in e.query_pieces))
        out.append(e)
    return out


@pytest.mark.parametrize("tab", ["dashboard", "xray", "narrator", "blocks"])
async def test_control_characters_in_prompts_and_outputs_are_drawn_visible(tmp_path, tab):
    app = NanoVLLMApp(ReplayController(nasty_trace(), pace=(0.0, 0.0)), tutorial_path=tmp_path / "t.json")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.controller.state == "idle", timeout=30, what="the replay's end")
        app.select("0")
        app.action_show_tab(tab)
        await pilot.pause(0.2)
        shown = screen_text(app)
        assert not RAW.search(shown), f"raw control characters on the {tab} tab: {RAW.findall(shown)}"
        if tab == "dashboard":
            assert "␛[31mRED" in shown
        assert all(not RAW.search(r.prompt + r.text + r.last_token) for r in app.state.requests.values())


@pytest.mark.parametrize("option", [["--prompt", "hi"], ["--stop", "x"], ["--priority", "1"],
                                    ["--prompt", "a", "--prompt", "b"]])
def test_a_repeatable_option_with_replay_ends_with_one_line_and_status_2(capsys, option):
    """It raised AttributeError ('object' has no 'append') from given_options, with a traceback."""
    from nanovllm_tui.options import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--replay", str(TRACE), *option])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert f"{option[0]} does nothing with --replay" in err


def test_given_options_sees_repeatable_options_and_not_absent_ones():
    from nanovllm_tui.options import NOT_WITH_REPLAY, SERVER_SIDE, given_options

    assert given_options(["--stop", "x", "--prompt", "a"], NOT_WITH_REPLAY) == ["prompt", "stop"]
    assert given_options(["--prompt", "a", "--stop", "x"], SERVER_SIDE) == []
    assert given_options(["--paused", "--prompt", "a"], SERVER_SIDE) == ["paused"]


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "9000", "--max-model-len", "8192"],
     "--max-tokens: max tokens must be a whole number from 1 to 8192 (the max_model_len of the engine it goes to: here or the server's), not '9000'"),
    (["--max-tokens", "600", "--max-model-len", "512", "--prompt", "Hi"], "from 1 to 512"),
])
def test_start_up_values_are_checked_by_the_prompt_bars_rules(capsys, argv, message):
    from nanovllm_tui.options import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and message in err and len(err.splitlines()) == 1


async def test_a_start_up_max_tokens_beyond_the_models_context_ends_the_app_with_status_2(tiny_llama_dir, tmp_path):
    """--prompt Hi --max-tokens 9000 sent req-0 with max 9000 while the bar said the most is the
    model's max_model_len (known only once it has loaded: the tiny model's is 512)."""
    from nanovllm_tui.starter import BackgroundController
    from nanovllm_core.engine.controller import EngineController
    from nanovllm_tui.widgets.prompt_bar import PromptSettings

    controller = BackgroundController(lambda: EngineController(model=str(tiny_llama_dir), num_kv_blocks=32,
                                                               start_paused=True))
    app = NanoVLLMApp(controller, settings=PromptSettings(max_tokens=9000, chat=False), prompts=[("Hi", 0)],
                      tutorial_path=tmp_path / "t.json")
    exits, exit_app = [], app.exit
    app.exit = lambda *a, **kw: (exits.append(kw), exit_app(*a, **kw))[1]
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: exits, timeout=60, what="the app to refuse the start-up max tokens")
    assert app.return_code == 2 and len(exits) == 1
    assert str(exits[0]["message"]) == ("nanovllm-tui: error: --max-tokens: max tokens must be a whole number from 1 "
                                         "to 512 (the max_model_len of the engine it goes to: here or the server's), not '9000'; lower --max-tokens "
                                         "(--max-model-len is already the model's whole context)")  # 512: the tiny's context (trial 20e)


async def test_a_start_up_refusal_that_comes_before_the_model_is_known_ends_with_the_max_tokens_line(tiny_llama_dir,
                                                                                                   tmp_path):
    """Under --connect the server's 400 for a --prompt can come before its ready event; the app then
    ended with the server's wording, or with the --max-tokens line when ready came first (a CI run
    on 2026-12-07 got the first). Now the refusal waits for the context length and the line is one."""
    import threading

    from nanovllm_core.engine.controller import EngineController
    from nanovllm_tui.starter import BackgroundController
    from nanovllm_tui.widgets.prompt_bar import PromptSettings

    loaded = threading.Event()
    controller = BackgroundController(lambda: (loaded.wait(30), EngineController(model=str(tiny_llama_dir),
                                                                                 num_kv_blocks=32))[1])
    app = NanoVLLMApp(controller, settings=PromptSettings(max_tokens=9000, chat=False), prompts=[("Hi", 0)],
                      tutorial_path=tmp_path / "t.json")
    exits, exit_app = [], app.exit
    app.exit = lambda *a, **kw: (exits.append(kw), exit_app(*a, **kw))[1]
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app._startup_ids, timeout=20, what="the start-up prompt sent")
        assert not app.state.model_info.get("max_model_len")  # the model is still loading
        [rid] = app._startup_ids
        app._announce(ev.RequestRejected(request_id=rid, reason="This model's maximum context length is 512 tokens. "
                                         "However, you requested 9001 tokens (1 in the prompt, 9000 for the "
                                         "completion). Please reduce the length of the prompt or max_tokens. (HTTP 400)"))
        await pilot.pause(0.2)
        assert not exits  # not yet: the context length is not known
        loaded.set()
        await wait_until(pilot, lambda: exits, timeout=60, what="the app to refuse the start-up max tokens")
    assert app.return_code == 2 and len(exits) == 1
    assert str(exits[0]["message"]).endswith("; lower --max-tokens (--max-model-len is already the model's whole "
                                             "context)"), exits


async def test_under_connect_the_start_up_max_tokens_refusal_points_at_the_server(tiny_server, tmp_path):
    """--connect refuses --max-model-len, so the hint names the server's option (trial 6)."""
    from nanovllm_tui.remote import RemoteController
    from nanovllm_tui.widgets.prompt_bar import PromptSettings

    app = NanoVLLMApp(RemoteController(tiny_server.url, tiny_server.api_key),
                      settings=PromptSettings(max_tokens=9000, chat=False), prompts=[("Hi", 0)],
                      tutorial_path=tmp_path / "t.json")
    exits, exit_app = [], app.exit
    app.exit = lambda *a, **kw: (exits.append(kw), exit_app(*a, **kw))[1]
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: exits, timeout=60, what="the app to refuse the start-up max tokens")
    assert app.return_code == 2
    assert str(exits[0]["message"]).endswith("lower --max-tokens or raise `nanovllm serve --max-model-len` on the server")


@pytest.mark.parametrize("field, typed", [
    ("priority", "٥"), ("priority", "1_0"), ("priority", ""), ("temperature", ""), ("temperature", "inf"),
    ("temperature", "nan"), ("temperature", "1_0"), ("temperature", "٠.5"), ("max-tokens", "٥"),
    ("max-tokens", "1_0"), ("max-tokens", ""),
])
def test_every_setting_takes_ascii_digits_only_and_refuses_an_empty_field(field, typed):
    from nanovllm_tui.widgets.prompt_bar import setting_rules

    result = setting_rules(512)[field].validate(typed)
    assert not result.is_valid and f"not {typed!r}" in result.failure_descriptions[0]


@pytest.mark.parametrize("field, typed, value", [
    ("priority", " -7 ", -7), ("priority", "+3", 3), ("temperature", "0.7", 0.7), ("temperature", ".5", 0.5),
    ("temperature", "1e-3", 0.001), ("temperature", "2", 2.0), ("max-tokens", "512", 512),
])
def test_every_setting_still_takes_plain_numbers(field, typed, value):
    from nanovllm_tui.widgets.prompt_bar import setting_rules

    rule = setting_rules(512)[field]
    assert rule.validate(typed).is_valid and rule.parse(typed) == value


def shown_actions(app) -> set[str]:
    """The actions the footer offers now."""
    return {b.action for _, b, enabled, _ in app.screen.active_bindings.values() if b.show and enabled}


async def test_a_replay_offers_no_run_demo_key_on_the_tutorial_tab(tmp_path):
    """It showed `r Run demo`, and r only said demonstrations need a local engine."""
    from tests.tui_helpers import replay_app

    app = replay_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("4")
        await pilot.pause(0.2)
        assert app.active_tab == "tutorial" and "chapter(1)" in shown_actions(app)
        assert "run_demo" not in shown_actions(app)
        await pilot.press("right")
        await pilot.pause(0.1)
        assert "run_demo" not in shown_actions(app)


async def test_a_live_app_offers_run_demo_only_on_chapters_with_a_demonstration(tiny_llama_dir, tmp_path):
    from nanovllm_tui.views.tutorial import TutorialView
    from nanovllm_core.educational import tutorial as tut
    from tests.tui_helpers import tiny_app

    app = tiny_app(tiny_llama_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("escape", "4")
        await pilot.pause(0.2)
        view = app.query_one(TutorialView)
        for _ in tut.CHAPTERS:
            c = view.chapter
            has_demo = bool(c.demo and tut.DEMOS.get(c.demo) and c.demo_prompt)
            assert ("run_demo" in shown_actions(app)) == has_demo, c.title
            await pilot.press("right")
            await pilot.pause(0.05)


async def test_aborts_are_announced_only_for_the_apps_own_requests(tiny_llama_dir, tmp_path):
    """Every client that left an attached server popped "cmpl-... aborted after 4 tokens" in every
    attached app. Another client's abort (here: a request sent to the engine past the app) only
    changes its row in the table; the app's own abort is still announced."""
    from nanovllm_core.sampling_params import SamplingParams
    from tests.tui_helpers import Notes, send_prompt, tiny_app

    notes = Notes()
    app = tiny_app(tiny_llama_dir, tmp_path, start_paused=True, max_tokens=50)
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the model")
        other = app.controller.submit("someone else's prompt", SamplingParams(max_tokens=50), 0)
        await send_prompt(pilot, "mine")
        mine = app.selected
        await wait_until(pilot, lambda: {other, mine} <= set(app.state.requests), what="both requests")
        app.controller.abort(other)
        await wait_until(pilot, lambda: app.state.requests[other].state == "finished", what="the other's abort")
        await pilot.press("escape", "a")
        await wait_until(pilot, lambda: app.state.requests[mine].state == "finished", what="my abort")
        await pilot.pause(0.2)
        assert app.state.requests[other].finish_reason == "abort"
        # paused, it never ran: the toast says it held no K/V (trial 43e), not "after 0 tokens"
        assert notes.find(f"{mine} aborted before its prefill began; it held no KV blocks")
        assert not notes.find(f"{other} aborted")


def test_xray_says_1_block_not_1_blocks():
    from nanovllm_tui.views.xray import gqa_text
    from tests.tui_helpers import XRAY_TRACE

    trace = next(e for e in load_trace(XRAY_TRACE) if isinstance(e, ev.LayerTrace))
    text = gqa_text(trace, 0, block_size=4096).plain
    assert " fill 1 block of 4096 (" in text or " fills 1 block of 4096 (" in text, text
    assert "1 blocks" not in text


def test_the_engine_panel_keeps_the_token_unit_at_120_columns():
    """At 120 columns (26 cells) it cut `last step 476: 1/512 tokens` to `last step 476: 1/512`."""
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.views.dashboard import phase_text

    state = EngineState()
    for e in load_trace(TRACE):
        state.apply(e)
    state.plan = dataclasses.replace(state.plan, step=476, token_budget=512, num_batched_tokens=1)
    assert phase_text(state, 26).plain.splitlines()[1] == "last step 476: 1/512 tok"
    assert phase_text(state, 40).plain.splitlines()[1] == "last step 476: 1/512 tokens"


def test_the_engine_panel_says_one_token_unit_in_every_state_at_a_width():
    """Trial 13: at 120x40 (26 cells) `step 23 running: 1/512 tok` while the running and idle states said
    `tokens`: the unit is chosen once for the width and step, so every state says the same."""
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.views.dashboard import phase_text

    class Shown(EngineState):
        busy = False  # running steps, or idle / paused (each state's wording)

    state = Shown()
    for e in load_trace(TRACE):
        state.apply(e)
    state.plan = dataclasses.replace(state.plan, step=23, token_budget=512, num_batched_tokens=1)
    for width, unit in ((26, "tok"), (40, "tokens")):
        seen = {}
        for busy, step_open in ((False, False), (False, True), (True, False)):
            state.step_open, state.busy = step_open, busy
            line = phase_text(state, width).plain.splitlines()[1]
            seen[line] = line.endswith("1/512 " + unit) and len(line) <= width
        assert len(seen) == 3 and all(seen.values()), (width, seen)


async def test_the_last_runs_rate_has_its_unit(tmp_path):
    """The idle throughput label read `last 1 step 35`, no unit."""
    app = NanoVLLMApp(ReplayController(load_trace(TRACE), pace=(0.0, 0.0)), tutorial_path=tmp_path / "t.json")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.controller.state == "idle", timeout=30, what="the replay's end")
        await pilot.pause(0.6)  # the state poll sees idle
        label = str(app.query_one("#decode-spark").render())
        assert re.search(r"last \d+ steps? [0-9.k]+ tok/s$", label), label


def test_the_header_keeps_the_active_request_count_before_device_and_weights():
    """At 120 columns the header dropped `· N active requests` and kept `· cpu · float32 · ... weights`."""
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.widgets.status_header import StatusHeader

    state = EngineState()
    for e in load_trace(TRACE):
        state.apply(e)
    state.model_name = "SmolLM2-135M-Instruct-Q4_1"
    state.model_info.update(quantization="gguf", weight_kinds="q4_1, q8_0, f32")
    state.engine_state, state.step = "running", 476
    for i in range(3):
        state.submitted(f"cmpl-{i:024d}", "x", 0, 5, chat=False)
    header = StatusHeader()
    shown = []
    header.show_content = shown.append
    header.show(state, width=96)
    line = shown[-1].plain
    # the count stays (trial 13's fit: after the weights went, "3 active" lets the device stay too)
    assert "· 3 active" in line and "step 476" in line and len(line) <= 96, line


@pytest.mark.parametrize("size", [(60, 20), (120, 25)])
async def test_the_prompt_bars_labels_stand_apart_from_their_values_on_a_short_screen(tiny_llama_dir, tmp_path, size):
    """At 60x20 the bar read `prio0   max50   temp0.0` (borderless fields right after their labels)."""
    from tests.tui_helpers import tiny_app

    app = tiny_app(tiny_llama_dir, tmp_path, max_tokens=50)
    async with app.run_test(size=size) as pilot:
        await pilot.pause(0.3)
        shown = screen_text(app)
        assert re.search(r"prio +0 ", shown) and re.search(r"max +50 ", shown) and re.search(r"temp +0\.0", shown), shown
        assert "prio0" not in shown and "max50" not in shown


def test_chapter_5s_quiz_asks_for_a_figure_its_text_and_figures_do_not_print():
    """The chapter printed this model's K/V bytes per token (46,080) right above the quiz asking for it."""
    from nanovllm_core.educational import tutorial as tut

    chapter = next(c for c in tut.CHAPTERS if c.key == "kv_cache")
    info = {"kv_bytes_per_token": 46080, "num_layers": 30, "num_kv_heads": 3, "num_heads": 9, "head_dim": 64,
            "dtype": "float32", "num_parameters": 134_515_008, "hidden_size": 576}
    shown = chapter.text + "\n".join(tut.model_facts(chapter, info))
    right = chapter.quiz.choices[chapter.quiz.answer]
    assert right == f"{2 * 30 * 9 * 64 * 4:,}" and right not in shown


@pytest.mark.parametrize("seconds, shown", [
    (0.0421, "42 ms"), (0.9994, "999 ms"), (0.9996, "1.0 s"), (1.242, "1.2 s"), (12.34, "12.3 s"),
    (1234.0, "1234 s"), (None, "-"),
])
def test_the_tables_durations_switch_to_seconds_at_1_s_as_the_teaching_text_does(seconds, shown):
    """Trial 9: the request table showed TTFT '1242 ms' where the Narrator and the CLI said '1.2 s'."""
    from nanovllm_core.educational.commentary import ms
    from nanovllm_tui.widgets.format import fmt_ms

    assert fmt_ms(seconds) == shown
    if seconds is not None and seconds != 0.9996:  # (whole ms in a cell: 999.6 ms is a full second there)
        assert fmt_ms(seconds).endswith(" s") == ms(seconds).endswith(" s")


async def test_an_abort_this_app_did_not_ask_for_is_told_apart_from_its_own(tiny_llama_dir, tmp_path):
    """Trial 26c: a server shutting down aborted the app's request and the toast said "aborted after 8
    tokens" in the words of the `a` key, as if the person had aborted it."""
    from tests.tui_helpers import Notes, send_prompt, tiny_app

    notes = Notes()
    app = tiny_app(tiny_llama_dir, tmp_path, start_paused=True, max_tokens=50)
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the model")
        await send_prompt(pilot, "first")
        first = app.selected
        await send_prompt(pilot, "second")
        second = app.selected
        await wait_until(pilot, lambda: {first, second} <= set(app.state.requests), what="both requests")
        app.controller.abort(first)  # as a server's shutdown or another client does: not the `a` key
        await wait_until(pilot, lambda: app.state.requests[first].state == "finished", what="the abort")
        await pilot.press("escape", "a")  # the person's own abort of the selected (second) one
        await wait_until(pilot, lambda: app.state.requests[second].state == "finished", what="my abort")
        await pilot.pause(0.2)
        assert notes.find(f"{first} aborted on the server, not by this app")
        assert notes.find(f"{second} aborted before its prefill began") and not notes.find(f"{second} aborted on the server")


async def test_under_connect_a_start_up_prompt_with_the_default_max_tokens_fits_the_servers_context(tiny_server,
                                                                                                  tmp_path):
    """Left open in trial 30e's fix: the bar lowered a default max tokens the server's max_model_len refuses,
    but `nanovllm-tui --connect URL --prompt hi` sent its prompt with the default before the server told its
    max_model_len, and the app ended with the --max-tokens line. The prompt now waits for it and goes with
    half of it (tiny_server: 512), as the bar's value does; a typed --max-tokens is still refused (above)."""
    from nanovllm_tui.remote import RemoteController
    from nanovllm_tui.widgets.prompt_bar import PromptSettings

    app = NanoVLLMApp(RemoteController(tiny_server.url, tiny_server.api_key),
                      settings=PromptSettings(max_tokens=9000, chat=False, max_tokens_given=False),
                      prompts=[("Hi", 0)], tutorial_path=tmp_path / "t.json")
    exits, exit_app = [], app.exit
    app.exit = lambda *a, **kw: (exits.append(kw), exit_app(*a, **kw))[1]
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app._startup_ids, timeout=60, what="the start-up prompt sent")
        [rid] = app._startup_ids
        assert app.state.requests[rid].max_tokens == 256
        await wait_until(pilot, lambda: app.state.requests[rid].state not in ("submitted", "waiting"), timeout=60,
                         what="the server to admit it")
        assert app.state.requests[rid].state != "rejected" and not exits
        app.controller.abort(rid)
    assert not exits


def test_an_abort_toast_tells_how_far_a_prompt_without_tokens_had_got():
    """Trial 43e: a request aborted with its prompt 48 of 72 in was toasted as "aborted after 0 tokens"."""
    from dataclasses import replace
    from types import SimpleNamespace

    from nanovllm_tui.app import abort_progress
    from tests.test_narrator import finished

    aborted = replace(finished(n_out=0), finish_reason="abort")
    assert abort_progress(aborted, SimpleNamespace(prompt_len=72, prefilled=48)) == (
        "in the middle of its prefill, 48 of its 72 prompt tokens in the KV cache; its KV blocks are released (a "
        "block another request shares stays in use)")
    assert abort_progress(aborted, SimpleNamespace(prompt_len=72, prefilled=0, num_preemptions=0)) == (
        "before its prefill began; it held no KV blocks")
    assert abort_progress(aborted, SimpleNamespace(prompt_len=72, prefilled=0, num_preemptions=1)) == (
        "while preempted; it held no KV blocks (its preemption had released them)")
    assert abort_progress(replace(aborted, num_output_tokens=2), SimpleNamespace(prompt_len=72, prefilled=72)) \
        .startswith("after 2 tokens; its KV blocks are released")
    assert abort_progress(aborted, None).startswith("after 0 tokens")  # a row the app never saw: no claim



def test_the_block_maps_legend_names_every_glyph_a_block_can_be_drawn_with():
    """Trial 45c: a quarter-full block was drawn "▂▂" and the legend listed only "▄▄" for part-filled blocks."""
    from nanovllm_core import events as ev
    from nanovllm_tui.views.block_map import legend_text
    from nanovllm_tui.widgets.block_grid import LEVELS

    blocks = ev.BlocksChanged(step=0, block_size=16, bytes_per_block=1, states="uf", ref_counts=(1, 0),
                              tables=(ev.SeqBlocks("0", 0, 0, (0,), 4, 4),))
    legend = legend_text(blocks, {}).plain
    assert all(glyph in legend for glyph in LEVELS), legend
