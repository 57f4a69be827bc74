"""Saving the averaged parameters for evaluation and serving (TF's ``swapping_saver``), with Orbax.

Optional: needs ``orbax-checkpoint`` (``pip install "optax-dist[checkpoint]"``), imported only
when a function here is called; ``import optax_dist`` never imports this module.

* :func:`save_eval_params` writes :func:`optax_dist.eval_params` (the EMA of
  :func:`~optax_dist.moving_average`, the center of :func:`~optax_dist.elastic_average` or
  :func:`~optax_dist.agn`) under the model's own parameter tree, so a model without any optimizer
  restores it as if it were its ordinary params.
* :func:`restore_params` reads such a checkpoint into a params tree or an abstract one.

The optimizer states are ``NamedTuple``\\ s of arrays, so a training run resumes exactly with Orbax
itself: save ``{"params": params, "opt_state": opt_state}`` and restore it into the abstract tree
``jax.eval_shape`` gives for the same init (with ``sharding=`` set on each
``jax.ShapeDtypeStruct`` where the arrays are sharded). For states stacked over workers that init
is the mapped one (``jax.vmap(tx.init, axis_name=...)`` or the ``shard_map`` of it), whose step
counters have the workers' axis too; ``tx.init`` alone gives scalar counters, which Orbax refuses
to restore the stacked ones into:

.. code-block:: python

  import orbax.checkpoint as ocp

  init = jax.vmap(tx.init, axis_name="workers")  # the init the training run used
  with ocp.StandardCheckpointer() as ckpt:  # `path` must be absolute
    ckpt.save(path, {"params": params, "opt_state": opt_state})
  abstract = jax.eval_shape(lambda p: {"params": p, "opt_state": init(p)}, params)
  with ocp.StandardCheckpointer() as ckpt:
    state = ckpt.restore(path, abstract)

Training on from the restored state gives bitwise the params and state of an uninterrupted run,
also in the middle of a communication period (the step counters are in the state).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import optax

from optax_dist import _axis, _checks
from optax_dist._eval_params import eval_params


def _orbax(fn: str) -> Any:
  try:
    import orbax.checkpoint as ocp  # optional dependency, imported on first use
  except ImportError as e:  # one line naming the extra, instead of Orbax's own traceback
    raise ImportError(
      f"`optax_dist.checkpoint.{fn}` needs orbax-checkpoint: install it with"
      f' `pip install "optax-dist[checkpoint]"` (or `pip install orbax-checkpoint`) ({e}).'
    ) from None
  return ocp


def _absolute(directory: str | os.PathLike) -> str | os.PathLike:
  """Orbax needs absolute paths; local relative paths are made absolute, URLs are kept."""
  if isinstance(directory, (str, os.PathLike)):
    path = os.fspath(directory)
    if "://" not in path:
      return os.path.abspath(path)
  return directory


def _workers_axis_size(params: Any, opt_state: Any, worker: int, num_workers: int | None) -> int:
  """The common leading size of every leaf of ``params`` and ``opt_state``: the workers' axis.

  Trees stacked over workers (the outputs of ``vmap``, ``shard_map`` with ``P(axis)`` or ``pmap``)
  have axis 0 on every leaf, the scalar step counters of the state included. A tree that is not
  stacked has a scalar counter (every averaging state keeps one) or leaves of different leading
  sizes, and is refused, instead of silently saving row ``worker`` of each leaf.
  """
  fix = (
    " Pass `worker=None` when the trees are not stacked over workers (one worker, or one"
    " worker's copy already selected)."
  )
  size, ref = _axis.workers_axis_size(
    f"save_eval_params(worker={worker})", params, opt_state, fix, num_workers)
  if ref is not None and not 0 <= worker < size:
    raise ValueError(
      f"`save_eval_params(worker={worker})` must be in [0, {size}): the workers' axis is axis 0,"
      f" of size {size} ({ref[0]} has shape {ref[1]}). Pass a worker in that range."
    )
  return size


def _worker_copy(
  tree: Any, params: Any, opt_state: Any, worker: int | None, num_workers: int | None
) -> Any:
  """``tree`` with axis 0 indexed at ``worker``, after checking the trees are stacked."""
  if num_workers is not None:
    _checks.check_positive_int("save_eval_params", "num_workers", num_workers)
    if worker is None:
      raise ValueError(
        f"`save_eval_params(num_workers={num_workers})` is only meaningful with `worker=`: pass"
        " the worker whose copy to save, or drop `num_workers`."
      )
  if worker is None:
    return tree
  _checks.check_int("save_eval_params", "worker", worker)
  _workers_axis_size(params, opt_state, worker, num_workers)
  return jax.tree.map(lambda leaf: leaf[worker], tree)


def save_eval_params(
  directory: str | os.PathLike,
  opt_state: optax.OptState,
  params: optax.Params,
  *,
  worker: int | None = None,
  num_workers: int | None = None,
  force: bool = False,
) -> optax.Params:
  """Saves the averaged params (EMA or center) under the params' own tree (``swapping_saver``).

  Writes ``optax_dist.eval_params(opt_state, params)`` with Orbax's ``StandardCheckpointer``: the
  averaged parameters in the params' tree, names and dtypes, so that a plain model, built without
  any optimizer, restores them with :func:`restore_params` (or Orbax directly) as its params.
  With no averaging state in ``opt_state``, ``params`` themselves are saved.

  Args:
    directory: the checkpoint directory to create (a relative local path is made absolute).
    opt_state: the optimizer state holding the average.
    params: the current params, giving the tree and dtypes.
    worker: for states and params stacked over workers on axis 0 (``vmap``, or ``shard_map``
      with ``P(axis)``), the worker whose copy to save. The center is identical on every worker;
      the EMA of :func:`~optax_dist.moving_average` is each worker's own. ``None``: save the trees
      as they are. With ``worker``, every leaf of ``params`` and ``opt_state`` (the state's
      scalar step counters included) must have one common leading size, the number of workers;
      a tree that is not stacked is refused rather than sliced (see Raises).
    num_workers: the number of workers the trees are stacked over, checked against every
      leaf's leading size; ``None``: the leading size of the first leaf of ``params``. Only with
      ``worker``. Pass it when ``opt_state`` holds no step counter (e.g. plain ``optax.sgd``,
      no averaging state), where a tree that is not stacked could otherwise pass the check.
    force: overwrite an existing ``directory``.

  Returns:
    The saved tree (the params' structure), e.g. to evaluate right away.

  Shapes:
    The saved leaves have the params' shapes, without axis 0 when ``worker`` is given.

  Collectives:
    None (call it outside any mapped function).

  Raises:
    ImportError: orbax-checkpoint is not installed.
    TypeError: ``worker`` or ``num_workers`` is not an int.
    ValueError: with ``worker``, a leaf of ``params`` or ``opt_state`` is a scalar (e.g. the
      ``local_step`` of a state that is not stacked), leaves differ in their leading size (or
      from ``num_workers``), or ``worker`` is not in ``[0, num_workers)``; the message names the
      leaf's path and shape. ``num_workers`` without ``worker``, or below 1. The average's tree
      differs from ``params``' tree; ``directory`` exists and ``force`` is False.

  Examples:
    >>> import tempfile, os, jax.numpy as jnp, optax, optax_dist
    >>> from optax_dist.checkpoint import restore_params, save_eval_params
    >>> params = {"w": jnp.array([1.0, 2.0])}
    >>> tx = optax_dist.moving_average(optax.sgd(2.0), decay=0.5)
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([0.1, 0.1])}, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> path = os.path.join(tempfile.mkdtemp(), "eval")
    >>> _ = save_eval_params(path, state, params)
    >>> restore_params(path, {"w": jnp.zeros(2)})  # a model without an optimizer
    {'w': Array([0.9, 1.9], dtype=float32)}
    >>> save_eval_params(path + "-0", state, params, worker=0)  # one worker: nothing to index
    Traceback (most recent call last):
    ValueError: `save_eval_params(worker=0)` needs ... but opt_state.count has shape (): ...

  References:
    TensorFlow 1.x, ``MovingAverageOptimizer.swapping_saver`` and
    ``ElasticAverageOptimizer.swapping_saver``.
  """
  ocp = _orbax("save_eval_params")
  tree = _worker_copy(eval_params(opt_state, params), params, opt_state, worker, num_workers)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(_absolute(directory), tree, force=force)
  return tree


def restore_params(directory: str | os.PathLike, target: optax.Params | None = None) -> Any:
  """Restores params saved by :func:`save_eval_params` (or any Orbax pytree checkpoint).

  Args:
    directory: the checkpoint directory (a relative local path is made absolute).
    target: the params tree to restore into: concrete arrays (their shapes, dtypes and
      shardings are used, their values ignored) or ``jax.ShapeDtypeStruct`` leaves, e.g.
      ``jax.eval_shape(model.init, key, x)``, with ``sharding=`` to place them. ``None``:
      the tree and shardings recorded in the checkpoint.

  Returns:
    The restored tree, with ``target``'s structure when given.

  Raises:
    ImportError: orbax-checkpoint is not installed.
    FileNotFoundError: no checkpoint at ``directory``.
    ValueError: ``target``'s tree or shapes differ from the checkpoint's (raised by Orbax).

  Examples:
    >>> import tempfile, os, jax, jax.numpy as jnp, optax_dist
    >>> from optax_dist.checkpoint import restore_params, save_eval_params
    >>> path = os.path.join(tempfile.mkdtemp(), "params")
    >>> _ = save_eval_params(path, None, {"b": jnp.ones(2, jnp.bfloat16)})
    >>> restore_params(path, {"b": jax.ShapeDtypeStruct((2,), jnp.bfloat16)})
    {'b': Array([1, 1], dtype=bfloat16)}
  """
  ocp = _orbax("restore_params")
  abstract = None if target is None else jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  with ocp.StandardCheckpointer() as ckpt:
    return ckpt.restore(_absolute(directory), abstract)
