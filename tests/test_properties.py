"""Property tests (hypothesis): invariants over random pytrees, dtypes and hyperparameters.

Trees are nested dicts, tuples and lists with ``None`` leaves and 0-d, empty and small arrays in
float16, bfloat16 and float32. Invariants:

(a) the center of ``elastic_average`` and ``agn`` is identical on every worker after every step;
(b) the EMA of a parameter that does not move stays exactly that parameter;
(c) a dropped update changes nothing but ``num_dropped``;
(d) updates keep the params' tree, shapes and dtypes;
(e) the state's tree, shapes and dtypes never change: an update behind a data-dependent
    ``lax.cond`` (the other branch returns the old state) traces.

(d) and (e) only trace (``jax.eval_shape``), so they cover nested wrappers cheaply; (a)-(c) run
a few steps in one compiled ``lax.scan`` per example.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

WORKERS = 3
STEPS = 4
DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
SHAPES = ((), (0,), (3,), (2, 2))

SETTINGS = settings(
  max_examples=15,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TRACE_SETTINGS = settings(SETTINGS, max_examples=40)  # (d), (e): tracing only, no compilation


# ----------------------------------------------------------------------------------------------
# Strategies.


@dataclasses.dataclass(frozen=True)
class Leaf:
  """An array leaf to build: shape and dtype (a pytree leaf itself, so specs map like trees)."""

  shape: tuple
  dtype: type


_leaves = st.one_of(
  st.builds(Leaf, st.sampled_from(SHAPES), st.sampled_from(DTYPES)),
  st.none(),
)
_specs = st.recursive(
  _leaves,
  lambda children: st.one_of(
    st.lists(children, max_size=3),
    st.lists(children, max_size=3).map(tuple),
    st.dictionaries(st.text("abcxyz", min_size=1, max_size=2), children, max_size=3),
  ),
  max_leaves=5,
)
# A top-level `None` is not a params tree (`params=None` means "not given" in optax).
param_specs = _specs.filter(lambda spec: spec is not None)
# Most properties need at least one array; the container edge cases are still drawn inside.
tree_specs = _specs.filter(lambda spec: len(jax.tree.leaves(spec)) > 0)


def build(spec, rng, lead=(), scale=1.0):
  """Random arrays for ``spec``, each with leading dimensions ``lead`` (NumPy, on the host: a
  conversion on the device would compile a program per shape and dtype)."""
  return jax.tree.map(
    lambda leaf: (scale * rng.normal(size=lead + leaf.shape)).astype(np.float32).astype(leaf.dtype),
    spec,
  )


def stack(tree, n):
  return jax.tree.map(lambda x: np.stack([x] * n), tree)


def bits(x):
  """The bit pattern of ``x`` (NaN and -0.0 compare as bits)."""
  x = np.asarray(x)
  return x.reshape(-1).view(f"u{x.dtype.itemsize}")


def assert_bitwise_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(bits(x), bits(y))


INNERS = {
  "sgd": lambda: optax.sgd(0.1),
  "momentum": lambda: optax.sgd(0.05, momentum=0.9),
  "adam": lambda: optax.adam(0.01),
}
inners = st.sampled_from(sorted(INNERS)).map(lambda name: INNERS[name]())


comm_dtypes = st.sampled_from([None, jnp.bfloat16, jnp.float32])


@st.composite
def communicating(draw, axis_name="w"):
  """elastic_average or agn with random hyperparameters."""
  inner = draw(inners)
  period = draw(st.integers(1, 3))
  if draw(st.booleans()):
    return optax_dist.agn(
      inner,
      communication_period=period,
      center_update=draw(st.sampled_from(["sequential", "mean"])),
      axis_name=axis_name,
      comm_dtype=draw(comm_dtypes),
    )
  return optax_dist.elastic_average(
    inner,
    communication_period=period,
    moving_rate=draw(st.none() | st.floats(0.01, 0.5)),
    rho=draw(st.none() | st.floats(0.0, 1.0)),
    learning_rate=draw(st.none() | st.floats(0.01, 1.0)),
    axis_name=axis_name,
    comm_dtype=draw(comm_dtypes),
  )


decays = st.one_of(
  st.floats(0.0, 1.0),
  st.builds(lambda a, b: optax.linear_schedule(a, b, 3), st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
)


WRAPPERS = (
  "moving_average", "elastic_average", "agn", "drop_stale_gradients", "tower",
  "accumulate_then_reduce", "apply_if_finite",
)


@st.composite
def wrapped(draw, depth=2):
  """A transformation of the package, possibly around another one, around an optax optimizer."""
  inner = draw(wrapped(depth=depth - 1)) if depth > 1 and draw(st.booleans()) else draw(inners)
  kind = draw(st.sampled_from(WRAPPERS))
  period = draw(st.integers(1, 3))
  if kind == "moving_average":
    return optax_dist.moving_average(
      inner, draw(decays), use_num_updates=draw(st.booleans()),
      sequential_update=draw(st.booleans()), ema_dtype=draw(st.sampled_from([None, jnp.float32])),
    )
  if kind == "elastic_average":
    return optax_dist.elastic_average(
      inner, communication_period=period, rho=draw(st.floats(0.0, 1.0)), axis_name="w",
      comm_dtype=draw(comm_dtypes),
    )
  if kind == "agn":
    return optax_dist.agn(
      inner, communication_period=period, axis_name="w",
      center_update=draw(st.sampled_from(["sequential", "mean"])), comm_dtype=draw(comm_dtypes),
    )
  if kind == "drop_stale_gradients":
    return optax_dist.drop_stale_gradients(inner, draw(st.integers(-2, 3)))
  if kind == "accumulate_then_reduce":
    return optax_dist.accumulate_then_reduce(
      inner, period, "w", reduction=draw(st.sampled_from(["mean", "sum"])),
      accumulator_dtype=draw(st.sampled_from([None, jnp.float32])), comm_dtype=draw(comm_dtypes),
    )
  if kind == "apply_if_finite":
    return optax_dist.apply_if_finite(inner, draw(st.integers(1, 3)), axis_name="w")
  return optax_dist.tower(
    inner, "w", reduction=draw(st.sampled_from(["mean", "sum"])), comm_dtype=draw(comm_dtypes)
  )


# ----------------------------------------------------------------------------------------------
# (a) The center is identical on every worker after every step.


@SETTINGS
@given(spec=tree_specs, tx=communicating(), seed=st.integers(0, 2**32 - 1))
def test_center_identical_on_every_worker(spec, tx, seed):
  rng = np.random.default_rng(seed)
  params = stack(build(spec, rng), WORKERS)  # every worker starts from the same params
  grads = build(spec, rng, lead=(STEPS, WORKERS))  # and gets its own gradients

  def worker_step(carry, g):
    p, s = carry
    updates, s = tx.update(g, s, p)
    p = optax.apply_updates(p, updates)
    return (p, s), s

  @jax.jit
  def run(params, grads):
    state = jax.vmap(tx.init, axis_name="w", axis_size=WORKERS)(params)
    step = jax.vmap(worker_step, axis_name="w", axis_size=WORKERS)
    _, states = jax.lax.scan(step, (params, state), grads)
    return states

  states = run(params, grads)  # every leaf: (STEPS, WORKERS, ...)
  shared = [states.center]
  if isinstance(states, optax_dist.AGNState):
    shared.append(states.center_inner_state)
  for leaf in jax.tree.leaves(shared):
    for w in range(1, WORKERS):
      np.testing.assert_array_equal(bits(leaf[:, w]), bits(leaf[:, 0]))


# ----------------------------------------------------------------------------------------------
# (b) The EMA of a parameter that does not move stays that parameter.


@SETTINGS
@given(
  spec=tree_specs,
  decay=decays,
  use_num_updates=st.booleans(),
  sequential_update=st.booleans(),
  ema_dtype=st.sampled_from([None, jnp.float32]),
  seed=st.integers(0, 2**32 - 1),
)
def test_ema_of_constant_params_is_constant(
  spec, decay, use_num_updates, sequential_update, ema_dtype, seed
):
  rng = np.random.default_rng(seed)
  params = build(spec, rng, scale=100.0)
  grads = build(spec, rng, lead=(STEPS,))
  tx = optax_dist.moving_average(
    optax.set_to_zero(), decay, use_num_updates=use_num_updates,
    sequential_update=sequential_update, ema_dtype=ema_dtype,
  )

  @jax.jit
  def run(params, grads):
    def step(state, g):
      _, state = tx.update(g, state, params)
      return state, state.ema

    return jax.lax.scan(step, tx.init(params), grads)[1]

  emas = run(params, grads)
  for ema, p in zip(jax.tree.leaves(emas), jax.tree.leaves(params)):
    assert ema.dtype == (p.dtype if ema_dtype is None else jnp.float32)
    want = np.broadcast_to(np.asarray(p).astype(ema.dtype), ema.shape)
    np.testing.assert_array_equal(np.asarray(ema), want)


# ----------------------------------------------------------------------------------------------
# (c) A dropped update changes nothing but `num_dropped`.


@SETTINGS
@given(
  spec=tree_specs,
  inner=inners | inners.map(lambda i: optax_dist.moving_average(i, 0.9)),
  max_staleness=st.integers(-3, 5),
  accepted=st.integers(0, 2),
  lag=st.integers(1, 10**6),
  seed=st.integers(0, 2**32 - 1),
)
def test_dropped_update_changes_only_num_dropped(
  spec, inner, max_staleness, accepted, lag, seed
):
  rng = np.random.default_rng(seed)
  params = build(spec, rng)
  grads = build(spec, rng, lead=(accepted + 1,))
  tx = optax_dist.drop_stale_gradients(inner, max_staleness)

  @jax.jit
  def run(params, grads):
    state = tx.init(params)
    for i in range(accepted):  # some fresh updates first (dropped too if max_staleness < 0)
      g = jax.tree.map(lambda x, i=i: x[i], grads)
      _, state = tx.update(g, state, params, grad_step=state.global_step)
    g = jax.tree.map(lambda x: x[accepted], grads)
    grad_step = state.global_step - max(max_staleness, 0) - lag  # far in the past
    updates, new_state = tx.update(g, state, params, grad_step=grad_step)
    return state, updates, new_state

  state, updates, new_state = run(params, grads)
  assert int(new_state.num_dropped) == int(state.num_dropped) + 1
  assert_bitwise_equal(new_state._replace(num_dropped=state.num_dropped), state)
  assert jax.tree.structure(updates) == jax.tree.structure(params)
  for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
    assert u.dtype == p.dtype and u.shape == p.shape
    assert not np.any(np.asarray(u, np.float32))


# ----------------------------------------------------------------------------------------------
# (d) Updates keep the params' tree and dtypes; (e) the state's types are a fixed point.


def _abstract(spec, lead=(), sharding=None):
  return jax.tree.map(
    lambda leaf: jax.ShapeDtypeStruct(lead + leaf.shape, leaf.dtype, sharding=sharding), spec
  )


def _assert_same_types(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert (x.shape, x.dtype) == (y.shape, y.dtype)


@TRACE_SETTINGS
@given(spec=param_specs, tx=wrapped(), stale=st.booleans())
def test_updates_keep_params_tree_and_dtypes(spec, tx, stale):
  params = _abstract(spec, (WORKERS,))
  extra = {"grad_step": jnp.int32(-5)} if stale else {}

  def step(grads, params):
    state = tx.init(params)
    updates, state = tx.update(grads, state, params, **extra)
    return updates, tx.update(updates, state, params, **extra)[0]

  mapped = jax.vmap(step, axis_name="w", axis_size=WORKERS)
  first, second = jax.eval_shape(mapped, params, params)
  _assert_same_types(first, params)
  _assert_same_types(second, params)


@TRACE_SETTINGS
@given(spec=param_specs, tx=wrapped(), mapping=st.sampled_from(["vmap", "shard_map"]))
def test_state_types_are_stable_behind_cond(spec, tx, mapping):
  def step(pred, grads, state, params):
    # Data-dependent: one branch updates, the other keeps the state; lax.cond requires both
    # branches to return the same types.
    return jax.lax.cond(pred, lambda s: tx.update(grads, s, params)[1], lambda s: s, state)

  if mapping == "vmap":
    params = _abstract(spec, (WORKERS,))
    init = jax.vmap(tx.init, axis_name="w", axis_size=WORKERS)
    mapped = jax.vmap(step, axis_name="w", axis_size=WORKERS)
    pred = jax.ShapeDtypeStruct((WORKERS,), jnp.bool_)
  else:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((WORKERS,), ("w",), devices=jax.devices()[:WORKERS])
    sharding = NamedSharding(mesh, P("w"))
    params = _abstract(spec, (WORKERS,), sharding)

    def per_worker(f, num_args):  # each worker sees its own slice of axis 0
      def g(*args):
        out = f(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

      return jax.shard_map(g, mesh=mesh, in_specs=(P("w"),) * num_args, out_specs=P("w"))

    init, mapped = per_worker(tx.init, 1), per_worker(step, 4)
    pred = jax.ShapeDtypeStruct((WORKERS,), jnp.bool_, sharding=sharding)

  state = jax.eval_shape(init, params)
  new_state = jax.eval_shape(mapped, pred, params, state, params)
  _assert_same_types(new_state, state)
  newer_state = jax.eval_shape(mapped, pred, params, new_state, params)
  _assert_same_types(newer_state, state)
