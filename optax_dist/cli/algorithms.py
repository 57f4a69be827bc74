"""The optimizer of each algorithm ``optax-dist`` trains with: Adam inside an optax_dist wrapper.

* ``sync``: ``tower(adam, "workers")``, the gradients all-reduced on every step;
* ``elastic_average``: ``elastic_average(adam, communication_period=τ, moving_rate=α)`` (EASGD);
* ``agn``: ``agn(adam, communication_period=τ)``;
* ``moving_average``: ``moving_average(tower(adam, "workers"), decay, use_num_updates=True)``,
  evaluated on the EMA;
* ``drop_stale_gradients``: ``drop_stale_gradients(tower(adam, "workers"), max_staleness)``, fed
  gradients computed at the params of a random number of steps ago (see
  :mod:`optax_dist.cli.trainer`).
"""

from __future__ import annotations

from typing import Any

from optax_dist.cli.config import Settings

AXIS = "workers"
"""The mesh axis of the workers, over which the transformations communicate."""

ALGORITHMS = ("sync", "elastic_average", "agn", "moving_average", "drop_stale_gradients")
"""Every algorithm ``optax-dist train`` runs."""

COMPARED = ("sync", "elastic_average", "agn", "moving_average")
"""The algorithms ``optax-dist compare`` runs, in this order."""

PERIODIC = ("elastic_average", "agn")
"""The algorithms that communicate every ``communication_period`` steps (the others: every step)."""


def communication_rounds(algorithm: str, steps: int, communication_period: int) -> int:
  """The number of the first ``steps`` steps on which ``algorithm`` communicates."""
  return steps // communication_period if algorithm in PERIODIC else steps


def make_optimizer(settings: Settings) -> Any:
  """The per-worker optax transformation of ``settings.algorithm`` over axis :data:`AXIS`.

  ``settings`` must be resolved (:meth:`Settings.resolved`).
  """
  import optax

  import optax_dist

  adam = optax.adam(settings.learning_rate)
  dtype = settings.comm_dtype
  algorithm = settings.algorithm
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
      optax_dist.tower(adam, AXIS, comm_dtype=dtype), settings.decay, use_num_updates=True)
  if algorithm == "drop_stale_gradients":
    return optax_dist.drop_stale_gradients(
      optax_dist.tower(adam, AXIS, comm_dtype=dtype), settings.max_staleness)
  raise ValueError(
    f"`make_optimizer(settings)`: unknown algorithm {algorithm!r}; choose one of"
    f" {', '.join(ALGORITHMS)}.")
