"""The ``optax-dist`` command: the entry point, which parses the command line and runs a
subcommand.

Each subcommand is a module with ``add_parser(subparsers)`` and ``run(args)``:
``train`` (:mod:`optax_dist.cli.train`) trains with one algorithm, ``compare``
(:mod:`optax_dist.cli.compare`) with several side by side, ``async``
(:mod:`optax_dist.cli.async_run`) compares asynchronous protocols, emulated, ``plan``
(:mod:`optax_dist.cli.plan`) computes each method's utilization over a link, and ``replica``
(:mod:`optax_dist.cli.ft_replica`) runs one replica of a fault-tolerant run over torchft (the ``ft``
extra), as ``train --fault-tolerant`` starts them. A mistake is one line,
``optax-dist: error: ...``, with exit status 2. Training needs the ``examples`` extra.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from optax_dist import __version__
from optax_dist.cli import errors
from optax_dist.cli.arguments import EPILOG, Formatter, Parser
from optax_dist.cli.errors import PROG, CommandError

COMMANDS = {"train": "train", "compare": "compare", "async": "async_run", "plan": "plan",
            "replica": "ft_replica"}
"""The module under ``optax_dist.cli`` of each subcommand, in the order of the help."""


def command(name: str) -> ModuleType:
  """The module of subcommand ``name`` (:data:`COMMANDS`), imported."""
  return importlib.import_module(f"optax_dist.cli.{COMMANDS[name]}")


def build_parser(commands: Sequence[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
  """The argument parser of ``optax-dist``: one subparser per subcommand of ``commands``
  (default: every one of :data:`COMMANDS`; the usage names them all either way)."""
  parser = Parser(
    prog=PROG,
    description="Data-parallel training with the optax_dist transformations (an MLP on"
    " scikit-learn's digits by default), over emulated CPU devices of one or more JAX processes.",
    epilog=EPILOG, formatter_class=Formatter,
  )
  parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
  subparsers = parser.add_subparsers(dest="command", required=True,
                                     metavar="{" + ",".join(COMMANDS) + "}")
  for name in commands:
    command(name).add_parser(subparsers)
  return parser


def main(argv: list[str] | None = None) -> int:
  """Runs ``optax-dist``; returns the exit status (2 for a mistake, said in one line).

  ``args.argv`` holds the command line, with which ``train`` and ``compare`` start the other
  local processes (:func:`optax_dist.cli.processes.launch`). A command line that starts with a
  subcommand imports that subcommand's module alone (a replica's process, restarted after a
  fault, imports neither training, plotting nor the emulator); any other builds the whole
  parser.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  commands = argv[:1] if argv and argv[0] in COMMANDS else tuple(COMMANDS)
  args = build_parser(commands).parse_args(argv)
  args.argv = argv
  try:
    return command(args.command).run(args)
  except errors.SaidByProcessZero:
    pass
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
