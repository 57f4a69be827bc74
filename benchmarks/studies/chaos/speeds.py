"""The chaos study's speeds mode (``--speeds``, ``make bench-decoupled``): decoupled rounds over
torchft when the replicas' speeds differ.

Replica ``i`` of a run is capped at ``--cpus / 2`` times ``speeds[i] / sum(speeds)`` CPUs (a cgroup,
CFS period 20 ms) once ready, its transport threads (exchange, torchft, gloo: ``runs.FREE_THREADS``)
left beside the launcher and Lighthouse unless ``--cap-threads``; its inner step alone under its
cap, ``t_i``, gives its speed's share ``(1 / t_i) / sum_j (1 / t_j)``, checked within ±10% of the
ratio's. Per seed the arms in turn (reversed every other seed), each a control beside a second run
(``--speed-faults``: under the study's fault schedule): synchronous rounds, and ``--decoupled
--min-quorum 1 --grace-window W`` for each of ``--windows``. From the replicas' JSONL logs over a
run's span (first commit to last): the compute utilization ``sum_i steps_i t_i / (span R)``
(``steps_i``: replica ``i``'s inner steps at its boundaries in the span), and the same until the
first replica's last boundary (its loop returned: from there on the others finish their last rounds
alone); each replica's wait per boundary (a decoupled boundary's ``waited``, from its push to its
pull, 0 where it pushed nothing; a synchronous line's ``exchange_seconds``, with the end of the
steps JAX dispatched ahead); its median inner step; the training loss (the mean of the last R
committed lines') and where it reaches the synchronous control's final one.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import jax
import numpy as np

from benchmarks import kit
from benchmarks.network import faults as inflicted
from benchmarks.studies.chaos import runs, schedule
from benchmarks.studies.chaos.accounting import accounting as over_span
from benchmarks.studies.chaos.accounting import figures, final_metric
from optax_dist.cli import ft_flags, ft_task
from optax_dist.cli.main import build_parser
from optax_dist.cli.tasks import TASKS
from optax_dist.fault_tolerance.rundir import by_round

TOLERANCE = 0.1  # a replica's measured speed within this of its share of the ratio


def solo_seconds(config: dict[str, Any], replica: int, group: str, rounds: int) -> float:
  """Replica ``replica``'s median seconds per inner step, alone: its task, compiled, then this
  process moved into the cgroup ``group`` ("": none), ``rounds`` rounds of ``H`` steps timed,
  each ended by a read of its loss (as a round's boundary reads them)."""
  c = runs.Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()})
  args = build_parser().parse_args(runs.command(c, "solo")[3:])
  ft_flags.resolve(args)
  data = (task := TASKS[args.task]).load(args.seed)
  s = ft_task.settings(args, task, lambda: data)
  params, loss_and_grad, batch_fn, _, _ = ft_task.task_engine(task, data, s, args.replicas)
  protocol, loss_grads = ft_task.protocol(s), jax.jit(loss_and_grad)
  state, times = (params, protocol.tx_init(params)), []
  for r in range(rounds + 1):  # round 0 compiles
    if r == 1 and group:
      pathlib.Path(group, "cgroup.procs").write_text(str(os.getpid()))
    start, losses = time.perf_counter(), []
    for step in range(r * c.sync_period, (r + 1) * c.sync_period):
      loss, grads = loss_grads(state[0], batch_fn(s.seed, replica, step))
      state = protocol.inner_step(*state, grads)
      losses.append(loss)
    jax.device_get(losses)
    times.append((time.perf_counter() - start) / c.sync_period)
  return float(np.median(times[1:]))


def calibrate(config: runs.Config, rounds: int = 5) -> dict[str, Any]:
  """:func:`solo_seconds` of every replica at once, each process in its own group (its cap):
  ``t_solo`` by replica, its speed's share of the replicas' (``1 / t_i`` over their sum) and
  whether it is within :data:`TOLERANCE` of ``speeds[i] / sum(speeds)``."""
  cfg = json.loads(json.dumps(dataclasses.asdict(config)))
  with inflicted.CpuShares(config.replicas, config.cpus / 2, "k", config.speeds,
                           runs.SPEEDS_PERIOD_US) as shares:
    code = ("from optax_dist.cli.processes import init_jax; init_jax(1)\n"  # a replica's device
            "from benchmarks.studies.chaos import speeds; print(speeds.solo_seconds({}))")
    procs = [subprocess.Popen([sys.executable, "-c", code.format(f"{cfg!r}, {i}, '{g}', {rounds}")],
                              stdout=subprocess.PIPE)
             for i, g in enumerate(shares.groups or [""] * config.replicas)]
    try:
      t = [float(p.communicate()[0].split()[-1]) for p in procs]
    finally:
      for p in procs:
        p.kill()
        p.wait()
  share = np.reciprocal(t) / np.sum(np.reciprocal(t))
  expected = np.asarray(config.speeds) / sum(config.speeds)
  return {"t_solo": t, "share": share.tolist(), "expected": expected.tolist(),
          "caps": (expected * config.cpus / 2).tolist(),
          "within": (abs(share / expected - 1) <= TOLERANCE).tolist()}


