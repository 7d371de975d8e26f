"""The app driven with keys, as a person would (Textual's Pilot), on the real engine."""

from __future__ import annotations

import threading
import time

import pytest
from textual.widgets import Static, TabbedContent

from nanovllm_tui.views.tutorial import QuizChoices, TutorialView
from tests.tui_helpers import Notes, engine_app, replay_app, send_prompt, wait_until

pytestmark = [pytest.mark.real_model, pytest.mark.anyio]
SIZE = (120, 40)


async def test_a_prompt_from_the_bar_streams_its_tokens_in(make_engine, tmp_path):
    app = engine_app(make_engine, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the model's ready event")
        await send_prompt(pilot, "The capital of France is", max_tokens=4)
        rid = app.selected
        await wait_until(pilot, lambda: app.state.requests[rid].state == "finished", what="the request to finish")
        req = app.state.requests[rid]
        assert req.num_output == 4 and req.text == app.controller.results[rid].outputs[0].text
        assert req.ttft is not None and len(req.top) == 5
        await pilot.pause()
        shown = str(app.query_one("#output", Static).render())
        # the prompt and its continuation are two labelled turns, not one run of text (issue 29, item 4)
        assert "Prompt (raw text)\nThe capital of France is\nContinuation\n" + req.text.rstrip() in shown
        assert "The capital of France is" + req.text not in shown


async def test_pause_then_n_runs_exactly_one_step(make_engine, tmp_path):
    app = engine_app(make_engine, tmp_path, max_tokens=3)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready)
        await pilot.press("escape", "space")
        await wait_until(pilot, lambda: app.state.paused, what="the engine's pause")  # shown once confirmed
        await send_prompt(pilot, "Python is a")
        rid = app.selected
        await wait_until(pilot, lambda: app.state.requests[rid].state == "waiting", what="the request to be added")
        await pilot.press("escape", "n")
        await wait_until(pilot, lambda: app.state.step == 0, what="one step")
        await pilot.pause(0.5)  # time enough for a second step, if one were (wrongly) taken
        req = app.state.requests[rid]
        assert app.state.step == 0 and req.num_output == 1 and req.prefilled == req.prompt_len

        await pilot.press("n")
        await wait_until(pilot, lambda: app.state.step == 1)
        await pilot.pause(0.3)
        assert app.state.requests[rid].num_output == 2

        await pilot.press("5")  # the block map asks a paused engine for its pool at once
        await wait_until(pilot, lambda: app.state.blocks is not None, what="a block snapshot")
        assert app.state.blocks.step == 1 and [t.request_id for t in app.state.blocks.tables] == [rid]

        await pilot.press("space")  # resume: it runs to the end
        await wait_until(pilot, lambda: app.state.requests[rid].state == "finished")
        assert app.state.requests[rid].num_output == 3 and not app.state.paused


async def start_long_request(pilot, app) -> str:
    """Send a 200-token request once the model is ready; return its id after its first token."""
    await wait_until(pilot, lambda: app.state.ready)
    await send_prompt(pilot, "Once upon a time", max_tokens=200)
    rid = app.selected
    await wait_until(pilot, lambda: app.state.requests[rid].num_output >= 1, what="a first token")
    return rid


async def test_a_aborts_the_selected_request_and_frees_its_blocks(make_engine, tmp_path):
    app = engine_app(make_engine, tmp_path)
    notes = Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        rid = await start_long_request(pilot, app)
        await pilot.press("escape", "a")
        await wait_until(pilot, lambda: notes.find(f"{rid} aborted"), what="the abort's notification")
        assert app.state.requests[rid].finish_reason == "abort" and app.state.requests[rid].num_output < 200
        await wait_until(pilot, lambda: app.controller.state == "idle")
        assert app.controller.engine.block_manager.num_used_blocks == 0


