"""A benchmark run's processes, found by the ``--out OUT`` in their command lines, and the faults
applied to them (:func:`inflict`), their end (:func:`kill_all`) and CPU time."""

from __future__ import annotations

import contextlib
import itertools
import os
import pathlib
import signal
import time

from optax_dist.fault_tolerance.rundir import RunDir

SIGNALS = {"kill": signal.SIGKILL, "lighthouse": signal.SIGKILL, "stop": signal.SIGSTOP,
           "cont": signal.SIGCONT}


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


def process_ids(out: str, flag: str, standbys: bool = False) -> dict[int, int]:
  """``INDEX -> pid`` of the run's live processes with ``flag INDEX`` (``--replica-id``,
  ``--process-id``) but a waiting standby's (``--wait-for-takeover``, not yet named by the
  launcher's ``OUT/replica_<INDEX>.pid``); with ``standbys``, the waiting standbys' only."""
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
  """Sends ``kind``'s signal to ``pid`` (a kill with ``group``: to its process group); whether
  the process was there."""
  try:
    os.kill(-pid if kind == "kill" and group else pid, SIGNALS[kind])
  except ProcessLookupError:
    return False
  return True


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
  raise RuntimeError(f"faults: processes of {out} survive SIGKILL: {sorted(processes(out))}")


def cpu_seconds(pid: int) -> float | None:
  """The user and system CPU seconds of ``pid`` so far, or ``None`` once it has gone."""
  try:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
  except OSError:
    return None
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
