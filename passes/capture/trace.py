"""Pass 1 — trace: capture a model as a ``torch.fx.GraphModule``.

Recurrent modules (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) and user-named leaf
modules stay single ``call_module`` nodes. When a submodule cannot be traced
(data-dependent control flow, ``math.ceil`` on a traced size …), it is kept as a
leaf — exact, opaque — and tracing starts again; each such module is recorded
(:class:`UntracedModule`: path, type, the user source line and the error) for the
plan and the report. ``strict=True`` (``ApproxConfig(strict_trace=True)``) raises
:class:`fxapprox.TraceError` instead, naming the module and line, with the two ways
out; a failure in the root module's own code always raises.

Where a model library publishes what its fx users should not trace into (timm's
``register_notrace_module`` / ``register_notrace_function`` registries), those
modules are leaves and those functions are wrapped, when the library is importable.
"""

from __future__ import annotations

import copy
import importlib.util
import linecache
import os
import traceback
from dataclasses import asdict, dataclass

import torch
import torch.fx
from torch import nn

from fxapprox.errors import TraceError
from fxapprox.op_kinds.builtin import hf_conv1d_class
from fxapprox.passes.capture.torch_transformer import training_forward

# nn.RNNBase also covers ApproxLSTM (an RNNBase with nn.LSTM's methods, see fxapprox.runtime.modules)
RECURRENT_MODULES: tuple[type[nn.Module], ...] = (nn.LSTM, nn.GRU, nn.RNN, nn.RNNBase)

_TORCH_DIR = os.path.dirname(torch.__file__)



def library_notrace() -> tuple[tuple[type, ...], tuple]:
    """Modules and functions model libraries ask fx not to trace into (timm's registries), if installed."""
    try:
        from timm.layers import _fx as timm_fx
    except Exception:   # not installed, or a timm without the registries
        return (), ()
    modules = tuple(getattr(timm_fx, "_leaf_modules", ()))
    functions = tuple(getattr(timm_fx, "_autowrap_functions", ()))
    return modules, functions


@dataclass(frozen=True)
class UntracedModule:
    """A submodule torch.fx could not trace, kept as an exact leaf."""

    module: str              #: qualified name
    module_type: str
    reason: str              #: the tracing error, one line
    source_line: str | None  #: ``file:line: `code``` of the user line that broke tracing

    def to_dict(self) -> dict:
        return asdict(self)


class ApproxTracer(torch.fx.Tracer):
    """A ``torch.fx.Tracer`` that keeps recurrent modules, HF ``Conv1D``, named modules and libraries' no-trace
    modules as leaves and wraps libraries' no-trace functions. With ``torch_transformers``, torch's own
    transformer modules are traced through their training computation
    (:mod:`fxapprox.passes.capture.torch_transformer`; the paths in ``self.traced_through``) instead of kept whole."""

    def __init__(self, leaf_modules: tuple[str | type, ...] = (), torch_transformers: bool = False) -> None:
        library_modules, library_functions = library_notrace()
        super().__init__(autowrap_functions=library_functions)
        self.leaf_names = {leaf for leaf in leaf_modules if isinstance(leaf, str)}
        self.leaf_types = tuple(leaf for leaf in leaf_modules if isinstance(leaf, type)) + library_modules
        self.torch_transformers = torch_transformers
        self.traced_through: list[str] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, RECURRENT_MODULES) or isinstance(m, self.leaf_types) \
                or hf_conv1d_class(m) is not None:   # one call_module node the conv1d_hf kind samples
            return True
        if module_qualified_name in self.leaf_names:
            return True
        if self.torch_transformers and training_forward(m) is not None:
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):
        traced_forward = training_forward(m) if self.torch_transformers else None
        if traced_forward is not None:
            path = self.path_of_module(m)
            if not self.is_leaf_module(m, path):   # (a module the user named stays whole)
                self.traced_through.append(path)
                forward = traced_forward
        return super().call_module(m, forward, args, kwargs)


