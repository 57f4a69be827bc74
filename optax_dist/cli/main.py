"""The ``optax-dist`` command: data-parallel training with the optax_dist transformations.

``optax-dist train --algorithm NAME`` trains with one algorithm; ``optax-dist compare`` trains with
``sync``, ``elastic_average``, ``agn`` and ``moving_average`` and compares them; ``optax-dist
async`` compares asynchronous protocols, emulated. ``--task`` chooses what to train on
(:mod:`optax_dist.cli.tasks`). Each run emulates ``--devices`` CPU devices, one worker each,
prints a table, and writes a JSON file of the results and a PNG plot under ``--out``.

With ``--processes P`` the workers are the devices of ``P`` ``jax.distributed`` processes
(:mod:`optax_dist.cli.launcher`); with ``--checkpoint-every N`` the state is saved with Orbax and
``--resume`` continues an interrupted run exactly.

The arguments are checked before any training starts; JAX is told how many CPU devices to create
before it initialises its backends. Needs the ``examples`` extra.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from typing import Any

import jax
import numpy as np

from optax_dist import async_emulator
from optax_dist.cli import async_run, errors, launcher, plan, reports, trainer
from optax_dist.cli.algorithms import ALGORITHMS, COMPARED, check_exchange
from optax_dist.cli.arguments import build_parser
from optax_dist.cli.checkpoints import CheckpointMismatchError, saved_steps
from optax_dist.cli.config import DEFAULTS, Settings
from optax_dist.cli.errors import PROG, CommandError
from optax_dist.cli.tasks import TASKS, Task

TRAINING_MODULES = ("flax", "sklearn", "matplotlib", "tqdm")
"""The modules of the ``examples`` extra every subcommand needs (Orbax: only for checkpoints)."""

RECIPE = ("optimizer", "b2", "weight_decay", "lr_schedule", "lr_warmup_steps", "clip_norm")
"""The settings of the inner optimizer (:func:`optax_dist.cli.algorithms.inner_optimizer`)."""

TASK_DEFAULTS = ("steps", "batch_size", "learning_rate", "eval_every", "communication_period",
                 "sync_period", *RECIPE)
"""The settings whose default a task may change (``Task.defaults``)."""


def main(argv: list[str] | None = None) -> int:
  """Runs ``optax-dist``; returns the exit status (2 for a mistake, said in one line)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  try:
    if args.command == "async":
      return run_async(args)
    if args.command == "plan":
      return plan.run(args)
    return run_training(args, argv)
  except CommandError as e:
    errors.report(str(e))
  except ModuleNotFoundError as e:
    message = errors.missing_extra(e)
    if message is None:
      raise
    errors.report(message)
  except KeyboardInterrupt:
    sys.stderr.write(f"{PROG}: interrupted\n")
    return 130
  return 2


def check_out(path: str) -> None:
  """Raises :class:`CommandError` unless ``path`` is (or can be made) a writable directory."""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise CommandError(
      f"argument --out: cannot create directory {path!r}: {e.strerror or e}") from None
  if not os.path.isdir(path):
    raise CommandError(f"argument --out: {path!r} is not a directory")
  try:
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise CommandError(
      f"argument --out: directory {path!r} is not writable: {e.strerror or e}") from None


def _require(task: Task, *, checkpoints: bool) -> None:
  modules = TRAINING_MODULES + (("orbax.checkpoint",) if checkpoints else ())
  errors.require(modules)
  errors.require(task.requires, task.install or errors.EXAMPLES_HINT)


def _check_processes(args: argparse.Namespace) -> None:
  """Raises :class:`CommandError` unless the multi-process arguments fit together."""
  if args.process_id is not None:
    if args.coordinator is None:
      raise CommandError("argument --process-id: needs --coordinator HOST:PORT, the address of"
                         " process 0")
    if not 0 <= args.process_id < args.processes:
      raise CommandError(f"argument --process-id: must be in 0..{args.processes - 1}"
                         f" (--processes {args.processes}), got {args.process_id}")
  elif args.coordinator is not None and args.processes == 1:
    raise CommandError("argument --coordinator: needs --processes > 1 or --process-id")


