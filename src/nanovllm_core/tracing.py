"""Recording the event stream: JSON lines, and Chrome's trace-event format.

- :class:`JsonlTraceWriter` writes every event as one JSON line (``events.to_json``); the
  app's ``--replay`` plays such a file back without a model, and :func:`decode_event` reads
  a line back (the same lines come from ``nanovllm serve``'s event stream).
- :func:`chrome_trace` turns events into the Trace Event Format that Perfetto
  (ui.perfetto.dev) and ``chrome://tracing`` open: one track for engine steps and one per
  request, showing when it queued, each prefill chunk, its decode run, preemptions and its end.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Iterable

from nanovllm_core import events as ev


class _Recording:
    """What a recorder shares: closing while the engine thread may still be sending, and saying
    whether the recording ends early.

    A front end closes its recorders when it quits, and the engine thread need not have stopped
    by then: the app abandons a step in flight at its next layer boundary rather than wait for it
    (``yield_gate.GATE.close``), and a remote app's reader thread may deliver one more event. So
    an event that arrives after :meth:`close` is dropped and counted (``dropped``), never written
    to a closed file (trial 14a: three chained tracebacks and a dead engine thread on ``q`` under
    ``--trace-xray``); :meth:`ended_early` says in one sentence what the recording then lacks.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.count = 0  # events recorded
        self.dropped = 0  # events that came after close
        self.unfinished_step: int | None = None  # a step whose StepPlanned is recorded and its end is not
        self._lock = threading.Lock()
        self._closed = False  # close() was called
        self._stopped = False  # nothing more is recorded: closed, or a write failed

    def __call__(self, event: ev.Event) -> None:
        with self._lock:
            if self._stopped:
                self.dropped += 1
                return
            self._record(event)
            if self._stopped:  # the write failed: the recording ended there (close() raises why)
                self.dropped += 1
                return
            self.count += 1
            if isinstance(event, ev.StepPlanned) and event.scheduled:
                self.unfinished_step = event.step
            elif isinstance(event, ev.StepTimed) or (isinstance(event, ev.EngineError) and event.step is not None
                                                     and event.step == self.unfinished_step):
                self.unfinished_step = None  # ended (a failed step's EngineError ends it too, as a replay reads it)

    def close(self) -> None:
        """Finish the file; events from now on are dropped (idempotent).

        Raises:
            OSError: the file could not be written (a write during the run, or this last one).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = self._stopped = True
            self._finish()

    def ended_early(self) -> str | None:
        """After :meth:`close`: one sentence when the recording stops short of what the engine did
        (a step it was still running, or events after the close), else None."""
        if self.unfinished_step is not None:
            return (f"the trace {self.path} ends during step {self.unfinished_step}, which was still running when "
                    "the recording closed: --replay plays the steps before it")
        if self.dropped:
            one = self.dropped == 1
            return (f"the trace {self.path} ends early: {self.dropped:,} event{'' if one else 's'} that came after "
                    f"the recording closed {'is' if one else 'are'} not in it")
        return None

    def _record(self, event: ev.Event) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


class JsonlTraceWriter(_Recording):
    """A subscriber that appends each event to a ``.jsonl`` file (use as ``engine.subscribe(writer, ...)``).

    A replay needs the model's facts before the first step: subscribed to an ``LLMEngine`` (which
    sends no ``ModelLoading``), write ``EngineController.ready_event(engine)`` first, as
    ``nanovllm --trace`` does; a controller's subscribers get it from the controller.

    Safe to close from another thread than the engine's: see :class:`_Recording`. A write that
    fails (a full disk) ends the recording there rather than fail the engine's step: the
    events after it are dropped and :meth:`close` raises the error.

    Raises:
        OSError: the file cannot be created (checked at construction).
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._f = open(self.path, "w", encoding="utf-8")
        self._error: OSError | None = None

    def _record(self, event: ev.Event) -> None:
        try:
            self._f.write(ev.to_json(event) + "\n")
            if isinstance(event, ev.StepTimed) or self.unfinished_step is None:
                # at each step's end and between steps (an abort, a finish): the file holds every whole step
                # while the engine idles, not only at close (trial 36c: a copy taken from an idle app's trace
                # lacked its last StepTimed, and its replay said that step never finished)
                self._f.flush()
        except OSError as e:
            self._error, self._stopped = e, True

    def _finish(self) -> None:
        try:
            self._f.close()
        except OSError as e:
            self._error = self._error or e
        if self._error is not None:
            raise self._error


def decode_event(line: str) -> ev.Event:
    """One trace line back into its event: the decoder of trace files (``--replay``) and of the
    server's event stream (``nanovllm-tui --connect``), which carry the same lines.

    Raises:
        ValueError: the line is not an engine event (not JSON, an unknown type, or fields that
            do not fit it).
    """
    try:
        return ev.from_json(line)
    except TypeError as e:  # a known type with fields it does not have (a newer or damaged trace)
        raise ValueError(f"not an engine event: {e}") from None


