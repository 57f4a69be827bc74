"""Hierarchical meshes: synchronous within a host, periodic across hosts, against NumPy.

On a ``hosts x gpus`` mesh (2x2 and 2x4) under ``shard_map`` with per-worker params, each
periodic transformation runs in two layouts:

* nested: ``diloco(tower(adamw, "gpus"), axis_name="hosts")`` (likewise ``elastic_average`` and
  ``local_sgd``): every step all-reduces the gradients within a host, and the hosts exchange
  every H steps;
* flat: ``axis_name=("hosts", "gpus")``: every device is a worker of the periodic exchange.

``agn`` commits to its center with either ``center_update`` (``"agn"`` is ``"sequential"``,
``"agn_mean"`` is ``"mean"``).

The reference is a float64 NumPy loop over the grid of workers written from ALGORITHMS.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

STEPS = 7
PERIOD = 3
SHAPE = (3, 2)
LR, OUTER_LR, OUTER_MOMENTUM, WEIGHT_DECAY = 0.05, 0.7, 0.9, 1e-2
MOVING_RATE = 0.1
MESHES = [(2, 2), (2, 4)]


# ----------------------------------------------------------------------------------------------
# NumPy optimizers on float64 arrays: init(x) -> state, update(g, state, x) -> (u, state).


class AdamW:
  b1, b2, eps = 0.9, 0.999, 1e-8

  def init(self, x):
    return 0, np.zeros_like(x), np.zeros_like(x)

  def update(self, g, state, x):
    count, mu, nu = state
    count, mu, nu = count + 1, self.b1 * mu + (1 - self.b1) * g, self.b2 * nu + (1 - self.b2) * g**2
    mu_hat, nu_hat = mu / (1 - self.b1**count), nu / (1 - self.b2**count)
    return -LR * (mu_hat / (np.sqrt(nu_hat) + self.eps) + WEIGHT_DECAY * x), (count, mu, nu)


class Nesterov:  # optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
  def init(self, x):
    return np.zeros_like(x)

  def update(self, g, trace, x):
    trace = g + OUTER_MOMENTUM * trace
    return -OUTER_LR * (g + OUTER_MOMENTUM * trace), trace


def reference(algorithm, nested, grads, x0):
  """Params of every worker after each step; ``grads[t, h, d]``, workers on a hosts x gpus grid."""
  steps, hosts, gpus = grads.shape[:3]
  inner = AdamW()
  x = np.broadcast_to(x0, (hosts, gpus, *x0.shape)).copy()
  states = [[inner.init(x0) for _ in range(gpus)] for _ in range(hosts)]
  center, outer, outer_state = x0.copy(), Nesterov(), Nesterov().init(x0)
  accum, center_state = np.zeros_like(x), inner.init(x0)
  history = []
  for t in range(steps):
    g = grads[t]
    if nested:  # the tower's mean within each host
      g = np.broadcast_to(g.mean(axis=1, keepdims=True), g.shape)
    for h in range(hosts):
      for d in range(gpus):
        u, states[h][d] = inner.update(g[h, d], states[h][d], x[h, d])
        x[h, d] = x[h, d] + u
    accum += g
    if (t + 1) % PERIOD == 0 and algorithm.startswith("agn"):
      commits = (accum[:, 0] if nested else accum.reshape(-1, *x0.shape)) / PERIOD
      for commit in (commits.mean(axis=0),) if algorithm == "agn_mean" else commits:
        u, center_state = inner.update(commit, center_state, center)
        center = center + u
      x[...], accum[...] = center, 0
    elif (t + 1) % PERIOD == 0:
      # Nested: the gpus of a host hold identical params; average over hosts only.
      workers = x[:, 0] if nested else x.reshape(-1, *x0.shape)
      if algorithm == "diloco":
        delta = np.mean([center - w for w in workers], axis=0)
        o, outer_state = outer.update(delta, outer_state, center)
        center = center + o
        x[...] = center
      elif algorithm == "local_sgd":
        x[...] = np.mean(workers, axis=0)
      else:  # elastic_average: d_i = a (x_i - center); center += sum_i d_i
        d = MOVING_RATE * (workers - center)
        center = center + d.sum(axis=0)
        if nested:
          x -= d[:, None]
        else:
          x -= d.reshape(x.shape)
    history.append(x.copy())
  return np.array(history)


# ----------------------------------------------------------------------------------------------
# The library under shard_map.


def build(algorithm, nested, slice_axis=None):
  inner = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
  if nested:
    inner, axis_name = optax_dist.tower(inner, "gpus"), "hosts"
  else:
    axis_name = ("hosts", "gpus")
  common = {"axis_name": axis_name, "slice_axis": slice_axis}
  if algorithm == "diloco":
    outer = optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    return optax_dist.diloco(inner, outer, sync_period=PERIOD, **common)
  if algorithm == "streaming_diloco":
    outer = optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    return optax_dist.streaming_diloco(inner, outer, sync_period=PERIOD, num_fragments=1,
                                       **common)
  if algorithm == "local_sgd":
    return optax_dist.local_sgd(inner, sync_period=PERIOD, **common)
  if algorithm.startswith("agn"):
    center_update = "mean" if algorithm == "agn_mean" else "sequential"
    return optax_dist.agn(inner, communication_period=PERIOD, center_update=center_update,
                          **common)
  return optax_dist.elastic_average(inner, communication_period=PERIOD, moving_rate=MOVING_RATE,
                                    **common)


def run(txs, mesh, grads, x0):
  """Trains each of ``txs`` from ``x0`` on ``grads`` (``STEPS x hosts x gpus``) in one compiled
  program: each one's params after every step (shaped as ``grads``) and its final state."""
  axes = ("hosts", "gpus")
  n = mesh.size

  def train(grads, params):  # one worker's: grads (STEPS, 1, ...), params (1, ...)
    def history(tx):
      def step(carry, grad):
        params, state = carry
        updates, state = tx.update(grad, state, params)
        params = optax.apply_updates(params, updates)
        return (params, state), params

      (_, state), steps = jax.lax.scan(step, (params[0], tx.init(params[0])), grads[:, 0])
      return steps[:, None], jax.tree.map(lambda v: v[None], state)

    return [history(tx) for tx in txs]

  f = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=(P(None, axes), P(axes)),
                            out_specs=[(P(None, axes), P(axes))] * len(txs)))
  params = np.broadcast_to(x0, (n, *x0.shape)).astype(np.float32)
  put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
  flat = grads.reshape(grads.shape[0], n, *x0.shape).astype(np.float32)
  return [(np.asarray(steps).reshape(grads.shape), state)
          for steps, state in f(put(flat, P(None, axes)), put(params, P(axes)))]


