"""An engine that stops for good (a tensor-parallel rank died): what the commands and the library say.

- ``nanovllm`` (plain and with a teaching view) and the speculative command print the reason once, on
  stderr, in one line, and end with status 1 (report 16d #1);
- after the death, ``LLM.generate`` and ``LLM.chat`` raise ``EngineDeadError`` with the reason (#7);

The command and library checks run on one process with the failure injected as the engine sees it
(``TensorParallelError`` from a step).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nanovllm_core import LLM, EngineDeadError, SamplingParams
from nanovllm_core.engine.tp_launch import TensorParallelError
from tests.conftest import run_main, save_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(progress=lambda *a: None)
DEATH = "tensor-parallel worker rank 2 (pid 4242) was killed by SIGKILL; the engine has stopped"


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch):
    monkeypatch.setenv("NANOVLLM_TP_TIMEOUT_S", "3")


def dies_at_step(engine, step: int = 2) -> None:
    """From step ``step`` on, the engine's step fails as when a worker rank died (rank 0's view of it)."""
    def inject(plan):
        if plan.step >= step:
            raise TensorParallelError(DEATH)

    engine.fault_injector = inject


def test_generate_returns_the_reason_then_a_dead_engine_raises(make_tiny_engine):
    llm = LLM.from_engine(make_tiny_engine(device="cpu", num_kv_blocks=32))
    dies_at_step(llm.engine)
    outs = llm.generate(["Hello there", "The capital of France is"],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    assert all(o.error == f"{DEATH}, restart it" for o in outs)
    assert llm.engine.block_manager.num_used_blocks == 0
    for call in (lambda: llm.generate(["again"], use_tqdm=False),
                 lambda: llm.generate(["again"], use_tqdm=False, reject_bad_prompts=True),
                 lambda: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)):
        with pytest.raises(EngineDeadError) as e:
            call()
        assert str(e.value) == f"{DEATH}, restart it"


@pytest.mark.parametrize("extra", [(), ("--narrate",)])
def test_the_command_says_why_once_and_ends_with_status_1(make_tiny_engine, capsys, monkeypatch, extra):
    from nanovllm_core import cli
    from nanovllm_core import llm as llm_module

    def build(progress=None, **kwargs):
        llm = LLM.from_engine(make_tiny_engine(device="cpu", num_kv_blocks=32))
        dies_at_step(llm.engine)
        return llm

    monkeypatch.setattr(llm_module, "LLM", build)
    code, out, err = run_main(cli.main, capsys, "--prompt", "Hello there", "--prompt", "Python is a",
                              "--max-tokens", "8", "--ignore-eos", *extra)
    assert code == 1, err
    lines = [line for line in err.splitlines() if "restart it" in line]
    assert lines == [f"nanovllm: error: 2 of 2 prompts ended with an error: {DEATH}, restart it"], err
    assert out.count("finish_reason=error") == 2


def test_the_speculative_command_says_why_and_ends_with_status_1(capsys, monkeypatch, tiny_llama_dir):
    from nanovllm_core.speculative import cli as spec_cli

    real = spec_cli.timed_generate

    def failing(llm, *a, **k):
        if llm.engine.speculator is not None:
            dies_at_step(llm.engine)
        return real(llm, *a, **k)

    monkeypatch.setattr(spec_cli, "timed_generate", failing)
    code, out, err = run_main(spec_cli.main, capsys, "--target-model", str(tiny_llama_dir), "--draft-model",
                              "ngram", "--max-tokens", "6", "--ignore-eos", "--device", "cpu")
    assert code == 1, err
    assert err.strip().splitlines()[-1] == (f"nanovllm-spec: error: 1 of 1 prompt ended with an error: {DEATH}, "
                                            "restart it (with speculation)")
