"""Training through failures: fault-tolerant DiLoCo under a fixed-seed Poisson schedule of faults.

Two runs of ``optax-dist train --fault-tolerant`` (a torchft Lighthouse and R replica processes,
``--devices 1`` each; the launcher restarts a dead replica after ``--restart-delay`` s and it
heals at its first quorum) with the same settings and seed, started together and sharing the
machine: a control without faults, and the faulted run. Each run's launcher and Lighthouse run
in a hub network namespace of its own, each replica in one of its own joined to its hub's
bridge by a veth pair (:class:`netns.Star`, unshaped). Each run's clock starts at its first
commit (imports and compilation untimed). The faults are drawn with ``--seed``: exponential
gaps of mean ``1 / --fault-rate`` s, each on a uniform replica and of a uniform kind: a ``kill
-9`` of the replica's process group, a ``SIGSTOP`` for ``--stop-seconds`` (uniform) then
``SIGCONT``, or its link down (its bridge port: nothing passes either way) for
``--link-seconds`` (uniform) then up; one on a replica that is not running (or already
stopped, or cut off) is recorded as skipped. They are applied while the control runs. The
faulted run also has its Lighthouse killed once (``kill -9``), ``--lighthouse-kill`` s after
its first commit; the launcher starts it again on its address.

Measured from the replicas' logs (``OUT/replicas/replica_<i>.jsonl``):

* goodput: the faulted run's committed tokens (the committed lines' weights: a healer's
  weight-0 round counts nothing) over the control's, over the span both ran (the shorter run's,
  from each run's first commit);
* useful-work ratio: committed tokens over the tokens of the logged rounds (a killed replica's
  unfinished round is not logged: an upper bound);
* heal time: from a restarted replica's first appearance in the process tree, a stopped one's
  ``SIGCONT`` or a cut-off one's link up, to its next committed round; a restarted replica's
  first ``quorum_seconds`` (quorum request to quorum, heal included), and the rounds from its
  first round to its first commit (a heal within one round: 0 or 1);
* heals, and of them the unprovoked ones: to a replica without a fault of its own (nor a
  Lighthouse kill) in the 20 s before (a heal cascade's mark);
* longest stall (gap between commits), aborted rounds, rounds committed after a retry (a line
  with ``attempts`` > 1), the rounds whose committed lines hold more than one ``state_hash``
  (must be 0), and the final held-out metric (``final_<i>.json``).

Beside them (``--sync-checkpoint-every`` > 0), synchronous data parallelism with today's remedy
under the same schedule, and its own control: ``optax-dist train --algorithm sync`` over R
``jax.distributed`` processes checkpointing every ``--sync-checkpoint-every`` steps, started again
with ``--resume`` ``--restart-delay`` s after a fault ends it (:class:`SyncRun`); its tokens
count once checkpointed, from its first checkpoint, for the DiLoCo control's span; the two are
started together too, after the first pair. Its processes share this machine's network: its
schedule is the kills and stops only.

Every process of a run (launcher, Lighthouse, replicas: found by the run's directory in their
command lines) is killed when it ends, and its namespaces removed, also on an exception or
Ctrl-C. Needs root (``make bench-chaos``); says so and exits with 0 otherwise.

Each replica process runs in a cgroup of its own capped at ``--cpus / 2R`` CPUs
(:class:`CpuShares`; ``--cpus 0`` leaves them uncapped), so that a stopped or restarting
replica's share stays idle rather than speeding up the others, and the two runs of a pair keep
one pace; the groups are removed at the end, also after an error. Run together, the control
and the faulted run see the same machine: a drift of its pace (about ±10% between runs one
after the other) touches both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import kit
from benchmarks.network import netns
from optax_dist.cli import ft_task, orbax_checkpoints
from optax_dist.cli.ft_flags import DEFAULTS
from optax_dist.cli.main import build_parser
from optax_dist.fault_tolerance.rundir import RunDir, by_round

KINDS = ("kill", "stop", "link")
TARGET_GOODPUT = 0.9


@dataclasses.dataclass(frozen=True)
class Config:
  replicas: int = kit.option(4, "R, replica processes")
  min_replicas: int = kit.option(
    3, "the smallest quorum that commits; a majority of the replicas (the command's default)"
    " keeps two quorums without a common member from committing the same round")
  algorithm: str = kit.option("diloco", "the command's --algorithm (diloco, streaming_diloco,"
                              " local_sgd)")
  task: str = kit.option("lm", "the command's --task")
  sync_period: int = kit.option(20, "H, inner steps per round")
  steps: int = kit.option(6_000, "committed inner steps of each run (--steps): at least 10"
                          " minutes of the control")
  fault_rate: float = kit.option(1 / 30, "faults per second (Poisson)")
  stop_seconds: tuple[float, float] = kit.option((3.0, 10.0), "a SIGSTOP's length, uniform")
  link_seconds: tuple[float, float] = kit.option((5.0, 15.0), "a link down's length, uniform")
  restart_delay: float = kit.option(2.0, "seconds before the launcher restarts a dead replica")
  exchange_timeout: float = kit.option(2.0, "--exchange-timeout of the replicas, seconds")
  exchange_retries: int = kit.option(
    DEFAULTS["exchange_retries"], "--exchange-retries: new quorums for a round whose exchange"
    " failed (the command's default)")
  join_timeout: float = kit.option(
    DEFAULTS["join_timeout"], "--join-timeout: seconds the Lighthouse waits for a heartbeating"
    " replica that has not asked for the quorum (the command's default)")
  heartbeat_timeout: float = kit.option(
    1.0, "--lighthouse-heartbeat-timeout: seconds of silence before a replica is dropped")
  finish_grace: float = kit.option(2.0, "--finish-grace: seconds the others have to finish")
  seed: int = kit.option(0, "seed of the fault schedule (the runs' --seed stays 0)")
  reuse: bool = kit.option(False, "read back the runs a study with the same settings finished"
                                  " under PREFIX_runs/ (NAME.json) instead of running them again")
  timeout: float = kit.option(1800.0, "seconds after which a pair of runs is stopped")
  cpus: float = kit.option(float(os.cpu_count() or 1),
                           "CPUs a pair of runs shares, each replica capped at cpus / 2R (cgroups);"
                           " 0: none")
  sync_checkpoint_every: int = kit.option(
    100, "the synchronous arm's --checkpoint-every (steps); 0: no synchronous arm")
  lighthouse_kill: float = kit.option(
    300.0, "when the faulted run's Lighthouse is killed, seconds after its first commit; 0: never")
  standby: bool = kit.option(
    True, "the command's --standby: a warm standby process per replica id, outside the CPU groups"
    " at the lowest priority until it takes over a dead replica's id (and its group)")
  checkpoint_every: int = kit.option(
    200, "the fault-tolerant runs' --checkpoint-every (steps): their validation curves' points;"
    " 0: none")


QUICK = {"steps": 400, "fault_rate": 1 / 8, "sync_checkpoint_every": 20, "lighthouse_kill": 15.0,
         "checkpoint_every": 100}


@dataclasses.dataclass(frozen=True)
class TimedFault:
  """At ``at`` seconds after the first commit: ``kind`` on ``replica``, for ``seconds`` (stop,
  link). (The in-process engine's :class:`optax_dist.fault_tolerance.Fault` is by round.)"""

  at: float
  kind: str
  replica: int
  seconds: float = 0.0


def schedule(seed: int, rate: float, horizon: float, replicas: int,
             stop_seconds: tuple[float, float] = (3.0, 10.0),
             link_seconds: tuple[float, float] = (5.0, 15.0)) -> list[TimedFault]:
  """The faults of a Poisson process of ``rate`` per second over ``[0, horizon)`` seconds.

  Gaps are exponential with mean ``1 / rate``; each fault's kind (:data:`KINDS`: ``kill``,
  ``stop``, ``link``) and replica are uniform, a stop's length uniform in ``stop_seconds``, a
  link's in ``link_seconds``. The draws are sequential from ``numpy.random.default_rng(seed)``:
  a longer horizon extends the same list.

  Raises:
    ValueError: ``rate`` or ``horizon`` not positive, ``replicas < 1``, ``stop_seconds`` or
      ``link_seconds`` not an interval of positive seconds.
  """
  lengths = {"kill": (0.0, 0.0), "stop": stop_seconds, "link": link_seconds}
  if not (rate > 0 and horizon > 0 and replicas >= 1 and
          all(0 < lengths[k][0] <= lengths[k][1] for k in ("stop", "link"))):
    raise ValueError(f"chaos.schedule: need rate > 0, horizon > 0, replicas >= 1 and"
                     f" intervals 0 < a <= b of stop_seconds and link_seconds, got rate={rate},"
                     f" horizon={horizon}, replicas={replicas}, stop_seconds={stop_seconds},"
                     f" link_seconds={link_seconds}")
  rng, t, faults = np.random.default_rng(seed), 0.0, []
  while True:
    t += rng.exponential(1 / rate)
    kind = KINDS[rng.integers(len(KINDS))]
    replica, seconds = int(rng.integers(replicas)), float(rng.uniform(*lengths[kind]))
    if t >= horizon:
      return faults
    faults.append(TimedFault(round(t, 3), kind, replica, round(seconds, 3)))


def command(config: Config, out: str, star: netns.Star | None = None) -> list[str]:
  """``optax-dist train --fault-tolerant`` of the study's settings, writing to ``out``; with
  ``star``, run in its hub (the Lighthouse on the hub's address) and each replica in its own
  namespace (``--replica-netns``)."""
  c = config
  flags = [("--algorithm", c.algorithm), ("--fault-tolerant",), ("--replicas", c.replicas),
           ("--min-replicas", c.min_replicas), ("--devices", 1), ("--task", c.task),
           ("--steps", c.steps), ("--sync-period", c.sync_period),
           ("--restart-delay", c.restart_delay), ("--max-restarts", 1000),
           ("--exchange-timeout", c.exchange_timeout), ("--exchange-retries", c.exchange_retries),
           ("--join-timeout", c.join_timeout), ("--finish-grace", c.finish_grace),
           ("--lighthouse-heartbeat-timeout", c.heartbeat_timeout), ("--no-progress",),
           ("--out", out)]
  flags += [] if star is None else [("--host", star.address), ("--replica-netns", star.pattern)]
  flags += [("--checkpoint-every", c.checkpoint_every)] * bool(c.checkpoint_every)
  flags += [("--standby",)] * c.standby
  return ([] if star is None else star.exec_prefix()) + _train(flags)


def _train(flags: list[tuple[Any, ...]]) -> list[str]:
  """``optax-dist train`` (this interpreter, ``-m optax_dist.cli``) with ``flags``: ``(flag,
  value)`` pairs and ``(flag,)`` switches."""
  return [sys.executable, "-m", "optax_dist.cli", "train", *(str(x) for f in flags for x in f)]


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


def process_ids(out: str, flag: str) -> dict[int, int]:
  """``INDEX -> pid`` of the run's live processes whose command line holds ``flag INDEX``
  (``--replica-id`` for the replicas, ``--process-id`` for ``jax.distributed`` processes), but
  a waiting standby's (``--wait-for-takeover``, not yet named by the launcher's
  ``OUT/replica_<INDEX>.pid``)."""
  pids, run = {}, RunDir(out)
  for pid, line in processes(out).items():
    args = line.split()
    if flag in args:
      index = int(args[args.index(flag) + 1])
      if "--wait-for-takeover" not in args or run.replica_pid(index) == pid:
        pids[index] = pid
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


class CpuShares:
  """Equal CPU caps: one cgroup per replica, each allowed ``cpus / replicas`` CPUs (``cpu.max``
  on cgroup v2, the CFS quota of v1's ``cpu`` controller), so that a stopped or restarting
  replica's share stays idle instead of speeding up the others. :meth:`add` moves a replica's
  process (all its threads) into its group; the groups are removed on exit, their processes
  moved back first. ``cpus`` 0: no caps, :meth:`add` does nothing. The groups are named
  ``optax_dist_chaos_PIDTAG_I``: ``tag`` tells apart the runs of one process.

  Raises:
    RuntimeError: caps asked for, and no cgroup ``cpu`` controller is mounted.
  """

  PERIOD_US = 100_000

  def __init__(self, replicas: int, cpus: float, tag: str = ""):
    self.quota_us = int(self.PERIOD_US * cpus / replicas) if cpus else 0
    self.root, self.v2 = self._controller() if self.quota_us else (None, False)
    name = f"optax_dist_chaos_{os.getpid()}{tag}"
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
      for attempt in range(50):  # a killed process leaves its group only once it has exited
        try:
          for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, OSError):
              (self.root / "cgroup.procs").write_text(pid)
          group.rmdir()
          break
        except FileNotFoundError:
          break
        except OSError:  # EBUSY
          if attempt == 49:
            raise
          time.sleep(0.1)


