"""Fault tolerance in the user's own loop: `Replica.start`/`after_step` driven by a plain optax
loop, a Flax Linen `TrainState` loop and an NNX loop, through the in-process engine.

The examples (`examples/*_fault_tolerant.py`) are run as users run them, with their scripted
kill and rejoin; the plain optax loop is compared round by round with the library's own round
(`InProcessEngine`), which `test_fault_tolerance` compares with the in-program transformation.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import tree_batch, tree_params

from optax_dist import fault_tolerance as ft

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
H = 2


def _example(name: str):
  spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_an_example_becomes_fault_tolerant_with_at_most_15_lines(flavour):
  """Lines added or changed in the fault-tolerant example against the plain one, blank lines
  aside: imports and the engine's choice included."""
  plain = (EXAMPLES / f"{flavour}_plain.py").read_text().splitlines()
  tolerant = (EXAMPLES / f"{flavour}_fault_tolerant.py").read_text().splitlines()
  changed = [line for line in difflib.unified_diff(plain, tolerant, lineterm="", n=0)
             if line.startswith("+") and not line.startswith("+++") and line[1:].strip()]
  assert 0 < len(changed) <= 15, changed
  assert not (EXAMPLES / "__init__.py").exists()  # no helper module beside the examples


# ------------------------------------------------------------------------------------------------
# The examples, through the in-process engine, with their scripted kill and rejoin.


@functools.cache
def _example_run(flavour: str):
  module = _example(f"{flavour}_fault_tolerant")
  engine = ft.engine("in_process", module.PROTOCOL, num_replicas=3, faults=module.FAULTS)
  return module, engine, engine.run(module.train)


