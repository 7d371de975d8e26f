"""Quantization is a property of the model's linear layers: the loader builds them here.

``prepare_linear_layers`` runs once, when a model has been loaded from its checkpoint, and
swaps every ``nn.Linear`` (q/k/v, o, gate/up, down) and the LM head for the module that
will run it:

- float (``"none"``): :class:`~nanovllm_core.model.cpu_linear.FloatLinear`, the float
  weight packed for oneDNN now, so that no step pays for packing;
- a block mode (``"gguf"``, ``"q8_0"``, ``"q4_0"``, ``"q4_1"``): :class:`~nanovllm_core.model.block_quant.BlockLinear`.

No flag (``quantization=None`` or ``"auto"``) is a decision, made by :func:`resolve_quantization`
before anything is built: a GGUF checkpoint's own blocks on the CPU where they run, else float.

Every such module reports ``bytes_per_weight`` and ``weight_bytes``; :func:`linear_weight_bytes`
sums them: the bytes of weights one decode step streams from memory at batch 1.

An int8 mode (int8 weights with one scale per output channel, through oneDNN/fbgemm, with
SmoothQuant calibration and outlier channels) was removed: ``"q8_0"`` (int8 weights in
32-weight blocks, each with its own scale) is faster and closer to float32 (see
docs/cpu-kernels.md, "int8 weights: what went and why").
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import numpy as np

# The mode names are value-level facts (EngineConfig checks them), so they live in config.py.
from nanovllm_core.config import (  # noqa: F401  (re-exported)
    AUTO,
    BLOCK_MODES,
    QUANTIZATION_CHOICES,
    QUANTIZATION_MODES,
    built_quantization,
    check_quantization,
    normalize_quantization,
    setting,
)
from nanovllm_core.model import block_quant
from nanovllm_core.model.block_quant import BY_GGML_TYPE
from nanovllm_core.model.cpu_linear import FloatLinear

EMBEDDING_FORMAT = "q8_0"  # the token embedding (and a tied LM head) in every block mode but "gguf"


def _linear_slots(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, module) of every ``nn.Linear`` still in the model."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear)]


def _gguf_reader(gguf_file):
    """``gguf.GGUFReader`` over ``gguf_file`` (it maps the file; nothing is copied).

    Raises:
        ValueError: the file cannot be read, in one line naming it, what it is and what to do
            (``checkpoint_files.open_gguf``).
    """
    from nanovllm_core.model.checkpoint_files import open_gguf

    return open_gguf(gguf_file)


def gguf_block_tensors(gguf_file, cfg) -> dict[str, tuple[str, torch.Tensor | None]]:
    """The weights of a GGUF file under their Hugging Face names: ``{name: (ggml type name, blocks or None)}``.

    ``blocks`` is uint8 ``[rows, K / 32 * block_bytes]`` for a type :mod:`block_quant` runs
    (Q8_0, Q4_0, Q4_1), with q/k rows put back in Hugging Face's rotary order (whole rows move,
    so every block stays as shipped); None for any other type (F32, F16, K-quants ...).

    Raises:
        ValueError: the file cannot be read, or a block's scale is NaN or infinite (the file is
            corrupt: ``weight_checks``), naming the tensor.
    """
    from nanovllm_core.model.gguf_names import gguf_to_hf_name, unpermute_rotary_rows
    from nanovllm_core.model.weight_checks import blocks_phrase, nonfinite_scales

    reader = _gguf_reader(gguf_file)
    out: dict[str, tuple[str, torch.Tensor | None]] = {}
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        fmt = BY_GGML_TYPE.get(int(t.tensor_type))
        blocks = None
        if fmt is not None:
            blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))
            bad = nonfinite_scales(blocks, fmt)
            if bad:
                raise ValueError(f"{Path(gguf_file).name} is corrupt: tensor {t.name} {blocks_phrase(bad, fmt.name)}; "
                                 "re-download it or convert it to GGUF again")
            if name.endswith("self_attn.q_proj.weight"):
                blocks = unpermute_rotary_rows(blocks, cfg.num_attention_heads).contiguous()
            elif name.endswith("self_attn.k_proj.weight"):
                blocks = unpermute_rotary_rows(blocks, cfg.num_key_value_heads).contiguous()
        out[name] = (t.tensor_type.name.lower() if fmt is None else fmt.name, blocks)
    return out


# The decoder-layer weights a block mode runs as BlockLinear (what auto looks at in a GGUF file).
LINEAR_SOURCES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def gguf_tensor_types(gguf_file) -> dict[str, str]:
    """``{Hugging Face name: ggml type name}`` (``"q4_1"``, ``"f32"``, ``"q6_k"`` ...) of a GGUF file's weights.

    Reads the header only (``gguf.GGUFReader`` maps the file; no tensor is copied).

    Raises:
        ValueError: the file cannot be read.
    """
    from nanovllm_core.model.gguf_names import gguf_to_hf_name

    reader = _gguf_reader(gguf_file)
    out = {}
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        if name is not None:
            fmt = BY_GGML_TYPE.get(int(t.tensor_type))
            out[name] = fmt.name if fmt is not None else t.tensor_type.name.lower()
    return out


def resolve_quantization(requested: str | None, gguf_file, device: torch.device | str, dtype: torch.dtype,
                         tensor_parallel_size: int = 1,
                         tensor_types: dict[str, str] | None = None) -> tuple[str | None, str | None]:
    """The mode to build for a request, and why auto chose float: ``(mode or None for float, note or None)``.

    The one place the default is decided. ``requested`` as ``EngineConfig.quantization`` keeps it
    (None = auto). The rule:

    - a named mode (``"none"``, ``"gguf"``, ``"q8_0"``, ``"q4_0"``, ``"q4_1"``) is built as
      asked (``"none"`` -> None); its own checks (CPU only, a GGUF file for ``"gguf"``) come later;
    - auto keeps the file's own blocks (``"gguf"``) when all of these hold, else float (None) with
      a one-line note naming the first that failed: ``tensor_parallel_size`` is 1 (sharded
      layers are float); the checkpoint is a GGUF file (``gguf_file`` not None: a safetensors
      checkpoint holds float weights); the device is the CPU (the block kernels are C for
      the CPU); ``dtype`` is float32 (block layers compute in float32); every decoder-layer
      linear weight is Q8_0, Q4_0 or Q4_1 (the formats ``model/block_quant.py`` runs;
      K-quants and float tensors would run dequantized); the block kernel builds
      (``block_quant.unavailable_reason()``: a C compiler, ``NANOVLLM_BLOCK_KERNELS`` not 0;
      PyTorch's fallback is far slower than float32).

    ``tensor_types``: :func:`gguf_tensor_types` of ``gguf_file`` when the caller has them (the
    loader keeps them beside the converted model), else read from the file.
    ``tensor_parallel_size`` is the hook for sharded engines: the lead wires
    ``EngineConfig.tensor_parallel_size`` into it; until then every caller passes 1.

    Raises:
        ValueError: an unknown ``requested`` name, or a GGUF file that cannot be read.
    """
    name = normalize_quantization(requested)
    if name is not None:
        return built_quantization(name), None
    device = torch.device(device)

    def float_because(why: str) -> tuple[None, str]:
        return None, f"auto chose float weights: {why}"

    if tensor_parallel_size > 1:
        return float_because(f"tensor parallelism ({tensor_parallel_size} ranks) shards float layers")
    if gguf_file is None:
        return float_because("the checkpoint is not a GGUF file (float weights); "
                             "quantization (--quantization) q8_0, q4_0 or q4_1 quantizes it at load")
    if device.type != "cpu":
        return float_because(f"the block kernels run on the CPU, not on {device.type}")
    if dtype != torch.float32:
        return float_because(f"block layers compute in float32, not {str(dtype).replace('torch.', '')}")
    types = tensor_types if tensor_types is not None else gguf_tensor_types(gguf_file)
    linear = [t for n, t in types.items()
              if n.startswith("model.layers.") and any(n.endswith(f".{src}.weight") for src in LINEAR_SOURCES)]
    other = sorted({t for t in linear if t not in block_quant.FORMATS})
    if not linear or other:
        return float_because(f"the file's linear layers are in {', '.join(other) or 'no block format'}, which this "
                             f"engine runs dequantized; {setting('quantization', 'gguf')} keeps what it can")
    reason = block_quant.unavailable_reason()
    if reason is not None:
        return float_because(f"the block kernel is unavailable ({reason}), and PyTorch's fallback is slower than "
                             f"float32; {setting('quantization', 'gguf')} runs it anyway")
    return "gguf", None


# The Hugging Face tensors packed into each of a decoder layer's linear modules, in row order.
PACKED_SOURCES = {
    ("self_attn", "qkv_proj"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn", "o_proj"): ("self_attn.o_proj",),
    ("mlp", "gate_up_proj"): ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp", "down_proj"): ("mlp.down_proj",),
}


def keep_file_blocks(model: nn.Module, file_blocks: dict[str, tuple[str, torch.Tensor | None]]) -> set[str]:
    """Swap in a :class:`~block_quant.BlockLinear` (and :class:`~block_quant.BlockEmbedding`) wherever the file's blocks can run.

    ``file_blocks``: :func:`gguf_block_tensors`. A packed module (qkv, gate_up) takes its tensors'
    blocks, concatenated by rows, when all of them are in one format :mod:`block_quant` runs;
    otherwise it is left as it is (an ``nn.Linear``, to run float). The untied LM head likewise;
    a tied head is built later, over the embedding's blocks.

    Works on a model on the ``meta`` device, before any weight is materialised: the loader calls
    it there, so no float copy of a kept weight is ever made (biases and norms stay float and
    are loaded after). Returns the Hugging Face names the blocks now stand for (the loader
    reads none of them from the float checkpoint); ``model._kept_float`` counts, by ggml type,
    the tensors left float (:func:`_prepare_block_layers` turns it into the note).
    """
    kept: set[str] = set()
    kept_float: dict[str, int] = getattr(model, "_kept_float", None) or {}

    def blocks_for(names: list[str]) -> tuple[torch.Tensor, str] | None:
        found = [file_blocks.get(n, ("missing", None)) for n in names]
        if len({f for f, _ in found}) == 1 and all(b is not None for _, b in found):
            return torch.cat([b for _, b in found]) if len(found) > 1 else found[0][1], found[0][0]
        for f, b in found:
            if b is None:
                kept_float[f] = kept_float.get(f, 0) + 1
        return None

    def swap(parent: nn.Module, attr: str, names: list[str]) -> None:
        child = getattr(parent, attr)
        if not isinstance(child, nn.Linear) or child.in_features % block_quant.BLOCK_SIZE:
            return
        got = blocks_for(names)
        if got is not None:
            setattr(parent, attr, block_quant.BlockLinear(got[0], got[1], child.in_features, child.bias))
            kept.update(names)

    for i, layer in enumerate(model.layers):
        for (part, attr), sources in PACKED_SOURCES.items():
            swap(getattr(layer, part), attr, [f"model.layers.{i}.{src}.weight" for src in sources])
    emb = model.embed_tokens
    if isinstance(emb, nn.Embedding) and emb.embedding_dim % block_quant.BLOCK_SIZE == 0:
        got = blocks_for(["model.embed_tokens.weight"])
        if got is not None:
            model.embed_tokens = block_quant.BlockEmbedding(got[0], got[1], emb.embedding_dim)
            kept.add("model.embed_tokens.weight")
    if not model.config.tie_word_embeddings:
        swap(model, "lm_head", ["lm_head.weight"])
    model._kept_float = kept_float
    return kept


def _prepare_block_layers(model: nn.Module, mode: str, gguf_file) -> None:
    """Swap every linear module (and the embedding) for block ones: the file's blocks or quantized at load.

    ``mode == "gguf"``: :func:`keep_file_blocks` (unless the loader already ran it on the meta
    model); what it left as ``nn.Linear`` runs float, and ``model.quantization_note`` says which
    tensors and types. Other modes quantize the loaded float weights: linear layers in ``mode``,
    embedding and tied LM head in :data:`EMBEDDING_FORMAT`.
    """
    cfg = model.config
    if mode == "gguf" and getattr(model, "_kept_float", None) is None:
        keep_file_blocks(model, gguf_block_tensors(gguf_file, cfg))
    kept_float: dict[str, int] = getattr(model, "_kept_float", None) or {}

    def linear_for(child: nn.Module) -> nn.Module:
        if not isinstance(child, nn.Linear):  # already blocks (the file's)
            return child
        weight = child.weight
        if mode == "gguf" or weight.shape[1] % block_quant.BLOCK_SIZE:
            if mode != "gguf":
                kept_float[f"{list(weight.shape)} (width not a multiple of 32)"] = 1
            return FloatLinear(weight, child.bias)
        return block_quant.BlockLinear.from_float(weight, mode, child.bias)

    for layer in model.layers:
        for part, attr in PACKED_SOURCES:
            parent = getattr(layer, part)
            setattr(parent, attr, linear_for(getattr(parent, attr)))
    emb = model.embed_tokens
    if mode != "gguf" and isinstance(emb, nn.Embedding) and emb.embedding_dim % block_quant.BLOCK_SIZE == 0:
        model.embed_tokens = block_quant.BlockEmbedding(block_quant.quantize(emb.weight, EMBEDDING_FORMAT),
                                                        EMBEDDING_FORMAT, emb.embedding_dim)
    emb = model.embed_tokens
    if cfg.tie_word_embeddings:
        model.lm_head = (block_quant.BlockLinear.sharing(emb)
                         if isinstance(emb, block_quant.BlockEmbedding) else FloatLinear(emb.weight))
    elif isinstance(model.lm_head, nn.Linear):
        head = model.lm_head.weight
        model.lm_head = (block_quant.BlockLinear.from_float(head, EMBEDDING_FORMAT)
                         if mode != "gguf" and head.shape[1] % block_quant.BLOCK_SIZE == 0 else FloatLinear(head))
    model.quantization_note = None
    model._kept_float = None
    if kept_float:
        what = ", ".join(f"{n} x {k}" for k, n in sorted(kept_float.items()))
        model.quantization_note = (f"some weights are not in a block format this engine runs ({what}); "
                                   "they run dequantized to float32")


def weight_formats(model: nn.Module) -> dict[str, int]:
    """``{format: bytes}`` over the linear layers, the LM head and the embedding, as built: what runs.

    Formats are ``float32`` (or the model's dtype), ``q8_0``, ``q4_0``, ``q4_1``; a tied
    head that reads the embedding's blocks is counted once.
    """
    out: dict[str, int] = {}
    seen: set[int] = set()
    for m in [*linear_modules(model), model.embed_tokens]:
        packed, weight = getattr(m, "packed", None), m._parameters.get("weight")
        if packed is not None:  # a block module (BlockLinear, BlockEmbedding): the bytes it reads
            key, size = packed.data_ptr(), packed.numel()
        else:
            key, size = weight.data_ptr(), weight.numel() * weight.element_size()
        if key in seen:
            continue
        seen.add(key)
        kind = getattr(m, "kind", None) or str(weight.dtype).replace("torch.", "")
        out[kind] = out.get(kind, 0) + size
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def describe_weights(model: nn.Module) -> str:
    """One line naming what runs, by format and bytes, from :func:`weight_formats`:
    ``q4_1 66 MB + q8_0 30 MB (96 MB of weights)``, or ``float32 538 MB of weights`` for one format."""
    formats = weight_formats(model)
    total = sum(formats.values())
    parts = [f"{k} {v / 1e6:.0f} MB" for k, v in sorted(formats.items(), key=lambda kv: -kv[1])]
    if len(parts) == 1:
        return f"{parts[0]} of weights"
    return f"{' + '.join(parts)} ({total / 1e6:.0f} MB of weights)"


def prepare_linear_layers(model: nn.Module, quantization: str | None = None, gguf_file=None) -> None:
    """Build the runtime linear modules of a loaded ``LlamaForCausalLM``, in place (see the module docstring).

    ``quantization``: the mode to build, never auto (None or ``"none"``: float; the loader
    resolves auto first with :func:`resolve_quantization`).

    ``gguf_file``: the checkpoint's GGUF file, needed for ``"gguf"``. Sets ``model.quantization``,
    ``model.quantization_note`` and ``model.lm_head``.

    Raises:
        ValueError: an unknown mode or ``"auto"``, a quantized mode on a device other than the CPU, or
            ``"gguf"`` without a GGUF file.
    """
    quantization = built_quantization(quantization)
    device = model.norm.weight.device
    if quantization is not None and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on the CPU (this engine's C kernels), not on {device.type}; "
                         f"use {setting('device', 'cpu')} or {setting('quantization', 'none')}")
    model.quantization_note = None
    if quantization in BLOCK_MODES:
        if quantization == "gguf" and gguf_file is None:
            raise ValueError("quantization='gguf' keeps a GGUF file's blocks, but this model was not loaded from one; "
                             "use q8_0, q4_0 or q4_1")
        _prepare_block_layers(model, quantization, gguf_file)
        model.quantization = quantization
        if block_quant.FusedDecoderLayers.supported(model):
            for layer in model.layers:
                layer.mlp.c_swiglu = True
            model.fused_layers = block_quant.FusedDecoderLayers(model)
        return
    for parent, name, child in _linear_slots(model):
        setattr(parent, name, FloatLinear(child.weight, child.bias))
    if model.config.tie_word_embeddings:
        model.lm_head = FloatLinear(model.embed_tokens.weight, None)
    model.quantization = quantization


def linear_modules(model: nn.Module) -> list[nn.Module]:
    """Every module that reports ``weight_bytes`` (the decoder layers' linears and the LM head), each once."""
    seen: dict[int, nn.Module] = {}
    for m in model.modules():
        if hasattr(m, "weight_bytes") and hasattr(m, "bytes_per_weight"):
            seen.setdefault(id(m), m)
    return list(seen.values())


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of linear-layer weights (scales included) one forward pass reads: every step's weight traffic."""
    return sum(m.weight_bytes for m in linear_modules(model))


def linear_weight_count(model: nn.Module) -> int:
    """Number of weights (elements) in the linear layers and the LM head: what :func:`linear_weight_bytes` stores."""
    return sum(m.out_features * m.in_features for m in linear_modules(model))
