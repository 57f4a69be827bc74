"""The chaos study's report: the archive of the runs' records, the figures computed from them,
the Markdown and the plot; ``python -m benchmarks.studies.chaos.report --recompute ARCHIVE``."""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import pathlib
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import kit
from benchmarks.studies.chaos import accounting, runs
from benchmarks.studies.chaos.accounting import BACK
from optax_dist.fault_tolerance.rundir import RunDir

TARGET_GOODPUT = 0.9


def write_archive(path: str, study: dict[str, Any], records: dict[str, dict[str, Any]],
                  prefix: str) -> None:
  """``path`` (``.tar.xz``), whole or not at all: ``study.json`` (settings, each seed's as run),
  per run ``seed<S>/<NAME>/record.json`` (but the lines) and ``replicas/replica_<i>.jsonl``."""
  with tarfile.open(path + ".tmp", "w:xz") as tar:
    _add(tar, "study.json", study)
    for seed, found in records.items():
      for name, record in found.items():
        where = f"seed{seed}/{name}"
        _add(tar, f"{where}/record.json", {k: v for k, v in record.items() if k != "lines"})
        for log in sorted(RunDir(f"{prefix}_runs/{where}").replicas.glob("replica_*.jsonl")):
          tar.add(log, f"{where}/replicas/{log.name}")
  os.replace(path + ".tmp", path)


def _add(tar: tarfile.TarFile, name: str, value: Any) -> None:
  data, info = json.dumps(value, default=str).encode(), tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


def read_archive(path: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
  """The study's settings and its runs' records (by seed, then name) from :func:`write_archive`'s
  archive, a fault-tolerant run's ``lines`` read from its JSONL files."""
  records: dict[str, dict[str, Any]] = {}
  with tempfile.TemporaryDirectory() as tmp, tarfile.open(path) as tar:
    tar.extractall(tmp, filter="data")
    study = kit.read_json(os.path.join(tmp, "study.json"))
    for seed in study["seeds"]:
      for found in sorted(pathlib.Path(tmp, f"seed{seed}").glob("*/record.json")):
        record = kit.read_json(str(found))
        if "saved" not in record:  # a fault-tolerant run
          record["lines"] = RunDir(found.parent).lines()
        records.setdefault(seed, {})[found.parent.name] = record
  return study, records


def result(study: dict[str, Any], records: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """Each seed's numbers (:func:`seed_result`) and the figures' table (:data:`FIGURES`)."""
  seeds = {seed: seed_result(study["seeds"][seed], found) for seed, found in records.items()}
  figures = [seeds[s]["figures"] for s in seeds]
  arms = [figures, [f.get("sync") for f in figures]]
  return {"config": study["config"], "seeds": seeds, "summary": [
    [label, *(_spread([f and get(f) for f in arm], spec) for arm in arms)]
    for label, get, spec in FIGURES]}


def seed_result(meta: dict[str, Any], found: dict[str, Any]) -> dict[str, Any]:
  """One seed's accounting of its runs (``found``, by name) and its ``figures``."""
  pair = accounting.compare(found["control"], found["faulted"])
  final = {k: accounting.final_metric(r["final"]) for k, r in found.items()}
  figures = accounting.figures(pair["faulted"], pair["goodput"], pair["span_s"]) | {
    "hash_mismatches": pair["faulted"]["hash_mismatches"],
    "standby_cpu_s": pair["faulted"]["standby_cpu_s"],
    "second_half_gap": pair["second_half_gap"], "equal_tokens_gap": (
      final["faulted"] / final["equal_tokens"] - 1 if final.get("equal_tokens") else None)}
  keys = ("events", "final", "status", "wall_s", "load_before", "load_after")
  out = {"meta": meta, "pair": pair, "figures": figures,
         "runs": {k: {key: r[key] for key in keys} for k, r in found.items()}}
  if "sync_faulted" in found:
    out["sync"] = {k: accounting.sync_accounting(found[f"sync_{k}"], pair["span_s"],
                                                 meta["tokens_per_step"])
                   for k in ("control", "faulted")}
    goodput = out["sync"]["faulted"]["committed_tokens"] / out["sync"]["control"][
      "committed_tokens"]
    figures["sync"] = accounting.figures(out["sync"]["faulted"], goodput, pair["span_s"]) | {
      "checkpoint_every": meta["sync_checkpoint_every"]}
  return out


FIGURES = (
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
  ("restart p95: heal (s), ready to commit", lambda f: f["returns"]["kill"].get("heal"), ".1f"),
  ("longest stall (s)", lambda f: f["longest_stall_s"], ".1f"),
  ("state-hash mismatches", lambda f: f.get("hash_mismatches"), ".0f"),
  ("spare (standby) CPU-seconds", lambda f: f.get("standby_cpu_s"), ".0f"),
  ("final metric against the equal-tokens control", lambda f: f.get("equal_tokens_gap"), "+.2%"),
  ("median gap, second half of checkpoints, at equal tokens",
   lambda f: f.get("second_half_gap"), "+.2%"),
  ("checkpoint interval (steps)", lambda f: f.get("checkpoint_every"), ".0f"))
"""The figures' table: a label, the value in an arm's ``figures``, its format."""


def _spread(values: Sequence[Any], spec: str) -> str:
  """``median [min, max]`` of ``values`` in ``spec`` (the median alone if all agree); a dash if
  one is missing."""
  if not values or None in values:
    return "—"
  median, low, high = (format(v, spec) for v in (np.median(values), min(values), max(values)))
  return median if low == high else f"{median} [{low}, {high}]"


ROWS = (
  ("committed tokens in the span", lambda a, r: a["committed_tokens"]),
  ("useful-work ratio", lambda a, r: f"{a['useful_work']:.3f}"),
  ("rounds committed (whole run) / after a retried exchange / aborted everywhere / abort lines",
   lambda a, r: " / ".join(str(a[k]) for k in (
     "rounds_committed", "rounds_retried", "rounds_aborted", "abort_lines"))),
  ("median seconds of a round all replicas committed",
   lambda a, r: kit.fmt(a["full_round_s"], ".4f")),
  ("heals / of them unprovoked (no fault of the replica's own in the 20 s before)",
   lambda a, r: f"{a['heals']} / {a['unprovoked_heals']}"),
  ("final held-out metric (mean of replicas)",
   lambda a, r: kit.fmt(accounting.final_metric(r["final"]), ".4f")),
  ("exit status / wall clock (s) / load average before → after", lambda a, r: (
    f"{r['status']} / {r['wall_s']:.0f} / {kit.loads(r['load_before'], r['load_after'])}")))
"""Each seed's table: a label, a run's cell from its accounting and record."""


def markdown(result: dict[str, Any], figure: str) -> str:
  cfg, seeds = result["config"], result["seeds"]
  doc = importlib.import_module("benchmarks.studies.chaos").__doc__
  settings = runs.Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}
                         | {"sync_checkpoint_every": "N"})
  pairs = [(s, k) for s in seeds for k in ("control", "faulted")]
  return "\n\n".join([
    "# Chaos: fault-tolerant DiLoCo and synchronous data parallelism under faults",
    kit.doc_markdown(doc, 0, 3),
    (f"Settings: `{' '.join(runs.command(settings, 'OUT')[2:])}` (steps as run: "
     + ", ".join(f"seed {s} {seeds[s]['meta']['steps']}" for s in seeds)
     + f"), each replica capped at {cfg['cpus'] / 2 / cfg['replicas']:.3f} CPU (0: uncapped);"
     f" faults at {cfg['fault_rate']:.3f}/s; the synchronous arm `"
     + " ".join(runs.sync_command(settings, "OUT", False)[2:]) + "`, N in the table."),
    f"## Figures: median [range] over seeds {', '.join(seeds)}",
    kit.table(["", cfg["algorithm"] + ", fault-tolerant", "sync, checkpoint and restart"],
              result["summary"]),
    (f"Target: goodput ≥ {TARGET_GOODPUT} (Decoupled DiLoCo reports 0.88), no state-hash"
     " mismatch, the final metric within 1% of the equal-tokens control's."),
    "## Each seed's fault-tolerant pair",
    kit.table(["", *(f"seed {s}, {k}" for s, k in pairs)], [
      [label, *(cell(seeds[s]["pair"][k], seeds[s]["runs"][k]) for s, k in pairs)]
      for label, cell in ROWS]),
    f"![committed tokens]({figure})",
    *([f"Run {r['date']}: `{r['command']}`, {r['seconds']:.0f} s."] if (r := result.get(
      "run")) else [])])


