"""The narrator: plain-English commentary written from the engine's events, with their real numbers.

Feed it every event of a run (``engine.subscribe(narrator_callback, topk=5, blocks=True)``)
and it returns :class:`Commentary` entries: how the prompt was tokenized (each piece and its
id), what the embedding produced (sizes, and real values when X-Ray capture is on), how many
tokens the prefill processed and how long the step took, each decode step's top choices and
the token taken, what the sampling settings did, speculative verifications, how many bytes
the KV cache holds, and the scheduler's decisions (who waits and why, chunked prefill,
preemption and its victim, prefix cache hits, samples sharing a prompt), and, for an engine
split over ranks, a step that waited on communication (``tp_facts.waited_on_communication``). The CLI's
``--narrate`` and the app's Narrator tab both render these entries.

Truth rule: a sentence either states what the step's own events show (its plan, its
tokens, its timings, its blocks) or a rule this engine always follows; nothing is said
"because that is what usually happens". When the events cannot tell, the sentence is left
out rather than guessed.

Order: events of one engine step arrive as ``StepPlanned``, (``LayerTrace``...),
(``SpecDecodeStep``, ``TokenSampled``...)..., ``RequestFinished``..., ``BlocksChanged``,
``StepTimed``. Scheduler decisions are told at ``StepPlanned``; the rest of the step is
told at ``StepTimed``, when its wall time is known, in reading order (embedding, prefill,
tokens, a split step's communication, finished, KV cache: every step's communication note directly
after its tokens, the last step's too).

Readability with many requests: steady decode-only steps produce no scheduler entry, and
``max_decode_steps_per_request`` caps the per-token entries of each request (the rest are
summed up when it finishes).

Sources: the scheduler rules are vLLM's V1 scheduler but for a waiting request's preemption of
running ones, which was vLLM V0's (see ``engine/scheduler.py``); the
terms (prefill, decode, token budget, preemption, prefix cache hit, TTFT, TPOT) are vLLM's.

Why past ~400 lines: one class turns every event kind into sentences, in the order a step
emits them; the sampling and scheduler commentary already live in narrator_sampling.py and
narrator_scheduler.py, and splitting the rest would scatter one step's story over files.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Any

from nanovllm_core import events as ev
from nanovllm_core.educational.commentary import (Commentary, agree, human_bytes, join_words, ms, ordinal,
                                                    plural, show_piece, who)
from nanovllm_core.educational.kv_facts import kv_footprint
from nanovllm_core.educational.narrator_sampling import (budget_at_turn, draft_limits_sentence, sampling_intro,
                                                         speculative_entry, token_choice, token_label,
                                                         unfilled_reservations, verification_rule)
from nanovllm_core.educational.narrator_scheduler import PRIORITY_NOTE, SchedulerNarration
from nanovllm_core.educational.tp_facts import across_ranks, tp_size, waited_on_communication
from nanovllm_core.sampling_params import contiguous_reservation

__all__ = ["KINDS", "Commentary", "Narrator", "PRIORITY_NOTE", "human_bytes", "ms", "ordinal", "plural", "show_piece"]

KINDS = ("model", "tokenization", "embedding", "attention", "prefill", "decode", "sampling", "kv_cache",
         "scheduler", "chunked_prefill", "preemption", "prefix_cache", "finished", "rejected", "speculative",
         "communication", "error")
MAX_PIECES_SHOWN = 48  # a longer prompt's pieces and ids are shown up to this many, then counted
MAX_TABLES_SHOWN = 4   # block tables listed in one KV cache entry


def capture_note(timed: ev.StepTimed) -> str:
    """A traced step's sentence on the X-Ray capture inside its time (``StepTimed.traced``), or "".

    Trial 12: the narrator put a traced step's 1.3 s down to "norms, RoPE, attention..." while the
    untraced steps beside it took 56 ms: the capture is a processor of that number and is named.
    """
    if not getattr(timed, "traced", False):
        return ""
    return (" That time includes the X-Ray's capture of this step's layers, which ran inside the step and can be "
            "most of it: a step the X-Ray does not trace runs faster.")


def yielded_note(timed: ev.StepTimed) -> str:
    """A step's sentence on the time it waited for the app's frame (``StepTimed.yielded_s``), or ""."""
    if timed.yielded_s < 0.0005:
        return ""
    return (f" Besides that it waited {ms(timed.yielded_s)} while this app drew its answer to a key you pressed "
            "(or a click), so that the frame had the CPU; that wait is in the TTFT/TPOT of the requests in the step.")


@dataclass
class _RequestState:
    prompt: str | None
    num_prompt_tokens: int
    priority: int
    max_tokens: int | None
    sampling: dict[str, Any]
    n: int = 1
    decode_told: int = 0
    decode_untold: int = 0
    verify_untold: int = 0  # speculative verifications past the cap, summed up at the finish
    first_step_s: float | None = None  # the wall time of the step that made sample 0's first token
    embedding_told: bool = False


@dataclass
class _OpenStep:
    plan: ev.StepPlanned
    events: list[ev.Event] = field(default_factory=list)


def _scores_layout(shape: tuple[int, ...], num_heads: int, num_kv_heads: int) -> str:
    """What each axis of a traced score matrix is, read off its numbers, so a learner who expects
    [query heads, tokens, keys] sees why X-Ray's is grouped. X-Ray (educational/xray.py) records
    ``[num_kv_heads, group * tokens, keys]``, the layout of grouped-query attention (Ainslie et al. 2023):
    each KV head's keys meet the queries of its ``group`` query heads in one product, K never copied.
    Older traces are ``[batch, heads, tokens, keys]``. Returns "" for a layout it cannot name."""
    group = num_heads // max(1, num_kv_heads)
    if len(shape) == 3 and shape[0] == num_kv_heads and group > 1 and shape[1] % group == 0:
        n, keys = shape[1] // group, shape[2]
        return (f", [KV head, its {group} query heads x {plural(n, 'token')}, {plural(keys, 'key')}]: the queries "
                f"are grouped by the KV head they read, so each of the {num_kv_heads} KV heads meets its {group} "
                f"heads' queries ({group} x {n} = {shape[1]} rows) in one product, not [{num_heads}, {n}, {keys}] "
                "with its keys copied per query head")
    if len(shape) == 3 and shape[0] == num_heads:
        return f", [head, {plural(shape[1], 'query token')}, {plural(shape[2], 'key')}]"
    if len(shape) == 4 and shape[1] == num_heads:
        return f", [batch, head, {plural(shape[2], 'query token')}, {plural(shape[3], 'key')}]"
    return ""


class Narrator(SchedulerNarration):
    """Turns engine events into :class:`Commentary`.

    Args:
        model_info: ``LLMEngine.model_info()`` (also taken from a ready ``ModelLoading`` event);
            when given, the first call of :meth:`feed` starts with a ``model`` entry.
        max_decode_steps_per_request: at most this many ``decode`` entries per request (None:
            all); later tokens are counted and summed up in its ``finished`` entry.
        kv_every_step: a ``kv_cache`` entry after every step (default: only when the number of
            blocks in use changed).

    Raises:
        ValueError: a negative ``max_decode_steps_per_request``.

    Not thread-safe: feed it from one thread (or behind a queue).
    """

    def __init__(self, model_info: dict | None = None, max_decode_steps_per_request: int | None = None,
                 kv_every_step: bool = False) -> None:
        if max_decode_steps_per_request is not None and max_decode_steps_per_request < 0:
            raise ValueError("max_decode_steps_per_request must be >= 0 or None (no cap)")
        self.info: dict[str, Any] = dict(model_info or {})
        self.max_decode = max_decode_steps_per_request
        self.kv_every_step = kv_every_step
        self._introduced = False
        self._requests: dict[str, _RequestState] = {}
        self._open: _OpenStep | None = None
        self._last_signature: tuple | None = None
        self._last_blocks_used: int | None = None
        self._last_pool: ev.BlocksChanged | None = None  # the newest block tables, for an abort between steps
        self._pool_counts: tuple[int, int] | None = None  # (used, cached-free) blocks now, for an abort without tables
        self._step_ended = False  # a StepTimed came: "step N" names a step that ran (the first step is step 0 too)
        # Per sequence: tokens with K/V computed so far (from the plans), and, after a
        # preemption, how many it had computed when it lost its blocks (to tell a recompute
        # from tokens computed for the first time).
        self._computed: dict[int, int] = {}
        self._lost: dict[int, int] = {}
        self._request_of: dict[int, str] = {}
        # Per sequence: tokens recomputed over all its readmissions, and the preemptions the narrator saw
        # (the total is told only when it saw them all).
        self._recomputed: dict[int, int] = {}
        self._preempts_seen: dict[int, int] = {}
        # Per sequence: its latest speculative reservation (step, first position, slots 1 + k, drafts proposed),
        # to tell why a block table holds a block ahead of its tokens.
        self._reserved: dict[int, tuple[int, int, int, int]] = {}

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
        if isinstance(event, ev.BlocksChanged):
            self._last_pool = event
        if isinstance(event, ev.StepTimed) and event.num_blocks_total:
            self._pool_counts = (event.num_blocks_used, event.num_blocks_cached)
        if isinstance(event, ev.StepTimed):
            self._step_ended = True
        if isinstance(event, ev.StepTimed) and self._last_pool is not None and self._last_pool.step != event.step:
            # a step ended with no snapshot of its own (the app asks for them only while a tab shows them): the
            # older tables are not the pool now (trial 45e: an abort named step 2's 2 blocks where it held 3)
            self._last_pool = None
        if isinstance(event, ev.StepPlanned):
            out.extend(self.flush())
            self._lost = {q: n for q, n in self._lost.items() if self._computed.get(q, 0) < n}
            out.extend(self._planned(event))
            self._track(event)
            if event.scheduled:
                self._open = _OpenStep(event)
        elif isinstance(event, ev.StepTimed):
            out.extend(self._step_done(event))
        elif isinstance(event, ev.RequestAdded):
            out.extend(self._added(event))
        elif isinstance(event, ev.RequestRejected):
            # the engine's reason as a sentence: it began in lower case with no full stop (trial 11)
            reason = event.reason.strip() or "no reason given"
            reason = (reason[:1].upper() + reason[1:]) + ("" if reason.endswith((".", "!", "?", ")")) else ".")
            out.append(Commentary("rejected", f"Request {event.request_id} rejected", reason,
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
        heads, kv = i["num_heads"], max(1, i["num_kv_heads"])
        if kv == heads:
            sharing = f"{heads} attention heads, each with its own keys and values (multi-head attention),"
        else:
            style = "multi-query attention" if kv == 1 else "grouped-query attention"
            sharing = (f"{heads} query heads sharing {plural(kv, 'KV head')} ({heads // kv} to 1, {style}: query head "
                       f"h reads KV head h // {heads // kv}),")
        weights = ""
        if i.get("quantization") and i.get("weight_format"):  # block modes: what each format holds
            weights = f", weights kept in GGUF blocks as {i['weight_format']}"
        text = (f"{i.get('model_name', 'The model')} on {i.get('device', '?')} in {i.get('dtype', '?')}{weights}: "
                f"{i.get('num_parameters', 0) / 1e6:.0f} M parameters in {i['num_layers']} decoder layers, "
                f"hidden size {i['hidden_size']}, {sharing} heads of {i['head_dim']} dimensions, a vocabulary of "
                f"{i['vocab_size']:,} tokens. Each token kept in the KV cache costs "
                f"{i['kv_bytes_per_token']:,} bytes{self._ranks(i['kv_bytes_per_token'])}; "
                + (f"the pool has {plural(i.get('num_kv_blocks', 0), 'block')} of {i.get('block_size', 0)} tokens."
                   if not self._contiguous else
                   f"this is the contiguous baseline (no paged attention): one request runs at a time, its keys and "
                   f"values in one contiguous region reserved when it is admitted for its prompt plus max_tokens "
                   f"(capped at max_model_len, in whole units of {i.get('block_size', 0)} tokens), out of room for "
                   f"{i.get('num_kv_blocks', 0) * i.get('block_size', 0):,} tokens."))
        return [Commentary("model", "The model", text)]

    @property
    def _contiguous(self) -> bool:
        """The engine is the contiguous baseline (``paged=False``): one region per request, no block tables."""
        return self.info.get("paged") is False

    def _ranks(self, nbytes: float, fmt: Any = None) -> str:
        """" across N ranks (X on each)" when the engine is split (KV byte figures are totals over the ranks)."""
        return across_ranks(nbytes, tp_size(self.info), fmt)

    def flush(self) -> list[Commentary]:
        """Tell what an unfinished step buffered (a step cut short has no ``StepTimed``)."""
        if self._open is None:
            return []
        step, self._open = self._open, None
        return self._tell_step_events(step.plan, step.events, None)

    # ------------------------------------------------------------------ requests

    def _name(self, request_id: str, index: int = 0) -> str:
        state = self._requests.get(request_id)
        return who(request_id, index, state.n if state else 1)

    def _entry_name(self, s: ev.ScheduledEntry) -> str:
        return self._name(s.request_id, s.index)

    def _added(self, e: ev.RequestAdded) -> list[Commentary]:
        sampling = dict(e.sampling)
        self._requests[e.request_id] = _RequestState(e.prompt, len(e.prompt_token_ids), e.priority, e.max_tokens,
                                                     sampling, n=e.n)
        n = len(e.prompt_token_ids)
        shown = min(n, MAX_PIECES_SHOWN)
        pairs = " ".join(f"{show_piece(p)}={t}" for p, t in zip(e.prompt_pieces[:shown], e.prompt_token_ids[:shown]))
        more = f" ... and {n - shown} more" if n > shown else ""
        ids = ", ".join(str(t) for t in e.prompt_token_ids[:shown])
        if e.prompt is not None:
            source = f"The prompt {e.prompt!r}"
        elif e.chat:  # a conversation the chat template turned into ids (the app's chat mode): not ids typed in
            role, said = e.chat[-1]
            source = (f"The {role}'s message {said!r}" if len(e.chat) == 1 else
                      f"The conversation of {len(e.chat)} messages (the last, the {role}'s: {said!r})")
            source += ", put through the model's chat template,"
        else:
            source = "The prompt (given as token ids)"
        vocab = self.info.get("vocab_size")
        spaced = any(" " in p for p in e.prompt_pieces[:shown])  # the note only where a ␣ is shown
        text = (f"{source} becomes {plural(n, 'token')}: {pairs}{more}.\n"
                f"Token ids: [{ids}{', ...' if n > shown else ''}]\n"
                + ("(␣ marks a space.) " if spaced else "") + "The model only ever sees these integers"
                + (f", each an index into its vocabulary of {vocab:,} pieces." if vocab else ".")
                + (" Special tokens such as the start marker count like any other." if n and self._looks_special(e)
                   else ""))
        if e.n > 1:
            text += "\n" + self._samples_plan(e.n, n)
        out = [Commentary("tokenization", f"Request {e.request_id}: {plural(n, 'token')}", text, request_id=e.request_id)]
        out.append(sampling_intro(self._name(e.request_id), e.request_id, sampling, e.max_tokens, e.n))
        return out

    def _samples_plan(self, n: int, prompt_len: int) -> str:
        if self.info.get("prefix_caching") is False:
            return (f"It asks for {n} samples. Prefix caching is off, so the samples share nothing: each one prefills "
                    "the whole prompt itself.")
        bs = self.info.get("block_size")
        if bs and (prompt_len - 1) // bs == 0:  # LLMEngine.shareable_prompt_blocks: nothing to wait for
            return (f"It asks for {n} samples. Its {plural(prompt_len, 'token')} fill no block before the one "
                    f"holding the prompt's last token (blocks hold {bs}), which each sample computes itself, so "
                    "the samples have nothing to share through the prefix cache: all of them prefill the prompt "
                    "from the start, side by side.")
        others = "the other sample waits" if n == 2 else f"the other {n - 1} wait"
        return (f"It asks for {n} samples. Sample 0 prefills the prompt first; {others} until its full "
                "prompt blocks are in the prefix cache and then share them, except the block that holds the "
                "prompt's last token, which each sample computes itself. (The PagedAttention paper's engine forks "
                "the sequence instead and shares even that last block, copying it on write.)")

    @staticmethod
    def _looks_special(e: ev.RequestAdded) -> bool:
        return any(p.startswith("<") and p.endswith(">") and len(p) > 2 for p in e.prompt_pieces)

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
        entries = {s.seq_id: s for s in plan.scheduled} if plan is not None else {}
        for s in entries.values():
            if s.num_spec_tokens:  # slots for the newest token (or the prompt's last) and k drafts
                self._reserved[s.seq_id] = (plan.step, s.start + s.num_own_tokens - 1, 1 + s.num_spec_tokens,
                                            s.num_drafts)
        if plan is not None:
            for s in plan.scheduled:
                if s.kind != "prefill":
                    continue
                out.extend(self._embedding(plan, s, first_layer.get(s.request_id)))
                out.extend(self._prefill(plan, s, timed))
        kept: dict[int, int] = {}  # tokens each sequence gained in this step
        left: dict[str, int] = {}  # tokens of each request in this step not told yet
        for e in events:
            if isinstance(e, ev.TokenSampled):
                kept[e.seq_id] = kept.get(e.seq_id, 0) + 1
                left[e.request_id] = left.get(e.request_id, 0) + 1
        finishing = {e.request_id for e in events if isinstance(e, ev.RequestFinished)}
        first_kept: dict[int, ev.SpecDecodeStep] = {}  # a verification, until its first kept token is told
        # per sequence: the verification of this step, its rule, and how many of its kept tokens were told
        run: dict[int, list] = {}
        ends: list[Commentary] = []  # finishes, told after the step's forward pass and its communication note
        for e in events:
            if isinstance(e, ev.TokenSampled):
                kept_by = None
                if e.seq_id in run:
                    v, rule, told = run[e.seq_id]
                    kept_by = (v, told, rule)
                    run[e.seq_id][2] += 1
                left[e.request_id] -= 1
                out.extend(self._token(e, entries.get(e.seq_id), timed, first_kept.pop(e.seq_id, None),
                                       e.speculative or kept_by is not None, kept_by, plan,
                                       last=e.request_id in finishing and not left[e.request_id]))
            elif isinstance(e, ev.SpecDecodeStep):
                first_kept[e.seq_id] = e
                if e.seq_id in self._computed:
                    self._computed[e.seq_id] += next((i for i, ok in enumerate(e.accepted) if not ok), len(e.accepted))
                greedy = verification_rule(e, self._requests[e.request_id].sampling
                                           if e.request_id in self._requests else None)
                run[e.seq_id] = [e, greedy, 0]
                state = self._requests.get(e.request_id)
                if state is not None and self.max_decode is not None and state.decode_told >= self.max_decode:
                    state.verify_untold += 1  # past the cap, as its tokens are (trial 10)
                else:
                    out.append(speculative_entry(e, self._name(e.request_id), greedy, kept.get(e.seq_id),
                                                 state.sampling if state is not None else None,
                                                 state.decode_told + state.decode_untold if state is not None else 1,
                                                 draft_limits_sentence(entries.get(e.seq_id), e.proposer, plan,
                                                                       self._entry_name),
                                                 kernel=self.info.get("attention_backend")))
            elif isinstance(e, ev.RequestFinished):
                ends.append(self._finished(e))
            elif isinstance(e, ev.EngineError):
                out.append(Commentary("error", "Engine error" + (f" in step {e.step}" if e.step is not None else ""),
                                      e.message + (f" (request {e.request_id} was finished because of it)"
                                                   if e.request_id else ""), request_id=e.request_id, step=e.step))
        if timed is not None:
            # The forward pass's communication belongs beside the tokens it produced, in every step: before
            # a finish and the KV cache entry, so the last step's note does not follow "KV cache: empty"
            # as if it were a step of its own (trial 7).
            waited = waited_on_communication(timed)  # a step split over ranks (tensor parallel)
            if waited is not None:
                out.append(Commentary("communication", f"Step {timed.step} waited on communication", waited,
                                      step=timed.step))
        out.extend(ends)
        if timed is not None:
            out.extend(self._kv_cache(timed, blocks))
        return out

    def _ahead(self, tb: ev.SeqBlocks, block_size: int) -> str:
        """Why ``tb`` holds blocks past those its computed tokens fill (speculative decoding), or ``""``.

        Before a step the scheduler reserves slots for a speculating sequence's newest token and up
        to k drafts, taking a block before the last is full when they need it; the verification gives
        back blocks past the kept tokens, but a step whose proposer drafted nothing rolls nothing back.
        """
        need = -(-tb.num_computed_tokens // block_size) if block_size else len(tb.block_table)
        ahead = list(tb.block_table[need:])
        if not ahead:
            return ""
        head = (f"; {'block' if len(ahead) == 1 else 'blocks'} {ahead if len(ahead) > 1 else ahead[0]} "
                f"{'holds' if len(ahead) == 1 else 'hold'} none of its tokens yet")
        it = "it" if len(ahead) == 1 else "them"
        seen = self._reserved.get(tb.seq_id)
        if seen is None:
            return head + ": reserved ahead of them in a step this narrator did not see"
        step, start, slots, drafts = seen
        last = f"block {tb.block_table[need - 1]}" if need else "the last one"
        why = (f": before step {step} the scheduler reserved slots for 1 + {slots - 1} tokens, positions {start}.."
               f"{start + slots - 1}, the newest and up to {slots - 1} drafts, and took {it} before {last} was full")
        if drafts == 0:
            return head + why + (f"; the proposer drafted none, and only rejected drafts give back blocks past the "
                                 f"kept tokens, so {it} {'waits' if len(ahead) == 1 else 'wait'} for the tokens to come")
        return head + why

    def _embedding(self, plan: ev.StepPlanned, s: ev.ScheduledEntry, trace: ev.LayerTrace | None) -> list[Commentary]:
        state = self._requests.get(s.request_id)
        if state is None or state.embedding_told:
            return []
        state.embedding_told = True
        hidden = trace.hidden_size if trace else self.info.get("hidden_size")
        vocab = self.info.get("vocab_size")
        if hidden is None:
            return []
        matrix = f"[{vocab}, {hidden}]" if vocab else f"[vocab_size, {hidden}]"
        ids = "The token id" if s.num_tokens == 1 else f"Each of the {s.num_tokens} token ids" + (
            f" (the prompt's last token and {plural(s.num_drafts, 'draft')})" if s.num_drafts else "")
        rows = plan.num_batched_tokens
        batch = (f"its {plural(s.num_tokens, 'row')} {agree(s.num_tokens, 'joins', 'join')} "
                 f"{plural(rows - s.num_tokens, 'row')} of other sequences in the step's "
                 f"flat [{rows}, {hidden}] hidden states" if rows > s.num_tokens
                 else f"the hidden states are [{rows}, {hidden}]")
        text = (f"{ids} of this prefill selects one row of the {matrix} embedding matrix, a lookup without "
                f"arithmetic: {batch}, {hidden} numbers per token.")
        title = f"Request {s.request_id}: embedding to {hidden} dimensions"
        if trace is not None:
            emb = next((t for t in trace.tensors if t.name == "token_embeddings"), None)
            if emb is not None and emb.sample:
                values = ", ".join(f"{v:+.4f}" for v in emb.sample)
                text += f" The last token's vector begins {values}, ... (real values from this run)."
            return [Commentary("embedding", title, text, request_id=s.request_id, step=trace.step),
                    self._attention(trace)]
        # True whether or not --xray was given (trial 7: at --tensor-parallel-size 3 with --xray on it
        # said "Real values appear when X-Ray capture is on").
        if tp_size(self.info) > 1:
            text += " (No real values: an engine split over ranks is not traced by X-Ray.)"
        else:
            text += (" (Real values appear only in a step X-Ray traces, with --xray or the app's X-Ray tab; this "
                     "one was not traced.)")
        return [Commentary("embedding", title, text, request_id=s.request_id, step=plan.step)]

    def _attention(self, t: ev.LayerTrace) -> Commentary:
        shapes = {x.name: x for x in t.tensors}
        q, k, scores, probs = (shapes.get(n) for n in ("q", "k", "scores", "probs"))
        group = t.num_heads // max(1, t.num_kv_heads)
        text = (f"In layer {t.layer} (of {t.num_layers}, counted from 0), the projections give Q "
                f"{list(q.shape) if q else '?'} and K, V {list(k.shape) if k else '?'}: {t.num_heads} query heads share "
                f"{t.num_kv_heads} KV heads, {group} per KV head (query head h reads KV head h // {group}; no KV head is "
                f"copied), so the cache keeps {group}x fewer keys and values. The scores S = Q K^T / sqrt({t.head_dim})"
                + (f" have the shape {list(scores.shape)}{_scores_layout(scores.shape, t.num_heads, t.num_kv_heads)}"
                   if scores else "")
                + "; the causal softmax turns each row into weights that sum to 1.")
        kernel = self.info.get("attention_backend")
        if kernel in ("sdpa", "flash-attn", "cpu-paged", "cpu-contiguous"):
            text += (f" This engine's fused attention kernel ({kernel}) never stores the whole score matrix; X-Ray "
                     "recomputes it to show it.")
        elif kernel == "math":
            text += " This engine's math attention backend writes the score matrix to memory, as shown."
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
        name = self._name(s.request_id, s.index)
        cap = f"{name[0].upper()}{name[1:]}"
        rows = plan.num_batched_tokens
        # A prompt's last token may carry drafts (speculative decoding): count them apart, nothing is recomputed.
        n, drafts, total = s.num_own_tokens, s.num_drafts, s.seq_len
        lead = f"With its {plural(drafts, 'draft')}, they" if drafts else "They"
        flat = (f" {agree(s.num_tokens, 'It is 1', f'{lead} are {s.num_tokens}')} of the step's {rows} token rows, "
                "which run through each layer together "
                "as one flat batch." if rows > s.num_tokens else "")
        drafted = (f" After the prompt's last token come {plural(drafts, 'drafted token')} in the same pass: guesses for the tokens after "
                   "the prompt, verified at once (the SPECULATIVE DECODING entry tells which are kept); their keys and "
                   "values fill reserved slots and count only for the drafts kept." if drafts else "")
        timing = ""
        if timed is not None and timed.wall_time_s > 0:  # the Dashboard's prefill rate, over this one step
            others = timed.num_tokens - timed.num_prefill_tokens
            # A step that also decodes or verifies drafts (trial 13b) shares its time between both kinds of
            # rows: prefill tokens over it are no prefill rate, so tell the rate of all its tokens instead.
            counted = timed.num_tokens if others else timed.num_prefill_tokens
            rate = counted / timed.wall_time_s
            figure = f"{rate:,.0f}" if rate >= 10 else f"{rate:.1f}"
            took = f" The step took {ms(timed.wall_time_s)} for its {plural(timed.num_tokens, 'token')}"
            if others:
                took += (f", {timed.num_prefill_tokens} of them prefill and {others} decoded or verified: "
                         f"{figure} tokens/s for all of them")
                own = ("; a step that also decodes has no prefill rate of its own, its time is shared by both "
                       "kinds of rows")
            else:
                own = ""
            if getattr(timed, "traced", False):  # the capture's time is in the rate: told, and not as the engine's
                timing = (f"{took}, {figure} tokens/s" if not others else took) + (
                    " with the X-Ray's capture of its layers inside it, so not the engine's own "
                    f"{'prefill ' if not others else ''}rate: a step the X-Ray does not trace runs faster"
                    f"{own}.{yielded_note(timed)}")
            else:
                timing = (f"{took}: a prefill rate of {figure} tokens/s" if not others else took) + \
                    f"{own}.{yielded_note(timed)}"
        per_token = self.info.get("kv_bytes_per_token")
        kv = (f" Their keys and values, {n} x {per_token:,} = {n * per_token:,} bytes{self._ranks(n * per_token)}, "
              "are now in the KV cache." if per_token else " Their keys and values are now in the KV cache.")
        if n == 1 and per_token:
            kv = f" Its keys and values, {per_token:,} bytes{self._ranks(per_token)}, are now in the KV cache."
        kv += drafted
        end = s.start + n
        remaining = total - end
        rest = (f" {plural(remaining, 'token')} {agree(remaining, 'remains', 'remain')} for later steps."
                if remaining else "")
        rid = s.request_id
        if self._preemptions(plan, s.seq_id) or total > s.prompt_len:
            reused = (f"; the {s.num_cached_tokens} before them were found in the prefix cache"
                      if s.num_cached_tokens and s.start == s.num_cached_tokens and rid in plan.admitted else "")
            again, first = self._split(s.seq_id, s.start, end)
            text = (f"{cap} was preempted earlier and lost its blocks. It computes tokens {s.start}..{end - 1} "
                    f"({n}) of its {total} ({s.prompt_len} prompt + {total - s.prompt_len} "
                    f"generated) through {through}{self._again(again, first)}{reused}.{rest}{flat}{timing}{kv}")
            if again is None:
                title = f"{cap}: recompute of {plural(n, 'token')}"
            elif again:
                title = f"{cap}: recompute of {plural(again, 'token')}" + (f" and {first} new" if first else "")
            else:
                title = f"{cap}: {plural(first, 'new token')} after its readmission"
            return [Commentary("prefill", title, text, request_id=rid, step=plan.step)]
        whole = s.start == s.num_cached_tokens and end == total
        if whole:
            if s.index > 0:
                tokens = (f"The {plural(n, 'prompt token')} of sample {s.index} after the "
                          f"{plural(s.num_cached_tokens, 'token')} "
                          "it shares with sample 0" if s.num_cached_tokens else
                          f"{agree(n, 'The 1 prompt token', f'All {n} prompt tokens')} of sample "
                          f"{s.index} (it shares none with sample 0: "
                          + ("prefix caching is off)" if self.info.get("prefix_caching") is False
                             else "no block of the prompt was in the prefix cache)"))
            elif s.num_cached_tokens:
                tokens = (f"The {plural(n, 'prompt token')} after the "
                          f"{plural(s.num_cached_tokens, 'token')} found in the prefix cache")
            else:
                tokens = f"All {n} prompt tokens" if n > 1 else "The one prompt token"
            verb = "go" if n > 1 else "goes"
            text = (f"{tokens} {verb} through {through} in one forward pass.{flat}{timing}{kv} Only the last "
                    "position's vocabulary scores are computed: they choose the first new token.")
            return [Commentary("prefill", f"{cap}: prefill of {plural(n, 'token')} at once", text,
                               request_id=rid, step=plan.step)]
        others = rows - s.num_tokens
        # a draft reservation planned before it and left unfilled took budget its tokens do not show (trial 24d #1)
        at_turn = budget_at_turn(plan, s, self._entry_name, name) if remaining and s.budget_left == n else ""
        # what the others took of the budget is what they reserved: draft slots left empty count (trial 25c #3),
        # as in the scheduler entry and in budget_at_turn
        unfilled = [e for e in unfilled_reservations(plan) if e is not s]
        empty = sum(e.num_spec_tokens - e.num_drafts for e in unfilled)
        counting = (f", counting {plural(empty, 'draft slot')} of "
                    f"{join_words([self._entry_name(e) for e in unfilled])} reserved before the proposer ran and "
                    "left empty" if empty else "")
        budget = (f"The step's budget is {plan.token_budget} tokens, {at_turn}. " if at_turn else
                  f"The step's budget is {plan.token_budget} tokens"
                  + (f", {others + empty} of them taken by other sequences{counting}" if others + empty else "")
                  + ". ")
        span = f"token {s.start}" if n == 1 else f"tokens {s.start}..{end - 1} ({n})"
        if remaining:
            text = (f"{budget}The prompt of {name} has {s.prompt_len} tokens, more than this step could give it, so it is "
                    f"read in chunks: this step reads {span} through "
                    f"{through}.{rest}")
        else:
            text = (f"{budget}This is the last chunk of {name}'s {s.prompt_len}-token prompt: "
                    f"{span} through {through}. Its last position chooses the first new "
                    "token.")
        text += self._beside(plan, s) + timing + kv
        title = (f"{cap}: prefill chunk {s.start}..{end - 1} of {s.prompt_len}"
                 + (f", then {plural(drafts, 'draft')}" if drafts else ""))
        return [Commentary("chunked_prefill", title, text, request_id=rid, step=plan.step)]

    def _token(self, e: ev.TokenSampled, entry: ev.ScheduledEntry | None, timed: ev.StepTimed | None,
               verification: ev.SpecDecodeStep | None, speculative: bool,
               kept_by: tuple[ev.SpecDecodeStep, int, bool | None] | None = None,
               plan: ev.StepPlanned | None = None, last: bool = False) -> list[Commentary]:
        """A ``decode`` entry: the choice and its distribution, then how this token was computed in its step.

        ``entry``: the sequence's part of the step's plan (None when unknown); ``verification``:
        the verification this token is the first kept token of; ``speculative``: kept by one;
        ``kept_by``: that verification, the token's place in its kept run and its rule; ``last``: the
        request's last token (it finishes in this step, no later token of it follows).
        """
        state = self._requests.get(e.request_id)
        if state is not None and e.index == 0 and e.num_output_tokens == 1 and timed is not None:
            state.first_step_s = timed.wall_time_s
        if state is not None and self.max_decode is not None:
            if state.decode_told >= self.max_decode:
                state.decode_untold += 1
                return []
        if state is not None:
            state.decode_told += 1
        piece = token_label(e)
        sampling = state.sampling if state is not None else {}
        text, caption = token_choice(e, sampling, self.info.get("vocab_size"), kept_by)
        # a prefill entry with drafts is a prompt's last token: its kept drafts are no recompute
        recompute = entry is not None and entry.kind == "prefill" and not entry.num_drafts and e.num_output_tokens > 1
        which = ("first token, from the prefill" if e.num_output_tokens == 1 else
                 f"token #{e.num_output_tokens}, after the recompute" if recompute else f"token #{e.num_output_tokens}")
        took = (f" The step took {ms(timed.wall_time_s)}.{capture_note(timed)}{yielded_note(timed)}"
                if timed is not None else "")
        if verification is not None and timed is not None:  # the step's wall time holds the drafting too
            took = (f" The step, drafting included, took {ms(timed.wall_time_s)}.{capture_note(timed)}"
                    f"{yielded_note(timed)}")
        if verification is not None:
            n_query = verification.num_query_tokens or 1 + len(verification.draft_tokens)
            text += (f" It was kept by the verification above: {n_query} tokens of this sequence went through the "
                     f"layers in this step's one forward pass.{took}")
        elif speculative:
            text += " It was kept by the same verification pass."
        elif entry is not None and entry.kind == "decode" and entry.num_tokens == 1:
            per_token = self.info.get("kv_bytes_per_token")
            ctx = e.position
            text += (f"{took} This sequence ran one new token through the layers; its query read the keys and values "
                     f"of its {plural(ctx, 'token')} so far from the KV cache"
                     + (f", {ctx} x {per_token:,} = {ctx * per_token:,} bytes{self._ranks(ctx * per_token)}: reads of "
                        "its own, which batching "
                        "with other sequences does not share." if per_token else "."))
            text += self._bandwidth_share(timed)
        if verification is None and not speculative:  # a step that could have verified drafts and had none
            why = draft_limits_sentence(entry, self.info.get("speculative_model"), plan, self._entry_name)
            text += f" It ran without drafts.{why}" if why else ""
        if state is not None and self.max_decode is not None and state.decode_told == self.max_decode and not last:
            # its last token (the request finishes in this step) has no later ones to promise (trial 37e)
            text += " (Later tokens of this request are summed up when it finishes.)"
        notes = tuple("chosen" if t.token_id == e.token_id else "" for t in e.top)
        name = self._name(e.request_id, e.index)
        # a token the prefill's last position chose is filed under the decode kind (filters, tutorial demos) but
        # headed by what made it: no decode step did (trial 42a)
        heading = ("first token" if e.num_output_tokens == 1 else "token after recompute" if recompute else "")
        return [Commentary("decode", f"{name[0].upper()}{name[1:]}, {which}: {piece}", text, request_id=e.request_id,
                           step=e.step, table=tuple((t.text, t.prob) for t in e.top), table_title=caption,
                           table_notes=notes if any(notes) else (), heading=heading)]

    def _bandwidth_share(self, timed: ev.StepTimed | None) -> str:
        """For a step of one token: its weight bytes over its wall time against the measured bandwidth.

        ``linear_weight_bytes`` (linear layers and LM head, as stored) read once in ``wall_time_s``
        is the rate the step reached; at the machine's measured ``memory_bandwidth`` reading them
        takes ``bytes / bandwidth``, and the rest of the step is time spent on anything else.
        Empty when the step ran more than one token or a figure is unknown; for a step the X-Ray
        traced, a sentence saying why no rate is told.
        """
        weights, bw = self.info.get("linear_weight_bytes"), self.info.get("memory_bandwidth")
        if timed is None or timed.num_tokens != 1 or not weights or not bw or timed.wall_time_s <= 0:
            return ""
        if getattr(timed, "traced", False):  # trial 12: the capture's time was put down to norms, RoPE, attention...
            return (" No weight-reading rate is told for this step: the X-Ray's capture is in its time, and a rate "
                    "over it would be the capture's as much as the engine's.")
        n = tp_size(self.info)
        if n > 1:  # linear_weight_bytes is rank 0's shard, and the other ranks read theirs from the same memory
            return (f" No weight-reading rate is told for this step: split over {n} ranks, each read its own shard "
                    f"of the weights at once (rank 0's is {human_bytes(weights)}), so one rank's rate is not the "
                    "machine's.")
        floor = weights / bw
        busy = (" (measured while the host was busy, so likely low)"
                if "host was busy" in str(self.info.get("machine") or "") else "")
        return (f" Alone in its step, it read the {human_bytes(weights)} of linear-layer and LM-head weights "
                f"at {weights / timed.wall_time_s / 1e9:,.2f} GB/s, {weights / timed.wall_time_s / bw:.0%} of this "
                f"machine's measured {bw / 1e9:,.1f} GB/s{busy}: reading them at {bw / 1e9:,.1f} GB/s takes "
                f"{ms(floor)}, so the other {ms(max(0.0, timed.wall_time_s - floor))} of the step were not spent "
                "reading weights at that rate: norms, RoPE, attention, the KV write, sampling, the calls between operations, or "
                "reading them slower.")

    def _kv_cache(self, t: ev.StepTimed, blocks: ev.BlocksChanged | None) -> list[Commentary]:
        """The ``kv_cache`` entry: blocks reserved and bytes they reserve, tokens stored and their bytes.

        Told when the number of blocks in use changed, or after every step with ``kv_every_step``
        (then a step that took no block says so).
        """
        same = t.num_blocks_used == self._last_blocks_used
        if same and not self.kv_every_step:
            return []
        self._last_blocks_used = t.num_blocks_used
        per_block = (blocks.bytes_per_block if blocks is not None else
                     t.kv_bytes_used // t.num_blocks_used if t.num_blocks_used else None)
        cached = ""
        if t.num_blocks_cached:
            one = t.num_blocks_cached == 1
            cached = (f" {plural(t.num_blocks_cached, 'freed block')} {'keeps its' if one else 'keep their'} contents "
                      "for prefix-cache reuse.")
        if self._contiguous:
            return self._kv_region(t, blocks, same)
        if t.num_blocks_used == 0:
            free = t.num_blocks_total - t.num_blocks_cached
            if t.num_blocks_cached:  # the Dashboard's split, free and cached-free (trial 35c: "all 512 are free" beside
                one = t.num_blocks_cached == 1  # its "cached-free 2 · free 510")
                every = (f"{plural(free, 'block')} {agree(free, 'is', 'are')} free and {t.num_blocks_cached:,} "
                         f"cached-free: freed, {'it keeps its' if one else 'they keep their'} contents for prefix-cache "
                         "reuse until a request takes " + ("it" if one else "them"))
                cached = ""
            else:
                every = ("the pool's one block is free" if t.num_blocks_total == 1 else  # not "all 1 blocks" (35e)
                         f"all {t.num_blocks_total:,} blocks are free")
            text = f"No request holds KV blocks now: {every}.{cached}"
            return [Commentary("kv_cache", "KV cache: empty", text, step=t.step)]
        change = " No block was taken or freed in this step." if same else ""
        text = (f"Live requests now hold {plural(t.num_blocks_used, 'block')}"
                + (f" x {per_block:,} bytes" if per_block else "")
                + f" = {t.kv_bytes_used:,} bytes ({human_bytes(t.kv_bytes_used)}) reserved, of the pool's "
                f"{human_bytes(t.kv_bytes_total)} ({t.num_blocks_used:,} of {t.num_blocks_total:,} blocks in use)"
                + ("." if tp_size(self.info) <= 1 else
                   f". These bytes are totals across {tp_size(self.info)} ranks: each rank holds its own KV heads' "
                   f"slice of every block, {human_bytes(t.kv_bytes_used / tp_size(self.info))} of the reserved bytes "
                   f"and {human_bytes(t.kv_bytes_total / tp_size(self.info))} of the pool."))
        title = (f"KV cache: {human_bytes(t.kv_bytes_used)} reserved in {plural(t.num_blocks_used, 'block')}"
                 + (f" across {tp_size(self.info)} ranks" if tp_size(self.info) > 1 else ""))
        if blocks is not None and blocks.tables:
            fp = kv_footprint(blocks)
            if fp.blocks == t.num_blocks_used:
                text += (f" Their tokens store {plural(fp.tokens, 'token')} x {fp.bytes_per_token:,} bytes = "
                         f"{fp.stored_bytes:,} bytes ({human_bytes(fp.stored_bytes)}"
                         f"{self._ranks(fp.stored_bytes, human_bytes)}) of keys and values"
                         + ("." if not fp.empty_slots else
                            f"; the other {plural(fp.empty_slots, 'slot')} {agree(fp.empty_slots, 'is', 'are')} "
                            "reserved but still empty."))
                title += f", {human_bytes(fp.stored_bytes)} stored"
        text += change + cached
        if blocks is None:  # the app asks for snapshots only while its Narrator or Block Map tab is open
            text += (" No snapshot of the block tables came with this step, so the bytes its tokens store "
                     "are not told here.")
            if self.info.get("speculative_model"):  # trial 44e: 4 blocks for 48 tokens beside "ran without drafts"
                text += (" With speculative decoding a sequence may hold a block none of its tokens fill yet: before "
                         "each step the scheduler reserves slots for its newest token and up to k drafts, taking a "
                         "block when they need one, and only rejected drafts give blocks back, so a step whose "
                         "proposer drafted none keeps it for the tokens to come.")
        if blocks is not None and blocks.tables:
            shown = []
            for tb in blocks.tables[:MAX_TABLES_SHOWN]:
                free = max(0, len(tb.block_table) * blocks.block_size - tb.num_computed_tokens)
                shared = [b for b in tb.block_table if b < len(blocks.ref_counts) and blocks.ref_counts[b] > 1]
                shown.append(f"{self._name(tb.request_id, tb.index)} keeps {plural(tb.num_computed_tokens, 'token')} "
                             f"in blocks {list(tb.block_table)} ({plural(free, 'slot')} still empty"
                             + self._ahead(tb, blocks.block_size)
                             + (f"; {list(shared)} shared with another sequence" if shared else "") + ")")
            text += " Block tables: " + "; ".join(shown)
            if len(blocks.tables) > MAX_TABLES_SHOWN:
                text += f"; and {len(blocks.tables) - MAX_TABLES_SHOWN} more"
            text += "."
        return [Commentary("kv_cache", title, text, step=t.step)]

    def _kv_region(self, t: ev.StepTimed, blocks: ev.BlocksChanged | None, same: bool) -> list[Commentary]:
        """The contiguous baseline's ``kv_cache`` entry: the running request's one region, reserved up front
        (its slots are the pool's blocks it was given at admission; the unfilled ones are waste)."""
        bs = blocks.block_size if blocks is not None else self.info.get("block_size", 0)
        room = t.num_blocks_total * bs
        if t.num_blocks_used == 0:
            text = f"No request holds a KV region now: all the room for {room:,} tokens is free."
            return [Commentary("kv_cache", "KV cache: empty", text, step=t.step)]
        slots = t.num_blocks_used * bs
        text = (f"The running request holds one contiguous KV region of {plural(slots, 'slot')} = {t.kv_bytes_used:,} "
                f"bytes ({human_bytes(t.kv_bytes_used)}), reserved up front when it was admitted for its prompt plus "
                f"max_tokens{self._reservation_sum(blocks, slots, bs)}, whether filled or not ({slots:,} of the "
                f"{room:,} slots of room in use).")
        title = f"KV cache: {human_bytes(t.kv_bytes_used)} reserved up front"
        if blocks is not None and blocks.tables:
            fp = kv_footprint(blocks)
            text += (f" It stores {plural(fp.tokens, 'token')} x {fp.bytes_per_token:,} bytes = {fp.stored_bytes:,} bytes "
                     f"({human_bytes(fp.stored_bytes)}) of keys and values"
                     + ("." if not fp.empty_slots else
                        f"; the other {plural(fp.empty_slots, 'slot')} {agree(fp.empty_slots, 'is', 'are')} "
                        f"reserved but still empty. {self._paged_would_hold(fp.tokens, slots, bs)}"))
            title += f", {human_bytes(fp.stored_bytes)} stored"
        if same:
            text += " The region does not grow: nothing was taken or freed in this step."
        return [Commentary("kv_cache", title, text, step=t.step)]

    def _reservation_sum(self, blocks: ev.BlocksChanged | None, slots: int, bs: int) -> str:
        """``" (5 + 4 = 9 tokens, rounded up to 1 whole block of 16)"``: the running request's reservation
        (``Scheduler.reservation``: prompt + max_tokens, capped at max_model_len) and how the region's size
        follows from it (trial 30e: "16 slots ... for its prompt plus max_tokens" of a 5 + 4 request);
        "" when the narrator does not know the request (attached mid-run)."""
        if blocks is None or not blocks.tables or not bs:
            return ""
        request = self._requests.get(blocks.tables[0].request_id)
        if request is None or request.max_tokens is None:
            return ""
        want = request.num_prompt_tokens + request.max_tokens
        cap = self.info.get("max_model_len") or None
        capped = contiguous_reservation(request.num_prompt_tokens, request.max_tokens, cap)
        if -(-capped // bs) * bs != slots:  # not the reservation this rule gives (a recompute's longer sequence)
            return ""
        sum_ = f"{request.num_prompt_tokens} + {request.max_tokens} = {want} tokens"
        if capped != want:
            sum_ += f", capped at max_model_len {cap}"
        blocks_n = slots // bs
        rounded = "" if capped == slots else f", rounded up to {plural(blocks_n, 'whole block')} of {bs}"
        return f" ({sum_}{rounded})"

    @staticmethod
    def _paged_would_hold(stored: int, slots: int, bs: int) -> str:
        """What paged attention would hold for the same tokens now (a block taken only as one fills): the
        region's empty slots beyond that are the waste paging avoids; the ones in its last block it leaves
        empty too (trial 30e: 11 empty slots of a one-block region were called "the waste that paged
        attention avoids", though a paged engine holds the same block)."""
        held = -(-stored // bs) * bs if bs else slots
        avoided = slots - held
        if avoided <= 0:
            return (f"Paged attention would hold the same {plural(held // bs, 'block')} for these tokens now, with "
                    "the same slots empty: at this step the region wastes no more than paging would.")
        tail = held - stored
        return (f"Paged attention would hold only {plural(held // bs, 'block')} ({held} slots) for these tokens now, "
                f"taking a block only when one fills: {avoided} of the empty slots are the waste it avoids"
                + (f"; the other {tail}, in its last block, it would leave empty too." if tail else "."))

    @staticmethod
    def _cached_summary(e: ev.RequestFinished) -> str:
        """A finish's prefix-cache hits: the first admission's, and a readmission's apart (trial 14c #2).

        The first admission's count is of prompt tokens (vLLM's ``num_cached_tokens``); a readmission
        after a preemption can find more (such as its own full blocks, kept cached-free), generated
        tokens among them. The Dashboard's cached column shows the first (trial 24d #3).
        """
        first, again = e.num_cached_prompt_tokens, getattr(e, "num_cached_tokens_readmitted", None)
        prompt = plural(e.num_prompt_tokens, "prompt token")
        if again is None:  # never readmitted (or a trace from before the field): one admission to tell
            if not first:
                return ""
            at = " at its first admission" if e.num_preemptions else ""
            return f" {first} of its {prompt} came from the prefix cache{at}."
        if not first and not again:
            return ""
        told = (f" At its first admission {first} of its {prompt} came from the prefix cache" if first else
                f" At its first admission none of its {prompt} were in the prefix cache")
        which = "its readmission" if e.num_preemptions == 1 else "the readmission that found the most"
        if not again:
            return told + f"; after its preemption, {which} found none there."
        # a hit is a prefix: its first num_prompt_tokens are prompt tokens, the rest generated (trial 17b #2)
        in_prompt = min(again, e.num_prompt_tokens)
        made = again - in_prompt
        what = (("all of them prompt tokens" if again > 1 else "a prompt token") if not made else
                f"{in_prompt} prompt + {made} generated")
        return told + f"; after its preemption, {which} found {plural(again, 'token')} there ({what})."

    @staticmethod
    def _why(reason: str, stop_reason: str | int | None) -> str:
        if reason == "stop":
            if stop_reason is None:
                return "it produced an end-of-sequence token"
            if isinstance(stop_reason, int):
                return f"it produced stop token {stop_reason}"
            return f"its text reached the stop string {stop_reason!r}"
        return {"length": "it reached its token limit", "abort": "it was aborted",
                "error": "an engine error ended it"}.get(reason, reason)

    def _aborted_blocks(self, e: ev.RequestFinished) -> str:
        """What an abort did to the KV pool, from the newest block tables (trial 12: the narrator said nothing).

        An abort happens between steps, so the tables after the last step are the ones it changed.
        A block another request also holds (a prefix-cache hit) stays in use by that request. With no tables
        (none was asked for while it ran), from the pool's counts before and after it (``StepTimed``, then the
        event's ``kv_blocks_used`` / ``kv_blocks_cached``; trial 40e: "its KV blocks, if it held any" where the
        entry before had said 2 blocks were in use).
        """
        request_id = e.request_id
        before, after = self._pool_counts, None
        if e.kv_blocks_used is not None:
            after = (e.kv_blocks_used, e.kv_blocks_cached or 0)
            self._pool_counts = after  # a second abort before the next step starts from this one's pool
        pool = self._last_pool
        if pool is None:
            if before is None or after is None:
                return (" Its KV blocks, if it held any, were released at once: a block another request shares (a "
                        "prefix-cache hit) stays in use by that request.")
            released, kept = before[0] - after[0], after[1] - before[1]
            if released <= 0:
                return (" No block in use went back to the pool: it held none of its own (it was waiting, or "
                        "another request shares every block it held).")
            return (f" The pool's blocks in use went from {before[0]} to {after[0]}: {plural(released, 'KV block')} "
                    f"released at once" + (f", {kept} of them kept as cached-free for prefix-cache reuse"
                                           if 0 < kept < released else ", kept as cached-free for prefix-cache reuse"
                                           if kept >= released else "")
                    + " (a block another request shares stays in use by it).")
        tables = [t for t in pool.tables if t.request_id == request_id]
        ids = sorted({b for t in tables for b in t.block_table})
        if not ids:
            return " It held no KV blocks (it was waiting), so the pool did not change."
        shared = [b for b in ids if pool.ref_counts[b] > sum(b in t.block_table for t in tables)]
        back = len(ids) - len(shared)
        # a second abort before the next step sees the pool as this one left it
        refs = list(pool.ref_counts)
        for t in tables:
            for b in t.block_table:
                refs[b] -= 1
        self._last_pool = dataclasses.replace(pool, ref_counts=tuple(refs),
                                              tables=tuple(t for t in pool.tables if t.request_id != request_id))
        text = f" Its {plural(len(ids), 'KV block')} {ids} {agree(len(ids), 'was', 'were')} released at once"
        if shared:
            text += (f": {plural(len(shared), 'block')} {shared} {agree(len(shared), 'is', 'are')} shared with another "
                     f"request through the prefix cache and {agree(len(shared), 'stays', 'stay')} in use by it, "
                     + (f"the other {back} went back to the pool" if back else "so none went back to the pool"))
        else:
            text += f": {agree(back, 'it went', 'all went')} back to the pool"
        if back and self.info.get("prefix_caching") is not False:
            # trial 19a: a full block whose tokens another block already holds (two requests prefilled the same
            # prefix in one step) goes back empty, as the preemption sentence says
            text += (" (a full block keeps its contents as cached-free, for prefix-cache reuse, unless another block "
                     "already holds the same tokens: then it is simply freed)")
        return text + "."

    def _prefill_reached(self, e: ev.RequestFinished) -> str:
        """For a request aborted in the middle of its prefill: how far its prompt's K/V had got (trial 43e: "after
        0 tokens" and nothing else, where the Dashboard row showed 48/72 prefilled); "" otherwise, and when the
        narrator did not see its steps or a preemption had dropped them (then it held no K/V)."""
        if e.finish_reason != "abort" or e.num_output_tokens or len(e.samples) > 1:
            return ""
        done = max((self._computed[q] for q, r in self._request_of.items() if r == e.request_id and q in self._computed),
                   default=0)
        total, cached = e.num_prompt_tokens, e.num_cached_prompt_tokens or 0
        if not done or done >= total:
            return ""
        # the hits counted are the first admission's: after a preemption the split is not known
        how = ("" if e.num_preemptions else
               f" ({cached} found in the prefix cache, {done - cached} computed by its prefill)" if 0 < cached < done
               else " (found in the prefix cache)" if cached >= done else "")
        return (f" It was aborted in the middle of its prefill: {done} of its {total} prompt tokens had their keys "
                f"and values in the KV cache{how}; prompt tokens {done}..{total - 1} were never run, and no token was "
                "sampled.")

    def _finished(self, e: ev.RequestFinished) -> Commentary:
        state = self._requests.pop(e.request_id, None)
        reached = self._prefill_reached(e)
        self._forget(e.request_id)
        text = (f"Request {e.request_id} finished ({e.finish_reason}): {self._why(e.finish_reason, e.stop_reason)} after "
                f"{plural(e.num_output_tokens, 'token')}: {e.output_text!r}.")
        text += reached
        if len(e.samples) > 1:
            text = (f"Request {e.request_id} finished: all {len(e.samples)} samples are done. "
                    + " ".join(f"Sample {x.index} ({x.finish_reason}, {plural(len(x.token_ids), 'token')}): {x.text!r}."
                               for x in e.samples))
        held = (f", {ms(e.paused_s)} of it with the engine held paused, which TTFT and TPOT leave out"
                if e.paused_s and e.e2e_s is not None else "")  # trial 11: the three did not add up
        text += (f" Time to first token {ms(e.ttft_s)}, time per output token {ms(e.tpot_s)}, end to end {ms(e.e2e_s)}"
                 + (f" (wall time{held})" if held else "")
                 + (" (sample 0's times)." if len(e.samples) > 1 else "."))
        if e.tpot_s is not None:  # trial 36a: a 64.2 ms TPOT beside steps of 26.6 and 52.9 ms, with no word why
            text += (" TPOT and end to end are wall-clock spans between tokens, so they also hold the time between "
                     "steps (scheduling, detokenizing, and whatever the program does there, such as printing this "
                     "narration), not only the steps' own times.")
        if (state is not None and state.first_step_s is not None and e.ttft_s is not None
                and e.ttft_s < state.first_step_s and ms(e.ttft_s) != ms(state.first_step_s)):  # shown apart (38a)
            # trial 37a: "Time to first token 867.8 ms" after "The step took 876.5 ms" for the step that made it
            text += (f" TTFT is shorter than the {ms(state.first_step_s)} of the step that made the first token: a "
                     "token's time is taken when its step's sampling ends, and the step's time also holds the "
                     "output processing after it (detokenizing, stop checks, events), as vLLM stamps its tokens.")
        text += self._cached_summary(e)
        if e.num_preemptions:
            text += f" It was preempted {plural(e.num_preemptions, 'time')}."
        if state is not None and state.decode_untold:
            text += (f" {agree(state.decode_untold, '1 of its tokens was', f'{state.decode_untold} of its tokens were')} "
                     "not narrated one by one"
                     + (f", nor {plural(state.verify_untold, 'later speculative verification')}"
                        if state.verify_untold else "") + ".")
        if e.finish_reason == "abort":
            text += self._aborted_blocks(e)
        if e.error:
            text += f" Error: {e.error}"
        # an abort before any step ran (while the model loads, or paused before the first) names no step: its event
        # carries step 0, the first step's number, and no step 0 had run (trial 45e)
        return Commentary("finished", f"Request {e.request_id} finished: {e.finish_reason}", text,
                          request_id=e.request_id, step=e.step if self._step_ended else None)
