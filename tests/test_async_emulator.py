"""The asynchronous emulator: TF's asynchronous test numbers, analytic schedules, NumPy references.

Every emulation runs under ``jax.jit`` (``emulate`` compiles one ``lax.scan`` over events). The
expected numbers come from TF's own tests (``tf_contrib_reference.md``), from closed-form
schedules, or from sequential NumPy re-implementations written here.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist
from optax_dist import async_emulator as ae


def minus_sum(params, batch):
  """A loss whose gradient is -1 for every parameter (TF's tests pass gradients of -1)."""
  del batch
  return -sum(jnp.sum(leaf) for leaf in jax.tree.leaves(params))


def identity(params):
  return params


# ----------------------------------------------------------------------------------------------
# TF's asynchronous numbers.


def test_tf_elastic_average_two_workers_period_one():
  # ElasticAverageOptimizerTest.test2Worker1Period: worker 0 steps, then worker 1; each exchanges
  # with the center as the previous one left it. v0 = 0, v1 = 1, a [2, 4] variable of ones.
  params = {"v0": jnp.array(0.0), "v1": jnp.array(1.0), "part": jnp.ones((2, 4))}
  protocol = ae.elastic_average(optax.sgd(1.0), communication_period=1, moving_rate=0.5)
  result = ae.emulate(protocol, minus_sum, params, None, ae.explicit_schedule([0, 1]))
  w = result.worker_params
  assert float(w["v0"][0]) == 0.5 and float(w["v1"][0]) == 1.5  # worker 0's locals
  assert float(w["v0"][1]) == 0.75 and float(w["v1"][1]) == 1.75  # worker 1's locals
  assert float(result.params["v0"]) == 0.75 and float(result.params["v1"]) == 1.75  # center
  np.testing.assert_array_equal(result.params["part"], np.full((2, 4), 1.75))
  np.testing.assert_array_equal(result.server_step, [1, 2])  # global_step: +1 per exchange


def test_tf_elastic_average_one_worker_period_two():
  # ElasticAverageOptimizerTest.test1Workers2Period (moving rate 1): the center after each step.
  params = {"v0": jnp.array(0.0), "v1": jnp.array(1.0)}
  protocol = ae.elastic_average(optax.sgd(1.0), communication_period=2, moving_rate=1.0)
  result = ae.emulate(protocol, minus_sum, params, None, ae.explicit_schedule([0] * 4),
                      eval_fn=identity, eval_every=1)
  np.testing.assert_array_equal(result.eval_metrics["v0"], [0.0, 0.0, 2.0, 2.0, 2.0])
  np.testing.assert_array_equal(result.eval_metrics["v1"], [1.0, 1.0, 3.0, 3.0, 3.0])
  np.testing.assert_array_equal(result.eval_step, [0, 0, 1, 1, 2])  # TF's global_step
  np.testing.assert_array_equal(result.params["v0"], 2.0)  # the swapping saver's value
  np.testing.assert_array_equal(result.worker_params["v0"], [2.0])


def tf_adam():
  return optax.adam(0.1, b1=0.0, b2=0.0, eps=1e-8)


def test_tf_agn_one_worker_period_four():
  # AGNOptimizerTest.test1Workers2Period (period 4, Adam(0.1, 0, 0)): the center moves +0.1 on
  # every 4th step and the worker pulls it.
  params = {"v0": jnp.array(0.0), "v1": jnp.array(0.5)}
  protocol = ae.agn(tf_adam(), communication_period=4)
  result = ae.emulate(protocol, minus_sum, params, None, ae.explicit_schedule([0] * 8),
                      eval_fn=identity, eval_every=4)
  np.testing.assert_allclose(result.eval_metrics["v0"], [0.0, 0.1, 0.2], atol=1e-6)
  np.testing.assert_allclose(result.eval_metrics["v1"], [0.5, 0.6, 0.7], atol=1e-6)
  np.testing.assert_allclose(result.worker_params["v0"], [0.2], atol=1e-6)  # pulled
  np.testing.assert_allclose(result.worker_params["v1"], [0.7], atol=1e-6)


def test_tf_agn_two_workers_period_one():
  # AGNOptimizerTest.test2Worker1Period: w0, w1, w0, w1, w0, w1; every commit moves the center
  # +0.1 through the one shared center Adam state.
  params = {"v0": jnp.array(0.0), "v1": jnp.array(0.5), "part": jnp.zeros((2, 4))}
  protocol = ae.agn(tf_adam(), communication_period=1)
  result = ae.emulate(protocol, minus_sum, params, None, ae.explicit_schedule([0, 1] * 3),
                      eval_fn=identity, eval_every=1)
  center = result.eval_metrics
  np.testing.assert_allclose(center["v0"][[1, 2, 6]], [0.1, 0.2, 0.6], atol=1e-6)
  for k, value in ((1, 0.1), (2, 0.2), (6, 0.6)):
    assert np.linalg.norm(center["part"][k] - value) < 1e-6  # assertNDArrayNear
  np.testing.assert_allclose(result.params["v1"], 1.1, atol=1e-6)


@pytest.mark.parametrize(
  ("workers", "staleness", "global_step", "dropped"),
  [(1, 0, 1, 0), (1, -1, 0, 1), (2, 0, 1, 1), (2, 1, 2, 0), (3, 0, 1, 2), (3, 1, 2, 1)],
)
def test_tf_drop_stale_gradients(workers, staleness, global_step, dropped):
  # DropStaleGradientOptimizerTest: every worker computes at global_step 0; the chief applies
  # first, then the k-th other worker (staleness k as the step then stands).
  params = {"v0": jnp.array(0.0), "v1": jnp.array(1.0)}
  server = optax_dist.drop_stale_gradients(optax.sgd(1.0), staleness)
  schedule = ae.explicit_schedule([(k, 0) for k in range(workers)])
  result = ae.emulate(ae.downpour(server), minus_sum, params, None, schedule)
  assert int(result.server_state.global_step) == global_step
  assert int(result.server_state.num_dropped) == dropped  # TF's stale_counter
  assert result.server_step[-1] == global_step
  assert (result.num_dropped, result.num_accepted) == (dropped, global_step)
  assert float(result.params["v0"]) == 0.0 + global_step
  assert float(result.params["v1"]) == 1.0 + global_step


# ----------------------------------------------------------------------------------------------
# Analytic schedules.


def quadratic(params, batch):
  return jnp.sum((params - batch["target"]) ** 2)


def quadratic_data(workers, examples=4, dim=3):
  target = np.arange(workers * examples * dim, dtype=np.float32).reshape(workers, examples, dim)
  return {"target": jnp.asarray(target / target.size)}


def test_constant_times_steady_state_staleness_is_workers_minus_one():
  n = 4
  schedule = ae.Cluster(n).schedule(num_events=10 * n)
  np.testing.assert_array_equal(schedule.worker, np.tile(np.arange(n), 10))
  np.testing.assert_array_equal(schedule.time, np.repeat(np.arange(1.0, 11.0), n))
  result = ae.emulate(ae.downpour(optax.sgd(0.1)), quadratic, jnp.zeros(3), quadratic_data(n),
                      schedule, batch_size=2)
  np.testing.assert_array_equal(result.staleness[:n], np.arange(n))  # the first round
  np.testing.assert_array_equal(result.staleness[n:], n - 1)  # every later commit: N - 1
  np.testing.assert_array_equal(result.server_step, np.arange(1, 10 * n + 1))


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_constant_times_max_staleness_below_workers_minus_one(max_staleness):
  # With N equal workers and m = max_staleness < N - 1, a drop does not advance global_step, so
  # after the first round the same m + 1 workers are accepted in every round (staleness m) and
  # the other N - 1 - m are dropped in every round (staleness m + 1).
  n, rounds, m = 4, 6, max_staleness
  server = optax_dist.drop_stale_gradients(optax.sgd(0.1), m)
  result = ae.emulate(ae.downpour(server), quadratic, jnp.zeros(3), quadratic_data(n),
                      ae.Cluster(n).schedule(num_events=rounds * n), batch_size=2)
  worker = np.tile(np.arange(n), rounds)
  later = np.arange(rounds * n) >= n
  np.testing.assert_array_equal(result.accepted[later], worker[later] <= m)
  np.testing.assert_array_equal(result.staleness[later], np.where(worker[later] <= m, m, m + 1))
  assert result.num_dropped == rounds * (n - 1 - m)
  assert result.dropped_fraction == pytest.approx((n - 1 - m) / n)
  assert int(result.server_state.num_dropped) == result.num_dropped


def numpy_drop_stale(worker, max_staleness, num_workers):
  """TF's semantics, sequentially: each worker reads right after its own commit."""
  global_step, read = 0, np.zeros(num_workers, int)
  staleness, accepted = [], []
  for w in worker:
    s = global_step - read[w]
    staleness.append(s)
    accepted.append(s <= max_staleness)
    global_step += int(s <= max_staleness)
    read[w] = global_step
  return np.array(staleness), np.array(accepted)


def test_straggler_dropped_fraction_matches_the_schedule():
  n, m = 4, 2
  cluster = ae.Cluster(n, jitter=0.3, stragglers=1, slowdown=4.0, seed=3)
  schedule = cluster.schedule(num_events=400)
  counts = np.bincount(schedule.worker, minlength=n)
  assert counts[-1] < counts[0] / 3  # the straggler is about 4x slower
  server = optax_dist.drop_stale_gradients(optax.sgd(0.1), m)
  result = ae.emulate(ae.downpour(server), quadratic, jnp.zeros(3), quadratic_data(n), schedule,
                      batch_size=2)
  staleness, accepted = numpy_drop_stale(schedule.worker, m, n)
  np.testing.assert_array_equal(result.staleness, staleness)
  np.testing.assert_array_equal(result.accepted, accepted)
  assert result.dropped_fraction == pytest.approx(1 - accepted.mean())
  assert 0.05 < result.dropped_fraction < 0.95  # measurably drops, not everything
  assert np.all(~result.accepted[schedule.worker == n - 1][1:])  # the straggler: always stale


def test_cluster_schedule_timing():
  # Constant compute 1, worker 2 three times slower, latency 0.5 on every 2nd (communicating)
  # step; worker 1 crashes at 2.5 (its step in flight, due at 3.5, is lost), back at 3.5.
  cluster = ae.Cluster(3, stragglers=1, slowdown=3.0, latency=0.5)
  s = cluster.schedule(duration=7.0, communication_period=2, restarts=[(1, 2.5, 1.0)])
  times = {w: s.time[(s.worker == w) & ~s.restart].tolist() for w in range(3)}
  assert times[0] == [1.0, 2.5, 3.5, 5.0, 6.0]
  assert times[1] == [1.0, 2.5, 4.5, 6.0, 7.0]
  assert times[2] == [3.0, 6.5]
  assert s.time[s.restart].tolist() == [3.5] and s.worker[s.restart].tolist() == [1]
  np.testing.assert_array_equal(s.local_step[(s.worker == 1) & ~s.restart], [1, 2, 1, 2, 3])
  assert np.all(np.diff(s.time) >= 0)
  with pytest.raises(ValueError, match="exactly one of"):
    cluster.schedule()
  with pytest.raises(ValueError, match="stragglers"):
    ae.Cluster(3, stragglers=4)


# ----------------------------------------------------------------------------------------------
# Numerics against sequential NumPy references (least squares, full-shard minibatches so the
# minibatch order does not matter, SGD everywhere).


def lsq_problem(n, m=6, dim=3, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, m, dim)).astype(np.float32)
  y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.1 * rng.normal(size=(n, m))).astype(
    np.float32)
  return {"x": x, "y": y}


