"""Plans and measurements that agree across the ranks of ``torch.distributed`` (DDP): every rank trains with rank
0's plan, and the guard's measurements are averaged over the ranks before it acts on them.
"""

from __future__ import annotations

import dataclasses

import torch

from fxapprox.pipeline.records import DECISION_KEY, candidates_of, decision_of
from fxapprox.plan import Plan
from fxapprox.runtime.model_state import ModelState

__all__ = ["agreed_plan", "mean_over_ranks", "plan_of_rank_zero"]


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agreed_plan(gm, plan: Plan, state: ModelState) -> Plan:
    """Under ``torch.distributed``, the first plan every rank trains with: rank 0's, where every rank planned with
    the same budget, method and config. The measured policy times candidates on each rank, and timings differ from
    rank to rank; the plans must not (DDP's sampled AllReduce sums the same sampled rows on every rank). Ranks
    asked for different plans keep their own, and ``register_sampled_allreduce`` says which rank has which.
    Every rank must plan (it is a collective), as every rank runs the first batch."""
    import torch.distributed as dist

    if not _distributed():
        return plan
    settings = repr((state.budget, state.method, state.memory_budget, state.config.to_dict()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, settings)
    if len(set(gathered)) > 1:
        return plan
    return plan_of_rank_zero(gm, plan)


def plan_of_rank_zero(gm, plan: Plan) -> Plan:
    """Under DDP, rank 0's plan (each rank planned from its own timings); its choices are also recorded in
    every rank's graph meta, which the next checks' predictions read."""
    import torch.distributed as dist

    if not _distributed():
        return plan
    payload = [plan.to_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    plan = Plan.from_dict(payload[0])
    nodes = {n.name: n for n in gm.graph.nodes}
    for decision in plan.layers:
        node = nodes.get(decision.node)
        if node is None or candidates_of(node) is None or decision_of(node) is None:
            continue
        matching = [c for c in candidates_of(node).candidates
                    if (c.mode, c.method, c.k) == (decision.mode, decision.method, decision.k)]
        planned = decision_of(node)
        node.meta[DECISION_KEY] = dataclasses.replace(
            planned, chosen=(matching[0] if matching else planned.chosen) if decision.approximate else None)
    return plan


def mean_over_ranks(values: list[float], device) -> list[float]:
    """``values`` averaged over the ranks of the default process group (unchanged when not distributed)."""
    import torch.distributed as dist

    if not _distributed():
        return values
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()
