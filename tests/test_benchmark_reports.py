"""Every benchmark warns when its speed figures were taken on a busy host (``benchmarks.common``).

A shared machine can make one round of one system much slower than the others (a neighbour's
job), or keep the CPU loaded throughout; the medians then describe the host, not the code.
"""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

import pytest

import benchmarks
from benchmarks.benchmark_quantization import MAX_ROUND_SPREAD, noise_warnings
from benchmarks.common import busy_host_warnings


def summary(b1_rounds, wl_rounds, load_end, cores=2):
    return {"batch1_decode": {"all_rounds": b1_rounds}, "workload": {"all_rounds": wl_rounds},
            "machine": {"load_average_at_end": load_end, "cpu_count": cores}}


def test_steady_rounds_on_a_quiet_host_give_no_warning():
    s = summary({"float32": [24.4, 22.0, 23.0], "int8": [34.4, 32.0, 33.0]},
                {"float32": [191.7, 186.3, 188.6]}, [2.0, 1.9, 1.7])
    assert noise_warnings(s) == []


def test_rounds_that_disagree_are_named_with_their_range():
    s = summary({"int8": [35.0, 43.8, 36.3]}, {"float32": [180.2, 214.2, 196.8]}, [1.8, 1.8, 1.6])
    warnings = noise_warnings(s)
    assert len(warnings) == 2
    assert warnings[0].startswith("warning: int8 batch-1 decode rounds range 35.0-43.8 tok/s (1.25x)")
    assert warnings[1].startswith("warning: float32 workload rounds range 180.2-214.2 tok/s (1.19x)")


def test_the_spread_limit_itself_and_a_single_round_do_not_warn():
    s = summary({"float32": [100.0, 100.0 * MAX_ROUND_SPREAD]}, {"float32": [50.0]}, [1.0, 1.0, 1.0])
    assert noise_warnings(s) == []


def test_a_loaded_cpu_at_the_end_is_reported_per_core():
    assert noise_warnings(summary({}, {}, [4.8, 3.0, 2.0])) == [
        "warning: load average 4.8 on 2 cores at the end: other work shared the CPU, so the speed figures are "
        "not this code's alone; run again on a quiet machine"]
    assert noise_warnings(summary({}, {}, [4.8, 3.0, 2.0], cores=8)) == []  # 0.6 per core
    assert noise_warnings(summary({}, {}, None)) == []  # no load average on this platform


def test_load_at_the_start_counts_too_and_both_ends_make_one_line():
    assert busy_host_warnings(None, [4.0, 1, 1], [0.5, 1, 1], cores=2) == [
        "warning: load average 4.0 on 2 cores at the start: other work shared the CPU, so the speed figures are "
        "not this code's alone; run again on a quiet machine"]
    both = busy_host_warnings({"ours": [10.0, 10.5]}, [4.0, 1, 1], [5.5, 1, 1], cores=2)
    assert len(both) == 1 and both[0].startswith("warning: load average 4.0 at the start and 5.5 at the end on 2 cores")


BENCHMARKS = sorted(p.stem for p in Path(benchmarks.__file__).parent.glob("benchmark_*.py"))


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_checks_the_host(name):
    """Each benchmark's main makes a HostCheck and reports it (benchmark_quantization through noise_warnings)."""
    source = inspect.getsource(importlib.import_module(f"benchmarks.{name}"))
    assert ("HostCheck()" in source and "host.report(" in source) or "noise_warnings(s)" in source, name


def test_a_benchmark_run_on_a_busy_host_says_so(monkeypatch, capsys):
    from benchmarks import benchmark_scheduler_unit, common

    monkeypatch.setattr(common, "load_average", lambda: [9.0, 9.0, 9.0])
    result = benchmark_scheduler_unit.main(["--quick"])
    out = capsys.readouterr().out
    warning = f"warning: load average 9.0 at the start and 9.0 at the end on {os.cpu_count()} cores"
    if 9.0 > common.MAX_LOAD_PER_CORE * (os.cpu_count() or 1):
        assert out.strip().splitlines()[-1].startswith(warning) and result["host_warnings"], out
    else:  # a host with many cores: 9 is not busy there
        assert "warning: load average" not in out
