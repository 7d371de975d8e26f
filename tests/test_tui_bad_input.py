"""Bad input and failures: each shows a notification (or the layout adapts) and the app stays up."""

from __future__ import annotations

import time

import pytest
from textual.widgets import TabbedContent

from nanovllm_core.engine.controller import EngineController
from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.options import build_app, parse_args
from nanovllm_tui.replay import ReplayController, load_trace
from nanovllm_tui.starter import BackgroundController
from tests.tui_helpers import TRACE, Notes, engine_app, replay_app, send_prompt, tiny_app, wait_until

pytestmark = pytest.mark.anyio
SIZE = (120, 40)


async def still_answers_keys(pilot) -> None:
    """The app is up: a number key still switches the tab."""
    await pilot.press("escape", "5")
    await pilot.pause()
    assert pilot.app.query_one(TabbedContent).active == "blocks"


async def test_empty_prompt_is_not_sent_and_says_why(tiny_llama_dir, tmp_path):
    app, notes = tiny_app(tiny_llama_dir, tmp_path), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await send_prompt(pilot, "")
        await pilot.pause()
        assert notes.find("Not sent: the prompt is empty", "warning") and not app.state.requests
        await still_answers_keys(pilot)


async def test_a_setting_that_is_not_a_number_is_not_sent(tiny_llama_dir, tmp_path):
    app, notes = tiny_app(tiny_llama_dir, tmp_path), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await send_prompt(pilot, "Hello", max_tokens="lots")
        await wait_until(pilot, lambda: notes.find("max tokens must be a whole number", "error"), timeout=10)
        assert not app.state.requests and app.query_one("#prompt").value == "Hello"


async def test_a_refused_settings_toast_goes_once_the_field_is_fixed(tiny_llama_dir, tmp_path):
    """Trial 13: max "0" then Enter: the "Not sent: max tokens ..." toast stayed on screen after the field was
    fixed and focus had moved. It goes when the field it names becomes valid, and shows again if it is broken again."""
    app, notes = tiny_app(tiny_llama_dir, tmp_path), Notes()

    def toasts() -> list[str]:
        return [n.message for n in app._notifications if n.message.startswith("Not sent")]

    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        app.query_one("#prompt").focus()
        await pilot.press(*"Hello", "tab", "tab")
        assert app.focused.id == "max-tokens"
        await pilot.press("end", *["backspace"] * 5, "0", "enter")
        await wait_until(pilot, lambda: toasts(), timeout=5, what="the refusal")
        assert "max tokens must be a whole number" in toasts()[0]
        await pilot.press("backspace", "5", "shift+tab")
        await pilot.pause()
        assert not toasts() and not str(app.query_one("#prompt-error").render())
        await pilot.press("tab", "backspace", "0", "enter")  # broken again: said again, at once
        await wait_until(pilot, lambda: toasts(), timeout=5, what="the refusal again")
        assert not app.state.requests


@pytest.mark.real_model
async def test_a_prompt_longer_than_the_model_allows_is_rejected_with_the_reason(make_engine, tmp_path):
    app, notes = engine_app(make_engine, tmp_path, max_model_len=32), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready)
        await send_prompt(pilot, "word " * 60)
        rid = app.selected
        await wait_until(pilot, lambda: notes.find(f"{rid} was rejected: the prompt has", "error"),
                         what="the rejection's notification")
        assert "max_model_len is 32" in app.state.requests[rid].error
        # kept, as a bad setting keeps it (newcomer trial 3: the refused prompt was wiped from the bar)
        assert app.query_one("#prompt").value == "word " * 60 and notes.find("the prompt is back in the bar")
        field = app.query_one("#prompt")  # the cursor after it: typing goes on at its end (trial 8: in front)
        assert field.has_focus and field.cursor_position == len(field.value)
        await pilot.press("x")
        assert field.value == "word " * 60 + "x"
        await send_prompt(pilot, "Hi", max_tokens=2)  # the engine still serves
        await wait_until(pilot, lambda: app.state.requests[app.selected].state == "finished")


@pytest.mark.real_model
async def test_an_engine_error_is_shown_and_the_next_prompt_still_runs(make_engine, tmp_path):
    app, notes = engine_app(make_engine, tmp_path), Notes()
    failures = []

    def fail_once(plan):
        if not failures:
            failures.append(plan.step)
            raise RuntimeError("injected failure")

    app.controller.engine.fault_injector = fail_once
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready)
        await send_prompt(pilot, "Hello", max_tokens=2)
        await wait_until(pilot, lambda: notes.find("injected failure", "error"), what="the error notification")
        await send_prompt(pilot, "The sky is", max_tokens=2)
        rid = app.selected
        await wait_until(pilot, lambda: app.state.requests[rid].state == "finished")
        assert app.state.requests[rid].num_output == 2


def _app_loading(tmp_path, **engine) -> tuple[NanoVLLMApp, Notes]:
    """An app whose engine loads with ``EngineController(**engine)`` in the background, and its notes."""
    app = NanoVLLMApp(BackgroundController(lambda: EngineController(**engine)), tutorial_path=tmp_path / "t.json")
    return app, Notes()


