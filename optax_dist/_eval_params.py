"""The parameters to evaluate and to save: the average kept by the outermost averaging wrapper."""

from __future__ import annotations

import jax
import optax

from optax_dist import _state


def eval_params(opt_state: optax.OptState, params: optax.Params) -> optax.Params:
  """The parameters to evaluate and to save (TF's ``swapping_saver``).

  Of the averaging states in ``opt_state`` (each declares its field as ``AVERAGE``:
  :class:`MovingAverageState` gives its ``ema``;
  :class:`ElasticAverageState` and :class:`AGNState` give their ``center``;
  :class:`DiLoCoState` and :class:`StreamingDiLoCoState` their ``anchor``; :class:`LocalSGDState`
  has none, each worker's params being identical right after a model average), the first in a
  depth-first walk: the outermost wrapper, or in an ``optax.chain`` the earliest member. It is
  cast to the params' dtypes and returned in the params' tree. With no averaging state,
  ``params`` is returned unchanged.

  Args:
    opt_state: the state of a transformation built from optax and optax_dist pieces.
    params: the current params, giving the tree and dtypes of the result.

  Returns:
    A tree like ``params``: the average, or ``params`` itself.

  Shapes:
    Same as ``params``. Under a mapped axis, call it per worker (the center and the anchor are
    identical on every worker; the EMA is each worker's own).

  Collectives:
    None.

  Raises:
    ValueError: the average's tree differs from the params' tree.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_dist
    >>> tx = optax.chain(optax.clip(1.0), optax_dist.moving_average(optax.sgd(1.0), 0.5))
    >>> params = jnp.array([1.0])
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jnp.array([1.0]), state, params)
    >>> optax_dist.eval_params(state, optax.apply_updates(params, updates))
    Array([0.5], dtype=float32)

  References:
    TensorFlow 1.x, ``MovingAverageOptimizer.swapping_saver`` and
    ``ElasticAverageOptimizer.swapping_saver``.
  """
  average = _state.declared(opt_state, "AVERAGE")
  if average is None:
    return params
  got, want = jax.tree.structure(average), jax.tree.structure(params)
  if got != want:
    raise ValueError(
      f"`eval_params`: the averaged parameters have tree {got} but `params` has {want}; pass"
      " the params this optimizer state was built for."
    )
  return optax.tree.cast_like(average, params)
