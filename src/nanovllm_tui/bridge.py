"""The bridge: engine events (engine thread) -> the app (UI thread), at most once a frame.

The engine calls :meth:`EngineBridge.__call__` on its own thread for every event. That
call must be quick and must never touch a widget, so it only appends the event to a
buffer and, when the buffer was empty, posts one :class:`EngineBridge.EventsReady`
message with ``post_message`` (thread-safe, non-blocking). The app answers that message
by calling :meth:`drain` no more often than ``fps`` times a second, so a flood of tokens
becomes one screen update per frame.

High-rate snapshots are coalesced while they wait: only each step's newest ``BlocksChanged``
(the whole KV pool) is kept, so the narrator can tell every step's block tables (trial 25c), and
only the newest step's ``LayerTrace`` events; what is kept stays in arrival order (the narrator
reads a step's events in order). A Tutorial demonstration's bridge keeps every one
(``coalesce=False``): its notes tell each snapshot (trial 16a).

A step's results are handed over together: from its first result (a token, a finished request, the
pool after it) until its ``StepTimed``, a drain leaves them in the buffer. Otherwise a frame drawn
while the engine sent them showed some requests one token ahead of the others, beside the pool and
the Engine panel of the step before (trial 16: 10/10/9 where step 110 left 10/9/9 and step 111
11/10/10). Its ``StepPlanned`` (the step now running) and X-Ray layers go at once. Any other kind of
event (a pause, a new request, an error, the next plan) also ends the hold, and so does
``drain(flush=True)`` (a recording's end, or a step that stopped without its ``StepTimed``).

Every event leaves :meth:`EngineBridge.drain` with its text made safe to draw (:func:`visible_event`):
prompts, outputs, token pieces, stop strings and error messages come from clients and the model,
and a raw escape code in them would act on the terminal. So every tab, toast and the narrator
show control characters as pictures (``␛``) without each having to remember.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from typing import Any

from textual.message import Message
from textual.message_pump import MessagePump

from nanovllm_core import events as ev
from nanovllm_tui.widgets.format import visible_text

# Screen updates a second from engine events: smooth to read, cheap beside a busy engine. On a
# machine of two cores or fewer every frame the UI thread draws is taken from the engine's
# compute threads (and Python's lock), so it draws half as often there: measured on 2 cores
# while watching the Dashboard, the UI thread's share of a core went from 12-13% at 10 frames
# a second to 8-10% at 5 (benchmarks/benchmark_tui.py).
DEFAULT_FPS = 10.0 if (os.cpu_count() or 1) > 2 else 5.0


class EngineBridge:
    """Buffers engine events for the UI thread.

    Args:
        target: what receives ``EventsReady`` (the app).
        fps: the most drains per second the app should do (frames per second).
        coalesce: keep only each step's newest ``BlocksChanged`` and the newest step's ``LayerTrace``
            events of a frame (the app's views draw the newest state); False keeps every event
            (a demonstration narrates every step from its own snapshot: a few short requests).
    """

    class EventsReady(Message):
        """Events are waiting in the bridge; call ``drain`` (posted at most once per drain)."""

    def __init__(self, target: MessagePump, fps: float = DEFAULT_FPS, coalesce: bool = True) -> None:
        self.target = target
        self.coalesce = coalesce
        self.frame_s = 1.0 / fps
        self._lock = threading.Lock()
        self._events: list[ev.Event | None] = []  # None: a snapshot superseded by a newer one
        self._blocks_at: int | None = None
        self._xray_at: list[int] = []
        self._posted = False
        self._last_drain = 0.0
        self._last_arrival = 0.0  # time.monotonic() of the newest event
        self._open_step: int | None = None  # the newest planned step, until its StepTimed
        self._held_from: int | None = None  # index in _events of the open step's first result
        self.received = 0  # events seen, superseded snapshots included
        self.subscription: Any = None

    # ------------------------------------------------------------------ engine thread

    def __call__(self, event: ev.Event) -> None:
        """Take one event (engine thread). Never blocks on the UI."""
        with self._lock:
            self.received += 1
            events = self._events
            if not self.coalesce:
                pass
            elif isinstance(event, ev.BlocksChanged):
                # a snapshot supersedes only one of the same step (an abort's after the step's end): each
                # step keeps its own, for the narrator's KV entry of that step (trial 25c: steps whose
                # snapshot a later step's had replaced were told without their stored bytes and tables)
                if self._blocks_at is not None and events[self._blocks_at].step == event.step:
                    events[self._blocks_at] = None
                self._blocks_at = len(events)
            elif isinstance(event, ev.LayerTrace):
                if self._xray_at:
                    first = events[self._xray_at[0]]
                    if (first.step, first.request_id) != (event.step, event.request_id):
                        for i in self._xray_at:
                            events[i] = None
                        self._xray_at = []
                self._xray_at.append(len(events))
            self._hold_or_release(event)
            events.append(event)
            self._last_arrival = time.monotonic()
            post = not self._posted
            self._posted = True
        if post:
            try:
                self.target.post_message(self.EventsReady())
            except RuntimeError:  # the app's event loop has closed (the app quit inside a step): nobody is left to draw
                pass

    def _hold_or_release(self, event: ev.Event) -> None:
        """Whether ``event`` (not yet appended, lock held) begins, continues or ends the hold on the open step's results."""
        if isinstance(event, RESULTS) and event.step is not None and event.step == self._open_step:
            if self._held_from is None:
                self._held_from = len(self._events)
        elif isinstance(event, ev.LayerTrace) and event.step == self._open_step:
            pass  # a layer of the open step: held only behind a result already held
        else:  # StepTimed ends the step; anything else is no part of its results
            self._held_from = None
            # (an empty plan runs nothing: no StepTimed follows it, and an abort's results must not wait for one)
            self._open_step = event.step if isinstance(event, ev.StepPlanned) and event.scheduled else None

    # ------------------------------------------------------------------ UI thread

    def connect(self, controller: Any, topk: int = 5, xray: bool = False, blocks: bool = False) -> None:
        """Subscribe to ``controller`` at the given level of detail (change it later with :meth:`want`)."""
        self.subscription = controller.subscribe(self, topk=topk, xray=xray, blocks=blocks)

    def want(self, *, xray: bool | None = None, blocks: bool | None = None) -> None:
        """Ask the engine for more or less detail (e.g. X-Ray only while its tab is visible)."""
        sub = self.subscription
        if sub is None:
            return
        if xray is not None:
            sub.xray = xray
        if blocks is not None:
            sub.blocks = blocks

    def delay(self) -> float:
        """Seconds to wait before the next drain keeps to the frame rate (0: drain now)."""
        return max(0.0, self._last_drain + self.frame_s - time.monotonic())

    def pending(self) -> bool:
        """Events wait in the bridge (held ones included): the app has not drawn them."""
        with self._lock:
            return bool(self._events)

    def stale(self, seconds: float) -> bool:
        """An open step's results are held and no event came for ``seconds``: its ``StepTimed`` is not
        coming (the engine stopped inside the step), so they should be drawn (``drain(flush=True)``)."""
        with self._lock:
            return self._held_from is not None and time.monotonic() - self._last_arrival >= seconds

    def drain(self, flush: bool = False) -> list[ev.Event]:
        """Everything buffered since the last drain, in arrival order, superseded snapshots left out,
        except the results of a step still open (see the module's docstring); ``flush``: those too."""
        with self._lock:
            events, cut = self._events, self._held_from
            if flush or cut is None:
                self._events, self._blocks_at, self._xray_at = [], None, []
                self._held_from = None
                if flush:
                    self._open_step = None
            else:
                events, self._events = events[:cut], events[cut:]
                self._blocks_at = None if self._blocks_at is None or self._blocks_at < cut else self._blocks_at - cut
                self._xray_at = [i - cut for i in self._xray_at if i >= cut]
                self._held_from = 0
            self._posted = False
        self._last_drain = time.monotonic()
        return [visible_event(e) for e in events if e is not None]


# A step's results: held together until its StepTimed (see the module's docstring)
RESULTS = (ev.TokenSampled, ev.SpecDecodeStep, ev.RequestFinished, ev.BlocksChanged)

_FIELDS: dict[type, tuple[str, ...]] = {}
_NUMBER = r"(int|float|bool)"
_NUMERIC = re.compile(rf"({_NUMBER}|tuple\[{_NUMBER}, \.\.\.\]|tuple\[tuple\[{_NUMBER}, \.\.\.\], \.\.\.\])( \| None)?")


def visible_event(event: Any) -> Any:
    """``event`` (a frozen dataclass, nested ones included) with every string made visible by
    :func:`~nanovllm_tui.widgets.format.visible_text`; the same object when none needed it
    (the common case: nothing is copied). Tuples of numbers are passed by unread."""
    names = _FIELDS.get(type(event))
    if names is None:  # fields declared as numbers only (most of StepTimed, attention weights) are never read
        names = _FIELDS[type(event)] = tuple(f.name for f in dataclasses.fields(event)
                                             if not _NUMERIC.fullmatch(str(f.type)))
    changes = {}
    for name in names:
        value = getattr(event, name)
        shown = _visible(value)
        if shown is not value:
            changes[name] = shown
    return dataclasses.replace(event, **changes) if changes else event


def _visible(value: Any) -> Any:
    if isinstance(value, str):
        return visible_text(value)
    if isinstance(value, (tuple, list)):
        if not value or not isinstance(value[0], (str, tuple, list)) and not dataclasses.is_dataclass(value[0]):
            return value  # numbers (token ids, samples, timings): homogeneous, nothing to show
        shown = [_visible(v) for v in value]
        if all(a is b for a, b in zip(shown, value)):
            return value
        return type(value)(shown)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return visible_event(value)
    return value
