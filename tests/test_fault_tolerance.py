"""Fault-tolerant rounds in the in-process engine: the invariants, bit for bit, under scripted
faults (torchft's ``local_sgd_integ_test.py`` way: faults injected in one process, the global
state compared after every round).

The optimizers' products are exact (by powers of 2), as in ``test_halves``: the engine's halves
run in other programs than the in-program transformation, and XLA's fusion (an FMA) of an
inexact product there would move an anchor by an ulp whatever the protocol does.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import pickle
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import PicklePayload

import optax_dist
from optax_dist import fault_tolerance as ft
from optax_dist.fault_tolerance import checkpoints

AXIS = "w"
SHAPES = {"a": (4, 3), "b": (5,)}  # b: 5 values, not a multiple of the blocks
H = 2
BLOCK = 4
FORMATS = {
  "none": {}, "bfloat16": {"comm_dtype": jnp.bfloat16},
  "int8": {"comm_dtype": "int8", "comm_block_size": BLOCK},
  "int8_feedback": {"comm_dtype": "int8", "comm_block_size": BLOCK, "error_feedback": True},
  "float4": {"comm_dtype": "float4_e2m1fn", "comm_block_size": BLOCK},
}


def _inner():
  return optax.sgd(0.5, momentum=0.5)


def _outer():
  return optax.sgd(1.0, momentum=0.5, nesterov=True)


@jax.jit
def _params():
  keys = jax.random.split(jax.random.key(0), len(SHAPES))
  return {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, SHAPES.items(), strict=True)}


@jax.jit
def _batch(seed, slot, step):
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), slot), step)
  keys = jax.random.split(key, len(SHAPES))
  return {k: jax.random.normal(kk, s) for kk, (k, s) in zip(keys, SHAPES.items(), strict=True)}


def _grad(params, batch):  # the gradient of 0.5 |params - batch|^2
  return jax.tree.map(jnp.subtract, params, batch)


# Streaming DiLoCo with 2 fragments and H = 4: a round (one fragment's exchange) every 2 steps,
# as diloco's with H = 2.
STREAMING = (("num_fragments", 2), ("sync_period", 2 * H))


@functools.cache
def _protocol(algorithm: str, fmt: str, extra: tuple = ()) -> ft.RoundProtocol:
  """One protocol per case, shared by the tests: its halves compile once."""
  outer = None if algorithm == "local_sgd" else _outer()
  kw = {"sync_period": H, **FORMATS[fmt], **dict(extra)}
  return ft.RoundProtocol(algorithm, _inner(), outer, **kw)


def _engine(algorithm="diloco", fmt="none", extra=(), **kw):
  return ft.InProcessEngine(_protocol(algorithm, fmt, extra), _params(), _grad, _batch, **kw)


def _assert_trees_equal(got, want) -> None:
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _assert_equal_global_state(engine, members) -> None:
  """E1: every member holds the same global state, leaf for leaf and by hash."""
  states = [ft.global_state(engine.replicas[i]) for i in members]
  for state in states[1:]:
    _assert_trees_equal(state, states[0])
  assert len({ft.state_hash(s) for s in states}) == 1


# ------------------------------------------------------------------------------------------------
# E4: without a fault the engine is the in-program transformation.


def _in_program(algorithm, fmt, n, rounds, extra=()):
  """The transformation under vmap(axis_name): each worker's (params, state) after each round
  (every H steps: diloco's and local_sgd's rounds, and one fragment's for STREAMING)."""
  kw = {"axis_name": AXIS, "sync_period": H, **FORMATS[fmt], **dict(extra)}
  if algorithm == "local_sgd":
    tx = optax_dist.local_sgd(_inner(), **kw)
  else:
    tx = getattr(optax_dist, algorithm)(_inner(), _outer(), **kw)

  @jax.jit
  @functools.partial(jax.vmap, axis_name=AXIS)
  def step(params, state, batch):
    updates, state = tx.update(_grad(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  params = jax.tree.map(lambda p: np.broadcast_to(p, (n, *p.shape)), jax.device_get(_params()))
  state = jax.jit(jax.vmap(tx.init, axis_name=AXIS))(params)
  after = []
  for t in range(rounds * H):
    # the engine's batches: the same program computes them (stacked on the host)
    batches = [_batch(0, i, t) for i in range(n)]
    params, state = step(params, state, jax.tree.map(lambda *b: np.stack(b), *batches))
    if (t + 1) % H == 0:
      host = jax.device_get((params, state))
      after.append([jax.tree.map(lambda x, i=i: x[i], host) for i in range(n)])
  return after


@pytest.mark.parametrize("algorithm, fmt, n, exact, extra", [
  ("diloco", "none", 2, True, ()), ("diloco", "bfloat16", 2, True, ()),
  ("diloco", "float4", 2, True, ()), ("diloco", "int8_feedback", 3, True, ()),
  ("diloco", "none", 3, False, ()),
  ("local_sgd", "none", 2, True, ()), ("local_sgd", "int8", 3, True, ()),
  ("streaming_diloco", "none", 2, True, STREAMING),
  ("streaming_diloco", "int8_feedback", 3, True, (*STREAMING, ("mixing", 0.5))),
])
def test_no_fault_equals_in_program(algorithm, fmt, n, exact, extra):
  """Bitwise for 2 replicas and the gathered formats (summed in float32 in rank order); with 3
  replicas in the params' own dtype a psum may add in another order: the first round within
  one ulp (later rounds start from params an ulp apart)."""
  rounds = 4 if exact else 1  # streaming: each fragment twice
  want = _in_program(algorithm, fmt, n, rounds, extra)
  engine = _engine(algorithm, fmt, extra, num_replicas=n)
  for r in range(rounds):
    assert all(line.committed for line in engine.run(1))
    for i in range(n):
      _assert_replica_is(engine.replicas[i], want[r][i], exact)


def _assert_replica_is(got, want, exact):
  """A replica's params and optimizer state against the in-program worker's ``want``: bit for
  bit if ``exact``, else within one ulp."""
  for g, w in zip(jax.tree.leaves((got.params, got.opt_state)), jax.tree.leaves(want),
                  strict=True):
    if exact:
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    else:
      np.testing.assert_array_max_ulp(np.asarray(g), np.asarray(w), maxulp=1)


@pytest.mark.parametrize("fmt, n, tau, mixing", [
  ("none", 2, 1, 0.0), ("none", 2, 2, 0.5), ("none", 3, 1, 0.5), ("int8_feedback", 3, 2, 0.0),
])
def test_overlap_equals_in_program(fmt, n, tau, mixing):
  """E4 with overlap: a fragment's round commits on its send step s and its merge lands on
  step s + tau in the replicas' inner steps, as in ``streaming_diloco(overlap=tau)``: after
  every round (steps 2, 4, 6, 8; tau = 1 lands mid-round, tau = 2 on the other fragment's
  send), bitwise for 2 replicas and the gathered format, within one ulp for 3 replicas in the
  params' own dtype. A landing a step early or late fails it."""
  extra = (*STREAMING, ("overlap", tau), ("mixing", mixing))
  rounds = 4
  want = _in_program("streaming_diloco", fmt, n, rounds, extra)
  engine = _engine("streaming_diloco", fmt, extra, num_replicas=n)
  exact = n == 2 or fmt != "none"
  for r in range(rounds):
    assert all(line.committed for line in engine.run(1))
    for i in range(n):
      got = engine.replicas[i]
      assert int(got.opt_state.in_flight_step[r % 2]) == 2 * (r + 1)  # held from the send
      _assert_replica_is(got, want[r][i], exact)


def test_a_death_at_a_round_boundary_equals_checkpoint_resize_and_resume():
  """Replica 2 of 3 dies after round 1 (during round 2's inner steps, so nothing of it is
  merged again): replicas 0 and 1 then hold what the in-program run does when checkpointed
  after round 1, resized to 2 workers (``resize_state``) and resumed. The optimizer state bit
  for bit: a gathered format (int8, summed in float32 in rank order), and an inner optimizer
  and no error feedback whose per-worker state the resize keeps (SGD has none). The params,
  which a checkpoint does not hold, within a few ulps (4 measured in round 2, 0 in round 3):
  the resize restarts them from the anchor, while a survivor holds its params landed on it
  (origin + (anchor - origin)), an ulp off, and its next round starts there. A join is not such a
  boundary: the joiner's first round has weight 0 (it heals), where a resized run's new worker
  contributes at once."""
  kw = {"sync_period": H, "comm_dtype": "int8", "comm_block_size": BLOCK}
  inner = optax.sgd(0.5)
  engine = ft.InProcessEngine(ft.RoundProtocol("diloco", inner, _outer(), **kw), _params(),
                              _grad, _batch, num_replicas=3, faults=[ft.Fault(2, 2, "die_inner")])
  tx = optax_dist.diloco(inner, _outer(), axis_name=AXIS, **kw)

  @jax.jit
  @functools.partial(jax.vmap, axis_name=AXIS)
  def step(params, state, batch):
    updates, state = tx.update(_grad(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  def steps(params, state, n, first, last):
    for t in range(first, last):
      batches = [_batch(0, i, t) for i in range(n)]
      params, state = step(params, state, jax.tree.map(lambda *b: np.stack(b), *batches))
    return params, state

  params = jax.tree.map(lambda p: np.broadcast_to(p, (3, *p.shape)), jax.device_get(_params()))
  params, state = steps(params, jax.jit(jax.vmap(tx.init, axis_name=AXIS))(params), 3, 0, 2 * H)
  state, params = optax_dist.resize_state(tx, state, params, 2)
  for r in (2, 3):
    params, state = steps(params, state, 2, r * H, (r + 1) * H)
    engine.run(3 if r == 2 else 1)
    assert [line.members for line in engine.log if line.round == r] == [(0, 1)] * 2
    host = jax.device_get((params, state))
    for i in (0, 1):
      _assert_trees_equal(engine.replicas[i].opt_state, jax.tree.map(lambda x, i=i: x[i], host[1]))
      for got, want in zip(jax.tree.leaves(engine.replicas[i].params), jax.tree.leaves(params),
                           strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want[i]), rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------
# E1, E2, E3 under a schedule of every fault.

SCHEDULE = [
  ft.Fault(0, 3, "die_inner"),  # dies before its first exchange ...
  ft.Fault(1, 3, "join"),  # ... and joins from step 0: heals from replica 0
  ft.Fault(2, 1, "die_exchange"),  # the round aborts on every member
  ft.Fault(3, 1, "join"), ft.Fault(3, 0, "die_heal"),  # the donor dies: 1 heals from 2
  ft.Fault(4, 0, "join"), ft.Fault(4, 2, "straggle"),  # 0 heals; 2 is left out, reverts
  ft.Fault(5, 3, "nonfinite"),  # 2 heals (behind); 3 votes no: abort
]
# round -> (members, committed, healed)
EXPECTED = {
  0: ((0, 1, 2), True, ()), 1: ((0, 1, 2, 3), True, (3,)), 2: ((0, 1, 2, 3), False, ()),
  3: ((1, 2, 3), True, (1,)), 4: ((0, 1, 3), True, (0,)), 5: ((0, 1, 2, 3), False, (2,)),
  6: ((0, 1, 2, 3), True, ()),
}


# Overlap 3: fragment 0 sent on step 2 lands on step 5, after fragment 1's send on step 4, so
# the round boundary's heals and aborts meet a fragment in flight.
OVERLAP = (*STREAMING, ("overlap", 3))


@pytest.fixture(scope="module", params=[
  ("diloco", ()), ("streaming_diloco", STREAMING), ("streaming_diloco", OVERLAP)],
  ids=["diloco", "streaming_diloco", "streaming_overlap"])
def faulty_run(request):
  calls = []

  def batch_fn(seed, slot, step):
    calls.append((slot, step))
    return _batch(seed, slot, step)

  engine = ft.InProcessEngine(
    _protocol(request.param[0], "int8_feedback", request.param[1]), _params(), _grad, batch_fn,
    num_replicas=4, faults=SCHEDULE)
  per_round = []
  for _ in EXPECTED:
    lines = engine.run(1)
    per_round.append(lines)
    members = next(line.members for line in lines if line.members)
    _assert_equal_global_state(engine, [i for i in members if engine.replicas[i] is not None])
  return engine, per_round, calls


def test_faults_do_what_the_schedule_says(faulty_run):
  _, per_round, _ = faulty_run
  for r, lines in enumerate(per_round):
    members, committed, healed = EXPECTED[r]
    in_quorum = [line for line in lines if line.members]
    assert in_quorum[0].members == members, r
    assert {line.committed for line in in_quorum} == {committed}, r
    assert tuple(line.replica for line in lines if line.healed) == healed, r
    for line in lines:  # healed and joined replicas weigh nothing
      assert line.weight == (0 if line.healed or not line.members else line.tokens), (r, line)
  straggler = [line for line in per_round[4] if line.replica == 2]
  assert straggler[0].members == () and not straggler[0].committed
  assert [line.quorum_id for line in (lines[0] for lines in per_round)] == [1, 2, 2, 3, 4, 5, 5]


def test_committed_members_hold_one_global_state(faulty_run):
  """E1 (checked leaf by leaf after each round in the fixture) and by the log's hashes."""
  _, per_round, _ = faulty_run
  for lines in per_round:
    assert len({line.state_hash for line in lines if line.members}) == 1
  assert len({line.state_hash for line in per_round[-1]}) == 1  # all four agree at the end


def test_healed_joiner_equals_its_donor(faulty_run):
  """E2: bit for bit, right after each heal."""
  engine, _, _ = faulty_run
  assert [(r, j, d) for r, j, d, _, _ in engine.heals] == [
    (1, 3, 0), (3, 1, 2), (4, 0, 1), (5, 2, 0)]
  for _, _, _, joiner, donor in engine.heals:
    _assert_trees_equal(joiner, donor)
  if engine.protocol.overlap:  # a heal carries the fragment in flight since the last round's
    # send (none after round 2's abort), and the joiner lands it with the others (E1, E3)
    assert [d.opt_state.in_flight_step.tolist() for *_, d in engine.heals] == [
      [2, 0], [0, 0], [0, 8], [10, 0]]


def test_run_with_faults_equals_replay_of_its_log(faulty_run):
  """E3: a fresh engine driven by the log alone gives the same lines, hashes included."""
  engine, _, _ = faulty_run
  fresh = ft.InProcessEngine(engine.protocol, _params(), _grad, _batch, num_replicas=4)
  assert ft.replay(fresh, engine.log) == engine.log


def test_data_position_is_the_local_step(faulty_run):
  """Each slot's batches are (slot, local_step): a joiner continues its slot's stream from the
  step it healed to; the steps of a round a replica died in (after running) are lost."""
  _, _, calls = faulty_run
  want = {
    0: [*range(0, 8), *range(10, 14)],  # ran rounds 0-3 (died donating), healed to step 10
    1: [*range(0, 6), *range(8, 14)],  # died in round 2's exchange, healed to step 8
    2: list(range(14)),  # every round (straggled in round 4, healed in round 5)
    3: list(range(4, 14)),  # dead in round 0, joined in round 1, healed to step 4
  }
  assert {slot: [t for s, t in calls if s == slot] for slot in range(4)} == want


def test_a_retried_exchange_commits_the_round_of_the_members_left():
  """With ``exchange_retries``, the round replica 1 dies in the exchange of commits on the
  others in a new quorum: their global state is the one of a round replica 1 died before (in
  its inner steps), and the log replays (E3)."""
  retried = _engine(num_replicas=4, faults=SCHEDULE[:3], exchange_retries=1)
  died_before = _engine(num_replicas=4, faults=[*SCHEDULE[:2], ft.Fault(2, 1, "die_inner")])
  lines, want = retried.run(3)[-3:], died_before.run(3)[-3:]
  assert [(line.replica, line.members, line.committed) for line in lines] == [
    (i, (0, 2, 3), True) for i in (0, 2, 3)]
  assert [line.state_hash for line in lines] == [line.state_hash for line in want]
  assert retried.replicas[1] is None
  fresh = _engine(num_replicas=4)
  assert ft.replay(fresh, retried.log) == retried.log


# ------------------------------------------------------------------------------------------------
# Abort, weights, quorum.


def _aborted_round(algorithm: str, **kw):
  """Two replicas' engines, one whose round 1 aborts (a non-finite payload) and one without
  the fault; each after round 1, with the faulty replicas' states before it. Checks the
  outcomes and that the abort keeps the anchor, the outer state and the residual."""
  faulty = _engine(algorithm, "int8_feedback", num_replicas=2,
                   faults=[ft.Fault(1, 1, "nonfinite")], **kw)
  clean = _engine(algorithm, "int8_feedback", num_replicas=2, **kw)
  faulty.run(1), clean.run(1)
  before = [faulty.replicas[i] for i in range(2)]
  assert not any(line.committed for line in faulty.run(1))
  assert all(line.committed for line in clean.run(1))
  for i in range(2):
    for field in ("anchor", "outer_state", "error_feedback"):
      _assert_trees_equal(getattr(faulty.replicas[i].opt_state, field),
                          getattr(before[i].opt_state, field))
  return faulty, clean, before


def test_abort_keeps_the_global_state_and_returns_to_the_anchor():
  faulty, clean, before = _aborted_round("diloco")
  for i in range(2):
    got, old = faulty.replicas[i], before[i]
    _assert_trees_equal(got.params, old.opt_state.anchor)
    assert int(got.opt_state.local_step) == 2 * H and int(got.rounds) == 1
    # the inner state is kept: the one of the same inner steps in a committed round
    _assert_trees_equal(got.opt_state.inner_state, clean.replicas[i].opt_state.inner_state)


def test_streaming_abort_reverts_only_its_fragment():
  """Round 1 is fragment 1's exchange (step 4), and leaf "b" is fragment 1's."""
  p = _protocol("streaming_diloco", "int8_feedback", STREAMING)
  assert [p.fragment(t) for t in range(1, 5)] == [None, 0, None, 1]
  assert optax_dist.streaming_diloco_fragments(_params(), 2) == (0, 1)
  faulty, clean, before = _aborted_round("streaming_diloco", extra=STREAMING)
  for i in range(2):
    got, old = faulty.replicas[i], before[i]
    _assert_trees_equal(got.params["b"], old.opt_state.anchor["b"])  # the fragment reverts
    _assert_trees_equal(got.params["a"], clean.replicas[i].params["a"])  # the other goes on


def test_streaming_abort_with_overlap_reverts_only_its_fragment():
  """With overlap 3 the aborted round 1 (fragment 1's send, step 4) puts nothing in flight:
  its leaf "b" reverts to the anchor on the send step and nothing of it lands on step 7, while
  fragment 0, in flight since step 2, still lands on step 5 as in the run without the fault."""
  faulty, clean, before = _aborted_round("streaming_diloco", extra=OVERLAP)
  for i in range(2):
    got = faulty.replicas[i]
    _assert_trees_equal(got.params["b"], before[i].opt_state.anchor["b"])
    _assert_trees_equal(got.params["a"], clean.replicas[i].params["a"])
    assert got.opt_state.in_flight_step.tolist() == [2, 0]
    assert clean.replicas[i].opt_state.in_flight_step.tolist() == [2, 4]
  anchor_b = faulty.replicas[0].opt_state.anchor["b"]
  faulty.run(2), clean.run(2)  # steps 5 to 8
  _assert_trees_equal(faulty.replicas[0].opt_state.anchor["b"], anchor_b)
  assert not np.array_equal(clean.replicas[0].opt_state.anchor["b"], anchor_b)
  _assert_trees_equal(faulty.replicas[0].opt_state.outer_state[0],
                      clean.replicas[0].opt_state.outer_state[0])


def test_healed_replica_weighs_nothing():
  """Replica 2 misses round 0 and heals in round 1: the global state is that of two replicas."""
  three = _engine(num_replicas=3, faults=[ft.Fault(0, 2, "die_inner"), ft.Fault(1, 2, "join")])
  two = _engine(num_replicas=2, min_replicas=2)
  lines = three.run(2)
  two.run(2)
  assert [(line.round, line.replica, line.weight) for line in lines] == [
    (0, 0, H), (0, 1, H), (1, 0, H), (1, 1, H), (1, 2, 0)]
  assert {line.state_hash for line in lines[2:]} == {
    ft.state_hash(ft.global_state(two.replicas[0]))}


def test_unequal_tokens_give_the_token_weighted_merge():
  p = _protocol("local_sgd", "none")
  engine = ft.InProcessEngine(p, _params(), _grad, _batch, num_replicas=2, tokens_per_step=[1, 3])
  assert [line.weight for line in engine.run(1)] == [H, 3 * H]
  sent = [  # each replica's round, outside the engine
    p.run_round(p.init(_params()), lambda params, t, s=slot: _grad(params, _batch(0, s, t)))[1]
    .payload for slot in range(2)]
  weighted = optax_dist.merge_payloads(sent, [H, 3 * H])
  _assert_trees_equal(engine.replicas[0].average, weighted)
  assert not np.array_equal(weighted["a"], optax_dist.merge_payloads(sent)["a"])


def test_straggler_reverts_then_heals_with_a_zero_residual():
  engine = _engine(fmt="int8_feedback", num_replicas=3, faults=[ft.Fault(1, 2, "straggle")])
  engine.run(1)
  before = engine.replicas[2]
  (*_, line) = engine.run(1)
  assert (line.replica, line.members, line.committed, line.weight) == (2, (), False, 0)
  late = engine.replicas[2]  # reverted as on an abort: the round's residual candidate dropped
  _assert_trees_equal(late.params, before.opt_state.anchor)
  _assert_trees_equal(late.opt_state.error_feedback, before.opt_state.error_feedback)
  assert int(late.opt_state.local_step) == 2 * H and int(late.rounds) == 1
  (*_, line) = engine.run(1)
  assert (line.healed, line.committed, line.weight) == (True, True, 0)
  residual = engine.replicas[2].opt_state.error_feedback  # rebuilt to zero, kept by the commit
  _assert_trees_equal(residual, jax.tree.map(jnp.zeros_like, engine.params0))


def test_no_quorum_no_commit():
  """All but one die: min_replicas = 2 of 3 is not met and the lone replica aborts."""
  engine = _engine(num_replicas=3, faults=[ft.Fault(1, 1, "die_inner"),
                                           ft.Fault(1, 2, "die_inner")])
  engine.run(1)
  anchor = engine.replicas[0].opt_state.anchor
  (line,) = engine.run(1)
  assert (line.replica, line.members, line.committed) == (0, (0,), False)
  assert int(engine.replicas[0].rounds) == 1
  _assert_trees_equal(engine.replicas[0].opt_state.anchor, anchor)
  _assert_trees_equal(engine.replicas[0].params, anchor)


# ------------------------------------------------------------------------------------------------
# The state split and the heal payload.


def test_local_state_rebuilds_a_joiner():
  p = _protocol("diloco", "int8_feedback")
  engine = _engine(fmt="int8_feedback", num_replicas=2)
  engine.run(2)
  donor = engine.replicas[0]
  joiner = ft.local_state(p, ft.global_state(donor), _params())
  _assert_trees_equal(ft.global_state(joiner), ft.global_state(donor))
  _assert_trees_equal(joiner.params, donor.opt_state.anchor)
  _assert_trees_equal(joiner.opt_state.inner_state, p.tx.init(_params()).inner_state)
  _assert_trees_equal(joiner.opt_state.error_feedback,
                      jax.tree.map(jnp.zeros_like, donor.opt_state.error_feedback))
  assert ft.global_state(donor).opt_state.inner_state is None  # local: never sent


def test_a_joiner_takes_its_donor_s_inner_state_moments_and_counts():
  """Replica 1 dies in round 0 and joins in round 2: it takes its donor's inner optimizer
  state, its learning-rate schedule's count and adam's count and moments (at the same anchor
  as its restart point), so it meets the run's learning rate with the run's moments."""
  def parts(replica, kind):
    tree = replica.opt_state.inner_state
    return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, kind))
            if isinstance(x, kind)]

  protocol = ft.RoundProtocol("diloco", optax.adam(optax.linear_schedule(0.1, 0.01, 100)),
                              _outer(), sync_period=H)
  engine = ft.InProcessEngine(protocol, _params(), _grad, _batch, num_replicas=2,
                              faults=[ft.Fault(0, 1, "die_inner"), ft.Fault(2, 1, "join")])
  engine.run(3)
  assert [line.healed for line in engine.log if line.replica == 1] == [True]
  donor, joiner = engine.replicas[0], engine.replicas[1]
  (schedule,) = parts(joiner, optax.ScaleByScheduleState)
  (adam,) = parts(joiner, optax.ScaleByAdamState)
  assert int(schedule.count) == int(parts(donor, optax.ScaleByScheduleState)[0].count) == 3 * H
  (donor_adam,) = parts(donor, optax.ScaleByAdamState)
  # healed in round 2 from the donor's state before that round's commit: the same moments then,
  # and both took round 2's commit and round 3's steps alike (they are not global: the joiner's
  # own steps since may differ)
  assert int(adam.count) == int(donor_adam.count) == 3 * H
  assert all(float(jnp.abs(x).sum()) > 0 for x in jax.tree.leaves((adam.mu, adam.nu)))
  # the inner state is sent, not global: the hash of a committed round does not hold it
  assert ft.inner_state(donor).inner_state == donor.opt_state.inner_state
  assert ft.global_state(donor).opt_state.inner_state is None
  engine.run(1)
  assert [int(parts(engine.replicas[i], optax.ScaleByScheduleState)[0].count)
          for i in (0, 1)] == [4 * H, 4 * H]


def test_a_checkpoint_restores_as_a_heal_newest_finished_first(tmp_path):
  """A replica restored from a checkpoint holds the writer's global state and inner state bit
  for bit (params = anchor, adam's moments and count the writer's), from the newest checkpoint whose JSON was written; a
  checkpoint of other settings or with a flipped byte is refused naming its path."""
  protocol = ft.RoundProtocol("diloco", optax.adam(optax.linear_schedule(0.1, 0.01, 100)),
                              _outer(), sync_period=H)
  engine = ft.InProcessEngine(protocol, _params(), _grad, _batch, num_replicas=2)
  fresh = protocol.init(_params())
  assert checkpoints.restore(tmp_path, protocol, fresh, _params(), 7) is None
  writer = checkpoints.CheckpointWriter(tmp_path, 3, fingerprint=7)
  assert [writer.due(step, H) for step in (2, 4, 6, 8)] == [False, True, True, False]
  assert writer.due(8, H, last=True)
  written = {}
  for _ in range(2):
    engine.run(1)
    replica = engine.replicas[0]
    step = int(replica.opt_state.local_step)
    writer.write(ft.heal_state(replica), step=step, rounds=int(replica.rounds), time=float(step))
    written[step] = replica
  writer.close()
  (tmp_path / "step_6.heal").write_bytes(b"unfinished: no step_6.json beside it")
  assert [(m["step"], m["rounds"], m["fingerprint"]) for m in checkpoints.saved(tmp_path)] == [
    (2, 1, 7), (4, 2, 7)]
  restored, meta = checkpoints.restore(tmp_path, protocol, fresh, _params(), 7)
  assert meta["step"] == 4
  _assert_trees_equal(ft.heal_state(restored), ft.heal_state(written[4]))
  _assert_trees_equal(restored.params, written[4].opt_state.anchor)
  (adam,) = [x for x in jax.tree.leaves(restored.opt_state.inner_state,
                                        is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(x, optax.ScaleByAdamState)]
  _assert_trees_equal(restored.opt_state.inner_state, written[4].opt_state.inner_state)
  assert int(adam.count) == 4
  with pytest.raises(ValueError, match=r"step_4.heal: written by a run of other settings"):
    checkpoints.restore(tmp_path, protocol, fresh, _params(), 8)
  payload = bytearray((tmp_path / "step_4.heal").read_bytes())
  payload[-1] ^= 1
  (tmp_path / "step_4.heal").write_bytes(bytes(payload))
  with pytest.raises(ValueError, match=r"step_4.heal.*hash is not the manifest's"):
    checkpoints.restore(tmp_path, protocol, fresh, _params(), 7)
  with pytest.raises(ValueError, match=r"`CheckpointWriter\(every=...\)`.*got 0"):
    checkpoints.CheckpointWriter(tmp_path, 0, fingerprint=7)


@pytest.mark.parametrize("algorithm, fmt, extra", [
  ("diloco", "int8_feedback", ()), ("streaming_diloco", "none", STREAMING),
  ("streaming_diloco", "none", OVERLAP), ("local_sgd", "none", ())])
def test_a_resume_rebuilds_each_replica_whole_from_its_local_checkpoint(algorithm, fmt, extra,
                                                                        tmp_path):
  """Each replica's local file beside the global checkpoint of the same round (params, inner
  state, error-feedback residual) rebuilds it bit for bit; the resume point is the newest
  checkpoint every member's file is there for; a replica without its own file there gets the
  donation alone (it heals); a replica keeps its newest LOCAL_KEPT files."""
  engine = _engine(algorithm, fmt, extra, num_replicas=2)
  fresh = _protocol(algorithm, fmt, extra).init(_params())
  writer = checkpoints.CheckpointWriter(tmp_path, H, fingerprint=7)
  written = []
  for _ in range(3):
    engine.run(1)
    step, rounds = int(engine.replicas[0].opt_state.local_step), int(engine.replicas[0].rounds)
    for i in (0, 1):
      writer.write_local(engine.replicas[i], step=step, slot=i)
    writer.write(ft.heal_state(engine.replicas[0]), step=step, rounds=rounds, time=0.0,
                 members=(0, 1))
    written.append((step, [engine.replicas[i] for i in (0, 1)]))
  writer.close()
  assert sorted(p.name for p in tmp_path.glob("*.local")) == [
    f"step_{step}.replica_{i}.local" for step, _ in written[1:] for i in (0, 1)]
  if dict(extra).get("overlap"):  # fragments in flight at each checkpoint (both at 4 and 6)
    assert [w[0].opt_state.in_flight_step.tolist() for _, w in written] == [[2, 0], [2, 4],
                                                                            [6, 4]]
  if fmt == "int8_feedback":  # a residual that is not zero: a heal would drop it
    assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(
      engine.replicas[1].opt_state.error_feedback))

  def resumed(slot):
    donation, own = checkpoints.resume(tmp_path, fresh, ft.heal_state(fresh), slot, 7)
    return donation, own if own is None else ft.heal.resumed_state(donation.global_state, own)

  for i in (0, 1):
    _assert_trees_equal(resumed(i)[1], written[2][1][i])
  checkpoints.local_path(tmp_path, written[2][0], 1).unlink()  # killed before it wrote it
  assert checkpoints.resume_point(tmp_path)["step"] == written[1][0]
  for i in (0, 1):
    _assert_trees_equal(resumed(i)[1], written[1][1][i])
  checkpoints.local_path(tmp_path, written[1][0], 1).unlink()
  assert checkpoints.resume_point(tmp_path) is None  # then the newest: replica 1 heals
  (donation, own), (_, whole) = resumed(1), resumed(0)
  assert own is None and int(donation.global_state.rounds) == 3
  _assert_trees_equal(whole, written[2][1][0])
  with pytest.raises(ValueError, match=r"local state is of round 3, the global state of round 2"):
    ft.heal.resumed_state(ft.global_state(written[1][1][0]), ft.heal.local_part(whole))
  other = checkpoints.CheckpointWriter(tmp_path, H, fingerprint=8)
  other.write_local(written[2][1][1], step=written[2][0], slot=1)
  other.close()
  with pytest.raises(ValueError, match=r"replica_1.local.* is of another run \(fingerprint 8\)"):
    resumed(1)


def test_a_checkpoint_written_before_the_loop_donates_its_arrays_holds_their_values(tmp_path):
  """The writer's thread runs after the loop's next step has donated (deleted) the arrays it was
  given: it writes the values they held (its own copies), global and local."""
  engine = _engine("diloco", "none", (), num_replicas=1)
  engine.run(1)
  replica = engine.replicas[0]
  kept = jax.tree.map(np.array, replica)
  writer = checkpoints.CheckpointWriter(tmp_path, H, fingerprint=7)
  started = threading.Event()
  writer._pool.submit(started.wait)  # the thread is busy until the arrays are gone
  writer.write(ft.heal_state(replica), step=H, rounds=1, time=0.0, members=(0,))
  writer.write_local(replica, step=H, slot=0)
  for x in jax.tree.leaves(replica):
    if isinstance(x, jax.Array):
      x.delete()
  started.set()
  writer.close()
  fresh = _protocol("diloco", "none", ()).init(_params())
  donation, own = checkpoints.resume(tmp_path, fresh, ft.heal_state(fresh), 0, 7)
  _assert_trees_equal(ft.heal.resumed_state(donation.global_state, own), kept)


def test_state_hash_sees_every_bit_dtype_shape_and_structure():
  tree = {"x": jnp.arange(4.0), "n": jnp.int32(3)}
  h = ft.state_hash(tree)
  assert h == ft.state_hash({"x": jnp.arange(4.0), "n": jnp.int32(3)})
  flipped = np.asarray(tree["x"]).copy()
  flipped.view(np.uint32)[2] ^= 1
  for other in ({"x": jnp.asarray(flipped), "n": jnp.int32(3)},
                {"x": jnp.asarray(np.arange(4.0, dtype=np.float32).view(np.int32)),
                 "n": jnp.int32(3)},  # the same bytes, another dtype
                {"x": jnp.arange(4.0).reshape(2, 2), "n": jnp.int32(3)},  # another shape
                {"y": jnp.arange(4.0), "n": jnp.int32(3)}):
    assert ft.state_hash(other) != h


@pytest.fixture(scope="module")
def healed_state():
  engine = _engine(fmt="int8_feedback", num_replicas=2)
  engine.run(1)
  return ft.global_state(engine.replicas[0])


def test_heal_payload_round_trips(healed_state):
  blob = ft.encode_heal(healed_state)
  assert isinstance(blob, bytes) and blob.startswith(ft.MAGIC)
  _assert_trees_equal(ft.decode_heal(blob, healed_state, replica="1"), healed_state)


def test_heal_payload_of_the_wrong_shape_names_replica_and_leaf(healed_state):
  wider = ft.global_state(
    _protocol("diloco", "int8_feedback").init(
      {"a": jnp.zeros((4, 3)), "b": jnp.zeros(6)}))
  with pytest.raises(ValueError, match=r"replica '7': leaf \.opt_state\.anchor\['b'\] has dtype"
                     r" 'float32' and shape \[5\], expected 'float32' and \[6\]"):
    ft.decode_heal(ft.encode_heal(healed_state), wider, replica="7")
  as_bf16 = jax.tree.map(
    lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, healed_state)
  with pytest.raises(ValueError, match=r"replica '7': leaf \.opt_state\.anchor\['a'\] has dtype"
                     r" 'float32' and shape \[4, 3\], expected 'bfloat16'"):
    ft.decode_heal(ft.encode_heal(healed_state), as_bf16, replica="7")


def test_heal_payload_corrupted_or_truncated_is_refused(healed_state):
  blob = bytearray(ft.encode_heal(healed_state))
  blob[-1] ^= 1
  with pytest.raises(ValueError, match="replica '2'.*hash"):
    ft.decode_heal(bytes(blob), healed_state, replica="2")
  with pytest.raises(ValueError, match="replica '2' holds .* bytes of data"):
    ft.decode_heal(bytes(blob[:-4]), healed_state, replica="2")
  with pytest.raises(TypeError, match="replica '2' must be bytes"):
    ft.decode_heal(healed_state, healed_state, replica="2")


def test_heal_payload_of_another_run_is_refused_unread_naming_both_fingerprints(healed_state):
  """The manifest names the donor's run; a receiver of another run, or given a payload that
  names none, refuses it before reading its data (here truncated: the fingerprint is told, not
  the length). Without ``fingerprint`` (a checkpoint, whose JSON names it) none is checked."""
  blob = ft.encode_heal(healed_state, fingerprint=-9)
  _assert_trees_equal(ft.decode_heal(blob, healed_state, replica="1", fingerprint=-9),
                      healed_state)
  _assert_trees_equal(ft.decode_heal(blob, healed_state, replica="1"), healed_state)
  with pytest.raises(ValueError, match=r"^heal payload from replica '4' is of another run"
                     r" \(fingerprint -9\), this run's fingerprint is 7: refused unread"):
    ft.decode_heal(blob[:-4], healed_state, replica="4", fingerprint=7)
  with pytest.raises(ValueError, match=r"^heal payload from replica '4' names no run, this"
                     r" run's fingerprint is 7: refused unread"):
    ft.decode_heal(ft.encode_heal(healed_state), healed_state, replica="4", fingerprint=7)
  named_true = ft.encode_heal(healed_state, fingerprint=1000).replace(b":1000,", b":true,")
  with pytest.raises(ValueError, match=r"is of another run \(fingerprint True\)"):
    ft.decode_heal(named_true, healed_state, replica="4", fingerprint=1)  # JSON's true is not 1




def test_pickle_payload_is_refused_and_runs_nothing(healed_state):
  blob = pickle.dumps(PicklePayload())
  pickle.loads(blob)  # the payload is live: unpickling it runs code
  assert PicklePayload.RAN == ["unpickled"]
  PicklePayload.RAN.clear()
  with pytest.raises(ValueError, match="replica '3' does not start with"):
    ft.decode_heal(blob, healed_state, replica="3")
  header = ft.MAGIC + len(blob).to_bytes(8, "big") + blob  # a pickle where the manifest goes
  with pytest.raises(ValueError, match="replica '3': the manifest is not JSON"):
    ft.decode_heal(header, healed_state, replica="3")
  assert PicklePayload.RAN == []


# ------------------------------------------------------------------------------------------------
# Bad input.


def test_bad_input():
  with pytest.raises(ValueError, match=r"RoundProtocol\(algorithm=...\).*'elastic_average'"):
    ft.RoundProtocol("elastic_average", _inner())
  with pytest.raises(ValueError, match=r"RoundProtocol\(num_fragments=...\)` must be at most"
                     r" sync_period=2"):
    ft.RoundProtocol("streaming_diloco", _inner(), sync_period=2, num_fragments=3)
  with pytest.raises(ValueError, match=r"are streaming_diloco's, got num_fragments=2"):
    ft.RoundProtocol("diloco", _inner(), sync_period=2, num_fragments=2)
  with pytest.raises(ValueError, match=r"are streaming_diloco's, got .*, overlap=1 for diloco"):
    ft.RoundProtocol("diloco", _inner(), sync_period=2, overlap=1)
  with pytest.raises(ValueError, match=r"`streaming_diloco\(overlap=...\)` must be an int in"
                     r" \[0, sync_period\) = \[0, 4\) .*, got 4\.$"):
    ft.RoundProtocol("streaming_diloco", _inner(), sync_period=4, num_fragments=2, overlap=4)
  with pytest.raises(ValueError, match=r"RoundProtocol\(outer=...\)"):
    ft.RoundProtocol("local_sgd", _inner(), _outer(), sync_period=2)
  with pytest.raises(ValueError, match=r"Fault\(kind=...\)"):
    ft.Fault(0, 0, "explode")
  with pytest.raises(ValueError, match=r"Fault\(round=...\)` must be an int >= 0, got -1"):
    ft.Fault(-1, 0, "join")
  with pytest.raises(ValueError, match=r"Engine\(min_replicas=...\)` must be at most num_rep"):
    _engine(num_replicas=2, min_replicas=3)
  with pytest.raises(ValueError, match="names replica 2, but there are 2"):
    _engine(num_replicas=2, faults=[ft.Fault(0, 2, "join")])
  with pytest.raises(ValueError, match="replica 1 is alive"):
    _engine(num_replicas=2, faults=[ft.Fault(0, 1, "join")]).run(1)


# ------------------------------------------------------------------------------------------------
# The ft extra: only the torchft engine imports torch.


def test_core_does_not_import_torch():
  code = ("import sys, optax_dist, optax_dist.fault_tolerance;"
          " print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchft')))")
  env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parent.parent))
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        check=True)
  assert done.stdout.strip() == "[]"


