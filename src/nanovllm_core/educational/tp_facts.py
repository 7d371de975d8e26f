"""Tensor parallelism in numbers: which sizes split a model, each rank's shard shapes, the
bytes its all-reduces carry, and where a split step's time went. Pure arithmetic.

The split is Megatron-LM's (Shoeybi et al. 2019, section 3), as vLLM and nano-vllm run it:

- q/k/v and gate/up are *column-parallel*: each rank keeps a slice of the output features
  (its query heads and the KV heads they read; its share of the MLP's intermediate
  features), so it computes its slice of Q, K, V and of SiLU(G) * U without talking to anyone;
- o and down are *row-parallel*: each rank keeps the matching slice of the input features and
  produces a full-width ``[T, hidden]`` partial sum; one all-reduce (a sum over the ranks)
  after each gives every rank the layer's output: 2 all-reduces per decoder layer;
- the embedding and the LM head are split over the vocabulary: a rank looks up only the ids
  in its rows (zeros elsewhere) and one all-reduce of ``[T, hidden]`` sums the lookups; the LM
  head gives each rank the logits of its rows, ``[S, vocab / N]``, gathered on rank 0, which
  samples (a gather, not an all-reduce).

So a step of T tokens runs ``2 * layers + 1`` all-reduces of a ``[T, hidden]`` tensor (61 on
a 30-layer model) and one gather of the sampled rows' logits.

Grouped-query attention bounds N: a query head reads KV head ``h // group`` and the two must
live on the same rank, so each rank holds whole KV heads and the query heads that read them.
Here N must divide the KV heads (and then the query heads), the intermediate size and the
vocabulary: the engine's own rule (``split_rule.split_sizes``, which ``model.parallel`` applies), which this module calls. (vLLM
also accepts a multiple of the KV heads, replicating each KV head on N / KV-heads ranks; this
engine does not.)

Shapes are written ``[in, out]``, as the X-Ray writes a product's right operand
(``[T, 576] @ [576, 192]``); the embedding is a table ``[rows, hidden]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from nanovllm_core import events as ev
from nanovllm_core.educational.commentary import ms, plural

DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}
COMM_SHARE_TOLD = 0.2  # the narrator says a step waited on communication from this share of a rank's time


@dataclass(frozen=True)
class TPDims:
    """The sizes the split depends on (elements; heads)."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int


def dims(model: Any) -> TPDims:
    """:class:`TPDims` from ``LLMEngine.model_info()`` (a mapping: ``num_heads``, ``num_layers``, ...)
    or a ``ModelConfig`` (attributes: ``num_attention_heads``, ``num_hidden_layers``, ...).

    Raises:
        ValueError: a size is missing or not a positive integer (names it).
    """
    names = {"num_layers": ("num_layers", "num_hidden_layers"), "hidden": ("hidden_size",),
             "intermediate": ("intermediate_size",), "num_heads": ("num_heads", "num_attention_heads"),
             "num_kv_heads": ("num_kv_heads", "num_key_value_heads"), "head_dim": ("head_dim",),
             "vocab": ("vocab_size",)}
    got: dict[str, int] = {}
    for field_, keys in names.items():
        value = None
        for k in keys:
            value = model.get(k) if isinstance(model, Mapping) else getattr(model, k, None)
            if value is not None:
                break
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"tensor-parallel shapes need a positive integer {keys[0]}, got {value!r}")
        got[field_] = value
    return TPDims(**got)


def valid_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int | None = None,
                vocab_size: int | None = None) -> list[int]:
    """Tensor-parallel sizes N that split a model: N divides the KV heads (each rank holds whole KV
    heads and the query heads that read them, so it also divides the query heads) and, when given,
    the MLP's intermediate size and the vocabulary (each rank's rows of the embedding and the LM
    head). The engine's own check (``split_rule.split_sizes``, which ``model.parallel`` applies), so the two cannot disagree.
    SmolLM2-135M (9 query, 3 KV heads, 1536, 49152): ``[1, 3]``.

    Raises:
        ValueError: a head count that is not positive, or query heads not a multiple of KV heads.
    """
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"heads must be positive with query heads a multiple of KV heads, got {num_heads} "
                         f"query and {num_kv_heads} KV heads")
    from nanovllm_core.split_rule import split_sizes

    return split_sizes(num_kv_heads, num_heads, num_kv_heads, intermediate_size, vocab_size)


