"""Weights that are not numbers: how the loader finds a corrupt checkpoint before it runs.

A file whose bytes were overwritten (a bad disk, a failed copy, 0xFF written over its middle)
still loads: its names and shapes are intact. Its values are not: 0xFF bytes read as an fp16
or float32 NaN, one NaN weight makes every logit NaN, and sampling from NaN logits gives a
uniform distribution and token 0 (trial 14d: an empty completion and exit status 0). So every
tensor the loader reads is checked, and a non-finite one refuses the load in one line:

- a float tensor: every value finite (:func:`nonfinite_floats`);
- a block tensor (Q8_0, Q4_0, Q4_1): every block's fp16 scale ``d`` (and Q4_1's min ``m``)
  finite (:func:`nonfinite_scales`). The quants themselves are 4- or 8-bit integers: every
  bit pattern is a weight, so the scales are all there is to check.

Both are one numpy pass (numpy's ``isfinite``; torch's ``isfinite(t).all()`` took 30-50x longer
on the busy 2-core AMD EPYC, Zen 4 with AVX-512, this was measured on). Their cost on the embedded model's load, same
CPU: about 0.1 s, whether of its 96 MB of blocks' scales or of its 538 MB of float32 weights
(docs/engine.md, "Model files that are broken or corrupt").
"""

from __future__ import annotations

import numpy as np
import torch

from nanovllm_core.model.block_formats import BlockFormat, block_format

_BF16_EXPONENT = 0x7F80  # bfloat16's exponent bits; all ones is inf or NaN (numpy has no bfloat16)


def nonfinite_floats(tensor: torch.Tensor) -> int:
    """How many values of ``tensor`` are NaN or infinite (0 for an integer tensor)."""
    if not tensor.is_floating_point():
        return 0
    t = tensor.detach().cpu()
    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy()
        return int(np.count_nonzero((bits & _BF16_EXPONENT) == _BF16_EXPONENT))
    if t.dtype not in (torch.float16, torch.float32, torch.float64):  # float8 and the like: rare, torch does it
        return int((~torch.isfinite(t)).sum())
    values = t.numpy()
    finite = np.isfinite(values)
    return 0 if finite.all() else int(finite.size - np.count_nonzero(finite))


def nonfinite_scales(blocks: torch.Tensor, fmt: BlockFormat | str) -> int:
    """How many blocks of ``blocks`` (uint8 ``[N, K / 32 * block_bytes]``, the file's layout) have a NaN
    or infinite scale ``d`` (or min ``m``, Q4_1): the fp16 numbers at the start of each block."""
    fmt = block_format(fmt) if isinstance(fmt, str) else fmt
    fields = 2 if fmt.name == "q4_1" else 1
    raw = np.ascontiguousarray(blocks.detach().cpu().numpy()).reshape(-1, fmt.block_bytes)
    finite = np.isfinite(raw.view(np.float16)[:, :fields])
    return 0 if finite.all() else int(np.count_nonzero(~finite.all(axis=1)))


def first_nonfinite_blocks(blocks: dict[str, tuple[str, torch.Tensor | None]]) -> tuple[str, str, int] | None:
    """The first tensor of ``{name: (format, blocks or None)}`` with non-finite scales, as
    ``(name, format, blocks affected)``; None when every scale is finite."""
    for name, (kind, data) in blocks.items():
        if data is not None:
            bad = nonfinite_scales(data, kind)
            if bad:
                return name, kind, bad
    return None


def values_phrase(count: int) -> str:
    """``holds 3 values that are NaN or infinite`` (one value: ``holds 1 value that is ...``)."""
    return f"holds {count:,} {'value that is' if count == 1 else 'values that are'} NaN or infinite"


def blocks_phrase(count: int, fmt: str) -> str:
    """``has 3,276 q4_1 blocks whose scale is NaN or infinite`` (one block: ``has 1 q4_1 block ...``)."""
    return f"has {count:,} {fmt} block{'' if count == 1 else 's'} whose scale is NaN or infinite"
