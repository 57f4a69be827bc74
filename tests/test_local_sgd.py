"""local_sgd against a float64 NumPy reference, its warm-up, its exchange dtype and bad inputs."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from _diloco_reference import (
  ATOL,
  ATOL_ADAM,
  AXIS,
  INNERS,
  STEPS,
  N,
  assert_history_close,
  error,
  np_grad,
  problem,
  run,
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
