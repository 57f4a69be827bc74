"""Steps per second of 2 ``jax.distributed`` processes over gloo: elastic_average vs sync.

Runs ``optax-dist train --processes 2 --devices 1`` (two local processes, one worker each,
collectives over gloo on the loopback interface) for ``elastic_average`` (communication period
10) and ``sync`` (``tower``: an all-reduce on every step), each for a short and a long run. The
steady-state rate is the difference of steps over the difference of the runs' ``wall_time_s``
(which includes compilation and the evaluations at the start and the end: the difference cancels
them). Only measured where the installed ``optax-dist`` has ``--processes``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

PROCESSES = 2
DEVICES = 1
PERIOD = 10
STEPS = (100, 2100)
ALGORITHMS = ("sync", "elastic_average")


def _command(*args: str) -> list[str]:
  return [sys.executable, "-m", "optax_dist.cli", *args]


def available() -> str | None:
  """``None`` if ``optax-dist train`` has ``--processes``, else why not."""
  try:
    help_text = subprocess.run(_command("train", "--help"), capture_output=True, text=True,
                               timeout=120, check=False).stdout
  except (OSError, subprocess.SubprocessError) as e:
    return f"`optax-dist train --help` failed: {e}"
  if "--processes" not in help_text:
    return "`optax-dist train` has no `--processes` option in this version"
  return None


def _run(algorithm: str, steps: int, out: str) -> float:
  """``wall_time_s`` of one multi-process run (raises ``RuntimeError`` on failure)."""
  argv = _command(
    "train", "--algorithm", algorithm, "--processes", str(PROCESSES), "--devices", str(DEVICES),
    "--steps", str(steps), "--eval-every", str(steps), "--communication-period", str(PERIOD),
    "--out", out, "--no-progress",
  )
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env,
                        check=False)
  if proc.returncode != 0:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"`{' '.join(argv[3:])}` exited with {proc.returncode}: {' / '.join(tail)}")
  with open(os.path.join(out, f"results_{algorithm}.json")) as f:
    result = json.load(f)["algorithms"][algorithm]
  return float(result["wall_time_s"])


def measure() -> dict[str, Any]:
  reason = available()
  if reason is not None:
    return {"measured": False, "reason": reason}
  rates = {}
  try:
    with tempfile.TemporaryDirectory() as out:
      walls = {a: {} for a in ALGORITHMS}
      for steps in STEPS:  # interleaved
        for algorithm in ALGORITHMS:
          walls[algorithm][steps] = _run(algorithm, steps, out)
      for algorithm in ALGORITHMS:
        w = walls[algorithm]
        if w[STEPS[1]] <= w[STEPS[0]]:
          raise ValueError(f"{algorithm}: the {STEPS[1]}-step run took no longer than the"
                           f" {STEPS[0]}-step one ({w[STEPS[1]]:.1f} s vs {w[STEPS[0]]:.1f} s):"
                           " the machine is too loaded to measure")
        rates[algorithm] = {"walls": w, "steps_per_s": (STEPS[1] - STEPS[0]) /
                            (w[STEPS[1]] - w[STEPS[0]])}
  except (RuntimeError, OSError, KeyError, ValueError, subprocess.SubprocessError) as e:
    return {"measured": False, "reason": f"a run failed: {e}"}
  return {"measured": True, "rates": rates}


def markdown(result: dict[str, Any]) -> str:
  if not result["measured"]:
    return f"not measured: {result['reason']}."
  import _util

  rates = result["rates"]
  sync = rates["sync"]["steps_per_s"]
  rows = []
  for algorithm in ALGORITHMS:
    r = rates[algorithm]
    rows.append([algorithm, f"{r['walls'][STEPS[0]]:.1f}", f"{r['walls'][STEPS[1]]:.1f}",
                 f"{r['steps_per_s']:.1f}", f"{r['steps_per_s'] / sync:.2f}"])
  header = ["algorithm", f"wall s, {STEPS[0]} steps", f"wall s, {STEPS[1]} steps", "steps / s",
            "vs sync"]
  return "\n".join([
    (f"`optax-dist train --processes {PROCESSES} --devices {DEVICES}` (digits MLP, one worker per"
     f" process, gloo over loopback); steps/s = {STEPS[1] - STEPS[0]} / (wall({STEPS[1]}) −"
     f" wall({STEPS[0]}))."),
    "",
    _util.table(header, rows),
  ])
