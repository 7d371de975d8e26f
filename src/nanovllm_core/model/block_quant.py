"""Linear layers and embeddings whose weights stay in GGUF's block formats (Q8_0, Q4_0, Q4_1).

A block is 32 consecutive weights of one output row and the numbers that scale them:

======  =====  ==================================================  ===================
format  bytes  layout                                              weight
======  =====  ==================================================  ===================
Q8_0    34     fp16 scale d, 32 int8 q                             ``d * q``
Q4_0    18     fp16 scale d, 16 bytes of 4-bit q                   ``d * (q - 8)``
Q4_1    20     fp16 scale d, fp16 min m, 16 bytes of 4-bit q       ``d * q + m``
======  =====  ==================================================  ===================

(in a 4-bit block, byte j holds weight j in its low nibble and weight j + 16 in its high one;
ggml's ``ggml-quants.c`` defines the formats). A weight matrix ``[N, K]`` is stored as
``[N, K / 32 * bytes]`` uint8: each row's blocks one after another, exactly as a GGUF file
holds it, so a checkpoint that ships blocks is used as shipped (the loader keeps them; no
dequantize-then-requantize), and a float checkpoint is quantized at load with the ``gguf``
package's reference quantizers (the same arithmetic as llama.cpp's ``quantize``). In memory
the modules hold the blocks packed 8 rows at a time for the kernel's vector lanes (:func:`pack`:
the same bytes reordered; :attr:`BlockLinear.blocks` gives the file's order back).

:class:`BlockLinear` runs in C (``block_quant_cpu.c``) the way llama.cpp does on the CPU: each
activation row is first quantized per 32-block to int8 with a float32 scale (:data:`ACTIVATIONS`),
then each output is a sum over blocks of exact integer dot products, scaled once a block. One
row's result never depends on the other rows of its batch. Why int8 activations and not float
ones (exact with respect to the dequantized weights): measured on a 2-core AMD EPYC (AVX2), one
thread, float activations took 22.6 ms of CPU a token on the embedded model against llama.cpp's
14.1 ms, because widening each 4-bit weight to a float costs more instructions than the
product itself; integer products (``maddubs``) halve the instructions a block. The cost is a
second rounding, of x, measured by ``benchmarks/benchmark_quantization.py`` (perplexity).
Where the C library cannot be built, or ``NANOVLLM_BLOCK_KERNELS=0``, it runs
:func:`reference_linear` in PyTorch instead: the same values up to rounding, much slower (the
engine says so at load).

Why past ~400 lines: the formats, the PyTorch reference they are tested against, the two
modules and the one-call decoder layers are one subject (weights kept in blocks) and share the
C library's bindings; each part is short.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from pathlib import Path

import numpy as np
import torch
from torch import nn

from nanovllm_core import native, yield_gate
from nanovllm_core.config import setting
from nanovllm_core.model.block_formats import (  # noqa: F401 (re-exported: the formats are part of this module's API)
    ACTIVATIONS,
    BLOCK_SIZE,
    BY_GGML_TYPE,
    FORMATS,
    BlockFormat,
    block_format,
)

SOURCE = Path(__file__).with_name("block_quant_cpu.c")
ENV_SWITCH = "NANOVLLM_BLOCK_KERNELS"  # "0": the PyTorch fallback
# ----------------------------------------------------------------------------- the C library

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    "block_linear": (_i32, [_i32, _p, _p, _i64, _p, _i64, _p, _i64, _i64, _i64, _i64, _p, _i32]),
    "block_rows": (_i32, [_i32, _p, _p, _i64, _i64, _i64, _p]),
}


def library() -> ctypes.CDLL | None:
    """``block_quant_cpu.c`` built for this CPU, or None (no compiler, failed build, or ``NANOVLLM_BLOCK_KERNELS=0``)."""
    return native.load_unless_off(SOURCE, SIGNATURES, ENV_SWITCH)[0]


def unavailable_reason() -> str | None:
    """Why :func:`library` is None, or None when it loads."""
    return native.load_unless_off(SOURCE, SIGNATURES, ENV_SWITCH)[1]


def block_scratch(rows: int, in_features: int) -> int:
    """Floats of scratch ``block_linear`` needs for ``rows`` activation rows of ``in_features``
    (their int8 values, and per 32-block a scale, a float and an integer sum): ``BLOCK_SCRATCH`` in the C source."""
    return rows * (in_features // BLOCK_SIZE) * 3 + rows * in_features // 4


_scratch_local = threading.local()


def scratch(floats: int) -> torch.Tensor:
    """A float32 buffer of at least ``floats`` elements for one C call, reused by later calls on this thread.

    Grown (never shrunk) to the largest request so far: a decode step no longer allocates and
    faults in fresh pages for the quantized activations and the layers' intermediates. Its
    contents are scratch: valid only during the call that was handed it. One buffer per thread,
    so two engines stepping on two threads never share one.
    """
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < floats:
        buf = torch.empty(max(floats, 1), dtype=torch.float32)
        _scratch_local.buf = buf
    return buf


# ----------------------------------------------------------------------------- reference (PyTorch)

def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``[M, K]`` float32 -> (int values ``[M, K]`` as float32, scales ``[M, K / 32]``), as the kernel does.

    Per 32-block: ``d = max|x| / 127``, ``q = round-half-even(x * (1 / d))`` (0 for an all-zero
    block): ggml's Q8_1 activation quantization, the scale kept in float32.
    """
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK_SIZE, BLOCK_SIZE)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1))  # torch.round rounds half to even, as nearbyintf
    return q.reshape(m, k), d


