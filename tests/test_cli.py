"""The ``nanovllm`` command: real completions, and one-line errors with exit status 2."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from nanovllm_core import cli
from nanovllm_core.llm import LLM
from nanovllm_core.sampling_params import SamplingParams
from tests.conftest import run_main


def run_cli(capsys, *args):
    return run_main(cli.main, capsys, *args)


@pytest.mark.real_model
def test_default_prompt_completes_with_paris(capsys):
    code, out, err = run_cli(capsys, "--max-tokens", "8", "--num-kv-blocks", "64")
    assert code == 0, err
    assert "Prompt: 'The capital of France is'" in out
    assert "Paris" in out.split("Completion:")[1]


@pytest.mark.real_model
def test_several_prompts_with_priorities_and_memory_stats(capsys, shared_default_loads):
    code, out, _ = run_cli(capsys, "--prompt", "Hello", "--priority", "1", "--prompt", "Python is a",
                           "--priority", "10", "--max-tokens", "4", "--num-kv-blocks", "64", "--show-memory-stats")
    assert code == 0 and shared_default_loads == [None]  # auto: the loader decides
    assert out.count("Completion:") == 2
    assert "KV cache memory:" in out and "prefix cache:" in out
    # the lookups count every token looked up, re-admitted ones too: not "prompt tokens" (issue 28 review)
    assert "tokens looked up hit (prompts, and tokens re-admitted after a preemption)" in out


@pytest.mark.real_model
def test_chat_flag_uses_chat_template(capsys, shared_default_loads):
    # float32 weights: the shipped Q4_1 blocks (the CPU default) answer this question greedily with
    # "L'Étoile, la Marseillaise," -- and so does llama.cpp on the same file (checked with
    # llama-cpp-python 0.3.36's create_chat_completion): the 4-bit model's answer, not a bug of ours.
    code, out, _ = run_cli(capsys, "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "12",
                           "--num-kv-blocks", "64", "--quantization", "none")
    assert code == 0 and "Paris" in out and shared_default_loads == ["none"]


@pytest.mark.parametrize("args,message", [
    (["--max-tokens", "0"], "--max-tokens: expected a whole number from 1 to 2147483647, got 0"),
    (["--temperature", "-1"], "nanovllm: error: argument --temperature: must be a finite number >= 0 (0 means greedy), got '-1'"),
    # trial 14d: nan and inf said only "expected a decimal number in ASCII digits"; they get the range as -1 does
    (["--temperature", "nan"], "nanovllm: error: argument --temperature: must be a finite number >= 0 (0 means greedy), "
                               "written in ASCII digits, got 'nan'"),
    (["--temperature", "inf"], "argument --temperature: must be a finite number >= 0 (0 means greedy), written in "
                               "ASCII digits, got 'inf'"),
    (["--top-p", "nan"], "argument --top-p: must be in (0, 1], written in ASCII digits, got 'nan'"),
    (["--min-p", "inf"], "argument --min-p: must be in [0, 1], written in ASCII digits, got 'inf'"),
    (["--repetition-penalty", "nan"], "argument --repetition-penalty: must be > 0 (1 means off), written in ASCII "
                                      "digits, got 'nan'"),
    (["--seed", "abc"], "--seed: a seed is a 64-bit integer (-9223372036854775808 to 9223372036854775807) in ASCII "
                        "digits, got 'abc'"),
    (["--tp-rendezvous-timeout", "nan"], "--tp-rendezvous-timeout: expected a number of seconds above 0, in ASCII "
                                         "digits, got 'nan'"),
    (["--prompt", ""], "--prompt must not be empty"),  # (only spaces is a prompt, as in vLLM: trial 16)
    (["--prompt", "a", "--priority", "1", "--priority", "2"], "2 --priority values for 1 --prompt"),
    (["--model", "/does/not/exist"], "does not exist"),
    (["--scheduling-policy", "lottery"], "invalid choice"),
    (["--top-p", "0"], "argument --top-p: must be in (0, 1], got '0'"),
    (["--top-k", "-5"], "--top-k: expected a whole number from -1 to 2147483647"),
    (["--min-p", "1.5"], "argument --min-p: must be in [0, 1], got '1.5'"),
    (["--repetition-penalty", "0"], "argument --repetition-penalty: must be > 0 (1 means off), got '0'"),
    (["--logprobs", "50"], "logprobs"),
    (["--stop", ""], "argument --stop: a stop string must not be empty, got ''"),
    (["--seed", "99999999999999999999999"], "--seed: a seed is a 64-bit integer"),
    (["--seed", "-9223372036854775809"], "--seed: a seed is a 64-bit integer"),
    (["--prompt", "abc\udcff\udcfe def"], "--prompt: not valid UTF-8: byte 0xff at character 3"),
    (["--stop", "x\udcff"], "--stop: not valid UTF-8: byte 0xff at character 1"),  # trial 10: could never match
    # issue 29 item 3: absurd integers are one line, with the range, before anything loads
    (["--priority", str(10**30)], "--priority: expected a whole number from -1000 to 1000 (higher runs first), got 1"),
    (["--priority", "1001"], "--priority: expected a whole number from -1000 to 1000"),
    (["--priority", "-1001"], "--priority: expected a whole number from -1000 to 1000"),
    (["--priority", "True"], "--priority: expected a whole number from -1000 to 1000, got 'True'"),
    (["--top-k", str(10**30)], "--top-k: expected a whole number from -1 to 2147483647, got 1"),
    (["--max-tokens", str(10**30)], "--max-tokens: expected a whole number from 1 to 2147483647, got 1"),
    (["--logprobs", str(10**30)], "--logprobs: expected a whole number from 0 to 20, got 1"),
    (["--num-speculative-tokens", str(10**30)], "--num-speculative-tokens: expected a positive integer up to 2147483647"),
    (["--num-kv-blocks", str(10**30)], "--num-kv-blocks: expected a positive integer up to 2147483647, got 100"),
    (["--max-model-len", "64", "--max-tokens", "64"],
     "--max-tokens 64 leaves no room for a prompt in --max-model-len 64"),
    # trial 16d: the tutorial's own options were ignored without --tutorial
    (["--progress-file", "p.json"], "--progress-file applies only with --tutorial; add --tutorial or leave it out"),
    (["--tutorial-chapter", "3", "--no-demos"],
     "--tutorial-chapter and --no-demos apply only with --tutorial; add --tutorial or leave it out"),
    # trial 43d: it did nothing without --narrate, and said nothing (--dashboard does not narrate either)
    (["--narrate-steps", "3"], "--narrate-steps applies only with --narrate; add --narrate or leave it out"),
    (["--dashboard", "--narrate-steps", "0"], "--narrate-steps applies only with --narrate"),
    # trial 12: accepted and ignored under fcfs; vLLM refuses it (the engine's rule, before loading)
    (["--scheduling-policy", "fcfs", "--prompt", "a", "--prompt", "b", "--priority", "0", "--priority", "1"],
     "--priority is 1, but the engine schedules fcfs (arrival order, priorities unused; vLLM refuses a priority "
     "other than 0 there too); use --scheduling-policy priority or --priority 0"),
    # issue 29, trial 12: an empty model name loaded the embedded default without a word
    (["--model", ""], "argument --model: a model name must not be empty, got ''; leave the option out for the "
                      "embedded default model"),
    (["--model", "  "], "argument --model: a model name must not be empty"),
    (["--speculative-model", ""], "argument --speculative-model: a model name must not be empty"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, args, message):
    code, out, err = run_cli(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


# Newcomer trial 8: `--temperature -1` said "SamplingParams.temperature=-1.0 is invalid" (and `1e400` said
# "temperature=inf"), not argparse's "argument --temperature: ..." that --priority and --max-tokens use.
@pytest.mark.parametrize("option,value,rule", [
    ("--temperature", "-1", "must be a finite number >= 0 (0 means greedy)"),
    ("--temperature", "1e400", "must be a finite number >= 0 (0 means greedy)"),
    ("--top-p", "0", "must be in (0, 1]"),
    ("--top-p", "1e400", "must be in (0, 1]"),
    ("--min-p", "-0.5", "must be in [0, 1]"),
    ("--repetition-penalty", "-1e400", "must be > 0 (1 means off)"),
    ("--stop", "", "a stop string must not be empty"),
])
def test_bad_sampling_values_are_argparse_lines_naming_the_option_and_the_text_typed(capsys, option, value, rule):
    from nanovllm_core.speculative import cli as spec_cli
    from nanovllm_tui import options

    parsers = [("nanovllm", cli.build_parser().parse_args), ("nanovllm-tui", options.parse_args)]
    if option in ("--temperature", "--top-p"):  # the speculative command's sampling options
        parsers.append(("nanovllm-spec", spec_cli.build_parser().parse_args))
    for prog, parse in parsers:
        with pytest.raises(SystemExit) as e:
            parse(["--prompt", "hi", f"{option}={value}"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err == f"{prog}: error: argument {option}: {rule}, got {value!r}\n", err


def test_an_invalid_utf8_prompt_from_a_real_process_is_one_line():
    """The bytes a shell passes for ``$(printf 'abc\\xff\\xfe def')``: not UTF-8, refused before loading."""
    proc = subprocess.run([sys.executable.encode(), b"-m", b"nanovllm_core.cli", b"--prompt", b"abc\xff\xfe def"],
                          capture_output=True, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == ["nanovllm: error: argument --prompt: not valid UTF-8: byte 0xff at "
                                        "character 3; pass UTF-8 text (check the terminal's or the file's encoding)"]


def test_bad_speculative_cli_arguments_are_one_line(capsys):
    from nanovllm_core.speculative import cli as spec_cli

    for args, message in ((["--seed", str(2**64)], "64-bit"), (["--prompt", "a\udcff"], "not valid UTF-8"),
                          (["--target-model", ""], "--target-model: a model name must not be empty"),
                          (["--draft-model", ""], "--draft-model: a model name must not be empty")):
        code, _, err = run_main(spec_cli.main, capsys, *args)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.real_model
def test_loading_prints_each_stage_as_serve_does(capsys, cli_on_shared_model, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a person at a terminal waits for the load
    code, out, err = run_cli(capsys, "--max-tokens", "2", "--num-kv-blocks", "64")
    assert code == 0 and err.startswith("nanovllm: loading the embedded default model...\n"), err
    assert "nanovllm: loading weights...\n" in err and err.count("loading weights") == 1  # once a stage
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # a script reads stderr for errors only
    code, out, err = run_cli(capsys, "--max-tokens", "2", "--num-kv-blocks", "64")
    assert code == 0 and "loading" not in err, err


def test_the_loader_reports_its_stages_as_they_begin(tmp_path, monkeypatch):
    import torch

    from nanovllm_core.model import loader
    from tests.conftest import save_tiny_llama

    monkeypatch.setattr(loader, "load_tokenizer", lambda p: None)
    calls = []
    loader.load_model(str(save_tiny_llama(tmp_path)), torch.device("cpu"), torch.float32,
                      progress=lambda stage, done, total: calls.append((stage, done)))
    assert calls[0] == ("loading weights", 0) and ("packing linear layers", 0) in calls


@pytest.mark.parametrize("argv, message", [
    (["--trace", "{tmp}/no/such/x.jsonl"], "--trace {tmp}/no/such/x.jsonl: the folder {tmp}/no/such does not exist; "
                                           "create it first or choose another path"),
    (["--trace-chrome", "{tmp}"], "--trace-chrome {tmp} is a folder; give a file name in it"),
    (["--trace", ""], "--trace needs a file name"),
    (["--trace", "{tmp}/file/x.jsonl"], "--trace {tmp}/file/x.jsonl: {tmp}/file is not a folder; choose another path"),
    (["--trace", "{tmp}/t.json", "--trace-chrome", "{tmp}/t.json"],
     "--trace and --trace-chrome name the same file {tmp}/t.json; give each its own"),
    (["--tutorial", "--no-demos", "--progress-file", "{tmp}"], "--progress-file {tmp} is a folder"),
    (["--tutorial", "--progress-file", "{tmp}/file/p.json"], "--progress-file {tmp}/file/p.json: {tmp}/file is not a folder"),
])
def test_an_output_file_that_cannot_be_written_is_refused_before_the_model_loads(capsys, monkeypatch, tmp_path,
                                                                                 argv, message):
    """Trial 16e: ``--trace /nonexistent/dir/x.jsonl`` was refused only after the model had loaded (52-120 s).
    Every output path is checked while the options are parsed: one line, status 2, nothing loaded."""
    import nanovllm_core.educational.tutorial_demos as demos
    import nanovllm_core.llm

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(nanovllm_core.llm, "LLM", no_load)
    monkeypatch.setattr(demos.EngineDemos, "load", no_load)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        cli.main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("nanovllm: error: " + message.format(tmp=tmp_path)), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the check left no file behind


def test_a_writable_trace_path_is_not_created_by_the_check_when_another_option_fails(capsys, tmp_path):
    """The check creates and removes a new file at once: a run refused later (here: its model) leaves none."""
    trace, chrome = tmp_path / "t.jsonl", tmp_path / "c.json"
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", str(tmp_path / "no-such-model"), "--trace", str(trace), "--trace-chrome", str(chrome)])
    assert e.value.code == 2 and "no-such-model does not exist" in capsys.readouterr().err
    assert not trace.exists() and not chrome.exists()


def test_bad_model_path_from_a_real_process_prints_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "nanovllm_core.cli", "--model", "/no/such/dir"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("nanovllm: error: model path /no/such/dir does not exist; check the path "
                                   "(or omit model (--model) for the embedded default)")


@pytest.mark.real_model
def test_trace_files_record_the_run(capsys, tmp_path, shared_default_loads):
    import json

    from nanovllm_core.tracing import read_jsonl

    jsonl, chrome = tmp_path / "run.jsonl", tmp_path / "run.json"
    code, out, _ = run_cli(capsys, "--prompt", "Hi", "--max-tokens", "3", "--num-kv-blocks", "32",
                           "--trace", str(jsonl), "--trace-chrome", str(chrome))
    assert code == 0 and shared_default_loads == [None]
    events = read_jsonl(jsonl)
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("TokenSampled") == 3 and kinds[1] == "RequestAdded" and kinds[-1] == "StepTimed"
    assert events[0].ready and events[0].info()["num_layers"] == 30  # the model's facts come first, for replays
    assert "LayerTrace" not in kinds
    assert "RequestFinished" in kinds and "BlocksChanged" in kinds
    names = [e["name"] for e in json.loads(chrome.read_text())["traceEvents"]]
    assert "prefill chunk" in names and "finished (length)" in names


@pytest.mark.real_model
def test_trace_xray_adds_layer_traces_to_the_trace(capsys, tmp_path, shared_default_loads):
    from nanovllm_core import events as ev
    from nanovllm_core.tracing import read_jsonl

    jsonl = tmp_path / "run.jsonl"
    code, _, _ = run_cli(capsys, "--prompt", "Hi", "--max-tokens", "2", "--num-kv-blocks", "32",
                         "--trace", str(jsonl), "--trace-xray")
    assert code == 0 and shared_default_loads == [None]
    traces = [e for e in read_jsonl(jsonl) if isinstance(e, ev.LayerTrace)]
    assert len(traces) == 2 * 30  # every layer of both steps


def test_ctrl_c_inside_a_step_says_once_where_the_trace_ends(capsys, tmp_path, tiny_llama_dir, monkeypatch):
    """Ctrl-C inside a step: the trace closes with that step unfinished (its StepPlanned and layer
    traces, no StepTimed); the command says so in one line, and the file replays up to it."""
    from nanovllm_core.engine.llm_engine import LLMEngine
    from nanovllm_tui.replay import load_trace

    sample, calls = LLMEngine._sample, []

    def ctrl_c_in_step_2(self, result):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return sample(self, result)

    monkeypatch.setattr(LLMEngine, "_sample", ctrl_c_in_step_2)
    jsonl = tmp_path / "run.jsonl"
    code, _, err = run_cli(capsys, "--model", str(tiny_llama_dir), "--prompt", "Hi", "--max-tokens", "8",
                           "--num-kv-blocks", "32", "--trace", str(jsonl), "--trace-xray")
    assert code == 130
    assert err.strip().splitlines()[-2:] == [
        "interrupted", f"nanovllm: the trace {jsonl} ends during step 2, which was still running when the recording "
                       "closed: --replay plays the steps before it"]
    trace = load_trace(jsonl)
    assert trace.cut_step == 2 and [e.finish_reason for e in trace if e.kind == "RequestFinished"] == ["abort"]


def test_a_trace_that_cannot_be_finished_ends_the_command_with_one_line(capsys, tmp_path, tiny_llama_dir,
                                                                        monkeypatch):
    from pathlib import Path

    chrome, write_text = tmp_path / "run.json", Path.write_text

    def full_disk(self, *args, **kwargs):  # the Chrome trace is written when it closes: the disk is full by then
        if self == chrome:
            raise OSError(28, "No space left on device")
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    code, out, err = run_cli(capsys, "--model", str(tiny_llama_dir), "--prompt", "Hi", "--max-tokens", "2",
                             "--num-kv-blocks", "32", "--trace-chrome", str(chrome))
    assert code == 1 and "Completion" in out  # what was generated is still shown
    assert err.strip().splitlines()[-1] == (f"nanovllm: the trace {chrome} could not be written: "
                                            "[Errno 28] No space left on device")


def test_trace_xray_without_trace_is_one_line(capsys):
    code, _, err = run_cli(capsys, "--trace-xray", "--num-kv-blocks", "8")
    assert code == 2 and "add --trace FILE.jsonl" in err and len(err.strip().splitlines()) == 1


def test_trace_to_unwritable_path_is_one_line(capsys, shared_default_loads):
    code, _, err = run_cli(capsys, "--trace", "/no/such/dir/run.jsonl", "--num-kv-blocks", "8")
    assert code == 2 and "--trace /no/such/dir/run.jsonl: the folder /no/such/dir does not exist" in err
    assert len(err.strip().splitlines()) == 1
    assert shared_default_loads == []  # refused before the model loads (trial 16e: it was after, 52-120 s)


def test_sampling_flags_map_to_sampling_params():
    args = cli.build_parser().parse_args([
        "--temperature", "0.7", "--top-k", "40", "--top-p", "0.9", "--min-p", "0.05", "--repetition-penalty", "1.2",
        "--seed", "3", "--stop", "\n\n", "--stop", "END", "--logprobs", "4", "--max-tokens", "7", "--ignore-eos",
    ])
    assert cli.sampling_params(args) == SamplingParams(
        temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=3, stop=["\n\n", "END"],
        logprobs=4, max_tokens=7, ignore_eos=True)


@pytest.fixture
def cli_on_shared_model(monkeypatch, make_engine):
    """``cli.main`` with its ``LLM`` built over the session's already-loaded real model."""
    from nanovllm_core import llm as llm_module

    def build(progress=None, **kw):
        if progress is not None:  # the stages a real load reports, so the command's lines show
            progress("loading weights", 0, 1)
            progress("loading weights", 1, 1)
        return LLM.from_engine(make_engine(**kw))

    monkeypatch.setattr(llm_module, "LLM", build)


