"""What diloco, streaming_diloco and local_sgd share, each case run over all three.

A tuple of mesh axes trains as one worker axis, collectives run only inside the sync
conditionals, mixed precision behaves as the inner optimizer, an eager init then a donating step,
and the bad inputs the three check alike. Each algorithm's own tests (its NumPy reference, its
numbers, its schedule) are in ``test_diloco.py``, ``test_streaming_diloco.py`` and
``test_local_sgd.py``; the references and drivers are in ``_diloco_reference.py``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _diloco_reference import ATOL, AXIS, RTOL, SHAPES, N, error, problem, run, shard_map_step

import optax_dist

# ----------------------------------------------------------------------------------------------
# A tuple of mesh axes.


@pytest.mark.parametrize(
  "make",
  [
    lambda axis: optax_dist.diloco(optax.adam(0.05), sync_period=3, axis_name=axis),
    lambda axis: optax_dist.streaming_diloco(
      optax.sgd(0.1, momentum=0.9), sync_period=4, num_fragments=3, mixing=0.5, axis_name=axis
    ),
    lambda axis: optax_dist.local_sgd(
      optax.sgd(0.1), sync_period=2, warmup_steps=2, axis_name=axis
    ),
  ],
  ids=["diloco", "streaming_diloco", "local_sgd"],
)
def test_tuple_of_mesh_axes_is_one_worker_axis(make):
  """Workers on a 2 x 2 mesh, ``axis_name=("hosts", "gpus")``, train as four workers on one axis."""
  x0, c, d = problem(7)
  history_2d, _ = run(make(("hosts", "gpus")), x0, c, d, "shard_map_2d")
  history, _ = run(make(AXIS), x0, c, d, "vmap")
  for k in x0:
    np.testing.assert_allclose(history_2d[k], history[k], rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------------------------
# Communication: bytes per sync, per fragment, 8-bit exchange (as lowered).


def per_conditional(report):
  """Bytes (operands, results) of the collectives of each outermost conditional."""
  found = {}
  for c in report.conditional:
    total = found.setdefault(c.conditionals[0][0], [0, 0, set()])
    total[0] += c.bytes
    total[1] += c.result_bytes
    total[2].add(c.kind)
  return sorted((b, r, tuple(sorted(k))) for b, r, k in found.values())


@pytest.mark.parametrize(
  "name,make,expected",
  [
    ("diloco", lambda: optax_dist.diloco(optax.sgd(0.1), sync_period=3, axis_name=AXIS),
     [(48, 48, ("all-reduce",))]),
    ("streaming_f3", lambda: optax_dist.streaming_diloco(
      optax.sgd(0.1), sync_period=3, num_fragments=3, axis_name=AXIS),
     [(16, 16, ("all-reduce",))] * 3),
    ("streaming_f2", lambda: optax_dist.streaming_diloco(
      optax.sgd(0.1), sync_period=3, num_fragments=2, axis_name=AXIS),
     [(16, 16, ("all-reduce",)), (32, 32, ("all-reduce",))]),
    ("local_sgd_warmup", lambda: optax_dist.local_sgd(
      optax.sgd(0.1), sync_period=3, warmup_steps=2, axis_name=AXIS),
     [(48, 48, ("all-reduce",))] * 2),
    # As JAX lowers it (XLA's CPU compiler then widens the 8-bit gather to 16 bits).
    ("diloco_float8", lambda: optax_dist.diloco(
      optax.sgd(0.1), sync_period=3, axis_name=AXIS, comm_dtype=jnp.float8_e4m3fn),
     [(12, 48, ("all-gather",))]),
  ],
)
def test_collectives_only_in_sync_conditionals(name, make, expected):
  init, step, put = shard_map_step(make())
  params = put({k: np.zeros((N, *s), np.float32) for k, s in SHAPES.items()})
  state = init(params)
  stage = "lowered" if name.endswith("float8") else "compiled"
  report = optax_dist.communication_report(step, params, state, params, stage=stage)
  assert not report.unconditional, report.unconditional
  assert per_conditional(report) == expected
  assert report.non_communication_step.bytes == 0


# ----------------------------------------------------------------------------------------------
# dtypes, buffers, one worker.


@pytest.mark.parametrize(
  "make",
  [
    lambda inner: optax_dist.diloco(inner, sync_period=2, anchor_dtype=jnp.float32),
    lambda inner: optax_dist.streaming_diloco(  # fragment 0 syncs on step 2, fragment 1 on 4
      inner, sync_period=4, num_fragments=2, anchor_dtype=jnp.float32
    ),
    lambda inner: optax_dist.local_sgd(inner, sync_period=2),
  ],
  ids=["diloco", "streaming_diloco", "local_sgd"],
)
def test_mixed_precision_behaves_as_inner(make):
  inner = optax.sgd(0.1, momentum=0.9)
  tx = make(inner)
  params = jax.device_put({"a": np.array([1.0, 2.0], jnp.bfloat16),
                           "b": np.array([[3.0, -1.0]], jnp.bfloat16)})
  grads = jax.device_put({"a": np.array([0.3, -0.7], np.float32),
                          "b": np.array([[1.1, 0.2]], np.float32)})
  state = jax.jit(tx.init)(params)
  step = jax.jit(tx.update)
  updates, state1 = step(grads, state, params)
  inner_updates, _ = jax.jit(lambda g, p: inner.update(g, inner.init(p), p))(grads, params)
  for k in params:  # step 1 is no sync: exactly the inner's updates, in its dtype
    assert updates[k].dtype == inner_updates[k].dtype == jnp.float32
    np.testing.assert_array_equal(updates[k], inner_updates[k])
  shapes = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype), s)
  assert shapes(state1) == shapes(state)
  params = jax.jit(optax.apply_updates)(params, updates)
  updates, state2 = step(grads, state1, params)  # a sync step
  assert shapes(state2) == shapes(state) and step._cache_size() == 1
  assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))
  if hasattr(state2, "anchor"):
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(state2.anchor))
    evaluated = jax.jit(optax_dist.eval_params)(state2, params)
    assert all(e.dtype == jnp.bfloat16 for e in jax.tree.leaves(evaluated))


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax_dist.diloco(optax.adam(0.1), sync_period=2),
    lambda: optax_dist.streaming_diloco(optax.adam(0.1), sync_period=2, num_fragments=2),
    lambda: optax_dist.local_sgd(optax.adam(0.1), sync_period=2),
  ],
  ids=["diloco", "streaming_diloco", "local_sgd"],
)
def test_eager_init_then_donating_step(make):
  tx = make()
  params = jax.device_put({"a": np.ones(4, np.float32), "b": np.arange(4.0, dtype=np.float32)})
  state = tx.init(params)  # eager: must share no buffer with params

  def step(params, state):
    updates, state = tx.update(jax.tree.map(jnp.sin, params), state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  for _ in range(3):
    params, state = step(params, state)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))


# ----------------------------------------------------------------------------------------------
# Bad inputs: the message names the function, the argument and the value.


FAMILY = {
  "diloco": lambda **kw: optax_dist.diloco(optax.sgd(0.1), **kw),
  "streaming_diloco": lambda **kw: optax_dist.streaming_diloco(optax.sgd(0.1), **kw),
  "local_sgd": lambda **kw: optax_dist.local_sgd(optax.sgd(0.1), **{"sync_period": 2, **kw}),
}


@pytest.mark.parametrize("fn", FAMILY)
@pytest.mark.parametrize("value,exc", [(0, ValueError), (-3, ValueError), (1.5, TypeError)])
def test_sync_period_must_be_a_positive_int(fn, value, exc):
  with pytest.raises(exc, match=error(fn, "sync_period", "must be a positive int", value)):
    FAMILY[fn](sync_period=value)


@pytest.mark.parametrize("fn", FAMILY)
def test_num_workers_checks(fn):
  with pytest.raises(ValueError, match=re.escape(f"`{fn}(num_workers=4)` needs `axis_name`")):
    FAMILY[fn](num_workers=4)
  with pytest.raises(ValueError, match=error(fn, "num_workers", "must be a positive int", 0)):
    FAMILY[fn](num_workers=0, axis_name=AXIS)
  tx = FAMILY[fn](num_workers=3, axis_name=AXIS)
  pattern = re.escape(f"`{fn}(num_workers=...)` must equal the size of axis 'workers', got") + (
    " num_workers=3 but the axis has 2 workers"
  )
  with pytest.raises(ValueError, match=pattern):
    jax.vmap(tx.init, axis_name=AXIS)({"a": jnp.zeros((2, 3)), "b": jnp.zeros((2, 3))})


@pytest.mark.parametrize("fn", FAMILY)
def test_update_where_the_named_axis_is_unbound_raises(fn):
  tx = FAMILY[fn](axis_name="wrokers", **({"num_fragments": 1} if "streaming" in fn else {}))
  params = {"w": jnp.ones(3)}
  state = tx.init(params)  # init may run where the axis is unbound (abstract state)
  pattern = re.escape(f"`{fn}(axis_name='wrokers')`: `update` was called where axis 'wrokers'")
  with pytest.raises(ValueError, match=pattern + " is not bound"):
    tx.update(params, state, params)


@pytest.mark.parametrize(
  "fn,arg",
  [(fn, "comm_dtype") for fn in FAMILY] + [(fn, "anchor_dtype") for fn in FAMILY if "diloco" in fn],
)
def test_dtypes_must_be_floating(fn, arg):
  # jnp.int32: jnp.int8 names a quantized comm_dtype format.
  with pytest.raises(TypeError, match=error(fn, arg, "floating dtype", jnp.int32)):
    FAMILY[fn](**{arg: jnp.int32})


@pytest.mark.parametrize("fn", ["diloco", "streaming_diloco"])
def test_outer_must_be_a_transformation(fn):
  with pytest.raises(
    TypeError, match=re.escape(f"`{fn}(outer=...)` must be an optax GradientTransformation")
    + ".*got function"
  ):
    FAMILY[fn](outer=optax.sgd)


@pytest.mark.parametrize("fn", FAMILY)
def test_update_needs_params_and_floating_leaves(fn):
  tx = FAMILY[fn](**({"num_fragments": 1} if fn == "streaming_diloco" else {}))
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match=re.escape(f"`{fn}` needs the current parameters")):
    tx.update({"w": jnp.ones(3)}, state)
  with pytest.raises(TypeError, match=re.escape(f"`{fn}`") + r".*floating-point.*\['n'\].*int32"):
    tx.init({"w": jnp.ones(3), "n": jnp.zeros((), jnp.int32)})
