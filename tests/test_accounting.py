"""Communication accounting: the collectives of compiled steps, their kinds, counts and bytes.

Expected bytes are computed from the params tree (elements x itemsize per worker), never read
from the report under test. Steps run under ``shard_map`` on 8 devices with per-worker params
(``P("w")``); the optimizer state is an argument of the compiled step, so XLA cannot fold the
communication predicate away. XLA's CPU compiler widens bfloat16 collectives to float32, so the
bfloat16 byte counts are read from the lowered program (``stage="lowered"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist
from optax_dist import CommunicationReport

N = 8
MESH = jax.make_mesh((N,), ("w",))
LOCAL = {"a": (4, 3), "b": (5,)}  # one worker's params shapes


def _local_bytes(tree_shapes: dict, itemsize: int) -> int:
  return sum(int(np.prod(s)) * itemsize for s in tree_shapes.values())


PARAMS_BYTES = _local_bytes(LOCAL, 4)  # float32: (12 + 5) * 4 = 68


def _sharded(tree):
  return jax.device_put(tree, NamedSharding(MESH, P("w")))


def _per_worker(f):
  """Runs ``f`` on each worker's slice of arrays with a leading worker axis."""

  def g(*args):
    out = f(*jax.tree.map(lambda x: x[0], args))
    return jax.tree.map(lambda x: x[None], out)

  return jax.jit(jax.shard_map(g, mesh=MESH, in_specs=P("w"), out_specs=P("w")))


def _data(seed=0):
  rng = np.random.default_rng(seed)
  params = {k: np.repeat(rng.normal(size=(1,) + s), N, axis=0) for k, s in LOCAL.items()}
  grads = {k: rng.normal(size=(N,) + s) for k, s in LOCAL.items()}
  def cast(tree):
    return _sharded(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree))

  return cast(params), cast(grads)


def _report(tx, stage="compiled"):
  params, grads = _data()
  state = _per_worker(tx.init)(params)
  step = _per_worker(lambda g, s, p: tx.update(g, s, p))
  return optax_dist.communication_report(step, grads, state, params, stage=stage)


# ----------------------------------------------------------------------------------------------
# The transformations' collectives.


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tower_all_reduces_the_gradient_bytes_on_every_step(reduction):
  report = _report(optax_dist.tower(optax.sgd(0.1), "w", reduction=reduction))
  assert set(report.unconditional.by_kind()) == {"all-reduce"}
  assert report.unconditional.bytes == PARAMS_BYTES == 68
  assert not report.conditional
  assert report.communication_step.bytes == report.non_communication_step.bytes == PARAMS_BYTES


def test_tower_counts_mixed_dtypes_by_itemsize_from_abstract_arguments():
  tx = optax_dist.all_reduce("w")
  sharding = NamedSharding(MESH, P("w"))
  grads = {"f": jax.ShapeDtypeStruct((N, 4, 3), jnp.float32, sharding=sharding),
           "h": jax.ShapeDtypeStruct((N, 6), jnp.bfloat16, sharding=sharding)}
  step = _per_worker(lambda g: tx.update(g, tx.init(g))[0])
  report = optax_dist.communication_report(step, grads, stage="lowered")
  assert report.unconditional.of_kind("all-reduce").bytes == 12 * 4 + 6 * 2
  assert sorted(s for c in report.unconditional for s in c.shapes) == ["bf16[6]", "f32[4,3]"]


def test_comm_dtype_bfloat16_halves_tower_bytes_and_stays_close():
  params, grads = _data()
  reports, outs = {}, {}
  for dtype in (None, jnp.bfloat16):
    tx = optax_dist.tower(optax.sgd(1.0), "w", comm_dtype=dtype)
    step = _per_worker(lambda g, s, p, tx=tx: tx.update(g, s, p)[0])
    state = _per_worker(tx.init)(params)
    reports[dtype] = optax_dist.communication_report(step, grads, state, params, stage="lowered")
    outs[dtype] = step(grads, state, params)
  assert reports[None].unconditional.bytes == PARAMS_BYTES
  assert reports[jnp.bfloat16].unconditional.bytes == PARAMS_BYTES // 2
  assert all(s.startswith("bf16[") for c in reports[jnp.bfloat16].unconditional for s in c.shapes)
  for k in LOCAL:
    expected = -np.asarray(grads[k]).mean(axis=0)  # sgd(1) on the towers' mean
    assert outs[jnp.bfloat16][k].dtype == jnp.float32
    np.testing.assert_allclose(outs[None][k], np.broadcast_to(expected, outs[None][k].shape),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[jnp.bfloat16][k], outs[None][k], rtol=2e-2, atol=2e-2)


