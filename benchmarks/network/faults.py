"""A benchmark run's processes, found by the ``--out OUT`` in their command lines: the faults
applied to them (:func:`inflict`), their end (:func:`kill_all`), their CPU time and equal CPU
caps (:class:`CpuShares`, cgroups; needs root)."""

from __future__ import annotations

import contextlib
import itertools
import os
import pathlib
import signal
import time
from collections.abc import Sequence
from typing import Self

from optax_dist.fault_tolerance.rundir import RunDir


def processes(out: str) -> dict[int, str]:
  """The live processes whose command line holds ``--out OUT``: pid -> command line."""
  found = {}
  for entry in pathlib.Path("/proc").iterdir():
    with contextlib.suppress(OSError):  # a process gone meanwhile
      args = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
      if any(a == b"--out" and b == out.encode() for a, b in itertools.pairwise(args)):
        found[int(entry.name)] = " ".join(a.decode() for a in args)
  return found


def process_ids(out: str, flag: str, standbys: bool = False) -> dict[int, int]:
  """``INDEX -> pid`` of the run's processes with ``flag INDEX`` but the waiting standbys (not
  named by the launcher's ``OUT/replica_<INDEX>.pid`` yet); with ``standbys``, those only."""
  pids, run = {}, RunDir(out)
  for pid, line in processes(out).items():
    args = line.split()
    if flag in args:
      index = int(args[args.index(flag) + 1])
      waiting = "--wait-for-takeover" in args and run.replica_pid(index) != pid
      if waiting == standbys:
        pids[index] = pid
  return pids


def inflict(kind: str, pid: int, group: bool = False) -> bool:
  """Sends ``kind``'s signal to ``pid`` (``kill``, ``lighthouse``: ``SIGKILL``, with ``group`` a
  kill to its process group; ``stop``, ``cont``: ``SIGSTOP``, ``SIGCONT``); whether it was there."""
  sig = {"kill": signal.SIGKILL, "lighthouse": signal.SIGKILL, "stop": signal.SIGSTOP,
         "cont": signal.SIGCONT}[kind]
  try:
    os.kill(-pid if kind == "kill" and group else pid, sig)
  except ProcessLookupError:
    return False
  return True


def kill_all(out: str) -> None:
  """SIGKILLs (and SIGCONTs) every process of the run ``out`` until none is left."""
  for _ in range(50):
    if not (found := processes(out)):
      return
    for pid, sig in itertools.product(found, (signal.SIGKILL, signal.SIGCONT)):
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    time.sleep(0.1)
  raise RuntimeError(f"faults: processes of {out} survive SIGKILL: {sorted(processes(out))}")


def cpu_seconds(pid: int) -> float | None:
  """The user and system CPU seconds of ``pid`` so far, or ``None`` once it has gone."""
  try:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
  except OSError:
    return None
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuShares:
  """One cgroup per replica, each allowed ``cpus / replicas`` CPUs (with ``speeds``, ``cpus``
  times ``speeds[i] / sum(speeds)``; v2's ``cpu.max``, v1's CFS quota per ``period_us``): a
  stopped or restarting replica's share stays idle. :meth:`add` moves a process into its
  replica's group; on exit the groups are removed, their processes moved back. ``cpus`` 0: no
  caps. ``tag`` tells apart the runs of one process. Raises ``RuntimeError`` for caps without
  a cgroup ``cpu`` controller, ``ValueError`` for a quota under the kernel's 1 ms."""

  def __init__(self, replicas: int, cpus: float, tag: str = "",
               speeds: Sequence[float] = (), period_us: int = 100_000):
    shares = [s / sum(speeds) for s in speeds] if speeds else [1 / replicas] * replicas
    self.period_us, self.quotas = period_us, [int(period_us * cpus * s) for s in shares]
    if cpus and min(self.quotas) < 1000:
      raise ValueError(f"CpuShares: a quota of {min(self.quotas)} us, under 1000 us (cpus={cpus},"
                       f" speeds={tuple(speeds)}, period_us={period_us})")
    self.root, self.v2 = self._controller() if cpus else (None, False)
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
    raise RuntimeError("cgroups: no cgroup cpu controller under /sys/fs/cgroup (or --cpus 0)")

  def __enter__(self) -> Self:
    if self.v2:
      (self.root / "cgroup.subtree_control").write_text("+cpu")
    for group, quota in zip(self.groups, self.quotas):
      group.mkdir()
      if self.v2:
        (group / "cpu.max").write_text(f"{quota} {self.period_us}")
      else:
        (group / "cpu.cfs_period_us").write_text(str(self.period_us))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    return self

  def add(self, replica: int, pid: int) -> None:
    if self.groups:
      with contextlib.suppress(ProcessLookupError, OSError):  # it may have died meanwhile
        (self.groups[replica] / "cgroup.procs").write_text(str(pid))

  def release(self, pid: int, prefixes: Sequence[str]) -> None:
    """Moves the threads of ``pid`` whose Linux names start with one of ``prefixes`` out of its
    cap, beside the launcher (a thread they start starts there). Raises ``RuntimeError`` on
    cgroup v2 (threads move only within a threaded subtree: not built)."""
    if prefixes and self.groups and self.v2:
      raise RuntimeError("CpuShares.release: on cgroup v2 threads move only within a threaded"
                         " subtree, not built; cap whole processes (--cap-threads)")
    with contextlib.suppress(OSError):  # it may have died meanwhile
      for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        if prefixes and self.groups and (task / "comm").read_text().startswith(tuple(prefixes)):
          (self.root / "tasks").write_text(task.name)

  def __exit__(self, *exc: object) -> None:
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
