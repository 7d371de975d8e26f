"""``--connect URL``: the engine of a running ``nanovllm serve`` behind the ``EngineController`` interface.

:class:`RemoteController` is the third controller beside the local one (an engine thread)
and the replay one, and the app cannot tell them apart: events arrive from the server's
``/v1/engine/events`` stream (server-sent events whose data lines are the trace format,
decoded with the replay's :func:`~nanovllm_core.tracing.decode_event`), and the commands
(``pause``, ``resume``, ``step``, ``abort``, ``submit``, ``xray``) are posted to
``/v1/engine/control``, with the API key when one is given. Several apps may watch one
server; a pause from any of them reaches all.

Nothing here ever blocks the UI thread: a reader thread keeps the stream open and a sender
thread posts commands in order. When the connection drops, ``state`` becomes
``disconnected`` (the header shows it), one ``EngineError`` says so, and the reader
reconnects with ``Last-Event-ID``, so the server replays what was missed; a server that
restarted meanwhile is a new engine (its event ids name another instance): the app is told
(:class:`ServerRestarted`) and the new engine's snapshot follows. A command that
fails is reported the same way (a refused prompt as ``RequestRejected``), never dropped silently.
"""

from __future__ import annotations

import dataclasses
import http.client
import itertools
import json
import queue
import re
import secrets
import socket
import sys
import threading
import time
import traceback
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable

from nanovllm_core import events as ev
from nanovllm_core import untrusted
from nanovllm_core.tracing import decode_event
from nanovllm_tui.widgets.format import quoted


@dataclass(frozen=True)
class ServerRestarted(ev.Event):
    """The stream came back from a new engine (the server restarted): what the app knew of the old
    one is gone (its running requests will never finish there). Made by :class:`RemoteController`,
    not by an engine; the snapshot of the new engine follows it."""

    url: str


@dataclass(frozen=True)
class ServerStopped(ev.Event):
    """The server shut down with requests it never finished: its stream's last state frame named them
    (``unfinished``), the step running when it stopped had not reached the aborts. Made by
    :class:`RemoteController` from that frame, not by an engine."""

    url: str
    step: int | None = None
    unfinished: tuple[str, ...] = ()


class RemoteError(Exception):
    """The server refused or could not be reached; the message says what to do."""


class NotNanoServer(RemoteError):
    """Something answers at the address, but not ``nanovllm serve`` (a path it has is missing there)."""


class ServerLoading(RemoteError):
    """The server is up but still loading its model (503, code ``model_loading``): ask again soon."""


class ConnectionRefused(RemoteError):
    """Nothing listens at the server's address (yet): a ``nanovllm serve`` started a moment ago
    opens its port only after a few seconds of setting up."""


class KeyRefused(RemoteError):
    """The server answered 401: the API key is missing or not its own (also a server restarted
    with another ``--api-key`` under an attached app)."""


@dataclass
class RemoteSubscription:
    """A local listener and the detail it wants; the stream asks the server for the most any wants."""

    callback: Callable[[ev.Event], None]
    topk: int = 5
    blocks: bool = True
    xray: bool = False

    def wants(self, event: ev.Event) -> bool:
        return ev.asked_for(event, blocks=self.blocks, xray=self.xray)