async def test_a_model_that_cannot_load_is_reported_and_the_app_stays_up(tmp_path):
    app, notes = _app_loading(tmp_path, model=str(tmp_path / "no-such-model"))
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: notes.find("model failed to load", "error"), timeout=30,
                         what="the load failure's notification")
        assert app.state.phase == "failed"
        assert "does not exist" in str(app.query_one("#header").render())
        # the model path was given: the toast does not tell the reader to "try --model PATH" (trial 7's kind)
        assert notes.find("--model naming a checkpoint that loads") and not notes.find("Try --model")
        await send_prompt(pilot, "Hello")
        await wait_until(pilot, lambda: notes.find("was rejected: no model loaded"), what="the rejection")
        await still_answers_keys(pilot)


async def test_after_a_failed_load_every_tab_says_there_is_no_engine(tmp_path):
    """Trial 13: after a failed load the KV panel said "waiting for the model", the Block Map and the X-Ray
    "send a prompt": nothing will ever step. Each empty state now says there is no engine."""
    app, notes = _app_loading(tmp_path, model=str(tmp_path / "no-such-model"))
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.phase == "failed", timeout=30, what="the load failure")
        await pilot.press("escape", "1")
        await pilot.pause()
        shown = {"KV": str(app.query_one("#kv").render()), "output": str(app.query_one("#output").render())}
        await pilot.press("escape", "5")
        await pilot.pause()
        shown["Block Map"] = str(app.query_one("#blocks-summary").render())
        await pilot.press("escape", "2")
        await pilot.pause()
        shown["X-Ray"] = str(app.query_one("#xray-title").render())
        for where, text in shown.items():
            flat = " ".join(text.split())
            assert "No engine: model failed to load (see the header)" in flat, (where, flat)
            assert "send a prompt" not in flat.lower() and "waiting for" not in flat and "0/0" not in flat, (where, flat)


@pytest.mark.parametrize("size", [(120, 40), (60, 20)])
async def test_the_kv_panel_names_the_step_its_figures_are_after(tmp_path, size):
    """Trial 13: while step 46 ran the header said "running · step 46" and the KV panel showed the pool as
    step 45 left it, unlabelled. Its title now says which step its figures are after."""
    import dataclasses

    app = replay_app(tmp_path)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        assert "before any step" in app.query_one("#kv").border_title
        app.controller.step(4)
        await wait_until(pilot, lambda: app.state.kv is not None and app.state.kv.step == 3)
        await pilot.pause()
        assert app.query_one("#kv").border_title.endswith("after step 3")
        app.state.apply(dataclasses.replace(app.state.plan, step=4))  # step 4 in flight: the header names it
        app._redraw()
        await pilot.pause()
        assert app.state.step == 4 and ("step 4" in str(app.query_one("#header").render()) or size[0] < 100)
        assert app.query_one("#kv").border_title.endswith("after step 3")
        assert len(app.query_one("#kv").border_title) <= app.query_one("#kv").size.width - 4


async def test_a_60x20_terminal_folds_panels_away_and_keeps_working(tmp_path):
    app = replay_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        app.controller.step(4)
        await wait_until(pilot, lambda: app.state.step == 3)
        await pilot.resize_terminal(60, 20)
        await pilot.pause()
        assert app.screen.has_class("-narrow") and app.screen.has_class("-short")
        assert not app.query_one("#topk").display and not app.query_one("#throughput").display
        for key in "12345":
            await pilot.press("escape", key)
            await pilot.pause()
            assert app.query_one(f"#{app.query_one(TabbedContent).active}-view").region.height > 5
        await pilot.resize_terminal(120, 40)
        await pilot.pause()
        assert not app.screen.has_class("-narrow")


async def test_keys_that_cannot_act_now_say_why(tmp_path):
    # a slow replay, so the selected request is still running when a is pressed
    app = NanoVLLMApp(ReplayController(load_trace(TRACE), pace=(5.0, 5.0)), tutorial_path=tmp_path / "t.json")
    notes = Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await pilot.press("escape", "n", "a")  # a is not offered in a replay (it cannot change a recording)
        await wait_until(pilot, lambda: notes.find("n runs one step while the engine is paused", "warning"))
        app.action_abort()  # reached another way (the palette no longer offers it either): says why
        await wait_until(pilot, lambda: notes.find("its requests cannot be aborted", "warning"))
        assert not notes.find("", "error")


async def test_abort_with_no_request_selected_says_so(tmp_path):
    app = NanoVLLMApp(BackgroundController(lambda: EngineController(model=str(tmp_path / "none"))),
                      tutorial_path=tmp_path / "t.json")
    notes = Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.phase == "failed", timeout=30, what="the load failure")
        await pilot.press("escape", "a")
        await pilot.pause()
        # trial 13: no model, so no request will come: neither "pick one" nor "send a prompt"
        assert notes.find("No engine: model failed to load (see the header)", "warning")
        await pilot.press("n")
        await pilot.pause()
        assert not notes.find("press space to pause first") and not notes.find("send a prompt")


