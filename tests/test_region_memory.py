"""Saved-activation plans (``memory_budget``, ``activation_bits``) of hierarchically captured models.

Traced regions are marked like a traced model; inputs of swapped leaves in eager code are marked by a forward
pre-hook; what eager code saves is counted over a real step, and kept exact or as 8-bit copies when the budget needs
them. The plan's totals must be what a real step keeps.
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
    # values only unless a test asks for blocks: whether a block is checkpointed depends on this machine's timings
    changes.setdefault("activation_checkpoint", False)
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
    assert memory is not None and memory.eager_bytes > 0 and "saved by eager code, kept " in memory.note
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


def test_eager_code_saves_are_copied_only_when_the_budget_needs_them():
    torch.manual_seed(0)
    model = EagerRoot().train()
    inputs = {"x": torch.randn(32, 16)}
    loss = lambda out: out.square().mean()   # noqa: E731
    loose = fxapprox.approximate(model, 1.0, memory_budget=0.6, example_inputs=inputs, config=config())
    assert loose.plan.memory.eager_copy_bits is None and "kept exact" in loose.plan.memory.note
    assert loose.plan.memory.eager_planned_bytes == loose.plan.memory.eager_bytes
    tight = fxapprox.approximate(model, 1.0, memory_budget=0.15, example_inputs=inputs, config=config())
    memory = tight.plan.memory
    assert memory.eager_copy_bits == 8 and memory.eager_planned_bytes < memory.eager_bytes / 3
    assert memory.budget_met, memory.note
    check_plan_against_a_step(tight, model, inputs, loss)
    # without the copies of what the root's own code saves (the SiLU's input and sigmoid), 0.15 is out of reach
    without = memory.total_planned_bytes - memory.eager_planned_bytes + memory.eager_bytes
    assert without > 0.15 * memory.total_exact_bytes
    expected = gradients(model, inputs, loss)
    got = gradients(tight, inputs, loss)
    for name, grad in expected.items():
        assert torch.linalg.vector_norm(got[name] - grad) <= 0.2 * torch.linalg.vector_norm(grad), name


def test_which_eager_saves_may_be_copied():
    from fxapprox.runtime.saved_tensors import eager_copy_eligible

    x = torch.randn(64, 64, requires_grad=True)
    assert eager_copy_eligible(x * 2, 0)
    assert not eager_copy_eligible((x * 2).int(), 0)                       # not floating point
    assert not eager_copy_eligible(x.detach() * 2, 0)                       # not in the autograd graph (a table)
    assert not eager_copy_eligible(torch.log_softmax(x, -1), 0)             # exponentiated in backward
    assert not eager_copy_eligible(torch.softmax(x, -1), 0)
    assert not eager_copy_eligible(x * 2, 64 * 64 * 4 + 1)                 # below activation_min_bytes


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
@pytest.mark.parametrize("memory_budget", [0.25, 0.0625])
def test_hf_models_get_a_memory_plan_that_a_real_step_keeps(name, memory_budget):
    from tests.test_hf_capture import build

    model, inputs = build(name)
    approx = fxapprox.approximate(model, 1.0, memory_budget=memory_budget, example_inputs=inputs, config=config())
    check_plan_against_a_step(approx, model, inputs, lambda out: out.loss)
    if memory_budget >= 0.25:   # the tiny models' own code saves too large a share for less
        assert approx.plan.memory.budget_met, approx.plan.memory.note
    assert any(v.compressed and v.node.endswith("_input0") for v in approx.plan.memory.values)   # leaf inputs
    assert "saved by eager code" in str(approx.report)
    approx.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(**inputs).logits, model.eval()(**inputs).logits)


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="hierarchical capture of HF models "
                    "is tested on transformers 5")
def test_a_budget_below_what_eager_code_saves_is_met_on_a_hugging_face_llama():
    """What eager code saves (attention's inputs: rotated q and k, v) is ~10% of a Llama's exact bytes: below that
    it must be kept as copies too (examples/llama_lm.py's model; benchmarks/bench_memory_frontier.py meets 0.0625 on
    its batch)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)).train()
    ids = torch.randint(0, 96, (2, 64))   # examples/llama_lm.py's model, on fewer tokens
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    approx = fxapprox.approximate(model, 1.0, memory_budget=0.08, example_inputs=inputs,
                                  config=fxapprox.ApproxConfig(check_every=None, progress=False,
                                                               activation_checkpoint=False))
    memory = approx.plan.memory
    assert memory.budget_met and memory.eager_copy_bits == 8, memory.note
    assert memory.eager_bytes > 0.08 * memory.total_exact_bytes   # out of reach with them as they are
    check_plan_against_a_step(approx, model, inputs, lambda out: out.loss)


@pytest.fixture
def free_recompute(monkeypatch):
    """Timings under which re-running a region block costs nothing and packing is dear: the plan checkpoints
    blocks rather than compressing values."""
    from fxapprox.pipeline import eager

    monkeypatch.setattr(eager, "region_recompute_seconds",
                        lambda model, blocks, *args: {block.name: 1e-9 for block in blocks})
    monkeypatch.setattr(eager, "pack_timings", lambda *args: {8: 1.0, 4: 1.0, 2: 1.0})
    monkeypatch.setattr(eager, "cached_step_seconds", lambda *args: 1e-3)


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="hierarchical capture of HF models "
                    "is tested on transformers 5")
def test_a_region_captured_model_checkpoints_its_decoder_layers(free_recompute):
    """A decoder layer runs its own code eagerly (its norms and MLP traced, its projections swapped, its attention
    eager): checkpointing it frees all of that, re-run exactly in backward."""
    from tests.test_hf_capture import build

    model, inputs = build("llama")
    inputs = {**inputs, "use_cache": False}
    approx = fxapprox.approximate(model, 1.0, memory_budget=0.6, example_inputs=inputs,
                                  config=config(activation_checkpoint=True))
    memory = approx.plan.memory
    assert [b.name for b in memory.blocks] == ["model.layers.0", "model.layers.1"]
    assert memory.checkpointed and memory.budget_met and not memory.compressed, memory.note
    freed = memory.checkpointed[0]
    assert "frees" in freed.reason and "saved by its eager code" in freed.reason
    expected = gradients(model, inputs, lambda out: out.loss)
    got = gradients(approx, inputs, lambda out: out.loss)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6)
    assert approx.saved_activation_stats.stored_bytes <= memory.total_planned_bytes
    assert approx.saved_activation_stats.stored_bytes < 0.6 * memory.total_exact_bytes
    for clone in (copy.deepcopy(approx), torch.load(_saved(approx), weights_only=False)):
        cloned = gradients(clone, inputs, lambda out: out.loss)
        for name, grad in expected.items():
            torch.testing.assert_close(cloned[name], grad, rtol=1e-5, atol=1e-6)
    approx.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(**inputs).logits, model.eval()(**inputs).logits)


def _saved(module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return buffer

