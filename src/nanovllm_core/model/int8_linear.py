"""Linear layers with int8 weights, multiplied by oneDNN's int8 kernels (through PyTorch).

At batch 1 decode reads every weight once per token, so its speed is set by bytes moved:
int8 weights are a quarter of float32's (about 0.28x with the scales and outlier columns
below, on the default model). The scheme is "W8A8" with dynamic per-token
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
Then a few input channels per layer, the largest at calibration, skip int8 and take a finer
integer grid of their own (LLM.int8()'s decomposition, Dettmers et al. 2022, section 3.2):
the rest of a token quantizes against its own largest value, not the outliers'. The outliers'
product is exact too, so it stays batch-invariant (see :class:`Int8Linear`).

The float work around the matmul (quantizing each token, its outlier channels, scaling
the result and adding the outliers' product) runs in ``int8_cpu.c``, two calls per layer
instead of about twenty PyTorch ops whose dispatch cost more than the int8 matmul at batch
1 (140 us against 87 us per 960x576 layer for one token, 2-core Xeon). It does the same IEEE
float32 operations in the same order, so its output is bit-identical to the PyTorch ops,
which remain where no C compiler is found or ``NANOVLLM_INT8_NATIVE=0``.

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

For a single token (batch-1 decode) the product goes to fbgemm's matrix-vector path instead,
fed our per-token integers, which returns the same bits without oneDNN's fixed cost per call
(see :func:`_fbgemm_gemv_choice`).

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

Why past ~400 lines: one module (Int8Linear) with the library paths it chooses between
(oneDNN, fbgemm, the C helpers) and the measurements behind each choice.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from nanovllm_core import native


def _onednn_int8_available() -> bool:
    try:
        return (torch.backends.mkldnn.is_available() and torch.ops.onednn.qlinear_prepack is not None
                and torch.ops.onednn.qlinear_pointwise is not None)
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_int8_available()
# The outlier channels' integer grid: activations in [-OUTLIER_ACT_LEVELS, OUTLIER_ACT_LEVELS]
# per token (12 bits), weights in [-B, B] per channel with B from outlier_weight_levels.
OUTLIER_ACT_LEVELS = 2047
FLOAT32_EXACT_INT = 2**24  # every integer of magnitude up to this is a float32
_ONE = torch.tensor(1.0)
_ZERO = torch.tensor(0, dtype=torch.int32)
NATIVE_SOURCE = Path(__file__).with_name("int8_cpu.c")
NATIVE_ENV_SWITCH = "NANOVLLM_INT8_NATIVE"  # "0": quantize and scale with PyTorch ops instead (bit-identical)
_p, _i64, _f32, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
NATIVE_SIGNATURES = {
    "int8_quantize_rows": (None, [_p, _i64, _i64, _p, _f32, _p, _p, _p, _p, _i64, _p, _f32, _p, _p, _i32]),
    "int8_epilogue": (ctypes.c_int, [_p, _i64, _i64, _p, _p, _p, _i64, _p, _p, _i32]),
}


def native_helpers() -> ctypes.CDLL | None:
    """``int8_cpu.c`` (the quantization and epilogue around the int8 matmul, one call each), or None
    where it cannot be built or ``NANOVLLM_INT8_NATIVE=0``; then PyTorch ops compute the same bits."""
    return native.load_unless_off(NATIVE_SOURCE, NATIVE_SIGNATURES, NATIVE_ENV_SWITCH)[0]


def native_unavailable_reason() -> str | None:
    """Why :func:`native_helpers` returns None (switched off, no compiler, failed build), or None when it loads."""
    return native.load_unless_off(NATIVE_SOURCE, NATIVE_SIGNATURES, NATIVE_ENV_SWITCH)[1]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


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


GEMV_ENV_SWITCH = "NANOVLLM_INT8_GEMV"  # "0": oneDNN for single tokens too


def _fbgemm_pack(qweight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """int8 ``[N, K]`` and its per-row scales ``[N]`` -> fbgemm's packed weight (bias None)."""
    with warnings.catch_warnings():  # PyTorch marks its quantized tensor types deprecated
        warnings.simplefilter("ignore", UserWarning)
        qt = torch._make_per_channel_quantized_tensor(qweight.contiguous(), w_scale.double(),
                                                      torch.zeros(qweight.shape[0], dtype=torch.long), 0)
    with _fbgemm_engine():
        return torch.ops.quantized.linear_prepack(qt, None)


