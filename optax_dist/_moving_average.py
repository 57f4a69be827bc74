"""An exponential moving average of the parameters (TF's ``MovingAverageOptimizer``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dist import _axis, _checks, _state


class MovingAverageState(NamedTuple):
  """State of :func:`moving_average`.

  Attributes:
    count: ``int32[]``, the number of ``update`` calls so far.
    ema: the exponential moving average of the parameters; the params' tree and shapes, each leaf
      in ``ema_dtype`` (default: that param's dtype).
    inner_state: the state of the wrapped transformation.
  """

  count: jax.Array
  ema: optax.Params
  inner_state: optax.OptState

  AVERAGE = "ema"  # eval_params returns this field
  RESTART = None  # resize_state restarts the workers' params from this field
  RESIZE = {"count": _state.KEEP, "ema": _state.MEAN, "inner_state": _state.INNER}


def moving_average(
  inner: optax.GradientTransformation,
  decay: float | optax.Schedule = 0.9999,
  *,
  use_num_updates: bool = False,
  sequential_update: bool = True,
  ema_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Keeps an exponential moving average (EMA) of the parameters beside ``inner``.

  The updates of ``inner`` are returned unchanged; the average lives in the state and is what
  :func:`optax_dist.eval_params` returns, to evaluate and to save (TF's ``swapping_saver``).
  With :math:`t` the number of ``update`` calls after this one and :math:`p` the params:

  .. math::

    d_t &= \mathrm{decay}(t - 1) \quad (\text{a float, or a schedule called with the count
      before the increment}) \\
    d_t &\leftarrow \min\left(d_t, \tfrac{1 + t}{10 + t}\right) \quad (\text{if
      use\_num\_updates}) \\
    \mathrm{ema}_t &= d_t\, \mathrm{ema}_{t-1} + (1 - d_t)\, p

  where :math:`p` is the params *after* this update (``sequential_update=True``, computed as
  ``optax.apply_updates`` would) or *before* it (``sequential_update=False``). The average starts
  equal to the params given to ``init`` (not zeros, so no debiasing is needed).

  Args:
    inner: the transformation whose updates are applied to the params.
    decay: dimensionless rate in [0, 1], or an optax schedule of the ``update`` count.
    use_num_updates: cap the decay at :math:`(1 + t) / (10 + t)` so that the average tracks the
      params closely early on (TF's ``ExponentialMovingAverage(num_updates=global_step)``).
    sequential_update: average the params after this update (``True``) or before it.
    ema_dtype: dtype of the average (default: each param's dtype). ``jnp.float32`` is the usual
      choice for bfloat16 params.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; extra args are forwarded to ``inner``.

  Shapes:
    ``updates`` and ``params`` share one tree; the returned updates have the same tree, shapes and
    dtypes as ``inner``'s. ``ema`` has the params' tree and shapes. Memory: one extra copy of the
    params (in ``ema_dtype``).

  Collectives:
    None. Under a mapped axis every worker keeps the average of its own params.

  Raises:
    TypeError: ``inner`` is not a transformation; ``decay`` is not a number or a callable;
      ``ema_dtype`` not ``None`` or a floating dtype; a param leaf is not floating point (the
      message names the leaf's path).
    ValueError: ``decay`` outside [0, 1]; ``update`` called without ``params`` or with updates
      whose shapes differ from the params' (the message names the leaf and both shapes).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_dist
    >>> params = {"w": jnp.array([1.0, 2.0])}
    >>> tx = optax_dist.moving_average(optax.sgd(2.0), decay=0.5)
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([0.1, 0.1])}, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> params["w"], optax_dist.eval_params(state, params)["w"]
    (Array([0.8, 1.8], dtype=float32), Array([0.9, 1.9], dtype=float32))

  References:
    TensorFlow 1.x, ``tf.contrib.opt.MovingAverageOptimizer`` and
    ``tf.train.ExponentialMovingAverage``.
    Polyak & Juditsky, `Acceleration of Stochastic Approximation by Averaging
    <https://doi.org/10.1137/0330046>`_, 1992.
  """
  fn = "moving_average"
  _checks.check_transformation(fn, inner)
  inner = _axis.wrap_inner(inner)  # unknown extra args dropped, state dtypes kept
  if not callable(decay):
    _checks.check_number(fn, "decay", decay, lower=0.0, upper=1.0, constraint="in [0, 1]")
  ema_dtype = _checks.check_floating_dtype(fn, "ema_dtype", ema_dtype)

  def init_fn(params):
    _checks.check_floating(fn, params)
    return MovingAverageState(
      count=jnp.zeros([], jnp.int32),
      ema=_axis.copy(params, ema_dtype),
      inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    _checks.require_params(fn, params)
    _checks.check_tree_matches(fn, updates, state.ema, "params")
    updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)

    d = decay(state.count) if callable(decay) else decay
    count = optax.safe_increment(state.count)
    if use_num_updates:
      t = count.astype(jnp.float32)
      d = jnp.minimum(d, (1.0 + t) / (10.0 + t))

    p = optax.apply_updates(params, updates) if sequential_update else params
    # ema = d ema + (1 - d) p, written as TF's assign_moving_average writes it,
    # ema - (1 - d) (ema - p): exact (ema stays put) wherever p equals ema.
    ema = jax.tree.map(
      lambda e, x: (e - (1.0 - d) * (e - x.astype(e.dtype))).astype(e.dtype), state.ema, p
    )
    return updates, MovingAverageState(count=count, ema=ema, inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
