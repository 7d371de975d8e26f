"""``--replay FILE.jsonl``: play a recorded event trace as if an engine were running.

:class:`ReplayController` has the ``EngineController`` commands the app uses, so the app
cannot tell the difference: ``pause``, ``resume`` and ``step(n)`` act on the recorded step
boundaries, and events reach subscribers from a thread of their own, at the pace they were
recorded (each gap clamped to ``pace``). Commands that would change what happened
(``submit``, ``abort``) are answered with the same events an engine uses to refuse them.

Two kinds of pause are kept apart. The replay's own pauses of its playback are sent as
:class:`PlaybackPaused` / :class:`PlaybackResumed` (an ``EnginePaused`` / ``EngineResumed`` to
anyone who asks ``isinstance``): the app shows them, but they take no recorded time. The pauses
of the recorded session are sent as :class:`RecordedPaused` / :class:`RecordedResumed` where they
happened: they do not hold the playback, and the app counts them as the engine did (engine time
leaves them out), so the live TTFT/TPOT of a request that spanned one agree with the engine's
figures in its ``RequestFinished``.
Record a trace with ``nanovllm --prompt ... --trace run.jsonl``.
"""

from __future__ import annotations

import gzip
import itertools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from nanovllm_core import events as ev
from nanovllm_core import untrusted
from nanovllm_core.tracing import decode_event
from nanovllm_tui.remote import ServerRestarted, ServerStopped

REPLAY_ABORT_REFUSAL = "a replay cannot change it"  # ends the replay's own refusal of an abort (not a recorded one)
NO_NEW_PROMPTS = "a replay plays a recorded trace and cannot run new prompts; start nanovllm-tui without --replay"


@dataclass(frozen=True)
class PlaybackPaused(ev.EnginePaused):
    """The replay's playback held at a step boundary (``time``: the recording's clock there)."""


@dataclass(frozen=True)
class PlaybackResumed(ev.EngineResumed):
    """The replay's playback going on again (``time``: the recording's clock at that boundary)."""


@dataclass(frozen=True)
class RecordedPaused(ev.Event):
    """A recorded ``EnginePaused``: the recorded engine was held paused from ``time`` (its engine
    time leaves this out). Made by :func:`split_steps`, not by an engine."""

    step: int


@dataclass(frozen=True)
class RecordedResumed(ev.Event):
    """A recorded ``EngineResumed``: the recorded engine's pause ended at ``time``."""

    step: int


def as_recorded(e: ev.EnginePaused | ev.EngineResumed) -> RecordedPaused | RecordedResumed:
    """A recorded pause event as the replay sends it (see the module's docstring)."""
    kind = RecordedPaused if isinstance(e, ev.EnginePaused) else RecordedResumed
    return kind(step=e.step, time=e.time)


@dataclass
class ReplaySubscription:
    """A listener and the detail it asked for (a replay sends what was recorded regardless)."""

    callback: Callable[[ev.Event], None]
    topk: int = 5
    blocks: bool = True
    xray: bool = False


class Trace(list):
    """A trace's events; ``cut_line``: the number of its last line when that line was cut short
    (it is not played), else None; ``cut_step``: the step the recording stopped in, before its
    ``StepTimed`` (it is not played: it never finished), else None."""

    cut_line: int | None = None
    cut_step: int | None = None


# Events an app itself makes and its recorder writes beside the engine's (``--connect --trace``): a
# server that restarted under an attached app is a line of the trace, and was "not an engine event".
APP_EVENTS: dict[str, type] = {"ServerRestarted": ServerRestarted, "ServerStopped": ServerStopped}


def decode_line(line: str) -> ev.Event:
    """One trace line: an engine event (``decode_event``) or one of :data:`APP_EVENTS`.

    Raises:
        ValueError: as ``decode_event``.
    """
    try:
        return decode_event(line)
    except ValueError:
        try:
            data = untrusted.loads(line)
        except (ValueError, RecursionError):
            data = None
        if not (isinstance(data, dict) and data.get("type") in APP_EVENTS):
            raise
        return ev._build(APP_EVENTS[data["type"]], data)


