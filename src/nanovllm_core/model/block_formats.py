"""The GGUF block formats the engine runs (Q8_0, Q4_0, Q4_1): a table a learner can read, without torch.

``model/block_quant.py`` runs them (and re-exports these names); the X-Ray's block drawing
(``educational/xray_blocks.py``) reads them here, so the app can draw a block without
importing torch. A block is 32 consecutive weights of one output row and their scale (and min).
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_SIZE = 32  # weights per block, in every format here
ACTIVATIONS = "q8 per 32-block"  # how the kernel holds activations (see model/block_quant.py's docstring)


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format: its name, ggml type id, bytes per block, C enum value and a one-line layout."""

    name: str
    ggml_type: int
    block_bytes: int
    c_id: int
    layout: str

    @property
    def bytes_per_weight(self) -> float:
        """Bytes each weight costs, its share of the scale (and min) included: 34/32, 18/32, 20/32."""
        return self.block_bytes / BLOCK_SIZE


FORMATS: dict[str, BlockFormat] = {
    "q8_0": BlockFormat("q8_0", 8, 34, 0, "fp16 scale d + 32 int8 q; w = d*q"),
    "q4_0": BlockFormat("q4_0", 2, 18, 1, "fp16 scale d + 32 4-bit q; w = d*(q-8)"),
    "q4_1": BlockFormat("q4_1", 3, 20, 2, "fp16 scale d + fp16 min m + 32 4-bit q; w = d*q + m"),
}
BY_GGML_TYPE = {f.ggml_type: f for f in FORMATS.values()}


def block_format(name: str) -> BlockFormat:
    """The format called ``name`` (``q8_0``, ``q4_0``, ``q4_1``, any case).

    Raises:
        ValueError: an unknown name, in one line naming the choices.
    """
    fmt = FORMATS.get(str(name).lower())
    if fmt is None:
        raise ValueError(f"block format {name!r} is unknown; use one of {', '.join(FORMATS)}")
    return fmt
