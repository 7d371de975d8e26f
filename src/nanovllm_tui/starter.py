"""Starting the engine behind the window: ``BackgroundController``.

Importing torch and building an ``EngineController`` takes seconds on a small machine, and the
window should not wait for it. ``BackgroundController`` has the controller's interface at
once and builds the real one on a thread of its own; commands given meanwhile (subscribe,
submit, pause, ...) are kept in order and handed to it the moment it exists. Once built it
only forwards, and the real controller loads the model (with its own loading events).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

from nanovllm_core import events as ev


class ForwardingSubscription:
    """The subscription handed out before the real one exists; later changes of ``topk``,
    ``xray`` and ``blocks`` reach the real subscription too."""

    _FLAGS = ("topk", "xray", "blocks")

    def __init__(self, callback: Callable[[ev.Event], None], topk: int, xray: bool, blocks: bool) -> None:
        object.__setattr__(self, "real", None)
        self.callback, self.topk, self.xray, self.blocks = callback, topk, xray, blocks

    def attach(self, real: Any) -> None:
        object.__setattr__(self, "real", real)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in self._FLAGS and self.real is not None:
            setattr(self.real, name, value)


class BackgroundController:
    """An ``EngineController`` (from ``factory``) built on a thread from :meth:`start`, usable at once.

    Raises nothing itself: a factory that fails is reported as a failed model load
    (``state == "failed"``, ``load_error``, and an ``EngineError`` to subscribers).

    ``start_paused``: the factory's controller starts paused (``--paused``), known before it is built,
    so the loading header can say so from its first frame (trial 11).
    """

    live = True

    def __init__(self, factory: Callable[[], Any], start_paused: bool = False) -> None:
        self._factory = factory
        self.start_paused = start_paused
        self._lock = threading.Lock()
        self._real: Any = None
        self._pending: list[Callable[[Any], Any]] = []
        self._subs: list[ForwardingSubscription] = []
        self._stop = False
        self._ids = itertools.count()
        self._error: str | None = None
        self._failure: str | None = None
        self._pending_ids: list[str] = []  # the ids of the submits in _pending (rejected if the build fails)
        self._thread = threading.Thread(target=self._build, name="nanovllm-starter", daemon=True)

    def start(self) -> None:
        """Begin building the engine (the app calls it once its window is on screen: importing
        torch on another thread still competes with the first paint for the interpreter)."""
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    def _build(self) -> None:
        try:
            real = self._factory()
        except Exception as e:  # an engine that cannot even be built: report it like a failed load
            from nanovllm_core.engine.controller import load_failure  # torch is loaded (or failed) by now

            failure, error = load_failure(e), str(e) or type(e).__name__
            with self._lock:  # "failed" from here on: a submit now is rejected at once (submit's own check)
                self._failure, self._error = failure, error
                subs, waited = list(self._subs), self._pending_ids
                self._pending, self._pending_ids = [], []
            for sub in subs:
                sub.callback(ev.EngineError(step=None, message=failure))
                for rid in waited:  # prompts sent while it loaded: rejected, never silently dropped
                    sub.callback(ev.RequestRejected(request_id=rid, reason=f"no model loaded: {error}"))
            return
        with self._lock:  # hand over what waited, in order, before anything new can run
            self._real = real
            for command in self._pending:
                command(real)
            self._pending, self._pending_ids = [], []
            stop = self._stop
        if stop:
            real.shutdown(timeout=1.0)

    def _do(self, command: Callable[[Any], Any], request_id: str | None = None) -> bool:
        """Run ``command`` on the engine controller, or queue it until it is built (``request_id``: the
        submit's, rejected if the build fails). False: the build has failed and nothing was done."""
        with self._lock:
            if self._error is not None:
                return False
            if self._real is None:
                self._pending.append(command)
                if request_id is not None:
                    self._pending_ids.append(request_id)
                return True
            real = self._real
        command(real)
        return True

    # ------------------------------------------------------------------ EngineController's interface

    @property
    def real(self) -> Any:
        """The ``EngineController`` once built, else None."""
        return self._real

    @property
    def state(self) -> str:
        if self._real is not None:
            return self._real.state
        return "failed" if self._error is not None else "loading"

    @property
    def load_error(self) -> str | None:
        return self._real.load_error if self._real is not None else self._error

    @property
    def load_failure(self) -> str | None:
        """``load_error`` with its kind in front (``nanovllm_core.engine.controller.load_failure``)."""
        return getattr(self._real, "load_failure", None) if self._real is not None else self._failure

    @property
    def engine(self) -> Any:
        return self._real.engine if self._real is not None else None

    @property
    def results(self) -> dict:
        return self._real.results if self._real is not None else {}

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() or (self._real is not None and self._real.is_alive)

    def subscribe(self, callback: Callable[[ev.Event], None], topk: int = 5, xray: bool = False,
                  blocks: bool = True) -> ForwardingSubscription:
        sub = ForwardingSubscription(callback, topk, xray, blocks)
        with self._lock:
            self._subs.append(sub)
        self._do(lambda c: sub.attach(c.subscribe(callback, topk=sub.topk, xray=sub.xray, blocks=sub.blocks)))
        return sub

    def submit(self, prompt: Any, sampling_params: Any = None, priority: int = 0,
               request_id: str | None = None, fit_context: bool = False) -> str:
        """Queue a request; its id is known at once (``req-N``), before the engine exists.
        ``fit_context``: as ``EngineController.submit``'s."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not self._do(lambda c: c.submit(prompt, sampling_params, priority, request_id=rid, fit_context=fit_context),
                        request_id=rid):
            for sub in list(self._subs):
                sub.callback(ev.RequestRejected(request_id=rid, reason=f"no model loaded: {self._error}"))
        return rid

    def yield_for_frame(self) -> None:
        """EngineController.yield_for_frame once the engine exists (nothing to hold before)."""
        if self._real is not None:
            self._real.yield_for_frame()

    def frame_drawn(self) -> None:
        if self._real is not None:
            self._real.frame_drawn()

    def pause(self) -> None:
        self._do(lambda c: c.pause())

    def resume(self) -> None:
        self._do(lambda c: c.resume())

    def step(self, n: int = 1) -> None:
        """``EngineController.step``; a refusal (``StepsPending``: as many steps are pending as may be)
        reaches the subscribers as an ``EngineError`` "step: ...", as a server's refusal does under
        ``--connect``, also when the step waited for the engine to be built."""
        if n < 1:
            raise ValueError(f"step(n) needs n >= 1, got {n}")

        def step(c: Any) -> None:
            try:
                c.step(n)
            except ValueError as e:
                # (no self._lock: _build runs the steps that waited with it held; copying the list is atomic)
                for sub in list(self._subs):
                    sub.callback(ev.EngineError(step=None, message=f"step: {e}"))

        self._do(step)

    def abort(self, request_id: str) -> None:
        self._do(lambda c: c.abort(request_id))

    def xray(self, request_id: str | None, layer: int = 0, head: int = 0) -> None:
        self._do(lambda c: c.xray(request_id, layer, head))

    def call(self, fn: Callable[[Any], Any]) -> None:
        self._do(lambda c: c.call(fn))

    def shutdown(self, timeout: float = 1.0) -> bool:
        """Stop the engine thread; if it is still being built, it is stopped as soon as it is."""
        with self._lock:
            self._stop = True
            real = self._real
        if real is not None:
            return real.shutdown(timeout)
        if self._thread.ident is None:  # never started
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive() and (self._real is None or not self._real.is_alive)
