"""The row family (``fxapprox.ops.rows``): a block's backward on the samples it keeps, forward exact.

Ratio 1 is the exact gradient bit for bit; the estimator is unbiased (the mean of many draws converges to the exact
gradient at the rate of independent draws); a sampled step executes the kept rows only (``FlopCounterMode``); the
probes refuse blocks that mix samples or draw random numbers; the variance checks raise the ratios when the batch is
less noisy and lower them when it is noisier; traced and region-captured models, copies, pickles, ``state_dict``,
evaluation, autocast and ``torch.compile``.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxapprox
from fxapprox.ops.row_tape import row_linear
from fxapprox.ops.rows import RowSampler, kept_rows_count, row_sampled_call
from fxapprox.passes.measurement.measure_rows import BlockRun, forward_disruption, probe_row_block
from fxapprox.passes.policy.row_policy import next_ratios, with_ratios
from fxapprox.plan import Plan
from tests.test_untraceable_blocks import CharLM, UnpackingBlock

D, HEADS, VOCAB, T, B = 32, 4, 40, 16, 8
#: rows wherever the blocks reach the budget (models at their initial weights let the forward be sampled)
ROWS = fxapprox.ApproxConfig(max_forward_kl=None, check_every=None, row_check_every=None, check_verbose=False,
                             min_speedup=None)


class Block(nn.Module):
    def __init__(self, d: int = D, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.Sequential(*[Block() for _ in range(blocks)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids)))


def _batch(batch: int = B):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, T), generator=generator)
    return ids, torch.randint(0, VOCAB, (batch, T), generator=generator)


def _loss(model, ids, targets):
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def _gradients(model, ids, targets) -> dict:
    model.zero_grad(set_to_none=True)
    _loss(model, ids, targets).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _approximate(model, budget=0.5, ids=None, config=ROWS):
    ids = _batch()[0] if ids is None else ids
    return fxapprox.approximate(model, budget, example_inputs=(ids,), config=config)


def _set_ratios(approx, ratio: float, token_ratio: float = 1.0, force: bool = False) -> None:
    """Pin the plan's ratios (after the first step's calibration check, which would choose them again)."""
    if approx.plan.rows.checked_step is None:
        ids, targets = _batch()
        _loss(approx, ids, targets).backward()
        approx.zero_grad(set_to_none=True)
    approx._apply_plan(with_ratios(approx.plan, approx._planning_module(), ratio, token_ratio))
    approx._row_sampler().force = force


@pytest.fixture(params=["traced", "regions"])
def model_and_approx(request):
    torch.manual_seed(0)
    if request.param == "traced":
        model = LM()
    else:
        model = CharLM(UnpackingBlock, blocks=3, d=D, heads=HEADS, vocab=VOCAB, context=T)
    approx = _approximate(model)
    assert approx.plan.rows is not None, approx.plan.note
    return model, approx


# -- the estimator ---------------------------------------------------------------------------------------------------
def test_the_plan_spends_the_budget_on_rows(model_and_approx):
    model, approx = model_and_approx
    plan = approx.plan
    assert plan.budget_met and plan.achieved <= 0.5 + 1e-9, plan.note
    assert {d.mode for d in plan.approximated} == {"rows"}
    assert len(plan.rows.sampled) == 3 and all(b.ratio < 1 for b in plan.rows.sampled)
    assert Plan.from_dict(plan.to_dict()) == plan


def test_ratio_one_is_bit_identical_to_exact(model_and_approx):
    """Through the whole machinery (forward recorded, backward replayed on every row), the gradients are the exact
    ones, bit for bit."""
    model, approx = model_and_approx
    _set_ratios(approx, 1.0, force=True)
    ids, targets = _batch()
    exact, replayed = _gradients(model.train(), ids, targets), _gradients(approx, ids, targets)
    assert exact.keys() == replayed.keys()
    for name in exact:
        assert torch.equal(exact[name], replayed[name]), name


def test_set_approximate_false_trains_exactly(model_and_approx):
    model, approx = model_and_approx
    _set_ratios(approx, 0.25)
    approx.set_approximate(False)
    ids, targets = _batch()
    exact, found = _gradients(model.train(), ids, targets), _gradients(approx, ids, targets)
    for name in exact:
        torch.testing.assert_close(found[name], exact[name], rtol=1e-5, atol=1e-6)
    approx.set_approximate(True)
    found = _gradients(approx, ids, targets)
    assert any(not torch.allclose(found[n], exact[n], rtol=1e-3, atol=1e-5) for n in exact)


def test_the_estimate_is_unbiased(model_and_approx):
    """The mean of ``n`` sampled gradients is ~``1/√n`` of one draw's distance from the exact gradient (independent,
    unbiased draws), for rows and tokens sampled together."""
    model, approx = model_and_approx
    _set_ratios(approx, 0.5, 0.5)
    ids, targets = _batch()
    exact = _gradients(model.train(), ids, targets)
    names = [n for n in exact if ".blocks." in f".{n}" or n.startswith("blocks.")]
    draws = 300
    total, one = None, None
    for _ in range(draws):
        found = _gradients(approx, ids, targets)
        vector = torch.cat([found[n].flatten() for n in names])
        total = vector if total is None else total + vector
        one = vector if one is None else one
    reference = torch.cat([exact[n].flatten() for n in names])
    single = float((one - reference).norm())
    mean_error = float((total / draws - reference).norm())
    assert single > 0.05 * float(reference.norm())   # a draw is far from exact ...
    assert mean_error < 3.0 * single / math.sqrt(draws)   # ... their mean converges as unbiased draws do


def test_a_sampled_step_executes_the_kept_rows_only():
    """``FlopCounterMode`` over a training step matches the plan's FLOPs: the kept rows' GEMMs only, the forward's
    not repeated."""
    torch.manual_seed(0)
    model = LM()
    approx = _approximate(model)
    _set_ratios(approx, 0.5)   # 4 of 8 samples: a whole count
    ids, targets = _batch()

    def counted(module) -> int:
        with FlopCounterMode(display=False) as counter:
            _loss(module, ids, targets).backward()
        module.zero_grad(set_to_none=True)
        return counter.get_total_flops()
    assert counted(approx) == pytest.approx(approx.plan.total_planned_flops, rel=0.03)
    assert counted(approx) / counted(model.train()) == pytest.approx(approx.plan.achieved, rel=0.03)


def test_kept_counts_realise_fractional_ratios():
    torch.manual_seed(0)
    counts = [kept_rows_count(0.97, 16) for _ in range(4000)]
    assert set(counts) == {15, 16}
    assert sum(counts) / len(counts) == pytest.approx(0.97 * 16, rel=0.01)
    assert kept_rows_count(1.0, 16) == 16 and kept_rows_count(0.01, 16) >= 1


def test_zero_gradient_rows_are_never_kept_and_an_empty_batch_passes():
    sampler = RowSampler(ratios={"b": 0.5})
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0])
    for _ in range(50):
        rows, scale = sampler.kept_rows("b", weights)
        assert set(rows.tolist()) >= {1, 3, 6} and torch.all(scale[weights[rows] == 0] == 0)
    layer = nn.Linear(4, 3)
    x = torch.randn(0, 5, 4, requires_grad=True)
    out = row_sampled_call("b", sampler, lambda t: row_linear(t, layer.weight, layer.bias), (x,), {},
                           list(layer.parameters()), 0)
    out.sum().backward()
    assert out.shape == (0, 5, 3)


def test_bf16_autocast_step_runs_and_matches_exact_at_ratio_one():
    torch.manual_seed(0)
    model = LM()
    approx = _approximate(model)
    _set_ratios(approx, 1.0, force=True)
    ids, targets = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exact = _gradients(model.train(), ids, targets)
        replayed = _gradients(approx, ids, targets)
    for name in exact:
        torch.testing.assert_close(replayed[name], exact[name], rtol=2e-2, atol=2e-3)
    _set_ratios(approx, 0.5, 0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        found = _gradients(approx, ids, targets)
    assert all(torch.isfinite(g).all() for g in found.values())


# -- which blocks ----------------------------------------------------------------------------------------------------
class NormedBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(T)

    def forward(self, x):
        return super().forward(self.norm(x))


class DroppingBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return super().forward(self.drop(x))


@pytest.mark.parametrize("block, reason", [(Block, None), (NormedBlock, "mixes its samples"),
                                           (DroppingBlock, "draws random numbers")])
def test_the_probe_refuses_blocks_that_mix_samples_or_draw(block, reason):
    torch.manual_seed(0)
    found = probe_row_block(BlockRun(block().train(), (torch.randn(B, T, D),), {}, B))
    assert (found is None) if reason is None else (found is not None and found.startswith(reason)), found


def test_blocks_that_cannot_be_row_sampled_say_why_in_the_plan():
    torch.manual_seed(0)
    model = LM()
    model.blocks[1] = NormedBlock()
    assert "row sampling not used: the row-sampled blocks reach" in _approximate(copy.deepcopy(model)).plan.note
    approx = _approximate(model, 0.7)
    decisions = {b.name: b for b in approx.plan.rows.blocks}
    assert not decisions["blocks.1"].sampled and decisions["blocks.1"].reason.startswith("mixes its samples")
    assert decisions["blocks.0"].sampled and decisions["blocks.2"].sampled


def test_a_trained_model_keeps_its_forward_exact_and_an_initial_one_may_sample_it():
    """``max_forward_kl``: sampled forwards barely move the near-uniform predictions of a model at its initial
    weights, and move a confident (trained) model's a lot."""
    torch.manual_seed(0)
    model, ids = LM().train(), _batch()[0]
    calm = forward_disruption(lambda: model(ids), 0.5, 16)
    with torch.no_grad():
        model.head.weight.mul_(200.0)
    confident = forward_disruption(lambda: model(ids), 0.5, 16)
    assert calm < 0.1 < confident
    config = fxapprox.ApproxConfig(check_every=None, row_check_every=None, min_speedup=None)
    assert fxapprox.approximate(LM(), 0.5, example_inputs=(ids,), config=config).plan.rows is None
    assert fxapprox.approximate(model, 0.5, example_inputs=(ids,), config=config).plan.rows is not None


