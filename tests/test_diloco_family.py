"""diloco, streaming_diloco and local_sgd against float64 NumPy references, and their contracts.

Four workers train a quadratic, ``g_i = c_i * x_i - d_i(t)`` (the gradient depends on the params,
so every sync changes what follows), under ``jax.vmap(axis_name=...)`` and ``jax.shard_map`` over
four emulated devices (inputs placed ``P("workers")``). The NumPy loops below implement the
equations of ALGORITHMS.md with their own inner (sgd, momentum, adam) and outer (sgd, Nesterov)
optimizers. Also: the equivalences (``diloco(outer=sgd(1))`` is ``local_sgd``, ``streaming_diloco``
with one fragment is ``diloco``), the numbers torchft's and MaxText's own DiLoCo tests assert, the
sync schedule, communication bytes, 8-bit exchange, mixed precision, donation and bad inputs.
"""

from __future__ import annotations

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

AXIS = "workers"
N = 4
STEPS = 8
SHAPES = {"a": (4,), "b": (2, 2), "c": (1, 4)}  # three leaves of 4 elements
RTOL, ATOL = 1e-5, 1e-6
ATOL_ADAM = 1e-5  # Adam divides by sqrt(nu): float32 rounding of small gradients shows more

# ----------------------------------------------------------------------------------------------
# NumPy optimizers on dicts of float64 arrays, written from optax's equations.


class NpSGD:
  """``u = -lr g``; with momentum ``t = g + m t`` and ``u = -lr t`` (Nesterov: ``-lr (g + m t)``)."""

  def __init__(self, lr, momentum=None, nesterov=False):
    self.lr, self.momentum, self.nesterov = lr, momentum, nesterov

  def init(self, params):
    return {k: np.zeros_like(v) for k, v in params.items()}

  def update(self, grads, state):
    if self.momentum is None:
      return {k: -self.lr * g for k, g in grads.items()}, state
    trace = {k: g + self.momentum * state[k] for k, g in grads.items()}
    if self.nesterov:
      return {k: -self.lr * (g + self.momentum * trace[k]) for k, g in grads.items()}, trace
    return {k: -self.lr * t for k, t in trace.items()}, trace


class NpAdam:
  def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8):
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

  def init(self, params):
    return 0, {k: np.zeros_like(v) for k, v in params.items()}, {k: 0 * v for k, v in params.items()}

  def update(self, grads, state):
    count, mu, nu = state
    count += 1
    mu = {k: self.b1 * mu[k] + (1 - self.b1) * g for k, g in grads.items()}
    nu = {k: self.b2 * nu[k] + (1 - self.b2) * g * g for k, g in grads.items()}
    updates = {
      k: -self.lr * (mu[k] / (1 - self.b1**count))
      / (np.sqrt(nu[k] / (1 - self.b2**count)) + self.eps)
      for k in grads
    }
    return updates, (count, mu, nu)


INNERS = {
  "sgd": (lambda: optax.sgd(0.1), lambda: NpSGD(0.1)),
  "momentum": (lambda: optax.sgd(0.05, momentum=0.9), lambda: NpSGD(0.05, 0.9)),
  "adam": (lambda: optax.adam(0.05), lambda: NpAdam(0.05)),
}
OUTERS = {
  "nesterov": (lambda: optax.sgd(0.7, momentum=0.9, nesterov=True), lambda: NpSGD(0.7, 0.9, True)),
  "sgd1": (lambda: optax.sgd(1.0), lambda: NpSGD(1.0)),
}


# ----------------------------------------------------------------------------------------------
# The problem and the NumPy references.


def problem(seed=0):
  rng = np.random.RandomState(seed)
  x0 = {k: rng.uniform(-1, 1, s) for k, s in SHAPES.items()}
  c = {k: rng.uniform(0.5, 1.5, (N, *s)) for k, s in SHAPES.items()}  # per worker
  d = {k: rng.normal(size=(STEPS, N, *s)) for k, s in SHAPES.items()}  # per step and worker
  return x0, c, d


def np_grad(c, d, x, i, t):
  return {k: c[k][i] * x[k] - d[k][t, i] for k in x}


