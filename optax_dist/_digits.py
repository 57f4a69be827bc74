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

The mesh may span several ``jax.distributed`` processes (``optax-dist --processes``): every
process builds the same global arrays from the same host data, holding the shards of its own
devices, and runs the same step. Runs can be checkpointed with Orbax and resumed exactly
(:class:`_Checkpoints`).

Needs the ``examples`` extra (flax, scikit-learn); matplotlib only for :func:`plot`. The caller
must have made enough devices available (``jax.config.update("jax_num_cpu_devices", N)``) before
JAX initialised.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
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


def split_and_standardize(
  x: np.ndarray, y: np.ndarray, seed: int, test_fraction: float = 0.25
) -> dict[str, np.ndarray]:
  """Splits ``(x, y)`` by ``seed`` (stratified) and standardizes the features.

  The features are standardized with the training set's mean and standard deviation (constant
  pixels are left centred). Returns ``x_train``, ``y_train``, ``x_test``, ``y_test`` as float32
  and int32 arrays.
  """
  from sklearn.model_selection import train_test_split

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


def load_data(seed: int, test_fraction: float = 0.25) -> dict[str, np.ndarray]:
  """``digits`` (1797 8x8 images, 10 classes), by :func:`split_and_standardize`."""
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  return split_and_standardize(x, y, seed, test_fraction)


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
  comm_dtype: str | None = None,
) -> Any:
  """The per-worker optax transformation of ``algorithm``, communicating over axis ``"workers"``.

  ``comm_dtype`` (e.g. ``"bfloat16"``) is the dtype of the exchanged values (``None``: float32).
  """
  import optax

  import optax_dist

  adam = optax.adam(learning_rate)
  if algorithm == "sync":
    return optax_dist.tower(adam, AXIS, comm_dtype=comm_dtype)
  if algorithm == "elastic_average":
    return optax_dist.elastic_average(
      adam,
      communication_period=communication_period,
      moving_rate=moving_rate,
      axis_name=AXIS,
      comm_dtype=comm_dtype,
    )
  if algorithm == "agn":
    return optax_dist.agn(
      adam, communication_period=communication_period, axis_name=AXIS, comm_dtype=comm_dtype
    )
  if algorithm == "moving_average":
    return optax_dist.moving_average(
      optax_dist.tower(adam, AXIS, comm_dtype=comm_dtype), decay, use_num_updates=True
    )
  if algorithm == "drop_stale_gradients":
    return optax_dist.drop_stale_gradients(
      optax_dist.tower(adam, AXIS, comm_dtype=comm_dtype), max_staleness
    )
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


@functools.lru_cache(maxsize=2)
def _epoch_orders(seed: int, devices: int, n_local: int, epoch: int) -> np.ndarray:
  """The ``(devices, n_local)`` permutations of each worker's shard for ``epoch``."""
  return np.stack([
    np.random.default_rng([seed, 2, worker, epoch]).permutation(n_local)
    for worker in range(devices)
  ]).astype(np.int32)


def minibatch(seed: int, devices: int, n_local: int, batch_size: int, step: int) -> np.ndarray:
  """The ``(devices, batch_size)`` int32 indices into each worker's shard for step ``step + 1``.

  Every epoch, each worker takes a fresh permutation of its shard (drawn from
  ``(seed, worker, epoch)``) and walks through it ``batch_size`` at a time; the remainder of
  each permutation is skipped. A pure function of its arguments: the step is the position in
  the data, so a run resumed at a step draws the minibatches an uninterrupted run draws.
  """
  per_epoch = n_local // batch_size
  epoch, start = divmod(step, per_epoch)
  start *= batch_size
  return _epoch_orders(seed, devices, n_local, epoch)[:, start:start + batch_size]


def _delays(seed: int, steps: int, depth: int) -> np.ndarray:
  """``drop_stale_gradients``' delay of each step, ``0`` to ``depth - 1``, drawn from ``seed``."""
  return np.random.default_rng([seed, 1]).integers(0, depth, size=steps, dtype=np.int32)


def put(x: Any, sharding: Any) -> Any:
  """The global array of ``sharding`` whose value is the host array ``x``.

  Every process passes the same ``x`` and contributes the shards on its own devices, so this
  works in one process and across ``jax.distributed`` processes alike.
  """
  import jax

  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def to_host(tree: Any) -> Any:
  """``tree``'s global arrays as NumPy arrays on every process (an all-gather across processes)."""
  import jax

  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils

  return multihost_utils.process_allgather(tree, tiled=True)


