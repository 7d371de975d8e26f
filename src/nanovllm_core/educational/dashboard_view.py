"""``--dashboard``: a Rich live view of the engine while it generates.

It shows the phase of the current step (prefill, decode or both), progress through the
layers, each request's prefill and decode progress and its preemptions (the prompt bar counts
each prompt token once; the tokens a preemption made the engine compute again are told beside it),
the KV cache (blocks and bytes), tokens
per second, the text being generated and the latest top predictions, all from the engine's
events; for an engine split over ranks (tensor parallel), each rank's compute and all-reduce
time in the last step.

Layer progress is shown only when it is measured: the engine's forward pass runs all layers
in one call and reports nothing per layer, unless X-Ray capture is on (``--xray``), whose
``LayerTrace`` events arrive layer by layer. Without them the dashboard shows step progress
and says that layers are not measured, and why: no ``--xray``, a step X-Ray did not choose, or an
engine split over ranks (tensor parallel), which X-Ray does not trace.

On a terminal the view is a ``rich.live.Live`` region redrawn as events arrive; anything
else printed through the same console (the narrator, X-Ray) appears above it. When the
console is not a terminal (a pipe, a log file) no frames are drawn: one static snapshot of
the final state is printed by :meth:`DashboardView.stop`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.measure import Measurement
from rich.text import Text

from nanovllm_core import events as ev
from nanovllm_core.educational.commentary import plural
from nanovllm_core.educational.narrator import human_bytes, ms
from nanovllm_core.educational.narrator_sampling import table_caption
from nanovllm_core.educational.rich_parts import topk_table
from nanovllm_core.educational.tp_facts import across_ranks, dashboard_lines, tp_size

MIN_REDRAW_S = 0.05  # token and layer events redraw at most this often; step ends always redraw
MAX_REQUEST_ROWS = 8
BAR = 30  # progress bar width in cells


def rate(tokens_per_s: float) -> str:
    """Tokens/s with one decimal below 100 (a slow CPU step is not shown as 0), none above."""
    return f"{tokens_per_s:,.1f}" if tokens_per_s < 100 else f"{tokens_per_s:,.0f}"



class NewestText:
    """A stream's text in a table cell: its newest words, cut at the left ("…" first) to the cell's
    width. (Cutting at a fixed 40 characters and then at the right showed a window from the middle:
    neither the start nor the newest text; issue 29, trial 5.)"""

    def __init__(self, text: str) -> None:
        self.text = text

    def __rich_measure__(self, console, options) -> Measurement:
        width = Text(self.text).cell_len
        return Measurement(min(width, 12), min(width, options.max_width))

    def __rich_console__(self, console, options):
        text = Text(self.text, no_wrap=True, overflow="crop")
        width = options.max_width
        if text.cell_len > width:
            tail = self.text[-(width - 1):] if width > 1 else ""
            while tail and Text(tail).cell_len > width - 1:  # wide characters take two cells
                tail = tail[1:]
            text = Text("…" + tail, no_wrap=True, overflow="crop")
        yield text

@dataclass
class _Request:
    prompt: str
    prompt_len: int
    max_tokens: int | None
    state: str = "waiting"
    computed: int = 0
    generated: int = 0
    text: str = ""
    finish_reason: str | None = None
    preemptions: int = 0  # of any of its samples
    recomputed: int = 0   # tokens computed again after a preemption (prompt and generated)


class DashboardView:
    """The live dashboard. Call it with every event; :meth:`start` before generating, :meth:`stop` after.

    Args:
        console: the shared console (a terminal gets live frames; anything else one final snapshot).
        model_info: ``LLMEngine.model_info()`` for the header, layer count and KV sizes.
        xray: X-Ray capture was asked for (``--xray``), so the Layers row does not tell the reader to add it.
    """

    def __init__(self, console: Console, model_info: dict[str, Any] | None = None, xray: bool = False) -> None:
        self.console = console
        self.info = dict(model_info or {})
        self.xray = xray
        self.requests: dict[str, _Request] = {}
        self.phase = "idle"
        self.step: int | None = None
        self.num_steps = 0
        self.layers_done = 0
        self.layers_traced_now = False   # this step's layers are reported by X-Ray traces
        self.layers_ever_traced = False
        self.layer_request: str | None = None
        self.kv: ev.StepTimed | None = None
        self.peak_kv_bytes = 0
        self.last_step: ev.StepTimed | None = None
        self.traced_steps = 0  # steps the X-Ray captured: their capture is in the step times and rates
        self.top: tuple[ev.TopToken, ...] = ()
        self.top_request: str | None = None
        self.top_chosen: str | None = None
        self.top_chosen_id: int | None = None  # the row marked chosen: by id (a byte piece's text is "" or one of many alike)
        self.top_caption = ""
        self._sampling: dict[str, dict] = {}
        self.focus: str | None = None
        self.started: float | None = None
        self.ended: float | None = None
        self._plan: ev.StepPlanned | None = None
        # Preemptions and their recompute (trial 13b: the panel showed "Prefill 11/11 prompt tokens" and
        # no preemption while the engine counted one): seq id -> tokens computed, and -> computed when preempted.
        self.preemptions = 0
        self.recomputed = 0
        self._computed: dict[int, int] = {}
        self._lost: dict[int, int] = {}
        self._live: Live | None = None
        self._last_draw = 0.0

    # ------------------------------------------------------------------ lifecycle

    @property
    def live(self) -> bool:
        return self._live is not None

    def start(self) -> None:
        """Begin live frames if the console is a terminal (else nothing until :meth:`stop`)."""
        if self.console.is_terminal and self._live is None:
            self._live = Live(self.render(), console=self.console, auto_refresh=False, transient=False)
            self._live.start()

    def stop(self) -> None:
        """Draw the final state: the last live frame stays on screen, or a snapshot is printed."""
        self.phase = "done" if self.requests and all(r.state == "finished" for r in self.requests.values()) \
            else self.phase
        if self._live is not None:
            self._live.update(self.render(), refresh=True)
            self._live.stop()
            self._live = None
        else:
            self.console.print(self.render())

    def subscribe(self, engine) -> Any:
        """Subscribe to ``engine`` (an ``LLMEngine``) for top-5 predictions; block snapshots are not needed."""
        return engine.subscribe(self, topk=5, blocks=False, xray=False)

    # ------------------------------------------------------------------ events

    def __call__(self, event: ev.Event) -> None:
        redraw = False
        if isinstance(event, ev.ModelLoading) and event.ready and event.model_info:
            self.info.update(event.info())
        elif isinstance(event, ev.RequestAdded):
            self.requests[event.request_id] = _Request(event.prompt or "", len(event.prompt_token_ids),
                                                       event.max_tokens)
            self.focus = self.focus or event.request_id
            self._sampling[event.request_id] = dict(event.sampling)
        elif isinstance(event, ev.RequestRejected):
            self.requests[event.request_id] = _Request("", 0, 0, state="rejected")
        elif isinstance(event, ev.StepPlanned):
            self._planned(event)
        elif isinstance(event, ev.LayerTrace):
            if event.step == self.step:
                self.layers_traced_now = self.layers_ever_traced = True
                self.layers_done = event.layer + 1
                self.layer_request = event.request_id
                redraw = self._due()
        elif isinstance(event, ev.TokenSampled):
            r = self.requests.get(event.request_id)
            if r is not None and event.index == 0:
                r.generated = event.num_output_tokens
                r.text += event.text
            self.top, self.top_request = event.top, event.request_id
            self.top_chosen, self.top_chosen_id = event.token_text or event.special, event.token_id
            self.top_caption = table_caption(event, self._sampling.get(event.request_id, {}))
            self.focus = event.request_id if self.focus not in self._active() else self.focus
            redraw = self._due()
        elif isinstance(event, ev.RequestFinished):
            r = self.requests.get(event.request_id)
            if r is not None:
                r.state, r.finish_reason = "finished", event.finish_reason
                r.generated, r.text = event.num_output_tokens, event.output_text
        elif isinstance(event, ev.StepTimed):
            self._timed(event)
            redraw = True
        if redraw and self._live is not None:
            self._last_draw = time.perf_counter()
            self._live.update(self.render(), refresh=True)

    def _due(self) -> bool:
        return time.perf_counter() - self._last_draw >= MIN_REDRAW_S

    def _active(self) -> list[str]:
        return [rid for rid, r in self.requests.items() if r.state == "running"]

    def _planned(self, plan: ev.StepPlanned) -> None:
        if not plan.scheduled:
            return
        self.started = self.started or time.perf_counter()
        self._plan = plan
        self.step = plan.step
        kinds = {s.kind for s in plan.scheduled}
        self.phase = "prefill + decode" if len(kinds) > 1 else kinds.pop()
        self.layers_done = 0
        self.layers_traced_now = False
        self._lost = {q: n for q, n in self._lost.items() if self._computed.get(q, 0) < n}
        for q in plan.preempted:
            self.preemptions += 1
            r = self.requests.get(q.request_id)
            if r is not None:
                r.preemptions += 1
                if q.index == 0:
                    r.state, r.computed = "preempted", 0
            if q.seq_id in self._computed:
                self._lost[q.seq_id] = max(self._computed.pop(q.seq_id), self._lost.get(q.seq_id, 0))
        for s in plan.scheduled:
            r = self.requests.get(s.request_id)
            if r is not None and s.index == 0:
                r.state = "running"
            if s.kind == "prefill" and s.seq_id in self._lost:  # the part it had computed before: again
                again = max(0, min(s.start + s.num_own_tokens, self._lost[s.seq_id]) - s.start)
                self.recomputed += again
                if r is not None:
                    r.recomputed += again
            # drafts count once kept: the next plan's start says so
            self._computed[s.seq_id] = s.start + (s.num_own_tokens if s.kind == "prefill" else 1)

    def _timed(self, t: ev.StepTimed) -> None:
        self.num_steps += 1
        self.kv = self.last_step = t
        self.traced_steps += bool(getattr(t, "traced", False))
        self.peak_kv_bytes = max(self.peak_kv_bytes, t.kv_bytes_used)
        self.ended = time.perf_counter()
        if self._plan is not None:
            for s in self._plan.scheduled:
                r = self.requests.get(s.request_id)
                if r is not None and s.index == 0:
                    r.computed = max(r.computed, min(s.start + s.num_tokens, r.prompt_len))
        self._plan = None

    # ------------------------------------------------------------------ drawing

    @property
    def total_generated(self) -> int:
        return sum(r.generated for r in self.requests.values())

    def render(self) -> RenderableType:
        """The whole dashboard as one Rich renderable."""
        i = self.info
        header = Text.assemble(("Model: ", "bold"), str(i.get("model_name", "?")), "   ", ("Device: ", "bold"),
                               str(i.get("device", "?")), "   ", ("Dtype: ", "bold"), str(i.get("dtype", "?")))
        body: list[RenderableType] = [header, self._progress(), self._request_table(), self._memory_and_speed()]
        split = dashboard_lines(self.last_step) if self.last_step is not None else []
        if split:  # a step split over ranks (tensor parallel): its compute and all-reduce time per rank
            body.append(Panel(Text("\n".join(split[:-1]) + "\n") + Text(split[-1], style="dim"),
                              title=f"Where the last step's time went ({self.last_step.tp_size} ranks)",
                              title_align="left"))
        body.append(self._text_panel())
        if self.top:
            chosen = tuple("chosen" if t.token_id == self.top_chosen_id else "" for t in self.top)
            body.append(Panel(topk_table([(t.text, t.prob) for t in self.top], notes=chosen),
                              title=f"Top predictions (request {self.top_request}, latest token)", title_align="left",
                              subtitle=self.top_caption, subtitle_align="left"))
        return Panel(Group(*body), title="nano-vLLM inference dashboard", border_style="cyan")

    def _layers_hint(self) -> str:
        """Why the Layers row has no per-layer bar, true for the options given: a split engine
        (tensor parallel) captures nothing, so --xray cannot help there; with --xray on a single
        engine only the steps X-Ray chooses are traced; only without it does the hint name --xray."""
        tp = tp_size(self.info)
        if tp > 1:
            return f"not measured per layer: an engine split over {tp} ranks is not traced"
        if self.xray:
            return "not measured per layer: X-Ray traces chosen steps only"
        return "not measured per layer; --xray traces them"

    def _progress(self) -> Panel:
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold", width=9)
        grid.add_column(width=BAR)
        grid.add_column()
        grid.add_row("Phase", Text(self.phase.upper(), style="bold yellow"),
                      f"step {self.step if self.step is not None else '-'} ({self.num_steps} steps run)")
        layers = self.info.get("num_layers")
        if self.layers_traced_now and layers:
            grid.add_row("Layers", ProgressBar(total=layers, completed=self.layers_done, width=BAR),
                         f"{self.layers_done}/{layers} (X-Ray, request {self.layer_request})")
        elif self.layers_ever_traced:
            grid.add_row("Layers", Text("not traced in this step", style="dim"),
                         Text("X-Ray traces chosen steps only", style="dim"))
        else:
            grid.add_row("Layers", Text(f"all {layers or '?'} in one call", style="dim"),
                         Text(self._layers_hint(), style="dim"))
        prompt_total = sum(r.prompt_len for r in self.requests.values())
        prompt_done = sum(r.computed for r in self.requests.values())
        note = ""
        if self.preemptions:  # the bar counts prompt tokens once: a preemption's recompute is told beside it
            note = (f"; {plural(self.preemptions, 'preemption')}, {plural(self.recomputed, 'token')} recomputed "
                    "(not in the bar)")
        grid.add_row("Prefill", ProgressBar(total=max(prompt_total, 1), completed=prompt_done, width=BAR),
                     f"{prompt_done}/{prompt_total} prompt tokens{note}")
        limits = [r.max_tokens for r in self.requests.values() if r.state != "rejected"]
        total = sum(m for m in limits if m) if limits and all(limits) else None
        gen = self.total_generated
        grid.add_row("Decode", ProgressBar(total=total or max(gen, 1), completed=gen, width=BAR),
                     f"Tokens generated: {gen}" + (f" of up to {total}" if total else ""))
        return Panel(grid, title="Progress", title_align="left")

    def _request_table(self) -> RenderableType:
        if len(self.requests) <= 1:
            return Text("")
        table = Table(box=None, header_style="bold", padding=(0, 1))
        for col in ("request", "state", "prefill", "decode", "preempted", "text"):
            table.add_column(col)
        for rid, r in list(self.requests.items())[:MAX_REQUEST_ROWS]:
            state = r.state + (f" ({r.finish_reason})" if r.finish_reason else "")
            table.add_row(rid, state, f"{r.computed}/{r.prompt_len}",
                          f"{r.generated}/{r.max_tokens if r.max_tokens else '?'}",
                          str(r.preemptions) + (f" ({r.recomputed} again)" if r.recomputed else ""),
                          NewestText(r.text.replace("\n", " ")))
        if len(self.requests) > MAX_REQUEST_ROWS:
            table.add_row("...", f"{len(self.requests) - MAX_REQUEST_ROWS} more", "", "", "", "")
        return Panel(table, title="Requests", title_align="left")

    def _memory_and_speed(self) -> Table:
        kv = self.kv
        mem = Table.grid(padding=(0, 1))
        if kv is not None and kv.num_blocks_total:
            n = tp_size(self.info)
            mem.add_row("KV reserved", f"{human_bytes(kv.kv_bytes_used)} of {human_bytes(kv.kv_bytes_total)} (whole blocks)"
                        + (f" across {n} ranks" if n > 1 else ""))
            if n > 1:  # the engine's KV bytes are totals over the ranks: each holds its KV heads' slice
                mem.add_row("", f"{human_bytes(kv.kv_bytes_used / n)} of {human_bytes(kv.kv_bytes_total / n)} on each rank")
            mem.add_row("Peak", f"{human_bytes(self.peak_kv_bytes)} reserved{across_ranks(self.peak_kv_bytes, n, human_bytes)}")
            mem.add_row("", ProgressBar(total=kv.num_blocks_total, completed=kv.num_blocks_used, width=24))
            mem.add_row("Blocks", f"{kv.num_blocks_used}/{kv.num_blocks_total} used, {kv.num_blocks_cached} cached-free")
        else:
            mem.add_row("KV cache", "no step yet")
        speed = Table.grid(padding=(0, 1))
        last = self.last_step
        if last is not None:
            # a step the X-Ray traced has its capture in its time (trial 12): its rates say so
            which = "(last step, X-Ray capture included)" if getattr(last, "traced", False) else "(last step)"
            if last.num_prefill_tokens and last.num_decode_tokens:
                # a mixed step's time is shared by its prefill and decode rows (trial 13b): neither kind's
                # tokens over it is a rate of that kind, so the rate of all its tokens is told instead
                speed.add_row("All tokens", f"{rate(last.num_tokens / last.wall_time_s) if last.wall_time_s > 0 else '-'}"
                              f" tok/s {which}")
                speed.add_row("", Text(f"(a mixed step: {last.num_prefill_tokens} prefill + {last.num_decode_tokens} "
                                       "decode or draft tokens share its time, so no prefill or decode rate of "
                                       "its own)", style="dim"))
            else:  # a kind the last step ran none of has no rate: '0.0 tok/s' read as measured (trial 26a)
                for kind, tokens, per_s in (("Prefill", last.num_prefill_tokens, last.prefill_tokens_per_s),
                                            ("Decode", last.num_decode_tokens, last.decode_tokens_per_s)):
                    speed.add_row(kind, f"{rate(per_s)} tok/s {which}" if tokens else
                                  f"- (the last step had no {kind.lower()} tokens)")
            elapsed = (self.ended or 0) - (self.started or 0)
            if elapsed > 0:
                # engine steps only: from the first step's plan to the last step's end. The command's
                # own total (cli.py) is wall time around generate(), tokenizing and detokenizing included.
                speed.add_row("Overall", f"{rate(self.total_generated / elapsed)} tok/s over {elapsed:.2f} s")
                speed.add_row("", Text("(engine steps only" + (f", {plural(self.traced_steps, 'step')} with the X-Ray "
                                       "capture in them)" if self.traced_steps else ")"), style="dim"))
            speed.add_row("Step time", ms(last.wall_time_s) + (" (X-Ray capture included)"
                                                               if getattr(last, "traced", False) else ""))
        else:
            speed.add_row("Throughput", "no step yet")
        outer = Table.grid(expand=True, padding=(0, 1))
        outer.add_column(ratio=1)
        outer.add_column(ratio=1)
        outer.add_row(Panel(mem, title="Memory", title_align="left"),
                      Panel(speed, title="Throughput", title_align="left"))
        return outer

    def _text_panel(self) -> Panel:
        r = self.requests.get(self.focus) if self.focus else None
        if r is None:
            return Panel(Text("waiting for a request", style="dim"), title="Generated text", title_align="left")
        cursor = "█" if r.state != "finished" else ""
        body = Text.assemble((r.prompt, "dim"), (r.text, "bold"), cursor)
        # the prompt (dim) comes first: the title says so (trial 41e: "Generated text" held the prompt too)
        return Panel(body, title=f"Request {self.focus}: prompt (dim), then generated text", title_align="left")
