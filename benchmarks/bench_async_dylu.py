"""Synchronous DiLoCo against asynchronous DiLoCo, delayed Nesterov and DyLU, on heterogeneous
workers (Liu et al. 2024, Table 3's comparison), emulated on the digits task.

Four workers of speeds 1 : 1 : 0.5 : 0.25 (steps per unit of simulated time), SGD inner steps
(``--inner-lr``, minibatch 32), H local steps per round, outer learning rate 0.7 and momentum 0.9:

* ``sync diloco``: :func:`optax_dist.diloco` under ``jax.vmap``; every round all workers take H
  steps and wait for the slowest, so a round takes H / 0.25 time units; one Nesterov step on the
  mean pseudo-gradient;
* ``async diloco``: the emulator's :func:`~optax_dist.async_emulator.diloco`, one Nesterov step
  (``optax.sgd(0.7, 0.9, nesterov=True)``) per commit;
* ``async + delayed nesterov``: ``outer=optax_dist.delayed_nesterov(0.7, 0.9, buffer_size=4)``;
* ``async + delayed nesterov + dylu``: the same with ``dylu=True`` (H_w = 16, 16, 8, 4 for H = 16).

Prints the test accuracy of the anchor at a few simulated times for each seed, and the machine's
load average (the numbers are simulated time; the load only affects how long the script takes).

Usage::

  python benchmarks/bench_async_dylu.py [--seeds 0 1 2] [--duration 320] [--sync-period 16]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dist
from optax_dist import async_emulator as ae
from optax_dist.cli import async_run
from optax_dist.cli.tasks import TASKS

SPEEDS = (1.0, 1.0, 0.5, 0.25)
OUTER_LR, OUTER_MOMENTUM, BATCH = 0.7, 0.9, 32


def sync_diloco(problem, *, h, rounds, inner_lr, seed):
  """Test accuracy of the anchor after each round of synchronous DiLoCo (round 0 first)."""
  data, n = problem["data"], len(SPEEDS)
  m = jax.tree.leaves(data)[0].shape[1]
  tx = optax_dist.diloco(optax.sgd(inner_lr), optax.sgd(OUTER_LR, OUTER_MOMENTUM, nesterov=True),
                         sync_period=h, axis_name="w")
  rng = np.random.default_rng((seed, 7))
  index = jnp.asarray(rng.integers(0, m, size=(rounds, h, n, BATCH)))
  loss_fn = problem["loss_fn"]

  def worker(params, state, shard, idx):
    def step(carry, i):
      p, s = carry
      batch = jax.tree.map(lambda d: d[i], shard)
      g = jax.grad(loss_fn)(p, batch)
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    (params, state), _ = jax.lax.scan(step, (params, state), idx)
    return params, state

  one_round = jax.jit(jax.vmap(worker, axis_name="w", in_axes=(0, 0, 0, 1)))
  params = jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), problem["params"])
  state = jax.vmap(tx.init)(params)
  metric = jax.jit(problem["metric_fn"])
  accuracy = [float(metric(problem["params"]))]
  for r in range(rounds):
    params, state = one_round(params, state, data, index[r])
    accuracy.append(float(metric(jax.tree.map(lambda a: a[0], state.anchor))))
  return np.asarray(accuracy)


def async_run_accuracy(problem, protocol, *, duration, seed, eval_every):
  cluster = ae.Cluster(len(SPEEDS), speeds=SPEEDS, seed=seed)
  schedule = cluster.schedule(duration=duration,
                              communication_period=protocol.sync_periods(cluster.worker_speeds))
  r = ae.emulate(protocol, problem["loss_fn"], problem["params"], problem["data"], schedule,
                 batch_size=BATCH, seed=seed, eval_fn=problem["metric_fn"], eval_every=eval_every)
  return r.eval_time, np.asarray(r.eval_metrics), int(r.committed.sum())


def at(times, values, t):
  """The last value measured at or before ``t``."""
  return values[np.searchsorted(times, t, side="right") - 1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--duration", type=float, default=320.0)
  parser.add_argument("--sync-period", type=int, default=16)
  parser.add_argument("--inner-lr", type=float, default=0.05)
  args = parser.parse_args()
  h, n = args.sync_period, len(SPEEDS)
  round_time = h / min(SPEEDS)
  rounds = int(args.duration // round_time)
  checkpoints = [args.duration * f for f in (0.25, 0.5, 1.0)]
  print(f"load average before: {os.getloadavg()}, cpus: {os.cpu_count()}")
  print(f"speeds {SPEEDS}, H={h} (DyLU: {ae.dylu_sync_periods(SPEEDS, h)}), inner sgd"
        f" {args.inner_lr}, outer {OUTER_LR}/{OUTER_MOMENTUM}, duration {args.duration:g}")
  sgd = optax.sgd(args.inner_lr)
  nesterov = optax.sgd(OUTER_LR, OUTER_MOMENTUM, nesterov=True)
  dn = optax_dist.delayed_nesterov(OUTER_LR, OUTER_MOMENTUM, buffer_size=n)
  protocols = {
    "async diloco": ae.diloco(sgd, nesterov, sync_period=h),
    "async + delayed nesterov": ae.diloco(sgd, dn, sync_period=h),
    "async + delayed nesterov + dylu": ae.diloco(sgd, dn, sync_period=h, dylu=True),
  }
  table = {name: [] for name in ["sync diloco", *protocols]}
  start = time.perf_counter()
  for seed in args.seeds:
    problem = async_run.setup(TASKS["digits"], n, seed)
    acc = sync_diloco(problem, h=h, rounds=rounds, inner_lr=args.inner_lr, seed=seed)
    times = np.arange(rounds + 1) * round_time
    table["sync diloco"].append([at(times, acc, t) for t in checkpoints])
    for name, protocol in protocols.items():
      t, a, commits = async_run_accuracy(problem, protocol, duration=args.duration, seed=seed,
                                         eval_every=50)
      table[name].append([at(t, a, c) for c in checkpoints])
      print(f"  seed {seed} {name}: {commits} commits")
  header = " ".join(f"t={c:>5g}" for c in checkpoints)
  print(f"\n{'test accuracy, mean (min-max) over seeds':<34} {header}")
  for name, rows in table.items():
    rows = np.asarray(rows)
    cells = " ".join(f"{rows[:, j].mean():.3f} ({rows[:, j].min():.3f}-{rows[:, j].max():.3f})"
                     for j in range(len(checkpoints)))
    print(f"{name:<34} {cells}")
  print(f"\nload average after: {os.getloadavg()}, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
