"""The directory of a fault-tolerant run, read back: one reader for every file the run writes.

A run's directory ``OUT`` holds, by writer:

* the command: ``launches.jsonl`` (a line per start of the run, its first and each
  ``--resume``: its ``time``);
* the launcher (:mod:`optax_dist.fault_tolerance.launcher`): ``restarts.jsonl`` (a line per
  replica restart: its ``replica``, exit ``status`` and ``time``), ``lighthouse.log`` and
  ``lighthouse.pid`` (the Lighthouse's output and its live process), ``replica_<i>.log`` and
  ``replica_<i>.pid`` (replica ``i``'s output, and its live process: a standby's once it took
  over); with replicas of P processes (replica groups), rank ``r`` > 0's as
  ``replica_<i>.rank_<r>.log`` and ``replica_<i>.rank_<r>.pid``;
* replica ``i``: ``replicas/replica_<i>.jsonl``, one JSON line per round (``round``, ``step``,
  ``quorum_id``, ``members``, ``committed``, ``weight``, ``healed``, ``state_hash``,
  ``tokens``, ``loss``, ``time``, ``pid``, ``quorum_seconds``, ``attempts``, ``donor``,
  ``exchange_seconds``),
  opened for appending: a
  restarted replica adds to its file; rank ``r`` > 0 of a replica group writes its own,
  ``replicas/replica_<i>.rank_<r>.jsonl``; a replica of ``optax-dist replica`` also writes
  ``replicas/ready_<i>`` at its start and ``replicas/final_<i>.json`` (its test metric and
  the hash of its whole state) once finished; in decoupled rounds also
  ``replicas/boundaries_<i>.jsonl`` (:meth:`RunDir.boundaries`);
* the quorum's rank 0: the checkpoints, ``replicas/checkpoints/step_<step>.{heal,json}``, and
  each member its local state beside them, ``step_<step>.replica_<i>.local``
  (:mod:`optax_dist.fault_tolerance.checkpoints`).

:class:`RunDir` names these paths, reads them (:meth:`RunDir.lines`, :meth:`RunDir.final`,
:meth:`RunDir.checkpoints`, the pids), sums a run up (:meth:`RunDir.summary`) and clears an
earlier run's files (:meth:`RunDir.clear`; a resumed run's pids and marks only,
:meth:`RunDir.clear_marks`). ``optax-dist train --fault-tolerant`` and the
chaos study (``benchmarks/studies/chaos/``) read their runs with it.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import pathlib
import re
import time
from typing import Any

from optax_dist.fault_tolerance import checkpoints


def by_round(lines: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
  """``lines`` grouped by their ``round``, in the order given."""
  rounds: dict[int, list[dict[str, Any]]] = {}
  for line in lines:
    rounds.setdefault(line["round"], []).append(line)
  return rounds


class RunDir:
  """The files of the fault-tolerant run under ``out`` (see the module's docstring).

  Args:
    out: the run's directory (it need not exist yet).
  """

  def __init__(self, out: str | os.PathLike):
    self.out = pathlib.Path(out)
    self.replicas = self.out / "replicas"
    self.checkpoint_dir = self.replicas / "checkpoints"
    self.lighthouse_log = self.out / "lighthouse.log"
    self.lighthouse_pid_file = self.out / "lighthouse.pid"
    self.restarts_file = self.out / "restarts.jsonl"
    self.launches_file = self.out / "launches.jsonl"

  def replica_log(self, i: int, rank: int = 0) -> pathlib.Path:
    """The output of replica ``i``'s process ``rank``, which the launcher appends to."""
    return self.out / f"replica_{i}{_rank(rank)}.log"

  def pid_file(self, i: int, rank: int = 0) -> pathlib.Path:
    """Where the launcher writes the pid of replica ``i``'s live process ``rank``."""
    return self.out / f"replica_{i}{_rank(rank)}.pid"

  def lines_file(self, i: int, rank: int = 0) -> pathlib.Path:
    """The JSONL file of replica ``i``'s process ``rank``: one line per round."""
    return self.replicas / f"replica_{i}{_rank(rank)}.jsonl"

  def boundaries_file(self, i: int) -> pathlib.Path:
    """The JSONL file of replica ``i``'s boundaries in decoupled rounds (its ``Boundary``,
    ``Heal``, ``Revert`` and ``CatchUp`` lines, :mod:`~optax_dist.fault_tolerance.decoupled`)."""
    return self.replicas / f"boundaries_{i}.jsonl"

  def final_file(self, i: int) -> pathlib.Path:
    """Replica ``i``'s evaluation once finished."""
    return self.replicas / f"final_{i}.json"

  def ready_file(self, i: int) -> pathlib.Path:
    """The start mark of replica ``i`` (``optax-dist replica``'s start barrier)."""
    return self.replicas / f"ready_{i}"

  def lines(self, replica: int | None = None, rank: int = 0) -> list[dict[str, Any]]:
    """The lines of replica ``replica``'s process ``rank`` in the order written; ``None``:
    every replica's (every rank 0's ``replica_<i>.jsonl`` found), by ``time``. ``[]`` before
    any line."""
    if replica is not None:
      return _jsonl(self.lines_file(replica, rank))
    ids = sorted(int(m.group(1)) for path in self.replicas.glob("replica_*.jsonl")
                 if (m := re.fullmatch(r"replica_(\d+)\.jsonl", path.name)))
    return sorted((x for i in ids for x in self.lines(i)), key=lambda line: line["time"])

  def boundaries(self, replica: int) -> list[dict[str, Any]]:
    """The lines of replica ``replica``'s :meth:`boundaries_file` in the order written; ``[]``
    before any."""
    return _jsonl(self.boundaries_file(replica))

  def add_restart(self, replica: int, status: int) -> None:
    """Appends to ``restarts.jsonl`` that replica ``replica`` exited with ``status`` (negative:
    killed by that signal) and is restarted, at ``time`` (now, Unix seconds)."""
    with open(self.restarts_file, "a") as f:
      f.write(json.dumps({"replica": replica, "status": status, "time": time.time()}) + "\n")

  def add_launch(self) -> None:
    """Appends to ``launches.jsonl`` that the run starts (or resumes) now (``time``, Unix
    seconds): the lines written after it are that launch's (:meth:`summary`)."""
    self.out.mkdir(parents=True, exist_ok=True)
    with open(self.launches_file, "a") as f:
      f.write(json.dumps({"time": time.time()}) + "\n")

  def restarts(self) -> list[dict[str, Any]]:
    """The replicas' restarts (``replica``, ``status``, ``time``) in the order the launcher
    wrote them; ``[]`` before any."""
    return _jsonl(self.restarts_file)

  def first_commit(self) -> float | None:
    """The Unix time of the run's first committed line, or ``None`` before it."""
    return min((line["time"] for line in self.lines() if line["committed"]), default=None)

  def final(self) -> dict[int, dict[str, Any]]:
    """The finished replicas' ``final_<i>.json``, by replica id in order."""
    found = {int(path.stem.split("_")[1]): path for path in self.replicas.glob("final_*.json")}
    return {i: json.loads(found[i].read_text()) for i in sorted(found)}

  def finished(self) -> bool:
    """Whether a replica has finished (written its ``final_<i>.json``)."""
    return any(self.replicas.glob("final_*.json"))

  def checkpoints(self) -> list[dict[str, Any]]:
    """The finished checkpoints' JSON, oldest first (:func:`checkpoints.saved`)."""
    return checkpoints.saved(self.checkpoint_dir)

  def lighthouse_pid(self) -> int | None:
    """The pid of the run's Lighthouse, or ``None`` before the launcher has started one."""
    return _read_pid(self.lighthouse_pid_file)

  def replica_pid(self, i: int, rank: int = 0) -> int | None:
    """The pid of replica ``i``'s live process ``rank`` as the launcher last named it, or
    ``None``."""
    return _read_pid(self.pid_file(i, rank))

  def summary(self, replicas: int, restarts: int, processes: int = 1) -> dict[str, Any]:
    """What the files of replicas ``0`` to ``replicas - 1`` say about the run.

    Args:
      replicas: R, the run's replicas (the files of other ids are left out).
      restarts: the launcher's count of restarts, reported as given.
      processes: P, the processes of each replica (its ranks' lines are read too).

    Returns:
      ``rounds_committed`` (round indices some replica committed), ``rounds_aborted`` (those
      none committed), ``restarts``, ``heals`` (rank 0's lines of a healed replica) and
      ``heal_seconds`` (their ``quorum_seconds``: the quorum with the heal), ``hashes_agree``
      (every committed round has one ``state_hash`` over every rank of every replica, within
      each launch of :meth:`add_launch`: a resume that redoes rounds from a checkpoint taken
      by a joiner's heal need not redo them bit for bit),
      ``finished`` (the replicas that wrote their final evaluation) and ``final`` (those
      evaluations, by replica).
    """
    lines = [line for i in range(replicas) for line in self.lines(i)]
    ranks = [x for i in range(replicas) for r in range(1, processes) for x in self.lines(i, r)]
    starts = [x["time"] for x in _jsonl(self.launches_file)]
    hashes: dict[tuple[int, int], set[str]] = {}  # by (launch, round): a resume may redo rounds
    for x in lines + ranks:
      launch = bisect.bisect_right(starts, x["time"]) if starts else 0
      got = hashes.setdefault((launch, x["round"]), set())
      got.update([x["state_hash"]] if x["committed"] else [])
    committed = {r for (_, r), h in hashes.items() if h}
    final = {i: v for i, v in self.final().items() if i < replicas}
    heals = [line["quorum_seconds"] for line in lines if line["healed"]]
    return {"rounds_committed": len(committed),
            "rounds_aborted": len({r for _, r in hashes} - committed),
            "restarts": restarts, "heals": len(heals), "heal_seconds": heals,
            "hashes_agree": all(len(h) <= 1 for h in hashes.values()),
            "finished": sorted(final), "final": final}

  def clear(self) -> None:
    """Removes an earlier run's Lighthouse log, restarts and replica files (their logs, pids, lines,
    decoupled rounds' boundary lines, evaluations, start marks and checkpoints): a new run starts
    them afresh, and its processes append to them."""
    self.clear_marks()
    for pattern in ("lighthouse.log", "launches.jsonl", "restarts.jsonl", "replica_*.log",
                    "replicas/replica_*.jsonl", "replicas/boundaries_*.jsonl",
                    "replicas/checkpoints/step_*"):
      for path in self.out.glob(pattern):
        path.unlink()

  def clear_marks(self) -> None:
    """Removes an earlier run's pids, evaluations and start marks, and keeps its logs, lines and
    checkpoints: a resumed run's replicas meet at their start again, restore the checkpoints
    and append to the logs and lines."""
    for pattern in ("replica_*.pid", "replicas/final_*.json", "replicas/ready_*"):
      for path in self.out.glob(pattern):
        path.unlink()


def _jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  """The JSON lines of the file ``path`` (``[]`` if it does not exist)."""
  text = path.read_text() if path.exists() else ""
  return [json.loads(line) for line in text.splitlines() if line.strip()]


def _rank(rank: int) -> str:
  """A file name's part for process ``rank`` of a replica group: none for rank 0."""
  return f".rank_{rank}" if rank else ""


def _read_pid(path: pathlib.Path) -> int | None:
  with contextlib.suppress(OSError, ValueError):
    return int(path.read_text())
  return None
