"""Asynchronous DiLoCo in the emulator, with optax SGD/Nesterov and delayed Nesterov outers.

The expected numbers come from sequential NumPy re-implementations written here (asynchronous
DiLoCo with stragglers and restarts, delayed Nesterov as its equations state), from closed forms
(outer SGD adds each worker's progress to the anchor; the staleness of a hand-written schedule),
and from equivalences (one worker is ``optax_dist.diloco``; a buffer of one is optax's Nesterov).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist
from optax_dist import async_emulator as ae

# ----------------------------------------------------------------------------------------------
# NumPy references.


def np_nesterov(learning_rate, momentum):
  """``optax.sgd(learning_rate, momentum, nesterov=True)``: (init, step) on float64 arrays."""

  def step(state, g):
    trace = g + momentum * state
    return -learning_rate * (g + momentum * trace), trace

  return (lambda x: np.zeros_like(x)), step


def np_delayed_nesterov(learning_rate, momentum, buffer_size, activation):
  """Delayed Nesterov as its equations state: state (t, m, Δ)."""
  n, c = buffer_size, activation

  def step(state, g):
    t, m, delta = state
    delta = delta + g
    if (t + 1) % n == 0:
      m = momentum * m + delta / n
      u = -learning_rate * ((1 - c * n + c) * momentum * m + g / n)
      delta = np.zeros_like(delta)
    else:
      u = -learning_rate * (c * momentum * m + g / n)
    return u, (t + 1, m, delta)

  return (lambda x: (0, np.zeros_like(x), np.zeros_like(x))), step


def least_squares_grad(x, shard):
  """The gradient of ``mean((a @ x - b) ** 2)`` over the whole shard, in float64."""
  a, b = shard["a"].astype(np.float64), shard["b"].astype(np.float64)
  return 2.0 * a.T @ (a @ x - b) / len(b)


def np_async_diloco(events, x0, shards, *, sync_period, inner_lr, inner_momentum, outer):
  """Asynchronous DiLoCo, one event at a time: workers train with momentum SGD (their own
  trace) on their full shard; on every H-th local step the pseudo-gradient ``read - x'`` goes
  to the server's ``outer`` step from the current anchor, and the worker reads the new anchor.

  Returns the final anchor, every worker's params, and the staleness of each commit (outer
  steps between the worker's read and its commit).
  """
  outer_init, outer_step = outer
  anchor, outer_state, outer_steps = x0.copy(), outer_init(x0), 0

  def fresh():
    return {"x": anchor.copy(), "read": anchor.copy(), "read_step": outer_steps,
            "trace": np.zeros_like(x0), "k": 0}

  workers = {w: fresh() for w in range(len(shards))}
  staleness = []
  for event in events:
    if isinstance(event, tuple):  # ("restart", w)
      workers[event[1]] = fresh()
      continue
    me = workers[event]
    me["trace"] = least_squares_grad(me["x"], shards[event]) + inner_momentum * me["trace"]
    me["x"] = me["x"] - inner_lr * me["trace"]
    me["k"] += 1
    if me["k"] % sync_period == 0:
      u, outer_state = outer_step(outer_state, me["read"] - me["x"])
      anchor = anchor + u
      staleness.append(outer_steps - me["read_step"])
      outer_steps += 1
      me.update(x=anchor.copy(), read=anchor.copy(), read_step=outer_steps)
  return anchor, np.stack([workers[w]["x"] for w in range(len(shards))]), staleness


def least_squares(params, batch):
  return jnp.mean((batch["a"] @ params - batch["b"]) ** 2)


def shards_of(num_workers, examples, dim, seed=0):
  """Each worker's own least-squares problem: ``{"a": [N, M, D], "b": [N, M]}``, float32."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(num_workers, examples, dim)).astype(np.float32)
  b = (a @ rng.normal(size=dim) + 0.3 * rng.normal(size=(num_workers, examples)))
  return {"a": a, "b": b.astype(np.float32)}


