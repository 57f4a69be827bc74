r"""The emulation: :func:`emulate` runs a protocol on a schedule as one ``lax.scan`` over events.

The host prepares the events (each step's minibatch rows, downpour's explicit reads) in NumPy,
the device runs them in one jitted scan (:mod:`.simulators` holds each protocol's event), and
the host derives the server steps and the staleness from what the device reports
(:class:`AsyncResult`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dist import _checks
from optax_dist.async_emulator import simulators
from optax_dist.async_emulator.protocols import AGN, DiLoCo, Downpour, ElasticAverage, Protocol
from optax_dist.async_emulator.timing import Schedule

__all__ = ("AsyncResult", "emulate")


@dataclasses.dataclass(frozen=True, eq=False)
class AsyncResult:
  """What :func:`emulate` returns. Per-event arrays have one entry per schedule event.

  Attributes:
    time: ``float64[E]``, each event's simulated time.
    worker: ``int32[E]``, each event's worker.
    restart: ``bool[E]``, True for restart events.
    join: ``bool[E]``, True where a worker joins (see :class:`Schedule`).
    leave: ``bool[E]``, True where a worker leaves for good.
    loss: ``float32[E]``, the minibatch loss the worker computed at the event (at its snapshot
      for downpour, at its local params otherwise); NaN for restarts, joins and leaves.
    server_step: ``int32[E]``, the server step after the event: downpour's ``global_step``
      (accepted commits); for elastic averaging and AGN the number of exchanges with the center;
      for DiLoCo the number of outer steps (commits).
    committed: ``bool[E]``, True where the event exchanged with the server (every downpour step;
      every τ-th or H-th local step otherwise).
    accepted: ``bool[E]``, committed and not dropped.
    staleness: ``int32[E]``, for commits: the server step at the commit minus the server step
      the worker read (for elastic averaging, AGN and DiLoCo: at its last exchange or restart,
      so for DiLoCo the outer steps between its read of the anchor and its commit); -1
      elsewhere.
    read_step: ``int32[E]``, for commits: the server step the worker read; -1 elsewhere.
    eval_time, eval_step: ``float64[K]``, ``int32[K]``: when ``eval_fn`` ran (time 0, then after
      every ``eval_every`` events and after the last).
    eval_metrics: ``eval_fn``'s outputs stacked on a leading axis ``[K]``; ``None`` without it.
    params: the final server params (downpour), center, or anchor (DiLoCo).
    worker_params: the final per-worker params, stacked ``[N, ...]``: each worker's last read of
      the server (downpour) or its local params; for a worker that left, those it held when it
      left; for one that never joined, the initial params.
    server_state: the final server optimizer state (downpour), center optimizer state (AGN),
      outer optimizer state (DiLoCo), or ``None`` (elastic averaging).
  """

  time: np.ndarray
  worker: np.ndarray
  restart: np.ndarray
  join: np.ndarray
  leave: np.ndarray
  loss: np.ndarray
  server_step: np.ndarray
  committed: np.ndarray
  accepted: np.ndarray
  staleness: np.ndarray
  read_step: np.ndarray
  eval_time: np.ndarray
  eval_step: np.ndarray
  eval_metrics: Any
  params: Any
  worker_params: Any
  server_state: Any

  @property
  def num_accepted(self) -> int:
    """The number of accepted commits."""
    return int(self.accepted.sum())

  @property
  def num_dropped(self) -> int:
    """The number of dropped commits."""
    return int((self.committed & ~self.accepted).sum())

  @property
  def dropped_fraction(self) -> float:
    """Dropped commits over all commits (0 without commits)."""
    total = int(self.committed.sum())
    return self.num_dropped / total if total else 0.0

  @property
  def commit_staleness(self) -> np.ndarray:
    """``int32[C]``: the staleness of every commit, in event order."""
    return self.staleness[self.committed]


@functools.partial(
  jax.jit,
  static_argnames=("protocol", "loss_fn", "eval_fn", "num_workers", "explicit_reads",
                   "only_steps", "periods"))
def _simulate(params, data, events, *, protocol, loss_fn, eval_fn, num_workers, explicit_reads,
              only_steps, periods=None):
  """The emulation: ``events`` leaves are ``[chunks, chunk, ...]``; ``eval_fn`` after each chunk.

  ``only_steps``: every event is a step (no restart, no padding), so no event needs a select.
  ``periods``: DiLoCo with ``dylu``: each worker's local steps per commit; else ``None``.
  """
  sim = simulators.simulator(protocol, loss_fn, num_workers, explicit_reads, only_steps,
                             periods)
  flat = None if data is None else jax.tree.map(
    lambda d: d.reshape((-1,) + d.shape[2:]), data)

  def event(carry, ev):
    batch = None if flat is None else jax.tree.map(lambda d: d[ev.index], flat)
    return sim.event(carry, ev, batch)

  def evaluate(carry):
    return None if eval_fn is None else eval_fn(sim.server_params(carry))

  def chunk(carry, evs):
    carry, records = jax.lax.scan(event, carry, evs)
    return carry, (records, evaluate(carry))

  carry = sim.init(params)
  first = evaluate(carry)
  carry, (records, evals) = jax.lax.scan(chunk, carry, events)
  return sim.outputs(carry), records, first, evals


def _batch_indices(schedule, data, batch_size, seed):
  """``int32[E, B]``: per step, ``batch_size`` rows of the worker's shard (flattened), drawn
  from a fresh ``default_rng((seed, worker))`` permutation of the shard every epoch."""
  if data is None:
    return np.zeros((schedule.num_events, 0), np.int32)
  leaves = jax.tree.leaves(data)
  shapes = {tuple(np.shape(leaf)[:2]) for leaf in leaves}
  n = schedule.num_workers
  if len(shapes) != 1 or next(iter(shapes))[0] != n or len(next(iter(shapes))) != 2:
    raise ValueError(
      "`emulate(data=...)`: every leaf must have shape [num_workers, examples_per_worker, ...]"
      f" with num_workers={n}, got leading shapes {sorted(shapes)}. Shard a dataset with"
      " `optax_dist.split_batch(data, num_workers)`."
    )
  m = next(iter(shapes))[1]
  _checks.check_positive_int("emulate", "batch_size", batch_size)
  if batch_size > m:
    raise ValueError(
      f"`emulate(batch_size=...)` must be at most the examples per worker ({m}), got"
      f" {batch_size}."
    )
  index = np.zeros((schedule.num_events, batch_size), np.int64)
  steps = schedule.step
  for w in range(n):
    where = np.flatnonzero(steps & (schedule.worker == w))
    if not len(where):
      continue
    rng = np.random.default_rng((seed, w))
    epochs = -(-len(where) * batch_size // m)
    order = np.argsort(rng.random((epochs, m)), axis=1).reshape(-1)
    index[where] = order[: len(where) * batch_size].reshape(-1, batch_size) + w * m
  return index.astype(np.int32)


def _bookkeeping(schedule, committed, accepted):
  """``server_step``, ``staleness``, ``read_step`` (``int32[E]`` each) from the device's flags.

  The server step starts at 0 and counts accepted commits (downpour's ``global_step``) or
  exchanges with the center. A worker reads the server right after its own commit, restart or
  join, unless the schedule gives explicit read steps, which are checked here: the server must have
  been at the requested step at some point since the worker's previous commit.
  """
  n, explicit = schedule.num_workers, schedule.read_step
  server_step = np.zeros(len(committed), np.int32)
  staleness = np.full(len(committed), -1, np.int32)
  read_step = np.full(len(committed), -1, np.int32)
  step, read = 0, np.zeros(n, np.int64)  # read: the step each worker read at its last exchange
  for k, (w, reads) in enumerate(zip(schedule.worker, schedule.restart | schedule.join)):
    if committed[k]:
      r = read[w] if explicit is None else explicit[k]
      if not read[w] <= r <= step:
        raise ValueError(
          f"`emulate`: event {k} (worker {w}) asks for the params of server step {r}, but"
          f" between the worker's previous commit and this one the server was at steps"
          f" {read[w]} to {step} only."
        )
      staleness[k], read_step[k] = step - r, r
    step += int(accepted[k])
    server_step[k] = step
    if committed[k] or reads:
      read[w] = step
  return server_step, staleness, read_step


def _next_reads(schedule):
  """``int32[E, N]``: after event e, the read step of each worker's next step (-1: none)."""
  e, n = schedule.num_events, schedule.num_workers
  out = np.full((e, n), -1, np.int32)
  pending = np.full(n, -1, np.int32)
  for k in range(e - 1, -1, -1):
    out[k] = pending
    if schedule.step[k]:
      pending[schedule.worker[k]] = schedule.read_step[k]
  return out


def emulate(
  protocol: Protocol,
  loss_fn: Callable[[optax.Params, Any], jax.Array],
  params: optax.Params,
  data: Any,
  schedule: Schedule,
  *,
  batch_size: int = 1,
  seed: int = 0,
  eval_fn: Callable[[optax.Params], Any] | None = None,
  eval_every: int | None = None,
) -> AsyncResult:
  r"""Runs ``protocol`` on ``schedule``'s events: one ``lax.scan`` over events under ``jax.jit``.

  Every worker starts from ``params`` (TF's init op copies the center to every worker). Then,
  for each event in time order, its worker draws its next minibatch from its shard of ``data``
  and:

  * **downpour**: computes ``loss_fn``'s gradients at its snapshot of the server params and
    commits them (``server.update(..., grad_step=read_step)``), then takes a new snapshot;
  * **elastic_average** / **agn**: takes one local step on its own params; on every τ-th local
    step it exchanges with the current center (see :func:`elastic_average`, :func:`agn`);
  * **diloco**: takes one local step on its own params; on every H-th local step (with
    ``dylu``, every :math:`H_w`-th of worker :math:`w`) it commits its pseudo-gradient to the
    server's outer optimizer and reads the new anchor (see :func:`diloco`);
  * a **restart** event re-initialises the worker from the current server params, center or
    anchor (its snapshot, or its local params and a fresh local optimizer state);
  * a **join** does the same for a worker absent until then (it joins with the current server
    params, center or anchor, not the initial ``params``);
  * a **leave** changes nothing on the server: whatever the worker computed since its last
    exchange (its step in flight, DiLoCo's local steps, AGN's accumulated gradients) is lost,
    and the worker has no later event.

  The workers are the schedule's :math:`N`, present or not: ``elastic_average``'s default
  :math:`\alpha = 0.9 / (\tau N)` counts the workers that join later or have left.

  Call it from Python, not under a ``jit`` of your own: it compiles and runs the scan itself and
  then derives the server steps and staleness on the host. The compiled scan is cached by
  ``protocol``, ``loss_fn``, ``eval_fn`` and the shapes: build them once to run many schedules of
  one length without recompiling.

  Args:
    protocol: :func:`downpour`, :func:`elastic_average`, :func:`agn` or :func:`diloco`.
    loss_fn: ``loss_fn(params, batch) -> scalar``, jittable; ``batch`` has the leaves of
      ``data`` with the leading worker axis removed and ``[batch_size, ...]`` rows (``None`` if
      ``data`` is ``None``).
    params: the initial params (any pytree of float arrays).
    data: a pytree whose leaves are ``[N, M, ...]``: worker ``i``'s shard of ``M`` examples is
      ``leaf[i]`` (``optax_dist.split_batch`` shards a dataset); or ``None`` for losses without
      data. The minibatch indices are computed on the host: each worker walks a fresh permutation
      of its shard per epoch, from ``numpy.random.default_rng((seed, worker))``.
    schedule: from :meth:`Cluster.schedule` (with the protocol's ``communication_period``; for
      DiLoCo with ``dylu``, ``protocol.sync_periods(cluster.worker_speeds)``) or
      :func:`explicit_schedule` (not with ``dylu``: it has no speeds).
    batch_size: the rows of a minibatch (ignored when ``data`` is ``None``).
    seed: the seed of the minibatch order.
    eval_fn: optional ``eval_fn(server_params) -> pytree of scalars``, jittable, called on the
      server params (downpour), the center or the anchor (diloco): once before the first event, then after every
      ``eval_every`` events and after the last (inside the scan).
    eval_every: events between evaluations; default: only before and after.

  Returns:
    An :class:`AsyncResult`: per-event loss, server step, staleness and acceptance, the
    evaluations, the final server params (center, anchor) and the workers' params.

  Shapes:
    With :math:`N` workers, :math:`E` events and :math:`P` params: the device holds the server
    (or center, or anchor) and its optimizer state, :math:`N` params snapshots (downpour) or
    :math:`N` local params and local optimizer states (and, for diloco, :math:`N` anchors read),
    the data, and :math:`E \times` (``batch_size`` + a
    few) int32 of schedule: :math:`O(NP + E)`, no per-event params.

  Collectives:
    None: the workers are emulated one event at a time on one device.

  Raises:
    ValueError: the schedule's ``communication_period`` differs from the protocol's (for
      DiLoCo with ``dylu``, from its per-worker periods at the schedule's speeds); ``dylu`` with
      an explicit schedule; explicit
      ``read_step`` with a protocol other than downpour, or steps the server never reached in
      time (detected after the run); ``data`` leaves not ``[N, M, ...]``; a bad ``batch_size``
      or ``eval_every``.

  Examples:
    TF's ``ElasticAverageOptimizer`` test with two workers (period 1, moving rate 0.5, SGD(1),
    gradients -1): worker 0 exchanges, then worker 1 against the center worker 0 left:

    >>> import jax.numpy as jnp, optax
    >>> from optax_dist import async_emulator as ae
    >>> protocol = ae.elastic_average(optax.sgd(1.0), communication_period=1, moving_rate=0.5)
    >>> r = ae.emulate(protocol, lambda p, _: -jnp.sum(p), jnp.array([0.0, 1.0]), None,
    ...                ae.explicit_schedule([0, 1]))
    >>> r.worker_params[:, 0], r.params[0]  # v0 of both workers, and of the center
    (Array([0.5 , 0.75], dtype=float32), Array(0.75, dtype=float32))
  """
  periods = _check_arguments(protocol, schedule, eval_every)
  explicit_reads = schedule.read_step is not None
  index = _batch_indices(schedule, data, batch_size, seed)
  e = schedule.num_events
  next_read = _next_reads(schedule) if explicit_reads else np.zeros((e, 0), np.int32)
  chunk = e if eval_every is None or eval_fn is None else min(eval_every, e)
  events, pad = _device_events(schedule, index, next_read, chunk)
  outputs, records, first, evals = _simulate(
    params, data, events, protocol=protocol, loss_fn=loss_fn, eval_fn=eval_fn,
    num_workers=schedule.num_workers, explicit_reads=explicit_reads,
    only_steps=bool(pad == 0 and schedule.step.all()), periods=periods,
  )
  records = jax.tree.map(lambda a: np.asarray(a).reshape((-1,) + a.shape[2:])[:e], records)
  evaluations = None
  if eval_fn is not None:
    evaluations = jax.tree.map(
      lambda a, b: np.concatenate([np.asarray(a)[None], np.asarray(b)]), first, evals)
  return _result(schedule, outputs, records, evaluations, chunk)


def _check_arguments(protocol, schedule, eval_every):
  """The checks of :func:`emulate` that need no data; DiLoCo's per-worker periods with ``dylu``
  (else ``None``)."""
  fn = "emulate"
  if not isinstance(protocol, (Downpour, ElasticAverage, AGN, DiLoCo)):
    raise TypeError(
      f"`{fn}(protocol=...)` must come from `downpour`, `elastic_average`, `agn` or `diloco`,"
      f" got {type(protocol).__name__}."
    )
  if not isinstance(schedule, Schedule):
    raise TypeError(f"`{fn}(schedule=...)` must be a Schedule, got {type(schedule).__name__}.")
  dylu = isinstance(protocol, DiLoCo) and protocol.dylu
  if dylu:
    if schedule.speeds is None:
      raise ValueError(
        f"`{fn}`: `diloco(dylu=True)` needs the workers' speeds, which an explicit schedule does"
        " not have; build the schedule with `Cluster(...).schedule(...)`.")
    periods = protocol.sync_periods(schedule.speeds)
    if schedule.periods != periods:
      raise ValueError(
        f"`{fn}`: the schedule was made with communication_period="
        f"{schedule.communication_period} but `diloco(dylu=True)` commits every {periods} local"
        f" steps at the workers' speeds {schedule.speeds}; build it with"
        f" `cluster.schedule(..., communication_period={periods})`.")
  period = schedule.communication_period
  if not dylu and period is not None and schedule.periods != (
      (protocol.communication_period,) * schedule.num_workers):
    raise ValueError(
      f"`{fn}`: the schedule was made with communication_period={period} but the protocol"
      f" communicates every {protocol.communication_period} steps; build it with"
      f" `cluster.schedule(..., communication_period={protocol.communication_period})`."
    )
  if schedule.read_step is not None and not isinstance(protocol, Downpour):
    raise ValueError(f"`{fn}`: explicit `read_step`s are for the downpour protocol only.")
  if eval_every is not None:
    _checks.check_positive_int(fn, "eval_every", eval_every)
  return periods if dylu else None


def _device_events(schedule, index, next_read, chunk):
  """The schedule as a :class:`simulators.Event` of ``[chunks, chunk, ...]`` device arrays, the
  last chunk padded with no-op events; and the number of those."""
  chunks = -(-schedule.num_events // chunk)
  pad = chunks * chunk - schedule.num_events
  kind = np.select([schedule.restart | schedule.join, schedule.leave],
                   [simulators.RESTART, simulators.NOOP], simulators.STEP).astype(np.int32)

  def padded(a, value):
    a = np.concatenate([a, np.full((pad,) + a.shape[1:], value, a.dtype)])
    return jnp.asarray(a.reshape((chunks, chunk) + a.shape[1:]))

  events = simulators.Event(
    worker=padded(schedule.worker.astype(np.int32), 0),
    kind=padded(kind, simulators.NOOP),
    index=padded(index, 0),
    next_read=padded(next_read, -1),
  )
  return events, pad


def _result(schedule, outputs, records, evaluations, chunk):
  """The :class:`AsyncResult` of a run: the device's outputs and records, the host's counts."""
  server, workers, server_state = outputs
  server_step, staleness, read_step = _bookkeeping(schedule, records.committed, records.accepted)
  e = schedule.num_events
  last = np.minimum(np.arange(1, -(-e // chunk) + 1) * chunk, e) - 1  # each evaluation's event
  return AsyncResult(
    time=schedule.time,
    worker=schedule.worker,
    restart=schedule.restart,
    join=schedule.join,
    leave=schedule.leave,
    loss=records.loss,
    server_step=server_step,
    committed=records.committed,
    accepted=records.accepted,
    staleness=staleness,
    read_step=read_step,
    eval_time=np.concatenate([[0.0], schedule.time[last]]),
    eval_step=np.concatenate([[0], server_step[last]]).astype(np.int32),
    eval_metrics=evaluations,
    params=server,
    worker_params=workers,
    server_state=server_state,
  )
