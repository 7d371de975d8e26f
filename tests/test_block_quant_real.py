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
    assert model.lm_head.packed.data_ptr() == model.embed_tokens.packed.data_ptr()
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


def test_each_engine_on_a_shared_model_gets_its_own_pool_pointers(make_llm):
    """The one-call layers' pointer tables follow the engines' KV caches: a second engine over the
    same model (as benchmarks and tests build them) writes into its own pools, never a freed one's."""
    import gc

    from nanovllm_core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = make_llm(quantization="gguf", num_kv_blocks=32)
    fused = first.engine.model.fused_layers
    want = first.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert first.engine.runner.kv_cache in fused._tables
    before = len(fused._tables)
    del first
    gc.collect()
    assert len(fused._tables) == before - 1  # the table kept no pool alive
    second = make_llm(quantization="gguf", num_kv_blocks=48)
    got = second.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids
    cache = second.engine.runner.kv_cache
    assert got == want and cache in fused._tables
    assert fused._tables[cache][0].k_pool == cache.k_by_head[0].data_ptr()


def test_two_engines_on_one_model_step_at_once_on_two_threads(make_llm):
    """The app runs a tutorial demo's engine beside the live one, over the same loaded model: both
    step at the same time (the C layers release the GIL). Each keeps its own pool pointers and
    gets the tokens it gets alone. A single shared table used to be swapped and freed under the
    other thread's running call: a segfault (issue 29)."""
    import threading

    from nanovllm_core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [["The capital of France is", "Once upon a time"], ["Water boils at", "Python is a language that"]]
    llms = [make_llm(quantization="gguf", num_kv_blocks=32), make_llm(quantization="gguf", num_kv_blocks=48)]
    alone = [[o.outputs[0].token_ids for o in llm.generate(p, params, use_tqdm=False)] for llm, p in zip(llms, prompts)]
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(i):
        try:
            for _ in range(3):
                got.setdefault(i, []).append(
                    [o.outputs[0].token_ids for o in llms[i].generate(prompts[i], params, use_tqdm=False)])
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and not any(t.is_alive() for t in threads)
    assert got == {0: [alone[0]] * 3, 1: [alone[1]] * 3}


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


# ----------------------------------------------------------------------------- the default: auto


def test_auto_keeps_the_file_s_blocks_on_the_cpu_and_says_why_not_elsewhere(real_model_gguf, monkeypatch):
    from nanovllm_core import native
    from nanovllm_core.model.quantization import resolve_quantization

    resolved = real_model_gguf[2]
    types = loader.gguf_tensor_types_cached(resolved)  # what auto reads: the file's header, kept beside it
    assert types["model.layers.0.self_attn.q_proj.weight"] == "q4_1" and types["model.norm.weight"] == "f32"
    cpu, f32, gguf_file = torch.device("cpu"), torch.float32, resolved.gguf_file

    def auto(**kw):
        args = dict(gguf_file=gguf_file, device=cpu, dtype=f32, tensor_types=types) | kw
        return resolve_quantization(None, args.pop("gguf_file"), args.pop("device"), args.pop("dtype"), **args)

    assert auto() == ("gguf", None)
    assert resolve_quantization("auto", gguf_file, cpu, f32, tensor_types=types) == ("gguf", None)
    # a named mode is built as asked, "none" as float: nothing is decided
    assert resolve_quantization("none", gguf_file, cpu, f32) == (None, None)
    assert resolve_quantization("q8_0", None, cpu, f32) == ("q8_0", None)
    for kw, why in [(dict(gguf_file=None), "the checkpoint is not a GGUF file"),
                    (dict(device=torch.device("cuda")), "the block kernels run on the CPU, not on cuda"),
                    (dict(dtype=torch.bfloat16), "block layers compute in float32, not bfloat16"),
                    (dict(tensor_parallel_size=2), "tensor parallelism (2 ranks)"),
                    (dict(tensor_types=types | {"model.layers.3.mlp.down_proj.weight": "q6_k"}),
                     "the file's linear layers are in q6_k")]:
        mode, note = auto(**kw)
        assert mode is None and note.startswith("auto chose float weights: " + why) and "\n" not in note, kw
    monkeypatch.setenv(bq.ENV_SWITCH, "0")
    mode, note = auto()
    assert mode is None and "block kernel is unavailable (NANOVLLM_BLOCK_KERNELS=0)" in note
    monkeypatch.delenv(bq.ENV_SWITCH)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("CC", "/nonexistent/cc")
    mode, note = auto()
    assert mode is None and "no C compiler" in note


def test_the_block_model_holds_no_float_copy_of_its_linear_weights(real_model_gguf, real_model):
    model = real_model_gguf[0]
    mods = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert all(isinstance(m, bq.BlockLinear) for m in mods) and isinstance(model.embed_tokens, bq.BlockEmbedding)
    # float parameters left: the RMSNorm weights only (61 x 576 float32 = 140,544 bytes)
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert float_bytes == (2 * model.config.num_hidden_layers + 1) * model.config.hidden_size * 4
    assert model.quantization == "gguf" and model.quantization_requested == "gguf"
    # built from the file's tensors straight away, they are the blocks the float model was dequantized from
    qkv, float_qkv = model.layers[7].self_attn.qkv_proj, real_model[0].layers[7].self_attn.qkv_proj.weight
    assert torch.equal(qkv.dequantized(), float_qkv)


def test_the_cli_default_runs_the_embedded_model_s_blocks_and_says_so(real_model_gguf, monkeypatch, capsys):
    asked = []

    def load_shared(model, device, dtype, max_model_len=None, progress=None, quantization=None):
        asked.append(quantization)
        return real_model_gguf

    monkeypatch.setattr(loader, "load_model", load_shared)
    code, out, err = run_main(cli.main, capsys, "--max-tokens", "2", "--num-kv-blocks", "64")
    assert code == 0, err
    assert asked == [None]  # auto: the loader decides
    assert "gguf weights (q4_1 66 MB + q8_0 30 MB (96 MB of weights))" in out
