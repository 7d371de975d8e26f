"""The sampler: turn a batch of next-token logits into tokens, one row per sequence.

Every row may have different settings; each stage is one tensor operation over the whole
batch (no Python loop over the vocabulary), in vLLM's order:

1. penalties on the raw logits: repetition (prompt and output tokens; positive logits
   divided, negative multiplied; Keskar et al. 2019), presence and frequency (output tokens);
2. ``min_tokens``: end-of-sequence and stop tokens masked until enough tokens exist;
3. greedy rows take the argmax here;
4. temperature, then top-k, then top-p (nucleus, Holtzman et al. 2020), then min-p;
5. a token is drawn with the exponential-race trick (``argmax(p / E)``, ``E ~ Exp(1)``), which
   equals sampling from ``p``; rows with a ``seed`` draw ``E`` from their own generator, so
   their tokens do not depend on what else is in the batch.

Log-probabilities returned to the user (``logprobs``) and the top-k shown by the teaching
views are those of the model's raw distribution (``log_softmax`` of the logits), as vLLM
returns by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm_core.engine.sequence import Sequence


@dataclass
class SamplerOutput:
    """Tokens for each row, and what was asked for besides.

    ``token_ids``: one per row. ``chosen_logprobs``: log p(token) per row under the raw
    distribution (None unless asked). ``top``: per row, ``[(token_id, logprob), ...]``
    best first (None unless asked; rows that asked for nothing get ``[]``).
    """

    token_ids: list[int]
    chosen_logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition, presence and frequency penalties, and ``min_tokens``. logits ``[S, vocab]`` float32 (a new tensor)."""
    s_count, vocab = logits.shape
    rep = [q.params.repetition_penalty for q in seqs]
    pres = [q.params.presence_penalty for q in seqs]
    freq = [q.params.frequency_penalty for q in seqs]
    out = logits
    if any(r != 1.0 for r in rep) or any(pres) or any(freq):
        out = logits.clone()
        dev = logits.device
        counts = torch.zeros((s_count, vocab), dtype=torch.float32, device=dev)
        seen_prompt = torch.zeros((s_count, vocab), dtype=torch.bool, device=dev)
        for row, q in enumerate(seqs):
            outs = q.output_token_ids
            if outs:
                counts[row].index_add_(0, torch.tensor(outs, device=dev), torch.ones(len(outs), device=dev))
            if rep[row] != 1.0:
                seen_prompt[row, torch.tensor(q.token_ids[:q.num_prompt_tokens], device=dev)] = True
        r = torch.tensor(rep, device=dev).unsqueeze(1)
        seen = seen_prompt | (counts > 0)
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        out = out - torch.tensor(freq, device=dev).unsqueeze(1) * counts
        out = out - torch.tensor(pres, device=dev).unsqueeze(1) * (counts > 0).float()
    needs_min = [row for row, q in enumerate(seqs) if q.num_output_tokens < q.params.min_tokens]
    if needs_min:
        out = out.clone() if out is logits else out
        for row in needs_min:
            q = seqs[row]
            banned = list(q.eos_token_ids) + list(q.params.stop_token_ids)
            if banned:
                out[row, torch.tensor(banned, device=logits.device)] = float("-inf")
    return out


def filter_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Sampling distribution after temperature, top-k, top-p and min-p.

    Args:
        logits: ``[S, vocab]`` float32 (penalties already applied).
        temperature: ``[S]`` (> 0). top_k: ``[S]`` int, 0 = off. top_p: ``[S]`` in (0, 1].
        min_p: ``[S]`` in [0, 1].

    Returns:
        probabilities ``[S, vocab]`` that sum to 1 per row. The most likely token always survives.
    """
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if need_k:
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
            rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(rank >= k.unsqueeze(1), float("-inf"))
        if need_p:
            sorted_probs = sorted_logits.softmax(dim=-1)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
            drop = before >= top_p.unsqueeze(1)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if bool((min_p > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def row_tensors(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p) ``[S]`` tensors of the rows' settings (greedy rows get temperature 1)."""
    temp = torch.tensor([q.params.temperature if not q.params.greedy else 1.0 for q in seqs], device=device)
    top_k = torch.tensor([max(q.params.top_k, 0) for q in seqs], device=device)
    top_p = torch.tensor([q.params.top_p for q in seqs], device=device)
    min_p = torch.tensor([q.params.min_p for q in seqs], device=device)
    return temp, top_k, top_p, min_p


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row from ``probs [S, vocab]`` by the exponential race; seeded rows use their generator."""
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
        processed = apply_penalties(logits, seqs)
        greedy = [q.params.greedy for q in seqs]
        tokens = processed.argmax(dim=-1)
        if not all(greedy):
            rows = [i for i, g in enumerate(greedy) if not g]
            sub = [seqs[i] for i in rows]
            probs = filter_probs(processed[rows], *row_tensors(sub, logits.device))
            drawn = draw(probs, [q.generator for q in sub])
            tokens[rows] = drawn
        token_list = tokens.tolist()
        want = [max(top_k_events, q.params.logprobs or 0) for q in seqs]
        any_logprobs = any(q.params.logprobs is not None for q in seqs)
        if not any(want) and not any_logprobs:
            return SamplerOutput(token_ids=token_list)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        top: list[list[tuple[int, float]]] = [[] for _ in seqs]
        k = max(want)
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            values, ids = values.tolist(), ids.tolist()
            for row in range(len(seqs)):
                top[row] = list(zip(ids[row][: want[row]], values[row][: want[row]]))
        return SamplerOutput(token_ids=token_list, chosen_logprobs=chosen, top=top)
