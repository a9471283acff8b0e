"""Mixed schedules: approximate training for part of the run, exact for the rest.

Zhu et al. train with the sparse backward for most steps and finish dense
(e.g. the first ¾ sparse, the last ¼ dense), which recovers dense accuracy in
less time. :class:`SparseThenDense` switches an approximated module with
:meth:`fxapprox.ApproxGraphModule.set_approximate` at the right step.
"""

from __future__ import annotations

from fxapprox._validate import check_fraction, check_int


class SparseThenDense:
    """Approximate for the first ``sparse_fraction`` of ``total_steps``, exact afterwards.

    Call :meth:`step` once per training step, before the forward pass.

    Example::

        >>> schedule = fxapprox.SparseThenDense(approx, total_steps=1000, sparse_fraction=0.75)
        >>> for x, y in loader:
        ...     schedule.step()                  # steps 0..749 approximate, 750.. exact
        ...     loss_fn(approx(x), y).backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, approx, total_steps: int, sparse_fraction: float = 0.75) -> None:
        if not hasattr(approx, "set_approximate"):
            raise TypeError(f"approx must be a module returned by fxapprox.approximate, got {type(approx).__name__}")
        self.approx = approx
        self.total_steps = check_int("total_steps", total_steps, minimum=1)
        self.sparse_fraction = check_fraction("sparse_fraction", sparse_fraction, allow_zero=True)
        self.switch_step = round(self.sparse_fraction * self.total_steps)
        self.steps_taken = 0

    @property
    def approximating(self) -> bool:
        """Whether the next step is approximate."""
        return self.steps_taken < self.switch_step

    def step(self) -> bool:
        """Set the module's mode for the coming step; returns whether it approximates."""
        approximate = self.approximating
        self.approx.set_approximate(approximate)
        self.steps_taken += 1
        return approximate


__all__ = ["SparseThenDense"]
