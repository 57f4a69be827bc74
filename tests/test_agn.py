"""agn: TF's agn_optimizer_test numbers, a NumPy reference with four workers (vmap, shard_map,
pmap), program size and bad inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import (
  assert_all_equal,
  assert_ndarray_near,
  assert_near,
  assert_pulled,
  error,
  sgd,
  sgd_step,
)
from _multiworker import (
  INNERS,
  NUM_WORKERS,
  PERIOD,
  NumpyAdam,
  add,
  initial_params,
  random_grads,
  run_against_reference,
  scale,
  worker,
)

import optax_dist

AXIS = "w"


# ----------------------------------------------------------------------------------------------
# TF's AGNOptimizer tests (agn_optimizer_test.py): Adam(0.1, beta1=0, beta2=0, eps=1e-8),
# gradients -1: every Adam step moves a variable by 0.1 / (1 + 1e-8).


def tf_agn_adam():
  return optax.adam(learning_rate=0.1, b1=0.0, b2=0.0, eps=1e-8)


def test_agn_1_worker_4_period():
  """TF ``test1Workers2Period`` (one worker, period 4; the name is TF's)."""
  tx = optax_dist.agn(tf_agn_adam(), communication_period=4)
  step = sgd_step(tx)
  params = {"v0": np.float32(0.0), "v1": np.float32(0.5)}
  grads = host_constant(params, -1.0)
  state = jax.jit(tx.init)(params)

  assert_all_equal(0.0, params["v0"])
  assert_all_equal(0.5, params["v1"])
  assert_all_equal(0.0, state.center["v0"])
  assert_all_equal(0.5, state.center["v1"])

  params, state = step(params, state, grads)  # TF's "step 0"
  assert_near(0.1, params["v0"], 1e-6)
  assert_near(0.6, params["v1"], 1e-6)
  assert_all_equal(0.0, state.center["v0"])
  assert_all_equal(0.5, state.center["v1"])

  for _ in range(2):
    params, state = step(params, state, grads)
  assert_near(0.3, params["v0"], 1e-6)
  assert_near(0.8, params["v1"], 1e-6)

  # Step 4 commits a = -4, a / 4 = -1, the center takes one Adam step (+0.1), params pulled.
  params, state = step(params, state, grads)
  assert_pulled(state.center["v0"], params["v0"])
  assert_pulled(state.center["v1"], params["v1"])
  assert_near(0.1, params["v0"], 1e-6)
  assert_near(0.6, params["v1"], 1e-6)

  for _ in range(4):
    params, state = step(params, state, grads)
  assert_pulled(state.center["v0"], params["v0"])
  assert_pulled(state.center["v1"], params["v1"])
  assert_near(0.2, params["v0"], 1e-6)
  assert_near(0.7, params["v1"], 1e-6)


def _agn_two_worker_params():
  return {"v0": np.float32(0.0), "v1": np.float32(0.5),
          "partition_var": np.zeros((2, 4), np.float32)}


def host_constant(params, value):
  """Gradients of ``value`` shaped as ``params``, made on the host (as a data loader gives them)."""
  return jax.tree.map(lambda p: np.full(np.shape(p), value, np.float32), params)


def _assert_agn_center(center, value):
  assert_near(value, center["v0"], 1e-6)
  for part in np.split(np.asarray(center["partition_var"]), 2):  # two [1, 4] parts, to a [4]
    assert_ndarray_near([value] * 4, part, 1e-6)


def test_agn_2_worker_1_period_asynchronous_order():
  """TF ``test2Worker1Period``: w0, w1, w0, w1, w0, w1, each committing to the center (and the
  center's Adam state) as the previous worker left it: +0.1 per worker step."""
  tx = optax_dist.agn(tf_agn_adam(), communication_period=1)
  step = sgd_step(tx)
  params = [_agn_two_worker_params()] * 2
  states = [jax.jit(tx.init)(p) for p in params]
  grads = host_constant(params[0], -1.0)

  assert_all_equal(0.0, params[0]["v0"])
  assert_all_equal(0.5, params[0]["v1"])
  assert_all_equal(0.0, params[1]["v0"])
  assert_all_equal(0.5, params[1]["v1"])
  assert_all_equal(0.0, states[0].center["v0"])
  assert_all_equal(0.5, states[0].center["v1"])

  shared = states[0]

  def worker_step(i):
    nonlocal shared
    state = states[i]._replace(center=shared.center, center_inner_state=shared.center_inner_state)
    params[i], states[i] = step(params[i], state, grads)
    shared = states[i]

  worker_step(0)
  _assert_agn_center(shared.center, 0.1)
  worker_step(1)
  _assert_agn_center(shared.center, 0.2)
  for i in (0, 1, 0, 1):
    worker_step(i)
  _assert_agn_center(shared.center, 0.6)
  assert_near(1.1, shared.center["v1"], 1e-6)  # implied var_1_g


@pytest.mark.parametrize("center_update, per_round", [("sequential", 0.2), ("mean", 0.1)])
def test_agn_2_worker_1_period_synchronous(center_update, per_round):
  """``test2Worker1Period`` under ``vmap``: "sequential" applies both workers' commits (two Adam
  steps, +0.2 per round), "mean" one Adam step on their mean (+0.1 per round); the workers then
  restart from the center."""
  tx = optax_dist.agn(
    tf_agn_adam(), communication_period=1, center_update=center_update, axis_name="w"
  )
  step = jax.jit(jax.vmap(sgd_step(tx), axis_name="w"))
  params = jax.tree.map(lambda p: np.stack([p, p]), _agn_two_worker_params())
  state = jax.jit(jax.vmap(tx.init, axis_name="w"))(params)
  grads = host_constant(params, -1.0)
  for round_ in range(1, 4):
    params, state = jax.device_get(step(params, state, grads))
    for w in range(2):
      center = jax.tree.map(lambda a, w=w: a[w], state.center)
      _assert_agn_center(center, per_round * round_)
      assert_near(0.5 + per_round * round_, center["v1"], 1e-6)
      for leaf, c in zip(jax.tree.leaves(params), jax.tree.leaves(center)):
        np.testing.assert_allclose(leaf[w], c, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Four workers against a NumPy reference.


class NumpyAGN:
  """AGN: local inner steps, mean accumulated gradient committed to the center every period."""

  def __init__(self, inner, params, center_update):
    self.inner, self.center_update = inner, center_update
    self.x = [dict(params) for _ in range(NUM_WORKERS)]
    self.center = dict(params)
    self.states = [inner.init(params) for _ in range(NUM_WORKERS)]
    self.center_state = inner.init(params)
    self.accum = [{k: np.zeros_like(v) for k, v in params.items()} for _ in range(NUM_WORKERS)]
    self.step_count = 0

  def step(self, grads):
    self.step_count += 1
    for i in range(NUM_WORKERS):
      u, self.states[i] = self.inner.update(grads[i], self.states[i])
      self.x[i] = add(self.x[i], u)
      self.accum[i] = add(self.accum[i], grads[i])
    if self.step_count % PERIOD == 0:
      commits = [scale(1.0 / PERIOD, a) for a in self.accum]
      if self.center_update == "mean":
        commits = [scale(1.0 / NUM_WORKERS, {k: sum(c[k] for c in commits) for k in commits[0]})]
      for commit in commits:  # axis-index order
        u, self.center_state = self.inner.update(commit, self.center_state)
        self.center = add(self.center, u)
      self.x = [dict(self.center) for _ in range(NUM_WORKERS)]
      self.accum = [{k: np.zeros_like(v) for k, v in a.items()} for a in self.accum]


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
@pytest.mark.parametrize("inner_name", sorted(INNERS))
@pytest.mark.parametrize("center_update", ["sequential", "mean"])
def test_agn_matches_numpy(center_update, inner_name, mapping):
  make_inner, make_np_inner, _ = INNERS[inner_name]
  tx = optax_dist.agn(
    make_inner(), communication_period=PERIOD, center_update=center_update, axis_name="w"
  )
  reference = NumpyAGN(make_np_inner(), initial_params(), center_update)
  params, _ = run_against_reference(tx, reference, mapping, random_grads())
  # After the last commit (step 6) every worker restarted from the center: step 7 is local only.
  assert not np.allclose(worker(params, 0)["w"], worker(params, 1)["w"])


def test_agn_sequential_and_mean_differ():
  """With a non-linear inner (Adam), applying the commits one by one is not one step on their
  mean: the two center updates must be told apart by the reference."""
  seq = NumpyAGN(NumpyAdam(0.02), initial_params(), "sequential")
  mean = NumpyAGN(NumpyAdam(0.02), initial_params(), "mean")
  for grads in random_grads(num_steps=PERIOD):
    seq.step(grads)
    mean.step(grads)
  assert not np.allclose(seq.center["w"], mean.center["w"], rtol=1e-3)


def test_agn_pmap_matches_numpy():
  """Users still write ``pmap`` training loops: AGN with Adam, sequential commits."""
  tx = optax_dist.agn(optax.adam(0.02), communication_period=PERIOD, axis_name="w")
  reference = NumpyAGN(NumpyAdam(0.02), initial_params(), "sequential")
  run_against_reference(tx, reference, "pmap", random_grads())


# ----------------------------------------------------------------------------------------------
# Sequential commits: program size independent of N.


def test_agn_sequential_program_size_does_not_grow_with_workers():
  tx = optax_dist.agn(optax.adam(0.1), communication_period=1, axis_name=AXIS)

  def eqns(n):
    params = jax.ShapeDtypeStruct((n, 3), jnp.float32)
    state = jax.eval_shape(jax.vmap(tx.init, axis_name=AXIS), params)
    jaxpr = jax.make_jaxpr(jax.vmap(tx.update, axis_name=AXIS))(params, state, params)
    return _count_eqns(jaxpr.jaxpr)

  assert eqns(2) == eqns(16)


def _count_eqns(jaxpr) -> int:
  """The equations of ``jaxpr`` and of every sub-jaxpr (cond branches, scan bodies), counted
  rather than its printed lines (whose wrapping depends on the numbers printed)."""
  total = 0
  for eqn in jaxpr.eqns:
    total += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          total += _count_eqns(inner)
  return total


# ----------------------------------------------------------------------------------------------
# Bad inputs.


def test_center_update_must_be_sequential_or_mean():
  with pytest.raises(
    ValueError, match=error("agn", "center_update", "must be one of 'sequential', 'mean'", "bogus")
  ):
    optax_dist.agn(sgd(), center_update="bogus")
