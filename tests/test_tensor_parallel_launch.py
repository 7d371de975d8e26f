"""Tensor parallelism across hosts (``nanovllm worker``, ``--tp-master-addr/--tp-master-port/--tp-local-ranks``).

One machine plays two hosts: rank 0 is this test process (through ``LLM`` or the ``nanovllm``
command's main) with ``tp_local_ranks=1`` (it starts no worker), and rank 1 is a separate
``python -m nanovllm_core.cli worker`` process, both on 127.0.0.1 with a free port and the
tiny random LLaMA. What is claimed (``engine/tp_launch.py``, ``engine/tensor_parallel.py``) and tested here:

- greedy tokens and log-probabilities equal the all-local N = 2 run's, bit for bit (the same
  shards and the same collectives: only the launch differs);
- the worker may start before rank 0 listens (it retries until its rendezvous timeout);
- closing rank 0 stops the remote worker (exit 0, one line), destroys the group and frees the port;
- a remote worker killed between steps ends the engine within seconds with one line naming
  its rank, PID and host, every block freed;
- bad input is one line naming what to fix, within a bounded time: a worker's rank or size that
  cannot be right, missing options, rank 0 unreachable, a rank that never joins, a worker with
  another world size or another model (both ends say it), a port rank 0 cannot listen on,
  and launch settings that contradict each other.

One extra process at a time, one torch thread each; every wait is bounded.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nanovllm_core import LLM, SamplingParams
from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.tensor_parallel import TensorParallelError
from nanovllm_core.engine.tp_launch import WorkerOptions, free_port, join_rank0
from tests.test_tensor_parallel import assert_no_group_left, kill_worker_and_check_the_engine_ends

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello there my friend, how", "The capital of France is", "one two three four five six seven eight nine"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
QUIET = dict(progress=lambda *a: None)
JOIN_BOUND_S = 90  # a worker process imports torch and loads its shard: ~15 s on a busy 2-core EPYC


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch):
    monkeypatch.setenv("NANOVLLM_TP_TIMEOUT_S", "3")


def rank0_refusal(tiny_llama_dir: Path, port: int, other) -> TensorParallelError:
    """Rank 0 through ``LLM``, waiting for rank 1 from elsewhere at ``port``, while ``other()`` runs in a
    thread (the other end): the one-line error rank 0 ends with, within 30 s."""
    t = threading.Thread(target=other, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError) as e:
        LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=16, tensor_parallel_size=2, tp_master_port=port,
            tp_local_ranks=1, tp_rendezvous_timeout=30, **QUIET)
    t.join(10)
    assert time.monotonic() - t0 < 30
    return e.value


def start_worker(port: int, *extra: str, rank: int = 1, size: int = 2) -> subprocess.Popen:
    """``nanovllm worker`` as another host would run it (one torch thread; stderr captured)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    return subprocess.Popen([sys.executable, "-m", "nanovllm_core.cli", "worker", "--master-addr", "127.0.0.1",
                             "--master-port", str(port), "--rank", str(rank), "--tensor-parallel-size", str(size),
                             "--threads", "1", "--rendezvous-timeout", str(JOIN_BOUND_S), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 20) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the worker did not exit within {timeout} s: {err[-2000:]}")
    return proc.returncode, err


@pytest.fixture(scope="module")
def all_local(tiny_llama_dir):
    """PROMPTS' greedy outputs at N = 2 with both ranks on this host (rank 0 starts rank 1 itself)."""
    with LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64, tensor_parallel_size=2, **QUIET) as llm:
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_no_group_left()
    return out


