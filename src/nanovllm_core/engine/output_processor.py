"""Output processing: what happens to each token a step keeps, and what callers get back.

vLLM V1 splits this between the scheduler's update step (append the token, check stops) and
its output processor (detokenize, logprobs, ``RequestOutput``); here it is one module. Every
kept token takes the same path, whether a plain decode sampled it or a speculative
verification kept it (an accepted draft, a correction or a bonus token):

1. append it to the sequence, with its metrics (first-token time) and logprobs (the top
   ``logprobs`` candidates plus the chosen token, with ranks);
   every token of one step carries the step's one :class:`StepStamp` (when its forward pass
   and sampling finished), like vLLM V1's ``IterationStats.iteration_timestamp``: how long the
   step's other requests took to process does not count in a request's TTFT, TPOT or E2E;
2. detokenize it incrementally (``detokenizer.py``);
3. check stops in vLLM's order: EOS, ``stop_token_ids`` and stop strings (none of them within
   the first ``min_tokens`` tokens), then ``max_tokens`` and ``max_model_len``;
4. tell listeners (``TokenSampled``).

The engine then frees a finished sequence's blocks; :meth:`OutputProcessor.finished` and
:meth:`OutputProcessor.take` build the ``RequestOutput`` objects that ``step()`` returns.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from nanovllm_core import events as ev
from nanovllm_core.engine.clock import EngineClock
from nanovllm_core.engine.detokenizer import (TokenPieces, detokenize_new_token, find_stop_string, release_text,
                                              streamed_text)
from nanovllm_core.engine.sequence import Sequence
from nanovllm_core.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm_core.sampling.sampler import SamplerOutput
from nanovllm_core.sampling_params import SamplingParams

Stop = tuple[str, "str | int | None"]  # (finish_reason, stop_reason)


@dataclass(frozen=True)
class StepStamp:
    """When one step's forward pass and sampling finished: the time every token it made carries.

    ``engine_s``: seconds on the engine's clock (``EngineClock.now()``: the request metrics'
    first/last-token and finish times); ``wall_s``: seconds since the epoch (``time.time()``:
    the ``time`` of the events the step's output processing sends). Taken once per forward
    pass, before any request's output is processed, so a slow detokenizer or listener delays
    no request's times (vLLM V1 stamps an iteration's outputs the same way).
    """

    engine_s: float
    wall_s: float

    @classmethod
    def now(cls, clock: EngineClock) -> "StepStamp":
        return cls(clock.now(), time.time())


@dataclass
class RequestState:
    """One request as the engine tracks it: its samples (``n`` sequences) and how to report them.

    ``pending_siblings``: samples waiting until the first sample's prompt is in the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    pending_siblings: list[Sequence] = field(default_factory=list)
    error: str | None = None


