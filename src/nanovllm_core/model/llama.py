"""The LLaMA family of decoder-only transformers, written out in plain PyTorch.

Follows Touvron et al. 2023 ("LLaMA", section 2.2): pre-normalisation with RMSNorm,
SwiGLU feed-forward, rotary position embeddings (Su et al. 2021), and grouped-query
attention (Ainslie et al. 2023) when ``num_key_value_heads < num_attention_heads``.

The model works on one flat token dimension, the way vLLM's models do: a batch of many
sequences, some in prefill and some in decode, is one tensor ``[num_tokens]`` of token ids
with one position each. Attention is the only place where sequences are told apart; it is
delegated to an attention context (paged or contiguous KV cache) passed into ``forward``.

Weights: q/k/v projections are packed into one matrix and gate/up into another, so each
layer runs two matrix multiplications where the checkpoint has five (vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` idea). ``load_weights`` maps the
Hugging Face tensor names onto the packed parameters.

Tensor parallelism (``--tensor-parallel-size N``): ``model/parallel.py`` cuts each rank's
shard out of these same modules (Megatron's split); the model then differs only where the
ranks join their partial results, each marked ``tp`` below: the all-reduce after ``o_proj``
and after ``down_proj``, the vocabulary-split embedding, and the LM head's gather to rank 0.
With ``tp`` None (one process) those lines do nothing.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import nn

# ModelConfig lives with the other value types (config.py) so that attention can name it
# without importing the model; re-exported here, where readers of the model look for it.
from nanovllm_core.config import SUPPORTED_MODEL_TYPES, ModelConfig  # noqa: F401
from nanovllm_core import yield_gate
from nanovllm_core.model import block_quant, native_ops
from nanovllm_core.model.cpu_linear import linear
from nanovllm_core.model.tracer import LayerTracer

class AttentionContext(Protocol):
    """What the model needs from a KV cache: store this layer's new K/V, attend over the context.

    Implemented by the paged attention (``nanovllm_core.attention.paged``) and the contiguous
    baseline (``nanovllm_core.attention.contiguous``).
    """

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[num_tokens, num_heads, head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]``
        -> attention output ``[num_tokens, num_heads, head_dim]``."""
        ...


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): ``x / rms(x) * weight``.

    Computed in float32 and cast back, as transformers does, so half-precision runs agree.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``."""
        weight = self.weight  # a parameter: read once (nn.Module's attribute lookup is the slow path)
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            # In C on the CPU (one pass, batch-invariant order; see native_ops), else PyTorch's
            # fused kernel: the same arithmetic in one pass instead of six.
            out = native_ops.rms_norm(x, weight, self.eps)
            return out if out is not None else nn.functional.rms_norm(x, (x.shape[-1],), weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` of the rotary embedding, float32.

    ``scaling`` of type ``llama3`` applies Llama 3.1's frequency-dependent stretch (long
    wavelengths divided by ``factor``, short ones kept, a smooth blend between); ``linear``
    divides all frequencies by ``factor`` (position interpolation, Chen et al. 2023).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        factor = float(scaling["factor"])
        if kind == "linear":
            inv_freq = inv_freq / factor
        elif kind == "llama3":
            low = float(scaling["low_freq_factor"])
            high = float(scaling["high_freq_factor"])
            old_len = float(scaling["original_max_position_embeddings"])
            low_freq_wavelen = old_len / low
            high_freq_wavelen = old_len / high
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
            smooth = (old_len / wavelen - low) / (high - low)
            blended = (1 - smooth) * scaled / factor + smooth * scaled
            is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            inv_freq = torch.where(is_medium, blended, scaled)
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a precomputed cos/sin table.

    Uses the "rotate half" pairing of transformers' LLaMA (dimension i pairs with
    i + head_dim/2), which is the layout of Hugging Face checkpoints.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self.build_tables()

    def build_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the float32 tables ``[max_position, 1, head_dim]`` on ``device``.

        ``cos_cache`` holds each position's angle cosines written twice, ``(cos, cos)``;
        ``sin_cache`` the sines with the rotation's signs, ``(-sin, sin)`` (what :meth:`apply`
        multiplies by). Stored whole, twice the half-width tables' memory, so that a step's
        :meth:`cos_sin` is one row lookup per table instead of nine small operations (issue 27:
        at batch-1 decode on the CPU those operations were part of the per-token overhead).
        """
        device = device or self.cos_cache.device
        shape = (self.max_position, 1, self.head_dim)
        if torch.device(device).type == "meta":  # shapes only: computing on meta would import torch._dynamo (~2 s)
            self.cos_cache = torch.empty(shape, dtype=torch.float32, device="meta")
            self.sin_cache = torch.empty(shape, dtype=torch.float32, device="meta")
            return
        inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        self.cos_cache = torch.cat((cos, cos), dim=-1).reshape(shape).to(device)
        self.sin_cache = torch.cat((-sin, sin), dim=-1).reshape(shape).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[num_tokens]`` -> (cos, sin), each ``[num_tokens, 1, head_dim]`` (new, contiguous tensors).

        ``cos`` is the angles' cosines written twice, ``(cos, cos)``; ``sin`` carries the
        rotation's signs, ``(-sin, sin)``, so :meth:`apply` is two products and a sum: the
        rows of the tables :meth:`build_tables` made. Built once per step and shared by every
        layer. Positions must be inside the table: the caller checks them with :meth:`check`
        on Python ints (reading the tensor's maximum back would make the CPU wait for the GPU
        every step).
        """
        cos = self.cos_cache.index_select(0, positions)
        sin = self.sin_cache.index_select(0, positions)
        if dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def check(self, max_position: int) -> None:
        """Refuse a position beyond the table.

        Raises:
            ValueError: ``max_position`` >= the table's length (``max_model_len`` too large).
        """
        if max_position >= self.cos_cache.shape[0]:
            raise ValueError(f"position {max_position} is beyond the rotary table "
                             f"({self.cos_cache.shape[0]} positions); lower max_model_len")

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x ``[num_tokens, heads, head_dim]`` by its positions' angles (tables from :meth:`cos_sin`).

        Each pair ``(x1, x2)`` = ``(x[i], x[i + head_dim/2])`` becomes
        ``(x1 cos - x2 sin, x2 cos + x1 sin)``.
        """
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    """Multi-head / grouped-query self-attention with a packed QKV projection.

    Shapes: hidden ``[T, hidden]`` -> q ``[T, num_heads, head_dim]``,
    k/v ``[T, num_kv_heads, head_dim]`` -> output ``[T, hidden]``.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.tp = None  # tensor parallelism: this rank's heads only, o_proj's partial sums all-reduced

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionContext,
        tracer: "LayerTracer | None" = None,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        # Q and K heads are rotated together: one set of operations instead of two.
        qk = qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if not native_ops.rope_(qk, cos, sin):  # in place in C on the CPU: the same bits as apply, one call
            qk = RotaryEmbedding.apply(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        if tracer is not None:
            tracer.qkv(self.layer_idx, x, q, k, v, attn)
        out = attn.forward(self.layer_idx, q, k, v)
        out = self.o_proj(out.reshape(n, self.q_size))
        if self.tp is not None:  # row-parallel o_proj: each rank's heads give a partial sum [T, hidden]
            out = self.tp.all_reduce(out)
        if tracer is not None:
            tracer.attention_output(self.layer_idx, out)
        return out


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``, gate and up packed."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.c_swiglu = False  # set by the loader in block modes (model/quantization.py)
        self.tp = None  # tensor parallelism: this rank's intermediate rows only, down_proj's partial sums all-reduced

    def forward(self, x: torch.Tensor, tracer: "LayerTracer | None" = None) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]`` through ``[T, intermediate]``."""
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        # Block-quantized layers take SwiGLU from the same C as their fused path (block_quant.silu_mul).
        act = block_quant.silu_mul(gate_up) if self.c_swiglu else None
        if act is None:
            act = nn.functional.silu(gate).mul_(up)  # in place: one [T, intermediate] buffer fewer
        out = self.down_proj(act)
        if self.tp is not None:  # row-parallel down_proj: a partial sum [T, hidden] on each rank
            out = self.tp.all_reduce(out)
        if tracer is not None:
            tracer.mlp(self.layer_idx, x, gate, up, act, out)
        return out


