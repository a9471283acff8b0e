"""The approximable op kinds: the registry (``registry.py``: :class:`OpKind`, :func:`register_op_kind`, the lookups
the passes use) and the built-in kinds (``builtin.py``), registered here by one explicit call so that the registry
is complete whichever module is imported first.

A new kind is one :class:`OpKind` subclass and one :func:`register_op_kind` call::

    >>> from fxapprox.op_kinds import OP_KINDS
    >>> sorted(OP_KINDS)
    ['conv1d_hf', 'conv2d', 'conv2d_fn', 'linear', 'linear_fn', 'lstm', 'matmul']
"""

from fxapprox.op_kinds.builtin import register_builtin_op_kinds
from fxapprox.op_kinds.registry import OP_KINDS, OpKind, handler_for, match_node, register_op_kind

register_builtin_op_kinds()

__all__ = ["OP_KINDS", "OpKind", "handler_for", "match_node", "register_op_kind"]
