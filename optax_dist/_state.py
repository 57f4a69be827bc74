"""What each library state declares beside its fields, for :func:`eval_params` and
:func:`resize_state` to read.

Every ``<Transform>State`` of optax_dist carries three class attributes (not fields: they are
not part of the pytree, and checkpoints hold only the fields):

* ``RESIZE``: per field, how :func:`resize_state` carries it to another number of workers:
  :data:`KEEP`, :data:`MEAN` or :data:`INNER`;
* ``AVERAGE``: the field holding the averaged params that :func:`eval_params` returns (the EMA,
  the center, the anchor), or ``None``;
* ``RESTART``: the field the workers' params restart from after a resize (the center or the
  anchor), or ``None`` (the workers' mean).
"""

from __future__ import annotations

from typing import Any

KEEP = "keep"
"""Global state, identical on every worker: worker 0's value, exactly, on every new worker."""

MEAN = "mean"
"""The workers' mean (exactly worker 0's value wherever every worker holds the same one)."""

INNER = "inner"
"""An inner state: nested library states are walked, optax's own states follow the mode."""


def is_library_state(node: Any) -> bool:
  """Whether ``node`` is a state of an optax_dist transformation (it declares ``RESIZE``)."""
  return isinstance(node, tuple) and isinstance(getattr(type(node), "RESIZE", None), dict)
