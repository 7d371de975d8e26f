"""Shared by the TUI tests: building the app on a real engine or a replay, waiting, and reading notifications."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from textual.notifications import Notify

from nanovllm_core.engine.controller import EngineController
from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.replay import ReplayController, load_trace
from nanovllm_tui.widgets.prompt_bar import PromptSettings

TRACE = Path(__file__).parent / "data" / "tui_trace.jsonl.gz"
XRAY_TRACE = Path(__file__).parent / "data" / "xray_trace.jsonl.gz"


def engine_app(make_engine, tmp_path: Path, start_paused: bool = False, max_tokens: int = 4,
               chat: bool | None = False, **engine_settings) -> NanoVLLMApp:
    """The app on a real engine (the session's shared model, a small KV pool, short generations).

    ``chat``: the prompt bar's chat setting; raw text unless a test asks (the app's own default,
    None, sends chat to a model with a chat template)."""
    engine_settings.setdefault("num_kv_blocks", 64)
    controller = EngineController.from_engine(make_engine(**engine_settings), start_paused=start_paused)
    return NanoVLLMApp(controller, settings=PromptSettings(max_tokens=max_tokens, chat=chat),
                       tutorial_path=tmp_path / "tutorial.json")


def tiny_app(tiny_llama_dir: Path, tmp_path: Path, start_paused: bool = False, max_tokens: int = 3,
             **kwargs) -> NanoVLLMApp:
    """The app on a live engine over the tiny random LLaMA (``tiny_llama_dir``), loaded behind the
    window as ``nanovllm-tui`` does: for what needs a prompt bar that takes prompts (a replay takes
    none) but not the real model's answers. Raw text prompts, ``max_tokens`` each."""
    from nanovllm_tui.starter import BackgroundController

    controller = BackgroundController(lambda: EngineController(model=str(tiny_llama_dir), num_kv_blocks=32,
                                                               start_paused=start_paused),
                                       start_paused=start_paused)  # as nanovllm-tui --paused builds it
    return NanoVLLMApp(controller, settings=PromptSettings(max_tokens=max_tokens, chat=False),
                       tutorial_path=tmp_path / "tutorial.json", **kwargs)


def replay_app(tmp_path: Path, start_paused: bool = True, trace: Path = TRACE, **kwargs) -> NanoVLLMApp:
    """The app replaying ``tests/data/tui_trace.jsonl.gz`` (or ``trace``; no model needed)."""
    return NanoVLLMApp(ReplayController(load_trace(trace), start_paused=start_paused),
                       tutorial_path=tmp_path / "tutorial.json", **kwargs)


class Notes:
    """A ``run_test(message_hook=...)`` hook keeping the notifications the app showed."""

    def __init__(self):
        self.items = []

    def __call__(self, message):
        if isinstance(message, Notify):
            self.items.append(message.notification)

    def find(self, text: str, severity: str | None = None):
        return [n for n in self.items if text in n.message and (severity is None or n.severity == severity)]


async def wait_until(pilot, condition, timeout: float = 60.0, what: str = "condition") -> None:
    """Let the app run until ``condition()`` holds (the engine works on its own thread meanwhile)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")
        await pilot.pause(0.05)


async def send_prompt(pilot, prompt: str, max_tokens: int | None = None, priority: int | None = None) -> None:
    """Type into the prompt bar's fields and press Enter, as a person would."""
    app = pilot.app
    if max_tokens is not None:
        app.query_one("#max-tokens").value = str(max_tokens)
    if priority is not None:
        app.query_one("#priority").value = str(priority)
    app.query_one("#prompt").focus()
    app.query_one("#prompt").value = prompt
    await pilot.press("enter")


def keys_at_once(app, *keys: str) -> None:
    """Deliver ``keys`` (characters or key names, as ``Pilot.press`` takes them) the way a terminal
    does under load: all queued before the first is handled (``Pilot.press`` waits for each key
    in turn, which hides faults of order)."""
    import unicodedata

    from textual import events
    from textual.keys import REPLACED_KEYS, _character_to_key, _get_unicode_name_from_key

    for key in keys:
        if len(key) == 1 and not key.isalnum():
            key = _character_to_key(key)
        try:  # the character a terminal sends with the key, as Pilot works it out
            char = unicodedata.lookup(_get_unicode_name_from_key(REPLACED_KEYS.get(key, key)))
        except KeyError:
            char = key if len(key) == 1 else None
        event = events.Key(key, char)
        event.set_sender(app)
        app._driver.send_message(event)


def visible_tab(app) -> str:
    from textual.widgets import TabbedContent

    return app.query_one(TabbedContent).active


@contextlib.asynccontextmanager
async def attached_and_paused(server, tmp_path: Path, size: tuple[int, int] = (120, 36), **app_kwargs):
    """The app attached to ``server`` (``--connect``), ready, with the server paused from the app (Esc, space):
    yields ``(app, pilot, notes)``, the app's toasts collected in ``notes``. ``app_kwargs`` go to
    ``NanoVLLMApp`` (e.g. ``recorders=[writer], record_xray=True`` as ``--trace F --trace-xray``)."""
    from nanovllm_tui.remote import RemoteController

    app = NanoVLLMApp(RemoteController(server.url, server.api_key), tutorial_path=tmp_path / "t.json", **app_kwargs)
    notes = Notes()
    async with app.run_test(size=size, message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready and app.controller.connected, 30, "the attached server")
        await pilot.press("escape", "space")
        await wait_until(pilot, lambda: server.controller.state == "paused", 10, "the server to pause")
        yield app, pilot, notes
