"""Flax: every transformation under Linen's TrainState and nnx.Optimizer, single and per worker."""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist
import optax_dist.flax

STEPS = 5
B, D_IN, D_OUT = 4, 3, 2


def _inner():
  return optax.sgd(0.1, momentum=0.9)


TRANSFORMATIONS = {
  "moving_average": lambda: optax_dist.moving_average(_inner(), decay=0.8),
  "elastic_average": lambda: optax_dist.elastic_average(
    _inner(), communication_period=2, moving_rate=0.3, rho=0.5
  ),
  "agn": lambda: optax_dist.agn(_inner(), communication_period=2),
  "drop_stale_gradients": lambda: optax_dist.drop_stale_gradients(_inner(), max_staleness=1),
  "tower": lambda: optax_dist.tower(_inner(), None),  # one tower: passes through
  "apply_if_finite": lambda: optax_dist.apply_if_finite(
    optax_dist.moving_average(_inner(), decay=0.8), 2
  ),
}
# The global step each gradient was computed against; with max_staleness=1 the third and fourth
# (staleness 2) are dropped and the others accepted.
GRAD_STEPS = np.array([0, 0, 0, 0, 2], np.int32)


def _data(seed=0, steps=STEPS, lead=()):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(steps, *lead, B, D_IN)).astype(np.float32)
  y = rng.normal(size=(steps, *lead, B, D_OUT)).astype(np.float32)
  return x, y


def _assert_close(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


def test_flax_is_imported_only_by_the_flax_module():
  # `import optax_dist` must work without Flax installed: no other module imports it at module
  # level (imports inside functions are lazy).
  package = pathlib.Path(optax_dist.__file__).parent
  for path in package.glob("*.py"):
    if path.name == "flax.py":
      continue
    for node in ast.parse(path.read_text()).body:
      names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
      if isinstance(node, ast.ImportFrom) and node.level == 0:
        names = [node.module or ""]
      assert not any(n == "flax" or n.startswith("flax.") for n in names), path.name


# ----------------------------------------------------------------------------------------------
# Linen TrainState.

_MODEL = nn.Dense(D_OUT)


@jax.jit
def _linen_init(x):
  return _MODEL.init(jax.random.key(0), x)


def _linen_loss(params, x, y):
  return jnp.mean((_MODEL.apply(params, x) - y) ** 2)


def _linen_runs(tx, params, xs, ys, grad_steps=None):
  """Trains from ``params`` three ways in one compiled program; returns the three end states.

  The reference is ``tx.update`` and ``optax.apply_updates`` by hand; then Flax's ``TrainState``
  (without extra args) and ``optax_dist.flax.TrainState`` (with ``grad_step=`` if given).
  """
  steps = np.zeros(len(xs), np.int32) if grad_steps is None else grad_steps
  extra = (lambda gs: {}) if grad_steps is None else (lambda gs: {"grad_step": gs})

  @jax.jit
  def run(params, xs, ys, steps):
    def plain(carry, batch):
      params, state = carry
      x, y, gs = batch
      grads = jax.grad(_linen_loss)(params, x, y)
      updates, state = tx.update(grads, state, params, **extra(gs))
      return (optax.apply_updates(params, updates), state), None

    def with_train_state():  # one body per class: no trace cached for one serves the other
      def body(state, batch):
        x, y, gs = batch
        grads = jax.grad(_linen_loss)(state.params, x, y)
        kwargs = extra(gs) if isinstance(state, optax_dist.flax.TrainState) else {}
        return state.apply_gradients(grads=grads, **kwargs), None

      return body

    ref = jax.lax.scan(plain, (params, tx.init(params)), (xs, ys, steps))[0]
    states = [
      jax.lax.scan(
        with_train_state(), cls.create(apply_fn=_MODEL.apply, params=params, tx=tx),
        (xs, ys, steps),
      )[0]
      for cls in (train_state.TrainState, optax_dist.flax.TrainState)
    ]
    return ref, states

  return run(params, xs, ys, steps)


@pytest.mark.parametrize("name", list(TRANSFORMATIONS))
def test_linen_train_state_equals_plain_loop(name):
  xs, ys = _data()
  params = _linen_init(xs[0])
  (ref_params, ref_state), (flax_state, ours) = _linen_runs(TRANSFORMATIONS[name](), params, xs, ys)
  for state in (flax_state, ours):
    assert int(state.step) == STEPS
    _assert_close(state.params, ref_params)
    _assert_close(state.opt_state, ref_state)
  _assert_close(ours.eval_params(), optax_dist.eval_params(ref_state, ref_params))
  if name not in ("drop_stale_gradients", "tower"):  # these keep no average
    assert not np.allclose(ours.eval_params()["params"]["kernel"], ours.params["params"]["kernel"])


def test_train_state_forwards_grad_step():
  xs, ys = _data()
  params = _linen_init(xs[0])
  tx = TRANSFORMATIONS["drop_stale_gradients"]()
  (ref_params, ref_state), (_, state) = _linen_runs(tx, params, xs, ys, GRAD_STEPS)
  assert int(state.step) == STEPS  # every call, accepted or not
  np.testing.assert_array_equal(state.opt_state.num_dropped, 2)
  np.testing.assert_array_equal(state.opt_state.global_step, 3)
  _assert_close(state.params, ref_params)
  _assert_close(state.opt_state, ref_state)


def test_train_state_replaces_fields_and_forwards_the_rest():
  class BatchNormState(optax_dist.flax.TrainState):
    batch_stats: Any = None

  seen = {}

  def update(updates, state, params=None, **extra_args):
    seen.update(extra_args)
    return updates, state

  tx = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
  state = BatchNormState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx, batch_stats=0)
  state = state.apply_gradients(grads={"w": jnp.ones(2)}, batch_stats=7, grad_step=3)
  assert state.batch_stats == 7 and seen == {"grad_step": 3}
  np.testing.assert_array_equal(state.params["w"], [2.0, 2.0])
  assert {f.name for f in dataclasses.fields(state)} >= {"batch_stats", "step", "params"}


