"""Data-parallel training of a small MLP on scikit-learn's ``digits`` with each algorithm.

The program behind ``optax-dist train`` and ``optax-dist compare``. Every worker is one device
of a 1-D mesh with axis ``"workers"``; its params, optimizer state and shard of the training set
live on that device, and one jitted ``jax.shard_map`` step trains all of them:

* ``sync``: ``tower(adam, "workers")``, the gradients all-reduced on every step;
* ``elastic_average``: ``elastic_average(adam, communication_period=τ, moving_rate=α)`` (EASGD,
  α = 0.9 / N by default: :func:`default_moving_rate`);
* ``agn``: ``agn(adam, communication_period=τ)``;
* ``moving_average``: ``moving_average(tower(adam, "workers"), decay, use_num_updates=True)``,
  evaluated on the EMA;
* ``drop_stale_gradients``: ``drop_stale_gradients(tower(adam, "workers"), max_staleness)``,
  where on each step all workers compute their gradients at the params of a random number of
  accepted steps ago (0 to ``max_staleness + 1``, the same for every worker); the gradients
  staler than ``max_staleness`` are dropped.

The minibatch indices and the delays are drawn on the host with NumPy from ``seed`` and passed to
the step, so the step is compiled once and a run is reproducible from its seed.

Needs the ``examples`` extra (flax, scikit-learn); matplotlib only for :func:`plot`. The caller
must have made enough devices available (``jax.config.update("jax_num_cpu_devices", N)``) before
JAX initialised.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

ALGORITHMS = ("sync", "elastic_average", "agn", "moving_average", "drop_stale_gradients")
"""Every algorithm ``optax-dist train`` runs."""

COMPARED = ("sync", "elastic_average", "agn", "moving_average")
"""The algorithms ``optax-dist compare`` runs, in this order."""

PERIODIC = ("elastic_average", "agn")
"""The algorithms that communicate every ``communication_period`` steps (the others: every step)."""

AXIS = "workers"

DEFAULTS = {
  "devices": 8,
  "steps": 200,
  "batch_size": 16,
  "learning_rate": 1e-2,
  "communication_period": 10,
  "decay": 0.99,
  "max_staleness": 2,
  "eval_every": 10,
  "seed": 0,
}
"""The defaults of the command line."""


def communication_rounds(algorithm: str, steps: int, communication_period: int) -> int:
  """The number of the first ``steps`` steps on which ``algorithm`` communicates.

  ``elastic_average`` and ``agn`` exchange with the center on every ``communication_period``-th
  step; the others all-reduce the gradients on every step.
  """
  return steps // communication_period if algorithm in PERIODIC else steps


def default_moving_rate(devices: int) -> float:
  """EASGD's α here: ``0.9 / devices``, the paper's β = Nα = 0.9 exchanged once per round.

  TF's default also divides by the period (``0.9 / τ / N``, :func:`optax_dist.elastic_average`'s
  default); with τ = 10 and 8 workers that coupling is so weak that the workers, each fitting its
  own 1/8 of a small training set, drift apart and the center stays near 0.92 test accuracy.
  """
  return 0.9 / devices


def load_data(seed: int, test_fraction: float = 0.25) -> dict[str, np.ndarray]:
  """``digits`` (1797 8x8 images, 10 classes), split by ``seed`` (stratified) and standardized.

  The features are standardized with the training set's mean and standard deviation (constant
  pixels are left centred). Returns ``x_train``, ``y_train``, ``x_test``, ``y_test`` as float32
  and int32 arrays.
  """
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  x, y = load_digits(return_X_y=True)
  x_train, x_test, y_train, y_test = train_test_split(
    x, y, test_size=test_fraction, random_state=seed, stratify=y
  )
  mean = x_train.mean(axis=0)
  std = x_train.std(axis=0)
  std[std == 0] = 1.0
  return {
    "x_train": ((x_train - mean) / std).astype(np.float32),
    "y_train": y_train.astype(np.int32),
    "x_test": ((x_test - mean) / std).astype(np.float32),
    "y_test": y_test.astype(np.int32),
  }


def make_model(hidden: tuple[int, ...] = (64, 64), num_classes: int = 10) -> Any:
  """A Flax Linen MLP: ``Dense -> relu`` for each width in ``hidden``, then ``Dense(classes)``."""
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for width in hidden:
        x = nn.relu(nn.Dense(width)(x))
      return nn.Dense(num_classes)(x)

  return MLP()


def make_optimizer(
  algorithm: str,
  *,
  learning_rate: float,
  communication_period: int,
  moving_rate: float,
  decay: float,
  max_staleness: int,
) -> Any:
  """The per-worker optax transformation of ``algorithm``, communicating over axis ``"workers"``."""
  import optax

  import optax_dist

  adam = optax.adam(learning_rate)
  if algorithm == "sync":
    return optax_dist.tower(adam, AXIS)
  if algorithm == "elastic_average":
    return optax_dist.elastic_average(
      adam,
      communication_period=communication_period,
      moving_rate=moving_rate,
      axis_name=AXIS,
    )
  if algorithm == "agn":
    return optax_dist.agn(adam, communication_period=communication_period, axis_name=AXIS)
  if algorithm == "moving_average":
    return optax_dist.moving_average(
      optax_dist.tower(adam, AXIS), decay, use_num_updates=True
    )
  if algorithm == "drop_stale_gradients":
    return optax_dist.drop_stale_gradients(optax_dist.tower(adam, AXIS), max_staleness)
  raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}.")


@functools.cache
def initial_params(seed: int, num_features: int) -> Any:
  """The MLP's initial params for ``seed``, as NumPy arrays (computed once per process)."""
  import jax
  import jax.numpy as jnp

  model = make_model()
  # The RBG generator compiles faster on CPU than the default threefry.
  init = jax.jit(lambda key: model.init(key, jnp.zeros((1, num_features)))["params"])
  return jax.device_get(init(jax.random.key(seed, impl="rbg")))


