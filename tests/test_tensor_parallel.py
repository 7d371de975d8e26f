"""Tensor parallelism (``--tensor-parallel-size N``): shards, sizes, determinism, failures, entry points.

What is claimed (``model/parallel.py``) and tested here:

- every shard has the shape and the rows of the Megatron split;
- sizes that do not split the model are one-line errors naming the sizes that work, raised
  before any process starts;
- within one N, greedy output repeats run to run and does not change with batching or with
  chunked prefill; against N = 1, log-probabilities agree within :data:`LOGPROB_TOLERANCE`
  (the split changes only the order of float32 partial sums);
- the per-rank timing in ``StepTimed`` is the runner's measurement, and the counts and bytes
  are those of the split (``2 * layers + 1`` all-reduces of ``[num_tokens, hidden]``);
- paused (or idle) longer than the collective timeout is fine (workers wait on their connection to rank 0);
- a killed worker ends the engine with a one-line error within seconds, every block freed,
  every process joined, the process group destroyed;
- SmolLM2 at N = 3 through the ``nanovllm`` command and ``LLM`` gives the N = 1 greedy text, and the
  app runs a prompt on it and shows each rank's time (one N = 3 engine shared by the LLM, app and command
  checks).

One tensor-parallel engine per process at a time (one ``torch.distributed`` group), so the
engines here are built and closed one after another.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rich.console import Console

from nanovllm_core import LLM, EngineDeadError, SamplingParams
from nanovllm_core import events as ev
from nanovllm_core.config import EngineConfig
from nanovllm_core.educational.commentary import ms
from nanovllm_core.config import ModelConfig
from nanovllm_core.model.loader import load_model
from nanovllm_core.model.parallel import TensorParallel, check_size, shard_spans, valid_sizes

# |log p(N) - log p(1)| for the top tokens of every generated position, float32 on the CPU.
LOGPROB_TOLERANCE = 1e-4
PROMPTS = ["Hello there my friend, how", "The capital of France is", "one two three four five six seven eight nine"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
QUIET = dict(progress=lambda *a: None)


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch):
    monkeypatch.setenv("NANOVLLM_TP_TIMEOUT_S", "3")


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_no_group_left(port: int | None = None):
    """No process group, no worker process left; with ``port``: rank 0's listening port is free again."""
    assert not dist.is_initialized()
    assert multiprocessing.active_children() == []
    if port is not None:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Greedy tokens and log-probabilities of PROMPTS at N = 1 on the tiny LLaMA."""
    llm = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64, **QUIET)
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


# ----------------------------------------------------------------------------- sizes


def test_valid_sizes_follow_the_heads():
    smol = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                       rope_theta=1e5, max_position_embeddings=2048, tie_word_embeddings=True)
    assert valid_sizes(smol, 8) == [1, 3]
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=2 does not split SmolLM2 .*sizes that work: 1, 3$"):
        check_size(smol, 2, "SmolLM2")
    check_size(smol, 3)
    shards = [shard_spans(smol, r, 3) for r in range(3)]
    assert [s["q_heads"] for s in shards] == [(0, 3), (3, 6), (6, 9)]
    assert [s["kv_heads"] for s in shards] == [(0, 1), (1, 2), (2, 3)]
    assert shards[2]["vocab"] == (32768, 49152)
    assert shards[0]["qkv_proj"] == (3 * 64 + 2 * 64, 576) and shards[0]["o_proj"] == (576, 192)
    assert shards[0]["gate_up_proj"] == (1024, 576) and shards[0]["down_proj"] == (576, 512)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0 is invalid"),
    (dict(tensor_parallel_size=None), "tensor_parallel_size=None is invalid"),
    (dict(tensor_parallel_size=2, quantization="gguf"),
     "quantization='gguf' (--quantization gguf) does not run with tensor_parallel_size > 1 (--tensor-parallel-size) "
     "yet; use quantization='none' (--quantization none)"),
    (dict(tensor_parallel_size=2, quantization="q8_0"),
     "quantization='q8_0' (--quantization q8_0) does not run with tensor_parallel_size > 1"),
    (dict(tensor_parallel_size=2, paged=False), "needs the paged engine"),
    (dict(tensor_parallel_size=2, speculative_model="ngram"), "speculative decoding does not run with"),
])
def test_bad_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs", [
    dict(tensor_parallel_size=3, quantization="gguf"),
    dict(tensor_parallel_size=1, tp_master_port=29500),
    dict(tensor_parallel_size=2, paged=False),
    dict(tensor_parallel_size=2, speculative_model="ngram"),
    dict(quantization="q8_0", dtype="bfloat16"),
    dict(num_speculative_tokens=3),
])
def test_a_settings_error_names_the_python_keyword_of_each_flag_it_names(kwargs):
    """Trial 16e: ``LLM(tensor_parallel_size=3, quantization="gguf")`` answered in CLI flags only
    (``use --quantization none``). Each flag such an error names comes with the keyword LLM(...) takes."""
    with pytest.raises(ValueError) as e:
        EngineConfig(**kwargs)
    text = str(e.value)
    for flag in re.findall(r"--([a-z][a-z-]*)", text):
        keyword = {"no-paged-attention": "paged"}.get(flag, flag.replace("-", "_"))
        assert re.search(rf"\b{keyword}\b[=)( ]", text.replace(f"--{flag}", "")), (flag, text)


def test_the_python_api_and_the_cli_read_their_own_name_in_one_message(tiny_llama_dir):
    """The same refusal through LLM(...) and ``nanovllm``: each caller finds the name it typed."""
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_llama_dir), device="cpu", tensor_parallel_size=3, quantization="gguf", **QUIET)
    assert "quantization='gguf'" in str(e.value) and "quantization='none'" in str(e.value)
    assert "tensor_parallel_size > 1" in str(e.value)
    assert "--quantization none" in str(e.value) and "--tensor-parallel-size" in str(e.value)


def test_a_size_that_does_not_divide_the_heads_fails_before_any_process_starts(tiny_llama_dir):
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=16, tensor_parallel_size=3, **QUIET)
    assert str(e.value).endswith("sizes that work: 1, 2") and "\n" not in str(e.value)
    assert_no_group_left()


def test_a_load_that_fails_on_rank_0_stops_the_workers_it_started(tiny_llama_dir):
    """The workers start before rank 0 reads its shard; when that read fails, they are stopped at once (they
    may be waiting in the rendezvous, not on their connection), and the one-line error is rank 0's."""
    from nanovllm_core.model.loader import ModelLoadError

    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"^max_model_len=100000 is longer than the model's context"):
        LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=16, tensor_parallel_size=2, max_model_len=100000, **QUIET)
    assert time.monotonic() - t0 < 30
    assert_no_group_left()


