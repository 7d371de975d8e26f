"""Issue 29, newcomer trial 7: the app never shows a stale or wrong state."""

from __future__ import annotations

import pytest

from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.widgets.prompt_bar import PromptSettings
from tests.tui_helpers import Notes, engine_app, send_prompt, tiny_app, wait_until

SIZE = (120, 40)
pytestmark = pytest.mark.anyio


def _record_exits(app: NanoVLLMApp) -> list:
    exits, exit_app = [], app.exit
    app.exit = lambda *a, **kw: (exits.append(kw), exit_app(*a, **kw))[1]
    return exits


# ---------------------------------------------------------------- 1: max tokens that do not fit after the prompt


async def _start_up_refusal(tiny_llama_dir, tmp_path, prompts: list, max_tokens: int, **engine) -> tuple[str, NanoVLLMApp]:
    """Start the app on the tiny model with ``prompts`` sent at start: the one line it ends with
    (status 2), and the app."""
    from nanovllm_core.engine.controller import EngineController
    from nanovllm_tui.starter import BackgroundController

    controller = BackgroundController(lambda: EngineController(model=str(tiny_llama_dir), **engine))
    app = NanoVLLMApp(controller, settings=PromptSettings(max_tokens=max_tokens, chat=False), prompts=prompts,
                      tutorial_path=tmp_path / "t.json")
    exits = _record_exits(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: exits, timeout=60, what="the app to refuse the start-up prompt")
    assert app.return_code == 2 and len(exits) == 1
    return str(exits[0]["message"]), app


async def test_a_start_up_prompt_whose_max_tokens_do_not_fit_after_it_ends_the_app_with_status_2(tiny_llama_dir, tmp_path):
    """`nanovllm-tui --prompt "hello there" --max-tokens 8191` ran (capped at the context) where
    `nanovllm` refuses it; the tiny model's context is 512, so 512 never fits after a prompt."""
    line, app = await _start_up_refusal(tiny_llama_dir, tmp_path, [("hello there", 0)], 512, num_kv_blocks=64)
    # newcomer trial 8: the options, as nanovllm names them ("lower max_tokens or raise max_model_len" before)
    assert line.startswith("nanovllm-tui: error: --prompt was refused: --max-tokens 512 does not fit: the prompt has ")
    assert "the context (max_model_len) is 512" in line and "\n" not in line
    # 512 is the tiny LLaMA's whole context: raising --max-model-len is no way out (trial 20e)
    assert line.endswith("; lower --max-tokens (--max-model-len is already the model's whole context)")
    assert not any(r.state == "finished" and r.finish_reason == "length" for r in app.state.requests.values())


async def test_the_prompt_bar_refuses_max_tokens_that_do_not_fit_and_keeps_the_prompt(tiny_llama_dir, tmp_path):
    app, notes = tiny_app(tiny_llama_dir, tmp_path), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await send_prompt(pilot, "Tell me a story about a brave knight", max_tokens=510)
        rid = app.selected
        await wait_until(pilot, lambda: notes.find(f"{rid} was rejected: max_tokens 510 does not fit", "error"),
                         timeout=30, what="the refusal")
        assert app.state.requests[rid].state == "rejected"
        assert app.query_one("#prompt").value == "Tell me a story about a brave knight"
        assert notes.find("the prompt is back in the bar") and app.return_code is None  # the bar's: no exit
        await send_prompt(pilot, "Hi", max_tokens=2)  # one that fits still runs
        await wait_until(pilot, lambda: app.state.requests[app.selected].state == "finished")


@pytest.mark.real_model
async def test_the_refusal_counts_the_chat_template_the_engine_really_sees(make_engine, tmp_path):
    """The trial: max_model_len 64, max tokens 40, "Tell me a story about a brave knight" sent as
    chat: 9 tokens of text fit, but with SmolLM2's template the engine sees 38 (38 + 40 > 64)."""
    app, notes = engine_app(make_engine, tmp_path, max_tokens=40, chat=True, max_model_len=64), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready)
        await send_prompt(pilot, "Tell me a story about a brave knight")
        rid = app.selected
        await wait_until(pilot, lambda: notes.find(f"{rid} was rejected: max_tokens 40 does not fit", "error"),
                         what="the refusal")
        assert "the prompt has 38 tokens and the context (max_model_len) is 64, so at most 26 can follow" \
            in app.state.requests[rid].error
        assert app.query_one("#prompt").value == "Tell me a story about a brave knight"


