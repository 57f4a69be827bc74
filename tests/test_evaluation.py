"""What a run's evaluation computes: :func:`optax_dist.cli.steps.evaluate_fn` (and, with replicas,
:func:`optax_dist.cli.steps.replica_evaluate_fn` on each device) scores the workers' params only
where they differ from ``eval_params`` in some bit, with the metrics of computing both."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist
from optax_dist.cli.algorithms import DATA, REPLICA
from optax_dist.cli.steps import evaluate_fn, replica_evaluate_fn, same_bits


def metric_fn(scored: list[int]):
  """A mean-square metric that appends to ``scored`` when it runs (once for the workers under
  ``vmap``)."""

  def metric(params, test):
    jax.debug.callback(lambda: scored.append(1))
    return jnp.mean((test @ params["w"]) ** 2)

  return metric


@pytest.mark.parametrize("move", [None, "one bit", 0.5])
def test_the_workers_params_are_scored_only_where_they_differ(move):
  workers, tx = 4, optax_dist.diloco(optax.sgd(0.1), sync_period=4, axis_name="w")
  params = {"w": jnp.tile(jnp.linspace(-1.0, 1.0, 6), (workers, 1))}
  opt_state = jax.vmap(tx.init, axis_name="w")(params)  # the anchor: a copy of the params
  if move is not None:  # one of one worker's params
    w = np.array(params["w"])
    w[2, 3] = np.nextafter(w[2, 3], np.float32(2.0)) if move == "one bit" else w[2, 3] + move
    params = {"w": jnp.asarray(w)}
  test = jnp.asarray(np.random.default_rng(0).normal(size=(5, 6)), jnp.float32)
  scored = []
  got = jax.jit(evaluate_fn(metric_fn(scored)))(params, opt_state, test)
  jax.effects_barrier()
  assert len(scored) == (1 if move is None else 2)  # one callback per vmap over the workers

  def mean_metric(p):
    return jax.jit(lambda p: jnp.mean(jax.vmap(lambda q: metric_fn([])(q, test))(p)))(p)

  want = (mean_metric(optax_dist.eval_params(opt_state, params)), mean_metric(params))
  np.testing.assert_array_equal(np.array(got), np.array(want))
  # one bit apart, the two metrics may round to the same float32 or not: no claim
  if move is None:
    assert want[0] == want[1]
  elif move == 0.5:
    assert want[0] != want[1]


@pytest.mark.parametrize("move", [None, 0.5])
def test_with_replicas_a_device_scores_its_params_only_where_they_differ(move):
  """2 replicas of 2 devices, each device holding its worker's params and the whole test set:
  4 scorings of ``eval_params``, and of the params only on the device whose params moved."""
  tx = optax_dist.diloco(optax.sgd(0.1), sync_period=4, axis_name="w")
  w = np.tile(np.linspace(-1.0, 1.0, 6, dtype=np.float32), (4, 1))
  opt_state = jax.vmap(tx.init, axis_name="w")({"w": jnp.asarray(w)})
  if move is not None:
    w[2, 3] += move
  test = jnp.asarray(np.random.default_rng(0).normal(size=(5, 6)), jnp.float32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), (REPLICA, DATA))
  split = jax.sharding.PartitionSpec((REPLICA, DATA))
  scored = []
  evaluate = jax.jit(jax.shard_map(
    replica_evaluate_fn(metric_fn(scored)), mesh=mesh,
    in_specs=(split, split, jax.sharding.PartitionSpec()), out_specs=jax.sharding.PartitionSpec()))
  got = evaluate({"w": jnp.asarray(w)}, opt_state, test)
  jax.effects_barrier()
  assert len(scored) == (4 if move is None else 5)
  each = [float(jnp.mean((test @ row) ** 2)) for row in w]
  np.testing.assert_allclose(got[1], np.mean(each), rtol=1e-6)


def test_same_bits_tells_signed_zeros_apart_and_a_nan_from_itself():
  zero, nan = jnp.array([0.0, 1.0]), jnp.array([jnp.nan, 1.0])
  assert not same_bits({"a": zero}, {"a": -zero})
  assert same_bits({"a": nan}, {"a": nan})
  assert not same_bits((zero, nan), (zero, zero))
  assert same_bits((zero.astype(jnp.bfloat16),), (zero.astype(jnp.bfloat16),))