def test_a_remote_worker_gives_the_all_local_output_and_its_death_ends_the_engine(tiny_llama_dir, all_local):
    """Rank 0 through ``LLM`` (no local worker), rank 1 through ``nanovllm worker``, started first: the all-local
    tokens and log-probabilities, bit for bit; then the worker is killed between steps."""
    port = free_port()
    worker = start_worker(port)
    try:
        t0 = time.monotonic()
        llm = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64, tensor_parallel_size=2, tp_master_port=port,
                  tp_local_ranks=1, tp_rendezvous_timeout=JOIN_BOUND_S, **QUIET)
        assert time.monotonic() - t0 < JOIN_BOUND_S
        engine = llm.engine
        info = engine.model_info()
        assert info["tensor_parallel_pids"] == (os.getpid(), worker.pid)
        assert engine.runner.workers.procs == {}  # rank 0 started no process
        assert engine.runner.workers.where[1] == f"pid {worker.pid} on {socket.gethostname()} (127.0.0.1)"
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for a, b in zip(got, all_local):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert [{t: lp.logprob for t, lp in d.items()} for d in a.outputs[0].logprobs] == \
                   [{t: lp.logprob for t, lp in d.items()} for d in b.outputs[0].logprobs]
        assert engine.block_manager.num_used_blocks == 0
        # The remote worker dies between steps: the engine ends within seconds, one line naming it.
        kill_worker_and_check_the_engine_ends(
            llm, "between steps", worker.pid, port=port,
            names=f"tensor-parallel worker rank 1 (pid {worker.pid} on {socket.gethostname()} (127.0.0.1))")
    finally:
        worker.kill()
        worker.communicate()


def test_rank_0_from_the_cli_with_a_remote_worker_prints_the_all_local_text_and_stops_it(all_local, tiny_llama_dir,
                                                                                        capsys):
    """``nanovllm --tensor-parallel-size 2 --tp-local-ranks 1 --tp-master-port P``: the all-local completion; on
    exit the worker is told to stop, says so in one line and exits 0; the port is free again. This worker reads
    its own copy of the model (``--model``: the same folder here), checked against rank 0's config."""
    from nanovllm_core import cli
    from tests.conftest import run_main

    port = free_port()
    worker = start_worker(port, "--model", str(tiny_llama_dir))
    try:
        code, out, err = run_main(cli.main, capsys, "--model", str(tiny_llama_dir), "--device", "cpu",
                                  "--tensor-parallel-size", "2", "--tp-local-ranks", "1", "--tp-master-addr",
                                  "127.0.0.1", "--tp-master-port", str(port), "--tp-rendezvous-timeout",
                                  str(JOIN_BOUND_S), "--prompt", PROMPTS[1], "--max-tokens", "6", "--temperature",
                                  "0", "--ignore-eos", "--num-kv-blocks", "64")
        assert code == 0, err[-2000:]
        assert f"Completion: {all_local[1].outputs[0].text!r}" in out
        assert "tensor parallel over 2 ranks (gloo)" in out
        t0 = time.monotonic()
        status, werr = finish(worker)
        assert time.monotonic() - t0 < 15
        assert status == 0, werr[-2000:]
        assert werr.strip().splitlines()[-1] == "nanovllm worker: rank 1: rank 0 stopped the engine"
        assert_no_group_left(port)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()


# ----------------------------------------------------------------------------- bad input


def worker_cli(capsys, *args: str) -> tuple[int, str]:
    from nanovllm_core import cli
    from tests.conftest import run_main

    code, _out, err = run_main(cli.main, capsys, "worker", *args)
    return code, err