def reference_linear(x: torch.Tensor, blocks: torch.Tensor, fmt: BlockFormat | str, in_features: int) -> torch.Tensor:
    """What :class:`BlockLinear` computes, in float64: x ``[M, K]`` quantized per block, times the blocks' weights.

    ``sum_b (d_w d_x sum_i q_i xq_i + m_w d_x sum_i xq_i)`` per output (``m_w = -8 d_w`` for Q4_0, 0
    for Q8_0); the kernel's float32 result is within float32 rounding of it.
    """
    fmt = block_format(fmt) if isinstance(fmt, str) else fmt
    xq, xd = quantize_activations(x)
    xdq = (xq.double().reshape(x.shape[0], -1, BLOCK_SIZE) * xd.double().unsqueeze(-1)).reshape(x.shape)
    return xdq @ dequantize(blocks, fmt, in_features).double().T

def _halves(raw: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 2]`` (little-endian fp16 bytes) -> float32 ``[...]``."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def dequantize(blocks: torch.Tensor, fmt: BlockFormat | str, in_features: int) -> torch.Tensor:
    """Blocks uint8 ``[N, K / 32 * block_bytes]`` -> float32 weights ``[N, K]`` (K = ``in_features``).

    Written from the format table in the module docstring, in PyTorch; the same values as
    ``gguf.quants.dequantize`` (tests/test_block_quant.py checks it).

    Raises:
        ValueError: ``in_features`` not a multiple of 32, or blocks of another width.
    """
    fmt = block_format(fmt) if isinstance(fmt, str) else fmt
    n = blocks.shape[0]
    if in_features % BLOCK_SIZE or blocks.shape[1] != in_features // BLOCK_SIZE * fmt.block_bytes:
        raise ValueError(f"{fmt.name} blocks of width {blocks.shape[1]} do not hold {in_features} weights a row")
    b = blocks.reshape(n, in_features // BLOCK_SIZE, fmt.block_bytes)
    d = _halves(b[..., 0:2].unsqueeze(-1).reshape(*b.shape[:2], 2))
    if fmt.name == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        w = d.unsqueeze(-1) * q
    else:
        qs = b[..., (4 if fmt.name == "q4_1" else 2):]
        q = torch.cat((qs & 15, qs >> 4), dim=-1).float()
        if fmt.name == "q4_1":
            m = _halves(b[..., 2:4])
            w = d.unsqueeze(-1) * q + m.unsqueeze(-1)
        else:
            w = d.unsqueeze(-1) * (q - 8.0)
    return w.reshape(n, in_features)


def quantize(weight: torch.Tensor, fmt: BlockFormat | str) -> torch.Tensor:
    """Float weights ``[N, K]`` -> blocks uint8 ``[N, K / 32 * block_bytes]``, with gguf's reference quantizer.

    The ``gguf`` package's numpy port of ggml's ``quantize_row_*_ref``: per block, Q8_0 takes
    ``d = max|w| / 127``, Q4_0 ``d = w_maxabs / -8`` and Q4_1 ``d = (max - min) / 15, m = min``.

    Raises:
        ValueError: K not a multiple of 32.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    fmt = block_format(fmt) if isinstance(fmt, str) else fmt
    if weight.dim() != 2 or weight.shape[1] % BLOCK_SIZE:
        raise ValueError(f"a {list(weight.shape)} weight cannot be cut into {fmt.name} blocks of {BLOCK_SIZE} "
                         f"(its last dimension must be a multiple of 32); load it with {setting('quantization', 'none')}")
    arr = weight.detach().to(torch.float32).cpu().numpy()
    out = gguf_quantize(arr, GGMLQuantizationType(fmt.ggml_type))
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(weight.shape[0], -1)


# ----------------------------------------------------------------------------- the packed layout

PACK_ROWS = 8  # weight rows a packed group interleaves: one per lane of an 8-float vector (NC in the C source)


def _pack_parts(fmt: BlockFormat) -> tuple[int, int]:
    """(header bytes of one row's block: d, or d and m; quant bytes of one row's block)."""
    header = 4 if fmt.name == "q4_1" else 2
    return header, fmt.block_bytes - header


def pack(blocks: torch.Tensor, fmt: BlockFormat | str) -> torch.Tensor:
    """File-layout blocks uint8 ``[N, K / 32 * block_bytes]`` -> the kernels' layout ``[ceil(N / 8), K / 32, 8 * block_bytes]``.

    The same bytes reordered (nothing is requantized): per group of 8 rows (the last row
    repeated past N) and per block, the 8 rows' fp16 ``d``, then their ``m`` (Q4_1), then their
    quant bytes 4 at a time, word ``w`` of row ``k`` at ``32 w + 4 k``, so one 32-byte load
    holds the same word of 8 rows, one row per vector lane (``block_quant_cpu.c``, "Packed
    layout"; llama.cpp's CPU repack interleaves Q4_0 rows the same way). :func:`unpack` inverts it.
    """
    fmt = block_format(fmt) if isinstance(fmt, str) else fmt
    n, width = blocks.shape
    nb, header = width // fmt.block_bytes, _pack_parts(fmt)[0]
    if n % PACK_ROWS:
        blocks = torch.cat((blocks, blocks[-1:].expand(PACK_ROWS - n % PACK_ROWS, width)))
    b = blocks.reshape(-1, PACK_ROWS, nb, fmt.block_bytes).permute(0, 2, 1, 3)  # [G, nb, 8 rows, block_bytes]
    g = b.shape[0]
    parts = [b[..., 0:2].reshape(g, nb, 2 * PACK_ROWS)]  # the 8 d
    if header == 4:
        parts.append(b[..., 2:4].reshape(g, nb, 2 * PACK_ROWS))  # the 8 m
    q = b[..., header:].reshape(g, nb, PACK_ROWS, -1, 4).transpose(2, 3)  # [G, nb, words, 8 rows, 4 bytes]
    parts.append(q.reshape(g, nb, -1))
    return torch.cat(parts, dim=-1).contiguous()


def unpack(packed: torch.Tensor, fmt: BlockFormat | str, rows: int) -> torch.Tensor:
    """The inverse of :func:`pack`: ``[G, K / 32, 8 * block_bytes]`` -> file-layout blocks ``[rows, K / 32 * block_bytes]``.

    Raises:
        ValueError: ``rows`` not in the groups' range (more than ``8 G`` or not past ``8 (G - 1)``).
    """
    fmt = block_format(fmt) if isinstance(fmt, str) else fmt
    g, nb, _ = packed.shape
    if not PACK_ROWS * (g - 1) < rows <= PACK_ROWS * g:
        raise ValueError(f"{g} packed groups of {PACK_ROWS} rows cannot hold {rows} rows")
    header, qbytes = _pack_parts(fmt)
    parts = [packed[..., 0:2 * PACK_ROWS].reshape(g, nb, PACK_ROWS, 2)]
    if header == 4:
        parts.append(packed[..., 2 * PACK_ROWS:4 * PACK_ROWS].reshape(g, nb, PACK_ROWS, 2))
    q = packed[..., header * PACK_ROWS:].reshape(g, nb, qbytes // 4, PACK_ROWS, 4).transpose(2, 3)
    parts.append(q.reshape(g, nb, PACK_ROWS, qbytes))
    b = torch.cat(parts, dim=-1).permute(0, 2, 1, 3)  # [G, 8 rows, nb, block_bytes]
    return b.reshape(g * PACK_ROWS, nb * fmt.block_bytes)[:rows].contiguous()


# ----------------------------------------------------------------------------- modules

class BlockLinear(nn.Module):
    """``y = x W^T + b`` with W kept in a block format: x ``[num_tokens, in_features]`` -> ``[num_tokens, out_features]``.

    ``blocks``: uint8 ``[out_features, in_features / 32 * block_bytes]`` (a GGUF tensor's rows,
    as the file holds them); the module keeps them as :func:`pack` orders them for the kernel
    (``packed``, the same bytes) and gives the file's order back as :attr:`blocks`.
    Activations and the result are float32. Bit for bit, a row's result is the same whatever
    else is in ``x`` (see ``block_quant_cpu.c``).

    Attributes:
        kind: the format's name (``q4_1``, ...), shown by the app and ``model_info()``.
        quantized_at_load: True when :meth:`from_float` made the blocks from float weights at load
            (``--quantization q8_0`` ...), False when they are a checkpoint's own (a GGUF file's).
        packed: uint8 ``[ceil(out_features / 8), in_features / 32, 8 * block_bytes]``, what the kernel reads.
        bytes_per_weight: bytes per weight with its share of scale (and min): 34/32, 18/32 or 20/32.
        weight_bytes: bytes one forward pass streams from memory (all of ``packed``).
    """

    def __init__(self, blocks: torch.Tensor, fmt: BlockFormat | str, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.format = block_format(fmt) if isinstance(fmt, str) else fmt
        if in_features % BLOCK_SIZE or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != in_features // BLOCK_SIZE * self.format.block_bytes:
            raise ValueError(f"{self.format.name} blocks {list(blocks.shape)} ({blocks.dtype}) do not hold "
                             f"{in_features} weights a row")
        self._init(pack(blocks, self.format), blocks.shape[0], in_features, bias)

    def _init(self, packed: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        self.register_buffer("packed", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.out_features, self.in_features = out_features, in_features
        self.kind = self.format.name
        self.quantized_at_load = False

    @classmethod
    def sharing(cls, embedding: "BlockEmbedding") -> "BlockLinear":
        """An LM head tied to ``embedding``: the same packed blocks (one copy), ``[vocab, hidden]``."""
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head.format = embedding.format
        head._init(embedding.packed, embedding.num_embeddings, embedding.embedding_dim, None)
        return head

    def first_rows(self, rows: int) -> "BlockLinear":
        """A ``BlockLinear`` over this one's first ``rows`` output rows (rounded up to a multiple of 8):
        a view of the same packed blocks, no copy, no bias (``roofline.block_peak`` times an LM head on
        a slice of it, as long as a layer's projection)."""
        rows = min(self.out_features, -(-rows // PACK_ROWS) * PACK_ROWS)
        part = type(self).__new__(type(self))
        nn.Module.__init__(part)
        part.format = self.format
        part._init(self.packed[:rows // PACK_ROWS], rows, self.in_features, None)
        return part

    @classmethod
    def from_float(cls, weight: torch.Tensor, fmt: BlockFormat | str, bias: torch.Tensor | None = None) -> "BlockLinear":
        """Quantize a float weight ``[out_features, in_features]`` into ``fmt`` blocks (see :func:`quantize`)."""
        module = cls(quantize(weight, fmt), fmt, weight.shape[1], bias)
        module.quantized_at_load = True
        return module

    @property
    def bytes_per_weight(self) -> float:
        return self.format.bytes_per_weight

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel()

    @property
    def blocks(self) -> torch.Tensor:
        """The blocks in the file's order, uint8 ``[out_features, in_features / 32 * block_bytes]`` (a new tensor)."""
        return unpack(self.packed, self.format, self.out_features)

    def file_block(self, row: int = 0, index: int = 0) -> bytes:
        """The ``block_bytes`` bytes of block ``index`` of weight row ``row``, as the file stores them (for teaching)."""
        group = self.packed[row // PACK_ROWS:row // PACK_ROWS + 1]
        one = unpack(group, self.format, PACK_ROWS)[row % PACK_ROWS]
        return bytes(one[index * self.format.block_bytes:(index + 1) * self.format.block_bytes].tolist())

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[out_features, in_features]`` these blocks stand for (a new tensor: for teaching and tests)."""
        return dequantize(self.blocks, self.format, self.in_features)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[num_tokens, in_features]`` -> ``[num_tokens, out_features]`` float32 (``+ residual`` when given).

        Raises:
            ValueError: x of another width.
        """
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input width {x.shape[-1]} does not match this layer's {self.in_features} input features")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        lib = library() if x2.device.type == "cpu" and not (torch.is_grad_enabled() and x2.requires_grad) else None
        if lib is None:
            y = reference_linear(x2.cpu(), self.blocks, self.format, self.in_features).float().to(x2.device)
            if self.bias is not None:
                y = y + self.bias
            if residual is not None:
                y = residual.reshape(y.shape) + y
            return y.reshape(*lead, self.out_features)
        if residual is not None and self.bias is not None:  # residual + (x W^T + b): the bias first
            return (residual.reshape(-1, self.out_features) + self.forward(x2)).reshape(*lead, self.out_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        if m:
            res = None
            if residual is not None:
                res = residual.reshape(m, self.out_features)
                if res.dtype != torch.float32 or res.stride(-1) != 1:
                    res = res.float().contiguous()
            sx = scratch(block_scratch(m, self.in_features))
            lib.block_linear(self.format.c_id, self.packed.data_ptr(), x2.data_ptr(), x2.stride(0), y.data_ptr(),
                             self.out_features, None if res is None else res.data_ptr(),
                             0 if res is None else res.stride(0), m, self.out_features, self.in_features,
                             sx.data_ptr(), torch.get_num_threads())
            if self.bias is not None:
                y += self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class BlockEmbedding(nn.Module):
    """Token embedding kept in blocks: ids ``[num_tokens]`` -> rows ``[num_tokens, hidden]`` float32.

    A lookup dequantizes only the rows it reads (``d * q`` for Q8_0), the same values as the
    dequantized matrix holds; the matrix itself stays ``vocab x hidden / 32 * block_bytes`` bytes.
    A tied LM head reads the same blocks (:class:`BlockLinear` over :attr:`blocks`).

    Raises (forward):
        IndexError: an id outside ``[0, num_embeddings)``.
    """

    def __init__(self, blocks: torch.Tensor, fmt: BlockFormat | str, embedding_dim: int) -> None:
        super().__init__()
        self.format = block_format(fmt) if isinstance(fmt, str) else fmt
        if embedding_dim % BLOCK_SIZE or blocks.shape[1] != embedding_dim // BLOCK_SIZE * self.format.block_bytes:
            raise ValueError(f"{self.format.name} blocks {list(blocks.shape)} do not hold {embedding_dim} values a row")
        self.register_buffer("packed", pack(blocks, self.format), persistent=False)  # as BlockLinear keeps them
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.kind = self.format.name

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel()

    @property
    def blocks(self) -> torch.Tensor:
        """The blocks in the file's order, uint8 ``[num_embeddings, embedding_dim / 32 * block_bytes]`` (a new tensor)."""
        return unpack(self.packed, self.format, self.num_embeddings)

    def dequantized(self) -> torch.Tensor:
        """The float32 matrix ``[num_embeddings, embedding_dim]`` (a new tensor: for teaching and tests)."""
        return dequantize(self.blocks, self.format, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        lib = library()
        if lib is None or flat.device.type != "cpu":
            if flat.numel() and not bool(((flat >= 0) & (flat < self.num_embeddings)).all()):
                raise IndexError(f"a token id is outside the vocabulary [0, {self.num_embeddings})")
            groups = self.packed[flat.cpu() // PACK_ROWS]  # the groups holding the rows, unpacked 8 rows each
            rows = unpack(groups, self.format, groups.shape[0] * PACK_ROWS)[
                torch.arange(flat.numel()) * PACK_ROWS + flat.cpu() % PACK_ROWS]
            rows = dequantize(rows, self.format, self.embedding_dim).to(flat.device)
            return rows.reshape(*ids.shape, self.embedding_dim)
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=torch.float32)
        if flat.numel() and lib.block_rows(self.format.c_id, self.packed.data_ptr(), flat.data_ptr(), flat.numel(),
                                           self.num_embeddings, self.embedding_dim, out.data_ptr()) != 0:
            raise IndexError(f"a token id is outside the vocabulary [0, {self.num_embeddings})")
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind}"


# ----------------------------------------------------------------------------- SwiGLU and whole layers

_f = ctypes.c_float
SIGNATURES.update({
    "silu_mul_f32": (None, [_p, _p, _i64, _i64, _i32]),
    "decoder_layers": (_i32, [_p, _i32, _p, _p, _i64, _i64, _i64, _i32, _i32, _i32, _f, _p, _p, _p, _i64, _p, _p, _p,
                              _i32, _i32, _i32, _i32, _f, _p, _i32, _p]),
})


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU's ``silu(gate) * up`` in C for gate_up ``[T, 2I]`` float32 (gate first) -> ``[T, I]``; None where unavailable.

    The model uses it in block modes so that its step-by-step path and :class:`FusedDecoderLayers`
    compute the same bits (PyTorch's silu rounds its exp differently).
    """
    lib = library()
    if lib is None or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.dim() != 2:
        return None
    gu = gate_up.contiguous()
    t, two_i = gu.shape
    act = torch.empty(t, two_i // 2, dtype=torch.float32)
    if t:
        lib.silu_mul_f32(gu.data_ptr(), act.data_ptr(), t, two_i // 2, torch.get_num_threads())
    return act


class _LayerWeights(ctypes.Structure):
    _fields_ = [("qkv", _p), ("o", _p), ("gate_up", _p), ("down", _p),
                ("qkv_fmt", ctypes.c_int32), ("o_fmt", ctypes.c_int32), ("gate_up_fmt", ctypes.c_int32),
                ("down_fmt", ctypes.c_int32), ("input_norm", _p), ("post_norm", _p), ("k_pool", _p), ("v_pool", _p)]


class _LayerOps(ctypes.Structure):
    _fields_ = [("rms_norm", _p), ("rope", _p), ("write_kv", _p), ("attention", _p)]


class FusedDecoderLayers:
    """All decoder layers of a block-mode model in one C call per step (``decoder_layers`` in ``block_quant_cpu.c``).

    Runs ``x [T, hidden]`` through the first ``num_layers`` layers for a step whose attention
    is the CPU paged kernel, with no Python between operations: per layer RMSNorm, the qkv
    blocks, RoPE, the KV write, PagedAttention, o + residual, RMSNorm, gate/up, SwiGLU, down +
    residual. The C functions are the ones the step-by-step path (``model/llama.py``) calls,
    passed as pointers, so both give the same bits (tests/test_block_quant_real.py holds them
    equal); ``llama.py`` stays the readable reference and the X-Ray capture runs it.

    ``__call__`` returns None (the caller runs the layers one by one) when a library is
    missing or the step is not on the CPU paged kernel.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # KV cache -> its layer table (pointers into that cache's pools): one per engine sharing the
        # model, since two engines may step at once on two threads (the app's tutorial demos do).
        self._tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @staticmethod
    def supported(model: nn.Module) -> bool:
        """Every layer's four linear modules are :class:`BlockLinear` without bias, and the model is float32."""
        for layer in model.layers:
            mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if not all(isinstance(m, BlockLinear) and m.bias is None for m in mods):
                return False
        return model.norm.weight.dtype == torch.float32

    _ops_cache: dict[tuple[int, int], _LayerOps] = {}  # per process: (norm/rope library, attention library) -> pointers

    @classmethod
    def _ops(cls) -> _LayerOps | None:
        """The C functions the layers call, or None where a library is missing or switched off.

        The switches are read on every call (a test or an A/B run may turn one off); the pointer
        table is built once per process for the libraries loaded (they stay loaded).
        """
        from nanovllm_core.attention import cpu_paged
        from nanovllm_core.model import native_ops

        norm_rope, attn = native_ops.library(), cpu_paged._load()[0]
        if library() is None or norm_rope is None or attn is None:
            return None
        key = (id(norm_rope), id(attn))
        ops = cls._ops_cache.get(key)
        if ops is None:
            addr = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
            ops = _LayerOps(addr(norm_rope.rms_norm_f32), addr(norm_rope.rope_f32), addr(attn.write_kv),
                            addr(attn.paged_attention))
            cls._ops_cache[key] = ops
        return ops

    def _layer_array(self, cache) -> ctypes.Array:
        # One table per KV cache object (its pools are fixed for its life), held by a weak key, so a
        # later engine's cache is never taken for a freed one that had the same id or addresses
        # (a stale pointer would write into freed memory), and the table keeps no pool alive. Each
        # engine keeps its own: a single table swapped between two engines stepping on two threads
        # was freed under the other's running C call (a segfault running a tutorial demo beside
        # generation, issue 29).
        table = self._tables.get(cache)
        if table is not None:
            return table
        rows = []
        for i, layer in enumerate(self.model.layers):
            a, m = layer.self_attn, layer.mlp
            rows.append(_LayerWeights(
                a.qkv_proj.packed.data_ptr(), a.o_proj.packed.data_ptr(), m.gate_up_proj.packed.data_ptr(),
                m.down_proj.packed.data_ptr(), a.qkv_proj.format.c_id, a.o_proj.format.c_id,
                m.gate_up_proj.format.c_id, m.down_proj.format.c_id, layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(), cache.k_by_head[i].data_ptr(),
                cache.v_by_head[i].data_ptr()))
        table = (_LayerWeights * len(rows))(*rows)
        self._tables[cache] = table
        return table

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn, num_layers: int,
                 first_layer: int = 0) -> torch.Tensor | None:
        """x ``[T, hidden]`` float32 after layers ``[first_layer, num_layers)`` (a new tensor), or None where
        this path does not apply. ``first_layer > 0`` continues a step whose earlier layers ran elsewhere
        (the X-Ray runs its captured layer step by step between two fused slices): the C call gets the
        layer table from that row on.

        Raises:
            ValueError: a slot outside the pool, or a layer range outside the model.
            RuntimeError: attention could not allocate its scratch memory.
        """
        if not 0 <= first_layer <= num_layers <= len(self.model.layers):
            raise ValueError(f"fused layers [{first_layer}, {num_layers}) are not within the model's "
                             f"{len(self.model.layers)} layers")
        meta = getattr(attn, "meta", None)
        if not getattr(attn, "use_cpu_paged", False) or meta is None or meta.token_rows is None \
                or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        ops = self._ops()
        if ops is None:
            return None
        cfg = self.model.config
        t, h = x.shape
        i, nh, nkv, hd = cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cache = attn.cache
        kpool = cache.k_by_head[0]
        _, nb, bs, _ = kpool.shape
        out = x.contiguous().clone()
        work = scratch(t * (h + (nh + 2 * nkv) * hd + nh * hd + 3 * i) + block_scratch(t, max(h, i)) + 1)
        slots = meta.slot_mapping.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        table = self._layer_array(cache)  # held here until the C call returns
        rc = library().decoder_layers(
            ctypes.addressof(table) + first_layer * ctypes.sizeof(_LayerWeights),
            num_layers - first_layer, ctypes.addressof(ops), out.data_ptr(), t, h, i,
            nh, nkv, hd, float(self.model.norm.eps), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), nb * bs,
            meta.block_tables.data_ptr(), meta.token_rows.data_ptr(), meta.token_context.data_ptr(), nb, bs,
            meta.block_tables.shape[1], max(1, meta.max_seqlen_k), hd ** -0.5, work.data_ptr(),
            torch.get_num_threads(), yield_gate.GATE.address)
        if rc == -1:
            raise ValueError(f"a slot in the slot mapping lies outside the pool's {nb * bs} slots")
        if rc == -2:
            raise RuntimeError("the CPU paged attention kernel could not allocate its scratch memory")
        return out
