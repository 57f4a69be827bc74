"""Dynamic local updates (DyLU) in the asynchronous emulator, and workers of different speeds.

Expected values come from closed forms written here: the local steps per commit
:math:`H_w = \\max(1, \\lfloor v_w / \\max v \\cdot H \\rfloor)`, the end time of each worker's
k-th step (:math:`k / v_w` plus one latency per commit), and, with a constant gradient and outer
``sgd(1)``, the anchor as the sum of every commit's own :math:`H_w` steps. ``dylu=False`` is
checked to leave the schedule and the numbers as they were, bit for bit.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist
from optax_dist import async_emulator as ae

SPEEDS = (1.0, 1.0, 0.5, 0.25)
H = 30


def np_dylu(speeds, h):
  v = np.asarray(speeds, np.float64)
  return np.maximum(1, np.floor(np.round(v / v.max() * h, 9))).astype(int)


def test_local_steps_per_commit_are_proportional_to_speed():
  assert ae.dylu_sync_periods(SPEEDS, H) == (30, 30, 15, 7)
  np.testing.assert_array_equal(ae.dylu_sync_periods(SPEEDS, H), np_dylu(SPEEDS, H))
  rng = np.random.default_rng(0)
  for _ in range(20):
    speeds, h = tuple(rng.uniform(0.01, 3.0, size=5)), int(rng.integers(1, 200))
    np.testing.assert_array_equal(ae.dylu_sync_periods(speeds, h), np_dylu(speeds, h))
  assert ae.dylu_sync_periods((2.0, 2.0, 1.0, 0.5), H) == (30, 30, 15, 7)  # only ratios count
  assert ae.dylu_sync_periods((1.0, 0.01), 30) == (30, 1)  # at least one step
  assert ae.dylu_sync_periods((1.0, 0.29), 100) == (100, 29)  # 0.29 * 100 is 28.999999999999996
  protocol = ae.diloco(optax.sgd(0.1), sync_period=H, dylu=True)
  assert protocol.sync_periods(SPEEDS) == (30, 30, 15, 7)
  assert ae.diloco(optax.sgd(0.1), sync_period=H).sync_periods(SPEEDS) == (30,) * 4


def test_cluster_speeds():
  cluster = ae.Cluster(4, speeds=SPEEDS)
  assert cluster.worker_speeds == SPEEDS
  for w, v in enumerate(SPEEDS):
    np.testing.assert_array_equal(cluster.compute_times(w, 3), np.full(3, 1.0 / v))
  # Speeds and stragglers combine: worker 3 is 0.25 / 2 as fast.
  both = ae.Cluster(4, speeds=SPEEDS, stragglers=1, slowdown=2.0)
  assert both.worker_speeds == (1.0, 1.0, 0.5, 0.125)
  assert ae.Cluster(3, stragglers=1, slowdown=4.0).worker_speeds == (1.0, 1.0, 0.25)


def closed_form_schedule(speeds, periods, latency, duration):
  """(worker, time, local step, commits) of every step ending by ``duration``, in time order
  (ties by worker): worker w's k-th step ends at k / v_w + latency * floor(k / H_w)."""
  rows = []
  for w, (v, h) in enumerate(zip(speeds, periods)):
    k = 1
    while (t := k / v + latency * (k // h)) <= duration:
      rows.append((t, w, k, k % h == 0))
      k += 1
  rows.sort()
  t, w, k, c = (np.array(a) for a in zip(*rows))
  return w, t, k, c


@pytest.mark.parametrize("latency", [0.0, 0.5])
def test_the_schedule_of_workers_at_1_1_half_quarter_speed(latency):
  cluster = ae.Cluster(4, speeds=SPEEDS, latency=latency)
  periods = ae.diloco(optax.sgd(0.1), sync_period=H, dylu=True).sync_periods(
    cluster.worker_speeds)
  schedule = cluster.schedule(duration=130.0, communication_period=periods)
  w, t, k, c = closed_form_schedule(SPEEDS, (30, 30, 15, 7), latency, 130.0)
  np.testing.assert_array_equal(schedule.worker, w)
  np.testing.assert_allclose(schedule.time, t, rtol=1e-12)
  np.testing.assert_array_equal(schedule.local_step, k)
  np.testing.assert_array_equal(schedule.communicates, c)
  assert schedule.periods == (30, 30, 15, 7) and schedule.speeds == SPEEDS
  # Every worker commits about every 30 time units: 4 commits each by 130 (without latency).
  commits = np.bincount(schedule.worker[schedule.communicates], minlength=4)
  if latency == 0.0:
    np.testing.assert_array_equal(commits, [4, 4, 4, 4])
    np.testing.assert_array_equal(schedule.time[schedule.communicates & (schedule.worker == 3)],
                                  [28.0, 56.0, 84.0, 112.0])


def test_emulate_commits_each_workers_own_steps():
  # A constant gradient -a_w on worker w: each commit of worker w brings lr * H_w * a_w, and
  # outer sgd(1) adds it to the current anchor, so the anchor is lr * sum_w commits_w H_w a_w.
  lr = 0.1
  a = np.array([[1.0, 0.0], [0.0, 2.0], [-1.0, 1.0], [0.5, 0.5]], np.float32)
  data = {"a": np.repeat(a[:, None, :], 5, axis=1)}

  def linear(params, batch):
    return -jnp.mean(batch["a"] @ params)

  cluster = ae.Cluster(4, speeds=SPEEDS, jitter=0.1, seed=1)
  protocol = ae.diloco(optax.sgd(lr), optax.sgd(1.0), sync_period=H, dylu=True)
  periods = protocol.sync_periods(cluster.worker_speeds)
  schedule = cluster.schedule(duration=200.0, communication_period=periods)
  result = ae.emulate(protocol, linear, jnp.zeros(2), data, schedule, batch_size=2)
  commits = np.bincount(schedule.worker[schedule.communicates], minlength=4)
  assert commits.min() >= 5
  expected_committed = schedule.step & (schedule.local_step % np.array(periods)[schedule.worker]
                                        == 0)
  np.testing.assert_array_equal(result.committed, expected_committed)
  np.testing.assert_allclose(result.params, lr * (commits * np.array(periods)) @ a, rtol=1e-5)


def digits_like(n=4, m=24, d=6, seed=0):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(n, m, d)).astype(np.float32)
  return {"a": a, "b": (a @ rng.normal(size=d)).astype(np.float32)}


def least_squares(params, batch):
  return jnp.mean((batch["a"] @ params - batch["b"]) ** 2)


def run(protocol, schedule):
  r = ae.emulate(protocol, least_squares, jnp.zeros(6), digits_like(), schedule, batch_size=4,
                 eval_fn=lambda p: jnp.sum(p**2), eval_every=7)
  return r


def assert_bitwise_equal(r1, r2):
  for field in ("loss", "committed", "server_step", "staleness", "eval_metrics"):
    np.testing.assert_array_equal(getattr(r1, field), getattr(r2, field), err_msg=field)
  np.testing.assert_array_equal(r1.params, r2.params)
  np.testing.assert_array_equal(r1.worker_params, r2.worker_params)


def test_dylu_false_leaves_schedules_and_numbers_bit_identical():
  outer = optax_dist.delayed_nesterov(0.7, buffer_size=4)
  kwargs = {"jitter": 0.3, "stragglers": 1, "slowdown": 3.0, "latency": 0.2, "seed": 2}
  plain, ones = ae.Cluster(4, **kwargs), ae.Cluster(4, speeds=(1.0,) * 4, **kwargs)
  s1 = plain.schedule(duration=40.0, communication_period=3, restarts=[(1, 11.5)])
  s2 = ones.schedule(duration=40.0, communication_period=(3, 3, 3, 3), restarts=[(1, 11.5)])
  for field in ("worker", "time", "restart", "local_step", "join", "leave"):
    np.testing.assert_array_equal(getattr(s1, field), getattr(s2, field), err_msg=field)
  np.testing.assert_array_equal(s1.communicates, s2.communicates)
  assert s1.communication_period == 3
  sgd = optax.sgd(0.05)
  off = ae.diloco(sgd, outer, sync_period=3)
  assert off == ae.diloco(sgd, outer, sync_period=3, dylu=False)
  # The per-worker path (dylu=True at equal speeds: every H_w = H) gives the same bits.
  on = ae.diloco(sgd, outer, sync_period=3, dylu=True)
  equal = ae.Cluster(4, jitter=0.3, latency=0.2, seed=2)
  s3 = equal.schedule(duration=40.0, communication_period=3, restarts=[(1, 11.5)])
  assert_bitwise_equal(run(off, s3), run(on, s3))
  assert_bitwise_equal(run(off, s1), run(off, s2))


def test_errors():
  with pytest.raises(ValueError, match=r"`Cluster\(speeds=...\)` must be None or 4"):
    ae.Cluster(4, speeds=(1.0, 1.0, 0.5))
  with pytest.raises(ValueError, match=r"`Cluster\(speeds=...\)`"):
    ae.Cluster(2, speeds=(1.0, 0.0))
  with pytest.raises(ValueError, match=r"`Cluster\(speeds=...\)`"):
    ae.Cluster(2, speeds=1.0)
  with pytest.raises(ValueError, match=r"communication_period=...\)` must be a positive int or 4"):
    ae.Cluster(4).schedule(duration=5.0, communication_period=(3, 3, 3))
  with pytest.raises(ValueError, match=r"communication_period=...\)` must be a positive int or 2"):
    ae.Cluster(2).schedule(duration=5.0, communication_period=(3, 0))
  with pytest.raises(TypeError, match=r"`diloco\(dylu=...\)` must be a bool, got 1"):
    ae.diloco(optax.sgd(0.1), dylu=1)
  with pytest.raises(ValueError, match=r"`dylu_sync_periods\(speeds=...\)`"):
    ae.dylu_sync_periods((1.0, -1.0), 10)
  with pytest.raises(ValueError, match=r"dylu_sync_periods\(sync_period=...\)"):
    ae.dylu_sync_periods((1.0,), 0)
  protocol = ae.diloco(optax.sgd(0.1), sync_period=H, dylu=True)
  cluster = ae.Cluster(4, speeds=SPEEDS)
  with pytest.raises(ValueError, match=r"commits every \(30, 30, 15, 7\) local steps"):
    ae.emulate(protocol, lambda p, _: jnp.sum(p), jnp.zeros(1), None,
               cluster.schedule(duration=40.0, communication_period=H))
  with pytest.raises(ValueError, match="explicit schedule"):
    ae.emulate(protocol, lambda p, _: jnp.sum(p), jnp.zeros(1), None, ae.explicit_schedule([0]))
  plain = ae.diloco(optax.sgd(0.1), sync_period=H)
  with pytest.raises(ValueError, match="communicates every 30 steps"):
    ae.emulate(plain, lambda p, _: jnp.sum(p), jnp.zeros(1), None,
               cluster.schedule(duration=40.0, communication_period=(30, 30, 15, 7)))


def test_the_async_command_runs_diloco_with_dylu():
  from optax_dist.cli import async_run
  from optax_dist.cli.main import build_parser
  from optax_dist.cli.tasks import TASKS

  assert build_parser().parse_args(["async", "--dylu"]).dylu is True
  assert build_parser().parse_args(["async"]).dylu is False
  kwargs = {"protocols": ("diloco+delayed_nesterov",), "duration": 40.0, "eval_every": 40,
            "communication_period": 8, "stragglers": 0, "speeds": SPEEDS, "jitter": 0.0}
  (off,) = async_run.run_protocols(TASKS["digits"], **kwargs)
  (on,) = async_run.run_protocols(TASKS["digits"], dylu=True, **kwargs)
  # By time 40 without DyLU: workers 0-1 commit 5 times each, worker 2 twice, worker 3 once;
  # with it (H_w = 8, 8, 4, 2) every worker commits every 8 time units: 5 times each.
  assert off["commits"] == 5 + 5 + 2 + 1
  assert on["commits"] == 4 * 5
  assert "DyLU" in async_run.describe(
    TASKS["digits"], workers=4, stragglers=0, slowdown=1.0, latency=0.0, restarts=(),
    max_staleness=2, communication_period=8, dylu=True)