async def test_under_connect_the_servers_refusal_shows_as_the_local_one(tiny_server, tmp_path):
    from nanovllm_tui.remote import RemoteController

    app, notes = NanoVLLMApp(RemoteController(tiny_server.url, tiny_server.api_key),
                             settings=PromptSettings(max_tokens=4, chat=False),
                             tutorial_path=tmp_path / "t.json"), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the server's model")
        await send_prompt(pilot, "Tell me a story about a brave knight", max_tokens=510)
        rid = app.selected
        await wait_until(pilot, lambda: notes.find(f"{rid} was rejected: ", "error"), timeout=30, what="the refusal")
        assert "maximum context length is 512 tokens" in notes.find(f"{rid} was rejected")[0].message
        # the field as a client of the OpenAI routes names it: the person typed no params (trial 35a)
        assert "prompt or max_tokens." in notes.find(f"{rid} was rejected")[0].message
        assert "params." not in app.state.requests[rid].error
        assert app.query_one("#prompt").value == "Tell me a story about a brave knight"
        assert notes.find("the prompt is back in the bar")


async def test_under_connect_a_start_up_prompt_that_does_not_fit_ends_the_app_with_status_2(tiny_server, tmp_path):
    from nanovllm_tui.remote import RemoteController

    app = NanoVLLMApp(RemoteController(tiny_server.url, tiny_server.api_key),
                      settings=PromptSettings(max_tokens=512, chat=False), prompts=[("hello there", 0)],
                      tutorial_path=tmp_path / "t.json")
    exits = _record_exits(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: exits, timeout=60, what="the app to refuse the start-up prompt")
    assert app.return_code == 2
    line = str(exits[0]["message"])
    assert line.startswith("nanovllm-tui: error: --prompt was refused: ") and "maximum context length" in line


def test_the_library_still_caps_output_at_the_context(make_tiny_engine):
    """LLMEngine without fit_context (LLM.generate's way, vLLM's LLM): the request runs and stops at
    max_model_len with finish_reason "length"; with it, the same request is rejected."""
    from nanovllm_core.sampling_params import SamplingParams

    engine = make_tiny_engine(num_kv_blocks=64, max_model_len=24)
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    engine.add_request("hello there", params, request_id="capped")
    engine.add_request("hello there", params, request_id="refused", fit_context=True)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    for out in engine.pop_finished_outputs():
        outputs[out.request_id] = out
    capped, refused = outputs["capped"], outputs["refused"]
    assert capped.outputs[0].finish_reason == "length"
    assert len(capped.prompt_token_ids) + len(capped.outputs[0].token_ids) == 24
    assert refused.outputs[0].finish_reason == "rejected" and "max_tokens 30 does not fit" in refused.error


# ---------------------------------------------------------------- 3: the whole header at 120 columns

LONG_MODEL = "Meta-Llama-3.1-8B-Instruct"  # the longest name of a LLaMA checkpoint one is likely to run


@pytest.mark.parametrize("case", ["replay before a step", "replay paused at step 1", "replay pausing… at step 1234",
                                  "replay resuming… at step 1234", "running at step 1234", "disconnected at step 1234",
                                  "paused at step 1234"])