def check_size(n: int, d: TPDims) -> None:
    """Raise a one-line ``ValueError`` naming the sizes that work unless ``n`` splits ``d``."""
    ok = valid_sizes(d.num_heads, d.num_kv_heads, d.intermediate, d.vocab)
    if isinstance(n, bool) or not isinstance(n, int) or n not in ok:
        raise ValueError(f"tensor_parallel_size {n!r} does not split {d.num_heads} query / {d.num_kv_heads} KV heads, "
                         f"{d.intermediate} intermediate features and a vocabulary of {d.vocab}: use one of "
                         f"{', '.join(map(str, ok))}")


@dataclass(frozen=True)
class RankShard:
    """What rank ``rank`` of ``n`` holds of each decoder layer (shapes ``[in, out]``) and of the vocabulary.

    ``q_heads`` / ``kv_heads``: ``(first, last + 1)`` of its query and KV heads;
    ``vocab_rows``: ``(first, last + 1)`` of its vocabulary rows (``vocab / n`` each: n divides the
    vocabulary, as the engine requires).
    """

    rank: int
    n: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    q: tuple[int, int]
    k: tuple[int, int]
    v: tuple[int, int]
    o: tuple[int, int]
    gate: tuple[int, int]
    up: tuple[int, int]
    down: tuple[int, int]
    vocab_rows: tuple[int, int]
    embedding: tuple[int, int]
    lm_head: tuple[int, int]