STAGES = [(None, 4, "compiled"), (None, 4, "lowered"), (jnp.bfloat16, 2, "lowered")]


@pytest.mark.parametrize("comm_dtype,itemsize,stage", STAGES)
def test_elastic_average_communicates_only_in_the_conditional(comm_dtype, itemsize, stage):
  tx = optax_dist.elastic_average(
    optax.sgd(0.1), communication_period=3, axis_name="w", comm_dtype=comm_dtype
  )
  report = _report(tx, stage)
  assert not report.unconditional
  assert not report.non_communication_step
  assert set(report.conditional.by_kind()) == {"all-reduce"}  # the psum of d
  assert report.communication_step.bytes == _local_bytes(LOCAL, itemsize)
  assert all(len(c.conditionals) == 1 for c in report.conditional)


@pytest.mark.parametrize("comm_dtype,itemsize,stage", STAGES)
def test_agn_sequential_gathers_n_times_the_params_in_the_conditional(comm_dtype, itemsize, stage):
  tx = optax_dist.agn(optax.sgd(0.1), communication_period=2, axis_name="w",
                      comm_dtype=comm_dtype)
  report = _report(tx, stage)
  assert not report.unconditional
  assert not report.non_communication_step
  gathers = report.communication_step.of_kind("all-gather")
  assert gathers == report.conditional.of_kind("all-gather")
  assert report.communication_step.bytes == gathers.bytes == _local_bytes(LOCAL, itemsize)
  assert gathers.result_bytes == N * _local_bytes(LOCAL, itemsize)


def test_agn_mean_all_reduces_the_params_bytes_in_the_conditional():
  report = _report(optax_dist.agn(optax.sgd(0.1), communication_period=2,
                                  center_update="mean", axis_name="w"))
  assert not report.unconditional
  assert report.non_communication_step.count == 0
  assert set(report.communication_step.by_kind()) == {"all-reduce"}
  assert report.communication_step.bytes == PARAMS_BYTES


@pytest.mark.parametrize("center_update", ["sequential", "mean"])
def test_comm_dtype_numerics_of_the_center_exchange(center_update):
  # Two communication steps under vmap: bfloat16 exchange within bfloat16 rounding of float32.
  rng = np.random.default_rng(1)
  params = jnp.asarray(np.repeat(rng.normal(size=(1, 6)), 4, axis=0), jnp.float32)
  grads = jnp.asarray(rng.normal(size=(4, 4, 6)), jnp.float32)  # (steps, workers, dim)
  results = {}
  for dtype in (None, jnp.bfloat16):
    txs = {
      "easgd": optax_dist.elastic_average(optax.sgd(0.5), communication_period=2,
                                          axis_name="w", comm_dtype=dtype),
      "agn": optax_dist.agn(optax.sgd(0.5), communication_period=2, axis_name="w",
                            center_update=center_update, comm_dtype=dtype),
    }
    for name, tx in txs.items():
      p, s = params, jax.vmap(tx.init, axis_name="w")(params)
      update = jax.jit(jax.vmap(tx.update, axis_name="w"))
      for g in grads:
        u, s = update(g, s, p)
        p = optax.apply_updates(p, u)
      results[name, dtype] = (p, s.center)
  for name in ("easgd", "agn"):
    for a, b in zip(results[name, None], results[name, jnp.bfloat16]):
      assert b.dtype == jnp.float32
      np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2)
    assert not np.allclose(results[name, None][0], params)  # the exchange moved the params


