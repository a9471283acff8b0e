"""Pass 2b — shapes: ``torch.fx.passes.shape_prop.ShapeProp`` on the example inputs.

Writes a :class:`~fxapprox.pipeline.records.TensorSummary` (``shape``: a list, or a list of lists for
multi-output nodes; ``dtype``) under ``node.meta[TENSOR_KEY]``; torch's own ``tensor_meta`` stays too.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from fxapprox.pipeline.records import TENSOR_KEY, TensorSummary


def _summarise(tensor_meta):
    if isinstance(tensor_meta, TensorMetadata):
        return list(tensor_meta.shape), str(tensor_meta.dtype).replace("torch.", "")
    if isinstance(tensor_meta, (tuple, list)):
        parts = [_summarise(item) for item in tensor_meta]
        return [p[0] for p in parts], next((p[1] for p in parts if p[1]), None)
    return None, None


def propagate_shapes(gm: torch.fx.GraphModule, *example_inputs) -> torch.fx.GraphModule:
    """Annotate every node with its output shape and dtype.

    Example::

        >>> propagate_shapes(gm, torch.randn(2, 3, 32, 32))
        >>> tensor_of(gm.graph.find_nodes(op="call_module", target="conv1")[0]).shape
        [2, 64, 16, 16]
    """
    ShapeProp(gm).propagate(*example_inputs)
    for node in gm.graph.nodes:
        shape, dtype = _summarise(node.meta.get("tensor_meta"))
        node.meta[TENSOR_KEY] = TensorSummary(shape, dtype)
    return gm