def streaming_reference(inner, outer, x0, c, d, *, sync_period, ids, mixing=0.0):
  """Streaming DiLoCo (DiLoCo with one fragment) as a loop over workers; params per step."""
  keys, frags = list(x0), sorted(set(ids.values()))
  num_fragments = len(frags)
  x = [dict(x0) for _ in range(N)]
  anchor = dict(x0)
  inner_states = [inner.init(x0) for _ in range(N)]
  outer_states = [outer.init({k: x0[k] for k in keys if ids[k] == f}) for f in frags]
  history = []
  for t in range(STEPS):
    step = t + 1
    new_x = []
    for i in range(N):
      u, inner_states[i] = inner.update(np_grad(c, d, x[i], i, t), inner_states[i])
      new_x.append({k: x[i][k] + u[k] for k in keys})
    for f in frags:
      offset = ((f + 1) * sync_period // num_fragments) % sync_period
      if step % sync_period != offset:
        continue
      mine = [k for k in keys if ids[k] == f]
      delta = {k: np.mean([anchor[k] - new_x[i][k] for i in range(N)], axis=0) for k in mine}
      o, outer_states[f] = outer.update(delta, outer_states[f])
      for k in mine:
        anchor[k] = anchor[k] + o[k]
        for i in range(N):
          new_x[i][k] = mixing * new_x[i][k] + (1 - mixing) * anchor[k]
    x = new_x
    history.append(x)
  return history, anchor


def local_sgd_reference(inner, x0, c, d, *, sync_period, warmup_steps):
  keys = list(x0)
  x = [dict(x0) for _ in range(N)]
  inner_states = [inner.init(x0) for _ in range(N)]
  history = []
  for t in range(STEPS):
    step = t + 1
    grads = [np_grad(c, d, x[i], i, t) for i in range(N)]
    if step <= warmup_steps:
      mean = {k: np.mean([g[k] for g in grads], axis=0) for k in keys}
      grads = [mean] * N
    new_x = []
    for i in range(N):
      u, inner_states[i] = inner.update(grads[i], inner_states[i])
      new_x.append({k: x[i][k] + u[k] for k in keys})
    if step > warmup_steps and (step - warmup_steps) % sync_period == 0:
      mean = {k: np.mean([xi[k] for xi in new_x], axis=0) for k in keys}
      new_x = [dict(mean) for _ in range(N)]
    x = new_x
    history.append(x)
  return history


# ----------------------------------------------------------------------------------------------
# Drivers: a whole run in one compiled program, under vmap or shard_map.


def _grad(x, c, d):
  return jax.tree.map(lambda x, c, d: c * x - d, x, c, d)


def run(tx, x0, c, d, mapping="vmap", dtype=jnp.float32):
  """Trains ``STEPS`` steps; returns the params after every step ``(STEPS, N, ...)`` and the state.

  ``x0`` is broadcast to every worker; ``c`` is ``(N, ...)`` and ``d`` ``(STEPS, N, ...)``.
  ``mapping="shard_map_2d"`` maps the workers over a 2 x 2 mesh, axes ``("hosts", "gpus")``.
  """
  cast = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, dtype), tree)
  x = cast({k: np.broadcast_to(v, (N, *v.shape)) for k, v in x0.items()})
  c, d = cast(c), cast(d)

  def worker_run(x, c, d):  # one worker: x (...), c (...), d (STEPS, ...)
    def body(carry, d_t):
      x, s = carry
      u, s = tx.update(_grad(x, c, d_t), s, x)
      x = optax.apply_updates(x, u)
      return (x, s), x

    (_, state), history = jax.lax.scan(body, (x, tx.init(x)), d)
    return history, state

  if mapping == "vmap":
    d = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), d)
    history, state = jax.jit(jax.vmap(worker_run, axis_name=AXIS))(x, c, d)
  else:
    if mapping == "shard_map":
      mesh, spec = jax.make_mesh((N,), (AXIS,), devices=jax.devices()[:N]), P(AXIS)
    else:
      mesh = jax.make_mesh((2, N // 2), ("hosts", "gpus"), devices=jax.devices()[:N])
      spec = P(("hosts", "gpus"))
    squeeze = lambda tree: jax.tree.map(lambda a: a[0], tree)
    expand = lambda tree: jax.tree.map(lambda a: a[None], tree)
    fn = jax.shard_map(
      lambda *args: expand(worker_run(*squeeze(args))), mesh=mesh, in_specs=spec,
      out_specs=spec,
    )
    d = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), d)
    put = lambda tree: jax.device_put(tree, NamedSharding(mesh, spec))
    history, state = jax.jit(fn)(put(x), put(c), put(d))
  return jax.tree.map(lambda a: np.swapaxes(np.asarray(a, np.float64), 0, 1), history), state


