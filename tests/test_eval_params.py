"""eval_params: the outermost average of a state, cast to the params' dtypes, or the params."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist

AXIS = "workers"
LR = 0.1


def test_eval_params_rejects_a_different_params_tree():
  tx = optax_dist.moving_average(optax.sgd(0.1))
  state = tx.init({"w": jnp.ones(2)})
  with pytest.raises(
    ValueError, match=re.escape("`eval_params`: the averaged parameters have tree")
  ):
    optax_dist.eval_params(state, {"v": jnp.ones(2)})


def run_steps(tx, params, steps=3):
  state = tx.init(params)
  grads = jnp.array([1.0, -2.0], params.dtype)
  update = jax.jit(tx.update)
  for _ in range(steps):
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize(
  "make,path",
  [
    (lambda: optax_dist.moving_average(optax.sgd(LR), 0.5), ("ema",)),
    (
      lambda: optax_dist.elastic_average(optax.sgd(LR), communication_period=2, moving_rate=0.3),
      ("center",),
    ),
    (lambda: optax_dist.agn(optax.sgd(LR), communication_period=2), ("center",)),
    # The outermost wrapper wins.
    (
      lambda: optax_dist.moving_average(optax_dist.agn(optax.sgd(LR), communication_period=2), 0.5),
      ("ema",),
    ),
    (
      lambda: optax_dist.agn(optax_dist.moving_average(optax.sgd(LR), 0.5), communication_period=2),
      ("center",),
    ),
    # In a chain, the earliest member wins.
    (
      lambda: optax.chain(
        optax.clip(10.0),
        optax_dist.elastic_average(optax.sgd(LR), communication_period=2, moving_rate=0.3),
        optax_dist.moving_average(optax.identity(), 0.5),
      ),
      (1, "center"),
    ),
    (
      lambda: optax.chain(
        optax_dist.moving_average(optax.sgd(LR), 0.5),
        optax_dist.elastic_average(optax.identity(), communication_period=2),
      ),
      (0, "ema"),
    ),
    # Through optax's own wrappers.
    (
      lambda: optax.MultiSteps(optax_dist.moving_average(optax.sgd(LR), 0.5), 1),
      ("inner_opt_state", "ema"),
    ),
    (
      lambda: optax.inject_hyperparams(optax_dist.moving_average)(optax.sgd(LR), decay=0.5),
      ("inner_state", "ema"),
    ),
    (lambda: optax_dist.diloco(optax.sgd(LR), sync_period=2), ("anchor",)),
    (
      lambda: optax_dist.streaming_diloco(optax.sgd(LR), sync_period=2, num_fragments=1),
      ("anchor",),
    ),
  ],
  ids=[
    "ema",
    "ea_center",
    "agn_center",
    "ema_of_agn",
    "agn_of_ema",
    "chain_ea_first",
    "chain_ema_first",
    "multi_steps",
    "inject_hyperparams",
    "diloco_anchor",
    "streaming_diloco_anchor",
  ],
)
def test_eval_params_returns_the_outermost_average(make, path):
  params, state = run_steps(make(), jnp.array([1.0, 2.0]))
  expected = state
  for key in path:
    expected = expected[key] if isinstance(key, int) else getattr(expected, key)
  result = optax_dist.eval_params(state, params)
  assert not np.array_equal(expected, params)  # the two differ, so the test can tell
  np.testing.assert_array_equal(result, expected)


def test_eval_params_casts_to_param_dtypes():
  tx = optax_dist.moving_average(optax.sgd(LR), 0.5, ema_dtype=jnp.float32)
  params = {"a": jnp.array([1.0, 2.0], jnp.bfloat16), "b": jnp.array([3.0], jnp.float32)}
  state = tx.init(params)
  updates, state = tx.update(
    {"a": jnp.array([1.0, 1.0], jnp.bfloat16), "b": jnp.array([1.0])}, state, params
  )
  result = optax_dist.eval_params(state, optax.apply_updates(params, updates))
  assert result["a"].dtype == jnp.bfloat16 and result["b"].dtype == jnp.float32
  # ema = 0.5 * p0 + 0.5 * (p0 - 0.1 g) = p0 - 0.05
  np.testing.assert_allclose(np.asarray(result["a"], np.float32), [0.95, 1.95], rtol=1e-2)
  np.testing.assert_allclose(result["b"], [2.95], rtol=1e-6)


@pytest.mark.parametrize(
  "tx",
  [
    optax.adam(LR),
    optax.chain(
      optax_dist.tower(optax.sgd(LR), AXIS), optax_dist.drop_stale_gradients(optax.sgd(LR), 1)
    ),
    optax_dist.local_sgd(optax.sgd(LR), sync_period=2),
  ],
  ids=["adam", "tower_and_drop_stale", "local_sgd"],
)
def test_eval_params_without_average_returns_params_unchanged(tx):
  params = {"w": jnp.array([1.0, 2.0])}
  state = tx.init(params)
  assert optax_dist.eval_params(state, params) is params
