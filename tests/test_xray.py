"""X-Ray: what it shows is the step the engine ran (its flat batch, its backend's bytes, each tensor for
what it is) against this machine's measured roofline."""

from __future__ import annotations

import pytest
import torch

from nanovllm_core import SamplingParams, roofline
from nanovllm_core import events as ev
from nanovllm_core.educational import xray_facts as facts
from nanovllm_core.educational.xray_costs import (LayerDims, SeqAttention, compute_bound_tokens, layer_intensity,
                                                  layer_ops, layer_roof, peak_words)
from nanovllm_core.roofline import Roofline

SMOL = LayerDims(hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64, elem=4)


# ------------------------------------------------------------------------------ the roofline


def test_the_ridge_point_divides_memory_bound_from_compute_bound():
    r = Roofline(peak_flops=100e9, bandwidth=10e9, machine="m")
    assert r.ridge == 10.0
    assert r.bound(50, 10) == "memory" and r.bound(100, 10) == "compute"
    assert r.min_time_s(100e9, 1e9) == 1.0 and r.min_time_s(1e9, 20e9) == 2.0


def test_the_roofline_is_measured_once_then_read_back(tmp_path, monkeypatch):
    calls = []

    def fake_measure(device, dtype, quantization=None, bandwidth=None):
        calls.append(bandwidth)
        return Roofline(1e11 * (10 if quantization else 1), bandwidth or 1e10, f"fake machine {quantization}")

    monkeypatch.setattr(roofline, "measure", fake_measure)
    monkeypatch.setattr(roofline, "_measured", {})
    monkeypatch.setattr(roofline, "_bandwidths", {})
    path = tmp_path / "roofline.json"
    first = roofline.machine_roofline("cpu", torch.float32, path)
    assert roofline.machine_roofline("cpu", torch.float32, path) == first and len(calls) == 1
    monkeypatch.setattr(roofline, "_measured", {})  # as a new process would start
    assert roofline.cached("cpu", torch.float32, path) == first and len(calls) == 1
    path.write_text("not json")
    monkeypatch.setattr(roofline, "_measured", {})
    assert roofline.cached("cpu", torch.float32, path) is None
    roofline.machine_roofline("cpu", torch.float32, path)
    assert len(calls) == 2
    # a block mode runs the float matmul's peak: float's entry, nothing measured
    assert roofline.machine_roofline("cpu", torch.float32, path, quantization="gguf") == first and len(calls) == 2
    assert roofline.cached("cpu", torch.float32, path, quantization="q8_0") == first
    monkeypatch.setattr(roofline, "_measured", {})  # a new process: the kept bandwidth serves every dtype
    monkeypatch.setattr(roofline, "_bandwidths", {})
    assert roofline.cached_bandwidth("cpu", path) == 1e10
    roofline.machine_roofline("cpu", torch.float64, path)
    assert len(calls) == 3 and calls[-1] == 1e10


def test_block_weights_are_named_and_their_kernels_peak_named_apart_from_the_float_matmuls():
    r = roofline.measure("cpu", torch.float32, gemm_n=128, stream_bytes=8 << 20, repeats=1, quantization="q8_0")
    assert r.peak_flops > 1e8 and r.machine.endswith("float32, q8_0 weights")
    assert peak_words(r.machine, 3.3e11) == ("float matmul peak 330.0 GFLOP/s (the float operations), the block "
                                             "kernels' own not measured")
    assert peak_words(r.machine, 3.3e11, (("q8_0", 4.4e11),)) == (
        "float matmul peak 330.0 GFLOP/s (the float operations), Q8_0 block kernel peak 440.0 GFLOP/s (the projection "
        "in that format, timed on this model's weights)")
    assert peak_words("a CPU, float32", 3.3e11) == "matmul peak 330.0 GFLOP/s"


def test_measuring_times_a_matmul_and_a_streaming_read():
    r = roofline.measure("cpu", torch.float32, gemm_n=128, stream_bytes=8 << 20, repeats=1)
    assert r.peak_flops > 1e8 and r.bandwidth > 1e8
    assert "float32" in r.machine and f"{torch.get_num_threads()} threads" in r.machine


# --------------------------------------------------------------------------- the cost model


def test_the_fused_backend_moves_no_score_matrix_and_the_math_backend_does():
    seq = SeqAttention(num_tokens=5, context_len=5, keys_read=5)
    fused = {o.name: o for o in layer_ops(SMOL, [seq], "fused")}
    math = {o.name: o for o in layer_ops(SMOL, [seq], "math")}
    qo, kv, s = 9 * 5 * 64 * 4, 3 * 5 * 64 * 4, 9 * 5 * 5 * 4  # Q (= O), K (= V), S (= P) bytes
    assert fused["attention"].bytes == 2 * qo + 2 * kv
    assert "attention_scores" not in fused and "attention" not in math
    assert math["attention_scores"].bytes == qo + kv + s and math["softmax"].bytes == 2 * s
    assert math["attention_output"].bytes == s + kv + qo
    # the fused causal square skips keys after each query (5 + 4 + ... + 1 pairs); math computes all 25, then masks
    visited = sum(p + 1 for p in range(5))
    per_pair = 9 * (2 * 64 + 5 + 2 * 64)  # per query head: QK^T, softmax, PV
    assert fused["attention"].flops == per_pair * visited
    assert sum(math[n].flops for n in ("attention_scores", "softmax", "attention_output")) == per_pair * 25


def test_a_layer_has_two_rmsnorms_in_the_order_they_run():
    names = [o.name for o in layer_ops(SMOL, [SeqAttention(5, 5, 5)])]
    assert names.count("input_layernorm") == names.count("post_attention_layernorm") == 1
    assert names.index("input_layernorm") < names.index("qkv_proj") < names.index("attention") \
        < names.index("post_attention_layernorm") < names.index("mlp_gate_up")
    assert names.count("residual_add") == 2


