"""Block-quantized exchange formats against NumPy references written here.

The references encode with the formats' definitions (a scale per block, round to the nearest
grid point with ties to even, the grids listed in full) and read the codes with their own
unpacking; ``ml_dtypes`` gives a second reference for ``float4_e2m1fn``. ``quantized_sum`` runs
under ``jax.vmap(axis_name=...)`` and under ``jax.shard_map`` over four emulated devices, and its
all-gather bytes are read from the compiled program.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist
from optax_dist import _quantize

FORMATS = ("int8", "float4_e2m1fn", "e3m0")
GRIDS = {  # magnitudes, in code order
  "float4_e2m1fn": np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64),
  "e3m0": np.array([0, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1], np.float64),
}
FORMAT_MAX = {"int8": 127, "float4_e2m1fn": 6, "e3m0": 1}
N = 4
# encode and decode jitted, as a step runs them: one program per format and shape, where the eager
# call compiled each of its operations for each shape.
encode = jax.jit(_quantize.encode, static_argnums=(1, 2))
decode = jax.jit(_quantize.decode, static_argnums=(1, 2, 3))


# ----------------------------------------------------------------------------------------------
# NumPy references.


def ref_encode(x, fmt, block_size):
  """(signed grid values ``float32[K, B]``, scales ``float32[K]``) of ``x``, padded with zeros."""
  flat = np.asarray(x, np.float32).ravel()
  num_blocks = -(-flat.size // block_size)
  blocks = np.zeros(num_blocks * block_size, np.float32)
  blocks[: flat.size] = flat
  blocks = blocks.reshape(num_blocks, block_size)
  scales = np.abs(blocks).max(axis=1) * np.float32(1 / FORMAT_MAX[fmt])  # float32 reciprocal
  # Round up to 17 / 22 / 24 significant bits: every grid value x scale is then exact.
  step = np.uint32(2 ** {"int8": 7, "float4_e2m1fn": 2, "e3m0": 0}[fmt])
  scales = (-(-scales.view(np.uint32) // step) * step).view(np.float32)
  scales[scales < 2.0**-126] = 0.0
  with np.errstate(divide="ignore"):
    y = blocks * np.where(scales > 0, np.float32(1) / scales, np.float32(0))[:, None]
  if fmt == "int8":
    return np.clip(np.round(y), -127, 127).astype(np.float32), scales
  grid = GRIDS[fmt]
  distance = np.abs(grid - np.abs(y.astype(np.float64))[..., None])
  nearest = distance == distance.min(axis=-1, keepdims=True)
  even = nearest & (np.arange(8) % 2 == 0)  # a tie is between neighbours: one index is even
  index = np.where(even.any(-1), even.argmax(-1), nearest.argmax(-1))
  return (np.where(y < 0, -1, 1) * grid[index]).astype(np.float32), scales


def ref_values(packed, fmt):
  """The signed grid values ``float32[K, B]`` that ``packed``'s codes stand for."""
  codes = np.asarray(packed.codes)
  if fmt == "int8":
    assert codes.dtype == np.int8
    return codes.astype(np.float32)
  assert codes.dtype == np.uint8
  unpacked = np.empty((codes.shape[0], 2 * codes.shape[1]), np.uint8)
  unpacked[:, 0::2] = codes & 0xF
  unpacked[:, 1::2] = codes >> 4
  sign = np.where(unpacked >> 3, -1.0, 1.0)
  return (sign * GRIDS[fmt][unpacked & 7]).astype(np.float32)


def ref_decode(values, scales, size):
  return (values * scales[:, None]).ravel()[:size]


def bracket_step(magnitude, fmt):
  """The spacing of the grid around each ``magnitude`` (>= 0, at most the grid's max)."""
  grid = np.arange(128.0) if fmt == "int8" else GRIDS[fmt]
  upper = np.clip(np.searchsorted(grid, magnitude), 1, len(grid) - 1)
  return grid[upper] - grid[upper - 1]


