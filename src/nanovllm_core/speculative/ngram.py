"""Prompt lookup decoding: draft the tokens that followed an earlier occurrence of the last few tokens.

Saxena 2023 ("Prompt Lookup Decoding"); vLLM's ``ngram`` proposer. Text that quotes,
repeats or edits its context (code, lists, summaries) often continues the way an earlier
occurrence of the same n-gram did. No model runs: the draft is a fixed guess, a point
mass ``q = 1`` for the rejection sampler.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nanovllm_core.engine.scheduler import ScheduledSequence
from nanovllm_core.speculative.base import Draft, Proposer


def propose_ngram(token_ids: list[int], num_tokens: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to ``num_tokens`` ids that followed the latest earlier match of the last n tokens.

    Tries n from ``max_n`` down to ``min_n``; the first n with a match wins. The match must
    start before the suffix itself, so at least one following token exists; fewer than
    ``num_tokens`` are returned when the match is near the end, none when nothing matches.
    """
    length = len(token_ids)
    if num_tokens < 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows starting at 0 .. length-1-n: every match is followed by at least one token
        windows = sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            begin = int(starts[-1]) + n
            return tokens[begin:begin + num_tokens].tolist()
    return []


class NgramProposer(Proposer):
    """Drafts by prompt lookup over each sequence's prompt and output so far.

    Args:
        max_n, min_n: the n-gram lengths tried, longest first (vLLM's ``prompt_lookup_max/min``).
    """

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, scheduled: list[ScheduledSequence]) -> dict[int, Draft]:
        return {s.seq.seq_id: Draft(propose_ngram(s.seq.token_ids, s.num_spec_tokens, self.max_n, self.min_n))
                for s in scheduled if s.num_spec_tokens > 0}
