"""Quantized exchanges (``comm_dtype`` int8, float4_e2m1fn, e3m0) of the periodic transformations.

The references are written here in NumPy from the rules of ``optax_dist._quantize``'s module
docstring: the block scale is ``max|x| * fl(1/max G)`` in float32, rounded up to 17 (int8), 22
(float4_e2m1fn) or 24 (e3m0) significant bits, blocks with a scale below 2**-126 are sent as
zeros, and each value is rounded to the grid point nearest to ``x * fl(1/scale)`` (ties to
even). Every sync of the tests below is exact in float32 (inner and outer SGD of learning rate
1, 2 or 4 workers, so the mean's division is exact), and the comparisons are bit-exact: one
flipped code is a whole grid step off.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

AXIS = "w"
FORMATS = {"int8": jnp.int8, "float4_e2m1fn": jnp.float4_e2m1fn, "e3m0": "e3m0"}
SHAPES = {"w": (3, 7), "b": (5,)}  # 21 and 5 values: padded blocks of 8
BLOCK = 8
H = 2

# ----------------------------------------------------------------------------------------------
# NumPy reference of the block quantizers.

_GRID = {
  "float4_e2m1fn": np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64),
  "e3m0": np.array([0] + [2.0**e for e in range(-6, 1)], np.float64),
}
_LARGEST = {"int8": 127.0, "float4_e2m1fn": 6.0, "e3m0": 1.0}
_SIGNIFICANT_BITS = {"int8": 17, "float4_e2m1fn": 22, "e3m0": 24}


def _round_up_to_bits(s: np.ndarray, bits: int) -> np.ndarray:
  """Non-negative float32 ``s`` rounded up to ``bits`` significant bits."""
  drop = 24 - bits
  if drop == 0:
    return s
  pattern = s.view(np.uint32).astype(np.uint64)
  mask = np.uint64(2**drop - 1)
  return ((pattern + mask) & ~mask).astype(np.uint32).view(np.float32)


def _nearest_grid_point(magnitude: np.ndarray, grid: np.ndarray) -> np.ndarray:
  """The nearest point of ``grid`` to each ``magnitude``, ties to the even index (float64)."""
  distance = np.abs(magnitude.astype(np.float64)[..., None] - grid)
  index = np.argmin(distance, axis=-1)  # the lower one on a tie
  upper = np.minimum(index + 1, len(grid) - 1)
  tie = (upper != index) & (
    np.take_along_axis(distance, upper[..., None], -1)[..., 0]
    == np.take_along_axis(distance, index[..., None], -1)[..., 0]
  )
  return grid[np.where(tie & (index % 2 == 1), upper, index)]


def quantized(x: np.ndarray, fmt: str, block: int) -> np.ndarray:
  """What a worker sends for ``x``, decoded: float32, ``x``'s shape."""
  flat = np.asarray(x, np.float32).ravel()
  blocks = np.zeros(math.ceil(flat.size / block) * block, np.float32)
  blocks[: flat.size] = flat
  blocks = blocks.reshape(-1, block)
  largest = np.abs(blocks).max(axis=1)
  scale = _round_up_to_bits(largest * np.float32(1 / _LARGEST[fmt]), _SIGNIFICANT_BITS[fmt])
  scale = np.where(scale >= np.float32(2.0**-126), scale, np.float32(0))
  with np.errstate(divide="ignore"):
    inverse = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
  y = blocks * inverse[:, None]
  if fmt == "int8":
    g = np.clip(np.round(y), -127, 127)  # np.round: half to even
  else:
    g = np.sign(y) * _nearest_grid_point(np.abs(y), _GRID[fmt])
  decoded = (g * scale[:, None]).astype(np.float32)
  return decoded.ravel()[: flat.size].reshape(np.shape(x))


def quantized_tree(tree: dict[str, np.ndarray], fmt: str, block: int) -> dict[str, np.ndarray]:
  """What a worker sends for a dict of float32 leaves, decoded: the leaves, flattened in the
  order of ``jax.tree.leaves`` (sorted keys), are quantized end to end as one vector, so a
  block may span two leaves."""
  keys = sorted(tree)
  flat = quantized(np.concatenate([np.ravel(tree[k]) for k in keys]), fmt, block)
  ends = np.cumsum([np.size(tree[k]) for k in keys])
  return {k: piece.reshape(np.shape(tree[k]))
          for k, piece in zip(keys, np.split(flat, ends[:-1]), strict=True)}


