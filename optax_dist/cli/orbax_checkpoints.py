"""Orbax checkpoints of a training run, and resuming from them exactly.

A checkpoint holds the training state (``{"params", "opt_state", "history"}``, global sharded
arrays: each process writes and reads its own shards; on several hosts the directory must be on a
shared file system) and, as JSON, the step, the run's settings, the record of the metric so far
and the wall time so far. The step is the position in the minibatches and the delays (see
:mod:`optax_dist.cli.pipeline`), so nothing else is needed to continue exactly. A resume skips a
damaged checkpoint for the intact one before it (:attr:`Checkpoints.found`).
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from optax_dist.cli.config import default_moving_rate
from optax_dist.cli.errors import PROG

SETTINGS_ADDED = {"task": "digits", "sync_period": None, "outer_learning_rate": 0.7,
                  "outer_momentum": 0.9, "num_fragments": 4, "warmup_steps": 0,
                  "param_dtype": "float32", "optimizer": "adam", "b2": 0.999,
                  "weight_decay": 0.0, "lr_schedule": "constant", "lr_warmup_steps": 0,
                  "clip_norm": None, "replicas": 1, "fsdp": None, "comm_block_size": 256,
                  "error_feedback": False, "overlap": 0, "eager": False, "mixing": 0.0,
                  "exchange_device": False}
"""Settings absent from older checkpoints, with the value those runs had."""


def _epath(path: str) -> Any:
  """``path`` as Orbax's path type (``etils.epath.Path``)."""
  from etils import epath as etils_epath

  return etils_epath.Path(path)


def _orbax() -> Any:
  """``orbax.checkpoint``, imported when a run saves or resumes: the command runs without it."""
  import orbax.checkpoint as ocp

  return ocp


class CheckpointMismatchError(ValueError):
  """A checkpoint to resume from was written by a run with other settings.

  ``every_process``: every process of the run finds it alike (the settings, or process 0's
  decision that no checkpoint is intact), so process 0 alone needs to say it."""

  def __init__(self, message: str, *, every_process: bool = True):
    super().__init__(message)
    self.every_process = every_process


class DamagedCheckpointError(CheckpointMismatchError):
  """A checkpoint to resume from cannot be read (a file of it is damaged or missing); the message
  names its path and what Orbax found wrong, in one line. A :class:`CheckpointMismatchError` so
  that the command reports both alike."""


def _reason(error: Exception) -> str:
  """What is wrong, in one line: ``error``'s type and the first line of its message."""
  text = error.args[0] if isinstance(error, KeyError) and error.args else error
  first = (str(text).strip().splitlines() or [""])[0]
  return f"{type(error).__name__}: {first}"[:200]


