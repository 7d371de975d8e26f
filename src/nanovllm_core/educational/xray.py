"""X-Ray capture: what each decoder layer computed for one request in one step.

The model calls a ``LayerTracer``'s hooks while it runs (only when one is passed, so normal
steps pay nothing). The tracer keeps just the chosen request's rows of the flat batch,
recomputes that request's attention scores from the query and the cached keys (the fused
attention kernel never materialises them), and emits one ``LayerTrace`` event per layer
with shapes as a batch of one, a few real values, each operation's math, FLOPs and bytes.

Cost: the extra work is one score matrix per layer for one request, about the cost of that
request's own attention, so a captured step takes well under twice as long.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

from nanovllm_core import events as ev

if TYPE_CHECKING:  # pragma: no cover
    from nanovllm_core.engine.llm_engine import LLMEngine
    from nanovllm_core.engine.scheduler import ScheduledSequence, SchedulerOutput

HEATMAP_MAX_QUERIES = 48
HEATMAP_MAX_KEYS = 96
SAMPLE_VALUES = 4


def _sample(t: torch.Tensor) -> tuple[float, ...]:
    return tuple(round(float(v), 5) for v in t.reshape(-1)[:SAMPLE_VALUES].tolist())


class XRayCapture:
    """Chooses what to trace: one request (or the first scheduled one), and the heatmap's layer and head."""

    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        self.request_id: str | None = None
        self.layer = 0
        self.head = 0

    def select(self, request_id: str | None, layer: int = 0, head: int = 0) -> None:
        """Trace ``request_id`` (None: the first request in each step); heatmap of ``layer``/``head``.

        Raises:
            ValueError: layer or head out of range.
        """
        cfg = self.engine.model_config
        if not 0 <= layer < cfg.num_hidden_layers:
            raise ValueError(f"x-ray layer {layer} is out of range 0..{cfg.num_hidden_layers - 1}")
        if not 0 <= head < cfg.num_attention_heads:
            raise ValueError(f"x-ray head {head} is out of range 0..{cfg.num_attention_heads - 1}")
        self.request_id, self.layer, self.head = request_id, layer, head

    def tracer_for(self, plan: "SchedulerOutput") -> "LayerTracer | None":
        """A tracer for this step if the chosen request runs in it, else None."""
        from nanovllm_core.engine.model_runner import ModelRunner

        order = ModelRunner.batch_order(plan.scheduled)
        offset = 0
        for s in order:
            if (self.request_id is None or s.seq.request_id == self.request_id) and s.seq.index == 0:
                return LayerTracer(self.engine, plan.step, s, offset, self.layer, self.head, self.engine._emit)
            offset += s.num_new_tokens
        return None


