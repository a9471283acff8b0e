import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import StochasticDepth

import fxapprox
from fxapprox.passes import follow_training_mode, trace
from fxapprox.passes.capture.training_flags import ModeFollowingCall

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
    assert len(wrappers) == 3
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


class StandardisedConv(nn.Conv2d):
    """NF-Net's weight standardisation: batch_norm over the weight with training=True in *both* modes."""

    def forward(self, x):
        weight = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True,
                              momentum=0.0, eps=1e-5).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding)


class DropPathBlock(nn.Module):
    """timm's drop path: ``if not self.training: return x`` — the trace keeps whichever branch it took."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        out = self.fc(x)
        if not self.training:
            return x + out
        keep = torch.bernoulli(torch.full_like(x[..., :1], 0.5)) / 0.5
        return x + out * keep


class AttentionDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.p = 0.5

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0).squeeze(1)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = StandardisedConv(3, 32, 3, padding=1)
        self.block = DropPathBlock()
        self.attention = AttentionDropout()

    def forward(self, x):
        return self.attention(self.block(self.conv(x).mean((2, 3)).unsqueeze(1).expand(-1, 4, -1)))


def test_only_constants_that_change_with_the_mode_follow_it():
    model = Mixed()
    x = torch.randn(4, 3, 8, 8)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,), config=FLOPS)
    untraced = {u["module"]: u["reason"] for u in approx.plan.untraced}
    assert list(untraced) == ["block"] and "self.training" in untraced["block"]
    followers = [m for m in approx.modules() if isinstance(m, ModeFollowingCall)]
    # the attention's dropout_p follows the mode; weight standardisation's training=True does not
    assert [m.function for m in followers] == [F.scaled_dot_product_attention]
    model.eval(), approx.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(x), model(x))   # used to crash: batch_norm(training=False, no stats)
    approx.train()
    approx(x).sum().backward()


def test_sdpa_dropout_of_a_graph_traced_in_training_mode_is_off_in_eval():
    """A GraphModule traced elsewhere (Hugging Face's tracer) has no second trace: SDPA's baked dropout_p
    is known to be a training-only probability."""
    gm = torch.fx.symbolic_trace(AttentionDropout())
    gm = follow_training_mode(gm)
    x = torch.randn(4, 6, 32)
    gm.eval()
    torch.testing.assert_close(gm(x), gm(x))
    gm.train()
    assert not torch.equal(gm(x), gm(x))
