"""The benchmark programs' quick modes run end to end and produce every figure, well-formed.

Speed is never asserted here: the figures must exist, be finite and positive where they are
rates or times, and keep the JSON shape the README documents. The experiments must also
exercise what they claim to measure (the small pool does preempt, the cache does hit).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from benchmarks import (
    benchmark_advanced_scheduling,
    benchmark_comparison,
    benchmark_events,
    benchmark_quantization,
    benchmark_scheduler_unit,
    benchmark_serving,
)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_comparison_quick_writes_the_documented_json(tmp_path):
    path = tmp_path / "cmp.json"
    benchmark_comparison.main(["--quick", "--systems", "ours,hf-padded", "--json", str(path)])
    data = json.loads(path.read_text())
    assert set(data) >= {"workload", "systems", "gemm_peak_flops", "roofline_fraction", "speedup_vs_best_hf"}
    assert set(data["systems"]) == {"ours", "hf-padded"}
    for name, s in data["systems"].items():
        for key in ("useful_tokens_per_s", "ttft_p50_s", "tpot_p50_s", "peak_rss_bytes", "roofline_fraction"):
            assert positive(s[key]), (name, key, s[key])
        assert s["ttft_p50_s"] <= s["ttft_p99_s"]
    w = data["workload"]
    assert w["num_requests"] == 4 and w["total_output_tokens"] > 0
    assert positive(data["gemm_peak_flops"]) and positive(data["speedup_vs_best_hf"])
    assert data["roofline_fraction"] == data["systems"]["ours"]["roofline_fraction"]
    assert 0.0 <= data["systems"]["hf-padded"]["same_tokens_as_ours"] <= 1.0


def test_comparison_rejects_an_unknown_system(capsys):
    with pytest.raises(SystemExit) as e:
        benchmark_comparison.main(["--quick", "--systems", "ours,vllm"])
    assert e.value.code == 2
    assert "unknown system(s) vllm" in capsys.readouterr().err


def test_comparison_rejects_a_system_listed_twice(capsys):
    with pytest.raises(SystemExit) as e:
        benchmark_comparison.main(["--quick", "--systems", "ours,ours-int8,ours"])
    assert e.value.code == 2
    assert "listed more than once: ours" in capsys.readouterr().err


def test_quantization_quick_measures_quality_bytes_and_speed_of_both_modes(tmp_path):
    path = tmp_path / "quant.json"
    benchmark_quantization.main(["--quick", "--skip-hf", "--gather-ab", "--json", str(path)])
    data = json.loads(path.read_text())
    q = data["quality"]
    assert all(positive(q["perplexity"][m]) for m in ("float32", "int8"))
    assert abs(q["perplexity_change"]) < 0.2  # int8 is close to float32, not broken
    assert 0.0 <= q["greedy_agreement_until_first_difference"] <= 1.0
    assert data["linear_weight_bytes"]["float32"] > 3.2 * data["linear_weight_bytes"]["int8"]  # int8 + scales + outlier columns
    for section in ("batch1_decode", "workload"):
        rates = data[section]["tokens_per_s" if section == "batch1_decode" else "useful_tokens_per_s"]
        assert set(rates) >= {"float32", "int8"} and all(positive(v) for v in rates.values())
        assert positive(data[section]["int8_over_float32"])
    assert 0 < data["workload"]["float32_roofline_fraction"] < 1
    assert data["int8_weight_range"] in (63, 127)
    # the A/B against the gather path ran both modes that way too (the env switch restored afterwards)
    assert set(data["batch1_decode"]["tokens_per_s"]) >= {"float32 gather", "int8 gather"}
    assert all(positive(r["workload"]) and positive(r["batch1_decode"]) for r in data["cpu_paged_over_gather"].values())
    assert "NANOVLLM_CPU_PAGED_ATTENTION" not in os.environ
    # llama.cpp joins the batch-1 figures exactly where llama-cpp-python is installed
    import importlib.util

    has_llamacpp = importlib.util.find_spec("llama_cpp") is not None
    assert ("llama.cpp" in data["batch1_decode"]["tokens_per_s"]) is has_llamacpp
    assert (data["batch1_decode"]["int8_over_llamacpp"] is not None) is has_llamacpp
    if has_llamacpp:
        assert positive(data["batch1_decode"]["int8_over_llamacpp"])
        assert data["llamacpp"]["threads"] == data["machine"]["torch_threads"]  # the same threads as ours


def test_comparison_llamacpp_without_the_package_is_one_line(capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a))
    with pytest.raises(SystemExit) as e:
        benchmark_comparison.main(["--quick", "--systems", "ours,llamacpp"])
    assert e.value.code == 2
    assert "system llamacpp needs llama-cpp-python" in capsys.readouterr().err


def test_advanced_scheduling_quick_exercises_every_feature(tmp_path):
    path = tmp_path / "sched.json"
    benchmark_advanced_scheduling.main(["--all", "--quick", "--json", str(path)])
    data = json.loads(path.read_text())
    for policy in ("priority", "fcfs"):
        assert positive(data["priority"][policy]["ttft_high_p50_s"])
    assert data["priority"]["priority"]["num_preemptions"] > 0  # the urgent requests did preempt
    small = data["preemption"]["pool holds ~1/3"]
    assert small["num_preemptions"] > 0 and small["tokens_recomputed"] > 0
    assert data["preemption"]["pool holds all"]["num_preemptions"] == 0
    for mode in ("chunked", "one piece"):
        assert positive(data["chunked_prefill"][mode]["decode_stall_max_s"])
    assert data["chunked_prefill"]["chunked"]["token_budget"] < data["chunked_prefill"]["one piece"]["token_budget"]
    assert data["prefix_caching"]["on"]["hit_rate"] > 0 and data["prefix_caching"]["off"]["hit_rate"] == 0


def test_advanced_scheduling_needs_a_feature(capsys):
    with pytest.raises(SystemExit) as e:
        benchmark_advanced_scheduling.main(["--quick"])
    assert e.value.code == 2
    assert "choose --all" in capsys.readouterr().err


def test_scheduler_unit_quick_measures_steps_and_step_cost(tmp_path):
    path = tmp_path / "unit.json"
    benchmark_scheduler_unit.main(["--quick", "--json", str(path)])
    data = json.loads(path.read_text())
    assert [q["num_requests"] for q in data["queue"]] == [10, 100]
    for q in data["queue"]:
        assert q["steps"] > 0 and positive(q["steps_per_s"])
    assert [c["running"] for c in data["step_cost_vs_running"]] == [1, 8, 64]
    assert all(positive(c["step_mean_s"]) for c in data["step_cost_vs_running"])


def test_events_quick_measures_every_subscriber_level(tmp_path):
    path = tmp_path / "events.json"
    benchmark_events.main(["--quick", "--json", str(path)])
    data = json.loads(path.read_text())
    assert set(data["tokens_per_s"]) == {"none", "minimal", "full", "xray"}
    assert all(positive(v) for v in data["tokens_per_s"].values())
    assert all(positive(v) for v in data["median_tokens_per_s"].values())
    assert data["relative_to_none"]["none"] == 1.0


@pytest.mark.parametrize("module, argv, message", [
    (benchmark_events, ["--requests", "0"], "argument --requests: expected a positive integer, got 0"),
    (benchmark_events, ["--quick", "--repeats", "x"], "argument --repeats: expected a positive integer, got 'x'"),
    (benchmark_events, ["--quick", "--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json: cannot write"),
    (benchmark_comparison, ["--quick", "--json", "/nonexistent-dir/x.json"], "cannot write there"),
    (benchmark_comparison, ["--quick", "--hf-max-batch-tokens", "-1"], "--hf-max-batch-tokens must be at least 1"),
    (benchmark_scheduler_unit, ["--quick", "--json", "/nonexistent-dir/x.json"], "cannot write there"),
    (benchmark_quantization, ["--quick", "--rounds", "0"], "argument --rounds: expected a positive integer, got 0"),
    (benchmark_quantization, ["--quick", "--json", "/nonexistent-dir/x.json"], "cannot write there"),
    (benchmark_advanced_scheduling, ["--all", "--quick", "--json", "/"], "cannot write there"),
])
def test_bad_arguments_end_before_the_run_with_one_line(capsys, module, argv, message):
    with pytest.raises(SystemExit) as e:
        module.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_serving_quick_measures_the_server_against_offline(tmp_path, tiny_llama_dir):
    path = tmp_path / "serving.json"
    benchmark_serving.main(["--quick", "--model", str(tiny_llama_dir), "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["workload"]["num_requests"] == 6 and data["request_rate"] is None  # all at once
    for system in ("serving", "offline"):
        for key in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
            assert positive(data[system][key]), (system, key, data[system][key])
        assert data[system]["ttft_p50_s"] <= data[system]["ttft_p99_s"]
    assert data["ratio"] == pytest.approx(data["serving"]["output_tokens_per_s"] / data["offline"]["output_tokens_per_s"])


@pytest.mark.parametrize("rate", ["0", "-1", "fast"])
def test_serving_rejects_a_bad_rate(rate, capsys):
    with pytest.raises(SystemExit) as e:
        benchmark_serving.main(["--quick", "--request-rate", rate])
    assert e.value.code == 2 and "--request-rate" in capsys.readouterr().err
