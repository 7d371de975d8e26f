"""What one decoder layer costs in a step: each operation's math, shapes, FLOPs and bytes moved.

The engine runs every operation but attention on the step's flat batch of ``T`` tokens (all
scheduled sequences, prefill chunks and decodes together: ``[T, hidden]``, ``[T, heads,
head_dim]``), so a weight read from memory serves all ``T`` rows; attention alone is done
per sequence, over that sequence's context. The costs below follow that shape and the
attention backend that ran:

- ``fused`` (PyTorch's ``scaled_dot_product_attention``, the default): one kernel reads Q, K,
  V and writes O; the score matrix never leaves it, so it costs no memory traffic;
- ``math``: ``S = Q K^T``, ``softmax``, ``P V`` as three steps, with S and P written and read;
- ``cpu_paged`` (the CPU in float32, when its C kernel compiled): fused, reading the KV
  blocks in place through the block table; each query's scores live in a scratch row of
  the kernel, never in a stored matrix;
- ``flash_attn`` (CUDA with flash-attn): fused, reading the KV blocks in place;
- ``cpu_contiguous`` (the contiguous baseline, ``--no-paged-attention``, with that C kernel):
  the same fused kernel, reading each request's one contiguous KV region in place (no blocks,
  no block table: the region is handed to it as a single block).

Where neither in-place kernel runs (``fused`` or ``math``: the cases listed in
``attention.cpu_paged.FALLBACK_CONDITIONS`` and ``attention.selector.FLASH_ATTN_FALLBACK_CONDITIONS``) a sequence whose
context is already cached first gathers its KV blocks into one contiguous buffer
(``kv_gather``), a copy the in-place kernels avoid. Attention FLOPs count
the (query, key) pairs the kernel visits (:func:`score_pairs`: the causal half where it skips
masked keys, the full rectangle where it computes and masks them). Bytes count reads plus writes at the model's element size, weights as stored (under a
block mode, ``gguf``, ``q8_0``, ``q4_0``, ``q4_1``, the blocks' bytes, scales and mins included: 34, 18 or 20 bytes per 32 weights) and K/V at the cache's element size; FLOPs count a multiply-add
as 2. GQA: K and V bytes are those of the ``num_kv_heads`` stored heads; query head ``h``
reads KV head ``h // group`` and nothing is copied.

Sources: the operation list is LLaMA's decoder layer (Touvron et al. 2023, section 2.2);
arithmetic intensity and the ridge point are the roofline model's (Williams et al. 2009).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm_core.events import OpInfo

BACKEND_NAMES = {
    "fused": "fused SDPA (PyTorch scaled_dot_product_attention: the score matrix stays inside the kernel)",
    "math": "math (S = QK^T, softmax and PV as separate steps: S and P go through memory)",
    "cpu_paged": "CPU paged kernel (C: reads the KV blocks in place through the block table, nothing gathered; "
                 "sums in a fixed order, so a token's result ignores its batch)",
    "flash_attn": "flash-attn paged kernel (CUDA: reads the KV blocks in place, nothing gathered)",
    "cpu_contiguous": "CPU attention kernel over one contiguous KV region per request (the C kernel of "
                      "attention/paged_attention_cpu.c, given the whole region as one block: no block table, "
                      "nothing gathered; sums in a fixed order)",
}


@dataclass(frozen=True)
class LayerDims:
    """A decoder layer's sizes: elements, heads; ``elem`` bytes per number of the model's dtype.

    ``weight_elem``: bytes per linear-layer weight as stored, scales included (about 1.06 for
    Q8_0; 0 means ``elem``); ``kv_elem``: bytes per cached K/V number (0 means ``elem``);
    ``linear_weight_bytes``: the bytes each of qkv_proj, o_proj, gate_up_proj and down_proj
    stores, in that order, when the engine's layers report them (a GGUF file may keep each in
    another format, so one average would misstate each); ``linear_kinds``: the format each of
    those four runs in (``"q4_1"``, ``"q8_0"``, ``"float32"``, ...; empty: not known, and then no
    format is named).
    """

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    elem: int
    weight_elem: float = 0.0
    kv_elem: int = 0
    linear_weight_bytes: tuple[int, ...] = ()
    linear_kinds: tuple[str, ...] = ()

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // max(1, self.num_kv_heads)


@dataclass(frozen=True)
class SeqAttention:
    """One sequence's attention in a step: ``num_tokens`` queries over ``context_len`` keys.

    ``keys_read``: keys the kernel multiplies (more than ``context_len`` when a decode is padded
    to its group's longest context); ``gathered``: KV slots copied into a contiguous buffer
    first (0 when the kernel reads the cache directly).
    """

    num_tokens: int
    context_len: int
    keys_read: int
    gathered: int = 0


def causal_pairs(num_tokens: int, context_len: int) -> int:
    """(query, key) pairs under the causal mask: ``num_tokens`` new tokens at the end of ``context_len``.

    The query at position ``p`` attends keys ``0..p`` (``p + 1`` of them), so new tokens at
    positions ``c - t .. c - 1`` give ``t (c - t) + t (t + 1) / 2`` pairs: about half the
    ``t x c`` rectangle for a prefill from position 0, all of it for a decode (``t = 1``).
    """
    t, c = num_tokens, context_len
    return t * (c - t) + t * (t + 1) // 2


def score_pairs(s: SeqAttention, backend: str) -> int:
    """(query, key) scores the kernel computes for one sequence: what its loops visit.

    ``cpu_paged``: each query token walks keys ``0..position`` (the C kernel's ``token_ctx``),
    exactly :func:`causal_pairs`. ``flash_attn``, and ``fused`` on a causal square from
    position 0 (``is_causal``): the kernels skip the tiles above the diagonal, so the causal
    pairs (plus a part of the diagonal tiles, not counted here). ``math``, and ``fused`` with an
    explicit mask (a chunk after cached tokens, a padded decode): the whole ``num_tokens x
    keys_read`` rectangle is computed, then masked.
    """
    causal = causal_pairs(s.num_tokens, s.context_len)
    if backend in ("cpu_paged", "cpu_contiguous", "flash_attn"):
        return causal
    if backend == "fused" and s.num_tokens == s.context_len == s.keys_read:
        return causal
    return s.num_tokens * s.keys_read


def weight_note(d: LayerDims, index: int) -> str:
    """What linear module ``index`` (0 qkv, 1 o, 2 gate_up, 3 down) really multiplies, appended to its math:
    a block format's bytes and formula (``model/block_quant.py``; the X-Ray draws the
    block itself, ``educational/xray_blocks.py``), or nothing for float weights."""
    from nanovllm_core.educational.xray_blocks import FORMULA
    from nanovllm_core.model.block_formats import FORMATS  # torch-free: a replay or --connect loads no torch

    kind = d.linear_kinds[index] if index < len(d.linear_kinds) else ""
    if kind in FORMATS:
        f = FORMATS[kind]
        return f"; W in {kind.upper()} blocks, {f.block_bytes} bytes per 32 weights: {FORMULA[kind]}"
    return ""


def _op(name: str, math: str, shapes: str, flops: float, nbytes: float, kernel: str = "") -> OpInfo:
    return OpInfo(name, math, shapes, int(flops), int(nbytes), kernel)


def _attention_shapes(d: LayerDims, this: SeqAttention | None, backend: str) -> tuple[str, str, str]:
    """Shapes of the traced sequence's attention: (scores, softmax, output).

    Q and O as the engine and every kernel take them, ``[tokens, heads, head_dim]`` (a slice of
    the batch's ``[T, heads, head_dim]``), K and V as the sequence's context ``[keys, kv_heads,
    head_dim]`` (``attention/ops.py``, ``attention/cpu_paged.py``); the score matrix in the grouped
    layout X-Ray records, ``[kv_heads, group x tokens, keys]`` (query head h reads KV head h // group).
    """
    nh, nkv, hd, g = d.num_heads, d.num_kv_heads, d.head_dim, d.group
    t, k = (this.num_tokens, this.keys_read) if this else ("t", "ctx")
    gt = g * t if isinstance(t, int) else f"{g}t"
    padding = ""
    if this is not None and this.keys_read > this.context_len:
        padding = f" ({this.context_len} in context, {this.keys_read - this.context_len} padding slots masked)"
    if backend == "math":
        return (f"this request: Q [{t}, {nh}, {hd}] regrouped by KV head as [{nkv}, {gt}, {hd}] @ K^T "
                f"[{nkv}, {hd}, {k}] (K [{k}, {nkv}, {hd}]{padding}) -> S [{nkv}, {gt}, {k}]",
                f"S [{nkv}, {gt}, {k}] -> P, each row over its keys (causal mask)",
                f"P [{nkv}, {gt}, {k}] @ V [{nkv}, {k}, {hd}] -> [{nkv}, {gt}, {hd}], back to O [{t}, {nh}, {hd}]")
    fused = (f"this request: Q [{t}, {nh}, {hd}], K, V [{k}, {nkv}, {hd}]{padding} -> O [{t}, {nh}, {hd}]; "
             f"query head h reads KV head h // {g}, so its scores are grouped [{nkv}, {gt}, {k}] "
             f"({g} query heads x {t} token{'' if t == 1 else 's'} a KV head)")
    return fused, "", ""


def layer_ops(d: LayerDims, seqs: list[SeqAttention], backend: str = "fused",
              this: SeqAttention | None = None) -> tuple[OpInfo, ...]:
    """The operations of one decoder layer over a step's batch, in the order they run.

    Args:
        d: the layer's sizes.
        seqs: every scheduled sequence's attention (the batch has ``T = sum(num_tokens)`` rows).
        backend: ``"fused"``, ``"math"``, ``"cpu_paged"``, ``"cpu_contiguous"`` or ``"flash_attn"`` (see the module docstring).
        this: the traced sequence (its shapes are written out for attention, and, with other sequences
            in the batch, its share of the attention FLOPs and bytes, which are the batch's).

    Returns:
        ``OpInfo`` per operation: math, shapes (``[T, ...]`` for the batch), FLOPs, bytes.
    """
    h, i, nh, nkv, hd, e = d.hidden, d.intermediate, d.num_heads, d.num_kv_heads, d.head_dim, d.elem
    w, kv = d.weight_elem or e, d.kv_elem or e  # block modes: weights as stored; K/V as the cache stores them
    # what each product really multiplies (a block format's layout), and so which kernel ran it
    note = [weight_note(d, k) for k in range(4)]
    kern = [d.linear_kinds[k] if k < len(d.linear_kinds) else "" for k in range(4)]
    T = sum(s.num_tokens for s in seqs)
    qkv = (nh + 2 * nkv) * hd
    w_qkv, w_o, w_gate_up, w_down = d.linear_weight_bytes or (h * qkv * w, nh * hd * h * w, h * 2 * i * w, i * h * w)
    ops = [
        _op("input_layernorm", "RMSNorm before attention: x / sqrt(mean(x²) + eps) · w",
            f"residual [{T}, {h}] -> [{T}, {h}]", 4 * T * h, (2 * T * h + h) * e),
        _op("qkv_proj", "Q, K, V = X W_qkv  (one packed matrix)" + note[0],
            f"[{T}, {h}] @ [{h}, {qkv}] -> Q [{T}, {nh}, {hd}] | K [{T}, {nkv}, {hd}] | V [{T}, {nkv}, {hd}]",
            2 * T * h * qkv, w_qkv + (T * h + T * qkv) * e, kern[0]),
        _op("rope", "rotate each (x_i, x_i+d/2) pair of Q and K by position · theta^(-2i/d)",
            f"Q and K together [{T}, {nh + nkv}, {hd}]", 3 * T * (nh + nkv) * hd, 2 * T * (nh + nkv) * hd * e),
        _op("kv_cache_write", "K, V of the new tokens -> their slots (slot_mapping)",
            f"2 x [{T}, {nkv}, {hd}] -> the cache", 0, 2 * T * nkv * hd * (e + kv)),
    ]
    gathered = sum(s.gathered for s in seqs)
    if gathered and backend not in ("flash_attn", "cpu_paged", "cpu_contiguous"):
        ops.append(_op("kv_gather", "copy each sequence's KV blocks into one contiguous buffer (block table)",
                       f"2 x [{nkv}, {gathered}, {hd}] over the batch's sequences", 0,
                       2 * 2 * gathered * nkv * hd * kv))
    scores_shape, softmax_shape, out_shape = _attention_shapes(d, this, backend)
    q_bytes = sum(nh * s.num_tokens * hd for s in seqs) * e
    kv_bytes = sum(nkv * s.keys_read * hd for s in seqs) * kv
    pairs = sum(score_pairs(s, backend) for s in seqs)  # what the kernel's loops visit (causal halves)
    qk = 2 * nh * pairs * hd
    soft = 5 * nh * pairs
    s_bytes = sum(nh * s.num_tokens * s.keys_read for s in seqs) * e
    # The attention shapes are the traced request's; the FLOPs and bytes are the whole batch's (trial 12: a
    # 303k-FLOP figure under "this request" was 2 sequences' work): with others in the batch, say so and give its share.
    mine = {"scores": (0, 0), "softmax": (0, 0), "output": (0, 0), "fused": (0, 0)}
    if this is not None:
        q1, kv1 = nh * this.num_tokens * hd * e, nkv * this.keys_read * hd * kv
        p1 = score_pairs(this, backend)
        s1 = nh * this.num_tokens * this.keys_read * e
        mine = {"scores": (2 * nh * p1 * hd, q1 + kv1 + s1), "softmax": (5 * nh * p1, 2 * s1),
                "output": (2 * nh * p1 * hd, s1 + kv1 + q1), "fused": (4 * nh * p1 * hd + 5 * nh * p1, 2 * q1 + 2 * kv1)}

    def share(part: str) -> str:
        if this is None or len(seqs) < 2:
            return ""
        f, b = mine[part]
        return (f"; this op's FLOPs and bytes are the whole batch's ({len(seqs)} sequences), this request's share "
                f"{int(f):,} FLOPs and {int(b):,} bytes")

    if backend == "math":
        ops += [
            _op("attention_scores", f"S = Q K^T / sqrt({hd}), per sequence", scores_shape + share("scores"), qk,
                q_bytes + kv_bytes + s_bytes),
            _op("softmax", "P = softmax(S + causal mask)", softmax_shape + share("softmax"), soft, 2 * s_bytes),
            _op("attention_output", "O = P V", out_shape + share("output"), qk, s_bytes + kv_bytes + q_bytes),
        ]
    else:
        how = ("one kernel call for the batch, each query reading its context's blocks in place"
               if backend == "cpu_paged" else
               "one kernel call per sequence, reading its contiguous KV region in place" if backend == "cpu_contiguous"
               else "one fused kernel per sequence")
        ops.append(_op("attention", f"O = softmax(Q K^T / sqrt({hd}) + causal mask) V, {how}: "
                       "S and P never reach memory", scores_shape + share("fused"), 2 * qk + soft,
                       2 * q_bytes + 2 * kv_bytes))
    ops += [
        _op("o_proj", "Y = O W_o" + note[1], f"[{T}, {nh * hd}] @ [{nh * hd}, {h}] -> [{T}, {h}]",
            2 * T * nh * hd * h, w_o + (T * nh * hd + T * h) * e, kern[1]),
        _op("residual_add", "residual += attention output", f"[{T}, {h}] + [{T}, {h}]", T * h, 3 * T * h * e),
        _op("post_attention_layernorm", "RMSNorm before the MLP: x / sqrt(mean(x²) + eps) · w",
            f"residual [{T}, {h}] -> [{T}, {h}]", 4 * T * h, (2 * T * h + h) * e),
        _op("mlp_gate_up", "G, U = X W_gate, X W_up  (one packed matrix)" + note[2],
            f"[{T}, {h}] @ [{h}, {2 * i}] -> G, U [{T}, {i}]", 2 * T * h * 2 * i, w_gate_up + (T * h + 2 * T * i) * e,
            kern[2]),
        _op("swiglu", "A = SiLU(G) · U", f"[{T}, {i}] -> [{T}, {i}]", 5 * T * i, 3 * T * i * e),
        _op("mlp_down", "Y = A W_down" + note[3], f"[{T}, {i}] @ [{i}, {h}] -> [{T}, {h}]", 2 * T * i * h,
            w_down + (T * i + T * h) * e, kern[3]),
        _op("residual_add", "residual += MLP output", f"[{T}, {h}] + [{T}, {h}]", T * h, 3 * T * h * e),
    ]
    return tuple(ops)


def model_edge_ops(hidden: int, vocab: int, elem: int, lm_head_bytes: int, num_tokens: int,
                   num_sampled_rows: int, embedding_row_bytes: int = 0,
                   embedding_kind: str = "") -> tuple[OpInfo, ...]:
    """What a forward pass does outside its decoder layers: the embedding lookup, the final
    norm (both over all ``num_tokens`` rows) and the LM head, over the ``num_sampled_rows`` rows
    that sample only (the last token of each sampling sequence; 1 + k for a verification).

    ``lm_head_bytes``: the head's weight as stored (the embedding matrix when tied; it is read
    whole however few rows sample, and not at all in a step where no row samples: the engine
    then skips the head, ``ModelRunner.execute``); logits are written in float32. ``embedding_row_bytes``:
    one stored embedding row (0: ``hidden * elem``; a Q8_0 row of 576 is 18 blocks x 34 =
    612 bytes), read once per token and written as ``hidden`` numbers of ``elem`` bytes;
    ``embedding_kind``: its format when not the model's dtype (``"q8_0"``), named in the math.
    """
    T, S, h, v, e = num_tokens, num_sampled_rows, hidden, vocab, elem
    row = embedding_row_bytes or h * e
    stored = f", stored in {embedding_kind.upper()} blocks and decoded as it is read" if embedding_kind else ""
    return (
        _op("embedding_lookup", f"X = E[token ids]: one row of the embedding matrix per token{stored} (no arithmetic)",
            f"[{T}] ids -> [{T}, {h}]", 0, T * row + T * h * e),
        _op("final_norm", "RMSNorm after the last layer", f"[{T}, {h}] -> [{T}, {h}]", 4 * T * h, (2 * T * h + h) * e),
        _op("lm_head", "logits = X W_vocab^T, for the rows that sample" if S else
            "not run: no row samples in this step (a prompt chunk that is not its prompt's last), so the "
            "head's weights are not read",
            f"[{S}, {h}] @ [{h}, {v}] -> [{S}, {v}]", 2 * S * h * v,
            (lm_head_bytes + S * h * e + S * v * 4) if S else 0),
    )


def sampled_rows(scheduled) -> int:
    """Rows a step sends through the LM head: 1 per sampling sequence, 1 + k for a verification of k drafts."""
    return sum(s.num_tokens if getattr(s, "num_spec_tokens", 0) else 1 for s in scheduled if s.samples)


def decode_growth(d: LayerDims, backend: str = "fused") -> tuple[int, int, int]:
    """How a one-token decode's layer work grows with its context, from :func:`layer_ops`.

    Returns ``(fixed, per_key, crossover)``: the FLOPs that do not depend on the context (the
    projections, MLP, norms, RoPE, residual adds: one token's worth), the attention FLOPs each
    cached key adds (scores, softmax, weighted sum over all query heads), and the context
    length from which attention's FLOPs reach the fixed part.
    """
    def split(c: int) -> tuple[int, int]:
        ops = layer_ops(d, [SeqAttention(1, c, c)], backend)
        att = sum(o.flops for o in ops if o.name in ("attention", "attention_scores", "softmax", "attention_output"))
        return sum(o.flops for o in ops) - att, att

    fixed, one = split(1)
    _, two = split(2)
    per_key = two - one
    return fixed, per_key, -(-fixed // per_key) if per_key else 0


def intensity(flops: float, nbytes: float) -> float:
    """Arithmetic intensity, FLOP per byte moved (0 when nothing moves)."""
    return flops / nbytes if nbytes else 0.0


def layer_intensity(ops: tuple[OpInfo, ...] | list[OpInfo]) -> float:
    """The whole layer's FLOP/byte: all its FLOPs over all its bytes."""
    return intensity(sum(o.flops for o in ops), sum(o.bytes for o in ops))


def linear_crossing_tokens(n: int, k: int, bytes_per_weight: float, elem: float, ridge: float) -> float:
    """Tokens from which one linear layer ``[n, k]`` reaches ``ridge`` (FLOP/byte); ``inf`` if it never does.

    Over ``T`` tokens it does ``2 T n k`` FLOPs and moves ``n k b`` bytes of weights plus
    ``T (n + k) e`` of activations (as :func:`layer_ops` counts them), so the crossing is
    ``T* = R b n k / (2 n k - R (n + k) e)``: about ``R b / 2`` while the activation term is
    small, and never once ``R >= 2 n k / ((n + k) e)``. Halving ``b`` halves ``T*`` as surely as
    halving ``R`` does: the crossing moves by the ratio of ridges over the ratio of bytes per
    weight (:func:`crossing_shift`), not by the ridge ratio alone (``nanovllm_core.roofline``).
    """
    room = 2 * n * k - ridge * (n + k) * elem
    return ridge * bytes_per_weight * n * k / room if room > 0 else float("inf")


def crossing_shift(ridge_ratio: float, bytes_per_weight_ratio: float) -> float:
    """How many times more tokens a layer needs to turn compute-bound, to leading order (``T* ≈ R b / 2``):
    ``ridge_ratio`` (new ridge / old) divided by ``bytes_per_weight_ratio`` (old bytes a weight / new).

    A kernel whose peak is 12x float32's, on weights of 1.1 bytes: ``crossing_shift(12, 4 / 1.1)`` = 3.3, not 12.
    """
    return ridge_ratio / bytes_per_weight_ratio


LINEAR_OPS = ("qkv_proj", "o_proj", "mlp_gate_up", "mlp_down")  # the projections: the ops with a weight kernel


def is_block(kind: str) -> bool:
    """Whether weights of ``kind`` run a block kernel (``"q4_1"``, ...: ``model/block_formats.FORMATS``)."""
    from nanovllm_core.model.block_formats import FORMATS  # torch-free

    return kind in FORMATS


def kernel_peak(kind: str, float_peak: float, block_peaks: tuple[tuple[str, float], ...] | dict = ()) -> float:
    """The peak FLOP/s an operation on weights of ``kind`` is judged against: the block kernel's
    measured peak for a block format (``block_peaks[kind]``, from ``roofline.block_peak``; 0.0 when
    it was not measured, and then the operation gets no verdict), the float matmul's for anything
    else (float weights, and ``""``: an operation that is no projection, whose own kernel's peak is
    not measured: norms, RoPE, attention).

    Trial 14c: judged against the float matmul's 44 GFLOP/s, a Q4_1 decode of 2 tokens was called
    compute-bound; the Q4_1 kernel's own peak measured 1.6-3x the float one's on the same 2-core AMD EPYC
    (Zen 4, AVX-512 with VNNI).
    """
    if is_block(kind):
        return float(dict(block_peaks).get(kind, 0.0))
    return float_peak


def unjudged_kinds(ops, block_peaks: tuple[tuple[str, float], ...] | dict = ()) -> list[str]:
    """The block formats among ``ops``' kernels whose peak is not in ``block_peaks`` (sorted, once each)."""
    known = dict(block_peaks)
    return sorted({o.kernel for o in ops if is_block(o.kernel) and not known.get(o.kernel)})


@dataclass(frozen=True)
class LayerRoof:
    """A layer against the roofline, each operation at its own kernel's peak.

    ``compute_s``: the sum of each operation's FLOPs over its kernel's peak; ``memory_s``: all its
    bytes over the bandwidth; ``min_s``: the sum of each operation's larger of the two (they run one
    after another); ``ridge``: the layer's own ridge point, FLOP/byte (its FLOPs over ``compute_s``,
    over the bandwidth: the float ridge when every operation is judged against the float peak).
    """

    compute_s: float
    memory_s: float
    min_s: float
    ridge: float

    @property
    def bound(self) -> str:
        return "compute-bound" if self.compute_s >= self.memory_s else "memory-bound"


def layer_roof(ops, float_peak: float, bandwidth: float,
               block_peaks: tuple[tuple[str, float], ...] | dict = ()) -> LayerRoof | None:
    """:class:`LayerRoof` of ``ops``, or None when a block kernel among them has no measured peak."""
    if float_peak <= 0 or bandwidth <= 0 or unjudged_kinds(ops, block_peaks):
        return None
    compute = memory = least = 0.0
    for o in ops:
        c = o.flops / kernel_peak(o.kernel, float_peak, block_peaks) if o.flops else 0.0
        m = o.bytes / bandwidth
        compute, memory, least = compute + c, memory + m, least + max(c, m)
    flops = sum(o.flops for o in ops)
    return LayerRoof(compute, memory, least, flops / compute / bandwidth if compute else float_peak / bandwidth)


def compute_bound_tokens(d: LayerDims, ridge: float, backend: str = "fused", limit: int = 1 << 16,
                         block_ridges: tuple[tuple[str, float], ...] | dict = ()) -> int:
    """The fewest tokens a one-sequence prefill (from position 0) needs for its layer to reach its ridge point.

    ``ridge`` in FLOP/byte (the float matmul's peak FLOP/s over the bandwidth): what every
    operation is judged against but a block-format projection, which is judged against its block
    kernel's ridge in ``block_ridges`` (``(format, FLOP/byte)``). The layer is compute-bound once the
    sum of each operation's FLOPs over its ridge reaches its bytes (:func:`layer_roof`; with one
    ridge for all, once its intensity reaches it). Returns 0 when even ``limit`` tokens stay below
    it, or when a block format of ``d`` has no ridge in ``block_ridges`` (not known: no answer).
    The layer's intensity grows with the tokens (each weight read serves more rows), so a doubling
    search then a bisection finds the crossing.
    """
    if unjudged_kinds(layer_ops(d, [SeqAttention(1, 1, 1)], backend), block_ridges):
        return 0

    def reaches(t: int) -> bool:
        roof = layer_roof(layer_ops(d, [SeqAttention(t, t, t)], backend), ridge, 1.0, block_ridges)
        return roof is not None and roof.compute_s >= roof.memory_s

    hi = 1
    while not reaches(hi):
        if hi >= limit:
            return 0
        hi = min(limit, hi * 2)
    lo = hi // 2  # reaches(lo) is False (or lo == 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
    return hi


BLOCK_MACHINE_WORDS = tuple(f", {mode} weights" for mode in ("gguf", "q8_0", "q4_0", "q4_1"))


def peak_words(machine: str, peak_flops: float, block_peaks: tuple[tuple[str, float], ...] | dict = ()) -> str:
    """The peaks a roofline judges against: ``"matmul peak 330.0 GFLOP/s"`` for float weights; under a
    block mode (``machine`` names ``gguf``, ``q8_0``, ``q4_0`` or ``q4_1`` weights) the float matmul's
    for the operations that are no block projection, then each block kernel's, measured on this
    model's weights (``roofline.block_peak``), or, when they were not measured (a trace recorded
    before they were), that they were not."""
    if not any(w in machine for w in BLOCK_MACHINE_WORDS) and not block_peaks:
        return f"matmul peak {peak_flops / 1e9:,.1f} GFLOP/s"
    words = f"float matmul peak {peak_flops / 1e9:,.1f} GFLOP/s (the float operations)"
    if UNRELIABLE in machine and not block_peaks:
        return words + f", the block kernels' own not reliably measured on this busy host"
    if not block_peaks:
        return words + ", the block kernels' own not measured"
    kernels = ", ".join(f"{k.upper()} block kernel peak {v / 1e9:,.1f} GFLOP/s" for k, v in dict(block_peaks).items())
    return f"{words}, {kernels} (the {'projection' if len(dict(block_peaks)) == 1 else 'projections'} in that "\
           "format, timed on this model's weights)"


UNRELIABLE = "could not be measured reliably on this busy host"  # roofline.UNRELIABLE (torch-free copy)
REMEASURE = "python -m nanovllm_core.roofline"


def unknown_peak_reason(machine: str, kinds: list[str]) -> str:
    """Why the projections of block formats ``kinds`` get no compute/memory verdict: their kernel's peak
    was measured but not trusted (``machine`` says so: ``roofline.with_block_peaks``), or not measured."""
    names = " and ".join("block" if k == "block" else k.upper() for k in kinds)
    whose = "kernels' peaks" if len(kinds) > 1 else "kernel's peak"
    if UNRELIABLE in machine:
        return f"the {names} {whose} {UNRELIABLE}; run `{REMEASURE}` when the machine is quiet"
    return f"the {names} {whose} {'were' if len(kinds) > 1 else 'was'} not measured (the float matmul's is not theirs)"


def ridge_position(intensity_: float, ridge: float) -> str:
    """Where an intensity sits against a ridge point, from their ratio: ``"below"`` (under half of it),
    ``"just below"``, ``"just above"`` (within 2x either side: near it, where a busier host or
    another kernel could tip it) or ``"above"`` (twice it or more)."""
    r = intensity_ / ridge if ridge else float("inf")
    if r < 0.5:
        return "below"
    if r < 1:
        return "just below"
    if r < 2:
        return "just above"
    return "above"
