"""Golden results: short runs of every params-updating transformation, bit for bit.

Each case builds one transformation with one exchange option (wire format, block size, error
feedback, overlap, eager, mixing, fragments, hierarchical axes, slice axis), runs ``init`` and
``STEPS`` updates of four workers in one jitted program (under ``jax.vmap(axis_name=...)`` or
``jax.shard_map`` on the emulated CPU devices), and compares the SHA-256 of the final params and
of the final state (every leaf's dtype, shape and bytes) with ``tests/golden/hashes.json``.

The hashes are of x86-64 code with XLA's CPU instructions capped at AVX2 (``conftest.py``: the
widest vectors the machine has would round some sums differently); elsewhere the cases are
skipped. The fixture records what the library computed when it was written; a change of the library
that is meant to keep every result (a restructuring) must keep these hashes. Regenerate them
only for a change meant to alter results, and say so in its commit::

  PYTHONPATH=$PWD python tests/test_golden.py --write
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

if __name__ == "__main__":  # the generator: set up JAX as the tests' conftest does
  sys.path.insert(0, str(pathlib.Path(__file__).parent))

import conftest  # noqa: E402

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

FIXTURE = pathlib.Path(__file__).parent / "golden" / "hashes.json"
STEPS = 8
SHAPES = {"a": (4, 3), "b": (5,), "c": (2,)}  # b: 5 values, not a multiple of the blocks
BLOCK = 4  # comm_block_size of the quantized formats: several blocks per leaf

# How the workers are mapped: (devices per mesh axis, mesh axis names); "vmap" is one axis "w"
# of 4 workers under jax.vmap.
LAYOUTS = {
  "vmap": ((4,), ("w",)),
  "shard": ((4,), ("w",)),
  "hosts": ((2, 2), ("hosts", "gpus")),  # four workers on a tuple of two axes
  "sliced": ((2, 4), ("hosts", "gpus")),  # two workers of four devices each
}


def _sgd():
  return optax.sgd(0.1, momentum=0.9)


def _adam():
  return optax.adam(0.05)


def _diloco(**kw):
  kw.setdefault("axis_name", "w")
  return optax_dist.diloco(_adam(), optax.sgd(0.7, momentum=0.9, nesterov=True), sync_period=3,
                           **kw)


def _streaming(**kw):
  kw.setdefault("sync_period", 4)
  kw.setdefault("num_fragments", 2)
  return optax_dist.streaming_diloco(_adam(), optax.sgd(0.7, momentum=0.9, nesterov=True),
                                     axis_name="w", **kw)


def _local_sgd(**kw):
  return optax_dist.local_sgd(_sgd(), sync_period=3, axis_name="w", **kw)


def _elastic(inner=None, **kw):
  kw.setdefault("axis_name", "w")
  return optax_dist.elastic_average(
    inner or _sgd(), communication_period=3, moving_rate=0.2, **kw)


def _agn(**kw):
  kw.setdefault("axis_name", "w")
  return optax_dist.agn(_sgd(), communication_period=3, **kw)


def _stale_step(t):
  """``grad_step`` for ``drop_stale_gradients``: every third gradient is two steps old."""
  return {"grad_step": jnp.where(t % 3 == 2, t - 2, t).astype(jnp.int32)}


# name -> (layout, build, extra args of update given the 0-based step t, NaN gradient step)
CASES = {
  # One case per transformation, under vmap.
  "moving_average": ("vmap", lambda: optax_dist.moving_average(
    optax_dist.tower(_sgd(), "w"), 0.9), None),
  "moving_average_num_updates": ("vmap", lambda: optax_dist.moving_average(
    _adam(), 0.9, use_num_updates=True, sequential_update=False), None),
  "elastic_average": ("vmap", lambda: _elastic(), None),
  "agn_sequential": ("vmap", lambda: _agn(), None),
  "agn_mean": ("vmap", lambda: _agn(center_update="mean"), None),
  "drop_stale_gradients": ("vmap", lambda: optax_dist.drop_stale_gradients(_sgd(), 1),
                           _stale_step),
  "tower_mean": ("vmap", lambda: optax_dist.tower(_adam(), "w"), None),
  "tower_sum_bf16": ("vmap", lambda: optax_dist.tower(
    _sgd(), "w", reduction="sum", comm_dtype=jnp.bfloat16), None),
  "all_reduce": ("vmap", lambda: optax.chain(
    optax_dist.all_reduce("w", "sum"), _sgd()), None),
  "accumulate_then_reduce": ("vmap", lambda: optax_dist.accumulate_then_reduce(
    _adam(), 2, "w"), None),
  "accumulate_then_reduce_sum_bf16": ("vmap", lambda: optax_dist.accumulate_then_reduce(
    _sgd(), 3, "w", reduction="sum", comm_dtype=jnp.bfloat16), None),
  "apply_if_finite": ("vmap", lambda: optax_dist.apply_if_finite(
    optax_dist.tower(_sgd(), "w"), 2, axis_name="w"), None),
  "diloco": ("vmap", lambda: _diloco(), None),
  "diloco_delayed_nesterov": ("vmap", lambda: optax_dist.diloco(
    _adam(), optax_dist.delayed_nesterov(0.7, 0.9, buffer_size=2), sync_period=2,
    axis_name="w"), None),
  "streaming_diloco": ("vmap", lambda: _streaming(), None),
  "local_sgd": ("vmap", lambda: _local_sgd(), None),
  # Wire formats.
  "diloco_bf16_anchor_f32": ("vmap", lambda: _diloco(
    comm_dtype=jnp.bfloat16, anchor_dtype=jnp.float32), None),
  "diloco_float8": ("vmap", lambda: _diloco(comm_dtype=jnp.float8_e4m3fn), None),
  "diloco_int8": ("vmap", lambda: _diloco(comm_dtype=jnp.int8, comm_block_size=BLOCK), None),
  "diloco_float4_ef": ("vmap", lambda: _diloco(
    comm_dtype=jnp.float4_e2m1fn, comm_block_size=BLOCK, error_feedback=True), None),
  "diloco_e3m0_ef": ("vmap", lambda: _diloco(
    comm_dtype="e3m0", comm_block_size=BLOCK, error_feedback=True), None),
  "streaming_bf16": ("vmap", lambda: _streaming(comm_dtype=jnp.bfloat16), None),
  "streaming_float8": ("vmap", lambda: _streaming(comm_dtype=jnp.float8_e5m2), None),
  "streaming_int8_ef": ("vmap", lambda: _streaming(
    comm_dtype=jnp.int8, comm_block_size=BLOCK, error_feedback=True), None),
  "streaming_e3m0": ("vmap", lambda: _streaming(comm_dtype="e3m0", comm_block_size=BLOCK),
                     None),
  "local_sgd_bf16_warmup": ("vmap", lambda: _local_sgd(
    comm_dtype=jnp.bfloat16, warmup_steps=2), None),
  "local_sgd_float4": ("vmap", lambda: _local_sgd(
    comm_dtype=jnp.float4_e2m1fn, comm_block_size=BLOCK), None),
  "elastic_average_int8": ("vmap", lambda: _elastic(comm_dtype="int8", comm_block_size=BLOCK),
                           None),
  "agn_e3m0": ("vmap", lambda: _agn(comm_dtype="e3m0", comm_block_size=BLOCK), None),
  # Streaming DiLoCo's overlap, eager updates, mixing and fragments.
  "streaming_overlap": ("vmap", lambda: _streaming(overlap=1), None),
  "streaming_overlap_eager": ("vmap", lambda: _streaming(overlap=2, eager=True), None),
  "streaming_overlap_eager_mixing": ("vmap", lambda: _streaming(
    overlap=3, eager=True, mixing=0.5, sync_period=5), None),
  "streaming_three_fragments_h2": ("vmap", lambda: _streaming(
    num_fragments=3, sync_period=2), None),
  "streaming_explicit_fragments": ("vmap", lambda: _streaming(
    fragments={"a": 1, "b": 0, "c": 1}, anchor_dtype=jnp.float32), None),
  "streaming_overlap_float4_ef_eager": ("vmap", lambda: _streaming(
    overlap=1, eager=True, comm_dtype="float4_e2m1fn", comm_block_size=BLOCK,
    error_feedback=True), None),
  # shard_map on four devices.
  "shard_tower": ("shard", lambda: optax_dist.tower(_adam(), "w"), None),
  "shard_accumulate_then_reduce": ("shard", lambda: optax_dist.accumulate_then_reduce(
    _sgd(), 2, "w"), None),
  "shard_apply_if_finite": ("shard", lambda: optax_dist.apply_if_finite(
    optax_dist.tower(_sgd(), "w"), 2, axis_name="w"), None),
  "shard_elastic_average_bf16": ("shard", lambda: _elastic(comm_dtype=jnp.bfloat16), None),
  "shard_agn": ("shard", lambda: _agn(), None),
  "shard_agn_mean_int8": ("shard", lambda: _agn(
    center_update="mean", comm_dtype="int8", comm_block_size=BLOCK), None),
  "shard_diloco_int8_ef": ("shard", lambda: _diloco(
    comm_dtype=jnp.int8, comm_block_size=BLOCK, error_feedback=True), None),
  "shard_streaming_overlap_eager_e3m0_ef": ("shard", lambda: _streaming(
    overlap=1, eager=True, mixing=0.5, comm_dtype="e3m0", comm_block_size=BLOCK,
    error_feedback=True), None),
  "shard_streaming": ("shard", lambda: _streaming(), None),
  "shard_local_sgd_warmup": ("shard", lambda: _local_sgd(warmup_steps=2), None),
  # Hierarchical: the workers on a tuple of mesh axes.
  "hosts_tower_hierarchical": ("hosts", lambda: optax_dist.tower(
    _sgd(), ("hosts", "gpus"), hierarchical=True), None),
  "hosts_all_reduce_hierarchical_bf16": ("hosts", lambda: optax.chain(optax_dist.all_reduce(
    ("hosts", "gpus"), comm_dtype=jnp.bfloat16, hierarchical=True), _sgd()), None),
  "hosts_diloco": ("hosts", lambda: _diloco(axis_name=("hosts", "gpus")), None),
  "hosts_diloco_int8_ef": ("hosts", lambda: optax_dist.diloco(
    _adam(), sync_period=3, axis_name=("hosts", "gpus"), comm_dtype="int8",
    comm_block_size=BLOCK, error_feedback=True), None),
  "hosts_streaming_overlap": ("hosts", lambda: optax_dist.streaming_diloco(
    _adam(), sync_period=4, num_fragments=2, overlap=1, axis_name=("hosts", "gpus")), None),
  "hosts_elastic_average": ("hosts", lambda: _elastic(axis_name=("hosts", "gpus")), None),
  # slice_axis: two workers ("hosts") of four devices ("gpus") holding one replica.
  "sliced_diloco": ("sliced", lambda: optax_dist.diloco(
    optax_dist.tower(_adam(), "gpus"), sync_period=3, axis_name="hosts", slice_axis="gpus"),
    None),
  "sliced_diloco_int8_ef": ("sliced", lambda: optax_dist.diloco(
    optax_dist.tower(_adam(), "gpus"), sync_period=3, axis_name="hosts", slice_axis="gpus",
    comm_dtype="int8", comm_block_size=BLOCK, error_feedback=True), None),
  "sliced_streaming_overlap_eager": ("sliced", lambda: optax_dist.streaming_diloco(
    optax_dist.tower(_adam(), "gpus"), sync_period=4, num_fragments=2, overlap=1, eager=True,
    axis_name="hosts", slice_axis="gpus"), None),
  "sliced_local_sgd_bf16": ("sliced", lambda: optax_dist.local_sgd(
    optax_dist.tower(_sgd(), "gpus"), sync_period=3, axis_name="hosts", slice_axis="gpus",
    comm_dtype=jnp.bfloat16), None),
  "sliced_elastic_average": ("sliced", lambda: _elastic(
    optax_dist.tower(_sgd(), "gpus"), axis_name="hosts", slice_axis="gpus"), None),
  "sliced_agn": ("sliced", lambda: optax_dist.agn(
    optax_dist.tower(_sgd(), "gpus"), communication_period=3, axis_name="hosts",
    slice_axis="gpus"), None),
  "sliced_agn_mean": ("sliced", lambda: optax_dist.agn(
    optax_dist.tower(_sgd(), "gpus"), communication_period=3, center_update="mean",
    axis_name="hosts", slice_axis="gpus"), None),
}
NAN_CASES = {"apply_if_finite", "shard_apply_if_finite"}  # worker 1's gradient is NaN on step 2


def _inputs(num_devices: int) -> tuple[dict, dict, dict]:
  """Per-device initial params (identical), targets and noise (``[STEPS, devices, ...]``)."""
  rng = np.random.default_rng(0)
  x0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
  params = {k: np.broadcast_to(v, (num_devices, *v.shape)).copy() for k, v in x0.items()}
  targets = {k: rng.normal(size=(num_devices, *s)).astype(np.float32) for k, s in SHAPES.items()}
  noise = {k: rng.normal(size=(STEPS, num_devices, *s)).astype(np.float32)
           for k, s in SHAPES.items()}
  return params, targets, noise


def _program(tx, extra, nan, axes=()):
  """One device's run: ``init``, then ``STEPS`` updates on the gradient of
  :math:`\\frac12 \\|x - \\mathrm{target}\\|^2` plus noise; the final params and state.

  Under ``shard_map`` (``axes``, the mesh's) the carry is typed varying over every axis, as
  between two calls of a mapped step (no data moves)."""

  def cast(v):
    missing = tuple(a for a in axes if a not in jax.typeof(v).manual_axis_type.varying)
    return jax.lax.pcast(v, missing, to="varying") if missing else v

  def varying(tree):
    return jax.tree.map(cast, tree)

  def run(params, target, noise, nan_here):
    def step(carry, xs):
      params, state = carry
      t, noise_t = xs
      grads = jax.tree.map(lambda p, c, e: p - c + e, params, target, noise_t)
      if nan:
        grads = jax.tree.map(lambda g: jnp.where(nan_here & (t == 2), jnp.nan, g), grads)
      updates, state = tx.update(grads, state, params, **(extra(t) if extra else {}))
      return varying((optax.apply_updates(params, updates), state)), None

    steps = (jnp.arange(STEPS, dtype=jnp.int32), noise)
    (params, state), _ = jax.lax.scan(step, varying((params, tx.init(params))), steps)
    return params, state

  return run


def run_case(name: str) -> tuple[object, object]:
  layout, build, extra = CASES[name]
  shape, axes = LAYOUTS[layout]
  num_devices = int(np.prod(shape))
  params, targets, noise = _inputs(num_devices)
  nan_here = np.arange(num_devices) == 1
  if layout == "vmap":
    run = _program(build(), extra, name in NAN_CASES)
    mapped = jax.jit(jax.vmap(run, in_axes=(0, 0, 1, 0), axis_name="w"))
    return mapped(params, targets, noise, nan_here)
  run = _program(build(), extra, name in NAN_CASES, axes)
  mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:num_devices])
  spec = P(axes)
  squeeze = lambda tree, axis=0: jax.tree.map(lambda v: jnp.squeeze(v, axis), tree)  # noqa: E731

  def per_device(params, target, noise, nan_here):
    out = run(squeeze(params), squeeze(target), squeeze(noise, 1), squeeze(nan_here))
    return jax.tree.map(lambda v: v[None], out)

  mapped = jax.jit(jax.shard_map(
    per_device, mesh=mesh, in_specs=(spec, spec, P(None, axes), spec), out_specs=spec))
  put = lambda v, s=spec: jax.device_put(v, NamedSharding(mesh, s))  # noqa: E731
  return mapped(put(params), put(targets), put(noise, P(None, axes)), put(nan_here))


def digest(tree: object) -> str:
  """SHA-256 over ``tree``'s leaves in order: each leaf's dtype, shape and bytes."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    value = np.asarray(leaf)
    h.update(f"{value.dtype.name}{value.shape}".encode())
    h.update(np.ascontiguousarray(value).tobytes())
  return h.hexdigest()


def hashes(name: str) -> dict[str, str]:
  params, state = run_case(name)
  return {"params": digest(params), "state": digest(state)}


def test_every_case_is_recorded():
  assert sorted(json.loads(FIXTURE.read_text())) == sorted(CASES)


@pytest.mark.skipif(not conftest.X86, reason="the hashes are of x86-64 code (AVX2)")
@pytest.mark.parametrize("name", list(CASES))
def test_golden(name):
  assert hashes(name) == json.loads(FIXTURE.read_text())[name]


def test_digest_sees_dtype_shape_and_bits():
  x = np.zeros(4, np.float32)
  distinct = {digest(x), digest(x.reshape(2, 2)), digest(x.astype(np.int32)),
              digest(-x), digest(np.nextafter(x, 1))}
  assert len(distinct) == 5


if __name__ == "__main__":
  if sys.argv[1:] != ["--write"]:
    sys.exit("usage: PYTHONPATH=$PWD python tests/test_golden.py --write")
  FIXTURE.parent.mkdir(exist_ok=True)
  FIXTURE.write_text(json.dumps({name: hashes(name) for name in CASES}, indent=1) + "\n")
  print(f"wrote {len(CASES)} cases to {FIXTURE}")