# ----------------------------------------------------------------------------------------------
# NNX Optimizer.


def _nnx_plain_loss(params, x, y):
  return jnp.mean((x @ params["kernel"] + params["bias"] - y) ** 2)


@pytest.mark.parametrize("name", list(TRANSFORMATIONS))
def test_nnx_optimizer_equals_plain_loop(name):
  xs, ys = _data(seed=1)
  model = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0))
  params = {k: jnp.asarray(v) for k, v in nnx.to_pure_dict(nnx.state(model, nnx.Param)).items()}
  tx = TRANSFORMATIONS[name]()
  use_grad_step = name == "drop_stale_gradients"
  extra = (lambda gs: {"grad_step": gs}) if use_grad_step else (lambda gs: {})
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, nnx_state = nnx.split((model, optimizer))

  @jax.jit
  def run(params, nnx_state, xs, ys, grad_steps):
    def plain(carry, batch):  # the reference: tx.update and optax.apply_updates by hand
      params, state = carry
      x, y, gs = batch
      grads = jax.grad(_nnx_plain_loss)(params, x, y)
      updates, state = tx.update(grads, state, params, **extra(gs))
      return (optax.apply_updates(params, updates), state), None

    def with_optimizer(nnx_state, batch):
      x, y, gs = batch
      model, optimizer = nnx.merge(graphdef, nnx_state)
      grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
      optimizer.update(model, grads, **extra(gs))
      return nnx.split((model, optimizer))[1], None

    ref = jax.lax.scan(plain, (params, tx.init(params)), (xs, ys, grad_steps))[0]
    return ref, jax.lax.scan(with_optimizer, nnx_state, (xs, ys, grad_steps))[0]

  (params, state), nnx_state = run(params, nnx_state, xs, ys, GRAD_STEPS)
  nnx.update((model, optimizer), nnx_state)

  assert int(optimizer.step[...]) == STEPS
  _assert_close({"kernel": model.kernel[...], "bias": model.bias[...]}, params)
  expected = optax_dist.eval_params(state, params)
  got = optax_dist.flax.nnx_eval_params(optimizer, model)
  _assert_close({"kernel": got["kernel"], "bias": got["bias"]}, expected)
  if use_grad_step:
    opt_state = nnx.as_pure(optimizer.opt_state)
    np.testing.assert_array_equal(opt_state.num_dropped, 2)
    np.testing.assert_array_equal(opt_state.global_step, 3)
  # The averaged params load back into a copy of the model.
  eval_model = nnx.clone(model)
  nnx.update(eval_model, got)
  np.testing.assert_array_equal(eval_model.kernel[...], expected["kernel"])


