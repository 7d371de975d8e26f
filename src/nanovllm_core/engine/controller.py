"""``EngineController``: the engine on its own thread, driven by a command queue.

The app (and anything else interactive) never calls the engine directly. It sends commands
(``submit``, ``pause``, ``resume``, ``step(n)``, ``abort``, ``abort_all``, ``shutdown``), which are
thread-safe and return at once; the engine thread applies them *between* steps, so pausing
and single-stepping act on step boundaries. Everything the engine does comes back as
events (``nanovllm_core.events``) through ``subscribe``.

The model loads on the engine thread, so a window can appear at once; commands sent while
it loads are queued and run afterwards, and loading progress arrives as ``ModelLoading``
events. A failing step becomes an ``EngineError`` event and the thread keeps serving.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from nanovllm_core import events as ev
from nanovllm_core import yield_gate
from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.llm_engine import LLMEngine, Subscription
from nanovllm_core.outputs import CompletionOutput, RequestOutput
from nanovllm_core.sampling_params import SamplingParams, check_priority
from nanovllm_core.untrusted import shown


def load_failure(error: BaseException) -> str:
    """The one-line EngineError message for an engine that could not be built: ``events.MODEL_FAILED: ...``
    or ``events.SETTING_REFUSED: ...``. A setting: :class:`~nanovllm_core.config.SettingError`, or any other
    ``ValueError`` than a :class:`~nanovllm_core.model.loader.ModelLoadError` (``EngineConfig``'s checks)."""
    from nanovllm_core.config import SettingError
    from nanovllm_core.model.loader import ModelLoadError

    text = str(error) or type(error).__name__
    setting = isinstance(error, SettingError) or (isinstance(error, ValueError)
                                                   and not isinstance(error, ModelLoadError))
    return f"{ev.SETTING_REFUSED if setting else ev.MODEL_FAILED}: {text}"


MAX_STEPS = 1000  # single steps that may be pending (asked for and not yet run) at once; more is refused
STATES = ("loading", "running", "paused", "idle", "stopped", "failed")


class StepsPending(ValueError):
    """A ``step(n)`` that would leave more than ``MAX_STEPS`` steps pending; nothing was queued.

    ``n``: the steps asked for; ``pending``: those asked for before and not yet run; ``room``: the
    most that may be asked now (``MAX_STEPS - pending``). The message says all three (trial 14b: a
    server answered ``{"ok": true}`` to 600 + 500 steps and ran 1000 of them).
    """

    def __init__(self, n: int, pending: int) -> None:
        self.n, self.pending, self.room = n, pending, MAX_STEPS - pending
        advice = (f"ask for at most {self.room} now, or wait until some have run" if self.room > 0
                  else "ask again once some have run")
        super().__init__(f"n={n} would make {pending + n} steps pending, more than the {MAX_STEPS} that may wait at "
                         f"once: {pending} {'is' if pending == 1 else 'are'} pending already (asked for and not yet "
                         f"run); {advice}")


class NotPaused(ValueError):
    """A ``step(n)`` while the engine is running, or will be once the commands sent before it have
    applied (the last ``pause``/``resume`` asked was a resume, or none was and it did not start
    paused); nothing was queued. The message says what to do.

    Acceptance follows the order commands were *asked* in, not the state the engine thread has
    applied so far: a step sent after a resume that had not applied yet read the state "paused",
    was accepted (a server answered 200) and then dropped without a word once the resume applied
    (trial 25b)."""

    def __init__(self) -> None:
        super().__init__("step runs single steps while the engine is paused; pause first (the last pause or resume "
                         "asked was a resume, or the engine runs)")


@dataclass
class _Command:
    name: str
    args: tuple = ()


class EngineController:
    """Owns the engine thread.

    Args:
        model: what ``LLM`` accepts (None = the embedded default); loaded on the thread.
        start_paused: begin paused (the app's tutorial and tests use it).
        **llm_kwargs: engine settings (``EngineConfig`` fields: block_size, num_kv_blocks, ...).

    Raises:
        ValueError: a keyword that is not a setting (``EngineConfig.unknown_options``).

    ``state`` is one of ``loading``, ``running`` (stepping), ``paused``, ``idle`` (nothing to
    do), ``stopped`` (after shutdown) or ``failed`` (the model did not load; ``load_error`` says why).
    ``start_paused``: as given (while ``loading``, whether the engine will come up paused).
    """

    def __init__(self, model: str | None = None, *, start_paused: bool = False, _engine: LLMEngine | None = None,
                 **llm_kwargs: Any) -> None:
        unknown = EngineConfig.unknown_options(llm_kwargs, "EngineController", extra=("start_paused",))
        if unknown:  # before the thread starts: its load would fail on a TypeError without a hint
            raise ValueError(unknown)
        self._engine: LLMEngine | None = _engine
        self._owns_engine = _engine is None  # loaded on this controller's thread: closed when it stops
        self._model = model
        self._llm_kwargs = llm_kwargs
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._subscriptions: list[Subscription] = []
        self._sub_lock = threading.Lock()
        self._ids = itertools.count()
        self._paused = start_paused
        self.start_paused = start_paused
        self._steps_allowed = 0  # steps the engine thread may still run while paused
        # Pending steps are counted when step() is called, so a caller is refused at once (steps_pending).
        # A pause or resume drops the steps asked before it: each step command carries how many pause
        # and resume calls came before it, and only those asked since the last call still count.
        self._steps_lock = threading.Lock()
        self._drops = 0  # pause() and resume() calls so far
        self._drops_applied = 0  # of them, applied by the engine thread
        self._steps_queued = 0  # steps of step() calls since the last pause()/resume(), not yet applied
        # Whether the engine is paused once every command asked so far has applied: set by pause() and
        # resume() when they are called (not when the engine thread applies them), so step() accepts
        # exactly the steps that will find the engine paused, whatever step boundary they arrive at.
        self._will_pause = start_paused
        self._aborts_lock = threading.Lock()
        self._aborts_asked: set[str] = set()  # ids of abort() calls the engine thread has not applied yet
        self._stop = threading.Event()
        self._state = "loading" if _engine is None else ("paused" if start_paused else "idle")
        if _engine is not None and start_paused:
            _engine.clock.stop()
        self.load_error: str | None = None
        self.load_failure: str | None = None  # load_error with its kind in front (load_failure())
        self.results: dict[str, RequestOutput] = {}
        # The engine's stats() as of its last step or command, taken on the engine thread (see stats()).
        self._stats: dict[str, Any] = {}
        self._listeners: dict[str, Callable[[RequestOutput], None]] = {}  # engine thread only
        self._results_cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_llm(cls, llm: Any, start_paused: bool = False) -> "EngineController":
        """Wrap an ``LLM`` that is already loaded (its engine moves to the controller's thread)."""
        return cls(_engine=llm.engine, start_paused=start_paused)

    @classmethod
    def from_engine(cls, engine: LLMEngine, start_paused: bool = False) -> "EngineController":
        return cls(_engine=engine, start_paused=start_paused)

    # ------------------------------------------------------------------ public, thread-safe

    @property
    def state(self) -> str:
        return self._state

    @property
    def engine(self) -> LLMEngine | None:
        """The engine once loaded. Read-only use from other threads (its config, tokenizer)."""
        return self._engine

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def subscribe(self, callback: Callable[[ev.Event], None], topk: int = 5, xray: bool = False,
                  blocks: bool = True) -> Subscription:
        """Receive every event (engine and controller) on the engine thread; see ``LLMEngine.subscribe``.

        The returned subscription's ``topk``/``xray``/``blocks`` may be changed later (e.g. the
        app turns ``xray`` on only while the X-Ray tab is visible).
        """
        sub = Subscription(callback, topk=topk, blocks=blocks, xray=xray)
        with self._sub_lock:
            self._subscriptions.append(sub)
            loaded = self._engine is not None
            if loaded:
                self._engine._subscribers.append(sub)
        if loaded:  # a late subscriber still learns the model's facts (and a pause held), on the engine thread
            self.call(lambda engine: [sub.callback(e) for e in self._arrival_events(engine)])
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._sub_lock:
            if sub in self._subscriptions:
                self._subscriptions.remove(sub)
            if self._engine is not None:
                self._engine.unsubscribe(sub)

    def submit(self, prompt: str | list[int], sampling_params: SamplingParams | None = None, priority: int = 0,
               request_id: str | None = None,
               on_output: Callable[[RequestOutput], None] | None = None, fit_context: bool = False,
               chat: list[dict[str, Any]] | None = None) -> str:
        """Queue a request; returns its id at once (it is added between steps, after loading).

        ``chat``: the conversation ``prompt``'s ids were rendered from with the chat template (the server's
        chat completions), for the teaching views (``LLMEngine.add_request``).

        ``fit_context``: reject (``RequestRejected``) a ``max_tokens`` that does not fit after the
        prompt, as counted by the engine (chat template applied), in ``max_model_len``
        (``LLMEngine.add_request``); ``nanovllm-tui`` sends so.

        ``on_output``: called on the engine thread with each ``RequestOutput`` of this request
        as the engine makes it (cumulative text and token ids after every step that touched
        it), the last one ``finished``; a refusal (``finish_reason="rejected"``, ``error`` set)
        arrives as soon as the request is refused, even while paused. Such a request's final
        output is not kept in ``results`` (the listener had it). It must be quick: hand the
        output to a queue (vLLM's per-request output collector plays this part in its server).

        Raises:
            ValueError: ``priority`` is not an int from -1000 to 1000, or not 0 under the loaded engine's
                ``fcfs`` policy (``LLMEngine.check_priority``; checked here, in the caller's thread; before
                the engine has loaded, the engine refuses it with a ``RequestRejected``).
        """
        if self._engine is not None:
            self._engine.check_priority(priority)
        else:  # its policy is not known yet: the range here, the rest at add_request
            check_priority(priority)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        # its arrival is now, not when the engine thread takes it between steps: TTFT and e2e include the wait
        # for a long step running now, as a client sees it (trial 30c: 7.8 s behind a prefill left out), and
        # the rest of the load for a prompt sent while the model loads (trial 38a: "end to end 82 ms" for a
        # prompt typed 5 s before the model was ready). Before the engine exists its clock would read
        # perf_counter with nothing held paused yet: that reading, taken now.
        arrival = self._engine.clock.reading() if self._engine is not None else (time.perf_counter(), 0.0)
        self._commands.put(_Command("submit", (prompt, sampling_params, priority, rid, on_output, fit_context,
                                                 chat, arrival)))
        return rid

    def pause(self) -> None:
        """Stop stepping after the current step (steps asked for and not yet run are dropped)."""
        self._drop_steps("pause")

    def resume(self) -> None:
        """Run freely again (steps asked for and not yet run are dropped: they were for a paused engine)."""
        self._drop_steps("resume")

    @property
    def pause_asked(self) -> bool:
        """True when the engine is paused once the commands asked so far have applied: the last of
        ``pause()``/``resume()`` called was ``pause`` (or neither was and it started paused). What
        :meth:`step` is accepted under, also while the engine thread has not applied that pause yet."""
        return self._will_pause

    def _drop_steps(self, name: str) -> None:
        with self._steps_lock:
            self._will_pause = name == "pause"
            self._drops += 1
            self._steps_queued = 0
            self._commands.put(_Command(name, (self._drops,)))

    def step(self, n: int = 1) -> None:
        """While paused, run exactly ``n`` engine steps (steps with nothing to do are not counted).

        Steps asked for add up while at most ``MAX_STEPS`` are pending (:meth:`steps_pending`); a
        ``pause`` while paused drops the ones not yet run (the engine stays paused; issue 29, trial 7).
        Steps never wait for work that does not exist: those the engine thread holds when no request
        is running or waiting (none was, or the last one finished or was aborted) are dropped, and the
        pause holds (trial 15b: kept, they ran the next request to its end while the engine said
        "paused"). A ``submit`` sent before the step counts: commands apply in order.

        A step is accepted while the engine is paused or a ``pause`` asked before it has not applied
        yet (it runs once the engine has paused at its step boundary); one asked after a ``resume``
        is refused even while the engine thread has not applied that resume yet (:attr:`pause_asked`).

        Raises:
            ValueError: ``n`` is not a whole number from 1 to ``MAX_STEPS``.
            NotPaused: (a ValueError) the engine runs, or will once the commands asked before have
                applied; none is queued.
            StepsPending: (a ValueError) ``n`` more would leave more than ``MAX_STEPS`` pending; none is queued.
        """
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_STEPS:
            raise ValueError(f"step(n) needs a whole n from 1 to {MAX_STEPS}, got {shown(n)}")
        with self._steps_lock:
            if not self._will_pause:
                raise NotPaused()
            pending = self._pending_locked()
            if pending + n > MAX_STEPS:
                raise StepsPending(n, pending)
            self._steps_queued += n
            self._commands.put(_Command("step", (n, self._drops)))

    def steps_pending(self) -> int:
        """Steps asked for with :meth:`step` that have not run yet and will (not those a pause or
        resume sent since will drop), at most ``MAX_STEPS``."""
        with self._steps_lock:
            return self._pending_locked()

    def _pending_locked(self) -> int:
        allowed = self._steps_allowed if self._drops_applied == self._drops else 0  # else a pause on its way drops them
        return self._steps_queued + allowed

    def abort(self, request_id: str) -> bool:
        """Finish a request with ``finish_reason="abort"`` between steps (at the end of the step in
        progress); its blocks are released (shared ones stay in use).

        Returns True when the abort was queued, False when an abort of ``request_id`` is queued
        already and not yet applied (nothing more is queued; :meth:`abort_pending`).
        """
        with self._aborts_lock:
            if request_id in self._aborts_asked:
                return False
            self._aborts_asked.add(request_id)
        self._commands.put(_Command("abort", (request_id,)))
        return True

    def abort_all(self) -> None:
        """Finish every request the engine holds (waiting, running, preempted; each of an ``n > 1``
        request's samples) with ``finish_reason="abort"`` between steps, whoever submitted it.

        Each gets its ``RequestFinished`` (the last one's ``kv_blocks_used`` counts the blocks left in
        use: 0 when nothing else holds any) and its listener its final output. Commands sent before it
        apply first (a submit queued earlier is added, then aborted). The server calls it at shutdown
        so that every watcher sees each request end, not only the OpenAI clients' (trial 20d: a prompt
        typed in an attached app stayed "running" on a server that had stopped).
        """
        self._commands.put(_Command("abort_all"))

    def abort_pending(self, request_id: str) -> bool:
        """Whether an abort of ``request_id`` was asked and the engine thread has not applied it yet."""
        with self._aborts_lock:
            return request_id in self._aborts_asked

    def xray(self, request_id: str | None, layer: int = 0, head: int = 0) -> None:
        """Choose which request X-Ray traces (None, or a step it is not in: whichever runs first in the step) and the heatmap's layer/head.

        An id the engine does not know (not waiting, running, nor among the lately ended: see
        ``LLMEngine.select_xray``), or a layer or head out of range, is refused with an
        ``EngineError`` (``xray: ...``, ``request_id`` the id asked for); the choice stays as it was."""
        self._commands.put(_Command("xray", (request_id, layer, head)))

    def stats(self) -> dict[str, Any]:
        """``LLMEngine.stats()`` as of the engine's last step boundary: answers at once, never waits for a step.

        The engine thread takes the snapshot after each step and after each batch of commands (and
        before it hands outputs to their listeners, so a client told its request finished reads
        figures that include it). One snapshot is one ``stats()`` call, so its figures agree with
        each other; read mid-step, it is the last step's. ``{}`` until the model has loaded.
        (vLLM's ``/metrics`` likewise reads figures already logged, never the engine mid-step.)
        """
        return self._stats

    def _refresh_stats(self, engine: LLMEngine) -> None:
        """Take a new snapshot for :meth:`stats` (engine thread only; a reader sees the old dict or the new one)."""
        try:
            self._stats = engine.stats()
        except Exception:  # a snapshot must never stop the engine
            traceback.print_exc()

    def call(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run ``fn(engine)`` on the engine thread between steps (for rare reads that must be consistent)."""
        self._commands.put(_Command("call", (fn,)))

    def wait(self, request_id: str, timeout: float | None = None) -> RequestOutput | None:
        """Block until a request has finished (or timeout); returns its output or None."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._results_cond:
            while request_id not in self.results:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not self._thread.is_alive():
                    return self.results.get(request_id)
                self._results_cond.wait(timeout=0.05 if left is None else min(left, 0.05))
            return self.results[request_id]

    def shutdown(self, timeout: float = 1.0) -> bool:
        """Stop the thread (after the step in progress); True if it ended within ``timeout`` seconds."""
        self._stop.set()
        self._commands.put(_Command("wake"))
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ the thread

    def _emit(self, event: ev.Event) -> None:
        with self._sub_lock:
            subs = list(self._subscriptions)
        for sub in subs:
            try:
                sub.callback(event)
            except Exception:  # a broken listener must not stop the engine
                traceback.print_exc()

    def _load(self) -> bool:
        def progress(stage: str, done: int, total: int) -> None:
            self._emit(ev.ModelLoading(stage=stage, done=done, total=total))

        self._emit(ev.ModelLoading(stage="resolving model", done=0, total=1, message=str(self._model or "default")))
        try:
            config = EngineConfig(model=self._model, **self._llm_kwargs)
            engine = LLMEngine.from_config(config, progress=progress)
        except Exception as e:  # ModelLoadError and bad settings: one line, the thread stays up
            self.load_error = str(e) if str(e) else type(e).__name__
            self.load_failure = load_failure(e)
            self._state = "failed"
            self._emit(ev.EngineError(step=None, message=self.load_failure))
            return False
        with self._sub_lock:
            engine._subscribers.extend(self._subscriptions)
            self._engine = engine
        if self._paused:
            engine.clock.stop()
        self._state = "paused" if self._paused else "idle"
        self._refresh_stats(engine)
        for event in self._arrival_events(engine):
            self._emit(event)
        return True

    def _arrival_events(self, engine: LLMEngine) -> list[ev.Event]:
        """What a listener learns first: the model's facts, then, if the engine is held paused (started
        with ``start_paused``), an ``EnginePaused`` dated when the pause began, so the listener's live
        TTFT and TPOT leave the pause out as the engine's clock does."""
        events: list[ev.Event] = [self.ready_event(engine)]
        if self._paused:
            events.append(ev.EnginePaused(step=engine.scheduler.step_index, time=time.time() - engine.clock.held_s()))
        return events

    @staticmethod
    def ready_event(engine: LLMEngine) -> ev.ModelLoading:
        """The final ``ModelLoading`` event, carrying ``engine.model_info()``."""
        return ev.ModelLoading(stage="ready", done=1, total=1, ready=True, model_name=engine.model_name,
                               device=str(engine.device), dtype=str(engine.dtype).replace("torch.", ""),
                               model_info=tuple(sorted(engine.model_info().items())))

    @staticmethod
    def yield_for_frame(seconds: float = yield_gate.MAX_HOLD_S) -> None:
        """A front end is about to draw a key's frame: the engine waits at its next layer or step
        boundary until :meth:`frame_drawn` or ``seconds`` (at most ``yield_gate.MAX_HOLD_S``) pass.

        On a busy CPU host this lets the frame have a core instead of sharing it with the step's
        threads (``yield_gate.py``). The engine's outputs do not change; their times include the wait.
        """
        yield_gate.GATE.hold(seconds)

    @staticmethod
    def frame_drawn() -> None:
        """The frame :meth:`yield_for_frame` was for is on screen: the engine goes on."""
        yield_gate.GATE.release()

    def _run(self) -> None:
        if self._engine is None and not self._load():
            self._serve_failed()
            return
        engine = self._engine
        self._refresh_stats(engine)  # an engine handed in (_engine) has not been read yet
        while not self._stop.is_set():
            busy = engine.has_unfinished_requests() and (not self._paused or self._steps_allowed > 0)
            if self._drain_commands(block=not busy):
                self._refresh_stats(engine)
            if self._stop.is_set():
                break
            if engine.has_unfinished_requests() and (not self._paused or self._steps_allowed > 0):
                self._state = "running" if not self._paused else "paused"
                before = engine.scheduler.step_index
                self._step(engine)
                if self._paused and self._steps_allowed > 0 and engine.scheduler.step_index > before:
                    with self._steps_lock:
                        self._steps_allowed -= 1  # only real scheduler steps count
            elif not self._paused:
                self._state = "idle"
                if self._steps_allowed:
                    with self._steps_lock:
                        self._steps_allowed = 0
            else:
                self._state = "paused"
                if self._steps_allowed and not engine.has_unfinished_requests():
                    with self._steps_lock:  # steps never wait for work that does not exist (trial 15b):
                        self._steps_allowed = 0  # kept, they would run the next request while "paused"
        if self._owns_engine:
            engine.close()  # tensor-parallel workers stop with the thread that loaded them
        self._state = "stopped"

    def _serve_failed(self) -> None:
        """The model did not load: answer commands with errors until shutdown."""
        while not self._stop.is_set():
            try:
                cmd = self._commands.get(timeout=0.1)
            except queue.Empty:
                continue
            if cmd.name == "abort":  # nothing to abort: no longer pending
                with self._aborts_lock:
                    self._aborts_asked.discard(cmd.args[0])
            if cmd.name == "submit":
                rid, listener = cmd.args[3], cmd.args[4]
                reason = f"no model loaded: {self.load_error}"
                self._emit(ev.RequestRejected(request_id=rid, reason=reason))
                if listener is not None:
                    self._notify(listener, _rejected_output(rid, cmd.args[0], reason))
        self._state = "stopped"

    def _drain_commands(self, block: bool) -> bool:
        """Apply the queued commands (waiting up to 50 ms for one if ``block``); True if any applied."""
        try:
            cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: _Command) -> None:
        engine = self._engine
        try:
            if cmd.name == "submit":
                prompt, params, priority, rid, listener, fit_context, chat, arrival = cmd.args
                if listener is not None:
                    if rid in self._listeners:
                        raise ValueError(f"request id {shown(rid)} is already in use")
                    self._listeners[rid] = listener
                engine.add_request(prompt, params, priority, request_id=rid, fit_context=fit_context, chat=chat,
                                   arrival=arrival)
                self._collect(engine.pop_finished_outputs())  # a refusal reaches its listener now
            elif cmd.name == "pause":
                with self._steps_lock:  # also while paused: the steps asked for and not yet run are dropped
                    self._steps_allowed, self._drops_applied = 0, cmd.args[0]
                if not self._paused:
                    self._paused = True
                    self._state = "paused"
                    engine.clock.stop()
                    self._emit(ev.EnginePaused(step=engine.scheduler.step_index))
            elif cmd.name == "resume":
                with self._steps_lock:
                    self._steps_allowed, self._drops_applied = 0, cmd.args[0]
                if self._paused:
                    self._paused = False
                    # before the event: a watcher told "resumed" must not read state "paused"
                    self._state = "running" if engine.has_unfinished_requests() else "idle"
                    engine.clock.start()
                    self._emit(ev.EngineResumed(step=engine.scheduler.step_index))
            elif cmd.name == "step":
                n, drops = cmd.args
                with self._steps_lock:
                    if drops == self._drops:  # asked since the last pause/resume call: no longer queued
                        self._steps_queued -= n
                    if self._paused:  # (step() keeps the total within MAX_STEPS)
                        self._steps_allowed += n
                        n = 0
                if n:  # step() accepts only under a pause asked before it: never dropped without a word
                    self._emit(ev.EngineError(step=None, message=f"step: {n} step(s) not run: the engine was "
                                                                 "running when they arrived; pause first"))
            elif cmd.name == "abort":
                try:
                    if not engine.abort_request(cmd.args[0]):
                        self._emit(ev.EngineError(step=None, request_id=cmd.args[0],
                                                  message=f"abort: no running or waiting request {json.dumps(cmd.args[0])}"))
                    self._collect(engine.pop_finished_outputs())
                finally:  # after its output went out: a later abort of the id is answered as for an ended request
                    with self._aborts_lock:
                        self._aborts_asked.discard(cmd.args[0])
            elif cmd.name == "abort_all":
                for rid in list(engine.requests):
                    engine.abort_request(rid)
                self._collect(engine.pop_finished_outputs())
            elif cmd.name == "xray":
                engine.select_xray(*cmd.args)
            elif cmd.name == "call":
                cmd.args[0](engine)
        except Exception as e:  # e.g. a bad request id or bad params: report, keep serving
            # a refused submit or xray names its request (an xray of an unknown id: select_xray says which)
            named = {"submit": 3, "xray": 0}.get(cmd.name)
            self._emit(ev.EngineError(step=None, message=f"{cmd.name}: {type(e).__name__}: {e}",
                                      request_id=cmd.args[named] if named is not None else None))
            if cmd.name == "submit":
                self._emit(ev.RequestRejected(request_id=cmd.args[3], reason=str(e)))
                rid, listener = cmd.args[3], cmd.args[4]
                if listener is not None:
                    if self._listeners.get(rid) is listener:
                        del self._listeners[rid]
                    self._notify(listener, _rejected_output(rid, cmd.args[0], str(e)))

    def _step(self, engine: LLMEngine) -> None:
        engine.clock.start()  # a single step while paused is engine time; the wait around it is not
        try:
            outputs = engine.step()
        except Exception as e:
            self._emit(ev.EngineError(step=engine.scheduler.step_index, message=f"{type(e).__name__}: {e}",
                                      traceback=traceback.format_exc()))
            outputs = engine.fail_running(f"engine error: {type(e).__name__}: {e}")
        finally:
            if self._paused:
                engine.clock.stop()
        self._collect(outputs)  # (takes the stats snapshot first)

    @staticmethod
    def _notify(listener: Callable[[RequestOutput], None], output: RequestOutput) -> None:
        try:
            listener(output)
        except Exception:  # a broken listener must not stop the engine
            traceback.print_exc()

    def _collect(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their listeners; keep the finished ones nobody listened for in ``results``."""
        if self._engine is not None:  # the snapshot first: a client told "finished" reads figures that count it
            self._refresh_stats(self._engine)
        done = []
        for o in outputs:
            listener = self._listeners.get(o.request_id)
            if listener is None:
                if o.finished:
                    done.append(o)
                continue
            if o.finished:
                del self._listeners[o.request_id]
            self._notify(listener, o)
        if done:
            with self._results_cond:
                for o in done:
                    self.results[o.request_id] = o
                self._results_cond.notify_all()


def _rejected_output(request_id: str, prompt: Any, reason: str) -> RequestOutput:
    """The output of a request refused before the engine took it (as ``LLMEngine`` shapes its own refusals)."""
    return RequestOutput(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None, prompt_token_ids=[],
                         outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="rejected")],
                         finished=True, error=reason)