def test_projections_run_over_the_flat_batch_and_only_gathered_context_is_copied():
    prefill, decode = SeqAttention(5, 5, 5), SeqAttention(1, 30, 32, gathered=32)
    ops = {o.name: o for o in layer_ops(SMOL, [decode, prefill])}
    assert ops["qkv_proj"].flops == 2 * 6 * 576 * 960 and "[6, 576]" in ops["qkv_proj"].shapes
    assert ops["kv_gather"].bytes == 2 * 2 * 32 * 3 * 64 * 4  # K and V, read and written
    assert "kv_gather" not in {o.name for o in layer_ops(SMOL, [decode, prefill], "flash_attn")}
    this = {o.name: o for o in layer_ops(SMOL, [decode], this=decode)}
    assert "K, V [32, 3, 64] (30 in context, 2 padding slots masked)" in this["attention"].shapes
    assert "query head h reads KV head h // 3" in this["attention"].shapes


@pytest.mark.parametrize("backend", ["cpu_paged", "fused", "math"])
def test_attention_figures_under_this_request_say_they_are_the_batchs_and_give_its_share(backend):
    """Trial 12: "this request: Q [5, 9, 64] ... 303.0k FLOPs · 93.0 KiB" was req-0's and req-1's work together."""
    verify, prefill = SeqAttention(4, 30, 30), SeqAttention(5, 5, 5)
    both = [o for o in layer_ops(SMOL, [verify, prefill], backend, prefill) if o.shapes.startswith(("this request",
                                                                                                       "S [", "P ["))]
    alone = {o.name: o for o in layer_ops(SMOL, [prefill], backend, prefill)}
    assert both
    for op in both:
        mine = alone[op.name]
        assert (f"this op's FLOPs and bytes are the whole batch's (2 sequences), this request's share "
                f"{mine.flops:,} FLOPs and {mine.bytes:,} bytes") in op.shapes, op.shapes
        assert "whole batch's" not in mine.shapes  # alone in its step: the figures are its own
        assert op.flops > mine.flops


def test_a_prefill_turns_compute_bound_where_its_layer_reaches_the_ridge():
    n = compute_bound_tokens(SMOL, ridge=10.0)
    at = layer_intensity(layer_ops(SMOL, [SeqAttention(n, n, n)]))
    below = layer_intensity(layer_ops(SMOL, [SeqAttention(n - 1, n - 1, n - 1)]))
    assert below < 10.0 <= at
    assert compute_bound_tokens(SMOL, ridge=1e6) == 0  # never, for a ridge no layer reaches


def test_heatmap_labels_are_decoded_once_and_redone_where_the_tokens_changed():
    from types import SimpleNamespace

    from nanovllm_core.educational.xray import XRayCapture

    decoded = []
    engine = SimpleNamespace(token_pieces=lambda ids: decoded.extend(ids) or [f"<{i}>" for i in ids])
    capture = XRayCapture(engine, measure=False)
    seq = SimpleNamespace(seq_id=7, token_ids=[1, 2, 3])
    assert capture.pieces(seq) == ["<1>", "<2>", "<3>"]
    seq.token_ids += [4, 5]
    assert capture.pieces(seq) == ["<1>", "<2>", "<3>", "<4>", "<5>"] and decoded == [1, 2, 3, 4, 5]
    seq.token_ids[3:] = [9]  # a rejected draft rolled back, another token kept
    assert capture.pieces(seq) == ["<1>", "<2>", "<3>", "<9>"] and decoded[-1:] == [9]


# ------------------------------------------------------------------ capture on the real model

PROMPTS = ["The capital of France is", "Hi",
           "A river begins as rain on a mountain and the water gathers in small streams that join into brooks"]


def batch_rows(plan: ev.StepPlanned) -> dict[str, int]:
    """Each request's first row in the flat batch: single-token decodes first, shortest context first."""
    order = sorted(plan.scheduled, key=lambda s: (0, s.start) if s.num_tokens == 1 else (1, 0))
    rows, at = {}, 0
    for s in order:
        rows[s.request_id] = at
        at += s.num_tokens
    return rows


@pytest.fixture(scope="module")
def traced(make_llm):
    """A mixed run (a chunked prompt continuing its cached context, decodes beside prefills) with X-Ray on."""
    llm = make_llm(num_kv_blocks=32, block_size=16, max_num_batched_tokens=24)
    events: list[ev.Event] = []
    llm.engine.subscribe(events.append, topk=0, blocks=False, xray=True)
    llm.engine.select_xray(None, layer=1, head=4)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    plans = {e.step: e for e in events if isinstance(e, ev.StepPlanned)}
    steps: dict[int, list[ev.LayerTrace]] = {}
    for e in events:
        if isinstance(e, ev.LayerTrace):
            steps.setdefault(e.step, []).append(e)
    return llm, plans, steps


@pytest.mark.real_model
def test_shapes_are_the_steps_flat_batch_and_slices_are_labelled(traced):
    llm, plans, steps = traced
    for step, traces in steps.items():
        plan, t = plans[step], traces[0]
        T = plan.num_batched_tokens
        entry = next(s for s in plan.scheduled if s.request_id == t.request_id)
        ctx = entry.start + entry.num_tokens
        assert (t.num_batch_tokens, t.num_new_tokens, t.context_len) == (T, entry.num_tokens, ctx)
        assert t.num_batch_seqs == len(plan.scheduled) and t.first_row == batch_rows(plan)[t.request_id]
        x = {i.name: i for i in t.tensors}
        assert x["attn_norm"].shape == x["residual_out"].shape == x["attn_out"].shape == (T, 576)
        assert x["q"].shape == (T, 9, 64) and x["k"].shape == x["v"].shape == (T, 3, 64)
        assert x["gate"].shape == x["up"].shape == x["act"].shape == (T, 1536)
        assert x["k_context"].shape == (ctx, 3, 64)  # as the cache's slot view holds it, tokens first
        assert x["scores"].shape == x["probs"].shape == (3, 3 * entry.num_tokens, ctx)
        assert {i.scope for i in t.tensors if i.name in ("k_context", "scores", "probs")} == {"request"}
        assert {i.scope for i in t.tensors if i.name not in ("k_context", "scores", "probs")} == {"batch"}
        assert t.part == entry.kind
        assert (t.prompt_len, t.total_len, t.num_cached_tokens) == (entry.prompt_len, entry.total_len,
                                                                    entry.num_cached_tokens)
        ops = {o.name: o for o in t.ops}
        assert ops["qkv_proj"].flops == 2 * T * 576 * 960
    assert any(t[0].num_batch_tokens > t[0].num_new_tokens for t in steps.values()), "some step batches several"


