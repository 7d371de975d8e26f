"""The engine's side of speculative decoding: propose before the forward pass, verify after it.

One engine step with speculation (the scheduler has already given each decoding sequence
``1 + k`` token slots and the blocks for them):

1. :meth:`Speculator.propose`: the proposer drafts up to k tokens per sequence, cut before
   the first token the request bans at that position (``min_tokens``); they are appended to
   ``token_ids`` provisionally and ``num_new_tokens`` becomes ``1 + drafts``;
2. the target runs ONE forward pass over the whole batch; :meth:`extra_rows` asks the model
   runner for logits at every drafted position, not only the last;
3. the sampler takes every row of the step through the same logits processors; for a
   sequence with drafts (:meth:`row_group`) it judges them (``rejection_sampler``) and keeps
   the accepted ones plus one token of the target's own;
4. the engine rolls back: drops the rejected drafts, sets ``num_computed_tokens`` to cover
   only the kept tokens, truncates the block table, then appends the kept tokens one by
   one through the output processor's stop checks, like any other token.
"""

from __future__ import annotations

from nanovllm_core.engine.scheduler import ScheduledSequence
from nanovllm_core.engine.sequence import Sequence
from nanovllm_core.sampling.sampler import RowGroup, min_tokens_ban
from nanovllm_core.speculative.metrics import SpecDecodeStats
from nanovllm_core.speculative.base import Draft, Proposer
from nanovllm_core.speculative.rejection_sampler import Verification


def cut_at_ban(seq: Sequence, draft: list[int]) -> list[int]:
    """``draft`` up to (not including) the first token the request bans at its position.

    Draft ``j`` would be output number ``seq.num_output_tokens + j + 1``; ``min_tokens`` bans
    EOS and stop ids until then. The target never emits a banned token, so a draft slot
    spent on one is wasted.
    """
    for j, token in enumerate(draft):
        if token in min_tokens_ban(seq.params, seq.eos_token_ids, seq.num_output_tokens + j):
            return draft[:j]
    return draft


class Speculator:
    """Proposes drafts for a step's decoding sequences and hands them to the sampler.

    Args:
        proposer: where drafts come from.
        num_speculative_tokens: k, the most drafts per sequence and step.
    """

    def __init__(self, proposer: Proposer, num_speculative_tokens: int) -> None:
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.stats = SpecDecodeStats()
        self._drafts: dict[int, Draft] = {}

    @property
    def name(self) -> str:
        return self.proposer.name

    # ------------------------------------------------------------------ 1. propose

    def propose(self, scheduled: list[ScheduledSequence]) -> None:
        """Draft for every entry with ``num_spec_tokens`` > 0 and append the drafts provisionally.

        Afterwards each such entry has ``spec_tokens`` set and ``num_new_tokens = 1 + len(spec_tokens)``
        (a sequence with no draft runs as a plain decode). Fewer drafts than slots add their reason to
        ``draft_limits``: ``"proposer"`` (it proposed fewer) or ``"min_tokens"`` (cut at a banned token).
        """
        self._drafts = self.proposer.propose(scheduled)
        for s in scheduled:
            if not s.num_spec_tokens:
                continue
            draft = self._drafts.get(s.seq.seq_id)
            proposed = list(draft.tokens[:s.num_spec_tokens]) if draft else []
            s.spec_tokens = cut_at_ban(s.seq, proposed)
            if len(proposed) < s.num_spec_tokens:
                s.draft_limits += ("proposer",)
            if len(s.spec_tokens) < len(proposed):
                s.draft_limits += ("min_tokens",)
            s.num_new_tokens = 1 + len(s.spec_tokens)
            s.seq.token_ids.extend(s.spec_tokens)

    def discard(self, scheduled: list[ScheduledSequence]) -> None:
        """Undo :meth:`propose` (the step failed): drop the drafts, back to plain decodes."""
        self.proposer.step_failed(scheduled)
        for s in scheduled:
            if s.spec_tokens:
                del s.seq.token_ids[s.start + 1:]
            s.spec_tokens = []
            if s.num_spec_tokens:
                s.num_new_tokens = 1
                s.draft_limits += ("failed_step",)
            s.num_spec_tokens = 0
        self._drafts = {}

    @staticmethod
    def extra_rows(scheduled: list[ScheduledSequence]) -> dict[int, list[int]]:
        """For the model runner: logits at every drafted row (indices among each sequence's new tokens)."""
        return {s.seq.seq_id: list(range(len(s.spec_tokens))) for s in scheduled if s.spec_tokens}

    # ------------------------------------------------------------------ 2. verify

    def row_group(self, s: ScheduledSequence) -> RowGroup:
        """The sampler's view of a scheduled sequence's rows: its drafts and their ``q`` (none for a plain row)."""
        if not s.spec_tokens:
            return RowGroup()
        draft = self._drafts.get(s.seq.seq_id)
        probs = draft.probs[:len(s.spec_tokens)] if draft is not None and draft.probs is not None else None
        return RowGroup(list(s.spec_tokens), probs)

    def record(self, v: Verification) -> None:
        """Count one verification in the acceptance statistics."""
        self.stats.record(v)

    def step_done(self) -> None:
        """Forget this step's drafts."""
        self._drafts = {}

    # ------------------------------------------------------------------ bookkeeping

    def computed_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` whose K/V is complete in every pool (the prefix-cache limit), see ``Proposer``."""
        return self.proposer.computed_tokens(seq)

    def release(self, seq_id: int) -> None:
        """Forget a finished, aborted or preempted sequence's drafting state."""
        self.proposer.release(seq_id)
