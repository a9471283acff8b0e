"""Runtime of checkpointed blocks: a block of the graph that keeps nothing for backward and runs again there.

The memory rewrite (``fxapprox.passes.memory.rewrite_checkpoint``) moves a block's nodes — a transformer layer, a
ResNet bottleneck — into a :class:`CheckpointedBlock` submodule and calls it where they stood. While the model
trains inside a compressing forward (:mod:`fxapprox.runtime.saved_activations`) the call goes through
``torch.utils.checkpoint.checkpoint``: the forward keeps only the block's inputs, and backward re-runs the block to
rebuild what it needs. The gradients are the exact ones (the RNG state is replayed, so dropout and the sampled ops
draw what they drew). Outside a compressing forward (evaluation, ``no_grad``, ``set_approximate(False)``) the block
runs as plain code, like the memory plan's marker nodes.

A checkpoint keeps the block's inputs. Where the memory plan keeps one as a low-bit copy, the block runs the
reentrant form (``use_reentrant=True``), which keeps its inputs through autograd's saved tensors
(``save_for_backward``), where the compressing hooks pack them like any saved value; otherwise the non-reentrant
form, torch's recommended one, which holds them as they are and works with ``torch.autograd.grad`` (the reentrant
form supports ``backward()`` only). When no tensor it is passed requires a gradient (a block fed straight from
the data, whose parameters all come through its modules), the reentrant form would leave the block's parameters
without gradients, so the non-reentrant form runs. Either way the re-run leaves a BatchNorm's running statistics
as the forward left them (they would otherwise move twice a step).

A block whose re-run the plan compresses (``recompute_saving``) runs the reentrant form too: backward re-runs it
inside a compressing session of its own, so the values its backward needs are kept as low-bit copies while it
runs — what the block holds at its backward's peak shrinks like the rest of the plan (the memory markers for
its values are part of its graph, and do nothing in the forward, where it saves nothing).

The submodule owns no parameters: the modules and parameters the block uses are passed in as arguments, so
``state_dict`` keys, ``named_parameters`` and the optimizer see the model as before.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from fxapprox.ops.training_context import current, training_context
from fxapprox.runtime.saved_activations import compressing_saved_tensors

__all__ = ["CheckpointedBlock", "RegionCheckpoint", "call_module"]

#: the parameters a block uses arrive as arguments and are never tagged: nothing to exclude by storage
_NO_STATE = nn.Module()


@contextlib.contextmanager
def _running_statistics_kept(modules: list[nn.Module]):
    """A re-run must not move a BatchNorm's running statistics a second time. Not by restoring them after (autograd
    checks they are not written after the op that read them): momentum 0 keeps them as they are; only the batch
    count is put back."""
    norms = [(m, m.momentum, m.num_batches_tracked.clone()) for m in modules
             if isinstance(m, _BatchNorm) and m.track_running_stats and m.training]
    for norm, _, _ in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        for norm, momentum, count in norms:
            norm.momentum = momentum
            with torch.no_grad():
                norm.num_batches_tracked.copy_(count)


def _replay(context) -> dict:
    """Backward re-runs a block outside the forward's context: the step's view of it (a guarded step draws from a
    fork of the RNG), less the compressor (the block's own tensors are not saved)."""
    replay = {field.name: getattr(context, field.name) for field in dataclasses.fields(context)}
    replay["compressor"] = None
    return replay


def call_module(module: nn.Module, *args, **kwargs):
    """What a block's ``call_module`` node becomes inside :class:`CheckpointedBlock`: the module is an input."""
    return module(*args, **kwargs)


class CheckpointedBlock(nn.Module):
    """A block of the graph run under ``torch.utils.checkpoint`` in a compressing training forward.

    ``graph`` takes the block's modules and parameters first, then its activations (``inputs`` names them, for the
    report), and returns the block's outputs as a tuple. ``block`` is the module path the block came from.
    """

    def __init__(self, graph: torch.fx.Graph, block: str, compressed_inputs: bool = False,
                 recompute_saving=None) -> None:
        super().__init__()
        self.block = block
        self.compressed_inputs = compressed_inputs
        self.recompute_saving = recompute_saving   # fxapprox.runtime.saved_activations.SavingOptions, or None
        # A GraphModule over an empty root: it owns nothing, every module and parameter arrives as an argument.
        self.code = torch.fx.GraphModule(nn.Module(), graph, class_name="Block")

    def forward(self, *inputs):
        context = current()
        if context.compressor is None or not torch.is_grad_enabled():
            return self.code(*inputs)
        replay = _replay(context)
        reentrant = (self.compressed_inputs or self.recompute_saving is not None) and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
        compress_rerun = reentrant and self.recompute_saving is not None
        calls = []

        def run(*args):
            rerun = bool(calls)
            calls.append(1)
            with _running_statistics_kept([m for m in args if isinstance(m, nn.Module)] if rerun else []), \
                    training_context(**replay):
                if compress_rerun and torch.is_grad_enabled():   # the re-run in backward (reentrant)
                    with compressing_saved_tensors(self.recompute_saving, _NO_STATE):
                        return self.code(*args)
                return self.code(*args)

        return checkpoint(run, *inputs, use_reentrant=reentrant, preserve_rng_state=True)

    def extra_repr(self) -> str:
        return (f"block={self.block!r}, compressed_inputs={self.compressed_inputs}, "
                f"compressed_rerun={self.recompute_saving is not None}")


class RegionCheckpoint:
    """The ``forward`` of a checkpointed block of a region-captured model (``fxapprox.passes.memory.region_blocks``),
    set on its module as an instance attribute (its class, parameters and ``state_dict`` keys are untouched).

    In a compressing training forward it runs the module's own forward under the reentrant
    ``torch.utils.checkpoint``: the forward runs without saving anything (the plan's markers still tag what they
    mark, so the block's inputs are kept through the compressing hooks at their planned width), and backward
    re-runs it exactly. Elsewhere it is the module's forward. The tensors it is called with that require a
    gradient are the checkpoint's inputs; the other arguments (masks, rotary tables) are held as they are.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        module = self.module
        forward = type(module).forward
        context = current()
        if context.compressor is None or not torch.is_grad_enabled():
            return forward(module, *args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        slots = [i for i, value in enumerate(flat) if isinstance(value, torch.Tensor) and value.requires_grad]
        if not slots:
            return forward(module, *args, **kwargs)
        replay = _replay(context)
        calls, structure = [], []

        def run(*tensors):
            rerun = bool(calls)
            calls.append(1)
            values = list(flat)
            for slot, tensor in zip(slots, tensors):
                values[slot] = tensor
            call_args, call_kwargs = tree_unflatten(values, spec)
            if not rerun:   # the forward (no grad): the markers tag the block's inputs for the checkpoint's save
                output = forward(module, *call_args, **call_kwargs)
            else:
                with _running_statistics_kept(list(module.modules())), training_context(**replay):
                    output = forward(module, *call_args, **call_kwargs)
            # the checkpoint hands on gradients through tensors it returns: a dict or a ModelOutput goes flat
            leaves, output_spec = tree_flatten(output)
            structure[:] = [output_spec]
            return tuple(leaves)

        # What the checkpoint saves (its inputs) is this block's, at the widths the plan gave them: not copies of
        # the eager code around it.
        context.compressor.enter_eager(None, 0, self)
        try:
            leaves = checkpoint(run, *(flat[slot] for slot in slots), use_reentrant=True, preserve_rng_state=True)
        finally:
            context.compressor.exit_eager(self)
        return tree_unflatten(list(leaves), structure[0])
