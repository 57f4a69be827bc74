"""Training over a real bandwidth-limited link: two processes in two network namespaces.

Each run is ``optax-dist train --task lm --processes 2 --devices 4`` with its two processes in
two network namespaces joined by a veth pair (:mod:`netns`), process 0 (and the coordinator) in
``a``, process 1 in ``b``: every byte the processes exchange (gloo's collectives, JAX's
coordination service) crosses the veth pair, shaped at the rate under test in each direction
with a token bucket (``tc ... tbf``), or unshaped. Every run has the same 8 workers (4 devices
per process, one worker each), the same batch per worker, learning rate, steps and seed; the
periodic algorithms exchange every H steps (``--sync-period H --communication-period H``).

For each run: the wall-clock of the whole command (start-up, compilation and evaluations
included); each step's seconds (the trainer's ``step_times``), split into the steps that
exchange (every step for ``sync``) and those that do not; the bytes each veth sent, read from
its counters before and after; the validation bits per byte against the training seconds (the
steps' seconds summed up to each evaluation); and, per rate, the rate a timed TCP transfer
achieves in each direction. The runs alternate algorithms within each rate; the load average
is recorded before and after each run.

Needs root and iproute2 (``make bench-network``); says why and exits with 0 otherwise.
``--extra-args`` is appended to every run's command line (e.g. ``--extra-args='--replicas 2'``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import netns  # noqa: E402

RATES = ("unshaped", "1gbit", "100mbit", "10mbit")
ALGORITHMS = ("sync", "diloco", "streaming_diloco", "local_sgd", "elastic_average")
PROCESSES = 2
DEVICES = 4
STEPS = 40
PERIOD = 10
"""H: the steps between the exchanges of the periodic algorithms."""
BATCH = 8
EVAL_EVERY = 10
TIMEOUT = 1800
"""Seconds a run may take before it is stopped."""
QUICK = {"rates": ("100mbit",), "algorithms": ("sync", "diloco"), "steps": 6, "period": 3}


def command(algorithm: str, process_id: int, coordinator: str, out: str, *, steps: int,
            period: int, extra: list[str]) -> list[str]:
  """Process ``process_id``'s ``optax-dist train`` command line."""
  return [sys.executable, "-m", "optax_dist.cli", "train", "--task", "lm", "--algorithm",
          algorithm, "--processes", str(PROCESSES), "--process-id", str(process_id),
          "--coordinator", coordinator, "--devices", str(DEVICES), "--steps", str(steps),
          "--batch-size", str(BATCH), "--sync-period", str(period), "--communication-period",
          str(period), "--eval-every", str(min(EVAL_EVERY, steps)), "--out", out,
          "--no-progress", *extra]


def environment() -> dict[str, str]:
  """This process's environment with this checkout first on ``PYTHONPATH``, no ``XLA_FLAGS``."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  return env


def param_bytes(task_name: str = "lm") -> int:
  """The bytes of ``task_name``'s params (float32), from their shapes."""
  import jax
  import jax.numpy as jnp

  from optax_dist.cli import tasks

  task = tasks.TASKS[task_name]
  data = task.load(0)
  example = {k: jnp.zeros((1,) + v.shape[1:], v.dtype) for k, v in data.train.items()}
  model = task.model()
  shapes = jax.eval_shape(lambda key: task.init_params(model, key, example), jax.random.key(0))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def exchanges(result: dict[str, Any]) -> list[bool]:
  """For each step of ``result`` (a trainer's results), whether it exchanges across workers."""
  from optax_dist.cli.algorithms import ALGORITHMS
  from optax_dist.cli.config import Settings

  algorithm = ALGORITHMS[result["algorithm"]]
  fields = {k: result[k] for k in ("algorithm", "steps", *algorithm.settings) if k in result}
  settings = Settings(**fields)
  flags = [algorithm.communicates(settings, s) for s in range(1, result["steps"] + 1)]
  return [True if f is None else f for f in flags]


def _median(xs: list[float]) -> float | None:
  import statistics

  return statistics.median(xs) if xs else None