def arms(config: runs.Config) -> list[tuple[str, runs.Config]]:
  """The arms: synchronous rounds, then ``--decoupled --min-quorum 1 --grace-window W`` per
  ``windows`` (``decoupled_steps`` steps), no checkpoints, a minute's ``--finish-grace``."""
  base = dataclasses.replace(config, checkpoint_every=0, decoupled=None,
                             finish_grace=max(config.finish_grace, 60.0))
  steps = config.decoupled_steps or config.replicas * config.steps
  return [("sync", base)] + [(f"k1_w{w:g}", dataclasses.replace(base, decoupled=w, steps=steps))
                             for w in config.windows]


def run_seed(config: runs.Config, seed: int, prefix: str) -> tuple[dict[str, Any], dict]:
  """Seed ``seed``'s arms (:func:`arms`, reversed for an odd seed), each a control beside a
  second run (``speed_faults``: faulted) in ``PREFIX_runs/seed<SEED>/<ARM>{_control,}``, then
  for each K = 1 arm an equal-speed synchronous run alone (speeds all 1, the pair's CPUs) of
  its control's committed tokens (``<ARM>_equal_tokens``): ``{"order": [...]}``, the records."""
  order, found = arms(config)[::-1 if seed % 2 else 1], {}
  faults = schedule.schedule(seed, config.fault_rate, config.timeout, config.replicas, tuple(
    config.stop_seconds), tuple(config.link_seconds)) if config.speed_faults else []
  for name, c in order:
    found[f"{name}_control"], found[name] = runs.records(
      c, prefix, (f"seed{seed}/{name}_control", f"seed{seed}/{name}"), lambda out: runs.together(
        [runs.FaultTolerantRun(c, out[0], [], c.cpus / 2, "c", seed),
         runs.FaultTolerantRun(c, out[1], faults, c.cpus / 2, "f", seed)], c.timeout))
  per_round = config.replicas * max(x["tokens"] for x in found["sync_control"]["lines"])
  for name, c in arms(config)[1:]:
    tokens = sum(x["weight"] for x in found[f"{name}_control"]["lines"] if x["committed"])
    e = dataclasses.replace(arms(config)[0][1], speeds=(1.0,) * config.replicas, steps=max(
      1, round(tokens / per_round)) * config.sync_period)
    (found[f"{name}_equal_tokens"],) = runs.records(
      e, prefix, (f"seed{seed}/{name}_equal_tokens",), lambda out, e=e: runs.together(
        [runs.FaultTolerantRun(e, out[0], [], e.cpus / 2, "e", seed)], e.timeout))
  return {"order": [name for name, _ in order]}, found


