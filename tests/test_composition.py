"""Each transformation inside optax.MultiSteps and optax.chain, against NumPy references.

Two workers are emulated with ``vmap(axis_name="w")``. The gradients are fixed in advance (they
do not depend on the params), so a NumPy simulation of every worker gives the exact trajectory
of the params and of the average ``eval_params`` returns, step by step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist

N = 2  # workers
LR, MOMENTUM = 0.1, 0.5
DECAY = 0.7  # moving_average
PERIOD, ALPHA = 2, 0.25  # elastic_average, agn
MAX_STALENESS = 1
MAX_NORM, WEIGHT_DECAY = 1.0, 0.05
K = 3  # MultiSteps(every_k_schedule=K)

SIZES = {"b": 2, "w": 3}  # params {"b": (2,), "w": (3,)}, flattened to 5 numbers in NumPy
D = sum(SIZES.values())


def _to_tree(v):
  return {"b": v[..., :2], "w": v[..., 2:]}


def _to_flat(tree):
  return jnp.concatenate([tree["b"], tree["w"]], axis=-1)


def _inner():
  return optax.sgd(LR, momentum=MOMENTUM)


TRANSFORMATIONS = {
  "moving_average": lambda: optax_dist.moving_average(_inner(), decay=DECAY),
  "elastic_average": lambda: optax_dist.elastic_average(
    _inner(), communication_period=PERIOD, moving_rate=ALPHA, axis_name="w"
  ),
  "agn": lambda: optax_dist.agn(_inner(), communication_period=PERIOD, axis_name="w"),
  "drop_stale_gradients": lambda: optax_dist.drop_stale_gradients(_inner(), MAX_STALENESS),
  "tower": lambda: optax_dist.tower(_inner(), "w"),
}


# ----------------------------------------------------------------------------------------------
# NumPy references: every worker at once, arrays of shape (N, D), float64.


class _Sgd:
  """``optax.sgd(LR, momentum=MOMENTUM)``: trace = g + m trace; u = -lr trace."""

  def __init__(self, shape):
    self.trace = np.zeros(shape)

  def __call__(self, g):
    self.trace = g + MOMENTUM * self.trace
    return -LR * self.trace


class _MovingAverage:
  def __init__(self, x0):
    self.sgd, self.ema = _Sgd(x0.shape), x0.copy()

  def step(self, g, x, grad_step):
    u = self.sgd(g)
    self.ema = DECAY * self.ema + (1 - DECAY) * (x + u)
    return u

  def average(self, x):
    return self.ema


class _ElasticAverage:
  def __init__(self, x0):
    self.sgd, self.center, self.t = _Sgd(x0.shape), x0[0].copy(), 0

  def step(self, g, x, grad_step):
    u = self.sgd(g)
    self.t += 1
    if self.t % PERIOD == 0:
      moved = x + u
      d = ALPHA * (moved - self.center)
      self.center = self.center + d.sum(0)
      u = moved - d - x
    return u

  def average(self, x):
    return np.broadcast_to(self.center, x.shape)


class _Agn:
  def __init__(self, x0):
    self.sgd, self.center_sgd = _Sgd(x0.shape), _Sgd(x0.shape[1:])
    self.center, self.accum, self.t = x0[0].copy(), np.zeros_like(x0), 0

  def step(self, g, x, grad_step):
    u = self.sgd(g)
    self.accum = self.accum + g
    self.t += 1
    if self.t % PERIOD == 0:
      for j in range(N):  # "sequential": one inner step per worker's commit, in axis order
        self.center = self.center + self.center_sgd(self.accum[j] / PERIOD)
      u = self.center - x
      self.accum = np.zeros_like(self.accum)
    return u

  def average(self, x):
    return np.broadcast_to(self.center, x.shape)


class _DropStaleGradients:
  def __init__(self, x0):
    self.sgd, self.global_step, self.num_dropped = _Sgd(x0.shape), 0, 0

  def step(self, g, x, grad_step):
    if self.global_step - grad_step > MAX_STALENESS:
      self.num_dropped += 1
      return np.zeros_like(g)
    self.global_step += 1
    return self.sgd(g)

  def average(self, x):
    return x


class _Tower:
  def __init__(self, x0):
    self.sgd = _Sgd(x0.shape[1:])

  def step(self, g, x, grad_step):
    return np.broadcast_to(self.sgd(g.mean(0)), g.shape)

  def average(self, x):
    return x


REFERENCES = {
  "moving_average": _MovingAverage,
  "elastic_average": _ElasticAverage,
  "agn": _Agn,
  "drop_stale_gradients": _DropStaleGradients,
  "tower": _Tower,
}


def _clip(v):
  """``optax.clip_by_global_norm(MAX_NORM)`` of each worker's updates."""
  norm = np.linalg.norm(v, axis=-1, keepdims=True)
  return np.where(norm < MAX_NORM, v, v / np.maximum(norm, MAX_NORM) * MAX_NORM)


def _decay(v, x):
  """``optax.add_decayed_weights(WEIGHT_DECAY)``."""
  return v + WEIGHT_DECAY * x