# -- variance checks -------------------------------------------------------------------------------------------------
class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _check(approx, inputs, loss):
    def backward_outputs(output):
        return [loss(output)], [torch.ones(())]
    rows = approx.plan.rows
    return approx.measure_rows((inputs,), {}, backward_outputs, [({b.name: 0.5 for b in rows.sampled}, 0.5)])[0]


def test_the_checks_raise_the_ratios_for_a_less_noisy_batch_and_lower_them_for_a_noisier_one():
    """The sampling variance is measured against the minibatch's: where the samples' gradients agree (inputs
    spread little around a common one) the same sampling weighs more against the minibatch's noise and the ratios
    go up; where they agree less, they come down."""
    torch.manual_seed(0)
    model = nn.Sequential(*[MLPBlock() for _ in range(3)])
    centre = torch.randn(1, T, D)
    direction = torch.randn(T, D)

    def loss(output):
        return (output * direction).sum(-1).pow(2).mean()

    def batch(spread: float):
        return centre + spread * torch.randn(16, T, D, generator=torch.Generator().manual_seed(5))
    approx = fxapprox.approximate(model, "auto", example_inputs=(batch(1.0),), config=ROWS)
    config = approx._fxapprox_state.config
    ratio = {spread: next_ratios(0.5, 0.5, _check(approx, batch(spread), loss), 0.025, config, calibrating=True)[0]
             for spread in (0.05, 1.0, 20.0)}
    assert ratio[0.05] > ratio[1.0] > ratio[20.0], ratio


