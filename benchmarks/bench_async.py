"""Cost of one emulated asynchronous event against one synchronous training step.

For the digits MLP of ``optax-dist async`` (64-64-64-10, minibatch 32), measures:

* ``jit step``: one jitted synchronous training step (gradient, optimizer update, apply),
  called from a Python loop, per call;
* ``scan step``: the same step inside a ``lax.scan`` (no dispatch), per step;
* ``emulator``: :func:`optax_dist.async_emulator.emulate` per event (host preparation included,
  compilation excluded), for each protocol, with the optimizer the synchronous step uses.

Each number is the minimum over ``--reps`` interleaved repetitions (the machine may be shared).
CPU time of the process is reported beside wall time: with other jobs on the cores it is the
steadier of the two.

Usage::

  python benchmarks/bench_async.py [--events 2000] [--workers 4] [--reps 5]
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dist
from optax_dist import async_emulator as ae
from optax_dist.cli import async_run
from optax_dist.cli.tasks import TASKS


def cpu_time() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def measure(fn, count):
  """(wall, cpu) seconds per unit of one call of ``fn`` doing ``count`` units."""
  wall, cpu = time.perf_counter(), cpu_time()
  jax.block_until_ready(fn())
  return (time.perf_counter() - wall) / count, (cpu_time() - cpu) / count


def cell(v: tuple[float, float]) -> str:
  """Wall / CPU microseconds."""
  return f"{v[0] * 1e6:6.1f}/{v[1] * 1e6:6.1f}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--events", type=int, default=2000)
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--reps", type=int, default=5)
  args = parser.parse_args()

  problem = async_run.setup(TASKS["digits"], args.workers, seed=0)
  loss_fn, params, data = problem["loss_fn"], problem["params"], problem["data"]
  e, b = args.events, args.batch_size
  flat = jax.tree.map(lambda d: d.reshape((-1,) + d.shape[2:]), data)
  rows = np.random.default_rng(0).integers(0, flat["x"].shape[0], (e, b)).astype(np.int32)
  cluster = ae.Cluster(args.workers, jitter=0.1, seed=0)

  def sync_fns(tx):
    def step(p, o, idx):
      batch = jax.tree.map(lambda d: d[idx], flat)
      loss, grads = jax.value_and_grad(loss_fn)(p, batch)
      updates, o = tx.update(grads, o, p)
      return optax.apply_updates(p, updates), o, loss

    jit_step = jax.jit(step)

    @jax.jit
    def scan_steps(p, idx):
      def body(carry, i):
        p, o, loss = step(*carry, i)
        return (p, o), loss
      return jax.lax.scan(body, (p, tx.init(p)), idx)

    def loop():
      p, o = params, tx.init(params)
      for i in range(e):
        p, o, _ = jit_step(p, o, rows_dev[i])
      return p

    rows_dev = [jnp.asarray(r) for r in rows]
    return loop, lambda: scan_steps(params, jnp.asarray(rows))

  sgd, adam = optax.sgd(0.1), optax.adam(1e-3)
  cases = {
    "downpour (sgd)": (ae.downpour(sgd), sgd),
    "downpour + drop_stale_gradients (sgd)": (
      ae.downpour(optax_dist.drop_stale_gradients(sgd, 2)), sgd),
    "elastic_average (sgd)": (ae.elastic_average(sgd, communication_period=4), sgd),
    "agn (sgd)": (ae.agn(sgd, communication_period=4), sgd),
    "elastic_average (adam)": (ae.elastic_average(adam, communication_period=4), adam),
    "agn (adam)": (ae.agn(adam, communication_period=4), adam),
  }
  fns = {}
  for name, (protocol, tx) in cases.items():
    schedule = cluster.schedule(num_events=e, communication_period=protocol.communication_period)

    def emulate(protocol=protocol, schedule=schedule):
      return ae.emulate(protocol, loss_fn, params, data, schedule, batch_size=b).params

    loop, scan = sync_fns(tx)
    fns[name] = {"jit step": loop, "scan step": scan, "emulator": emulate}
    for fn in fns[name].values():  # compile
      jax.block_until_ready(fn())

  best: dict[tuple[str, str], tuple[float, float]] = {}
  for _ in range(args.reps):
    for name, kinds in fns.items():
      for kind, fn in kinds.items():
        wall, cpu = measure(fn, e)
        old = best.get((name, kind), (np.inf, np.inf))
        best[(name, kind)] = (min(old[0], wall), min(old[1], cpu))

  print(f"digits MLP, batch {b}, {args.workers} workers, {e} events; min of {args.reps} reps;"
        " µs per step or event (wall / CPU)")
  header = (f"{'protocol':40s} {'jit step':>13s} {'scan step':>13s} {'emulator':>13s}"
            f" {'emu/jit':>8s} {'emu/scan':>9s}")
  print(header)
  for name in fns:
    j, s, m = (best[(name, k)] for k in ("jit step", "scan step", "emulator"))
    print(f"{name:40s} {cell(j):>13s} {cell(s):>13s} {cell(m):>13s}"
          f" {m[1] / j[1]:8.2f} {m[1] / s[1]:9.2f}")


if __name__ == "__main__":
  main()
