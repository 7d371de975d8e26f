"""Prefill and decode throughput (tokens/s) now, each with a sparkline of recent steps."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical

from nanovllm_core.educational.commentary import plural
from nanovllm_tui.state import RATE_WINDOW, EngineState, mixed_step
from nanovllm_tui.widgets.format import first_fitting, fmt_ms, fmt_rate, sparkline
from nanovllm_tui.widgets.live import LiveStatic

STYLES = {"prefill": "#f5a524", "decode": "#3ecf8e"}


class ThroughputPanel(Vertical):
    """Tokens per second of engine time over the newest ``RATE_WINDOW`` steps that did prefill
    (decode) work while the engine runs (``EngineState.rate``: what the Narrator tells for a step);
    while it is idle or paused the headline says so (:func:`not_running`), not a 0 rate, and the rate
    of those steps is beside the sparkline ("last 3 steps 1,234 tok/s"); sparklines show each step's
    rate, one cell a step. While none of the kept steps (the newest ``HISTORY_STEPS``) did a kind's work (an
    app that attached to a server while its requests decoded, a decode longer than the history), that kind's
    headline reads ``-`` and says how many steps had none: no rate of them was measured.

    The rates leave out the time steps waited while the app drew a key's frame (``StepTimed.yielded_s``,
    ``nanovllm_core/yield_gate.py``); once there was any, the panel's bottom border says how much in all.
    Steps the X-Ray traced keep their capture in their rates (it runs inside the step); while any is among
    the newest ``RATE_WINDOW``, the border says so too. A step that prefilled and decoded together
    (``mixed_step``) is in neither rate nor sparkline (its time is shared by both kinds of rows); while any
    is among the newest ``RATE_WINDOW``, the border says so (trial 13b)."""

    def compose(self) -> ComposeResult:
        for kind in STYLES:
            yield LiveStatic(kind, id=f"{kind}-rate")
            yield LiveStatic(id=f"{kind}-spark")

    def show(self, state: EngineState) -> None:
        traced = sum(1 for t in list(state.timings)[-RATE_WINDOW:] if getattr(t, "traced", False))  # a deque
        width = self.size.width - 4
        mixed = sum(1 for t in list(state.timings)[-RATE_WINDOW:] if mixed_step(t))
        self.border_subtitle = border_captions(state.yielded_s, traced, mixed, width)
        # what the rates divide by, where it fits: the steps' own time, not the wall time a request's TPOT holds
        # (trial 39a: "decode 181 tok/s" beside a lone request's 35 ms TPOT read as a contradiction)
        self.border_title = "Throughput · step time" if width >= len("Throughput · step time") else "Throughput"
        rates = {kind: state.rate(kind) for kind in STYLES}
        per_step = {"prefill": [0.0 if mixed_step(t) else t.prefill_tokens_per_s for t in state.timings],
                    "decode": [0.0 if mixed_step(t) else t.decode_tokens_per_s for t in state.timings]}
        busy = state.busy
        sparks = {kind: self.query_one(f"#{kind}-spark", LiveStatic) for kind in STYLES}
        kept = plural(len(state.timings), 'step')
        unmeasured = ([" only mixed steps", " mixed only", " mixed only", " mixed", " -"] if mixed else
                      [f" none in the last {kept}", f" none in {kept}", " none lately", " none", " -"])
        # idle or paused: the newest steps' rate, or, where none of the kept steps did a kind's work, that
        # none did, as the headline says it while running (trial 33a: a blank line under "prefill idle")
        tails = last_rates({kind: None if busy or not state.timings else rates[kind] if rates[kind][1]
                            else unmeasured for kind in STYLES},
                           {kind: sparks[kind].content_region.width - min(KEEP_CELLS, len(per_step[kind]))
                            for kind in STYLES})
        # Not running: the headline says why in a word, not a "0 tok/s" that reads as measured beside the
        # last steps' measured rate (trial 24d #4: "prefill 0 tok/s" on every n while paused).
        still = None if busy else not_running(state)
        for kind, style in STYLES.items():
            rate, steps = rates[kind]
            figures = ([still] if still is not None else
                       ["- (only mixed steps)", "- (mixed only)", "-"] if not steps and mixed
                       # none of the kept steps did this kind's work (an app attached while a request
                       # decoded; a long decode): no rate was measured, and "0 tok/s" would read as one
                       # (trial 29c)
                       else [f"- (none in the last {kept})", f"- (none in {kept})", "- (none lately)", "-"]
                       if not steps
                       else [f"{fmt_rate(rate)} tok/s", fmt_rate(rate)])
            label = self.query_one(f"#{kind}-rate", LiveStatic)
            label.show_content(first_fitting(label.content_region.width,
                                             *[Text.assemble((f"{kind:<8}", "bold"), f) for f in figures]))
            tail = Text(tails[kind], style="dim")
            width = sparks[kind].content_region.width
            sparks[kind].show_content(sparkline(per_step[kind], max(0, width - tail.cell_len), style) + tail)


def not_running(state: EngineState) -> str:
    """The Throughput headline's word while no step runs: ``paused`` (the app paused; single steps
    taken with ``n`` included), ``idle`` (nothing to run), or the phase that stops it (``loading``,
    ``failed``, ``disconnected``, ``ended``: a replay that ended with requests unfinished)."""
    phase = state.phase
    if phase in ("paused", "loading", "failed", "ended", "idle", "disconnected"):
        return phase
    return "paused" if state.paused or state.engine_state == "paused" else "idle"


KEEP_CELLS = 2  # sparkline cells a rate's wording leaves at least (the newest steps)


def last_rates(last: dict[str, tuple[float, int] | None], room: dict[str, int]) -> dict[str, str]:
    """Each kind's rate of its newest steps, written after its sparkline while the engine is idle or
    paused (``last[kind]``: (tok/s, steps); five wordings of its own, longest first, for a kind no kept
    step did; None: nothing to write), in one wording for both kinds:
    the longest in which each fits its ``room`` (cells; 0 or less: not laid out yet, the longest).
    Trial 14e: at 100 columns " last 1 step 1.9 tok/s" wrapped its unit onto a row of its own, and
    the panel's 4 rows lost the decode sparkline and rate."""
    def wordings(rate: float, steps: int) -> list[str]:
        figure = f"{fmt_rate(rate)} tok/s"
        return [f" last {plural(steps, 'step')} {figure}", f" {plural(steps, 'step')} {figure}",
                f" last {figure}", f" {figure}", f" {fmt_rate(rate)}"]

    options = {kind: [""] * 5 if v is None else list(v) if isinstance(v, list) else wordings(*v)
               for kind, v in last.items()}
    level = next((i for i in range(5) if all(room[k] <= 0 or len(options[k][i]) <= room[k] for k in options)), 4)
    return {kind: words[level] for kind, words in options.items()}


