"""Stage 6, memory (with a ``memory_budget``): compact pooling and attention from saved inputs
(``compact_pooling``, ``attention_recompute``), the saved values (``saved_values``) and what compressing each costs
(``measure_saved``), the blocks that may be checkpointed (``blocks``) and what each option costs in time
(``measure_blocks``), the plan (``memory_policy``) and its rewrites (``rewrite_saved``: marker nodes;
``rewrite_checkpoint``: the training forward with checkpointed blocks)."""