@pytest.mark.parametrize("build", ["load", "factory"])
async def test_space_with_no_engine_says_so_and_shows_no_pause_pending(tmp_path, build):
    """Space after the engine failed to start (its model did not load, or the engine could not even be
    built) did nothing at all, where n and a say there is no engine; the header must not claim a
    pause is under way either."""
    def broken():
        raise RuntimeError("no such device")

    factory = broken if build == "factory" else (lambda: EngineController(model=str(tmp_path / "none")))
    app, notes = NanoVLLMApp(BackgroundController(factory), tutorial_path=tmp_path / "t.json"), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.phase == "failed", timeout=30, what="the failure")
        await pilot.press("escape", "space")
        await wait_until(pilot, lambda: notes.find("No engine: model failed to load (see the header)", "warning"),
                         what="the no-engine warning")
        assert app.state.pending is None
        assert "paus" not in str(app.query_one("#header").render())


async def test_abort_with_no_request_at_all_says_to_send_one(tiny_llama_dir, tmp_path):
    """Trial 13: ``a`` before any prompt said "pick one in the Dashboard's table" over an empty table."""
    app, notes = tiny_app(tiny_llama_dir, tmp_path), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await pilot.press("escape", "a")
        await pilot.pause()
        assert notes.find("No request to abort: send a prompt first.", "warning")
        assert not notes.find("pick one in the Dashboard's table")


@pytest.mark.parametrize("size", [(120, 40), (60, 20)])
async def test_a_replay_invites_no_prompt_and_lists_none_it_did_not_record(tmp_path, size):
    """Issue 29, item 13: a replay's prompt bar is one line saying it takes no prompts (its fields
    disabled); keys typed at it and '/' add no request, so the X-Ray header lists none rejected."""
    from textual.widgets import Input

    app, notes = replay_app(tmp_path), Notes()
    async with app.run_test(size=size, message_hook=notes) as pilot:
        app.controller.step(4)
        await wait_until(pilot, lambda: app.state.step == 3, timeout=10, what="four recorded steps")
        recorded = {rid: req.state for rid, req in app.state.requests.items()}
        bar = app.query_one("#prompt-bar")
        line = app.query_one("#prompt-replay")
        assert line.display and line.region.height == 1 and "takes no prompts" in str(line.render())
        assert not app.query_one("#prompt-fields").display
        assert all(field.is_disabled and not field.focusable for field in bar.query(Input))
        assert not isinstance(app.focused, Input)  # the keys go to the views
        await pilot.press("slash", *"Hello", "enter")  # '/' is not offered in a replay: the bar's line says why
        await pilot.click("#prompt-replay")
        await pilot.press(*"Hi", "enter")
        await pilot.pause()
        assert app.query_one("#prompt", Input).value == "" and not isinstance(app.focused, Input)
        assert {rid: req.state for rid, req in app.state.requests.items()} == recorded
        await pilot.press("escape", "2")
        await pilot.pause()
        screen = app.export_screenshot()  # the X-Ray tab as drawn (SVG text)
        assert "X-Ray" in screen and "rejected" not in screen and "Hello" not in screen
        await still_answers_keys(pilot)


async def test_a_replay_offers_only_the_keys_that_can_act_and_titles_no_refusal_engine_error(tmp_path):
    """Newcomer trial 3: under --replay --paused the footer listed "/ Prompt" and "a Abort", and a
    showed a toast titled "Engine error". The footer and the command palette offer only what a
    replay can do; a refused command is never titled an engine error."""
    from nanovllm_tui.commands import EngineCommands

    app, notes = replay_app(tmp_path), Notes()
    async with app.run_test(size=(160, 40), message_hook=notes) as pilot:
        app.controller.step(2)
        await wait_until(pilot, lambda: app.state.step == 1, timeout=10, what="two recorded steps")
        shown = {b.action for _, b, enabled, _ in app.screen.active_bindings.values() if b.show and enabled}
        assert not shown & {"focus_prompt", "toggle_chat", "abort"} and {"toggle_pause", "step", "quit"} <= shown
        offered = [a.action for a in EngineCommands(app.screen)._offered()]
        assert "abort" not in offered and "focus_prompt" not in offered and "step" in offered
        await pilot.press("escape", "a")
        app.action_abort()  # what the palette or a stray binding would reach
        app.controller.abort(app.selected)  # the replay itself refuses too
        await pilot.pause(0.3)
        assert notes.find("its requests cannot be aborted", "warning")
        assert all(n.title != "Engine error" for n in notes.items), [(n.title, n.message) for n in notes.items]
        assert notes.find("part of a recording", "warning")


