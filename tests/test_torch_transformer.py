"""torch's own transformer modules in the plan (``fxapprox/passes/capture/torch_transformer.py``).

``nn.MultiheadAttention``, ``nn.TransformerEncoder(Layer)``, ``nn.TransformerDecoder(Layer)`` and ``nn.Transformer`` are
traced through their training computation: their projections and feed-forward layers are candidates like any
linear layer; a plan that samples nothing trains as torch does; evaluation is torch's own forward (its inference
fast path and nested tensors included), bit for bit.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torchvision
from torch import nn

import fxapprox
from fxapprox.ops.attention import attention_from_saved_inputs
from fxapprox.passes.capture.trace import TRACED_THROUGH_KEY, trace
from tests.test_budget_contract import BUDGET, SLACK, executed_fraction

D, HEADS, FF, VOCAB = 64, 4, 128, 50
#: no variance check inside FlopCounterMode (its module tracker's hooks refuse the check's autograd.grad)
QUIET = fxapprox.ApproxConfig(check_verbose=False, row_check_every=None)


class Encoder(nn.Module):
    def __init__(self, batch_first=True, norm_first=False, activation="relu", dropout=0.0, nested=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=dropout, activation=activation,
                                           batch_first=batch_first, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids, mask=None, padding=None):
        return self.head(self.encoder(self.embed(ids), mask=mask, src_key_padding_mask=padding))


class Seq2Seq(nn.Module):
    def __init__(self, batch_first=True, norm_first=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.transformer = nn.Transformer(D, HEADS, 2, 2, FF, dropout=0.0, batch_first=batch_first,
                                          norm_first=norm_first)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, src, tgt, tgt_mask=None, memory_padding=None):
        out = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=tgt_mask,
                               memory_key_padding_mask=memory_padding)
        return self.head(out)


def _ids(batch, length, batch_first=True):
    ids = torch.randint(0, VOCAB, (batch, length))
    return ids if batch_first else ids.t().contiguous()


def _padding(batch, length):
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[: batch // 2, -3:] = True
    return padding


def _trains_like_torch(model, args):
    """A plan that samples nothing: the training forward is torch's bit for bit, the gradients torch's (the
    projections see the samples in the module's own layout, so the weight gradients sum in another order)."""
    approx = fxapprox.approximate(model, 1.0, example_inputs=args, config=QUIET).train()
    model.train()
    out, expected = approx(*args), model(*args)
    assert torch.equal(out, expected)
    out.square().mean().backward()
    expected.square().mean().backward()
    grads = dict(approx.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, parameter.grad, msg=name, rtol=1e-4, atol=1e-6)
    model.zero_grad(set_to_none=True)
    return approx


def _evaluates_like_torch(approx, model, args):
    approx.eval(), model.eval()
    with torch.no_grad():   # torch's inference fast path
        assert torch.equal(approx(*args), model(*args))
    assert torch.equal(approx(*args), model(*args))
    approx.train(), model.train()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("masks", ["none", "causal", "padding", "both"])
def test_an_encoder_trains_and_evaluates_like_torch(batch_first, norm_first, masks):
    torch.manual_seed(0)
    model = Encoder(batch_first, norm_first, activation="gelu" if norm_first else "relu")
    ids = _ids(6, 12, batch_first)
    causal = nn.Transformer.generate_square_subsequent_mask(12) if masks in ("causal", "both") else None
    if masks == "both":   # boolean like the padding mask (torch deprecates mixing the two)
        causal = torch.ones(12, 12, dtype=torch.bool).triu(1)
    padding = _padding(6, 12) if masks in ("padding", "both") else None
    args = (ids, causal, padding)
    approx = _trains_like_torch(model, args)
    assert "encoder.layers.0" in approx.meta[TRACED_THROUGH_KEY]
    _evaluates_like_torch(approx, model, args)


class FunctionalDropout(Encoder):
    def forward(self, ids, mask=None, padding=None):
        hidden = nn.functional.dropout(self.embed(ids), 0.5, training=self.training)
        return self.head(self.encoder(hidden, mask=mask, src_key_padding_mask=padding))


def test_the_models_own_traced_training_flags_follow_eval():
    torch.manual_seed(0)
    model = FunctionalDropout()
    args = (_ids(6, 12), None, None)
    approx = fxapprox.approximate(model, BUDGET, example_inputs=args, config=QUIET)
    _evaluates_like_torch(approx, model, args)


def test_nested_tensor_fast_path_evaluates_bit_for_bit():
    torch.manual_seed(0)
    model = Encoder(nested=True, activation=nn.ReLU())   # a callable activation
    args = (_ids(6, 12), None, _padding(6, 12))
    approx = fxapprox.approximate(model, BUDGET, example_inputs=args, config=QUIET)
    assert approx.plan.approximated
    _evaluates_like_torch(approx, model, args)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_decoder_with_cross_attention_trains_and_evaluates_like_torch(batch_first, norm_first):
    torch.manual_seed(0)
    model = Seq2Seq(batch_first, norm_first)
    args = (_ids(4, 10, batch_first), _ids(4, 7, batch_first), nn.Transformer.generate_square_subsequent_mask(7),
            _padding(4, 10))
    approx = _trains_like_torch(model, args)
    through = approx.meta[TRACED_THROUGH_KEY]
    assert "transformer.decoder.layers.1.multihead_attn" in through and "transformer" in through
    _evaluates_like_torch(approx, model, args)


class Attention(nn.Module):
    """``nn.MultiheadAttention`` called directly: weights asked for, separate key/value sizes, cross-attention."""

    def __init__(self):
        super().__init__()
        self.query = nn.Linear(32, D)
        self.cross = nn.MultiheadAttention(D, HEADS, batch_first=True, kdim=48, vdim=40)
        self.self_attn = nn.MultiheadAttention(D, HEADS, bias=False)
        self.head = nn.Linear(D, 8)

    def forward(self, x, memory, padding):
        y, weights = self.cross(self.query(x), memory, memory[..., :40], key_padding_mask=padding)
        seq = y.transpose(0, 1)
        z, per_head = self.self_attn(seq, seq, seq, average_attn_weights=False)
        return self.head(z.transpose(0, 1)) + weights.sum() + per_head.mean()


def test_multihead_attention_called_directly_trains_and_evaluates_like_torch():
    torch.manual_seed(0)
    model = Attention()
    args = (torch.randn(4, 10, 32), torch.randn(4, 12, 48), torch.rand(4, 12) > 0.7)
    approx = _trains_like_torch(model, args)
    layers = {d.target for d in approx.plan.layers}
    assert {"cross.q_proj_weight (linear)", "cross.out_proj", "self_attn.in_proj_weight (linear)"} <= layers
    _evaluates_like_torch(approx, model, args)


def _step(approx, args):
    """One training step (a row plan's first step runs its variance check: not inside FlopCounterMode)."""
    approx.train()(*args).square().mean().backward()
    approx.zero_grad(set_to_none=True)


def _rows_of(approx):
    return {block.name for block in approx.plan.rows.blocks} if approx.plan.rows is not None else set()


@pytest.mark.parametrize("build", ["encoder", "transformer", "vit"])
def test_budget_is_spent_on_torch_transformers(build):
    """Budget 0.5 executes at most 0.55 of exact training FLOPs (FlopCounterMode over a step), attention's
    projections among the sampled layers; the state_dict keys are the original's and load back into it."""
    torch.manual_seed(0)
    if build == "encoder":
        model, args = Encoder(), (_ids(8, 16), None, None)
    elif build == "transformer":
        model, args = Seq2Seq(), (_ids(8, 12), _ids(8, 10), nn.Transformer.generate_square_subsequent_mask(10))
    else:   # torchvision's ViT (nn.MultiheadAttention inside its own blocks), small
        model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=HEADS,
                                                     hidden_dim=D, mlp_dim=FF, num_classes=10)
        args = (torch.randn(4, 3, 32, 32),)
    approx = fxapprox.approximate(model, BUDGET, example_inputs=args, config=QUIET)
    assert approx.plan.budget_met, approx.plan.note
    sampled = {d.target for d in approx.plan.approximated}
    assert any("in_proj_weight" in name or "out_proj" in name for name in sampled) \
        or any("layers" in block for block in _rows_of(approx)), approx.report
    _step(approx, args)
    assert executed_fraction(model.train(), approx, args) <= BUDGET + SLACK
    assert sorted(approx.state_dict()) == sorted(model.state_dict())
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(approx.state_dict())
    _evaluates_like_torch(approx, fresh, args)


