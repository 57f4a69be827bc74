"""Data-parallel training of any task with any algorithm: the loop, checkpoints and resuming.

:func:`train` checks the settings (:func:`optax_dist.cli.checks.check_settings`), with
``resume`` finds the checkpoint to resume from (and refuses a damaged or mismatched one before
anything compiles), builds the run (:class:`optax_dist.cli.runs.Run`,
:class:`~optax_dist.cli.runs.GlobalRun` on the global view,
:class:`~optax_dist.cli.exchange_device.ExchangeDeviceRun` with an exchange device), restores that
checkpoint, and trains step by step, evaluating and saving on the way.

The mesh may span several ``jax.distributed`` processes (:mod:`optax_dist.cli.processes`): every
process builds the same global arrays from the same host data, holding the shards of its own
devices, and runs the same step. The caller must have made enough devices available
(``jax.config.update("jax_num_cpu_devices", N)``) before JAX initialised.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import optax_dist
from optax_dist.cli import checks
from optax_dist.cli.algorithms import ALGORITHMS
from optax_dist.cli.orbax_checkpoints import Checkpoints
from optax_dist.cli.config import Settings
from optax_dist.cli.exchange_device import ExchangeDeviceRun
from optax_dist.cli.meshes import to_host
from optax_dist.cli.progress import Progress, Steps
from optax_dist.cli.runs import GlobalRun, Run, metric_keys, record_keys
from optax_dist.cli.steps import State
from optax_dist.cli.tasks import Data, Task


def train(
  task: Task,
  data: Data,
  settings: Settings,
  *,
  on_step: Callable[[int], None] | None = None,
  progress: bool = False,
  checkpoint_dir: str | None = None,
  checkpoint_every: int = 0,
  resume: bool = False,
  keep_state: bool = False,
) -> dict[str, Any]:
  """Trains ``task`` on ``data`` with ``settings.algorithm`` over ``settings.devices`` workers.

  Worker ``i`` owns the ``i``-th of ``devices`` equal shards of the training set and draws
  minibatches from a fresh permutation of its shard every epoch. All workers start from the same
  params (:func:`optax_dist.cli.runs.initial_params`, the same for every algorithm given the
  seed). The test metric is measured at step 0, every ``eval_every`` steps and at the end, for
  the params :func:`optax_dist.eval_params` returns and for the workers' own params, each
  averaged over the workers. After ``jax.distributed.initialize`` the workers are the devices of
  every process, and every process calls ``train`` with the same arguments; the results are the
  same on all.

  With ``settings.fsdp`` K the run is on the global view
  (:class:`~optax_dist.cli.runs.GlobalRun`): one jitted ``jax.vmap`` step over the replicas,
  each replica's params sharded over K of its devices and its state over K or all of them (see
  :class:`~optax_dist.cli.runs.GlobalRun`); device ``i`` trains on worker
  ``i``'s examples, so the losses are those of the per-device step to float rounding. The state
  then has a leading replica axis.

  With ``settings.exchange_device``
  (:class:`~optax_dist.cli.exchange_device.ExchangeDeviceRun`) the ``streaming_diloco``
  exchanges across the replicas run on one extra device per process (JAX must have
  ``devices / processes`` + 1 CPU devices in each), beside the steps between a fragment's send
  and its landing; the params and state are the in-step route's.

  With ``checkpoint_dir`` and ``checkpoint_every > 0``, the state is saved with Orbax every
  ``checkpoint_every`` steps and at the end; with ``resume``, training continues from the latest
  checkpoint there (from the start if there is none) and ends with the params of an
  uninterrupted run. Without ``resume``, the checkpoints there are replaced.

  Args:
    on_step: called with the step number after each step.
    progress: show on stderr each phase as it runs (building the model, compiling, evaluating:
      :class:`optax_dist.cli.progress.Progress`), then a bar over the steps.
    keep_state: put the final state in the result, as ``final_state``.

  Returns:
    A dict of the settings, the final metrics, ``communication_rounds``, ``wall_time_s``
    (compilation included; summed over the resumed runs), ``num_dropped``
    (``drop_stale_gradients`` only), ``resumed_from_step`` (with ``resume``), ``resized``
    (``{"step", "from_workers", "to_workers"}``, when ``resume`` continued a checkpoint of
    another number of workers: see :func:`resize`), ``history``
    (the lists of :func:`~optax_dist.cli.runs.record_keys`; ``train_loss`` is the workers' mean
    minibatch loss),
    ``collective_bytes`` (per compiled step, ``every_step`` or ``communication_step`` and
    ``non_communication_step``: the bytes each device sends into collectives, by the mesh axes
    they span, e.g. ``{"data": ..., "replica": ...}``, within a replica and across replicas
    apart; ``unconditional``, on every execution, and ``conditional``, a list with each
    conditional exchange's, e.g. one per fragment of ``streaming_diloco``, of which one runs on
    a sync step; ``operands``, the same structure counting the arrays they carry; read from
    the compiled program, see :func:`optax_dist.communication_report`; with ``exchange_device``
    also ``exchange``, the exchange programs', per device of the exchange mesh,
    ``conditional`` holding one per fragment, and the steps' own have none across replicas),
    ``step_times`` (the seconds of each step this call ran, from the step's start until its
    loss and params are ready on this process: evaluations and checkpoints excluded; after
    ``resume``, the steps after the checkpoint's) and ``bytes_per_device`` (``params``,
    ``opt_state``: one device's shards; ``step_arguments``: the compiled step's arguments on one
    device, from its ``memory_analysis``, the device's shard of the training set included); with
    ``keep_state``, ``final_state``: the final ``params`` and ``opt_state`` as NumPy arrays with
    a leading worker axis (with ``fsdp``, replica axis), gathered from every process.

  Raises:
    ValueError: settings that :func:`optax_dist.cli.checks.check_settings` refuses (its
      one-line messages name the command's flags); too few devices, or with ``exchange_device``
      a process without exactly one device beyond its training devices.
    CheckpointMismatchError: ``resume`` from a checkpoint written with other settings, raised
      before the run is built.
    DamagedCheckpointError: ``resume`` with every checkpoint damaged (raised before the run is
      built), or the arrays of the newest intact one unreadable (a damaged newer one is set
      aside: see :class:`Checkpoints`).
  """
  start = time.perf_counter()
  settings = settings.resolved()
  checks.check_settings(settings, (settings.algorithm,), processes=jax.process_count(),
                        train_examples=lambda: checks.num_examples(data.train))
  checkpoints = None
  if checkpoint_dir is not None and (checkpoint_every > 0 or resume):
    # With resume, a checkpoint to refuse is refused here, before the run compiles.
    checkpoints = Checkpoints(checkpoint_dir, settings.as_dict(), resume=resume)
  shown = Progress(settings.algorithm, progress)
  if settings.fsdp is not None:
    run = GlobalRun(task, data, settings, progress=shown)
  elif settings.exchange_device:
    run = ExchangeDeviceRun(task, data, settings, progress=shown)
  else:
    run = Run(task, data, settings, progress=shown)
  resized = None
  record = {key: [] for key in record_keys(task)}
  state, earlier_time, resumed_from = run.initial, 0.0, None
  if resume and checkpoints is not None:
    state, record, earlier_time, resumed_from, resized = _restore(run, checkpoints, state, record)
  first = (resumed_from or 0) + 1
  if first == 1:
    with shown.phase("evaluating at step 0"):
      run.measure(state, record, 0, None)

  def save(s: int, state: State) -> State:
    if checkpoints is not None and checkpoint_every > 0 and (
        s % checkpoint_every == 0 or s == settings.steps):
      state = run.settle(state)  # no exchange in flight outside the state
      checkpoints.save(s, state._asdict(), {
        "record": record, "wall_time_s": earlier_time + time.perf_counter() - start})
    return state

  step_times = []
  with shown.steps(settings.steps, first - 1) as bar:
    state = _loop(run, state, record, first, save=save, on_step=on_step, bar=bar,
                  step_times=step_times)
  state = run.settle(state)
  if checkpoints is not None:
    checkpoints.close()
  result = _result(task, settings, state, record, earlier_time + time.perf_counter() - start)
  result["step_times"] = step_times
  result["collective_bytes"] = run.collectives
  result["bytes_per_device"] = run.bytes_per_device
  if resumed_from is not None:
    result["resumed_from_step"] = resumed_from
  if resized is not None:
    result["resized"] = resized
  if keep_state:
    result["final_state"] = to_host({"params": state.params, "opt_state": state.opt_state})
  return result


def _loop(run: Run, state: State, record: dict[str, list], first: int, *, save: Callable,
          on_step: Callable | None, bar: Steps, step_times: list[float]) -> State:
  """Trains from step ``first`` to the end: evaluates, saves, reports progress; the last state.

  Appends each step's seconds (the step until its loss and params are ready) to
  ``step_times``. ``bar`` counts each step as it ends and says when the run evaluates.
  """
  settings = run.settings
  for s in range(first, settings.steps + 1):
    started = time.perf_counter()
    state, loss = run.step(state, s)
    # One step at a time: XLA CPU's collectives time out when many steps' worth of device
    # threads queue up on few cores. The params too: a sync step run apart (diloco) ends with
    # its exchange program, after the loss.
    jax.block_until_ready((loss, state.params))
    step_times.append(time.perf_counter() - started)
    bar.update()
    if s % settings.eval_every == 0 or s == settings.steps:
      with bar.phase("final evaluation" if s == settings.steps else f"evaluating at step {s}"):
        run.measure(state, record, s, loss)
    state = save(s, state)
    if on_step is not None:
      on_step(s)
  return state


def _restore(run: Run, checkpoints: Any, state: State, record: dict[str, list]) -> tuple:
  """``(state, record, earlier wall time, step, resize)`` of the newest intact checkpoint (step 0 if
  none); ``resize`` is ``None``, or ``{"step", "from_workers", "to_workers"}`` (the devices) when
  the checkpoint had another number of devices: the state was moved to this run's workers with
  :func:`optax_dist.resize_state`, or on the global view (:class:`GlobalRun`), whose state is
  per replica, restored onto this run's mesh as it is."""
  restored = checkpoints.restore(state._asdict(), run.replicated,
                                 per_worker=run.state_per_worker)
  if restored is None:
    return state, record, 0.0, 0, None
  saved, meta = restored
  saved, change = State(**saved), None
  workers = meta["settings"]["devices"]
  if workers != run.settings.devices:
    if run.state_per_worker:
      saved = resize(run, saved)
    change = {"step": meta["step"], "from_workers": workers, "to_workers": run.settings.devices}
  return saved, meta["record"], meta["wall_time_s"], meta["step"], change


def resize(run: Run, state: State) -> State:
  """``state`` of another number of workers, moved to ``run``'s by
  :func:`optax_dist.resize_state` (the inner optimizer states averaged), and sharded over them.

  ``drop_stale_gradients``' params history is the same on every worker (it trains with
  ``tower``): worker 0's goes to every new worker.
  """
  workers = run.settings.devices
  # On host values: every process computes the same, locally.
  params, opt_state, history = _replicated_value(state)
  opt_state, params = optax_dist.resize_state(run.tx, opt_state, params, workers)
  history = jax.tree.map(lambda h: np.broadcast_to(h[:1], (workers, *h.shape[1:])), history)
  return State(*run.shard(_replicated_value((params, opt_state))), run.shard(history))


def _replicated_value(tree: Any) -> Any:
  """The host value of ``tree``'s arrays, each whole on every device (and process)."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), tree)


def _result(task: Task, settings: Settings, state: State, record: dict[str, list],
            wall_time: float) -> dict[str, Any]:
  """The results of a finished run (see :func:`train`): the settings of the recipe, those the
  algorithm reads (:attr:`Algorithm.settings`), the final metrics and the history."""
  s, algorithm = settings, ALGORITHMS[settings.algorithm]
  result = {
    "algorithm": s.algorithm,
    "task": s.task,
    "metric": task.metric_key,
    "devices": s.devices,
    "replicas": s.replicas,
    "fsdp": s.fsdp,
    "steps": s.steps,
    "batch_size": s.batch_size,
    "learning_rate": s.learning_rate,
    "param_dtype": s.param_dtype,
    **{key: getattr(s, key) for key in algorithm.settings},
    "communication_rounds": algorithm.communication_rounds(s, s.steps),
    **{key: record[key][-1] for key in metric_keys(task)},
    "final_train_loss": record["train_loss"][-1],
    "wall_time_s": wall_time,
    "history": record,
  }
  if algorithm.stale_gradients:
    # The same on every worker; read from a shard this process holds.
    dropped = state.opt_state.num_dropped.addressable_shards[0].data
    result["num_dropped"] = int(np.asarray(dropped)[0])
  return result
