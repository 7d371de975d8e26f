"""The HTTP server: a FastAPI app over one ``EngineController``, run by uvicorn.

Endpoints (OpenAI's and vLLM's shapes):

| method and path | what |
|---|---|
| ``POST /v1/completions``, ``POST /v1/chat/completions`` | generate, whole or streamed (``stream: true``, SSE, ``data: [DONE]`` last) |
| ``GET /v1/models`` | the one model served |
| ``GET /health`` | 200 while the engine thread serves (paused too: body ``{"status": "paused"}``), else 503 (``"loading"`` while the model loads: :class:`LoadingGate`) |
| ``GET /metrics`` | Prometheus text, vLLM's metric names (``metrics.py``), and ``nanovllm:engine_paused`` |
| ``GET /v1/engine/events`` | the engine's event stream for attached apps (``event_hub.py``) |
| ``POST /v1/engine/control`` | pause, resume, step, abort, submit, xray, snapshot |

With an API key every ``/v1`` path needs ``Authorization: Bearer KEY`` (401 otherwise);
``/health`` and ``/metrics`` stay open, as in vLLM. Errors are OpenAI's JSON shape with the
right status, and the server keeps serving. A client that goes away mid-request has its
engine requests aborted (their KV blocks are released; a block another request shares stays in
use). On Ctrl-C / SIGTERM in-flight requests
are aborted and their streams end at once with ``finish_reason: "abort"`` and ``[DONE]`` (not
waiting for the engine's step in progress), and the process exits within a few seconds.

Why past ~400 lines: it is the route table of the OpenAI server, each route with its
validation before the first byte, and the gate that answers while the model loads; the
request/response shapes live in protocol.py and openai_serving.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import signal
import threading
import time
import unicodedata
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from nanovllm_core.engine.controller import MAX_STEPS, NotPaused, StepsPending
from nanovllm_core.entrypoints.addresses import is_loopback
from nanovllm_core.entrypoints.event_hub import EventHub
from nanovllm_core.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from nanovllm_core.entrypoints.openai_serving import SERVER_ID_PREFIXES, OpenAIServing, Prepared
from nanovllm_core.entrypoints.protocol import (APIError, ChatCompletionRequest, CompletionRequest, conversation_of,
                                                logit_bias_ids, validation_error, whole_number)
from nanovllm_core.model.quantization import describe_weights
from nanovllm_core.entrypoints.request_stream import InFlight
from nanovllm_core.prompts import unicode_problem
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core import untrusted

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
EVENTS_QUERY = ("topk", "blocks", "xray")  # /v1/engine/events' query parameters
EVENTS_FLAGS = {"1": True, "0": False, "true": True, "false": False}  # what blocks= and xray= take
MAX_EVENTS_TOPK = 20
# Fields a command may leave out (a null counts as left out); the rest are required (abort's request_id,
# submit's prompt) or take null as a value (xray's request_id: no request).
OPTIONAL_CONTROL_FIELDS = {"pause": ("owner",), "resume": ("owner",), "step": ("n",),
                           "submit": ("params", "priority", "request_id"), "xray": ("layer", "head")}
CONTROL_COMMANDS = ("pause", "resume", "step", "abort", "submit", "xray", "snapshot")
# The fields each control command takes (besides "command"); any other is refused, naming it.
CONTROL_FIELDS = {"pause": ("owner",), "resume": ("owner",), "snapshot": (), "step": ("n",), "abort": ("request_id",),
                  "xray": ("request_id", "layer", "head"), "submit": ("prompt", "params", "priority", "request_id")}
MIN_BODY_BYTES = 1 << 20  # the smallest default request-body limit (1 MiB)
BODY_BYTES_PER_TOKEN = 64  # default limit: this many bytes per token of the model's context, at least MIN_BODY_BYTES


class EncodableJSONResponse(JSONResponse):
    """Starlette's ``JSONResponse`` whose body always encodes: a lone surrogate (U+D800..U+DFFF, which
    JSON's ``\\udc00`` escape carries in from a client and which has no UTF-8 form) in any text or key
    is written as its escape text ``\\udc00`` (``untrusted.encodable``). Every JSON answer of this
    server is one (errors, control answers, completions): an error repeating a client's key, model
    name or value was a bare 500 and a traceback (trial 29b)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:  # rare: walk the body only then
            return super().render(untrusted.encodable(content))


class ServerState:
    """What the routes share: the controller, the OpenAI serving logic, metrics, the event hub,
    and the streams in flight (aborted together at shutdown)."""


    def __init__(self, controller: Any, model_name: str, api_key: str | None,
                 max_body_bytes: int | None = None) -> None:
        self.controller = controller
        self.model_name = model_name
        self.api_key = api_key
        self.metrics = ServerMetrics(model_name)
        self.in_flight = InFlight()
        self.serving = OpenAIServing(controller, model_name, self.metrics, self.in_flight)
        self.max_body_bytes = max_body_bytes or default_max_body_bytes(self.serving.max_model_len)
        self.hub = EventHub(controller)
        self.shutting_down = False
        # Every engine request id in flight (control submits, OpenAI requests with the server's ids or
        # X-Request-Id's): a client's id that one of them holds is refused at once (a control id
        # cannot take the server's prefixes: SERVER_ID_PREFIXES).
        self.ids = self.serving.ids
        # Who made the pause now held (the "owner" its pause command gave; None: a client that gave
        # none, or --paused). A resume that names an owner ends only that owner's pause: an app that
        # quits resumes what it paused, never a pause another client made after it (issue 29).
        self.pause_owner: str | None = None

    def begin_shutdown(self) -> None:
        """Abort every request in flight and end the event streams (their clients see them end).

        Safe from any thread (a signal handler, a test): aborts go through the controller's
        queue and the hub wakes its watchers through the event loop.
        """
        self.shutting_down = True
        self.in_flight.end_all()
        # Every request the engine holds ends too, whoever sent it: control submits (each prompt typed
        # in an attached app), and any an OpenAI stream did not name. Without it an attached app kept a
        # control-submitted request "running", holding its blocks, while the server was down (trial 20d).
        self.controller.abort_all()
        # The hub closes after the engine thread has applied the aborts, so watching apps see the
        # requests end; a second close a moment later covers an engine that no longer answers.
        hub = self.hub
        self.controller.call(lambda engine: hub.close())
        fallback = threading.Timer(2.0, hub.close)
        fallback.daemon = True
        fallback.start()


