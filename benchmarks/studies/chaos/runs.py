"""The chaos study's settings and arms: each run a command under a fault schedule (redrawn by
:func:`schedule.redraw`), its processes capped and faulted (:mod:`benchmarks.network.faults`),
several at once under :func:`together`."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from typing import Any, Self

import optax

from benchmarks import kit
from benchmarks.network import faults as inflicted
from benchmarks.network import netns
from benchmarks.studies.chaos.schedule import TimedFault, redraw, redraw_rng
from optax_dist.cli import ft_task, orbax_checkpoints
from optax_dist.cli.ft_flags import DEFAULTS
from optax_dist.cli.main import build_parser
from optax_dist.cli.tasks import TASKS
from optax_dist.fault_tolerance.rundir import RunDir


@dataclasses.dataclass(frozen=True)
class Config:
  replicas: int = kit.option(4, "R, replica processes")
  min_replicas: int = kit.option(3, "the smallest quorum that commits (a majority)")
  algorithm: str = kit.option("diloco", "the command's --algorithm")
  task: str = kit.option("lm", "the command's --task")
  sync_period: int = kit.option(20, "H, inner steps per round")
  steps: int = kit.option(6_000, "inner steps of each run (--steps)")
  fault_rate: float = kit.option(1 / 30, "faults per second (Poisson)")
  stop_seconds: tuple[float, float] = kit.option((3.0, 10.0), "a SIGSTOP's length, uniform")
  link_seconds: tuple[float, float] = kit.option((5.0, 15.0), "a link down's length, uniform")
  restart_delay: float = kit.option(2.0, "seconds before a dead replica (or sync command) restarts")
  exchange_timeout: float = kit.option(2.0, "--exchange-timeout of the replicas, seconds")
  exchange_retries: int = kit.option(DEFAULTS["exchange_retries"], "--exchange-retries")
  join_timeout: float = kit.option(DEFAULTS["join_timeout"], "--join-timeout, seconds")
  heartbeat_timeout: float = kit.option(1.0, "--lighthouse-heartbeat-timeout, seconds")
  finish_grace: float = kit.option(2.0, "--finish-grace: seconds the others have to finish")
  seeds: tuple[int, ...] = kit.option((0, 1, 2), "the fault schedules' seeds (--seed stays 0)")
  min_faults: int = kit.option(15, "fewer applied faults in a seed's span: it runs again longer")
  reuse: bool = kit.option(False, "read back runs of the same settings from PREFIX_runs/")
  timeout: float = kit.option(1800.0, "seconds after which a pair of runs is stopped")
  cpus: float = kit.option(float(os.cpu_count() or 1), "CPUs a pair shares (cgroups); 0: none")
  sync_checkpoint_every: int | None = kit.option(None, "default Young-Daly's; 0: no sync arm")
  lighthouse_kill: float = kit.option(300.0, "seconds in of the Lighthouse's kill; 0: never")
  standby: bool = kit.option(False, "spares in both arms (--standby; sync: no restart delay)")
  checkpoint_every: int = kit.option(200, "the fault-tolerant runs' --checkpoint-every; 0: none")
  equal_tokens_control: bool = kit.option(True, "a control of the faulted run's tokens")
  speeds: tuple[float, ...] = kit.option((), "the speeds mode (make bench-decoupled): the"
                                         " replicas' CPU caps in this ratio")
  windows: tuple[float, ...] = kit.option((0.0, 2.0), "speeds: the K = 1 arms' --grace-window")
  decoupled_steps: int | None = kit.option(None, "speeds: a decoupled arm's --steps (R * steps)")
  speed_faults: bool = kit.option(False, "speeds: the runs beside the controls faulted")
  decoupled: float | None = kit.option(None, "a run's --decoupled --min-quorum 1 --grace-window")
  flags: str = kit.option("", "more train flags of every fault-tolerant run")
  staleness_rule: str = kit.option("token_share", "a decoupled run's --staleness-rule")
  rate: str | None = kit.option(None, "the link mode: the replicas' links shaped at this rate")
  overlaps: tuple[int, ...] = kit.option((0,), "the link mode: each pair's --overlap")
  cap_threads: bool = kit.option(False, "speeds: a cap holds its replica's exchange, torchft and"
                                 " gloo threads too (else they run beside the launcher)")


SPEEDS_PERIOD_US = 20_000  # the CFS period of the speeds mode's caps (short: a cap is smooth)
FREE_THREADS = ("optax_dist-", "torchft", "gloo", "pt_gloo", "pt_tcpstore")  # transport threads
QUICK = {"steps": 400, "fault_rate": 1 / 8, "lighthouse_kill": 15.0, "checkpoint_every": 100,
         "seeds": (0,), "min_faults": 0}


def command(c: Config, out: str, star: netns.Star | None = None) -> list[str]:
  """``optax-dist train --fault-tolerant`` of the study's settings ``c``, writing to ``out``;
  with ``star``, in its hub, each replica in its own namespace (``--replica-netns``)."""
  flags = [("--algorithm", c.algorithm), ("--fault-tolerant",), ("--replicas", c.replicas),
           ("--min-replicas", c.min_replicas), ("--devices", 1), ("--task", c.task),
           ("--steps", c.steps), ("--sync-period", c.sync_period),
           ("--restart-delay", c.restart_delay), ("--max-restarts", 1000),
           ("--exchange-timeout", c.exchange_timeout),
           *[("--exchange-retries", c.exchange_retries)] * (c.decoupled is None),
           ("--join-timeout", c.join_timeout), ("--finish-grace", c.finish_grace),
           ("--lighthouse-heartbeat-timeout", c.heartbeat_timeout), ("--no-progress",),
           ("--out", out)]
  flags += [] if star is None else [("--host", star.address), ("--replica-netns", star.pattern)]
  flags += [("--checkpoint-every", c.checkpoint_every)] * bool(c.checkpoint_every) + [
    ("--standby",)] * c.standby
  flags += [] if c.decoupled is None else [("--decoupled",), ("--min-quorum", 1), (
    "--grace-window", c.decoupled), ("--staleness-rule", c.staleness_rule)]
  flags += [(x,) for x in c.flags.split()]
  return ([] if star is None else star.exec_prefix()) + _train(flags)


def sync_command(c: Config, out: str, resume: bool) -> list[str]:
  """``optax-dist train --algorithm sync`` over R processes of one device, checkpointing every
  ``--sync-checkpoint-every`` steps, a process silent for ``--exchange-timeout`` s (rounded up)
  declared dead (``--resume``: from the newest checkpoint)."""
  return _train([("--algorithm", "sync"), ("--processes", c.replicas), ("--devices", 1),
                 ("--task", c.task), ("--steps", c.steps),
                 ("--checkpoint-every", c.sync_checkpoint_every),
                 ("--heartbeat-timeout", math.ceil(c.exchange_timeout)), ("--no-progress",),
                 ("--out", out)] + [("--resume",)] * resume)


def _train(flags: list[tuple[Any, ...]]) -> list[str]:
  """``optax-dist train`` (this interpreter) with ``flags``: ``(flag, value)``, ``(switch,)``."""
  return [sys.executable, "-m", "optax_dist.cli", "train", *(str(x) for f in flags for x in f)]


class Run:
  """A command under a fault schedule, which :func:`together` enters (empties ``out``, makes the
  CPU groups of ``cpus``, starts it), ticks (:meth:`inject`) and leaves (kills every process,
  removes the groups and namespaces). ``tag``: a lower-case letter; ``seed``: the redraws'."""

  flag, group = "", False  # the flag of a process's index; a kill of its process group

  def __init__(self, config: Config, out: str, faults: list[TimedFault], cpus: float, tag: str,
               seed: int = 0, rate: str | None = None):
    self.config, self.out, self.cpus, self.tag, self.rate = config, out, cpus, tag, rate
    self.timed, self.dir = kit.Timed(), RunDir(out)
    self.pending, self.rng = sorted(faults, key=lambda f: f.at), redraw_rng(seed)
    self.seen, self.ready, self.standby_cpu, self.t0, self.released = {}, {}, {}, None, None
    self.events, self.undo = [], []  # [t, kind, replica, pid]; (when, replica, pid, cont or up)

  def __enter__(self) -> Self:
    shutil.rmtree(self.out, ignore_errors=True)
    os.makedirs(self.out)
    with contextlib.ExitStack() as self.stack:  # closed at once if a step fails
      self.stack.enter_context(self.timed)
      self.log = self.stack.enter_context(open(os.path.join(self.out, "command.log"), "w"))
      self.shares = self.stack.enter_context(inflicted.CpuShares(
        self.config.replicas, self.cpus, self.tag, self.config.speeds,
        SPEEDS_PERIOD_US if self.config.speeds else 100_000))
      self.star = self._network()
      self.proc = self._start(resume=False)
      self.stack.callback(lambda: (inflicted.kill_all(self.out), self.proc.wait()))
      self.stack = self.stack.pop_all()
    return self

  def __exit__(self, *exc: object) -> None:
    self.stack.close()

  def _start(self, resume: bool) -> subprocess.Popen:
    # a synchronous restart reads its programs back, as the fault-tolerant replicas do
    cache = {"JAX_COMPILATION_CACHE_DIR": os.path.abspath(f"{self.out}/compilation_cache")}
    return subprocess.Popen(self._command(resume), stdout=self.log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=cache | os.environ)

  def _network(self) -> netns.Star | None:
    return None

  def record(self) -> dict[str, Any]:
    return {"t0": self.t0, "events": self.events, "status": self.proc.returncode,
            **self.timed.record()}

  def now(self) -> float:  # seconds after t0 (0 before it is known)
    return time.time() - (self.t0 or time.time())

  def inject(self, t0: float | None, *, ending: bool) -> None:
    """One look on the clock of the run's first progress ``t0``: a new process (``flag INDEX``)
    recorded (``start``) and capped; due faults applied (``kill -9``, of the process group with
    ``group``; ``SIGSTOP`` then ``SIGCONT``; link down then up), redrawn or ``unapplied``."""
    self.t0 = self.t0 or t0
    pids, now = inflicted.process_ids(self.out, self.flag), self.now()
    for i, pid in pids.items():
      if self.seen.get(i) != pid:
        self.seen[i] = pid
        if not self.config.speeds:  # capped once ready (FaultTolerantRun.tick) with speeds
          self.shares.add(i, pid)
        self.events.append([now, "start", i, pid])
    for undo in [u for u in self.undo if u[0] <= now]:
      self.undo.remove(undo)
      self._apply(undo[3], undo[1], undo[2], now)
    if ending:
      self.pending = []
    while self.t0 is not None and self.pending and self.pending[0].at <= now:
      live = ({-1: self.dir.lighthouse_pid()} if self.pending[0].kind == "lighthouse" else
              {i: pid for i, pid in pids.items() if all(u[1] != i for u in self.undo)})
      fault = redraw(self.pending.pop(0), {i for i, pid in live.items() if pid}, self.rng)
      if fault is None or not self._apply(fault.kind, fault.replica, live[fault.replica], now):
        self.events.append([now, "unapplied", -1, None])
      elif fault.kind in ("stop", "link"):
        self.undo.append((now + fault.seconds, fault.replica, live[fault.replica],
                          "cont" if fault.kind == "stop" else "up"))

  def _apply(self, kind: str, replica: int, pid: int, now: float) -> bool:
    """Applies ``kind`` to ``replica`` (process ``pid``) and records it; whether it could."""
    if kind in ("link", "up"):
      self.star.set_link(replica, up=kind == "up")
    elif not inflicted.inflict(kind, pid, self.group):
      return False
    self.events.append([now, kind, replica, pid])
    return True


