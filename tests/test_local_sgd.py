"""local_sgd against a float64 NumPy reference, its warm-up, its exchange dtype and bad inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _diloco_reference import (
  ATOL,
  ATOL_ADAM,
  AXIS,
  COMM_DTYPES,
  INNERS,
  SHAPES,
  STEPS,
  N,
  assert_history_close,
  error,
  exchange_bytes,
  integer_plus_a_little,
  np_grad,
  problem,
  rounded,
  run,
  steps,
)

import optax_dist


def local_sgd_reference(inner, x0, c, d, *, sync_period, warmup_steps):
  keys = list(x0)
  x = [dict(x0) for _ in range(N)]
  inner_states = [inner.init(x0) for _ in range(N)]
  history = []
  for t in range(STEPS):
    step = t + 1
    grads = [np_grad(c, d, x[i], i, t) for i in range(N)]
    if step <= warmup_steps:
      mean = {k: np.mean([g[k] for g in grads], axis=0) for k in keys}
      grads = [mean] * N
    new_x = []
    for i in range(N):
      u, inner_states[i] = inner.update(grads[i], inner_states[i])
      new_x.append({k: x[i][k] + u[k] for k in keys})
    if step > warmup_steps and (step - warmup_steps) % sync_period == 0:
      mean = {k: np.mean([xi[k] for xi in new_x], axis=0) for k in keys}
      new_x = [dict(mean) for _ in range(N)]
    x = new_x
    history.append(x)
  return history


LOCAL_SGD_CONFIGS = [
  ("vmap", "sgd", 2, 0),
  ("vmap", "adam", 1, 3),
  ("shard_map", "momentum", 3, 2),
]


@pytest.mark.parametrize("mapping,inner,sync_period,warmup_steps", LOCAL_SGD_CONFIGS)
def test_local_sgd_matches_numpy_reference(mapping, inner, sync_period, warmup_steps):
  x0, c, d = problem(2)
  tx = optax_dist.local_sgd(
    INNERS[inner][0](), sync_period=sync_period, warmup_steps=warmup_steps, axis_name=AXIS
  )
  history, state = run(tx, x0, c, d, mapping)
  reference = local_sgd_reference(
    INNERS[inner][1](), x0, c, d, sync_period=sync_period, warmup_steps=warmup_steps
  )
  assert_history_close(history, reference, atol=ATOL_ADAM if inner == "adam" else ATOL)
  assert set(state._fields) == {"local_step", "inner_state"}  # no anchor: params are evaluated
  params = {k: v[-1] for k, v in history.items()}
  assert optax_dist.eval_params(state, params) is params
  # Identical workers through the warm-up and on model-average steps, apart in between.
  first_average = warmup_steps + sync_period
  for t in range(warmup_steps):
    np.testing.assert_array_equal(history["b"][t, 0], history["b"][t, 3], err_msg=f"step {t + 1}")
  np.testing.assert_allclose(
    history["b"][first_average - 1, 0], history["b"][first_average - 1, 3], rtol=1e-6, atol=1e-7
  )
  if sync_period > 1:
    assert not np.allclose(history["b"][first_average - 2, 0], history["b"][first_average - 2, 3])


# ----------------------------------------------------------------------------------------------
# Bad inputs.


@pytest.mark.parametrize("value,exc", [(-1, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_warmup_steps_must_be_a_non_negative_int(value, exc):
  constraint = "must be an int >= 0" if exc is ValueError else "must be an int"
  with pytest.raises(exc, match=error("local_sgd", "warmup_steps", constraint, value)):
    optax_dist.local_sgd(optax.sgd(0.1), sync_period=2, warmup_steps=value)


# ----------------------------------------------------------------------------------------------
# The exchange in comm_dtype.


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
@pytest.mark.parametrize("comm", sorted(COMM_DTYPES))
def test_comm_dtype_rounds_the_averaged_params(comm, mapping):
  """From x0 = 0 with SGD 1 and gradients -v_i, one model average: the params x'_i = v_i are
  rounded to ``comm_dtype`` before the exchange; every worker lands on their mean, exactly."""
  values = integer_plus_a_little(12)
  tx = optax_dist.local_sgd(
    optax.sgd(1.0), sync_period=1, axis_name=AXIS, comm_dtype=COMM_DTYPES[comm]
  )
  [(params, _)] = steps(tx, [jax.tree.map(np.negative, values)], mapping)
  for k, v in values.items():
    expected = rounded(v, comm).sum(axis=0) / N
    assert np.all(np.abs(expected - v.astype(np.float64).mean(axis=0)) > 1e-3)  # rounding shows
    np.testing.assert_array_equal(np.asarray(params[k], np.float64), [expected] * N)


def test_comm_dtype_sets_the_bytes_of_the_average():
  params_bytes = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
  got = exchange_bytes(
    lambda dtype: optax_dist.local_sgd(
      optax.sgd(0.1), sync_period=3, axis_name=AXIS, comm_dtype=dtype
    )
  )
  assert got == {
    "float32": (("all-reduce",), params_bytes, params_bytes),
    "bfloat16": (("all-reduce",), params_bytes // 2, params_bytes // 2),
    "float8_e4m3fn": (("all-gather",), params_bytes // 4, N * params_bytes // 4),
  }


# ----------------------------------------------------------------------------------------------
# The warm-up with workers that start apart.


def local_sgd_reference_from(inner, x0s, c, d, *, sync_period, warmup_steps):
  """local_sgd's equations, worker i starting from ``x0s[i]``; params per step and worker."""
  keys = list(x0s[0])
  x = [dict(x0) for x0 in x0s]
  inner_states = [inner.init(x0) for x0 in x0s]
  history = []
  for t in range(STEPS):
    step = t + 1
    grads = [np_grad(c, d, x[i], i, t) for i in range(N)]
    if step <= warmup_steps:  # the gradients' mean, each worker on its own params
      mean = {k: np.mean([g[k] for g in grads], axis=0) for k in keys}
      grads = [mean] * N
    for i in range(N):
      u, inner_states[i] = inner.update(grads[i], inner_states[i])
      x[i] = {k: x[i][k] + u[k] for k in keys}
    if step > warmup_steps and (step - warmup_steps) % sync_period == 0:
      mean = {k: np.mean([xi[k] for xi in x], axis=0) for k in keys}
      x = [dict(mean) for _ in range(N)]
    history.append(list(x))
  return history


