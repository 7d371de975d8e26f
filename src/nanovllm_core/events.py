"""The event contract: typed, immutable records of everything the engine does.

The TUI, the CLI teaching modes and trace files see the engine only through these. Each
event is a frozen dataclass of plain values (ints, floats, strings, tuples, nested event
parts), cheap to build, safe to hand to another thread, and serialisable to one JSON line
with :func:`to_json` and back with :func:`from_json`.

Events about one request carry ``request_id``; events about one engine step carry ``step``.
Expensive events (``LayerTrace``, top-k lists, ``BlocksChanged``) are only built when a
subscriber asked for them (see ``LLMEngine.subscribe``).

Why this file runs past ~400 lines: it is the whole contract between the engine and every
view, server and trace file, and it is read as one list (each event a short dataclass, with
the JSON codec they share at the end); split, a reader would lose the one place to look.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

from nanovllm_core import untrusted


def _now() -> float:
    return time.time()


@dataclass(frozen=True)
class Event:
    """Base of all events. ``time``: wall-clock seconds since the epoch when it was made."""

    time: float = field(default_factory=_now, kw_only=True)

    @property
    def kind(self) -> str:
        return type(self).__name__


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class RequestAdded(Event):
    """A request entered the waiting queue.

    ``prompt_pieces``: the tokenizer's piece for each prompt token (for the narrator; as
    :class:`TopToken` ``text``, bytes of a character as ``<0xE3>``);
    ``sampling``: the request's non-default sampling settings. ``prompt`` is the text of a
    text prompt, None for token ids or a conversation; ``chat``: a conversation's ``(role,
    text)`` per message, rendered with the model's chat template into the token ids (empty
    otherwise, and in traces recorded before this field existed).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    prompt_pieces: tuple[str, ...]
    priority: int
    max_tokens: int | None
    n: int = 1
    sampling: tuple[tuple[str, Any], ...] = ()
    chat: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RequestRejected(Event):
    """A request was refused before running; ``reason`` says why and what to do.

    ``priority`` / ``max_tokens``: the request's, as asked (None where the refusal came before they
    were known, and in traces recorded before these fields existed), so a replay's row shows them
    as the live app's does (trial 11)."""

    request_id: str
    reason: str
    priority: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True)
class SampleResult:
    """How one of a request's ``n`` samples ended."""

    index: int
    finish_reason: str
    stop_reason: str | int | None
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RequestFinished(Event):
    """A request ended: once per request, when its last sample ends.

    The top-level fields describe sample 0; ``samples`` lists every sample (``n`` > 1).
    ``finish_reason``: ``stop`` / ``length`` / ``abort`` / ``error``. Times in seconds
    (TTFT = first token - arrival; TPOT = mean time from the first token to the last, per later
    token; e2e = finish - arrival). TTFT and TPOT are the engine's own time: time a controller
    held the engine paused is left out; e2e is wall time, and ``paused_s`` says how much of it
    the request spent paused (None in traces recorded before this field existed).
    ``kv_blocks_used`` / ``kv_blocks_cached``: the KV pool's used and cached-free blocks right
    after this request's blocks were returned, so a view stays true after an abort between
    steps (None in traces recorded before these fields existed).
    Prefix-cache hits of sample 0 (``RequestMetrics``), in tokens: ``num_cached_prompt_tokens``: prompt
    tokens the cache held at its first admission (vLLM's ``num_cached_tokens``);
    ``num_cached_tokens_readmitted``: the most one readmission after a preemption found there, prompt
    and generated tokens (None: never readmitted, or a trace recorded before this field existed).
    """

    request_id: str
    step: int | None
    index: int
    finish_reason: str
    stop_reason: str | int | None
    output_text: str
    output_token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    num_preemptions: int
    num_cached_prompt_tokens: int
    error: str | None = None
    samples: tuple[SampleResult, ...] = ()
    kv_blocks_used: int | None = None
    kv_blocks_cached: int | None = None
    paused_s: float | None = None
    num_cached_tokens_readmitted: int | None = None


# ------------------------------------------------------------------------------ steps


