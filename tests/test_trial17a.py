"""Trial 17a: nanovllm-tui's output paths checked before anything starts (local, --web, --connect),
in the words of ``nanovllm``; ``--progress-file`` without ``--tutorial``."""

from __future__ import annotations

import pytest

from nanovllm_core import cli


def _refused(capsys, call) -> str:
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2, err
    return err[-1]


PATHS = [
    (["--trace", "{tmp}/BAD/x.jsonl"], "--trace {tmp}/BAD/x.jsonl: the folder {tmp}/BAD does not exist; create it "
                                       "first or choose another path"),
    (["--trace-chrome", "{tmp}"], "--trace-chrome {tmp} is a folder; give a file name in it"),
    (["--progress-file", "{tmp}/file/p.json"], "--progress-file {tmp}/file/p.json: {tmp}/file is not a folder"),
    (["--trace", "{tmp}/t.json", "--trace-chrome", "{tmp}/t.json"],
     "--trace and --trace-chrome name the same file {tmp}/t.json; give each its own"),
]


@pytest.mark.parametrize("mode", ["local", "web", "connect"])
@pytest.mark.parametrize("argv, message", PATHS)
def test_tui_output_paths_are_refused_before_anything_starts(capsys, monkeypatch, tmp_path, mode, argv, message):
    """``nanovllm-tui --web --trace BAD/x.jsonl`` served anyway and every visitor's app failed to start;
    plain ``nanovllm-tui`` said ``cannot write the trace file: [Errno 21] ...`` for ``--trace-chrome``."""
    import nanovllm_tui.remote as remote
    import nanovllm_tui.web as web
    from nanovllm_tui.options import build_app

    def never(*a, **k):
        raise AssertionError("started before the output paths were checked")

    monkeypatch.setattr(web, "page_server", never)
    monkeypatch.setattr(remote, "check_server", never)
    (tmp_path / "file").write_text("")
    argv = [a.format(tmp=tmp_path) for a in argv]
    if mode == "web":  # the paths are checked before --web's own rule on traces
        line = _refused(capsys, lambda: web.serve_in_browser(["--web", "--port", "18417", *argv]))
    elif mode == "connect":
        line = _refused(capsys, lambda: build_app(["--connect", "http://127.0.0.1:9", *argv]))
    else:
        line = _refused(capsys, lambda: build_app(argv))
    assert line.startswith("nanovllm-tui: error: " + message.format(tmp=tmp_path)), line
    assert "Errno" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("option", ["--trace", "--trace-chrome", "--progress-file"])
def test_web_refuses_a_trace_every_visitor_would_write(capsys, monkeypatch, tmp_path, option):
    """One app process per visitor: each would open the same trace file afresh."""
    import nanovllm_tui.web as web

    monkeypatch.setattr(web, "page_server", lambda *a, **k: pytest.fail("served"))
    line = _refused(capsys, lambda: web.serve_in_browser(["--web", "--port", "18417", option, str(tmp_path / "t")]))
    assert line.startswith(f"nanovllm-tui: error: {option} cannot be used with --web: every visitor's app"), line
    # trial 46c: with --connect to a server needing a key, the key was asked for first; the options' own
    # conflict comes before any server is reached
    line = _refused(capsys, lambda: web.serve_in_browser(["--web", "--port", "18417", "--connect", "http://127.0.0.1:9",
                                                          option, str(tmp_path / "t")]))
    assert line.startswith(f"nanovllm-tui: error: {option} cannot be used with --web: every visitor's app"), line


def test_a_trace_file_that_fails_late_is_named_by_its_option(capsys, monkeypatch, tmp_path):
    """A file that passed the check and then cannot be created: the line names the option (the Chrome
    trace is not "the trace file") and says what to do, not errno text."""
    import argparse

    import nanovllm_core.tracing as tracing
    from nanovllm_tui.options import open_recorders

    def fail(self, path):
        raise IsADirectoryError(21, "Is a directory", str(path))

    monkeypatch.setattr(tracing.ChromeTraceRecorder, "__init__", fail)
    args = argparse.Namespace(trace=None, trace_chrome=str(tmp_path / "c.json"))
    line = _refused(capsys, lambda: open_recorders(args))
    assert line == (f"nanovllm-tui: error: --trace-chrome {tmp_path / 'c.json'} cannot be written (Is a directory); "
                    "choose a path you can write")


def test_progress_file_without_tutorial_is_refused_in_one_line(capsys):
    line = _refused(capsys, lambda: cli.main(["--prompt", "hi", "--max-tokens", "1", "--progress-file", "x.json"]))
    assert line == "nanovllm: error: --progress-file applies only with --tutorial; add --tutorial or leave it out"


def test_a_progress_file_whose_folder_exists_is_tried_before_the_tutorial(capsys):
    """``--progress-file /proc/x.json`` passed the check (the folder exists, and root may write) and the
    whole tutorial ran before a note named an internal temp file."""
    line = _refused(capsys, lambda: cli.main(["--tutorial", "--no-demos", "--progress-file", "/proc/x.json"]))
    assert line.startswith("nanovllm: error: --progress-file /proc/x.json cannot be written ("), line
    assert line.endswith("); choose a path you can write")


