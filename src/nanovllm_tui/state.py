"""What the app knows about the engine: a fold of its events, kept on the UI thread.

Every view draws from one :class:`EngineState`. It is plain Python (no Textual), so the
rules it follows (how a request's state, prefill progress, TTFT and TPOT are derived from
the event stream) can be tested on their own. Times come from the events' own ``time``
fields, never from the clock, so a replayed trace always looks the same.
"""

from __future__ import annotations

import collections
import dataclasses

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from nanovllm_core import events as ev
from nanovllm_core.educational.narrator_sampling import table_caption
from nanovllm_tui.widgets.format import visible_text

HISTORY_STEPS = 120  # StepTimed records kept for sparklines
# engine_state when what the app shows can no longer be confirmed (remote.RemoteController.state)
LOST = ("stopped", "disconnected", "key refused", "key needed")
RATE_WINDOW = 10  # steps averaged for the throughput figures
MAX_FINISHED = 200  # finished requests kept in the table


BUSY_PHASES = ("prefill", "decode", "verify")  # what a step's batch held, in the order a busy phase names them


@dataclass
class RequestView:
    """One request as the app shows it.

    ``state``: ``submitted`` (sent, the engine has not added it yet, e.g. while the model
    loads), ``waiting``, ``running``, ``preempted``, ``finished`` or ``rejected``.
    Token counts in tokens, times in seconds.
    """

    request_id: str
    prompt: str
    priority: int | None = 0  # None: not known (a request refused before the engine added it, seen elsewhere)
    max_tokens: int | None = None
    chat: bool | None = None  # sent as a user's chat message (True), as raw text (False), or not known (sent elsewhere)
    n: int = 1  # samples of the prompt (a client's n); the app follows sample 0, the Narrator tells them all
    # a conversation's (role, text) per message (RequestAdded.chat), as sent; empty for a text or token-id prompt
    conversation: tuple[tuple[str, str], ...] = ()
    state: str = "submitted"
    prompt_len: int | None = None
    prompt_pieces: tuple[str, ...] = ()
    prefilled: int = 0
    num_cached: int = 0
    num_output: int = 0
    text: str = ""
    top: tuple[ev.TopToken, ...] = ()
    top_caption: str = ""  # which distribution ``top`` is, naming every processor that changed it
    sampling: dict = field(default_factory=dict)  # the request's non-default sampling settings
    last_token: str = ""
    last_token_id: int | None = None
    added_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_ttft: float | None = None
    finished_tpot: float | None = None
    # the engine's own TTFT / TPOT so far (TokenSampled.ttft_s / tpot_s; None from older traces)
    engine_ttft: float | None = None
    engine_tpot: float | None = None
    finished_paused: float | None = None
    # the engine's paused seconds so far (EngineState.paused_clock) when it arrived / at its first and newest token
    paused_at_added: float = 0.0
    paused_at_first: float = 0.0
    paused_at_last: float = 0.0
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    order: int = 0  # arrival number in this session (picks the request's colour)
    # the first and newest step that ran it (sample 0; StepPlanned.scheduled): what the X-Ray says of a
    # trace older than its steps (trial 21d)
    first_step: int | None = None
    last_step: int | None = None
    # a replay's end: the state it had at the last step played (it is "unfinished" since; see recording_ended)
    ended_as: str | None = None
    # n > 1: sample 0 (whose figures the row shows) has ended while other samples run on (trial 35e: the row
    # read "running · sample 0 of 3" beside sample 0's finished 30/30); no event says so, the plans do
    sample0_done: bool = False
    # the sample indexes any plan's queues have held: n > 1 samples beyond sample 0 wait outside the queues
    # until its prompt is in the prefix cache, then join the waiting queue at that step's end (trial 37c)
    samples_queued: set[int] = dataclasses.field(default_factory=set)

    @property
    def live(self) -> bool:
        """Still queued or running (abortable)."""
        return self.state in ("submitted", "waiting", "running", "preempted")

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds of engine time (time held paused left out, as the engine
        counts it): the engine's own figure from the first token on (the one it reports at the
        finish too, so the value never changes then); from event times only for a trace recorded
        before tokens carried it."""
        if self.finished_ttft is not None:
            return self.finished_ttft
        if self.engine_ttft is not None:
            return self.engine_ttft
        if self.first_token_time is None or self.added_time is None:
            return None
        return self.first_token_time - self.added_time - (self.paused_at_first - self.paused_at_added)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, seconds of engine time (mean inter-token latency):
        the engine's own figure as of the newest token (at the finish, the one it reports), else
        from event times (traces recorded before tokens carried it)."""
        if self.finished_tpot is not None:
            return self.finished_tpot
        if self.engine_tpot is not None:
            return self.engine_tpot
        if self.num_output < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        engine_s = self.last_token_time - self.first_token_time - (self.paused_at_last - self.paused_at_first)
        return engine_s / (self.num_output - 1)

    @property
    def paused_s(self) -> float:
        """Seconds this request spent with the engine held paused (up to its newest token while it runs)."""
        if self.finished_paused is not None:
            return self.finished_paused
        return max(0.0, self.paused_at_last - self.paused_at_added)


