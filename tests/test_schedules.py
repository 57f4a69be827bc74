"""The public schedules: each is the rule its transformation's ``update`` applies, and
``hinted_step`` calls the variant the schedule names.

Each schedule is checked two ways: against the closed form written here, and against the
transformation itself, run on two workers that start apart, by the steps on which its global
state (center or anchor) changes or the workers land on one point.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist

STEPS = 12
# Two workers that start apart; two leaves, so that streaming_diloco has two fragments.
START = {"a": jnp.array([[0.0, 1.0], [4.0, -2.0]]), "b": jnp.array([[3.0], [-1.0]])}
GRADS = {"a": jnp.array([[1.0, -1.0], [0.5, 2.0]]), "b": jnp.array([[0.25], [-0.75]])}


def _close(x, y):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), x, y)


def _run(tx, steps=STEPS):
  """The params and states after each of ``steps`` updates of ``tx`` under vmap."""
  init = jax.vmap(tx.init, axis_name="w")
  update = jax.jit(jax.vmap(tx.update, axis_name="w"))
  params, state, trace = START, init(START), []
  for _ in range(steps):
    updates, state = update(GRADS, state, params)
    params = optax.apply_updates(params, updates)
    trace.append((params, state))
  return trace


def _changed(before, after):
  return not np.array_equal(np.asarray(before), np.asarray(after))


def test_periodic_schedules_closed_form():
  steps = range(1, 13)
  assert [t for t in steps if optax_dist.diloco_syncs(t, sync_period=4)] == [4, 8, 12]
  assert [t for t in steps if optax_dist.elastic_average_communicates(
    t, communication_period=5)] == [5, 10]
  assert [t for t in steps if optax_dist.agn_communicates(t, communication_period=3)] == [
    3, 6, 9, 12]
  assert [t for t in steps if optax_dist.local_sgd_syncs(t, sync_period=2, warmup_steps=3)] == [
    5, 7, 9, 11]
  assert [t for t in steps if optax_dist.local_sgd_warming_up(t, warmup_steps=3)] == [1, 2, 3]
  fragment = functools.partial(optax_dist.streaming_diloco_syncs, sync_period=4, num_fragments=2)
  assert [t for t in steps if fragment(t, fragment=0)] == [2, 6, 10]
  assert [t for t in steps if fragment(t, fragment=1)] == [4, 8, 12]
  assert [t for t in steps if fragment(t)] == [2, 4, 6, 8, 10, 12]


def test_schedules_accept_arrays():
  t = jnp.arange(1, 9)
  np.testing.assert_array_equal(optax_dist.diloco_syncs(t, sync_period=4), np.arange(1, 9) % 4 == 0)
  np.testing.assert_array_equal(
    optax_dist.local_sgd_syncs(t, sync_period=2, warmup_steps=3), [0, 0, 0, 0, 1, 0, 1, 0])


@pytest.mark.parametrize("name, tx, field, schedule", [
  ("diloco", optax_dist.diloco(optax.sgd(0.1), sync_period=4, axis_name="w"), "anchor",
   functools.partial(optax_dist.diloco_syncs, sync_period=4)),
  ("elastic_average", optax_dist.elastic_average(
    optax.sgd(0.1), communication_period=5, moving_rate=0.2, axis_name="w"), "center",
   functools.partial(optax_dist.elastic_average_communicates, communication_period=5)),
  ("agn", optax_dist.agn(optax.sgd(0.1), communication_period=3, axis_name="w"), "center",
   functools.partial(optax_dist.agn_communicates, communication_period=3)),
  ("streaming_diloco", optax_dist.streaming_diloco(
    optax.sgd(0.1), sync_period=4, num_fragments=2, axis_name="w"), "anchor",
   functools.partial(optax_dist.streaming_diloco_syncs, sync_period=4, num_fragments=2)),
])
def test_global_state_moves_exactly_on_the_schedule(name, tx, field, schedule):
  trace = _run(tx, STEPS)
  previous = getattr(jax.vmap(tx.init, axis_name="w")(START), field)
  moved = []
  for t, (_, state) in enumerate(trace, start=1):
    now = getattr(state, field)
    if any(_changed(a, b) for a, b in zip(jax.tree.leaves(previous), jax.tree.leaves(now))):
      moved.append(t)
    previous = now
  assert moved == [t for t in range(1, STEPS + 1) if schedule(t)], name


def test_local_sgd_averages_exactly_on_the_schedule():
  tx = optax_dist.local_sgd(optax.sgd(0.1), sync_period=2, warmup_steps=3, axis_name="w")
  landed = [t for t, (params, _) in enumerate(_run(tx), start=1)
            if all(np.allclose(x[0], x[1], rtol=0, atol=1e-6) for x in jax.tree.leaves(params))]
  assert landed == [t for t in range(1, STEPS + 1)
                    if optax_dist.local_sgd_syncs(t, sync_period=2, warmup_steps=3)]


def _counting_step(tx, traces):
  def train_step(params, state, communicate):
    traces.append(communicate)
    updates, state = jax.vmap(
      functools.partial(tx.update, communicate=communicate), axis_name="w")(GRADS, state, params)
    return optax.apply_updates(params, updates), state

  return train_step


def test_hinted_step_compiles_two_variants_and_follows_the_schedule():
  tx = optax_dist.diloco(optax.sgd(0.1), optax.sgd(0.7, momentum=0.9), sync_period=3,
                         axis_name="w")
  traces = []
  step = optax_dist.hinted_step(
    _counting_step(tx, traces), functools.partial(optax_dist.diloco_syncs, sync_period=3))
  params, state = START, jax.vmap(tx.init, axis_name="w")(START)
  for _ in range(7):
    params, state = step(params, state)
  assert sorted(traces) == [False, True]  # each variant traced once
  assert step.step == 7 and int(state.local_step[0]) == 7
  reference, ref_state = _run(tx, 7)[-1]
  _close(params, reference)
  _close(state.anchor, ref_state.anchor)


def test_hinted_step_start_resumes_the_schedule():
  tx = optax_dist.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_period=3, axis_name="w")
  trace = _run(tx, 5)
  params, state = trace[1]  # after 2 steps: the next sync is call 3
  step = optax_dist.hinted_step(
    _counting_step(tx, []), functools.partial(optax_dist.diloco_syncs, sync_period=3), start=2)
  for _ in range(3):
    params, state = step(params, state)
  _close(state.anchor, trace[4][1].anchor)
  _close(params, trace[4][0])


def test_hinted_step_rejects_bad_arguments():
  with pytest.raises(TypeError, match=r"hinted_step\(communicates=...\)"):
    optax_dist.hinted_step(lambda: None, 3)
  with pytest.raises(ValueError, match=r"hinted_step\(start=...\).*got -1"):
    optax_dist.hinted_step(lambda: None, lambda t: True, start=-1)


def test_schedules_reject_bad_periods():
  with pytest.raises(ValueError, match=r"diloco_syncs\(sync_period=...\)"):
    optax_dist.diloco_syncs(3, sync_period=0)
  with pytest.raises(ValueError, match=r"streaming_diloco_syncs\(fragment=...\)"):
    optax_dist.streaming_diloco_syncs(3, sync_period=4, num_fragments=2, fragment=2)
