"""Graph passes of fxapprox, installed as ``fxapprox.passes``.

The pipeline, one file per stage; each pass writes a typed record under its own ``node.meta`` key
(``fxapprox/records.py``):

1. ``trace`` — capture the model (``ApproxTracer``; recurrent modules stay leaves), then
   ``training_flags`` — traced ``training=self.training`` arguments follow ``train()``/``eval()`` again; where
   the model's own code does not trace, ``regions`` captures it region by region and ``stitch`` makes one
   planning graph of the regions (``eager_flops`` and ``eager_saved`` measure the eager code between them)
2. analysis (``fxapprox.analysis.analyse``) — ``flops`` (2a, first: it names the node a model fails at),
   ``shape_prop`` (2b), ``saved_bytes`` (2c), ``channels`` (2d); ``graph_view`` is the ``networkx`` view
3. ``rank`` — order sampleable layers, widest and most expensive first
4. ``candidates`` (4a) — blockers and the candidate grid per layer (from the op-kind registry,
   ``fxapprox/op_kinds.py``); ``measure_candidates`` (4b) — each candidate's errors and speed on the
   example batch; ``budget_policy`` (4c) — the explicit :class:`fxapprox.plan.Plan` (``measured_policy``,
   ``error_model``, ``payoff``, ``interpolation``, ``fixed_ratio_policy``, ``plan_note``); ``input_saving`` (4d) — what each forward-sampled
   layer keeps of its input for backward (the input itself or its kept columns); ``check_plan`` (4e) — the plan run on
   the example batch against exact training, and made again where its errors passed the predictions
5. ``rewrite`` — swap planned nodes for sampled ops (Linear, Conv2d, LSTM, …)

With a ``memory_budget`` (compressed saved activations), after the rewrite (``fxapprox.memory_planning``):

6. ``compact_pooling`` (6a) — max pools save 8-bit window offsets; ``attention_recompute`` (6b) — attention
   rebuilds its softmax from its saved inputs; ``saved_bytes`` runs again; ``measure_saved`` (6c) — each saved
   value's gradient cost when quantised; on a traced model ``blocks`` — the blocks that may be checkpointed —
   and ``measure_blocks`` — what each option costs in step time; ``memory_policy`` (6d) — which blocks to
   checkpoint and bits per saved graph value, the fastest plan that fits (``plan.memory``; ``saved_values`` is its
   model of the values); ``rewrite_saved`` (6e) — a ``compress_saved`` marker after each planned value;
   ``rewrite_checkpoint`` — the training forward's copy of the graph with each checkpointed block one call

During training, ``replan`` makes the compute plan again from the guard's measurements (under ``budget="auto"``
past ``max_grad_error`` or when the plan stops paying; under a numeric budget past ``divergence_error``).
"""

from fxapprox.passes.blocks import find_blocks
from fxapprox.passes.budget_policy import plan_budget
from fxapprox.passes.candidates import enumerate_candidates
from fxapprox.passes.channels import annotate_channels
from fxapprox.passes.compact_pooling import compact_max_pools
from fxapprox.passes.flops import count_flops
from fxapprox.passes.graph_view import to_networkx
from fxapprox.passes.input_saving import plan_input_saving
from fxapprox.passes.measure_candidates import measure_candidates
from fxapprox.passes.measure_saved import measure_saved_values
from fxapprox.passes.memory_policy import plan_memory
from fxapprox.passes.rank import rank_layers
from fxapprox.passes.rewrite import rewrite_sampled_ops
from fxapprox.passes.rewrite_checkpoint import checkpointed_graph
from fxapprox.passes.rewrite_saved import rewrite_saved_activations
from fxapprox.passes.saved_bytes import measure_saved_bytes
from fxapprox.passes.shape_prop import propagate_shapes
from fxapprox.passes.trace import ApproxTracer, trace
from fxapprox.passes.training_flags import follow_training_mode

__all__ = [
    "ApproxTracer", "annotate_channels", "checkpointed_graph", "compact_max_pools", "count_flops",
    "enumerate_candidates", "find_blocks", "follow_training_mode", "measure_candidates", "measure_saved_bytes", "measure_saved_values", "plan_budget",
    "plan_input_saving",
    "plan_memory", "propagate_shapes", "rank_layers", "rewrite_sampled_ops", "rewrite_saved_activations",
    "to_networkx", "trace",
]
