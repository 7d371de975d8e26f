"""Linear layers with int8 weights, multiplied by oneDNN's int8 kernels (through PyTorch).

At batch 1 decode reads every weight once per token, so its speed is set by bytes moved:
int8 weights are a quarter of float32's (about 0.3x with the scales and float64 outlier
columns below, on the default model). The scheme is "W8A8" with dynamic per-token
activations, as in SmoothQuant (Xiao et al. 2023) and vLLM's CPU int8 path:

- weights, per output channel: ``W[n, :] ~ qw[n, :] * sw[n]``, ``qw`` in ``[-Q, Q]``, made once at load;
- activations, per row (token), when the layer runs: ``x[t, :] ~ qx[t, :] * sx[t]``, ``qx`` in ``[-127, 127]``;
- oneDNN sums ``qx @ qw.T`` in int32, which is exact, then
  ``y[t, n] = acc[t, n] * sw[n] * sx[t] (+ bias[n])``.

Every scale belongs to one token or one output channel and the integer sum is exact, so a
token's output does not depend on which other tokens share its batch: batching, chunked
prefill, prefix caching and preemption give bit-identical int8 outputs. (Attention, float
arithmetic between these layers, is made batch-invariant separately: see
``nanovllm_core.model.quantization.attention_sum_dtype``.)

Inputs with a few large channels (the RMSNorm outputs that feed q/k/v and gate/up) are
first divided by a per-channel smoothing factor that is multiplied into the weight's columns
(SmoothQuant, section 4): the product is unchanged, the activations quantize with less error.
Then a few input channels per layer, the largest at calibration, skip int8 altogether and
are multiplied in float64 (LLM.int8()'s decomposition, Dettmers et al. 2022, section 3.2):
the rest of a token quantizes against its own largest value, not the outliers'.

Why oneDNN's kernel. Candidates measured on an Intel Xeon with AVX-512 VNNI and AMX (one
thread, thread CPU time, the default model's 30 layers + LM head, each at once, medians of
interleaved rounds, a shared machine at load ~10): speed-up over our packed float32.

====================================================  =====  =====  =====  =====
kernel                                                T=1    T=16   T=64   T=256
====================================================  =====  =====  =====  =====
oneDNN int8, per-token activations (this module)      3.5x   2.6x   5.3x   2.3x
torch.ao dynamic int8 (fbgemm, per-tensor activations) 4.5x   2.1x   4.2x   2.1x
``aten._int_mm`` + per-token scales (torchao's path)   -      -      3.4x   1.3x
``aten._weight_int8pack_mm`` (int8 weight-only)        1.4x   0.28x  0.09x  0.04x
``aten._weight_int4pack_mm_for_cpu`` (int4, g=32)      0.66x  0.08x  -      -
====================================================  =====  =====  =====  =====

torch.ao's dynamic linear quantizes the whole batch with one activation scale, so a
token's result would change with its neighbours (and torch.ao.quantization is deprecated);
torchao 0.18's CPU paths are ``_int_mm`` and, for weight-only, a float matmul of the
dequantized weight. The int4 kernel is slower than float32 here, so there is no int4 mode.

The one choice made by capability: CPUs with AVX2 but without VNNI (e.g. AMD EPYC before
Zen 4) multiply int8 with ``vpmaddubsw``, which saturates when two neighbouring products
add up past 32767; oneDNN then returns wrong sums for full-range weights (checked on this
Xeon with ``ONEDNN_MAX_CPU_ISA=AVX2``: errors of millions; with weights in [-63, 63]: exact).
:func:`weight_range` runs one worst-case product when first needed and uses 7-bit weights
(Q = 63) wherever 8-bit ones would saturate.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def _onednn_int8_available() -> bool:
    try:
        return (torch.backends.mkldnn.is_available() and torch.ops.onednn.qlinear_prepack is not None
                and torch.ops.onednn.qlinear_pointwise is not None)
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_int8_available()
_ONE = torch.tensor(1.0)
_ZERO = torch.tensor(0, dtype=torch.int32)


def _onednn_matmul(qx: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor, w_zero: torch.Tensor) -> torch.Tensor:
    """qx ``[T, K]`` int8 times the packed int8 weight, summed in int32, times ``w_scale`` ``[N]`` -> float32 ``[T, N]``."""
    return torch.ops.onednn.qlinear_pointwise.tensor(qx, _ONE, _ZERO, packed, w_scale, w_zero, None, 1.0, 0,
                                                     torch.float32, "none", [], "")


@functools.cache
def weight_range() -> int:
    """The largest int8 weight magnitude Q this CPU sums exactly: 127, or 63 where oneDNN's int8 saturates.

    Probes one worst case, all-127 activations against all-127 weights (64 of each), against
    its exact sum 64 x 127 x 127; without oneDNN the product is computed in float, and 127.
    """
    if not _ONEDNN:
        return 127
    k = 64
    qw = torch.full((16, k), 127, dtype=torch.int8)
    qx = torch.full((1, k), 127, dtype=torch.int8)
    got = _onednn_matmul(qx, torch.ops.onednn.qlinear_prepack(qw, None), torch.ones(16), torch.zeros(16, dtype=torch.long))
    return 127 if bool((got == k * 127 * 127).all()) else 63


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: x ``[T, K]`` float -> (qx ``[T, K]`` int8, sx ``[T, 1]`` float), ``x ~ qx * sx``.

    Each row's largest magnitude becomes 127; an all-zero row stays zero.
    """
    # abs().amax(): the same exact maximum as vector_norm(x, inf), measured ~7x faster for
    # 256 tokens x 1536 channels on 2 cores of a Xeon (76 us against 534 us).
    scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30).div_(127.0)
    return torch.round(x / scale).to(torch.int8), scale


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with W stored as int8 per output channel; activations quantized per token.

    x ``[num_tokens, in_features]`` (any float dtype) -> y ``[num_tokens, out_features]`` in x's dtype.
    Build with :meth:`from_float`.

    Attributes:
        w_scale: ``[out_features]`` float32, ``W[n, :] ~ qw[n, :] * w_scale[n]``.
        inv_smooth: ``[in_features]`` float32 or None; x is multiplied by it before quantizing
            (and W's columns were divided by it), SmoothQuant's migration of activation outliers.
        outlier_channels: ``[k]`` long or None; input channels multiplied in float64 instead
            of int8 (LLM.int8()'s mixed-precision decomposition, Dettmers et al. 2022, section
            3.2, with the channels fixed at calibration instead of found per batch). A token's
            int8 scale is then set by its ordinary channels, so they keep more precision.
        outlier_weight: ``[out_features, k]`` float64 or None, W's columns for those channels
            (unsmoothed: they multiply the input as it arrives).
        bytes_per_weight: bytes read per weight per forward pass, scales and outlier columns
            included (~1.2 on the default model; ~1.007 without outlier channels).
        weight_bytes: bytes one forward pass streams (int8 weights, scales, outlier columns).
    """

    kind = "int8"

    def __init__(self, qweight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 inv_smooth: torch.Tensor | None, outlier_channels: torch.Tensor | None = None,
                 outlier_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("w_scale", w_scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.register_buffer("inv_smooth", None if inv_smooth is None else inv_smooth.float().contiguous())
        has_outliers = outlier_channels is not None and outlier_channels.numel() > 0
        self.register_buffer("outlier_channels", outlier_channels.long().contiguous() if has_outliers else None)
        # float64: a [T, k] x [k, N] product whose float32 rounding could depend on T (see forward)
        self.register_buffer("outlier_weight", outlier_weight.double().contiguous() if has_outliers else None)
        # What the forward pass runs with: W's outlier columns as [k, out_features], and one
        # vector that both smooths the input and zeroes its outlier channels (one product, not two).
        self._outlier_weight_t = self.outlier_weight.T.contiguous() if has_outliers else None
        in_scale = None
        if has_outliers or inv_smooth is not None:
            in_scale = torch.ones(self.in_features) if inv_smooth is None else self.inv_smooth.clone()
            if has_outliers:
                in_scale[self.outlier_channels] = 0.0
        self._in_scale = in_scale
        if _ONEDNN and qweight.device.type == "cpu":
            self._packed = torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None)
            self._w_zero = torch.zeros(self.out_features, dtype=torch.long)
            self.qweight = None
        else:  # no oneDNN: the same integer product through a float matmul
            self._packed = None
            self.register_buffer("qweight", qweight.contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   smooth: torch.Tensor | None = None, outlier_channels: torch.Tensor | None = None) -> "Int8Linear":
        """Quantize a float weight ``[out_features, in_features]`` per output channel.

        ``smooth`` ``[in_features]`` (> 0): SmoothQuant's factors; the weight's columns are
        multiplied by them before quantizing and the input divided by them when the layer runs.
        ``outlier_channels`` ``[k]`` (long, distinct input channels): kept out of int8 (see
        the class docstring); their weight columns are stored in float64 and left out of the
        int8 weight, so they no longer set any row's weight scale either.

        Raises:
            ValueError: the weight is not 2-D or not on the CPU, or an outlier channel is out of range.
        """
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"int8 weights are built from a 2-D CPU weight; got {list(weight.shape)} on {weight.device}")
        q = weight_range()
        with torch.no_grad():
            w = weight.detach().float()
            if smooth is not None:
                w = w * smooth
            outlier_weight = None
            if outlier_channels is not None and outlier_channels.numel():
                outlier_channels = outlier_channels.long()
                if int(outlier_channels.min()) < 0 or int(outlier_channels.max()) >= w.shape[1]:
                    raise ValueError(f"outlier channels must lie in [0, {w.shape[1]}); got {outlier_channels.tolist()}")
                # unsmoothed: the forward pass multiplies them by the input as it arrives
                outlier_weight = weight.detach()[:, outlier_channels].double()
                w = w.index_fill(1, outlier_channels, 0.0)
            w_scale = torch.linalg.vector_norm(w, float("inf"), dim=1).clamp_(min=1e-12).div_(q)
            qweight = w.div(w_scale[:, None]).round_().clamp_(-q, q).to(torch.int8)
        return cls(qweight, w_scale, bias, None if smooth is None else 1.0 / smooth.float(),
                   outlier_channels, outlier_weight)

    @property
    def bytes_per_weight(self) -> float:
        return self.weight_bytes / (self.out_features * self.in_features)

    @property
    def weight_bytes(self) -> int:
        num_outliers = 0 if self.outlier_channels is None else self.outlier_channels.numel()
        return self.bytes_for(self.out_features, self.in_features, self.inv_smooth is not None, num_outliers)

    @staticmethod
    def bytes_for(out_features: int, in_features: int, smoothed: bool, num_outliers: int) -> int:
        """Bytes such a layer stores and reads per forward pass: int8 weights, a float32 scale
        per output row, a float32 factor per input channel (smoothing, 0 on outlier channels;
        if ``smoothed`` or ``num_outliers``), and per outlier channel its float64 weight column
        and its int64 index."""
        in_scale = 4 * in_features if smoothed or num_outliers else 0  # the input's per-channel factors
        return out_features * in_features + 4 * out_features + in_scale + num_outliers * (8 * out_features + 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, in_features]`` -> ``[num_tokens, out_features]``."""
        xf = x if x.dtype == torch.float32 else x.float()
        outliers = None
        if self.outlier_channels is not None:
            # The outlier channels' share in float64, per token: its rounding back to float32
            # cannot depend on how many tokens share the product (as attention's, see
            # nanovllm_core.model.quantization.attention_sum_dtype).
            outliers = xf.index_select(1, self.outlier_channels).double() @ self._outlier_weight_t
        if self._in_scale is not None:
            xf = xf * self._in_scale  # smoothed, and 0 on the outlier channels
        qx, sx = quantize_rows(xf)
        if self._packed is not None:
            y = _onednn_matmul(qx, self._packed, self.w_scale, self._w_zero)
        else:
            y = torch.nn.functional.linear(qx.float(), self.qweight.float()) * self.w_scale
        # dequantized, plus the outliers' share, in float64: one rounding to float32
        y = y.mul_(sx) if outliers is None else torch.addcmul(outliers, y, sx).float()
        if self.bias is not None:
            y = y.add_(self.bias)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def extra_repr(self) -> str:
        smooth = ", smoothed" if self.inv_smooth is not None else ""
        outliers = "" if self.outlier_channels is None else f", {self.outlier_channels.numel()} float outlier channels"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8{smooth}{outliers}"
