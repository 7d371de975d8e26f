"""Trial 15a: a block kernel's peak measured on a busy host (26-41 GFLOP/s one run, 382 the next beside a
float matmul's 213) flipped a batch-1 Q4_1 decode between compute-bound and memory-bound; the views now
give no verdict from a peak that cannot be trusted, and say why. Fake measurements only, no timing."""

import torch

from nanovllm_core import roofline
from nanovllm_core.educational import xray_facts as facts
from nanovllm_core.educational.tutorial import chapter, model_facts
from nanovllm_core.roofline import Roofline
from tests.test_xray import BUSY_HOST, decode_trace

FLOAT = Roofline(213.1e9, 33.0e9, "AMD EPYC (2 threads), float32, q4_1 weights")


def _peak(flops, share=1.0, shape="[3072, 576]"):
    return roofline.BlockPeak("q4_1", flops, f"{shape} at 128 tokens", share)


def test_an_untrusted_block_peak_gives_no_verdict_and_says_why():
    for bad in (_peak(26.0e9, share=0.3), _peak(40.8e9, share=0.95)):  # busy; quiet share but far below float
        roof = roofline.with_block_peaks(FLOAT, [bad])
        assert roof.block_peaks == ()
        t = decode_trace(kernel_peaks=roof.block_peaks, machine=roof.machine, peak=FLOAT.peak_flops,
                         bandwidth=FLOAT.bandwidth)
        qkv = next(o for o in t.ops if o.name == "qkv_proj")
        assert facts.bound(t, qkv) == ""
        text = " ".join(facts.roofline_lines(t)) + facts.verdict_line(t)
        assert "compute-bound from about" not in text and ": compute-bound" not in text
        assert ("the Q4_1 kernel's peak could not be measured reliably on this busy host; run "
                "`python -m nanovllm_core.roofline` when the machine is quiet") in text
    good = roofline.with_block_peaks(FLOAT, [_peak(382.2e9)])
    assert good.block_peaks == (("q4_1", 382.2e9),) and "reliably" not in good.machine


def test_the_crossing_sentence_never_says_fewer_than_one_token_nor_comes_from_a_busy_peak():
    t = decode_trace(kernel_peaks=(("q4_1", 3.6e11),))
    one = " ".join(facts.roofline_lines(t.__class__(**{**t.__dict__, "compute_bound_tokens": 1})))
    assert "fewer tokens" not in one and "even a step of 1 token" in one
    busy = BUSY_HOST + "; measured while the host was busy (its threads got 24% of their cores), so likely low"
    text = " ".join(facts.roofline_lines(decode_trace(kernel_peaks=(("q4_1", 3.6e11),), machine=busy)))
    assert "compute-bound from about" not in text and "not told" in text


def test_the_tutorial_agrees_with_the_xray_on_an_untrusted_peak():
    roof = roofline.with_block_peaks(FLOAT, [_peak(26.0e9, share=0.3)])
    info = {"peak_flops": roof.peak_flops, "memory_bandwidth": roof.bandwidth, "machine": roof.machine,
            "block_peaks": roof.block_peaks, "compute_bound_tokens": 1, "token_budget": 512,
            "weight_kinds": "q4_1", "quantization": "gguf", "linear_weight_bytes": 84_000_000,
            "linear_weights": 134_400_000, "num_layers": 30, "kv_bytes_per_token": 46080, "num_kv_heads": 3,
            "head_dim": 64, "dtype": "float32", "num_parameters": 134_515_008}
    prefill = " ".join(model_facts(chapter("prefill"), info))
    assert "compute-bound from about" not in prefill and "not told" in prefill
    decode = " ".join(model_facts(chapter("decode"), info))
    assert "Q4_1 kernel's peak could not be measured reliably on this busy host" in decode
    assert "waits on memory" not in decode and "below it" not in decode


def test_a_kept_quiet_block_peak_is_used_and_the_command_measures_block_peaks(tmp_path, monkeypatch):
    from nanovllm_core.model.block_quant import BlockLinear

    module = BlockLinear.from_float(torch.randn(64, 128), "q4_1")
    path = tmp_path / "roofline.json"
    results = iter([_peak(382e9, shape="[64, 128]"), _peak(26e9, share=0.3, shape="[64, 128]")])
    monkeypatch.setattr(roofline, "_block_peaks", {})
    monkeypatch.setattr(roofline, "measure_block_peak", lambda m, tokens=128: next(results))
    quiet = roofline.block_peak(module, "cpu", path, float_peak=213e9)  # kept
    monkeypatch.setattr(roofline, "_block_peaks", {})
    busy = roofline.block_peak(module, "cpu", path, float_peak=213e9, again=True)  # busy: this process only
    assert not busy.quiet and roofline.cached_block_peak(module, "cpu", path) == quiet  # the kept one wins
    # `python -m nanovllm_core.roofline` times and keeps the block kernels too
    monkeypatch.setattr(roofline, "remeasure", lambda: FLOAT)
    monkeypatch.setattr(roofline, "default_block_modules", lambda: [module])
    monkeypatch.setattr(roofline, "default_cache_path", lambda: path)
    seen = []
    monkeypatch.setattr(roofline, "block_peak", lambda m, **kw: seen.append(kw) or _peak(380e9))
    assert roofline.main() == 0 and seen and seen[0]["again"]


def test_a_byte_token_that_completes_a_character_is_named_as_its_table_row():
    """Trial 15a item 2: "the favourite is [<0x93>] at 21.99%. Greedy decoding takes it: [こ] (id 237)"."""
    from nanovllm_core.educational.narrator_sampling import token_choice
    from tests.test_narrator import sampled

    e = sampled(2, token=237, text="こ", top=((237, "<0x93>", 0.2199), (260, " the", 0.05)))
    text, _ = token_choice(e, {}, 49152)
    assert "Greedy decoding takes it: [<0x93>] (id 237), which completes こ." in text, text
    assert "[こ] (id 237)" not in text
    plain, _ = token_choice(sampled(1), {}, 49152)  # an ordinary token keeps its text
    assert "takes it: [ Paris] (id 7042)." in plain or "(id 7042)." in plain


def test_the_torch_free_copy_of_the_unreliable_peak_wording_matches_the_roofline_s():
    from nanovllm_core import roofline
    from nanovllm_core.educational import xray_costs

    assert xray_costs.UNRELIABLE == roofline.UNRELIABLE
