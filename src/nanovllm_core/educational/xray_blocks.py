"""The X-Ray's picture of a weight block: how a block-quantized layer holds 32 weights, with a real block.

In a block mode (``--quantization gguf``, ``q8_0``, ``q4_0``, ``q4_1``; ``model/block_quant.py``)
each output row of a linear layer is stored as blocks of 32 consecutive weights and the numbers
that scale them, in GGUF's layouts:

- Q8_0, 34 bytes: fp16 scale ``d``, then 32 int8 ``q`` (byte ``2 + i`` is ``q[i]``); ``w = d * q``;
- Q4_0, 18 bytes: fp16 ``d``, then 16 bytes of 4-bit ``q``; ``w = d * (q - 8)``;
- Q4_1, 20 bytes: fp16 ``d``, fp16 min ``m``, then 16 bytes of 4-bit ``q``; ``w = d * q + m``;

where in a 4-bit block byte ``j`` of the 16 holds ``q[j]`` in its low nibble and ``q[j + 16]``
in its high one (ggml's ``ggml-quants.c``). The capture (:func:`block_tensor`) reads the first
block of a layer's qkv_proj row 0 as the engine holds it, parses ``d``, ``m`` and the first
:data:`SHOWN` integers from its bytes, and takes the weights they decode to from the engine's
own ``BlockLinear.dequantized`` path (``block_quant.dequantize``). They travel in the layer's
``LayerTrace`` as one ``TensorInfo`` named :data:`BLOCK_TENSOR` (so a remote app gets them too):
shape ``[rows, blocks per row, bytes per block]`` of the stored matrix, sample ``(d, m, q[0..3],
w[0..3])`` (``m`` is 0 in the formats without one). :func:`block_lines` draws it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanovllm_core import events as ev
from nanovllm_core.model import block_formats
from nanovllm_core.model.block_formats import BLOCK_SIZE, FORMATS, BlockFormat  # no torch: the app imports this

BLOCK_TENSOR = "weight_block"  # the TensorInfo name of a layer's sampled block, as the checkpoint stores it
BLOCK_TENSOR_AT_LOAD = "weight_block_at_load"  # the same for a block quantized at load from float weights
BLOCK_SCOPE = "weights"  # its scope: not a batch or request tensor, the layer's stored weights
BLOCK_MODULE = "qkv_proj"  # the linear module whose first block is shown
SHOWN = 4  # integers (and the weights they decode to) shown
BY_BLOCK_BYTES = {f.block_bytes: f for f in FORMATS.values()}  # 34, 18, 20: each format's own size
FORMULA = {"q8_0": "w = d·q", "q4_0": "w = d·(q − 8)", "q4_1": "w = d·q + m"}


def activations_note() -> str:
    """What the block kernels do with the activations, as ``model/block_quant.py`` states it.

    Reads a module constant ``ACTIVATIONS`` (a phrase) when the module defines one; otherwise
    says only what holds at the call: float32 activations go in, float32 results come out.
    """
    said = getattr(block_formats, "ACTIVATIONS", None)
    if isinstance(said, str) and said.strip():
        return f"activations: {said.strip()}"
    return "float32 activations in and out"


@dataclass(frozen=True)
class BlockSample:
    """One real block: its format, the stored matrix's ``rows`` x ``in_features``, the block's
    scale ``d``, min ``m`` (Q4_1; None otherwise), first integers ``q`` (as stored: 0..15 for
    4-bit, -128..127 for Q8_0) and the float32 weights ``w`` they decode to; ``from_file``: the
    checkpoint's own block (a GGUF file's), not one quantized at load from float weights."""

    format: BlockFormat
    rows: int
    in_features: int
    d: float
    m: float | None
    q: tuple[int, ...]
    w: tuple[float, ...]
    from_file: bool = True


def read_block(raw: bytes | bytearray, fmt: BlockFormat) -> tuple[float, float | None, list[int]]:
    """``(d, m, q[0..31])`` parsed from one block's ``fmt.block_bytes`` bytes, by the layout above.

    Raises:
        ValueError: ``raw`` is not one block of ``fmt``.
    """
    import struct

    if len(raw) != fmt.block_bytes:
        raise ValueError(f"a {fmt.name} block is {fmt.block_bytes} bytes, not {len(raw)}")
    d = struct.unpack("<e", bytes(raw[0:2]))[0]
    if fmt.name == "q8_0":
        return d, None, list(struct.unpack("<32b", bytes(raw[2:34])))
    m = struct.unpack("<e", bytes(raw[2:4]))[0] if fmt.name == "q4_1" else None
    nibbles = raw[4:] if fmt.name == "q4_1" else raw[2:]
    return d, m, [b & 15 for b in nibbles] + [b >> 4 for b in nibbles]


def sample_block(module) -> BlockSample | None:
    """Row 0's first block of a ``BlockLinear`` (None for any other module)."""
    fmt = getattr(module, "format", None)
    if not isinstance(fmt, BlockFormat) or not hasattr(module, "file_block") or not hasattr(module, "in_features"):
        return None
    raw = module.file_block(0, 0)  # the file's 18/20/34 bytes (the module keeps them packed 8 rows at a time)
    d, m, q = read_block(raw, fmt)
    import torch  # only when a live model's block is drawn

    from nanovllm_core.model import block_quant

    first = torch.tensor(list(raw), dtype=torch.uint8).reshape(1, -1)
    w = block_quant.dequantize(first, fmt, BLOCK_SIZE)[0, :SHOWN].tolist()  # the engine's own decoding
    return BlockSample(fmt, int(module.out_features), int(module.in_features), float(d), m, tuple(q[:SHOWN]),
                       tuple(float(x) for x in w), not getattr(module, "quantized_at_load", False))


