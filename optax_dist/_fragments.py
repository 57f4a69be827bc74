"""Streaming DiLoCo's fragments: which param leaves sync together, and their masked parts."""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from optax_dist import _checks

STRATEGIES = ("contiguous", "balanced")
"""The assignments :func:`streaming_diloco_fragments` computes from the leaves' sizes."""


def streaming_diloco_fragments(
  params: Any, num_fragments: int, strategy: Any = "contiguous"
) -> tuple[int, ...]:
  r"""The fragment of each param leaf, as :func:`streaming_diloco` assigns them.

  With :math:`n_j` the element count of leaf j (in ``jax.tree.leaves`` order), C the total and
  F = ``num_fragments``:

  * ``"contiguous"`` (``streaming_diloco``'s ``fragments=None``): runs of about equal element
    counts, leaf j in fragment :math:`\lfloor F c_j / C \rfloor`, :math:`c_j = \sum_{k<j} n_k`;
  * ``"balanced"``: the leaves by decreasing size, each to the fragment with the fewest
    elements so far (the lowest id on a tie);
  * a tree of int ids with the params' structure: those ids.

  Args:
    params: the params (arrays or ``jax.ShapeDtypeStruct``); only their shapes are read.
    num_fragments: F, a positive int.
    strategy: ``"contiguous"`` (default), ``"balanced"`` or a tree of ids in ``[0, F)``.

  Returns:
    A tuple of ints in ``[0, F)``, one per leaf of ``params`` in ``jax.tree.leaves`` order;
    ``jax.tree.unflatten(jax.tree.structure(params), ids)`` makes it a ``fragments=`` tree.

  Collectives:
    None.

  Raises:
    TypeError: ``num_fragments`` or an id not an int.
    ValueError: ``num_fragments`` below 1; ``strategy`` none of the choices; an id outside
      ``[0, F)``; a tree of ids without the params' structure; a fragment left without a leaf.

  Examples:
    >>> import jax.numpy as jnp, optax_dist
    >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(6), "c": jnp.zeros(4)}
    >>> optax_dist.streaming_diloco_fragments(params, 2)
    (0, 0, 1)
    >>> optax_dist.streaming_diloco_fragments(params, 2, "balanced")
    (1, 0, 1)

  References:
    Douillard et al., `Streaming DiLoCo with overlapping communication
    <https://arxiv.org/abs/2501.18512>`_, 2025 (fragments of the model's layers).
  """
  fn = "streaming_diloco_fragments"
  _checks.check_positive_int(fn, "num_fragments", num_fragments)
  check_strategy(fn, strategy, num_fragments, name="strategy")
  return assign(fn, params, num_fragments, strategy, name="strategy")


def check_strategy(fn: str, strategy: Any, num_fragments: int, name: str = "fragments") -> None:
  """Raise unless ``strategy`` is ``None``, one of :data:`STRATEGIES` or a tree of int ids in
  ``[0, num_fragments)``."""
  if strategy is None or isinstance(strategy, str):
    if strategy is not None:
      _checks.check_choice(fn, name, strategy, STRATEGIES)
    return
  for path, leaf in jax.tree_util.tree_leaves_with_path(strategy):
    value = _checks.concrete(leaf)
    where = jax.tree_util.keystr(path) or "<root>"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise TypeError(
        f"`{fn}({name}=...)` must hold an int fragment id per param leaf, got {leaf!r} at"
        f" {where}."
      )
    if not 0 <= value < num_fragments:
      raise ValueError(
        f"`{fn}({name}=...)` ids must be in [0, num_fragments) = [0, {num_fragments}),"
        f" got {value} at {where}."
      )


def assign(
  fn: str, params: Any, num_fragments: int, strategy: Any = None, name: str = "fragments"
) -> tuple[int, ...]:
  """The fragment of each leaf of ``params`` (``strategy`` checked by :func:`check_strategy`).

  Raises:
    ValueError: a tree of ids without the params' structure; a fragment left empty.
  """
  leaves = jax.tree.leaves(params)
  sizes = [_size(leaf) for leaf in leaves]
  if strategy == "balanced":
    ids = _balanced(sizes, num_fragments)
  elif strategy is None or strategy == "contiguous":
    total, before, ids = sum(sizes), 0, []
    for size in sizes:
      ids.append(num_fragments * before // total if total else 0)
      before += size
    ids = tuple(ids)
  else:
    got, want = jax.tree.structure(strategy), jax.tree.structure(params)
    if got != want:
      raise ValueError(
        f"`{fn}({name}=...)` must have the params' tree structure, got {got}, expected {want}."
      )
    ids = tuple(int(_checks.concrete(f)) for f in jax.tree.leaves(strategy))
  empty = sorted(set(range(num_fragments)) - set(ids))
  if empty and not isinstance(strategy, (str, type(None))):
    raise ValueError(
      f"`{fn}({name}=...)` assigns no leaf to fragment {empty[0]} of"
      f" num_fragments={num_fragments}; use every id in [0, {num_fragments}) or pass a"
      " smaller num_fragments."
    )
  if empty:
    raise ValueError(
      f"`{fn}(num_fragments=...)` must leave no fragment empty, got {num_fragments}"
      f" fragments for {len(leaves)} param leaves of sizes {sizes} (fragment {empty[0]} gets"
      f" no leaf). Pass fewer fragments, or an explicit `{name}=` tree of ids."
    )
  return ids


def _size(leaf: Any) -> int:
  return int(np.prod(leaf.shape if hasattr(leaf, "shape") else np.shape(leaf), dtype=np.int64))


def _balanced(sizes: list[int], num_fragments: int) -> tuple[int, ...]:
  """The largest leaf first, to the fragment with the fewest elements."""
  totals, ids = np.zeros(num_fragments, np.int64), [0] * len(sizes)
  for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
    ids[j] = int(np.argmin(totals))
    totals[ids[j]] += sizes[j]
  return tuple(ids)


class Fragments(NamedTuple):
  """The leaves of one params tree split into fragments: a fragment's part is the tree with the
  other fragments' leaves replaced by ``optax.MaskedNode()`` (as ``optax.masked`` does).

  Attributes:
    ids: the fragment of each leaf, in ``jax.tree.leaves`` order.
    treedef: the params' tree structure.
  """

  ids: tuple[int, ...]
  treedef: Any

  def part(self, leaves: list | None, fragment: int) -> Any:
    """Fragment ``fragment``'s part of the tree of ``leaves`` (``None`` stays ``None``)."""
    if leaves is None:
      return None
    return self.treedef.unflatten(
      [x if f == fragment else optax.MaskedNode() for x, f in zip(leaves, self.ids, strict=True)]
    )

  def put(self, leaves: list | None, part: Any, fragment: int) -> list | None:
    """``leaves`` with fragment ``fragment``'s replaced by those of its ``part``."""
    if leaves is None:
      return None
    return [
      a if i != fragment else b
      for a, b, i in zip(leaves, self.leaves(part), self.ids, strict=True)
    ]

  @staticmethod
  def leaves(part: Any) -> list:
    """The leaves of a part, ``MaskedNode`` included, in the full tree's leaf order."""
    return jax.tree.leaves(part, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
