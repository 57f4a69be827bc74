"""Decoupled rounds on the in-process engine: replicas of different speeds on a simulated clock.

The synchronous engine is the reference for K = R, an infinite window and equal speeds; a
hand-made schedule (speeds 1 : 1 : 0.5 : 0.25) is checked against a NumPy reference of the
merge; a run with an abort and an age gate is replayed from its JSON lines and its tokens are
accounted for.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import math
import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import tree_batch, tree_params

import optax_dist
from optax_dist import fault_tolerance as ft
from optax_dist.fault_tolerance import decoupled, halves, heal
from optax_dist.fault_tolerance.decoupled import MergeLine, Revert

H = 2
SPEEDS = (1.0, 1.0, 0.5, 0.25)


def _loop(protocol, steps, pause=None, record=None):
  """A user's loop (a jitted step that donates params and state); returns its state, the
  decoupled global hash after each of its boundaries, and its replica. ``pause(slot, step)``:
  seconds it sleeps before the step (real time, not the simulated clock's); ``record(replica)``
  is called after each boundary."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch):
    grads = jax.tree.map(jnp.subtract, params, batch)  # of 0.5 |params - batch|^2
    updates, opt_state = protocol.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def train(replica):
    params = tree_params()
    state = replica.start((params, protocol.tx.init(params)))
    hashes = []
    while replica.step < steps:
      if pause is not None:
        time.sleep(pause(replica.slot, replica.step))
      state = replica.after_step(train_step(*state, tree_batch(replica.seed, replica.slot,
                                                           replica.step)))
      if replica.step % H == 0:
        hashes.append(decoupled.global_hash(replica.replica_state))
        if record is not None:
          record(replica)
    return state, hashes, replica

  return train


def _leaves_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------------------------------------
# K = R, an infinite window, equal speeds: the synchronous engine.


@pytest.mark.parametrize("case", ["diloco_int8_feedback", "local_sgd", "streaming_feedback"])
def test_k_equal_to_r_with_an_infinite_window_is_the_synchronous_engine(case):
  """Every round closes when all three payloads are in and each replica lands at its own
  boundary: params, optimizer states and the global hash after every round bit for bit the
  synchronous engine's; one hash per round across replicas (E1), the MergeLine's (streaming:
  the fragments in the synchronous schedule's order, by the committed-round counter)."""
  if case == "local_sgd":
    protocol = ft.RoundProtocol("local_sgd", optax.sgd(0.5, momentum=0.5), sync_period=H)
  elif case == "streaming_feedback":
    protocol = ft.RoundProtocol("streaming_diloco", optax.sgd(0.5, momentum=0.5),
                                optax.sgd(1.0, momentum=0.5, nesterov=True), sync_period=2 * H,
                                num_fragments=2, comm_dtype="int8", comm_block_size=4,
                                error_feedback=True)
  else:
    protocol = ft.RoundProtocol("diloco", optax.sgd(0.5, momentum=0.5),
                                optax.sgd(1.0, momentum=0.5, nesterov=True), sync_period=H,
                                comm_dtype="int8", comm_block_size=4, error_feedback=True)
  rounds = 3
  sync = ft.InProcess(protocol, num_replicas=3).run(_loop(protocol, rounds * H))
  # token_share: the mean of R payloads of equal tokens, bit for bit
  rule = "token_share" if case == "streaming_feedback" else decoupled.DEFAULT_STALENESS_RULE
  engine = ft.InProcess(protocol, num_replicas=3, speeds=(1.0,) * 3, staleness_rule=rule)
  got = engine.run(_loop(protocol, rounds * H))
  assert [line.round for line in engine.log] == list(range(rounds))
  assert [line.fragment for line in engine.log] == [
    protocol.fragment(H * (r + 1)) for r in range(rounds)]
  assert all(line.committed and len(line.payloads) == 3 for line in engine.log)
  for i in range(3):
    _leaves_equal(got[i][0], sync[i][0])
    assert got[i][1] == sync[i][1] == [line.state_hash for line in engine.log]


# ------------------------------------------------------------------------------------------------
# A hand-made schedule against a NumPy reference.

# Speeds 1 : 1 : 0.5 : 0.25, H = 2, K = 2, W = 1, 8 inner steps each, 3 tokens a step: replica
# i's boundary at local_step b comes at b / v_i. At one time the settles come first (each
# replica's push follows its own), then the pulls. At its settle a replica whose payload was
# merged after it went on lands late (x <- anchor + (x - x_b), x_b its params at that push);
# one that missed rounds moves onto the new anchor with its own steps kept (x <- anchor +
# (x - its anchor)); one whose payload is still in the open round pushes nothing ("skip"). A
# pull lands it if the round holding its payload closed at that time ("land"); a payload's
# staleness counts the rounds since its replica's last pull.
SCHEDULE = [
  ("push", 0, 2), ("push", 1, 2), ("pull", 0), ("pull", 1),  # t=2: 2 in, the window to t=3
  ("close",),  # t=3: round 0 = {0@2, 1@2}
  ("push", 0, 4), ("push", 1, 4), ("push", 2, 2), ("pull", 0), ("pull", 1), ("pull", 2),
  ("close",),  # t=5: round 1 = {0@4, 1@4, 2@2}, all stale by round 0
  ("push", 0, 6), ("push", 1, 6), ("pull", 0), ("pull", 1),
  ("close",),  # t=7: round 2
  ("push", 0, 8), ("push", 1, 8), ("push", 2, 4), ("push", 3, 2),
  ("close",),  # t=8: every live payload in; replica 3's stale by rounds 0-2
  ("land", 0), ("land", 1), ("land", 2), ("land", 3),  # replicas 0 and 1 are done
  ("push", 2, 6), ("pull", 2),  # t=12: alone in the open round, K=2
  ("skip", 2, 8), ("push", 3, 4),  # t=16: replica 2's payload still in flight, its last steps
  ("close",), ("land", 3),  # unsent; the round closes with every live one in
  ("push", 3, 6), ("close",), ("land", 3),  # t=24, t=32: replica 3 alone (every live one)
  ("push", 3, 8), ("close",), ("land", 3),
]
CLOSES = [3.0, 5.0, 7.0, 8.0, 16.0, 24.0, 32.0]
ROWS = [  # (replica, step, tokens, staleness) of each round
  [(0, 2, 6, 0), (1, 2, 6, 0)],
  [(0, 4, 6, 1), (1, 4, 6, 1), (2, 2, 6, 1)],
  [(0, 6, 6, 1), (1, 6, 6, 1)],
  [(0, 8, 6, 1), (1, 8, 6, 1), (2, 4, 6, 2), (3, 2, 6, 3)],
  [(2, 6, 6, 0), (3, 4, 6, 0)],
  [(3, 6, 6, 0)],
  [(3, 8, 6, 0)],
]
INNER_LR, OUTER_LR, TOKENS = 0.5, 0.7, 3


def _reference(rule):
  """The schedule in float64 NumPy: inner SGD on 0.5 |x - batch|^2, pseudo-gradients
  anchor - x, the outer SGD step on their merge: ``"dylu"``: the mean weighted by T / (1 + s);
  ``"token_share"``: sum_i T_i delta_i / (R max_j T_j)."""
  def host(tree):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]

  def moved(i, ref):  # x_i onto the anchor, its steps since ref kept
    x[i] = [a + (p - r) for a, p, r in zip(anchor, x[i], ref, strict=True)]
    held[i] = (list(anchor), version)

  x = {i: host(tree_params()) for i in range(4)}
  anchor, version = host(tree_params()), 0
  held = {i: (list(anchor), 0) for i in range(4)}  # the anchor its params are on, its version
  seen = dict.fromkeys(range(4), 0)  # the version at its last pull
  step, sent, pending, late, rows = dict.fromkeys(range(4), 0), dict.fromkeys(range(4), 0), {}, {}, []
  for event in SCHEDULE:
    if event[0] in ("push", "skip"):
      _, i, b = event
      for t in range(step[i], b):
        x[i] = [p - INNER_LR * (p - d) for p, d in zip(x[i], host(tree_batch(0, i, t)), strict=True)]
      step[i] = b
      if event[0] == "skip":
        continue
      if i in late:
        moved(i, late.pop(i))
      elif held[i][1] != version:
        moved(i, held[i][0])
      delta = [a - p for a, p in zip(anchor, x[i], strict=True)]
      pending[i] = (delta, TOKENS * (b - sent[i]), seen[i], b, list(x[i]))
      sent[i] = b
    elif event[0] == "close":
      entries = [pending[i] for i in sorted(pending)]
      weights = [t / (1 + version - v) if rule == "dylu" else t for _, t, v, _, _ in entries]
      total = sum(weights) if rule == "dylu" else 4 * max(weights)
      mean = [sum(w * d[k] for w, (d, *_) in zip(weights, entries, strict=True)) / total
              for k in range(len(anchor))]
      anchor = [a - OUTER_LR * m for a, m in zip(anchor, mean, strict=True)]
      rows.append([(i, b, t, version - v) for i, (_, t, v, b, _) in sorted(pending.items())])
      late.update({i: xb for i, (*_, xb) in pending.items()})
      version, pending = version + 1, {}
    else:
      _, i = event
      seen[i] = version
      if event[0] == "land":
        x[i], held[i] = list(anchor), (list(anchor), version)
        late.pop(i)
  return x, anchor, rows


