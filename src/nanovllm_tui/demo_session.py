"""A tutorial demonstration on its own small engine, under the settings its chapter describes.

The app's engine keeps its own settings (512 KV blocks, a 512-token budget) and its own
requests; a chapter about a third request waiting for a place, or about chunks and
preemption, cannot happen there. So each demonstration builds a fresh engine over the
loaded model's weights and tokenizer (no second copy of the model) with the chapter's
settings (``Demo.engine``: e.g. ``max_num_seqs=2``; a 12-block pool and a 32-token budget),
exactly as the terminal tutorial does (``EngineDemos.engine``), and runs it on its own
``EngineController`` thread. Its events come back through an ``EngineBridge`` to the
Tutorial tab, which feeds its own narrator: every note of the demonstration is kept,
including those of a step that ends its last request, before it is called finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from textual.message_pump import MessagePump

from nanovllm_core import events as ev
from nanovllm_core.educational import tutorial as tut
from nanovllm_core.educational.narrator import Commentary, Narrator
from nanovllm_core.educational.xray_facts import roofline_commentary
from nanovllm_tui.bridge import EngineBridge


@dataclass
class DemoRun:
    """What a demonstration has sent and shown: request ids, those that ended, the narrator's notes,
    and the newest plan of its engine (who runs, who waits)."""

    demo: tut.Demo
    chapter: tut.Chapter
    queue: list[tut.DemoRequest]
    settings: str = ""
    request_ids: list[str] = field(default_factory=list)
    ended: set[str] = field(default_factory=set)
    notes: list[Commentary] = field(default_factory=list)
    plan: ev.StepPlanned | None = None
    preemptions: int = 0
    finished: bool = False
    error: str | None = None

    @property
    def done(self) -> bool:
        """Every request has been sent."""
        return not self.queue


def settings_text(info: dict[str, Any]) -> str:
    """The demo engine's settings that shape scheduling, from its ``model_info()`` (the CLI's words too:
    :func:`~nanovllm_core.educational.tutorial.engine_settings_text`)."""
    return tut.engine_settings_text(info)


class DemoSession:
    """One demonstration: builds its engine, sends its requests, turns its events into notes.

    Args:
        target: the widget that receives the bridge's ``EventsReady`` messages (the Tutorial tab),
            which calls :meth:`take` with the drained events.
        main_engine: the app's loaded ``LLMEngine`` (its model, tokenizer, device and dtype are shared).
        demo, chapter: what to run (``chapter.demo_prompt`` first, then the demo's extra prompts).
        fps: the bridge's frame rate.

    Raises:
        ValueError: the demo's settings are invalid for this model (from ``EngineConfig``).
    """

    def __init__(self, target: MessagePump, main_engine: Any, demo: tut.Demo, chapter: tut.Chapter,
                 fps: float) -> None:
        from nanovllm_core.educational.tutorial_demos import EngineDemos
        from nanovllm_core.engine.controller import EngineController

        demos = EngineDemos.from_loaded(main_engine.model, main_engine.tokenizer, main_engine.resolved,
                                        device=str(main_engine.device),
                                        dtype=str(main_engine.dtype).replace("torch.", ""))
        self.engine = demos.engine(**demo.engine_settings())
        info = self.engine.model_info()
        spec = self.engine.speculator
        settings = tut.engine_settings_text(info, spec.name if spec is not None else "", spec.k if spec else 0)
        self.run = DemoRun(demo, chapter, demo.requests(chapter.demo_prompt), settings=settings)
        self.narrator = Narrator(info, max_decode_steps_per_request=None, kv_every_step=demo.kv_every_step)
        self._traced: set[str] = set()
        self._ids = iter(range(1, 1 << 30))
        self.controller = EngineController.from_engine(self.engine)
        # every step's own block snapshot and traces: the notes tell each step (chapter 5's per-step tables)
        self.bridge = EngineBridge(target, fps=fps, coalesce=False)
        self.bridge.connect(self.controller, topk=5, xray=demo.xray, blocks=True)
        if demo.xray:
            self.controller.xray(None, 0, 0)  # layer 0 of whichever request runs first

    def start(self) -> None:
        """Send the first request (all of them unless the demonstration is sequential)."""
        self._send_next()
        while not self.run.demo.sequential and not self.run.done:
            self._send_next()

    def _send_next(self) -> None:
        request = self.run.queue.pop(0)
        rid = self.controller.submit(request.prompt, request.params, request.priority,
                                     request_id=f"demo-{next(self._ids)}")
        self.run.request_ids.append(rid)

    def take(self, events: list[ev.Event]) -> None:
        """Fold the engine's events in: notes of the demo's kinds, ended requests, the next request."""
        run = self.run
        kinds = run.demo.kinds
        for event in events:
            for note in self.narrator.feed(event):
                self._keep(note)
            if isinstance(event, ev.StepPlanned) and event.scheduled:
                run.plan = event
                run.preemptions += len(event.preempted)
            elif isinstance(event, ev.LayerTrace) and "roofline" in kinds and event.layer == 0 \
                    and event.request_id not in self._traced:
                self._traced.add(event.request_id)
                self._keep(roofline_commentary(event))
            elif isinstance(event, ev.EngineError) and event.step is None and event.request_id is None:
                run.error = event.message
            if isinstance(event, (ev.RequestFinished, ev.RequestRejected)) and event.request_id in run.request_ids:
                run.ended.add(event.request_id)
                if not run.done:
                    self._send_next()
            # The step that ends the last request is narrated at its StepTimed: finished after it
            # (a refusal happens outside any step).
            last = run.done and run.ended >= set(run.request_ids)
            if last and not run.finished and isinstance(event, (ev.StepTimed, ev.RequestRejected)):
                for note in self.narrator.flush():
                    self._keep(note)
                run.finished = True
        if run.finished:
            self.stop(wait=False)

    def _keep(self, note: Commentary) -> None:
        run = self.run
        if note.kind in run.demo.kinds and (note.request_id is None or note.request_id in run.request_ids):
            run.notes.append(note)

    def stop(self, wait: bool = True) -> None:
        """Stop the demonstration's engine thread (``wait``: join it, up to a second)."""
        self.bridge.want(xray=False, blocks=False)
        self.controller.shutdown(timeout=1.0 if wait else 0.0)
