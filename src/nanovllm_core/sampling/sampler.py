"""The sampler: turn a step's next-token logits into the tokens each sequence keeps.

One code path for every row of a step, plain decodes and speculative verifications alike
(vLLM V1's sampler and rejection sampler over one set of logits processors):

1. :class:`Distributions` puts every row through the request's logits processors, each one
   tensor operation over the whole batch, in vLLM V1's order: the ``min_tokens`` ban on
   end-of-sequence and stop tokens; the request's ``logit_bias`` added; penalties on the raw logits (repetition over prompt and
   output tokens, positive logits divided and negative multiplied, Keskar et al. 2019, CTRL;
   then frequency per occurrence and presence once, over output tokens); then for rows that
   sample, temperature, min-p (Nguyen et al. 2024), top-k, and top-p on what top-k left
   (nucleus sampling, Holtzman et al. 2020, Sec. 3.1). A verification row sees the tokens
   before its own position (the drafts before it, as if accepted), so penalties and the ban
   are those of that position.
2. :class:`Sampler` judges a sequence's drafts, if it has any (``speculative/rejection_sampler``:
   the greedy rule for greedy requests, rejection sampling otherwise), then draws the last
   token of every sequence in one batch: the argmax of the processed logits for greedy rows,
   otherwise the exponential race (``argmax(p / E)``, ``E ~ Exp(1)`` per token, which is exactly
   sampling from ``p``). Rows with a ``seed`` draw from their own generator, so their tokens do
   not depend on what else is in the batch. A plain decode is the case of no drafts.
3. What was asked for besides, for the kept tokens only: the log-probabilities returned to
   the user (``logprobs``), those of the model's raw distribution (``log_softmax`` of the
   unprocessed logits) with ranks, as vLLM returns by default (``logprobs_mode="raw_logprobs"``);
   and for the teaching views, the top candidates of the distribution the token was chosen
   from (after the processors), with a flag saying whether a processor changed it.

Why this file runs past ~400 lines: the three stages above are one path that plain decodes
and verifications share, and their order (processors, then judging drafts, then drawing)
is the lesson; each stage is a short function or class, in that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from nanovllm_core.engine.sequence import Sequence
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.speculative import rejection_sampler
from nanovllm_core.speculative.rejection_sampler import Verification
from nanovllm_core.transfer import to_device


class SamplingRow:
    """What the logits processors read of one row: the request's settings and the tokens before it.

    A plain decode row is its :class:`Sequence` itself (:meth:`at` returns it). Verification
    row ``j`` of a speculating sequence predicts the token after its first ``length`` tokens,
    which include drafts ``0..j-1`` as if accepted: the row only counts if they are.
    """

    def __init__(self, seq: Sequence, length: int) -> None:
        self.params = seq.params
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.token_ids = seq.token_ids[:length]
        self.eos_token_ids = seq.eos_token_ids
        self.generator = seq.generator

    @classmethod
    def at(cls, seq: Sequence, length: int) -> "Sequence | SamplingRow":
        """The row predicting token ``length`` of ``seq`` (0-based): ``seq`` itself when that is its next token."""
        return seq if length == seq.num_tokens else cls(seq, length)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def min_tokens_ban(params: SamplingParams, eos_token_ids: tuple[int, ...], num_output_tokens: int) -> list[int]:
    """Token ids the ``min_tokens`` rule forbids as output number ``num_output_tokens + 1``.

    EOS and ``stop_token_ids`` while fewer than ``min_tokens`` tokens exist (vLLM's
    ``MinTokensLogitsProcessor``); sorted, empty once enough exist.
    """
    if num_output_tokens >= params.min_tokens:
        return []
    return sorted(set(eos_token_ids) | set(params.stop_token_ids))


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Forbid EOS and ``stop_token_ids`` in rows with fewer than ``min_tokens`` outputs.

    logits ``[S, vocab]`` float32; returns a new tensor when something is masked (vLLM's
    ``MinTokensLogitsProcessor``). Token ids must be inside the vocabulary (the engine checks).
    """
    rows, cols = [], []
    for row, q in enumerate(seqs):
        banned = min_tokens_ban(q.params, q.eos_token_ids, q.num_output_tokens)
        rows += [row] * len(banned)
        cols += banned
    if not rows:
        return logits
    out = logits.clone()
    if out.is_cpu and out.dtype in _NUMPY_FLOATS:  # the same writes through NumPy: no index tensors to build
        out.numpy()[rows, cols] = float("-inf")
    else:
        out[to_device(rows, torch.long, logits.device), to_device(cols, torch.long, logits.device)] = float("-inf")
    return out