def _check_resume(args: argparse.Namespace, algorithms: tuple[str, ...]) -> None:
  """Raises :class:`CommandError` if ``--resume`` finds no checkpoint of any of ``algorithms``."""
  root = os.path.join(args.out, "checkpoints")
  if not args.resume or any(saved_steps(os.path.join(root, a)) for a in algorithms):
    return
  raise CommandError(
    f"argument --resume: no checkpoint of {', '.join(algorithms)} under {root}; resume with the"
    " --out of a run started with --checkpoint-every N, or run without --resume to start over")


def settings_of(args: argparse.Namespace, task: Task) -> Settings:
  """The resolved settings of the run ``args`` asks for (``algorithm``: ``train``'s)."""
  given = {key: getattr(args, key) for key in TASK_DEFAULTS if getattr(args, key) is not None}
  values = {key: DEFAULTS[key] for key in TASK_DEFAULTS} | dict(task.defaults) | given
  for key in ("communication_period", "sync_period"):  # a task's default adapts to --steps
    if key not in given and values[key] is not None:
      values[key] = min(values[key], values["steps"])
  return Settings(
    task=task.name, algorithm=getattr(args, "algorithm", "sync"),
    devices=args.processes * args.devices, replicas=args.replicas, fsdp=args.fsdp,
    moving_rate=args.moving_rate, decay=args.decay,
    max_staleness=args.max_staleness, seed=args.seed,
    comm_dtype=None if args.comm_dtype == "float32" else args.comm_dtype,
    comm_block_size=args.comm_block_size, error_feedback=args.error_feedback,
    overlap=args.overlap, eager=args.eager, mixing=args.mixing,
    exchange_device=args.exchange_device,
    outer_learning_rate=args.outer_learning_rate, outer_momentum=args.outer_momentum,
    num_fragments=args.num_fragments, warmup_steps=args.warmup_steps,
    param_dtype=args.param_dtype, **values,
  ).resolved()


def _check_settings(settings: Settings, algorithms: tuple[str, ...], n_train: int,
                    processes: int = 1) -> None:
  """Raises :class:`CommandError` unless every worker gets a minibatch, the periods fit the run,
  the optimizer's settings fit together, every algorithm takes the exchange
  (:func:`optax_dist.cli.algorithms.check_exchange`) and, with ``exchange_device``, each of the
  ``processes`` holds one replica."""
  workers = settings.devices
  if workers % settings.replicas:
    raise CommandError(
      f"argument --replicas: must divide the number of workers (--processes x --devices ="
      f" {workers}) into replicas of equal size, got {settings.replicas}")
  if settings.fsdp is not None:
    _check_fsdp(settings, algorithms)
  if settings.optimizer == "adam" and settings.weight_decay:
    raise CommandError(
      f"argument --weight-decay: adam has no weight decay, got {settings.weight_decay:g}; use"
      " --optimizer adamw (decoupled) or sgd")
  if settings.lr_schedule == "warmup_cosine" and settings.lr_warmup_steps >= settings.steps:
    raise CommandError(
      f"argument --lr-warmup-steps: must be less than --steps ({settings.steps}), got"
      f" {settings.lr_warmup_steps}")
  if n_train // workers < settings.batch_size:
    raise CommandError(
      f"argument --batch-size: each worker needs at least batch-size examples, but the"
      f" {n_train} training examples give {n_train // workers} to each of {workers}"
      f" workers; lower --batch-size or --devices")
  for name in ("communication_period", "sync_period"):
    users = [a for a in algorithms if ALGORITHMS[a].period_name == name]
    period = getattr(settings, name)
    warmup = any(ALGORITHMS[a].warmup is not None for a in users)  # the first exchange after it
    room = settings.steps - (settings.warmup_steps if warmup else 0)
    if users and period > room:
      flag = "--" + name.replace("_", "-")
      limit = (f"--steps ({settings.steps}) minus --warmup-steps ({settings.warmup_steps})"
               if warmup else f"--steps ({settings.steps})")
      raise CommandError(
        f"argument {flag}: must be at most {limit}, got {period}; {', '.join(users)} would"
        " never communicate (leave it out to use the default, which adapts to --steps)")
  _check_exchanges(settings, algorithms)
  if settings.exchange_device and settings.replicas != processes:
    raise CommandError(
      "argument --exchange-device: needs one replica per process and more than one process"
      f" (--replicas equal to --processes > 1), got --replicas {settings.replicas} with"
      f" --processes {processes}")