async def test_an_abort_while_paused_shows_the_freed_blocks_and_queues_at_once(make_engine, tmp_path):
    from nanovllm_tui.views.dashboard import phase_text

    app = engine_app(make_engine, tmp_path)
    notes = Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        rid = await start_long_request(pilot, app)
        await pilot.press("escape", "space")
        await wait_until(pilot, lambda: app.state.paused, what="a pause")
        await pilot.pause(0.3)
        assert app.state.kv.num_blocks_used > 0 and "1 running" in phase_text(app.state).plain
        await pilot.press("a")  # no step runs while paused: only the finish event can tell the view
        await wait_until(pilot, lambda: notes.find(f"{rid} aborted"), what="the abort's notification")
        assert app.state.kv.num_blocks_used == 0
        assert app.state.kv.num_blocks_cached == app.controller.engine.block_manager.num_cached_free_blocks
        assert "0 running · 0 waiting" in phase_text(app.state).plain


async def test_number_keys_switch_every_tab_and_xray_is_traced_only_while_shown(make_engine, tmp_path):
    app = engine_app(make_engine, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready)
        await pilot.press("escape")
        tabs = app.query_one(TabbedContent)
        for key, tab in zip("12345", ("dashboard", "xray", "narrator", "tutorial", "blocks")):
            await pilot.press(key)
            await pilot.pause()
            assert tabs.active == tab and app.query_one(f"#{tab}-view").display
            assert app.bridge.subscription.xray == (tab == "xray")
            assert app.bridge.subscription.blocks == (tab in ("blocks", "narrator"))
        await pilot.press("2")
        await send_prompt(pilot, "Hello", max_tokens=2)
        rid = app.selected
        await wait_until(pilot, lambda: app.state.requests[rid].state == "finished")
        await pilot.pause(0.2)
        # Only the layer shown is captured (issue 29: the others run untraced, in C where the model can).
        assert sorted(app.state.xray) == [0] and {t.request_id for t in app.state.xray.values()} == {rid}
        await pilot.press("escape", "down", "down")  # two layers down
        assert app.query_one("#xray-view").layer_index == 2
        await pilot.pause(0.2)
        title = " ".join(str(app.query_one("#xray-title").render()).split())
        step = app.state.xray[0].step
        assert f"Layer 2 was not captured in step {step} (it captured layer 0)" in title
        # the selected request has finished: no next step of it will capture layer 2 (trial 9)
        assert f"Request {rid} is finished (no longer running), so no step of it will capture layer 2" in title
        # A layer/head chosen while a request runs reaches the engine: pause, send, choose, step.
        await pilot.press("space")
        await wait_until(pilot, lambda: app.controller.state == "paused", what="a pause")
        await send_prompt(pilot, "Hi", max_tokens=3)
        rid2 = app.selected
        await pilot.press("escape", "down", "right")  # layer 3, head 1
        await pilot.pause(0.2)
        await pilot.press("n")
        await wait_until(pilot, lambda: app.state.heat is not None and app.state.heat.request_id == rid2,
                         what="the step's heatmap")
        assert (app.state.heat.layer, app.state.heat.head) == (3, 1)
        assert sorted(app.state.xray) == [3]


async def test_the_command_palette_offers_the_same_actions(make_engine, tmp_path):
    app = engine_app(make_engine, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready)
        await pilot.press("ctrl+p")
        await pilot.press(*"Pause or resume")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.state.paused and app.controller.state == "paused", what="a pause")


async def test_tutorial_demo_runs_on_the_engine_and_its_commentary_appears(make_engine, tmp_path):
    app = engine_app(make_engine, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready)
        await pilot.press("escape", "4", "r")  # chapter 1: tokenization
        tutorial = app.query_one(TutorialView)
        await wait_until(pilot, lambda: tutorial.run is not None and tutorial.run.finished, what="the demo")
        kinds = {n.kind for n in tutorial.run.notes}
        assert kinds == {"tokenization"}
        assert "Token ids: [" in tutorial.run.notes[0].text