_NUMPY_FLOATS = (torch.float32, torch.float64)


def apply_logit_bias(logits: torch.Tensor, seqs: list) -> torch.Tensor:
    """Add each row's ``logit_bias`` (``{token_id: bias}``, clamped to [-100, 100] by ``SamplingParams``).

    logits ``[S, vocab]`` float32; returns a new tensor when some row has a bias (vLLM V1's
    ``LogitBiasLogitsProcessor``, after the ``min_tokens`` ban: a banned token stays at -inf).
    Token ids must be inside the vocabulary (the engine checks: ``LLMEngine.request_problem``).
    """
    rows, cols, bias = [], [], []
    for row, q in enumerate(seqs):
        for token, value in (q.params.logit_bias or {}).items():
            rows.append(row)
            cols.append(token)
            bias.append(value)
    if not rows:
        return logits
    out = logits.clone()
    if out.is_cpu and out.dtype in _NUMPY_FLOATS:  # (row, token) pairs are unique: a plain fancy-index add
        out.numpy()[rows, cols] += np.asarray(bias, dtype=out.numpy().dtype)
    else:
        dev = logits.device
        out.index_put_((to_device(rows, torch.long, dev), to_device(cols, torch.long, dev)),
                       to_device(bias, out.dtype, dev), accumulate=True)
    return out


def argmax_rows(t: torch.Tensor) -> list[int]:
    """Per row of ``t`` ``[R, vocab]``, the index of its largest value (the first one on a tie; the
    first NaN where a row has one), as a Python list.

    On the CPU in float32/float64 through NumPy's ``argmax``, which gives those same indices
    (first maximum, first NaN) with vector instructions: torch's CPU argmax over one
    49152-wide row took 114 us against NumPy's 11 us (AMD EPYC, one thread), once per
    decode step. Elsewhere ``torch.argmax``.
    """
    if t.is_cpu and t.dtype in _NUMPY_FLOATS and not t.requires_grad:
        return t.numpy().argmax(axis=-1).tolist()
    return t.argmax(dim=-1).tolist()


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
    rows = [i for i, q in enumerate(seqs) if penalized(q.params)]
    if not rows:
        return logits
    seqs = [seqs[i] for i in rows]  # rows without penalties are left as they are
    vocab = logits.shape[1]
    dev = logits.device
    counts = torch.zeros((len(rows), vocab), dtype=torch.float32, device=dev)
    in_prompt = torch.zeros((len(rows), vocab), dtype=torch.bool, device=dev)
    for row, q in enumerate(seqs):
        outs = q.output_token_ids
        if outs:
            ids = to_device(outs, torch.long, dev)
            counts[row].index_add_(0, ids, torch.ones(len(outs), device=dev))
        in_prompt[row, to_device(q.token_ids[:q.num_prompt_tokens], torch.long, dev)] = True
    seen = in_prompt | (counts > 0)
    sub = logits if len(rows) == logits.shape[0] else logits[rows]
    r = to_device([q.params.repetition_penalty for q in seqs], torch.float32, dev).unsqueeze(1)
    sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    sub = sub - to_device([q.params.frequency_penalty for q in seqs], torch.float32, dev).unsqueeze(1) * counts
    sub = sub - to_device([q.params.presence_penalty for q in seqs], torch.float32, dev).unsqueeze(1) * (counts > 0).float()
    if len(rows) == logits.shape[0]:
        return sub
    out = logits.clone()
    out[rows] = sub
    return out


def penalized(params: SamplingParams) -> bool:
    """True when a repetition, presence or frequency penalty is on."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0 or params.frequency_penalty != 0


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
    and the three ``any_*`` flags computed from the same Python values (no wait for a GPU)."""
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


