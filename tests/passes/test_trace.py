import pytest
import torch
from torch import nn

import fxapprox
from fxapprox.passes.trace import trace

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


def test_untraceable_model_names_module_and_line():
    with pytest.raises(fxapprox.TraceError) as info:
        fxapprox.approximate(Outer(), 0.5, config=FLOPS)
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
        trace(model)
    assert isinstance(model.inner, Branchy)
