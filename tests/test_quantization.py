"""Linear layers as the loader builds them, whatever the mode: packed once at load, a quantized
mode's logits near float32's and its tokens independent of scheduling, short contexts, and bad
mode names (``int8``, removed, among them) as one-line errors.

Tolerance for a whole model: on a tiny random LLaMA each position's Q8_0 logits are within
3 % of float32's (relative L2 error of the logits row).
"""

from __future__ import annotations

import pytest
import torch

from nanovllm_core.config import INT8_REMOVED, EngineConfig
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_core.model import block_quant, cpu_linear, loader
from nanovllm_core.model.cpu_linear import FloatLinear
from nanovllm_core.model.quantization import linear_modules, linear_weight_bytes
from nanovllm_core.sampling_params import SamplingParams
from tests.test_model_parity import PROMPTS, VARIANTS, _load_without_tokenizer, contiguous_logits

LOGITS_TOLERANCE = 0.03  # relative L2 error per logits row, Q8_0 against float32


def test_each_linear_reports_its_bytes_per_weight():
    w = torch.randn(960, 576)
    assert FloatLinear(w).bytes_per_weight == 4.0 and FloatLinear(w).weight_bytes == 960 * 576 * 4
    q8 = block_quant.BlockLinear.from_float(w, "q8_0")
    assert q8.weight_bytes == 960 * 576 // 32 * 34  # 34 bytes a block of 32: 32 int8 weights and an fp16 scale
    assert q8.bytes_per_weight == 34 / 32


@pytest.mark.parametrize("variant", ["mha_untied", "mqa_bias"])  # an untied LM head; biases and one KV head
def test_q8_0_logits_stay_within_tolerance_of_float32(tmp_path, variant):
    from tests.conftest import save_tiny_llama

    path = save_tiny_llama(tmp_path, seed=1, **VARIANTS[variant])
    full, _, _ = _load_without_tokenizer(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "load_tokenizer", lambda p: None)
        q8, _, _ = loader.load_model(str(path), torch.device("cpu"), torch.float32, quantization="q8_0")
    assert q8.quantization == "q8_0"
    assert all(isinstance(m, block_quant.BlockLinear) and m.kind == "q8_0" for m in linear_modules(q8))
    for prompt in PROMPTS:
        want, got = contiguous_logits(full, prompt), contiguous_logits(q8, prompt)
        rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
        assert rel < LOGITS_TOLERANCE, (variant, len(prompt), rel)
    # 34 bytes per 32 weights against float32's 128: 3.76x fewer
    assert linear_weight_bytes(full) / linear_weight_bytes(q8) == pytest.approx(128 / 34)


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


@pytest.mark.parametrize("mode", ["q8_0", "q4_0"])
def test_a_mode_quantized_at_load_runs_with_a_short_context(tmp_path, monkeypatch, mode):
    """``max_model_len=32`` sizes the rotary tables for 32 positions; quantizing at load and a
    request that fills the context must run within them (issue 29 item 15: the removed int8
    mode's calibration pass once indexed past them, an IndexError at load)."""
    from tests.conftest import save_tiny_llama

    monkeypatch.setattr(loader, "load_tokenizer", lambda p: None)
    path = str(save_tiny_llama(tmp_path))
    model, _, _ = loader.load_model(path, torch.device("cpu"), torch.float32, max_model_len=32, quantization=mode)
    assert model.quantization == mode and model.rotary.max_position == 32
    engine = LLMEngine(EngineConfig(num_kv_blocks=16, max_model_len=32, quantization=mode), model, _Tokenizer())
    engine.add_request(list(range(5, 25)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    outputs = []
    for _ in range(40):
        outputs += [o for o in engine.step() if o.finished]
        if outputs:
            break
    assert len(outputs[0].outputs[0].token_ids) == 12  # 20 + 12 = 32 positions: the whole context


def test_q8_0_logprobs_are_bit_identical_however_the_tokens_are_scheduled(tmp_path, monkeypatch):
    """Alone, batched (decodes padded in groups), chunked, preempted: the same logprobs to the last bit.

    A random model's logits are near-ties everywhere, so a last-bit difference in attention,
    re-quantized by the next layer's int8 activations, would show here. The block kernel's
    rows ignore their batch and the CPU paged kernel sums in an order fixed by the token alone.
    """
    from nanovllm_core.attention import cpu_paged
    from nanovllm_core.llm import LLM
    from tests.conftest import save_tiny_llama

    if not cpu_paged.available(torch.device("cpu"), torch.float32, "flash"):
        pytest.skip("the CPU paged kernel is not available here")
    if block_quant.unavailable_reason() is not None:
        pytest.skip(f"the block kernel is not available here: {block_quant.unavailable_reason()}")
    monkeypatch.setattr(loader, "load_tokenizer", lambda p: None)
    path = save_tiny_llama(tmp_path, seed=3, vocab_size=512)
    model, _, _ = loader.load_model(str(path), torch.device("cpu"), torch.float32, quantization="q8_0")
    prompts = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (5, 37, 12, 61)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)

    def run(**config):
        llm = LLM.from_engine(LLMEngine(EngineConfig(quantization="q8_0", block_size=8, **config), model, _Tokenizer()))
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], {**llm.stats(), **llm.engine.model_info()}

    alone, _ = run(paged=False, num_kv_blocks=64)
    batched, stats = run(num_kv_blocks=64)
    assert stats["attention_backend"] == "cpu-paged" and batched == alone
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
    assert "is unknown; use one of auto, none, gguf, q8_0, q4_0, q4_1 (" in message and "\n" not in message


@pytest.mark.parametrize("make", [
    lambda: EngineConfig(quantization="int8"),
    lambda: EngineConfig(quantization="INT8", device="cpu"),
    lambda: loader.load_model(None, torch.device("cpu"), torch.float32, quantization="int8"),
])
def test_the_removed_int8_mode_is_one_line_naming_q8_0(make):
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value) == INT8_REMOVED
    assert "int8 was removed; use q8_0" in INT8_REMOVED and "\n" not in INT8_REMOVED


def test_the_cli_s_words_for_the_removed_int8_mode_are_the_engine_s():
    from nanovllm_core import cli_args

    assert cli_args.INT8_REMOVED == INT8_REMOVED


def test_an_engine_refuses_a_model_built_with_other_linear_layers(tmp_path, monkeypatch):
    from tests.conftest import save_tiny_llama

    monkeypatch.setattr(loader, "load_tokenizer", lambda p: None)
    model, _, _ = loader.load_model(str(save_tiny_llama(tmp_path)), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="built with quantization=None but the engine was asked for 'q8_0'"):
        LLMEngine(EngineConfig(num_kv_blocks=16, quantization="q8_0"), model, _Tokenizer())
