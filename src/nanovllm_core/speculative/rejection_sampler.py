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


def verification(draft: list[int], num_accepted: int, last: int, p: list[float], q: list[float]) -> Verification:
    """The :class:`Verification` of ``draft`` once its outcome is on the host: the first
    ``num_accepted`` drafts, then ``last`` (the correction or the bonus token)."""
    return Verification(tokens=draft[:num_accepted] + [last], num_accepted=num_accepted, p=p, q=q,
                        accepted=[i < num_accepted for i in range(len(draft))])


def verify_greedy(draft: list[int], target_argmax: list[int], p: list[float]) -> Verification:
    """Greedy verification: accept drafts while they equal the target's argmax.

    Args:
        draft: ``n`` draft token ids.
        target_argmax: ``n + 1`` argmax token ids of the target's processed logits at each row.
        p: ``n`` target probabilities of the draft tokens, only reported.
    """
    n = len(draft)
    accepted = 0
    while accepted < n and draft[accepted] == target_argmax[accepted]:
        accepted += 1
    return verification(draft, accepted, target_argmax[accepted], p, [1.0] * n)


def sample_on_device(draft: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> tuple[torch.Tensor, ...]:
    """Rejection sampling of ``n`` drafts against the target (Leviathan et al. 2023, Algorithm 1),
    computed where the tensors live and never read back, so a batch of sequences waits once.

    Args:
        draft: ``[n]`` long, the draft token ids (n >= 1).
        target_probs: ``[n + 1, vocab]``, the target's sampling distribution at each row, after
            the request's penalties, temperature, top-k/top-p/min-p.
        draft_probs: ``[n, vocab]``, the distributions the drafts were drawn from, after the same
            processing; None for a point mass at each draft token (n-gram or greedy drafts).
        generator: the request's generator (seeded requests), or None for torch's global one.

    Returns:
        ``(num_accepted [], last [], p [n], q [n])``: how many leading drafts were accepted
        (long), the token drawn after them (long: from the residual at the first rejection,
        from ``p_{n+1}`` when all were accepted), and the target's and draft's probability of
        each draft token.
    """
    n = draft.numel()
    rows = torch.arange(n, device=draft.device)
    p = target_probs[rows, draft]
    q = draft_probs[rows, draft] if draft_probs is not None else torch.ones_like(p)
    u = torch.rand(n, generator=generator, device=draft.device)
    num_accepted = accept_draft(u, p, q).long().cumprod(0).sum()
    # The residual normalize(max(0, p - q)) of every row; the one at the first rejection is used.
    if draft_probs is not None:
        residual = (target_probs[:n] - draft_probs[:n]).clamp_min(0)
    else:
        residual = target_probs[:n].clone().scatter_(1, draft.unsqueeze(1), 0.0)
    total = residual.sum(dim=-1, keepdim=True)
    # max(0, p - q) is all zero only when p == q (then nothing is ever rejected); guard rounding.
    residual = torch.where(total > 0, residual / total, target_probs[:n])
    dist = torch.cat([residual, target_probs[n:n + 1]]).index_select(0, num_accepted.view(1))
    return num_accepted, draw(dist, [generator])[0], p, q


def verify_sampled(draft: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None) -> Verification:
    """:func:`sample_on_device` for one sequence, read back (arguments as there, ``draft`` as a list)."""
    ids = torch.tensor(draft, dtype=torch.long).to(target_probs.device)
    num_accepted, last, p, q = sample_on_device(ids, target_probs, draft_probs, generator)
    return verification(draft, int(num_accepted), int(last), p.tolist(), q.tolist())
