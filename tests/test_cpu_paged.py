"""The CPU PagedAttention kernel (``attention.cpu_paged``): right values, the same bits in any batch, and a fallback.

Values are checked against a float64 softmax(q k^T / sqrt(d)) v over each token's context,
gathered from the pool in block-table order. Batch invariance is checked bit for bit: a
token alone, in a batch of other sequences, as one row of a prefill chunk, and on 1 or 2
threads. Where the kernel cannot be built the engine must fall back to the gather path and
say why.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanovllm_core.attention import cpu_paged
from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_core.engine.model_runner import ModelRunner, PlanEntry
from nanovllm_core.model import loader
from nanovllm_core.sampling_params import SamplingParams
from tests import native_builds

needs_kernel = pytest.mark.skipif(not cpu_paged.available(torch.device("cpu"), torch.float32, "flash"),
                                  reason=f"the CPU paged kernel is not available here: "
                                         f"{cpu_paged.unsupported_reason(torch.device('cpu'), torch.float32, 'flash')}")


def make_pool(num_kv_heads=3, num_blocks=40, block_size=16, head_dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def reference(q, k_pool, v_pool, table, context):
    """float64 attention of one token ``q [num_heads, head_dim]`` over the first ``context`` slots of ``table``."""
    nkv, _, bs, hd = k_pool.shape
    k = k_pool[:, table].reshape(nkv, -1, hd)[:, :context].double()
    v = v_pool[:, table].reshape(nkv, -1, hd)[:, :context].double()
    group = q.shape[0] // nkv
    qg = q.double().view(nkv, group, hd)
    p = torch.softmax(qg @ k.transpose(1, 2) / hd ** 0.5, dim=-1)
    return (p @ v).reshape(-1, hd)


def run_kernel(q, k_pool, v_pool, tables, rows, context):
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return cpu_paged.paged_attention(q, k_pool, v_pool, bt, torch.tensor(rows, dtype=torch.int32),
                                     torch.tensor(context, dtype=torch.int32), max(context))


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 4, 40, 8), (8, 2, 128, 4)])
def test_each_token_gets_softmax_qk_v_over_its_own_context(heads, kv_heads, head_dim, block_size):
    k_pool, v_pool = make_pool(kv_heads, 64, block_size, head_dim)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
    # a lone decode of 1 key, a decode ending exactly on a block boundary, a longer one, and a 5-token chunk
    contexts = [[1], [4 * block_size], [7 * block_size + 3], list(range(2 * block_size + 1, 2 * block_size + 6))]
    tables, rows, ctx, start = [], [], [], 0
    for i, c in enumerate(contexts):
        n = -(-max(c) // block_size)
        tables.append(perm[start:start + n])
        start += n
        rows += [i] * len(c)
        ctx += c
    q = torch.randn(len(ctx), heads, head_dim, generator=torch.Generator().manual_seed(2))
    out = run_kernel(q, k_pool, v_pool, tables, rows, ctx)
    assert out.shape == q.shape and out.dtype == torch.float32
    for t in range(len(ctx)):
        want = reference(q[t], k_pool, v_pool, tables[rows[t]], ctx[t])
        torch.testing.assert_close(out[t].double(), want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_token_gets_the_same_bits_alone_in_a_batch_in_a_chunk_and_on_any_thread_count():
    k_pool, v_pool = make_pool()
    table = [5, 17, 2, 30, 11]  # the token's sequence: 70 tokens over 5 blocks
    q = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    alone = run_kernel(q[None], k_pool, v_pool, [table], [0], [70])[0]
    # in a batch: other sequences before and after it, of other lengths and blocks
    others = torch.randn(3, 9, 64)
    batch = torch.cat([others[:2], q[None], others[2:]])
    batched = run_kernel(batch, k_pool, v_pool, [[1, 3], table, [7, 8, 9]], [0, 0, 1, 2], [20, 25, 70, 40])[2]
    # as the last row of a 6-token prefill chunk of its own sequence
    chunk_q = torch.cat([torch.randn(5, 9, 64), q[None]])
    chunked = run_kernel(chunk_q, k_pool, v_pool, [table], [0] * 6, list(range(65, 71)))[5]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = run_kernel(batch, k_pool, v_pool, [[1, 3], table, [7, 8, 9]], [0, 0, 1, 2], [20, 25, 70, 40])[2]
    finally:
        torch.set_num_threads(threads)
    for other in (batched, chunked, one_thread):
        assert torch.equal(alone, other)


@needs_kernel
def test_wrong_inputs_are_one_line_errors():
    k_pool, v_pool = make_pool()
    q = torch.randn(1, 9, 64)
    bt, rows, ctx = torch.zeros((1, 1), dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    bad = [
        (q.double(), k_pool, v_pool, bt, rows, ctx, "float32"),
        (q, k_pool.transpose(1, 2), v_pool, bt, rows, ctx, "contiguous"),
        (torch.randn(1, 8, 64), k_pool, v_pool, bt, rows, ctx, "cannot share"),
        (q, k_pool, v_pool, bt.long(), rows, ctx, "int32"),
    ]
    for *args, said in bad:
        with pytest.raises(ValueError, match=said) as e:
            cpu_paged.paged_attention(*args, max_context=1)
        assert "\n" not in str(e.value)


@needs_kernel
def test_the_runner_refuses_a_block_table_that_cannot_hold_the_context():
    """The kernel reads raw memory: a short table or a block outside the pool is refused before it runs."""
    runner = SimpleNamespace(block_size=16, kv_cache=SimpleNamespace(num_blocks=8), device=torch.device("cpu"),
                             _num_decodes=ModelRunner._num_decodes)
    with pytest.raises(ValueError, match="cannot hold its 20 tokens"):
        ModelRunner._cpu_paged_metadata(runner, [PlanEntry(4, 0, tuple(range(20)), (1,))], None)
    with pytest.raises(ValueError, match="pool of 8 blocks"):
        ModelRunner._cpu_paged_metadata(runner, [PlanEntry(4, 19, (7,), (1, 8))], None)


def test_without_a_compiler_the_engine_gathers_and_says_why(monkeypatch):
    from nanovllm_core import native

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("CC", "/nonexistent/cc")
    why = cpu_paged.unsupported_reason(torch.device("cpu"), torch.float32, "flash")
    assert why is not None and "no C compiler" in why and "install gcc" in why
    with pytest.raises(RuntimeError, match="not available"):
        cpu_paged.paged_attention(torch.randn(1, 9, 64), *make_pool(), torch.zeros((1, 1), dtype=torch.int32),
                                  torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1)


def test_the_cli_says_when_the_c_paths_are_not_used_and_why(monkeypatch, capsys, tiny_llama_dir):
    """A run that silently fell back (no compiler, a switch) would hide why it is slower."""
    from tests.conftest import run_main

    from nanovllm_core import cli, native

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("NANOVLLM_NATIVE_OPS", "0")
    code, out, _ = run_main(cli.main, capsys, "--model", str(tiny_llama_dir), "--prompt", "Hi", "--max-tokens", "2")
    assert code == 0
    assert "note: the CPU paged attention kernel is not used (K/V are gathered for SDPA): no C compiler was found" in out
    assert "note: RMSNorm and RoPE run as PyTorch ops, not in C: NANOVLLM_NATIVE_OPS=0" in out


def test_the_cli_says_when_block_layers_run_without_their_c_kernel(monkeypatch, capsys, tiny_llama_dir):
    from tests.conftest import run_main

    from nanovllm_core import cli, native

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("CC", "/nonexistent/cc")
    code, out, _ = run_main(cli.main, capsys, "--model", str(tiny_llama_dir), "--prompt", "Hi", "--max-tokens", "2",
                            "--quantization", "q8_0")
    assert code == 0
    assert ("note: block-quantized layers dequantize and run PyTorch's matmul, not the C kernels (slower, and rows "
            "depend on their batch): no C compiler") in out
    code, out, _ = run_main(cli.main, capsys, "--model", str(tiny_llama_dir), "--prompt", "Hi", "--max-tokens", "2",
                            "--quantization", "none")
    assert code == 0 and "block-quantized" not in out  # float32 weights have no block kernel to miss


def test_a_failed_build_is_reported_not_raised(monkeypatch, tmp_path):
    from nanovllm_core import native

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1, like a compiler that rejects the source
    why = cpu_paged.unsupported_reason(torch.device("cpu"), torch.float32, "flash")
    assert why is not None and why.startswith("its build failed") and "\n" not in why
    assert why.endswith("exit status 1, no message")  # a compiler that fails silently still says something
    assert not list((tmp_path / "nanovllm" / "kernels").glob("*.so"))  # no half-written library left behind


@needs_kernel
def test_a_cc_with_arguments_is_a_compiler_too(monkeypatch, tmp_path):
    """CC may be a command line (``ccache gcc``, ``gcc -O2``): found by its program, run with its arguments."""
    import shlex

    from nanovllm_core import native

    real = shlex.split(native._compiler())[0]
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", f"{real} -O2")
    assert native._compiler() == shlex.join([real, "-O2"])
    assert cpu_paged.unsupported_reason(torch.device("cpu"), torch.float32, "flash") is None
    assert list((tmp_path / "nanovllm" / "kernels").glob("paged_attention_cpu-*.so"))


def test_other_devices_dtypes_and_the_math_backend_are_not_served():
    cpu = torch.device("cpu")
    assert "float32 only" in cpu_paged.unsupported_reason(cpu, torch.bfloat16, "flash")
    assert "math backend" in cpu_paged.unsupported_reason(cpu, torch.float32, "math")
    assert "CPU" in cpu_paged.unsupported_reason(torch.device("cuda"), torch.float32, "flash")


@pytest.mark.parametrize("kernel_on", [True, False], ids=["cpu-paged", "gather"])
def test_a_block_engine_picks_its_attention_by_the_kernel(tmp_path, monkeypatch, kernel_on):
    """Q8_0 weights keep float32 K/V on the kernel and on the gather path, and the X-Ray shows the gather."""
    from nanovllm_core.educational.xray import backend_of
    from tests.conftest import save_tiny_llama
    from tests.test_quantization import _Tokenizer

    if kernel_on and not cpu_paged.available(torch.device("cpu"), torch.float32, "flash"):
        pytest.skip("the CPU paged kernel is not available here")
    if not kernel_on:
        monkeypatch.setenv(cpu_paged.ENV_SWITCH, "0")
    monkeypatch.setattr(loader, "load_tokenizer", lambda p: None)
    model, _, _ = loader.load_model(str(save_tiny_llama(tmp_path, vocab_size=512)), torch.device("cpu"),
                                    torch.float32, quantization="q8_0")
    engine = LLMEngine(EngineConfig(quantization="q8_0", block_size=8, num_kv_blocks=32), model, _Tokenizer())
    info = engine.model_info()
    assert info["attention_backend"] == ("cpu-paged" if kernel_on else "sdpa")
    assert info["cpu_paged_unavailable"] == (None if kernel_on else f"{cpu_paged.ENV_SWITCH}=0 turned it off")
    assert info["kv_dtype"] == "float32" and info["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K, V x 2 layers x 2 heads x 16
    assert backend_of(engine) == ("cpu_paged" if kernel_on else "fused")
    traces = []
    engine.subscribe(lambda e: traces.append(e) if type(e).__name__ == "LayerTrace" else None, xray=True)
    engine.add_request(list(range(3, 23)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    decode_ops = [{o.name for o in t.ops} for t in traces if t.num_new_tokens == 1]
    assert decode_ops and all(("kv_gather" in ops) != kernel_on for ops in decode_ops)


@needs_kernel
def test_write_kv_puts_each_token_in_its_slot_from_strided_views_of_qkv():
    """The cache write reads K and V straight out of the packed qkv rows and must land exactly
    where ``index_copy_`` into the slot view would put them."""
    nkv, nb, bs, hd = 3, 10, 4, 8
    k_pool, v_pool = torch.zeros(nkv, nb, bs, hd), torch.zeros(nkv, nb, bs, hd)
    qkv = torch.randn(5, (9 + 2 * nkv) * hd)
    k = qkv[:, 9 * hd:(9 + nkv) * hd].view(5, nkv, hd)  # strided rows, as the model passes them
    v = qkv[:, (9 + nkv) * hd:].view(5, nkv, hd)
    slots = torch.tensor([0, 7, 8, 39, 21])
    cpu_paged.write_kv(k, v, slots, k_pool, v_pool)
    want_k, want_v = torch.zeros(nkv, nb * bs, hd), torch.zeros(nkv, nb * bs, hd)
    want_k.transpose(0, 1).index_copy_(0, slots, k)
    want_v.transpose(0, 1).index_copy_(0, slots, v)
    assert torch.equal(k_pool.view(nkv, nb * bs, hd), want_k) and torch.equal(v_pool.view(nkv, nb * bs, hd), want_v)


@needs_kernel
@pytest.mark.parametrize("bad_slot", [-1, 40])
def test_write_kv_refuses_a_slot_outside_the_pool_and_writes_nothing(bad_slot):
    k_pool, v_pool = torch.zeros(3, 10, 4, 8), torch.zeros(3, 10, 4, 8)
    k = v = torch.ones(2, 3, 8)
    with pytest.raises(ValueError, match="outside the pool's 40 slots"):
        cpu_paged.write_kv(k, v, torch.tensor([1, bad_slot]), k_pool, v_pool)
    assert not k_pool.any() and not v_pool.any()
    with pytest.raises(ValueError, match="int64 slots"):
        cpu_paged.write_kv(k, v, torch.tensor([1, 2], dtype=torch.int32), k_pool, v_pool)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_paged.write_kv(torch.ones(2, 2, 8), torch.ones(2, 2, 8), torch.tensor([1, 2]), k_pool, v_pool)


@needs_kernel
def test_a_strided_query_view_gives_the_same_bits_as_a_contiguous_copy():
    k_pool, v_pool = make_pool()
    packed = torch.randn(4, (9 + 6) * 64)
    q = packed[:, :9 * 64].view(4, 9, 64)  # the q heads of a packed qkv row
    assert not q.is_contiguous()
    tables, rows, ctx = [[3, 1, 4]], [0, 0, 0, 0], [30, 31, 32, 33]
    assert torch.equal(run_kernel(q, k_pool, v_pool, tables, rows, ctx),
                       run_kernel(q.contiguous(), k_pool, v_pool, tables, rows, ctx))


@needs_kernel
@pytest.mark.parametrize("march, needs", native_builds.BUILDS, ids=native_builds.BUILD_IDS)
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 1), (10, 2), (4, 4)])
def test_every_build_of_the_kernel_gives_the_same_bits(tmp_path, march, needs, heads, kv_heads):
    """The vector paths claim the very arithmetic of the plain loops, so a build for an older
    instruction set must agree bit for bit with this machine's build, over 8-key tiles, tails
    (contexts not a multiple of 8 or 16) and GQA groups of 3, 8 (two tiles of 4 heads), 5 (4 + 1) and 1."""
    lib = native_builds.build(tmp_path, cpu_paged.SOURCE, march, needs, cpu_paged.SIGNATURES)
    k_pool, v_pool = make_pool(kv_heads)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(5)).tolist()
    tables = [perm[:9], perm[9:13], perm[13:14]]
    rows = [0] * 6 + [1, 2]
    context = [129, 130, 131, 132, 133, 137, 61, 5]
    q = torch.randn(len(rows), heads, 64, generator=torch.Generator().manual_seed(6))
    ours = run_kernel(q, k_pool, v_pool, tables, rows, context)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = torch.empty_like(q)
    rows_t, context_t = torch.tensor(rows, dtype=torch.int32), torch.tensor(context, dtype=torch.int32)
    assert lib.paged_attention(q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(),
                               bt.data_ptr(), rows_t.data_ptr(), context_t.data_ptr(), len(rows), heads, kv_heads, 64,
                               40, 16, width, max(context), 64 ** -0.5, 2) == 0
    assert torch.equal(out, ours)