def summed(values: list[np.ndarray]) -> np.ndarray:
  """The workers' values added one after another in worker order, in float32."""
  total = values[0]
  for v in values[1:]:
    total = (total + v).astype(np.float32)
  return total


def test_reference_quantizer_on_hand_values():
  """The reference itself, on values whose codes can be read off."""
  x = np.array([127.0, 63.5, -0.4, 0.6, 0, 0, 0, 0], np.float32)  # scale 1
  np.testing.assert_array_equal(quantized(x, "int8", 8), [127, 64, -0.0, 1, 0, 0, 0, 0])
  x = np.array([6.0, 2.5, 0.25, -0.75, 5.0, 0, 0, 0], np.float32)  # scale 1: ties to even
  np.testing.assert_array_equal(
    quantized(x, "float4_e2m1fn", 8), [6, 2, 0, -1, 4, 0, 0, 0]
  )
  x = np.array([1.0, 0.375, -0.7, 2.0**-8, 0, 0, 0, 0], np.float32)
  np.testing.assert_array_equal(quantized(x, "e3m0", 8), [1, 0.5, -0.5, 0, 0, 0, 0, 0])


# ----------------------------------------------------------------------------------------------
# Helpers.


def _stack(tree: dict, n: int) -> dict:
  return {k: np.broadcast_to(v, (n, *v.shape)).copy() for k, v in tree.items()}


def _gradients(rng: np.random.RandomState, n: int) -> dict:
  """Per-worker gradients of mixed magnitudes (so blocks get different scales)."""
  grads = {}
  for k, shape in SHAPES.items():
    magnitude = 10.0 ** rng.uniform(-3, 0, (n, *shape))
    grads[k] = (rng.normal(size=(n, *shape)) * magnitude).astype(np.float32)
  return grads


def _diloco(fmt, n, error_feedback, **kwargs):
  return optax_dist.diloco(
    optax.sgd(1.0), optax.sgd(1.0), sync_period=H, axis_name=AXIS, num_workers=n,
    comm_dtype=FORMATS[fmt], comm_block_size=BLOCK, error_feedback=error_feedback, **kwargs,
  )


def _run_diloco_together(cases, syncs=3, seed=0):
  """Runs diloco under vmap for ``syncs`` syncs, for each ``(fmt, n, error_feedback)`` of
  ``cases`` (each from its own generator of ``seed``); a step of every case is one jitted call
  (one program for all the cases instead of one each). Per case, at each sync, what the
  reference needs: (anchor before, the workers' x', the state after, the params after)."""
  rngs = [np.random.RandomState(seed) for _ in cases]
  params = [_stack({k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}, n)
            for rng, (_, n, _) in zip(rngs, cases, strict=True)]
  txs = [_diloco(*case) for case in cases]
  states = [jax.vmap(tx.init, axis_name=AXIS)(p) for tx, p in zip(txs, params, strict=True)]
  step = jax.jit(lambda *args: [jax.vmap(tx.update, axis_name=AXIS)(*a)
                                for tx, a in zip(txs, zip(*args, strict=True), strict=True)])
  synced = [[] for _ in cases]
  for s in range(1, syncs * H + 1):
    grads = [_gradients(rng, n) for rng, (_, n, _) in zip(rngs, cases, strict=True)]
    anchors = [{k: np.asarray(v[0]) for k, v in state.anchor.items()} for state in states]
    x_new = [{k: (p[k] - g[k]).astype(np.float32) for k in p}  # inner SGD(1)
             for p, g in zip(params, grads, strict=True)]
    updates, states = zip(*step(grads, states, params), strict=True)
    params = [{k: np.asarray(v) for k, v in optax.apply_updates(p, u).items()}
              for p, u in zip(params, updates, strict=True)]
    for i in range(len(cases)):
      if s % H == 0:
        synced[i].append((anchors[i], x_new[i], states[i], params[i]))
      else:
        np.testing.assert_array_equal(params[i]["w"], x_new[i]["w"])
  return synced


