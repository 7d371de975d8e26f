"""The engine's clock: wall time with the time the engine was held paused left out.

A request's TTFT and TPOT should measure the engine, not how long a person kept it paused
between single steps. ``EngineController`` stops this clock while it holds the engine paused
(and runs it during each single step); request metrics read their times from it, so a pause
simply does not exist for them. How long each request spent paused is kept apart
(``RequestMetrics.paused_time``), so the wall time is still known.
"""

from __future__ import annotations

import threading
import time


class EngineClock:
    """A ``time.perf_counter`` that stands still while :meth:`stop`-ped.

    ``now()``: seconds on the engine's clock (perf_counter less every paused interval so far,
    the current one included); ``paused_s()``: seconds held paused so far, the current interval included.
    """

    def __init__(self) -> None:
        self._paused_total = 0.0
        self._stopped_at: float | None = None
        self._lock = threading.Lock()  # reading() may run on another thread (a server's, at a request's arrival)

    @property
    def stopped(self) -> bool:
        return self._stopped_at is not None

    def stop(self) -> None:
        """The engine is held paused from now (no effect if already stopped)."""
        with self._lock:
            if self._stopped_at is None:
                self._stopped_at = time.perf_counter()

    def start(self) -> None:
        """The engine runs again (no effect if running); the paused interval is added to ``paused_s``."""
        with self._lock:
            if self._stopped_at is not None:
                self._paused_total += time.perf_counter() - self._stopped_at
                self._stopped_at = None

    def held_s(self) -> float:
        """Seconds the current pause has lasted (0.0 while running)."""
        return 0.0 if self._stopped_at is None else time.perf_counter() - self._stopped_at

    def paused_s(self) -> float:
        current = 0.0 if self._stopped_at is None else time.perf_counter() - self._stopped_at
        return self._paused_total + current

    def now(self) -> float:
        if self._stopped_at is not None:
            return self._stopped_at - self._paused_total
        return time.perf_counter() - self._paused_total

    def reading(self) -> tuple[float, float]:
        """``(now(), paused_s())`` read together, safe from any thread: a request's arrival as the
        front end receives it (``EngineController.submit``), before the engine thread adds it."""
        with self._lock:
            return self.now(), self.paused_s()
