"""The algorithms ``optax-dist`` trains with: an :class:`Algorithm` record each, in one table.

Each record says how to build the algorithm's optax_dist transformation around the inner
optimizer (:func:`inner_optimizer`, the same recipe for every algorithm), when it communicates
(from the library's own schedule functions), which settings it reads, and what the trainer must
do for it. The rest of the command reads the table and never tests an algorithm's name.

* ``sync``: ``tower(inner, workers)``, the gradients all-reduced on every step;
* ``elastic_average``: ``elastic_average(inner, communication_period=τ, moving_rate=α)`` (EASGD);
* ``agn``: ``agn(inner, communication_period=τ)``;
* ``moving_average``: ``moving_average(tower(inner, workers), decay, use_num_updates=True)``,
  evaluated on the EMA;
* ``drop_stale_gradients``: ``drop_stale_gradients(tower(inner, workers), max_staleness)``, fed
  gradients computed at the params of a random number of steps ago (see
  :mod:`optax_dist.cli.runs`);
* ``local_sgd``: ``local_sgd(inner, sync_period=H, warmup_steps=W)``, model averaging every H
  steps;
* ``diloco``: ``diloco(inner, outer, sync_period=H, error_feedback=...)`` with the outer Nesterov
  SGD ``sgd(outer_learning_rate, momentum=outer_momentum, nesterov=True)``;
* ``streaming_diloco``: ``streaming_diloco(inner, outer, sync_period=H, num_fragments=F,
  fragments="balanced", mixing=α, overlap=τ, eager=..., error_feedback=...)``, the params'
  leaves assigned to the fragments by size.

With ``replicas`` R > 1 the workers form R replicas on a 2-D mesh (:data:`REPLICA`,
:data:`DATA`): the inner optimizer is ``tower(inner, DATA)``, a synchronous reduction within each
replica on every step, and the algorithm runs across the replicas (``axis_name=REPLICA``), each
device of a replica exchanging only its 1/K slice of the params (``slice_axis=DATA``). The
all-reducing algorithms (``sync``, ``moving_average``, ``drop_stale_gradients``) reduce over
every worker whatever R, hierarchically (``tower(..., hierarchical=True)``: reduce-scatter within
each replica, the slices all-reduced across replicas, all-gather within), so a replica's devices
send the gradients' bytes across once.

With ``fsdp`` K (the global view, :class:`optax_dist.cli.runs.GlobalRun`) the step is
``jax.vmap`` over the replicas and the compiler reduces the gradients within each replica (its
loss is the mean over its devices' minibatches): every algorithm is built around the bare inner
optimizer over :data:`REPLICA` alone, without ``tower`` inside or ``slice_axis``; ``sync`` is
``tower(inner, REPLICA)``. The algorithms fed stale gradients (``drop_stale_gradients``) are
refused there: the global view keeps no params history to compute them at.

With ``param_dtype="bfloat16"`` the EMA (``moving_average``) and the anchor (``diloco``,
``streaming_diloco``) are kept in float32.

The exchange: every algorithm sends in ``comm_dtype``, a float dtype of
:data:`FLOAT_COMM_DTYPES` or, for those whose :attr:`Algorithm.comm_dtypes` say so, a
block-quantized format of :data:`QUANTIZED_COMM_DTYPES` (codes with one float32 scale per
``comm_block_size`` values). The options of :data:`EXCHANGE_OPTIONS` reach the algorithms that
list them in :attr:`Algorithm.settings`; :func:`optax_dist.cli.checks.check_settings` refuses
the others.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import optax

import optax_dist
from optax_dist.cli.config import Settings

AXIS = "workers"
"""The mesh axis of the workers with one replica (``replicas=1``)."""

REPLICA, DATA = "replica", "data"
"""The mesh axes with ``replicas`` > 1: the replicas, and the workers within one replica."""

FSDP = "fsdp"
"""The mesh axis, inside each replica, over which ``fsdp`` shards the params (the global view)."""

Schedule = Callable[[int], bool]
"""``schedule(step) -> bool``: whether step ``step`` (from 1) makes the periodic exchange."""

FLOAT_COMM_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")
"""The ``comm_dtype`` values every algorithm takes: a cast before the collective (8-bit floats
are gathered and summed in float32); ``tower`` takes only these."""

QUANTIZED_COMM_DTYPES = ("int8", "float4_e2m1fn", "e3m0")
"""The block-quantized ``comm_dtype`` values: codes (8 or 4 bits) with one float32 scale per
``comm_block_size`` values, gathered and summed in float32."""

COMM_DTYPES = FLOAT_COMM_DTYPES + QUANTIZED_COMM_DTYPES
"""Every ``comm_dtype`` of the command (``--comm-dtype``)."""

EXCHANGE_OPTIONS = ("comm_block_size", "error_feedback", "overlap", "eager", "mixing",
                    "exchange_device")
"""The settings of the exchange that only the algorithms listing them in
:attr:`Algorithm.settings` take; away from their defaults, the others refuse them."""


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One algorithm of the command: how to build it, when it communicates, what it reads.

  Attributes:
    name: the name on the command line (``--algorithm``) and in the results.
    summary: the transformation, in words (for the help).
    build: ``build(settings, inner, axis) -> tx``: the per-worker transformation around
      ``inner`` over the mesh axis (or axes) ``axis``.
    schedule: ``schedule(settings) -> Schedule``: the library's schedule of the periodic
      exchange, which the trainer passes to ``update`` as the static ``communicate`` hint;
      ``None`` for the algorithms that communicate on every step.
    warmup: ``warmup(settings) -> Schedule``: steps that all-reduce before the schedule starts
      (``local_sgd``'s synchronous warm-up), counted as communication rounds; or ``None``.
    period_name: the setting holding the steps between exchanges (``"communication_period"``
      or ``"sync_period"``, the library's argument name), or ``None``: every step.
    settings: the settings the algorithm reads beyond the recipe, recorded in its results; of
      :data:`EXCHANGE_OPTIONS`, those it takes.
    comm_dtypes: the ``comm_dtype`` values it takes (:data:`COMM_DTYPES`, or the float ones).
    compared: whether ``optax-dist compare`` runs it.
    across_replicas: whether it runs across the replicas of ``replicas`` > 1 (else it reduces
      over every worker whatever the replicas); its ``build`` then takes ``slice_axis``, so each
      device of a replica exchanges only its 1/K slice of the params.
    stale_gradients: whether the trainer feeds it gradients computed at older params.
    evaluated: what :func:`optax_dist.eval_params` gives back for it, in words.
    synchronize: ``synchronize(settings, axis, slice_axis) -> fn``: the sync of its
      ``update`` apart from the inner step, ``fn(anchor, outer_state, new_params, residual) ->
      (anchor, outer_state, residual)`` (:func:`optax_dist.diloco_synchronize`), which the
      trainer runs after the step compiled with ``communicate=False`` instead of compiling a
      second step; or ``None``.
  """

  name: str
  summary: str
  build: Callable[[Settings, Any, Any], Any]
  schedule: Callable[[Settings], Schedule] | None = None
  warmup: Callable[[Settings], Schedule] | None = None
  period_name: str | None = None
  settings: tuple[str, ...] = ()
  comm_dtypes: tuple[str, ...] = FLOAT_COMM_DTYPES
  compared: bool = False
  across_replicas: bool = False
  stale_gradients: bool = False
  evaluated: str = "the params"
  synchronize: Callable[[Settings, Any, Any], Callable] | None = None

  def period(self, settings: Settings) -> int:
    """Steps between the exchanges of this algorithm under ``settings`` (1: every step)."""
    return 1 if self.period_name is None else getattr(settings, self.period_name)

  def communicates(self, settings: Settings, step: int) -> bool | None:
    """The static hint of step ``step`` (from 1): whether it makes the periodic exchange
    (``streaming_diloco``: some fragment syncs; ``local_sgd``: the model average); ``None``
    for the algorithms that communicate on every step."""
    return None if self.schedule is None else bool(self.schedule(settings)(step))

  def communication_rounds(self, settings: Settings, steps: int) -> int:
    """The number of the first ``steps`` steps on which this algorithm communicates.

    ``streaming_diloco``: the steps on which some fragment syncs (each sends about 1/F of the
    params); ``local_sgd``: every warm-up step, then one per ``sync_period``.
    """
    if self.schedule is None:
      return steps
    schedule = self.schedule(settings)
    warmup = self.warmup(settings) if self.warmup is not None else lambda step: False
    return sum(bool(schedule(t)) or bool(warmup(t)) for t in range(1, steps + 1))