def assert_history_close(history, reference, rtol=RTOL, atol=ATOL):
  for t, step in enumerate(reference):
    for i, x in enumerate(step):
      for k in x:
        np.testing.assert_allclose(
          history[k][t, i], x[k], rtol=rtol, atol=atol, err_msg=f"step {t + 1} worker {i} {k}"
        )


def assert_eval_params_is_anchor(state, history):
  """eval_params gives the anchor, cast to the params' dtypes."""
  params = {k: jnp.asarray(v[-1], jnp.float32) for k, v in history.items()}
  evaluated = jax.vmap(optax_dist.eval_params)(jax.tree.map(np.asarray, state), params)
  for k in params:
    np.testing.assert_array_equal(evaluated[k], np.asarray(state.anchor[k]))


def assert_identical_on_workers(tree):
  for leaf in jax.tree.leaves(tree):
    leaf = np.asarray(leaf)
    for i in range(1, leaf.shape[0]):
      np.testing.assert_array_equal(leaf[i], leaf[0])


# ----------------------------------------------------------------------------------------------
# Against the references.

DILOCO_CONFIGS = [
  ("vmap", "sgd", "nesterov", 1),
  ("vmap", "momentum", "nesterov", 3),
  ("vmap", "adam", "sgd1", 2),
  ("shard_map", "adam", "nesterov", 3),
]


@pytest.mark.parametrize("mapping,inner,outer,sync_period", DILOCO_CONFIGS)
def test_diloco_matches_numpy_reference(mapping, inner, outer, sync_period):
  x0, c, d = problem()
  tx = optax_dist.diloco(
    INNERS[inner][0](), OUTERS[outer][0](), sync_period=sync_period, axis_name=AXIS
  )
  history, state = run(tx, x0, c, d, mapping)
  reference, anchor = streaming_reference(
    INNERS[inner][1](), OUTERS[outer][1](), x0, c, d, sync_period=sync_period,
    ids=dict.fromkeys(x0, 0),
  )
  atol = ATOL_ADAM if inner == "adam" else ATOL
  assert_history_close(history, reference, atol=atol)
  assert_identical_on_workers(state.anchor)
  for k in anchor:
    np.testing.assert_allclose(np.asarray(state.anchor[k])[0], anchor[k], RTOL, atol)
  assert_eval_params_is_anchor(state, history)
  np.testing.assert_array_equal(np.asarray(state.local_step), STEPS)
  if sync_period > 1:  # the workers differ between syncs, and coincide on sync steps
    assert not np.allclose(history["a"][sync_period - 2, 0], history["a"][sync_period - 2, 1])
  np.testing.assert_allclose(  # x_i + (anchor - x_i): the anchor up to rounding
    history["a"][sync_period - 1, 0], history["a"][sync_period - 1, 1], rtol=1e-6, atol=1e-7
  )


STREAMING_CONFIGS = [
  # mapping, inner, outer, sync_period, num_fragments, explicit fragments, mixing
  ("vmap", "momentum", "nesterov", 3, 2, None, 0.5),
  ("vmap", "adam", "nesterov", 4, 3, None, 0.0),
  ("vmap", "sgd", "sgd1", 2, 3, None, 0.5),  # H < F: fragments 0 and 2 share even steps
  ("shard_map", "adam", "nesterov", 3, 2, {"a": 1, "b": 0, "c": 1}, 0.5),
  ("shard_map", "momentum", "sgd1", 4, 3, {"a": 2, "b": 0, "c": 1}, 0.0),
]