def test_training_records_variance_checks():
    """The first step and every ``row_check_every`` after it are checked and recorded; under ``"auto"`` a check
    that leaves nothing to sample within the bound doubles the interval to the next."""
    torch.manual_seed(0)
    config = fxapprox.ApproxConfig(check_every=None, row_check_every=3, check_verbose=False, min_speedup=None)
    approx = _approximate(LM(), "auto", config=config)
    ids, targets = _batch()
    optimizer = torch.optim.SGD(approx.parameters(), lr=0.1)
    for _ in range(12):
        optimizer.zero_grad()
        _loss(approx, ids, targets).backward()
        optimizer.step()
    checks = list(approx.history)
    steps = [c.step for c in checks]
    assert steps[:2] == [1, 4]
    assert all(c.sgd_variance > 0 and c.variance_ratio is not None for c in checks)
    rows = approx.plan.rows
    assert rows.checked_step == steps[-1] and rows.sgd_variance == checks[-1].sgd_variance
    for before, after, record in zip(steps, steps[1:], checks):
        sampled_nothing = record.row_ratio >= 1.0 and record.token_ratio >= 1.0
        assert after - before == (6 if sampled_nothing and before > 1 else 3)
    assert "variance" in str(approx.report)


def test_auto_samples_only_below_the_measured_time_break_even(tmp_path, monkeypatch):
    """``"auto"``'s row break-even is the lower of the replay's FLOP break-even and the block's step timed plain
    and row-sampled (cached per machine: the same plan again)."""
    from fxapprox.passes.analysis.row_blocks import row_blocks_of
    from fxapprox.passes.measurement.measure_rows import BlockRun, row_time_breakeven
    from fxapprox.pipeline.timing_cache import TimingCache

    torch.manual_seed(0)
    config = fxapprox.ApproxConfig(check_every=None, check_verbose=False, timing_cache=str(tmp_path))
    approx = _approximate(LM(), "auto", config=config)
    rows = approx.plan.rows
    flop_breakeven = min(b.breakeven(1.0) for b in row_blocks_of(approx._planning_module()) if not b.blocker)
    assert 0.0 <= rows.row_breakeven <= flop_breakeven
    block = Block()
    run = BlockRun(block, (torch.randn(B, T, D),), {}, B)
    cache = TimingCache.for_config(str(tmp_path), torch.device("cpu"))
    first = row_time_breakeven(run, cache)
    assert 0.0 <= first <= 1.0 and row_time_breakeven(run, cache) == first
    # the timed break-even is what "auto" plans with, and a numeric budget (FLOPs) does not time it
    import fxapprox.passes.measurement.measure_rows as measure_rows

    timed = []
    monkeypatch.setattr(measure_rows, "row_time_breakeven", lambda *a, **k: timed.append(1) or 0.3)
    assert _approximate(LM(), "auto", config=config).plan.rows.row_breakeven == pytest.approx(min(0.3, flop_breakeven))
    assert timed == [1]
    assert _approximate(LM(), 0.5).plan.rows.row_breakeven == pytest.approx(flop_breakeven) and timed == [1]