class Distributions:
    """A step's rows after the requests' logits processors: what every token is chosen from.

    Built once per step over every row that samples, plain and verification rows alike.

    Attributes:
        logits: ``[R, vocab]`` float32, the model's raw logits.
        rows: ``R`` rows (:class:`Sequence` or :class:`SamplingRow`), what the processors read.
        processed: ``[R, vocab]``, after the ``min_tokens`` ban, the ``logit_bias`` and the penalties
            (``logits`` itself when no processor applies).
        greedy: per row, True when the request takes the argmax (temperature ~ 0).
    """

    def __init__(self, logits: torch.Tensor, rows: list) -> None:
        self.logits = logits
        self.rows = rows
        self.processed = apply_penalties(apply_logit_bias(apply_min_tokens(logits, rows), rows), rows)
        self.greedy = [r.params.greedy for r in rows]
        sampled = [i for i, g in enumerate(self.greedy) if not g]
        self._slot = {row: j for j, row in enumerate(sampled)}
        self._sampling = (filter_probs(self.processed[sampled], *row_tensors([rows[i] for i in sampled], logits.device))
                          if sampled else None)
        self._argmax: list[int] | None = None

    def argmax(self) -> list[int]:
        """Per row, the argmax of the processed logits (what a greedy row takes)."""
        if self._argmax is None:
            self._argmax = argmax_rows(self.processed)
        return self._argmax

    def probs(self, index: list[int]) -> torch.Tensor:
        """``[len(index), vocab]``: the distribution each listed row chooses from.

        Rows that sample: after temperature, min-p, top-k and top-p. Greedy rows: the softmax of
        the processed logits (they take its argmax).
        """
        out = torch.empty((len(index), self.logits.shape[1]), dtype=torch.float32, device=self.logits.device)
        greedy = [j for j, i in enumerate(index) if self.greedy[i]]
        sampled = [j for j, i in enumerate(index) if not self.greedy[i]]
        if greedy:
            out[greedy] = self.processed[[index[j] for j in greedy]].softmax(dim=-1)
        if sampled:
            out[sampled] = self._sampling[[self._slot[index[j]] for j in sampled]]
        return out

    def changed(self, index: list[int]) -> list[bool]:
        """Per listed row: did a processor make its distribution differ from the model's own?

        True when the ban, a logit bias or a penalty changed a logit of the row, or when the row samples
        with a temperature other than 1 or with min-p, top-k or top-p on.
        """
        out = [False] * len(index)
        touched = [j for j, i in enumerate(index) if self._touched(i)]
        if touched and self.processed is not self.logits:
            rows = [index[j] for j in touched]
            for j, diff in zip(touched, (self.processed[rows] != self.logits[rows]).any(dim=-1).tolist()):
                out[j] = diff
        for j, i in enumerate(index):
            p = self.rows[i].params
            if not self.greedy[i] and (p.temperature != 1.0 or p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0):
                out[j] = True
        return out

    def _touched(self, i: int) -> bool:
        """Could a logits processor (penalties, ``logit_bias``, the ``min_tokens`` ban) have changed row ``i``?"""
        r = self.rows[i]
        return penalized(r.params) or bool(r.params.logit_bias) or bool(min_tokens_ban(r.params, r.eos_token_ids, r.num_output_tokens))

    def choose(self, picks: list[tuple[int, torch.Tensor | None]]) -> list[int]:
        """One token per ``(row, replacement)``, drawn in one batch.

        Greedy rows take the argmax of their processed logits. Other rows draw, with the row's
        generator, from ``replacement`` (``[vocab]``, a rejected draft's recovery distribution)
        or else from the row's own distribution.
        """
        if not picks:
            return []
        rows = [r for r, _ in picks]
        drawn = [j for j, r in enumerate(rows) if not self.greedy[r]]
        if not drawn:  # every row greedy (a greedy decode step): the argmaxes are the tokens
            return argmax_rows(_take(self.processed, rows))
        tokens = _take(self.processed, rows).argmax(dim=-1)
        if all(picks[j][1] is None for j in drawn):
            probs = _take(self._sampling, [self._slot[rows[j]] for j in drawn])
        else:
            probs = torch.stack([picks[j][1] if picks[j][1] is not None else self._sampling[self._slot[rows[j]]]
                                 for j in drawn])
        tokens[drawn] = draw(probs, [self.rows[rows[j]].generator for j in drawn])
        return tokens.tolist()