@pytest.mark.parametrize("argv, message", [
    (["--replay", "/no/such/trace.jsonl"], "cannot replay /no/such/trace.jsonl"),
    (["--replay", str(TRACE), "--chat"], "--chat does nothing with --replay"),
    (["--replay", str(TRACE), "--raw"], "--raw does nothing with --replay"),
    (["--tutorial"], "--tutorial is a nanovllm option and not available in the app (its tabs show the same"),
    (["--prompt", ""], "--prompt must not be empty"),
    (["--fps", "0"], "--fps: must be between 1 and 60 (screen updates per second), got '0'"),
    (["--fps", "fast"], "--fps: must be between 1 and 60 (screen updates per second), got 'fast'"),  # trial 12b
    (["--fps", "٥"], "--fps: must be between 1 and 60"),  # ASCII digits, as every number option
    (["--fps", "0"], "argument --fps: must be between 1 and 60"),
    (["--model", ""], "argument --model: a model name must not be empty, got ''; leave the option out"),
    (["--temperature", "-1"], "temperature"),
    (["--trace-xray"], "--trace-xray records into the --trace file; add --trace FILE.jsonl"),
    (["--replay", str(TRACE), "--model", "x"], "--model does nothing with --replay: a replay plays a recorded trace"),
    (["--replay", str(TRACE), "--max-tokens", "5"], "--max-tokens does nothing with --replay"),
    (["--replay", str(TRACE), "--trace", "t.jsonl"], "--trace does nothing with --replay"),
    (["--replay", str(TRACE), "--quantization", "q8_0"], "--quantization does nothing with --replay"),
    (["--quantization", "int4"], "--quantization: invalid choice: 'int4'"),
    (["--quantization", "int8"], "--quantization: quantization int8 was removed; use q8_0 (int8 weights in 32-weight"),
    (["--prompt", "a", "--priority", str(10**30)], "--priority: expected a whole number from -1000 to 1000"),
    (["--top-k", str(10**30)], "--top-k: expected a whole number from -1 to 2147483647"),
    (["--connect", "http://127.0.0.1:9", "--quantization", "q8_0"], "--quantization cannot be used with --connect"),
])
def test_bad_options_end_with_one_line_and_status_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and message in err and len(err.splitlines()) == 1