@pytest.mark.parametrize("bad", [jnp.int32, "not a dtype", bool])
def test_comm_dtype_must_be_floating(bad):
  factories = {
    "all_reduce": lambda: optax_dist.all_reduce("w", comm_dtype=bad),
    "tower": lambda: optax_dist.tower(optax.sgd(1.0), "w", comm_dtype=bad),
    "elastic_average": lambda: optax_dist.elastic_average(optax.sgd(1.0), axis_name="w",
                                                          comm_dtype=bad),
    "agn": lambda: optax_dist.agn(optax.sgd(1.0), axis_name="w", comm_dtype=bad),
  }
  for name, make in factories.items():
    with pytest.raises(TypeError, match=rf"`{name}\(comm_dtype=\.\.\.\)` must be None(,| or) a floa"):
      make()


# ----------------------------------------------------------------------------------------------
# The parser, on HLO text written by hand in the forms XLA prints.

_ASYNC = """\
HloModule m, is_scheduled=true
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}
%wrapped_reduce_scatter (p0: f32[64]) -> f32[8] {
  %p0 = f32[64]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(%p0), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}
ENTRY %main (a: f32[4,3], b: bf16[5], c: f32[64]) -> f32[4,3] {
  %a = f32[4,3]{1,0} parameter(0)
  %b = bf16[5]{0} parameter(1)
  %c = f32[64]{0} parameter(2)
  %ars = (f32[4,3]{1,0}, /*index=1*/bf16[5]{0}) all-reduce-start(%a, %b), channel_id=1, to_apply=%add
  %ard = (f32[4,3]{1,0}, bf16[5]{0}) all-reduce-done(%ars)
  %ags = (f32[4,3]{1,0}, f32[32,3]{1,0}) all-gather-start(f32[4,3]{1,0} %a), dimensions={0}
  %agd = f32[32,3]{1,0} all-gather-done((f32[4,3]{1,0}, f32[32,3]{1,0}) %ags)
  %as = ((f32[64]{0}), f32[8]{0}, s32[]) async-start(%c), calls=%wrapped_reduce_scatter
  %au = ((f32[64]{0}), f32[8]{0}, s32[]) async-update(%as), calls=%wrapped_reduce_scatter
  %ad = f32[8]{0} async-done(%au), calls=%wrapped_reduce_scatter
  ROOT %r = f32[4,3]{1,0} get-tuple-element(%ard), index=0
}
"""


def test_parser_counts_async_pairs_once_with_tuple_bytes():
  report = CommunicationReport.from_hlo_text(_ASYNC)
  by_name = {c.name: c for c in report.collectives}
  assert set(by_name) == {"ars", "ags", "rs"}
  assert by_name["ars"].kind == "all-reduce"
  assert by_name["ars"].shapes == ("f32[4,3]", "bf16[5]")
  assert by_name["ars"].bytes == by_name["ars"].result_bytes == 12 * 4 + 5 * 2
  assert by_name["ags"].kind == "all-gather"
  assert (by_name["ags"].bytes, by_name["ags"].result_bytes) == (12 * 4, 96 * 4)
  assert by_name["rs"].kind == "reduce-scatter"
  assert (by_name["rs"].bytes, by_name["rs"].result_bytes) == (64 * 4, 8 * 4)
  assert report.unconditional.count == 3
  assert report.unconditional.by_kind() == {
    "all-reduce": (1, 58), "all-gather": (1, 48), "reduce-scatter": (1, 256)
  }


_CONTROL_FLOW = """\
%inner_true (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %cp = f32[2]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}
}
%inner_false (p: f32[2]) -> f32[2] {
  ROOT %p = f32[2]{0} parameter(0)
}
%skip (p: (f32[16], f32[2])) -> (f32[16], f32[2]) {
  ROOT %p = (f32[16]{0}, f32[2]{0}) parameter(0)
}
%communicate (p: (f32[16], f32[2])) -> (f32[16], f32[2]) {
  %p = (f32[16]{0}, f32[2]{0}) parameter(0)
  %x = f32[16]{0} get-tuple-element(%p), index=0
  %y = f32[2]{0} get-tuple-element(%p), index=1
  %ar = f32[16]{0} all-reduce(%x), to_apply=%add
  %q = pred[] constant(true)
  %c2 = f32[2]{0} conditional(%q, %y, %y), true_computation=%inner_true, false_computation=%inner_false
  ROOT %t = (f32[16]{0}, f32[2]{0}) tuple(%ar, %c2)
}
%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %v = f32[4]{0} get-tuple-element(%p), index=1
  %a2a = f32[4]{0} all-to-all(%v), dimensions={0}
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %a2a)
}
%cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
ENTRY %main (i: s32[], t: (f32[16], f32[2]), w: (s32[], f32[4])) -> (f32[16], f32[2]) {
  %i = s32[] parameter(0)
  %t = (f32[16]{0}, f32[2]{0}) parameter(1)
  %w = (s32[], f32[4]{0}) parameter(2)
  %loop = (s32[], f32[4]{0}) while(%w), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %c = (f32[16]{0}, f32[2]{0}) conditional(%i, %t, %t), branch_computations={%skip, %communicate}
}
"""


