"""int8 linear layers: the integer product is exact, a token's result ignores its batch, and
the loader builds (and packs) every linear layer once, when the model loads.

Tolerance for a whole model: on a tiny random LLaMA each position's int8 logits are within
3 % of float32's (relative L2 error of the logits row; measured: at most 1.7 %).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_core.model import cpu_linear, loader
from nanovllm_core.model.cpu_linear import FloatLinear
from tests import native_builds
from nanovllm_core.model.int8_linear import (
    FLOAT32_EXACT_INT,
    OUTLIER_ACT_LEVELS,
    Int8Linear,
    outlier_weight_levels,
    quantize_rows,
    weight_range,
)
from nanovllm_core.model.quantization import linear_modules, linear_weight_bytes, outlier_channels
from nanovllm_core.sampling_params import SamplingParams
from tests.test_model_parity import PROMPTS, VARIANTS, _load_without_tokenizer, contiguous_logits

LOGITS_TOLERANCE = 0.03  # relative L2 error per logits row, int8 against float32


def exact_product(layer: Int8Linear, qweight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What the int8 layer must compute, in float64: (qx @ qw.T) * sx * sw + bias."""
    xs = x if layer.inv_smooth is None else x * layer.inv_smooth
    qx, sx = quantize_rows(xs)
    y = (qx.double() @ qweight.double().t()) * sx.double() * layer.w_scale.double()
    return y if layer.bias is None else y + layer.bias.double()


def test_int8_layer_computes_the_exact_integer_product_scaled():
    torch.manual_seed(0)
    w, b = torch.randn(48, 64) * 0.05, torch.randn(48)
    layer = Int8Linear.from_float(w, b)
    q = weight_range()
    qweight = torch.round(w / layer.w_scale[:, None]).clamp(-q, q)
    x = torch.randn(9, 64)
    torch.testing.assert_close(layer(x).double(), exact_product(layer, qweight, x), rtol=1e-5, atol=1e-5)
    # ... and that product is close to the float one: the quantization error is small
    rel = (layer(x) - torch.nn.functional.linear(x, w, b)).norm() / torch.nn.functional.linear(x, w, b).norm()
    assert rel < 0.02


def test_a_tokens_int8_output_does_not_depend_on_its_batch():
    torch.manual_seed(1)
    layer = Int8Linear.from_float(torch.randn(96, 64) * 0.05)
    x = torch.randn(40, 64)
    x[3] *= 50  # one token with a huge activation must not change the others' quantization
    together = layer(x)
    for i in (0, 3, 17, 39):
        assert torch.equal(layer(x[i:i + 1]), together[i:i + 1])
    assert torch.equal(layer(x[5:21]), together[5:21])


def test_smoothing_keeps_the_product_and_shrinks_an_outlier_channels_error():
    torch.manual_seed(2)
    w = torch.randn(64, 32) * 0.05
    x = torch.randn(16, 32)
    x[:, 7] *= 40  # an outlier channel, as RMSNorm outputs have
    want = torch.nn.functional.linear(x, w)
    smooth = (x.abs().amax(0) ** 0.5 / w.abs().amax(0) ** 0.5)
    plain_err = (Int8Linear.from_float(w)(x) - want).norm()
    smooth_err = (Int8Linear.from_float(w, smooth=smooth)(x) - want).norm()
    assert smooth_err < plain_err / 2


