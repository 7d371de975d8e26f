"""What the engine tells its listeners: subscriptions, the events of a step, the X-Ray observer.

``EventSource`` is the listening half of :class:`~nanovllm_core.engine.llm_engine.LLMEngine`
(its base class), kept apart so that ``llm_engine.py`` reads as the loop: schedule -> run ->
sample -> update. Every method here only *reads* the engine's state to describe it; nothing
here changes what the engine computes. Events cost nothing when nobody listens: the engine
builds them only when ``_subscribers`` is non-empty, and the expensive ones (top-k lists,
block maps, layer traces) only when some subscriber asked for them.

What the engine provides (set in ``LLMEngine.__init__``): ``_subscribers`` (a list of
:class:`Subscription`), ``xray`` (the layer observer, None until first asked for),
``requests`` (live requests by id), ``finished_ids`` (ids of requests ended lately),
``scheduler``, ``block_manager``, ``bytes_per_block``, ``step_index`` and
``prefix_cache_hit_rate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from nanovllm_core import events as ev
from nanovllm_core import untrusted
from nanovllm_core.engine import observer
from nanovllm_core.engine.output_processor import RequestState
from nanovllm_core.engine.scheduler import SchedulerOutput
from nanovllm_core.engine.sequence import Sequence


@dataclass
class Subscription:
    """A listener and the detail it asked for.

    ``topk``: candidates per sampled token (0 = none); ``blocks``: ``BlocksChanged`` each
    step; ``xray``: ``LayerTrace`` events for the requests chosen with ``LLMEngine.xray_request``.
    """

    callback: Callable[[ev.Event], None]
    topk: int = 0
    blocks: bool = False
    xray: bool = False


class EventSource:
    """The listening half of ``LLMEngine`` (see the module's docstring)."""

    # ------------------------------------------------------------------ subscriptions

    def subscribe(self, callback: Callable[[ev.Event], None], topk: int = 5, xray: bool = False,
                  blocks: bool = True) -> Subscription:
        """Call ``callback(event)`` for every event from now on, at the declared level of detail.

        Nothing a subscriber did not ask for is computed: top-k lists only if some
        subscriber has ``topk > 0``, block snapshots only if some has ``blocks``, layer
        traces only if some has ``xray``. Each gets its own ``topk``, and also the block
        snapshots and layer traces made for others (see :meth:`_emit`). The callback runs on
        the engine's thread and must be quick (hand the event to a queue).

        Raises:
            RuntimeError: ``xray`` with no layer observer installed (see ``engine/observer.py``).
        """
        if xray:
            self._xray_capture()  # measures the machine's roofline now, outside any step
        sub = Subscription(callback, topk=topk, blocks=blocks, xray=xray)
        self._subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subscribers:
            self._subscribers.remove(sub)

    def _emit(self, event: ev.Event) -> None:
        """Send ``event`` to each subscriber: a ``TokenSampled``'s top choices cut to its own ``topk``
        (the engine computed the most any asked for; trial 20d: every subscriber got that most).

        ``blocks`` and ``xray`` say what a subscriber needs *made*; in this process each subscriber
        also sees the block maps and layer traces another one asked for, at no cost (they exist
        already): the narrator and the dashboard use the layer traces of the steps the X-Ray view
        chose (``nanovllm --narrate --xray --dashboard``), without asking for every step to be
        traced. Listeners outside the process (the server's event stream, the app's remote
        controller) get only what they asked for (``events.asked_for``): there each costs bytes.
        """
        cut: dict[int, ev.Event] = {}  # one trimmed copy per topk asked for
        for sub in list(self._subscribers):
            mine = cut.get(sub.topk)
            if mine is None:
                mine = cut[sub.topk] = ev.with_topk(event, sub.topk)
            sub.callback(mine)

    @property
    def _topk_wanted(self) -> int:
        return max((s.topk for s in self._subscribers), default=0)

    @property
    def _blocks_wanted(self) -> bool:
        return any(s.blocks for s in self._subscribers)

    # ------------------------------------------------------------------ events of a request

    def _finished_event(self, req: RequestState, wall_s: float) -> ev.RequestFinished:
        """One event per request, when its last sample ends; top-level fields describe sample 0.

        ``wall_s``: its ``time`` (seconds since the epoch): the finishing step's stamp, or now for an abort.
        """
        first = req.seqs[0]
        m = first.metrics
        samples = tuple(
            ev.SampleResult(index=s.index, finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                            text=s.output_text, token_ids=tuple(s.output_token_ids))
            for s in req.seqs
        )
        return ev.RequestFinished(
            request_id=req.request_id, step=self.step_index, index=0, finish_reason=first.finish_reason,
            stop_reason=first.stop_reason, output_text=first.output_text,
            output_token_ids=tuple(first.output_token_ids), num_prompt_tokens=first.num_prompt_tokens,
            num_output_tokens=first.num_output_tokens, ttft_s=m.time_to_first_token, tpot_s=m.time_per_output_token,
            e2e_s=m.e2e_time, num_preemptions=m.num_preemptions,
            num_cached_prompt_tokens=m.num_cached_prompt_tokens, error=first.error, samples=samples,
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_cached=self.block_manager.num_cached_free_blocks, paused_s=m.paused_time,
            num_cached_tokens_readmitted=m.num_cached_tokens_readmitted, time=wall_s,
        )

    # ------------------------------------------------------------------ events of a step

    def _tracer(self, plan: SchedulerOutput):
        if not any(s.xray for s in self._subscribers):
            return None
        if getattr(self.config, "tensor_parallel_size", 1) > 1:
            # The X-Ray's capture reads whole-model tensors and a rank holds a shard: none is made; the
            # X-Ray views say so and draw the split from model_info() and StepTimed instead.
            return None
        # Inside a step: no roofline measurement here (it would count in the step's time).
        return self._xray_capture(measure=False).tracer_for(plan)

    def _xray_capture(self, measure: bool = True) -> observer.StepObserver:
        """The layer observer (the X-Ray capture), made on first use with the installed plug;
        ``measure`` also lets it do its slow one-time work (the X-Ray measures the machine's
        roofline, once per process and device; call it between steps).

        Raises:
            RuntimeError: no observer is installed (``engine.observer.install``).
        """
        if self.xray is None:
            plug = observer.installed()
            if plug is None:
                raise RuntimeError("no layer observer is installed, so X-Ray traces cannot be made "
                                   "(nanovllm_core/__init__.py installs the X-Ray; see engine/observer.py)")
            self.xray = plug.make(self, measure)
        elif measure:
            self.xray.prepare()
        return self.xray

    def select_xray(self, request_id: str | None, layer: int = 0, head: int = 0, every_layer: bool = False) -> None:
        """Choose the request X-Ray traces (None: the first one in each step) and the heatmap's layer and head.

        ``request_id`` must be known to the engine: waiting, running or preempted (in
        ``requests``), or ended lately (finished, aborted or rejected: one of the newest
        ``llm_engine.FINISHED_IDS_KEPT`` ids in ``finished_ids``). A finished request can be chosen (an app
        keeps its row selected, its newest trace on show); a step it is not in traces the step's first request.

        From then on only ``layer`` is captured (one ``LayerTrace`` per traced step; the model runs
        the other layers untraced), or every layer with ``every_layer``. Before any choice every
        layer is captured.

        Raises:
            ValueError: layer or head out of range, or an id no request has (the message names it).
        """
        if request_id is not None and not self.knows_request(request_id):
            raise ValueError(f"no running, waiting or recently finished request {untrusted.shown(request_id)} to X-Ray; "
                             "choose one of the ids in the request events (or none: the first in each step)")
        if every_layer:
            self._xray_capture().select(request_id, layer, head, every_layer=True)
        else:  # the three-argument call every observer takes (engine/observer.py)
            self._xray_capture().select(request_id, layer, head)

    def knows_request(self, request_id: str) -> bool:
        """The id is a live request's (waiting, running, preempted) or one that ended lately (see ``finished_ids``)."""
        return request_id in self.requests or request_id in self.finished_ids

    def _queue_entry(self, seq: Sequence) -> ev.QueueEntry:
        return ev.QueueEntry(request_id=seq.request_id, seq_id=seq.seq_id, index=seq.index, priority=seq.priority,
                             status=seq.status.value, num_tokens=seq.num_tokens,
                             num_computed_tokens=seq.num_computed_tokens, num_preemptions=seq.metrics.num_preemptions)

    def _step_planned_event(self, plan: SchedulerOutput) -> ev.StepPlanned:
        entries = tuple(
            ev.ScheduledEntry(request_id=s.seq.request_id, seq_id=s.seq.seq_id, index=s.seq.index, kind=s.kind,
                              num_tokens=s.num_new_tokens, start=s.start, prompt_len=s.seq.num_prompt_tokens,
                              total_len=s.seq.num_tokens, num_cached_tokens=s.num_cached_tokens, samples=s.samples,
                              priority=s.seq.priority, num_spec_tokens=s.num_spec_tokens,
                              max_drafts=s.max_drafts, draft_limits=tuple(s.draft_limits),
                              num_cached_blocks_in_use=s.num_cached_blocks_in_use,
                              num_cached_blocks_own=s.num_cached_blocks_own,
                              budget_left=s.budget_left, plan_order=s.plan_order)
            for s in plan.scheduled
        )
        return ev.StepPlanned(
            step=plan.step, token_budget=plan.token_budget, num_batched_tokens=plan.num_batched_tokens,
            scheduled=entries, preempted=tuple(self._queue_entry(s) for s in plan.preempted),
            admitted=tuple(s.request_id for s in plan.admitted),
            waiting=tuple(self._queue_entry(s) for s in self.scheduler.waiting),
            running=tuple(self._queue_entry(s) for s in self.scheduler.running),
            max_num_seqs=self.scheduler.max_num_seqs,
            shortfalls=tuple(ev.Shortfall(request_id=w.needer.request_id, seq_id=w.needer.seq_id, index=w.needer.index,
                                          blocks_needed=w.blocks_needed, blocks_free=w.blocks_free, waiting=w.waiting)
                             for w in plan.shortfalls),
            wait_reason=plan.wait_reason, wait_blocks=tuple(plan.wait_blocks),
        )

    def blocks_event(self, step: int) -> ev.BlocksChanged:
        """A snapshot of the KV pool and every live block table."""
        bm = self.block_manager
        code = {"used": "u", "cached": "c", "free": "f"}
        states = "".join(code[bm.block_state(b)] for b in range(bm.num_blocks))
        tables = tuple(
            ev.SeqBlocks(request_id=s.request_id, seq_id=s.seq_id, index=s.index, block_table=tuple(s.block_table),
                         num_tokens=s.num_tokens, num_computed_tokens=s.num_computed_tokens)
            for s in self.scheduler.running + self.scheduler.waiting if s.block_table
        )
        return ev.BlocksChanged(step=step, block_size=bm.block_size, bytes_per_block=self.bytes_per_block,
                                states=states, ref_counts=tuple(b.ref_count for b in bm.blocks), tables=tables,
                                prefix_cache_hit_rate=self.prefix_cache_hit_rate)

    def _emit_step_end(self, plan: SchedulerOutput, wall: float, yielded: float = 0.0) -> None:
        if self._blocks_wanted:
            self._emit(self.blocks_event(plan.step))
        # A prompt's last token may carry drafts (speculative decoding): they are verified like a decode's, not prefill.
        prefill = sum(s.num_new_tokens - len(s.spec_tokens) for s in plan.scheduled if s.kind == "prefill")
        decode = plan.num_batched_tokens - prefill
        bm = self.block_manager
        wall = max(wall, 1e-9)
        traced, self._step_traced = self._step_traced, False  # set by the step that ran (LLMEngine.__init__ first)
        self._emit(ev.StepTimed(
            step=plan.step, wall_time_s=wall, num_tokens=plan.num_batched_tokens, num_prefill_tokens=prefill,
            num_decode_tokens=decode, prefill_tokens_per_s=prefill / wall, decode_tokens_per_s=decode / wall,
            kv_bytes_used=bm.num_used_blocks * self.bytes_per_block,
            kv_bytes_total=bm.num_blocks * self.bytes_per_block,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_blocks_used=bm.num_used_blocks, num_blocks_cached=bm.num_cached_free_blocks,
            num_blocks_total=bm.num_blocks, yielded_s=yielded, traced=traced,
            **self._tensor_parallel_timing(),
        ))

    def _tensor_parallel_timing(self) -> dict:
        """``StepTimed``'s ``tp_`` fields for the step just run: each rank's measured seconds, as its runner got them."""
        runner = getattr(self, "runner", None)
        timing = getattr(runner, "tp_timing", None)
        if timing is None:
            return {}
        return dict(tp_size=len(timing.wall_s), tp_forward_s=timing.wall_s, tp_compute_s=timing.compute_s,
                    tp_comm_s=timing.comm_s, tp_all_reduces=timing.all_reduces,
                    tp_all_reduce_bytes=timing.all_reduce_bytes, tp_gather_bytes=timing.gather_bytes)
