"""diloco, streaming_diloco and local_sgd: float64 NumPy references and the drivers that run them.

Four workers train a quadratic, ``g_i = c_i * x_i - d_i(t)`` (the gradient depends on the params,
so every sync changes what follows), under ``jax.vmap(axis_name=...)`` and ``jax.shard_map`` over
four emulated devices (inputs placed ``P("workers")``). The NumPy loops implement the equations of
ALGORITHMS.md with their own inner (sgd, momentum, adam) and outer (sgd, Nesterov) optimizers.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

AXIS = "workers"


N = 4


STEPS = 8


SHAPES = {"a": (4,), "b": (2, 2), "c": (1, 4)}  # three leaves of 4 elements


RTOL, ATOL = 1e-5, 1e-6


RTOL, ATOL = 1e-5, 1e-6


ATOL_ADAM = 1e-5  # Adam divides by sqrt(nu): float32 rounding of small gradients shows more


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


def error(fn, arg, constraint, value):
  return f"{re.escape(f'`{fn}({arg}=')}.*{re.escape(constraint)}.*got {re.escape(repr(value))}"


# ----------------------------------------------------------------------------------------------
# The exchange in comm_dtype: values that rounding to bfloat16 or float8_e4m3fn moves, and
# whose rounded sums are exact in either dtype.

COMM_DTYPES = {"bfloat16": jnp.bfloat16, "float8_e4m3fn": jnp.float8_e4m3fn}


def integer_plus_a_little(seed, scale=1.0):
  """Per-worker ``(N, ...)`` float32 values ``scale * (m + 0.003)``, ``m`` an integer in
  [1, 6]: bfloat16 and float8_e4m3fn round ``m + 0.003`` and ``2 (m + 0.003)`` to the integer,
  and every partial sum of four such integers is exact in both, so an exchange in either dtype
  gives the mean of the rounded values exactly, and one in float32 misses it by 0.003 ``scale``."""
  rng = np.random.RandomState(seed)
  out = {}
  for k, s in SHAPES.items():
    out[k] = (scale * (rng.randint(1, 7, (N, *s)) + 0.003)).astype(np.float32)
  return out


def rounded(values, comm):
  """``values`` rounded to the ``comm`` dtype (a name of COMM_DTYPES) by ml_dtypes, in float64."""
  dtype = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}[comm]
  return np.asarray(values).astype(dtype).astype(np.float64)


def steps(tx, grads_seq, mapping):
  """Steps from zero params on N workers, one per gradient tree of ``grads_seq``; the params and
  the state after each step."""
  params = {k: jnp.zeros((N, *s)) for k, s in SHAPES.items()}
  if mapping == "vmap":
    state = jax.vmap(tx.init, axis_name=AXIS)(params)

    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    step = jax.jit(jax.vmap(step, axis_name=AXIS))
  else:
    init, step, put = shard_map_step(tx)
    params = put(params)
    state = init(params)
    grads_seq = [put(jax.tree.map(jnp.asarray, g)) for g in grads_seq]
  history = []
  for grads in grads_seq:
    params, state = step(params, state, grads)
    history.append((params, state))
  return history


def exchange_bytes(make):
  """``{comm_dtype name: (kinds, operand bytes, result bytes)}`` of the collectives inside the
  step's conditionals, as JAX lowers the shard_map step (XLA's CPU compiler would widen bfloat16
  to float32)."""
  out = {}
  for name, dtype in {"float32": None, **COMM_DTYPES}.items():
    init, step, put = shard_map_step(make(dtype))
    params = put({k: jnp.zeros((N, *s)) for k, s in SHAPES.items()})
    report = optax_dist.communication_report(
      step, params, init(params), params, stage="lowered"
    )
    assert not report.unconditional, report.unconditional
    kinds = tuple(sorted({c.kind for c in report.conditional}))
    out[name] = (kinds, report.conditional.bytes, report.conditional.result_bytes)
  return out