def _outlier_input(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    w = torch.randn(64, 96) * 0.05
    x = torch.randn(24, 96)
    x[:, [5, 40, 77]] *= 60  # three channels far larger than the rest, in every token (LLM.int8()'s finding)
    return w, x


def test_outlier_channels_run_in_float_and_cut_the_error_of_the_rest():
    w, x = _outlier_input(3)
    want = torch.nn.functional.linear(x, w)
    channels = outlier_channels(x.abs().amax(0), count=3)
    assert channels.tolist() == [5, 40, 77]
    plain = Int8Linear.from_float(w)
    split = Int8Linear.from_float(w, outlier_channels=channels)
    assert (split(x) - want).norm() < (plain(x) - want).norm() / 5
    # The split is exact where it should be: the int8 part is the integer product of the
    # ordinary channels, which alone set the token's scale; the outlier part is the integer
    # product of x's outlier columns and W's, each on its own finer grid.
    q = weight_range()
    rest = x.index_fill(1, channels, 0.0)
    w_rest = w.index_fill(1, channels, 0.0)
    qweight = torch.round(w_rest / split.w_scale[:, None]).clamp(-q, q)
    qx, sx = quantize_rows(rest)
    exact = (qx.double() @ qweight.double().t()) * sx.double() * split.w_scale.double()
    levels = outlier_weight_levels(3)
    col_scale = w[:, channels].abs().amax(0) / levels
    qo_weight = torch.round(w[:, channels] / col_scale).clamp(-levels, levels)
    xo = x[:, channels] * col_scale
    so = xo.abs().amax(1, keepdim=True) / OUTLIER_ACT_LEVELS
    exact += (torch.round(xo / so).double() @ qo_weight.double().t()) * so.double()
    torch.testing.assert_close(split(x).double(), exact, rtol=1e-5, atol=1e-5)
    assert split.weight_bytes == 64 * 96 + 64 * 4 + 96 * 4 + 3 * (64 * 4 + 4 + 8)  # + the input's factors (0 on outliers)
    with pytest.raises(ValueError, match="outlier channels must lie in"):
        Int8Linear.from_float(w, outlier_channels=torch.tensor([96]))


def test_with_outlier_channels_a_tokens_output_still_ignores_its_batch():
    w, x = _outlier_input(4)
    layer = Int8Linear.from_float(w, smooth=torch.rand(96) + 0.5, outlier_channels=torch.tensor([5, 40, 77]))
    together = layer(x)
    want = torch.nn.functional.linear(x, w)
    assert (together - want).norm() / want.norm() < 0.01  # smoothing and the split together still compute x W^T
    for i in (0, 7, 23):
        assert torch.equal(layer(x[i:i + 1]), together[i:i + 1])
    assert torch.equal(layer(x[3:19]), together[3:19])


@pytest.mark.parametrize("num_outliers", [1, 3, 16, 32])
def test_the_outlier_product_is_exact_in_float32_at_its_worst_case(num_outliers):
    """Every partial sum of the outliers' float32 product must be an integer below 2**24: then
    no summation order (MKL's blocking differs with the number of tokens) can change it."""
    levels = outlier_weight_levels(num_outliers)
    assert num_outliers * OUTLIER_ACT_LEVELS * levels < FLOAT32_EXACT_INT
    worst_x = torch.full((5, num_outliers), float(OUTLIER_ACT_LEVELS))
    worst_w = torch.full((num_outliers, 7), float(levels))
    worst_w[:, 3] = -levels
    assert torch.equal((worst_x @ worst_w).double(), worst_x.double() @ worst_w.double())
    assert torch.equal(worst_x[:1] @ worst_w, (worst_x @ worst_w)[:1])


def test_outlier_count_is_capped_by_a_share_of_the_channels():
    assert outlier_channels(torch.rand(576)).numel() == 16  # the default model's hidden size
    assert outlier_channels(torch.rand(64)).numel() == 2  # a tiny model keeps most channels int8
    assert outlier_channels(torch.rand(8)).numel() == 0


@pytest.mark.parametrize("in_features, out_features, num_outliers, smoothed, bias",
                         [(576, 960, 16, True, False), (1536, 576, 16, False, True), (576, 3072, 0, True, True),
                          (40, 24, 3, False, False)])
def test_the_native_quantize_and_epilogue_compute_the_same_bits_as_pytorch(monkeypatch, in_features, out_features,
                                                                            num_outliers, smoothed, bias):
    """``int8_cpu.c`` replaces ~20 PyTorch ops per layer with two calls; the outputs must not move by a bit."""
    from nanovllm_core.model import int8_linear

    if int8_linear.native_helpers() is None or not int8_linear._ONEDNN:
        pytest.skip("the native int8 helpers (or oneDNN's int8 matmul) are not available here")
    g = torch.Generator().manual_seed(in_features)
    layer = Int8Linear.from_float(torch.randn(out_features, in_features, generator=g),
                                  torch.randn(out_features, generator=g) if bias else None,
                                  torch.rand(in_features, generator=g) + 0.5 if smoothed else None,
                                  torch.randperm(in_features, generator=g)[:num_outliers] if num_outliers else None)
    for tokens in (0, 1, 3, 64, 300):
        x = torch.randn(tokens, in_features, generator=g) * 3
        x[:, :2] *= 40  # a few large channels, as the RMSNorm outputs have
        native = layer(x)
        monkeypatch.setenv(int8_linear.NATIVE_ENV_SWITCH, "0")
        assert int8_linear.native_helpers() is None
        assert torch.equal(native, layer(x)), tokens
        monkeypatch.delenv(int8_linear.NATIVE_ENV_SWITCH)


@pytest.mark.parametrize("march, needs", native_builds.BUILDS, ids=native_builds.BUILD_IDS)
def test_every_build_of_the_int8_helpers_computes_the_same_bits(tmp_path, monkeypatch, march, needs):
    """The vector paths of ``int8_cpu.c`` (a 16- or 8-lane absmax; the outlier sums held in
    registers, fused where the CPU has FMA) claim the plain loops' bits: a build for each older
    instruction set must give the PyTorch path's output, over vector widths, remainders
    (out_features not a multiple of 64), outlier channels and bias; a NaN in one token stays there."""
    from nanovllm_core.model import int8_linear

    if not int8_linear._ONEDNN:
        pytest.skip("oneDNN's int8 matmul is not available here")
    lib = native_builds.build(tmp_path, int8_linear.NATIVE_SOURCE, march, needs, int8_linear.NATIVE_SIGNATURES)
    g = torch.Generator().manual_seed(7)
    for in_features, out_features, num_outliers, bias in ((576, 1000, 16, True), (1536, 576, 16, False), (37, 24, 3, True)):
        layer = Int8Linear.from_float(torch.randn(out_features, in_features, generator=g),
                                      torch.randn(out_features, generator=g) if bias else None,
                                      torch.rand(in_features, generator=g) + 0.5,
                                      torch.randperm(in_features, generator=g)[:num_outliers])
        x = torch.randn(70, in_features, generator=g) * 3
        x[:, :2] *= 40
        x[5, 3] = float("nan")
        monkeypatch.setattr(int8_linear, "native_helpers", lambda: lib)
        built = layer(x)
        monkeypatch.setenv(int8_linear.NATIVE_ENV_SWITCH, "0")
        monkeypatch.setattr(int8_linear, "native_helpers", lambda: None)
        reference = layer(x)
        monkeypatch.delenv(int8_linear.NATIVE_ENV_SWITCH)
        others = torch.arange(len(x)) != 5  # a NaN token's own output is not defined bit for bit (casts of NaN)
        assert torch.equal(built[others], reference[others]), (in_features, out_features)
        assert built[others].isfinite().all()  # the NaN stayed in its own token


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_single_token_through_fbgemm_gets_the_bits_onednn_gives_it_alone_and_batched(monkeypatch, native):
    """Batch-1 decode multiplies through fbgemm (faster for one token); a token must come out the
    same through fbgemm, through oneDNN, and as one row of a batch (which oneDNN always takes)."""
    from nanovllm_core.model import int8_linear

    if not int8_linear.fbgemm_gemv():
        pytest.skip(f"single tokens go to oneDNN here: {int8_linear._fbgemm_gemv_choice()[1]}")
    monkeypatch.setenv(int8_linear.NATIVE_ENV_SWITCH, native)
    g = torch.Generator().manual_seed(7)
    layer = Int8Linear.from_float(torch.randn(960, 576, generator=g), torch.randn(960, generator=g),
                                  torch.rand(576, generator=g) + 0.5, torch.randperm(576, generator=g)[:16])
    assert layer._fbgemm_packed is not None
    x = torch.randn(9, 576, generator=g) * 3
    x[:, :2] *= 40
    x[4] = 0.0  # an all-zero token
    batched = layer(x)
    for t in range(x.shape[0]):
        alone = layer(x[t:t + 1])
        monkeypatch.setenv(int8_linear.GEMV_ENV_SWITCH, "0")
        assert not int8_linear.fbgemm_gemv()
        assert torch.equal(alone, layer(x[t:t + 1])), t
        monkeypatch.delenv(int8_linear.GEMV_ENV_SWITCH)
        assert torch.equal(alone, batched[t:t + 1]), t


def test_switching_the_single_token_path_off_at_build_time_keeps_no_second_weight_copy(monkeypatch):
    from nanovllm_core.model import int8_linear

    monkeypatch.setenv(int8_linear.GEMV_ENV_SWITCH, "0")
    layer = Int8Linear.from_float(torch.randn(24, 40))
    assert layer._fbgemm_packed is None
    x = torch.randn(1, 40)
    monkeypatch.delenv(int8_linear.GEMV_ENV_SWITCH)
    assert torch.equal(layer(x), layer(torch.cat([x, x]))[:1])  # oneDNN for the lone token, same bits


def test_the_fbgemm_choice_refuses_sums_that_differ_from_onednns(monkeypatch):
    """The single-token path is taken only where fbgemm returns oneDNN's bits: a kernel that
    differs (here: one off by a float32 step) must be refused, with the reason."""
    from nanovllm_core.model import int8_linear

    if not int8_linear._ONEDNN or "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("no oneDNN int8 or no fbgemm here")
    real = int8_linear._fbgemm_matmul
    monkeypatch.setattr(int8_linear, "_fbgemm_matmul", lambda qx, packed: torch.nextafter(real(qx, packed),
                                                                                           torch.tensor(float("inf"))))
    int8_linear._fbgemm_gemv_choice.cache_clear()
    try:
        use, why = int8_linear._fbgemm_gemv_choice()
        assert not use and "differ" in why
        assert Int8Linear.from_float(torch.randn(8, 16))._fbgemm_packed is None
    finally:
        int8_linear._fbgemm_gemv_choice.cache_clear()


@pytest.mark.parametrize("tokens", [1, 4])
def test_int8_layer_refuses_an_input_of_the_wrong_width_before_reading_it(tokens):
    layer = Int8Linear.from_float(torch.randn(8, 16), smooth=torch.rand(16) + 0.5)
    with pytest.raises(ValueError, match="takes 16 input features"):
        layer(torch.randn(tokens, 24))


def test_int8_layer_takes_an_empty_step_and_half_precision_inputs():
    layer = Int8Linear.from_float(torch.randn(8, 16))
    assert layer(torch.randn(0, 16)).shape == (0, 8)
    x = torch.randn(3, 16).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    # computed in float32 from the same (rounded) input, only the result rounded to bf16
    assert torch.equal(y, layer(x.float()).to(torch.bfloat16))


def test_each_linear_reports_its_bytes_per_weight():
    w = torch.randn(960, 576)
    assert FloatLinear(w).bytes_per_weight == 4.0 and FloatLinear(w).weight_bytes == 960 * 576 * 4
    int8 = Int8Linear.from_float(w)
    assert int8.weight_bytes == 960 * 576 + 960 * 4  # one byte a weight, a float32 scale a row
    assert 1.0 < int8.bytes_per_weight < 1.01


@pytest.mark.slow
def test_cpus_whose_int8_sums_saturate_get_7_bit_weights_and_exact_products():
    # oneDNN restricted to AVX2 multiplies int8 with vpmaddubsw, which saturates at 16 bits
    # (the AMD EPYC machines without VNNI): the probe must notice and keep the products exact.
    code = ("import torch; from nanovllm_core.model.int8_linear import Int8Linear, weight_range, quantize_rows\n"
            "torch.manual_seed(0); w = torch.randn(32, 256) * 0.05; w[:, 0] = 1.0; x = torch.randn(4, 256)\n"
            "layer = Int8Linear.from_float(w); q = weight_range()\n"
            "qw = torch.round(w / layer.w_scale[:, None]).clamp(-q, q); qx, sx = quantize_rows(x)\n"
            "want = (qx.double() @ qw.double().t()) * sx.double() * layer.w_scale.double()\n"
            "print(q, float((layer(x).double() - want).abs().max()))\n")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    q, err = out.stdout.split()
    assert int(q) == 63 and float(err) < 1e-4


@pytest.mark.parametrize("variant", ["mha_untied", "mqa_bias"])  # an untied LM head; biases and one KV head
def test_int8_logits_stay_within_tolerance_of_float32(tmp_path, variant):
    from tests.conftest import save_tiny_llama

    path = save_tiny_llama(tmp_path, seed=1, **VARIANTS[variant])
    full, _, _ = _load_without_tokenizer(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "load_tokenizer", lambda p: None)
        int8, _, _ = loader.load_model(str(path), torch.device("cpu"), torch.float32, quantization="int8")
    assert all(isinstance(m, Int8Linear) for m in linear_modules(int8)) and int8.quantization == "int8"
    for prompt in PROMPTS:
        want, got = contiguous_logits(full, prompt), contiguous_logits(int8, prompt)
        rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
        assert rel < LOGITS_TOLERANCE, (variant, len(prompt), rel)
    # A quarter of the bytes, less the scales' share (4 bytes a row of only 64 weights here) and
    # the outlier columns' (1/32 of the channels here, 4 bytes each; 16 of 576 in the default model).
    assert all(m.outlier_channels.numel() == m.in_features // 32 for m in linear_modules(int8))
    assert linear_weight_bytes(full) / linear_weight_bytes(int8) > 2.9


def test_weights_are_packed_at_load_so_the_first_step_packs_nothing(tmp_path, monkeypatch):
    from tests.conftest import save_tiny_llama

    packs = []
    real_pack = cpu_linear.pack
    monkeypatch.setattr(cpu_linear, "pack", lambda w: packs.append(w.shape) or real_pack(w))
    monkeypatch.setattr(loader, "load_tokenizer", lambda p: None)
    model, _, _ = loader.load_model(str(save_tiny_llama(tmp_path)), torch.device("cpu"), torch.float32)
    if cpu_linear._AVAILABLE:  # 2 layers x (qkv, o, gate_up, down) + the tied LM head
        assert len(packs) == 9
    packs.clear()
    engine = LLMEngine(EngineConfig(num_kv_blocks=16), model, _Tokenizer())
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=2))
    engine.step()
    assert packs == []


