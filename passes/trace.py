"""Pass 1 — trace: capture a model as a ``torch.fx.GraphModule``.

Recurrent modules (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) and user-named leaf
modules stay single ``call_module`` nodes. A failure is re-raised as
:class:`fxapprox.TraceError` naming the module being traced and the user
source line that broke tracing, with the two ways out.
"""

from __future__ import annotations

import copy
import linecache
import os
import traceback

import torch
import torch.fx
from torch import nn

from fxapprox.errors import TraceError

# nn.RNNBase also covers ApproxLSTM (an RNNBase with nn.LSTM's methods, see fxapprox.modules)
RECURRENT_MODULES: tuple[type[nn.Module], ...] = (nn.LSTM, nn.GRU, nn.RNN, nn.RNNBase)

_TORCH_DIR = os.path.dirname(torch.__file__)



class ApproxTracer(torch.fx.Tracer):
    """A ``torch.fx.Tracer`` that keeps recurrent modules and named modules as leaves."""

    def __init__(self, leaf_modules: tuple[str | type, ...] = ()) -> None:
        super().__init__()
        self.leaf_names = {leaf for leaf in leaf_modules if isinstance(leaf, str)}
        self.leaf_types = tuple(leaf for leaf in leaf_modules if isinstance(leaf, type))

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, RECURRENT_MODULES) or isinstance(m, self.leaf_types):
            return True
        if module_qualified_name in self.leaf_names:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch and fxapprox (the user's code)."""
    import fxapprox  # the package's own frames are not the user's code

    own_dirs = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(fxapprox.__file__)))
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or "<eval_with_key>" in path:
            continue
        if any(path.startswith(own + os.sep) for own in own_dirs):
            continue
        return frame
    return None


def trace(model: nn.Module, leaf_modules: tuple[str | type, ...] = ()) -> torch.fx.GraphModule:
    """Trace ``model`` (which is not modified) into a new ``GraphModule``.

    A ``GraphModule`` is taken as already traced and deep-copied as it is.

    Example::

        >>> gm = trace(torchvision.models.resnet18())
        >>> gm.graph.find_nodes(op="call_module", target="fc")
    """
    if isinstance(model, torch.fx.GraphModule):
        return copy.deepcopy(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a torch.fx.GraphModule, got {type(model).__name__}")
    model = copy.deepcopy(model)
    tracer = ApproxTracer(leaf_modules)
    try:
        graph = tracer.trace(model)
    except Exception as error:
        raise _trace_error(model, tracer, error) from error
    return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


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
    return TraceError(message, module_path=module_path, source_line=source_line)
