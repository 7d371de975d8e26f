"""What a proposal is: :class:`Draft` (one sequence's guessed tokens) and :class:`Proposer`
(the base class every proposer implements).

Kept apart from ``proposer.py``, which *builds* proposers (and so imports every kind), so
that the kinds (``ngram.py``, ``draft_model.py``) and the ``speculator.py`` can import the
base without an import circle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm_core.engine.scheduler import ScheduledSequence
from nanovllm_core.engine.sequence import Sequence


@dataclass
class Draft:
    """One sequence's proposal.

    ``tokens``: the drafted ids (possibly fewer than the slots, possibly none).
    ``probs``: ``[len(tokens), vocab]`` float32, the draft distribution ``q`` each token was drawn
    from (after the request's own temperature/top-k/top-p), or None for point masses (n-gram
    lookups and greedy drafting).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer:
    """Base class: proposes draft tokens for a step's speculating sequences."""

    name = "proposer"

    def propose(self, scheduled: list[ScheduledSequence]) -> dict[int, Draft]:
        """Drafts keyed by ``seq_id``, for the entries of ``scheduled`` with ``num_spec_tokens`` > 0.

        The entries' ``start`` is the position of each sequence's newest (uncomputed) token.
        """
        raise NotImplementedError

    def computed_tokens(self, seq: Sequence) -> int:
        """How many of ``seq``'s tokens have complete K/V in every pool this proposer keeps.

        Blocks beyond this are not registered in the prefix cache yet. Default: all the target computed.
        """
        return seq.num_computed_tokens

    def release(self, seq_id: int) -> None:
        """Forget a finished, aborted or preempted sequence."""

    def step_failed(self, scheduled: list[ScheduledSequence]) -> None:
        """The step's forward pass failed after :meth:`propose`: distrust what this step wrote."""
