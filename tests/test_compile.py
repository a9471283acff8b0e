"""torch.compile: top-k sampled ops compile with no graph break (``fullgraph=True``), forward and backward, and
give eager's results; the random methods and compressed activations may break the graph but must work.

The op-level tests use the ``aot_eager`` backend (dynamo + AOTAutograd, which traces the backward too, without
inductor's code generation, to keep the suite fast); one test runs inductor on a whole approximated model.
"""

import warnings

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox.runtime.modules import ApproxConv2d, ApproxLinear, ApproxLSTM, ApproxMatmul, SamplingSpec


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _linear(mode):
    return ApproxLinear.from_linear(nn.Linear(64, 32), SamplingSpec("topk", 16, 64, mode)), (torch.randn(8, 64),)


def _conv(mode):
    conv = nn.Conv2d(8, 6, 3, padding=1)
    return ApproxConv2d.from_conv2d(conv, SamplingSpec("topk", 4, 8, mode)), (torch.randn(2, 8, 6, 6),)


class _MatmulHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 32) / 8)
        self.matmul = ApproxMatmul(SamplingSpec("topk", 16, 64), "right")

    def forward(self, x):
        return self.matmul(x, self.weight)


def _lstm(mode):
    lstm = nn.LSTM(16, 32, num_layers=2, bidirectional=True)
    return ApproxLSTM.from_lstm(lstm, SamplingSpec("topk", 8, 32)), (torch.randn(5, 3, 16),)


CASES = {
    "linear forward": lambda: _linear("forward"),
    "linear backward": lambda: _linear("backward"),
    "linear weight_grad": lambda: _linear("weight_grad"),
    "conv2d forward": lambda: _conv("forward"),
    "conv2d backward": lambda: _conv("backward"),
    "conv2d weight_grad": lambda: _conv("weight_grad"),
    "matmul": lambda: (_MatmulHolder(), (torch.randn(8, 64),)),
    "lstm": lambda: _lstm("backward"),
}


def _loss(module, *inputs):
    out = module(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    return out.square().mean()


def _grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_top_k_sampled_ops_compile_without_graph_breaks(case):
    module, inputs = CASES[case]()
    module.train()
    explanation = torch._dynamo.explain(_loss)(module, *inputs)
    assert explanation.graph_break_count == 0, [str(b.reason)[:200] for b in explanation.break_reasons]
    torch._dynamo.reset()
    eager_loss = _loss(module, *inputs)
    eager_loss.backward()
    eager = _grads(module)
    module.zero_grad()
    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)
    compiled_loss = compiled(module, *inputs)
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss)
    for name, grad in _grads(module).items():
        torch.testing.assert_close(grad, eager[name], msg=name)


