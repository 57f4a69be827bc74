r"""The protocols of the asynchronous emulator: what a worker does at a step and at a commit.

Each factory checks its arguments with the library transformation it reuses and returns a frozen
dataclass that :func:`optax_dist.async_emulator.emulate` runs:

* :func:`downpour`: asynchronous SGD, every step a commit of gradients to the server;
* :func:`elastic_average`: asynchronous EASGD (:func:`optax_dist.elastic_average` per worker);
* :func:`agn`: asynchronous AGN (:func:`optax_dist.agn` per worker);
* :func:`diloco`: asynchronous DiLoCo, every H-th step a commit of a pseudo-gradient to the
  server's outer optimizer; with ``dylu=True`` every :math:`H_w`-th step of worker :math:`w`
  (:func:`dylu_sync_periods`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import optax

from optax_dist import _checks
from optax_dist._agn import agn as _agn
from optax_dist._outer import default_outer
from optax_dist._diloco import diloco as _diloco
from optax_dist._elastic_average import BETA
from optax_dist._elastic_average import elastic_average as _elastic_average

__all__ = (
  "AGN",
  "DiLoCo",
  "Downpour",
  "ElasticAverage",
  "Protocol",
  "agn",
  "diloco",
  "downpour",
  "dylu_sync_periods",
  "elastic_average",
)


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


@dataclasses.dataclass(frozen=True)
class DiLoCo:
  """Asynchronous DiLoCo; built by :func:`diloco`.

  Attributes:
    inner: every worker's local optimizer (each worker has its own state).
    outer: the server's optimizer of the anchor, fed one pseudo-gradient per commit.
    sync_period: H, local steps between a worker's commits (the fastest worker's with
      ``dylu``).
    dylu: whether each worker's local steps per commit scale with its speed
      (:func:`dylu_sync_periods`).
  """

  inner: optax.GradientTransformation
  outer: optax.GradientTransformation
  sync_period: int = 500
  dylu: bool = False

  @property
  def communication_period(self) -> int:
    """A worker commits on every H-th local step (with ``dylu``, the fastest worker)."""
    return self.sync_period

  def sync_periods(self, speeds: Sequence[float]) -> tuple[int, ...]:
    """Each worker's local steps per commit given the workers' ``speeds``: H for every worker,
    or :func:`dylu_sync_periods` with ``dylu``. Pass the result to ``Cluster.schedule(...,
    communication_period=...)`` with ``speeds=cluster.worker_speeds``."""
    if self.dylu:
      return dylu_sync_periods(speeds, self.sync_period)
    return (self.sync_period,) * len(speeds)


Protocol = Downpour | ElasticAverage | AGN | DiLoCo


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
  _checks.check_transformation("downpour", server)
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



def dylu_sync_periods(speeds: Sequence[float], sync_period: int) -> tuple[int, ...]:
  r"""Dynamic local updates: each worker's local steps per commit, proportional to its speed.

  With :math:`v_w` the speed of worker :math:`w` (steps per unit of time) and :math:`H` the
  fastest worker's local steps per commit:

  .. math::

    H_w = \max\Big(1, \Big\lfloor \frac{v_w}{\max_u v_u}\, H \Big\rfloor\Big)

  so every worker's round of local steps takes about as long as the fastest worker's, and slow
  workers' pseudo-gradients are no staler than the fast ones'. (A product within a relative
  :math:`10^{-9}` below an integer counts as that integer, against float rounding:
  ``0.29 * 100`` gives 29.)

  Args:
    speeds: one speed :math:`v_w > 0` per worker, any unit (``Cluster.worker_speeds``).
    sync_period: :math:`H`, in local steps, a positive int.

  Returns:
    :math:`(H_0, \dots, H_{N-1})`, positive ints, in local steps.

  Raises:
    ValueError: ``speeds`` empty or not all finite and > 0; ``sync_period`` not a positive int.

  Examples:
    >>> from optax_dist import async_emulator as ae
    >>> ae.dylu_sync_periods((1.0, 1.0, 0.5, 0.25), 30)
    (30, 30, 15, 7)

  References:
    Liu et al., `Asynchronous Local-SGD Training for Language Modeling
    <https://arxiv.org/abs/2401.09135>`_, 2024 (dynamic local updates, DyLU).
  """
  fn = "dylu_sync_periods"
  _checks.check_positive_int(fn, "sync_period", sync_period)
  speeds = tuple(speeds)
  if not speeds or not all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                           and 0 < v < math.inf for v in speeds):
    raise ValueError(
      f"`{fn}(speeds=...)` must be one finite speed > 0 per worker, got {speeds!r}.")
  fastest = max(speeds)
  return tuple(max(1, math.floor(v / fastest * sync_period * (1.0 + 1e-9))) for v in speeds)


def diloco(
  inner: optax.GradientTransformation,
  outer: optax.GradientTransformation | None = None,
  *,
  sync_period: int = 500,
  dylu: bool = False,
) -> DiLoCo:
  r"""Asynchronous DiLoCo: each worker commits its pseudo-gradient to the server on its own.

  Worker :math:`i` reads the anchor :math:`\theta` (:math:`\hat\theta_i \leftarrow \theta`),
  starts from it (:math:`x_i \leftarrow \hat\theta_i`) and takes H local steps with
  ``inner``. After its H-th step, with :math:`x'_i` its params and :math:`\theta`,
  :math:`s` the server's anchor and outer state *as the previous commit left them* (other
  workers may have committed since worker :math:`i` read), it commits, one worker at a time in
  event order:

  .. math::

    \Delta_i = \hat\theta_i - x'_i, \qquad
    (u, s) \leftarrow \mathrm{outer.update}(\Delta_i, s, \theta), \qquad
    \theta \leftarrow \theta + u, \qquad x_i \leftarrow \hat\theta_i \leftarrow \theta

  and starts again. Each commit is one outer step of the server; its staleness is the number of
  outer steps (other workers' commits) between the worker's read of :math:`\hat\theta_i` and
  its commit. ``inner``'s state is the worker's own and is kept across commits, as
  :func:`optax_dist.diloco` keeps it; a restart starts the worker afresh from the current
  :math:`\theta`.

  With one worker this is :func:`optax_dist.diloco` (``axis_name=None``). With
  ``outer=optax.sgd(1.0)`` each commit adds the worker's own progress to the current anchor,
  :math:`\theta \leftarrow \theta + (x'_i - \hat\theta_i)`. A momentum outer optimizer
  (the default, Nesterov) takes one momentum step per commit, on stale pseudo-gradients;
  ``outer=``:func:`optax_dist.delayed_nesterov` (Liu et al. 2024) moves the momentum once every ``N``
  commits and takes plain gradient steps in between.

  Args:
    inner: every worker's local optimizer.
    outer: the server's optimizer of the anchor, fed :math:`\Delta_i` (a descent direction, as a
      gradient). Default: ``optax.sgd(0.7, momentum=0.9, nesterov=True)``, as
      :func:`optax_dist.diloco`; or :func:`optax_dist.delayed_nesterov`.
    sync_period: H, in local steps; a worker's first commit is on its H-th step. Build the
      schedule with ``cluster.schedule(..., communication_period=sync_period)``.
    dylu: dynamic local updates (Liu et al. 2024): worker :math:`w` commits every
      :math:`H_w` local steps instead, :math:`H_w = \max(1, \lfloor v_w / \max_u v_u
      \cdot H \rfloor)` with :math:`v_w` its speed in the schedule's cluster
      (:func:`dylu_sync_periods`, :attr:`Cluster.worker_speeds`). Build the schedule with
      ``cluster.schedule(..., communication_period=protocol.sync_periods(
      cluster.worker_speeds))``. ``False`` (default): every worker commits every H steps.

  Returns:
    A :class:`DiLoCo` protocol for :func:`emulate`.

  Raises:
    TypeError, ValueError: as :func:`optax_dist.diloco` for the same arguments; ``dylu`` not a
      bool.

  Examples:
    >>> import optax, optax_dist
    >>> from optax_dist import async_emulator as ae
    >>> outer = optax_dist.delayed_nesterov(0.7, momentum=0.9, buffer_size=4)
    >>> ae.diloco(optax.adam(1e-3), outer, sync_period=50).communication_period
    50

    With dynamic local updates on workers of speeds 1 : 1 : 0.5 : 0.25:

    >>> cluster = ae.Cluster(4, speeds=(1.0, 1.0, 0.5, 0.25))
    >>> protocol = ae.diloco(optax.sgd(0.1), outer, sync_period=30, dylu=True)
    >>> periods = protocol.sync_periods(cluster.worker_speeds)
    >>> periods
    (30, 30, 15, 7)
    >>> schedule = cluster.schedule(duration=60.0, communication_period=periods)
    >>> schedule.time[schedule.communicates].tolist()  # every round takes about 30
    [28.0, 30.0, 30.0, 30.0, 56.0, 60.0, 60.0, 60.0]

  References:
    Douillard et al., `DiLoCo: Distributed Low-Communication Training of Language Models
    <https://arxiv.org/abs/2311.08105>`_, 2023.
    Liu et al., `Asynchronous Local-SGD Training for Language Modeling
    <https://arxiv.org/abs/2401.09135>`_, 2024.
  """
  _diloco(inner, outer, sync_period=sync_period)  # the library's validation
  if not isinstance(dylu, bool):
    raise TypeError(f"`diloco(dylu=...)` must be a bool, got {dylu!r}.")
  return DiLoCo(inner, default_outer() if outer is None else outer, sync_period, dylu)
