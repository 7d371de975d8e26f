"""Counters of speculative decoding, and the expected tokens per verification.

Leviathan et al. 2023, section 3.1: if each draft token is accepted with probability alpha,
independently, a verification of k drafts yields on average
``E = (1 - alpha^(k+1)) / (1 - alpha)`` tokens (the accepted drafts plus the target's own).
vLLM's "draft acceptance rate" (accepted / drafted) counts the drafts after a rejection as
rejected although nobody judged them, so it understates alpha; ``num_examined_tokens`` gives
the estimate the formula wants (accepted / drafts judged up to the first rejection).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm_core.speculative.rejection_sampler import Verification


def expected_accepted_length(alpha: float, k: int) -> float:
    """Expected tokens per verification, ``(1 - alpha^(k+1)) / (1 - alpha)`` (Leviathan et al. 2023, eq. 1).

    ``alpha``: the probability that one draft token is accepted (assumed the same for every
    position); ``k``: drafts per step. Counts the accepted drafts plus the target's own token.
    """
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class SpecDecodeStats:
    """Counters over the engine's life.

    ``num_verifications``: verifications with at least one draft token; ``num_draft_tokens``
    and ``num_accepted_tokens`` over them; ``num_examined_tokens``: drafts up to and including
    the first rejection (those after it were never judged).
    """

    num_verifications: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_examined_tokens: int = 0

    def record(self, v: Verification) -> None:
        self.num_verifications += 1
        self.num_draft_tokens += v.num_draft_tokens
        self.num_accepted_tokens += v.num_accepted
        self.num_examined_tokens += min(v.num_accepted + 1, v.num_draft_tokens)

    def as_dict(self) -> dict[str, float | int]:
        """The ``spec_*`` entries of ``LLMEngine.stats()``.

        ``spec_acceptance_rate``: accepted / drafted (vLLM's draft acceptance rate);
        ``spec_per_token_acceptance_rate``: accepted / examined, the estimate of Leviathan's
        alpha that the expected-length formula assumes; ``spec_mean_accepted_length``: tokens
        generated per verification, the accepted drafts plus the target's own token.
        """
        v, d, a, e = self.num_verifications, self.num_draft_tokens, self.num_accepted_tokens, self.num_examined_tokens
        return {
            "spec_verifications": v,
            "spec_draft_tokens": d,
            "spec_accepted_tokens": a,
            "spec_acceptance_rate": a / d if d else 0.0,
            "spec_per_token_acceptance_rate": a / e if e else 0.0,
            "spec_mean_accepted_length": (a + v) / v if v else 0.0,
        }
