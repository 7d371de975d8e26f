"""Tensor-parallel workers: ranks 1..N-1 as processes on torch.distributed, driven by rank 0, on one host or many.

Rank 0 is the caller's process: it runs the scheduler, the block manager, the sampler and the
events, and its ``ModelRunner`` holds shard 0 of the weights and of the KV pool. Ranks
1..N-1 are worker processes that each hold their shard and run the same forward pass on the
same plan; the model's all-reduces and the LM head's gather (``model/parallel.py``) go through
``torch.distributed``: gloo on the CPU, NCCL on CUDA. A worker is either started by rank 0 on
its own host (``multiprocessing`` spawn context; ranks ``1..local_ranks-1``) or by the user on
another host with ``nanovllm worker --master-addr HOST --master-port PORT --rank R
--tensor-parallel-size N`` (:func:`run_worker`; torchrun's ``MASTER_ADDR``, ``MASTER_PORT``,
``RANK`` and ``WORLD_SIZE`` stand in for the options), ranks ``local_ranks..N-1``.

**Launch** (``engine/tp_launch.py``): rank 0 listens at ``--tp-master-addr``/``--tp-master-port``;
every worker, local or remote, connects there, passes a key check, and is checked and welcomed
(model, dtype, context length, device type, the collective timeout and the port of the
``torch.distributed`` rendezvous); once all have loaded their shards every rank initialises
``tcp://master_addr:that port``.

**Control path: one TCP connection per worker, the plan pickled once per step, for every rank**
(one path for local and remote workers; as GeeeekExplorer/nano-vllm pickles its calls; it writes
them into shared memory and rings an Event, vLLM broadcasts them through a shared-memory ring
buffer, or a ZeroMQ socket across hosts). Why a connection rather than
``broadcast_object_list`` on a gloo group: a worker waiting on its connection, not inside a
collective, may wait forever, and the engine can sit paused or idle for hours while a gloo
collective gives up after its timeout; the connection closing is how a worker learns that rank 0
is gone and how rank 0 sees a worker die (its last error arrives first), at once, on either host
(TCP keep-alive probes, ``tp_launch._tune``, find a vanished host in about 25 s); and the plan
is small (per sequence its id, start, new token ids and block table: a few hundred bytes a
step), so the copy costs microseconds against a forward pass of milliseconds. The tensors themselves never go through
the connection: only ``torch.distributed`` moves them.

Each step: rank 0 sends ``("step", entries, flat_rows)`` to every worker, runs the same
``ModelRunner.execute``, then reads each worker's reply: its wall seconds for the step and its
collectives' counts, bytes and seconds (:class:`StepTiming`). The reply also proves the worker
alive. Failure: rank 0 checks its workers before each step and waits for replies while
watching their connections (and, for local ones, their processes); a collective that a dead
peer leaves raises at once (gloo's socket closes) and one that a hung peer leaves raises after
:func:`collective_timeout_s` (30 s). Either way rank 0 raises :class:`TensorParallelError` (one
line naming the rank, its PID (and host) and what happened), stops the other workers, and the
engine finishes every request with that error (every block freed). Shutdown
(``LLMEngine.close``, ``LLM.close`` / ``with LLM(...)`` / its ``__del__``, and ``atexit``):
each worker is told to stop and destroys its process group; local ones are joined (terminated if
they do not stop within seconds), remote ones are waited for until their connection closes (they
exit); rank 0 destroys its group and closes its listening port.

Why this file runs past ~500 lines: the two ends of one protocol (the worker's loop and rank
0's ``WorkerGroup``) read best side by side, message for message; split, each half would
name messages the reader cannot see.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from typing import Any

import torch

from nanovllm_core.engine.tp_launch import (  # noqa: F401  (re-exported: the engine and the CLI import them from here)
    RENDEZVOUS_TIMEOUT_S,
    Rendezvous,
    MAIN_GUARD_EXIT,
    MAIN_GUARD_FIX,
    TensorParallelError,
    WorkerOptions,
    how_it_ended,
    _recv_by,
    free_port,
    join_rank0,
)
from nanovllm_core.config import setting
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


def refuse_in_spawned_import() -> None:
    """Stop a worker process that is still importing rank 0's script (spawn's re-import of ``__main__``)
    and was about to create an engine of its own: one line on stderr, exit :data:`MAIN_GUARD_EXIT`.

    Without this, multiprocessing's ``freeze_support`` traceback fills the screen and rank 0 reports only
    that the worker exited before it joined. Nothing happens in any other process.
    """
    import multiprocessing.process as mp_process

    if getattr(mp_process.current_process(), "_inheriting", False):
        print(f"nanovllm tensor-parallel worker (pid {os.getpid()}): the script creates a tensor-parallel engine "
              f"when it is imported; {MAIN_GUARD_FIX}", file=sys.stderr, flush=True)
        raise SystemExit(MAIN_GUARD_EXIT)


# What gloo (and NCCL) say when the other end of a collective went away or stopped answering: the
# rank that reports it is not the cause, the rank that went away is.
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
              "timed out", "timeout", "socket closed", "remote process exited", "read error", "write error")


def peer_lost(text: str) -> bool:
    """Whether an error text says that a peer of a collective went away (rather than this rank failing)."""
    low = text.lower()
    return any(p in low for p in _PEER_LOST)


def short_reason(text: str, limit: int = 200) -> str:
    """The first line of a collective's error without its source location and its advice
    (gloo: ``[../pair.cc:545] Read error [127.0.0.1]:50599: Connection reset by peer. This is
    typically caused by ...`` -> ``Read error [127.0.0.1]:50599: Connection reset by peer``)."""
    import re

    first = (str(text).strip().splitlines() or [""])[0]
    first = re.sub(r"\[[^\]]*\.(?:cc|cpp|cu|h|hpp):\d+\]\s*", "", first)
    first = first.split(". This is typically")[0].split(" This is typically")[0].rstrip(". ")
    first = first.encode("ascii", "ignore").decode().strip()
    return first[:limit]


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


def backend_for(device: torch.device) -> str:
    """``"nccl"`` on CUDA (when this torch has it), else ``"gloo"``.

    Raises:
        ValueError: CUDA without NCCL.
    """
    import torch.distributed as dist

    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise ValueError(f"tensor parallelism on CUDA needs NCCL, which this torch build lacks; use {setting('device', 'cpu')}")
        return "nccl"
    return "gloo"


def threads_per_rank(world_size: int) -> int:
    """Torch threads for each rank: the cores shared evenly, at least one (so N ranks use at most the cores when N <= cores)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _init_group(backend: str, addr: str, port: int, rank: int, world_size: int, timeout_s: float):
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
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


