"""Equal CPU caps for a benchmark run's processes, one cgroup each (needs root)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import time
from typing import Self


class CpuShares:
  """One cgroup per replica, each allowed ``cpus / replicas`` CPUs (v2's ``cpu.max``, v1's CFS
  quota), so that a stopped or restarting replica's share stays idle. :meth:`add` moves a
  process (all its threads) into its replica's group; on exit the groups are removed, their
  processes moved back first. ``cpus`` 0: no caps. ``tag`` tells apart the runs of one process
  (groups ``optax_dist_chaos_PIDTAG_I``).

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
    raise RuntimeError("cgroups: no cgroup cpu controller under /sys/fs/cgroup (or --cpus 0)")

  def __enter__(self) -> Self:
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