def _damaged_trace(tmp_path, how: str):
    """The test trace with one line damaged as trial 14a damaged it; returns (path, that line's number)."""
    import gzip
    import json

    lines = gzip.open(TRACE, "rt", encoding="utf-8").read().splitlines()
    if how == "wrong types":  # a StepTimed whose every field but its type says BOGUS
        i = next(k for k in range(len(lines) // 2, len(lines)) if '"type":"StepTimed"' in lines[k])
        lines[i] = json.dumps({k: v if k == "type" else "BOGUS" for k, v in json.loads(lines[i]).items()})
    elif how in ("NaN yielded", "negative prob", "negative blocks"):  # report 15b, findings 1 and 3: one field edited
        field, value, kind = {"NaN yielded": ("yielded_s", float("nan"), "StepTimed"),
                              "negative blocks": ("num_blocks_used", -3, "StepTimed"),
                              "negative prob": (None, -3.0, "TokenSampled")}[how]
        i = next(k for k in range(len(lines) // 2, len(lines))
                 if f'"type":"{kind}"' in lines[k] and (field or '"type":"TopToken"' in lines[k]))
        x = json.loads(lines[i])
        if field:
            x[field] = value
        else:
            x["top"][0]["prob"] = value
        lines[i] = json.dumps(x)
    elif how == "cut mid-file":  # line 101 cut to 50 characters, the later lines kept
        i = 100
        lines[i] = lines[i][:50]
    else:  # the last line whole but with a field of the wrong type, and no newline after it
        i = len(lines) - 1
        lines[i] = json.dumps({**json.loads(lines[i]), "time": "soon"})
    path = tmp_path / "damaged.jsonl"
    path.write_text("\n".join(lines) + ("" if how == "last line" else "\n"), encoding="utf-8")
    return path, i + 1


@pytest.mark.parametrize("how, message", [
    ("wrong types", 'StepTimed.time must be a number, got "BOGUS"'),  # was: the app's Rich traceback, status 1
    ("cut mid-file", "not complete JSON, cut short or corrupted (it stops after 50 characters)"),  # was: "Invalid
    ("last line", 'must be a number, got "soon"'),  # control character at: line 1 column 51"; was: read as a cut line
    ("NaN yielded", "StepTimed.yielded_s must be a finite number >= 0, got NaN"),  # was: the app's traceback, status 1
    ("negative prob", "TokenSampled.top[0].prob must be a number from 0 to 1, got -3.0"),  # was: drawn as -300.0%
    ("negative blocks", "StepTimed.num_blocks_used must be >= 0, got -3"),  # was: "used -3" of the pool
])
def test_a_damaged_trace_is_refused_with_its_line_and_what_is_wrong(capsys, tmp_path, how, message):
    path, line = _damaged_trace(tmp_path, how)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--replay", str(path)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"nanovllm-tui: error: cannot replay {path}: line {line}: ") and err.endswith(message)


@pytest.mark.parametrize("content, message", [
    (b'{"type":"ModelLoading","time":1.0,"stage":"x","done":1,"total":2,"zzz":1}\n',
     'line 1: ModelLoading has no field "zzz" (it has "time", '),
    (b'{"type":"EnginePaused","time":1.0}\n', 'line 1: EnginePaused lacks "step", which every EnginePaused has; the line '
     "was edited or not written by nanovllm: record a trace with nanovllm --trace FILE.jsonl"),
    (b"\xff\xfe\x00\x01binary", "not a trace: it holds bytes that are not UTF-8 text (0xff), as a binary file does; "
     "record a trace with nanovllm --trace FILE.jsonl"),
])
def test_a_trace_that_does_not_fit_is_refused_in_our_words_with_what_to_do(capsys, tmp_path, content, message):
    """Report 15b, finding 7: these said "TokenSampled.__init__() missing 1 required positional argument",
    "got an unexpected keyword argument 'zzz'" and "'utf-8' codec can't decode byte 0xff"."""
    path = tmp_path / "edited.jsonl"
    path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--replay", str(path)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"nanovllm-tui: error: cannot replay {path}: {message}"), err
    assert "__init__" not in err and "codec" not in err and "record a trace with nanovllm --trace FILE.jsonl" in err


def test_the_apps_help_lists_only_options_the_app_takes(capsys):
    """Trial 14e: ``nanovllm-tui --help`` offered --narrate, --xray, --dashboard, --tutorial, --no-demos,
    --tutorial-chapter and --show-memory-stats, which the app always refuses. They are left out of
    its help and usage; typed, each is still refused with the line that names the tabs."""
    import argparse
    import re

    from nanovllm_tui.options import NOT_IN_APP, build_parser

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert "The capital of France" not in out  # nanovllm's default prompt: the app sends none unless given one
    # --logprobs: the engine computes them, the app shows its own top-5 panel instead (fix15c's note)
    assert "show the top-N log-probabilities" not in out and "the app does not show them" in " ".join(out.split())
    shown = set(re.findall(r"--[a-z][a-z-]*", out))
    refused = {f"--{name.replace('_', '-')}" for name in NOT_IN_APP}
    assert shown and not shown & refused, shown & refused
    offered = {o for a in build_parser()._actions if a.help != argparse.SUPPRESS for o in a.option_strings}
    assert shown >= offered - {"-h"} and "--narrate-steps" in shown and "--progress-file" in shown
    for option in sorted(refused):
        argv = [option, "3"] if option == "--tutorial-chapter" else [option]
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "is a nanovllm option and not available in the app" in capsys.readouterr().err


def test_every_option_the_app_accepts_does_something_in_it_or_is_refused():
    """Each option of ``nanovllm-tui`` is listed here with where it acts, or is refused with one line
    (``NOT_IN_APP``; ``NOT_WITH_REPLAY`` beside ``--replay``). A new option must be placed here."""
    from nanovllm_tui.options import NOT_IN_APP, build_parser

    engine = {"model", "device", "dtype", "scheduling_policy", "max_prefill_tokens", "max_num_seqs", "max_model_len",
              "block_size", "num_kv_blocks", "no_paged_attention", "no_flash_attn", "no_prefix_caching",
              "speculative_model", "num_speculative_tokens", "quantization",
              "tensor_parallel_size", "tp_master_addr", "tp_master_port", "tp_local_ranks",
              "tp_rendezvous_timeout"}  # -> engine_kwargs -> the EngineController
    sampling = {"top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop", "logprobs", "ignore_eos"}
    prompt_bar = {"prompt", "priority", "max_tokens", "temperature", "chat", "raw"}  # sent at start / the bar's defaults
    app = {"narrate_steps", "progress_file", "trace", "trace_xray", "trace_chrome", "replay", "paused", "fps"}
    remote = {"connect", "api_key", "web", "host", "port"}  # attach to a server / serve the app to browsers
    accepted = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert accepted - set(NOT_IN_APP) == engine | sampling | prompt_bar | app | remote
    args = parse_args(["--top-k", "7", "--stop", "x", "--logprobs", "2", "--ignore-eos", "--seed", "3"])
    assert (args.sampling.top_k, args.sampling.stop, args.sampling.logprobs) == (7, ["x"], 2)
    assert args.sampling.ignore_eos and args.sampling.seed == 3  # applied to every prompt the app sends


@pytest.mark.real_model
async def test_trace_xray_records_the_layer_traces_of_each_step(tiny_llama_dir, tmp_path):
    from nanovllm_tui.replay import load_trace

    trace = tmp_path / "run.jsonl"
    app = build_app(["--model", str(tiny_llama_dir), "--trace", str(trace), "--trace-xray", "--prompt", "Hello",
                     "--max-tokens", "3", "--progress-file", str(tmp_path / "p.json")])
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: any(r.state == "finished" for r in app.state.requests.values()),
                         what="the prompt to finish")
        await pilot.press("escape", "q")
    events = load_trace(trace)
    layers = [e for e in events if e.kind == "LayerTrace"]
    steps = [e for e in events if e.kind == "StepPlanned"]
    assert len(steps) == 3 and len(layers) == 2 * len(steps)  # the tiny model's 2 layers, every step


@pytest.mark.real_model
async def test_quitting_inside_a_traced_step_closes_the_trace_without_a_traceback(tiny_llama_dir, tmp_path,
                                                                                 monkeypatch):
    """Trial 14a: q while a step ran under --trace --trace-xray closed the trace file under the engine
    thread, which then wrote to it: three chained tracebacks, the thread dead, status 0. The app
    does not wait for a long step; the late events are dropped and the app says once that the
    recording ends inside that step, and it still replays up to there."""
    import threading

    from nanovllm_core import events as ev

    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    trace = tmp_path / "run.jsonl"
    app = build_app(["--model", str(tiny_llama_dir), "--trace", str(trace), "--trace-xray", "--paused",
                     "--prompt", "Hello there", "--max-tokens", "3", "--progress-file", str(tmp_path / "p.json")])
    inside, go_on = threading.Event(), threading.Event()

    def long_step(event: ev.Event) -> None:  # the step's first event holds the engine thread, as a long prefill would
        if isinstance(event, ev.StepPlanned) and event.scheduled:
            inside.set()
            go_on.wait(30)

    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready and app.state.requests, what="the tiny model and the prompt")
        app.controller.subscribe(long_step, topk=0, blocks=False)
        app.controller.step(1)
        await wait_until(pilot, inside.is_set, what="step 0 to begin")
        await pilot.press("ctrl+q")  # the engine is still inside step 0: the app stops waiting for it after 1 s
    go_on.set()  # the step goes on, and its events meet a closed trace
    deadline = time.monotonic() + 30
    while app.controller.is_alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not app.controller.is_alive and died == []  # before: "Exception in thread nanovllm-engine"
    assert app.exit_lines == [f"the trace {trace} ends during step 0, which was still running when the recording "
                              "closed: --replay plays the steps before it"]
    assert not app.recording_failed
    with pytest.raises(ValueError, match="the recording stopped during step 0"):
        load_trace(trace)  # as it says: the one step it began is not played


def test_a_trace_that_cannot_be_written_at_quit_is_one_line_and_a_failing_status(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    from nanovllm_core.tracing import ChromeTraceRecorder
    from nanovllm_tui import app as app_module

    chrome, write_text = tmp_path / "run.json", Path.write_text

    def full_disk(self, *args, **kwargs):
        if self == chrome:
            raise OSError(28, "No space left on device")
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    app = replay_app(tmp_path, recorders=[ChromeTraceRecorder(chrome)])
    app.stop_engine()
    assert app.exit_lines == [f"the trace {chrome} could not be written: [Errno 28] No space left on device"]
    # main() as the console script runs it, the app's run being a quit at once
    monkeypatch.setattr(app_module.NanoVLLMApp, "run", lambda self: self.stop_engine())
    monkeypatch.setattr(app_module.NanoVLLMApp, "return_code", None)
    monkeypatch.setattr("nanovllm_tui.lifetime.end_on_early_signals", lambda: None)  # this test runner's signals stay
    monkeypatch.setattr("nanovllm_tui.options.build_app", lambda argv: replay_app(
        tmp_path, recorders=[ChromeTraceRecorder(chrome)]))
    capsys.readouterr()
    assert app_module.main(["--replay", str(TRACE)]) == 1
    assert capsys.readouterr().err == (f"nanovllm-tui: the trace {chrome} could not be written: [Errno 28] No space "
                                       "left on device\n")


def test_a_good_replay_option_loads_the_trace():
    args = parse_args(["--replay", str(TRACE), "--paused"])
    assert args.paused and len(args.replay_events) > 100


def test_teaching_options_of_the_cli_set_the_narrator_and_tutorial_tabs(tmp_path):
    app = build_app(["--replay", str(TRACE), "--progress-file", str(tmp_path / "p.json"), "--narrate-steps", "3"])
    assert app.tutorial_path == str(tmp_path / "p.json") and app.narrator.max_decode == 3
    app.controller.shutdown()


async def test_a_narrator_failure_is_reported_once_and_the_other_tabs_go_on(tmp_path):
    app, notes = replay_app(tmp_path, start_paused=False), Notes()

    def broken(event):
        raise KeyError("surprise")

    app.narrator.feed = broken
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: notes.find("The narrator could not describe", "warning"))
        await wait_until(pilot, lambda: app.state.step is not None and app.state.step >= 2, what="two steps")
        await pilot.pause()
        assert len(notes.find("The narrator could not describe", "warning")) == 1
        await still_answers_keys(pilot)


async def test_a_60x20_terminal_keeps_chapter_text_above_an_answered_quiz(tmp_path):
    app = replay_app(tmp_path)
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.pause(0.3)
        await pilot.press("escape", "4")
        await pilot.pause(0.2)
        await pilot.press("a")  # answer: the feedback grows the quiz panel
        await pilot.pause(0.3)
        assert "-short" in app.screen.classes
        assert app.query_one("#feedback").size.height > 0
        assert app.query_one("#chapter-scroll").size.height >= 3


@pytest.mark.real_model
@pytest.mark.parametrize("switched_off", [False, True])
async def test_the_app_says_at_load_when_the_c_paths_are_off_and_why(make_engine, tmp_path, monkeypatch,
                                                                     switched_off):
    if switched_off:
        monkeypatch.setenv("NANOVLLM_NATIVE_OPS", "0")
    app, notes = engine_app(make_engine, tmp_path), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready)
        await pilot.pause()
        said = notes.find("RMSNorm and RoPE run as PyTorch ops, not in C: NANOVLLM_NATIVE_OPS=0", "warning")
        assert bool(said) == switched_off
        if not app.state.model_info.get("cpu_paged_unavailable"):
            assert not notes.find("CPU paged attention kernel not used")


