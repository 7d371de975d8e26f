"""Tensor parallelism's arithmetic: which rows of each weight a rank keeps, and the collectives that join them.

Follows the Megatron-LM split (Shoeybi et al. 2019, section 3), as vLLM's
``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding`` do, over
``N = world_size`` ranks, rank ``r`` keeping:

- ``qkv_proj`` (column-parallel): query heads ``[r*H/N, (r+1)*H/N)`` and KV heads
  ``[r*K/N, (r+1)*K/N)``: weight ``[(H/N + 2K/N) * head_dim, hidden]``. Each rank attends with
  its own heads over its own slice of the KV pool: attention needs no communication.
- ``o_proj`` (row-parallel): the matching input columns, weight ``[hidden, H/N * head_dim]``;
  each rank's product is a partial sum, joined by **one all-reduce** ``[num_tokens, hidden]``.
- ``gate_up_proj`` (column-parallel): intermediate rows ``[r*I/N, (r+1)*I/N)`` of gate and of
  up, weight ``[2I/N, hidden]``; SwiGLU is elementwise, so it runs on the shard.
- ``down_proj`` (row-parallel): weight ``[hidden, I/N]``, then **one all-reduce**.
- ``embed_tokens`` (vocabulary-parallel): rows ``[r*V/N, (r+1)*V/N)``; a rank looks up the
  ids it owns, writes zeros for the others, and **one all-reduce** sums the rows (exactly:
  one non-zero term per element). The LM head (tied or not) has the same rows: each rank
  computes logits for its slice of the vocabulary ``[rows, V/N]``, and a **gather** to rank
  0 joins them into ``[rows, V]`` (only rank 0 samples).

A forward pass therefore makes ``2 * num_layers + 1`` all-reduces (61 for SmolLM2's 30
layers) and one gather. Biases of row-parallel layers are kept by rank 0 only (the others
hold zeros), so the all-reduce adds them once.

Sizes that work: N divides the query heads, the KV heads, the intermediate size and the
vocabulary (:func:`valid_sizes`). No head is replicated: a model with 3 KV heads runs on 1
or 3 ranks, not 2.

Determinism: an all-reduce sums the same N partial results in the same order on every rank
(gloo's ring and NCCL's algorithms give every rank identical bits), so the ranks stay in
lock step and a run repeats bit for bit. A sum of N partial products differs from one
product over the whole row in the last bits, so logits differ from ``N = 1`` by rounding: in
float32 the stated (and tested) bound is 1e-4 on every top log-probability; measured 1.6e-5
on SmolLM2 at N = 3 (top 3 of 5 greedy tokens; tests/test_tensor_parallel.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nanovllm_core.config import ModelConfig
from nanovllm_core.split_rule import SPLIT_SIZES, split_sizes  # noqa: F401 (the rule lives without torch)


# The sizes every N must divide, in the words the teaching uses (tutorial chapter 13, the
# X-Ray, docs/engine.md): one list, so the rule the engine checks and the rule it teaches
# cannot drift apart (``educational.tp_facts.valid_sizes`` calls :func:`split_sizes`).
def valid_sizes(cfg: ModelConfig, limit: int = 64) -> list[int]:
    """Every N <= ``limit`` that divides the query heads, KV heads, intermediate size and vocabulary."""
    return split_sizes(limit, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                       cfg.vocab_size)


def check_size(cfg: ModelConfig, size: int, model_name: str = "this model") -> None:
    """Refuse a tensor-parallel size that does not split the model evenly.

    Raises:
        ValueError: ``size`` does not divide the query heads, KV heads, intermediate size or
            vocabulary (one line naming the sizes that work).
    """
    if size in valid_sizes(cfg, max(size, 1)):
        return
    works = ", ".join(str(n) for n in valid_sizes(cfg, 16))
    raise ValueError(f"tensor_parallel_size={size} does not split {model_name} ({cfg.num_attention_heads} query heads, "
                     f"{cfg.num_key_value_heads} KV heads, intermediate size {cfg.intermediate_size}, vocabulary "
                     f"{cfg.vocab_size}) evenly; sizes that work: {works}")


@dataclass
class CommStats:
    """What one rank's collectives cost in the current step: counts, bytes, and seconds of
    ``time.perf_counter`` around each call (waiting for the slowest rank included)."""

    all_reduces: int = 0
    all_reduce_bytes: int = 0
    gathers: int = 0
    gather_bytes: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # each all-reduce's seconds, in order

    def as_tuple(self) -> tuple[int, int, int, int, float, tuple[float, ...]]:
        return (self.all_reduces, self.all_reduce_bytes, self.gathers, self.gather_bytes, self.seconds,
                tuple(self.latencies))


class TensorParallel:
    """One rank's view of the group: its rank, the group size, and the collectives the model calls.

    Args:
        rank: this process's rank, 0..world_size-1 (rank 0 samples).
        world_size: N.
        group: the ``torch.distributed`` process group (None only when ``world_size`` is 1).
    """

    def __init__(self, rank: int, world_size: int, group: Any = None) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.stats = CommStats()

    def reset_stats(self) -> CommStats:
        """Start counting a new step; returns the finished step's stats."""
        done, self.stats = self.stats, CommStats()
        return done

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (any shape) over the ranks, in place; every rank gets the same bits."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        dt = time.perf_counter() - t0
        s = self.stats
        s.all_reduces += 1
        s.all_reduce_bytes += x.numel() * x.element_size()
        s.seconds += dt
        s.latencies.append(dt)
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor | None:
        """Join per-rank logits ``[rows, V/N]`` into ``[rows, V]`` on rank 0 (None on the other ranks)."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0, group=self.group)
        s = self.stats
        s.gathers += 1
        s.gather_bytes += local.numel() * local.element_size()
        s.seconds += time.perf_counter() - t0
        return torch.cat(parts, dim=-1) if parts is not None else None

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this rank's head counts and intermediate size (what its KV pool and layers hold)."""
        n = self.world_size
        return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // n,
                                   num_key_value_heads=cfg.num_key_value_heads // n,
                                   intermediate_size=cfg.intermediate_size // n)

    def span(self, total: int) -> tuple[int, int]:
        """This rank's ``[start, end)`` of ``total`` things split evenly."""
        part = total // self.world_size
        return self.rank * part, (self.rank + 1) * part


