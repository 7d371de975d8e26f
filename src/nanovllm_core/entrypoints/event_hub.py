"""The engine's event stream for attached apps: ``GET /v1/engine/events``.

One subscription to the controller feeds a numbered log of events; every watcher (an app
attached with ``nanovllm-tui --connect``, or ``curl -N``) reads the log from its own cursor
as server-sent events::

    id: 3f9a0c:812
    data: {"type":"TokenSampled","step":40,...}      <- one line of the trace format (events.to_json)

    event: state
    data: {"state":"running","step":40}             <- at least every half second, and when it changes: the
                                                       controller's state

The ``data`` lines are exactly what ``--trace`` writes, so the app decodes them with the
replay's decoder. An event's ``id`` is this server's instance and the event's number; a
watcher that reconnects sends it back as ``Last-Event-ID`` and gets every event it missed
while the log still holds them; a new watcher (or one that fell too far behind)
first gets a snapshot of the engine as it is: the model's facts, the pauses (``EnginePaused``
and ``EngineResumed`` with the times they happened) that overlap a live request, the one held
now included, so a watcher's TTFT and TPOT leave out paused time as the engine's do; every live request (its ``RequestAdded`` and the tokens it has sampled so far), each request
the newest step ran that has ended since (its ``RequestAdded``, tokens and ``RequestFinished``: an
app recording from its attach, ``--trace``, never begins with a step of a request it never
introduced; trial 29c), and the newest step's ``StepPlanned``, ``StepTimed`` (its KV pool figures brought up to date by
any request that finished after that step, e.g. one aborted between steps) and (to a watcher
of blocks) ``BlocksChanged``,
so an app that attaches mid-run shows the same step, queues and pool as one that watched
from the start. Watchers ask for detail (``topk``, ``blocks``,
``xray``); the engine computes the most any watcher asked for, and each watcher is sent
only what it asked for (its own number of top choices per token: ``events.with_topk``). Nothing here blocks the engine thread: it appends to the log and
wakes the event loop only when a watcher is waiting; watchers are sent what accumulated,
at most ``1 / BATCH_INTERVAL_S`` times a second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from nanovllm_core import events as ev

LOG_EVENTS = 20_000  # events kept for watchers that reconnect
HEARTBEAT_S = 0.5
MAX_PAUSES = 1000  # ended pauses kept for new watchers (each single step ends one)
ENDED_IDS_KEPT = 1024  # ids of ended requests remembered, as the engine's llm_engine.FINISHED_IDS_KEPT
# A watcher is sent what accumulated at most this often: an app draws 5-10 frames a second, and
# fewer, larger writes leave the event loop (and Python's lock) to the engine and the API.
BATCH_INTERVAL_S = 0.05
# Running with no request left, the controller goes idle (or paused) a moment after the last step's events:
# a watcher is told within this many seconds, not at the next heartbeat (trials 42c, 43c: an attached app's
# header said "running" beside an IDLE Engine panel for seconds on a busy host)
STATE_SETTLE_S = 0.05


@dataclass(eq=False)
class _Watcher:
    topk: int
    blocks: bool
    xray: bool
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def wants(self, event: ev.Event) -> bool:
        return ev.asked_for(event, blocks=self.blocks, xray=self.xray)

    def cuts(self, event: ev.Event) -> bool:
        """The event as logged carries more top choices than this watcher asked for (another asked more)."""
        return ev.with_topk(event, self.topk) is not event


class EventHub:
    """Publishes a controller's events to any number of SSE watchers.

    Call :meth:`start` on the event loop (it subscribes), :meth:`close` at shutdown (every
    watcher's stream ends).
    """

    def __init__(self, controller: Any, log_events: int = LOG_EVENTS, heartbeat_s: float = HEARTBEAT_S,
                 batch_interval_s: float = BATCH_INTERVAL_S) -> None:
        self.controller = controller
        self.batch_interval_s = batch_interval_s
        self.log_events = log_events
        self.instance = secrets.token_hex(3)  # a restarted server's numbers are not this one's
        self.heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        # [seq, event, encoded line or None, {topk: encoded line of the event cut to topk} or None]
        self._log: list[list] = []
        self._first_seq = 1
        self._seq = 0
        self._ready: ev.ModelLoading | None = None
        self._live: dict[str, ev.RequestAdded] = {}
        self._tokens: dict[str, list[ev.TokenSampled]] = {}  # of live requests: their output so far
        # the requests the newest StepPlanned ran that have ended since: their RequestAdded, tokens and
        # end, so a new watcher's snapshot introduces every request of the step it is sent (trial 29c)
        self._step_ended: dict[str, list[ev.Event]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()  # the newest ENDED_IDS_KEPT ended requests' ids
        self._latest: dict[type, ev.Event] = {}  # the newest StepPlanned, StepTimed, BlocksChanged
        self._step = 0
        # The engine's pauses as its events tell them (the app's accounting: held from EnginePaused to
        # EngineResumed, except during single steps): a new watcher is sent those that overlap a live
        # request, so its TTFT and TPOT leave out the pauses it did not see, as the engine's do.
        self._paused = False
        self._held: ev.EnginePaused | None = None  # the pause held now, from when it began
        self._pauses: list[tuple[ev.EnginePaused, ev.EngineResumed]] = []  # ended ones
        self._watchers: set[_Watcher] = set()
        self._wake_pending = False
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sub: Any = None

    def start(self) -> None:
        from nanovllm_core.engine.controller import EngineController

        self._loop = asyncio.get_running_loop()
        engine = self.controller.engine
        if engine is not None:  # the model's facts are known now; watchers need them first
            self._ready = EngineController.ready_event(engine)
            if self.controller.state == "paused" and self._held is None:  # paused before this hub listened
                began = time.time() - engine.clock.held_s()
                self._paused, self._held = True, ev.EnginePaused(step=engine.scheduler.step_index, time=began)
        self._sub = self.controller.subscribe(self.publish, topk=0, xray=False, blocks=False)

    def close(self) -> None:
        """End every watcher's stream once it has been sent what was published so far (the server is
        shutting down); safe from any thread."""
        self._closing = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake)
        if self._sub is not None:
            self.controller.unsubscribe(self._sub)
            self._sub = None

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)

    # ------------------------------------------------------------------ engine thread

    def publish(self, event: ev.Event) -> None:
        """Append one event to the log and wake the watchers (called on the engine thread)."""
        with self._lock:
            self._seq += 1
            self._log.append([self._seq, event, None, None])
            if len(self._log) > 2 * self.log_events:
                del self._log[: len(self._log) - self.log_events]
                self._first_seq = self._log[0][0]
            if isinstance(event, ev.RequestAdded):
                self._live[event.request_id] = event
            elif isinstance(event, ev.TokenSampled):
                if event.request_id in self._live:
                    self._tokens.setdefault(event.request_id, []).append(event)
            elif isinstance(event, (ev.RequestFinished, ev.RequestRejected)):
                added = self._live.pop(event.request_id, None)
                self._ended.pop(event.request_id, None)
                self._ended[event.request_id] = None
                if len(self._ended) > ENDED_IDS_KEPT:
                    self._ended.popitem(last=False)
                tokens = self._tokens.pop(event.request_id, [])
                planned = self._latest.get(ev.StepPlanned)
                if added is not None and planned is not None and any(
                        s.request_id == event.request_id for s in planned.scheduled):
                    self._step_ended[event.request_id] = [added, *tokens, event]
                timed = self._latest.get(ev.StepTimed)
                if isinstance(event, ev.RequestFinished) and event.kv_blocks_used is not None and timed:
                    # blocks came back after the newest step (an abort between steps): a new watcher's
                    # snapshot gives the pool as it is now, not as that step left it
                    per_block = timed.kv_bytes_total // timed.num_blocks_total if timed.num_blocks_total else 0
                    self._latest[ev.StepTimed] = dataclasses.replace(
                        timed, num_blocks_used=event.kv_blocks_used, num_blocks_cached=event.kv_blocks_cached or 0,
                        kv_bytes_used=event.kv_blocks_used * per_block)
            elif isinstance(event, (ev.EnginePaused, ev.EngineResumed)):
                self._paused = isinstance(event, ev.EnginePaused)
                self._hold(event) if self._paused else self._release(event)
            elif isinstance(event, (ev.StepPlanned, ev.StepTimed, ev.BlocksChanged)):
                self._latest[type(event)] = event
                if isinstance(event, ev.StepPlanned) and event.scheduled:  # a step while paused is engine time
                    self._release(ev.EngineResumed(step=event.step, time=event.time))
                elif isinstance(event, ev.StepTimed) and self._paused:  # held again after a single step
                    self._hold(ev.EnginePaused(step=event.step, time=event.time))
                if isinstance(event, ev.StepPlanned):
                    self._step = event.step
                    self._step_ended = {}  # the step a new watcher is sent is this one now
                    if self._sub is not None and not self._sub.blocks:  # no longer sent each step: stale
                        self._latest.pop(ev.BlocksChanged, None)
            elif isinstance(event, ev.ModelLoading) and event.ready:
                self._ready = event
            wake = bool(self._watchers) and not self._wake_pending
            self._wake_pending = self._wake_pending or wake
        if wake and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop has closed
                pass

    def _hold(self, event: ev.EnginePaused) -> None:
        if self._held is None:
            self._held = event

    def _release(self, event: ev.EngineResumed) -> None:
        if self._held is not None:
            self._pauses.append((self._held, event))
            self._held = None
        # only pauses that overlap a live request matter to a new watcher
        oldest = min((added.time for added in self._live.values()), default=event.time)
        self._pauses = [p for p in self._pauses if p[1].time >= oldest][-MAX_PAUSES:]

    def live_request_ids(self) -> set[str]:
        """Ids of the requests added and not yet finished, as the published events tell (an id just
        submitted is here once the engine thread has added it)."""
        with self._lock:
            return set(self._live)

    def ended_request_ids(self) -> set[str]:
        """Ids of the newest ``ENDED_IDS_KEPT`` requests that finished (or were aborted or rejected), as the
        published events tell."""
        with self._lock:
            return set(self._ended)

    def request_blocks_snapshot(self) -> None:
        """Publish a fresh ``BlocksChanged`` (taken on the engine thread between steps, even while paused)."""
        self.controller.call(lambda engine: self.publish(engine.blocks_event(engine.step_index)))

    # ------------------------------------------------------------------ event loop

    def _wake(self) -> None:
        for w in self._watchers:
            w.wake.set()

    def _update_detail(self) -> None:
        """Ask the engine for the most detail any watcher wants (nothing costly when none does)."""
        sub = self._sub
        if sub is None:
            return
        sub.topk = max((w.topk for w in self._watchers), default=0)
        sub.blocks = any(w.blocks for w in self._watchers)
        sub.xray = any(w.xray for w in self._watchers)

    def _snapshot(self, w: _Watcher) -> list[ev.Event]:
        """What a new watcher needs first, the engine as it is now (call with the lock held)."""
        timed: list[ev.Event] = [e for pause in self._pauses for e in pause]
        if self._held is not None:
            timed.append(self._held)
        elif self.controller.state == "paused":  # asked for, not yet applied by the engine thread
            timed.append(ev.EnginePaused(step=self._step))
        for rid, added in self._live.items():
            timed.append(added)
            timed.extend(self._tokens.get(rid, ()))
        for ended in self._step_ended.values():  # the newest step's requests that ended since
            timed.extend(ended)
        timed.extend(e for kind in (ev.StepPlanned, ev.StepTimed, ev.BlocksChanged)
                     if (e := self._latest.get(kind)) is not None and w.wants(e))
        # in the order they happened, so the watcher's pause accounting is the engine's
        timed.sort(key=lambda e: e.time)
        return ([self._ready] if self._ready is not None else []) + timed

    def _frame(self, seq: int, event: ev.Event) -> str:
        return f"id: {self.instance}:{seq}\ndata: {ev.to_json(event)}\n\n"

    def parse_last_event_id(self, header: str | None) -> int | None:
        """The event number in a ``Last-Event-ID`` this server sent (None: absent, malformed or another server's)."""
        instance, _, seq = (header or "").partition(":")
        # ASCII digits only, and few: int() refuses "²" (a digit to isdigit) and 5000 digits with a
        # ValueError, which was a 500 (trial 14b's kind: a header is outside input too)
        ok = instance == self.instance and seq.isascii() and seq.isdigit() and len(seq) <= 18
        return int(seq) if ok else None

    def _encoded(self, entry: list, w: _Watcher) -> str:
        """The log entry's frame as ``w`` gets it: its own ``topk`` (encoded once per topk asked)."""
        if w.cuts(entry[1]):
            if entry[3] is None:
                entry[3] = {}
            if w.topk not in entry[3]:
                entry[3][w.topk] = self._frame(entry[0], ev.with_topk(entry[1], w.topk))
            return entry[3][w.topk]
        if entry[2] is None:
            entry[2] = self._frame(entry[0], entry[1])
        return entry[2]

    def _stopped_frame(self) -> str:
        """The stream's last frame at a shutdown: state ``stopped``, the step, and ``unfinished``, the
        requests added and never finished. Empty when the engine applied the shutdown's aborts before the
        close (each told by its ``RequestFinished``); a step still running when the close could wait no
        longer (a long prefill on a busy host) leaves its requests here, so a watcher knows they ended
        with the server instead of showing them running for good (trial 30c)."""
        with self._lock:
            unfinished = list(self._live)
        return f"event: state\ndata: {json.dumps({'state': 'stopped', 'step': self._step, 'unfinished': unfinished})}\n\n"

    def _state_frame(self, state: str | None = None) -> str:
        """The ``state`` frame: ``state`` (default: the controller's now) and the newest step."""
        state = self.controller.state if state is None else state
        return f"event: state\ndata: {json.dumps({'state': state, 'step': self._step})}\n\n"

    async def stream(self, topk: int = 0, blocks: bool = False, xray: bool = False,
                     last_event_id: int | None = None) -> AsyncIterator[str]:
        """One watcher's server-sent events, until it disconnects or the server shuts down."""
        w = _Watcher(topk=topk, blocks=blocks, xray=xray)
        self._watchers.add(w)
        self._update_detail()
        try:
            with self._lock:
                resume = last_event_id is not None and self._first_seq - 1 <= last_event_id <= self._seq
                cursor = last_event_id if resume else self._seq
                snapshot = [] if resume else self._snapshot(w)
            sent_state = self.controller.state
            yield self._state_frame(sent_state) + "".join(self._frame(cursor, ev.with_topk(e, w.topk)) for e in snapshot)
            last_state = time.monotonic()
            while True:
                # Re-arm the wake-up before reading: an event published from here on wakes this loop,
                # and while it is busy sending, the engine thread is not asked to wake it again.
                self._wake_pending = False
                w.wake.clear()
                closing = self._closing  # read before the log: what came before the close is still sent
                with self._lock:
                    if cursor < self._first_seq - 1:  # fell behind the log: start over from a snapshot
                        cursor, batch, snapshot = self._seq, [], self._snapshot(w)
                    else:
                        batch, snapshot = self._log[cursor - self._first_seq + 1:], []
                out = [self._frame(cursor, ev.with_topk(e, w.topk)) for e in snapshot]
                for entry in batch:
                    if w.wants(entry[1]):
                        out.append(self._encoded(entry, w))
                    cursor = entry[0]
                now_state = self.controller.state  # after the log: the events that led to it go first
                if now_state != sent_state or time.monotonic() - last_state >= self.heartbeat_s:
                    out.append(self._state_frame(now_state))
                    sent_state, last_state = now_state, time.monotonic()
                if closing:  # the last frame: a state "stopped" naming what ends unfinished (see stopped_frame)
                    out.append(self._stopped_frame())
                if out:
                    yield "".join(out)
                if closing:
                    return
                if batch:
                    await asyncio.sleep(self.batch_interval_s)
                else:
                    with self._lock:
                        settling = sent_state == "running" and not self._live  # idle (or paused) in a moment
                    try:
                        await asyncio.wait_for(w.wake.wait(), STATE_SETTLE_S if settling else self.heartbeat_s)
                    except asyncio.TimeoutError:
                        pass
        finally:
            self._watchers.discard(w)
            self._update_detail()
