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
reused and only the rest is recomputed. Under the ``priority`` policy a waiting request may also preempt running ones of
lower priority when blocks are short (``_preempt_for``). That rule is not vLLM V1's: V1 preempts only for a running
request, and a waiting request that gets no blocks just waits (its waiting loop stops: ``if new_blocks is None: break``);
preempting for a waiting request of higher priority was vLLM V0's (``_schedule_priority_preemption``).

Speculative decoding (``num_speculative_tokens`` = k > 0): a sequence in decode is planned
with ``1 + k`` tokens (its newest token plus up to k draft slots), all counted against the
token budget, with blocks reserved for them. Fewer drafts when the budget (after one token
for every other running sequence), ``max_tokens`` or ``max_model_len`` leave less room, and
none when the reservation would need a block that is not free: drafts never preempt or
starve another sequence.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from nanovllm_core.engine.block_manager import BlockManager
from nanovllm_core.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's part of a step.

    ``num_new_tokens``: tokens it runs through the model this step; ``kind``: ``"prefill"``
    (a prompt chunk, or a recompute after preemption) or ``"decode"``; ``samples``: whether
    this step ends at its last token, so a new token is sampled; ``num_cached_tokens``:
    prompt tokens served from the prefix cache when it was admitted in this step.

    Speculative decoding: ``num_spec_tokens`` draft slots are reserved (and counted in
    ``num_new_tokens``); the engine then puts the proposed drafts in ``spec_tokens`` and sets
    ``num_new_tokens = 1 + len(spec_tokens)`` before the forward pass.
    """

    seq: Sequence
    num_new_tokens: int
    kind: str
    samples: bool
    start: int  # num_computed_tokens before this step
    num_cached_tokens: int = 0
    num_spec_tokens: int = 0
    spec_tokens: list[int] = field(default_factory=list)


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
    sequence, in the same order.
    """

    step: int
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    admitted: list[Sequence]
    token_budget: int
    num_batched_tokens: int
    shortfalls: list[Shortfall] = field(default_factory=list)

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
        max_model_len: longest sequence in tokens (caps draft slots; None = no cap).
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, token_budget: int,
                 policy: str = "priority", enable_chunked_prefill: bool = True,
                 num_speculative_tokens: int = 0, max_model_len: int | None = None) -> None:
        self.block_manager = block_manager
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

        # 1. Running sequences, most important first: decodes and unfinished prefill chunks.
        if self.policy == "priority":
            self.running.sort(key=lambda s: s.sort_key("priority"))
        queue = list(self.running)
        for i, seq in enumerate(queue):
            if seq.status is not SequenceStatus.RUNNING or budget <= 0:
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            # Draft slots come out of what is left once every later running sequence has its one token
            # (counted only when the budget could bind: counting every step is quadratic in the batch).
            later = 0
            if self.num_speculative_tokens and budget - num_new - (len(queue) - i - 1) < self.num_speculative_tokens:
                later = sum(1 for other in queue[i + 1:] if other.status is SequenceStatus.RUNNING)
            num_spec = self._num_spec_tokens(seq, budget - num_new - later)
            if num_spec and not bm.can_allocate(seq, seq.num_computed_tokens + num_new + num_spec):
                num_spec = 0  # drafts only use free blocks; they never cost another sequence its blocks
            while not bm.can_allocate(seq, seq.num_computed_tokens + num_new):
                victim = self._victim()
                why = Shortfall(seq, bm.new_blocks_needed(seq, seq.num_computed_tokens + num_new, ()),
                                bm.num_free_blocks)
                budget += self._preempt(victim, plan, preempted, why)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            bm.allocate(seq, seq.num_computed_tokens + num_new + num_spec)
            plan[seq.seq_id] = self._scheduled(seq, num_new, num_spec=num_spec)
            budget -= num_new + num_spec

        # 2. Waiting sequences, in policy order, unless this step already had to preempt.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.find_cached_prefix(seq)
            num_computed = len(cached) * bm.block_size
            num_new = seq.num_tokens - num_computed
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if not bm.can_allocate(seq, num_computed + num_new, cached):
                if not self._preempt_for(seq, num_computed + num_new, cached, plan, preempted):
                    break
                budget = self.token_budget - sum(p.num_new_tokens for p in plan.values())
                if not self.enable_chunked_prefill and seq.num_tokens - num_computed > budget:
                    break
                num_new = min(seq.num_tokens - num_computed, budget)
                if num_new <= 0:
                    break
            bm.record_lookup(seq.num_tokens, num_computed)
            bm.allocate(seq, num_computed + num_new, cached)
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
        )
        self.step_index += 1
        return out

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
        for victim in lower:
            if bm.can_allocate(seq, num_tokens, cached):
                break
            why = Shortfall(seq, bm.new_blocks_needed(seq, num_tokens, cached), bm.free_blocks_after_hits(cached),
                            waiting=True)
            self._preempt(victim, plan, preempted, why)
        return bm.can_allocate(seq, num_tokens, cached)

    def _num_spec_tokens(self, seq: Sequence, budget_left: int) -> int:
        """Draft slots for ``seq`` this step: k, or fewer where the budget or the request's limits leave less room.

        Only a sequence with exactly one uncomputed token (its newest) speculates. The
        verification pass runs positions ``num_tokens - 1 .. num_tokens - 1 + drafts``, all
        below ``max_model_len``; drafts beyond ``max_tokens - 1`` more tokens could never be kept.
        """
        if not self.num_speculative_tokens or seq.num_uncomputed_tokens != 1:
            return 0
        room = [self.num_speculative_tokens, budget_left]
        if self.max_model_len is not None:
            room.append(self.max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            room.append(seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(room))

    @staticmethod
    def _scheduled(seq: Sequence, num_new: int, num_cached: int = 0, num_spec: int = 0) -> ScheduledSequence:
        samples = seq.num_computed_tokens + num_new == seq.num_tokens
        kind = "decode" if (num_new == 1 and samples and seq.num_output_tokens > 0
                            and seq.num_computed_tokens == seq.num_tokens - 1) else "prefill"
        return ScheduledSequence(seq=seq, num_new_tokens=num_new + num_spec, kind=kind, samples=samples,
                                 start=seq.num_computed_tokens, num_cached_tokens=num_cached,
                                 num_spec_tokens=num_spec)