async def test_quiz_answers_are_graded_scored_and_kept_between_launches(tmp_path):
    app = replay_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("escape", "4")
        await wait_until(pilot, lambda: isinstance(app.focused, QuizChoices), what="the quiz to have the focus")
        tutorial = app.query_one(TutorialView)
        chapter = tutorial.chapter
        right = "ABCD"[chapter.quiz.answer]
        await pilot.press(right.lower())
        assert "Right" in str(app.query_one("#feedback", Static).render())
        assert (tutorial.progress.score, tutorial.progress.answered) == (1, 1)

        await pilot.press("right")  # next chapter; answer it wrongly with the arrows and Enter
        wrong = (tutorial.chapter.quiz.answer + 1) % 4
        await pilot.press("home", *["down"] * wrong, "enter")
        assert "Not quite" in str(app.query_one("#feedback", Static).render())
        assert (tutorial.progress.score, tutorial.progress.answered) == (1, 2)

    again = replay_app(tmp_path)  # a second launch reads the saved progress
    async with again.run_test(size=SIZE) as pilot:
        tutorial = again.query_one(TutorialView)
        assert (tutorial.progress.score, tutorial.progress.answered, tutorial.progress.current) == (1, 2, 1)


async def test_q_quits_and_stops_the_engine_thread(make_engine, tmp_path):
    app = engine_app(make_engine, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the model's ready event")
        await send_prompt(pilot, "Count to ten:", max_tokens=100)
        await wait_until(pilot, lambda: app.state.requests[app.selected].num_output >= 1, what="a first token")
        assert app.controller.is_alive
        await pilot.press("escape", "q")
    # quit waits up to a second for the step in progress; on a loaded machine a step can take
    # longer, and the thread then ends right after it (no timing is asserted here)
    deadline = time.monotonic() + 30
    while app.controller.is_alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not app.controller.is_alive and app.controller.state == "stopped" and app.return_code == 0


async def test_a_prompt_sent_while_the_model_loads_waits_and_then_runs(tiny_llama_dir, tmp_path, monkeypatch):
    from nanovllm_core.engine.controller import EngineController
    from nanovllm_core.engine.llm_engine import LLMEngine
    from nanovllm_tui.app import NanoVLLMApp
    from nanovllm_tui.starter import BackgroundController
    from nanovllm_tui.widgets.prompt_bar import PromptSettings

    loading = threading.Event()  # holds the model's loading until the prompt has been sent
    load = LLMEngine.from_config.__func__
    monkeypatch.setattr(LLMEngine, "from_config",
                        classmethod(lambda cls, *a, **kw: loading.wait(30) and load(cls, *a, **kw)))
    app = NanoVLLMApp(BackgroundController(lambda: EngineController(model=str(tiny_llama_dir), num_kv_blocks=32)),
                      settings=PromptSettings(max_tokens=3), tutorial_path=tmp_path / "t.json")
    notes = Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await send_prompt(pilot, "Hello there")  # the window is up, the model is not
        rid = app.selected
        assert app.state.requests[rid].state == "submitted" and app.state.phase == "loading"
        assert notes.find("waits in the queue until the model has loaded")
        assert "loading model" in str(app.query_one("#header").render())
        loading.set()
        await wait_until(pilot, lambda: app.state.requests[rid].state == "finished", what="the queued prompt")
        assert app.state.ready and app.state.requests[rid].num_output == 3


@pytest.mark.parametrize("cores", [2, 8])
async def test_the_ui_thread_keeps_its_priority_on_a_busy_host(make_engine, tmp_path, monkeypatch, cores):
    """At nice +10 the UI thread came after every other process of a busy host: tab switches took
    0.6-3.3 s while the engine generated (issue 29). It keeps the priority it started with."""
    import os

    calls = []
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "setpriority", lambda which, who, prio: calls.append((which, who, prio)))
    app = engine_app(make_engine, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready)
        await send_prompt(pilot, "Hello", max_tokens=2)
        await wait_until(pilot, lambda: app.state.requests and all(not r.live for r in app.state.requests.values()))
    assert calls == []