def test_data(seed=0, shape=(3, 100)):
  """Values whose rows differ by orders of magnitude, with zeros and exact block maxima."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape) * np.logspace(-3, 3, shape[0])[:, None]
  x.ravel()[::17] = 0.0
  return x.astype(np.float32)


test_data.__test__ = False


# ----------------------------------------------------------------------------------------------
# encode / decode.


@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_matches_reference(fmt):
  x = test_data()
  packed = encode(jnp.asarray(x), fmt, 64)
  values, scales = ref_encode(x, fmt, 64)
  np.testing.assert_array_equal(np.asarray(packed.scales), scales)
  np.testing.assert_array_equal(ref_values(packed, fmt), values)
  decoded = decode(packed, fmt, x.shape, jnp.float32)
  expected = ref_decode(values, scales, x.size).reshape(x.shape)
  np.testing.assert_array_equal(np.asarray(decoded), expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ties_round_to_even(fmt):
  """A block whose maximum is the format's maximum has scale 1: the midpoints are exact."""
  grid = np.arange(128.0) if fmt == "int8" else GRIDS[fmt]
  midpoints = (grid[:-1] + grid[1:]) / 2
  x = np.concatenate([[grid[-1]], midpoints, -midpoints]).astype(np.float32)
  x = np.pad(x, (0, -x.size % 2))
  packed = encode(jnp.asarray(x), fmt, x.size)
  assert float(packed.scales[0]) == 1.0
  values, _ = ref_encode(x, fmt, x.size)
  np.testing.assert_array_equal(ref_values(packed, fmt), values)
  index = np.searchsorted(grid, np.abs(values[0, 1 : 1 + len(midpoints)]))
  assert np.all(index % 2 == 0)


