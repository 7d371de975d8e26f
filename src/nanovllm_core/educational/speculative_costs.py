"""What speculative decoding gains on the machine at hand: the Leviathan et al. formula with measured costs.

Leviathan, Kalman and Matias 2023 ("Fast Inference from Transformers via Speculative
Decoding"), with ``alpha`` the acceptance rate (the chance that the target keeps a draft
token), ``gamma`` drafts per step and ``c`` the drafter's cost per draft token as a fraction
of one target decode step:

- Theorem 3.8 / equation (1): one verification step yields
  ``(1 - alpha^(gamma + 1)) / (1 - alpha)`` tokens on average (the kept drafts, plus the
  target's own token);
- Theorem 3.8: the expected wall-time speed-up is that divided by ``gamma c + 1``. The ``+ 1``
  is the verification, assumed to cost one target step (true where a step is bound by
  reading the weights, as on a GPU at small batch). Where verifying ``1 + gamma`` tokens costs
  ``v`` target steps, the same argument divides by ``gamma c + v``: :func:`speedup` takes ``v``.

The costs come from a run on this engine (:func:`measure`): a plain decode step's wall time,
a verification step's wall time, and the part of it the proposer took (the engine's step
wall time includes drafting). Timings are medians of the run's steps, so they are of this
machine, now, including whatever else it was doing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from nanovllm_core import events as ev
from nanovllm_core.educational.commentary import ms


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens one verification yields on average: ``(1 - alpha^(gamma+1)) / (1 - alpha)`` (``gamma + 1`` at alpha 1)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(alpha: float, gamma: int, c: float, v: float = 1.0) -> float:
    """Expected speed-up over plain decoding: ``expected_tokens / (gamma c + v)`` (Theorem 3.8 at ``v = 1``)."""
    return expected_tokens(alpha, gamma) / (gamma * c + v)


def acceptance_rate(steps: list[ev.SpecDecodeStep]) -> float | None:
    """Accepted drafts over drafts the target judged (the ones after a rejection are dropped, not judged)."""
    judged = accepted = 0
    for s in steps:
        for ok in s.accepted:
            judged += 1
            if not ok:
                break
            accepted += 1
    return accepted / judged if judged else None


@dataclass(frozen=True)
class Measured:
    """One run's costs, in seconds (medians over steps), and what it drafted and kept.

    ``decode_s``: a plain one-token decode step (speculation off, same prompt);
    ``verify_s``: a step that verified drafts, drafting included; ``draft_s``: the proposer's
    part of it; ``gamma``: drafts per verification (the configured number); ``mean_drafts``:
    drafts actually proposed per verification; ``alpha``: :func:`acceptance_rate`;
    ``tokens_per_verify``: tokens a verification step kept, measured;
    ``plain_s_per_token`` / ``spec_s_per_token``: decode wall time per generated token.
    """

    decode_s: float
    verify_s: float
    draft_s: float
    gamma: int
    mean_drafts: float
    alpha: float
    tokens_per_verify: float
    plain_s_per_token: float
    spec_s_per_token: float
    proposer: str = "ngram"

    @property
    def c(self) -> float:
        """The drafter's cost per draft token, in target decode steps."""
        return self.draft_s / self.decode_s / max(self.mean_drafts, 1e-9)

    @property
    def v(self) -> float:
        """A verification's forward pass (drafting excluded), in target decode steps."""
        return (self.verify_s - self.draft_s) / self.decode_s


def measure(make_engine: Callable[..., Any], prompt: str, params: Any, gamma: int, proposer: str = "ngram",
            on_event: Callable[[ev.Event], None] | None = None) -> Measured | None:
    """Run ``prompt`` twice on fresh engines, without and with speculation, and time their decode steps.

    ``make_engine(**settings)`` builds an engine (e.g. ``EngineDemos.engine``); ``on_event``
    also receives the speculative run's events (a demonstration narrates them). Returns None
    when the speculative run verified no drafts or the plain run had no decode step.
    """
    plain = _run(make_engine(), prompt, params)
    engine = make_engine(speculative_model=proposer, num_speculative_tokens=gamma)
    drafting: dict[int, float] = {}
    spec = engine.speculator
    propose = spec.propose

    def timed_propose(scheduled):  # the engine's step time includes drafting: time that part
        t0 = time.perf_counter()
        try:
            return propose(scheduled)
        finally:
            drafting[engine.step_index] = time.perf_counter() - t0

    spec.propose = timed_propose
    try:
        events = _run(engine, prompt, params, on_event)
    finally:
        del spec.propose
    decode = [t.wall_time_s for t in plain if isinstance(t, ev.StepTimed) and t.num_prefill_tokens == 0]
    verifications = [e for e in events if isinstance(e, ev.SpecDecodeStep)]
    verified = {e.step for e in verifications}
    kept: dict[int, int] = {}
    for e in events:
        if isinstance(e, ev.TokenSampled) and e.step in verified:
            kept[e.step] = kept.get(e.step, 0) + 1
    timed = {t.step: t.wall_time_s for t in events if isinstance(t, ev.StepTimed)}
    alpha = acceptance_rate(verifications)
    if not decode or not verified or alpha is None:
        return None
    spec_decode = [t for t in events if isinstance(t, ev.StepTimed) and t.num_prefill_tokens == 0]
    spec_tokens = sum(1 for e in events if isinstance(e, ev.TokenSampled)
                      and e.step in {t.step for t in spec_decode})
    return Measured(
        decode_s=statistics.median(decode),
        verify_s=statistics.median(timed[s] for s in verified),
        draft_s=statistics.median(drafting.get(s, 0.0) for s in verified),
        gamma=gamma,
        mean_drafts=sum(len(e.draft_tokens) for e in verifications) / len(verifications),
        alpha=alpha,
        tokens_per_verify=sum(kept.values()) / len(verified),
        plain_s_per_token=sum(decode) / len(decode),
        spec_s_per_token=sum(t.wall_time_s for t in spec_decode) / max(spec_tokens, 1),
        proposer=proposer,
    )


