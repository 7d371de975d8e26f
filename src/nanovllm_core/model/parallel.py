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


def valid_sizes(cfg: ModelConfig, limit: int = 64) -> list[int]:
    """Every N <= ``limit`` that divides the query heads, KV heads, intermediate size and vocabulary."""
    return [n for n in range(1, limit + 1)
            if not (cfg.num_attention_heads % n or cfg.num_key_value_heads % n
                    or cfg.intermediate_size % n or cfg.vocab_size % n)]


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


def _keep(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
    if value is not None:
        setattr(module, name, nn.Parameter(value.contiguous().clone(), requires_grad=False))


def shard_model(model: nn.Module, tp: TensorParallel) -> None:
    """Cut a loaded float ``LlamaForCausalLM`` down to rank ``tp.rank``'s shard, in place (see the module docstring).

    Run after the checkpoint is loaded and before ``quantization.prepare_linear_layers`` packs
    the layers. Sets ``model.tp`` and each attention's and MLP's ``tp`` (their all-reduces),
    and their local head counts and intermediate size; ``model.config`` stays the whole model's.
    """
    cfg, d = model.config, model.config.head_dim
    q0, q1 = tp.span(cfg.num_attention_heads)
    k0, k1 = tp.span(cfg.num_key_value_heads)
    i0, i1 = tp.span(cfg.intermediate_size)
    v0, v1 = tp.span(cfg.vocab_size)
    q_size, kv_size, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    with torch.no_grad():
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            rows = torch.cat([torch.arange(q0 * d, q1 * d), q_size + torch.arange(k0 * d, k1 * d),
                              q_size + kv_size + torch.arange(k0 * d, k1 * d)])
            qkv = attn.qkv_proj
            _keep(qkv, "weight", qkv.weight.index_select(0, rows))
            _keep(qkv, "bias", None if qkv.bias is None else qkv.bias.index_select(0, rows))
            _keep(attn.o_proj, "weight", attn.o_proj.weight[:, q0 * d:q1 * d])
            if attn.o_proj.bias is not None and tp.rank != 0:
                _keep(attn.o_proj, "bias", torch.zeros_like(attn.o_proj.bias))
            attn.num_heads, attn.num_kv_heads = q1 - q0, k1 - k0
            attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d
            gu = mlp.gate_up_proj
            rows = torch.cat([torch.arange(i0, i1), inter + torch.arange(i0, i1)])
            _keep(gu, "weight", gu.weight.index_select(0, rows))
            _keep(gu, "bias", None if gu.bias is None else gu.bias.index_select(0, rows))
            _keep(mlp.down_proj, "weight", mlp.down_proj.weight[:, i0:i1])
            if mlp.down_proj.bias is not None and tp.rank != 0:
                _keep(mlp.down_proj, "bias", torch.zeros_like(mlp.down_proj.bias))
            mlp.intermediate_size = i1 - i0
            attn.tp = mlp.tp = tp
        _keep(model.embed_tokens, "weight", model.embed_tokens.weight[v0:v1])
        if not cfg.tie_word_embeddings:
            _keep(model.lm_head, "weight", model.lm_head.weight[v0:v1])
    model.tp = tp
    model.vocab_start, model.vocab_end = v0, v1