# ------------------------------------------------------------------ errors quote values as JSON spells them

def _error(server, path, body):
    import httpx

    r = httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


@pytest.mark.parametrize("field, value, shown", [
    ("temperature", -1, "temperature=-1 is invalid"), ("top_p", 0, "top_p=0 is invalid"),
    ("frequency_penalty", 3, "frequency_penalty=3 is invalid"),
    ("repetition_penalty", 0, "repetition_penalty=0 is invalid"),
    ("temperature", -1.0, "temperature=-1.0 is invalid"),  # a float sent as a float stays one
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/engine/control"])
def test_an_integer_sent_is_quoted_as_an_integer(tiny_server, path, field, value, shown):
    """Trial 17a: ``"temperature": -1`` came back as ``temperature=-1.0`` (pydantic's StrictFloat made it
    a float before SamplingParams quoted it)."""
    body = ({"prompt": "x", "max_tokens": 1, field: value} if path == "/v1/completions"
            else {"command": "submit", "prompt": "x", "params": {"max_tokens": 1, field: value}})
    assert shown in _error(tiny_server, path, body)


def test_integer_sampling_values_still_reach_the_engine_as_floats(tiny_server):
    from nanovllm_core.entrypoints.protocol import CompletionRequest

    params = CompletionRequest(prompt="x", temperature=1, top_p=1, repetition_penalty=2).sampling_params(3, None)
    assert all(type(getattr(params, f)) is float for f in ("temperature", "top_p", "repetition_penalty", "min_p"))


def test_logit_bias_errors_spell_json(tiny_server):
    """The example is valid JSON, a key is quoted as sent (text), and 1e400 is clamped as vLLM clamps it."""
    control = {"command": "submit", "prompt": "x", "params": {"max_tokens": 1, "logit_bias": [[30, 1]]}}
    message = _error(tiny_server, "/v1/engine/control", control)
    assert message.startswith("params.logit_bias=[[30, 1]] is invalid") and '{"50256": -100}' in message
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1, "logit_bias": {"-1": 5}}),
                       ("/v1/engine/control", {"command": "submit", "prompt": "x",
                                               "params": {"max_tokens": 1, "logit_bias": {"-1": 5}}})):
        message = _error(tiny_server, path, body)
        assert 'has the key "-1", which is not a token id' in message, message
    import httpx

    r = httpx.post(tiny_server.url + "/v1/completions", headers={**tiny_server.headers, "Content-Type": "application/json"},
                   content='{"prompt": "x", "max_tokens": 2, "temperature": 0, "return_token_ids": true, '
                           '"logit_bias": {"30": 1e400}}', timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [30, 30]  # clamped to +100: forced


@pytest.mark.parametrize("content_type, status", [
    ("application/json; charset=latin-1", 400), ("application/json; charset=\"ISO-8859-1\"", 400),
    ("application/json; charset=utf-16", 400), ("application/json; charset=UTF-8", 200),
    ("application/json;charset=\"utf-8\"", 200), ("application/json; charset=utf8", 200),
    ("application/json; foo=bar", 200),
])
def test_a_charset_other_than_utf8_is_refused_in_one_line(tiny_server, content_type, status):
    """Trial 17a: ``charset=latin-1`` passed the Content-Type check and the body was then read as UTF-8
    ("not valid JSON"); a JSON body is UTF-8 (RFC 8259), and the refusal now says so."""
    import httpx

    r = httpx.post(tiny_server.url + "/v1/completions", content='{"prompt": "caf\u00e9", "max_tokens": 1}'.encode(),
                   headers={**tiny_server.headers, "Content-Type": content_type}, timeout=60)
    assert r.status_code == status, r.text
    if status == 400:
        error = r.json()["error"]
        assert error["code"] == "unsupported_media_type" and "a JSON body is UTF-8 (RFC 8259)" in error["message"]
        assert "\n" not in error["message"]


@pytest.mark.parametrize("key", ["30", "030", " 30", "+30", "3_0", "30 "])
def test_logit_bias_keys_are_read_as_vllm_reads_them_with_int(tiny_server, key):
    """Trial 17a: ``" 30"`` and ``"+30"`` were refused while ``"030"`` was taken; vLLM takes ``int(key)``."""
    import httpx

    body = {"prompt": "x", "max_tokens": 2, "temperature": 0, "return_token_ids": True, "logit_bias": {key: 100}}
    r = httpx.post(tiny_server.url + "/v1/completions", json=body, headers=tiny_server.headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [30, 30]


@pytest.mark.parametrize("key", ["abc", "3.0", "", "-1", "30x", "9" * 5000, "99999999999999999999999"])
def test_a_logit_bias_key_int_refuses_or_outside_the_vocabulary_is_one_line(tiny_server, key):
    message = _error(tiny_server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "logit_bias": {key: 1}})
    assert "\n" not in message and len(message) < 400, message
    assert ("not a token id" in message) or ("vocabulary" in message), message