ALGORITHMS = ["diloco", "local_sgd", "elastic_average", "agn", "agn_mean"]


@functools.cache
def mesh_runs(shape):
  """Every (algorithm, nested) case on a ``shape`` mesh, trained in one program: the case's
  ``run`` and the gradients and start it was trained on."""
  mesh = jax.make_mesh(shape, ("hosts", "gpus"))
  rng = np.random.default_rng(sum(shape))
  grads = rng.normal(size=(STEPS, *shape, *SHAPE))
  x0 = rng.normal(size=SHAPE)
  cases = [(a, nested) for a in ALGORITHMS for nested in (True, False)]
  got = run([build(a, nested) for a, nested in cases], mesh, grads, x0)
  return dict(zip(cases, got)), grads, x0


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_hierarchical_mesh_matches_numpy(shape, algorithm, nested):
  runs, grads, x0 = mesh_runs(shape)
  got, state = runs[algorithm, nested]
  want = reference(algorithm, nested, grads, x0)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
  # The global state is identical on every device.
  averaged = {"diloco": "anchor", "elastic_average": "center", "agn": "center",
              "agn_mean": "center"}.get(algorithm)
  if averaged:
    values = np.asarray(getattr(state, averaged))
    np.testing.assert_array_equal(values, np.broadcast_to(values[0], values.shape))


SLICED = ["diloco", "streaming_diloco", "local_sgd", "elastic_average", "agn", "agn_mean"]