@functools.cache
def _hand_run(rule="dylu"):
  protocol = ft.RoundProtocol("diloco", optax.sgd(INNER_LR), optax.sgd(OUTER_LR), sync_period=H)
  engine = ft.InProcess(protocol, num_replicas=4, speeds=SPEEDS, min_quorum=2, grace_window=1.0,
                        staleness_rule=rule, tokens_per_step=TOKENS)
  return engine, engine.run(_loop(protocol, 4 * H))


@pytest.mark.parametrize("rule", ["dylu", "token_share"])
def test_token_weights_and_staleness_match_a_numpy_reference_of_a_hand_made_schedule(rule):
  """The rounds close when the hand schedule says, with the payloads, tokens and staleness it
  says (and the reference computes); weights T / (1 + s) (``"token_share"``: T, the merge over
  R times the largest); each replica's params and anchor are the reference's; each
  replica ends on the hash of the last global state it took."""
  engine, results = _hand_run(rule)
  x, anchor, rows = _reference(rule)
  assert rows == ROWS
  merges = [line for line in engine.log if isinstance(line, MergeLine)]
  assert [line.time for line in merges] == CLOSES
  assert [[row[:4] for row in line.payloads] for line in merges] == ROWS
  # replica 2's loop returned after skipping its boundary at step 8 (t = 16): steps 6-8 unsent
  assert [x for x in engine.log if not isinstance(x, MergeLine)] == [
    decoupled.Unsent(4, 2, 8, 2 * TOKENS)]
  for line in merges:
    assert line.committed and line.lost == 0 and all(row[5] for row in line.payloads)
    for _, _, tokens, stale, weight, _ in line.payloads:
      assert weight == pytest.approx(tokens / (1 + stale) if rule == "dylu" else tokens)
  assert heal.state_hash(engine.state[0]) == merges[-1].state_hash  # after every loop
  for i, (state, _, replica) in results.items():
    params, opt_state = state
    for got, want in zip(jax.tree.leaves(params), x[i], strict=True):
      np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    last = {0: 3, 1: 3, 2: 3, 3: 6}[i]
    assert replica.state_hash() == merges[last].state_hash
    if i == 3:
      for got, want in zip(jax.tree.leaves(opt_state.anchor), anchor, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_the_schedule_does_not_depend_on_the_threads_timing():
  """The hand-made run again with the fast replicas' threads slowed down in real time (random
  pauses, the slowest replica's not): the same lines, hashes included."""
  engine, _ = _hand_run()
  protocol = ft.RoundProtocol("diloco", optax.sgd(INNER_LR), optax.sgd(OUTER_LR), sync_period=H)
  again = ft.InProcess(protocol, num_replicas=4, speeds=SPEEDS, min_quorum=2, grace_window=1.0,
                       staleness_rule="dylu", tokens_per_step=TOKENS)
  jitter = random.Random(0)
  again.run(_loop(protocol, 4 * H, pause=lambda slot, step: 0.01 * jitter.random() * (slot < 2)))
  assert again.log == engine.log


def test_a_replica_compiles_no_round_program_once_it_has_started(monkeypatch):
  """Every program of a round (the merges of 1 to R payloads, equal weights or not, a
  catch-up's and a late landing's rebase, the outer step) is compiled by the replicas' warm-up,
  before they join: a K = 1 run at speeds 1 : 1 : 0.5 : 0.25 (merges of one to four payloads,
  catch-ups, late landings) compiles nothing once every replica has started but its loop's own
  step and the copies of single leaves. Its params' shapes are no other test's, so no program
  of theirs is in the cache."""
  protocol = ft.RoundProtocol("diloco", optax.sgd(INNER_LR), optax.sgd(OUTER_LR), sync_period=H)
  engine = ft.InProcess(protocol, num_replicas=4, speeds=SPEEDS, min_quorum=1, grace_window=1.0,
                        staleness_rule="dylu", tokens_per_step=TOKENS)
  joined, compiled, rebases = threading.Event(), set(), collections.Counter()
  started, rebased = threading.Barrier(4, action=joined.set), decoupled.rebased

  class Compiles(logging.Handler):
    def emit(self, record):
      message = record.getMessage()
      if joined.is_set() and message.startswith("Finished XLA compilation"):
        compiled.add(message.split()[4])

  def spy(protocol, replica, received, flight=None, fragment=None):
    rebases["late" if flight else "catch-up"] += joined.is_set()
    return rebased(protocol, replica, received, flight, fragment)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, step):
    grads = jax.tree.map(lambda p: p - jnp.sin(step + p.size), params)
    updates, opt_state = protocol.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def train(replica):
    params = {"w": jnp.full((7, 11), 0.1 * replica.slot, jnp.float32), "v": jnp.zeros(13)}
    state = replica.start((params, protocol.tx.init(params)))
    started.wait()
    while replica.step < 8 * H:
      state = replica.after_step(train_step(*state, float(replica.step)))

  monkeypatch.setattr(decoupled, "rebased", spy)
  handler = Compiles()
  logging.getLogger("jax").addHandler(handler)
  jax.config.update("jax_log_compiles", True)  # on every thread (the context manager's: its own)
  try:
    engine.run(train)
  finally:
    jax.config.update("jax_log_compiles", False)
    logging.getLogger("jax").removeHandler(handler)
  assert {len(x.payloads) for x in engine.log if isinstance(x, MergeLine)} == {1, 2, 3, 4}
  assert rebases["late"] and rebases["catch-up"], rebases
  assert compiled <= {"jit(train_step)", "jit(copy)"}, compiled


