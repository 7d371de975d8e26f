"""Tensor-parallel workers: ranks 1..N-1 as processes on torch.distributed, driven by rank 0.

Rank 0 is the caller's process: it runs the scheduler, the block manager, the sampler and the
events, and its ``ModelRunner`` holds shard 0 of the weights and of the KV pool. Ranks
1..N-1 are worker processes (``multiprocessing`` spawn context) that each hold their shard
and run the same forward pass on the same plan; the model's all-reduces and the LM head's
gather (``model/parallel.py``) go through ``torch.distributed``: gloo on the CPU, NCCL on
CUDA (rank r on GPU r), initialised over ``tcp://127.0.0.1:<a free port>`` as torchrun's
``env://`` rendezvous would over a network.

**Control path: one pipe per worker, the plan pickled once per step** (as GeeeekExplorer/nano-vllm
pickles its calls; it writes them into shared memory and rings an Event, vLLM broadcasts
them through a shared-memory ring buffer). Why a pipe here: the plan is small (per sequence
its id, start, new token ids and block table: a few hundred bytes a step), so a pipe's copy
costs microseconds against a forward pass of milliseconds; a pipe's other end closing is how a
worker learns that rank 0 is gone (``EOFError``) and how rank 0 sees a worker's last error;
and a worker waiting on its pipe, not inside a collective, may wait forever: the engine can
sit paused or idle for hours, while a gloo collective gives up after its timeout. The tensors
themselves never go through the pipe: only ``torch.distributed`` moves them.

Each step: rank 0 sends ``("step", entries, flat_rows)`` to every worker, runs the same
``ModelRunner.execute``, then reads each worker's reply: its wall seconds for the step and its
collectives' counts, bytes and seconds (:class:`StepTiming`). The reply also proves the worker
alive. Failure: rank 0 checks its workers before each step and waits for replies while
polling their liveness; a collective that a dead peer leaves raises at once (gloo's socket
closes) and one that a hung peer leaves raises after :func:`collective_timeout_s` (30 s). Either way
rank 0 raises :class:`TensorParallelError` (one line naming the rank, its PID and what
happened), stops the other workers, and the engine finishes every request with that error
(every block freed). Shutdown (``LLMEngine.close``, ``LLM.close`` / ``with LLM(...)`` / its
``__del__``, and ``atexit``): each worker is told to stop, joined (terminated if it does not
stop within seconds), and every rank destroys its process group.

Why this file runs past ~400 lines: the two ends of one protocol (the worker's loop and rank
0's ``WorkerGroup``) read best side by side, message for message; split, each half would
name messages the reader cannot see.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import socket
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from nanovllm_core.model.parallel import CommStats, TensorParallel

# A collective waits this long for a peer (a hung worker ends the engine after it); a step of
# a small model takes milliseconds, a long prefill on a busy CPU some seconds. The environment
# variable NANOVLLM_TP_TIMEOUT_S overrides it (tests use a short one).
COLLECTIVE_TIMEOUT_S = 30.0
# Start-up: a worker imports torch and loads its shard (tens of seconds on a busy 2-core host).
START_TIMEOUT_S = 300.0


def collective_timeout_s() -> float:
    """Seconds a collective (and rank 0's wait for a worker's reply) may take: NANOVLLM_TP_TIMEOUT_S or 30."""
    try:
        return max(0.5, float(os.environ.get("NANOVLLM_TP_TIMEOUT_S", COLLECTIVE_TIMEOUT_S)))
    except ValueError:
        return COLLECTIVE_TIMEOUT_S


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died, hung or failed; the engine cannot continue (one-line message)."""


