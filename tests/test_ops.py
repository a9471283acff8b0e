"""Sampled Linear/Conv2d ops: exact at k = n, and equal to the reference (autograd through
gathers) for k < n, forward and backward; top-k keeps the k largest norm products."""

import pytest
import torch
import torch.nn.functional as F

from fxapprox.ops import sampled_conv2d, sampled_linear, select_pairs
from fxapprox.ops.conv import pair_scores_conv2d
from fxapprox.ops.linear import pair_scores_linear


def _grads(fn, *tensors):
    tensors = [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]
    out = fn(*tensors)
    grad_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in tensors if t is not None]


def test_linear_k_equals_n_is_exact_forward_and_backward():
    x, w, b = torch.randn(16, 32), torch.randn(8, 32), torch.randn(8)
    ref, ref_grads = _grads(F.linear, x, w, b)
    out, grads = _grads(lambda x, w, b: sampled_linear(x, w, b, k=32), x, w, b)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_conv_k_equals_n_is_exact_forward_and_backward():
    x, w, b = torch.randn(2, 8, 7, 7), torch.randn(4, 8, 3, 3), torch.randn(4)
    ref, ref_grads = _grads(lambda x, w, b: F.conv2d(x, w, b, 2, 1), x, w, b)
    out, grads = _grads(lambda x, w, b: sampled_conv2d(x, w, b, k=8, stride=2, padding=1), x, w, b)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_topk_keeps_the_largest_norm_products():
    x, w = torch.randn(16, 32), torch.randn(8, 32)
    x[:, 5] *= 100
    scores = pair_scores_linear(x, w)
    kept, scale = select_pairs("topk", scores, 6)
    assert scale is None and 5 in kept.tolist()
    assert set(kept.tolist()) == set(torch.argsort(scores, descending=True)[:6].tolist())
    assert torch.equal(kept, kept.sort().values)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_sampled_matches_reference_gathers(bias):
    x, w = torch.randn(3, 5, 32), torch.randn(8, 32)
    b = torch.randn(8) if bias else None
    kept, _ = select_pairs("topk", pair_scores_linear(x.reshape(-1, 32), w), 12)

    def reference(x, w, b=None):
        return F.linear(x.index_select(-1, kept), w.index_select(1, kept), b)

    ref, ref_grads = _grads(reference, x, w, b)
    out, grads = _grads(lambda x, w, b=None: sampled_linear(x, w, b, k=12), x, w, b)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # gradients are zero outside the kept columns
    dropped = torch.ones(32, dtype=torch.bool)
    dropped[kept] = False
    assert torch.count_nonzero(grads[0][..., dropped]) == 0


def test_conv_sampled_matches_reference_gathers():
    x, w, b = torch.randn(2, 16, 9, 9), torch.randn(6, 16, 3, 3), torch.randn(6)
    kept, _ = select_pairs("topk", pair_scores_conv2d(x, w), 5)

    def reference(x, w, b):
        return F.conv2d(x.index_select(1, kept), w.index_select(1, kept), b, 1, 2, 2)

    ref, ref_grads = _grads(reference, x, w, b)
    out, grads = _grads(lambda x, w, b: sampled_conv2d(x, w, b, k=5, padding=2, dilation=2), x, w, b)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_edge_cases_zero_columns_single_row_noncontiguous_empty():
    w = torch.randn(8, 32, requires_grad=True)
    zeros = torch.zeros(4, 32, requires_grad=True)
    out = sampled_linear(zeros, w, None, k=8)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(w.grad).all()
    one = torch.randn(1, 32)
    assert sampled_linear(one, w, None, k=8).shape == (1, 8)
    noncontiguous = torch.randn(32, 16).t()
    assert not noncontiguous.is_contiguous()
    assert sampled_linear(noncontiguous, w, None, k=8).shape == (16, 8)
    assert sampled_linear(torch.randn(0, 32), w, None, k=8).shape == (0, 8)
    x_nc = torch.randn(2, 9, 9, 16).permute(0, 3, 1, 2)
    assert sampled_conv2d(x_nc, torch.randn(4, 16, 3, 3), None, k=4, padding=1).shape == (2, 4, 9, 9)
    assert sampled_conv2d(torch.randn(0, 16, 5, 5), torch.randn(4, 16, 3, 3), None, k=4).shape == (0, 4, 3, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    x = torch.randn(8, 64, dtype=dtype, requires_grad=True)
    w = torch.randn(16, 64, dtype=dtype, requires_grad=True)
    out = sampled_linear(x, w, None, k=16)
    out.float().sum().backward()
    assert out.dtype == dtype and x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all()
    if dtype is torch.bfloat16:  # fp16 conv is not implemented on every CPU build
        xc = torch.randn(2, 16, 6, 6, dtype=dtype, requires_grad=True)
        wc = torch.randn(4, 16, 3, 3, dtype=dtype, requires_grad=True)
        outc = sampled_conv2d(xc, wc, None, k=4, padding=1)
        outc.float().sum().backward()
        assert outc.dtype == dtype and torch.isfinite(wc.grad.float()).all()


def test_bad_k():
    with pytest.raises(ValueError, match="k must be"):
        sampled_linear(torch.randn(2, 8), torch.randn(3, 8), None, k=0)
    with pytest.raises(ValueError, match="method must be one of"):
        sampled_linear(torch.randn(2, 8), torch.randn(3, 8), None, k=2, method="nope")
