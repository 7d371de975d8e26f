"""The embedded model with its GGUF blocks kept (``--quantization gguf``): the file's bytes run as
shipped, the one-call decoder layers equal the step-by-step model bit for bit, and greedy output
does not depend on scheduling within the mode (alone, batched, chunked, prefix-cached, preempted).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm_core import cli
from nanovllm_core.model import block_quant as bq
from nanovllm_core.model import loader
from nanovllm_core.model.quantization import QUANTIZATION_CHOICES, weight_formats
from tests.conftest import run_main
from tests.test_engine_equivalence import PRIORITIES, run

pytestmark = pytest.mark.real_model


def test_the_files_blocks_run_as_shipped(real_model_gguf, real_model):
    import gguf

    model, _, resolved = real_model_gguf
    assert model.quantization == "gguf" and model.quantization_note is None
    # The GGUF's own bytes: layer 0's o_proj (no rotary reordering) is the file's tensor, byte for byte.
    reader = gguf.GGUFReader(str(resolved.gguf_file))
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_output.weight")
    o = model.layers[0].self_attn.o_proj
    assert isinstance(o, bq.BlockLinear) and o.kind == "q4_1"
    assert np.array_equal(o.blocks.numpy(), np.asarray(raw.data))
    # q/k rows moved back to Hugging Face's rotary order: the blocks stand for the float model's weights.
    float_model = real_model[0]
    assert torch.equal(model.layers[3].self_attn.qkv_proj.dequantized(), float_model.layers[3].self_attn.qkv_proj.weight)
    assert torch.equal(model.layers[3].mlp.gate_up_proj.dequantized(), float_model.layers[3].mlp.gate_up_proj.weight)
    # The embedding stays Q8_0 and the tied LM head reads the same blocks; no float32 copy of any weight.
    assert isinstance(model.embed_tokens, bq.BlockEmbedding) and model.embed_tokens.kind == "q8_0"
    assert model.lm_head.blocks.data_ptr() == model.embed_tokens.blocks.data_ptr()
    formats = weight_formats(model)
    assert set(formats) == {"q4_1", "q8_0"}, formats
    assert 90e6 < sum(formats.values()) < 100e6  # the file is 98 MB
    ids = torch.tensor([0, 2, 49151])
    assert torch.equal(model.embed_tokens(ids), float_model.embed_tokens(ids))


def test_one_call_layers_equal_the_step_by_step_model(make_llm):
    from nanovllm_core.sampling_params import SamplingParams

    llm = make_llm(quantization="gguf", max_num_batched_tokens=24)  # chunked prefill and decode steps
    model = llm.engine.model
    assert model.fused_layers is not None
    logits = []
    original = model.compute_logits
    model.compute_logits = lambda h: logits.append(original(h)) or logits[-1]
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        prompts = ["The capital of France is", "Water boils at a temperature of one hundred degrees"]
        fused = llm.generate(prompts, params, use_tqdm=False)
        fused_logits, logits[:] = list(logits), []
        fused_layers, model.fused_layers = model.fused_layers, None
        try:
            stepwise = llm.generate(prompts, params, use_tqdm=False)
        finally:
            model.fused_layers = fused_layers
    finally:
        model.compute_logits = original
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in stepwise]
    assert len(fused_logits) == len(logits) >= 6  # a step each: the chunked prefill, then decodes
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, logits))


@pytest.fixture(scope="module")
def gguf_reference(make_llm):
    tokens, _ = run(make_llm, quantization="gguf", max_num_seqs=1)  # one prompt at a time
    return tokens


@pytest.mark.parametrize("settings, check", [
    (dict(), lambda s: True),
    (dict(max_num_batched_tokens=32), lambda s: True),
    (dict(max_num_seqs=2), lambda s: s["prefix_cache_hits"] > 0),
    (dict(num_kv_blocks=12, max_num_batched_tokens=64), lambda s: s["num_preemptions"] > 0),
    (dict(priority=PRIORITIES, num_kv_blocks=14, block_size=8), lambda s: s["num_preemptions"] > 0),
], ids=["batch", "chunked", "prefix-cached", "preempted", "priority-preempted"])
def test_gguf_greedy_tokens_do_not_depend_on_scheduling(make_llm, gguf_reference, settings, check):
    tokens, stats = run(make_llm, quantization="gguf", **settings)
    assert check(stats), stats
    assert tokens == gguf_reference


def test_cli_quantization_gguf_says_which_formats_run(capsys, monkeypatch, real_model_gguf):
    asked = []

    def load_shared(model, device, dtype, max_model_len=None, progress=None, quantization=None):
        asked.append(quantization)
        return real_model_gguf

    monkeypatch.setattr(loader, "load_model", load_shared)
    code, out, err = run_main(cli.main, capsys, "--quantization", "gguf", "--max-tokens", "6", "--num-kv-blocks", "64")
    assert code == 0, err
    assert asked == ["gguf"]
    assert "Paris" in out.split("Completion:")[1]
    assert "gguf weights (q4_1 66 MB + q8_0 30 MB (96 MB of weights))" in out


def test_cli_choices_are_the_engines():
    assert cli.QUANTIZATION_CHOICES == QUANTIZATION_CHOICES


def test_gguf_mode_on_a_model_that_is_not_a_gguf_file_is_one_line(default_model_dir):
    with pytest.raises(loader.ModelLoadError, match=r"keeps a GGUF file's own blocks, but .* is not a \.gguf file; use "
                                                    r"q8_0, q4_0 or q4_1 to quantize it at load, or none$"):
        loader.load_model(str(default_model_dir), torch.device("cpu"), torch.float32, quantization="gguf")
