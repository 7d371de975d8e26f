"""Tensor parallelism's launch: how the ranks find rank 0, prove who they are, and agree on what they run.

Rank 0 is the master, as torchrun's ``env://`` rendezvous has it. It listens on
``master_addr:master_port`` (``--tp-master-addr``/``--tp-master-port``; 127.0.0.1 and a free
port when every rank is local). Every worker, the ones rank 0 starts on its own host and the
ones started with ``nanovllm worker`` on others, connects there (:func:`join_rank0`, retrying
until the rendezvous timeout, so workers may start before rank 0), proves it holds the same key
(an HMAC-SHA256 challenge each way over ``NANOVLLM_TP_AUTHKEY``, before anything is
unpickled), and says hello: its rank, its world size and, when it was given its own
``--model``, that model's config. Rank 0 (:class:`Rendezvous`) checks them (a rank out of range,
one it runs itself, a rank twice, another world size or another model is a one-line refusal
that both ends raise, naming what to fix) and answers with what every rank must share: the
model path, dtype, context length, device type, the collective timeout and the port of the
``torch.distributed`` rendezvous (a free port on rank 0's host). The connection then stays
open as that worker's control path (``engine/tensor_parallel.py``). A rank that has not joined
when the rendezvous timeout (``--tp-rendezvous-timeout``, 300 s) ends is a one-line error
naming the rank and the command that starts it.

Why ``--tp-local-ranks K`` (ranks 0..K-1 on rank 0's host) rather than torchrun's
``--nnodes``/``--node-rank``: rank 0's host also runs the scheduler and the sampler, and hosts
may hold different numbers of ranks, so one count on rank 0 and one ``--rank`` per worker
process (torchrun's ``RANK``: one per process) say where every rank runs without assuming
equal nodes. Trust: like torchrun's store, the connection is meant for a trusted network; the
key check keeps a stray or mistaken client out (set one ``NANOVLLM_TP_AUTHKEY`` on every
host), it does not encrypt.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

# RENDEZVOUS_TIMEOUT_S: how long rank 0 waits for every worker to connect, and a worker for rank 0 to
# listen (EngineConfig's default for tp_rendezvous_timeout, so it lives there)
from nanovllm_core.config import RENDEZVOUS_TIMEOUT_S, setting
# A connection must pass the key check within this (a port scanner or a silent client is dropped).
HANDSHAKE_TIMEOUT_S = 10.0
_MAGIC = b"nanovllm-tensor-parallel/1\n"  # the first bytes each way: a wrong port reads as one
_NONCE = 32


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died, hung, failed or could not join; the engine cannot continue (one-line message)."""


# A local worker that the spawn start method started re-imports the script that created the engine; a
# script without the ``if __name__ == "__main__":`` guard then creates a second engine inside the
# worker. The worker says so in one line and exits with this code, which rank 0 names as the cause.
MAIN_GUARD_EXIT = 3
MAIN_GUARD_FIX = 'put the code that creates LLM(tensor_parallel_size=N) under `if __name__ == "__main__":`'
MAIN_GUARD_WHY = ('the script has no `if __name__ == "__main__":` guard, so each worker process, which imports the '
                  "script again (the spawn start method), started an engine of its own")


