"""The trainer on the global view (``--fsdp K``) against the per-device ``shard_map`` step.

The ``lm`` task (0.28M params) with ``diloco`` over 2 replicas of 4 emulated CPU devices, the same
seed and settings, trained by :func:`optax_dist.cli.trainer.train` three ways: the per-device step
(``--replicas 2``), the global view with ``fsdp=1`` (params whole on every device) and with
``fsdp=4`` (each replica's params and state sharded over its 4 devices). The runs are interleaved,
``--rounds`` times each. Reported for each: the final train loss and validation bits per byte, each
device's bytes of params and optimizer state (its shards) and of the compiled step's arguments
(``memory_analysis``), the median step time with its interquartile range (the result's
``step_times``, the first step left out) and the machine's load average before the run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from benchmarks import kit
from optax_dist.cli import trainer
from optax_dist.cli.tasks import TASKS

CONFIGS = {"per-device (shard_map)": None, "global view, fsdp=1": 1, "global view, fsdp=4": 4}
"""The runs compared, by name: their ``fsdp``."""


@dataclasses.dataclass(frozen=True)
class Config:
  steps: int = kit.option(40, "training steps of every run")
  rounds: int = kit.option(2, "runs of each configuration, interleaved")


QUICK = {"steps": 6, "rounds": 1}


def measure(config: Config, prefix: str) -> dict[str, Any]:
  task, rows = TASKS["lm"], []
  data = task.load(0)
  for _ in range(config.rounds):
    for name, fsdp in CONFIGS.items():
      s = kit.settings(algorithm="diloco", devices=kit.DEVICES, replicas=2, fsdp=fsdp,
                       steps=config.steps, sync_period=10, eval_every=config.steps)
      rows.append(row(name, kit.load_average(), trainer.train(task, data, s)))
      print(f"[fsdp] {rows[-1]}", flush=True)
  return {"steps": config.steps, "rows": rows}


def row(name: str, load: str, result: dict) -> dict:
  quartiles = np.percentile(np.array(result["step_times"][1:]) * 1e3, [25, 50, 75]).tolist()
  held = result["bytes_per_device"]
  return {"run": name, "final train loss": repr(result["final_train_loss"]),
          "val bits/byte": repr(result["test_bits_per_byte_eval_params"]),
          "params B/device": held["params"], "opt state B/device": held["opt_state"],
          "step args B/device": held["step_arguments"], "step ms": quartiles, "load before": load}


def markdown(result: dict[str, Any], figure: str) -> str:
  keys = [k for k in result["rows"][0] if k != "step ms"]
  rows = [[r[k] for k in keys] + ["{1:.1f} [{0:.1f}, {2:.1f}]".format(*r["step ms"])]
          for r in result["rows"]]
  return kit.blocks("# The global view against the per-device step",
                    kit.doc_markdown(__doc__, 0, 1), f"{result['steps']} steps per run.",
                    kit.table(keys + ["step ms median [IQR]"], rows),
                    f"![step time by configuration]({figure})")


def plot(result: dict[str, Any], path: str) -> None:
  rows = result["rows"]
  fig, ax = kit.plt.subplots(figsize=(7, 3))
  q1, median, q3 = zip(*(r["step ms"] for r in rows))
  ax.barh(range(len(rows)), median, xerr=[[m - a for m, a in zip(median, q1)],
                                          [b - m for m, b in zip(median, q3)]])
  ax.set_yticks(range(len(rows)), [r["run"] for r in rows], fontsize=7)
  ax.set_xlabel("step ms (median, IQR)")
  kit.save_figure(fig, path)