def default_max_body_bytes(max_model_len: int) -> int:
    """The default request-body limit in bytes: ``BODY_BYTES_PER_TOKEN`` per token of context, at
    least ``MIN_BODY_BYTES`` (a prompt that fits the context is far below it; a body far above
    it could only be refused after seconds of tokenizing)."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


DEFAULT_CORS = {"allow_origins": ["*"], "allow_methods": ["*"], "allow_headers": ["*"], "allow_credentials": False}



def model_permission(created: int) -> dict[str, Any]:
    """One ``/v1/models`` card's permission entry, shaped as vLLM's ``ModelPermission`` with its
    defaults (sampling, logprobs and viewing allowed; fine-tuning and engine creation not);
    ``created``: the card's own time (Unix seconds), as vLLM stamps both when asked."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}

def model_root(engine: Any) -> str:
    """A ``/v1/models`` card's ``root``: the model as it was given to load (vLLM's ``root`` is its
    ``--model``: a repo id or a path), else the file or folder the default model was loaded from,
    else (an engine built from a model in memory) its name. Never the ``--served-model-name``."""
    given = getattr(engine.config, "model", None)
    if given:
        return str(given)
    resolved = engine.resolved
    if resolved is not None:
        return str(resolved.gguf_file or resolved.path)
    return engine.model_name


