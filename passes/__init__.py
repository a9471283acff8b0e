"""Graph passes of fxapprox, installed as ``fxapprox.passes``.

The pipeline, one file per stage; each pass writes a typed record under its own ``node.meta`` key
(``fxapprox/records.py``):

1. ``trace`` — capture the model (``ApproxTracer``; recurrent modules stay leaves), then
   ``training_flags`` — traced ``training=self.training`` arguments follow ``train()``/``eval()`` again
2. analysis — ``shape_prop``, ``flops``, ``saved_bytes``, ``channels`` (+ ``graph_view``)
3. ``rank`` — order sampleable layers, widest and most expensive first
4. ``candidates`` — blockers and the candidate grid per layer (from the op-kind registry,
   ``fxapprox/op_kinds.py``); ``measure_candidates`` — each candidate's errors and speed on the
   example batch; ``budget_policy`` — the explicit :class:`fxapprox.plan.Plan`; ``input_saving`` — what each
   forward-sampled layer keeps of its input for backward (the input itself or its kept columns)
5. ``rewrite`` — swap planned nodes for sampled ops (Linear, Conv2d, LSTM)

With a ``memory_budget`` (compressed saved activations), after the rewrite:

6. ``compact_pooling`` — max pools save 8-bit window offsets; ``saved_bytes`` runs again;
   ``measure_saved`` — each saved value's gradient cost when quantised;
   ``memory_policy`` — bits per saved graph value (``plan.memory``);
   ``rewrite_saved`` — a ``compress_saved`` marker after each planned value
"""

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
from fxapprox.passes.rewrite_saved import rewrite_saved_activations
from fxapprox.passes.saved_bytes import measure_saved_bytes
from fxapprox.passes.shape_prop import propagate_shapes
from fxapprox.passes.trace import ApproxTracer, trace
from fxapprox.passes.training_flags import follow_training_mode

__all__ = [
    "ApproxTracer", "annotate_channels", "compact_max_pools", "count_flops", "enumerate_candidates",
    "follow_training_mode", "measure_candidates", "measure_saved_bytes", "measure_saved_values", "plan_budget",
    "plan_input_saving",
    "plan_memory", "propagate_shapes", "rank_layers", "rewrite_sampled_ops", "rewrite_saved_activations",
    "to_networkx", "trace",
]
