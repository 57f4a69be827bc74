"""Can a cross-process exchange run while local steps compute, on XLA CPU?

Streaming DiLoCo with an overlap τ dispatches an exchange and consumes its result τ steps later,
which hides the communication only if the runtime runs the exchange beside the steps dispatched
after it. Measured with two ``jax.distributed`` processes (gloo, :data:`DEVICES` emulated CPU
devices each) over a shaped :class:`netns.Link`, process 0 and the coordinator in ``a``.

A local step is a jitted data-parallel tower over a process's first :data:`TRAINING` devices (a
few matmuls per shard, a ``psum`` of a gradient over them); the exchange, a ``psum`` across the
processes of ``--size`` bytes of float32 each. Each process times per repeat, with barriers:

* ``compute``: ``--steps`` local steps dispatched back to back, waited for at the end;
* ``exchange``: the exchange alone on the dedicated device, waited for;
* ``blocking``: the exchange, then the steps, each waited for before the next is dispatched;
* ``overlap_same_devices``: the exchange over both processes' training devices (a 2 x 4 mesh, a
  quarter of the bytes each) dispatched without waiting, then the steps, then a wait for all;
* ``overlap_own_device``: the same with the exchange on a dedicated device per process (the last
  one, a 2-device mesh across the processes), its input moved there with ``jax.device_put``;
* ``overlap_thread``: as ``overlap_own_device``, the exchange dispatched and waited for in a
  Python thread while the main thread dispatches the steps.

XLA's CPU client runs a computation over several devices of a process as a gang, started only
when the previous gang has finished, so ``overlap_same_devices`` should serialise; a one-device
computation waits only for that device's previous work and its inputs. Overlap efficiency is
``(compute + exchange - overlapped) / min(compute, exchange)`` of the medians: 1 when the shorter
is fully hidden, 0 when they run one after the other (left out when the exchange is too short to
tell, as unshaped). Also recorded per overlap: the seconds until the exchange's dispatch returned
(near 0 when asynchronous) and until the steps were done (about ``compute`` beside the exchange,
``exchange + compute`` behind it); whether the results equal the sum of both processes' inputs;
the load average before and after each rate.

Needs root and iproute2 (``python -m benchmarks.network.probe_overlap --help``); says why and exits
with 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.multihost_utils import sync_global_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.network import netns

DEVICES = 5
"""Emulated CPU devices per process: the training devices and one for the exchange."""
TRAINING = 4
"""The devices of a process the local steps run on (the first ones)."""
SIZE = 1_120_000
"""Bytes of float32 each process contributes to the exchange."""
STEPS, REPEATS, PORT = 5, 5, 7713
SHORTEST = 0.05
"""The overlap efficiency is left out when the shorter of compute and exchange is below this
fraction of the longer: the noise of the longer then exceeds what overlap could save."""
VARIANTS = ("compute", "exchange", "blocking", "overlap_same_devices", "overlap_own_device",
            "overlap_thread")
OVERLAPPED = VARIANTS[3:]


def worker(args: argparse.Namespace) -> dict[str, Any]:
  """Process ``--worker``'s measurements (it joins the other at ``--coordinator``)."""
  process_id, both = args.worker, netns.join(args, DEVICES)
  local = both[process_id]
  train_mesh = Mesh(np.array(local[:TRAINING]), ("data",))
  wide_mesh = Mesh(np.array([devs[:TRAINING] for devs in both]), ("replica", "data"))
  own_mesh = Mesh(np.array([devs[TRAINING] for devs in both]), ("replica",))
  own_device = local[TRAINING]
  width, layers, rows = args.width, args.layers, args.rows

  def tower(x, w):
    h = x
    for _ in range(layers):
      h = jnp.tanh(h @ w)
    grad = jax.lax.psum(h.T @ x, "data") / (rows * TRAINING)
    return w - 1e-3 * grad

  step = jax.jit(jax.shard_map(tower, mesh=train_mesh, in_specs=(P("data"), P()), out_specs=P()))

  def all_reduce(mesh, spec):
    return jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "replica"), mesh=mesh, in_specs=spec,
                                 out_specs=spec))

  exchange_wide = all_reduce(wide_mesh, P("replica", "data"))
  exchange_own = all_reduce(own_mesh, P("replica"))
  own_sharding = NamedSharding(own_mesh, P("replica"))

  n = args.size // 4 // TRAINING * TRAINING
  base, rng = np.arange(n, dtype=np.float32) % 7, np.random.default_rng(process_id)
  x = jax.device_put(rng.standard_normal((rows * TRAINING, width), np.float32) / width**0.5,
                     NamedSharding(train_mesh, P("data")))
  w0 = jax.device_put(rng.standard_normal((width, width), np.float32) / width**0.5,
                      NamedSharding(train_mesh, P()))
  # The exchanged values (a parameter fragment) live on the training devices, split over them.
  fragment = jax.device_put(((process_id + 1) * base)[None], NamedSharding(train_mesh,
                                                                             P(None, "data")))
  whole = jax.device_put(((process_id + 1) * base)[None], NamedSharding(train_mesh, P()))
  expected = 3 * base

  def wide_input():
    shards = [s.data for s in sorted(fragment.addressable_shards, key=lambda s: s.device.id)]
    return jax.make_array_from_single_device_arrays((2, n), NamedSharding(
      wide_mesh, P("replica", "data")), shards)

  def own_input():
    moved = jax.device_put(whole.addressable_data(0), own_device)
    return jax.make_array_from_single_device_arrays((2, n), own_sharding, [moved])

  def steps(w, wait):
    for _ in range(args.steps):
      w = step(x, w)
      if wait:
        w.block_until_ready()
    return w

  def correct(result):
    return all(np.allclose(np.asarray(s.data)[0], expected[s.index[1]])
               for s in result.addressable_shards)

  def run(variant):
    """Seconds of ``variant``; for an overlap, the seconds until its exchange's dispatch returned
    and until its steps were done; and whether its exchange's result was right."""
    start = time.perf_counter()
    marks, out = {}, None
    if variant == "compute":
      steps(w0, wait=False).block_until_ready()
    elif variant == "exchange":
      out = exchange_own(own_input()).block_until_ready()
    elif variant == "blocking":
      exchange_own(own_input()).block_until_ready()
      steps(w0, wait=True)
    elif variant == "overlap_thread":
      box = {}

      def exchange_now():
        box["out"] = exchange_own(own_input())
        marks["dispatch"] = time.perf_counter() - start
        box["out"].block_until_ready()

      thread = threading.Thread(target=exchange_now)
      thread.start()
      steps(w0, wait=False).block_until_ready()
      marks["steps_done"] = time.perf_counter() - start
      thread.join()
      out = box["out"]
    else:
      same = variant == "overlap_same_devices"
      out = exchange_wide(wide_input()) if same else exchange_own(own_input())
      marks["dispatch"] = time.perf_counter() - start
      steps(w0, wait=False).block_until_ready()
      marks["steps_done"] = time.perf_counter() - start
      out.block_until_ready()
    seconds = time.perf_counter() - start
    return seconds, marks, None if out is None else correct(out)

  times = {v: [] for v in VARIANTS}
  marks = {v: {"dispatch": [], "steps_done": []} for v in OVERLAPPED}
  right = {v: [] for v in VARIANTS if v not in ("compute", "blocking")}
  for r in range(-1, args.repeats):  # repeat -1 compiles and opens gloo's connections: left out
    for variant in VARIANTS:
      sync_global_devices(f"{r} {variant}")
      seconds, at, ok = run(variant)
      if r < 0:
        continue
      times[variant].append(seconds)
      for k, t in at.items():
        marks[variant][k].append(t)
      if ok is not None:
        right[variant].append(ok)
  sync_global_devices("done")
  return {"process": process_id, "times": times, "marks": marks,
          "correct": {v: all(oks) for v, oks in right.items()}}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
  """Medians, minima and maxima of one process's times, and each overlap's efficiency."""
  stats = {v: {"median": statistics.median(t), "min": min(t), "max": max(t)}
           for v, t in result["times"].items()}
  compute, exchange = stats["compute"]["median"], stats["exchange"]["median"]
  for v in OVERLAPPED:
    if min(compute, exchange) >= SHORTEST * max(compute, exchange):
      stats[v]["efficiency"] = (compute + exchange - stats[v]["median"]) / min(compute, exchange)
    for k, t in result["marks"][v].items():
      stats[v][f"{k}_median"] = statistics.median(t)
  for v, ok in result["correct"].items():
    stats[v]["correct"] = ok
  return stats