@pytest.mark.slow
def test_vit_b_16_spends_the_budget():
    torch.manual_seed(0)
    model, x = torchvision.models.vit_b_16(image_size=32, num_classes=10), torch.randn(2, 3, 32, 32)
    approx = fxapprox.approximate(model, BUDGET, example_inputs=(x,), config=QUIET)
    assert approx.plan.budget_met, approx.plan.note
    assert executed_fraction(model.train(), approx, (x,)) <= BUDGET + SLACK
    _evaluates_like_torch(approx, model, (x,))


def test_encoder_layers_are_row_blocks_when_batch_first():
    """The row family samples whole encoder layers (the samples are every projection's first dimension when the
    module is batch-first); sequence-first layers mix the samples' positions and are refused, with the reason."""
    torch.manual_seed(0)
    # a causal (T, S) mask reaches each layer before its activations: the batch is still the activations' B
    args = (_ids(16, 12), nn.Transformer.generate_square_subsequent_mask(12), None)
    fine_tuning = fxapprox.ApproxConfig(max_forward_kl=1e-6, check_verbose=False, row_check_every=None)
    model = Encoder()
    approx = fxapprox.approximate(model, BUDGET, example_inputs=args, config=fine_tuning)
    assert _rows_of(approx) == {"encoder.layers.0", "encoder.layers.1"}, approx.plan.note
    _step(approx, args)
    assert executed_fraction(model.train(), approx, args) <= BUDGET + SLACK
    sequence_first = fxapprox.approximate(Encoder(batch_first=False), BUDGET, example_inputs=(_ids(16, 16, False),),
                                          config=fine_tuning)
    assert sequence_first.plan.rows is None
    assert "row sampling not used" in sequence_first.plan.note


