"""The Tutorial tab's demonstrations, driven with keys: each runs under its chapter's settings on an
engine of its own and shows its commentary, whatever the length of its requests.

A tiny random LLaMA (with the real tokenizer) stands in for the model: what these chapters show
(who waits, chunks, preemption, which notes appear) is the scheduler's and the narrator's doing.
"""

from __future__ import annotations

import pytest

from nanovllm_core.config import EngineConfig
from nanovllm_core.educational.tutorial import CHAPTERS, TutorialProgress
from nanovllm_core.engine.controller import EngineController
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.views.tutorial import TutorialView
from nanovllm_tui.widgets.prompt_bar import PromptSettings
from tests.tui_helpers import Notes, wait_until

pytestmark = pytest.mark.anyio
SIZE = (120, 40)


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    import torch

    from nanovllm_core.model.loader import load_model

    return load_model(str(tiny_llama_dir), torch.device("cpu"), torch.float32)


def app_at_chapter(tiny_model, tmp_path, number: int) -> NanoVLLMApp:
    """The app on the tiny model's engine (the app's usual 512 blocks, budget 512), opened at a chapter."""
    path = tmp_path / "tutorial.json"
    TutorialProgress(current=number - 1).save(path)
    engine = LLMEngine(EngineConfig(num_kv_blocks=512), *tiny_model)
    return NanoVLLMApp(EngineController.from_engine(engine), settings=PromptSettings(max_tokens=4), tutorial_path=path)


async def run_demo(pilot, app) -> TutorialView:
    await wait_until(pilot, lambda: app.state.ready, what="the ready event")
    await pilot.press("escape", "4", "r")
    tutorial = app.query_one(TutorialView)
    await wait_until(pilot, lambda: tutorial.run is not None and tutorial.run.finished, what="the demonstration")
    await pilot.pause(0.1)
    return tutorial


def shown(tutorial: TutorialView) -> str:
    return str(tutorial.query_one("#demo-log").render())


async def test_chapter_9_demo_shows_the_third_request_waiting_for_a_place(tiny_model, tmp_path):
    app = app_at_chapter(tiny_model, tmp_path, 9)
    async with app.run_test(size=SIZE) as pilot:
        tutorial = await run_demo(pilot, app)
        run = tutorial.run
        assert run.settings.startswith("64 KV blocks") and "at most 2 running" in run.settings
        waits = [n for n in run.notes if n.kind == "scheduler" and "Waiting: request demo-3 (max_num_seqs" in n.text]
        assert waits, [n.text for n in run.notes]
        joins = [n for n in run.notes if n.kind == "scheduler" and "request demo-3: prefill" in n.text]
        assert joins and run.notes.index(joins[0]) > run.notes.index(waits[-1])  # it joins once a place is free
        text = shown(tutorial)
        assert "at most 2 running" in text and "Waiting: request demo-3 (max_num_seqs" in " ".join(text.split())
        # the app's own engine kept its settings and saw none of it
        assert app.controller.engine.scheduler.max_num_seqs != 2 and not app.state.requests


async def test_chapter_11_demo_chunks_the_long_prompt_and_preempts(tiny_model, tmp_path):
    app = app_at_chapter(tiny_model, tmp_path, 11)
    async with app.run_test(size=SIZE) as pilot:
        tutorial = await run_demo(pilot, app)
        run = tutorial.run
        kinds = {n.kind for n in run.notes}
        assert {"chunked_prefill", "preemption"} <= kinds, kinds
        assert run.preemptions >= 1
        assert "12 KV blocks of 8 tokens, budget 32 tokens a step" in run.settings
        text = " ".join(shown(tutorial).split())
        assert "preempted" in text and "preemptions so far" in text


@pytest.mark.parametrize("number,kinds", [(2, {"embedding"}), (3, {"embedding", "attention"}),
                                          (4, {"prefill", "roofline"})])
async def test_one_token_demos_still_show_their_commentary(tiny_model, tmp_path, number, kinds):
    app = app_at_chapter(tiny_model, tmp_path, number)
    async with app.run_test(size=SIZE) as pilot:
        tutorial = await run_demo(pilot, app)
        run = tutorial.run
        assert all(r.params.max_tokens == 1 for r in run.demo.requests("x"))
        assert kinds <= {n.kind for n in run.notes}
        text = shown(tutorial)
        assert "· finished" in text
        for note in run.notes:
            assert note.title in text


async def test_chapter_12_has_a_speculative_demonstration(tiny_model, tmp_path):
    app = app_at_chapter(tiny_model, tmp_path, 12)
    assert CHAPTERS[11].demo == "speculative_decoding"
    async with app.run_test(size=SIZE) as pilot:
        tutorial = await run_demo(pilot, app)
        assert "ngram drafts of up to 4 tokens" in tutorial.run.settings
        assert {n.kind for n in tutorial.run.notes} >= {"finished"}


def test_the_demo_step_line_names_a_verification_as_such():
    from types import SimpleNamespace

    from nanovllm_core import events as ev

    def entry(kind, num):
        return ev.ScheduledEntry(request_id=f"demo-{num}", seq_id=num, index=0, kind=kind, num_tokens=num, start=9,
                                 prompt_len=9, total_len=10, num_cached_tokens=0, samples=True, priority=0)

    plan = ev.StepPlanned(step=3, token_budget=32, num_batched_tokens=10, scheduled=(entry("decode", 5),
                          entry("decode", 1), entry("prefill", 4)), preempted=(), admitted=(), waiting=(), running=(),
                          max_num_seqs=4)
    line = str(TutorialView._now(SimpleNamespace(plan=plan, preemptions=0)))
    assert "ran demo-5 verify 1 + 4, demo-1 decode, demo-4 prefill 4" in line


