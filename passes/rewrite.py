"""Pass 5 — rewrite: replace the planned nodes with sampled ops.

Each planned node is handed to its registered :class:`fxapprox.op_kinds.registry.OpKind`:

* ``call_module`` ``nn.Linear`` / ``nn.Conv2d`` / ``nn.LSTM`` → the submodule is swapped for
  :class:`~fxapprox.runtime.modules.ApproxLinear` / :class:`~fxapprox.runtime.modules.ApproxConv2d` /
  :class:`~fxapprox.runtime.modules.ApproxLSTM` (sparse backward) holding the *same* parameters
  under the same path (``state_dict`` keys stay).
* ``F.linear(x, weight, bias)``, ``F.conv2d(x, weight, ...)`` (groups=1) and
  ``x @ W`` / ``W @ x`` with a parameter operand → a ``call_module`` node calling
  a parameter-free :class:`~fxapprox.runtime.modules.ApproxFunctionalLinear` /
  :class:`~fxapprox.runtime.modules.ApproxFunctionalConv2d` / :class:`~fxapprox.runtime.modules.ApproxMatmul`
  registered as ``fxapprox_<node>``.

Only nodes the plan marks ``approximate`` are touched.
"""

from __future__ import annotations

import torch.fx

from fxapprox.op_kinds.registry import OP_KINDS
from fxapprox.ops.lstm import LSTMBackward
from fxapprox.plan import Plan
from fxapprox.runtime.modules import SamplingSpec


def rewrite_sampled_ops(gm: torch.fx.GraphModule, plan: Plan) -> torch.fx.GraphModule:
    """Apply ``plan`` to ``gm`` in place and return it (recompiled).

    Example::

        >>> gm = rewrite_sampled_ops(gm, plan)
        >>> type(gm.fc).__name__
        'ApproxLinear'
    """
    by_name = {node.name: node for node in gm.graph.nodes}
    lstm = LSTMBackward(plan.config.get("lstm_granularity", "coarse"), plan.config.get("lstm_block_steps", 1))
    for decision in plan.approximated:
        handler = OP_KINDS.get(decision.op_kind)
        if handler is None:
            raise ValueError(f"the plan asks to sample {decision.node!r} of kind {decision.op_kind!r}, "
                             "which has no rewrite")
        spec = SamplingSpec(method=decision.method, k=decision.k, n=decision.n, mode=decision.mode,
                            random_share=decision.random_share, save_input=decision.save_input or "reference")
        handler.rewrite(gm, by_name[decision.node], spec, lstm)
    gm.graph.lint()
    gm.recompile()
    return gm