async def test_at_120_columns_the_header_keeps_the_weight_format_in_every_normal_state(tmp_path, case):
    """`--replay run.jsonl --paused` read `… · cpu · float32 · gguf weights (q4_1+q8_0)` before the
    first `n`, and `… · cpu · float32` from step 1 on: the step made the line longer and the weights went."""
    from tests.tui_helpers import replay_app

    app = replay_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the replay's model")
        state = app.state
        state.model_name = LONG_MODEL
        state.model_info = {**state.model_info, "quantization": "gguf", "weight_kinds": "q4_1+q8_0"}
        replay = case.startswith("replay")  # else as --connect or a local engine shows it
        state.step = None if "before" in case else int(case.rsplit(" ", 1)[1])
        state.paused = "paused" in case or "resuming" in case
        state.pending = "pausing" if "pausing" in case else "resuming" if "resuming" in case else None
        if case.startswith("disconnected"):
            state.engine_state = "disconnected"
        elif case.startswith("running"):
            state.engine_state = "running"
        active = len(state.active_requests)
        assert active >= 2 or "before" in case  # the trace's requests are under way at the steps checked
        app.query_one("#header").show(state, replay=replay, width=app.size.width - 2)  # as the app's _show_header
        line = str(app.query_one("#header").render())
        assert len(line) <= SIZE[0] - 2 and "…" not in line.replace("pausing…", "").replace("resuming…", "")
        for part in ("nano-vLLM", LONG_MODEL, "cpu · float32", "q4_1+q8_0 gguf", f"{active} active"):
            assert part in line, (part, line)
        assert ("replay" in line) == replay
        if state.step is not None:
            assert f"step {state.step}" in line
        shown = {"disconnected": "● disconnected", "running": "● running", "paused": "● paused"}
        expected = "● pausing…" if "pausing" in case else "● resuming…" if "resuming" in case else next(
            (v for k, v in shown.items() if k in case), "● paused")
        assert expected in line, (expected, line)


# ---------------------------------------------------------------- 6: the chat box without colour


async def test_the_chat_box_reads_differently_on_and_off_without_colour(tiny_llama_dir, tmp_path):
    """After ctrl+t a text capture still read `▐X▌ chat` (only the colour differed), yet the next
    prompt went as raw text."""
    app = tiny_app(tiny_llama_dir, tmp_path)
    app.settings.chat = True
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        box = app.query_one("#chat")
        on, screen_on = box.render().plain, _screen_text(app)
        await pilot.press("ctrl+t")
        await pilot.pause()
        off, screen_off = box.render().plain, _screen_text(app)
        assert app.query_one("#prompt-bar").chat is False
        assert "X" in on and "chat" in on and "X" not in off and "raw" in off and "chat" not in off
        assert "▐X▌ chat" in screen_on and "▐X▌ chat" not in screen_off and "▐ ▌ raw" in screen_off
        assert box.size.width == 9  # the prompt beside it keeps its width
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert box.render().plain == on and app.query_one("#prompt-bar").chat is True


def _screen_text(app) -> str:
    """The screen as plain text, as a terminal capture (tmux capture-pane) reads it."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


# ---------------------------------------------------------------- 4: Esc then a digit, sent at once


def _parsed(data: str) -> list:
    """The key events Textual's terminal parser makes of ``data`` (an ESC alone waits for more: flushed)."""
    import time

    from textual._xterm_parser import XTermParser

    parser = XTermParser()
    keys = list(parser.feed(data))
    time.sleep(0.15)  # past textual's ESCAPE_DELAY
    return keys + list(parser.feed(""))


