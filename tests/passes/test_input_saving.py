"""Input saving: forward-sampled layers keep their input by reference where it is saved anyway, a gathered
copy where they are its only savers; approximated models never save more than exact ones."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox.runtime.modules import ApproxConv2d, ApproxLinear

FLOPS = fxapprox.ApproxConfig(policy="flops", keep_ratio=0.5, min_channels=8)


class ConvReluConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(x)))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TwoHeads(nn.Module):
    """Two sampled layers read the same input (saved by nothing else)."""

    def __init__(self):
        super().__init__()
        self.left = nn.Linear(32, 32)
        self.right = nn.Linear(32, 32)

    def forward(self, x):
        return self.left(x) * self.right(x)


def _saved(model, *inputs) -> int:
    model.train()
    with fxapprox.count_saved_bytes(model) as counter:
        model(*inputs)
    return counter.bytes


def test_input_saved_by_a_relu_is_kept_by_reference():
    approx = fxapprox.approximate(ConvReluConv(), 0.5, example_inputs=(torch.randn(2, 16, 8, 8),), config=FLOPS)
    decision = approx.plan.decision("conv2")
    assert decision.approximate and decision.save_input == "reference"
    assert "relu" in decision.save_input_reason
    assert isinstance(approx.conv2, ApproxConv2d) and approx.conv2.fxapprox_spec.save_input == "reference"
    # conv1's input is the model input, which only conv1 saves
    assert approx.plan.decision("conv1").save_input == "gathered"


def test_only_saver_keeps_a_gathered_copy_and_memory_falls():
    x = torch.randn(64, 32)
    model = Mlp()
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,), config=FLOPS)
    for name in ("fc1", "fc2"):   # fc2's input is GELU's output: GELU saves its input, not its output
        assert approx.plan.decision(name).save_input == "gathered", approx.plan.decision(name).save_input_reason
    assert isinstance(approx.fc2, ApproxLinear) and approx.fc2.fxapprox_spec.save_input == "gathered"
    assert _saved(approx, x) < _saved(model, x)


def test_sampled_layers_sharing_an_input_keep_it_whole_when_their_copies_would_add_up_to_more():
    x = torch.randn(16, 32)
    half = fxapprox.approximate(TwoHeads(), 0.5, example_inputs=(x,), config=FLOPS)
    assert {half.plan.decision(n).save_input for n in ("left", "right")} == {"reference"}   # 0.5 + 0.5 = 1
    quarter = fxapprox.approximate(TwoHeads(), 0.25, example_inputs=(x,),
                                   config=fxapprox.ApproxConfig(policy="flops", keep_ratio=0.25, min_channels=8))
    assert {quarter.plan.decision(n).save_input for n in ("left", "right")} == {"gathered"}


@pytest.mark.parametrize("save_input", ["reference", "gathered"])
def test_both_savings_give_the_same_gradients(save_input):
    torch.manual_seed(0)
    x = torch.randn(8, 16, 6, 6, requires_grad=True)
    conv = nn.Conv2d(16, 8, 3, padding=1)
    kept = torch.tensor([0, 3, 4, 9, 15])
    from fxapprox.ops.conv import conv2d_with_channels
    from fxapprox.ops.linear import linear_with_pairs

    out = conv2d_with_channels(x, conv.weight, conv.bias, kept, None, 1, 1, 1, save_input)
    got = torch.autograd.grad(out.square().sum(), [x, conv.weight, conv.bias])
    reference = F.conv2d(x[:, kept], conv.weight[:, kept], conv.bias, 1, 1)
    want = torch.autograd.grad(reference.square().sum(), [x, conv.weight, conv.bias])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    x2 = torch.randn(5, 3, 16, requires_grad=True)
    linear = nn.Linear(16, 4)
    scale = torch.rand(5) + 0.5
    out = linear_with_pairs(x2, linear.weight, linear.bias, kept, scale, save_input)
    got = torch.autograd.grad(out.square().sum(), [x2, linear.weight])
    reference = F.linear(x2[..., kept] * scale, linear.weight[:, kept], linear.bias)
    want = torch.autograd.grad(reference.square().sum(), [x2, linear.weight])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_a_reference_saves_the_input_itself_and_no_weight_copy():
    x = torch.randn(64, 256)
    linear = nn.Linear(256, 256)
    from fxapprox.ops.linear import sampled_linear

    with fxapprox.count_saved_bytes(linear) as exact:
        F.linear(x, linear.weight, linear.bias)
    with fxapprox.count_saved_bytes(linear) as reference:
        sampled_linear(x, linear.weight, linear.bias, 128, save_input="reference")
    with fxapprox.count_saved_bytes(linear) as gathered:
        sampled_linear(x, linear.weight, linear.bias, 128, save_input="gathered")
    index_bytes = 128 * 8
    assert reference.bytes == exact.bytes + index_bytes            # x itself (the weight is a parameter)
    assert gathered.bytes == exact.bytes // 2 + index_bytes         # half of x's columns
    with pytest.raises(ValueError, match="save_input"):
        sampled_linear(x, linear.weight, linear.bias, 128, save_input="copy")


class Block(nn.Module):
    """A pre-LN transformer block (attention through SDPA, GELU feed-forward)."""

    def __init__(self, width=64, heads=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads = heads

    def forward(self, x):
        batch, steps, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, steps, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        x = x + self.proj(attended)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


@pytest.mark.parametrize("policy", ["flops", "measured"])
@pytest.mark.parametrize("case", ["resnet18", "transformer"])
def test_approximated_models_never_save_more_than_exact(case, policy):
    torch.manual_seed(0)
    if case == "resnet18":
        import torchvision

        model, x = torchvision.models.resnet18(num_classes=10), torch.randn(4, 3, 32, 32)
    else:
        model, x = nn.Sequential(Block(), Block()), torch.randn(4, 32, 64)
    # Tolerances off: these models are too small to be faster sampled; the point is what sampled layers save.
    config = fxapprox.ApproxConfig(policy=policy, measure_repeats=1, error_draws=1, min_speedup=None,
                                   max_grad_error=None, min_gain=None)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,), config=config)
    assert approx.plan.approximated
    assert _saved(approx, x) <= _saved(model, x)
