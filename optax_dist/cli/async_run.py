"""``optax-dist async``: asynchronous parameter-server training of a task, emulated.

Runs four asynchronous protocols with :mod:`optax_dist.async_emulator` on one timing model of
the cluster (the same compute times, stragglers, restarts, and workers leaving for good or
joining mid-run, for each) and compares them at the same simulated time:

* ``downpour``: asynchronous SGD, every commit applied by the server (``optax.sgd``);
* ``downpour+drop_stale``: the same with ``drop_stale_gradients(optax.sgd, max_staleness)`` as the
  server transformation, which drops the commits staler than ``max_staleness``;
* ``elastic_average``: asynchronous EASGD, every worker exchanging with the center every
  ``communication_period`` local steps (TF's asynchronous order);
* ``agn``: asynchronous AGN, every worker committing its mean accumulated gradient to the center
  every ``communication_period`` local steps;
* ``diloco``: asynchronous DiLoCo, every worker committing its pseudo-gradient after
  ``communication_period`` local steps to the server's outer SGD with learning rate 1/N (each
  commit moves the anchor by one worker's share: model averaging spread over the commits);
* ``diloco+delayed_nesterov``: the same with the delayed Nesterov outer optimizer of Liu et al.
  (2024), its momentum applied once every N commits (N = ``workers``).

With ``dylu=True`` (``--dylu``) both DiLoCo protocols use dynamic local updates: worker ``w``
commits every ``H_w = max(1, floor(v_w / max(v) * H))`` local steps, ``v_w`` its speed (a
straggler's is ``1 / slowdown``), so the slow workers' rounds take about as long as the fast
ones'.

The data, model, loss and metric are a task's (:mod:`optax_dist.cli.tasks`), as in ``optax-dist
train``. :func:`run_protocols` runs the protocols; ``add_parser(subparsers)`` adds the subcommand to
an ``argparse`` parser and ``run(args)`` runs it: prints the table and writes
``results_async.json`` and ``async.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dist
from optax_dist import async_emulator as ae
from optax_dist.cli import arguments, checks, errors, pipeline, reports
from optax_dist.cli.errors import CommandError
from optax_dist.cli.tasks import TASKS, Task

_PROTOCOLS = {  # name: protocol(sgd, period, moving_rate, max_staleness, workers, dylu)
  "downpour": lambda sgd, tau, alpha, staleness, workers, dylu: ae.downpour(sgd),
  "downpour+drop_stale": lambda sgd, tau, alpha, staleness, workers, dylu: ae.downpour(
    optax_dist.drop_stale_gradients(sgd, staleness)),
  "elastic_average": lambda sgd, tau, alpha, staleness, workers, dylu: ae.elastic_average(
    sgd, communication_period=tau, moving_rate=alpha),
  "agn": lambda sgd, tau, alpha, staleness, workers, dylu: ae.agn(sgd, communication_period=tau),
  "diloco": lambda sgd, tau, alpha, staleness, workers, dylu: ae.diloco(
    sgd, optax.sgd(1.0 / workers), sync_period=tau, dylu=dylu),
  "diloco+delayed_nesterov": lambda sgd, tau, alpha, staleness, workers, dylu: ae.diloco(
    sgd, optax_dist.delayed_nesterov(buffer_size=workers), sync_period=tau, dylu=dylu),
}

PROTOCOLS = tuple(_PROTOCOLS)
"""Every protocol :func:`run_protocols` runs, in this order."""

DEFAULTS = {
  "workers": 4,
  "max_staleness": 2,
  "stragglers": 1,
  "slowdown": 4.0,
  "jitter": 0.2,
  "latency": 0.0,
  "restarts": (),
  "leaves": (),
  "joins": (),
  "duration": 400.0,
  "batch_size": 32,
  "learning_rate": 0.1,
  "communication_period": 4,
  "moving_rate": 0.2,
  "eval_every": 50,
  "seed": 0,
  "dylu": False,
}
"""The defaults of :func:`run_protocols` (and of ``optax-dist async``)."""


def make_protocol(
  name: str, *, learning_rate: float, communication_period: int, moving_rate: float,
  max_staleness: int, workers: int = DEFAULTS["workers"], dylu: bool = DEFAULTS["dylu"],
) -> Any:
  """The :mod:`optax_dist.async_emulator` protocol called ``name`` (one of :data:`PROTOCOLS`);
  ``dylu``: the DiLoCo protocols with dynamic local updates."""
  if name not in _PROTOCOLS:
    raise ValueError(
      f"`run_protocols(protocols=...)`: unknown protocol {name!r}; choose from"
      f" {', '.join(PROTOCOLS)}.")
  return _PROTOCOLS[name](optax.sgd(learning_rate), communication_period, moving_rate,
                          max_staleness, workers, dylu)


def setup(task: Task, workers: int, seed: int) -> dict[str, Any]:
  """The sharded data, initial params, ``loss_fn`` and ``metric_fn`` of ``task``.

  Worker ``i`` owns the ``i``-th of ``workers`` equal shards of the training set (the remainder is
  left out). Returns a dict with ``data`` (every leaf ``[workers, M, ...]``), ``params``,
  ``loss_fn(params, batch)`` and ``metric_fn(params)`` (the test metric, jittable).
  """
  raw = task.load(seed)
  model = task.model()
  data = jax.tree.map(jnp.asarray, pipeline.shard_examples(raw.train, workers))
  test = jax.tree.map(jnp.asarray, raw.test)
  example = {key: value[:1] for key, value in raw.train.items()}
  params = task.init_params(model, jax.random.PRNGKey(seed), example)
  metric = task.metric_fn(model)
  return {"data": data, "params": params, "loss_fn": task.loss_fn(model),
          "metric_fn": lambda params: metric(params, test)}


def _row(name: str, result: Any, schedule: Any, wall_time: float) -> dict[str, Any]:
  """The results of one protocol (see :func:`run_protocols`)."""
  staleness = result.commit_staleness
  return {
    "protocol": name,
    "test_accuracy": float(result.eval_metrics[-1]),
    "commits": int(result.committed.sum()),
    "dropped_fraction": result.dropped_fraction,
    "mean_staleness": float(staleness.mean()) if len(staleness) else 0.0,
    "max_staleness_seen": int(staleness.max()) if len(staleness) else 0,
    "simulated_time": float(result.time[-1]),
    "events": schedule.num_events,
    "wall_time_s": wall_time,
    "history": {
      "time": result.eval_time.tolist(),
      "server_step": result.eval_step.tolist(),
      "test_accuracy": np.asarray(result.eval_metrics).tolist(),
    },
    "staleness": staleness.tolist(),
  }


def run_protocols(
  task: Task,
  *,
  workers: int = DEFAULTS["workers"],
  max_staleness: int = DEFAULTS["max_staleness"],
  stragglers: int = DEFAULTS["stragglers"],
  slowdown: float = DEFAULTS["slowdown"],
  jitter: float = DEFAULTS["jitter"],
  latency: float = DEFAULTS["latency"],
  restarts: Sequence[tuple[int, float]] = DEFAULTS["restarts"],
  leaves: Sequence[tuple[int, float]] = DEFAULTS["leaves"],
  joins: Sequence[tuple[int, float]] = DEFAULTS["joins"],
  duration: float = DEFAULTS["duration"],
  batch_size: int = DEFAULTS["batch_size"],
  learning_rate: float = DEFAULTS["learning_rate"],
  communication_period: int = DEFAULTS["communication_period"],
  moving_rate: float = DEFAULTS["moving_rate"],
  eval_every: int = DEFAULTS["eval_every"],
  seed: int = DEFAULTS["seed"],
  protocols: Sequence[str] = PROTOCOLS,
  progress: bool = False,
  dylu: bool = DEFAULTS["dylu"],
  speeds: Sequence[float] | None = None,
) -> list[dict[str, Any]]:
  """Runs each asynchronous protocol on ``task`` for ``duration`` simulated time; one row each.

  Every protocol sees the same cluster: ``workers`` workers whose steps take 1 time unit
  (uniformly jittered by ``±jitter``), the last ``stragglers`` of them ``slowdown`` × slower, plus
  ``latency`` per exchange with the server, and the same ``restarts`` ((worker, time) pairs:
  the worker loses its step in flight and restarts from the server or center), ``leaves`` (the
  worker leaves for good, its work since its last exchange lost) and ``joins`` (the worker, one of
  ``workers``, is absent until then and starts from the server, center or anchor). All start
  from the same params; SGD with ``learning_rate`` everywhere (the server's, or each worker's and
  the center's). The test metric is measured on the server params (downpour) or the center, every
  ``eval_every`` events and at the end.

  Args:
    task: the data, model, loss and metric.
    workers, stragglers, slowdown, jitter, latency, restarts, leaves, joins: the cluster
      (:class:`optax_dist.async_emulator.Cluster`, its ``schedule``); ``slowdown`` ≥ 1,
      ``jitter`` in [0, 1); restarts, leaves and joins as ``(worker, time)`` pairs.
    max_staleness: ``drop_stale_gradients``' threshold for ``downpour+drop_stale``.
    duration: the simulated time each protocol runs for (a step takes about 1).
    batch_size: each worker's minibatch.
    learning_rate: the SGD learning rate.
    communication_period: τ of ``elastic_average`` and ``agn``, H of ``diloco``, in local steps.
    moving_rate: α of ``elastic_average``.
    eval_every: events between test-metric measurements.
    seed: the seed of the data split, the init, the compute times and the minibatch order.
    protocols: which of :data:`PROTOCOLS` to run.
    progress: show a progress bar (one tick per protocol) on stderr.
    dylu: the DiLoCo protocols with dynamic local updates (each worker's local steps per commit
      proportional to its speed; :func:`optax_dist.async_emulator.dylu_sync_periods`).
    speeds: ``None`` or one relative speed per worker (``Cluster(speeds=...)``, e.g.
      ``(1, 1, 0.5, 0.25)``), combined with ``stragglers`` and ``slowdown``.

  Returns:
    One dict per protocol with the keys of :data:`optax_dist.cli.reports.ASYNC_COLUMNS`
    (``test_accuracy`` is the final metric; ``mean_staleness`` and ``max_staleness_seen`` over
    commits; for ``elastic_average`` and ``agn`` staleness counts other workers' exchanges with
    the center since the worker's last one), plus ``history`` (``time``, ``server_step``,
    ``test_accuracy`` lists) and ``staleness`` (the staleness of every commit).
  """
  from tqdm.auto import tqdm  # the examples extra, checked before a run

  cluster = ae.Cluster(num_workers=workers, compute_time=1.0, jitter=jitter,
                       stragglers=stragglers, slowdown=slowdown, latency=latency, seed=seed,
                       speeds=None if speeds is None else tuple(speeds))
  problem = setup(task, workers, seed)
  rows = []
  for name in tqdm(protocols, desc="async", unit="protocol", disable=not progress, leave=False,
                   file=sys.stderr):
    start = time.perf_counter()
    protocol = make_protocol(name, learning_rate=learning_rate, moving_rate=moving_rate,
                             communication_period=communication_period,
                             max_staleness=max_staleness, workers=workers, dylu=dylu)
    period = protocol.communication_period
    if isinstance(protocol, ae.DiLoCo):  # one per worker with dylu
      period = protocol.sync_periods(cluster.worker_speeds)
    schedule = cluster.schedule(duration=duration, communication_period=period,
                                restarts=restarts, leaves=leaves, joins=joins)
    result = ae.emulate(
      protocol, problem["loss_fn"], problem["params"], problem["data"], schedule,
      batch_size=batch_size, seed=seed, eval_fn=problem["metric_fn"], eval_every=eval_every)
    jax.block_until_ready(result.params)
    rows.append(_row(name, result, schedule, time.perf_counter() - start))
  return rows


def describe(task: Task, *, workers: int, stragglers: int, slowdown: float, latency: float,
             restarts: Sequence[Any], max_staleness: int, communication_period: int,
             leaves: Sequence[Any] = (), joins: Sequence[Any] = (),
             dylu: bool = DEFAULTS["dylu"]) -> str:
  """One line saying what :func:`run_protocols` emulated (the plot's title)."""
  extra = "".join(
    [f", latency {latency:g}" if latency else "",
     ", DiLoCo with DyLU" if dylu else "",
     f", {len(restarts)} restart(s)" if restarts else "",
     ", leaving: " + _at(leaves) if leaves else "",
     ", joining: " + _at(joins) if joins else ""])
  return (f"{task.name}, {workers} async workers ({stragglers} × {slowdown:g} slower{extra}),"
          f" max_staleness={max_staleness}, τ={communication_period}")


def _at(pairs: Sequence[Any]) -> str:
  """``((W, T), ...)`` as ``"W@T, W@T"``."""
  return ", ".join(f"{w}@{time:g}" for w, time in pairs)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
  """Adds ``async`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns it."""
  d = DEFAULTS
  parser = subparsers.add_parser(
    "async", help="compare asynchronous protocols, emulated",
    description=f"Emulate asynchronous parameter-server training with"
    f" {', '.join(PROTOCOLS)} on one simulated cluster (per-worker compute times,"
    " stragglers, restarts, workers leaving and joining) and compare them at the same simulated"
    " time; writes results_async.json and async.png under --out.",
  )
  arguments.task_argument(parser)
  parser.add_argument("--workers", type=arguments.positive_int, default=d["workers"],
                      help=f"number of asynchronous workers (default: {d['workers']})")
  parser.add_argument("--max-staleness", type=arguments.integer, default=d["max_staleness"],
                      help="drop_stale_gradients' largest accepted staleness, in server steps"
                      f" (default: {d['max_staleness']})")
  parser.add_argument("--stragglers", type=arguments.integer, default=d["stragglers"],
                      help=f"number of slow workers (default: {d['stragglers']})")
  parser.add_argument("--slowdown", type=arguments.positive_float, default=d["slowdown"],
                      help=f"how many times slower a straggler is (default: {d['slowdown']:g})")
  parser.add_argument("--restarts", type=arguments.worker_times, default=d["restarts"],
                      metavar="W@T[,W@T...]",
                      help="restart worker W at simulated time T (default: none)")
  parser.add_argument("--leaves", type=arguments.worker_times, default=d["leaves"],
                      metavar="W@T[,W@T...]",
                      help="worker W leaves for good at simulated time T, losing its work since"
                      " its last exchange (default: none)")
  parser.add_argument("--joins", type=arguments.worker_times, default=d["joins"],
                      metavar="W@T[,W@T...]",
                      help="worker W (one of --workers) is absent until simulated time T, then"
                      " starts from the server, center or anchor (default: none)")
  parser.add_argument("--duration", type=arguments.positive_float, default=d["duration"],
                      help="simulated time per protocol; one step takes about 1"
                      f" (default: {d['duration']:g})")
  parser.add_argument("--batch-size", type=arguments.positive_int, default=d["batch_size"],
                      help=f"minibatch size per worker (default: {d['batch_size']})")
  parser.add_argument("--learning-rate", type=arguments.positive_float,
                      default=d["learning_rate"],
                      help=f"SGD learning rate (default: {d['learning_rate']:g})")
  parser.add_argument("--communication-period", type=arguments.positive_int,
                      default=d["communication_period"],
                      help="local steps between exchanges of elastic_average and agn"
                      f" (default: {d['communication_period']})")
  parser.add_argument("--seed", type=arguments.integer, default=d["seed"],
                      help="seed of the data split, init, compute times and minibatches"
                      " (default: 0)")
  parser.add_argument("--dylu", action="store_true",
                      help="DiLoCo with dynamic local updates: each worker's local steps per"
                      " commit proportional to its speed (default: off)")
  arguments.output_arguments(parser)
  return parser


def _check_worker_times(args: argparse.Namespace) -> None:
  """Raises :class:`CommandError` for a ``--restarts``, ``--leaves`` or ``--joins`` worker that
  does not exist, or a combination the emulator refuses (a join after the leave, a restart of an
  absent worker)."""
  for flag in ("restarts", "leaves", "joins"):
    bad = [w for w, _ in getattr(args, flag) if w >= args.workers]
    if bad:
      raise CommandError(
        f"argument --{flag}: worker {bad[0]} does not exist (--workers {args.workers})")
  try:
    ae.Cluster(args.workers).schedule(
      duration=args.duration, restarts=args.restarts, leaves=args.leaves, joins=args.joins)
  except ValueError as e:
    raise CommandError(f"arguments --restarts, --leaves, --joins: {e}") from None


def run(args: argparse.Namespace) -> int:
  """Runs ``optax-dist async``: prints the table, writes ``results_async.json``/``async.png``."""
  task = TASKS[args.task]
  if task.metric_key != "accuracy":
    raise CommandError(f"argument --task: async emulates the classification tasks"
                       f" ({', '.join(t for t in TASKS if TASKS[t].metric_key == 'accuracy')}),"
                       f" not {task.name}; train {task.name} with train or compare")
  errors.require_task(task)
  if not 0 <= args.stragglers <= args.workers:
    raise CommandError(f"argument --stragglers: must be in 0..{args.workers} (--workers), got"
                       f" {args.stragglers}")
  _check_worker_times(args)
  checks.check_out(args.out)
  cluster = {key: getattr(args, key) for key in ("workers", "stragglers", "slowdown", "restarts",
                                                 "leaves", "joins", "max_staleness",
                                                 "communication_period", "dylu")}
  rows = run_protocols(task, **cluster, duration=args.duration, batch_size=args.batch_size,
                       learning_rate=args.learning_rate, seed=args.seed,
                       progress=not args.no_progress)
  png_path = os.path.join(args.out, "async.png")
  reports.plot_async(rows, png_path, describe(task, latency=DEFAULTS["latency"], **cluster))
  json_path = os.path.join(args.out, "results_async.json")
  reports.write_json(json_path, {
    "command": "async",
    "config": {k: v for k, v in vars(args).items() if k not in ("command", "argv")},
    "protocols": {r["protocol"]: r for r in rows}})
  print(reports.table(reports.ASYNC_COLUMNS, rows))
  print(f"wrote {json_path} and {png_path}")
  return 0
