"""optax_dist.delayed_nesterov against float64 NumPy references, alone and as diloco's outer.

The references below are written from Liu et al. 2024, Algorithm 3, as a loop over the whole
sequence of pseudo-gradients (the window of N, the momentum update on its last one, the
activation term on the others), not from the implementation's select-based update.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist

RTOL, ATOL = 1e-5, 1e-6


def np_delayed_nesterov_updates(grads, *, lr, beta, n, c):
  """Every update ``u_t`` of Algorithm 3 for the pseudo-gradients ``grads[t]``, and the final
  momentum and buffer (float64)."""
  m = np.zeros_like(grads[0], np.float64)
  window = []  # the pseudo-gradients received since the last momentum update
  out = []
  for t, g in enumerate(grads.astype(np.float64)):
    window.append(g)
    if len(window) == n:  # t + 1 is a multiple of N
      m = beta * m + np.sum(window, axis=0) / n
      out.append(-lr * ((1.0 - c * n + c) * beta * m + g / n))
      window = []
    else:
      out.append(-lr * (c * beta * m + g / n))
    assert len(window) == (t + 1) % n
  buffer = np.sum(window, axis=0) if window else np.zeros_like(m)
  return np.stack(out), m, buffer


@pytest.mark.parametrize(("buffer_size", "activation"), [(1, 0.0), (3, 0.0), (3, 0.2)])
def test_matches_the_numpy_reference_step_by_step(buffer_size, activation):
  grads = np.random.default_rng(0).normal(size=(11, 2, 3)).astype(np.float32)
  tx = optax_dist.delayed_nesterov(0.4, momentum=0.8, buffer_size=buffer_size,
                                   activation=activation)
  update = jax.jit(tx.update)
  state = tx.init(jnp.zeros((2, 3)))
  for t, g in enumerate(grads):
    u, state = update(jnp.asarray(g), state)
    expected, m, buffer = np_delayed_nesterov_updates(
      grads[: t + 1], lr=0.4, beta=0.8, n=buffer_size, c=activation)
    np.testing.assert_allclose(u, expected[-1], rtol=RTOL, atol=ATOL, err_msg=f"update {t}")
    np.testing.assert_allclose(state.momentum, m, rtol=RTOL, atol=ATOL, err_msg=f"m at {t}")
    np.testing.assert_allclose(state.buffer, buffer, rtol=RTOL, atol=ATOL, err_msg=f"Δ at {t}")
    assert int(state.count) == t + 1
  assert update._cache_size() == 1


def test_a_buffer_of_one_is_optax_nesterov_sgd():
  grads = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)
  ours = optax_dist.delayed_nesterov(0.7, momentum=0.9, buffer_size=1)
  theirs = optax.sgd(0.7, momentum=0.9, nesterov=True)
  s1, s2 = ours.init(jnp.zeros(4)), theirs.init(jnp.zeros(4))
  for g in grads:
    (u1, s1), (u2, s2) = ours.update(jnp.asarray(g), s1), theirs.update(jnp.asarray(g), s2)
    np.testing.assert_allclose(u1, u2, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(s1.momentum, s2[0].trace, rtol=1e-6, atol=1e-7)


def test_a_window_is_one_nesterov_step_on_the_mean():
  # With c = 0 the N updates of a window sum to optax's Nesterov update on their mean.
  n = 4
  grads = np.random.default_rng(2).normal(size=(3, n, 2)).astype(np.float32)
  ours = optax_dist.delayed_nesterov(0.5, momentum=0.7, buffer_size=n)
  theirs = optax.sgd(0.5, momentum=0.7, nesterov=True)
  s1, s2 = ours.init(jnp.zeros(2)), theirs.init(jnp.zeros(2))
  for window in grads:
    total = jnp.zeros(2)
    for g in window:
      u, s1 = ours.update(jnp.asarray(g), s1)
      total = total + u
    expected, s2 = theirs.update(jnp.asarray(window.mean(axis=0)), s2)
    np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-6)


def test_keeps_its_state_dtypes_under_jit():
  tx = optax_dist.delayed_nesterov(0.5, buffer_size=2, activation=0.5)
  params = {"w": jnp.zeros(3, jnp.bfloat16), "b": jnp.zeros((), jnp.float32)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(3):
    updates, state = update(jax.tree.map(jnp.ones_like, params), state)
  assert update._cache_size() == 1
  assert jax.tree.map(lambda x: x.dtype, state.momentum) == jax.tree.map(
    lambda x: x.dtype, params)
  assert jax.tree.map(lambda x: x.dtype, updates) == jax.tree.map(lambda x: x.dtype, params)


# ----------------------------------------------------------------------------------------------
# As the outer optimizer of optax_dist.diloco, four workers under vmap.

AXIS, W, H, SYNCS = "w", 4, 3, 7


def quadratic_data():
  """Worker w's gradient at x on its t-th step: ``c_w * x - d_w[t]``."""
  rng = np.random.default_rng(2)
  c = rng.uniform(0.5, 1.5, size=(W, 3)).astype(np.float32)
  d = rng.normal(size=(W, H * SYNCS, 3)).astype(np.float32)
  return c, d


