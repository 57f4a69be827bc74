"""Training through failures: fault-tolerant DiLoCo and synchronous training under Poisson faults.

Per seed, a control and a faulted run of ``optax-dist train --fault-tolerant`` together (R
replicas, each in a network namespace and a cgroup of ``--cpus / 2R`` CPUs; a dead one restarts
as a new process after ``--restart-delay`` s, its programs cached, and heals). Faults come at
exponential gaps of mean ``1 / --fault-rate`` s, each a uniform kind on a uniform replica: ``kill
-9``, ``SIGSTOP`` for ``--stop-seconds``, or its link down for ``--link-seconds``; one its replica
cannot take (dead, stopped, cut off) is drawn again at the same time on a uniform live replica
(a stream of its own, alike in both arms); and one Lighthouse kill. A seed with fewer than
``--min-faults`` applied runs again longer. Then an equal-tokens control (``--steps`` of the
faulted run's committed tokens, its schedule ending there), and the synchronous arm and its
control under the same kills and stops: ``--algorithm sync`` over R processes, one declared dead
after the fault-tolerant arm's exchange timeout, checkpointing at Young and Daly's ``sqrt(2 C
MTBF)`` (``C`` measured), restarted with ``--resume``. No arm has a spare (``--standby``: both,
their CPU-seconds counted). A run's clock starts at its first commit (checkpoint).

Every figure is the median and range over the seeds, computed again from the raw records in
``PREFIX_raw.tar.xz`` by ``python -m benchmarks.studies.chaos --recompute``:

* goodput: committed tokens (a healer's round none; sync: checkpointed) over the control's;
* the applied faults, their rate, and the work lost per fault: ``(1 - goodput) * span / faults``
  seconds;
* returns, p95 by kind: from the replica's return (a new process, ``SIGCONT``, link up;
  ``--resume``) to its first commit (checkpoint), in seconds and in the run's rounds meanwhile;
  a return whose process was starting (a restart; a stop or cut in a restart's start-up) split
  at its ``ready`` mark (session up) into start-up and heal (a stop's or cut's heal: all of it
  otherwise);
* validation: the final metric against the equal-tokens control's, and the median gap over the
  second half of the checkpoints against the control's at equal tokens.

Every process, cgroup and namespace of a run is removed when it ends, also on an exception or
Ctrl-C. Needs root (``make bench-chaos``); says so and exits with 0 otherwise. With ``--speeds``,
the speeds mode (:mod:`~benchmarks.studies.chaos.speeds`, ``make bench-decoupled``) runs instead:
decoupled rounds where the replicas' speeds differ; with ``--rate``, the link mode
(:mod:`~benchmarks.studies.chaos.link`): fault-tolerant rounds over a shaped link.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
from typing import Any

from benchmarks.studies.chaos import accounting, report, runs, schedule, speeds
from benchmarks.studies.chaos.report import markdown, plot
from benchmarks.studies.chaos.runs import QUICK, Config

__all__ = ["QUICK", "Config", "markdown", "measure", "plot"]


def measure(config: Config, prefix: str) -> dict[str, Any] | None:
  """Every seed's runs (:func:`run_seed`; a mode's, :func:`report.mode`: its ``run_seed``, with
  ``speeds`` after the speeds' calibration), archived in ``PREFIX_raw.tar.xz``, and the
  figures. A ``SIGTERM`` ends the study as Ctrl-C does, the runs in progress removed first."""
  if os.geteuid() != 0:
    print("[chaos] skipped: needs root (make bench-chaos)", file=sys.stderr)
    return None
  signal.signal(signal.SIGTERM, _interrupted)
  study, records = {"config": dataclasses.asdict(config), "seeds": {}}, {}
  if config.speeds:
    study["calibration"] = speeds.calibrate(config)
  for seed in config.seeds:
    study["seeds"][str(seed)], records[str(seed)] = getattr(
      report.mode(study["config"]), "run_seed", run_seed)(config, seed, prefix)
  report.write_archive(f"{prefix}_raw.tar.xz", study, records, prefix)
  return report.result(study, records)


def run_seed(config: Config, seed: int, prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
  """Seed ``seed``'s runs (in ``PREFIX_runs/seed<SEED>/``): the pair (longer while it took fewer
  than ``--min-faults``), the equal-tokens control, the synchronous pair for the first pair's
  span; its settings as run (steps, the checkpoint interval and what set it) and records."""
  c, cpus, name = dataclasses.replace(config, seeds=(seed,)), config.cpus / 2, f"seed{seed}"
  while True:
    faults = schedule.schedule(seed, c.fault_rate, c.timeout, c.replicas,
                               tuple(c.stop_seconds), tuple(c.link_seconds))
    kill = [schedule.TimedFault(c.lighthouse_kill, "lighthouse", -1)] * (c.lighthouse_kill > 0)
    control, faulted = runs.records(c, prefix, (f"{name}/control", f"{name}/faulted"), lambda out: (
      runs.together([runs.FaultTolerantRun(c, out[0], [], cpus, "c", seed),
                     runs.FaultTolerantRun(c, out[1], faults + kill, cpus, "f", seed)], c.timeout)))
    pair = accounting.compare(control, faulted)
    if (got := sum(pair["faulted"]["applied"][k] for k in accounting.FAULTS)) >= c.min_faults:
      break
    grow = 1.1 * c.min_faults / max(got, 1)  # the same schedule, drawn further
    rounds = math.ceil(round(c.steps * grow / c.sync_period, 9))  # 11.000000000000002: 11
    c = dataclasses.replace(c, steps=rounds * c.sync_period, timeout=c.timeout * grow)
  per_step = c.replicas * max(x["tokens"] for x in control["lines"]) / c.sync_period
  meta = {"steps": c.steps, "tokens_per_step": per_step}
  found = {"control": control, "faulted": faulted}
  if c.equal_tokens_control:
    tokens = sum(x["weight"] for x in faulted["lines"] if x["committed"])
    e = dataclasses.replace(c, steps=max(1, round(tokens / per_step / c.sync_period)) *
                            c.sync_period)
    (found["equal_tokens"],) = runs.records(e, prefix, (f"{name}/equal_tokens",), lambda out: (
      runs.together([runs.FaultTolerantRun(e, out[0], [], cpus, "e", seed)], e.timeout)))
  if c.sync_checkpoint_every != 0:
    every = c.sync_checkpoint_every
    if every is None:  # Young-Daly at the control's pace (a step: a full round / H); the MTBF
      # of the synchronous arm's faults, its kills and stops (a stop outlasts its heartbeat
      # timeout: each ends its command), 2 of the 3 kinds of --fault-rate
      meta |= {"checkpoint_cost_s": runs.checkpoint_cost(c.task, cpus / c.replicas),
               "mtbf_s": 1.5 / c.fault_rate,
               "step_s": pair["control"]["full_round_s"] / c.sync_period}
      every = runs.young_daly(meta["checkpoint_cost_s"], meta["mtbf_s"], meta["step_s"])
    s, meta["sync_checkpoint_every"] = dataclasses.replace(c, sync_checkpoint_every=every), every
    found["sync_control"], found["sync_faulted"] = runs.records(
      s, prefix, (f"{name}/sync_control", f"{name}/sync_faulted"), lambda out: runs.together(
        [runs.SyncRun(s, out[0], [], cpus, "s", pair["span_s"], seed),
         runs.SyncRun(s, out[1], faults, cpus, "t", pair["span_s"], seed)], s.timeout))
  return meta, found


def _interrupted(signum: int, frame: Any) -> None:
  raise KeyboardInterrupt(f"chaos: stopped by signal {signum}")
