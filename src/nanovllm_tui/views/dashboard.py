"""Dashboard: phase, requests, KV memory, throughput, and the selected request streaming in; for an
engine split over ranks (tensor parallel), each rank's compute and all-reduce time in the newest step."""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from nanovllm_tui.widgets.live import LiveStatic, tail

from nanovllm_core.educational.commentary import plural
from nanovllm_core.educational.tp_facts import dashboard_lines
from nanovllm_tui.state import EngineState
from nanovllm_tui.views.base import EngineView
from nanovllm_tui.widgets.format import first_fitting, fmt_ms, request_color
from nanovllm_tui.widgets.kv_bar import KVMemoryBar
from nanovllm_tui.widgets.request_table import RequestTable
from nanovllm_tui.widgets.throughput import ThroughputPanel
from nanovllm_tui.widgets.topk_bars import TopKBars, chosen_piece

PHASE_STYLES = {"prefill": "bold #f5a524", "decode": "bold #3ecf8e", "prefill+decode": "bold #4ea1ff",
                "verify": "bold #c678dd",
                "idle": "bold cyan", "paused": "bold yellow", "loading": "bold magenta", "failed": "bold red",
                "disconnected": "bold red"}


def phase_text(state: EngineState, width: int = 0, rows: int = 0) -> Text:
    """The phase, what the newest step did with its token budget (labelled the last step while the
    engine is idle or paused), and the queues now; each line in as many words as ``width`` cells hold,
    and in at most ``rows`` lines (0: no limit) by sharing lines (:func:`packed`): at 80x24 the
    panel has 2 rows and its batch and queue lines were cut (trial 14e's check)."""
    phase = state.phase
    # "ended": a replay played to its end (trial 11: it still said DECODE beside its unfinished requests)
    parts = [[Text("RECORDING ENDED" if phase == "ended" else phase.upper(), PHASE_STYLES.get(phase, "bold"))]]
    plan = state.plan
    if plan is None:
        parts.append([Text("no step yet", style="dim")])
        return packed(parts, width, rows)
    prefill = sum(1 for s in plan.scheduled if s.kind == "prefill")
    verifying = [s for s in plan.scheduled if s.num_drafts]  # a prompt's last token may carry drafts too
    decode = sum(1 for s in plan.scheduled if s.kind == "decode" and not s.num_drafts)
    used = Text(f"{plan.num_batched_tokens}/{plan.token_budget}", style="bold")
    # The step's figures are current only while steps run; otherwise say they are the last step's.
    step = Text(f"step {plan.step}: ") if state.busy else Text(f"last step {plan.step}", style="dim")
    if state.step_open and not state.busy:  # a single step (n) still running while paused: not done yet (trial 11)
        step = Text(f"step {plan.step} running")
    if state.failed_step == plan.step:  # it never finished: its budget was planned, not used (trial 10)
        step = Text(f"step {plan.step} failed", style="bold red")
    if not state.busy or state.failed_step == plan.step:
        used = Text(": ", style="dim") + used
    # "tok" before dropping the unit: "last step 476: 1/512" lost it at 120 columns (issue 29). One unit for
    # every state at this width and step: trial 13 saw "step 23 running: 1/512 tok" beside "step 22: ... tokens".
    widest = f"step {plan.step} running: {plan.token_budget}/{plan.token_budget} tokens"
    unit = " tokens" if not width or len(widest) <= width else " tok"
    parts.append([step + used + unit, step + used, step])
    parts.append([Text(f"{prefill} prefill · {decode} decode"), Text(f"{prefill} pre · {decode} dec")])
    if verifying:  # a verification is not a one-token decode: it runs 1 + k tokens of one sequence
        drafts = sum(s.num_drafts for s in verifying)  # the drafts run, not the slots reserved
        parts.append([Text(f"{len(verifying)} verifying {plural(drafts, 'draft token')}"),
                      Text(f"{len(verifying)} verify · {plural(drafts, 'draft')}")])
    running, waiting, preempted = state.queue_counts()  # now, not as of the newest step
    # The engine counts samples (a request with n > 1 runs n), as the batch line above, StepTimed and
    # /metrics do: its number first, the requests beside it where they differ (trial 20d: "3 running"
    # beside "5 decode" while the engine's num_running was 5)
    samples_running, samples_waiting, of_running = state.queue_samples()
    run_words = [f"{running} running", f"{running} run"]
    if samples_running != running:
        run_words = [f"{samples_running} running ({plural(running, 'request')})",
                     f"{samples_running} run ({running} req)"]
    wait_words = [f"{waiting} waiting", f"{waiting} wait"]
    if samples_waiting != waiting:
        wait_words = [f"{samples_waiting} waiting ({plural(waiting, 'request')})",
                      f"{samples_waiting} wait ({waiting} req)"]
    if of_running:  # samples of a running request that wait for a slot (n > 1): no waiting request holds them
        whose = "1 sample of a running request" if of_running == 1 else f"{of_running} samples of running requests"
        wait_words = [f"{samples_waiting} waiting ({plural(waiting, 'request')} + {whose})" if waiting else
                      f"{samples_waiting} waiting ({whose})",
                      f"{samples_waiting} wait ({waiting} req + {of_running} of run)" if waiting else
                      f"{samples_waiting} wait (of running)"]
    queues = [Text(f"{run_words[0]} · {wait_words[0]}"), Text(f"{run_words[1]} · {wait_words[1]}")]
    if preempted:
        queues = [q + Text(f" · {preempted} preempted", style="bold red") for q in queues] + \
                 [queues[1] + Text(f" · {preempted} pre", style="bold red")]
    aborts = state.step_aborts
    if aborts:  # aborted between steps (while paused): the queues are after it, the batch line before (trial 36c)
        after = f"after {aborts[0]}'s abort: " if len(aborts) == 1 else f"after {len(aborts)} aborts: "
        # the plain counts last: where even "now:" does not fit, every count keeps its word (trial 40c: "now: 1 run
        # · 0 wait · 1" lost its "pre" at 120x40); the KV panel's title still names the abort
        queues = ([Text(after, style="dim") + q for q in queues] + [Text("now: ", style="dim") + q for q in queues]
                  + queues[-1:])
    parts.append(queues)
    return packed(parts, width, rows)


