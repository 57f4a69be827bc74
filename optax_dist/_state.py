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

import jax

KEEP = "keep"
"""Global state, identical on every worker: worker 0's value, exactly, on every new worker."""

MEAN = "mean"
"""The workers' mean (exactly worker 0's value wherever every worker holds the same one)."""

INNER = "inner"
"""An inner state: nested library states are walked, optax's own states follow the mode."""


def is_library_state(node: Any) -> bool:
  """Whether ``node`` is a state of an optax_dist transformation (it declares ``RESIZE``)."""
  return isinstance(node, tuple) and isinstance(getattr(type(node), "RESIZE", None), dict)


def children(node: Any) -> tuple[list, Any]:
  """``node``'s direct pytree children and the treedef that rebuilds it from them."""
  return jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)


def is_leaf(node: Any) -> bool:
  """Whether ``node`` is a pytree leaf (an array, a scalar; ``None`` is a node with none)."""
  return jax.tree_util.all_leaves([node])


def holds(node: Any, predicate: Any) -> bool:
  """Whether ``node`` or a node below it satisfies ``predicate``."""
  if predicate(node):
    return True
  return not is_leaf(node) and any(holds(c, predicate) for c in children(node)[0])


def _is_leafy_record(node: Any) -> bool:
  """A ``NamedTuple`` holding arrays (``MaskedNode`` and ``EmptyState`` hold none)."""
  return isinstance(node, tuple) and hasattr(node, "_fields") and bool(jax.tree.leaves(node))


def is_record(node: Any) -> bool:
  """One optax state (``ScaleByAdamState``, ``TraceState``, ...): a ``NamedTuple`` of arrays
  with no other state inside, reset or kept as a whole (adam's count with its moments)."""
  if not _is_leafy_record(node) or is_library_state(node):
    return False
  return not any(holds(c, _is_leafy_record) for c in children(node)[0])


def map_fields(field: Any, other: Any, node: Any, *like: Any) -> Any:
  """``node`` rebuilt by its states' declared rules: each library state field by field, as
  ``field(rule, value, *like_values)`` (``rule`` its ``RESIZE`` entry); each subtree holding no
  library state as ``other(subtree, *like_subtrees)``; the containers between, child by child.
  ``like``: trees of ``node``'s structure walked alongside it (e.g. a template). ``field``
  walks an ``INNER`` field itself (by calling back into its own walk) if it wants to."""
  if is_library_state(node):
    return type(node)(**{
      name: field(rule, getattr(node, name), *(getattr(t, name) for t in like))
      for name, rule in node.RESIZE.items()})
  if is_leaf(node) or not holds(node, is_library_state):
    return other(node, *like)
  kids, treedef = children(node)
  likes = [children(t)[0] for t in like]
  return treedef.unflatten(
    [map_fields(field, other, c, *(kid[k] for kid in likes)) for k, c in enumerate(kids)])


def declared(node: Any, attribute: str) -> Any:
  """The field that the first library state in a depth-first walk of ``node`` names by its
  ``attribute`` (``"AVERAGE"`` or ``"RESTART"``), skipping states that declare ``None``; or
  ``None`` if no state declares one. The outermost wrapper comes first, then an
  ``optax.chain``'s members in order."""
  if is_library_state(node) and getattr(node, attribute) is not None:
    return getattr(node, getattr(node, attribute))
  if is_leaf(node):
    return None
  for child in children(node)[0]:
    found = declared(child, attribute)
    if found is not None:
      return found
  return None
