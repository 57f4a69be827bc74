"""The global view: ``jax.jit`` of ``jax.vmap(update, axis_name=..., spmd_axis_name=...)`` over
replicas stacked on a mesh axis, each replica's params sharded over an inner axis (FSDP).

* Without the hint, a non-communication step's compiled program has no params-sized
  collective outside a conditional (the predicate is agreed: one 4-byte all-reduce).
* Every transformation gives the values of plain ``jax.vmap(axis_name=...)`` on one device and
  of a partial-manual ``jax.shard_map(..., axis_names={"replica"})`` (default ``check_vma``),
  on 2×4 and 4×2 meshes, keeps the params' and state's shardings, and a hinted
  non-communication step has no collective.
* :func:`optax_dist.state_shardings` places a new state (``out_shardings``) and an Orbax restore.
* Explicit mesh axes: what runs and what JAX refuses.
* Flax: NNX ``nnx.Optimizer`` and Linen ``TrainState`` with a sharded model under DiLoCo.
* ``optax.MultiSteps`` around diloco exchanges k times per sync; inside it, once; under a
  partial-manual ``shard_map`` it runs with ``check_vma=False`` only.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

R = "replica"
MESHES = {"2x4": (2, 4), "4x2": (4, 2)}
PERIOD = 2
STEPS = 4
SPECS = {"w": P("inner", None), "b": P("inner")}  # one replica's layout

# The three programs reduce over the replicas in different orders (an XLA all-reduce across
# devices, a reduction over vmap's batch dimension) and fuse differently: after four steps they
# differ by at most one float32 ulp of the O(1) params (1.5e-7 measured), and Adam's moments
# near zero by ~2e-8 (relative 1.5e-6 there, hence the absolute floor).
RTOL, ATOL = 1e-6, 1e-7


def transformations():
  adam = optax.adam(1e-2)
  nesterov = optax.sgd(0.7, momentum=0.9, nesterov=True)
  return {
    "tower": optax_dist.tower(adam, R),
    "elastic_average": optax_dist.elastic_average(
      adam, communication_period=PERIOD, moving_rate=0.2, axis_name=R),
    "agn": optax_dist.agn(adam, communication_period=PERIOD, axis_name=R),
    "moving_average": optax_dist.moving_average(optax_dist.tower(adam, R), decay=0.9),
    "drop_stale_gradients": optax_dist.drop_stale_gradients(optax_dist.tower(adam, R), 2),
    "local_sgd": optax_dist.local_sgd(adam, sync_period=PERIOD, axis_name=R),
    "diloco": optax_dist.diloco(adam, nesterov, sync_period=PERIOD, axis_name=R),
    "streaming_diloco": optax_dist.streaming_diloco(
      adam, nesterov, sync_period=PERIOD, num_fragments=2, fragments={"w": 0, "b": 1},
      axis_name=R),
    "apply_if_finite": optax_dist.apply_if_finite(adam, 3, axis_name=R),
    "accumulate_then_reduce": optax_dist.accumulate_then_reduce(adam, PERIOD, R),
  }


NAMES = list(transformations())
PERIODIC = ["diloco", "local_sgd", "streaming_diloco", "elastic_average", "agn"]


def make_mesh(shape, axis_type=AxisType.Auto):
  return jax.make_mesh(shape, (R, "inner"), axis_types=(axis_type,) * 2)


def one_replica():
  return {"w": jnp.linspace(-1.0, 1.0, 32).reshape(8, 4), "b": jnp.linspace(0.5, 1.0, 8)}


def stacked(tree, n):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


def step_fn(tx, **hint):
  """One replica's step: its own gradients (they differ between replicas), then ``update``."""

  def step(params, state, t, replica):
    grads = jax.tree.map(lambda p: jnp.sin(3.0 * p + t + replica), params)
    updates, state = tx.update(grads, state, params, **hint)
    return optax.apply_updates(params, updates), state

  return step


def global_view(tx, **hint):
  return jax.jit(jax.vmap(
    step_fn(tx, **hint), in_axes=(0, 0, None, 0), axis_name=R, spmd_axis_name=R))


def emulated(tx):
  return jax.jit(jax.vmap(step_fn(tx), in_axes=(0, 0, None, 0), axis_name=R))


