r"""Asynchronous parameter-server training, emulated deterministically on one device.

JAX collectives are synchronous: every worker of a mapped axis takes its step at the same time.
TF 1.x ran its distributed optimizers *asynchronously*: each worker read the parameter server,
computed, and committed later, while others committed in between. This module reproduces that
with a deterministic event simulation:

1. **Timing** (host, NumPy). A :class:`Cluster` draws every worker's compute times from a seeded
   distribution (constant, uniform jitter, or some workers ``slowdown`` × slower) plus an optional
   communication latency, and :meth:`Cluster.schedule` turns them into a :class:`Schedule`: which
   worker finishes a step when, in time order, with worker restarts. :func:`explicit_schedule`
   builds one from a list instead (e.g. TF's unit tests' orders).
2. **Numerics** (device). :func:`emulate` runs the schedule as one ``jax.lax.scan`` over events
   inside ``jax.jit``: no Python work per event. Each worker holds one snapshot of the params
   (its read of the server, or its local params); no per-event copy is kept.

The protocols:

* :func:`downpour` (asynchronous SGD, "Downpour"): a worker reads the server params and the
  server's ``global_step``, computes gradients on its own minibatch at those params, and commits
  them later to the server transformation with ``grad_step=`` the step it read, then reads again.
  With ``optax_dist.drop_stale_gradients`` as the server transformation, stale commits are
  dropped exactly as TF's ``DropStaleGradientOptimizer`` drops them.
* :func:`elastic_average` (asynchronous EASGD, TF's ``ElasticAverageOptimizer``): each worker
  trains its own params with ``inner``; on every ``communication_period``-th local step it
  exchanges with the *current* center, one worker at a time in event order:
  :math:`d = \alpha (x' - \tilde{x})`, :math:`x \leftarrow x' - d`,
  :math:`\tilde{x} \leftarrow \tilde{x} + d`.
* :func:`agn` (TF's ``AGNOptimizer``): each worker trains locally and, every
  ``communication_period`` steps, commits its accumulated gradient divided by the period to the
  center (one ``inner`` step with the one shared center optimizer state), then pulls the center.

The per-worker numerics are the library's own transformations with ``axis_name=None``
(:func:`optax_dist.elastic_average`, :func:`optax_dist.agn`), called with the current center
swapped into their state; only the event order is the emulator's.

Example:

  >>> import jax.numpy as jnp, optax, optax_dist
  >>> from optax_dist import async_emulator as ae
  >>> def loss_fn(params, batch):  # least squares on each worker's shard
  ...   return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)
  >>> x = jnp.linspace(-1.0, 1.0, 64).reshape(4, 16, 1)  # 4 workers x 16 examples
  >>> data = {"x": x, "y": 3.0 * x[..., 0]}
  >>> cluster = ae.Cluster(num_workers=4, jitter=0.2, seed=0)
  >>> result = ae.emulate(
  ...     ae.downpour(optax_dist.drop_stale_gradients(optax.sgd(0.2), max_staleness=3)),
  ...     loss_fn, jnp.zeros(1), data, cluster.schedule(num_events=200), batch_size=8)
  >>> result.num_accepted + result.num_dropped
  200
  >>> bool(abs(result.params[0] - 3.0) < 1e-2)
  True
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dist import _common
from optax_dist._agn import agn as _agn
from optax_dist._drop_stale_gradients import DropStaleGradientsState
from optax_dist._elastic_average import BETA
from optax_dist._elastic_average import elastic_average as _elastic_average

__all__ = (
  "AGN",
  "AsyncResult",
  "Cluster",
  "Downpour",
  "ElasticAverage",
  "Schedule",
  "agn",
  "downpour",
  "elastic_average",
  "emulate",
  "explicit_schedule",
)

_STEP, _RESTART, _NOOP = 0, 1, 2  # event kinds on the device


# ----------------------------------------------------------------------------------------------
# Protocols.


@dataclasses.dataclass(frozen=True)
class Downpour:
  """Asynchronous SGD against a parameter server; built by :func:`downpour`.

  Attributes:
    server: the transformation the server applies to each commit.
  """

  server: optax.GradientTransformation

  @property
  def communication_period(self) -> int:
    """Every step of a worker is a commit."""
    return 1


@dataclasses.dataclass(frozen=True)
class ElasticAverage:
  """Asynchronous elastic averaging; built by :func:`elastic_average`.

  Attributes:
    inner: every worker's local optimizer.
    communication_period: τ, local steps between a worker's exchanges with the center.
    moving_rate: α, or ``None`` for :math:`0.9 / (\\tau N)`.
    rho: ρ, as :func:`optax_dist.elastic_average`.
    learning_rate: as :func:`optax_dist.elastic_average` (only for the default ρ).
  """

  inner: optax.GradientTransformation
  communication_period: int = 10
  moving_rate: float | None = None
  rho: float | None = None
  learning_rate: float | None = None

  def transformation(self, num_workers: int) -> optax.GradientTransformationExtraArgs:
    """One worker's ``optax_dist.elastic_average`` (``axis_name=None``), α resolved for N."""
    alpha = self.moving_rate
    if alpha is None:
      alpha = BETA / self.communication_period / num_workers
    return _elastic_average(
      self.inner, communication_period=self.communication_period, moving_rate=alpha,
      rho=self.rho, learning_rate=self.learning_rate,
    )