@dataclass(frozen=True)
class ScheduledEntry:
    """One sequence in a step plan: ``kind`` ``prefill`` (a chunk) or ``decode``; token counts.

    ``num_spec_tokens``: draft slots this step reserved for the sequence (speculative
    decoding); its ``num_tokens`` is then 1 + the drafts proposed (at most ``num_spec_tokens``;
    see :attr:`num_drafts`), the newest token and the drafts in one pass. That newest token is
    a kept token (``kind`` ``decode``) or, when a chunk left only the prompt's last token, that
    token (``kind`` ``prefill``): no recompute, the drafts follow it. ``total_len`` counts the
    drafts (:attr:`seq_len` does not). 0 for a plain decode or prefill, and in traces recorded
    before this field existed.

    ``max_drafts``: k, the drafts the sequence could have had this step (it had one uncomputed
    token and the engine speculates; 0 otherwise); ``draft_limits``: why it had fewer, the engine's
    reasons in the order they applied (``engine.scheduler.DRAFT_LIMITS``): ``budget``,
    ``max_tokens``, ``max_model_len`` (fewer slots), ``kv_blocks`` (only the slots free blocks
    hold), then ``proposer`` (it proposed fewer than the slots), ``min_tokens`` (drafts cut before
    a banned token), ``failed_step`` (retried alone without drafts). Empty when it had all k, and
    in traces recorded before these fields existed.

    ``num_cached_blocks_in_use``: of the ``num_cached_tokens // block_size`` prefix-cache hit
    blocks, how many another running sequence was holding when this one shared them (the rest
    were cached-free: freed, contents kept); None when the sequence was not admitted in this
    step, and in traces recorded before this field existed.

    ``num_cached_blocks_own``: at a readmission after a preemption, how many of the cached-free hit
    blocks are the sequence's own blocks from before its preemption (the rest of the cached-free
    hits another request left there with the same tokens); None when not a readmission, and in
    traces recorded before this field existed.

    ``budget_left``: tokens of the step's token budget still unplanned when the scheduler came to this
    sequence (before its own tokens and draft slots); ``plan_order``: its place in the scheduler's
    planning order (0 first; ``scheduled`` lists decodes first). A speculating sequence planned
    earlier took ``1 + num_spec_tokens`` of the budget before the proposer ran, even where it then
    ran fewer tokens (:attr:`num_tokens`). None in traces recorded before these fields existed.
    """

    request_id: str
    seq_id: int
    index: int
    kind: str
    num_tokens: int
    start: int
    prompt_len: int
    total_len: int
    num_cached_tokens: int
    samples: bool
    priority: int
    num_spec_tokens: int = 0
    max_drafts: int = 0
    draft_limits: tuple[str, ...] = ()
    num_cached_blocks_in_use: int | None = None
    num_cached_blocks_own: int | None = None
    budget_left: int | None = None
    plan_order: int | None = None

    @property
    def num_drafts(self) -> int:
        """Draft tokens among ``num_tokens`` (0 or more): ``num_tokens - 1`` when the sequence speculates.

        Only a sequence with one uncomputed token (its newest: a decode, or a prompt's last
        token when a chunk left just that one) speculates, so all but one of its tokens are
        drafts, verified in the same pass. ``num_spec_tokens`` counts the draft slots reserved,
        which a shorter draft does not fill.
        """
        return self.num_tokens - 1 if self.num_spec_tokens else 0

    @property
    def num_own_tokens(self) -> int:
        """Tokens of the sequence itself that this step computes (prompt, recomputed or newest), drafts left out."""
        return self.num_tokens - self.num_drafts

    @property
    def seq_len(self) -> int:
        """The sequence's length without this step's drafts (``total_len`` counts them: they are appended before the step)."""
        return self.total_len - self.num_drafts


@dataclass(frozen=True)
class QueueEntry:
    """One sequence in the waiting or running queue at plan time."""

    request_id: str
    seq_id: int
    index: int
    priority: int
    status: str
    num_tokens: int
    num_computed_tokens: int
    num_preemptions: int


@dataclass(frozen=True)
class Shortfall:
    """Why one preemption happened: a sequence needed more KV blocks than were free.

    ``request_id`` / ``seq_id`` / ``index``: the sequence that needed ``blocks_needed`` more
    blocks for this step while only ``blocks_free`` were free (empty plus cached-free, just
    before this victim gave its blocks back); ``waiting``: that sequence was a waiting request
    (priority policy) rather than a running one. It can be the preempted sequence itself.
    """

    request_id: str
    seq_id: int
    index: int
    blocks_needed: int
    blocks_free: int
    waiting: bool = False


@dataclass(frozen=True)
class StepPlanned(Event):
    """The scheduler's plan for one step.

    ``token_budget`` and ``num_batched_tokens`` in tokens; ``scheduled`` in batch order;
    ``preempted`` / ``admitted``: request ids (with seq ids) that lost or got blocks this step;
    ``waiting`` / ``running``: the queues after planning, in order; ``shortfalls``: why each
    preemption happened, one per ``preempted`` entry in the same order (empty in traces
    recorded before this field existed). ``wait_reason``: why the first of ``waiting`` was not
    admitted (``engine.scheduler.WAIT_REASONS``: ``preempted``, ``max_num_seqs``, ``budget``,
    ``chunked_prefill_off``, ``kv_blocks``, ``kv_run``); "" when none waits, and in traces recorded
    before this field existed. ``wait_blocks``: for ``kv_run`` (the contiguous baseline), the KV blocks
    free in all, the adjacent blocks the head's reservation needs, and the longest run of adjacent
    free blocks; ``()`` otherwise.
    """

    step: int
    token_budget: int
    num_batched_tokens: int
    scheduled: tuple[ScheduledEntry, ...]
    preempted: tuple[QueueEntry, ...]
    admitted: tuple[str, ...]
    waiting: tuple[QueueEntry, ...]
    running: tuple[QueueEntry, ...]
    max_num_seqs: int
    shortfalls: tuple[Shortfall, ...] = ()
    wait_reason: str = ""
    wait_blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class TopToken:
    """A candidate next token: id, its text, its probability under the model (0..1).

    ``text``: the token decoded alone; a token holding only part of a character's bytes as those
    bytes, ``<0xE3>`` (decoded alone every such token is "�"; traces recorded before hold "�")."""

    token_id: int
    text: str
    prob: float