def test_no_quantization_with_tp_means_float_weights():
    from nanovllm_core.model.quantization import resolve_quantization

    assert EngineConfig(tensor_parallel_size=2).quantization is None  # auto, resolved at load
    assert EngineConfig(tensor_parallel_size=2, quantization="none").quantization == "none"
    mode, note = resolve_quantization(None, Path("model.gguf"), "cpu", torch.float32, tensor_parallel_size=2)
    assert mode is None and "tensor parallelism (2 ranks)" in note
    with pytest.raises(ValueError, match="does not run with tensor_parallel_size > 1"):
        EngineConfig(tensor_parallel_size=2, quantization="gguf")


def test_the_option_reaches_the_engine_from_every_command_line():
    from nanovllm_core.cli import build_parser, engine_kwargs
    from nanovllm_core.entrypoints.cli import build_parser as serve_parser
    from nanovllm_tui.options import parse_args

    assert engine_kwargs(build_parser().parse_args(["--tensor-parallel-size", "3"]))["tensor_parallel_size"] == 3
    assert engine_kwargs(build_parser().parse_args([]))["tensor_parallel_size"] == 1
    assert engine_kwargs(serve_parser().parse_args(["--tensor-parallel-size", "3"]))["tensor_parallel_size"] == 3
    assert engine_kwargs(parse_args(["--tensor-parallel-size", "3"]))["tensor_parallel_size"] == 3
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--tensor-parallel-size", "0"])
    assert e.value.code == 2


# ----------------------------------------------------------------------------- shards