def _by_round(log) -> dict[int, list]:
  rounds: dict[int, list] = {}
  for line in sorted(log, key=lambda line: (line.round, line.replica)):
    rounds.setdefault(line.round, []).append(line)
  return rounds


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_an_example_survives_its_kill_and_rejoin_with_one_state_per_round(flavour):
  """E1: one global-state hash (BatchNorm statistics included) per committed round; replica 1
  misses round 2, restarts in round 3, heals there from replica 0 (E2: its hash is the
  donor's) and finishes with the others; the loss fell."""
  module, engine, results = _example_run(flavour)
  rounds = _by_round(engine.log)
  assert sorted(rounds) == list(range(module.STEPS // module.PROTOCOL.sync_period))
  for r, lines in rounds.items():
    committed = {line.state_hash for line in lines if line.committed}
    assert len(committed) == 1 and all(line.committed for line in lines), r
    assert sorted(line.replica for line in lines) == ([0, 2] if r == 2 else [0, 1, 2])
  assert engine.heals == [(3, 1, 0)]
  healed = [line for line in rounds[3] if line.replica == 1][0]
  assert healed.healed and healed.weight == 0 and healed.step == 4 * module.PROTOCOL.sync_period
  for slot, (_, losses) in results.items():
    assert losses[-1] < losses[0] / 2, slot


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_a_round_s_line_has_the_mean_of_the_losses_its_steps_returned(flavour):
  """Each line's ``loss`` is the mean of the losses the example's own steps returned in that
  round (its list, in float64), also for replica 1's rejoined life: the round it ran from its
  start, then, healed 20 steps ahead, its next rounds (the losses restart at each boundary)."""
  module, engine, results = _example_run(flavour)
  h = module.PROTOCOL.sync_period
  for slot, (_, losses) in results.items():
    lines = sorted((x for x in engine.log if x.replica == slot), key=lambda x: x.round)
    want = np.asarray(losses, np.float64).reshape(-1, h).mean(axis=1)
    np.testing.assert_allclose([x.loss for x in lines[-len(want):]], want, rtol=1e-12)
  assert len([x for x in engine.log if x.replica == 1]) == 5  # rounds 0, 1, then 3, 4, 5


def _collections(flavour: str, state):
  if flavour == "linen":
    return state.batch_stats
  from flax import nnx

  return nnx.as_pure(nnx.state(state, nnx.BatchStat))


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_batch_statistics_are_the_members_mean_at_commit(flavour):
  """The BatchNorm statistics end equal on every replica (averaged at each commit) and are not
  any single replica's own."""
  _, _, results = _example_run(flavour)
  stats = [_collections(flavour, results[i][0]) for i in range(3)]
  for other in stats[1:]:
    for a, b in zip(jax.tree.leaves(stats[0]), jax.tree.leaves(other), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(float(jnp.abs(x).sum()) > 0 for x in jax.tree.leaves(stats[0]))


# ------------------------------------------------------------------------------------------------
# A plain optax loop against the library's own round.


def _grad(params, batch):  # the gradient of 0.5 |params - batch|^2
  return jax.tree.map(jnp.subtract, params, batch)


def _loop(protocol, steps, log_steps=None):
  """A user's loop: an eager init, then a jitted step that donates params and state."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch):
    updates, opt_state = protocol.tx.update(_grad(params, batch), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def train(replica):
    params = tree_params()
    state = replica.start((params, protocol.tx.init(params)))
    while replica.step < steps:
      state = train_step(*state, tree_batch(replica.seed, replica.slot, replica.step))
      state = replica.after_step(state)
    return state, train_step._cache_size()

  return train


CASES = {
  "diloco": dict(algorithm="diloco", sync_period=H),
  "diloco_int8_feedback": dict(algorithm="diloco", sync_period=H, comm_dtype="int8",
                               comm_block_size=4, error_feedback=True),
  "local_sgd": dict(algorithm="local_sgd", sync_period=H),
  "streaming": dict(algorithm="streaming_diloco", sync_period=2 * H, num_fragments=2),
  "streaming_mixing": dict(algorithm="streaming_diloco", sync_period=2 * H, num_fragments=2,
                           mixing=0.5),
  "streaming_overlap": dict(algorithm="streaming_diloco", sync_period=2 * H, num_fragments=2,
                            mixing=0.5, overlap=3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_user_loop_lands_where_the_library_s_round_lands(case):
  """No fault: the user's loop (its own last inner step, its donated jitted step) gives the
  library round's global state after every round, bit for bit, and the same params; its step
  is compiled once."""
  kw = dict(CASES[case])
  algorithm = kw.pop("algorithm")
  outer = None if algorithm == "local_sgd" else optax.sgd(1.0, momentum=0.5, nesterov=True)
  protocol = ft.RoundProtocol(algorithm, optax.sgd(0.5, momentum=0.5), outer, **kw)
  rounds = 4
  library = ft.InProcessEngine(protocol, tree_params(), _grad, tree_batch, num_replicas=3)
  want = library.run(rounds)
  engine = ft.InProcess(protocol, num_replicas=3)
  steps = sum(line.step for line in want if line.replica == 0 and line.round == rounds - 1)
  results = engine.run(_loop(protocol, steps))
  got = {(line.round, line.replica): line.state_hash for line in engine.log}
  assert got == {(line.round, line.replica): line.state_hash for line in want}
  assert {line.loss for line in engine.log} == {None}  # the loop reports no loss
  for i in range(3):
    (params, _), compiled = results[i]
    assert compiled == 1
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(library.replicas[i].params),
                    strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_nonfinite_payload_aborts_the_round_on_every_member():
  """A member whose payload holds a NaN votes no: every member aborts (params back on the
  anchor, the global state unchanged) and the next round commits."""
  protocol = ft.RoundProtocol("diloco", optax.sgd(0.5), optax.sgd(1.0), sync_period=H)
  engine = ft.InProcess(protocol, num_replicas=3, faults=[ft.Fault(1, 2, "nonfinite")])
  engine.run(_loop(protocol, 3 * H))
  rounds = _by_round(engine.log)
  assert [line.committed for line in rounds[1]] == [False] * 3
  assert len({line.state_hash for line in rounds[1]}) == 1
  assert all(line.committed for line in rounds[2]) and len({
    line.state_hash for line in rounds[2]}) == 1


def test_a_straggler_aborts_then_heals():
  """Replica 2 left out of round 1's quorum aborts it; one round behind, it heals in round 2."""
  protocol = ft.RoundProtocol("diloco", optax.sgd(0.5), optax.sgd(1.0), sync_period=H)
  engine = ft.InProcess(protocol, num_replicas=3, faults=[ft.Fault(1, 2, "straggle")])
  engine.run(_loop(protocol, 3 * H))
  rounds = _by_round(engine.log)
  assert sorted((line.replica, line.committed, line.members) for line in rounds[1]) == [
    (0, True, (0, 1)), (1, True, (0, 1)), (2, False, ())]
  assert engine.heals == [(2, 2, 0)]
  assert len({line.state_hash for line in rounds[2]}) == 1


def test_step_key_is_a_stateless_function_of_seed_slot_and_step():
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(3), 1), 7)
  np.testing.assert_array_equal(jax.random.key_data(ft.step_key(3, 1, 7)),
                                jax.random.key_data(key))
  assert not np.array_equal(jax.random.key_data(ft.step_key(3, 1, 7)),
                            jax.random.key_data(ft.step_key(3, 2, 7)))


def test_bad_input():
  protocol = ft.RoundProtocol("diloco", optax.sgd(0.5), sync_period=H)
  params = tree_params()
  replica = ft.Replica(protocol, None, slot=0, seed=0, tokens_per_step=1)
  with pytest.raises(RuntimeError, match="before `Replica.start`"):
    replica.after_step((params, protocol.tx.init(params)))
  with pytest.raises(ValueError, match="must be RoundProtocol.tx's"):
    replica.start((params, optax.adam(0.1).init(params)))
  with pytest.raises(TypeError, match="TrainState, a \\(model, nnx.Optimizer\\) pair"):
    replica.start(params)
  with pytest.raises(ValueError, match=r"`engine\(kind=...\)` must be one of"):
    ft.engine("threads", protocol, num_replicas=2)
  with pytest.raises(ValueError, match="must be of a kind in"):
    ft.InProcess(protocol, num_replicas=2, faults=[ft.Fault(0, 0, "die_exchange")])
  with pytest.raises(ValueError, match="at most num_replicas=2"):
    ft.InProcess(protocol, num_replicas=2, min_replicas=3)


def test_a_grain_iterator_seeks_its_slot_s_stream_to_the_healed_step():
  """A loader with state: each replica reads its shard of a grain `MapDataset` through an
  iterator, and `seek` sets the iterator's position whenever the data position jumps; the
  rejoined replica 1 reads, after its heal, the batches of the healed steps (the shard's
  `[step]`, a stateless function of (seed, slot, step))."""
  grain = pytest.importorskip("grain")
  protocol = ft.RoundProtocol("diloco", optax.sgd(0.5), optax.sgd(1.0), sync_period=H)
  data = np.random.default_rng(1).normal(size=(64, 4)).astype(np.float32)  # indexed on the host
  dataset = grain.MapDataset.range(64).seed(0).shuffle().repeat().batch(8)
  step_fn = jax.jit(lambda p, o, x: protocol.inner_step(p, o, p - x.mean(0)))

  def train(replica):
    shard = dataset[replica.slot::3]
    stream = iter(shard.to_iter_dataset())
    params = jnp.zeros(4)
    state = replica.start((params, protocol.tx.init(params)),
                          seek=lambda step: stream.set_state({"next_index": step}))
    read = []
    while replica.step < 4 * H:
      index = next(stream)
      np.testing.assert_array_equal(index, shard[replica.step])
      read.append(replica.step)
      state = replica.after_step(step_fn(*state, data[index]))
    return read

  faults = [ft.Fault(1, 1, "die_inner"), ft.Fault(2, 1, "join")]
  engine = ft.InProcess(protocol, num_replicas=3, faults=faults)
  read = engine.run(train)
  assert engine.heals == [(2, 1, 0)]
  assert read[1] == [0, 1, 3 * H, 3 * H + 1]  # its first round, then the healed round's
  assert all(len({line.state_hash for line in lines if line.committed}) == 1
             for lines in _by_round(engine.log).values())


def test_a_healed_replica_s_next_payload_is_its_peers_size():
  """The command's AdamW recipe (clip, warm-up and cosine decay, b2 0.99, weight decay) on an
  MLP of digits, 4 replicas, heals at the start, middle and end of the schedule: the healed
  replica takes its donor's moments, so its next pseudo-gradient's norm is within 1.2x of its
  peers' median (with fresh moments and the schedule's count it was 1.9x in the middle and at
  the end: the post-warm-up learning rate meets an empty second moment)."""
  from sklearn.datasets import load_digits

  x_all, y_all = load_digits(return_X_y=True)
  x_all, y_all = jnp.asarray((x_all / 16.0).astype(np.float32)), jnp.asarray(y_all, np.int32)
  steps, period = 200, 10
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, steps, 3e-4)
  inner = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b2=0.99, weight_decay=0.1))
  protocol = ft.RoundProtocol("diloco", inner, sync_period=period)
  params0 = jax.jit(lambda k1, k2: {  # one program, not one per operation
    "w1": 0.1 * jax.random.normal(k1, (64, 64)), "b1": jnp.zeros(64),
    "w2": 0.1 * jax.random.normal(k2, (64, 10)), "b2": jnp.zeros(10)})(
      *jax.random.split(jax.random.key(0)))

  def loss(p, x, y):
    logits = jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def train_step(p, o, key):
    index = jax.random.randint(key, (32,), 0, len(x_all))
    updates, o = protocol.tx.update(jax.grad(loss)(p, x_all[index], y_all[index]), o, p)
    return optax.apply_updates(p, updates), o

  pseudo_gradient_norm = jax.jit(
    lambda anchor, p: optax.tree.norm(jax.tree.map(jnp.subtract, anchor, p)))
  norms = {}  # (slot, step) -> the norm of its pseudo-gradient at that round boundary

  def train(replica):
    state = replica.start((params0, protocol.tx.init(params0)))
    while replica.rounds < steps // period:
      state = train_step(*state, ft.step_key(0, replica.slot, replica.step))
      if (replica.step + 1) % period == 0:  # the round's last step
        norms[replica.slot, replica.step + 1] = float(pseudo_gradient_norm(state[1].anchor,
                                                                           state[0]))
      state = replica.after_step(state)

  faults = [ft.Fault(r + k, slot, kind) for r, slot in ((2, 1), (8, 2), (14, 3))
            for k, kind in ((0, "die_inner"), (1, "join"))]
  engine = ft.InProcess(protocol, num_replicas=4, faults=faults)
  engine.run(train)
  assert [(j, d) for _, j, d in engine.heals] == [(1, 0), (2, 0), (3, 0)]
  for r, j, _ in engine.heals:
    (healed,) = [line for line in engine.log if line.round == r and line.replica == j]
    after = healed.step + period  # the healed replica's next round
    peers = [norms[i, after] for i in range(4) if i != j]
    assert norms[j, after] / np.median(peers) <= 1.2, (r, norms[j, after], peers)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_non_finite_coordinate_of_one_member_s_payload_aborts_the_round(bad):
  """The vote refuses a payload with a single non-finite value in a single coordinate of one
  leaf (not only an all-NaN payload): `decide` aborts, and every other payload still votes
  yes."""
  from optax_dist.fault_tolerance import decision

  protocol = ft.RoundProtocol("diloco", optax.sgd(0.5), sync_period=H)
  good = {"a": jnp.ones((4, 3)), "b": jnp.ones(5)}
  poisoned = {"a": good["a"].at[2, 1].set(bad), "b": good["b"]}
  heads = [decision.Header(i, 8, 1, 7, H) for i in range(3)]
  assert protocol.votes(good) and not protocol.votes(poisoned)
  assert decision.decide(protocol, heads, [good] * 3, min_replicas=2).merged is not None
  d = decision.decide(protocol, heads, [good, poisoned, good], min_replicas=2)
  assert d.merged is None and d.voters == () and "[1]" in d.reason


