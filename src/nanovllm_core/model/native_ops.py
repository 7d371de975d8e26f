"""Float32 CPU layer operations in C (``layer_ops_cpu.c``), where PyTorch's dispatch costs more than the work.

Built and cached like the other C kernels (:mod:`nanovllm_core.native`). Where no C compiler is
found, the build fails, the tensors are not float32 CPU tensors, or ``NANOVLLM_NATIVE_OPS=0``,
:func:`rms_norm` returns None and the caller uses PyTorch's op, which computes the same values up
to float32 rounding (the order of the sum of squares differs); :func:`rope_` returns False and the
caller rotates with PyTorch ops, which give the same bits.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from nanovllm_core import native

SOURCE = Path(__file__).with_name("layer_ops_cpu.c")
ENV_SWITCH = "NANOVLLM_NATIVE_OPS"  # "0": PyTorch's ops instead


_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    "rms_norm_f32": (None, [_p, _p, ctypes.c_float, _p, _i64, _i64, _i32]),
    "rope_f32": (None, [_p, _i64, _i64, _i32, _i32, _p, _p, _i32]),
}


def library() -> ctypes.CDLL | None:
    """``layer_ops_cpu.c`` built for this CPU, or None where it cannot be built or ``NANOVLLM_NATIVE_OPS=0``."""
    return native.load_unless_off(SOURCE, SIGNATURES, ENV_SWITCH)[0]


def unavailable_reason() -> str | None:
    """Why :func:`library` returns None (switched off, no compiler, failed build), or None when it loads."""
    return native.load_unless_off(SOURCE, SIGNATURES, ENV_SWITCH)[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm (Zhang & Sennrich 2019) of x ``[num_tokens, hidden]`` with ``weight`` ``[hidden]``, in C.

    Returns ``(x / sqrt(mean(x**2, -1) + eps)) * weight`` ``[num_tokens, hidden]`` float32, each
    token's sum of squares in a fixed order (batch-invariant), or None where the C path does not
    apply (not float32 CPU tensors, x not 2-D, a weight that is not ``[hidden]``, autograd
    recording, or :func:`library` is None); PyTorch's op then runs, and raises for bad shapes.
    """
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or not x.is_cpu or x.dim() != 2
            or not weight.is_cpu or weight.shape != (x.shape[1],)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    lib = library()
    if lib is None:
        return None
    x = x.contiguous()
    w = weight.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        lib.rms_norm_f32(x.data_ptr(), w.data_ptr(), float(eps), out.data_ptr(), x.shape[0], x.shape[1],
                         torch.get_num_threads())
    return out


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate qk ``[num_tokens, heads, head_dim]`` in place by RoPE, in C; False (untouched) where it does not apply.

    ``cos``/``sin`` ``[num_tokens, 1, head_dim]`` come from ``RotaryEmbedding.cos_sin``. qk may be a
    view of the packed qkv projection (its rows strided); its heads and elements must be dense.
    The result is bit-identical to ``RotaryEmbedding.apply``: the same products and sums per element.
    Returns False for non-float32 or non-CPU tensors, other layouts, autograd, or no library.
    """
    if (qk.dtype != torch.float32 or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or not qk.is_cpu or qk.dim() != 3 or qk.stride(2) != 1 or qk.stride(1) != qk.shape[2]
            or qk.shape[2] % 2 or cos.shape != (qk.shape[0], 1, qk.shape[2]) or sin.shape != cos.shape
            or not cos.is_contiguous() or not sin.is_contiguous()
            or (torch.is_grad_enabled() and qk.requires_grad)):
        return False
    lib = library()
    if lib is None:
        return False
    if qk.numel():
        lib.rope_f32(qk.data_ptr(), qk.shape[0], qk.stride(0), qk.shape[1], qk.shape[2], cos.data_ptr(), sin.data_ptr(),
                     torch.get_num_threads())
    return True
