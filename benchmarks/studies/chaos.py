"""Training through failures: fault-tolerant DiLoCo under a fixed-seed Poisson schedule of faults.

Two runs of ``optax-dist train --fault-tolerant`` (a torchft Lighthouse and R replica processes
on 127.0.0.1, ``--devices 1`` each; the launcher restarts a dead replica after
``--restart-delay`` s and it heals at its first quorum) with the same settings and seed: a
control without faults, then the faulted run. Each run's clock starts at its first commit
(imports and compilation untimed). The faults are drawn with ``--seed`` over the control's span:
exponential gaps of mean ``1 / --fault-rate`` s, each a ``kill -9`` of a replica's process group
or a ``SIGSTOP`` for ``--stop-seconds`` (uniform) then ``SIGCONT``, on a uniform replica; one
on a replica that is not running (or already stopped) is recorded as skipped.

Measured from the replicas' logs (``OUT/replicas/replica_<i>.jsonl``):

* goodput: the faulted run's committed tokens (the committed lines' weights: a healer's
  weight-0 round counts nothing) over the control's, over the span both ran (the shorter run's,
  from each run's first commit);
* useful-work ratio: committed tokens over the tokens of the logged rounds (a killed replica's
  unfinished round is not logged: an upper bound);
* heal time: from a restarted replica's first appearance in the process tree, or a stopped
  one's ``SIGCONT``, to its next committed round; a restarted replica's first ``quorum_seconds``
  (quorum request to quorum, heal included);
* longest stall (gap between commits), aborted rounds, the rounds whose committed lines hold
  more than one ``state_hash`` (must be 0), and the final held-out metric (``final_<i>.json``).

Every process of a run (launcher, Lighthouse, replicas: found by the run's directory in their
command lines) is killed when it ends, also on an exception or Ctrl-C. Needs root (``make
bench-chaos``); says so and exits with 0 otherwise.

Each replica process runs in a cgroup of its own capped at ``--cpus / R`` CPUs
(:class:`CpuShares`; ``--cpus 0`` leaves them uncapped), so that a stopped or restarting
replica's share stays idle rather than speeding up the others; the groups are removed at the
end, also after an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

from benchmarks import kit

KINDS = ("kill", "stop")
TARGET_GOODPUT = 0.9


@dataclasses.dataclass(frozen=True)
class Config:
  replicas: int = kit.option(4, "R, replica processes")
  min_replicas: int = kit.option(2, "the smallest quorum that commits")
  task: str = kit.option("digits", "the command's --task")
  sync_period: int = kit.option(20, "H, inner steps per round")
  steps: int = kit.option(24000, "committed inner steps of each run (--steps)")
  fault_rate: float = kit.option(1 / 12, "faults per second (Poisson)")
  stop_seconds: tuple[float, float] = kit.option((3.0, 10.0), "a SIGSTOP's length, uniform")
  restart_delay: float = kit.option(2.0, "seconds before the launcher restarts a dead replica")
  exchange_timeout: float = kit.option(2.0, "--exchange-timeout of the replicas, seconds")
  heartbeat_timeout: float = kit.option(
    1.0, "--lighthouse-heartbeat-timeout: seconds of silence before a replica is dropped")
  finish_grace: float = kit.option(2.0, "--finish-grace: seconds the others have to finish")
  seed: int = kit.option(0, "seed of the fault schedule (the runs' --seed stays 0)")
  timeout: float = kit.option(900.0, "seconds after which a run is stopped")
  cpus: float = kit.option(float(os.cpu_count() or 1),
                           "CPUs the replicas share, each capped at cpus / R (cgroups); 0: none")


QUICK = {"steps": 4000, "fault_rate": 1 / 8}


@dataclasses.dataclass(frozen=True)
class Fault:
  """At ``at`` seconds after the first commit: ``kind`` on ``replica``, for ``seconds`` (stop)."""

  at: float
  kind: str
  replica: int
  seconds: float = 0.0


def schedule(seed: int, rate: float, horizon: float, replicas: int,
             stop_seconds: tuple[float, float] = (3.0, 10.0)) -> list[Fault]:
  """The faults of a Poisson process of ``rate`` per second over ``[0, horizon)`` seconds.

  Gaps are exponential with mean ``1 / rate``; each fault's kind (``kill``, ``stop``) and
  replica are uniform, a stop's length uniform in ``stop_seconds``. The draws are sequential from
  ``numpy.random.default_rng(seed)``: a longer horizon extends the same list.

  Raises:
    ValueError: ``rate`` or ``horizon`` not positive, ``replicas < 1``, ``stop_seconds`` not an
      interval of positive seconds.
  """
  if not (rate > 0 and horizon > 0 and replicas >= 1 and 0 < stop_seconds[0] <= stop_seconds[1]):
    raise ValueError(f"chaos.schedule: need rate > 0, horizon > 0, replicas >= 1 and"
                     f" 0 < stop_seconds[0] <= stop_seconds[1], got rate={rate},"
                     f" horizon={horizon}, replicas={replicas}, stop_seconds={stop_seconds}")
  rng, t, faults = np.random.default_rng(seed), 0.0, []
  while True:
    t += rng.exponential(1 / rate)
    kind, replica, seconds = KINDS[rng.integers(2)], int(rng.integers(replicas)), \
      float(rng.uniform(*stop_seconds))
    if t >= horizon:
      return faults
    faults.append(Fault(round(t, 3), kind, replica, round(seconds, 3) if kind == "stop" else 0.0))


def command(config: Config, out: str) -> list[str]:
  """``optax-dist train --fault-tolerant`` of the study's settings, writing to ``out``."""
  return [sys.executable, "-m", "optax_dist.cli", "train", "--algorithm", "diloco",
          "--fault-tolerant", "--replicas", str(config.replicas), "--min-replicas",
          str(config.min_replicas), "--devices", "1", "--task", config.task, "--steps",
          str(config.steps), "--sync-period", str(config.sync_period),
          "--restart-delay", str(config.restart_delay), "--max-restarts", "1000",
          "--exchange-timeout", str(config.exchange_timeout), "--finish-grace",
          str(config.finish_grace), "--lighthouse-heartbeat-timeout",
          str(config.heartbeat_timeout), "--no-progress", "--out", out]