# ------------------------------------------------------------------------------------------------
# E3: a synchronous run with faults equals a replay of its lines.

REPLAYED_FAULTS = [ft.Fault(1, 1, "die_inner"), ft.Fault(2, 1, "join"),
                   ft.Fault(3, 2, "straggle"), ft.Fault(4, 0, "nonfinite")]


@functools.cache
def _faulted_run():
  protocol = ft.RoundProtocol("diloco", optax.sgd(0.5, momentum=0.5),
                              optax.sgd(1.0, momentum=0.5, nesterov=True), sync_period=H)
  train = _loop(protocol, 6 * H)
  engine = ft.engine("in_process", protocol, num_replicas=3, faults=REPLAYED_FAULTS)
  return protocol, train, engine, engine.run(train)


@pytest.mark.parametrize("form", ["lines", "json"])
def test_a_run_with_faults_equals_a_replay_of_its_lines(form):
  """E3: a replica dies (round 1) and rejoins (round 2, healing from replica 0), a straggler
  aborts round 3 and heals in round 4, a NaN payload aborts round 4; the replay of the run's
  lines (or of their JSON) without a scripted fault writes the same lines (state hashes
  included), heals the same replicas from the same donors, and ends with every replica's
  params and optimizer state bit for bit."""
  import dataclasses
  import json

  protocol, train, engine, results = _faulted_run()
  assert engine.heals == [(2, 1, 0), (4, 2, 0)]
  assert [x.committed for x in sorted(engine.log, key=lambda x: (x.round, x.replica))
          if x.replica == 0] == [True, True, True, True, False, True]
  lines = engine.log if form == "lines" else [
    json.loads(json.dumps(dataclasses.asdict(x))) for x in engine.log]
  replay = ft.engine("in_process", protocol, num_replicas=3, replay=lines)
  got = replay.run(train)
  assert sorted(replay.log, key=lambda x: (x.round, x.replica)) == sorted(
    engine.log, key=lambda x: (x.round, x.replica))
  assert replay.heals == engine.heals
  assert sorted(replay.faults, key=lambda f: (f.round, f.replica)) == [
    ft.Fault(1, 1, "die_inner"), ft.Fault(2, 1, "join"), ft.Fault(3, 2, "straggle")]
  assert sorted(got) == [0, 1, 2]
  for i in range(3):
    for a, b in zip(jax.tree.leaves(results[i][0]), jax.tree.leaves(got[i][0]), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _tampered(log, r, change):
  import dataclasses
  import json

  lines = [json.loads(json.dumps(dataclasses.asdict(x))) for x in log]
  return [x for x in (change(x) if x["round"] == r else x for x in lines) if x is not None]


TAMPERED = {  # a round and what is changed in each of its lines (None: dropped)
  "nan_round_logged_as_a_commit": (4, lambda x: x | {"committed": bool(x["members"])}),
  "a_member_s_line_dropped": (5, lambda x: None if x["replica"] == 2 else x),
  "a_heal_not_logged": (2, lambda x: x | {"healed": False} if x["replica"] == 1 else x),
  "a_round_dropped": (5, lambda x: None),
  "a_round_added": (6, None),
  "an_empty_log": (0, lambda x: None),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_replay_that_diverges_from_its_log_raises_naming_the_round(case):
  """A payload the log does not have (round 4's NaN not injected: it commits), a member
  missing, a heal, a line not written, or a logged line the run does not write again."""
  protocol, train, engine, _ = _faulted_run()
  r, change = TAMPERED[case]
  if case == "an_empty_log":
    lines = []
  elif change is None:  # round 5's lines again as round 6's
    lines = _tampered(engine.log, 5, lambda x: x) + _tampered(
      [x for x in engine.log if x.round == 5], 5, lambda x: x | {"round": 6})
  else:
    lines = _tampered(engine.log, r, change)
  with pytest.raises(RuntimeError, match=f"replay diverges from its log at round {r}:"):
    ft.InProcess(protocol, num_replicas=3, replay=lines).run(train)


def test_an_example_s_kill_and_rejoin_replays_with_its_batch_statistics():
  """E3 with model collections: the Linen example's run (replica 1 dies in round 2, rejoins
  in round 3 and heals) replayed from its lines: the same lines and every replica's final
  TrainState (params, optimizer state, BatchNorm statistics) bit for bit."""
  module, engine, results = _example_run("linen")
  replay = ft.engine("in_process", module.PROTOCOL, num_replicas=3, replay=engine.log)
  got = replay.run(module.train)
  assert replay.heals == engine.heals == [(3, 1, 0)]
  for i in range(3):
    for a, b in zip(jax.tree.leaves(results[i][0]), jax.tree.leaves(got[i][0]), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_synchronous_replay_s_bad_input():
  protocol, _, engine, _ = _faulted_run()
  with pytest.raises(ValueError, match=r"`InProcess\(faults=...\)` must be empty with replay="):
    ft.InProcess(protocol, num_replicas=3, faults=REPLAYED_FAULTS, replay=engine.log)
  with pytest.raises(ValueError, match="must hold RoundLog lines or their JSON objects, got 3"):
    ft.InProcess(protocol, num_replicas=3, replay=[3])
  with pytest.raises(ValueError, match="must name a replica below 2, once per round"):
    ft.InProcess(protocol, num_replicas=2, replay=engine.log)


# ------------------------------------------------------------------------------------------------
# The examples' loops in decoupled rounds: replicas of different speeds, none waiting.

SPEEDS = (1.0, 1.0, 0.5)  # inner steps per simulated second: replica 2 is half as fast
DECOUPLED = dict(speeds=SPEEDS, min_quorum=1, grace_window=2.0)  # a fifth of a fast round


def _arrays(flavour: str, state) -> list:
  """Every array of a returned Linen `TrainState` or NNX model."""
  if flavour == "linen":
    return jax.tree.leaves(state)
  from flax import nnx

  return jax.tree.leaves(nnx.state(state))


def _assert_same_arrays(flavour: str, a, b) -> None:
  for x, y in zip(_arrays(flavour, a), _arrays(flavour, b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@functools.cache
def _decoupled_run(flavour: str):
  module = _example(f"{flavour}_fault_tolerant")
  engine = ft.engine("in_process", module.PROTOCOL, num_replicas=3, faults=module.FAULTS,
                     **DECOUPLED)
  return module, engine, engine.run(module.train)


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_an_example_s_loop_trains_decoupled_through_its_kill_and_rejoin(flavour):
  """The example's own loop, unchanged, on the decoupled engine (K = 1, W = 2 s): rounds close
  without the slow replica's payload and its payloads enter later merges, stale; replica 1
  dies, rejoins and heals from replica 0; every token of every loop is in one committed merge
  or counted lost; every replica's loss fell by half."""
  from optax_dist.fault_tolerance import decoupled

  module, engine, results = _decoupled_run(flavour)
  merges = [x for x in engine.log if isinstance(x, decoupled.MergeLine)]
  assert merges and all(m.committed for m in merges)
  assert any(2 not in {row[0] for row in m.payloads} for m in merges)
  slow = [row for m in merges for row in m.payloads if row[0] == 2]
  assert slow and all(row[5] for row in slow) and max(row[3] for row in slow) >= 1
  (death,) = [x for x in engine.log if isinstance(x, decoupled.Death)]
  (healed,) = [x for x in engine.log if isinstance(x, decoupled.Heal)]
  assert (death.replica, healed.replica, healed.donor) == (1, 1, 0)
  assert engine.heals == [(healed.round, 1, 0)]
  steps = {0: module.STEPS, 1: death.step + module.STEPS, 2: module.STEPS}
  assert {i: sum(c.values()) for i, c in decoupled.accounts(engine.log).items()} == steps
  for slot, (_, losses) in results.items():
    assert losses[-1] < losses[0] / 2, slot


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_an_example_s_decoupled_run_replays_bit_for_bit_with_its_batch_statistics(flavour):
  """E3 in decoupled rounds with model collections: the run's JSON lines as the plan give the
  same lines and every replica's final state (params, optimizer state, BatchNorm statistics)
  bit for bit."""
  import dataclasses
  import json

  module, engine, results = _decoupled_run(flavour)
  lines = [json.loads(json.dumps(dataclasses.asdict(x))) for x in engine.log]
  again = ft.engine("in_process", module.PROTOCOL, num_replicas=3, faults=module.FAULTS,
                    replay=lines, **DECOUPLED)
  got = again.run(module.train)
  assert again.log == engine.log
  for i in range(3):
    _assert_same_arrays(flavour, results[i][0], got[i][0])


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_an_example_s_loop_decoupled_with_k_equal_r_is_the_synchronous_round(flavour):
  """E4 with model collections: K = R, an infinite window and equal speeds give the synchronous
  engine's run of the example's loop bit for bit (params, optimizer state, BatchNorm
  statistics, the losses)."""
  module = _example(f"{flavour}_fault_tolerant")
  sync = ft.engine("in_process", module.PROTOCOL, num_replicas=3).run(module.train)
  got = ft.engine("in_process", module.PROTOCOL, num_replicas=3, speeds=(1.0,) * 3).run(
    module.train)
  for i in range(3):
    assert got[i][1] == sync[i][1]
    _assert_same_arrays(flavour, sync[i][0], got[i][0])
