"""Collectives checked against a sequential NumPy reference, with several workers.

Four workers with different random gradients run each communicating transformation under
``jax.vmap(axis_name=...)`` and under ``jax.shard_map`` over four emulated devices (per-worker
params and states sharded ``P("w")``); one test uses ``jax.pmap``. After every step: the params
match a plain NumPy loop over the workers implementing the equations of ALGORITHMS.md (float64,
relative tolerance 1e-5), the center is identical on every worker, and the center changes only on
communication steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

NUM_WORKERS = 4
NUM_STEPS = 7
PERIOD = 3
RTOL, ATOL = 1e-5, 1e-6
SHAPES = {"w": (3, 2), "b": (2,)}

# ------------------------------------------------------------------------------------------------
# NumPy inner optimizers: ``init(params) -> state`` and ``update(grads, state) -> (updates,
# state)`` on dicts of float64 arrays, written from the optax equations.


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


# ------------------------------------------------------------------------------------------------
# NumPy references: one call per step, a loop over the workers.


class NumpyElasticAverage:
  """Synchronous EASGD: every worker exchanges against the same center."""

  def __init__(self, inner, params, moving_rate, rho):
    self.inner, self.alpha, self.rho = inner, moving_rate, rho
    self.x = [dict(params) for _ in range(NUM_WORKERS)]
    self.center = dict(params)
    self.states = [inner.init(params) for _ in range(NUM_WORKERS)]
    self.step_count = 0

  def step(self, grads):
    self.step_count += 1
    new_x = []
    for i in range(NUM_WORKERS):
      g = add(grads[i], scale(self.rho, sub(self.x[i], self.center)))
      u, self.states[i] = self.inner.update(g, self.states[i])
      new_x.append(add(self.x[i], u))
    if self.step_count % PERIOD == 0:
      d = [scale(self.alpha, sub(x, self.center)) for x in new_x]
      new_x = [sub(x, d_i) for x, d_i in zip(new_x, d)]
      for d_i in d:
        self.center = add(self.center, d_i)
    self.x = new_x


class NumpyAGN:
  """AGN: local inner steps, mean accumulated gradient committed to the center every period."""

  def __init__(self, inner, params, center_update):
    self.inner, self.center_update = inner, center_update
    self.x = [dict(params) for _ in range(NUM_WORKERS)]
    self.center = dict(params)
    self.states = [inner.init(params) for _ in range(NUM_WORKERS)]
    self.center_state = inner.init(params)
    self.accum = [{k: np.zeros_like(v) for k, v in params.items()} for _ in range(NUM_WORKERS)]
    self.step_count = 0

  def step(self, grads):
    self.step_count += 1
    for i in range(NUM_WORKERS):
      u, self.states[i] = self.inner.update(grads[i], self.states[i])
      self.x[i] = add(self.x[i], u)
      self.accum[i] = add(self.accum[i], grads[i])
    if self.step_count % PERIOD == 0:
      commits = [scale(1.0 / PERIOD, a) for a in self.accum]
      if self.center_update == "mean":
        commits = [scale(1.0 / NUM_WORKERS, {k: sum(c[k] for c in commits) for k in commits[0]})]
      for commit in commits:  # axis-index order
        u, self.center_state = self.inner.update(commit, self.center_state)
        self.center = add(self.center, u)
      self.x = [dict(self.center) for _ in range(NUM_WORKERS)]
      self.accum = [{k: np.zeros_like(v) for k, v in a.items()} for a in self.accum]


# ------------------------------------------------------------------------------------------------
# Running a transformation on the four workers.


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


# ------------------------------------------------------------------------------------------------
# elastic_average and agn against the references.

EA_CONFIGS = {
  # name: (elastic_average kwargs given the inner learning rate, (moving_rate, rho) of reference)
  "rho0": (lambda lr: {"moving_rate": 0.2, "rho": 0.0}, lambda lr: (0.2, 0.0)),
  "rho_positive": (lambda lr: {"moving_rate": 0.2, "rho": 0.5}, lambda lr: (0.2, 0.5)),
  # TF's defaults: moving_rate = 0.9 / period / workers, rho = moving_rate / learning_rate.
  "defaults": (
    lambda lr: {"learning_rate": lr},
    lambda lr: (0.9 / PERIOD / NUM_WORKERS, 0.9 / PERIOD / NUM_WORKERS / lr),
  ),
}


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
@pytest.mark.parametrize("inner_name", sorted(INNERS))
@pytest.mark.parametrize("config", sorted(EA_CONFIGS))
def test_elastic_average_matches_numpy(config, inner_name, mapping):
  make_inner, make_np_inner, lr = INNERS[inner_name]
  kwargs, np_rates = EA_CONFIGS[config]
  tx = optax_dist.elastic_average(
    make_inner(), communication_period=PERIOD, axis_name="w", **kwargs(lr)
  )
  reference = NumpyElasticAverage(make_np_inner(), initial_params(), *np_rates(lr))
  run_against_reference(tx, reference, mapping, random_grads())


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
@pytest.mark.parametrize("inner_name", sorted(INNERS))
@pytest.mark.parametrize("center_update", ["sequential", "mean"])
def test_agn_matches_numpy(center_update, inner_name, mapping):
  make_inner, make_np_inner, _ = INNERS[inner_name]
  tx = optax_dist.agn(
    make_inner(), communication_period=PERIOD, center_update=center_update, axis_name="w"
  )
  reference = NumpyAGN(make_np_inner(), initial_params(), center_update)
  params, _ = run_against_reference(tx, reference, mapping, random_grads())
  # After the last commit (step 6) every worker restarted from the center: step 7 is local only.
  assert not np.allclose(worker(params, 0)["w"], worker(params, 1)["w"])


def test_agn_sequential_and_mean_differ():
  """With a non-linear inner (Adam), applying the commits one by one is not one step on their
  mean: the two center updates must be told apart by the reference."""
  seq = NumpyAGN(NumpyAdam(0.02), initial_params(), "sequential")
  mean = NumpyAGN(NumpyAdam(0.02), initial_params(), "mean")
  for grads in random_grads(num_steps=PERIOD):
    seq.step(grads)
    mean.step(grads)
  assert not np.allclose(seq.center["w"], mean.center["w"], rtol=1e-3)


def test_agn_pmap_matches_numpy():
  """Users still write ``pmap`` training loops: AGN with Adam, sequential commits."""
  tx = optax_dist.agn(optax.adam(0.02), communication_period=PERIOD, axis_name="w")
  reference = NumpyAGN(NumpyAdam(0.02), initial_params(), "sequential")
  run_against_reference(tx, reference, "pmap", random_grads())


def test_elastic_average_pmap_matches_numpy():
  tx = optax_dist.elastic_average(
    optax.sgd(0.05, momentum=0.9),
    communication_period=PERIOD,
    moving_rate=0.2,
    rho=0.5,
    axis_name="w",
  )
  reference = NumpyElasticAverage(NumpySGD(0.05, 0.9), initial_params(), 0.2, 0.5)
  run_against_reference(tx, reference, "pmap", random_grads())


# ------------------------------------------------------------------------------------------------
# tower: every worker takes the same inner step on the sum or mean of the workers' gradients.


@pytest.mark.parametrize(
  "mapping, reduction, inner_name",
  [
    ("vmap", "mean", "sgd"),
    ("vmap", "sum", "momentum"),
    ("vmap", "mean", "adam"),
    ("shard_map", "sum", "sgd"),
    ("shard_map", "mean", "momentum"),
    ("shard_map", "sum", "adam"),
  ],
)
def test_tower_matches_numpy(mapping, reduction, inner_name):
  make_inner, make_np_inner, _ = INNERS[inner_name]
  tx = optax_dist.tower(make_inner(), "w", reduction=reduction)
  mapped = Mapped(tx, mapping)
  x = initial_params()
  np_inner = make_np_inner()
  np_state = np_inner.init(x)
  params = mapped.put(stack([x] * NUM_WORKERS))
  state = mapped.init(params)
  for grads in random_grads(num_steps=4):
    params, state = mapped.step(params, state, stack(grads))
    total = {k: sum(g[k] for g in grads) for k in SHAPES}
    reduced = total if reduction == "sum" else scale(1.0 / NUM_WORKERS, total)
    u, np_state = np_inner.update(reduced, np_state)
    x = add(x, u)
    assert_identical_on_workers(params)
    assert_close(worker(params, 0), x)


# ------------------------------------------------------------------------------------------------
# moving_average and drop_stale_gradients: no collectives, each worker on its own.


@pytest.mark.parametrize("sequential_update", [True, False])
def test_moving_average_per_worker_matches_numpy(sequential_update):
  decay = 0.8
  tx = optax_dist.moving_average(
    optax.sgd(0.05, momentum=0.9), decay, sequential_update=sequential_update
  )
  mapped = Mapped(tx, "vmap")
  starts = [initial_params(seed=10 + i) for i in range(NUM_WORKERS)]
  params = stack(starts)
  state = mapped.init(params)
  np_inner = NumpySGD(0.05, 0.9)
  xs, emas = [dict(s) for s in starts], [dict(s) for s in starts]
  np_states = [np_inner.init(s) for s in starts]
  for grads in random_grads(num_steps=5):
    params, state = mapped.step(params, state, stack(grads))
    for i in range(NUM_WORKERS):
      u, np_states[i] = np_inner.update(grads[i], np_states[i])
      new_x = add(xs[i], u)
      p = new_x if sequential_update else xs[i]
      emas[i] = add(scale(decay, emas[i]), scale(1 - decay, p))
      xs[i] = new_x
      assert_close(worker(params, i), xs[i])
      assert_close(worker(state.ema, i), emas[i])
      assert_close(worker(optax_dist.eval_params(state, params), i), emas[i])


def test_drop_stale_gradients_per_worker_matches_numpy():
  """Each worker keeps its own global step; its gradients lag it by 0, 1 or 2 steps."""
  max_staleness = 1
  tx = optax_dist.drop_stale_gradients(optax.sgd(0.05, momentum=0.9), max_staleness)
  mapped = Mapped(tx, "vmap")
  x0 = initial_params()
  params = stack([x0] * NUM_WORKERS)
  state = mapped.init(params)
  np_inner = NumpySGD(0.05, 0.9)
  xs = [dict(x0) for _ in range(NUM_WORKERS)]
  np_states = [np_inner.init(x0) for _ in range(NUM_WORKERS)]
  global_steps, dropped = [0] * NUM_WORKERS, [0] * NUM_WORKERS
  lags = np.random.default_rng(2).integers(0, 3, size=(6, NUM_WORKERS))
  for grads, lag in zip(random_grads(num_steps=6), lags):
    grad_step = jnp.asarray(np.array(global_steps) - lag, jnp.int32)
    params, state = mapped.step(params, state, stack(grads), grad_step=grad_step)
    for i in range(NUM_WORKERS):
      if lag[i] <= max_staleness:
        u, np_states[i] = np_inner.update(grads[i], np_states[i])
        xs[i] = add(xs[i], u)
        global_steps[i] += 1
      else:
        dropped[i] += 1
      assert_close(worker(params, i), xs[i])
    np.testing.assert_array_equal(np.asarray(state.global_step), global_steps)
    np.testing.assert_array_equal(np.asarray(state.num_dropped), dropped)
  assert 0 < sum(dropped) < lags.size  # both branches were exercised
