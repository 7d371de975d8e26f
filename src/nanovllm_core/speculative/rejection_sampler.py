"""Verification of drafted tokens: keep what the target agrees with, then add one token of its own.

Speculative sampling (Leviathan et al. 2023, section 2.3 and Algorithm 1; Chen et al. 2023,
Algorithm 2). For draft tokens ``x_1..x_n`` drawn from the draft's distributions ``q_i`` and
the target's distributions ``p_i`` at the same positions (plus ``p_{n+1}`` after the last):

1. accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``, in order, stopping at the
   first rejection;
2. on a rejection at ``i``, draw the replacement from ``normalize(max(0, p_i - q_i))``;
3. when all ``n`` are accepted, draw a *bonus* token from ``p_{n+1}``.

Every emitted token is then distributed exactly as the target alone would have sampled it,
whatever ``q`` is. A draft that is a fixed guess (prompt lookup, or greedy drafting) has a
point mass ``q_i = 1`` at ``x_i``: it is accepted with probability ``p_i(x_i)``, and a rejection
samples from ``p_i`` with ``x_i`` removed.

Greedy requests (temperature 0) use the greedy rule instead: a draft token is kept while it
equals the argmax of the target's processed logits at its position, and the first mismatch
is replaced by that argmax, so the output is token-identical to greedy decoding without
speculation. ``p`` and ``q`` are only reported then; no random number is drawn.

Here are the rules for one sequence; the sampler (``sampling/sampler.py``) applies them to
every sequence of a step, after the same logits processors as a plain decode row, and draws
the last token of every sequence (correction, bonus or plain decode) in one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verification:
    """What one verification of one sequence decided.

    ``tokens``: the tokens to append, the accepted drafts then the correction (at the first
    rejection) or the bonus token (all accepted), so ``len(tokens) == num_accepted + 1``.
    ``p``, ``q``: target and draft probability of each draft token; ``accepted``: per draft
    token (False for every token after the first rejection). ``greedy``: which rule decided
    (True: equality with the target's argmax; False: rejection sampling, ``min(1, p/q)``).
    """

    tokens: list[int]
    num_accepted: int
    p: list[float]
    q: list[float]
    accepted: list[bool]
    greedy: bool = False

    @property
    def num_draft_tokens(self) -> int:
        return len(self.accepted)


def accept_draft(u: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The acceptance test: ``u < p / q`` for ``u ~ U(0, 1)``, i.e. accept with probability ``min(1, p / q)``.

    u, p, q: ``[n]`` (uniform draws, target and draft probability of each draft token) -> ``[n]`` bool.
    Written as ``u * q < p`` so that ``q`` is never divided by.
    """
    return u * q < p


def greedy_accepted(draft: list[int], target_argmax: list[int]) -> int:
    """The greedy rule: how many leading drafts equal the target's argmax at their position.

    ``target_argmax``: at least ``len(draft)`` ids, the argmax of the target's processed logits
    at each draft's position.
    """
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target_argmax[accepted]:
        accepted += 1
    return accepted


def sampled_accepted(p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None) -> int:
    """Rejection sampling: how many leading drafts pass :func:`accept_draft`, one uniform draw each.

    p, q: ``[n]`` target and draft probability of each draft token. ``generator``: the
    request's own (seeded requests) or None for torch's global one.
    """
    n = p.shape[0]
    u = torch.rand(n, generator=generator, device=p.device)
    ok = accept_draft(u, p, q)
    rejected = (~ok).nonzero()
    return int(rejected[0]) if len(rejected) else n


def recovery_distribution(target: torch.Tensor, draft: torch.Tensor | None, draft_token: int) -> torch.Tensor:
    """Where the replacement of a rejected draft is drawn from: ``normalize(max(0, p - q))``, ``[vocab]``.

    ``target``: ``p`` at the rejected position ``[vocab]``; ``draft``: ``q`` there, or None for a
    point mass at ``draft_token`` (then ``p`` with that token removed).
    """
    if draft is not None:
        residual = (target - draft).clamp_min(0)
    else:
        residual = target.clone()
        residual[draft_token] = 0.0
    total = residual.sum()
    # max(0, p - q) is all zero only when p == q (then nothing is ever rejected); guard rounding.
    return residual / total if total > 0 else target
