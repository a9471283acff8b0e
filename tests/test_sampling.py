"""Statistical and structural tests of the pair selectors and the sampling modes."""

import math

import pytest
import torch
import torch.nn.functional as F

from fxapprox.ops import (backward_sampled_conv2d, backward_sampled_linear, sampled_conv2d, sampled_linear,
                          select_pairs)
import fxapprox.ops.sampling
from fxapprox.ops.sampling import (bernoulli_probabilities, crs_probabilities, inclusion_probabilities,
                                   systematic_sample, wta_crs_split)


@pytest.fixture(params=[True, False], ids=["numpy path", "device path"])
def selection_path(request, monkeypatch):
    """CRS and WTA-CRS select on CPU tensors in NumPy, on other devices in torch: both must draw alike."""
    monkeypatch.setattr(fxapprox.ops.sampling, "CPU_NUMPY", request.param)


def _operands(rows=6, n=24, cols=5):
    torch.manual_seed(1)
    scales = torch.logspace(-1, 1, n)  # uneven column norms, as in real layers
    return torch.randn(rows, n) * scales, torch.randn(cols, n)


def _draws(method, x, w, k, count):
    outs = torch.stack([sampled_linear(x, w, None, k=k, method=method) for _ in range(count)])
    return outs


def test_bernoulli_probabilities_sum_to_k_and_redistribute_clamped_mass():
    scores = torch.tensor([100.0, 50.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    p = bernoulli_probabilities(scores, 4)
    assert p.sum().item() == pytest.approx(4.0, rel=1e-5)
    assert p.max() <= 1.0 and p[0] == 1.0 and p[1] == 1.0   # clamped, their excess shared out
    assert p[6] == 0.0                                       # zero pairs contribute nothing: never kept
    torch.testing.assert_close(p[2:6], torch.full((4,), p[2].item()))
    assert bernoulli_probabilities(torch.zeros(8), 3).sum().item() == pytest.approx(3.0)


def test_crs_probabilities_have_a_uniform_floor():
    p = crs_probabilities(torch.tensor([1.0, 0.0, 0.0, 3.0]))
    assert p.sum().item() == pytest.approx(1.0) and p.min().item() == pytest.approx(0.1 / 4)
    torch.testing.assert_close(crs_probabilities(torch.zeros(5)), torch.full((5,), 0.2))


def _draws_for_distinct(probabilities: torch.Tensor, k: int) -> int:
    """The previous CRS / WTA-CRS draw count (i.i.d. draws with replacement until ``k`` distinct pairs in
    expectation, capped at 4 per pair): the variance bar the systematic estimators must not exceed."""
    n = probabilities.numel()
    if k >= n:
        return 4 * n
    missing = torch.log1p(-probabilities.double().clamp(max=1 - 1e-12))
    low, high = k, 4 * n
    while low < high:
        middle = (low + high) // 2
        if float((1.0 - torch.exp(middle * missing)).sum()) >= k:
            high = middle
        else:
            low = middle + 1
    return low


def _previous_variance(method: str, x, w, k) -> float:
    """The single-draw squared error of the previous (with-replacement, duplicates merged) estimator."""
    exact = x @ w.t()
    a2, b2 = x.square().sum(0), w.square().sum(0)
    scores = (a2 * b2).sqrt()
    if method == "crs":
        p = crs_probabilities(scores)
        return float(((a2 * b2 / p).sum() - exact.square().sum()) / _draws_for_distinct(p, k))
    p = scores / scores.sum()
    ordered, order = torch.sort(p, descending=True)
    c = int(wta_crs_split(ordered, k))
    rest = order[c:]
    mass = p[rest].sum()
    rest_product = x[:, rest] @ w[:, rest].t()
    draws = _draws_for_distinct(p[rest] / mass, k - c)
    return float((mass * (a2[rest] * b2[rest] / p[rest]).sum() - rest_product.square().sum()) / draws)


@pytest.mark.parametrize("method", ["crs", "bernoulli", "wta_crs"])
def test_unbiased_and_variance_as_predicted(method, selection_path):
    x, w = _operands()
    exact = x @ w.t()
    k, count = 8, 4000
    outs = _draws(method, x, w, k, count)
    mse = (outs - exact).square().sum((1, 2))
    if method == "bernoulli":
        a2, b2 = x.square().sum(0), w.square().sum(0)
        p = bernoulli_probabilities((a2 * b2).sqrt(), k)
        predicted = float(((1 - p) / p * a2 * b2).sum())
        assert mse.mean().item() == pytest.approx(predicted, rel=0.1)   # the single-draw error, as predicted
    else:
        # systematic PPS sampling has no closed-form variance: it must not exceed the previous estimator's
        predicted = _previous_variance(method, x, w, k)
        assert mse.mean().item() < predicted, (mse.mean().item(), predicted)
    # the mean of `count` draws converges to the exact product at rate 1/count (unbiased)
    mean_error = (outs.mean(0) - exact).square().sum().item()
    assert mean_error < 4 * mse.mean().item() / count
    assert mean_error < 0.05 * exact.square().sum().item()


@pytest.mark.parametrize("method", ["crs", "wta_crs"])
@pytest.mark.parametrize("skew", [0.0, 1.0, 3.0])
def test_systematic_estimators_have_no_more_variance_than_the_previous_ones(method, skew, selection_path):
    """At keep-ratios of 1/4 and above (the plans' grid) no more variance than the previous with-replacement
    estimators, which drew more than k times to keep k distinct pairs in expectation; at 1/12 that extra draw
    count gives the previous ones up to ~15% less variance (a fixed-size design cannot draw more pairs)."""
    torch.manual_seed(7)
    n = 48
    x = torch.randn(6, n) * torch.logspace(-skew, 0, n)
    w = torch.randn(5, n)
    exact = x @ w.t()
    for k in (4, 12, 24, 40):
        mse = torch.stack([(sampled_linear(x, w, None, k=k, method=method) - exact).square().sum()
                           for _ in range(1500)]).mean().item()
        bound = 1.05 if k / n >= 0.25 else 1.2
        assert mse <= bound * _previous_variance(method, x, w, k) + 1e-6, (k, mse)


def test_inclusion_probabilities_and_systematic_sampling():
    torch.manual_seed(0)
    weights = torch.tensor([100.0, 50.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.5, 2.0, 3.0])
    p = inclusion_probabilities(weights, 5)
    assert p.sum().item() == pytest.approx(5.0, rel=1e-5) and p.max() <= 1.0 and p[6] == 0.0
    counts = torch.zeros(10)
    for _ in range(4000):
        kept, scale = systematic_sample(p, 5)
        assert kept.numel() == 5 and kept.unique().numel() == 5                 # k distinct pairs, every draw
        torch.testing.assert_close(scale, 1.0 / p[kept])
        counts[kept] += 1
    assert torch.allclose(counts / 4000, p, atol=0.03)                          # kept with probability π_i
    target = inclusion_probabilities(weights, 5, target=torch.tensor(3.0))      # a device-side target
    assert target.sum().item() == pytest.approx(3.0, rel=1e-5)
    few = inclusion_probabilities(torch.tensor([1.0, 2.0, 0.0, 0.0, 0.0]), 3)   # fewer positive pairs than k
    assert few.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    kept, scale = systematic_sample(few, 3)
    assert kept.numel() == 3 and sorted(kept[scale > 0].tolist()) == [0, 1] and (scale[scale > 0] == 1).all()


def test_wta_crs_keeps_the_winners_and_beats_crs_on_skewed_pairs(selection_path):
    torch.manual_seed(5)
    n, k = 64, 16
    x = torch.randn(8, n) * torch.logspace(-2, 1, n)   # a few columns carry most of the mass
    w = torch.randn(6, n)
    exact = x @ w.t()
    scores = x.norm(dim=0) * w.norm(dim=0)
    kept, scale = select_pairs("wta_crs", scores, k)
    assert kept.numel() == k and kept.unique().numel() == k and torch.equal(kept, kept.sort().values)
    winners = int(wta_crs_split(torch.sort(scores / scores.sum(), descending=True).values, k))
    assert winners > 0
    top = set(torch.topk(scores, winners).indices.tolist())
    assert top <= set(kept.tolist())                                           # the winners are always kept ...
    assert all(scale[kept.tolist().index(i)].item() == 1.0 for i in top)      # ... unscaled
    errors = {}
    for method in ("crs", "wta_crs"):
        errors[method] = torch.stack([(sampled_linear(x, w, None, k=k, method=method) - exact).square().sum()
                                      for _ in range(2000)]).mean().item()
    # systematic CRS keeps the heaviest pairs surely too (π clamped at 1), so WTA-CRS's margin over it is smaller
    # than over the previous i.i.d. CRS; both beat their previous versions here
    assert errors["wta_crs"] < 0.95 * errors["crs"], errors
    assert all(errors[m] < _previous_variance(m, x, w, k) for m in errors), errors


@pytest.mark.parametrize("method", ["topk", "crs", "wta_crs"])
def test_static_methods_keep_exactly_k_pairs(method, selection_path):
    for scores in (torch.rand(100), torch.ones(100), torch.logspace(-3, 3, 100), torch.zeros(100)):
        for k in (1, 7, 50, 99):
            kept, _ = select_pairs(method, scores, k)
            assert kept.numel() == k


def test_wta_crs_edge_cases(selection_path):
    kept, scale = select_pairs("wta_crs", torch.zeros(10), 4)            # no mass anywhere: uniform draws
    assert kept.numel() == 4 and kept.unique().numel() == 4 and torch.isfinite(scale).all()
    kept, scale = select_pairs("wta_crs", torch.tensor([5.0, 0.0, 0.0, 0.0]), 2)   # the winner holds it all
    assert kept.numel() == 2 and kept[scale > 0].tolist() == [0] and scale[scale > 0].tolist() == [1.0]
    kept, scale = select_pairs("wta_crs", torch.rand(6), 6)               # k >= n: everything, unscaled
    assert kept.tolist() == list(range(6)) and torch.equal(scale, torch.ones(6))


def test_topk_is_biased_but_deterministic():
    x, w = _operands()
    first = sampled_linear(x, w, None, k=8, method="topk")
    assert torch.equal(first, sampled_linear(x, w, None, k=8, method="topk"))
    assert not torch.allclose(first, x @ w.t())


def test_topk_random_share_prevents_starvation():
    scores = torch.linspace(1, 2, 32)          # the same ranking every step
    starved = torch.zeros(32, dtype=torch.bool)
    guarded = torch.zeros(32, dtype=torch.bool)
    for _ in range(300):
        starved[select_pairs("topk", scores, 8, 0.0)[0]] = True
        kept, _ = select_pairs("topk", scores, 8, 0.25)
        assert kept.numel() == 8 and kept.unique().numel() == 8
        assert set(range(26, 32)) <= set(kept.tolist())  # the top 8-2 stay
        guarded[kept] = True
    assert starved.sum() == 8           # pure top-k never picks the other 24 columns
    assert guarded.all()                # with a random share every column is eventually picked


@pytest.mark.parametrize("method", ["topk", "crs", "bernoulli", "wta_crs"])
def test_every_method_is_exact_at_full_ratio(method):
    x, w, b = torch.randn(7, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True), torch.randn(4)
    torch.testing.assert_close(sampled_linear(x, w, b, k=16, method=method), F.linear(x, w, b))
    xc, wc = torch.randn(2, 8, 5, 5), torch.randn(3, 8, 3, 3)
    torch.testing.assert_close(sampled_conv2d(xc, wc, None, k=8, padding=1, method=method),
                               F.conv2d(xc, wc, padding=1))
    torch.testing.assert_close(backward_sampled_linear(x, w, b, 1.0, method), F.linear(x, w, b))
    for sample_input_grad in (True, False):
        out = backward_sampled_linear(x, w, b, 1.0, method, sample_input_grad=sample_input_grad)
        grads = torch.autograd.grad(out.sum(), (x, w))
        exact = torch.autograd.grad(F.linear(x, w, b).sum(), (x, w))
        for got, want in zip(grads, exact):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("method", ["crs", "bernoulli"])
def test_unbiased_methods_on_conv(method):
    torch.manual_seed(2)
    x, w = torch.randn(2, 12, 6, 6) * torch.logspace(-1, 1, 12).view(1, -1, 1, 1), torch.randn(4, 12, 3, 3)
    exact = F.conv2d(x, w, padding=1)
    mean = torch.stack([sampled_conv2d(x, w, None, k=4, padding=1, method=method) for _ in range(3000)]).mean(0)
    assert (mean - exact).norm() / exact.norm() < 0.05


def test_all_zero_columns_with_unbiased_methods(selection_path):
    for method in ("crs", "bernoulli"):
        x = torch.zeros(4, 16, requires_grad=True)
        w = torch.randn(8, 16, requires_grad=True)
        out = sampled_linear(x, w, torch.ones(8), k=4, method=method)
        out.sum().backward()
        assert torch.equal(out, torch.ones(4, 8)) and torch.isfinite(w.grad).all() and torch.isfinite(x.grad).all()


# -- backward sampling ------------------------------------------------------------------------

def test_backward_mode_forward_is_exact_and_grads_match_reference():
    torch.manual_seed(3)
    x = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(12, 16, requires_grad=True)
    b = torch.randn(12, requires_grad=True)
    out = backward_sampled_linear(x, w, b, 0.5, "topk")
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=0, atol=0)
    grad_out = torch.randn(10, 12)
    out.backward(grad_out)
    # reference: dX over the 6 strongest output features, dW over the 5 strongest rows
    feature_scores = grad_out.norm(dim=0) * w.detach().norm(dim=1)
    features = torch.topk(feature_scores, 6).indices
    rows = torch.topk(x.detach().norm(dim=1) * grad_out.norm(dim=1), 5).indices
    torch.testing.assert_close(x.grad, grad_out[:, features] @ w.detach()[features])
    torch.testing.assert_close(w.grad, grad_out[rows].t() @ x.detach()[rows])
    torch.testing.assert_close(b.grad, grad_out.sum(0))


def test_backward_mode_conv_forward_exact_and_unbiased_grads():
    torch.manual_seed(4)
    x = torch.randn(6, 8, 7, 7, requires_grad=True)
    w = torch.randn(10, 8, 3, 3, requires_grad=True)
    out = backward_sampled_conv2d(x, w, None, 0.5, padding=1, method="bernoulli")
    torch.testing.assert_close(out, F.conv2d(x, w, padding=1), rtol=0, atol=0)
    grad_out = torch.randn_like(out)
    exact_dx, exact_dw = torch.autograd.grad(F.conv2d(x, w, padding=1), (x, w), grad_out)
    dx_sum, dw_sum, draws = torch.zeros_like(x), torch.zeros_like(w), 1500
    for _ in range(draws):
        dx, dw = torch.autograd.grad(backward_sampled_conv2d(x, w, None, 0.5, padding=1, method="bernoulli"),
                                     (x, w), grad_out)
        dx_sum += dx
        dw_sum += dw
    assert ((dx_sum / draws - exact_dx).norm() / exact_dx.norm()).item() < 0.05
    assert ((dw_sum / draws - exact_dw).norm() / exact_dw.norm()).item() < 0.05


def test_backward_mode_keep_ratio_one_and_bad_ratio():
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    dx, dw = torch.autograd.grad(backward_sampled_linear(x, w, None, 1.0).sum(), (x, w))
    ex, ew = torch.autograd.grad(F.linear(x, w).sum(), (x, w))
    torch.testing.assert_close(dx, ex, atol=1e-5, rtol=0)
    torch.testing.assert_close(dw, ew, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="keep_ratio"):
        backward_sampled_linear(x, w, None, 0.0)
    assert math.isfinite(backward_sampled_linear(torch.zeros(0, 8), w, None, 0.5).sum().item())


# -- weight-gradient sampling ----------------------------------------------------------------

@pytest.mark.parametrize("method", ["topk", "wta_crs", "bernoulli"])
def test_weight_grad_mode_keeps_forward_and_input_grad_exact(method):
    torch.manual_seed(6)
    x = torch.randn(4, 12, 16, requires_grad=True)   # (B, T, C): rows are tokens
    w = torch.randn(10, 16, requires_grad=True)
    b = torch.randn(10, requires_grad=True)
    grad_out = torch.randn(4, 12, 10)
    out = backward_sampled_linear(x, w, b, 0.25, method, sample_input_grad=False)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=0, atol=0)
    dx, dw, db = torch.autograd.grad(out, (x, w, b), grad_out)
    ex, ew, eb = torch.autograd.grad(F.linear(x, w, b), (x, w, b), grad_out)
    torch.testing.assert_close(dx, ex)
    torch.testing.assert_close(db, eb)
    assert not torch.allclose(dw, ew)
    if method == "topk":   # the 12 strongest of the 48 token rows
        rows = torch.topk(x.detach().reshape(48, 16).norm(dim=1) * grad_out.reshape(48, 10).norm(dim=1), 12).indices
        torch.testing.assert_close(dw, grad_out.reshape(48, 10)[rows].t() @ x.detach().reshape(48, 16)[rows])
    else:                  # unbiased: the mean of many draws converges to the exact weight gradient
        total = torch.zeros_like(w)
        for _ in range(2000):
            total += torch.autograd.grad(backward_sampled_linear(x, w, b, 0.25, method, sample_input_grad=False),
                                         w, grad_out)[0]
        assert ((total / 2000 - ew).norm() / ew.norm()).item() < 0.06


