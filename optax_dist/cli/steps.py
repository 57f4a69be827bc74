"""The functions a run compiles: one worker's training step, the global view's step, and the
evaluations, with the training state they carry.

:func:`step_fn` runs under ``jax.shard_map`` (one worker per device, its state with a leading
axis of 1); :func:`global_step_fn` under ``jax.jit``, ``jax.vmap`` over the replicas
(:class:`optax_dist.cli.runs.GlobalRun`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

import optax_dist
from optax_dist.cli.algorithms import AXIS, DATA, REPLICA


class State(NamedTuple):
  """The training state, every leaf with a leading worker axis (sharded over the workers).

  Attributes:
    params: each worker's params.
    opt_state: each worker's optimizer state.
    history: ``drop_stale_gradients`` only: each worker's params of the last ``depth`` accepted
      steps (``[workers, depth, ...]``), where stale gradients are computed; ``{}`` otherwise.
  """

  params: Any
  opt_state: Any
  history: Any


def unstack(tree):
  """``tree`` without its leading axis of size 1 (one worker's state under ``shard_map``)."""
  return jax.tree.map(lambda x: x[0], tree)


def stack(tree):
  """``tree`` with a leading axis of size 1 (back to the sharded layout)."""
  return jax.tree.map(lambda x: x[None], tree)


def step_fn(tx: Any, loss_fn: Callable, *, stale: bool, depth: int,
            communicate: bool | None = None, axis: Any = AXIS,
            loss_axis: Any = None) -> Callable:
  """One training step of one worker, to run under ``shard_map`` over the mesh axes ``axis``.

  ``step(params, opt_state, history, train, idx, delay)``: ``train`` is the worker's shard, ``idx``
  its minibatch's indices, ``delay`` (``drop_stale_gradients`` only) how many accepted steps old
  the params the gradients are computed at are. Returns the new state and the workers' mean loss.
  ``communicate`` (if not ``None``) is passed to ``tx.update`` as its static hint. With
  ``loss_axis`` the loss is the mean over that axis only, shaped ``[1]`` (one per replica for
  :data:`DATA`: no collective across the replicas).
  """
  hint = {} if communicate is None else {"communicate": communicate}

  def step(params, opt_state, history, train, idx, delay):
    params, opt_state, history = unstack((params, opt_state, history))
    batch = jax.tree.map(lambda shard: shard[0][idx[0]], train)
    read, extra = params, dict(hint)
    if stale:  # every worker reads the params of `delay` accepted steps ago
      grad_step = jnp.maximum(opt_state.global_step - delay, 0)
      read = jax.tree.map(lambda h: h[grad_step % depth], history)
      extra = {"grad_step": grad_step}
    loss, grads = jax.value_and_grad(loss_fn)(read, batch)
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    params = optax.apply_updates(params, updates)
    if stale:
      slot = opt_state.global_step % depth
      history = jax.tree.map(lambda h, p: h.at[slot].set(p), history, params)
    if loss_axis is not None:
      return (*stack((params, opt_state, history)), jax.lax.pmean(loss, loss_axis)[None])
    return (*stack((params, opt_state, history)), jax.lax.pmean(loss, axis))

  return step


def evaluate_fn(metric_fn: Callable) -> Callable:
  """``evaluate(params, opt_state, test)``: the mean metric of ``eval_params`` and of the params.

  The params' metric is computed only where they differ from ``eval_params`` (in any bit of any
  worker's); where they are the same (e.g. at step 0, ``eval_params`` being a copy of the params)
  it is the ``eval_params``' metric, which the same computation on the same bits gives again.
  """

  def evaluate(params, opt_state, test):
    score = jax.vmap(lambda p: metric_fn(p, test))
    averaged = optax_dist.eval_params(opt_state, params)
    return both_metrics(lambda p: jnp.mean(score(p)), averaged, params)

  return evaluate


def both_metrics(score: Callable, averaged: Any, params: Any) -> tuple[jax.Array, jax.Array]:
  """``(score(averaged), score(params))``, the second computed only where ``params`` differ from
  ``averaged`` in some bit (else it is the first: the same computation on the same bits); once
  when they are one tree (no averaging state)."""
  metric = score(averaged)
  if averaged is params:
    return metric, metric
  return metric, jax.lax.cond(same_bits(averaged, params), lambda: metric,
                              lambda: score(params))


def same_bits(a: Any, b: Any) -> jax.Array:
  """Whether the trees ``a`` and ``b`` (of one structure, shapes and dtypes) hold the same bits:
  a scalar bool (``-0.0`` and ``0.0`` differ, a NaN equals itself)."""

  def bits(x):
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))

  return jnp.all(jnp.stack([jnp.all(bits(x) == bits(y))
                            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]))


def replica_evaluate_fn(metric_fn: Callable) -> Callable:
  """``evaluate(params, opt_state, test)`` of one device under ``jax.shard_map`` over
  ``(REPLICA, DATA)``, for replicas whose devices hold the same params and state: the metric of
  its worker's ``eval_params`` and params on its ``test`` examples (its 1/K of the test set, or
  all of it), averaged over every device; the params' only on a device where they differ from
  its ``eval_params`` in some bit (:func:`both_metrics`). ``metric_fn`` must be a mean over
  equally many values per example, so that the mean over equal slices is the whole test set's."""

  def evaluate(params, opt_state, test):
    params, opt_state = unstack(params), unstack(opt_state)
    averaged = optax_dist.eval_params(opt_state, params)
    scores = jnp.stack(both_metrics(lambda p: metric_fn(p, test), averaged, params))
    return tuple(jax.lax.pmean(scores, (REPLICA, DATA)))

  return evaluate


def global_step_fn(tx: Any, loss_fn: Callable, batch: NamedSharding, *,
                   communicate: bool | None = None) -> Callable:
  """The training step of every replica at once, on the global view (``jax.vmap`` of one
  replica's step over :data:`REPLICA`, ``spmd_axis_name=REPLICA``), to run under ``jax.jit``.

  ``step(params, opt_state, train, idx)``: ``params`` and ``opt_state`` stacked over the R
  replicas (``[R, ...]``); ``train`` ``[R, W, M, ...]``, the shards of the W workers (devices) of
  each replica; ``idx`` ``[R, W, B]``, each worker's minibatch indices into its shard. A
  replica's loss is the mean over its ``W * B`` examples (the mean of its workers' minibatch
  losses), its batch constrained to ``batch`` (one replica's sharding of the example axis); the
  compiler reduces the gradients inside each replica, ``tx`` exchanges across the replicas.
  Returns the new params and state, and the replicas' mean loss. ``communicate`` (if not
  ``None``) is passed to ``tx.update`` as its static hint.
  """
  hint = {} if communicate is None else {"communicate": communicate}

  def replica_step(params, opt_state, train, idx):
    examples = jax.tree.map(lambda x: jax.vmap(lambda shard, i: shard[i])(x, idx), train)
    examples = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), examples)
    loss, grads = jax.value_and_grad(loss_fn)(
      params, jax.lax.with_sharding_constraint(examples, batch))
    updates, opt_state = tx.update(grads, opt_state, params, **hint)
    return optax.apply_updates(params, updates), opt_state, loss

  mapped = jax.vmap(replica_step, axis_name=REPLICA, spmd_axis_name=REPLICA)

  def step(params, opt_state, train, idx):
    params, opt_state, loss = mapped(params, opt_state, train, idx)
    return params, opt_state, jnp.mean(loss)

  return step