def build_app(controller: Any, model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int | None = None, cors: dict[str, Any] | None = None) -> FastAPI:
    """The FastAPI app serving ``controller`` (whose model must have loaded).

    Args:
        model_name: the name clients send as ``model`` (default: the engine's model name).
        api_key: when set, every ``/v1`` request needs ``Authorization: Bearer <api_key>``; an
            empty one is no key (as ``--api-key ""`` and an empty ``$NANOVLLM_API_KEY`` are).
        max_body_bytes: a larger request body is refused with 413 before it is parsed
            (default :func:`default_max_body_bytes` of the model's ``max_model_len``).
        cors: Starlette ``CORSMiddleware``'s ``allow_origins``, ``allow_methods``, ``allow_headers``,
            ``allow_credentials`` (default :data:`DEFAULT_CORS`: any origin, as vLLM's server), so a
            browser page on another origin can call the server (its preflight ``OPTIONS`` answered).

    Raises:
        ValueError: the controller has no loaded engine.
    """
    if controller.engine is None:
        raise ValueError(f"the engine is not ready (state {controller.state!r}); wait for the model to load")
    api_key = api_key or None  # "" would refuse every client that sends a key, and let in only those that send none
    state = ServerState(controller, model_name or controller.engine.model_name, api_key, max_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.hub.start()
        yield
        state.begin_shutdown()

    app = FastAPI(title="nano-vLLM", lifespan=lifespan, docs_url=None, redoc_url=None,
                  default_response_class=EncodableJSONResponse)
    app.state.server = state
    app.add_middleware(CORSMiddleware, **{**DEFAULT_CORS, **(cors or {})})
    key_check = _api_key_check(api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return EncodableJSONResponse(e.body(), status_code=e.status, headers=_echoed_id(request))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:  # 404, 405: OpenAI's body too
        if request.url.path == "/v1" or request.url.path.startswith("/v1/"):
            try:  # the key first on every /v1 path, as vLLM's middleware checks it before routing: a client without
                await key_check(request)  # it learnt every route and method from the 404/405 (trial 41b)
            except APIError as refused:
                return EncodableJSONResponse(refused.body(), status_code=refused.status, headers=_echoed_id(request))
        path = untrusted.clipped(request.url.path)  # as sent: a 16 KB path came back whole
        if e.status_code == 404:
            message = (f"Not Found: no route {untrusted.clipped(request.method)} {path}; this server serves "
                       "/v1/completions, /v1/chat/completions, /v1/models, /v1/engine/events, /v1/engine/control, "
                       "/health, /metrics and /openapi.json")
        elif e.status_code == 405:
            allowed = (e.headers or {}).get("allow") or (e.headers or {}).get("Allow")
            message = f"Method Not Allowed: {path} does not take {untrusted.clipped(request.method)}" + (
                f"; use {allowed}" if allowed else "")
        else:
            message = str(e.detail)
        return EncodableJSONResponse(APIError(message, status=e.status_code, code=_HTTP_CODES.get(e.status_code)).body(),
                            status_code=e.status_code, headers={**(e.headers or {}), **_echoed_id(request)})

    @app.exception_handler(RequestValidationError)
    async def bad_query(request: Request, e: RequestValidationError) -> JSONResponse:  # e.g. ?topk=many
        err = e.errors()[0]
        field = str(err["loc"][-1])
        return EncodableJSONResponse(APIError(f"Invalid value for {field}: {err['msg']}", param=field,
                                     code="invalid_value").body(), status_code=400, headers=_echoed_id(request))

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine thread serves (paused included: the process is sound, and a restart
        would lose the pause's purpose), else 503; the body says which: ``{"status": "ok"}``,
        ``"paused"`` (requests wait until a resume), ``"shutting_down"`` or the engine's state."""
        ok = controller.is_alive and controller.state not in ("failed", "stopped") and not state.shutting_down
        if ok:
            status = "paused" if controller.state == "paused" else "ok"
        else:
            status = "shutting_down" if state.shutting_down else controller.state if controller.is_alive else "stopped"
        return EncodableJSONResponse({"status": status}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # the engine's figures as of its last step boundary (controller.stats()): a scrape never waits
        # for a step in progress, however long a prefill runs (as vLLM's /metrics, which reads logged stats)
        stats = {**controller.stats(), "paused": controller.state == "paused"}
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)

    v1 = APIRouter(dependencies=[Depends(key_check)])

    @v1.get("/v1/models")
    async def models() -> dict:
        model = controller.engine.model
        # vLLM's ModelCard keys and order (root: the model loaded, parent: null for a base model,
        # permission: one default ModelPermission), then our two; the card and its permission are
        # made per call and stamped with one time, as vLLM's are (trial 21b: they differed by 24 s)
        now = int(time.time())
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": now, "owned_by": "nanovllm",
            "root": model_root(controller.engine), "parent": None, "max_model_len": state.serving.max_model_len,
            "permission": [model_permission(now)],
            # what runs (auto, the default, decided it at load): "gguf", "q8_0", ... or "none" for float
            "quantization": model.quantization or "none", "weight_format": describe_weights(model)}]}

    @v1.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = _parse(CompletionRequest, await _json(request, state.max_body_bytes))
        # Tokenizing a long prompt takes seconds of CPU: off the event loop, so other clients' streams
        # and /health go on meanwhile.
        client_id = _client_request_id(request, body.request_id)
        return await _respond(request, state, await run_in_threadpool(state.serving.prepare_completion, body),
                              *client_id)

    @v1.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = _parse(ChatCompletionRequest, await _json(request, state.max_body_bytes))
        client_id = _client_request_id(request, body.request_id)
        return await _respond(request, state, await run_in_threadpool(state.serving.prepare_chat, body), *client_id)

    @v1.get("/v1/engine/events")
    async def engine_events(request: Request, topk: str = "0", blocks: str = "0", xray: str = "0") -> Response:
        if state.shutting_down:  # a watcher would only be let go again at once
            raise APIError("the server is shutting down", status=503, type="server_error", code="shutting_down")
        unknown = sorted(set(request.query_params) - set(EVENTS_QUERY))
        if unknown:  # a misspelt parameter is never ignored, as the control API's fields (trial 9)
            raise APIError(f"unknown query parameter {untrusted.shown(unknown[0])} on /v1/engine/events; it takes "
                           f"{', '.join(EVENTS_QUERY)}", param=unknown[0], code="unknown_parameter")
        repeated = next((name for name in EVENTS_QUERY if len(request.query_params.getlist(name)) > 1), None)
        if repeated is not None:  # which one counts is a guess a client should not have to make (trial 29b)
            raise APIError(f"query parameter {repeated} is given {len(request.query_params.getlist(repeated))} "
                           f"times on /v1/engine/events; give it once", param=repeated, code="invalid_value")
        # each parameter read here, so every wrong value gets the same kind of line: what it takes, what came
        # (trial 26c: ?topk=abc and ?blocks=2 got pydantic's words, ?xray=yes passed)
        if not (topk.isascii() and topk.isdigit() and 0 <= int(topk) <= MAX_EVENTS_TOPK):
            raise APIError(f"topk must be a whole number from 0 to {MAX_EVENTS_TOPK} (the top choices sent with "
                           f"each sampled token), got {untrusted.shown(topk)}", param="topk", code="invalid_value")
        flags = {}
        for name, value, what in (("blocks", blocks, "the block tables"), ("xray", xray, "X-Ray traces")):
            flags[name] = EVENTS_FLAGS.get(value.lower())
            if flags[name] is None:
                raise APIError(f"{name} must be 1 (send {what}) or 0 (true or false also do), got "
                               f"{untrusted.shown(value)}", param=name, code="invalid_value")
        last_id = state.hub.parse_last_event_id(request.headers.get("last-event-id"))
        return StreamingResponse(state.hub.stream(int(topk), flags["blocks"], flags["xray"], last_id),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    @v1.post("/v1/engine/control")
    async def engine_control(request: Request) -> dict:
        body = await _json(request, state.max_body_bytes)
        if isinstance(body, dict) and body.get("command") == "submit":  # tokenizes: off the event loop
            return await run_in_threadpool(_control, state, body)
        return _control(state, body)

    app.include_router(v1)
    return app


# ---------------------------------------------------------------------- request handling


def _api_key_check(api_key: str | None):
    async def check(request: Request) -> None:
        # OPTIONS is never asked for the key, as vLLM's middleware lets it through: a preflight carries none,
        # and a bare OPTIONS then gets the 405 any key would (trial 46b: 401 without the key, 405 with it)
        if api_key is None or request.method == "OPTIONS":
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError("Incorrect or missing API key: send it as the header 'Authorization: Bearer <key>' "
                           "(the key given to nanovllm serve --api-key)", status=401, type="authentication_error",
                           code="invalid_api_key")
    return check


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def _check_media_type(content_type: str | None) -> None:
    """Refuse a POST body not sent as ``application/json`` (another parameter is allowed, and a
    ``charset`` of UTF-8), as vLLM's ``validate_json_request`` does on every POST route, before the body
    is read. Another charset is refused too: the body is read as JSON is, UTF-8 (RFC 8259; vLLM's
    Starlette ignores the charset and decodes UTF-8 too), so a ``charset=latin-1`` body was refused as
    "not valid JSON" without saying why, or read as something it was not (trial 17a).

    vLLM answers 400 ("Unsupported Media Type: Only 'application/json' is allowed", a
    ``RequestValidationError``; older versions 415); so does this server, with the Content-Type it got
    and the header to send. Trial 16b: a body sent as ``text/plain`` was served, which lets a web
    page on any origin post to the server as a "simple" request with no CORS preflight.

    Raises:
        APIError: 400 ``unsupported_media_type``.
    """
    media_type, _, parameters = (content_type or "").partition(";")
    if media_type.strip().lower() == "application/json":
        charset = _charset(parameters)
        if charset is None or charset.lower() in ("utf-8", "utf8"):
            return
        raise APIError(f"the request declares charset {untrusted.shown(charset)}, but a JSON body is UTF-8 (RFC 8259) "
                       "and is read as UTF-8; send the body as UTF-8 with 'Content-Type: application/json' (or "
                       "charset=utf-8)", param="Content-Type", code="unsupported_media_type")
    got = "no Content-Type header" if content_type is None else f"Content-Type {untrusted.shown(content_type, as_json=True)}"
    raise APIError(f"Unsupported Media Type: Only 'application/json' is allowed; the request was sent with {got}. Send "
                   "the body as JSON with the header 'Content-Type: application/json' (curl: -H \"Content-Type: "
                   "application/json\")", param="Content-Type", code="unsupported_media_type")


def _charset(parameters: str) -> str | None:
    """The ``charset`` of a Content-Type's parameters (``"; charset=utf-8"``, quotes removed), or None."""
    for parameter in parameters.split(";"):
        name, eq, value = parameter.partition("=")
        if eq and name.strip().lower() == "charset":
            return value.strip().strip('"').strip()
    return None


def _echoed_id(request: Request) -> dict[str, str]:
    """An error answer's ``X-Request-Id``: the client's header as it came (its bytes, which Starlette reads as
    latin-1), as vLLM's request-id middleware sends it back on every response; none when none was sent, or
    when it is itself refused (trial 35b: a 400 or 404 left it out, where docs/serving.md says it comes back)."""
    raw = request.headers.get("x-request-id")
    try:  # only an id the server takes (its one check): a control character cannot go back in a header (trial 13)
        taken = raw is not None and _client_request_id(request)[1] == "X-Request-Id"
    except APIError:
        taken = False
    return {"X-Request-Id": raw} if taken else {}


async def _json(request: Request, limit: int) -> Any:
    """The request body parsed as JSON, once its Content-Type is ``application/json`` (:func:`_check_media_type`).

    Raises:
        APIError: 400 ``unsupported_media_type`` for another Content-Type or none; 413 for a body
            over ``limit`` bytes (its Content-Length, or the bytes read so far, is over it: read no further); 400 ``invalid_json`` for a body that is not JSON,
            also one nested past the parser's depth (``untrusted.loads``) or not UTF-8; 400 ``invalid_value``
            for an integer of more digits than Python reads (``untrusted.JSONNumberTooLong``, naming its key).
    """
    _check_media_type(request.headers.get("content-type"))
    too_big = APIError(f"the request body is larger than this server's limit of {limit} bytes; send a shorter "
                       "prompt or fewer prompts per request (the limit is nanovllm serve --max-body-bytes)",
                       status=413, code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:  # gone while sending its body: a 400 to nobody, not a traceback (trial 35b; vLLM: 400)
        raise APIError("the client closed the connection before its request body had arrived whole",
                       code="invalid_json") from None
    data = b"".join(chunks)
    try:  # JSON is UTF-8 (RFC 8259): json.loads would read a body opening with bytes ff fe as UTF-16 (trial 30b)
        text = data.decode("utf-8-sig")  # (a UTF-8 byte order mark is skipped, as json.loads skipped it)
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start} "
                       "is not valid UTF-8); send the JSON body encoded as UTF-8", code="invalid_json") from None
    try:
        return untrusted.loads(text)
    except untrusted.JSONNumberTooLong as e:  # valid JSON (RFC 8259 sets no digit limit): the value is the problem
        raise APIError(str(e), param=e.key, code="invalid_value") from None
    except untrusted.JSONTooDeep as e:  # json.loads' RecursionError was a 500 and a traceback (trial 14b)
        raise APIError(f"the request body is nested too deeply ({e}); send a JSON object whose fields nest a few "
                       "levels at most, as OpenAI's request fields do", code="invalid_json") from None
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON ({e}); send a JSON object", code="invalid_json") from None


