"""X-Ray in block modes: the block it draws is the format's layout and a real block, each linear op names
its format and moves its BlockLinear's bytes, and a layer's compute-bound crossing moves by the ratio of
ridges over the ratio of bytes per weight. Each figure is recomputed here from first principles."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from nanovllm_core import events as ev
from nanovllm_core import roofline
from nanovllm_core.educational import xray_blocks as xb
from nanovllm_core.educational.xray_costs import (LayerDims, SeqAttention, crossing_shift, layer_ops,
                                                  linear_crossing_tokens, model_edge_ops)
from nanovllm_core.model.block_quant import FORMATS, BlockLinear

SMOL = LayerDims(hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64, elem=4)
LINEAR = ("qkv_proj", "o_proj", "mlp_gate_up", "mlp_down")


def trace_with(tensors=(), ops=(), layer=0) -> ev.LayerTrace:
    return ev.LayerTrace(step=0, request_id="0", layer=layer, num_layers=1, tensors=tuple(tensors), ops=tuple(ops),
                         num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, kv_bytes_per_token=46080)


def decode_by_hand(raw: bytes, name: str) -> np.ndarray:
    """The 32 weights of one block, from ggml's layout written out again with numpy (not block_quant's code)."""
    d = float(np.frombuffer(raw[0:2], dtype="<f2")[0])
    if name == "q8_0":
        return d * np.frombuffer(raw[2:34], dtype=np.int8).astype(np.float64)
    packed = np.frombuffer(raw[4:] if name == "q4_1" else raw[2:], dtype=np.uint8)
    q = np.concatenate([packed & 15, packed >> 4]).astype(np.float64)  # weight j low nibble, j + 16 high
    if name == "q4_1":
        return d * q + float(np.frombuffer(raw[2:4], dtype="<f2")[0])
    return d * (q - 8)


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_drawn_block_is_the_formats_layout_and_a_real_block(name):
    fmt = FORMATS[name]
    layer = BlockLinear.from_float(torch.randn(64, 96, generator=torch.Generator().manual_seed(3)), name)
    raw = bytes(layer.blocks[0, :fmt.block_bytes].tolist())
    info = xb.block_tensor(layer)
    assert info.name == xb.BLOCK_TENSOR_AT_LOAD and info.shape == (64, 3, fmt.block_bytes)
    s = xb.from_trace(trace_with([info]))
    assert s.format is fmt and (s.rows, s.in_features) == (64, 96)
    assert xb.from_trace(ev.from_json(ev.to_json(trace_with([info])))) == s  # what a remote app receives
    # d, m and q are the block's own bytes; the weights are what ggml's layout decodes them to
    expect = decode_by_hand(raw, name)
    assert s.d == float(np.frombuffer(raw[0:2], dtype="<f2")[0])
    assert (s.m is None) == (name != "q4_1")
    assert np.allclose(s.w, expect[:xb.SHOWN], rtol=1e-6, atol=1e-7)
    assert np.allclose(s.w, layer.dequantized()[0, :xb.SHOWN].numpy())
    q = np.asarray(s.q, dtype=np.float64)
    by_formula = {"q8_0": s.d * q, "q4_0": s.d * (q - 8), "q4_1": s.d * q + (s.m or 0.0)}[name]
    assert np.allclose(by_formula, s.w, rtol=1e-5, atol=1e-6)  # the formula printed beside them holds
    # the drawing's byte counts add up to the format's block, and its words are the format's
    lines = xb.block_lines(trace_with([info]))
    sizes = [int(n) for n in re.findall(r"(\d+) bytes", lines[5].split("=")[0])]
    assert sum(sizes) == fmt.block_bytes == (2 + 32 if name == "q8_0" else 2 + 16 + (2 if name == "q4_1" else 0))
    assert f"= {fmt.block_bytes} bytes for 32 weights" in lines[5]
    assert f"{fmt.block_bytes}/32 = {fmt.bytes_per_weight:g} bytes a weight" in lines[0]
    assert ("m       " in lines[2]) == (name == "q4_1")
    assert f"64 rows x 3 blocks x {fmt.block_bytes} bytes = {layer.weight_bytes:,} bytes" in lines[-1]
    assert "activations" in lines[0]  # what the kernel does with them is said once, from block_quant
    # where the block came from: quantized here at load, or a checkpoint's own (trial 5: both read "as the file stores it")
    assert any("made at load" in line and "not as the checkpoint stores them" in line for line in lines)
    assert not any("as the file stores it" in line for line in lines)
    shipped = BlockLinear(layer.blocks, name, 96)  # blocks as a GGUF file hands them over
    assert not shipped.quantized_at_load and xb.block_tensor(shipped).name == xb.BLOCK_TENSOR
    shipped_lines = xb.block_lines(trace_with([xb.block_tensor(shipped)]))
    assert any("as the file stores it" in line for line in shipped_lines)
    assert not any("made at load" in line for line in shipped_lines)


def test_a_4_bit_block_keeps_weight_j_in_the_low_nibble_and_j_plus_16_in_the_high():
    raw = bytearray(20)
    raw[0:2] = np.float16(0.5).tobytes()
    raw[2:4] = np.float16(-1.0).tobytes()
    raw[4] = 0x3A  # q[0] = 0xA, q[16] = 0x3
    d, m, q = xb.read_block(bytes(raw), FORMATS["q4_1"])
    assert (d, m, q[0], q[16], q[1]) == (0.5, -1.0, 10, 3, 0)
    with pytest.raises(ValueError, match="20 bytes, not 18"):
        xb.read_block(bytes(18), FORMATS["q4_1"])


def test_the_kernels_activations_are_named_only_as_block_quant_states_them(monkeypatch):
    from nanovllm_core.model import block_formats as block_quant  # where the phrase lives (no torch)

    monkeypatch.delattr(block_quant, "ACTIVATIONS", raising=False)
    assert xb.activations_note() == "float32 activations in and out"
    monkeypatch.setattr(block_quant, "ACTIVATIONS", "quantized to Q8 per block of 32 inside the kernel", raising=False)
    assert xb.activations_note() == "activations: quantized to Q8 per block of 32 inside the kernel"


def test_each_linear_op_names_its_own_format_and_moves_its_stored_bytes():
    one = [SeqAttention(1, 10, 10)]
    h, i, qkv = 576, 1536, 960
    counts = (h * qkv, h * h, h * 2 * i, i * h)
    for name, fmt in FORMATS.items():
        stored = tuple(n // 32 * fmt.block_bytes for n in counts)
        d = replace(SMOL, weight_elem=fmt.bytes_per_weight, linear_weight_bytes=stored, linear_kinds=(name,) * 4)
        ops = {o.name: o for o in layer_ops(d, one, "cpu_paged")}
        for op_name, w, (k, n) in zip(LINEAR, stored, ((h, qkv), (h, h), (h, 2 * i), (i, h))):
            assert f"W in {name.upper()} blocks, {fmt.block_bytes} bytes per 32 weights" in ops[op_name].math
            assert ops[op_name].bytes == w + (k + n) * 4  # blocks once + one token in and out, float32
        assert not any("W in " in o.math for o in ops.values() if o.name not in LINEAR)
    mixed = replace(SMOL, linear_kinds=("q4_1", "float32", "q4_0", "q8_0"))
    math_ = {o.name: o.math for o in layer_ops(mixed, one, "cpu_paged")}
    assert "Q4_1" in math_["qkv_proj"] and "blocks" not in math_["o_proj"] and "Q4_0" in math_["mlp_gate_up"]
    assert "Q8_0" in math_["mlp_down"]
    # narrow weights of no known format (an engine that did not report its kinds) name none
    unknown = replace(SMOL, weight_elem=1.1)
    assert not any("W in " in o.math for o in layer_ops(unknown, one, "cpu_paged"))


def test_the_embedding_lookup_reads_one_stored_row_a_token():
    h, v = 576, 49152
    q8_row = h // 32 * 34  # 612 bytes
    edges = {o.name: o for o in model_edge_ops(h, v, 4, v * q8_row, 5, 1, q8_row, "q8_0")}
    assert edges["embedding_lookup"].bytes == 5 * q8_row + 5 * h * 4  # rows read as stored, written as float32
    assert "Q8_0 blocks" in edges["embedding_lookup"].math
    assert edges["lm_head"].bytes == v * q8_row + h * 4 + v * 4  # the whole matrix, however few rows sample
    plain = {o.name: o for o in model_edge_ops(h, v, 4, v * h * 4, 5, 1)}
    assert plain["embedding_lookup"].bytes == 2 * 5 * h * 4 and "blocks" not in plain["embedding_lookup"].math


def test_a_block_roofline_without_its_kernels_peak_says_it_is_the_float_matmuls():
    from nanovllm_core.educational.xray_costs import peak_words

    words = peak_words("a CPU (2 threads), float32, gguf weights", 5.6e10)
    assert words.startswith("float matmul peak 56.0 GFLOP/s") and "not measured" in words
    assert peak_words("a CPU (2 threads), float32", 5.6e10) == "matmul peak 56.0 GFLOP/s"


# ------------------------------------------------------------------------------ where a layer turns compute-bound


def first_compute_bound(d: LayerDims, op: str, ridge: float, limit: int = 1 << 14) -> float:
    """Brute force over layer_ops: the fewest tokens at which ``op`` reaches ``ridge`` (inf if none up to limit)."""
    for t in range(1, limit):
        o = next(o for o in layer_ops(d, [SeqAttention(t, t, t)], "cpu_paged") if o.name == op)
        if o.flops / o.bytes >= ridge:
            return t
    return math.inf


@pytest.mark.parametrize("b", [4.0, 1.1, 20 / 32])
def test_the_linear_crossing_formula_agrees_with_the_ops_own_bytes(b):
    """T* = R b N K / (2 N K - R (N + K) e), against the first T at which the op's own FLOP/byte reaches R."""
    d = replace(SMOL, weight_elem=b)
    for ridge in (2.0, 7.3, 40.0):
        expected = linear_crossing_tokens(576, 960, b, 4, ridge)
        assert first_compute_bound(d, "qkv_proj", ridge) == math.ceil(expected)
    cap = 2 * 576 * 960 / ((576 + 960) * 4)  # float32 activations cap the op's intensity here
    assert linear_crossing_tokens(576, 960, b, 4, cap * 1.01) == math.inf