@dataclass(frozen=True)
class TokenSampled(Event):
    """A sequence got a new token.

    ``text``: the output text that became final with this token. It is empty while the token
    ends mid-character, and characters that may begin a stop string are held back until the
    next token shows they do not; the ``text`` of one sequence's events concatenates to its
    final ``output_text`` (stop strings cut, multi-byte characters whole).
    ``token_text``: what this token itself spelled, from the incremental detokenizer ("" while it
    ends mid-character); never held back or cut, so it suits showing the token chosen.

    ``top``: the most likely candidates (only when a subscriber asked for ``topk``) of the
    distribution the sampler chose from: after the logits processors (repetition, presence and
    frequency penalties, the ``min_tokens`` ban on EOS and stop ids) and, when the request
    samples, after temperature, min-p, top-k and top-p (candidates they removed are left
    out); under greedy decoding the chosen token is the first of ``top``. For a token kept by
    a verification it is the target's distribution at that position.
    ``model_top``: the model's own candidates before any processor, filled only when a
    processor changed this row (so a view can show both, labelled);
    ``logprob``: log p of the chosen token under the model (None unless computed);
    ``speculative``: the token was kept by a speculative verification, in a forward pass
    that ran the drafted tokens too (see :class:`SpecDecodeStep`).
    ``special``: the token's name when it is one of the tokenizer's special tokens (such as
    ``<|im_end|>``, which ends a chat turn), else ""; a special token is not text, so
    ``token_text`` is empty for it unless the request keeps special tokens.
    ``ttft_s`` / ``tpot_s``: the sequence's TTFT and TPOT so far, seconds on the engine's clock
    (``RequestMetrics``: time held paused left out; TPOT None before the second token), the very
    figures :class:`RequestFinished` reports at the end, so a view showing them live never changes
    its TTFT at the finish (issue 29, trial 7: 414 ms running, 416 ms once aborted). None in traces
    recorded before they were added.
    """

    step: int
    request_id: str
    seq_id: int
    index: int
    token_id: int
    text: str
    position: int
    num_output_tokens: int
    top: tuple[TopToken, ...] = ()
    logprob: float | None = None
    temperature: float = 1.0
    greedy: bool = True
    token_text: str = ""
    model_top: tuple[TopToken, ...] = ()
    speculative: bool = False
    special: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(frozen=True)
class SeqBlocks:
    """A sequence's block table: physical block ids in logical order, and its token count."""

    request_id: str
    seq_id: int
    index: int
    block_table: tuple[int, ...]
    num_tokens: int
    num_computed_tokens: int


@dataclass(frozen=True)
class BlocksChanged(Event):
    """The KV pool after a step, or after an abort or failure released blocks between steps
    (``step``: the last step that ended then), or when asked for (a tab shown, a server's ``snapshot``).

    ``states``: one character per physical block, ``u`` used, ``c`` cached-free, ``f`` free;
    ``ref_counts``: per block; ``tables``: every live sequence's block table.
    ``block_size`` in tokens, ``bytes_per_block`` across all layers and K+V.
    """

    step: int
    block_size: int
    bytes_per_block: int
    states: str
    ref_counts: tuple[int, ...]
    tables: tuple[SeqBlocks, ...]
    prefix_cache_hit_rate: float = 0.0

    def owners(self) -> dict[int, list[str]]:
        """block id -> request ids whose tables hold it."""
        result: dict[int, list[str]] = {}
        for t in self.tables:
            for b in t.block_table:
                result.setdefault(b, []).append(t.request_id)
        return result

    @property
    def num_blocks(self) -> int:
        return len(self.states)


