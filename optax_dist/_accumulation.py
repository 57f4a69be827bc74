"""Gradient accumulation over micro-steps with one all-reduce per accumulated step."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dist import _axis, _checks, _exchange, _state


class AccumulateThenReduceState(NamedTuple):
  """State of :func:`accumulate_then_reduce` (the fields of ``optax.MultiStepsState``).

  Attributes:
    mini_step: ``int32[]``, the micro-steps accumulated since the last reduction, in
      :math:`[0, k)`.
    gradient_step: ``int32[]``, the number of reductions (``inner`` steps) so far.
    inner_opt_state: the state of ``inner``, identical on every tower.
    acc_grads: this tower's sum of the gradients of the current accumulation; the params' tree
      and shapes, in ``accumulator_dtype`` (default: the params' dtypes).
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  inner_opt_state: optax.OptState
  acc_grads: optax.Updates

  AVERAGE = None  # eval_params returns this field
  RESTART = None  # resize_state restarts the workers' params from this field
  RESIZE = {
    "mini_step": _state.KEEP, "gradient_step": _state.KEEP, "inner_opt_state": _state.INNER,
    "acc_grads": _state.MEAN,
  }


def accumulate_then_reduce(
  inner: optax.GradientTransformation,
  every_k: int,
  axis_name: Hashable | None,
  *,
  reduction: str = "mean",
  use_grad_mean: bool = True,
  accumulator_dtype: Any = None,
  comm_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Accumulates local gradients over ``every_k`` micro-steps, then all-reduces them once.

  The result of ``optax.MultiSteps(tower(inner, axis_name), every_k)`` without its wasted
  communication: ``MultiSteps`` runs its inner transformation on every micro-step and masks the
  result, so ``tower`` all-reduces on each of the :math:`k` micro-steps. Here each tower sums
  its own gradients :math:`g_{i,m}` locally, and only on the :math:`k`-th micro-step all-reduces
  them and takes one ``inner`` step, identical on every tower:

  .. math::

    A_i &\leftarrow A_i + g_{i,m} \\
    \text{if } m \bmod k = 0:\quad
      G &= \mathrm{reduce}_i\big(A_i / k\big), \quad u = \mathrm{inner}(G), \quad
      A_i \leftarrow 0 \\
    \text{else}:\quad u &= 0

  where :math:`m` counts the micro-steps (1 on the first), :math:`\mathrm{reduce}` is the
  ``reduction`` over the towers of :func:`all_reduce` (mean or sum) and the division by
  :math:`k` is dropped when ``use_grad_mean=False``. The reduction and the ``inner`` step run
  inside a ``lax.cond`` on :math:`m \bmod k = 0`, a predicate identical on every tower.

  .. note::

    Equal to ``optax.MultiSteps(tower(inner, axis_name, reduction=r), every_k,
    use_grad_mean=...)`` up to float rounding (``MultiSteps`` accumulates a running mean;
    here a sum is divided once), with a different state.

  Args:
    inner: the optimizer applied once per ``every_k`` micro-steps to the reduced gradients.
    every_k: :math:`k`, the number of micro-steps per reduction, a positive int.
    axis_name: the mapped axis (or tuple of mesh axes) whose positions are the towers;
      ``None`` means one tower (no collective: plain gradient accumulation).
    reduction: ``"mean"`` or ``"sum"`` over the towers, as in :func:`all_reduce`.
    use_grad_mean: if ``True`` (default, as ``optax.MultiSteps``), the accumulated gradients
      are averaged over the :math:`k` micro-steps; else summed.
    accumulator_dtype: the dtype of ``acc_grads`` for floating leaves; ``None`` (default) is
      ``float32`` for params of lower precision (``bfloat16``, ``float16``) and each param's
      own dtype otherwise, as ``optax.MultiSteps`` accumulates: a ``bfloat16`` sum of 512
      gradients of 1.0 stops growing at 256.
    comm_dtype: the floating dtype in which the accumulated gradients are all-reduced (e.g.
      ``jnp.bfloat16``: half the bytes of ``float32``); ``None`` (default) uses their own dtype.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`AccumulateThenReduceState`. Extra args are forwarded to ``inner`` on the reducing
    micro-steps; unknown ones are dropped.

  Shapes:
    ``updates`` have the params' tree; the returned updates have ``inner``'s tree, shapes and
    dtypes (zeros on the accumulating micro-steps). Memory: one params-sized accumulator per
    tower.

  Collectives:
    Those of :func:`all_reduce` (a ``psum``/``pmean`` over ``axis_name`` of the gradient's
    bytes, in ``comm_dtype`` if given), once per ``every_k`` micro-steps, inside a
    ``lax.cond``; none on the other micro-steps (``optax.MultiSteps(tower(...), k)`` all-reduces
    on all :math:`k`). :func:`communication_report` measures them.

  Raises:
    TypeError: ``inner`` is not a transformation; ``every_k`` not an int;
      ``accumulator_dtype`` or ``comm_dtype`` not ``None`` or a floating dtype; ``comm_dtype``
      without a sign or a zero, or block-quantized (``jnp.float4_e2m1fn`` included: refused
      naming the transformations that take it).
    ValueError: ``every_k`` < 1; ``reduction`` not ``"mean"`` or ``"sum"``; in ``update``,
      a named ``axis_name`` that is not bound where it runs, or updates whose shapes differ
      from the params'.

  Examples:
    Two towers emulated with ``vmap``, two micro-steps per reduction, SGD with learning rate 1:

    >>> import jax, jax.numpy as jnp, optax, optax_dist
    >>> tx = optax_dist.accumulate_then_reduce(optax.sgd(1.0), 2, "towers")
    >>> state = jax.vmap(tx.init, axis_name="towers")(jnp.zeros((2, 1)))
    >>> update = jax.vmap(tx.update, axis_name="towers")
    >>> u1, state = update(jnp.array([[1.0], [2.0]]), state)  # accumulated, not reduced
    >>> u2, state = update(jnp.array([[3.0], [6.0]]), state)  # -mean of [1, 3, 2, 6]
    >>> u1[:, 0], u2[:, 0]
    (Array([0., 0.], dtype=float32), Array([-3., -3.], dtype=float32))

  References:
    ``optax.MultiSteps`` (gradient accumulation) with TensorFlow 1.x's
    ``tf.contrib.estimator.TowerOptimizer`` (synchronous tower reduction).
  """
  fn = "accumulate_then_reduce"
  _checks.check_transformation(fn, inner)
  inner = _axis.wrap_inner(inner)
  _checks.check_positive_int(fn, "every_k", every_k)
  _checks.check_choice(fn, "reduction", reduction, ("mean", "sum"))
  exchange = _exchange.gradient_exchange(fn, axis_name, comm_dtype)
  accumulator_dtype = _checks.check_floating_dtype(fn, "accumulator_dtype", accumulator_dtype)

  def accumulator(p):
    dtype = jnp.result_type(p)
    if jnp.issubdtype(dtype, jnp.floating):
      # Default: float32 for params of lower precision, as optax.MultiSteps accumulates.
      default = jnp.promote_types(dtype, jnp.float32)
      dtype = default if accumulator_dtype is None else accumulator_dtype
    return jnp.zeros(jnp.shape(p), dtype)

  def init_fn(params):
    return AccumulateThenReduceState(
      mini_step=jnp.zeros([], jnp.int32),
      gradient_step=jnp.zeros([], jnp.int32),
      inner_opt_state=inner.init(params),
      acc_grads=jax.tree.map(accumulator, params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    _checks.check_tree_matches(fn, updates, state.acc_grads, "params")
    _axis.bound_axis_size(fn, axis_name)

    # A_i <- A_i + g_{i,m}
    acc_grads = jax.tree.map(lambda a, g: (a + g).astype(a.dtype), state.acc_grads, updates)
    mini_step = optax.safe_increment(state.mini_step)
    emit = exchange.agree(mini_step % every_k == 0)

    def local_grads(acc_grads):  # A_i / k, in the gradients' dtypes
      if use_grad_mean:
        acc_grads = jax.tree.map(lambda a: a / every_k, acc_grads)
      return optax.tree.cast_like(acc_grads, updates)

    def reduce_and_step(acc_grads, inner_state):
      grads = exchange.reduce(local_grads(acc_grads), reduction)
      u, new_state = inner.update(grads, inner_state, params, **extra_args)  # u = inner(G)
      return u, new_state, optax.tree.zeros_like(acc_grads)

    def accumulate(acc_grads, inner_state):
      shapes, _ = jax.eval_shape(
        lambda g, s: inner.update(g, s, params, **extra_args), local_grads(acc_grads),
        inner_state,
      )
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      return zeros, inner_state, acc_grads  # u = 0

    new_updates, inner_state, acc_grads = _axis.communicate_if(
      emit, reduce_and_step, accumulate, acc_grads, state.inner_opt_state
    )
    gradient_step = jnp.where(
      emit, optax.safe_increment(state.gradient_step), state.gradient_step
    )
    return new_updates, AccumulateThenReduceState(
      mini_step=mini_step % every_k,
      gradient_step=gradient_step,
      inner_opt_state=inner_state,
      acc_grads=acc_grads,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
