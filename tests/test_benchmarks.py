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
    benchmark_speculative,
    benchmark_tensor_parallel,
    benchmark_tui,
)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_comparison_quick_writes_the_documented_json(tmp_path, shared_default_loads):
    # ours' LLM(quantization="none") gets the session's float32 model (``shared_default_loads``) instead of
    # reading and building the weights again; hf-padded still loads transformers' own model
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
    assert shared_default_loads == ["none"]  # ours ran on the float32 model, as the benchmark asks


def test_comparison_rejects_an_unknown_system(capsys):
    with pytest.raises(SystemExit) as e:
        benchmark_comparison.main(["--quick", "--systems", "ours,vllm"])
    assert e.value.code == 2
    assert "unknown system(s) vllm" in capsys.readouterr().err


def test_comparison_rejects_a_system_listed_twice(capsys):
    with pytest.raises(SystemExit) as e:
        benchmark_comparison.main(["--quick", "--systems", "ours,ours-gguf,ours"])
    assert e.value.code == 2
    assert "listed more than once: ours" in capsys.readouterr().err


def test_quantization_quick_measures_every_figure_of_each_mode(tmp_path, capsys):
    from pathlib import Path

    path = tmp_path / "quant.json"
    held_out = Path(__file__).resolve().parents[1] / "README.md"  # any English text the model was not tuned on
    benchmark_quantization.main(["--quick", "--modes", "float32,gguf", "--skip-hf", "--gather-ab",
                                 "--held-out", str(held_out), "--json", str(path)])
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    modes = ("float32", "gguf")
    assert data["modes"] == list(modes)
    # memory: the weights as built, what a token reads, the resident growth of each load
    mem = data["memory"]
    assert set(mem["float32"]["weight_formats"]) == {"float32"}
    assert set(mem["gguf"]["weight_formats"]) == {"q4_1", "q8_0"}  # the file's own blocks, embedding in Q8_0
    assert mem["float32"]["weight_bytes"] > 5 * mem["gguf"]["weight_bytes"]
    for m in modes:
        assert data["linear_weight_bytes"][m] == mem[m]["linear_weight_bytes"] > 0
        if mem[m]["rss_growth_bytes"] is not None:  # Linux
            assert mem[m]["rss_growth_bytes"] > 0.5 * mem[m]["weight_bytes"]
            assert mem[m]["load_peak_rss_growth_bytes"] >= mem[m]["rss_growth_bytes"] - 2**20
    # the bandwidth: measured once, the best of its samples, used for every mode's share
    bw = data["memory_bandwidth"]
    assert len(bw["samples"]) == 3 and bw["bytes_per_s"] == max(bw["samples"]) and positive(bw["bytes_per_s"])
    b1 = data["batch1_decode"]
    for m in modes:
        assert positive(b1["tokens_per_s"][m]) and positive(data["workload"]["useful_tokens_per_s"][m])
        assert b1["bandwidth_share"][m] == pytest.approx(
            data["linear_weight_bytes"][m] * b1["tokens_per_s"][m] / bw["bytes_per_s"])
        assert positive(b1["over_float32"][m]) and positive(data["workload"]["over_float32"][m])
    assert b1["over_float32"]["float32"] == 1.0 and data["workload"]["over_float32"]["float32"] == 1.0
    assert b1["q8_0_over_float32"] is None  # q8_0 was not among --modes
    assert 0 < data["workload"]["float32_roofline_fraction"] < 1
    # quality: both texts, every mode against float32
    q = data["quality"]
    assert set(q["texts"]) == {"corpus", "held-out"} and q["held_out_note"] is None
    for name, t in q["texts"].items():
        assert all(positive(t["perplexity"][m]) for m in modes)
        assert t["perplexity_change"]["float32"] == 0.0
        assert abs(t["perplexity_change"]["gguf"]) < 0.05  # the file's blocks are float32's weights: not broken
        assert t["greedy_agreement_until_first_difference"]["float32"] == 1.0
        assert 0.0 <= t["greedy_agreement_until_first_difference"]["gguf"] <= 1.0
    # the A/B against the gather path ran every mode that way too (the env switch restored afterwards)
    assert set(b1["tokens_per_s"]) >= {"float32 gather", "gguf gather"}
    assert all(positive(r["workload"]) and positive(r["batch1_decode"]) for r in data["cpu_paged_over_gather"].values())
    assert "NANOVLLM_CPU_PAGED_ATTENTION" not in os.environ
    # llama.cpp joins the batch-1 figures exactly where llama-cpp-python is installed
    import importlib.util

    has_llamacpp = importlib.util.find_spec("llama_cpp") is not None
    assert ("llama.cpp" in b1["tokens_per_s"]) is has_llamacpp
    assert (b1["gguf_over_llamacpp"] is not None) is has_llamacpp
    if has_llamacpp:
        assert b1["gguf_over_llamacpp"] == b1["over_llamacpp"]["gguf"] and positive(b1["gguf_over_llamacpp"])
        assert positive(b1["bandwidth_share"]["llama.cpp"])  # credited with gguf's bytes: the same blocks
        assert data["llamacpp"]["threads"] == data["machine"]["torch_threads"]  # the same threads as ours
        assert "gguf / llama.cpp = " in out
    # the report names the CPU beside the figures, and the host check ran
    assert data["machine"]["cpu"] in out and "memory read bandwidth:" in out
    assert isinstance(data["host_warnings"], list)
    assert all(w in out for w in data["host_warnings"])


