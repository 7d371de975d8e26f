"""nanovllm_core: a small, readable vLLM-class inference engine for LLaMA-family models.

``from nanovllm_core import LLM, SamplingParams`` gives the offline API; the names and
semantics follow vLLM's, so the same script runs there with a changed import.
"""

from nanovllm_core.config import EngineConfig
from nanovllm_core.llm import LLM
from nanovllm_core.model.loader import ModelLoadError
from nanovllm_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm_core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "EngineConfig",
           "ModelLoadError"]
__version__ = "0.1.0"
