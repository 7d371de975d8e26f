"""Block-quantized linear layers (Q8_0, Q4_0, Q4_1): formats against gguf's own reader, the C
kernel against a float64 reference, bit-equal builds for every instruction set, and rows that
do not depend on their batch."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from nanovllm_core.model import block_quant as bq
from nanovllm_core.model.quantization import QUANTIZATION_CHOICES, built_quantization, normalize_quantization
from tests.native_builds import BUILD_IDS, BUILDS, build

FORMATS = list(bq.FORMATS)
needs_kernel = pytest.mark.skipif(bq.library() is None, reason=f"block kernels unavailable: {bq.unavailable_reason()}")


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 3] *= 20  # an outlier column, as real checkpoints have
    return w


def gguf_reference(blocks: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    arr = gguf_dequantize(blocks.numpy(), GGMLQuantizationType(bq.FORMATS[fmt].ggml_type))
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(blocks.shape[0], k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_are_ggufs_layout_and_dequantize_as_gguf_does(fmt):
    w = weights(40, 96)
    blocks = bq.quantize(w, fmt)
    assert blocks.dtype == torch.uint8 and blocks.shape == (40, 3 * bq.FORMATS[fmt].block_bytes)
    # gguf's own quantizer gives the same bytes; its dequantizer the same floats as ours
    raw = gguf_quantize(w.numpy(), GGMLQuantizationType(bq.FORMATS[fmt].ggml_type))
    assert np.array_equal(np.asarray(raw).reshape(40, -1), blocks.numpy())
    ours = bq.dequantize(blocks, fmt, 96)
    assert torch.equal(ours, gguf_reference(blocks, fmt, 96))
    # error per weight: half a step (plus fp16 rounding of the scale); Q4_0's grid -8..7 d puts
    # the block's largest magnitude at -8 d, so the other end may round by up to a whole step
    step = {"q8_0": 0.5 / 127, "q4_0": 1 / 8, "q4_1": 0.5 / 15}[fmt]
    span = w.reshape(40, 3, 32).abs().amax(-1) * (2 if fmt == "q4_1" else 1)
    err = (ours - w).abs().reshape(40, 3, 32).amax(-1)
    assert bool((err <= span * step * 1.02 + 1e-4).all())


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_a_float64_product_of_the_quantized_operands(fmt):
    w = weights(70, 160, seed=1)
    lin = bq.BlockLinear.from_float(w, fmt, bias=torch.linspace(-1, 1, 70))
    x = torch.randn(11, 160, generator=torch.Generator().manual_seed(2))
    x[3] = 0.0  # an all-zero row: scale 0, no division by it
    ref = bq.reference_linear(x, lin.blocks, fmt, 160) + lin.bias.double()
    y = lin(x)
    assert y.shape == (11, 70) and y.dtype == torch.float32
    # the integer sums are exact; what remains is float32 rounding of a few block-scaled terms
    scale = (x.abs().double() @ lin.dequantized().abs().double().T).max()
    assert (y.double() - ref).abs().max() < 1e-6 * scale
    # and activations quantized per 32-block stay within about 1/254 of each block's largest |x|
    exact = x.double() @ lin.dequantized().double().T + lin.bias.double()
    assert (y.double() - exact).abs().max() < 0.01 * scale
    # the residual variant adds after the product, the same bits as adding in PyTorch
    res = torch.randn(11, 70)
    assert torch.equal(lin(x, residual=res), res + y)


# Batch sizes around the kernel's tiles: 8 weight rows per vector, 64 activation rows per pass.
SIZES = (1, 2, 3, 4, 5, 7, 8, 9, 17, 64, 65, 130)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_result_does_not_depend_on_its_batch_or_threads(fmt):
    lin = bq.BlockLinear.from_float(weights(50, 128, seed=3), fmt)  # 50 outputs: a last group of 2
    x = torch.randn(130, 128, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([lin(x[i:i + 1]) for i in range(130)])  # M = 1, a batch-1 decode step
    for m in SIZES:
        assert torch.equal(lin(x[:m]), alone[:m]), m
        assert torch.equal(lin(x[130 - m:]), alone[130 - m:]), m  # other rows in other tile positions
    split = torch.cat([lin(x[:5]), lin(x[5:6]), lin(x[6:])])
    strided = lin(torch.cat([x, x], dim=1)[:, :128])  # a view with rows 256 floats apart
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = lin(x)
    finally:
        torch.set_num_threads(threads)
    for other in (split, strided, one_thread):
        assert torch.equal(alone, other)


def _signatures():
    return {"block_linear": bq.SIGNATURES["block_linear"]}


def _run(lib: ctypes.CDLL, lin: bq.BlockLinear, x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], lin.out_features)
    sx = torch.empty(bq.block_scratch(x.shape[0], lin.in_features))
    assert lib.block_linear(lin.format.c_id, lin.packed.data_ptr(), x.data_ptr(), x.stride(0), y.data_ptr(),
                            lin.out_features, None, 0, x.shape[0], lin.out_features, lin.in_features,
                            sx.data_ptr(), 2) == 0
    return y


@needs_kernel
@pytest.mark.parametrize("march, needs", BUILDS, ids=BUILD_IDS)
def test_every_instruction_set_build_gives_the_native_bits(tmp_path, march, needs):
    lib = build(tmp_path, bq.SOURCE, march, needs, _signatures())
    x = torch.randn(130, 192, generator=torch.Generator().manual_seed(5))
    for fmt in FORMATS:
        lin = bq.BlockLinear.from_float(weights(37, 192, seed=6), fmt)  # 37 outputs: a last group of 5
        for m in SIZES:
            assert torch.equal(_run(lib, lin, x[:m]), lin(x[:m])), (fmt, m)


# (outputs N, inputs K): one block, a last group of 1 / 7 / 9 rows, fewer rows than a group, an
# odd block count, and more groups than the batch-1 path prefetches ahead of, split over threads
ODD_SHAPES = [(1, 32), (7, 32), (9, 96), (17, 800), (61, 224), (203, 224)]  # the last one threaded (N K >= 32768)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n, k", ODD_SHAPES)
def test_the_batch_1_path_gives_the_batched_paths_bits(fmt, n, k):
    """M = 1 runs its own loop (group1_avx2 in an AVX2 build); each row alone equals the same row in a batch of 9."""
    lin = bq.BlockLinear.from_float(weights(n, k, seed=7), fmt)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(8))
    x[4] = 0.0  # an all-zero row: scale 0
    batched = lin(x)
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            alone = torch.cat([lin(x[i:i + 1]) for i in range(9)])
            assert torch.equal(alone, batched), (t, (alone - batched).abs().max())
    finally:
        torch.set_num_threads(threads)
    # a residual added in the same call (the decoder's o and down projections): y = r + x W^T
    r = torch.randn(1, n, generator=torch.Generator().manual_seed(9))
    y = torch.empty(1, n)
    sx = torch.empty(bq.block_scratch(1, k))
    assert bq.library().block_linear(lin.format.c_id, lin.packed.data_ptr(), x[:1].data_ptr(), k, y.data_ptr(), n,
                                     r.data_ptr(), n, 1, n, k, sx.data_ptr(), 2) == 0
    assert torch.equal(y, r + batched[:1])


@needs_kernel
@pytest.mark.parametrize("march, needs", BUILDS, ids=BUILD_IDS)
def test_every_build_gives_the_native_bits_at_batch_1(tmp_path, march, needs):
    lib = build(tmp_path, bq.SOURCE, march, needs, _signatures())
    for fmt in FORMATS:
        for n, k in ODD_SHAPES:
            lin = bq.BlockLinear.from_float(weights(n, k, seed=10), fmt)
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(11))
            assert torch.equal(_run(lib, lin, x), lin(x)), (fmt, n, k)


def test_activations_are_quantized_as_ggml_does():
    x = torch.tensor([[0.5] * 31 + [-127.0], [0.0] * 32])  # 0.5 -> round half to even -> 0 ... with d = 1
    q, d = bq.quantize_activations(x)
    assert d.tolist() == [[1.0], [0.0]]
    assert q[0, :31].tolist() == [0.0] * 31 and q[0, 31] == -127 and q[1].abs().sum() == 0


def test_the_pytorch_fallback_computes_the_same_product(monkeypatch):
    lin = bq.BlockLinear.from_float(weights(30, 64, seed=7), "q4_1")
    x = torch.randn(4, 64)
    native = lin(x)
    monkeypatch.setenv(bq.ENV_SWITCH, "0")
    assert bq.library() is None and bq.unavailable_reason() == f"{bq.ENV_SWITCH}=0"
    fallback = lin(x)
    assert torch.allclose(fallback, native, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernels", ["c", "pytorch"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_rows_are_the_dequantized_matrix_rows(fmt, kernels, monkeypatch):
    if kernels == "pytorch":
        monkeypatch.setenv(bq.ENV_SWITCH, "0")
    blocks = bq.quantize(weights(100, 64, seed=8), fmt)  # 100 rows: the last packed group is half padding
    emb = bq.BlockEmbedding(blocks, fmt, 64)
    assert torch.equal(emb.blocks, blocks)  # packing keeps every byte
    ids = torch.tensor([[0, 99], [42, 42]])
    out = emb(ids)
    assert out.shape == (2, 2, 64)
    assert torch.equal(out.reshape(4, 64), gguf_reference(blocks, fmt, 64)[ids.reshape(-1)])
    for bad in (100, -1):
        with pytest.raises(IndexError, match=r"outside the vocabulary \[0, 100\)"):
            emb(torch.tensor([bad]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_is_a_reordering_of_the_same_bytes(fmt):
    f = bq.block_format(fmt)
    for rows in (1, 7, 8, 9, 30):
        blocks = torch.randint(0, 256, (rows, 3 * f.block_bytes), dtype=torch.uint8)
        packed = bq.pack(blocks, fmt)
        assert packed.shape == ((rows + 7) // 8, 3, 8 * f.block_bytes)
        assert torch.equal(bq.unpack(packed, fmt, rows), blocks)
        # row k's block b: its d at 2k of the group's block, its first quant word at header + 4k
        header = 32 if fmt == "q4_1" else 16
        k, b = (rows - 1) % 8, 2
        blk = packed[(rows - 1) // 8, b]
        assert blk[2 * k:2 * k + 2].tolist() == blocks[rows - 1, b * f.block_bytes:b * f.block_bytes + 2].tolist()
        first_q = b * f.block_bytes + (4 if fmt == "q4_1" else 2)
        assert blk[header + 4 * k:header + 4 * k + 4].tolist() == blocks[rows - 1, first_q:first_q + 4].tolist()
    with pytest.raises(ValueError, match="cannot hold 17 rows"):
        bq.unpack(bq.pack(torch.zeros(9, f.block_bytes, dtype=torch.uint8), fmt), fmt, 17)


def test_bad_shapes_and_names_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^block format 'q3_k' is unknown; use one of q8_0, q4_0, q4_1$"):
        bq.block_format("q3_k")
    with pytest.raises(ValueError, match=r"must be a multiple of 32\); load it with quantization='none' \(--quantization none\)$"):
        bq.quantize(torch.zeros(4, 48), "q8_0")
    with pytest.raises(ValueError, match="do not hold 64 weights a row"):
        bq.BlockLinear(torch.zeros(4, 36, dtype=torch.uint8), "q4_1", 64)
    lin = bq.BlockLinear.from_float(weights(8, 64), "q8_0")
    with pytest.raises(ValueError, match="input width 32 does not match this layer's 64 input features"):
        lin(torch.zeros(1, 32))


def test_quantization_names():
    assert QUANTIZATION_CHOICES == ("auto", "none", "gguf", "q8_0", "q4_0", "q4_1")
    # None and "auto" are the request to decide at load; "none" asks for float and stays said
    assert normalize_quantization("auto") is None and normalize_quantization(None) is None
    assert normalize_quantization("none") == "none" and normalize_quantization("Q4_0") == "q4_0"
    assert built_quantization("none") is None and built_quantization(None) is None and built_quantization("gguf") == "gguf"
    with pytest.raises(ValueError, match=r"^quantization='auto' must be resolved before layers are built"):
        built_quantization("auto")
    with pytest.raises(ValueError, match=r"^quantization='int3' is unknown; use one of auto, none, gguf, q8_0"):
        normalize_quantization("int3")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_a_float_checkpoint_is_quantized_at_load(tiny_llama_dir, fmt):
    from nanovllm_core.model.loader import load_model
    from nanovllm_core.model.quantization import weight_formats

    model, _, _ = load_model(str(tiny_llama_dir), torch.device("cpu"), torch.float32, quantization=fmt)
    float_model, _, _ = load_model(str(tiny_llama_dir), torch.device("cpu"), torch.float32)
    assert model.quantization == fmt and model.quantization_note is None
    qkv = model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, bq.BlockLinear) and qkv.kind == fmt
    # the blocks are gguf's quantization of the float weights; embedding and tied head in Q8_0
    assert torch.equal(qkv.blocks, bq.quantize(float_model.layers[1].self_attn.qkv_proj.weight, fmt))
    assert model.embed_tokens.kind == "q8_0" and model.lm_head.packed.data_ptr() == model.embed_tokens.packed.data_ptr()
    assert set(weight_formats(model)) == {fmt, "q8_0"} | ({"q8_0"} if fmt == "q8_0" else set())
    assert model.fused_layers is not None


def test_a_width_that_is_not_a_multiple_of_32_stays_float_and_says_so(tmp_path, default_model_dir):
    from nanovllm_core.model.loader import load_model
    from tests.conftest import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "odd", default_model_dir, hidden_size=48, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=96)
    model, _, _ = load_model(str(folder), torch.device("cpu"), torch.float32, quantization="q4_0")
    assert not isinstance(model.layers[0].self_attn.qkv_proj, bq.BlockLinear)
    assert model.fused_layers is None
    assert model.quantization_note.startswith("some weights are not in a block format this engine runs (")
    assert "\n" not in model.quantization_note and "width not a multiple of 32" in model.quantization_note


def test_scratch_is_reused_on_a_thread_and_never_shared_between_threads():
    import threading

    first = bq.scratch(1000)
    assert first.numel() >= 1000 and first.dtype == torch.float32
    assert bq.scratch(10).data_ptr() == first.data_ptr()  # a smaller request: the same buffer
    grown = bq.scratch(first.numel() + 1)
    assert grown.numel() > first.numel()
    assert bq.scratch(1000).data_ptr() == grown.data_ptr()
    other = []
    t = threading.Thread(target=lambda: other.append(bq.scratch(1000).data_ptr()))
    t.start()
    t.join()
    assert other and other[0] != grown.data_ptr()


@needs_kernel
def test_the_layers_function_table_is_built_once_and_the_switch_still_counts(monkeypatch):
    ops = bq.FusedDecoderLayers._ops()
    if ops is None:
        pytest.skip("the norm/rope or attention library is unavailable here")
    assert bq.FusedDecoderLayers._ops() is ops and ops.rms_norm and ops.attention
    monkeypatch.setenv(bq.ENV_SWITCH, "0")
    assert bq.FusedDecoderLayers._ops() is None