class FaultTolerantRun(Run):
  """:func:`command` in a :class:`netns.Star`, on the clock of its first commit. Its record:
  ``t0``, ``events`` (``[t, kind, replica, pid]``: ``start``, ``ready`` (its ``ready_<i>``),
  the faults, ``cont``, ``up``, ``unapplied``), ``lines``, ``boundaries`` (a decoupled run's),
  ``final``, ``curve`` (:func:`ft_task.checkpoint_metrics`), ``standby_cpu_s``, ``status``,
  ``wall_s``, loads. With ``speeds``, a replica process is capped from its ``ready`` on."""

  flag, group = "--replica-id", True

  def _network(self) -> netns.Star:
    star = self.stack.enter_context(netns.Star(self.config.replicas, self.tag, self.rate))
    self.stack.callback(lambda: setattr(self, "link_bytes", star.counters()))  # its processes
    return star  # killed first

  def _command(self, resume: bool) -> list[str]:
    return command(self.config, self.out, self.star)

  def tick(self, ending: bool) -> bool:
    """One look (no fault once a replica has finished); whether the command still runs."""
    self.inject(self.t0 or self.dir.first_commit(), ending=ending or self.dir.finished())
    for i in range(self.config.replicas):
      with contextlib.suppress(OSError):
        if self.ready.get(i) != (mark := self.dir.ready_file(i).stat().st_mtime):
          self.ready[i] = mark
          self.events.append([mark - (self.t0 or mark), "ready", i, self.seen.get(i)])
          if self.config.speeds:
            self.shares.add(i, self.seen.get(i))
      if self.config.speeds and i in self.ready and int(time.monotonic()) != self.released:
        self.shares.release(self.seen.get(i), () if self.config.cap_threads else FREE_THREADS)
    self.released = int(time.monotonic())  # once a second: gloo's threads start at each quorum
    for pid in inflicted.process_ids(self.out, self.flag, standbys=True).values():
      self.standby_cpu[pid] = inflicted.cpu_seconds(pid) or self.standby_cpu.get(pid, 0.0)
    return self.proc.poll() is None

  def record(self) -> dict[str, Any]:
    args = build_parser().parse_args(command(self.config, self.out)[3:])
    return {**super().record(), "lines": self.dir.lines(), "final": [*self.dir.final().values()],
            "curve": ft_task.checkpoint_metrics(args), "boundaries": [
              x for path in sorted(self.dir.replicas.glob("boundaries_*.jsonl"))
              for x in kit.read_json(str(path), lines=True)],
            "standby_cpu_s": sum(self.standby_cpu.values()),
            "link_bytes": getattr(self, "link_bytes", None)}


