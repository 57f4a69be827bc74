"""Skipping non-finite updates on every worker together (an agreed ``optax.apply_if_finite``)."""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dist import _axis, _checks, _state


class ApplyIfFiniteState(NamedTuple):
  """State of :func:`apply_if_finite` (the fields of ``optax.ApplyIfFiniteState``).

  Attributes:
    notfinite_count: ``int32[]``, the number of consecutive steps on which some worker's updates
      held a NaN or an Inf; reset to 0 by a step on which every worker's updates were finite.
    last_finite: ``bool[]``, whether every worker's updates were finite on the last step.
    total_notfinite: ``int32[]``, the number of steps so far on which some worker's updates held
      a NaN or an Inf; never reset.
    inner_state: the state of the wrapped transformation; unchanged by a skipped step.

  Every field except ``inner_state`` is identical on every worker.
  """

  notfinite_count: jax.Array
  last_finite: jax.Array
  total_notfinite: jax.Array
  inner_state: optax.OptState

  AVERAGE = None  # eval_params returns this field
  RESTART = None  # resize_state restarts the workers' params from this field
  RESIZE = {
    "notfinite_count": _state.KEEP, "last_finite": _state.KEEP,
    "total_notfinite": _state.KEEP, "inner_state": _state.INNER,
  }


def _all_finite(tree: optax.Updates) -> jax.Array:
  """``bool[]``: whether every element of every leaf of ``tree`` is finite."""
  flags = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]
  return functools.reduce(jnp.logical_and, flags, jnp.array(True))


