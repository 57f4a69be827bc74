"""What ``optax-dist train --fault-tolerant`` shows on stderr while its replicas train.

A thread reads the run's directory (:class:`~optax_dist.fault_tolerance.rundir.RunDir`: the
replicas' JSON lines and the launcher's restarts) every :data:`REFRESH_SECONDS` and shows

* the status (:func:`status`): the committed rounds (of the run's total), the committed tokens
  (the members' merge weights), tokens per second since the command started (the tokens of the
  rounds committed since), and the last committed round's training loss, the mean of its
  members' round losses weighted by their tokens (a healed member, weight 0, is left out);
* one line per restart and per heal as they happen (:func:`events`; a resumed run's earlier
  ones are not shown again), e.g. ``replica 1 restarted (exit -9)`` (a negative status: killed
  by that signal), ``replica 1 healed from replica 0 at round 12``.

On a terminal the status is a ``tqdm`` bar over the rounds (the ``examples`` extra, as the
other commands' bars: :mod:`optax_dist.cli.progress`), the events printed above it; elsewhere (a
log, CI) plain lines: each event, and the status when it changed, at most every
:data:`PLAIN_SECONDS`, and once at the end. ``--no-progress`` shows nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Self

from optax_dist.cli.errors import PROG
from optax_dist.cli.progress import REFRESH_SECONDS, new_bar
from optax_dist.fault_tolerance.rundir import RunDir

PLAIN_SECONDS = 10.0
"""Seconds between two status lines when stderr is not a terminal."""


def status(lines: list[dict[str, Any]], started: float, now: float) -> dict[str, Any]:
  """The run's status from its replicas' ``lines`` at ``now`` (Unix seconds) for a command
  started at ``started``: ``rounds`` (round indices some replica committed), ``tokens`` (the
  sum of the committed lines' ``weight``), ``tokens_per_second`` (the weights of the committed
  lines written since ``started``, over ``now - started``; 0 before a second) and ``loss`` (of
  the last committed round: :math:`\\sum_i w_i \\ell_i / \\sum_i w_i` over its committed lines
  with a ``loss``; ``None`` if none or if their weights are all 0)."""
  committed = [x for x in lines if x["committed"]]
  rounds = {x["round"] for x in committed}
  recent = sum(x["weight"] for x in committed if x["time"] >= started)
  last = [x for x in committed
          if x["round"] == max(rounds, default=None) and x.get("loss") is not None]
  weight = sum(x["weight"] for x in last)
  return {"rounds": len(rounds), "tokens": sum(x["weight"] for x in committed),
          "tokens_per_second": recent / (now - started) if now - started >= 1.0 else 0.0,
          "loss": sum(x["weight"] * x["loss"] for x in last) / weight if weight else None}


def status_text(s: dict[str, Any]) -> str:
  """:func:`status` in words after the rounds: ``3,840 tokens (250/s), loss 0.8123``."""
  loss = "" if s["loss"] is None else f", loss {s['loss']:.4f}"
  return f"{s['tokens']:,} tokens ({s['tokens_per_second']:,.0f}/s){loss}"


def events(lines: list[dict[str, Any]], restarts: list[dict[str, Any]]) -> list[tuple]:
  """``(time, text)`` of each restart (``restarts``: :meth:`RunDir.restarts`) and each heal
  (a line with ``healed``, its ``donor`` named when the line has one), by time."""
  found = [(r["time"], f"replica {r['replica']} restarted (exit {r['status']})")
           for r in restarts]
  for x in lines:
    if x["healed"]:
      donor = "" if x.get("donor") is None else f" from replica {x['donor']}"
      found.append((x["time"], f"replica {x['replica']} healed{donor} at round {x['round']}"))
  return sorted(found)


class Watch:
  """Shows the run under ``run_dir`` (see the module's docstring) while the ``with`` block
  runs, over ``total`` rounds; ``enabled`` False: shows nothing, starts no thread.
  ``terminal``: whether stderr is a terminal (default: asked)."""

  def __init__(self, run_dir: RunDir, total: int, enabled: bool = True,
               terminal: bool | None = None):
    self.run_dir, self.total, self.enabled = run_dir, total, enabled
    self.terminal = sys.stderr.isatty() if terminal is None else terminal
    self._shown: set = set()
    self._said, self._said_at, self._bar = None, float("-inf"), None
    self._stop = threading.Event()

  def __enter__(self) -> Self:
    if self.enabled:
      self.started = time.time()
      if self.terminal:
        self._bar = new_bar(total=self.total, desc=PROG, unit="round", leave=True)
      self._thread = threading.Thread(target=self._run, name="optax-dist ft progress",
                                      daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc: object) -> None:
    if not self.enabled:
      return
    self._stop.set()
    self._thread.join()
    self.poll(final=True)
    if self._bar is not None:
      self._bar.close()

  def _run(self) -> None:
    while not self._stop.wait(REFRESH_SECONDS):
      self.poll()

  def poll(self, final: bool = False) -> None:
    """Reads the run's files once: shows the events not shown yet, then the status (plain: if
    it changed and :data:`PLAIN_SECONDS` have passed, or ``final``)."""
    lines, now = self.run_dir.lines(), time.time()
    for event in events(lines, self.run_dir.restarts()):
      if event not in self._shown and event[0] >= self.started:
        self._shown.add(event)
        self._write(event[1])
    s = status(lines, self.started, now)
    if self._bar is not None:
      self._bar.n = s["rounds"]
      self._bar.set_postfix_str(status_text(s))  # refreshes the bar
      return
    said = (s["rounds"], s["tokens"])
    if said != self._said and (final or now - self._said_at >= PLAIN_SECONDS):
      self._said, self._said_at = said, now
      self._write(f"{s['rounds']}/{self.total} rounds committed, {status_text(s)}")

  def _write(self, text: str) -> None:
    if self._bar is not None:
      self._bar.write(f"{PROG}: {text}", file=sys.stderr)
    else:
      sys.stderr.write(f"{PROG}: {text}\n")
      sys.stderr.flush()