def shard_spans(cfg: ModelConfig, rank: int, world_size: int, num_blocks: int | None = None,
                block_size: int | None = None) -> dict[str, Any]:
    """What rank ``rank`` of ``world_size`` keeps, as ``[start, end)`` spans and weight shapes of one decoder layer.

    Keys: ``rank``; ``q_heads``, ``kv_heads``, ``intermediate``, ``vocab`` (spans);
    ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, ``embed_tokens`` (weight shapes
    ``[out, in]``); ``kv_pool_per_layer`` (K or V shape of its slice of one layer's pool,
    ``[kv_heads, num_blocks, block_size, head_dim]``; 0 for a size not given).
    """
    tp = TensorParallel(rank, world_size)
    h, d = cfg.hidden_size, cfg.head_dim
    q0, q1 = tp.span(cfg.num_attention_heads)
    k0, k1 = tp.span(cfg.num_key_value_heads)
    i0, i1 = tp.span(cfg.intermediate_size)
    v0, v1 = tp.span(cfg.vocab_size)
    nq, nkv, ni = q1 - q0, k1 - k0, i1 - i0
    return {"rank": rank, "q_heads": (q0, q1), "kv_heads": (k0, k1), "intermediate": (i0, i1), "vocab": (v0, v1),
            "qkv_proj": ((nq + 2 * nkv) * d, h), "o_proj": (h, nq * d), "gate_up_proj": (2 * ni, h),
            "down_proj": (h, ni), "embed_tokens": (v1 - v0, h),
            "kv_pool_per_layer": (nkv, num_blocks or 0, block_size or 0, d)}


