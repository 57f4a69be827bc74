"""``optax-dist train --fault-tolerant``: the command's task trained by replica processes that
die, come back and heal while the run goes on (the ``ft`` extra: torch and torchft).

``--replicas R`` replicas, each its own JAX program with ``--devices`` devices (its minibatch
split over them, the gradients reduced within it on every step), or with ``--processes P`` a
group of P ``jax.distributed`` processes of ``--devices`` devices each (a replica group: its
minibatch split over the group's devices), meet once per round
(every ``--sync-period`` H inner steps) through torchft: a quorum of at least
``--min-replicas``, a heal for a replica that is behind, the exchange, a vote, then a commit or
an abort on every member (:mod:`optax_dist.fault_tolerance.torchft_engine`). The
:class:`~optax_dist.fault_tolerance.launcher.Launcher` of the command line's
:class:`~optax_dist.fault_tolerance.launcher.LaunchConfig` (:func:`ft_flags.launch_config
<optax_dist.cli.ft_flags.launch_config>`) runs the Lighthouse and restarts a replica that dies;
each replica is ``optax-dist replica`` (:mod:`optax_dist.cli.ft_replica`) with this command's
flags, so a replica started by hand with the same flags joins the same run.

The replicas train ``--task`` as ``optax-dist train --replicas R --devices R*P*D`` would
(:mod:`optax_dist.cli.ft_task`): the same model, initial params, loss, inner and outer
optimizers, and the same minibatches. Each replica writes ``OUT/replicas/replica_<i>.jsonl``
(one line per round) and, once finished, ``OUT/replicas/final_<i>.json``
(:class:`~optax_dist.fault_tolerance.rundir.RunDir`). The command then prints the run's
:meth:`~optax_dist.fault_tolerance.rundir.RunDir.summary` and writes it to
``OUT/fault_tolerant_<algorithm>.json`` (in decoupled rounds with each replica's tokens merged,
lost and estimated lost at kills: ``tokens``), and plots the replicas' training loss against
wall-clock seconds, their restarts and heals marked, in
``OUT/fault_tolerant_loss_<algorithm>.png`` (:func:`~optax_dist.cli.reports.plot_loss`). While
the run goes on it shows on stderr the committed rounds and tokens, the tokens per second, the
last committed round's training loss, and each restart and heal
(:mod:`optax_dist.cli.ft_progress`; not with ``--no-progress``).

A new run refuses an ``--out`` that holds a fault-tolerant run's checkpoints; ``--resume``
continues that run instead, with the same settings (their fingerprint checked): the Lighthouse
and every replica start again, each replica from the newest checkpoint that every member of
its round wrote its local state for (rebuilt whole, so the run goes on as if never stopped;
a replica without its own local state heals from a peer), the lines and logs appended to.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

from optax_dist.cli import errors, ft_flags, ft_progress, ft_task, reports
from optax_dist.cli.errors import PROG, CommandError
from optax_dist.cli.tasks import TASKS, Task
from optax_dist.fault_tolerance import checkpoints, decoupled
from optax_dist.fault_tolerance.launcher import Launcher
from optax_dist.fault_tolerance.rundir import RunDir

REPLICA_COMMAND = ("-m", "optax_dist.cli", "replica")
"""A replica's command line after the Python interpreter: ``optax-dist replica``."""