# ----------------------------------------------------------------------------------------------
# Per-worker TrainState under shard_map.

N = 4
LR, ALPHA, PERIOD = 0.1, 0.2, 2


def _numpy_easgd(w0, b0, xs, ys):
  """Synchronous EASGD with plain SGD on ``mean((x w + b - y)^2)``, every worker in NumPy."""
  w = np.tile(w0.astype(np.float64), (N, 1, 1))
  b = np.tile(b0.astype(np.float64), (N, 1))
  cw, cb = w0.astype(np.float64), b0.astype(np.float64)
  for t in range(len(xs)):
    for i in range(N):
      r = xs[t, i] @ w[i] + b[i] - ys[t, i]  # residual, (B, 1)
      w[i] -= LR * 2.0 / B * xs[t, i].T @ r
      b[i] -= LR * 2.0 / B * r.sum(0)
    if (t + 1) % PERIOD == 0:
      dw, db = ALPHA * (w - cw), ALPHA * (b - cb)
      w, b = w - dw, b - db
      cw, cb = cw + dw.sum(0), cb + db.sum(0)
  return w, b, cw, cb


def _per_worker(x):
  x = jnp.asarray(x)
  if "w" not in jax.typeof(x).manual_axis_type.varying:
    x = jax.lax.pcast(x, "w", to="varying")
  return x[None]


def test_per_worker_train_state_under_shard_map_elastic_average():
  model = nn.Dense(1)
  rng = np.random.default_rng(2)
  xs = rng.normal(size=(4, N, B, D_IN)).astype(np.float32)
  ys = rng.normal(size=(4, N, B, 1)).astype(np.float32)
  params = jax.jit(lambda x: model.init(jax.random.key(1), x))(xs[0, 0])
  tx = optax_dist.elastic_average(optax.sgd(LR), communication_period=PERIOD,
                                  moving_rate=ALPHA, axis_name="w")
  mesh = Mesh(np.array(jax.devices()[:N]), ("w",))

  def worker(params, xs, ys):
    # Every worker starts from the same params, then trains its own copy.
    params = jax.tree.map(lambda p: jax.lax.pcast(p, "w", to="varying"), params)
    state = optax_dist.flax.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(state, batch):
      x, y = batch

      def loss(p):
        return jnp.mean((state.apply_fn(p, x[0]) - y[0]) ** 2)

      return state.apply_gradients(grads=jax.grad(loss)(state.params)), None

    state, _ = jax.lax.scan(step, state, (xs, ys))
    return jax.tree.map(_per_worker, (state.params, state.eval_params()))

  f = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=(P(), P(None, "w"), P(None, "w")),
                            out_specs=P("w")))

  def put(a, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))

  local, center = f(put(params, P()), put(xs, P(None, "w")), put(ys, P(None, "w")))

  kernel, bias = params["params"]["kernel"], params["params"]["bias"]
  w, b, cw, cb = _numpy_easgd(np.asarray(kernel), np.asarray(bias), xs, ys)
  np.testing.assert_allclose(local["params"]["kernel"], w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(local["params"]["bias"], b, rtol=1e-5, atol=1e-6)
  for leaf, ref in ((center["params"]["kernel"], cw), (center["params"]["bias"], cb)):
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))  # identical
    np.testing.assert_allclose(leaf[0], ref, rtol=1e-5, atol=1e-6)
  assert not np.allclose(local["params"]["kernel"][0], local["params"]["kernel"][1])