def apply_if_finite(
  inner: optax.GradientTransformation,
  max_consecutive_errors: int,
  axis_name: Hashable | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Skips a step on every worker when any worker's updates hold a NaN or an Inf.

  ``optax.apply_if_finite`` with the decision agreed across the workers of ``axis_name``. With
  :math:`g_i` worker :math:`i`'s incoming updates, :math:`c` the ``notfinite_count`` and
  :math:`M` = ``max_consecutive_errors``:

  .. math::

    f &= \textstyle\bigwedge_i \mathrm{isfinite}(g_i) \quad (\text{one } \texttt{pmax}
      \text{ of a scalar flag over the axis}) \\
    c &\leftarrow \begin{cases} 0 & f \\ c + 1 & \neg f \end{cases} \\
    f \lor c > M:&\quad u_i = \mathrm{inner}(g_i), \quad \mathrm{inner\_state}
      \leftarrow \mathrm{inner\_state}' \\
    \text{otherwise}:&\quad u_i = 0, \quad \mathrm{inner\_state} \text{ unchanged}

  so after :math:`M` consecutive skipped steps the next non-finite one is applied anyway, as
  ``optax.apply_if_finite`` does (``max_consecutive_errors=0`` never skips).

  Wrap the *whole* distributed transformation, outermost:
  ``apply_if_finite(elastic_average(...), M, axis_name="w")``,
  ``apply_if_finite(moving_average(tower(...)), M, axis_name="w")``. A skipped step then skips
  every worker's ``inner`` together: the step counters stay in lockstep, the center, the EMA and
  the other workers' states never see the bad gradients, and the collectives inside ``inner``
  run on all workers or on none.

  .. note::

    ``optax.apply_if_finite`` decides per worker. Around a transformation with collectives
    (:func:`elastic_average`, :func:`agn`, :func:`tower`) under ``shard_map`` or ``pmap``, the
    worker that skips does not join the collectives the others run, and the program hangs;
    under ``vmap`` the NaNs enter the others' sums; and without collectives
    (:func:`drop_stale_gradients`, :func:`moving_average`) the workers' step counters drift
    apart. With ``axis_name=None`` this function computes what ``optax.apply_if_finite`` does.

  Args:
    inner: the transformation to protect, typically the whole distributed optimizer.
    max_consecutive_errors: the number of consecutive non-finite steps to skip before applying
      one anyway; a non-negative int.
    axis_name: the mapped axis (or tuple of mesh axes) whose positions are the workers;
      ``None`` for one worker and no collective.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; extra args are forwarded to ``inner``.

  Shapes:
    The returned updates have the tree, shapes and dtypes of ``inner``'s (zeros of those on a
    skipped step). The counters are scalars.

  Collectives:
    On every step, one ``pmax`` over ``axis_name`` of an ``int32`` scalar (the non-finite flag).
    None when ``axis_name`` is ``None``. The collectives of ``inner`` run on every
    worker or on none, inside a ``lax.cond`` on the agreed flag.

  Raises:
    TypeError: ``inner`` is not a transformation; ``max_consecutive_errors`` is not an int.
    ValueError: ``max_consecutive_errors`` is negative; in ``update``, a named ``axis_name``
      that is not bound where it runs.

  Examples:
    Two workers emulated with ``vmap``; worker 1's gradient is NaN, so both skip the step:

    >>> import jax, jax.numpy as jnp, optax, optax_dist
    >>> tx = optax_dist.apply_if_finite(
    ...     optax_dist.tower(optax.sgd(1.0), "workers"), 3, axis_name="workers")
    >>> params = jnp.ones((2, 1))
    >>> state = jax.vmap(tx.init, axis_name="workers")(params)
    >>> grads = jnp.array([[1.0], [jnp.nan]])
    >>> updates, state = jax.vmap(tx.update, axis_name="workers")(grads, state, params)
    >>> updates[:, 0], state.notfinite_count, state.last_finite
    (Array([0., 0.], dtype=float32), Array([1, 1], dtype=int32), Array([False, False], dtype=bool))

  References:
    Optax, ``optax.apply_if_finite`` and ``optax.ApplyIfFiniteState``.
  """
  fn = "apply_if_finite"
  _checks.check_transformation(fn, inner)
  _checks.check_int(fn, "max_consecutive_errors", max_consecutive_errors)
  if (v := _checks.concrete(max_consecutive_errors)) is not None and v < 0:
    raise ValueError(f"`{fn}(max_consecutive_errors=...)` must be a non-negative int, got {v}.")
  inner = _axis.wrap_inner(inner)

  def init_fn(params):
    return ApplyIfFiniteState(
      notfinite_count=jnp.zeros([], jnp.int32),
      last_finite=jnp.array(True, jnp.bool_),
      total_notfinite=jnp.zeros([], jnp.int32),
      inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    # f: finite on every worker. One pmax of this worker's flag "some element is not finite".
    notfinite = jnp.logical_not(_all_finite(updates)).astype(jnp.int32)
    if _axis.bound_axis_size(fn, axis_name) is not None:
      notfinite = jax.lax.pmax(notfinite, axis_name)
    isfinite = notfinite == 0

    notfinite_count = jnp.where(
      isfinite, jnp.zeros([], jnp.int32), optax.safe_increment(state.notfinite_count)
    )
    total_notfinite = jnp.where(
      isfinite, state.total_notfinite, optax.safe_increment(state.total_notfinite)
    )

    def apply(updates, inner_state):
      return inner.update(updates, inner_state, params, **extra_args)

    def skip(updates, inner_state):
      new_updates, _ = jax.eval_shape(apply, updates, inner_state)
      return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), new_updates), inner_state

    updates, inner_state = _axis.communicate_if(
      jnp.logical_or(isfinite, notfinite_count > max_consecutive_errors),
      apply, skip, updates, state.inner_state,
    )
    # The agreed flag is typed invariant over the axis; keep each counter's type as it came in.
    def like(new, old):
      return _axis.cast_varying(new, _axis.varying_axes(old))

    # last_finite = f, read off the count (0 exactly when f: safe_increment stops at the int32
    # maximum): a value of the state, laid out as the state is, where the flag alone would be
    # laid out as an agreed scalar (replicated over the replicas of the global view).
    notfinite_count = like(notfinite_count, state.notfinite_count)
    return updates, ApplyIfFiniteState(
      notfinite_count=notfinite_count,
      last_finite=like(notfinite_count == 0, state.last_finite),
      total_notfinite=like(total_notfinite, state.total_notfinite),
      inner_state=inner_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