def test_parser_separates_branches_and_multiplies_loops():
  report = CommunicationReport.from_hlo_text(_CONTROL_FLOW)
  by_name = {c.name: c for c in report.collectives}
  assert set(by_name) == {"a2a", "ar", "cp"}
  assert by_name["a2a"].conditionals == () and by_name["a2a"].trip_count == 5
  assert by_name["ar"].conditionals == (("c", 1),)  # lax.cond's true branch is index 1
  assert by_name["cp"].conditionals == (("c", 1), ("c2", 0))  # a pred's true branch is 0
  assert report.unconditional.count == 5 and report.unconditional.bytes == 5 * 16
  assert report.conditional.by_kind() == {"all-reduce": (1, 64), "collective-permute": (1, 8)}
  assert report.communication_step.by_kind() == {
    "all-to-all": (5, 80), "all-reduce": (1, 64), "collective-permute": (1, 8)
  }
  assert report.non_communication_step.by_kind() == {"all-to-all": (5, 80)}
  assert "every step: 5 all-to-all (80 B)" in str(report)


def test_parser_rejects_text_without_an_entry_computation_and_unknown_stages():
  with pytest.raises(ValueError, match=r"`communication_report\(stage=...\)` must be one of"):
    optax_dist.communication_report(lambda x: x, jnp.ones(2), stage="optimized")
  with pytest.raises(ValueError, match="no ENTRY computation"):
    CommunicationReport.from_hlo_text("not an HLO module")
  with pytest.raises(ValueError, match="must be one of"):
    CommunicationReport.from_hlo_text(_ASYNC).collectives.of_kind("psum")


# ----------------------------------------------------------------------------------------------
# Bytes per conditional: each periodic exchange apart.

FRAGMENT_SHAPES = {"a": (4, 4), "b": (4, 4), "c": (4, 4), "d": (4, 4)}  # 4 equal leaves


