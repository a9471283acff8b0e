"""Shared machinery of the measuring passes: run each node again on private copies.

FLOPs and saved-for-backward bytes must be attributed to the graph node that
causes them, backward included. Running the whole model under one counter
attributes backward work to whichever autograd node happens to run, so each
measuring pass instead re-executes every compute node in isolation: its inputs
are cloned (in-place ops cannot touch the real values), float inputs that
required grad in the real run become fresh leaves, and the node's forward and
backward are measured on their own. The real values then flow on as in
``torch.fx.Interpreter``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map

from fxapprox.errors import AnalysisError
from fxapprox.pipeline.records import OUTSIDE_MODEL_KEY

COMPUTE_OPS = ("call_module", "call_function", "call_method")


def _isolate(value, grad_leaves: list[torch.Tensor]):
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, torch.nn.Parameter):
        # Parameters (from get_attr nodes) keep their storage: graph ops do not
        # modify them in place, and saved-bytes accounting must see them as state.
        leaf = value.detach().requires_grad_(value.requires_grad)
        if value.requires_grad:
            grad_leaves.append(leaf)
        return leaf
    if value.requires_grad and (value.is_floating_point() or value.is_complex()):
        leaf = value.detach().requires_grad_(True)
        grad_leaves.append(leaf)
        return leaf.clone()
    return value.detach().clone()


def run_backward(outputs, inputs: list[torch.Tensor]) -> None:
    """Backpropagate ones from every differentiable output to ``inputs`` (no ``.grad`` writes)."""
    outs = [o for o in tree_flatten(outputs)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs or not inputs:
        return
    torch.autograd.grad(outs, inputs, grad_outputs=[torch.ones_like(o) for o in outs],
                        allow_unused=True)


class NodeIsolationInterpreter(torch.fx.Interpreter):
    """Interpreter that calls :meth:`measure` for every compute node before running it."""

    description = "analysing"

    def __init__(self, gm: torch.fx.GraphModule, progress: bool = False) -> None:
        super().__init__(gm)
        self.show_progress = progress
        self._progress = None
        self._task = None

    def measure(self, node: torch.fx.Node, run: Callable[[], object],
                grad_inputs: list[torch.Tensor]) -> None:
        """Measure one node; ``run()`` executes it on private copies of its inputs."""
        raise NotImplementedError

    def run_node(self, n: torch.fx.Node):
        try:
            return self._measure_and_run(n)
        except AnalysisError:
            raise
        except Exception as error:
            from fxapprox.passes.analysis.graph_view import target_name

            raise AnalysisError(
                f"the model failed on the example inputs at node {n.name!r} ({n.op} {target_name(n)}): "
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error

    def _measure_and_run(self, n: torch.fx.Node):
        if n.op in COMPUTE_OPS and not n.meta.get(OUTSIDE_MODEL_KEY):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            grad_leaves: list[torch.Tensor] = []
            iso_args, iso_kwargs = tree_map(lambda v: _isolate(v, grad_leaves), (args, kwargs))
            if n.op == "call_module":
                module = self.module.get_submodule(n.target)
                grad_leaves.extend(p for p in module.parameters() if p.requires_grad)
            self.isolated_inputs = (iso_args, iso_kwargs)
            with self._set_current_node(n):
                self.measure(n, lambda: getattr(self, n.op)(n.target, iso_args, iso_kwargs), grad_leaves)
        result = super().run_node(n)
        if self._progress is not None:
            self._progress.advance(self._task)
        return result

    def run(self, *args, **kwargs):
        if not self.show_progress:
            return super().run(*args, **kwargs)
        from rich.progress import Progress

        with Progress(transient=True) as progress:
            self._progress = progress
            self._task = progress.add_task(self.description, total=len(self.module.graph.nodes))
            try:
                return super().run(*args, **kwargs)
            finally:
                self._progress = self._task = None