@dataclass(frozen=True)
class StepTimed(Event):
    """How long a step took and what it processed.

    ``wall_time_s`` seconds; token counts (``num_prefill_tokens``: prompt tokens computed,
    recomputes included; ``num_decode_tokens``: the rest, decodes and every draft verified,
    also the drafts after a prompt's last token); throughputs in tokens/s over this step (in a
    step with both kinds of rows, each kind's tokens over the whole step's time, which is no rate of
    that kind: the teaching views tell such a step's rate for all its tokens instead);
    KV bytes used and total of the pool (every tensor-parallel rank's slice together).
    ``yielded_s``: seconds the step waited while a front end drew a key's frame
    (``yield_gate.py``; 0 without one); not in ``wall_time_s`` nor the rates, but in the
    TTFT and TPOT of the requests it delayed.
    ``traced``: the X-Ray captured this step (``LayerTrace``); its capture ran inside the step
    and counts in ``wall_time_s`` and the rates, so a rate derived from them is not the
    engine's own (False in recordings made before this field existed).

    Tensor parallelism (``tp_size`` > 1; otherwise the ``tp_`` fields keep their defaults):
    per rank (index = rank, rank 0 the engine's process), ``tp_forward_s`` seconds of the
    forward pass on that rank (``ModelRunner.execute``: model and LM head; scheduling and
    sampling are rank 0's alone and count in ``wall_time_s`` only), of which ``tp_comm_s``
    inside collectives (``time.perf_counter`` around each all-reduce and the logits gather, a
    wait for the slowest rank included) and ``tp_compute_s`` the rest. ``tp_all_reduces``
    and ``tp_all_reduce_bytes``: the all-reduces of the step and the bytes of the tensors they
    summed, per rank (each rank's whole ``[num_tokens, hidden]`` tensor); ``tp_gather_bytes``:
    the logits slice each rank sent to rank 0.
    """

    step: int
    wall_time_s: float
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    kv_bytes_used: int
    kv_bytes_total: int
    num_running: int
    num_waiting: int
    num_blocks_used: int = 0
    num_blocks_cached: int = 0
    num_blocks_total: int = 0
    tp_size: int = 1
    tp_forward_s: tuple[float, ...] = ()
    tp_compute_s: tuple[float, ...] = ()
    tp_comm_s: tuple[float, ...] = ()
    tp_all_reduces: int = 0
    tp_all_reduce_bytes: int = 0
    tp_gather_bytes: int = 0
    yielded_s: float = 0.0
    traced: bool = False


# ---------------------------------------------------------------------------- x-ray


@dataclass(frozen=True)
class TensorInfo:
    """A named tensor seen during the forward pass: its shape and a few real values.

    ``scope``: ``"batch"`` when ``shape`` is the step's flat batch (``[num_tokens, ...]`` over
    every scheduled sequence), ``"request"`` when it is the traced request's own slice (its
    context's keys, its attention scores); ``""`` in traces recorded before this field.
    ``sample``: the first values of the traced request's last token (head 0 where there are heads).
    """

    name: str
    shape: tuple[int, ...]
    sample: tuple[float, ...]
    scope: str = ""


@dataclass(frozen=True)
class OpInfo:
    """One operation of a layer: its math, operand shapes, cost in FLOPs and bytes moved.

    ``kernel``: for a projection, the format of the weights it multiplies, which names the kernel
    that ran it (``"q4_1"``, ``"q8_0"``: a block kernel; ``"float32"``: the float matmul); ``""`` for
    every other operation and in traces recorded before this field existed."""

    name: str
    math: str
    shapes: str
    flops: int
    bytes: int
    kernel: str = ""


