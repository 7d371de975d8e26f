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

Greedy requests (temperature 0) are the limit of the same rule: a draft token is accepted
while it equals the target's argmax, and the argmax is emitted at the first mismatch, so the
output is token-identical to greedy decoding without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm_core.sampling.sampler import draw


@dataclass
class Verification:
    """What one verification of one sequence decided.

    ``tokens``: the tokens to append, the accepted drafts then the correction (at the first
    rejection) or the bonus token (all accepted), so ``len(tokens) == num_accepted + 1``.
    ``p``, ``q``: target and draft probability of each draft token; ``accepted``: per draft
    token (False for every token after the first rejection).
    """

    tokens: list[int]
    num_accepted: int
    p: list[float]
    q: list[float]
    accepted: list[bool]

    @property
    def num_draft_tokens(self) -> int:
        return len(self.accepted)


def accept_draft(u: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The acceptance test: ``u < p / q`` for ``u ~ U(0, 1)``, i.e. accept with probability ``min(1, p / q)``.

    u, p, q: ``[n]`` (uniform draws, target and draft probability of each draft token) -> ``[n]`` bool.
    Written as ``u * q < p`` so that ``q`` is never divided by.
    """
    return u * q < p


def verify_greedy(draft: list[int], target_argmax: list[int], target_probs: torch.Tensor) -> Verification:
    """Greedy verification: accept drafts while they equal the target's argmax.

    Args:
        draft: ``n`` draft token ids.
        target_argmax: ``n + 1`` argmax token ids of the target's processed logits at each row.
        target_probs: ``[n + 1, vocab]``, only read to report ``p`` of the drafts.
    """
    n = len(draft)
    accepted = 0
    while accepted < n and draft[accepted] == target_argmax[accepted]:
        accepted += 1
    dev = target_probs.device
    p = target_probs[torch.arange(n, device=dev), torch.tensor(draft, dtype=torch.long, device=dev)].tolist()
    return Verification(tokens=draft[:accepted] + [target_argmax[accepted]], num_accepted=accepted, p=p,
                        q=[1.0] * n, accepted=[i < accepted for i in range(n)])


def verify_sampled(draft: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None) -> Verification:
    """Rejection sampling of ``n`` drafts against the target (Leviathan et al. 2023, Algorithm 1).

    Args:
        draft: ``n`` draft token ids (n >= 1).
        target_probs: ``[n + 1, vocab]``, the target's sampling distribution at each row, after
            the request's penalties, temperature, top-k/top-p/min-p.
        draft_probs: ``[n, vocab]``, the distributions the drafts were drawn from, after the same
            processing; None for a point mass at each draft token (n-gram or greedy drafts).
        generator: the request's generator (seeded requests), or None for torch's global one.
    """
    n = len(draft)
    dev = target_probs.device
    rows = torch.arange(n, device=dev)
    ids = torch.tensor(draft, dtype=torch.long, device=dev)
    p = target_probs[rows, ids]
    q = draft_probs[rows, ids] if draft_probs is not None else torch.ones_like(p)
    u = torch.rand(n, generator=generator, device=dev)
    ok = accept_draft(u, p, q)
    rejected = (~ok).nonzero()
    accepted = int(rejected[0]) if len(rejected) else n
    if accepted == n:
        dist = target_probs[n]
    else:
        if draft_probs is not None:
            residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
        else:
            residual = target_probs[accepted].clone()
            residual[draft[accepted]] = 0.0
        total = residual.sum()
        # max(0, p - q) is all zero only when p == q (then nothing is ever rejected); guard rounding.
        dist = residual / total if total > 0 else target_probs[accepted]
    last = int(draw(dist.unsqueeze(0), [generator])[0])
    return Verification(tokens=draft[:accepted] + [last], num_accepted=accepted, p=p.tolist(), q=q.tolist(),
                        accepted=[i < accepted for i in range(n)])