class LayerTracer:
    """Hooks called by ``LlamaForCausalLM.forward``; emits ``LayerTrace`` events.

    ``start`` is the first row of the traced sequence in the flat batch ``[num_tokens, ...]``.
    """

    def __init__(self, engine: "LLMEngine", step: int, scheduled: "ScheduledSequence", start: int,
                 heat_layer: int, heat_head: int, emit: Callable[[ev.Event], None]) -> None:
        self.engine = engine
        self.cfg = engine.model_config
        self.step = step
        self.sched = scheduled
        self.rows = slice(start, start + scheduled.num_new_tokens)
        self.heat_layer, self.heat_head = heat_layer, heat_head
        self.emit = emit
        self.elem = torch.empty((), dtype=engine.dtype).element_size()
        self._tensors: list[ev.TensorInfo] = []
        self._q: torch.Tensor | None = None
        self._attention: tuple = ()
        self._context_len = 0

    # ------------------------------------------------------------------ hooks

    def embedding(self, input_ids: torch.Tensor, x: torch.Tensor) -> None:
        t = self.sched.num_new_tokens
        self._embedding = ev.TensorInfo("token_embeddings", (1, t, self.cfg.hidden_size), _sample(x[self.rows][-1]))

    def qkv(self, layer: int, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        r, t = self.rows, self.sched.num_new_tokens
        c = self.cfg
        self._tensors = [self._embedding] if layer == 0 else []
        self._tensors += [
            ev.TensorInfo("hidden_states", (1, t, c.hidden_size), _sample(x[r][-1])),
            ev.TensorInfo("q", (1, c.num_attention_heads, t, c.head_dim), _sample(q[r][-1, 0])),
            ev.TensorInfo("k", (1, c.num_key_value_heads, t, c.head_dim), _sample(k[r][-1, 0])),
            ev.TensorInfo("v", (1, c.num_key_value_heads, t, c.head_dim), _sample(v[r][-1, 0])),
        ]
        self._q = q[r].float().clone()

    def attention_output(self, layer: int, out: torch.Tensor) -> None:
        c = self.cfg
        keys = self._context_keys(layer)  # [ctx, nkv, hd], including this step's tokens
        ctx = keys.shape[0]
        self._context_len = ctx
        q = self._q  # [t, nh, hd]
        t = q.shape[0]
        group = c.num_attention_heads // c.num_key_value_heads
        k_per_head = keys.float().repeat_interleave(group, dim=1)  # [ctx, nh, hd]
        scores = torch.einsum("thd,chd->htc", q, k_per_head) / math.sqrt(c.head_dim)  # [nh, t, ctx]
        q_pos = torch.arange(self.sched.start, self.sched.start + t)
        mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        self._tensors += [
            ev.TensorInfo("k_cache", (1, c.num_key_value_heads, ctx, c.head_dim), _sample(keys[-1, 0])),
            ev.TensorInfo("scores", (1, c.num_attention_heads, t, ctx), _sample(scores[0, -1, -SAMPLE_VALUES:])),
            ev.TensorInfo("probs", (1, c.num_attention_heads, t, ctx), _sample(probs[0, -1, -SAMPLE_VALUES:])),
            ev.TensorInfo("attn_output", (1, t, c.hidden_size), _sample(out[self.rows][-1])),
        ]
        if layer == self.heat_layer:
            p = probs[self.heat_head, -HEATMAP_MAX_QUERIES:, -HEATMAP_MAX_KEYS:]
            self._attention = tuple(tuple(round(float(x), 5) for x in row) for row in p.tolist())
        else:
            self._attention = ()

    def mlp(self, layer: int, x, gate, up, act, out) -> None:
        r, t = self.rows, self.sched.num_new_tokens
        c = self.cfg
        self._tensors += [
            ev.TensorInfo("gate", (1, t, c.intermediate_size), _sample(gate[r][-1])),
            ev.TensorInfo("up", (1, t, c.intermediate_size), _sample(up[r][-1])),
            ev.TensorInfo("act", (1, t, c.intermediate_size), _sample(act[r][-1])),
            ev.TensorInfo("mlp_output", (1, t, c.hidden_size), _sample(out[r][-1])),
        ]
        seq = self.sched.seq
        pieces = self.engine.token_pieces
        heat = layer == self.heat_layer
        ctx = self._context_len
        q_from = max(self.sched.start, self.sched.start + t - HEATMAP_MAX_QUERIES)
        k_from = max(0, ctx - HEATMAP_MAX_KEYS)
        self.emit(ev.LayerTrace(
            step=self.step, request_id=seq.request_id, layer=layer, num_layers=c.num_hidden_layers,
            tensors=tuple(self._tensors), ops=self.layer_ops(t, ctx), num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_size=c.hidden_size,
            kv_bytes_per_token=c.kv_bytes_per_token(self.engine.dtype),
            head=self.heat_head if heat else None, attention=self._attention,
            query_pieces=tuple(pieces(seq.token_ids[q_from:self.sched.start + t])) if heat else (),
            key_pieces=tuple(pieces(seq.token_ids[k_from:ctx])) if heat else (),
        ))

    # ------------------------------------------------------------------ helpers

    def _context_keys(self, layer: int) -> torch.Tensor:
        """This sequence's cached keys in ``layer``: ``[context_len, num_kv_heads, head_dim]``."""
        runner = self.engine.runner
        seq = self.sched.seq
        ctx = self.sched.start + self.sched.num_new_tokens
        if runner.paged:
            bs = runner.block_size
            table = torch.tensor(seq.block_table, dtype=torch.long, device=runner.device)
            slots = (table[:, None] * bs + torch.arange(bs, device=runner.device)).reshape(-1)[:ctx]
            return runner.kv_cache.k_slots[layer].index_select(0, slots)
        return runner.contiguous[seq.seq_id].k[layer, :ctx]

    def layer_ops(self, t: int, ctx: int) -> tuple[ev.OpInfo, ...]:
        """The layer's operations for ``t`` new tokens over ``ctx`` context tokens: math, shapes, FLOPs, bytes."""
        c, e = self.cfg, self.elem
        h, i, nh, nkv, hd = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv_out = (nh + 2 * nkv) * hd
        g = nh // nkv
        return (
            ev.OpInfo("rmsnorm", "x / sqrt(mean(x^2) + eps) * w", f"[1,{t},{h}] -> [1,{t},{h}]", 4 * t * h, 2 * t * h * e),
            ev.OpInfo("qkv_proj", "Q = X W_q, K = X W_k, V = X W_v",
                      f"[1,{t},{h}] @ [{h},{qkv_out}] -> Q [1,{nh},{t},{hd}], K,V [1,{nkv},{t},{hd}]",
                      2 * t * h * qkv_out, (h * qkv_out + t * h + t * qkv_out) * e),
            ev.OpInfo("rope", "rotate each (x_i, x_i+d/2) pair of Q and K by position * theta^(-2i/d)",
                      f"Q [1,{nh},{t},{hd}], K [1,{nkv},{t},{hd}]", 6 * t * (nh + nkv) * hd // 2,
                      2 * t * (nh + nkv) * hd * e),
            ev.OpInfo("kv_cache_write", "K, V of the new tokens -> their slots (slot_mapping)",
                      f"2 x [{t},{nkv},{hd}] -> cache", 0, 2 * t * nkv * hd * e),
            ev.OpInfo("attention_scores", f"S = Q K^T / sqrt({hd})  ({g} query heads share each KV head)",
                      f"[1,{nh},{t},{hd}] @ [1,{nh},{hd},{ctx}] -> [1,{nh},{t},{ctx}]",
                      2 * nh * t * ctx * hd, (nh * t * hd + nkv * ctx * hd) * e),
            ev.OpInfo("softmax", "P = softmax(S + causal_mask)", f"[1,{nh},{t},{ctx}] -> [1,{nh},{t},{ctx}]",
                      5 * nh * t * ctx, 2 * nh * t * ctx * e),
            ev.OpInfo("attention_output", "O = P V", f"[1,{nh},{t},{ctx}] @ [1,{nh},{ctx},{hd}] -> [1,{nh},{t},{hd}]",
                      2 * nh * t * ctx * hd, (nkv * ctx * hd + nh * t * hd) * e),
            ev.OpInfo("o_proj", "Y = O W_o  (+ residual)", f"[1,{t},{nh * hd}] @ [{nh * hd},{h}] -> [1,{t},{h}]",
                      2 * t * nh * hd * h, (nh * hd * h + t * nh * hd + t * h) * e),
            ev.OpInfo("mlp_gate_up", "G = X W_gate, U = X W_up", f"[1,{t},{h}] @ [{h},{2 * i}] -> 2 x [1,{t},{i}]",
                      2 * t * h * 2 * i, (h * 2 * i + t * h + 2 * t * i) * e),
            ev.OpInfo("swiglu", "A = SiLU(G) * U", f"[1,{t},{i}] -> [1,{t},{i}]", 5 * t * i, 3 * t * i * e),
            ev.OpInfo("mlp_down", "Y = A W_down  (+ residual)", f"[1,{t},{i}] @ [{i},{h}] -> [1,{t},{h}]",
                      2 * t * i * h, (i * h + t * i + t * h) * e),
        )