@pytest.mark.real_model
def test_each_tensor_is_what_its_label_says(traced):
    _, _, steps = traced
    traces = sorted(next(iter(steps.values())), key=lambda t: t.layer)
    for before, after in zip(traces, traces[1:]):
        out = next(i for i in before.tensors if i.name == "residual_out")
        assert next(i for i in after.tensors if i.name == "residual").sample == out.sample
    for t in traces:
        x = {i.name: i.sample for i in t.tensors}
        residual = x.get("residual") or x["token_embeddings"]
        assert x["residual_mid"] == pytest.approx([a + b for a, b in zip(residual, x["attn_out"])], abs=2e-4)
        assert x["residual_out"] == pytest.approx([a + b for a, b in zip(x["residual_mid"], x["mlp_out"])], abs=2e-4)
        assert x["attn_norm"] != pytest.approx(residual, abs=1e-3)  # the norm's output is not the residual stream
        assert all(name in facts.LABELS for name in x)


@pytest.mark.real_model
def test_attention_bytes_follow_the_backend_and_the_gather_the_step_did(traced):
    llm, plans, steps = traced
    gathers = 0
    for step, traces in steps.items():
        plan, t = plans[step], traces[0]
        ops = {o.name: o for o in t.ops}
        in_place = llm.engine.runner.use_cpu_paged  # the CPU paged kernel reads the blocks where they lie
        assert t.attention_backend == ("cpu_paged" if in_place else "fused") and "attention_scores" not in ops
        continuing = [s for s in plan.scheduled if s.num_tokens > 1 and s.start > 0]
        decodes = [s for s in plan.scheduled if s.num_tokens == 1]
        if in_place:
            assert "kv_gather" not in ops
            gathers += 1
            # each token's own context, read once: K and V of 3 KV heads x 64 in float32, no padding
            keys = sum(s.start + s.num_tokens for s in plan.scheduled)
            q = sum(s.num_tokens for s in plan.scheduled) * 9 * 64 * 4
            assert ops["attention"].bytes == 2 * q + 2 * keys * 3 * 64 * 4
        elif continuing or decodes:
            gathers += 1
            chunk_slots = sum(-(-(s.start + s.num_tokens) // 16) * 16 for s in continuing)
            assert ops["kv_gather"].bytes >= 2 * 2 * chunk_slots * 3 * 64 * 4
        else:
            assert "kv_gather" not in ops
    assert gathers


@pytest.mark.real_model
def test_the_heatmap_holds_every_key_and_each_row_sums_to_one(traced):
    _, _, steps = traced
    heat = [t for traces in steps.values() for t in traces if t.attention]
    assert heat and all(h.layer == 1 and h.head == 4 for h in heat)
    for h in heat:
        assert h.keys_per_column == 1 and h.key_start == 0 and len(h.key_pieces) == h.context_len
        assert len(h.attention) == min(h.num_new_tokens, 48)
        for row in h.attention:
            assert len(row) == h.context_len and abs(sum(row) - 1.0) < 1e-3


@pytest.mark.real_model
def test_the_gqa_and_roofline_sentences_agree_with_the_step(traced):
    llm, plans, steps = traced
    t = steps[min(steps)][0]
    ctx = t.context_len
    text = " ".join(facts.gqa_lines(t, head=4))
    assert "query head h reads KV head h // 3" in text and "Head 4 reads KV head 4 // 3 = 1" in text
    assert f"2 x 3 x {ctx} x 64 x 4 = {2 * 3 * ctx * 64 * 4:,} bytes" in text
    assert "[1, 9, 64" not in text and "repeated" not in text
    roof = roofline.cached(llm.engine.device, llm.engine.dtype)
    assert roof is not None and (t.peak_flops, t.memory_bandwidth) == (roof.peak_flops, roof.bandwidth)
    dims = LayerDims(576, 1536, 9, 3, 64, 4)
    assert t.compute_bound_tokens == compute_bound_tokens(dims, roof.ridge, "fused")
    lines = " ".join(facts.roofline_lines(t))
    assert f"{roof.ridge:.1f} FLOP/byte (the ridge point)" in lines
    expected = "compute-bound" if layer_intensity(t.ops) >= roof.ridge else "memory-bound"
    assert f"FLOP/byte: {expected}" in lines
    info = llm.engine.model_info()
    assert info["peak_flops"] == roof.peak_flops and info["compute_bound_tokens"] == t.compute_bound_tokens


@pytest.mark.real_model
def test_a_speculative_verification_is_labelled_as_such(make_llm):
    from nanovllm_core.educational.tutorial import chapter

    llm = make_llm(num_kv_blocks=32, speculative_model="ngram", num_speculative_tokens=4)
    events: list[ev.Event] = []
    llm.engine.subscribe(events.append, topk=0, blocks=False, xray=True)
    llm.engine.select_xray(None)
    prompt = chapter("speculative_decoding").demo_prompt  # repeats itself: prompt lookup finds drafts
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    spec = [e for e in events if isinstance(e, ev.SpecDecodeStep)]
    assert spec
    verify = {t.step: t for t in events if isinstance(t, ev.LayerTrace) and t.layer == 0 and t.part == "verify"}
    for s in spec:
        t = verify[s.step]
        k = len(s.draft_tokens)
        assert t.num_new_tokens == 1 + k
        assert facts.what_ran(t).startswith(f"speculative verification: the newest token + {k} draft")
        assert facts.step_kind(t) == "speculative verification"


def test_narrow_weights_and_narrow_kv_move_their_own_bytes():
    """A decode step reads weights as stored (Q8_0: 34 bytes per 32) and K/V at the cache's element size."""
    from dataclasses import replace

    q8_0 = replace(SMOL, weight_elem=34 / 32, kv_elem=2)
    seqs = [SeqAttention(1, 100, 112, gathered=112)]
    f32 = {o.name: o.bytes for o in layer_ops(SMOL, seqs, "fused")}
    q8 = {o.name: o.bytes for o in layer_ops(q8_0, seqs, "fused")}
    h, qkv, i = 576, (9 + 2 * 3) * 64, 1536
    assert f32["qkv_proj"] - q8["qkv_proj"] == h * qkv * (4 - 34 / 32)  # 4 -> 1.0625 bytes per weight
    assert f32["mlp_down"] - q8["mlp_down"] == i * h * (4 - 34 / 32)
    assert 2 * q8["kv_gather"] == f32["kv_gather"]  # 4 -> 2 bytes per cached number
    assert f32["rope"] == q8["rope"]  # activations stay float32


def test_a_roofline_measured_on_a_busy_host_says_so_and_is_not_kept(tmp_path, monkeypatch):
    """Issue 29: 39 GFLOP/s measured under load was kept for good where the host reached 78-85.
    A measurement whose threads did not get their cores is used by this process only, says the
    host was busy and how to measure again; an entry kept before the check is measured again."""
    shares = iter([0.4, 0.95])
    monkeypatch.setattr(roofline, "measure", lambda device, dtype, quantization=None, bandwidth=None: Roofline(
        39e9, 1e10, "fake machine", cpu_share=next(shares)))
    monkeypatch.setattr(roofline, "_measured", {})
    monkeypatch.setattr(roofline, "_bandwidths", {})
    path = tmp_path / "roofline.json"
    busy = roofline.machine_roofline("cpu", torch.float32, path)
    assert not busy.quiet and not path.exists() and roofline.cached_bandwidth("cpu", path) is None  # nor the bandwidth
    assert "host was busy" in busy.machine and "python -m nanovllm_core.roofline" in busy.machine
    assert roofline.machine_roofline("cpu", torch.float32, path) is busy  # this process: not measured again
    monkeypatch.setattr(roofline, "_measured", {})  # a new process measures again, on a quiet host
    quiet = roofline.machine_roofline("cpu", torch.float32, path)
    assert quiet.quiet and quiet.machine == "fake machine" and path.exists()
    monkeypatch.setattr(roofline, "_measured", {})
    assert roofline.cached("cpu", torch.float32, path) == quiet

    import json  # an entry kept before the check (no cpu_share) is not trusted
    data = json.loads(path.read_text())
    for entry in data.values():
        del entry["cpu_share"]
    path.write_text(json.dumps(data))
    monkeypatch.setattr(roofline, "_measured", {})
    assert roofline.cached("cpu", torch.float32, path) is None


def test_measuring_records_the_share_of_the_cores_its_threads_got():
    r = roofline.measure("cpu", torch.float32, gemm_n=256, stream_bytes=16 << 20, repeats=2)
    assert 0.0 < r.cpu_share <= 1.0


@pytest.mark.real_model
def test_attention_flops_count_the_keys_the_cpu_kernel_visits_prefill_chunks_decodes_and_verifications(
        make_llm, monkeypatch):
    """The X-Ray's attention FLOPs against the C kernel's own loop bounds (``token_context`` per query token)."""
    from nanovllm_core.attention import cpu_paged

    llm = make_llm(num_kv_blocks=32, block_size=16, max_num_batched_tokens=24, speculative_model="ngram",
                   num_speculative_tokens=3)
    if llm.engine.model_info()["attention_backend"] != "cpu-paged":
        pytest.skip("the CPU paged kernel does not run here")
    visited: dict[int, set[int]] = {}
    step = [0]
    real = cpu_paged.paged_attention

    def counting(q, k, v, tables, rows, context, max_context):
        visited.setdefault(step[0], set()).add(int(context.sum()))  # one value per step: every layer the same
        return real(q, k, v, tables, rows, context, max_context)

    monkeypatch.setattr(cpu_paged, "paged_attention", counting)
    events: list[ev.Event] = []

    def keep(e: ev.Event) -> None:
        if isinstance(e, ev.StepPlanned):
            step[0] = e.step
        events.append(e)

    llm.engine.subscribe(keep, topk=0, blocks=False, xray=True)
    llm.engine.select_xray(None, layer=0)
    prompts = [PROMPTS[2], "one two three one two three one two three one two"]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    d = SMOL
    parts = set()
    for t in (e for e in events if isinstance(e, ev.LayerTrace) and e.layer == 0):
        (pairs,) = visited[t.step]
        attention = next(o for o in t.ops if o.name == "attention")
        assert attention.flops == d.num_heads * (2 * d.head_dim + 5 + 2 * d.head_dim) * pairs, t.step
        parts.add(t.part)
    assert {"prefill", "verify"} <= parts  # a chunk from position 0, a chunk after cached tokens, verifications


@pytest.mark.real_model
def test_the_lm_head_total_counts_the_rows_the_model_really_sends_through_it(make_llm):
    """The step total's parts outside the layers: LM head rows against ``compute_logits``' own input, each step."""
    from nanovllm_core.educational.xray_costs import model_edge_ops, sampled_rows
    from nanovllm_core.educational.xray_view import step_total

    llm = make_llm(num_kv_blocks=32, max_num_batched_tokens=24, speculative_model="ngram", num_speculative_tokens=3)
    model = llm.engine.model
    rows: list[int] = []
    real = model.compute_logits
    model.compute_logits = lambda hidden: (rows.append(hidden.shape[0]), real(hidden))[1]
    plans: list[ev.StepPlanned] = []
    llm.engine.subscribe(lambda e: plans.append(e) if isinstance(e, ev.StepPlanned) and e.scheduled else None,
                         topk=0, blocks=False)
    try:
        llm.generate([PROMPTS[2], "one two three one two three one two three one two"],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        del model.compute_logits
    assert [sampled_rows(p.scheduled) for p in plans] == rows  # chunks that do not sample add no row
    assert any(s.num_spec_tokens for p in plans for s in p.scheduled) and any(not s.samples for p in plans
                                                                                for s in p.scheduled)
    h, v = SMOL.hidden, 49152
    edges = {o.name: o for o in model_edge_ops(h, v, 4, v * h * 4, 24, 3)}
    assert edges["lm_head"].flops == 2 * 3 * h * v and edges["embedding_lookup"].flops == 0
    layer = ev.LayerTrace(step=0, request_id="0", layer=0, num_layers=2, tensors=(), num_heads=9, num_kv_heads=3,
                          head_dim=64, hidden_size=h, kv_bytes_per_token=46080, num_batch_tokens=24,
                          ops=(ev.OpInfo("qkv_proj", "", "", 1_000_000, 2_000_000),))
    text = step_total([layer, layer], tuple(edges.values()))
    whole = 2_000_000 + sum(o.flops for o in edges.values())
    assert f"The whole forward pass: {whole / 1e6:.3g} MFLOP" in text and "3 rows that sample" in text
    assert "not counted" in step_total([layer, layer])


def test_a_block_mode_shares_float_s_roofline_and_names_its_weights(tmp_path, monkeypatch):
    calls = []

    def fake_measure(device, dtype, quantization=None, bandwidth=None):
        calls.append((quantization, bandwidth))
        return Roofline(1e11, bandwidth or 1e10, roofline.machine_name(device, dtype, quantization))

    monkeypatch.setattr(roofline, "measure", fake_measure)
    monkeypatch.setattr(roofline, "_measured", {})
    monkeypatch.setattr(roofline, "_bandwidths", {})
    path = tmp_path / "roofline.json"
    block = roofline.machine_roofline("cpu", torch.float32, path, quantization="q4_1")
    assert calls == [(None, None)]  # the float matmul's peak, and the bandwidth, measured once ...
    assert block.machine.endswith("float32, q4_1 weights")  # ... and named for the weights that run
    assert peak_words(block.machine, 1e11).endswith("the block kernels' own not measured")
    plain = roofline.machine_roofline("cpu", torch.float32, path)
    assert calls == [(None, None)] and plain.machine.endswith("float32") and plain.peak_flops == block.peak_flops


# SmolLM2's layer in Q4_1 blocks, as the default model runs it: 20 bytes per 32 weights.
Q4_1_SMOL = LayerDims(576, 1536, 9, 3, 64, 4, weight_elem=20 / 32, linear_kinds=("q4_1",) * 4)
BUSY_HOST = "AMD EPYC (2 threads), float32, gguf weights"


def decode_trace(kernel_peaks=(), machine=BUSY_HOST, peak=44.4e9, bandwidth=9.6e9, kinds=True) -> ev.LayerTrace:
    """Trial 14c's step: a decode of 2 tokens (two sequences, 1 token each) in Q4_1, against its roofline."""
    d = Q4_1_SMOL if kinds else LayerDims(576, 1536, 9, 3, 64, 4, weight_elem=20 / 32)
    ops = layer_ops(d, [SeqAttention(1, 33, 33), SeqAttention(1, 2, 2)], "cpu_paged")
    if not kinds:  # a trace recorded before ops named their kernel: the math still says the format
        ops = tuple(ev.OpInfo(o.name, o.math + ("; W in Q4_1 blocks, 20 bytes per 32 weights" if o.name in
                                                 ("qkv_proj", "o_proj", "mlp_gate_up", "mlp_down") else ""),
                              o.shapes, o.flops, o.bytes) for o in ops)
    ridges = tuple((k, v / bandwidth) for k, v in kernel_peaks)
    return ev.LayerTrace(step=1, request_id="1", layer=0, num_layers=30, tensors=(), ops=ops, num_heads=9,
                         num_kv_heads=3, head_dim=64, hidden_size=576, kv_bytes_per_token=46080, part="decode",
                         num_new_tokens=1, context_len=33, num_batch_tokens=2, num_batch_seqs=2,
                         attention_backend="cpu_paged", peak_flops=peak, memory_bandwidth=bandwidth, machine=machine,
                         compute_bound_tokens=compute_bound_tokens(d, peak / bandwidth, "cpu_paged",
                                                                   block_ridges=ridges) if kinds else 2,
                         kernel_peaks=tuple(kernel_peaks))


def test_a_block_projection_is_judged_against_its_block_kernels_peak_not_the_float_matmuls():
    """Trial 14c: a 2-token Q4_1 decode's qkv_proj (6.2 FLOP/byte) was called compute-bound against the
    float matmul's ridge of 4.6 FLOP/byte, and "a prefill becomes compute-bound from about 2 tokens".
    The Q4_1 kernel that ran it peaks at about 8x that float figure (a 2-core AMD EPYC), so its ridge
    is 37.5 FLOP/byte: memory-bound, and the crossing comes about ten tokens later."""
    t = decode_trace(kernel_peaks=(("q4_1", 3.6e11),))
    ops = {o.name: o for o in t.ops}
    qkv = ops["qkv_proj"]
    assert qkv.kernel == "q4_1" and 6.0 < facts.op_intensity(qkv) < 6.5 and facts.op_intensity(qkv) > facts.ridge(t)
    assert facts.bound(t, qkv) == "memory-bound"  # 6.2 against the Q4_1 kernel's 37.5, not the float matmul's 4.6
    assert all(facts.bound(t, ops[n]) == "memory-bound" for n in ("o_proj", "mlp_gate_up", "mlp_down"))
    assert ops["input_layernorm"].kernel == "" and facts.op_peak(t, ops["input_layernorm"]) == 44.4e9
    assert t.compute_bound_tokens > 10  # each projection against 37.5 FLOP/byte: not 2 tokens
    assert compute_bound_tokens(Q4_1_SMOL, 4.625, "cpu_paged") == 0  # its kernel's ridge not given: no answer
    text = " ".join(facts.roofline_lines(t))
    assert "Q4_1 block kernel peak 360.0 GFLOP/s" in text and "a Q4_1 projection above 37.5" in text
    assert "a float operation is compute-bound above 4.6 FLOP/byte" in text
    assert f"about {t.compute_bound_tokens:,} tokens in one step, each operation against its kernel's peak" in text
    roof = layer_roof(t.ops, t.peak_flops, t.memory_bandwidth, t.kernel_peaks)
    assert roof.bound == "memory-bound" and f"own ridge point of {roof.ridge:.1f} FLOP/byte" in text
    assert "FLOP/byte (its operations each at their kernel's peak): memory-bound" in text
    line = facts.verdict_line(t)
    assert "each Q4_1 projection against its block kernel's ridge point" in line and "busy" not in line
    # The CLI's operation list and the app's pipeline label the projections from the same judgement.
    from nanovllm_core.educational.xray_view import op_cost
    from nanovllm_tui.views.xray import pipeline_text

    assert op_cost(t, qkv).endswith("6.2 FLOP/B, memory-bound")
    assert "compute-bound" not in pipeline_text(t).plain.split("Verdicts")[0]


def test_a_block_trace_without_its_kernels_peak_judges_no_projection():
    """A trace whose block kernel was not measured (one recorded before it was): its projections get no
    verdict rather than the float matmul's, and no prefill crossing is told; the float operations keep theirs."""
    for t in (decode_trace(), decode_trace(kinds=False)):
        ops = {o.name: o for o in t.ops}
        assert facts.op_kernel(t, ops["qkv_proj"]) == "q4_1"
        assert facts.bound(t, ops["qkv_proj"]) == "" and facts.bound(t, ops["input_layernorm"]) == "memory-bound"
        text = " ".join(facts.roofline_lines(t))
        assert "the block kernels' own not measured" in text and "Q4_1 kernel's peak was not measured" in text
        assert "compute-bound from about" not in text and "the float matmul's is not theirs" in facts.verdict_line(t)


def test_a_verdict_on_a_roofline_measured_on_a_busy_host_says_so():
    busy = BUSY_HOST + "; measured while the host was busy (its threads got 24% of their cores), so likely low"
    t = decode_trace(kernel_peaks=(("q4_1", 3.6e11),), machine=busy)
    assert "measured while the host was busy" in facts.verdict_line(t)
    text = " ".join(facts.roofline_lines(t))
    assert "memory-bound (against peaks measured while the host was busy" in text
    assert "Where a prefill turns compute-bound is not told: the peaks were measured while the host was busy" in text


def test_the_block_kernels_peak_is_timed_on_the_weights_kept_when_quiet_and_named_when_busy(tmp_path, monkeypatch):
    from nanovllm_core.model.block_quant import BlockLinear

    torch.manual_seed(0)
    module = BlockLinear.from_float(torch.randn(64, 128), "q4_1")
    measured = roofline.measure_block_peak(module, tokens=16, seconds=0.01)
    assert measured.kind == "q4_1" and measured.peak_flops > 0 and measured.timed_on == "[64, 128] at 16 tokens"
    calls = []

    def fake(m, tokens=roofline.BLOCK_PEAK_TOKENS, share=1.0):
        calls.append(m)
        return roofline.BlockPeak(m.kind, 3e11, f"[{m.out_features}, {m.in_features}] at {tokens} tokens", share)

    monkeypatch.setattr(roofline, "_block_peaks", {})
    monkeypatch.setattr(roofline, "measure_block_peak", fake)
    path = tmp_path / "roofline.json"
    first = roofline.block_peak(module, "cpu", path)
    assert roofline.block_peak(module, "cpu", path) == first and len(calls) == 1
    monkeypatch.setattr(roofline, "_block_peaks", {})  # a new process reads it back
    assert roofline.cached_block_peak(module, "cpu", path) == first and len(calls) == 1
    assert roofline.cached_block_peak(module.first_rows(8), "cpu", path) is None  # another shape: not this one
    float_roof = Roofline(1e11, 1e10, "a CPU (2 threads), float32, q4_1 weights")
    assert roofline.with_block_peaks(float_roof, [first]).block_peaks == (("q4_1", 3e11),)
    # Busy: used by this process, not kept, and the roofline's machine says so.
    monkeypatch.setattr(roofline, "_block_peaks", {})
    monkeypatch.setattr(roofline, "measure_block_peak", lambda m, tokens=128: fake(m, tokens, share=0.3))
    path2 = tmp_path / "busy.json"
    busy = roofline.block_peak(module, "cpu", path2)
    assert not busy.quiet and not path2.exists()
    roof = roofline.with_block_peaks(float_roof, [busy])
    assert roof.block_peaks == () and "the Q4_1 kernel's peak could not be measured reliably on this busy host" in roof.machine


def test_first_rows_is_a_view_that_computes_the_same_rows():
    from nanovllm_core.model.block_quant import BlockLinear

    torch.manual_seed(0)
    module = BlockLinear.from_float(torch.randn(40, 64), "q8_0")
    part = module.first_rows(12)  # rounded up to 16: two packed groups of 8 rows
    x = torch.randn(3, 64)
    assert part.out_features == 16 and part.packed.data_ptr() == module.packed.data_ptr()
    assert torch.equal(part(x), module(x)[:, :16])


def test_sampled_values_say_which_end_of_the_row_they_are():
    """scores and probs carry the last query row's newest keys (the last is the token's weight on
    itself); the views said "first values" of them (trial 5: a learner could not find key 0's 0.29)."""
    from nanovllm_core.educational import xray_facts

    probs = ev.TensorInfo("probs", (3, 15, 5), (0.2436, 0.0477, 0.1246, 0.2987), "request")
    q = ev.TensorInfo("q", (5, 9, 64), (0.5, -0.25, 0.125, 1.0), "batch")
    assert xray_facts.sample_text(probs) == "..., +0.2436, +0.0477, +0.1246, +0.2987 (the newest 4 keys, its own last)"
    assert xray_facts.sample_text(q) == "+0.5000, -0.2500, +0.1250, +1.0000, ..."
    assert xray_facts.TAIL_SAMPLED == {"scores", "probs"}


def test_the_not_traced_note_promises_no_trace_to_a_request_that_finished(make_tiny_engine):
    """Trial 10: ``--xray`` with two 2-token prompts said of request 0 "a missed decode is traced at that
    request's next step" in the step where request 0 finished. The note says which requests may still
    be traced and which ended."""
    import io

    from rich.console import Console

    from nanovllm_core import LLM, SamplingParams
    from nanovllm_core.educational.xray_view import XRayView, skipped_note

    engine = make_tiny_engine(num_kv_blocks=64)
    shown = []
    xray = XRayView(Console(file=io.StringIO(), width=200), engine, detail_layer=0, on_traced=shown.append)
    xray.subscribe()
    LLM.from_engine(engine).generate(["Hello", "The sky is"], SamplingParams(temperature=0, max_tokens=2,
                                                                             ignore_eos=True), use_tqdm=False)
    xray.close()
    console = Console(file=io.StringIO(), width=400)
    for part in shown:
        console.print(part)
    notes = [line for line in console.file.getvalue().splitlines() if "Not traced in this step" in line]
    assert notes and any("finished in this step and will not be traced" in n for n in notes), notes
    assert not any("next step" in n for n in notes)
    assert skipped_note([("1", "prefill"), ("2", "decode")], {"2"}) == (
        "Not traced in this step: request 1 (prefill), 2 (decode). The engine traces one request per step: "
        "request 1 may have its decode traced at a later step; request 2 finished in this step and will not be "
        "traced.")


# ------------------------------------------------------------------------------ trial 10: what a chunk costs and is

def _chunk_trace(**kw) -> ev.LayerTrace:
    fields = dict(step=0, request_id="0", layer=0, num_layers=2, tensors=(), num_heads=9, num_kv_heads=3,
                  head_dim=64, hidden_size=576, kv_bytes_per_token=46080, num_batch_tokens=8, num_batch_seqs=1,
                  part="prefill", num_new_tokens=8, context_len=8, prompt_len=9, total_len=9,
                  ops=(ev.OpInfo("qkv_proj", "", "", 1_000_000, 2_000_000),))
    fields.update(kw)
    return ev.LayerTrace(**fields)


def test_a_step_that_samples_no_row_reads_no_lm_head_and_only_its_embedding_rows():
    """Trial 10: the 0..7 chunk of a 9-token prompt samples nothing (the engine skips the LM head), yet its
    X-Ray counted the whole 28.7 MiB head matrix in "the 0 rows that sample" and the forward pass."""
    from nanovllm_core.educational.xray_costs import model_edge_ops
    from nanovllm_core.educational.xray_view import step_total

    h, v, head_bytes, row = 576, 49152, 30_081_024, 612  # the Q8_0 head [49152, 576]; one Q8_0 embedding row
    edges = {o.name: o for o in model_edge_ops(h, v, 4, head_bytes, 8, 0, row, "q8_0")}
    assert edges["lm_head"].flops == 0 and edges["lm_head"].bytes == 0 and "not run" in edges["lm_head"].math
    assert edges["embedding_lookup"].bytes == 8 * row + 8 * h * 4  # the 8 rows read, not the [49152, 576] table
    sampling = {o.name: o for o in model_edge_ops(h, v, 4, head_bytes, 8, 1, row, "q8_0")}
    assert sampling["lm_head"].bytes == head_bytes + h * 4 + v * 4  # one row that samples reads the whole head
    layer = _chunk_trace()
    text = step_total([layer, layer], tuple(edges.values()))
    moved = 2 * 2_000_000 + sum(o.bytes for o in edges.values())
    assert "the LM head does not run" in text and "rows that sample" not in text
    assert moved < 4_100_000 and "MiB" in text.split("The whole forward pass")[1]
    assert f"{moved / 2**20:.1f} MiB" in text.split("The whole forward pass")[1]


def test_a_prefill_chunk_says_what_it_is_a_chunk_of_in_the_header_and_the_apps_title():
    """Trial 10: the X-Ray said "prefill, 8 new tokens at positions 0..7" where the narrator said "prefill
    chunk 0..7 of 9"; now both X-Ray views name the chunk and its prompt."""
    from rich.console import Console

    from nanovllm_core.educational.xray_view import render_step

    first = _chunk_trace()
    console = Console(width=200, record=True)
    console.print(render_step([first]))
    head = console.export_text().splitlines()[0]
    assert "prefill chunk, 8 new tokens at positions 0..7 of a 9-token prompt" in head
    assert facts.what_ran(first) == "prefill chunk: 8 new tokens (positions 0..7 of a 9-token prompt) over 8 in context"
    last = _chunk_trace(num_new_tokens=1, context_len=9, num_batch_tokens=1)
    assert facts.what_ran(last) == "prefill chunk: 1 new token (position 8 of a 9-token prompt) over 9 in context"
    whole = _chunk_trace(prompt_len=8, total_len=8)
    assert facts.what_ran(whole) == "prefill: 8 new tokens over 8 in context"
    after_cache = _chunk_trace(num_new_tokens=4, context_len=20, prompt_len=20, total_len=20, num_cached_tokens=16)
    assert facts.trace_chunk_of(after_cache) == ""  # the rest of the prompt after a prefix hit is no chunk
    assert facts.chunk_of(0, 8, 9, 12, 0) == "its 12 tokens (9 prompt + 3 generated, all but the newest recomputed)"
    assert facts.trace_chunk_of(_chunk_trace(prompt_len=0, total_len=0)) == ""  # an older trace: nothing claimed


def test_attention_shapes_are_the_engines_tokens_first_layout_beside_the_grouped_scores():
    """Trial 10: the attention row said "Q [9, 2, 64] ... -> O [9, 2, 64]" (heads first) while the q
    tensor row said [2, 9, 64] and the kernels take and return [T, num_heads, head_dim]."""
    this = SeqAttention(2, 2, 2)
    fused = next(o for o in layer_ops(SMOL, [this], "cpu_paged", this) if o.name == "attention")
    assert fused.shapes.startswith("this request: Q [2, 9, 64], K, V [2, 3, 64] -> O [2, 9, 64]")
    assert "scores are grouped [3, 6, 2]" in fused.shapes and "[9, 2, 64]" not in fused.shapes
    math = {o.name: o for o in layer_ops(SMOL, [this], "math", this)}
    assert math["attention_scores"].shapes.startswith("this request: Q [2, 9, 64] regrouped by KV head as [3, 6, 64]")
    assert "K [2, 3, 64]" in math["attention_scores"].shapes and "-> S [3, 6, 2]" in math["attention_scores"].shapes
    assert math["attention_output"].shapes.endswith("back to O [2, 9, 64]")
    trace = ev.LayerTrace(step=0, request_id="0", layer=0, num_layers=30, tensors=(), ops=(), num_heads=9,
                          num_kv_heads=3, head_dim=64, hidden_size=576, kv_bytes_per_token=46080)
    assert "K and V stay [ctx, 3, 64] beside Q [t, 9, 64]" in facts.gqa_lines(trace)[0]


def test_the_cli_heatmap_that_shows_only_the_newest_keys_says_which_are_hidden_and_that_rows_sum_less():
    """Trial 10: at 80 columns the heatmap showed keys 3-12 of 13 under "each row sums to 1 over all its
    keys" while the shown rows summed to 0.68-0.84 and nothing said keys 0-2 were hidden."""
    from rich.console import Console

    from nanovllm_core.educational.xray_view import heatmap_caption, render_layer_detail

    rows = tuple(tuple([0.1, 0.1, 0.1] + [0.07] * 10) for _ in range(4))  # 4 queries over 13 keys
    t = _chunk_trace(part="verify", num_new_tokens=4, context_len=13, head=0, attention=rows,
                     query_pieces=("a", "b", "c", "d"), key_pieces=tuple("k" * 13), prompt_len=9, total_len=13)
    caption = heatmap_caption(t)
    assert "only the newest keys, 3-12, are shown: keys 0-2 are hidden" in caption
    assert "shown weights sum to less than 1" in caption
    console = Console(width=80, record=True)
    console.print(render_layer_detail(t))
    flat = " ".join(console.export_text().split())
    assert "keys 0-2 are hidden" in flat
    few = _chunk_trace(num_new_tokens=4, context_len=4, head=0, attention=tuple(tuple([0.25] * 4) for _ in range(4)))
    assert heatmap_caption(few) == "each row sums to 1 over all its keys"  # every key shown: no such words
    many = _chunk_trace(head=0, attention=tuple(tuple([1 / 12] * 12) for _ in range(12)), keys_per_column=3)
    assert "only the newest keys, 6-35, are shown: keys 0-5 are hidden" in heatmap_caption(many)  # 3 keys a column
    assert "only the newest 10 query rows are shown" in heatmap_caption(many)


def test_the_cli_xray_header_at_80_columns_wraps_rather_than_cuts():
    """Trial 10: "X-RAY · request 0 · step 1 · speculative verification, 1 + 3 tokens at positi… ─" and
    "... split over 3 ran… ─" at 80 columns: the heading now wraps whole, with the rule below it."""
    from rich.console import Console

    from nanovllm_core.educational.xray_view import render_split_step, render_step

    t = _chunk_trace(part="verify", num_new_tokens=4, context_len=13, step=1)
    console = Console(width=80, record=True)
    console.print(render_step([t]))
    text = console.export_text()
    assert "…" not in text.splitlines()[0]
    assert "speculative verification, 1 + 3 tokens at positions 9..12" in " ".join(text.split())
    wide = Console(width=200, record=True)
    wide.print(render_step([t]))
    first = wide.export_text().splitlines()[0]
    assert first.startswith("X-RAY · request 0 · step 1 · speculative verification") and first.endswith("─")
    info = {"tensor_parallel_size": 3, "hidden_size": 576, "intermediate_size": 1536, "num_heads": 9,
            "num_kv_heads": 3, "head_dim": 64, "vocab_size": 49152, "num_layers": 30}
    timed = ev.StepTimed(step=0, wall_time_s=0.02, num_tokens=6, num_prefill_tokens=6, num_decode_tokens=0,
                         prefill_tokens_per_s=300.0, decode_tokens_per_s=0.0, kv_bytes_used=0,
                         kv_bytes_total=8 * 16 * 46080, num_running=2, num_waiting=0, num_blocks_used=2,
                         num_blocks_total=8, tp_size=3, tp_compute_s=(0.01, 0.01, 0.01),
                         tp_comm_s=(0.005, 0.005, 0.005), tp_all_reduces=61, tp_all_reduce_bytes=61 * 6 * 576 * 4)
    entry = ev.ScheduledEntry(request_id="0", seq_id=0, index=0, kind="prefill", num_tokens=5, start=0,
                              prompt_len=5, total_len=5, num_cached_tokens=0, samples=True, priority=0)
    console = Console(width=80, record=True)
    console.print(render_split_step(info, timed, entry))
    text = console.export_text()
    assert "…" not in text.splitlines()[0]
    assert "X-RAY · step 0 · 6 tokens · request 0's prefill, 5 of them · split over 3 ranks" in " ".join(text.split())


def test_the_cli_heatmap_shows_pieces_that_look_like_rich_markup():
    """Trial 10: the prompt's first piece "one" was shown as "[one]" passed to Rich as markup: a style
    tag, so the first key's header and the first query's label were blank."""
    from rich.console import Console

    from nanovllm_core.educational.xray_view import attention_table

    pieces = ("one", " two", "bold", "/x")
    rows = tuple(tuple([1 / (i + 1)] * (i + 1) + [0.0] * (3 - i)) for i in range(4))
    t = _chunk_trace(num_new_tokens=4, context_len=4, head=0, attention=rows, query_pieces=pieces, key_pieces=pieces)
    console = Console(width=120, record=True)
    console.print(attention_table(t))
    lines = console.export_text().splitlines()
    assert all(label in lines[0] for label in ("[one]", "[␣two]", "[bold]", "[/x]")), lines[0]
    assert [line.split()[0] for line in lines[1:5]] == ["[one]", "[␣two]", "[bold]", "[/x]"]


def test_the_not_traced_note_lists_a_later_prefill_chunk_and_names_a_chunk_as_one(make_tiny_engine):
    """Trial 35e: with --max-prefill-tokens 8, step 1 ran request 0's decode (traced) beside request 1's last
    prefill chunk, and no line said request 1 was not traced (docs/teaching.md: a prompt prefilled in the same
    step as another is listed); step 0 called request 1's 3-of-7 chunk "(prefill)"."""
    import io

    from rich.console import Console

    from nanovllm_core import LLM, SamplingParams
    from nanovllm_core.educational.xray_view import XRayView

    engine = make_tiny_engine(num_kv_blocks=64, max_num_batched_tokens=8, enable_chunked_prefill=True)
    shown = []
    xray = XRayView(Console(file=io.StringIO(), width=200), engine, detail_layer=0, on_traced=shown.append)
    xray.subscribe()
    LLM.from_engine(engine).generate([[5] * 5, [6] * 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                     use_tqdm=False)
    xray.close()
    console = Console(file=io.StringIO(), width=400)
    for part in shown:
        console.print(part)
    notes = [line.strip() for line in console.file.getvalue().splitlines() if "Not traced in this step" in line]
    assert any("request 1 (prefill chunk, tokens 0..2 of 7)" in n for n in notes), notes
    assert any("request 1 (prefill chunk, tokens 3..6 of 7)" in n for n in notes), notes