@pytest.mark.parametrize(
  "mapping,inner,outer,sync_period,num_fragments,fragments,mixing", STREAMING_CONFIGS
)
def test_streaming_diloco_matches_numpy_reference(
  mapping, inner, outer, sync_period, num_fragments, fragments, mixing
):
  x0, c, d = problem(1)
  tx = optax_dist.streaming_diloco(
    INNERS[inner][0](), OUTERS[outer][0](), sync_period=sync_period,
    num_fragments=num_fragments, fragments=fragments, mixing=mixing, axis_name=AXIS,
  )
  history, state = run(tx, x0, c, d, mapping)
  # Default assignment of three equal leaves: F=1 -> 0,0,0; F=2 -> 0,0,1; F=3 -> 0,1,2.
  ids = fragments or dict(zip(x0, [(num_fragments * 4 * j) // 12 for j in range(3)]))
  reference, anchor = streaming_reference(
    INNERS[inner][1](), OUTERS[outer][1](), x0, c, d, sync_period=sync_period, ids=ids,
    mixing=mixing,
  )
  atol = ATOL_ADAM if inner == "adam" else ATOL
  assert_history_close(history, reference, atol=atol)
  assert_identical_on_workers(state.anchor)
  for k in anchor:
    np.testing.assert_allclose(np.asarray(state.anchor[k])[0], anchor[k], RTOL, atol)
  assert_eval_params_is_anchor(state, history)


LOCAL_SGD_CONFIGS = [
  ("vmap", "sgd", 2, 0),
  ("vmap", "adam", 1, 3),
  ("shard_map", "momentum", 3, 2),
]


@pytest.mark.parametrize("mapping,inner,sync_period,warmup_steps", LOCAL_SGD_CONFIGS)
def test_local_sgd_matches_numpy_reference(mapping, inner, sync_period, warmup_steps):
  x0, c, d = problem(2)
  tx = optax_dist.local_sgd(
    INNERS[inner][0](), sync_period=sync_period, warmup_steps=warmup_steps, axis_name=AXIS
  )
  history, state = run(tx, x0, c, d, mapping)
  reference = local_sgd_reference(
    INNERS[inner][1](), x0, c, d, sync_period=sync_period, warmup_steps=warmup_steps
  )
  assert_history_close(history, reference, atol=ATOL_ADAM if inner == "adam" else ATOL)
  assert set(state._fields) == {"local_step", "inner_state"}  # no anchor: params are evaluated
  params = {k: v[-1] for k, v in history.items()}
  assert optax_dist.eval_params(state, params) is params
  # Identical workers through the warm-up and on model-average steps, apart in between.
  first_average = warmup_steps + sync_period
  for t in range(warmup_steps):
    np.testing.assert_array_equal(history["b"][t, 0], history["b"][t, 3], err_msg=f"step {t + 1}")
  np.testing.assert_allclose(
    history["b"][first_average - 1, 0], history["b"][first_average - 1, 3], rtol=1e-6, atol=1e-7
  )
  if sync_period > 1:
    assert not np.allclose(history["b"][first_average - 2, 0], history["b"][first_average - 2, 3])


# ----------------------------------------------------------------------------------------------
# Equivalences.


@pytest.mark.parametrize("inner,sync_period", [("adam", 3)])
def test_diloco_with_outer_sgd_1_is_local_sgd(inner, sync_period):
  x0, c, d = problem(3)
  diloco = optax_dist.diloco(
    INNERS[inner][0](), optax.sgd(1.0), sync_period=sync_period, axis_name=AXIS
  )
  local = optax_dist.local_sgd(INNERS[inner][0](), sync_period=sync_period, axis_name=AXIS)
  history_diloco, state = run(diloco, x0, c, d)
  history_local, _ = run(local, x0, c, d)
  for k in x0:
    np.testing.assert_allclose(history_diloco[k], history_local[k], rtol=1e-5, atol=1e-6)
  # The anchor is the workers' mean after the last sync.
  last_sync = (STEPS // sync_period) * sync_period
  np.testing.assert_allclose(
    np.asarray(state.anchor["c"])[0], history_local["c"][last_sync - 1, 0], rtol=1e-5, atol=1e-6
  )


@pytest.mark.parametrize("inner", ["momentum"])
def test_streaming_diloco_with_one_fragment_is_diloco(inner):
  x0, c, d = problem(4)
  kwargs = {"sync_period": 3, "axis_name": AXIS}
  history_d, state_d = run(optax_dist.diloco(INNERS[inner][0](), **kwargs), x0, c, d)
  history_s, state_s = run(
    optax_dist.streaming_diloco(INNERS[inner][0](), num_fragments=1, **kwargs), x0, c, d
  )
  for k in x0:
    np.testing.assert_array_equal(history_s[k], history_d[k])
  for a, b in zip(jax.tree.leaves(state_s.anchor), jax.tree.leaves(state_d.anchor), strict=True):
    np.testing.assert_array_equal(a, b)
  assert len(state_s.outer_state) == 1
  for a, b in zip(
    jax.tree.leaves(state_s.outer_state[0]), jax.tree.leaves(state_d.outer_state), strict=True
  ):
    np.testing.assert_array_equal(a, b)


def test_diloco_under_pmap_matches_vmap():
  """Users still write pmap loops: the same steps, one per device."""
  x0, c, d = problem(8)
  tx = optax_dist.diloco(optax.sgd(0.1, momentum=0.9), sync_period=2, axis_name=AXIS)
  history, _ = run(tx, x0, c, d)
  devices = jax.devices()[:N]

  def step(x, s, c, d):
    u, s = tx.update(_grad(x, c, d), s, x)
    return optax.apply_updates(x, u), s

  step = jax.pmap(step, axis_name=AXIS, devices=devices)
  to32 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)
  x = to32({k: np.broadcast_to(v, (N, *v.shape)) for k, v in x0.items()})
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(x)
  for t in range(STEPS):
    x, state = step(x, state, to32(c), to32({k: v[t] for k, v in d.items()}))
    for k in x0:
      np.testing.assert_allclose(np.asarray(x[k]), history[k][t], rtol=RTOL, atol=ATOL)
  assert_identical_on_workers(state.anchor)


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
# Numbers asserted by torchft's and MaxText's own tests.

# torchft's diloco_regression_test (test_diloco_mocked_updates, no delay): two replicas, two
# one-element layers in two fragments starting at 1, gradient 2, inner SGD lr 1, outer SGD lr 2,
# sync_every 6, fragment_update_alpha = mixing. Params before each of 16 steps, and the global
# params at steps 3, 6, 9, 12 (its fixture files).
TORCHFT = {
  0.0: (
    [1, -1, -3, -11, -13, -15, -17, -19, -21, -35, -37, -39, -41, -43, -45, -59],
    [1, -1, -3, -5, -7, -9, -23, -25, -27, -29, -31, -33, -47, -49, -51, -53],
    {3: (-11, 1), 6: (-11, -23), 9: (-35, -23), 12: (-35, -47)},
  ),
  0.5: (
    [1, -1, -3, -8, -10, -12, -14, -16, -18, -24.5, -26.5, -28.5, -30.5, -32.5, -34.5, -40.25],
    [1, -1, -3, -5, -7, -9, -17, -19, -21, -23, -25, -27, -32, -34, -36, -38],
    {3: (-11, 1), 6: (-11, -23), 9: (-29, -23), 12: (-29, -35)},
  ),
  1.0: (
    [1 - 2 * t for t in range(16)],
    [1 - 2 * t for t in range(16)],
    {3: (-11, 1), 6: (-11, -23), 9: (-23, -23), 12: (-23, -23)},
  ),
}


@pytest.mark.parametrize("mixing", sorted(TORCHFT))
def test_torchft_streaming_fixture(mixing):
  layer0, layer1, anchors = TORCHFT[mixing]
  tx = optax_dist.streaming_diloco(
    optax.sgd(1.0), optax.sgd(2.0), sync_period=6, num_fragments=2, mixing=mixing, axis_name=AXIS
  )
  params = {"layers.0.weight": jnp.ones((2, 1, 1)), "layers.1.weight": jnp.ones((2, 1, 1))}
  state = jax.vmap(tx.init, axis_name=AXIS)(params)
  step = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
  grads = jax.tree.map(lambda p: jnp.full_like(p, 2.0), params)
  for t in range(16):
    got = [np.asarray(params[k])[:, 0, 0] for k in sorted(params)]
    np.testing.assert_array_equal(got[0], [layer0[t]] * 2, err_msg=f"layer 0, step {t}")
    np.testing.assert_array_equal(got[1], [layer1[t]] * 2, err_msg=f"layer 1, step {t}")
    if t in anchors:
      anchor = [np.asarray(state.anchor[k])[:, 0, 0] for k in sorted(params)]
      np.testing.assert_array_equal(np.stack(anchor, 1), [anchors[t]] * 2)
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)


def test_maxtext_diloco_numbers():
  """MaxText's diloco_test: 2 replicas, linear model, MSE, inner SGD 0.1, outer Nesterov lr 1.

  Replica 0's loss on steps 1-4 is 1.0, 0.49, 0.2401 and 0.207545 (rtol 1e-2 there), and after
  the sync on step 3 the params are w = (1.5345, 1.0494), b = 0.5839 (four decimals).
  """
  tx = optax_dist.diloco(
    optax.sgd(0.1), optax.sgd(1.0, momentum=0.9, nesterov=True), sync_period=3, axis_name=AXIS
  )
  inputs = jnp.array([[[0.0, 1.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]])
  labels = jnp.array([[[1.0], [2.0]], [[2.0], [3.0]]])

  def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

  def step(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  params = {"w": jnp.array([[[2.0], [1.0]]] * 2), "b": jnp.ones((2, 1))}
  state = jax.vmap(tx.init, axis_name=AXIS)(params)
  step = jax.jit(jax.vmap(step, axis_name=AXIS))
  losses = []
  for t in range(4):
    params, state, loss = step(params, state, inputs, labels)
    losses.append(float(loss[0]))
    if t == 2:
      np.testing.assert_allclose(params["w"][:, :, 0], [[1.5345, 1.0494]] * 2, atol=1e-4)
      np.testing.assert_allclose(params["b"][:, 0], [0.5839] * 2, atol=1e-4)
  np.testing.assert_allclose(losses, [1.0, 0.49, 0.2401, 0.207545], rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# Schedules, fragments and per-fragment outer state.


def synced_steps(tx, params, steps):
  """For each leaf, the steps on which its anchor changed (one worker, gradients -1)."""
  state = tx.init(params)
  update = jax.jit(tx.update)
  grads = jax.tree.map(lambda p: -jnp.ones_like(p), params)
  changes = {k: [] for k in params}
  for t in range(1, steps + 1):
    before = state.anchor
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    for k in params:
      if not np.array_equal(before[k], state.anchor[k]):
        changes[k].append(t)
  return changes


@pytest.mark.parametrize(
  "sync_period,num_fragments,expected",
  [
    (4, 1, [[4, 8, 12]] * 3),
    (4, 3, [[1, 5, 9], [2, 6, 10], [4, 8, 12]]),  # s_f = 1, 2, 4
    (6, 2, [[3, 9], [3, 9], [6, 12]]),  # s_f = 3, 6; leaves in fragments 0, 0, 1
    (2, 3, [[2, 4, 6, 8, 10, 12], [1, 3, 5, 7, 9, 11], [2, 4, 6, 8, 10, 12]]),  # H < F
    (1, 3, [list(range(1, 13))] * 3),
  ],
)
def test_streaming_sync_schedule(sync_period, num_fragments, expected):
  params = {"a": jnp.zeros(4), "b": jnp.zeros(4), "c": jnp.zeros(4)}
  tx = optax_dist.streaming_diloco(
    optax.sgd(1.0), optax.sgd(1.0), sync_period=sync_period, num_fragments=num_fragments
  )
  changes = synced_steps(tx, params, 12)
  assert [changes[k] for k in sorted(params)] == expected


@pytest.mark.parametrize(
  "sizes,num_fragments,expected",
  [
    ([5, 5, 5, 5], 4, (0, 1, 2, 3)),
    ([10, 1, 1, 1, 7], 2, (0, 1, 1, 1, 1)),  # c_j = 0, 10, 11, 12, 13 of 20
    ([1, 1, 1, 1, 16], 2, (0, 0, 0, 0, 0)),  # fragment 1 would be empty: raises
    ([3, 4, 6], 3, (0, 0, 1)),  # c_j = 0, 3, 7 of 13: fragment 2 empty, raises
  ],
)
def test_default_fragment_assignment(sizes, num_fragments, expected):
  params = {f"p{j}": jnp.zeros(s) for j, s in enumerate(sizes)}
  tx = optax_dist.streaming_diloco(optax.sgd(0.1), num_fragments=num_fragments)
  if len(set(expected)) < num_fragments:
    pattern = (
      re.escape("`streaming_diloco(num_fragments=...)` must leave no fragment empty, got")
      + f" {num_fragments} fragments for {len(sizes)} param leaves of sizes "
      + re.escape(str(sizes))
      + ".*explicit `fragments=`"
    )
    with pytest.raises(ValueError, match=pattern):
      tx.init(params)
    return
  assert optax_dist._streaming_diloco.assign_fragments("t", params, num_fragments) == expected
  state = tx.init(params)
  for f, outer_state in enumerate(state.outer_state):  # masked like optax.masked
    trace = outer_state[0].trace
    for j, k in enumerate(sorted(params)):
      assert isinstance(trace[k], optax.MaskedNode) == (expected[j] != f)


def test_outer_state_advances_only_on_its_fragment_sync():
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  tx = optax_dist.streaming_diloco(optax.sgd(0.1), sync_period=4, num_fragments=2)  # s_f = 2, 4
  state = tx.init(params)
  update = jax.jit(tx.update)
  grads = {"a": -jnp.ones(2), "b": -jnp.ones(2)}
  traces = []
  for _ in range(4):
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    traces.append([state.outer_state[0][0].trace["a"][0], state.outer_state[1][0].trace["b"][0]])
  traces = np.asarray(traces)
  np.testing.assert_array_equal(traces[:2, 1], 0.0)  # fragment 1 untouched before step 4
  np.testing.assert_array_equal(traces[0, 0], 0.0)
  assert traces[1, 0] != 0 and traces[2, 0] == traces[1, 0] and traces[3, 0] == traces[1, 0]
  assert traces[3, 1] != 0
  assert isinstance(state.outer_state[0][0].trace["b"], optax.MaskedNode)
  assert isinstance(state.outer_state[1][0].trace["a"], optax.MaskedNode)


# ----------------------------------------------------------------------------------------------
# Communication: bytes per sync, per fragment, 8-bit exchange.


def shard_map_step(tx):
  mesh = jax.make_mesh((N,), (AXIS,), devices=jax.devices()[:N])
  squeeze = lambda tree: jax.tree.map(lambda a: a[0], tree)
  expand = lambda tree: jax.tree.map(lambda a: a[None], tree)

  def worker_step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  init = jax.jit(
    jax.shard_map(lambda p: expand(tx.init(squeeze(p))), mesh=mesh, in_specs=P(AXIS),
                  out_specs=P(AXIS))
  )
  step = jax.jit(
    jax.shard_map(lambda *a: expand(worker_step(*squeeze(a))), mesh=mesh, in_specs=P(AXIS),
                  out_specs=P(AXIS))
  )
  put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P(AXIS)))
  return init, step, put


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
  params = put({k: jnp.zeros((N, *s)) for k, s in SHAPES.items()})
  state = init(params)
  stage = "lowered" if name.endswith("float8") else "compiled"
  report = optax_dist.communication_report(step, params, state, params, stage=stage)
  assert not report.unconditional, report.unconditional
  assert per_conditional(report) == expected
  assert report.non_communication_step.bytes == 0


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
def test_float8_exchange_sums_quantized_values_in_float32(mapping):
  """With float8 the workers' pseudo-gradients are quantized, gathered and summed in float32.

  x0 = 0 and outer SGD 1 after one inner SGD step: the anchor becomes -mean_i q(g_i), with q the
  rounding to float8_e4m3fn, summed exactly (no float8 rounding of partial sums, no overflow
  of float8's range even where the sum exceeds 448).
  """
  rng = np.random.RandomState(6)
  grads = {k: rng.uniform(-200, 200, (N, *s)).astype(np.float32) for k, s in SHAPES.items()}
  tx = optax_dist.diloco(
    optax.sgd(1.0), optax.sgd(1.0), sync_period=1, axis_name=AXIS, comm_dtype=jnp.float8_e4m3fn
  )
  params = {k: jnp.zeros((N, *s)) for k, s in SHAPES.items()}
  if mapping == "vmap":
    state = jax.vmap(tx.init, axis_name=AXIS)(params)
    _, state = jax.jit(jax.vmap(tx.update, axis_name=AXIS))(grads, state, params)
  else:
    init, step, put = shard_map_step(tx)
    params = put(params)
    _, state = step(params, init(params), put(jax.tree.map(jnp.asarray, grads)))
  assert_identical_on_workers(state.anchor)
  for k, g in grads.items():
    quantized = g.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    expected = -(quantized.sum(axis=0) / N)
    np.testing.assert_allclose(np.asarray(state.anchor[k])[0], expected, rtol=1e-7)
  # Some sums exceed float8_e4m3fn's largest value, 448: a float8 psum would give NaN there.
  totals = np.concatenate([g.astype(ml_dtypes.float8_e4m3fn).astype(np.float64).sum(0).ravel()
                           for g in grads.values()])
  assert np.max(np.abs(totals)) > 448


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
  params = {"a": jnp.array([1.0, 2.0], jnp.bfloat16), "b": jnp.array([[3.0, -1.0]], jnp.bfloat16)}
  grads = {"a": jnp.array([0.3, -0.7], jnp.float32), "b": jnp.array([[1.1, 0.2]], jnp.float32)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  updates, state1 = step(grads, state, params)
  inner_updates, _ = inner.update(grads, inner.init(params), params)
  for k in params:  # step 1 is no sync: exactly the inner's updates, in its dtype
    assert updates[k].dtype == inner_updates[k].dtype == jnp.float32
    np.testing.assert_array_equal(updates[k], inner_updates[k])
  shapes = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype), s)
  assert shapes(state1) == shapes(state)
  params = optax.apply_updates(params, updates)
  updates, state2 = step(grads, state1, params)  # a sync step
  assert shapes(state2) == shapes(state) and step._cache_size() == 1
  assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))
  if hasattr(state2, "anchor"):
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(state2.anchor))
    evaluated = optax_dist.eval_params(state2, params)
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
  params = {"a": jnp.ones(4), "b": jnp.arange(4.0)}
  state = tx.init(params)  # eager: must share no buffer with params

  def step(params, state):
    updates, state = tx.update(jax.tree.map(jnp.sin, params), state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  for _ in range(3):
    params, state = step(params, state)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


def test_one_worker_diloco_is_an_outer_step_on_its_own_progress():
  # H = 2, inner SGD 1, outer Nesterov: after two steps of gradient -1 from 0, x' = 2,
  # delta = -2, trace = -2, anchor = 0 + 0.7 (2 + 0.9 * 2) = 2.66.
  tx = optax_dist.diloco(optax.sgd(1.0), sync_period=2)
  params = jnp.zeros(1)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(2):
    updates, state = update(-jnp.ones(1), state, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(params, [2.66], rtol=1e-6)
  np.testing.assert_allclose(state.anchor, [2.66], rtol=1e-6)
  np.testing.assert_allclose(state.outer_state[0].trace, [-2.0])


# ----------------------------------------------------------------------------------------------
# Bad inputs: the message names the function, the argument and the value.


def error(fn, arg, constraint, value):
  return f"{re.escape(f'`{fn}({arg}=')}.*{re.escape(constraint)}.*got {re.escape(repr(value))}"


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


@pytest.mark.parametrize("value,exc", [(-1, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_warmup_steps_must_be_a_non_negative_int(value, exc):
  constraint = "must be an int >= 0" if exc is ValueError else "must be an int"
  with pytest.raises(exc, match=error("local_sgd", "warmup_steps", constraint, value)):
    optax_dist.local_sgd(optax.sgd(0.1), sync_period=2, warmup_steps=value)


@pytest.mark.parametrize("value,exc", [(-0.1, ValueError), (1.5, ValueError), ("x", TypeError)])
def test_mixing_must_be_in_unit_interval(value, exc):
  with pytest.raises(exc, match=re.escape("`streaming_diloco(mixing=...)`") + ".*got"):
    optax_dist.streaming_diloco(optax.sgd(0.1), mixing=value)
  if exc is ValueError:
    with pytest.raises(exc, match=error("streaming_diloco", "mixing", "in [0, 1]", value)):
      optax_dist.streaming_diloco(optax.sgd(0.1), mixing=value)


@pytest.mark.parametrize("value,exc", [(0, ValueError), (2.0, TypeError)])
def test_num_fragments_must_be_a_positive_int(value, exc):
  with pytest.raises(
    exc, match=error("streaming_diloco", "num_fragments", "must be a positive int", value)
  ):
    optax_dist.streaming_diloco(optax.sgd(0.1), num_fragments=value)


def test_num_fragments_above_the_leaf_count():
  tx = optax_dist.streaming_diloco(optax.sgd(0.1), num_fragments=3)
  pattern = (
    re.escape("`streaming_diloco(num_fragments=...)` must leave no fragment empty, got 3")
    + r" fragments for 2 param leaves of sizes \[2, 5\]"
  )
  with pytest.raises(ValueError, match=pattern):
    tx.init({"a": jnp.zeros(2), "b": jnp.zeros(5)})


def test_explicit_fragments_are_checked():
  def make(fragments, num_fragments=2):
    return optax_dist.streaming_diloco(
      optax.sgd(0.1), num_fragments=num_fragments, fragments=fragments
    )

  with pytest.raises(ValueError, match=re.escape("ids must be in [0, num_fragments) = [0, 2),")
                     + r" got 2 at \['b'\]"):
    make({"a": 0, "b": 2})
  with pytest.raises(TypeError, match=re.escape("`streaming_diloco(fragments=...)` must hold an")
                     + r".*got 'x' at \['a'\]"):
    make({"a": "x", "b": 1})
  params = {"a": jnp.zeros(2), "b": jnp.zeros(5)}
  with pytest.raises(ValueError, match=re.escape("`streaming_diloco(fragments=...)` must have the")
                     + ".*PyTreeDef"):
    make({"a": 0, "c": 1}).init(params)
  with pytest.raises(ValueError, match=re.escape("assigns no leaf to fragment 1 of num_fragments=3")):
    make({"a": 0, "b": 2}, num_fragments=3).init(params)
  state = make({"a": 1, "b": 0}).init(params)
  assert isinstance(state.outer_state[0][0].trace["a"], optax.MaskedNode)
  assert isinstance(state.outer_state[1][0].trace["b"], optax.MaskedNode)