def lsq_loss(params, batch):
  return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)


def lsq_grad(p, data, w):
  x, y = data["x"][w].astype(np.float64), data["y"][w].astype(np.float64)
  return 2.0 * x.T @ (x @ p - y) / len(y)


def numpy_reference(protocol, schedule, data, lr, tau=1, alpha=0.0, max_staleness=None):
  n = schedule.num_workers
  center = np.zeros(3)
  local = np.zeros((n, 3))
  accum = np.zeros((n, 3))
  steps = np.zeros(n, int)
  global_step, read = 0, np.zeros(n, int)
  for w, restart in zip(schedule.worker, schedule.restart):
    if restart:
      local[w], accum[w], steps[w], read[w] = center, 0.0, 0, global_step
      continue
    if protocol == "downpour":
      g = lsq_grad(local[w], data, w)  # local[w] is the worker's snapshot
      if max_staleness is None or global_step - read[w] <= max_staleness:
        center = center - lr * g
        global_step += 1
      local[w], read[w] = center, global_step
      continue
    g = lsq_grad(local[w], data, w)
    local[w] = local[w] - lr * g
    accum[w] += g
    steps[w] += 1
    if steps[w] % tau == 0:
      if protocol == "elastic_average":
        d = alpha * (local[w] - center)
        local[w], center = local[w] - d, center + d
      else:
        center = center - lr * accum[w] / tau
        local[w], accum[w] = center, 0.0
  return center, local