@pytest.mark.real_model
def test_max_tokens_beyond_the_context_is_refused_as_the_server_does(capsys, cli_on_shared_model):
    # "The capital of France is" is 5 tokens: 5 + 60 > 64, which the server refuses with its check_length error
    code, out, err = run_cli(capsys, "--max-model-len", "64", "--max-tokens", "60", "--num-kv-blocks", "64")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["nanovllm: error: --max-tokens 60 does not fit: the prompt has 5 tokens and "
                                        "the context (max_model_len) is 64, so at most 59 can follow; lower "
                                        "--max-tokens or raise --max-model-len"]
    code, out, err = run_cli(capsys, "--max-model-len", "64", "--max-tokens", "59", "--num-kv-blocks", "64")
    assert code == 0, err  # exactly filling the context is allowed, as on the server
    assert "[59 tokens, finish_reason=length" in out or "finish_reason=stop" in out


@pytest.mark.real_model
def test_stop_strings_and_logprobs_from_the_command_line(capsys, cli_on_shared_model):
    code, out, err = run_cli(capsys, "--stop", "zzz", "--stop", "answer is", "--logprobs", "2", "--max-tokens", "12",
                             "--num-kv-blocks", "64")
    assert code == 0, err
    assert "Completion: ' Paris.\\n\\nThe '" in out
    assert "7 tokens, finish_reason=stop, stop_reason='answer is'" in out
    logprob_lines = [line for line in out.splitlines() if line.startswith("    '")]
    assert len(logprob_lines) == 7 and logprob_lines[0].startswith("    ' Paris': ' Paris' -0.")