@dataclasses.dataclass(frozen=True)
class AGN:
  """Asynchronous accumulated gradient normalization; built by :func:`agn`.

  Attributes:
    inner: the optimizer of the local steps and of the center (one shared center state).
    communication_period: τ, local steps between a worker's commits.
  """

  inner: optax.GradientTransformation
  communication_period: int = 10

  def transformation(self, num_workers: int) -> optax.GradientTransformationExtraArgs:
    """One worker's ``optax_dist.agn`` (``axis_name=None``)."""
    del num_workers
    return _agn(self.inner, communication_period=self.communication_period)


Protocol = Downpour | ElasticAverage | AGN


def downpour(server: optax.GradientTransformation) -> Downpour:
  r"""Asynchronous SGD (Downpour): workers commit gradients of the params they read earlier.

  Worker :math:`i` reads the server params :math:`w_{s}` and the server's ``global_step``
  :math:`s`, computes :math:`g_i = \nabla \ell(w_{s}; B_i)` on its minibatch, and when its step
  ends commits

  .. math::

    u, \mathrm{state} = \mathrm{server.update}(g_i, \mathrm{state}, w,\ \mathrm{grad\_step}=s),
    \qquad w \leftarrow w + u

  to the *current* server params :math:`w`, then reads again. The staleness of the commit is
  :math:`\mathrm{global\_step} - s`. ``global_step`` is the ``global_step`` of the first
  :class:`optax_dist.DropStaleGradientsState` in the server state (so it counts accepted
  commits only, as TF's), or else the number of commits.

  Args:
    server: the server's transformation, e.g. ``optax.sgd(0.1)`` or
      ``optax_dist.drop_stale_gradients(optax.sgd(0.1), max_staleness=2)``. Extra args it does
      not take (``grad_step``) are dropped (``optax.with_extra_args_support``).

  Returns:
    A :class:`Downpour` protocol for :func:`emulate`.

  Raises:
    TypeError: ``server`` is not a transformation.

  Examples:
    >>> import optax, optax_dist
    >>> from optax_dist import async_emulator as ae
    >>> ae.downpour(optax_dist.drop_stale_gradients(optax.sgd(0.1), 2)).communication_period
    1

  References:
    Dean et al., `Large Scale Distributed Deep Networks
    <https://papers.nips.cc/paper/4687-large-scale-distributed-deep-networks>`_, NeurIPS 2012.
    TensorFlow 1.x, ``tf.contrib.opt.DropStaleGradientOptimizer``.
  """
  _common.check_transformation("downpour", server)
  return Downpour(server)


