"""drop_stale_gradients: TF's drop_stale_gradient_optimizer_test numbers, a per-worker NumPy
reference and bad inputs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_all_equal, error, sgd, sgd_step
from _multiworker import (
  NUM_WORKERS,
  Mapped,
  NumpySGD,
  add,
  assert_close,
  initial_params,
  random_grads,
  stack,
  worker,
)

import optax_dist

# ----------------------------------------------------------------------------------------------
# TF's DropStaleGradientOptimizer tests (drop_stale_gradient_optimizer_test.py).


@pytest.mark.parametrize(
  "num_workers, max_staleness, global_step, num_dropped, num_applied",
  [
    pytest.param(1, 0, 1, 0, 1, id="test1Worker"),
    pytest.param(1, -1, 0, 1, 0, id="test1WorkerNegativeStaleness"),
    pytest.param(2, 0, 1, 1, 1, id="test2WorkersStaleness0"),
    pytest.param(2, 1, 2, 0, 2, id="test2WorkersStaleness1"),
    pytest.param(3, 0, 1, 2, 1, id="test3WorkersStaleness0"),
    pytest.param(3, 1, 2, 1, 2, id="test3WorkersStaleness1"),
  ],
)
def test_drop_stale_gradients(num_workers, max_staleness, global_step, num_dropped, num_applied):
  """TF's schedule: every worker computes at global_step 0; the chief applies first, then the
  others in order, all on one shared (parameter-server) state. Loss -v0 - v1, SGD(1)."""
  tx = optax_dist.drop_stale_gradients(optax.sgd(1.0), max_staleness)
  step = sgd_step(tx)
  params = {"v0": jnp.array(0.0), "v1": jnp.array(1.0)}
  state = tx.init(params)

  assert_all_equal(0.0, params["v0"])
  assert_all_equal(1.0, params["v1"])
  assert_all_equal(0.0, state.num_dropped)
  assert_all_equal(0, state.global_step)

  grads = jax.grad(lambda p: 0.0 - p["v0"] - p["v1"])(params)
  for _ in range(num_workers):
    params, state = step(params, state, grads, grad_step=0)

  assert_all_equal(global_step, state.global_step)
  assert_all_equal(num_dropped, state.num_dropped)
  assert_all_equal(0.0 + num_applied, params["v0"])
  assert_all_equal(1.0 + num_applied, params["v1"])


# ----------------------------------------------------------------------------------------------
# Four workers, each with its own global step.


def test_drop_stale_gradients_per_worker_matches_numpy():
  """Each worker keeps its own global step; its gradients lag it by 0, 1 or 2 steps."""
  max_staleness = 1
  tx = optax_dist.drop_stale_gradients(optax.sgd(0.05, momentum=0.9), max_staleness)
  mapped = Mapped(tx, "vmap")
  x0 = initial_params()
  params = stack([x0] * NUM_WORKERS)
  state = mapped.init(params)
  np_inner = NumpySGD(0.05, 0.9)
  xs = [dict(x0) for _ in range(NUM_WORKERS)]
  np_states = [np_inner.init(x0) for _ in range(NUM_WORKERS)]
  global_steps, dropped = [0] * NUM_WORKERS, [0] * NUM_WORKERS
  lags = np.random.default_rng(2).integers(0, 3, size=(6, NUM_WORKERS))
  for grads, lag in zip(random_grads(num_steps=6), lags):
    grad_step = jnp.asarray(np.array(global_steps) - lag, jnp.int32)
    params, state = mapped.step(params, state, stack(grads), grad_step=grad_step)
    for i in range(NUM_WORKERS):
      if lag[i] <= max_staleness:
        u, np_states[i] = np_inner.update(grads[i], np_states[i])
        xs[i] = add(xs[i], u)
        global_steps[i] += 1
      else:
        dropped[i] += 1
      assert_close(worker(params, i), xs[i])
    np.testing.assert_array_equal(np.asarray(state.global_step), global_steps)
    np.testing.assert_array_equal(np.asarray(state.num_dropped), dropped)
  assert 0 < sum(dropped) < lags.size  # both branches were exercised


# ----------------------------------------------------------------------------------------------
# Bad inputs.


@pytest.mark.parametrize("value", [1.5, "1", None])
def test_max_staleness_must_be_an_int(value):
  with pytest.raises(
    TypeError, match=error("drop_stale_gradients", "max_staleness", "must be an int", value)
  ):
    optax_dist.drop_stale_gradients(sgd(), value)


def test_negative_max_staleness_is_allowed_and_drops_everything():
  tx = optax_dist.drop_stale_gradients(sgd(), -1)
  state = tx.init(jnp.zeros(2))
  for _ in range(2):
    updates, state = tx.update(jnp.ones(2), state)  # staleness 0 > -1: dropped
    np.testing.assert_array_equal(updates, [0.0, 0.0])
  assert (int(state.global_step), int(state.num_dropped)) == (0, 2)


DROP = optax_dist.drop_stale_gradients(optax.sgd(0.1), 1)


@pytest.mark.parametrize("grad_step", [1.0, jnp.array(1.0), np.float32(1.0)])
def test_grad_step_must_be_an_integer(grad_step):
  params = jnp.ones(2)
  pattern = re.escape("`drop_stale_gradients` update: `grad_step` must be an integer") + (
    ".*got dtype float"
  )
  with pytest.raises(TypeError, match=pattern):
    DROP.update(params, DROP.init(params), grad_step=grad_step)


@pytest.mark.parametrize(
  "grad_step,shape", [(jnp.array([1, 2]), "(2,)"), (np.zeros((1, 1), np.int32), "(1, 1)")]
)
def test_grad_step_must_be_a_scalar(grad_step, shape):
  params = jnp.ones(2)
  pattern = re.escape(
    f"`drop_stale_gradients` update: `grad_step` must be a scalar, got shape {shape}."
  )
  with pytest.raises(ValueError, match=pattern):
    DROP.update(params, DROP.init(params), grad_step=grad_step)


def test_grad_step_accepts_python_and_array_integers():
  params = jnp.ones(2)
  state = DROP.init(params)
  for grad_step in (0, np.int64(0), jnp.array(0, jnp.int32)):
    updates, new_state = DROP.update(params, state, grad_step=grad_step)
    np.testing.assert_allclose(updates, [-0.1, -0.1])
    assert int(new_state.global_step) == 1
