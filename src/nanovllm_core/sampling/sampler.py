"""The sampler: turn a batch of next-token logits into tokens, one row per sequence.

Every row may have different settings; each stage is one tensor operation over the whole
batch (no Python loop over the vocabulary), in vLLM V1's order:

1. ``min_tokens``: end-of-sequence and stop tokens masked until enough tokens exist;
2. penalties on the raw logits: repetition (prompt and output tokens; positive logits
   divided, negative multiplied; Keskar et al. 2019, CTRL), then frequency (per occurrence)
   and presence (once) over output tokens;
3. greedy rows (temperature ~ 0) take the argmax here;
4. temperature, then min-p (Nguyen et al. 2024), then top-k, then top-p (nucleus sampling,
   Holtzman et al. 2020, Sec. 3.1) on what top-k left;
5. a token is drawn with the exponential race (``argmax(p / E)``, ``E ~ Exp(1)`` per token),
   which is exactly sampling from ``p``; rows with a ``seed`` draw ``E`` from their own
   generator, so their tokens do not depend on what else is in the batch.

Log-probabilities returned to the user (``logprobs``) and the top-k shown by the teaching
views are those of the model's raw distribution (``log_softmax`` of the unprocessed logits),
as vLLM returns by default (``logprobs_mode="raw_logprobs"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanovllm_core.engine.sequence import Sequence
from nanovllm_core.transfer import to_device


@dataclass
class SamplerOutput:
    """Tokens for each row, and what was asked for besides.

    ``token_ids``: one per row. ``chosen_logprobs``: log p(token) per row under the raw
    distribution (None unless asked). ``chosen_ranks``: the chosen token's rank among the
    whole vocabulary under that distribution (1 = most likely; None unless asked).
    ``top``: per row, ``[(token_id, logprob), ...]`` best first (None unless asked; rows
    that asked for nothing get ``[]``).
    """

    token_ids: list[int]
    chosen_logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None
    chosen_ranks: list[int] | None = None


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Forbid EOS and ``stop_token_ids`` in rows with fewer than ``min_tokens`` outputs.

    logits ``[S, vocab]`` float32; returns a new tensor when something is masked (vLLM's
    ``MinTokensLogitsProcessor``). Token ids must be inside the vocabulary (the engine checks).
    """
    rows, cols = [], []
    for row, q in enumerate(seqs):
        if q.num_output_tokens < q.params.min_tokens:
            banned = set(q.eos_token_ids) | set(q.params.stop_token_ids)
            rows += [row] * len(banned)
            cols += sorted(banned)
    if not rows:
        return logits
    out = logits.clone()
    out[to_device(rows, torch.long, logits.device), to_device(cols, torch.long, logits.device)] = float("-inf")
    return out


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition, frequency and presence penalties, as vLLM applies them.

    Args:
        logits: ``[S, vocab]`` float32, one row per sequence.
        seqs: the rows' sequences (their prompt and output token ids, their ``params``).

    Returns:
        ``[S, vocab]``: for every token in the prompt or output, a positive logit divided by
        ``repetition_penalty`` and a negative one multiplied by it; then
        ``frequency_penalty x count`` and ``presence_penalty x (count > 0)`` subtracted,
        counting output tokens only. The input itself when every penalty is off.
    """
    s_count, vocab = logits.shape
    rep = [q.params.repetition_penalty for q in seqs]
    pres = [q.params.presence_penalty for q in seqs]
    freq = [q.params.frequency_penalty for q in seqs]
    if all(r == 1.0 for r in rep) and not any(pres) and not any(freq):
        return logits
    dev = logits.device
    counts = torch.zeros((s_count, vocab), dtype=torch.float32, device=dev)
    in_prompt = torch.zeros((s_count, vocab), dtype=torch.bool, device=dev)
    for row, q in enumerate(seqs):
        outs = q.output_token_ids
        if outs:
            ids = to_device(outs, torch.long, dev)
            counts[row].index_add_(0, ids, torch.ones(len(outs), device=dev))
        in_prompt[row, to_device(q.token_ids[:q.num_prompt_tokens], torch.long, dev)] = True
    seen = in_prompt | (counts > 0)
    r = to_device(rep, torch.float32, dev).unsqueeze(1)
    out = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    out = out - to_device(freq, torch.float32, dev).unsqueeze(1) * counts
    return out - to_device(pres, torch.float32, dev).unsqueeze(1) * (counts > 0).float()


def filter_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor, any_min_p: bool | None = None,
                 any_top_k: bool | None = None, any_top_p: bool | None = None) -> torch.Tensor:
    """Sampling distribution after temperature, min-p, top-k and top-p.

    Args:
        logits: ``[S, vocab]`` float32 (penalties already applied).
        temperature: ``[S]`` (> 0). min_p: ``[S]`` in [0, 1] (0 = off).
        top_k: ``[S]`` integer, 0 = off. top_p: ``[S]`` in (0, 1] (1 = off).
        any_min_p, any_top_k, any_top_p: whether some row uses that filter, known on the host
            (:func:`row_tensors` passes them); None reads it from the tensor, which on a GPU
            makes the CPU wait for it.

    Returns:
        probabilities ``[S, vocab]`` that sum to 1 per row. min-p drops tokens whose
        probability is below ``min_p`` x the top one's; top-k keeps the k most likely; top-p
        keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (a token
        survives while the mass of the tokens strictly better than it is below ``top_p``).
        The most likely token always survives.
    """
    logits = logits / temperature.unsqueeze(1)
    if any_min_p is None:
        any_min_p, any_top_k, any_top_p = bool((min_p > 0).any()), bool((top_k > 0).any()), bool((top_p < 1.0).any())
    if any_min_p:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    vocab = logits.shape[1]
    need_k, need_p = any_top_k, any_top_p
    if need_k or need_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if need_k:
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
            rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(rank >= k.unsqueeze(1), float("-inf"))
        if need_p:
            sorted_probs = sorted_logits.softmax(dim=-1)
            better_mass = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = (better_mass >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits.softmax(dim=-1)


class RowSettings(NamedTuple):
    """The rows' sampling settings as tensors ``[S]``, then whether any row uses each filter (host booleans).

    Unpacks into :func:`filter_probs`'s arguments: ``filter_probs(logits, *row_tensors(...))``.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    any_min_p: bool
    any_top_k: bool
    any_top_p: bool