def report(rate: str, summaries: list[dict[str, Any]], load: list[float]) -> str:
  """Each variant's median, min and max seconds, efficiency, dispatch and steps-done medians and
  correctness, per process."""
  keys = ("median", "min", "max", "efficiency", "dispatch_median", "steps_done_median", "correct")
  rows = [[v, *(s[v].get(k) for s in summaries for k in keys)] for v in VARIANTS]
  header = ["variant", *(f"p{i} {k.removesuffix('_median')}" for i in range(2) for k in keys)]
  return (f"\n{rate} (load average {load[0]:.2f} before, {load[1]:.2f} after)\n"
          + netns.columns(header, rows))


def drive(args: argparse.Namespace, pair: Any) -> dict[str, Any]:
  """Both processes' measurements and their summaries at each of ``--rates``."""
  config = {k: getattr(args, k) for k in ("size", "steps", "repeats", "width", "layers", "rows")}
  out = {"config": config | {"devices": DEVICES, "training": TRAINING}, "cores": os.cpu_count(),
         "rates": {}}
  with netns.Link() as link:
    for rate in args.rates:
      link.shape(rate)
      results, load = pair(link)
      summaries = [summarize(r) for r in results]
      print(report(rate, summaries, load), flush=True)
      out["rates"][rate] = {"load_average": load, "processes": summaries,
                            "raw": [r["times"] for r in results]}
  return out


def main(argv: list[str]) -> int:
  return netns.probe_main(argv, "benchmarks.network.probe_overlap", __doc__, PORT, {
    "--rates": {"nargs": "+", "default": ["10mbit", "unshaped"]},
    "--size": {"type": int, "default": SIZE, "help": "bytes each process exchanges"},
    "--steps": {"type": int, "default": STEPS, "help": "local steps per measurement"},
    "--repeats": {"type": int, "default": REPEATS},
    "--width": {"type": int, "default": 512, "help": "the tower's width"},
    "--layers": {"type": int, "default": 8, "help": "matmuls per step"},
    "--rows": {"type": int, "default": 1024, "help": "rows of the batch per device"}},
    worker, drive)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