# ----------------------------------------------------------------------------- a worker rank


def _recv(conn: Connection, parent_pid: int | None):
    """The next message from rank 0, waiting as long as it takes; None once rank 0 is gone (its connection
    closed, or, for a worker rank 0 started, its process ended)."""
    return _recv_by(conn, float("inf"), parent_pid)


def _rank0_gone(conn: Connection, parent_pid: int | None, grace_s: float = 2.0) -> bool:
    """Whether rank 0 has gone (its connection closed, or the parent process ended) within ``grace_s``
    seconds; False when it is still there (it sends ``stop`` once it has seen the failure, or nothing)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if parent_pid is not None and os.getppid() != parent_pid:
            return True
        try:
            if conn.poll(0.1) and conn.recv()[0] == "stop":
                return False
        except (EOFError, OSError):
            return True
    return False


def run_worker(opts: WorkerOptions, conn: Connection | None = None, welcome: dict | None = None) -> tuple[int, str]:
    """A worker rank's life: join rank 0 (unless ``conn``/``welcome`` say it has), load its shard (while rank 0
    loads its own), join the process group, then run each step rank 0 sends until told to stop.

    Returns:
        ``(exit status, one line)``: 0 when rank 0 told it to stop; 1 when rank 0 went away or a step failed
        (the reason also went to rank 0 when it could).

    Raises:
        ValueError, TensorParallelError, ModelLoadError: as :func:`join_rank0`, before any shard is loaded.
    """
    if conn is None:
        conn, welcome = join_rank0(opts)
    code, why = 1, f"rank 0 at {opts.master_addr}:{opts.master_port} closed the connection; this worker stopped"
    try:
        if opts.threads:
            torch.set_num_threads(opts.threads)
        dev = torch.device(welcome["device"])
        if dev.type == "cuda":
            local = opts.local_rank if opts.local_rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
            dev = torch.device("cuda", local)
            torch.cuda.set_device(dev)
        from nanovllm_core.config import DTYPES
        from nanovllm_core.engine.model_runner import ModelRunner
        from nanovllm_core.model.loader import load_model, warm_up

        tp = TensorParallel(opts.rank, opts.world_size)  # its group once loaded: cutting and reading need none
        model, _tokenizer, _resolved = load_model(welcome["model_path"], dev, DTYPES[welcome["dtype"]],
                                                  max_model_len=welcome["max_model_len"], tensor_parallel=tp,
                                                  model_config=welcome["model_config"], with_tokenizer=False)
        conn.send(("loaded", None))
        runner = None
        while True:
            msg = _recv(conn, opts.parent_pid)
            if msg is None:
                break
            kind = msg[0]
            if kind == "stop":
                code, why = 0, "rank 0 stopped the engine"
                break
            if kind == "join":  # every rank has loaded: the rendezvous of torch.distributed, on rank 0's port
                tp.group = _init_group(welcome["backend"], opts.master_addr, welcome["dist_port"], opts.rank,
                                       opts.world_size, welcome["timeout_s"])
            elif kind == "runner":
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
        code, why = 1, f"{type(e).__name__}: {short_reason(e)}"
        if peer_lost(why) and _rank0_gone(conn, opts.parent_pid):
            why = (f"rank 0 at {opts.master_addr}:{opts.master_port} went away during a step (its connection "
                   "closed); this worker stopped: start rank 0 again, then this worker")
        else:
            if peer_lost(why):
                why += " (another rank went away; rank 0 names it)"
            try:
                conn.send(("error", why))
            except Exception:
                pass
    finally:
        _destroy_group()
        try:
            conn.close()
        except Exception:
            pass
    return code, why


def _worker_process(opts: WorkerOptions) -> None:
    """A local worker's process (rank 0 started it): :func:`run_worker`, then exit without interpreter teardown."""
    try:
        code, _ = run_worker(opts)
    except BaseException as e:  # noqa: BLE001 - it never joined: rank 0 sees the exit and reports it; the reason here
        print(f"nanovllm tensor-parallel rank {opts.rank}: {e}", file=sys.stderr, flush=True)
        code = 1
    os._exit(code)  # torch's atexit hooks must not touch a half-destroyed group


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
    """Rank 0's handle on ranks 1..N-1: start the local ones, admit them all, drive their steps, stop them.

    Start-up overlaps: the constructor listens at ``master_addr:master_port``, starts the local
    workers and returns; a thread admits each worker as it connects (the key check, its hello
    checked, the welcome sent), so workers read their shards while rank 0 reads its own (through
    :attr:`tp`, whose group is not set yet); :meth:`wait_loaded` then waits for every rank to have
    joined and loaded, and all join the process group.

    Args:
        world_size: N (>= 2).
        device: the engine's device (rank 0 runs on it; on CUDA a local worker r runs on GPU r).
        model_path: the resolved model folder every rank loads (rank 0 resolved and converted it);
            a remote worker given its own ``--model`` loads that instead, after its config matched.
        model_config: its ``ModelConfig`` (sent along, so a worker need not import transformers).
        dtype: the dtype's name (``"float32"``...).
        max_model_len: the rotary table's length, as rank 0's.
        master_addr: the address to listen on (None: 127.0.0.1; ``0.0.0.0``: every interface).
        master_port: the port to listen on (None: a free one; ranks joining from other hosts need a known one).
        local_ranks: ranks 0..local_ranks-1 run on this host (None: all N); the others join from elsewhere.
        rendezvous_timeout_s: how long every rank may take to connect (seconds).

    Raises:
        ValueError: another tensor-parallel engine (or any ``torch.distributed`` group) is live in this process.
        TensorParallelError: the address cannot be listened on, or a worker could not be started.
    """

    def __init__(self, world_size: int, device: torch.device, model_path: str, model_config, dtype: str,
                 max_model_len: int | None, master_addr: str | None = None, master_port: int | None = None,
                 local_ranks: int | None = None, rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise ValueError("a torch.distributed group is already live in this process (one tensor-parallel engine "
                             "at a time); close the other engine first (LLM.close())")
        self.world_size = world_size
        self.local_ranks = world_size if local_ranks is None else local_ranks
        self.backend = backend_for(device)
        self.threads = threads_per_rank(self.local_ranks)  # this host's cores, shared by the ranks it runs
        self._old_threads = torch.get_num_threads()
        self._closed = False
        self._reported: dict[int, str] = {}  # rank -> the error it sent (kept to name the cause; see _blame)
        self.timeout_s = collective_timeout_s()
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.tp = TensorParallel(0, world_size)  # rank 0's; its group is joined in wait_loaded
        self.procs: dict[int, Any] = {}  # rank -> the process this host started for it
        self.rendezvous = Rendezvous(world_size, self.local_ranks, master_addr, master_port, rendezvous_timeout_s,
                                     model_config)
        self.master_addr, self.master_port = self.rendezvous.master_addr, self.rendezvous.master_port
        self.bind_addr = self.rendezvous.bind_addr
        self._welcome = {"model_path": model_path, "model_config": model_config, "dtype": dtype,
                         "max_model_len": max_model_len, "device": str(device), "backend": self.backend,
                         "timeout_s": self.timeout_s, "dist_port": free_port("0.0.0.0")}
        ctx = mp.get_context("spawn")
        worker_threads = self.worker_threads = min(self.threads, self._old_threads)  # torch threads of each worker
        try:
            for rank in range(1, self.local_ranks):
                opts = WorkerOptions(rank, world_size, self.master_addr, self.master_port, local_rank=rank,
                                     threads=worker_threads, rendezvous_timeout_s=rendezvous_timeout_s,
                                     parent_pid=os.getpid())
                p = ctx.Process(target=_worker_process, name=f"nanovllm-tp-rank{rank}", daemon=True, args=(opts,))
                with _stderr_with_a_file_descriptor():
                    p.start()
                self.procs[rank] = p
                self.rendezvous.where[rank] = f"pid {p.pid}"
            _LIVE.add(self)
            self.rendezvous.start(self._welcome, self.procs)
            if torch.get_num_threads() > self.threads:
                torch.set_num_threads(self.threads)
        except BaseException:
            self.shutdown()
            raise

    @property
    def conns(self) -> list[Connection | None]:
        """Each worker's control connection, rank r's at r - 1 (None until it joined)."""
        return self.rendezvous.conns

    @property
    def where(self) -> dict[int, str]:
        """rank -> ``"pid 123"`` (a worker this host started) or ``"pid 123 on host (10.0.0.2)"``."""
        return self.rendezvous.where

    @property
    def pids(self) -> list[int | None]:
        """Each rank's PID (rank 0's is this process; a remote rank's is on its host; None: not joined yet)."""
        return [os.getpid()] + [self.rendezvous.pids.get(r, self.procs[r].pid if r in self.procs else None)
                                for r in range(1, self.world_size)]

    # ------------------------------------------------------------------ talking to the workers

    def _send(self, msg: Any) -> None:
        self.check_alive()
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(msg)
            except (BrokenPipeError, OSError, EOFError):
                raise self._end_of(rank, "closed its connection") from None

    def _dead(self, rank: int, what: str) -> TensorParallelError:
        p, conn = self.procs.get(rank), self.conns[rank - 1]
        state = what
        if p is not None:
            p.join(1.0)
            if p.exitcode is not None:
                state = how_it_ended(p.exitcode)
        try:  # a worker that failed on its own said why before it exited
            while conn is not None and conn.poll(0):
                msg = conn.recv()
                if msg[0] == "error":
                    self._reported.setdefault(rank, msg[1])
        except (EOFError, OSError):
            pass
        said = self._reported.get(rank)
        if said is not None and not peer_lost(said):
            state = f"failed ({short_reason(said)}) and {state}"
        return TensorParallelError(f"tensor-parallel worker rank {rank} ({self.where.get(rank, 'not joined')}) "
                                   f"{state}; the engine has stopped")

    def _failed(self, rank: int, why: str) -> TensorParallelError:
        """Rank ``rank`` reported ``why`` (its step failed) and is still there."""
        return TensorParallelError(f"tensor-parallel worker rank {rank} ({self.where.get(rank)}) failed: "
                                   f"{short_reason(why)}; the engine has stopped")

    def _went_away(self, rank: int) -> TensorParallelError | None:
        """Rank ``rank``'s end if its process ended or its connection closed, else None; an error it sent
        meanwhile is kept in ``_reported`` (another message, a step's late reply, is dropped)."""
        p, conn = self.procs.get(rank), self.conns[rank - 1]
        if p is not None and not p.is_alive():
            return self._dead(rank, "died")
        if conn is None:
            return None
        try:
            while conn.poll(0):
                msg = conn.recv()
                if msg[0] == "error":
                    self._reported.setdefault(rank, msg[1])
        except (EOFError, OSError):
            return self._dead(rank, "closed its connection")
        return None

    def _blame(self, rank: int, why: str | None, fallback: TensorParallelError,
               grace_s: float = 2.0) -> TensorParallelError:
        """The error that names the cause of a failed step.

        ``rank`` (0: rank 0's own step) failed with ``why``. A collective whose peer went away fails on every
        rank that was left in it (gloo: "Connection reset by peer"), the first to say so is not the cause:
        for such a ``why`` (or none) wait up to ``grace_s`` seconds for a rank whose process ended or whose
        connection closed, and name it; else a rank that reported a failure of its own; else ``fallback``.
        """
        if why is not None and not peer_lost(why):
            return fallback
        deadline = time.monotonic() + grace_s
        after: TensorParallelError | None = None  # a rank that went away after saying a peer had gone
        while True:
            for r in range(1, self.world_size):
                if r == rank:
                    continue
                gone = self._went_away(r)
                if gone is not None and r not in self._reported:
                    return gone  # killed, or its host vanished: it said nothing first
                if gone is not None and not peer_lost(self._reported[r]):
                    return gone  # it failed on its own (its reason is in the line) and exited
                if gone is not None and after is None:
                    after = gone
            own = [r for r, said in sorted(self._reported.items()) if r != rank and not peer_lost(said)]
            if own:
                return self._failed(own[0], self._reported[own[0]])
            if time.monotonic() > deadline:
                return fallback if rank != 0 or after is None else after
            time.sleep(0.05)

    def _end_of(self, rank: int, what: str) -> TensorParallelError:
        """Rank ``rank`` has gone (``what``): its line, unless it first said that a peer had gone (then that peer's)."""
        gone = self._dead(rank, what)
        said = self._reported.get(rank)
        return self._blame(rank, said, gone) if said is not None and peer_lost(said) else gone

    def _gone(self, rank: int, strict: bool) -> TensorParallelError | None:
        """Rank ``rank``'s end if it has died, failed or closed its connection, else None; a message it sent
        unasked is an error when ``strict`` (between steps), else read and dropped (a step's late reply)."""
        p, conn = self.procs.get(rank), self.conns[rank - 1]
        if p is not None and not p.is_alive():
            return self._end_of(rank, "died")
        if conn is None:
            return TensorParallelError(f"tensor-parallel rank {rank} never joined; the engine has stopped")
        try:
            if not conn.poll(0):
                return None
            msg = conn.recv()
        except (EOFError, OSError):
            return self._end_of(rank, "closed its connection")
        if msg[0] == "error":
            self._reported.setdefault(rank, msg[1])
            return self._blame(rank, msg[1], self._failed(rank, msg[1]))
        if strict:
            return TensorParallelError(f"tensor-parallel worker rank {rank} sent {msg[0]!r} unasked; the engine "
                                       "has stopped")
        return None

    def check_alive(self) -> None:
        """Raise :class:`TensorParallelError` if a worker has exited or closed its connection (or the group was shut down)."""
        if self._closed:
            raise TensorParallelError("the tensor-parallel workers were shut down; restart the engine")
        for rank in range(1, self.world_size):
            gone = self._gone(rank, strict=True)
            if gone is not None:
                raise gone

    def wait_all(self, kind: str, timeout: float | None = None) -> list[Any]:
        """One ``kind`` reply from each worker (rank order), watching their connections (and local processes);
        bounded by ``timeout`` seconds.

        Raises:
            TensorParallelError: a worker reported an error, exited, closed its connection or did not answer in time.
        """
        timeout = self.timeout_s if timeout is None else timeout
        replies: list[Any] = [None] * len(self.conns)
        pending = {conn: i for i, conn in enumerate(self.conns)}
        deadline = time.monotonic() + timeout
        while pending:
            for conn in wait_for_connections(list(pending), timeout=0.05):
                i = pending[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    raise self._end_of(i + 1, "closed its connection") from None
                if msg[0] == "error":
                    self._reported.setdefault(i + 1, msg[1])
                    raise self._blame(i + 1, msg[1], self._failed(i + 1, msg[1]))
                if msg[0] != kind:
                    raise TensorParallelError(f"tensor-parallel worker rank {i + 1} answered {msg[0]!r} to "
                                              f"{kind!r}; the engine has stopped")
                replies[i] = msg[1]
                del pending[conn]
            for i in sorted(pending.values()):
                p = self.procs.get(i + 1)
                if p is not None and not p.is_alive():
                    raise self._end_of(i + 1, "died")
            if pending and time.monotonic() > deadline:
                late = min(pending.values()) + 1
                raise TensorParallelError(f"tensor-parallel worker rank {late} ({self.where.get(late)}) did "
                                          f"not answer {kind!r} within {timeout:.0f} s; the engine has stopped")
        return replies

    # ------------------------------------------------------------------ the engine's calls

    def wait_loaded(self, progress=None) -> None:
        """Wait until every rank has joined and holds its shard (after rank 0 loaded its own), then all join the
        process group. ``progress(stage, done, total)`` hears where rank 0 waits for ranks from other hosts.

        Raises:
            TensorParallelError: a worker was refused, failed, exited, did not join within the rendezvous
                timeout or did not load within ``START_TIMEOUT_S``.
        """
        if progress is not None and self.local_ranks < self.world_size and self.rendezvous.waiting:
            first, last = self.local_ranks, self.world_size - 1
            ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
            progress(f"waiting for tensor-parallel {ranks} to join at {self.bind_addr}:{self.master_port}", 0, 1)
        self.rendezvous.wait()
        self.wait_all("loaded", START_TIMEOUT_S)
        self._send(("join",))
        self.tp.group = _init_group(self.backend, self.master_addr, self._welcome["dist_port"], 0, self.world_size,
                                    self.timeout_s)

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
        first = short_reason(error)
        fallback = TensorParallelError(f"a tensor-parallel step failed on rank 0 ({type(error).__name__}: {first}); "
                                       "the engine has stopped")
        reason = self._blame(0, None, fallback)  # a dead or failing worker is the likelier cause: looked for first
        self.shutdown()
        return reason

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every worker (asked; a local one then terminated, then killed), wait for each to go, destroy this
        rank's group and close the listening port (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        rendezvous = getattr(self, "rendezvous", None)
        if rendezvous is None:  # the port could not be listened on: nothing was started
            return
        rendezvous.stop()
        conns = [c for c in self.conns if c is not None]
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.send(("stop",))
        if self.tp.group is None:  # never joined (rank 0's load failed): a worker may be loading, not reading
            timeout = min(timeout, 0.5)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for rank in range(1, self.world_size):  # a remote worker: gone once its connection closes
            conn = self.conns[rank - 1]
            if conn is None or rank in self.procs:
                continue
            try:
                while conn.poll(max(0.0, deadline - time.monotonic())):
                    conn.recv()
            except (EOFError, OSError):
                pass
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()
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
