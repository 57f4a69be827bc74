"""``optax-dist replica``: one replica of a fault-tolerant run over torchft, joining the run
that a Lighthouse coordinates (a first start, or a restart under the same id: it heals).

It takes ``train``'s flags (the task, the algorithm and its settings, ``--replicas R``,
``--devices``, the fault-tolerance flags) and trains replica ``--replica-id`` of the run those
flags describe (:func:`optax_dist.cli.fault_tolerant.run_replica`): ``optax-dist train
--fault-tolerant`` starts its replicas this way, and a replica started by hand with the same
flags joins the same run. One JSON line per round in ``OUT/replicas/replica_<I>.jsonl``. Needs
the ``ft`` extra (torch, torchft); a mistake, the missing extra or a quorum that never forms is
one line, exit status 2.

``add_parser(subparsers)`` adds the subcommand to an ``argparse`` parser; ``run(args)`` runs it.
"""

from __future__ import annotations

import argparse
from typing import Any

from optax_dist.cli import fault_tolerant
from optax_dist.cli.arguments import Formatter, integer_at_least_0, training_parser
from optax_dist.fault_tolerance import SUPPORTED
from optax_dist.fault_tolerance import replica as ft_replica


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
  ft_replica.add_process_flags(parser)
  fault_tolerant.add_arguments(parser)
  return parser


def run(args: argparse.Namespace) -> int:
  """Runs the replica; a mistake or a failure is a :class:`CommandError` (one line, status 2)."""
  return fault_tolerant.run_replica(args)
