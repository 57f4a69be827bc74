"""Flax integration: a Linen ``TrainState`` that forwards extra args, and averaged params for NNX.

Optional: this module imports Flax, ``import optax_dist`` does not. Import it as
``import optax_dist.flax``.

* :class:`TrainState`: ``flax.training.train_state.TrainState`` whose ``apply_gradients``
  forwards extra keyword arguments (``grad_step=``) to ``tx.update``, with
  :meth:`TrainState.eval_params`.
* :func:`nnx_eval_params`: the averaged params of an ``nnx.Optimizer``, as an ``nnx.State``
  for ``nnx.update``.
* :func:`sync_batch_stats`: a collection such as ``batch_stats`` averaged over the workers.
* :func:`update_bn` (Linen) and :func:`nnx_update_bn` (NNX): BatchNorm statistics re-estimated
  for given params (the EMA or the center that :func:`optax_dist.eval_params` returns), whose
  statistics no worker's running averages match.

``flax.nnx.Optimizer`` needs nothing more: ``optimizer.update(model, grads, grad_step=...)``
already forwards its keyword arguments to ``tx.update``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax

try:
  import flax.linen as nn
  from flax import nnx, traverse_util
  from flax.training import train_state
except ImportError as e:  # one line naming the extra, instead of Flax's own traceback
  raise ImportError(
    f'`optax_dist.flax` needs Flax: install it with `pip install "optax-dist[examples]"` ({e}).'
  ) from None

from optax_dist import _axis, _checks
from optax_dist._eval_params import eval_params as _eval_params

# Flax's key for variables updated by their gradient directly, not by ``tx``.
_OVERWRITE_WITH_GRADIENT = train_state.OVERWRITE_WITH_GRADIENT


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` that forwards extra args to ``tx.update``.

  Linen's ``TrainState.apply_gradients(grads=..., **kwargs)`` uses ``kwargs`` only to replace
  fields of the state, so the extra arguments of an ``optax.GradientTransformationExtraArgs``
  (such as ``grad_step=`` of :func:`optax_dist.drop_stale_gradients`) cannot reach ``tx``. Here
  a keyword naming a field of the state (``step``, ``params``, or a field a subclass adds, e.g.
  ``batch_stats``) replaces that field, as in Flax; every other keyword is passed to
  ``tx.update``. :meth:`eval_params` gives the averaged params to evaluate and to save.

  Attributes:
    step: the number of ``apply_gradients`` calls so far.
    apply_fn: usually ``model.apply``.
    params: the parameters updated by ``tx``.
    tx: the optax transformation (any optax or optax_dist one).
    opt_state: the state of ``tx``.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_dist
    >>> import optax_dist.flax
    >>> tx = optax_dist.drop_stale_gradients(optax.sgd(1.0), max_staleness=0)
    >>> state = optax_dist.flax.TrainState.create(
    ...     apply_fn=None, params={"w": jnp.zeros(1)}, tx=tx)
    >>> state = state.apply_gradients(grads={"w": jnp.ones(1)}, grad_step=0)  # fresh
    >>> state = state.apply_gradients(grads={"w": jnp.ones(1)}, grad_step=0)  # stale: dropped
    >>> state.params["w"], state.step, state.opt_state.num_dropped
    (Array([-1.], dtype=float32), 2, Array(1, dtype=int32))

  References:
    Flax, ``flax.training.train_state.TrainState``.
  """

  def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
    """Applies one step of ``tx``: ``step += 1``, new ``params`` and ``opt_state``.

    Args:
      grads: gradients with the tree of ``params``.
      **kwargs: keywords naming a field of the state replace it (as in Flax); the others are
        extra args for ``tx.update`` (e.g. ``grad_step=``).

    Returns:
      The updated state.
    """
    fields = {f.name for f in dataclasses.fields(self)}
    replace = {k: v for k, v in kwargs.items() if k in fields}
    extra_args = {k: v for k, v in kwargs.items() if k not in fields}

    overwrite = _OVERWRITE_WITH_GRADIENT in grads
    grads_with_opt = grads["params"] if overwrite else grads
    params_with_opt = self.params["params"] if overwrite else self.params
    updates, opt_state = self.tx.update(
      grads_with_opt, self.opt_state, params_with_opt, **extra_args
    )
    new_params = optax.apply_updates(params_with_opt, updates)
    if overwrite:
      new_params = {"params": new_params, _OVERWRITE_WITH_GRADIENT: grads[_OVERWRITE_WITH_GRADIENT]}
    return self.replace(step=self.step + 1, params=new_params, opt_state=opt_state, **replace)

  def eval_params(self) -> Any:
    """The params to evaluate and to save: :func:`optax_dist.eval_params` of this state.

    Returns:
      A tree like ``params``: the average kept by the outermost averaging transformation in
      ``tx`` (the EMA of :func:`optax_dist.moving_average`, the center of
      :func:`optax_dist.elastic_average` or :func:`optax_dist.agn`), or ``params`` itself.
    """
    if not _is_array(self.params) and _OVERWRITE_WITH_GRADIENT in self.params:
      averaged = _eval_params(self.opt_state, self.params["params"])
      return {**self.params, "params": averaged}
    return _eval_params(self.opt_state, self.params)