@pytest.mark.parametrize("rank", [0, 1])
def test_every_shard_has_the_split_shape_and_rows(tiny_llama_dir, tiny_model, rank):
    model, _, _ = tiny_model
    cfg = model.config
    # rank's shard cut by the loader (no group is needed to cut, only to run)
    model2, _, _ = load_model(str(tiny_llama_dir), torch.device("cpu"), torch.float32,
                              tensor_parallel=TensorParallel(rank, 2))
    spans = shard_spans(cfg, rank, 2)
    d, q, kv, i = cfg.head_dim, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size
    (q0, q1), (k0, k1), (i0, i1), (v0, v1) = spans["q_heads"], spans["kv_heads"], spans["intermediate"], spans["vocab"]
    for layer, whole in zip(model2.layers, model.layers):
        a, w = layer.self_attn, whole.self_attn
        assert tuple(a.qkv_proj.weight.shape) == spans["qkv_proj"]
        expect = torch.cat([w.qkv_proj.weight[q0 * d:q1 * d], w.qkv_proj.weight[q + k0 * d:q + k1 * d],
                            w.qkv_proj.weight[q + kv + k0 * d:q + kv + k1 * d]])
        assert torch.equal(a.qkv_proj.weight, expect)
        assert tuple(a.o_proj.weight.shape) == spans["o_proj"]
        assert torch.equal(a.o_proj.weight, w.o_proj.weight[:, q0 * d:q1 * d])
        m, wm = layer.mlp, whole.mlp
        assert tuple(m.gate_up_proj.weight.shape) == spans["gate_up_proj"]
        assert torch.equal(m.gate_up_proj.weight, torch.cat([wm.gate_up_proj.weight[i0:i1],
                                                             wm.gate_up_proj.weight[i + i0:i + i1]]))
        assert tuple(m.down_proj.weight.shape) == spans["down_proj"]
        assert torch.equal(m.down_proj.weight, wm.down_proj.weight[:, i0:i1])
        assert (a.num_heads, a.num_kv_heads, m.intermediate_size) == (q1 - q0, k1 - k0, i1 - i0)
    assert tuple(model2.embed_tokens.weight.shape) == spans["embed_tokens"]
    assert torch.equal(model2.embed_tokens.weight, model.embed_tokens.weight[v0:v1])
    assert (model2.vocab_start, model2.vocab_end) == (v0, v1)


