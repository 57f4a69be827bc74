"""The chaos study's fault schedule, a fixed-seed Poisson process (:func:`schedule`), and the rule
that moves a fault its replica cannot take (:func:`redraw`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np

KINDS = ("kill", "stop", "link")


@dataclasses.dataclass(frozen=True)
class TimedFault:
  """``kind`` on ``replica`` (Lighthouse: -1) ``at`` s after the first commit, for ``seconds``."""

  at: float
  kind: str
  replica: int
  seconds: float = 0.0


def schedule(seed: int, rate: float, horizon: float, replicas: int,
             stop_seconds: tuple[float, float] = (3.0, 10.0),
             link_seconds: tuple[float, float] = (5.0, 15.0)) -> list[TimedFault]:
  """The faults of a Poisson process of ``rate`` per second over ``[0, horizon)`` seconds, each of
  a uniform kind (:data:`KINDS`) on a uniform replica, a stop or link down for a uniform length
  in ``stop_seconds`` or ``link_seconds``: drawn in turn from ``default_rng(seed)``, so that a
  longer horizon extends the same list. ``ValueError`` for a ``rate`` or ``horizon`` not
  positive, ``replicas < 1``, or ``stop_seconds`` or ``link_seconds`` not positive intervals."""
  lengths = {"kill": (0.0, 0.0), "stop": stop_seconds, "link": link_seconds}
  if not (rate > 0 and horizon > 0 and replicas >= 1 and
          all(0 < lengths[k][0] <= lengths[k][1] for k in ("stop", "link"))):
    raise ValueError(f"chaos.schedule: need rate > 0, horizon > 0, replicas >= 1 and intervals"
                     f" 0 < a <= b, got rate={rate}, horizon={horizon}, replicas={replicas},"
                     f" stop_seconds={stop_seconds}, link_seconds={link_seconds}")
  rng, t, faults = np.random.default_rng(seed), 0.0, []
  while True:
    t += rng.exponential(1 / rate)
    kind = KINDS[rng.integers(len(KINDS))]
    replica, seconds = int(rng.integers(replicas)), float(rng.uniform(*lengths[kind]))
    if t >= horizon:
      return faults
    faults.append(TimedFault(round(t, 3), kind, replica, round(seconds, 3)))


def redraw_rng(seed: int) -> np.random.Generator:
  """The stream of an arm's redraws: ``default_rng([seed, 1])``, alike in every arm of ``seed``."""
  return np.random.default_rng([seed, 1])


def redraw(fault: TimedFault, live: Collection[int], rng: np.random.Generator) -> TimedFault | None:
  """``fault`` itself if its replica is ``live`` (not dead, stopped or cut off); else the same at
  ``sorted(live)[u]``, ``u`` uniform from ``rng``; ``None`` (unapplied) if none is (or a
  Lighthouse kill's Lighthouse is not)."""
  if fault.replica in live:
    return fault
  if fault.kind == "lighthouse" or not live:
    return None
  return dataclasses.replace(fault, replica=sorted(live)[int(rng.integers(len(live)))])
