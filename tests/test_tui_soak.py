"""The soak test (issue 15): random keys and terminal sizes, and the app's promises checked after every key.

Pilot drives the app on a tiny random LLaMA engine and on the recorded replay with keys drawn
from the app's bindings, digits, letters, Esc, Enter, Tab and the arrows, sends prompts along
the way and resizes the terminal between 60x20 and 250x60. After every key: the app is still
running, the visible tab is the one the last tab key chose, and the header's engine state is the
controller's. At the end every prompt sent has finished or was rejected (none lost) and no KV
block is held.

It is seeded: a failure names the seed and the key, and ``NANOVLLM_SOAK_SEED=<seed>`` replays
it. CI runs ``NANOVLLM_SOAK_KEYS`` keys a run (default 120, under a minute of CPU for both runs on an
idle 2-core machine); set it to a few thousand for a long soak.
"""

from __future__ import annotations

import os
import random
import string
import time

import pytest

from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.commands import ACTIONS, TABS
from nanovllm_tui.widgets.prompt_bar import PromptBar, PromptSettings
from tests.tui_helpers import replay_app, visible_tab

pytestmark = pytest.mark.anyio
NUM_KEYS = int(os.environ.get("NANOVLLM_SOAK_KEYS", "120"))
SEED = int(os.environ.get("NANOVLLM_SOAK_SEED", "1515"))
TAB_KEYS = {str(i): tab for i, (tab, _) in enumerate(TABS, 1)}
# q quits (the run would end) and ctrl+p opens the palette, a screen of its own: both left out
BINDING_KEYS = [a.key for a in ACTIONS if a.key != "q"]
OTHER_KEYS = ["escape", "enter", "tab", "shift+tab", "up", "down", "left", "right"]
WORDS = ("the", "brave", "knight", "rode", "to", "a", "castle", "and", "sang", "of", "dragons", "42")


def draw_key(rng: random.Random, typing: bool) -> str:
    pool = rng.random()
    if pool < 0.35:
        key = rng.choice(BINDING_KEYS)
    elif pool < 0.55:
        key = rng.choice(string.digits)
    elif pool < 0.8:
        key = rng.choice(string.ascii_lowercase)
    else:
        key = rng.choice(OTHER_KEYS)
    return "x" if key == "q" and not typing else key


def in_bar(app) -> bool:
    """The focus is in the prompt bar (a field or its chat box): a key typed there is never an app key."""
    return app.focused is not None and any(isinstance(node, PromptBar) for node in app.focused.ancestors)


def header_state(app) -> str:
    text = str(app.query_one("#header").render())
    return text.split("● ", 1)[1].split(" ", 1)[0] if "● " in text else ""


async def soak(pilot, seed: int, num_keys: int) -> set[str]:
    """Press ``num_keys`` random keys, checking the app's promises after each; returns the request ids it sent."""
    app: NanoVLLMApp = pilot.app
    rng = random.Random(seed)
    tab = visible_tab(app)
    sent: set[str] = set()
    submit = app.submit_request

    def submit_and_note(*args, **kwargs) -> str:
        rid = submit(*args, **kwargs)
        sent.add(rid)
        return rid

    app.submit_request = submit_and_note
    for i in range(num_keys):
        where = f"seed {seed}, key #{i}"
        if rng.random() < 0.03:
            size = (rng.randint(60, 250), rng.randint(20, 60))
            await pilot.resize_terminal(*size)
            where += f" after a resize to {size[0]}x{size[1]}"
        typing = in_bar(app)
        if rng.random() < 0.03:  # send a prompt: / (typed, if already in the bar), some words, Enter
            keys = ["slash", *" ".join(rng.choices(WORDS, k=rng.randint(1, 6))), "enter"]
        else:
            keys = [draw_key(rng, typing)]
        for key in keys:
            typing = in_bar(app)
            await pilot.press(key)
            if key in TAB_KEYS and not typing:
                tab = TAB_KEYS[key]
        where += f" ({keys[-1]!r})"
        assert app.is_running, f"{where}: the app stopped"
        assert visible_tab(app) == tab, f"{where}: tab {visible_tab(app)}, but the last tab key chose {tab}"
        deadline = time.monotonic() + 5
        while header_state(app) != app.controller.state and time.monotonic() < deadline:
            await pilot.pause(0.05)
        assert header_state(app) == app.controller.state, \
            f"{where}: the header says {header_state(app)!r}, the controller {app.controller.state!r}"
    return sent


async def all_end(pilot, seed: int, sent: set[str]) -> None:
    """Run the engine to the end; every prompt sent must have ended, none lost."""
    app = pilot.app
    await pilot.press("escape")
    if app.state.paused:
        await pilot.press("space")
    deadline = time.monotonic() + 120
    while any(app.state.requests[rid].live for rid in sent if rid in app.state.requests):
        assert time.monotonic() < deadline, f"seed {seed}: requests still running after 120 s"
        await pilot.pause(0.1)
    for rid in sent:
        req = app.state.requests[rid]
        assert req.state in ("finished", "rejected"), f"seed {seed}: {rid} ended {req.state}"


@pytest.mark.real_model  # the tiny model borrows the real model's tokenizer
async def test_soak_on_a_tiny_engine(tiny_llama_dir, tmp_path):
    from nanovllm_core.engine.controller import EngineController

    controller = EngineController(model=str(tiny_llama_dir), num_kv_blocks=64)
    app = NanoVLLMApp(controller, settings=PromptSettings(max_tokens=8, chat=False), tutorial_path=tmp_path / "t.json")
    async with app.run_test(size=(120, 40)) as pilot:
        deadline = time.monotonic() + 60
        while not app.state.ready:
            assert time.monotonic() < deadline, "the tiny model did not load"
            await pilot.pause(0.1)
        sent = await soak(pilot, SEED, NUM_KEYS)
        await all_end(pilot, SEED, sent)
        assert sent, f"seed {SEED}: no prompt was sent; choose more keys"
        for rid in sent:
            if app.state.requests[rid].state == "finished":
                assert controller.results[rid].finished
        assert controller.engine.block_manager.num_used_blocks == 0, f"seed {SEED}: KV blocks held after the end"


async def test_soak_on_the_recorded_replay(tmp_path):
    app = replay_app(tmp_path, start_paused=False)
    async with app.run_test(size=(120, 40)) as pilot:
        sent = await soak(pilot, SEED + 1, NUM_KEYS)
        await all_end(pilot, SEED + 1, sent)
        assert not sent  # a replay takes no prompts: its bar is disabled, so no key sends one