class _Server:
    """Where the server is and how to talk to it (one short-lived HTTP connection per call)."""

    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        example = "give one like http://127.0.0.1:8000"
        try:
            parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
            port = parts.port  # ValueError: not a number, or outside 0-65535
        except ValueError as e:
            raise RemoteError(f"{quoted(url)} is not a server address ({e}); {example}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RemoteError(f"{quoted(url)} is not a server address; {example}")
        if port == 0:
            raise RemoteError(f"{quoted(url)} is not a server address (port 0); {example}")
        bad = [c for c in parts.netloc if c.isspace() or ord(c) < 32 or ord(c) == 127]
        if bad:  # http.client refuses such a host only when it connects (InvalidURL)
            raise RemoteError(f"{quoted(url)} is not a server address (it contains {bad[0]!r}); {example}")
        # `nanovllm serve` prints its address as http://HOST:PORT/v1 (OpenAI clients' base URL); the
        # routes this controller asks for (/v1/models, /v1/engine/...) already start with /v1.
        path = parts.path.rstrip("/")
        path = path[:-3] if path.endswith("/v1") else path
        self.url = f"{parts.scheme}://{parts.netloc}{path}"
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, port
        self.base = path
        self.api_key = api_key
        self.timeout = timeout

    def connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def headers(self, **extra: str) -> dict[str, str]:
        h = {"Accept": "application/json", **extra}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def refusal(self, status: int, body: bytes, path: str = "") -> RemoteError:
        """The error for an answer ``status`` to ``path``: the server's own message, or what to do.

        A 404 without nano-vLLM's JSON error body (another web server, or an OpenAI server that is
        not nano-vLLM's) says that the path is missing there and asks whether the address is a
        ``nanovllm serve`` one (trial 12b: "404: Not Found (HTTP 404)" said neither)."""
        code = None
        try:
            error = untrusted.loads(body)["error"]
            message, code = error["message"], error.get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            if status in (404, 405) and path:
                return NotNanoServer(f"{self.url} has no {path}: is it a `nanovllm serve` address? (it answered "
                                     f"HTTP {status}; `nanovllm serve` prints its address when it starts)")
            message = body.decode("utf-8", "replace").strip()[:200] or http.client.responses.get(status, "")
        if status == 503 and code == "model_loading":
            return ServerLoading(f"the server at {self.url} is still loading its model")
        if status == 401:
            if not self.api_key:  # none was sent: the server wants one (trial 30c: "refused the API key")
                return KeyRefused(f"the server at {self.url} needs an API key (pass --api-key KEY or set "
                                  "$NANOVLLM_API_KEY)")
            return KeyRefused(f"the server at {self.url} refused the API key (the key given with --api-key or "
                              "$NANOVLLM_API_KEY is not the server's)")
        return RemoteError(f"{message} (HTTP {status})")

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One JSON request; the decoded answer.

        Raises:
            RemoteError: the server answered with an error (its message), or could not be reached;
                (:class:`NotNanoServer`) it answered 200 with something other than JSON.
        """
        conn = self.connection()
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, self.base + path, body=data,
                         headers=self.headers(**({"Content-Type": "application/json"} if data else {})))
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            kind = ConnectionRefused if isinstance(e, ConnectionRefusedError) else RemoteError
            raise kind(f"cannot reach {self.url} ({_reason(e)}); is `nanovllm serve` running there?") from None
        finally:
            conn.close()
        if resp.status != 200:
            raise self.refusal(resp.status, raw, path)
        try:
            return untrusted.loads(raw) if raw else None
        except ValueError as e:  # not JSON, or nested past the parser's depth: not this server's answer
            raise NotNanoServer(f"{self.url} answered {path} with something other than JSON ({e}); is it a "
                                "`nanovllm serve` address?") from None


def _lacks(have: tuple[int, bool, bool], wanted: tuple[int, bool, bool]) -> bool:
    """A stream opened with detail ``have`` (topk, blocks, xray) lacks something of ``wanted``."""
    return wanted[0] > have[0] or (wanted[1] and not have[1]) or (wanted[2] and not have[2])


def _reason(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, socket.timeout):
        return "no answer in time"
    return str(e) or type(e).__name__


REFUSED_POLL_S = 0.25  # how often a refused address is tried again: attach soon after the port opens


def check_server(url: str, api_key: str | None = None, timeout: float = 5.0, wait_loading_s: float = 0.0,
                 on_loading: Callable[[], None] | None = None, poll_s: float = 1.0, wait_refused_s: float = 0.0,
                 on_refused: Callable[[], None] | None = None) -> str:
    """The name of the model served at ``url`` (its ``/v1/models``), checking the key on the way.

    A server still loading its model (``nanovllm serve`` answers 503 ``model_loading`` meanwhile)
    is asked again every ``poll_s`` seconds for up to ``wait_loading_s`` seconds; ``on_loading``
    is called once, when the first such answer comes (to say that it waits). An address that
    refuses the connection (a server started with the app opens its port a few seconds later) is
    tried again every ``REFUSED_POLL_S`` seconds for up to ``wait_refused_s`` seconds from the
    start; ``on_refused`` is called once, at the first refusal. Any other failure to reach it (an
    unknown host, no answer in time) is raised at once.

    Raises:
        RemoteError: not a server address, unreachable, the key is missing or wrong, or
            (:class:`ServerLoading`) still loading after ``wait_loading_s`` seconds, or
            (:class:`ConnectionRefused`) still refusing after ``wait_refused_s`` seconds.
    """
    server = _Server(url, api_key, timeout)
    start = time.monotonic()
    deadline, told, told_refused = start + wait_loading_s, False, False
    while True:
        try:
            models = server.request("GET", "/v1/models")
            break
        except ConnectionRefused:
            if time.monotonic() + REFUSED_POLL_S > start + wait_refused_s:
                raise
            if not told_refused and on_refused is not None:
                on_refused()
            told_refused = True
            time.sleep(REFUSED_POLL_S)
        except ServerLoading as e:
            if time.monotonic() >= deadline:
                waited = f" after {wait_loading_s:g} s" if wait_loading_s else ""
                raise ServerLoading(f"{e}{waited}; try again once it prints its start-up line "
                                    "(GET /health answers {\"status\": \"ok\"} then)") from None
            if not told and on_loading is not None:
                on_loading()
            told = True
            time.sleep(poll_s)
    try:
        name, owner = models["data"][0]["id"], models["data"][0].get("owned_by")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise RemoteError(f"{url} answered /v1/models without a model; is it a `nanovllm serve` address?") from None
    if owner != "nanovllm":  # another OpenAI server (vLLM says "vllm"): it has no engine events to watch
        raise NotNanoServer(f"{server.url} serves {name!r} but is not `nanovllm serve` (its /v1/models says owned_by "
                            f"{owner!r}), so it has no /v1/engine/events to watch; connect to a `nanovllm serve` "
                            "address")
    return name


def sampling_words(reason: str) -> str:
    """A server's refusal of this app's ``submit`` with its sampling fields named as a client of the
    OpenAI routes names them (``max_tokens``), not as the control API's body nests them
    (``params.max_tokens``): the person typed no ``params`` (trial 35a)."""
    return re.sub(r"\bparams\.(?=[a-z_]+\b)", "", reason)


class RemoteController:
    """A running server's engine, with the ``EngineController`` commands the app uses.

    Args:
        url: the server, e.g. ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer`` with every call (the server's ``--api-key``).
        reconnect_s: (first, longest) wait between reconnection attempts, doubling in between.
        read_timeout_s: a stream silent this long is taken as lost (the server sends its
            state every half second).

    ``state``: the server's engine state (``running``, ``paused``, ``idle``, ...), or
    ``disconnected`` while the stream is down, ``stopped`` after :meth:`shutdown`.

    Raises:
        RemoteError: ``url`` is not a server address (nothing is contacted before :meth:`start`).
    """

    live = True
    engine = None
    local_engine = False  # no engine in this process: the tutorial's demonstrations cannot run here
    load_error = None

    def __init__(self, url: str, api_key: str | None = None, reconnect_s: tuple[float, float] = (0.25, 2.0),
                 read_timeout_s: float = 10.0) -> None:
        self._server = _Server(url, api_key, read_timeout_s)
        self.url = self._server.url
        self.reconnect_s = reconnect_s
        self.results: dict = {}
        self._subs: list[RemoteSubscription] = []
        self._lock = threading.Lock()
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._connected = False
        self._server_state = "loading"
        self._last_id: str | None = None
        self._instance: str | None = None  # the server's instance in event ids: a new one is a new engine
        self._outage_reported: str | None = None  # the kind of outage told to the app ("lost", "key refused")
        self._key_refused = False  # the stream's last try was answered 401
        self._stream_conn: http.client.HTTPConnection | None = None
        # The detail of the stream now open, once the server has its watcher (None between streams), and a
        # restream the sender asked for: a command waits until the server has the detail wished before it
        # (trial 26b: "2 n" ran the step before the stream's xray=1 reached the server, so it was untraced).
        self._stream_detail: tuple[int, bool, bool] | None = None
        self._restream = False
        self._stream_cv = threading.Condition()
        self._ids = itertools.count()
        self._session = secrets.token_hex(2)  # ids of prompts sent from this app: tui-<session>-<n>
        self._paused_here = False  # this controller's last word was pause: shutdown resumes the server
        self._sent_here: set[str] = set()  # prompts sent from this app that have not ended: shutdown aborts them
        # Names this app's pauses to the server, which keeps who made the pause it holds: the resume
        # sent on quitting ends the pause only if it is still this app's (not another client's since).
        self._owner = f"tui-{secrets.token_hex(8)}"
        self._reader = threading.Thread(target=self._read_loop, name="nanovllm-remote-events", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="nanovllm-remote-commands", daemon=True)

    # ------------------------------------------------------------------ EngineController's interface

    def start(self) -> None:
        """Open the event stream and the command channel (the app calls it once its window is up)."""
        if self._reader.ident is None:
            self._reader.start()
            self._sender.start()

    @property
    def state(self) -> str:
        """The server's state, or ``disconnected`` (``key refused`` when the server answers 401)."""
        if self._stop.is_set():
            return "stopped"
        if self._connected:
            return self._server_state
        if self._key_refused:  # none sent: the server restarted with a key this app never had
            return "key refused" if self._server.api_key else "key needed"
        return "disconnected"

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def is_alive(self) -> bool:
        return self._reader.is_alive()

    def subscribe(self, callback: Callable[[ev.Event], None], topk: int = 5, xray: bool = False,
                  blocks: bool = True) -> RemoteSubscription:
        """Receive the server's events (on the reader thread); the flags may be changed later."""
        sub = RemoteSubscription(callback, topk=topk, blocks=blocks, xray=xray)
        with self._lock:
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: RemoteSubscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def submit(self, prompt: str | list[int], sampling_params: Any = None, priority: int = 0,
               request_id: str | None = None, fit_context: bool = True) -> str:
        """Send a prompt to the server like any client's; its id (``tui-<session>-<n>``) is known at once.

        ``fit_context`` is always in force: the server refuses (400, here a ``RequestRejected``) a
        ``max_tokens`` that does not fit after the prompt, as it refuses any client's."""
        rid = request_id if request_id is not None else f"tui-{self._session}-{next(self._ids)}"
        params = {} if sampling_params is None else {
            f.name: getattr(sampling_params, f.name) for f in dataclasses.fields(sampling_params)}
        body = {"command": "submit", "request_id": rid, "prompt": prompt, "params": params, "priority": priority}
        with self._lock:
            self._sent_here.add(rid)
        self._commands.put((body, lambda reason: self._deliver(ev.RequestRejected(request_id=rid,
                                                                                  reason=sampling_words(reason)))))
        return rid

    def pause(self) -> None:
        self._paused_here = True
        self._command({"command": "pause", "owner": self._owner})

    def resume(self) -> None:
        self._paused_here = False
        self._command({"command": "resume"})

    def step(self, n: int = 1) -> None:
        """While the server is paused, run exactly ``n`` engine steps there."""
        if n < 1:
            raise ValueError(f"step(n) needs n >= 1, got {n}")
        self._command({"command": "step", "n": n})

    def abort(self, request_id: str) -> None:
        self._command({"command": "abort", "request_id": request_id})

    def xray(self, request_id: str | None, layer: int = 0, head: int = 0) -> None:
        self._command({"command": "xray", "request_id": request_id, "layer": layer, "head": head})

    def call(self, fn: Callable[[Any], Any]) -> None:
        """A remote engine cannot run a local function. The app reads one thing this way, a
        fresh snapshot of the KV pool for its subscribers; that is what the server is asked for."""
        self._command({"command": "snapshot"})

    def shutdown(self, timeout: float = 1.0) -> bool:
        """Close the stream and stop both threads; True if they ended within ``timeout`` seconds.

        A server this controller paused (its last word was :meth:`pause`) is resumed first: an app
        that quit while paused left the server paused and every client waiting (issue 29). The
        resume names this app as the pause's owner, so the server ends the pause only if it is still
        this app's: a server started paused, paused by another client (also after another client
        resumed and paused it again), or restarted since, is left as it is.

        Prompts sent from this app that have not ended are aborted first, as the server aborts a
        client's request when the client goes away: nobody is left to read them (trial 11: one ran
        on to its 2,000 tokens after the app quit). An id the server no longer knows is refused
        there and nothing else happens."""
        with self._lock:
            unfinished = sorted(self._sent_here)
        for rid in unfinished:
            self._command({"command": "abort", "request_id": rid})
        if self._paused_here:
            # queued behind what is still to be sent; the sender posts it before ending
            self._command({"command": "resume", "owner": self._owner})
        self._commands.put(None)
        if self._sender.ident is not None:
            self._sender.join(timeout)
        self._stop.set()
        conn = self._stream_conn
        if conn is not None and conn.sock is not None:
            try:  # wakes the reader out of its read at once
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in (self._reader, self._sender):
            if t.ident is not None:
                t.join(timeout)
        return not (self._reader.is_alive() or self._sender.is_alive())

    # ------------------------------------------------------------------ delivery

    def _deliver(self, event: ev.Event) -> None:
        with self._lock:
            subs = list(self._subs)
            if isinstance(event, (ev.RequestFinished, ev.RequestRejected)):
                self._sent_here.discard(event.request_id)
        for sub in subs:
            if sub.wants(event):
                try:
                    sub.callback(ev.with_topk(event, sub.topk))  # its own topk, not the most any asked
                except Exception:  # a broken listener must not stop the stream
                    traceback.print_exc()

    def _detail(self) -> tuple[int, bool, bool]:
        with self._lock:
            subs = list(self._subs)
        return (max((s.topk for s in subs), default=0), any(s.blocks for s in subs), any(s.xray for s in subs))

    # ------------------------------------------------------------------ commands (sender thread)

    def _command(self, body: dict) -> None:
        name = body["command"]
        self._commands.put((body, lambda reason: self._deliver(
            ev.EngineError(step=None, request_id=body.get("request_id"), message=f"{name}: {reason}"))))

    def _send_loop(self) -> None:
        while True:
            item = self._commands.get()
            if item is None or self._stop.is_set():
                return
            body, on_error = item
            self._catch_up_detail()
            try:
                self._server.request("POST", "/v1/engine/control", body)
            except RemoteError as e:
                on_error(str(e))

    def _catch_up_detail(self) -> None:
        """Before a command is posted, let the server have the detail this app's subscribers asked for
        before it: the stream is reopened with it (its first frame comes after the server registered its
        watcher) when it lacks anything wished, so a step pressed after the X-Ray opened is traced, as keys
        act in the order pressed. Waits at most ``read_timeout_s``; a stream that is down is not waited for."""
        wanted = self._detail()
        with self._stream_cv:
            have = self._stream_detail
            if not self._connected or have is None or not _lacks(have, wanted):
                return
            self._restream = True
            conn = self._stream_conn
        if conn is not None and conn.sock is not None:
            try:  # wakes the reader out of its read: it reopens the stream with the detail wished now
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._stream_cv:
            self._stream_cv.wait_for(lambda: self._stop.is_set() or not self._connected or (
                self._stream_detail is not None and not _lacks(self._stream_detail, wanted)),
                self._server.timeout)

    # ------------------------------------------------------------------ the event stream (reader thread)

    def _read_loop(self) -> None:
        delay = self.reconnect_s[0]
        while not self._stop.is_set():
            try:
                self._read_stream(self._detail())
                delay = self.reconnect_s[0]  # ended to change detail: reconnect at once
                continue
            except (OSError, http.client.HTTPException, RemoteError, ValueError) as e:
                if self._stop.is_set():
                    break
                with self._stream_cv:
                    restream, self._restream = self._restream, False
                if restream and isinstance(e, OSError):  # the sender closed it to reopen it with more detail
                    continue
                self._lost(e)
            self._stop.wait(delay)
            delay = min(delay * 2, self.reconnect_s[1])
        self._connected = False

    def _lost(self, error: BaseException) -> None:
        """The stream failed: told to the app once per kind of outage (a server that comes back refusing
        the key is told again, and shows as ``key refused``, not only ``disconnected``; trial 7)."""
        self._connected = False
        self._key_refused = isinstance(error, KeyRefused)
        reason = str(error) if isinstance(error, RemoteError) else _reason(error)
        kind = "key refused" if self._key_refused else "lost"  # not each new reason: refused, timed out, ...
        if kind != self._outage_reported:
            self._outage_reported = kind
            if self._key_refused:  # retrying with the same key succeeds only if the server's key changes back
                message = (f"{reason}; restart the app with the server's key, or restart the server with this one "
                           "(the app keeps retrying meanwhile)")
            else:
                message = f"lost the connection to {self.url} ({reason}); reconnecting"
            self._deliver(ev.EngineError(step=None, message=message))

    def _read_stream(self, detail: tuple[int, bool, bool]) -> None:
        """Read the stream until it fails (raises) or the wanted detail changes (returns)."""
        topk, blocks, xray = detail
        topk = min(topk, 20)  # the most the server sends (more is a 400)
        query = urllib.parse.urlencode({"topk": topk, "blocks": int(blocks), "xray": int(xray)})
        conn = self._server.connection()
        self._stream_conn = conn
        try:
            extra = {"Accept": "text/event-stream"}
            if self._last_id is not None:
                extra["Last-Event-ID"] = self._last_id
            conn.request("GET", f"{self._server.base}/v1/engine/events?{query}", headers=self._server.headers(**extra))
            resp = conn.getresponse()
            if resp.status != 200:
                raise self._server.refusal(resp.status, resp.read(), "/v1/engine/events")
            self._connected, self._outage_reported, self._key_refused = True, None, False
            kind, data, event_id = "message", [], None
            while not self._stop.is_set():
                raw = resp.readline()
                if not raw:  # a server killed (kill -9) ends it as a clean stop does: neither is told apart (trial 36c)
                    raise ConnectionError("the event stream ended: the server stopped or the connection broke")
                line = raw.decode("utf-8").rstrip("\r\n")
                if line:
                    name, _, value = line.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                    if name == "data":
                        data.append(value)
                    elif name == "id":
                        event_id = value
                    elif name == "event":
                        kind = value
                    continue
                if data:
                    self._dispatch(kind, "\n".join(data), event_id)
                    if self._stream_detail != detail:  # the server sends its first frame once it has the watcher
                        with self._stream_cv:
                            self._stream_detail = detail
                            self._stream_cv.notify_all()
                kind, data, event_id = "message", [], None
                if self._detail() != detail:
                    return
        finally:
            with self._stream_cv:
                self._stream_conn, self._stream_detail = None, None
                self._stream_cv.notify_all()
            conn.close()

    def _dispatch(self, kind: str, data: str, event_id: str | None) -> None:
        if kind == "state":
            try:
                state = untrusted.loads(data)
            except ValueError as e:
                raise ValueError(f"the server sent a state event that is not JSON ({e})") from None
            if not isinstance(state, dict) or not isinstance(state.get("state"), str):
                raise ValueError(f"the server sent a state event without a state: {data[:80]!r}")
            self._server_state = state["state"]
            if state["state"] == "stopped":  # its requests ended with it: none of this app's is left to abort on quit
                with self._lock:  # (trial 38c: the quit's abort of a lost one went to the server that replaced it)
                    self._sent_here.clear()
            unfinished = state.get("unfinished")
            if state["state"] == "stopped" and isinstance(unfinished, list) and unfinished:
                step = state.get("step") if isinstance(state.get("step"), int) else None
                self._deliver(ServerStopped(url=self.url, step=step,
                                            unfinished=tuple(str(rid) for rid in unfinished)))
            return
        try:
            event = decode_event(data)
        except RecursionError:  # json.loads in from_json, or its decoder: a ValueError as any bad line
            raise ValueError(f"the server sent an event nested too deeply to decode (more than about "
                             f"{sys.getrecursionlimit()} levels deep)") from None
        if event_id is not None:
            instance = event_id.partition(":")[0]
            if self._instance is not None and instance != self._instance:
                self._paused_here = False  # a new engine: nothing this app did reached it
                with self._lock:
                    self._sent_here.clear()
                self._deliver(ServerRestarted(url=self.url))
            self._instance, self._last_id = instance, event_id
        if isinstance(event, ev.EnginePaused):
            self._server_state = "paused"
        elif isinstance(event, ev.EngineResumed):
            self._server_state = "running"
        self._deliver(event)
