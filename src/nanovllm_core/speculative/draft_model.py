"""Drafting with a model: a small draft LLaMA, or the target's own first layers.

The draft runs k times per step, one token per speculating sequence each time (the first
time on the sequence's newest token), and its logits go through the request's own logits
processors (the ``min_tokens`` ban, penalties, temperature, top-k/top-p/min-p; the sampler's
:class:`~nanovllm_core.sampling.sampler.Distributions`): greedy requests take the argmax (a
point mass), others draw from that distribution ``q`` and keep it for the rejection sampler.

Its KV cache is paged with the target's geometry and addressed by the SAME block tables
and slot mapping, so the target's block manager serves both and rollback is one
``truncate``:

- a draft model (``DraftModelProposer.for_model``) keeps its own pool, one block per
  target block. So that its cache holds every token the target's does, its first pass of
  each step also runs every prefill chunk and plain decode the target runs (it "mirrors"
  the plan). When all k drafts are accepted the last one was never fed to the draft, so the
  draft lags one token; the next step feeds it first, and until then the block holding it
  is kept out of the prefix cache (``computed_tokens``).
- self-speculation (``DraftModelProposer.early_exit``, Elhoushi et al. 2024 "LayerSkip";
  Zhang et al. 2023 "Draft & Verify") drafts with the target's first N layers, final norm
  and LM head. Those layers' K/V for a token are the target's own, so the draft writes
  straight into the target's pool (layers 0..N-1) and the verification pass, which
  rewrites the same slots in every layer, needs no separate cache and no mirroring.
"""

from __future__ import annotations

import torch

from nanovllm_core.engine.model_runner import ModelRunner
from nanovllm_core.engine.scheduler import ScheduledSequence
from nanovllm_core.engine.sequence import Sequence
from nanovllm_core.model.llama import LlamaForCausalLM
from nanovllm_core.sampling.sampler import Distributions
from nanovllm_core.speculative.base import Draft, Proposer