@dataclass(frozen=True)
class StepTiming:
    """One tensor-parallel step, per rank (index = rank).

    ``wall_s``: seconds of ``ModelRunner.execute`` on that rank; ``comm_s``: of them, seconds
    inside collectives (``time.perf_counter`` around each all-reduce and the gather, waiting
    for the slowest rank included); ``compute_s = wall_s - comm_s``. ``all_reduces`` and
    ``all_reduce_bytes``: per rank (the same on every rank: each sends its whole tensor);
    ``gather_bytes``: each rank's logits slice. ``latencies_s``: rank 0's all-reduces, each.
    """

    wall_s: tuple[float, ...]
    comm_s: tuple[float, ...]
    all_reduces: int
    all_reduce_bytes: int
    gathers: int
    gather_bytes: int
    latencies_s: tuple[float, ...]

    @property
    def compute_s(self) -> tuple[float, ...]:
        return tuple(max(0.0, w - c) for w, c in zip(self.wall_s, self.comm_s))


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the OS picks it; several runs side by side get different ones)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device) -> str:
    """``"nccl"`` on CUDA (when this torch has it), else ``"gloo"``.

    Raises:
        ValueError: CUDA without NCCL.
    """
    import torch.distributed as dist

    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise ValueError("tensor parallelism on CUDA needs NCCL, which this torch build lacks; use --device cpu")
        return "nccl"
    return "gloo"