@pytest.mark.parametrize("args, env, message", [
    (["--rank", "0"], {}, "--rank 0 is the engine itself"),
    (["--rank", "2"], {}, "--rank 2 is outside 1 to 1 (--tensor-parallel-size 2)"),
    (["--tensor-parallel-size", "1"], {}, "--tensor-parallel-size 1: a worker joins a group of 2 or more ranks"),
    ([], {"RANK": "5", "WORLD_SIZE": "4"}, "--rank 5 is outside 1 to 3 (--tensor-parallel-size 4)"),  # torchrun's env
    (["--master-port", "70000"], {}, "a TCP port is 1 to 65535, got 70000"),
])
def test_a_worker_with_a_rank_or_size_that_cannot_be_right_stops_before_connecting(capsys, monkeypatch, args, env,
                                                                                    message):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    base = {"--master-addr": "127.0.0.1", "--master-port": "9", "--rank": "1", "--tensor-parallel-size": "2"}
    for flag in list(base):
        if flag in args or (flag == "--rank" and "RANK" in env) or (flag == "--tensor-parallel-size" and "WORLD_SIZE" in env):
            base.pop(flag)
    argv = [x for kv in base.items() for x in kv] + args
    code, err = worker_cli(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_worker_without_a_master_says_which_option_or_variable_to_give(capsys, monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    code, err = worker_cli(capsys, "--rank", "1", "--tensor-parallel-size", "2")
    assert code == 2 and "--master-addr is required (or set MASTER_ADDR)" in err, err
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    code, err = worker_cli(capsys, "--rank", "1", "--tensor-parallel-size", "2")
    assert code == 2 and "--master-port is required (or set MASTER_PORT)" in err, err


def test_an_unreachable_rank_0_is_one_line_after_the_rendezvous_timeout(capsys):
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    code, err = worker_cli(capsys, "--master-addr", "127.0.0.1", "--master-port", str(port), "--rank", "1",
                           "--tensor-parallel-size", "2", "--rendezvous-timeout", "1")
    assert 1 <= time.monotonic() - t0 < 10
    assert code == 2 and len(err.strip().splitlines()) == 2, err  # the "joining" line, then the error
    assert f"could not reach rank 0 at 127.0.0.1:{port} within 1 s (Connection refused)" in err, err
    code, err = worker_cli(capsys, "--master-addr", "no-such-host.invalid", "--master-port", str(port), "--rank", "1",
                           "--tensor-parallel-size", "2", "--rendezvous-timeout", "1")
    assert code == 2 and "--master-addr 'no-such-host.invalid' does not resolve" in err, err


def test_a_rank_that_never_joins_ends_rank_0_with_the_command_to_start_it(tiny_llama_dir):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError) as e:
        LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=16, tensor_parallel_size=2, tp_master_port=port,
            tp_local_ranks=1, tp_rendezvous_timeout=1, **QUIET)
    assert time.monotonic() - t0 < 30
    assert str(e.value) == (f"tensor-parallel rank 1 did not join rank 0 at 127.0.0.1:{port} within 1 s; on each "
                            f"one's host run `nanovllm worker --master-addr 127.0.0.1 --master-port {port} --rank R "
                            "--tensor-parallel-size 2` (R = 1), or raise tp_rendezvous_timeout (--tp-rendezvous-timeout)")
    assert_no_group_left(port)


@pytest.mark.parametrize("case", ["world size", "model"])
def test_a_worker_with_another_world_size_or_model_is_refused_at_both_ends(tiny_llama_dir, tmp_path, case):
    """Rank 0 (this thread) and a worker's join (another thread, before any shard would load): each side gets the
    same one line naming what to fix, within seconds of the hello."""
    from tests.conftest import save_tiny_llama

    port = free_port()
    if case == "model":
        other = save_tiny_llama(tmp_path / "other", None, vocab_size=1000, hidden_size=32)
        opts = WorkerOptions(1, 2, "127.0.0.1", port, model=str(other), rendezvous_timeout_s=30)
        expect = "has another model than rank 0 (vocab_size 1000 vs 49152; hidden_size 32 vs 64"
    else:
        opts = WorkerOptions(1, 3, "127.0.0.1", port, rendezvous_timeout_s=30)
        expect = "was started with --tensor-parallel-size 3 but rank 0 runs 2; start it with --tensor-parallel-size 2"
    seen: list[BaseException] = []

    def join():
        try:
            join_rank0(opts)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            seen.append(e)

    err = rank0_refusal(tiny_llama_dir, port, join)
    assert expect in str(err) and "\n" not in str(err), str(err)
    assert len(seen) == 1 and isinstance(seen[0], TensorParallelError) and str(seen[0]) == str(err)
    assert_no_group_left(port)


