"""The scheduler: each engine step, decide which sequences run and how many tokens each.

It follows vLLM's V1 scheduler but for one rule of the ``priority`` policy (a waiting request's
preemption of running ones, below): continuous batching (Yu et al. 2022 "Orca" iteration-level
scheduling), one *token budget* per step shared by prefill and decode, *running* sequences
served first (a decode costs one token; an unfinished prefill continues with its next
chunk), then *waiting* ones admitted in policy order while budget, ``max_num_seqs`` and KV
blocks last. A prompt longer than the remaining budget is prefilled in chunks over several
steps (chunked prefill, Agrawal et al. 2023 "SARATHI"); the running sequences served before
a chunk keep decoding, and one served after a chunk that used the whole budget waits a step.

Preemption by recompute (Kwon et al. 2023, section 4.5): when a running sequence needs more
blocks than are free (one for a decode, several for a chunk), the least important running sequence (lowest priority, latest
arrival) gives up all its blocks and goes back to the front of the waiting queue, keeping
the tokens it has generated; when readmitted, its full blocks still in the prefix cache are
reused and only the rest is computed (recomputed, apart from tokens it never computed, its newest at least). Under the ``priority`` policy a waiting request may also preempt running ones of
lower priority when blocks are short (``_preempt_for``). That rule is not vLLM V1's: V1 preempts only for a running
request, and a waiting request that gets no blocks just waits (its waiting loop stops: ``if new_blocks is None: break``);
preempting for a waiting request of higher priority was vLLM V0's (``_schedule_priority_preemption``).

Speculative decoding (``num_speculative_tokens`` = k > 0): a sequence in decode is planned
with ``1 + k`` tokens (its newest token plus up to k draft slots), all counted against the
token budget, with blocks reserved for them. Fewer drafts when the budget (after one token
for every other running sequence), ``max_tokens`` or ``max_model_len`` leave less room, and
only as many as the blocks free once every running sequence's own tokens fit (after any
preemption for them) can hold: drafts never preempt or starve another sequence. Each
sequence's plan names what held its drafts below k (``draft_limits``), for the views.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from nanovllm_core.engine.block_manager import BlockManager
from nanovllm_core.engine.sequence import Sequence, SequenceStatus
from nanovllm_core.sampling_params import contiguous_reservation


# Why a sequence that could speculate got fewer than k drafts in a step (``ScheduledSequence.draft_limits``):
# the scheduler's reasons for fewer draft slots, then the speculator's for fewer drafts than slots.
DRAFT_LIMITS = {
    "budget": "the step's token budget left fewer slots (after one token for every later running sequence)",
    "max_tokens": "the request's max_tokens leaves fewer tokens to generate",
    "max_model_len": "max_model_len leaves fewer positions",
    "kv_blocks": "more slots would need a KV block that is not free (drafts never preempt)",
    "proposer": "the proposer proposed fewer (an n-gram proposer: no earlier match, or one near the end)",
    "min_tokens": "a draft was a token the request bans at its position (min_tokens), so the drafts stop before it",
    "failed_step": "the step's batched forward pass failed and each sequence was retried alone without drafts",
}


# Why the head of the waiting queue was not admitted in a step (``SchedulerOutput.wait_reason``); the
# sequences behind it wait behind it (admission is in policy order and stops at the first that cannot go).
WAIT_REASONS = {
    "preempted": "the step preempted a running sequence, and a step that preempts admits no one after that",
    "max_num_seqs": "max_num_seqs sequences are running",
    "budget": "the step's token budget is used up",
    "chunked_prefill_off": "its prompt does not fit the budget left and chunked prefill is off",
    "kv_blocks": "too few free KV blocks for it (and, under the priority policy, no lower-priority running "
                 "sequences whose blocks would be enough)",
    "kv_run": "the contiguous baseline: enough KV blocks are free in all, but no run of adjacent ones holds its "
              "whole reservation (external fragmentation, which block tables avoid)",
}


@dataclass
class ScheduledSequence:
    """One sequence's part of a step.

    ``num_new_tokens``: tokens it runs through the model this step; ``kind``: ``"prefill"``
    (a prompt chunk, or a recompute after preemption) or ``"decode"``; ``samples``: whether
    this step ends at its last token, so a new token is sampled; ``num_cached_tokens``:
    prompt tokens served from the prefix cache when it was admitted in this step;
    ``num_cached_blocks_in_use``: how many of those hit blocks another sequence was holding when
    they were shared (ref count above 0); the rest were cached-free (None: not admitted this step).
    ``num_cached_blocks_own``: at a readmission after a preemption, how many of the cached-free hit
    blocks are the very blocks (same id, same position) it held when it was preempted; the other
    cached-free hits were another request's, holding the same tokens (None: not a readmission).

    Speculative decoding: ``num_spec_tokens`` draft slots are reserved (and counted in
    ``num_new_tokens``); the engine then puts the proposed drafts in ``spec_tokens`` and sets
    ``num_new_tokens = 1 + len(spec_tokens)`` before the forward pass. ``max_drafts``: k when the
    sequence could speculate this step (one uncomputed token), else 0; ``draft_limits``: why it got
    fewer than ``max_drafts`` drafts, from :data:`DRAFT_LIMITS` in the order they applied (the
    scheduler's for the slots, then the speculator's for the drafts proposed).

    ``budget_left``: tokens of the step's budget still unplanned when this sequence's turn came
    (before its own tokens and draft slots; after any preemption its turn caused); ``plan_order``:
    its place in the order the scheduler planned the step (0 first; ``scheduled`` is sorted decodes
    first, which loses it). With them the views can say what a budget limit was made of, draft slots
    reserved before the proposer ran included (trial 24d #1). They record; they decide nothing.
    """

    seq: Sequence
    num_new_tokens: int
    kind: str
    samples: bool
    start: int  # num_computed_tokens before this step
    num_cached_tokens: int = 0
    num_cached_blocks_in_use: int | None = None
    num_cached_blocks_own: int | None = None
    num_spec_tokens: int = 0
    spec_tokens: list[int] = field(default_factory=list)
    max_drafts: int = 0
    draft_limits: tuple[str, ...] = ()
    budget_left: int | None = None
    plan_order: int | None = None


@dataclass
class Shortfall:
    """Why a sequence was preempted: ``needer`` needed ``blocks_needed`` more KV blocks and only ``blocks_free`` were free.

    ``blocks_free`` counts empty and cached-free blocks just before this victim gave its
    blocks back (for a waiting ``needer``, less any cached-free blocks its own prefix hit
    takes); ``waiting``: the needer was a waiting request (priority policy) rather than a
    running one. The needer can be the victim itself.
    """

    needer: Sequence
    blocks_needed: int
    blocks_free: int
    waiting: bool = False


@dataclass
class SchedulerOutput:
    """One step's plan.

    ``scheduled`` in order (decodes first, then prefill chunks); ``preempted``: sequences
    that lost their blocks this step, in order; ``token_budget`` and ``num_batched_tokens``
    in tokens; ``admitted``: sequences moved from waiting to running this step;
    ``shortfalls``: why each preemption happened, one :class:`Shortfall` per preempted
    sequence, in the same order. ``wait_reason``: why the first sequence still waiting was not
    admitted (:data:`WAIT_REASONS`; "" when none waits). ``wait_blocks``: for ``"kv_run"``, the blocks
    free in all, the adjacent blocks its reservation needs, and the longest run of adjacent free blocks
    (``()`` otherwise).
    """

    step: int
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    admitted: list[Sequence]
    token_budget: int
    num_batched_tokens: int
    shortfalls: list[Shortfall] = field(default_factory=list)
    wait_reason: str = ""
    wait_blocks: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Plans steps over a waiting queue and a running set, with a :class:`BlockManager`.

    Args:
        block_manager: the KV pool.
        max_num_seqs: most sequences running at once.
        token_budget: tokens per step (``max_num_batched_tokens``).
        policy: ``"priority"`` or ``"fcfs"``.
        enable_chunked_prefill: when False, a prompt runs whole in one step or waits.
        num_speculative_tokens: draft slots per decode, k (0 = no speculative decoding).
        max_model_len: longest sequence in tokens (caps draft slots and reservations; None = no cap).
        reserve_up_front: the contiguous baseline (``paged=False``): a sequence takes, when admitted,
            the KV slots of the longest it may grow (:meth:`reservation`), not a block at a time, as one
            run of adjacent physical blocks (first fit, :meth:`BlockManager.allocate_run`); with no run
            long enough it waits (``"kv_run"``) even when enough blocks are free in all.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, token_budget: int,
                 policy: str = "priority", enable_chunked_prefill: bool = True,
                 num_speculative_tokens: int = 0, max_model_len: int | None = None,
                 reserve_up_front: bool = False) -> None:
        self.block_manager = block_manager
        self.reserve_up_front = reserve_up_front
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._shortfalls: list[Shortfall] = []  # this step's, filled by _preempt
        self.step_index = 0
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len

    # ------------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        """Put a sequence in the waiting queue, in policy order."""
        seq.status = SequenceStatus.WAITING if seq.metrics.num_preemptions == 0 else SequenceStatus.PREEMPTED
        bisect.insort_right(self.waiting, seq, key=lambda s: s.sort_key(self.policy))

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of its queue and release its blocks (finish or abort; a shared block stays in use)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def reservation(self, seq: Sequence) -> int:
        """Tokens the contiguous baseline reserves for ``seq`` at admission: prompt + ``max_tokens``
        (absent: ``max_model_len``), capped at ``max_model_len``; what a pre-paging server set aside
        per request (Kwon et al. 2023, section 3). ``add_request`` refuses a request whose reservation
        is larger than the pool, so one that waits is admitted once the running one ends."""
        return max(seq.num_tokens, contiguous_reservation(seq.num_prompt_tokens, seq.params.max_tokens,
                                                          self.max_model_len))

    def _admission_tokens(self, seq: Sequence, num_tokens: int) -> int:
        """Tokens whose blocks admitting ``seq`` takes: those it runs now (``num_tokens``), or in the
        contiguous baseline its whole :meth:`reservation`."""
        return max(num_tokens, self.reservation(seq)) if self.reserve_up_front else num_tokens

    def _fits(self, seq: Sequence, num_tokens: int, cached: list[int] = ()) -> bool:
        """Can ``seq`` be given blocks for ``num_tokens`` tokens now? In the contiguous baseline a
        sequence without blocks needs one run of adjacent free blocks (cached hits: none, prefix
        caching is off there)."""
        bm = self.block_manager
        if self.reserve_up_front and not seq.block_table:
            return bm.find_free_run(bm.blocks_needed(num_tokens)) is not None
        return bm.can_allocate(seq, num_tokens, cached)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning

    def _victim(self) -> Sequence:
        """The running sequence to preempt: lowest priority, then latest arrival (fcfs: latest arrival)."""
        if self.policy == "priority":
            return max(self.running, key=lambda s: (-s.priority, s.arrival))
        return max(self.running, key=lambda s: s.arrival)

    def _preempt(self, seq: Sequence, plan: dict[int, ScheduledSequence], out: list[Sequence],
                 why: Shortfall | None = None) -> int:
        """Free ``seq``'s blocks and requeue it; return the budget it had taken this step.

        ``why`` (the shortfall that made it the victim) is kept for the step's plan.
        """
        if why is not None:
            self._shortfalls.append(why)
        self.running.remove(seq)
        seq.preempted_block_table = list(seq.block_table)  # whose blocks its readmission's hits are
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.add(seq)
        out.append(seq)
        taken = plan.pop(seq.seq_id, None)
        return taken.num_new_tokens if taken else 0

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. See the module docstring for the rules."""
        bm = self.block_manager
        budget = self.token_budget
        plan: dict[int, ScheduledSequence] = {}
        preempted: list[Sequence] = []
        admitted: list[Sequence] = []
        self._shortfalls = []
        order = itertools.count()  # planning order, for the views (ScheduledSequence.plan_order)

        # 1. Running sequences, most important first: decodes and unfinished prefill chunks.
        if self.policy == "priority":
            self.running.sort(key=lambda s: s.sort_key("priority"))
        queue = list(self.running)
        for i, seq in enumerate(queue):
            if seq.status is not SequenceStatus.RUNNING or budget <= 0:
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq, seq.num_computed_tokens + num_new):
                victim = self._victim()
                why = Shortfall(seq, bm.new_blocks_needed(seq, seq.num_computed_tokens + num_new, ()),
                                bm.num_free_blocks)
                budget += self._preempt(victim, plan, preempted, why)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            # Draft slots come out of the budget left once every later running sequence has its one token
            # (counted only when the budget could bind: counting every step is quadratic in the batch); their
            # blocks are taken below, once every running sequence's own tokens have theirs.
            later = 0
            if self.num_speculative_tokens and budget - num_new - (len(queue) - i - 1) < self.num_speculative_tokens:
                later = sum(1 for other in queue[i + 1:] if other.status is SequenceStatus.RUNNING)
            num_spec, limits = self._num_spec_tokens(seq, budget - num_new - later)
            bm.allocate(seq, seq.num_computed_tokens + num_new)
            plan[seq.seq_id] = self._scheduled(seq, num_new, num_spec=num_spec)
            plan[seq.seq_id].budget_left, plan[seq.seq_id].plan_order = budget, next(order)
            if seq.num_uncomputed_tokens == 1 and self.num_speculative_tokens:
                plan[seq.seq_id].max_drafts = self.num_speculative_tokens
                plan[seq.seq_id].draft_limits = limits
            budget -= num_new + num_spec
        budget += self._reserve_draft_blocks(plan)

        # 2. Waiting sequences, in policy order, unless this step already had to preempt. Why the head of
        # the queue left waiting was not admitted is kept for the views (``SchedulerOutput.wait_reason``).
        wait_reason = ""
        wait_blocks: tuple[int, ...] = ()
        while self.waiting:
            if preempted:
                wait_reason = "preempted"
                break
            if len(self.running) >= self.max_num_seqs:
                wait_reason = "max_num_seqs"
                break
            if budget <= 0:
                wait_reason = "budget"
                break
            seq = self.waiting[0]
            cached = bm.find_cached_prefix(seq)
            num_computed = len(cached) * bm.block_size
            num_new = seq.num_tokens - num_computed
            if not self.enable_chunked_prefill and num_new > budget:
                wait_reason = "chunked_prefill_off"
                break
            num_new = min(num_new, budget)
            # What admission takes: the blocks of the tokens run now, or (contiguous baseline) the whole reservation.
            need = self._admission_tokens(seq, num_computed + num_new)
            if not self._fits(seq, need, cached):
                if not self._preempt_for(seq, need, cached, plan, preempted):
                    if self.reserve_up_front and bm.can_allocate(seq, need, cached):
                        # Enough blocks free in all, but not side by side: the baseline's external fragmentation.
                        wait_reason = "kv_run"
                        wait_blocks = (bm.num_free_blocks, bm.blocks_needed(need), bm.longest_free_run())
                    else:
                        wait_reason = "kv_blocks"
                    break
                budget = self.token_budget - sum(p.num_new_tokens for p in plan.values())
                if not self.enable_chunked_prefill and seq.num_tokens - num_computed > budget:
                    wait_reason = "chunked_prefill_off"
                    break
                num_new = min(seq.num_tokens - num_computed, budget)
                if num_new <= 0:
                    wait_reason = "budget"
                    break
            bm.record_lookup(seq.num_tokens, num_computed)
            in_use = sum(1 for b in cached if bm.blocks[b].ref_count > 0)  # held live, not cached-free
            former = seq.preempted_block_table
            own = (sum(1 for i, b in enumerate(cached) if i < len(former) and former[i] == b
                       and bm.blocks[b].ref_count == 0) if seq.metrics.num_preemptions else None)
            if self.reserve_up_front:  # one region of adjacent blocks, the whole reservation (no prefix hits)
                bm.allocate_run(seq, self._admission_tokens(seq, num_computed + num_new))
            else:
                bm.allocate(seq, self._admission_tokens(seq, num_computed + num_new), cached)
            self.waiting.pop(0)
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.num_preemptions == 0:
                seq.metrics.num_cached_prompt_tokens = num_computed
            else:  # a readmission: its hit can hold generated tokens too, so it is kept apart from the first
                seq.metrics.num_cached_tokens_readmitted = max(seq.metrics.num_cached_tokens_readmitted or 0,
                                                               num_computed)
            self.running.append(seq)
            admitted.append(seq)
            plan[seq.seq_id] = self._scheduled(seq, num_new, num_cached=num_computed)
            plan[seq.seq_id].num_cached_blocks_in_use = in_use
            plan[seq.seq_id].num_cached_blocks_own = own
            plan[seq.seq_id].budget_left, plan[seq.seq_id].plan_order = budget, next(order)
            budget -= num_new

        scheduled = sorted(plan.values(), key=lambda p: p.kind != "decode")
        out = SchedulerOutput(
            step=self.step_index,
            scheduled=scheduled,
            preempted=preempted,
            admitted=admitted,
            token_budget=self.token_budget,
            num_batched_tokens=sum(p.num_new_tokens for p in scheduled),
            shortfalls=self._shortfalls if len(self._shortfalls) == len(preempted) else [],
            wait_reason=wait_reason,
            wait_blocks=wait_blocks,
        )
        self.step_index += 1
        return out

    def _reserve_draft_blocks(self, plan: dict[int, ScheduledSequence]) -> int:
        """Take the blocks of the running sequences' draft slots, in plan order; return the budget given back.

        Only blocks free once every running sequence's own tokens have theirs, after any preemption
        for them: drafts never cost another sequence its blocks (trial 14c #3: slots sized before a
        preemption were dropped for the block it then freed, and a block taken for drafts could make
        a later running sequence preempt one). A sequence whose slots do not all fit gets as many as
        do, ``"kv_blocks"`` added to its ``draft_limits``; its unused slots go back to the budget.
        """
        bm = self.block_manager
        returned = 0
        for p in plan.values():
            if not p.num_spec_tokens:
                continue
            own = p.num_new_tokens - p.num_spec_tokens
            fit = p.num_spec_tokens
            while fit and not bm.can_allocate(p.seq, p.start + own + fit):
                fit -= 1
            if fit < p.num_spec_tokens:
                returned += p.num_spec_tokens - fit
                p.draft_limits += ("kv_blocks",)
                p.num_spec_tokens, p.num_new_tokens = fit, own + fit
            if fit:
                bm.allocate(p.seq, p.start + own + fit)
        return returned

    def _preempt_for(self, seq: Sequence, num_tokens: int, cached: list[int],
                     plan: dict[int, ScheduledSequence], preempted: list[Sequence]) -> bool:
        """Priority policy: preempt lower-priority running sequences until ``seq`` fits.

        Only when preempting all of them would be enough; otherwise nothing is touched.
        """
        if self.policy != "priority":
            return False
        bm = self.block_manager
        lower = sorted((s for s in self.running if s.priority < seq.priority),
                       key=lambda s: (s.priority, -s.arrival))
        freeable = sum(1 for s in lower for b in s.block_table if bm.blocks[b].ref_count == 1)
        shortfall = bm.new_blocks_needed(seq, num_tokens, cached) - bm.free_blocks_after_hits(cached)
        if not lower or freeable < shortfall:
            return False
        if self.reserve_up_front and not seq.block_table:  # the contiguous baseline: a run must come free
            released = {b for s in lower for b in s.block_table if bm.blocks[b].ref_count == 1}
            if bm.find_free_run(bm.blocks_needed(num_tokens), released) is None:
                return False
        for victim in lower:
            if self._fits(seq, num_tokens, cached):
                break
            why = Shortfall(seq, bm.new_blocks_needed(seq, num_tokens, cached), bm.free_blocks_after_hits(cached),
                            waiting=True)
            self._preempt(victim, plan, preempted, why)
        return self._fits(seq, num_tokens, cached)

    def _num_spec_tokens(self, seq: Sequence, budget_left: int) -> tuple[int, tuple[str, ...]]:
        """Draft slots for ``seq`` this step, and what held them below k (:data:`DRAFT_LIMITS`).

        k, or fewer where the budget (``"budget"``) or the request's limits (``"max_tokens"``,
        ``"max_model_len"``) leave less room; every limit that allows no more than the slots given
        is named. Only a sequence with exactly one uncomputed token (its newest) speculates (0, ()
        otherwise). The verification pass runs positions ``num_tokens - 1 .. num_tokens - 1 + drafts``,
        all below ``max_model_len``; drafts beyond ``max_tokens - 1`` more tokens could never be kept.
        """
        k = self.num_speculative_tokens
        if not k or seq.num_uncomputed_tokens != 1:
            return 0, ()
        room = {"budget": budget_left}
        if seq.params.max_tokens is not None:
            room["max_tokens"] = seq.params.max_tokens - seq.num_output_tokens - 1
        if self.max_model_len is not None:
            room["max_model_len"] = self.max_model_len - seq.num_tokens
        slots = max(0, min(k, *room.values()))
        return slots, tuple(name for name, r in room.items() if r <= slots < k)

    @staticmethod
    def _scheduled(seq: Sequence, num_new: int, num_cached: int = 0, num_spec: int = 0) -> ScheduledSequence:
        samples = seq.num_computed_tokens + num_new == seq.num_tokens
        kind = "decode" if (num_new == 1 and samples and seq.num_output_tokens > 0
                            and seq.num_computed_tokens == seq.num_tokens - 1) else "prefill"
        return ScheduledSequence(seq=seq, num_new_tokens=num_new + num_spec, kind=kind, samples=samples,
                                 start=seq.num_computed_tokens, num_cached_tokens=num_cached,
                                 num_spec_tokens=num_spec)