class Run:
  """One command of the study under a fault schedule, as a ``with`` block that :func:`together`
  drives: entering empties ``out`` (an earlier run's files would set the clock or be resumed),
  makes the run's CPU groups (``cpus`` shared by its R processes) and starts the command;
  :meth:`tick` looks at it once and applies due faults (:meth:`inject`); leaving kills every
  process of the run and removes its groups (and namespaces), also on an exception or Ctrl-C.
  ``tag``, one lower-case letter, tells apart the groups and namespaces of runs that share the
  machine."""

  flag, group = "", False
  """The flag whose value is a process's index (``--replica-id``, ``--process-id``), and whether
  a ``kill -9`` is of the process's group."""

  def __init__(self, config: Config, out: str, faults: list[TimedFault], cpus: float, tag: str):
    self.config, self.out, self.cpus, self.tag = config, out, cpus, tag
    self.timed, self.stack, self.dir = kit.Timed(), contextlib.ExitStack(), RunDir(out)
    self.pending = sorted(faults, key=lambda f: f.at)
    self.events: list[list[Any]] = []  # [t, kind, replica, pid]
    self.seen: dict[int, int] = {}
    self.undo: list[tuple[float, int, int, str]] = []  # (when, replica, pid, cont or up)
    self.t0: float | None = None

  def __enter__(self) -> Run:
    shutil.rmtree(self.out, ignore_errors=True)
    os.makedirs(self.out)
    try:
      self.stack.enter_context(self.timed)
      self.log = self.stack.enter_context(open(os.path.join(self.out, "command.log"), "w"))
      self.shares = self.stack.enter_context(CpuShares(self.config.replicas, self.cpus, self.tag))
      self.star = self._network()
      self.proc = self._start(resume=False)
      self.stack.callback(self._end)
    except BaseException:
      self.stack.close()
      raise
    return self

  def __exit__(self, *exc: Any) -> None:
    self.stack.close()

  def _end(self) -> None:
    kill_all(self.out)
    self.proc.wait()

  def _start(self, resume: bool) -> subprocess.Popen:
    return subprocess.Popen(self._command(resume), stdout=self.log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=self._env())

  def _network(self) -> netns.Star | None:
    return None

  def _env(self) -> dict[str, str] | None:
    return None

  def record(self) -> dict[str, Any]:
    return {"t0": self.t0, "events": self.events, "status": self.proc.returncode,
            **self.timed.record()}

  def now(self) -> float:
    """Seconds after ``t0`` (0 before it is known)."""
    return time.time() - (self.t0 or time.time())

  def inject(self, t0: float | None, *, ending: bool) -> None:
    """One look at the run's processes (those whose command line holds ``flag INDEX``, e.g.
    ``--replica-id 2``) on the clock of its first progress ``t0`` (once known): each new process
    is recorded (``start``; a standby when it takes over) and moved into its CPU share (a
    waiting standby stays outside, at the lowest priority); a due fault is a ``kill -9`` (of the
    process group with ``group``) or a ``SIGSTOP`` followed by ``SIGCONT`` ``seconds`` later, a
    link down (``star``'s) then up ``seconds`` later, or a ``kill -9`` of the run's Lighthouse
    (kind ``lighthouse``, replica -1), or ``skipped`` when its process is not running or already
    stopped or cut off. With ``ending``, no fault any more."""
    pids = process_ids(self.out, self.flag)
    self.t0 = self.t0 or t0
    now = self.now()
    for i, pid in pids.items():
      if self.seen.get(i) != pid:
        self.seen[i] = pid
        self.shares.add(i, pid)
        self.events.append([now, "start", i, pid])
    for undo in [u for u in self.undo if u[0] <= now]:
      self.undo.remove(undo)
      self._apply(undo[3], undo[1], undo[2], now)
    if ending:
      self.pending = []
    while self.t0 is not None and self.pending and self.pending[0].at <= now:
      fault = self.pending.pop(0)
      pid = self.dir.lighthouse_pid() if fault.kind == "lighthouse" else pids.get(fault.replica)
      if pid is None or any(u[1] == fault.replica for u in self.undo):
        self.events.append([now, "skipped", fault.replica, pid])
        continue
      self._apply(fault.kind, fault.replica, pid, now)
      if fault.kind in ("stop", "link"):
        self.undo.append((now + fault.seconds, fault.replica, pid,
                          "cont" if fault.kind == "stop" else "up"))

  def _apply(self, kind: str, replica: int, pid: int, now: float) -> None:
    """Applies ``kind`` to ``replica`` (its process ``pid``) and records it, or a ``skipped``
    when its process has gone."""
    if kind in ("link", "up"):
      self.star.set_link(replica, up=kind == "up")
    else:
      sig = {"kill": signal.SIGKILL, "lighthouse": signal.SIGKILL, "stop": signal.SIGSTOP,
             "cont": signal.SIGCONT}[kind]
      try:
        os.kill(-pid if kind == "kill" and self.group else pid, sig)
      except ProcessLookupError:
        kind = "skipped"
    self.events.append([now, kind, replica, pid])