def traced_caption(steps: int, width: int) -> str:
    """The bottom border when X-Ray-traced steps are among the newest ones: their capture ran inside the step
    and is in their rates (trial 12: rates over traced steps read as the engine's); "" when none."""
    if not steps:
        return ""
    variants = [f"X-Ray capture counted in {plural(steps, 'recent step')}' rates"
                if steps > 1 else "X-Ray capture counted in a recent step's rate",
                "X-Ray capture counted in rates", "X-Ray in rates"]
    return next((v for v in variants if len(v) <= width), variants[-1])


def mixed_caption(steps: int, width: int) -> str:
    """The bottom border when steps that prefilled and decoded together are among the newest ones: their time
    is shared by both kinds of rows, so they are in neither rate (trial 13b); "" when none."""
    if not steps:
        return ""
    variants = [f"{plural(steps, 'mixed prefill+decode step')} not in rates", "mixed steps not in rates",
                "mixed not in rates"]
    return next((v for v in variants if len(v) <= width), variants[-1])


def border_captions(yielded_s: float, traced: int, mixed: int, width: int) -> str:
    """The Throughput panel's bottom border: each note that applies (:func:`yielded_caption`,
    :func:`traced_caption`, :func:`mixed_caption`), in that order, each in the longest wording that
    fits its share of ``width`` cells. Where even their shortest wordings do not fit together, the
    keys' wait goes first, then the X-Ray's: a rate missing its mixed steps reads as wrong without
    its note (trial 22a: beside "keys 194 ms" the mixed-step note was dropped, the first note kept).
    The X-Ray's and the mixed steps' notes, which both change what the rates hold, share one phrase
    (:func:`traced_and_mixed_caption`) before the X-Ray's is dropped."""
    makers = [(2, lambda w: yielded_caption(yielded_s, w)), (1, lambda w: traced_caption(traced, w)),
              (0, lambda w: mixed_caption(mixed, w))]  # (rank: lower is kept longer, the note at a width)
    live = [(rank, make) for rank, make in makers if make(width)]
    while live:
        share = (width - 3 * (len(live) - 1)) // len(live)
        joined = " · ".join(make(share) for _, make in live)
        if len(joined) <= width:
            return joined
        if [rank for rank, _ in live] == [1, 0]:  # both notes that change what the rates hold: one phrase
            both = traced_and_mixed_caption(width)  # before the X-Ray's goes (trial 33a: a rate over a traced
            if both:  # step read 2.4 tok/s under "mixed not in rates" alone, at 120 columns)
                return both
        live.remove(max(live, key=lambda m: m[0]))
    return ""


def traced_and_mixed_caption(width: int) -> str:
    """Both notes in one phrase, where they do not fit apart: X-Ray capture in the rates, mixed steps
    out of them; "" where even its shortest wording does not fit ``width``."""
    variants = ["rates: X-Ray capture in, mixed steps out", "rates: X-Ray in, mixed out", "X-Ray in, mixed out"]
    return next((v for v in variants if len(v) <= width), "")


def yielded_caption(seconds: float, width: int) -> str:
    """The Throughput panel's bottom border: the steps' waits for this app's keys (``StepTimed.yielded_s``),
    in the longest wording that fits ``width`` cells; "" when there were none."""
    if seconds < 0.0005:
        return ""
    figure = fmt_ms(seconds)
    variants = [f"{figure} waited for your keys (not in rates)", f"{figure} for keys, not in rates",
                f"keys {figure}, not in rates", f"keys {figure}"]
    return next((v for v in variants if len(v) <= width), variants[-1])