@pytest.mark.parametrize("digit, tab", [("3", "narrator"), ("4", "tutorial")])
async def test_esc_then_a_digit_at_once_leaves_the_prompt_bar_and_shows_the_tab(tmp_path, tiny_llama_dir, digit, tab):
    """`tmux send-keys Escape 3` typed "£" into the prompt (Textual read ESC 3 as WezTerm's Option+3)."""
    from textual import events

    from nanovllm_tui.lifetime import read_esc_key_as_alt
    from tests.tui_helpers import visible_tab

    app = tiny_app(tiny_llama_dir, tmp_path)
    app.get_driver_class()  # what `nanovllm-tui` does before its driver starts: the parser's table is set
    [key] = _parsed("\x1b" + digit)
    assert (key.key, key.character) == (f"alt+{digit}", digit)
    read_esc_key_as_alt()  # twice is harmless
    [pound] = _parsed("£")  # typed as such, it is still the character
    assert (pound.key, pound.character) == ("pound_sign", "£")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        app.query_one("#prompt").focus()
        await pilot.press("h", "i")
        assert app.focused.id == "prompt" and app.query_one("#prompt").value == "hi"
        event = events.Key(key.key, key.character)
        event.set_sender(app)
        app._driver.send_message(event)
        await wait_until(pilot, lambda: visible_tab(app) == tab, timeout=10, what=f"tab {digit}")
        assert app.query_one("#prompt").value == "hi" and app.focused.id != "prompt"
        # outside the bar too (trial 8: focus on a view, ESC 2 at once left the tab as it was)
        event = events.Key("alt+2", "2")
        event.set_sender(app)
        app._driver.send_message(event)
        await wait_until(pilot, lambda: visible_tab(app) == "xray", timeout=10, what="tab 2 from outside the bar")
        assert app.query_one("#prompt").value == "hi"
        # ESC then space at once: Textual dropped the ESC and typed the space (trial 8); now Esc, then pause
        [space] = _parsed("\x1b ")
        assert (space.key, space.character) == ("alt+space", " ")
        app.query_one("#prompt").focus()
        event = events.Key(space.key, space.character)
        event.set_sender(app)
        app._driver.send_message(event)
        await wait_until(pilot, lambda: app.state.paused or app.state.pending == "pausing", timeout=10,
                         what="Esc space to pause")
        assert app.query_one("#prompt").value == "hi" and app.focused.id != "prompt"
        app.query_one("#prompt").focus()  # entering the prompt puts the cursor after its text (trial 20e)
        await pilot.press("home")  # Textual 8 binds alt+backspace to delete the word right of the cursor
        await pilot.press("alt+backspace")  # an alt key the field binds keeps its meaning: delete a word
        await pilot.pause()
        assert app.query_one("#prompt").value == "" and app.focused.id == "prompt"


# ---------------------------------------------------------------- 5: one TTFT (and TPOT), live and finished


async def test_ttft_and_tpot_shown_live_are_the_figures_reported_at_the_finish(tiny_llama_dir, tmp_path):
    """A running row showed TTFT 414 ms, after `a` (abort) 416 ms: the live value came from event
    times, the final one from the engine's clock."""
    app = tiny_app(tiny_llama_dir, tmp_path, start_paused=True, max_tokens=20)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await send_prompt(pilot, "Once upon a time")
        rid = app.selected
        for n in range(1, 4):  # prefill + first token, then two decode steps
            app.controller.step(1)
            await wait_until(pilot, lambda: app.state.requests[rid].num_output == n, timeout=30, what=f"token {n}")
        req = app.state.requests[rid]
        live_ttft, live_tpot = req.ttft, req.tpot
        assert live_ttft is not None and live_tpot is not None
        assert (live_ttft, live_tpot) == (req.engine_ttft, req.engine_tpot)  # the engine's own figures
        app.controller.abort(rid)
        await wait_until(pilot, lambda: app.state.requests[rid].state == "finished", timeout=30, what="the abort")
        assert req.finish_reason == "abort" and req.num_output == 3
        assert (req.finished_ttft, req.finished_tpot) == (live_ttft, live_tpot)  # exactly: nothing changed
        assert (req.ttft, req.tpot) == (live_ttft, live_tpot)


def test_a_trace_recorded_before_tokens_carried_ttft_still_shows_one_from_event_times():
    from nanovllm_core import events as ev
    from nanovllm_tui.state import EngineState

    state = EngineState()
    state.apply(ev.RequestAdded(request_id="r", prompt="hi", prompt_token_ids=(1, 2), prompt_pieces=("h", "i"),
                                priority=0, max_tokens=4, n=1, sampling=(), time=10.0))
    for i, t in enumerate((10.25, 10.5, 10.75), 1):
        state.apply(ev.TokenSampled(step=i, request_id="r", seq_id=0, index=0, token_id=5, text="x", position=1 + i,
                                    num_output_tokens=i, time=t))
    req = state.requests["r"]
    assert req.engine_ttft is None and req.ttft == pytest.approx(0.25) and req.tpot == pytest.approx(0.25)