def _is_array(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def nnx_eval_params(optimizer: nnx.Optimizer, model: nnx.Module) -> nnx.State:
  """The averaged params of an ``nnx.Optimizer``'s transformation, for ``nnx.update``.

  :func:`optax_dist.eval_params` for Flax NNX: of the params ``optimizer`` trains in ``model``
  (its ``wrt`` filter), the average kept by the outermost averaging transformation, or the
  params themselves when there is none.

  Args:
    optimizer: the ``nnx.Optimizer`` built for ``model``.
    model: the model whose params ``optimizer`` updates.

  Returns:
    A pure ``nnx.State`` (arrays, no ``Variable`` wrappers) with the tree of
    ``nnx.state(model, optimizer.wrt)``. Load it into a copy of the model to evaluate it:
    ``eval_model = nnx.clone(model); nnx.update(eval_model, nnx_eval_params(optimizer, model))``.

  Raises:
    ValueError: ``optimizer`` was built for a model with a different tree of params.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_dist
    >>> from flax import nnx
    >>> import optax_dist.flax
    >>> model = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
    >>> model.kernel[...] = jnp.ones((1, 1))
    >>> tx = optax_dist.moving_average(optax.sgd(1.0), decay=0.5)
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 1))).sum())(model)  # d/dkernel = 1
    >>> _ = optimizer.update(model, grads)
    >>> model.kernel[...], optax_dist.flax.nnx_eval_params(optimizer, model)["kernel"]
    (Array([[0.]], dtype=float32), Array([[0.5]], dtype=float32))

  References:
    TensorFlow 1.x, ``MovingAverageOptimizer.swapping_saver``.
  """
  params = nnx.as_pure(nnx.state(model, optimizer.wrt))
  return _eval_params(nnx.as_pure(optimizer.opt_state), params)


# ----------------------------------------------------------------------------------------------
# BatchNorm statistics: averaged over the workers, or re-estimated for the averaged params.

# The variables of a BatchNorm in its ``batch_stats`` collection.
_BN_STATS = ("mean", "var")


def sync_batch_stats(batch_stats: Any, axis_name: Hashable | tuple) -> Any:
  r"""The mean over the workers of ``axis_name`` of a collection such as ``batch_stats``.

  For each floating leaf :math:`s_i` of worker :math:`i` of :math:`N`,

  .. math:: \bar s = \frac{1}{N} \sum_{i=1}^{N} s_i,

  identical on every worker; other leaves (integer counters) are returned unchanged. Call it
  inside the mapped step, e.g. before evaluating or saving, so that the running averages of
  BatchNorm describe all the workers' data, not one worker's. The statistics of the averaged
  params are another matter: see :func:`update_bn`.

  Args:
    batch_stats: any tree of arrays: the ``batch_stats`` collection of a Linen model, the
      ``nnx.state(model, nnx.BatchStat)`` of an NNX one, or any other collection.
    axis_name: the worker axis, as in the transformations: one axis name, or a tuple of mesh
      axis names (the mean is then over all their workers).

  Returns:
    A tree like ``batch_stats``, its floating leaves averaged. Under ``shard_map`` each leaf
    keeps the varying type of the given leaf (so it can replace it in a ``lax.scan`` carry),
    although its value is the same on every worker.

  Shapes:
    Each leaf keeps its shape and dtype.

  Collectives:
    One ``jax.lax.pmean`` over ``axis_name`` per floating leaf, on every call.

  Raises:
    ValueError: ``axis_name`` names an axis that is not bound where it is called.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import optax_dist.flax
    >>> stats = {"mean": jnp.array([[0.0], [2.0]]), "var": jnp.array([[1.0], [3.0]])}  # 2 workers
    >>> sync = lambda s: optax_dist.flax.sync_batch_stats(s, "workers")
    >>> synced = jax.vmap(sync, axis_name="workers")(stats)
    >>> synced["mean"][:, 0], synced["var"][:, 0]
    (Array([1., 1.], dtype=float32), Array([2., 2.], dtype=float32))

  References:
    Flax, ``examples/imagenet/train.py``, ``sync_batch_stats``.
  """
  _check_bound("sync_batch_stats", axis_name)

  def mean(x):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      return x
    return _axis.cast_varying(jax.lax.pmean(x, axis_name), _axis.varying_axes(x))

  return jax.tree.map(mean, batch_stats)


def update_bn(
  apply_fn: Callable[..., Any],
  variables: Any,
  batches: Any,
  *,
  axis_name: Hashable | tuple | None = None,
  **kwargs: Any,
) -> Any:
  r"""The BatchNorm statistics of a Linen model for ``variables["params"]``, from ``batches``.

  Runs the model in training mode on each of the :math:`K` batches and returns, for each
  ``nn.BatchNorm`` with input :math:`x_k` on batch :math:`k`, the exact means of the batches'
  statistics over the layer's reduction axes (no momentum):

  .. math::
    \mathrm{mean} = \frac{1}{K} \sum_{k=1}^{K} \mathrm{E}[x_k], \qquad
    \mathrm{var} = \frac{1}{K} \sum_{k=1}^{K} \left(\mathrm{E}[x_k^2] - \mathrm{E}[x_k]^2\right),

  the (biased) batch variance being the one BatchNorm normalizes with in training. With
  ``axis_name``, also averaged over the :math:`N` workers (each its own :math:`K` batches):
  :math:`\frac{1}{NK}\sum_i\sum_k`. Use it for params no worker trained with, whose running
  averages therefore match none of them: the EMA of :func:`optax_dist.moving_average`, the center
  of :func:`optax_dist.elastic_average` and :func:`optax_dist.agn`.

  Each BatchNorm's running averages are set to zero before each call and divided by
  ``1 - momentum`` after it, which leaves that batch's statistics whatever the layer's
  ``momentum``. The given statistics are not used; the other leaves of the collection (kept by
  other modules) are returned as given. Other layers run as ``kwargs`` set them: a Dropout in
  training mode draws from the same ``rngs`` on every batch.

  Args:
    apply_fn: ``model.apply`` (or ``TrainState.apply_fn``), called as
      ``apply_fn(variables, batch, mutable=["batch_stats"], **kwargs)``.
    variables: ``{"params": params, "batch_stats": batch_stats, ...}``, the params to estimate
      the statistics for (e.g. ``state.eval_params()``); ``batch_stats`` gives the tree.
    batches: the model's input, stacked: every leaf has a leading axis of length :math:`K \ge 1`
      and ``batch[k]`` is one batch (as large as the training batches, for the same statistics).
    axis_name: if given, the statistics are also averaged over this worker axis (one name or a
      tuple of mesh axis names); call it inside the mapped step, each worker on its own batches.
    **kwargs: passed to ``apply_fn``: whatever puts the model in training mode, e.g.
      ``train=True`` or ``use_running_average=False``.

  Returns:
    The new ``batch_stats`` collection: a dict with the tree of ``variables["batch_stats"]``.
    With ``axis_name`` under ``shard_map``, each leaf keeps at least the varying type of the given
    leaf.

  Shapes:
    Each statistic has the layer's feature shape, the dtype of the given statistic.

  Collectives:
    None of its own without ``axis_name`` (a BatchNorm with its own ``axis_name`` syncs as in
    training); with it, one ``jax.lax.pmean`` per statistic, as :func:`sync_batch_stats`.

  Raises:
    ValueError: ``variables`` has no ``batch_stats`` collection or lacks a BatchNorm's
      statistics; ``batches`` has no leaves or zero batches; no ``nn.BatchNorm`` ran; one ran with
      ``use_running_average=True`` (pass what selects training mode in ``kwargs``) or with
      ``momentum=1``; ``axis_name`` is not bound.

  Examples:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> import optax_dist.flax
    >>> bn = nn.BatchNorm(momentum=0.9)
    >>> variables = bn.init(jax.random.key(0), jnp.zeros((2, 1)), use_running_average=True)
    >>> batches = jnp.array([[[0.0], [2.0]], [[4.0], [6.0]]])  # 2 batches of 2: means 1 and 5
    >>> stats = optax_dist.flax.update_bn(bn.apply, variables, batches, use_running_average=False)
    >>> stats["mean"], stats["var"]
    (Array([3.], dtype=float32), Array([1.], dtype=float32))

  References:
    PyTorch, ``torch.optim.swa_utils.update_bn``. P. Izmailov et al., "Averaging Weights Leads
    to Wider Optima and Better Generalization", UAI 2018, https://arxiv.org/abs/1803.05407.
  """
  fn = "update_bn"
  if "batch_stats" not in variables:
    raise ValueError(
      f"`{fn}(variables=...)` must hold a 'batch_stats' collection, got the collections"
      f" {sorted(variables)}. Pass {{'params': params, 'batch_stats': batch_stats}}."
    )
  _check_batches(fn, batches)
  _check_bound(fn, axis_name)
  given = traverse_util.flatten_dict(variables["batch_stats"])
  norms = set()  # the scope paths of the BatchNorms that ran, found while tracing
  intercept = _batch_statistics_of_each_call(fn, norms)

  def batch_statistics(batch):
    with nn.intercept_methods(intercept):
      _, mutated = apply_fn(variables, batch, mutable=["batch_stats"], **kwargs)
    return mutated["batch_stats"]

  per_batch = jax.lax.map(batch_statistics, batches)
  if not norms:
    raise ValueError(
      f"`{fn}`: no flax.linen.BatchNorm ran in `apply_fn`; there are no statistics to estimate."
    )

  def new_leaf(path, stats):
    keys = tuple(k.key for k in path)
    if keys[:-1] not in norms or keys[-1] not in _BN_STATS:
      return given[keys]
    return _mean_over_batches(stats, given[keys], axis_name)

  return jax.tree_util.tree_map_with_path(new_leaf, per_batch)


def nnx_update_bn(
  model: nnx.Module,
  batches: Any,
  *,
  axis_name: Hashable | tuple | None = None,
  **kwargs: Any,
) -> nnx.State:
  r"""The BatchNorm statistics of a Flax NNX model for its current params, from ``batches``.

  :func:`update_bn` for NNX: the exact means over the :math:`K` batches (and, with
  ``axis_name``, the :math:`N` workers) of each ``nnx.BatchNorm``'s batch mean and (biased)
  batch variance,

  .. math::
    \mathrm{mean} = \frac{1}{K} \sum_{k=1}^{K} \mathrm{E}[x_k], \qquad
    \mathrm{var} = \frac{1}{K} \sum_{k=1}^{K} \left(\mathrm{E}[x_k^2] - \mathrm{E}[x_k]^2\right).

  The model is called as ``model(batch, **kwargs)`` on a copy whose BatchNorms are in training
  mode (``use_running_average=False``) with ``momentum=0``, so each call leaves that batch's
  statistics; ``model`` itself is not changed. Other modules run in the mode ``model`` is in
  (keep Dropout deterministic: every batch sees the same RNG state). Load the result with
  ``nnx.update(model, stats)``.

  Args:
    model: the model, holding the params to estimate the statistics for (e.g. a copy updated
      with :func:`nnx_eval_params`).
    batches: the model's input, stacked: every leaf has a leading axis of length :math:`K \ge 1`
      and ``batch[k]`` is one batch.
    axis_name: if given, the statistics are also averaged over this worker axis (one name or a
      tuple of mesh axis names); call it inside the mapped step, each worker on its own batches.
    **kwargs: passed to ``model`` on every call. A model that passes ``use_running_average``
      to its BatchNorms itself needs what makes it pass ``False`` (e.g. ``train=True``).

  Returns:
    A pure ``nnx.State`` (arrays) with the tree of ``nnx.state(model, nnx.BatchStat)``: the
    BatchNorms' ``mean`` and ``var`` re-estimated, any other ``BatchStat`` as in ``model``. With
    ``axis_name`` under ``shard_map``, each leaf keeps at least the varying type of the model's.

  Shapes:
    Each statistic has the layer's feature shape and the dtype of the model's.

  Collectives:
    As :func:`update_bn`: with ``axis_name``, one ``jax.lax.pmean`` per statistic.

  Raises:
    ValueError: ``model`` has no ``nnx.BatchNorm``; ``batches`` has no leaves or zero batches;
      ``axis_name`` is not bound.

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import optax_dist.flax
    >>> bn = nnx.BatchNorm(1, use_running_average=True, rngs=nnx.Rngs(0))
    >>> batches = jnp.array([[[0.0], [2.0]], [[4.0], [6.0]]])  # 2 batches of 2: means 1 and 5
    >>> stats = optax_dist.flax.nnx_update_bn(bn, batches)
    >>> nnx.update(bn, stats)
    >>> bn.mean[...], bn.var[...]
    (Array([3.], dtype=float32), Array([1.], dtype=float32))

  References:
    PyTorch, ``torch.optim.swa_utils.update_bn``.
  """
  fn = "nnx_update_bn"
  _check_batches(fn, batches)
  _check_bound(fn, axis_name)
  work = nnx.clone(model)
  if not _nnx_batch_norms(work):
    raise ValueError(f"`{fn}(model=...)`: the model has no nnx.BatchNorm; nothing to estimate.")
  for bn in _nnx_batch_norms(work):
    bn.use_running_average = False
    bn.momentum = 0.0  # after a call, the running averages are that batch's statistics
    bn.mean[...] = jnp.zeros_like(bn.mean[...])
    bn.var[...] = jnp.zeros_like(bn.var[...])
  graphdef, state = nnx.split(work)

  def batch_statistics(state, batch):  # the state is carried unchanged: each batch starts from it
    work = nnx.merge(graphdef, state)
    work(batch, **kwargs)
    return state, [(bn.mean[...], bn.var[...]) for bn in _nnx_batch_norms(work)]

  _, per_batch = jax.lax.scan(batch_statistics, state, batches)
  out = nnx.clone(model)
  for bn, stats in zip(_nnx_batch_norms(out), per_batch, strict=True):
    bn.mean[...] = _mean_over_batches(stats[0], bn.mean[...], axis_name)
    bn.var[...] = _mean_over_batches(stats[1], bn.var[...], axis_name)
  return nnx.as_pure(nnx.state(out, nnx.BatchStat))


def _nnx_batch_norms(model: nnx.Module) -> list[nnx.BatchNorm]:
  return [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.BatchNorm)]