def test_int8_loads_with_a_context_shorter_than_its_calibration_text(tmp_path, monkeypatch):
    """``max_model_len=32`` sizes the rotary tables for 32 positions; the 80-token calibration pass
    must run within them (it once indexed past them: an IndexError at load)."""
    from nanovllm_core.model.quantization import calibration_ids
    from tests.conftest import save_tiny_llama

    monkeypatch.setattr(loader, "load_tokenizer", lambda p: None)
    path = str(save_tiny_llama(tmp_path))
    model, _, _ = loader.load_model(path, torch.device("cpu"), torch.float32, max_model_len=32, quantization="int8")
    assert len(calibration_ids(None, model.config.vocab_size)) > 32 and model.quantization == "int8"
    engine = LLMEngine(EngineConfig(num_kv_blocks=16, max_model_len=32, quantization="int8"), model, _Tokenizer())
    engine.add_request(list(range(5, 25)), SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))
    outputs = []
    for _ in range(40):
        outputs += [o for o in engine.step() if o.finished]
        if outputs:
            break
    assert len(outputs[0].outputs[0].token_ids) == 11


@pytest.mark.parametrize("kernel", ["cpu-paged", "gather"])
def test_int8_logprobs_are_bit_identical_however_the_tokens_are_scheduled(tmp_path, monkeypatch, kernel):
    """Alone, batched (decodes padded in groups), chunked, preempted: the same logprobs to the last bit.

    A random model's logits are near-ties everywhere, so a last-bit difference in attention,
    re-quantized by the next int8 layer, would show here (it did, before attention was made
    batch-invariant). Both ways are checked: the CPU paged kernel's fixed summation order on
    float32 K/V, and the gather path's float64 sums (where the kernel cannot be built).
    """
    from nanovllm_core.attention import cpu_paged
    from nanovllm_core.llm import LLM
    from tests.conftest import save_tiny_llama

    if kernel == "gather":
        monkeypatch.setenv(cpu_paged.ENV_SWITCH, "0")
    elif not cpu_paged.available(torch.device("cpu"), torch.float32, "flash"):
        pytest.skip("the CPU paged kernel is not available here")
    monkeypatch.setattr(loader, "load_tokenizer", lambda p: None)
    path = save_tiny_llama(tmp_path, seed=3, vocab_size=512)
    model, _, _ = loader.load_model(str(path), torch.device("cpu"), torch.float32, quantization="int8")
    prompts = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (5, 37, 12, 61)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)

    def run(**config):
        llm = LLM.from_engine(LLMEngine(EngineConfig(quantization="int8", block_size=8, **config), model, _Tokenizer()))
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], {**llm.stats(), **llm.engine.model_info()}

    alone, _ = run(paged=False, num_kv_blocks=64)
    batched, stats = run(num_kv_blocks=64)
    assert stats["attention_backend"] == ("cpu-paged" if kernel == "cpu-paged" else "sdpa") and batched == alone
    chunked_preempted, stats = run(num_kv_blocks=12, max_num_batched_tokens=16)
    assert stats["num_preemptions"] > 0 and chunked_preempted == alone


class _Tokenizer:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


@pytest.mark.parametrize("make", [
    lambda: EngineConfig(quantization="int3"),
    lambda: EngineConfig(quantization="int4"),
    lambda: loader.load_model(None, torch.device("cpu"), torch.float32, quantization="fp8"),
])
def test_an_unknown_quantization_is_one_line_naming_the_choice(make):
    with pytest.raises(ValueError) as e:
        make()
    message = str(e.value)
    assert "is unknown; use one of auto, none, gguf, q8_0, q4_0, q4_1, int8" in message and "\n" not in message


def test_an_engine_refuses_a_model_built_with_other_linear_layers(tmp_path, monkeypatch):
    from tests.conftest import save_tiny_llama

    monkeypatch.setattr(loader, "load_tokenizer", lambda p: None)
    model, _, _ = loader.load_model(str(save_tiny_llama(tmp_path)), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="built with quantization=None but the engine was asked for 'int8'"):
        LLMEngine(EngineConfig(num_kv_blocks=16, quantization="int8"), model, _Tokenizer())
