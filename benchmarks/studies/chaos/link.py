"""The chaos study's link mode (``--rate``): fault-tolerant rounds over a bandwidth-limited link.

Per seed (the command's ``--seed``) and each of ``--overlaps`` τ, one run of ``optax-dist train
--fault-tolerant --overlap τ`` with its replicas' links shaped at ``--rate`` both ways (each
replica's namespace's veth and its bridge port, tbf as the network study's) and the same run
unshaped, one after the other (which goes first alternates), no fault, each replica capped at
``--cpus / R`` CPUs. From the replicas' JSONL logs: the span from the first commit to the last
line and the whole command's wall clock (start-up and compilation in it), the median
``exchange_seconds`` of a round (its thread's, beside the steps), the bytes each replica's veth
sent and received, the held-out metric and the last state hash (equal in both runs of a pair: the
link changes the time, not the result). Target: with overlap, the shaped span within 1.05× of the
unshaped one, median over the seeds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from benchmarks import kit
from benchmarks.studies.chaos import runs
from benchmarks.studies.chaos.accounting import final_metric
from benchmarks.studies.network import param_bytes

TARGET = 1.05  # the shaped span over the unshaped one, with overlap


def run_seed(config: runs.Config, seed: int, prefix: str) -> tuple[dict[str, Any], dict]:
  """Seed ``seed``'s pairs, by name ``overlap<τ>_<shaped|unshaped>``; no settings of its own."""
  found = {}
  for k, tau in enumerate(config.overlaps):
    c = dataclasses.replace(config, flags=f"{config.flags} --seed {seed} --overlap {tau}")
    for rate in (config.rate, None)[::1 if (seed + k) % 2 == 0 else -1]:
      name = f"overlap{tau}_{'shaped' if rate else 'unshaped'}"
      (found[name],) = runs.records(c, prefix, (f"seed{seed}/{name}",), lambda out: runs.together(
        [runs.FaultTolerantRun(c, out[0], [], c.cpus, "l", seed, rate)], c.timeout))
  return {}, found


def run_result(record: dict[str, Any]) -> dict[str, Any]:
  """One run's figures (see the module's docstring)."""
  lines, sent = record["lines"], record.get("link_bytes") or []
  return {"span_s": max(x["time"] for x in lines) - record["t0"], "wall_s": record["wall_s"],
          "rounds": len({x["round"] for x in lines if x["committed"]}),
          "exchange_s": float(np.median([x["exchange_seconds"] for x in lines])),
          "sent_mb": [b["tx_bytes"] / 1e6 for b in sent],
          "received_mb": [b["rx_bytes"] / 1e6 for b in sent],
          "metric": final_metric(record["final"]), "hash": lines[-1]["state_hash"],
          "status": record["status"], "load": kit.loads(record["load_before"],
                                                          record["load_after"]),
          "timeline": [[x["time"] - record["t0"], x["loss"]] for x in lines if x["replica"] == 0]}


def result(study: dict[str, Any], records: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """Each run's figures, and per τ the shaped run's span and wall clock over the unshaped one's
  (median [range] over the seeds) and whether each pair ended on one state hash."""
  seeds = {s: {n: run_result(r) for n, r in found.items()} for s, found in records.items()}
  summary = {}
  for tau in study["config"]["overlaps"]:
    pairs = [(got[f"overlap{tau}_shaped"], got[f"overlap{tau}_unshaped"]) for got in seeds.values()]
    summary[tau] = {k: [a[k] / b[k] for a, b in pairs] for k in ("span_s", "wall_s")} | {
      "same_hash": all(a["hash"] == b["hash"] for a, b in pairs)}
  return {"config": study["config"], "seeds": seeds, "summary": summary}


def markdown(result: dict[str, Any], figure: str) -> str:
  cfg, seeds, summary = result["config"], result["seeds"], result["summary"]
  settings = runs.Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})
  met = [f"τ = {tau}: {kit.fmt(np.median(s['span_s']), '.3f')} ≤ {TARGET}"
         f" {'met' if np.median(s['span_s']) <= TARGET else 'missed'}"
         for tau, s in summary.items() if int(tau) > 0]
  rows = [[s, f"τ = {n.split('_')[0][7:]}, {n.split('_')[1]}", f"{r['span_s']:.1f}",
           f"{r['wall_s']:.1f}", r["rounds"], f"{r['exchange_s']:.3f}",
           " / ".join(f"{a:.2f}, {b:.2f}" for a, b in zip(r["sent_mb"], r["received_mb"])),
           kit.fmt(r["metric"], ".4f"), r["hash"][:12], r["status"], r["load"]]
          for s, got in seeds.items() for n, r in got.items()]
  return "\n\n".join([
    f"# Fault-tolerant rounds over a {cfg['rate']} link",
    kit.doc_markdown(__doc__, 1),
    (f"Settings: `{' '.join(runs.command(settings, 'OUT')[2:])}` with `--seed S --overlap τ`;"
     f" each replica capped at {cfg['cpus'] / cfg['replicas']:.2f} CPU; the params"
     f" {param_bytes() / 1e6:.2f} MB in float32."),
    f"## Shaped over unshaped: median [range] over seeds {', '.join(seeds)}",
    kit.table(["τ", "span", "whole command", "one state hash per pair"], [
      [tau, kit.spread(s["span_s"], ".3f"), kit.spread(s["wall_s"], ".3f"),
       "yes" if s["same_hash"] else "no"] for tau, s in summary.items()]),
    f"Target: {'; '.join(met) or 'no run with overlap'}.",
    "## Each run",
    kit.table(["seed", "run", "span s", "wall s", "rounds", "exchange s (median)",
               "MB sent, received per replica", "held-out metric", "state hash", "exit",
               "load (1 min)"], rows),
    f"![loss against wall clock]({figure})", *kit.run_line(result, load=True)])


def plot(result: dict[str, Any], path: str) -> None:
  """Per τ, replica 0's round losses against seconds after the first commit, each seed's shaped
  run solid and its unshaped one dashed."""
  taus = list(result["summary"])
  fig, axes = kit.plt.subplots(1, len(taus), figsize=(6 * len(taus), 4), squeeze=False)
  for ax, tau in zip(axes[0], taus, strict=True):
    for i, (seed, got) in enumerate(result["seeds"].items()):
      for kind, style in (("shaped", "-"), ("unshaped", "--")):
        t = np.array(got[f"overlap{tau}_{kind}"]["timeline"])
        ax.plot(t[:, 0], t[:, 1], style, color=f"C{i}", label=f"seed {seed}, {kind}")
    ax.set(xlabel="seconds after the first commit", ylabel="training loss", title=f"τ = {tau}")
    ax.legend(fontsize=7)
  kit.save_figure(fig, path, f"{result['config']['rate']} (solid) against unshaped (dashed)")