def inner_optimizer(settings: Settings) -> optax.GradientTransformation:
  """The recipe every algorithm trains with (the DiLoCo family's inner optimizer).

  ``optax.chain(clip_by_global_norm(clip_norm), optimizer(learning_rate_schedule(settings)))``
  with ``optimizer`` one of ``adam`` (``b2``), ``adamw`` (``b2``, ``weight_decay``) or ``sgd``
  (``weight_decay`` as ``add_decayed_weights`` before it); no clipping if ``clip_norm`` is
  ``None``. The schedule reads the optimizer's own step count: under the DiLoCo family, the
  inner step.
  """
  s = settings
  lr = learning_rate_schedule(s)
  if s.optimizer == "adam":
    tx = optax.adam(lr, b2=s.b2)
  elif s.optimizer == "adamw":
    tx = optax.adamw(lr, b2=s.b2, weight_decay=s.weight_decay)
  elif s.optimizer == "sgd":
    tx = optax.sgd(lr)
    if s.weight_decay:
      tx = optax.chain(optax.add_decayed_weights(s.weight_decay), tx)
  else:
    raise ValueError(f"`inner_optimizer(settings.optimizer=...)` must be one of"
                     f" {', '.join(OPTIMIZERS)}, got {s.optimizer!r}.")
  if s.clip_norm is None:
    return tx
  return optax.chain(optax.clip_by_global_norm(s.clip_norm), tx)


