"""Saved-activation plans (``memory_budget``, ``activation_bits``) of hierarchically captured models.

Traced regions are marked like a traced model; inputs of swapped leaves in eager code are marked by a forward
pre-hook; what eager code saves is counted over a real step and kept exact. The plan's totals must be what a real
step keeps.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fxapprox
from fxapprox.passes.measurement.error_model import propagation_weights
from fxapprox.pipeline.records import UPSTREAM_OUTSIDE_KEY
from fxapprox.runtime.saved_activations import count_saved_bytes


class EagerRoot(nn.Module):
    """Data-dependent control flow and saving work (a SiLU) in the root's own code, around a traced block and a
    Linear that eager code calls."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        x = self.block(x)
        if x.sum() > 0:   # not traceable
            x = x * 2
        return self.head(x * torch.sigmoid(x))


def config(**changes):
    return fxapprox.ApproxConfig(check_every=None, activation_min_bytes=0, **changes)


def exact_saved_bytes(model, inputs: dict) -> int:
    with count_saved_bytes(model) as counter:
        model(**inputs)
    return counter.bytes


def gradients(model, inputs: dict, loss) -> dict:
    model.zero_grad()
    loss(model(**inputs)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def check_plan_against_a_step(approx, original, inputs: dict, loss) -> None:
    """The plan's exact total is what the original saves; its planned total is what the runtime keeps."""
    memory = approx.plan.memory
    assert memory is not None and memory.eager_bytes > 0 and "saved by eager code, kept exact" in memory.note
    assert memory.total_exact_bytes == exact_saved_bytes(original, inputs)
    loss(approx(**inputs)).backward()
    assert approx.saved_activation_stats.stored_bytes == memory.total_planned_bytes
    assert all(torch.isfinite(p.grad).all() for p in approx.parameters() if p.grad is not None)


def test_a_root_that_cannot_be_traced_gets_a_memory_plan():
    torch.manual_seed(0)
    model = EagerRoot().train()
    inputs = {"x": torch.randn(32, 16)}
    approx = fxapprox.approximate(model, 1.0, memory_budget=0.3, example_inputs=inputs, config=config())
    assert {r["path"]: r["kind"] for r in approx.plan.regions} == {"": "eager", "block": "traced", "head": "leaf"}
    check_plan_against_a_step(approx, model, inputs, lambda out: out.square().mean())
    assert approx.plan.memory.budget_met and approx.plan.memory.achieved <= 0.3
    approx.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(**inputs), model.eval()(**inputs))


def test_uniform_bits_mark_the_inputs_of_swapped_leaves_and_32_bits_are_exact():
    torch.manual_seed(0)
    model = EagerRoot().train()
    inputs = {"x": torch.randn(32, 16)}
    loss = lambda out: out.square().mean()   # noqa: E731
    expected = gradients(model, inputs, loss)
    at_4 = fxapprox.approximate(model, 1.0, example_inputs=inputs, config=config(activation_bits=4))
    # the head runs inside the root's eager code: its input is marked by a pre-hook, not a graph node
    assert at_4.head._fxapprox_input_marks.marks == [(0, 4, False)]
    head_input = next(v for v in at_4.plan.memory.values if v.node == "head_input0")
    assert head_input.compressed and head_input.bits == 4
    check_plan_against_a_step(at_4, model, inputs, loss)
    at_32 = fxapprox.approximate(model, 1.0, example_inputs=inputs, config=config(activation_bits=32))
    got = gradients(at_32, inputs, loss)   # every eligible value through the hooks, at full width
    assert at_32.head._fxapprox_input_marks.marks == [(0, 32, False)]
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad)


def test_a_region_captured_memory_plan_survives_copy_and_pickle():
    torch.manual_seed(0)
    model = EagerRoot().train()
    inputs = {"x": torch.randn(32, 16)}
    approx = fxapprox.approximate(model, 1.0, example_inputs=inputs, config=config(activation_bits=4))
    buffer = io.BytesIO()
    torch.save(approx, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(approx), torch.load(buffer, weights_only=False)):
        assert clone.plan.to_dict() == approx.plan.to_dict()
        clone(**inputs).square().mean().backward()
        assert clone.saved_activation_stats.stored_bytes == approx.plan.memory.total_planned_bytes


def test_activation_replanning_is_refused_on_a_region_captured_model():
    with pytest.raises(NotImplementedError, match="activation_replan_every"):
        fxapprox.approximate(EagerRoot(), 1.0, memory_budget=0.5, config=config(activation_replan_every=10))


def test_a_stitched_region_input_counts_as_an_upstream_owner():
    """A region's input that requires grad was produced by code with parameters outside the planning graph:
    the input-gradient error of the layer reading it is counted (weight 1), as for a layer inside the graph."""
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4)))
    linear = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert propagation_weights(gm, [linear])[0][linear.name] == 0.0   # the model's own input: nothing upstream
    next(iter(gm.graph.find_nodes(op="placeholder"))).meta[UPSTREAM_OUTSIDE_KEY] = True
    assert propagation_weights(gm, [linear])[0][linear.name] == 1.0


transformers = pytest.importorskip("transformers")


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="hierarchical capture of HF models "
                    "is tested on transformers 5")
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hf_models_get_a_memory_plan_that_a_real_step_keeps(name):
    from tests.test_hf_capture import build

    model, inputs = build(name)
    approx = fxapprox.approximate(model, 1.0, memory_budget=0.25, example_inputs=inputs, config=config())
    check_plan_against_a_step(approx, model, inputs, lambda out: out.loss)
    assert any(v.compressed and v.node.endswith("_input0") for v in approx.plan.memory.values)   # leaf inputs
    assert "saved by eager code" in str(approx.report)
    approx.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(**inputs).logits, model.eval()(**inputs).logits)