class FaultTolerantRun(Run):
  """``optax-dist train --fault-tolerant`` (:func:`command`) in a :class:`netns.Star`'s hub, each
  replica in a namespace of its own, its faults on the clock of its first commit. Its record:
  ``t0`` (Unix time of the first commit), ``events`` (``[t, kind, replica, pid]``, ``t`` in
  seconds after ``t0``: ``start`` of a replica process, ``kill``, ``stop``, ``cont``, ``link``
  (down), ``up``, ``lighthouse``, ``skipped``), ``lines`` (the JSONL lines), ``final`` (the
  replicas' ``final_<i>.json``), ``curve`` (the held-out metric of each checkpoint:
  :func:`optax_dist.cli.ft_task.checkpoint_metrics`, evaluated here after the run),
  ``status``, ``wall_s`` and the load averages."""

  flag, group = "--replica-id", True

  def _network(self) -> netns.Star:
    return self.stack.enter_context(netns.Star(self.config.replicas, self.tag))

  def _command(self, resume: bool) -> list[str]:
    return command(self.config, self.out, self.star)

  def tick(self, ending: bool) -> bool:
    """One look; ``ending``: no fault any more (nor once a replica has finished: the run is
    ending). Whether the command still runs."""
    self.inject(self.t0 or self.dir.first_commit(), ending=ending or self.dir.finished())
    return self.proc.poll() is None

  def record(self) -> dict[str, Any]:
    args = build_parser().parse_args(command(self.config, self.out)[3:])
    return {**super().record(), "lines": self.dir.lines(), "final": [*self.dir.final().values()],
            "curve": ft_task.checkpoint_metrics(args)}


