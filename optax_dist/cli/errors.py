"""How ``optax-dist`` reports a mistake: one line, ``optax-dist: error: ...``, exit status 2."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable
from typing import Any

PROG = "optax-dist"

EXAMPLES_MODULES = ("flax", "sklearn", "matplotlib", "tqdm", "orbax.checkpoint")
"""The modules of the ``examples`` extra, which every subcommand needs."""

TRAINING_MODULES = ("flax", "sklearn", "matplotlib", "tqdm")
"""The modules of the ``examples`` extra every subcommand that trains needs (Orbax: only for
checkpoints)."""

EXAMPLES_HINT = 'optax-dist needs the "examples" extra: pip install "optax-dist[examples]"'


class CommandError(Exception):
  """A mistake in the command line or in its environment, said in one line (exit status 2)."""


class SaidByProcessZero(CommandError):
  """A mistake every process of a run finds alike (process 0 decides, or all read the same),
  raised on the other processes: they exit with status 2 without a line, and process 0 says it
  once."""


def report(message: str) -> None:
  """Writes ``optax-dist: error: message`` to stderr."""
  sys.stderr.write(f"{PROG}: error: {message}\n")
  sys.stderr.flush()


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # a parent package is missing, or blocked
    return False


def require(modules: Iterable[str], hint: str = EXAMPLES_HINT) -> None:
  """Raises :class:`CommandError` naming the first of ``modules`` that is not installed.

  Checks without importing, so that the message comes before any slow import.
  """
  for module in modules:
    if not _installed(module):
      raise CommandError(f"no module named {module!r}; {hint}")


def require_task(task: Any, *, checkpoints: bool = False) -> None:
  """Raises :class:`CommandError` unless the modules a run of ``task`` (a
  :class:`optax_dist.cli.tasks.Task`) needs are installed, Orbax too with ``checkpoints``."""
  require(TRAINING_MODULES + (("orbax.checkpoint",) if checkpoints else ()))
  require(task.requires, task.install or EXAMPLES_HINT)


def missing_extra(error: ModuleNotFoundError) -> str | None:
  """The one-line message for ``error`` if it names a module of the ``examples`` extra."""
  name = error.name or ""
  for module in EXAMPLES_MODULES:
    if name.split(".")[0] == module.split(".")[0]:
      return f"no module named {module!r}; {EXAMPLES_HINT}"
  return None
