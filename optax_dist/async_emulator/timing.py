r"""The timing model of the asynchronous emulator: workers' compute times and the event schedule.

Everything here runs on the host, in NumPy. A :class:`Cluster` draws every worker's compute
times from a seeded distribution and :meth:`Cluster.schedule` orders the events they produce;
:func:`explicit_schedule` builds a :class:`Schedule` from a hand-written list instead. Either
is the input of :func:`optax_dist.async_emulator.emulate`.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from optax_dist import _common

__all__ = ("Cluster", "Schedule", "explicit_schedule")


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """The events of an emulation in time order (host NumPy arrays, one entry per event).

  Build it with :meth:`Cluster.schedule` or :func:`explicit_schedule`.

  Attributes:
    num_workers: :math:`N`.
    worker: ``int32[E]``, the worker of each event.
    time: ``float64[E]``, the simulated time of each event, nondecreasing.
    restart: ``bool[E]``, True for a restart (the worker re-initialises from the server, the
      center or the anchor), False for a step (a local step; for downpour a commit).
    local_step: ``int32[E]``, the worker's step count since its (re)start, after this step; 0
      for restarts.
    read_step: ``int32[E]`` or ``None``. Downpour only: the server ``global_step`` whose params
      the step's gradients are computed at (explicit schedules). ``None``: each worker reads the
      server right after its own previous commit (or restart), as in the timing model.
    communication_period: the period the schedule's latencies assume (``None`` for explicit
      schedules); :func:`emulate` checks it against the protocol's.
  """

  num_workers: int
  worker: np.ndarray
  time: np.ndarray
  restart: np.ndarray
  local_step: np.ndarray
  read_step: np.ndarray | None = None
  communication_period: int | None = None

  @property
  def num_events(self) -> int:
    """The number of events (steps and restarts)."""
    return int(self.worker.shape[0])

  @property
  def communicates(self) -> np.ndarray:
    """``bool[E]``: the steps that exchange with the server (every ``communication_period``-th)."""
    period = self.communication_period or 1
    return ~self.restart & (self.local_step % period == 0)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """A timing model of ``num_workers`` asynchronous workers and one parameter server.

  Worker :math:`i`'s :math:`k`-th step takes

  .. math::

    c_{i,k} = \\mathrm{compute\\_time} \\cdot \\kappa_i \\cdot u_{i,k}
      + \\mathrm{latency} \\cdot [\\text{the step communicates}],
    \\qquad u_{i,k} \\sim \\mathcal{U}[1 - \\mathrm{jitter}, 1 + \\mathrm{jitter}]

  with :math:`\\kappa_i = \\mathrm{slowdown}` for the stragglers and 1 for the others. So
  ``jitter=0`` and no stragglers is the constant model; ``jitter > 0`` uniform jitter;
  ``stragglers`` with ``slowdown=k`` the straggler model (they combine). The draws come from
  ``numpy.random.default_rng((seed, i))``, one stream per worker, so a schedule depends only on
  the fields and its length.

  Attributes:
    num_workers: :math:`N`, a positive int.
    compute_time: the mean time of one step's computation (any time unit), > 0.
    jitter: the relative half-width of the uniform jitter, in [0, 1).
    stragglers: the number of slow workers (the last ones: workers ``N - stragglers`` …
      ``N - 1``, so the chief, worker 0, is fast) or a tuple of their indices.
    slowdown: k ≥ 1, how many times slower a straggler computes.
    latency: ≥ 0, the round trip of one exchange with the server, added to every step that
      communicates (every step for downpour; every τ-th for elastic averaging and AGN; every
      H-th for DiLoCo).
    seed: the seed of the compute-time draws.
  """

  num_workers: int
  compute_time: float = 1.0
  jitter: float = 0.0
  stragglers: int | tuple[int, ...] = 0
  slowdown: float = 1.0
  latency: float = 0.0
  seed: int = 0

  def __post_init__(self):
    fn = "Cluster"
    _common.check_positive_int(fn, "num_workers", self.num_workers)
    _common.check_number(fn, "compute_time", self.compute_time, lower=0.0, lower_open=True,
                         constraint="> 0")
    _common.check_number(fn, "jitter", self.jitter, lower=0.0, upper=1.0, constraint="in [0, 1)")
    if self.jitter >= 1.0:
      raise ValueError(f"`Cluster(jitter=...)` must be in [0, 1), got {self.jitter}.")
    _common.check_number(fn, "slowdown", self.slowdown, lower=1.0, constraint=">= 1")
    _common.check_number(fn, "latency", self.latency, lower=0.0, constraint=">= 0")
    _common.check_int(fn, "seed", self.seed)
    slow = self.straggler_ids
    bad = [i for i in slow if not 0 <= i < self.num_workers]
    if bad or len(set(slow)) != len(slow):
      raise ValueError(
        f"`Cluster(stragglers=...)` must be a count in [0, num_workers={self.num_workers}] or"
        f" distinct worker indices in [0, {self.num_workers}), got {self.stragglers!r}."
      )

  @property
  def straggler_ids(self) -> tuple[int, ...]:
    """The indices of the slow workers."""
    if isinstance(self.stragglers, numbers.Integral):
      count = int(self.stragglers)
      if not 0 <= count <= self.num_workers:
        raise ValueError(
          f"`Cluster(stragglers=...)` must be a count in [0, num_workers={self.num_workers}],"
          f" got {count}."
        )
      return tuple(range(self.num_workers - count, self.num_workers))
    return tuple(int(i) for i in self.stragglers)

  def compute_times(self, worker: int, num_steps: int) -> np.ndarray:
    """``float64[num_steps]``: the compute part of worker ``worker``'s first steps (no latency)."""
    rng = np.random.default_rng((self.seed, worker))
    factor = self.slowdown if worker in self.straggler_ids else 1.0
    u = rng.uniform(1.0 - self.jitter, 1.0 + self.jitter, size=num_steps)
    return self.compute_time * factor * (u if self.jitter > 0 else np.ones(num_steps))

  def schedule(
    self,
    *,
    num_events: int | None = None,
    duration: float | None = None,
    communication_period: int = 1,
    restarts: Sequence[tuple[int, float] | tuple[int, float, float]] = (),
  ) -> Schedule:
    """The events of this cluster in time order, until ``num_events`` steps or ``duration``.

    Every worker starts at time 0 with a read of the server; its steps follow back to back. A
    step's event is at the time it ends (for a communicating step: when its exchange with the
    server completes, after ``latency``). Ties are broken by worker index, restarts after steps.

    A restart ``(worker, time)`` or ``(worker, time, downtime)``: the worker crashes at
    ``time``, so the step it was running is lost (a step ending exactly at ``time`` is not);
    after ``downtime`` (default 0) its restart event re-initialises its params and optimizer
    state from the server, the center or the anchor, its local step count restarts at 0, and it
    continues. The other workers never wait.

    Args:
      num_events: stop after this many steps (restarts not counted; those at or before the last
        step are kept).
      duration: or stop at this simulated time (events at ``time <= duration`` are kept).
      communication_period: the protocol's τ (1 for downpour, ``sync_period`` for DiLoCo):
        which steps pay ``latency``.
      restarts: the restarts, in any order.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: not exactly one of ``num_events`` and ``duration``; a bad restart.
    """
    fn = "Cluster.schedule"
    if (num_events is None) == (duration is None):
      raise ValueError(f"`{fn}` needs exactly one of `num_events` and `duration`.")
    if num_events is not None:
      _common.check_positive_int(fn, "num_events", num_events)
    else:
      _common.check_number(fn, "duration", duration, lower=0.0, lower_open=True,
                           constraint="> 0")
    _common.check_positive_int(fn, "communication_period", communication_period)
    crashes = _parse_restarts(fn, restarts, self.num_workers)
    steps = self._all_steps(num_events, duration, communication_period, crashes)
    worker, time, restart, local = _in_time_order(steps, crashes)
    if num_events is not None:
      last = np.flatnonzero(~restart)[num_events - 1]
      keep = np.arange(len(time)) <= last
    else:
      keep = time <= duration
    return Schedule(
      num_workers=self.num_workers,
      worker=worker[keep].astype(np.int32),
      time=time[keep].astype(np.float64),
      restart=restart[keep],
      local_step=local[keep].astype(np.int32),
      communication_period=communication_period,
    )

  def _all_steps(self, num_events, duration, period, crashes):
    """Every worker's steps (end times, local step counts), drawn until the end is covered."""
    n = self.num_workers
    per_worker = max(16, 2 * (num_events or 0) // n + 16)
    while True:
      steps = [self._worker_steps(w, per_worker, period, crashes[w]) for w in range(n)]
      horizon = min(s[0][-1] if len(s[0]) else np.inf for s in steps)
      all_times = np.sort(np.concatenate([s[0] for s in steps]))
      if num_events is not None:
        end = all_times[num_events - 1] if len(all_times) >= num_events else np.inf
      else:
        end = duration
      if end <= horizon:
        return steps
      if per_worker > 1 << 24:
        raise ValueError("`Cluster.schedule`: the workers make no progress; check `restarts`.")
      per_worker *= 2

  def _worker_steps(self, w, num_steps, period, crashes):
    """End times and local step counts of worker ``w``'s completed steps (``num_steps`` draws)."""
    compute = self.compute_times(w, num_steps)
    times, locals_ = [], []
    start, used = 0.0, 0
    for crash, downtime in list(crashes) + [(np.inf, 0.0)]:
      local, t = 0, start
      while used < num_steps:
        local += 1
        end = t + compute[used] + (self.latency if local % period == 0 else 0.0)
        used += 1
        if end > crash:  # the step in flight at the crash is lost
          break
        times.append(end)
        locals_.append(local)
        t = end
      if used >= num_steps:
        break
      start = crash + downtime
    return np.asarray(times, np.float64), np.asarray(locals_, np.int64)


def _in_time_order(steps, crashes):
  """``worker``, ``time``, ``restart``, ``local_step`` of every step and restart, in time order.

  Ties are broken by worker index, restarts after steps.
  """
  worker, time, restart, local = [], [], [], []
  for w, (t, k) in enumerate(steps):
    back = np.array([c + d for c, d in crashes[w]], float)
    worker += [np.full(len(t), w), np.full(len(back), w)]
    time += [t, back]
    restart += [np.zeros(len(t), bool), np.ones(len(back), bool)]
    local += [k, np.zeros(len(back), np.int64)]
  worker, time, restart, local = map(np.concatenate, (worker, time, restart, local))
  order = np.lexsort((worker, restart, time))
  return worker[order], time[order], restart[order], local[order]


def _parse_restarts(fn, restarts, num_workers):
  crashes = [[] for _ in range(num_workers)]
  for entry in restarts:
    entry = tuple(entry)
    if len(entry) not in (2, 3):
      raise ValueError(
        f"`{fn}(restarts=...)` entries must be (worker, time) or (worker, time, downtime), got"
        f" {entry!r}."
      )
    w, t = int(entry[0]), float(entry[1])
    downtime = float(entry[2]) if len(entry) == 3 else 0.0
    if not 0 <= w < num_workers or t < 0 or downtime < 0:
      raise ValueError(
        f"`{fn}(restarts=...)`: a restart needs a worker in [0, {num_workers}), time >= 0 and"
        f" downtime >= 0, got {entry!r}."
      )
    crashes[w].append((t, downtime))
  for w, entries in enumerate(crashes):
    entries.sort()
    for (t0, d0), (t1, _) in itertools.pairwise(entries):
      if t1 < t0 + d0:
        raise ValueError(
          f"`{fn}(restarts=...)`: worker {w} crashes at {t1} while it is down ({t0} to"
          f" {t0 + d0})."
        )
  return crashes


def explicit_schedule(events: Sequence[Any], *, num_workers: int | None = None) -> Schedule:
  """A :class:`Schedule` from an explicit list of events, in order (event ``k`` at time ``k+1``).

  Each event is one of:

  * ``w`` (an int): worker ``w`` takes a step (for downpour: commits gradients computed at the
    params it read right after its previous commit, or at the start);
  * ``(w, read_step)``: downpour only: worker ``w`` commits gradients computed at the server's
    params of ``global_step == read_step``. The worker must be able to have read them: the
    server must be at that step at some point after the worker's previous commit (steps only
    grow, and a dropped commit does not move them). :func:`emulate` raises otherwise.
  * ``("restart", w)``: worker ``w`` re-initialises from the server, the center or the anchor.

  Every step of a downpour schedule must give ``read_step`` or none must.

  Args:
    events: the events, in time order.
    num_workers: :math:`N`; default: one more than the largest worker index.

  Returns:
    A :class:`Schedule` with ``communication_period=None``.

  Raises:
    ValueError: a malformed event; a worker index outside ``[0, num_workers)``; ``read_step``
      given for some steps only, or together with restarts.

  Examples:
    TF's ``DropStaleGradientOptimizer`` test with three workers: every worker reads
    ``global_step`` 0, then the chief commits first and the others after it:

    >>> from optax_dist import async_emulator as ae
    >>> s = ae.explicit_schedule([(0, 0), (1, 0), (2, 0)])
    >>> s.worker, s.read_step
    (array([0, 1, 2], dtype=int32), array([0, 0, 0], dtype=int32))
  """
  fn = "explicit_schedule"
  worker, restart, read = [], [], []
  for k, event in enumerate(events):
    if isinstance(event, numbers.Integral):
      worker.append(int(event)), restart.append(False), read.append(None)
    elif isinstance(event, tuple) and len(event) == 2 and event[0] == "restart":
      worker.append(int(event[1])), restart.append(True), read.append(None)
    elif (isinstance(event, tuple) and len(event) == 2
          and all(isinstance(v, numbers.Integral) for v in event)):
      worker.append(int(event[0])), restart.append(False), read.append(int(event[1]))
    else:
      raise ValueError(
        f"`{fn}(events=...)`: event {k} must be a worker index, (worker, read_step) or"
        f" ('restart', worker), got {event!r}."
      )
  if not worker:
    raise ValueError(f"`{fn}(events=...)` must not be empty.")
  n = max(worker) + 1 if num_workers is None else num_workers
  _common.check_positive_int(fn, "num_workers", n)
  if min(worker) < 0 or max(worker) >= n:
    raise ValueError(
      f"`{fn}(events=...)`: worker indices must be in [0, {n}), got {sorted(set(worker))}."
    )
  given = [r is not None for r, is_restart in zip(read, restart) if not is_restart]
  if any(given) and not all(given):
    raise ValueError(f"`{fn}(events=...)`: give `read_step` for every step or for none.")
  if any(given) and any(restart):
    raise ValueError(f"`{fn}(events=...)`: restarts cannot be mixed with explicit `read_step`s.")
  worker = np.asarray(worker, np.int32)
  restart = np.asarray(restart, bool)
  local = np.zeros(len(worker), np.int32)
  count = np.zeros(n, np.int64)
  for k, (w, r) in enumerate(zip(worker, restart)):
    count[w] = 0 if r else count[w] + 1
    local[k] = count[w]
  read_step = None
  if any(given):
    read_step = np.asarray([-1 if r is None else r for r in read], np.int32)
  return Schedule(
    num_workers=n,
    worker=worker,
    time=np.arange(1, len(worker) + 1, dtype=np.float64),
    restart=restart,
    local_step=local,
    read_step=read_step,
  )