class SyncRun(Run):
  """Synchronous data parallelism with today's remedy (:func:`sync_command`), for ``horizon``
  seconds after its first checkpoint: a fault that ends the command (the launcher stops every
  process when one dies) is followed, ``--restart-delay`` s later, by the same command with
  ``--resume``, which goes on from the newest checkpoint; its processes share a persistent
  compilation cache under ``out/compilation_cache``. Its faults (``kill -9`` of one process,
  ``SIGSTOP``; no link faults: its processes share the machine's network) are on the clock of
  the first checkpoint. Its record is :class:`FaultTolerantRun`'s with ``t0`` the first
  checkpoint's time, ``saved`` (``[Unix time, step]`` of each new checkpoint as it appears) and
  ``events`` also holding ``exit`` (``[t, "exit", -1, status]``) and ``resume`` (``[t,
  "resume", -1, pid]``); no ``lines``."""

  flag = "--process-id"

  def __init__(self, config: Config, out: str, faults: list[TimedFault], cpus: float, tag: str,
               horizon: float):
    super().__init__(config, out, [f for f in faults if f.kind != "link"], cpus, tag)
    self.horizon, self.saved, self.restart_at = horizon, [], None
    self.directory = os.path.join(out, "checkpoints", "sync")

  def _command(self, resume: bool) -> list[str]:
    return sync_command(self.config, self.out, resume)

  def _env(self) -> dict[str, str]:
    # a restart reads its programs back, as the fault-tolerant replicas do
    cache = os.path.abspath(os.path.join(self.out, "compilation_cache"))
    return {"JAX_COMPILATION_CACHE_DIR": cache} | os.environ

  def tick(self, ending: bool) -> bool:
    """One look (``ending`` has no effect: the run ends at its horizon); restarts the command
    when it ended with an error. Whether the run goes on."""
    if self.restart_at is None and self.proc.poll() is not None:
      if self.proc.returncode == 0:
        return False  # every step done before the horizon
      self.events.append([self.now(), "exit", -1, self.proc.returncode])
      self.restart_at = time.monotonic() + self.config.restart_delay
    if self.restart_at is not None and time.monotonic() >= self.restart_at:
      self.proc, self.restart_at = self._start(resume=True), None
      self.events.append([self.now(), "resume", -1, self.proc.pid])
    steps = orbax_checkpoints.saved_steps(self.directory)
    if steps and (not self.saved or steps[-1] > self.saved[-1][1]):
      self.saved.append([time.time(), steps[-1]])
    self.inject(self.saved[0][0] if self.saved else None, ending=False)
    return self.t0 is None or self.now() <= self.horizon

  def record(self) -> dict[str, Any]:
    return {**super().record(), "saved": self.saved, "final": []}


def together(runs: list[Run], timeout: float) -> list[dict[str, Any]]:
  """Starts ``runs`` at once and looks at each every 0.1 s until none goes on; once one has
  ended, the others get no more faults (a control's end ends the faulted run's schedule).
  Returns their records. Every process, CPU group and namespace of the runs is gone when it
  returns or raises.

  Raises:
    TimeoutError: a run still going on after ``timeout`` seconds.
  """
  netns.remove_stale()
  deadline = time.monotonic() + timeout
  with contextlib.ExitStack() as stack:
    for run in runs:
      stack.enter_context(run)
    going = [True] * len(runs)
    while any(going):
      if time.monotonic() > deadline:
        raise TimeoutError(f"chaos: {[r.out for r, g in zip(runs, going) if g]} past --timeout")
      going = [g and run.tick(ending=not all(going)) for run, g in zip(runs, going)]
      time.sleep(0.1)
  return [run.record() for run in runs]