def _run(engine: Any, prompt: str, params: Any, on_event: Callable[[ev.Event], None] | None = None) -> list[ev.Event]:
    events: list[ev.Event] = []

    def keep(e: ev.Event) -> None:
        events.append(e)
        if on_event is not None:
            on_event(e)

    engine.subscribe(keep, topk=5 if on_event is not None else 0, blocks=on_event is not None)
    engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return events


def host_load() -> str:
    """``" (load average 6.2 on 2 cores)"`` when the host's 1-minute load exceeds its cores, else ``""``
    (also where the platform has no load average)."""
    import os

    from nanovllm_core.host_load import BUSY_LOAD_PER_CORE, load_average

    load = load_average()
    cores = os.cpu_count() or 1
    if not load or load[0] <= BUSY_LOAD_PER_CORE * cores:  # the benchmarks' limit (host_load.busy_host_note)
        return ""
    return f" (load average {load[0]:.1f} on {cores} core{'' if cores == 1 else 's'})"


def measured_v_words(m: Measured, load: str | None = None) -> str:
    """The sentence on the speed-up with the measured v: the formula's figure, or, when v < 1 (a
    verification of 1 + drafts tokens measured cheaper than a one-token decode step, which more work
    cannot be), that the figure is noise and none is claimed. ``load``: :func:`host_load`'s words
    (None: read now)."""
    if m.v >= 1:
        gain = speedup(m.alpha, m.gamma, m.c, m.v)
        return (f"with the measured v it is over (gamma c + v): {gain:.2f}x (the yield is at gamma = {m.gamma} drafts "
                f"every step, v at the {m.mean_drafts:.1f} drafts verified on average: a longer verification would "
                "cost more)")
    load = host_load() if load is None else load
    busy = f"the host was busy{load}" if load else "other work on the machine, or the cache warming up"
    return (f"the measured v = {m.v:.2f} is below 1, a verification of 1 + {m.mean_drafts:.1f} tokens cheaper than a "
            f"one-token decode step, which more work cannot be: it is noise between two medians ({busy}), so no "
            f"speed-up is computed from it; the v = 1 figure above is the most the formula allows. Rerun on a quiet "
            "machine for a true v")


def cost_words(m: Measured, load: str | None = None) -> str:
    """The chapter's measured paragraph: the costs, the formula with them, and the speed-up seen.
    ``load``: the host's load in words for a v below 1 (None: :func:`host_load` now)."""
    ideal = speedup(m.alpha, m.gamma, m.c)
    return (f"Measured on this machine just now (medians): a plain decode step {ms(m.decode_s)}; a step "
            f"verifying up to {m.gamma} drafts (on average {m.mean_drafts:.1f}) {ms(m.verify_s)}, of which "
            f"drafting took {ms(m.draft_s, digits=2)}. So the verifying forward pass costs v = {m.v:.2f} decode "
            f"steps and the {m.proposer} drafter c = {m.c:.3f} of a step per draft. "
            f"The acceptance rate was alpha = {m.alpha:.2f} (accepted drafts over drafts judged). Leviathan et al. "
            f"2023, Theorem 3.8: a step yields (1 - alpha^(gamma+1)) / (1 - alpha) = "
            f"{expected_tokens(m.alpha, m.gamma):.2f} tokens on average at gamma = {m.gamma} drafts every step "
            f"(measured: {m.tokens_per_verify:.2f}, with {m.mean_drafts:.1f} drafts proposed per step), and "
            f"the speed-up is that over (gamma c + 1) = {ideal:.2f}x if verification cost one decode step; "
            f"{measured_v_words(m, load)}. Engine step time "
            f"per decoded token in these two runs (time between steps, such as narration, left out): "
            f"{ms(m.plain_s_per_token)} plain, {ms(m.spec_s_per_token)} speculative "
            f"({m.plain_s_per_token / m.spec_s_per_token:.2f}x).")