def test_comparison_llamacpp_without_the_package_is_one_line(capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a))
    with pytest.raises(SystemExit) as e:
        benchmark_comparison.main(["--quick", "--systems", "ours,llamacpp"])
    assert e.value.code == 2
    assert "system llamacpp needs llama-cpp-python" in capsys.readouterr().err


def test_advanced_scheduling_quick_exercises_every_feature(tmp_path, shared_default_loads):
    # the benchmark's one load of the default model gets the session's model of the same mode (``shared_default_loads``)
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
    assert shared_default_loads == [None]  # one load, the default (auto) mode, as the benchmark asks


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
    assert set(data["tokens_per_s"]) == {"none", "minimal", "full", "xray", "xray_all"}
    assert all(positive(v) for v in data["tokens_per_s"].values())
    assert all(positive(v) for v in data["median_tokens_per_s"].values())
    assert data["relative_to_none"]["none"] == 1.0


@pytest.mark.parametrize("module, argv, message", [
    (benchmark_events, ["--requests", "0"], "argument --requests: expected a positive integer, got 0"),
    (benchmark_events, ["--quick", "--repeats", "x"], "argument --repeats: expected a positive integer, got 'x'"),
    (benchmark_events, ["--quick", "--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json: the folder /nonexistent-dir does not exist"),
    (benchmark_comparison, ["--quick", "--json", "/nonexistent-dir/x.json"], "the folder /nonexistent-dir does not exist"),
    (benchmark_comparison, ["--quick", "--hf-max-batch-tokens", "-1"], "--hf-max-batch-tokens must be at least 1"),
    (benchmark_scheduler_unit, ["--quick", "--json", "/nonexistent-dir/x.json"], "the folder /nonexistent-dir does not exist"),
    (benchmark_quantization, ["--quick", "--rounds", "0"], "argument --rounds: expected a positive integer, got 0"),
    (benchmark_quantization, ["--quick", "--json", "/nonexistent-dir/x.json"], "the folder /nonexistent-dir does not exist"),
    (benchmark_quantization, ["--quick", "--modes", "gguf,q4_0"], "float32 must be one of the modes"),
    (benchmark_quantization, ["--quick", "--modes", "float32,fp8"], "unknown mode(s) fp8; use float32, gguf"),
    (benchmark_quantization, ["--quick", "--modes", "float32,gguf,float32"], "a mode is listed more than once"),
    # every benchmark's --json is checked before its run (trial 16e: these three wrote only at the end)
    (benchmark_speculative, ["--quick", "--json", "/nonexistent-dir/x.json"], "the folder /nonexistent-dir does not"),
    (benchmark_tensor_parallel, ["--quick", "--json", "/nonexistent-dir/x.json"], "the folder /nonexistent-dir does"),
    (benchmark_tui, ["--json", "/nonexistent-dir/x.json"], "the folder /nonexistent-dir does not exist"),
    (benchmark_advanced_scheduling, ["--all", "--quick", "--json", "/"], "--json / is a folder; give a file name in it"),
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


def test_tensor_parallel_runs_float_weights_at_every_size_n_1_included(monkeypatch):
    """Trial 14e: N = 1 took the default (the GGUF file's Q4_1 blocks on the CPU) while N > 1 runs float
    weights, so "vs N=1" compared weight formats; every N must ask for the same (float) weights."""
    import nanovllm_core

    asked = []

    class Stop(Exception):
        pass

    def spy(model, **kw):
        asked.append((kw["tensor_parallel_size"], kw.get("quantization")))
        raise Stop

    monkeypatch.setattr(nanovllm_core, "LLM", spy)
    for n in (1, 3):
        with pytest.raises(Stop):
            benchmark_tensor_parallel.measure(None, n, ["Hi"], 1)
    assert asked == [(1, "none"), (3, "none")]


def test_tensor_parallel_quick_figures_agree_with_each_other_and_with_the_split(tmp_path, tiny_llama_dir, capsys):
    """N = 1 and 2 on the tiny LLaMA (4 query / 2 KV heads, 2 layers): every figure derives from the ones it
    says it does (share = comm / forward, comm per token, tokens/s), the counts are the split's (2 x layers + 1
    all-reduces of [tokens, hidden] float32 a step), p50 <= p99, and StepTimed carried the measured numbers."""
    from nanovllm_core.config import ModelConfig
    from nanovllm_core.model.loader import load_hf_config

    path = tmp_path / "tp.json"
    rows = benchmark_tensor_parallel.main(["--quick", "--model", str(tiny_llama_dir), "--sizes", "1,2",
                                           "--max-tokens", "3", "--json", str(path)])
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data == [dict(vars(r)) for r in rows]  # the JSON holds the rows the table shows
    cfg = ModelConfig.from_hf(load_hf_config(tiny_llama_dir))
    per_step = 2 * cfg.num_hidden_layers + 1
    one, two = data
    assert [one["tp_size"], two["tp_size"]] == [1, 2]
    for r in data:
        assert r["output_tokens"] == 2 * 3  # --quick: 2 prompts, 3 tokens each (ignore_eos)
        assert r["tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["steps"] >= 3 and r["batch_tokens"] >= r["output_tokens"] and r["events_agree"] is True
    # one process: no collectives, nothing to share
    assert one["comm_s_rank0"] == one["all_reduces"] == one["all_reduce_bytes"] == 0
    assert one["p50_all_reduce_s"] is None and one["p99_all_reduce_s"] is None
    # two ranks: the split's counts, and each derived figure from the figures it derives from
    assert two["all_reduces"] == per_step * two["steps"]
    assert two["all_reduce_bytes"] == per_step * two["batch_tokens"] * cfg.hidden_size * 4
    assert 0 < two["comm_s_rank0"] <= two["forward_s_rank0"] and two["comm_s_rank0"] <= two["comm_s_max_rank"]
    assert two["comm_share"] == pytest.approx(two["comm_s_rank0"] / two["forward_s_rank0"])
    assert two["comm_per_token_s"] == pytest.approx(two["comm_s_rank0"] / two["output_tokens"])
    assert 0 < two["p50_all_reduce_s"] <= two["p99_all_reduce_s"] <= two["comm_s_rank0"]
    assert "StepTimed = measured" in out and " NO" not in out
    # trial 14e: N = 1 ran the default model's Q4_1 blocks and N = 3 float32, so "vs N=1" compared formats
    assert all(r["weight_format"].startswith("float32 ") for r in data), [r["weight_format"] for r in data]
    assert "float weights at every N" in out and f"N=1 {one['weight_format']}" in out
    assert f"{two['comm_share']:.0%}" in out and "vs N=1" in out


def test_the_quantization_benchmarks_default_held_out_text_ships_with_the_repository():
    """Trial 12e: the default was ../shared/seed/original-readme.txt beside the repository, absent
    from a clone, so `--quick` measured no held-out column there."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    held_out = benchmark_quantization.parse_args(["--quick"]).held_out.resolve()
    assert held_out.is_file() and root in held_out.parents, held_out


def test_the_speculative_tables_legend_names_every_rate_column(capsys):
    """Trial 44a: the legend explained len, E(alpha), steps and same, but not how "acc rate" and "alpha" differ."""
    from benchmarks.benchmark_speculative import print_table

    print_table([])
    out = capsys.readouterr().out
    header, legend = out.splitlines()[0], " ".join(out.splitlines()[1:])
    for column in ("acc rate", "alpha", "len", "E(alpha)", "steps", "same"):
        assert column in header and f"{column}:" in legend, column