def test_replica_without_the_ft_extra_says_so_in_one_line(monkeypatch):
  from optax_dist.fault_tolerance import replica

  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ModuleNotFoundError
  for module in ("torchft_engine", "torchft_session"):  # imported by another test
    monkeypatch.delitem(sys.modules, f"optax_dist.fault_tolerance.{module}", raising=False)
    monkeypatch.delattr(ft, module, raising=False)
  with pytest.raises(replica.ReplicaError) as info:
    replica.load_engine()
  said = str(info.value)
  assert "\n" not in said and "no module named 'torch'" in said
  assert 'pip install "optax-dist[ft]"' in said


# ------------------------------------------------------------------------------------------------
# A run's launch configuration and its directory read back.


def test_launch_config_fills_in_the_majority_and_refuses_bad_values(tmp_path):
  from optax_dist.fault_tolerance.launcher import JOIN_TIMEOUT_S, LaunchConfig

  config = LaunchConfig(replicas=4, out=tmp_path, replica_command=["-m", "x"],
                        replica_args=["--steps", "8"])
  assert (config.min_replicas, config.out, config.replica_command) == (3, str(tmp_path),
                                                                       ("-m", "x"))
  assert config.replica_args == ("--steps", "8") and config.join_timeout == JOIN_TIMEOUT_S
  base = {"replicas": 2, "out": str(tmp_path), "replica_command": ("-m", "x")}
  for changed, error, said in (
      ({"replicas": 0}, ValueError, r"`LaunchConfig\(replicas=...\)` must be a positive int,"
       " got 0"),
      ({"min_replicas": 3}, ValueError, r"`LaunchConfig\(min_replicas=...\)` must be in \[1,"
       r" replicas=2\], got 3"),
      ({"restart_delay": -1.0}, ValueError, r"`LaunchConfig\(restart_delay=...\)` must be a"
       r" number of seconds >= 0, got -1.0"),
      ({"exchange_timeout": 0}, ValueError, r"`LaunchConfig\(exchange_timeout=...\)` must be a"
       " positive number of seconds, got 0"),
      ({"max_restarts": 1.5}, TypeError, r"`LaunchConfig\(max_restarts=...\)` must be an int"),
      ({"host": "0.0.0.0"}, ValueError, r"`LaunchConfig\(host=...\)` must be a specific"
       " address, got '0.0.0.0'"),
      ({"replica_netns": "chaos"}, ValueError, r"`LaunchConfig\(replica_netns=...\)` must hold"
       r" \{i\} \(one namespace per replica\), got 'chaos'"),
      ({"replica_netns": "no-such-netns-{i}"}, ValueError, r"`LaunchConfig\(replica_netns=...\)`"
       " must name existing network namespaces .*: no no-such-netns-0"),
      ({"replica_command": ()}, ValueError, r"`LaunchConfig\(replica_command=...\)`")):
    with pytest.raises(error, match=said):
      LaunchConfig(**base | changed)