class SyncRun(Run):
  """:func:`sync_command` for ``horizon`` s after its first checkpoint, its clock's origin: a
  fault that ends it is followed ``--restart-delay`` s later (with ``--standby`` at once) by
  ``--resume``. No link faults (its processes share the machine's network). Its record:
  :class:`Run`'s, ``saved`` (``[Unix time, step]`` of each new checkpoint), ``exit`` and
  ``resume`` events (``[t, "exit", -1, status]``, ``[t, "resume", -1, pid]``)."""

  flag = "--process-id"

  def __init__(self, config: Config, out: str, faults: list[TimedFault], cpus: float, tag: str,
               horizon: float, seed: int = 0):
    super().__init__(config, out, [f for f in faults if f.kind != "link"], cpus, tag, seed)
    self.horizon, self.saved, self.restart_at = horizon, [], None

  def _command(self, resume: bool) -> list[str]:
    return sync_command(self.config, self.out, resume)

  def tick(self, ending: bool) -> bool:
    """One look, restarting the command after an error; whether the run goes on."""
    if self.restart_at is None and self.proc.poll() is not None:
      if self.proc.returncode == 0:
        return False  # every step done before the horizon
      self.events.append([self.now(), "exit", -1, self.proc.returncode])
      self.restart_at = time.monotonic() + self.config.restart_delay * (not self.config.standby)
    if self.restart_at is not None and time.monotonic() >= self.restart_at:
      self.proc, self.restart_at = self._start(resume=True), None
      self.events.append([self.now(), "resume", -1, self.proc.pid])
    steps = orbax_checkpoints.saved_steps(os.path.join(self.out, "checkpoints", "sync"))
    if steps and (not self.saved or steps[-1] > self.saved[-1][1]):
      self.saved.append([time.time(), steps[-1]])
    self.inject(self.saved[0][0] if self.saved else None, ending=False)
    return self.t0 is None or self.now() <= self.horizon

  def record(self) -> dict[str, Any]:
    return {**super().record(), "saved": self.saved, "final": []}


