"""Stitch a hierarchically captured model's regions into one planning graph, and put the planned regions back.

The planning passes (FLOPs, shapes, candidates, measurement, the policies, the rewrite) work on one
``GraphModule``. :func:`stitch` builds one from a :class:`~fxapprox.passes.capture.regions.Capture`: every traced
region's graph is inlined (node names and module targets prefixed by the region's path), every swapped leaf is
one ``call_module`` node at its path, each fed with what it received on the capture forward; every eager module
is one :class:`EagerCode` node whose FLOPs are those :mod:`fxapprox.passes.capture.eager_flops` counted over a real
step, so the budget stays a fraction of the whole model. The regions are not connected to each other in this
graph (the eager code between them is not traced): the analyses' backward gives each region's outputs the
gradient they received in a real step of the whole model (recorded with the inputs, :func:`stitched_loss`), so
the measured policy measures every layer under its real upstream gradient, as in a traced model.

After the rewrite, :func:`install_regions` splits the graph back: each traced region becomes a ``GraphModule``
put in place of its module in the model, each rewritten leaf is injected by name.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten

from fxapprox.passes.capture.regions import Capture, RegionInputs, bind_placeholders
from fxapprox.pipeline._projection import projection_direction
from fxapprox.pipeline.records import (DOWNSTREAM_OUTSIDE_KEY, EAGER_REASON_KEY, OUTSIDE_MODEL_KEY, SAME_TENSOR_KEY,
                                       UPSTREAM_OUTSIDE_KEY)
from fxapprox.runtime.graph_pickle import RecordedGraphModule
from fxapprox.runtime.saved_markers import compress_saved

__all__ = ["EagerCode", "REGION_KEY", "install_regions", "stitch", "stitched_loss", "tensor_identity"]

#: ``node.meta`` key: the path of the region a stitched node belongs to
REGION_KEY = "fxapprox_region"


class EagerCode:
    """Stands for an eager module's own code in the planning graph (exact; its FLOPs are set by the caller)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.__name__ = self.__qualname__ = f"eager {path or '<root>'}"
        self.__module__ = ""

    def __call__(self) -> None:
        return None

    def __reduce__(self):
        return (EagerCode, (self.path,))


def stitched_loss(*outputs_and_gradients) -> torch.Tensor:
    """``Σ output · upstream gradient`` over every region: pairs ``(region output, gradients)``, the gradients one
    per flattened output (what it received in the capture step; ``None``: a fixed random direction). Its gradient
    at each region's output is the one that output gets in the real model."""
    total = None
    for pair in range(0, len(outputs_and_gradients), 2):
        outputs, gradients = outputs_and_gradients[pair], outputs_and_gradients[pair + 1]
        for index, tensor in enumerate(tree_flatten(outputs)[0]):
            if not (isinstance(tensor, torch.Tensor) and tensor.requires_grad and tensor.is_floating_point()):
                continue
            gradient = gradients[index] if index < len(gradients) else None
            if gradient is None:
                gradient = projection_direction(tensor, seed=index)
            term = (tensor.float() * gradient.float()).sum()
            total = term if total is None else total + term
    return total if total is not None else torch.zeros(())


def _safe(path: str) -> str:
    return path.replace(".", "_") or "root"


