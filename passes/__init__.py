"""Graph passes of fxapprox, installed as ``fxapprox.passes``: one folder per stage of the pipeline, one pass per
file. Each pass writes a typed record under its own ``node.meta`` key (``fxapprox/pipeline/records.py``).

1. ``capture/`` — ``trace`` (``ApproxTracer``; recurrent modules stay leaves), then ``training_flags`` (traced
   ``training=self.training`` arguments follow ``train()``/``eval()`` again); where the model's own code does not
   trace, ``regions`` captures it region by region and ``stitch`` makes one planning graph of the regions
   (``eager_flops`` and ``eager_saved`` measure the eager code between them)
2. ``analysis/`` (run by ``fxapprox.pipeline.analysis.analyse``) — ``flops`` (2a, first: it names the node a model
   fails at), ``shape_prop`` (2b), ``saved_bytes`` (2c), ``channels`` (2d); ``rank`` (3) orders the sampleable
   layers, widest and most expensive first; ``graph_view`` is the ``networkx`` view
3. ``measurement/`` — ``candidates`` (4a): blockers and the candidate grid per layer (from the op-kind registry,
   ``fxapprox.op_kinds``); ``measure_candidates`` (4b): each candidate's errors and speed on the example batch;
   ``error_model``: what a candidate is predicted to add to the gradient error
4. ``policy/`` — ``budget_policy`` (4c): the explicit :class:`fxapprox.plan.Plan` (``measured_policy``,
   ``payoff``, ``interpolation``, ``fixed_ratio_policy``, ``plan_note``); ``input_saving`` (4d): what each
   forward-sampled layer keeps of its input for backward
5. ``rewrite`` — swap planned nodes for sampled ops (Linear, Conv2d, LSTM, …)
6. ``memory/`` — with a ``memory_budget``, after the rewrite (``fxapprox.pipeline.memory_planning``):
   ``compact_pooling`` (6a), ``attention_recompute`` (6b), ``saved_bytes`` again, ``measure_saved`` (6c: each
   saved value's gradient cost when quantised), on a traced model ``blocks`` (the blocks that may be
   checkpointed) and ``measure_blocks`` (what each option costs in step time), ``memory_policy`` (6d: which blocks
   to checkpoint and bits per saved graph value, the fastest plan that fits; ``saved_values`` is its model of the
   values), ``rewrite_saved`` (6e: a ``compress_saved`` marker after each planned value) and
   ``rewrite_checkpoint`` (the training forward's copy of the graph with each checkpointed block one call)
7. ``guard/`` — ``check_plan`` (4e): the plan run on the example batch against exact training before it trains,
   made again where its errors passed the predictions; ``replan``: the compute plan made again during training
   from the guard's measurements (under ``budget="auto"`` past ``max_grad_error`` or when the plan stops paying;
   under a numeric budget past ``divergence_error``)
"""

from fxapprox.passes.analysis.channels import annotate_channels
from fxapprox.passes.analysis.flops import count_flops
from fxapprox.passes.analysis.graph_view import to_networkx
from fxapprox.passes.analysis.rank import rank_layers
from fxapprox.passes.analysis.saved_bytes import measure_saved_bytes
from fxapprox.passes.analysis.shape_prop import propagate_shapes
from fxapprox.passes.capture.trace import ApproxTracer, trace
from fxapprox.passes.capture.training_flags import follow_training_mode
from fxapprox.passes.measurement.candidates import enumerate_candidates
from fxapprox.passes.measurement.measure_candidates import measure_candidates
from fxapprox.passes.memory.blocks import find_blocks
from fxapprox.passes.memory.compact_pooling import compact_max_pools
from fxapprox.passes.memory.measure_saved import measure_saved_values
from fxapprox.passes.memory.memory_policy import plan_memory
from fxapprox.passes.memory.rewrite_checkpoint import checkpointed_graph
from fxapprox.passes.memory.rewrite_saved import rewrite_saved_activations
from fxapprox.passes.policy.budget_policy import plan_budget
from fxapprox.passes.policy.input_saving import plan_input_saving
from fxapprox.passes.rewrite import rewrite_sampled_ops

__all__ = [
    "ApproxTracer", "annotate_channels", "checkpointed_graph", "compact_max_pools", "count_flops",
    "enumerate_candidates", "find_blocks", "follow_training_mode", "measure_candidates", "measure_saved_bytes",
    "measure_saved_values", "plan_budget", "plan_input_saving", "plan_memory", "propagate_shapes", "rank_layers",
    "rewrite_sampled_ops", "rewrite_saved_activations", "to_networkx", "trace",
]
