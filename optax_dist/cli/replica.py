"""``optax-dist replica``: one replica of a fault-tolerant run over torchft, joining the run
that a Lighthouse coordinates (a first start, or a restart under the same id: it heals).

The flags, the task and the log are :mod:`optax_dist.fault_tolerance.replica`'s: one JSON line
per round in ``OUT/replicas/replica_<I>.jsonl``. Needs the ``ft`` extra (torch, torchft); a
mistake, the missing extra or a quorum that never forms is one line, exit status 2.

``add_parser(subparsers)`` adds the subcommand to an ``argparse`` parser; ``run(args)`` runs it.
"""

from __future__ import annotations

import argparse
from typing import Any

from optax_dist.cli.arguments import Formatter
from optax_dist.cli.errors import CommandError
from optax_dist.fault_tolerance import replica


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
  """Adds ``replica`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns it."""
  parser = subparsers.add_parser(
    "replica", help="run one replica of a fault-tolerant run over torchft (the ft extra)",
    description="Join the fault-tolerant run a torchft Lighthouse coordinates as replica"
    " --replica-id (its data slot): quorum, heal if behind, exchange, vote, once per round of"
    " --sync-period steps, on a synthetic linear regression.", formatter_class=Formatter)
  replica.add_arguments(parser)
  return parser


def run(args: argparse.Namespace) -> int:
  """Runs the replica; a :class:`~optax_dist.fault_tolerance.replica.ReplicaError` becomes a
  :class:`CommandError` (one line, status 2)."""
  try:
    return replica.run(args)
  except replica.ReplicaError as e:
    raise CommandError(str(e)) from None
