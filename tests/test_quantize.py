"""The activation quantiser: bounded error, unbiased stochastic rounding, exact signs, edge cases."""

import math

import pytest
import torch

from fxapprox.ops.quantize import pack_mask, quantize, quantized_nbytes


def _group_steps(q, numel: int, group_size: int) -> torch.Tensor:
    """The step of each element's group, flattened like the tensor."""
    return q.scale.float().repeat_interleave(group_size)[:numel]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_nearest_error_is_at_most_half_a_step(bits):
    x = torch.randn(8, 300) * torch.linspace(0.1, 10, 300)
    q = quantize(x, bits, rounding="nearest", group_size=64)
    error = (q.dequantize() - x).abs().reshape(-1)
    steps = _group_steps(q, x.numel(), 64)
    assert torch.all(error <= steps / 2 + 1e-6 * x.abs().max())
    assert q.dequantize().shape == x.shape and q.dequantize().dtype == x.dtype


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("sign_exact", [False, True])
def test_stochastic_rounding_is_unbiased(bits, sign_exact):
    torch.manual_seed(0)
    x = torch.rand(4, 256) * 3 if sign_exact else torch.randn(4, 256)
    draws = 3000
    total = torch.zeros_like(x)
    for _ in range(draws):
        total += quantize(x, bits, group_size=64, sign_exact=sign_exact).dequantize()
    mean = total / draws
    q = quantize(x, bits, group_size=64, sign_exact=sign_exact)
    steps = _group_steps(q, x.numel(), 64).view_as(x)
    # One draw's error has variance ≤ step²/4; the mean of `draws` has ≤ step²/(4·draws). Allow 5 σ.
    bound = 5 * steps / (2 * math.sqrt(draws))
    assert torch.all((mean - x).abs() <= bound + 1e-6)


def test_stochastic_error_stays_below_one_step():
    x = torch.randn(16, 512)
    q = quantize(x, 4, group_size=128)
    steps = _group_steps(q, x.numel(), 128).view_as(x)
    assert torch.all((q.dequantize() - x).abs() <= steps + 1e-6)


def test_sign_exact_keeps_zeros_and_positives():
    x = torch.relu(torch.randn(32, 257))
    x[0, :5] = 1e-12  # tiny positives must stay positive
    for bits in (2, 4, 8):
        y = quantize(x, bits, sign_exact=True).dequantize()
        assert torch.equal(y > 0, x > 0)
        assert torch.all(y >= 0)


def test_constant_and_zero_tensors_come_back_exactly():
    for x in (torch.full((3, 100), 2.5), torch.zeros(5, 64), torch.full((7,), -1.0)):
        for rounding in ("stochastic", "nearest"):
            assert torch.equal(quantize(x, 4, rounding=rounding).dequantize(), x)


def test_nan_and_inf_propagate_to_their_group():
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    x[2, 7] = float("inf")
    y = quantize(x, 4, group_size=64).dequantize()
    assert not torch.isfinite(y[1]).all() and not torch.isfinite(y[2]).all()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[3]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_round_trip(dtype):
    x = torch.randn(6, 128).to(dtype)
    y = quantize(x, 8, rounding="nearest").dequantize()
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert (y.float() - x.float()).abs().max() < 0.05 * x.float().abs().max()


def test_layouts_odd_sizes_and_empty():
    x = torch.randn(2, 3, 5, 7).to(memory_format=torch.channels_last)
    y = quantize(x, 8, rounding="nearest").dequantize()
    assert y.is_contiguous(memory_format=torch.channels_last) and y.shape == x.shape
    assert (y - x).abs().max() < 0.05
    t = torch.randn(33, 17).t()  # non-contiguous, numel not a multiple of the group
    assert (quantize(t, 8, rounding="nearest").dequantize() - t).abs().max() < 0.05
    empty = torch.randn(0, 4)
    assert quantize(empty, 4).dequantize().shape == (0, 4)
    one = torch.tensor([3.0])
    assert torch.equal(quantize(one, 2).dequantize(), one)


def test_sizes_match_the_formula():
    x = torch.randn(1000, 256)
    for bits in (2, 4, 8):
        assert quantize(x, bits).nbytes == quantized_nbytes(x.numel(), bits)
    assert quantized_nbytes(x.numel(), 4) / (x.numel() * 4) == pytest.approx(4.125 / 32)


