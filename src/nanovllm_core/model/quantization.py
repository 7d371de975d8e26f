"""Quantization is a property of the model's linear layers: the loader builds them here.

``prepare_linear_layers`` runs once, when a model has been loaded from its checkpoint, and
swaps every ``nn.Linear`` (q/k/v, o, gate/up, down) and the LM head for the module that
will run it:

- float (``"none"``): :class:`~nanovllm_core.model.cpu_linear.FloatLinear`, the float
  weight packed for oneDNN now, so that no step pays for packing;
- a block mode (``"gguf"``, ``"q8_0"``, ``"q4_0"``, ``"q4_1"``): :class:`~nanovllm_core.model.block_quant.BlockLinear`;
- ``quantization="int8"``: :class:`~nanovllm_core.model.int8_linear.Int8Linear`, int8
  weights with one scale per output channel, activations quantized per token. The token
  embedding stays float (a lookup reads one row, not the matrix); a tied LM head gets its
  own int8 copy of the embedding matrix.

No flag (``quantization=None`` or ``"auto"``) is a decision, made by :func:`resolve_quantization`
before anything is built: a GGUF checkpoint's own blocks on the CPU where they run, else float.

Every such module reports ``bytes_per_weight`` and ``weight_bytes``; :func:`linear_weight_bytes`
sums them: the bytes of weights one decode step streams from memory at batch 1.

For int8, the inputs of q/k/v and gate/up (RMSNorm outputs, a few channels 10-30x larger
than the rest in SmolLM2) are smoothed first (SmoothQuant, Xiao et al. 2023, section 4):
the largest magnitude of each input channel is measured by running the float model once over
a fixed calibration text (:data:`CALIBRATION_TEXT`, about 80 tokens), and each channel j is
divided by ``s_j = sqrt(max|x_j| / max|W[:, j]|)`` while the weight's column j is multiplied
by it. The same pass picks, for every linear layer and the LM head, the
:data:`OUTLIER_CHANNELS` input channels with the largest (smoothed) maxima; those skip int8
and take a finer integer grid of their own (:func:`outlier_channels`, LLM.int8()'s decomposition).
Measured on the default model, int8 perplexity against float32 on ``benchmarks/corpus.txt``
(1,508 tokens) and, held out, the project's seed README (4,526 tokens): +2.70 % / +3.57 %
with smoothing alone, +0.93 % / +0.73 % with 16 outlier channels as well (in float64),
+0.90 % / +0.68 % with those on their own 12-bit x 10-bit integer grid (now).
"""

from __future__ import annotations

from typing import Iterable

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
)
from nanovllm_core.model import block_quant
from nanovllm_core.model.block_quant import BY_GGML_TYPE
from nanovllm_core.model.cpu_linear import FloatLinear
from nanovllm_core.model.int8_linear import Int8Linear

EMBEDDING_FORMAT = "q8_0"  # the token embedding (and a tied LM head) in every block mode but "gguf"

CALIBRATION_TEXT = (
    "A short calibration passage: the committee met on Tuesday to discuss the budget, the new library, "
    "and the repairs to the old bridge. Numbers were read aloud: 12, 250, 3,400. Someone asked why; "
    "nobody knew. def f(x):\n    return x * 2\n\"Hello,\" she said, \"is this the way to the station?\""
)
SMOOTHING_ALPHA = 0.5  # SmoothQuant's migration strength: 0.5 splits the range evenly between x and W
OUTLIER_CHANNELS = 16  # input channels per linear layer kept out of int8 (see outlier_channels) ...
OUTLIER_SHARE = 1 / 32  # ... and at most this share of them, so a small model stays mostly int8


