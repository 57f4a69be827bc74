"""A command's task as the replicas of a fault-tolerant run train it: the settings of the
equivalent ``train --replicas R --devices R*D`` run (:func:`settings`), their round protocol
(:func:`protocol`), one replica's share of the task (:func:`task_engine`), the params it
evaluates (:func:`evaluated`), and the evaluation of a finished run's checkpoints
(:func:`checkpoint_metrics`).

Worker ``w`` of the ``R*D`` owns the ``w``-th shard of the training set, and replica ``i`` holds
workers ``i*D`` to ``i*D + D - 1``: its batch at step ``t`` is a stateless function of
``(seed, i, t)`` (:func:`optax_dist.cli.pipeline.minibatch`), so a replica restarted under its
id continues its slot's stream from the healed step.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from optax_dist.cli import algorithms, checks, ft_flags, pipeline
from optax_dist.cli.config import Settings, settings_of
from optax_dist.cli.errors import CommandError
from optax_dist.cli.tasks import TASKS, Data, Task
from optax_dist.fault_tolerance import RoundProtocol, halves
from optax_dist.fault_tolerance import checkpoints as ft_checkpoints
from optax_dist.fault_tolerance.decision import settings_fingerprint
from optax_dist.fault_tolerance.rundir import RunDir


def settings(args: argparse.Namespace, task: Task, load: Callable[[], Data]) -> Settings:
  """The settings of the equivalent ``train --replicas R --devices R*P*D`` run (P: a
  replica's ``--processes``), checked as that command checks them
  (:func:`optax_dist.cli.checks.check_command`; ``load()`` gives the data when the check needs
  it)."""
  s = settings_of(args, task)
  s = dataclasses.replace(s, devices=args.replicas * args.processes * args.devices).resolved()
  checks.check_command(args, s, (args.algorithm,),
                       train_examples=lambda: checks.num_examples(load().train))
  return s


def protocol(s: Settings, staleness_rule: str | None = None) -> RoundProtocol:
  """The :class:`~optax_dist.fault_tolerance.RoundProtocol` of ``s``: the command's inner
  optimizer (:func:`optax_dist.cli.algorithms.inner_optimizer`), outer optimizer, exchange,
  mixing and overlap; with low-precision params (``param_dtype`` not float32), the anchor of
  ``diloco`` and ``streaming_diloco`` in float32, as ``train`` keeps it (``local_sgd`` keeps
  none). The outer optimizer is Nesterov SGD, or with ``staleness_rule`` ``"delayed_nesterov"``
  (``--decoupled --staleness-rule``; ``None``: not decoupled) delayed Nesterov of buffer size
  N = R (``s.replicas``), the asynchronous emulator's (:func:`algorithms.outer_optimizer
  <optax_dist.cli.algorithms.outer_optimizer>`): every replica process of a run builds it from
  the same flags."""
  row = halves.row(s.algorithm)  # the settings the algorithm's row takes
  delayed = s.replicas if staleness_rule == "delayed_nesterov" else None
  outer = algorithms.outer_optimizer(s, delayed) if row.takes_outer else None
  anchor_dtype = "float32" if row.takes_outer and s.param_dtype != "float32" else None
  return RoundProtocol(
    s.algorithm, algorithms.inner_optimizer(s), outer, sync_period=s.sync_period,
    error_feedback=s.error_feedback,
    num_fragments=s.num_fragments if row.takes_fragments else None, mixing=s.mixing,
    overlap=s.overlap, anchor_dtype=anchor_dtype, **algorithms.exchange_options(s))


def check_protocol(task: Task, data: Data, s: Settings) -> None:
  """Raises :class:`CommandError` naming the flag if :func:`protocol` refuses ``s`` or the
  task's params (e.g. more fragments than the params' leaves fill), on abstract values: before
  any replica starts, whose error would otherwise be restarted."""
  import jax

  try:
    jax.eval_shape(protocol(s).init, _param_shapes(task, data, s))
  except ValueError as e:
    raise CommandError(f"argument {checks.library_flag(e) or '--algorithm'}: {e}") from None


def _param_shapes(task: Task, data: Data, s: Settings) -> Any:
  """The task's initial params as shapes and dtypes (``s.param_dtype``), built abstractly."""
  import jax

  model = task.model()
  example = {key: jax.ShapeDtypeStruct((1,) + v.shape[1:], v.dtype)
             for key, v in data.train.items()}
  params = jax.eval_shape(
    lambda batch: task.init_params(model, jax.random.key(s.seed), batch), example)
  return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, s.param_dtype), params)


def fingerprint(task: Task, data: Data, s: Settings, replicas: int) -> int:
  """The settings fingerprint a replica of ``s`` (one of ``replicas``) computes
  (:func:`~optax_dist.fault_tolerance.decision.settings_fingerprint` of its protocol, params,
  seed and tokens per step, :func:`task_engine`'s), here from the params' shapes and dtypes
  alone: what ``--resume`` checks a run's checkpoints against before any replica starts."""
  import jax

  params = jax.tree.map(lambda p: np.broadcast_to(np.zeros((), p.dtype), p.shape),  # views
                        _param_shapes(task, data, s))
  return settings_fingerprint(protocol(s), params, seed=s.seed,
                              tokens_per_step=tokens_per_step(data, s, replicas))


def tokens_per_step(data: Data, s: Settings, replicas: int) -> int:
  """The tokens of a replica's inner step (:func:`task_engine`'s): its ``s.devices // replicas``
  workers' batches of ``s.batch_size`` examples of :func:`tokens_per_example` each."""
  return s.devices // replicas * s.batch_size * tokens_per_example(data)


def task_engine(task: Task, data: Data, s: Settings, replicas: int) -> tuple[Any, ...]:
  """``(params, loss_and_grad, batch_fn, tokens_per_step, evaluate)`` of ``task`` for one replica
  of ``replicas`` (``s.devices`` workers in all, ``K = s.devices // replicas`` per replica:
  the devices of the program's ``jax.distributed`` processes, a replica group's, in
  ``jax.devices()`` order).

  * ``params``: :func:`optax_dist.cli.runs.initial_params` (``train``'s) in ``s.param_dtype``,
    replicated over the replica's K devices; with ``s.fsdp`` F, each sharded over F of them as
    ``train --fsdp F`` shards one replica's (:func:`optax_dist.cli.meshes.fsdp_spec`, on a
    ``(K / F, F)`` mesh over ``(DATA, FSDP)``);
  * ``loss_and_grad(params, batch)``: ``(loss, grads)``, ``task``'s mean loss on the replica's
    batch of ``K * batch_size`` examples, split over its K devices, and its gradient: the mean
    of its workers' gradients (the compiler reduces them within the replica), placed as
    ``params`` are however the params it is given are placed (a heal's arrive on one device);
  * ``batch_fn(seed, slot, step)``: the minibatches of workers ``slot * K`` to ``slot * K + K -
    1`` for step ``step + 1`` (:func:`optax_dist.cli.pipeline.minibatch`), stateless; each
    process of a group draws the whole batch and JAX keeps the rows of its own devices;
  * ``tokens_per_step``: the targets in the replica's batch of a step, ``K * batch_size`` times
    :func:`tokens_per_example` (a round's merge weight is its inner steps times this);
  * ``evaluate(params) -> float``: ``task``'s test metric, on this process's first device
    (the params read back to the host: a group's every process computes it alone).
  """
  import jax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from optax_dist.cli.algorithms import DATA, FSDP
  from optax_dist.cli.meshes import fsdp_spec
  from optax_dist.cli.runs import initial_params

  k, f = s.devices // replicas, s.fsdp or 1
  mesh = Mesh(np.array(jax.devices()[:k]).reshape(k // f, f), (DATA, FSDP))
  shards = pipeline.shard_examples(data.train, s.devices)
  n_local = checks.num_examples(data.train) // s.devices
  example = tuple((key, (1,) + v.shape[1:], str(v.dtype)) for key, v in data.train.items())
  model = task.model()
  params = jax.tree.map(lambda p: p.astype(s.param_dtype), initial_params(task, s.seed, example))
  placed = jax.tree.map(lambda p: NamedSharding(mesh, fsdp_spec(p.shape, f) if s.fsdp else P()),
                        params)
  params = jax.device_put(params, placed)
  examples = NamedSharding(mesh, P((DATA, FSDP)))

  def batch_fn(seed: int, slot: int, step: int) -> Any:
    workers = np.arange(slot * k, slot * k + k)[:, None]
    idx = pipeline.minibatch(seed, s.devices, n_local, s.batch_size, step)[workers[:, 0]]
    batch = {key: v[workers, idx].reshape((-1,) + v.shape[2:]) for key, v in shards.items()}
    return jax.device_put(batch, examples)

  value_and_grad = jax.value_and_grad(task.loss_fn(model))

  def loss_and_grad(params: Any, batch: Any) -> tuple[Any, Any]:
    loss, grads = value_and_grad(params, batch)
    return loss, jax.lax.with_sharding_constraint(grads, placed)

  metric = jax.jit(task.metric_fn(model))
  return (params, loss_and_grad, batch_fn, k * s.batch_size * tokens_per_example(data),
          lambda p: float(metric(jax.tree.map(np.asarray, p), data.test)))


def tokens_per_example(data: Data) -> int:
  """The targets an example of ``data`` holds: its label (1) for a classification task, one per
  position (the next byte) for the ``lm`` task's windows."""
  return int(np.prod(np.shape(data.train["y"])[1:], dtype=np.int64))


def evaluated(state: Any) -> Any:
  """The params to evaluate: ``local_sgd``'s last committed average, else
  :func:`optax_dist.eval_params` (the anchor)."""
  import optax_dist

  if state.average is not None:
    return state.average
  return optax_dist.eval_params(state.opt_state, state.params)


def checkpoint_metrics(args: argparse.Namespace) -> list[dict[str, Any]]:
  """The task's held-out metric of each checkpoint the run ``args`` describe wrote (under
  ``OUT/replicas/checkpoints``, with ``--checkpoint-every``): one dict per checkpoint, oldest
  first, with its ``step``, ``rounds``, ``time`` and ``test_<metric>`` (of the params a replica
  restored from it evaluates: the anchor; ``local_sgd``: the last average). Run in this process,
  after the run (e.g. for a validation curve); JAX must have a device.

  Raises:
    CommandError: as the command's checks; the ``ft`` extra missing.
    ValueError: a checkpoint written with other settings, or damaged.
  """
  args.fault_tolerant = True
  ft_flags.resolve(args)
  task = TASKS[args.task]
  data = task.load(args.seed)
  s = settings(args, task, lambda: data)
  params, _, _, tokens, evaluate = task_engine(task, data, s, args.replicas)
  rounds = protocol(s)
  fingerprint = settings_fingerprint(rounds, params, seed=s.seed, tokens_per_step=tokens)
  run, start = RunDir(args.out), rounds.init(params)
  metrics = []
  for meta in run.checkpoints():
    state, _ = ft_checkpoints.restore(run.checkpoint_dir, rounds, start, params, fingerprint, meta)
    metrics.append({**{k: meta[k] for k in ("step", "rounds", "time")},
                    f"test_{task.metric_key}": evaluate(evaluated(state))})
  return metrics