def partial_manual(tx, mesh, check_vma=True):
  step = step_fn(tx)

  def body(params, state, t, replica):
    squeeze = functools.partial(jax.tree.map, lambda x: x[0])
    new = step(squeeze(params), squeeze(state), t, replica[0])
    return jax.tree.map(lambda x: x[None], new)

  return jax.jit(jax.shard_map(
    body, mesh=mesh, in_specs=(P(R), P(R), P(), P(R)), out_specs=P(R), axis_names={R},
    check_vma=check_vma))


def placed(tx, mesh):
  """Stacked params and a new state on ``mesh``: params ``P(R, *spec)``, state by
  :func:`optax_dist.state_shardings` (``out_shardings`` of the jitted init)."""
  n = mesh.shape[R]
  shardings = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
  params = jax.device_put(
    stacked(one_replica(), n), {k: NamedSharding(mesh, P(R, *s)) for k, s in SPECS.items()})
  state_sh = optax_dist.state_shardings(tx, one_replica(), shardings, replica_axis=R)
  state = jax.jit(jax.vmap(tx.init), out_shardings=state_sh)(params)
  replicas = jax.device_put(jnp.arange(n, dtype=jnp.float32), NamedSharding(mesh, P(R)))
  return params, state, replicas


def run(step, params, state, replicas, steps=STEPS):
  for t in range(1, steps + 1):
    params, state = step(params, state, jnp.float32(t), replicas)
  return params, state


def assert_same_shardings(got, want):
  """Every leaf of the step's output is sharded as its input was (a value agreed over the
  replicas too, e.g. apply_if_finite's `last_finite`: else the next call recompiles)."""
  for (path, g), w in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
  ):
    assert g.sharding.is_equivalent_to(w.sharding, w.ndim), (jax.tree_util.keystr(path), g, w)


# ----------------------------------------------------------------------------------------------
# The agreed predicate: no params-sized collective outside the conditional.


@pytest.mark.parametrize("name", PERIODIC)
def test_unhinted_step_keeps_the_exchange_inside_a_conditional(three_ways, name):
  tx = transformations()[name]
  (params, state, replicas), *_ = three_ways[name, "2x4"]
  report = optax_dist.communication_report(
    global_view(tx), params, state, jnp.float32(1), replicas)
  # The exchange is conditional; outside it only the agreed predicates, one int32 pmax per
  # conditional (streaming_diloco has one per fragment).
  exchanges = len(report.per_conditional)
  assert exchanges == (2 if name == "streaming_diloco" else 1), report.conditional
  assert report.unconditional.bytes <= 4 * exchanges, report.unconditional
  assert all(s in ("s32[]", "pred[]") for c in report.unconditional for s in c.shapes)
  assert report.non_communication_step.bytes == report.unconditional.bytes


# ----------------------------------------------------------------------------------------------
# Every transformation: the global view, vmap on one device and partial-manual shard_map agree.


def run_together(steps, inputs, steps_count=STEPS):
  """:func:`run` of several steps, each on its own ``(params, state, replicas)``, all in one
  program (one compilation instead of one per step function)."""

  @jax.jit
  def together(carries, t, replicas):
    return [step(*carry, t, r) for step, carry, r in zip(steps, carries, replicas, strict=True)]

  carries, replicas = [(p, s) for p, s, _ in inputs], [r for *_, r in inputs]
  for t in range(1, steps_count + 1):
    carries = together(carries, jnp.float32(t), replicas)
  return carries


