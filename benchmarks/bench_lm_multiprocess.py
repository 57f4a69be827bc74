"""Two ``jax.distributed`` processes × 2 devices on the LM: hierarchical against synchronous.

Two local processes, each with 2 emulated CPU devices, joined by ``jax.distributed`` with gloo
collectives over loopback (:func:`optax_dist.cli.launcher.init_jax`), form a 2 × 2 mesh with
axes ``("processes", "devices")``; each of the 4 devices is a worker with its own quarter of the
``lm`` task's training windows, minibatch 8, adam 3e-3:

* *hierarchical*: ``diloco(tower(adam, "devices"), outer, sync_period=H, axis_name="processes")``
  — the gradients all-reduced within a process on every step, the processes synced every H
  steps with the paper's outer Nesterov SGD (0.7, momentum 0.9);
* *synchronous*: ``tower(adam, ("processes", "devices"))`` — the gradients all-reduced over all
  4 workers, across the processes, on every step.

The training loop is this module's own (the trainer's mesh is 1-D): run as ``python
bench_lm_multiprocess.py --worker ...``, each process builds the same global arrays and runs
the same jitted ``shard_map`` steps: for ``diloco`` two, compiled ahead of time, one that syncs
and one that does not (the static ``communicate`` hint, as ``optax-dist`` trains). Steps per
second exclude the first step: ``(steps − 1) / (time after the last step − time after the
first)``. The final validation bits
per byte are those of :func:`optax_dist.eval_params` (the anchor, or the params), the workers'
mean. Each algorithm runs 3 times (seeds 0, 1, 2), interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

PROCESSES = 2
DEVICES = 2
STEPS = 100
SYNC_PERIOD = 25
BATCH = 8
LEARNING_RATE = 3e-3
RUNS = 3
ALGORITHMS = ("tower", "diloco")
LABELS = {
  "tower": "synchronous: tower(adam) over all 4 devices",
  "diloco": f"hierarchical: diloco(tower(adam, devices), H={SYNC_PERIOD}) across processes",
}
WORKERS = ("processes", "devices")


def make_tx(algorithm: str) -> Any:
  import optax

  import optax_dist

  adam = optax.adam(LEARNING_RATE)
  if algorithm == "tower":
    return optax_dist.tower(adam, WORKERS)
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  return optax_dist.diloco(optax_dist.tower(adam, "devices"), outer, sync_period=SYNC_PERIOD,
                           axis_name="processes")


def train(algorithm: str, steps: int, seed: int) -> dict[str, Any]:
  """One process's part of a run (after ``jax.distributed`` is initialised)."""
  import jax
  import optax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_dist
  from optax_dist.cli import pipeline, tasks, trainer

  task = tasks.TASKS["lm"]
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.array(devices).reshape(PROCESSES, DEVICES), WORKERS)
  n = PROCESSES * DEVICES
  split, replicated = NamedSharding(mesh, P(WORKERS)), NamedSharding(mesh, P())
  data = task.load(seed)
  shards = pipeline.shard_examples(data.train, n)
  n_local = len(shards["x"][0])
  train_data = {k: pipeline.put(v, split) for k, v in shards.items()}
  test = {k: pipeline.put(v, replicated) for k, v in data.test.items()}
  example = tuple((k, (1,) + v.shape[1:], str(v.dtype)) for k, v in data.train.items())
  host_params = trainer.initial_params(task, seed, example)
  params = jax.tree.map(lambda p: pipeline.put(np.broadcast_to(p, (n,) + p.shape), split),
                        host_params)
  tx = make_tx(algorithm)
  model = task.model()
  loss_fn, metric_fn = task.loss_fn(model), task.metric_fn(model)

  def per_worker(f):
    def g(*args):
      out = f(*jax.tree.map(lambda x: x[0], args))
      return jax.tree.map(lambda x: x[None], out)

    return g

  def step_fn(hint):
    extra = {} if hint is None else {"communicate": hint}

    def step(params, opt_state, shard, idx):
      batch = jax.tree.map(lambda x: x[idx], shard)
      grads = jax.grad(loss_fn)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params, **extra)
      return optax.apply_updates(params, updates), opt_state

    return jax.jit(jax.shard_map(per_worker(step), mesh=mesh, in_specs=P(WORKERS),
                                 out_specs=P(WORKERS)), donate_argnums=(0, 1))

  opt_state = jax.jit(jax.shard_map(per_worker(tx.init), mesh=mesh, in_specs=P(WORKERS),
                                    out_specs=P(WORKERS)))(params)
  idx = pipeline.put(pipeline.minibatch(seed, n, n_local, BATCH, 0), split)
  # diloco: a step that syncs and one that does not, as the trainer compiles them (the static
  # `communicate` hint); both compiled before the first step.
  hints = (None,) if algorithm == "tower" else (False, True)
  steps_by_hint = {h: step_fn(h).lower(params, opt_state, train_data, idx).compile()
                   for h in hints}

  @jax.jit
  def evaluate(params, opt_state):
    averaged = optax_dist.eval_params(opt_state, params)
    return jax.numpy.mean(jax.vmap(lambda p: metric_fn(p, test))(averaged))

  marks = []
  for s in range(steps):
    idx = pipeline.put(pipeline.minibatch(seed, n, n_local, BATCH, s), split)
    hint = None if algorithm == "tower" else optax_dist.diloco_syncs(s + 1, sync_period=SYNC_PERIOD)
    params, opt_state = steps_by_hint[hint](params, opt_state, train_data, idx)
    jax.block_until_ready(params)
    marks.append(time.perf_counter())
  bits = float(np.asarray(evaluate(params, opt_state).addressable_data(0)))
  rate = (steps - 1) / (marks[-1] - marks[0]) if steps > 1 else float("nan")
  return {"algorithm": algorithm, "seed": seed, "steps": steps, "steps_per_s": rate,
          "bits_per_byte": bits, "first_step_s": marks[0] - START}