@pytest.mark.real_model
def test_the_same_seed_gives_the_same_sampled_completion(capsys, cli_on_shared_model):
    flags = ["--temperature", "1.0", "--top-k", "50", "--top-p", "0.95", "--min-p", "0.01",
             "--repetition-penalty", "1.1", "--max-tokens", "5", "--num-kv-blocks", "64"]
    runs = [run_cli(capsys, *flags, "--seed", "5") for _ in range(2)]  # unseeded runs would differ
    completions = [next(line for line in out.splitlines() if line.startswith("Completion:")) for _, out, _ in runs]
    assert all(code == 0 for code, _, _ in runs)
    assert completions[0] == completions[1]


@pytest.mark.real_model
def test_speculative_flags_reach_the_engine(capsys, shared_default_loads):
    code, out, err = run_cli(capsys, "--prompt", "one two three one two three one two", "--max-tokens", "6",
                             "--num-kv-blocks", "64", "--speculative-model", "ngram", "--num-speculative-tokens", "3",
                             "--show-memory-stats")
    assert code == 0 and shared_default_loads == [None], err
    assert "speculative (ngram, k=3):" in out and "draft tokens accepted" in out
    # trial 39a: without --show-memory-stats a run with drafts said nothing of them
    code, out, err = run_cli(capsys, "--prompt", "one two three one two three one two", "--max-tokens", "6",
                             "--num-kv-blocks", "64", "--speculative-model", "ngram", "--num-speculative-tokens", "3")
    assert code == 0 and "KV cache memory" not in out, err
    assert any(line.startswith("speculative (ngram, k=3): ") and "draft tokens accepted" in line
               for line in out.splitlines()), out


