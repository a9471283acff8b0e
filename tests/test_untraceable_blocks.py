"""A model whose root traces but whose blocks do not: the blocks' layers are in the plan and the budget is spent.

Three common ways a block defeats torch.fx — unpacking a generator over a proxy (a usual way to write attention),
data-dependent control flow, and a library function called on a traced size — each in a 4-block character LM.
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox.passes.capture.trace import trace
from tests.test_budget_contract import BUDGET, SLACK, executed_fraction

D, HEADS, VOCAB, T = 64, 4, 64, 32


class UnpackingBlock(nn.Module):
    """A pre-LN transformer block whose attention unpacks ``q, k, v = (… for z in ….split(d))``: a generator over
    a proxy does not trace."""

    def __init__(self, d: int = D, heads: int = HEADS):
        super().__init__()
        self.d, self.heads = d, heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x):
        B, L, C = x.shape
        q, k, v = (z.reshape(B, L, self.heads, C // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(self.d, dim=2))
        x = x + self.proj(self.attend(q, k, v).transpose(1, 2).reshape(B, L, C))
        return x + self.mlp(self.ln2(x))


class BranchingBlock(UnpackingBlock):
    """Data-dependent control flow: ``if x.sum() > 0``."""

    def forward(self, x):
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attended = self.proj(self.attend(q, k, v).transpose(1, 2).reshape(B, L, C))
        if attended.sum() > 0:
            x = x + attended
        else:
            x = x - attended
        return x + self.mlp(self.ln2(x))


class LibraryBlock(UnpackingBlock):
    """A library function called on a traced size: ``np.sqrt(q.shape[-1])``."""

    def attend(self, q, k, v):
        scale = 1.0 / np.sqrt(q.shape[-1])
        scores = (q @ k.transpose(-2, -1)) * scale
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


class CharLM(nn.Module):
    """A character LM whose root traces and whose blocks (``block``) do not."""

    def __init__(self, block: type[nn.Module], blocks: int = 4, d: int = D, heads: int = HEADS, vocab: int = VOCAB,
                 context: int = T):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.position = nn.Parameter(torch.zeros(context, d))
        self.blocks = nn.ModuleList(block(d, heads) for _ in range(blocks))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


BLOCKS = [UnpackingBlock, BranchingBlock, LibraryBlock]


def _model_and_batch(block):
    torch.manual_seed(0)
    model = CharLM(block)
    with torch.no_grad():
        model.position.normal_(std=0.02)
    return model, torch.randint(0, VOCAB, (16, T))


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.__name__)
def test_untraceable_blocks_are_captured_and_the_budget_is_spent(block):
    model, ids = _model_and_batch(block)
    with pytest.raises(fxapprox.TraceError):   # the premise: torch.fx cannot trace the block
        trace(model.blocks[0], strict=True)
    approx = fxapprox.approximate(model, BUDGET, example_inputs=(ids,))
    plan = approx.plan
    assert plan.budget_met and plan.achieved <= BUDGET + 1e-9, plan.note
    assert executed_fraction(model.train(), approx, (ids,)) <= BUDGET + SLACK
    assert [u["module"] for u in plan.untraced] == [f"blocks.{i}" for i in range(4)]
    sampled = {d.target for d in plan.layers if d.approximate}   # by module path: node names differ per capture
    inside = {f"blocks.{i}.{name}" for i in range(4) for name in ("qkv", "proj", "mlp.0", "mlp.2")}
    assert len(sampled & inside) >= 8, sampled   # the blocks' own layers carry the budget
    report = " ".join(str(approx.report).split())   # the rows wrap at 120 columns
    assert f"could not trace 'blocks.0', 'blocks.1', 'blocks.2' and 1 more ({block.__name__})" in report
    assert "test_untraceable_blocks.py" in report   # the source line that broke tracing

    assert list(approx.state_dict()) == list(model.state_dict())
    copied = copy.deepcopy(approx)
    buffer = io.BytesIO()
    torch.save(approx, buffer)   # pickles the module
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    model.eval()
    with torch.no_grad():
        expected = model(ids)
        for candidate in (approx, copied, loaded):
            candidate.eval()
            torch.testing.assert_close(candidate(ids), expected)
    for candidate in (copied, loaded):   # the copies train approximately too
        candidate.train()
        torch.nn.functional.cross_entropy(candidate(ids).flatten(0, 1), ids.flatten()).backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in candidate.parameters())


def test_the_lm_head_is_the_output_layer_and_pays_for_a_forward_error():
    """In the region-captured model only the head is an output layer: its forward error is not averaged away."""
    from fxapprox.passes.measurement.error_model import output_layers

    model, ids = _model_and_batch(UnpackingBlock)
    approx = fxapprox.approximate(model, BUDGET, example_inputs=(ids,))
    planning = approx._fxapprox_state.planning
    layers = {d.node for d in approx.plan.layers if d.op_kind}
    assert output_layers(planning) & layers == {"head"}
    head = approx.plan.decision("head")
    assert not (head.approximate and head.mode == "forward"), head.reason


def test_plans_of_a_model_captured_region_by_region_are_reproducible(tmp_path):
    config = fxapprox.ApproxConfig(timing_cache=str(tmp_path))
    plans = []
    for _ in range(3):
        model, ids = _model_and_batch(UnpackingBlock)
        plans.append(fxapprox.approximate(model, BUDGET, example_inputs=(ids,), config=config).plan)
    assert len({p.fingerprint() for p in plans}) == 1
    assert plans[0].layers == plans[2].layers


def test_leaf_modules_keep_an_untraceable_block_whole_and_strict_trace_raises():
    model, ids = _model_and_batch(UnpackingBlock)
    config = fxapprox.ApproxConfig(leaf_modules=tuple(f"blocks.{i}" for i in range(4)))
    approx = fxapprox.approximate(model, BUDGET, example_inputs=(ids,), config=config)
    assert isinstance(approx, fxapprox.ApproxGraphModule) and not approx.plan.regions
    assert not any(d.approximate for d in approx.plan.layers if d.node.startswith("blocks"))
    with pytest.raises(fxapprox.TraceError) as info:
        fxapprox.approximate(model, BUDGET, config=fxapprox.ApproxConfig(strict_trace=True))
    assert info.value.module_path == "blocks.0"


def test_a_library_no_trace_block_holding_layers_is_captured():
    """timm registers blocks it asks torch.fx not to trace into (NF-Net's NormFreeBlock, MobileViT's block): kept
    as opaque leaves they would keep their layers out of the plan."""
    timm_fx = pytest.importorskip("timm.layers._fx")

    class RegisteredBlock(UnpackingBlock):
        def forward(self, x):   # traces: once captured, each block is a traced region
            B, L, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).reshape(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
            x = x + self.proj(self.attend(q, k, v).transpose(1, 2).reshape(B, L, C))
            return x + self.mlp(self.ln2(x))

    timm_fx.register_notrace_module(RegisteredBlock)
    try:
        model, ids = _model_and_batch(RegisteredBlock)
        approx = fxapprox.approximate(model, BUDGET, example_inputs=(ids,),
                                      config=fxapprox.ApproxConfig(policy="flops"))
    finally:
        timm_fx._leaf_modules.discard(RegisteredBlock)
    from fxapprox.passes.capture.regions import LIBRARY_LEAF

    untraced = {u["module"]: u["reason"] for u in approx.plan.untraced}
    assert set(untraced) == {f"blocks.{i}" for i in range(4)} and set(untraced.values()) == {LIBRARY_LEAF}
    assert {r["path"]: r["kind"] for r in approx.plan.regions}["blocks.0"] == "traced"
    assert approx.plan.budget_met and sum(d.approximate for d in approx.plan.layers) >= 16
    assert "torch.fx did not trace 'blocks.0'" in " ".join(str(approx.report).split())
    model.eval(), approx.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(ids), model(ids))