def processes(out: str) -> dict[int, str]:
  """The live processes whose command line holds ``--out OUT``: pid -> command line."""
  found = {}
  for entry in pathlib.Path("/proc").iterdir():
    try:
      args = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
    except OSError:
      continue
    if any(a == b"--out" and b == out.encode() for a, b in itertools.pairwise(args)):
      found[int(entry.name)] = " ".join(a.decode() for a in args)
  return found


def replica_pids(out: str) -> dict[int, int]:
  """Replica id -> pid of the run's live replica processes (``optax-dist replica``)."""
  pids = {}
  for pid, line in processes(out).items():
    args = line.split()
    if "replica" in args and "--replica-id" in args:
      pids[int(args[args.index("--replica-id") + 1])] = pid
  return pids


def kill_all(out: str) -> None:
  """SIGKILLs (and SIGCONTs) every process of the run ``out`` until none is left."""
  for _ in range(50):
    found = processes(out)
    if not found:
      return
    for pid, sig in itertools.product(found, (signal.SIGKILL, signal.SIGCONT)):
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    time.sleep(0.1)
  raise RuntimeError(f"chaos: processes of {out} survive SIGKILL: {sorted(processes(out))}")


def read_lines(out: str) -> list[dict[str, Any]]:
  """Every replica's JSONL lines of the run ``out``, by time."""
  lines = []
  for path in sorted(pathlib.Path(out, "replicas").glob("replica_*.jsonl")):
    lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return sorted(lines, key=lambda line: line["time"])