def tensor_identity(value) -> tuple | None:
    """What makes two recorded inputs the same tensor (each recorded input is its own detached view)."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    return value.data_ptr(), tuple(value.shape), value.stride(), value.dtype, value.requires_grad


def _input(graph: torch.fx.Graph, name: str, value, path: str, firsts: dict[tuple, torch.fx.Node]) -> torch.fx.Node:
    """A placeholder for what region ``path`` received: marked when its gradient flows on outside the graph, and
    as the same tensor as an earlier region's input (a layer norm's output that an MLP region and an attention
    projection both read): the memory policy sees one value, saved once."""
    made = graph.placeholder(name)
    made.meta[REGION_KEY] = path
    if isinstance(value, torch.Tensor) and value.requires_grad:
        made.meta[UPSTREAM_OUTSIDE_KEY] = True
    key = tensor_identity(value)
    if key is not None:
        if key in firsts:
            made.meta[SAME_TENSOR_KEY] = firsts[key].name
        else:
            firsts[key] = made
    return made


def _gradients(graph: torch.fx.Graph, prefix: str, received: RegionInputs, values: list) -> torch.fx.Node:
    node = graph.placeholder(f"{prefix}_upstream_gradient")
    values.append(tuple(received.output_grads))
    return node


def _feeds_output(path: str, inputs: dict[str, RegionInputs]) -> bool:
    """Whether the region at ``path`` holds one of the model's output layers (:func:`~fxapprox.passes.capture.regions.
    output_modules`)."""
    return any(record.feeds_output for where, record in inputs.items()
               if where == path or where.startswith(path + "."))


def _mark_read_on(output, path: str, inputs: dict[str, RegionInputs]) -> None:
    """Mark a region's output nodes that the model's code reads on (the region is not the model's output)."""
    if _feeds_output(path, inputs):
        return
    for node in tree_flatten(output)[0]:
        if isinstance(node, torch.fx.Node):
            node.meta[DOWNSTREAM_OUTSIDE_KEY] = True


def stitch(model: nn.Module, capture: Capture, inputs: dict[str, RegionInputs]) -> tuple[torch.fx.GraphModule, tuple]:
    """The planning graph of ``model``'s regions and its example inputs (what each region received)."""
    graph = torch.fx.Graph()
    values: list = []
    outputs: list = []
    objects: dict[str, object] = {}
    leaf_inputs: dict[tuple, torch.fx.Node] = {}
    firsts: dict[tuple, torch.fx.Node] = {}
    for region in capture.regions:
        prefix = _safe(region.path)
        if region.kind == "eager":
            node = graph.call_function(EagerCode(region.path), ())
            node.name = graph._graph_namespace.create_name(f"eager_{prefix}", node)
            node.meta[REGION_KEY] = region.path
            node.meta[EAGER_REASON_KEY] = region.reason
            continue
        received = inputs[region.path]
        if region.kind == "leaf":
            def leaf_input(name: str, value) -> torch.fx.Node:
                # leaves fed the same tensor (q, k and v projections) share one placeholder
                key = tensor_identity(value)
                if key is not None and key in leaf_inputs:
                    return leaf_inputs[key]
                values.append(value)
                made = _input(graph, name, value, region.path, firsts)
                if key is not None:
                    leaf_inputs[key] = made
                return made

            args = tuple(leaf_input(f"{prefix}_input{index}", value) for index, value in enumerate(received.args))
            kwargs = {key: leaf_input(f"{prefix}_{key}", value) for key, value in received.kwargs.items()}
            node = graph.create_node("call_module", region.path, args, kwargs, name=prefix)
            node.meta[REGION_KEY] = region.path
            objects[region.path] = model.get_submodule(region.path)
            _mark_read_on(node, region.path, inputs)
            outputs.append(node)
            outputs.append(_gradients(graph, prefix, received, values))
            continue
        region_gm = capture.graphs[region.path]
        bound = bind_placeholders(region_gm, model.get_submodule(region.path).forward, received)
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        placeholders = iter(bound)
        for node in region_gm.graph.nodes:
            if node.op == "placeholder":
                values.append(next(placeholders))
                new = _input(graph, f"{prefix}_{node.name}", values[-1], region.path, firsts)
            elif node.op == "output":
                outputs.append(torch.fx.node.map_arg(node.args[0], lambda n: env[n]))
                _mark_read_on(outputs[-1], region.path, inputs)
                outputs.append(_gradients(graph, prefix, received, values))
                continue
            else:
                target = node.target
                if node.op in ("call_module", "get_attr"):
                    target = f"{region.path}.{node.target}"
                    objects[target] = (region_gm.get_submodule(node.target) if node.op == "call_module"
                                       else operator.attrgetter(node.target)(region_gm))
                new = graph.create_node(node.op, target, torch.fx.node.map_arg(node.args, lambda n: env[n]),
                                        torch.fx.node.map_arg(node.kwargs, lambda n: env[n]),
                                        name=f"{prefix}_{node.name}", type_expr=node.type)
            new.meta = {**node.meta, **new.meta}
            new.meta["fxapprox_local_name"] = node.name
            new.meta[REGION_KEY] = region.path
            env[node] = new
    loss = graph.call_function(stitched_loss, tuple(outputs))
    loss.meta[OUTSIDE_MODEL_KEY] = True
    graph.output(loss)
    stitched = RecordedGraphModule(objects, graph, class_name="StitchedRegions")
    return stitched, tuple(values)


def _region_of(node: torch.fx.Node) -> str | None:
    """The region of ``node``: its tag, or (for a node a pass inserted) the first tagged neighbour's."""
    seen, frontier = set(), [node]
    while frontier:
        current = frontier.pop(0)
        if REGION_KEY in current.meta:
            return current.meta[REGION_KEY]
        seen.add(current)
        frontier += [n for n in (*current.all_input_nodes, *current.users) if n not in seen
                     and n.target is not stitched_loss]
    return None


def _keep_buffer_persistence(region_gm: torch.fx.GraphModule, original: nn.Module) -> None:
    """``GraphModule`` registers every copied buffer as persistent: a non-persistent one (rotary ``inv_freq``)
    would add a ``state_dict`` key the original model does not load."""
    for name, _ in list(region_gm.named_buffers()):
        owner_path, _, leaf = name.rpartition(".")
        try:
            original_owner = original.get_submodule(owner_path)
        except AttributeError:
            continue
        if leaf in getattr(original_owner, "_non_persistent_buffers_set", ()):
            region_gm.get_submodule(owner_path)._non_persistent_buffers_set.add(leaf)


class SavedInputMarks:
    """Forward pre-hook of a swapped leaf in eager code: the memory plan's ``compress_saved`` marks on its inputs
    (there is no graph around it to hold them)."""

    def __init__(self) -> None:
        self.marks: list[tuple[int | str, int, bool]] = []   # (argument index or keyword, bits, sign_exact)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        for where, bits, sign_exact in self.marks:
            value = args[where] if isinstance(where, int) else kwargs.get(where)
            if value is not None:
                compress_saved(value, bits, sign_exact)


def _mark_leaf_inputs(model: nn.Module, stitched: torch.fx.GraphModule, leaves: set[str]) -> None:
    """Leaves whose inputs the memory plan compresses mark them on every call, through a forward pre-hook."""
    for marker in stitched.graph.find_nodes(op="call_function", target=compress_saved):
        value = marker.args[0]
        if value.op != "placeholder":
            continue
        for user in value.users:
            if user.op != "call_module" or user.target not in leaves:
                continue
            module = model.get_submodule(user.target)
            hook = getattr(module, "_fxapprox_input_marks", None)
            if hook is None:
                hook = module._fxapprox_input_marks = SavedInputMarks()
                module.register_forward_pre_hook(hook, with_kwargs=True)
            where = next((i for i, a in enumerate(user.args) if a is value), None)
            if where is None:
                where = next(key for key, a in user.kwargs.items() if a is value)
            hook.marks.append((where, *marker.args[1:]))


def install_regions(model: nn.Module, stitched: torch.fx.GraphModule, capture: Capture) -> None:
    """Put the planned regions into ``model`` (in place): traced regions as ``GraphModule`` s made of their part of
    ``stitched``, swapped leaves as the modules the rewrite made. Targets of the stitched graph's ``call_module``
    nodes that the rewrite added (functional ops' modules) are moved under their region's path."""
    parts: dict[str, list[torch.fx.Node]] = {}
    for node in stitched.graph.nodes:
        if node.op == "output" or node.target is stitched_loss or node.name.endswith("_upstream_gradient"):
            continue
        region = _region_of(node)
        if region is not None:
            parts.setdefault(region, []).append(node)
    loss = next(n for n in stitched.graph.nodes if n.target is stitched_loss)
    region_outputs = iter(loss.args[0::2])
    for region in capture.regions:
        if region.kind == "eager":
            continue
        output = next(region_outputs)
        if region.kind == "leaf":
            model.set_submodule(region.path, stitched.get_submodule(region.path))
            continue
        original_gm = capture.graphs[region.path]
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        objects: dict[str, object] = {}
        original_placeholders = iter(original_gm.graph.find_nodes(op="placeholder"))
        prefix = f"{region.path}."
        for node in parts.get(region.path, ()):
            if node.op == "placeholder":
                template = next(original_placeholders)
                new = graph.placeholder(template.target, template.type, default_value=(
                    template.args[0] if template.args else torch.fx.graph.inspect.Signature.empty))
            else:
                target = node.target
                if node.op in ("call_module", "get_attr"):
                    if not target.startswith(prefix):   # added by the rewrite at the top: move it under the region
                        moved = f"{prefix}{target}"
                        module = stitched.get_submodule(target)
                        stitched.add_submodule(moved, module)
                        delattr(stitched, target)
                        node.target = target = moved
                    objects[target[len(prefix):]] = (stitched.get_submodule(target) if node.op == "call_module"
                                                      else operator.attrgetter(target)(stitched))
                    target = target[len(prefix):]
                new = graph.create_node(node.op, target, torch.fx.node.map_arg(node.args, lambda n: env[n]),
                                        torch.fx.node.map_arg(node.kwargs, lambda n: env[n]),
                                        name=node.meta.get("fxapprox_local_name", node.name), type_expr=node.type)
            new.meta = node.meta
            env[node] = new
        graph.output(torch.fx.node.map_arg(output, lambda n: env[n]))
        graph._codegen = original_gm.graph._codegen
        original = model.get_submodule(region.path)
        region_gm = RecordedGraphModule(objects, graph, class_name=type(original).__name__)
        _keep_buffer_persistence(region_gm, original)
        region_gm.training = original.training
        model.set_submodule(region.path, region_gm)
    _mark_leaf_inputs(model, stitched, {r.path for r in capture.regions if r.kind == "leaf"})
    stitched.recompile()