def run_once(link: netns.Link, algorithm: str, port: int, out: str, *, steps: int, period: int,
             extra: list[str], timeout: float = TIMEOUT) -> dict[str, Any]:
  """One run over ``link``; its wall-clock, bytes, step times and curve (raises RuntimeError)."""
  os.makedirs(out, exist_ok=True)
  coordinator = f"{link.addresses['a']}:{port}"
  env, logs = environment(), []
  load_before = os.getloadavg()
  before = link.counters()
  start = time.perf_counter()
  procs = []
  for i, side in enumerate("ab"):
    log = open(os.path.join(out, f"process{i}.log"), "w")  # noqa: SIM115
    logs.append(log)
    procs.append(link.popen(side, command(algorithm, i, coordinator, out, steps=steps,
                                          period=period, extra=extra),
                            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
  try:
    deadline = start + timeout
    for p in procs:
      p.wait(timeout=max(deadline - time.perf_counter(), 1))
  except subprocess.TimeoutExpired:
    pass
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for log in logs:
      log.close()
  wall = time.perf_counter() - start
  after = link.counters()
  codes = [p.returncode for p in procs]
  if codes != [0, 0]:
    tails = []
    for i in range(PROCESSES):
      with open(os.path.join(out, f"process{i}.log")) as f:
        last = " / ".join(f.read().strip().splitlines()[-3:])
      tails.append(f"process {i} (exit {codes[i]}): {last}")
    raise RuntimeError(f"{algorithm} at {link.rate}: " + "; ".join(tails))
  with open(os.path.join(out, f"results_{algorithm}.json")) as f:
    result = json.load(f)["algorithms"][algorithm]
  return summarize(result, wall, before, after, load_before, os.getloadavg())


def summarize(result: dict[str, Any], wall: float, before: dict, after: dict,
              load_before: tuple, load_after: tuple) -> dict[str, Any]:
  """The numbers of one run kept in ``network_results.json``."""
  times, flags = result["step_times"], exchanges(result)
  history = result["history"]
  elapsed = [sum(times[:s]) for s in history["step"]]
  # Step 1 is left out of the medians: its first calls set up the collectives.
  exchange = [t for s, (t, f) in enumerate(zip(times, flags)) if f and s > 0]
  local = [t for s, (t, f) in enumerate(zip(times, flags)) if not f and s > 0]
  return {
    "algorithm": result["algorithm"],
    "steps": result["steps"],
    "period": result.get("sync_period", result.get("communication_period", 1)),
    "replicas": result.get("replicas", 1),
    "communication_rounds": result["communication_rounds"],
    "wall_s": wall,
    "trainer_wall_s": result["wall_time_s"],
    "train_s": sum(times),
    "step_times": times,
    "exchange_step_s": _median(exchange),
    "local_step_s": _median(local),
    "bytes_a_to_b": after["a"]["tx_bytes"] - before["a"]["tx_bytes"],
    "bytes_b_to_a": after["b"]["tx_bytes"] - before["b"]["tx_bytes"],
    "curve": {"step": history["step"], "train_s": elapsed,
              "bits_per_byte": history["test_bits_per_byte_eval_params"]},
    "bits_per_byte": result["test_bits_per_byte_eval_params"],
    "load_before": [round(x, 2) for x in load_before],
    "load_after": [round(x, 2) for x in load_after],
  }


def measure(rates: list[str], algorithms: list[str], *, steps: int, period: int,
            extra: list[str], repeats: int = 1, work: str | None = None) -> dict[str, Any]:
  """Every algorithm at every rate over one :class:`netns.Link` (reshaped between rates)."""
  for rate in rates:
    netns.bits_per_second(rate)  # a bad rate fails before anything runs
  result = {"rates": rates, "algorithms": algorithms, "steps": steps, "period": period,
            "processes": PROCESSES, "devices": DEVICES, "batch_size": BATCH, "extra_args": extra,
            "param_bytes": param_bytes(), "load_before": [round(x, 2) for x in os.getloadavg()],
            "achieved_mbit": {}, "runs": []}
  start, port = time.perf_counter(), 12000
  with tempfile.TemporaryDirectory() as tmp, netns.Link() as link:
    for repeat in range(repeats):
      for rate in rates:
        link.shape(rate)
        if rate not in result["achieved_mbit"]:
          result["achieved_mbit"][rate] = {
            "b_to_a": link.measure_rate("b") / 1e6, "a_to_b": link.measure_rate("a") / 1e6}
          print(f"[network] {rate}: achieved {result['achieved_mbit'][rate]['b_to_a']:.1f}"
                f" Mbit/s b->a, {result['achieved_mbit'][rate]['a_to_b']:.1f} a->b", flush=True)
        for algorithm in algorithms:
          port += 1
          out = os.path.join(work or tmp, f"{rate}-{algorithm}-{repeat}")
          run = run_once(link, algorithm, port, out, steps=steps, period=period, extra=extra)
          run |= {"rate": rate, "repeat": repeat}
          result["runs"].append(run)
          print(f"[network] {rate} {algorithm}: {run['wall_s']:.1f} s whole,"
                f" {run['train_s']:.1f} s training, {run['bytes_a_to_b'] / 1e6:.1f} MB a->b,"
                f" {run['bytes_b_to_a'] / 1e6:.1f} MB b->a, {run['bits_per_byte']:.3f}"
                f" bits/byte, load {run['load_after'][0]:.2f}", flush=True)
  result["load_after"] = [round(x, 2) for x in os.getloadavg()]
  result["seconds"] = time.perf_counter() - start
  result["namespaces_left"] = [n for n in netns.namespaces() if n in link.names.values()]
  return result


def _mean(runs: list[dict], key: str) -> float | None:
  values = [r[key] for r in runs if r[key] is not None]
  return sum(values) / len(values) if values else None


def _fmt(x: float | None, spec: str) -> str:
  return "–" if x is None else format(x, spec)


def markdown(result: dict[str, Any], plot_name: str) -> str:
  """The results as a Markdown section: the method, a table, the figure."""
  import _util

  p = result["param_bytes"]
  rows = []
  for rate in result["rates"]:
    achieved = result["achieved_mbit"][rate]
    for algorithm in result["algorithms"]:
      runs = [r for r in result["runs"] if r["rate"] == rate and r["algorithm"] == algorithm]
      if not runs:
        continue
      rounds = runs[0]["communication_rounds"]
      sent = _mean(runs, "bytes_a_to_b")
      rows.append([
        rate, f"{min(achieved.values()):.1f}", algorithm, f"{_mean(runs, 'wall_s'):.1f}",
        f"{_mean(runs, 'train_s'):.1f}", _fmt(_mean(runs, "exchange_step_s"), ".3f"),
        _fmt(_mean(runs, "local_step_s"), ".3f"), str(rounds),
        f"{sent / 1e6:.1f} / {_mean(runs, 'bytes_b_to_a') / 1e6:.1f}",
        f"{sent / p / max(rounds, 1):.2f}", f"{_mean(runs, 'bits_per_byte'):.3f}",
        f"{runs[-1]['load_before'][0]:.1f} → {runs[-1]['load_after'][0]:.1f}"])
  header = ["rate", "achieved Mbit/s (slower way)", "algorithm", "whole run s", "training s",
            "exchange step s", "local step s", "exchanges", "MB a→b / b→a",
            "a→b per exchange / params", "val bits/byte", "load (1 min)"]
  machine = _util.machine()
  extra = f" Extra arguments: `{' '.join(result['extra_args'])}`." if result["extra_args"] else ""
  return "\n".join([
    "## Training over a bandwidth-limited link (two network namespaces)",
    "",
    _util.doc_markdown(__doc__, 1, 2),
    "",
    (f"{result['processes']} processes × {result['devices']} devices, lm task, batch"
     f" {result['batch_size']} per worker, {result['steps']} steps, H = {result['period']};"
     f" params {p / 1e6:.2f} MB (float32). {machine['cores']} CPUs, shared by both processes;"
     f" load average {', '.join(map(str, result['load_before']))} before,"
     f" {', '.join(map(str, result['load_after']))} after; {result['seconds'] / 60:.1f} min."
     f"{extra} Steps' medians leave out step 1; \"per exchange / params\" is the bytes a sent"
     " over the run divided by the exchanges and by the params' bytes (evaluations, start-up and"
     " the coordination service's traffic included; `streaming_diloco` sends one fragment,"
     " about 1/F of the params, per exchange)."),
    "",
    _util.table(header, rows, align="lrlrrrrrrrrr"),
    "",
    f"![validation bits per byte against training seconds, one panel per rate]({plot_name})",
  ])


def plot(result: dict[str, Any], path: str) -> None:
  """Validation bits per byte against training seconds, one panel per rate."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rates = result["rates"]
  fig, axes = plt.subplots(1, len(rates), figsize=(4 * len(rates), 3.5), squeeze=False,
                           sharey=True)
  for ax, rate in zip(axes[0], rates):
    for k, algorithm in enumerate(result["algorithms"]):
      for r in (r for r in result["runs"] if r["rate"] == rate and r["algorithm"] == algorithm):
        ax.plot(r["curve"]["train_s"], r["curve"]["bits_per_byte"], "o-", color=f"C{k}",
                label=algorithm if r["repeat"] == 0 else None, markersize=3)
    achieved = min(result["achieved_mbit"][rate].values())
    ax.set_title(f"{rate} (achieved {achieved:.0f} Mbit/s)", fontsize=9)
    ax.set_xlabel("training seconds (steps only)")
    ax.grid(True, alpha=0.3)
  axes[0][0].set_ylabel("validation bits per byte")
  axes[0][-1].legend(fontsize=7)
  fig.suptitle(f"lm, {result['processes']} processes × {result['devices']} devices, veth pair"
               f" shaped with tbf\n{result['steps']} steps, H = {result['period']}; load"
               f" {result['load_before'][0]:.1f} before, {result['load_after'][0]:.1f} after",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help=f"{', '.join(QUICK['algorithms'])} at {QUICK['rates'][0]},"
                           f" {QUICK['steps']} steps: checks the program only")
  parser.add_argument("--rates", default=None,
                      help=f"comma-separated tc rates or 'unshaped' (default {','.join(RATES)})")
  parser.add_argument("--algorithms", default=None,
                      help=f"comma-separated (default {','.join(ALGORITHMS)})")
  parser.add_argument("--steps", type=int, default=None, help=f"default {STEPS}")
  parser.add_argument("--period", type=int, default=None,
                      help=f"H, steps between the periodic exchanges (default {PERIOD})")
  parser.add_argument("--repeats", type=int, default=1, help="runs of each algorithm at each rate")
  parser.add_argument("--extra-args", default="",
                      help="appended to every run's command line, e.g. --extra-args='--replicas 2'")
  parser.add_argument("--output", default=None,
                      help="PREFIX of PREFIX_results.json, PREFIX.png and PREFIX.md (default"
                           " benchmarks/network; with --quick, a temporary directory)")
  parser.add_argument("--keep-logs", default=None, metavar="DIR",
                      help="keep each run's results and logs under DIR")
  parser.add_argument("--from-json", default=None, metavar="PATH",
                      help="rewrite the figure and the Markdown of PATH's results; runs nothing")
  args = parser.parse_args(argv)
  if args.from_json:
    with open(args.from_json) as f:
      return report(json.load(f), args.output or args.from_json.removesuffix("_results.json"))
  reason = netns.unavailable()
  if reason is not None:
    print(f"[network] skipped: {reason}")
    return 0
  quick = QUICK if args.quick else {}
  rates = args.rates.split(",") if args.rates else list(quick.get("rates", RATES))
  algorithms = (args.algorithms.split(",") if args.algorithms
                else list(quick.get("algorithms", ALGORITHMS)))
  steps = args.steps or quick.get("steps", STEPS)
  period = args.period or quick.get("period", PERIOD)
  output = args.output or (os.path.join(tempfile.mkdtemp(), "network") if args.quick
                           else os.path.join(HERE, "network"))
  netns.remove_stale()
  try:
    result = measure(rates, algorithms, steps=steps, period=period,
                     extra=shlex.split(args.extra_args), repeats=args.repeats,
                     work=args.keep_logs)
  except netns.Unavailable as e:
    print(f"[network] skipped: {e}")
    return 0
  with open(f"{output}_results.json", "w") as f:
    json.dump(result, f, indent=1)
  return report(result, output)


def report(result: dict[str, Any], output: str) -> int:
  """Writes ``OUTPUT.png`` and ``OUTPUT.md`` of ``result`` and prints the Markdown."""
  plot(result, f"{output}.png")
  text = markdown(result, os.path.basename(f"{output}.png"))
  with open(f"{output}.md", "w") as f:
    f.write(text + "\n")
  print(text)
  print(f"[network] wrote {output}.png and {output}.md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
