"""An engine that stops for good (a tensor-parallel rank died): what the commands and the library say.

- ``nanovllm`` (plain and with a teaching view) and the speculative command print the reason once, on
  stderr, in one line, and end with status 1 (report 16d #1);
- after the death, ``LLM.generate`` and ``LLM.chat`` raise ``EngineDeadError`` with the reason (#7);
- at N = 3, a rank killed inside a step is the rank the error names, without gloo's raw text (#6);
- a script without the ``__main__`` guard ends in one line naming the guard (#8).

The command and library checks run on one process with the failure injected as the engine sees it
(``TensorParallelError`` from a step); the N = 3 and guard checks start real worker processes.
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


@pytest.fixture(scope="module")
def tiny_n3_dir(tmp_path_factory, default_model_dir):
    """A tiny random LLaMA whose heads split three ways (6 query heads, 3 KV heads)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-n3"), default_model_dir, hidden_size=96,
                           intermediate_size=192, num_attention_heads=6, num_key_value_heads=3)


def test_a_rank_killed_inside_a_collective_is_the_rank_named(tiny_n3_dir):
    """Rank 2 dies once the step's plan is sent: ranks 0 and 1 are left in its all-reduce, and gloo tells
    both that a peer went away. The error names rank 2 (not rank 1, the first to complain), in plain words."""
    llm = LLM(str(tiny_n3_dir), device="cpu", num_kv_blocks=32, tensor_parallel_size=3, **QUIET)
    try:
        workers = llm.engine.runner.workers
        victim = workers.procs[2].pid
        send = workers.begin_step
        steps = []

        def send_then_kill(entries, rows):
            send(entries, rows)
            steps.append(1)
            if len(steps) == 2:
                os.kill(victim, signal.SIGKILL)

        workers.begin_step = send_then_kill
        outs = llm.generate(["Hello there", "one two three"], SamplingParams(temperature=0, max_tokens=20,
                                                                              ignore_eos=True), use_tqdm=False)
        assert {o.outputs[0].finish_reason for o in outs} == {"error"}
        error = llm.engine.fatal_error
        assert error.startswith(f"tensor-parallel worker rank 2 (pid {victim}) was killed by SIGKILL"), error
        assert "\n" not in error and "GLHF" not in error and ".cc:" not in error
        with pytest.raises(EngineDeadError, match="rank 2"):
            llm.generate(["again"], use_tqdm=False)
    finally:
        llm.close()


def test_a_script_without_the_main_guard_is_told_so_in_one_line(tmp_path, tiny_llama_dir):
    script = tmp_path / "noguard.py"
    script.write_text(textwrap.dedent(f"""
        from nanovllm_core import LLM
        llm = LLM({str(tiny_llama_dir)!r}, device="cpu", num_kv_blocks=16, tensor_parallel_size=2,
                  progress=lambda *a: None)
        print("generated", llm.generate("hi"))
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "freeze_support" not in proc.stderr
    worker_line = [line for line in proc.stderr.splitlines() if line.startswith("nanovllm tensor-parallel worker")]
    assert len(worker_line) == 1 and 'under `if __name__ == "__main__":`' in worker_line[0], proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("nanovllm_core.engine.tp_launch.TensorParallelError: tensor-parallel worker rank 1 (pid ")
    assert "no `if __name__ == \"__main__\":` guard" in last, last


def test_a_remote_worker_whose_rank_0_dies_inside_a_step_says_rank_0_went_away(tmp_path, tiny_llama_dir):
    """Rank 0 (a script) is killed right after sending a step: the worker, left in the step's all-reduce,
    ends with status 1 and one line saying that rank 0 went away, not gloo's text."""
    from nanovllm_core.engine.tp_launch import free_port
    from tests.test_tensor_parallel_launch import finish, start_worker

    port = free_port()
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal
        from nanovllm_core import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({str(tiny_llama_dir)!r}, device="cpu", num_kv_blocks=16, tensor_parallel_size=2,
                      tp_master_port={port}, tp_local_ranks=1, progress=lambda *a: None)
            workers, steps = llm.engine.runner.workers, []
            send = workers.begin_step
            def send_then_die(entries, rows):
                send(entries, rows)
                steps.append(1)
                if len(steps) == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
            workers.begin_step = send_then_die
            llm.generate("hi", SamplingParams(max_tokens=10, ignore_eos=True))
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    worker = start_worker(port)
    rank0 = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        rank0.communicate(timeout=180)
        assert rank0.returncode == -signal.SIGKILL
        code, err = finish(worker, timeout=30)
    finally:
        for p in (worker, rank0):
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert last == (f"nanovllm worker: rank 1: rank 0 at 127.0.0.1:{port} went away during a step (its connection "
                    "closed); this worker stopped: start rank 0 again, then this worker"), err


def test_serve_logs_a_dead_engine_once(tiny_llama_dir, capsys):
    """``nanovllm serve``'s engine stops for good while serving: its log says why once, in one line."""
    from nanovllm_core.entrypoints import cli as serve_cli

    parser = serve_cli.build_parser()
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--device", "cpu", "--num-kv-blocks", "16"])
    controller = serve_cli.load(args, parser)
    try:
        dies_at_step(controller.engine, step=1)
        ids = [controller.submit(p, SamplingParams(max_tokens=4)) for p in ("hi", "there")]
        outs = [controller.wait(i, timeout=30) for i in ids]
        assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
        assert controller.engine_died == f"{DEATH}, restart it"
    finally:
        controller.shutdown(timeout=5)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if DEATH in line]
    assert lines == [f"nanovllm serve: error: {DEATH}, restart it; requests in flight ended with it, new ones get 503 "
                     "engine_dead; restart nanovllm serve"], err
