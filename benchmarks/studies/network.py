"""Training over a real bandwidth-limited link: two processes in two network namespaces.

Each run is ``optax-dist train --task lm --processes 2 --devices 4`` with its two processes in
two network namespaces joined by a veth pair (:mod:`netns`), process 0 (and the coordinator) in
``a``, process 1 in ``b``: every byte the processes exchange (gloo's collectives, JAX's
coordination service) crosses the veth pair, shaped at the rate under test in each direction
with a token bucket (``tc ... tbf``), or unshaped. Every run has the same 8 workers (4 devices
per process, one worker each), the same batch per worker, learning rate, steps and seed; the
periodic algorithms exchange every H steps (``--sync-period H --communication-period H``).
With ``--replicas 2`` (the default) each process holds one replica: the gradients are reduced
inside a process on every step and only the exchanges across replicas cross the link (``sync``
reduces hierarchically, each device sending its 1/4 slice across).

For each run: the wall-clock of the whole command (start-up, compilation and evaluations
included); each step's seconds (the trainer's ``step_times``), split into the steps that
exchange (every step for ``sync``) and those that do not; the bytes each veth sent, read from
its counters before and after, beside the bytes predicted from the compiled steps' collectives
(the trainer's ``collective_bytes``); the validation bits per byte against the training seconds
(the steps' seconds summed up to each evaluation); and, per rate, the rate a timed TCP transfer
achieves in each direction. The runs alternate algorithms within each rate; the load average
is recorded before and after each run.

Needs root and iproute2 (``make bench-network``); says why and exits with 0 otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import sys
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks import kit
from benchmarks.network import netns
from optax_dist.cli import tasks, trainer
from optax_dist.cli.algorithms import ALGORITHMS
from optax_dist.cli.config import Settings

RATES = ("unshaped", "1gbit", "100mbit", "10mbit")
OUTER = ("--outer-learning-rate", "0.7", "--outer-momentum", "0.5")
"""The outer Nesterov SGD of the DiLoCo family here: :func:`outer_sweep`'s best with momentum
with 10 outer steps (200 steps at H = 20), where the papers' momentum 0.9 ends far behind (see
its table)."""
METHODS = {
  "sync": ("sync", ()), "diloco": ("diloco", OUTER),
  "streaming_diloco": ("streaming_diloco", OUTER), "local_sgd": ("local_sgd", ()),
  "elastic_average": ("elastic_average", ()),
  "diloco_int8": ("diloco", (*OUTER, "--comm-dtype", "int8")),
  "diloco_e3m0_feedback": ("diloco", (*OUTER, "--comm-dtype", "e3m0", "--error-feedback")),
  "streaming_diloco_overlap": ("streaming_diloco", (*OUTER, "--overlap", "2")),
  "streaming_diloco_overlap_device": ("streaming_diloco",
                                      (*OUTER, "--overlap", "2", "--exchange-device"))}
"""The methods: a label, and its ``--algorithm`` and command-line flags."""
DEFAULT_METHODS = ("sync", "diloco", "streaming_diloco", "local_sgd", "elastic_average")
"""The methods compared by default; the others (exchange formats, overlap) by ``--methods``."""
SWEEP = ((0.7, 0.9), (0.85, 0.7), (0.7, 0.5), (1.0, 0.0))
"""The (outer learning rate, outer momentum) pairs of :func:`outer_sweep`: the papers' 0.7 and
0.9 first, plain averaging (local SGD's rule) last."""
PROCESSES, DEVICES, STEPS, PERIOD = 2, 4, 200, 20
"""H (PERIOD): the steps between the periodic algorithms' exchanges. At 10 Mbit/s one exchange of
the lm params takes about 1.2 s beside 0.3 s of compute per step on 2 cores: with H = 10 a DiLoCo
step can at best be 1.30 times its unshaped time (measured 1.31), with H = 20 1.15; the final losses
of DiLoCo and streaming DiLoCo hardly differ between the two (3.149, 3.150)."""
REPLICAS, BATCH, EVAL_EVERY, TIMEOUT = 2, 8, 20, 1800
"""TIMEOUT: the seconds a run may take before it is stopped."""
_fmt = functools.partial(kit.fmt, missing="–")
GLOO_OPERAND_BYTES = 576
"""Bytes gloo sends beyond an all-reduce operand's own, per operand and direction between two
processes (``benchmarks/results/probe_link_bytes.json``, with jax 0.10.2's gloo: 12 TCP segments
per operand; XLA combines a tree's leaves into one all-reduce of many operands, and gloo reduces
each apart)."""


def command(algorithm: str, process_id: int, coordinator: str, out: str, *, steps: int,
            period: int, extra: list[str]) -> list[str]:
  return [sys.executable, "-m", "optax_dist.cli", "train", "--task", "lm", "--algorithm",
          algorithm, "--processes", str(PROCESSES), "--process-id", str(process_id),
          "--coordinator", coordinator, "--devices", str(DEVICES), "--steps", str(steps),
          "--batch-size", str(BATCH), "--sync-period", str(period), "--communication-period",
          str(period), "--eval-every", str(min(EVAL_EVERY, steps)), "--out", out,
          "--no-progress", *extra]


def param_bytes() -> int:
  """The bytes of the ``lm`` task's params (float32), from their shapes."""
  task = tasks.TASKS["lm"]
  return kit.tree_bytes(kit.initial_params(task, task.load(0).train))


def settings_of(result: dict[str, Any]) -> Settings:
  return kit.settings(**{f.name: result[f.name] for f in dataclasses.fields(Settings)
                         if f.name in result})


def cross_bytes(by_axes: dict[str, int], operands: dict[str, int],
                framing: int = GLOO_OPERAND_BYTES, pairs: int = DEVICES) -> float:
  """Bytes one process sends the other for one execution of collectives totalling ``by_axes``
  per device and carrying ``operands`` arrays (the trainer's ``collective_bytes`` and its
  ``operands``, keyed by the mesh axes they span).

  Collectives within a process (``data``) send nothing across. Those across the replicas only
  (``replica``) pair each device with one of the other process: a two-rank all-reduce (or
  all-gather) sends its operands' bytes each way, plus ``framing`` bytes per operand (gloo's,
  :data:`GLOO_OPERAND_BYTES`; 0 for the operands' bytes alone), for each of the ``pairs`` device
  pairs (``DEVICES``; 1 for the exchange device's programs of ``--exchange-device``). Those over
  every worker (``replica,data`` or ``workers``) are taken as one ring over all :math:`n` devices,
  which crosses once each way carrying :math:`2(n-1)/n` of the bytes.
  """
  n, total = PROCESSES * DEVICES, 0.0
  for key, b in by_axes.items():
    axes = key.split(",")
    if axes == ["replica"]:
      total += pairs * (b + framing * operands[key])
    elif "replica" in axes or "workers" in axes:
      total += 2 * (n - 1) / n * b
  return total


def predicted_bytes(result: dict[str, Any], framing: int = GLOO_OPERAND_BYTES) -> float:
  """Bytes one process sends the other over the run (:func:`cross_bytes` summed by
  :func:`benchmarks.kit.run_bytes`; an exchange program of ``--exchange-device``: one pair)."""
  return kit.run_bytes(result, settings_of(result), lambda by_axes, operands, exchange: cross_bytes(
    by_axes, operands, framing, pairs=1 if exchange else DEVICES))[-1]


def run_once(link: netns.Link, algorithm: str, port: int, out: str, *, steps: int, period: int,
             extra: list[str]) -> dict[str, Any]:
  """One run over ``link``; its wall-clock, bytes, step times and curve (raises RuntimeError)."""
  os.makedirs(out, exist_ok=True)
  coordinator, load_before, before = f"{link.addresses['a']}:{port}", _load(), link.counters()
  start = time.perf_counter()
  link.run_pair([command(algorithm, i, coordinator, out, steps=steps, period=period, extra=extra)
                 for i in range(PROCESSES)], out, TIMEOUT, what=algorithm)
  wall, after = time.perf_counter() - start, link.counters()
  result = kit.read_json(os.path.join(out, f"results_{algorithm}.json"))["algorithms"][algorithm]
  times, history = result["step_times"], result["history"]
  s = settings_of(result)  # whether each step exchanges across workers:
  flags = [ALGORITHMS[s.algorithm].communicates(s, t) in (None, True)
           for t in range(1, s.steps + 1)]
  # Step 1 is left out of the medians: its first calls set up the collectives.
  exchange, local = ([t for t, f in zip(times[1:], flags[1:]) if f is k] for k in (True, False))
  counted = {f"{kind}_{x}_to_{y}": after[x][f"tx_{kind}"] - before[x][f"tx_{kind}"]
             for kind in ("bytes", "packets") for x, y in ("ab", "ba")}
  return {
    "algorithm": result["algorithm"], "steps": result["steps"],
    "period": result.get("sync_period", result.get("communication_period", 1)),
    "replicas": result.get("replicas", 1), "communication_rounds": result["communication_rounds"],
    "wall_s": wall, "trainer_wall_s": result["wall_time_s"], "train_s": sum(times),
    "step_times": times, "exchange_step_s": _median_of(exchange), "local_step_s": _median_of(local),
    **counted, "predicted_bytes": predicted_bytes(result),
    "operand_bytes": predicted_bytes(result, framing=0),
    "collective_bytes": result["collective_bytes"],
    "curve": {"step": history["step"], "train_s": [sum(times[:s]) for s in history["step"]],
              "bits_per_byte": history["test_bits_per_byte_eval_params"]},
    "bits_per_byte": result["test_bits_per_byte_eval_params"],
    "load_before": load_before, "load_after": _load()}


def outer_sweep(*, steps: int, period: int, extra: list[str]) -> list[dict[str, Any]]:
  """DiLoCo's final validation bits per byte for each outer (learning rate, momentum) of
  :data:`SWEEP`, trained in this process over ``PROCESSES * DEVICES`` devices (the losses do not
  depend on the link or on how the devices split into processes)."""
  runs, task = [], tasks.TASKS["lm"]
  data = task.load(0)
  for lr, momentum in SWEEP:
    s = kit.settings(extra, algorithm="diloco", devices=PROCESSES * DEVICES, steps=steps,
                     batch_size=BATCH, sync_period=period, eval_every=min(EVAL_EVERY, steps),
                     outer_learning_rate=lr, outer_momentum=momentum)
    bits = trainer.train(task, data, s)["test_bits_per_byte_eval_params"]
    runs.append({"outer_learning_rate": lr, "outer_momentum": momentum, "bits_per_byte": bits})
    print(f"[network] outer sweep lr {lr} momentum {momentum}: {bits:.4f} bits/byte", flush=True)
  return runs


def _load() -> list[float]:
  return [round(x, 2) for x in os.getloadavg()]


def payload(run: dict[str, Any], side: str = "a") -> float:
  """TCP payload bytes ``side`` sent: the veth's bytes less the headers of its packets."""
  to = f"{side}_to_{'b' if side == 'a' else 'a'}"
  return run[f"bytes_{to}"] - netns.FRAME_OVERHEAD * run[f"packets_{to}"]


def time_to(run: dict[str, Any], target: float) -> float | None:
  """Training seconds to ``target`` validation bits per byte (:func:`benchmarks.kit.reach`)."""
  return (at := kit.reach(run["curve"]["bits_per_byte"], target, run["curve"]["train_s"])) and at[0]


def loss_at(run: dict[str, Any], budget: float) -> float:
  """Validation bits per byte at the last evaluation within ``budget`` training seconds."""
  curve = run["curve"]
  within = [y for t, y in zip(curve["train_s"], curve["bits_per_byte"]) if t <= budget]
  return within[-1] if within else curve["bits_per_byte"][0]


def _runs(result: dict[str, Any], rate: str, method: str) -> list[dict]:
  return [r for r in result["runs"] if r["rate"] == rate and r["method"] == method]


def _cells(result: dict[str, Any]) -> list[tuple[str, str, list[dict]]]:
  """``(rate, method, its runs)`` of each rate and method that has runs."""
  return [(rate, method, runs) for rate in result["rates"] for method in result["methods"]
          if (runs := _runs(result, rate, method))]


def _median_of(runs: list, fn: Any = lambda x: x) -> float | None:
  """The median of ``fn`` (a function, or a key) over ``runs``, ``None`` values left out."""
  values = [v for v in (r[fn] if isinstance(fn, str) else fn(r) for r in runs) if v is not None]
  return kit.median(values) if values else None


def target_loss(result: dict[str, Any]) -> float:
  """The highest final validation bits per byte among the unshaped runs (every method reaches
  it); among the first rate's runs if there is no unshaped one."""
  rate = "unshaped" if "unshaped" in result["rates"] else result["rates"][0]
  return max(r["bits_per_byte"] for r in result["runs"] if r["rate"] == rate)


def measurements_table(result: dict[str, Any]) -> str:
  """Every run's wall-clock, step times, bytes and final loss (medians over repeats)."""
  p, rows = result["param_bytes"], []
  for rate, method, runs in _cells(result):
    rounds, med = max(runs[0]["communication_rounds"], 1), functools.partial(_median_of, runs)
    spread = max(r["train_s"] for r in runs) - min(r["train_s"] for r in runs)
    rows.append([
      rate, f"{min(result['achieved_mbit'][rate].values()):.1f}", method, f"{med('wall_s'):.1f}",
      f"{med('train_s'):.1f}" + (f" ± {spread / 2:.1f}" if len(runs) > 1 else ""),
      _fmt(med("exchange_step_s"), ".3f"), _fmt(med("local_step_s"), ".3f"),
      str(runs[0]["communication_rounds"]), f"{med('predicted_bytes') / 1e6:.1f}",
      f"{med(payload) / 1e6:.1f}", f"{med(payload) / med('predicted_bytes'):.3f}",
      f"{med('operand_bytes') / rounds / p:.3f}", f"{med('bits_per_byte'):.3f}",
      f"{runs[-1]['load_before'][0]:.1f} → {runs[-1]['load_after'][0]:.1f}"])
  header = ["rate", "achieved Mbit/s", "method", "whole run s", "training s",
            "exchange step s", "local step s", "exchanges", "predicted MB a→b",
            "payload MB a→b", "payload / predicted", "operands per exchange / params",
            "val bits/byte", "load (1 min)"]
  return kit.table(header, rows, "lrlrrrrrrrrrrr")


def _own_unshaped(result: dict[str, Any], rate: str, method: str) -> float | None:
  """``method``'s median training seconds at ``rate`` over its own unshaped ones."""
  unshaped = _median_of(_runs(result, "unshaped", method), "train_s")
  return _median_of(_runs(result, rate, method), "train_s") / unshaped if unshaped else None


def _speedup(result: dict[str, Any], rate: str, method: str, target: float) -> float | None:
  """Sync's median training seconds to ``target`` at ``rate`` over ``method``'s."""
  sync, reach = (_median_of(_runs(result, rate, m), lambda r: time_to(r, target))
                 for m in ("sync", method))
  return sync / reach if sync and reach else None


def summary_table(result: dict[str, Any]) -> str:
  """Per rate and method: time to the target loss, speed-up over sync, the loss at sync's
  training time, and the training time over the method's own unshaped time."""
  target = target_loss(result)
  rows = [[rate, method, _fmt(_median_of(runs, lambda r: time_to(r, target)), ".1f"),
           _fmt(_speedup(result, rate, method, target), ".2f"),
           _fmt(_median_of(runs, lambda r: loss_at(r, budget)) if budget else None, ".3f"),
           _fmt(_own_unshaped(result, rate, method), ".2f")]
          for rate, method, runs in _cells(result)
          for budget in [_median_of(_runs(result, rate, "sync"), "train_s")]]
  header = ["rate", "method", f"training s to {target:.3f} bits/byte", "speed-up over sync",
            "bits/byte at sync's training s", "training s / own unshaped"]
  return kit.table(header, rows, "llrrrr")


def sensitivity_table(result: dict[str, Any], levels: int = 5) -> str:
  """The speed-up over sync at the slowest rate for other target losses: ``levels`` of them
  evenly spaced from :func:`target_loss` down to the lowest final loss of the unshaped runs
  other than sync's (where the best of them ends, at its last evaluation)."""
  rate = result["rates"][-1]
  unshaped = "unshaped" if "unshaped" in result["rates"] else result["rates"][0]
  lowest = min(r["bits_per_byte"] for r in result["runs"]
               if r["rate"] == unshaped and r["method"] != "sync")
  methods = [m for m in result["methods"] if m != "sync" and _runs(result, rate, m)]
  sync = _runs(result, rate, "sync")
  rows = [[f"{loss:.3f}", _fmt(_median_of(sync, lambda r: time_to(r, loss)), ".1f"),
           *(_fmt(_speedup(result, rate, m, loss), ".2f") for m in methods)]
          for loss in np.linspace(target_loss(result), lowest, levels).tolist()]
  header = ["target bits/byte", f"sync's training s at {rate}", *methods]
  return kit.table(header, rows, "r" * len(header))


def targets(result: dict[str, Any]) -> list[str]:
  lines, target, p = [], target_loss(result), result["param_bytes"]

  def check(ok: bool | None, text: str) -> None:
    lines.append(f"- {'n/a' if ok is None else 'met' if ok else 'MISSED'}: {text}")

  slow = "10mbit"  # no runs there: no target of it
  for method in (m for m in ("diloco", "streaming_diloco") if _runs(result, slow, m)):
    speedup = _speedup(result, slow, method, target)
    check(None if speedup is None else speedup >= 3,
          f"{method} reaches {target:.3f} bits/byte at 10 Mbit/s"
          f" {_fmt(speedup, '.2f')}× sooner than sync (target ≥ 3×)")
    ratio = _own_unshaped(result, slow, method)
    check(None if ratio is None else ratio <= 1.3,
          f"{method}'s training time at 10 Mbit/s is {_fmt(ratio, '.2f')}× its unshaped"
          " time (target ≤ 1.3×)")
  for method, bound, what in (("sync", 1.1, "a step"), ("diloco", 1.1, "an exchange")):
    if runs := [r for r in result["runs"] if r["method"] == method]:
      rounds = max(runs[0]["communication_rounds"], 1)
      per, measured = (_median_of(runs, key) / rounds / p for key in ("operand_bytes", payload))
      check(per <= bound, f"{method}: {what} sends {per:.3f}× the params' bytes each way (the"
            " operands of the compiled collectives; the veth payload over the whole run, gloo's"
            f" framing, start-up and evaluations included, {measured:.3f}×; target ≤ {bound}×)")
  for method, (_, flags) in result["methods"].items():
    if "--comm-dtype" not in flags or not (base := _runs(result, slow, "diloco")):
      continue
    fmt, runs = flags[list(flags).index("--comm-dtype") + 1], _runs(result, slow, method)
    wire = _median_of(runs, payload) / _median_of(base, payload)
    operands = _median_of(runs, "operand_bytes") / _median_of(base, "operand_bytes")
    bound = {"int8": 0.26, "e3m0": 0.135, "float4_e2m1fn": 0.135}.get(fmt)
    check(None if bound is None else wire <= bound,
          f"{method}: the veth payload at 10 Mbit/s is {wire:.3f}× float32 diloco's (the compiled"
          f" exchanges' operands {operands:.3f}×; codes and scales: target ≤ {bound}×)")
  if ratios := [payload(r) / r["predicted_bytes"] for r in result["runs"] if r["predicted_bytes"]]:
    worst = max(ratios, key=lambda x: abs(x - 1))
    check(abs(worst - 1) <= 0.05,
          f"veth payload a→b within {abs(worst - 1):.1%} of the prediction in the worst run"
          f" (median {_median_of(ratios):.3f}×; target within 5%)")
  return lines


def markdown(result: dict[str, Any], plot_name: str) -> str:
  p, machine = result["param_bytes"], kit.machine()
  extra = f" Arguments: `{' '.join(result['extra_args'])}`." if result["extra_args"] else ""
  return kit.blocks(
    "## Training over a bandwidth-limited link (two network namespaces)",
    kit.doc_markdown(__doc__, 1, 2),
    (f"{result['processes']} processes × {result['devices']} devices, lm task, batch"
     f" {result['batch_size']} per worker, {result['steps']} steps, H = {result['period']};"
     f" params {p / 1e6:.2f} MB (float32). {machine['cores']} CPUs, shared by both processes;"
     f" load average {', '.join(map(str, result['load_before']))} before,"
     f" {', '.join(map(str, result['load_after']))} after; {result['seconds'] / 60:.1f} min."
     f"{extra} Steps' medians leave out step 1. *Predicted*: the bytes process 0 sends process 1"
     " over the steps, from the compiled steps' collectives (`cross_bytes`: their operands'"
     f" bytes and gloo's {GLOO_OPERAND_BYTES} bytes per operand); *operands*: those bytes"
     " without gloo's; *payload*: the veth's bytes less 66 bytes of headers per packet, the whole"
     " run (start-up, evaluations and the coordination service included); `streaming_diloco`"
     " sends one fragment, about 1/F of the params, per exchange."),
    "Methods (label: algorithm and flags): " + "; ".join(
      f"{m}: `--algorithm {a}{''.join(' ' + x for x in flags)}`"
      for m, (a, flags) in result["methods"].items()) + ".",
    *[f"Note: {note}" for note in result.get("notes", [])], measurements_table(result),
    (f"Time to loss: the target is the highest final validation loss of the unshaped runs,"
     f" {target_loss(result):.3f} bits/byte; training seconds are the steps' own (start-up,"
     " compilation and evaluations left out)."), summary_table(result),
    *([(f"The speed-up over sync at {result['rates'][-1]} for other targets, from the one above"
        " down to the lowest final loss of the other unshaped runs ('–': not reached):"),
       sensitivity_table(result)] if _runs(result, result["rates"][-1], "sync") else []),
    "Targets:", "\n".join(targets(result)),
    *([(f"DiLoCo's outer optimizer at this budget ({result['steps'] // result['period']} outer"
        " steps; one process, unshaped, the same losses as over the link): the final validation"
        " loss for each outer learning rate and Nesterov momentum. The DiLoCo family above runs"
        f" `{' '.join(OUTER)}`."),
       kit.table(["outer learning rate", "outer momentum", "final val bits/byte"],
                 [[f"{r['outer_learning_rate']:g}", f"{r['outer_momentum']:g}",
                   f"{r['bits_per_byte']:.4f}"] for r in result["outer_sweep"]], "rrr")]
      if result.get("outer_sweep") else []),
    f"![validation bits per byte against training seconds, one panel per rate]({plot_name})")


def plot(result: dict[str, Any], path: str) -> None:
  rates = result["rates"]
  fig, axes = kit.plt.subplots(1, len(rates), figsize=(4 * len(rates), 3.5), squeeze=False,
                           sharey=True)
  for ax, rate in zip(axes[0], rates):
    for k, method in enumerate(result["methods"]):
      for r in _runs(result, rate, method):
        ax.plot(r["curve"]["train_s"], r["curve"]["bits_per_byte"], "o-", color=f"C{k}",
                label=method if r["repeat"] == 0 else None, markersize=3)
    achieved = min(result["achieved_mbit"][rate].values())
    ax.set_title(f"{rate} (achieved {achieved:.0f} Mbit/s)", fontsize=9)
    ax.set_xlabel("training seconds (steps only)")
    ax.axhline(target_loss(result), color="grey", lw=0.8, ls=":")
  # The first evaluation (step 0, about 9 bits per byte) is off the top: the end is what differs.
  finals = [r["curve"]["bits_per_byte"][-1] for r in result["runs"]]
  axes[0][0].set_ylim(min(finals) - 0.1, target_loss(result) + 1.0)
  axes[0][0].set_ylabel("validation bits per byte (dotted: the target)")
  axes[0][-1].legend(fontsize=7)
  kit.save_figure(fig, path, f"lm, {result['processes']} processes × {result['devices']}"
                             f" devices, veth pair shaped with tbf\n{result['steps']} steps, H ="
                             f" {result['period']}; load {result['load_before'][0]:.1f} before,"
                             f" {result['load_after'][0]:.1f} after", grid=True)


@dataclasses.dataclass(frozen=True)
class Config:
  rates: tuple[str, ...] = kit.option(RATES, "tc rates or 'unshaped'")
  methods: tuple[str, ...] = kit.option(DEFAULT_METHODS, f"of {', '.join(METHODS)}")
  steps: int = kit.option(STEPS, "training steps of every run")
  period: int = kit.option(PERIOD, "H, steps between the periodic exchanges")
  repeats: int = kit.option(1, "runs of each method at each rate")
  extra_args: str = kit.option(f"--replicas {REPLICAS}", "appended to every run's command line"
                               " ('' for one worker per device)")
  no_outer_sweep: bool = kit.option(False, "skip the outer-optimizer sweep before the DiLoCo"
                                    " family")
  keep_logs: str | None = kit.option(None, "keep each run's results and logs under DIR",
                                     metavar="DIR")
  note: str | None = kit.option(None, "with --report: add this note on the runs (e.g. what else"
                                " ran on the machine) to the result, shown above the measurements")


QUICK = {"rates": ("100mbit",), "methods": ("sync", "diloco"), "steps": 6, "period": 3}


def measure(config: Config, prefix: str) -> dict[str, Any] | None:
  """Every method of ``--methods`` at every rate over one fresh :class:`netns.Link` (reshaped
  between rates), after :func:`outer_sweep` unless ``--no-outer-sweep`` or no method of the
  DiLoCo family is among them; or ``None`` (having said why) without a link."""
  for rate in config.rates:
    netns.bits_per_second(rate)  # a bad rate fails before anything runs
  if unknown := [m for m in config.methods if m not in METHODS]:
    raise ValueError(f"--methods: {unknown[0]!r} is not one of {', '.join(METHODS)}")
  if reason := netns.unavailable():
    print(f"[network] skipped: {reason}")
    return None
  netns.remove_stale()
  steps, period, extra = config.steps, config.period, shlex.split(config.extra_args)
  result = {"rates": list(config.rates), "methods": {m: METHODS[m] for m in config.methods},
            "steps": steps, "period": period, "processes": PROCESSES, "devices": DEVICES,
            "batch_size": BATCH, "extra_args": extra, "param_bytes": param_bytes(),
            "load_before": _load(), "achieved_mbit": {}, "runs": []}
  start, port = time.perf_counter(), 12000
  if not config.no_outer_sweep and {"diloco", "streaming_diloco"} & set(config.methods):
    result["outer_sweep"] = outer_sweep(steps=steps, period=period, extra=extra)
  try:
    with tempfile.TemporaryDirectory() as tmp, netns.Link() as link:
      for repeat in range(config.repeats):
        for rate in config.rates:
          link.shape(rate)
          if rate not in result["achieved_mbit"]:
            achieved = result["achieved_mbit"][rate] = {"b_to_a": link.measure_rate("b") / 1e6,
                                                         "a_to_b": link.measure_rate("a") / 1e6}
            print(f"[network] {rate}: achieved {achieved['b_to_a']:.1f} Mbit/s b->a,"
                  f" {achieved['a_to_b']:.1f} a->b", flush=True)
          for method in config.methods:
            port += 1
            algorithm, flags = METHODS[method]
            out = os.path.join(config.keep_logs or tmp, f"{rate}-{method}-{repeat}")
            run = run_once(link, algorithm, port, out, steps=steps, period=period,
                           extra=[*flags, *extra])
            run |= {"rate": rate, "repeat": repeat, "method": method}
            result["runs"].append(run)
            print(f"[network] {rate} {method}: {run['wall_s']:.1f} s whole,"
                  f" {run['train_s']:.1f} s training, {run['bytes_a_to_b'] / 1e6:.1f} MB a->b,"
                  f" {run['bytes_b_to_a'] / 1e6:.1f} MB b->a, {run['bits_per_byte']:.3f}"
                  f" bits/byte, load {run['load_after'][0]:.2f}", flush=True)
  except netns.Unavailable as e:
    print(f"[network] skipped: {e}")
    return None
  return result | {"load_after": _load(), "seconds": time.perf_counter() - start,
                   "namespaces_left": [n for n in netns.namespaces() if n in link.names.values()]}


def load(prefix: str, config: Config) -> dict[str, Any]:
  """The saved result, with ``config.note`` added to its notes."""
  result = kit.read_json(f"{prefix}.json")
  if config.note:
    result["notes"] = [*result.get("notes", []), config.note]
  return result
