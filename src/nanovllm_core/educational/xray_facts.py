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
import re

from nanovllm_core.educational.xray_costs import (REMEASURE, BACKEND_NAMES, BLOCK_MACHINE_WORDS, LINEAR_OPS, intensity, is_block,
                                                  kernel_peak, layer_intensity, layer_roof, unknown_peak_reason, peak_words)

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
        newest = "the newest key, its own" if len(x.sample) == 1 else f"the newest {len(x.sample)} keys, its own last"
        return f"..., {values} ({newest})"
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
    all but the newest recomputed)"``; ``""`` when it is the whole rest of its prefill (from the first token the prefix
    cache did not hold to its last) or the lengths are not known. As the narrator's
    "prefill chunk 0..7 of 9" (trial 10: the X-Ray said "8 new tokens at positions 0..7" alone)."""
    if not prompt_len or not total_len or (start == num_cached and start + new >= total_len):
        return ""
    if total_len > prompt_len:
        # The newest generated token was sampled but never run through the model before the preemption: its
        # keys and values are computed for the first time (trial 21a bug 2).
        return (f"its {total_len} tokens ({prompt_len} prompt + {total_len - prompt_len} generated, "
                "all but the newest recomputed)")
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
    """The machine's float ridge point in FLOP/byte: the float matmul's peak over the bandwidth (0 when
    the trace has no roofline). A block kernel's is :func:`kernel_ridge`'s."""
    return trace.peak_flops / trace.memory_bandwidth if roofline_known(trace) else 0.0


def busy(trace: ev.LayerTrace) -> bool:
    """The trace's roofline (or a block kernel's peak in it) was measured while the host was busy."""
    return "host was busy" in trace.machine


def op_kernel(trace: ev.LayerTrace, op: ev.OpInfo) -> str:
    """The format of the weights ``op`` multiplies, naming its kernel (``"q4_1"``, ``"float32"``; ``""``
    for an operation that is no projection). A trace recorded before ops carried it: read from the
    math's ``W in Q4_1 blocks``, or ``"block"`` (a block kernel, which one unknown) for a projection of
    a block model whose math does not say."""
    if op.kernel or op.name not in LINEAR_OPS or not any(w in trace.machine for w in BLOCK_MACHINE_WORDS):
        return op.kernel
    m = re.search(r"W in (Q\w+) blocks", op.math)
    return m.group(1).lower() if m else "block"


def _blockish(kind: str) -> bool:
    return kind == "block" or is_block(kind)


def kind_peak(trace: ev.LayerTrace, kind: str) -> float:
    """FLOP/s of the kernel that runs ``kind`` weights in this trace: a block format's measured peak
    (0.0 when the trace does not hold it), the float matmul's for anything else."""
    return 0.0 if kind == "block" else kernel_peak(kind, trace.peak_flops, trace.kernel_peaks)


def op_peak(trace: ev.LayerTrace, op: ev.OpInfo) -> float:
    """FLOP/s ``op`` is judged against: its block kernel's measured peak for a block-format projection
    (0.0 when the trace does not hold it), the float matmul's for every other operation."""
    return kind_peak(trace, op_kernel(trace, op))


def kernel_ridge(trace: ev.LayerTrace, kind: str) -> float:
    """The ridge point (FLOP/byte) of the kernel that runs ``kind`` weights (0.0 when not known)."""
    return kind_peak(trace, kind) / trace.memory_bandwidth if roofline_known(trace) else 0.0


def bound(trace: ev.LayerTrace, op: ev.OpInfo) -> str:
    """``"compute-bound"`` or ``"memory-bound"``: ``op``'s intensity against the ridge point of the kernel
    that ran it (:func:`op_peak`); ``""`` when the trace has no roofline or that kernel's peak is not in it."""
    peak = op_peak(trace, op)
    if not roofline_known(trace) or not op.bytes or peak <= 0:
        return ""
    return "compute-bound" if op.flops / op.bytes >= peak / trace.memory_bandwidth else "memory-bound"


def _kinds(trace: ev.LayerTrace, known: bool) -> list[str]:
    """The block formats of the trace's projections whose peak the trace holds (``known``) or not."""
    kinds = sorted({op_kernel(trace, o) for o in trace.ops if _blockish(op_kernel(trace, o))})
    return [k for k in kinds if (kind_peak(trace, k) > 0) == known]


def _names(kinds: list[str]) -> str:
    return " and ".join("block" if k == "block" else k.upper() for k in kinds)