def _reshape(module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
    """Replace ``module.<name>`` (if any) by an uninitialised parameter of ``shape``, same dtype and device."""
    old = getattr(module, name, None)
    if old is not None:
        setattr(module, name, nn.Parameter(torch.empty(shape, dtype=old.dtype, device=old.device), requires_grad=False))


def shard_model(model: nn.Module, tp: TensorParallel) -> None:
    """Give a built, not yet loaded ``LlamaForCausalLM`` rank ``tp.rank``'s shard shapes, in place (module docstring).

    The loader calls it on the model while it is still on the ``meta`` device (no memory), before
    materialising it; :func:`read_shard` then reads each tensor's rows of this rank straight from
    the checkpoint, so no rank ever holds the whole model. Every sharded parameter is replaced by
    an uninitialised one of the shard's shape (``qkv_proj [(H/N + 2K/N) * head_dim, hidden]``,
    ``o_proj [hidden, H/N * head_dim]``, ``gate_up_proj [2I/N, hidden]``, ``down_proj
    [hidden, I/N]``, ``embed_tokens`` and an untied ``lm_head [V/N, hidden]``; biases alike).
    Sets ``model.tp`` and each attention's and MLP's ``tp`` (their all-reduces), their local
    head counts and intermediate size, and ``model.vocab_start`` / ``vocab_end``;
    ``model.config`` stays the whole model's.
    """
    spans = shard_spans(model.config, tp.rank, tp.world_size)
    (q0, q1), (k0, k1), (i0, i1), (v0, v1) = spans["q_heads"], spans["kv_heads"], spans["intermediate"], spans["vocab"]
    d, h = model.config.head_dim, model.config.hidden_size
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.num_heads, attn.num_kv_heads = q1 - q0, k1 - k0
        attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d
        rows = attn.q_size + 2 * attn.kv_size
        _reshape(attn.qkv_proj, "weight", (rows, h))
        _reshape(attn.qkv_proj, "bias", (rows,))
        _reshape(attn.o_proj, "weight", (h, attn.q_size))  # its bias stays [hidden] (whole on rank 0, zeros elsewhere)
        attn.qkv_proj.out_features, attn.o_proj.in_features = rows, attn.q_size
        mlp.intermediate_size = i1 - i0
        _reshape(mlp.gate_up_proj, "weight", (2 * (i1 - i0), h))
        _reshape(mlp.gate_up_proj, "bias", (2 * (i1 - i0),))
        _reshape(mlp.down_proj, "weight", (h, i1 - i0))
        mlp.gate_up_proj.out_features, mlp.down_proj.in_features = 2 * (i1 - i0), i1 - i0
        attn.tp = mlp.tp = tp
    _reshape(model.embed_tokens, "weight", (v1 - v0, h))
    model.embed_tokens.num_embeddings = v1 - v0
    if not model.config.tie_word_embeddings:
        _reshape(model.lm_head, "weight", (v1 - v0, h))
        model.lm_head.out_features = v1 - v0
    model.tp = tp
    model.vocab_start, model.vocab_end = v0, v1


# Which dimension of each Hugging Face tensor is split, and over which span (shard_spans' key, scaled by head_dim?).
_SPLIT = {
    "self_attn.q_proj.weight": (0, "q_heads", True), "self_attn.q_proj.bias": (0, "q_heads", True),
    "self_attn.k_proj.weight": (0, "kv_heads", True), "self_attn.k_proj.bias": (0, "kv_heads", True),
    "self_attn.v_proj.weight": (0, "kv_heads", True), "self_attn.v_proj.bias": (0, "kv_heads", True),
    "self_attn.o_proj.weight": (1, "q_heads", True),
    "mlp.gate_proj.weight": (0, "intermediate", False), "mlp.gate_proj.bias": (0, "intermediate", False),
    "mlp.up_proj.weight": (0, "intermediate", False), "mlp.up_proj.bias": (0, "intermediate", False),
    "mlp.down_proj.weight": (1, "intermediate", False),
    "embed_tokens.weight": (0, "vocab", False), "lm_head.weight": (0, "vocab", False),
}
_ROW_PARALLEL_BIASES = ("self_attn.o_proj.bias", "mlp.down_proj.bias")


def read_shard(hf_name: str, tensor: Any, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """Rank ``tp.rank``'s part of checkpoint tensor ``hf_name``, reading only those rows or columns.

    ``tensor``: a safetensors slice (``safe_open(...).get_slice(name)``: indexing it reads just
    the indexed part from the file) or a whole ``torch.Tensor``. Column-parallel weights and
    biases (q/k/v, gate/up) keep rows, row-parallel weights (o, down) keep columns, the
    embedding and LM head keep vocabulary rows (spans of :func:`shard_spans`); a row-parallel
    bias is whole on rank 0 and zeros elsewhere (the all-reduce adds it once); anything else
    (the norms) is read whole.
    """
    name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
    leaf = name.split(".", 2)[2] if name.startswith("layers.") else name
    if leaf in _ROW_PARALLEL_BIASES and tp.rank != 0:
        whole = tensor[:]
        return torch.zeros_like(whole)
    split = _SPLIT.get(leaf)
    if split is None:
        return tensor[:]
    dim, key, per_head = split
    a, b = shard_spans(cfg, tp.rank, tp.world_size)[key]
    if per_head:
        a, b = a * cfg.head_dim, b * cfg.head_dim
    return tensor[a:b] if dim == 0 else tensor[:, a:b]
