"""The fault-tolerant halves' table: a new algorithm is one more row, and the protocol and the
in-process engine run it through faults with nothing else changed.

The values are exact (dyadic, the inner and outer learning rates powers of 2, the means'
quotients representable), so the engine's anchors are checked against the analytic ones bit
for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist
from optax_dist import fault_tolerance as ft
from optax_dist.fault_tolerance import halves

H = 2
OUTER = optax.sgd(1.0)  # model averaging: theta - 1 * (theta - mean x') = mean x'


def _build(p: ft.RoundProtocol) -> optax.GradientTransformationExtraArgs:
  return optax_dist.diloco(p.inner, OUTER, sync_period=p.sync_period, comm_dtype=p.comm_dtype,
                           comm_block_size=p.comm_block_size, error_feedback=p.error_feedback)


def _commit(p, origin, updates, opt_state, average, merged, residual, fragment):
  anchor, outer_state = optax_dist.diloco_outer_step(
    OUTER, opt_state.anchor, opt_state.outer_state, merged)
  opt_state = opt_state._replace(anchor=anchor, outer_state=outer_state, error_feedback=residual)
  return halves.land(origin, anchor), opt_state, average


# DiLoCo's row with its outer optimizer forced to SGD(1): the model average, kept as an anchor.
MODEL_AVERAGE = dataclasses.replace(
  halves.HALVES["diloco"], build=_build, commit=_commit, takes_outer=False)


@pytest.fixture
def model_average(monkeypatch):
  monkeypatch.setitem(halves.HALVES, "model_average", MODEL_AVERAGE)
  return ft.RoundProtocol("model_average", optax.sgd(0.5), sync_period=H)


def _grad(params, batch):  # the gradient of 0.5 |params - batch|^2
  return jax.tree.map(jnp.subtract, params, batch)


def _batch(seed, slot, step):  # slot i's target c_i = i + 1, every step
  del seed, step
  return {"w": jnp.full((3,), slot + 1.0, jnp.float32)}


def _anchors(rounds):
  """The analytic anchors: from theta, H = 2 steps of SGD(1/2) towards c_i give
  x'_i = theta / 4 + 3 c_i / 4, and a committed round's anchor is their mean over the round's
  voters (the members of weight > 0); an aborted round keeps it."""
  theta, out = Fraction(0), []
  for voters in rounds:
    if voters:
      theta = sum(theta / 4 + Fraction(3 * (i + 1), 4) for i in voters) / len(voters)
    out.append(float(theta))
  return out


def test_a_fourth_row_runs_through_faults(model_average):
  faults = [
    ft.Fault(1, 2, "die_inner"),  # round 1: replicas 0 and 1 commit
    ft.Fault(2, 2, "join"),  # round 2: replica 2 heals (weight 0) ...
    ft.Fault(2, 1, "die_exchange"),  # ... and 1 dies in the exchange: the round aborts
    ft.Fault(3, 1, "join"),  # round 3: replica 1 heals; 0 and 2 are merged
  ]
  engine = ft.InProcessEngine(model_average, {"w": jnp.zeros(3)}, _grad, _batch,
                              num_replicas=3, min_replicas=2, faults=faults)
  want = _anchors([(0, 1, 2), (0, 1), (), (0, 2), (0, 1, 2)])
  assert want == [1.5, 1.5, 1.5, 1.875, 1.96875]

  log = []
  for r, anchor in enumerate(want):
    lines = engine.run(1)
    log += lines
    committed = [line for line in lines if line.committed]
    assert bool(committed) == (r != 2)
    if committed:  # E1: one global state per committed round
      assert len({line.state_hash for line in committed}) == 1
    for line in lines:  # every live replica, committed or aborted: params on the anchor
      replica = engine.replicas[line.replica]
      np.testing.assert_array_equal(replica.opt_state.anchor["w"], np.full(3, anchor, np.float32))
      np.testing.assert_array_equal(replica.params["w"], replica.opt_state.anchor["w"])
  assert [(line.round, line.replica) for line in log if line.healed] == [(2, 2), (3, 1)]
  assert [int(engine.replicas[i].rounds) for i in range(3)] == [4, 4, 4]
  for _, _, _, joiner, donor in engine.heals:  # E2: a joiner holds its donor's global state
    assert ft.state_hash(joiner) == ft.state_hash(donor)

  fresh = ft.InProcessEngine(model_average, {"w": jnp.zeros(3)}, _grad, _batch,
                             num_replicas=3, min_replicas=2)
  assert ft.replay(fresh, log) == log  # E3


def test_a_rows_settings_are_checked_from_the_row(model_average):
  with pytest.raises(ValueError, match=r"RoundProtocol\(outer=...\)` must be None for"
                     r" model_average"):
    ft.RoundProtocol("model_average", optax.sgd(0.5), optax.sgd(0.1), sync_period=H)
  with pytest.raises(ValueError, match=r"are streaming_diloco's, got num_fragments=2"):
    ft.RoundProtocol("model_average", optax.sgd(0.5), sync_period=H, num_fragments=2)
  assert model_average.rounds_until(7) == 3 and model_average.round_steps(1) == 1
  assert model_average.fragment(2) is None and not model_average.payload_size_varies
  zeros = model_average.healed_payload(*_state(model_average), step=H)
  assert jax.tree.map(lambda x: (x.shape, x.dtype, float(np.abs(x).max())), zeros) == {
    "w": ((3,), np.float32, 0.0)}


def test_unknown_algorithm_names_the_rows():
  with pytest.raises(ValueError, match=r"must be one of \('diloco', 'local_sgd',"
                     r" 'streaming_diloco'\), got 'model_average'"):
    ft.RoundProtocol("model_average", optax.sgd(0.5))
  assert ft.SUPPORTED == tuple(halves.HALVES) == ("diloco", "local_sgd", "streaming_diloco")


def test_streaming_rows_schedule_and_healed_payload():
  p = ft.RoundProtocol("streaming_diloco", optax.sgd(0.5), sync_period=4, num_fragments=2)
  assert [p.fragment(t) for t in range(1, 9)] == [None, 0, None, 1] * 2
  assert [p.rounds_until(t) for t in range(1, 9)] == [0, 1, 1, 2, 2, 3, 3, 4]
  assert p.round_steps(0) == 2 and p.round_steps(2) == 2 and p.payload_size_varies
  params = {"a": jnp.ones(3), "b": jnp.ones(3)}
  zeros = p.healed_payload(params, p.tx.init(params), step=4)  # fragment 1's: "b"
  assert isinstance(zeros["a"], optax.MaskedNode)
  np.testing.assert_array_equal(zeros["b"], np.zeros(3, np.float32))
  assert ft.RoundProtocol("local_sgd", optax.sgd(0.5), sync_period=4).rounds_until(9) == 2


def _state(protocol):
  params = {"w": jnp.zeros(3)}
  return params, protocol.tx.init(params)


# ------------------------------------------------------------------------------------------------
# anchor_dtype: a float32 anchor beside bfloat16 params, as the in-program DiLoCo family keeps it.

LOW = {"a": (4, 3), "b": (5,)}


def _low_params():
  keys = jax.random.split(jax.random.key(0), len(LOW))
  return {k: jax.random.normal(key, s, jnp.bfloat16)
          for key, (k, s) in zip(keys, LOW.items(), strict=True)}


@jax.jit
def _low_batch(seed, slot, step):
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), slot), step)
  keys = jax.random.split(key, len(LOW))
  return {k: jax.random.normal(kk, s, jnp.bfloat16)
          for kk, (k, s) in zip(keys, LOW.items(), strict=True)}


@pytest.mark.parametrize("algorithm, kw", [
  ("diloco", {"sync_period": H}),
  ("streaming_diloco", {"sync_period": 2 * H, "num_fragments": 2}),
])
def test_a_float32_anchor_of_bfloat16_params_equals_in_program(algorithm, kw):
  """E4 with ``anchor_dtype=jnp.float32`` and bfloat16 params, 2 replicas: bit for bit the
  in-program transformation under ``vmap(axis_name)`` after every round (a round every H
  steps: diloco's, and one of streaming's 2 fragments with its H = 2H)."""
  inner, outer = optax.sgd(0.5, momentum=0.5), optax.sgd(1.0, momentum=0.5, nesterov=True)
  protocol = ft.RoundProtocol(algorithm, inner, outer, anchor_dtype=jnp.float32, **kw)
  engine = ft.InProcessEngine(protocol, _low_params(), _grad, _low_batch, num_replicas=2)
  tx = getattr(optax_dist, algorithm)(inner, outer, axis_name="w", anchor_dtype=jnp.float32,
                                      **kw)

  @jax.jit
  @functools.partial(jax.vmap, axis_name="w")
  def step(params, state, batch):
    updates, state = tx.update(_grad(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  params = jax.tree.map(lambda p: jnp.broadcast_to(p, (2, *p.shape)), _low_params())
  state = jax.vmap(tx.init, axis_name="w")(params)
  for t in range(4 * H):
    batches = [_low_batch(0, i, t) for i in range(2)]
    params, state = step(params, state, jax.tree.map(lambda *b: jnp.stack(b), *batches))
    if (t + 1) % H:
      continue
    assert all(line.committed for line in engine.run(1))
    for i in range(2):
      got = engine.replicas[i]
      assert jax.tree.leaves(got.opt_state.anchor)[0].dtype == jnp.float32
      assert jax.tree.leaves(got.params)[0].dtype == jnp.bfloat16
      want = jax.tree.map(lambda x, i=i: x[i], (params, state))
      for g, w in zip(jax.tree.leaves((got.params, got.opt_state)), jax.tree.leaves(want),
                      strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_anchor_dtype_is_refused_for_local_sgd_and_fingerprinted():
  from optax_dist.fault_tolerance.decision import settings_fingerprint

  with pytest.raises(ValueError, match=r"`RoundProtocol\(anchor_dtype=...\)` must be None for"
                     r" local_sgd \(it keeps no anchor\), got"):
    ft.RoundProtocol("local_sgd", optax.sgd(0.5), sync_period=H, anchor_dtype=jnp.float32)

  def fingerprint(anchor_dtype):
    protocol = ft.RoundProtocol("diloco", optax.sgd(0.5), sync_period=H,
                                anchor_dtype=anchor_dtype)
    return settings_fingerprint(protocol, _low_params(), seed=0, tokens_per_step=1)

  assert fingerprint(jnp.float32) == fingerprint("float32") != fingerprint(None)
  # None adds no field: a run without anchor_dtype keeps its fingerprint (its checkpoints restore)
  assert fingerprint(None) == 3427140245638494269  # the value before the field existed
