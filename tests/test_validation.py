"""Bad inputs: every check raises with a message naming the call, the argument, the value and the
constraint. Values that ``optax.inject_hyperparams`` passes as traced arrays are not checked."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import called, error, sgd

import optax_dist

AXIS = "workers"


COMMUNICATING = {
  "elastic_average": lambda **kw: optax_dist.elastic_average(sgd(), **kw),
  "agn": lambda **kw: optax_dist.agn(sgd(), **kw),
}


# ----------------------------------------------------------------------------------------------
# Integer hyperparameters.


@pytest.mark.parametrize("fn", COMMUNICATING)
@pytest.mark.parametrize(
  "value,exc",
  [
    (0, ValueError),
    (-1, ValueError),
    (1.5, TypeError),
    (2.0, TypeError),
    ("3", TypeError),
    (True, TypeError),
  ],
)
def test_communication_period_must_be_a_positive_int(fn, value, exc):
  with pytest.raises(exc, match=error(fn, "communication_period", "must be a positive int", value)):
    COMMUNICATING[fn](communication_period=value)


@pytest.mark.parametrize("fn", COMMUNICATING)
@pytest.mark.parametrize("value,exc", [(0, ValueError), (-2, ValueError), (1.5, TypeError)])
def test_num_workers_must_be_a_positive_int(fn, value, exc):
  with pytest.raises(exc, match=error(fn, "num_workers", "must be a positive int", value)):
    COMMUNICATING[fn](num_workers=value, axis_name=AXIS)


@pytest.mark.parametrize("fn", COMMUNICATING)
def test_several_workers_without_axis_name(fn):
  pattern = re.escape(f"`{fn}(num_workers=4)` needs `axis_name`") + ".*cannot communicate"
  with pytest.raises(ValueError, match=pattern):
    COMMUNICATING[fn](num_workers=4)
  COMMUNICATING[fn](num_workers=1)  # one worker needs no axis


@pytest.mark.parametrize("fn", COMMUNICATING)
def test_num_workers_must_match_the_axis_size_at_trace_time(fn):
  tx = COMMUNICATING[fn](num_workers=3, axis_name=AXIS)  # the factory cannot know the axis
  params = jnp.zeros((2, 3))
  pattern = (
    called(fn, "num_workers") + ".*must equal the size of axis 'workers', got"
    " num_workers=3 but the axis has 2 workers"
  )
  with pytest.raises(ValueError, match=pattern):
    jax.vmap(tx.init, axis_name=AXIS)(params)
  state = tx.init(params[0])  # unbound axis: allowed (e.g. to build abstract state)
  state = jax.tree.map(lambda x: jnp.broadcast_to(x, (2, *x.shape)), state)
  with pytest.raises(ValueError, match=pattern):
    jax.vmap(tx.update, axis_name=AXIS)(params, state, params)
  # With the matching size it works.
  good = COMMUNICATING[fn](num_workers=2, axis_name=AXIS)
  jax.vmap(good.init, axis_name=AXIS)(params)


UNBOUND = {
  **{fn: lambda fn=fn, **kw: COMMUNICATING[fn](**kw) for fn in COMMUNICATING},
  "tower": lambda axis_name, **kw: optax_dist.tower(sgd(), axis_name),
  "all_reduce": lambda axis_name, **kw: optax_dist.all_reduce(axis_name),
  "accumulate_then_reduce": lambda axis_name, **kw: optax_dist.accumulate_then_reduce(
    sgd(), 1, axis_name
  ),
  "apply_if_finite": lambda axis_name, **kw: optax_dist.apply_if_finite(
    optax_dist.tower(sgd(), axis_name), 1, axis_name
  ),
}


@pytest.mark.parametrize("fn", UNBOUND)
@pytest.mark.parametrize("num_workers", [None, 2])
@pytest.mark.parametrize("axis_name", ["wrokers", (AXIS, "hsots")])
def test_update_where_the_axis_is_not_bound_raises(fn, num_workers, axis_name):
  """A misspelled axis, or ``update`` outside the mapped function, must not train alone."""
  kw = {} if num_workers is None else {"num_workers": num_workers}
  tx = UNBOUND[fn](axis_name=axis_name, **kw)
  params = jnp.zeros(3)
  state = tx.init(params)  # init may run unbound (abstract state)

  def pattern(missing):
    return (
      re.escape(f"`{fn}(axis_name={axis_name!r})`: `update` was called where axis {missing!r}")
      + " is not bound.*cannot communicate.*check the spelling"
    )

  with pytest.raises(ValueError, match=pattern(AXIS if isinstance(axis_name, tuple) else axis_name)):
    tx.update(params, state, params)
  stacked = jax.tree.map(lambda x: jnp.stack([x, x]), state)
  with pytest.raises(ValueError, match=pattern("hsots" if isinstance(axis_name, tuple) else axis_name)):
    jax.vmap(tx.update, axis_name=AXIS)(jnp.zeros((2, 3)), stacked, jnp.zeros((2, 3)))


@pytest.mark.parametrize("fn", COMMUNICATING)
def test_axis_of_size_zero(fn):
  tx = COMMUNICATING[fn](axis_name=AXIS)
  pattern = re.escape(f"`{fn}` was called under axis 'workers' of size 0") + ".*at least one worker"
  with pytest.raises(ValueError, match=pattern):
    jax.vmap(tx.init, axis_name=AXIS)(jnp.zeros((0, 3)))


@pytest.mark.parametrize("value", [np.int64(3), jnp.array(3, jnp.int32)], ids=["numpy", "jax"])
def test_integer_hyperparameters_accept_numpy_and_jax_integers(value):
  """A NumPy or JAX integer works as the int it holds: the first exchange is on step 3."""
  for tx in (
    optax_dist.elastic_average(sgd(), communication_period=value, moving_rate=0.5),
    optax_dist.agn(sgd(), communication_period=value),
  ):
    params = jnp.zeros(2)
    state = tx.init(params)
    centers = []
    for _ in range(3):
      updates, state = tx.update(jnp.ones(2), state, params)
      params = optax.apply_updates(params, updates)
      centers.append(float(optax_dist.eval_params(state, params)[0]))
    assert centers[0] == centers[1] == 0.0 and centers[2] < 0.0
  tx = optax_dist.drop_stale_gradients(sgd(), value)
  _, state = tx.update(jnp.ones(2), tx.init(jnp.zeros(2)), grad_step=-3)  # staleness 3: accepted
  _, state = tx.update(jnp.ones(2), state, grad_step=-3)  # staleness 4: dropped
  assert (int(state.global_step), int(state.num_dropped)) == (1, 1)


# ----------------------------------------------------------------------------------------------
# The wrapped transformation.

WRAPPERS = {
  "moving_average": lambda inner: optax_dist.moving_average(inner),
  "elastic_average": lambda inner: optax_dist.elastic_average(inner),
  "agn": lambda inner: optax_dist.agn(inner),
  "drop_stale_gradients": lambda inner: optax_dist.drop_stale_gradients(inner, 1),
  "tower": lambda inner: optax_dist.tower(inner, AXIS),
  "diloco": lambda inner: optax_dist.diloco(inner),
  "streaming_diloco": lambda inner: optax_dist.streaming_diloco(inner),
  "local_sgd": lambda inner: optax_dist.local_sgd(inner, sync_period=2),
}


@pytest.mark.parametrize("fn", WRAPPERS)
@pytest.mark.parametrize(
  "inner,type_name",
  [(optax.sgd, "function"), (None, "NoneType"), ((lambda p: p, None), "tuple")],
  ids=["factory_not_called", "none", "tuple_without_update"],
)
def test_inner_must_be_a_transformation(fn, inner, type_name):
  pattern = (
    called(fn, "inner") + ".*must be an optax GradientTransformation.*got " + re.escape(type_name)
  )
  with pytest.raises(TypeError, match=pattern):
    WRAPPERS[fn](inner)


# ----------------------------------------------------------------------------------------------
# update() arguments.

NEED_PARAMS = {
  "moving_average": optax_dist.moving_average(optax.sgd(0.1)),
  "elastic_average": optax_dist.elastic_average(optax.sgd(0.1)),
  "agn": optax_dist.agn(optax.sgd(0.1)),
  "diloco": optax_dist.diloco(optax.sgd(0.1)),
  "streaming_diloco": optax_dist.streaming_diloco(optax.sgd(0.1), num_fragments=1),
}


@pytest.mark.parametrize("fn", NEED_PARAMS)
def test_update_without_params(fn):
  tx = NEED_PARAMS[fn]
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  pattern = re.escape(f"`{fn}` needs the current parameters") + ".*" + re.escape("params=None")
  with pytest.raises(ValueError, match=pattern):
    tx.update(params, state)
  with pytest.raises(ValueError, match=pattern):
    tx.update(params, state, None)


@pytest.mark.parametrize(
  "tx,scale",
  [
    (optax_dist.drop_stale_gradients(optax.sgd(0.1), 1), -0.1),
    (optax_dist.all_reduce(None), 1.0),  # one tower: passes through
    (optax_dist.tower(optax.sgd(0.1), None), -0.1),
  ],
  ids=["drop_stale_gradients", "all_reduce", "tower"],
)
def test_transformations_without_params_do_not_need_them(tx, scale):
  grads = jnp.array([1.0, -2.0, 3.0])
  updates, _ = tx.update(grads, tx.init(grads))
  np.testing.assert_allclose(updates, scale * np.array([1.0, -2.0, 3.0]), rtol=1e-6)


@pytest.mark.parametrize("fn", NEED_PARAMS)
def test_updates_tree_must_match_params(fn):
  tx = NEED_PARAMS[fn]
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  pattern = re.escape(f"`{fn}`: `updates` must have the tree structure of the params") + (
    r".*got PyTreeDef\(\{'v': \*\}\), expected PyTreeDef\(\{'w': \*\}\)"
  )
  with pytest.raises(ValueError, match=pattern):
    tx.update({"v": jnp.ones(3)}, state, {"v": jnp.ones(3)})


# ----------------------------------------------------------------------------------------------
# inject_hyperparams: concrete arrays are checked, traced ones are not.


@pytest.mark.parametrize(
  "factory,kwargs,exc,pattern",
  [
    (
      optax_dist.moving_average,
      {"decay": 1.5},
      ValueError,
      called("moving_average", "decay") + ".*in \\[0, 1\\], got 1.5\\.",
    ),
    (
      optax_dist.elastic_average,
      {"communication_period": 0},
      ValueError,
      called("elastic_average", "communication_period") + ".*positive int, got 0\\.",
    ),
    (
      optax_dist.elastic_average,
      {"moving_rate": -0.5},
      ValueError,
      called("elastic_average", "moving_rate") + ".*> 0, got -0.5\\.",
    ),
    (
      optax_dist.elastic_average,
      {"rho": -0.5},
      ValueError,
      called("elastic_average", "rho") + ".*>= 0, got -0.5\\.",
    ),
    (
      optax_dist.agn,
      {"communication_period": -3},
      ValueError,
      called("agn", "communication_period") + ".*positive int, got -3\\.",
    ),
    (
      optax_dist.drop_stale_gradients,
      {"max_staleness": 1.5},
      TypeError,
      called("drop_stale_gradients", "max_staleness") + ".*must be an int",
    ),
    (
      optax_dist.streaming_diloco,
      {"mixing": 1.5},
      ValueError,
      called("streaming_diloco", "mixing") + ".*in \\[0, 1\\], got 1.5\\.",
    ),
  ],
  ids=[
    "decay", "communication_period", "moving_rate", "rho", "agn_period", "max_staleness",
    "mixing",
  ],
)
def test_inject_hyperparams_checks_concrete_arrays(factory, kwargs, exc, pattern):
  injected = optax.inject_hyperparams(factory)(optax.sgd(0.1), **kwargs)  # nothing built yet
  with pytest.raises(exc, match=pattern):
    injected.init(jnp.ones(2))  # the factory runs here, on concrete arrays


def test_inject_hyperparams_does_not_check_traced_arrays():
  params = jnp.ones(2)
  injected = optax.inject_hyperparams(optax_dist.moving_average)(optax.sgd(0.1), decay=0.5)
  state = injected.init(params)
  state.hyperparams["decay"] = jnp.asarray(1.5, jnp.float32)  # out of range, set by hand
  with pytest.raises(ValueError, match=called("moving_average", "decay") + ".*got 1.5"):
    injected.update(params, state, params)  # concrete: checked
  updates, new_state = jax.jit(injected.update)(params, state, params)  # traced: not checked
  # ema = 1.5 * ema + (1 - 1.5) * (params - 0.1 * grads) = 1.5 - 0.5 * 0.9
  np.testing.assert_allclose(new_state.inner_state.ema, [1.05, 1.05], rtol=1e-6)
  np.testing.assert_allclose(updates, [-0.1, -0.1], rtol=1e-6)


def test_inject_hyperparams_traced_integer_hyperparameters():
  params = jnp.ones(2)
  injected = optax.inject_hyperparams(optax_dist.elastic_average)(
    optax.sgd(0.1), communication_period=2, moving_rate=0.5
  )
  state = injected.init(params)
  update = jax.jit(injected.update)
  grads = jnp.ones(2)
  for _ in range(2):
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  # Step 1: x = 0.9. Step 2: x' = 0.8, d = 0.5 (0.8 - 1) = -0.1, x = 0.9, center = 0.9.
  np.testing.assert_allclose(params, [0.9, 0.9], rtol=1e-6)
  np.testing.assert_allclose(state.inner_state.center, [0.9, 0.9], rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Misuse that used to give silently wrong results.


@pytest.mark.parametrize("fn", ["elastic_average", "agn"])
@pytest.mark.parametrize("leaf,dtype", [(jnp.arange(3), "int32"), (jnp.array([True]), "bool")])
def test_param_averaging_rejects_non_floating_leaves(fn, leaf, dtype):
  """Integer params would truncate every step and every exchange."""
  tx = COMMUNICATING[fn]()
  params = {"w": jnp.ones(2), "n": leaf}
  pattern = re.escape(f"`{fn}`") + ".*floating-point.*" + re.escape("['n']") + ".*" + dtype
  with pytest.raises(TypeError, match=pattern):
    tx.init(params)
  state = tx.init({"w": jnp.ones(2), "n": jnp.ones(leaf.shape)})
  with pytest.raises(TypeError, match=pattern):
    tx.update(params, state, params)


@pytest.mark.parametrize("fn", NEED_PARAMS)
def test_update_shapes_must_match_params(fn):
  tx = NEED_PARAMS[fn]
  params = {"b": jnp.ones(2), "w": jnp.ones((3, 2))}
  state = tx.init(params)
  updates = {"b": jnp.ones(2), "w": jnp.ones((2, 3))}
  pattern = (
    re.escape(f"`{fn}`: the update at ['w'] has shape (2, 3) but the params leaf there has shape")
    + re.escape(" (3, 2)")
  )
  with pytest.raises(ValueError, match=pattern):
    tx.update(updates, state, params)


# ----------------------------------------------------------------------------------------------
# Storage dtypes: the rule of comm_dtype's cast formats.

STORAGE_DTYPES = {
  ("diloco", "anchor_dtype"): lambda **kw: optax_dist.diloco(sgd(), **kw),
  ("streaming_diloco", "anchor_dtype"): lambda **kw: optax_dist.streaming_diloco(sgd(), **kw),
  ("moving_average", "ema_dtype"): lambda **kw: optax_dist.moving_average(sgd(), **kw),
  ("accumulate_then_reduce", "accumulator_dtype"): lambda **kw: optax_dist.accumulate_then_reduce(
    sgd(), 2, axis_name=AXIS, **kw
  ),
}


@pytest.mark.parametrize("fn,arg", STORAGE_DTYPES, ids=lambda x: x if isinstance(x, str) else "")
def test_storage_dtypes_without_a_sign_or_a_zero_are_refused(fn, arg):
  """``float8_e8m0fnu`` holds neither -1 nor 0: an anchor, an average or a sum of either sign
  would turn into NaN, as a ``comm_dtype`` of that format would."""
  pattern = (
    called(fn, arg) + r"...\)` must be a format with a sign and a zero .*, got float8_e8m0fnu,"
    r" which has no sign and no zero\.$"
  )
  with pytest.raises(TypeError, match=pattern):
    STORAGE_DTYPES[fn, arg](**{arg: jnp.float8_e8m0fnu})
  STORAGE_DTYPES[fn, arg](**{arg: jnp.float8_e4m3fn})  # signed, with a zero: taken
