"""The command lines: ``nanovllm serve`` (a real process: start, serve, stop on SIGTERM) and the app's
``--connect`` / ``--web`` options; bad ones end with status 2 and one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from nanovllm_core.entrypoints import cli as serve_cli
from nanovllm_core.entrypoints.api_server import bind_warning
from nanovllm_tui import options
from nanovllm_tui.remote import RemoteController
from tests.conftest import end_process_group, run_main
from tests.tui_helpers import TRACE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.real_model
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_model_loads_ends_the_server_cleanly(sig):
    """Trial 12: SIGTERM (``docker stop``, systemd) or SIGINT while the embedded model was still loading
    aborted the server: "terminate called without an active exception", status 134 (the interpreter's
    teardown ran under the loading thread, inside torch). It ends with status 0 as after loading."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), *sys.path) if p),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm_core.cli", "serve", "--port", str(free_port()),
                             "--no-access-log"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:  # the first loading stage: the weights are being read
            line = proc.stderr.readline()
            lines.append(line)
            if not line or line.startswith("nanovllm serve: reading"):
                break
        assert lines[-1].startswith("nanovllm serve: reading"), "".join(lines)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        err = "".join(lines) + proc.stderr.read()
        assert code == 0 and "terminate called" not in err and "Traceback" not in err, (code, err)
        assert err.rstrip().endswith("nanovllm serve: stopped before the model had loaded; nothing was served"), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_sigterm_aborts_the_stream_in_flight_and_exits_within_seconds(tiny_llama_dir):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), *sys.path) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm_core.cli", "serve", "--model", str(tiny_llama_dir),
                             "--port", str(port), "--num-kv-blocks", "64", "--no-access-log"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        chunks, stopped_at = [], None
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    if stopped_at is None:
                        proc.send_signal(signal.SIGTERM)  # mid-stream
                        stopped_at = time.monotonic()
        assert chunks[-1] == "[DONE]"
        assert json.loads(chunks[-2])["choices"][0]["finish_reason"] == "abort"
        assert time.monotonic() - stopped_at < 5  # the server's own shutdown is prompt
        # Python's teardown of torch takes seconds more on a busy machine: wait for it generously.
        code = proc.wait(timeout=60)
        err = proc.stderr.read()
        assert code == 0 and "Traceback" not in err, err
        assert f"on http://127.0.0.1:{port}/v1" in err and "nanovllm-tui --connect" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_bad_options_end_with_one_line(capsys, tiny_llama_dir):
    code, _, err = run_main(serve_cli.main, capsys, "--port", "0")
    assert code == 2 and "a TCP port is 1 to 65535, got 0" in err
    for beyond in ("65536", "99999"):  # once a traceback from bind()
        code, _, err = run_main(serve_cli.main, capsys, "--port", beyond)
        assert code == 2 and f"a TCP port is 1 to 65535, got {beyond}" in err and "Traceback" not in err
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, _, err = run_main(serve_cli.main, capsys, "--port", str(port))
        assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_main(serve_cli.main, capsys, "--model", str(tiny_llama_dir / "missing"), "--port",
                            str(free_port()))
    assert code == 2 and "model failed to load" in err and "Traceback" not in err
    code, _, err = run_main(serve_cli.main, capsys, "--quantization", "int4")
    assert code == 2 and "--quantization: invalid choice: 'int4'" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_main(serve_cli.main, capsys, "--quantization", "int8")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--quantization: quantization int8 was removed; use q8_0 (int8 weights in 32-weight blocks" in err


@pytest.mark.parametrize("argv, message", [
    (["--port", "-1"], "--port: a TCP port is 1 to 65535, got -1"),  # trial 12b: "expected a positive integer"
    (["--port", "0"], "--port: a TCP port is 1 to 65535, got 0"),
    (["--port", "99999"], "--port: a TCP port is 1 to 65535, got 99999"),
    (["--port", "http"], "--port: a TCP port is a whole number from 1 to 65535, got 'http'"),
    (["--tp-master-port", "-5"], "--tp-master-port: a TCP port is 1 to 65535, got -5"),
    (["--served-model-name", ""], "--served-model-name: the name clients send as model must not be empty, got ''; "
                                  "leave the option out to serve under the model's own name"),
    (["--served-model-name", "  "], "must not be empty"),
])
def test_serve_range_and_empty_name_messages_say_what_to_give(capsys, monkeypatch, argv, message):
    """Trial 12b: ``--served-model-name ''`` served the model's own name silently, and ``--port -1``
    and ``--port 99999`` were refused in two wordings."""
    def no_serving(host, port):  # an option taken would serve: end with another line rather than serve
        raise OSError(98, "the test does not serve")

    monkeypatch.setattr(serve_cli, "listen", no_serving)
    code, _, err = run_main(serve_cli.main, capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, message", [
    (["--web", "--port", "-1"], "--port: a TCP port is 1 to 65535, got -1"),
    (["--web", "--port", "70000"], "--port: a TCP port is 1 to 65535, got 70000"),
])
def test_the_apps_port_says_the_same(capsys, argv, message):
    code, _, err = run_main(options.build_app, capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_nanovllm_serve_is_a_subcommand_of_nanovllm(capsys):
    from nanovllm_core import cli

    code, out, _ = run_main(cli.main, capsys, "serve", "--help")
    assert code == 0 and "nanovllm serve" in out and "--api-key" in out


def test_listening_beyond_this_machine_without_a_key_warns():
    assert bind_warning("127.0.0.1", None) is None and bind_warning("::1", None) is None
    assert bind_warning("localhost", None) is None and bind_warning("0.0.0.0", "k") is None
    warning = bind_warning("0.0.0.0", None)
    assert warning.startswith("warning: listening on 0.0.0.0 without --api-key") and "--api-key KEY" in warning


def test_app_connect_checks_the_server_and_its_key_first(tiny_server, capsys, monkeypatch):
    monkeypatch.setattr(options, "REFUSED_WAIT_S", 0.5)  # nothing will start there: no need to wait 60 s
    code, _, err = run_main(options.parse_args, capsys, "--connect", f"http://127.0.0.1:{free_port()}")
    assert code == 2 and "cannot reach" in err and "nanovllm serve" in err
    code, _, err = run_main(options.parse_args, capsys, "--connect", tiny_server.url)
    # trial 30c: no key was sent, so nothing was refused: the server needs one
    assert code == 2 and "needs an API key (pass --api-key KEY or set $NANOVLLM_API_KEY)" in err
    assert "refused" not in err
    code, _, err = run_main(options.parse_args, capsys, "--connect", tiny_server.url, "--api-key", "nope")
    assert code == 2 and "not the server's" in err
    code, _, err = run_main(options.parse_args, capsys, "--connect", tiny_server.url, "--model", "x")
    assert code == 2 and "--model cannot be used with --connect" in err
    code, _, err = run_main(options.parse_args, capsys, "--port", "9000")
    assert code == 2 and "add --web" in err
    app = options.build_app(["--connect", tiny_server.url, "--api-key", tiny_server.api_key])
    assert isinstance(app.controller, RemoteController) and app.controller.url == tiny_server.url


@pytest.mark.parametrize("url", ["not a url", "http://127.0.0.1:99999", "http://[::1", "http://h:x", "http://h:0", ""])
@pytest.mark.parametrize("web", [False, True])
def test_a_bad_connect_address_ends_with_one_line_and_status_2(capsys, url, web):
    """Newcomer trial (issue 29): these ended in a traceback (InvalidURL, "Port out of range",
    "Invalid IPv6 URL") with status 1, where ftp://x got one line and status 2."""
    code, out, err = run_main(options.parse_args, capsys, *(["--web"] if web else []), "--connect", url)
    assert code == 2 and "Traceback" not in err and err.count("\n") <= 2, err
    assert f"--connect: {url!r} is not a server address" in err and "http://127.0.0.1:8000" in err


def test_connect_takes_the_v1_address_serve_prints(tiny_server, capsys):
    """serve's start-up line shows http://HOST:PORT/v1 first; --connect with it asked for /v1/v1/models."""
    for url in (tiny_server.url + "/v1", tiny_server.url + "/v1/"):
        args = options.parse_args(["--connect", url, "--api-key", tiny_server.api_key])
        assert args.connect == url
        assert RemoteController(url, tiny_server.api_key).url == tiny_server.url


def test_web_passes_every_other_option_to_the_app():
    from nanovllm_tui.web import app_arguments

    argv = ["--web", "--port", "8123", "--connect", "http://h:1", "--host=0.0.0.0", "--fps", "5"]
    assert app_arguments(argv) == ["--connect", "http://h:1", "--fps", "5"]


@pytest.mark.parametrize("key_args", [["--api-key", "s3cret-key"], ["--api-key=s3cret-key"], ["--api", "s3cret-key"],
                                      ["--ap=s3cret-key"]])
def test_web_passes_the_api_key_in_the_environment_not_on_the_command_line(key_args):
    """The key on the app processes' command line showed in textual-serve's banner and in ``ps``."""
    from nanovllm_tui.web import app_arguments, app_environment

    argv = ["--we", "--po", "8123", *key_args, "--connect", "http://h:1", "--ho=::1"]
    assert app_arguments(argv) == ["--connect", "http://h:1"]
    # each visitor's app is marked so (its tutorial progress lasts the visit: trial 48a)
    assert app_environment("s3cret-key") == {"NANOVLLM_API_KEY": "s3cret-key", "NANOVLLM_WEB_VISITOR": "1"}
    assert app_environment(None) == {"NANOVLLM_API_KEY": None,  # --api-key "" overrides a key in the environment
                                     "NANOVLLM_WEB_VISITOR": "1"}


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    continue
                if ppid == parent:
                    found.append(int(entry))
                    todo.append(int(entry))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the app process's /proc entries")
def test_web_key_is_in_no_banner_and_no_app_command_line(tmp_path):
    """``nanovllm-tui --web --api-key KEY``: the banner and the app process a page starts show no KEY;
    the app process has it in $NANOVLLM_API_KEY."""
    import aiohttp

    port, key = free_port(), "s3cret-key-41"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), *sys.path) if p)}
    env.pop("NANOVLLM_API_KEY", None)
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        web = subprocess.Popen([sys.executable, "-m", "nanovllm_tui.app", "--web", "--port", str(port),
                                "--replay", str(TRACE), "--api-key", key], env=env, cwd=tmp_path, stdout=sink,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert web.poll() is None, out.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "nothing listened"
                time.sleep(0.2)

        async def open_page_and_read_app_process() -> tuple[str, str]:
            async with aiohttp.ClientSession() as http:
                async with http.ws_connect(f"http://127.0.0.1:{port}/ws?width=80&height=24"):
                    end = time.monotonic() + 30
                    while time.monotonic() < end:
                        for pid in _children(web.pid):
                            try:
                                with open(f"/proc/{pid}/cmdline", "rb") as f:
                                    cmdline = f.read().replace(b"\0", b" ").decode()
                                with open(f"/proc/{pid}/environ", "rb") as f:
                                    environ = f.read().decode("utf-8", "replace")
                            except OSError:
                                continue
                            if "nanovllm_tui.app" in cmdline and "--web" not in cmdline:
                                return cmdline, environ
                        await asyncio.sleep(0.1)
            raise AssertionError("no app process started for the page")

        import asyncio

        cmdline, environ = asyncio.run(open_page_and_read_app_process())
        assert "--replay" in cmdline and key not in cmdline and "--api-key" not in cmdline
        assert f"NANOVLLM_API_KEY={key}" in environ.split("\0")
    finally:
        end_process_group(web)
    banner = out.read_text()
    assert "Serving" in banner and key not in banner


def test_web_port_in_use_ends_with_one_line(capsys):
    from nanovllm_tui.app import main

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, _, err = run_main(main, capsys, "--web", "--port", str(port), "--replay",
                                str(TRACE))
    assert code == 2 and f"--web cannot listen on 127.0.0.1:{port}" in err


@pytest.mark.parametrize("url", ["ftp://x", "http://"])
def test_remote_controller_refuses_what_is_not_a_server_address(url):
    from nanovllm_tui.remote import RemoteError

    with pytest.raises(RemoteError, match="not a server address"):
        RemoteController(url)


def test_serve_paused_starts_the_engine_paused(tiny_llama_dir):
    """``nanovllm-tui --connect URL --paused`` says to set it on ``nanovllm serve``: it exists there."""
    parser = serve_cli.build_parser()
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--paused", "--num-kv-blocks", "16"])
    controller = serve_cli.load(args, parser)
    try:
        assert controller.state == "paused"
    finally:
        controller.shutdown(timeout=5)
    assert not serve_cli.build_parser().parse_args([]).paused
    assert "--paused" in parser.format_help() and "--max-body-bytes" in parser.format_help()


@pytest.mark.parametrize("paused", [False, True])
@pytest.mark.parametrize("api_key", [False, True])
def test_the_startup_line_has_no_empty_piece(paused, api_key):
    """Newcomer trial 3: the line read "...--connect http://127.0.0.1:18431); ; Ctrl-C stops"."""
    line = serve_cli.startup_line("smollm2", "q4_1 weights: 90 MiB", "http://127.0.0.1:8000", api_key=api_key,
                                  paused=paused)
    pieces = line.split("; ")
    assert all(p.strip() for p in pieces) and ";;" not in line.replace(" ", ""), line
    assert pieces[-1] == "Ctrl-C stops" and ("paused: requests wait until a resume" in pieces) == paused
    assert line.startswith("nanovllm serve: smollm2 (q4_1 weights: 90 MiB) on http://127.0.0.1:8000/v1 (watch it: "
                           "nanovllm-tui --connect http://127.0.0.1:8000" + (" --api-key KEY)" if api_key else ")"))


def test_connect_with_paused_points_at_an_option_serve_has(capsys):
    code, _, err = run_main(options.build_app, capsys, "--connect", "http://127.0.0.1:9", "--paused")
    assert code == 2 and "`nanovllm serve --paused`" in err and "press space" in err
    assert "--paused" in serve_cli.build_parser().format_help()


@pytest.mark.parametrize("argv", [["--scheduling-policy", "fcfs"], ["--scheduling-policy", "priority"],
                                  ["--block-size", "32"], ["--max-prefill-tokens", "256"], ["--max-num-seqs", "8"],
                                  ["--no-prefix-caching"], ["--num-kv-blocks", "64"], ["--tensor-parallel-size", "2"],
                                  ["--model", "x"]])
def test_connect_refuses_every_engine_option_with_a_tail_that_fits_it(capsys, argv):
    """Newcomer trial 3: --scheduling-policy fcfs, --block-size, --max-prefill-tokens, --max-num-seqs
    and --no-prefix-caching were accepted silently under --connect, and every refusal ended with
    "press space in the app to pause". Each is refused, pointing at the server's own option."""
    code, _, err = run_main(options.build_app, capsys, "--connect", "http://127.0.0.1:9", *argv)
    option = argv[0]
    assert code == 2 and f"{option} cannot be used with --connect" in err and f"`nanovllm serve {option}`" in err
    assert "pause" not in err and err.count("\n") == 1
    dest = option[2:].replace("-", "_")
    assert dest in options.SERVER_SIDE and dest in {a.dest for a in serve_cli.build_parser()._actions}


def test_every_server_side_option_is_one_serve_has():
    serve = {a.dest for a in serve_cli.build_parser()._actions}
    assert set(options.SERVER_SIDE) <= serve, set(options.SERVER_SIDE) - serve


def test_connect_and_replay_are_refused_together_as_two_sources(capsys, tmp_path):
    trace = tmp_path / "run.jsonl"
    trace.write_text("")
    code, _, err = run_main(options.build_app, capsys, "--connect", "http://127.0.0.1:9", "--replay", str(trace))
    assert code == 2 and "give one of them" in err and "nanovllm serve" not in err


def test_serve_answers_at_once_while_its_model_loads_and_connect_waits_for_it(make_tiny_engine, capsys):
    """Newcomer trial (issue 29): while `nanovllm serve` loaded its model (20-40 s) the port was bound
    but nothing answered (curl -m 5 /health timed out) and `nanovllm-tui --connect` said "cannot
    reach ... is nanovllm serve running there?". Now /health says loading, every other path an
    OpenAI 503, and --connect waits (saying so) until the model is ready."""
    import asyncio
    import threading
    import types

    from nanovllm_core.engine.controller import EngineController
    from nanovllm_core.entrypoints.api_server import APIServer, LoadingGate, build_app
    from nanovllm_tui.remote import ServerLoading, check_server
    from tests.serve_helpers import free_socket

    real = EngineController.from_engine(make_tiny_engine(num_kv_blocks=64))
    loading = types.SimpleNamespace(state="loading", engine=None)  # serve's controller, as seen while it loads
    ready = []
    gate = LoadingGate(loading, lambda: build_app(real), on_ready=ready.append, poll_s=0.02)
    sock = free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = APIServer(gate, log_level="warning", access_log=False)
    server.start_in_thread(sock)
    try:
        r = httpx.get(url + "/health", timeout=5)
        assert (r.status_code, r.json()) == (503, {"status": "loading"})
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")):
            r = httpx.request(method, url + path, json={"prompt": "hi"} if method == "POST" else None, timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", (path, r.text)
            assert "loading its model" in r.json()["error"]["message"] and r.headers["retry-after"] == "2"
        with pytest.raises(ServerLoading, match="still loading its model; try again once it prints"):
            check_server(url)
        assert not ready

        def finish_loading() -> None:
            loading.engine, loading.state = real.engine, real.state

        threading.Timer(1.0, finish_loading).start()
        args = options.parse_args(["--connect", url + "/v1"])  # waits, saying so, then checks as usual
        assert args.connect == url + "/v1"
        err = capsys.readouterr().err
        assert err.count("is loading its model; waiting for it (at most 180 s; Ctrl-C stops)") == 1, err
        assert len(ready) == 1 and httpx.get(url + "/health", timeout=5).json() == {"status": "ok"}
        assert check_server(url) == real.engine.model_name
    finally:
        server.stop()
        real.shutdown(timeout=5)
    # a model that fails to load stops the server (serve then reports the load error, status 2)
    failed = []
    broken = LoadingGate(types.SimpleNamespace(state="failed", engine=None), lambda: None,
                         on_failed=lambda: failed.append(True))
    asyncio.run(broken._open_when_ready())
    assert failed == [True] and broken.app is None


def test_serve_refuses_a_kv_pool_smaller_than_one_max_model_len_sequence(capsys, tiny_llama_dir):
    """Newcomer trial 10: `nanovllm serve --num-kv-blocks 40` started, and every chat request without
    max_tokens (chat runs to max_model_len by default) was then refused with a 400 naming a field the
    client never sent. As vLLM does, the server refuses to start, saying which option fixes it."""
    code, _, err = run_main(serve_cli.main, capsys, "--model", str(tiny_llama_dir), "--port", str(free_port()),
                            "--num-kv-blocks", "8", "--no-access-log")
    assert code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.endswith("the KV pool holds 8 blocks x 16 tokens = 128 tokens, fewer than one sequence of "
                         "max_model_len 512 (a request without max_tokens may run that long); add --max-model-len "
                         "128 (or less), or raise --num-kv-blocks to 32"), err
    parser = serve_cli.build_parser()
    assert serve_cli.early_pool_problem(parser.parse_args(["--model", str(tiny_llama_dir), "--num-kv-blocks", "8",
                                                           "--max-model-len", "128"])) is None
    fits = serve_cli.load(parser.parse_args(["--model", str(tiny_llama_dir), "--num-kv-blocks", "8",
                                             "--max-model-len", "128"]), parser)
    try:  # what the line proposes is served
        assert serve_cli.pool_problem(fits) is None
    finally:
        fits.shutdown(timeout=5)


def _other_server(answers: dict[str, tuple[int, bytes]]):
    """A plain HTTP server on a free port answering ``GET path`` with (status, body); 404 "Not Found" elsewhere."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = answers.get(self.path.split("?")[0], (404, b"404: Not Found"))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.mark.parametrize("answers, message", [
    ({}, "has no /v1/models: is it a `nanovllm serve` address?"),  # textual-serve, any web page
    ({"/v1/models": (200, b'{"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]}')},
     "serves 'm' but is not `nanovllm serve`"),  # an OpenAI server without the engine's events
])
def test_connect_to_a_server_that_is_not_nanovllm_says_so(capsys, answers, message):
    """Trial 12b: ``--connect`` to textual-serve's port said ``--connect: 404: Not Found (HTTP 404)``."""
    httpd, url = _other_server(answers)
    try:
        code, _, err = run_main(options.parse_args, capsys, "--connect", url)
    finally:
        httpd.shutdown()
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert "(HTTP 404)" not in err or "has no" in err


def test_the_event_stream_missing_says_what_the_address_is_not():
    from nanovllm_tui.remote import NotNanoServer, _Server

    error = _Server("http://127.0.0.1:9", None, 5.0).refusal(404, b"404: Not Found", "/v1/engine/events")
    assert isinstance(error, NotNanoServer)
    assert str(error).startswith("http://127.0.0.1:9 has no /v1/engine/events: is it a `nanovllm serve` address?")
    # nano-vLLM's own 404s keep their message (a request id not found, say)
    body = b'{"error": {"message": "no request x", "code": "request_not_found"}}'
    assert str(_Server("http://127.0.0.1:9", None, 5.0).refusal(404, body, "/v1/engine/control")) == "no request x (HTTP 404)"
def test_max_body_bytes_is_a_byte_count_with_a_64_bit_bound(capsys):
    """Issue 29, trial 12: --max-body-bytes took positive_int's int32 bound for counts; bytes need 64 bits."""
    parser = serve_cli.build_parser()
    assert parser.parse_args(["--max-body-bytes", str(8 * 2**30)]).max_body_bytes == 8 * 2**30
    for bad in ("0", str(2**63), "1GiB"):
        with pytest.raises(SystemExit) as e:
            serve_cli.build_parser().parse_args(["--max-body-bytes", bad])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and "number of bytes" in err, err


def test_serve_refuses_an_empty_model_name_with_one_line(capsys):
    """Issue 29, trial 12: ``--model ""`` loaded the embedded default without a word."""
    with pytest.raises(SystemExit) as e:  # the parser alone: the old code went on to serve the default model
        serve_cli.build_parser().parse_args(["--model", "", "--port", str(free_port())])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "argument --model: a model name must not be empty" in err


def test_no_loading_stage_is_printed_after_the_commands_last_line(capsys):
    """A signal while the model loaded: 'stopped before the model had loaded; nothing was served' was
    followed by the loader's next stages ('loading weights...'), the command's last line not last (a
    full run under load, 2-core EPYC)."""
    import threading
    from types import SimpleNamespace

    from nanovllm_core import events as ev
    from nanovllm_core.entrypoints.cli import progress_printer, say_last

    controller = SimpleNamespace(said_lock=threading.Lock(), said_last=False, engine_died=None, engine=None)
    progress = progress_printer(controller)
    progress(ev.ModelLoading(stage="reading the weights", done=0, total=2))
    say_last(controller, "nanovllm serve: stopped before the model had loaded; nothing was served")
    progress(ev.ModelLoading(stage="loading weights", done=1, total=2))
    err = capsys.readouterr().err
    assert err.rstrip().endswith("nothing was served") and "loading weights" not in err, err
    assert "nanovllm serve: reading the weights..." in err


def test_serve_refuses_a_pool_the_options_make_too_small_before_loading_any_weight(capsys, tiny_llama_dir,
                                                                                   monkeypatch):
    """Trials 42c, 43c: `nanovllm serve --num-kv-blocks 24 --block-size 4` loaded the weights (12 s, /health
    answering "loading") before its refusal, though the options and the model's config decide it."""
    def no_load(args):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(serve_cli, "start_loading", no_load)
    code, _, err = run_main(serve_cli.main, capsys, "--model", str(tiny_llama_dir), "--port", str(free_port()),
                            "--num-kv-blocks", "24", "--block-size", "4", "--no-access-log")
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].endswith(
        "the KV pool holds 24 blocks x 4 tokens = 96 tokens, fewer than one sequence of max_model_len 512 (a request "
        "without max_tokens may run that long); add --max-model-len 96 (or less), or raise --num-kv-blocks to 128"), err
    bad = serve_cli.build_parser().parse_args(["--model", "/nonexistent/model", "--num-kv-blocks", "2"])
    assert serve_cli.early_pool_problem(bad) is None  # the load says what is wrong with the model, in its words

