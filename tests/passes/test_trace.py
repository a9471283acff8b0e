import pytest
import torch
from torch import nn

import fxapprox
from fxapprox.passes.capture.trace import trace

#: the FLOP-ranked policy: these tests are about the rewrite, not about which layers the measured policy picks
FLOPS = fxapprox.ApproxConfig(policy="flops")


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: not traceable
            return x * 2
        return x


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Branchy()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(self.inner(x))


STRICT = fxapprox.ApproxConfig(policy="flops", strict_trace=True)


def test_untraceable_model_names_module_and_line_with_strict_trace():
    with pytest.raises(fxapprox.TraceError) as info:
        fxapprox.approximate(Outer(), 0.5, config=STRICT)
    message = str(info.value)
    assert "'inner'" in message and "Branchy" in message
    assert "if x.sum() > 0" in message and "test_trace.py" in message
    assert "leaf_modules=('inner',)" in message and "GraphModule" in message
    assert info.value.module_path == "inner"


def test_leaf_module_fix_works_and_leaf_stays_exact():
    config = fxapprox.ApproxConfig(policy="flops", leaf_modules=("inner",), min_channels=8)
    approx = fxapprox.approximate(Outer(), 0.5, example_inputs=(torch.randn(4, 16),), config=config)
    assert [n.target for n in approx.graph.nodes if n.op == "call_module"] == ["inner", "fc"]
    assert approx.plan.decision("fc").approximate


def test_leaf_by_type_and_recurrent_leaves():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Branchy()
            self.gru = nn.GRU(8, 8)

        def forward(self, x):
            return self.gru(self.inner(x))[0]

    gm = trace(Model(), leaf_modules=(Branchy,))
    assert {n.target for n in gm.graph.nodes if n.op == "call_module"} == {"inner", "gru"}


def test_trace_does_not_touch_the_model():
    model = Outer()
    with pytest.raises(fxapprox.TraceError):
        trace(model, strict=True)
    assert isinstance(model.inner, Branchy)
    trace(model)
    assert isinstance(model.inner, Branchy)


class Padded(nn.Module):
    """timm-style 'same' padding: math.ceil on a traced size."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3)

    def forward(self, x):
        import math
        pad = max((math.ceil(x.shape[-1] / 2) - 1) * 2 + 3 - x.shape[-1], 0)
        return self.conv(nn.functional.pad(x, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2)))


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(Padded(), nn.ReLU(), Outer2d())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class Outer2d(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Branchy()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(self.inner(x))


def test_untraceable_submodules_with_layers_are_captured_region_by_region_and_reported():
    model = Nested()
    x = torch.randn(2, 3, 16, 16)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,),
                                  config=fxapprox.ApproxConfig(policy="flops", min_channels=3))
    untraced = {u["module"]: u for u in approx.plan.untraced}
    # the innermost modules that failed: blocks.0 holds a Conv2d, so the model is captured region by region
    assert set(untraced) == {"blocks.0", "blocks.2.inner"}
    assert untraced["blocks.2.inner"]["module_type"] == "Branchy"
    assert "if x.sum() > 0" in untraced["blocks.2.inner"]["source_line"]
    assert "math.ceil" in untraced["blocks.0"]["source_line"] or "ceil" in untraced["blocks.0"]["reason"]
    assert isinstance(approx, Nested)
    regions = {r["path"]: r["kind"] for r in approx.plan.regions}
    assert regions["blocks.0"] == "eager" and regions["blocks.0.conv"] == "leaf"
    assert regions["stem"] == "leaf" and regions["head"] == "leaf"
    assert approx.plan.decision("blocks_0_conv").approximate   # a layer inside the untraceable block is sampled
    report = str(approx.report)
    assert "could not trace 'blocks.0' (Padded)" in report and "ran eagerly, their layers captured" in report
    assert fxapprox.plan.Plan.from_dict(approx.plan.to_dict()).untraced == approx.plan.untraced
    approx.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(x), model.eval()(x))
    approx.train()(x).sum().backward()


def test_untraceable_submodules_without_layers_stay_leaves_of_the_traced_model():
    # Branchy holds no approximable layer: the model stays one traced graph with it as an exact leaf
    approx = fxapprox.approximate(Outer(), 0.5, example_inputs=(torch.randn(4, 16),),
                                  config=fxapprox.ApproxConfig(policy="flops", min_channels=8))
    assert isinstance(approx, fxapprox.ApproxGraphModule) and not approx.plan.regions
    assert [u["module"] for u in approx.plan.untraced] == ["inner"]
    assert "kept exact, torch.fx could not trace 'inner' (Branchy)" in str(approx.report)
    assert approx.plan.decision("fc").approximate


class BranchyRoot(nn.Module):
    """Data-dependent control flow in the root's own code, around a traceable block and a bare Linear."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 16)
        self.inner = Branchy()

    def forward(self, x):
        x = self.block(x)
        if x.sum() > 0:   # not traceable
            x = x * 2
        return self.head(self.inner(x))


def test_a_root_that_cannot_be_traced_runs_eagerly_and_its_children_are_approximated():
    torch.manual_seed(0)
    model = BranchyRoot()
    x = torch.randn(8, 16)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,),
                                  config=fxapprox.ApproxConfig(policy="flops", min_channels=3))
    assert type(approx).__name__ == "BranchyRoot" and isinstance(approx, BranchyRoot)
    regions = {r["path"]: r for r in approx.plan.regions}
    assert regions[""]["kind"] == "eager" and "if x.sum() > 0" in regions[""]["source_line"]
    assert regions["block"]["kind"] == "traced" and regions["head"]["kind"] == "leaf"
    assert "inner" not in regions   # no parameters: nothing to approximate, it runs inside the root's code
    assert isinstance(approx.block, torch.fx.GraphModule)
    assert type(approx.head).__name__ == "ApproxLinear" and approx.plan.approximated
    assert set(approx.state_dict()) == set(model.state_dict())
    approx.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(x), model.eval()(x))
    approx.train()(x).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in approx.parameters())


def test_a_root_that_cannot_be_traced_raises_with_strict_trace():
    with pytest.raises(fxapprox.TraceError) as info:
        fxapprox.approximate(BranchyRoot(), 0.5, config=fxapprox.ApproxConfig(strict_trace=True))
    assert info.value.module_path == "<root>"


class StandardisedConv(nn.Conv2d):
    """A Conv2d subclass with its own forward (timm's ScaledStdConv2d): not the plain op."""

    def forward(self, x):
        weight = (self.weight - self.weight.mean((1, 2, 3), keepdim=True)) * 0.5
        return nn.functional.conv2d(x, weight, self.bias, self.stride, self.padding)


def test_subclasses_with_their_own_forward_are_not_swapped_for_the_plain_sampled_op():
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), StandardisedConv(32, 32, 3, padding=1))
    x = torch.randn(2, 3, 8, 8)
    config = fxapprox.ApproxConfig(policy="flops", leaf_modules=(StandardisedConv,), min_channels=3)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,), config=config)
    decision = approx.plan.decision("_1")
    assert not decision.approximate and "overrides Conv2d.forward" in decision.reason
    approx.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(x), model.eval()(x))