def sync_command(config: Config, out: str, resume: bool) -> list[str]:
  """``optax-dist train --algorithm sync`` over R processes of one device, checkpointing every
  ``--sync-checkpoint-every`` steps (``--resume``: from the newest checkpoint)."""
  return _train([("--algorithm", "sync"), ("--processes", config.replicas), ("--devices", 1),
                 ("--task", config.task), ("--steps", config.steps),
                 ("--checkpoint-every", config.sync_checkpoint_every), ("--no-progress",),
                 ("--out", out)] + [("--resume",)] * resume)


def committed_tokens(lines: list[dict[str, Any]], t0: float, span: float) -> int:
  """The weights of the committed lines with ``t0 < time <= t0 + span`` (the first commit's
  round is the clock's origin and is not counted)."""
  return sum(line["weight"] for line in lines if line["committed"] and
             t0 < line["time"] <= t0 + span)


def heal_times(lines: list[dict[str, Any]], t0: float, events: list[list[Any]]) -> list[float]:
  """Seconds from each ``start`` (after ``t0``), ``cont`` or ``up`` event of a replica to that
  replica's next committed line; an event not followed by a commit is left out."""
  out = []
  for at, kind, replica, _ in events:
    if kind in ("cont", "up") or (kind == "start" and at > 0):
      after = [line["time"] - t0 for line in lines if line["replica"] == replica and
               line["committed"] and line["time"] - t0 > at]
      if after:
        out.append(min(after) - at)
  return out


UNPROVOKED_S = 20.0
"""A heal is *unprovoked* when its replica had no fault of its own (nor a Lighthouse kill) in
the seconds before it: it was left out of a quorum by another's fault, a heal cascade's mark."""


def unprovoked_heals(lines: list[dict[str, Any]], t0: float, events: list[list[Any]]) -> int:
  """The healed lines of a replica with no event of its own or of the Lighthouse (replica -1)
  in the ``UNPROVOKED_S`` seconds before."""
  return sum(line["healed"] and not any(
    replica in (line["replica"], -1) and 0 <= line["time"] - t0 - at <= UNPROVOKED_S
    for at, _, replica, _ in events) for line in lines)


def accounting(run: dict[str, Any], span: float) -> dict[str, Any]:
  """A run's numbers over its first ``span`` seconds (see the module's docstring)."""
  lines, t0 = run["lines"], run["t0"]
  rounds = by_round(lines)
  commits = sorted({max(x["time"] for x in group if x["committed"]) - t0
                    for group in rounds.values() if any(x["committed"] for x in group)})
  ends = {r: max(x["time"] for x in g) for r, g in rounds.items()}
  size = {r: sum(x["committed"] for x in g) for r, g in rounds.items()}
  full = [ends[r] - ends[r - 1] for r in ends if r - 1 in ends and size[r] == max(size.values())]
  restarts = [e for e in run["events"] if e[1] == "start" and e[0] > 0]
  first = [next((x["quorum_seconds"] for x in lines if x["pid"] == pid), None)
           for _, _, _, pid in restarts]
  own = [[x for x in lines if x["pid"] == pid] for _, _, _, pid in restarts]
  heals = heal_times(lines, t0, run["events"])
  return {
    "committed_tokens": committed_tokens(lines, t0, span),
    "useful_work": sum(x["weight"] for x in lines if x["committed"]) / sum(
      x["tokens"] for x in lines), "rounds_committed": len(commits),
    "rounds_aborted": sum(not any(x["committed"] for x in g) for g in rounds.values()),
    "abort_lines": sum(not x["committed"] for x in lines),
    "rounds_retried": sum(any(x["committed"] and x.get("attempts", 1) > 1 for x in g)
                          for g in rounds.values()),
    "hash_mismatches": sum(len({x["state_hash"] for x in g if x["committed"]}) > 1
                           for g in rounds.values()),
    "longest_stall_s": float(max(np.diff(commits), default=0.0)), "heal_s": heals,
    "heals": sum(x["healed"] for x in lines),
    "unprovoked_heals": unprovoked_heals(lines, t0, run["events"]),
    # the pace of a round that every replica committed: a drift between the runs shows here
    "full_round_s": float(np.median(full)) if full else None,
    "heal_p50_s": float(np.percentile(heals, 50)) if heals else None,
    "heal_p95_s": float(np.percentile(heals, 95)) if heals else None,
    "first_quorum_s": [q for q in first if q is not None], "timeline": _timeline(lines, t0),
    "curve": validation_curve(run),
    # rounds from a restarted process's first round to its first commit (0: healed and committed
    # in the round of its first quorum)
    "heal_rounds": [next((x["round"] - got[0]["round"] for x in got if x["committed"]), None)
                    for got in own if got],
  }


def validation_curve(run: dict[str, Any]) -> list[list[float]]:
  """``[seconds after t0, committed tokens up to its step (the whole run's), held-out metric]``
  of each checkpoint of the run (its record's ``curve``; none in results measured before)."""
  lines, out = run["lines"], []
  for point in run.get("curve", []):
    tokens = sum(x["weight"] for x in lines if x["committed"] and x["step"] <= point["step"])
    metric = next(v for k, v in point.items() if k.startswith("test_"))
    out.append([point["time"] - run["t0"], tokens, metric])
  return out


def equal_tokens(control: list[list[float]], faulted: list[list[float]]) -> dict | None:
  """The faulted run's last checkpoint (its final state) against the control's curve
  interpolated linearly in committed tokens at as many tokens; ``None`` without both curves."""
  if not (control and faulted):
    return None
  _, tokens, metric = faulted[-1]
  curve = np.array(control)
  at = float(np.interp(tokens, curve[:, 1], curve[:, 2]))
  return {"tokens": tokens, "faulted": metric, "control": at, "gap": metric / at - 1}


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
          "goodput": b["committed_tokens"] / a["committed_tokens"],
          "equal_tokens": equal_tokens(a["curve"], b["curve"])}