class CpuShares:
  """Equal CPU caps: one cgroup per replica, each allowed ``cpus / replicas`` CPUs (``cpu.max``
  on cgroup v2, the CFS quota of v1's ``cpu`` controller), so that a stopped or restarting
  replica's share stays idle instead of speeding up the others. :meth:`add` moves a replica's
  process (all its threads) into its group; the groups are removed on exit, their processes
  moved back first. ``cpus`` 0: no caps, :meth:`add` does nothing.

  Raises:
    RuntimeError: caps asked for, and no cgroup ``cpu`` controller is mounted.
  """

  PERIOD_US = 100_000

  def __init__(self, replicas: int, cpus: float):
    self.quota_us = int(self.PERIOD_US * cpus / replicas) if cpus else 0
    self.root, self.v2 = self._controller() if self.quota_us else (None, False)
    name = f"optax_dist_chaos_{os.getpid()}"
    self.groups = [self.root / f"{name}_{i}" for i in range(replicas)] if self.root else []

  @staticmethod
  def _controller() -> tuple[pathlib.Path, bool]:
    controllers = pathlib.Path("/sys/fs/cgroup/cgroup.controllers")
    if controllers.exists() and "cpu" in controllers.read_text().split():
      return controllers.parent, True
    v1 = pathlib.Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
      return v1, False
    raise RuntimeError("chaos: no cgroup cpu controller under /sys/fs/cgroup (or --cpus 0)")

  def __enter__(self) -> CpuShares:
    if self.v2:
      (self.root / "cgroup.subtree_control").write_text("+cpu")
    for group in self.groups:
      group.mkdir()
      if self.v2:
        (group / "cpu.max").write_text(f"{self.quota_us} {self.PERIOD_US}")
      else:
        (group / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(self.quota_us))
    return self

  def add(self, replica: int, pid: int) -> None:
    if self.groups:
      with contextlib.suppress(ProcessLookupError, OSError):  # it may have died meanwhile
        (self.groups[replica] / "cgroup.procs").write_text(str(pid))

  def __exit__(self, *exc: Any) -> None:
    for group in self.groups:
      with contextlib.suppress(FileNotFoundError):
        for pid in (group / "cgroup.procs").read_text().split():
          with contextlib.suppress(ProcessLookupError, OSError):
            (self.root / "cgroup.procs").write_text(pid)
        group.rmdir()


