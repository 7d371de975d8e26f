"""The X-Ray's sentences, computed from one ``LayerTrace``: shared by ``--xray`` and the app's X-Ray tab.

Every sentence here is a fact of the traced step (its shapes, its flat batch, the backend
that ran, the bytes it moved) or of the machine (its measured roofline), so the terminal
and the app say the same true things. Traces recorded before a field existed fall back to
what they do hold and never claim more.
"""

from __future__ import annotations

from nanovllm_core import events as ev
from nanovllm_core.educational.commentary import plural
from nanovllm_core.educational.narrator import Commentary
from nanovllm_core.educational.xray_costs import BACKEND_NAMES, intensity, layer_intensity, peak_words

# What each captured tensor is. Names of older traces are kept readable (their "hidden_states"
# was input_layernorm's output, not the residual stream).
LABELS = {
    "token_embeddings": "embedding rows of the step's tokens: the residual stream entering layer 0",
    "residual": "residual stream entering this layer (the previous layer's output)",
    "attn_norm": "input_layernorm(residual): what Q, K and V are projected from",
    "q": "queries after RoPE",
    "k": "keys after RoPE (written to the KV cache)",
    "v": "values (written to the KV cache)",
    "k_context": "this request's keys in context, read from the cache (slice)",
    "scores": "this request's scores Q K^T / sqrt(d), recomputed by X-Ray, as GQA groups them: [KV head, "
              "its query heads x tokens, keys] (slice)",
    "probs": "this request's softmax weights, grouped as scores; each row sums to 1 (slice)",
    "attn_out": "attention block output (after o_proj), added to the residual",
    "residual_mid": "residual stream after attention: residual + attn_out",
    "mlp_norm": "post_attention_layernorm(residual_mid): the MLP's input",
    "gate": "gate projection G",
    "up": "up projection U",
    "act": "SiLU(G) · U",
    "mlp_out": "MLP output (after down_proj), added to the residual",
    "residual_out": "residual stream leaving the layer (the next layer's input)",
    "weight_block": "block modes: qkv_proj's stored blocks [rows, blocks a row, bytes a block]; sample: row 0's "
                    "first block's d, m, first 4 q and the weights they decode to (educational/xray_blocks.py)",
    "weight_block_at_load": "as weight_block, for blocks quantized at load from float weights (--quantization q8_0, "
                            "q4_0, q4_1), not a checkpoint's own",
    # older traces
    "hidden_states": "input_layernorm output (older trace: its shape is a batch of one)",
    "k_cache": "this request's keys in context (older trace)",
    "attn_output": "attention block output after o_proj (older trace)",
    "mlp_output": "MLP output (older trace)",
}


# Tensors whose sample is the last query row's newest keys (the capture in xray.py takes them, so
# that the last value is the token's weight on itself); every other sample is its first values.
TAIL_SAMPLED = frozenset({"scores", "probs"})


def sample_text(x: ev.TensorInfo) -> str:
    """A tensor's sampled values as the views print them, saying which end of the row they are:
    ``+0.1, +0.2, ...`` (the first values) or ``..., +0.1, +0.2 (the newest 2 keys)``."""
    values = ", ".join(f"{v:+.4f}" for v in x.sample)
    if not x.sample:
        return ""
    if x.name in TAIL_SAMPLED:
        return f"..., {values} (the newest {len(x.sample)} keys, its own last)"
    return f"{values}, ..."


def tensor(trace: ev.LayerTrace, name: str) -> ev.TensorInfo | None:
    return next((t for t in trace.tensors if t.name == name), None)