START = time.perf_counter()


def _worker_main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--worker", action="store_true")
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--coordinator", required=True)
  parser.add_argument("--algorithm", choices=ALGORITHMS, required=True)
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  from optax_dist.cli import launcher

  launcher.init_jax(DEVICES, PROCESSES, args.process_id, args.coordinator)
  result = train(args.algorithm, args.steps, args.seed)
  if args.process_id == 0:
    with open(args.out, "w") as f:
      json.dump(result, f)
  return 0


def run_once(algorithm: str, steps: int, seed: int, timeout: float = 900) -> dict[str, Any]:
  """One run: two local processes; returns process 0's result (raises ``RuntimeError``)."""
  from optax_dist.cli.launcher import free_port

  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  address = f"127.0.0.1:{free_port()}"
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "result.json")
    start = time.perf_counter()
    procs = [subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), "--worker", "--process-id", str(i),
       "--coordinator", address, "--algorithm", algorithm, "--steps", str(steps),
       "--seed", str(seed), "--out", out],
      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
      for i in range(PROCESSES)]
    errors = []
    for p in procs:
      try:
        _, err = p.communicate(timeout=timeout)
      except subprocess.TimeoutExpired:
        for q in procs:
          q.kill()
        raise RuntimeError(f"{algorithm} seed {seed}: no result after {timeout:.0f} s") from None
      if p.returncode != 0:
        errors.append(f"exit {p.returncode}: {' / '.join(err.strip().splitlines()[-2:])}")
    if errors:
      raise RuntimeError(f"{algorithm} seed {seed}: {'; '.join(errors)}")
    with open(out) as f:
      result = json.load(f)
  result["wall_s"] = time.perf_counter() - start
  return result


def measure(quick: bool = False) -> dict[str, Any]:
  import _util

  steps, runs = (20, 1) if quick else (STEPS, RUNS)
  load_before, start = _util.load_average(), time.perf_counter()
  results = {a: [] for a in ALGORITHMS}
  try:
    for seed in range(runs):  # interleaved
      for algorithm in ALGORITHMS:
        results[algorithm].append(run_once(algorithm, steps, seed))
        r = results[algorithm][-1]
        print(f"[bench]   {algorithm} seed {seed}: {r['steps_per_s']:.2f} steps/s,"
              f" {r['bits_per_byte']:.4f} bits/byte", flush=True)
  except (RuntimeError, OSError) as e:
    return {"measured": False, "reason": str(e), "results": results}
  summary = {}
  for algorithm, rs in results.items():
    rates = [r["steps_per_s"] for r in rs]
    bits = [r["bits_per_byte"] for r in rs]
    summary[algorithm] = {"steps_per_s": _util.median(rates), "rates": rates,
                          "bits_per_byte": float(np.mean(bits)), "bits_sd": float(np.std(bits)),
                          "bits": bits, "wall_s": float(np.mean([r["wall_s"] for r in rs]))}
  return {"measured": True, "steps": steps, "runs": runs, "summary": summary,
          "load_before": load_before, "load_after": _util.load_average(),
          "seconds": time.perf_counter() - start}