def drive(config: Config, out: str, faults: list[Fault]) -> dict[str, Any]:
  """Runs the command into ``out`` and applies ``faults`` on the clock of its first commit.

  Returns the run's record: ``t0`` (Unix time of the first commit), ``events`` (``[t, kind,
  replica, pid]``, ``t`` in seconds after ``t0``: ``start`` of a replica process, ``kill``,
  ``stop``, ``cont``, ``skipped``), ``lines`` (the JSONL lines), ``final`` (the replicas'
  ``final_<i>.json``), ``status``, ``wall_s`` and the load averages. Every process of the run is
  gone when it returns or raises.
  """
  os.makedirs(out, exist_ok=True)
  with (kit.Timed() as timed, open(os.path.join(out, "command.log"), "w") as log,
        CpuShares(config.replicas, config.cpus) as shares):
    proc = subprocess.Popen(command(config, out), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
      t0, events = _inject(proc, out, faults, time.monotonic() + config.timeout, shares)
    finally:
      kill_all(out)
      proc.wait()
  final = [json.loads(p.read_text()) for p in sorted(pathlib.Path(out, "replicas").glob(
    "final_*.json"))]
  return {"t0": t0, "events": events, "lines": read_lines(out), "final": final,
          "status": proc.returncode, **timed.record()}


def _inject(proc: subprocess.Popen, out: str, faults: list[Fault], deadline: float,
            shares: CpuShares) -> tuple[float | None, list[list[Any]]]:
  """Until ``proc`` ends: notes each new replica process (and moves it into its CPU share, at
  most 0.1 s after it appears), applies the due faults and the due ``SIGCONT``s (see
  :func:`drive`), no fault once a replica has finished; returns ``t0`` and the events."""
  events, seen, pending, t0 = [], {}, sorted(faults, key=lambda f: f.at), None
  conts: list[tuple[float, int, int]] = []
  while proc.poll() is None:
    if time.monotonic() > deadline:
      raise TimeoutError(f"chaos: the run {out} is past its --timeout")
    pids = replica_pids(out)
    t0 = t0 or min((x["time"] for x in read_lines(out) if x["committed"]), default=None)
    now = time.time() - (t0 or time.time())
    for i, pid in pids.items():
      if seen.get(i) != pid:
        seen[i] = pid
        shares.add(i, pid)
        events.append([now, "start", i, pid])
    for cont in [c for c in conts if c[0] <= now]:
      conts.remove(cont)
      _signal(cont[2], signal.SIGCONT, events, now, "cont", cont[1])
    if any(pathlib.Path(out, "replicas").glob("final_*.json")):
      pending = []  # a replica has finished: the run is ending
    while t0 is not None and pending and pending[0].at <= now:
      fault = pending.pop(0)
      pid = pids.get(fault.replica)
      if pid is None or any(c[1] == fault.replica for c in conts):
        events.append([now, "skipped", fault.replica, pid])
      elif fault.kind == "kill":
        _signal(-pid, signal.SIGKILL, events, now, "kill", fault.replica)
      else:
        _signal(pid, signal.SIGSTOP, events, now, "stop", fault.replica)
        conts.append((now + fault.seconds, fault.replica, pid))
    time.sleep(0.1)
  return t0, events


def _signal(pid: int, sig: int, events: list[list[Any]], now: float, kind: str, replica: int
            ) -> None:
  """Sends ``sig`` to ``pid`` (a group if negative) and records it, or a ``skipped``."""
  try:
    os.kill(pid, sig)
  except ProcessLookupError:
    kind = "skipped"
  events.append([now, kind, replica, abs(pid)])


def committed_tokens(lines: list[dict[str, Any]], t0: float, span: float) -> int:
  """The weights of the committed lines with ``t0 < time <= t0 + span`` (the first commit's
  round is the clock's origin and is not counted)."""
  return sum(line["weight"] for line in lines if line["committed"] and
             t0 < line["time"] <= t0 + span)


def heal_times(lines: list[dict[str, Any]], t0: float, events: list[list[Any]]) -> list[float]:
  """Seconds from each ``start`` (after ``t0``) or ``cont`` event of a replica to that replica's
  next committed line; an event not followed by a commit is left out."""
  out = []
  for at, kind, replica, _ in events:
    if kind == "cont" or (kind == "start" and at > 0):
      after = [line["time"] - t0 for line in lines if line["replica"] == replica and
               line["committed"] and line["time"] - t0 > at]
      if after:
        out.append(min(after) - at)
  return out


def accounting(run: dict[str, Any], span: float) -> dict[str, Any]:
  """A run's numbers over its first ``span`` seconds (see the module's docstring)."""
  lines, t0 = run["lines"], run["t0"]
  rounds: dict[int, list[dict[str, Any]]] = {}
  for line in lines:
    rounds.setdefault(line["round"], []).append(line)
  commits = sorted({max(x["time"] for x in group if x["committed"]) - t0
                    for group in rounds.values() if any(x["committed"] for x in group)})
  restarts = [e for e in run["events"] if e[1] == "start" and e[0] > 0]
  first = [next((x["quorum_seconds"] for x in lines if x["pid"] == pid), None)
           for _, _, _, pid in restarts]
  heals = heal_times(lines, t0, run["events"])
  return {
    "committed_tokens": committed_tokens(lines, t0, span),
    "useful_work": sum(x["weight"] for x in lines if x["committed"]) / sum(
      x["tokens"] for x in lines), "rounds_committed": len(commits),
    "rounds_aborted": sum(not any(x["committed"] for x in g) for g in rounds.values()),
    "abort_lines": sum(not x["committed"] for x in lines),
    "hash_mismatches": sum(len({x["state_hash"] for x in g if x["committed"]}) > 1
                           for g in rounds.values()),
    "longest_stall_s": float(max(np.diff(commits), default=0.0)), "heal_s": heals,
    "heal_p50_s": float(np.percentile(heals, 50)) if heals else None,
    "heal_p95_s": float(np.percentile(heals, 95)) if heals else None,
    "first_quorum_s": [q for q in first if q is not None], "timeline": _timeline(lines, t0),
  }


def _timeline(lines: list[dict[str, Any]], t0: float, points: int = 400) -> list[list[float]]:
  """``[seconds after t0, committed tokens so far]`` at about ``points`` of the committed lines
  after ``t0``, the last one included."""
  done = [(x["time"] - t0, x["weight"]) for x in lines if x["committed"] and x["time"] > t0]
  total = np.cumsum([w for _, w in done])
  keep = sorted(set(range(0, len(done), max(1, len(done) // points))) | {len(done) - 1})
  return [[done[i][0], float(total[i])] for i in keep if i >= 0]


def compare(control: dict[str, Any], faulted: dict[str, Any]) -> dict[str, Any]:
  """Both runs' accounting over the span both ran (the shorter's, first commit to last line)."""
  span = min(max(x["time"] for x in run["lines"]) - run["t0"] for run in (control, faulted))
  a, b = accounting(control, span), accounting(faulted, span)
  return {"span_s": span, "control": a, "faulted": b,
          "goodput": b["committed_tokens"] / a["committed_tokens"]}


def measure(config: Config, prefix: str) -> dict[str, Any] | None:
  """The control run, the schedule over its span, the faulted run (their directories, logs
  included, in ``PREFIX_runs/``); their comparison."""
  if os.geteuid() != 0:
    print("[chaos] skipped: needs root (make bench-chaos)", file=sys.stderr)
    return None
  control = drive(config, f"{prefix}_runs/control", [])
  span = max(line["time"] for line in control["lines"]) - control["t0"]
  faults = schedule(config.seed, config.fault_rate, span, config.replicas,
                    tuple(config.stop_seconds))
  faulted = drive(config, f"{prefix}_runs/faulted", faults)
  keys = ("events", "final", "status", "wall_s", "load_before", "load_after")
  return {"config": dataclasses.asdict(config), "faults": [dataclasses.asdict(f) for f in faults],
          "horizon_s": span, **compare(control, faulted),
          "runs": {k: {key: run[key] for key in keys}
                   for k, run in (("control", control), ("faulted", faulted))}}


ROWS = (
  ("committed tokens in the span", lambda a, r: a["committed_tokens"]),
  ("useful-work ratio", lambda a, r: f"{a['useful_work']:.3f}"),
  ("rounds committed (whole run)", lambda a, r: a["rounds_committed"]),
  ("rounds aborted everywhere / abort lines",
   lambda a, r: f"{a['rounds_aborted']} / {a['abort_lines']}"),
  ("state-hash mismatches", lambda a, r: a["hash_mismatches"]),
  ("longest stall (s)", lambda a, r: f"{a['longest_stall_s']:.2f}"),
  ("heal p50 / p95 (s)", lambda a, r: " / ".join(
    kit.fmt(a[k], ".2f") for k in ("heal_p50_s", "heal_p95_s")) + f" (n = {len(a['heal_s'])})"),
  ("restarted replica's first quorum (s)",
   lambda a, r: ", ".join(f"{q:.2f}" for q in a["first_quorum_s"]) or "—"),
  ("final held-out metric (mean of replicas)", lambda a, r: _metric(r["final"])),
  ("exit status / wall clock (s)", lambda a, r: f"{r['status']} / {r['wall_s']:.0f}"),
  ("load average before → after", lambda a, r: kit.loads(r["load_before"], r["load_after"])))
"""The report's table: a label, and the cell of one run from its accounting and its record."""


def _metric(final: list[dict[str, Any]]) -> str:
  items = [(k, v) for line in final for k, v in line.items() if k.startswith("test_")]
  names = sorted({k for k, _ in items})
  return f"{', '.join(names)} {np.mean([v for _, v in items]):.4f}" if items else "—"


def markdown(result: dict[str, Any], figure: str) -> str:
  cfg, runs = result["config"], result["runs"]
  kinds = [e[1] for e in runs["faulted"]["events"] if 0 < e[0] <= result["span_s"]]
  rows = [[label] + [cell(result[k], runs[k]) for k in ("control", "faulted")]
          for label, cell in ROWS]
  return "\n\n".join([
    "# Chaos: fault-tolerant DiLoCo under faults", kit.doc_markdown(__doc__, 0, 3),
    (f"Settings: `{' '.join(command(Config(**cfg), 'OUT')[2:])}`;"
     f"{_caps(cfg)} faults: rate"
     f" {cfg['fault_rate']:.3f}/s, seed {cfg['seed']}, over the control's span of"
     f" {result['horizon_s']:.1f} s; within the span counted: {kinds.count('kill')} kills,"
     f" {kinds.count('stop')} stops, {kinds.count('skipped')} skipped (the plot shows all)."),
    (f"**Goodput {result['goodput']:.3f}** (committed tokens of the faulted run over the"
     f" control's, over the first {result['span_s']:.1f} s after each run's first commit, the"
     " span both ran)."),
    (f"Target: goodput ≥ {TARGET_GOODPUT} (Decoupled DiLoCo reports 0.88) and no state-hash"
     f" mismatch: {'met' if _met(result) else 'missed'}."),
    kit.table(["", "control", "faults"], rows), f"![committed tokens]({figure})",
    _not_built(cfg),
    (f"Run {result['run']['date']}: `{result['run']['command']}`,"
     f" {result['run']['seconds']:.0f} s.")])


def _met(result: dict[str, Any]) -> bool:
  return result["goodput"] >= TARGET_GOODPUT and result["faulted"]["hash_mismatches"] == 0


def _caps(cfg: dict[str, Any]) -> str:
  """The CPU caps in the settings' line (none in results measured before they existed)."""
  cpus = cfg.get("cpus", 0)
  return f" each replica capped at {cpus / cfg['replicas']:.2f} CPU (cgroups);" if cpus else ""


def _not_built(cfg: dict[str, Any]) -> str:
  missing = ("synchronous data parallelism with checkpoint-restart on the same schedule,"
             " link-down faults (network namespaces), a lighthouse kill,")
  if cfg.get("cpus", 0):
    return (f"Not built here: {missing} the lm task and a 10-minute schedule of 15 faults. The"
            " replicas' caps leave a stopped replica's share idle; a restarted one spends its"
            " first seconds importing JAX and torch within its share (it runs uncapped for at"
            " most 0.1 s after it starts, until the study moves it into its group).")
  return (f"Not built here: {missing} an equal CPU share per replica (cgroup `cpu.max`), the lm"
          " task and a 10-minute schedule of 15 faults. The replicas share 2 cores with whatever"
          " else runs: a stopped replica frees CPU for the others, and a restarted one spends its"
          " first seconds importing JAX and torch.")


def plot(result: dict[str, Any], path: str) -> None:
  fig, ax = kit.plt.subplots(figsize=(8, 4.5))
  for name in ("control", "faulted"):
    t = np.array(result[name]["timeline"] or [[0, 0]])
    ax.plot(t[:, 0], t[:, 1], label=name, drawstyle="steps-post")
  colors = {"kill": "red", "stop": "orange", "cont": "green", "start": "grey"}
  for at, kind, replica, _ in result["runs"]["faulted"]["events"]:
    if at > 0 and kind in colors:
      ax.axvline(at, color=colors[kind], lw=0.8, ls=":" if kind == "start" else "-")
      ax.text(at, ax.get_ylim()[1], f"{kind} {replica}", rotation=90, fontsize=6, va="top")
  ax.axvline(result["span_s"], color="black", lw=0.8, ls="--", label="the span counted")
  ax.set_xlabel("seconds after the first commit")
  ax.set_ylabel("committed tokens")
  ax.set_title(f"goodput {result['goodput']:.3f}: kill (red), stop (orange), cont (green),"
               " restart (grey)", fontsize=9)
  ax.legend()
  kit.save_figure(fig, path)