def shape_str(shape: tuple[int, ...]) -> str:
    """``(5, 9, 64)`` -> ``"[5, 9, 64]"``."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def is_flat(trace: ev.LayerTrace) -> bool:
    """True for traces with the flat-batch shapes (recorded after ``num_batch_tokens`` existed)."""
    return trace.num_batch_tokens > 0


def new_and_context(trace: ev.LayerTrace) -> tuple[int, int]:
    """(tokens this request ran, tokens in its context after the step), also for older traces."""
    if is_flat(trace):
        return trace.num_new_tokens, trace.context_len
    q, k = tensor(trace, "q"), tensor(trace, "k_cache")
    return (q.shape[2] if q else 0), (k.shape[2] if k else 0)


def step_kind(trace: ev.LayerTrace, entry: ev.ScheduledEntry | None = None) -> str:
    """What the traced request did in the step: ``prefill``, ``decode`` or ``speculative verification``."""
    kind = trace.part or (entry.kind if entry is not None else "")
    if kind == "verify":
        return "speculative verification"
    if kind:
        return kind
    new, ctx = new_and_context(trace)  # older trace without the kind: the plan is not at hand
    return "decode" if new == 1 and ctx > 1 else "prefill"


def chunk_of(start: int, new: int, prompt_len: int, total_len: int, num_cached: int) -> str:
    """What a prefill of ``new`` tokens from position ``start`` is a chunk of: ``"a 9-token prompt"``,
    or for a sequence readmitted after a preemption ``"its 12 tokens (9 prompt + 3 generated,
    recomputed)"``; ``""`` when it is the whole rest of its prefill (from the first token the prefix
    cache did not hold to its last) or the lengths are not known. As the narrator's
    "prefill chunk 0..7 of 9" (trial 10: the X-Ray said "8 new tokens at positions 0..7" alone)."""
    if not prompt_len or not total_len or (start == num_cached and start + new >= total_len):
        return ""
    if total_len > prompt_len:
        return f"its {total_len} tokens ({prompt_len} prompt + {total_len - prompt_len} generated, recomputed)"
    return f"a {prompt_len}-token prompt"


def trace_chunk_of(trace: ev.LayerTrace) -> str:
    """:func:`chunk_of` for a traced prefill (``""`` for other parts and for traces that lack the lengths)."""
    if step_kind(trace) != "prefill":
        return ""
    new, ctx = new_and_context(trace)
    return chunk_of(ctx - new, new, trace.prompt_len, trace.total_len, trace.num_cached_tokens)


def what_ran(trace: ev.LayerTrace) -> str:
    """``"decode: 1 new token over 43 in context"``; a verification names its 1 + k tokens, a prefill
    chunk what it is a chunk of (``"prefill chunk: 8 new tokens (positions 0..7 of a 9-token prompt) ..."``)."""
    new, ctx = new_and_context(trace)
    kind = step_kind(trace)
    if kind == "speculative verification":
        return (f"speculative verification: the newest token + {plural(new - 1, 'draft')} "
                f"checked in one pass, over {ctx} in context")
    of = trace_chunk_of(trace)
    if of:
        where = f"position {ctx - 1}" if new == 1 else f"positions {ctx - new}..{ctx - 1}"
        return (f"prefill chunk: {plural(new, 'new token')} ({where} of {of}) "
                f"over {ctx} in context")
    return f"{kind}: {plural(new, 'new token')} over {ctx} in context"


def batch_line(trace: ev.LayerTrace) -> str:
    """The flat batch of the step and where the traced request sits in it."""
    if not is_flat(trace):
        return "Shapes are this request's alone (an older trace): the engine's batch is not recorded."
    T, n, a = trace.num_batch_tokens, trace.num_new_tokens, trace.first_row
    rows = f"row {a}" if n == 1 else f"rows {a}-{a + n - 1}"
    others = trace.num_batch_seqs - 1
    with_others = f" with {plural(others, 'other sequence')}" if others else " alone"
    return (f"Continuous batching: the step ran {plural(T, 'token')}{with_others} as one flat "
            f"batch, [{T}, {trace.hidden_size}] through every projection and the MLP; request "
            f"{trace.request_id} is {rows}. Only attention is per sequence, over its own context.")


def backend_line(trace: ev.LayerTrace) -> str:
    return f"Attention backend: {BACKEND_NAMES.get(trace.attention_backend, trace.attention_backend)}." \
        if trace.attention_backend else ""


def gqa_lines(trace: ev.LayerTrace, head: int | None = None, elem_bytes: int | None = None) -> list[str]:
    """Grouped-query attention as the engine does it, and the KV bytes it keeps and reads."""
    nh, nkv, hd, layers = trace.num_heads, max(1, trace.num_kv_heads), trace.head_dim, trace.num_layers
    g = nh // nkv
    per_token = trace.kv_bytes_per_token
    e = elem_bytes or per_token // max(1, 2 * layers * nkv * hd)
    _, ctx = new_and_context(trace)
    lines = [
        f"GQA: {nh} query heads share {nkv} KV heads; query head h reads KV head h // {g} "
        f"(heads {', '.join(f'{k * g}-{k * g + g - 1}' for k in range(nkv))} read KV heads "
        f"{', '.join(str(k) for k in range(nkv))}). No KV head is copied: K and V stay "
        f"[ctx, {nkv}, {hd}] beside Q [t, {nh}, {hd}], and the scores are grouped by the KV head they read, "
        f"[{nkv}, {g} x t, ctx].",
    ]
    if head is not None:
        lines.append(f"Head {head} reads KV head {head} // {g} = {head // g}.")
    lines.append(f"KV cache per token: 2 (K, V) x {layers} layers x {nkv} KV heads x {hd} x {e} bytes = "
                 f"{per_token:,} bytes; one KV head per query head would keep {per_token * g:,} ({g}x more).")
    if ctx:
        read = 2 * nkv * ctx * hd * e
        lines.append(f"This request: {plural(ctx, 'token')} in context = {ctx * per_token:,} bytes of KV in all layers; "
                     f"each layer's attention reads 2 x {nkv} x {ctx} x {hd} x {e} = {read:,} bytes of it.")
    return lines


def op_intensity(op: ev.OpInfo) -> float:
    return intensity(op.flops, op.bytes)


def roofline_known(trace: ev.LayerTrace) -> bool:
    return trace.peak_flops > 0 and trace.memory_bandwidth > 0


def ridge(trace: ev.LayerTrace) -> float:
    """The machine's ridge point in FLOP/byte (0 when the trace has no roofline)."""
    return trace.peak_flops / trace.memory_bandwidth if roofline_known(trace) else 0.0


