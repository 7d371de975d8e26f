"""Float linear layers on the CPU with the weight packed once, when the model loads, for oneDNN.

``nn.functional.linear`` in float32 on the CPU calls MKL's sgemm, which rearranges
("packs") the weight matrix into its blocked layout on every call. oneDNN, which PyTorch
ships as ``mkldnn``, can keep a weight packed, so each call only streams it. Measured on
the 2-core AMD EPYC these benchmarks ran on (one thread, the default model's layer shapes,
weights not in cache): 75 -> 100 GFLOP/s for a 48-token decode batch, 96 -> 110 GFLOP/s
for 512 tokens, and the LM head for 48 rows 47 -> 30 ms.

:class:`FloatLinear` packs its weight when it is built, that is when the loader builds the
model (``nanovllm_core.model.quantization.prepare_linear_layers``), so no step pays for
packing: a first request runs as fast as any later one, and a step's measured speed is the
step's own. The packed copy is rebuilt if the weight changes in place (PyTorch's tensor
version counter), so loading new weights can never serve stale ones. It costs one more copy
of each packed weight in memory (about 540 MB for the default model in float32, `--quantization none`). Anything else
(another device, another dtype, a PyTorch built without oneDNN, or ``ENABLED = False``)
takes the plain ``nn.functional.linear`` path; both compute the same product, rounded
differently in the last bits.
"""

from __future__ import annotations

import torch
from torch import nn

ENABLED = True  # set to False to run PyTorch's default (MKL) path, e.g. to compare
# At most this many tokens take MKL's path even when a packed weight exists: a matrix-vector
# product streams the weight once either way, and MKL's gemv does it with less overhead.
# Measured on a 2-core Intel Xeon (AVX-512), the default model's 121 linear layers in
# sequence, medians of 5: 1 token 36.1 ms MKL against 43.7 ms packed, 2 tokens 41.2 / 45.8,
# 4 tokens 65.5 / 51.1, 8 tokens 81.8 / 55.9.
MKL_MAX_TOKENS = 2


def _ops_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and bool(
            torch.ops.mkldnn._linear_pointwise and torch.ops.mkldnn._reorder_linear_weight)
    except (AttributeError, RuntimeError):
        return False


_AVAILABLE = _ops_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a float32 CPU weight ``[out_features, in_features]`` (the one-time cost)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of ``weight`` ``[out_features, in_features]``, or None where not used.

    Made on first use and kept on the weight tensor (remade when the weight changes in place).
    """
    if not (ENABLED and _AVAILABLE and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2):
        return None
    cached = getattr(weight, "_nanovllm_packed", None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    packed = pack(weight)
    weight._nanovllm_packed = (weight._version, packed)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: x ``[num_tokens, in_features]`` -> ``[num_tokens, out_features]``.

    Same contract as ``nn.functional.linear``; on the CPU in float32 through the packed weight,
    except for at most :data:`MKL_MAX_TOKENS` tokens (the batch-1 decode), which MKL runs faster.
    """
    small = x.dim() == 2 and x.shape[0] <= MKL_MAX_TOKENS
    packed = packed_weight(weight) if x.dtype == torch.float32 and x.dim() == 2 and not small else None
    if packed is None:
        return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class FloatLinear(nn.Module):
    """``y = x W^T + b`` with W in the model's float dtype, packed for oneDNN when built (CPU, float32).

    x ``[num_tokens, in_features]`` -> y ``[num_tokens, out_features]``. ``weight`` may be
    shared with another module (a tied LM head shares the embedding matrix).

    Attributes:
        bytes_per_weight: bytes each weight occupies and every forward pass reads (4 in float32).
        weight_bytes: bytes of weights one forward pass streams from memory (the whole matrix).
    """

    kind = "float"

    def __init__(self, weight: nn.Parameter | torch.Tensor, bias: nn.Parameter | torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = self.weight.shape
        self.kind = str(self.weight.dtype).replace("torch.", "")
        packed_weight(self.weight)  # now, at load: never inside a timed step

    @property
    def bytes_per_weight(self) -> float:
        return float(self.weight.element_size())

    @property
    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, in_features]`` -> ``[num_tokens, out_features]``."""
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"