# ---------------------------------------------------------------- 2: --connect to a server still opening its port


def test_connect_waits_for_a_server_that_opens_its_port_a_moment_later(make_tiny_engine, capsys, monkeypatch):
    """`nanovllm serve --port P &` and `nanovllm-tui --connect http://127.0.0.1:P` started together
    ended at once with "cannot reach ... (connection refused)": the port opens ~6 s after start."""
    import socket
    import threading
    import time

    from nanovllm_core.engine.controller import EngineController
    from nanovllm_core.entrypoints.api_server import APIServer, build_app
    from nanovllm_tui import options
    from nanovllm_tui.remote import ConnectionRefused, check_server
    from tests.serve_helpers import free_socket

    controller = EngineController.from_engine(make_tiny_engine(num_kv_blocks=64))
    probe = free_socket()
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    url = f"http://127.0.0.1:{port}"
    server, opened = APIServer(build_app(controller, api_key="k"), log_level="warning", access_log=False), []

    def open_port() -> None:
        opened.append(time.monotonic())
        server.start_in_thread(socket.create_server(("127.0.0.1", port)))

    told = []
    with pytest.raises(ConnectionRefused, match=r"cannot reach .* \(connection refused\); is `nanovllm serve`"):
        check_server(url, "k", wait_refused_s=0.6, on_refused=lambda: told.append(time.monotonic()))
    assert len(told) == 1  # said once, at the first refusal
    timer = threading.Timer(1.5, open_port)
    timer.start()
    try:
        start = time.monotonic()
        args = options.parse_args(["--connect", url, "--api-key", "k"])  # waits, saying so, then checks as usual
        assert args.connect == url and opened and time.monotonic() - start >= 1.4
        err = capsys.readouterr().err.splitlines()
        assert err == [f"nanovllm-tui: nothing answers at {url} yet (connection refused); "
                       f"waiting up to {options.REFUSED_WAIT_S:g} s for "
                       "a server starting there (Ctrl-C stops)"]
        assert check_server(url, "k", on_refused=told.append) == controller.engine.model_name and len(told) == 1
    finally:
        timer.join()
        server.stop()
        controller.shutdown(timeout=5)


def test_connect_gives_up_on_a_refusing_address_after_the_bound_with_the_same_line(capsys, monkeypatch):
    import time

    from nanovllm_tui import options
    from tests.serve_helpers import free_socket

    probe = free_socket()
    port = probe.getsockname()[1]
    probe.close()
    monkeypatch.setattr(options, "REFUSED_WAIT_S", 1)
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        options.parse_args(["--connect", f"http://127.0.0.1:{port}"])
    assert exit_info.value.code == 2 and 0.7 <= time.monotonic() - start < 5
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"nanovllm-tui: nothing answers at http://127.0.0.1:{port} yet (connection refused); "
                             "waiting up to 1 s")
    assert err[-1].endswith(f"--connect: cannot reach http://127.0.0.1:{port} (connection refused); is `nanovllm "
                            "serve` running there?") and len(err) == 2


async def test_start_up_prompts_the_kv_pool_can_never_hold_end_the_app_with_status_2(tiny_llama_dir, tmp_path):
    """Trial 21a bug 3: three --prompts all refused for a pool too small; the app kept running with only the
    first put back in the bar. Every refused --prompt now ends the app with one line, as a wrong option does."""
    prompts = [("The capital of France is a city that", 0), ("Python is a programming language", 5),
               ("Once upon a time there was", 1)]
    line, _ = await _start_up_refusal(tiny_llama_dir, tmp_path, prompts, 20, num_kv_blocks=2, block_size=8)
    assert line.startswith("nanovllm-tui: error: --prompt 1 was refused: the request may need ")
    assert line.endswith("but the pool has only 2; raise --num-kv-blocks or lower --max-tokens") and "\n" not in line