def elastic_average(
  inner: optax.GradientTransformation,
  *,
  communication_period: int = 10,
  moving_rate: float | None = None,
  rho: float | None = None,
  learning_rate: float | None = None,
) -> ElasticAverage:
  r"""Asynchronous EASGD: each worker exchanges with the current center, one at a time.

  Worker :math:`i` trains its own params :math:`x_i` with ``inner`` (and ρ's elastic force
  towards the current center). On its τ-th, 2τ-th, … local step, with :math:`x'_i` its params
  after the step and :math:`\tilde{x}` the center *as the previous exchange left it*:

  .. math::

    d = \alpha\,(x'_i - \tilde{x}), \qquad x_i \leftarrow x'_i - d, \qquad
    \tilde{x} \leftarrow \tilde{x} + d

  which is TF's asynchronous order. Each worker step is one call of
  ``optax_dist.elastic_average(inner, communication_period=τ, moving_rate=α, ...)`` (no axis)
  with ``state._replace(center=current_center)``.

  Args:
    inner: every worker's local optimizer (each worker has its own state).
    communication_period: τ, in local steps; a worker's first exchange is on its τ-th step.
    moving_rate: α; default :math:`0.9 / (\tau N)` with :math:`N` the schedule's workers.
    rho: ρ, as :func:`optax_dist.elastic_average` (default 0, or α / ``learning_rate``).
    learning_rate: ``inner``'s learning rate, only for the default ρ.

  Returns:
    An :class:`ElasticAverage` protocol for :func:`emulate`.

  Raises:
    TypeError, ValueError: as :func:`optax_dist.elastic_average` for the same arguments.

  Examples:
    >>> import optax
    >>> from optax_dist import async_emulator as ae
    >>> ae.elastic_average(optax.sgd(0.1), communication_period=4).communication_period
    4

  References:
    TensorFlow 1.x, ``tf.contrib.opt.ElasticAverageOptimizer``.
    Zhang, Choromanska & LeCun, `Deep learning with Elastic Averaging SGD
    <https://arxiv.org/abs/1412.6651>`_, NeurIPS 2015 (Algorithm 2, asynchronous EASGD).
  """
  _elastic_average(  # the library's own validation of every argument
    inner, communication_period=communication_period, moving_rate=moving_rate, rho=rho,
    learning_rate=learning_rate,
  )
  return ElasticAverage(inner, communication_period, moving_rate, rho, learning_rate)


def agn(inner: optax.GradientTransformation, *, communication_period: int = 10) -> AGN:
  r"""Asynchronous AGN: workers commit their mean accumulated gradient to a shared center.

  Worker :math:`i` trains its own params with ``inner`` and accumulates its raw gradients
  :math:`a_i`. On its τ-th, 2τ-th, … local step it commits, in event order:

  .. math::

    \tilde{x} \leftarrow \tilde{x} + \mathrm{inner}_{\tilde{x}}(a_i / \tau), \qquad
    x_i \leftarrow \tilde{x}, \qquad a_i \leftarrow 0

  where :math:`\mathrm{inner}_{\tilde{x}}` is ``inner.update`` with ``params=center`` and the
  one center optimizer state shared by every worker (TF keeps its slots on the parameter
  server). Each worker step is one call of ``optax_dist.agn(inner, communication_period=τ)`` (no
  axis) with the current ``center`` and ``center_inner_state`` swapped into its state.

  Args:
    inner: the optimizer of the local steps and of the center.
    communication_period: τ, in local steps; a worker's first commit is on its τ-th step.

  Returns:
    An :class:`AGN` protocol for :func:`emulate`.

  Raises:
    TypeError, ValueError: as :func:`optax_dist.agn` for the same arguments.

  Examples:
    >>> import optax
    >>> from optax_dist import async_emulator as ae
    >>> ae.agn(optax.adam(0.01), communication_period=4).communication_period
    4

  References:
    TensorFlow 1.x, ``tf.contrib.opt.AGNOptimizer``.
    Hermans, Spanakis & Möckel, `Accumulated Gradient Normalization
    <https://arxiv.org/abs/1710.02368>`_, ACML 2017.
  """
  _agn(inner, communication_period=communication_period)  # the library's validation
  return AGN(inner, communication_period)


