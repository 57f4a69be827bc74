"""The asynchronous emulator with workers that leave for good and workers that join mid-run.

The expected schedules are closed forms (constant compute times); the numerics come from a
sequential NumPy re-implementation of the four protocols written here, in which a join reads the
server (center, anchor) with a fresh state and a leave changes nothing on the server.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_dist import async_emulator as ae

LR, TAU, ALPHA, OUTER_LR = 0.05, 3, 0.3, 0.7
PROTOCOLS = ("downpour", "elastic_average", "agn", "diloco")


def make_protocol(name, tau=TAU):
  sgd = optax.sgd(LR)
  return {
    "downpour": lambda: ae.downpour(sgd),
    "elastic_average": lambda: ae.elastic_average(sgd, communication_period=tau,
                                                  moving_rate=ALPHA),
    "agn": lambda: ae.agn(sgd, communication_period=tau),
    "diloco": lambda: ae.diloco(sgd, optax.sgd(OUTER_LR), sync_period=tau),
  }[name]()


def lsq_problem(n, m=6, dim=3, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, m, dim)).astype(np.float32)
  y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.1 * rng.normal(size=(n, m)))
  return {"x": x, "y": y.astype(np.float32)}


def lsq_loss(params, batch):
  return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)


def minus_sum(params, batch):
  """A loss whose gradient is -1 for every parameter."""
  del batch
  return -jnp.sum(params)


def np_loss(p, data, w):
  x, y = data["x"][w].astype(np.float64), data["y"][w].astype(np.float64)
  return np.mean((x @ p - y) ** 2)


def np_grad(p, data, w):
  x, y = data["x"][w].astype(np.float64), data["y"][w].astype(np.float64)
  return 2.0 * x.T @ (x @ p - y) / len(y)


def numpy_reference(protocol, schedule, data, tau=TAU):
  """The center (server, anchor) and every worker's params after ``schedule``, in float64."""
  n = schedule.num_workers
  center = np.zeros(3)
  local, accum, read = np.zeros((n, 3)), np.zeros((n, 3)), np.zeros((n, 3))
  steps = np.zeros(n, int)
  for k, w in enumerate(schedule.worker):
    if schedule.leave[k]:  # nothing reaches the server
      continue
    if schedule.join[k] or schedule.restart[k]:
      local[w], read[w], accum[w], steps[w] = center, center, 0.0, 0
      continue
    g = np_grad(local[w], data, w)
    if protocol == "downpour":  # local[w] is the worker's snapshot of the server
      center = center - LR * g
      local[w] = center
      continue
    local[w], accum[w], steps[w] = local[w] - LR * g, accum[w] + g, steps[w] + 1
    if steps[w] % tau:
      continue
    if protocol == "elastic_average":
      d = ALPHA * (local[w] - center)
      local[w], center = local[w] - d, center + d
    elif protocol == "agn":
      center = center - LR * accum[w] / tau
      local[w], accum[w] = center, 0.0
    else:  # diloco, outer SGD
      center = center - OUTER_LR * (read[w] - local[w])
      local[w], read[w] = center, center
  return center, local


def event_kinds(schedule):
  return np.select([schedule.restart, schedule.join, schedule.leave],
                   ["restart", "join", "leave"], "step")


# ----------------------------------------------------------------------------------------------
# Schedules.


def test_cluster_leave_and_join_timing():
  # Steps of 1, latency 0.5 on every 2nd step. Worker 1 leaves at 3.7: its step due at 4.5 is
  # lost. Worker 2 joins at 1.25 (steps end 2.25, 3.75, 4.75, 6.25) and crashes at 5.0 (back at
  # once: 5.0, 6.0, 7.5).
  cluster = ae.Cluster(3, latency=0.5)
  s = cluster.schedule(duration=7.5, communication_period=2, leaves=[(1, 3.7)],
                       joins=[(2, 1.25)], restarts=[(2, 5.0)])
  kinds = event_kinds(s)
  by_worker = {w: list(zip(kinds[s.worker == w].tolist(), s.time[s.worker == w].tolist()))
               for w in range(3)}
  assert by_worker[0] == [("step", t) for t in (1.0, 2.5, 3.5, 5.0, 6.0, 7.5)]
  assert by_worker[1] == [("step", 1.0), ("step", 2.5), ("step", 3.5), ("leave", 3.7)]
  assert by_worker[2] == [("join", 1.25), ("step", 2.25), ("step", 3.75), ("step", 4.75),
                          ("restart", 5.0), ("step", 6.0), ("step", 7.5)]
  np.testing.assert_array_equal(s.local_step[s.worker == 2], [0, 1, 2, 3, 0, 1, 2])
  np.testing.assert_array_equal(s.communicates[s.worker == 2],
                                [False, False, True, False, False, False, True])
  assert np.all(np.diff(s.time) >= 0)


