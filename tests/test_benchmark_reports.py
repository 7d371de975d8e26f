"""The quantization benchmark warns when its speed figures were taken on a busy host.

A shared machine can make one round of one system much slower than the others (a neighbour's
job), or keep the CPU loaded throughout; the medians then describe the host, not the code.
"""

from __future__ import annotations

from benchmarks.benchmark_quantization import MAX_ROUND_SPREAD, noise_warnings


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
