"""apply_if_finite: the skip decision agreed across workers, under shard_map and vmap."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

N = 4  # workers
D = 3  # params per worker
STEPS = 6
BAD_STEP = 1  # 0-based: the second step, a communication step for period 2
BAD_WORKER = 1
MAX_ERRORS = 3


def _mesh():
  return Mesh(np.array(jax.devices()[:N]), ("w",))


def _data():
  rng = np.random.default_rng(0)
  x0 = rng.normal(size=(D,)).astype(np.float32)
  grads = rng.normal(size=(STEPS, N, D)).astype(np.float32)
  return x0, grads


# Each transformation wrapped outermost by apply_if_finite: the distributed transformation
# (and its wrappers) inside, so a skip stops all of it on every worker together.
TRANSFORMATIONS = {
  "elastic_average": lambda: optax_dist.elastic_average(
    optax.sgd(0.1, momentum=0.5), communication_period=2, moving_rate=0.2, axis_name="w"
  ),
  "agn": lambda: optax_dist.agn(optax.sgd(0.1, momentum=0.5), communication_period=2,
                                axis_name="w"),
  "moving_average_tower": lambda: optax_dist.moving_average(
    optax_dist.tower(optax.sgd(0.1, momentum=0.5), "w"), decay=0.7
  ),
  "tower": lambda: optax_dist.tower(optax.adam(0.1), "w"),
  "drop_stale_gradients": lambda: optax_dist.drop_stale_gradients(
    optax.sgd(0.1, momentum=0.5), max_staleness=0
  ),
}


def _per_worker(x):
  """Adds the worker axis, typing the value as varying over it (for ``out_specs=P("w")``)."""
  x = jnp.asarray(x)
  if "w" not in jax.typeof(x).manual_axis_type.varying:
    x = jax.lax.pcast(x, "w", to="varying")
  return x[None]


def _run_shard_map(tx, x0, grads, bad):
  """Every worker inits from ``x0`` and takes ``len(grads)`` steps; NaN where ``bad``."""
  mesh = _mesh()

  def worker(x0, grads, bad):
    x, grads, bad = x0[0], grads[:, 0], bad[:, 0]
    # Typed per worker, as a state passed in and out of the step with `P("w")` would be.
    state = jax.tree.map(lambda a: _per_worker(a)[0], tx.init(x))

    def step(carry, inp):
      x, state = carry
      g, b = inp
      g = jnp.where(b, jnp.nan, g)
      updates, state = tx.update(g, state, x)
      return (optax.apply_updates(x, updates), state), None

    (x, state), _ = jax.lax.scan(step, (x, state), (grads, bad))
    return jax.tree.map(_per_worker, (x, state, optax_dist.eval_params(state, x)))

  f = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=(P("w"), P(None, "w"), P(None, "w")),
                            out_specs=P("w")))

  def put(a, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))

  return f(put(np.tile(x0, (N, 1)), P("w")), put(grads, P(None, "w")), put(bad, P(None, "w")))


def _bad_mask(steps=STEPS):
  bad = np.zeros((steps, N), bool)
  bad[BAD_STEP, BAD_WORKER] = True
  return bad


def _assert_finite(tree):
  chex.assert_tree_all_finite([x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)])


def _assert_close(a, b):
  chex.assert_trees_all_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(TRANSFORMATIONS))
def test_skip_is_agreed_under_shard_map(name):
  x0, grads = _data()
  inner = TRANSFORMATIONS[name]()
  tx = optax_dist.apply_if_finite(inner, MAX_ERRORS, axis_name="w")
  x, state, avg = _run_shard_map(tx, x0, grads, _bad_mask())

  # The reference: the same transformation, unwrapped, where the bad step never happened.
  kept = np.delete(np.arange(STEPS), BAD_STEP)
  x_ref, state_ref, avg_ref = _run_shard_map(inner, x0, grads[kept], np.zeros((STEPS - 1, N), bool))

  _assert_finite((x, state, avg))
  np.testing.assert_array_equal(state.total_notfinite, np.ones(N))
  np.testing.assert_array_equal(state.notfinite_count, np.zeros(N))
  _assert_close(x, x_ref)
  _assert_close(state.inner_state, state_ref)
  _assert_close(avg, avg_ref)  # the center, the EMA, or the params
  if name != "drop_stale_gradients":  # the averages and tower params are identical everywhere
    np.testing.assert_array_equal(avg, np.broadcast_to(avg[0], avg.shape))


def test_optax_apply_if_finite_lets_workers_diverge_under_shard_map():
  # Without collectives inside, optax's per-worker decision runs, but the worker that skipped
  # has a global step one behind the others from then on.
  x0, grads = _data()
  inner = TRANSFORMATIONS["drop_stale_gradients"]()
  _, ours, _ = _run_shard_map(optax_dist.apply_if_finite(inner, MAX_ERRORS, axis_name="w"),
                              x0, grads, _bad_mask())
  _, theirs, _ = _run_shard_map(optax.apply_if_finite(inner, MAX_ERRORS), x0, grads, _bad_mask())
  np.testing.assert_array_equal(ours.inner_state.global_step, [STEPS - 1] * N)
  expected = [STEPS] * N
  expected[BAD_WORKER] = STEPS - 1
  np.testing.assert_array_equal(theirs.inner_state.global_step, expected)
  np.testing.assert_array_equal(theirs.total_notfinite, [1 if i == BAD_WORKER else 0
                                                         for i in range(N)])


def _run_vmap(tx, x0, grads, bad):
  def worker(grads, bad):
    x = jnp.asarray(x0)
    state = tx.init(x)

    def step(carry, inp):
      x, state = carry
      g, b = inp
      updates, state = tx.update(jnp.where(b, jnp.nan, g), state, x)
      return (optax.apply_updates(x, updates), state), None

    return jax.lax.scan(step, (x, state), (grads, bad))[0]

  return jax.jit(jax.vmap(worker, in_axes=1, axis_name="w"))(grads, bad)


def test_optax_apply_if_finite_poisons_the_center_under_vmap():
  # With a per-worker decision the bad worker's NaNs reach the others' sum on the communication
  # step, and the bad worker's step counter falls out of phase. The agreed decision avoids both.
  x0, grads = _data()
  inner = TRANSFORMATIONS["elastic_average"]()
  _, theirs = _run_vmap(optax.apply_if_finite(inner, MAX_ERRORS), x0, grads, _bad_mask())
  _, ours = _run_vmap(optax_dist.apply_if_finite(inner, MAX_ERRORS, axis_name="w"),
                      x0, grads, _bad_mask())
  assert not np.all(np.isfinite(theirs.inner_state.center))
  assert len(set(np.asarray(theirs.inner_state.local_step).tolist())) == 2
  _assert_finite(ours)
  np.testing.assert_array_equal(ours.inner_state.local_step, [STEPS - 1] * N)


def test_single_worker_matches_optax():
  # With axis_name=None the numbers and the counters are optax.apply_if_finite's, including
  # the step applied anyway after max_consecutive_errors skips.
  params = jnp.array([1.0, 2.0])
  nan = jnp.array([jnp.nan, 1.0])
  ok = jnp.array([0.5, -0.5])
  sequence = [ok, nan, nan, ok, nan, nan, nan, ok]
  ours_tx = optax_dist.apply_if_finite(optax.sgd(0.1, momentum=0.9), 2)
  optax_tx = optax.apply_if_finite(optax.sgd(0.1, momentum=0.9), 2)
  ours, theirs = ours_tx.init(params), optax_tx.init(params)
  ours_update, optax_update = jax.jit(ours_tx.update), jax.jit(optax_tx.update)
  p_ours = p_theirs = params
  applied = []
  for g in sequence:
    u, ours = ours_update(g, ours, p_ours)
    v, theirs = optax_update(g, theirs, p_theirs)
    p_ours, p_theirs = optax.apply_updates(p_ours, u), optax.apply_updates(p_theirs, v)
    applied.append(bool(np.any(u != 0)))
    for field in ("notfinite_count", "last_finite", "total_notfinite"):
      np.testing.assert_array_equal(getattr(ours, field), getattr(theirs, field))
    _assert_close(ours.inner_state, theirs.inner_state)
    np.testing.assert_array_equal(p_ours, p_theirs)
  # Skips at the first two NaN steps of each run; the third consecutive one is applied.
  assert applied == [True, False, False, True, False, False, True, True]
  assert int(ours.total_notfinite) == 5 and int(ours.notfinite_count) == 0


def test_one_pmax_per_step_and_none_for_one_worker():
  def step(tx, g):
    return tx.update(g, tx.init(g), g)

  tx = optax_dist.apply_if_finite(optax.sgd(1.0), 1, axis_name="w")
  bound = str(jax.make_jaxpr(jax.vmap(lambda g: step(tx, g), axis_name="w"))(jnp.ones((2, 3))))
  assert bound.count("pmax") == 1
  with pytest.raises(ValueError, match=r"apply_if_finite\(axis_name='w'\)`: `update` was called"):
    step(tx, jnp.ones(3))  # the named axis is not bound: raises rather than train alone
  one = optax_dist.apply_if_finite(optax.sgd(1.0), 1)
  assert "pmax" not in str(jax.make_jaxpr(lambda g: step(one, g))(jnp.ones(3)))


def test_eval_params_sees_through_the_wrapper():
  tx = optax_dist.apply_if_finite(optax_dist.moving_average(optax.sgd(1.0), decay=0.5), 1)
  params = jnp.array([1.0])
  updates, state = tx.update(jnp.array([1.0]), tx.init(params), params)
  np.testing.assert_allclose(optax_dist.eval_params(state, params + updates), [0.5])


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), (1.5, TypeError),
                                              (True, TypeError)])
def test_max_consecutive_errors_is_validated(value, error):
  with pytest.raises(error, match=r"apply_if_finite\(max_consecutive_errors=\.\.\.\)"):
    optax_dist.apply_if_finite(optax.sgd(1.0), value)


def test_inner_is_validated():
  with pytest.raises(TypeError, match=r"apply_if_finite\(inner=\.\.\.\)"):
    optax_dist.apply_if_finite(lambda g: g, 1)
