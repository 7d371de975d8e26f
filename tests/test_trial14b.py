"""Trial 14b: a newcomer's run of ``nanovllm serve``, ``--connect`` and ``--web`` (docs/serving.md)."""

from __future__ import annotations

import argparse
import http.server
import json
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

    # a safetensors file's header (a file on disk that claims to be one; trial 47b's kind)
    import struct

    from nanovllm_core.model.checkpoint_files import safetensors_problem

    header = ("{" + '"a":' * 1 + deep + "}").encode()
    broken = tmp_path / "deep.safetensors"
    broken.write_bytes(struct.pack("<Q", len(header)) + header)
    assert safetensors_problem(broken) == "deep.safetensors is not a safetensors file: its header is not JSON"

    # a command-line list (nanovllm serve --allowed-origins)
    with pytest.raises(argparse.ArgumentTypeError, match="expected a JSON list of strings"):
        text_list(deep)


# ---------------------------------------------------------------------- 2. steps past the 1000 pending


def control(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/engine/control", json=body, headers=server.headers, timeout=30)


def test_a_step_that_would_pass_the_pending_cap_is_refused_with_what_may_be_asked(tiny_server):
    """Trial 14b: 600 then 500 steps both answered {"ok": true}, and only the steps up to the cap ran.
    The command that would pass it is a 400 naming n, the steps pending and the most that may be asked."""
    assert control(tiny_server, {"command": "pause"}).json() == {"ok": True}
    control(tiny_server, {"command": "submit", "prompt": "hi", "params": {"max_tokens": 8}}).raise_for_status()
    held, entered = threading.Event(), threading.Event()
    # the engine thread waits here, so the steps asked stay pending (a step needs a request: trial 15b)
    tiny_server.controller.call(lambda engine: (entered.set(), held.wait(30)))
    try:
        assert entered.wait(30)
        assert control(tiny_server, {"command": "step", "n": 600}).json() == {"ok": True}
        r = control(tiny_server, {"command": "step", "n": 500})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "n" and error["code"] == "too_many_steps"
        assert error["message"] == ("n=500 would make 1100 steps pending, more than the 1000 that may wait at "
                                    "once: 600 are pending already (asked for and not yet run); ask for at most 400 "
                                    "now, or wait until some have run")
        assert control(tiny_server, {"command": "step", "n": 400}).json() == {"ok": True}
        r = control(tiny_server, {"command": "step", "n": 1})
        assert r.status_code == 400 and r.json()["error"]["message"].endswith(
            "1000 are pending already (asked for and not yet run); ask again once some have run")
        assert tiny_server.controller.steps_pending() == 1000
        # a pause while paused drops them: the whole 1000 may be asked again at once, even before it is applied
        assert control(tiny_server, {"command": "pause"}).json() == {"ok": True}
        assert control(tiny_server, {"command": "step", "n": 1000}).json() == {"ok": True}
    finally:
        held.set()
        assert control(tiny_server, {"command": "resume"}).json()["resumed"] is True
    assert tiny_server.controller.steps_pending() == 0
    from tests.conftest import poll_until

    assert poll_until(lambda: not tiny_server.controller.engine.has_unfinished_requests())  # left idle


def test_every_step_accepted_runs_and_the_pending_count_falls_as_they_do(make_tiny_engine):
    """The steps asked for while paused run one for one (trial 14b's 600 + 500 ran 1001: the second
    command came after one step had run, and the cap cut it to what fitted beside the 599 left)."""
    from nanovllm_core.engine.controller import EngineController, StepsPending
    from nanovllm_core.sampling_params import SamplingParams
    from tests.conftest import poll_until

    engine = make_tiny_engine(max_num_seqs=1)
    c = EngineController.from_engine(engine, start_paused=True)
    try:
        c.step(990)  # nothing to run yet: they wait
        start = engine.scheduler.step_index
        rid = c.submit("Tell me a story", SamplingParams(max_tokens=20, ignore_eos=True))
        assert c.wait(rid, timeout=30) is not None  # 20 steps ran
        assert engine.scheduler.step_index - start == 20
        assert poll_until(lambda: c.steps_pending() == 970)
        with pytest.raises(StepsPending, match="970 are pending already .*; ask for at most 30 now") as refused:
            c.step(31)
        assert (refused.value.n, refused.value.pending, refused.value.room) == (31, 970, 30)
        c.step(30)
        assert c.steps_pending() == 1000
    finally:
        c.shutdown(timeout=5)


def test_the_local_apps_step_refused_reaches_its_subscribers_as_a_command_refused(make_tiny_engine):
    """nanovllm-tui's BackgroundController: a refused step is an EngineError "step: ..." (the app's
    "Not done" toast), also for a step that waited for the engine to be built."""
    from nanovllm_core import events as ev
    from nanovllm_core.engine.controller import EngineController
    from nanovllm_tui.starter import BackgroundController
    from tests.conftest import poll_until

    seen = []
    background = BackgroundController(lambda: EngineController.from_engine(make_tiny_engine(), start_paused=True))
    background.subscribe(seen.append, topk=0, blocks=False)
    held = threading.Event()
    background.submit("hi")  # steps need a request to run (trial 15b: else they are dropped)
    background.call(lambda engine: held.wait(30))  # the engine thread waits: the steps stay pending
    background.step(1000)
    background.step(1)  # all wait for the engine to be built
    background.start()
    try:
        refused = lambda: [e for e in seen if isinstance(e, ev.EngineError) and e.message.startswith("step: ")]
        assert poll_until(lambda: len(refused()) == 1, 30)
        assert refused()[0].message.startswith("step: n=1 would make 1001 steps pending")
        background.step(2)  # built now: refused at once, the same way
        assert poll_until(lambda: len(refused()) == 2, 10)
    finally:
        held.set()
        background.shutdown(timeout=5)


@pytest.mark.anyio
async def test_n_under_connect_shows_the_servers_refusal_as_one_line(tiny_server, tmp_path):
    """The app's n, attached to a server with 1000 steps pending: the 400 is a "Not done" toast of one line."""
    from tests.tui_helpers import attached_and_paused, wait_until

    engine, gate = tiny_server.controller.engine, threading.Event()
    try:
        async with attached_and_paused(tiny_server, tmp_path) as (app, pilot, notes):
            r = control(tiny_server, {"command": "submit", "prompt": "Once upon a time", "request_id": "steps-14b",
                                      "params": {"max_tokens": 50, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            await wait_until(pilot, lambda: "steps-14b" in app.state.requests, 10, "the request in the app")
            engine.fault_injector = lambda plan: gate.wait(30)  # the first step holds: 1000 stay pending
            assert control(tiny_server, {"command": "step", "n": 1000}).json() == {"ok": True}
            await pilot.press("n")
            await wait_until(pilot, lambda: notes.find("would make 1001 steps pending"), 10, "the refusal")
            (note,) = notes.find("would make 1001 steps pending")
            assert note.message == ("step: n=1 would make 1001 steps pending, more than the 1000 that may wait at "
                                    "once: 1000 are pending already (asked for and not yet run); ask again once some "
                                    "have run (HTTP 400)")
            assert note.title == "Not done" and note.severity == "warning"
            gate.set()
            control(tiny_server, {"command": "pause"})  # drops the steps left
            control(tiny_server, {"command": "abort", "request_id": "steps-14b"})
    finally:
        gate.set()
        engine.fault_injector = None
    assert poll_until_idle(tiny_server)


def poll_until_idle(server) -> bool:
    """The shared server left as the other tests expect it: running, no request."""
    from tests.conftest import poll_until

    if server.controller.state == "paused":
        control(server, {"command": "resume"})
    server.wait_idle()
    return poll_until(lambda: server.controller.state != "paused", 5)


# ---------------------------------------------------------------------- 3. errors quote a value cut short

BIG_TEXT = "x" * 100_000
BIG_LIST = list(range(30_000))
MOST_ERROR_BYTES = 1000  # a one-line error; the trial's came back at 900 KB


def _fields(model) -> list[str]:
    return sorted(model.model_fields)


def _short_answer(r: httpx.Response, what) -> None:
    assert r.status_code < 500, (what, r.status_code, r.text[:300])
    assert len(r.content) < MOST_ERROR_BYTES, (what, len(r.content), r.text[:300])


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_every_field_of_a_request_is_quoted_short_in_its_error(tiny_server, path):
    """Trial 14b: a 900 KB temperature came back as a 900 KB error. Every field, sent a long text or a
    long list, and a long unknown field name get an answer of one short line."""
    from nanovllm_core.entrypoints.protocol import ChatCompletionRequest, CompletionRequest

    model = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
    base = {"prompt": "hi"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    base["max_tokens"] = 1
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=60) as http:
        for field in [*_fields(model), BIG_TEXT]:
            for value in (BIG_TEXT, BIG_LIST):
                _short_answer(http.post(path, json={**base, field: value}), (field[:20], type(value)))
        message = {"role": "user", "content": "hi"}
        for key in ("role", "content", BIG_TEXT):  # inside a chat message, and a text part
            _short_answer(http.post(CHAT, json={"messages": [{**message, key: BIG_TEXT}]}), key[:20])
        _short_answer(http.post(CHAT, json={"messages": [{"role": "user", "content": [{"type": BIG_TEXT}]}]}), "part")


def test_every_control_field_is_quoted_short_in_its_error(tiny_server):
    from nanovllm_core.entrypoints.api_server import CONTROL_FIELDS
    from nanovllm_core.sampling_params import SamplingParams

    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=60) as http:
        try:
            for command in (BIG_TEXT, BIG_LIST):  # the trial's "unknown command [[[[..." came back at 2 KB
                _short_answer(http.post("/v1/engine/control", json={"command": command}), "command")
            for name, fields in CONTROL_FIELDS.items():
                for field in [*fields, BIG_TEXT]:
                    for value in (BIG_TEXT, BIG_LIST):
                        r = http.post("/v1/engine/control", json={"command": name, field: value})
                        _short_answer(r, (name, field[:20], type(value)))
            for field in [*SamplingParams.__dataclass_fields__, BIG_TEXT]:
                for value in (BIG_TEXT, BIG_LIST):
                    body = {"command": "submit", "prompt": "hi", "params": {"max_tokens": 1, field: value}}
                    _short_answer(http.post("/v1/engine/control", json=body), ("params", field[:20]))
            _short_answer(http.post("/v1/engine/control", json={"command": "xray", "layer": 10 ** 4000}), "layer")
            _short_answer(http.get("/v1/" + "y" * 8000), "path")
            _short_answer(http.get("/v1/engine/events?" + "z" * 8000 + "=1"), "query")
        finally:
            http.post("/v1/engine/control", json={"command": "resume"})
    tiny_server.wait_idle()


def test_a_quoted_value_keeps_its_start_and_says_its_size():
    from nanovllm_core import untrusted

    assert untrusted.shown("0.5") == '"0.5"' and untrusted.shown([5]) == "[5]"  # short: its JSON text
    assert untrusted.shown("x" * 900_000) == '"' + "x" * 40 + '"… (900000 characters)'
    assert untrusted.shown(list(range(5000))) == "[0, 1, 2, 3, 4, 5, 6, 7, ...] (a list of 5000 items)"
    assert untrusted.shown(10 ** 4000) == f"1{'0' * 39}… (4001 digits)"
    assert untrusted.shown("explode", as_json=True) == '"explode"' and untrusted.shown(True, as_json=True) == "true"
    assert untrusted.listed(["a" * 100, "b", "c", "d", "e", "f"]) == (f"{'a' * 60}… (100 characters), b, c, d, e "
                                                                      "and 1 more")
    deep = untrusted.loads(nested(900))
    assert untrusted.shown(deep) == "[[[[[...]]]]] (a list of 1 item)"


@pytest.mark.parametrize("seq", [b"\xb2", b"9" * 5000], ids=["superscript-two", "5000-digits"])
def test_a_last_event_id_that_int_refuses_is_a_fresh_start_not_a_500(tiny_server, seq):
    """Trial 14b's kind in a header: "²" (the byte 0xB2, read as latin-1) passes isdigit(), and so do
    5000 digits; int() refused both with a ValueError, a 500."""
    instance = tiny_server.http.app.state.server.hub.instance
    headers = {**tiny_server.headers, "Last-Event-ID": f"{instance}:".encode() + seq}
    with httpx.stream("GET", tiny_server.url + "/v1/engine/events", headers=headers, timeout=30) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("event: state")


# ---------------------------------------------------------------------- 4. OpenAI chat fields that ask for nothing here

MESSAGES = [{"role": "user", "content": "Say hi"}]


def chat(server, **fields) -> httpx.Response:
    return httpx.post(server.url + CHAT, json={"messages": MESSAGES, "max_tokens": 1, **fields},
                      headers=server.headers, timeout=60)


@pytest.mark.parametrize("fields", [
    {"parallel_tool_calls": False}, {"parallel_tool_calls": True}, {"parallel_tool_calls": None},
    {"store": False}, {"store": None}, {"metadata": {}}, {"metadata": None},
    {"metadata": {"team": "docs", "run": "14b"}},
    {"parallel_tool_calls": False, "store": False, "metadata": {"a": "b"}, "tools": [], "tool_choice": "none"},
], ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_openai_chat_fields_that_ask_for_nothing_are_served(tiny_server, fields):
    """Trial 14b: parallel_tool_calls, store and metadata, standard OpenAI chat fields some client
    frameworks always send, were refused as "Unrecognized request argument"; vLLM takes them."""
    r = chat(tiny_server, **fields)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


@pytest.mark.parametrize("fields, param, message", [
    ({"store": True}, "store", "store is not supported by this server (it keeps no completions to list or distill "
                               "later); leave it out or send false"),
    ({"store": 0}, "store", "Invalid value for store: Input should be a valid boolean (got 0)"),  # 0 == False in Python, not in JSON
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "Invalid value for parallel_tool_calls"),
    ({"metadata": {"n": 1}}, "metadata.n", "Invalid value for metadata.n"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "metadata holds at most 16 key-value pairs, got 17"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "metadata keys hold at most 64 characters and values at most 512"),
    ({"echo": True}, "echo", "echo=true is not supported by this server (a response holds the generated text only, "
                             "not the prompt); leave it out or send false"),
], ids=["store-true", "store-0", "parallel_tool_calls-text", "metadata-number", "metadata-17", "metadata-long",
        "echo"])
def test_chat_fields_that_ask_for_what_this_server_lacks_are_refused_clearly(tiny_server, fields, param, message):
    r = chat(tiny_server, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"] and "Unrecognized" not in error["message"], error
    assert error["message"].count("got ") <= 1, error  # trial 41b: "got 17 (got {...})"


def test_echo_is_refused_in_the_same_words_on_both_routes(tiny_server):
    """Trial 14b: completions said "echo=true is not supported by this server; leave it out", chat
    "Unrecognized request argument supplied: echo"."""
    completion = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "echo": True},
                            headers=tiny_server.headers, timeout=60).json()["error"]
    assert completion == chat(tiny_server, echo=True).json()["error"]
    assert chat(tiny_server, echo=False).status_code == 200


# ---------------------------------------------------------------------- 5. one shape for an aborted chat stream's end


def test_a_chat_stream_ends_alike_aborted_by_the_control_api_or_by_shutdown(make_tiny_engine):
    """Trial 14b: a control API abort ended a chat stream with "delta": {"content": ""}, a shutdown
    with "delta": {}; both are now the first, as vLLM sends a finish with no new text."""
    from nanovllm_core.engine.controller import EngineController
    from tests.conftest import poll_until
    from tests.serve_helpers import start_server

    controller = EngineController.from_engine(make_tiny_engine(num_kv_blocks=64), start_paused=True)
    server = start_server(controller, api_key=None)
    ends: dict[str, dict] = {}

    def read(how: str) -> None:
        body = {"messages": MESSAGES, "max_tokens": 4, "stream": True}
        with httpx.stream("POST", server.url + CHAT, json=body, headers={"X-Request-Id": how}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        ends[how] = chunks[-1]["choices"][0]

    try:
        for how in ("control", "shutdown"):
            reader = threading.Thread(target=read, args=(how,))
            reader.start()
            assert poll_until(lambda: server.stats()["num_waiting"] == 1, 30)  # queued; paused, so no token
            if how == "control":
                assert control(server, {"command": "abort", "request_id": "chatcmpl-control"}).json() == {"ok": True}
            else:
                server.http.app.state.server.begin_shutdown()
            reader.join(30)
            assert not reader.is_alive()
    finally:
        server.stop()
        controller.shutdown(timeout=5)
    assert ends["control"] == ends["shutdown"] == {"index": 0, "delta": {"content": ""}, "logprobs": None,
                                                   "finish_reason": "abort", "stop_reason": None}


def test_the_serving_doc_says_steps_total_counts_steps_run_while_the_app_numbers_them_from_0(tiny_server):
    """Trial 14b: /metrics said 199 while the app said "step 198", and neither the docs nor the
    screen said why. The doc's sentence, and the fact it states."""
    from pathlib import Path

    from nanovllm_core import events as ev

    doc = " ".join((Path(__file__).parent.parent / "docs" / "serving.md").read_text().split())
    assert ("| `nanovllm:steps_total` | counter | engine steps run; the app's header, its tabs and the event stream "
            "number steps from 0 (after the app's \"step 198\", 199 have run) |") in doc  # the metrics table (fix20a)
    planned: list[int] = []
    sub = tiny_server.controller.subscribe(lambda e: planned.append(e.step) if isinstance(e, ev.StepPlanned) else None,
                                           topk=0, blocks=False)
    try:
        r = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                       headers=tiny_server.headers, timeout=60)
        assert r.status_code == 200
        tiny_server.wait_idle()
    finally:
        tiny_server.controller.unsubscribe(sub)
    metrics = httpx.get(tiny_server.url + "/metrics").text
    total = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("nanovllm:steps_total"))
    assert planned and total == planned[-1] + 1