def test_a_replica_settles_once_its_inner_steps_are_computed_not_dispatched():
  """JAX dispatches a loop's steps ahead of the device; a replica's settle at its boundary
  comes after its inner steps ran (its params computed), so it sees the rounds that closed
  while they ran (else it finds its payload in flight there, and skips its push)."""
  protocol = ft.RoundProtocol("diloco", optax.sgd(INNER_LR), optax.sgd(OUTER_LR), sync_period=H)
  engine = ft.InProcess(protocol, num_replicas=2, speeds=(1.0, 1.0), min_quorum=1,
                        grace_window=1.0, tokens_per_step=TOKENS)
  computed = []

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, slow):  # a step the device takes a while to run
    drift = jax.lax.fori_loop(0, 40, lambda _, m: jnp.tanh(m @ m), slow)
    grads = jax.tree.map(lambda p: p - drift[0, 0], params)
    updates, opt_state = protocol.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def train(replica):
    params = tree_params()
    state = replica.start((params, protocol.tx.init(params)))
    settle, latest = replica.engine.settle, []

    def spy(step):
      computed.append(all(x.is_ready() for x in jax.tree.leaves(latest[-1][0])))
      return settle(step)

    replica.engine.settle = spy
    slow = jnp.full((384, 384), 1e-3)
    while replica.step < 3 * H:
      latest.append(train_step(*state, slow))
      state = replica.after_step(latest[-1])

  engine.run(train)
  assert len(computed) == 6 and all(computed), computed


# ------------------------------------------------------------------------------------------------
# The auto window: gamma times the least slack.


def _windowed_log(**window):
  """The hand-made schedule's run (K = 2) with the grace window ``window`` gives; its log."""
  protocol = ft.RoundProtocol("diloco", optax.sgd(INNER_LR), optax.sgd(OUTER_LR), sync_period=H)
  engine = ft.InProcess(protocol, num_replicas=4, speeds=SPEEDS, min_quorum=2,
                        tokens_per_step=TOKENS, **window)
  engine.run(_loop(protocol, 4 * H))
  return engine.log


def test_the_auto_window_is_gamma_times_the_least_slack_of_the_speeds():
  """``grace_window="auto"``: W = gamma max(0, min_i xi_i), xi_i = c_i n_i - x_i, on the clock
  c_i = 1 / v_i, n_i = H and x_i = 0 (NumPy): the first round closes W after its second payload
  (at 2 s), and the run is the one of that fixed window (at gamma 0.5, W = 1 s: the hand-made
  run). The mean slack (4 s) or the largest (8 s) would close other rounds."""
  slacks = (1 / np.asarray(SPEEDS)) * H - 0.0
  assert decoupled.auto_window([decoupled.slack(1 / v, H, 0.0) for v in SPEEDS], 0.5) == (
    0.5 * slacks.min())
  assert decoupled.auto_window([-1.0, 3.0], 2.0) == 0.0 == decoupled.auto_window([], 2.0)
  for gamma in (0.5, 0.75):
    window = gamma * max(0.0, slacks.min())
    log = _windowed_log(grace_window="auto", grace_gamma=gamma)
    assert log[0].time == 2.0 + window
    assert log == (_hand_run()[0].log if gamma == 0.5 else _windowed_log(grace_window=window))


@pytest.mark.parametrize(("gamma", "window"), [(1e12, math.inf), (0.0, 0.0)])
def test_auto_with_a_huge_gamma_waits_for_every_payload_and_with_gamma_0_not_at_all(gamma,
                                                                                     window):
  """A huge gamma closes the rounds of W = inf, gamma 0 those of W = 0: the same lines."""
  assert _windowed_log(grace_window="auto", grace_gamma=gamma) == _windowed_log(
    grace_window=window)


# ------------------------------------------------------------------------------------------------
# Fragments: a hand-made schedule against a NumPy reference.

# streaming_diloco, sync period 4, F = 2 (leaf "a" fragment 0, "b" fragment 1): a boundary every
# 2 inner steps; round r's fragment is the schedule's on the committed-round counter (0, 1, 0,
# ...), not the one a replica's own step names. Speeds 1 : 0.25, K = 1, W = 0 (a round closes
# at its first arrival, before that time's pulls), 8 inner steps each, 3 tokens a step. At t=8
# replica 1 moves onto the anchor of rounds 0-2 (its own steps kept); its first payload (its
# step 2 names fragment 0) is of round 3's fragment 1, staleness 1 (fragment 1 committed once
# since its start); at t=16 its fragment-0 payload carries the
# tokens of 4 steps (it never sent fragment 0 before), at t=24 its fragment-1 payload those
# since its step 2.
FRAGMENT_SCHEDULE = [
  ("push", 0, 2), ("close",), ("land", 0), ("push", 0, 4), ("close",), ("land", 0),
  ("push", 0, 6), ("close",), ("land", 0),
  ("push", 0, 8), ("push", 1, 2), ("close",), ("land", 0), ("land", 1),
  ("push", 1, 4), ("close",), ("land", 1), ("push", 1, 6), ("close",), ("land", 1),
  ("push", 1, 8), ("close",), ("land", 1),
]
FRAGMENT_ROWS = [  # (replica, step, tokens, staleness) of each round; its fragment
  ([(0, 2, 6, 0)], 0), ([(0, 4, 12, 0)], 1), ([(0, 6, 12, 0)], 0),
  ([(0, 8, 12, 0), (1, 2, 6, 1)], 1), ([(1, 4, 12, 0)], 0), ([(1, 6, 12, 0)], 1),
  ([(1, 8, 12, 0)], 0),
]