class LlamaDecoderLayer(nn.Module):
    """One pre-norm transformer block: ``x + attn(norm(x))`` then ``h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, layer_idx)

    def forward(self, x, cos, sin, attn: AttentionContext, tracer=None) -> torch.Tensor:
        if tracer is not None:
            tracer.layer_input(self.self_attn.layer_idx, x)
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, tracer)
        out = h + self.mlp(self.post_attention_layernorm(h), tracer)
        if tracer is not None:
            tracer.layer_output(self.self_attn.layer_idx, h, out)
        return out


class LlamaForCausalLM(nn.Module):
    """The whole model: embedding, decoder layers, final norm, LM head.

    ``forward`` returns final hidden states ``[num_tokens, hidden]``; ``compute_logits``
    applies the LM head only to the rows that need next-token logits (one per sequence
    that samples this step), which saves a ``[num_tokens, vocab]`` matrix product.
    """

    def __init__(self, cfg: ModelConfig, max_position: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        # Uninitialised (the loader fills every weight): Embedding's own normal_ init, run on the meta device,
        # imports torch._dynamo (about 2 s of a tensor-parallel worker's start-up on a busy 2-core EPYC).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_position or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # None: float weights; else see nanovllm_core.model.quantization, which swaps the
        # nn.Linear modules above for the ones that run (packed float or blocks) after loading.
        self.quantization: str | None = None
        # Block modes on the CPU: every decoder layer of a step in one C call (block_quant.FusedDecoderLayers).
        self.fused_layers: block_quant.FusedDecoderLayers | None = None
        # Tensor parallelism (model/parallel.py): this rank's collectives and its vocabulary rows [start, end).
        self.tp = None
        self.vocab_start, self.vocab_end = 0, cfg.vocab_size

    @property
    def lm_head_matrix(self) -> torch.Tensor:
        """The ``[vocab, hidden]`` output projection (the embedding matrix when tied)."""
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        tracer: "LayerTracer | None" = None,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions ``[num_tokens]`` -> final-normed hidden ``[num_tokens, hidden]``.

        ``num_layers`` runs only the first N decoder layers (early exit, used by
        self-speculative drafting); the final norm is still applied.

        ``tracer``: its hooks are called for the layers in ``tracer.layers`` (None or absent: every
        layer). The other layers run untraced, through the one-call C path where the model has
        one: layers ``[0, L)`` fused, layer ``L`` step by step with the hooks, ``(L, N)`` fused; the
        same bits as all step by step (tests/test_block_quant_real.py), so a traced step costs
        about one step-by-step layer more than an untraced one.
        """
        x = self.embed(input_ids)
        if tracer is not None:
            tracer.embedding(input_ids, x)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        n = len(self.layers) if num_layers is None else num_layers
        wanted = getattr(tracer, "layers", None) if tracer is not None else ()
        traced = range(n) if wanted is None else sorted({i for i in wanted if 0 <= i < n})
        gate = yield_gate.GATE
        i = 0
        for stop in [*traced, n]:  # untraced layers [i, stop), then the traced layer ``stop``
            if i < stop:
                fused = self.fused_layers(x, cos, sin, attn, stop, i) if self.fused_layers else None
                if fused is not None:  # the same operations in C, the same bits (block_quant.FusedDecoderLayers)
                    x = fused
                else:
                    for layer in self.layers[i:stop]:
                        if gate.c.until_ns:  # a front end's key is drawing its frame (yield_gate.py)
                            gate.wait()
                        x = layer(x, cos, sin, attn)
            if stop < n:
                if gate.c.until_ns:
                    gate.wait()
                x = self.layers[stop](x, cos, sin, attn, tracer)
            i = stop + 1
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids ``[num_tokens]`` -> embeddings ``[num_tokens, hidden]``.

        Split over the vocabulary (``tp``): this rank holds rows ``[vocab_start, vocab_end)``,
        looks up the ids it owns, writes zeros for the rest, and an all-reduce sums the ranks'
        rows (one non-zero term per element: the same bits as one process).
        """
        if self.tp is None:
            return self.embed_tokens(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        x = self.embed_tokens((input_ids - self.vocab_start).masked_fill(outside, 0))
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden ``[num_rows, hidden]`` -> logits ``[num_rows, vocab]`` in float32.

        Through ``lm_head`` once the loader has built it (a tied head gets its own module over
        the embedding matrix, float or blocks); before that, through the embedding matrix itself.
        Split over the vocabulary (``tp``): each rank's ``[num_rows, vocab / N]`` is gathered
        to rank 0, which alone gets the logits; the other ranks get None.
        """
        head = self._modules.get("lm_head")
        logits = head(hidden) if head is not None else linear(hidden, self.lm_head_matrix)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        return logits if logits is None or logits.dtype == torch.float32 else logits.float()

    def check_positions(self, max_position: int) -> None:
        """Raise ValueError when ``max_position`` (tokens) is beyond the rotary table (see ``RotaryEmbedding.check``)."""
        self.rotary.check(max_position)

    # ----------------------------------------------------------------------------- weights

    def packed_parameter(self, hf_name: str) -> tuple[torch.Tensor, slice | None] | None:
        """Where a Hugging Face tensor goes: (our parameter, row slice in it) or None if unused.

        ``model.layers.3.self_attn.k_proj.weight`` -> rows ``[q_size, q_size + kv_size)`` of
        layer 3's ``qkv_proj.weight``.
        """
        name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        if name in ("lm_head.weight",):
            return (None if self.config.tie_word_embeddings else (self.lm_head.weight, None))
        if name.startswith("embed_tokens.") or name.startswith("norm."):
            return self._param(name), None
        if not name.startswith("layers."):
            return None
        parts = name.split(".")
        layer = int(parts[1])
        if layer >= len(self.layers):
            return None
        rest = ".".join(parts[2:])
        block = self.layers[layer]
        attn, mlp = block.self_attn, block.mlp
        q, kv, i = attn.q_size, attn.kv_size, mlp.intermediate_size
        packed = {
            "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q)),
            "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv)),
            "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv)),
            "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, i)),
            "mlp.up_proj": ("mlp.gate_up_proj", slice(i, 2 * i)),
        }
        module, _, leaf = rest.rpartition(".")
        if module in packed:
            target, rows = packed[module]
            return self._param(f"layers.{layer}.{target}.{leaf}"), rows
        if rest.endswith("rotary_emb.inv_freq"):
            return None
        return self._param(f"layers.{layer}.{rest}"), None

    def _param(self, name: str) -> torch.Tensor:
        try:
            return self.get_parameter(name)
        except AttributeError:
            raise KeyError(name) from None

    def expected_hf_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face tensor name this model needs, with its shape (``ModelConfig.hf_tensor_shapes``)."""
        return self.config.hf_tensor_shapes()