def _records(config: Config, prefix: str, names: tuple[str, ...],
             run: Callable[[list[str]], list[dict[str, Any]]]) -> list[dict[str, Any]]:
  """``run([PREFIX_runs/NAME, ...])``'s records, also written to ``PREFIX_runs/NAME.json`` with
  the settings; with ``--reuse``, read back from there when every one's settings are the same."""
  paths, settings = [f"{prefix}_runs/{n}" for n in names], [_settings(config, n) for n in names]
  saved = [kit.read_json(f"{p}.json") if config.reuse and os.path.exists(f"{p}.json") else None
           for p in paths]
  if all(s is not None and s["config"] == c for s, c in zip(saved, settings)):
    return [s["record"] for s in saved]
  records = run(paths)
  for path, config_, record in zip(paths, settings, records, strict=True):
    kit.write_json(f"{path}.json", {"config": config_, "record": record})
  return records


def _settings(config: Config, name: str) -> dict[str, Any]:
  """The settings the record of the run ``name`` depends on (not ``reuse``, ``timeout``; nor
  ``lighthouse_kill`` but for the faulted run)."""
  ignored = ("reuse", "timeout") + (() if name == "faulted" else ("lighthouse_kill",))
  return {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(config))).items()
          if k not in ignored}


def _interrupted(signum: int, frame: Any) -> None:
  raise KeyboardInterrupt(f"chaos: stopped by signal {signum}")


def sync_accounting(run: dict[str, Any], span: float, tokens_per_step: float) -> dict[str, Any]:
  """The synchronous arm's numbers over its first ``span`` seconds. Its progress survives a
  fault only once checkpointed: committed tokens are the steps of the newest checkpoint past the
  first one (the clock's origin) times ``tokens_per_step``; the longest stall is the longest gap
  between new checkpoints (the span's end included); restarts count the command's exits."""
  saved = [(t - run["t0"], step) for t, step in run["saved"] if t - run["t0"] <= span]
  first = saved[0][1]
  return {"committed_tokens": (saved[-1][1] - first) * tokens_per_step,
          "restarts": sum(e[1] == "exit" and e[0] <= span for e in run["events"]),
          "longest_stall_s": float(max(np.diff([t for t, _ in saved] + [span]))),
          "timeline": [[t, (step - first) * tokens_per_step] for t, step in saved]}


def measure(config: Config, prefix: str) -> dict[str, Any] | None:
  """The control and the faulted run together, then (``--sync-checkpoint-every``) the
  synchronous arm's control and faulted run together for the first pair's span, each run's
  replicas capped at ``--cpus / 2R`` (their directories, logs included, in ``PREFIX_runs/``);
  their comparison. A ``SIGTERM`` ends the study as Ctrl-C does: every process, CPU group and
  namespace of the runs in progress is removed first."""
  if os.geteuid() != 0:
    print("[chaos] skipped: needs root (make bench-chaos)", file=sys.stderr)
    return None
  signal.signal(signal.SIGTERM, _interrupted)
  # drawn over the longest a run may take; applied while the control runs
  faults = schedule(config.seed, config.fault_rate, config.timeout, config.replicas,
                    tuple(config.stop_seconds), tuple(config.link_seconds))
  # the synchronous arm has no Lighthouse: its schedule is the replicas' faults only
  faults_ft = sorted(faults + [TimedFault(config.lighthouse_kill, "lighthouse", -1)] * (
    config.lighthouse_kill > 0), key=lambda f: f.at)
  cpus = config.cpus / 2
  control, faulted = _records(config, prefix, ("control", "faulted"), lambda out: together(
    [FaultTolerantRun(config, out[0], [], cpus, "c"),
     FaultTolerantRun(config, out[1], faults_ft, cpus, "f")], config.timeout))
  span = max(line["time"] for line in control["lines"]) - control["t0"]
  keys = ("events", "final", "status", "wall_s", "load_before", "load_after")
  runs = {"control": control, "faulted": faulted}
  result = {"config": dataclasses.asdict(config),
            "faults": [dataclasses.asdict(f) for f in faults_ft if f.at < span],
            "horizon_s": span, "cpus_per_replica": cpus / config.replicas,
            **compare(control, faulted)}
  if config.sync_checkpoint_every:
    # a synchronous step takes every replica's batch: R times a replica's share of a round / H
    per_step = config.replicas * max(x["tokens"] for x in control["lines"]) / config.sync_period
    runs["sync_control"], runs["sync_faulted"] = _records(
      config, prefix, ("sync_control", "sync_faulted"), lambda out: together(
        [SyncRun(config, out[0], [], cpus, "s", span),
         SyncRun(config, out[1], faults, cpus, "t", span)], config.timeout))
    sync = {k: sync_accounting(runs[f"sync_{k}"], result["span_s"], per_step)
            for k in ("control", "faulted")}
    result["sync"] = {**sync, "tokens_per_step": per_step, "goodput": sync["faulted"][
      "committed_tokens"] / sync["control"]["committed_tokens"]}
  return result | {"runs": {k: {key: run[key] for key in keys + ("saved",) if key in run}
                            for k, run in runs.items()}}


