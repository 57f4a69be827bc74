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

from optax_dist import _checks

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
      center or the anchor).
    local_step: ``int32[E]``, the worker's step count since its (re)start or join, after this
      step; 0 for restarts, joins and leaves.
    read_step: ``int32[E]`` or ``None``. Downpour only: the server ``global_step`` whose params
      the step's gradients are computed at (explicit schedules). ``None``: each worker reads the
      server right after its own previous commit (or restart), as in the timing model.
    communication_period: the period the schedule's latencies assume: an int, or one int per
      worker (DiLoCo with ``dylu=True``); ``None`` for explicit schedules. :func:`emulate`
      checks it against the protocol's.
    join: ``bool[E]``, True for a join: a worker absent until then reads the server, the center
      or the anchor and starts with a fresh optimizer state (on the device, a restart). A
      worker with a join has no event before it. ``None`` (the default) means no joins.
    leave: ``bool[E]``, True where a worker leaves for good: it has no event after it, and
      nothing it computed since its last exchange reaches the server. ``None``: no leaves.
    speeds: the cluster's :attr:`Cluster.worker_speeds` (one float per worker, the fastest
      1 or less), or ``None`` (explicit schedules: no timing model).

  The other events (``~(restart | join | leave)``, :attr:`step`) are steps: a local step, for
  downpour a commit.
  """

  num_workers: int
  worker: np.ndarray
  time: np.ndarray
  restart: np.ndarray
  local_step: np.ndarray
  read_step: np.ndarray | None = None
  communication_period: int | tuple[int, ...] | None = None
  join: np.ndarray | None = None
  leave: np.ndarray | None = None
  speeds: tuple[float, ...] | None = None

  def __post_init__(self):
    for name in ("join", "leave"):
      if getattr(self, name) is None:
        object.__setattr__(self, name, np.zeros(self.worker.shape, bool))

  @property
  def num_events(self) -> int:
    """The number of events (steps, restarts, joins and leaves)."""
    return int(self.worker.shape[0])

  @property
  def step(self) -> np.ndarray:
    """``bool[E]``: the steps (neither a restart, a join nor a leave)."""
    return ~(self.restart | self.join | self.leave)

  @property
  def active(self) -> np.ndarray:
    """``int32[E]``: the workers present after each event (joined and not left yet)."""
    absent = len(np.unique(self.worker[self.join]))
    active = self.num_workers - absent + np.cumsum(self.join) - np.cumsum(self.leave)
    return active.astype(np.int32)

  @property
  def periods(self) -> tuple[int, ...] | None:
    """Each worker's communication period (``communication_period`` per worker), or ``None``."""
    period = self.communication_period
    if period is None:
      return None
    if isinstance(period, numbers.Integral):
      return (int(period),) * self.num_workers
    return tuple(int(p) for p in period)

  @property
  def communicates(self) -> np.ndarray:
    """``bool[E]``: the steps that exchange with the server (every ``communication_period``-th
    of the event's worker)."""
    periods = self.periods
    if periods is None or len(set(periods)) == 1:
      period = self.communication_period if periods is None else periods[0]
      return self.step & (self.local_step % (period or 1) == 0)
    return self.step & (self.local_step % np.asarray(periods)[self.worker] == 0)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """A timing model of ``num_workers`` asynchronous workers and one parameter server.

  Worker :math:`i`'s :math:`k`-th step takes

  .. math::

    c_{i,k} = \\mathrm{compute\\_time} \\cdot \\kappa_i \\cdot u_{i,k}
      + \\mathrm{latency} \\cdot [\\text{the step communicates}],
    \\qquad u_{i,k} \\sim \\mathcal{U}[1 - \\mathrm{jitter}, 1 + \\mathrm{jitter}]

  with :math:`\\kappa_i = \\mathrm{slowdown} / v_i` for the stragglers and :math:`1 / v_i` for
  the others, :math:`v_i` the worker's entry of ``speeds`` (1 without it). So ``jitter=0`` and no
  stragglers is the constant model; ``jitter > 0`` uniform jitter; ``stragglers`` with
  ``slowdown=k`` the straggler model; ``speeds`` one relative speed per worker, e.g.
  ``(1, 1, 0.5, 0.25)`` (they all combine). The draws come from
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
    speeds: ``None`` (every :math:`v_i = 1`) or one relative speed :math:`v_i > 0` per worker:
      worker :math:`i`'s steps take :math:`1 / v_i` times ``compute_time`` (times ``slowdown``
      for a straggler). See :attr:`worker_speeds` for the result of both.
  """

  num_workers: int
  compute_time: float = 1.0
  jitter: float = 0.0
  stragglers: int | tuple[int, ...] = 0
  slowdown: float = 1.0
  latency: float = 0.0
  seed: int = 0
  speeds: tuple[float, ...] | None = None

  def __post_init__(self):
    fn = "Cluster"
    _checks.check_positive_int(fn, "num_workers", self.num_workers)
    _checks.check_number(fn, "compute_time", self.compute_time, lower=0.0, lower_open=True,
                         constraint="> 0")
    _checks.check_number(fn, "jitter", self.jitter, lower=0.0, upper=1.0, constraint="in [0, 1)")
    if self.jitter >= 1.0:
      raise ValueError(f"`Cluster(jitter=...)` must be in [0, 1), got {self.jitter}.")
    _checks.check_number(fn, "slowdown", self.slowdown, lower=1.0, constraint=">= 1")
    _checks.check_number(fn, "latency", self.latency, lower=0.0, constraint=">= 0")
    _checks.check_int(fn, "seed", self.seed)
    if self.speeds is not None:
      speeds = tuple(self.speeds) if isinstance(self.speeds, Sequence) else None
      ok = speeds is not None and len(speeds) == self.num_workers and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 < v < np.inf
        for v in speeds)
      if not ok:
        raise ValueError(
          f"`Cluster(speeds=...)` must be None or {self.num_workers} (num_workers) finite"
          f" numbers > 0, one relative speed per worker, got {self.speeds!r}.")
      object.__setattr__(self, "speeds", tuple(float(v) for v in speeds))
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

  @property
  def worker_speeds(self) -> tuple[float, ...]:
    """Each worker's speed :math:`1 / \\kappa_i`: steps per ``compute_time``, without jitter."""
    return tuple(1.0 / self._factor(w) for w in range(self.num_workers))

  def _factor(self, worker):
    """:math:`\\kappa_i`, worker ``worker``'s step time in units of ``compute_time``."""
    factor = self.slowdown if worker in self.straggler_ids else 1.0
    if self.speeds is not None:
      factor = factor / self.speeds[worker]
    return factor

  def compute_times(self, worker: int, num_steps: int) -> np.ndarray:
    """``float64[num_steps]``: the compute part of worker ``worker``'s first steps (no latency)."""
    rng = np.random.default_rng((self.seed, worker))
    factor = self._factor(worker)
    u = rng.uniform(1.0 - self.jitter, 1.0 + self.jitter, size=num_steps)
    return self.compute_time * factor * (u if self.jitter > 0 else np.ones(num_steps))

  def schedule(
    self,
    *,
    num_events: int | None = None,
    duration: float | None = None,
    communication_period: int | Sequence[int] = 1,
    restarts: Sequence[tuple[int, float] | tuple[int, float, float]] = (),
    leaves: Sequence[tuple[int, float]] = (),
    joins: Sequence[tuple[int, float]] = (),
  ) -> Schedule:
    """The events of this cluster in time order, until ``num_events`` steps or ``duration``.

    Every worker starts at time 0 (a joining worker at its join) with a read of the server; its
    steps follow back to back. A step's event is at the time it ends (for a communicating step:
    when its exchange with the server completes, after ``latency``). Ties are broken by kind (steps, then leaves, then
    joins and restarts, so these read the server after the steps ending at their time), then by
    worker index. The other workers never wait.

    A restart ``(worker, time)`` or ``(worker, time, downtime)``: the worker crashes at
    ``time``, so the step it was running is lost (a step ending exactly at ``time`` is not);
    after ``downtime`` (default 0) its restart event re-initialises its params and optimizer
    state from the server, the center or the anchor, its local step count restarts at 0, and it
    continues.

    A leave ``(worker, time)``: the worker leaves for good at ``time``; the step it was running
    is lost, and with it everything it computed since its last exchange (for DiLoCo its local
    steps since its last commit, for AGN its accumulated gradients). A leave event marks it.

    A join ``(worker, time)``: the worker is absent from the start; at ``time`` its join event
    reads the current server params, center or anchor, with a fresh optimizer state and local
    step 0, and its steps follow from there (TF's asynchronous EASGD starts a new worker from
    the center; DiLoCo's from the anchor).

    Args:
      num_events: stop after this many steps (restarts, joins and leaves not counted; those at
        or before the last step are kept).
      duration: or stop at this simulated time (events at ``time <= duration`` are kept).
      communication_period: the protocol's τ (1 for downpour, ``sync_period`` for DiLoCo), or
        one per worker (DiLoCo with ``dylu=True``: ``protocol.sync_periods(
        cluster.worker_speeds)``): which steps pay ``latency``.
      restarts: the restarts, in any order; a worker's must fall while it is present (a crash
        after its join, back before its leave).
      leaves: ``(worker, time)`` pairs, at most one per worker.
      joins: ``(worker, time)`` pairs, at most one per worker, before the worker's leave.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: not exactly one of ``num_events`` and ``duration``; ``communication_period``
        neither a positive int nor ``num_workers`` of them; a bad restart, leave or
        join (a worker outside ``[0, num_workers)``, a negative time, a worker twice, a join at
        or after the worker's leave, a restart outside the worker's presence); ``num_events``
        more steps than the workers take before they all leave.

    Examples:
      Four workers, steps of 1: worker 2 joins at 1.5 and worker 3 leaves at 2.5 (its third
      step is lost), so three workers are present, then four, then three:

      >>> from optax_dist import async_emulator as ae
      >>> s = ae.Cluster(4).schedule(duration=4.0, leaves=[(3, 2.5)], joins=[(2, 1.5)])
      >>> s.time[s.worker == 3].tolist(), s.leave[s.worker == 3].tolist()
      ([1.0, 2.0, 2.5], [False, False, True])
      >>> s.time[s.worker == 2].tolist(), s.join[s.worker == 2].tolist()
      ([1.5, 2.5, 3.5], [True, False, False])
      >>> s.active[0].item(), s.active[s.join | s.leave].tolist()
      (3, [4, 3])
    """
    fn = "Cluster.schedule"
    if (num_events is None) == (duration is None):
      raise ValueError(f"`{fn}` needs exactly one of `num_events` and `duration`.")
    if num_events is not None:
      _checks.check_positive_int(fn, "num_events", num_events)
    else:
      _checks.check_number(fn, "duration", duration, lower=0.0, lower_open=True,
                           constraint="> 0")
    periods = _parse_periods(fn, communication_period, self.num_workers)
    presence = _Presence.parse(fn, self.num_workers, joins, leaves)
    crashes = _parse_restarts(fn, restarts, self.num_workers, presence)
    steps = self._all_steps(num_events, duration, periods, crashes, presence)
    events = _in_time_order(steps, crashes, presence)
    if num_events is not None:
      last = np.flatnonzero(events["kind"] == _STEP)[num_events - 1]
      keep = np.arange(len(events["time"])) <= last
    else:
      keep = events["time"] <= duration
    kind = events["kind"][keep]
    return Schedule(
      num_workers=self.num_workers,
      worker=events["worker"][keep].astype(np.int32),
      time=events["time"][keep].astype(np.float64),
      restart=kind == _RESTART,
      local_step=events["local"][keep].astype(np.int32),
      communication_period=(
        communication_period if isinstance(communication_period, numbers.Integral) else periods),
      join=kind == _JOIN,
      leave=kind == _LEAVE,
      speeds=self.worker_speeds,
    )

  def _all_steps(self, num_events, duration, periods, crashes, presence):
    """Every worker's steps (end times, local step counts), drawn until the end is covered."""
    n = self.num_workers
    per_worker = max(16, 2 * (num_events or 0) // n + 16)
    while True:
      steps = [self._worker_steps(w, per_worker, periods[w], crashes[w], presence.span(w))
               for w in range(n)]
      horizon = min(covered for _, _, covered in steps)  # every step before it is drawn
      all_times = np.sort(np.concatenate([t for t, _, _ in steps]))
      end = duration
      if num_events is not None:
        end = all_times[num_events - 1] if len(all_times) >= num_events else np.inf
      if end <= horizon and end < np.inf:
        return [(t, k) for t, k, _ in steps]
      if horizon == np.inf:
        raise ValueError(
          f"`Cluster.schedule(num_events={num_events})`: the workers take only"
          f" {len(all_times)} steps before they all leave; ask for fewer or give `duration`.")
      if per_worker > 1 << 24:
        raise ValueError("`Cluster.schedule`: the workers make no progress; check `restarts`.")
      per_worker *= 2

  def _worker_steps(self, w, num_steps, period, crashes, span):
    """Worker ``w``'s completed steps from ``num_steps`` draws while present (``span`` = join,
    leave): end times, local step counts, and the time up to which they are all drawn."""
    compute = self.compute_times(w, num_steps)
    times, locals_ = [], []
    start, leave = span
    used = 0
    for crash, downtime in [*crashes, (leave, None)]:
      local, t = 0, start
      while used < num_steps:
        local += 1
        end = t + compute[used] + (self.latency if local % period == 0 else 0.0)
        used += 1
        if end > crash:  # the step in flight at the crash or the leave is lost
          break
        times.append(end)
        locals_.append(local)
        t = end
      else:  # the draws ran out: later steps are not drawn yet
        return np.asarray(times, np.float64), np.asarray(locals_, np.int64), t
      if downtime is None:  # left for good: every step is drawn
        return np.asarray(times, np.float64), np.asarray(locals_, np.int64), np.inf
      start = crash + downtime
    raise AssertionError("unreachable: the leave ends the loop")


def _parse_periods(fn, period, num_workers):
  """One positive int period per worker, from an int or a sequence of ``num_workers`` ints."""
  if isinstance(period, Sequence) and not isinstance(period, str):
    periods = tuple(period)
    ok = len(periods) == num_workers and all(
      isinstance(p, numbers.Integral) and not isinstance(p, bool) and p > 0 for p in periods)
    if not ok:
      raise ValueError(
        f"`{fn}(communication_period=...)` must be a positive int or {num_workers}"
        f" (num_workers) positive ints, one per worker, got {period!r}.")
    return tuple(int(p) for p in periods)
  _checks.check_positive_int(fn, "communication_period", period)
  return (int(period),) * num_workers


_STEP, _LEAVE, _JOIN, _RESTART = 0, 1, 2, 3
"""Event kinds of :meth:`Cluster.schedule`, in their order among events at the same time."""


@dataclasses.dataclass(frozen=True)
class _Presence:
  """When each worker is present: ``joins[w]`` (0 for the workers there from the start) to
  ``leaves[w]`` (``inf`` for those that never leave)."""

  joins: dict[int, float]
  leaves: dict[int, float]

  @classmethod
  def parse(cls, fn, num_workers, joins, leaves):
    """Checks ``joins`` and ``leaves`` (``(worker, time)`` pairs) of ``fn``."""
    presence = cls(_parse_pairs(fn, "joins", joins, num_workers),
                   _parse_pairs(fn, "leaves", leaves, num_workers))
    for w, t in presence.joins.items():
      if presence.leaves.get(w, np.inf) <= t:
        raise ValueError(
          f"`{fn}`: worker {w} joins at {t} but leaves at {presence.leaves[w]}; a worker must"
          " join before it leaves (it cannot join after it leaves, nor come back).")
    return presence

  def span(self, w):
    """``(join, leave)`` times of worker ``w``."""
    return self.joins.get(w, 0.0), self.leaves.get(w, np.inf)


def _parse_pairs(fn, name, pairs, num_workers):
  """``{worker: time}`` from ``(worker, time)`` pairs, each worker at most once."""
  out = {}
  for entry in pairs:
    entry = tuple(entry)
    ok = (len(entry) == 2 and isinstance(entry[0], numbers.Integral)
          and isinstance(entry[1], numbers.Real))
    if not ok or not 0 <= entry[0] < num_workers or not 0 <= entry[1] < np.inf:
      raise ValueError(
        f"`{fn}({name}=...)` entries must be (worker, time) with a worker in"
        f" [0, {num_workers}) and a finite time >= 0, got {entry!r}.")
    if int(entry[0]) in out:
      raise ValueError(f"`{fn}({name}=...)`: worker {entry[0]} appears twice, got {pairs!r}.")
    out[int(entry[0])] = float(entry[1])
  return out


def _in_time_order(steps, crashes, presence):
  """``worker``, ``time``, ``kind``, ``local`` of every event, in time order.

  Ties are broken by kind (steps, leaves, joins, restarts), then by worker index.
  """
  parts = []  # (worker, times, kind, local steps)
  for w, (t, k) in enumerate(steps):
    parts.append((w, t, _STEP, k))
    parts.append((w, [c + d for c, d in crashes[w]], _RESTART, 0))
    parts.append((w, [presence.joins[w]] if w in presence.joins else [], _JOIN, 0))
    parts.append((w, [presence.leaves[w]] if w in presence.leaves else [], _LEAVE, 0))
  worker = np.concatenate([np.full(len(t), w) for w, t, _, _ in parts])
  time = np.concatenate([np.asarray(t, np.float64) for _, t, _, _ in parts])
  kind = np.concatenate([np.full(len(t), k) for _, t, k, _ in parts])
  local = np.concatenate([np.broadcast_to(np.asarray(s, np.int64), len(t)) for _, t, _, s in parts])
  order = np.lexsort((worker, kind, time))
  return {"worker": worker[order], "time": time[order], "kind": kind[order],
          "local": local[order]}


def _parse_restarts(fn, restarts, num_workers, presence):
  """Each worker's ``(crash, downtime)`` pairs, sorted; checked against each other and against
  the worker's join and leave."""
  crashes = [[] for _ in range(num_workers)]
  for entry in restarts:
    w, t, downtime = _restart_entry(fn, entry, num_workers)
    crashes[w].append((t, downtime))
  for w, entries in enumerate(crashes):
    entries.sort()
    for (t0, d0), (t1, _) in itertools.pairwise(entries):
      if t1 < t0 + d0:
        raise ValueError(
          f"`{fn}(restarts=...)`: worker {w} crashes at {t1} while it is down ({t0} to"
          f" {t0 + d0})."
        )
    join, leave = presence.span(w)
    for t, d in entries:
      if (w in presence.joins and t <= join) or t + d >= leave:
        raise ValueError(
          f"`{fn}(restarts=...)`: worker {w} is present from {join} to {leave}; its restart"
          f" (crash at {t}, back at {t + d}) must crash after it joins and be back before it"
          " leaves."
        )
  return crashes


def _restart_entry(fn, entry, num_workers):
  """``(worker, time, downtime)`` of one restart."""
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
  return w, t, downtime


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
  * ``("join", w)``: worker ``w``, absent until then (it has no earlier event), reads the
    server, the center or the anchor and starts with a fresh optimizer state.
  * ``("leave", w)``: worker ``w`` leaves for good (it has no later event).

  Every step of a downpour schedule must give ``read_step`` or none must.

  Args:
    events: the events, in time order.
    num_workers: :math:`N`; default: one more than the largest worker index.

  Returns:
    A :class:`Schedule` with ``communication_period=None``.

  Raises:
    ValueError: a malformed event; a worker index outside ``[0, num_workers)``; ``read_step``
      given for some steps only, or together with restarts or joins; a worker that joins or
      leaves twice, has an event before its join or after its leave, or joins after it leaves.

  Examples:
    TF's ``DropStaleGradientOptimizer`` test with three workers: every worker reads
    ``global_step`` 0, then the chief commits first and the others after it:

    >>> from optax_dist import async_emulator as ae
    >>> s = ae.explicit_schedule([(0, 0), (1, 0), (2, 0)])
    >>> s.worker, s.read_step
    (array([0, 1, 2], dtype=int32), array([0, 0, 0], dtype=int32))

    Worker 1 leaves after one step and worker 2 joins in its place:

    >>> s = ae.explicit_schedule([0, 1, ("leave", 1), ("join", 2), 0, 2])
    >>> s.active.tolist(), s.step.tolist()
    ([2, 2, 1, 2, 2, 2], [True, True, False, False, True, True])
  """
  fn = "explicit_schedule"
  parsed = [_parse_event(fn, k, event) for k, event in enumerate(events)]
  if not parsed:
    raise ValueError(f"`{fn}(events=...)` must not be empty.")
  worker, kind = (np.asarray(a, np.int64) for a in list(zip(*parsed))[:2])
  read = [r for _, _, r in parsed]
  n = int(worker.max()) + 1 if num_workers is None else num_workers
  _checks.check_positive_int(fn, "num_workers", n)
  if worker.min() < 0 or worker.max() >= n:
    raise ValueError(
      f"`{fn}(events=...)`: worker indices must be in [0, {n}), got {sorted(set(worker))}."
    )
  given = [r is not None for r, k in zip(read, kind) if k == _STEP]
  if any(given) and not all(given):
    raise ValueError(f"`{fn}(events=...)`: give `read_step` for every step or for none.")
  if any(given) and np.isin(kind, (_RESTART, _JOIN)).any():
    raise ValueError(
      f"`{fn}(events=...)`: restarts and joins cannot be mixed with explicit `read_step`s.")
  _check_membership_order(fn, worker, kind)
  local = np.zeros(len(worker), np.int32)
  count = np.zeros(n, np.int64)
  for k, (w, kd) in enumerate(zip(worker, kind)):
    count[w] = count[w] + 1 if kd == _STEP else 0
    local[k] = count[w]
  read_step = None
  if any(given):
    read_step = np.asarray([-1 if r is None else r for r in read], np.int32)
  return Schedule(
    num_workers=n, worker=worker.astype(np.int32),
    time=np.arange(1, len(worker) + 1, dtype=np.float64), restart=kind == _RESTART,
    local_step=local, read_step=read_step, join=kind == _JOIN, leave=kind == _LEAVE,
  )


_NAMED_EVENTS = {"restart": _RESTART, "join": _JOIN, "leave": _LEAVE}


def _parse_event(fn, k, event):
  """``(worker, kind, read_step)`` of event ``k`` of :func:`explicit_schedule`."""
  if isinstance(event, numbers.Integral):
    return int(event), _STEP, None
  if isinstance(event, tuple) and len(event) == 2 and isinstance(event[1], numbers.Integral):
    if isinstance(event[0], str) and event[0] in _NAMED_EVENTS:
      return int(event[1]), _NAMED_EVENTS[event[0]], None
    if isinstance(event[0], numbers.Integral):
      return int(event[0]), _STEP, int(event[1])
  raise ValueError(
    f"`{fn}(events=...)`: event {k} must be a worker index, (worker, read_step),"
    f" ('restart', worker), ('join', worker) or ('leave', worker), got {event!r}."
  )


def _check_membership_order(fn, worker, kind):
  """Each worker joins and leaves at most once, its join first and its leave last."""
  for w in np.unique(worker):
    kinds = kind[worker == w]
    joins, leaves = np.flatnonzero(kinds == _JOIN), np.flatnonzero(kinds == _LEAVE)
    problem = None
    if len(joins) > 1 or len(leaves) > 1:
      problem = "joins or leaves more than once"
    elif len(joins) and len(leaves) and leaves[0] < joins[0]:
      problem = "joins after it leaves (a worker that leaves is gone for good)"
    elif len(joins) and joins[0] != 0:
      problem = "has events before its join (a joining worker is absent until then)"
    elif len(leaves) and leaves[0] != len(kinds) - 1:
      problem = "has events after its leave"
    if problem:
      raise ValueError(f"`{fn}(events=...)`: worker {w} {problem}.")
