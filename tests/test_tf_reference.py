"""TensorFlow 1.x's own unit-test numbers for the wrapped optimizers, through the optax_dist API.

Every asserted number comes from TF's tests (``tf.contrib.opt`` and ``tf.contrib.estimator``
r1.15: elastic_average_optimizer_test, drop_stale_gradient_optimizer_test,
replicate_model_fn_test, agn_optimizer_test, moving_average_optimizer_test) or is derived
analytically where the synchronous port differs from TF's asynchronous schedule. The
tolerances are TF's:

* ``assertAllEqual``: exact;
* ``assertNear(a, b, err)``: ``a == b or |a - b| <= err``;
* ``assertNDArrayNear(a, b, err)``: ``||a - b||_2 < err``;
* ``assertAllCloseAccordingToType``: ``numpy.allclose`` with rtol = atol = 1e-6 for
  float32/float64 and 1e-3 for float16.

TF's asynchronous worker order (each worker exchanging with the center as the previous worker
left it) is reproduced with single-worker transformations whose states share the center.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

# ------------------------------------------------------------------------------------------------
# TF's assertion helpers.


def assert_all_equal(expected, actual):
  np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))


def assert_near(expected, actual, err):
  expected, actual = float(expected), float(np.asarray(actual))
  assert expected == actual or abs(expected - actual) <= err, (expected, actual, err)


def assert_pulled(center, params):
  """``params`` were pulled to ``center``: TF asserts equality; a pull applied as the delta
  ``center - params`` is exact up to float rounding (ALGORITHMS.md), so allow 2 ulp."""
  np.testing.assert_array_max_ulp(np.asarray(params), np.asarray(center), maxulp=2)


def assert_ndarray_near(expected, actual, err):
  diff = np.asarray(actual, np.float64) - np.asarray(expected, np.float64)
  assert np.linalg.norm(diff) < err, (expected, actual, err)


_TOLERANCE_BY_DTYPE = {
  np.dtype(np.float16): 1e-3,
  np.dtype(np.float32): 1e-6,
  np.dtype(np.float64): 1e-6,
}


def assert_all_close_according_to_type(expected, actual):
  actual = np.asarray(actual)
  tol = _TOLERANCE_BY_DTYPE[actual.dtype]
  np.testing.assert_allclose(
    actual.astype(np.float64), np.asarray(expected, np.float64), rtol=tol, atol=tol
  )


def sgd_step(tx):
  """A jitted ``(params, state, grads, **kw) -> (params, state)`` for ``tx``."""

  @jax.jit
  def step(params, state, grads, **extra_args):
    updates, state = tx.update(grads, state, params, **extra_args)
    return optax.apply_updates(params, updates), state

  return step


def constant_grads(params, value):
  return jax.tree.map(lambda p: jnp.full_like(p, value), params)


# ------------------------------------------------------------------------------------------------
# 1. ElasticAverageOptimizer (elastic_average_optimizer_test.py).


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


# ------------------------------------------------------------------------------------------------
# 2. DropStaleGradientOptimizer (drop_stale_gradient_optimizer_test.py).


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


# ------------------------------------------------------------------------------------------------
# 3. TowerOptimizer (replicate_model_fn_test.py): features [[1], [2]], labels [[1], [2]], two
# towers of one row each, c = 10, loss |x c - y| summed.

NUM_TOWERS = 2
MAPPINGS = ("vmap", "shard_map_per_tower", "shard_map_replicated")


def _tower_mesh():
  return Mesh(np.array(jax.devices()[:NUM_TOWERS]), ("t",))


def run_towers(mapping, step, params, batch):
  """Runs ``step(params, batch) -> (params, aux)`` once per tower on the towers' shards.

  ``batch`` leaves are ``[NUM_TOWERS, ...]`` (from ``split_batch``); ``params`` are the same on
  every tower. Returns per-tower params (leading tower axis) and the first tower's ``aux``
  (``aux`` must be reduced over the towers by ``step``), after checking that every tower holds the
  same params.
  """
  tile = lambda tree: jax.tree.map(lambda p: jnp.stack([p] * NUM_TOWERS), tree)
  if mapping == "vmap":
    new_params, aux = jax.jit(jax.vmap(step, axis_name="t"))(tile(params), batch)
    aux = jax.tree.map(lambda a: a[0], aux)
  else:
    mesh = _tower_mesh()
    sharded = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
    squeeze = lambda tree: jax.tree.map(lambda a: a[0], tree)
    expand = lambda tree: jax.tree.map(lambda a: a[None], tree)
    if mapping == "shard_map_per_tower":

      def fn(p, b):
        new_params, aux = step(squeeze(p), squeeze(b))
        return expand(new_params), aux

      params_in, param_spec = sharded(tile(params), P("t")), P("t")
    else:  # params replicated with P(): autodiff sums the gradient over the towers.
      fn = lambda p, b: step(p, squeeze(b))
      params_in, param_spec = sharded(params, P()), P()
    mapped = jax.shard_map(
      fn, mesh=mesh, in_specs=(param_spec, P("t")), out_specs=(param_spec, P())
    )
    new_params, aux = jax.jit(mapped)(params_in, sharded(batch, P("t")))
    if mapping == "shard_map_replicated":
      new_params = tile(new_params)
  for leaf in jax.tree.leaves(new_params):
    for k in range(1, NUM_TOWERS):
      assert_all_equal(leaf[0], leaf[k])
  return new_params, aux


def abs_loss(var, x, y):
  return jnp.sum(jnp.abs(x * var - y))


def tower_train_step(txs, loss_fn, reduce_loss):
  """One tower step: each ``tx`` of ``txs`` in turn, on the gradient of ``loss_fn``.

  Returns the new params and the reported loss: the towers' losses at the params before the
  step, reduced by ``reduce_loss`` (``psum`` for TF's SUM, ``pmean`` otherwise).
  """

  def step(params, batch):
    x, y = batch["features"], batch["labels"]
    reported = reduce_loss(loss_fn(params, x, y), "t")
    for tx in txs:
      grads = jax.grad(loss_fn)(params, x, y)
      updates, _ = tx.update(grads, tx.init(params), params)
      params = optax.apply_updates(params, updates)
    return params, reported

  return step


def tf_batch(features=((1.0,), (2.0,)), labels=None):
  labels = features if labels is None else labels
  batch = {"features": jnp.array(features), "labels": jnp.array(labels)}
  return optax_dist.split_batch(batch, NUM_TOWERS)


def c_loss(params, x, y):
  return abs_loss(params["c"], x, y)


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_tower_train_sum(mapping):
  """``ReplicateModelTest.test_train``: loss 27, c = 10 - (1 + 2) = 7."""
  tx = optax_dist.tower(optax.sgd(1.0), "t", reduction="sum")
  params = {"c": jnp.array(10.0)}
  step = tower_train_step([tx], c_loss, jax.lax.psum)
  params, loss = run_towers(mapping, step, params, tf_batch())
  assert loss == (1.0 * 10 - 1.0) + (2.0 * 10 - 2.0)
  assert params["c"][0] == 7.0


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_tower_train_mean(mapping):
  """``test_train_with_mean_reduction``: loss 13.5, c = 10 - (0.5 + 1) = 8.5; a variable outside
  the loss (gradient zero, TF's None gradient) stays at 1."""
  tx = optax_dist.tower(optax.sgd(1.0), "t", reduction="mean")
  params = {"c": jnp.array(10.0), "another_variable": jnp.array(1.0)}
  step = tower_train_step([tx], c_loss, jax.lax.pmean)
  params, loss = run_towers(mapping, step, params, tf_batch())
  assert loss == ((1.0 * 10 - 1.0) + (2.0 * 10 - 2.0)) / 2.0
  assert params["c"][0] == 8.5
  assert params["another_variable"][0] == 1.0


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_tower_two_steps(mapping):
  """``test_train_two_steps_collected_gradients_are_reset_between_steps``: losses 27 then 24,
  c 7 then 3 (features and labels [[1], [2]], then [[1.5], [2.5]])."""
  tx = optax_dist.tower(optax.sgd(1.0), "t", reduction="sum")
  step = tower_train_step([tx], c_loss, jax.lax.psum)
  params = {"c": jnp.array(10.0)}
  expected_losses = ((1.0 * 10 - 1.0) + (2.0 * 10 - 2.0), (1.5 * 7.0 - 1.5) + (2.5 * 7.0 - 2.5))
  expected_c = (10.0 - 3.0, 7.0 - 4.0)
  for features, loss_want, c_want in zip(
    (((1.0,), (2.0,)), ((1.5,), (2.5,))), expected_losses, expected_c
  ):
    params, loss = run_towers(mapping, step, params, tf_batch(features))
    params = jax.tree.map(lambda a: a[0], params)
    assert loss == loss_want
    assert params["c"] == c_want


def test_tower_single_tower_passes_through():
  """``test_train_single_tower``: one device, default reduction, no scaling: loss 27, c = 7.

  With ``axis_name=None`` (one tower, TF's no-replication case) the updates pass through
  unreduced."""
  tx = optax_dist.tower(optax.sgd(1.0), None)
  params = {"c": jnp.array(10.0)}
  x, y = jnp.array([[1.0], [2.0]]), jnp.array([[1.0], [2.0]])
  loss, grads = jax.value_and_grad(c_loss)(params, x, y)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  params = optax.apply_updates(params, updates)
  assert loss == (1.0 * 10 - 1.0) + (2.0 * 10 - 2.0)
  assert params["c"] == 7.0


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_tower_two_optimizers(mapping):
  """``ReplicateWithTwoOptimizersTest.test_train``: GD(1) then Adam(1), both tower-wrapped with
  SUM: c = 10 - 3 - 1 = 6 (Adam's first step is -lr g / (|g| + eps)), loss 27.

  In float64 like TF's ``c``: in float32, optax's Adam bias correction ``1 - 0.999`` alone is
  off by 1e-5 relative, more than TF's 1e-6.
  """
  with jax.enable_x64(True):
    first = optax_dist.tower(optax.sgd(1.0), "t", reduction="sum")
    second = optax_dist.tower(optax.adam(1.0), "t", reduction="sum")
    step = tower_train_step([first, second], c_loss, jax.lax.psum)
    batch = jax.tree.map(lambda a: a.astype(jnp.float64), tf_batch())
    params, loss = run_towers(mapping, step, {"c": jnp.array(10.0, jnp.float64)}, batch)
    assert params["c"].dtype == jnp.float64
    assert loss == (1.0 * 10 - 1.0) + (2.0 * 10 - 2.0)
    assert_near(6.0, params["c"][0], 1e-6)


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_tower_two_losses_one_optimizer_each(mapping):
  """``ReplicateWithTwoLossesAndOneOptimizer.test_train``: c = 10, d = 2, losses |x c - y| and
  |x d - y| minimised by two tower-wrapped GD(1) with SUM: loss 30, c = 7, d = -1."""
  first = optax_dist.tower(optax.sgd(1.0), "t", reduction="sum")
  second = optax_dist.tower(optax.sgd(1.0), "t", reduction="sum")

  def step(params, batch):
    x, y = batch["features"], batch["labels"]
    loss = abs_loss(params["c"], x, y) + abs_loss(params["d"], x, y)
    reported = jax.lax.psum(loss, "t")
    for tx, name in ((first, "c"), (second, "d")):
      var = params[name]
      grad = jax.grad(abs_loss)(var, x, y)
      updates, _ = tx.update(grad, tx.init(var), var)
      params = {**params, name: optax.apply_updates(var, updates)}
    return params, reported

  params = {"c": jnp.array(10.0), "d": jnp.array(2.0)}
  params, loss = run_towers(mapping, step, params, tf_batch())
  assert loss == (1.0 * 10 - 1.0 + 1.0 * 2.0 - 1.0) + (2.0 * 10 - 2.0 + 2.0 * 2.0 - 2.0)
  assert_near(7.0, params["c"][0], 1e-6)
  assert_near(-1.0, params["d"][0], 1e-6)


# SplitBatchTest.


@pytest.mark.parametrize(
  "num_towers, expected",
  [
    (2, [[0.0, 1.0], [2.0, 3.0]]),
    (4, [[0.0], [1.0], [2.0], [3.0]]),
    (1, [[0.0, 1.0, 2.0, 3.0]]),
  ],
)
def test_split_batch_simple(num_towers, expected):
  shards = optax_dist.split_batch(jnp.array([0.0, 1.0, 2.0, 3.0]), num_towers)
  assert_all_equal(expected, shards)


def test_split_batch_dict_per_key():
  batch = {"first": jnp.array([0.0, 1.0, 2.0, 3.0]), "second": jnp.array([4.0, 5.0, 6.0, 7.0])}
  shards = optax_dist.split_batch(batch, 2)
  assert_all_equal([[0.0, 1.0], [2.0, 3.0]], shards["first"])
  assert_all_equal([[4.0, 5.0], [6.0, 7.0]], shards["second"])


def test_split_batch_labels_dict():
  labels = {"first": jnp.array([10.0, 11.0]), "second": jnp.array([12.0, 13.0])}
  shards = optax_dist.split_batch(labels, 2)
  assert_all_equal([10.0], shards["first"][0])
  assert_all_equal([12.0], shards["second"][0])
  assert_all_equal([11.0], shards["first"][1])
  assert_all_equal([13.0], shards["second"][1])


def test_split_batch_not_divisible():
  """``test_batch_size_that_is_not_divisible_by_the_number_of_gpus``: 3 rows, 2 towers."""
  with pytest.raises(ValueError, match=r"(?s)batch size.*divisible.*number of workers") as info:
    optax_dist.split_batch({"x": jnp.ones((3, 1))}, 2)
  assert "3" in str(info.value) and "2" in str(info.value)


# ------------------------------------------------------------------------------------------------
# 4. AGNOptimizer (agn_optimizer_test.py): Adam(0.1, beta1=0, beta2=0, eps=1e-8), gradients -1:
# every Adam step moves a variable by 0.1 / (1 + 1e-8).


def tf_agn_adam():
  return optax.adam(learning_rate=0.1, b1=0.0, b2=0.0, eps=1e-8)


def test_agn_1_worker_4_period():
  """TF ``test1Workers2Period`` (one worker, period 4; the name is TF's)."""
  tx = optax_dist.agn(tf_agn_adam(), communication_period=4)
  step = sgd_step(tx)
  params = {"v0": jnp.array(0.0), "v1": jnp.array(0.5)}
  grads = constant_grads(params, -1.0)
  state = tx.init(params)

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
  return {"v0": jnp.array(0.0), "v1": jnp.array(0.5), "partition_var": jnp.zeros((2, 4))}


def _assert_agn_center(center, value):
  assert_near(value, center["v0"], 1e-6)
  for part in jnp.split(center["partition_var"], 2):  # two [1, 4] parts, compared to a [4]
    assert_ndarray_near([value] * 4, part, 1e-6)


def test_agn_2_worker_1_period_asynchronous_order():
  """TF ``test2Worker1Period``: w0, w1, w0, w1, w0, w1, each committing to the center (and the
  center's Adam state) as the previous worker left it: +0.1 per worker step."""
  tx = optax_dist.agn(tf_agn_adam(), communication_period=1)
  step = sgd_step(tx)
  params = [_agn_two_worker_params()] * 2
  states = [tx.init(p) for p in params]
  grads = constant_grads(params[0], -1.0)

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
  params = jax.tree.map(lambda p: jnp.stack([p, p]), _agn_two_worker_params())
  state = jax.vmap(tx.init, axis_name="w")(params)
  grads = constant_grads(params, -1.0)
  for round_ in range(1, 4):
    params, state = step(params, state, grads)
    for w in range(2):
      center = jax.tree.map(lambda a, w=w: a[w], state.center)
      _assert_agn_center(center, per_round * round_)
      assert_near(0.5 + per_round * round_, center["v1"], 1e-6)
      for leaf, c in zip(jax.tree.leaves(params), jax.tree.leaves(center)):
        np.testing.assert_allclose(leaf[w], c, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# 5. MovingAverageOptimizer (moving_average_optimizer_test.py): var0 = [1, 2], var1 = [3, 4],
# loss sum(0.1 var0) + sum(0.01 var1), GD(2.0), average_decay 0.5.


def _moving_average_run(sequential_update, dtype):
  tx = optax_dist.moving_average(optax.sgd(2.0), 0.5, sequential_update=sequential_update)
  step = sgd_step(tx)
  orig = {"var0": jnp.array([1.0, 2.0], dtype), "var1": jnp.array([3.0, 4.0], dtype)}
  g0, g1 = jnp.array([0.1, 0.1], dtype), jnp.array([0.01, 0.01], dtype)
  loss = lambda p: jnp.sum(g0 * p["var0"]) + jnp.sum(g1 * p["var1"])
  params, state = orig, tx.init(orig)

  def check_ordering():
    # TF swaps the EMA into the variables: value < average < original, elementwise.
    avg = optax_dist.eval_params(state, params)
    for name in ("var0", "var1"):
      val, av, og = (np.asarray(t[name], np.float64) for t in (params, avg, orig))
      assert np.all(val < av) and np.all(av < og), (name, val, av, og)

  # Step 1.
  params, state = step(params, state, jax.grad(loss)(params))
  assert params["var0"].dtype == dtype and state.ema["var0"].dtype == dtype
  assert_all_close_according_to_type([0.8, 1.8], params["var0"])
  assert_all_close_according_to_type([2.98, 3.98], params["var1"])
  if sequential_update:
    assert_all_close_according_to_type([0.9, 1.9], state.ema["var0"])
    assert_all_close_according_to_type([2.99, 3.99], state.ema["var1"])
    check_ordering()

  # Step 2.
  params, state = step(params, state, jax.grad(loss)(params))
  assert_all_close_according_to_type([0.6, 1.6], params["var0"])
  assert_all_close_according_to_type([2.96, 3.96], params["var1"])
  check_ordering()
  if sequential_update:  # implied by TF's numbers
    assert_all_close_according_to_type([0.75, 1.75], state.ema["var0"])
    assert_all_close_according_to_type([2.975, 3.975], state.ema["var1"])


@pytest.mark.parametrize("sequential_update", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_moving_average_run(sequential_update, dtype):
  """TF ``testRun`` (half and float)."""
  _moving_average_run(sequential_update, dtype)


@pytest.mark.parametrize("sequential_update", [True, False])
def test_moving_average_run_float64(sequential_update):
  """TF ``testRun`` (double), with 64-bit types enabled for this test only."""
  with jax.enable_x64(True):
    _moving_average_run(sequential_update, jnp.float64)


def test_moving_average_correct_override():
  """TF ``testCorrectOverride``: the inner update is applied as is: 1.2 - 2.0 * 2.4 = -3.6."""
  tx = optax_dist.moving_average(optax.sgd(2.0))
  params = jnp.array([1.2])
  grads = jax.grad(lambda v: jnp.sum(v**2))(params)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  inner_updates, _ = optax.sgd(2.0).update(grads, optax.sgd(2.0).init(params), params)
  assert_all_equal(inner_updates, updates)
  assert_near(-3.6, optax.apply_updates(params, updates)[0], 1e-6)
