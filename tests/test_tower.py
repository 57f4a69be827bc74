"""tower, all_reduce and split_batch: TF's replicate_model_fn numbers, a NumPy reference, 2-D
meshes, 8-bit communication and bad inputs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_all_equal, assert_near, error, sgd
from _multiworker import (
  INNERS,
  NUM_WORKERS,
  SHAPES,
  Mapped,
  add,
  assert_close,
  assert_identical_on_workers,
  initial_params,
  random_grads,
  scale,
  stack,
  worker,
)
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

AXIS = "w"


# ----------------------------------------------------------------------------------------------
# TF's TowerOptimizer tests (replicate_model_fn_test.py): features [[1], [2]], labels
# [[1], [2]], two towers of one row each, c = 10, loss |x c - y| summed.


NUM_TOWERS = 2


MAPPINGS = ("vmap", "shard_map_per_tower", "shard_map_replicated")


def _tower_mesh():
  return Mesh(np.array(jax.devices()[:NUM_TOWERS]), ("t",))


def run_towers(mapping, step, params, batch):
  """Runs ``step(params, batch) -> (params, aux)`` once per tower on the towers' shards.

  ``batch`` leaves are ``[NUM_TOWERS, ...]`` (from ``split_batch``); ``params`` are the same on
  every tower. Returns per-tower params (leading tower axis) and the first tower's ``aux``
  (``aux`` must be reduced over the towers by ``step``), after checking that every tower holds the
  same params.
  """
  tile = lambda tree: jax.tree.map(lambda p: jnp.stack([p] * NUM_TOWERS), tree)
  if mapping == "vmap":
    new_params, aux = jax.jit(jax.vmap(step, axis_name="t"))(tile(params), batch)
    aux = jax.tree.map(lambda a: a[0], aux)
  else:
    mesh = _tower_mesh()
    sharded = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
    squeeze = lambda tree: jax.tree.map(lambda a: a[0], tree)
    expand = lambda tree: jax.tree.map(lambda a: a[None], tree)
    if mapping == "shard_map_per_tower":

      def fn(p, b):
        new_params, aux = step(squeeze(p), squeeze(b))
        return expand(new_params), aux

      params_in, param_spec = sharded(tile(params), P("t")), P("t")
    else:  # params replicated with P(): autodiff sums the gradient over the towers.
      fn = lambda p, b: step(p, squeeze(b))
      params_in, param_spec = sharded(params, P()), P()
    mapped = jax.shard_map(
      fn, mesh=mesh, in_specs=(param_spec, P("t")), out_specs=(param_spec, P())
    )
    new_params, aux = jax.jit(mapped)(params_in, sharded(batch, P("t")))
    if mapping == "shard_map_replicated":
      new_params = tile(new_params)
  for leaf in jax.tree.leaves(new_params):
    for k in range(1, NUM_TOWERS):
      assert_all_equal(leaf[0], leaf[k])
  return new_params, aux


def abs_loss(var, x, y):
  return jnp.sum(jnp.abs(x * var - y))


def tower_train_step(txs, loss_fn, reduce_loss):
  """One tower step: each ``tx`` of ``txs`` in turn, on the gradient of ``loss_fn``.

  Returns the new params and the reported loss: the towers' losses at the params before the
  step, reduced by ``reduce_loss`` (``psum`` for TF's SUM, ``pmean`` otherwise).
  """

  def step(params, batch):
    x, y = batch["features"], batch["labels"]
    reported = reduce_loss(loss_fn(params, x, y), "t")
    for tx in txs:
      grads = jax.grad(loss_fn)(params, x, y)
      updates, _ = tx.update(grads, tx.init(params), params)
      params = optax.apply_updates(params, updates)
    return params, reported

  return step


def tf_batch(features=((1.0,), (2.0,)), labels=None):
  labels = features if labels is None else labels
  batch = {"features": jnp.array(features), "labels": jnp.array(labels)}
  return optax_dist.split_batch(batch, NUM_TOWERS)


def c_loss(params, x, y):
  return abs_loss(params["c"], x, y)


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_tower_train_sum(mapping):
  """``ReplicateModelTest.test_train``: loss 27, c = 10 - (1 + 2) = 7."""
  tx = optax_dist.tower(optax.sgd(1.0), "t", reduction="sum")
  params = {"c": jnp.array(10.0)}
  step = tower_train_step([tx], c_loss, jax.lax.psum)
  params, loss = run_towers(mapping, step, params, tf_batch())
  assert loss == (1.0 * 10 - 1.0) + (2.0 * 10 - 2.0)
  assert params["c"][0] == 7.0


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_tower_train_mean(mapping):
  """``test_train_with_mean_reduction``: loss 13.5, c = 10 - (0.5 + 1) = 8.5; a variable outside
  the loss (gradient zero, TF's None gradient) stays at 1."""
  tx = optax_dist.tower(optax.sgd(1.0), "t", reduction="mean")
  params = {"c": jnp.array(10.0), "another_variable": jnp.array(1.0)}
  step = tower_train_step([tx], c_loss, jax.lax.pmean)
  params, loss = run_towers(mapping, step, params, tf_batch())
  assert loss == ((1.0 * 10 - 1.0) + (2.0 * 10 - 2.0)) / 2.0
  assert params["c"][0] == 8.5
  assert params["another_variable"][0] == 1.0


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_tower_two_steps(mapping):
  """``test_train_two_steps_collected_gradients_are_reset_between_steps``: losses 27 then 24,
  c 7 then 3 (features and labels [[1], [2]], then [[1.5], [2.5]])."""
  tx = optax_dist.tower(optax.sgd(1.0), "t", reduction="sum")
  step = tower_train_step([tx], c_loss, jax.lax.psum)
  params = {"c": jnp.array(10.0)}
  expected_losses = ((1.0 * 10 - 1.0) + (2.0 * 10 - 2.0), (1.5 * 7.0 - 1.5) + (2.5 * 7.0 - 2.5))
  expected_c = (10.0 - 3.0, 7.0 - 4.0)
  for features, loss_want, c_want in zip(
    (((1.0,), (2.0,)), ((1.5,), (2.5,))), expected_losses, expected_c
  ):
    params, loss = run_towers(mapping, step, params, tf_batch(features))
    params = jax.tree.map(lambda a: a[0], params)
    assert loss == loss_want
    assert params["c"] == c_want


def test_tower_single_tower_passes_through():
  """``test_train_single_tower``: one device, default reduction, no scaling: loss 27, c = 7.

  With ``axis_name=None`` (one tower, TF's no-replication case) the updates pass through
  unreduced."""
  tx = optax_dist.tower(optax.sgd(1.0), None)
  params = {"c": jnp.array(10.0)}
  x, y = jnp.array([[1.0], [2.0]]), jnp.array([[1.0], [2.0]])
  loss, grads = jax.value_and_grad(c_loss)(params, x, y)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  params = optax.apply_updates(params, updates)
  assert loss == (1.0 * 10 - 1.0) + (2.0 * 10 - 2.0)
  assert params["c"] == 7.0


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_tower_two_optimizers(mapping):
  """``ReplicateWithTwoOptimizersTest.test_train``: GD(1) then Adam(1), both tower-wrapped with
  SUM: c = 10 - 3 - 1 = 6 (Adam's first step is -lr g / (|g| + eps)), loss 27.

  In float64 like TF's ``c``: in float32, optax's Adam bias correction ``1 - 0.999`` alone is
  off by 1e-5 relative, more than TF's 1e-6.
  """
  with jax.enable_x64(True):
    first = optax_dist.tower(optax.sgd(1.0), "t", reduction="sum")
    second = optax_dist.tower(optax.adam(1.0), "t", reduction="sum")
    step = tower_train_step([first, second], c_loss, jax.lax.psum)
    batch = jax.tree.map(lambda a: a.astype(jnp.float64), tf_batch())
    params, loss = run_towers(mapping, step, {"c": jnp.array(10.0, jnp.float64)}, batch)
    assert params["c"].dtype == jnp.float64
    assert loss == (1.0 * 10 - 1.0) + (2.0 * 10 - 2.0)
    assert_near(6.0, params["c"][0], 1e-6)


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_tower_two_losses_one_optimizer_each(mapping):
  """``ReplicateWithTwoLossesAndOneOptimizer.test_train``: c = 10, d = 2, losses |x c - y| and
  |x d - y| minimised by two tower-wrapped GD(1) with SUM: loss 30, c = 7, d = -1."""
  first = optax_dist.tower(optax.sgd(1.0), "t", reduction="sum")
  second = optax_dist.tower(optax.sgd(1.0), "t", reduction="sum")

  def step(params, batch):
    x, y = batch["features"], batch["labels"]
    loss = abs_loss(params["c"], x, y) + abs_loss(params["d"], x, y)
    reported = jax.lax.psum(loss, "t")
    for tx, name in ((first, "c"), (second, "d")):
      var = params[name]
      grad = jax.grad(abs_loss)(var, x, y)
      updates, _ = tx.update(grad, tx.init(var), var)
      params = {**params, name: optax.apply_updates(var, updates)}
    return params, reported

  params = {"c": jnp.array(10.0), "d": jnp.array(2.0)}
  params, loss = run_towers(mapping, step, params, tf_batch())
  assert loss == (1.0 * 10 - 1.0 + 1.0 * 2.0 - 1.0) + (2.0 * 10 - 2.0 + 2.0 * 2.0 - 2.0)
  assert_near(7.0, params["c"][0], 1e-6)
  assert_near(-1.0, params["d"][0], 1e-6)


# ----------------------------------------------------------------------------------------------
# TF's SplitBatchTest.


@pytest.mark.parametrize(
  "num_towers, expected",
  [
    (2, [[0.0, 1.0], [2.0, 3.0]]),
    (4, [[0.0], [1.0], [2.0], [3.0]]),
    (1, [[0.0, 1.0, 2.0, 3.0]]),
  ],
)
def test_split_batch_simple(num_towers, expected):
  shards = optax_dist.split_batch(jnp.array([0.0, 1.0, 2.0, 3.0]), num_towers)
  assert_all_equal(expected, shards)


def test_split_batch_dict_per_key():
  batch = {"first": jnp.array([0.0, 1.0, 2.0, 3.0]), "second": jnp.array([4.0, 5.0, 6.0, 7.0])}
  shards = optax_dist.split_batch(batch, 2)
  assert_all_equal([[0.0, 1.0], [2.0, 3.0]], shards["first"])
  assert_all_equal([[4.0, 5.0], [6.0, 7.0]], shards["second"])


def test_split_batch_labels_dict():
  labels = {"first": jnp.array([10.0, 11.0]), "second": jnp.array([12.0, 13.0])}
  shards = optax_dist.split_batch(labels, 2)
  assert_all_equal([10.0], shards["first"][0])
  assert_all_equal([12.0], shards["second"][0])
  assert_all_equal([11.0], shards["first"][1])
  assert_all_equal([13.0], shards["second"][1])


def test_split_batch_not_divisible():
  """``test_batch_size_that_is_not_divisible_by_the_number_of_gpus``: 3 rows, 2 towers."""
  with pytest.raises(ValueError, match=r"(?s)batch size.*divisible.*number of workers") as info:
    optax_dist.split_batch({"x": jnp.ones((3, 1))}, 2)
  assert "3" in str(info.value) and "2" in str(info.value)


# ----------------------------------------------------------------------------------------------
# Four workers against a NumPy reference: every worker takes the same inner step on the
# sum or mean of the workers' gradients.


@pytest.mark.parametrize(
  "mapping, reduction, inner_name",
  [
    ("vmap", "mean", "sgd"),
    ("vmap", "sum", "momentum"),
    ("vmap", "mean", "adam"),
    ("shard_map", "sum", "sgd"),
    ("shard_map", "mean", "momentum"),
    ("shard_map", "sum", "adam"),
  ],
)
def test_tower_matches_numpy(mapping, reduction, inner_name):
  make_inner, make_np_inner, _ = INNERS[inner_name]
  tx = optax_dist.tower(make_inner(), "w", reduction=reduction)
  mapped = Mapped(tx, mapping)
  x = initial_params()
  np_inner = make_np_inner()
  np_state = np_inner.init(x)
  params = mapped.put(stack([x] * NUM_WORKERS))
  state = mapped.init(params)
  for grads in random_grads(num_steps=4):
    params, state = mapped.step(params, state, stack(grads))
    total = {k: sum(g[k] for g in grads) for k in SHAPES}
    reduced = total if reduction == "sum" else scale(1.0 / NUM_WORKERS, total)
    u, np_state = np_inner.update(reduced, np_state)
    x = add(x, u)
    assert_identical_on_workers(params)
    assert_close(worker(params, 0), x)


# ----------------------------------------------------------------------------------------------
# A tuple axis on a 2-D mesh, 8-bit communication.


TUPLE_AXIS_SPECS = [P(), P("hosts"), P("gpus"), P(("hosts", "gpus"))]


def _tuple_axis_updates(mesh, reduction, params_spec, hierarchical):
  """sgd(1)'s updates of the per-tower gradients 1..4 on ``mesh`` (unjitted) and its inputs."""
  tx = optax_dist.tower(optax.sgd(1.0), ("hosts", "gpus"), reduction=reduction,
                        hierarchical=hierarchical)
  n_params = int(np.prod([mesh.shape[a] for a in jax.tree.leaves(tuple(params_spec))]))
  params = jax.device_put(jnp.zeros(n_params), NamedSharding(mesh, params_spec))
  x = jax.device_put(jnp.arange(1.0, 5.0), NamedSharding(mesh, P(("hosts", "gpus"))))

  def step(p, x):
    grads = jax.grad(lambda p: jnp.sum(p[0] * x))(p)
    updates, _ = tx.update(grads, tx.init(p), p)
    return updates

  return jax.shard_map(step, mesh=mesh, in_specs=(params_spec, P(("hosts", "gpus"))),
                       out_specs=params_spec), (params, x)


@pytest.fixture(scope="module")
def tuple_axis_updates():
  """Every case of the test below on one 2x2 mesh, all compiled as one program."""
  mesh = jax.make_mesh((2, 2), ("hosts", "gpus"))
  cases = [(reduction, spec, hierarchical) for reduction in ("sum", "mean")
           for spec in TUPLE_AXIS_SPECS for hierarchical in (False, True)]
  fns, args = zip(*(_tuple_axis_updates(mesh, *case) for case in cases), strict=True)
  updates = jax.jit(lambda args: [fn(*a) for fn, a in zip(fns, args, strict=True)])(list(args))
  return dict(zip(cases, updates, strict=True))


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("reduction,expected", [("sum", -10.0), ("mean", -2.5)])
@pytest.mark.parametrize("params_spec", TUPLE_AXIS_SPECS)
def test_tower_tuple_axis_counts_each_tower_once(
  tuple_axis_updates, reduction, expected, params_spec, hierarchical
):
  """Per-tower gradients 1..4 on a 2x2 mesh: sum -10, mean -2.5 with sgd(1), whichever axes the
  params are replicated over (autodiff has then summed over those; the psum runs over the rest),
  flat or hierarchical."""
  updates = tuple_axis_updates[reduction, params_spec, hierarchical]
  n_params = 2 ** len(jax.tree.leaves(tuple(params_spec)))  # a param per device it spans
  np.testing.assert_allclose(updates, np.full(n_params, expected))


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
def test_tower_float8_comm_dtype_sums_quantized_values_in_float32(mapping):
  """Each tower's gradient is rounded to float8 once and the sum is exact in float32: no
  rounding after each addition, no NaN past float8_e4m3fn's 448."""
  n = 8
  tx = optax_dist.tower(optax.sgd(1.0), AXIS, reduction="sum", comm_dtype=jnp.float8_e4m3fn)
  grads = jnp.asarray(np.random.default_rng(0).uniform(50, 200, (n, 16)), jnp.float32)

  def step(g):
    return tx.update(g, tx.init(g))[0]

  if mapping == "vmap":
    got = jax.jit(jax.vmap(step, axis_name=AXIS))(grads)
  else:
    mesh = jax.make_mesh((n,), (AXIS,))
    got = jax.jit(jax.shard_map(lambda g: step(g[0])[None], mesh=mesh, in_specs=P(AXIS),
                                out_specs=P(AXIS)))(
      jax.device_put(grads, NamedSharding(mesh, P(AXIS))))
  quantized = np.asarray(grads.astype(jnp.float8_e4m3fn).astype(jnp.float32))
  want = -quantized.sum(axis=0)  # well past 448
  assert np.all(np.abs(want) > 448)
  np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(want, got.shape))


# ----------------------------------------------------------------------------------------------
# Bad inputs.


@pytest.mark.parametrize(
  "fn,make",
  [
    ("all_reduce", lambda r: optax_dist.all_reduce(AXIS, reduction=r)),
    ("tower", lambda r: optax_dist.tower(sgd(), AXIS, reduction=r)),
  ],
)
def test_reduction_must_be_mean_or_sum(fn, make):
  with pytest.raises(
    ValueError, match=error(fn, "reduction", "must be one of 'mean', 'sum'", "avg")
  ):
    make("avg")


@pytest.mark.parametrize("batch,towers", [(5, 2), (6, 4), (3, 8)])
def test_split_batch_size_must_divide(batch, towers):
  pattern = re.escape(
    f"`split_batch`: the batch size must be divisible by the number of workers, got batch size"
    f" {batch} and {towers} workers."
  )
  with pytest.raises(ValueError, match=pattern):
    optax_dist.split_batch({"x": np.zeros((batch, 2))}, towers)


def test_split_batch_rejects_scalars_and_bad_tower_counts():
  with pytest.raises(ValueError, match=re.escape("`split_batch`: the leaf at ['y'] is a scalar")):
    optax_dist.split_batch({"x": np.zeros(4), "y": np.float32(1.0)}, 2)
  with pytest.raises(
    ValueError, match=error("split_batch", "num_workers", "must be a positive int", 0)
  ):
    optax_dist.split_batch(np.zeros(4), 0)
  with pytest.raises(
    TypeError, match=error("split_batch", "num_workers", "must be a positive int", 2.0)
  ):
    optax_dist.split_batch(np.zeros(4), 2.0)


def test_split_batch_leaves_must_share_the_batch_size():
  batch = {"x": jnp.zeros((8, 4)), "y": jnp.zeros(6)}
  pattern = (
    re.escape("`split_batch`: every leaf of `batch` must have the same leading (batch) size")
    + r".*got 8 at \['x'\], 6 at \['y'\]\.$"
  )
  with pytest.raises(ValueError, match=pattern):
    optax_dist.split_batch(batch, 2)


def test_split_batch_num_towers_is_deprecated_and_equal():
  batch = {"x": jnp.arange(8.0)}
  with pytest.warns(DeprecationWarning, match="num_towers"):
    old = optax_dist.split_batch(batch, num_towers=4)
  np.testing.assert_array_equal(old["x"], optax_dist.split_batch(batch, num_workers=4)["x"])
  with pytest.raises(TypeError, match="num_towers"):
    optax_dist.split_batch(batch, 4, num_towers=4)


# ----------------------------------------------------------------------------------------------
# Hierarchical all-reduce: reduce-scatter inside a host, the slices across hosts, all-gather.

HOSTS, GPUS = "hosts", "gpus"
# Leaves of 21 and 5 values: neither a multiple of 4 (the slices are padded).
HIER_SHAPES = {"w": (7, 3), "b": (5,)}


def _per_worker_grads(rows, cols, dtype=jnp.float32):
  rng = np.random.default_rng(7)
  return {k: rng.normal(size=(rows, cols, *s)).astype(np.float32).astype(dtype)
          for k, s in HIER_SHAPES.items()}


def _hierarchical_shard_map(tx, mesh, grads):
  """``tx``'s updates of per-worker ``grads`` ``[hosts, gpus, ...]`` under shard_map."""
  spec = P(HOSTS, GPUS)
  grads = jax.device_put(grads, NamedSharding(mesh, spec))

  def update(g):
    g = jax.tree.map(lambda x: x[0, 0], g)
    return jax.tree.map(lambda x: x[None, None], tx.update(g, tx.init(g))[0])

  return jax.jit(jax.shard_map(update, mesh=mesh, in_specs=spec, out_specs=spec)), grads


@pytest.mark.parametrize("layout", [(2, 4), (4, 2)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
def test_hierarchical_all_reduce_matches_numpy(layout, reduction, mapping):
  """Every worker gets the float64 sum (or mean) of all workers' gradients."""
  rows, cols = layout
  grads = _per_worker_grads(rows, cols)
  tx = optax_dist.all_reduce((HOSTS, GPUS), reduction, hierarchical=True)
  if mapping == "vmap":
    update = lambda g: tx.update(g, tx.init(g))[0]  # noqa: E731
    out = jax.jit(jax.vmap(jax.vmap(update, axis_name=GPUS), axis_name=HOSTS))(grads)
  else:
    mesh = jax.make_mesh(layout, (HOSTS, GPUS), axis_types=(AxisType.Auto,) * 2)
    fn, placed = _hierarchical_shard_map(tx, mesh, grads)
    out = fn(placed)
  for k, g in grads.items():
    total = np.sum(np.asarray(g, np.float64), axis=(0, 1))
    want = total if reduction == "sum" else total / (rows * cols)
    np.testing.assert_allclose(out[k], np.broadcast_to(want, g.shape), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", [(2, 4), (4, 2)])
def test_hierarchical_all_reduce_sends_each_slice_across_hosts_once(layout):
  """Across hosts each device all-reduces ceil(size / K) values per leaf (K devices per host);
  the flat all-reduce spans both axes with every leaf's whole bytes."""
  rows, cols = layout
  mesh = jax.make_mesh(layout, (HOSTS, GPUS), axis_types=(AxisType.Auto,) * 2)
  grads = _per_worker_grads(rows, cols)
  slice_bytes = sum(4 * -(-int(np.prod(s)) // cols) for s in HIER_SHAPES.values())
  leaf_bytes = sum(4 * int(np.prod(s)) for s in HIER_SHAPES.values())
  found = {}
  for hierarchical in (False, True):
    tx = optax_dist.all_reduce((HOSTS, GPUS), hierarchical=hierarchical)
    fn, placed = _hierarchical_shard_map(tx, mesh, grads)
    found[hierarchical] = optax_dist.communication_report(fn, placed).unconditional
  assert found[False].of_kind("all-reduce").over(mesh, (HOSTS, GPUS)).bytes == leaf_bytes
  assert found[False].over(mesh, HOSTS).bytes == 0
  across = found[True].over(mesh, HOSTS)
  assert across.bytes == slice_bytes and set(c.kind for c in across) == {"all-reduce"}
  inside = found[True].over(mesh, GPUS)
  assert {c.kind for c in inside} == {"reduce-scatter", "all-gather"}
  assert found[True].over(mesh, (HOSTS, GPUS)).bytes == 0


def test_hierarchical_all_reduce_in_bfloat16_across_hosts():
  """``comm_dtype`` is the dtype of the exchange across hosts: the slices cross in bfloat16
  (half the bytes), the result keeps the gradients' float32."""
  mesh = jax.make_mesh((2, 4), (HOSTS, GPUS), axis_types=(AxisType.Auto,) * 2)
  grads = _per_worker_grads(2, 4)
  tx = optax_dist.all_reduce((HOSTS, GPUS), "sum", comm_dtype=jnp.bfloat16, hierarchical=True)
  fn, placed = _hierarchical_shard_map(tx, mesh, grads)
  out = fn(placed)
  # XLA's CPU compiler widens bfloat16 collectives to float32: read the lowered program.
  report = optax_dist.communication_report(fn, placed, stage="lowered")
  across = report.unconditional.over(mesh, HOSTS)
  assert across.bytes == sum(2 * -(-int(np.prod(s)) // 4) for s in HIER_SHAPES.values())
  for k, g in grads.items():
    assert out[k].dtype == jnp.float32
    total = np.sum(np.asarray(g, np.float64), axis=(0, 1))
    np.testing.assert_allclose(out[k][0, 0], total, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("fn", ["all_reduce", "tower"])
def test_hierarchical_needs_two_axes_and_a_bool(fn):
  make = {"all_reduce": lambda **kw: optax_dist.all_reduce(**kw),
          "tower": lambda **kw: optax_dist.tower(optax.sgd(1.0), **kw)}[fn]
  with pytest.raises(ValueError, match=re.escape(
      f"`{fn}(hierarchical=True)` needs a tuple `axis_name` of two or more mesh axes")):
    make(axis_name="workers", hierarchical=True)
  with pytest.raises(TypeError, match=re.escape(f"`{fn}(hierarchical=...)` must be a bool")):
    make(axis_name=(HOSTS, GPUS), hierarchical="yes")