# ----------------------------------------------------------------------------------------------
# Timing: the cluster and the event schedule (host, NumPy).


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """The events of an emulation in time order (host NumPy arrays, one entry per event).

  Build it with :meth:`Cluster.schedule` or :func:`explicit_schedule`.

  Attributes:
    num_workers: :math:`N`.
    worker: ``int32[E]``, the worker of each event.
    time: ``float64[E]``, the simulated time of each event, nondecreasing.
    restart: ``bool[E]``, True for a restart (the worker re-initialises from the server or the
      center), False for a step (a local step; for downpour a commit).
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
      communicates (every step for downpour; every τ-th for elastic averaging and AGN).
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
    state from the server or the center, its local step count restarts at 0, and it continues.
    The other workers never wait.

    Args:
      num_events: stop after this many steps (restarts not counted; those at or before the last
        step are kept).
      duration: or stop at this simulated time (events at ``time <= duration`` are kept).
      communication_period: the protocol's τ (1 for downpour): which steps pay ``latency``.
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
    n = self.num_workers
    per_worker = max(16, 2 * (num_events or 0) // n + 16)
    while True:
      steps = [self._worker_steps(w, per_worker, communication_period, crashes[w])
               for w in range(n)]
      horizon = min(s[0][-1] if len(s[0]) else np.inf for s in steps)
      all_times = np.sort(np.concatenate([s[0] for s in steps]))
      if num_events is not None:
        end = all_times[num_events - 1] if len(all_times) >= num_events else np.inf
      else:
        end = duration
      if end <= horizon:
        break
      if per_worker > 1 << 24:
        raise ValueError(f"`{fn}`: the workers make no progress; check `restarts`.")
      per_worker *= 2

    worker, time, restart, local = [], [], [], []
    for w, (t, k) in enumerate(steps):
      worker.append(np.full(len(t), w))
      time.append(t)
      restart.append(np.zeros(len(t), bool))
      local.append(k)
      back = np.array([c + d for c, d in crashes[w]], float)
      worker.append(np.full(len(back), w))
      time.append(back)
      restart.append(np.ones(len(back), bool))
      local.append(np.zeros(len(back), np.int64))
    worker, time, restart, local = map(np.concatenate, (worker, time, restart, local))
    order = np.lexsort((worker, restart, time))
    worker, time, restart, local = worker[order], time[order], restart[order], local[order]
    if num_events is not None:
      last = np.flatnonzero(~restart)[num_events - 1]
      keep = np.arange(len(time)) <= last
    else:
      keep = time <= duration
    return Schedule(
      num_workers=n,
      worker=worker[keep].astype(np.int32),
      time=time[keep].astype(np.float64),
      restart=restart[keep],
      local_step=local[keep].astype(np.int32),
      communication_period=communication_period,
    )

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
  * ``("restart", w)``: worker ``w`` re-initialises from the server or the center.

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


# ----------------------------------------------------------------------------------------------
# The result.


@dataclasses.dataclass(frozen=True, eq=False)
class AsyncResult:
  """What :func:`emulate` returns. Per-event arrays have one entry per schedule event.

  Attributes:
    time: ``float64[E]``, each event's simulated time.
    worker: ``int32[E]``, each event's worker.
    restart: ``bool[E]``, True for restart events.
    loss: ``float32[E]``, the minibatch loss the worker computed at the event (at its snapshot
      for downpour, at its local params otherwise); NaN for restarts.
    server_step: ``int32[E]``, the server step after the event: downpour's ``global_step``
      (accepted commits); for elastic averaging and AGN the number of exchanges with the center.
    committed: ``bool[E]``, True where the event exchanged with the server (every downpour step;
      every τ-th local step otherwise).
    accepted: ``bool[E]``, committed and not dropped.
    staleness: ``int32[E]``, for commits: the server step at the commit minus the server step
      the worker read (for elastic averaging and AGN: at its last exchange or restart); -1
      elsewhere.
    read_step: ``int32[E]``, for commits: the server step the worker read; -1 elsewhere.
    eval_time, eval_step: ``float64[K]``, ``int32[K]``: when ``eval_fn`` ran (time 0, then after
      every ``eval_every`` events and after the last).
    eval_metrics: ``eval_fn``'s outputs stacked on a leading axis ``[K]``; ``None`` without it.
    params: the final server params (downpour) or center.
    worker_params: the final per-worker params, stacked ``[N, ...]``: each worker's last read of
      the server (downpour) or its local params.
    server_state: the final server optimizer state (downpour), center optimizer state (AGN), or
      ``None`` (elastic averaging).
  """

  time: np.ndarray
  worker: np.ndarray
  restart: np.ndarray
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


# ----------------------------------------------------------------------------------------------
# The numerics (device): one lax.scan over events.


class _Event(NamedTuple):
  worker: jax.Array  # int32[]
  kind: jax.Array  # int32[]: _STEP, _RESTART or _NOOP
  index: jax.Array  # int32[B]: rows of the flattened data
  next_read: jax.Array  # int32[N] (explicit read steps) or int32[0]


class _Record(NamedTuple):
  """What the device reports per event; the integer bookkeeping (server steps, staleness) follows
  from it and the schedule on the host (:func:`_bookkeeping`)."""

  loss: jax.Array  # float32[]: the worker's minibatch loss (NaN for restarts)
  committed: jax.Array  # bool[]: the event exchanged with the server
  accepted: jax.Array  # bool[]: committed and not dropped


def _stack(tree, n):
  """``n`` copies of ``tree``, one per worker: every leaf stacked on a leading axis ``[n, ...]``."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + jnp.shape(a)), tree)