def packed(parts: list[list[Text]], width: int, rows: int) -> Text:
    """``parts`` (each its wordings, longest first) one a line, each in the longest wording that fits
    ``width`` (:func:`first_fitting`). While there are more lines than ``rows`` (0: no limit), two
    neighbours share a line, joined by " · ", where their joined wording fits ``width`` (the pair
    shortest together first), so a panel of fixed height shows them all; when none fits (a 60x20
    terminal) the lines past ``rows`` stay below the panel's edge, the least needed last (the queues:
    the header counts the active requests and the table lists them)."""
    lines = [list(p) for p in parts]
    while rows and len(lines) > rows:
        fits = [k for k in range(len(lines) - 1)
                if not width or lines[k][-1].cell_len + 3 + lines[k + 1][-1].cell_len <= width]
        if not fits:
            break
        i = min(fits, key=lambda k: lines[k][-1].cell_len + lines[k + 1][-1].cell_len)
        joined = [a + Text(" · ", style="dim") + b for a in lines[i] for b in lines[i + 1]]
        lines[i:i + 2] = [sorted(joined, key=lambda t: -t.cell_len)]
    return Text("\n").join(first_fitting(width, *line) for line in lines)


class DashboardView(EngineView):
    """The engine at a glance. The request table's highlighted row is the selected request."""

    def compose(self) -> ComposeResult:
        with Horizontal(id="dash-top"):
            yield LiveStatic(id="phase", classes="panel")
            yield KVMemoryBar(id="kv", classes="panel")
            yield ThroughputPanel(id="throughput", classes="panel")
        yield LiveStatic(id="dash-tp", classes="panel")
        yield RequestTable(id="requests", chosen=getattr(self.app, "select", None))  # the app's selection, at once
        with Horizontal(id="dash-bottom"):
            yield LiveStatic(id="output", classes="panel")
            yield TopKBars(id="topk", classes="panel")

    def on_mount(self) -> None:
        self.query_one("#phase").border_title = "Engine"
        self.query_one("#kv").border_title = "KV cache memory"
        self.query_one("#throughput").border_title = "Throughput"
        self.query_one("#output").border_title = "Selected request"
        self.query_one("#topk").border_title = "Top-k next tokens"
        self.query_one("#dash-tp").display = False  # shown only for a step split over ranks

    def main_widget(self) -> RequestTable:
        return self.query_one(RequestTable)

    def on_resize(self) -> None:
        self.update_view(self.app.state, self.app.selected)  # the panels fit their text to their widths

    def _show_split(self, state: EngineState) -> None:
        """Tensor parallel: where the newest step's time went on each rank (hidden for one process)."""
        panel = self.query_one("#dash-tp", LiveStatic)
        lines = dashboard_lines(state.timings[-1]) if state.timings else []
        panel.display = bool(lines)
        if lines:
            panel.border_title = f"Where the last step's time went ({state.timings[-1].tp_size} ranks)"
            panel.show_content(Text("\n".join(lines[:-1]) + "\n") + Text(lines[-1], style="dim"))

    def update_view(self, state: EngineState, selected: str | None) -> None:
        phase = self.query_one("#phase", LiveStatic)
        phase.show_content(phase_text(state, phase.content_region.width, phase.content_region.height))
        self.query_one(KVMemoryBar).show(state)
        self.query_one(ThroughputPanel).show(state)
        self._show_split(state)
        self.query_one(RequestTable).sync(state, selected)
        req = state.requests.get(selected) if selected else None
        output = self.query_one("#output", LiveStatic)
        topk = self.query_one(TopKBars)
        if req is None:
            output.border_title = "Selected request"
            empty = ("Type a prompt below and press Enter; its text streams in here." if getattr(self.app, "live", True)
                     else "No request selected: pick one of the recording's with ] or [.")  # a replay takes no prompts
            output.show_content(Text(state.no_engine or empty, style="dim"))
            topk.show((), None)
            return
        title = f"{req.request_id} · {req.state}"
        if req.n > 1:  # the row, this text and its top-k follow sample 0 (trial 11: nothing said there were more)
            title += f" · sample 0 of {req.n} (all in the Narrator)"
        room = output.size.width - 4 - cell_len(title)  # the border's corners and the spaces around the title
        output.border_title = title + paused_note(req, state.paused, room)
        text = exchange(req)
        if req.state == "running":
            text.append("▌", style="bold")
        if req.error:
            text.append(f"\n{req.error}", style="red")
        region = output.content_region  # show the end of the stream, as a terminal would
        output.show_content(tail(text, region.width, region.height, self.app.console))
        label = f"token #{req.num_output}: {chosen_piece(req.top, req.last_token_id, req.last_token)}" if req.num_output else ""
        if label and req.top_caption and not req.top_caption.endswith("own probabilities"):
            label += f" ({req.top_caption})"  # a processor changed these numbers: name each one
        topk.show(req.top, req.last_token_id, label)


