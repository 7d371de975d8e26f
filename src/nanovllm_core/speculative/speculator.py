"""The engine's side of speculative decoding: propose before the forward pass, verify after it.

One engine step with speculation (the scheduler has already given each decoding sequence
``1 + k`` token slots and the blocks for them):

1. :meth:`Speculator.propose`: the proposer drafts up to k tokens per sequence; they are
   appended to ``token_ids`` provisionally and ``num_new_tokens`` becomes ``1 + drafts``;
2. the target runs ONE forward pass over the whole batch; :meth:`extra_rows` asks the model
   runner for logits at every drafted position, not only the last;
3. :meth:`Speculator.verify`: the target's logits at those rows go through the request's
   own penalties, temperature, top-k/top-p/min-p, and the rejection sampler keeps the
   accepted drafts plus one token (see ``rejection_sampler``);
4. the engine rolls back: drops the drafts from ``token_ids``, sets ``num_computed_tokens``
   to cover only the accepted ones, truncates the block table, then appends the kept tokens
   one by one through its usual stop checks.
"""

from __future__ import annotations

import torch

from nanovllm_core.engine.model_runner import ForwardResult
from nanovllm_core.engine.scheduler import ScheduledSequence
from nanovllm_core.engine.sequence import Sequence
from nanovllm_core.sampling.sampler import SamplerOutput, apply_penalties, filter_probs, row_tensors
from nanovllm_core.speculative import rejection_sampler
from nanovllm_core.speculative.metrics import SpecDecodeStats
from nanovllm_core.speculative.proposer import Draft, Proposer
from nanovllm_core.transfer import to_device


