"""Sparse-backward LSTM: exact forward, nn.LSTM's gradients at keep-ratio 1, top-k columns, plan and module."""

import copy

import pytest
import torch
from torch import nn

import fxapprox
from fxapprox.ops import _cpu_gemm as cpu_gemm
from fxapprox.ops import lstm as lstm_ops
from fxapprox.ops.lstm import coarse_columns, fine_mask_, sparse_backward_lstm_layer
from fxapprox.ops.sampling import rounded_count
from fxapprox.runtime.modules import ApproxLSTM, SamplingSpec

#: the FLOP-ranked policy: these tests are about the rewrite, not about which layers the measured policy picks
FLOPS = fxapprox.ApproxConfig(policy="flops")

CONFIGS = [dict(), dict(num_layers=2), dict(bidirectional=True), dict(batch_first=True),
           dict(num_layers=2, bidirectional=True, batch_first=True), dict(bias=False)]


def _approx_lstm(lstm: nn.LSTM, keep_ratio: float, granularity: str = "coarse") -> ApproxLSTM:
    k = rounded_count(keep_ratio, lstm.hidden_size)
    return ApproxLSTM.from_lstm(copy.deepcopy(lstm), SamplingSpec("topk", max(k, 1), lstm.hidden_size,
                                                                  mode="backward"), granularity)


def _run(module, x, hx):
    out, (h, c) = module(x, hx)
    loss = out.square().sum() + h.sum() * 0.5 + c.sum() * 0.25
    params = [x] + list(module.parameters())
    return out.detach(), torch.autograd.grad(loss, params)