OPTIMIZERS = ("adam", "adamw", "sgd")
"""The inner optimizers of :func:`inner_optimizer`."""

LR_SCHEDULES = ("constant", "warmup_cosine")
"""The learning-rate schedules of :func:`learning_rate_schedule`."""

LR_END_FRACTION = 0.1
"""``warmup_cosine`` decays to this fraction of the peak learning rate at the last step."""


def learning_rate_schedule(settings: Settings) -> Any:
  """``settings.learning_rate``, constant, or ``warmup_cosine``: linear warm-up from 0 over
  ``lr_warmup_steps``, then cosine decay to :data:`LR_END_FRACTION` of the peak at ``steps``
  (``optax.warmup_cosine_decay_schedule``)."""
  s = settings
  if s.lr_schedule == "constant":
    return s.learning_rate
  if s.lr_schedule == "warmup_cosine":
    return optax.warmup_cosine_decay_schedule(
      0.0, s.learning_rate, warmup_steps=s.lr_warmup_steps, decay_steps=s.steps,
      end_value=LR_END_FRACTION * s.learning_rate)
  raise ValueError(f"`learning_rate_schedule(settings.lr_schedule=...)` must be one of"
                   f" {', '.join(LR_SCHEDULES)}, got {s.lr_schedule!r}.")


def _global_dtype(settings: Settings) -> Any:
  """float32 for the EMA and the anchor of bfloat16 params (``None``: the params' own)."""
  return "float32" if settings.param_dtype != "float32" else None


def outer_optimizer(settings: Settings,
                    buffer_size: int | None = None) -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: Nesterov SGD (plain SGD with ``outer_momentum`` 0); with
  ``buffer_size`` N, delayed Nesterov (:func:`optax_dist.delayed_nesterov` of
  ``outer_learning_rate`` and ``outer_momentum``: the momentum moves once per N outer steps,
  plain steps of the pseudo-gradient over N in between; Liu et al. 2024), the outer optimizer
  of decoupled rounds' ``staleness_rule="delayed_nesterov"``."""
  s = settings
  if buffer_size is not None:
    return optax_dist.delayed_nesterov(s.outer_learning_rate, s.outer_momentum,
                                       buffer_size=buffer_size)
  return optax.sgd(s.outer_learning_rate, momentum=s.outer_momentum or None,
                   nesterov=bool(s.outer_momentum))


def _tower(s: Settings, inner: Any, axis: Any) -> Any:
  """``tower`` over ``axis``; over the mesh axes ``(REPLICA, DATA)``, hierarchical: the gradients
  reduce-scattered within each replica, all-reduced across replicas, all-gathered within.

  ``tower`` takes float formats only: with a block-quantized ``comm_dtype`` (which only the
  algorithms across replicas take), the ``tower`` within each replica reduces in the gradients'
  own dtype and the format applies to the exchange across replicas."""
  comm = s.comm_dtype if (s.comm_dtype or "float32") in FLOAT_COMM_DTYPES else None
  return optax_dist.tower(inner, axis, comm_dtype=comm, hierarchical=isinstance(axis, tuple))


def exchange_options(s: Settings) -> dict[str, Any]:
  """The library's arguments of an exchange that may be block-quantized (``comm_block_size``
  only with a block-quantized ``comm_dtype``: the library refuses it with the others)."""
  block = s.comm_dtype in QUANTIZED_COMM_DTYPES
  return {"comm_dtype": s.comm_dtype, "comm_block_size": s.comm_block_size if block else None}