_READ_GROUP = 8
"""Leaves read by one ``lax.cond`` in :func:`_take`: XLA's CPU runtime runs a branch of at most
8 kernels sequentially, a longer one concurrently on its thread pool, which costs far more here."""


def _take(stacked, w):
  """Worker ``w``'s copy of a stacked tree.

  The read goes through ``lax.cond``s (whose predicate always holds) so that it lands in buffers
  of its own: plain dynamic slices get fused into their many consumers, some of which XLA then
  schedules after the row's write, and it then copies the whole stacks on every event.
  """
  leaves, treedef = jax.tree.flatten(stacked)
  out = []
  for start in range(0, len(leaves), _READ_GROUP):
    group = leaves[start:start + _READ_GROUP]

    def read(group=group):
      return [jax.lax.dynamic_index_in_dim(a, w, keepdims=False) for a in group]

    def empty(group=group):
      return [jnp.zeros(a.shape[1:], a.dtype) for a in group]

    out += jax.lax.cond(w >= 0, read, empty)
  return treedef.unflatten(out)


def _put(stacked, w, tree):
  """``stacked`` with worker ``w``'s copy replaced by ``tree`` (in place under ``jit``)."""
  return jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, w, 0), stacked, tree)


def _drop_stale_state(state):
  """The first ``DropStaleGradientsState`` in a depth-first walk of ``state``, or ``None``."""
  def is_dss(x):
    return isinstance(x, DropStaleGradientsState)

  for node in jax.tree.leaves(state, is_leaf=is_dss):
    if is_dss(node):
      return node
  return None


def _nan_if(pred, loss):
  return jnp.where(pred, loss.astype(jnp.float32), jnp.float32(jnp.nan))


def _select(pred, on_true, on_false, every_event_is_a_step):
  """``optax.tree.where``, skipped when the schedule has only steps (``pred`` is then True)."""
  return on_true if every_event_is_a_step else optax.tree.where(pred, on_true, on_false)


