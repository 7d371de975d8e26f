"""The ``nanovllm`` command: real completions, and one-line errors with exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nanovllm_core import cli


def run_cli(capsys, *args):
    try:
        code = cli.main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.real_model
def test_default_prompt_completes_with_paris(capsys):
    code, out, err = run_cli(capsys, "--max-tokens", "8", "--num-kv-blocks", "64")
    assert code == 0, err
    assert "Prompt: 'The capital of France is'" in out
    assert "Paris" in out.split("Completion:")[1]


@pytest.mark.real_model
def test_several_prompts_with_priorities_and_memory_stats(capsys):
    code, out, _ = run_cli(capsys, "--prompt", "Hello", "--priority", "1", "--prompt", "Python is a",
                           "--priority", "10", "--max-tokens", "4", "--num-kv-blocks", "64", "--show-memory-stats")
    assert code == 0
    assert out.count("Completion:") == 2
    assert "KV cache memory:" in out and "prefix cache:" in out


@pytest.mark.real_model
def test_chat_flag_uses_chat_template(capsys):
    code, out, _ = run_cli(capsys, "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "12",
                           "--num-kv-blocks", "64")
    assert code == 0 and "Paris" in out


@pytest.mark.parametrize("args,message", [
    (["--max-tokens", "0"], "--max-tokens: expected a positive integer"),
    (["--temperature", "-1"], "temperature"),
    (["--prompt", "  "], "--prompt must not be empty"),
    (["--prompt", "a", "--priority", "1", "--priority", "2"], "2 --priority values for 1 --prompt"),
    (["--model", "/does/not/exist"], "does not exist"),
    (["--scheduling-policy", "lottery"], "invalid choice"),
    (["--top-p", "0"], "top_p"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, args, message):
    code, out, err = run_cli(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_bad_model_path_from_a_real_process_prints_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "nanovllm_core.cli", "--model", "/no/such/dir"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("nanovllm: error: model path /no/such/dir does not exist; check the path "
                                   "(or omit --model for the embedded default)")


@pytest.mark.real_model
def test_trace_files_record_the_run(capsys, tmp_path):
    import json

    from nanovllm_core.tracing import read_jsonl

    jsonl, chrome = tmp_path / "run.jsonl", tmp_path / "run.json"
    code, out, _ = run_cli(capsys, "--prompt", "Hi", "--max-tokens", "3", "--num-kv-blocks", "32",
                           "--trace", str(jsonl), "--trace-chrome", str(chrome))
    assert code == 0
    events = read_jsonl(jsonl)
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("TokenSampled") == 3 and kinds[1] == "RequestAdded" and kinds[-1] == "StepTimed"
    assert events[0].ready and events[0].info()["num_layers"] == 30  # the model's facts come first, for replays
    assert "LayerTrace" not in kinds
    assert "RequestFinished" in kinds and "BlocksChanged" in kinds
    names = [e["name"] for e in json.loads(chrome.read_text())["traceEvents"]]
    assert "prefill chunk" in names and "finished (length)" in names


@pytest.mark.real_model
def test_trace_xray_adds_layer_traces_to_the_trace(capsys, tmp_path):
    from nanovllm_core import events as ev
    from nanovllm_core.tracing import read_jsonl

    jsonl = tmp_path / "run.jsonl"
    code, _, _ = run_cli(capsys, "--prompt", "Hi", "--max-tokens", "2", "--num-kv-blocks", "32",
                         "--trace", str(jsonl), "--trace-xray")
    assert code == 0
    traces = [e for e in read_jsonl(jsonl) if isinstance(e, ev.LayerTrace)]
    assert len(traces) == 2 * 30  # every layer of both steps


def test_trace_xray_without_trace_is_one_line(capsys):
    code, _, err = run_cli(capsys, "--trace-xray", "--num-kv-blocks", "8")
    assert code == 2 and "add --trace FILE.jsonl" in err and len(err.strip().splitlines()) == 1


def test_trace_to_unwritable_path_is_one_line(capsys):
    code, _, err = run_cli(capsys, "--trace", "/no/such/dir/run.jsonl", "--num-kv-blocks", "8")
    assert code == 2 and "cannot write the trace file" in err and len(err.strip().splitlines()) == 1