def _steps_together(txs, n, steps, seed):
  """``steps`` steps of each of ``txs`` under vmap on ``n`` workers, all from the start and
  gradients one generator of ``seed`` draws (as each test drew them for itself), a step of every
  transformation one jitted call (one program for all of them). Per transformation, per step:
  ``(params, state)`` before it, the gradients, and ``(params, state)`` after it."""
  rng = np.random.RandomState(seed)
  start = _stack({k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}, n)
  params = [start] * len(txs)
  states = [jax.vmap(tx.init, axis_name=AXIS)(start) for tx in txs]
  step = jax.jit(lambda grads, states, params: [
    jax.vmap(tx.update, axis_name=AXIS)(grads, s, p)
    for tx, s, p in zip(txs, states, params, strict=True)])
  history = [[] for _ in txs]
  for _ in range(steps):
    grads = _gradients(rng, n)
    updates, new_states = zip(*step(grads, states, params), strict=True)
    new_params = [{k: np.asarray(v) for k, v in optax.apply_updates(p, u).items()}
                  for p, u in zip(params, updates, strict=True)]
    for seen, *at in zip(history, params, states, new_params, new_states, strict=True):
      seen.append((at[0], at[1], grads, at[2], at[3]))
    params, states = new_params, list(new_states)
  return history


# ----------------------------------------------------------------------------------------------
# diloco against the reference.


DILOCO_CASES = [(fmt, n, error_feedback) for fmt in FORMATS for error_feedback in (False, True)
                for n in (2, 4)]


@pytest.fixture(scope="module")
def diloco_syncs():
  return dict(zip(DILOCO_CASES, _run_diloco_together(DILOCO_CASES), strict=True))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "feedback"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_diloco_syncs_match_numpy_reference(diloco_syncs, fmt, error_feedback, n):
  """Each sync: anchor <- anchor - (1/N) sum_j Q(anchor - x'_j [+ r_j]), r_j <- the rest."""
  residual = {k: np.zeros((n, *s), np.float32) for k, s in SHAPES.items()}
  for anchor, x_new, state, params in diloco_syncs[fmt, n, error_feedback]:
    targets = [{k: (anchor[k] - x_new[k][j] + residual[k][j]).astype(np.float32)
                for k in SHAPES} for j in range(n)]  # residual: zeros without feedback
    sent = [quantized_tree(target, fmt, BLOCK) for target in targets]
    for k in SHAPES:
      delta = summed([q[k] for q in sent]) / np.float32(n)
      expected = (anchor[k] - delta).astype(np.float32)
      np.testing.assert_array_equal(np.asarray(state.anchor[k]), _stack({k: expected}, n)[k])
      # x_i <- theta, as x_i + (theta - x_i): to float32 rounding.
      np.testing.assert_allclose(params[k], _stack({k: expected}, n)[k], rtol=1e-6, atol=1e-7)
      if error_feedback:
        residual[k] = np.stack([t[k] - q[k] for t, q in zip(targets, sent)]).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(state.error_feedback[k]), residual[k])
    if not error_feedback:
      assert state.error_feedback is None


@pytest.fixture(scope="module")
def four_syncs():
  """Each format on 4 workers, with and without feedback, 4 syncs of seed 3: one program."""
  cases = [(fmt, 4, error_feedback) for fmt in FORMATS for error_feedback in (False, True)]
  return dict(zip(cases, _run_diloco_together(cases, syncs=4, seed=3), strict=True))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_error_feedback_sent_plus_residual_is_the_pseudo_gradients(four_syncs, fmt):
  """Over K syncs, sum_k sum_j sent + sum_j r_j = sum_k sum_j (anchor_k - x'_jk), where the sent
  sum of sync k is read off the anchor: N (anchor_k - anchor_k+1) (outer SGD of rate 1)."""
  n = 4

  def balance(error_feedback):
    sent = {k: np.zeros(s) for k, s in SHAPES.items()}
    given = {k: np.zeros(s) for k, s in SHAPES.items()}
    for anchor, x_new, state, _ in four_syncs[fmt, n, error_feedback]:
      for k in SHAPES:
        new_anchor = np.asarray(state.anchor[k][0], np.float64)
        sent[k] += n * (anchor[k].astype(np.float64) - new_anchor)
        given[k] += (anchor[k].astype(np.float64) - x_new[k].astype(np.float64)).sum(0)
    held = {
      k: 0.0 if state.error_feedback is None else np.asarray(state.error_feedback[k]).sum(0)
      for k in SHAPES
    }
    return {k: sent[k] + held[k] - given[k] for k in SHAPES}, given

  gap, given = balance(True)
  scale = max(np.abs(g).max() for g in given.values())
  for k in SHAPES:  # float32 rounding of the anchor's updates and of t = delta + r only
    np.testing.assert_allclose(gap[k], 0.0, atol=1e-5 * scale)
  gap, _ = balance(False)  # without feedback the quantization error is lost: far above that
  assert max(np.abs(g).max() for g in gap.values()) > 1e-3 * scale


