"""Small synthetic GGUF files for the loader's tests: a tiny random LLaMA with the embedded model's tokenizer.

The real file is 98 MB; these are ~4 MB (the 49,152-token vocabulary's embedding is most of it)
and convert in seconds, so a test can break one at will.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TINY = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, context=512)


def tokenizer_fields(gguf_file: Path, vocab: int = 512) -> list[tuple[str, object, object, object]]:
    """``(key, value, type, sub_type)`` of every ``tokenizer.*`` metadata entry of a GGUF file, its
    vocabulary cut to the first ``vocab`` tokens (and the BPE merges among them): transformers reads a
    GGUF tokenizer in Python, ~8 s for the embedded model's 49,152 tokens on a busy 2-core EPYC."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_file))
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            fields[name] = [name, field.contents(), kind, sub]
    tokens = fields["tokenizer.ggml.tokens"][1][:vocab]
    kept = set(tokens)
    fields["tokenizer.ggml.tokens"][1] = tokens
    fields["tokenizer.ggml.token_type"][1] = fields["tokenizer.ggml.token_type"][1][:vocab]
    fields["tokenizer.ggml.merges"][1] = [m for m in fields["tokenizer.ggml.merges"][1]
                                          if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept]
    return [tuple(f) for f in fields.values()]


def write_tiny_gguf(path: Path, tokenizer: list | None, seed: int = 0) -> Path:
    """A tiny random LLaMA as a GGUF file: Q4_1 linear layers, a Q8_0 embedding (tied head), float32 norms,
    as the embedded model ships its weights; ``tokenizer``: :func:`tokenizer_fields`, or None for none
    (a 512-token embedding: enough for a test that never gets past opening the file)."""
    import gguf
    from gguf.quants import quantize

    h, f, layers = TINY["hidden"], TINY["intermediate"], TINY["layers"]
    heads, kv = TINY["heads"], TINY["kv_heads"]
    head_dim = h // heads
    tokenizer = tokenizer or []
    vocab = next((len(v) for k, v, _t, _s in tokenizer if k == "tokenizer.ggml.tokens"), 512)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(TINY["context"])
    writer.add_embedding_length(h)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(f)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value, kind, sub in tokenizer:
        writer.add_key_value(key, value, kind, sub_type=sub)
    rng = np.random.default_rng(seed)

    def blocks(rows: int, cols: int, kind) -> np.ndarray:
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return quantize(w, kind)

    q41, q80 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", blocks(vocab, h, q80), raw_dtype=q80)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, dtype=np.float32))
        for name, rows, cols in (("attn_q", h, h), ("attn_k", kv * head_dim, h), ("attn_v", kv * head_dim, h),
                                 ("attn_output", h, h), ("ffn_gate", f, h), ("ffn_up", f, h), ("ffn_down", h, f)):
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks(rows, cols, q41), raw_dtype=q41)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def overwrite_tensor(path: Path, tensor: str, data: bytes, at: int = 0) -> None:
    """Write ``data`` over the bytes of GGUF tensor ``tensor``, ``at`` bytes into it (the file keeps its size)."""
    import gguf

    offset = next(t.data_offset for t in gguf.GGUFReader(str(path)).tensors if t.name == tensor)
    with open(path, "r+b") as f:
        f.seek(offset + at)
        f.write(data)