class EngineState:
    """The engine as seen through its events; :meth:`apply` folds in one event.

    ``model_info``: the ready event's facts (layers, heads, KV pool, ...); ``timings``: the
    last ``HISTORY_STEPS`` StepTimed events; ``blocks``: the newest BlocksChanged;
    ``xray``: layer index -> LayerTrace of the newest traced step; ``heat``: the newest
    LayerTrace carrying attention weights.
    """

    def __init__(self) -> None:
        self.model_info: dict[str, Any] = {}
        self.model_name = ""
        self.device = ""
        self.dtype = ""
        self.ready = False
        self.loading: ev.ModelLoading | None = None
        self.load_error: str | None = None
        self.load_failure = ev.MODEL_FAILED  # which kind of start failure load_error is (events.SETTING_REFUSED)
        self.paused = False  # what the header shows: the engine (or a replay's playback) confirmed paused
        self.pending: str | None = None  # "pausing" or "resuming": asked by the app, not yet confirmed
        # The engine's own pause accounting (see paused_clock), apart from ``paused``: a replay's
        # playback pauses show as paused but take no recorded time; its recorded pauses are the reverse.
        self._held = False
        self._paused_total = 0.0  # seconds the engine was held paused, from pause/resume/step events
        self._paused_since: float | None = None
        self.engine_state = "loading"
        self.step: int | None = None
        self.plan: ev.StepPlanned | None = None
        # The newest step failed before it ended (an EngineError of that step, no StepTimed yet): its
        # number, else None. Its planned chunks are not counted as prefilled meanwhile (trial 10).
        self.failed_step: int | None = None
        self._before_plan: dict[str, int] = {}  # request id -> prefilled before the newest step's chunk
        self._planned_prefill: dict[str, int] = {}  # request id -> prefilled once the newest step ends
        self.step_open = False  # the newest planned step has not ended yet (no StepTimed, no failure)
        # Samples (sequences: a request with n > 1 has n) per request in the newest plan's queues, and how
        # many of the running ones ended inside that step while their request ran on (a sample that met
        # EOS; no event names it: the step's StepTimed.num_running, the engine's count, tells)
        self._seqs: dict[str, dict[str, int]] = {"running": {}, "waiting": {}}
        self._samples_ended = 0
        self.requests: dict[str, RequestView] = {}
        self.timings: deque[ev.StepTimed] = deque(maxlen=HISTORY_STEPS)
        self.yielded_s = 0.0  # seconds the engine's steps waited for this app's key frames (StepTimed.yielded_s)
        self.blocks: ev.BlocksChanged | None = None
        self.xray: dict[int, ev.LayerTrace] = {}
        self.heat: ev.LayerTrace | None = None
        self._kv_now: ev.StepTimed | None = None
        # every abort between steps since the newest step: the Engine panel's queues and the KV title's figures
        # are after them (one that held no block counts too: trial 43c read "2 aborts" beside 3 aborted rows)
        self.step_aborts: list[str] = []
        self.blocks_aborts: list[str] = []  # the ones of those the Block Map's snapshot is after
        self.last_error: ev.EngineError | None = None
        # A replay played to its end: the requests it left unfinished, in arrival order (see recording_ended)
        self.unfinished: list[str] | None = None
        self.num_events = 0
        self._order = itertools.count()

    # ------------------------------------------------------------------ requests

    def submitted(self, request_id: str, prompt: str, priority: int, max_tokens: int | None,
                  chat: bool | None = None) -> RequestView:
        """Record a prompt the app has just sent (before the engine has seen it); ``chat``: as a user's message.
        The prompt is kept as shown (control characters made visible, as the bridge does to events)."""
        req = RequestView(request_id, visible_text(prompt), priority, max_tokens, chat=chat, order=next(self._order))
        self.requests[request_id] = req
        return req

    def _request(self, request_id: str) -> RequestView:
        req = self.requests.get(request_id)
        if req is None:  # submitted elsewhere (a replay, the command line)
            req = self.requests[request_id] = RequestView(request_id, "", order=next(self._order))
        return req

    def request_ids(self) -> list[str]:
        return list(self.requests)

    @property
    def active_requests(self) -> list[RequestView]:
        return [r for r in self.requests.values() if r.live]

    def recording_ended(self) -> None:
        """A replay has played its last step: the requests still live in it are marked ``unfinished``
        (the recording stopped while they ran; no step of theirs will come) and listed in
        ``unfinished``; each keeps the state it had at that step in ``ended_as``, so the queues
        still read as the last step left them. Trial 11: at the end their rows still said running
        and the Engine panel DECODE; trial 12: then the panel said "0 running" beside "2 decode"."""
        if self.unfinished is not None:
            return
        live = sorted((r for r in self.requests.values() if r.live), key=lambda r: r.order)
        for req in live:
            req.ended_as, req.state = req.state, "unfinished"
        self.unfinished = [r.request_id for r in live]

    # ------------------------------------------------------------------ folding

    def apply(self, event: ev.Event) -> None:
        """Fold one event in (unknown kinds are ignored)."""
        self.num_events += 1
        handler = getattr(self, f"_on_{type(event).__name__}", None)
        if handler is not None:
            handler(event)

    def _on_ModelLoading(self, e: ev.ModelLoading) -> None:
        self.loading = e
        if e.ready:
            self.ready = True
            self.model_info = e.info()
            self.model_name, self.device, self.dtype = e.model_name, e.device, e.dtype
            if self.engine_state == "loading":
                self.engine_state = "paused" if self.paused else "idle"

    def _on_EngineError(self, e: ev.EngineError) -> None:
        self.last_error = e
        if e.step is not None and e.step == self.step and e.request_id is None and self.plan is not None \
                and self.plan.scheduled and self.failed_step is None:
            # The step failed as a whole: its chunks did not run (a device failure ends the engine with no
            # StepTimed; otherwise each request is retried alone and the StepTimed re-counts them).
            self.failed_step = e.step
            self.step_open = False
            for rid, before in self._before_plan.items():
                if rid in self.requests:
                    self.requests[rid].prefilled = before
        if e.step is None and ev.is_load_failure(e.message):
            self.load_failure, _, self.load_error = e.message.partition(": ")
            self.engine_state = "failed"

    def paused_clock(self, at: float) -> float:
        """Seconds the engine had been held paused by event time ``at`` (the engine's own
        accounting, rebuilt from events: paused from EnginePaused to EngineResumed, except
        during the steps run one at a time meanwhile). In a replay the pauses counted are the
        recorded ones (``RecordedPaused`` to ``RecordedResumed``, see ``nanovllm_tui.replay``),
        never the replay's own pauses of its playback (``PlaybackPaused``), which take no recorded time."""
        current = 0.0 if self._paused_since is None else max(0.0, at - self._paused_since)
        return self._paused_total + current

    def _hold(self, at: float) -> None:
        if self._paused_since is None:
            self._paused_since = at

    def _release(self, at: float) -> None:
        if self._paused_since is not None:
            self._paused_total += max(0.0, at - self._paused_since)
            self._paused_since = None

    def _on_EnginePaused(self, e: ev.EnginePaused) -> None:
        self._show_paused(True)
        self._on_RecordedPaused(e)

    def _on_EngineResumed(self, e: ev.EngineResumed) -> None:
        self._show_paused(False)
        self._on_RecordedResumed(e)

    def _show_paused(self, paused: bool) -> None:
        """The engine (or a replay's playback) confirmed paused or running: shown; a request of
        the app for that state is answered."""
        self.paused = paused
        if self.pending == ("pausing" if paused else "resuming"):
            self.pending = None

    def _on_PlaybackPaused(self, e: ev.EnginePaused) -> None:
        """A replay's playback held (``nanovllm_tui.replay``): shown as paused, no recorded time passes."""
        self._show_paused(True)

    def _on_PlaybackResumed(self, e: ev.EngineResumed) -> None:
        self._show_paused(False)

    def _on_RecordedPaused(self, e: Any) -> None:
        """The engine held paused from ``e.time``: counted in :meth:`paused_clock` (in a replay, a
        pause of the recorded session, which does not pause the playback)."""
        self._held = True
        self._hold(e.time)

    def _on_RecordedResumed(self, e: Any) -> None:
        self._held = False
        self._release(e.time)

    def _on_RequestAdded(self, e: ev.RequestAdded) -> None:
        req = self._request(e.request_id)
        # A prompt sent as token ids (a chat template's rendering) is shown as its pieces.
        # Made visible as the app's own prompts are (submitted): a replay's or another client's prompt
        # can hold an ESC too.
        req.prompt = visible_text(e.prompt if e.prompt is not None else (req.prompt or "".join(e.prompt_pieces)))
        req.priority, req.max_tokens, req.sampling = e.priority, e.max_tokens, dict(e.sampling)
        req.n = e.n
        req.conversation = tuple((str(role), visible_text(str(text))) for role, text in e.chat)
        req.prompt_len, req.prompt_pieces = len(e.prompt_token_ids), e.prompt_pieces
        req.added_time = e.time
        req.paused_at_added = req.paused_at_first = req.paused_at_last = self.paused_clock(e.time)
        if req.state == "submitted":
            req.state = "waiting"

    def _on_RequestRejected(self, e: ev.RequestRejected) -> None:
        known = e.request_id in self.requests
        req = self._request(e.request_id)
        if not known:  # refused before it was added (a replay, another client): the event's settings, if any
            req.priority = e.priority  # None is shown as "-", not a made-up 0 (trial 9)
            req.max_tokens = e.max_tokens
        req.state, req.error = "rejected", e.reason
        self._prune()

    def _on_StepPlanned(self, e: ev.StepPlanned) -> None:
        self.step, self.plan, self.failed_step = e.step, e, None
        self._before_plan, self._planned_prefill = {}, {}
        self.step_open = True
        self._seqs = {"running": collections.Counter(q.request_id for q in e.running),
                      "waiting": collections.Counter(q.request_id for q in e.waiting)}
        self._samples_ended = 0
        if e.scheduled:  # a step while paused is engine time
            self._release(e.time)
        for q in e.waiting + e.running:
            if q.request_id in self.requests:
                self.requests[q.request_id].samples_queued.add(q.index)
            if q.index != 0 or q.request_id not in self.requests:
                continue
            req = self.requests[q.request_id]
            req.state = q.status if q.status in ("waiting", "running", "preempted") else req.state
            req.num_preemptions = q.num_preemptions
            if req.prompt_len is not None:
                req.prefilled = min(req.prompt_len, q.num_computed_tokens)
        for s in e.scheduled:
            if s.index != 0 or s.request_id not in self.requests:
                continue
            req = self.requests[s.request_id]
            req.first_step = e.step if req.first_step is None else req.first_step
            req.last_step = e.step
            # The prompt tokens its first admission found in the prefix cache, vLLM's num_cached_tokens:
            # a readmission's hit (generated tokens too) showed 40 beside a 38-token prompt (trial 24d #3).
            # A readmission (preempted before, or holding generated tokens: a trace that lacks the counts,
            # --connect attached late) changes nothing; the finish gives the engine's own figure.
            if (s.request_id in e.admitted and req.num_preemptions == 0 and s.num_cached_blocks_own is None
                    and s.seq_len == s.prompt_len):
                req.num_cached = s.num_cached_tokens
            if s.kind == "prefill":
                # counted as prefilled when the step ends (StepTimed), not while it runs: a step taken
                # with n lasted seconds with its chunks shown done (trial 11)
                self._before_plan[s.request_id] = req.prefilled
                self._planned_prefill[s.request_id] = min(s.prompt_len, s.start + s.num_tokens)
        for q in e.preempted:
            if q.index == 0 and q.request_id in self.requests:
                req = self.requests[q.request_id]
                req.state, req.prefilled, req.num_preemptions = "preempted", 0, q.num_preemptions
        # a request of n > 1 samples still queued, whose sample 0 is in no queue of this plan: sample 0 ended
        entries = (*e.waiting, *e.running, *e.preempted, *e.scheduled)
        with_sample0 = {q.request_id for q in entries if q.index == 0}
        for rid in {q.request_id for q in entries if q.index != 0} - with_sample0:
            req = self.requests.get(rid)
            if req is not None and req.n > 1 and req.live and req.num_output > 0:
                req.sample0_done = True

    def _on_TokenSampled(self, e: ev.TokenSampled) -> None:
        if e.index != 0:
            return
        req = self._request(e.request_id)
        req.text += e.text
        req.num_output = e.num_output_tokens
        req.last_token, req.last_token_id = e.token_text or e.special, e.token_id
        if e.top:
            req.top, req.top_caption = e.top, table_caption(e, req.sampling)
        paused = self.paused_clock(e.time)
        if req.first_token_time is None:
            req.first_token_time, req.paused_at_first = e.time, paused
        req.last_token_time, req.paused_at_last = e.time, paused
        req.engine_ttft, req.engine_tpot = e.ttft_s, e.tpot_s
        if req.prompt_len is not None:
            req.prefilled = req.prompt_len

    def _on_RequestFinished(self, e: ev.RequestFinished) -> None:
        req = self._request(e.request_id)
        req.state = "finished"
        req.finish_reason, req.error = e.finish_reason, e.error
        req.text, req.num_output = e.output_text, e.num_output_tokens
        if e.num_output_tokens and req.prompt_len is not None:  # its prompt ran whole once: a finished row says so,
            req.prefilled = req.prompt_len  # not "0/35" for KV a preemption dropped before an abort (trial 42c)
        req.finished_ttft, req.finished_tpot, req.finished_paused = e.ttft_s, e.tpot_s, e.paused_s
        req.num_preemptions = e.num_preemptions
        # the column's figure: the first admission's, vLLM's num_cached_tokens (trial 24d #3; the
        # Narrator's finish entry gives a readmission's apart)
        req.num_cached = e.num_cached_prompt_tokens
        if e.finish_reason == "abort" and not self.step_open and self.plan is not None:
            self.step_aborts.append(e.request_id)  # the queues now are after it, the batch line is the step's
        self._prune()
        last = self.kv
        if e.kv_blocks_used is not None and last is not None and last.num_blocks_total:
            # Blocks came back outside a step (an abort) or after the step's figures: the pool now.
            per_block = last.kv_bytes_total // last.num_blocks_total
            self._kv_now = dataclasses.replace(last, num_blocks_used=e.kv_blocks_used,
                                               num_blocks_cached=e.kv_blocks_cached or 0,
                                               kv_bytes_used=e.kv_blocks_used * per_block)

    def _on_ServerStopped(self, e: Any) -> None:
        """An attached server shut down while a step still ran: the requests it named never got their
        ``RequestFinished``; they are lost, not running for good (trial 30c)."""
        during = f" during step {e.step}" if e.step is not None else ""
        for rid in e.unfinished:
            req = self.requests.get(rid)
            if req is not None and req.live:
                req.state, req.error = "lost", (f"the server at {e.url} stopped{during}; this request ended "
                                                "unfinished with it")

    def _on_ServerRestarted(self, e: Any) -> None:
        """An attached server came back with a new engine: the old one's live requests are lost
        (kept in the table, marked so); the ones that had ended are dropped (the new server knows
        none of them: beside its own rows they read as its history; trial 8), and its step,
        queues, pool and timings are forgotten."""
        for rid, req in list(self.requests.items()):
            if req.live:
                req.state, req.error = "lost", f"the server at {e.url} restarted; this request ended with it"
            elif req.state != "lost":
                del self.requests[rid]
        self.step = self.plan = self.blocks = self._kv_now = None
        self.step_aborts, self.blocks_aborts = [], []
        self.step_open, self._planned_prefill, self._before_plan = False, {}, {}
        self._seqs, self._samples_ended = {"running": {}, "waiting": {}}, 0
        self.timings.clear()
        self.xray, self.heat = {}, None
        self.paused, self.pending, self._held, self._paused_since = False, None, False, None
        self._prune()

    def _on_StepTimed(self, e: ev.StepTimed) -> None:
        if self.failed_step is None and e.step == self.step:  # the step ran: its chunks are computed now
            for rid, done in self._planned_prefill.items():
                req = self.requests.get(rid)
                if req is not None and req.state not in ("preempted", "rejected") and req.prefilled < done:
                    req.prefilled = done
        self._planned_prefill = {}
        self.step_open = False
        if self.failed_step is not None and self.plan is not None and e.step == self.failed_step:
            # the step's requests were retried one by one and it ended: the chunks of those still live ran
            for s in self.plan.scheduled:
                req = self.requests.get(s.request_id)
                if s.index == 0 and s.kind == "prefill" and req is not None and req.live:
                    req.prefilled = max(req.prefilled, min(s.prompt_len, s.start + s.num_tokens))
            self.failed_step = None
        self._before_plan = {}
        if self.plan is not None and e.step == self.plan.step:  # the engine's count after the step: planned less ended
            self._samples_ended = max(0, self._samples_queued()[0] - e.num_running)
        self.timings.append(e)
        self.yielded_s += e.yielded_s
        self._kv_now, self.step_aborts = None, []
        if self._held:  # a single step has ended: held paused again
            self._hold(e.time)

    def _on_BlocksChanged(self, e: ev.BlocksChanged) -> None:
        self.blocks = e
        # a snapshot taken between steps is after the aborts since the newest step (the Block Map says so);
        # one at a step's end (the step still open) is that step's alone
        self.blocks_aborts = [] if self.step_open else list(self.step_aborts)

    def _on_LayerTrace(self, e: ev.LayerTrace) -> None:
        current = next(iter(self.xray.values()), None)
        if current is not None and (current.step, current.request_id) != (e.step, e.request_id):
            self.xray = {}
        self.xray[e.layer] = e
        if e.attention:
            self.heat = e

    def _prune(self) -> None:
        done = [rid for rid, r in self.requests.items() if not r.live]
        for rid in done[: max(0, len(done) - MAX_FINISHED)]:
            del self.requests[rid]

    # ------------------------------------------------------------------ derived figures

    @property
    def no_engine(self) -> str | None:
        """The sentence every panel shows in place of its empty state once the engine failed to start
        (None while it loads or runs): nothing will step in this run, so "send a prompt" or "waiting for the
        model" would be false (trial 13)."""
        if self.load_error is None:
            return None
        return f"No engine: {self.load_failure} (see the header), so no step will run; start the app again with that fixed."

    @property
    def phase(self) -> str:
        """``loading``, ``failed``, ``disconnected`` (an attached server out of reach, its key refused, or the
        controller stopped), ``paused``, ``idle``, ``ended`` (a replay ended with requests unfinished), or the newest step's batch: ``prefill``,
        ``decode``, ``verify`` (a speculative verification: a sequence's last token and its
        drafts in one pass), or those present joined by ``+`` (e.g. ``prefill+decode``).
        """
        if self.load_error is not None:
            return "failed"
        if not self.ready:
            return "loading"
        if self.engine_state in LOST:  # a server out of reach may have resumed or stepped meanwhile: not
            return "disconnected"  # "paused" under a header that says disconnected (trial 29c)
        if self.paused:
            return "paused"
        if self.unfinished:  # a replay that ended while requests ran: no step runs again (all done: idle)
            return "ended"
        if not self.active_requests or self.plan is None or not self.plan.scheduled:
            return "idle"
        if not self.step_open and not any(s.request_id in self.requests and self.requests[s.request_id].live
                                          for s in self.plan.scheduled):
            # the newest step ended and ran none of the live requests (a prompt sent to an idle engine, its
            # step not planned yet): no step of that kind is under way (trial 31a: "DECODE" beside "0
            # running · 1 waiting" of a step whose request had finished)
            return "idle"
        # A verification runs drafts: after a kept token (decode) or after a prompt's last token (prefill with drafts).
        kinds = {"verify" if s.kind == "decode" and s.num_drafts else s.kind for s in self.plan.scheduled}
        kinds |= {"verify" for s in self.plan.scheduled if s.kind == "prefill" and s.num_drafts}
        return "+".join(k for k in BUSY_PHASES if k in kinds)

    @property
    def busy(self) -> bool:
        """The engine is running steps now (not idle, paused, loading or failed)."""
        return (self.phase not in ("failed", "loading", "disconnected", "paused", "idle", "ended")
                and self.engine_state == "running")

    def throughput(self) -> tuple[float, float]:
        """(prefill, decode) tokens per second: see :meth:`rate`."""
        return self.rate("prefill")[0], self.rate("decode")[0]

    def rate(self, kind: str) -> tuple[float, int]:
        """(tokens/s, steps): ``kind`` (``prefill`` or ``decode``) tokens over the wall time of the
        newest ``RATE_WINDOW`` steps that processed only that kind, and how many steps that is.

        Over one step this is that step's ``StepTimed.<kind>_tokens_per_s``, the rate the Narrator
        tells for a prefill step, so the two agree; steps without such tokens do not dilute it. A
        mixed step (prefill rows beside decode or draft rows, ``mixed_step``) counts in neither: its
        time is shared by both kinds, so its tokens of one kind over it are no rate of that kind
        (trial 13b); the Throughput panel's border says when such steps are among the newest.
        """
        steps = [t for t in self.timings if getattr(t, f"num_{kind}_tokens") and not mixed_step(t)][-RATE_WINDOW:]
        wall = sum(t.wall_time_s for t in steps)
        return (sum(getattr(t, f"num_{kind}_tokens") for t in steps) / wall if wall > 0 else 0.0), len(steps)

    @property
    def kv(self) -> ev.StepTimed | None:
        """The KV pool's newest figures (blocks used / cached / total, bytes): the newest step's,
        updated by any request that finished after it."""
        if self._kv_now is not None:
            return self._kv_now
        return self.timings[-1] if self.timings else None

    def queue_samples(self) -> tuple[int, int, int]:
        """Samples (sequences, what the engine's queues, ``StepTimed.num_running`` and /metrics
        ``num_requests_running`` count) (running, waiting, waiting of running requests) now, where
        :meth:`queue_counts` counts requests: a request with n > 1 runs n samples until each ends (trial 20d:
        "3 running" beside "5 decode" in the same panel), and a running one may have samples waiting (trial
        37c: "0 waiting" where the engine and /metrics had 1). Each request's as the newest plan queued it
        (its ``n`` when the plan has none of it), less those that ended inside the newest step (the engine's
        count then)."""
        running, waiting, of_running = self._samples_queued()
        return max(running - self._samples_ended, self.queue_counts()[0]), waiting, of_running

    def _samples_queued(self) -> tuple[int, int, int]:
        """(running, waiting, waiting of running requests) samples of the requests in those states now, as
        the newest plan queued them; after a step that cached a running request's prompt, its samples no plan
        has queued yet are waiting (the engine releases them into its waiting queue at that step's end:
        ``StepTimed.num_waiting``)."""
        running = waiting = of_running = 0
        for rid, r in self.requests.items():
            state = r.ended_as if r.state == "unfinished" and r.ended_as else r.state
            if state == "running":
                running += self._seqs["running"].get(rid) or r.n
                of_running += self._seqs["waiting"].get(rid, 0)
                if (r.samples_queued and not self.step_open and r.prompt_len is not None
                        and r.prefilled >= r.prompt_len):
                    of_running += max(0, r.n - len(r.samples_queued))
            elif state in ("waiting", "submitted"):
                waiting += self._seqs["waiting"].get(rid) or r.n
        return running, waiting + of_running, of_running

    def queue_counts(self) -> tuple[int, int, int]:
        """Requests (running, waiting, preempted) now, as the request table shows them; at a
        replay's end the unfinished ones as the last step played left them (``ended_as``)."""
        states = [r.ended_as if r.state == "unfinished" and r.ended_as else r.state for r in self.requests.values()]
        return (states.count("running"), states.count("waiting") + states.count("submitted"),
                states.count("preempted"))


def after_aborts(aborts: list[str]) -> str:
    """`` and req-1's abort`` / `` and 2 aborts``: what a pool's figures are after besides a step, for aborts
    between steps (``EngineState.step_aborts`` / ``blocks_aborts``); "" for none."""
    if not aborts:
        return ""
    return f" and {aborts[0]}'s abort" if len(aborts) == 1 else f" and {len(aborts)} aborts"


def mixed_step(t: ev.StepTimed) -> bool:
    """A step that prefilled and also decoded or verified drafts: its time is shared by both kinds of
    rows, so neither kind's tokens over it is a rate of that kind (trial 13b)."""
    return bool(t.num_prefill_tokens and t.num_decode_tokens)
