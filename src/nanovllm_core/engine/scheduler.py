"""The scheduler: each engine step, decide which sequences run and how many tokens each.

It follows vLLM's V1 scheduler (continuous batching, Yu et al. 2022 "Orca" iteration-level
scheduling): one *token budget* per step shared by prefill and decode, *running* sequences
served first (a decode costs one token; an unfinished prefill continues with its next
chunk), then *waiting* ones admitted in policy order while budget, ``max_num_seqs`` and KV
blocks last. A prompt longer than the remaining budget is prefilled in chunks over several
steps (chunked prefill, Agrawal et al. 2023 "SARATHI") while other sequences keep decoding.

Preemption by recompute (Kwon et al. 2023, section 4.5): when a running sequence needs a
block and none is free, the least important running sequence (lowest priority, latest
arrival) gives up all its blocks and goes back to the front of the waiting queue, keeping
the tokens it has generated; when readmitted it recomputes them (often from the prefix
cache). Under the ``priority`` policy a waiting request may also preempt running ones of
lower priority when blocks are short.
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
    """

    seq: Sequence
    num_new_tokens: int
    kind: str
    samples: bool
    start: int  # num_computed_tokens before this step
    num_cached_tokens: int = 0
    spec_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's plan.

    ``scheduled`` in order (decodes first, then prefill chunks); ``preempted``: sequences
    that lost their blocks this step, in order; ``token_budget`` and ``num_batched_tokens``
    in tokens; ``admitted``: sequences moved from waiting to running this step.
    """

    step: int
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    admitted: list[Sequence]
    token_budget: int
    num_batched_tokens: int

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
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, token_budget: int,
                 policy: str = "priority", enable_chunked_prefill: bool = True) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.step_index = 0
        # Sequences held back from admission (e.g. n>1 siblings waiting for the first's prefill).
        self.lookahead_tokens = 0  # extra slots reserved per decode (speculative decoding)

    # ------------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        """Put a sequence in the waiting queue, in policy order."""
        seq.status = SequenceStatus.WAITING if seq.metrics.num_preemptions == 0 else SequenceStatus.PREEMPTED
        bisect.insort_right(self.waiting, seq, key=lambda s: s.sort_key(self.policy))

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it and free its blocks (finish or abort)."""
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

    def _preempt(self, seq: Sequence, plan: dict[int, ScheduledSequence], out: list[Sequence]) -> int:
        """Free ``seq``'s blocks and requeue it; return the budget it had taken this step."""
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

        # 1. Running sequences, most important first: decodes and unfinished prefill chunks.
        if self.policy == "priority":
            self.running.sort(key=lambda s: s.sort_key("priority"))
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget <= 0:
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            extra = self.lookahead_tokens if not seq.in_prefill else 0
            while not bm.can_allocate(seq, seq.num_computed_tokens + num_new + extra):
                victim = self._victim()
                budget += self._preempt(victim, plan, preempted)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            bm.allocate(seq, seq.num_computed_tokens + num_new + extra)
            plan[seq.seq_id] = self._scheduled(seq, num_new)
            budget -= num_new

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
        shortfall = bm._new_blocks_needed(seq, num_tokens, cached) - bm._available_after_hits(cached)
        if not lower or freeable < shortfall:
            return False
        for victim in lower:
            if bm.can_allocate(seq, num_tokens, cached):
                break
            self._preempt(victim, plan, preempted)
        return bm.can_allocate(seq, num_tokens, cached)

    @staticmethod
    def _scheduled(seq: Sequence, num_new: int, num_cached: int = 0) -> ScheduledSequence:
        samples = seq.num_computed_tokens + num_new == seq.num_tokens
        kind = "decode" if (num_new == 1 and samples and seq.num_output_tokens > 0
                            and seq.num_computed_tokens == seq.num_tokens - 1) else "prefill"
        return ScheduledSequence(seq=seq, num_new_tokens=num_new, kind=kind, samples=samples,
                                 start=seq.num_computed_tokens, num_cached_tokens=num_cached)
