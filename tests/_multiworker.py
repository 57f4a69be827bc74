"""Four workers with different random gradients, against sequential NumPy loops.

``Mapped`` runs a transformation under ``jax.vmap(axis_name="w")``, ``jax.shard_map`` over four
emulated devices (per-worker params and states sharded ``P("w")``) or ``jax.pmap``. The NumPy
inner optimizers (float64) are written from optax's equations; ``run_against_reference`` checks
after every step that the params match the reference (relative tolerance 1e-5), that the center
is identical on every worker and that it changes only on communication steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

NUM_WORKERS = 4


NUM_STEPS = 7


PERIOD = 3


RTOL, ATOL = 1e-5, 1e-6


RTOL, ATOL = 1e-5, 1e-6


SHAPES = {"w": (3, 2), "b": (2,)}


class NumpySGD:
  def __init__(self, learning_rate, momentum=None):
    self.lr, self.momentum = learning_rate, momentum

  def init(self, params):
    return {k: np.zeros_like(v) for k, v in params.items()}

  def update(self, grads, state):
    if self.momentum is None:
      return {k: -self.lr * g for k, g in grads.items()}, state
    trace = {k: g + self.momentum * state[k] for k, g in grads.items()}  # t = g + m t
    return {k: -self.lr * t for k, t in trace.items()}, trace


class NumpyAdam:
  def __init__(self, learning_rate, b1=0.9, b2=0.999, eps=1e-8):
    self.lr, self.b1, self.b2, self.eps = learning_rate, b1, b2, eps

  def init(self, params):
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    return (0, zeros, dict(zeros))

  def update(self, grads, state):
    count, mu, nu = state
    count += 1
    mu = {k: self.b1 * mu[k] + (1 - self.b1) * g for k, g in grads.items()}
    nu = {k: self.b2 * nu[k] + (1 - self.b2) * g**2 for k, g in grads.items()}
    updates = {}
    for k in grads:
      mu_hat = mu[k] / (1 - self.b1**count)
      nu_hat = nu[k] / (1 - self.b2**count)
      updates[k] = -self.lr * mu_hat / (np.sqrt(nu_hat) + self.eps)
    return updates, (count, mu, nu)


INNERS = {
  "sgd": (lambda: optax.sgd(0.1), lambda: NumpySGD(0.1), 0.1),
  "momentum": (lambda: optax.sgd(0.05, momentum=0.9), lambda: NumpySGD(0.05, 0.9), 0.05),
  "adam": (lambda: optax.adam(0.02), lambda: NumpyAdam(0.02), 0.02),
}


def add(a, b):
  return {k: a[k] + b[k] for k in a}


def sub(a, b):
  return {k: a[k] - b[k] for k in a}


def scale(s, a):
  return {k: s * v for k, v in a.items()}


def initial_params(seed=0):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s) for k, s in SHAPES.items()}


def random_grads(seed=1, num_steps=NUM_STEPS):
  """``[step][worker] -> dict`` of float64 gradients, exactly representable in float32."""
  rng = np.random.default_rng(seed)
  return [
    [
      {k: rng.normal(size=s).astype(np.float32).astype(np.float64) for k, s in SHAPES.items()}
      for _ in range(NUM_WORKERS)
    ]
    for _ in range(num_steps)
  ]


def stack(per_worker):
  """A list of per-worker dicts -> one dict of float32 arrays with a leading worker axis."""
  return {k: jnp.asarray(np.stack([t[k] for t in per_worker]), jnp.float32) for k in per_worker[0]}


def train_step(tx):
  def step(params, state, grads, **extra_args):
    updates, state = tx.update(grads, state, params, **extra_args)
    return optax.apply_updates(params, updates), state

  return step


class Mapped:
  """``init`` and ``step`` of ``tx`` mapped over ``NUM_WORKERS`` workers on axis ``"w"``.

  Inputs and outputs carry a leading worker axis in every mapping: ``vmap`` maps it,
  ``shard_map`` shards it over four devices (each device sees a block of one), ``pmap`` maps it
  over four devices.
  """

  def __init__(self, tx, mapping):
    self.mapping = mapping
    step = train_step(tx)
    if mapping == "vmap":
      self.init = jax.jit(jax.vmap(tx.init, axis_name="w"))
      self.step = jax.jit(jax.vmap(step, axis_name="w"))
    elif mapping == "pmap":
      devices = jax.devices()[:NUM_WORKERS]
      self.init = jax.pmap(tx.init, axis_name="w", devices=devices)
      self.step = jax.pmap(step, axis_name="w", devices=devices)
    else:
      self.mesh = Mesh(np.array(jax.devices()[:NUM_WORKERS]), ("w",))
      squeeze = lambda tree: jax.tree.map(lambda a: a[0], tree)
      expand = lambda tree: jax.tree.map(lambda a: a[None], tree)
      blockwise = lambda fn: lambda *args, **kw: expand(fn(*squeeze(args), **squeeze(kw)))
      shard = lambda fn: jax.jit(
        jax.shard_map(blockwise(fn), mesh=self.mesh, in_specs=P("w"), out_specs=P("w"))
      )
      self.init, self._step = shard(tx.init), shard(step)
      self.step = lambda *args, **kw: self._step(*self.put(args), **self.put(kw))

  def put(self, tree):
    if self.mapping != "shard_map":
      return tree
    return jax.device_put(tree, NamedSharding(self.mesh, P("w")))


def worker(tree, i):
  return jax.tree.map(lambda a: np.asarray(a[i]), tree)


def assert_identical_on_workers(tree):
  for leaf in jax.tree.leaves(tree):
    leaf = np.asarray(leaf)
    for i in range(1, NUM_WORKERS):
      np.testing.assert_array_equal(leaf[i], leaf[0])


def assert_close(actual, expected):
  for k in expected:
    np.testing.assert_allclose(np.asarray(actual[k], np.float64), expected[k], RTOL, ATOL)


def run_against_reference(tx, reference, mapping, grads_seq, **step_kwargs):
  """Runs ``tx`` and ``reference`` side by side; checks params, center and communication."""
  mapped = Mapped(tx, mapping)
  params = mapped.put(stack(reference.x))
  state = mapped.init(params)
  previous_center = np.asarray(state.center["w"])
  for t, grads in enumerate(grads_seq, start=1):
    params, state = mapped.step(params, state, stack(grads), **step_kwargs)
    reference.step(grads)
    assert_identical_on_workers(state.center)
    assert_close(worker(state.center, 0), reference.center)
    for i in range(NUM_WORKERS):
      assert_close(worker(params, i), reference.x[i])
    center = np.asarray(state.center["w"])
    if t % PERIOD == 0:
      assert not np.array_equal(center, previous_center), f"no exchange at step {t}"
    else:
      np.testing.assert_array_equal(center, previous_center, err_msg=f"exchange at step {t}")
    previous_center = center
  assert int(np.asarray(state.local_step)[0]) == len(grads_seq)
  return params, state
