"""The CUDA path on real hardware: one script, a few minutes on one GPU.

    python -m benchmarks.gpu_check                    # every check, then the comparison benchmark
    python -m benchmarks.gpu_check --skip-comparison  # the checks only

On a machine without CUDA it prints one line saying so and exits with status 2. Checks, each
printed as PASS or FAIL with its figures (exit status 1 if any failed):

1. load: the embedded model loaded on the GPU in the engine's default dtype; the peak of
   allocated memory while loading against the weights' own size (a cast after
   materialising would show about 3x for float32 checkpoints into half precision);
2. greedy equivalence: the paged engine at the default block size and at 256, on a long and
   a short prompt together, gives the contiguous baseline's tokens (one request at a time);
3. no math fallback: the same generations, plus chunked prefill over a cached context, with
   SDPA restricted to its flash, memory-efficient and cuDNN kernels (a call only the math
   kernel would take raises instead of running);
4. no sync in a decode step: with ``torch.cuda.set_sync_debug_mode("warn")``, the forward pass
   of a decode step makes no host-device synchronisation, the whole step at most one (the
   sampled tokens coming back);
5. the KV pool: blocks, block size, kernel, bytes, and GPU memory left free;
6. tensor parallelism (NCCL), when two or more GPUs are visible (else it says so and is
   skipped): greedy tokens at the largest N <= the GPU count that splits the embedded model
   (SmolLM2: 3), or at N = 2 on a tiny random LLaMA with 4 query / 2 KV heads when only two
   GPUs are visible, equal to N = 1's, in float32 (a split only reorders partial sums);

then ``benchmarks.benchmark_comparison --quick --device cuda`` (ours against transformers).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

NO_CUDA = "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); run it on a machine with one"
MAX_TOKENS = 32
BLOCK_SIZES = (None, 256)  # None: the engine's default for this GPU


@dataclass
class Report:
    """Check results in order: (name, passed, detail)."""

    results: list[tuple[str, bool, str]] = field(default_factory=list)

    def add(self, name: str, passed: bool, detail: str) -> None:
        self.results.append((name, passed, detail))
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}", flush=True)

    @property
    def failed(self) -> list[str]:
        return [name for name, ok, _ in self.results if not ok]


def prompts(tokenizer: Any) -> list[list[int]]:
    """A long prompt (the benchmark corpus, ~1,400 tokens: several 256-token blocks) and a short one."""
    from benchmarks.common import corpus_token_ids

    return [corpus_token_ids(tokenizer)[:1400], tokenizer.encode("The capital of France is")]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (the shorter one's length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def generate(engine, token_prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of every prompt, submitted together."""
    from nanovllm_core.llm import LLM
    from nanovllm_core.sampling_params import SamplingParams

    outs = LLM.from_engine(engine).generate(token_prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                          ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def check_equivalence(report: Report, make_engine, token_prompts: list[list[int]]) -> None:
    """Paged at each block size against the contiguous baseline, token for token."""
    reference = generate(make_engine(paged=False), token_prompts)
    for block_size in BLOCK_SIZES:
        engine = make_engine(block_size=block_size)
        info = engine.model_info()
        tokens = generate(engine, token_prompts)
        diffs = [first_difference(a, b) for a, b in zip(tokens, reference)]
        detail = (f"block size {info['block_size']} ({info['attention_backend']}), prompts of "
                  f"{[len(p) for p in token_prompts]} tokens: " +
                  ", ".join("same" if d is None else f"differs from token {d}" for d in diffs))
        report.add(f"greedy paged == contiguous, block size {info['block_size']}", all(d is None for d in diffs),
                   detail)


def count_syncs(fn) -> tuple[Any, int]:
    """Run ``fn()`` with CUDA's sync debug mode on; (its result, the synchronisations it made)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in caught)


def check_syncs(report: Report, make_engine, token_prompts: list[list[int]]) -> None:
    """Decode steps of both prompts at each block size: syncs in the forward pass and in the whole step."""
    from nanovllm_core.sampling_params import SamplingParams

    for block_size in BLOCK_SIZES:
        engine = make_engine(block_size=block_size)
        for p in token_prompts:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + engine.scheduler.waiting):
            engine.step()  # prefill (and its first token)
        run, forward_syncs = engine.runner.run, []

        def counted(*args, **kwargs):
            result, n = count_syncs(lambda: run(*args, **kwargs))
            forward_syncs.append(n)
            return result

        engine.runner.run = counted
        step_syncs = [count_syncs(engine.step)[1] for _ in range(4)]
        engine.runner.run = run
        while engine.has_unfinished_requests():
            engine.step()
        info = engine.model_info()
        report.add(f"no sync in a decode step, block size {info['block_size']}",
                   max(forward_syncs) == 0 and max(step_syncs) <= 1,
                   f"{info['attention_backend']}: syncs per forward pass {forward_syncs}, per step {step_syncs} "
                   "(1 = the sampled tokens read back)")


def check_no_math_fallback(report: Report, make_engine, token_prompts: list[list[int]]) -> None:
    """The generations again, SDPA limited to its fused kernels; a 128-token budget chunks the long prompt."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    settings = [dict(paged=False)] + [dict(block_size=b, max_num_batched_tokens=128) for b in BLOCK_SIZES]
    for kwargs in settings:
        try:
            with sdpa_kernel(fused):
                generate(make_engine(**kwargs), token_prompts)
            report.add(f"no SDPA math fallback, {kwargs}", True, "flash/efficient/cuDNN ran every attention call")
        except RuntimeError as e:
            report.add(f"no SDPA math fallback, {kwargs}", False, str(e).splitlines()[0][:200])


def load_on_gpu(report: Report, device: torch.device):
    """Load the embedded model on ``device`` in the default dtype; report the load's peak memory."""
    from nanovllm_core.config import default_dtype
    from nanovllm_core.model.loader import load_model

    dtype = default_dtype(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    model, tokenizer, resolved = load_model(None, device, dtype)
    seconds = time.perf_counter() - t0
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated(device) - before
    report.add("load peak", peak < 1.5 * weights,
               f"{resolved.name} in {str(dtype).replace('torch.', '')}: weights {weights / 2**20:,.0f} MiB, "
               f"peak allocated while loading {peak / 2**20:,.0f} MiB ({peak / weights:.2f}x), {seconds:.1f} s")
    return model, tokenizer, resolved


def report_pool(report: Report, make_engine, device: torch.device) -> None:
    """The default KV pool on this GPU (sized from free memory after loading)."""
    engine = make_engine(num_kv_blocks=None)
    info = engine.model_info()
    free, total = torch.cuda.mem_get_info(device)
    tokens = info["num_kv_blocks"] * info["block_size"]
    report.add("KV pool", info["num_kv_blocks"] > 0,
               f"{info['num_kv_blocks']:,} blocks x {info['block_size']} tokens = {tokens:,} tokens "
               f"({engine.runner.kv_cache.nbytes / 2**30:.2f} GiB, {info['attention_backend']}); "
               f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free after allocating it")
    del engine
    torch.cuda.empty_cache()


def check_tensor_parallel(report: Report, token_prompts: list[list[int]]) -> None:
    """Greedy tokens at N > 1 (NCCL, one GPU per rank) against N = 1, float32; skipped (said so) with one GPU."""
    import tempfile

    from nanovllm_core.config import ModelConfig
    from nanovllm_core.llm import LLM
    from nanovllm_core.model.loader import load_hf_config, resolve_model
    from nanovllm_core.model.parallel import valid_sizes
    from nanovllm_core.sampling_params import SamplingParams

    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"SKIP  tensor-parallel greedy equality: {gpus} GPU visible, it needs 2 or more", flush=True)
        return
    model = None
    sizes = [n for n in valid_sizes(ModelConfig.from_hf(load_hf_config(resolve_model(None).path)), gpus) if n > 1]
    tmp = None
    if not sizes:  # SmolLM2's 3 KV heads do not split over 2 GPUs: a tiny random LLaMA with 2 KV heads does
        from transformers import LlamaConfig, LlamaForCausalLM

        tmp = tempfile.TemporaryDirectory()
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                     tie_word_embeddings=True)).float().save_pretrained(tmp.name)
        tokdir = resolve_model(None).path
        import shutil
        for f in tokdir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, tmp.name)
        model, sizes = tmp.name, [2]
    n = max(sizes)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [p[:256] for p in token_prompts]
    runs = {}
    for size in (1, n):
        with LLM(model, device="cuda", dtype="float32", num_kv_blocks=64, tensor_parallel_size=size,
                 progress=lambda *a: None) as llm:
            runs[size] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    diffs = [first_difference(a, b) for a, b in zip(runs[n], runs[1])]
    report.add(f"tensor-parallel greedy == N=1 at N={n} (nccl)", all(d is None for d in diffs),
               f"{model or 'embedded model'}, float32, {len(prompts)} prompts x 16 tokens: " +
               ", ".join("same" if d is None else f"differs from token {d}" for d in diffs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--skip-comparison", action="store_true", help="skip the comparison benchmark at the end")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 2
    from nanovllm_core.attention.selector import flash_attn_unsupported
    from nanovllm_core.config import EngineConfig
    from nanovllm_core.engine.llm_engine import LLMEngine

    device = torch.device("cuda")
    try:
        import flash_attn
        fa = f"flash-attn {flash_attn.__version__}"
    except Exception as e:  # not installed, or built for another torch
        fa = f"flash-attn not importable ({type(e).__name__})"
    major, minor = torch.cuda.get_device_capability(device)
    print(f"gpu_check: {torch.cuda.get_device_name(device)}, capability {major}.{minor}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, {fa}", flush=True)
    report = Report()
    model, tokenizer, resolved = load_on_gpu(report, device)
    why_not = flash_attn_unsupported(device, model.embed_tokens.weight.dtype, model.config.head_dim, 256)
    print(f"flash-attn's paged kernel at block size 256: {'used' if why_not is None else 'not used: ' + why_not}")

    def make_engine(**kwargs) -> LLMEngine:
        kwargs.setdefault("num_kv_blocks", 256)  # room for both prompts at either block size
        if kwargs.get("block_size") is None:
            kwargs.pop("block_size", None)
        return LLMEngine(EngineConfig(**kwargs), model, tokenizer, resolved)

    token_prompts = prompts(tokenizer)
    for check in (check_equivalence, check_no_math_fallback, check_syncs):
        try:
            check(report, make_engine, token_prompts)
        except Exception as e:  # one broken check must not hide the others' results
            report.add(check.__name__, False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    report_pool(report, make_engine, device)
    del model
    torch.cuda.empty_cache()
    try:
        check_tensor_parallel(report, token_prompts)
    except Exception as e:
        report.add("tensor-parallel greedy equality", False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    torch.cuda.empty_cache()
    if not args.skip_comparison:
        from benchmarks import benchmark_comparison

        benchmark_comparison.main(["--quick", "--device", "cuda"])
    passed = len(report.results) - len(report.failed)
    print(f"gpu_check: {passed} of {len(report.results)} checks passed"
          + (f"; failed: {', '.join(report.failed)}" if report.failed else ""))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