def run(args: argparse.Namespace) -> int:
  """Runs ``optax-dist train --fault-tolerant`` (``args`` resolved by
  :func:`optax_dist.cli.ft_flags.resolve`): checks, then the launcher (the Lighthouse and
  ``--replicas`` processes of ``optax-dist replica`` with this command's flags); prints the
  run's summary. Returns 0, or 1 if fewer than ``--min-replicas`` replicas finished or two
  replicas committed one round with different state hashes."""
  task = TASKS[args.task]
  errors.require_task(task)
  data = task.load(args.seed)
  s = ft_task.settings(args, task, lambda: data)
  ft_task.check_protocol(task, data, s)
  protocol = ft_task.protocol(s, args.staleness_rule)
  if args.decoupled:
    _check_decoupled(args, s)
  config = ft_flags.launch_config(args, REPLICA_COMMAND)
  run_dir = RunDir(args.out)
  _take_out(args, run_dir, lambda: ft_task.fingerprint(task, data, s, args.replicas))
  # torchft's Rust logs (every quorum, in this process and the replicas'): errors only.
  os.environ.setdefault("RUST_LOG", "error")
  _share_compilations(run_dir)
  try:
    launcher = Launcher(config)
  except RuntimeError as e:
    raise CommandError(str(e)) from None
  if not args.no_progress:
    sys.stderr.write(f"{PROG}: fault-tolerant {args.algorithm}: lighthouse {launcher.url},"
                     f" {args.replicas} replicas of {args.processes} process(es)"
                     f" (logs: {args.out}/replica_<i>.log)\n")
    sys.stderr.flush()
  started, rounds = time.time(), protocol.rounds_until(s.steps)
  try:
    with ft_progress.Watch(run_dir, rounds, enabled=not args.no_progress):
      status = launcher.run()
  finally:
    launcher.close()
  result = run_dir.summary(args.replicas, sum(s.restarts for s in launcher.slots),
                           args.processes)
  result.update(algorithm=args.algorithm, task=task.name, replicas=args.replicas,
                min_replicas=args.min_replicas, launcher_status=status)
  if args.decoupled:
    result["tokens"] = _tokens(run_dir, args.replicas, protocol,
                               ft_task.tokens_per_step(data, s, args.replicas))
  (run_dir.out / f"fault_tolerant_{args.algorithm}.json").write_text(
    json.dumps(result, indent=1) + "\n")
  plot = _plot_loss(run_dir, args, task, started)
  print(_describe(result, task))
  print(f"wrote {run_dir.out / f'fault_tolerant_{args.algorithm}.json'} and {plot}")
  return 0 if status == 0 and result["hashes_agree"] else 1


def _check_decoupled(args: argparse.Namespace, s: Any) -> None:
  """Raises :class:`CommandError` if the replicas' protocol refuses ``--staleness-rule``, before
  any replica starts: ``delayed_nesterov`` needs an outer optimizer, which ``local_sgd`` does not
  have (with ``diloco`` and ``streaming_diloco`` the protocol's is then delayed Nesterov)."""
  try:
    decoupled.check_settings("train", ft_task.protocol(s, args.staleness_rule),
                             num_replicas=args.replicas,
                             speeds=None, min_quorum=args.min_quorum,
                             grace_window=args.grace_window, staleness_rule=args.staleness_rule,
                             max_staleness=args.max_staleness)
  except ValueError as e:
    raise CommandError(f"argument --staleness-rule: {e}") from None


def _plot_loss(run_dir: RunDir, args: argparse.Namespace, task: Task,
               started: float) -> pathlib.Path:
  """Writes ``OUT/fault_tolerant_loss_<algorithm>.png``, the replicas' training loss against
  the seconds since ``started`` with the restarts and heals marked
  (:func:`optax_dist.cli.reports.plot_loss`); returns its path."""
  path = run_dir.out / f"fault_tolerant_loss_{args.algorithm}.png"
  reports.plot_loss(run_dir.lines(), run_dir.restarts(), started, str(path),
                    f"fault-tolerant {args.algorithm} on {task.name}, {args.replicas} replicas")
  return path