def together(runs: list[Run], timeout: float) -> list[dict[str, Any]]:
  """Starts ``runs`` at once and ticks each every 0.1 s until none goes on (once one has ended,
  the others get no more faults); their records. Every process, group and namespace is gone
  when it returns or raises (``TimeoutError``: a run still going on after ``timeout`` s)."""
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


def young_daly(cost_s: float, mtbf_s: float, step_s: float) -> int:
  """Young and Daly's checkpoint interval ``sqrt(2 C MTBF)`` (``C`` a checkpoint's cost, in
  seconds) in steps of ``step_s`` seconds, at least 1 (Young, CACM 1974; Daly, FGCS 2006)."""
  return max(1, round(math.sqrt(2 * cost_s * mtbf_s) / step_s))


def checkpoint_cost(task: str, cpus: float) -> float:
  """:func:`save_seconds` in a new process capped at ``cpus`` CPUs (0: none), as a replica is."""
  with inflicted.CpuShares(1, cpus, "z") as share:
    code = f"from benchmarks.studies.chaos import runs; print(runs.save_seconds({task!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    share.add(0, proc.pid)
    return float(proc.communicate()[0].split()[-1])


def save_seconds(task: str, repeats: int = 3) -> float:
  """The median seconds of saving ``task``'s params and Adam's moments with the synchronous
  arm's :class:`orbax_checkpoints.Checkpoints`."""
  params, steps = kit.initial_params(TASKS[task], TASKS[task].load(0).train), itertools.count(1)
  state = {"params": params, "opt_state": optax.adam(1e-3).init(params)}
  with tempfile.TemporaryDirectory() as directory:
    saver = orbax_checkpoints.Checkpoints(directory, {}, resume=False)
    times = timeit.repeat(lambda: saver.save(next(steps), state, {}), number=1, repeat=repeats)
    saver.close()
  return kit.median(times)


def records(config: Config, prefix: str, names: tuple[str, ...],
            run: Callable[[list[str]], list[dict[str, Any]]]) -> list[dict[str, Any]]:
  """``run([PREFIX_runs/NAME, ...])``'s records, also written to ``PREFIX_runs/NAME.json`` with
  their settings (all but ``reuse``, ``timeout`` and, but for a faulted run,
  ``lighthouse_kill``); with ``--reuse``, read back from there if every one's are the same."""
  paths, settings = [f"{prefix}_runs/{n}" for n in names], [
    {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(config))).items() if k not in (
      "reuse", "timeout", *["lighthouse_kill"] * (n.split("/")[-1] != "faulted"))} for n in names]
  saved = [kit.read_json(f"{p}.json") if config.reuse and os.path.exists(f"{p}.json") else None
           for p in paths]
  if all(s is not None and s["config"] == c for s, c in zip(saved, settings)):
    return [s["record"] for s in saved]
  records = run(paths)
  for path, config_, record in zip(paths, settings, records, strict=True):
    kit.write_json(f"{path}.json", {"config": config_, "record": record})
  return records