def read_jsonl(path: str | Path) -> list[ev.Event]:
    """Events from a ``.jsonl`` trace.

    Raises:
        ValueError: a line is not an engine event (the message gives its line number).
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(decode_event(line))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    return out


class ChromeTraceRecorder(_Recording):
    """A subscriber that keeps events and writes a Chrome trace JSON file on :meth:`close`
    (safe to close from another thread than the engine's: see :class:`_Recording`).

    Raises:
        OSError: the file cannot be created (checked at construction).
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.path.open("w").close()  # fail early on a bad path
        self.events: list[ev.Event] = []

    def _record(self, event: ev.Event) -> None:
        if not isinstance(event, (ev.LayerTrace, ev.BlocksChanged)):
            self.events.append(event)

    def _finish(self) -> None:
        self.path.write_text(json.dumps(chrome_trace(self.events)))


def chrome_trace(events: Iterable[ev.Event]) -> dict:
    """Build ``{"traceEvents": [...]}`` from engine events (times in microseconds from the first event).

    Track 0 holds engine steps; track i (i >= 1) holds request number i in arrival order.
    """
    events = list(events)
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(e.time for e in events)

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 1)

    out: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "nano-vLLM engine"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "engine steps"}},
    ]
    tracks: dict[str, int] = {}
    plans: dict[int, ev.StepPlanned] = {}
    step_end: dict[int, float] = {}
    for e in events:
        if isinstance(e, ev.StepPlanned):
            plans[e.step] = e
        elif isinstance(e, ev.StepTimed):
            step_end[e.step] = e.time
    # state per request: open span (name, start, args) to close when it changes
    open_span: dict[str, tuple[str, float, dict]] = {}

    def track(rid: str) -> int:
        if rid not in tracks:
            tracks[rid] = len(tracks) + 1
            out.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tracks[rid], "args": {"name": f"request {rid}"}})
        return tracks[rid]

    def close(rid: str, at: float) -> None:
        span = open_span.pop(rid, None)
        if span is not None:
            name, start, args = span
            out.append({"name": name, "ph": "X", "pid": 1, "tid": track(rid), "ts": us(start),
                        "dur": max(us(at) - us(start), 0.1), "args": args})

    def open_(rid: str, name: str, at: float, args: dict) -> None:
        close(rid, at)
        open_span[rid] = (name, at, args)

    for e in events:
        if isinstance(e, ev.RequestAdded):
            open_(e.request_id, "queued", e.time, {"prompt_tokens": len(e.prompt_token_ids), "priority": e.priority})
        elif isinstance(e, ev.StepPlanned):
            end = step_end.get(e.step, e.time)
            if e.scheduled:
                out.append({"name": f"step {e.step}", "ph": "X", "pid": 1, "tid": 0, "ts": us(e.time),
                            "dur": max(us(end) - us(e.time), 0.1),
                            "args": {"tokens": e.num_batched_tokens, "budget": e.token_budget,
                                     "sequences": len(e.scheduled), "preempted": len(e.preempted)}})
            for p in e.preempted:
                close(p.request_id, e.time)
                out.append({"name": "preempted", "ph": "i", "s": "t", "pid": 1, "tid": track(p.request_id), "ts": us(e.time)})
                open_(p.request_id, "waiting (preempted)", e.time, {"preemptions": p.num_preemptions})
            for s in e.scheduled:
                if s.index != 0:
                    continue
                current = open_span.get(s.request_id)
                if s.kind == "decode":
                    if current is not None and current[0] == "decode":
                        current[2]["tokens"] += 1
                    else:
                        open_(s.request_id, "decode", e.time, {"tokens": 1})
                else:
                    open_(s.request_id, "prefill chunk", e.time,
                          {"tokens": s.num_tokens, "start": s.start, "cached": s.num_cached_tokens})
                    close(s.request_id, end)
        elif isinstance(e, ev.RequestFinished):
            close(e.request_id, e.time)
            out.append({"name": f"finished ({e.finish_reason})", "ph": "i", "s": "t", "pid": 1,
                        "tid": track(e.request_id), "ts": us(e.time),
                        "args": {"output_tokens": e.num_output_tokens, "ttft_s": e.ttft_s, "tpot_s": e.tpot_s}})
        elif isinstance(e, ev.RequestRejected):
            close(e.request_id, e.time)
            out.append({"name": "rejected", "ph": "i", "s": "t", "pid": 1, "tid": track(e.request_id), "ts": us(e.time),
                        "args": {"reason": e.reason}})
    last = max(e.time for e in events)
    for rid in list(open_span):
        close(rid, last)
    return {"traceEvents": out, "displayTimeUnit": "ms"}
