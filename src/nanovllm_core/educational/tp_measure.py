"""How long one all-reduce takes on this machine: torch.distributed's gloo backend between
2-3 local processes, measured for the tensor-parallel chapter.

A tensor-parallel decode step runs ``2 * layers + 1`` all-reduces of a ``[1, hidden]`` tensor
(``educational/tp_facts.py``), so their latency, not their bytes, sets what one token spends
communicating. This measures it the way the engine would pay it: separate processes (one
thread each, as a rank of a split engine on this CPU), gloo over 127.0.0.1, one
``all_reduce`` (sum) of a ``[1, hidden]`` float32 tensor at a time, timed on rank 0.

Every rank is a child process, so the caller's process never joins a process group (an engine
in it keeps its own): forked from the caller on Linux when it runs one thread (torch is already
loaded there, so a rank starts in milliseconds), else a fresh interpreter that loads this file
alone (seconds: it imports torch). The rendezvous is a ``TCPStore`` the caller opens on a free
port (port 0: the OS picks; no port is guessed), and each rank destroys its process group
before it exits. Bounded in time: a rank still running at ``timeout_s`` is killed and the
measurement raises.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from nanovllm_core.native import cpu_name


def _rank(host: str, port: int, rank: int, world: int, hidden: int, iters: int, warmup: int,
          timeout: float) -> dict:
    """One rank: join the group through the caller's store, time ``iters`` all-reduces, leave the group.

    Returns ``{"rank", "times" (seconds, rank 0 only), "sum_ok", "destroyed"}``."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # 127.0.0.1 only, whatever the host name resolves to
    wait = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(host, port, world, is_master=False, timeout=wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=wait)
    x = torch.ones(1, hidden, dtype=torch.float32)
    for _ in range(warmup):
        dist.all_reduce(x)
    dist.barrier()
    times = []
    for _ in range(iters):
        x.fill_(1.0)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    ok = float(x[0, 0]) == float(world)  # the sum of one 1.0 from every rank
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "times": times if rank == 0 else [], "sum_ok": ok, "destroyed": not dist.is_initialized()}


def _forked_rank(conn, host: str, *args) -> None:
    """A forked rank: wait for the store's port through ``conn``, run :func:`_rank`, send back its result
    (or its error, in one line)."""
    try:
        port = conn.recv()
        conn.send(_rank(host, port, *args))
    except BaseException as e:  # noqa: BLE001 - the caller raises it as a RuntimeError
        first = (str(e).splitlines() or [""])[0]
        conn.send({"error": f"{type(e).__name__}: {first}"})
    finally:
        conn.close()


# A rank in a fresh interpreter (where forking is not safe): this file alone (stdlib at the top), not the package.
_FRESH = ("import importlib.util, json, sys\n"
          "spec = importlib.util.spec_from_file_location('_tp_rank', sys.argv[1])\n"
          "m = sys.modules['_tp_rank'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
          "a = sys.argv[2:]\n"
          "print(json.dumps(m._rank(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), int(a[5]), int(a[6]), "
          "float(a[7]))))\n")

@dataclass(frozen=True)
class AllReduceLatency:
    """One measurement: ``p50_us`` / ``p99_us`` microseconds per all-reduce over ``iters`` calls on rank 0.

    ``world_size`` processes; ``nbytes``: the tensor each rank contributed (``[1, hidden]``
    float32); ``backend``: ``"gloo"``; ``machine``: the CPU's name (timings on a shared machine
    are noisy: compare figures measured in the same run).
    """

    p50_us: float
    p99_us: float
    world_size: int
    iters: int
    hidden: int
    nbytes: int
    backend: str
    machine: str

    def per_token_us(self, allreduces: int) -> float:
        """``allreduces`` x the median: what one token's all-reduces cost at this latency (µs)."""
        return allreduces * self.p50_us


def _can_fork() -> bool:
    """Fork the ranks (no interpreter start, torch already loaded) only on Linux from a process with one
    thread: a fork copies only the calling thread, and a lock another thread held would never be released."""
    import threading

    return sys.platform.startswith("linux") and threading.active_count() == 1


