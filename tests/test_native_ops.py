"""The C RMSNorm (nanovllm_core/model/layer_ops_cpu.c): right values, batch-invariant bits, clean fallback."""

import pytest
import torch

from nanovllm_core.model import native_ops
from nanovllm_core.model.llama import RMSNorm

needs_native = pytest.mark.skipif(native_ops.library() is None,
                                  reason=f"the C layer ops are not available here: {native_ops.unavailable_reason()}")


def reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@needs_native
@pytest.mark.parametrize("hidden", [576, 40, 7, 4096])
def test_rms_norm_matches_float64_as_closely_as_pytorchs(hidden):
    g = torch.Generator().manual_seed(hidden)
    w = torch.randn(hidden, generator=g)
    x = torch.randn(37, hidden, generator=g) * 5
    x[:, 0] *= 100  # one large channel, as LLaMA's residual stream has
    ours = native_ops.rms_norm(x, w, 1e-5)
    torchs = torch.nn.functional.rms_norm(x, (hidden,), w, 1e-5)
    ref = reference(x, w, 1e-5)
    scale = ref.abs().max()
    assert ours.dtype == torch.float32 and ours.shape == x.shape
    assert float((ours.double() - ref).abs().max() / scale) < 4e-7
    assert float((ours.double() - ref).abs().max()) <= 2 * float((torchs.double() - ref).abs().max()) + 1e-6


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_gives_a_token_the_same_bits_alone_and_in_any_batch(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(3)
        w = torch.randn(576, generator=g)
        x = torch.randn(300, 576, generator=g)  # large enough for the OpenMP path
        batched = native_ops.rms_norm(x, w, 1e-6)
        for rows in (slice(0, 1), slice(5, 8), slice(100, 164), slice(299, 300)):
            assert torch.equal(native_ops.rms_norm(x[rows].clone(), w, 1e-6), batched[rows])
    finally:
        torch.set_num_threads(previous)


@needs_native
def test_the_model_norm_uses_c_and_falls_back_to_pytorch_when_switched_off(monkeypatch):
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 64))
    x = torch.randn(5, 64)
    with torch.inference_mode():
        assert torch.equal(norm(x), native_ops.rms_norm(x, norm.weight, 1e-5))
        monkeypatch.setenv(native_ops.ENV_SWITCH, "0")
        assert native_ops.library() is None and native_ops.unavailable_reason() == "NANOVLLM_NATIVE_OPS=0"
        assert torch.equal(norm(x), torch.nn.functional.rms_norm(x, (64,), norm.weight, 1e-5))


def test_rms_norm_leaves_what_it_does_not_handle_to_pytorch():
    w = torch.ones(8)
    assert native_ops.rms_norm(torch.randn(2, 8, dtype=torch.float64), w.double(), 1e-5) is None
    assert native_ops.rms_norm(torch.randn(2, 3, 8), w, 1e-5) is None  # 3-D: the caller flattens or falls back
    assert native_ops.rms_norm(torch.randn(2, 8, requires_grad=True), w, 1e-5) is None  # autograd records
    assert native_ops.rms_norm(torch.randn(2, 9), w, 1e-5) is None  # a weight of another width: PyTorch raises
    if native_ops.library() is not None:
        assert native_ops.rms_norm(torch.randn(0, 8), w, 1e-5).shape == (0, 8)
        strided = torch.randn(8, 4).t()  # not contiguous: copied first
        assert torch.allclose(native_ops.rms_norm(strided, w, 1e-5), reference(strided, w, 1e-5).float(), atol=1e-6)


@needs_native
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rope_in_c_rotates_the_packed_qkv_in_place_with_the_bits_of_the_pytorch_ops(tokens):
    from nanovllm_core.model.llama import RotaryEmbedding

    rotary = RotaryEmbedding(64, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    cos, sin = rotary.cos_sin(positions, torch.float32)
    qkv = torch.randn(tokens, 15 * 64) * 4
    qk = qkv[:, :12 * 64].view(tokens, 12, 64)  # 9 query + 3 key heads; v after them is left alone
    want = RotaryEmbedding.apply(qk.clone(), cos, sin)
    v_before = qkv[:, 12 * 64:].clone()
    assert native_ops.rope_(qk, cos, sin)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, 12 * 64:], v_before)


def test_rope_in_c_declines_what_it_does_not_handle():
    cos = sin = torch.ones(2, 1, 8)
    assert not native_ops.rope_(torch.randn(2, 3, 8, dtype=torch.float64), cos.double(), sin.double())
    assert not native_ops.rope_(torch.randn(2, 8, 3).transpose(1, 2), cos, sin)  # elements not dense
    assert not native_ops.rope_(torch.randn(2, 3, 8), torch.ones(2, 8), torch.ones(2, 8))  # tables of another shape


def test_rotary_tables_give_the_rotation_of_the_half_width_angles():
    """cos_sin reads whole rows of the stored (cos, cos) / (-sin, sin) tables: the same values as
    building them from the angles' half-width cosines and sines at each position, in any dtype."""
    from nanovllm_core.model.llama import RotaryEmbedding, rope_inverse_frequencies

    rotary = RotaryEmbedding(64, 512, 10000.0, None)
    positions = torch.tensor([0, 1, 7, 300, 511])
    freqs = torch.outer(torch.arange(512, dtype=torch.float32), rope_inverse_frequencies(64, 10000.0, None))
    half_cos, half_sin = freqs.cos()[positions].unsqueeze(1), freqs.sin()[positions].unsqueeze(1)
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rotary.cos_sin(positions, dtype)
        assert cos.shape == sin.shape == (5, 1, 64) and cos.dtype == sin.dtype == dtype and cos.is_contiguous()
        c, s = half_cos.to(dtype), half_sin.to(dtype)
        assert torch.equal(cos, torch.cat((c, c), dim=-1)) and torch.equal(sin, torch.cat((-s, s), dim=-1))
    with pytest.raises(ValueError, match="beyond the rotary table"):
        rotary.check(512)