def test_bad_speculative_setting_is_one_line(capsys, shared_default_loads):
    code, _, err = run_cli(capsys, "--speculative-model", "self:999", "--num-kv-blocks", "8")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "self:" in err
    assert shared_default_loads == [None]  # refused once the model is known, as without the shared load


def test_a_run_whose_every_prompt_is_rejected_exits_1_and_says_why(capsys, shared_default_loads):
    long_prompt = "word " * 400
    code, out, err = run_cli(capsys, "--prompt", long_prompt, "--max-model-len", "64", "--max-tokens", "2",
                             "--num-kv-blocks", "16")
    assert code == 1
    assert "rejected: the prompt has" in out and "max_model_len is 64" in out
    assert "... (2,000 characters)" in out  # a long prompt is not printed back whole
    assert err.strip() == "nanovllm: every prompt was rejected (reasons above)"
    code, out, _ = run_cli(capsys, "--prompt", long_prompt, "--prompt", "Hi", "--max-model-len", "64",
                           "--max-tokens", "2", "--num-kv-blocks", "16")
    assert code == 0 and "rejected:" in out and "Completion:" in out
    assert shared_default_loads == [None, None]  # each run's LLM asked for the default model


@pytest.mark.real_model
def test_one_token_is_one_token_not_1_tokens(capsys, cli_on_shared_model):
    code, out, err = run_cli(capsys, "--max-tokens", "1", "--num-kv-blocks", "64")
    assert code == 0, err
    assert "[1 token, finish_reason=length" in out and " 1 token in " in out
    assert not re.search(r"(?<![\d.])1 tokens", out)  # "1 tokens", but not a rate such as "(3.1 tokens/s)"