@pytest.mark.parametrize("mode", [None, "forward", "backward", "weight_grad"])
@pytest.mark.parametrize("method", ["topk", "crs", "wta_crs"])
def test_an_approximated_model_compiles_whole_under_the_default_config(method, mode):
    """``torch.compile(approx, fullgraph=True)`` of a planned model with the default config (the guard on: it says
    once that it does not run compiled, without breaking the graph) trains, every fixed-count method and mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    x = torch.randn(32, 64)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,), method=method,
                                  config=fxapprox.ApproxConfig(mode=mode, check_verbose=False)).train()
    assert approx.plan.approximated, approx.plan.note
    compiled = torch.compile(approx, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            approx.zero_grad()
            compiled(x).square().mean().backward()
    assert any("does not run under torch.compile" in str(w.message) for w in caught)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in approx.parameters())


@pytest.mark.parametrize("method", ["crs", "bernoulli", "wta_crs"])
def test_random_methods_run_compiled(method):
    """Their kept count is data-dependent (a host sync): dynamo may break the graph, the step must still run."""
    module = ApproxLinear.from_linear(nn.Linear(64, 32), SamplingSpec(method, 16, 64)).train()
    x = torch.randn(8, 64)
    loss = torch.compile(_loss, backend="aot_eager")(module, x)
    loss.backward()
    assert torch.isfinite(module.weight.grad).all() and module.weight.grad.abs().sum() > 0


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("memory_budget", [None, 0.25])
def test_compiled_approximated_model_matches_eager(memory_budget):
    """``torch.compile(approx)`` (inductor) trains like the eager approximated model; with a memory plan the
    compiled graphs pack what they save (at the plan's widths), the gradients stay those of eager training."""
    model = _MLP()
    x = torch.randn(64, 128)
    target = torch.randint(0, 10, (64,))
    approx = fxapprox.approximate(model, budget=0.5, memory_budget=memory_budget, example_inputs=(x,), method="topk",
                                  config=fxapprox.ApproxConfig(policy="flops", random_share=0.0)).train()
    assert any(isinstance(m, ApproxLinear) for m in approx.modules())
    torch.manual_seed(1)
    F.cross_entropy(approx(x), target).backward()
    eager = _grads(approx)
    approx.zero_grad()
    compiled = torch.compile(approx)
    torch.manual_seed(1)
    F.cross_entropy(compiled(x), target).backward()
    if memory_budget is None:
        for name, grad in _grads(approx).items():
            torch.testing.assert_close(grad, eager[name], msg=name, atol=1e-5, rtol=1e-4)
        return
    # The copies' rounding draws differ between the eager and the compiled packing (2-bit copies here): each is
    # compared with the same plan's gradients without copies, the compiled ones as close as the eager ones.
    exact_saving = fxapprox.approximate(model, budget=0.5, example_inputs=(x,), method="topk",
                                        config=fxapprox.ApproxConfig(policy="flops", random_share=0.0)).train()
    F.cross_entropy(exact_saving(x), target).backward()
    reference = _grads(exact_saving)
    for name, grad in _grads(approx).items():
        compiled_cosine = F.cosine_similarity(grad.flatten(), reference[name].flatten(), dim=0)
        eager_cosine = F.cosine_similarity(eager[name].flatten(), reference[name].flatten(), dim=0)
        assert compiled_cosine > min(0.95, eager_cosine - 0.03), (name, float(compiled_cosine), float(eager_cosine))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_torch_export_of_an_approximated_model(mode):
    """``torch.export``: eval exports the exact graph; training mode keeps the sampled ops (the LSTM as its
    custom op) and gives the same outputs as the module."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.lstm, self.head = nn.Linear(64, 128), nn.LSTM(128, 64), nn.Linear(64, 10)

        def forward(self, x):
            return self.head(self.lstm(F.relu(self.fc(x)))[0])

    x = torch.randn(5, 8, 64)
    approx = fxapprox.approximate(Net(), 0.5, example_inputs=(x,), method="topk",
                                  config=fxapprox.ApproxConfig(policy="flops", random_share=0.0))
    getattr(approx, mode)()
    exported = torch.export.export(approx, (x,))
    custom = [n for n in exported.graph.nodes if "fxapprox" in str(n.target)]
    assert bool(custom) == (mode == "train")
    torch.testing.assert_close(exported.module()(x), approx(x))


def _packed_by_compiled_graphs(monkeypatch) -> list:
    """Record every saved tensor the compiled graphs' pack hook packs (it runs when the graphs are traced)."""
    from fxapprox.runtime import compiled_saving

    packed = []
    real = compiled_saving.CompiledSaving.bits_for

    def recording(self, tensor):
        bits = real(self, tensor)
        if bits is not None and tensor.is_contiguous():
            packed.append((tuple(tensor.shape), bits))
        return bits
    monkeypatch.setattr(compiled_saving.CompiledSaving, "bits_for", recording)
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")   # trace the graphs here, not from a cache
    return packed


def test_memory_plan_compiles_with_packing_inlined(monkeypatch):
    """Under ``torch.compile`` a memory plan no longer runs the forward eagerly: the compiled graphs' saved tensors
    are packed at the plan's widths (AOTAutograd inlines the hooks), one graph serves every step (no recompile),
    and the gradients are those of exact training up to the copies' rounding."""
    packed = _packed_by_compiled_graphs(monkeypatch)
    torch.manual_seed(0)
    model = _MLP()
    x = torch.randn(256, 128)
    target = torch.randint(0, 10, (256,))
    config = fxapprox.ApproxConfig(check_every=None, activation_min_bytes=0, activation_checkpoint=False)
    approx = fxapprox.approximate(model, 1.0, memory_budget=0.25, example_inputs=(x,), config=config).train()
    assert approx.plan.memory.compressed
    exact = _MLP()
    exact.load_state_dict(model.state_dict())
    F.cross_entropy(exact(x), target).backward()
    reference = {name: p.grad for name, p in exact.named_parameters()}
    compiled = torch.compile(approx, backend="aot_eager")
    graphs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # no "runs eagerly" warning any more
        for _ in range(3):
            approx.zero_grad()
            F.cross_entropy(compiled(x), target).backward()
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert packed, "the compiled graphs packed nothing"
    widths = {bits for _, bits in packed}
    assert widths <= {d.bits for d in approx.plan.memory.compressed}
    assert graphs[0] == graphs[-1]   # the first step's graphs serve the others: no recompile
    for name, grad in _grads(approx).items():
        cosine = F.cosine_similarity(grad.flatten(), reference[name].flatten(), dim=0)
        assert cosine > 0.98, (name, float(cosine))


def test_compiled_pack_and_unpack():
    """The inlined packer's copy: within one step of each group (bits 8/4/2), unbiased under stochastic
    rounding, exact for a constant group, a tail group padded, the dtype kept, nearest rounding deterministic;
    a tensor of no planned size, a view and an integer tensor pass through."""
    from fxapprox.runtime.compiled_saving import CompiledSaving, _hook_modules

    torch.manual_seed(0)
    x = torch.randn(40, 100)   # 4000 elements: 15 full groups of 256 and a padded tail
    for bits in (8, 4, 2):
        pack, unpack = _hook_modules(CompiledSaving(((4000, 100, "float32", bits),), 256, 0, True))
        copy = pack(x)
        assert isinstance(copy, tuple) and copy[0].dtype == torch.uint8
        assert copy[0].numel() == 16 * 256 * bits // 8
        y = unpack(copy)
        assert y.shape == x.shape and y.dtype == x.dtype
        groups = torch.cat([x.reshape(-1), x.reshape(-1)[-1:].expand(96)]).view(16, 256)
        step = ((groups.amax(1) - groups.amin(1)) / (2 ** bits - 1)).repeat_interleave(256)[:4000].view(40, 100)
        assert ((y - x).abs() <= step * (1 + 1e-5)).all()
        if bits == 4:   # unbiased: the mean of many copies converges on x (std of one copy ≤ step / 2)
            mean = torch.stack([unpack(pack(x)) for _ in range(400)]).mean(0)
            assert ((mean - x).abs() <= 5 * step / 2 / 400 ** 0.5 + 1e-6).all()
    pack, unpack = _hook_modules(CompiledSaving(((4000, 100, "float32", 4),), 256, 0, False))
    assert torch.equal(unpack(pack(x)), unpack(pack(x)))   # nearest: deterministic
    constant = torch.full((40, 100), 0.3)
    assert torch.equal(unpack(pack(constant)), constant)
    half = x.to(torch.bfloat16)
    pack, unpack = _hook_modules(CompiledSaving(((4000, 100, "bfloat16", 8),), 256, 0, True))
    assert unpack(pack(half)).dtype == torch.bfloat16
    relu = torch.relu(torch.randn(40, 100)) * torch.linspace(1e-4, 1, 100)   # many small positives
    pack, unpack = _hook_modules(CompiledSaving(((4000, 100, "float32", 2),), 256, 0, True))
    for _ in range(5):   # sign-exact: a 2-bit copy keeps the ReLU's mask exactly
        assert torch.equal(unpack(pack(relu)) > 0, relu > 0)
    for kept in (torch.randn(100, 40), x.t(), torch.ones(40, 100, dtype=torch.long)):
        assert pack(kept) is kept and unpack(kept) is kept