class EarlyExitModel:
    """The target's first ``num_layers`` decoder layers, then its final norm and LM head.

    Offers what :class:`ModelRunner` uses of a model (``config``, ``parameters``, the call
    ``(input_ids [T], positions [T], attn) -> hidden [T, hidden]``, ``compute_logits``,
    ``check_positions``),
    sharing the target's weights.
    """

    def __init__(self, target: LlamaForCausalLM, num_layers: int) -> None:
        self.target = target
        self.num_layers = num_layers
        self.config = target.config

    def parameters(self):
        return self.target.parameters()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, tracer=None) -> torch.Tensor:
        return self.target(input_ids, positions, attn, None, num_layers=self.num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    def check_positions(self, max_position: int) -> None:
        self.target.check_positions(max_position)


class DraftModelProposer(Proposer):
    """Drafts k tokens per sequence with a draft model run through its own :class:`ModelRunner`.

    Args:
        runner: runs the draft (its pool shares the target's block tables).
        mirror: also run every token the target runs (a draft model with its own pool);
            False when the pool is the target's (early exit).
        name: for events and stats, e.g. ``"self:8"``.
    """

    def __init__(self, runner: ModelRunner, mirror: bool, name: str) -> None:
        self.runner = runner
        self.mirror = mirror
        self.name = name
        self._computed: dict[int, int] = {}  # seq_id -> tokens with K/V in the draft's own pool

    @classmethod
    def for_model(cls, draft: LlamaForCausalLM, target_runner: ModelRunner, name: str) -> "DraftModelProposer":
        """A separate draft model with its own paged pool of the target's geometry (same block count and size)."""
        t = target_runner
        runner = ModelRunner(draft, t.block_size, t.kv_cache.num_blocks, True, t.backend, t.max_model_len)
        return cls(runner, mirror=True, name=name)

    @classmethod
    def early_exit(cls, target_runner: ModelRunner, num_layers: int) -> "DraftModelProposer":
        """Self-speculation: the target's first ``num_layers`` layers, writing into the target's own pool."""
        t = target_runner
        runner = ModelRunner(EarlyExitModel(t.model, num_layers), t.block_size, t.kv_cache.num_blocks, True,
                             t.backend, t.max_model_len, kv_cache=t.kv_cache)
        return cls(runner, mirror=False, name=f"self:{num_layers}")

    # ------------------------------------------------------------------ cache bookkeeping

    def computed_tokens(self, seq: Sequence) -> int:
        if not self.mirror:
            return seq.num_computed_tokens
        return min(seq.num_computed_tokens, self._computed.get(seq.seq_id, seq.num_computed_tokens))

    def release(self, seq_id: int) -> None:
        self._computed.pop(seq_id, None)

    def step_failed(self, scheduled: list[ScheduledSequence]) -> None:
        # The engine retries these sequences without the draft: feed their tokens again next step.
        if self.mirror:
            for s in scheduled:
                self._computed[s.seq.seq_id] = min(s.start, self._computed.get(s.seq.seq_id, s.start))

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledSequence]) -> dict[int, Draft]:
        spec = [s for s in scheduled if s.num_spec_tokens > 0]
        base = {s.seq.seq_id: s.seq.num_tokens for s in spec}  # length before any draft
        tokens: dict[int, list[int]] = {s.seq.seq_id: [] for s in spec}
        probs: dict[int, list[torch.Tensor | None]] = {s.seq.seq_id: [] for s in spec}
        batch = self._first_pass(scheduled if self.mirror else spec)
        try:
            while batch:
                result = self.runner.run(batch)
                seqs = [s.seq for s, _ in result.rows]
                chosen, q = self._choose(result.logits, seqs)
                for seq, token, q_row in zip(seqs, chosen, q):
                    seq.token_ids.append(token)  # the next pass feeds it
                    tokens[seq.seq_id].append(token)
                    probs[seq.seq_id].append(q_row)
                active = [s for s in spec if len(tokens[s.seq.seq_id]) < s.num_spec_tokens]
                batch = [ScheduledSequence(s.seq, 1, "draft", samples=True, start=s.seq.num_tokens - 1) for s in active]
                if self.mirror:
                    for s in active:
                        self._computed[s.seq.seq_id] = s.seq.num_tokens
        finally:
            for s in spec:
                del s.seq.token_ids[base[s.seq.seq_id]:]
        out = {}
        for s in spec:
            rows = probs[s.seq.seq_id]
            stacked = torch.stack(rows) if rows and rows[0] is not None else None
            out[s.seq.seq_id] = Draft(tokens[s.seq.seq_id], stacked)
        return out

    def _first_pass(self, entries: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """The first draft pass: each sequence's newest token, and (mirroring) every token the target runs.

        A mirrored sequence starts where the draft's own cache ends, which may be one token
        before the target's (the last draft of a fully accepted run was never fed).
        """
        batch = []
        for s in entries:
            seq = s.seq
            end = s.start + (1 if s.num_spec_tokens else s.num_new_tokens)
            start = s.start
            if self.mirror:
                start = min(start, self._computed.get(seq.seq_id, start))
                self._computed[seq.seq_id] = end
            batch.append(ScheduledSequence(seq, end - start, "draft", samples=s.num_spec_tokens > 0, start=start))
        return batch

    @staticmethod
    def _choose(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Draft logits ``[S, vocab]`` -> one token per row and its ``q`` row (None for greedy rows).

        Each sequence's ``token_ids`` hold its history up to this row, so the logits
        processors (penalties, the ``min_tokens`` ban) see exactly what the target will see
        at the same position: the draft never proposes a token the target bans there.
        """
        dist = Distributions(logits, seqs)
        tokens = dist.choose([(i, None) for i in range(len(seqs))])
        sampled = [i for i, greedy in enumerate(dist.greedy) if not greedy]
        q: list[torch.Tensor | None] = [None] * len(seqs)
        if sampled:
            for i, row in zip(sampled, dist.probs(sampled)):
                q[i] = row
        return tokens, q