async def test_a_replay_runs_no_demonstration(tmp_path):
    """A replay does not offer r (tests/test_tui_newcomer.py checks the footer); pressing it anyway
    starts nothing and raises nothing."""
    from nanovllm_tui.views.tutorial import TutorialView
    from tests.tui_helpers import replay_app

    app, notes = replay_app(tmp_path), Notes()
    async with app.run_test(size=SIZE, message_hook=notes) as pilot:
        await pilot.press("escape", "4", "r")
        await pilot.pause(0.3)
        view = app.query_one(TutorialView)
        assert view.session is None and not view.measuring
        assert not notes.find("", "error")
        # Trial 7: the hidden key said nothing, and the only words on screen were the prompt bar's
        # "takes no prompts". Each refused key now names what it refused.
        assert notes.find("No demonstration in a replay", "warning")
        await pilot.press("1", "a", "ctrl+t")  # (on the Tutorial tab, a answers the quiz)
        await pilot.pause(0.3)
        assert notes.find("No abort in a replay", "warning") and notes.find("No chat/raw switch in a replay", "warning")
        assert not [n for n in notes.items if "takes no prompts" in n.message]


async def test_chapter_13_measures_all_reduces_and_says_when_the_split_engine_is_missing(tiny_model, tmp_path,
                                                                                         monkeypatch):
    from nanovllm_core.educational import tp_measure
    from nanovllm_core.educational.tp_facts import split_engine_available

    asked = []

    def fake(world_size, hidden, iters, warmup):  # the real one is tested in test_tp_teaching.py
        asked.append((world_size, hidden))
        return tp_measure.AllReduceLatency(p50_us=250.0, p99_us=900.0, world_size=world_size, iters=iters,
                                           hidden=hidden, nbytes=hidden * 4, backend="gloo", machine="a test CPU")

    monkeypatch.setattr(tp_measure, "measure_allreduce", fake)
    app = app_at_chapter(tiny_model, tmp_path, 13)
    assert CHAPTERS[12].demo == "tensor_parallel"
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the ready event")
        await pilot.press("escape", "4", "r")
        tutorial = app.query_one(TutorialView)
        await wait_until(pilot, lambda: not tutorial.measuring and tutorial.measured is not None, what="the measurement")
        await pilot.pause(0.1)
        info = app.state.model_info
        layers = 2 * info["num_layers"] + 1
        assert asked == [(3, info["hidden_size"])]  # the loaded model's width, three ranks
        text = " ".join(shown(tutorial).split())
        assert "Measured now on a test CPU" in text
        assert f"runs {layers} of them one after another: {layers} x 250 µs = {layers * 0.25:,.1f} ms" in text
        # the heading's "beside a one-process decode step measured now" (trial 16a #3: the app showed none)
        assert "One process decoded the chapter's demo prompt ('The capital of France is') at" in text
        assert "measured just now" in text
        if not split_engine_available():
            assert "The split engine (tensor_parallel_size) is not available in this build" in text
        else:  # the split run is the CLI's: the app points there and starts no processes
            assert "The split run itself: `nanovllm --tutorial --tutorial-chapter 13` in a terminal" in text
        assert tutorial.run is None  # no engine was started for it


class _Silent:
    """A bridge target that never drains by itself: the test drains once, as a busy app's one frame would."""

    def post_message(self, message) -> bool:
        return True


def test_every_kv_cache_step_of_chapter_5_shows_stored_bytes_and_block_tables_even_in_one_frame(tiny_model):
    """Chapter 5 promises, after each step, the bytes reserved, the bytes stored and the blocks behind them.
    The app's bridge kept only the newest block snapshot of a frame, so the steps that shared a frame with a
    later one lost theirs and told only the reserved line (trial 16a bug 2): a demonstration keeps every one."""
    from nanovllm_core import events as ev
    from nanovllm_core.educational import tutorial as tut
    from nanovllm_tui.demo_session import DemoSession
    from tests.conftest import poll_until

    chapter = next(c for c in CHAPTERS if c.demo == "kv_cache")
    demo = tut.DEMOS["kv_cache"]
    main = LLMEngine(EngineConfig(num_kv_blocks=64), *tiny_model)
    session = DemoSession(_Silent(), main, demo, chapter, fps=5)
    timed: list[int] = []
    session.controller.subscribe(lambda e: timed.append(e.step) if isinstance(e, ev.StepTimed) else None,
                                 topk=0, blocks=False)
    try:
        session.start()
        assert poll_until(lambda: len(timed) >= demo.max_tokens, timeout=60)
        session.take(session.bridge.drain())  # every step in one frame
    finally:
        session.stop()
    kv = [n for n in session.run.notes if n.kind == "kv_cache"]
    live = [n for n in kv if n.title != "KV cache: empty"]
    assert len(kv) == demo.max_tokens and len(live) == demo.max_tokens - 1, [n.title for n in kv]
    for n in live:  # the promise, kept in every step
        assert "reserved" in n.title and "stored" in n.title, n.title
        assert "Their tokens store" in n.text and "Block tables:" in n.text, n.text