async def test_at_60x20_the_request_table_keeps_cells_whole_and_scrolls_sideways(tmp_path):
    """Issue 29, item 13: at 60x20 the Dashboard's request table is wider than the screen. It does
    not wrap (docs/app.md says so): every cell is whole, the request column is in view, and ←/→
    with the table focused bring the other columns (up to the last, cached) into view."""
    from nanovllm_tui.widgets.request_table import RequestTable

    app = replay_app(tmp_path)
    async with app.run_test(size=(60, 20)) as pilot:
        app.controller.step(4)
        await wait_until(pilot, lambda: app.state.step == 3, timeout=10, what="four recorded steps")
        await pilot.press("escape", "1")
        await pilot.pause()
        table = app.query_one(RequestTable)
        assert app.focused is table and table.region.height >= 3  # header and at least two rows
        assert table.virtual_size.width > table.size.width and table.scroll_x == 0
        assert "request" in table.render_line(0).text and "cached" not in table.render_line(0).text
        for _ in range(table.virtual_size.width):
            await pilot.press("right")
        await pilot.pause()
        assert table.scroll_x == table.max_scroll_x > 0 and table.render_line(0).text.rstrip().endswith("cached")


def test_long_ids_are_shortened_to_distinct_labels():
    """Trial 9: a server's ids (``chatcmpl-`` and 32 hex digits) made the request column 45 cells wide."""
    from nanovllm_tui.widgets.request_table import ID_CELLS, short_ids

    a, b = "chatcmpl-" + "0" * 26 + "abcdef", "chatcmpl-" + "1" * 26 + "abcdef"  # same last 6
    many = [f"cmpl-{'9' * 32}-{i}" for i in range(12)]  # one completions request's prompts
    labels = short_ids(["req-0", a, b, *many, "c" * 40])
    assert labels["req-0"] == "req-0"
    assert len(set(labels.values())) == len(labels)  # distinct, as the ids are
    assert labels[many[0]] == "cmpl-…99999999-0" and labels[many[11]] == "cmpl-…9999999-11"
    assert labels["c" * 40] == "…" + "c" * (ID_CELLS - 1)
    assert labels[a].startswith("chatcmpl-…") and labels[a].endswith("abcdef") and len(labels[a]) > ID_CELLS
    assert short_ids([a]) == {a: "chatcmpl-…abcdef"}