def _take_out(args: argparse.Namespace, run_dir: RunDir, fingerprint: Callable[[], int]) -> None:
  """Readies ``--out`` for the run: a new run clears an earlier run's files
  (:meth:`RunDir.clear`), and is refused where they hold a fault-tolerant run's checkpoints;
  ``--resume`` keeps them (its replicas restore the checkpoints and append to the lines and
  logs: :meth:`RunDir.clear_marks`) once the checkpoint its replicas start from has this
  run's settings (``fingerprint()``: :func:`ft_task.fingerprint
  <optax_dist.cli.ft_task.fingerprint>`).

  Raises:
    CommandError: a new run into an ``--out`` that holds checkpoints; ``--resume`` where there
      is none, or of other settings.
  """
  saved = run_dir.checkpoints()
  if not args.resume:
    if saved:
      raise CommandError(
        f"argument --out: {run_dir.checkpoint_dir} holds a fault-tolerant run's checkpoints;"
        " continue that run with --resume, or give another --out (or remove that directory)")
    run_dir.clear()
    run_dir.add_launch()
    return
  if not saved:
    raise CommandError(f"argument --resume: no fault-tolerant checkpoint under"
                       f" {run_dir.checkpoint_dir} to continue from")
  start = checkpoints.resume_point(run_dir.checkpoint_dir) or saved[-1]
  if start["fingerprint"] != (mine := fingerprint()):
    raise CommandError(
      f"argument --resume: {start['path']} was written with other settings (fingerprint"
      f" {start['fingerprint']}, these settings' {mine}); give the run's own settings, or"
      " another --out for a new run")
  run_dir.clear_marks()
  run_dir.add_launch()


def _share_compilations(run_dir: RunDir) -> None:
  """Gives the replicas (through the environment they inherit) a persistent JAX compilation
  cache under ``OUT/compilation_cache``, unless ``JAX_COMPILATION_CACHE_DIR`` is set already,
  every program cached: a restarted replica reads its programs back instead of compiling them
  again, which is most of its time to heal. A hit runs the executable the miss compiled: the
  results do not change."""
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        str(run_dir.out.resolve() / "compilation_cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _count(n: int, thing: str) -> str:
  return f"{n} {thing}{'s' * (n != 1)}"


def _tokens(run_dir: RunDir, replicas: int, protocol: Any,
            tokens_per_step: int) -> dict[str, dict[str, int]]:
  """A decoupled run's tokens by replica: ``merged`` and ``lost`` as its round and boundary
  lines count them (:func:`~optax_dist.fault_tolerance.decoupled.accounts`), and ``unlogged``,
  its killed processes' steps no line counts, estimated
  (:func:`~optax_dist.fault_tolerance.decoupled.unlogged`: to their next boundary) and lost."""
  lines = [x for i in range(replicas) for x in run_dir.lines(i)]
  lines += [x for i in range(replicas) for x in run_dir.boundaries(i)]
  estimated = decoupled.unlogged(lines, protocol, tokens_per_step)
  return {str(i): {**v, "unlogged": estimated.get(i, 0)}
          for i, v in decoupled.accounts(lines).items()}


def _describe(result: dict[str, Any], task: Task) -> str:
  """Two lines (three in decoupled rounds: the tokens): the rounds, restarts, heals and hashes;
  the final test metric."""
  heals = result["heal_seconds"]
  healed = f" ({max(heals):.2f} s at most)" if heals else ""
  agree = ("the state hashes agree on every committed round" if result["hashes_agree"]
           else "STATE HASHES DIFFER on a committed round")
  first = (f"fault-tolerant {result['algorithm']} on {task.name}, {result['replicas']} replicas"
           f" (quorum >= {result['min_replicas']}): {result['rounds_committed']} rounds"
           f" committed, {result['rounds_aborted']} aborted,"
           f" {_count(result['restarts'], 'restart')}, {_count(len(heals), 'heal')}{healed};"
           f" {agree}")
  if "tokens" in result:
    merged, lost, unlogged = (sum(v[k] for v in result["tokens"].values())
                              for k in ("merged", "lost", "unlogged"))
    first += (f"\ntokens: {merged:,} merged, {lost + unlogged:,} lost ({unlogged:,} of them"
              " killed processes' steps after their last boundary, estimated)")
  if not result["final"]:
    return first + "\nno replica finished"
  values = {f"{v[f'test_{task.metric_key}']:.4f}" for v in result["final"].values()}
  second = (f"final {task.metric_label} of the evaluated params: {', '.join(sorted(values))}"
            f" (replicas {', '.join(map(str, result['finished']))} finished)")
  return first + "\n" + second