def _batch_statistics_of_each_call(fn: str, norms: set) -> Callable[..., Any]:
  """A Linen method interceptor: each ``nn.BatchNorm`` call leaves its batch's statistics.

  The layer updates ``r <- momentum * r + (1 - momentum) * s`` with ``s`` the batch statistic;
  from ``r = 0`` that is ``(1 - momentum) * s``, and dividing by the same float32 factor gives
  ``s`` back to within one rounding. Adds each such layer's scope path to ``norms``.
  """

  def intercept(next_fun, args, kwargs, context):
    bn = context.module
    if not (isinstance(bn, nn.BatchNorm) and context.method_name == "__call__"):
      return next_fun(*args, **kwargs)
    path = tuple(bn.scope.path)
    _check_training(fn, bn, path, args, kwargs)
    for name in _BN_STATS:
      bn.put_variable("batch_stats", name, jnp.zeros_like(bn.get_variable("batch_stats", name)))
    out = next_fun(*args, **kwargs)
    for name in _BN_STATS:
      value = bn.get_variable("batch_stats", name)
      bn.put_variable("batch_stats", name, value / (1 - bn.momentum))
    norms.add(path)
    return out

  return intercept


def _check_training(fn: str, bn: nn.BatchNorm, path: tuple, args: tuple, kwargs: dict) -> None:
  """Raise unless the BatchNorm at ``path`` will compute and store batch statistics."""
  where = "/".join(path) or "the top level"
  if not all(bn.has_variable("batch_stats", name) for name in _BN_STATS):
    raise ValueError(
      f"`{fn}(variables=...)`: 'batch_stats' lacks the mean and var of the BatchNorm at"
      f" {where}. Pass the 'batch_stats' collection that model.init made."
    )
  given = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
  if _checks.concrete(bn.use_running_average if given is None else given):
    raise ValueError(
      f"`{fn}`: the BatchNorm at {where} ran with use_running_average=True, so it computes no"
      " batch statistics. Pass what puts the model in training mode as keyword arguments,"
      " e.g. update_bn(..., train=True)."
    )
  if _checks.concrete(bn.momentum) == 1:
    raise ValueError(
      f"`{fn}`: the BatchNorm at {where} has momentum=1, so it never stores batch statistics."
    )


