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
    (["--prompt", "  "], "--prompt must not be empty"),
    (["--temperature", "-1"], "temperature"),
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
