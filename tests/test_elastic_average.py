"""elastic_average: TF's elastic_average_optimizer_test numbers, a NumPy reference with four
workers (vmap, shard_map, pmap) and bad inputs."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_all_equal, called, constant_grads, error, sgd, sgd_step
from _multiworker import (
  INNERS,
  NUM_WORKERS,
  PERIOD,
  NumpySGD,
  add,
  initial_params,
  random_grads,
  run_against_reference,
  scale,
  sub,
)

import optax_dist

AXIS = "workers"


# ----------------------------------------------------------------------------------------------
# TF's ElasticAverageOptimizer tests (elastic_average_optimizer_test.py).


def test_elastic_average_1_worker_2_period():
  """TF ``test1Workers2Period``: one worker, period 2, moving_rate 1, SGD(1), gradients -1."""
  tx = optax_dist.elastic_average(optax.sgd(1.0), communication_period=2, moving_rate=1.0)
  step = sgd_step(tx)
  params = {"v0": jnp.array(0.0), "v1": jnp.array(1.0)}
  grads = constant_grads(params, -1.0)
  state = tx.init(params)

  # After init.
  assert_all_equal(0.0, params["v0"])
  assert_all_equal(1.0, params["v1"])
  assert_all_equal(0.0, state.center["v0"])
  assert_all_equal(1.0, state.center["v1"])

  # Step 1: a local step only.
  params, state = step(params, state, grads)
  assert_all_equal(1.0, params["v0"])
  assert_all_equal(2.0, params["v1"])
  assert_all_equal(0.0, state.center["v0"])
  assert_all_equal(1.0, state.center["v1"])

  # Step 2: "iteration 2, global variable update".
  params, state = step(params, state, grads)
  assert_all_equal(0.0, params["v0"])
  assert_all_equal(1.0, params["v1"])
  assert_all_equal(2.0, state.center["v0"])
  assert_all_equal(3.0, state.center["v1"])

  # Step 3.
  params, state = step(params, state, grads)
  assert_all_equal(1.0, params["v0"])
  assert_all_equal(2.0, params["v1"])
  assert_all_equal(2.0, state.center["v0"])
  assert_all_equal(3.0, state.center["v1"])

  # Step 4, then the swapping saver writes the center under the params' names.
  params, state = step(params, state, grads)
  saved = optax_dist.eval_params(state, params)
  assert_all_equal(2.0, saved["v0"])
  assert_all_equal(3.0, saved["v1"])
  # Not asserted by TF, implied by its derivation: the local params are (2, 3) as well.
  assert_all_equal(2.0, params["v0"])
  assert_all_equal(3.0, params["v1"])


def _ea_two_worker_params():
  return {"v0": jnp.array(0.0), "v1": jnp.array(1.0), "partition_var": jnp.ones((2, 4))}


def test_elastic_average_2_worker_1_period_asynchronous_order():
  """TF ``test2Worker1Period``: worker 0 then worker 1, each against the center it finds.

  Two single-worker transformations share the center: worker 1's state is given the center
  worker 0 left before it updates.
  """
  tx = optax_dist.elastic_average(optax.sgd(1.0), communication_period=1, moving_rate=0.5)
  step = sgd_step(tx)
  params0 = params1 = _ea_two_worker_params()
  state0, state1 = tx.init(params0), tx.init(params1)
  grads = constant_grads(params0, -1.0)

  assert_all_equal(0.0, params0["v0"])
  assert_all_equal(1.0, params0["v1"])
  assert_all_equal(0.0, params1["v0"])
  assert_all_equal(1.0, params1["v1"])
  assert_all_equal(0.0, state0.center["v0"])
  assert_all_equal(1.0, state0.center["v1"])

  params0, state0 = step(params0, state0, grads)
  state1 = state1._replace(center=state0.center)
  params1, state1 = step(params1, state1, grads)
  center = state1.center

  assert_all_equal(0.5, params0["v0"])
  assert_all_equal(1.5, params0["v1"])
  assert_all_equal(0.75, center["v0"])
  assert_all_equal(1.75, center["v1"])
  assert_all_equal(0.75, params1["v0"])
  assert_all_equal(1.75, params1["v1"])
  # The partitioned variable's center (ones init, same arithmetic + 1), as the swapping saver
  # writes it: both [1, 4] parts are 1.75.
  saved = optax_dist.eval_params(state1, params1)
  assert_all_equal([[1.75] * 4] * 2, saved["partition_var"])
  assert_all_equal(center["partition_var"], saved["partition_var"])


def test_elastic_average_2_worker_1_period_synchronous():
  """``test2Worker1Period`` under ``vmap``: both workers exchange against the same center.

  Each worker: x' = x0 + 1, d = 0.5 (x' - c0) = 0.5, x = x' - d = x0 + 0.5, and the center
  moves by the sum of both d: c = c0 + 1.
  """
  tx = optax_dist.elastic_average(
    optax.sgd(1.0), communication_period=1, moving_rate=0.5, axis_name="w"
  )
  params = jax.tree.map(lambda p: jnp.stack([p, p]), _ea_two_worker_params())
  state = jax.vmap(tx.init, axis_name="w")(params)
  grads = constant_grads(params, -1.0)
  params, state = jax.jit(jax.vmap(sgd_step(tx), axis_name="w"))(params, state, grads)

  assert_all_equal([0.5, 0.5], params["v0"])
  assert_all_equal([1.5, 1.5], params["v1"])
  assert_all_equal([1.0, 1.0], state.center["v0"])
  assert_all_equal([2.0, 2.0], state.center["v1"])
  assert_all_equal(np.full((2, 2, 4), 1.5), params["partition_var"])
  assert_all_equal(np.full((2, 2, 4), 2.0), state.center["partition_var"])


# ----------------------------------------------------------------------------------------------
# Four workers against a NumPy reference.


class NumpyElasticAverage:
  """Synchronous EASGD: every worker exchanges against the same center."""

  def __init__(self, inner, params, moving_rate, rho):
    self.inner, self.alpha, self.rho = inner, moving_rate, rho
    self.x = [dict(params) for _ in range(NUM_WORKERS)]
    self.center = dict(params)
    self.states = [inner.init(params) for _ in range(NUM_WORKERS)]
    self.step_count = 0

  def step(self, grads):
    self.step_count += 1
    new_x = []
    for i in range(NUM_WORKERS):
      g = add(grads[i], scale(self.rho, sub(self.x[i], self.center)))
      u, self.states[i] = self.inner.update(g, self.states[i])
      new_x.append(add(self.x[i], u))
    if self.step_count % PERIOD == 0:
      d = [scale(self.alpha, sub(x, self.center)) for x in new_x]
      new_x = [sub(x, d_i) for x, d_i in zip(new_x, d)]
      for d_i in d:
        self.center = add(self.center, d_i)
    self.x = new_x


EA_CONFIGS = {
  # name: (elastic_average kwargs given the inner learning rate, (moving_rate, rho) of reference)
  "rho0": (lambda lr: {"moving_rate": 0.2, "rho": 0.0}, lambda lr: (0.2, 0.0)),
  "rho_positive": (lambda lr: {"moving_rate": 0.2, "rho": 0.5}, lambda lr: (0.2, 0.5)),
  # TF's defaults: moving_rate = 0.9 / period / workers, rho = moving_rate / learning_rate.
  "defaults": (
    lambda lr: {"learning_rate": lr},
    lambda lr: (0.9 / PERIOD / NUM_WORKERS, 0.9 / PERIOD / NUM_WORKERS / lr),
  ),
}


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
@pytest.mark.parametrize("inner_name", sorted(INNERS))
@pytest.mark.parametrize("config", sorted(EA_CONFIGS))
def test_elastic_average_matches_numpy(config, inner_name, mapping):
  make_inner, make_np_inner, lr = INNERS[inner_name]
  kwargs, np_rates = EA_CONFIGS[config]
  tx = optax_dist.elastic_average(
    make_inner(), communication_period=PERIOD, axis_name="w", **kwargs(lr)
  )
  reference = NumpyElasticAverage(make_np_inner(), initial_params(), *np_rates(lr))
  run_against_reference(tx, reference, mapping, random_grads())


def test_elastic_average_pmap_matches_numpy():
  tx = optax_dist.elastic_average(
    optax.sgd(0.05, momentum=0.9),
    communication_period=PERIOD,
    moving_rate=0.2,
    rho=0.5,
    axis_name="w",
  )
  reference = NumpyElasticAverage(NumpySGD(0.05, 0.9), initial_params(), 0.2, 0.5)
  run_against_reference(tx, reference, "pmap", random_grads())


# ----------------------------------------------------------------------------------------------
# Bad inputs.


@pytest.mark.parametrize("value", [0, -1, 0.0, float("nan")])
def test_moving_rate_must_be_positive(value):
  with pytest.raises(
    ValueError, match=error("elastic_average", "moving_rate", "must be > 0", value)
  ):
    optax_dist.elastic_average(sgd(), moving_rate=value)


@pytest.mark.parametrize("value", [-0.1, -1])
def test_rho_must_be_non_negative(value):
  with pytest.raises(ValueError, match=error("elastic_average", "rho", "must be >= 0", value)):
    optax_dist.elastic_average(sgd(), rho=value)
  optax_dist.elastic_average(sgd(), rho=0.0)  # the paper's Algorithm 1


@pytest.mark.parametrize("value", [0, -0.5])
def test_learning_rate_must_be_positive(value):
  with pytest.raises(
    ValueError, match=error("elastic_average", "learning_rate", "must be > 0", value)
  ):
    optax_dist.elastic_average(sgd(), learning_rate=value)


@pytest.mark.parametrize("name", ["moving_rate", "rho", "learning_rate"])
def test_real_hyperparameters_reject_non_numbers(name):
  with pytest.raises(TypeError, match=called("elastic_average", name) + ".*real number.*'x'"):
    optax_dist.elastic_average(sgd(), **{name: "x"})


def test_elastic_average_warns_when_the_center_would_overshoot():
  """moving_rate * N = 1.5 * 2 = 3: beyond 2 the exchange diverges (3e32 after 30 steps)."""
  tx = optax_dist.elastic_average(sgd(), communication_period=1, moving_rate=1.5, axis_name=AXIS)
  params = jnp.array([[0.0], [1.0]])
  state = jax.vmap(tx.init, axis_name=AXIS)(params)
  pattern = r"moving_rate \* num_workers = 1\.5 \* 2 = 3 > 1.*stable for 0 < moving_rate.*< 0\.5"
  with pytest.warns(UserWarning, match=pattern):
    jax.vmap(tx.update, axis_name=AXIS)(jnp.zeros_like(params), state, params)
  stable = optax_dist.elastic_average(sgd(), communication_period=1, moving_rate=0.4,
                                      axis_name=AXIS)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.vmap(stable.update, axis_name=AXIS)(jnp.zeros_like(params), state, params)