# ----------------------------------------------------------------------------------------------
# BatchNorm statistics for the center of elastic_average: synced over workers, re-estimated.

# Training steps, batch size, re-estimation batches per worker (320 of its 350 examples).
BN_STEPS, BN_BATCH, BN_K, BN_MOMENTUM = 40, 32, 10, 0.9


@functools.cache
def _digits():
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def _digits_batches():
  """Each worker's training batches, (steps, N, B, 64), and its K re-estimation batches."""
  (x, y), _ = _digits()
  shards = [np.arange(i, len(x), N) for i in range(N)]  # worker i's training examples
  rng = np.random.default_rng(3)
  idx = np.stack([rng.choice(s, size=(BN_STEPS, BN_BATCH)) for s in shards], axis=1)
  est = np.stack([s[: BN_K * BN_BATCH].reshape(BN_K, BN_BATCH) for s in shards])  # (N, K, B)
  return x[idx], y[idx].astype(np.int32), x[est]


def _easgd():
  return optax_dist.elastic_average(
    optax.sgd(0.1, momentum=0.9), communication_period=4, moving_rate=0.9 / N, axis_name="w"
  )


def _numpy_bn_stats(x, kernel, bias):
  """The mean over all batches of each batch's mean and biased variance of ``x kernel + b``."""
  h = x.astype(np.float64) @ np.asarray(kernel, np.float64) + np.asarray(bias, np.float64)
  h = h.reshape(-1, *h.shape[-2:])  # (batches, B, features)
  return h.mean(1).mean(0), h.var(1).mean(0)


def _scores(logits, y):
  """Accuracy and mean cross-entropy on the test set (in NumPy, float64)."""
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  loss = -np.take_along_axis(log_p, y[:, None], -1).mean()
  return float(np.mean(np.argmax(logits, -1) == y)), float(loss)


class _BNNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    h = nn.Dense(32)(x)
    h = nn.BatchNorm(use_running_average=not train, momentum=BN_MOMENTUM)(h)
    return nn.Dense(10)(nn.relu(h))


class _BNTrainState(optax_dist.flax.TrainState):
  batch_stats: Any = None


def _linen_worker(xs, ys, est, variables):
  """One worker's EASGD run (shard_map body); returns its state, center and statistics."""
  model = _BNNet()
  variables = jax.tree.map(lambda v: jax.lax.pcast(v, "w", to="varying"), variables)
  state = _BNTrainState.create(
    apply_fn=model.apply,
    params=variables["params"],
    tx=_easgd(),
    batch_stats=variables["batch_stats"],
  )

  def step(state, batch):
    x, y = batch

    def loss(params):
      logits, mutated = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats},
        x[0],
        train=True,
        mutable=["batch_stats"],
      )
      return optax.softmax_cross_entropy_with_integer_labels(logits, y[0]).mean(), mutated

    grads, mutated = jax.grad(loss, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=mutated["batch_stats"]), None

  state, _ = jax.lax.scan(step, state, (xs, ys))
  center = state.eval_params()
  estimated = optax_dist.flax.update_bn(
    model.apply,
    {"params": center, "batch_stats": state.batch_stats},
    est[0],
    axis_name="w",
    train=True,
  )
  # The synced statistics keep the carry's varying type: they can replace it in a scan.
  synced, _ = jax.lax.scan(
    lambda s, _: (optax_dist.flax.sync_batch_stats(s, "w"), None), state.batch_stats, length=2
  )
  return jax.tree.map(_per_worker, (state.batch_stats, center, estimated, synced))


