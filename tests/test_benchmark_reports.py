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


@pytest.fixture(autouse=True)
def no_own_threads(monkeypatch):
    """The busy-host notes here judge faked loads as other work alone: the run's own threads (taken out
    of the load at the end, host_load.own_threads) count 0 unless a test says otherwise."""
    from nanovllm_core import host_load

    monkeypatch.setattr(host_load, "own_threads", lambda: 0)


def summary(b1_rounds, wl_rounds, load_end, cores=2, threads=2):
    return {"batch1_decode": {"all_rounds": b1_rounds}, "workload": {"all_rounds": wl_rounds},
            "machine": {"load_average_at_end": load_end, "cpu_count": cores, "torch_threads": threads}}


def test_steady_rounds_on_a_quiet_host_give_no_warning():
    s = summary({"float32": [24.4, 22.0, 23.0], "q8_0": [34.4, 32.0, 33.0]},
                {"float32": [191.7, 186.3, 188.6]}, [2.0, 1.9, 1.7])
    assert noise_warnings(s) == []


def test_rounds_that_disagree_are_named_with_their_range():
    s = summary({"q8_0": [35.0, 43.8, 36.3]}, {"float32": [180.2, 214.2, 196.8]}, [1.8, 1.8, 1.6])
    warnings = noise_warnings(s)
    assert len(warnings) == 2
    assert warnings[0].startswith("warning: q8_0 batch-1 decode rounds range 35.0-43.8 tok/s (1.25x)")
    assert warnings[1].startswith("warning: float32 workload rounds range 180.2-214.2 tok/s (1.19x)")


def test_the_spread_limit_itself_and_a_single_round_do_not_warn():
    s = summary({"float32": [100.0, 100.0 * MAX_ROUND_SPREAD]}, {"float32": [50.0]}, [1.0, 1.0, 1.0])
    assert noise_warnings(s) == []


NOTE_END = ("warning: the host was busy (load average {} on 2 cores at the end): other work shared the CPU, so the "
            "timings and every ratio of them are not this code's alone; run again on a quiet machine")


def test_a_loaded_cpu_at_the_end_is_reported_per_core():
    own = ", 2 of it this run's own threads)"
    assert noise_warnings(summary({}, {}, [4.8, 3.0, 2.0])) == [NOTE_END.format("4.8").replace("end)", "end" + own)]
    assert noise_warnings(summary({}, {}, [3.5, 3.0, 2.0])) == [NOTE_END.format("3.5").replace("end)", "end" + own)]
    assert noise_warnings(summary({}, {}, [2.5, 3.0, 2.0])) == []  # its own 2 threads and 0.5 of others: not busy
    assert noise_warnings(summary({}, {}, [2.5, 3.0, 2.0], threads=0)) == [NOTE_END.format("2.5")]
    assert noise_warnings(summary({}, {}, [4.8, 3.0, 2.0], cores=8)) == []  # 2.8 others on 8 cores
    assert noise_warnings(summary({}, {}, None)) == []  # no load average on this platform


def test_load_at_the_start_counts_too_and_both_ends_make_one_line():
    assert busy_host_warnings(None, [4.0, 1, 1], [0.5, 1, 1], cores=2) == [
        "warning: the host was busy (load average 4.0 on 2 cores at the start): other work shared the CPU, so the "
        "timings and every ratio of them are not this code's alone; run again on a quiet machine"]
    both = busy_host_warnings({"ours": [10.0, 10.5]}, [4.0, 1, 1], [5.5, 1, 1], cores=2)
    assert len(both) == 1 and both[0].startswith(
        "warning: the host was busy (load average 4.0 at the start and 5.5 at the end on 2 cores)")


BENCHMARKS = sorted(p.stem for p in Path(benchmarks.__file__).parent.glob("benchmark_*.py"))
# Programs in benchmarks/ with a main that time nothing themselves, and why.
NOT_TIMING = {"gpu_check": "pass/fail checks on a GPU; its timed part is benchmark_comparison.main, which warns"}
ROOT = Path(benchmarks.__file__).parent.parent


def entry_points() -> list[str]:
    """Every program that prints speed figures: benchmarks/*.py with a main, the speculative CLI."""
    found = [p.stem for p in sorted(Path(benchmarks.__file__).parent.glob("*.py"))
             if "def main(" in p.read_text() and p.stem not in NOT_TIMING]
    return found + ["nanovllm_core.speculative.cli"]