def test_a_stranger_is_dropped_and_a_worker_with_another_key_is_refused(tiny_llama_dir):
    """Rank 0 admits nothing before the key check: a client that speaks another protocol is dropped (the
    rendezvous goes on), one that answers the challenge with another key ends rank 0 with one line."""
    from multiprocessing.connection import Connection

    from nanovllm_core.engine.tp_launch import _MAGIC

    port = free_port()
    seen: list[bytes] = []

    def clients():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                stranger = socket.create_connection(("127.0.0.1", port), timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")  # read as a 1.2 GB message: refused, dropped
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.settimeout(None)  # a Connection reads its descriptor blocking
        conn = Connection(sock.detach())
        challenge = conn.recv_bytes(256)
        seen.append(challenge)
        conn.send_bytes(_MAGIC + bytes(32) + os.urandom(32))  # a digest made with another key
        try:
            seen.append(conn.recv_bytes(256))
        except (EOFError, OSError):
            seen.append(b"closed")
        stranger.close()
        conn.close()

    err = rank0_refusal(tiny_llama_dir, port, clients)
    assert str(err) == ("a tensor-parallel worker from 127.0.0.1 holds another key; set the same "
                            "NANOVLLM_TP_AUTHKEY on every host; the engine has stopped")
    assert seen[0].startswith(_MAGIC) and seen[1] == b"closed"  # challenged, then shut out unanswered
    assert_no_group_left(port)


def test_a_port_rank_0_cannot_listen_on_is_one_line(tiny_llama_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(TensorParallelError) as e:
            LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=16, tensor_parallel_size=2, tp_master_port=port,
                tp_local_ranks=1, **QUIET)
    assert str(e.value).startswith(f"cannot listen on 127.0.0.1:{port} for the tensor-parallel workers (")
    assert str(e.value).endswith("choose another tp_master_port (--tp-master-port), or an address of this host for "
                                "tp_master_addr (--tp-master-addr)")
    assert_no_group_left()


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=2, tp_local_ranks=3), "tp_local_ranks=3 is invalid: it counts the ranks on rank 0's "
                                                     "host, 1 (rank 0 alone) to tensor_parallel_size (2)"),
    (dict(tensor_parallel_size=2, tp_local_ranks=1), "ranks 1 to 1 join from other hosts (tp_local_ranks=1 of "
                                                     "tensor_parallel_size=2), which must be told where: give "
                                                     "tp_master_port (--tp-master-port PORT)"),
    (dict(tensor_parallel_size=1, tp_master_port=29500), "tp_master_port=29500 places tensor-parallel ranks, but "
                                                         "tensor_parallel_size=1 runs one process"),
    (dict(tensor_parallel_size=2, tp_master_port=70000), "tp_master_port=70000 is invalid: a TCP port is 1 to 65535"),
    (dict(tensor_parallel_size=2, tp_rendezvous_timeout=0), "tp_rendezvous_timeout=0 is invalid"),
    (dict(tensor_parallel_size=2, tp_rendezvous_timeout=float("nan")), "tp_rendezvous_timeout=nan is invalid"),
    # tensor_parallel_size=1 refuses every launch option, the timeout too (trial 21c bug 4: it was accepted)
    *[(dict(tensor_parallel_size=1, tp_rendezvous_timeout=t), f"tp_rendezvous_timeout={t!r} places tensor-parallel "
       "ranks, but tensor_parallel_size=1 runs one process; drop it or raise tensor_parallel_size")
      for t in (-1, "x", float("nan"), 300)],
    (dict(tensor_parallel_size=1, tp_master_addr=5), "tp_master_addr=5 places tensor-parallel ranks"),
    (dict(tensor_parallel_size=1, tp_local_ranks=2), "tp_local_ranks=2 places tensor-parallel ranks"),
])
def test_launch_settings_that_contradict_each_other_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_rendezvous_timeout_defaults_to_300_s_where_ranks_are_placed():
    assert EngineConfig().tp_rendezvous_timeout is None  # told apart from a given value, which size 1 refuses
    assert EngineConfig(tensor_parallel_size=2).tp_rendezvous_timeout == 300.0
    from nanovllm_core.cli import build_parser, engine_kwargs
    EngineConfig(**engine_kwargs(build_parser().parse_args([])))  # the CLI gives none unless typed


def test_the_launch_options_reach_the_engine_from_every_command_line():
    from nanovllm_core.cli import build_parser, engine_kwargs
    from nanovllm_core.entrypoints.cli import build_parser as serve_parser
    from nanovllm_tui.options import parse_args

    argv = ["--tensor-parallel-size", "2", "--tp-master-addr", "0.0.0.0", "--tp-master-port", "29500",
            "--tp-local-ranks", "1", "--tp-rendezvous-timeout", "60"]
    want = dict(tp_master_addr="0.0.0.0", tp_master_port=29500, tp_local_ranks=1, tp_rendezvous_timeout=60.0)
    for args in (build_parser().parse_args(argv), serve_parser().parse_args(argv), parse_args(argv)):
        kwargs = engine_kwargs(args)
        assert {k: kwargs[k] for k in want} == want
        EngineConfig(**kwargs)  # accepted as a whole
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--tp-rendezvous-timeout", "-1"])
    assert e.value.code == 2