def test_a_batch_of_one_sample_waits_for_a_larger_batch_to_check():
    """One sample has no minibatch variance to measure: the step trains without a check, the next larger batch
    is checked."""
    torch.manual_seed(0)
    config = fxapprox.ApproxConfig(max_forward_kl=None, check_every=None, row_check_every=2, check_verbose=False,
                                   min_speedup=None)
    approx = _approximate(LM(), 0.6, config=config)
    ids, targets = _batch()
    _loss(approx, ids[:1], targets[:1]).backward()
    assert list(approx.history) == [] and approx.plan.rows.checked_step is None
    _loss(approx, ids, targets).backward()
    assert [c.step for c in approx.history] == [2] and approx.history[0].sgd_variance > 0


def test_a_numeric_budget_keeps_its_flops_through_the_checks():
    torch.manual_seed(0)
    config = fxapprox.ApproxConfig(max_forward_kl=None, check_every=None, row_check_every=2, check_verbose=False,
                                   min_speedup=None)
    approx = _approximate(LM(), 0.6, config=config)
    ids, targets = _batch()
    for _ in range(5):
        _loss(approx, ids, targets).backward()
    assert [c.step for c in approx.history] == [1, 3, 5]
    assert approx.plan.budget_met and approx.plan.achieved == pytest.approx(0.6, abs=0.01), approx.plan.note


# -- the model as users have it --------------------------------------------------------------------------------------
def test_state_dict_eval_copies_and_pickles(model_and_approx):
    model, approx = model_and_approx
    ids, targets = _batch()
    assert approx.state_dict().keys() == model.state_dict().keys()
    approx.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(ids), model.eval()(ids), rtol=0, atol=0)
    approx.train()
    _loss(approx, ids, targets).backward()
    buffer = io.BytesIO()
    torch.save(approx, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(approx), torch.load(buffer, weights_only=False)):
        assert clone.plan.to_dict() == approx.plan.to_dict()
        found = _gradients(clone, ids, targets)
        assert all(torch.isfinite(g).all() for g in found.values())
        assert clone._row_sampler() is not approx._row_sampler()


def test_torch_compile_runs_the_row_step_eagerly_with_a_warning():
    torch.manual_seed(0)
    approx = _approximate(LM())
    compiled = torch.compile(approx, backend="eager")
    ids, targets = _batch()
    with pytest.warns(RuntimeWarning, match="row-sampled plan's training step runs eagerly"):
        _loss(compiled, ids, targets).backward()
    assert all(p.grad is not None for p in approx.parameters())