def test_the_entry_points_listed_are_every_benchmark_the_docs_name():
    names = set(entry_points())
    assert set(BENCHMARKS) <= names
    text = (ROOT / "docs" / "benchmarks.md").read_text() + (ROOT / "README.md").read_text()
    import re

    for mod in set(re.findall(r"benchmarks[./](benchmark_\w+)", text)):
        assert mod in names, mod


@pytest.mark.parametrize("name", entry_points())
def test_every_benchmark_checks_the_host_with_the_shared_helper(name):
    """Each program that prints speed figures reads the load at its start (``HostCheck()``, the shared
    helper in nanovllm_core.host_load) and prints its note at the end; a new benchmark without it fails."""
    module = importlib.import_module(name if "." in name else f"benchmarks.{name}")
    source = inspect.getsource(module)
    assert "HostCheck()" in source, name
    assert "host.report(" in source or "noise_warnings(s" in source or "busy_host(host)" in source, name


@pytest.mark.parametrize("name", entry_points())
def test_every_benchmark_s_host_check_is_the_shared_one(name, monkeypatch, capsys):
    """The HostCheck each program makes, run on a faked busy load: the same note everywhere."""
    from nanovllm_core import host_load

    module = importlib.import_module(name if "." in name else f"benchmarks.{name}")
    monkeypatch.setattr(os, "getloadavg", lambda: (2.5, 2.0, 2.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    check_cls = getattr(module, "HostCheck", None) or host_load.HostCheck
    assert issubclass(check_cls, host_load.HostCheck), name
    host = check_cls()
    line = NOTE_END.format("2.5").replace("2.5 on 2 cores at the end", "2.5 at the start and 2.5 at the end on 2 cores")
    if hasattr(host, "report"):
        assert host.report() == [line] and capsys.readouterr().out == line + "\n"
    else:
        assert module.busy_host(host).startswith(line), name


def test_benchmark_comparison_says_the_host_was_busy(monkeypatch, capsys):
    """trial 29d: benchmark_comparison printed no warning at a load of 2.4-3.3 on 2 cores (its limit was
    1.5 per core), where the speculative CLI did. Its main, with the systems and the matmul peak faked."""
    from benchmarks import benchmark_comparison as bc

    def fake_ours(workload, target=bc.CPU, name="ours", **kwargs):
        outputs = [[7] * n for n in workload.output_lens]
        return bc.SystemResult(name, 1.0, [0.1] * len(outputs), [0.01] * len(outputs), outputs, 2**20)

    monkeypatch.setattr(bc, "run_ours", fake_ours)
    monkeypatch.setattr(bc, "gemm_peaks", lambda: {"mkl": 200e9})
    monkeypatch.setattr(os, "getloadavg", lambda: (2.5, 2.4, 2.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    summary = bc.main(["--quick", "--systems", "ours"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("warning: the host was busy (load average 2.5 at the start and 2.5 at the end on 2 cores)")
    assert summary["host_warnings"] == [out[-1]]


def test_a_benchmark_run_on_a_busy_host_says_so(monkeypatch, capsys):
    from benchmarks import benchmark_scheduler_unit

    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    result = benchmark_scheduler_unit.main(["--quick"])
    out = capsys.readouterr().out
    warning = "warning: the host was busy (load average 9.0 at the start and 9.0 at the end on 2 cores)"
    assert out.strip().splitlines()[-1].startswith(warning) and result["host_warnings"], out


def test_memory_bandwidth_samples_that_disagree_are_named_in_gb_per_s():
    s = summary({}, {}, [1.0, 1.0, 1.0])
    s["memory_bandwidth"] = {"samples": [10e9, 10.5e9]}
    assert noise_warnings(s) == []
    s["memory_bandwidth"] = {"samples": [8e9, 10e9, 9.9e9]}
    warnings = noise_warnings(s)
    assert len(warnings) == 1 and warnings[0].startswith("warning: memory bandwidth rounds range 8.0-10.0 GB/s (1.25x): ")


# -- benchmark_quantization's report, from a summary made up here (no model runs)

def quant_summary(llamacpp: bool = True, held_out: bool = True) -> dict:
    modes = ["float32", "gguf", "q8_0"]
    rate = {"float32": 20.0, "gguf": 50.0, "q8_0": 60.0}
    nbytes = {"float32": 438e6, "gguf": 96e6, "q8_0": 143e6}  # each share below 100% of 10 GB/s
    bw = 10e9
    if llamacpp:
        rate["llama.cpp"] = 40.0
    text = {"path": "x", "perplexity_tokens": 1508, "perplexity": {"float32": 10.0, "gguf": 10.0, "q8_0": 10.05},
            "perplexity_change": {"float32": 0.0, "gguf": 0.0, "q8_0": 0.005},
            "greedy_agreement_until_first_difference": {"float32": 1.0, "gguf": 0.97, "q8_0": 0.9}}
    return {
        "machine": {"cpu": "Test CPU 9000", "cpu_count": 2, "torch": "2.x", "torch_threads": 2,
                    "load_average_at_start": [0.5, 0.5, 0.5], "load_average_at_end": [0.6, 0.5, 0.5]},
        "cpu_flags": ["avx2"], "modes": modes, "rounds": 3, "attention_kernel": {m: "cpu-paged" for m in modes},
        "memory_bandwidth": {"bytes_per_s": bw, "samples": [bw, 9.8e9], "buffer_bytes": 512 * 2**20},
        "memory": {m: {"weight_formats": {"q8_0" if m == "q8_0" else m: int(nbytes[m])}, "weight_bytes": int(nbytes[m]),
                       "linear_weight_bytes": int(nbytes[m]), "rss_growth_bytes": int(2 * nbytes[m]),
                       "load_peak_rss_growth_bytes": int(2.1 * nbytes[m])} for m in modes},
        "quality": {"texts": {"corpus": text, **({"held-out": text} if held_out else {})}, "greedy_prompts": 32,
                    "greedy_tokens_per_prompt": 32,
                    "held_out_note": None if held_out else "held-out text /nowhere not found: quality on the corpus only"},
        "llamacpp": {"llama_cpp_python": "0.3", "threads": 2, "amx_repack": "not applicable (this CPU has no AMX)"},
        "batch1_decode": {"tokens": 128, "prompt_tokens": 32, "tokens_per_s": rate,
                          "all_rounds": {k: [v] * 3 for k, v in rate.items()},
                          "over_float32": {m: rate[m] / 20.0 for m in modes},
                          "over_llamacpp": {m: rate[m] / 40.0 for m in modes} if llamacpp else None,
                          "gguf_over_llamacpp": 1.25 if llamacpp else None, "q8_0_over_float32": 3.0,
                          "bandwidth_share": {m: nbytes[m] * rate[m] / bw for m in modes}},
        "workload": {"num_requests": 64, "useful_tokens_per_s": {"float32": 200.0, "gguf": 210.0, "q8_0": 190.0},
                     "all_rounds": {}, "over_float32": {"float32": 1.0, "gguf": 1.05, "q8_0": 0.95},
                     "float32_roofline_fraction": 0.3},
        "gemm_peak_flops": 300e9,
    }


def test_quantization_report_names_the_cpu_the_bandwidth_and_each_modes_figures():
    from benchmarks.benchmark_quantization import report

    out = report(quant_summary())
    assert "machine: Test CPU 9000 (avx2), 2 cores" in out
    assert "memory read bandwidth: 10.0 GB/s (best of 2 sums over 512 MiB, 2 threads" in out
    assert "batch-1 decode on Test CPU 9000: gguf / llama.cpp = 1.25x" in out and "q8_0 / float32 = 3.00x" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["gguf"], ["q8_0"])}
    # the speed row of gguf: 50 tok/s, 2.50x float32, 1.25x llama.cpp, 48.0% of 10 GB/s (96 MB x 50 / 10e9), workload 1.05x
    speed = [line.split() for line in out.splitlines() if line.startswith("gguf ") and "%" in line and "x" in line]
    assert ["gguf", "50", "2.50x", "1.25x", "48.0%", "210", "1.05x"] in speed, rows
    assert "corpus ppl (1508 tok)" in out and "held-out ppl (1508 tok)" in out
    assert "warning" not in out


def test_quantization_report_without_llamacpp_or_held_out_text_says_so():
    from benchmarks.benchmark_quantization import report

    out = report(quant_summary(llamacpp=False, held_out=False))
    assert "llama.cpp Q4_1" not in out and "gguf / llama.cpp" not in out
    assert "held-out text /nowhere not found: quality on the corpus only" in out and "held-out ppl" not in out
    assert "q8_0 / float32 = 3.00x" in out
    assert "gguf / float32 = 2.50x" in out  # the default mode, the one the README quotes (trial 45a)
    assert "above 100%" not in out


def test_quantization_report_says_a_bandwidth_share_above_100_percent_means_a_low_measurement():
    """Trial 45a: "158.3%" of the measured bandwidth, printed with nothing to say no decode reads faster than
    memory: the bandwidth was measured low on a busy host."""
    from benchmarks.benchmark_quantization import report

    summary = quant_summary()
    summary["batch1_decode"]["bandwidth_share"]["q8_0"] = 1.583
    out = report(summary)
    assert "158.3%" in out and "(q8_0 above 100%: no decode reads faster than memory, so the bandwidth was" in out


def test_prompts_are_cut_at_distinct_offsets_within_their_lengths_and_repeat_by_seed():
    from benchmarks.benchmark_quantization import cut_prompts

    ids = list(range(1000))
    prompts = cut_prompts(ids, 32, seed=1)
    assert len(prompts) == 32 and len({p[0] for p in prompts}) == 32
    assert all(16 <= len(p) <= 64 and p == ids[p[0]:p[0] + len(p)] for p in prompts)
    assert cut_prompts(ids, 32, seed=1) == prompts and cut_prompts(ids, 32, seed=2) != prompts


def test_a_missing_held_out_text_gives_none(tmp_path):
    from benchmarks.benchmark_quantization import held_out_ids

    class Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return [len(w) for w in text.split()]

    assert held_out_ids(Tokenizer(), tmp_path / "missing.txt") is None
    (tmp_path / "text.txt").write_text("one three five")
    assert held_out_ids(Tokenizer(), tmp_path / "text.txt") == [3, 5, 4]


def test_rss_is_read_after_freeing_what_python_and_malloc_hold():
    from benchmarks.benchmark_quantization import rss_bytes

    before = rss_bytes()
    if before is None:
        pytest.skip("no /proc/self/status here")
    block = bytearray(64 * 2**20)
    block[::4096] = b"x" * len(block[::4096])  # touch every page
    assert rss_bytes() - before > 48 * 2**20
    del block
    assert rss_bytes() - before < 16 * 2**20


@pytest.mark.parametrize("flags, expected", [
    ("fpu sse2 avx avx2 fma", "AMD EPYC (AVX2)"),                                   # Zen 3
    ("avx2 avx512f avx512bw avx512_vnni avx512_bf16", "AMD EPYC (AVX-512, VNNI)"),    # Zen 4
    ("avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8", "AMD EPYC (AVX-512, VNNI, AMX)"),
    ("sse2 sse4_2", "AMD EPYC"),
])
def test_every_figures_machine_names_the_instruction_sets_its_kernels_used(tmp_path, flags, expected):
    # trial 16e: "2-core AMD EPYC" named a Zen 3 with AVX2 in some figures and a Zen 4 with
    # AVX-512 in others (the block kernel's peak differs 2x between them); the model name alone
    # did not say which machine a figure came from.
    from nanovllm_core.native import cpu_name
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
                    f"model name\t: AMD EPYC\nflags\t\t: {flags}\n")
    assert cpu_name(str(info)) == expected


def test_the_benchmarks_and_the_tensor_parallel_measurement_name_the_cpu_one_way():
    import benchmarks.common
    from nanovllm_core import native, roofline
    from nanovllm_core.educational import tp_measure
    assert benchmarks.common.cpu_name is roofline.cpu_name is tp_measure.cpu_name is native.cpu_name


def test_a_summary_ratio_under_one_reads_the_other_way_round(capsys):
    """Trial 20e: chunking's stall was 12.8 s against 4.39 s in one piece and the summary said
    "0.34x shorter with chunking" (read as a gain); every summary line words the ratio by its side of 1."""
    from benchmarks.benchmark_advanced_scheduling import print_chunked, print_prefix, print_priority
    from benchmarks.common import compared

    assert compared(1.5, "faster", "slower") == "1.50x faster"
    assert compared(4.39 / 12.8, "shorter", "longer") == "2.92x longer"
    assert compared(0.0, "faster", "slower") == compared(float("nan"), "faster", "slower") == "not comparable"
    row = {"token_budget": 128, "decode_stall_max_s": 12.8, "itl_p50_s": 0.27, "long_prompt_ttft_s": 22.7}
    print_chunked({"setup": "x", "chunked": row, "one piece": {**row, "decode_stall_max_s": 4.39},
                   "stall_reduction": 4.39 / 12.8})
    out = capsys.readouterr().out
    assert "the longest decode stall is 2.92x longer with chunking" in out and "shorter" not in out
    source = inspect.getsource(print_priority) + inspect.getsource(print_prefix)
    assert "compared(" in source and "x faster" not in source  # the other two summary lines share the rule


# -- benchmark_comparison's table, from made-up timings (no model runs)

def comparison_summary(gguf_peaks, with_llamacpp=False):
    from benchmarks.benchmark_comparison import SystemResult, summarize
    from benchmarks.common import Workload

    workload = Workload("quick", 0, (10, 10), (5, 5), [[1] * 10, [1] * 10], [5, 5])
    def run(name, seconds, peaks=None):
        return SystemResult(name, seconds, [0.1, 0.2], [0.01, 0.02], [[7] * 5, [7] * 5], 2**20,
                            kernel_peaks=peaks)
    results = {"hf-padded": run("hf-padded", 2.0), "ours": run("ours", 1.0), "ours-gguf": run("ours-gguf", 0.25, gguf_peaks)}
    if with_llamacpp:
        results["llamacpp"] = run("llamacpp", 0.5, {"llama.cpp's kernels": None})
    # 2 x 1e9 parameters x 30 tokens = 60 GFLOP; float peak 200 GFLOP/s: ours 30%, ours-gguf 240 GFLOP/s
    summary = summarize(workload, results, 200e9, 10**9)
    summary["machine"].update(device="cpu", dtype="float32")
    return summary


def test_comparison_judges_each_row_against_the_peak_of_the_kernel_that_ran_it():
    """trial 29d: ours-gguf ran the Q4_1 block kernel but was divided by the float32 matmul peak (114.5%)."""
    from benchmarks.benchmark_comparison import report

    s = comparison_summary({"Q4_1 block kernel": 400e9, "Q8_0 block kernel": 300e9}, with_llamacpp=True)
    rows = s["systems"]
    assert rows["ours"]["roofline_fraction"] == pytest.approx(0.3)
    assert rows["ours-gguf"]["roofline_fraction"] == pytest.approx(240e9 / 400e9)  # not 1.2 against 200
    assert rows["llamacpp"]["roofline_fraction"] is None  # its kernels' peak is not known
    text = report(s)
    lines = {}
    for line in text.splitlines():  # the table's rows (the ratio line under it starts with "ours" too)
        if line.split() and line.split()[0] in rows:
            lines.setdefault(line.split()[0], line.split())
    assert lines["ours-gguf"][-2:] == ["60.0%", "-"]  # our own row: no "ours is" ratio against ours
    assert lines["ours"][-2:] == ["30.0%", "-"]
    assert lines["llamacpp"][-2] == "-" and lines["hf-padded"][-1] == "2x"
    assert "ours-gguf against the fastest kernel it ran, 400.0 GFLOP/s (Q4_1 block kernel 400.0 GFLOP/s" in text
    assert "llamacpp: no trusted peak" in text and "120.0%" not in text


def test_comparison_gives_no_roofline_for_a_block_row_without_a_trusted_peak():
    from benchmarks.benchmark_comparison import report

    s = comparison_summary({"Q4_1 block kernel": None})
    assert s["systems"]["ours-gguf"]["roofline_fraction"] is None
    assert "ours-gguf: no trusted peak (Q4_1 block kernel's not known), so no roofline" in report(s)



def test_the_run_s_own_threads_are_not_other_work():
    """A quiet 2-core host running a benchmark's 2 torch threads reads a load of about 2 at the end: that is
    not a busy host. Two burners beside it (about 4) are, and the note says how much of it was the run's own."""
    from nanovllm_core.host_load import busy_host_note

    assert busy_host_note([0.3], [2.1], cores=2, own=2) is None
    assert busy_host_note([0.3], [2.1], cores=2, own=0) is not None  # the same figure with no threads of ours
    note = busy_host_note([0.3], [4.0], cores=2, own=2)
    assert note.startswith("warning: the host was busy (load average 4.0 on 2 cores at the end, 2 of it this run's "
                           "own threads): other work shared the CPU"), note
    assert busy_host_note([2.5], [2.1], cores=2, own=2).startswith(
        "warning: the host was busy (load average 2.5 on 2 cores at the start):")  # before the run: all others'