# Three workers, H = 2; worker 2 steps once for every four steps of the others, so its commits
# land after several of theirs; worker 1 restarts once in the middle.
STRAGGLER_EVENTS = (
  [0, 1, 0, 1, 2, 0, 1, 0, 1, 2, 0, 1, 0, ("restart", 1), 1, 2]
  + [0, 1, 0, 1, 2, 0, 1, 0, 2, 1, 0, 1, 0, 1, 2, 0, 1]
)

OUTERS = {
  "nesterov": (lambda: optax.sgd(0.6, momentum=0.9, nesterov=True), lambda: np_nesterov(0.6, 0.9)),
  "delayed_nesterov": (
    lambda: optax_dist.delayed_nesterov(0.6, momentum=0.9, buffer_size=3, activation=0.2),
    lambda: np_delayed_nesterov(0.6, 0.9, 3, 0.2),
  ),
}


# ----------------------------------------------------------------------------------------------
# Asynchronous DiLoCo against NumPy, closed forms and the library.


@pytest.mark.parametrize("outer", sorted(OUTERS))
def test_matches_numpy_reference_with_stragglers_and_a_restart(outer):
  make_outer, make_np_outer = OUTERS[outer]
  data = shards_of(3, examples=6, dim=4)
  x0 = np.linspace(-0.5, 0.5, 4).astype(np.float32)
  protocol = ae.diloco(optax.sgd(0.05, momentum=0.5), make_outer(), sync_period=2)
  # batch_size = the shard: every step's gradient is the shard's, whatever the row order.
  result = ae.emulate(protocol, least_squares, jnp.asarray(x0), data,
                      ae.explicit_schedule(STRAGGLER_EVENTS), batch_size=6)
  anchor, workers, staleness = np_async_diloco(
    STRAGGLER_EVENTS, x0.astype(np.float64), [{k: v[w] for k, v in data.items()} for w in range(3)],
    sync_period=2, inner_lr=0.05, inner_momentum=0.5, outer=make_np_outer())
  assert max(staleness) >= 3  # the straggler's commits are stale
  np.testing.assert_allclose(result.params, anchor, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(result.worker_params, workers, rtol=2e-5, atol=2e-6)
  np.testing.assert_array_equal(result.commit_staleness, staleness)
  np.testing.assert_array_equal(result.server_step[-1], len(staleness))


def test_one_worker_is_the_library_diloco():
  # One worker never sees another's commit: asynchronous DiLoCo is optax_dist.diloco with
  # axis_name=None on the same gradients (the whole shard every step).
  data = shards_of(1, examples=8, dim=3, seed=1)
  x0 = jnp.array([0.3, -0.2, 0.1])
  inner, outer = optax.adam(0.05), optax.sgd(0.7, momentum=0.9, nesterov=True)
  result = ae.emulate(ae.diloco(inner, outer, sync_period=3), least_squares, x0, data,
                      ae.explicit_schedule([0] * 13), batch_size=8)

  tx = optax_dist.diloco(inner, outer, sync_period=3)
  params, state, losses = x0, tx.init(x0), []
  batch = jax.tree.map(lambda d: jnp.asarray(d[0]), data)
  for _ in range(13):
    loss, grads = jax.value_and_grad(least_squares)(params, batch)
    updates, state = tx.update(grads, state, params)
    params, losses = optax.apply_updates(params, updates), [*losses, loss]
  np.testing.assert_allclose(result.params, state.anchor, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(result.worker_params[0], params, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(result.loss, losses, rtol=1e-5)
  np.testing.assert_array_equal(result.committed, (np.arange(1, 14) % 3) == 0)
  np.testing.assert_array_equal(result.commit_staleness, 0)


@pytest.mark.parametrize("outer_lr", [1.0, 0.5])
def test_outer_sgd_adds_each_workers_progress_to_the_current_anchor(outer_lr):
  # With a constant gradient -a_w on worker w, H steps of sgd(lr) move a worker by lr * H * a_w
  # from the anchor it read, however stale. Outer sgd(η) then moves the *current* anchor by
  # η * lr * H * a_w per commit: the final anchor is x0 + η lr H Σ_w commits_w a_w.
  lr, h, n = 0.1, 3, 4
  a = np.array([[1.0, 0.0], [0.0, 2.0], [-1.0, 1.0], [0.5, 0.5]], np.float32)
  data = {"a": np.repeat(a[:, None, :], 5, axis=1)}  # every row of worker w's shard is a_w

  def linear(params, batch):
    return -jnp.mean(batch["a"] @ params)

  cluster = ae.Cluster(num_workers=n, jitter=0.3, stragglers=1, slowdown=4.0, seed=3)
  schedule = cluster.schedule(num_events=120, communication_period=h)
  protocol = ae.diloco(optax.sgd(lr), optax.sgd(outer_lr), sync_period=h)
  result = ae.emulate(protocol, linear, jnp.zeros(2), data, schedule, batch_size=2)
  commits = np.array([np.sum(schedule.communicates & (schedule.worker == w)) for w in range(n)])
  assert result.commit_staleness.max() >= 2 and commits[-1] < commits[0]  # a slow worker
  expected = outer_lr * lr * h * commits @ a
  np.testing.assert_allclose(result.params, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(result.committed, schedule.communicates)


def test_staleness_counts_outer_steps_between_read_and_commit():
  # H = 2. Commits (event: worker, the outer step it read, the outer steps before it commits):
  #  1: w0 read 0, 0 -> staleness 0     5: w0 read 1, 1 -> 0     6: w1 read 0, 2 -> 2
  #  7: w2 read 0, 3 -> 3               8: w2 restarts and reads 4
  # 11: w0 read 2, 4 -> 2              12: w2 read 4, 5 -> 1    (w1 at event 13: 1 step, none)
  events = [0, 0, 1, 2, 0, 0, 1, 2, ("restart", 2), 2, 0, 0, 2, 1]
  protocol = ae.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_period=2)
  result = ae.emulate(protocol, lambda p, _: jnp.sum(p**2), jnp.ones(2), None,
                      ae.explicit_schedule(events))
  np.testing.assert_array_equal(np.flatnonzero(result.committed), [1, 5, 6, 7, 11, 12])
  np.testing.assert_array_equal(result.commit_staleness, [0, 0, 2, 3, 2, 1])
  np.testing.assert_array_equal(result.read_step[result.committed], [0, 1, 0, 0, 2, 4])
  np.testing.assert_array_equal(result.server_step, [0, 1, 1, 1, 1, 2, 3, 4, 4, 4, 4, 5, 6, 6])
  assert np.isnan(result.loss[8]) and result.restart[8]


def test_eval_fn_sees_the_anchor_and_a_restart_starts_from_it():
  # Gradient -1, inner sgd(0.5), H = 2, outer sgd(1). Workers 0 and 1 step once (0.5 each);
  # worker 0 steps again and commits: the anchor becomes 1. Worker 1 restarts from it (params 1,
  # step count 0) and steps once more: params 1.5, no commit.
  protocol = ae.diloco(optax.sgd(0.5), optax.sgd(1.0), sync_period=2)
  result = ae.emulate(protocol, lambda p, _: -jnp.sum(p), jnp.zeros(1), None,
                      ae.explicit_schedule([0, 1, 0, ("restart", 1), 1]),
                      eval_fn=lambda p: p[0], eval_every=1)
  np.testing.assert_allclose(result.eval_metrics, [0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
  np.testing.assert_array_equal(result.committed, [False, False, True, False, False])
  np.testing.assert_allclose(result.worker_params[:, 0], [1.0, 1.5])


# ----------------------------------------------------------------------------------------------
# Errors.


def test_errors():
  with pytest.raises(ValueError, match=r"diloco\(sync_period=...\)` must be a positive int"):
    ae.diloco(optax.sgd(0.1), sync_period=0)
  with pytest.raises(TypeError, match=r"diloco\(outer=...\)"):
    ae.diloco(optax.sgd(0.1), outer="sgd")
  protocol = ae.diloco(optax.sgd(0.1), sync_period=4)
  with pytest.raises(ValueError, match="communication_period=4"):
    ae.emulate(protocol, lambda p, _: jnp.sum(p), jnp.zeros(1), None,
               ae.Cluster(2).schedule(num_events=4, communication_period=2))