@pytest.mark.real_model
def test_the_summary_names_float_weights_and_their_bytes_as_it_does_block_ones(capsys, cli_on_shared_model):
    """Trial 14: README says `--quantization none` runs 538 MB of float32 weights, but the summary line
    named the weights' format and bytes only for block modes."""
    code, out, err = run_cli(capsys, "--max-tokens", "1", "--num-kv-blocks", "64")
    assert code == 0, err
    assert re.search(r"on cpu, float32, float weights \(float32 5\d\d MB of weights\), model ", out), out


@pytest.mark.real_model
def test_the_summary_and_the_dashboard_each_say_what_their_time_includes(capsys, cli_on_shared_model):
    """Trial 7: the dashboard said "Overall 1.4 tok/s (1.43 s)" and the summary "2 tokens in 1.49 s
    (1.3 tokens/s)", two timings of one run with no word of why they differ. Each says what it counts."""
    code, out, err = run_cli(capsys, "--max-tokens", "2", "--num-kv-blocks", "64", "--dashboard")
    assert code == 0, err
    steps = re.search(r"Overall\s+[\d.,]+ tok/s over ([\d.]+) s[^\n]*\n[^\n]*\(engine steps only\)", out)
    wall = re.search(r"2 tokens in ([\d.]+) s of wall time \([\d.]+ tokens/s, tokenizing, detokenizing and the "
                     r"teaching views' output included\)", out)
    assert steps and wall, out
    assert float(steps.group(1)) <= float(wall.group(1))  # the steps lie inside the wall time