class _DownpourSim:
  """Carry: server params and state, an own commit counter, N snapshots and their read steps."""

  def __init__(self, protocol, loss_fn, num_workers, explicit_reads, only_steps):
    self.server = optax.with_extra_args_support(protocol.server)
    self.loss_fn = loss_fn
    self.n = num_workers
    self.explicit_reads = explicit_reads
    self.only_steps = only_steps

  def global_step(self, opt_state, commits):
    dss = _drop_stale_state(opt_state)
    return commits if dss is None else dss.global_step

  def dropped(self, opt_state):
    dss = _drop_stale_state(opt_state)
    return jnp.zeros([], jnp.int32) if dss is None else dss.num_dropped

  def init(self, params):
    params = jax.tree.map(jnp.asarray, params)
    opt_state = self.server.init(params)
    commits = jnp.zeros([], jnp.int32)
    snap_step = jnp.full([self.n], self.global_step(opt_state, commits), jnp.int32)
    return (params, opt_state, commits, _stack(params, self.n), snap_step)

  def server_params(self, carry):
    return carry[0]

  def event(self, carry, ev, batch):
    params, opt_state, commits, snaps, snap_step = carry
    is_step, is_restart = ev.kind == _STEP, ev.kind == _RESTART
    w = ev.worker
    snap, read = _take(snaps, w), snap_step[w]

    loss, grads = jax.value_and_grad(self.loss_fn)(snap, batch)
    updates, new_state = self.server.update(grads, opt_state, params, grad_step=read)
    new_params = optax.apply_updates(params, updates)
    dropped = self.dropped(new_state) > self.dropped(opt_state)
    params = _select(is_step, new_params, params, self.only_steps)
    opt_state = _select(is_step, new_state, opt_state, self.only_steps)
    commits = commits + is_step.astype(jnp.int32)
    step_after = self.global_step(opt_state, commits)

    if self.explicit_reads:  # every worker whose next commit reads this step refreshes
      fresh = ev.next_read == step_after
      snaps = jax.tree.map(
        lambda s, p: jnp.where(fresh.reshape((-1,) + (1,) * p.ndim), p[None], s), snaps, params)
      snap_step = jnp.where(fresh, step_after, snap_step)
    else:  # the worker reads right after its own commit or restart
      reads = is_step | is_restart
      snaps = _put(snaps, w, _select(reads, params, snap, self.only_steps))
      snap_step = snap_step.at[w].set(jnp.where(reads, step_after, read))

    record = _Record(loss=_nan_if(is_step, loss), committed=is_step, accepted=is_step & ~dropped)
    return (params, opt_state, commits, snaps, snap_step), record

  def outputs(self, carry):
    return carry[0], carry[3], carry[1]


class _CenterSim:
  """Elastic averaging and AGN. Carry: the center and its shared optimizer state (AGN), and the
  workers' rows (local params and local state, whose shared fields are ``None``)."""

  def __init__(self, protocol, loss_fn, num_workers, only_steps):
    self.tx = protocol.transformation(num_workers)
    self.period = protocol.communication_period
    self.agn = isinstance(protocol, AGN)
    self.loss_fn = loss_fn
    self.n = num_workers
    self.only_steps = only_steps

  def local(self, state):  # the worker's own part of the state
    if self.agn:
      return state._replace(center=None, center_inner_state=None)
    return state._replace(center=None)

  def shared(self, state):
    return (state.center, state.center_inner_state) if self.agn else (state.center, None)

  def full(self, local, shared):
    center, center_inner_state = shared
    if self.agn:
      return local._replace(center=center, center_inner_state=center_inner_state)
    return local._replace(center=center)

  def init(self, params):
    params = jax.tree.map(jnp.asarray, params)
    state = self.tx.init(params)
    return (self.shared(state), _stack((params, self.local(state)), self.n))

  def server_params(self, carry):
    return carry[0][0]

  def event(self, carry, ev, batch):
    shared, rows = carry
    is_step, is_restart = ev.kind == _STEP, ev.kind == _RESTART
    w = ev.worker
    x, local = _take(rows, w)

    loss, grads = jax.value_and_grad(self.loss_fn)(x, batch)
    # The update runs under `vmap` over a batch of one: the transformation's `lax.cond` on the
    # communication step then becomes a select of both branches (same result). On CPU a
    # conditional inside the scan costs more than the exchange it skips.
    one = (grads, self.full(local, shared), x)
    updates, new_state = jax.tree.map(
      lambda a: a[0], jax.vmap(self.tx.update)(*jax.tree.map(lambda a: a[None], one)))
    new_x = optax.apply_updates(x, updates)
    committed = is_step & (new_state.local_step % self.period == 0)
    new_row = (new_x, self.local(new_state))
    if self.only_steps:
      shared, row = self.shared(new_state), new_row
    else:
      shared = optax.tree.where(is_step, self.shared(new_state), shared)
      center = shared[0]
      fresh = (center, self.local(self.tx.init(center)))  # a restart starts from the center
      row = optax.tree.where(is_restart, fresh, optax.tree.where(is_step, new_row, (x, local)))
    rows = _put(rows, w, row)

    record = _Record(loss=_nan_if(is_step, loss), committed=committed, accepted=committed)
    return (shared, rows), record

  def outputs(self, carry):
    shared, rows = carry[0], carry[1]
    return shared[0], rows[0], shared[1]