def row_tensors(seqs: list[Sequence], device: torch.device) -> RowSettings:
    """(temperature, top_k, top_p, min_p), each ``[S]``, from the rows' settings (top_k -1 becomes 0, off),
    and the three ``any_*`` flags computed from the same Python values."""
    top_k = [max(q.params.top_k, 0) for q in seqs]
    top_p = [q.params.top_p for q in seqs]
    min_p = [q.params.min_p for q in seqs]
    return RowSettings(to_device([q.params.temperature for q in seqs], torch.float32, device),
                       to_device(top_k, torch.long, device), to_device(top_p, torch.float32, device),
                       to_device(min_p, torch.float32, device),
                       any(m > 0 for m in min_p), any(k > 0 for k in top_k), any(p < 1.0 for p in top_p))


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of ``probs [S, vocab]``, returned as ``[S]`` long.

    The exponential race: with ``E_i ~ Exp(1)`` independent, ``argmax_i p_i / E_i`` is token
    ``i`` with probability ``p_i``. Rows with a generator draw their ``E`` from it (one
    ``vocab``-long draw per step), so a seeded row's token depends only on its seed and its
    own probabilities.
    """
    e = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        e.exponential_()
    for i in seeded:
        e[i].exponential_(generator=generators[i])
    return (probs / e).argmax(dim=-1)


class Sampler:
    """Samples a batch of rows. Stateless; per-request randomness lives on each ``Sequence``."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], top_k_events: int = 0) -> SamplerOutput:
        """logits ``[S, vocab]`` float32, one row per sequence -> :class:`SamplerOutput`.

        ``top_k_events``: also return this many top (token, logprob) per row for listeners;
        rows whose request asked for ``logprobs`` get at least that many.
        """
        processed = apply_penalties(apply_min_tokens(logits, seqs), seqs)
        tokens = processed.argmax(dim=-1)
        rows = [i for i, q in enumerate(seqs) if not q.params.greedy]
        if rows:
            sub = [seqs[i] for i in rows]
            index = to_device(rows, torch.long, logits.device)
            probs = filter_probs(processed.index_select(0, index), *row_tensors(sub, logits.device))
            tokens.index_copy_(0, index, draw(probs, [q.generator for q in sub]))
        token_list = tokens.tolist()  # the step's one wait for the device: its tokens
        want = [max(top_k_events, q.params.logprobs or 0) for q in seqs]
        if not any(want) and all(q.params.logprobs is None for q in seqs):
            return SamplerOutput(token_ids=token_list)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, tokens.unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top: list[list[tuple[int, float]]] = [[] for _ in seqs]
        k = max(want)
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            values, ids = values.tolist(), ids.tolist()
            for row in range(len(seqs)):
                top[row] = list(zip(ids[row][: want[row]], values[row][: want[row]]))
        return SamplerOutput(token_ids=token_list, chosen_logprobs=chosen.squeeze(1).tolist(), top=top,
                             chosen_ranks=ranks.tolist())