@functools.cache
def sliced_runs():
  """Every algorithm of :data:`SLICED` nested on a 2x4 mesh, with ``slice_axis="gpus"`` and
  without, trained in one program: ``(sliced, unsliced)`` runs by algorithm, the gradients, the
  start and the mesh."""
  mesh = jax.make_mesh((2, 4), ("hosts", "gpus"))
  rng = np.random.default_rng(11)
  grads = rng.normal(size=(STEPS, 2, 4, *SHAPE))
  x0 = rng.normal(size=SHAPE)
  got = run([build(a, True, slice_axis=s) for a in SLICED for s in ("gpus", None)], mesh, grads,
            x0)
  return {a: (got[2 * i], got[2 * i + 1]) for i, a in enumerate(SLICED)}, grads, x0, mesh


@pytest.mark.parametrize("algorithm", SLICED)
def test_sliced_exchange_matches_numpy_and_sends_each_byte_once(algorithm):
  """slice_axis="gpus": the devices of a host hold identical params after the tower, so each
  sends 1/K of them across the hosts and gathers the rest inside the host; the values are the
  nested layout's (streaming_diloco with one fragment is diloco)."""
  runs, grads, x0, mesh = sliced_runs()
  (got, state), (unsliced, _) = runs[algorithm]
  np.testing.assert_allclose(got, unsliced, rtol=1e-6, atol=1e-7)
  reference_algorithm = "diloco" if algorithm == "streaming_diloco" else algorithm
  np.testing.assert_allclose(got, reference(reference_algorithm, True, grads, x0), rtol=2e-5,
                             atol=5e-6)
  # The exchange's conditional: 6 values, in slices of ceil(6 / 4) = 2 float32 per device
  # across the hosts, gathered back (8 bytes sent, 32 received) inside the host. agn's devices
  # accumulate their own gradients: a reduce-scatter (32 bytes in, 8 out) gives each its slice of
  # the host's mean; its sequential commits gather both hosts' slices (8 sent, 16 received)
  # across, then the two slices of every device inside the host (16 sent, 64 received).
  spec = P(("hosts", "gpus"))
  tx = build(algorithm, True, slice_axis="gpus")

  def step(grad, state, params):
    grad, state, params = jax.tree.map(lambda v: v[0], (grad, state, params))
    updates, state = tx.update(grad, state, params, communicate=True)
    return jax.tree.map(lambda v: v[None], (optax.apply_updates(params, updates), state))

  put = lambda v: jax.device_put(np.asarray(v, np.float32), NamedSharding(mesh, spec))
  params = put(np.broadcast_to(x0, (8, *SHAPE)))
  report = optax_dist.communication_report(
    jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec), put(grads[0].reshape(8, *SHAPE)),
    state, params)
  gathers = sorted((c.bytes, c.result_bytes) for c in report.collectives.of_kind("all-gather"))
  reduces = sorted(c.bytes for c in report.collectives.of_kind("all-reduce"))
  scatters = [c.bytes for c in report.collectives.of_kind("reduce-scatter")]
  if algorithm.startswith("agn"):  # the tower's 6 gradients twice (the center's step too),
    tower = sum(reduces) - (8 if algorithm == "agn_mean" else 0)  # which XLA may combine
    exchange = [(8, 16), (16, 64)] if algorithm == "agn" else [(8, 32)]
    assert (gathers, tower, scatters) == (exchange, 48, [32]), (gathers, reduces, scatters)
  else:  # the tower's all-reduce of the 6 gradients and the exchange's 2 values per device
    assert (gathers, reduces, scatters) == ([(8, 32)], [8, 24], [])


def test_slice_axis_must_be_inside_the_worker_and_bound():
  with pytest.raises(ValueError, match=r"`diloco\(slice_axis='hosts'\)` must be an axis inside"):
    tx = optax_dist.diloco(optax.sgd(1.0), sync_period=2, axis_name="hosts", slice_axis="hosts")
    jax.vmap(tx.update, axis_name="hosts")(jnp.ones((2, 3)), jax.vmap(tx.init)(jnp.ones((2, 3))),
                                           jnp.ones((2, 3)))
  tx = optax_dist.diloco(optax.sgd(1.0), sync_period=2, axis_name="hosts", slice_axis="gpu")
  with pytest.raises(ValueError, match=r"`diloco\(slice_axis='gpu'\)`: `update` was called where"):
    jax.vmap(tx.update, axis_name="hosts")(jnp.ones((2, 3)), jax.vmap(tx.init)(jnp.ones((2, 3))),
                                           jnp.ones((2, 3)))
