"""How :func:`fxapprox.approximate` runs the passes (``fxapprox.passes``): the analysis stage (``analysis.py``), the
compute plan (``compute_plan.py``), the memory plan (``memory_planning.py``), a model torch.fx cannot trace planned
region by region (``eager.py``), plans that agree across ranks (``ranks.py``), and what the passes share: their
per-node records (``records.py``), per-layer rules (``overrides.py``), the per-machine timing cache
(``timing_cache.py``) and the loss they backpropagate when the user gives none (``_projection.py``)."""