@pytest.mark.real_model
def test_two_prompts_written_to_a_file_leave_no_line_of_spaces(capsys, cli_on_shared_model):
    """Issue 29: the progress bar's last redraw left a line of spaces in captured output."""
    code, out, err = run_cli(capsys, "--prompt", "Hi", "--prompt", "Hello", "--max-tokens", "2", "--num-kv-blocks", "64")
    assert code == 0, err
    assert not [line for line in (out + err).replace("\r", "\n").splitlines() if line and not line.strip()]


@pytest.mark.parametrize("option,value", [
    ("--max-tokens", "０８"), ("--max-tokens", "1_0"), ("--priority", "٣"), ("--temperature", "1_0"),
    ("--temperature", "０.５"), ("--temperature", "inf"), ("--top-p", "nan"), ("--seed", "٥"),
    ("--num-kv-blocks", "1_000"),
])
def test_numbers_on_the_command_line_are_ascii_digits_in_both_commands(capsys, option, value):
    """int() and float() take '٥', '０８' and '1_0': both commands accepted them at start while the
    app's prompt bar, whose rule docs/app.md says they share, refused them (issue 29, trial 6)."""
    from nanovllm_core.speculative import cli as spec_cli
    from nanovllm_tui import options

    for parse in (cli.build_parser().parse_args, options.parse_args):
        with pytest.raises(SystemExit) as e:
            parse(["--prompt", "hi", option, value])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert value in err and len(err.strip().splitlines()) == 1, err
    if option in ("--temperature", "--seed", "--top-p"):
        with pytest.raises(SystemExit):
            spec_cli.build_parser().parse_args(["--prompt", "hi", option, value])
        assert value in capsys.readouterr().err
    assert cli.build_parser().parse_args(["--prompt", "hi", option, " 8 " if option != "--top-p" else "0.5"])


