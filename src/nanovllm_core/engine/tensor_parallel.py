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

**Launch: rank 0 is the master, as torchrun's ``env://`` rendezvous has it.** Rank 0 listens on
``master_addr:master_port`` (``--tp-master-addr``/``--tp-master-port``; 127.0.0.1 and a free port
when every rank is local). Every worker, local or remote, connects there (retrying until the
rendezvous timeout, so workers may start before rank 0), proves it holds the same key (an
HMAC challenge each way over ``NANOVLLM_TP_AUTHKEY``, before anything is unpickled), and says
hello: its rank, its world size and, when it was given its own ``--model``, that model's
config. Rank 0 checks them (a rank out of range, one it runs itself, a rank twice, another
world size or another model is a one-line refusal that both ends print, naming what to fix)
and answers with what every rank must share: the model path, dtype, context length, device
type, the collective timeout and the port of the ``torch.distributed`` rendezvous (a free port
on rank 0's host; every rank initialises ``tcp://master_addr:that port`` once all have loaded).
A rank that has not joined when the rendezvous timeout (``--tp-rendezvous-timeout``, 300 s) ends
is a one-line error naming the rank and the command to start it. Why ``--tp-local-ranks K``
(ranks 0..K-1 here) rather than torchrun's ``--nnodes``/``--node-rank``: rank 0's host also
runs the scheduler and the sampler, and hosts may hold different numbers of ranks, so one
count on rank 0 and one ``--rank`` per worker process (torchrun's ``RANK``: one per process)
say where every rank runs without assuming equal nodes.

**Control path: one TCP connection per worker, the plan pickled once per step, for every rank**
(one path for local and remote workers; as GeeeekExplorer/nano-vllm pickles its calls; it writes
them into shared memory and rings an Event, vLLM broadcasts them through a shared-memory ring
buffer, or a ZeroMQ socket across hosts). Why a connection rather than
``broadcast_object_list`` on a gloo group: a worker waiting on its connection, not inside a
collective, may wait forever, and the engine can sit paused or idle for hours while a gloo
collective gives up after its timeout; the connection closing is how a worker learns that rank 0
is gone and how rank 0 sees a worker die (its last error arrives first), at once, on either host
(TCP keep-alive probes find a vanished host in about 25 s); and the plan is small (per sequence
its id, start, new token ids and block table: a few hundred bytes a step), so the copy costs
microseconds against a forward pass of milliseconds. The tensors themselves never go through
the connection: only ``torch.distributed`` moves them. Trust: like torchrun's store, the
connection is meant for a trusted network; the key check keeps a stray or mistaken client out
(set one ``NANOVLLM_TP_AUTHKEY`` on every host), it does not encrypt.

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

Why this file runs past ~400 lines: the two ends of one protocol (the worker's loop and rank
0's ``WorkerGroup``) read best side by side, message for message; split, each half would
name messages the reader cannot see.
"""

from __future__ import annotations

import atexit
import contextlib
import hmac
import multiprocessing as mp
import os
import select
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from typing import Any

import torch

from nanovllm_core.model.parallel import CommStats, TensorParallel

# A collective waits this long for a peer (a hung worker ends the engine after it); a step of
# a small model takes milliseconds, a long prefill on a busy CPU some seconds. The environment
# variable NANOVLLM_TP_TIMEOUT_S overrides it (tests use a short one).
COLLECTIVE_TIMEOUT_S = 30.0
# Start-up: a worker imports torch and loads its shard (tens of seconds on a busy 2-core host).
START_TIMEOUT_S = 300.0
# How long rank 0 waits for every worker to connect, and a worker for rank 0 to listen (torchrun's
# rendezvous waits 900 s; the ranks here are started by hand or by rank 0, so minutes suffice).
RENDEZVOUS_TIMEOUT_S = 300.0
# A connection must pass the key check within this (a port scanner or a silent client is dropped).
HANDSHAKE_TIMEOUT_S = 10.0
_MAGIC = b"nanovllm-tensor-parallel/1\n"  # the first bytes each way: a wrong port reads as one
_NONCE = 32


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` free right now (the OS picks it; several runs side by side get different ones)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
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


# ----------------------------------------------------------------------------- the connection and its key


def _authkey() -> bytes:
    """The shared key of the HMAC check: ``NANOVLLM_TP_AUTHKEY`` (the same on every host), or a fixed default."""
    return os.environ.get("NANOVLLM_TP_AUTHKEY", "nanovllm-tp").encode()


def _digest(nonce: bytes) -> bytes:
    return hmac.new(_authkey(), nonce, "sha256").digest()


def _tune(sock: socket.socket) -> Connection:
    """A connected socket as a ``multiprocessing`` ``Connection`` (pickled messages, ``poll``), with TCP
    keep-alive probes after 10 s of silence, every 5 s, 3 tries (a vanished host is seen in ~25 s) and no Nagle delay."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return Connection(sock.detach())


def _recv_bytes_by(conn: Connection, deadline: float) -> bytes | None:
    """The next raw message (at most 256 bytes) before ``deadline``, or None (nothing came, or the peer closed)."""
    try:
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            return None
        return conn.recv_bytes(256)
    except (EOFError, OSError):
        return None


def _recv_by(conn: Connection, deadline: float, parent_pid: int | None = None):
    """The next pickled message before ``deadline`` (None: none in time, the peer closed, or the parent died)."""
    while time.monotonic() < deadline:
        try:
            if conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                return conn.recv()
        except (EOFError, OSError):
            return None
        if parent_pid is not None and os.getppid() != parent_pid:
            return None
    return None


def _recv(conn: Connection, parent_pid: int | None):
    """The next message from rank 0, waiting as long as it takes; None once rank 0 is gone (its connection
    closed, or, for a worker rank 0 started, its process ended)."""
    return _recv_by(conn, float("inf"), parent_pid)


def _connect(addr: str, port: int, deadline: float, timeout_s: float) -> Connection:
    """Connect to rank 0 at ``addr:port``, retrying while nothing listens there yet, until ``deadline``.

    Raises:
        TensorParallelError: the address does not resolve, or rank 0 was not reached in time (one line).
    """
    last = "nothing answered"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TensorParallelError(f"could not reach rank 0 at {addr}:{port} within {timeout_s:g} s ({last}); start "
                                      f"rank 0 there first (--tensor-parallel-size N --tp-master-port {port}) or fix "
                                      "--master-addr/--master-port, or raise --rendezvous-timeout")
        try:
            sock = socket.create_connection((addr, port), timeout=min(5.0, left))
        except socket.gaierror as e:
            raise TensorParallelError(f"--master-addr {addr!r} does not resolve ({e.strerror}); give rank 0's host "
                                      "name or IP address") from None
        except OSError as e:
            last = e.strerror or type(e).__name__
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
            continue
        return _tune(sock)


def _answer_key(conn: Connection, where: str, deadline: float) -> None:
    """The worker's half of the key check (rank 0 challenges first, then the worker).

    Raises:
        TensorParallelError: the other end is not a nanovllm rank 0, or the keys differ.
    """
    first = _recv_bytes_by(conn, deadline)
    if first is None or not first.startswith(_MAGIC) or len(first) != len(_MAGIC) + _NONCE:
        raise TensorParallelError(f"{where} did not answer as a nanovllm tensor-parallel rank 0; check "
                                  "--master-addr and --master-port (rank 0's --tp-master-port)")
    mine = os.urandom(_NONCE)
    conn.send_bytes(_MAGIC + _digest(first[len(_MAGIC):]) + mine)
    theirs = _recv_bytes_by(conn, deadline)
    if theirs is None or not hmac.compare_digest(theirs, _digest(mine)):
        raise TensorParallelError(f"rank 0 at {where} and this worker hold different keys; set the same "
                                  "NANOVLLM_TP_AUTHKEY on every host")


# ----------------------------------------------------------------------------- a worker rank


@dataclass(frozen=True)
class WorkerOptions:
    """What a worker rank is started with.

    Args:
        rank: 1..world_size-1.
        world_size: N, as rank 0's ``--tensor-parallel-size``.
        master_addr, master_port: where rank 0 listens (its ``--tp-master-addr``/``--tp-master-port``).
        model: this host's path (or repo id) of the model; None: rank 0's resolved path (a shared disk,
            or a worker rank 0 started itself).
        local_rank: this worker's GPU on its host (CUDA only; None: 0, or the rank for one rank 0 started).
        threads: torch threads (None: torch's default).
        rendezvous_timeout_s: how long to keep trying to reach rank 0 and to wait for its answer.
        parent_pid: rank 0's PID when rank 0 started this worker (it stops when that process ends).
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    model: str | None = None
    local_rank: int | None = None
    threads: int | None = None
    rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S
    parent_pid: int | None = None


def check_worker_rank(rank: int, world_size: int) -> None:
    """Refuse a worker's rank or world size that cannot be right, before it connects.

    Raises:
        ValueError: world size below 2, rank 0 (the engine itself), or a rank outside 1..N-1 (one line).
    """
    if world_size < 2:
        raise ValueError(f"--tensor-parallel-size {world_size}: a worker joins a group of 2 or more ranks; give "
                         "rank 0's --tensor-parallel-size")
    if rank == 0:
        raise ValueError("--rank 0 is the engine itself (nanovllm, nanovllm serve or nanovllm-tui with "
                         "--tensor-parallel-size N); a worker's --rank is 1 to N-1")
    if not 1 <= rank < world_size:
        raise ValueError(f"--rank {rank} is outside 1 to {world_size - 1} (--tensor-parallel-size {world_size}); "
                         "give each worker its own rank in that range")


def _own_model_config(model: str):
    """The ``ModelConfig`` of this host's copy of ``model`` (what rank 0 compares with its own), and its path."""
    from nanovllm_core.config import ModelConfig
    from nanovllm_core.model.loader import ModelLoadError, load_hf_config, resolve_model

    resolved = resolve_model(model)
    try:
        return ModelConfig.from_hf(load_hf_config(resolved.path)), str(resolved.path)
    except (ValueError, AttributeError) as e:
        raise ModelLoadError(f"{resolved.name}: {e}") from None


def join_rank0(opts: WorkerOptions) -> tuple[Connection, dict]:
    """Reach rank 0, pass the key check, say hello, and get its welcome (what every rank shares).

    Raises:
        ValueError: a rank or world size that cannot be right.
        TensorParallelError: rank 0 unreachable within the rendezvous timeout, another key, or rank 0
            refused this worker (its one-line reason: another world size or model, a rank taken).
        ModelLoadError: this worker's own ``--model`` cannot be read.
    """
    check_worker_rank(opts.rank, opts.world_size)
    own = _own_model_config(opts.model) if opts.model else None
    where = f"{opts.master_addr}:{opts.master_port}"
    deadline = time.monotonic() + opts.rendezvous_timeout_s
    conn = _connect(opts.master_addr, opts.master_port, deadline, opts.rendezvous_timeout_s)
    try:
        _answer_key(conn, where, deadline)
        conn.send(("hello", {"rank": opts.rank, "world_size": opts.world_size, "host": socket.gethostname(),
                             "pid": os.getpid(), "model_config": own[0] if own else None,
                             "local": opts.parent_pid is not None}))
        msg = _recv_by(conn, deadline)
        if msg is None:
            raise TensorParallelError(f"rank 0 at {where} did not welcome rank {opts.rank} within "
                                      f"{opts.rendezvous_timeout_s:g} s")
        if msg[0] == "refused":
            raise TensorParallelError(msg[1])
        welcome = dict(msg[1])
        if own:
            welcome["model_path"] = own[1]
        return conn, welcome
    except BaseException:
        conn.close()
        raise


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
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        code, why = 1, f"{type(e).__name__}: {first}"
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


class _Refused(Exception):
    """The rendezvous cannot complete (one line: what to fix)."""


def _config_differences(theirs, ours) -> list[str]:
    import dataclasses

    return [f"{f.name} {getattr(theirs, f.name)!r} vs {getattr(ours, f.name)!r}"
            for f in dataclasses.fields(ours) if getattr(theirs, f.name, None) != getattr(ours, f.name)]


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
        self.timeout_s = collective_timeout_s()
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.tp = TensorParallel(0, world_size)  # rank 0's; its group is joined in wait_loaded
        self.procs: dict[int, Any] = {}  # rank -> the process this host started for it
        self.conns: list[Connection | None] = [None] * (world_size - 1)  # rank r's at r - 1, once admitted
        self.where: dict[int, str] = {}  # rank -> "pid 123" (a local worker) or "pid 123 on host (10.0.0.2)"
        self._pid: dict[int, int] = {}
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        bind = master_addr or "127.0.0.1"
        self.bind_addr = bind
        self.master_addr = "127.0.0.1" if bind in ("0.0.0.0", "") else bind  # where this host's ranks connect
        try:
            self._listener: socket.socket | None = socket.create_server((bind, master_port or 0),
                                                                        backlog=max(8, world_size))
        except socket.gaierror as e:
            raise TensorParallelError(f"--tp-master-addr {bind!r} does not resolve ({e.strerror}); give an address "
                                      "of this host") from None
        except OSError as e:
            raise TensorParallelError(f"cannot listen on {bind}:{master_port} for the tensor-parallel workers "
                                      f"({e.strerror}); choose another --tp-master-port, or an address of this host "
                                      "for --tp-master-addr") from None
        self.master_port = self._listener.getsockname()[1]
        self._welcome = {"model_path": model_path, "model_config": model_config, "dtype": dtype,
                         "max_model_len": max_model_len, "device": str(device), "backend": self.backend,
                         "timeout_s": self.timeout_s, "dist_port": free_port("0.0.0.0")}
        self._model_config = model_config
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
                self.where[rank] = f"pid {p.pid}"
            _LIVE.add(self)
            self._deadline = time.monotonic() + rendezvous_timeout_s
            self._thread = threading.Thread(target=self._rendezvous, name="nanovllm-tp-rendezvous", daemon=True)
            self._thread.start()
            if torch.get_num_threads() > self.threads:
                torch.set_num_threads(self.threads)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pids(self) -> list[int | None]:
        """Each rank's PID (rank 0's is this process; a remote rank's is on its host; None: not joined yet)."""
        return [os.getpid()] + [self._pid.get(r, self.procs[r].pid if r in self.procs else None)
                                for r in range(1, self.world_size)]

    # ------------------------------------------------------------------ the rendezvous (a thread)

    def _rendezvous(self) -> None:
        """Admit workers until every rank has joined, one was refused, a local one died, or the time ran out."""
        try:
            while not self._stop.is_set() and None in self.conns:
                for rank, p in self.procs.items():
                    if self.conns[rank - 1] is None and not p.is_alive():
                        raise _Refused(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code "
                                       f"{p.exitcode} before it joined; the engine has stopped")
                if time.monotonic() > self._deadline:
                    raise _Refused(self._missing())
                ready, _, _ = select.select([self._listener], [], [], 0.2)
                if ready:
                    sock, addr = self._listener.accept()
                    rank = self._admit(sock, addr[0])
                    if rank is not None and self._stop.is_set():  # shut down meanwhile: this one stops too
                        with contextlib.suppress(Exception):
                            self.conns[rank - 1].send(("stop",))
                            self.conns[rank - 1].close()
        except _Refused as e:
            self._error = str(e)
        except Exception as e:  # noqa: BLE001 - the listener closed under it (shutdown) or the OS refused
            if not self._stop.is_set():
                self._error = f"the tensor-parallel rendezvous failed ({type(e).__name__}: {e}); the engine has stopped"
        finally:
            self._close_listener()

    def _missing(self) -> str:
        missing = [r for r in range(1, self.world_size) if self.conns[r - 1] is None]
        remote = [r for r in missing if r >= self.local_ranks]
        where = f"{socket.gethostname() if self.bind_addr in ('0.0.0.0', '') else self.bind_addr}:{self.master_port}"
        text = (f"tensor-parallel rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not join "
                f"rank 0 at {where} within {self.rendezvous_timeout_s:g} s")
        if remote:
            return (text + f"; on each one's host run `nanovllm worker --master-addr {where.rsplit(':', 1)[0]} "
                    f"--master-port {self.master_port} --rank R --tensor-parallel-size {self.world_size}` (R = "
                    f"{', '.join(map(str, remote))}), or raise --tp-rendezvous-timeout")
        return text + " (workers this host started); the engine has stopped"

    def _admit(self, sock: socket.socket, peer: str) -> int | None:
        """One connection: the key check, the hello checked, the welcome sent; its rank, or None (dropped: not a
        worker, or silent past ``HANDSHAKE_TIMEOUT_S``).

        Raises:
            _Refused: another key, or a hello that cannot be right (the worker was told why first).
        """
        conn = _tune(sock)
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        try:
            nonce = os.urandom(_NONCE)
            conn.send_bytes(_MAGIC + nonce)
            reply = _recv_bytes_by(conn, deadline)
            if reply is None or not reply.startswith(_MAGIC) or len(reply) != len(_MAGIC) + 2 * _NONCE:
                conn.close()
                return None
            if not hmac.compare_digest(reply[len(_MAGIC):len(_MAGIC) + _NONCE], _digest(nonce)):
                conn.close()
                raise _Refused(f"a tensor-parallel worker from {peer} holds another key; set the same "
                               "NANOVLLM_TP_AUTHKEY on every host; the engine has stopped")
            conn.send_bytes(_digest(reply[len(_MAGIC) + _NONCE:]))
            msg = _recv_by(conn, deadline)
            if not (isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "hello" and isinstance(msg[1], dict)):
                conn.close()
                return None
        except (OSError, EOFError):
            conn.close()
            return None
        hello = msg[1]
        refusal = self._check_hello(hello, peer)
        if refusal is not None:
            with contextlib.suppress(Exception):
                conn.send(("refused", refusal))
            conn.close()
            raise _Refused(refusal)
        rank = hello["rank"]
        self._pid[rank] = hello.get("pid")
        if rank not in self.procs:
            self.where[rank] = f"pid {hello.get('pid')} on {hello.get('host')} ({peer})"
        conn.send(("welcome", self._welcome))
        self.conns[rank - 1] = conn
        return rank

    def _check_hello(self, hello: dict, peer: str) -> str | None:
        """Why this worker cannot join (one line: what to fix), or None."""
        rank, size, n, local = hello.get("rank"), hello.get("world_size"), self.world_size, self.local_ranks
        who = f"the tensor-parallel worker from {hello.get('host')} ({peer}, pid {hello.get('pid')})"
        if size != n:
            return (f"{who} was started with --tensor-parallel-size {size} but rank 0 runs {n}; start it with "
                    f"--tensor-parallel-size {n}")
        if not isinstance(rank, int) or not 1 <= rank < n:
            return f"{who} asked for rank {rank}, outside 1 to {n - 1}; give it a --rank in that range"
        if rank < local and not hello.get("local"):
            if local == n:
                return (f"{who} asked for rank {rank}, but rank 0 runs all {n} ranks on its own host; start rank 0 "
                        "with --tp-local-ranks K so that ranks K to N-1 join from other hosts")
            return (f"{who} asked for rank {rank}, which rank 0 runs on its own host (--tp-local-ranks {local}: "
                    f"ranks 0 to {local - 1}); give it a rank from {local} to {n - 1}")
        if self.conns[rank - 1] is not None:
            return f"{who} asked for rank {rank}, which {self.where[rank]} already holds; give each worker its own --rank"
        theirs = hello.get("model_config")
        if theirs is not None and theirs != self._model_config:
            diffs = _config_differences(theirs, self._model_config)
            return (f"{who} (rank {rank}) has another model than rank 0 ({'; '.join(diffs[:3]) or 'its config'}); "
                    "start it with rank 0's model as --model, or without --model to read rank 0's path")
        return None

    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(Exception):
                listener.close()

    # ------------------------------------------------------------------ talking to the workers

    def _send(self, msg: Any) -> None:
        self.check_alive()
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(msg)
            except (BrokenPipeError, OSError, EOFError):
                raise self._dead(rank, "closed its connection") from None

    def _dead(self, rank: int, what: str) -> TensorParallelError:
        p, conn = self.procs.get(rank), self.conns[rank - 1]
        state = what
        if p is not None:
            p.join(1.0)
            if p.exitcode is not None:
                state = f"exited with code {p.exitcode}"
        try:  # a worker that failed on its own said why before it exited
            while conn is not None and conn.poll(0):
                msg = conn.recv()
                if msg[0] == "error":
                    state = f"failed ({msg[1]}) and {state}"
        except (EOFError, OSError):
            pass
        return TensorParallelError(f"tensor-parallel worker rank {rank} ({self.where.get(rank, 'not joined')}) "
                                   f"{state}; the engine has stopped")

    def _gone(self, rank: int, strict: bool) -> TensorParallelError | None:
        """Rank ``rank``'s end if it has died, failed or closed its connection, else None; a message it sent
        unasked is an error when ``strict`` (between steps), else read and dropped (a step's late reply)."""
        p, conn = self.procs.get(rank), self.conns[rank - 1]
        if p is not None and not p.is_alive():
            return self._dead(rank, "died")
        if conn is None:
            return TensorParallelError(f"tensor-parallel rank {rank} never joined; the engine has stopped")
        try:
            if not conn.poll(0):
                return None
            msg = conn.recv()
        except (EOFError, OSError):
            return self._dead(rank, "closed its connection")
        if msg[0] == "error":
            return TensorParallelError(f"tensor-parallel worker rank {rank} ({self.where.get(rank)}) failed: "
                                       f"{msg[1]}; the engine has stopped")
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
                    raise self._dead(i + 1, "closed its connection") from None
                if msg[0] == "error":
                    raise TensorParallelError(f"tensor-parallel worker rank {i + 1} ({self.where.get(i + 1)}) failed: "
                                              f"{msg[1]}; the engine has stopped")
                if msg[0] != kind:
                    raise TensorParallelError(f"tensor-parallel worker rank {i + 1} answered {msg[0]!r} to "
                                              f"{kind!r}; the engine has stopped")
                replies[i] = msg[1]
                del pending[conn]
            for i in sorted(pending.values()):
                p = self.procs.get(i + 1)
                if p is not None and not p.is_alive():
                    raise self._dead(i + 1, "died")
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
        if progress is not None and self.local_ranks < self.world_size and self._thread.is_alive():
            first, last = self.local_ranks, self.world_size - 1
            ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
            progress(f"waiting for tensor-parallel {ranks} to join at {self.bind_addr}:{self.master_port}", 0, 1)
        while self._thread.is_alive():
            self._thread.join(0.2)
        if self._error is not None:
            raise TensorParallelError(self._error)
        if None in self.conns:
            raise TensorParallelError("the tensor-parallel rendezvous was stopped; restart the engine")
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
        deadline = time.monotonic() + 2.0  # a killed peer's exit is seen within moments
        reason = None
        while reason is None and time.monotonic() < deadline:
            for rank in range(1, self.world_size):
                reason = self._gone(rank, strict=False)
                if reason is not None:
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
        """Stop every worker (asked; a local one then terminated, then killed), wait for each to go, destroy this
        rank's group and close the listening port (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        self._close_listener()
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
