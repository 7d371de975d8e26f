"""Quantization choices on the real model and its tokenizer: bad names and the removed int8 mode
as one-line errors at every entry point, a mode quantized at load with a short context, the
bytes a block model reports and the teaching built on them, and the tutorial's demonstrations
in the mode asked for. Greedy tokens within a block mode not depending on scheduling:
``tests/test_block_quant_real.py`` (the file's blocks) and ``tests/test_quantization.py`` (Q8_0).
"""

from __future__ import annotations

import pytest
import torch

from nanovllm_core import cli
from nanovllm_core.config import INT8_REMOVED
from nanovllm_core.educational.tutorial import chapter, model_facts
from nanovllm_core.educational.xray import layer_dims
from nanovllm_core.educational.xray_costs import SeqAttention, layer_ops
from nanovllm_core.llm import LLM
from nanovllm_core.sampling_params import SamplingParams
from tests.conftest import run_main

pytestmark = pytest.mark.real_model


def test_cli_unknown_quantization_exits_2_with_one_line(capsys):
    code, out, err = run_main(cli.main, capsys, "--quantization", "int3")
    assert code == 2
    assert err.strip().count("\n") == 0 and "--quantization: invalid choice: 'int3'" in err


def test_cli_quantization_int8_exits_2_naming_q8_0(capsys):
    code, out, err = run_main(cli.main, capsys, "--quantization", "int8")
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and f"argument --quantization: {INT8_REMOVED}" in err


def test_llm_unknown_quantization_raises_one_line_before_loading():
    with pytest.raises(ValueError, match=r"^quantization='int4' is unknown; use one of auto, none, gguf, q8_0, q4_0, q4_1 "):
        LLM(quantization="int4")


def test_llm_quantization_int8_raises_one_line_naming_q8_0_before_loading():
    with pytest.raises(ValueError) as e:
        LLM(quantization="int8", max_model_len=32)
    assert str(e.value) == INT8_REMOVED


@pytest.mark.parametrize("mode", ["q8_0", "q4_0"])
def test_llm_and_cli_quantize_at_load_with_a_short_context(tiny_llama_dir, capsys, mode):
    """Issue 29 item 15 for the modes quantized at load: ``LLM(quantization=..., max_model_len=32)``
    and the CLI's ``--max-model-len 64`` load and generate (the removed int8 mode crashed at load)."""
    llm = LLM(model=str(tiny_llama_dir), quantization=mode, max_model_len=32, num_kv_blocks=16)
    assert llm.engine.model.quantization == mode and llm.engine.max_model_len == 32
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, ignore_eos=True)
    assert len(llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids) == 8
    code, out, err = run_main(cli.main, capsys, "--model", str(tiny_llama_dir), "--quantization", mode,
                              "--max-model-len", "64", "--max-tokens", "4", "--num-kv-blocks", "16")
    assert code == 0, err
    assert f"{mode} weights" in out


def test_gguf_model_reports_its_blocks_bytes_and_the_teaching_uses_them(make_engine):
    """The file's own blocks: every figure recomputed from the shapes and the block sizes."""
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
    assert f"reads its {info['linear_weight_bytes'] / 2**20:.1f} MiB of q4_1+q8_0 block ({b:.3f} bytes a weight" in decode
    assert f"{float_info['linear_weight_bytes'] / info['linear_weight_bytes']:.1f}x the bytes" in decode
    assert "--quantization q8_0 the same" not in decode  # the float engine's forecast, not this one's
    kv = " ".join(model_facts(chapter("kv_cache"), info))
    assert f"block linear layers and LM head take {info['linear_weight_bytes'] / 2**20:.1f} MiB" in kv
    assert "M parameters in float32" not in kv  # the float figure is not what this engine holds


def test_the_tutorials_demonstrations_run_in_the_quantization_asked_for(capsys, monkeypatch, real_model_gguf):
    from nanovllm_core.educational import tutorial_demos

    # The CLI's --tutorial hands --quantization to the demonstrations' engines (it used to drop it).
    made = []

    class Spy(tutorial_demos.EngineDemos):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

        def load(self):
            self._loaded = real_model_gguf
            return super().load()

    monkeypatch.setattr(tutorial_demos, "EngineDemos", Spy)
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("q\n"))
    run_main(cli.main, capsys, "--quantization", "gguf", "--tutorial", "--tutorial-chapter", "5")
    assert made and made[0].quantization == "gguf"
    # ... and demonstrations over an already loaded block model (the app's) build block engines.
    demos = tutorial_demos.EngineDemos.from_loaded(*real_model_gguf)
    info = demos.engine().model_info()
    assert info["quantization"] == "gguf" and info["kv_dtype"] == "float32"
    # Their roofline names the block weights; its peak is the float matmul's, and the block kernels' beside it.
    from nanovllm_core import roofline

    from nanovllm_core.educational.xray import engine_roofline

    roof = roofline.cached("cpu", torch.float32, None, "gguf")
    assert roof is not None and roof.machine.split(";")[0].endswith("gguf weights")  # (a busy host adds why after ";")
    assert info["machine"] == engine_roofline(demos.engine(), measure=False).machine  # a busy block kernel adds its own
    assert info["peak_flops"] == roof.peak_flops == roofline.cached("cpu", torch.float32, None).peak_flops
    assert "float matmul peak" in " ".join(model_facts(chapter("prefill"), info))
    prefill = " ".join(model_facts(chapter("prefill"), info))
    if dict(info["block_peaks"]).get("q4_1"):  # measured on a quiet host: the block kernel's own peak is named
        assert "Q4_1 block kernel peak" in prefill
    else:  # a busy host's block peak is not trusted (trial 15a): the chapter says so instead of a verdict
        assert "measured on a busy host" in prefill and "python -m nanovllm_core.roofline" in prefill, prefill
