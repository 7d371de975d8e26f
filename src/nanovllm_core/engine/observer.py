"""The engine's observer hook: how code above the engine watches the layers of a step.

The engine runs the model; it does not know what a teaching view wants to see. When some
subscriber asks for layer traces (``LLMEngine.subscribe(..., xray=True)``), the engine makes
one *observer* with the installed :class:`ObserverPlug`; before each step's forward pass it
asks that observer for a :class:`~nanovllm_core.model.tracer.LayerTracer` (or None) and
hands it to the model, which calls it with each layer's tensors.

The X-Ray capture (``nanovllm_core.educational.xray.XRayCapture``) is the observer the
package installs, from ``nanovllm_core/__init__.py``: that file runs before any
``nanovllm_core.*`` module, so the plug is always in place, and ``engine/`` never imports
``educational/`` (the layers contract in pyproject.toml checks it). Another observer (a
profiler, a test double) can be installed with :func:`install`.

This module imports nothing at run time, so the package's ``__init__`` can install a plug
without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from nanovllm_core.model.tracer import LayerTracer


class StepObserver(Protocol):
    """What the engine asks of an installed observer (all calls on the engine's thread)."""

    def tracer_for(self, plan: Any) -> "LayerTracer | None":
        """A tracer for the step ``plan`` (a ``SchedulerOutput``) is about to run, or None to skip it.

        Called inside the step: it must be cheap (no measuring here)."""

    def select(self, request_id: str | None, layer: int = 0, head: int = 0, every_layer: bool = False) -> None:
        """Choose what to trace (None: the first request of each step); ``layer``/``head`` for detail views;
        only ``layer``'s hooks are wanted unless ``every_layer`` (the tracer's ``layers`` says which).

        Raises:
            ValueError: layer or head out of range.
        """

    def prepare(self) -> None:
        """One-time slow work (the X-Ray measures the machine's roofline), called between steps."""


@dataclass(frozen=True)
class ObserverPlug:
    """What code above the engine installs.

    ``make(engine, prepare)``: a new :class:`StepObserver` for ``engine``; ``prepare`` True asks
    it to do its slow one-time work now (the engine passes False when inside a step).
    ``facts(engine)``: extra entries for ``LLMEngine.model_info()`` (the X-Ray adds the machine's
    roofline when it was measured before); must not measure anything.
    """

    make: Callable[[Any, bool], StepObserver]
    facts: Callable[[Any], dict] = lambda engine: {}


_installed: ObserverPlug | None = None


def install(plug: ObserverPlug | None) -> ObserverPlug | None:
    """Make ``plug`` the observer every engine builds from now on (None: none); returns the previous one.

    Engines that already made their observer keep it.
    """
    global _installed
    previous, _installed = _installed, plug
    return previous


def installed() -> ObserverPlug | None:
    """The plug :func:`install` put in place, or None."""
    return _installed
