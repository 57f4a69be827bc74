"""The outer step of the DiLoCo family: one optimizer step on the workers' mean pseudo-gradient."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import optax

from optax_dist import _axis


def default_outer() -> optax.GradientTransformation:
  """The DiLoCo paper's outer optimizer: Nesterov momentum SGD, learning rate 0.7, momentum 0.9."""
  return optax.sgd(0.7, momentum=0.9, nesterov=True)


def pseudo_gradient(anchor: Any, new_params: Any) -> Any:
  """This worker's pseudo-gradient :math:`\\theta - x'`, in the anchor's dtypes."""
  return jax.tree.map(lambda a, x: a - x.astype(a.dtype), anchor, new_params)


def outer_step(
  outer: optax.GradientTransformation, anchor: Any, outer_state: optax.OptState, delta: Any
) -> tuple[Any, optax.OptState]:
  """One step of ``outer`` from ``anchor`` on the pseudo-gradient ``delta``, dtypes kept."""
  steps, new_outer_state = outer.update(delta, outer_state, anchor)
  new_anchor = _axis.keep_dtypes(optax.apply_updates(anchor, steps), anchor)
  return new_anchor, _axis.keep_dtypes(new_outer_state, outer_state)


def outer_sync(
  outer: optax.GradientTransformation,
  anchor: Any,
  outer_state: optax.OptState,
  new_params: Any,
  *,
  axis_name: Hashable | None,
  num_workers: int,
  comm_dtype: Any = None,
) -> tuple[Any, optax.OptState]:
  """One DiLoCo sync of ``anchor`` (a tree, or a sub-tree with ``optax.MaskedNode`` leaves).

  The pseudo-gradient is :math:`\\Delta = \\frac{1}{N}\\sum_j (\\theta - x'_j)`, computed in the
  anchor's dtype and all-reduced in ``comm_dtype``; then ``outer`` takes one step on it from
  :math:`\\theta`. ``axis_name=None`` means one worker: :math:`\\Delta = \\theta - x'`.

  Returns:
    The new anchor and outer state, with the dtypes of the old ones.
  """
  delta = pseudo_gradient(anchor, new_params)
  if axis_name is not None:
    delta = _axis.worker_mean(delta, axis_name, num_workers, comm_dtype)
  return outer_step(outer, anchor, outer_state, delta)