@pytest.mark.parametrize(("buffer_size", "activation"), [(3, 0.0), (2, 0.25)])
def test_as_the_outer_optimizer_of_diloco_under_vmap(buffer_size, activation):
  c, d = quadratic_data()
  x0 = np.linspace(-1.0, 1.0, 3).astype(np.float32)
  inner_lr, inner_beta, lr, beta = 0.1, 0.5, 0.6, 0.9
  outer = optax_dist.delayed_nesterov(lr, momentum=beta, buffer_size=buffer_size,
                                      activation=activation)
  tx = optax_dist.diloco(optax.sgd(inner_lr, momentum=inner_beta), outer, sync_period=H,
                         axis_name=AXIS)

  def worker(c_w, d_w):
    def step(carry, d_t):
      x, state = carry
      updates, state = tx.update(c_w * x - d_t, state, x)
      x = optax.apply_updates(x, updates)
      return (x, state), x

    (_, state), xs = jax.lax.scan(step, (jnp.asarray(x0), tx.init(jnp.asarray(x0))), d_w)
    return xs, state

  xs, state = jax.jit(jax.vmap(worker, axis_name=AXIS))(jnp.asarray(c), jnp.asarray(d))

  # The reference: local momentum SGD (each worker's own trace, kept across syncs); every H
  # steps the mean pseudo-gradient goes through Algorithm 3 and every worker lands on θ.
  x = np.tile(x0.astype(np.float64), (W, 1))
  trace = np.zeros_like(x)
  theta = x0.astype(np.float64)
  deltas = []
  for t in range(H * SYNCS):
    g = c * x - d[:, t]
    trace = g + inner_beta * trace
    x = x - inner_lr * trace
    if (t + 1) % H == 0:
      deltas.append((theta - x).mean(axis=0))
      u, m, _ = np_delayed_nesterov_updates(np.stack(deltas), lr=lr, beta=beta, n=buffer_size,
                                            c=activation)
      theta = theta + u[-1]
      x = np.tile(theta, (W, 1))
    np.testing.assert_allclose(xs[:, t], x, rtol=RTOL, atol=1e-5, err_msg=f"step {t + 1}")
  np.testing.assert_allclose(state.anchor[0], theta, rtol=RTOL, atol=1e-5)
  np.testing.assert_allclose(state.outer_state.momentum[0], m, rtol=RTOL, atol=1e-5)
  assert int(state.outer_state.count[0]) == SYNCS


# ----------------------------------------------------------------------------------------------
# The old emulator names.


@pytest.mark.parametrize("name", ["delayed_nesterov", "DelayedNesterovState"])
def test_the_emulator_names_are_deprecated_aliases(name):
  from optax_dist import async_emulator as ae
  from optax_dist.async_emulator import outer

  for module in (ae, outer):
    with pytest.warns(DeprecationWarning, match=f"use `optax_dist.{name}`"):
      alias = getattr(module, name)
    assert alias is getattr(optax_dist, name)
  assert name not in ae.__all__
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    getattr(optax_dist, name)
  with pytest.raises(AttributeError):
    ae.no_such_name  # noqa: B018


def test_errors():
  with pytest.raises(ValueError, match=r"delayed_nesterov\(activation=...\)` must be in \[0, 1/"):
    optax_dist.delayed_nesterov(buffer_size=4, activation=0.5)
  with pytest.raises(ValueError, match=r"delayed_nesterov\(buffer_size=...\)` must be a positive"):
    optax_dist.delayed_nesterov(buffer_size=0)
  with pytest.raises(ValueError, match=r"delayed_nesterov\(momentum=...\)` must be in \[0, 1\)"):
    optax_dist.delayed_nesterov(momentum=1.0, buffer_size=2)
  with pytest.raises(ValueError, match=r"delayed_nesterov\(learning_rate=...\)"):
    optax_dist.delayed_nesterov(0.0, buffer_size=2)