def _assert_resized_to_the_mean(tx, state, params, residual):
  """``resize_state`` to 2 workers gives each the workers' mean residual."""
  new_state, _ = optax_dist.resize_state(tx, state, params, 2)
  for k, r in residual.items():
    np.testing.assert_allclose(
      np.asarray(new_state.error_feedback[k]), np.broadcast_to(r.mean(0), (2, *r.shape[1:])),
      rtol=1e-6, atol=1e-9,
    )


def test_error_feedback_residual_is_mean_on_resize_and_eval_params_is_the_anchor(diloco_syncs):
  n = 4
  _, (_, _, state, params), _ = diloco_syncs["e3m0", n, True]  # after its second sync
  tx = _diloco("e3m0", n, True)
  residual = {k: np.asarray(v) for k, v in state.error_feedback.items()}
  assert all(np.abs(r).max() > 0 for r in residual.values())
  assert not np.array_equal(residual["w"][0], residual["w"][1])  # each worker's own
  _assert_resized_to_the_mean(tx, state, params, residual)
  # eval_params returns the anchor, the same as without error feedback.
  evaluated = optax_dist.eval_params(state, params)
  jax.tree.map(np.testing.assert_array_equal, evaluated, state.anchor)
  no_feedback = state._replace(error_feedback=None)
  jax.tree.map(
    np.testing.assert_array_equal, optax_dist.eval_params(no_feedback, params), evaluated
  )


def test_default_state_leaves_are_unchanged_and_none_is_an_empty_node():
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  state = optax_dist.diloco(optax.sgd(0.1), sync_period=2).init(params)
  assert state.error_feedback is None
  old_fields = (state.local_step, state.anchor, state.inner_state, state.outer_state)
  assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(old_fields))
  assert optax.tree.norm(optax.tree.zeros_like(state)) == 0  # optax.tree walks it
  on = optax_dist.diloco(optax.sgd(0.1), sync_period=2, comm_dtype=jnp.int8, error_feedback=True)
  residual = on.init(params).error_feedback
  assert jax.tree.map(lambda r: (r.shape, r.dtype), residual) == {
    k: (s, jnp.float32) for k, s in SHAPES.items()
  }


class _FourFieldDiLoCoState(NamedTuple):
  """DiLoCoState as it was before ``error_feedback``: a checkpoint of it is an old one."""

  local_step: Any
  anchor: Any
  inner_state: Any
  outer_state: Any


def test_checkpoints_old_default_state_restores_into_the_four_old_fields(tmp_path):
  """Orbax keys a NamedTuple's fields by name: restoring a checkpoint written before the field
  existed into the new state is a structure mismatch naming ``error_feedback``; restoring into a
  dict of the four old fields and adding ``error_feedback=None`` gives the state back (the field
  adds no leaf). New states round-trip."""
  ocp = pytest.importorskip("orbax.checkpoint")
  params = {k: jnp.arange(math.prod(s), dtype=jnp.float32).reshape(s) for k, s in SHAPES.items()}
  state = optax_dist.diloco(optax.sgd(0.1, momentum=0.9), sync_period=2).init(params)
  old_fields = _FourFieldDiLoCoState._fields
  with ocp.PyTreeCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "old", _FourFieldDiLoCoState(*state[:4]))
    checkpointer.save(tmp_path / "new", state)
    with pytest.raises(ValueError, match="error_feedback"):
      checkpointer.restore(tmp_path / "old", args=ocp.args.PyTreeRestore(item=state))
    item = {k: getattr(state, k) for k in old_fields}
    fields = checkpointer.restore(tmp_path / "old", args=ocp.args.PyTreeRestore(item=item))
    again = checkpointer.restore(tmp_path / "new", args=ocp.args.PyTreeRestore(item=state))
  restored = optax_dist.DiLoCoState(**fields, error_feedback=None)
  for tree in (restored, again):
    assert type(tree) is type(state) and tree.error_feedback is None
    jax.tree.map(np.testing.assert_array_equal, tree, state)


