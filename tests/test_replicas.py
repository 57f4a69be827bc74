"""``replicas``: the workers split into replicas on a ``("replica", "data")`` mesh, trained by the
trainer, equal the library composed by hand under nested ``vmap``.

With R replicas of D workers, every step is ``tower(adam, "data")`` within a replica and the
algorithm across the replicas (``axis_name="replica"``); with R = 1 the algorithm runs across all
workers as before. Worker ``i`` (replica ``i // D``) reads the ``i``-th shard of the training set
whatever R, so the global batch does not change.
"""

from __future__ import annotations

import chex
import jax
import numpy as np
import optax
import pytest

import optax_dist
from optax_dist.cli import pipeline, runs, trainer
from optax_dist.cli.config import Settings
from optax_dist.cli.tasks import TASKS

WORKERS, STEPS, BATCH, PERIOD, LR = 8, 6, 8, 3, 1e-2


def by_hand(task, data, replicas):
  """diloco(adam), composed from the library by hand, over ``replicas`` of ``WORKERS`` workers."""
  size = WORKERS // replicas
  adam = optax.adam(LR)
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  if replicas == 1:
    tx = optax_dist.diloco(adam, outer, sync_period=PERIOD, axis_name="workers")
  else:
    tx = optax_dist.diloco(optax_dist.tower(adam, "data"), outer, sync_period=PERIOD,
                           axis_name="replica")
  loss_fn = task.loss_fn(task.model())

  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  if replicas == 1:
    step, init = jax.vmap(step, axis_name="workers"), jax.vmap(tx.init)
  else:
    step = jax.vmap(jax.vmap(step, axis_name="data"), axis_name="replica")
    init = jax.vmap(jax.vmap(tx.init))
  step, init = jax.jit(step), jax.jit(init)
  example = tuple((k, (1,) + v.shape[1:], str(v.dtype)) for k, v in data.train.items())
  params = runs.initial_params(task, 0, example)
  grid = (replicas, size) if replicas > 1 else (WORKERS,)
  params = jax.tree.map(lambda p: np.broadcast_to(p, grid + p.shape), params)
  state = init(params)
  shards = pipeline.shard_examples(data.train, WORKERS)
  n_local = len(shards["x"][0])
  for t in range(STEPS):
    idx = pipeline.minibatch(0, WORKERS, n_local, BATCH, t)
    batch = {k: v[np.arange(WORKERS)[:, None], idx] for k, v in shards.items()}
    batch = jax.tree.map(lambda x: x.reshape(grid + x.shape[1:]), batch)
    params, state = step(params, state, batch)
  return jax.tree.map(lambda x: np.asarray(x).reshape((WORKERS,) + x.shape[len(grid):]), params)


@pytest.mark.parametrize("replicas", [1, 2])
def test_diloco_over_replicas_is_the_library_composed_by_hand(replicas):
  task = TASKS["digits"]
  data = task.load(0)
  settings = Settings(algorithm="diloco", devices=WORKERS, replicas=replicas, steps=STEPS,
                      batch_size=BATCH, sync_period=PERIOD, eval_every=STEPS, learning_rate=LR)
  result = trainer.train(task, data, settings, keep_state=True)
  final = result["final_state"]
  assert result["replicas"] == replicas
  chex.assert_trees_all_close(final["params"], by_hand(task, data, replicas), rtol=1e-5,
                              atol=1e-6)


def test_sync_is_one_reduction_whatever_the_replicas():
  """sync all-reduces over every worker: 2 replicas train as 1, on the same global batch."""
  task = TASKS["digits"]
  data = task.load(0)
  finals = []
  for replicas in (1, 2):
    settings = Settings(devices=WORKERS, replicas=replicas, steps=4, batch_size=BATCH,
                        eval_every=4)
    finals.append(trainer.train(task, data, settings, keep_state=True)["final_state"]["params"])
  chex.assert_trees_all_close(*finals, rtol=1e-5, atol=1e-6)


def test_replicas_must_divide_the_workers():
  task = TASKS["digits"]
  with pytest.raises(ValueError, match=r"argument --replicas: must divide the number of workers"
                     r" \(--processes x --devices = 8\) into replicas of equal size, got 3"):
    trainer.train(task, task.load(0), Settings(devices=WORKERS, replicas=3, steps=2))


def test_sync_over_replicas_sends_each_slice_across_once():
  """With 2 replicas of 4 workers, sync reduces hierarchically: across replicas each device
  all-reduces only its 1/4 slice of every gradient (padded), a replica's devices together the
  params' bytes once; nothing over all 8 workers at once (each replica averages its own loss)."""
  task = TASKS["digits"]
  data = task.load(0)
  settings = Settings(devices=WORKERS, replicas=2, steps=1, batch_size=BATCH, eval_every=1)
  result = trainer.train(task, data, settings)
  example = tuple((k, (1,) + v.shape[1:], str(v.dtype)) for k, v in data.train.items())
  sizes = [np.size(p) for p in jax.tree.leaves(runs.initial_params(task, 0, example))]
  step = result["collective_bytes"]["every_step"]
  assert step["conditional"] == []
  assert step["unconditional"]["replica"] == sum(4 * -(-n // 4) for n in sizes)
  assert "replica,data" not in step["unconditional"]  # the loss is averaged within replicas
  # One operand per param leaf across replicas (XLA may combine them into fewer collectives).
  assert step["operands"]["unconditional"]["replica"] == len(sizes)


@pytest.mark.parametrize("algorithm,replicas", [
  ("local_sgd", 2), ("diloco", 4), ("elastic_average", 2), ("moving_average", 4)])
def test_evaluation_over_replicas_is_the_mean_over_every_worker(algorithm, replicas):
  """With replicas, each device scores its worker on its slice of the test set (a replica's
  workers hold the same params; digits' 450 test examples split over 2 devices, not over 4):
  the recorded metrics equal the mean over all workers of each one's on the whole test set,
  computed here. No exchange within the run's 4 steps, so the replicas' params differ."""
  task = TASKS["digits"]
  data = task.load(0)
  settings = Settings(algorithm=algorithm, devices=WORKERS, replicas=replicas, steps=4,
                      batch_size=BATCH, eval_every=4, learning_rate=0.05, sync_period=10,
                      communication_period=10)
  result = trainer.train(task, data, settings, keep_state=True)
  final = jax.device_get(result["final_state"])  # each worker's slice taken on the host
  metric = jax.jit(task.metric_fn(task.model()))

  def each_worker(tree):
    return np.array([metric(jax.tree.map(lambda x, i=i: x[i], tree), data.test)
                     for i in range(WORKERS)])

  workers = each_worker(final["params"])
  evaluated = each_worker(jax.jit(optax_dist.eval_params)(final["opt_state"], final["params"]))
  by_replica = workers.reshape(replicas, -1)
  np.testing.assert_array_equal(by_replica, by_replica[:, :1].repeat(WORKERS // replicas, 1))
  if algorithm != "moving_average":  # a tower over every worker: all hold the same params
    assert len(set(by_replica[:, 0])) > 1, "the replicas' params should differ"
  eval_key, workers_key = trainer.metric_keys(task)
  np.testing.assert_allclose(result[workers_key], workers.mean(), rtol=1e-6)
  np.testing.assert_allclose(result[eval_key], evaluated.mean(), rtol=1e-6)
