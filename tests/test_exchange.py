"""``optax_dist.Exchange``: checked once when built, its collectives against NumPy."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

N = 4


def _values(seed=0, shape=(N, 6)):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_resolves_the_wire_format_and_block_size_once():
  assert optax_dist.Exchange("w").comm_block_size is None  # not block-quantized: no blocks
  assert optax_dist.Exchange("w", comm_dtype=jnp.int8).comm_block_size == 256
  assert optax_dist.Exchange("w", comm_dtype=jnp.int8).comm_dtype == "int8"
  assert optax_dist.Exchange("w", comm_dtype=jnp.float4_e2m1fn).comm_dtype == "float4_e2m1fn"
  assert optax_dist.Exchange("w", comm_dtype="bfloat16").comm_dtype == np.dtype(jnp.bfloat16)
  assert optax_dist.Exchange("w", comm_dtype="e3m0", comm_block_size=8).comm_block_size == 8
  # Built again from its own fields (dataclasses.replace), it is the same value.
  exchange = optax_dist.Exchange(("a", "b"), 4, jnp.int8, 16, "c", call="mine")
  assert dataclasses.replace(exchange) == exchange
  assert hash(dataclasses.replace(exchange)) == hash(exchange)
  with pytest.raises(dataclasses.FrozenInstanceError):
    exchange.comm_dtype = None


@pytest.mark.parametrize(("kwargs", "error", "message"), [
  ({"comm_dtype": jnp.int32}, TypeError, r"`mine\(comm_dtype=...\)` must be None, a floating"),
  ({"comm_dtype": "e3m0", "comm_block_size": 7}, ValueError,
   r"`mine\(comm_block_size=...\)` must be even with comm_dtype='e3m0'"),
  ({"comm_dtype": "int8", "comm_block_size": 0}, ValueError,
   r"`mine\(comm_block_size=...\)` must be a positive int"),
  ({"axis_name": None, "num_workers": 2}, ValueError,
   r"`mine\(num_workers=2\)` needs `axis_name`"),
  ({"hierarchical": True}, ValueError, r"`mine\(hierarchical=True\)` needs a tuple `axis_name`"),
  ({"hierarchical": 1}, TypeError, r"`mine\(hierarchical=...\)` must be a bool, got 1"),
  ({"packed_payload": "yes"}, TypeError, r"`mine\(packed_payload=...\)` must be a bool"),
  ({"packed_payload": True, "slice_axis": "k"}, ValueError,
   r"`mine\(packed_payload=True\)` sends one worker's codes whole: it takes no slice_axis"),
])
def test_bad_arguments_name_the_call_site(kwargs, error, message):
  kwargs = {"axis_name": "w", **kwargs}
  with pytest.raises(error, match=message):
    optax_dist.Exchange(**kwargs, call="mine")


@pytest.mark.parametrize("build", [
  lambda: optax_dist.diloco(optax.sgd(1.0), sync_period=2, axis_name="wokers"),
  lambda: optax_dist.streaming_diloco(optax.sgd(1.0), sync_period=2, num_fragments=1,
                                      axis_name="wokers"),
  lambda: optax_dist.local_sgd(optax.sgd(1.0), sync_period=2, axis_name="wokers"),
  lambda: optax_dist.elastic_average(optax.sgd(1.0), axis_name="wokers"),
  lambda: optax_dist.agn(optax.sgd(1.0), axis_name="wokers"),
])
def test_a_misspelled_axis_is_named_in_update(build):
  tx = build()
  name = tx.update.__qualname__.split(".")[0]
  params = jnp.ones((N, 3))
  state = jax.vmap(tx.init)(params)
  with pytest.raises(ValueError, match=rf"`{name}\(axis_name='wokers'\)`: `update` was called"
                                       r" where axis 'wokers' is not bound"):
    jax.vmap(tx.update, axis_name="workers")(params, state, params)


def test_bind_checks_the_axes_where_update_runs():
  assert jax.vmap(lambda x: x * optax_dist.Exchange("w").bind(), axis_name="w")(
    jnp.ones(3)).tolist() == [3.0, 3.0, 3.0]
  with pytest.raises(ValueError, match=r"`mine\(slice_axis='s'\)`: `update` was called where"):
    jax.vmap(lambda x: optax_dist.Exchange("w", slice_axis="s", call="mine").bind(),
             axis_name="w")(jnp.ones(3))
  with pytest.raises(ValueError, match=r"`mine\(num_workers=...\)` must equal the size of axis"):
    jax.vmap(lambda x: optax_dist.Exchange("w", 2, call="mine").bind(), axis_name="w")(
      jnp.ones(3))


def test_one_worker_returns_its_own_tree():
  exchange = optax_dist.Exchange(None, comm_dtype=jnp.int8)
  tree = {"a": jnp.arange(3.0)}
  assert exchange.sum(tree) is tree and exchange.mean(tree) is tree
  assert exchange.mean_with_feedback(tree, None) == (tree, None)
  assert exchange.size() == 1


def test_sum_mean_and_gather_match_numpy():
  x = _values()
  exchange = optax_dist.Exchange("w")
  run = lambda f: np.asarray(jax.jit(jax.vmap(f, axis_name="w"))(x))
  np.testing.assert_array_equal(run(exchange.gather), np.broadcast_to(x, (N, *x.shape)))
  np.testing.assert_allclose(run(exchange.sum), np.broadcast_to(x.sum(0), x.shape), rtol=1e-6)
  np.testing.assert_allclose(run(exchange.mean), np.broadcast_to(x.mean(0), x.shape), rtol=1e-6)


def test_bfloat16_mean_rounds_each_term_and_the_sum():
  x = np.array([[1.0 + 2**-9], [1.0], [1.0], [1.0]], np.float32)  # 1 + 2^-9 is not a bfloat16
  mean = jax.jit(jax.vmap(optax_dist.Exchange("w", comm_dtype=jnp.bfloat16).mean,
                          axis_name="w"))(x)
  bf16 = x.astype(ml_dtypes.bfloat16).astype(np.float32)
  assert bf16[0, 0] == 1.0
  np.testing.assert_array_equal(np.asarray(mean), np.broadcast_to(bf16.sum(0) / N, x.shape))


@pytest.mark.parametrize("fmt", ["int8", "float4_e2m1fn", "e3m0"])
def test_mean_with_feedback_sends_what_it_does_not_keep(fmt):
  x, r = _values(1), 0.01 * _values(2)
  exchange = optax_dist.Exchange("w", comm_dtype=fmt, comm_block_size=2)
  mean, kept = jax.jit(jax.vmap(exchange.mean_with_feedback, axis_name="w"))(x, r)
  sent = x + r - np.asarray(kept)  # Q(t_i + r_i), per worker
  np.testing.assert_allclose(np.asarray(mean), np.broadcast_to(sent.sum(0) / N, x.shape),
                             rtol=1e-6, atol=1e-7)
  plain = jax.jit(jax.vmap(exchange.mean, axis_name="w"))(x + r)  # the same codes, no feedback
  np.testing.assert_array_equal(np.asarray(mean), np.asarray(plain))
  assert np.abs(np.asarray(kept)).max() > 0  # something was dropped, and kept


@pytest.mark.parametrize("fmt", ["int8", "float4_e2m1fn", "e3m0"])
def test_a_packed_payload_is_the_codes_sent_and_merges_to_the_in_program_mean(fmt):
  """``packed_payload=True``: a worker's payload is the block codes and scales it sends
  (``wire_bytes`` of its 10 values in blocks of 4, beside its integer leaf), its residual the
  float32 payload's, and ``merge_payloads`` of the N packed payloads is the in-program mean
  with feedback, bit for bit."""
  x, r = _values(1, (N, 10)), 0.01 * _values(2, (N, 10))
  packed = optax_dist.Exchange("w", comm_dtype=fmt, comm_block_size=4, packed_payload=True)
  plain = dataclasses.replace(packed, packed_payload=False)
  sent = []
  payload, plain_payload = jax.jit(packed.payload), jax.jit(plain.payload)  # as a step runs them
  for i in range(N):
    tree = {"x": x[i], "n": np.arange(3, dtype=np.int32)}
    residual = {"x": r[i], "n": np.zeros(3, np.float32)}
    wire, kept = payload(tree, residual)
    _, kept_plain = plain_payload(tree, residual)
    assert sum(np.asarray(a).nbytes for a in jax.tree.leaves(wire)) == (
      optax_dist._quantize.wire_bytes(10, fmt, 4) + 3 * 4)
    np.testing.assert_array_equal(np.asarray(kept["x"]), np.asarray(kept_plain["x"]))
    sent.append(wire)
  mean, _ = jax.jit(jax.vmap(plain.mean_with_feedback, axis_name="w"))(x, r)
  merged = optax_dist.merge_payloads(sent)
  np.testing.assert_array_equal(np.asarray(merged["x"]), np.asarray(mean)[0])
  np.testing.assert_array_equal(np.asarray(merged["n"]), np.arange(3))


def test_sliced_mean_is_the_unsliced_mean_bit_for_bit():
  mesh = jax.make_mesh((2, 4), ("hosts", "gpus"))
  x = np.repeat(_values(3, (2, 1, 10)), 4, axis=1).reshape(8, 10)  # a copy per device of a host
  spec = P(("hosts", "gpus"))

  def run(exchange):
    f = jax.shard_map(lambda v: exchange.mean(v[0])[None], mesh=mesh, in_specs=spec,
                      out_specs=spec)
    return np.asarray(jax.jit(f)(jax.device_put(x, NamedSharding(mesh, spec))))

  sliced = run(optax_dist.Exchange("hosts", comm_dtype=jnp.bfloat16, slice_axis="gpus"))
  whole = run(optax_dist.Exchange("hosts", comm_dtype=jnp.bfloat16))
  np.testing.assert_array_equal(sliced, whole)
  hosts = x.reshape(2, 4, 10)[:, 0].astype(ml_dtypes.bfloat16)
  rounded = (hosts[0] + hosts[1]).astype(np.float32) / 2  # each term and the sum in bfloat16
  np.testing.assert_array_equal(whole, np.broadcast_to(rounded, (8, 10)))
  assert not np.array_equal(whole, np.broadcast_to(x.reshape(2, 4, 10).mean(0), (2, 4, 10))
                            .reshape(8, 10))  # bfloat16 did round


# One meaning per wire format: the block formats are block-scaled wherever they are taken and
# refused, by name, where every step's gradients are exchanged.

GRADIENT_EXCHANGES = {
  "tower": lambda **kw: optax_dist.tower(optax.sgd(1.0), "w", **kw),
  "all_reduce": lambda **kw: optax_dist.all_reduce("w", **kw),
  "accumulate_then_reduce": lambda **kw: optax_dist.accumulate_then_reduce(
    optax.sgd(1.0), 2, "w", **kw),
}
PERIODIC_EXCHANGES = {
  "diloco": lambda **kw: optax_dist.diloco(optax.sgd(1.0), axis_name="w", **kw),
  "streaming_diloco": lambda **kw: optax_dist.streaming_diloco(
    optax.sgd(1.0), num_fragments=1, axis_name="w", **kw),
  "local_sgd": lambda **kw: optax_dist.local_sgd(optax.sgd(1.0), sync_period=2, axis_name="w",
                                                **kw),
  "elastic_average": lambda **kw: optax_dist.elastic_average(optax.sgd(1.0), axis_name="w", **kw),
  "agn": lambda **kw: optax_dist.agn(optax.sgd(1.0), axis_name="w", **kw),
}


@pytest.mark.parametrize("fn", sorted(GRADIENT_EXCHANGES))
@pytest.mark.parametrize("fmt", [jnp.float4_e2m1fn, "float4_e2m1fn", jnp.int8, "e3m0"])
def test_gradient_exchanges_refuse_the_block_formats_naming_who_takes_them(fn, fmt):
  name = jnp.dtype(fmt).name if fmt != "e3m0" else fmt
  message = (rf"`{fn}\(comm_dtype=...\)` must be None or a floating dtype such as jnp.bfloat16,"
             rf" got '{name}': a block-quantized format .* is taken by diloco, streaming_diloco,"
             r" local_sgd, elastic_average and agn only\.")
  with pytest.raises(TypeError, match=message):
    GRADIENT_EXCHANGES[fn](comm_dtype=fmt)


def test_float4_is_block_scaled_where_it_is_taken():
  """Gradients of size 0.05 are below float4_e2m1fn's smallest step (0.5) and a raw cast sends
  zeros; every transformation that takes the format scales each block first."""
  g = 0.05 * np.random.default_rng(4).normal(size=(N, 64)).astype(np.float32)
  assert not np.any(g.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))  # a raw cast: zeros
  mean = jax.jit(jax.vmap(optax_dist.Exchange("w", comm_dtype=jnp.float4_e2m1fn).mean,
                          axis_name="w"))(g)
  np.testing.assert_allclose(np.asarray(mean)[0], g.mean(0), atol=0.25 * np.abs(g).max())
  tx = optax_dist.diloco(optax.sgd(1.0), optax.sgd(1.0), sync_period=1, axis_name="w",
                         comm_dtype=jnp.float4_e2m1fn)
  params = np.zeros((N, 64), np.float32)
  updates, _ = jax.jit(jax.vmap(lambda g, p: tx.update(g, tx.init(p), p), axis_name="w"))(
    g, params)
  np.testing.assert_array_equal(np.asarray(updates), np.broadcast_to(-np.asarray(mean), g.shape))


@pytest.mark.parametrize("build", [
  *GRADIENT_EXCHANGES.values(),
  *PERIODIC_EXCHANGES.values(),
  lambda **kw: optax_dist.Exchange("w", call="mine", **kw),
])
def test_formats_without_a_sign_or_a_zero_are_refused_everywhere(build):
  with pytest.raises(TypeError, match=r"\(comm_dtype=...\)` must be a format with a sign and a"
                                      r" zero .*, got float8_e8m0fnu, which has no sign and no"
                                      r" zero\."):
    build(comm_dtype=jnp.float8_e8m0fnu)


@pytest.mark.parametrize("name", [n for n in dir(ml_dtypes) if n.startswith("float")
                                  and isinstance(getattr(ml_dtypes, n), type)])
def test_every_accepted_float_format_carries_minus_one_and_zero(name):
  dtype = np.dtype(getattr(ml_dtypes, name))
  exact = np.array_equal(np.array([-1.0, 0.0]).astype(dtype).astype(np.float32), [-1.0, 0.0])
  floating = jnp.issubdtype(dtype, jnp.floating)  # JAX 0.10.0 does not count float6 as floating
  try:
    optax_dist.Exchange("w", comm_dtype=dtype)
  except TypeError:
    assert not (exact and floating)
  else:
    assert exact


def test_diloco_with_float8_e8m0fnu_would_send_nan():
  """Why the unsigned format is refused: its cast of [1, -1, .5, 0] is [1, nan, .5, nan]."""
  cast = np.array([1.0, -1.0, 0.5, 0.0]).astype(ml_dtypes.float8_e8m0fnu).astype(np.float32)
  assert np.isnan(cast[[1, 3]]).all()
  with pytest.raises(TypeError, match="float8_e8m0fnu"):
    PERIODIC_EXCHANGES["diloco"](comm_dtype=jnp.float8_e8m0fnu)


@pytest.mark.parametrize("fn", sorted(PERIODIC_EXCHANGES))
@pytest.mark.parametrize("fmt", [None, jnp.bfloat16, jnp.float8_e4m3fn])
def test_a_block_size_without_a_block_format_is_refused(fn, fmt):
  message = (rf"`{fn}\(comm_block_size=...\)` sets the blocks of a block-quantized comm_dtype"
             rf" .* and must be None with comm_dtype={re.escape(repr(_resolved(fmt)))}, got 64\.")
  with pytest.raises(ValueError, match=message):
    PERIODIC_EXCHANGES[fn](comm_dtype=fmt, comm_block_size=64)


def _resolved(fmt):
  return None if fmt is None else np.dtype(fmt)


def test_the_block_size_is_none_unless_the_format_is_block_quantized():
  assert optax_dist.Exchange("w", comm_dtype=jnp.bfloat16).comm_block_size is None
  assert optax_dist.Exchange("w", comm_dtype=jnp.int8).comm_block_size == 256
  exchange = optax_dist.Exchange("w", comm_dtype=jnp.bfloat16)
  assert dataclasses.replace(exchange, axis_name="v").comm_dtype == np.dtype(jnp.bfloat16)
  with pytest.raises(ValueError, match=r"`mine\(comm_block_size=...\)` sets the blocks"):
    optax_dist.Exchange("w", comm_block_size=256, call="mine")


@pytest.mark.parametrize("comm", [None, "bfloat16", "float8_e4m3fn", "int8"])
def test_the_command_passes_the_block_size_only_with_a_block_format(comm):
  from optax_dist.cli import algorithms
  from optax_dist.cli.config import Settings

  s = Settings(algorithm="diloco", comm_dtype=comm, sync_period=2)
  tx = algorithms.ALGORITHMS["diloco"].build(s, optax.sgd(0.1), "w")
  assert callable(tx.update)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_payloads_is_ieee_arithmetic_in_rank_order(dtype):
  """``merge_payloads`` (a few jitted programs per tree) computes, bit for bit, what NumPy's
  IEEE arithmetic does one operation at a time, for 3 payloads in rank order, equal and unequal
  weights, single-value and larger leaves: the sum in the payloads' dtype (a bfloat16 sum
  rounded at each addition), its cast to float32, the division by N or the weights' sum as the
  multiplication by its rounded reciprocal (the same bits on every XLA version), and the products
  by the weights (no fused multiply-add)."""
  rng = np.random.default_rng(0)
  shapes = {"one": (), "single": (1,), "row": (37,), "block": (5, 7)}
  payloads = [{k: jnp.asarray(rng.standard_normal(s).astype(np.float32) * 10.0 ** i, dtype)
               for k, s in shapes.items()} for i in range(3)]

  def reference(xs, weights):  # NumPy, one rounded operation after another
    xs = [np.asarray(x) for x in xs]
    if weights is None:
      return (xs[0] + xs[1] + xs[2]).astype(np.float32) * (np.float32(1) / np.float32(3))
    terms = [x.astype(np.float32) * np.float32(w) for x, w in zip(xs, weights, strict=True)]
    return (terms[0] + terms[1] + terms[2]) * (np.float32(1) / np.float32(total or sum(weights)))

  for weights, total in ((None, None), ([3.0, 7.0, 5.0], None), ([3.0, 7.0, 5.0], 40)):
    merged = optax_dist.merge_payloads(payloads, weights, total=total)
    for k in shapes:
      want = np.asarray(reference([p[k] for p in payloads], weights), np.float32)
      assert np.asarray(merged[k]).tobytes() == want.tobytes(), (weights, total, k)