class _fbgemm_engine:
    """Select PyTorch's fbgemm quantized engine for the block, restoring the previous one."""

    def __enter__(self) -> None:
        self.previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"

    def __exit__(self, *exc) -> None:
        torch.backends.quantized.engine = self.previous


def _fbgemm_matmul(qx_float: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """qx ``[T, K]`` (int8 values held as float32) times fbgemm's packed int8 weight, summed in int32,
    times the weight scales -> float32 ``[T, N]``. fbgemm takes unsigned activations: with scale 1 and
    zero point 128 it quantizes ``qx`` to ``qx + 128`` exactly and subtracts the 128s' share again."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(qx_float, 1.0, 128, packed)


@functools.cache
def _fbgemm_gemv_choice() -> tuple[bool, str]:
    """(use fbgemm for single-token calls, why), decided once per process.

    At one token (batch-1 decode) oneDNN's int8 matmul spends about 25 us per call before it
    reads a weight; fbgemm's matrix-vector path does not (2-core Xeon, the default model's 120
    layers with cold caches: 4.5 ms against 7.0 ms; from 2 tokens on the two are equal and from
    16 on oneDNN is far faster). fbgemm is used only where it returns the very bits oneDNN
    returns (checked here on worst-case and random integers: both sums are exact, and both scale
    them with one float32 product by ``w_scale``), so a token's output stays the same alone or
    batched, and only where it is measured faster on this CPU. fbgemm is reached through PyTorch's
    quantized tensors, which PyTorch marks deprecated: where a later PyTorch drops them, the check
    fails and oneDNN takes every call. The cost is memory: each layer keeps its int8 weight
    packed for both kernels (each call reads one).
    """
    try:
        if not _ONEDNN or "fbgemm" not in torch.backends.quantized.supported_engines:
            return False, "fbgemm or oneDNN is not in this PyTorch build"
        q = weight_range()
        gen = torch.Generator().manual_seed(0)
        n, k = 1536, 576
        qw = torch.randint(-q, q + 1, (n, k), dtype=torch.int8, generator=gen)
        qw[:16] = q
        qw[16:32] = -q
        w_scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
        onednn_packed = torch.ops.onednn.qlinear_prepack(qw, None)
        fbgemm_packed = _fbgemm_pack(qw, w_scale)
        w_zero = torch.zeros(n, dtype=torch.long)
        probes = [torch.full((1, k), 127, dtype=torch.int8), torch.full((1, k), -127, dtype=torch.int8),
                  torch.randint(-127, 128, (1, k), dtype=torch.int8, generator=gen)]
        for qx in probes:
            if not torch.equal(_onednn_matmul(qx, onednn_packed, w_scale, w_zero),
                               _fbgemm_matmul(qx.float(), fbgemm_packed)):
                return False, "fbgemm's sums differ from oneDNN's on this CPU"
        qx = probes[2]
        qxf = qx.float()
        times = {"onednn": [], "fbgemm": []}
        for _ in range(5):
            for name, call in (("onednn", lambda: _onednn_matmul(qx, onednn_packed, w_scale, w_zero)),
                               ("fbgemm", lambda: _fbgemm_matmul(qxf, fbgemm_packed))):
                start = time.perf_counter()
                for _ in range(20):
                    call()
                times[name].append(time.perf_counter() - start)
        if min(times["fbgemm"]) >= min(times["onednn"]):
            return False, "fbgemm was not faster than oneDNN for one token on this CPU"
        return True, "fbgemm: bit-identical to oneDNN and faster for one token here"
    except (RuntimeError, AttributeError) as e:
        return False, f"fbgemm failed: {e}"


def fbgemm_gemv() -> bool:
    """True where single-token int8 products run through fbgemm (see :func:`_fbgemm_gemv_choice`);
    ``NANOVLLM_INT8_GEMV=0`` sends them to oneDNN (read at each call, so a test can switch it)."""
    return os.environ.get(GEMV_ENV_SWITCH, "1") != "0" and _fbgemm_gemv_choice()[0]


def outlier_weight_levels(num_outliers: int) -> int:
    """The largest outlier weight magnitude B with which a float32 product of ``num_outliers``
    channels stays exact: ``num_outliers * OUTLIER_ACT_LEVELS * B < 2**24`` (at most 2047).

    Every partial sum of such a product is then an integer below 2**24, which float32 holds
    exactly, so the sum is the same in any order, any blocking and with or without FMA.
    """
    return max(1, min(2047, (FLOAT32_EXACT_INT - 1) // (max(1, num_outliers) * OUTLIER_ACT_LEVELS)))


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
        outlier_channels: ``[k]`` long or None; input channels kept out of int8 (LLM.int8()'s
            mixed-precision decomposition, Dettmers et al. 2022, section 3.2, with the channels
            fixed at calibration instead of found per batch). A token's int8 scale is then set
            by its ordinary channels, so they keep more precision.
        outlier_qweight: ``[out_features, k]`` float32 holding integers in ``[-B, B]``
            (:func:`outlier_weight_levels`), W's columns for those channels, unsmoothed, each
            column over its own scale ``outlier_col_scale`` ``[k]`` float32.
        bytes_per_weight: bytes read per weight per forward pass, scales and outlier columns
            included (~1.1 on the default model; ~1.007 without outlier channels).
        weight_bytes: bytes one forward pass streams (int8 weights, scales, outlier columns).

    The outliers' share is ``z * so`` with ``z = qo @ outlier_qweight.T``, where ``qo`` ``[T, k]``
    are the token's outlier inputs times ``outlier_col_scale``, rounded to integers in
    [-2047, 2047] over a per-token scale ``so`` ``[T, 1]``. The product is computed in float32
    and is exact (its sums are integers below 2**24), so, like the int8 part, it does not
    depend on the batch; the result is ``y = (acc * sw) * sx + (z * so)``, each step one
    correctly rounded float32 operation per element. (Measured on a 2-core Xeon, 256 tokens
    through the default model's 120 layers: 42 ms for this against 235 ms for the same share
    in float64, which this replaced.)
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
        qo_weight, col_scale = (self.quantize_outlier_columns(outlier_weight.detach().float()) if has_outliers
                                else (None, None))
        self.register_buffer("outlier_qweight", qo_weight)
        self.register_buffer("outlier_col_scale", col_scale)
        # What the forward pass runs with: the outlier columns as [k, out_features], and one
        # vector that both smooths the input and zeroes its outlier channels (one product, not two).
        self._outlier_qweight_t = qo_weight.T.contiguous() if has_outliers else None
        in_scale = None
        if has_outliers or inv_smooth is not None:
            in_scale = torch.ones(self.in_features) if inv_smooth is None else self.inv_smooth.clone()
            if has_outliers:
                in_scale[self.outlier_channels] = 0.0
        self._in_scale = in_scale
        if _ONEDNN and qweight.device.type == "cpu":
            self._packed = torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None)
            # (not made with NANOVLLM_INT8_GEMV=0 at build time: no second copy of the weights then)
            self._fbgemm_packed = _fbgemm_pack(qweight, self.w_scale) if fbgemm_gemv() else None
            self._w_zero = torch.zeros(self.out_features, dtype=torch.long)
            self.qweight = None
        else:  # no oneDNN: the same integer product through a float matmul
            self._packed = self._fbgemm_packed = None
            self.register_buffer("qweight", qweight.contiguous())

    @staticmethod
    def quantize_outlier_columns(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """W's outlier columns ``[out_features, k]`` float -> (integers in [-B, B] as float32
        ``[out_features, k]``, per-column scales ``[k]`` float32), ``weight ~ q * scale``."""
        levels = outlier_weight_levels(weight.shape[1])
        col_scale = weight.abs().amax(dim=0).clamp_(min=1e-30).div_(levels)
        return weight.div(col_scale).round_().clamp_(-levels, levels), col_scale

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   smooth: torch.Tensor | None = None, outlier_channels: torch.Tensor | None = None) -> "Int8Linear":
        """Quantize a float weight ``[out_features, in_features]`` per output channel.

        ``smooth`` ``[in_features]`` (> 0): SmoothQuant's factors; the weight's columns are
        multiplied by them before quantizing and the input divided by them when the layer runs.
        ``outlier_channels`` ``[k]`` (long, distinct input channels): kept out of int8 (see
        the class docstring); their weight columns are left out of the int8 weight, so they no
        longer set any row's weight scale either, and kept on a finer integer grid of their own.

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
                outlier_weight = weight.detach()[:, outlier_channels].float()
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
        if ``smoothed`` or ``num_outliers``), and per outlier channel its weight column (float32
        integers), its float32 scale and its int64 index."""
        in_scale = 4 * in_features if smoothed or num_outliers else 0  # the input's per-channel factors
        return out_features * in_features + 4 * out_features + in_scale + num_outliers * (4 * out_features + 4 + 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, in_features]`` -> ``[num_tokens, out_features]``.

        Raises:
            ValueError: x's last dimension is not ``in_features``.
        """
        if x.shape[-1] != self.in_features:
            raise ValueError(f"int8 linear layer takes {self.in_features} input features; got {list(x.shape)}")
        xf = x if x.dtype == torch.float32 else x.float()
        lib = native_helpers() if self._packed is not None and x.dim() == 2 else None
        if lib is not None:
            return self._forward_native(lib, xf.contiguous(), x.dtype)
        outliers = None
        if self.outlier_channels is not None:
            # The outlier channels' share, exact per token (class docstring): every op below is
            # per element or an integer sum, so a token's result ignores the rest of its batch.
            xo = xf.index_select(1, self.outlier_channels).mul_(self.outlier_col_scale)
            so = xo.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30).div_(OUTLIER_ACT_LEVELS)
            outliers = torch.mm(torch.round(xo.div_(so)), self._outlier_qweight_t).mul_(so)
        if self._in_scale is not None:
            xf = xf * self._in_scale  # smoothed, and 0 on the outlier channels
        qx, sx = quantize_rows(xf)
        if self._packed is not None:
            y = self._int8_matmul(qx)
        else:
            y = torch.nn.functional.linear(qx.float(), self.qweight.float()) * self.w_scale
        y = y.mul_(sx)
        if outliers is not None:
            y = y.add_(outliers)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _forward_native(self, lib: ctypes.CDLL, xf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`forward` with the float work in ``int8_cpu.c``: one call quantizes each token (and
        its outlier channels), oneDNN multiplies, one call scales and adds the outliers and bias.
        Bit-identical to the PyTorch ops (tests/test_quantization.py checks it)."""
        t, k_in = xf.shape
        threads = torch.get_num_threads()
        # one token through fbgemm: the integers are written as the floats it takes (same values)
        fbgemm = t == 1 and self._fbgemm_packed is not None and fbgemm_gemv()
        qx = torch.empty((t, k_in), dtype=torch.float32 if fbgemm else torch.int8)
        sx = torch.empty(t, dtype=torch.float32)
        k = 0 if self.outlier_channels is None else self.outlier_channels.numel()
        xo = torch.empty((t, k), dtype=torch.float32) if k else None
        so = torch.empty(t, dtype=torch.float32) if k else None
        lib.int8_quantize_rows(xf.data_ptr(), t, k_in, _ptr(self._in_scale), 127.0, None if fbgemm else qx.data_ptr(),
                               qx.data_ptr() if fbgemm else None, sx.data_ptr(),
                               _ptr(self.outlier_channels), k, _ptr(self.outlier_col_scale), float(OUTLIER_ACT_LEVELS),
                               _ptr(xo), _ptr(so), threads)
        y = (_fbgemm_matmul(qx, self._fbgemm_packed) if fbgemm else self._int8_matmul(qx)).contiguous()
        if lib.int8_epilogue(y.data_ptr(), t, self.out_features, sx.data_ptr(), _ptr(xo), _ptr(self._outlier_qweight_t),
                             k, _ptr(so), _ptr(self.bias), threads) != 0:
            raise MemoryError("int8 epilogue: could not allocate a row of scratch memory")
        return y if dtype == torch.float32 else y.to(dtype)

    def _int8_matmul(self, qx: torch.Tensor) -> torch.Tensor:
        """qx ``[T, K]`` int8 -> ``qx @ qweight.T * w_scale`` ``[T, N]`` float32, exact sums: through
        fbgemm for one token where :func:`fbgemm_gemv` says so (the same bits), else oneDNN."""
        if qx.shape[0] == 1 and self._fbgemm_packed is not None and fbgemm_gemv():
            return _fbgemm_matmul(qx.float(), self._fbgemm_packed)
        return _onednn_matmul(qx, self._packed, self.w_scale, self._w_zero)

    def extra_repr(self) -> str:
        smooth = ", smoothed" if self.inv_smooth is not None else ""
        outliers = "" if self.outlier_channels is None else f", {self.outlier_channels.numel()} outlier channels"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8{smooth}{outliers}"
