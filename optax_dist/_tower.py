"""Synchronous gradient reduction across the workers (TF's ``TowerOptimizer``, whose device towers
are the workers here)."""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np
import optax

from optax_dist import _axis, _checks, _exchange

_REDUCTIONS = ("mean", "sum")


def all_reduce(
  axis_name: Hashable, reduction: str = "mean", *, comm_dtype: Any = None,
  hierarchical: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Replaces the updates by their sum or mean over the workers of ``axis_name``.

  .. math::

    g \leftarrow \textstyle\sum_{k=1}^{N} g_k \quad (\text{``"sum"``, TF's
      ``Reduction.SUM``}), \qquad
    g \leftarrow \tfrac{1}{N} \textstyle\sum_{k=1}^{N} g_k \quad (\text{``"mean"``, every
      other TF reduction})

  The result is the sum or mean of the per-worker gradients whichever way the workers were mapped.
  Under ``vmap``, ``pmap``, and ``shard_map`` with per-worker params, each worker's gradient varies
  over the axis and is reduced with ``psum``/``pmean``. Under ``shard_map`` (varying types
  checked, its default) with params replicated as ``P()``, autodiff has already summed the
  gradient over the workers and typed it invariant: ``"sum"`` leaves it as is and ``"mean"``
  divides it by :math:`N` (a plain ``pmean`` would count the workers twice). With
  ``axis_name=None`` (one worker), updates pass through unreduced.

  ``axis_name`` may be a tuple of mesh axes (e.g. ``("hosts", "gpus")``): the workers are the
  positions of all of them together, :math:`N` is the product of their sizes, and the rule above
  applies per axis: a leaf is ``psum``-med over the axes it varies over and treated as already
  summed over those where types are checked and it is invariant (e.g. params ``P("hosts")``
  under ``shard_map`` over both axes: autodiff summed the gradient over ``gpus``, the ``psum``
  runs over ``hosts``).

  With ``comm_dtype``, each floating leaf is cast to ``comm_dtype`` before the ``psum`` and back
  to its own dtype after it (the mean then divides in the leaf's dtype): the communicated bytes
  scale with ``comm_dtype``'s itemsize, at the cost of rounding every :math:`g_k` and the sum to
  ``comm_dtype``.

  With ``hierarchical=True`` and ``axis_name = (*outer, inner)`` (e.g. ``("hosts", "gpus")``,
  the last axis the fast one, inside a host), a leaf summed over two or more axes is
  reduce-scattered over ``inner``, its 1/K slices all-reduced over ``outer`` (in ``comm_dtype``)
  and all-gathered over ``inner`` (Horovod's hierarchical all-reduce): the same sum, added in
  another order, with each host's K devices together sending the gradient's bytes across hosts
  once. A flat ``psum`` over all the axes is one ring over every device, which crosses between
  hosts about twice per host.

  Args:
    axis_name: the mapped axis (or tuple of mesh axes) whose positions are the workers; ``None``
      for one worker.
    reduction: ``"mean"`` or ``"sum"``.
    comm_dtype: the floating dtype in which the gradients are communicated (e.g.
      ``jnp.bfloat16``: half the bytes of ``float32``); ``None`` (default) sends each leaf
      in its own dtype. Non-floating leaves are always communicated in their own dtype.
    hierarchical: reduce over a tuple ``axis_name`` inner axis first, as above (default
      ``False``: one ``psum`` over all the axes).

  Returns:
    A stateless ``optax.GradientTransformationExtraArgs``.

  Shapes:
    Returns updates with the same tree, shapes and dtypes as the incoming ones.

  Collectives:
    On every step, one ``psum`` (``"sum"``) or ``pmean`` (``"mean"``) over ``axis_name`` per
    leaf that varies over the axis: the gradient's bytes (its element count times the itemsize
    of ``comm_dtype``, or of its own dtype), all-reduced. None for leaves already summed by
    autodiff, and none with ``axis_name=None``. With ``hierarchical``: a ``psum_scatter`` and an
    ``all_gather`` over ``inner`` (the leaf's dtype, padded to a multiple of K values) around a
    ``psum`` of 1/K of the leaf over ``outer``. :func:`communication_report` measures them.

  Raises:
    TypeError: ``comm_dtype`` not ``None`` or a floating dtype with a sign and a zero (a
      block-quantized format, ``jnp.float4_e2m1fn`` included, is refused naming the
      transformations that take it); ``hierarchical`` not a bool.
    ValueError: ``hierarchical=True`` with an ``axis_name`` of fewer than two axes;
      ``reduction`` not ``"mean"`` or ``"sum"``; in ``update``, a named
      ``axis_name`` that is not bound where it runs (a misspelled name, or ``update`` outside
      the mapped function).

  Examples:
    >>> import jax, jax.numpy as jnp, optax_dist
    >>> tx = optax_dist.all_reduce("workers", reduction="sum")
    >>> reduce = lambda g: tx.update(g, tx.init(g))[0]
    >>> jax.vmap(reduce, axis_name="workers")(jnp.array([1.0, 2.0, 3.0]))
    Array([6., 6., 6.], dtype=float32)

  References:
    TensorFlow 1.x, ``tf.contrib.estimator.TowerOptimizer`` with ``replicate_model_fn``.
  """
  _checks.check_choice("all_reduce", "reduction", reduction, _REDUCTIONS)
  exchange = _exchange.gradient_exchange("all_reduce", axis_name, comm_dtype, hierarchical)
  return _all_reduce(exchange, reduction)


def _all_reduce(
  exchange: _exchange.Exchange, reduction: str
) -> optax.GradientTransformationExtraArgs:
  """:func:`all_reduce` over ``exchange``, whose errors name the public function called."""

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return exchange.reduce(updates, reduction), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def tower(
  inner: optax.GradientTransformation,
  axis_name: Hashable,
  *,
  reduction: str = "mean",
  comm_dtype: Any = None,
  hierarchical: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Reduces the gradients of all workers, then takes one ``inner`` step on the result.

  ``tower(inner, axis_name, reduction=r, comm_dtype=c)`` is
  ``optax.chain(all_reduce(axis_name, r, comm_dtype=c, hierarchical=h), inner)``:

  .. math::

    u = \mathrm{inner}\big(\textstyle\sum_k g_k\big) \ (\text{``"sum"``}) \quad\text{or}\quad
    u = \mathrm{inner}\big(\tfrac{1}{N}\textstyle\sum_k g_k\big) \ (\text{``"mean"``})

  identical on every worker when every worker starts from the same params and state: synchronous
  data parallelism. See :func:`all_reduce` for how the reduction adapts to the mapping.

  Args:
    inner: the optimizer applied once per step to the reduced gradients.
    axis_name: the mapped axis (or tuple of mesh axes) whose positions are the workers.
    reduction: ``"mean"`` (TF's default losses, divided by the number of workers) or ``"sum"``.
    comm_dtype: the floating dtype in which the gradients are all-reduced (e.g.
      ``jnp.bfloat16``); ``None`` (default) uses each gradient's own dtype. ``inner`` always
      receives the reduced gradients in their own dtype.
    hierarchical: with a tuple ``axis_name`` ``(*outer, inner)``, reduce-scatter over ``inner``,
      all-reduce the slices over ``outer``, all-gather over ``inner`` (see :func:`all_reduce`):
      across hosts each gradient's bytes are sent once, not about twice.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with the state of
    ``optax.chain(all_reduce(...), inner)``; extra args are forwarded to ``inner``.

  Shapes:
    Returns updates with the tree, shapes and dtypes of ``inner``'s.

  Collectives:
    Those of :func:`all_reduce`, on every step: the gradient's bytes, in ``comm_dtype`` if
    given. To all-reduce once per :math:`k` accumulated micro-steps instead of on every one, use
    :func:`accumulate_then_reduce` rather than ``optax.MultiSteps(tower(...), k)``.

  Raises:
    TypeError: ``inner`` is not a transformation; ``comm_dtype`` not ``None`` or a floating
      dtype with a sign and a zero (a block-quantized format, ``jnp.float4_e2m1fn`` included, is
      refused naming the transformations that take it); ``hierarchical`` not a bool.
    ValueError: ``reduction`` not ``"mean"`` or ``"sum"``; ``hierarchical=True`` with fewer
      than two axes; in ``update``, a named
      ``axis_name`` that is not bound where it runs.

  Examples:
    TF's ``test_train``: :math:`c = 10`, two towers with loss :math:`|x c - y|` on rows
    :math:`x = y = 1` and :math:`2`, summed, SGD with learning rate 1:

    >>> import jax, jax.numpy as jnp, optax, optax_dist
    >>> tx = optax_dist.tower(optax.sgd(1.0), "workers", reduction="sum")
    >>> c = jnp.array(10.0)
    >>> def step(x, y):
    ...   g = jax.grad(lambda c: jnp.abs(x * c - y))(c)
    ...   updates, _ = tx.update(g, tx.init(c), c)
    ...   return optax.apply_updates(c, updates)
    >>> jax.vmap(step, axis_name="workers")(jnp.array([1.0, 2.0]), jnp.array([1.0, 2.0]))
    Array([7., 7.], dtype=float32)

  References:
    TensorFlow 1.x, ``tf.contrib.estimator.TowerOptimizer`` with ``replicate_model_fn``.
  """
  _checks.check_transformation("tower", inner)
  _checks.check_choice("tower", "reduction", reduction, _REDUCTIONS)
  exchange = _exchange.gradient_exchange("tower", axis_name, comm_dtype, hierarchical)
  return optax.chain(_all_reduce(exchange, reduction), _axis.wrap_inner(inner))


def split_batch(
  batch: Any, num_workers: int | None = None, *, num_towers: int | None = None
) -> Any:
  """Splits every leaf of ``batch`` on axis 0 into ``num_workers`` equal shards.

  Args:
    batch: a pytree of arrays whose leaves share the leading (batch) dimension :math:`B`.
    num_workers: the number of shards :math:`N`, one per worker, a positive int dividing
      :math:`B`.
    num_towers: the former name of ``num_workers`` (TF's towers), deprecated: it still works
      and warns (``DeprecationWarning``).

  Returns:
    The same tree with leaves of shape ``(N, B // N, ...)``, ready to be mapped over
    (``vmap``/``pmap``) or placed with a ``NamedSharding`` over the workers' axis for
    ``shard_map``.

  Collectives:
    None: call it outside the mapped step, on the whole batch.

  Raises:
    TypeError: ``num_workers`` not an int; both ``num_workers`` and ``num_towers`` given.
    ValueError: ``num_workers`` not positive; a leaf is 0-d; the leaves' leading sizes
      differ (the shards would no longer line up); the batch size is not divisible by
      ``num_workers``.

  Examples:
    >>> import jax.numpy as jnp, optax_dist
    >>> optax_dist.split_batch({"x": jnp.arange(4.0)}, 2)["x"]
    Array([[0., 1.],
           [2., 3.]], dtype=float32)

  References:
    TensorFlow 1.x, ``replicate_model_fn``'s input split (``_split_batch``).
  """
  if num_towers is not None:
    if num_workers is not None:
      raise TypeError("`split_batch`: pass `num_workers` only (`num_towers` is its former name).")
    warnings.warn(
      "`split_batch(num_towers=...)` is deprecated: pass `num_workers=...` (same meaning).",
      DeprecationWarning, stacklevel=2,
    )
    num_workers = num_towers
  _checks.check_positive_int("split_batch", "num_workers", num_workers)
  _check_same_batch_size(batch)

  def split(path, leaf):
    shape = np.shape(leaf)
    if not shape:
      raise ValueError(
        f"`split_batch`: the leaf at {jax.tree_util.keystr(path) or '<root>'} is a scalar;"
        " every leaf needs a leading batch dimension."
      )
    if shape[0] % num_workers:
      raise ValueError(
        f"`split_batch`: the batch size must be divisible by the number of workers, got batch"
        f" size {shape[0]} and {num_workers} workers."
      )
    return leaf.reshape((num_workers, shape[0] // num_workers) + tuple(shape[1:]))

  return jax.tree_util.tree_map_with_path(split, batch)


def _check_same_batch_size(batch: Any) -> None:
  """Raise unless every non-scalar leaf of ``batch`` has the same leading size."""
  sizes = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
    if np.ndim(leaf):
      sizes.setdefault(np.shape(leaf)[0], jax.tree_util.keystr(path) or "<root>")
  if len(sizes) > 1:
    found = ", ".join(f"{size} at {path}" for size, path in sizes.items())
    raise ValueError(
      "`split_batch`: every leaf of `batch` must have the same leading (batch) size, so that"
      f" the shards of x and y line up; got {found}."
    )
