"""The analysis passes run together, without side effects on the module they measure."""

from __future__ import annotations

import contextlib

import torch
import torch.fx

from fxapprox.passes.analysis.channels import annotate_channels
from fxapprox.passes.analysis.flops import count_flops
from fxapprox.passes.analysis.saved_bytes import measure_saved_bytes
from fxapprox.passes.analysis.shape_prop import propagate_shapes

__all__ = ["analyse", "measurement_sandbox"]


@contextlib.contextmanager
def measurement_sandbox(gm: torch.fx.GraphModule):
    """Run analysis without side effects: buffers (BN stats), RNG and mode are restored."""
    buffers = {name: buffer.detach().clone() for name, buffer in gm.named_buffers()}
    modes = {module: module.training for module in gm.modules()}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        gm.train()
        try:
            yield
        finally:
            for module, mode in modes.items():
                module.training = mode
            with torch.no_grad():
                for name, buffer in gm.named_buffers():
                    buffer.copy_(buffers[name])


def analyse(gm: torch.fx.GraphModule, example_inputs: tuple, progress: bool = False) -> torch.fx.GraphModule:
    """Run every analysis pass on ``gm`` (shapes, FLOPs, saved bytes, channels)."""
    with measurement_sandbox(gm):
        # The FLOP pass runs first: it reports a model that fails on these inputs
        # as an AnalysisError naming the node (ShapeProp would print a traceback).
        count_flops(gm, *example_inputs, progress=progress)
        propagate_shapes(gm, *example_inputs)
        measure_saved_bytes(gm, *example_inputs, progress=progress)
    annotate_channels(gm)
    return gm