@pytest.mark.parametrize("host, said", [
  ("0", "got '0' (it resolves to 0.0.0.0: every interface)"), ("0.0.0.0", "got '0.0.0.0'"),
  ("::", "got '::'"), ("[::]", "got '[::]'"), ("::ffff:0.0.0.0", "got '::ffff:0.0.0.0'"),
  ("", "got ''")])
def test_launch_config_refuses_a_host_that_binds_every_interface(tmp_path, host, said):
  import re

  from optax_dist.fault_tolerance.launcher import LaunchConfig

  with pytest.raises(ValueError, match="^" + re.escape(
      f"`LaunchConfig(host=...)` must be a specific address, {said}.") + "$"):
    LaunchConfig(replicas=1, out=tmp_path, replica_command=("-m", "x"), host=host)


def test_launch_config_resolves_its_host_once_to_the_address_its_urls_carry(tmp_path):
  import socket

  from optax_dist.fault_tolerance.launcher import LaunchConfig, url_host

  def host(given):
    return LaunchConfig(replicas=1, out=tmp_path, replica_command=("-m", "x"), host=given).host

  assert host("localhost") == socket.getaddrinfo("localhost", None)[0][4][0]
  assert (host("127.0.0.1"), host("::1"), host("[::1]")) == ("127.0.0.1", "::1", "::1")
  assert (url_host("127.0.0.1"), url_host("::1")) == ("127.0.0.1", "[::1]")
  with pytest.raises(ValueError, match=r"`LaunchConfig\(host=...\)` must be an address or a name"
                     " that resolves, got 'no-such-host.invalid'"):
    host("no-such-host.invalid")


