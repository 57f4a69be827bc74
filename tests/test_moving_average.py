"""moving_average's timing, checked on moving params against a NumPy reference.

The contract: a ``decay`` schedule is called with the count *before* the increment (0 on the first
update); with ``use_num_updates`` the decay is capped at ``(1 + t) / (10 + t)`` with ``t`` the count
*after* the increment (1 on the first update); ``ema = d ema + (1 - d) p`` with ``p`` the params
after this update (``sequential_update=True``) or before it. Every case moves the params on every
step, so a wrong count, a wrong cap or the params of the wrong side of the update all show.

Also TF's MovingAverageOptimizer numbers, four workers each with its own average (no
collectives), and bad inputs.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import (
  assert_all_close_according_to_type,
  assert_all_equal,
  assert_near,
  called,
  error,
  sgd,
  sgd_step,
)
from _multiworker import (
  NUM_WORKERS,
  Mapped,
  NumpySGD,
  add,
  assert_close,
  initial_params,
  random_grads,
  scale,
  stack,
  worker,
)

import optax_dist

STEPS = 6
LR = 0.5


def grads(step):
  return np.array([1.0 + step, -2.0, 0.5 * step], np.float64)


def numpy_ema(decay, use_num_updates, sequential_update):
  """float64 reference: plain SGD params and the EMA after each of ``STEPS`` updates."""
  params = np.array([1.0, -1.0, 2.0])
  ema = params.copy()
  history = []
  for count in range(STEPS):  # count: updates before this one
    d = decay(count) if callable(decay) else decay
    if use_num_updates:
      d = min(d, (1.0 + (count + 1)) / (10.0 + (count + 1)))
    new_params = params - LR * grads(count)
    ema = d * ema + (1.0 - d) * (new_params if sequential_update else params)
    params = new_params
    history.append(ema.copy())
  return np.array(history)


def run(decay, use_num_updates, sequential_update):
  tx = optax_dist.moving_average(
    optax.sgd(LR), decay, use_num_updates=use_num_updates, sequential_update=sequential_update
  )
  params = jnp.array([1.0, -1.0, 2.0])
  state = tx.init(params)
  history = []
  for step in range(STEPS):
    updates, state = tx.update(jnp.asarray(grads(step), jnp.float32), state, params)
    params = optax.apply_updates(params, updates)
    history.append(optax_dist.eval_params(state, params))
  return np.array(history)


DECAYS = {
  "constant": 0.6,
  # Different on every count, so a schedule called one count late is visible.
  "schedule": optax.linear_schedule(0.2, 0.8, STEPS),
  # Above the cap (1 + t) / (10 + t) on every step: the cap decides; a max() would not cap.
  "capped": 0.95,
  # Below the cap from t = 3 on ((1 + 3) / 13 = 0.31 > 0.25): min() switches between the two.
  "crossing": 0.25,
}


@pytest.mark.parametrize("sequential_update", [True, False])
@pytest.mark.parametrize("use_num_updates", [False, True])
@pytest.mark.parametrize("decay", DECAYS)
def test_ema_matches_numpy_reference(decay, use_num_updates, sequential_update):
  got = run(DECAYS[decay], use_num_updates, sequential_update)
  want = numpy_ema(DECAYS[decay], use_num_updates, sequential_update)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_use_num_updates_changes_the_average():
  """The cap is not a no-op on these cases: with and without it the averages differ."""
  for decay in ("capped", "crossing"):
    assert not np.allclose(run(DECAYS[decay], True, True), run(DECAYS[decay], False, True))


def test_first_update_uses_count_one_in_the_cap():
  """First update, decay 0.95 capped: d = (1 + 1) / (10 + 1) = 2/11 (not 1/10 with count 0)."""
  tx = optax_dist.moving_average(optax.sgd(1.0), 0.95, use_num_updates=True)
  params = jnp.array([0.0])
  _, state = tx.update(jnp.array([-11.0]), tx.init(params), params)  # params move to 11
  np.testing.assert_allclose(state.ema, [(1 - 2 / 11) * 11.0], rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# TF's MovingAverageOptimizer tests (moving_average_optimizer_test.py): var0 = [1, 2],
# var1 = [3, 4], loss sum(0.1 var0) + sum(0.01 var1), GD(2.0), average_decay 0.5.


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


# ----------------------------------------------------------------------------------------------
# Four workers, each on its own: no collectives.


@pytest.mark.parametrize("sequential_update", [True, False])
def test_moving_average_per_worker_matches_numpy(sequential_update):
  decay = 0.8
  tx = optax_dist.moving_average(
    optax.sgd(0.05, momentum=0.9), decay, sequential_update=sequential_update
  )
  mapped = Mapped(tx, "vmap")
  starts = [initial_params(seed=10 + i) for i in range(NUM_WORKERS)]
  params = stack(starts)
  state = mapped.init(params)
  np_inner = NumpySGD(0.05, 0.9)
  xs, emas = [dict(s) for s in starts], [dict(s) for s in starts]
  np_states = [np_inner.init(s) for s in starts]
  for grads in random_grads(num_steps=5):
    params, state = mapped.step(params, state, stack(grads))
    for i in range(NUM_WORKERS):
      u, np_states[i] = np_inner.update(grads[i], np_states[i])
      new_x = add(xs[i], u)
      p = new_x if sequential_update else xs[i]
      emas[i] = add(scale(decay, emas[i]), scale(1 - decay, p))
      xs[i] = new_x
      assert_close(worker(params, i), xs[i])
      assert_close(worker(state.ema, i), emas[i])
      assert_close(worker(optax_dist.eval_params(state, params), i), emas[i])


# ----------------------------------------------------------------------------------------------
# Bad inputs.


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_decay_must_be_in_unit_interval(value):
  with pytest.raises(
    ValueError, match=error("moving_average", "decay", "must be in [0, 1]", value)
  ):
    optax_dist.moving_average(sgd(), decay=value)
  optax_dist.moving_average(sgd(), decay=0.0)
  optax_dist.moving_average(sgd(), decay=1.0)


@pytest.mark.parametrize("value", ["0.9", [0.9]])
def test_decay_must_be_a_number_or_schedule(value):
  with pytest.raises(TypeError, match=called("moving_average", "decay") + ".*real number"):
    optax_dist.moving_average(sgd(), decay=value)
  optax_dist.moving_average(sgd(), decay=optax.constant_schedule(0.9))


@pytest.mark.parametrize(
  "leaf,dtype", [(jnp.zeros((), jnp.int32), "int32"), (jnp.array([True]), "bool")]
)
def test_moving_average_rejects_non_floating_leaves(leaf, dtype):
  tx = optax_dist.moving_average(optax.sgd(0.1))
  params = {"w": jnp.ones(2), "step": leaf}
  pattern = (
    re.escape("`moving_average`")
    + ".*floating-point.*"
    + re.escape("['step']")
    + ".*"
    + re.escape(dtype)
  )
  with pytest.raises(TypeError, match=pattern):
    tx.init(params)
  with pytest.raises(TypeError, match=pattern):
    jax.eval_shape(tx.init, params)


@pytest.mark.parametrize("dtype", [jnp.int32, "bool", "float33"])
def test_ema_dtype_must_be_floating(dtype):
  with pytest.raises(TypeError, match=error("moving_average", "ema_dtype", "floating dtype", dtype)):
    optax_dist.moving_average(sgd(), ema_dtype=dtype)
