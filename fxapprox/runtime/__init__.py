"""What runs while an approximated model trains: its call path and public surface (``model.py``: ``.plan``,
``.report``, ``.history``, ``.set_approximate``), the state it carries (``model_state.py``), the sampled modules the
rewrite puts in the graph (``modules.py``), the guard (``guard.py``), compressed saving of activations
(``saved_activations.py``, ``saved_markers.py``, ``saved_tensors.py``, ``recompute.py``; under ``torch.compile``
``compiled_saving.py``), checkpointed blocks
(``checkpointing.py``), pickling (``graph_pickle.py``), BatchNorm recalibration (``calibration.py``) and counting a
block's host syncs (``host_sync.py``). The kernels themselves are in ``fxapprox.ops``."""