@pytest.mark.parametrize("protocol", ["downpour", "elastic_average", "agn"])
def test_matches_numpy_reference_with_stragglers_and_a_restart(protocol):
  n, lr, tau, alpha = 3, 0.05, 3, 0.3
  data = lsq_problem(n)
  cluster = ae.Cluster(n, jitter=0.4, stragglers=1, slowdown=2.5, latency=0.2, seed=1)
  if protocol == "downpour":
    p = ae.downpour(optax_dist.drop_stale_gradients(optax.sgd(lr), 2))
    kwargs = {"max_staleness": 2}
  elif protocol == "elastic_average":
    p = ae.elastic_average(optax.sgd(lr), communication_period=tau, moving_rate=alpha)
    kwargs = {"tau": tau, "alpha": alpha}
  else:
    p = ae.agn(optax.sgd(lr), communication_period=tau)
    kwargs = {"tau": tau}
  schedule = cluster.schedule(num_events=90, communication_period=p.communication_period,
                              restarts=[(0, 7.3), (2, 12.0, 2.0)])
  assert schedule.restart.sum() == 2
  result = ae.emulate(p, lsq_loss, jnp.zeros(3), data, schedule, batch_size=6)
  center, local = numpy_reference(protocol, schedule, data, lr, **kwargs)
  np.testing.assert_allclose(result.params, center, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(result.worker_params, local, rtol=1e-4, atol=1e-5)
  if protocol != "downpour":
    np.testing.assert_array_equal(result.committed, schedule.communicates)


@pytest.mark.parametrize("protocol", ["downpour", "elastic_average", "agn"])
def test_restarted_worker_equals_the_center_right_after_restart(protocol):
  # Steps every 1.0; worker 1 restarts at 5.5 (its step ending at 6 is lost): the schedule ends
  # with that restart, so the worker's params right after it are the final ones.
  n = 3
  p = {"downpour": ae.downpour(optax.sgd(0.1)),
       "elastic_average": ae.elastic_average(optax.adam(0.1), communication_period=2),
       "agn": ae.agn(optax.adam(0.1), communication_period=2)}[protocol]
  schedule = ae.Cluster(n).schedule(duration=5.5, communication_period=p.communication_period,
                                    restarts=[(1, 5.5)])
  assert schedule.restart[-1] and schedule.worker[-1] == 1 and schedule.time[-1] == 5.5
  result = ae.emulate(p, quadratic, jnp.zeros(3), quadratic_data(n), schedule, batch_size=2)
  np.testing.assert_array_equal(result.worker_params[1], result.params)
  assert not np.array_equal(result.worker_params[0], result.params)  # the others did not pull


# ----------------------------------------------------------------------------------------------
# The API: determinism, evaluation, errors.


def test_same_seed_same_bits_and_eval_fn():
  n = 3
  data = lsq_problem(n, m=8)
  cluster = ae.Cluster(n, jitter=0.5, stragglers=1, slowdown=3.0, seed=7)
  schedule = cluster.schedule(num_events=50, communication_period=2)
  p = ae.elastic_average(optax.adam(0.05), communication_period=2)

  def eval_fn(params):
    return {"loss": lsq_loss(params, jax.tree.map(lambda d: d.reshape(-1, *d.shape[2:]), data)),
            "norm": jnp.linalg.norm(params)}

  def run(seed):
    return ae.emulate(p, lsq_loss, jnp.zeros(3), data, schedule, batch_size=2, seed=seed,
                      eval_fn=eval_fn, eval_every=20)

  a, b, c = run(0), run(0), run(1)
  np.testing.assert_array_equal(a.loss, b.loss)
  np.testing.assert_array_equal(a.params, b.params)
  np.testing.assert_array_equal(a.worker_params, b.worker_params)
  assert not np.array_equal(a.loss, c.loss)  # another minibatch order
  # Evaluations: at time 0, after events 20 and 40, and after the last (50).
  np.testing.assert_array_equal(a.eval_time, [0.0, *schedule.time[[19, 39, 49]]])
  np.testing.assert_array_equal(a.eval_step, [0, *a.server_step[[19, 39, 49]]])
  assert float(a.eval_metrics["norm"][0]) == 0.0
  np.testing.assert_allclose(a.eval_metrics["norm"][-1], np.linalg.norm(a.params), rtol=1e-6)
  assert a.eval_metrics["loss"][-1] < a.eval_metrics["loss"][0]


def test_errors():
  p = ae.elastic_average(optax.sgd(0.1), communication_period=4)
  with pytest.raises(ValueError, match="communication_period=1 but the protocol communicates"):
    ae.emulate(p, minus_sum, jnp.zeros(2), None, ae.Cluster(2).schedule(num_events=4))
  with pytest.raises(ValueError, match="downpour protocol only"):
    ae.emulate(p, minus_sum, jnp.zeros(2), None, ae.explicit_schedule([(0, 0)]))
  with pytest.raises(ValueError, match="communication_period"):
    ae.elastic_average(optax.sgd(0.1), communication_period=0)
  with pytest.raises(ValueError, match="every step or for none"):
    ae.explicit_schedule([(0, 0), 1])
  # Worker 1 asks for step 0 after the server moved on to 2 while it was committing at step 1.
  server = ae.downpour(optax.sgd(1.0))
  with pytest.raises(ValueError, match="event 2 .worker 1. asks for the params of server step 0"):
    ae.emulate(server, minus_sum, jnp.zeros(2), None,
               ae.explicit_schedule([(0, 0), (1, 1), (1, 0)]))
  with pytest.raises(ValueError, match="shape \\[num_workers, examples_per_worker"):
    ae.emulate(server, quadratic, jnp.zeros(3), quadratic_data(3),
               ae.Cluster(2).schedule(num_events=4), batch_size=2)


@pytest.mark.parametrize(
  "module", ["", *(m.name for m in pkgutil.iter_modules(ae.__path__))], ids=lambda m: m or "ae")
def test_docstring_examples(module):
  # doctest collects a function from the module defining it: every module of the subpackage.
  module = importlib.import_module(f"{ae.__name__}.{module}" if module else ae.__name__)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.failed == 0 and (result.attempted > 0 or module.__name__.endswith("simulators"))


def test_run_async_digits_small(tmp_path):
  from optax_dist.cli import async_run, reports
  from optax_dist.cli.tasks import TASKS

  out = tmp_path / "async.png"
  rows = async_run.run_protocols(
    TASKS["digits"], protocols=("downpour+drop_stale",), duration=30.0, max_staleness=0,
    eval_every=20)
  reports.plot_async(rows, str(out))
  (row,) = rows
  assert row["protocol"] == "downpour+drop_stale" and row["simulated_time"] <= 30.0
  assert 0.0 < row["dropped_fraction"] < 1.0  # 4 workers, max_staleness 0: drops
  assert row["max_staleness_seen"] >= 1 and row["events"] == row["commits"]
  assert out.stat().st_size > 0
  table = reports.table(reports.ASYNC_COLUMNS, rows).splitlines()
  assert table[0].split()[:3] == ["protocol", "test", "acc"] and len(table) == 3