def test_run_dir_reads_the_lines_finals_pids_and_checkpoints_it_clears(tmp_path):
  from optax_dist.fault_tolerance.rundir import RunDir

  run = RunDir(tmp_path / "run")
  assert (run.lines(), run.final(), run.first_commit(), run.lighthouse_pid()) == ([], {}, None,
                                                                                   None)
  run.replicas.mkdir(parents=True)
  line = {"round": 0, "committed": True, "healed": False, "state_hash": "a",
          "quorum_seconds": 0.1, "time": 12.0}
  rows = {0: [line, {**line, "round": 1, "time": 14.0}],
          1: [{**line, "time": 11.0, "committed": False},
              {**line, "round": 1, "time": 13.0, "healed": True, "quorum_seconds": 0.5}],
          2: [{**line, "round": 1, "time": 15.0, "state_hash": "b"}]}  # a foreign id
  for i, lines in rows.items():
    run.lines_file(i).write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n")
  run.final_file(1).write_text('{"test_accuracy": 0.5}')
  run.lighthouse_pid_file.write_text("123\n")
  run.pid_file(0).write_text("77\n")
  assert [x["time"] for x in run.lines()] == [11.0, 12.0, 13.0, 14.0, 15.0]
  assert run.lines(1) == rows[1] and run.first_commit() == 12.0
  assert (run.lighthouse_pid(), run.replica_pid(0), run.replica_pid(1)) == (123, 77, None)
  assert run.finished() and run.final() == {1: {"test_accuracy": 0.5}}
  assert run.summary(2, restarts=1) == {
    "rounds_committed": 2, "rounds_aborted": 0, "restarts": 1, "heals": 1, "heal_seconds": [0.5],
    "hashes_agree": True, "finished": [1], "final": {1: {"test_accuracy": 0.5}}}
  assert not run.summary(3, restarts=0)["hashes_agree"]  # replica 2 committed round 1 apart
  run.launches_file.write_text('{"time": 10.0}\n{"time": 14.5}\n')  # a --resume at 14.5
  redone = run.summary(3, restarts=0)  # replica 2's round 1 is the resumed launch's
  assert redone["hashes_agree"] and redone["rounds_committed"] == 2
  assert run.checkpoints() == []
  run.clear()
  assert run.lines() == [] and not run.finished() and run.lighthouse_pid() == 123
  assert not run.launches_file.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux thread name")
def test_an_exchange_thread_s_name_is_the_one_linux_shows_its_first_15_bytes():
  """``top -H``, ``ps -L`` and a cgroup's thread placement read ``/proc/PID/task/TID/comm``,
  which Python 3.11 leaves at the process's name for every thread it starts."""
  from optax_dist.fault_tolerance.lighthouse import name_thread

  def comm():
    return pathlib.Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

  got = {}

  def run():
    got["before"] = comm()
    name_thread("optax_dist-poll, and more")
    got["after"] = comm()

  thread = threading.Thread(target=run)
  thread.start()
  thread.join()
  assert got["before"] == comm() and got["after"] == "optax_dist-poll"
