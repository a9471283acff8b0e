"""Pass 1 (hierarchical) — regions: capture a model whose own code torch.fx cannot trace.

Hugging Face models on transformers 5 (``**kwargs`` signatures, masks built with ``vmap``, attention dispatch on
the inputs' shapes) and other models with data-dependent control flow at the top cannot be traced whole. Here
the module that fails runs its own Python forward eagerly and capture descends into its children:

* ``"traced"``: a child that traces completely (both modes, no opaque submodule) — everything fxapprox does to a
  traced model applies inside it;
* ``"leaf"``: an approximable module (``nn.Linear``, ``nn.Conv2d``, ``nn.LSTM``, Hugging Face ``Conv1D``) in eager
  code — it is swapped in place, by name, the way PEFT and torchao inject their modules;
* ``"eager"``: a module whose own code runs eagerly (exact), descended into; the reason is its tracing error.
  PEFT adapters (LoRA's ``lora_A`` / ``lora_B``) stay exact and are not descended into: they are what is trained,
  and small; the frozen base layer beside them is a leaf whose weight needs no gradient.

Children without parameters are not descended into (nothing to approximate; their FLOPs count as their eager
parent's), nor are modules called more than once in one forward (shared: they stay exact). :func:`record_calls`
records what every module is called with on one real forward (forward pre-hooks); :func:`capture_regions` decides
the regions from it: a child is traced for calls like that one (tensors traced, ``None`` and Python constants
specialised and asserted by torch.fx), and the analyses run each region on what it received.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from fxapprox.errors import TraceError
from fxapprox.op_kinds.builtin import hf_conv1d_class
from fxapprox.passes.capture.trace import (MODE_DEPENDENT, RECURRENT_MODULES, ROOT_MODE_DEPENDENT_KEY, UNTRACED_KEY,
                                           UntracedModule, library_notrace, trace_both_modes)
from fxapprox.passes.capture.training_flags import follow_training_mode
from fxapprox.pipeline._projection import first_tensor, projection_loss

__all__ = ["Capture", "LIBRARY_LEAF", "Region", "RegionInputs", "SWAPPED_LEAVES", "bind_placeholders",
           "capture_regions", "hidden_layers", "hidden_layers_root", "holds_layers", "output_modules", "record_calls",
           "short_reason", "swappable", "untraceable_root"]

#: module types swapped in place where they sit in eager code (and HF ``Conv1D``, matched by class)
SWAPPED_LEAVES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d, nn.LSTM)




def swappable(module: nn.Module) -> bool:
    """A layer the sampled op can stand in for: one of :data:`SWAPPED_LEAVES` running that class's own forward (a
    subclass with its own — a weight-standardised convolution — is traced or descended into instead)."""
    if hf_conv1d_class(module) is not None:
        return True
    return any(isinstance(module, kind) and type(module).forward is kind.forward for kind in SWAPPED_LEAVES)


def holds_layers(module: nn.Module) -> bool:
    """Whether region capture can bring layers of ``module`` into the plan: it is a layer the sampled op stands in
    for, or a module below it is a linear / convolution / LSTM (a subclass with its own forward is traced, its
    ``F.conv2d`` / ``F.linear`` sampled)."""
    return swappable(module) or any(isinstance(m, SWAPPED_LEAVES) or hf_conv1d_class(m) is not None
                                    for m in module.modules() if m is not module)


LIBRARY_LEAF = "its library asks torch.fx not to trace into it (timm's register_notrace_module)"


def _library_leaf(module: nn.Module, path: str, leaf_modules: tuple) -> bool:
    """A module a model library registers as not to be traced into that holds layers (and the user did not name)."""
    library_modules, _ = library_notrace()
    return bool(library_modules) and isinstance(module, library_modules) and holds_layers(module) \
        and not _is_user_leaf(module, path, leaf_modules)


def hidden_layers(model: nn.Module, traced: torch.fx.GraphModule, leaf_modules: tuple = ()) -> list[UntracedModule]:
    """The opaque leaves of ``traced`` (``model`` traced) that keep layers out of the plan: submodules torch.fx
    could not trace (``UNTRACED_KEY``) and library no-trace modules, each holding layers (:func:`holds_layers`).
    Region capture brings them in; a module the user named in ``leaf_modules`` stays whole."""
    hidden = [u for u in traced.meta.get(UNTRACED_KEY, ()) if holds_layers(model.get_submodule(u.module))]
    for node in traced.graph.find_nodes(op="call_module"):
        module = traced.get_submodule(node.target)
        if _library_leaf(module, node.target, leaf_modules):
            hidden.append(UntracedModule(node.target, type(module).__name__, LIBRARY_LEAF, None))
    return hidden


@dataclass(frozen=True)
class Region:
    """One part of a hierarchically captured model: how it runs and why."""

    path: str            #: qualified name in the model ("" for the root)
    kind: str            #: "traced", "leaf" or "eager"
    module_type: str
    reason: str          #: why it runs this way (for "eager": torch.fx's error, one line)
    source_line: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Region":
        return cls(**data)


def short_reason(text: str, limit: int = 160) -> str:
    """The first sentence of a tracing error, at most ``limit`` characters (the report's rows are one line)."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    sentence = first.split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= limit else sentence[:limit - 1] + "…"


def untraceable_root(model: nn.Module, error: TraceError) -> Region:
    """The root region of a model whose own code failed to trace with ``error``."""
    reason = error.reason or str(error).splitlines()[0]
    return Region("", "eager", type(model).__name__, f"torch.fx could not trace it: {short_reason(reason)}",
                  error.source_line)


def hidden_layers_root(model: nn.Module, hidden: list[UntracedModule]) -> Region:
    """The root region of a model whose own code traces but whose submodules ``hidden`` (holding approximable
    layers, :func:`hidden_layers`) do not, or are not to be traced."""
    paths = [u.module for u in hidden]
    named = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return Region("", "eager", type(model).__name__, f"its submodules {named} are not traced")


@dataclass
class Capture:
    """The regions of a model (in module order) and the traced regions' GraphModules."""

    regions: list[Region] = field(default_factory=list)
    graphs: dict[str, torch.fx.GraphModule] = field(default_factory=dict)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _relative_leaves(leaf_modules: tuple, path: str) -> tuple:
    """The user's ``leaf_modules`` as seen from the submodule at ``path`` (names made relative; types kept)."""
    prefix = f"{path}." if path else ""
    return tuple(leaf if isinstance(leaf, type) else leaf[len(prefix):]
                 for leaf in leaf_modules if isinstance(leaf, type) or leaf.startswith(prefix))


def _is_user_leaf(module: nn.Module, path: str, leaf_modules: tuple) -> bool:
    return path in leaf_modules or isinstance(module, tuple(x for x in leaf_modules if isinstance(x, type)))


_CONSTANTS = (type(None), bool, int, float, str)


def _is_constant(value) -> bool:
    leaves, _ = tree_flatten(value)
    return all(isinstance(leaf, _CONSTANTS) for leaf in leaves)


def _adapter_names(module: nn.Module) -> tuple[str, ...]:
    """The adapter children of a PEFT tuner layer (``BaseTunerLayer.adapter_layer_names``: LoRA's ``lora_A``,
    ``lora_B``, …), matched by attribute so that peft is not imported; empty for any other module."""
    names = getattr(type(module), "adapter_layer_names", ())
    return tuple(names) if isinstance(names, (tuple, list)) else ()


def _trace_region(module: nn.Module, leaf_modules: tuple, inputs: "RegionInputs") -> torch.fx.GraphModule:
    """``module`` traced completely for calls like this one, sharing its parameters (tied weights stay tied), or
    :class:`TraceError`. Tensor arguments are traced; ``None`` and Python constants are specialised (torch.fx
    asserts them at every call: a region is never run with a value it was not traced for)."""
    signature = inspect.signature(module.forward)
    variadic = [p.name for p in signature.parameters.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise TraceError(f"forward takes *{variadic[0]}", reason=f"forward takes *{variadic[0]} (not traced)")
    bound = signature.bind(*inputs.args, **inputs.kwargs)
    bound.apply_defaults()
    concrete = {}
    for name, value in bound.arguments.items():
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, (tuple, list, dict)):   # torch.fx would flatten it into several placeholders
            raise TraceError(f"called with a constant {type(value).__name__} argument {name!r}",
                             reason=f"called with a constant {type(value).__name__} argument {name!r} (not traced)")
        if not _is_constant(value):
            raise TraceError(f"called with a {type(value).__name__} argument {name!r}",
                             reason=f"called with a {type(value).__name__} argument {name!r} (not traced)")
        concrete[name] = value
    traced, other = trace_both_modes(module, leaf_modules, strict=True, copy_model=False,
                                     concrete_args=concrete or None)
    if traced.meta.get(ROOT_MODE_DEPENDENT_KEY):   # one trace would keep one mode's branch: run it eagerly
        raise TraceError(MODE_DEPENDENT, reason=MODE_DEPENDENT)
    untraced = traced.meta.get(UNTRACED_KEY, ())
    if untraced:   # a mode-dependent submodule: descend rather than keep an opaque leaf
        first = untraced[0]
        raise TraceError(f"{first.module}: {first.reason}", module_path=first.module, source_line=first.source_line,
                         module_type=first.module_type, reason=first.reason)
    opaque = [node.target for node in traced.graph.find_nodes(op="call_module")
              if _library_leaf(traced.get_submodule(node.target), node.target, leaf_modules)]
    if opaque:   # a library no-trace module would hide its layers in this region: descend instead
        raise TraceError(f"{opaque[0]}: {LIBRARY_LEAF}", module_path=opaque[0], reason=f"{opaque[0]}: {LIBRARY_LEAF}")
    gm = follow_training_mode(traced, other, training=module.training)
    # torch.fx renames specialised arguments (mask -> mask_1): callers pass them by their own names
    for node, name in zip(gm.graph.find_nodes(op="placeholder"), signature.parameters):
        node.target = name
    gm.recompile()
    return gm


def capture_regions(model: nn.Module, root: Region, calls: dict[str, "RegionInputs"],
                    leaf_modules: tuple = ()) -> Capture:
    """The regions of ``model`` (whose own code does not trace: ``root`` says why), from what each module was called
    with on one forward (:func:`record_calls`). ``model`` is not modified."""
    capture = Capture()

    def visit(module: nn.Module, path: str, region: Region | None) -> None:
        if region is not None:
            capture.regions.append(region)
        for name, child in module.named_children():
            child_path = _join(path, name)
            if not any(True for _ in child.parameters()):
                continue
            kind = type(child).__name__
            if name in _adapter_names(module):
                capture.regions.append(Region(child_path, "eager", kind, "PEFT adapter: trained, stays exact"))
                continue
            if type(child).forward is nn.Module.forward:   # ModuleList / ModuleDict: containers, not called
                visit(child, child_path, None)
                continue
            received = calls.get(child_path)
            if received is None and any(p.startswith(child_path + ".") for p in calls):
                visit(child, child_path, None)   # not called itself (PEFT's LoraModel): its children are
                continue
            if received is None or received.calls != 1:
                why = "not called on the example inputs" if received is None else \
                    f"called {received.calls} times in one forward: a shared module stays exact"
                capture.regions.append(Region(child_path, "eager", kind, why))
                continue
            if _is_user_leaf(child, child_path, leaf_modules) or isinstance(child, RECURRENT_MODULES) \
                    and not isinstance(child, nn.LSTM):
                capture.regions.append(Region(child_path, "eager", kind, "kept whole (leaf_modules or a recurrent "
                                                                         "layer without a sampled version)"))
                continue
            if swappable(child):
                capture.regions.append(Region(child_path, "leaf", kind,
                                              "approximable layer in eager code: swapped in place"))
                continue
            try:
                capture.graphs[child_path] = _trace_region(child, _relative_leaves(leaf_modules, child_path),
                                                           received)
            except Exception as error:   # noqa: BLE001 — any tracing failure: run it eagerly, descend
                reason = getattr(error, "reason", None) or f"{type(error).__name__}: {str(error).splitlines()[0]}"
                visit(child, child_path, Region(child_path, "eager", kind,
                                                f"torch.fx could not trace it: {short_reason(reason)}",
                                                getattr(error, "source_line", None)))
                continue
            capture.regions.append(Region(child_path, "traced", kind, "traces"))

    visit(model, "", root)
    return capture


@dataclass
class RegionInputs:
    """What one module was called with on the capture step (its first call), how often it was called, the
    gradient its output received (one entry per flattened output, ``None`` where none flowed), and whether its
    output is the model's: no parameterised module lies between it and the loss (:func:`output_modules`)."""

    args: tuple
    kwargs: dict
    calls: int = 1
    output_grads: list = field(default_factory=list)
    feeds_output: bool = False


def output_modules(output, producers: dict) -> set[str]:
    """The modules whose outputs the model's output (its first tensor: the loss, or the logits) is computed from
    with no parameterised module in between — its output layers, whose forward error goes straight into the loss.

    ``producers`` maps the autograd nodes that made modules' outputs to those modules' paths (modules that own
    parameters themselves: ``Linear``, ``LayerNorm``; containers pass the walk on to what is inside). The walk
    goes back through the autograd graph from the output and stops at the first such node on each path.
    """
    start = first_tensor(output)
    if not isinstance(start, torch.Tensor) or start.grad_fn is None:
        return set()
    found: set[str] = set()
    seen, frontier = set(), [start.grad_fn]
    while frontier:
        node = frontier.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in producers:
            found.update(producers[node])
            continue
        frontier.extend(following for following, _ in node.next_functions)
    return found


def _detached(value):
    if not isinstance(value, torch.Tensor):
        return value
    # the requires_grad flag stays: the analyses count an input gradient only where the real step has one
    return value.detach().requires_grad_(value.requires_grad and (value.is_floating_point() or value.is_complex()))


def record_calls(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, RegionInputs]:
    """Run one step of ``model(*args, **kwargs)`` (the backward of the projection loss, no ``.grad`` written) and
    record, for every submodule with parameters, what its first call received, how often it was called and the
    upstream gradient of that call's output. Run it inside the analysis sandbox."""
    seen: dict[str, RegionInputs] = {}
    producers: dict = {}   # autograd node that made a module's output -> the module paths
    handles = []

    def keep_gradient(record: RegionInputs, index: int):
        def hook(grad):
            record.output_grads[index] = grad.detach()
        return hook

    for path, module in model.named_modules():
        if not path or not any(True for _ in module.parameters()):
            continue

        def pre_hook(module, hook_args, hook_kwargs, path=path):
            if path in seen:
                seen[path].calls += 1
            else:
                seen[path] = RegionInputs(tree_map(_detached, tuple(hook_args)), tree_map(_detached, dict(hook_kwargs)))

        def post_hook(module, hook_args, hook_kwargs, output, path=path):
            record = seen[path]
            if record.calls != 1 or record.output_grads:
                return
            flat = tree_flatten(output)[0]
            if any(True for _ in module.parameters(recurse=False)):
                for value in flat:
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        producers.setdefault(value.grad_fn, []).append(path)
            record.output_grads = [None] * len(flat)
            for index, value in enumerate(flat):
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    value.register_hook(keep_gradient(record, index))
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
    try:
        with torch.enable_grad():
            output = model(*args, **kwargs)
            for path in output_modules(output, producers):
                seen[path].feeds_output = True
            loss = projection_loss(output)
            parameters = [p for p in model.parameters() if p.requires_grad]
            if loss.requires_grad and parameters:
                torch.autograd.grad(loss, parameters, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def bind_placeholders(gm: torch.fx.GraphModule, module_forward, inputs: RegionInputs) -> list:
    """The values of ``gm``'s placeholders (named after ``module_forward``'s parameters) for these inputs."""
    bound = inspect.signature(module_forward).bind(*inputs.args, **inputs.kwargs)
    bound.apply_defaults()
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):
        name = node.target.lstrip("*")
        if name not in bound.arguments:
            raise TypeError(f"no value for input {name!r}")
        values.append(bound.arguments[name])
    return values
