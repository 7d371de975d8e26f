"""``LayerTracer``: what the model calls while it runs, when a tracer is passed to ``forward``.

The model only *calls* these hooks; it never builds a tracer. The X-Ray
(``nanovllm_core.educational.xray``) implements them and reaches the model through the
engine's observer hook (``nanovllm_core.engine.observer``), so the model and the engine
stay free of the teaching code above them. A step without a tracer pays nothing: every
call site is guarded by ``if tracer is not None``.

Shapes: ``T`` is the step's flat token count (all scheduled sequences' new tokens),
``hidden``/``intermediate`` the model's sizes, ``heads``/``kv_heads`` its query and KV
head counts, ``hd`` the head size. Tensors are the live ones: a tracer must not change them.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class LayerTracer(Protocol):
    """Hooks ``LlamaForCausalLM.forward`` calls, in this order for each step.

    ``layers``: the decoder layers whose hooks are called (None: every layer); the model runs the
    others untraced (through its one-call C layers where it has them), and ``embedding`` is
    always called.
    """

    layers: frozenset[int] | None

    def embedding(self, input_ids: torch.Tensor, x: torch.Tensor) -> None:
        """``input_ids`` ``[T]``; ``x``: the token embeddings ``[T, hidden]``."""

    def layer_input(self, layer: int, x: torch.Tensor) -> None:
        """The residual stream entering decoder layer ``layer``, ``[T, hidden]``."""

    def qkv(self, layer: int, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            attn: Any = None) -> None:
        """``x``: input_layernorm's output ``[T, hidden]``; q ``[T, heads, hd]``; k, v ``[T, kv_heads, hd]``
        (after RoPE); ``attn``: the step's attention context (paged or contiguous)."""

    def attention_output(self, layer: int, out: torch.Tensor) -> None:
        """The attention block's output after ``o_proj``, ``[T, hidden]``."""

    def mlp(self, layer: int, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: torch.Tensor,
            out: torch.Tensor) -> None:
        """``x``: post_attention_layernorm's output ``[T, hidden]``; gate, up, act ``[T, intermediate]``;
        ``out`` ``[T, hidden]``."""

    def layer_output(self, layer: int, mid: torch.Tensor, out: torch.Tensor) -> None:
        """``mid``: the residual after attention; ``out``: after the MLP (the next layer's input), ``[T, hidden]``."""