def threads_per_rank(world_size: int) -> int:
    """Torch threads for each rank: the cores shared evenly, at least one (so N ranks use at most the cores when N <= cores)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _init_group(backend: str, port: int, rank: int, world_size: int, timeout_s: float):
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=START_TIMEOUT_S))
    # The collectives' own group, with the short timeout (the default group's long one covers start-up).
    return dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout_s), backend=backend)


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _recv(conn, parent_pid: int):
    """The next message from rank 0, or None once rank 0 is gone (its pipe closed or its process ended)."""
    while True:
        try:
            if conn.poll(1.0):
                return conn.recv()
        except (EOFError, OSError):
            return None
        if os.getppid() != parent_pid:
            return None


def _worker_main(rank: int, world_size: int, port: int, backend: str, device: str, model_path: str, model_config,
                 dtype: str,
                 max_model_len: int | None, threads: int, timeout_s: float, conn, parent_pid: int) -> None:
    """A worker rank's life: load its shard (while rank 0 loads its own), join the group, then run each step
    rank 0 sends until told to stop."""
    code = 0
    try:
        torch.set_num_threads(threads)
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", rank)
            torch.cuda.set_device(dev)
        from nanovllm_core.config import DTYPES
        from nanovllm_core.engine.model_runner import ModelRunner
        from nanovllm_core.model.loader import load_model, warm_up

        tp = TensorParallel(rank, world_size)  # its group once loaded: cutting and reading need none
        model, _tokenizer, _resolved = load_model(model_path, dev, DTYPES[dtype], max_model_len=max_model_len,
                                                  tensor_parallel=tp, model_config=model_config, with_tokenizer=False)
        conn.send(("loaded", None))
        tp.group = _init_group(backend, port, rank, world_size, timeout_s)
        runner = None
        while True:
            msg = _recv(conn, parent_pid)
            if msg is None or msg[0] == "stop":
                break
            kind = msg[0]
            if kind == "runner":
                block_size, num_blocks, attention_backend, max_len = msg[1]
                runner = ModelRunner(model, block_size, num_blocks, True, attention_backend, max_len)
                conn.send(("runner", None))
            elif kind == "warm_up":
                warm_up(model)
                tp.reset_stats()
                conn.send(("warm_up", None))
            elif kind == "step":
                tp.reset_stats()
                t0 = time.perf_counter()
                runner.execute(msg[1], msg[2])
                wall = time.perf_counter() - t0
                conn.send(("step", (wall, tp.reset_stats().as_tuple())))
    except BaseException as e:  # noqa: BLE001 - the reason goes to rank 0, which reports it
        code = 1
        try:
            conn.send(("error", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"))
        except Exception:
            pass
    finally:
        _destroy_group()
        try:
            conn.close()
        except Exception:
            pass
    os._exit(code)  # no interpreter teardown: torch's atexit hooks must not touch a half-destroyed group


@contextlib.contextmanager
def _stderr_with_a_file_descriptor():
    """While processes start: a ``sys.stderr`` with a real file descriptor.

    multiprocessing's resource tracker passes ``sys.stderr.fileno()`` to the process it starts;
    inside a Textual app ``sys.stderr`` is the app's capture, whose ``fileno()`` is -1, and the
    start fails with "bad value(s) in fds_to_keep". The process's own stderr (or /dev/null) stands in.
    """
    saved = sys.stderr
    try:
        ok = saved is not None and saved.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        ok = False
    if ok:
        yield
        return
    devnull = None
    try:
        real = sys.__stderr__
        if real is None or real.fileno() < 0:
            raise OSError
    except (AttributeError, OSError, ValueError):
        real = devnull = open(os.devnull, "w")
    sys.stderr = real
    try:
        yield
    finally:
        sys.stderr = saved
        if devnull is not None:
            devnull.close()


_LIVE: "weakref.WeakSet[WorkerGroup]" = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for group in list(_LIVE):
        group.shutdown()


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1: start them, join the process group, drive their steps, stop them.

    Start-up overlaps: the constructor starts the workers and returns; while they import torch
    and read their shards, rank 0 reads its own (through :attr:`tp`, whose group is not set
    yet); :meth:`wait_loaded` then waits for every worker's shard and joins the group.

    Args:
        world_size: N (>= 2).
        device: the engine's device (rank 0 runs on it; on CUDA worker r runs on GPU r).
        model_path: the resolved model folder every rank loads (rank 0 resolved and converted it).
        model_config: its ``ModelConfig`` (sent along, so a worker need not import transformers).
        dtype: the dtype's name (``"float32"``...).
        max_model_len: the rotary table's length, as rank 0's.

    Raises:
        ValueError: another tensor-parallel engine (or any ``torch.distributed`` group) is live in this process.
        TensorParallelError: a worker could not be started.
    """

    def __init__(self, world_size: int, device: torch.device, model_path: str, model_config, dtype: str,
                 max_model_len: int | None) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise ValueError("a torch.distributed group is already live in this process (one tensor-parallel engine "
                             "at a time); close the other engine first (LLM.close())")
        self.world_size = world_size
        self.backend = backend_for(device)
        self.port = free_port()
        self.threads = threads_per_rank(world_size)
        self._old_threads = torch.get_num_threads()
        self._closed = False
        self.timeout_s = collective_timeout_s()
        self.tp = TensorParallel(0, world_size)  # rank 0's; its group is joined in wait_loaded
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        worker_threads = self.worker_threads = min(self.threads, self._old_threads)  # torch threads of each worker
        try:
            for rank in range(1, world_size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, name=f"nanovllm-tp-rank{rank}", daemon=True,
                                args=(rank, world_size, self.port, self.backend, str(device), model_path, model_config, dtype,
                                      max_model_len, worker_threads, self.timeout_s, child, os.getpid()))
                with _stderr_with_a_file_descriptor():
                    p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            _LIVE.add(self)
            self.pids = [os.getpid()] + [p.pid for p in self.procs]
            if torch.get_num_threads() > self.threads:
                torch.set_num_threads(self.threads)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ talking to the workers

    def _send(self, msg: Any) -> None:
        self.check_alive()
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(msg)
            except (BrokenPipeError, OSError, EOFError):
                raise self._dead(rank, "its pipe closed") from None

    def _dead(self, rank: int, what: str) -> TensorParallelError:
        p, conn = self.procs[rank - 1], self.conns[rank - 1]
        p.join(1.0)
        state = f"exited with code {p.exitcode}" if p.exitcode is not None else what
        try:  # a worker that failed on its own said why before it exited
            while conn.poll(0):
                msg = conn.recv()
                if msg[0] == "error":
                    state = f"failed ({msg[1]}) and {state}"
        except (EOFError, OSError):
            pass
        return TensorParallelError(f"tensor-parallel worker rank {rank} (pid {p.pid}) {state}; the engine has stopped")

    def check_alive(self) -> None:
        """Raise :class:`TensorParallelError` if a worker has exited (or the group was shut down)."""
        if self._closed:
            raise TensorParallelError("the tensor-parallel workers were shut down; restart the engine")
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise self._dead(rank, "died")

    def wait_all(self, kind: str, timeout: float | None = None) -> list[Any]:
        """One ``kind`` reply from each worker (rank order), polling their liveness; bounded by ``timeout`` seconds.

        Raises:
            TensorParallelError: a worker reported an error, exited, or did not answer in time.
        """
        timeout = self.timeout_s if timeout is None else timeout
        replies: list[Any] = [None] * len(self.conns)
        got = [False] * len(self.conns)
        deadline = time.monotonic() + timeout
        while not all(got):
            for i, conn in enumerate(self.conns):
                if got[i]:
                    continue
                try:
                    ready = conn.poll(0.02)
                    msg = conn.recv() if ready else None
                except (EOFError, OSError):
                    raise self._dead(i + 1, "closed its pipe") from None
                if msg is None:
                    if not self.procs[i].is_alive():
                        raise self._dead(i + 1, "died")
                    continue
                if msg[0] == "error":
                    raise TensorParallelError(f"tensor-parallel worker rank {i + 1} (pid {self.procs[i].pid}) failed: "
                                              f"{msg[1]}; the engine has stopped")
                if msg[0] != kind:
                    raise TensorParallelError(f"tensor-parallel worker rank {i + 1} answered {msg[0]!r} to "
                                              f"{kind!r}; the engine has stopped")
                replies[i], got[i] = msg[1], True
            if time.monotonic() > deadline and not all(got):
                late = got.index(False) + 1
                raise TensorParallelError(f"tensor-parallel worker rank {late} (pid {self.procs[late - 1].pid}) did "
                                          f"not answer {kind!r} within {timeout:.0f} s; the engine has stopped")
        return replies

    # ------------------------------------------------------------------ the engine's calls

    def wait_loaded(self) -> None:
        """Wait until every worker holds its shard (after rank 0 loaded its own), then join the process group.

        Raises:
            TensorParallelError: a worker failed, exited or did not load within ``START_TIMEOUT_S``.
        """
        self.wait_all("loaded", START_TIMEOUT_S)
        self.tp.group = _init_group(self.backend, self.port, 0, self.world_size, self.timeout_s)

    def build_runners(self, block_size: int, num_blocks: int, attention_backend: str, max_model_len: int) -> None:
        """Each worker builds its ``ModelRunner`` and its slice of the KV pool (the same block ids as rank 0's)."""
        self._send(("runner", (block_size, num_blocks, attention_backend, max_model_len)))
        self.wait_all("runner", START_TIMEOUT_S)

    def warm_up(self) -> None:
        """Ask every worker to run the warm-up pass (rank 0 runs its own, then calls ``wait_all("warm_up")``)."""
        self._send(("warm_up", None))

    def begin_step(self, entries: list, flat_rows: list[int]) -> None:
        """The step's plan to every worker, once (see the module docstring)."""
        self._send(("step", entries, flat_rows))

    def end_step(self, wall: float, mine: CommStats) -> StepTiming:
        """Collect every worker's timing for the step rank 0 just ran (``wall`` seconds, ``mine`` its collectives)."""
        replies = self.wait_all("step")
        walls, comms = [wall], [mine.seconds]
        for w, stats in replies:
            walls.append(w)
            comms.append(stats[4])
        return StepTiming(wall_s=tuple(walls), comm_s=tuple(comms), all_reduces=mine.all_reduces,
                          all_reduce_bytes=mine.all_reduce_bytes, gathers=mine.gathers, gather_bytes=mine.gather_bytes,
                          latencies_s=tuple(mine.latencies))

    def failure(self, error: BaseException) -> TensorParallelError:
        """The one-line error for a step that failed on rank 0 (``error``), after stopping the group."""
        if isinstance(error, TensorParallelError):
            self.shutdown()
            return error
        deadline = time.monotonic() + 2.0  # a killed peer's exit is seen within moments
        reason = None
        while reason is None and time.monotonic() < deadline:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    reason = self._dead(rank, "died")
                    break
            else:
                time.sleep(0.05)
        if reason is None:
            first = (str(error).strip().splitlines() or [""])[0][:200]
            reason = TensorParallelError(f"a tensor-parallel step failed on rank 0 ({type(error).__name__}: {first}); "
                                         "the engine has stopped")
        self.shutdown()
        return reason

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every worker (asked, then terminated, then killed), join them, destroy this rank's group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except Exception:
                pass
        if self.tp.group is None:  # never joined (rank 0's load failed): a worker may wait in the rendezvous, not its pipe
            timeout = min(timeout, 0.5)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for conn in self.conns:
            try:
                conn.close()
            except Exception:
                pass
        _destroy_group()
        if torch.get_num_threads() != self._old_threads:
            torch.set_num_threads(self._old_threads)

    @property
    def closed(self) -> bool:
        return self._closed

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