# What a step itself sends between its StepPlanned and its StepTimed (left out of a step that never finished).
STEP_EVENTS = (ev.TokenSampled, ev.BlocksChanged, ev.LayerTrace, ev.SpecDecodeStep)


def drop_unfinished_step(events: Trace) -> None:
    """Leave out the last step when the recording stopped inside it (``q`` during a long prefill
    chunk: its ``StepPlanned`` and maybe some of its events, no ``StepTimed``), and keep its number
    in ``events.cut_step``. Played, it read as if it had run: "last step 486: 512/512 tok" and its
    chunk counted as prefilled while the KV panel had no blocks for it (trial 10). Events between
    steps (a request added, a pause) are kept. An empty step (nothing scheduled: the engine sends
    no ``StepTimed`` for it) and a step the engine reported failing (an ``EngineError`` of that
    step) are whole as recorded."""
    last = next((i for i in range(len(events) - 1, -1, -1) if isinstance(events[i], ev.StepPlanned)), None)
    if last is None or not events[last].scheduled:
        return
    step, tail = events[last].step, events[last + 1:]
    if any(isinstance(e, ev.StepTimed) or (isinstance(e, ev.EngineError) and e.step == step) for e in tail):
        return
    events[last:] = [e for e in tail if not isinstance(e, STEP_EVENTS)]
    events.cut_step = step


class NoModelFacts(ValueError):
    """A step before the trace's ready ``ModelLoading``: every recorder writes the model's facts
    before the first step (the engine sends them when it has loaded; a server's attach snapshot and a
    restarted server's begin with them), and the views need them (the model's sizes, its KV bytes).
    Played, such a trace stayed "loading model" while its steps ran (trial 20d)."""


