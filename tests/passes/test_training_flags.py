import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import StochasticDepth

import fxapprox
from fxapprox.passes import follow_training_mode, trace
from fxapprox.passes.training_flags import ModeFollowingCall

#: the FLOP-ranked policy: these tests are about the rewrite, not about which layers the measured policy picks
FLOPS = fxapprox.ApproxConfig(policy="flops")


class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.depth = StochasticDepth(0.5, "row")  # calls torchvision's fx-wrapped stochastic_depth

    def forward(self, x):
        x = F.dropout(self.fc(x), 0.5, self.training)              # flag passed positionally
        x = F.dropout(x, p=0.5, training=self.training)            # and by keyword
        return self.depth(x)


def test_constant_training_flags_follow_the_mode():
    gm = follow_training_mode(trace(Drop()))
    wrappers = [m for m in gm.modules() if isinstance(m, ModeFollowingCall)]
    assert len(wrappers) == 3 and {w.flag for w in wrappers} == {"training"}
    x = torch.ones(64, 32)
    gm.eval()
    torch.testing.assert_close(gm(x), gm.fc(x))          # no dropout in eval
    gm.train()
    assert (gm(x) == 0).any()                            # dropout again in training


def test_approximate_eval_matches_a_model_with_dropout():
    model = Drop()
    x = torch.randn(8, 32)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,), config=FLOPS)
    model.eval(), approx.eval()
    torch.testing.assert_close(approx(x), model(x), rtol=0, atol=0)
    assert list(approx.state_dict()) == list(model.state_dict())
