"""Dropping gradients computed against an old global step (TF's ``DropStaleGradientOptimizer``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dist import _axis, _checks, _state


class DropStaleGradientsState(NamedTuple):
  """State of :func:`drop_stale_gradients`.

  Attributes:
    global_step: ``int32[]``, the number of accepted updates so far.
    num_dropped: ``int32[]``, the number of dropped updates so far (TF's ``stale_counter``).
    inner_state: the state of the wrapped transformation; unchanged by a dropped update.
  """

  global_step: jax.Array
  num_dropped: jax.Array
  inner_state: optax.OptState

  AVERAGE = None  # eval_params returns this field
  RESTART = None  # resize_state restarts the workers' params from this field
  RESIZE = {
    "global_step": _state.KEEP, "num_dropped": _state.KEEP, "inner_state": _state.INNER,
  }


def _check_grad_step(grad_step: Any) -> None:
  dtype = jnp.result_type(grad_step)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
      "`drop_stale_gradients` update: `grad_step` must be an integer global step, got dtype"
      f" {dtype}."
    )
  if jnp.ndim(grad_step) != 0:
    raise ValueError(
      "`drop_stale_gradients` update: `grad_step` must be a scalar, got shape"
      f" {jnp.shape(grad_step)}."
    )


def drop_stale_gradients(
  inner: optax.GradientTransformation, max_staleness: int
) -> optax.GradientTransformationExtraArgs:
  r"""Drops updates whose gradients were computed against a ``global_step`` that is too old.

  The caller says which ``global_step`` it read when it computed the gradients
  (``grad_step=``); with :math:`s` = ``global_step - grad_step`` the staleness:

  .. math::

    s \le \mathrm{max\_staleness}:&\quad u = \mathrm{inner}(g), \quad
      \mathrm{global\_step} \mathrel{+}= 1 \\
    s > \mathrm{max\_staleness}:&\quad u = 0, \quad \mathrm{inner\_state} \text{ unchanged},
      \quad \mathrm{num\_dropped} \mathrel{+}= 1

  A negative ``max_staleness`` drops everything. ``grad_step=None`` means the current
  ``global_step`` (staleness 0). The inner update is always computed and then selected
  (``optax.tree.where``), so collectives inside ``inner`` run on every worker whatever each one
  decides.

  Wrapped in another transformation (``moving_average(drop_stale_gradients(...))``,
  ``optax.chain``), the state is nested; read ``global_step`` (or ``num_dropped``) with
  ``optax.tree_utils.tree_get(state, "global_step")``, which finds the one field of that name at
  any depth. It returns ``None`` when there is no such field and raises ``KeyError`` when there
  are several (two nested ``drop_stale_gradients``): then pass ``filtering=`` or index the state.

  Args:
    inner: the transformation applied to accepted updates.
    max_staleness: the largest accepted staleness, a count of accepted updates (TF's
      ``staleness``); an int, negative allowed.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes the keyword-only
    ``grad_step`` (an integer scalar) and forwards other extra args to ``inner``.

  Shapes:
    The returned updates have the tree, shapes and dtypes of ``inner``'s.

  Collectives:
    None of its own.

  Raises:
    TypeError: ``inner`` is not a transformation; ``max_staleness`` is not an int; ``grad_step``
      is not an integer.
    ValueError: ``grad_step`` is not a scalar.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_dist
    >>> tx = optax_dist.drop_stale_gradients(optax.sgd(1.0), max_staleness=0)
    >>> params = jnp.array([0.0])
    >>> state = tx.init(params)
    >>> u, state = tx.update(jnp.array([-1.0]), state, params, grad_step=0)  # fresh: accepted
    >>> u, state = tx.update(jnp.array([-1.0]), state, params, grad_step=0)  # stale by 1
    >>> u, state.global_step, state.num_dropped
    (Array([0.], dtype=float32), Array(1, dtype=int32), Array(1, dtype=int32))

    Nested, ``global_step`` is read with ``optax.tree_utils.tree_get``:

    >>> tx = optax_dist.moving_average(
    ...     optax_dist.drop_stale_gradients(optax.sgd(1.0), max_staleness=0), decay=0.5)
    >>> state = tx.init(params)
    >>> grad_step = optax.tree_utils.tree_get(state, "global_step")  # read with the gradients
    >>> u, state = tx.update(jnp.array([-1.0]), state, params, grad_step=grad_step)
    >>> optax.tree_utils.tree_get(state, "global_step"), state.inner_state.global_step
    (Array(1, dtype=int32), Array(1, dtype=int32))

  References:
    TensorFlow 1.x, ``tf.contrib.opt.DropStaleGradientOptimizer``.
    Dutta et al., `Slow and Stale Gradients Can Win the Race
    <https://arxiv.org/abs/1803.01113>`_, AISTATS 2018.
  """
  fn = "drop_stale_gradients"
  _checks.check_transformation(fn, inner)
  inner = _axis.wrap_inner(inner)  # unknown extra args dropped, state dtypes kept
  _checks.check_int(fn, "max_staleness", max_staleness)

  def init_fn(params):
    return DropStaleGradientsState(
      global_step=jnp.zeros([], jnp.int32),
      num_dropped=jnp.zeros([], jnp.int32),
      inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, *, grad_step=None, **extra_args):
    if grad_step is None:
      staleness = jnp.zeros([], jnp.int32)
    else:
      _check_grad_step(grad_step)
      staleness = state.global_step - jnp.asarray(grad_step, jnp.int32)
    accepted = staleness <= max_staleness

    new_updates, new_inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    updates = optax.tree.where(accepted, new_updates, optax.tree.zeros_like(new_updates))
    inner_state = optax.tree.where(accepted, new_inner_state, state.inner_state)
    return updates, DropStaleGradientsState(
      global_step=state.global_step + accepted.astype(jnp.int32),
      num_dropped=state.num_dropped + (~accepted).astype(jnp.int32),
      inner_state=inner_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