@pytest.mark.parametrize("options", CONFIGS, ids=lambda o: ",".join(o) or "default")
def test_keep_ratio_one_equals_nn_lstm(options):
    torch.manual_seed(0)
    lstm = nn.LSTM(6, 8, **options)
    approx = _approx_lstm(lstm, 1.0)
    approx.fxapprox_always_own = True   # our implementation's dense path, not nn.LSTM's kernel
    directions = 2 if lstm.bidirectional else 1
    x = torch.randn(3, 5, 6) if lstm.batch_first else torch.randn(5, 3, 6)
    x.requires_grad_(True)
    hx = (torch.randn(lstm.num_layers * directions, 3, 8), torch.randn(lstm.num_layers * directions, 3, 8))
    ref_out, ref_grads = _run(lstm, x, hx)
    out, grads = _run(approx, x, hx)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_sparse_gradients_are_the_dense_ones_restricted_to_kept_columns():
    """One step: with k < H, dh_{t-1}, dx, dW equal the dense formulas applied to dZ with dropped columns zeroed."""
    torch.manual_seed(1)
    lstm = nn.LSTM(4, 8)
    x = torch.randn(1, 3, 4, requires_grad=True)
    h0 = torch.randn(3, 8, requires_grad=True)
    c0 = torch.randn(3, 8, requires_grad=True)
    weights = [lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0]
    grad = torch.randn(1, 3, 8)
    hs, _, _ = sparse_backward_lstm_layer(x, h0, c0, *weights, keep_ratio=0.5)
    got = torch.autograd.grad((hs * grad).sum(), [x, h0] + weights[:2])
    # Reference: the dense gate gradient dZ (autograd through the exact cell), then keep the top-4 per gate.
    pre = x[0] @ weights[0].t() + weights[2] + h0 @ weights[1].t() + weights[3]
    pre.retain_grad()
    i, f, g, o = pre.chunk(4, 1)
    c = torch.sigmoid(f) * c0 + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    (h * grad[0]).sum().backward()
    dz = pre.grad
    kept = coarse_columns(dz, 4)
    mask = torch.zeros(32)
    mask[kept] = 1
    dz_kept = dz * mask
    want = [dz_kept @ weights[0], dz_kept @ weights[1], dz_kept.t() @ x[0].detach(), dz_kept.t() @ h0.detach()]
    torch.testing.assert_close(got[0][0], want[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[3], want[3], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("block_steps", [1, 3, 7, 20])
@pytest.mark.parametrize("library", ["onednn", "blas"])
def test_sparse_gradients_over_many_steps_equal_autograd_with_masked_gate_gradients(dtype, reverse, block_steps,
                                                                                   library, monkeypatch):
    """T steps: the layer's gradients equal autograd through the exact cells with every step's gate gradient
    restricted (by a hook) to each gate's top-k columns, which exercises the per-step products and the
    row-scattered weight-gradient accumulation at sizes where oneDNN's blocked kernels run. With
    ``block_steps`` L, the columns are chosen by the first step of each block of L steps in backward order
    (7 steps in blocks of 3: a partial block last; 20: one block for the whole sequence). Both product
    libraries and both tanh forms run, whichever this CPU would pick."""
    products = {"onednn": cpu_gemm._OneDNNProducts, "blas": cpu_gemm._BlasProducts}[library]
    monkeypatch.setattr(lstm_ops, "backward_products", lambda tensor: products)
    monkeypatch.setattr(lstm_ops, "tanh_is_fast", lambda: library == "blas")
    torch.manual_seed(2)
    steps, batch, inputs, hidden, k = 7, 16, 24, 64, 16
    lstm = nn.LSTM(inputs, hidden).to(dtype)
    weights = [lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0]
    x = torch.randn(steps, batch, inputs, dtype=dtype, requires_grad=True)
    h0 = torch.randn(batch, hidden, dtype=dtype, requires_grad=True)
    c0 = torch.randn(batch, hidden, dtype=dtype, requires_grad=True)
    grad = torch.randn(steps, batch, hidden, dtype=dtype)
    leaves = [x, h0, c0] + weights
    hs, _, _ = sparse_backward_lstm_layer(x, h0, c0, *weights, keep_ratio=k / hidden, reverse=reverse,
                                          block_steps=block_steps)
    got = torch.autograd.grad((hs * grad).sum(), leaves)
    kept_by_block = {}

    def keep_top_columns(dz, t):
        block = t // block_steps if reverse else (steps - 1 - t) // block_steps
        if block not in kept_by_block:   # hooks run in backward order: the block's first step chooses
            kept_by_block[block] = coarse_columns(dz, k)
        mask = torch.zeros(4 * hidden, dtype=dtype)
        mask[kept_by_block[block]] = 1
        return dz * mask

    h, c, outputs = h0, c0, [None] * steps
    for t in (range(steps - 1, -1, -1) if reverse else range(steps)):
        pre = x[t] @ weights[0].t() + weights[2] + h @ weights[1].t() + weights[3]
        pre.register_hook(lambda dz, t=t: keep_top_columns(dz, t))
        i, f, g, o = pre.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outputs[t] = h
    want = torch.autograd.grad((torch.stack(outputs) * grad).sum(), leaves)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-10
    for name, a, b in zip(["x", "h0", "c0", "w_ih", "w_hh", "b_ih", "b_hh"], got, want):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("reverse", [False, True])
def test_compiled_gate_factors_equal_the_eager_ones(reverse):
    torch.manual_seed(3)
    steps, batch, hidden = 5, 3, 8
    gates = torch.rand(steps, batch, 4 * hidden)
    cs, c0 = torch.randn(steps, batch, hidden), torch.randn(batch, hidden)
    tanh_cs = torch.tanh(cs)
    compiled = lstm_ops._factors_and_forget(gates, cs, c0, tanh_cs, reverse)
    eager = (*lstm_ops._gate_factors(gates, cs, c0, tanh_cs, reverse), gates[..., hidden:2 * hidden])
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)


def test_gate_factors_fall_back_to_eager_when_compiling_fails(monkeypatch):
    from torch._inductor.exc import InductorError

    def failing(*args):
        raise InductorError(RuntimeError("no C++ compiler"), "")

    monkeypatch.setattr(lstm_ops, "_compiled_gate_factors", lambda: failing)
    monkeypatch.setattr(lstm_ops, "_compile_failed", [])
    gates, cs = torch.rand(4, 2, 4 * 6), torch.randn(4, 2, 6)
    with pytest.warns(RuntimeWarning, match="eagerly"):
        factors, dc_from_dh, forget = lstm_ops._factors_and_forget(gates, cs, torch.zeros(2, 6), cs.tanh(), False)
    torch.testing.assert_close(forget, gates[..., 6:12])
    torch.testing.assert_close(factors, lstm_ops._gate_factors(gates, cs, torch.zeros(2, 6), cs.tanh(), False)[0])
    lstm_ops._factors_and_forget(gates, cs, torch.zeros(2, 6), cs.tanh(), False)   # no second attempt, no error


def test_block_steps_is_validated_and_reaches_the_module():
    with pytest.raises(ValueError, match="lstm_block_steps"):
        fxapprox.ApproxConfig(lstm_block_steps=0)
    with pytest.raises(TypeError, match="lstm_block_steps"):
        fxapprox.ApproxConfig(lstm_block_steps=2.5)
    config = fxapprox.ApproxConfig(policy="flops", lstm_block_steps=4)
    approx = fxapprox.approximate(CharLM(), 0.6, example_inputs=(torch.randint(0, 40, (10, 2)),), config=config)
    assert approx.lstm.fxapprox_block_steps == 4
    assert "block_steps=4" in repr(approx.lstm)


def test_coarse_columns_are_each_gates_top_k_by_norm():
    dz = torch.randn(16, 4 * 10)
    kept = coarse_columns(dz, 3)
    norms = dz.square().sum(0).view(4, 10)
    for gate in range(4):
        expected = set((norms[gate].topk(3).indices + 10 * gate).tolist())
        assert expected == set(kept[(kept >= 10 * gate) & (kept < 10 * gate + 10)].tolist())
    assert torch.equal(kept, kept.sort().values)


def test_fine_mask_keeps_each_rows_top_k_per_gate():
    dz = torch.randn(5, 4 * 6)
    masked = fine_mask_(dz.clone(), 2).view(5, 4, 6)
    assert torch.equal((masked != 0).sum(2), torch.full((5, 4), 2))
    kept = dz.view(5, 4, 6).abs().topk(2, dim=2).values
    assert torch.equal(masked.abs().sort(dim=2).values[..., -2:], kept.sort(dim=2).values)


def test_fine_granularity_trains():
    torch.manual_seed(0)
    lstm = nn.LSTM(6, 8)
    approx = _approx_lstm(lstm, 0.5, "fine")
    x = torch.randn(5, 3, 6, requires_grad=True)
    _, grads = _run(approx, x, None)
    assert all(torch.isfinite(g).all() for g in grads)


def test_eval_state_dict_and_forward_equal_nn_lstm():
    torch.manual_seed(0)
    lstm = nn.LSTM(6, 8, num_layers=2)
    approx = _approx_lstm(lstm, 0.25)
    assert list(approx.state_dict()) == list(lstm.state_dict())
    x = torch.randn(7, 2, 6)
    approx.train()
    torch.testing.assert_close(approx(x)[0], lstm(x)[0], atol=1e-5, rtol=0)   # forward exact while training
    approx.eval()
    lstm.eval()
    assert torch.equal(approx(x)[0], lstm(x)[0])
    restored = nn.LSTM(6, 8, num_layers=2)
    restored.load_state_dict(approx.state_dict())


def test_unsupported_configurations_are_reported():
    with pytest.raises(ValueError, match="proj_size"):
        _approx_lstm(nn.LSTM(6, 8, proj_size=4), 0.5)

    class Projected(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(6, 32, proj_size=4)

        def forward(self, x):
            return self.lstm(x)[0]

    approx = fxapprox.approximate(Projected(), 0.7, example_inputs=(torch.randn(5, 2, 6),), config=FLOPS)
    assert "proj_size" in approx.plan.decision("lstm").reason
    lstm = _approx_lstm(nn.LSTM(6, 8), 0.5)
    packed = nn.utils.rnn.pack_sequence([torch.randn(4, 6), torch.randn(2, 6)])
    with pytest.warns(RuntimeWarning, match="PackedSequence"):
        lstm(packed)


class CharLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 32)
        self.lstm = nn.LSTM(32, 64)
        self.decode = nn.Linear(64, 40)

    def forward(self, x):
        return self.decode(self.lstm(self.embed(x))[0])


@pytest.mark.parametrize("budget, expected_ratio", [(2 / 3, 0.5), (0.5, 0.25)])
def test_budget_maps_to_gate_keep_ratio(budget, expected_ratio):
    config = fxapprox.ApproxConfig(policy="flops", overrides=(fxapprox.LayerOverride("decode", exclude=True),
                                              fxapprox.LayerOverride("embed", exclude=True)))
    model = CharLM()
    x = torch.randint(0, 40, (20, 4))
    approx = fxapprox.approximate(model, budget, example_inputs=(x,), config=config)
    decision = approx.plan.decision("lstm")
    assert decision.approximate and decision.mode == "backward" and decision.method == "topk"
    # The decoder and embedding stay exact, so the LSTM alone must cut a little more than (3b - 1) / 2.
    assert expected_ratio * 0.5 < decision.keep_ratio <= expected_ratio + 1e-9
    assert approx.plan.budget_met
    approx(x).sum().backward()
    assert isinstance(approx.lstm, ApproxLSTM)
    approx.set_approximate(False)
    assert not approx.lstm.approximating


def test_sparse_then_dense_schedule():
    model = CharLM()
    x = torch.randint(0, 40, (10, 2))
    approx = fxapprox.approximate(model, 0.6, example_inputs=(x,), config=FLOPS)
    schedule = fxapprox.SparseThenDense(approx, total_steps=8, sparse_fraction=0.75)
    modes = [schedule.step() for _ in range(8)]
    assert modes == [True] * 6 + [False] * 2
    assert not approx.lstm.approximating
    with pytest.raises(ValueError, match="sparse_fraction"):
        fxapprox.SparseThenDense(approx, 8, sparse_fraction=1.5)
    with pytest.raises(TypeError, match="approx"):
        fxapprox.SparseThenDense(model, 8)


def test_reverse_direction_equals_the_flipped_sequence():
    torch.manual_seed(2)
    lstm = nn.LSTM(4, 8)
    weights = [lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0]
    x = torch.randn(6, 3, 4, requires_grad=True)
    h0, c0 = torch.randn(3, 8), torch.randn(3, 8)
    grad = torch.randn(6, 3, 8)
    hs, h, c = sparse_backward_lstm_layer(x, h0, c0, *weights, keep_ratio=0.5, reverse=True)
    got = torch.autograd.grad((hs * grad).sum() + h.sum(), [x] + weights)
    flipped = x.detach().flip(0).requires_grad_(True)
    hs_f, h_f, _ = sparse_backward_lstm_layer(flipped, h0, c0, *weights, keep_ratio=0.5)
    want = torch.autograd.grad((hs_f * grad.flip(0)).sum() + h_f.sum(), [flipped] + weights)
    torch.testing.assert_close(hs, hs_f.flip(0))
    torch.testing.assert_close(got[0], want[0].flip(0), atol=1e-5, rtol=0)
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
