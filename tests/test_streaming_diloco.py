"""streaming_diloco against a float64 NumPy reference, torchft's fixture numbers, the sync schedule,
fragments, mixing, its exchange dtype and bad inputs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _diloco_reference import (
  ATOL,
  ATOL_ADAM,
  AXIS,
  COMM_DTYPES,
  INNERS,
  OUTERS,
  RTOL,
  SHAPES,
  N,
  assert_eval_params_is_anchor,
  assert_history_close,
  assert_identical_on_workers,
  error,
  exchange_bytes,
  integer_plus_a_little,
  problem,
  rounded,
  run,
  steps,
  streaming_reference,
)

import optax_dist

# ----------------------------------------------------------------------------------------------
# Against the reference, equivalence with diloco.


STREAMING_CONFIGS = [
  # mapping, inner, outer, sync_period, num_fragments, explicit fragments, mixing
  ("vmap", "momentum", "nesterov", 3, 2, None, 0.5),
  ("vmap", "adam", "nesterov", 4, 3, None, 0.0),
  ("vmap", "sgd", "sgd1", 2, 3, None, 0.5),  # H < F: fragments 0 and 2 share even steps
  ("shard_map", "adam", "nesterov", 3, 2, {"a": 1, "b": 0, "c": 1}, 0.5),
  ("shard_map", "momentum", "sgd1", 4, 3, {"a": 2, "b": 0, "c": 1}, 0.0),
]


@pytest.mark.parametrize(
  "mapping,inner,outer,sync_period,num_fragments,fragments,mixing", STREAMING_CONFIGS
)
def test_streaming_diloco_matches_numpy_reference(
  mapping, inner, outer, sync_period, num_fragments, fragments, mixing
):
  x0, c, d = problem(1)
  tx = optax_dist.streaming_diloco(
    INNERS[inner][0](), OUTERS[outer][0](), sync_period=sync_period,
    num_fragments=num_fragments, fragments=fragments, mixing=mixing, axis_name=AXIS,
  )
  history, state = run(tx, x0, c, d, mapping)
  # Default assignment of three equal leaves: F=1 -> 0,0,0; F=2 -> 0,0,1; F=3 -> 0,1,2.
  ids = fragments or dict(zip(x0, [(num_fragments * 4 * j) // 12 for j in range(3)]))
  reference, anchor = streaming_reference(
    INNERS[inner][1](), OUTERS[outer][1](), x0, c, d, sync_period=sync_period, ids=ids,
    mixing=mixing,
  )
  atol = ATOL_ADAM if inner == "adam" else ATOL
  assert_history_close(history, reference, atol=atol)
  assert_identical_on_workers(state.anchor)
  for k in anchor:
    np.testing.assert_allclose(np.asarray(state.anchor[k])[0], anchor[k], RTOL, atol)
  assert_eval_params_is_anchor(state, history)


@pytest.mark.parametrize("inner", ["momentum"])
def test_streaming_diloco_with_one_fragment_is_diloco(inner):
  x0, c, d = problem(4)
  kwargs = {"sync_period": 3, "axis_name": AXIS}
  history_d, state_d = run(optax_dist.diloco(INNERS[inner][0](), **kwargs), x0, c, d)
  history_s, state_s = run(
    optax_dist.streaming_diloco(INNERS[inner][0](), num_fragments=1, **kwargs), x0, c, d
  )
  for k in x0:
    np.testing.assert_array_equal(history_s[k], history_d[k])
  for a, b in zip(jax.tree.leaves(state_s.anchor), jax.tree.leaves(state_d.anchor), strict=True):
    np.testing.assert_array_equal(a, b)
  assert len(state_s.outer_state) == 1
  for a, b in zip(
    jax.tree.leaves(state_s.outer_state[0]), jax.tree.leaves(state_d.outer_state), strict=True
  ):
    np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------------------------
# Numbers asserted by torchft's own test.


# torchft's diloco_regression_test (test_diloco_mocked_updates, no delay): two replicas, two
# one-element layers in two fragments starting at 1, gradient 2, inner SGD lr 1, outer SGD lr 2,
# sync_every 6, fragment_update_alpha = mixing. Params before each of 16 steps, and the global
# params at steps 3, 6, 9, 12 (its fixture files).
TORCHFT = {
  0.0: (
    [1, -1, -3, -11, -13, -15, -17, -19, -21, -35, -37, -39, -41, -43, -45, -59],
    [1, -1, -3, -5, -7, -9, -23, -25, -27, -29, -31, -33, -47, -49, -51, -53],
    {3: (-11, 1), 6: (-11, -23), 9: (-35, -23), 12: (-35, -47)},
  ),
  0.5: (
    [1, -1, -3, -8, -10, -12, -14, -16, -18, -24.5, -26.5, -28.5, -30.5, -32.5, -34.5, -40.25],
    [1, -1, -3, -5, -7, -9, -17, -19, -21, -23, -25, -27, -32, -34, -36, -38],
    {3: (-11, 1), 6: (-11, -23), 9: (-29, -23), 12: (-29, -35)},
  ),
  1.0: (
    [1 - 2 * t for t in range(16)],
    [1 - 2 * t for t in range(16)],
    {3: (-11, 1), 6: (-11, -23), 9: (-23, -23), 12: (-23, -23)},
  ),
}


@pytest.mark.parametrize("mixing", sorted(TORCHFT))
def test_torchft_streaming_fixture(mixing):
  layer0, layer1, anchors = TORCHFT[mixing]
  tx = optax_dist.streaming_diloco(
    optax.sgd(1.0), optax.sgd(2.0), sync_period=6, num_fragments=2, mixing=mixing, axis_name=AXIS
  )
  params = {k: np.ones((2, 1, 1), np.float32) for k in ("layers.0.weight", "layers.1.weight")}
  state = jax.jit(jax.vmap(tx.init, axis_name=AXIS))(params)
  step = jax.jit(jax.vmap(sgd_step(tx), axis_name=AXIS))
  grads = jax.tree.map(lambda p: np.full_like(p, 2.0), params)
  for t in range(16):
    got = [np.asarray(params[k])[:, 0, 0] for k in sorted(params)]
    np.testing.assert_array_equal(got[0], [layer0[t]] * 2, err_msg=f"layer 0, step {t}")
    np.testing.assert_array_equal(got[1], [layer1[t]] * 2, err_msg=f"layer 1, step {t}")
    if t in anchors:
      anchor = [np.asarray(state.anchor[k])[:, 0, 0] for k in sorted(params)]
      np.testing.assert_array_equal(np.stack(anchor, 1), [anchors[t]] * 2)
    params, state = step(grads, state, params)


# ----------------------------------------------------------------------------------------------
# Schedules, fragments and per-fragment outer state.


def sgd_step(tx):
  """``(grads, state, params) -> (params, state)``: ``tx``'s update applied."""

  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def synced_steps(tx, params, steps):
  """For each leaf, the steps on which its anchor changed (one worker, gradients -1)."""
  state = jax.jit(tx.init)(params)
  step = jax.jit(sgd_step(tx))
  grads = jax.tree.map(lambda p: -np.ones_like(p), params)
  changes = {k: [] for k in params}
  for t in range(1, steps + 1):
    before = state.anchor
    params, state = step(grads, state, params)
    for k in params:
      if not np.array_equal(before[k], state.anchor[k]):
        changes[k].append(t)
  return changes