def _fragment_reference():
  """The fragment schedule in float64 NumPy: inner SGD on 0.5 |x - batch|^2; at its push a
  replica that missed rounds moves onto the anchor, its own steps kept (x <- anchor + (x - the
  anchor it was on)); round r of fragment f = r % 2 merges f's pseudo-gradients anchor_f - x_f
  with the dylu weights T / (1 + s), T the tokens since the replica's last payload of f (or its
  start), s the updates of f since its last pull; the outer SGD step moves anchor_f; a landing
  replica's f leaf becomes the new anchor_f, its other leaf its own."""
  def host(tree):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]

  x = {i: host(tree_params()) for i in range(2)}
  anchor, versions, rows, pending = host(tree_params()), [0, 0], [], {}
  held = {i: (list(anchor), [0, 0]) for i in range(2)}  # the anchor its params are on, versions
  seen = {i: [0, 0] for i in range(2)}  # the versions at its last pull
  step, sent = dict.fromkeys(range(2), 0), {i: [0, 0] for i in range(2)}
  for event in FRAGMENT_SCHEDULE:
    f = len(rows) % 2
    if event[0] == "push":
      _, i, b = event
      for t in range(step[i], b):
        x[i] = [p - INNER_LR * (p - d) for p, d in zip(x[i], host(tree_batch(0, i, t)), strict=True)]
      step[i] = b
      if held[i][1] != versions:
        x[i] = [a + (p - h) for a, p, h in zip(anchor, x[i], held[i][0], strict=True)]
      pending[i] = (anchor[f] - x[i][f], TOKENS * (b - sent[i][f]), seen[i][f], b)
      sent[i][f] = b
    elif event[0] == "close":
      entries = [pending[i] for i in sorted(pending)]
      weights = [t / (1 + versions[f] - v) for _, t, v, _ in entries]
      mean = sum(w * d for w, (d, *_) in zip(weights, entries, strict=True)) / sum(weights)
      anchor[f] = anchor[f] - OUTER_LR * mean
      rows.append(([(i, b, t, versions[f] - v) for i, (_, t, v, b) in sorted(pending.items())],
                   f))
      versions[f], pending = versions[f] + 1, {}
    else:
      _, i = event
      landed = (len(rows) - 1) % 2  # the other fragment's leaf stays its own
      x[i][landed] = anchor[landed]
      held[i], seen[i] = (list(anchor), list(versions)), list(versions)
  return x, anchor, rows


def test_fragment_weights_and_staleness_match_a_numpy_reference_of_a_hand_made_schedule():
  """Each round's fragment, payloads, tokens (since the replica's last payload of that
  fragment) and staleness (of that fragment) are the reference's, the weights T / (1 + s), and
  both replicas' params and the anchor the reference's."""
  protocol = ft.RoundProtocol("streaming_diloco", optax.sgd(INNER_LR), optax.sgd(OUTER_LR),
                              sync_period=2 * H, num_fragments=2)
  engine = ft.InProcess(protocol, num_replicas=2, speeds=(1.0, 0.25), min_quorum=1,
                        grace_window=0.0, staleness_rule="dylu", tokens_per_step=TOKENS)
  results = engine.run(_loop(protocol, 4 * H))
  x, anchor, rows = _fragment_reference()
  assert rows == FRAGMENT_ROWS
  assert [([row[:4] for row in line.payloads], line.fragment) for line in engine.log] == rows
  assert [line.time for line in engine.log] == [2.0, 4.0, 6.0, 8.0, 16.0, 24.0, 32.0]
  for line in engine.log:
    assert line.committed and line.lost == 0
    for _, _, tokens, stale, weight, _ in line.payloads:
      assert weight == pytest.approx(tokens / (1 + stale))
  for i, ((params, opt_state), _, _) in results.items():
    for got, want in zip(jax.tree.leaves(params), x[i], strict=True):
      np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  for got, want in zip(jax.tree.leaves(results[1][0][1].anchor), anchor, strict=True):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_a_fragments_abort_reverts_that_fragment_only_and_its_fragment_comes_again():
  """Round 1 (fragment 1) aborts on a NaN: each member's fragment-1 leaf goes back to the
  anchor, its fragment-0 leaf stays its own; the schedule runs on the committed-round counter,
  so round 2 is fragment 1 again; the JSON lines replay bit for bit."""
  protocol = ft.RoundProtocol("streaming_diloco", optax.sgd(INNER_LR), optax.sgd(OUTER_LR),
                              sync_period=2 * H, num_fragments=2)
  settings = {"speeds": (1.0, 1.0), "faults": [ft.Fault(1, 0, "nonfinite")]}
  after = {}

  def record(replica):
    state = replica.replica_state
    after[replica.slot, replica.step] = jax.tree.map(
      np.asarray, (state.params, state.opt_state.anchor))

  engine = ft.InProcess(protocol, num_replicas=2, **settings)
  results = engine.run(_loop(protocol, 4 * H, record=record))
  assert [(line.fragment, line.committed) for line in engine.log] == [
    (0, True), (1, False), (1, True), (0, True)]
  for i in range(2):
    params, anchor = after[i, 2 * H]
    np.testing.assert_array_equal(params["b"], anchor["b"])
    assert not np.array_equal(params["a"], anchor["a"])
  lines = [json.loads(json.dumps(dataclasses.asdict(line))) for line in engine.log]
  again = ft.InProcess(protocol, num_replicas=2, replay=lines, speeds=(1.0, 1.0))
  replayed = again.run(_loop(protocol, 4 * H))
  assert again.log == engine.log
  for i in range(2):
    _leaves_equal(replayed[i][0], results[i][0])


# ------------------------------------------------------------------------------------------------
# An abort, an age gate, a replay.

FAULTY = {"speeds": SPEEDS, "min_quorum": 2, "grace_window": 0.5, "staleness_rule": "age_gate",
              "max_staleness": 1, "tokens_per_step": TOKENS}


@functools.cache
def _faulty_run():
  protocol = ft.RoundProtocol("diloco", optax.sgd(0.5, momentum=0.5),
                              optax.sgd(0.7, momentum=0.9, nesterov=True), sync_period=H)
  engine = ft.InProcess(protocol, num_replicas=4, faults=[ft.Fault(0, 0, "nonfinite")],
                        **FAULTY)
  return protocol, engine, engine.run(_loop(protocol, 6 * H))


def test_every_payload_enters_one_merge_or_is_counted_lost():
  """Round 0 aborts (a NaN) after its members pushed again: they revert and withdraw those
  payloads. Each payload is in exactly one line; a late payload (staleness >= 1) enters one
  merge; the age gate drops those staler than 1; every token up to a replica's last payload is
  in a merge or in a count of lost tokens."""
  _, engine, _ = _faulty_run()
  merges = [line for line in engine.log if isinstance(line, MergeLine)]
  reverts = [line for line in engine.log if isinstance(line, Revert)]
  assert not merges[0].committed and merges[0].lost == 12
  assert sorted((r.round, r.replica, r.step, r.lost) for r in reverts) == [
    (0, 0, 4, 6), (0, 1, 4, 6)]
  seen = [(row[0], row[1]) for line in merges for row in line.payloads]
  seen += [(r.replica, r.step) for r in reverts]
  assert len(seen) == len(set(seen))
  late = [row for line in merges if line.committed for row in line.payloads if row[3] >= 1]
  assert any(row[5] for row in late) and any(not row[5] for row in late)
  for line in merges:
    dropped = [row for row in line.payloads if not row[5]]
    assert line.lost == sum(row[2] for row in dropped)
    if line.committed:
      assert all(row[3] > FAULTY["max_staleness"] for row in dropped)
      assert all(row[4] == row[2] for row in line.payloads if row[5])
  for i in range(4):
    tokens = [row[2] for line in merges for row in line.payloads if row[0] == i]
    tokens += [r.lost for r in reverts if r.replica == i]
    last = max(step for j, step in seen if j == i)
    assert sum(tokens) == TOKENS * last, i