def test_copies_pickles_and_loaded_weights_evaluate_exactly():
    torch.manual_seed(0)
    model = Seq2Seq()
    args = (_ids(4, 10), _ids(4, 7), nn.Transformer.generate_square_subsequent_mask(7), None)
    approx = fxapprox.approximate(model, BUDGET, example_inputs=args, config=QUIET)
    approx(*args).square().mean().backward()
    buffer = io.BytesIO()
    torch.save(approx, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(approx), torch.load(buffer, weights_only=False)):
        _evaluates_like_torch(copied, model, args)
        copied(*args).square().mean().backward()
        assert all(p.grad is not None for p in copied.parameters())
    moved = {name: value + 0.01 for name, value in model.state_dict().items()}
    model.load_state_dict(moved)
    approx.load_state_dict(moved, assign=True)   # new tensors: evaluation reads them
    _evaluates_like_torch(approx, model, args)
    seen = []
    handle = approx.register_forward_hook(lambda *_: seen.append(1))
    _evaluates_like_torch(approx, model, args)
    handle.remove()
    assert len(seen) == 2   # the model's hooks run in evaluation too


@pytest.mark.parametrize("method", [pytest.param("topk", marks=pytest.mark.slow), "crs",
                                    pytest.param("wta_crs", marks=pytest.mark.slow)])
def test_an_encoder_compiles_whole(method):
    """``torch.compile(fullgraph=True)`` trains it (crs: layers keep different random shares, a symbolic float
    under dynamo)."""
    torch.manual_seed(0)
    model = Encoder(dropout=0.1)
    args = (_ids(8, 12), None, _padding(8, 12))
    approx = fxapprox.approximate(model, BUDGET, example_inputs=args, method=method, config=QUIET)
    compiled = torch.compile(approx, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            approx.zero_grad()
            compiled(*args).square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in approx.parameters())


def test_autocast_trains_in_the_autocast_dtype():
    torch.manual_seed(0)
    model = Encoder()
    args = (_ids(8, 12), None, _padding(8, 12))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(*args).float().sum().backward()
    except RuntimeError as error:   # a CPU without bf16 kernels for these ops
        pytest.skip(f"torch's own encoder does not run under CPU bf16 autocast here: {error}")
    approx = fxapprox.approximate(model, BUDGET, example_inputs=args, config=QUIET)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = approx(*args)
        out.float().square().mean().backward()
    assert out.dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in approx.parameters())


class OwnForwardLayer(nn.TransformerEncoderLayer):
    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        return super().forward(src, src_mask, src_key_padding_mask, is_causal) * 2


def test_what_is_kept_whole_says_why():
    model = nn.Sequential(nn.Linear(D, D), OwnForwardLayer(D, HEADS, FF, batch_first=True))
    gm = trace(model, torch_transformers=True)
    assert "1" in {n.target for n in gm.graph.find_nodes(op="call_module")}
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(D, HEADS, add_bias_kv=True, batch_first=True)
    x = torch.randn(2, 5, D)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = attention

        def forward(self, x):
            return self.attention(x, x, x)[0]
    approx = fxapprox.approximate(Wrap(), BUDGET, example_inputs=(x,), config=QUIET)
    reasons = {d.target: d.reason for d in approx.plan.layers}
    assert "add_bias_kv" in reasons["attention"], reasons


def test_unbatched_input_in_training_says_what_to_do():
    torch.manual_seed(0)
    model = Attention()
    args = (torch.randn(4, 10, 32), torch.randn(4, 12, 48), torch.rand(4, 12) > 0.7)
    approx = fxapprox.approximate(model, 1.0, example_inputs=args, config=QUIET)
    with pytest.raises(ValueError, match="batched"):
        approx(torch.randn(10, 32), torch.randn(12, 48), torch.rand(12) > 0.7)


def test_a_memory_plan_reaches_attention_inside_torch_layers():
    """Attention is a traced ``scaled_dot_product_attention`` node on views of the projections, so a memory plan
    compresses (or rebuilds) what it saves: a low ``memory_budget`` is met, and evaluation stays torch's own."""
    torch.manual_seed(0)
    model = Encoder()
    args = (_ids(16, 32), nn.Transformer.generate_square_subsequent_mask(32), None)
    approx = fxapprox.approximate(model, 1.0, memory_budget=0.25, example_inputs=args, config=QUIET)
    # (the memory plan swaps it for attention_from_saved_inputs, which rebuilds its softmax in backward)
    attention = {n.target for n in approx.graph.nodes if n.op == "call_function"}
    assert {nn.functional.scaled_dot_product_attention, attention_from_saved_inputs} & attention
    assert approx.plan.memory.achieved <= 0.25 + 1e-9, approx.plan.memory.note
    approx(*args).square().mean().backward()
    stats = approx._fxapprox_state.saved_stats
    assert stats.stored_bytes <= 0.5 * stats.exact_bytes   # small values (under activation_min_bytes) stay
    _evaluates_like_torch(approx, model, args)