ROWS = (
  ("committed tokens in the span", lambda a, r: a["committed_tokens"]),
  ("useful-work ratio", lambda a, r: f"{a['useful_work']:.3f}"),
  ("rounds committed (whole run)", lambda a, r: a["rounds_committed"]),
  ("rounds aborted everywhere / abort lines",
   lambda a, r: f"{a['rounds_aborted']} / {a['abort_lines']}"),
  ("rounds committed after a retried exchange", lambda a, r: a.get("rounds_retried", "—")),
  ("state-hash mismatches", lambda a, r: a["hash_mismatches"]),
  ("longest stall (s)", lambda a, r: f"{a['longest_stall_s']:.2f}"),
  ("median seconds of a round all replicas committed",
   lambda a, r: kit.fmt(a.get("full_round_s"), ".4f")),
  ("heals / of them unprovoked (no fault of the replica's own in the 20 s before)",
   lambda a, r: f"{a['heals']} / {a['unprovoked_heals']}" if "heals" in a else "—"),
  ("heal p50 / p95 (s)", lambda a, r: " / ".join(
    kit.fmt(a[k], ".2f") for k in ("heal_p50_s", "heal_p95_s")) + f" (n = {len(a['heal_s'])})"),
  ("restarts committed within one round of their first quorum",
   lambda a, r: f"{sum(n is not None and n <= 1 for n in a['heal_rounds'])} of"
                f" {len(a['heal_rounds'])}" if "heal_rounds" in a else "—"),
  ("restarted replica's first quorum (s)",
   lambda a, r: ", ".join(f"{q:.2f}" for q in a["first_quorum_s"]) or "—"),
  ("final held-out metric (mean of replicas)", lambda a, r: _metric(r["final"])),
  ("exit status / wall clock (s)", lambda a, r: f"{r['status']} / {r['wall_s']:.0f}"),
  ("load average before → after", lambda a, r: kit.loads(r["load_before"], r["load_after"])))
"""The report's table: a label, and the cell of one run from its accounting and its record."""


SYNC_ROWS = (
  ("committed (checkpointed) tokens in the span", lambda a, r: f"{a['committed_tokens']:.0f}"),
  ("restarts (--resume)", lambda a, r: a["restarts"]),
  ("longest gap between checkpoints (s)", lambda a, r: f"{a['longest_stall_s']:.2f}"),
  ("exit status of the last command / wall clock (s)",
   lambda a, r: f"{r['status']} / {r['wall_s']:.0f}"),
  ("load average before → after", lambda a, r: kit.loads(r["load_before"], r["load_after"])))
"""The synchronous arm's table, as :data:`ROWS`."""


def _table(rows: tuple, arms: list[tuple[dict[str, Any], dict[str, Any]]]) -> str:
  """``rows``' table of the control and the faulted run (``arms``: their accounting and record)."""
  return kit.table(["", "control", "faults"],
                   [[label] + [cell(a, r) for a, r in arms] for label, cell in rows])


def _sync_markdown(result: dict[str, Any]) -> str:
  sync, runs, cfg = result["sync"], result["runs"], result["config"]
  ratio = sync["control"]["committed_tokens"] / result["control"]["committed_tokens"]
  return kit.blocks(
    "## Synchronous data parallelism with checkpoint and restart",
    (f"The schedule's kills and stops (its processes share the machine's network: no link"
     f" faults) applied to `{' '.join(sync_command(Config(**cfg), 'OUT', False)[2:])}`"
     f" (one `jax.distributed` process per replica, the same CPU caps): a killed process ends"
     f" the command, which is started again with `--resume` {cfg['restart_delay']} s later; its"
     f" tokens count once checkpointed ({sync['tokens_per_step']:.0f} per step). **Goodput"
     f" {sync['goodput']:.3f}** against its own control over the same {result['span_s']:.1f} s;"
     f" its control committed {ratio:.3f} of the fault-tolerant control's tokens."),
    _table(SYNC_ROWS, [(sync[k], runs[f"sync_{k}"]) for k in ("control", "faulted")]))


def _metric(final: list[dict[str, Any]]) -> str:
  items = [(k, v) for line in final for k, v in line.items() if k.startswith("test_")]
  names = sorted({k for k, _ in items})
  return f"{', '.join(names)} {np.mean([v for _, v in items]):.4f}" if items else "—"


def _metric_gap(runs: dict[str, Any]) -> float | None:
  """The faulted run's mean held-out metric relative to the control's, minus 1 (both end at the
  same committed steps); ``None`` without both."""
  means = [[v for line in runs[k]["final"] for key, v in line.items() if key.startswith("test_")]
           for k in ("control", "faulted")]
  return float(np.mean(means[1]) / np.mean(means[0]) - 1) if all(means) else None


def markdown(result: dict[str, Any], figure: str) -> str:
  # a record without exchange_retries predates the retry: its rounds aborted at once
  cfg, runs = {"exchange_retries": 0} | result["config"], result["runs"]
  kinds = [e[1] for e in runs["faulted"]["events"] if 0 < e[0] <= result["span_s"]]
  return "\n\n".join([
    "# Chaos: fault-tolerant DiLoCo under faults", kit.doc_markdown(__doc__, 0, 3),
    (f"Settings: `{' '.join(command(Config(**cfg), 'OUT')[2:])}`;"
     f"{_caps(result)} faults: rate"
     f" {cfg['fault_rate']:.3f}/s, seed {cfg['seed']}, over the control's span of"
     f" {result['horizon_s']:.1f} s; within the span counted: {kinds.count('kill')} kills,"
     f" {kinds.count('stop')} stops, {kinds.count('link')} links down,"
     f" {kinds.count('lighthouse')} Lighthouse kills,"
     f" {kinds.count('skipped')} skipped (the plot shows all)."),
    (f"**Goodput {result['goodput']:.3f}** (committed tokens of the faulted run over the"
     f" control's, over the first {result['span_s']:.1f} s after each run's first commit, the"
     " span both ran)."),
    (f"Target: goodput ≥ {TARGET_GOODPUT} (Decoupled DiLoCo reports 0.88) and no state-hash"
     f" mismatch: {'met' if _met(result) else 'missed'}. The final held-out metric (same"
     f" committed steps) is {kit.fmt(_metric_gap(runs), '+.2%')} off the control's (target:"
     f" within 1%).{_equal_tokens(result.get('equal_tokens'))}"),
    _pace(result), _table(ROWS, [(result[k], runs[k]) for k in ("control", "faulted")]),
    *([_sync_markdown(result)] if "sync" in result else []), f"![committed tokens]({figure})",
    _not_built(result),
    (f"Run {result['run']['date']}: `{result['run']['command']}`,"
     f" {result['run']['seconds']:.0f} s.")])