class _Prefix:
    """A sequence as the target saw it at one verification row: its first ``length`` tokens.

    Offers what ``apply_penalties`` reads of a :class:`Sequence`, so each row gets the
    penalties and ``min_tokens`` masking of its own position.
    """

    def __init__(self, seq: Sequence, length: int) -> None:
        self.params = seq.params
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.token_ids = seq.token_ids[:length]
        self.eos_token_ids = seq.eos_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Speculator:
    """Proposes drafts for a step's decoding sequences and verifies them after the forward pass.

    Args:
        proposer: where drafts come from.
        num_speculative_tokens: k, the most drafts per sequence and step.
    """

    def __init__(self, proposer: Proposer, num_speculative_tokens: int) -> None:
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.stats = SpecDecodeStats()
        self._drafts: dict[int, Draft] = {}

    @property
    def name(self) -> str:
        return self.proposer.name

    # ------------------------------------------------------------------ 1. propose

    def propose(self, scheduled: list[ScheduledSequence]) -> None:
        """Draft for every entry with ``num_spec_tokens`` > 0 and append the drafts provisionally.

        Afterwards each such entry has ``spec_tokens`` set and ``num_new_tokens = 1 + len(spec_tokens)``
        (a sequence with no draft runs as a plain decode).
        """
        self._drafts = self.proposer.propose(scheduled)
        for s in scheduled:
            if not s.num_spec_tokens:
                continue
            draft = self._drafts.get(s.seq.seq_id)
            s.spec_tokens = list(draft.tokens[:s.num_spec_tokens]) if draft else []
            s.num_new_tokens = 1 + len(s.spec_tokens)
            s.seq.token_ids.extend(s.spec_tokens)

    def discard(self, scheduled: list[ScheduledSequence]) -> None:
        """Undo :meth:`propose` (the step failed): drop the drafts, back to plain decodes."""
        self.proposer.step_failed(scheduled)
        for s in scheduled:
            if s.spec_tokens:
                del s.seq.token_ids[s.start + 1:]
            s.spec_tokens = []
            if s.num_spec_tokens:
                s.num_new_tokens = 1
            s.num_spec_tokens = 0
        self._drafts = {}

    @staticmethod
    def extra_rows(scheduled: list[ScheduledSequence]) -> dict[int, list[int]]:
        """For the model runner: logits at every drafted row (indices among each sequence's new tokens)."""
        return {s.seq.seq_id: list(range(len(s.spec_tokens))) for s in scheduled if s.spec_tokens}

    # ------------------------------------------------------------------ 2. verify

    @staticmethod
    def split(result: ForwardResult) -> tuple[ForwardResult, list[tuple[ScheduledSequence, torch.Tensor]]]:
        """Separate plain rows (one per sampling sequence) from verification rows.

        Returns the plain rows as a :class:`ForwardResult`, and per speculating sequence its
        logits ``[1 + drafts, vocab]`` in position order.
        """
        plain, grouped = [], {}
        for i, (s, _) in enumerate(result.rows):
            if s.spec_tokens:
                grouped.setdefault(id(s), (s, []))[1].append(i)
            else:
                plain.append(i)
        logits, dev = result.logits, result.logits.device
        plain_result = ForwardResult(logits=logits.index_select(0, to_device(plain, torch.long, dev)),
                                     rows=[result.rows[i] for i in plain], num_tokens=result.num_tokens)
        # The runner lists a sequence's rows together and in order: a slice, no gather.
        return plain_result, [(s, logits[rows[0]:rows[-1] + 1]) for s, rows in grouped.values()]

    def verify(self, spec: list[tuple[ScheduledSequence, torch.Tensor]]) -> list[rejection_sampler.Verification]:
        """Judge each sequence's drafts against the target's logits ``[1 + n, vocab]`` at the same rows.

        Row j of a sequence predicts the token after its first ``start + 1 + j`` tokens; it
        gets the request's processing as of that position (penalties, ``min_tokens``), then
        greedy or rejection-sampling verification. Updates the counters.
        """
        if not spec:
            return []
        views = [_Prefix(s.seq, s.start + 1 + j) for s, logits in spec for j in range(logits.shape[0])]
        processed = apply_penalties(torch.cat([logits for _, logits in spec]), views)
        greedy_rows = [i for i, v in enumerate(views) if v.params.greedy]
        sampled_rows = [i for i, v in enumerate(views) if not v.params.greedy]
        dev = processed.device
        probs = torch.empty_like(processed)
        if greedy_rows:
            index = to_device(greedy_rows, torch.long, dev)
            probs.index_copy_(0, index, processed.index_select(0, index).softmax(dim=-1))  # only to report p
        if sampled_rows:
            index = to_device(sampled_rows, torch.long, dev)
            probs.index_copy_(0, index, filter_probs(processed.index_select(0, index),
                                                     *row_tensors([views[i] for i in sampled_rows], dev)))
        # Each sequence's rows: its n drafts, then the bonus row (no draft there: id 0, unused).
        ids = to_device([t for s, _ in spec for t in s.spec_tokens + [0]], torch.long, dev)
        p_rows = probs.gather(1, ids.unsqueeze(1)).squeeze(1)
        sampled, row = {}, 0
        for i, (s, logits) in enumerate(spec):
            n, seq = logits.shape[0] - 1, s.seq
            if not seq.params.greedy:
                d = self._drafts.get(seq.seq_id)
                sampled[i] = rejection_sampler.sample_on_device(
                    ids[row:row + n], probs[row:row + n + 1],
                    d.probs[:n] if d and d.probs is not None else None, seq.generator)
            row += n + 1
        # One wait for the device for the whole batch: every argmax and outcome, then every probability.
        ints = torch.cat([processed.argmax(dim=-1)] + [torch.stack(v[:2]) for v in sampled.values()]).tolist()
        floats = torch.cat([p_rows] + [v[3] for v in sampled.values()]).tolist()
        argmax, outcomes, qs = ints[:row], iter(ints[row:]), floats[row:]
        out, row = [], 0
        for i, (s, logits) in enumerate(spec):
            n, draft = logits.shape[0] - 1, s.spec_tokens
            p = floats[row:row + n]
            if i in sampled:
                v = rejection_sampler.verification(draft, next(outcomes), next(outcomes), p, qs[:n])
                qs = qs[n:]
            else:
                v = rejection_sampler.verify_greedy(draft, argmax[row:row + n + 1], p)
            self.stats.record(v)
            out.append(v)
            row += n + 1
        self._drafts = {}
        return out

    @staticmethod
    def sampler_output(logits: torch.Tensor, v: rejection_sampler.Verification, want: int,
                       any_logprobs: bool) -> SamplerOutput:
        """The kept tokens as a :class:`SamplerOutput` (one row per token), with log-probabilities if asked.

        ``logits``: the sequence's verification rows ``[1 + n, vocab]``; like the sampler, the
        log-probabilities are those of the raw distribution.
        """
        tokens = v.tokens
        if not want and not any_logprobs:
            return SamplerOutput(token_ids=list(tokens))
        logprobs = torch.log_softmax(logits[:len(tokens)], dim=-1)
        ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
        top: list[list[tuple[int, float]]] = [[] for _ in tokens]
        if want:
            values, top_ids = logprobs.topk(want, dim=-1)
            top = [list(zip(i, val)) for i, val in zip(top_ids.tolist(), values.tolist())]
        return SamplerOutput(token_ids=list(tokens), chosen_logprobs=chosen, top=top)

    # ------------------------------------------------------------------ bookkeeping

    def computed_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` whose K/V is complete in every pool (the prefix-cache limit), see ``Proposer``."""
        return self.proposer.computed_tokens(seq)

    def release(self, seq_id: int) -> None:
        """Forget a finished, aborted or preempted sequence's drafting state."""
        self.proposer.release(seq_id)
