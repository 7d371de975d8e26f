"""Trial 14b: a newcomer's run of ``nanovllm serve``, ``--connect`` and ``--web`` (docs/serving.md)."""

from __future__ import annotations

import argparse
import http.server
import threading

import httpx
import pytest

CHAT = "/v1/chat/completions"


def nested(depth: int, inner: str = "1") -> str:
    """JSON text of ``inner`` inside ``depth`` arrays: ``[[[1]]]``."""
    return "[" * depth + inner + "]" * depth


def post_text(server, path: str, text: str) -> httpx.Response:
    return httpx.post(server.url + path, content=text, timeout=60,
                      headers={**server.headers, "Content-Type": "application/json"})


# ---------------------------------------------------------------------- 1. JSON nested past the parser's depth

DEEP_BODIES = [  # the trial's: a prompt, chat's logit_bias and a control command, 2000 and 100000 deep
    ("/v1/completions", lambda d: '{"prompt":' + nested(d) + "}"),
    (CHAT, lambda d: '{"messages":[{"role":"user","content":"hi"}],"logit_bias":{"1":' + nested(d) + "}}"),
    ("/v1/engine/control", lambda d: '{"command":' + nested(d) + "}"),
    ("/v1/engine/control", lambda d: '{"command":"submit","prompt":"hi","params":{"stop":' + nested(d, '"a"') + "}}"),
]


DEEP_IDS = ["completions-prompt", "chat-logit_bias", "control-command", "control-submit-stop"]


@pytest.mark.parametrize("path, make", DEEP_BODIES, ids=DEEP_IDS)
@pytest.mark.parametrize("depth", [2000, 100000])
def test_a_body_nested_past_the_parsers_depth_is_a_400_invalid_json_on_every_post_endpoint(tiny_server, path, make,
                                                                                          depth):
    """Trial 14b: json.loads' RecursionError was "Internal Server Error" (500) and a traceback."""
    r = post_text(tiny_server, path, make(depth))
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("the request body is nested too deeply (arrays or objects nested inside one "
                                       "another more than about"), error["message"]
    assert "; send a JSON object" in error["message"] and "\n" not in error["message"]
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("path, make", DEEP_BODIES, ids=DEEP_IDS)
def test_a_body_nested_around_the_parsers_depth_is_a_4xx_never_a_500(tiny_server, path, make):
    """What parses reaches pydantic, the control API's checks and their error messages: none of them
    may recurse past the limit either (depths on both sides of the parser's edge)."""
    for depth in (500, 900, *range(920, 1001, 10)):
        r = post_text(tiny_server, path, make(depth))
        assert 400 <= r.status_code < 500, (depth, r.status_code, r.text[:300])


class _Answers(http.server.BaseHTTPRequestHandler):
    """A server that answers every GET with the same 200 body (not nanovllm's: anything may answer)."""

    body = b"{}"

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_json_from_outside_nested_too_deeply_is_a_one_line_refusal_wherever_it_is_read(tmp_path, monkeypatch):
    """The kind of trial 14b's 500: each reader of outside JSON (the app's --connect client, files on
    disk, a command-line list) meets RecursionError through ``untrusted.loads`` as a ValueError."""
    from nanovllm_core import roofline, untrusted
    from nanovllm_core.cli_args import text_list
    from nanovllm_core.educational.tutorial import TutorialProgress
    from nanovllm_core.model.loader import ModelLoadError, safetensors_files
    from nanovllm_tui.remote import NotNanoServer, RemoteController, RemoteError, _Server, check_server

    deep = nested(5000)
    with pytest.raises(untrusted.JSONTooDeep, match="more than about 1000 levels deep"):
        untrusted.loads(deep)
    assert isinstance(untrusted.JSONTooDeep("x"), ValueError)

    # --connect: the server's events and state lines, an error body, a 200 answer
    remote = RemoteController("http://127.0.0.1:9")
    for kind in ("message", "state"):
        with pytest.raises(ValueError, match="(nested too deeply|not JSON).*more than about 1000 levels deep"):
            remote._dispatch(kind, deep, None)
    refusal = _Server("http://127.0.0.1:9", None, 5.0).refusal(500, deep.encode())
    assert isinstance(refusal, RemoteError) and len(str(refusal)) < 300
    _Answers.body = deep.encode()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(NotNanoServer, match="with something other than JSON"):
            check_server(f"http://127.0.0.1:{httpd.server_address[1]}")
    finally:
        httpd.shutdown()

    # files on disk: the tutorial's progress, the roofline cache, a shard index
    progress = tmp_path / "progress.json"
    progress.write_text(deep)
    assert "is not JSON" in TutorialProgress.load(progress).notice
    cache = tmp_path / "roofline.json"
    cache.write_text(deep)
    assert roofline._read_cache(cache) == {}
    (tmp_path / "model.safetensors.index.json").write_text(deep)
    with pytest.raises(ModelLoadError, match="is not a valid shard index"):
        safetensors_files(tmp_path)

    # a command-line list (nanovllm serve --allowed-origins)
    with pytest.raises(argparse.ArgumentTypeError, match="expected a JSON list of strings"):
        text_list(deep)