def block_tensor(module) -> ev.TensorInfo | None:
    """The ``TensorInfo`` carrying :func:`sample_block` of ``module`` in a trace (None: not a block layer)."""
    s = sample_block(module)
    if s is None:
        return None
    return ev.TensorInfo(BLOCK_TENSOR if s.from_file else BLOCK_TENSOR_AT_LOAD, (s.rows, s.in_features // BLOCK_SIZE, s.format.block_bytes),
                         (s.d, s.m or 0.0, *map(float, s.q), *s.w), BLOCK_SCOPE)


def from_trace(trace: ev.LayerTrace) -> BlockSample | None:
    """The block a trace carries (None: the layer was not in a block format, an older trace, or an edited
    one whose block values are not all finite)."""
    x = next((t for t in trace.tensors if t.name in (BLOCK_TENSOR, BLOCK_TENSOR_AT_LOAD)), None)
    if x is None or len(x.shape) != 3 or x.shape[2] not in BY_BLOCK_BYTES:
        return None
    fmt = BY_BLOCK_BYTES[x.shape[2]]
    n = (len(x.sample) - 2) // 2
    v = x.sample
    if not all(math.isfinite(a) for a in v[:2 + 2 * n]):  # a sample may hold NaN (events._FIELD_RULES); a block never
        return None
    return BlockSample(fmt, x.shape[0], x.shape[1] * BLOCK_SIZE, v[0], v[1] if fmt.name == "q4_1" else None,
                       tuple(int(round(q)) for q in v[2:2 + n]), tuple(v[2 + n:2 + 2 * n]), x.name == BLOCK_TENSOR)


def layout_lines(fmt: BlockFormat) -> list[str]:
    """A drawing of one ``fmt`` block: which bytes hold the scale, the min and the 32 integers."""
    if fmt.name == "q8_0":
        cells = [("d", "fp16", 2), ("q[0] .. q[31]: one int8 a weight", "byte 2 + i = q[i]", 32)]
    else:
        head = [("d", "fp16", 2)] + ([("m", "fp16", 2)] if fmt.name == "q4_1" else [])
        cells = head + [("q: 16 bytes, two 4-bit weights a byte", "byte j: q[j] low nibble, q[j+16] high", 16)]
    widths = [max(len(a), len(b), len(f"{n} bytes")) + 2 for a, b, n in cells]
    top = "┌" + "┬".join("─" * w for w in widths) + "┐"
    bottom = "└" + "┴".join("─" * w for w in widths) + "┘"
    row = lambda k: "│" + "│".join(f" {c[k]:<{w - 1}}" for c, w in zip(cells, widths)) + "│"  # noqa: E731
    sizes = " " + " ".join(f" {f'{n} bytes':<{w - 1}}" for (_, _, n), w in zip(cells, widths))
    return [top, row(0), row(1), bottom, sizes.rstrip() + f"  = {fmt.block_bytes} bytes for 32 weights"]


def block_lines(trace: ev.LayerTrace) -> list[str]:
    """The block drawing, the real block and the qkv_proj bytes it implies; empty without a block."""
    s = from_trace(trace)
    if s is None:
        return []
    f = s.format
    blocks_per_row = s.in_features // BLOCK_SIZE
    stored = s.rows * blocks_per_row * f.block_bytes
    lines = [f"Weights in {f.name.upper()} blocks ({BLOCK_MODULE} of layer {trace.layer}; model/block_quant.py): "
             f"each output row's weights in blocks of 32, {f.block_bytes} bytes a block, "
             f"{f.block_bytes}/32 = {f.bytes_per_weight:g} bytes a weight with the scale{' and min' if f.name == 'q4_1' else ''} "
             f"(float32: 4); {FORMULA[f.name]}, {activations_note()}."]
    lines += ["  " + line for line in layout_lines(f)]
    lines.append(f"In memory the kernel keeps the same bytes packed 8 rows at a time: per block, the 8 rows' d"
                 f"{' and m' if f.name == 'q4_1' else ''}, then their {'int8' if f.name == 'q8_0' else '4-bit'} values 4 bytes per row in turn, "
                 f"so one 32-byte load feeds 8 outputs (block_quant.pack reorders the bytes and changes none).")
    m = f", m = {s.m:+.6g}" if s.m is not None else ""
    q = ", ".join(str(v) for v in s.q)
    w = ", ".join(f"{v:+.5f}" for v in s.w)
    origin = ("as the file stores it" if s.from_file else
              f"made at load: {f.name.upper()} from the weights loaded in float32, not as the checkpoint stores them")
    lines.append(f"Row 0's first block, {origin}: d = {s.d:+.6g}{m}; q[0..{len(s.q) - 1}] = {q} -> "
                 f"w = {w} ({FORMULA[f.name]}).")
    op = next((o for o in trace.ops if o.name == BLOCK_MODULE), None)
    text = (f"{BLOCK_MODULE} stores [{s.rows}, {s.in_features}] weights as {s.rows} rows x {blocks_per_row} blocks x "
            f"{f.block_bytes} bytes = {stored:,} bytes (float32: {s.rows * s.in_features * 4:,})")
    if op is not None and op.bytes >= stored:
        text += (f"; its operation this step moved {op.bytes:,} bytes: those weights once, plus "
                 f"{op.bytes - stored:,} bytes of float32 activations in and out")
    lines.append(text + ".")
    return lines