def test_ties_steps_then_leaves_then_joins():
  # At time 2: worker 0's and worker 1's steps end, worker 1 leaves, worker 2 joins (and reads
  # the server after both steps).
  s = ae.Cluster(3).schedule(duration=2.0, leaves=[(1, 2.0)], joins=[(2, 2.0)])
  at_two = s.time == 2.0
  assert event_kinds(s)[at_two].tolist() == ["step", "step", "leave", "join"]
  assert s.worker[at_two].tolist() == [0, 1, 1, 2]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_event_after_a_leave_and_none_before_a_join(seed):
  cluster = ae.Cluster(4, jitter=0.5, stragglers=1, slowdown=3.0, latency=0.3, seed=seed)
  s = cluster.schedule(duration=40.0, communication_period=2, leaves=[(0, 13.3), (3, 20.0)],
                       joins=[(2, 7.7)], restarts=[(2, 9.0, 1.5), (1, 4.0)])
  for w, leave_time in ((0, 13.3), (3, 20.0)):
    mine = np.flatnonzero(s.worker == w)
    assert s.leave[mine[-1]] and s.time[mine[-1]] == leave_time
    assert np.all(s.time[mine[:-1]] <= leave_time) and s.leave[mine].sum() == 1
  mine = np.flatnonzero(s.worker == 2)
  assert s.join[mine[0]] and s.time[mine[0]] == 7.7 and np.all(s.time[mine[1:]] > 7.7)
  assert s.join.sum() == 1 and s.restart.sum() == 2
  assert (s.worker[s.step] == 1).sum() > 30  # the others keep going: about 40 steps of 1


def test_num_events_counts_steps_and_matches_duration():
  # A worker gone early must not stop the drawing: the first 60 steps are those of a long run.
  cluster = ae.Cluster(3, jitter=0.4, seed=5)
  kwargs = {"leaves": [(1, 2.2)], "joins": [(2, 3.1)], "communication_period": 2}
  short = cluster.schedule(num_events=60, **kwargs)
  long = cluster.schedule(duration=200.0, **kwargs)
  assert short.step.sum() == 60 and short.step[-1]
  e = short.num_events
  for field in ("worker", "time", "restart", "join", "leave", "local_step"):
    np.testing.assert_array_equal(getattr(short, field), getattr(long, field)[:e])
  with pytest.raises(ValueError, match="only 4 steps before they all leave"):
    ae.Cluster(2).schedule(num_events=10, leaves=[(0, 2.5), (1, 2.0)])


def test_a_leave_and_a_join_keep_the_number_of_active_workers():
  # Five workers, worker 4 absent until 10, worker 1 gone from 10: four at every step, and four
  # steps end in every unit of time.
  s = ae.Cluster(5).schedule(duration=20.0, leaves=[(1, 10.0)], joins=[(4, 10.0)])
  np.testing.assert_array_equal(s.active[s.step], 4)
  np.testing.assert_array_equal(np.bincount(s.time[s.step].astype(int))[1:], np.full(20, 4))
  assert (s.worker[s.step] == 1).sum() == 10 and (s.worker[s.step] == 4).sum() == 10
  assert s.active[0] == 4 and s.active.min() == 3  # between the leave and the join at 10


def test_explicit_schedule_membership():
  s = ae.explicit_schedule([0, ("join", 2), 1, 2, ("leave", 1), 0, ("restart", 2), 2])
  assert event_kinds(s).tolist() == ["step", "join", "step", "step", "leave", "step",
                                     "restart", "step"]
  np.testing.assert_array_equal(s.local_step, [1, 0, 1, 1, 0, 2, 0, 1])
  np.testing.assert_array_equal(s.active, [2, 3, 3, 3, 2, 2, 2, 2])


