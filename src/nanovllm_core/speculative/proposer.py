"""Proposers: where draft tokens come from, chosen with ``speculative_model``.

A proposer looks at the step's plan and returns, for every sequence that was given draft
slots (``ScheduledSequence.num_spec_tokens`` > 0), up to that many guessed next tokens and
the distribution each was drawn from. It leaves every sequence's ``token_ids`` as it found
them; the :class:`~nanovllm_core.speculative.speculator.Speculator` appends the drafts.

``speculative_model`` values:

- ``"ngram"``: prompt lookup (:mod:`.ngram`), no model at all;
- ``"self:N"``: the target's first N decoder layers + final norm + LM head (early exit);
- ``"target"``: the target model itself as the draft (every draft is accepted at
  temperature 0; useful to check the machinery, never faster);
- ``"default"``: the embedded default model as the draft;
- anything else: a LLaMA-family model (repo id, folder, ``.gguf``) with the target's vocabulary.
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


def parse_self_layers(spec: str, num_layers: int) -> int:
    """N of ``"self:N"``, checked against the target's layer count.

    Raises:
        ValueError: N is not in 1..num_layers-1.
    """
    n = int(spec.split(":", 1)[1])
    if not 1 <= n <= num_layers - 1:
        raise ValueError(f"speculative_model={spec!r} is invalid: the target has {num_layers} layers, "
                         f"so N must be between 1 and {num_layers - 1}")
    return n