COLORS = {"kill": "red", "stop": "orange", "cont": "green", "start": "grey",
          "lighthouse": "purple", "link": "blue", "up": "cyan"}
"""The plot's colour of each event of the faulted run."""


def plot(result: dict[str, Any], path: str) -> None:
  """For each seed, committed tokens against wall clock (both arms) and the held-out metric of
  the checkpoints against wall clock; the faulted run's events marked."""
  seeds = result["seeds"]
  fig, axes = kit.plt.subplots(len(seeds), 2, figsize=(12, 3.5 * len(seeds)), squeeze=False)
  for (tokens, metric), (seed, got) in zip(axes, seeds.items(), strict=True):
    arms = [(got["pair"], "ft ", "-")] + [(got["sync"], "sync ", "--")] * ("sync" in got)
    for arm, prefix, style in arms:
      for name in ("control", "faulted"):
        t = np.array(arm[name]["timeline"] or [[0, 0]])
        tokens.plot(t[:, 0], t[:, 1], ls=style, label=prefix + name, drawstyle="steps-post")
    for name in ("control", "faulted"):
      if curve := got["pair"][name]["curve"]:
        metric.plot(*np.array(curve)[:, [0, 2]].T, marker=".", label=name)
    for ax in (tokens, metric):
      for at, kind, _, _ in got["runs"]["faulted"]["events"]:
        if at > 0 and kind in COLORS:
          ax.axvline(at, color=COLORS[kind], lw=0.6, ls=":" if kind == "start" else "-")
      ax.set_xlabel("seconds after the first commit")
    tokens.legend(fontsize=7)
    tokens.set_ylabel(f"seed {seed}: committed tokens")
    metric.set_ylabel("held-out metric at each checkpoint")
  kit.save_figure(fig, path, "kill (red), stop (orange), cont (green), restart (grey), link down"
                             " (blue), up (cyan), Lighthouse kill (purple)")


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.chaos.report")
  parser.add_argument("--recompute", required=True, metavar="PREFIX_raw.tar.xz",
                      help="a study's archive: print its report computed again from it alone")
  archive = parser.parse_args(argv).recompute
  figure = os.path.basename(archive).removesuffix("_raw.tar.xz") + ".png"
  print(markdown(result(*read_archive(archive)), figure))
  return 0


if __name__ == "__main__":
  sys.exit(main())
