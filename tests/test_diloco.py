"""diloco against a float64 NumPy reference, the numbers of MaxText's DiLoCo test, equivalences,
its exchange dtype, pmap and one worker."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from _diloco_reference import (
  ATOL,
  ATOL_ADAM,
  AXIS,
  COMM_DTYPES,
  INNERS,
  OUTERS,
  RTOL,
  SHAPES,
  STEPS,
  N,
  _grad,
  assert_eval_params_is_anchor,
  assert_history_close,
  assert_identical_on_workers,
  exchange_bytes,
  integer_plus_a_little,
  problem,
  rounded,
  run,
  shard_map_step,
  steps,
  streaming_reference,
)

import optax_dist

# ----------------------------------------------------------------------------------------------
# Against the reference, equivalences, pmap.


DILOCO_CONFIGS = [
  ("vmap", "sgd", "nesterov", 1),
  ("vmap", "momentum", "nesterov", 3),
  ("vmap", "adam", "sgd1", 2),
  ("shard_map", "adam", "nesterov", 3),
]


@pytest.mark.parametrize("mapping,inner,outer,sync_period", DILOCO_CONFIGS)
def test_diloco_matches_numpy_reference(mapping, inner, outer, sync_period):
  x0, c, d = problem()
  tx = optax_dist.diloco(
    INNERS[inner][0](), OUTERS[outer][0](), sync_period=sync_period, axis_name=AXIS
  )
  history, state = run(tx, x0, c, d, mapping)
  reference, anchor = streaming_reference(
    INNERS[inner][1](), OUTERS[outer][1](), x0, c, d, sync_period=sync_period,
    ids=dict.fromkeys(x0, 0),
  )
  atol = ATOL_ADAM if inner == "adam" else ATOL
  assert_history_close(history, reference, atol=atol)
  assert_identical_on_workers(state.anchor)
  for k in anchor:
    np.testing.assert_allclose(np.asarray(state.anchor[k])[0], anchor[k], RTOL, atol)
  assert_eval_params_is_anchor(state, history)
  np.testing.assert_array_equal(np.asarray(state.local_step), STEPS)
  if sync_period > 1:  # the workers differ between syncs, and coincide on sync steps
    assert not np.allclose(history["a"][sync_period - 2, 0], history["a"][sync_period - 2, 1])
  np.testing.assert_allclose(  # x_i + (anchor - x_i): the anchor up to rounding
    history["a"][sync_period - 1, 0], history["a"][sync_period - 1, 1], rtol=1e-6, atol=1e-7
  )


@pytest.mark.parametrize("inner,sync_period", [("adam", 3)])
def test_diloco_with_outer_sgd_1_is_local_sgd(inner, sync_period):
  x0, c, d = problem(3)
  diloco = optax_dist.diloco(
    INNERS[inner][0](), optax.sgd(1.0), sync_period=sync_period, axis_name=AXIS
  )
  local = optax_dist.local_sgd(INNERS[inner][0](), sync_period=sync_period, axis_name=AXIS)
  history_diloco, state = run(diloco, x0, c, d)
  history_local, _ = run(local, x0, c, d)
  for k in x0:
    np.testing.assert_allclose(history_diloco[k], history_local[k], rtol=1e-5, atol=1e-6)
  # The anchor is the workers' mean after the last sync.
  last_sync = (STEPS // sync_period) * sync_period
  np.testing.assert_allclose(
    np.asarray(state.anchor["c"])[0], history_local["c"][last_sync - 1, 0], rtol=1e-5, atol=1e-6
  )


def test_diloco_under_pmap_matches_vmap():
  """Users still write pmap loops: the same steps, one per device."""
  x0, c, d = problem(8)
  tx = optax_dist.diloco(optax.sgd(0.1, momentum=0.9), sync_period=2, axis_name=AXIS)
  history, _ = run(tx, x0, c, d)
  devices = jax.devices()[:N]

  def step(x, s, c, d):
    u, s = tx.update(_grad(x, c, d), s, x)
    return optax.apply_updates(x, u), s

  step = jax.pmap(step, axis_name=AXIS, devices=devices)
  to32 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)
  x = to32({k: np.broadcast_to(v, (N, *v.shape)) for k, v in x0.items()})
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(x)
  for t in range(STEPS):
    x, state = step(x, state, to32(c), to32({k: v[t] for k, v in d.items()}))
    for k in x0:
      np.testing.assert_allclose(np.asarray(x[k]), history[k][t], rtol=RTOL, atol=ATOL)
  assert_identical_on_workers(state.anchor)


# ----------------------------------------------------------------------------------------------
# Numbers asserted by MaxText's own test.


def test_maxtext_diloco_numbers():
  """MaxText's diloco_test: 2 replicas, linear model, MSE, inner SGD 0.1, outer Nesterov lr 1.

  Replica 0's loss on steps 1-4 is 1.0, 0.49, 0.2401 and 0.207545 (rtol 1e-2 there), and after
  the sync on step 3 the params are w = (1.5345, 1.0494), b = 0.5839 (four decimals).
  """
  tx = optax_dist.diloco(
    optax.sgd(0.1), optax.sgd(1.0, momentum=0.9, nesterov=True), sync_period=3, axis_name=AXIS
  )
  inputs = np.array([[[0.0, 1.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]], np.float32)
  labels = np.array([[[1.0], [2.0]], [[2.0], [3.0]]], np.float32)

  def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

  def step(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  params = {"w": np.array([[[2.0], [1.0]]] * 2, np.float32), "b": np.ones((2, 1), np.float32)}
  state = jax.jit(jax.vmap(tx.init, axis_name=AXIS))(params)
  step = jax.jit(jax.vmap(step, axis_name=AXIS))
  losses = []
  for t in range(4):
    params, state, loss = jax.device_get(step(params, state, inputs, labels))
    losses.append(float(loss[0]))
    if t == 2:
      np.testing.assert_allclose(params["w"][:, :, 0], [[1.5345, 1.0494]] * 2, atol=1e-4)
      np.testing.assert_allclose(params["b"][:, 0], [0.5839] * 2, atol=1e-4)
  np.testing.assert_allclose(losses, [1.0, 0.49, 0.2401, 0.207545], rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# Communication dtype, one worker.


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
def test_float8_exchange_sums_quantized_values_in_float32(mapping):
  """With float8 the workers' pseudo-gradients are quantized, gathered and summed in float32.

  x0 = 0 and outer SGD 1 after one inner SGD step: the anchor becomes -mean_i q(g_i), with q the
  rounding to float8_e4m3fn, summed exactly (no float8 rounding of partial sums, no overflow
  of float8's range even where the sum exceeds 448).
  """
  rng = np.random.RandomState(6)
  grads = {k: rng.uniform(-200, 200, (N, *s)).astype(np.float32) for k, s in SHAPES.items()}
  tx = optax_dist.diloco(
    optax.sgd(1.0), optax.sgd(1.0), sync_period=1, axis_name=AXIS, comm_dtype=jnp.float8_e4m3fn
  )
  params = {k: np.zeros((N, *s), np.float32) for k, s in SHAPES.items()}
  if mapping == "vmap":
    state = jax.jit(jax.vmap(tx.init, axis_name=AXIS))(params)
    _, state = jax.jit(jax.vmap(tx.update, axis_name=AXIS))(grads, state, params)
  else:
    init, step, put = shard_map_step(tx)
    params = put(params)
    _, state = step(params, init(params), put(grads))
  assert_identical_on_workers(state.anchor)
  for k, g in grads.items():
    quantized = g.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    expected = -(quantized.sum(axis=0) / N)
    np.testing.assert_allclose(np.asarray(state.anchor[k])[0], expected, rtol=1e-7)
  # Some sums exceed float8_e4m3fn's largest value, 448: a float8 psum would give NaN there.
  totals = np.concatenate([g.astype(ml_dtypes.float8_e4m3fn).astype(np.float64).sum(0).ravel()
                           for g in grads.values()])
  assert np.max(np.abs(totals)) > 448


def test_one_worker_diloco_is_an_outer_step_on_its_own_progress():
  # H = 2, inner SGD 1, outer Nesterov: after two steps of gradient -1 from 0, x' = 2,
  # delta = -2, trace = -2, anchor = 0 + 0.7 (2 + 0.9 * 2) = 2.66.
  tx = optax_dist.diloco(optax.sgd(1.0), sync_period=2)
  params = np.zeros(1, np.float32)
  state = jax.jit(tx.init)(params)

  @jax.jit
  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(2):
    params, state = step(-np.ones(1, np.float32), state, params)
  np.testing.assert_allclose(params, [2.66], rtol=1e-6)
  np.testing.assert_allclose(state.anchor, [2.66], rtol=1e-6)
  np.testing.assert_allclose(state.outer_state[0].trace, [-2.0])


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
@pytest.mark.parametrize("comm", sorted(COMM_DTYPES))
def test_comm_dtype_rounds_the_exchanged_pseudo_gradients(comm, mapping):
  """From x0 = 0, inner SGD 1 and outer SGD 1, one sync: each worker's pseudo-gradient is its
  gradient, rounded to ``comm_dtype`` before the exchange; the anchor and the params become
  minus the mean of the rounded values, exactly."""
  grads = integer_plus_a_little(11)
  tx = optax_dist.diloco(
    optax.sgd(1.0), optax.sgd(1.0), sync_period=1, axis_name=AXIS, comm_dtype=COMM_DTYPES[comm]
  )
  [(params, state)] = steps(tx, [grads], mapping)
  for k, g in grads.items():
    expected = -rounded(g, comm).sum(axis=0) / N
    assert np.all(np.abs(expected + g.astype(np.float64).mean(axis=0)) > 1e-3)  # rounding shows
    np.testing.assert_array_equal(np.asarray(state.anchor[k], np.float64), [expected] * N)
    np.testing.assert_array_equal(np.asarray(params[k], np.float64), [expected] * N)


def test_comm_dtype_sets_the_bytes_of_the_sync():
  """bfloat16 halves the float32 all-reduce; float8_e4m3fn is gathered, a quarter of the bytes
  sent and N times that received."""
  params_bytes = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
  got = exchange_bytes(
    lambda dtype: optax_dist.diloco(
      optax.sgd(0.1), sync_period=3, axis_name=AXIS, comm_dtype=dtype
    )
  )
  assert got == {
    "float32": (("all-reduce",), params_bytes, params_bytes),
    "bfloat16": (("all-reduce",), params_bytes // 2, params_bytes // 2),
    "float8_e4m3fn": (("all-gather",), params_bytes // 4, N * params_bytes // 4),
  }
