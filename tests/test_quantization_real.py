"""int8 weights on the real model: from the CLI, through ``LLM``, and greedy outputs that do not
depend on scheduling *within* int8 mode (batch vs alone, chunked, preempted, prefix-cached).

int8 is not float32: its tokens may differ from float32's after a while (the benchmark
measures how often). Within int8 every token's logits are computed the same whatever else
shares its step: the int8 products are exact and per token, and attention is batch-invariant
(the CPU paged kernel's fixed summation order, or float64 sums where that kernel cannot run;
``nanovllm_core.model.quantization.attention_sum_dtype`` says why), so the tokens must be
equal, token for token.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm_core import cli
from nanovllm_core.educational.tutorial import chapter, model_facts
from nanovllm_core.educational.xray import layer_dims
from nanovllm_core.educational.xray_costs import SeqAttention, layer_ops
from nanovllm_core.llm import LLM
from nanovllm_core.model import loader
from tests.conftest import run_main
from tests.test_engine_equivalence import PRIORITIES, run

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def int8_reference(make_llm):
    tokens, _ = run(make_llm, quantization="int8", paged=False)  # the contiguous baseline, one prompt at a time
    return tokens


@pytest.mark.parametrize("settings, check", [
    (dict(), lambda s: True),                                                   # one batch
    (dict(max_num_batched_tokens=32), lambda s: True),                          # every long prompt chunked
    (dict(max_num_seqs=2), lambda s: s["prefix_cache_hits"] > 0),               # later prompts hit the cache
    (dict(num_kv_blocks=12, max_num_batched_tokens=64), lambda s: s["num_preemptions"] > 0),
    (dict(priority=PRIORITIES, num_kv_blocks=14, block_size=8), lambda s: s["num_preemptions"] > 0),
], ids=["batch", "chunked", "prefix-cached", "preempted", "priority-preempted"])
def test_int8_greedy_tokens_do_not_depend_on_scheduling(make_llm, int8_reference, settings, check):
    tokens, stats = run(make_llm, quantization="int8", **settings)
    assert check(stats), stats
    assert tokens == int8_reference


def test_cli_quantization_int8_loads_int8_layers_and_completes(capsys, monkeypatch, real_model_int8):
    asked = []

    def load_shared(model, device, dtype, max_model_len=None, progress=None, quantization=None):
        asked.append(quantization)  # the flag reached the loader; the session's int8 model is that load's result
        return real_model_int8

    monkeypatch.setattr(loader, "load_model", load_shared)
    code, out, err = run_main(cli.main, capsys, "--quantization", "int8", "--max-tokens", "6", "--num-kv-blocks", "64")
    assert code == 0, err
    assert asked == ["int8"]
    assert "Paris" in out.split("Completion:")[1]
    assert "int8 weights" in out


def test_cli_unknown_quantization_exits_2_with_one_line(capsys):
    code, out, err = run_main(cli.main, capsys, "--quantization", "int3")
    assert code == 2
    assert err.strip().count("\n") == 0 and "--quantization: invalid choice: 'int3'" in err


def test_llm_unknown_quantization_raises_one_line_before_loading():
    with pytest.raises(ValueError, match=r"^quantization='int4' is unknown; use one of auto, none, gguf, q8_0, q4_0, q4_1, int8 "):
        LLM(quantization="int4")


def test_int8_model_reports_a_quarter_of_the_bytes(make_engine):
    float_engine, int8_engine = make_engine(), make_engine(quantization="int8")
    float_info, int8_info = float_engine.model_info(), int8_engine.model_info()
    assert float_info["quantization"] is None and int8_info["quantization"] == "int8"
    ratio = float_info["linear_weight_bytes"] / int8_info["linear_weight_bytes"]
    # 538 MB -> 149 MB on SmolLM2-135M: int8 weights, scales (~0.5 %) and 16 outlier columns a layer in float32 (~10 %)
    assert 3.5 < ratio < 3.7
    assert int8_info["linear_weight_bytes"] == float_info["int8_linear_weight_bytes"]  # the float engine's forecast
    # The X-Ray's bytes per operation use the weights and K/V as this engine stores them.
    f32_dims, int8_dims = layer_dims(float_engine), layer_dims(int8_engine)
    assert f32_dims.weight_elem == 4 and f32_dims.kv_elem == 4
    qkv = int8_engine.model.layers[0].self_attn.qkv_proj
    assert int8_dims.linear_weight_bytes[0] == qkv.weight_bytes  # each op's own bytes, not an average
    one = SeqAttention(1, 10, 10)
    op = next(o for o in layer_ops(int8_dims, [one], "fused", one) if o.name == "qkv_proj")
    assert op.bytes == qkv.weight_bytes + (576 + 960) * 4  # the weights as stored, one token in and out in float32
    # K/V: float32 on the batch-invariant CPU paged kernel, float64 where the gather path runs instead.
    kv_elem, kv_dtype = (4, "float32") if int8_info["attention_backend"] == "cpu-paged" else (8, "float64")
    assert 1.1 < int8_dims.weight_elem < 1.3 and int8_dims.kv_elem == kv_elem and int8_info["kv_dtype"] == kv_dtype
    # The tutorial's decode chapter reads these numbers from the engine in use.
    decode = " ".join(model_facts(chapter("decode"), int8_info))
    assert f"reads its {int8_info['linear_weight_bytes'] / 2**20:,.0f} MiB of int8" in decode
    assert f"{float_info['linear_weight_bytes'] / int8_info['linear_weight_bytes']:.1f}x the bytes" in decode


def test_gguf_model_reports_its_blocks_bytes_and_the_teaching_uses_them(make_engine):
    """The int8 test above, for the file's own blocks: every figure recomputed from the shapes and the block sizes."""
    from nanovllm_core.model.block_quant import FORMATS

    float_engine, gguf_engine = make_engine(), make_engine(quantization="gguf")
    float_info, info = float_engine.model_info(), gguf_engine.model_info()
    assert info["quantization"] == "gguf" and info["weight_kinds"] == "q4_1+q8_0"
    q4_1, q8_0 = FORMATS["q4_1"].block_bytes, FORMATS["q8_0"].block_bytes  # 20 and 34 bytes per 32 weights
    per_layer = sum(n * k // 32 * q4_1 for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)))
    head = 49152 * 576 // 32 * q8_0  # the tied LM head reads the embedding's Q8_0 blocks
    assert info["linear_weight_bytes"] == 30 * per_layer + head  # linear layers + LM head, nothing else
    assert info["linear_weights"] == float_info["linear_weights"]
    # The X-Ray's bytes per operation: each BlockLinear's own weight_bytes, activations in float32.
    dims = layer_dims(gguf_engine)
    assert dims.weight_elem == q4_1 / 32 and dims.linear_kinds == ("q4_1",) * 4
    qkv = gguf_engine.model.layers[0].self_attn.qkv_proj
    assert dims.linear_weight_bytes[0] == qkv.weight_bytes == 960 * 576 // 32 * q4_1
    one = SeqAttention(1, 10, 10)
    op = next(o for o in layer_ops(dims, [one], "cpu_paged", one) if o.name == "qkv_proj")
    assert op.bytes == qkv.weight_bytes + (576 + 960) * 4
    assert "int8" not in op.math and "Q4_1 blocks" in op.math
    # The tutorial's decode chapter reads these numbers from the engine in use.
    decode = " ".join(model_facts(chapter("decode"), info))
    b = info["linear_weight_bytes"] / info["linear_weights"]
    assert f"reads its {info['linear_weight_bytes'] / 2**20:,.0f} MiB of q4_1+q8_0 block ({b:.3f} bytes a weight" in decode
    assert f"{float_info['linear_weight_bytes'] / info['linear_weight_bytes']:.1f}x the bytes" in decode
    assert "--quantization int8" not in decode
    kv = " ".join(model_facts(chapter("kv_cache"), info))
    assert f"block linear layers and LM head take {info['linear_weight_bytes'] / 2**20:,.0f} MiB" in kv
    assert "M parameters in float32" not in kv  # the float figure is not what this engine holds


def test_the_tutorials_demonstrations_run_in_the_quantization_asked_for(capsys, monkeypatch, real_model_int8):
    from nanovllm_core.educational import tutorial_demos

    # The CLI's --tutorial hands --quantization to the demonstrations' engines (it used to drop it).
    made = []

    class Spy(tutorial_demos.EngineDemos):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

        def load(self):
            self._loaded = real_model_int8
            return super().load()

    monkeypatch.setattr(tutorial_demos, "EngineDemos", Spy)
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("q\n"))
    run_main(cli.main, capsys, "--quantization", "int8", "--tutorial", "--tutorial-chapter", "5")
    assert made and made[0].quantization == "int8"
    # ... and demonstrations over an already loaded int8 model (the app's) build int8 engines.
    demos = tutorial_demos.EngineDemos.from_loaded(*real_model_int8)
    info = demos.engine().model_info()
    assert info["quantization"] == "int8" and info["kv_dtype"] == ("float32" if info["attention_backend"] == "cpu-paged"
                                                                   else "float64")
    # Their roofline is int8's own (the demonstrations measured it): oneDNN's int8 peak, not float32's.
    from nanovllm_core import roofline

    roof = roofline.cached("cpu", torch.float32, None, "int8")
    assert roof is not None and info["machine"] == roof.machine and roof.machine.split(";")[0].endswith("int8 weights")  # (a busy host adds why after ";")
    assert info["peak_flops"] == roof.peak_flops
    assert "int8 matmul peak" in " ".join(model_facts(chapter("prefill"), info))
