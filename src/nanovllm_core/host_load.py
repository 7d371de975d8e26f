"""Was the host busy while something was timed? One note, the same in every benchmark and timing CLI.

A timing on a shared machine is the host's as much as the code's when other work wants the cores:
the 1-minute load average (runnable threads) above the number of cores means some thread waited
for a CPU. At the end the load holds the run's own threads, which are taken out before it is judged. Every benchmark (``benchmarks/``, through ``benchmarks.common.HostCheck``)
and the speculative CLI read the load when they start and when they end, and print
:func:`busy_host_note`'s line when either exceeds the cores (trial 29d: the speculative CLI warned at
a load of 3.0 on 2 cores, benchmark_comparison, with its own limit of 1.5 per core, said nothing in
the same minute).

Nothing heavy is imported here (no torch): the helper is for any program that times something.
"""

from __future__ import annotations

import os

BUSY_LOAD_PER_CORE = 1.0  # a 1-minute load average above this many runnable threads per core: busy
# At the end the load holds the run's own threads too: with those taken out, other work above this many
# threads per core shared the CPU (a quiet 2-core host running 2 torch threads reads about 2.0 at the end,
# which is not "busy"; two burners beside it read about 4.0)
BUSY_OTHERS_PER_CORE = 0.5


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages, rounded to 0.01 (None on a platform without them)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def own_threads() -> int:
    """The compute threads this process runs at once: torch's intra-op threads once torch is imported, else 1."""
    import sys

    torch = sys.modules.get("torch")
    try:
        return max(1, int(torch.get_num_threads())) if torch is not None else 1
    except Exception:  # a half-imported or stubbed torch: count the main thread
        return 1


def busy_host_note(load_at_start: list[float] | None, load_at_end: list[float] | None,
                   cores: int | None = None, own: int = 0) -> str | None:
    """The line saying the host was busy, or None when it was not (or no load average is known).

    Args:
        load_at_start, load_at_end: :func:`load_average` before and after the timed work (None: not
            known); a 1-minute figure above :data:`BUSY_LOAD_PER_CORE` x ``cores`` at the start, or at
            the end, less the run's ``own`` threads, above :data:`BUSY_OTHERS_PER_CORE` x ``cores``, is busy.
        cores: the CPU's cores (default ``os.cpu_count()``).
        own: the threads the timed run itself kept busy (:func:`own_threads`), named in the note.

    Returns:
        e.g. ``"warning: the host was busy (load average 3.3 on 2 cores at the end): other work shared
        the CPU, so the timings and every ratio of them are not this code's alone; run again on a
        quiet machine"``.
    """
    cores = cores or os.cpu_count() or 1
    busy = [("start", load_at_start[0])] if load_at_start and load_at_start[0] > BUSY_LOAD_PER_CORE * cores else []
    if load_at_end and load_at_end[0] - own > BUSY_OTHERS_PER_CORE * cores:
        busy.append(("end", load_at_end[0]))
    if not busy:
        return None
    on = f"{cores} core{'' if cores == 1 else 's'}"
    where = (f"{busy[0][1]:.1f} on {on} at the {busy[0][0]}" if len(busy) == 1 else
             f"{busy[0][1]:.1f} at the start and {busy[1][1]:.1f} at the end on {on}")
    if own and busy[-1][0] == "end":
        where += f", {own} of it this run's own thread{'' if own == 1 else 's'}"
    return (f"warning: the host was busy (load average {where}): other work shared the CPU, so the timings and "
            "every ratio of them are not this code's alone; run again on a quiet machine")


class HostCheck:
    """Make one before timing anything (it reads the load), call :meth:`note` at the end: the busy-host
    line for the whole run (:func:`busy_host_note`), or None."""

    def __init__(self) -> None:
        self.load_at_start = load_average()
        self.load_at_end: list[float] | None = None

    def note(self) -> str | None:
        self.load_at_end = load_average()
        return busy_host_note(self.load_at_start, self.load_at_end, os.cpu_count(), own_threads())