def test_a_payload_carries_its_replica_s_own_collections_not_the_global_ones_it_just_took(
    monkeypatch):
  """Model collections (a TrainState's ``batch_stats``; here a count of the steps that updated
  them): a replica's settle takes the global ones, and the payload it pushes right after holds
  the ones its own steps left, so at a push at step ``b`` they are those it last took at a step
  before ``b`` (or its initial zero) plus its steps since. Speeds 1 : 1 : 0.5, K = 1: payloads
  land late and settles take the global state right before pushes."""
  from flax.training import train_state

  from optax_dist.fault_tolerance import clock

  class State(train_state.TrainState):
    batch_stats: dict

  protocol = ft.RoundProtocol("diloco", optax.sgd(0.1), optax.sgd(0.7), sync_period=H)
  events = collections.defaultdict(list)  # slot -> ("take" | "push", step, count)
  settle, exchange = clock._Port.settle, clock._Port.exchange

  def seen(tree):
    return float(tree["seen"])

  def spied_settle(port, step):
    got = settle(port, step)
    if got is not None and (got.late or got.received is not None):
      events[port._slot].append(("take", step, seen(got.received[1])))
    return got

  def spied_exchange(port, push):
    events[port._slot].append(("push", push.header.step, seen(push.payload[1])))
    got = exchange(port, push)
    taken = got.landed[2] if got.landed is not None else (
      got.received[1] if got.received is not None else None)
    if taken is not None:
      events[port._slot].append(("take", push.header.step, seen(taken)))
    return got

  monkeypatch.setattr(clock._Port, "settle", spied_settle)
  monkeypatch.setattr(clock._Port, "exchange", spied_exchange)

  def train(replica):
    state = replica.start(State.create(apply_fn=None, params={"w": jnp.zeros(3)},
                                       tx=protocol.tx, batch_stats={"seen": jnp.zeros(())}))
    while replica.step < 12 * H:
      state = state.apply_gradients(grads={"w": state.params["w"] - 1.0})
      state = replica.after_step(state.replace(batch_stats={"seen": state.batch_stats["seen"]
                                                            + 1}))
    return state

  ft.InProcess(protocol, num_replicas=3, speeds=(1.0, 1.0, 0.5), min_quorum=1,
               grace_window=0.5).run(train)
  took_then_pushed = 0
  for slot, seq in events.items():
    taken = [(0, 0.0)]  # (step, count) of each take, in order
    for kind, step, count in seq:
      if kind == "take":
        taken.append((step, count))
        continue
      base_step, base = [t for t in taken if t[0] < step][-1]
      np.testing.assert_allclose(count, base + step - base_step, rtol=1e-6, err_msg=str(slot))
      took_then_pushed += taken[-1][0] == step
  assert took_then_pushed >= 3


def test_a_decoupled_run_replays_from_its_json_lines_bit_for_bit():
  """The JSON lines as the plan (the NaN not injected again: the abort is the log's): the
  same lines and the same params and optimizer states; a log it cannot follow raises."""
  protocol, engine, results = _faulty_run()
  lines = [json.loads(json.dumps(dataclasses.asdict(line))) for line in engine.log]
  again = ft.InProcess(protocol, num_replicas=4, replay=lines, **FAULTY)
  replayed = again.run(_loop(protocol, 6 * H))
  assert [dataclasses.asdict(line) for line in again.log] == [
    dataclasses.asdict(line) for line in engine.log]
  for i in range(4):
    _leaves_equal(replayed[i][0], results[i][0])
  broken = [dict(line, payloads=line["payloads"][:1]) if "payloads" in line else line
            for line in lines]
  with pytest.raises(RuntimeError, match="replay diverges from its log at round 0"):
    ft.InProcess(protocol, num_replicas=4, replay=broken, **FAULTY).run(_loop(protocol, 6 * H))


def test_boundary_lines_give_a_replay_its_boundaries_times_whatever_the_speeds():
  """A real run (the torchft engine) logs each boundary's time (``decoupled.Boundary``): the
  hand-made schedule's lines with its boundaries at ``step / speed`` replay at equal speeds to
  the same lines; without the boundaries, equal speeds do not follow the log."""
  engine, _ = _hand_run()
  protocol = engine.protocol
  bounds = [dataclasses.asdict(decoupled.Boundary(i, b, b / v, False))
            for i, v in enumerate(SPEEDS) for b in range(H, 4 * H + 1, H)]
  lines = [dataclasses.asdict(line) for line in engine.log]
  equal = {"num_replicas": 4, "speeds": (1.0,) * 4, "min_quorum": 2, "grace_window": 1.0,
           "tokens_per_step": TOKENS}
  again = ft.InProcess(protocol, replay=lines + bounds, **equal)
  again.run(_loop(protocol, 4 * H))
  replayed = [dataclasses.asdict(line) for line in again.log]
  # a loop's return is not a logged boundary: its Unsent line comes once the replay ends
  assert replayed == [x for x in lines if "committed" in x] + [
    x for x in lines if "committed" not in x]
  with pytest.raises(RuntimeError, match="replay diverges from its log"):
    ft.InProcess(protocol, replay=lines, **equal).run(_loop(protocol, 4 * H))


# ------------------------------------------------------------------------------------------------
# A death and a join.

# Speeds 1 : 1 : 0.5, K = 2, W = 1, 12 inner steps per loop, 3 tokens a step. t=3: round 0 =
# {0@2, 1@2}. t=4: replica 1 dies at its boundary (round 1 has closed; its 6 tokens lost); round
# 1 = {0@4, 2@2}, every live payload in. t=8: replica 0 skips (0@6 still open); round 2 =
# {0@6, 2@4}; the join of round 3 starts replica 1's loop at t=8. t=10: it heals at its first
# boundary (round 3 open) from replica 0, its 6 tokens lost. t=12: replica 0 skips its last
# boundary (0@10 open: steps 10-12 unsent); round 3 = {0@10 (12 tokens), 1@4, 2@6}; then
# rounds 4-6 of replicas 1 and 2 (replica 1 skips at t=16 and its last boundary, t=20). Adam's
# moments and count are the donor's in the heal.
DEATH = {"speeds": (1.0, 1.0, 0.5), "min_quorum": 2, "grace_window": 1.0,
         "staleness_rule": "dylu", "tokens_per_step": TOKENS,
         "faults": [ft.Fault(1, 1, "die_inner"), ft.Fault(3, 1, "join")]}


