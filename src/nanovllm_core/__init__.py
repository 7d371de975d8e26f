"""nanovllm_core: a small, readable vLLM-class inference engine for LLaMA-family models.

``from nanovllm_core import LLM, SamplingParams`` gives the offline API; the names and
semantics follow vLLM's, so the same script runs there with a changed import.

The names below are imported on first use (PEP 562), so a light module such as
``nanovllm_core.events`` can be imported without loading torch: the app shows its window
first and loads torch and the model behind it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "nanovllm_core.llm",
    "SamplingParams": "nanovllm_core.sampling_params",
    "RequestOutput": "nanovllm_core.outputs",
    "CompletionOutput": "nanovllm_core.outputs",
    "RequestMetrics": "nanovllm_core.outputs",
    "EngineConfig": "nanovllm_core.config",
    "ModelLoadError": "nanovllm_core.model.loader",
    "EngineDeadError": "nanovllm_core.engine.llm_engine",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from nanovllm_core.config import EngineConfig
    from nanovllm_core.engine.llm_engine import EngineDeadError
    from nanovllm_core.llm import LLM
    from nanovllm_core.model.loader import ModelLoadError
    from nanovllm_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from nanovllm_core.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nanovllm_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


# The composition root: plug the X-Ray (educational/, above the engine) into the engine's
# observer hook. This file runs before any nanovllm_core module, so every engine finds the
# plug, and engine/ never imports educational/ (engine/observer.py says more). Both imports
# of the X-Ray wait until an engine first asks, so `import nanovllm_core` stays light.
from nanovllm_core.engine import observer as _observer  # noqa: E402  (no torch: the module imports nothing)


def _make_xray(engine: Any, measure: bool) -> Any:
    from nanovllm_core.educational.xray import XRayCapture

    return XRayCapture(engine, measure=measure)


def _xray_facts(engine: Any) -> dict:
    from nanovllm_core.educational.xray import roofline_info

    return roofline_info(engine)


_observer.install(_observer.ObserverPlug(make=_make_xray, facts=_xray_facts))