# What the panel calls the prompt and the output: a chat's turns, raw text and its continuation, or
# (a request sent elsewhere: a replay, an attached server's other clients) plain prompt and output.
ROLES = {True: ("You (chat)", "Assistant"), False: ("Prompt (raw text)", "Continuation"), None: ("Prompt", "Output")}


def exchange(req) -> Text:
    """The selected request's prompt and output as two labelled turns, each label on a line of its
    own, so the output never reads as part of the prompt (the text itself is shown as is). A
    conversation sent elsewhere (a replay, an attached server's chat clients) is shown as its
    messages, one ``role: text`` per line, not as its chat template's raw rendering (trial 27b)."""
    asked, answered = ROLES[req.chat]
    text = Text()
    if req.chat is None and req.conversation:
        count = len(req.conversation)
        text.append(f"Chat ({count} message{'s' if count != 1 else ''})\n", style="bold")
        text.append("\n".join(f"{role}: {said}" for role, said in req.conversation), style="dim")
        answered = "Assistant"
    else:
        text.append(f"{asked}\n", style="bold")
        text.append(req.prompt, style="dim")
    text.append(f"\n{answered}\n", style="bold")
    text.append(req.text, style=f"bold {request_color(req.order)}")
    return text


def paused_notes(req, engine_paused: bool) -> list[str]:
    """The selected request's title's note on time held paused (its wall time differs from the
    engine's), longest first: the title takes the longest that fits its panel (cut, it read
    "...(not in TTFT/T…" at 120 columns: trial 10). Every form but the last keeps what the figure
    means, that it is not in TTFT/TPOT. Its figure grows only with its tokens (the engine's paused
    clock, read at each), so while the engine is held the note says "paused now" and counts only
    what came before: a figure shown as current did not move until the next key (issue 29).
    ``[""]`` when there is nothing to say."""
    earlier = fmt_ms(req.paused_s) if req.paused_s >= 0.001 else ""
    if req.live and engine_paused:
        if not earlier:
            return [" · paused now (not in TTFT/TPOT)", " · paused now"]
        return [f" · paused now, {earlier} before its last token (not in TTFT/TPOT)",
                f" · paused now, +{earlier} earlier (not in TTFT/TPOT)",
                f" · paused now (+{earlier}; not in TTFT/TPOT)", " · paused now"]
    if not earlier:
        return [""]
    so_far = " so far" if req.live else ""
    return [f" · {earlier} paused{so_far} (not in TTFT/TPOT)", f" · {earlier} paused (not in TTFT/TPOT)",
            f" · {earlier} paused, not in TTFT", f" · {earlier} paused"]


def paused_note(req, engine_paused: bool, width: int | None = None) -> str:
    """The longest of :func:`paused_notes` that fits ``width`` cells (None: the longest)."""
    notes = paused_notes(req, engine_paused)
    return next((n for n in notes if width is None or cell_len(n) <= width), notes[-1])