def _streaming_diloco(s: Settings, inner: Any, axis: Any, slice_axis=None) -> Any:
  return optax_dist.streaming_diloco(
    inner, outer_optimizer(s), sync_period=s.sync_period, num_fragments=s.num_fragments,
    fragments="balanced", mixing=s.mixing, overlap=s.overlap, eager=s.eager, axis_name=axis,
    error_feedback=s.error_feedback, anchor_dtype=_global_dtype(s), slice_axis=slice_axis,
    **exchange_options(s))


_DILOCO = ("sync_period", "outer_learning_rate", "outer_momentum")
_QUANTIZED = ("comm_dtype", "comm_block_size")

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
  Algorithm(
    "sync", "tower: the gradients all-reduced every step",
    build=lambda s, inner, axis: _tower(s, inner, axis), settings=("comm_dtype",),
    compared=True),
  Algorithm(
    "elastic_average", "EASGD: each worker pulled to a center every communication period",
    build=lambda s, inner, axis, slice_axis=None: optax_dist.elastic_average(
      inner, communication_period=s.communication_period, moving_rate=s.moving_rate,
      axis_name=axis, slice_axis=slice_axis, **exchange_options(s)),
    schedule=lambda s: lambda step: optax_dist.elastic_average_communicates(
      step, communication_period=s.communication_period),
    period_name="communication_period",
    settings=("communication_period", "moving_rate", *_QUANTIZED), comm_dtypes=COMM_DTYPES,
    compared=True, across_replicas=True, evaluated="the center"),
  Algorithm(
    "agn", "AGN: the workers' accumulated updates averaged every communication period",
    build=lambda s, inner, axis, slice_axis=None: optax_dist.agn(
      inner, communication_period=s.communication_period, axis_name=axis, slice_axis=slice_axis,
      **exchange_options(s)),
    schedule=lambda s: lambda step: optax_dist.agn_communicates(
      step, communication_period=s.communication_period),
    period_name="communication_period", settings=("communication_period", *_QUANTIZED),
    comm_dtypes=COMM_DTYPES, compared=True, across_replicas=True),
  Algorithm(
    "moving_average", "tower, evaluated on an exponential moving average of the params",
    build=lambda s, inner, axis: optax_dist.moving_average(
      _tower(s, inner, axis), s.decay, use_num_updates=True,
      ema_dtype=_global_dtype(s)),
    settings=("decay", "comm_dtype"), compared=True, evaluated="the EMA"),
  Algorithm(
    "drop_stale_gradients", "tower fed stale gradients, those staler than max staleness dropped",
    build=lambda s, inner, axis: optax_dist.drop_stale_gradients(
      _tower(s, inner, axis), s.max_staleness),
    settings=("max_staleness", "comm_dtype"), stale_gradients=True),
  Algorithm(
    "local_sgd", "local SGD: the workers' params averaged every sync period",
    build=lambda s, inner, axis, slice_axis=None: optax_dist.local_sgd(
      inner, sync_period=s.sync_period, axis_name=axis, warmup_steps=s.warmup_steps,
      slice_axis=slice_axis, **exchange_options(s)),
    schedule=lambda s: lambda step: optax_dist.local_sgd_syncs(
      step, sync_period=s.sync_period, warmup_steps=s.warmup_steps),
    warmup=lambda s: lambda step: optax_dist.local_sgd_warming_up(
      step, warmup_steps=s.warmup_steps),
    period_name="sync_period", settings=("sync_period", "warmup_steps", *_QUANTIZED),
    comm_dtypes=COMM_DTYPES, compared=True, across_replicas=True),
  Algorithm(
    "diloco", "DiLoCo: an outer Nesterov step on the workers' mean change every sync period",
    build=lambda s, inner, axis, slice_axis=None: optax_dist.diloco(
      inner, outer_optimizer(s), sync_period=s.sync_period, axis_name=axis,
      error_feedback=s.error_feedback, anchor_dtype=_global_dtype(s), slice_axis=slice_axis,
      **exchange_options(s)),
    schedule=lambda s: lambda step: optax_dist.diloco_syncs(step, sync_period=s.sync_period),
    period_name="sync_period", settings=(*_DILOCO, *_QUANTIZED, "error_feedback"),
    comm_dtypes=COMM_DTYPES, compared=True, across_replicas=True,
    evaluated="the anchor", synchronize=lambda s, axis, slice_axis: functools.partial(
      optax_dist.diloco_synchronize, outer_optimizer(s),
      optax_dist.Exchange(axis, slice_axis=slice_axis, call="diloco", **exchange_options(s)))),
  Algorithm(
    "streaming_diloco", "streaming DiLoCo: DiLoCo with the params synced in fragments, in turn",
    build=_streaming_diloco,
    schedule=lambda s: lambda step: optax_dist.streaming_diloco_syncs(
      step, sync_period=s.sync_period, num_fragments=s.num_fragments),
    period_name="sync_period",
    settings=(*_DILOCO, "num_fragments", *_QUANTIZED, "error_feedback", "overlap", "eager",
              "mixing", "exchange_device"),
    comm_dtypes=COMM_DTYPES, across_replicas=True,
    evaluated="the anchor"),
)}
"""Every algorithm ``optax-dist train`` runs, by name; ``compare`` runs those marked
``compared``, in this order."""