@pytest.fixture(scope="module")
def three_ways():
  """Every transformation on each mesh, ``STEPS`` steps in the global view, under a
  partial-manual ``shard_map`` and under vmap on one device: the global view's and the
  partial-manual steps of a mesh's cases compiled as one program each (one mesh a program: the
  global view's shardings name their mesh), the one-device steps of every case as one.
  ``{(name, mesh_name): (inputs, global, manual, one device)}``."""
  cases = [(name, mesh_name) for mesh_name in MESHES for name in NAMES]
  txs = [transformations()[name] for name, _ in cases]
  inputs, got, manual = [], [], []
  for mesh_name, shape in MESHES.items():
    mesh = make_mesh(shape)
    on_mesh = [tx for tx, (_, m) in zip(txs, cases, strict=True) if m == mesh_name]
    placed_here = [placed(tx, mesh) for tx in on_mesh]
    inputs += placed_here
    got += run_together([global_view(tx) for tx in on_mesh], placed_here)
    manual += run_together([partial_manual(tx, mesh) for tx in on_mesh], placed_here)
  want = run_together([emulated(tx) for tx in txs], jax.device_put(inputs, jax.devices()[0]))
  return dict(zip(cases, zip(inputs, got, manual, want, strict=True), strict=True))


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("name", NAMES)
def test_global_view_equals_vmap_and_partial_manual_shard_map(three_ways, name, mesh_name):
  (params, state, _), got, manual, want = three_ways[name, mesh_name]
  assert_same_shardings(got, (params, state))
  assert_same_shardings(manual, (params, state))
  chex.assert_trees_all_close(jax.device_get(got), jax.device_get(want), rtol=RTOL, atol=ATOL)
  chex.assert_trees_all_close(jax.device_get(manual), jax.device_get(want), rtol=RTOL, atol=ATOL)
  # The params moved, and the replicas differ where the algorithm keeps them apart.
  assert not np.allclose(got[0]["w"], params["w"])


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("name", PERIODIC)
def test_hinted_non_communication_step_has_no_collective(three_ways, name, mesh_name):
  tx = transformations()[name]
  (params, state, replicas), *_ = three_ways[name, mesh_name]
  quiet = optax_dist.communication_report(
    global_view(tx, communicate=False), params, state, jnp.float32(1), replicas)
  assert not quiet.collectives, quiet.collectives
  loud = optax_dist.communication_report(
    global_view(tx, communicate=True), params, state, jnp.float32(1), replicas)
  assert loud.communication_step.bytes > 0


# ----------------------------------------------------------------------------------------------
# state_shardings: a new state placed by out_shardings, a checkpoint restored onto the mesh.


def expected_spec(path, leaf):
  """What the state's leaf at ``path`` should be sharded as: a params-shaped leaf like the param
  it mirrors (the last key of its path), anything else over the replicas only."""
  key = path[-1].key if path and isinstance(path[-1], jax.tree_util.DictKey) else None
  if key in SPECS and leaf.shape[1:] == one_replica()[key].shape:
    return P(R, *SPECS[key])
  return P(R)


@pytest.mark.parametrize("name", NAMES)
def test_state_shardings_places_a_new_state_like_the_params_inside_each_replica(three_ways, name):
  mesh = make_mesh(MESHES["2x4"])
  (_, state, _), *_ = three_ways[name, "2x4"]
  leaves = jax.tree_util.tree_leaves_with_path(state)
  assert any(leaf.ndim > 1 for _, leaf in leaves)
  for path, leaf in leaves:
    spec = expected_spec(path, leaf)
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (path, spec)
    # Each device holds its replica's row and its quarter of the param's first dimension.
    per_device = (1, leaf.shape[1] // 4, *leaf.shape[2:]) if len(spec) > 1 else (1, *leaf.shape[1:])
    assert {s.data.shape for s in leaf.addressable_shards} == {per_device}, path


def test_state_shardings_keeps_streaming_diloco_masked_fragments_and_takes_specs():
  tx = transformations()["streaming_diloco"]
  specs = optax_dist.state_shardings(tx, one_replica(), SPECS)
  traces = [outer[0].trace for outer in specs.outer_state]
  assert traces[0]["b"] == optax.MaskedNode() and traces[1]["w"] == optax.MaskedNode()
  assert traces[0]["w"] == P(R, "inner", None) and traces[1]["b"] == P(R, "inner")
  assert specs.local_step == P(R)
  with pytest.raises(ValueError, match=r"params\['w'\].*already names 'replica'"):
    optax_dist.state_shardings(tx, one_replica(), {"w": P(R), "b": P()})
  with pytest.raises(ValueError, match="one sharding per leaf"):
    optax_dist.state_shardings(tx, one_replica(), {"w": P()})


def test_orbax_restores_a_state_onto_the_mesh_and_resize_state_onto_other_replicas(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = transformations()["diloco"]
  mesh = make_mesh(MESHES["2x4"])
  params, state, replicas = placed(tx, mesh)
  params, state = run(global_view(tx), params, state, replicas, steps=3)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", {"params": params, "opt_state": state})

  # A fresh process would know only the shapes and the mesh: eval_shape and state_shardings.
  shardings = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
  state_sh = optax_dist.state_shardings(tx, one_replica(), shardings)
  abstract_params = jax.eval_shape(lambda: stacked(one_replica(), 2))
  abstract_state = jax.eval_shape(jax.vmap(tx.init), abstract_params)
  abstract = {
    "params": jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P(R, *s))),
      abstract_params, SPECS),
    "opt_state": jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, state_sh),
  }
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "ckpt", abstract)
  chex.assert_trees_all_equal(jax.device_get(restored["opt_state"]), jax.device_get(state))
  assert_same_shardings((restored["params"], restored["opt_state"]), (params, state))
  # The restored state trains on in the global view, without recompiling for new shardings.
  run(global_view(tx), restored["params"], restored["opt_state"], replicas, steps=1)

  # The same checkpoint continues on four replicas (a 4x2 mesh).
  state4, params4 = optax_dist.resize_state(tx, restored["opt_state"], restored["params"], 4)
  mesh4 = make_mesh(MESHES["4x2"])
  state4 = jax.device_put(state4, optax_dist.state_shardings(
    tx, one_replica(), {k: NamedSharding(mesh4, s) for k, s in SPECS.items()}))
  params4 = jax.device_put(params4, {k: NamedSharding(mesh4, P(R, *s)) for k, s in SPECS.items()})
  np.testing.assert_array_equal(state4.anchor["w"][3], state.anchor["w"][0])
  replicas4 = jax.device_put(jnp.arange(4, dtype=jnp.float32), NamedSharding(mesh4, P(R)))
  params4, state4 = run(global_view(tx), params4, state4, replicas4, steps=2)
  assert state4.anchor["w"].sharding.is_equivalent_to(NamedSharding(mesh4, P(R, "inner")), 3)
  assert np.isfinite(params4["w"]).all()