def markdown(result: dict[str, Any], plot_name: str) -> str:
  import _util

  if not result["measured"]:
    return f"Not measured: {result['reason']}."
  s = result["summary"]
  sync = s["tower"]
  rows = []
  for algorithm in ALGORITHMS:
    r = s[algorithm]
    rows.append([LABELS[algorithm], f"{r['steps_per_s']:.2f}",
                 ", ".join(f"{x:.2f}" for x in r["rates"]),
                 f"{r['steps_per_s'] / sync['steps_per_s']:.2f}",
                 f"{r['bits_per_byte']:.4f} ± {r['bits_sd']:.4f}",
                 f"{100 * (r['bits_per_byte'] / sync['bits_per_byte'] - 1):+.1f}%",
                 f"{r['wall_s']:.0f}"])
  header = ["algorithm", "steps / s (median)", "per run", "vs synchronous",
            "final val bits/byte ± sd", "vs synchronous", "wall s / run"]
  return "\n".join([
    _util.doc_markdown(__doc__, 1, 3),
    "",
    (f"{result['steps']} steps per run, {result['runs']} runs each (seeds"
     f" {', '.join(map(str, range(result['runs'])))}); load average {result['load_before']}"
     f" before, {result['load_after']} after ({_util.machine()['cores']} CPUs: the 2 processes"
     f" and their 4 devices share them); {result['seconds'] / 60:.1f} min."),
    "",
    _util.table(header, rows),
    "",
    ("Both processes and their 4 devices share one machine's cores, and gloo runs over loopback:"
     " a cross-process all-reduce of the gradients (1.1 MB) costs little here, so the rates"
     " measure each algorithm's own step cost (the DiLoCo wrapper's, see the overhead section)"
     " and how long each process waits for the other in the collectives, not a network. The"
     " waiting grows with the machine's load (a descheduled process stalls every collective of"
     " the other), so the synchronous step, with a cross-process collective on every step, is"
     " the more sensitive of the two to it; across a real network the per-step all-reduce is"
     " what the hierarchical layout saves."),
    "",
    f"![steps per second and validation loss, two processes]({plot_name})",
  ])


def plot(result: dict[str, Any], path: str) -> None:
  if not result["measured"]:
    return
  import _util
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  s = result["summary"]
  fig, (rate_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
  names = ["synchronous\n(tower over 4)", f"hierarchical\n(diloco H={SYNC_PERIOD} ∘ tower)"]
  for k, algorithm in enumerate(ALGORITHMS):
    r = s[algorithm]
    rate_ax.bar(k, r["steps_per_s"], color=f"C{k}")
    rate_ax.plot([k] * len(r["rates"]), r["rates"], "k.")
    loss_ax.bar(k, r["bits_per_byte"], yerr=r["bits_sd"], color=f"C{k}")
  for ax, label in ((rate_ax, "steps / s (median; dots: runs)"),
                    (loss_ax, "final validation bits per byte")):
    ax.set_xticks(range(len(ALGORITHMS)), names, fontsize=8)
    ax.set_ylabel(label)
    ax.grid(True, axis="y", alpha=0.3)
  bits = [s[a]["bits_per_byte"] for a in ALGORITHMS]
  loss_ax.set_ylim(min(bits) - 0.3, max(bits) + 0.2)
  fig.suptitle(f"LM, 2 processes × 2 devices, gloo, {result['steps']} steps."
               f" {_util.machine()['cores']} CPUs; load average {result['load_before']} before,"
               f" {result['load_after']} after", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  if "--worker" in sys.argv[1:]:
    sys.exit(_worker_main(sys.argv[1:]))
  sys.exit("run by benchmarks/run.py (--sections lm_multiprocess)")