def _store(world: int, timeout_s: float):
    """The rendezvous: a ``TCPStore`` server in this process on a port the OS picks (127.0.0.1 only)."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _timed_out(timeout_s: float, world_size: int) -> RuntimeError:
    return RuntimeError(f"the all-reduce measurement took longer than {timeout_s:.0f} s across {world_size} "
                        "processes; the machine may be too busy: try again")


def _run_forked(world: int, hidden: int, iters: int, warmup: int, timeout_s: float,
                deadline: float) -> list[dict]:
    """Fork the ranks first, then open the store and send them its port: no fork happens while the
    store's server thread runs."""
    import multiprocessing as mp

    import torch.distributed  # noqa: F401 - loaded once here, so the forked ranks start with it

    ctx = mp.get_context("fork")
    pipes, procs = [], []
    store = None
    try:
        for rank in range(world):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_forked_rank, args=(theirs, "127.0.0.1", rank, world, hidden, iters, warmup,
                                                       timeout_s), daemon=True)
            p.start()
            theirs.close()
            pipes.append(mine)
            procs.append(p)
        store = _store(world, timeout_s)
        for mine in pipes:
            mine.send(store.port)
        results = []
        for rank, mine in enumerate(pipes):
            if not mine.poll(max(0.0, deadline - time.monotonic())):
                raise _timed_out(timeout_s, world)
            try:
                got = mine.recv()
            except EOFError:
                got = {"error": "it exited without a result"}
            results.append({"rank": rank, **got})
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        return results
    finally:
        for p in procs:  # only the ranks this call started
            if p.is_alive():
                p.kill()
                p.join()
        for mine in pipes:
            mine.close()
        del store


def _run_fresh(world: int, hidden: int, iters: int, warmup: int, timeout_s: float, deadline: float) -> list[dict]:
    store = _store(world, timeout_s)
    try:
        return _run_fresh_ranks(("127.0.0.1", store.port), world, hidden, iters, warmup, timeout_s, deadline)
    finally:
        del store


def _run_fresh_ranks(args: tuple, world: int, hidden: int, iters: int, warmup: int, timeout_s: float,
                     deadline: float) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _FRESH, __file__, *map(str, (*args, rank, world, hidden, iters,
                                                                                    warmup, timeout_s))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(world)]
    results = []
    try:
        for rank, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise _timed_out(timeout_s, world) from None
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if p.returncode != 0 or not lines:
                last = (err.strip().splitlines() or ["no output"])[-1]
                results.append({"rank": rank, "error": f"exit {p.returncode}: {last}"})
            else:
                results.append({"rank": rank, **json.loads(lines[-1])})
        return results
    finally:
        for p in procs:  # only the ranks this call started
            if p.poll() is None:
                p.kill()
                p.wait()


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by the nearest-rank rule.

    Raises:
        ValueError: no values, or ``q`` outside 0..100.
    """
    if not values or not 0 <= q <= 100:
        raise ValueError(f"percentile needs values and 0 <= q <= 100, got {len(values)} values and q={q}")
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))] if q else ordered[0]


def measure_allreduce(world_size: int = 2, hidden: int = 576, iters: int = 200, warmup: int = 20,
                      timeout_s: float = 60.0) -> AllReduceLatency:
    """Time ``iters`` all-reduces of a ``[1, hidden]`` float32 tensor across ``world_size`` local processes.

    Args:
        world_size: ranks, 2-8 (one process each, one thread each).
        hidden: the tensor's width (SmolLM2: 576).
        iters, warmup: timed and untimed calls (iters >= 1, warmup >= 0).
        timeout_s: the whole measurement's limit, process start included.

    Returns:
        the p50/p99 latency on rank 0, in microseconds.

    Raises:
        ValueError: a size or count out of range.
        RuntimeError: a rank failed, timed out (it is killed), or the sum came out wrong (one line, the
            rank's last error line included).
    """
    if not 2 <= world_size <= 8 or hidden < 1 or iters < 1 or warmup < 0 or timeout_s <= 0:
        raise ValueError(f"measure_allreduce needs 2 <= world_size <= 8, hidden >= 1, iters >= 1, warmup >= 0 and "
                         f"timeout_s > 0; got {world_size}, {hidden}, {iters}, {warmup}, {timeout_s}")
    deadline = time.monotonic() + timeout_s
    run = _run_forked if _can_fork() else _run_fresh
    results = run(world_size, hidden, iters, warmup, timeout_s, deadline)
    for r in results:
        if "error" in r:
            raise RuntimeError(f"all-reduce rank {r['rank']} failed: {r['error']}")
    if not all(r["sum_ok"] and r["destroyed"] for r in results):
        raise RuntimeError("the all-reduce measurement gave a wrong sum or left a process group: see tp_measure.py")
    times = [t * 1e6 for t in results[0]["times"]]
    return AllReduceLatency(p50_us=statistics.median(times), p99_us=percentile(times, 99), world_size=world_size,
                            iters=iters, hidden=hidden, nbytes=hidden * 4, backend="gloo", machine=cpu_name())