def _check_exchanges(settings: Settings, algorithms: tuple[str, ...]) -> None:
  """Raises :class:`CommandError` unless each of ``algorithms`` takes the exchange options."""
  for algorithm in algorithms:
    try:
      check_exchange(dataclasses.replace(settings, algorithm=algorithm))
    except ValueError as e:
      raise CommandError(str(e)) from None


def _check_fsdp(settings: Settings, algorithms: tuple[str, ...]) -> None:
  """Raises :class:`CommandError` unless ``--fsdp`` divides a replica's devices and every
  algorithm runs on the global view."""
  per_replica = settings.devices // settings.replicas
  if per_replica % settings.fsdp:
    raise CommandError(
      f"argument --fsdp: must divide the devices of a replica (--processes x --devices /"
      f" --replicas = {per_replica}), got {settings.fsdp}")
  refused = [a for a in algorithms if ALGORITHMS[a].stale_gradients]
  if refused:
    raise CommandError(
      f"argument --fsdp: {', '.join(refused)} does not run on the global view, which keeps no"
      " params history to compute stale gradients at; run it without --fsdp")


def run_training(args: argparse.Namespace, argv: list[str]) -> int:
  """Runs ``optax-dist train`` or ``compare``; returns the exit status."""
  task = TASKS[args.task]
  _require(task, checkpoints=bool(args.checkpoint_every or args.resume))
  algorithms = COMPARED if args.command == "compare" else (args.algorithm,)
  _check_processes(args)
  check_out(args.out)
  _check_resume(args, algorithms)
  data = task.load(args.seed)
  settings = settings_of(args, task)
  _check_settings(settings, algorithms, len(next(iter(data.train.values()))), args.processes)
  if args.processes > 1 and args.process_id is None:
    return launcher.launch(argv, args.processes, args.coordinator)
  # --exchange-device: one more CPU device per process, beside the training devices.
  launcher.init_jax(args.devices + settings.exchange_device, args.processes, args.process_id,
                    args.coordinator, args.heartbeat_timeout)
  results, states = _train_all(args, task, data, settings, algorithms)
  if (args.process_id or 0) == 0:  # process 0 prints and writes the results
    _report(args, task, data, settings, results, states)
  return 0


def _train_all(args: argparse.Namespace, task: Task, data: Any, settings: Settings,
               algorithms: tuple[str, ...]) -> tuple[list[dict], dict[str, dict]]:
  """Trains with each of ``algorithms``; their results and (with ``--save-params``) states."""
  process = args.process_id or 0

  def on_step(step: int) -> None:
    if args.fail_at_step == step and process == args.processes - 1:
      sys.stderr.write(f"{PROG}: process {process}: exiting at step {step} (--fail-at-step)\n")
      sys.stderr.flush()
      os._exit(1)

  results, states = [], {}
  for algorithm in algorithms:
    states[algorithm] = {}
    try:
      results.append(trainer.train(
        task, data, dataclasses.replace(settings, algorithm=algorithm), on_step=on_step,
        progress=not args.no_progress and process == 0,
        checkpoint_dir=os.path.join(args.out, "checkpoints", algorithm),
        checkpoint_every=args.checkpoint_every or 0, resume=args.resume,
        final_state=states[algorithm] if args.save_params else None,
      ))
    except CheckpointMismatchError as e:
      raise CommandError(f"argument --resume: {e}") from None
  return results, states