def test_each_rank_reads_only_its_rows_from_the_file_biases_and_an_untied_head_included(tmp_path, monkeypatch):
    """A tiny LLaMA with every bias and its own LM head: each rank's shard is read with safetensors'
    get_slice (no split tensor read whole); the column-parallel biases are split like their rows, a
    row-parallel bias is whole on rank 0 and zeros on rank 1, and the two shards rebuild the whole."""
    import safetensors

    from tests.conftest import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "biased", vocab_size=1000, attention_bias=True, mlp_bias=True,
                             tie_word_embeddings=False)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))  # transformers starts biases at zero: make them tell
    weights.update({k: torch.randn_like(v) for k, v in weights.items() if k.endswith(".bias")})
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cpu = torch.device("cpu")
    whole, _, _ = load_model(str(folder), cpu, torch.float32, quantization="none", with_tokenizer=False)
    whole_reads: list[str] = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.handle = real_open(*a, **k)

        def __enter__(self):
            self.f = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return self.f.get_slice(key)

        def get_tensor(self, key):
            whole_reads.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    shards = [load_model(str(folder), cpu, torch.float32, tensor_parallel=TensorParallel(r, 2), with_tokenizer=False)[0]
              for r in range(2)]
    assert whole_reads == []  # every tensor, split or not, went through get_slice
    cfg, d = whole.config, whole.config.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    for n, w in enumerate(whole.layers):
        a, b = (s.layers[n] for s in shards)
        for leaf in ("weight", "bias"):
            full = getattr(w.self_attn.qkv_proj, leaf)
            parts = [getattr(x.self_attn.qkv_proj, leaf) for x in (a, b)]
            # each rank's [q | k | v] rows; q, k and v of both ranks, in order, are the whole's
            for lo, hi, (p0, p1) in ((0, q, (0, q // 2)), (q, q + kv, (q // 2, q // 2 + kv // 2)),
                                     (q + kv, q + 2 * kv, (q // 2 + kv // 2, q // 2 + kv))):
                assert torch.equal(torch.cat([x[p0:p1] for x in parts]), full[lo:hi])
            full = getattr(w.mlp.gate_up_proj, leaf)
            i = cfg.intermediate_size
            parts = [getattr(x.mlp.gate_up_proj, leaf) for x in (a, b)]
            assert torch.equal(torch.cat([x[:i // 2] for x in parts]), full[:i])  # gate
            assert torch.equal(torch.cat([x[i // 2:] for x in parts]), full[i:])  # up
        assert torch.equal(torch.cat([a.self_attn.o_proj.weight, b.self_attn.o_proj.weight], 1), w.self_attn.o_proj.weight)
        assert torch.equal(torch.cat([a.mlp.down_proj.weight, b.mlp.down_proj.weight], 1), w.mlp.down_proj.weight)
        for rank0, rank1, full in ((a.self_attn.o_proj.bias, b.self_attn.o_proj.bias, w.self_attn.o_proj.bias),
                                   (a.mlp.down_proj.bias, b.mlp.down_proj.bias, w.mlp.down_proj.bias)):
            assert torch.equal(rank0, full) and torch.equal(rank1, torch.zeros_like(full)) and full.abs().sum() > 0
        assert torch.equal(a.input_layernorm.weight, w.input_layernorm.weight)
    assert torch.equal(torch.cat([s.lm_head.weight for s in shards]), whole.lm_head.weight)
    assert tuple(shards[1].lm_head.weight.shape) == (500, cfg.hidden_size)
    assert torch.equal(torch.cat([s.embed_tokens.weight for s in shards]), whole.embed_tokens.weight)


def test_the_ranks_spans_tile_the_model(tiny_model):
    """shard_spans of all ranks tile the heads, the intermediate rows and the vocabulary without gaps."""
    cfg = tiny_model[0].config
    for n in valid_sizes(cfg, 4):
        spans = [shard_spans(cfg, r, n) for r in range(n)]
        for key, total in (("q_heads", cfg.num_attention_heads), ("kv_heads", cfg.num_key_value_heads),
                           ("intermediate", cfg.intermediate_size), ("vocab", cfg.vocab_size)):
            assert spans[0][key][0] == 0 and spans[-1][key][1] == total
            assert all(a[key][1] == b[key][0] for a, b in zip(spans, spans[1:]))


# ----------------------------------------------------------------------------- N = 2, the tiny LLaMA


def kill_worker_and_check_the_engine_ends(llm: LLM, when: str, worker_pid: int | None = None,
                                          names: str | None = None, port: int | None = None) -> None:
    """SIGKILL worker rank 1 (``when``: "between steps" or "inside a step") while requests run: the engine
    must end within seconds with a one-line error naming the rank (``names``: the words that must name
    it), every block freed, the group gone (and rank 0's ``port`` free, for a worker that joined it)."""
    engine = llm.engine
    worker_pid = worker_pid or engine.model_info()["tensor_parallel_pids"][1]
    names = names or f"worker rank 1 (pid {worker_pid})"
    errors: list[ev.EngineError] = []
    engine.subscribe(lambda e: errors.append(e) if isinstance(e, ev.EngineError) else None, topk=0)
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    if when == "between steps":
        os.kill(worker_pid, signal.SIGKILL)
    else:
        engine.fault_injector = lambda plan: os.kill(worker_pid, signal.SIGKILL)
    t0 = time.monotonic()
    outputs = []
    while engine.has_unfinished_requests() and time.monotonic() - t0 < 20:
        outputs.extend(engine.step())
    took = time.monotonic() - t0
    assert took < 10, took
    assert [o.outputs[0].finish_reason for o in outputs if o.finished] == ["error"] * 3
    assert engine.block_manager.num_used_blocks == 0
    assert engine.fatal_error is not None and "\n" not in engine.fatal_error
    assert names in engine.fatal_error, engine.fatal_error
    assert errors and errors[-1].message == engine.fatal_error
    assert_no_group_left(port)
    with pytest.raises(EngineDeadError) as dead:  # the dead engine refuses new work, with its reason
        llm.generate(["again"], GREEDY, use_tqdm=False)
    assert str(dead.value) == engine.fatal_error
    llm.close()  # idempotent after the failure; then the LLM itself refuses new work
    with pytest.raises(ValueError, match=r"^this LLM is closed; create a new LLM\(\.\.\.\)$"):
        llm.generate(["again"], GREEDY, use_tqdm=False)


def test_n2_greedy_matches_n1_repeats_ignores_batching_times_truly_then_a_killed_worker(
        tiny_llama_dir, reference):
    """One N = 2 engine: greedy as N = 1 (log-probabilities within LOGPROB_TOLERANCE), the same run to run
    and prompt by prompt; StepTimed carries exactly the runner's measurements; then a worker killed
    inside a step ends it."""
    timed: list[ev.StepTimed] = []
    measured = []
    llm = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64, tensor_parallel_size=2, **QUIET)
    engine = llm.engine
    info = engine.model_info()
    assert info["tensor_parallel_size"] == 2 and info["tensor_parallel_backend"] == "gloo"
    assert [s["rank"] for s in info["tensor_parallel_shards"]] == [0, 1]
    sub = engine.subscribe(lambda e: timed.append(e) if isinstance(e, ev.StepTimed) else None, topk=0)
    original = engine.runner._execute_parallel

    def spy(entries, flat_rows):
        out = original(entries, flat_rows)
        measured.append(engine.runner.tp_timing)
        return out

    engine.runner._execute_parallel = spy
    from nanovllm_core.educational.xray_view import XRayView

    shown = []
    xray = XRayView(Console(file=io.StringIO()), engine, detail_layer=1, on_traced=shown.append)
    xray.subscribe()
    batched = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    xray.close()
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    assert engine.block_manager.num_used_blocks == 0
    engine.unsubscribe(sub)
    assert tokens(batched) == tokens(reference) == tokens(again) == tokens(alone)
    worst = 0.0
    for got, want in zip(batched, reference):
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert a.keys() == b.keys()
            worst = max(worst, max(abs(a[t].logprob - b[t].logprob) for t in a))
    assert worst <= LOGPROB_TOLERANCE, worst
    # StepTimed shows exactly what the runner measured, step by step.
    assert len(timed) == len(measured) > 0
    cfg = engine.model_config
    for t, m in zip(timed, measured):
        assert t.tp_size == 2 and t.tp_forward_s == m.wall_s and t.tp_comm_s == m.comm_s
        assert t.tp_compute_s == m.compute_s
        assert all(abs(c + x - w) < 1e-12 for c, x, w in zip(t.tp_compute_s, t.tp_comm_s, t.tp_forward_s))
        assert t.tp_all_reduces == 2 * cfg.num_hidden_layers + 1
        assert t.tp_all_reduce_bytes == t.tp_all_reduces * t.num_tokens * cfg.hidden_size * 4
        assert 0 < sum(m.latencies_s) <= t.tp_comm_s[0]
        assert ev.from_json(ev.to_json(t)) == t
    # The X-Ray of the split engine: nothing captured, said in one line; each rank's shards of the layer
    # as the engine cut them, and the bytes of the step's all-reduces as StepTimed counted them.
    assert xray.num_traced_steps == 0 and xray.num_split_steps == len(shown) > 0
    by_step = {t.step: t for t in timed}
    h, d = cfg.hidden_size, cfg.head_dim
    for group in shown:
        buf = io.StringIO()
        Console(file=buf, width=400, highlight=False).print(group)
        text = " ".join(buf.getvalue().split())
        t = by_step[int(re.search(r"Step (\d+): ", text).group(1))]
        assert "No captured values at tensor_parallel_size 2:" in text
        assert "layer 1's weights on each rank" in text
        for s in info["tensor_parallel_shards"]:
            (q0, q1), (k0, k1) = s["q_heads"], s["kv_heads"]
            (o_out, o_in), (down_out, down_in) = s["o_proj"], s["down_proj"]
            assert (f"rank {s['rank']}: q [{h}, {(q1 - q0) * d}] (query heads {q0}-{q1 - 1}), k and v "
                    f"[{h}, {(k1 - k0) * d}] each (KV head {k0}), o [{o_in}, {o_out}], gate and up "
                    f"[{h}, {s['gate_up_proj'][0] // 2}] each, down [{down_in}, {down_out}]") in text
        assert f"T = {t.num_tokens}: each all-reduce takes {t.num_tokens} x {h} x 4 bytes" in text
        assert f"{t.tp_all_reduces} all-reduces, {t.tp_all_reduce_bytes:,} bytes per rank" in text
        assert f"rank 1: compute {ms(t.tp_compute_s[1], digits=2)}" in text
    kill_worker_and_check_the_engine_ends(llm, "inside a step")


def test_n2_chunked_paused_single_step_abort_then_a_killed_worker(tiny_llama_dir, reference):
    """One N = 2 engine with a budget of 5 tokens a step (every prompt prefilled in chunks): the N = 1
    tokens; a pause longer than the collective timeout (3 s here) with requests waiting harms nothing
    (an idle engine is the same case for the workers: they wait on their connection, not in a collective);
    single step and abort through the controller; then a worker killed between steps ends it."""
    from nanovllm_core.engine.controller import EngineController
    from tests.conftest import poll_until

    llm = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64, tensor_parallel_size=2,
              max_num_batched_tokens=5, **QUIET)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(reference)
    ctl = EngineController.from_llm(llm, start_paused=True)
    try:
        steps = llm.engine.scheduler.step_index
        rid = ctl.submit(PROMPTS[0], GREEDY)
        other = ctl.submit(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        time.sleep(4.0)  # paused past the collective timeout: nothing runs, nothing times out
        assert llm.engine.scheduler.step_index == steps
        ctl.step(1)
        assert poll_until(lambda: llm.engine.scheduler.step_index == steps + 1, 10)
        ctl.abort(other)
        ctl.resume()
        out = ctl.wait(rid, timeout=30)
        assert out is not None and out.outputs[0].token_ids == reference[0].outputs[0].token_ids
        assert poll_until(lambda: llm.engine.block_manager.num_used_blocks == 0, 10)
    finally:
        assert ctl.shutdown(timeout=5)
    kill_worker_and_check_the_engine_ends(llm, "between steps")


# ----------------------------------------------------------------------------- SmolLM2 at N = 3


SMOL_PROMPT = "The capital of France is"
SMOL_GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
START_BOUND_S = 120  # an N = 3 engine starts in about 20 s on a busy 2-core EPYC (3 processes importing torch)


@pytest.fixture(scope="module")
def smol_n1(make_engine):
    """SmolLM2's greedy completion of SMOL_PROMPT at N = 1 (the shared float32 model)."""
    return LLM.from_engine(make_engine(num_kv_blocks=32)).generate([SMOL_PROMPT], SMOL_GREEDY, use_tqdm=False)[0]


SMOL_CLI = ["--tensor-parallel-size", "3", "--device", "cpu", "--prompt", SMOL_PROMPT, "--max-tokens", "5",
            "--temperature", "0", "--ignore-eos", "--num-kv-blocks", "32", "--xray"]


@pytest.fixture(scope="module")
def smol_n3():
    """One SmolLM2 engine at N = 3, built with the ``LLM`` keywords the ``nanovllm`` command derives from
    SMOL_CLI (started once: ~20 s), for the module's LLM, app and command checks. The command check runs
    last and closes it, as the command closes the LLM it built; the close here is then a no-op."""
    from nanovllm_core.cli import build_parser, engine_kwargs

    t0 = time.monotonic()
    llm = LLM(**engine_kwargs(build_parser().parse_args(SMOL_CLI)), **QUIET)
    llm.start_s = time.monotonic() - t0
    yield llm
    llm.close()
    assert_no_group_left()


@pytest.mark.real_model
def test_smollm2_at_n3_from_llm_gives_the_n1_text(smol_n3, smol_n1):
    assert smol_n3.start_s < START_BOUND_S
    assert [s["kv_heads"] for s in smol_n3.engine.model_info()["tensor_parallel_shards"]] == [(0, 1), (1, 2), (2, 3)]
    got, want = smol_n3.generate([SMOL_PROMPT], SMOL_GREEDY, use_tqdm=False)[0].outputs[0], smol_n1.outputs[0]
    assert got.token_ids == want.token_ids
    worst = max(abs(a[t].logprob - b[t].logprob) for a, b in zip(got.logprobs, want.logprobs) for t in a)
    assert worst <= LOGPROB_TOLERANCE, worst
    print(f"SmolLM2 N=3 vs N=1: worst |log p difference| over the top-3 of 5 tokens {worst:.2e}")
    assert smol_n3.engine.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match=r"sizes that work: 1, 3$"):  # the CLI prints this as its one-line error
        LLM(num_kv_blocks=32, tensor_parallel_size=2, device="cpu", **QUIET)


@pytest.mark.real_model
@pytest.mark.anyio
async def test_the_app_at_n3_runs_a_prompt_and_shows_where_each_ranks_time_went(smol_n3, tmp_path, monkeypatch):
    """``nanovllm-tui --tensor-parallel-size 3``: the option reaches the engine the app starts (here the module's
    N = 3 engine stands in for a second start of three processes), a prompt runs to its 5 tokens, and the
    dashboard shows each rank's compute and communication of the newest step, as its StepTimed says."""
    from nanovllm_core.engine import controller
    from nanovllm_tui.options import build_app
    from tests.tui_helpers import wait_until

    real, asked = controller.EngineController, []

    def start(start_paused=False, **kwargs):
        asked.append(kwargs)
        return real.from_llm(smol_n3, start_paused=start_paused)

    monkeypatch.setattr(controller, "EngineController", start)
    app = build_app(["--tensor-parallel-size", "3", "--device", "cpu", "--prompt", SMOL_PROMPT, "--max-tokens", "5",
                     "--temperature", "0", "--ignore-eos", "--progress-file", str(tmp_path / "p.json")])
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: any(r.state == "finished" for r in app.state.requests.values()),
                         what="the prompt to finish")
        await pilot.pause(0.2)
        assert [a["tensor_parallel_size"] for a in asked] == [3]
        (req,) = app.state.requests.values()
        assert req.num_output == 5 and req.text
        assert app.state.model_info["tensor_parallel_size"] == 3
        panel = app.query_one("#dash-tp")
        assert panel.display and panel.border_title == "Where the last step's time went (3 ranks)"
        t = app.state.timings[-1]
        text = str(panel.render())
        for r in range(3):
            assert f"rank {r}: compute {ms(t.tp_compute_s[r], digits=2)}" in text
        assert f"{t.tp_all_reduces} all-reduces a rank, {t.tp_all_reduce_bytes:,} bytes from each" in text
        await pilot.press("escape", "q")
    assert smol_n3.engine.block_manager.num_used_blocks == 0


@pytest.mark.real_model
def test_smollm2_at_n3_from_the_cli_gives_the_n1_text(smol_n3, smol_n1, capsys, monkeypatch):
    """The ``nanovllm`` command's own main, at N = 3, with --xray: the split engine's prefill and first
    decode drawn. The ``LLM`` it asks for (its keywords checked equal to those smol_n3 was started with)
    is the module's N = 3 engine, so three more processes need not start; the command closes it when
    done, so this runs after the module's other smol_n3 checks."""
    from nanovllm_core import cli
    from nanovllm_core import llm as llm_module
    from tests.conftest import run_main

    asked = []

    def build(progress=None, **kwargs):
        asked.append(kwargs)
        return smol_n3

    monkeypatch.setattr(llm_module, "LLM", build)
    code, out, err = run_main(cli.main, capsys, *SMOL_CLI)
    assert code == 0, err[-2000:]
    assert asked == [cli.engine_kwargs(cli.build_parser().parse_args(SMOL_CLI))]
    assert asked[0]["tensor_parallel_size"] == 3 and asked[0]["device"] == "cpu"
    assert_no_group_left()  # the command closed its LLM: workers joined, the group destroyed
    assert f"Completion: {smol_n1.outputs[0].text!r}" in out
    assert "tensor parallel over 3 ranks (gloo)" in out
    # --xray of the split engine: no capture, said in one line; its prefill and first decode drawn from the sizes
    shown = " ".join(out.split())
    assert shown.count("No captured values at tensor_parallel_size 3:") == 2
    assert "rank 2: q [576, 192] (query heads 6-8), k and v [576, 64] each (KV head 2)" in shown
    assert "T = 1: each all-reduce takes 1 x 576 x 4 bytes = 2,304 bytes" in shown  # the decode step: 1 token


def test_workers_start_inside_an_app_whose_stderr_has_no_file_descriptor(monkeypatch):
    """Textual's capture of stderr has fileno() -1; multiprocessing's resource tracker would pass it on
    and fail ("bad value(s) in fds_to_keep"), so the workers start with the process's real stderr."""
    import io

    from nanovllm_core.engine.tensor_parallel import _stderr_with_a_file_descriptor

    class Capture(io.StringIO):
        def fileno(self) -> int:
            return -1

    capture = Capture()
    monkeypatch.setattr(sys, "stderr", capture)
    with _stderr_with_a_file_descriptor():
        assert sys.stderr is not capture and sys.stderr.fileno() >= 0
    assert sys.stderr is capture


# ----------------------------------------------------------------------------- the app's demos beside a split engine


@pytest.mark.anyio
async def test_a_split_apps_tutorial_refuses_engine_demos_and_keeps_serving(tiny_llama_dir, tmp_path):
    """Trial 17b #1: under ``nanovllm-tui --tensor-parallel-size N``, ``r`` on chapter 5 or 12 built a demo engine
    over the loaded model (rank 0's shard), whose all-reduces waited on ranks that never joined; gloo timed out
    and the app's own engine died (every later prompt failed). Now ``r`` there is refused at once in one line
    naming the terminal command, the chapter text does not invite it, no demonstration engine is built (the
    library refuses the shard too), and the app's engine still answers a prompt."""
    from nanovllm_core.educational.tutorial import CHAPTERS, TutorialProgress
    from nanovllm_core.educational.tutorial_demos import EngineDemos
    from nanovllm_core.engine.controller import EngineController
    from nanovllm_tui.app import NanoVLLMApp
    from nanovllm_tui.views.tutorial import TutorialView
    from nanovllm_tui.widgets.prompt_bar import PromptSettings
    from tests.tui_helpers import Notes, send_prompt, wait_until

    llm = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64, tensor_parallel_size=2, **QUIET)
    engine = llm.engine
    with pytest.raises(ValueError, match=r"^No demonstration over rank 0's shard of a model split over 2 ranks: .*"
                                         r"run `nanovllm --tutorial` in a terminal$"):
        EngineDemos.from_loaded(engine.model, engine.tokenizer, engine.resolved)
    number = next(c.number for c in CHAPTERS if c.demo == "kv_cache")
    path = tmp_path / "tutorial.json"
    TutorialProgress(current=number - 1).save(path)
    app = NanoVLLMApp(EngineController.from_llm(llm), settings=PromptSettings(max_tokens=3, chat=False),
                      tutorial_path=path)
    notes = Notes()
    try:
        async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
            await wait_until(pilot, lambda: app.state.ready, what="the ready event")
            await pilot.press("escape", "4")
            await pilot.pause(0.2)
            tutorial = app.query_one(TutorialView)
            assert tutorial.chapter.number == number
            text = " ".join(str(tutorial.query_one("#chapter-text").render()).split())
            assert "Press r" not in text
            want = (f"No demonstration beside an engine split over 2 ranks: a demonstration builds an engine over the "
                    f"whole loaded model, and here that is rank 0's shard; run `nanovllm --tutorial "
                    f"--tutorial-chapter {number}` in a terminal.")
            assert want in text
            await pilot.press("r")
            await pilot.pause(0.3)
            assert tutorial.session is None
            assert notes.find(want, "warning")
            for n in CHAPTERS:  # every engine demonstration is refused; chapter 13's measurement is not
                tutorial.progress.current = n.number - 1
                if n.demo:
                    assert tutorial.check_action("run_demo", ()) is bool(tut_demo(n).allreduce_ranks), n.number
            # chapter 13's intro in a split app: the app's engine is the split run, not three processes to add
            tutorial.progress.current = len(CHAPTERS) - 2
            await pilot.press("right")  # to the last chapter, 13
            await pilot.pause(0.2)
            assert tutorial.chapter.demo == "tensor_parallel"
            text = " ".join(str(tutorial.query_one("#chapter-text").render()).split())
            assert "This app's own engine is already the model split over 2 ranks" in text
            assert "three more processes" not in text and "where this app's own engine is one process" not in text
            assert "Press r to measure it." in text and tutorial.check_action("run_demo", ()) is True
            await pilot.press("escape", "1")
            await send_prompt(pilot, "Hello there")
            await wait_until(pilot, lambda: any(r.state == "finished" for r in app.state.requests.values()),
                             what="the prompt to finish")
            (req,) = app.state.requests.values()
            assert req.num_output == 3 and not req.error
            await pilot.press("escape", "q")
    finally:
        llm.close()
    assert_no_group_left()


def tut_demo(chapter):
    from nanovllm_core.educational.tutorial import DEMOS

    return DEMOS[chapter.demo]