@functools.cache
def _death_run():
  """The run, and each replica's inner optimizer state (host copies) after each boundary, by
  (replica, local_step, healed)."""
  protocol = ft.RoundProtocol("diloco", optax.adam(0.1), optax.sgd(0.7, momentum=0.9,
                                                                    nesterov=True), sync_period=H)
  engine, inner = ft.InProcess(protocol, num_replicas=3, **DEATH), {}

  def record(replica):
    inner[replica.slot, replica.step, replica.healed] = jax.tree.map(
      np.asarray, heal.inner_state(replica.replica_state))

  return protocol, engine, engine.run(_loop(protocol, 6 * H, record=record)), inner


def test_a_joiner_heals_to_its_donors_global_state_and_every_token_is_accounted_for():
  """E2: the joiner's global state after its heal is its donor's at that time (the last
  committed round's) bit for bit; E1: every
  hash a replica holds after a boundary is the initial one or a committed round's, one per
  round; every token each loop processed is in exactly one merge or counted lost (the dead
  replica's dropped payloads, the joiner's first payload)."""
  protocol, engine, results, inner = _death_run()
  merges = [line for line in engine.log if isinstance(line, MergeLine)]
  deaths = [line for line in engine.log if isinstance(line, decoupled.Death)]
  heals = [line for line in engine.log if isinstance(line, decoupled.Heal)]
  reverts = [line for line in engine.log if isinstance(line, Revert)]
  unsent = [line for line in engine.log if isinstance(line, decoupled.Unsent)]
  assert unsent == [decoupled.Unsent(3, 0, 12, 2 * TOKENS), decoupled.Unsent(5, 1, 12, 2 * TOKENS)]
  assert [(d.round, d.replica) for d in deaths] == [(1, 1)] and deaths[0].lost > 0
  assert [(h.round, h.replica, h.donor, h.step, h.lost) for h in heals] == [
    (3, 1, 0, H, H * TOKENS)]
  assert engine.heals == [(3, 1, 0)]
  assert [m.round for m in merges] == list(range(len(merges)))
  assert all(m.committed for m in merges)
  assert [[row[:3] for row in m.payloads] for m in merges[1:4]] == [
    [(0, 4, 6), (2, 2, 6)], [(0, 6, 6), (2, 4, 6)], [(0, 10, 12), (1, 4, 6), (2, 6, 6)]]
  _, hashes, joiner = results[1]
  assert joiner.last is not None and hashes[0] == merges[heals[0].round - 1].state_hash
  assert hashes[0] == results[0][1][4]  # the donor's after its boundary at step 10
  _leaves_equal(inner[1, H, True], inner[0, 10, False])  # adam's moments and count (10)
  committed = [m.state_hash for m in merges]
  assert len(set(committed)) == len(committed)
  initial = decoupled.global_hash(protocol.init(tree_params()))
  for _, held, _ in results.values():
    assert set(held) <= {*committed, initial}
  total = TOKENS * (3 * 6 * H + deaths[0].step)
  merged = sum(row[2] for m in merges for row in m.payloads if row[5])
  lost = sum(line.lost for line in merges + deaths + heals + reverts + unsent)
  assert merged + lost == total


def test_a_decoupled_run_with_a_death_and_a_join_replays_bit_for_bit():
  """The JSON lines of the run with a death and a join as the plan, the same faults: the same
  lines (deaths and heals included) and the same params and optimizer states."""
  protocol, engine, results, _ = _death_run()
  lines = [json.loads(json.dumps(dataclasses.asdict(line))) for line in engine.log]
  again = ft.InProcess(protocol, num_replicas=3, replay=lines, **DEATH)
  replayed = again.run(_loop(protocol, 6 * H))
  assert again.log == engine.log
  for i in range(3):
    _leaves_equal(replayed[i][0], results[i][0])


def test_a_dead_replica_s_thread_ending_after_its_joiner_started_leaves_the_joiner_be():
  """The killed loop's thread unwinds slowly (as on a loaded machine): it ends after its slot's
  joiner started, and the run is the same as when it ends at once."""
  protocol, engine, results, _ = _death_run()
  train = _loop(protocol, 6 * H)

  def slow_to_die(replica):
    try:
      return train(replica)
    except BaseException:
      time.sleep(0.5)
      raise

  again = ft.InProcess(protocol, num_replicas=3, **DEATH)
  replayed = again.run(slow_to_die)
  assert again.log == engine.log
  for i in range(3):
    _leaves_equal(replayed[i][0], results[i][0])



# K = R, W = inf, speeds 1 : 1, 12 inner steps per loop: every boundary lands at its round's close
# (a torchft run's boundaries are these). Replica 1 dies at its push at step 4 (round 1) and its
# loop starts again when round 1 closes (t=4): it heals at its first boundary (t=6, round 3).
KILL = {"speeds": (1.0, 1.0), "tokens_per_step": TOKENS,
        "faults": [ft.Fault(1, 1, "die_inner"), ft.Fault(2, 1, "join")]}


@functools.cache
def _killed_run():
  """The run, its JSON lines and the torchft engine's log of it: the round lines of replica 0
  (the survivor), then each replica's boundary lines (time: the close it landed in) and replica
  1's Heal line between its two processes' boundaries."""
  protocol = ft.RoundProtocol("diloco", optax.adam(0.1), optax.sgd(0.7, momentum=0.9,
                                                                    nesterov=True), sync_period=H)
  steps = collections.Counter()  # each replica's inner steps (all its loops), the loop's count

  def count(slot, step):
    steps[slot] += 1
    return 0.0

  engine, train = ft.InProcess(protocol, num_replicas=2, **KILL), _loop(protocol, 6 * H, count)
  results = engine.run(train)
  train.steps, train.ran = steps, dict(steps)  # the counter, and the run's count
  (healed,) = [x for x in engine.log if isinstance(x, decoupled.Heal)]
  bounds = [decoupled.Boundary(0, b, float(b), True) for b in range(H, 6 * H + 1, H)]
  bounds += [decoupled.Boundary(1, H, float(H), True), healed]  # its first process: one boundary
  bounds += [decoupled.Boundary(1, b, 2 * H + b, b > H) for b in range(H, 6 * H + 1, H)]
  lines = [x for x in engine.log if isinstance(x, MergeLine)] + bounds
  return protocol, train, engine, results, [json.loads(json.dumps(dataclasses.asdict(x)))
                                            for x in lines]