class OutputProcessor:
    """Appends kept tokens to their sequences and builds ``RequestOutput`` objects.

    Args:
        tokenizer: a transformers tokenizer (incremental detokenization, candidates' text).
        max_model_len: longest sequence in tokens (a ``"length"`` stop).
    """

    def __init__(self, tokenizer: Any, max_model_len: int, clock: EngineClock | None = None) -> None:
        self.tokenizer = tokenizer
        self.pieces = TokenPieces(tokenizer)  # a candidate's text: "<0xE3>" for bytes of a character, not "�"
        self.clock = clock or EngineClock()  # request times on the engine's clock (paused time left out)
        self.max_model_len = max_model_len
        self.pending: list[RequestOutput] = []  # finished outputs not yet returned by a step
        self.total_output_tokens = 0
        # Prompt tokens of every sample (sequence) whose first token came out, counted then: vLLM V1's
        # vllm:prompt_tokens (vllm/v1/metrics/stats.py IterationStats.update_from_output adds prompt_len
        # on a request's first output, and n fans out into n child requests; trial 16b)
        self.total_prompt_tokens = 0
        self._special: set[int] | None = None  # the tokenizer's special token ids, read on first use

    # ------------------------------------------------------------------ one token

    def append_token(self, seq: Sequence, sampled: SamplerOutput, i: int, step: int, *, speculative: bool = False,
                     emit: Callable[[ev.Event], None] | None = None, topk: int = 0,
                     stamp: StepStamp | None = None) -> Stop | None:
        """Add kept token ``i`` of ``sampled`` to ``seq``; return (finish_reason, stop_reason) if it must stop.

        Args:
            speculative: the token was kept by a speculative verification.
            stamp: when the step's forward pass and sampling finished (the token's time in the
                metrics and in ``TokenSampled.time``); None: now.
            emit: where to send the ``TokenSampled`` event (None: nobody listens).
            topk: candidates per token the listeners asked for.
        """
        token = sampled.token_ids[i]
        seq.token_ids.append(token)
        m = seq.metrics
        stamp = stamp or StepStamp.now(self.clock)
        now = stamp.engine_s
        if m.first_token_time is None:
            m.first_token_time = now
            m.first_token_step = step
            self.total_prompt_tokens += seq.num_prompt_tokens
        m.last_token_time = now
        m.num_output_tokens = seq.num_output_tokens
        self.total_output_tokens += 1
        logprob = sampled.chosen_logprobs[i] if sampled.chosen_logprobs is not None else None
        if logprob is not None:
            seq.cumulative_logprob += logprob
            if seq.logprobs is not None:
                seq.logprobs.append(self.logprob_entry(seq, sampled, i))
        text_len_before = len(seq.output_text)
        piece = detokenize_new_token(self.tokenizer, seq)
        seq.output_text += piece
        stop = self.check_stop(seq, token, len(piece), text_len_before)
        released = release_text(seq, finished=stop is not None)
        if emit is not None:
            top, model_top = self._candidates(sampled, i, topk)
            emit(ev.TokenSampled(
                step=step, request_id=seq.request_id, seq_id=seq.seq_id, index=seq.index, token_id=token,
                text=released, position=seq.num_tokens - 1, num_output_tokens=seq.num_output_tokens, top=top,
                logprob=logprob, temperature=seq.params.temperature, greedy=seq.params.greedy, token_text=piece,
                model_top=model_top, speculative=speculative, special=self._special_name(token),
                ttft_s=m.time_to_first_token, tpot_s=m.time_per_output_token, time=stamp.wall_s,
            ))
        return stop

    def _special_name(self, token: int) -> str:
        """The token's name if it is a special token of the tokenizer (``TokenSampled.special``), else ""."""
        if self._special is None:
            self._special = set(getattr(self.tokenizer, "all_special_ids", None) or ())
        return self.tokenizer.convert_ids_to_tokens(token) if token in self._special else ""

    def _candidates(self, sampled: SamplerOutput, i: int,
                    topk: int) -> tuple[tuple[ev.TopToken, ...], tuple[ev.TopToken, ...]]:
        """``TokenSampled.top`` (the distribution chosen from) and ``model_top`` (raw, only if a processor changed it)."""
        if not topk or sampled.sampled_top is None:
            return (), ()
        piece = self.pieces
        top = tuple(ev.TopToken(t, piece(t), p) for t, p in sampled.sampled_top[i][:topk])
        model_top: tuple[ev.TopToken, ...] = ()
        if sampled.processed[i]:
            model_top = tuple(ev.TopToken(t, piece(t), math.exp(lp)) for t, lp in sampled.top[i][:topk])
        return top, model_top

    def logprob_entry(self, seq: Sequence, sampled: SamplerOutput, i: int) -> dict[int, Logprob]:
        """vLLM's per-token logprobs: the top ``logprobs`` candidates plus the chosen token, with ranks."""
        token = sampled.token_ids[i]
        decode = self.tokenizer.decode
        entry = {tid: Logprob(lp, rank + 1, decode([tid]))
                 for rank, (tid, lp) in enumerate(sampled.top[i][: seq.params.logprobs])}
        if token not in entry:
            entry[token] = Logprob(sampled.chosen_logprobs[i], sampled.chosen_ranks[i], decode([token]))
        return entry

    def check_stop(self, seq: Sequence, token: int, new_text_len: int, text_len_before: int) -> Stop | None:
        """Should ``seq`` stop after its newest token? Returns (finish_reason, stop_reason) or None.

        Checked in vLLM's order: EOS, ``stop_token_ids`` and stop strings (none of them within
        the first ``min_tokens`` tokens), then ``max_tokens`` and ``max_model_len``. A stop
        token's own text and a stop string (with anything after it) are cut from
        ``output_text`` unless ``include_stop_str_in_output`` (vLLM V1's detokenizer).
        """
        p = seq.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            hit: Stop | None = None
            if token in seq.eos_token_ids:
                hit = ("stop", None)
            elif token in p.stop_token_ids:
                hit = ("stop", token)
            if hit is not None:
                if not p.include_stop_str_in_output:
                    seq.output_text = seq.output_text[:text_len_before]
                return hit
            # vLLM looks for stop strings only in text after the first min_tokens tokens.
            if p.stop and n_out > p.min_tokens:
                found = find_stop_string(seq, new_text_len)
                if found is not None:
                    stop, at = found
                    seq.output_text = seq.output_text[: at + len(stop) if p.include_stop_str_in_output else at]
                    return ("stop", stop)
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return ("length", None)
        if seq.num_tokens >= self.max_model_len:
            return ("length", None)
        return None

    # ------------------------------------------------------------------ request outputs

    def reject(self, request_id: str, prompt: Any, token_ids: list[int], reason: str) -> None:
        """Queue the finished output of a request that never ran (``finish_reason="rejected"``)."""
        self.pending.append(RequestOutput(
            request_id=request_id, prompt=prompt if isinstance(prompt, str) else None, prompt_token_ids=token_ids,
            outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="rejected")],
            finished=True, error=reason,
        ))

    def finished(self, req: RequestState) -> None:
        """Queue the final output of a request whose last sample just ended."""
        self.pending.append(self.request_output(req))

    def take(self, requests: dict[str, RequestState], touched: dict[str, None]) -> list[RequestOutput]:
        """The queued finished outputs, then the current output of every live request in ``touched``."""
        outs, self.pending = self.pending, []
        done = {o.request_id for o in outs}
        for rid in touched:
            req = requests.get(rid)
            if req is not None and rid not in done:
                outs.append(self.request_output(req))
        return outs

    def request_output(self, req: RequestState) -> RequestOutput:
        """A request's ``RequestOutput`` now: a running sample shows the text streamed so far."""
        completions = [
            CompletionOutput(index=s.index, text=s.output_text if s.is_finished else streamed_text(s),
                             token_ids=list(s.output_token_ids),
                             finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                             cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                             logprobs=list(s.logprobs) if s.logprobs is not None else None, metrics=s.metrics)
            for s in req.seqs
        ]
        errors = [s.error for s in req.seqs if s.error]
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
                             outputs=completions, finished=all(s.is_finished for s in req.seqs),
                             metrics=req.seqs[0].metrics, error=errors[0] if errors else None)
