"""What a run shows on stderr while it works: each phase as it runs, then a bar over its steps.

A run of ``optax-dist train`` spends tens of seconds before its first step (building the model,
compiling each step, the first evaluation) and seconds in each evaluation. :class:`Progress`
shows every such phase as one line, ``NAME: building the model… 00:03``, whose time counts up
while the phase runs and stays on the screen when it ends; then the steps' bar (``NAME:
40%|████ | 8/20``), whose description says when the run is evaluating (``NAME, evaluating at
step 20``). Every line shown is refreshed every :data:`REFRESH_SECONDS` by a thread of its own,
so a phase spent inside one call (XLA compiling a program) still shows its time going by.
The lines are ``tqdm`` bars (the ``examples`` extra, imported when a line is shown).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

REFRESH_SECONDS = 1.0
"""Seconds between two refreshes of a line on the screen."""


class Progress:
  """The phases and the steps of one run (``name``: the algorithm), on stderr when ``enabled``;
  disabled, every method shows nothing and imports nothing."""

  def __init__(self, name: str = "", enabled: bool = False):
    self.name = name
    self.enabled = enabled

  @contextlib.contextmanager
  def phase(self, what: str) -> Iterator[None]:
    """Shows ``NAME: what… MM:SS`` while the ``with`` block runs; the line stays, with the
    phase's time, when it ends."""
    if not self.enabled:
      yield
      return
    with _refreshed(new_bar(desc=f"{self.name}: {what}", bar_format="{desc}… {elapsed}",
                         leave=True)):
      yield

  @contextlib.contextmanager
  def steps(self, total: int, done: int) -> Iterator[Steps]:
    """The bar over the steps ``done + 1`` to ``total``, cleared when the ``with`` block ends."""
    if not self.enabled:
      yield Steps(None, self.name)
      return
    with _refreshed(new_bar(total=total, initial=done, desc=self.name, unit="step",
                         leave=False)) as bar:
      yield Steps(bar, self.name)


class Steps:
  """The steps' bar of :meth:`Progress.steps` (``bar``: a ``tqdm``, or ``None``: not shown)."""

  def __init__(self, bar: Any, name: str):
    self._bar = bar
    self._name = name

  def update(self) -> None:
    """Counts one more step."""
    if self._bar is not None:
      self._bar.update(1)

  @contextlib.contextmanager
  def phase(self, what: str) -> Iterator[None]:
    """``NAME, what`` as the bar's description while the ``with`` block runs."""
    if self._bar is None:
      yield
      return
    self._bar.set_description_str(f"{self._name}, {what}")
    try:
      yield
    finally:
      self._bar.set_description_str(self._name)


QUIET = Progress()
"""A run that shows nothing."""


def new_bar(**kwargs: Any) -> Any:
  """A ``tqdm`` bar on stderr with ``kwargs`` (the commands' bars, this module's and the
  fault-tolerant run's)."""
  from tqdm.auto import tqdm  # the examples extra, checked before a run

  return tqdm(file=sys.stderr, **kwargs)


@contextlib.contextmanager
def _refreshed(bar: Any) -> Iterator[Any]:
  """``bar``, refreshed every :data:`REFRESH_SECONDS` by a thread until the block ends, then
  closed."""
  stop = threading.Event()

  def refresh() -> None:
    while not stop.wait(REFRESH_SECONDS):
      bar.refresh()

  thread = threading.Thread(target=refresh, name="optax-dist progress", daemon=True)
  thread.start()
  try:
    yield bar
  finally:
    stop.set()
    thread.join()
    bar.close()
