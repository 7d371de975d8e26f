"""The narrator: plain-English commentary written from the engine's events, with their real numbers.

Feed it every event of a run (``engine.subscribe(narrator_callback, topk=5, blocks=True)``)
and it returns :class:`Commentary` entries: how the prompt was tokenized (each piece and its
id), what the embedding produced (sizes, and real values when X-Ray capture is on), how many
tokens the prefill processed and how long the step took, each decode step's top choices and
the token taken, what the sampling settings did, how many bytes the KV cache holds, and the
scheduler's decisions (who waits and why, chunked prefill, preemption and its victim, prefix
cache hits). The CLI's ``--narrate`` and the app's Narrator tab both render these entries.

Order: events of one engine step arrive as ``StepPlanned``, (``LayerTrace``...),
``TokenSampled``..., ``RequestFinished``..., ``BlocksChanged``, ``StepTimed``. Scheduler
decisions are told at ``StepPlanned``; the rest of the step is told at ``StepTimed``, when
its wall time is known, in reading order (embedding, prefill, tokens, finished, KV cache).

Readability with many requests: steady decode-only steps produce no scheduler entry, and
``max_decode_steps_per_request`` caps the per-token entries of each request (the rest are
summed up when it finishes).

Sources: the scheduler rules are vLLM's V1 scheduler (see ``engine/scheduler.py``); the
terms (prefill, decode, token budget, preemption, prefix cache hit, TTFT, TPOT) are vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanovllm_core import events as ev

KINDS = ("model", "tokenization", "embedding", "attention", "prefill", "decode", "sampling", "kv_cache",
         "scheduler", "chunked_prefill", "preemption", "prefix_cache", "finished", "rejected", "speculative",
         "error")
MAX_PIECES_SHOWN = 48  # a longer prompt's pieces and ids are shown up to this many, then counted
MAX_TABLES_SHOWN = 4   # block tables listed in one KV cache entry


@dataclass(frozen=True)
class Commentary:
    """One narrator entry.

    ``kind``: one of :data:`KINDS` (the subject); ``title``: a short headline; ``text``: the
    explanation with this event's real numbers; ``table``: (label, probability 0..1) rows, e.g.
    a decode step's top-k candidates.
    """

    kind: str
    title: str
    text: str
    request_id: str | None = None
    step: int | None = None
    table: tuple[tuple[str, float], ...] = ()


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds with one decimal; ``"n/a"`` for None."""
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def show_piece(text: str) -> str:
    """A token's text made visible inside brackets: a space as ``␣`` (so a piece never breaks at a line
    wrap and a leading space shows), newlines and tabs escaped."""
    return "[" + text.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t") + "]"