# ----------------------------------------------------------------------------------------------
# Numerics: every protocol against the NumPy reference, and the joining worker's start.


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_matches_numpy_reference_with_leaves_and_joins(protocol):
  n = 4
  data = lsq_problem(n)
  p = make_protocol(protocol)
  cluster = ae.Cluster(n, jitter=0.3, stragglers=1, slowdown=2.0, latency=0.2, seed=3)
  schedule = cluster.schedule(duration=25.0, communication_period=p.communication_period,
                              leaves=[(1, 9.3)], joins=[(3, 6.1)], restarts=[(0, 4.2)])
  assert schedule.leave.sum() == schedule.join.sum() == schedule.restart.sum() == 1
  result = ae.emulate(p, lsq_loss, jnp.zeros(3), data, schedule, batch_size=6)
  center, local = numpy_reference(protocol, schedule, data)
  np.testing.assert_allclose(result.params, center, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(result.worker_params, local, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(result.committed, schedule.communicates)
  np.testing.assert_array_equal(np.isnan(result.loss), ~schedule.step)
  np.testing.assert_array_equal(result.join, schedule.join)
  np.testing.assert_array_equal(result.leave, schedule.leave)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_joining_worker_starts_from_the_server_params_at_its_join(protocol):
  # Worker 2 joins at 3.5; its first step's loss is the loss of the center as it was right
  # after the join event (evaluated after every event), not of the initial params.
  n = 3
  data = lsq_problem(n)
  p = make_protocol(protocol, tau=2)
  schedule = ae.Cluster(n).schedule(duration=8.0, communication_period=p.communication_period,
                                    joins=[(2, 3.5)])
  result = ae.emulate(p, lsq_loss, jnp.zeros(3), data, schedule, batch_size=6,
                      eval_fn=lambda params: params, eval_every=1)
  join = int(np.flatnonzero(schedule.join)[0])
  first = int(np.flatnonzero(schedule.step & (schedule.worker == 2))[0])
  assert schedule.time[join] == 3.5 and schedule.time[first] == 4.5
  center_at_join = result.eval_metrics[join + 1]  # evaluations: before the first event, then
  assert np.abs(center_at_join).sum() > 0  # the center has moved by then
  np.testing.assert_allclose(result.loss[first], np_loss(center_at_join, data, 2), rtol=1e-5)
  commits = np.flatnonzero(result.committed & (schedule.worker == 2))
  assert result.read_step[commits[0]] == result.server_step[join]  # read at the join


def test_agn_accumulation_of_a_leaving_worker_is_lost():
  # τ = 2, gradients -1, SGD(1): worker 1 steps once and leaves, so its accumulated gradient
  # never reaches the center; worker 0's commit moves it by 1 (its mean gradient) only.
  p = ae.agn(optax.sgd(1.0), communication_period=2)
  result = ae.emulate(p, minus_sum, jnp.zeros(1), None,
                      ae.explicit_schedule([0, 1, ("leave", 1), 0]))
  np.testing.assert_array_equal(result.params, [1.0])
  np.testing.assert_array_equal(result.worker_params[:, 0], [1.0, 1.0])  # worker 1 as it left
  np.testing.assert_array_equal(result.committed, [False, False, False, True])


def test_diloco_local_progress_of_a_leaving_worker_is_lost():
  # H = 2, outer SGD(1), inner SGD(1), gradients -1: worker 1's single local step is never
  # committed; worker 0's commit moves the anchor by its own progress, 2.
  p = ae.diloco(optax.sgd(1.0), optax.sgd(1.0), sync_period=2)
  schedule = ae.explicit_schedule([0, 1, ("leave", 1), ("join", 2), 0, 2, 2])
  result = ae.emulate(p, minus_sum, jnp.zeros(1), None, schedule)
  # Worker 2 joins at anchor 0, worker 0 commits (anchor 2), worker 2 commits its progress 2
  # from the anchor it read: the anchor becomes 4; staleness 1 (worker 0's commit in between).
  np.testing.assert_array_equal(result.params, [4.0])
  np.testing.assert_array_equal(result.commit_staleness, [0, 1])


# ----------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize(("kwargs", "match"), [
  ({"leaves": [(3, 1.0)]}, r"leaves=\.\.\.\)` entries must be \(worker, time\) with a worker in"),
  ({"joins": [(0, -1.0)]}, r"joins=\.\.\.\)` entries .* finite time >= 0"),
  ({"joins": [(0, "soon")]}, r"joins=\.\.\.\)` entries"),
  ({"leaves": [(1, 2.0), (1, 3.0)]}, "worker 1 appears twice"),
  ({"joins": [(1, 5.0)], "leaves": [(1, 4.0)]}, "worker 1 joins at 5.0 but leaves at 4.0"),
  ({"joins": [(1, 4.0)], "leaves": [(1, 4.0)]}, "must join before it leaves"),
  ({"joins": [(1, 5.0)], "restarts": [(1, 3.0)]}, "must crash after it joins"),
  ({"leaves": [(1, 5.0)], "restarts": [(1, 4.0, 2.0)]}, "be back before it leaves"),
])
def test_cluster_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ae.Cluster(3).schedule(duration=10.0, **kwargs)


@pytest.mark.parametrize(("events", "match"), [
  ([0, ("join", 1), ("join", 1)], "worker 1 joins or leaves more than once"),
  ([0, ("leave", 1), ("join", 1)], "worker 1 joins after it leaves"),
  ([0, 1, ("join", 1)], "worker 1 has events before its join"),
  ([0, ("leave", 0), 0], "worker 0 has events after its leave"),
  ([(0, 0), ("join", 1), (1, 0)], "restarts and joins cannot be mixed"),
  ([0, ("part", 1)], r"\('join', worker\) or \('leave', worker\)"),
])
def test_explicit_schedule_errors(events, match):
  with pytest.raises(ValueError, match=match):
    ae.explicit_schedule(events)
