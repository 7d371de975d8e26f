"""A gate an interactive front end holds for a moment to take the CPU from the engine's step.

On a CPU host the engine's step uses every core it is given (OpenMP threads in the decoder
layers), and a full-screen app drawing a new tab needs one core for a few tens of ms. Beside
other busy processes the two share the cores fairly, so a key press waits for the step's
threads as much as it runs. While the gate is held, the engine waits between decoder layers
(and between steps) instead: a key's frame gets the CPU within about one layer's time (~1-10
ms), and the engine goes on when the frame is drawn or the hold's deadline passes, whichever
comes first. Nothing is skipped or reordered: the step computes the same bits, later.

The time the engine spent waiting is counted (:attr:`YieldGate.waited_s`): it is part of the
TTFT and TPOT the engine measures (a person's key presses delayed those tokens), and the
app says how much of it there was.

The gate is a ``ctypes`` structure so that the C decoder layers (``decoder_layers`` in
``model/block_quant_cpu.c``) read the same memory as Python, without the GIL:

    until_ns   int64   CLOCK_MONOTONIC deadline of the hold in ns (time.monotonic_ns); 0 = open
    waited_ns  int64   ns the engine has waited at the gate, in total (written by the engine thread at
                       each poll while it waits, so a closed gate shows a parked engine)

A process has one gate, :data:`GATE`: one engine thread reads it, one front end holds it.
This module imports no torch (the app imports it before the engine is loaded).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

MAX_HOLD_S = 0.25  # the longest one hold may stop the engine, whatever the front end does
_POLL_S = 0.0005   # how often a waiting engine looks at the gate again (the C side polls as often)


class _GateStruct(ctypes.Structure):
    _fields_ = [("until_ns", ctypes.c_int64), ("waited_ns", ctypes.c_int64)]


class YieldGate:
    """Hold (front end) and wait (engine) on one deadline; see the module docstring."""

    def __init__(self) -> None:
        self.c = _GateStruct(0, 0)

    @property
    def address(self) -> int:
        """The structure's address, for the C decoder layers."""
        return ctypes.addressof(self.c)

    @property
    def held(self) -> bool:
        """True while a hold's deadline lies ahead."""
        until = self.c.until_ns
        return bool(until) and time.monotonic_ns() < until

    @property
    def waited_s(self) -> float:
        """Seconds the engine has waited at this gate since the process started."""
        return self.c.waited_ns / 1e9

    def hold(self, seconds: float = MAX_HOLD_S) -> None:
        """Ask the engine to wait at its next layer or step boundary for at most ``seconds`` (capped at MAX_HOLD_S).

        Raises:
            ValueError: ``seconds`` is negative.
        """
        if seconds < 0:
            raise ValueError(f"a hold lasts 0 s or more, got {seconds}")
        self.c.until_ns = time.monotonic_ns() + int(min(seconds, MAX_HOLD_S) * 1e9)

    def release(self) -> None:
        """Let the engine go on now (its wait ends within one poll, 0.5 ms)."""
        self.c.until_ns = 0

    def wait(self) -> float:
        """Engine side, from Python: sleep while the gate is held. Returns the seconds waited (0.0 when open)."""
        until = self.c.until_ns
        if not until:
            return 0.0
        start = now = time.monotonic_ns()
        while now < until:
            time.sleep(min(_POLL_S, (until - now) / 1e9))
            later = time.monotonic_ns()
            self.c.waited_ns += later - now  # as it goes: a gate closed for good sees its engine waiting
            now = later
            until = self.c.until_ns
            if not until:
                break
        return (now - start) / 1e9

    def close(self) -> None:
        """The process is ending: hold the gate for good, so an engine thread still inside a step
        stops at its next layer (or step) boundary and waits there, off the CPU and out of every
        native thread pool, until the process ends. Never reopened: call it only on the way out
        (:func:`leave_when_engines_stop`); the step is abandoned, not finished."""
        self.c.until_ns = 2**63 - 1

    def parked(self, seconds: float = 0.02) -> bool:
        """After :meth:`close`: True when an engine thread waits at the gate (its waited time grew
        over ``seconds``)."""
        before = self.c.waited_ns
        time.sleep(seconds)
        return self.c.waited_ns > before


GATE = YieldGate()


ENGINE_THREADS = ("nanovllm-engine",)  # threads that run native code (torch, OpenMP, the C kernels)


def leave_when_engines_stop(status: int, seconds: float, ignore: frozenset = frozenset()) -> None:
    """On the way out of a front end (the app, ``nanovllm serve``), after it stopped its engines:
    stop engine threads still inside a step at their next layer boundary (:meth:`YieldGate.close`),
    wait up to ``seconds`` for each to stop there or end, and if one is still alive then (inside a
    step, or still loading the model), end the process with ``os._exit(status)``.

    The interpreter's normal teardown would destroy native thread pools under a thread still using
    them: "terminate called without an active exception", status 134 (the app on quit in issue 29's
    trial; ``nanovllm serve`` given SIGTERM while loading, trial 12). The caller has restored the
    terminal and closed its files by now, so skipping the teardown loses nothing. Returns normally
    when no engine thread is left. ``ignore``: threads that were there before (a test process's own).
    """
    busy = [t for t in threading.enumerate() if t.name in ENGINE_THREADS and t.is_alive() and t not in ignore]
    if busy:
        GATE.close()
        deadline = time.monotonic() + seconds
        while any(t.is_alive() for t in busy) and time.monotonic() < deadline:
            if GATE.parked():
                break
    if any(t.is_alive() for t in busy):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(status)
