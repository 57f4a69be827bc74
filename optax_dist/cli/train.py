"""``optax-dist train``: data-parallel training with one algorithm.

Trains ``--task`` with ``--algorithm`` over ``--devices`` emulated CPU devices (of each of
``--processes`` processes, :mod:`optax_dist.cli.processes`), one worker each; shows on stderr the
run in one line (:func:`optax_dist.cli.reports.training_summary`: the recipe and the exchange),
then each phase and step as it runs (:mod:`optax_dist.cli.progress`; not with
``--no-progress``); prints that line and a table on stdout and writes ``results_<algorithm>.json``
and ``accuracy_<algorithm>.png`` under ``--out``. With
``--checkpoint-every N`` the state is saved with Orbax and ``--resume`` continues an interrupted
run exactly. :func:`run_training` also runs ``compare`` (:mod:`optax_dist.cli.compare`).

Every setting is checked (:func:`optax_dist.cli.checks.check_command`) before the data, the
model or JAX's backends load; JAX is told how many CPU devices to create before it initialises.

``add_parser(subparsers)`` adds the subcommand to an ``argparse`` parser; ``run(args)`` runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from typing import Any

from optax_dist.cli import checks, errors, ft_flags, ft_train, processes, reports, trainer
from optax_dist.cli.algorithms import ALGORITHMS
from optax_dist.cli.arguments import EPILOG, Formatter, training_parser
from optax_dist.cli.orbax_checkpoints import CheckpointMismatchError
from optax_dist.cli.config import Settings, settings_of
from optax_dist.cli.errors import PROG, CommandError
from optax_dist.cli.progress import Progress
from optax_dist.cli.tasks import TASKS, Data, Task


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
  """Adds ``train`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns it."""
  parser = subparsers.add_parser(
    "train", parents=[training_parser()], help="train with one algorithm",
    description="Train with one algorithm; writes results_<algorithm>.json and"
    " accuracy_<algorithm>.png under --out. With --fault-tolerant, --replicas R processes train"
    " through failures instead: a replica that dies is restarted and heals while the others go"
    " on (see the fault tolerance flags; docs/fault_tolerance.md).",
    epilog=EPILOG, formatter_class=Formatter,
  )
  parser.add_argument("--algorithm", choices=tuple(ALGORITHMS), default="sync",
                      help="the algorithm: " + "; ".join(
                        f"{a.name}: {a.summary}" for a in ALGORITHMS.values())
                      + " (default: sync)")
  ft_flags.add_arguments(parser)
  return parser


def run(args: argparse.Namespace) -> int:
  """Runs ``optax-dist train`` (with ``--fault-tolerant``,
  :func:`optax_dist.cli.ft_train.run`); returns the exit status."""
  ft_flags.resolve(args)
  if args.fault_tolerant:
    return ft_train.run(args)
  return run_training(args, (args.algorithm,))


def run_training(args: argparse.Namespace, algorithms: tuple[str, ...]) -> int:
  """Trains with each of ``algorithms`` as ``args`` say (``args.argv``: the command line, which
  the other local processes are started with); returns the exit status."""
  task = TASKS[args.task]
  errors.require_task(task, checkpoints=bool(args.checkpoint_every or args.resume))
  settings = settings_of(args, task)
  load = functools.cache(lambda: task.load(args.seed))
  checks.check_command(args, settings, algorithms,
                       train_examples=lambda: checks.num_examples(load().train))
  if args.processes > 1 and args.process_id is None:
    return processes.launch(args.argv, args.processes, args.coordinator)
  progress = not args.no_progress and (args.process_id or 0) == 0
  if progress:  # the run, before its phases (stdout: only the results)
    sys.stderr.write(reports.training_summary(args, task, settings, algorithms) + "\n")
    sys.stderr.flush()
  # --exchange-device: one more CPU device per process, beside the training devices.
  processes.init_jax(args.devices + settings.exchange_device, args.processes, args.process_id,
                    args.coordinator, args.heartbeat_timeout)
  results, states = _train_all(args, task, load(), settings, algorithms, progress=progress)
  if (args.process_id or 0) == 0:  # process 0 prints and writes the results
    reports.report_training(args, task, load(), settings, results, states,
                            progress=Progress(PROG, progress))
  return 0


def _train_all(args: argparse.Namespace, task: Task, data: Data, settings: Settings,
               algorithms: tuple[str, ...], *,
               progress: bool) -> tuple[list[dict], dict[str, dict]]:
  """Trains with each of ``algorithms``; their results and (with ``--save-params``) states.
  With ``progress``, each run shows its phases and steps on stderr."""
  process = args.process_id or 0

  def on_step(step: int) -> None:
    if args.fail_at_step == step and process == args.processes - 1:
      sys.stderr.write(f"{PROG}: process {process}: exiting at step {step} (--fail-at-step)\n")
      sys.stderr.flush()
      os._exit(1)

  results, states = [], {}
  for algorithm in algorithms:
    try:
      result = trainer.train(
        task, data, dataclasses.replace(settings, algorithm=algorithm), on_step=on_step,
        progress=progress,
        checkpoint_dir=os.path.join(args.out, "checkpoints", algorithm),
        checkpoint_every=args.checkpoint_every or 0, resume=args.resume,
        keep_state=bool(args.save_params))
    except CheckpointMismatchError as e:
      if e.every_process and process != 0:
        raise errors.SaidByProcessZero from None
      raise CommandError(f"argument --resume: {e}") from None
    states[algorithm] = result.pop("final_state", {})
    results.append(result)
  return results, states
