"""The chaos study's report: the archive of the runs' records, the figures computed from them
(again from the archive alone: :func:`main`), the Markdown and the plot."""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import kit
from benchmarks.studies.chaos import accounting, link, runs, speeds
from benchmarks.studies.chaos.accounting import BACK
from optax_dist.fault_tolerance.rundir import RunDir


def write_archive(path: str, study: dict[str, Any], records: dict[str, dict[str, Any]],
                  prefix: str) -> None:
  """``path`` (``.tar.xz``), whole or not at all: ``study.json`` (the settings, each seed's as
  run, and the runs' records but their lines) and each run's raw JSONL logs
  (``seed<S>/<NAME>/replicas/replica_<i>.jsonl``, from ``PREFIX_runs``)."""
  with tarfile.open(path + ".tmp", "w:xz") as tar:
    data = json.dumps(study | {"records": {s: {n: {k: v for k, v in r.items() if k != "lines"}
                                               for n, r in found.items()}
                                           for s, found in records.items()}}, default=str).encode()
    info = tarfile.TarInfo("study.json")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    for seed, name in ((s, n) for s, found in records.items() for n in found):
      for log in sorted(RunDir(f"{prefix}_runs/seed{seed}/{name}").replicas.glob("*.jsonl")):
        tar.add(log, f"seed{seed}/{name}/replicas/{log.name}")
  os.replace(path + ".tmp", path)