def test_the_crossing_moves_by_the_ridge_ratio_over_the_bytes_ratio_not_the_ridge_ratio():
    """A kernel whose peak is 12x float32's over weights of 1.1 bytes, same bandwidth: ~3.3x more tokens, not 12x."""
    r32, r8 = 1.0, 12.0  # a small ridge, so the activation term is small against 2 N K
    t32 = linear_crossing_tokens(576, 960, 4.0, 4, r32)
    t8 = linear_crossing_tokens(576, 960, 1.1, 4, r8)
    shift = crossing_shift(r8 / r32, 4.0 / 1.1)
    assert shift == pytest.approx(12 / (4 / 1.1)) and shift == pytest.approx(3.3, abs=0.01)
    assert t8 / t32 == pytest.approx(shift, rel=0.15) and t8 / t32 < 12 / 2
    # Q4_1 (20 bytes a block) at float32's own ridge: the crossing comes 6.4x sooner, a ridge ratio of 1
    t4 = linear_crossing_tokens(576, 960, 20 / 32, 4, r32)
    assert t32 / t4 == pytest.approx(1 / crossing_shift(1.0, 4.0 / (20 / 32)), rel=0.01)


def test_the_roofline_docstring_states_the_re_derived_crossing():
    doc = " ".join(roofline.__doc__.split())
    assert "the crossing moves by the ratio of ridges divided by the ratio of bytes per weight" in doc
    assert "T* = R b N K / (2 N K - R (N + K) e)" in doc
    assert "up to ~12x more tokens" not in doc
    assert "~3.3x more tokens" in doc and f"{crossing_shift(12, 4 / 1.1):.1f}" == "3.3"


