"""The CUDA path, checked without a GPU: kernel choice, dtype choice, loading, and flash-attn's contract.

No GPU runs these tests. What a GPU would refuse is encoded from its documentation instead:
flash-attn 2.8's argument checks live in ``tests/fake_flash_attn.py`` (a CPU stand-in that
computes the reference result), the compute capability is monkeypatched. The proof on
hardware is ``python -m benchmarks.gpu_check``.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import torch

from nanovllm_core.attention import selector
from nanovllm_core.config import EngineConfig, default_dtype
from nanovllm_core.engine import model_runner
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_core.llm import LLM
from nanovllm_core.model.loader import load_model
from nanovllm_core.sampling_params import SamplingParams
from tests import fake_flash_attn

CUDA = torch.device("cuda:0")


@pytest.fixture
def gpu(monkeypatch):
    """Pretend the configured CUDA device has a given compute capability: ``gpu(8, 0)``."""
    def set_capability(major: int, minor: int) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
    return set_capability


# ----------------------------------------------------------------------------- kernel choice


@pytest.mark.parametrize("dtype, capability, head_dim, block_size, reason", [
    (torch.float32, (8, 0), 64, 256, "float16 and bfloat16 only"),
    (torch.float16, (7, 5), 64, 256, "compute capability 8.0"),
    (torch.float16, (8, 0), 68, 256, "multiple of 8"),
    (torch.float16, (8, 0), 320, 256, "at most 256"),
    (torch.bfloat16, (9, 0), 64, 16, "multiple of 256 tokens"),
])
def test_flash_attn_is_refused_where_mha_varlen_fwd_refuses(monkeypatch, gpu, dtype, capability, head_dim,
                                                             block_size, reason):
    fake_flash_attn.install(monkeypatch)
    gpu(*capability)
    assert reason in selector.flash_attn_unsupported(CUDA, dtype, head_dim, block_size)
    assert not selector.flash_attn_available(CUDA, dtype, head_dim, block_size)


@pytest.mark.parametrize("head_dim", [64, 72, 128, 256])
def test_flash_attn_is_chosen_where_it_runs(monkeypatch, gpu, head_dim):
    # 72 is a multiple of 8: flash-attn 2.8 rounds it up to its 96-wide kernel and runs it.
    fake_flash_attn.install(monkeypatch)
    gpu(8, 0)
    assert selector.flash_attn_unsupported(CUDA, torch.bfloat16, head_dim, 512) is None


def test_flash_attn_not_installed_or_not_cuda_is_refused(monkeypatch, gpu):
    gpu(9, 0)
    monkeypatch.setitem(__import__("sys").modules, "flash_attn", None)  # import flash_attn -> ImportError
    assert "not installed" in selector.flash_attn_unsupported(CUDA, torch.float16, 64, 256)
    assert "CUDA" in selector.flash_attn_unsupported(torch.device("cpu"), torch.float16, 64, 256)


def test_default_block_size_is_flash_attns_page_only_where_flash_attn_runs(monkeypatch, gpu):
    fake_flash_attn.install(monkeypatch)
    gpu(8, 6)
    assert selector.default_block_size(CUDA, torch.bfloat16, 64) == 256
    assert selector.default_block_size(CUDA, torch.bfloat16, 64, backend="math") == 16
    assert selector.default_block_size(CUDA, torch.float32, 64) == 16
    gpu(7, 5)
    assert selector.default_block_size(CUDA, torch.float16, 64) == 16
    assert selector.default_block_size(torch.device("cpu"), torch.float32, 64) == 16


def test_dtype_default_follows_the_configured_gpus_capability(gpu):
    gpu(7, 5)  # Turing: bfloat16 only emulated
    assert default_dtype(CUDA) == torch.float16
    gpu(8, 0)
    assert default_dtype(CUDA) == torch.bfloat16
    assert default_dtype(torch.device("cpu")) == torch.float32
    assert EngineConfig(device="cpu").torch_dtype == torch.float32


# ----------------------------------------------------------------------------- loading


def test_loader_casts_before_materialising(monkeypatch, tiny_llama_dir):
    from nanovllm_core.model import loader

    seen: list[set[torch.dtype]] = []
    materialize = loader.materialize_empty  # what the loader gives storage with (blocks kept by gguf stay)

    def spy(module, *args, **kwargs):
        seen.append({p.dtype for p in module.parameters()})
        return materialize(module, *args, **kwargs)

    monkeypatch.setattr(loader, "materialize_empty", spy)
    model, _, _ = load_model(str(tiny_llama_dir), torch.device("cpu"), torch.bfloat16)
    assert seen == [{torch.bfloat16}], "parameters were materialised before the cast"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# ----------------------------------------------------------------------------- the lowest torch

# What the code calls that older torch releases lack, with the first release that has it.
TORCH_FEATURES = {
    "enable_gqa=": (2, 5),                       # F.scaled_dot_product_attention(..., enable_gqa=)
    "nn.functional.rms_norm(": (2, 4),
    "pin_memory=True": (1, 0),
}


def test_pyproject_torch_floor_covers_what_the_code_calls():
    root = Path(__file__).resolve().parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(re.fullmatch(r"torch>=(\d+)\.(\d+)", d.replace(" ", "")) for d in deps if d.startswith("torch"))
    floor = (int(floor[1]), int(floor[2]))
    source = "\n".join(p.read_text() for p in (root / "src" / "nanovllm_core").rglob("*.py"))
    used = {name: version for name, version in TORCH_FEATURES.items() if name in source}
    assert "enable_gqa=" in used
    assert floor >= max(used.values()), f"pyproject allows torch {floor}, the code needs {max(used.values())}"


# ----------------------------------------------------------------------------- flash-attn's contract


def test_fake_flash_attn_refuses_what_flash_attn_refuses(monkeypatch):
    fake = fake_flash_attn.install(monkeypatch)
    q = torch.zeros(3, 4, 16, dtype=torch.float16)
    k = torch.zeros(2, 256, 2, 16, dtype=torch.float16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    table = torch.tensor([[1]], dtype=torch.int32)
    ok = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3, causal=True, block_table=table)
    assert fake.flash_attn_varlen_func(q, k, k, **ok).shape == q.shape
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        fake.flash_attn_varlen_func(q.float(), k.float(), k.float(), **ok)
    with pytest.raises(RuntimeError, match="int32"):
        fake.flash_attn_varlen_func(q, k, k, **{**ok, "cu_seqlens_k": cu.long()})
    with pytest.raises(RuntimeError, match="block_table must have dtype"):
        fake.flash_attn_varlen_func(q, k, k, **{**ok, "block_table": table.long()})
    with pytest.raises(RuntimeError, match="divisible by 256"):
        fake.flash_attn_varlen_func(q, k[:, :16], k[:, :16], **ok)
    with pytest.raises(RuntimeError, match="must divide"):
        fake.flash_attn_varlen_func(q[:, :3], k, k, **ok)


SHARED = list(range(1000, 1300))  # 300 tokens: one full 256-token block a later prompt can hit in the cache
PROMPTS = [
    [7, 8, 9, 10],
    SHARED + [11, 12],
    list(range(2000, 2290)),
    [5] * 40,
    SHARED + [13, 14, 15],
    list(range(3000, 3530)),  # three blocks
]


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_half(tmp_path_factory, default_model_dir):
    """A tiny random LLaMA (GQA 4:2, head size 16) in float16 on the CPU, contexts up to 1024 tokens."""
    from tests.conftest import save_tiny_llama

    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-fp16"), default_model_dir, seed=3,
                           max_position_embeddings=1024, initializer_range=0.2)
    return load_model(str(path), torch.device("cpu"), torch.float16)


def test_flash_attn_path_at_block_size_256_equals_the_contiguous_baseline(monkeypatch, tiny_half):
    model, tokenizer, resolved = tiny_half

    def llm(**kwargs) -> LLM:
        return LLM.from_engine(LLMEngine(EngineConfig(**kwargs), model, tokenizer, resolved))

    reference = _generate(llm(paged=False, num_kv_blocks=64))
    assert len({tuple(t) for t in reference}) > 3, "the random model says the same thing to every prompt"
    fake_flash_attn.install(monkeypatch)
    monkeypatch.setattr(model_runner, "flash_attn_available", lambda *args: True)

    together = llm(block_size=256, num_kv_blocks=32)  # every prompt in one step, then batched decodes
    assert together.engine.model_info()["attention_backend"] == "flash-attn"
    assert _generate(together) == reference
    assert any(c["batch_size"] == len(PROMPTS) and max(c["q_lens"]) == 1 for c in fake_flash_attn.calls)

    # A 96-token budget and a 5-block pool: chunks continue cached contexts, the shared
    # prompt's first block is a prefix-cache hit, and a request is preempted.
    fake_flash_attn.calls.clear()
    squeezed = llm(block_size=256, num_kv_blocks=5, max_num_batched_tokens=96)
    assert _generate(squeezed) == reference
    stats = squeezed.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0
    assert any(max(c["q_lens"]) > 1 and max(c["k_lens"]) > 256 for c in fake_flash_attn.calls)


@pytest.mark.parametrize("num_queries, start", [(1, 9), (5, 12)])
def test_masked_attention_folded_equals_sdpa_with_gqa(num_queries, start):
    # The form CUDA runs (no mask together with GQA), checked against SDPA's own GQA on the CPU.
    from nanovllm_core.attention.ops import causal_mask, masked_attention_folded

    gen = torch.Generator().manual_seed(0)
    ctx = start + num_queries
    q = torch.randn(1, 9, num_queries, 16, generator=gen)
    k, v = torch.randn(2, 1, 3, ctx, 16, generator=gen)
    mask = causal_mask(start, num_queries, ctx, q.device)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(masked_attention_folded(q, k, v, mask), expected, atol=1e-5)


# ----------------------------------------------------------------------------- errors on CUDA


def _failing_engine(tiny_half, monkeypatch, error: Exception, failures: int):
    """An engine that believes it runs on CUDA and whose first ``failures`` forward passes raise ``error``."""
    model, tokenizer, resolved = tiny_half
    engine = LLMEngine(EngineConfig(num_kv_blocks=64), model, tokenizer, resolved)
    events = []
    engine.subscribe(events.append, topk=0, blocks=False)
    for prompt in ([5, 6, 7], [8, 9], [10, 11, 12, 13]):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    monkeypatch.setattr(engine, "device", CUDA)  # what the step's error handling asks; the model stays on the CPU
    run, calls = engine.runner.run, []

    def flaky(*args, **kwargs):
        calls.append(len(args[0]))
        if len(calls) <= failures:
            raise error
        return run(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "run", flaky)
    return engine, events, calls


def test_a_cuda_error_stops_the_engine_once_and_finishes_every_request_as_an_error(monkeypatch, tiny_half):
    error = RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA")
    engine, events, calls = _failing_engine(tiny_half, monkeypatch, error, failures=99)
    outputs = engine.step()
    assert calls == [3], "the broken context was retried request by request"
    assert [type(e).__name__ for e in events].count("EngineError") == 1
    assert sorted(o.outputs[0].finish_reason for o in outputs) == ["error"] * 3
    assert all("device-side assert" in o.error and "restart" in o.error for o in outputs)
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished_requests()
    engine.add_request([5, 6], SamplingParams(max_tokens=2))  # refused from now on, with the reason
    (late,) = engine.step()
    assert late.outputs[0].finish_reason == "rejected" and "device-side assert" in late.error
    assert calls == [3]


def test_cuda_out_of_memory_is_retried_request_by_request(monkeypatch, tiny_half):
    engine, events, calls = _failing_engine(tiny_half, monkeypatch, torch.cuda.OutOfMemoryError("CUDA out of memory"),
                                            failures=1)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert calls[:4] == [3, 1, 1, 1]
    assert sorted(o.outputs[0].finish_reason for o in finished) == ["length"] * 3
    assert engine.fatal_error is None


# ----------------------------------------------------------------------------- the prepared GPU check


def test_gpu_check_says_one_line_without_cuda(monkeypatch, capsys):
    from benchmarks import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert capsys.readouterr().out.splitlines() == [gpu_check.NO_CUDA]


def test_gpu_check_equivalence_check_reports_each_block_size_on_the_cpu(monkeypatch, tiny_half, capsys):
    from benchmarks import gpu_check

    model, tokenizer, resolved = tiny_half
    monkeypatch.setattr(gpu_check, "MAX_TOKENS", 6)

    def make_engine(**kwargs):
        kwargs.setdefault("num_kv_blocks", 64)
        if kwargs.get("block_size") is None:
            kwargs.pop("block_size", None)
        return LLMEngine(EngineConfig(**kwargs), model, tokenizer, resolved)

    report = gpu_check.Report()
    gpu_check.check_equivalence(report, make_engine, [list(range(1000, 1300)), [7, 8, 9]])
    assert [ok for _, ok, _ in report.results] == [True, True] and not report.failed
    assert "block size 256 (sdpa)" in capsys.readouterr().out
    assert gpu_check.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert gpu_check.first_difference([1, 2], [1, 2, 3]) == 2
    assert gpu_check.first_difference([4], [4]) is None