@pytest.mark.parametrize(
  "sync_period,num_fragments,expected",
  [
    (4, 1, [[4, 8, 12]] * 3),
    (4, 3, [[1, 5, 9], [2, 6, 10], [4, 8, 12]]),  # s_f = 1, 2, 4
    (6, 2, [[3, 9], [3, 9], [6, 12]]),  # s_f = 3, 6; leaves in fragments 0, 0, 1
    (2, 3, [[2, 4, 6, 8, 10, 12], [1, 3, 5, 7, 9, 11], [2, 4, 6, 8, 10, 12]]),  # H < F
    (1, 3, [list(range(1, 13))] * 3),
  ],
)
def test_streaming_sync_schedule(sync_period, num_fragments, expected):
  params = {k: np.zeros(4, np.float32) for k in "abc"}
  tx = optax_dist.streaming_diloco(
    optax.sgd(1.0), optax.sgd(1.0), sync_period=sync_period, num_fragments=num_fragments
  )
  changes = synced_steps(tx, params, 12)
  assert [changes[k] for k in sorted(params)] == expected


@pytest.mark.parametrize(
  "sizes,num_fragments,expected",
  [
    ([5, 5, 5, 5], 4, (0, 1, 2, 3)),
    ([10, 1, 1, 1, 7], 2, (0, 1, 1, 1, 1)),  # c_j = 0, 10, 11, 12, 13 of 20
    ([1, 1, 1, 1, 16], 2, (0, 0, 0, 0, 0)),  # fragment 1 would be empty: raises
    ([3, 4, 6], 3, (0, 0, 1)),  # c_j = 0, 3, 7 of 13: fragment 2 empty, raises
  ],
)
def test_default_fragment_assignment(sizes, num_fragments, expected):
  params = {f"p{j}": np.zeros(s, np.float32) for j, s in enumerate(sizes)}
  tx = optax_dist.streaming_diloco(optax.sgd(0.1), num_fragments=num_fragments)
  if len(set(expected)) < num_fragments:
    pattern = (
      re.escape("`streaming_diloco(num_fragments=...)` must leave no fragment empty, got")
      + f" {num_fragments} fragments for {len(sizes)} param leaves of sizes "
      + re.escape(str(sizes))
      + ".*explicit `fragments=`"
    )
    with pytest.raises(ValueError, match=pattern):
      tx.init(params)
    return
  assert optax_dist.streaming_diloco_fragments(params, num_fragments) == expected
  state = jax.eval_shape(tx.init, params)
  for f, outer_state in enumerate(state.outer_state):  # masked like optax.masked
    trace = outer_state[0].trace
    for j, k in enumerate(sorted(params)):
      assert isinstance(trace[k], optax.MaskedNode) == (expected[j] != f)