# ------------------------------------------------------------------------------ the real model, gguf


@pytest.mark.real_model
def test_the_xray_of_a_gguf_engine_draws_its_own_blocks_and_counts_their_bytes(make_engine):
    from nanovllm_core import SamplingParams
    from nanovllm_core.educational.xray import layer_dims

    engine = make_engine(quantization="gguf", num_kv_blocks=32)
    events: list[ev.Event] = []
    sub = engine.subscribe(events.append, topk=0, blocks=False, xray=True)
    try:
        engine.select_xray(None, layer=0, head=0)
        engine.add_request("Hi", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_id="x")
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.unsubscribe(sub)
    traces = [e for e in events if isinstance(e, ev.LayerTrace)]
    assert traces
    model = engine.model
    for t in traces[:3]:
        qkv = model.layers[t.layer].self_attn.qkv_proj
        s = xb.from_trace(t)
        assert s is not None and s.format is qkv.format and qkv.kind == "q4_1"  # the embedded file's Q4_1
        raw = bytes(qkv.blocks[0, :qkv.format.block_bytes].tolist())
        assert np.allclose(s.w, decode_by_hand(raw, qkv.kind)[:xb.SHOWN], rtol=1e-6, atol=1e-7)
        assert s.m == float(np.frombuffer(raw[2:4], dtype="<f2")[0])
        ops = {o.name: o for o in t.ops}
        T = t.num_batch_tokens
        assert ops["qkv_proj"].bytes == qkv.weight_bytes + T * (576 + 960) * 4
        assert ops["mlp_down"].bytes == model.layers[t.layer].mlp.down_proj.weight_bytes + T * (1536 + 576) * 4
        assert "Q4_1 blocks, 20 bytes per 32 weights" in ops["qkv_proj"].math
        text = " ".join(xb.block_lines(t))
        assert f"= {qkv.weight_bytes:,} bytes (float32: {960 * 576 * 4:,})" in text
        assert f"moved {ops['qkv_proj'].bytes:,} bytes" in text
    dims = layer_dims(engine)
    assert dims.linear_kinds == ("q4_1",) * 4
    assert dims.linear_weight_bytes[0] == 960 * 576 // 32 * 20
    # Each projection is judged against the Q4_1 kernel that ran it, timed on these weights (trial 14c).
    from nanovllm_core.educational import xray_facts as facts
    from nanovllm_core.educational.xray_costs import compute_bound_tokens

    t = traces[0]
    peaks = dict(t.kernel_peaks)
    if "q4_1" not in peaks:  # timed on a busy host (trial 15a): left out, and the machine line says why
        # "the Q4_1 kernel's peak could not ..." or, when the Q8_0 head's was busy too, "the Q4_1 and
        # Q8_0 kernels' peaks could not ...": which of the two a loaded host spoils varies run to run.
        named = t.machine.split("could not be measured reliably")[0].rsplit("; the ", 1)[-1]
        assert "could not be measured reliably" in t.machine and "Q4_1" in named, t.machine
        assert facts.bound(t, next(o for o in t.ops if o.name == "qkv_proj")) == ""
        return
    assert peaks["q4_1"] > 0 and t.peak_flops > 0
    ops = {o.name: o for o in t.ops}
    assert [ops[n].kernel for n in ("qkv_proj", "o_proj", "mlp_gate_up", "mlp_down")] == ["q4_1"] * 4
    assert facts.op_peak(t, ops["qkv_proj"]) == peaks["q4_1"] and facts.op_peak(t, ops["rope"]) == t.peak_flops
    ridges = (("q4_1", peaks["q4_1"] / t.memory_bandwidth),)
    assert t.compute_bound_tokens == compute_bound_tokens(dims, facts.ridge(t), t.attention_backend, block_ridges=ridges)
    info = engine.model_info()  # the tutorial's facts: the LM head's Q8_0 kernel too (tied to the embedding)
    assert dict(info["block_peaks"])["q4_1"] == peaks["q4_1"] and (dict(info["block_peaks"]).get("q8_0", 0) > 0
                                                                  or "could not be measured reliably" in info["machine"])