def attention_sum_dtype(mode: str | None, batch_invariant_kernel: bool = False) -> torch.dtype | None:
    """The dtype attention computes in under ``mode``: float64 for int8, None (the model's dtype) otherwise.

    ``batch_invariant_kernel``: attention runs on a kernel whose sums no batch, chunking or
    padding changes (the CPU paged kernel, ``attention.cpu_paged``); then int8 needs nothing
    wider and this returns None. Below is why the other kernels need float64.

    Why int8 needs it. Each int8 layer quantizes its input per token, a whole rounding step
    (1/127 of the row's largest value) for any value near a rounding boundary. The int8
    products are exact and per token, but attention's float32 sums are not batch-invariant:
    the CPU's SDPA kernel and matmul round in an order that depends on the number of query
    rows (a prompt at once, in chunks, or one decode at a time), on the padding of a decode
    group and on the chunking of the context. Measured on the default model ("In 1492,
    Christopher Columbus", 9 tokens): layer 0's attention output differed by 1e-7 between a
    whole prefill and chunks of 3; re-quantized, that became 7e-6 after layer 0, 0.09 after
    layer 2 and 1.9 in the final hidden state, enough to change greedy tokens. In float64
    the same sums differ by ~1e-16 relative, which rounding back to float32 removes (a
    difference survives only for a value within ~1e-16 of a float32 rounding midpoint, about
    one in 10^8, and then changes an int8 input only if that too sits at a boundary): the
    same measurement gives bit-identical hidden states at every layer. The price is bytes:
    float64 K/V double the cache and its gathers, and on the 64-request workload (2-core
    Xeon) int8's float64 attention took longer than its int8 linear layers.
    """
    return torch.float64 if mode == "int8" and not batch_invariant_kernel else None


def _linear_slots(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, module) of every ``nn.Linear`` still in the model."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear)]


def _smoothed_inputs(model: nn.Module) -> list[nn.Linear]:
    """The linear layers that read an RMSNorm output: q/k/v and gate/up of every decoder layer."""
    return [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)]


LM_HEAD_INPUT = "lm_head"  # key of the final hidden state's maxima in input_channel_maxima's result


@torch.no_grad()
def input_channel_maxima(model: nn.Module, modules: Iterable[nn.Module], token_ids: list[int]) -> dict[nn.Module | str, torch.Tensor]:
    """Run the float model once over ``token_ids``; for each module, ``max |x|`` per input channel ``[in_features]``.

    Also the LM head's input (the final-normed hidden state ``forward`` returns), under the
    key :data:`LM_HEAD_INPUT`: the head is built after this pass, so there is no module to hook.
    Token ids longer than the model's rotary table (``max_model_len``) run as windows of that length.
    """
    from nanovllm_core.attention.contiguous import ContiguousKVCache

    maxima: dict[nn.Module, torch.Tensor] = {}

    def record(module, args):
        m = args[0].detach().abs().amax(dim=0).float()
        maxima[module] = torch.maximum(maxima[module], m) if module in maxima else m

    hooks = [m.register_forward_pre_hook(record) for m in modules]
    try:
        device = next(model.parameters()).device
        # A model built for a short context (max_model_len below the text's length) has rotary
        # tables only that long: the text then runs as consecutive windows, each from position 0.
        window = max(1, min(len(token_ids), model.rotary.max_position))
        for start in range(0, len(token_ids), window):
            chunk = token_ids[start:start + window]
            n = len(chunk)
            cache = ContiguousKVCache(model.config, n, next(model.parameters()).dtype, device)
            hidden = model(torch.tensor(chunk, device=device), torch.arange(n, device=device), cache.context(0, n))
            m = hidden.detach().abs().amax(dim=0).float()
            maxima[LM_HEAD_INPUT] = torch.maximum(maxima[LM_HEAD_INPUT], m) if LM_HEAD_INPUT in maxima else m
    finally:
        for h in hooks:
            h.remove()
    return maxima