def _take(t: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``t[index]``, without a copy when ``index`` is every row in order (a plain decode step)."""
    return t if index == list(range(t.shape[0])) else t[index]


@dataclass
class RowGroup:
    """The consecutive logits rows of one sequence in a step.

    A plain decode has no drafts and one row. A verification has ``n`` drafts and ``n + 1``
    rows: row ``j`` judges draft ``j``, the last one gives the bonus token.
    ``draft_probs``: ``[n, vocab]``, the distributions the drafts were drawn from (after the
    same processors), or None for point masses (prompt lookup, greedy drafting).
    """

    draft_tokens: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.draft_tokens) + 1


@dataclass
class SamplerOutput:
    """The tokens a step keeps, flat in row order, and what was asked for besides.

    ``token_ids``: the kept tokens, group by group: one for a plain decode, the accepted drafts
    plus one for a verification. ``rows``: the logits row each was chosen at; ``num_kept``:
    per group. ``verifications``: per group, what the verification decided (None for a plain
    decode).

    For the API (None unless some row asked for ``logprobs`` or a listener for top-k), under
    the model's raw distribution: ``chosen_logprobs`` (log p of each kept token),
    ``chosen_ranks`` (its rank among the whole vocabulary, 1 = most likely) and ``top``
    (``[(token_id, logprob), ...]`` best first, as many as the row's request or the listener
    asked for).

    For the teaching views (None unless ``top_k_events``): ``sampled_top``, the
    ``[(token_id, prob), ...]`` best first of the distribution the token was chosen from
    (after penalties and the ``min_tokens`` ban; for rows that sample, after temperature,
    min-p, top-k, top-p; candidates of probability 0 left out; for a verified token, the
    target's distribution at its position), so a greedy row's token is the first; and
    ``processed``, True where a processor made that distribution differ from the model's.
    """

    token_ids: list[int]
    chosen_logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None
    chosen_ranks: list[int] | None = None
    rows: list[int] = field(default_factory=list)
    num_kept: list[int] = field(default_factory=list)
    verifications: list[Verification | None] = field(default_factory=list)
    sampled_top: list[list[tuple[int, float]]] | None = None
    processed: list[bool] | None = None


class Sampler:
    """Samples a step's rows. Stateless; per-request randomness lives on each ``Sequence``."""

    def __call__(self, logits: torch.Tensor, rows: list, top_k_events: int = 0,
                 groups: list[RowGroup] | None = None) -> SamplerOutput:
        """logits ``[R, vocab]`` float32 and their rows -> the kept tokens (:class:`SamplerOutput`).

        Args:
            rows: per logits row, what the processors read (:class:`Sequence`, or
                :class:`SamplingRow` for a verification row).
            top_k_events: also describe this many top candidates per kept token for listeners;
                rows whose request asked for ``logprobs`` get at least that many raw ones.
            groups: consecutive rows per sequence, in row order (default: one plain row each).

        Raises:
            ValueError: the groups do not cover the rows exactly.
        """
        groups = groups if groups is not None else [RowGroup() for _ in rows]
        if sum(g.num_rows for g in groups) != len(rows) or logits.shape[0] != len(rows):
            raise ValueError(f"{len(groups)} row groups cover {sum(g.num_rows for g in groups)} rows, "
                             f"but there are {len(rows)} rows and {logits.shape[0]} logits rows")
        dist = Distributions(logits, rows)
        verifications = self._judge(dist, groups)
        picks: list[tuple[int, torch.Tensor | None]] = []
        first = 0
        for g, judged in zip(groups, verifications):
            v, replacement = judged if judged is not None else (None, None)
            picks.append((first + (v.num_accepted if v else 0), replacement))
            first += g.num_rows
        verifications = [j[0] if j is not None else None for j in verifications]
        last = dist.choose(picks)
        out = SamplerOutput(token_ids=[], verifications=verifications)
        first = 0
        for g, v, token, (row, _) in zip(groups, verifications, last, picks):
            kept = g.draft_tokens[:v.num_accepted] if v else []
            if v:
                v.tokens = kept + [token]
            out.token_ids += kept + [token]
            out.rows += list(range(first, row + 1))
            out.num_kept.append(len(kept) + 1)
            first += g.num_rows
        self._describe(dist, out, top_k_events)
        return out

    @staticmethod
    def _judge(dist: Distributions, groups: list[RowGroup]) -> list[tuple[Verification, torch.Tensor | None] | None]:
        """Judge every group's drafts; per group (None for a plain decode) its Verification and,
        if a sampled draft was rejected, the recovery distribution ``[vocab]`` to draw from.

        The tests run on the logits' device for all groups first; their results come back to the
        host in one copy (one wait per step on a GPU, not one per sequence). A Verification's
        ``tokens`` holds the accepted drafts until the last token is drawn.
        """
        pending = []  # (group, first row, p [n], q [n], ok [n] or None for the greedy rule)
        first = 0
        for g in groups:
            if g.draft_tokens:
                n = len(g.draft_tokens)
                target = dist.probs(list(range(first, first + n)))
                at = torch.arange(n, device=target.device)
                p = target[at, to_device(g.draft_tokens, torch.long, target.device)]
                if dist.greedy[first]:
                    pending.append((g, first, target, p, torch.ones_like(p), None))
                else:
                    ids = to_device(g.draft_tokens, torch.long, target.device)
                    q = g.draft_probs[at, ids] if g.draft_probs is not None else torch.ones_like(p)
                    u = torch.rand(n, generator=dist.rows[first].generator, device=p.device)
                    pending.append((g, first, target, p, q, rejection_sampler.accept_draft(u, p, q)))
            first += g.num_rows
        if not pending:
            return [None] * len(groups)
        host = torch.cat([torch.cat([p, q, (ok if ok is not None else torch.ones_like(p, dtype=torch.bool)).to(p.dtype)])
                          for _, _, _, p, q, ok in pending]).tolist()  # the one device -> host copy
        judged: dict[int, tuple[Verification, torch.Tensor | None]] = {}
        offset = 0
        for g, first, target, _, _, ok in pending:
            draft, n = g.draft_tokens, len(g.draft_tokens)
            p, q, passed = host[offset:offset + n], host[offset + n:offset + 2 * n], host[offset + 2 * n:offset + 3 * n]
            offset += 3 * n
            replacement = None
            if ok is None:
                accepted = rejection_sampler.greedy_accepted(draft, dist.argmax()[first:first + n])
            else:
                accepted = next((i for i, flag in enumerate(passed) if not flag), n)
                if accepted < n:
                    replacement = rejection_sampler.recovery_distribution(
                        target[accepted], g.draft_probs[accepted] if g.draft_probs is not None else None,
                        draft[accepted])
            judged[id(g)] = (Verification(tokens=draft[:accepted], num_accepted=accepted, p=p, q=q,
                                          accepted=[i < accepted for i in range(n)], greedy=ok is None), replacement)
        return [judged.get(id(g)) for g in groups]

    @staticmethod
    def _describe(dist: Distributions, out: SamplerOutput, top_k_events: int) -> None:
        """Fill ``out``'s log-probabilities (raw, for the API) and, for listeners, the chosen-from top-k."""
        params = [dist.rows[r].params for r in out.rows]
        want = [max(top_k_events, p.logprobs or 0) for p in params]
        if not any(want) and all(p.logprobs is None for p in params):
            return
        vocab = dist.logits.shape[1]
        ids = to_device(out.token_ids, torch.long, dist.logits.device).unsqueeze(1)
        logprobs = torch.log_softmax(dist.logits[out.rows], dim=-1)
        chosen = logprobs.gather(1, ids)
        out.chosen_logprobs = chosen.squeeze(1).tolist()
        out.chosen_ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        out.top = [[] for _ in out.rows]
        k = min(max(want), vocab)
        if k:
            values, top_ids = logprobs.topk(k, dim=-1)
            values, top_ids = values.tolist(), top_ids.tolist()
            out.top = [list(zip(i[:w], v[:w])) for i, v, w in zip(top_ids, values, want)]
        if not top_k_events:
            return
        values, top_ids = dist.probs(out.rows).topk(min(top_k_events, vocab), dim=-1)
        out.sampled_top = []
        for row, token, i, v in zip(out.rows, out.token_ids, top_ids.tolist(), values.tolist()):
            cands = [(t, pr) for t, pr in zip(i, v) if pr > 0]
            if dist.greedy[row] and cands and cands[0][0] != token:
                # a tie that topk ordered otherwise than argmax: show the token taken first
                mine = [c for c in cands if c[0] == token] or [(token, cands[0][1])]
                cands = (mine + [c for c in cands if c[0] != token])[: len(cands)]
            out.sampled_top.append(cands)
        out.processed = dist.changed(out.rows)