@dataclass(frozen=True)
class LayerTrace(Event):
    """X-Ray: what one decoder layer did for one request in one step.

    ``tensors``: named intermediate tensors, with the shapes the engine used (see
    ``TensorInfo.scope``); ``ops``: the layer's operations over the whole step's batch, FLOPs
    and bytes as the attention backend ran them; ``attention``: softmax weights
    ``[queries][key columns]`` of ``head`` when this is the chosen layer (else empty), each
    column summing ``keys_per_column`` keys from ``key_start`` on. Model facts for the GQA and
    KV arithmetic ride along.

    Fields added later (defaults for older traces): ``part``: the traced request's part of
    the step (``prefill``, ``decode``, or ``verify``: a speculative verification of 1 + k
    tokens); its ``num_new_tokens`` and ``context_len`` (tokens); ``first_row`` of its slice in
    the flat batch of ``num_batch_tokens`` rows over ``num_batch_seqs`` sequences;
    ``attention_backend``: what computed attention; the machine's measured roofline
    (``peak_flops`` FLOP/s of the float matmul, ``memory_bandwidth`` bytes/s, ``machine``; 0 when
    not measured; ``kernel_peaks``: ``(format, FLOP/s)`` of each block kernel the projections ran,
    measured on this model's weights, empty for float weights and in traces recorded before it
    was measured) and ``compute_bound_tokens``: the shortest one-sequence prefill whose layer
    reaches the ridge point on that machine, each operation against its kernel's peak (0: unknown
    or never); ``prompt_len``, ``total_len`` (prompt and
    generated tokens when the step was planned) and ``num_cached_tokens`` (found in the prefix
    cache) of the traced sequence, so a prefill chunk can say what it is a chunk of (0: not recorded).
    """

    step: int
    request_id: str
    layer: int
    num_layers: int
    tensors: tuple[TensorInfo, ...]
    ops: tuple[OpInfo, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    kv_bytes_per_token: int
    head: int | None = None
    attention: tuple[tuple[float, ...], ...] = ()
    query_pieces: tuple[str, ...] = ()
    key_pieces: tuple[str, ...] = ()
    part: str = ""  # not ``kind``: that is every event's type name (``Event.kind``)
    num_new_tokens: int = 0
    context_len: int = 0
    first_row: int = 0
    num_batch_tokens: int = 0
    num_batch_seqs: int = 0
    attention_backend: str = ""
    peak_flops: float = 0.0
    memory_bandwidth: float = 0.0
    machine: str = ""
    compute_bound_tokens: int = 0
    key_start: int = 0
    keys_per_column: int = 1
    prompt_len: int = 0
    total_len: int = 0
    num_cached_tokens: int = 0
    kernel_peaks: tuple[tuple[str, float], ...] = ()


# ---------------------------------------------------------------------- speculative


@dataclass(frozen=True)
class SpecDecodeStep(Event):
    """One speculative verification for one sequence.

    ``draft_tokens``: proposed ids; ``p``/``q``: target / draft probability of each;
    ``accepted``: per draft token; ``bonus_token``: the token the target added (the
    correction at the first rejection, or the extra one when all were accepted).
    ``greedy``: the rule that decided: True = each draft is kept when it equals the target's
    argmax (greedy requests); False = rejection sampling, kept with probability min(1, p/q)
    (Leviathan et al. 2023, section 2.3). ``num_query_tokens``: tokens of this sequence that
    the target ran in the verifying forward pass (the last kept token plus the drafts,
    1 + k; 0 in traces recorded before this field existed).
    """

    step: int
    request_id: str
    seq_id: int
    proposer: str
    draft_tokens: tuple[int, ...]
    draft_texts: tuple[str, ...]
    p: tuple[float, ...]
    q: tuple[float, ...]
    accepted: tuple[bool, ...]
    bonus_token: int | None
    bonus_text: str = ""
    greedy: bool = False
    num_query_tokens: int = 0


# ------------------------------------------------------------------------ lifecycle


@dataclass(frozen=True)
class ModelLoading(Event):
    """Loading progress: ``stage`` name, ``done`` of ``total`` units; ``ready`` on the last event.

    The ready event carries the model's facts in ``model_info`` (see ``LLMEngine.model_info``).
    """

    stage: str
    done: int
    total: int
    message: str = ""
    ready: bool = False
    model_name: str = ""
    device: str = ""
    dtype: str = ""
    model_info: tuple[tuple[str, Any], ...] = ()

    def info(self) -> dict[str, Any]:
        return dict(self.model_info)


@dataclass(frozen=True)
class EnginePaused(Event):
    step: int


@dataclass(frozen=True)
class EngineResumed(Event):
    step: int


# The two ways an engine fails to start, as the first words of its EngineError (step None): the model could
# not be found or loaded, or a setting does not fit the model or the machine (the model is fine; the message
# names the option to change). ``engine.controller.load_failure`` picks one; apps advise differently for each.
MODEL_FAILED = "model failed to load"
SETTING_REFUSED = "engine setting refused"


def is_load_failure(message: str) -> bool:
    """True for the EngineError message of an engine that never started, of either kind."""
    return message.startswith((MODEL_FAILED + ": ", SETTING_REFUSED + ": "))


@dataclass(frozen=True)
class EngineError(Event):
    """A step (or a command) failed; ``request_id`` names the request that was finished because of it,
    or, for a refused command (``abort`` or ``xray`` of an unknown id, a refused ``submit``), the id it named."""

    step: int | None
    message: str
    request_id: str | None = None
    traceback: str = ""


# ----------------------------------------------------------------------------- JSON

_PARTS = (SampleResult, ScheduledEntry, QueueEntry, Shortfall, TopToken, SeqBlocks, TensorInfo, OpInfo)
EVENT_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (RequestAdded, RequestRejected, RequestFinished, StepPlanned, TokenSampled, BlocksChanged,
                StepTimed, LayerTrace, SpecDecodeStep, ModelLoading, EnginePaused, EngineResumed, EngineError,
                *_PARTS)
}


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {"type": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = _encode(getattr(value, f.name))
        return out
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return None
    return value


def _decode(value: Any) -> Any:
    """A value of a field typed ``Any`` (``sampling``, ``model_info``): lists as tuples, objects that
    name an event type as that event; nothing else is checked."""
    if isinstance(value, dict) and "type" in value and value["type"] in EVENT_TYPES:
        return _build(EVENT_TYPES[value["type"]], value)
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value


class FieldTypeError(ValueError):
    """A trace line's field does not hold the type its event declares (``StepTimed.time`` a string).

    ``where``: the field's path, built on the way out of the nested objects
    (``StepPlanned.scheduled[0].start``); ``expected``: the declared type in words; ``value``: what
    the line holds."""

    def __init__(self, expected: str, value: Any) -> None:
        super().__init__(expected, value)
        self.expected, self.value, self.where = expected, value, ""

    def __str__(self) -> str:
        got = json.dumps(self.value, ensure_ascii=False)
        return f"{self.where.lstrip('.')} must be {self.expected}, got {got if len(got) <= 40 else got[:39] + '…'}"


class FieldsDoNotFit(FieldTypeError):
    """A trace line's object lacks a field its type always has, or has one it never has (an edited line, or
    one written by another program); ``str()`` names the object's path and the fields."""

    def __init__(self, text: str) -> None:
        super().__init__(text, None)

    def __str__(self) -> str:
        return f"{self.where.lstrip('.')} {self.expected}"


class OutOfRange(FieldTypeError):
    """A trace line's number of the declared type that its field never holds (``TopToken.prob`` -3, a negative
    count, an infinite or NaN time): ``expected`` is the field's rule (``>= 0``, ``a number from 0 to 1``)."""


def _type_words(tp: Any) -> str:
    """How an error names a declared type: ``int`` -> "a whole number", ``str | None`` -> "text or null"."""
    words = {int: "a whole number", float: "a number", str: "text", bool: "true or false", type(None): "null"}
    if tp in words:
        return words[tp]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_words(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return "a list"
    if dataclasses.is_dataclass(tp):
        return f"a {tp.__name__} object"
    return str(tp)


@dataclass(frozen=True)
class _Range:
    """The values a numeric field may hold beyond its type: ``lo <= value <= hi`` (a bound of a float field
    at ``sys.float_info.max`` keeps it finite); ``nan``: any float at all, NaN and infinities included
    (to_json writes NaN as null, read back as NaN); ``words``: the rule as an error says it."""

    lo: float
    hi: float
    words: str
    nan: bool = False


_FINITE = 1.7976931348623157e308  # sys.float_info.max: a bound that refuses the infinities
_COUNT = _Range(0, math.inf, ">= 0")  # counts, steps, positions, ids, sizes: what every int field holds by default
_POSITIVE = _Range(1, math.inf, ">= 1")
_ANY_INT = _Range(-math.inf, math.inf, "a whole number")
_SECONDS = _Range(0.0, _FINITE, "a finite number >= 0")  # times, durations, rates: every float field by default
_PROBABILITY = _Range(0.0, 1.0, "a number from 0 to 1")
_LOGPROB = _Range(-_FINITE, 0.0, "a finite number <= 0")
_ANY_FLOAT = _Range(-math.inf, math.inf, "a number", nan=True)

# The fields whose values differ from their type's default rule (an int field >= 0, a float field finite and
# >= 0), as the engine makes them: a priority is any whole number (vLLM's; lower runs first), a refused
# request's max_tokens is what it asked for (the refusal says why); a tensor's sample is what the forward pass
# computed, whatever it is (the only float the engine may hand on as NaN or infinite).
_FIELD_RULES: dict[tuple[str, str], _Range] = {
    **{(cls, "priority"): _ANY_INT for cls in ("RequestAdded", "RequestRejected", "ScheduledEntry", "QueueEntry")},
    ("RequestRejected", "max_tokens"): _ANY_INT,
    ("RequestAdded", "n"): _POSITIVE,
    ("BlocksChanged", "block_size"): _POSITIVE,
    ("StepTimed", "tp_size"): _POSITIVE,
    ("LayerTrace", "keys_per_column"): _POSITIVE,
    ("TopToken", "prob"): _PROBABILITY,
    ("SpecDecodeStep", "p"): _PROBABILITY,
    ("SpecDecodeStep", "q"): _PROBABILITY,
    ("BlocksChanged", "prefix_cache_hit_rate"): _PROBABILITY,
    ("LayerTrace", "attention"): _PROBABILITY,  # softmax weights
    ("TokenSampled", "logprob"): _LOGPROB,
    ("TensorInfo", "sample"): _ANY_FLOAT,
}


def _numbers_in(tp: Any) -> set[type]:
    """The number types (int, float) a declared type holds, in unions and tuples too."""
    if tp in (int, float):
        return {tp}
    return {n for a in typing.get_args(tp) if a is not Ellipsis for n in _numbers_in(a)}


def _rule_for(cls: type, name: str, tp: Any) -> _Range | None:
    """The value rule of field ``name`` of ``cls`` (declared ``tp``): :data:`_FIELD_RULES`, else by type."""
    rule = _FIELD_RULES.get((cls.__name__, name))
    if rule is not None:
        return rule
    numbers = _numbers_in(tp)
    return _SECONDS if float in numbers else _COUNT if int in numbers else None


_CHECKS: dict[Any, Callable[[Any], Any]] = {}
_FIELD_CHECKS: dict[type, dict[str, Callable[[Any], Any]]] = {}


def _checked_items(pairs) -> tuple:
    """``(check, value)`` pairs -> the checked values as a tuple; a failure names its index (``[2].field``)."""
    out = []
    for i, (check, v) in enumerate(pairs):
        try:
            out.append(check(v))
        except FieldTypeError as e:
            e.where = f"[{i}]{e.where}"
            raise
    return tuple(out)


def _check_for(tp: Any, rule: _Range | None = None) -> Callable[[Any], Any]:
    """The function that takes a value as JSON gave it as a field declared ``tp`` (made once per
    type and rule, from the dataclasses' annotations): lists become tuples, objects the event parts
    they name; a value of another type, or a number outside ``rule`` (every number in the field:
    :func:`_rule_for`), raises :class:`FieldTypeError`. ``null`` in a float field is the NaN
    :func:`to_json` wrote, taken only where the rule allows NaN."""
    check = _CHECKS.get((tp, rule))
    if check is None:
        check = _CHECKS[(tp, rule)] = _make_check(tp, rule)
    return check


def _make_check(tp: Any, rule: _Range | None) -> Callable[[Any], Any]:
    words = _type_words(tp)
    origin = typing.get_origin(tp)
    lo, hi = (rule.lo, rule.hi) if rule is not None else (-math.inf, math.inf)
    if tp is Any:
        return _decode
    if tp is float:
        nan_ok = rule is None or rule.nan
        bounded = not nan_ok  # a rule that allows NaN allows every float

        def check(value: Any) -> Any:
            kind = type(value)
            if kind is float or kind is int:
                if not bounded or lo <= value <= hi:  # NaN fails both comparisons
                    return value
                raise OutOfRange(rule.words, value)
            if value is None:
                if nan_ok:
                    return math.nan
                raise OutOfRange(rule.words, value)
            raise FieldTypeError(words, value)
    elif tp is int:
        def check(value: Any) -> Any:
            if type(value) is int:  # a bool is not a count
                if lo <= value <= hi:
                    return value
                raise OutOfRange(rule.words, value)
            raise FieldTypeError(words, value)
    elif tp in (str, bool, type(None)):
        exact = type(None) if tp is type(None) else tp

        def check(value: Any) -> Any:
            if type(value) is exact:  # nor an int a flag
                return value
            raise FieldTypeError(words, value)
    elif origin in (typing.Union, types.UnionType):
        nullable = type(None) in typing.get_args(tp)
        options = [_check_for(a, rule) for a in typing.get_args(tp) if a is not type(None)]

        def check(value: Any) -> Any:
            if value is None and nullable:
                return None
            for option in options:
                try:
                    return option(value)
                except OutOfRange:
                    raise  # the right type, out of range: say the range, not the types
                except FieldTypeError:
                    pass
            raise FieldTypeError(words, value)
    elif origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        item = typing.get_args(tp)[0]
        each = _check_for(item, rule)
        plain = item if item in (int, str, bool) else None  # one pass over a list of them (a layer's attention)
        unbounded = rule is None or rule.nan or (lo == -math.inf and hi == math.inf)

        def check(value: Any) -> Any:
            if type(value) is not list:
                raise FieldTypeError(words, value)
            if plain is not None and all(type(v) is plain for v in value):
                if plain is not int or unbounded or not value or (lo <= min(value) and max(value) <= hi):
                    return tuple(value)
            elif item is float and all(type(v) is float or type(v) is int for v in value):
                # min and max may step over a NaN; a sum holding one is NaN (an overflowing one is checked below)
                if unbounded or not value or (lo <= min(value) and max(value) <= hi and (s := sum(value)) == s):
                    return tuple(value)
            return _checked_items(zip([each] * len(value), value))
    elif origin is tuple:
        items = [_check_for(a, rule) for a in typing.get_args(tp)]

        def check(value: Any) -> Any:
            if type(value) is not list or len(value) != len(items):
                raise FieldTypeError(f"{words} of {len(items)}", value)
            return _checked_items(zip(items, value))
    elif dataclasses.is_dataclass(tp):
        name = tp.__name__

        def check(value: Any) -> Any:
            if type(value) is dict and value.get("type") == name:
                return _build(tp, value)
            raise FieldTypeError(words, value)
    else:  # a type the codec does not know: as before, unchecked
        return _decode
    return check


def _build(cls: type, data: dict) -> Any:
    """The event (or event part) ``cls`` from its JSON object, every field checked against its declared type.

    Raises:
        FieldTypeError: a field of another type (its ``where`` starts at this object: ``.scheduled[0].start``).
        FieldsDoNotFit: a field ``cls`` does not have, or one it needs missing (a :class:`FieldTypeError` too).
    """
    checks = _FIELD_CHECKS.get(cls)
    if checks is None:
        checks = _FIELD_CHECKS[cls] = {name: _check_for(tp, _rule_for(cls, name, tp))
                                       for name, tp in typing.get_type_hints(cls).items()}
    kwargs = {}
    for name, value in data.items():
        if name == "type":
            continue
        if cls is LayerTrace and name == "kind":  # traces written while this field was called ``kind``
            name = "part"
        check = checks.get(name)
        if check is None:  # a field it does not have: named below
            kwargs[name] = value
            continue
        try:
            kwargs[name] = check(value)
        except FieldTypeError as e:
            e.where = f".{name}{e.where}"
            raise
    required = _REQUIRED.get(cls)
    if required is None:
        required = _REQUIRED[cls] = {f.name for f in dataclasses.fields(cls) if f.init
                                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if not (kwargs.keys() >= required and kwargs.keys() <= checks.keys()):
        unknown = [name for name in kwargs if name not in checks]
        missing = [f.name for f in dataclasses.fields(cls) if f.name in required and f.name not in kwargs]
        if unknown:
            raise FieldsDoNotFit(f"has no field {_names(unknown)} (it has {_names(list(checks))})")
        if missing:
            raise FieldsDoNotFit(f"lacks {_names(missing)}, which every {cls.__name__} has")
    return cls(**kwargs)


_REQUIRED: dict[type, set[str]] = {}


def _names(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c`` (quoted as JSON keys), for an error."""
    quoted = [json.dumps(n, ensure_ascii=False)[:42] for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def asked_for(event: Event, *, blocks: bool, xray: bool) -> bool:
    """Does a listener that asked for ``blocks`` / ``xray`` detail get ``event``?

    ``BlocksChanged`` only with ``blocks``, ``LayerTrace`` only with ``xray``, every other
    event always (the rule ``LLMEngine.subscribe`` applies, for listeners outside the engine:
    the server's event stream and the app's remote controller).
    """
    if isinstance(event, BlocksChanged):
        return blocks
    if isinstance(event, LayerTrace):
        return xray
    return True


def with_topk(event: Event, topk: int) -> Event:
    """``event`` as a listener that asked for ``topk`` top choices gets it: a ``TokenSampled`` with
    ``top`` and ``model_top`` cut to their first ``topk`` (none for 0), any other event unchanged (the
    very object, as is a token whose lists are short enough).

    The engine computes the most any listener asked for; each listener is sent only its own number
    (trial 20d: a ``topk=0`` watcher of the server's stream got the 5 an attached app asked for).
    """
    if not isinstance(event, TokenSampled) or (len(event.top) <= topk and len(event.model_top) <= topk):
        return event
    return dataclasses.replace(event, top=event.top[:topk], model_top=event.model_top[:topk])


def to_json(event: Event) -> str:
    """One JSON line (no newline) with a ``type`` field naming the event class."""
    return json.dumps(_encode(event), ensure_ascii=False, separators=(",", ":"))


class IncompleteJSON(ValueError):
    """A line that begins as a JSON object and is not a whole one: cut short (a trace copied while it
    was written, a ``head -c``) or corrupted."""


def from_json(line: str) -> Event:
    """Rebuild an event from :func:`to_json`'s output, each field checked against the type its
    dataclass declares (a trace is a file anyone can edit, and the server's stream comes over a network).

    Raises:
        ValueError: not JSON, not a whole JSON object (:class:`IncompleteJSON`), no known ``type``, or
            a field of another type or range (:class:`FieldTypeError`, naming the field), or a field the
            event does not have, or one it needs missing (:class:`FieldsDoNotFit`).
    """
    try:
        data = untrusted.loads(line)
    except untrusted.JSONTooDeep as e:  # json.loads' RecursionError, which no ValueError handler would catch
        raise ValueError(f"nested too deeply to be an engine event: {e}") from None
    except json.JSONDecodeError as e:
        text = line.strip()
        if text.startswith("{"):  # json's own words ("Invalid control character at: ...") guess at the cause
            ended = e.pos >= len(text) or e.msg.startswith("Unterminated")  # the text ends inside the object
            where = (f"it stops after {len(text)} characters" if ended
                     else f"it goes wrong at character {e.pos + 1} of {len(text)}")
            raise IncompleteJSON(f"not complete JSON, cut short or corrupted ({where})") from None
        raise ValueError(f"not JSON ({e.msg} at character {e.pos + 1}); a trace holds one engine event, "
                         "a JSON object, a line") from None
    if not isinstance(data, dict) or data.get("type") not in EVENT_TYPES:
        raise ValueError(f"not an engine event: {line[:80]!r}")
    cls = EVENT_TYPES[data["type"]]
    try:
        return _build(cls, data)
    except FieldTypeError as e:
        e.where = cls.__name__ + e.where
        raise