def how_it_ended(exitcode: int | None) -> str:
    """A worker process's end in words: ``"was killed by SIGKILL"``, ``"exited with code 1"``, or, for
    :data:`MAIN_GUARD_EXIT`, the missing ``__main__`` guard and what to do."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    if exitcode == MAIN_GUARD_EXIT:
        return f"exited before it joined because {MAIN_GUARD_WHY}; {MAIN_GUARD_FIX}"
    return f"exited with code {exitcode}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` free right now (the OS picks it; several runs side by side get different ones)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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



# ----------------------------------------------------------------------------- a worker joins


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
    from nanovllm_core.model.loader import read_model_config, resolve_model

    resolved = resolve_model(model)
    return read_model_config(resolved), str(resolved.path)


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



# ----------------------------------------------------------------------------- rank 0 admits


class _Refused(Exception):
    """The rendezvous cannot complete (one line: what to fix)."""


def _config_differences(theirs, ours) -> list[str]:
    import dataclasses

    return [f"{f.name} {getattr(theirs, f.name)!r} vs {getattr(ours, f.name)!r}"
            for f in dataclasses.fields(ours) if getattr(theirs, f.name, None) != getattr(ours, f.name)]


class Rendezvous:
    """Rank 0's end of the launch: listen, then (a thread) admit each worker as it connects until every rank
    has joined, one was refused, a local worker died, or the time ran out.

    Args:
        world_size: N.
        local_ranks: ranks 0..local_ranks-1 run on rank 0's host (rank 0 starts them).
        master_addr: the address to listen on (None: 127.0.0.1; ``0.0.0.0``: every interface).
        master_port: the port (None: a free one).
        timeout_s: the rendezvous timeout (seconds).
        model_config: rank 0's ``ModelConfig`` (a worker with its own ``--model`` must match it).

    Raises:
        TensorParallelError: the address does not resolve or the port cannot be listened on (one line).
    """

    def __init__(self, world_size: int, local_ranks: int, master_addr: str | None, master_port: int | None,
                 timeout_s: float, model_config) -> None:
        self.world_size, self.local_ranks, self.rendezvous_timeout_s = world_size, local_ranks, timeout_s
        self.conns: list[Connection | None] = [None] * (world_size - 1)  # rank r's at r - 1, once admitted
        self.where: dict[int, str] = {}  # rank -> "pid 123" (a local worker) or "pid 123 on host (10.0.0.2)"
        self.pids: dict[int, int] = {}
        self.procs: dict[int, Any] = {}  # rank -> the local process rank 0 started (watched until it joins)
        self.welcome: dict = {}
        self.error: str | None = None
        self._model_config = model_config
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        bind = master_addr or "127.0.0.1"
        self.bind_addr = bind
        self.master_addr = "127.0.0.1" if bind in ("0.0.0.0", "") else bind  # where this host's ranks connect
        try:
            self._listener: socket.socket | None = socket.create_server((bind, master_port or 0),
                                                                        backlog=max(8, world_size))
        except socket.gaierror as e:
            raise TensorParallelError(f"{setting('tp_master_addr', bind)} does not resolve ({e.strerror}); give an address "
                                      "of this host") from None
        except OSError as e:
            raise TensorParallelError(f"cannot listen on {bind}:{master_port} for the tensor-parallel workers "
                                      f"({e.strerror}); choose another {setting('tp_master_port')}, or an address of this host "
                                      f"for {setting('tp_master_addr')}") from None
        self.master_port = self._listener.getsockname()[1]

    def start(self, welcome: dict, procs: dict[int, Any]) -> None:
        """Begin admitting workers (a daemon thread); ``welcome`` is what each gets, ``procs`` the local ones."""
        self.welcome, self.procs = welcome, procs
        self._deadline = time.monotonic() + self.rendezvous_timeout_s
        self._thread = threading.Thread(target=self._rendezvous, name="nanovllm-tp-rendezvous", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> list[Connection]:
        """Every worker's connection (rank order) once all have joined.

        Raises:
            TensorParallelError: a worker was refused, a local one exited, or a rank did not join in time.
        """
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.2)
        if self.error is not None:
            raise TensorParallelError(self.error)
        if self._thread is None or None in self.conns:
            raise TensorParallelError("the tensor-parallel rendezvous was stopped; restart the engine")
        return list(self.conns)

    def stop(self) -> None:
        """Stop admitting (a worker admitted meanwhile is told to stop) and close the listening port (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        self._close_listener()

    def _rendezvous(self) -> None:
        """Admit workers until every rank has joined, one was refused, a local one died, or the time ran out."""
        try:
            while not self._stop.is_set() and None in self.conns:
                for rank, p in self.procs.items():
                    if self.conns[rank - 1] is None and not p.is_alive():
                        raise _Refused(f"tensor-parallel worker rank {rank} (pid {p.pid}) {how_it_ended(p.exitcode)}"
                                       + ("" if p.exitcode == MAIN_GUARD_EXIT else " before it joined")
                                       + "; the engine has stopped")
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
            self.error = str(e)
        except Exception as e:  # noqa: BLE001 - the listener closed under it (shutdown) or the OS refused
            if not self._stop.is_set():
                self.error = f"the tensor-parallel rendezvous failed ({type(e).__name__}: {e}); the engine has stopped"
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
                    f"{', '.join(map(str, remote))}), or raise {setting('tp_rendezvous_timeout')}")
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
        self.pids[rank] = hello.get("pid")
        if rank not in self.procs:
            self.where[rank] = f"pid {hello.get('pid')} on {hello.get('host')} ({peer})"
        conn.send(("welcome", self.welcome))
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
                        "with tp_local_ranks=K (--tp-local-ranks K) so that ranks K to N-1 join from other hosts")
            return (f"{who} asked for rank {rank}, which rank 0 runs on its own host (ranks 0 to {local - 1}, "
                    f"{setting('tp_local_ranks', local)}); give it a rank from {local} to {n - 1}")
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