def _parse(model: type, body: Any):
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e, body) from None


MAX_REQUEST_ID_CHARS = 128  # a client's id (X-Request-Id, a control request_id): at most this long


def _client_request_id(request: Request, body_id: str | None = None) -> tuple[str | None, str]:
    """The client's id for the response and where it came from: the ``X-Request-Id`` header, else
    the body's ``request_id`` (vLLM's ``_base_request_id``: the header wins), else None (the
    server's own id); the second item names the field (``X-Request-Id`` or ``request_id``) for errors.

    Raises:
        APIError: 400 for an empty one, one over ``MAX_REQUEST_ID_CHARS`` characters, a control
            character, or header bytes that are not UTF-8 (the checks a control ``request_id`` gets).
    """
    raw = request.headers.get("x-request-id")
    if raw is None:
        if body_id is None:
            return None, "request_id"
        problem = id_problem("request_id", body_id)
        if problem is not None:
            raise APIError(f"{problem} (or leave request_id out for the server's own id)", param="request_id",
                           code="invalid_value")
        return body_id, "request_id"
    try:
        value = raw.encode("latin-1").decode("utf-8")  # HTTP headers arrive as bytes (read as latin-1)
    except UnicodeError:
        raise APIError("X-Request-Id is not valid UTF-8; send text (or leave the header out for the server's own id)",
                       param="X-Request-Id", code="invalid_value") from None
    problem = id_problem("X-Request-Id", value)
    if problem is not None:
        raise APIError(f"{problem} (or leave the header out for the server's own id)", param="X-Request-Id",
                       code="invalid_value")
    return value, "X-Request-Id"


