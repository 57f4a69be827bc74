"""accumulate_then_reduce: the result of MultiSteps(tower(inner), k), one all-reduce per k steps.

References: ``optax.MultiSteps(optax_dist.tower(inner, ...), k)`` (a different code path: it
runs the all-reduce and ``inner`` on every micro-step and masks the result) and, for SGD, the
closed form :math:`u = -\\eta\\, \\mathrm{reduce}_i(\\sum_m g_{i,m} / k)` computed with NumPy.
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

N = 8
MESH = jax.make_mesh((N,), ("w",))
K = 3
STEPS = 7  # two full accumulations and one partial


def _inner(name):
  return {"sgd": optax.sgd(0.1), "adam": optax.adam(0.05)}[name]


def _problem(num_towers, seed=0):
  rng = np.random.default_rng(seed)
  p0 = {"a": rng.normal(size=(4, 3)), "b": rng.normal(size=(5,))}
  params = jax.tree.map(lambda x: jnp.asarray(np.repeat(x[None], num_towers, 0), jnp.float32), p0)
  grads = [
    jax.tree.map(lambda x: jnp.asarray(rng.normal(size=(num_towers,) + x.shape), jnp.float32), p0)
    for _ in range(STEPS)
  ]
  return params, grads


def _vmapped(f):
  return jax.jit(jax.vmap(f, axis_name="w"))


def _sharded(f, check_vma=True):
  def g(*args):
    out = f(*jax.tree.map(lambda x: x[0], args))
    return jax.tree.map(lambda x: x[None], out)

  return jax.jit(jax.shard_map(g, mesh=MESH, in_specs=P("w"), out_specs=P("w"),
                               check_vma=check_vma))


def _sharded_unchecked(f):
  # optax.MultiSteps's skip branch returns zeros typed invariant while its update branch's
  # updates vary over the axis (masked by the per-worker mini_step): lax.cond rejects that
  # under shard_map's varying-type checks, so the reference runs without them.
  return _sharded(f, check_vma=False)


def _put(tree):
  return jax.device_put(tree, NamedSharding(MESH, P("w")))


def _trajectory(tx, mapped, params, grads):
  """The updates and params of every micro-step, every tower starting from the same params."""
  init, update = mapped(tx.init), mapped(lambda g, s, p: tx.update(g, s, p))
  state, out = init(params), []
  for g in grads:
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
    out.append((updates, params))
  return out, state


def _assert_trees_close(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_equals_multisteps_of_tower(mapping, inner):
  num_towers = 4 if mapping == "vmap" else N
  mapped, put = (_vmapped, lambda t: t) if mapping == "vmap" else (_sharded, _put)
  ref_mapped = _vmapped if mapping == "vmap" else _sharded_unchecked
  params, grads = _problem(num_towers)
  params, grads = put(params), [put(g) for g in grads]
  ours, state = _trajectory(
    optax_dist.accumulate_then_reduce(_inner(inner), K, "w"), mapped, params, grads
  )
  theirs, _ = _trajectory(optax.MultiSteps(optax_dist.tower(_inner(inner), "w"), K),
                          ref_mapped, params, grads)
  for step, ((u, p), (u_ref, p_ref)) in enumerate(zip(ours, theirs), start=1):
    _assert_trees_close(u, u_ref, rtol=1e-5, atol=1e-6)
    _assert_trees_close(p, p_ref, rtol=1e-5, atol=1e-6)
    if step % K:  # accumulating micro-steps: exactly zero updates
      assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(u))
    else:  # reducing micro-steps: identical on every tower, and nonzero
      for x in jax.tree.leaves(u):
        np.testing.assert_array_equal(np.asarray(x), np.broadcast_to(np.asarray(x)[:1], x.shape))
        assert np.all(np.asarray(x) != 0)
  np.testing.assert_array_equal(state.mini_step, STEPS % K)
  np.testing.assert_array_equal(state.gradient_step, STEPS // K)


@pytest.mark.parametrize("reduction,use_grad_mean", [("mean", True), ("sum", False)])
def test_sgd_closed_form_and_multisteps(reduction, use_grad_mean):
  lr, towers = 0.5, 3
  params, grads = _problem(towers, seed=1)
  tx = optax_dist.accumulate_then_reduce(optax.sgd(lr), 2, "w", reduction=reduction,
                                         use_grad_mean=use_grad_mean)
  ref = optax.MultiSteps(optax_dist.tower(optax.sgd(lr), "w", reduction=reduction), 2,
                         use_grad_mean=use_grad_mean)
  ours, _ = _trajectory(tx, _vmapped, params, grads[:4])
  theirs, _ = _trajectory(ref, _vmapped, params, grads[:4])
  for step in (2, 4):  # the reducing micro-steps
    g = {k: np.stack([np.asarray(grads[m][k], np.float64) for m in (step - 2, step - 1)])
         for k in params}  # (micro-step, tower, ...)
    for k, x in g.items():
      local = x.sum(0) / (2 if use_grad_mean else 1)
      reduced = local.sum(0) if reduction == "sum" else local.mean(0)
      expected = np.broadcast_to(-lr * reduced, local.shape)
      np.testing.assert_allclose(ours[step - 1][0][k], expected, rtol=1e-5, atol=1e-6)
  _assert_trees_close([u for u, _ in ours], [u for u, _ in theirs], rtol=1e-5, atol=1e-6)


def test_replicated_params_gradient_already_summed_by_autodiff():
  # shard_map with params P(): autodiff sums the gradient over the towers (typed invariant);
  # the mean divides it by N instead of all-reducing it again, as tower does.
  rng = np.random.default_rng(2)
  w0 = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
  xs = jax.device_put(jnp.asarray(rng.normal(size=(STEPS, N * 2, 3)), jnp.float32),
                      NamedSharding(MESH, P(None, "w")))

  def run(tx):
    def train(w, xs):
      state = tx.init(w)
      for x in xs:
        g = jax.grad(lambda w, x=x: jnp.sum((x @ w - 1.0) ** 2))(w)
        u, state = tx.update(g, state, w)
        w = optax.apply_updates(w, u)
      return w

    return jax.jit(jax.shard_map(train, mesh=MESH, in_specs=(P(), P(None, "w")),
                                 out_specs=P()))(w0, xs)

  ours = run(optax_dist.accumulate_then_reduce(optax.sgd(0.01), K, "w"))
  theirs = run(optax.MultiSteps(optax_dist.tower(optax.sgd(0.01), "w"), K))
  # NumPy: the global batch's gradient, averaged over the towers, accumulated over K steps.
  w, acc = np.asarray(w0, np.float64), 0.0
  for m, x in enumerate(np.asarray(xs, np.float64), start=1):
    acc = acc + 2 * x.T @ (x @ w - 1.0) / N
    if m % K == 0:
      w, acc = w - 0.01 * acc / K, 0.0
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ours, w, rtol=1e-4, atol=1e-5)


def test_all_reduces_once_per_k_micro_steps_inside_the_conditional():
  params, grads = _problem(N)
  params, g = _put(params), _put(grads[0])
  grad_bytes = sum(x.size // N * 4 for x in jax.tree.leaves(params))  # float32, per tower
  reports = {}
  for name, tx in {
    "ours": optax_dist.accumulate_then_reduce(optax.adam(0.1), K, "w"),
    "multisteps": optax.MultiSteps(optax_dist.tower(optax.adam(0.1), "w"), K),
  }.items():
    state = _sharded(tx.init)(params)
    step = _sharded(lambda g, s, p, tx=tx: tx.update(g, s, p))
    reports[name] = optax_dist.communication_report(step, g, state, params)
  ours, theirs = reports["ours"], reports["multisteps"]
  assert not ours.unconditional  # nothing on the accumulating micro-steps
  assert ours.non_communication_step.count == 0
  assert set(ours.conditional.by_kind()) == {"all-reduce"}
  assert ours.communication_step.bytes == grad_bytes
  assert theirs.unconditional.of_kind("all-reduce").bytes == grad_bytes  # every micro-step
  assert theirs.non_communication_step.bytes == grad_bytes
  # Per K micro-steps: one reduction against K.
  per_k_ours = ours.communication_step.bytes + (K - 1) * ours.non_communication_step.bytes
  per_k_theirs = K * theirs.unconditional.bytes
  assert (per_k_ours, per_k_theirs) == (grad_bytes, K * grad_bytes)


def test_comm_dtype_halves_the_bytes_and_stays_close():
  params, grads = _problem(N)
  params, grads = _put(params), [_put(g) for g in grads]
  grad_bytes = sum(x.size // N * 4 for x in jax.tree.leaves(params))
  out = {}
  for dtype in (None, jnp.bfloat16):
    tx = optax_dist.accumulate_then_reduce(optax.sgd(0.1), K, "w", comm_dtype=dtype)
    step = _sharded(lambda g, s, p, tx=tx: tx.update(g, s, p))
    state = _sharded(tx.init)(params)
    report = optax_dist.communication_report(step, grads[0], state, params, stage="lowered")
    out[dtype] = report.communication_step.bytes, _trajectory(tx, _sharded, params, grads)[0]
  assert out[None][0] == grad_bytes
  assert out[jnp.bfloat16][0] == grad_bytes // 2
  for (u, p), (u16, p16) in zip(out[None][1], out[jnp.bfloat16][1]):
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(u16))
    _assert_trees_close(u16, u, rtol=2e-2, atol=2e-3)
    _assert_trees_close(p16, p, rtol=2e-2, atol=2e-3)


def test_one_tower_is_plain_accumulation():
  params, grads = _problem(1)
  params, grads = jax.tree.map(lambda x: x[0], params), [jax.tree.map(lambda x: x[0], g)
                                                        for g in grads]
  mapped = jax.jit
  ours, _ = _trajectory(optax_dist.accumulate_then_reduce(optax.adam(0.1), K, None), mapped,
                        params, grads)
  theirs, _ = _trajectory(optax.MultiSteps(optax.adam(0.1), K), mapped, params, grads)
  _assert_trees_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_dtypes_stable_across_branches_and_no_recompilation():
  tx = optax_dist.accumulate_then_reduce(optax.adam(0.1), 2, None,
                                         accumulator_dtype=jnp.float32)
  params = {"w": jnp.ones((3,), jnp.bfloat16)}
  state = tx.init(params)
  assert state.acc_grads["w"].dtype == jnp.float32
  update = jax.jit(lambda g, s, p: tx.update(g, s, p, unknown_extra_arg=1.0))
  for _ in range(3):
    updates, state = update({"w": jnp.full((3,), 0.5, jnp.bfloat16)}, state, params)
    assert updates["w"].dtype == jnp.bfloat16
    assert state.acc_grads["w"].dtype == jnp.float32
  assert update._cache_size() == 1


@pytest.mark.parametrize(
  "kwargs,error,message",
  [
    ({"every_k": 0}, ValueError, r"`accumulate_then_reduce\(every_k=...\)` must be a positive"),
    ({"every_k": 1.5}, TypeError, r"`accumulate_then_reduce\(every_k=...\)` must be a positive"),
    ({"reduction": "max"}, ValueError, r"`accumulate_then_reduce\(reduction=...\)` must be one"),
    ({"comm_dtype": jnp.int8}, TypeError, r"`accumulate_then_reduce\(comm_dtype=...\)` must be"),
    ({"accumulator_dtype": "int32"}, TypeError,
     r"`accumulate_then_reduce\(accumulator_dtype=...\)` must be None or a floating .* 'int32'"),
    ({"inner": object()}, TypeError, r"`accumulate_then_reduce\(inner=...\)` must be an optax"),
  ],
)
def test_validation(kwargs, error, message):
  args = {"inner": optax.sgd(0.1), "every_k": 2, "axis_name": "w"} | kwargs
  with pytest.raises(error, match=message):
    optax_dist.accumulate_then_reduce(**args)


def test_bf16_accumulation_defaults_to_float32_as_multisteps():
  """512 gradients of 1.0 on bf16 params: a bf16 accumulator stops at 256 (mean 0.5)."""
  k = 512
  params = jnp.zeros(2, jnp.bfloat16)
  ours = optax_dist.accumulate_then_reduce(optax.sgd(1.0), k, None)
  theirs = optax.MultiSteps(optax.sgd(1.0), k)
  s_ours, s_theirs = ours.init(params), theirs.init(params)
  assert s_ours.acc_grads.dtype == s_theirs.acc_grads.dtype == jnp.float32
  step_ours, step_theirs = jax.jit(ours.update), jax.jit(theirs.update)
  g = jnp.ones(2, jnp.bfloat16)
  for _ in range(k):
    u_ours, s_ours = step_ours(g, s_ours, params)
    u_theirs, s_theirs = step_theirs(g, s_theirs, params)
  np.testing.assert_array_equal(u_ours, [-1.0, -1.0])
  np.testing.assert_array_equal(u_ours, u_theirs)
  explicit = optax_dist.accumulate_then_reduce(optax.sgd(1.0), k, None,
                                               accumulator_dtype=jnp.bfloat16)
  assert explicit.init(params).acc_grads.dtype == jnp.bfloat16