def saved_steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints under ``directory`` (none if it does not exist).

  Reads the directory names only (Orbax names a complete checkpoint by its step; a save in
  progress has another name, and so has a damaged checkpoint set aside, ``N.damaged``), so it
  needs neither Orbax nor JAX.
  """
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


class Checkpoints:
  """The checkpoints of one run under ``directory``; the last two are kept.

  Saves are synchronous and atomic: a process killed while saving leaves the previous checkpoint
  as the latest. Without ``resume``, the checkpoints of an earlier run there are deleted; with
  ``resume``, the newest intact checkpoint is found and its settings checked at once, before the
  caller builds and compiles its run: :attr:`found`.

  Raises:
    CheckpointMismatchError: with ``resume``, the newest intact checkpoint was written with other
      settings (other than the number of workers).
    DamagedCheckpointError: with ``resume``, every checkpoint is damaged.
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
      item_handlers={"state": ocp.StandardCheckpointHandler(),  # item_metadata reads them
                     "meta": ocp.JsonCheckpointHandler()},
    )
    self.found = self._find() if resume else None
    """The newest intact checkpoint's ``(step, JSON)``, its settings checked against this run's,
    or ``None`` (none, or not resuming)."""

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Saves ``state`` (a pytree of global arrays) and ``meta`` (JSON) as checkpoint ``step``."""
    ocp = _orbax()
    meta = {"step": step, "settings": self.settings, **meta}
    self.manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def _find(self) -> tuple[int, dict[str, Any]] | None:
    """The newest intact checkpoint's step and JSON (its settings completed with
    :data:`SETTINGS_ADDED` and checked), or ``None`` if there is none.

    A checkpoint whose JSON or array metadata Orbax cannot read is damaged: process 0 finds the
    newest intact one (and tells the others, :func:`multihost_utils.broadcast_one_to_all`),
    renames the newer damaged ones ``N.damaged`` (kept for inspection; no longer a step), and says
    so on stderr in one line.
    """
    step = self._intact_step()
    if step is None:
      return None
    meta = self._read(step, lambda: self._read_meta(step))
    meta["settings"] = {**SETTINGS_ADDED, **meta["settings"]}
    if meta["settings"]["sync_period"] is None:  # resolved only for the DiLoCo family before
      meta["settings"]["sync_period"] = self.settings["sync_period"]
    self._check_settings(step, meta["settings"])
    return step, meta

  def restore(self, state: Any, replicated: Any, *,
              per_worker: bool = True) -> tuple[Any, dict[str, Any]] | None:
    """The state and JSON of the checkpoint :attr:`found`, or ``None`` if there is none.

    With ``per_worker``, ``state``'s leaves have a leading worker axis: a checkpoint of as many
    workers is restored shaped and sharded like ``state``; one of another number of workers
    (``settings["devices"]`` differs: an elastic resume) is restored with its own worker count,
    replicated on every device (``replicated``, a sharding), for
    :func:`optax_dist.resize_state`. Without (the global view: a leading replica axis), every
    checkpoint is restored shaped and sharded like ``state``.

    Raises:
      DamagedCheckpointError: the arrays of the checkpoint cannot be read.
    """
    ocp = _orbax()
    if self.found is None:
      return None
    step, meta = self.found
    workers = meta["settings"]["devices"]

    def abstract(x):
      if workers == self.settings["devices"] or not per_worker:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      return jax.ShapeDtypeStruct((workers, *x.shape[1:]), x.dtype, sharding=replicated)

    restored = self._read(step, lambda: self.manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(jax.tree.map(abstract, state))))["state"])
    return restored, meta

  def _read_meta(self, step: int) -> dict[str, Any]:
    ocp = _orbax()
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def _path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _read(self, step: int, read: Any) -> Any:
    """``read()``; Orbax's error reading checkpoint ``step`` as a :class:`DamagedCheckpointError`.

    Orbax and TensorStore raise many types (``KeyError``, ``UnicodeDecodeError``, ``ValueError``,
    plain ``Exception`` for unreadable array data), hence ``Exception``.
    """
    try:
      return read()
    except Exception as e:  # noqa: BLE001 (see above)
      message = f"checkpoint {self._path(step)} is damaged ({_reason(e)})"
      raise DamagedCheckpointError(message, every_process=False) from e

  def _damage(self, step: int) -> str | None:
    """What is wrong with checkpoint ``step``'s JSON or array metadata, or ``None``.

    Reads through the handlers, not the manager: its ``restore`` ends with a barrier of every
    process, and only process 0 checks.
    """
    ocp = _orbax()
    meta = ocp.JsonCheckpointHandler()
    try:
      self._read(step, lambda: (meta.restore(_epath(self._path(step)) / "meta"),
                                self.manager.item_metadata(step)["state"]))
    except DamagedCheckpointError as e:
      return _reason(e.__cause__)
    return None

  def _intact_step(self) -> int | None:
    """The newest step whose JSON and array metadata read (``None`` if there is no checkpoint),
    decided by process 0 and told to the others; the newer damaged ones are set aside."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      return None
    step, damaged = self._newest_intact(steps) if jax.process_index() == 0 else (None, {})
    if jax.process_count() > 1:
      step = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if step is None else step)))
      step = None if step < 0 else step
    if step is None:
      found = "; ".join(f"{self._path(s)} is damaged ({reason})" for s, reason in damaged.items())
      raise DamagedCheckpointError(
        f"no intact checkpoint to resume from: {found or f'see process 0 ({self.directory})'};"
        " rerun without --resume to start over")
    if step != steps[0]:
      self._set_aside(damaged, step)
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"optax_dist damaged {self.directory}")
      self.manager.reload()
    return step

  def _newest_intact(self, steps: list[int]) -> tuple[int | None, dict[int, str]]:
    """The first of ``steps`` that is intact (or ``None``), and what is wrong with those before."""
    damaged = {}
    for step in steps:
      reason = self._damage(step)
      if reason is None:
        return step, damaged
      damaged[step] = reason
    return None, damaged

  def _set_aside(self, damaged: dict[int, str], step: int) -> None:
    """Renames the ``damaged`` checkpoints (step: what is wrong) ``N.damaged`` and says so."""
    for bad, reason in damaged.items():
      target = f"{self._path(bad)}.damaged"
      while os.path.exists(target):  # set aside before, at an earlier resume
        target += "+"
      os.rename(self._path(bad), target)
      sys.stderr.write(f"{PROG}: the checkpoint of step {bad} is damaged ({reason}); renamed it"
                       f" {target} and resuming from step {step}\n")
    sys.stderr.flush()

  def _check_settings(self, step: int, saved: dict[str, Any]) -> None:
    # A resume may change the number of workers, and with it the defaults that depend on it; and
    # where the exchanges run: a checkpoint holds no exchange in flight outside the state (saved
    # after ExchangeDeviceRun.settle), so both routes save and restore the same state.
    elastic = ["devices", "exchange_device"]
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