def test_masks_are_lossless():
    mask = torch.rand(3, 1001) > 0.5
    assert torch.equal(pack_mask(mask).dequantize(), mask)
    x = torch.relu(torch.randn(5, 9))
    assert torch.equal(pack_mask(x).dequantize(), (x > 0).float())
    assert pack_mask(mask).nbytes == math.ceil(mask.numel() / 8)


def test_bad_arguments_are_named():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="bits"):
        quantize(x, 3)
    with pytest.raises(ValueError, match="rounding"):
        quantize(x, 4, rounding="up")
    with pytest.raises(ValueError, match="group_size"):
        quantize(x, 4, group_size=12)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(3, dtype=torch.int64), 4)


def test_compiled_kernels_equal_eager():
    x = torch.randn(64, 320)
    torch.manual_seed(3)
    eager = quantize(x, 4)
    torch.manual_seed(3)
    compiled = quantize(x, 4, compiled=True)
    assert torch.equal(eager.packed, compiled.packed)
    torch.testing.assert_close(compiled.dequantize(), eager.dequantize(), atol=1e-6, rtol=0)


def test_groups_align_to_rows_so_a_row_of_zeros_comes_back_exactly():
    from fxapprox.ops.quantize import row_group

    assert [row_group(256, row) for row in (384, 128, 192, 1024, 96, 48, 100, None, 8 * 1009)] == [
        384, 128, 192, 256, 96, 256, 256, 256, 256]
    torch.manual_seed(0)
    x = torch.randn(4, 16, 384)
    x[1, 3] = 0.0                       # a padding token's embedding
    x[2, 7] *= 1e-4                     # a row far smaller than its neighbours
    for copy in (quantize(x, 2), quantize(x.reshape(-1), 2, row=384)):
        rebuilt = copy.dequantize().view_as(x)
        assert torch.equal(rebuilt[1, 3], torch.zeros(384))
        assert (rebuilt[2, 7] - x[2, 7]).abs().max() <= x[2, 7].abs().max()   # its own scale, not its neighbours'
        assert copy.nbytes == quantized_nbytes(x.numel(), 2, 256, row=384)
    assert quantized_nbytes(x.numel(), 2, 256, row=384) == x.numel() // 384 * (384 * 2 // 8 + 4)


def test_a_zero_row_keeps_a_normalisation_backward_finite():
    """An RMSNorm's backward multiplies its input by rsqrt(eps)³ ≈ 1e9 on a row of zeros: its copy must keep the
    row exactly zero (a group spanning it and a neighbouring row did not: the gradient went to 1e10, then NaN,
    training a Hugging Face Llama whose padding embedding is zero)."""
    import fxapprox

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 384, padding_idx=0)
            self.mix = torch.nn.Linear(384, 384, bias=False)
            self.head = torch.nn.Linear(384, 16)

        @staticmethod
        def norm(x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

        def forward(self, ids):
            return self.head(self.norm(self.mix(self.norm(self.embed(ids)))))

    torch.manual_seed(0)
    model = Norm()
    ids = torch.randint(0, 16, (4, 32))
    ids[:, 0] = 0
    approx = fxapprox.approximate(model, 1.0, example_inputs=(ids,),
                                  config=fxapprox.ApproxConfig(activation_bits=2, check_every=None, progress=False))
    out = approx(ids)
    (out * torch.randn_like(out)).sum().backward()
    assert all(torch.isfinite(p.grad).all() and p.grad.abs().max() < 1e3 for p in approx.parameters())


def test_the_rows_groups_align_to_are_feature_rows():
    from fxapprox.runtime.saved_tensors import memory_row

    def row(t):
        return memory_row(t.shape, t.stride())

    tokens = torch.randn(8, 16, 384)
    assert row(tokens) == 384 and row(tokens[:, :, :100]) == 100 and row(tokens.transpose(1, 2)) is None
    assert row(torch.randn(8, 4, 16, 48)) is None                        # attention's heads
    assert row(torch.randn(2, 64, 7, 7)) is None                         # a map's spatial row
    assert row(torch.randn(2, 64, 7, 7).to(memory_format=torch.channels_last)) == 64
    assert row(torch.randn(5)) is None
