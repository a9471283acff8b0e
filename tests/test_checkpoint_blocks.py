"""Checkpointed blocks in the memory plan: which blocks qualify, exact gradients, the model unchanged around them,
and the plan's choice between checkpointing and compressing."""

import copy
import dataclasses
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import fxapprox
import fxapprox.pipeline.memory_planning as memory_planning
from fxapprox import ApproxConfig
from fxapprox.passes.memory.blocks import find_blocks
from fxapprox.passes.memory.saved_values import saved_values
from fxapprox.plan import Plan


class Block(nn.Module):
    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    """Embedding, a list of residual blocks, a head: three checkpointable blocks."""

    def __init__(self, width: int = 32, depth: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, width)
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, 50)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _config(**kwargs):
    kwargs.setdefault("activation_compile", False)
    kwargs.setdefault("activation_min_bytes", 0)
    kwargs.setdefault("progress", False)
    kwargs.setdefault("check_every", None)
    return ApproxConfig(**kwargs)


@pytest.fixture
def cheap_recompute(monkeypatch):
    """Timings under which re-running a block costs nothing: the plan checkpoints every block it can."""
    measure = memory_planning.measure_memory_options

    def timings(*args, **kwargs):   # fixed, so the plan does not depend on how fast this machine packs
        measured = measure(*args, **kwargs)
        return dataclasses.replace(measured, recompute_seconds={name: 1e-9 for name in measured.recompute_seconds},
                                   step_seconds=1e-3, pack_seconds_per_byte={8: 1e-9, 4: 1e-9, 2: 1e-9})
    monkeypatch.setattr(memory_planning, "measure_memory_options", timings)
    monkeypatch.setattr(memory_planning, "measure_memory_step", lambda *args, **kwargs: 1.0)


@pytest.fixture
def tokens():
    torch.manual_seed(0)
    return torch.randint(0, 50, (4, 16))


def _loss(output):
    return output.float().square().mean()


