"""A ``Sequence``: one sample of one request, as the scheduler and block manager see it.

Its tokens are the prompt followed by what has been generated. ``num_computed_tokens``
counts the tokens whose K/V are in the cache (vLLM V1's name); the difference to
``num_tokens`` is what the next step must process: the whole prompt (prefill, possibly in
chunks), or just the newest token (decode). Preemption by recompute sets it back to 0 but
keeps the generated tokens, so the sequence resumes where it stopped.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from nanovllm_core.outputs import Logprob, RequestMetrics
from nanovllm_core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue after losing its blocks
    FINISHED = "finished"


_arrival_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """State of one sample being generated.

    Attributes:
        seq_id: unique per engine.
        request_id: the request it belongs to (``n`` > 1 gives several sequences per request).
        index: which of the request's ``n`` samples this is.
        token_ids: prompt + generated token ids.
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        num_computed_tokens: tokens whose K/V are cached (0 after preemption).
        block_table: physical block ids holding this sequence's K/V, in logical order.
        block_hashes: chained hashes of its full blocks (filled lazily by the block manager).
        preempted_block_table: its block table when it was last preempted (empty until then): which
            prefix-cache hits at its readmission are its own blocks, kept cached-free, and which are
            another request's.
        priority: higher is more important (used by the ``priority`` policy).
        arrival: a global counter; ties between equal priorities go to the earlier arrival.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    prompt: str | None = None
    index: int = 0
    priority: int = 0
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    preempted_block_table: list[int] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    output_text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    generator: torch.Generator | None = None
    eos_token_ids: tuple[int, ...] = ()
    # incremental detokenizer state (see engine/detokenizer.py)
    prefix_offset: int = 0
    read_offset: int = 0
    tokens_text: list[str] = field(default_factory=list)
    num_streamed_chars: int = 0  # characters of output_text already handed to listeners

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before this sequence can sample again."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while the prompt (or, after preemption, the prompt and earlier outputs) is being recomputed."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def sort_key(self, policy: str) -> tuple:
        """Queue order: priority policy -> (higher priority first, earlier arrival); fcfs -> arrival."""
        if policy == "priority":
            return (-self.priority, self.arrival)
        return (self.arrival,)

    def __repr__(self) -> str:  # short, for logs and assertion messages
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, status={self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={self.block_table})")