async def test_server_ids_leave_every_column_in_view_at_120_columns(tmp_path):
    """Trial 9: under --connect the server's 41-character ids pushed TTFT to cached off a 120-column
    screen. The table shows them shortened; the selected request's panel title keeps the whole id."""
    import gzip
    import re

    from nanovllm_tui.widgets.request_table import RequestTable

    ids = {str(i): f"chatcmpl-{i}{'7' * 28}{i}a{i}b" for i in range(3)}
    text = gzip.open(TRACE, "rt").read()
    text = re.sub(r'"request_id":"(\d)"', lambda m: f'"request_id":"{ids[m.group(1)]}"', text)
    trace = tmp_path / "server_ids.jsonl"
    trace.write_text(text)
    app = replay_app(tmp_path, trace=trace)
    async with app.run_test(size=SIZE) as pilot:
        app.controller.step(4)
        await wait_until(pilot, lambda: app.state.step == 3, timeout=10, what="four recorded steps")
        await pilot.press("escape", "1", "down")
        await pilot.pause()
        table = app.query_one(RequestTable)
        header = table.render_line(0).text
        assert header.rstrip().endswith("cached") and table.max_scroll_x == 0
        rows = [table.render_line(y).text for y in range(1, 4)]
        assert all("chatcmpl-…" in row and "77777" not in row for row in rows), rows
        assert any(full in str(app.screen.query_one("#output").border_title) for full in ids.values())