def test_streaming_diloco_syncs_one_fragment_per_conditional():
  """No collective outside sync steps; one all-reduce of params / F per fragment's conditional."""
  tx = optax_dist.streaming_diloco(optax.sgd(0.1), sync_period=8, num_fragments=4, axis_name="w")
  rng = np.random.default_rng(0)
  local = {k: rng.normal(size=s).astype(np.float32) for k, s in FRAGMENT_SHAPES.items()}
  params = _sharded({k: np.broadcast_to(v, (N, *v.shape)) for k, v in local.items()})
  state = _per_worker(tx.init)(params)
  step = _per_worker(lambda g, s, p: tx.update(g, s, p))
  report = optax_dist.communication_report(step, params, state, params)
  assert not report.unconditional
  assert not report.non_communication_step
  per_sync = list(report.per_conditional.values())
  assert len(per_sync) == 4
  assert [c.bytes for c in per_sync] == [_local_bytes(FRAGMENT_SHAPES, 4) // 4] * 4
  assert all(set(c.by_kind()) == {"all-reduce"} for c in per_sync)
  assert f"{per_sync[0]}" in str(report)


HIERARCHICAL = {
  "diloco": lambda inner: optax_dist.diloco(inner, sync_period=5, axis_name="hosts"),
  "local_sgd": lambda inner: optax_dist.local_sgd(inner, sync_period=5, axis_name="hosts"),
  "elastic_average": lambda inner: optax_dist.elastic_average(
    inner, communication_period=5, axis_name="hosts"),
}


@pytest.mark.parametrize("name", HIERARCHICAL)
def test_hierarchical_reports_tower_and_sync_bytes_apart(name):
  """E.g. diloco(tower(adamw, "gpus"), "hosts") on a 2x4 mesh: the tower's all-reduce on every
  step, the periodic exchange in its own conditional, both of the params' bytes."""
  mesh = jax.make_mesh((2, 4), ("hosts", "gpus"))
  tx = HIERARCHICAL[name](optax_dist.tower(optax.adamw(0.01), "gpus"))
  spec = P(("hosts", "gpus"))
  params, grads = jax.tree.map(
    lambda x: jax.device_put(x, NamedSharding(mesh, spec)), jax.device_get(_data())
  )

  def per_worker(f):
    def g(*args):
      return jax.tree.map(lambda x: x[None], f(*jax.tree.map(lambda x: x[0], args)))

    return jax.jit(jax.shard_map(g, mesh=mesh, in_specs=spec, out_specs=spec))

  state = per_worker(tx.init)(params)
  report = optax_dist.communication_report(
    per_worker(lambda g, s, p: tx.update(g, s, p)), grads, state, params
  )
  assert report.unconditional.bytes == PARAMS_BYTES  # the tower's mean over "gpus"
  (sync,) = report.per_conditional.values()
  assert sync.bytes == PARAMS_BYTES  # the pseudo-gradient's mean over "hosts"
  assert report.non_communication_step.bytes == PARAMS_BYTES


# ----------------------------------------------------------------------------------------------
# Nested loops and conditionals, compiled from JAX.


def _compiled_report(f, *scalars):
  """The compiled report of ``f(x, *scalars)`` under ``shard_map``, ``x`` 4 floats per worker."""
  step = jax.jit(
    jax.shard_map(f, mesh=MESH, in_specs=(P("w"),) + (P(),) * len(scalars), out_specs=P("w"))
  )
  x = jax.device_put(jnp.ones(N * 4), NamedSharding(MESH, P("w")))
  return optax_dist.communication_report(step, x, *scalars)


def _exchange(x):
  """An all-reduce of ``x`` (16 bytes per worker) whose result the next one depends on."""
  return jnp.sin(jax.lax.psum(x, "w")) + 0.5 * x


def test_nested_loops_count_each_collective_per_execution_of_both():
  """An all-reduce in a loop of 3 inside a loop of 5 runs 15 times per step; one in the outer
  loop's body only, 5 times."""

  def f(x):
    def outer(i, x):
      x = jax.lax.fori_loop(0, 3, lambda j, x: _exchange(x) + j, x)
      return _exchange(x) + i

    return jax.lax.fori_loop(0, 5, outer, x)

  report = _compiled_report(f)
  assert sorted(c.trip_count for c in report.collectives) == [5, 15]
  assert all(c.bytes == 16 and not c.conditionals for c in report.collectives)
  assert report.unconditional.count == 20
  assert report.unconditional.bytes == 20 * 16
  assert report.communication_step.by_kind() == {"all-reduce": (20, 320)}


def test_nested_conditionals_and_a_conditional_in_a_loop():
  """An all-reduce in a cond inside a cond names both, outermost first, and runs on the
  communication step only; one in a cond inside a loop of 5 runs 5 times there."""

  def f(x, a, b):
    def inner(x):
      return jax.lax.cond(b > 0, _exchange, lambda x: 2.0 * x, x)

    x = jax.lax.cond(a > 0, inner, lambda x: x + 1.0, x)
    body = lambda i, x: jax.lax.cond(b > i, _exchange, lambda x: x - 1.0, x)
    return jax.lax.fori_loop(0, 5, body, x)

  report = _compiled_report(f, 1, 1)
  by_depth = sorted(report.collectives, key=lambda c: len(c.conditionals))
  in_loop, nested = by_depth
  assert len(nested.conditionals) == 2 and nested.trip_count == 1
  assert len({name for name, _ in nested.conditionals}) == 2
  assert len(in_loop.conditionals) == 1 and in_loop.trip_count == 5
  assert in_loop.conditionals[0] not in nested.conditionals
  assert not report.unconditional
  assert report.conditional.count == 6
  assert report.communication_step.by_kind() == {"all-reduce": (6, 96)}
  assert not report.non_communication_step
  assert set(report.per_conditional) == {nested.conditionals[-1][0], in_loop.conditionals[0][0]}


def test_collectives_name_the_mesh_axes_they_span():
  """psum over "hosts", over "gpus" and over both on a 2x4 mesh: each collective's groups give
  the axes it spans, and by_axes splits the bytes (inside a host, across hosts) apart."""
  mesh = jax.make_mesh((2, 4), ("hosts", "gpus"))
  spec = jax.sharding.PartitionSpec(("hosts", "gpus"))

  def step(a, b, c):
    return (jax.lax.psum(a, "hosts"), jax.lax.psum(b, "gpus") * 2.0,
            jax.lax.psum(c, ("hosts", "gpus")) * 3.0)

  args = [jax.ShapeDtypeStruct((8, n), jnp.float32, sharding=jax.NamedSharding(mesh, spec))
          for n in (3, 5, 7)]
  report = optax_dist.communication_report(
    jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec), *args)
  assert report.collectives.by_axes(mesh) == {
    ("hosts",): (1, 12), ("gpus",): (1, 20), ("hosts", "gpus"): (1, 28)}
  assert report.collectives.over(mesh, "hosts").bytes == 12
  with pytest.raises(ValueError, match="outside a mesh of 4 devices"):
    report.collectives.items[0].axes(jax.make_mesh((4,), ("x",), devices=jax.devices()[:4]))


