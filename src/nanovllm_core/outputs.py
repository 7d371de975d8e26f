"""What ``LLM.generate`` returns: vLLM-shaped ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timing and scheduling facts of one request.

    Times are seconds on the engine's clock (``engine.clock``: ``time.perf_counter()`` with the
    time a controller held the engine paused left out); steps are engine step indices.
    ``time_to_first_token`` (TTFT) = first_token_time - arrival_time;
    ``time_per_output_token`` (TPOT) = (last_token_time - first_token_time) / (output tokens - 1),
    vLLM's mean inter-token latency: an abort after the last token does not change it.
    ``paused_time``: seconds of the request's life the engine was held paused (wall time =
    engine time + paused_time); ``paused_at_arrival`` is the clock's paused total when it arrived.

    Prefix-cache hits, in tokens: ``num_cached_prompt_tokens``: prompt tokens the prefix cache held
    at the request's first admission (vLLM's ``num_cached_tokens``, also set once);
    ``num_cached_tokens_readmitted``: the most tokens one readmission after a preemption found there,
    prompt and generated tokens alike (None while it has not been readmitted). A preempted request
    can find more at its readmission than at first: its own full blocks, kept cached-free.
    """

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    first_token_step: int | None = None
    finished_step: int | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens_readmitted: int | None = None
    last_token_time: float | None = None
    paused_at_arrival: float = 0.0
    paused_time: float = 0.0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.last_token_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_time(self) -> float | None:
        """Wall seconds from arrival to finish, time paused included (None until finished)."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time + self.paused_time


@dataclass
class Logprob:
    """One candidate token's log-probability and its rank (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sample.

    ``finish_reason``: ``"stop"`` (EOS, stop token or stop string), ``"length"`` (max_tokens or
    max_model_len), ``"abort"``, ``"rejected"`` (never ran; see ``RequestOutput.error``), or
    None while running. ``stop_reason``: the stop string or token id that ended it.
    ``logprobs``: per generated token, a dict token_id -> Logprob (top-k plus the chosen one).
    ``metrics``: this sample's own times (vLLM V1 runs each of ``n`` samples as a child request with
    its own TTFT, TPOT and finish time); None where no engine sample stands behind it (a rejection).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    metrics: RequestMetrics | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one request: its prompt, its samples, its metrics.

    ``metrics`` are sample 0's (each sample's own are in ``outputs[i].metrics``).

    ``error`` holds the one-line reason when the request was rejected or failed.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held at the request's first admission (sample 0), as vLLM's
        ``RequestOutput.num_cached_tokens``: never above the prompt's length; a readmission's hit after
        a preemption is ``metrics.num_cached_tokens_readmitted``."""
        return self.metrics.num_cached_prompt_tokens


def error_summary(outputs: list[RequestOutput], noun: str = "prompt") -> str | None:
    """One line for the requests of ``outputs`` that ended with ``finish_reason == "error"`` (a tensor-parallel
    worker died, the device failed, a step failed), or None when none did.

    The reason is said once, however many requests share it: ``"2 of 3 prompts ended with an error: <reason>"``
    (``; N other reasons`` when they differ). The commands print it on stderr and end with status 1.
    """
    failed = [o for o in outputs if any(c.finish_reason == "error" for c in o.outputs)]
    if not failed:
        return None
    reasons = list(dict.fromkeys(o.error or "an engine error (no reason recorded)" for o in failed))
    more = f"; {len(reasons) - 1} other reason{'s' if len(reasons) > 2 else ''}" if len(reasons) > 1 else ""
    many = f"{noun}s" if len(outputs) != 1 else noun
    return f"{len(failed)} of {len(outputs)} {many} ended with an error: {reasons[0]}{more}"