def load_trace(path: str | Path) -> Trace:
    """Events of a ``.jsonl`` trace, or of a gzipped one (``.jsonl.gz``). A last line cut short
    (no newline, not complete JSON) is left out and its number kept in ``cut_line``; a bad line
    anywhere else, or a field of another type than its event declares, is an error. A last step that
    never finished is left out (:func:`drop_unfinished_step`).

    Raises:
        OSError: the file cannot be read.
        ValueError: a line is not an engine event (its number is given, and the field whose type is
            wrong: ``line 101: StepTimed.time must be a number, got "BOGUS"``), a step comes before the
            model's facts (:class:`NoModelFacts`, naming the step's line), or the file holds no engine step.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    events = Trace()
    facts = False  # a ready ModelLoading has come (the model's facts)
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        event = decode_line(line)
                        events.append(event)
                        facts = facts or (isinstance(event, ev.ModelLoading) and event.ready)
                        if isinstance(event, ev.StepPlanned) and not facts:
                            raise NoModelFacts(f"step {event.step} comes before the model's facts (a ModelLoading "
                                               "event with ready true), which every recording holds first; the "
                                               "trace was cut at its start or edited: keep its first line, or "
                                               "record one with nanovllm --trace FILE.jsonl")
                    except ValueError as e:
                        # the last line, cut short (a recording copied while written, or `head -c`): play what
                        # came before it; a whole line whose fields do not fit is an error wherever it is
                        if not line.endswith("\n") and isinstance(e, ev.IncompleteJSON):
                            events.cut_line = n
                            break
                        advice = ("; the line was edited or not written by nanovllm: record a trace with "
                                  "nanovllm --trace FILE.jsonl" if isinstance(e, ev.FieldsDoNotFit) else "")
                        raise ValueError(f"line {n}: {e}{advice}") from None
    except UnicodeDecodeError as e:  # its own words name a codec and a byte (report 15b, finding 7)
        raise ValueError(f"not a trace: it holds bytes that are not UTF-8 text (0x{e.object[e.start:e.start + 1].hex()}), "
                         "as a binary file does; record a trace with nanovllm --trace FILE.jsonl") from None
    except (EOFError, gzip.BadGzipFile) as e:
        raise ValueError(f"not a readable trace: {e}") from None
    drop_unfinished_step(events)
    if not any(isinstance(e, ev.StepPlanned) for e in events):
        during = ("" if events.cut_step is None
                  else f" (the recording stopped during step {events.cut_step}, before it finished)")
        raise ValueError(f"no engine steps in this trace{during}; record one with nanovllm --prompt ... --trace FILE.jsonl")
    return events


def split_steps(events: list[ev.Event]) -> tuple[list[ev.Event], list[list[ev.Event]]]:
    """(events before the first step, one list per step starting at its ``StepPlanned``).

    Recorded pause/resume events become :class:`RecordedPaused` / :class:`RecordedResumed`, in
    their place: the recorded pauses are accounting (the engine time they leave out), not pauses
    of the playback, which the replay makes itself (:class:`PlaybackPaused`).
    """
    prologue: list[ev.Event] = []
    steps: list[list[ev.Event]] = []
    for e in events:
        if isinstance(e, (ev.EnginePaused, ev.EngineResumed)):
            e = as_recorded(e)
        if isinstance(e, ev.StepPlanned):
            steps.append([e])
        elif steps:
            steps[-1].append(e)
        else:
            prologue.append(e)
    return prologue, steps


class ReplayController:
    """Plays recorded events through the ``EngineController`` interface.

    Args:
        events: a trace's events (see :func:`load_trace`).
        start_paused: wait for ``resume`` or ``step`` before the first step.
        pace: (shortest, longest) wait between steps in seconds while playing.

    ``state``: ``running``, ``paused``, ``idle`` (the trace has ended) or ``stopped``;
    ``ended``: every recorded step has been played (and handed to the subscribers).
    """

    live = False

    def __init__(self, events: list[ev.Event], start_paused: bool = False,
                 pace: tuple[float, float] = (0.05, 1.0)) -> None:
        self._prologue, self._steps = split_steps(events)
        self.cut_line: int | None = getattr(events, "cut_line", None)  # see Trace
        self.cut_step: int | None = getattr(events, "cut_step", None)
        self.pace = pace
        self.load_error: str | None = None
        self.engine = None
        self._subs: list[ReplaySubscription] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._paused = start_paused
        self._allowed = 0
        self._stop = False
        self._next = 0
        self._started = False
        self.ended = False
        self._ids = itertools.count()
        self._state = "paused" if start_paused else "running"
        # (layer, head) -> the recorded steps whose trace of that layer carries its attention heatmap
        self._heatmap_steps: dict[tuple[int, int], list[int]] = {}
        for step_events in self._steps:
            for e in step_events:
                if isinstance(e, ev.LayerTrace) and e.attention:
                    steps = self._heatmap_steps.setdefault((e.layer, e.head), [])
                    if not steps or steps[-1] != e.step:
                        steps.append(e.step)
        # Playing starts with the first subscriber, so no listener misses the beginning.
        self._thread = threading.Thread(target=self._run, name="nanovllm-replay", daemon=True)

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> "ReplayController":
        return cls(load_trace(path), **kwargs)

    # ------------------------------------------------------------------ EngineController's interface

    @property
    def state(self) -> str:
        return self._state

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_steps(self) -> int:
        """Steps in the trace."""
        return len(self._steps)

    @property
    def steps_played(self) -> int:
        return self._next

    def next_heatmap_step(self, layer: int, head: int, step: int) -> int | None:
        """The first recorded step from ``step`` on whose trace holds the attention heatmap of ``layer``
        and ``head`` (None: the recording holds none from there on). A replay cannot trace anything
        new, so this, not "the next step", is when a heatmap chosen in the X-Ray can show."""
        return next((s for s in self._heatmap_steps.get((layer, head), ()) if s >= step), None)

    def subscribe(self, callback: Callable[[ev.Event], None], topk: int = 5, xray: bool = False,
                  blocks: bool = True) -> ReplaySubscription:
        """Receive every recorded event from now on; the first subscriber starts the playing.

        A later subscriber first gets the events before the first step (the model's facts).
        """
        sub = ReplaySubscription(callback, topk=topk, blocks=blocks, xray=xray)
        with self._lock:
            self._subs.append(sub)
            first, self._started = not self._started, True
        if first:
            self._thread.start()
        else:
            for e in self._prologue:
                callback(e)
        return sub

    def unsubscribe(self, sub: ReplaySubscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def submit(self, prompt: Any, sampling_params: Any = None, priority: int = 0,
               request_id: str | None = None, fit_context: bool = False) -> str:
        """Refused: a ``RequestRejected`` event says why (nothing is silently dropped)."""
        rid = request_id if request_id is not None else f"new-{next(self._ids)}"
        self._emit([ev.RequestRejected(request_id=rid, reason=NO_NEW_PROMPTS)])
        return rid

    def abort(self, request_id: str) -> None:
        self._emit([ev.EngineError(step=None, request_id=request_id,
                                   message=f"abort: {request_id!r} is part of a recording; {REPLAY_ABORT_REFUSAL}")])

    def xray(self, request_id: str | None, layer: int = 0, head: int = 0) -> None:
        """No effect: the trace holds whatever X-Ray events were recorded."""

    def call(self, fn: Callable[[Any], Any]) -> None:
        """No effect: there is no engine to run ``fn`` on."""

    def pause(self) -> None:
        with self._cond:
            if self._paused:
                return
            self._paused, self._allowed = True, 0
            if self._state == "idle":  # the recording has ended: paused now, as an engine with nothing to do is
                self._state = "paused"
            self._cond.notify_all()
        self._emit([PlaybackPaused(step=self._current_step(), time=self._recorded_now())])

    def resume(self) -> None:
        with self._cond:
            if not self._paused:
                return
            self._paused = False
            if self._state == "paused" and self._next >= len(self._steps):
                self._state = "idle"
            self._cond.notify_all()
        self._emit([PlaybackResumed(step=self._current_step(), time=self._recorded_now())])

    def step(self, n: int = 1) -> None:
        """While paused, play exactly ``n`` more recorded steps."""
        if n < 1:
            raise ValueError(f"step(n) needs n >= 1, got {n}")
        with self._cond:
            if self._paused:
                self._allowed += n
                self._cond.notify_all()

    def shutdown(self, timeout: float = 1.0) -> bool:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._state = "stopped"
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ the thread

    def _current_step(self) -> int:
        return self._steps[self._next - 1][0].step if self._next else 0

    def _recorded_now(self) -> float:
        """The recording's clock at the current step boundary (where a playback pause or resume is
        dated; they are not counted as paused time, see :class:`PlaybackPaused`)."""
        if self._next < len(self._steps):
            return self._steps[self._next][0].time
        return self._steps[-1][-1].time

    def _emit(self, events: list[ev.Event]) -> None:
        with self._lock:
            subs = list(self._subs)
        for e in events:
            for sub in subs:
                sub.callback(e)

    def _run(self) -> None:
        self._emit(self._prologue)
        while self._next < len(self._steps):
            with self._cond:
                while not self._stop and self._paused and self._allowed == 0:
                    self._state = "paused"
                    self._cond.wait()
                if self._stop:
                    break
                if self._paused:
                    self._allowed -= 1
                self._state = "paused" if self._paused else "running"
                group = self._steps[self._next]
                self._next += 1
            self._emit(group)
            if self._next < len(self._steps):
                gap = self._steps[self._next][0].time - group[0].time
                with self._cond:
                    if not self._paused and not self._stop:
                        self._cond.wait(min(max(gap, self.pace[0]), self.pace[1]))
        with self._cond:
            if not self._stop:
                self.ended = True
                self._state = "paused" if self._paused else "idle"
            while not self._stop:
                self._cond.wait()
        self._state = "stopped"
