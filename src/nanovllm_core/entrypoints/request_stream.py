"""One HTTP request's engine outputs, from the engine thread to the server's event loop.

The controller calls a listener on the engine thread with each ``RequestOutput`` (see
``EngineController.submit(on_output=...)``); the listener only hands the output to an
:class:`OutputRouter`, never waits. The router wakes the event loop once for everything a
step produced (not once per request: with 64 streams that is 64 wake-ups a step fewer) and
puts each output in its stream's queue. A request with several prompts becomes several
engine requests whose outputs share one queue. Outputs are cumulative (whole text and token
ids so far), so when the loop falls behind a busy engine only the newest output of each
engine request is kept: a client then gets a larger delta, never a lost token.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Callable

from nanovllm_core.outputs import RequestOutput
from nanovllm_core.sampling_params import SamplingParams

# At a shutdown, how long a stream waits for the engine's abort outputs (the step running must end first)
# before it ends with what it has: below uvicorn's graceful timeout (APIServer, 3 s), as the event hub's close.
END_GRACE_S = 2.0


class OutputRouter:
    """Moves outputs from the engine thread to the event loop's queues, one wake-up per batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, RequestOutput]] = []
        self._scheduled = False

    def push(self, queue: asyncio.Queue, output: RequestOutput | None) -> None:
        """Queue ``output`` for ``queue`` (any thread); the loop is woken if it is not already."""
        with self._lock:
            self._pending.append((queue, output))
            wake, self._scheduled = not self._scheduled, True
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop has closed (server shutdown): nobody is listening
                pass

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, output in pending:
            queue.put_nowait(output)


class InFlight:
    """The streams a server has open; :meth:`end_all` ends them (shutdown), and any stream that
    joins afterwards is ended as it joins (a request that raced the shutdown). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: set[RequestStream] = set()
        self.closed = False

    def add(self, stream: "RequestStream") -> None:
        with self._lock:
            closed = self.closed
            if not closed:
                self._streams.add(stream)
        if closed:
            stream.end_now()

    def discard(self, stream: "RequestStream") -> None:
        with self._lock:
            self._streams.discard(stream)

    def end_all(self) -> None:
        with self._lock:
            self.closed = True
            streams = list(self._streams)
        for stream in streams:
            stream.end_now()

    def __len__(self) -> int:
        return len(self._streams)


class RequestIds:
    """The engine request ids in flight on one server (OpenAI requests and control submits alike),
    so that an id a client chooses (the ``X-Request-Id`` header, a control ``request_id``) is never
    handed to the engine while a request still holds it, nor one the server assigned. Thread-safe:
    ids are released on the engine thread as their requests finish."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[str] = set()

    def reserve(self, ids: list[str]) -> str | None:
        """Reserve every id of ``ids`` (all or none); returns the first one already in use, or None."""
        with self._lock:
            taken = next((rid for rid in ids if rid in self._ids), None)
            if taken is None:
                self._ids.update(ids)
            return taken

    def release(self, *ids: str) -> None:
        with self._lock:
            self._ids.difference_update(ids)

    def __contains__(self, rid: object) -> bool:
        with self._lock:
            return rid in self._ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)


class RequestStream:
    """Submits prompts to a controller and yields their outputs on the event loop.

    Args:
        controller: an ``EngineController`` (or anything with its ``submit``/``abort``).
        router: shared by a server's streams (default: one of this stream's own).
        on_finished: called (engine thread) with each finished output, e.g. to count metrics.
        registry: the server's :class:`InFlight`, which the stream joins while it is open
            (the server's shutdown ends what is in it).

    Use ``async for outputs in stream`` (each item: the newest ``RequestOutput`` per engine
    request that changed), then ``stream.close()`` in a ``finally``: engine requests not yet
    finished (the client went away) are aborted, so their KV blocks are released (a block another
    request shares stays in use).
    """

    def __init__(self, controller: Any, router: OutputRouter | None = None,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 registry: InFlight | None = None,
                 on_progress: Callable[[RequestOutput], None] | None = None) -> None:
        self._controller = controller
        self._router = router or OutputRouter(asyncio.get_running_loop())
        self._on_finished = on_finished
        self._on_progress = on_progress  # every output, on the engine thread (first-token metrics)
        self._registry = registry
        self._queue: asyncio.Queue[RequestOutput | None] = asyncio.Queue()  # None: end now (shutdown)
        self.request_ids: list[str] = []
        self._unfinished: set[str] = set()
        self.ended_early = False

    def submit(self, prompts: list[str | list[int]], params: SamplingParams, priority: int, base_id: str,
               chat: list[dict[str, Any]] | None = None) -> list[str]:
        """Queue each prompt as an engine request (ids ``base_id``, or ``base_id-i`` for several).

        ``chat``: the conversation the prompt was rendered from (a chat completion), for the views."""
        for i, prompt in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            self.request_ids.append(rid)
            self._unfinished.add(rid)
            self._controller.submit(prompt, params, priority, request_id=rid, on_output=self._listener, chat=chat)
        if self._registry is not None:
            self._registry.add(self)
        return self.request_ids

    def _listener(self, output: RequestOutput) -> None:  # engine thread
        if not output.finished and self._on_progress is not None:
            self._on_progress(output)
        if output.finished and self._on_finished is not None:
            self._on_finished(output)
        self._router.push(self._queue, output)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def __aiter__(self) -> AsyncIterator[list[RequestOutput]]:
        while self._unfinished:
            newest = {}
            output = await self._queue.get()
            while True:
                if output is None:  # the server is stopping: what is unfinished ends as aborted
                    self.ended_early = True
                    if newest:
                        yield list(newest.values())
                    return
                newest[output.request_id] = output
                if output.finished:
                    self._unfinished.discard(output.request_id)
                try:
                    output = self._queue.get_nowait()
                except asyncio.QueueEmpty:
                    break
            yield list(newest.values())

    def abort(self) -> None:
        """Abort the engine requests that have not finished (their outputs still arrive, as ``abort``)."""
        for rid in list(self._unfinished):  # a copy: another thread (shutdown) may call this
            self._controller.abort(rid)

    def end_now(self) -> None:
        """The server is stopping (any thread): abort in the engine, and end the iteration once the
        engine's abort outputs have come (they carry every token the step running made: trial 31c, a
        stream ended at once lost that step's token, its usage one short of the engine's count), or
        after ``END_GRACE_S`` when that step does not end (``ended_early`` says so either way)."""
        self.ended_early = True
        self.abort()
        timer = threading.Timer(END_GRACE_S, self._router.push, (self._queue, None))
        timer.daemon = True
        timer.start()

    def close(self) -> None:
        """The HTTP request is over: abort what is unfinished and leave the registry."""
        self.abort()
        if self._registry is not None:
            self._registry.discard(self)