def test_resize_state_keeps_diloco_outer_delayed_nesterov_state():
  outer = optax_dist.delayed_nesterov(0.6, buffer_size=3, activation=0.2)
  tx = optax_dist.diloco(optax.sgd(0.1), outer, sync_period=2, axis_name=AXIS)
  c, d = quadratic_data()
  x = jnp.tile(jnp.asarray(np.linspace(-1.0, 1.0, 3), jnp.float32), (W, 1))
  state = jax.vmap(tx.init)(x)
  step = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p), axis_name=AXIS))
  for t in range(5):
    updates, state = step(jnp.asarray(c) * x - jnp.asarray(d[:, t]), state, x)
    x = optax.apply_updates(x, updates)
  new_state, new_x = optax_dist.resize_state(tx, state, x, 2)
  for old, new in zip(jax.tree.leaves(state.outer_state), jax.tree.leaves(new_state.outer_state)):
    np.testing.assert_array_equal(new, np.broadcast_to(old[0], new.shape))
  assert new_state.outer_state.momentum.shape == (2, 3)


def test_inject_hyperparams_gives_the_same_updates():
  injected = optax.inject_hyperparams(optax_dist.delayed_nesterov, static_args=("buffer_size",))(
    learning_rate=0.7, momentum=0.9, buffer_size=3, activation=0.1)
  plain = optax_dist.delayed_nesterov(0.7, 0.9, buffer_size=3, activation=0.1)
  s1, s2 = injected.init(jnp.zeros(2)), plain.init(jnp.zeros(2))
  update = jax.jit(injected.update)
  for g in np.random.default_rng(3).normal(size=(7, 2)).astype(np.float32):
    (u1, s1), (u2, s2) = update(jnp.asarray(g), s1), plain.update(jnp.asarray(g), s2)
    np.testing.assert_allclose(u1, u2, rtol=1e-6, atol=1e-7)
  assert update._cache_size() == 1


# ----------------------------------------------------------------------------------------------
# A learning-rate schedule, evaluated at the number of update calls before this one.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_constant_schedule_gives_the_float_updates_bitwise(dtype):
  grads = np.random.default_rng(4).normal(size=(7, 3)).astype(np.float32)
  plain = optax_dist.delayed_nesterov(0.4, momentum=0.8, buffer_size=3, activation=0.2)
  scheduled = optax_dist.delayed_nesterov(
    optax.constant_schedule(0.4), momentum=0.8, buffer_size=3, activation=0.2)
  s1, s2 = plain.init(jnp.zeros(3, dtype)), scheduled.init(jnp.zeros(3, dtype))
  for g in grads:
    g = jnp.asarray(g, dtype)
    (u1, s1), (u2, s2) = jax.jit(plain.update)(g, s1), jax.jit(scheduled.update)(g, s2)
    assert u2.dtype == u1.dtype == dtype
    np.testing.assert_array_equal(u2, u1)
  for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    np.testing.assert_array_equal(b, a)


def test_a_decaying_schedule_matches_the_numpy_reference():
  # In Algorithm 3 the learning rate multiplies the step only (m and Δ do not depend on it), so
  # the t-th update under a schedule is ε_t times the reference's update at ε = 1.
  grads = np.random.default_rng(5).normal(size=(10, 2, 3)).astype(np.float32)
  schedule = optax.exponential_decay(0.6, transition_steps=1, decay_rate=0.8)
  tx = optax_dist.delayed_nesterov(schedule, momentum=0.8, buffer_size=3, activation=0.2)
  update = jax.jit(tx.update)
  state = tx.init(jnp.zeros((2, 3)))
  unit, m, buffer = np_delayed_nesterov_updates(grads, lr=1.0, beta=0.8, n=3, c=0.2)
  eps = 0.6 * 0.8 ** np.arange(len(grads), dtype=np.float64)  # ε_t, t = update calls before
  for t, g in enumerate(grads):
    u, state = update(jnp.asarray(g), state)
    np.testing.assert_allclose(u, eps[t] * unit[t], rtol=RTOL, atol=ATOL, err_msg=f"update {t}")
  np.testing.assert_allclose(state.momentum, m, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(state.buffer, buffer, rtol=RTOL, atol=ATOL)
  assert update._cache_size() == 1


def test_a_learning_rate_neither_number_nor_callable_is_a_type_error():
  expected = r"learning_rate=...\)` must be a real number > 0 \(or an optax schedule\), got '0.7'"
  with pytest.raises(TypeError, match=expected):
    optax_dist.delayed_nesterov("0.7", buffer_size=2)