# ----------------------------------------------------------------------------------------------
# shard_map: the bytes on the wire.


def _packed_bytes(num_values: int, fmt: str, block: int) -> int:
  blocks = math.ceil(num_values / block)
  codes = blocks * block if fmt == "int8" else blocks * block // 2  # 4-bit: two per byte
  return codes + 4 * blocks


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_shard_map_sync_gathers_packed_codes_and_scales(fmt):
  n = 4
  mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])
  tx = _diloco(fmt, n, True)
  squeeze = lambda tree: jax.tree.map(lambda a: a[0], tree)
  expand = lambda tree: jax.tree.map(lambda a: a[None], tree)

  def worker_step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  mapped = lambda f: jax.jit(jax.shard_map(
    lambda *a: expand(f(*squeeze(a))), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)
  ))
  init, step = mapped(tx.init), mapped(worker_step)
  put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P(AXIS)))
  rng = np.random.RandomState(1)
  params = put(_stack({k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}, n))
  state = init(params)
  report = optax_dist.communication_report(step, params, state, params)
  assert not report.unconditional, report.unconditional
  assert report.non_communication_step.bytes == 0
  sync = report.communication_step
  assert set(sync.by_kind()) == {"all-gather"}, sync
  sent = _packed_bytes(sum(math.prod(s) for s in SHAPES.values()), fmt, BLOCK)
  assert sync.bytes == sent  # codes (1 or 1/2 byte per value, the last block padded) + scales
  assert sync.count == 2  # the codes and the scales of every leaf at once
  assert sync.result_bytes == n * sent

  # And the values: two syncs on 4 devices give the vmap reference's anchor.
  grads = _gradients(rng, n)
  x_new = {k: np.asarray(params[k]) - grads[k] for k in SHAPES}
  anchor = {k: np.asarray(state.anchor[k])[0] for k in SHAPES}
  for _ in range(H):
    params, state = step(params, state, put(grads))
    grads = jax.tree.map(np.zeros_like, grads)  # the second step leaves x' where it is
  sent_values = [quantized_tree({k: anchor[k] - x_new[k][j] for k in SHAPES}, fmt, BLOCK)
                 for j in range(n)]
  for k in SHAPES:
    expected = anchor[k] - summed([q[k] for q in sent_values]) / np.float32(n)
    np.testing.assert_array_equal(np.asarray(state.anchor[k]), _stack({k: expected}, n)[k])


# ----------------------------------------------------------------------------------------------
# local_sgd, elastic_average, agn.


@pytest.fixture(scope="module")
def local_sgd_runs():
  """local_sgd in each format, 4 workers, two periods from seed 2: one program."""
  txs = [optax_dist.local_sgd(optax.sgd(1.0), sync_period=H, axis_name=AXIS,
                              comm_dtype=FORMATS[fmt], comm_block_size=BLOCK) for fmt in FORMATS]
  return dict(zip(FORMATS, _steps_together(txs, 4, 2 * H, 2), strict=True))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_local_sgd_averages_quantized_params(local_sgd_runs, fmt):
  n = 4
  for s, (before, _, grads, params, _) in enumerate(local_sgd_runs[fmt], start=1):
    x_new = {k: before[k] - grads[k] for k in before}
    sent = [quantized_tree({k: x_new[k][j] for k in SHAPES}, fmt, BLOCK) for j in range(n)]
    for k in SHAPES:
      if s % H:
        np.testing.assert_array_equal(params[k], x_new[k])
        continue
      mean = summed([q[k] for q in sent]) / np.float32(n)
      # x_i + (mean - x_i): the returned update, applied, lands on the mean to float rounding.
      expected = (before[k] + (mean - before[k])).astype(np.float32)
      np.testing.assert_array_equal(params[k], expected)