COMPARED = tuple(name for name, a in ALGORITHMS.items() if a.compared)
"""The algorithms ``optax-dist compare`` runs, in order."""


def axes(settings: Settings) -> tuple[str, ...]:
  """The mesh axes: ``(AXIS,)``, or ``(REPLICA, DATA)`` with ``replicas`` > 1."""
  return (AXIS,) if settings.replicas == 1 else (REPLICA, DATA)


def make_optimizer(settings: Settings) -> Any:
  """The per-worker optax transformation of ``settings.algorithm`` (run under ``shard_map``
  over the mesh axes :func:`axes`), or with ``settings.fsdp``, one replica's (run under
  ``jax.vmap`` over :data:`REPLICA`).

  ``settings`` must be resolved (:meth:`Settings.resolved`) and pass
  :func:`optax_dist.cli.checks.check_settings`, which calls this function to have the library
  check its arguments. With ``settings.exchange_device``, ``streaming_diloco`` is built with no
  axis across the replicas (``axis_name=None``, the ``tower`` within each replica kept): its
  send step puts the replica's own pseudo-gradient in flight and the trainer exchanges it
  (:class:`optax_dist.cli.exchange_device.ExchangeDeviceRun`).

  Raises:
    ValueError: an unknown algorithm; the library's refusals of the settings.
  """
  algorithm = ALGORITHMS.get(settings.algorithm)
  if algorithm is None:
    raise ValueError(
      f"`make_optimizer(settings.algorithm=...)` must be one of {', '.join(ALGORITHMS)}, got"
      f" {settings.algorithm!r}.")
  inner = inner_optimizer(settings)
  axis, slice_axis = exchange_axes(settings)
  if slice_axis is None and not settings.exchange_device:
    return algorithm.build(settings, inner, axis)
  # Each replica's params are one worker's: a tower within the replica.
  return algorithm.build(settings, _tower(settings, inner, DATA), axis, slice_axis=slice_axis)


def exchange_axes(settings: Settings) -> tuple[Any, Any]:
  """``(axis, slice_axis)`` of :func:`make_optimizer`'s transformation: the mesh axis (or axes)
  of its workers, or ``None`` with ``exchange_device`` (each replica's own pseudo-gradient goes
  in flight: the trainer exchanges it across the replicas on its exchange device and puts the
  mean back before the landing step); and with replicas, for the algorithms across them,
  :data:`DATA` (a replica's devices hold identical params after the tower: each exchanges its
  1/K slice), else ``None``."""
  if settings.fsdp is not None:
    return REPLICA, None
  if settings.replicas == 1:
    return AXIS, None
  if settings.exchange_device:
    return None, None
  if not ALGORITHMS[settings.algorithm].across_replicas:
    return (REPLICA, DATA), None
  return REPLICA, DATA


def takers(name: str) -> tuple[str, ...]:
  """The algorithms that read the setting ``name`` (list it in :attr:`Algorithm.settings`)."""
  return tuple(a.name for a in ALGORITHMS.values() if name in a.settings)


def quantizing() -> tuple[str, ...]:
  """The algorithms that take the block-quantized formats (:data:`QUANTIZED_COMM_DTYPES`)."""
  return tuple(a.name for a in ALGORITHMS.values() if set(QUANTIZED_COMM_DTYPES) <= set(
    a.comm_dtypes))


def flag(name: str) -> str:
  """The command-line flag of the setting ``name``, e.g. ``--comm-block-size``."""
  return "--" + name.replace("_", "-")