def test_e2m1_matches_ml_dtypes():
  """The codes are ``float4_e2m1fn``'s bit patterns of ``x / scale``, as ml_dtypes rounds."""
  rng = np.random.default_rng(1)
  x = np.concatenate([[6.0], np.linspace(-6, 6, 4801), np.clip(rng.normal(size=1000) * 3, -6, 6)])
  x = x[: x.size - x.size % 2].astype(np.float32)
  packed = encode(jnp.asarray(x), "float4_e2m1fn", x.size)
  assert float(packed.scales[0]) == 1.0
  bits = np.asarray(x.astype(ml_dtypes.float4_e2m1fn)).view(np.uint8)
  codes = np.asarray(packed.codes)
  np.testing.assert_array_equal(codes[0] & 0xF, bits[0::2])
  np.testing.assert_array_equal(codes[0] >> 4, bits[1::2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_within_half_a_step(fmt):
  x = test_data(seed=2, shape=(8, 64))
  packed = encode(jnp.asarray(x), fmt, 64)
  decoded = np.asarray(decode(packed, fmt, x.shape, jnp.float32), np.float64)
  scales = np.asarray(packed.scales, np.float64)[:, None]
  magnitude = np.minimum(np.abs(x) / scales, FORMAT_MAX[fmt])
  bound = bracket_step(magnitude, fmt) / 2 * scales * (1 + 1e-6)
  assert np.all(np.abs(decoded - x) <= bound)
  assert np.all(np.abs(decoded - x).max(axis=1) > 0)  # the test data does quantize


@pytest.mark.parametrize("fmt", ["float4_e2m1fn", "e3m0"])
def test_every_4bit_code_survives_packing(fmt):
  codes = np.random.default_rng(3).permutation(np.tile(np.arange(16, dtype=np.uint8), 8))
  codes = codes.reshape(4, 32)
  packed = np.asarray(jax.jit(_quantize._pack)(codes))
  assert packed.shape == (4, 16) and packed.dtype == np.uint8
  np.testing.assert_array_equal(packed, codes[:, 0::2] | (codes[:, 1::2] << 4))
  np.testing.assert_array_equal(np.asarray(jax.jit(_quantize._unpack)(packed)), codes)
  # Every signed grid point, at scale 1, comes back exactly (negative zero included).
  grid = GRIDS[fmt].astype(np.float32)
  x = np.concatenate([grid, -grid])
  decoded = np.asarray(decode(encode(jnp.asarray(x), fmt, 16), fmt, (16,)))
  np.testing.assert_array_equal(decoded, x)
  np.testing.assert_array_equal(np.signbit(decoded), np.signbit(x))


@pytest.mark.parametrize("fmt", FORMATS)
def test_padding_and_shapes(fmt):
  """103 values in blocks of 16: 7 blocks, the last one padded with 9 zeros."""
  x = test_data(seed=4, shape=(1, 103)).ravel()
  packed = encode(jnp.asarray(x), fmt, 16)
  width = 16 if fmt == "int8" else 8
  assert packed.codes.shape == (7, width) and packed.scales.shape == (7,)
  assert packed.scales.dtype == jnp.float32
  assert packed.codes.nbytes + packed.scales.nbytes == _quantize.wire_bytes(103, fmt, 16)
  np.testing.assert_array_equal(ref_values(packed, fmt)[-1, 103 - 96 :], 0.0)
  assert decode(packed, fmt, (103,), jnp.bfloat16).dtype == jnp.bfloat16
  assert decode(packed, fmt).shape == (112,)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_and_tiny_blocks_are_sent_as_zeros(fmt):
  """A zero block, and one whose scale would be below float32's smallest normal."""
  tiny = 2.0**-127 * FORMAT_MAX[fmt]  # the scale would be 2**-127
  x = np.concatenate([np.zeros(8), np.full(8, tiny), [1e-30] + [0] * 7]).astype(np.float32)
  packed = encode(jnp.asarray(x), fmt, 8)
  scales = np.asarray(packed.scales)
  assert scales[0] == 0.0 and scales[1] == 0.0 and scales[2] >= 2.0**-126
  decoded = np.asarray(decode(packed, fmt, (24,)))
  np.testing.assert_array_equal(decoded[:16], 0.0)
  np.testing.assert_allclose(decoded[16], 1e-30, rtol=2.0**-16)
  assert np.all(np.isfinite(decoded))


@pytest.mark.parametrize(
  ("fmt", "block_size", "expected"),
  [("int8", 256, 4 * 256 + 4 * 4), ("float4_e2m1fn", 256, 4 * 128 + 4 * 4),
   ("e3m0", 256, 4 * 128 + 4 * 4), ("int8", 1, 1000 + 4000), ("e3m0", 2, 500 + 2000)],
)
def test_wire_bytes(fmt, block_size, expected):
  assert _quantize.wire_bytes(1000, fmt, block_size) == expected
  assert _quantize.wire_bytes(0, fmt, block_size) == 0


def test_errors():
  choices = "'int8', 'float4_e2m1fn', 'e3m0'"
  message = rf"`encode\(fmt=...\)` must be one of {choices}, got 'int4'"
  with pytest.raises(ValueError, match=message):
    _quantize.encode(jnp.ones(4), "int4")
  with pytest.raises(ValueError, match=r"`quantized_sum\(fmt=...\)`.*got 'float8'"):
    _quantize.quantized_sum(jnp.ones(4), "w", "float8")
  with pytest.raises(ValueError, match=r"`decode\(fmt=...\)`"):
    _quantize.decode(_quantize.encode(jnp.ones(4), "int8", 4), jnp.float32)
  for bad in (0, -4):
    message = rf"`wire_bytes\(block_size=...\)` must be a positive int, got {bad}"
    with pytest.raises(ValueError, match=message):
      _quantize.wire_bytes(10, "int8", bad)
  for bad in (2.0, True, "8"):
    with pytest.raises(TypeError, match=r"`encode\(block_size=...\)` must be a positive int"):
      _quantize.encode(jnp.ones(4), "int8", bad)
  with pytest.raises(ValueError, match=r"must be even for fmt='e3m0'.*got 7"):
    _quantize.encode(jnp.ones(4), "e3m0", 7)
  with pytest.raises(ValueError, match=r"must be even for fmt='float4_e2m1fn'"):
    _quantize.wire_bytes(4, jnp.float4_e2m1fn, 255)
  with pytest.raises(ValueError, match=r"num_values=...\)` must be >= 0, got -1"):
    _quantize.wire_bytes(-1, "int8", 4)
  with pytest.raises(ValueError, match=r"`decode\(shape=...\)`: \(9,\) holds 9 values"):
    _quantize.decode(_quantize.encode(jnp.ones(4), "int8", 8), "int8", (9,))
  with pytest.raises(ValueError, match=r"residual=...\)` must have the shape of `x`"):
    _quantize.quantize_with_feedback(jnp.ones(4), jnp.zeros(3))
  # The leaves are sent end to end: a residual of the right total size but another shape is
  # still refused, naming both shapes.
  with pytest.raises(ValueError, match=r"leaf of shape \(2, 3\) has a residual of shape \(6,\)"):
    jax.vmap(lambda t, r: _quantize.quantized_sum_with_feedback(t, r, "w"), axis_name="w")(
      {"a": jnp.ones((1, 2, 3))}, {"a": jnp.zeros((1, 6))})
  _quantize.encode(jnp.ones(7), "int8", 7)  # an odd block is fine for int8
  assert _quantize.wire_bytes(8, jnp.int8, 4) == 16  # dtypes name their formats


# ----------------------------------------------------------------------------------------------
# quantized_sum over the workers.


def worker_trees(seed=5):
  """Each worker's tree (leading axis N): a leaf not a multiple of the block, bfloat16, int."""
  rng = np.random.default_rng(seed)
  return {
    "w": np.stack([test_data(seed + i, (3, 100)) for i in range(N)]),
    "b": (rng.normal(size=(N, 7)) * 10).astype(ml_dtypes.bfloat16),
    "n": np.arange(N * 2, dtype=np.int32).reshape(N, 2),
  }


def ref_quantized_sum(trees, fmt, block_size):
  """Each worker's floating leaves (sorted keys, as ``jax.tree.leaves``) end to end, encoded as
  one vector; the decoded vectors added in worker order in float32; ints summed."""
  floating = [k for k in sorted(trees) if trees[k].dtype != np.int32]
  out = {k: leaf.sum(axis=0, dtype=leaf.dtype) for k, leaf in trees.items() if k not in floating}
  sizes = [math.prod(trees[k].shape[1:]) for k in floating]
  decoded = []
  for worker in range(N):
    flat = np.concatenate([trees[k][worker].astype(np.float32).ravel() for k in floating])
    decoded.append(ref_decode(*ref_encode(flat, fmt, block_size), flat.size))
  total = decoded[0]
  for d in decoded[1:]:
    total = total + d
  for k, piece in zip(floating, np.split(total, np.cumsum(sizes)[:-1]), strict=True):
    out[k] = piece.reshape(trees[k].shape[1:]).astype(trees[k].dtype)
  return out


def assert_trees_equal(actual, expected):
  for key in expected:
    assert np.asarray(actual[key]).dtype == expected[key].dtype, key
    np.testing.assert_array_equal(np.asarray(actual[key]), expected[key], err_msg=key)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_sum_vmap_equals_reference(fmt):
  trees = worker_trees()
  step = jax.jit(jax.vmap(lambda t: _quantize.quantized_sum(t, "w", fmt, 64), axis_name="w"))
  out = step(jax.tree.map(jnp.asarray, trees))
  expected = ref_quantized_sum(trees, fmt, 64)
  for worker in range(N):
    assert_trees_equal({k: v[worker] for k, v in out.items()}, expected)
  # Not the plain sum: the exchange did quantize.
  assert not np.array_equal(np.asarray(out["w"][0]), trees["w"].sum(axis=0))


MESH = jax.make_mesh((N,), ("w",), devices=jax.devices()[:N])


@functools.cache
def sharded_step(fmt, block_size):
  def per_worker(tree):
    local = jax.tree.map(lambda x: x[0], tree)
    return jax.tree.map(lambda x: x[None], _quantize.quantized_sum(local, "w", fmt, block_size))

  return jax.jit(jax.shard_map(per_worker, mesh=MESH, in_specs=P("w"), out_specs=P("w")))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_sum_shard_map_bytes_and_values(fmt):
  trees = worker_trees(seed=6)
  sharded = jax.device_put(jax.tree.map(jnp.asarray, trees), NamedSharding(MESH, P("w")))
  step = sharded_step(fmt, 64)
  report = optax_dist.communication_report(step, sharded)
  gathers = report.unconditional.of_kind("all-gather")
  expected = _quantize.wire_bytes(7 + 300, fmt, 64)  # "b" and "w" end to end: one last block
  assert gathers.bytes == expected
  assert gathers.count == 2  # codes and scales, however many leaves
  assert gathers.result_bytes == N * expected
  code_dtype = "s8" if fmt == "int8" else "u8"
  assert {s.split("[")[0] for c in gathers for s in c.shapes} == {code_dtype, "f32"}
  assert report.unconditional.of_kind("all-reduce").bytes == 2 * 4  # the int leaf, psum
  assert report.collectives.count == report.unconditional.count  # nothing else
  out = step(sharded)
  expected_values = ref_quantized_sum(trees, fmt, 64)
  for worker in range(N):
    assert_trees_equal({k: np.asarray(v)[worker] for k, v in out.items()}, expected_values)


def test_quantized_sum_non_finite_block():
  trees = worker_trees(seed=7)
  trees["w"][2, 0, 5] = np.nan
  trees["w"][1, 2, 99] = np.inf
  out = jax.jit(jax.vmap(lambda t: _quantize.quantized_sum(t, "w", "e3m0", 64), axis_name="w"))(
    trees)
  # "b" (7 values) then "w" end to end: w[j] is value 7 + j, in block (7 + j) // 64.
  w = np.asarray(out["w"][0]).ravel()
  assert not np.isfinite(np.asarray(out["b"][0], np.float32)).any()  # block 0: b and w[:57]
  assert not np.isfinite(w[:57]).any()  # the block holding the NaN (w[5])
  assert not np.isfinite(w[249:300]).any()  # the (padded) last block, holding the inf (w[299])
  assert np.isfinite(w[57:249]).all()


# ----------------------------------------------------------------------------------------------
# Error feedback.


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_feedback_loses_nothing(fmt):
  """Sent values plus the final residual sum to the inputs; without feedback they do not."""
  rng = np.random.default_rng(8)
  rounds = 20
  xs = [(rng.normal(size=(5, 40)) * np.logspace(-2, 1, 5)[:, None]).astype(np.float32)
        for _ in range(rounds)]
  step = jax.jit(functools.partial(_quantize.quantize_with_feedback, fmt=fmt, block_size=40))
  decode = jax.jit(functools.partial(_quantize.decode, fmt=fmt, shape=(5, 40)))
  round_trip = jax.jit(lambda x: _quantize.decode(_quantize.encode(x, fmt, 40), fmt, x.shape))
  residual = jnp.zeros((5, 40), jnp.float32)
  sent = np.zeros((5, 40))
  sent_without = np.zeros((5, 40))
  for x in xs:
    target = np.asarray(x, np.float64) + np.asarray(residual, np.float64)
    packed, residual = step(jnp.asarray(x), residual)
    assert residual.dtype == jnp.float32
    decoded = np.asarray(decode(packed), np.float64)
    np.testing.assert_array_equal(decoded + np.asarray(residual, np.float64),
                                  np.float32(target))  # the residual is exact
    sent += decoded
    sent_without += np.asarray(round_trip(x))
  total = np.sum(xs, axis=0, dtype=np.float64)
  tolerance = rounds * np.finfo(np.float32).eps * np.abs(total).max(axis=1, keepdims=True) * 4
  error = np.abs(sent + np.asarray(residual, np.float64) - total)
  assert np.all(error <= tolerance)
  assert np.abs(sent_without - total).max() > 100 * tolerance.max()


def test_error_feedback_bfloat16_input():
  x = jnp.asarray(np.linspace(-1, 1, 32), jnp.bfloat16)
  packed, residual = jax.jit(_quantize.quantize_with_feedback, static_argnums=(2, 3))(
    x, jnp.zeros(32, jnp.float32), "e3m0", 32)
  assert residual.dtype == jnp.float32 and residual.shape == (32,)
  decoded = np.asarray(decode(packed, "e3m0", (32,)))
  np.testing.assert_array_equal(decoded + np.asarray(residual), np.asarray(x, np.float32))


def test_trees_without_floating_values_skip_the_gather():
  """Integer and empty leaves are reduced as they are; with nothing to encode, no all_gather."""
  tree = {"n": np.arange(N * 2, dtype=np.int32).reshape(N, 2), "e": np.zeros((N, 0), np.float32)}
  sums = jax.vmap(lambda t: _quantize.quantized_sum(t, "w"), axis_name="w")(tree)
  np.testing.assert_array_equal(sums["n"][0], tree["n"].sum(0))
  assert sums["e"].shape == (N, 0)
  gathered = jax.vmap(lambda t: _quantize.quantized_all_gather(t, "w"), axis_name="w")(tree)
  np.testing.assert_array_equal(gathered["n"][1], tree["n"])
  sums, residual = jax.vmap(
    lambda t, r: _quantize.quantized_sum_with_feedback(t, r, "w"), axis_name="w")(
      tree, {"n": np.zeros((N, 2), np.float32), "e": np.zeros((N, 0), np.float32)})
  np.testing.assert_array_equal(sums["n"][0], tree["n"].sum(0))
  np.testing.assert_array_equal(residual["n"], 0.0)
  jaxpr = str(jax.make_jaxpr(jax.vmap(lambda t: _quantize.quantized_sum(t, "w"), axis_name="w"))(
    tree))
  assert "all_gather" not in jaxpr
