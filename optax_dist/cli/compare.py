"""``optax-dist compare``: the algorithms marked ``compared`` trained side by side.

Trains with each of :data:`optax_dist.cli.algorithms.COMPARED` on the same settings, one after
the other (:func:`optax_dist.cli.train.run_training`); prints one table and writes
``results.json`` and ``accuracy.png`` under ``--out``.

``add_parser(subparsers)`` adds the subcommand to an ``argparse`` parser; ``run(args)`` runs it.
"""

from __future__ import annotations

import argparse
from typing import Any

from optax_dist.cli.algorithms import COMPARED
from optax_dist.cli.arguments import EPILOG, Formatter, training_parser
from optax_dist.cli.train import run_training


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
  """Adds ``compare`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns it."""
  return subparsers.add_parser(
    "compare", parents=[training_parser()], help=f"compare {', '.join(COMPARED)}",
    description=f"Train with {', '.join(COMPARED)} and compare them; writes results.json and"
    " accuracy.png under --out.",
    epilog=EPILOG, formatter_class=Formatter,
  )


def run(args: argparse.Namespace) -> int:
  """Runs ``optax-dist compare``; returns the exit status."""
  return run_training(args, COMPARED)