@pytest.mark.real_model
def test_the_xray_captures_only_the_chosen_layer_and_runs_the_rest_fused_with_the_same_bits(make_llm):
    """A traced step runs layers [0, L) and (L, N) in the one-call C path and layer L step by step:
    the same logits and greedy tokens as an untraced run, one ``LayerTrace`` a step (the chosen
    layer, also after a change), and layer L's captured values equal those of an every-layer capture."""
    from nanovllm_core import SamplingParams

    llm = make_llm(quantization="gguf", num_kv_blocks=32, max_num_batched_tokens=24)  # chunked prefill
    engine, model = llm.engine, llm.engine.model
    assert model.fused_layers is not None
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = ["The capital of France is", "Water boils at a temperature of one hundred degrees"]
    logits: list[torch.Tensor] = []
    original, fused = model.compute_logits, model.fused_layers
    slices: list[tuple[int, int]] = []

    def spy(x, cos, sin, attn, num_layers, first_layer=0):
        slices.append((first_layer, num_layers))
        return fused(x, cos, sin, attn, num_layers, first_layer)

    def run(layer=None, every=False, switch_to=None):
        logits.clear()
        events: list[ev.Event] = []

        def listen(e):
            events.append(e)
            if switch_to is not None and isinstance(e, ev.StepTimed) and not switched:
                switched.append(e.step)  # the end of the first step: a new choice, as the app's ↓ sends it
                engine.select_xray(None, layer=switch_to, head=0)

        sub = engine.subscribe(listen, topk=0, blocks=False, xray=layer is not None) if layer is not None else None
        switched: list[int] = []
        if layer is not None:
            engine.select_xray(None, layer=layer, head=0, every_layer=every)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            if sub is not None:
                engine.unsubscribe(sub)
        return [o.outputs[0].token_ids for o in outs], list(logits), events

    model.compute_logits = lambda h: logits.append(original(h)) or logits[-1]
    model.fused_layers = spy
    try:
        plain_tokens, plain_logits, _ = run()
        slices.clear()
        tokens, traced_logits, events = run(layer=3)
        one_layer_slices = list(slices)
        all_tokens, _, all_events = run(layer=3, every=True)
        switch_tokens, _, switch_events = run(layer=3, switch_to=7)
    finally:
        model.compute_logits, model.fused_layers = original, fused
    n = engine.model_config.num_hidden_layers
    assert tokens == plain_tokens == all_tokens == switch_tokens
    assert len(traced_logits) == len(plain_logits) >= 5
    assert all(torch.equal(a, b) for a, b in zip(traced_logits, plain_logits))
    # Every traced step ran [0, 3) and [4, n) through the C call, layer 3 alone step by step.
    assert one_layer_slices and set(one_layer_slices) == {(0, 3), (4, n)}
    traces = [e for e in events if isinstance(e, ev.LayerTrace)]
    steps = [e.step for e in events if isinstance(e, ev.StepTimed)]
    assert [t.layer for t in traces] == [3] * len(steps) and [t.step for t in traces] == steps
    every = [e for e in all_events if isinstance(e, ev.LayerTrace)]
    assert [t.layer for t in every] == list(range(n)) * len(steps)
    # Layer 3 as captured alone and among all layers: the same values (the fused slices give the same bits).
    for alone, among in zip(traces, (t for t in every if t.layer == 3)):
        assert alone.tensors == among.tensors and alone.attention == among.attention
    switched = [e for e in switch_events if isinstance(e, ev.LayerTrace)]
    first_step = switched[0].step
    assert [t.layer for t in switched] == [3] + [7] * (len(switched) - 1) and len(switched) >= 3
    assert [t.step for t in switched] == list(range(first_step, first_step + len(switched)))