@pytest.mark.parametrize("kill", ["after_its_boundary_line", "before_its_boundary_line"])
def test_a_killed_process_s_log_replays_whether_or_not_its_last_boundary_line_was_written(kill):
  """E3 for every prefix a ``kill -9`` can leave: replica 1's first process is killed after round
  0 (holding its payload) closed, with its boundary line of that round written or not (killed
  between its round line and its boundary line, or after the round's payloads were all-gathered
  and before either). The replay of the torchft engine's log (no faults given: the restart is the
  log's) closes the same rounds with the same payloads and hashes, heals replica 1 from replica 0
  at the same boundary, and ends with every replica's state bit for bit the run's."""
  protocol, train, engine, results, lines = _killed_run()
  assert [x.payloads[0][:2] + x.payloads[1][:2] for x in engine.log[:1]] == [(0, H, 1, H)]
  if kill == "before_its_boundary_line":
    lines = [x for x in lines if x.get("replica") != 1 or x.get("time") != H]
  replay = ft.InProcess(protocol, num_replicas=2, replay=lines, speeds=(1.0, 1.0),
                        tokens_per_step=TOKENS)
  train.steps.clear()
  replayed = replay.run(train)
  assert dict(train.steps) == train.ran
  assert [x for x in replay.log if isinstance(x, MergeLine)] == [
    x for x in engine.log if isinstance(x, MergeLine)]
  assert [x for x in replay.log if isinstance(x, decoupled.Heal)] == [
    x for x in engine.log if isinstance(x, decoupled.Heal)]
  for i in range(2):
    _leaves_equal(replayed[i][0], results[i][0])
  # the killed process's steps after its last boundary: no line of the log counts them, the
  # estimate (to its next boundary, where it died) does, and so does the replay's Death line
  tokens = {i: TOKENS * n for i, n in sorted(train.ran.items())}
  estimated = decoupled.unlogged(lines, protocol, TOKENS)
  assert estimated == {1: TOKENS * H}
  assert {i: n + estimated.get(i, 0) for i, n in _tokens(lines).items()} == tokens
  assert _tokens(replay.log) == tokens


def _tokens(lines):
  """Each replica's tokens merged or lost (``decoupled.accounts``; the merged ones, summed over
  the replicas, those of the round lines' merged rows: each round's line is given once)."""
  got = decoupled.accounts(lines)
  rows = [row for x in lines for row in (x if isinstance(x, dict) else dataclasses.asdict(x)).get(
    "payloads", ())]
  assert sum(v["merged"] for v in got.values()) == sum(row[2] for row in rows if row[5])
  return {i: v["merged"] + v["lost"] for i, v in got.items()}


def test_every_token_of_a_run_with_a_kill_and_a_join_is_merged_or_lost_once_per_replica():
  """Per replica, its tokens merged into committed rounds plus those its lines count lost (its
  dead loop's Death line, its joiner's Heal line) are its loops' inner steps, counted by the
  loops themselves, times 3 tokens a step; the JSON lines count the same, and a round's line
  given once per replica (as every torchft replica writes it) is counted once."""
  _, train, engine, _, _ = _killed_run()
  assert train.ran == {0: 6 * H, 1: 2 * H + 6 * H}
  want = {i: {"merged": TOKENS * n, "lost": 0} for i, n in train.ran.items()}
  want[1] = {"merged": TOKENS * (H + 5 * H), "lost": TOKENS * (H + H)}  # its Death and Heal
  assert {i: sum(v.values()) for i, v in want.items()} == {
    i: TOKENS * n for i, n in train.ran.items()}
  assert decoupled.accounts(engine.log) == want
  lines = [json.loads(json.dumps(dataclasses.asdict(x))) for x in engine.log]
  twice = [x for x in lines if "committed" in x] + lines
  assert decoupled.accounts(twice) == want


def test_a_killed_process_s_unlogged_steps_run_from_its_last_counted_payload_to_its_next_boundary():
  """Hand-written torchft lines, 100 steps a round, 16 tokens a step: replica 1's first process
  has its payload of step 100 in round 0 and its boundary of step 200 in no round (the round
  closed without it), then is killed: 200 + 100 - 100 steps; its second process heals at step
  100, its payload of step 200 is withdrawn (a Revert line), then it is killed: 200 + 100 - 200
  steps; its third process is alive. Replica 0 was never killed."""
  protocol = ft.RoundProtocol("diloco", optax.sgd(0.1), sync_period=100)

  def merge(r, rows):
    return {"round": r, "time": r + 1.0, "committed": True, "reason": "", "version": r,
            "payloads": [[i, step, 1600, 0, 1600.0, True] for i, step in rows], "lost": 0,
            "state_hash": str(r), "fragment": None, "replica": 0}

  def bound(step, t):
    return dataclasses.asdict(decoupled.Boundary(1, step, t, False))

  lines = [merge(0, [(0, 100), (1, 100)]), merge(1, [(0, 200)]), merge(2, [(0, 300)]),
           bound(100, 1.0), bound(200, 1.9), dataclasses.asdict(decoupled.Heal(2, 1, 0, 100, 1600)),
           bound(100, 2.9), dataclasses.asdict(Revert(2, 1, 200, 1600)), bound(200, 3.1),
           dataclasses.asdict(decoupled.Heal(3, 1, 0, 100, 1600)), bound(100, 4.0)]
  steps = (200 + 100 - 100) + (200 + 100 - 200)
  assert decoupled.unlogged(lines, protocol, 16) == {1: 16 * steps}
  assert decoupled.unlogged(lines[:3], protocol, 16) == {}


def test_a_dead_loop_waking_after_its_joiner_healed_leaves_the_joiner_its_pull(monkeypatch):
  """The killed loop's thread is slow to wake at each of its boundaries (as on a loaded machine),
  its death among them, so its slot's joiner (started at the close its death completed) heals
  at its first boundary before the dead one has woken: each takes its own outcome, and the run
  is the one where the dead loop wakes at once."""
  import threading

  from optax_dist.fault_tolerance import clock

  protocol, train, engine, results, _ = _killed_run()
  doomed = []

  class Late(threading.Condition):
    def wait_for(self, predicate, timeout=None):
      got = super().wait_for(predicate, timeout)
      if threading.current_thread() in doomed:
        self.release()
        time.sleep(0.5)
        self.acquire()
      return got

  init = clock.Clock.__init__

  def late(self, engine):
    init(self, engine)
    self._cv = Late()

  def marked(replica):
    if replica.slot == 1 and not doomed:
      doomed.append(threading.current_thread())
    return train(replica)

  monkeypatch.setattr(clock.Clock, "__init__", late)
  again, out = ft.InProcess(protocol, num_replicas=2, **KILL), {}
  runner = threading.Thread(target=lambda: out.update(again.run(marked)), daemon=True)
  runner.start()
  runner.join(60)
  assert not runner.is_alive() and again.log == engine.log
  for i in range(2):
    _leaves_equal(out[i][0], results[i][0])


def test_a_replay_fills_in_no_boundary_a_kill_cannot_have_left_unwritten():
  """Only the last payload of a process can miss its boundary line: a log without replica 1's
  restarted process's boundary at step 4 (a later one written) diverges."""
  protocol, train, _, _, lines = _killed_run()
  broken = [x for x in lines if (x.get("replica"), x.get("step"), x.get("time")) != (1, 2 * H, 8)]
  assert len(broken) == len(lines) - 1
  with pytest.raises(RuntimeError, match="replay diverges from its log at round 3"):
    ft.InProcess(protocol, num_replicas=2, replay=broken, speeds=(1.0, 1.0),
                 tokens_per_step=TOKENS).run(train)