def test_outer_state_advances_only_on_its_fragment_sync():
  params = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
  tx = optax_dist.streaming_diloco(optax.sgd(0.1), sync_period=4, num_fragments=2)  # s_f = 2, 4
  state = jax.jit(tx.init)(params)
  step = jax.jit(sgd_step(tx))
  grads = {"a": -np.ones(2, np.float32), "b": -np.ones(2, np.float32)}
  traces = []
  for _ in range(4):
    params, state = step(grads, state, params)
    traces.append([state.outer_state[0][0].trace["a"][0], state.outer_state[1][0].trace["b"][0]])
  traces = np.asarray(traces)
  np.testing.assert_array_equal(traces[:2, 1], 0.0)  # fragment 1 untouched before step 4
  np.testing.assert_array_equal(traces[0, 0], 0.0)
  assert traces[1, 0] != 0 and traces[2, 0] == traces[1, 0] and traces[3, 0] == traces[1, 0]
  assert traces[3, 1] != 0
  assert isinstance(state.outer_state[0][0].trace["b"], optax.MaskedNode)
  assert isinstance(state.outer_state[1][0].trace["a"], optax.MaskedNode)


# ----------------------------------------------------------------------------------------------
# Bad inputs.


@pytest.mark.parametrize("value,exc", [(-0.1, ValueError), (1.5, ValueError), ("x", TypeError)])
def test_mixing_must_be_in_unit_interval(value, exc):
  with pytest.raises(exc, match=re.escape("`streaming_diloco(mixing=...)`") + ".*got"):
    optax_dist.streaming_diloco(optax.sgd(0.1), mixing=value)
  if exc is ValueError:
    with pytest.raises(exc, match=error("streaming_diloco", "mixing", "in [0, 1]", value)):
      optax_dist.streaming_diloco(optax.sgd(0.1), mixing=value)


@pytest.mark.parametrize("value,exc", [(0, ValueError), (2.0, TypeError)])
def test_num_fragments_must_be_a_positive_int(value, exc):
  with pytest.raises(
    exc, match=error("streaming_diloco", "num_fragments", "must be a positive int", value)
  ):
    optax_dist.streaming_diloco(optax.sgd(0.1), num_fragments=value)


def test_num_fragments_above_the_leaf_count():
  tx = optax_dist.streaming_diloco(optax.sgd(0.1), num_fragments=3)
  pattern = (
    re.escape("`streaming_diloco(num_fragments=...)` must leave no fragment empty, got 3")
    + r" fragments for 2 param leaves of sizes \[2, 5\]"
  )
  with pytest.raises(ValueError, match=pattern):
    tx.init({"a": jnp.zeros(2), "b": jnp.zeros(5)})