def id_problem(name: str, value: str) -> str | None:
    """Why ``value`` cannot be a client's id or owner name (one line naming ``name``), or None: it
    must hold 1 to ``MAX_REQUEST_ID_CHARS`` characters, none of them a control character (an id
    goes back in the ``X-Request-Id`` header, where HTTP allows none, and into logs) or a lone
    surrogate (it could never be sent back in a JSON answer)."""
    if not value:
        return f"{name} is empty; send 1 to {MAX_REQUEST_ID_CHARS} characters"
    if len(value) > MAX_REQUEST_ID_CHARS:
        return f"{name} has {len(value)} characters, more than {MAX_REQUEST_ID_CHARS}; send a shorter one"
    bad = next((i for i, ch in enumerate(value) if unicodedata.category(ch) == "Cc"), None)
    if bad is not None:
        return f"{name} holds the control character {json.dumps(value[bad])} at position {bad}; send printable text"
    problem = unicode_problem(value)
    return f"{name} is not valid Unicode: {problem}" if problem is not None else None


class _EngineStream(StreamingResponse):
    """A streamed answer that frees its request's ids when the response ends, also when its
    generator never began (a client gone before the first byte)."""

    def __init__(self, content: Any, on_end: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


async def _respond(request: Request, state: ServerState, p: Prepared, client_id: str | None = None,
                   client_field: str = "X-Request-Id") -> Response:
    """Reserve ``p``'s ids (400 for a client's id in use; ``client_field`` names where it came from)
    and answer it, whole or streamed; the ``X-Request-Id`` response header holds what follows
    ``cmpl-``/``chatcmpl-`` in the id."""
    serving = state.serving
    serving.reserve(p, client_id, client_field)
    # as the header came (its UTF-8 bytes, which Starlette writes as latin-1), or the server's own id
    headers = {"X-Request-Id": p.request_id.split("-", 1)[1].encode("utf-8").decode("latin-1")}
    if p.stream:
        return _EngineStream(serving.event_stream(p), lambda: serving.release_unsubmitted(p),
                             media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    try:
        stream = serving.open_stream(p)
    finally:
        serving.release_unsubmitted(p)
    answer = asyncio.ensure_future(serving.full_response(p, stream))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():  # the client went away (or the server is stopping): free its blocks
            answer.cancel()
        stream.close()
    if not answer.done() or answer.cancelled():  # cancel() only asks: the task may not have ended yet
        return Response(status_code=499, headers=headers)
    return EncodableJSONResponse(answer.result(), headers=headers)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (vLLM's ``listen_for_disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _control(state: ServerState, body: Any) -> dict[str, Any]:
    """Apply one control command (``{"command": ...}``) to the controller; every watcher sees its effect.

    Answers ``{"ok": true}``; ``resume`` adds ``"resumed"``: true when the engine runs on, false
    (with a ``"reason"``) when it names an ``owner`` that does not hold the pause, which stays;
    ``submit`` adds the ``"request_id"``.

    Raises:
        APIError: an unknown command or a bad argument (400); an abort or xray of a request id
            the server does not know (404; for xray, one neither live nor among the lately ended);
            an abort of a request whose abort was asked and is not applied yet (409, ``abort_pending``);
            a step while not paused (409, ``not_paused``) or with no request running or waiting (409,
            ``nothing_to_step``).
    """
    c = state.controller
    one_of = f"send {{\"command\": ...}} with one of {', '.join(CONTROL_COMMANDS)}"
    if not isinstance(body, dict):
        raise APIError(f"the control body must be a JSON object; {one_of}", param="command", code="invalid_json")
    if "command" not in body:
        raise APIError(f"the command is missing; {one_of}", param="command", code="missing_required_parameter")
    if body["command"] not in CONTROL_COMMANDS:
        raise APIError(f"unknown command {untrusted.shown(body['command'], as_json=True)}; {one_of}", param="command", code="invalid_value")
    name = body["command"]
    unknown = sorted(set(body) - {"command", *CONTROL_FIELDS[name]})
    if unknown:
        takes = ", ".join(CONTROL_FIELDS[name]) or "no other field"
        hint = ('; sampling settings such as max_tokens go in params, with SamplingParams field names '
                '({"params": {"max_tokens": 3}})') if name == "submit" else ""
        raise APIError(f"{name} does not take {untrusted.listed(unknown)} (it takes {takes}){hint}", param=unknown[0],
                       code="unknown_parameter")
    # an optional field sent as null is left out, as the OpenAI routes read every null (trial 30b: a pause or
    # resume with "owner": null was refused; xray's request_id: null already meant "none")
    body = {k: v for k, v in body.items() if v is not None or k not in OPTIONAL_CONTROL_FIELDS.get(name, ())}
    # the one rule of every integer field (protocol.whole_number): 3.0 is 3; 3.5, "3" and true are refused
    body = {k: whole_number(v) if k in ("n", "layer", "head", "priority") else v for k, v in body.items()}
    if name == "pause":
        state.pause_owner = _text(body, "owner") if "owner" in body else None
        c.pause()
    elif name == "resume":
        held = c.state == "paused" or state.pause_owner is not None
        if "owner" in body and _text(body, "owner") != state.pause_owner and held:
            # the pause held now is someone else's: kept, and the answer says so (with no pause held,
            # the engine runs on: resumed, as a resume without owner says; trial 6)
            return {"ok": True, "resumed": False,
                    "reason": "the pause held now was not made by this owner; it stays until its owner, or a "
                              "resume without owner, ends it"}
        state.pause_owner = None
        c.resume()
        return {"ok": True, "resumed": True}  # running again (also when it was not paused)
    elif name == "step":
        n = body.get("n", 1)
        if not _is_int(n) or not 1 <= n <= MAX_STEPS:
            raise APIError(f"step needs a whole n from 1 to {MAX_STEPS}, got {untrusted.shown(n)}", param="n", code="invalid_value")
        # A pause asked and not yet applied counts (trial 12b: the attached app's n while its header said
        # "pausing…" got "pause first"): the controller applies commands in order, so
        # the step runs once the engine has paused (at its next step boundary). A resume asked and not
        # yet applied counts too: the state still read "paused", the step was answered 200 and then
        # dropped once the resume applied (trial 25b). The controller decides, in the order asked.
        if not c.pause_asked:
            raise APIError(str(NotPaused()), status=409, code="not_paused")
        if not len(state.ids) and not state.hub.live_request_ids():  # submitted and not yet added count too
            # steps never wait for work that does not exist: banked, they ran the next request to its end
            # while the server said "paused" (trial 15b)
            raise APIError("nothing to step: no request is running or waiting; submit one first", status=409,
                           code="nothing_to_step")
        try:
            c.step(n)
        except StepsPending as e:  # was {"ok": true}, and the steps past the cap never ran (trial 14b)
            raise APIError(str(e), param="n", code="too_many_steps") from None
        except NotPaused as e:  # a resume from another client between the check and here
            raise APIError(str(e), status=409, code="not_paused") from None
    elif name == "abort":
        rid = _text(body, "request_id")
        known = rid in state.ids  # a request submitted and not yet added by the engine counts too
        if not known and rid not in state.hub.live_request_ids():
            raise APIError(f"no running or waiting request {json.dumps(rid)} to abort (it finished, or the id is "
                           "wrong: the ids are in GET /v1/engine/events)", status=404, param="request_id",
                           code="request_not_found")
        if not c.abort(rid):  # four {"ok": true} for one abort misled a script that retries (trial 15b)
            raise APIError(f"an abort of request {json.dumps(rid)} was already asked and is not applied yet; it "
                           "takes effect at the end of the engine's step in progress", status=409,
                           param="request_id", code="abort_pending")
    elif name == "xray":
        rid = body.get("request_id")
        layer, head = body.get("layer", 0), body.get("head", 0)
        wrong = [k for k, ok in (("request_id", rid is None or isinstance(rid, str)),
                                 ("layer", _is_int(layer)), ("head", _is_int(head))) if not ok]
        if wrong:
            raise APIError(f"xray needs request_id (text or null), layer and head (integers); {wrong[0]} is "
                           f"{untrusted.shown(body[wrong[0]])}", param=wrong[0], code="invalid_value")
        config = c.engine.model_config  # refused here, not broadcast to every watcher as an engine error (trial 7)
        for key, value, count in (("layer", layer, config.num_hidden_layers), ("head", head, config.num_attention_heads)):
            if not 0 <= value < count:
                raise APIError(f"xray {key} {untrusted.shown(value)} is out of range: this model has {count} {key}s, "
                               f"numbered 0..{count - 1}", param=key, code="invalid_value")
        if rid is not None:
            _text(body, "request_id")  # an id no request can have (a lone surrogate, ...): 400, as for abort
            known = rid in state.ids  # a request submitted and not yet added by the engine counts too
            if not (known or rid in state.hub.live_request_ids() or rid in state.hub.ended_request_ids()):
                raise APIError(f"no running, waiting or recently finished request "
                               f"{untrusted.shown(rid, MAX_REQUEST_ID_CHARS, as_json=True)} to X-Ray (the "
                               "id is wrong, or it ended long ago: the ids are in GET /v1/engine/events)",
                               status=404, param="request_id", code="request_not_found")
        c.xray(rid, layer, head)
    elif name == "snapshot":
        state.hub.request_blocks_snapshot()
    else:  # submit
        return {"ok": True, "request_id": _control_submit(state, body)}
    return {"ok": True}


# SamplingParams fields that hold integers (or a list of them): a whole-number float sent for one is
# that integer, as in /v1/completions (protocol.whole_number)
_INT_PARAMS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if "int" in str(f.type))
_NULL_PARAMS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if "None" in str(f.type))  # null is a value


def _whole_numbers(value: Any) -> Any:
    """``whole_number`` of ``value``, or of each item of a list (``stop_token_ids``)."""
    return [whole_number(v) for v in value] if isinstance(value, list) else whole_number(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(body: dict, key: str) -> str:
    """``body[key]``, a client's id or owner name (:func:`id_problem`'s checks).

    Raises:
        APIError: 400 ``missing_required_parameter`` when it is absent (as every other missing
            field), ``invalid_value`` when it is not text (null included) or fails a check.
    """
    value = body.get(key)
    if key not in body:
        raise APIError(f"{body.get('command', 'the command')} needs {key}: a string of 1 to {MAX_REQUEST_ID_CHARS} "
                       f"characters", param=key, code="missing_required_parameter")
    if not isinstance(value, str):
        raise APIError(f"{key} must be a string of 1 to {MAX_REQUEST_ID_CHARS} characters, got "
                       f"{untrusted.shown(value)}", param=key, code="invalid_value")
    problem = id_problem(key, value)
    if problem is not None:
        raise APIError(problem, param=key, code="invalid_value")
    return value


def _control_submit(state: ServerState, body: dict) -> str:
    """A prompt typed into an attached app: checked and queued like any client's, watched by every app.

    ``request_id`` (optional, at most 128 characters) must not start with a prefix the server
    uses for its own ids (``cmpl-``, ``chatcmpl-``, ``ctl-``) nor belong to a request of this
    kind still running. Returns the id.

    Raises:
        APIError: 400 for a bad prompt (as ``/v1/completions`` would refuse it), params,
            priority or request_id.
    """
    prompt = body.get("prompt")
    if isinstance(prompt, list):  # token ids written 3.0 (whole_number); chat messages are left as they are
        prompt = [whole_number(t) for t in prompt]
    token_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if isinstance(prompt, list) and any(isinstance(m, dict) for m in prompt):
        # chat messages: each checked exactly as /v1/chat/completions checks it (trial 29b: unknown keys in a
        # message were ignored, a message without content got the generic line, tool_calls were refused)
        prompt = conversation_of(prompt, "prompt")
    elif not (isinstance(prompt, str) or token_ids):
        # absent: missing_required_parameter, as every other missing field (trial 34b); present but not a prompt
        # (null included, as _text reads an id): invalid_value
        raise APIError("submit needs prompt: text, a list of token ids, or a list of chat messages "
                       "({\"role\": ..., \"content\": text}, rendered with the model's chat template)", param="prompt",
                       code="invalid_value" if "prompt" in body else "missing_required_parameter")
    fields = body.get("params")
    fields = {} if fields is None else fields  # only null is left out: [], "" or 0 are refused (trial 31b)
    if not isinstance(fields, dict):
        raise APIError(f"params must be an object of SamplingParams fields, got {untrusted.shown(fields)}",
                       param="params", code="invalid_value")
    known = [f.name for f in dataclasses.fields(SamplingParams)]
    names = {name: f"params.{name}" for name in known}  # errors name the field as sent: params.temperature
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise APIError(f"params has unknown field(s) {untrusted.listed(unknown)}; use SamplingParams field names",
                       param=f"params.{unknown[0]}", code="unknown_parameter")
    # null is "left out" for a field that takes no None (temperature: its default, as /v1/completions reads a
    # null temperature; trial 37b), and the value itself for one that does (max_tokens: up to max_model_len)
    fields = {k: v for k, v in fields.items() if v is not None or k in _NULL_PARAMS}
    fields = {k: _whole_numbers(v) if k in _INT_PARAMS else v for k, v in fields.items()}
    if fields.get("logit_bias") is not None:  # JSON keys are text: {"1234": -100}, as on /v1/completions
        fields["logit_bias"] = logit_bias_ids(fields["logit_bias"], "params.logit_bias")
    try:
        params = SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        message = str(e).removeprefix("SamplingParams.")
        field = message.split("=", 1)[0].split(" ", 1)[0]
        raise APIError(message, param=field if field in names else "params", code="invalid_value").renamed(names) from None
    priority = body.get("priority", 0)
    state.serving.check_priority(priority)  # the engine's rule, as /v1/completions checks it
    state.serving.check_prompt(prompt, params, names)  # exactly what /v1/completions refuses, refused here too
    if body.get("request_id") is None:
        rid = f"ctl-{uuid.uuid4().hex}"
    else:
        rid = _text(body, "request_id")
        if rid.startswith(SERVER_ID_PREFIXES):
            raise APIError(f"request_id {json.dumps(rid)} starts with {rid.split('-', 1)[0]}-, which the server keeps for "
                           "the ids it assigns; choose another (or leave request_id out)", param="request_id", code="invalid_value")
    if state.ids.reserve([rid]) is not None:
        raise APIError(f"request_id {json.dumps(rid)} is already in use by a request that has not finished; "
                       "choose another", param="request_id", code="duplicate_request_id")

    def finished_only(output: Any) -> None:  # a listener keeps the output out of controller.results
        if output.finished:
            state.ids.release(rid)
            state.metrics.observe(output)
        else:  # a first token's TTFT is observed in its step, as a client's request's is
            state.metrics.progress(output)

    if state.shutting_down:  # after the shutdown's abort of everything: it would run unwatched
        state.ids.release(rid)
        raise APIError("the server is shutting down; this prompt was not queued", status=503, type="server_error",
                       code="shutting_down")
    state.controller.submit(prompt, params, priority, request_id=rid, on_output=finished_only)
    return rid


# ---------------------------------------------------------------------- loading


class LoadingGate:
    """The ASGI app ``nanovllm serve`` runs from the moment its port is bound: while the model
    loads (tens of seconds for a real one) it answers at once rather than leaving clients hanging
    on a bound port: ``GET /health`` 503 ``{"status": "loading"}``, every other path 503 with
    OpenAI's error body (code ``model_loading``, a ``Retry-After`` header). Once the controller
    is ready it builds the real app with ``make_app`` (in a worker thread), starts its event hub,
    calls ``on_ready(app)`` and hands every request to it. A load that fails calls ``on_failed()``
    (the command stops the server and reports the error), as does a loaded engine that ``check``
    refuses (``check(controller)`` returns a one-line reason, kept in ``refused``; None to serve).

    It owns the lifespan: the real app's own lifespan never runs under it; its hub is started
    here and shut down with :meth:`ServerState.begin_shutdown`.
    """

    def __init__(self, controller: Any, make_app: Any, on_ready: Any = None, on_failed: Any = None,
                 poll_s: float = 0.05, check: Any = None) -> None:
        self.controller = controller
        self.make_app, self.on_ready, self.on_failed, self.poll_s = make_app, on_ready, on_failed, poll_s
        self.check = check
        self.refused: str | None = None
        self.app: FastAPI | None = None
        self._watch: asyncio.Task | None = None

    @property
    def server_state(self) -> ServerState | None:
        return None if self.app is None else self.app.state.server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._loading(scope, receive, send)
        # a websocket while loading: not accepted (closing the scope without an answer refuses it)

    async def _loading(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["path"] == "/health":
            response: Response = EncodableJSONResponse({"status": "loading"}, status_code=503)
        else:
            message = ("the server is loading its model; try again in a few seconds (GET /health answers "
                       "{\"status\": \"ok\"} once it serves)")
            response = EncodableJSONResponse(APIError(message, status=503, type="server_error", code="model_loading").body(),
                                    status_code=503, headers={"Retry-After": "2"})
        await response(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._watch = asyncio.get_running_loop().create_task(self._open_when_ready())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._watch is not None:
                    self._watch.cancel()
                if self.server_state is not None:
                    self.server_state.begin_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _open_when_ready(self) -> None:
        while self.controller.state == "loading":
            await asyncio.sleep(self.poll_s)
        if self.controller.state != "failed" and self.controller.engine is not None and self.check is not None:
            self.refused = self.check(self.controller)
        if self.controller.state == "failed" or self.controller.engine is None or self.refused is not None:
            if self.on_failed is not None:
                self.on_failed()
            return
        app = await run_in_threadpool(self.make_app)
        app.state.server.hub.start()  # on the event loop, as the app's own lifespan would
        self.app = app
        if self.on_ready is not None:
            self.on_ready(app)


# ---------------------------------------------------------------------- running


def bind_warning(host: str, api_key: str | None) -> str | None:
    """A warning when the server listens beyond this machine without an API key (else None)."""
    if api_key or is_loopback(host):
        return None
    return (f"warning: listening on {host} without --api-key: anyone who can reach this machine can send prompts, "
            "and pause, step or abort the engine; set --api-key KEY (or NANOVLLM_API_KEY)")


class APIServer:
    """uvicorn running :func:`build_app` (or a :class:`LoadingGate` in front of it) on a socket already bound.

    The first Ctrl-C / SIGTERM aborts in-flight requests and ends event streams at once,
    then uvicorn closes connections (waiting at most ``graceful_s`` seconds).
    """

    def __init__(self, app: FastAPI | LoadingGate, log_level: str = "info", access_log: bool = True,
                 graceful_s: float = 3.0) -> None:
        import uvicorn

        self.app = app

        def state() -> ServerState | None:  # a gate has none until the model has loaded
            return app.server_state if isinstance(app, LoadingGate) else app.state.server

        config = uvicorn.Config(app, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=graceful_s,
                                lifespan="on")

        class _Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if not self.should_exit and state() is not None:
                    state().begin_shutdown()
                super().handle_exit(sig, frame)
                # uvicorn raises a caught signal again once it has stopped; the shutdown it asked
                # for is done by then, and the command should end normally (status 0).
                getattr(self, "_captured_signals", []).clear()

        self.server = _Server(config)
        self._thread: threading.Thread | None = None

    def run(self, sock) -> None:
        """Serve on ``sock`` until Ctrl-C / SIGTERM (or :meth:`stop`)."""
        self.server.run(sockets=[sock])

    def start_in_thread(self, sock, timeout: float = 30.0) -> None:
        """Serve from a background thread (tests, benchmarks); returns once it accepts connections.

        Raises:
            RuntimeError: it did not start within ``timeout`` seconds.
        """
        self._thread = threading.Thread(target=self.run, args=(sock,), name="nanovllm-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> bool:
        """As SIGTERM would: abort in-flight requests, then stop; True if it ended in time."""
        self.server.handle_exit(signal.SIGTERM, None)
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