@pytest.mark.parametrize("warmup_steps,sync_period", [(3, 2), (2, 3)])
def test_warmup_keeps_workers_that_start_apart_apart(warmup_steps, sync_period):
  """Workers starting from different params: through the warm-up each applies the workers' mean
  gradient to its own params (no model average: they stay apart, exactly as separate runs on
  those gradients); the first model average is on step W + H, not before."""
  x0, c, d = problem(9)
  rng = np.random.RandomState(10)
  x0s = [{k: v + rng.uniform(-1, 1, v.shape) for k, v in x0.items()} for _ in range(N)]
  tx = optax_dist.local_sgd(
    INNERS["momentum"][0](), sync_period=sync_period, warmup_steps=warmup_steps, axis_name=AXIS
  )
  reference = local_sgd_reference_from(
    INNERS["momentum"][1](), x0s, c, d, sync_period=sync_period, warmup_steps=warmup_steps
  )

  def worker_run(x, c, d):
    def body(carry, d_t):
      x, s = carry
      u, s = tx.update(jax.tree.map(lambda x, c, d: c * x - d, x, c, d_t), s, x)
      x = optax.apply_updates(x, u)
      return (x, s), x

    return jax.lax.scan(body, (x, tx.init(x)), d)[1]

  to32 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)
  x = to32({k: np.stack([x0[k] for x0 in x0s]) for k in x0})
  history = jax.jit(jax.vmap(worker_run, axis_name=AXIS))(
    x, to32(c), to32(jax.tree.map(lambda a: np.swapaxes(a, 0, 1), d))
  )
  history = {k: np.swapaxes(np.asarray(v, np.float64), 0, 1) for k, v in history.items()}
  assert_history_close(history, reference)
  first_average = warmup_steps + sync_period
  for t in range(first_average - 1):  # steps 1 .. W + H - 1: the workers apart
    for k in x0:
      assert np.min(np.abs(history[k][t, 0] - history[k][t, 1])) > 1e-3, f"step {t + 1} {k}"
  for k in x0:  # step W + H: all on the mean
    np.testing.assert_allclose(
      history[k][first_average - 1], np.broadcast_to(history[k][first_average - 1, 0],
                                                      history[k][first_average - 1].shape),
      rtol=1e-6, atol=1e-7,
    )