def test_the_app_refuses_a_priority_under_fcfs_at_start_as_nanovllm_does(capsys):
    """Trial 12: `nanovllm-tui --scheduling-policy fcfs --priority 1` was accepted and the priority ignored."""
    from nanovllm_tui import options

    with pytest.raises(SystemExit) as e:
        options.parse_args(["--scheduling-policy", "fcfs", "--prompt", "hi", "--priority", "-4"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert "--priority is -4, but the engine schedules fcfs" in err and err.endswith("--priority 0")
    assert options.parse_args(["--scheduling-policy", "fcfs", "--prompt", "hi", "--priority", "0"])
    assert options.parse_args(["--prompt", "hi", "--priority", "-4"])


@pytest.mark.real_model
def test_chat_narration_tells_the_users_message_through_the_template_not_token_ids(capsys, cli_on_shared_model):
    """Trial 24d #2: ``--chat --narrate`` said 'The prompt (given as token ids)' of the text the user typed."""
    code, out, err = run_cli(capsys, "--chat", "--prompt", "Hi", "--max-tokens", "1", "--narrate",
                             "--num-kv-blocks", "64")
    assert code == 0, err
    assert "The user's message 'Hi', put through the model's chat template, becomes" in " ".join(out.split())
    assert "given as token ids" not in out


def test_a_pool_that_could_never_hold_a_prompt_is_one_line_and_status_2(capsys, shared_default_loads):
    """Trial 36e: `nanovllm --num-kv-blocks 1 --max-tokens 13` printed the prompt, its rejection, a summary and
    a last line, and ended with status 1, where nanovllm-tui ends the same options with one line and status 2
    (README: bad arguments end with status 2 and one line)."""
    code, out, err = run_cli(capsys, "--prompt", "The capital of France is", "--num-kv-blocks", "1",
                             "--max-tokens", "13")
    assert code == 2 and not out.strip() and len(err.strip().splitlines()) == 1, (out, err)
    assert "--prompt was refused: the request may need 2 KV blocks" in err and "raise --num-kv-blocks" in err
    code, out, _ = run_cli(capsys, "--prompt", "The capital of France is", "--num-kv-blocks", "1",
                           "--max-tokens", "12")
    assert code == 0 and "Completion:" in out  # 5 + 12 tokens store 16 K/V: the one block holds them


def test_the_narrators_cap_is_ten_unless_narrate_steps_says_otherwise():
    """Trial 43d: ``--narrate-steps`` now has no default of its own (given alone it is refused); the cap it
    sets is 10 when it is left out, in ``nanovllm --narrate`` and the app alike, and 0 means every token."""
    from nanovllm_core.cli import narrate_steps
    from nanovllm_tui.options import parse_args

    assert (narrate_steps(None), narrate_steps(0), narrate_steps(3)) == (10, None, 3)
    assert parse_args([]).narrate_steps is None and parse_args(["--narrate-steps", "4"]).narrate_steps == 4
    from nanovllm_tui.options import build_app
    from tests.tui_helpers import TRACE

    assert build_app(["--replay", str(TRACE)]).narrator.max_decode == 10  # the app's narrator, as before
    assert build_app(["--replay", str(TRACE), "--narrate-steps", "0"]).narrator.max_decode is None

