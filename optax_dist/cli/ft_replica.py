"""``optax-dist replica``: one replica of a fault-tolerant run over torchft, joining the run
that a Lighthouse coordinates (a first start, or a restart under the same id: it heals).

It takes ``train``'s flags (the task, the algorithm and its settings, ``--replicas R``,
``--devices``, the fault-tolerance flags) and trains replica ``--replica-id`` of the run those
flags describe (:func:`run`; the task as :mod:`optax_dist.cli.ft_task` shares it out):
``optax-dist train --fault-tolerant`` (:mod:`optax_dist.cli.ft_train`) starts its replicas
this way, and a replica started by hand with the same flags joins the same run. One JSON line
per round in ``OUT/replicas/replica_<I>.jsonl``, and once finished ``OUT/replicas/final_<I>.json``
with the test metric of its final evaluated params (the anchor; ``local_sgd``: the last
average) and ``replica_hash``, the :func:`~optax_dist.fault_tolerance.state_hash` of its whole
final state (params, optimizer state, global state). Needs the ``ft`` extra (torch, torchft); a mistake, the missing extra or a quorum that
never forms is one line, exit status 2.

``add_parser(subparsers)`` adds the subcommand to an ``argparse`` parser; ``run(args)`` runs it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from optax_dist.cli import errors, ft_flags, ft_task
from optax_dist.cli.arguments import Formatter, integer_at_least_0, training_parser
from optax_dist.cli.errors import CommandError
from optax_dist.cli.processes import init_jax
from optax_dist.cli.tasks import TASKS
from optax_dist.fault_tolerance import SUPPORTED, state_hash
from optax_dist.fault_tolerance import replica as ft_replica
from optax_dist.fault_tolerance.rundir import RunDir


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
  """Adds ``replica`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns it."""
  parser = subparsers.add_parser(
    "replica", parents=[training_parser()],
    help="run one replica of a fault-tolerant run over torchft (the ft extra)",
    description="Join the fault-tolerant run a torchft Lighthouse coordinates as replica"
    " --replica-id (its data slot) of the run train --fault-tolerant's flags describe: quorum,"
    " heal if behind, exchange, vote, once per round of --sync-period steps.",
    formatter_class=Formatter)
  parser.add_argument("--algorithm", choices=SUPPORTED, default="diloco",
                      help="the algorithm (default: diloco)")
  parser.add_argument("--lighthouse", required=True, help="the Lighthouse's URL, http://host:port")
  parser.add_argument("--replica-id", type=integer_at_least_0, required=True,
                      help="the replica's id and data slot, 0 to R-1")
  parser.add_argument("--parent-death", action="store_true",
                      help="die (SIGKILL) when the parent process dies")
  parser.add_argument("--wait-for-takeover", action="store_true",
                      help="a warm standby: compile, then wait for a line on stdin before joining"
                      " under --replica-id (the launcher's --standby)")
  ft_flags.add_arguments(parser)
  return parser


def run(args: argparse.Namespace) -> int:
  """Runs the replica; returns 0. A mistake or a failure is a :class:`CommandError` (one line,
  status 2)."""
  args.fault_tolerant = True
  task = TASKS[args.task]
  errors.require_task(task)
  ft_flags.resolve(args)
  ft_replica.start_process(args.parent_death, args.wait_for_takeover)
  init_jax(args.devices, args.processes, args.process_id, args.coordinator,
           args.heartbeat_timeout)
  data = task.load(args.seed)
  s = ft_task.settings(args, task, lambda: data)
  params, loss_and_grad, batch_fn, tokens, evaluate = ft_task.task_engine(
    task, data, s, args.replicas)
  run_dir = RunDir(args.out)
  try:
    state = ft_replica.serve(
      ft_task.protocol(s, args.staleness_rule), params, loss_and_grad, batch_fn,
      steps=s.steps, seed=s.seed, tokens_per_step=tokens, lighthouse=args.lighthouse,
      replica_id=args.replica_id, out=args.out, host=args.host,
      min_replicas=1 if args.decoupled else args.min_replicas,
      quorum_timeout=args.quorum_timeout, timeout=args.exchange_timeout,
      on_ready=lambda: _meet(run_dir, args.replica_id, args.replicas, args.quorum_timeout),
      checkpoint_every=args.checkpoint_every, standby=args.wait_for_takeover,
      exchange_retries=args.exchange_retries, num_replicas=args.replicas,
      **({name: getattr(args, name) for name in (*ft_flags.DECOUPLED, "max_staleness")}
         if args.decoupled else {}))
  except ft_replica.ReplicaError as e:
    raise CommandError(str(e)) from None
  final = final_record(args.replica_id, state, task, evaluate)  # every rank: it may be collective
  if not args.process_id:  # rank 0 of a replica group
    run_dir.final_file(args.replica_id).write_text(json.dumps(final) + "\n")
  return 0


def final_record(replica_id: int, state: Any, task: Any, evaluate: Callable) -> dict:
  """What ``OUT/replicas/final_<replica_id>.json`` holds of replica ``replica_id``'s final
  :class:`~optax_dist.fault_tolerance.ReplicaState` ``state``: its ``local_step``, the task's
  test metric of its evaluated params and the :func:`~optax_dist.fault_tolerance.state_hash`
  of the whole state."""
  return {"replica": replica_id, "step": int(state.opt_state.local_step),
          f"test_{task.metric_key}": evaluate(ft_task.evaluated(state)),
          "replica_hash": state_hash(state)}


def _meet(run_dir: RunDir, replica_id: int, replicas: int, timeout: float) -> None:
  """A start barrier: writes ``OUT/replicas/ready_<replica_id>``, then waits until every
  replica's file exists, at most ``timeout`` seconds, so that replicas started together, whose
  imports and compilations end seconds apart, meet in their first quorum. A replica restarted
  later finds every file and goes on at once."""
  run_dir.ready_file(replica_id).touch()
  deadline = time.monotonic() + timeout
  while (time.monotonic() < deadline
         and not all(run_dir.ready_file(i).exists() for i in range(replicas))):
    time.sleep(0.02)