# ----------------------------------------------------------------------------------------------
# Explicit mesh axes (jax.sharding.AxisType.Explicit, jax.set_mesh).


def test_explicit_axes_run_plain_adam_once_the_counters_are_sharded_over_the_replicas():
  tx = optax.adam(1e-2)
  mesh = make_mesh(MESHES["2x4"], AxisType.Explicit)
  step = jax.jit(jax.vmap(tx.update, axis_name=R, spmd_axis_name=R))
  with jax.set_mesh(mesh):
    params = jax.device_put(stacked(one_replica(), 2), {k: P(R, *s) for k, s in SPECS.items()})
    # Without out_shardings the count is built replicated, and vmap refuses the mix.
    state = jax.jit(jax.vmap(tx.init))(params)
    with pytest.raises(ValueError, match="inconsistent axis specs"):
      step(params, state, params)
    state_sh = optax_dist.state_shardings(tx, one_replica(), SPECS)
    state = jax.jit(jax.vmap(tx.init), out_shardings=state_sh)(params)
    updates, new_state = step(params, state, params)
  assert jax.typeof(new_state[0].count).sharding.spec == P(R)
  assert jax.typeof(new_state[0].mu["w"]).sharding.spec == P(R, "inner", None)


@pytest.mark.xfail(
  strict=True, raises=AssertionError,
  reason="JAX 0.10.2: a collective over the spmd_axis_name of vmap on an Explicit mesh axis"
  " fails in jax._src.core._make_lengths_same (AssertionError: (0, P('replica',))); use"
  " automatic axes or shard_map",
)
def test_explicit_axes_run_diloco():
  tx = transformations()["diloco"]
  mesh = make_mesh(MESHES["2x4"], AxisType.Explicit)
  with jax.set_mesh(mesh):
    params = jax.device_put(stacked(one_replica(), 2), {k: P(R, *s) for k, s in SPECS.items()})
    state_sh = optax_dist.state_shardings(tx, one_replica(), SPECS)
    state = jax.jit(jax.vmap(tx.init), out_shardings=state_sh)(params)
    replicas = jax.device_put(jnp.arange(2, dtype=jnp.float32), P(R))
    run(global_view(tx), params, state, replicas, steps=1)


# ----------------------------------------------------------------------------------------------
# Flax: a sharded Dense layer trained with DiLoCo in the global view.

D_IN, D_OUT, BATCH = 4, 8, 3
KERNEL, BIAS = P(None, "inner"), P("inner")


def batches(n, steps=STEPS):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(steps, n, BATCH, D_IN)).astype(np.float32)
  y = rng.normal(size=(steps, n, BATCH, D_OUT)).astype(np.float32)
  return x, y


