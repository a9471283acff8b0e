"""Stages 3–4, candidates and measurement: what each layer may become (``candidates``), each candidate's errors
and speed on the example batch (``measure_candidates``, with ``_isolation`` and ``_upstream``), and the error model
the policies predict with (``error_model``)."""