def test_iota_replica_groups_are_parsed():
  """XLA's iota form [G,S]<=[dims]T(perm): arange(8) as 2x4, transposed, cut into 4 groups of 2
  is {0,4},{1,5},{2,6},{3,7}: the groups across the first axis of a 2x4 mesh."""
  text = """HloModule m

ENTRY %main (p: f32[3]) -> f32[3] {
  %p = f32[3]{0} parameter(0)
  ROOT %ar = f32[3]{0} all-reduce(%p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
}
"""
  (collective,) = optax_dist.CommunicationReport.from_hlo_text(text).collectives
  assert collective.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert collective.axes(jax.make_mesh((2, 4), ("hosts", "gpus"))) == ("hosts",)


def test_mesh_axes_replica_groups_are_parsed():
  """XLA's mesh form ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (the global view's FSDP
  collectives): the groups along the second axis of a 2x4 mesh, {0,1,2,3} and {4,5,6,7}; with
  ``device_ids`` (an iota list or the ids), the mesh laid over those; a form with sub-axes is not
  read (no groups)."""
  hlo = """HloModule m

ENTRY %main (p: f32[3]) -> f32[3] {{
  %p = f32[3]{{0}} parameter(0)
  ROOT %ar = f32[3]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, use_global_device_ids=true, to_apply=%add
}}
"""
  mesh = jax.make_mesh((2, 4), ("replica", "fsdp"))
  for groups, expected, axes in [
      ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ((0, 1, 2, 3), (4, 5, 6, 7)), ("fsdp",)),
      ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", ((0, 4), (1, 5), (2, 6), (3, 7)), ("replica",)),
      ("mesh['axis_0'=2,'axis_1'=4,'axis_2'=1] {'axis_1','axis_2'}", ((0, 1, 2, 3), (4, 5, 6, 7)),
       ("fsdp",)),
      # The mesh over listed devices (the global view's exchange, one group per position of
      # (data, fsdp) when the state is sharded over both): 2x4 over 0,2,1,3,4,6,5,7.
      ("mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}",
       ((0, 4), (2, 6), (1, 5), (3, 7)), ("replica",)),
      ("mesh['axis_0'=2,'axis_1'=4], device_ids=(0,2,1,3,4,6,5,7) {'axis_1'}",
       ((0, 2, 1, 3), (4, 6, 5, 7)), ("fsdp",)),
      ("mesh['axis_0'=2,'axis_1'=4] {'axis_1':(1)2}", (), ("replica", "fsdp"))]:
    text = hlo.format(groups=groups)
    (collective,) = optax_dist.CommunicationReport.from_hlo_text(text).collectives
    assert collective.groups == expected, groups
    assert collective.axes(mesh) == axes, groups