def train_global_and_emulated(step, state, mesh, shardings):
  """``STEPS`` steps of ``step`` (one replica's) in the global view on ``mesh`` from ``state``
  placed by ``shardings``, and under plain vmap on one device; returns both end states."""
  n = mesh.shape[R]
  xs, ys = batches(n)
  data = NamedSharding(mesh, P(R))
  results = []
  for mapped, put in (
    (jax.vmap(step, axis_name=R, spmd_axis_name=R), lambda t, s: jax.device_put(t, s)),
    (jax.vmap(step, axis_name=R), lambda t, s: jax.device_put(t, jax.devices()[0])),
  ):
    mapped = jax.jit(mapped)
    current = put(state, shardings)
    for x, y in zip(xs, ys):
      current = mapped(current, put(x, data), put(y, data))
    results.append(current)
  return results


def test_nnx_optimizer_with_a_sharded_model_in_the_global_view():
  from flax import nnx

  tx = transformations()["diloco"]
  mesh = make_mesh(MESHES["2x4"])
  model = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
  state = stacked(state, 2)

  # Every leaf shaped like the kernel or the bias (the params, DiLoCo's anchor, the moments)
  # is sharded like it inside each replica; the counters over the replicas only.
  def sharding_of(x):
    spec = {(2, D_IN, D_OUT): P(R, *KERNEL), (2, D_OUT): P(R, *BIAS)}.get(x.shape, P(R))
    return NamedSharding(mesh, spec)

  shardings = jax.tree.map(sharding_of, state)

  def step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  got, want = train_global_and_emulated(step, state, mesh, shardings)
  chex.assert_trees_all_close(jax.device_get(got), jax.device_get(want), rtol=RTOL, atol=ATOL)
  for leaf, sharding in zip(jax.tree.leaves(got), jax.tree.leaves(shardings), strict=True):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
  model, optimizer = nnx.merge(graphdef, got)
  anchor = nnx.as_pure(optimizer.opt_state).anchor["kernel"]
  assert anchor.sharding.is_equivalent_to(NamedSharding(mesh, P(R, *KERNEL)), 3)
  # Two syncs in four steps: the replicas end on the same anchor.
  np.testing.assert_array_equal(anchor[0], anchor[1])


def test_linen_train_state_with_a_sharded_model_in_the_global_view():
  from flax import linen as nn

  from optax_dist.flax import TrainState

  tx = transformations()["diloco"]
  mesh = make_mesh(MESHES["2x4"])
  dense = nn.Dense(D_OUT)
  params = dense.init(jax.random.key(0), jnp.zeros((1, D_IN)))
  specs = {"params": {"kernel": KERNEL, "bias": BIAS}}
  state = stacked(TrainState.create(apply_fn=dense.apply, params=params, tx=tx), 2)
  named = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  # The train state's shardings: the step over the replicas, the params P(R, *spec), the
  # optimizer state from state_shardings.
  shardings = state.replace(
    step=NamedSharding(mesh, P(R)),
    params=jax.tree.map(lambda s: NamedSharding(mesh, P(R, *s)), specs),
    opt_state=optax_dist.state_shardings(tx, params, named),
  )

  def step(state, x, y):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, x) - y) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  got, want = train_global_and_emulated(step, state, mesh, shardings)
  chex.assert_trees_all_close(
    jax.device_get((got.params, got.opt_state)), jax.device_get((want.params, want.opt_state)),
    rtol=RTOL, atol=ATOL)
  assert got.opt_state.anchor["params"]["kernel"].sharding.is_equivalent_to(
    NamedSharding(mesh, P(R, *KERNEL)), 3)
  assert got.params["params"]["bias"].sharding.is_equivalent_to(
    NamedSharding(mesh, P(R, *BIAS)), 2)
  np.testing.assert_array_equal(got.opt_state.anchor["params"]["kernel"][0],
                                got.opt_state.anchor["params"]["kernel"][1])


# ----------------------------------------------------------------------------------------------
# Gradient accumulation around or inside diloco.


