"""Pass 5 — rewrite: replace the planned nodes with sampled ops.

* ``call_module`` ``nn.Linear`` / ``nn.Conv2d`` / ``nn.LSTM`` → the submodule is swapped for
  :class:`~fxapprox.modules.ApproxLinear` / :class:`~fxapprox.modules.ApproxConv2d` /
  :class:`~fxapprox.modules.ApproxLSTM` (sparse backward) holding the *same* parameters
  under the same path (``state_dict`` keys stay).
* ``F.linear(x, weight, bias)``, ``F.conv2d(x, weight, ...)`` (groups=1) and
  ``x @ W`` / ``W @ x`` with a parameter operand → a ``call_module`` node calling
  a parameter-free :class:`~fxapprox.modules.ApproxFunctionalLinear` /
  :class:`~fxapprox.modules.ApproxFunctionalConv2d` / :class:`~fxapprox.modules.ApproxMatmul`
  registered as ``fxapprox_<node>``.

Only nodes the plan marks ``approximate`` are touched.
"""

from __future__ import annotations

import torch.fx

from fxapprox.modules import (ApproxConv2d, ApproxFunctionalConv2d, ApproxFunctionalLinear, ApproxLinear,
                              ApproxLSTM, ApproxMatmul, SamplingSpec)
from fxapprox.plan import Plan
from fxapprox.passes._meta import fx_meta
from fxapprox.passes.channels import conv2d_call_args


def _linear_args(node: torch.fx.Node) -> tuple:
    names = ("input", "weight", "bias")
    values = list(node.args) + [node.kwargs.get(name) for name in names[len(node.args):]]
    return tuple(values[:3])


def rewrite_sampled_ops(gm: torch.fx.GraphModule, plan: Plan) -> torch.fx.GraphModule:
    """Apply ``plan`` to ``gm`` in place and return it (recompiled).

    Example::

        >>> gm = rewrite_sampled_ops(gm, plan)
        >>> type(gm.fc).__name__
        'ApproxLinear'
    """
    by_name = {node.name: node for node in gm.graph.nodes}
    for decision in plan.approximated:
        node = by_name[decision.node]
        spec = SamplingSpec(method=decision.method, k=decision.k, n=decision.n, mode=decision.mode,
                            random_share=decision.random_share)
        kind = decision.op_kind
        if kind == "linear":
            gm.add_submodule(node.target, ApproxLinear.from_linear(gm.get_submodule(node.target), spec))
        elif kind == "conv2d":
            gm.add_submodule(node.target, ApproxConv2d.from_conv2d(gm.get_submodule(node.target), spec))
        elif kind == "lstm":
            granularity = plan.config.get("lstm_granularity", "coarse")
            gm.add_submodule(node.target, ApproxLSTM.from_lstm(gm.get_submodule(node.target), spec, granularity))
        elif kind in ("linear_fn", "conv2d_fn", "matmul"):
            module_name = f"fxapprox_{node.name}"
            if kind == "linear_fn":
                module, args = ApproxFunctionalLinear(spec), _linear_args(node)
            elif kind == "conv2d_fn":
                call = conv2d_call_args(node)
                module = ApproxFunctionalConv2d(spec, call["stride"], call["padding"], call["dilation"])
                args = (call["input"], call["weight"], call["bias"])
            else:
                module, args = ApproxMatmul(spec, fx_meta(node)["parameter_side"]), tuple(node.args[:2])
            gm.add_submodule(module_name, module)
            node.op, node.target, node.args, node.kwargs = "call_module", module_name, args, {}
        else:
            raise ValueError(f"the plan asks to sample {decision.node!r} of kind {kind!r}, which has no rewrite")
    gm.graph.lint()
    gm.recompile()
    return gm