def _config(args: argparse.Namespace, task: Task, data: Any, settings: Settings) -> dict:
  """The ``config`` of the results' JSON."""
  return {
    "task": task.name, "devices": args.devices, "processes": args.processes,
    "workers": settings.devices, "replicas": settings.replicas, "fsdp": settings.fsdp,
    "steps": settings.steps,
    "batch_size": settings.batch_size,
    "learning_rate": settings.learning_rate,
    "communication_period": settings.communication_period, "moving_rate": settings.moving_rate,
    "sync_period": settings.sync_period, "outer_learning_rate": settings.outer_learning_rate,
    "outer_momentum": settings.outer_momentum, "num_fragments": settings.num_fragments,
    "warmup_steps": settings.warmup_steps, "param_dtype": settings.param_dtype,
    "decay": settings.decay, "max_staleness": settings.max_staleness,
    "comm_dtype": args.comm_dtype, "eval_every": settings.eval_every, "seed": settings.seed,
    "checkpoint_every": args.checkpoint_every,
    "dataset": {"name": task.dataset, "train": len(next(iter(data.train.values()))),
                "test": len(next(iter(data.test.values()))),
                "provenance": task.provenance() if task.provenance else None},
    "model": task.model_name,
    **{key: getattr(settings, key) for key in RECIPE},
  }


def _summary(args: argparse.Namespace, task: Task, settings: Settings,
             algorithms: list[str]) -> str:
  """The line above the table: what was trained, on how many workers, with which optimizer."""
  period = ""
  for name, words in (("communication_period", "communication period"),
                      ("sync_period", "sync period")):
    users = [a for a in algorithms if ALGORITHMS[a].period_name == name]
    if users:
      period += f", {words} {getattr(settings, name)} ({', '.join(users)}"
      if any("outer_learning_rate" in ALGORITHMS[a].settings for a in users):
        period += (f"; outer Nesterov lr {settings.outer_learning_rate:g}, momentum"
                   f" {settings.outer_momentum:g}")
      period += ")"
  layout = f" ({args.processes} processes x {args.devices} devices)" if args.processes > 1 else ""
  workers = settings.devices
  if settings.replicas > 1:
    layout += f" in {settings.replicas} replicas of {workers // settings.replicas}"
  if settings.fsdp is not None:
    layout += f", params sharded over {settings.fsdp} (global view)"
  return (f"{task.name}, {task.model_name}, {workers} worker{'s' if workers > 1 else ''}{layout}"
          f" x batch {settings.batch_size}, {_recipe(settings)}{period},"
          f" seed {settings.seed}")


def _recipe(settings: Settings) -> str:
  """The inner optimizer in words, e.g. ``adamw lr 0.003 (warmup_cosine, 15 warm-up steps),
  b2 0.99, weight decay 0.1, clip 1``."""
  s = settings
  text = f"{s.optimizer} lr {s.learning_rate:g}"
  if s.lr_schedule != "constant":
    text += (f" ({s.lr_schedule}, {s.lr_warmup_steps} warm-up"
             f" step{'' if s.lr_warmup_steps == 1 else 's'})")
  if s.optimizer != "sgd" and s.b2 != DEFAULTS["b2"]:
    text += f", b2 {s.b2:g}"
  if s.weight_decay:
    text += f", weight decay {s.weight_decay:g}"
  if s.clip_norm is not None:
    text += f", clip {s.clip_norm:g}"
  return text