def _user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch and fxapprox (the user's code)."""
    # the package's own frames (fxapprox/ and passes/, installed as fxapprox.passes) are not the user's code
    own_dirs = tuple(os.path.dirname(os.path.abspath(importlib.util.find_spec(name).origin))
                     for name in ("fxapprox", "fxapprox.passes"))
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or "<eval_with_key>" in path:
            continue
        if any(path.startswith(own + os.sep) for own in own_dirs):
            continue
        return frame
    return None


#: ``GraphModule.meta`` key under which :func:`trace` lists the :class:`UntracedModule` s
UNTRACED_KEY = "fxapprox_untraced"
#: ``GraphModule.meta`` keys set by :func:`trace` with ``torch_transformers`` when it traced through torch's
#: transformer modules: their paths, and the model traced with them whole (sharing the modules and parameters),
#: which evaluation runs (torch's own forward, fast path included)
TRACED_THROUGH_KEY = "fxapprox_torch_transformers"
EXACT_EVAL_KEY = "fxapprox_exact_eval"


def trace(model: nn.Module, leaf_modules: tuple[str | type, ...] = (), strict: bool = False, *,
          copy_model: bool = True, concrete_args: dict | None = None,
          torch_transformers: bool = False) -> torch.fx.GraphModule:
    """Trace ``model`` (which is not modified) into a new ``GraphModule``.

    A ``GraphModule`` is taken as already traced and deep-copied as it is. Submodules that fail to trace
    become leaves (listed in ``gm.meta[UNTRACED_KEY]``) unless ``strict``. ``torch_transformers``: see
    :class:`ApproxTracer` and :data:`EXACT_EVAL_KEY`.

    Example::

        >>> gm = trace(torchvision.models.resnet18())
        >>> gm.graph.find_nodes(op="call_module", target="fc")
    """
    if isinstance(model, torch.fx.GraphModule):
        return copy.deepcopy(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a torch.fx.GraphModule, got {type(model).__name__}")
    if copy_model:   # the GraphModule shares the traced model's submodules: never the caller's
        model = copy.deepcopy(model)
    untraced: list[UntracedModule] = []
    leaves = tuple(leaf_modules)
    # Each failure names one more module to keep whole; a model has finitely many.
    for _ in range(sum(1 for _ in model.modules()) + 1):
        tracer = ApproxTracer(leaves, torch_transformers)
        try:
            graph = tracer.trace(model, concrete_args)
        except Exception as error:
            failure = _trace_error(model, tracer, error)
            if strict or failure.module_path == "<root>":
                raise failure from error
            untraced.append(UntracedModule(failure.module_path, failure.module_type, failure.reason,
                                           failure.location))
            leaves = leaves + (failure.module_path,)
            continue
        gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
        gm.meta[UNTRACED_KEY] = tuple(untraced)
        if tracer.traced_through:
            whole = ApproxTracer(leaves)   # the same model with torch's modules whole: what evaluation runs
            whole_graph = whole.trace(model, concrete_args)
            gm.meta[EXACT_EVAL_KEY] = torch.fx.GraphModule(whole.root, whole_graph, type(model).__name__)
            gm.meta[TRACED_THROUGH_KEY] = tuple(tracer.traced_through)
        return gm
    raise AssertionError("unreachable: every module was made a leaf")  # pragma: no cover


def _innermost_module(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _module_code(gm: torch.fx.GraphModule) -> dict[str, list]:
    """Each module path's own traced ops (nodes whose innermost module it is), in order."""
    groups: dict[str, list] = {}
    for node in gm.graph.nodes:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        groups.setdefault(_innermost_module(node), []).append((node.op, target))
    return groups


MODE_DEPENDENT = "its code branches on self.training (the train- and eval-mode traces differ)"
#: ``GraphModule.meta`` key (True) set by :func:`trace_both_modes` when the traced module's own code differs between
#: the modes: the trace holds its training-mode branch only
ROOT_MODE_DEPENDENT_KEY = "fxapprox_root_mode_dependent"


def trace_both_modes(model: nn.Module, leaf_modules: tuple[str | type, ...] = (), strict: bool = False, *,
                     copy_model: bool = True, concrete_args: dict | None = None,
                     torch_transformers: bool = False) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule | None]:
    """:func:`trace` ``model`` in its mode and in the other one, with the same leaves.

    A submodule whose own traced code differs between the two (``if self.training:`` around a drop path,
    say) would keep the trace-time branch in the other mode: it is made a leaf, so it runs its own forward
    and follows ``train()``/``eval()``, and recorded in ``gm.meta[UNTRACED_KEY]``. The second trace lets
    :func:`~fxapprox.passes.capture.training_flags.follow_training_mode` tell mode-dependent constants from real
    ones; it is ``None`` for a ready GraphModule or when the other mode does not trace (or branches in the
    root module's own code). ``copy_model=False``: the result shares ``model``'s submodules and parameters;
    ``concrete_args`` are torch.fx's (arguments traced as the given constants); ``torch_transformers``: see
    :func:`trace`.
    """
    gm = trace(model, leaf_modules, strict, copy_model=copy_model, concrete_args=concrete_args,
               torch_transformers=torch_transformers)
    if isinstance(model, torch.fx.GraphModule):
        return gm, None
    leaves = tuple(leaf_modules) + tuple(u.module for u in gm.meta[UNTRACED_KEY])
    untraced = list(gm.meta[UNTRACED_KEY])
    other_model = copy.deepcopy(model).train(not model.training)
    for _ in range(sum(1 for _ in model.modules()) + 1):
        try:
            other = trace(other_model, leaves, strict=True, copy_model=False,   # a copy already
                          concrete_args=concrete_args, torch_transformers=torch_transformers)
        except Exception:   # noqa: BLE001 — traces in this mode only: training flags are told by name
            return gm, None
        mine, theirs = _module_code(gm), _module_code(other)
        differing = sorted(path for path in set(mine) | set(theirs) if mine.get(path) != theirs.get(path))
        if not differing:
            gm.meta[UNTRACED_KEY] = tuple(untraced)
            return gm, other
        if "" in differing:   # the root's own code: it cannot be a leaf
            gm.meta[UNTRACED_KEY] = tuple(untraced)
            gm.meta[ROOT_MODE_DEPENDENT_KEY] = True
            return gm, None
        for path in differing:
            module_type = type(model.get_submodule(path)).__name__
            untraced.append(UntracedModule(path, module_type, MODE_DEPENDENT, None))
        leaves = leaves + tuple(differing)
        gm = trace(model, leaves, strict, copy_model=copy_model, concrete_args=concrete_args,
                   torch_transformers=torch_transformers)
        untraced += gm.meta[UNTRACED_KEY]   # only new failures: the known ones are leaves now
        leaves += tuple(u.module for u in gm.meta[UNTRACED_KEY])
    return gm, None  # pragma: no cover


def _trace_error(model: nn.Module, tracer: ApproxTracer, error: Exception) -> TraceError:
    # Tracer.call_module pushes onto module_stack and pops only on success, so
    # after a failure the stack still holds the path to the failing module.
    stack = list(tracer.module_stack.values())
    module_path, module_type = stack[-1] if stack else ("", type(model))
    module_path = module_path or "<root>"
    type_name = getattr(module_type, "__name__", str(module_type))
    frame = _user_frame(error)
    where = ""
    source_line = None
    if frame is not None:
        source_line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        where = f" at {frame.filename}:{frame.lineno}: `{source_line}`"
    leaf_hint = f"ApproxConfig(leaf_modules=({module_path!r},))" if module_path != "<root>" else \
        "ApproxConfig(leaf_modules=(...,)) on the submodule that branches"
    message = (
        f"could not trace module {module_path!r} ({type_name}){where}: "
        f"{type(error).__name__}: {error}\n"
        f"fix: mark it a leaf with config={leaf_hint} (it then stays exact), "
        f"or trace the model yourself (e.g. with concrete_args or your library's tracer) "
        f"and pass the torch.fx.GraphModule to approximate()."
    )
    reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    return TraceError(message, module_path=module_path, source_line=source_line, module_type=type_name,
                      reason=reason, location=where.removeprefix(" at ") or None)