async def test_an_instruction_is_sent_as_chat_by_default_and_ctrl_t_sends_raw_text(make_engine, tmp_path):
    """Issue 29: "Write a poem about the sea." sent as raw text to the Instruct model ended after
    one token (end of text). A model with a chat template gets a user's message by default."""
    app = engine_app(make_engine, tmp_path, max_tokens=8, chat=None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the model's ready event")
        box = app.query_one("#chat")
        assert box.value and app.state.model_info["chat_template"]
        await send_prompt(pilot, "Write a poem about the sea.")
        chat = app.state.requests[app.selected]
        await wait_until(pilot, lambda: chat.state == "finished", what="the chat request")
        assert "<|im_start|>" in chat.prompt_pieces and chat.prompt == "Write a poem about the sea."
        assert chat.num_output == 8 and chat.text.strip()  # an answer, not an end of text at once
        await pilot.pause()
        shown = str(app.query_one("#output", Static).render())
        assert "You (chat)\nWrite a poem about the sea.\nAssistant\n" in shown, shown

        await pilot.press("ctrl+t")
        assert not box.value
        await send_prompt(pilot, "Write a poem about the sea.")
        raw = app.state.requests[app.selected]
        await wait_until(pilot, lambda: raw.state == "finished", what="the raw request")
        assert "<|im_start|>" not in raw.prompt_pieces and raw.prompt_len < chat.prompt_len


def test_chat_on_the_command_line_ticks_the_box_for_the_prompts_given_there():
    from nanovllm_tui.options import build_app

    app = build_app(["--chat", "--prompt", "Hi"])
    assert app.settings.chat is True
    app.controller.shutdown()


def test_raw_on_the_command_line_sends_the_prompts_as_nanovllm_does_and_its_help_says_chat_is_the_default(capsys):
    """Trial 29e: the app's --help said --chat "wraps each prompt in the model's chat template", as if off
    unless given, but the app already sends chat for a model with a template, and nothing on the command line
    sent --prompt raw as `nanovllm` does: the same --prompt and --max-tokens were a different request there."""
    from nanovllm_tui.options import build_app, build_parser

    app = build_app(["--raw", "--prompt", "Hi"])
    assert app.settings.chat is False
    app.controller.shutdown()
    assert build_app(["--prompt", "Hi"]).settings.chat is None  # the model decides: chat where it has a template
    usage = " ".join(build_parser().format_help().split())
    assert "the default already for a model with a chat template" in usage and "--raw" in usage
    with pytest.raises(SystemExit) as e:
        build_app(["--chat", "--raw"])
    assert e.value.code == 2 and "--chat and --raw ask for opposite things" in capsys.readouterr().err


async def test_xray_and_tutorial_tabs_teach_the_blocks_a_gguf_engine_runs(make_engine, tmp_path):
    """--quantization gguf: the X-Ray tab draws the engine's own Q4_1 block and the decode chapter counts its bytes."""
    from nanovllm_core.educational import xray_blocks

    app = engine_app(make_engine, tmp_path, quantization="gguf", num_kv_blocks=32)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready)
        await pilot.press("escape", "2")
        await send_prompt(pilot, "Hi", max_tokens=2)
        rid = app.selected
        await wait_until(pilot, lambda: app.state.requests[rid].state == "finished")
        await wait_until(pilot, lambda: 0 in app.state.xray, what="layer 0's trace")
        await pilot.pause(0.2)
        pipeline = str(app.query_one("#pipeline").content)
        qkv = app.controller.engine.model.layers[0].self_attn.qkv_proj
        sample = xray_blocks.sample_block(qkv)
        assert "Weights in Q4_1 blocks (qkv_proj of layer 0" in pipeline
        assert f"d = {sample.d:+.6g}, m = {sample.m:+.6g}" in pipeline
        assert f"= {qkv.weight_bytes:,} bytes" in pipeline
        assert xray_blocks.BLOCK_TENSOR not in pipeline  # drawn, not listed among the activations
        await pilot.press("escape", "4")
        tutorial = app.query_one(TutorialView)
        while tutorial.chapter.key != "decode":
            tutorial.action_chapter(1)
        await pilot.pause(0.2)
        text = str(app.query_one("#chapter-text").content)
        info = app.state.model_info
        from nanovllm_core.educational.commentary import human_bytes  # trial 10: sizes as the narrator writes them

        assert f"reads its {human_bytes(info['linear_weight_bytes'])} of q4_1+q8_0 block" in " ".join(text.split())