def _minibatches(seed: int, devices: int, n_local: int, batch_size: int) -> Any:
  """Yields ``(devices, batch_size)`` int32 indices into each worker's shard, forever.

  Every epoch, each worker takes a fresh permutation of its shard (drawn from
  ``(seed, worker, epoch)``) and walks through it ``batch_size`` at a time; the remainder of
  each permutation is skipped.
  """
  for epoch in itertools.count():
    orders = np.stack([
      np.random.default_rng([seed, 2, worker, epoch]).permutation(n_local)
      for worker in range(devices)
    ]).astype(np.int32)
    for start in range(0, n_local - batch_size + 1, batch_size):
      yield orders[:, start:start + batch_size]


def train(
  algorithm: str,
  data: dict[str, np.ndarray],
  *,
  devices: int = DEFAULTS["devices"],
  steps: int = DEFAULTS["steps"],
  batch_size: int = DEFAULTS["batch_size"],
  learning_rate: float = DEFAULTS["learning_rate"],
  communication_period: int = DEFAULTS["communication_period"],
  moving_rate: float | None = None,
  decay: float = DEFAULTS["decay"],
  max_staleness: int = DEFAULTS["max_staleness"],
  eval_every: int = DEFAULTS["eval_every"],
  seed: int = DEFAULTS["seed"],
  on_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
  """Trains the MLP on ``data`` with ``algorithm`` over ``devices`` workers for ``steps`` steps.

  Worker ``i`` owns the ``i``-th of ``devices`` equal shards of the training set (the remainder
  is left out) and draws minibatches of ``batch_size`` from a fresh permutation of its shard every
  epoch. All workers start from the same params (:func:`initial_params`, the same for every
  algorithm given the same seed). The test accuracy is measured at step 0, every
  ``eval_every`` steps and at the end, for the params :func:`optax_dist.eval_params` returns and
  for the workers' own params, each averaged over the workers.

  Returns:
    A dict of the settings, the final accuracies, ``communication_rounds``, ``wall_time_s``
    (compilation included), ``num_dropped`` (``drop_stale_gradients`` only) and ``history``:
    lists ``step``, ``communication_rounds``, ``test_accuracy_eval_params``,
    ``test_accuracy_workers`` and ``train_loss`` (the workers' mean minibatch loss).
  """
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_dist

  start = time.perf_counter()
  available = jax.devices("cpu")
  if devices > len(available):
    raise ValueError(
      f"--devices {devices} needs {devices} CPU devices but JAX has {len(available)}; set"
      f' jax.config.update("jax_num_cpu_devices", {devices}) before JAX initialises.'
    )
  n_local = len(data["x_train"]) // devices
  if n_local < batch_size:
    raise ValueError(
      f"--batch-size {batch_size} is larger than each worker's shard of the training set"
      f" ({len(data['x_train'])} examples over {devices} workers: {n_local} each)."
    )
  stale = algorithm == "drop_stale_gradients"
  depth = max(max_staleness, 0) + 2  # the params of the last `depth` accepted steps

  mesh = Mesh(np.array(available[:devices]), (AXIS,))
  split = NamedSharding(mesh, P(AXIS))
  replicated = NamedSharding(mesh, P())

  def shard(x):
    return jax.device_put(x, split)

  x_shards = shard(data["x_train"][: n_local * devices].reshape(devices, n_local, -1))
  y_shards = shard(data["y_train"][: n_local * devices].reshape(devices, n_local))
  x_test = jax.device_put(data["x_test"], replicated)
  y_test = jax.device_put(data["y_test"], replicated)

  model = make_model()
  tx = make_optimizer(
    algorithm,
    learning_rate=learning_rate,
    communication_period=communication_period,
    moving_rate=default_moving_rate(devices) if moving_rate is None else moving_rate,
    decay=decay,
    max_staleness=max_staleness,
  )

  def unstack(tree):
    return jax.tree.map(lambda x: x[0], tree)

  def stack(tree):
    return jax.tree.map(lambda x: x[None], tree)

  def init_fn(params):
    params = unstack(params)
    history = jax.tree.map(lambda p: jnp.broadcast_to(p, (depth,) + p.shape), params)
    return stack(tx.init(params)), stack(history if stale else {})

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def step_fn(params, opt_state, history, x_local, y_local, idx, delay):
    params, opt_state, history = unstack(params), unstack(opt_state), unstack(history)
    x, y = x_local[0][idx[0]], y_local[0][idx[0]]
    if stale:
      # Every worker reads the params of `delay` accepted steps ago (the same delay for all).
      grad_step = jnp.maximum(opt_state.global_step - delay, 0)
      read = jax.tree.map(lambda h: h[grad_step % depth], history)
      loss, grads = jax.value_and_grad(loss_fn)(read, x, y)
      updates, opt_state = tx.update(grads, opt_state, params, grad_step=grad_step)
      params = optax.apply_updates(params, updates)
      slot = opt_state.global_step % depth
      history = jax.tree.map(lambda h, p: h.at[slot].set(p), history, params)
    else:
      loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    loss = jax.lax.pmean(loss, AXIS)
    return stack(params), stack(opt_state), stack(history), loss

  def evaluate(params, opt_state):
    def accuracy(p):
      logits = model.apply({"params": p}, x_test)
      return jnp.mean((jnp.argmax(logits, axis=-1) == y_test).astype(jnp.float32))

    averaged = optax_dist.eval_params(opt_state, params)
    return jnp.mean(jax.vmap(accuracy)(averaged)), jnp.mean(jax.vmap(accuracy)(params))

  params = shard(jax.tree.map(
    lambda p: np.broadcast_to(p, (devices,) + p.shape), initial_params(seed, x_shards.shape[2])))
  init = jax.jit(jax.shard_map(init_fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
  opt_state, history = init(params)
  batches = _minibatches(seed, devices, n_local, batch_size)
  delays = np.random.default_rng([seed, 1]).integers(0, depth, size=steps, dtype=np.int32)
  # Each function is compiled once, ahead of time: a call with other types would raise.
  step = jax.jit(
    jax.shard_map(
      step_fn,
      mesh=mesh,
      in_specs=(P(AXIS), P(AXIS), P(AXIS), P(AXIS), P(AXIS), P(AXIS), P()),
      out_specs=(P(AXIS), P(AXIS), P(AXIS), P()),
    ),
    donate_argnums=(0, 1, 2),
  ).lower(
    params, opt_state, history, x_shards, y_shards,
    shard(np.zeros((devices, batch_size), np.int32)), jax.device_put(delays[0], replicated),
  ).compile()
  evaluate = jax.jit(evaluate).lower(params, opt_state).compile()
  record = {key: [] for key in (
    "step", "communication_rounds", "test_accuracy_eval_params", "test_accuracy_workers",
    "train_loss")}

  def measure(s, loss):
    acc_eval, acc_workers = evaluate(params, opt_state)
    record["step"].append(s)
    record["communication_rounds"].append(
      communication_rounds(algorithm, s, communication_period))
    record["test_accuracy_eval_params"].append(float(acc_eval))
    record["test_accuracy_workers"].append(float(acc_workers))
    record["train_loss"].append(None if loss is None else float(loss))

  measure(0, None)
  for s in range(1, steps + 1):
    idx = shard(next(batches))
    delay = jax.device_put(delays[s - 1], replicated)
    params, opt_state, history, loss = step(
      params, opt_state, history, x_shards, y_shards, idx, delay)
    if s % eval_every == 0 or s == steps:
      measure(s, loss)
    if on_step is not None:
      on_step(s)
  wall_time = time.perf_counter() - start

  result = {
    "algorithm": algorithm,
    "devices": devices,
    "steps": steps,
    "batch_size": batch_size,
    "learning_rate": learning_rate,
    "communication_period": communication_period if algorithm in PERIODIC else 1,
    "communication_rounds": communication_rounds(algorithm, steps, communication_period),
    "test_accuracy_eval_params": record["test_accuracy_eval_params"][-1],
    "test_accuracy_workers": record["test_accuracy_workers"][-1],
    "final_train_loss": record["train_loss"][-1],
    "wall_time_s": wall_time,
    "history": record,
  }
  if algorithm == "elastic_average":
    result["moving_rate"] = default_moving_rate(devices) if moving_rate is None else moving_rate
  if algorithm == "moving_average":
    result["decay"] = decay
  if stale:
    result["max_staleness"] = max_staleness
    result["num_dropped"] = int(np.asarray(opt_state.num_dropped)[0])
  return result


def plot(results: list[dict[str, Any]], path: str) -> None:
  """Writes a PNG of the test accuracy of ``eval_params`` vs step and vs communication rounds."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (by_step, by_round) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
  for result in results:
    h = result["history"]
    by_step.plot(h["step"], h["test_accuracy_eval_params"], label=result["algorithm"])
    by_round.plot(
      h["communication_rounds"], h["test_accuracy_eval_params"], label=result["algorithm"]
    )
  final = min(r["test_accuracy_eval_params"] for r in results)
  bottom = max(0.0, min(0.8, math.floor((final - 0.05) * 20) / 20))  # zoom on the end
  by_step.set_xlabel("step")
  by_round.set_xlabel("communication rounds")
  by_step.set_ylabel("test accuracy (eval_params)")
  by_round.set_xscale("symlog", linthresh=10)
  for ax in (by_step, by_round):
    ax.grid(True, alpha=0.3)
    ax.set_ylim(bottom, 1.0)
  by_step.legend(loc="lower right")
  devices = results[0]["devices"]
  fig.suptitle(f"digits MLP, {devices} data-parallel workers")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