def verdict_line(trace: ev.LayerTrace) -> str:
    """What the operations' compute-bound / memory-bound labels are judged against, in one line: each
    against the ridge point of the kernel that ran it where that kernel's peak was measured, the float
    matmul's for the rest (whose own kernels are not measured), none where a block kernel's peak is not
    known; and that the host was busy when it was. ``""`` without a roofline."""
    if not roofline_known(trace):
        return ""
    known, unknown = _kinds(trace, True), _kinds(trace, False)
    if known:
        text = (f"Verdicts: each {_names(known)} projection against its block kernel's ridge point, every other "
                "operation against the float matmul's")
    elif unknown:
        text = "Verdicts: the float operations against the float matmul's ridge point"
    else:
        text = "Verdicts: each operation against the matmul's ridge point, the projections' own kernel"
    text += " (RMSNorm, RoPE and attention run kernels whose own peaks are not measured)"
    if unknown:
        text += f"; the {_names(unknown)} projections get none: {unknown_peak_reason(trace.machine, unknown)}"
    if busy(trace):
        text += "; the peaks were measured while the host was busy, so likely low: a verdict near a ridge point may be wrong"
    return text + "."


def roofline_lines(trace: ev.LayerTrace) -> list[str]:
    """The machine's measured ridge points, this step's layer against them, and where a prefill crosses them.

    Each operation is judged against the peak of the kernel that ran it (:func:`op_peak`): a block
    projection against its block kernel's, timed on the model's weights, and everything else against
    the float matmul's. A trace whose block kernels' peaks are not known gives no layer verdict."""
    layer = layer_intensity(trace.ops)
    flops, moved = sum(o.flops for o in trace.ops), sum(o.bytes for o in trace.ops)
    step = f"This step's layer: {flops:,} FLOPs over {moved:,} bytes = {layer:.1f} FLOP/byte"
    if not roofline_known(trace):
        return [step + " (the machine's ridge point was not measured for this trace)."]
    r = ridge(trace)
    known, unknown = _kinds(trace, True), _kinds(trace, False)
    words = peak_words(trace.machine, trace.peak_flops, trace.kernel_peaks)
    if known or unknown:
        ridges = f"a float operation is compute-bound above {r:.1f} FLOP/byte"
        ridges += "".join(f" and a {k.upper()} projection above {kernel_ridge(trace, k):.1f}" for k in known)
        ridges += " (the ridge points: each peak over the bandwidth)" if known else " (the ridge point)"
        if unknown:
            ridges += f"; the {_names(unknown)} projections' own ridge point is not known"
    else:
        ridges = f"an operation is compute-bound above {r:.1f} FLOP/byte (the ridge point)"
    lines = [f"Roofline of this machine ({trace.machine}), measured: {words}, memory "
             f"{trace.memory_bandwidth / 1e9:,.1f} GB/s, so {ridges}."]
    if unknown:
        lines.append(f"{step}; no compute/memory verdict for the {_names(unknown)} projections or the whole layer: "
                     f"{unknown_peak_reason(trace.machine, unknown)}.")
        lines.append("Where a prefill turns compute-bound is not told for this trace, for the same reason.")
        return lines
    roof = layer_roof([ev.OpInfo(o.name, "", "", o.flops, o.bytes, op_kernel(trace, o)) for o in trace.ops],
                      trace.peak_flops, trace.memory_bandwidth, trace.kernel_peaks)
    hedge = " (against peaks measured while the host was busy, so likely low: it may well be wrong)" if busy(trace) else ""
    against = (f" against the layer's own ridge point of {roof.ridge:.1f} FLOP/byte (its operations each at their "
               "kernel's peak)" if known else "")
    lines.append(f"{step}{against}: {roof.bound}{hedge}; at this machine's limits, one operation after another, it "
                 f"needs at least {1e6 * roof.min_s:,.0f} µs.")
    n = trace.compute_bound_tokens
    each = ", each operation against its kernel's peak" if known else ""
    if busy(trace):  # trial 15a: a busy host's peak put the crossing at "1 token", a quiet one's far past it
        lines.append("Where a prefill turns compute-bound is not told: the peaks were measured while the host was "
                     f"busy; run `{REMEASURE}` when the machine is quiet.")
    elif n > 1:
        lines.append(f"On this machine a prefill becomes compute-bound from about {plural(n, 'token')} in one step{each}; "
                     "fewer tokens leave each weight read serving too little arithmetic.")
    elif n == 1:
        lines.append(f"On this machine even a step of 1 token makes this layer compute-bound{each}.")
    else:
        lines.append(f"On this machine no prefill length makes this layer compute-bound{each}.")
    return lines


def roofline_commentary(trace: ev.LayerTrace) -> Commentary:
    """A ``roofline`` entry for a demonstration: the step's batch, its layer against this machine's ridge point."""
    new, _ = new_and_context(trace)
    text = " ".join([batch_line(trace)] + roofline_lines(trace))
    return Commentary("roofline", f"Request {trace.request_id}: {what_ran(trace).split(':')[0]} of "
                      f"{plural(new, 'token')} against the roofline", text,
                      request_id=trace.request_id, step=trace.step)
