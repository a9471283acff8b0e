"""Count the operations of a block that make the host wait on the device.

On a GPU, reading a device value on the host (``.item()``, ``int(tensor)``, Python control flow on a tensor) or
running an op whose output shape depends on the data (``nonzero``, ``unique``, boolean masking) stalls the stream
until the device catches up; under ``torch.compile`` the same ops break the graph. :class:`count_host_syncs` is a
``TorchDispatchMode`` that counts them, op by op, on any device (the CPU included, where they cost nothing but
show what a GPU would wait for).

Example::

    >>> with fxapprox.count_host_syncs() as syncs:
    ...     approx(x).sum().backward()
    >>> syncs.total, syncs.counts
    (0, {})
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_SYNC_OPS", "count_host_syncs"]

_aten = torch.ops.aten

#: ops that read a device value on the host or whose output shape depends on the data (their overload packets)
HOST_SYNC_OPS = frozenset({
    _aten._local_scalar_dense, _aten.is_nonzero, _aten.equal, _aten.nonzero, _aten.argwhere, _aten._unique,
    _aten._unique2, _aten.unique_dim, _aten.unique_consecutive, _aten.masked_select, _aten.repeat_interleave,
    _aten.bincount,
})


class count_host_syncs(TorchDispatchMode):  # noqa: N801 — used like a function: ``with count_host_syncs() as c``
    """Count, by op name, the host-synchronising and data-dependent-shape ops run inside the block (forward and
    backward alike); :data:`HOST_SYNC_OPS` lists them. ``total`` is their number."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in HOST_SYNC_OPS:
            self.counts[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())
