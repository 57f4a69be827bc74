"""The trainer on the global view (``--fsdp K``) against the per-device ``shard_map`` step.

The ``lm`` task (0.28M params) with ``diloco`` over 2 replicas of 4 emulated CPU devices, the
same seed and settings, trained by :func:`optax_dist.cli.trainer.train` three ways: the
per-device step (``--replicas 2``), the global view with ``fsdp=1`` (params whole on every
device) and with ``fsdp=4`` (each replica's params and state sharded over its 4 devices). The
runs are interleaved, ``--rounds`` times each. Reported for each: the final train loss and
validation bits per byte, each device's bytes of params and optimizer state (its shards) and
of the compiled step's arguments (``memory_analysis``), the median step time with its
interquartile range (the result's ``step_times``, the first step left out) and the machine's
load average before the run.

Run: ``python benchmarks/bench_fsdp.py [--steps 40] [--rounds 2]``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import _util  # noqa: E402
import numpy as np  # noqa: E402

from optax_dist.cli import trainer  # noqa: E402
from optax_dist.cli.config import Settings  # noqa: E402
from optax_dist.cli.tasks import TASKS  # noqa: E402

CONFIGS = {"per-device (shard_map)": None, "global view, fsdp=1": 1, "global view, fsdp=4": 4}
"""The runs compared, by name: their ``fsdp``."""


def settings(fsdp: int | None, steps: int) -> Settings:
  task = TASKS["lm"]
  recipe = {k: v for k, v in task.defaults.items() if k not in ("steps", "sync_period")}
  return Settings(task="lm", algorithm="diloco", devices=8, replicas=2, fsdp=fsdp, steps=steps,
                  sync_period=10, **{**recipe, "eval_every": steps})


def row(name: str, result: dict, load: str) -> dict:
  times = np.array(result["step_times"][1:]) * 1e3
  q1, median, q3 = np.percentile(times, [25, 50, 75])
  held = result["bytes_per_device"]
  return {"run": name, "final train loss": repr(result["final_train_loss"]),
          "val bits/byte": repr(result["test_bits_per_byte_eval_params"]),
          "params B/device": held["params"], "opt state B/device": held["opt_state"],
          "step args B/device": held["step_arguments"],
          "step ms median [IQR]": f"{median:.1f} [{q1:.1f}, {q3:.1f}]", "load before": load}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--rounds", type=int, default=2)
  args = parser.parse_args()
  task = TASKS["lm"]
  data = task.load(0)
  rows = []
  for _ in range(args.rounds):
    for name, fsdp in CONFIGS.items():
      load = _util.load_average()
      rows.append(row(name, trainer.train(task, data, settings(fsdp, args.steps)), load))
      print(rows[-1], flush=True)
  print(_util.machine(), _util.versions())
  keys = list(rows[0])
  print("| " + " | ".join(keys) + " |")
  print("|" + "---|" * len(keys))
  for r in rows:
    print("| " + " | ".join(str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
  main()