EA_FORMATS, EA_RATE = ("int8", "e3m0"), 0.25


@pytest.fixture(scope="module")
def elastic_average_runs():
  """elastic_average in each of EA_FORMATS, 2 workers, 3 steps from seed 4: one program."""
  txs = [optax_dist.elastic_average(
    optax.sgd(1.0), communication_period=1, moving_rate=EA_RATE, axis_name=AXIS,
    comm_dtype=FORMATS[fmt], comm_block_size=BLOCK) for fmt in EA_FORMATS]
  return dict(zip(EA_FORMATS, _steps_together(txs, 2, 3, 4), strict=True))


@pytest.mark.parametrize("fmt", EA_FORMATS)
def test_elastic_average_center_receives_quantized_moves(elastic_average_runs, fmt):
  n, alpha = 2, EA_RATE
  for before, state_before, grads, params, state in elastic_average_runs[fmt]:
    center = {k: np.asarray(v[0]) for k, v in state_before.center.items()}
    x_new = {k: before[k] - grads[k] for k in before}
    moves = [{k: (np.float32(alpha) * (x_new[k][j] - center[k])).astype(np.float32)
              for k in SHAPES} for j in range(n)]
    sent = [quantized_tree(move, fmt, BLOCK) for move in moves]
    for k in SHAPES:
      expected = center[k] + summed([q[k] for q in sent])
      np.testing.assert_array_equal(np.asarray(state.center[k]), _stack({k: expected}, n)[k])
      # Each worker subtracts its own exact move.
      np.testing.assert_allclose(
        params[k], x_new[k] - np.stack([m[k] for m in moves]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("center_update", ["mean", "sequential"])
def test_agn_commits_quantized_gradients(center_update):
  n, fmt = 2, "int8"
  tx = optax_dist.agn(
    optax.sgd(1.0), communication_period=1, center_update=center_update, axis_name=AXIS,
    comm_dtype=jnp.int8, comm_block_size=BLOCK,
  )
  rng = np.random.RandomState(5)
  params = _stack({k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}, n)
  state = jax.vmap(tx.init, axis_name=AXIS)(params)
  grads = _gradients(rng, n)
  center = {k: np.asarray(v[0]) for k, v in state.center.items()}
  _, state = jax.jit(jax.vmap(tx.update, axis_name=AXIS))(grads, state, params)
  commits = [quantized_tree({k: grads[k][j] for k in SHAPES}, fmt, BLOCK) for j in range(n)]
  for k in SHAPES:
    sent = [q[k] for q in commits]
    if center_update == "mean":
      expected = center[k] - summed(sent) / np.float32(n)
    else:
      expected = center[k]
      for q in sent:  # one SGD(1) step per worker's commit, in worker order
        expected = (expected - q).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(state.center[k]), _stack({k: expected}, n)[k])


STREAMING_CASES = [(fmt, error_feedback, overlap) for fmt in FORMATS
                   for error_feedback in (False, True) for overlap in (0, 1)]
STREAMING_PERIOD = 4


@pytest.fixture(scope="module")
def streaming_runs():
  """Each case of the test below, 2 workers, 3 periods from the start and gradients of seed 5,
  in one program: ``{case: per step (params before, state before, grads, params after, state
  after)}``."""
  txs = [optax_dist.streaming_diloco(
    optax.sgd(1.0), optax.sgd(1.0), sync_period=STREAMING_PERIOD, num_fragments=2,
    fragments={"b": 1, "w": 0}, overlap=overlap, axis_name=AXIS, comm_dtype=FORMATS[fmt],
    comm_block_size=BLOCK, error_feedback=error_feedback)
    for fmt, error_feedback, overlap in STREAMING_CASES]
  return dict(zip(STREAMING_CASES, _steps_together(txs, 2, 3 * STREAMING_PERIOD, 5),
                  strict=True))


@pytest.mark.parametrize("overlap", [0, 1])
@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "feedback"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_streaming_diloco_matches_numpy_reference(streaming_runs, fmt, error_feedback, overlap):
  """Fragment f ("w" then "b") syncs on its own steps and quantizes t_j = theta_f - x'_j,f (plus
  r_j,f with error feedback, which keeps r_j,f <- t_j - Q(t_j)); theta_f <- theta_f - mean_j
  Q(t_j) lands ``overlap`` steps later; the other fragment's anchor stays."""
  n, sync_period = 2, STREAMING_PERIOD
  history = streaming_runs[fmt, error_feedback, overlap]
  expected = {k: v[0] for k, v in history[0][0].items()}  # the start
  residual = {k: np.zeros((n, *s), np.float32) for k, s in SHAPES.items()}
  landing = {}  # fragment's leaf -> (step, mean)
  for t, (params, _, grads, _, state) in enumerate(history, start=1):
    x_new = {k: (params[k] - grads[k]).astype(np.float32) for k in params}
    for f, k in enumerate(("w", "b")):
      if optax_dist.streaming_diloco_syncs(t, sync_period=sync_period, num_fragments=2,
                                           fragment=f):
        targets = [(expected[k] - x_new[k][j] + residual[k][j]).astype(np.float32)
                   for j in range(n)]
        sent = [quantized(target, fmt, BLOCK) for target in targets]
        if error_feedback:
          residual[k] = np.stack([a - b for a, b in zip(targets, sent)]).astype(np.float32)
        landing[k] = (t + overlap, summed(sent) / np.float32(n))
      if k in landing and landing[k][0] == t:
        expected[k] = (expected[k] - landing.pop(k)[1]).astype(np.float32)
      np.testing.assert_array_equal(np.asarray(state.anchor[k]), _stack({k: expected[k]}, n)[k])


def test_streaming_diloco_error_feedback_is_diloco_with_one_fragment():
  kwargs = dict(sync_period=H, axis_name=AXIS, comm_dtype="int8", comm_block_size=BLOCK,
                error_feedback=True)
  streaming = optax_dist.streaming_diloco(optax.sgd(1.0), optax.sgd(1.0), num_fragments=1,
                                          **kwargs)
  diloco = optax_dist.diloco(optax.sgd(1.0), optax.sgd(1.0), **kwargs)
  rng = np.random.RandomState(2)
  params = _stack({k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}, 2)
  states = [jax.vmap(tx.init, axis_name=AXIS)(params) for tx in (streaming, diloco)]
  steps = [jax.jit(jax.vmap(tx.update, axis_name=AXIS)) for tx in (streaming, diloco)]
  for _ in range(3 * H):
    grads = _gradients(rng, 2)
    for i, step in enumerate(steps):
      _, states[i] = step(grads, states[i], params)
  for k in SHAPES:
    np.testing.assert_array_equal(states[0].anchor[k], states[1].anchor[k])
    np.testing.assert_array_equal(states[0].error_feedback[k], states[1].error_feedback[k])


def test_streaming_diloco_error_feedback_residual_is_mean_on_resize():
  n, rng = 4, np.random.RandomState(6)
  params = _stack({k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}, n)
  tx = optax_dist.streaming_diloco(
    optax.sgd(1.0), optax.sgd(1.0), sync_period=2, num_fragments=2, fragments={"b": 1, "w": 0},
    overlap=1, axis_name=AXIS, comm_dtype="e3m0", comm_block_size=BLOCK, error_feedback=True)
  state = jax.vmap(tx.init, axis_name=AXIS)(params)
  step = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
  for _ in range(4):
    _, state = step(_gradients(rng, n), state, params)
  residual = {k: np.asarray(v) for k, v in state.error_feedback.items()}
  assert not np.array_equal(residual["w"][0], residual["w"][1])  # each worker's own
  _assert_resized_to_the_mean(tx, state, params, residual)


# ----------------------------------------------------------------------------------------------
# Bad inputs.

MAKERS = {
  "diloco": lambda **kw: optax_dist.diloco(optax.sgd(0.1), sync_period=2, **kw),
  "local_sgd": lambda **kw: optax_dist.local_sgd(optax.sgd(0.1), sync_period=2, **kw),
  "elastic_average": lambda **kw: optax_dist.elastic_average(optax.sgd(0.1), **kw),
  "agn": lambda **kw: optax_dist.agn(optax.sgd(0.1), **kw),
  "streaming_diloco": lambda **kw: optax_dist.streaming_diloco(
    optax.sgd(0.1), sync_period=2, num_fragments=1, **kw),
}


@pytest.mark.parametrize("fn", list(MAKERS))
@pytest.mark.parametrize("comm_dtype", ["int8", jnp.int8, "float4_e2m1fn", jnp.float4_e2m1fn,
                                        "e3m0", jnp.bfloat16, None])
def test_comm_dtype_accepts_formats_and_floats(fn, comm_dtype):
  MAKERS[fn](comm_dtype=comm_dtype)


@pytest.mark.parametrize("fn", list(MAKERS))
@pytest.mark.parametrize("bad", [jnp.int32, "int4", "float8"])
def test_comm_dtype_rejects_others_naming_the_choices(fn, bad):
  pattern = (re.escape(f"`{fn}(comm_dtype=...)`") + ".*floating dtype.*jnp.int8.*"
             + "jnp.float4_e2m1fn.*e3m0.*" + re.escape(repr(bad)))
  with pytest.raises(TypeError, match=pattern):
    MAKERS[fn](comm_dtype=bad)


@pytest.mark.parametrize("fn", list(MAKERS))
@pytest.mark.parametrize(
  "fmt,block,error,message",
  [
    ("int8", 0, ValueError, "must be a positive int, got 0"),
    ("int8", -8, ValueError, "must be a positive int, got -8"),
    ("int8", 2.5, TypeError, "must be a positive int, got 2.5"),
    ("int8", True, TypeError, "must be a positive int, got True"),
    ("e3m0", 7, ValueError, "must be even with comm_dtype='e3m0'.*got 7"),
    ("float4_e2m1fn", 33, ValueError, "must be even with comm_dtype='float4_e2m1fn'.*got 33"),
  ],
)
def test_comm_block_size_validated(fn, fmt, block, error, message):
  with pytest.raises(error, match=re.escape(f"`{fn}(comm_block_size=...)` ") + message):
    MAKERS[fn](comm_dtype=FORMATS[fmt], comm_block_size=block)


def test_odd_block_size_is_fine_for_int8():
  optax_dist.diloco(optax.sgd(0.1), comm_dtype=jnp.int8, comm_block_size=7)


@pytest.mark.parametrize("comm_dtype", [None, jnp.bfloat16, jnp.float8_e4m3fn])
def test_error_feedback_needs_a_quantized_format(comm_dtype):
  pattern = re.escape("`diloco(error_feedback=True)` needs a quantized comm_dtype") + ".*got"
  with pytest.raises(ValueError, match=pattern):
    optax_dist.diloco(optax.sgd(0.1), comm_dtype=comm_dtype, error_feedback=True)


def test_error_feedback_must_be_a_bool():
  with pytest.raises(TypeError, match=re.escape("`diloco(error_feedback=...)` must be a bool")):
    optax_dist.diloco(optax.sgd(0.1), comm_dtype=jnp.int8, error_feedback="yes")


def test_local_sgd_refuses_error_feedback_and_points_to_diloco():
  pattern = re.escape("`local_sgd(error_feedback=True)` is not supported") + ".*params themselves.*"
  with pytest.raises(ValueError, match=pattern + re.escape("diloco(inner, optax.sgd(1.0)")):
    optax_dist.local_sgd(optax.sgd(0.1), sync_period=2, comm_dtype=jnp.int8, error_feedback=True)


def test_traced_block_size_under_inject_hyperparams_names_static_args():
  injected = optax.inject_hyperparams(optax_dist.diloco)(
    optax.sgd(0.1), sync_period=2, comm_dtype=jnp.int8
  )
  injected.init(jnp.zeros(4))  # the default block size is left alone
  bad = optax.inject_hyperparams(optax_dist.diloco)(
    optax.sgd(0.1), sync_period=2, comm_dtype=jnp.int8, comm_block_size=8
  )
  state = bad.init(jnp.zeros(4))
  with pytest.raises(TypeError, match=re.escape('static_args=("comm_block_size",)')):
    jax.jit(bad.update)(jnp.ones(4), state, jnp.zeros(4))
  good = optax.inject_hyperparams(optax_dist.diloco, static_args=("comm_block_size",))(
    optax.sgd(0.1), sync_period=2, comm_dtype=jnp.int8, comm_block_size=8
  )
  jax.jit(good.update)(jnp.ones(4), good.init(jnp.zeros(4)), jnp.zeros(4))