def _mean_over_batches(stats: jax.Array, like: jax.Array, axis_name: Any) -> jax.Array:
  """The mean over axis 0 (the batches), and over ``axis_name`` if given, in ``like``'s dtype."""
  dtype = jnp.promote_types(stats.dtype, jnp.float32)
  mean = jnp.mean(stats, axis=0, dtype=dtype)
  if axis_name is not None:
    mean = jax.lax.pmean(mean, axis_name)
  mean = mean.astype(jnp.result_type(like))
  return _axis.cast_varying(mean, _axis.varying_axes(like))


def _check_batches(fn: str, batches: Any) -> None:
  leaves = jax.tree.leaves(batches)
  if not leaves or any(jnp.ndim(x) == 0 for x in leaves) or jnp.shape(leaves[0])[0] == 0:
    shapes = [jnp.shape(x) for x in leaves]
    raise ValueError(
      f"`{fn}(batches=...)` must be the stacked input batches, every leaf with a leading axis"
      f" of at least one batch, got leaves of shapes {shapes}."
    )


def _check_bound(fn: str, axis_name: Any) -> None:
  if axis_name is None:
    return
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  missing = [a for a in names if _axis.axis_size(a) is None]
  if missing:
    raise ValueError(
      f"`{fn}(axis_name={axis_name!r})`: axis {missing[0]!r} is not bound here, so the workers"
      " cannot be averaged. Call it inside the jax.shard_map, jax.pmap or jax.vmap that maps"
      f" the workers over {missing[0]!r} (check the spelling), or pass axis_name=None."
    )