def test_explicit_fragments_are_checked():
  def make(fragments, num_fragments=2):
    return optax_dist.streaming_diloco(
      optax.sgd(0.1), num_fragments=num_fragments, fragments=fragments
    )

  with pytest.raises(ValueError, match=re.escape("ids must be in [0, num_fragments) = [0, 2),")
                     + r" got 2 at \['b'\]"):
    make({"a": 0, "b": 2})
  with pytest.raises(TypeError, match=re.escape("`streaming_diloco(fragments=...)` must hold an")
                     + r".*got 'x' at \['a'\]"):
    make({"a": "x", "b": 1})
  params = {"a": jnp.zeros(2), "b": jnp.zeros(5)}
  with pytest.raises(ValueError, match=re.escape("`streaming_diloco(fragments=...)` must have the")
                     + ".*PyTreeDef"):
    make({"a": 0, "c": 1}).init(params)
  with pytest.raises(ValueError, match=re.escape("assigns no leaf to fragment 1 of num_fragments=3")):
    make({"a": 0, "b": 2}, num_fragments=3).init(params)
  state = make({"a": 1, "b": 0}).init(params)
  assert isinstance(state.outer_state[0][0].trace["a"], optax.MaskedNode)
  assert isinstance(state.outer_state[1][0].trace["b"], optax.MaskedNode)


# ----------------------------------------------------------------------------------------------
# Mixing with alpha and 1 - alpha apart; the exchange in comm_dtype.


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
def test_mixing_weighs_the_workers_params_by_alpha(mapping):
  """At alpha = 0.3 (alpha and 1 - alpha differ, unlike 0.5) a synced leaf becomes
  ``0.3 x' + 0.7 theta``, as the NumPy reference computes it, on every sync of both fragments."""
  x0, c, d = problem(5)
  tx = optax_dist.streaming_diloco(
    INNERS["momentum"][0](), OUTERS["nesterov"][0](), sync_period=3, num_fragments=2,
    mixing=0.3, axis_name=AXIS,
  )
  history, state = run(tx, x0, c, d, mapping)
  ids = dict(zip(x0, [0, 0, 1]))  # the default assignment of three equal leaves to 2 fragments
  reference, anchor = streaming_reference(
    INNERS["momentum"][1](), OUTERS["nesterov"][1](), x0, c, d, sync_period=3, ids=ids,
    mixing=0.3,
  )
  assert_history_close(history, reference)
  for k in anchor:
    np.testing.assert_allclose(np.asarray(state.anchor[k])[0], anchor[k], RTOL, ATOL)
  # After a sync the workers still differ (by 0.3 of their own progress), unlike mixing 0.
  assert not np.allclose(history["c"][2, 0], history["c"][2, 1])


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
@pytest.mark.parametrize("comm", sorted(COMM_DTYPES))
def test_comm_dtype_rounds_each_fragment_s_pseudo_gradients(comm, mapping):
  """From x0 = 0, inner SGD 1, outer SGD 1 and constant gradients g: fragment 0 syncs on step 1
  (pseudo-gradients g_i), fragment 1 on step 2 (2 g_i). Each is rounded to ``comm_dtype`` before
  the exchange: the anchor becomes minus the mean of the rounded values, exactly."""
  grads = integer_plus_a_little(13)
  fragments = {"a": 0, "b": 1, "c": 1}
  tx = optax_dist.streaming_diloco(
    optax.sgd(1.0), optax.sgd(1.0), sync_period=2, num_fragments=2, fragments=fragments,
    axis_name=AXIS, comm_dtype=COMM_DTYPES[comm],
  )
  (params1, state1), (params2, state2) = steps(tx, [grads, grads], mapping)
  for k, g in grads.items():
    synced = 1 if fragments[k] == 0 else 2
    expected = -rounded(synced * g, comm).sum(axis=0) / N
    assert np.all(np.abs(expected + synced * g.astype(np.float64).mean(axis=0)) > 1e-3)
    state, params = (state1, params1) if synced == 1 else (state2, params2)
    np.testing.assert_array_equal(np.asarray(state.anchor[k], np.float64), [expected] * N)
    np.testing.assert_array_equal(np.asarray(params[k], np.float64), [expected] * N)
    np.testing.assert_array_equal(state2.anchor[k], state.anchor[k])  # fragment 0 kept on step 2


def test_comm_dtype_sets_the_bytes_of_each_fragment_s_sync():
  params_bytes = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
  got = exchange_bytes(
    lambda dtype: optax_dist.streaming_diloco(
      optax.sgd(0.1), sync_period=3, num_fragments=3, axis_name=AXIS, comm_dtype=dtype
    )
  )
  assert got == {
    "float32": (("all-reduce",), params_bytes, params_bytes),
    "bfloat16": (("all-reduce",), params_bytes // 2, params_bytes // 2),
    "float8_e4m3fn": (("all-gather",), params_bytes // 4, N * params_bytes // 4),
  }