@functools.cache
def _linen_bn_run():
  xs, ys, est = _digits_batches()
  variables = jax.jit(lambda x: _BNNet().init(jax.random.key(0), x, train=False))(xs[0, 0])
  mesh = Mesh(np.array(jax.devices()[:N]), ("w",))
  f = jax.jit(
    jax.shard_map(
      _linen_worker, mesh=mesh, in_specs=(P(None, "w"), P(None, "w"), P("w"), P()), out_specs=P("w")
    )
  )
  return jax.device_get(f(xs, ys, est, variables)), est


def _linen_test_scores(center, batch_stats):
  _, (x, y) = _digits()
  return _scores(_linen_eval(center, batch_stats, x), y)


@jax.jit
def _linen_eval(center, batch_stats, x):
  return _BNNet().apply({"params": center, "batch_stats": batch_stats}, x, train=False)


def test_update_bn_matches_numpy_statistics_of_the_center():
  (_, center, estimated, _), est = _linen_bn_run()
  for leaf in jax.tree.leaves((center, estimated)):  # identical on every worker
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
  dense = center["Dense_0"]
  mean, var = _numpy_bn_stats(est, dense["kernel"][0], dense["bias"][0])
  np.testing.assert_allclose(estimated["BatchNorm_0"]["mean"][0], mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(estimated["BatchNorm_0"]["var"][0], var, rtol=1e-5, atol=1e-6)


def test_sync_batch_stats_is_the_mean_over_workers():
  (workers, _, _, synced), _ = _linen_bn_run()
  assert not np.allclose(workers["BatchNorm_0"]["mean"][0], workers["BatchNorm_0"]["mean"][1])
  for got, per_worker in zip(jax.tree.leaves(synced), jax.tree.leaves(workers), strict=True):
    expected = np.broadcast_to(per_worker.mean(0), per_worker.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_update_bn_evaluates_the_center_at_least_as_well_as_worker_0():
  (workers, center, estimated, synced), _ = _linen_bn_run()
  first = functools.partial(jax.tree.map, lambda leaf: leaf[0])
  own = _linen_test_scores(first(center), first(workers))
  reestimated = _linen_test_scores(first(center), first(estimated))
  averaged = _linen_test_scores(first(center), first(synced))
  print(
    f"center: (accuracy, loss) with worker 0's stats {own}, synced {averaged},"
    f" re-estimated {reestimated}"
  )
  assert reestimated[0] >= own[0] and reestimated[1] < own[1]


def test_update_bn_keeps_other_leaves_and_checks_its_arguments():
  class SpectralBN(nn.Module):  # SpectralNorm also keeps its state in "batch_stats"
    @nn.compact
    def __call__(self, x, train: bool):
      h = nn.SpectralNorm(nn.Dense(3))(x, update_stats=train)
      return nn.BatchNorm(use_running_average=not train)(h)

  model, x = SpectralBN(), np.arange(12.0, dtype=np.float32).reshape(1, 4, 3)
  variables = jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))(x[0])
  stats = jax.jit(lambda v, x: optax_dist.flax.update_bn(model.apply, v, x, train=True))(
    variables, x)
  _assert_close(stats["SpectralNorm_0"], variables["batch_stats"]["SpectralNorm_0"])
  with pytest.raises(ValueError, match=r"update_bn.*use_running_average=True.*train=True"):
    optax_dist.flax.update_bn(model.apply, variables, x, train=False)
  with pytest.raises(ValueError, match=r"update_bn\(variables=...\).*'batch_stats'"):
    optax_dist.flax.update_bn(model.apply, {"params": variables["params"]}, x, train=True)
  with pytest.raises(ValueError, match=r"update_bn\(batches=...\)"):
    optax_dist.flax.update_bn(model.apply, variables, x[:0], train=True)
  with pytest.raises(ValueError, match=r"update_bn\(axis_name='w'\).*not bound"):
    optax_dist.flax.update_bn(model.apply, variables, x, axis_name="w", train=True)
  with pytest.raises(ValueError, match=r"sync_batch_stats\(axis_name='w'\).*not bound"):
    optax_dist.flax.sync_batch_stats(variables["batch_stats"], "w")
  with pytest.raises(ValueError, match=r"nnx_update_bn\(model=...\).*no nnx.BatchNorm"):
    optax_dist.flax.nnx_update_bn(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), x)
  # Integer leaves are not averaged.
  stats = {"mean": np.array([0.0, 2.0], np.float32), "count": np.array([1, 4], np.int32)}
  synced = jax.jit(jax.vmap(lambda s: optax_dist.flax.sync_batch_stats(s, "w"), axis_name="w"))(
    stats)
  np.testing.assert_array_equal(synced["mean"], [1.0, 1.0])
  np.testing.assert_array_equal(synced["count"], [1, 4])