def _report(args: argparse.Namespace, task: Task, data: Any, settings: Settings,
            results: list[dict], states: dict[str, dict]) -> None:
  """Writes the JSON, the plot and (``--save-params``) the states; prints the table."""
  suffix = "" if args.command == "compare" else f"_{args.algorithm}"
  json_path = os.path.join(args.out, f"results{suffix}.json")
  png_path = os.path.join(args.out, f"accuracy{suffix}.png")
  reports.write_json(json_path, {"command": args.command,
                                 "config": _config(args, task, data, settings),
                                 "algorithms": {r["algorithm"]: r for r in results}})
  reports.plot_accuracy(results, png_path,
                        f"{task.name}, {task.model_name}, {settings.devices} data-parallel workers",
                        label=task.metric_label)
  if args.save_params:
    _save_params(args.save_params, states)
  print(_summary(args, task, settings, [r["algorithm"] for r in results]))
  print(reports.table(reports.train_columns(task.metric_label, task.metric_key), results))
  for r in results:
    if "num_dropped" in r:
      print(f"{r['algorithm']}: {r['num_dropped']} of {r['steps']} steps dropped"
            f" (max staleness {r['max_staleness']})")
    if r.get("resumed_from_step"):
      print(f"{r['algorithm']}: resumed from the checkpoint of step {r['resumed_from_step']}")
    if r.get("resized"):
      z = r["resized"]
      print(f"{r['algorithm']}: resized from {z['from_workers']} to {z['to_workers']} workers at"
            f" step {z['step']} (optax_dist.resize_state: global state kept, workers rebuilt)")
  print(f"wrote {json_path} and {png_path}")


def _save_params(path: str, states: dict[str, dict[str, Any]]) -> None:
  """Writes each algorithm's final params and optimizer state to ``path`` (npz)."""
  arrays = {}
  for algorithm, state in states.items():
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      arrays[f"{algorithm}{jax.tree_util.keystr(key_path)}"] = np.asarray(leaf)
  with open(path, "wb") as f:
    np.savez(f, **arrays)


def _check_worker_times(args: argparse.Namespace) -> None:
  """Raises :class:`CommandError` for a ``--restarts``, ``--leaves`` or ``--joins`` worker that
  does not exist, or a combination the emulator refuses (a join after the leave, a restart of an
  absent worker)."""
  for flag in ("restarts", "leaves", "joins"):
    bad = [w for w, _ in getattr(args, flag) if w >= args.workers]
    if bad:
      raise CommandError(
        f"argument --{flag}: worker {bad[0]} does not exist (--workers {args.workers})")
  try:
    async_emulator.Cluster(args.workers).schedule(
      duration=args.duration, restarts=args.restarts, leaves=args.leaves, joins=args.joins)
  except ValueError as e:
    raise CommandError(f"arguments --restarts, --leaves, --joins: {e}") from None


def run_async(args: argparse.Namespace) -> int:
  """Runs ``optax-dist async``: prints the table, writes ``results_async.json``/``async.png``."""
  task = TASKS[args.task]
  if task.metric_key != "accuracy":
    raise CommandError(f"argument --task: async emulates the classification tasks"
                       f" ({', '.join(t for t in TASKS if TASKS[t].metric_key == 'accuracy')}),"
                       f" not {task.name}; train {task.name} with train or compare")
  _require(task, checkpoints=False)
  if not 0 <= args.stragglers <= args.workers:
    raise CommandError(f"argument --stragglers: must be in 0..{args.workers} (--workers), got"
                       f" {args.stragglers}")
  _check_worker_times(args)
  check_out(args.out)
  cluster = {key: getattr(args, key) for key in ("workers", "stragglers", "slowdown", "restarts",
                                                 "leaves", "joins", "max_staleness",
                                                 "communication_period", "dylu")}
  rows = async_run.run(task, **cluster, duration=args.duration, batch_size=args.batch_size,
                       learning_rate=args.learning_rate, seed=args.seed,
                       progress=not args.no_progress)
  png_path = os.path.join(args.out, "async.png")
  reports.plot_async(rows, png_path, async_run.describe(
    task, latency=async_run.DEFAULTS["latency"], **cluster))
  json_path = os.path.join(args.out, "results_async.json")
  reports.write_json(json_path, {
    "command": "async", "config": {k: v for k, v in vars(args).items() if k != "command"},
    "protocols": {r["protocol"]: r for r in rows}})
  print(reports.table(reports.ASYNC_COLUMNS, rows))
  print(f"wrote {json_path} and {png_path}")
  return 0
