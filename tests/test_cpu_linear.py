"""The oneDNN packed-weight linear path computes what ``nn.functional.linear`` computes."""

from __future__ import annotations

import pytest
import torch

from nanovllm_core.model import cpu_linear


@pytest.mark.parametrize(
    "make_x",
    [
        lambda: torch.randn(7, 32),
        lambda: torch.randn(0, 32),  # an empty step
        lambda: torch.randn(5, 64)[:, :32],  # a non-contiguous view (row stride 64)
        lambda: torch.randn(32, 5).t(),  # transposed
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_functional_linear(make_x, with_bias):
    torch.manual_seed(0)
    w = torch.randn(48, 32)
    b = torch.randn(48) if with_bias else None
    x = make_x()
    got = cpu_linear.linear(x, w, b)
    want = torch.nn.functional.linear(x, w, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_copy_is_rebuilt_when_weight_changes_in_place():
    w = torch.randn(16, 8)
    x = torch.randn(3, 8)
    cpu_linear.linear(x, w)  # packs the weight
    with torch.no_grad():
        w.mul_(-3.0)  # e.g. load_state_dict copying new weights in
    torch.testing.assert_close(cpu_linear.linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_disabled_and_other_dtypes_take_the_plain_path(monkeypatch):
    w = torch.randn(16, 8)
    monkeypatch.setattr(cpu_linear, "ENABLED", False)
    assert cpu_linear.packed_weight(w) is None
    monkeypatch.setattr(cpu_linear, "ENABLED", True)
    assert cpu_linear.packed_weight(w.double()) is None
    x = torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(cpu_linear.linear(x, w.double()), x @ w.double().t())


def test_a_decode_of_one_or_two_tokens_takes_mkl_and_more_take_the_packed_weight(monkeypatch):
    w, calls = torch.randn(16, 8), []
    real = cpu_linear.packed_weight
    monkeypatch.setattr(cpu_linear, "packed_weight", lambda weight: calls.append(1) or real(weight))
    for n in range(1, cpu_linear.MKL_MAX_TOKENS + 1):
        x = torch.randn(n, 8)
        torch.testing.assert_close(cpu_linear.linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert calls == []
    x = torch.randn(cpu_linear.MKL_MAX_TOKENS + 1, 8)
    torch.testing.assert_close(cpu_linear.linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert calls == [1]