def smoothing_factors(x_max: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """SmoothQuant's per-channel factors ``s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha)`` ``[in_features]``."""
    w_max = weight.detach().abs().amax(dim=0).float().clamp(min=1e-5)
    return (x_max.clamp(min=1e-5) ** alpha / w_max ** (1 - alpha)).clamp(min=1e-5)


def num_outlier_channels(in_features: int) -> int:
    """How many input channels a layer with ``in_features`` keeps out of int8: :data:`OUTLIER_CHANNELS`,
    at most :data:`OUTLIER_SHARE` of them."""
    return min(OUTLIER_CHANNELS, int(in_features * OUTLIER_SHARE))


def outlier_channels(x_max: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """The ``count`` input channels of largest calibrated ``max |x|`` ``[in_features]``, ``[count]`` long, ascending.

    ``count`` defaults to :data:`OUTLIER_CHANNELS`, at most :data:`OUTLIER_SHARE` of the channels
    (16 of the default model's 576 or 1536). On the default model, against float32 on
    ``benchmarks/corpus.txt``: int8 perplexity +2.70 % with none, +1.58 % with 4, +0.90 % with
    16 (``benchmarks/benchmark_quantization.py`` prints the current figure).

    LLM.int8() (Dettmers et al. 2022, section 3.2) finds that a few hidden channels carry
    values far larger than the rest, in every layer and nearly every token; a per-token int8
    scale set by them leaves the other channels only a few levels. Those channels are the
    same from token to token, so here they are picked once, at load, from the calibration pass.
    """
    count = num_outlier_channels(x_max.numel()) if count is None else count
    count = max(0, min(count, x_max.numel()))
    return torch.topk(x_max, count).indices.sort().values


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """Token ids of :data:`CALIBRATION_TEXT` (or, with no usable tokenizer, a fixed run of ids below ``vocab_size``)."""
    try:
        ids = [i for i in tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False) if 0 <= i < vocab_size]
    except Exception:  # a model folder without a real tokenizer (tests): any fixed input will do
        ids = []
    return ids or [(17 * i + 5) % vocab_size for i in range(80)]


def _gguf_reader(gguf_file):
    """``gguf.GGUFReader`` over ``gguf_file`` (it maps the file; nothing is copied).

    Raises:
        ValueError: the file cannot be read, in one line naming it and why.
    """
    import gguf

    try:
        return gguf.GGUFReader(str(gguf_file))
    except Exception as e:
        raise ValueError(f"{gguf_file} could not be read ({type(e).__name__}: {e})") from None


def gguf_block_tensors(gguf_file, cfg) -> dict[str, tuple[str, torch.Tensor | None]]:
    """The weights of a GGUF file under their Hugging Face names: ``{name: (ggml type name, blocks or None)}``.

    ``blocks`` is uint8 ``[rows, K / 32 * block_bytes]`` for a type :mod:`block_quant` runs
    (Q8_0, Q4_0, Q4_1), with q/k rows put back in Hugging Face's rotary order (whole rows move,
    so every block stays as shipped); None for any other type (F32, F16, K-quants ...).

    Raises:
        ValueError: the file cannot be read.
    """
    from nanovllm_core.model.gguf_names import gguf_to_hf_name, unpermute_rotary_rows

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

    - a named mode (``"none"``, ``"gguf"``, ``"q8_0"``, ``"q4_0"``, ``"q4_1"``, ``"int8"``) is built as
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
                             "--quantization q8_0, q4_0 or q4_1 quantizes it at load")
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
                             "engine runs dequantized; --quantization gguf keeps what it can")
    reason = block_quant.unavailable_reason()
    if reason is not None:
        return float_because(f"the block kernel is unavailable ({reason}), and PyTorch's fallback is slower than "
                             "float32; --quantization gguf runs it anyway")
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
        model.lm_head = (block_quant.BlockLinear(emb.blocks, emb.format, emb.embedding_dim)
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

    Formats are ``float32`` (or the model's dtype), ``int8``, ``q8_0``, ``q4_0``, ``q4_1``; a tied
    head that reads the embedding's blocks is counted once.
    """
    out: dict[str, int] = {}
    seen: set[int] = set()
    for m in [*linear_modules(model), model.embed_tokens]:
        blocks, weight = getattr(m, "blocks", None), m._parameters.get("weight")
        if blocks is not None:
            key, size = blocks.data_ptr(), blocks.numel()
        elif weight is not None:
            key, size = weight.data_ptr(), weight.numel() * weight.element_size()
        else:  # int8: its own packed tensors, counted by the module
            key, size = id(m), m.weight_bytes
        if key in seen:
            continue
        seen.add(key)
        kind = getattr(m, "kind", None) or str(weight.dtype).replace("torch.", "")
        out[kind] = out.get(kind, 0) + size
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def describe_weights(model: nn.Module) -> str:
    """One line naming what runs: ``q4_1 (file blocks) + q8_0 embedding`` style, from :func:`weight_formats`."""
    formats = weight_formats(model)
    total = sum(formats.values())
    parts = [f"{k} {v / 1e6:.0f} MB" for k, v in sorted(formats.items(), key=lambda kv: -kv[1])]
    return f"{' + '.join(parts)} ({total / 1e6:.0f} MB of weights)"


def prepare_linear_layers(model: nn.Module, quantization: str | None = None,
                          token_ids: list[int] | None = None, gguf_file=None) -> None:
    """Build the runtime linear modules of a loaded ``LlamaForCausalLM``, in place (see the module docstring).

    ``quantization``: the mode to build, never auto (None or ``"none"``: float; the loader
    resolves auto first with :func:`resolve_quantization`).

    ``token_ids``: the int8 calibration input (default: 80 fixed ids; the loader passes
    :data:`CALIBRATION_TEXT` tokenized). ``gguf_file``: the checkpoint's GGUF file, needed for
    ``"gguf"``. Sets ``model.quantization``, ``model.quantization_note`` and ``model.lm_head``.

    Raises:
        ValueError: an unknown mode or ``"auto"``, a quantized mode on a device other than the CPU, or
            ``"gguf"`` without a GGUF file.
    """
    quantization = built_quantization(quantization)
    device = model.norm.weight.device
    if quantization is not None and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on the CPU (this engine's C kernels), not on {device.type}; "
                         "use device='cpu' or --quantization none")
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
    smooth: dict[nn.Module, torch.Tensor] = {}
    outliers: dict[nn.Module | str, torch.Tensor] = {}
    if quantization == "int8":
        ids = token_ids or calibration_ids(None, model.config.vocab_size)
        smoothed = _smoothed_inputs(model)
        maxima = input_channel_maxima(model, [child for _, _, child in _linear_slots(model)], ids)
        smooth = {m: smoothing_factors(maxima[m], m.weight) for m in smoothed}
        outliers = {m: outlier_channels(x_max / smooth[m] if m in smooth else x_max)
                    for m, x_max in maxima.items()}
        if not model.config.tie_word_embeddings:  # an own lm_head is never run by forward: give it the hidden's
            outliers[model.lm_head] = outliers[LM_HEAD_INPUT]

    def build(weight: torch.Tensor, bias: torch.Tensor | None, key: nn.Module | str) -> nn.Module:
        if quantization == "int8":
            return Int8Linear.from_float(weight, bias, smooth.get(key), outliers.get(key))
        return FloatLinear(weight, bias)

    for parent, name, child in _linear_slots(model):
        setattr(parent, name, build(child.weight, child.bias, child))
    if model.config.tie_word_embeddings:
        model.lm_head = build(model.embed_tokens.weight, None, LM_HEAD_INPUT)
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


def int8_weight_bytes(model: nn.Module) -> int:
    """Bytes :func:`linear_weight_bytes` would count were this model loaded with ``quantization="int8"``.

    From the layer shapes alone (no calibration), so a float model can say what int8 would
    change: the tutorial's decode chapter prints it.
    """
    smoothed = {id(m) for m in _smoothed_inputs(model)}
    return sum(Int8Linear.bytes_for(m.out_features, m.in_features, id(m) in smoothed, num_outlier_channels(m.in_features))
               for m in linear_modules(model))


def linear_weight_count(model: nn.Module) -> int:
    """Number of weights (elements) in the linear layers and the LM head: what :func:`linear_weight_bytes` stores."""
    return sum(m.out_features * m.in_features for m in linear_modules(model))
