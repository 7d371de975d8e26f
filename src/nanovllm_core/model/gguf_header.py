"""A GGUF file's header checked against itself and its tensors, before anything is converted or built.

A header value no LLaMA can have (0 layers, 3 KV heads for 4 query heads, a NaN epsilon or RoPE
base, a context of 0 tokens) either crashed far from its cause (a ``ZeroDivisionError`` sizing the
KV pool, a reshape in the first forward pass) or loaded and generated garbage (trial 16d). Here
each is refused in one line naming the file, the GGUF key and its value, and what to do; the
fault is in the file, so the advice is a fresh copy of it (:data:`config.FILE_FAULT`).

Two passes, both on the header alone (no tensor is read or dequantized):

- :func:`check_gguf_header`: the metadata's numbers (``config.architecture_problem`` on them,
  named by their GGUF keys; :data:`GGUF_NAMES`), the RoPE dimension count and the special
  token ids against the vocabulary, before transformers reads the file (it divides by the head
  count and indexes the token list, and would fail in its own words);
- :func:`check_gguf_tensors`: the tensors against the configuration built from that header:
  as many ``blk.N`` blocks as ``llama.block_count`` says, every tensor the model needs present,
  each of the shape the sizes imply.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from nanovllm_core.config import FILE_FAULT, ModelConfig, architecture_problem, config_fault
from nanovllm_core.model.gguf_names import gguf_to_hf_name

# The Hugging Face field each LLaMA GGUF key becomes (llama.cpp's gguf-py constants; transformers' GGUF mapping).
GGUF_NAMES = {
    "vocab_size": "llama.vocab_size",
    "hidden_size": "llama.embedding_length",
    "intermediate_size": "llama.feed_forward_length",
    "num_hidden_layers": "llama.block_count",
    "num_attention_heads": "llama.attention.head_count",
    "num_key_value_heads": "llama.attention.head_count_kv",
    "head_dim": "llama.attention.key_length",
    "max_position_embeddings": "llama.context_length",
    "rms_norm_eps": "llama.attention.layer_norm_rms_epsilon",
    "rope_theta": "llama.rope.freq_base",
    "rope_scaling": "llama.rope.scaling.type",
    "rope_scaling.factor": "llama.rope.scaling.factor",
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
}
TOKENS = "tokenizer.ggml.tokens"
TOKEN_ID_KEYS = tuple(f"tokenizer.ggml.{kind}_token_id"
                      for kind in ("bos", "eos", "unknown", "padding", "seperator", "eot", "eom"))
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _value(reader: Any, key: str) -> Any:
    """The value of metadata ``key`` (None when absent): a number, a string, or a list for an array."""
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # a field the reader cannot decode: shown as what it is
        return f"<unreadable {key}>"


def check_gguf_header(reader: Any, path: Path) -> None:
    """Refuse a LLaMA GGUF header whose numbers cannot be right (``reader``: a ``gguf.GGUFReader``).

    Raises:
        ValueError: one line: the file's name, the key and its value, why, and to get a fresh copy.
    """
    def fault(key: str, value: Any, why: str) -> ValueError:
        return ValueError(config_fault(path.name, key, value, why))

    tokens = reader.fields.get(TOKENS)
    vocab_tokens = len(tokens.data) if tokens is not None else None
    raw: dict[str, Any] = {name: _value(reader, key) for name, key in GGUF_NAMES.items() if "." not in name}
    for name, key in GGUF_NAMES.items():  # absent keys take transformers' defaults; present ones are checked
        if raw.get(name) is None:
            raw[name] = {"vocab_size": vocab_tokens or 1, "num_key_value_heads": raw["num_attention_heads"],
                         "rope_theta": 10000.0, "max_position_embeddings": 2048}.get(name)
    kind = raw.pop("rope_scaling")
    raw["rope_scaling"] = None
    if kind not in (None, "none", "linear", "yarn"):
        raise fault(GGUF_NAMES["rope_scaling"], kind, "not a RoPE scaling kind (none, linear, yarn)")
    if kind not in (None, "none"):
        raw["rope_scaling"] = {"rope_type": "linear", "factor": _value(reader, GGUF_NAMES["rope_scaling.factor"])}
    problem = architecture_problem(raw, GGUF_NAMES)
    if problem is not None:
        name, value, why = problem
        raise fault(GGUF_NAMES.get(name, name), value, why)
    head_dim = raw["head_dim"] or raw["hidden_size"] // raw["num_attention_heads"]
    value_length = _value(reader, "llama.attention.value_length")
    if value_length is not None and value_length != head_dim:
        raise fault("llama.attention.value_length", value_length, f"not the head size {head_dim}")
    rope_dims = _value(reader, "llama.rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise fault("llama.rope.dimension_count", rope_dims, f"not the head size {head_dim} (LLaMA turns whole heads)")
    if vocab_tokens is not None:
        if vocab_tokens == 0:
            raise fault(TOKENS, [], "an empty vocabulary")
        for key in TOKEN_ID_KEYS:
            token = _value(reader, key)
            if token is not None and not (isinstance(token, int) and 0 <= token < vocab_tokens):
                raise fault(key, token, f"outside the {vocab_tokens:,} tokens of {TOKENS}")


def check_gguf_tensors(reader: Any, path: Path, cfg: ModelConfig) -> None:
    """Refuse a GGUF file whose tensors do not match ``cfg``, the configuration read from its header.

    Checked in this order: the ``blk.N`` blocks present against ``llama.block_count`` (all of
    0 to N-1, none beyond); every tensor the model needs present; each tensor's shape (the
    header's dims reversed: ggml lists the fastest-varying first) against the sizes.

    Raises:
        ValueError: one line: the file's name, what disagrees with what, and to get a fresh copy.
    """
    blocks = sorted({int(m.group(1)) for t in reader.tensors if (m := _BLOCK.match(t.name))})
    if blocks != list(range(cfg.num_hidden_layers)):
        held = f"blocks blk.{blocks[0]} to blk.{blocks[-1]} ({len(blocks)} in all)" if blocks else "no blocks"
        raise ValueError(f"{path.name}: llama.block_count is {cfg.num_hidden_layers} but the file's tensors hold "
                         f"{held}; {FILE_FAULT}")
    expected = cfg.hf_tensor_shapes()
    present: set[str] = set()
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        present.add(name)
        want = expected.get(name)
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        if want is not None and shape != want:
            raise ValueError(f"{path.name}: tensor {t.name} has shape {list(shape)} where the header's sizes imply "
                             f"{list(want)} ({_sizes(cfg)}); {FILE_FAULT}")
    missing = [name for name in expected if name not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{path.name}: the file holds no tensor for {missing[0]}{more}, which its header implies; "
                         f"{FILE_FAULT}")


def _sizes(cfg: ModelConfig) -> str:
    """The header's sizes a tensor's shape follows from, as ``key value`` pairs."""
    return (f"llama.embedding_length {cfg.hidden_size}, llama.feed_forward_length {cfg.intermediate_size}, "
            f"llama.attention.head_count {cfg.num_attention_heads}, llama.attention.head_count_kv "
            f"{cfg.num_key_value_heads}, head size {cfg.head_dim}, vocabulary {cfg.vocab_size}")