def read_archive(path: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
  """The study's settings and its runs' records (by seed, then name) from :func:`write_archive`'s
  archive, a fault-tolerant run's ``lines`` read from its JSONL files."""
  with tempfile.TemporaryDirectory() as tmp, tarfile.open(path) as tar:
    tar.extractall(tmp, filter="data")
    study = kit.read_json(os.path.join(tmp, "study.json"))
    for seed, found in study["records"].items():
      for name, record in found.items():
        if "saved" not in record:  # a fault-tolerant run
          record["lines"] = RunDir(os.path.join(tmp, f"seed{seed}", name)).lines()
  return study, study.pop("records")


def mode(config: dict[str, Any]) -> Any:
  """The module of ``config``'s mode (:mod:`speeds`, :mod:`link`), or ``None``: the study's own."""
  return speeds if config.get("speeds") else link if config.get("rate") else None


def result(study: dict[str, Any], records: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """Each seed's :func:`seed_result` and the :data:`FIGURES` table; a mode's: its ``result``."""
  if other := mode(study["config"]):
    return other.result(study, records)
  seeds = {seed: seed_result(study["seeds"][seed], found) for seed, found in records.items()}
  figures = [s["figures"] for s in seeds.values()]
  return {"config": study["config"], "seeds": seeds, "summary": [
    [label, *(kit.spread([f and get(f) for f in arm], spec)
              for arm in (figures, [f.get("sync") for f in figures]))]
    for label, get, spec in FIGURES]}


def seed_result(meta: dict[str, Any], found: dict[str, Any]) -> dict[str, Any]:
  """One seed's accounting of its runs (``found``, by name) and its ``figures``."""
  pair = accounting.compare(found["control"], found["faulted"])
  final = {k: accounting.final_metric(r["final"]) for k, r in found.items()}
  figures = accounting.figures(pair["faulted"], pair["control"], pair["span_s"]) | {
    **{k: pair["faulted"][k] for k in ("hash_mismatches", "standby_cpu_s")},
    "second_half_gap": pair["second_half_gap"], "equal_tokens_gap": (
      final["faulted"] / final["equal_tokens"] - 1 if final.get("equal_tokens") else None)}
  out = {"meta": meta, "pair": pair, "figures": figures, "runs": {
    k: {key: v for key, v in r.items() if key not in ("lines", "curve")} for k, r in found.items()}}
  if "sync_faulted" in found:
    sync = out["sync"] = {k: accounting.sync_accounting(
      found[f"sync_{k}"], pair["span_s"], meta["tokens_per_step"]) for k in ("control", "faulted")}
    figures["sync"] = accounting.figures(sync["faulted"], sync["control"], pair["span_s"]) | {
      k: meta.get(k) for k in ("sync_checkpoint_every", "checkpoint_cost_s", "mtbf_s")}
  return out


FIGURES = (  # the figures' table: a label, the value in an arm's figures, its format
  ("goodput", lambda f: f["goodput"], ".3f"),
  *((f"applied faults: {name}", lambda f, k=k: f["applied"][k], ".0f") for k, name in (
    ("kill", "kills"), ("stop", "stops"), ("link", "links down"),
    ("lighthouse", "Lighthouse kills"), ("unapplied", "none applicable (unapplied)"))),
  ("applied faults per minute", lambda f: f["per_minute"], ".2f"),
  ("committed work lost per applied fault (s)", lambda f: f["lost_per_fault_s"], ".1f"),
  *((f"{k} return p95: {unit}", lambda f, k=k, key=key: f["returns"][k].get(key), spec)
    for k in BACK for key, unit, spec in (("seconds", "s", ".1f"), ("rounds", "rounds", ".1f"))),
  ("restart p95: start-up (s), process start to ready",
   lambda f: f["returns"]["kill"].get("startup"), ".1f"),
  *((f"{k} return p95: heal {unit}, to commit from its return or ready mark",
     lambda f, k=k, key=key: f["returns"][k].get(key), ".1f")
    for k in BACK for key, unit in (("heal", "(s)"), ("heal_rounds", "(rounds)"))),
  ("longest stall (s)", lambda f: f["longest_stall_s"], ".1f"),
  ("state-hash mismatches", lambda f: f.get("hash_mismatches"), ".0f"),
  ("spare (standby) CPU-seconds", lambda f: f.get("standby_cpu_s"), ".0f"),
  ("final metric against the equal-tokens control", lambda f: f.get("equal_tokens_gap"), "+.2%"),
  ("median gap, second half of checkpoints, at equal tokens",
   lambda f: f.get("second_half_gap"), "+.2%"),
  ("checkpoint interval (steps)", lambda f: f.get("sync_checkpoint_every"), ".0f"),
  ("Young-Daly's C, a checkpoint's cost (s)", lambda f: f.get("checkpoint_cost_s"), ".2f"),
  ("Young-Daly's MTBF (s)", lambda f: f.get("mtbf_s"), ".0f"))


ROWS = (  # each seed's table: a label, a run's cell from its accounting and record
  ("rounds committed (whole run) / after a retried exchange / aborted everywhere / abort lines",
   lambda a, r: " / ".join(str(a[k]) for k in (
     "rounds_committed", "rounds_retried", "rounds_aborted", "abort_lines"))),
  ("median seconds of a round all replicas committed",
   lambda a, r: kit.fmt(a["full_round_s"], ".4f")),
  ("heals / of them unprovoked (no event of the replica's own in the 20 s before)",
   lambda a, r: f"{a['heals']} / {a['unprovoked_heals']}"),
  ("final held-out metric (mean of replicas)",
   lambda a, r: kit.fmt(accounting.final_metric(r["final"]), ".4f")))


def markdown(result: dict[str, Any], figure: str) -> str:
  if other := mode(result["config"]):
    return other.markdown(result, figure)
  cfg, seeds = result["config"], result["seeds"]
  settings = runs.Config(**cfg | {"sync_checkpoint_every": "N"})
  pairs = [(s, k) for s in seeds for k in ("control", "faulted")]
  return "\n\n".join([
    "# Chaos: fault-tolerant DiLoCo and synchronous data parallelism under faults",
    kit.doc_markdown(importlib.import_module("benchmarks.studies.chaos").__doc__, 0, 3),
    (f"Settings: `{' '.join(runs.command(settings, 'OUT')[2:])}` (steps as run: "
     + ", ".join(f"seed {s} {seeds[s]['meta']['steps']}" for s in seeds)
     + f"), each replica capped at {cfg['cpus'] / 2 / cfg['replicas']:.3f} CPU (0: uncapped);"
     f" faults at {cfg['fault_rate']:.3f}/s; the synchronous arm `"
     + " ".join(runs.sync_command(settings, "OUT", False)[2:]) + "`, N in the table."),
    f"## Figures: median [range] over seeds {', '.join(seeds)}",
    kit.table(["", cfg["algorithm"] + ", fault-tolerant", "sync, checkpoint and restart"],
              result["summary"]),
    ("Target: goodput ≥ 0.9 (Decoupled DiLoCo reports 0.88), no state-hash mismatch, the final"
     " metric within 1% of the equal-tokens control's."), "## Each seed's fault-tolerant pair",
    kit.table(["", *(f"seed {s}, {k}" for s, k in pairs)], [
      [label, *(cell(seeds[s]["pair"][k], seeds[s]["runs"][k]) for s, k in pairs)]
      for label, cell in ROWS]),
    "Each run's exit status, wall clock and load average before → after: " + "; ".join(
      f"seed {s} {k} {r['status']}, {r['wall_s']:.0f} s, " + kit.loads(r["load_before"], r[
        "load_after"]) for s in seeds for k, r in seeds[s]["runs"].items()) + ".",
    f"![committed tokens]({figure})", *kit.run_line(result)])


COLORS = {"kill": "red", "stop": "orange", "cont": "green", "start": "grey",
          "lighthouse": "purple", "link": "blue", "up": "cyan"}  # the faulted run's events


def plot(result: dict[str, Any], path: str) -> None:
  """Per seed, committed tokens (both arms) and the checkpoints' held-out metric against wall
  clock, the faulted run's events marked (a mode's: its ``plot``)."""
  if other := mode(result["config"]):
    return other.plot(result, path)
  seeds = result["seeds"]
  fig, axes = kit.plt.subplots(len(seeds), 1, figsize=(10, 3.5 * len(seeds)), squeeze=False)
  for (ax,), (seed, got) in zip(axes, seeds.items(), strict=True):
    arms = [(got["pair"], "ft ", "-")] + [(got.get("sync"), "sync ", "--")] * ("sync" in got)
    for arm, prefix, style in arms:
      for name in ("control", "faulted"):
        t = np.array(arm[name]["timeline"] or [[0, 0]])
        ax.plot(t[:, 0], t[:, 1], ls=style, label=prefix + name, drawstyle="steps-post")
    for at, kind, _, _ in got["runs"]["faulted"]["events"]:
      if at > 0 and kind in COLORS:
        ax.axvline(at, color=COLORS[kind], lw=0.6, ls=":" if kind == "start" else "-")
    metric = ax.twinx()  # one scale for both runs' metric
    for name in ("control", "faulted"):
      if curve := got["pair"][name]["curve"]:
        metric.plot(*np.array(curve)[:, [0, 2]].T, "k." + "-:"[name == "control"])
    ax.set(xlabel="seconds after the first commit", ylabel=f"seed {seed}: committed tokens")
    ax.legend(fontsize=7)
  kit.save_figure(fig, path, "kill (red), stop (orange), cont (green), restart (grey), link down"
                             " (blue), up (cyan), Lighthouse kill (purple); black, right: the"
                             " held-out metric of each checkpoint (the control's dotted)")


def main(argv: Sequence[str] | None = None) -> None:
  """``--recompute PREFIX_raw.tar.xz``: prints the report computed from the archive alone."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.chaos")
  parser.add_argument("--recompute", required=True, metavar="PREFIX_raw.tar.xz")
  archive = parser.parse_args(argv).recompute
  figure = os.path.basename(archive).replace("_raw.tar.xz", ".png")
  print(markdown(result(*read_archive(archive)), figure))
