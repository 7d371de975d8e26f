"""The bridge: engine events (engine thread) -> the app (UI thread), at most once a frame.

The engine calls :meth:`EngineBridge.__call__` on its own thread for every event. That
call must be quick and must never touch a widget, so it only appends the event to a
buffer and, when the buffer was empty, posts one :class:`EngineBridge.EventsReady`
message with ``post_message`` (thread-safe, non-blocking). The app answers that message
by calling :meth:`drain` no more often than ``fps`` times a second, so a flood of tokens
becomes one screen update per frame.

High-rate snapshots are coalesced while they wait: only the newest ``BlocksChanged``
(the whole KV pool) is kept, and only the newest step's ``LayerTrace`` events.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from textual.message import Message
from textual.message_pump import MessagePump

from nanovllm_core import events as ev


class EngineBridge:
    """Buffers engine events for the UI thread.

    Args:
        target: what receives ``EventsReady`` (the app).
        fps: the most drains per second the app should do (frames per second).
    """

    class EventsReady(Message):
        """Events are waiting in the bridge; call ``drain`` (posted at most once per drain)."""

    def __init__(self, target: MessagePump, fps: float = 20.0) -> None:
        self.target = target
        self.frame_s = 1.0 / fps
        self._lock = threading.Lock()
        self._events: list[ev.Event] = []
        self._blocks: ev.BlocksChanged | None = None
        self._xray: list[ev.LayerTrace] = []
        self._posted = False
        self._last_drain = 0.0
        self.received = 0  # events seen, dropped snapshots included
        self.subscription: Any = None

    # ------------------------------------------------------------------ engine thread

    def __call__(self, event: ev.Event) -> None:
        """Take one event (engine thread). Never blocks on the UI."""
        with self._lock:
            self.received += 1
            if isinstance(event, ev.BlocksChanged):
                self._blocks = event
            elif isinstance(event, ev.LayerTrace):
                if self._xray and (self._xray[0].step, self._xray[0].request_id) != (event.step, event.request_id):
                    self._xray = []
                self._xray.append(event)
            else:
                self._events.append(event)
            post = not self._posted
            self._posted = True
        if post:
            self.target.post_message(self.EventsReady())

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

    def drain(self) -> list[ev.Event]:
        """Everything buffered since the last drain, snapshots last, in arrival order otherwise."""
        with self._lock:
            events = self._events
            if self._blocks is not None:
                events.append(self._blocks)
            events.extend(self._xray)
            self._events, self._blocks, self._xray = [], None, []
            self._posted = False
        self._last_drain = time.monotonic()
        return events
