"""The optimizer of each algorithm ``optax-dist`` trains with: Adam inside an optax_dist wrapper.

* ``sync``: ``tower(adam, "workers")``, the gradients all-reduced on every step;
* ``elastic_average``: ``elastic_average(adam, communication_period=τ, moving_rate=α)`` (EASGD);
* ``agn``: ``agn(adam, communication_period=τ)``;
* ``moving_average``: ``moving_average(tower(adam, "workers"), decay, use_num_updates=True)``,
  evaluated on the EMA;
* ``drop_stale_gradients``: ``drop_stale_gradients(tower(adam, "workers"), max_staleness)``, fed
  gradients computed at the params of a random number of steps ago (see
  :mod:`optax_dist.cli.trainer`);
* ``local_sgd``: ``local_sgd(adam, sync_period=H, warmup_steps=W)``, model averaging every H
  steps;
* ``diloco``: ``diloco(adam, outer, sync_period=H)`` with the outer Nesterov SGD
  ``sgd(outer_learning_rate, momentum=outer_momentum, nesterov=True)``;
* ``streaming_diloco``: ``streaming_diloco(adam, outer, sync_period=H, num_fragments=F,
  fragments=...)``, the params' leaves assigned to the fragments by size
  (``fragments="balanced"``).

With ``param_dtype="bfloat16"`` the EMA (``moving_average``) and the anchor (``diloco``,
``streaming_diloco``) are kept in float32.
"""

from __future__ import annotations

from typing import Any

from optax_dist.cli.config import Settings

AXIS = "workers"
"""The mesh axis of the workers, over which the transformations communicate."""

ALGORITHMS = ("sync", "elastic_average", "agn", "moving_average", "drop_stale_gradients",
              "local_sgd", "diloco", "streaming_diloco")
"""Every algorithm ``optax-dist train`` runs."""

COMPARED = ("sync", "elastic_average", "agn", "moving_average", "local_sgd", "diloco")
"""The algorithms ``optax-dist compare`` runs, in this order."""

PERIODIC = ("elastic_average", "agn")
"""The algorithms that communicate every ``communication_period`` steps."""

SYNCED = ("local_sgd", "diloco", "streaming_diloco")
"""The algorithms that sync every ``sync_period`` steps (the DiLoCo family)."""


def communicates(settings: Settings, step: int) -> bool | None:
  """Whether step ``step`` (from 1) of ``settings.algorithm`` makes its periodic exchange.

  The schedule of the algorithm's transformation, from the library: the trainer passes it to
  ``update`` as the static ``communicate`` hint, and compiles one step of each kind.
  ``streaming_diloco``: some fragment syncs; ``local_sgd``: the model average (its warm-up's
  all-reduce follows the counter). ``None`` for the algorithms that communicate on every step.
  """
  import optax_dist

  s = settings
  if s.algorithm == "elastic_average":
    return optax_dist.elastic_average_communicates(
      step, communication_period=s.communication_period)
  if s.algorithm == "agn":
    return optax_dist.agn_communicates(step, communication_period=s.communication_period)
  if s.algorithm == "local_sgd":
    return optax_dist.local_sgd_syncs(step, sync_period=s.sync_period,
                                      warmup_steps=s.warmup_steps)
  if s.algorithm == "diloco":
    return optax_dist.diloco_syncs(step, sync_period=s.sync_period)
  if s.algorithm == "streaming_diloco":
    return optax_dist.streaming_diloco_syncs(step, sync_period=s.sync_period,
                                             num_fragments=s.num_fragments)
  return None


def communication_rounds(settings: Settings, steps: int) -> int:
  """The number of the first ``steps`` steps on which ``settings.algorithm`` communicates.

  ``streaming_diloco``: the steps on which some fragment syncs (each sends about 1/F of the
  params); ``local_sgd``: every warm-up step, then one per ``sync_period``.
  """
  if communicates(settings, 1) is None:
    return steps
  warmup = min(steps, settings.warmup_steps) if settings.algorithm == "local_sgd" else 0
  return warmup + sum(bool(communicates(settings, t)) for t in range(1, steps + 1))


def make_optimizer(settings: Settings, params: Any = None) -> Any:
  """The per-worker optax transformation of ``settings.algorithm`` over axis :data:`AXIS`.

  ``settings`` must be resolved (:meth:`Settings.resolved`); ``params`` (one worker's, arrays or
  shapes) is needed by ``streaming_diloco`` only.
  """
  import optax

  import optax_dist

  adam = optax.adam(settings.learning_rate)
  dtype = settings.comm_dtype
  algorithm = settings.algorithm
  if algorithm in SYNCED:
    return _diloco_family(settings, adam, params)
  if algorithm == "sync":
    return optax_dist.tower(adam, AXIS, comm_dtype=dtype)
  if algorithm == "elastic_average":
    return optax_dist.elastic_average(
      adam, communication_period=settings.communication_period,
      moving_rate=settings.moving_rate, axis_name=AXIS, comm_dtype=dtype)
  if algorithm == "agn":
    return optax_dist.agn(
      adam, communication_period=settings.communication_period, axis_name=AXIS, comm_dtype=dtype)
  if algorithm == "moving_average":
    return optax_dist.moving_average(
      optax_dist.tower(adam, AXIS, comm_dtype=dtype), settings.decay, use_num_updates=True,
      ema_dtype=_global_dtype(settings))
  if algorithm == "drop_stale_gradients":
    return optax_dist.drop_stale_gradients(
      optax_dist.tower(adam, AXIS, comm_dtype=dtype), settings.max_staleness)
  raise ValueError(
    f"`make_optimizer(settings)`: unknown algorithm {algorithm!r}; choose one of"
    f" {', '.join(ALGORITHMS)}.")


def _global_dtype(settings: Settings) -> Any:
  """float32 for the EMA and the anchor of bfloat16 params (``None``: the params' own)."""
  return "float32" if settings.param_dtype != "float32" else None


def _diloco_family(settings: Settings, inner: Any, params: Any) -> Any:
  """The transformation of ``local_sgd``, ``diloco`` or ``streaming_diloco``."""
  import optax

  import optax_dist

  s = settings
  if s.algorithm == "local_sgd":
    return optax_dist.local_sgd(inner, sync_period=s.sync_period, axis_name=AXIS,
                                warmup_steps=s.warmup_steps, comm_dtype=s.comm_dtype)
  outer = optax.sgd(s.outer_learning_rate, momentum=s.outer_momentum or None,
                    nesterov=bool(s.outer_momentum))
  common = {"sync_period": s.sync_period, "axis_name": AXIS, "comm_dtype": s.comm_dtype,
            "anchor_dtype": _global_dtype(s)}
  if s.algorithm == "diloco":
    return optax_dist.diloco(inner, outer, **common)
  if params is None:
    raise ValueError("`make_optimizer(settings, params)`: streaming_diloco needs the params, to"
                     " assign their leaves to fragments.")
  return optax_dist.streaming_diloco(
    inner, outer, num_fragments=s.num_fragments,
    fragments="balanced", **common)
