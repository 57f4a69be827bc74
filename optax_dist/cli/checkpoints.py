"""Orbax checkpoints of a training run, and resuming from them exactly.

A checkpoint holds the training state (``{"params", "opt_state", "history"}``, global sharded
arrays: each process writes and reads its own shards; on several hosts the directory must be on a
shared file system) and, as JSON, the step, the run's settings, the record of the metric so far
and the wall time so far. The step is the position in the minibatches and the delays (see
:mod:`optax_dist.cli.pipeline`), so nothing else is needed to continue exactly.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
from jax.experimental import multihost_utils

from optax_dist.cli.config import default_moving_rate

SETTINGS_ADDED = {"task": "digits", "sync_period": None, "outer_learning_rate": 0.7,
                  "outer_momentum": 0.9, "num_fragments": 4, "warmup_steps": 0,
                  "param_dtype": "float32", "optimizer": "adam", "b2": 0.999,
                  "weight_decay": 0.0, "lr_schedule": "constant", "lr_warmup_steps": 0,
                  "clip_norm": None, "replicas": 1, "fsdp": None, "comm_block_size": 256,
                  "error_feedback": False, "overlap": 0, "eager": False, "mixing": 0.0,
                  "exchange_device": False}
"""Settings absent from older checkpoints, with the value those runs had."""


def _orbax() -> Any:
  """``orbax.checkpoint``, imported when a run saves or resumes: the command runs without it."""
  import orbax.checkpoint as ocp

  return ocp


class CheckpointMismatchError(ValueError):
  """A checkpoint to resume from was written by a run with other settings."""


def saved_steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints under ``directory`` (none if it does not exist).

  Reads the directory names only (Orbax names a complete checkpoint by its step; a save in
  progress has another name), so it needs neither Orbax nor JAX.
  """
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


class Checkpoints:
  """The checkpoints of one run under ``directory``; the last two are kept.

  Saves are synchronous and atomic: a process killed while saving leaves the previous checkpoint
  as the latest. Without ``resume``, the checkpoints of an earlier run there are deleted.
  """

  def __init__(self, directory: str, settings: dict[str, Any], *, resume: bool):
    ocp = _orbax()
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
    """Saves ``state`` (a pytree of global arrays) and ``meta`` (JSON) as checkpoint ``step``."""
    ocp = _orbax()
    meta = {"step": step, "settings": self.settings, **meta}
    self.manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def restore(self, state: Any, replicated: Any, *,
              per_worker: bool = True) -> tuple[Any, dict[str, Any]] | None:
    """The latest checkpoint's state and JSON, or ``None`` if there is none.

    With ``per_worker``, ``state``'s leaves have a leading worker axis: a checkpoint of as many
    workers is restored shaped and sharded like ``state``; one of another number of workers
    (``settings["devices"]`` differs: an elastic resume) is restored with its own worker count,
    replicated on every device (``replicated``, a sharding), for
    :func:`optax_dist.resize_state`. Without (the global view: a leading replica axis), every
    checkpoint is restored shaped and sharded like ``state``.

    Raises:
      CheckpointMismatchError: the checkpoint was written with other settings (other than the
        number of workers).
    """
    ocp = _orbax()
    step = self.manager.latest_step()
    if step is None:
      return None
    meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    meta["settings"] = {**SETTINGS_ADDED, **meta["settings"]}
    if meta["settings"]["sync_period"] is None:  # resolved only for the DiLoCo family before
      meta["settings"]["sync_period"] = self.settings["sync_period"]
    self._check_settings(step, meta["settings"])
    workers = meta["settings"]["devices"]

    def abstract(x):
      if workers == self.settings["devices"] or not per_worker:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      return jax.ShapeDtypeStruct((workers, *x.shape[1:]), x.dtype, sharding=replicated)

    restored = self.manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(jax.tree.map(abstract, state))))["state"]
    return restored, meta

  def _check_settings(self, step: int, saved: dict[str, Any]) -> None:
    # A resume may change the number of workers, and with it the defaults that depend on it.
    elastic = ["devices"]
    if all(s["moving_rate"] == default_moving_rate(s["devices"]) for s in (saved, self.settings)):
      elastic.append("moving_rate")
    if all(saved.get(k) == v for k, v in self.settings.items() if k not in elastic):
      return
    changed = ", ".join(
      f"{key} {saved.get(key)!r} -> {value!r}" for key, value in self.settings.items()
      if saved.get(key) != value and key not in elastic)
    raise CheckpointMismatchError(
      f"cannot resume from {self.directory} (step {step}): it was written with other"
      f" settings ({changed}); rerun with the same settings, or without --resume to start over"
    )

  def close(self) -> None:
    self.manager.close()