def _numpy_run(name, layout, x0, grads, grad_steps):
  """Per-step params and averages, (T, N, D) each, of ``layout`` around ``name``; the model."""
  x = np.tile(x0.astype(np.float64), (N, 1))
  ref = REFERENCES[name](x)
  xs, avgs = [], []
  acc = np.zeros_like(x)
  for t, (g, gs) in enumerate(zip(grads.astype(np.float64), grad_steps, strict=True)):
    if layout == "before":  # chain(clip, add_decayed_weights, T)
      u = ref.step(_decay(_clip(g), x), x, gs)
    elif layout == "after":  # chain(T, clip, add_decayed_weights)
      u = _decay(_clip(ref.step(g, x, gs)), x)
    else:  # MultiSteps(T, K): T steps once on the mean of every K gradients
      acc = acc + g
      if (t + 1) % K:
        u = np.zeros_like(x)
      else:
        u, acc = ref.step(acc / K, x, gs), np.zeros_like(acc)
    x = x + u
    xs.append(x)
    avgs.append(np.array(ref.average(x)))
  return np.stack(xs), np.stack(avgs), ref


# ----------------------------------------------------------------------------------------------
# The optax runs.


def _compose(name, layout):
  tx = TRANSFORMATIONS[name]()
  if layout == "before":
    return optax.chain(optax.clip_by_global_norm(MAX_NORM),
                       optax.add_decayed_weights(WEIGHT_DECAY), tx)
  if layout == "after":
    return optax.chain(tx, optax.clip_by_global_norm(MAX_NORM),
                       optax.add_decayed_weights(WEIGHT_DECAY))
  return optax.MultiSteps(tx, every_k_schedule=K)


def _optax_run(tx, x0, grads, grad_steps, extra_args):
  """Per-step params and ``eval_params``, (T, N, D) each, every worker under ``vmap``."""

  def worker(grads):
    params = _to_tree(jnp.asarray(x0))
    state = tx.init(params)

    def step(carry, inp):
      params, state = carry
      g, gs = inp
      extra = {"grad_step": gs} if extra_args else {}
      updates, state = tx.update(_to_tree(g), state, params, **extra)
      params = optax.apply_updates(params, updates)
      return (params, state), (_to_flat(params), _to_flat(optax_dist.eval_params(state, params)))

    return jax.lax.scan(step, (params, state), (grads, grad_steps))[1]

  xs, avgs = jax.jit(jax.vmap(worker, in_axes=1, out_axes=1, axis_name="w"))(grads)
  return np.asarray(xs), np.asarray(avgs)


def _data(steps, rate=2):
  rng = np.random.default_rng(0)
  x0 = rng.normal(size=(D,)).astype(np.float32)
  # Gradient norms around 0.2 to 4: clipped on some steps and not on others.
  scale = rng.choice([0.1, 0.5, 2.0], size=(steps, N, 1))
  grads = (scale * rng.normal(size=(steps, N, D))).astype(np.float32)
  # The global step each gradient was computed against: some stale by more than MAX_STALENESS.
  grad_steps = np.maximum(np.arange(steps) // rate - rng.integers(0, 3, size=steps), 0)
  return x0, grads, grad_steps.astype(np.int32)


@pytest.mark.parametrize("layout", ["before", "after", "multisteps"])
@pytest.mark.parametrize("name", list(TRANSFORMATIONS))
def test_composition_matches_numpy(name, layout):
  steps = 4 * K if layout == "multisteps" else 6
  x0, grads, grad_steps = _data(steps, K if layout == "multisteps" else 2)
  extra_args = name == "drop_stale_gradients"
  xs, avgs = _optax_run(_compose(name, layout), x0, grads, grad_steps, extra_args)
  xs_ref, avgs_ref, ref = _numpy_run(name, layout, x0, grads, grad_steps)
  if extra_args:  # the data exercise both outcomes: some updates dropped, some accepted
    assert ref.num_dropped > 0 and ref.global_step > 0
  np.testing.assert_allclose(xs, xs_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(avgs, avgs_ref, rtol=1e-5, atol=1e-6)
  if layout == "multisteps":  # params move only on every K-th step (where not dropped)
    moved = np.any(np.diff(xs, axis=0, prepend=np.broadcast_to(x0, (1, N, D))) != 0, axis=(1, 2))
    assert moved.any() and not moved[(np.arange(steps) + 1) % K != 0].any()


def _numpy_ema(trajectory, x0):
  ema, out = x0.astype(np.float64), []
  for x in trajectory:
    ema = DECAY * ema + (1 - DECAY) * x
    out.append(ema)
  return np.stack(out)


def test_moving_average_outermost_averages_the_actual_params():
  # moving_average(chain(clip, decay, sgd)) and chain(clip, decay, moving_average(sgd)) train like
  # chain(clip, decay, sgd) alone and average the params they produce; with clipping placed
  # after moving_average, the average tracks params that are never applied.
  steps = 6
  x0, grads, grad_steps = _data(steps)

  def pre(inner):
    return optax.chain(
      optax.clip_by_global_norm(MAX_NORM), optax.add_decayed_weights(WEIGHT_DECAY), inner
    )

  plain, _ = _optax_run(pre(_inner()), x0, grads, grad_steps, False)
  expected_ema = _numpy_ema(plain, x0)
  for tx in (optax_dist.moving_average(pre(_inner()), DECAY),
             pre(optax_dist.moving_average(_inner(), DECAY))):
    xs, ema = _optax_run(tx, x0, grads, grad_steps, False)
    np.testing.assert_allclose(xs, plain, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ema, expected_ema, rtol=1e-5, atol=1e-6)

  xs, ema = _optax_run(_compose("moving_average", "after"), x0, grads, grad_steps, False)
  assert not np.allclose(ema, _numpy_ema(xs, x0), rtol=1e-3)