# ------------------------------------------------------------------------------------------------
# Bad settings.

PROTOCOL = ft.RoundProtocol("diloco", optax.sgd(0.1), optax.sgd(1.0), sync_period=H)
BAD = [
  ({"speeds": (1.0, 1.0)}, ValueError, r"`InProcess\(speeds=...\)` must be one finite number"),
  ({"speeds": (1.0, 0.0, 1.0)}, ValueError, r"`InProcess\(speeds=...\)`"),
  ({"speeds": (1.0, math.inf, 1.0)}, ValueError, r"`InProcess\(speeds=...\)`"),
  ({"speeds": (1, 1, 1), "min_quorum": 0}, ValueError, r"`InProcess\(min_quorum=...\)`"),
  ({"speeds": (1, 1, 1), "min_quorum": 4}, ValueError, r"min_quorum=...\)` must be at most"),
  ({"speeds": (1, 1, 1), "min_quorum": 1.5}, TypeError, r"`InProcess\(min_quorum=...\)`"),
  ({"speeds": (1, 1, 1), "grace_window": -1.0}, ValueError, r"`InProcess\(grace_window=...\)`"),
  ({"speeds": (1, 1, 1), "grace_window": "1"}, TypeError, r"`InProcess\(grace_window=...\)`"),
  ({"speeds": (1, 1, 1), "grace_window": "auto", "grace_gamma": -1.0}, ValueError,
   r"`InProcess\(grace_gamma=...\)` must be a finite number >= 0, got -1.0"),
  ({"speeds": (1, 1, 1), "grace_window": "auto", "grace_gamma": math.inf}, ValueError,
   r"`InProcess\(grace_gamma=...\)` must be a finite number >= 0, got inf"),
  ({"speeds": (1, 1, 1), "staleness_rule": "fifo"}, ValueError,
   r"`InProcess\(staleness_rule=...\)` must be one of 'none', 'dylu'"),
  ({"speeds": (1, 1, 1), "max_staleness": -1}, ValueError, r"`InProcess\(max_staleness=...\)`"),
  ({"speeds": (1, 1, 1), "staleness_rule": "delayed_nesterov"}, ValueError,
   r"needs RoundProtocol\(outer=optax_dist.delayed_nesterov"),
  ({"speeds": (1, 1, 1), "min_quorum": 1, "min_replicas": 2}, ValueError,
   r"`InProcess\(min_replicas=...\)` must be at most min_quorum=1"),
  ({"min_quorum": 2}, ValueError, r"`InProcess\(speeds=...\)` must be given"),
  ({"grace_window": 1.0}, ValueError, r"`InProcess\(speeds=...\)` must be given"),
  ({"grace_window": "auto"}, ValueError, r"`InProcess\(speeds=...\)` must be given"),
  ({"speeds": (1, 1, 1), "faults": [ft.Fault(0, 1, "straggle")]}, ValueError,
   r"decoupled rounds have no 'straggle' faults"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD)
def test_bad_decoupled_settings_raise_one_line_errors(kwargs, error, message):
  with pytest.raises(error, match=message) as info:
    ft.InProcess(PROTOCOL, num_replicas=3, **kwargs)
  assert "\n" not in str(info.value)


def test_token_share_needs_the_number_of_replicas():
  """An engine of real replicas may not know R; token_share's divisor needs it."""
  with pytest.raises(ValueError, match=r"^`Torchft\(staleness_rule='token_share'\)` needs"
                     r" num_replicas \(R: .*\), got None\.$"):
    decoupled.check_settings("Torchft", PROTOCOL, num_replicas=None, speeds=None, min_quorum=1,
                             grace_window=0.0, staleness_rule="token_share", max_staleness=1)


def test_decoupled_rounds_refuse_overlap():
  protocol = ft.RoundProtocol("streaming_diloco", optax.sgd(0.1), sync_period=4, num_fragments=2,
                              overlap=1)
  with pytest.raises(ValueError, match=r"`InProcess\(protocol=...\)` must have overlap=0 for"
                     r" decoupled rounds .*, got overlap=1\.$"):
    ft.InProcess(protocol, num_replicas=2, speeds=(1, 1))


def test_decoupled_rounds_take_the_rules_they_name():
  """``delayed_nesterov`` with that outer optimizer and an infinite window are accepted."""
  nesterov = ft.RoundProtocol("diloco", optax.sgd(0.1), optax_dist.delayed_nesterov(
    0.7, 0.9, buffer_size=2), sync_period=H)
  engine = ft.InProcess(nesterov, num_replicas=2, speeds=(1, 0.5), grace_window=math.inf,
                        staleness_rule="delayed_nesterov")
  assert engine.min_quorum == 2 and engine.min_replicas == 1


# ------------------------------------------------------------------------------------------------
# The rebase: a replica moved onto a received anchor, its own steps kept.


@pytest.mark.parametrize("fragment", [None, 1])
def test_rebase_moves_bfloat16_params_by_the_float32_anchor_s_change_against_numpy(fragment):
  """``RoundProtocol.rebase``: every leaf x_new + (theta - x_old), except the late landing's
  fragment (all leaves with ``None``), where x_new + (theta - theta_b); in float32, cast to the
  params' bfloat16 (NumPy float64, rounded to bfloat16)."""
  protocol = ft.RoundProtocol("streaming_diloco", optax.sgd(0.1), optax.sgd(0.7), sync_period=4,
                              num_fragments=2, anchor_dtype="float32")
  params = {"a": jnp.asarray([1.0, -2.0], jnp.bfloat16), "b": jnp.asarray([3.0], jnp.bfloat16)}
  before = protocol.init(params)
  old = {"a": np.asarray([0.5, -1.25]), "b": np.asarray([2.5])}
  new = {"a": np.asarray([0.75, -1.0]), "b": np.asarray([2.0])}
  sent = {"a": jnp.asarray([0.875, -1.5], jnp.bfloat16), "b": jnp.asarray([2.75], jnp.bfloat16)}

  def at(anchor):
    tree = {k: jnp.asarray(v, jnp.float32) for k, v in anchor.items()}
    return before.opt_state._replace(anchor=tree), before.average

  got = protocol.rebase(params, sent, at(old), at(new), fragment)
  ids = dict(zip("ab", halves.leaf_fragments(protocol, params), strict=True))
  for k in "ab":
    ref = np.asarray(sent[k], np.float64) if ids[k] == fragment or fragment is None else old[k]
    want = (new[k] + np.asarray(params[k], np.float64) - ref).astype(jnp.bfloat16)
    assert got[k].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got[k]), want)
  plain = protocol.rebase(params, None, at(old), at(new), None)  # a catch-up: every leaf
  for k in "ab":
    want = (new[k] + np.asarray(params[k], np.float64) - old[k]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(plain[k]), want)