@functools.partial(
  jax.jit,
  static_argnames=("protocol", "loss_fn", "eval_fn", "num_workers", "explicit_reads",
                   "only_steps"))
def _simulate(params, data, events, *, protocol, loss_fn, eval_fn, num_workers, explicit_reads,
              only_steps):
  """The emulation: ``events`` leaves are ``[chunks, chunk, ...]``; ``eval_fn`` after each chunk.

  ``only_steps``: every event is a step (no restart, no padding), so no event needs a select.
  """
  if isinstance(protocol, Downpour):
    sim = _DownpourSim(protocol, loss_fn, num_workers, explicit_reads, only_steps)
  else:
    sim = _CenterSim(protocol, loss_fn, num_workers, only_steps)
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
  _common.check_positive_int("emulate", "batch_size", batch_size)
  if batch_size > m:
    raise ValueError(
      f"`emulate(batch_size=...)` must be at most the examples per worker ({m}), got"
      f" {batch_size}."
    )
  index = np.zeros((schedule.num_events, batch_size), np.int64)
  steps = ~schedule.restart
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
  exchanges with the center. A worker reads the server right after its own commit or restart,
  unless the schedule gives explicit read steps, which are checked here: the server must have
  been at the requested step at some point since the worker's previous commit.
  """
  n, explicit = schedule.num_workers, schedule.read_step
  server_step = np.zeros(len(committed), np.int32)
  staleness = np.full(len(committed), -1, np.int32)
  read_step = np.full(len(committed), -1, np.int32)
  step, read = 0, np.zeros(n, np.int64)  # read: the step each worker read at its last exchange
  for k, (w, restart) in enumerate(zip(schedule.worker, schedule.restart)):
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
    if committed[k] or restart:
      read[w] = step
  return server_step, staleness, read_step


def _next_reads(schedule):
  """``int32[E, N]``: after event e, the read step of each worker's next step (-1: none)."""
  e, n = schedule.num_events, schedule.num_workers
  out = np.full((e, n), -1, np.int32)
  pending = np.full(n, -1, np.int32)
  for k in range(e - 1, -1, -1):
    out[k] = pending
    if not schedule.restart[k]:
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
  * a **restart** event re-initialises the worker from the current server params or center (its
    snapshot, or its local params and a fresh local optimizer state).

  Call it from Python, not under a ``jit`` of your own: it compiles and runs the scan itself and
  then derives the server steps and staleness on the host. The compiled scan is cached by
  ``protocol``, ``loss_fn``, ``eval_fn`` and the shapes: build them once to run many schedules of
  one length without recompiling.

  Args:
    protocol: :func:`downpour`, :func:`elastic_average` or :func:`agn`.
    loss_fn: ``loss_fn(params, batch) -> scalar``, jittable; ``batch`` has the leaves of
      ``data`` with the leading worker axis removed and ``[batch_size, ...]`` rows (``None`` if
      ``data`` is ``None``).
    params: the initial params (any pytree of float arrays).
    data: a pytree whose leaves are ``[N, M, ...]``: worker ``i``'s shard of ``M`` examples is
      ``leaf[i]`` (``optax_dist.split_batch`` shards a dataset); or ``None`` for losses without
      data. The minibatch indices are computed on the host: each worker walks a fresh permutation
      of its shard per epoch, from ``numpy.random.default_rng((seed, worker))``.
    schedule: from :meth:`Cluster.schedule` (with the protocol's ``communication_period``) or
      :func:`explicit_schedule`.
    batch_size: the rows of a minibatch (ignored when ``data`` is ``None``).
    seed: the seed of the minibatch order.
    eval_fn: optional ``eval_fn(server_params) -> pytree of scalars``, jittable, called on the
      server params (downpour) or the center: once before the first event, then after every
      ``eval_every`` events and after the last (inside the scan).
    eval_every: events between evaluations; default: only before and after.

  Returns:
    An :class:`AsyncResult`: per-event loss, server step, staleness and acceptance, the
    evaluations, the final server (or center) params and the workers' params.

  Shapes:
    With :math:`N` workers, :math:`E` events and :math:`P` params: the device holds the server
    (or center) and its optimizer state, :math:`N` params snapshots (downpour) or :math:`N`
    local params and local optimizer states, the data, and :math:`E \times` (``batch_size`` + a
    few) int32 of schedule: :math:`O(NP + E)`, no per-event params.

  Collectives:
    None: the workers are emulated one event at a time on one device.

  Raises:
    ValueError: the schedule's ``communication_period`` differs from the protocol's; explicit
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
  fn = "emulate"
  if not isinstance(protocol, (Downpour, ElasticAverage, AGN)):
    raise TypeError(
      f"`{fn}(protocol=...)` must come from `downpour`, `elastic_average` or `agn`, got"
      f" {type(protocol).__name__}."
    )
  if not isinstance(schedule, Schedule):
    raise TypeError(f"`{fn}(schedule=...)` must be a Schedule, got {type(schedule).__name__}.")
  period = schedule.communication_period
  if period is not None and period != protocol.communication_period:
    raise ValueError(
      f"`{fn}`: the schedule was made with communication_period={period} but the protocol"
      f" communicates every {protocol.communication_period} steps; build it with"
      f" `cluster.schedule(..., communication_period={protocol.communication_period})`."
    )
  explicit_reads = schedule.read_step is not None
  if explicit_reads and not isinstance(protocol, Downpour):
    raise ValueError(f"`{fn}`: explicit `read_step`s are for the downpour protocol only.")
  if eval_every is not None:
    _common.check_positive_int(fn, "eval_every", eval_every)
  n, e = schedule.num_workers, schedule.num_events
  index = _batch_indices(schedule, data, batch_size, seed)
  next_read = _next_reads(schedule) if explicit_reads else np.zeros((e, 0), np.int32)

  chunk = e if eval_every is None or eval_fn is None else min(eval_every, e)
  chunks = -(-e // chunk)
  pad = chunks * chunk - e
  kind = np.where(schedule.restart, _RESTART, _STEP).astype(np.int32)

  def padded(a, value):
    a = np.concatenate([a, np.full((pad,) + a.shape[1:], value, a.dtype)])
    return jnp.asarray(a.reshape((chunks, chunk) + a.shape[1:]))

  events = _Event(
    worker=padded(schedule.worker.astype(np.int32), 0),
    kind=padded(kind, _NOOP),
    index=padded(index, 0),
    next_read=padded(next_read, -1),
  )
  (server, workers, server_state), records, first, evals = _simulate(
    params, data, events, protocol=protocol, loss_fn=loss_fn, eval_fn=eval_fn,
    num_workers=n, explicit_reads=explicit_reads,
    only_steps=bool(pad == 0 and not schedule.restart.any()),
  )
  records = jax.tree.map(lambda a: np.asarray(a).reshape((-1,) + a.shape[2:])[:e], records)
  server_step, staleness, read_step = _bookkeeping(schedule, records.committed, records.accepted)

  last = np.minimum(np.arange(1, chunks + 1) * chunk, e) - 1
  eval_metrics = None
  if eval_fn is not None:
    eval_metrics = jax.tree.map(
      lambda a, b: np.concatenate([np.asarray(a)[None], np.asarray(b)]), first, evals)
  return AsyncResult(
    time=schedule.time,
    worker=schedule.worker,
    restart=schedule.restart,
    loss=records.loss,
    server_step=server_step,
    committed=records.committed,
    accepted=records.accepted,
    staleness=staleness,
    read_step=read_step,
    eval_time=np.concatenate([[0.0], schedule.time[last]]),
    eval_step=np.concatenate([[0], server_step[last]]).astype(np.int32),
    eval_metrics=eval_metrics,
    params=server,
    worker_params=workers,
    server_state=server_state,
  )