def bound(trace: ev.LayerTrace, flops: float, nbytes: float) -> str:
    """``"compute-bound"``, ``"memory-bound"`` or ``""`` (no roofline in the trace)."""
    if not roofline_known(trace) or not nbytes:
        return ""
    return "compute-bound" if flops / nbytes >= ridge(trace) else "memory-bound"


def roofline_lines(trace: ev.LayerTrace) -> list[str]:
    """The machine's measured ridge point, this step's layer against it, and where a prefill crosses it."""
    layer = layer_intensity(trace.ops)
    flops, moved = sum(o.flops for o in trace.ops), sum(o.bytes for o in trace.ops)
    step = f"This step's layer: {flops:,} FLOPs over {moved:,} bytes = {layer:.1f} FLOP/byte"
    if not roofline_known(trace):
        return [step + " (the machine's ridge point was not measured for this trace)."]
    r = ridge(trace)
    lines = [
        f"Roofline of this machine ({trace.machine}), measured: {peak_words(trace.machine, trace.peak_flops)}, "
        f"memory {trace.memory_bandwidth / 1e9:,.1f} GB/s, so an operation is compute-bound above "
        f"{r:.1f} FLOP/byte (the ridge point).",
        f"{step}: {bound(trace, flops, moved)}; at this machine's limits it needs at least "
        f"{1e6 * max(flops / trace.peak_flops, moved / trace.memory_bandwidth):,.0f} µs.",
    ]
    n = trace.compute_bound_tokens
    if n:
        lines.append(f"On this machine a prefill becomes compute-bound from about {n:,} tokens in one step; "
                     "fewer tokens leave each weight read serving too little arithmetic.")
    else:
        lines.append("On this machine no prefill length makes this layer compute-bound.")
    return lines


def roofline_commentary(trace: ev.LayerTrace) -> Commentary:
    """A ``roofline`` entry for a demonstration: the step's batch, its layer against this machine's ridge point."""
    new, _ = new_and_context(trace)
    text = " ".join([batch_line(trace)] + roofline_lines(trace))
    return Commentary("roofline", f"Request {trace.request_id}: {what_ran(trace).split(':')[0]} of "
                      f"{plural(new, 'token')} against the roofline", text,
                      request_id=trace.request_id, step=trace.step)
