"""Stage 4, policy: the budget turned into an explicit, serialisable plan (``budget_policy``: the measured policy in
``measured_policy`` with ``payoff``, ``interpolation`` and the knapsack in ``_allocation``; the fixed-ratio policies
in ``fixed_ratio_policy``; the note in ``plan_note``; shared records in ``policy_types``) and what each
forward-sampled layer keeps of its input (``input_saving``). The rewrite that applies the plan is
``fxapprox.passes.rewrite``."""