class CheckpointMismatchError(ValueError):
  """A checkpoint to resume from was written by a run with other settings."""


class _Checkpoints:
  """The Orbax checkpoints of one run: the training state and, as JSON, the step and the record.

  The state is ``{"params", "opt_state", "history"}`` as global sharded arrays (each process
  writes and reads its own shards; on several hosts ``directory`` must be on a shared file
  system). The JSON holds the step (the position in the minibatches and the delays, see
  :func:`minibatch`), the seed, the settings of the run (a resume with other settings is refused),
  the accuracy record so far and the wall time so far. Saves are synchronous and atomic: a
  process killed while saving leaves the previous checkpoint as the latest. The last two
  checkpoints are kept.
  """

  def __init__(self, directory: str, settings: dict[str, Any], *, resume: bool):
    import jax
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    self.directory = os.path.abspath(directory)
    self.settings = settings
    if not resume:
      if jax.process_index() == 0 and os.path.isdir(self.directory):
        shutil.rmtree(self.directory)  # a fresh run replaces the checkpoints of an earlier one
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"optax_dist fresh {self.directory}")
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False),
      item_names=("state", "meta"),
    )

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    import orbax.checkpoint as ocp

    meta = {"step": step, "settings": self.settings, **meta}
    self.manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def restore(self, state: Any) -> tuple[Any, dict[str, Any]] | None:
    """The latest checkpoint's state (shaped and sharded like ``state``) and JSON, or ``None``."""
    import jax
    import orbax.checkpoint as ocp

    step = self.manager.latest_step()
    if step is None:
      return None
    meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta["settings"] != self.settings:
      changed = ", ".join(
        f"{key} {meta['settings'].get(key)!r} -> {value!r}" for key, value in self.settings.items()
        if meta["settings"].get(key) != value)
      raise CheckpointMismatchError(
        f"cannot resume from {self.directory} (step {step}): it was written with other"
        f" settings ({changed}); rerun with the same settings, or without --resume to start over"
      )
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = self.manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract)))["state"]
    return restored, meta

  def close(self) -> None:
    self.manager.close()


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
  comm_dtype: str | None = None,
  on_step: Callable[[int], None] | None = None,
  checkpoint_dir: str | None = None,
  checkpoint_every: int = 0,
  resume: bool = False,
  final_state: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """Trains the MLP on ``data`` with ``algorithm`` over ``devices`` workers for ``steps`` steps.

  Worker ``i`` owns the ``i``-th of ``devices`` equal shards of the training set (the remainder
  is left out) and draws minibatches of ``batch_size`` from a fresh permutation of its shard every
  epoch. All workers start from the same params (:func:`initial_params`, the same for every
  algorithm given the same seed). The test accuracy is measured at step 0, every
  ``eval_every`` steps and at the end, for the params :func:`optax_dist.eval_params` returns and
  for the workers' own params, each averaged over the workers.

  The workers are the first ``devices`` of ``jax.devices()``. After ``jax.distributed.initialize``
  these are the devices of every process, and every process calls ``train`` with the same
  arguments (``devices`` is then the total, all of them): each process holds the shards of its
  own devices, and the results are the same on every process.

  With ``checkpoint_dir`` and ``checkpoint_every > 0``, the state is saved with Orbax every
  ``checkpoint_every`` steps and at the end (see :class:`_Checkpoints`); with ``resume``, training
  continues from the latest checkpoint there (from the start if there is none), and ends with
  the params of an uninterrupted run. Without ``resume``, the checkpoints there are replaced.

  Args:
    on_step: called with the step number after each step.
    final_state: if given, filled with the final ``params`` and ``opt_state`` as NumPy arrays with
      a leading worker axis (gathered from every process).

  Returns:
    A dict of the settings, the final accuracies, ``communication_rounds``, ``wall_time_s``
    (compilation included; summed over the resumed runs), ``num_dropped``
    (``drop_stale_gradients`` only), ``resumed_from_step`` (with ``resume``) and ``history``:
    lists ``step``, ``communication_rounds``, ``test_accuracy_eval_params``,
    ``test_accuracy_workers`` and ``train_loss`` (the workers' mean minibatch loss).
  """
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_dist

  start = time.perf_counter()
  available = jax.devices()
  if devices > len(available):
    raise ValueError(
      f"--devices {devices} needs {devices} CPU devices but JAX has {len(available)}; set"
      f' jax.config.update("jax_num_cpu_devices", {devices}) before JAX initialises.'
    )
  if jax.process_count() > 1 and devices != len(available):
    raise ValueError(
      f"train(devices={devices}): with {jax.process_count()} processes every device is a worker;"
      f" pass devices={len(available)}, the number of devices of all processes."
    )
  n_local = len(data["x_train"]) // devices
  if n_local < batch_size:
    raise ValueError(
      f"--batch-size {batch_size} is larger than each worker's shard of the training set"
      f" ({len(data['x_train'])} examples over {devices} workers: {n_local} each)."
    )
  stale = algorithm == "drop_stale_gradients"
  depth = max(max_staleness, 0) + 2  # the params of the last `depth` accepted steps
  moving_rate = default_moving_rate(devices) if moving_rate is None else moving_rate

  mesh = jax.make_mesh((devices,), (AXIS,), axis_types=(AxisType.Auto,),
                       devices=available[:devices])
  split = NamedSharding(mesh, P(AXIS))
  replicated = NamedSharding(mesh, P())

  def shard(tree):
    return jax.tree.map(lambda x: put(x, split), tree)

  x_shards = shard(data["x_train"][: n_local * devices].reshape(devices, n_local, -1))
  y_shards = shard(data["y_train"][: n_local * devices].reshape(devices, n_local))
  x_test = put(data["x_test"], replicated)
  y_test = put(data["y_test"], replicated)

  model = make_model()
  tx = make_optimizer(
    algorithm,
    learning_rate=learning_rate,
    communication_period=communication_period,
    moving_rate=moving_rate,
    decay=decay,
    max_staleness=max_staleness,
    comm_dtype=comm_dtype,
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
  delays = _delays(seed, steps, depth)
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
    shard(np.zeros((devices, batch_size), np.int32)), put(delays[0], replicated),
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

  checkpoints = None
  first, earlier_time, resumed_from = 1, 0.0, None
  if checkpoint_dir is not None and (checkpoint_every > 0 or resume):
    settings = {
      "algorithm": algorithm, "devices": devices, "steps": steps, "batch_size": batch_size,
      "learning_rate": learning_rate, "communication_period": communication_period,
      "moving_rate": moving_rate, "decay": decay, "max_staleness": max_staleness,
      "eval_every": eval_every, "seed": seed, "comm_dtype": comm_dtype,
    }
    checkpoints = _Checkpoints(checkpoint_dir, settings, resume=resume)
    if resume:
      restored = checkpoints.restore({"params": params, "opt_state": opt_state,
                                      "history": history})
      resumed_from = 0
      if restored is not None:
        state, meta = restored
        params, opt_state, history = state["params"], state["opt_state"], state["history"]
        record, earlier_time = meta["record"], meta["wall_time_s"]
        resumed_from = meta["step"]
        first = resumed_from + 1
  if first == 1:
    measure(0, None)
  for s in range(first, steps + 1):
    idx = shard(minibatch(seed, devices, n_local, batch_size, s - 1))
    delay = put(delays[s - 1], replicated)
    params, opt_state, history, loss = step(
      params, opt_state, history, x_shards, y_shards, idx, delay)
    if s % eval_every == 0 or s == steps:
      measure(s, loss)
    if checkpoints is not None and checkpoint_every > 0 and (
        s % checkpoint_every == 0 or s == steps):
      checkpoints.save(
        s, {"params": params, "opt_state": opt_state, "history": history},
        {"record": record, "wall_time_s": earlier_time + time.perf_counter() - start})
    if on_step is not None:
      on_step(s)
  if checkpoints is not None:
    checkpoints.close()
  if final_state is not None:
    final_state.update(to_host({"params": params, "opt_state": opt_state}))
  wall_time = earlier_time + time.perf_counter() - start

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
  if resumed_from is not None:
    result["resumed_from_step"] = resumed_from
  if algorithm == "elastic_average":
    result["moving_rate"] = moving_rate
  if algorithm == "moving_average":
    result["decay"] = decay
  if stale:
    result["max_staleness"] = max_staleness
    # The same on every worker; read from a shard this process holds.
    result["num_dropped"] = int(np.asarray(opt_state.num_dropped.addressable_shards[0].data)[0])
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
