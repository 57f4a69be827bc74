"""The settings of one training run of ``optax-dist train``/``compare``, and their defaults.

A setting is a field of :class:`Settings` and the flag of the same name
(:mod:`optax_dist.cli.arguments`): :func:`settings_of` reads every field from the command line,
the results record them all, and :func:`optax_dist.cli.checks.check_settings` checks them.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from optax_dist.cli.tasks import Task

COMMUNICATION_PERIOD = 10
"""The default communication period, in steps, of runs of at least that many steps."""

LR_WARMUP_FRACTION = 0.05
"""The default learning-rate warm-up of ``warmup_cosine``, as a fraction of the steps."""


@dataclasses.dataclass(frozen=True)
class Settings:
  """What determines a run's numbers; a run resumes only from a checkpoint of equal settings.

  Attributes:
    task: the name of the task (:data:`optax_dist.cli.tasks.TASKS`).
    algorithm: a name of :data:`optax_dist.cli.algorithms.ALGORITHMS`.
    devices: the number of workers, one device each (of every process together).
    replicas: R, the number of replicas the workers form, of ``devices / R`` workers each: every
      step reduces the gradients within each replica, and the algorithm runs across the
      replicas (:mod:`optax_dist.cli.algorithms`); 1: the algorithm runs across the workers.
    fsdp: K, train on the global view (one ``jax.jit`` of ``jax.vmap`` over the replicas) with
      each replica's params and optimizer state sharded over K of its devices (FSDP; the state
      over all ``devices / replicas`` where they divide it), its minibatch over all of them; K
      must divide ``devices / replicas``. ``None``: one ``jax.shard_map`` step, every worker
      holding whole params (:mod:`optax_dist.cli.runs`).
    steps: training steps per worker.
    batch_size: minibatch size per worker, in examples.
    learning_rate: the inner optimizer's (peak) learning rate.
    optimizer: the inner optimizer, ``"adam"``, ``"adamw"`` or ``"sgd"``
      (:func:`optax_dist.cli.algorithms.inner_optimizer`).
    b2: Adam's (and AdamW's) second-moment decay.
    weight_decay: AdamW's decoupled weight decay; with ``sgd``, ``add_decayed_weights``; must be
      0 with ``adam``.
    lr_schedule: ``"constant"``, or ``"warmup_cosine"``: linear warm-up over
      ``lr_warmup_steps``, then cosine decay to 10% of ``learning_rate`` at ``steps``.
    lr_warmup_steps: the schedule's warm-up steps; ``None``: :data:`LR_WARMUP_FRACTION` of
      ``steps`` with ``warmup_cosine``, 0 otherwise.
    clip_norm: the gradients' global norm is clipped to this before the inner optimizer;
      ``None``: no clipping.
    communication_period: steps between exchanges of ``elastic_average`` and ``agn``; ``None``:
      :data:`COMMUNICATION_PERIOD`, or ``steps`` if the run is shorter (see :meth:`resolved`).
    sync_period: H, steps between syncs of ``local_sgd``, ``diloco`` and ``streaming_diloco``;
      ``None``: as ``communication_period``'s default.
    outer_learning_rate: DiLoCo's outer Nesterov SGD learning rate (the paper's 0.7).
    outer_momentum: DiLoCo's outer Nesterov momentum (the paper's 0.9; 0: plain SGD).
    num_fragments: ``streaming_diloco``'s number of fragments F.
    warmup_steps: ``local_sgd``'s synchronous steps before the first model average.
    param_dtype: the params' dtype, ``"float32"`` or ``"bfloat16"`` (the EMA and the DiLoCo
      anchor are then kept in float32).
    moving_rate: EASGD's α; ``None``: ``0.9 / devices`` (see :func:`default_moving_rate`).
    decay: ``moving_average``'s EMA decay (with TF's ``num_updates`` cap).
    max_staleness: ``drop_stale_gradients``' largest accepted staleness, in steps.
    eval_every: steps between evaluations of the test metric.
    seed: seed of the train/test split, the init, the minibatches and the delays.
    comm_dtype: the format of the exchanged values, a name of
      :data:`optax_dist.cli.algorithms.COMM_DTYPES` passed to the algorithm (``None``: the
      params' own dtype, float32 unless ``param_dtype`` says otherwise).
    comm_block_size: the values per float32 scale of a block-quantized ``comm_dtype`` (the
      library's ``comm_block_size``; 256 is its default).
    error_feedback: ``diloco``'s error feedback of what quantization dropped (the library's
      ``error_feedback``; needs a block-quantized ``comm_dtype``).
    overlap: ``streaming_diloco``'s τ, steps between a fragment's send and its landing.
    eager: ``streaming_diloco``'s eager update on the landing step (needs ``overlap`` ≥ 1).
    mixing: ``streaming_diloco``'s α, the weight of a worker's own params when a fragment lands.
    exchange_device: ``streaming_diloco`` with ``overlap`` ≥ 1 and one replica per process: the
      exchanges across replicas run as their own computation on one extra emulated CPU device
      per process, beside the next steps, instead of inside the send step
      (:class:`optax_dist.cli.exchange_device.ExchangeDeviceRun`).
  """

  task: str = "digits"
  algorithm: str = "sync"
  devices: int = 8
  replicas: int = 1
  fsdp: int | None = None
  steps: int = 200
  batch_size: int = 16
  learning_rate: float = 1e-2
  optimizer: str = "adam"
  b2: float = 0.999
  weight_decay: float = 0.0
  lr_schedule: str = "constant"
  lr_warmup_steps: int | None = None
  clip_norm: float | None = None
  communication_period: int | None = None
  sync_period: int | None = None
  outer_learning_rate: float = 0.7
  outer_momentum: float = 0.9
  num_fragments: int = 4
  warmup_steps: int = 0
  param_dtype: str = "float32"
  moving_rate: float | None = None
  decay: float = 0.99
  max_staleness: int = 2
  eval_every: int = 10
  seed: int = 0
  comm_dtype: str | None = None
  comm_block_size: int = 256
  error_feedback: bool = False
  overlap: int = 0
  eager: bool = False
  mixing: float = 0.0
  exchange_device: bool = False

  def resolved(self) -> Settings:
    """These settings with the defaults that depend on others filled in (both periods, whatever
    the algorithm: each algorithm reads its own)."""
    period = self.communication_period
    if period is None:
      period = default_communication_period(self.steps)
    sync_period = self.sync_period
    if sync_period is None:
      sync_period = default_communication_period(self.steps)
    rate = default_moving_rate(self.devices) if self.moving_rate is None else self.moving_rate
    warmup = self.lr_warmup_steps
    if warmup is None:
      warmup = default_lr_warmup_steps(self.steps) if self.lr_schedule == "warmup_cosine" else 0
    return dataclasses.replace(self, communication_period=period, sync_period=sync_period,
                               moving_rate=rate, lr_warmup_steps=warmup)

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


DEFAULTS = {field.name: field.default for field in dataclasses.fields(Settings)}
"""The default of every setting (the command line's defaults, before the task's own)."""


def default_communication_period(steps: int) -> int:
  """:data:`COMMUNICATION_PERIOD`, or ``steps`` if fewer: every run communicates at least once."""
  return min(COMMUNICATION_PERIOD, steps)


def default_lr_warmup_steps(steps: int) -> int:
  """:data:`LR_WARMUP_FRACTION` of ``steps``, rounded."""
  return round(LR_WARMUP_FRACTION * steps)


def default_moving_rate(devices: int) -> float:
  """EASGD's α here: ``0.9 / devices``, the paper's β = Nα = 0.9 exchanged once per round.

  TF's default also divides by the period (``0.9 / τ / N``, :func:`optax_dist.elastic_average`'s
  default); with τ = 10 and 8 workers that coupling is so weak that the workers, each fitting its
  own 1/8 of a small training set, drift apart and the center stays near 0.92 test accuracy.
  """
  return 0.9 / devices


PERIODS = ("communication_period", "sync_period")
"""The settings whose task default adapts to ``--steps`` (:func:`settings_of`)."""


def settings_of(args: argparse.Namespace, task: Task) -> Settings:
  """The resolved settings of the run ``args`` asks for (``compare``'s: ``algorithm`` "sync").

  Each field of :class:`Settings` comes from the flag of the same name when given (not
  ``None``), else from ``task.defaults``, else from :data:`DEFAULTS`; a task's default period
  longer than ``steps`` becomes ``steps``. ``devices`` counts the workers of every process
  (``--processes`` x ``--devices``) and ``--comm-dtype float32`` is ``comm_dtype=None``, the
  params' own dtype.
  """
  given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)
           if getattr(args, f.name, None) is not None}
  given |= {"task": task.name, "devices": args.processes * args.devices,
            "comm_dtype": None if args.comm_dtype == "float32" else args.comm_dtype}
  values = DEFAULTS | dict(task.defaults) | given
  for key in PERIODS:
    if key not in given and values[key] is not None:
      values[key] = min(values[key], values["steps"])
  return Settings(**values).resolved()