def plural(n: int, word: str) -> str:
    """``plural(1, "token")`` -> ``"1 token"``; ``plural(3, "token")`` -> ``"3 tokens"``."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


@dataclass
class _RequestState:
    prompt: str | None
    num_prompt_tokens: int
    priority: int
    max_tokens: int | None
    sampling: dict[str, Any]
    decode_told: int = 0
    decode_untold: int = 0
    embedding_told: bool = False


@dataclass
class _OpenStep:
    plan: ev.StepPlanned
    events: list[ev.Event] = field(default_factory=list)


class Narrator:
    """Turns engine events into :class:`Commentary`.

    Args:
        model_info: ``LLMEngine.model_info()`` (also taken from a ready ``ModelLoading`` event);
            when given, the first call of :meth:`feed` starts with a ``model`` entry.
        max_decode_steps_per_request: at most this many ``decode`` entries per request (None:
            all); later tokens are counted and summed up in its ``finished`` entry.

    Not thread-safe: feed it from one thread (or behind a queue).
    """

    def __init__(self, model_info: dict | None = None, max_decode_steps_per_request: int | None = None) -> None:
        if max_decode_steps_per_request is not None and max_decode_steps_per_request < 0:
            raise ValueError("max_decode_steps_per_request must be >= 0 or None (no cap)")
        self.info: dict[str, Any] = dict(model_info or {})
        self.max_decode = max_decode_steps_per_request
        self._introduced = False
        self._requests: dict[str, _RequestState] = {}
        self._open: _OpenStep | None = None
        self._last_signature: tuple | None = None
        self._last_blocks_used: int | None = None

    # ------------------------------------------------------------------ public

    def feed(self, event: ev.Event) -> list[Commentary]:
        """The commentary this event completes (often none until its step's ``StepTimed``)."""
        out: list[Commentary] = []
        if isinstance(event, ev.ModelLoading):
            if event.ready and event.model_info:
                self.info.update(event.info())
                self._introduced = False
        if self.info and not self._introduced:
            out.extend(self.introduction())
        if isinstance(event, ev.StepPlanned):
            out.extend(self.flush())
            out.extend(self._planned(event))
            if event.scheduled:
                self._open = _OpenStep(event)
        elif isinstance(event, ev.StepTimed):
            out.extend(self._step_done(event))
        elif isinstance(event, ev.RequestAdded):
            out.extend(self._added(event))
        elif isinstance(event, ev.RequestRejected):
            out.append(Commentary("rejected", f"Request {event.request_id} rejected", event.reason,
                                  request_id=event.request_id))
        elif isinstance(event, (ev.TokenSampled, ev.LayerTrace, ev.RequestFinished, ev.BlocksChanged,
                                ev.SpecDecodeStep, ev.EngineError)):
            if self._open is not None and getattr(event, "step", None) in (self._open.plan.step, None):
                self._open.events.append(event)
            else:
                out.extend(self._tell_step_events(None, [event], None))
        return out

    def introduction(self) -> list[Commentary]:
        """The ``model`` entry: the model's size and shape, from ``model_info`` (empty if unknown)."""
        self._introduced = True
        i = self.info
        if not i.get("num_layers"):
            return []
        group = i["num_heads"] // max(1, i["num_kv_heads"])
        text = (f"{i.get('model_name', 'The model')} on {i.get('device', '?')} in {i.get('dtype', '?')}: "
                f"{i.get('num_parameters', 0) / 1e6:.0f} M parameters in {i['num_layers']} decoder layers, "
                f"hidden size {i['hidden_size']}, {i['num_heads']} query heads sharing {i['num_kv_heads']} KV heads "
                f"({group} to 1, grouped-query attention) of {i['head_dim']} dimensions, a vocabulary of "
                f"{i['vocab_size']:,} tokens. Each token kept in the KV cache costs "
                f"{i['kv_bytes_per_token']:,} bytes; the pool has {i.get('num_kv_blocks', 0):,} blocks of "
                f"{i.get('block_size', 0)} tokens.")
        return [Commentary("model", "The model", text)]

    def flush(self) -> list[Commentary]:
        """Tell what an unfinished step buffered (a step cut short has no ``StepTimed``)."""
        if self._open is None:
            return []
        step, self._open = self._open, None
        return self._tell_step_events(step.plan, step.events, None)

    # ------------------------------------------------------------------ requests

    def _added(self, e: ev.RequestAdded) -> list[Commentary]:
        sampling = dict(e.sampling)
        self._requests[e.request_id] = _RequestState(e.prompt, len(e.prompt_token_ids), e.priority, e.max_tokens,
                                                     sampling)
        n = len(e.prompt_token_ids)
        shown = min(n, MAX_PIECES_SHOWN)
        pairs = " ".join(f"{show_piece(p)}={t}" for p, t in zip(e.prompt_pieces[:shown], e.prompt_token_ids[:shown]))
        more = f" ... and {n - shown} more" if n > shown else ""
        ids = ", ".join(str(t) for t in e.prompt_token_ids[:shown])
        source = f"The prompt {e.prompt!r}" if e.prompt is not None else "The prompt (given as token ids)"
        vocab = self.info.get("vocab_size")
        text = (f"{source} becomes {plural(n, 'token')}: {pairs}{more}.\n"
                f"Token ids: [{ids}{', ...' if n > shown else ''}]\n"
                "(␣ marks a space.) The model only ever sees these integers"
                + (f", each an index into its vocabulary of {vocab:,} pieces." if vocab else ".")
                + (" Special tokens such as the start marker count like any other." if n and self._looks_special(e)
                   else ""))
        out = [Commentary("tokenization", f"Request {e.request_id}: {plural(n, 'token')}", text, request_id=e.request_id)]
        out.append(self._sampling_intro(e.request_id, sampling, e.max_tokens))
        return out

    @staticmethod
    def _looks_special(e: ev.RequestAdded) -> bool:
        return any(p.startswith("<") and p.endswith(">") and len(p) > 2 for p in e.prompt_pieces)

    def _sampling_intro(self, rid: str, s: dict[str, Any], max_tokens: int | None) -> Commentary:
        temperature = float(s.get("temperature", 1.0))
        stop = f"up to {max_tokens} tokens" if max_tokens else "until the end-of-sequence token or max_model_len"
        if temperature < 1e-5:
            text = (f"Greedy decoding (temperature 0): at every step the single most likely token is taken, so the "
                    f"same prompt always gives the same text. It will generate {stop}.")
            return Commentary("sampling", f"Request {rid}: greedy", text, request_id=rid)
        if temperature == 1:
            parts = ["temperature 1 keeps the model's own distribution"]
        else:
            parts = [f"temperature {temperature:g} divides the logits by {temperature:g} before the softmax, making the "
                     f"distribution {'sharper' if temperature < 1 else 'flatter'} than the model's own"]
        if s.get("top_k", 0) > 0:
            parts.append(f"top-k {s['top_k']} keeps only the {s['top_k']} most likely tokens")
        if s.get("top_p", 1.0) < 1.0:
            parts.append(f"top-p {s['top_p']:g} keeps the smallest set of tokens whose probabilities add up to "
                         f"{s['top_p']:g}")
        if s.get("min_p", 0.0) > 0:
            parts.append(f"min-p {s['min_p']:g} drops tokens below {s['min_p']:g} x the best one's probability")
        if s.get("repetition_penalty", 1.0) != 1.0:
            parts.append(f"repetition penalty {s['repetition_penalty']:g} lowers tokens already seen")
        text = ("Random sampling: " + "; ".join(parts) + "; then one token is drawn from what remains"
                + (f", with seed {s['seed']} so the draw is repeatable" if s.get("seed") is not None else "")
                + f". It will generate {stop}.")
        return Commentary("sampling", f"Request {rid}: sampling at temperature {temperature:g}", text, request_id=rid)

    # ------------------------------------------------------------------ scheduler decisions

    def _planned(self, plan: ev.StepPlanned) -> list[Commentary]:
        out: list[Commentary] = []
        for q in plan.preempted:
            out.append(self._preemption(plan, q))
        for s in plan.scheduled:
            if s.num_cached_tokens > 0 and s.request_id in plan.admitted and s.index == 0:
                out.append(self._prefix_hit(plan, s))
        signature = (tuple((s.request_id, s.index, s.kind) for s in plan.scheduled),
                     tuple(q.request_id for q in plan.waiting))
        busy = len(plan.scheduled) > 1 or plan.waiting or plan.preempted
        if busy and (signature != self._last_signature or plan.admitted or plan.preempted):
            out.insert(0, self._schedule(plan))
        self._last_signature = signature
        return out

    def _schedule(self, plan: ev.StepPlanned) -> Commentary:
        parts = []
        for s in plan.scheduled:
            if s.kind == "decode":
                parts.append(f"request {s.request_id}: decode, 1 token")
            else:
                new = " (newly admitted)" if s.request_id in plan.admitted else ""
                parts.append(f"request {s.request_id}: prefill of {s.num_tokens} token{'s' if s.num_tokens != 1 else ''}"
                             f"{new}")
        text = (f"The scheduler spends {plan.num_batched_tokens} of its {plan.token_budget}-token budget on "
                f"{len(plan.scheduled)} sequence{'s' if len(plan.scheduled) != 1 else ''} in one forward pass: "
                + "; ".join(parts) + ".")
        if plan.waiting:
            head = plan.waiting[0]
            text += f" Waiting: request {head.request_id} ({self._waiting_reason(plan)})"
            if len(plan.waiting) > 1:
                rest = ", ".join(q.request_id for q in plan.waiting[1:6])
                text += f"; behind it, in {self.info.get('scheduling_policy', 'policy')} order: {rest}"
                if len(plan.waiting) > 6:
                    text += f" and {len(plan.waiting) - 6} more"
            text += "."
        return Commentary("scheduler", f"Step {plan.step}: {len(plan.scheduled)} running, {len(plan.waiting)} waiting",
                          text, step=plan.step)

    @staticmethod
    def _waiting_reason(plan: ev.StepPlanned) -> str:
        if plan.preempted:
            return "this step had to preempt, so no new request is admitted"
        if len(plan.running) >= plan.max_num_seqs:
            return f"max_num_seqs: {plan.max_num_seqs} requests are already running"
        if plan.num_batched_tokens >= plan.token_budget:
            return f"the step's token budget of {plan.token_budget} is used up"
        return "not enough free KV blocks for it now"

    def _preemption(self, plan: ev.StepPlanned, q: ev.QueueEntry) -> Commentary:
        policy = self.info.get("scheduling_policy", "priority")
        rule = ("the lowest-priority running request, the latest to arrive among equals" if policy == "priority"
                else "the latest-arrived running request")
        text = (f"The KV pool ran out of free blocks, so request {q.request_id} (priority {q.priority}) was preempted: "
                f"it was {rule}. It gave back all its blocks and went back to the waiting queue keeping its "
                f"{q.num_tokens} tokens; when readmitted it recomputes their keys and values (often from the prefix "
                f"cache). Preemptions of this request so far: {q.num_preemptions}.")
        return Commentary("preemption", f"Step {plan.step}: request {q.request_id} preempted", text,
                          request_id=q.request_id, step=plan.step)

    def _prefix_hit(self, plan: ev.StepPlanned, s: ev.ScheduledEntry) -> Commentary:
        bs = self.info.get("block_size")
        blocks = f" ({plural(s.num_cached_tokens // bs, 'full block')} shared by reference)" if bs else ""
        again = " on its readmission after preemption" if s.total_len > s.prompt_len else ""
        text = (f"Request {s.request_id} found its first {s.num_cached_tokens} of {s.total_len} tokens already in the "
                f"prefix cache{again}{blocks}. Their keys and values are reused, so this step computes only "
                f"{s.num_tokens} token{'s' if s.num_tokens != 1 else ''}.")
        return Commentary("prefix_cache", f"Request {s.request_id}: prefix cache hit, {s.num_cached_tokens} tokens",
                          text, request_id=s.request_id, step=plan.step)

    # ------------------------------------------------------------------ the rest of a step

    def _step_done(self, timed: ev.StepTimed) -> list[Commentary]:
        step, self._open = self._open, None
        if step is None or step.plan.step != timed.step:
            return self._tell_step_events(None, step.events if step else [], timed)
        return self._tell_step_events(step.plan, step.events, timed)

    def _tell_step_events(self, plan: ev.StepPlanned | None, events: list[ev.Event],
                          timed: ev.StepTimed | None) -> list[Commentary]:
        out: list[Commentary] = []
        first_layer = {e.request_id: e for e in events if isinstance(e, ev.LayerTrace) and e.layer == 0}
        blocks = next((e for e in reversed(events) if isinstance(e, ev.BlocksChanged)), None)
        if plan is not None:
            for s in plan.scheduled:
                if s.kind != "prefill" or s.index != 0:
                    continue
                out.extend(self._embedding(s, first_layer.get(s.request_id)))
                out.extend(self._prefill(plan, s, timed))
        for e in events:
            if isinstance(e, ev.TokenSampled):
                out.extend(self._token(e, timed))
            elif isinstance(e, ev.SpecDecodeStep):
                out.append(self._speculative(e))
            elif isinstance(e, ev.RequestFinished):
                out.append(self._finished(e))
            elif isinstance(e, ev.EngineError):
                out.append(Commentary("error", "Engine error" + (f" in step {e.step}" if e.step is not None else ""),
                                      e.message + (f" (request {e.request_id} was finished because of it)"
                                                   if e.request_id else ""), request_id=e.request_id, step=e.step))
        if timed is not None:
            out.extend(self._kv_cache(timed, blocks))
        return out

    def _embedding(self, s: ev.ScheduledEntry, trace: ev.LayerTrace | None) -> list[Commentary]:
        state = self._requests.get(s.request_id)
        if state is None or state.embedding_told:
            return []
        state.embedding_told = True
        hidden = trace.hidden_size if trace else self.info.get("hidden_size")
        vocab = self.info.get("vocab_size")
        if hidden is None:
            return []
        matrix = f"[{vocab}, {hidden}]" if vocab else f"[vocab_size, {hidden}]"
        ids = "The token id" if s.num_tokens == 1 else f"Each of the {s.num_tokens} token ids"
        text = (f"{ids} of this prefill selects one row of the {matrix} embedding matrix, a lookup without "
                f"arithmetic: the hidden states are [1, {s.num_tokens}, {hidden}], {hidden} numbers per token.")
        out: list[Commentary] = []
        if trace is not None:
            emb = next((t for t in trace.tensors if t.name == "token_embeddings"), None)
            if emb is not None:
                values = ", ".join(f"{v:+.4f}" for v in emb.sample)
                text += f" The last token's vector begins {values}, ... (real values from this run)."
            out.append(Commentary("embedding", f"Request {s.request_id}: embedding to {hidden} dimensions", text,
                                  request_id=s.request_id, step=trace.step))
            out.append(self._attention(trace))
            return out
        text += " (Real values appear when X-Ray capture is on.)"
        return [Commentary("embedding", f"Request {s.request_id}: embedding to {hidden} dimensions", text,
                           request_id=s.request_id)]

    @staticmethod
    def _attention(t: ev.LayerTrace) -> Commentary:
        shapes = {x.name: x for x in t.tensors}
        q, k, scores, probs = (shapes.get(n) for n in ("q", "k", "scores", "probs"))
        group = t.num_heads // max(1, t.num_kv_heads)
        text = (f"In layer {t.layer} of {t.num_layers}, the projections give Q {list(q.shape) if q else '?'} and K, V "
                f"{list(k.shape) if k else '?'}: {t.num_heads} query heads share {t.num_kv_heads} KV heads, "
                f"{group} per KV head (grouped-query attention), so the cache keeps {group}x fewer keys and values. "
                f"The scores S = Q K^T / sqrt({t.head_dim}) form {list(scores.shape) if scores else '?'}; the causal "
                "softmax turns each row into weights that sum to 1.")
        if probs is not None and probs.sample:
            text += (" Head 0's last query gives its last keys the weights "
                     + ", ".join(f"{v:.3f}" for v in probs.sample) + ".")
        if t.attention and t.key_pieces:
            row = t.attention[-1]
            best = max(range(len(row)), key=row.__getitem__)
            if best < len(t.key_pieces):
                text += (f" In head {t.head}, the last token attends most to {show_piece(t.key_pieces[best])} "
                         f"({row[best]:.1%}).")
        return Commentary("attention", f"Request {t.request_id}: attention in layer {t.layer}", text,
                          request_id=t.request_id, step=t.step)

    def _prefill(self, plan: ev.StepPlanned, s: ev.ScheduledEntry, timed: ev.StepTimed | None) -> list[Commentary]:
        layers = self.info.get("num_layers")
        through = f"all {layers} layers" if layers else "every layer"
        timing = ""
        if timed is not None:
            timing = (f" The step took {ms(timed.wall_time_s)} for its {timed.num_tokens} tokens "
                      f"({timed.num_tokens / timed.wall_time_s:,.0f} tokens/s).")
        per_token = self.info.get("kv_bytes_per_token")
        kv = (f" Their keys and values, {s.num_tokens} x {per_token:,} = {s.num_tokens * per_token:,} bytes, are now in "
              "the KV cache." if per_token else " Their keys and values are now in the KV cache.")
        if s.num_tokens == 1 and per_token:
            kv = f" Its keys and values, {per_token:,} bytes, are now in the KV cache."
        end = s.start + s.num_tokens
        rid = s.request_id
        if s.total_len > s.prompt_len:  # a preempted request recomputing prompt and generated tokens
            text = (f"Request {rid} was preempted earlier and is readmitted: it recomputes tokens {s.start}..{end - 1} "
                    f"of its {s.total_len} ({s.prompt_len} prompt + {s.total_len - s.prompt_len} generated) through "
                    f"{through}.{timing}{kv}")
            return [Commentary("prefill", f"Request {rid}: recompute of {s.num_tokens} tokens", text, request_id=rid,
                               step=plan.step)]
        if s.start == s.num_cached_tokens and end == s.total_len:
            tokens = (f"The {plural(s.num_tokens, 'prompt token')} after the {s.num_cached_tokens} found in the prefix "
                      "cache" if s.num_cached_tokens else f"All {s.num_tokens} prompt tokens" if s.num_tokens > 1
                      else "The one prompt token")
            what = (f"{tokens} go through {through} together in one forward pass, as matrix multiplications over "
                    f"{s.num_tokens} rows at once." if s.num_tokens > 1 else
                    f"{tokens} goes through {through} in one forward pass.")
            text = (f"{what}{timing}{kv} Only the last position's vocabulary scores are needed: they choose the first "
                    "new token.")
            return [Commentary("prefill", f"Request {rid}: prefill of {plural(s.num_tokens, 'token')} at once", text,
                               request_id=rid, step=plan.step)]
        remaining = s.total_len - end
        budget = plan.token_budget
        text = (f"The prompt of request {rid} has {s.prompt_len} tokens and the step's budget is {budget}, so it is "
                f"prefilled in chunks: this step reads tokens {s.start}..{end - 1} ({s.num_tokens} tokens) through "
                f"{through}." + timing + kv)
        if remaining:
            text += f" {remaining} tokens remain for later steps; other requests keep decoding meanwhile."
        else:
            text += " This was the last chunk: its last position chooses the first new token."
        title = f"Request {rid}: prefill chunk {s.start}..{end - 1} of {s.prompt_len}"
        return [Commentary("chunked_prefill", title, text, request_id=rid, step=plan.step)]

    def _token(self, e: ev.TokenSampled, timed: ev.StepTimed | None) -> list[Commentary]:
        state = self._requests.get(e.request_id)
        if state is not None and self.max_decode is not None:
            if state.decode_told >= self.max_decode:
                state.decode_untold += 1
                return []
        if state is not None:
            state.decode_told += 1
        piece = show_piece(e.text) if e.text else f"(id {e.token_id}, part of a character)"
        table = tuple((t.text, t.prob) for t in e.top)
        which = "first token, from the prefill" if e.num_output_tokens == 1 else f"token #{e.num_output_tokens}"
        vocab = self.info.get("vocab_size")
        if e.top:
            best = e.top[0]
            rank = next((i for i, t in enumerate(e.top) if t.token_id == e.token_id), None)
            text = (f"The model scored {'all ' + format(vocab, ',') if vocab else 'every'} vocabulary entries for "
                    f"position {e.position}; the favourite is {show_piece(best.text)} at {best.prob:.2%}.")
            if e.greedy:
                text += f" Greedy decoding takes it: {piece} (id {e.token_id})."
            elif rank is None:
                text += (f" Sampling at temperature {e.temperature:g} drew {piece} (id {e.token_id}), which is outside "
                         f"the top {len(e.top)}.")
            else:
                text += (f" Sampling at temperature {e.temperature:g} drew {piece} (id {e.token_id}), the "
                         f"{ordinal(rank + 1)} most likely at {e.top[rank].prob:.2%}.")
            text += " (Probabilities are the model's, before temperature and filtering.)" if not e.greedy else ""
        else:
            text = (f"The next token for position {e.position} is {piece} (id {e.token_id}), "
                    + ("the most likely one." if e.greedy else f"drawn at temperature {e.temperature:g}."))
        if timed is not None and e.num_output_tokens > 1:
            text += (f" Its step took {ms(timed.wall_time_s)}; only this one new token went through the layers, "
                     "its query reading the cached keys.")
        if state is not None and self.max_decode is not None and state.decode_told == self.max_decode:
            text += " (Later tokens of this request are summed up when it finishes.)"
        return [Commentary("decode", f"Request {e.request_id}, {which}: {piece}", text, request_id=e.request_id,
                           step=e.step, table=table)]

    def _kv_cache(self, t: ev.StepTimed, blocks: ev.BlocksChanged | None) -> list[Commentary]:
        if t.num_blocks_used == self._last_blocks_used:
            return []
        self._last_blocks_used = t.num_blocks_used
        per_block = (blocks.bytes_per_block if blocks is not None else
                     t.kv_bytes_used // t.num_blocks_used if t.num_blocks_used else None)
        cached = (f" {plural(t.num_blocks_cached, 'freed block')} keep their contents for prefix-cache reuse."
                  if t.num_blocks_cached else "")
        if t.num_blocks_used == 0:
            text = f"No request holds KV blocks now: all {t.num_blocks_total} blocks are free.{cached}"
            return [Commentary("kv_cache", "KV cache: empty", text, step=t.step)]
        text = (f"The KV cache now holds {plural(t.num_blocks_used, 'block')}"
                + (f" x {per_block:,} bytes" if per_block else "")
                + f" = {t.kv_bytes_used:,} bytes ({human_bytes(t.kv_bytes_used)}) of the pool's "
                f"{human_bytes(t.kv_bytes_total)} ({t.num_blocks_used} of {t.num_blocks_total} blocks in use).{cached}")
        if blocks is not None and blocks.tables:
            shown = []
            for tb in blocks.tables[:MAX_TABLES_SHOWN]:
                free = max(0, len(tb.block_table) * blocks.block_size - tb.num_computed_tokens)
                shown.append(f"request {tb.request_id} keeps {plural(tb.num_computed_tokens, 'token')} in blocks "
                             f"{list(tb.block_table)} ({plural(free, 'slot')} still empty)")
            text += " Block tables: " + "; ".join(shown)
            if len(blocks.tables) > MAX_TABLES_SHOWN:
                text += f"; and {len(blocks.tables) - MAX_TABLES_SHOWN} more"
            text += "."
        return [Commentary("kv_cache", f"KV cache: {human_bytes(t.kv_bytes_used)} in {plural(t.num_blocks_used, 'block')}", text,
                           step=t.step)]

    def _finished(self, e: ev.RequestFinished) -> Commentary:
        state = self._requests.pop(e.request_id, None)
        why = {"stop": "it produced a stop token or stop string", "length": "it reached its token limit",
               "abort": "it was aborted", "error": "an engine error ended it"}.get(e.finish_reason, e.finish_reason)
        text = (f"Request {e.request_id} finished ({e.finish_reason}): {why} after {plural(e.num_output_tokens, 'token')}: "
                f"{e.output_text!r}. Time to first token {ms(e.ttft_s)}, time per output token {ms(e.tpot_s)}, "
                f"end to end {ms(e.e2e_s)}.")
        if e.num_cached_prompt_tokens:
            text += f" {e.num_cached_prompt_tokens} of its {e.num_prompt_tokens} prompt tokens came from the prefix cache."
        if e.num_preemptions:
            text += f" It was preempted {e.num_preemptions} time{'s' if e.num_preemptions != 1 else ''}."
        if state is not None and state.decode_untold:
            text += f" {state.decode_untold} of its tokens were not narrated one by one."
        if e.error:
            text += f" Error: {e.error}"
        return Commentary("finished", f"Request {e.request_id} finished: {e.finish_reason}", text,
                          request_id=e.request_id, step=e.step)

    @staticmethod
    def _speculative(e: ev.SpecDecodeStep) -> Commentary:
        n_ok = 0
        for ok in e.accepted:
            if not ok:
                break
            n_ok += 1
        table = tuple((f"{show_piece(t)} {'accepted' if ok else 'rejected'}", p)
                      for t, ok, p in zip(e.draft_texts, e.accepted, e.p))
        text = (f"The {e.proposer} proposer guessed {len(e.draft_tokens)} tokens "
                + " ".join(show_piece(t) for t in e.draft_texts)
                + f"; the target model checked them in one pass and kept {n_ok}")
        if n_ok < len(e.draft_tokens):
            i = n_ok
            text += (f". The {ordinal(i + 1)} was rejected (target p={e.p[i]:.3f}, draft q={e.q[i]:.3f}; kept with "
                     f"probability min(1, p/q) = {min(1.0, e.p[i] / e.q[i]) if e.q[i] else 1.0:.3f})")
        if e.bonus_token is not None:
            text += f", and added {show_piece(e.bonus_text)} itself"
        text += f": {n_ok + (1 if e.bonus_token is not None else 0)} tokens from one target pass."
        return Commentary("speculative", f"Request {e.request_id}: {n_ok}/{len(e.draft_tokens)} draft tokens accepted",
                          text, request_id=e.request_id, step=e.step, table=table)