def _equal_tokens(at: dict | None) -> str:
  if at is None:
    return ""
  return (f" At equal committed tokens ({at['tokens']:.0f}, the faulted run's at its end; the"
          f" control's checkpoints interpolated linearly) it is {at['faulted']:.4f} against"
          f" {at['control']:.4f}: **{at['gap']:+.2%}** (target: within 1%).")


def _pace(result: dict[str, Any]) -> str:
  """The runs' median full rounds (run together: one machine, one pace)."""
  control, faulted = (result[k].get("full_round_s") for k in ("control", "faulted"))
  if not (control and faulted):
    return "The runs have no round every replica committed to compare their pace."
  return (f"A round every replica committed took a median of {faulted:.4f} s in the faulted"
          f" run and {control:.4f} s in the control ({faulted / control - 1:+.1%}); the two"
          " ran together, so the difference is the faulted run's own, not a drift of the"
          " machine's pace.")


def _met(result: dict[str, Any]) -> bool:
  return result["goodput"] >= TARGET_GOODPUT and result["faulted"]["hash_mismatches"] == 0


def _caps(result: dict[str, Any]) -> str:
  """The CPU caps in the settings' line (none with ``--cpus 0``)."""
  if not result["config"]["cpus"]:
    return ""
  return (f" the control and the faulted run together, each replica capped at"
          f" {result['cpus_per_replica']:.3f} CPU (cgroups);")


def _not_built(result: dict[str, Any]) -> str:
  """What the issue's study asks for that this result lacks, and what its CPU sharing means."""
  cfg, counted = result["config"], [f for f in result["faults"] if f["at"] <= result["span_s"]]
  capped = bool(cfg.get("cpus", 0))
  missing = [*([] if "sync" in result else [
    "synchronous data parallelism with checkpoint-restart on the same schedule"]),
    *([] if any(f["kind"] == "link" for f in counted) else [
      "link-down faults (network namespaces)"]),
    *([] if any(f["kind"] == "lighthouse" for f in counted) else ["a lighthouse kill"]),
    *([] if cfg.get("task", "digits") == "lm" else ["the lm task"]),
    *([] if cfg.get("algorithm") == "streaming_diloco" else ["streaming (`--algorithm"
                                                              " streaming_diloco`)"]),
    *([] if result["faulted"].get("curve") else [
      "the validation loss against wall clock (the plot shows committed tokens)"]),
    *([] if result["span_s"] >= 600 and len(counted) >= 15 else [
      "a schedule of at least 10 minutes and 15 faults"]),
    *([] if capped else ["an equal CPU share per replica (cgroup `cpu.max`)"])]
  restart = (
    "A replica's warm standby waits outside the groups at the lowest priority (`SCHED_IDLE`):"
    " it compiles in CPU time no capped replica can use (a group's quota spent or left idle by"
    " a replica waiting for its peers), and it takes over a dead replica's id and group."
    if cfg.get("standby") else
    "A restarted replica spends its first seconds importing JAX and torch within its share.")
  sharing = (
    "The replicas' caps leave a stopped replica's share idle. " + restart + " A new process"
    " runs uncapped for at most 0.1 s, until the study moves it into its group." if capped else
    "The replicas share 2 cores with whatever else runs: a stopped replica frees CPU for the"
    " others, and a restarted one spends its first seconds importing JAX and torch.")
  return f"Not built here: {', '.join(missing)}. {sharing}"


COLORS = {"kill": "red", "stop": "orange", "cont": "green", "start": "grey",
          "lighthouse": "purple", "link": "blue", "up": "cyan"}
"""The plot's colour of each event of the faulted run."""


def _mark_faults(ax: Any, events: list[list[Any]], named: bool) -> None:
  for at, kind, replica, _ in events:
    if at > 0 and kind in COLORS:
      ax.axvline(at, color=COLORS[kind], lw=0.8, ls=":" if kind == "start" else "-")
      if named:
        ax.text(at, ax.get_ylim()[1], f"{kind} {replica}", rotation=90, fontsize=6, va="top")


def plot(result: dict[str, Any], path: str) -> None:
  """Committed tokens against wall clock (both arms), and below, with the checkpoints' curves,
  the held-out metric against wall clock; the faulted run's events marked on both."""
  curves = [result[k].get("curve") for k in ("control", "faulted")]
  fig, axes = kit.plt.subplots(1 + all(curves), 1, figsize=(8, 4.5 + 3.5 * all(curves)),
                               sharex=True, squeeze=False)
  ax, events = axes[0, 0], result["runs"]["faulted"]["events"]
  arms = [(result, result["config"].get("algorithm", "diloco") + " ", "-")]
  arms += [(result["sync"], "sync ", "--")] if "sync" in result else []
  for arm, prefix, style in arms:
    for name in ("control", "faulted"):
      t = np.array(arm[name]["timeline"] or [[0, 0]])
      ax.plot(t[:, 0], t[:, 1], ls=style, label=prefix + name, drawstyle="steps-post")
  _mark_faults(ax, events, named=True)
  ax.axvline(result["span_s"], color="black", lw=0.8, ls="--", label="the span counted")
  ax.set_ylabel("committed tokens")
  ax.set_title(f"goodput {result['goodput']:.3f}: kill (red), stop (orange), cont (green),"
               " restart (grey), link down (blue), up (cyan), Lighthouse kill (purple)",
               fontsize=8)
  ax.legend()
  if all(curves):
    low = axes[1, 0]
    for name, curve in zip(("control", "faulted"), curves, strict=True):
      low.plot(*np.array(curve)[:, [0, 2]].T, marker=".", label=name)
    _mark_faults(low, events, named=False)
    low.set_ylabel("held-out metric at each checkpoint")
    low.legend()
  axes[-1, 0].set_xlabel("seconds after the first commit")
  kit.save_figure(fig, path)