def accounting(run: dict[str, Any], t_solo: list[float], sync_period: int) -> dict[str, Any]:
  """A run's figures over its span, first commit ``t0`` to last (the module's docstring)."""
  lines, t0, replicas = run["lines"], run["t0"], len(t_solo)
  committed = [x for x in lines if x["committed"]]
  span = max(x["time"] for x in committed) - t0
  merges = [group[0] for group in by_round(committed).values()]
  stale = collections.Counter(p[3] for x in merges for p in x.get("payloads", []) if p[5]) or {
    0: sum(len(x.get("members", ())) for x in merges)}  # synchronous: every member's, fresh
  if run["boundaries"]:  # each replica's boundaries, not a Revert line (it has their "at" too):
    mine = {i: [(b["pushed"] + b["waited"], b["waited"]) if "waited" in b else (b["at"], 0.0)
                for b in run["boundaries"] if b["replica"] == i and "landed" in b
                and ("waited" in b or "at" in b)] for i in range(replicas)}  # (end, wait)
  else:
    mine = {i: [(x["time"], x["exchange_seconds"]) for x in lines if x["replica"] == i]
            for i in range(replicas)}
  def utilization(until: float) -> float:  # over (t0, until]: the boundaries ended in it
    steps = [sync_period * sum(t0 < end <= until for end, _ in mine[i]) for i in mine]
    return sum(np.multiply(steps, t_solo)) / ((until - t0) * replicas)
  first_stop = min((max(end for end, _ in got) for got in mine.values() if got), default=0)
  waits = {i: [w for end, w in got if t0 < end <= t0 + span] for i, got in mine.items()}
  inner = {i: [(b[0] - b[1] - a[0]) / sync_period for a, b in itertools.pairwise(got)]
           for i, got in mine.items()}
  done = sorted((x["time"] - t0, x["loss"]) for x in committed if x["loss"] is not None)
  smooth = [[t, float(np.mean([v for _, v in done[k + 1 - replicas:k + 1]]))]
            for k, (t, _) in enumerate(done) if k + 1 >= replicas]
  return {
    "span_s": span, "utilization": utilization(t0 + span), "steady_utilization": utilization(
      first_stop) if t0 < first_stop <= t0 + span else None,
    "tokens_per_s": sum(x["weight"] for x in committed if t0 < x["time"]) / span,
    "partial_share": float(np.mean([sum(p[5] for p in x["payloads"]) < replicas
                                    if "payloads" in x else len(x["members"]) < replicas
                                    for x in merges])),
    "staleness": {str(k): v for k, v in sorted(stale.items())},
    "wait_s": [[float(np.percentile(w, q)) for q in (50, 99, 100)] if w else None
               for w in waits.values()],
    "inner_step_s": [float(np.median(v)) if v else None for v in inner.values()],
    "final": final_metric(run["final"]), "loss_curve": smooth[::max(1, len(smooth) // 400)],
    "final_loss": smooth[-1][1] if smooth else None,
    **{k: run[k] for k in ("status", "wall_s", "load_before", "load_after")}}


def result(study: dict[str, Any], records: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """Every run's :func:`accounting` (``failed``: the runs that committed no round, without); per
  seed each run's ``reach`` of the synchronous control's final loss over that control's span;
  with ``speed_faults`` each faulted run's ``faults``: the chaos figures over its control's span."""
  cfg, calibration, seeds = study["config"], study["calibration"], {}
  for seed, found in records.items():
    failed = sorted(k for k, r in found.items() if not any(x["committed"] for x in r["lines"]))
    got = {k: accounting(r, calibration["t_solo"], cfg["sync_period"]) for k, r in found.items()
           if k not in failed}
    sync = got["sync_control"]
    for a in got.values():
      curve = np.array(a["loss_curve"] or [[0.0, np.inf]])
      hit = kit.reach(curve[:, 1], sync["final_loss"], curve[:, 0])
      a["reach"] = None if hit is None else hit[0] / sync["span_s"]
    for k in [k for k in got if f"{k}_control" in got and cfg["speed_faults"]]:
      c = found[f"{k}_control"]  # over its span: a faulted run that stopped may end early
      span = max(x["time"] for x in c["lines"]) - c["t0"]
      got[k]["faults"] = figures(over_span(found[k], span), over_span(c, span), span)
    seeds[seed] = {"order": study["seeds"][seed]["order"], "runs": got, "failed": failed}
  return {"config": cfg, "calibration": calibration, "seeds": seeds}


ROWS = (  # each run's table: a label, its cell from the run's figures
  ("compute utilization", lambda a: f"{a['utilization']:.3f}"),
  ("compute utilization until the first loop returned", lambda a: kit.fmt(a.get(
    "steady_utilization"), ".3f")),
  ("committed tokens per second", lambda a: f"{a['tokens_per_s']:,.0f}"),
  ("committed merges of fewer than R payloads", lambda a: f"{a['partial_share']:.1%}"),
  ("merged payloads by staleness", lambda a: ", ".join(f"{k}: {v}" for k, v in a[
    "staleness"].items())),
  ("wait per round p50 / p99 / max (s), by replica", lambda a: "; ".join(
    " / ".join(f"{x:.2f}" for x in w or []) for w in a["wait_s"])),
  ("median inner step (s), by replica", lambda a: ", ".join(
    kit.fmt(t, ".3f") for t in a["inner_step_s"])),
  ("final validation metric / training loss", lambda a: kit.fmt(a["final"], ".4f") + " / "
   + kit.fmt(a["final_loss"], ".4f")),
  ("reaches the sync control's final loss at (its span's)", lambda a: kit.fmt(a["reach"], ".2f")),
  ("faulted: goodput; applied faults; lost per fault (s); hash mismatches", lambda a: "; ".join([
    f"{(f := a['faults'])['goodput']:.3f}", ", ".join(f"{k} {v}" for k, v in f["applied"].items()),
    kit.fmt(f["lost_per_fault_s"], ".2f"), str(f["hash_mismatches"])]) if "faults" in a else "—"),
  ("span (s); exit status, wall clock (s), load", lambda a: f"{a['span_s']:.0f}; {a['status']},"
   f" {a['wall_s']:.0f}, {kit.loads(a['load_before'], a['load_after'])}"))


def targets(got: dict[str, Any], windows: list[float]) -> list[str]:
  """Each windowed arm's control against the synchronous control: utilization >= 0.95, the
  sync control's final loss within half its span, wait p99 <= the window; each K = 1 arm's
  control's final validation metric within 1% of its equal-tokens run's; met or missed."""
  out = []
  for w in (w for w in windows if {f"k1_w{w:g}_equal_tokens", f"k1_w{w:g}_control"} <= set(got)):
    a, e = got[f"k1_w{w:g}_control"]["final"], got[f"k1_w{w:g}_equal_tokens"]["final"]
    out.append(f"- K = 1, W = {w:g} s: final validation metric {kit.fmt(a, '.4f')} within 1% of"
               f" the equal-speed synchronous run's at equal tokens, {kit.fmt(e, '.4f')}: "
               f"{a / e - 1:+.2%}, **" + ("met**" if a <= 1.01 * e else "missed**"))
  for w in (w for w in windows if w > 0 and f"k1_w{w:g}_control" in got):
    a = got[f"k1_w{w:g}_control"]
    p99 = max((x[1] for x in a["wait_s"] if x), default=math.inf)
    for what, value, met in (
        (f"utilization ≥ 0.95 (sync's {got['sync_control']['utilization']:.3f})",
         a["utilization"], a["utilization"] >= 0.95),
        ("the sync control's final loss within half its span", a["reach"], (a["reach"] or 1) <= .5),
        (f"wait p99 (s) ≤ the window, {w:g} s", p99, p99 <= w), *([
          ("goodput under the chaos schedule ≥ 0.95", f["goodput"], f["goodput"] >= 0.95),
          ("hash mismatches = 0", f["hash_mismatches"], not f["hash_mismatches"])]
          if (f := got[f"k1_w{w:g}"].get("faults")) else [])):
      spec = "d" if isinstance(value, int) else ".3f"
      out.append(f"- K = 1, W = {w:g} s: {what}: {kit.fmt(value, spec)}, **"
                 + ("met**" if met else "missed**"))
  return out


def markdown(result: dict[str, Any], figure: str) -> str:
  cfg, cal, seeds = result["config"], result["calibration"], result["seeds"]
  held = "whole processes" if cfg.get("cap_threads", True) else "all but transport threads"
  names = [(s, k) for s in seeds for k in seeds[s]["runs"]]
  return "\n\n".join([
    "# Decoupled rounds over torchft: replicas of different speeds", kit.doc_markdown(__doc__, 1),
    (f"Settings: `{' '.join(runs.command(arms(runs.Config(**cfg))[-1][1], 'OUT')[2:])}` (the"
     f" synchronous arm without `--decoupled`, `--steps {cfg['steps']}`); speeds"
     f" {' : '.join(f'{s:g}' for s in cfg['speeds'])}, {cfg['cpus'] / 2:g} CPUs per run; the caps"
     f" hold {held}."),
    "## Speeds alone under each cap", kit.table(
      ["replica", "cap (CPUs)", "inner step (s)", "share of speed", "ratio's share", "±10%"],
      [[i, *(f"{x:.4f}" for x in row[:4]), row[4]] for i, row in enumerate(zip(*(cal[k] for k in (
        "caps", "t_solo", "share", "expected", "within")), strict=True))]),
    "## Targets" + ("" if all(cal["within"]) else " (utilization not judged: a speed off ±10%)"),
    *(f"Seed {s}:\n\n" + "\n".join(targets(seeds[s]["runs"], cfg["windows"])) for s in seeds),
    "## Each run", kit.table([""] + [f"seed {s}, {k}" for s, k in names], [
      [label, *(cell(seeds[s]["runs"][k]) for s, k in names)] for label, cell in ROWS]),
    "Order of the arms: " + "; ".join(f"seed {s}: {', '.join(seeds[s]['order'])}" + "".join(
      f" ({', '.join(f)}: no round committed)" for f in [seeds[s]["failed"]] if f)
      for s in seeds) + f".\n\n![training loss]({figure})", *kit.run_line(result)])


def plot(result: dict[str, Any], path: str) -> None:
  """Per seed, each run's training loss (the mean of the last R committed lines') against the
  seconds after its first commit."""
  seeds = result["seeds"]
  fig, axes = kit.plt.subplots(len(seeds), 1, figsize=(10, 4 * len(seeds)), squeeze=False)
  for (ax,), (seed, got) in zip(axes, seeds.items(), strict=True):
    for k, a in ((k, a) for k, a in got["runs"].items() if a["loss_curve"]):
      ax.plot(*np.array(a["loss_curve"]).T, ls=":" if k.endswith("_control") else "-", label=k)
    ax.set(xlabel="seconds after the first commit", ylabel=f"seed {seed}: training loss")
    ax.legend(fontsize=7)
  kit.save_figure(fig, path, "training loss (mean of the last R committed lines) per run")
