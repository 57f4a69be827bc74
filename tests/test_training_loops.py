"""The patterns of real training scripts: donated steps, 2-D meshes, mixed precision.

* A jitted step that donates params and state right after an eager ``init`` (the standard Flax
  loop): ``init`` must share no buffer with the params.
* ``axis_name`` as a tuple of mesh axes on 2x2 and 2x4 meshes under ``shard_map``, with per-worker
  params, against the same run on a 1-D mesh of as many devices (tower with replicated params:
  ``test_tower.py``).
* Gradients in another floating dtype than the params: each transformation gives what its inner
  optimizer gives, and its state keeps its dtypes from step to step.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

AXIS = "w"


def sgd():
  return optax.sgd(0.1, momentum=0.9)


# Every transformation, with its own axis when it has one (``None``: one worker, unmapped).
def transformations(axis_name):
  return {
    "moving_average": optax_dist.moving_average(sgd(), 0.9),
    "moving_average_f32": optax_dist.moving_average(sgd(), 0.9, ema_dtype=jnp.float32),
    "elastic_average": optax_dist.elastic_average(
      sgd(), communication_period=2, moving_rate=0.1, rho=0.1, axis_name=axis_name
    ),
    "agn": optax_dist.agn(sgd(), communication_period=2, axis_name=axis_name),
    "agn_mean": optax_dist.agn(
      sgd(), communication_period=2, center_update="mean", axis_name=axis_name
    ),
    "drop_stale_gradients": optax_dist.drop_stale_gradients(sgd(), 1),
    "tower": optax_dist.tower(sgd(), axis_name),
    "accumulate_then_reduce": optax_dist.accumulate_then_reduce(sgd(), 2, axis_name),
    "apply_if_finite": optax_dist.apply_if_finite(
      optax_dist.elastic_average(sgd(), communication_period=2, axis_name=axis_name), 2, axis_name
    ),
  }


NAMES = list(transformations(None))


def params_tree(dtype=jnp.float32):
  """Made on the host and put on the device, as a checkpoint or an initializer gives them."""
  return jax.device_put({"w": np.linspace(-1.0, 1.0, 6).astype(dtype).reshape(3, 2),
                         "b": np.ones(2, dtype)})


@jax.jit
def grads_at(step, params):
  return jax.tree.map(lambda p: jnp.cos(p * (step + 1.0)).astype(p.dtype), params)


# ----------------------------------------------------------------------------------------------
# Donation.


@pytest.mark.parametrize("name", NAMES)
def test_init_shares_no_buffer_with_params(name):
  tx = transformations(None)[name]
  params = params_tree()
  state = tx.init(params)
  pointers = {p.unsafe_buffer_pointer() for p in jax.tree.leaves(params)}
  shared = [s for s in jax.tree.leaves(state) if s.unsafe_buffer_pointer() in pointers]
  assert not shared


@pytest.mark.parametrize("name", NAMES)
def test_jitted_step_donating_params_and_state_after_eager_init(name):
  tx = transformations(None)[name]
  params = params_tree()
  state = tx.init(params)  # eager, as in every training script

  def step(params, state, i):
    updates, state = tx.update(grads_at(i, params), state, params)
    return optax.apply_updates(params, updates), state

  donated = jax.jit(step, donate_argnums=(0, 1))
  reference = (params_tree(), tx.init(params_tree()))
  for i in range(4):
    params, state = donated(params, state, i)
    reference = jax.jit(step)(*reference, i)
  chex.assert_trees_all_close(params, reference[0], rtol=1e-6)
  chex.assert_tree_all_finite(params)


def test_flax_train_state_create_then_donated_train_step():
  from optax_dist.flax import TrainState

  tx = optax_dist.elastic_average(optax.adam(1e-2), communication_period=2)
  state = TrainState.create(apply_fn=None, params=params_tree(), tx=tx)

  @jax.jit
  def train_step(state):
    grads = grads_at(state.step.astype(jnp.float32), state.params)
    return state.apply_gradients(grads=grads)

  donated = jax.jit(train_step, donate_argnums=0)
  for _ in range(4):
    state = donated(state)
  assert int(state.step) == 4
  chex.assert_trees_all_equal(state.eval_params(), state.opt_state.center)


# ----------------------------------------------------------------------------------------------
# Tuple axes on 2-D meshes.

NUM_STEPS = 4
MESHES = {  # name: (2-D mesh shape, 1-D device count)
  "2x2": ((2, 2), 4),
  "2x4": ((2, 4), 8),
}


def run_per_worker(txs, mesh, axes, params, grads):
  """``NUM_STEPS`` steps of each of ``txs`` under ``shard_map`` with per-worker params and state
  sharded over ``axes``, every init and step in one program: each one's final params and state.
  ``params`` and each of ``grads`` have a leading worker axis."""
  unstack = lambda tree: jax.tree.map(lambda x: x[0], tree)
  stack = lambda tree: jax.tree.map(lambda x: x[None], tree)

  def train(p, gs):  # one worker's: p (1, ...), gs (NUM_STEPS, 1, ...)
    def run(tx):
      def step(carry, g):
        p, s = carry
        updates, s = tx.update(g, s, p)
        return (optax.apply_updates(p, updates), s), None

      # The state varies over the workers, as it would passed between steps sharded over axes.
      state = jax.tree.map(varying, tx.init(unstack(p)))
      return stack(jax.lax.scan(step, (unstack(p), state), jax.tree.map(lambda x: x[:, 0], gs))[0])

    return [run(tx) for tx in txs]

  def varying(x):
    names = (axes,) if isinstance(axes, str) else axes
    missing = tuple(a for a in names if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  train = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=(P(axes), P(None, axes)),
                                out_specs=P(axes)))
  grads = jax.tree.map(lambda *g: np.stack(g), *grads)
  return train(jax.device_put(params, NamedSharding(mesh, P(axes))),
               jax.device_put(grads, NamedSharding(mesh, P(None, axes))))


def worker_inputs(n):
  params = jax.tree.map(lambda p: np.broadcast_to(p, (n, *p.shape)), jax.device_get(params_tree()))
  rng = np.random.default_rng(0)
  grads = [
    jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    for _ in range(NUM_STEPS)
  ]
  return params, grads


TUPLE_NAMES = [n for n in NAMES if not n.startswith(("moving", "drop"))]


@functools.cache
def tuple_axis_runs(mesh_name):
  """Every transformation of :data:`TUPLE_NAMES` on the 2-D mesh (``axis_name=("hosts",
  "gpus")``) and on a 1-D mesh of as many devices, each mesh's runs in one program: the two
  runs by name, and the gradients."""
  shape, n = MESHES[mesh_name]
  params, grads = worker_inputs(n)
  mesh_2d = jax.make_mesh(shape, ("hosts", "gpus"))
  mesh_1d = jax.make_mesh((n,), (AXIS,))
  got = run_per_worker([transformations(("hosts", "gpus"))[name] for name in TUPLE_NAMES],
                       mesh_2d, ("hosts", "gpus"), params, grads)
  want = run_per_worker([transformations(AXIS)[name] for name in TUPLE_NAMES], mesh_1d, AXIS,
                        params, grads)
  return dict(zip(TUPLE_NAMES, zip(got, want))), grads


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", TUPLE_NAMES)
def test_tuple_axis_per_worker_params_matches_1d(name, mesh_name):
  runs, grads = tuple_axis_runs(mesh_name)
  got, want = runs[name]
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
  # The workers differ, so a tuple axis that reduced over one mesh axis only would differ too.
  assert not np.allclose(grads[0]["w"][0], grads[0]["w"][-1])


# ----------------------------------------------------------------------------------------------
# Mixed precision.

DTYPES = {  # params dtype, gradients dtype
  "bf16_params_f32_grads": (jnp.bfloat16, jnp.float32),
  "f32_params_bf16_grads": (jnp.float32, jnp.bfloat16),
  "f16_params_bf16_grads": (jnp.float16, jnp.bfloat16),
}


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_mixed_precision_behaves_as_inner(name, dtypes):
  """The first update (no exchange yet) is the inner optimizer's on the same inputs, in its
  dtype; then every state keeps its dtypes, so a jitted step compiles once."""
  param_dtype, grad_dtype = DTYPES[dtypes]
  tx = transformations(None)[name]
  params = params_tree(param_dtype)
  grads = jax.tree.map(lambda p: p.astype(grad_dtype), grads_at(0, params))
  inner = sgd()
  want, _ = inner.update(grads, inner.init(params), params)
  state = tx.init(params)
  update = jax.jit(tx.update)
  updates, new_state = update(grads, state, params)
  if name != "accumulate_then_reduce":  # it accumulates the first micro-step
    chex.assert_trees_all_close(updates, want, rtol=1e-2)
  chex.assert_trees_all_equal_dtypes(updates, want)
  for i in range(1, 5):
    chex.assert_trees_all_equal_dtypes(new_state, state)
    params = optax.apply_updates(params, updates)
    grads = jax.tree.map(lambda p: p.astype(grad_dtype), grads_at(i, params))
    updates, new_state = update(grads, new_state, params)
  chex.assert_tree_all_finite(params)
  assert update._cache_size() == 1