def test_weight_grad_mode_conv_input_grad_exact():
    torch.manual_seed(7)
    x = torch.randn(8, 6, 5, 5, requires_grad=True)
    w = torch.randn(4, 6, 3, 3, requires_grad=True)
    out = backward_sampled_conv2d(x, w, None, 0.5, padding=1, method="wta_crs", sample_input_grad=False)
    grad_out = torch.randn_like(out)
    dx, dw = torch.autograd.grad(out, (x, w), grad_out)
    ex, ew = torch.autograd.grad(F.conv2d(x, w, padding=1), (x, w), grad_out)
    torch.testing.assert_close(out, F.conv2d(x, w, padding=1), rtol=0, atol=0)
    torch.testing.assert_close(dx, ex)
    assert not torch.allclose(dw, ew)


def test_one_counting_rule_per_use():
    from fxapprox.ops.sampling import kept_count, rounded_count

    # the plan's k: the most pairs the ratio allows; a sampled op handed k / n keeps that k again
    for n in (1, 7, 10, 64, 127, 768):
        for ratio in (0.1, 0.25, 1 / 3, 0.5, 0.75, 0.999):
            k = kept_count(ratio, n)
            assert 1 <= k <= n and k <= ratio * n + 1e-9 or k == 1
            assert rounded_count(k / n, n) == k
    # another dimension at that ratio: nearest, at least one
    assert rounded_count(0.5, 7) == 4 and rounded_count(0.01, 7) == 1 and rounded_count(1.0, 7) == 7
