"""The speculative-decoding command and benchmark: real figures, and one-line errors with exit status 2."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from nanovllm_core.speculative import cli
from tests.conftest import run_main

REPEATING = "Count: one two three, one two three, one two three, one two"


def run_cli(capsys, *args):
    return run_main(cli.main, capsys, *args)


@pytest.mark.real_model
def test_cli_prints_completion_acceptance_expected_length_and_speedup(capsys):
    code, out, err = run_cli(capsys, "--draft-model", "ngram", "--prompt", REPEATING, "--max-tokens", "8",
                             "--num-speculative-tokens", "3", "--ignore-eos")
    assert code == 0, err
    assert "Completion:" in out and "identical to the run without speculation" in out
    assert "acceptance rate" in out and "expected E = (1 - a^(k+1)) / (1 - a) with k=3" in out
    assert "tokens/s with speculation" in out and "speed-up" in out


@pytest.mark.parametrize("args,message", [
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens: expected a positive integer"),
    (["--draft-model", "self:x"], "'self:N' needs a layer count"),
    (["--prompt", ""], "--prompt must not be empty"),
    (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0 (0 means greedy), got '-1'"),
    (["--target-model", "/no/such/model"], "does not exist"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, args, message):
    code, _, err = run_cli(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


@pytest.mark.real_model
def test_too_many_early_exit_layers_exit_2_with_one_line(capsys):
    code, _, err = run_cli(capsys, "--draft-model", "self:30")
    assert code == 2
    assert err.strip().splitlines() == [
        "nanovllm-spec: error: speculative_model='self:30' is invalid: the target has 30 layers, "
        "so N must be between 1 and 29"]


@pytest.mark.real_model
def test_benchmark_quick_run_reports_speed_and_acceptance(capsys):
    path = Path(__file__).parents[1] / "benchmarks" / "benchmark_speculative.py"
    spec = importlib.util.spec_from_file_location("benchmark_speculative", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    rows = bench.main(["--quick", "--max-tokens", "6"])
    out = capsys.readouterr().out
    assert {r.proposer for r in rows} == {"self:26", "ngram"}
    for r in rows:
        assert r.plain_tokens_per_s > 0 and r.spec_tokens_per_s > 0 and math.isfinite(r.speedup)
        assert 0 <= r.acceptance_rate <= 1 and r.expected_length >= 1
        assert r.identical  # greedy: speculation never changes the tokens
    assert "speed-up" in out and "E(alpha)" in out


@pytest.mark.real_model
def test_a_slower_run_says_why_and_what_pays_off(capsys, monkeypatch):
    """When speculation is slower, the command says so in one line (the README's self:8 ran at 0.22x)."""

    times = iter([10.0, 40.0])  # seconds: without speculation first, then with it (4x slower)

    def fake_run(llm, prompts, params):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return cli.TimedRun(outputs, next(times), sum(len(o.outputs[0].token_ids) for o in outputs),
                            steps=8 if llm.engine.config.speculative_model else 24, stats=llm.stats())

    monkeypatch.setattr(cli, "timed_generate", fake_run)
    code, out, err = run_cli(capsys, "--draft-model", "self:8", "--max-tokens", "3", "--num-speculative-tokens", "2")
    assert code == 0, err
    assert "speed-up 0.25x" in out
    assert ("drafting cost more than it saved here: 16 of 24 target passes saved, but each step also ran 8 of the "
            "model's layers 2 times to draft") in out
    # each run's wall time per step, from the runs themselves: 40 s / 8 steps against 10 s / 24
    assert "a step took 5,000 ms on average against 417 ms without speculation (wall time / steps, 12.0x)" in out
    assert "n-gram lookup ('--draft-model ngram') drafts with no model pass" in out
    assert cli.slower_note("ngram", 4, 10, 12).startswith("drafting cost more than it saved here: 2 of 12 target "
                                                          "passes saved, but each verification ran the model on up to "
                                                          "5 tokens")


def test_a_slower_n_gram_run_gives_its_mean_rows_and_does_not_advise_n_gram():
    """Trial 14e: after an n-gram run at 0.57x the note advised n-gram lookup on repeating text (what had just
    run) and said each verification ran 6 tokens where 54 drafts over 12 verifications is 5.5 on average."""
    stats = {"spec_verifications": 12, "spec_draft_tokens": 54}
    spec = cli.TimedRun([], 8.5, 48, 17, stats)
    plain = cli.TimedRun([], 4.8, 48, 48, {})
    note = cli.slower_note("ngram", 5, 17, 48, spec=spec, plain=plain)
    assert "ran the model on 5.5 tokens on average instead of 1" in note
    assert "a step took 500 ms on average against 100 ms without speculation (wall time / steps, 5.0x)" in note
    assert "'--draft-model ngram'" not in note and "--num-speculative-tokens" in note


def test_a_busy_host_is_named_beside_the_speed_up(monkeypatch):
    import os

    from nanovllm_core import host_load

    monkeypatch.setattr(host_load, "own_threads", lambda: 0)  # the faked load is other work alone

    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 7.0, 6.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert cli.busy_host() == (
        "warning: the host was busy (load average 7.5 on 2 cores at the end): other work shared the CPU, so the "
        "timings and every ratio of them are not this code's alone; run again on a quiet machine; the speed-up is "
        "a wall-clock ratio and follows the load, the step and acceptance counts do not")
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    assert cli.busy_host() is None


def test_quantization_chooses_the_targets_weights_as_nanovllm_does(capsys, monkeypatch):
    """The speculative CLI had no --quantization: its runs always took the file's blocks (auto)."""
    from nanovllm_core.model import loader

    asked = []

    def load(*a, quantization=None, **kw):
        asked.append(quantization)
        raise loader.ModelLoadError("stop here")

    monkeypatch.setattr(loader, "load_model", load)
    code, _, err = run_cli(capsys, "--quantization", "NONE")
    assert code == 2 and asked == ["none"] and "stop here" in err
    code, _, err = run_cli(capsys, "--quantization", "int4")
    assert code == 2 and "--quantization" in err and len(err.strip().splitlines()) == 1
