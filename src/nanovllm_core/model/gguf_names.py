"""How a GGUF file names and orders a LLaMA's weights, against Hugging Face's.

Used by the loader (dequantizing a GGUF file into a float checkpoint) and by
``model/quantization.py`` (keeping the file's own blocks), so it stands below both: neither
imports the other for it.
"""

from __future__ import annotations

import re

import torch

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None: not a weight we use)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    m = re.match(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$", name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row order for a q/k projection ``[num_heads * head_dim, hidden]``.

    llama.cpp's converter interleaves each head's rows so that rotary pairs are adjacent
    ((0, 1), (2, 3), ...); Hugging Face pairs row i with row i + head_dim/2. This is the
    inverse of ``permute`` in llama.cpp's ``convert_hf_to_gguf.py``.
    """
    rows = w.shape[0]
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