def shard_shapes(model: Any, n: int) -> tuple[RankShard, ...]:
    """Each rank's shard shapes under the Megatron split (module docstring), rank 0 first.

    Args:
        model: ``model_info()`` or a ``ModelConfig`` (see :func:`dims`).
        n: the tensor-parallel size.

    Raises:
        ValueError: ``n`` does not split the model (one line naming the sizes that do), or a size is missing.
    """
    d = dims(model)
    check_size(n, d)
    qh, kvh, inter = d.num_heads // n, d.num_kv_heads // n, d.intermediate // n
    rows = -(-d.vocab // n)
    out = []
    for r in range(n):
        first, last = r * rows, min(d.vocab, (r + 1) * rows)
        out.append(RankShard(
            rank=r, n=n, q_heads=(r * qh, (r + 1) * qh), kv_heads=(r * kvh, (r + 1) * kvh),
            q=(d.hidden, qh * d.head_dim), k=(d.hidden, kvh * d.head_dim), v=(d.hidden, kvh * d.head_dim),
            o=(qh * d.head_dim, d.hidden), gate=(d.hidden, inter), up=(d.hidden, inter), down=(inter, d.hidden),
            vocab_rows=(first, last), embedding=(last - first, d.hidden), lm_head=(d.hidden, last - first)))
    return tuple(out)


def allreduces_per_step(num_layers: int) -> int:
    """All-reduces of a ``[T, hidden]`` tensor in one forward pass, whatever T: 2 per decoder layer
    (after o_proj and after down_proj) and 1 for the vocabulary-split embedding (the LM head's
    logits are gathered on rank 0 instead, see :func:`lm_head_gather_bytes`)."""
    return 2 * num_layers + 1


def allreduce_bytes_per_token(hidden: int, dtype_bytes: int, num_layers: int) -> int:
    """Bytes each rank contributes to a forward pass's all-reduces per token:
    ``(2 * layers + 1) * hidden * dtype_bytes`` (SmolLM2 in float32: 61 x 576 x 4 = 140,544).

    The tensors' size, not the traffic: a ring all-reduce sends and receives 2 (N - 1) / N of it
    per rank, and gloo picks its own algorithm."""
    return allreduces_per_step(num_layers) * hidden * dtype_bytes


def lm_head_gather_bytes(vocab: int, n: int, num_sampled_rows: int) -> int:
    """Bytes of float32 logits one rank sends to rank 0 for a step's sampled rows: ``S * ceil(vocab / n) * 4``."""
    return num_sampled_rows * -(-vocab // n) * 4


def dtype_bytes(info: Mapping[str, Any]) -> int:
    """Bytes of one activation number (the all-reduced tensors' dtype), from ``model_info()['dtype']`` (4 if unknown)."""
    return DTYPE_BYTES.get(str(info.get("dtype", "float32")).replace("torch.", ""), 4)


def tp_size(info: Mapping[str, Any]) -> int:
    """``model_info()['tensor_parallel_size']``, 1 when absent (one process, or an older engine)."""
    n = info.get("tensor_parallel_size", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def across_ranks(nbytes: float, n: int, fmt: Callable[[float], str] | None = None) -> str:
    """What a KV-cache byte figure includes under tensor parallelism: ``""`` at ``n`` <= 1, else
    ``" across 3 ranks (240.0 KiB on each)"`` (``fmt`` formats the share; default ``"15,360 bytes"``).

    The engine's KV sizes (``kv_bytes_per_token``, a block's bytes, the pool) are whole-model
    totals: every rank holds each block's slice of its own KV heads, ``nbytes / n``."""
    if n <= 1:
        return ""
    each = nbytes / n
    return f" across {n} ranks ({fmt(each) if fmt else f'{round(each):,} bytes'} on each)"


def _span(a: tuple[int, int]) -> str:
    return str(a[0]) if a[1] - a[0] == 1 else f"{a[0]}-{a[1] - 1}"


def _shape(s: tuple[int, int]) -> str:
    return f"[{s[0]}, {s[1]}]"


def xray_lines(trace: ev.LayerTrace, info: Mapping[str, Any]) -> list[str]:
    """The X-Ray's tensor-parallel lines for the layer ``trace`` drew: each rank's shard shapes, and
    the bytes each of the layer's two all-reduces moves for this step's ``num_batch_tokens`` rows.

    Empty at N = 1, and when ``info`` lacks a size the shapes need (nothing is guessed)."""
    return shard_lines(info, trace.layer, trace.num_layers, trace.num_batch_tokens)


def shard_lines(info: Mapping[str, Any], layer: int, num_layers: int, num_tokens: int) -> list[str]:
    """Each rank's shard shapes of decoder layer ``layer`` and, when ``num_tokens`` (T, the step's
    flat batch: the rows of every all-reduced ``[T, hidden]`` tensor) is positive, the bytes each of
    the layer's two all-reduces and the step's ``2 * num_layers + 1`` all-reduces move per rank.

    Empty at N = 1, and when ``info`` (``model_info()``) lacks a size the shapes need (nothing is guessed)."""
    n = tp_size(info)
    if n == 1:
        return []
    try:
        shards = shard_shapes(info, n)
    except ValueError:
        return []
    lines = [f"Tensor parallel over {n} ranks (Megatron split): layer {layer}'s weights on each rank, [in, out]:"]
    for s in shards:
        lines.append(f"  rank {s.rank}: q {_shape(s.q)} (query heads {_span(s.q_heads)}), k and v {_shape(s.k)} "
                     f"each (KV head{'s' if s.kv_heads[1] - s.kv_heads[0] > 1 else ''} {_span(s.kv_heads)}), o {_shape(s.o)}, gate and up {_shape(s.gate)} each, "
                     f"down {_shape(s.down)}")
    elem = dtype_bytes(info)
    h, t = shards[0].o[1], num_tokens
    lines.append(f"o and down are row-parallel: each rank's product is a partial sum [T, {h}], and one all-reduce "
                 "after each adds the ranks' sums: 2 all-reduces in this layer.")
    if t:
        per = t * h * elem
        lines.append(f"This step, T = {t}: each all-reduce takes {t} x {h} x {elem} bytes = {per:,} bytes from every "
                     f"rank ({2 * per:,} for the layer; over the {num_layers} layers and the embedding's one, "
                     f"{allreduces_per_step(num_layers)} all-reduces, {allreduces_per_step(num_layers) * per:,} "
                     "bytes per rank).")
    return lines


def rank_kv_lines(info: Mapping[str, Any]) -> list[str]:
    """Grouped-query attention and the KV cache under the split, rank by rank: each rank's KV
    heads, the query heads that read them, and the KV bytes it keeps a token and a block (from
    ``model_info()``: the engine's ``kv_bytes_per_token`` is the whole model's, summed over the
    ranks; each holds ``1/N``). The X-Ray's "GQA and KV memory" panel of a split engine.

    Empty at N = 1 and when ``info`` lacks a size (nothing is guessed)."""
    n = tp_size(info)
    per = info.get("kv_bytes_per_token")
    if n == 1 or not isinstance(per, int) or per <= 0:
        return []
    try:
        d = dims(info)
        shards = shard_shapes(info, n)
    except ValueError:
        return []
    group = d.num_heads // d.num_kv_heads
    kvh = d.num_kv_heads // n
    elem = per // (2 * d.num_layers * d.num_kv_heads * d.head_dim)
    each = per // n
    block = info.get("block_size")
    lines = [f"GQA over {n} ranks: {d.num_heads} query heads share {d.num_kv_heads} KV heads (query head h reads KV "
             f"head h // {group}); each rank holds whole KV heads and the query heads that read them, so attention "
             "needs no communication. Each rank's KV cache keeps only its own KV heads:"]
    for s in shards:
        lines.append(f"  rank {s.rank}: KV head{'s' if kvh > 1 else ''} {_span(s.kv_heads)}, query heads "
                     f"{_span(s.q_heads)}: 2 (K, V) x {d.num_layers} layers x {kvh} x {d.head_dim} x {elem} bytes = "
                     f"{each:,} bytes a token" + (f", {each * block:,} a block of {block}" if block else ""))
    lines.append(f"Together {per:,} bytes a token across the {n} ranks: the KV sizes the Dashboard and Narrator "
                 "give are these totals.")
    return lines


def capture_off_line(n: int) -> str:
    """The one line the X-Ray shows instead of a captured layer when the engine runs split over ``n`` ranks."""
    return (f"No captured values at tensor_parallel_size {n}: the X-Ray's capture reads whole-model tensors and "
            "each rank holds only its shard, so the engine does not capture; shown instead, from the model's "
            "sizes and the step's token count, what the split runs.")


def untraced_lines(info: Mapping[str, Any], step: int, num_tokens: int, layer: int = 0) -> list[str]:
    """The X-Ray of a split engine's step ``step`` of ``num_tokens`` tokens (T of the flat batch, from
    ``StepTimed.num_tokens`` or ``StepPlanned.num_batched_tokens``): :func:`capture_off_line`, then
    :func:`shard_lines` for decoder layer ``layer``.

    Empty at N = 1 and when ``info`` lacks a size (``num_layers`` among them) or ``layer`` is not one of
    the model's layers (nothing is guessed)."""
    n = tp_size(info)
    layers = info.get("num_layers")
    if n == 1 or not isinstance(layers, int) or not 0 <= layer < layers:
        return []
    shards = shard_lines(info, layer, layers, num_tokens)
    if not shards:
        return []
    tokens = f"{num_tokens:,} token{'' if num_tokens == 1 else 's'}"
    return [capture_off_line(n), f"Step {step}: {tokens} in the batch (T = {num_tokens})."] + shards


@dataclass(frozen=True)
class TimeSplit:
    """Where a split step's time went, per rank (seconds): ``compute[r] + comm[r]`` is what rank r measured."""

    step: int
    n: int
    compute: tuple[float, ...]
    comm: tuple[float, ...]
    allreduces: int
    allreduce_bytes: int
    wall: float
    num_tokens: int

    def share(self, rank: int) -> float:
        """Rank ``rank``'s time in collectives (all-reduces, logits gather) over its measured time (0..1; 0 when nothing was measured)."""
        total = self.compute[rank] + self.comm[rank]
        return self.comm[rank] / total if total > 0 else 0.0


def time_split(t: ev.StepTimed) -> TimeSplit | None:
    """The step's per-rank split, or None when there is nothing true to show: one rank, no tokens,
    or per-rank times missing or not one per rank (an older trace, a step the engine did not measure)."""
    n = t.tp_size
    if n <= 1 or t.num_tokens <= 0 or len(t.tp_compute_s) != n or len(t.tp_comm_s) != n:
        return None
    if any(x < 0 for x in (*t.tp_compute_s, *t.tp_comm_s)):
        return None
    return TimeSplit(t.step, n, tuple(t.tp_compute_s), tuple(t.tp_comm_s), t.tp_all_reduces,
                     t.tp_all_reduce_bytes, t.wall_time_s, t.num_tokens)


def _tokens(n: int) -> str:
    return f"{n:,} token{'' if n == 1 else 's'}"


def _ms(s: float) -> str:
    return ms(s, digits=2)


def dashboard_lines(t: ev.StepTimed) -> list[str]:
    """Per-rank compute and communication of the step, and a caption saying what they include.
    Empty when :func:`time_split` has nothing true to show (N = 1 among others)."""
    split = time_split(t)
    if split is None:
        return []
    lines = [f"rank {r}: compute {_ms(split.compute[r])} · communication {_ms(split.comm[r])} ({split.share(r):.0%})"
             for r in range(split.n)]
    lines.append(f"step {split.step}: {_tokens(split.num_tokens)}, wall {_ms(split.wall)}; "
                 f"{split.allreduces} all-reduces a rank, {split.allreduce_bytes:,} bytes from each")
    lines.append("communication = time inside the step's all-reduces and its logits gather to rank 0, waiting for the "
                 "slowest rank included; compute + communication = the rank's forward pass. "
                 "The wall time is rank 0's whole step: scheduling, sampling and events too.")
    return lines


def waited_on_communication(t: ev.StepTimed, threshold: float = COMM_SHARE_TOLD) -> str | None:
    """The narrator's sentence when some rank spent at least ``threshold`` of its measured time of
    step ``t`` inside collectives, with the measured figures; None otherwise (N = 1, no tokens,
    per-rank times missing, or every rank below the threshold)."""
    split = time_split(t)
    if split is None:
        return None
    worst = max(range(split.n), key=split.share)
    if split.share(worst) < threshold:
        return None
    per_rank = "; ".join(f"rank {r} {_ms(split.comm[r])} of its {_ms(split.compute[r] + split.comm[r])} "
                         f"({split.share(r):.0%})" for r in range(split.n))
    count = ""
    if split.allreduces:
        count = (f" ({split.allreduces} all-reduces a rank, {split.allreduce_bytes:,} bytes from each, and the logits "
                 f"gather; {split.comm[worst] / (split.allreduces + 1) * 1e6:,.0f} µs a collective on average on "
                 f"rank {worst})")
    return (f"This step of {_tokens(split.num_tokens)} waited on communication. Time inside collectives (all-reduces and the logits gather): {per_rank}"
            f"{count}. A collective's time includes waiting for the slowest rank to arrive, not only moving bytes; "
            "ranks on one CPU also share its cores and memory bandwidth.")


SPLIT_UNAVAILABLE = ("the split engine (tensor_parallel_size) is not available in this build: the model runs in "
                     "one process here")
# The app's Tutorial tab runs the measurement only: a split engine loads a shard in every rank
# (seconds of loading the UI must not wait on) and starts processes of its own.
SPLIT_RUN_ELSEWHERE = ("the split run itself: `nanovllm --tutorial --tutorial-chapter 13` in a terminal, or this app "
                       "started with --tensor-parallel-size 3, whose Dashboard, X-Ray and Narrator then show every rank")


def app_no_baseline(local: bool, split: int) -> str:
    """Why the app's Tutorial tab timed no one-process decode step beside its all-reduces (trial 16c,
    16a): it watches a server (``local`` False), its own engine is split over ``split`` ranks (its
    model there is rank 0's shard), or the model was not loaded yet; where the comparison is printed."""
    cli = "`nanovllm --tutorial --tutorial-chapter 13` prints the comparison"
    if not local:
        return f"No one-process decode step was timed to compare with: this app watches a server and runs no model of its own; {cli}"
    if split > 1:
        return (f"No one-process decode step was timed to compare with: this app's own engine is split over {split} "
                f"ranks, so what is loaded here is rank 0's shard, not the whole model; {cli}")
    return "No one-process decode step was timed to compare with: the model was not loaded yet; press r again once it is ready"


def split_run_words(info: Mapping[str, Any]) -> str:
    """Where the Tutorial tab's reader finds the split run: :data:`SPLIT_RUN_ELSEWHERE`, or, when the app's
    own engine (``info``: its ``model_info()``) is already split, that engine, not an option to add."""
    n = tp_size(info)
    if n > 1:
        return (f"the split run itself is this app's own engine, already split over {n} ranks: its Dashboard, "
                "X-Ray and Narrator show every rank as you send prompts")
    return SPLIT_RUN_ELSEWHERE


def split_engine_available() -> bool:
    """Does this build's ``EngineConfig`` take ``tensor_parallel_size`` (the engine split over ranks)?"""
    import dataclasses

    from nanovllm_core.config import EngineConfig  # loads torch: only when a demonstration asks

    return "tensor_parallel_size" in {f.name for f in dataclasses.fields(EngineConfig)}


def communication_words(m: Any, allreduces: int, decode_steps: list[ev.StepTimed], prompt: str = "",
                        weights: str = "", busy: str | None = None) -> str:
    """The tensor-parallel demonstration's sentences: the measured all-reduce latency (``m``: a
    ``tp_measure.AllReduceLatency``), what ``allreduces`` of them cost a token at the median, and
    beside it the mean wall time of the one-process decode steps in ``decode_steps`` (measured in
    the same run; left out when there are none), named by ``prompt``, the one they decoded (the
    chapter's ``demo_prompt``: nothing before the sentence shows it, trial 17b #4).

    ``weights``: the one-process engine's weight format (``commentary.weights_label``; "" for float
    weights): a split engine shards float layers only, so over a GGUF file its ranks read float weights
    where the one process read the file's blocks, and the words say that part of the gap is the format
    (trial 34e: the chapter put all of it on the split). ``busy``: ``host_load.HostCheck.note()`` over the
    measurements, told when the host was busy (trial 34e: a loaded host's 570 ms "one-process" step made
    the split engine read as the faster)."""
    per_token_ms = m.per_token_us(allreduces) / 1000
    text = (f"Measured now on {m.machine}: one all-reduce of a [1, {m.hidden}] float32 tensor ({m.nbytes:,} bytes) "
            f"between {m.world_size} processes ({m.backend} over 127.0.0.1, one thread each) took {m.p50_us:,.0f} µs "
            f"at the median and {m.p99_us:,.0f} µs at the 99th percentile, over {m.iters} calls. A decode token of "
            f"this model runs {allreduces} of them one after another: {allreduces} x {m.p50_us:,.0f} µs = "
            f"{ms(per_token_ms / 1000)} of communication a token at the median, before any arithmetic (and before "
            "rank 0 gathers the logits).")
    if decode_steps:
        one = sum(t.wall_time_s for t in decode_steps) / len(decode_steps)
        which = f"the chapter's demo prompt ({prompt!r})" if prompt else "the chapter's demo prompt"
        text += (f" One process decoded {which} at {ms(one)} a step (mean of "
                 f"{plural(len(decode_steps), 'decode step')}, measured just now): "
                 f"the all-reduces alone are {per_token_ms / one / 1000:.1f}x that, and the split ranks' arithmetic, "
                 "on the same cores, comes on top.")
        if weights:
            text += (f" That process ran the loaded model's {weights}; a split engine runs float weights instead "
                     "(this engine splits float layers only, not the file's blocks), more bytes a step for the same "
                     "model, so part of a split step's gap to this one is the weight format, not the split.")
    if busy:
        text += f" {busy[0].upper()}{busy[1:]}."
    return text