def _grads(model, *inputs, seed: int = 0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    _loss(model(*inputs)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_same(expected: dict, got: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=rtol, atol=atol)


def _cosine(expected: dict, got: dict) -> float:
    return float(F.cosine_similarity(torch.cat([g.flatten() for g in expected.values()]),
                                     torch.cat([got[name].flatten() for name in expected]), dim=0))


def _analysed(model, *inputs):
    gm = torch.fx.symbolic_trace(model)
    fxapprox.analyse(gm, inputs)
    return gm


def test_blocks_are_the_items_of_containers(tokens):
    gm = _analysed(Stack(), tokens)
    values, _, _ = saved_values(gm)
    blocks = find_blocks(gm, values)
    assert [b.name for b in blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    # each block reads the residual stream the one before hands on, and frees what it saves inside
    assert blocks[1].inputs == blocks[0].outputs
    assert all(b.interior and b.interior_bytes > 0 and b.inputs_need_grad for b in blocks)
    assert not {"embed", "head"} & {n for b in blocks for n in b.nodes}


def test_resnet_blocks_hold_their_downsample():
    model = torchvision.models.resnet18(num_classes=10)
    gm = _analysed(model, torch.randn(2, 3, 32, 32))
    values, _, _ = saved_values(gm)
    blocks = find_blocks(gm, values)
    assert [b.name for b in blocks] == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    assert "layer2_0_downsample_0" in blocks[2].nodes


def test_checkpointed_blocks_train_with_exact_gradients(cheap_recompute, tokens):
    model = Stack()
    approx = fxapprox.approximate(copy.deepcopy(model), 1.0, memory_budget=0.5, example_inputs=(tokens,),
                                  config=_config())
    memory = approx.plan.memory
    assert [b.name for b in memory.checkpointed] == ["blocks.0", "blocks.1", "blocks.2"]
    assert not memory.compressed and memory.budget_met
    assert all(v.checkpointed_in for v in memory.values if v.node.startswith("blocks_"))
    _assert_same(_grads(model, tokens), _grads(approx, tokens))


def test_resnet_checkpointed_gradients_exact(cheap_recompute):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    approx = fxapprox.approximate(copy.deepcopy(model), 1.0, memory_budget=0.6, example_inputs=(x,),
                                  config=_config())
    memory = approx.plan.memory
    # lossless 1-bit ReLU masks aside, nothing is compressed
    assert memory.checkpointed and all(v.bits == 1 for v in memory.compressed) and memory.budget_met
    _assert_same(_grads(model, x), _grads(approx, x), rtol=1e-4, atol=1e-5)
    # the re-run in backward does not move the BatchNorms' running statistics a second time
    buffers = dict(approx.named_buffers())
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffers[name], buffer)


def test_dropout_inside_a_block_is_replayed(cheap_recompute, tokens):
    model = Stack(dropout=0.5)
    approx = fxapprox.approximate(copy.deepcopy(model), 1.0, memory_budget=0.5, example_inputs=(tokens,),
                                  config=_config())
    assert len(approx.plan.memory.checkpointed) == 3
    _assert_same(_grads(model, tokens, seed=3), _grads(approx, tokens, seed=3))


def test_compressed_block_inputs_go_through_the_reentrant_checkpoint(cheap_recompute, tokens):
    model = Stack(width=64)
    approx = fxapprox.approximate(copy.deepcopy(model), 1.0, memory_budget=0.36, example_inputs=(tokens,),
                                  config=_config())
    memory = approx.plan.memory
    compressed = {v.node for v in memory.compressed}
    inputs = {i for b in memory.checkpointed for i in b.inputs}
    assert compressed & inputs, memory.note
    # a checkpoint's input keeps at least 8 bits: the whole block is recomputed from its copy
    assert all(v.bits >= 8 for v in memory.compressed if v.node in inputs)
    expected, got = _grads(model, tokens), _grads(approx, tokens)
    assert all(b.inputs_copied for b in memory.checkpointed if set(b.inputs) & compressed)
    blocks = approx._fxapprox_state.checkpointed[1].blocks
    assert any(block.compressed_inputs for block in blocks.values())
    assert _cosine(expected, got) > 0.99


def test_model_around_the_blocks_is_unchanged(cheap_recompute, tokens):
    model = Stack()
    approx = fxapprox.approximate(copy.deepcopy(model), 1.0, memory_budget=0.5, example_inputs=(tokens,),
                                  config=_config())
    _grads(approx, tokens)
    assert approx.plan.memory.checkpointed
    assert list(approx.state_dict()) == list(model.state_dict())
    assert sorted(n for n, _ in approx.named_parameters()) == sorted(n for n, _ in model.named_parameters())
    model.load_state_dict(approx.state_dict())


def test_checkpoint_runs_only_in_a_compressing_training_forward(cheap_recompute, tokens, monkeypatch):
    import fxapprox.runtime.checkpointing as checkpointing

    calls = []
    real = checkpointing.checkpoint
    monkeypatch.setattr(checkpointing, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = Stack()
    approx = fxapprox.approximate(copy.deepcopy(model), 1.0, memory_budget=0.5, example_inputs=(tokens,),
                                  config=_config())
    _grads(approx, tokens)
    assert len(calls) == 3
    approx.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(tokens), model.eval()(tokens))
    approx.train()
    approx.set_approximate(False)
    calls.clear()
    _grads(approx, tokens)
    assert calls == []


def test_autograd_grad_works_when_no_block_input_is_compressed(cheap_recompute, tokens):
    approx = fxapprox.approximate(Stack(), 1.0, memory_budget=0.5, example_inputs=(tokens,), config=_config())
    memory = approx.plan.memory
    assert memory.checkpointed and not any(b.inputs_copied or b.recompute_bits for b in memory.checkpointed)
    parameters = list(approx.parameters())
    grads = torch.autograd.grad(_loss(approx(tokens)), parameters)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_copies_and_pickles_keep_checkpointing(cheap_recompute, tokens):
    approx = fxapprox.approximate(Stack(), 1.0, memory_budget=0.5, example_inputs=(tokens,), config=_config())
    expected = _grads(approx, tokens)
    for clone in (copy.deepcopy(approx), pickle.loads(pickle.dumps(approx))):
        assert clone.plan.memory.checkpointed == approx.plan.memory.checkpointed
        _assert_same(expected, _grads(clone, tokens))
    buffer = io.BytesIO()
    torch.save(approx, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._fxapprox_state.checkpointed is None   # rebuilt on the first step
    got = _grads(loaded, tokens)
    torch.testing.assert_close(got["head.weight"], expected["head.weight"])


def test_plan_and_report_show_the_blocks(cheap_recompute, tokens):
    approx = fxapprox.approximate(Stack(), 1.0, memory_budget=0.5, example_inputs=(tokens,), config=_config())
    plan = approx.plan
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.memory.predicted_time is not None and plan.memory.measured_time == 1.0
    text = approx.report.text(verbose=True)
    assert "blocks (checkpointed" in text and "in block" in text and "3 of 3 blocks checkpointed" in text


def test_replan_memory_plans_blocks_again(cheap_recompute, tokens):
    approx = fxapprox.approximate(Stack(), 1.0, memory_budget=0.5, example_inputs=(tokens,), config=_config())
    _grads(approx, tokens)
    before = approx._fxapprox_state.checkpointed
    plan = approx.replan_memory(tokens)
    assert len(plan.memory.checkpointed) == 3
    _grads(approx, tokens)
    assert approx._fxapprox_state.checkpointed is not before   # the graph was marked again: rebuilt


def test_activation_checkpoint_false_plans_values_only(cheap_recompute, tokens):
    approx = fxapprox.approximate(Stack(), 1.0, memory_budget=0.25, example_inputs=(tokens,),
                                  config=_config(activation_checkpoint=False))
    assert approx.plan.memory.blocks == () and approx.plan.memory.checkpointed == ()
    with pytest.raises(TypeError, match="activation_checkpoint"):
        ApproxConfig(activation_checkpoint="yes")


def test_expensive_blocks_stay_and_values_are_compressed(monkeypatch, tokens):
    """When re-running a block costs more than packing what it saves, the plan compresses instead."""
    measure = memory_planning.measure_memory_options

    def timings(*args, **kwargs):
        measured = measure(*args, **kwargs)
        return dataclasses.replace(measured, recompute_seconds={n: 10.0 for n in measured.recompute_seconds})
    monkeypatch.setattr(memory_planning, "measure_memory_options", timings)
    monkeypatch.setattr(memory_planning, "measure_memory_step", lambda *args, **kwargs: 1.1)
    approx = fxapprox.approximate(Stack(), 1.0, memory_budget=0.3, example_inputs=(tokens,), config=_config())
    memory = approx.plan.memory
    assert memory.blocks and not memory.checkpointed and memory.compressed and memory.budget_met


def test_plans_are_reproducible(tokens):
    """Measured timings go through the timing cache: the same model, batch and seed plan the same way."""
    def plan():
        torch.manual_seed(0)
        approx = fxapprox.approximate(Stack(), 1.0, memory_budget=0.2, example_inputs=(tokens,), config=_config())
        memory = approx.plan.memory
        return ([(v.node, v.bits, v.compressed, v.recomputed_from) for v in memory.values],
                [b.name for b in memory.checkpointed], memory.measured_time)
    assert plan() == plan()


def test_the_guard_checks_a_model_with_checkpointed_blocks(cheap_recompute, tokens):
    approx = fxapprox.approximate(Stack(), 1.0, memory_budget=0.2, example_inputs=(tokens,),
                                  config=_config(check_every=2))
    assert approx.plan.memory.checkpointed
    optimizer = torch.optim.SGD(approx.parameters(), lr=0.01)
    for _ in range(4):
        optimizer.zero_grad()
        _loss(approx(tokens)).backward()
        optimizer.step()
    assert len(approx.history) >= 1
    assert all(record.backward_error is not None and record.backward_error < 0.5 for record in approx.history)


def test_a_compressed_rerun_holds_copies_in_backward(cheap_recompute, tokens):
    """Below what checkpointing reaches — a re-run holding its block's values exact on top of what precedes it —
    the re-run keeps them as 8-bit copies."""
    model = Stack(width=64)
    approx = fxapprox.approximate(copy.deepcopy(model), 1.0, memory_budget=0.3, example_inputs=(tokens,),
                                  config=_config())
    memory = approx.plan.memory
    rerun = [b for b in memory.checkpointed if b.recompute_bits == 8]
    assert rerun and all(b.recompute_values for b in rerun), memory.note
    assert memory.budget_met and memory.recompute_bytes < max(b.interior_bytes for b in rerun)
    expected, got = _grads(model, tokens), _grads(approx, tokens)
    blocks = approx._fxapprox_state.checkpointed[1].blocks
    assert any(block.recompute_saving is not None for block in blocks.values())
    assert _cosine(expected, got) > 0.99