def test_multisteps_inside_diloco_exchanges_once_per_sync_with_the_results_of_outside():
  """``optax.MultiSteps(diloco(inner, sync_period=H), k)`` under vmap: MultiSteps' own
  conditional has a batched predicate, so it runs diloco's update on every micro-step and
  keeps the result only on the k-th; diloco's (agreed) sync predicate is true on all k
  micro-steps of a sync window, so the exchange runs k times per sync. The same algorithm as
  ``diloco(optax.MultiSteps(inner, k), sync_period=H * k)`` exchanges once."""
  k, h, syncs = 2, 2, 2
  outer_calls = {"outside": [], "inside": []}

  def counted_outer(calls):  # the outer step runs only in the exchange's branch
    def update(updates, state, params=None):
      jax.debug.callback(lambda: calls.append(1))
      return updates, state

    return optax.chain(optax.sgd(0.7, momentum=0.9), optax.GradientTransformation(
      lambda params: optax.EmptyState(), update))

  outside = optax.MultiSteps(optax_dist.diloco(
    optax.adam(1e-2), counted_outer(outer_calls["outside"]), sync_period=h, axis_name=R), k)
  inside = optax_dist.diloco(optax.MultiSteps(optax.adam(1e-2), k),
                             counted_outer(outer_calls["inside"]), sync_period=h * k, axis_name=R)
  mesh = make_mesh(MESHES["2x4"])
  (got_outside, _), (got_inside, _) = run_together(  # both in one program
    [global_view(outside), global_view(inside)], [placed(outside, mesh), placed(inside, mesh)],
    steps_count=k * h * syncs)
  jax.effects_barrier()
  assert len(outer_calls["outside"]) == k * syncs
  assert len(outer_calls["inside"]) == syncs
  chex.assert_trees_all_close(got_inside, got_outside, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------------------------
# state_shardings on state paths that end in no param's path: matched by shape alone.


def param_buffers():
  """A transformation whose state is a list of param-shaped buffers: its paths (``[0]``,
  ``[1]``, ...) end in no param's path, so state_shardings can match them by shape only."""
  return optax.GradientTransformation(
    lambda params: [jnp.zeros_like(p) for p in jax.tree.leaves(params)],
    lambda updates, state, params=None: (updates, state))


def test_state_shardings_gives_a_buffer_the_one_spec_of_the_params_of_its_shape():
  specs = optax_dist.state_shardings(param_buffers(), one_replica(), SPECS)
  assert specs == [P(R, *SPECS["b"]), P(R, *SPECS["w"])]  # the leaves' order: b, w


def test_state_shardings_replicates_a_buffer_whose_shape_has_params_of_several_specs():
  params = {"u": jnp.zeros((8, 4)), "v": jnp.zeros((8, 4))}
  one_spec = optax_dist.state_shardings(
    param_buffers(), params, {"u": P("inner", None), "v": P("inner", None)})
  assert one_spec == [P(R, "inner", None)] * 2
  two_specs = optax_dist.state_shardings(
    param_buffers(), params, {"u": P("inner", None), "v": P(None, "inner")})
  assert two_specs == [P(R)] * 2


def test_state_shardings_matches_a_moment_to_the_param_of_its_longest_path():
  # Adam's mu['z']['a'] ends in both params['a'] and params['z']['a'].
  params = {"a": jnp.zeros((8, 4)), "z": {"a": jnp.zeros((8, 4))}}
  specs = optax_dist.state_shardings(
    optax.adam(1e-3), params, {"a": P("inner", None), "z": {"a": P(None, "inner")}})
  assert specs[0].mu == {"a": P(R, "inner", None), "z": {"a": P(R, None, "inner")}}


def test_multisteps_under_partial_manual_shard_map_runs_with_check_vma_off():
  """``optax.MultiSteps``' skip branch makes its zero updates with ``jnp.zeros_like`` of
  ``jax.eval_shape``'s abstract values, whose sharding names the manual replica axis; under a
  partial-manual ``shard_map`` with ``check_vma=True`` JAX 0.10 fails on that (an
  ``AssertionError`` naming ``ManualAxisType``), for any inner optimizer (docs/global_view.md).
  With ``check_vma=False`` the step runs and gives the global view's values."""
  tx = optax.MultiSteps(optax_dist.diloco(optax.adam(1e-2), sync_period=2, axis_name=R), 2)
  mesh = make_mesh(MESHES["2x4"])
  params, state, replicas = placed(tx, mesh)
  with pytest.raises(AssertionError, match="ManualAxisType"):
    partial_manual(tx, mesh)(params, state, jnp.float32(1), replicas)
  # Six micro-steps: three updates, the second a sync, the third the replicas' own inner step.
  got = run(partial_manual(tx, mesh, check_vma=False), params, state, replicas, steps=6)
  want = run(global_view(tx), params, state, replicas, steps=6)
  assert_same_shardings(got, (params, state))
  chex.assert_trees_all_close(jax.device_get(got), jax.device_get(want), rtol=RTOL, atol=ATOL)
  assert int(got[1].gradient_step[0]) == 3
  assert not np.allclose(got[0]["w"][0], got[0]["w"][1])
