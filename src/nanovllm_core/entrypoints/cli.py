"""``nanovllm serve``: the OpenAI-compatible server on the command line.

    nanovllm serve [--model M] [engine options as for nanovllm] [--host 127.0.0.1] [--port 8000] [--api-key KEY]

The port is bound and served before the model loads, so a port in use is reported at once and
a client gets an answer at once (503 ``{"status": "loading"}`` on ``/health``) while the model
loads; a model that cannot load ends the command with one line. Bad options end with status 2.
"""

from __future__ import annotations

import argparse
import gc
import logging
import socket
import sys
import threading
import time
from typing import Any, Sequence

from nanovllm_core.cli_args import (
    _Parser,
    add_engine_arguments,
    add_model_arguments,
    api_key,
    api_key_default,
    contiguous_problem,
    engine_kwargs,
    origin_list,
    positive_bytes,
    positive_int,
    served_name,
    tcp_port,
    text_list,
)


def startup_line(model_name: str, weights: str, url: str, api_key: bool, paused: bool) -> str:
    """The line ``nanovllm serve`` prints once it listens: the model, where, how to watch, and a
    pause it starts with; the optional pieces are joined, so none leaves an empty ``; ;``."""
    pieces = [f"nanovllm serve: {model_name} ({weights}) on {url}/v1 "
              f"(watch it: nanovllm-tui --connect {url}{' --api-key KEY' if api_key else ''})"]
    if paused:
        pieces.append("paused: requests wait until a resume")
    pieces.append("Ctrl-C stops")
    return "; ".join(pieces)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nanovllm serve",
                description="Serve the engine over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, "
                            "/v1/models), /health and /metrics; watch it with `nanovllm-tui --connect URL`.")
    add_model_arguments(p)
    add_engine_arguments(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    s.add_argument("--port", type=tcp_port, default=8000, help="TCP port (default 8000)")
    s.add_argument("--api-key", type=api_key, default=api_key_default(),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $NANOVLLM_API_KEY, else none; "
                        "an empty KEY is none)")
    s.add_argument("--served-model-name", type=served_name, default=None,
                   help="the model name clients send (default: the model's own name)")
    s.add_argument("--paused", action="store_true",
                   help="start with the engine paused: requests are accepted and wait until an attached app "
                        "(nanovllm-tui --connect URL, space) or POST /v1/engine/control {\"command\": \"resume\"} "
                        "resumes it")
    s.add_argument("--max-body-bytes", type=positive_bytes, default=None,
                   help="refuse a request body larger than this with 413 (default: 64 bytes per token of "
                        "the model's context, at least 1 MiB)")
    c = p.add_argument_group("CORS (which web pages on other origins may call the server; vLLM's options)")
    c.add_argument("--allowed-origins", type=origin_list, default=["*"], metavar="LIST",
                   help="origins whose pages may call the server, a JSON list or comma-separated (default [\"*\"]: "
                        "any page, as vLLM; e.g. '[\"http://localhost:3000\"]')")
    c.add_argument("--allowed-methods", type=text_list, default=["*"], metavar="LIST",
                   help="HTTP methods those pages may use (default [\"*\"])")
    c.add_argument("--allowed-headers", type=text_list, default=["*"], metavar="LIST",
                   help="request headers those pages may send (default [\"*\"])")
    c.add_argument("--allow-credentials", action="store_true",
                   help="let those pages send cookies and HTTP authentication (default: off)")
    s.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info")
    s.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    return p


def cors_options(args: argparse.Namespace) -> dict[str, Any]:
    """``build_app``'s ``cors``: the CORS options given (vLLM's names and defaults)."""
    return {"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
            "allow_headers": args.allowed_headers, "allow_credentials": args.allow_credentials}


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``.

    Raises:
        OSError: the address is in use, not this machine's, or not allowed.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def start_loading(args: argparse.Namespace):
    """Start the engine thread loading the model (returns at once); each loading stage is printed on stderr."""
    from nanovllm_core.engine.controller import EngineController

    kwargs = engine_kwargs(args)
    controller = EngineController(kwargs.pop("model"), start_paused=args.paused, **kwargs)
    controller.engine_died = None  # the engine's fatal error once it stopped for good (the exit status is then 1)
    # The loading stages stop once the command has said its last line: a signal while the model loaded
    # printed "stopped before the model had loaded" and then the loader's next stages after it.
    controller.said_lock, controller.said_last = threading.Lock(), False
    controller.subscribe(progress_printer(controller), topk=0, blocks=False)
    return controller


def progress_printer(controller: Any):
    """The subscriber printing each loading stage once on stderr (none after :func:`say_last`), and an
    engine that stopped for good once (``controller.engine_died``)."""
    from nanovllm_core import events as ev

    seen: set[str] = set()

    def progress(event: ev.Event) -> None:
        if isinstance(event, ev.ModelLoading) and event.stage not in seen and not event.ready:
            seen.add(event.stage)
            with controller.said_lock:  # none after the command's last line (say_last)
                if not controller.said_last:
                    print(f"nanovllm serve: {event.stage}...", file=sys.stderr, flush=True)
        elif isinstance(event, ev.EngineError) and controller.engine_died is None:
            engine = controller.engine  # the engine stopped for good (a tensor-parallel rank died): said once
            if engine is not None and engine.fatal_error is not None and event.message == engine.fatal_error:
                controller.engine_died = event.message
                print(f"nanovllm serve: error: {event.message}; requests in flight ended with it, new ones get 503 "
                      "engine_dead; restart nanovllm serve", file=sys.stderr, flush=True)

    return progress


def say_last(controller, line: str) -> None:
    """Print the command's last line on stderr; no loading stage is printed after it."""
    with controller.said_lock:
        controller.said_last = True
        print(line, file=sys.stderr, flush=True)


def pool_problem(controller: Any) -> str | None:
    """Why the loaded engine cannot serve (one line), or None: its KV pool holds fewer tokens than
    one sequence of ``max_model_len``, which a request without ``max_tokens`` may run to (chat
    does by default). vLLM refuses to start so too ("the model's max seq len is larger than the
    maximum number of tokens that can be stored in KV cache")."""
    engine = controller.engine
    return pool_text(engine.block_manager.num_blocks, engine.block_manager.block_size, engine.max_model_len)


def early_pool_problem(args: argparse.Namespace) -> str | None:
    """:func:`pool_problem` decided from the options and the model's config, before any weight loads: with
    ``--num-kv-blocks`` the pool's size is known, and so are the block size and ``max_model_len`` once the
    config is read (trials 42c, 43c: the refusal came after a 12 s load while /health said "loading").
    None when the options leave it to the loaded engine (the pool sized from free memory) or the config
    cannot be read here (the load then says why)."""
    if args.num_kv_blocks is None:
        return None
    try:
        from nanovllm_core.config import EngineConfig
        from nanovllm_core.engine.llm_engine import planned_block_size
        from nanovllm_core.model.loader import read_model_config, resolve_model

        kwargs = engine_kwargs(args)
        config = EngineConfig(**kwargs)
        model_config = read_model_config(resolve_model(config.model, None))
    except Exception:  # a bad model or setting: the load reports it in its own words
        return None
    limit = config.max_model_len or model_config.max_position_embeddings
    block_size = planned_block_size(config, model_config, config.torch_device, config.torch_dtype)
    return pool_text(config.num_kv_blocks, block_size, limit)


def pool_text(blocks: int, block_size: int, limit: int) -> str | None:
    """The one-line refusal of a pool of ``blocks`` x ``block_size`` tokens below ``limit`` (``max_model_len``), or None."""
    pool = blocks * block_size
    if pool >= limit:
        return None
    return (f"the KV pool holds {blocks} block{'s' if blocks != 1 else ''} x {block_size} token{'s' if block_size != 1 else ''} = {pool} token{'s' if pool != 1 else ''}, fewer than one sequence of "
            f"max_model_len {limit} (a request without max_tokens may run that long); add --max-model-len {pool} "
            f"(or less), or raise --num-kv-blocks to {-(-limit // block_size)}")


def load(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """Start the engine thread and wait for the model (status 2 and one line if it cannot load)."""
    controller = None
    try:
        controller = start_loading(args)
        while controller.state == "loading":
            time.sleep(0.05)
    except KeyboardInterrupt:
        if controller is not None:
            controller.shutdown(timeout=1.0)
        raise
    if controller.state == "failed":
        controller.shutdown(timeout=1.0)
        parser.error(controller.load_failure or f"model failed to load: {controller.load_error}")
    return controller


def main(argv: Sequence[str] | None = None) -> int:
    """Bind the port, serve at once (503 ``loading`` while the model loads: ``LoadingGate``), then
    the OpenAI API until Ctrl-C / SIGTERM. Status 2 and one line for bad options, a port in use or
    a model that cannot load."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if contiguous_problem(args):  # a setting the contiguous baseline would ignore
        parser.error(contiguous_problem(args))
    from nanovllm_core.entrypoints.api_server import APIServer, LoadingGate, bind_warning, build_app

    before = frozenset(threading.enumerate())  # engine threads not this server's (a test process's own)
    early = early_pool_problem(args)  # a pool too small, known from the options and the config: refused unloaded
    if early is not None:
        parser.error(early)

    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        parser.error(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}; choose another --port or --host")
    warning = bind_warning(args.host, args.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown}:{args.port}"
    try:
        controller = start_loading(args)
    except KeyboardInterrupt:
        sock.close()
        return 130

    def make_app():
        # What exists now (torch, the model, the tokenizer: ~10^5 objects) lives as long as the server:
        # keep it out of the garbage collector's full passes, which would otherwise stall requests for
        # hundreds of ms now and then, and take seconds more when the process exits.
        gc.freeze()
        return build_app(controller, model_name=args.served_model_name, api_key=args.api_key,
                         max_body_bytes=args.max_body_bytes, cors=cors_options(args))

    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_level = logging.INFO

    def ready(app) -> None:
        from nanovllm_core.model.quantization import describe_weights  # torch is loaded by now

        uvicorn_log.setLevel(uvicorn_level)

        model = controller.engine.model
        print(startup_line(app.state.server.model_name, f"{model.quantization or 'float'} weights: "
                           f"{describe_weights(model)}", url, api_key=bool(args.api_key), paused=args.paused),
              file=sys.stderr, flush=True)

    server: APIServer | None = None
    gate: LoadingGate | None = None

    def failed() -> None:  # the server stops; the error is reported below, once it has
        server.server.should_exit = True

    try:
        # Serving starts before the model has loaded: /health answers {"status": "loading"} at once.
        gate = LoadingGate(controller, make_app, on_ready=ready, on_failed=failed, check=pool_problem)
        server = APIServer(gate, log_level=args.log_level, access_log=not args.no_access_log)
        uvicorn_level = uvicorn_log.level  # as the APIServer's config set it (--log-level)
        # uvicorn's own start-up lines wait for the model (ready() restores the level): a model that
        # cannot load still ends the command with one line, not uvicorn's start and stop lines first.
        uvicorn_log.setLevel(max(uvicorn_level, logging.WARNING))
        server.run(sock)
    finally:
        state = controller.state
        controller.shutdown(timeout=2.0)
        sock.close()
    if state == "loading":  # stopped (SIGTERM, Ctrl-C) before the model was ready: say so, not nothing (trial 13)
        say_last(controller, "nanovllm serve: stopped before the model had loaded; nothing was served")
    if state != "failed":
        # SIGTERM or Ctrl-C while the model still loads (or inside a long step): the engine thread is
        # in torch's code, and the interpreter's teardown under it aborted (status 134, trial 12).
        # The server has stopped and answered what it had; end the process past that thread.
        from nanovllm_core.yield_gate import leave_when_engines_stop

        leave_when_engines_stop(1 if controller.engine_died else 0, seconds=1.0, ignore=before)
    if state == "failed":
        parser.error(controller.load_failure or f"model failed to load: {controller.load_error}")
    if gate is not None and gate.refused is not None:
        parser.error(gate.refused)
    return 1 if getattr(controller, "engine_died", None) else 0  # the engine died while serving: said when it did


if __name__ == "__main__":
    sys.exit(main())