async def test_at_60x20_the_block_grid_scrolls_from_the_keyboard(tiny_llama_dir, tmp_path):
    """Trial 9 (unconfirmed then): at 60x20 the Block Map shows two rows of a 500-block pool; the
    grid takes focus with the tab and PageDown/↓/End move through the whole pool."""
    from nanovllm_tui.starter import BackgroundController
    from nanovllm_tui.widgets.block_grid import BlockGrid
    from nanovllm_tui.widgets.prompt_bar import PromptSettings

    controller = BackgroundController(lambda: EngineController(model=str(tiny_llama_dir), num_kv_blocks=500))
    app = NanoVLLMApp(controller, settings=PromptSettings(max_tokens=2, chat=False),
                      tutorial_path=tmp_path / "tutorial.json")
    async with app.run_test(size=(60, 20)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, timeout=60, what="the tiny model")
        await pilot.press("escape", "5")
        grid = app.query_one(BlockGrid)
        await wait_until(pilot, lambda: grid.max_scroll_y > 0, timeout=10, what="the grid of 500 blocks")
        assert app.focused is grid and grid.max_scroll_y > 0 and grid.scroll_y == 0
        assert grid.render_line(0).text.split()[0] == "0"
        await pilot.press("pagedown", "down")
        await pilot.pause()
        assert grid.scroll_y > 1 and grid.render_line(0).text.split()[0] == str(16 * int(grid.scroll_y))
        await pilot.press("end")
        await pilot.pause()
        assert grid.scroll_y == grid.max_scroll_y and "496" in " ".join(grid.render_line(y).text for y in range(3))


async def test_an_engine_setting_that_fails_is_not_blamed_on_the_model(tmp_path, tiny_llama_dir):
    """Issue 29, trial 12: ``--block-size 1000000`` was reported as "model failed to load" with the advice
    "Start again with --model naming a checkpoint that loads", though the model was fine."""
    app, notes = _app_loading(tmp_path, model=str(tiny_llama_dir), block_size=10**6)
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: notes.find("engine setting refused", "error"), timeout=60,
                         what="the setting's notification")
        assert app.state.phase == "failed"
        header = str(app.query_one("#header").render())
        assert "engine setting refused: block_size=1000000" in header and "model failed to load" not in header
        assert notes.find("(--block-size). Start again with that option changed")
        assert not notes.find("--model naming a checkpoint")
        await still_answers_keys(pilot)


async def test_a_replayed_connection_loss_is_told_as_the_recordings_not_as_now(tmp_path):
    """Trial 34c: a --connect recording made across a server restart replayed "lost the connection ...;
    reconnecting" as if this app were losing its connection now; a replay says it is the recording's."""
    import gzip

    from nanovllm_core import events as ev
    from tests.tui_helpers import TRACE, Notes, replay_app, wait_until

    lines = gzip.open(TRACE, "rt").read().splitlines()
    lost = ev.to_json(ev.EngineError(step=None, message="lost the connection to http://127.0.0.1:8000 "
                                                         "(connection refused); reconnecting"))
    trace = tmp_path / "lost.jsonl"
    trace.write_text("\n".join([*lines[:3], lost, *lines[3:]]) + "\n")
    notes = Notes()
    app = replay_app(tmp_path, trace=trace)
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: notes.find("lost the connection"), timeout=20, what="the recorded outage")
    [told] = notes.find("lost the connection")
    assert told.title == "Connection (recorded)" and told.message.startswith("In the recording: lost the connection")


async def test_a_replayed_refusal_and_a_lost_request_are_told_as_the_recordings(tmp_path):
    """Trial 38c: the recording app's quit-time abort, refused by the server that replaced the stopped one,
    replayed as a live "Not done" toast; and "1 request it never finished are marked lost"."""
    import gzip

    from nanovllm_core import events as ev
    from nanovllm_tui.remote import ServerStopped
    from tests.tui_helpers import TRACE, Notes, replay_app, wait_until

    lines = gzip.open(TRACE, "rt").read().splitlines()
    refused = ev.to_json(ev.EngineError(step=None, request_id="tui-a1b6-0", message="abort: no running or waiting "
                                        "request \"tui-a1b6-0\" to abort"))
    stopped = ev.to_json(ServerStopped(url="http://127.0.0.1:8000", step=2, unfinished=("tui-a1b6-0",)))
    trace = tmp_path / "quit.jsonl"
    trace.write_text("\n".join([*lines[:3], stopped, refused, *lines[3:]]) + "\n")
    notes = Notes()
    app = replay_app(tmp_path, trace=trace)
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: notes.find("tui-a1b6-0") and notes.find("marked lost"), timeout=20,
                         what="the recorded refusal and loss")
    [told] = notes.find("tui-a1b6-0")
    assert told.title == "Not done (recorded)" and told.message.startswith("In the recording: abort:"), told
    [lost] = notes.find("marked lost")
    assert "1 request it never finished is marked lost" in lost.message, lost.message


def test_a_server_that_stopped_leaves_no_prompt_of_this_app_to_abort_on_quit():
    """Trial 38c: a prompt the stopped server never finished was marked lost, yet the app's quit sent its abort to
    the server that replaced it (refused there: 401, or 404 for an id it never knew)."""
    from nanovllm_tui.remote import RemoteController, ServerStopped

    remote = RemoteController("http://127.0.0.1:9", None)
    seen = []
    remote.subscribe(seen.append, topk=0, blocks=False)
    remote._sent_here.add("tui-a1b6-0")
    remote._dispatch("state", '{"state": "stopped", "step": 8, "unfinished": ["tui-a1b6-0"]}', None)
    assert [type(e) for e in seen] == [ServerStopped] and not remote._sent_here
    remote.shutdown(timeout=1)
    assert not [c for c in list(remote._commands.queue) if c and c.get("command") == "abort"]