# NNX: the same run with nnx.Optimizer, workers under jax.vmap.


class _NNXBNNet(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(64, 32, rngs=rngs)
    self.bn = nnx.BatchNorm(32, momentum=BN_MOMENTUM, rngs=rngs)
    self.out = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.bn(self.dense(x))))


@functools.cache
def _nnx_bn_run():
  xs, ys, est = _digits_batches()
  model = _NNXBNNet(nnx.Rngs(0))
  graphdef, state = nnx.split((model, nnx.Optimizer(model, _easgd(), wrt=nnx.Param)))

  def worker(state, xs, ys, est):
    def step(state, batch):
      x, y = batch
      model, optimizer = nnx.merge(graphdef, state)
      grads = nnx.grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(
        model
      )
      optimizer.update(model, grads)
      return nnx.split((model, optimizer))[1], None

    state, _ = jax.lax.scan(step, state, (xs, ys))
    model, optimizer = nnx.merge(graphdef, state)
    center = nnx.clone(model)
    nnx.update(center, optax_dist.flax.nnx_eval_params(optimizer, model))
    estimated = optax_dist.flax.nnx_update_bn(center, est, axis_name="w")
    synced = optax_dist.flax.sync_batch_stats(nnx.as_pure(nnx.state(model, nnx.BatchStat)), "w")
    return nnx.as_pure(nnx.state(model)), nnx.as_pure(nnx.state(center)), estimated, synced

  states = jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *jnp.shape(x))), state)
  f = jax.jit(jax.vmap(worker, in_axes=(0, 1, 1, 0), axis_name="w"))
  return jax.device_get(f(states, xs, ys, est)), est, graphdef


def test_nnx_update_bn_matches_numpy_and_evaluates_at_least_as_well():
  (workers, center, estimated, synced), est, _ = _nnx_bn_run()
  mean, var = _numpy_bn_stats(est, center["dense"]["kernel"][0], center["dense"]["bias"][0])
  np.testing.assert_allclose(estimated["bn"]["mean"][1], mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(estimated["bn"]["var"][1], var, rtol=1e-5, atol=1e-6)
  for name in ("mean", "var"):
    per_worker = workers["bn"][name]
    np.testing.assert_allclose(
      synced["bn"][name],
      np.broadcast_to(per_worker.mean(0), per_worker.shape),
      rtol=1e-6,
      atol=1e-7,
    )

  _, (x, y) = _digits()
  model = _NNXBNNet(nnx.Rngs(0))
  nnx.update(model, jax.tree.map(lambda leaf: leaf[0], center))
  model.bn.use_running_average = True
  forward = nnx.jit(lambda model, x: model(x))
  own = _scores(forward(model, x), y)
  nnx.update(model, jax.tree.map(lambda leaf: leaf[0], estimated))
  reestimated = _scores(forward(model, x), y)
  print(f"NNX center: (accuracy, loss) with worker 0's stats {own}, re-estimated {reestimated}")
  assert reestimated[0] >= own[0] and reestimated[1] < own[1]
