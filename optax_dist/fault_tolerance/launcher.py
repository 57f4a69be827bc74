r"""A fault-tolerant run on one host: a Lighthouse and R replica processes, dead ones restarted.

``python -m optax_dist.fault_tolerance.launcher --replicas R --out DIR [flags] [-- replica
flags]`` starts torchft's Lighthouse as a child process
(:mod:`optax_dist.fault_tolerance.lighthouse`) bound to ``--host`` (never a wildcard), its output
appended to ``DIR/lighthouse.log`` and its pid in ``DIR/lighthouse.pid``, and R processes of
:mod:`optax_dist.fault_tolerance.replica`, ids 0 to R-1, each in its own process group and with
``--parent-death``. The Lighthouse and the replicas die with the launcher (Linux
``prctl(PR_SET_PDEATHSIG)``). The flags after ``--`` go to every replica (e.g. ``--steps``,
``--sync-period``).

A Lighthouse that exits (killed) is started again at once on the same address, at most
``--max-restarts`` times; meanwhile the replicas' quorum requests time out and are retried
(:class:`~optax_dist.fault_tolerance.torchft_engine.TorchftReplica`, up to their
``--quorum-timeout``), so the run stalls for the Lighthouse's downtime plus at most one
request's timeout and goes on.

A replica that exits with a nonzero status (killed, or an error) while no replica has finished
is started again under the same id after ``--restart-delay`` seconds, at most
``--max-restarts`` times per id: it heals at its first quorum. Status 2 is a replica's refusal
(a mistake in its flags or settings, said in one line in its log): it would refuse again, so
it is not restarted. Once a replica has finished (its
``--steps`` committed), the others have ``--finish-grace`` seconds to finish too; the ones still
running then are stopped (they are behind: no quorum forms for them any more). The launcher
exits 0 if at least ``--min-replicas`` replicas finished, else 1; a mistake or a missing ``ft``
extra is one line, status 2. Its first line on stdout is ``lighthouse <URL>``, the address
another replica (``python -m optax_dist.fault_tolerance.replica --lighthouse URL``) joins.

With ``--standby``, each replica id also has a warm standby: a process of the same command with
``--wait-for-takeover``, started beside it, that imports and compiles, then waits. A restart is
then the standby's takeover (a line on its stdin): it reads the newest checkpoint and joins at
once, and a new standby for the id starts. A standby that died (or never started) is replaced by
a fresh start. The pid of replica ``i``'s process (a standby once it took over) is in
``DIR/replica_<i>.pid``.

With ``--replica-netns``, each replica (and its standby) runs in a network namespace of its own
(made beforehand, e.g. by the chaos study), with ``--host`` its host name, which it resolves
there to that namespace's address. ``optax-dist train --fault-tolerant``
(:mod:`optax_dist.cli.fault_tolerant`) runs a :class:`Launcher` of ``optax-dist replica``
processes on the command's tasks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

REFUSED = 2
"""A replica's exit status when it refuses its flags or settings: it is not restarted."""

LIGHTHOUSE_START_S = 30.0
"""Seconds the Lighthouse's process has to accept connections after the launcher's start (it
imports torch: about 2 s on an idle machine, several times that on a loaded one)."""

JOIN_TIMEOUT_S = 60.0
"""``--join-timeout``'s default: seconds the Lighthouse waits for a replica that heartbeats but
has not asked for the quorum (torchft's own default). It must be longer than a round (H inner
steps and the exchange). A replica left out of a quorum asks for the next one at once, and the
Lighthouse counts the join timeout from the earliest request it holds. With a shorter timeout,
the next quorum forms as soon as a majority has asked and leaves out the member that asks
last, and that member then waits through a round in its turn: one member left out in every
round (a heal cascade). A long timeout costs nothing in the usual rounds. A quorum forms at once
when every member of the last one has asked, or when every heartbeating replica has. A dead,
stopped or cut-off replica stops heartbeating and is no longer waited for after
``--lighthouse-heartbeat-timeout``."""

LIGHTHOUSE_COMMAND = (str(pathlib.Path(__file__).with_name("lighthouse.py")),)
"""What follows the Python interpreter in the Lighthouse's command line: the script's path (not
``-m``: torchft's program reads the process's arguments after the interpreter's first)."""

REPLICA_COMMAND = ("-m", "optax_dist.fault_tolerance.replica")
"""What follows the Python interpreter in a replica's command line by default: the synthetic
task's replica (:mod:`optax_dist.fault_tolerance.replica`)."""


def build_parser() -> argparse.ArgumentParser:
  """The launcher's command line (timing flags in float seconds)."""
  p = argparse.ArgumentParser(prog="python -m optax_dist.fault_tolerance.launcher",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--replicas", type=int, required=True, help="R, replica processes")
  p.add_argument("--min-replicas", type=int, default=None,
                 help="the smallest quorum that commits; default R // 2 + 1")
  p.add_argument("--out", required=True, help="the run's directory")
  p.add_argument("--host", default="127.0.0.1", help="the address every server binds")
  p.add_argument("--port", type=int, default=0, help="the Lighthouse's port (0: any free one)")
  p.add_argument("--replica-netns", default=None, metavar="PATTERN",
                 help="run replica I in the network namespace PATTERN with {i} replaced by I"
                 " (ip netns exec, root), binding the address this machine's host name resolves"
                 " to there (default: this namespace, --host)")
  p.add_argument("--join-timeout", type=float, default=JOIN_TIMEOUT_S,
                 help="seconds the Lighthouse waits for a heartbeating replica that has not asked"
                 " for the quorum; longer than a round")
  p.add_argument("--lighthouse-heartbeat-timeout", type=float, default=5.0,
                 help="seconds without a heartbeat before the Lighthouse drops a replica")
  p.add_argument("--max-restarts", type=int, default=3, help="restarts per replica id")
  p.add_argument("--restart-delay", type=float, default=1.0, help="seconds before a restart")
  p.add_argument("--standby", action="store_true",
                 help="keep a warm standby process per replica id, which takes over a dead"
                 " replica's id after --restart-delay (a process and its memory more per id)")
  p.add_argument("--finish-grace", type=float, default=10.0,
                 help="seconds the others have to finish once one replica has")
  p.add_argument("replica_args", nargs=argparse.REMAINDER,
                 help="-- then the flags of every replica")
  return p


def check_arguments(args: argparse.Namespace) -> None:
  """Raises ValueError naming the flag of a bad value; fills in ``--min-replicas``' default and
  drops the ``--`` before the replicas' flags."""
  if args.replicas < 1:
    raise ValueError(f"--replicas must be a positive int, got {args.replicas}")
  if args.min_replicas is None:
    args.min_replicas = args.replicas // 2 + 1
  if not 1 <= args.min_replicas <= args.replicas:
    raise ValueError(
      f"--min-replicas must be in [1, --replicas={args.replicas}], got {args.min_replicas}")
  for flag in ("join_timeout", "lighthouse_heartbeat_timeout", "restart_delay", "finish_grace"):
    if not getattr(args, flag) >= 0:
      raise ValueError(f"--{flag.replace('_', '-')} must be >= 0 seconds, got"
                       f" {getattr(args, flag)}")
  if args.max_restarts < 0:
    raise ValueError(f"--max-restarts must be an int >= 0, got {args.max_restarts}")
  if args.host in ("", "0.0.0.0", "::", "[::]"):
    raise ValueError(f"--host must be a specific address, got {args.host!r}")
  if args.replica_netns is not None:
    names = {args.replica_netns.format(i=i) for i in range(args.replicas)}
    if len(names) != args.replicas:
      raise ValueError(f"--replica-netns must hold {{i}} (one namespace per replica), got"
                       f" {args.replica_netns!r}")
    if missing := sorted(n for n in names if not os.path.exists(f"/run/netns/{n}")):
      raise ValueError(f"--replica-netns: no network namespace {missing[0]} (ip netns list)")
  if args.replica_args[:1] == ["--"]:
    args.replica_args = args.replica_args[1:]


@dataclasses.dataclass
class _Slot:
  """One replica id's process and its history."""

  proc: subprocess.Popen | None = None
  standby: subprocess.Popen | None = None
  restarts: int = 0
  restart_at: float | None = None
  finished: bool = False


class Launcher:
  """The Lighthouse and the replica processes of one run (see the module's docstring).

  Args:
    args: the launcher's flags (:func:`build_parser`), checked by :func:`check_arguments`.
    command: what follows the Python interpreter in a replica's command line, before the flags
      the launcher adds (``--lighthouse``, ``--replica-id``, ``--out``, ``--host``,
      ``--min-replicas``, ``--parent-death``) and ``args.replica_args``; the replica must take
      those flags.
  """

  def __init__(self, args: argparse.Namespace, command: tuple[str, ...] = REPLICA_COMMAND):
    self.args, self.command = args, tuple(command)
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    self.port = args.port or _free_port(args.host)
    self.url = f"http://{args.host}:{self.port}"
    self.lighthouse, self.lighthouse_log = _Slot(), pathlib.Path(args.out) / "lighthouse.log"
    self.start_lighthouse()
    self._wait_for_lighthouse()
    self.slots = [_Slot() for _ in range(args.replicas)]

  def start_lighthouse(self) -> None:
    """Starts the Lighthouse's process on ``self.url`` (its output appended to
    ``OUT/lighthouse.log``, its pid written to ``OUT/lighthouse.pid``)."""
    a = self.args
    command = [sys.executable, *LIGHTHOUSE_COMMAND, "--bind", f"{a.host}:{self.port}",
               "--min_replicas", str(a.min_replicas), "--quorum_tick_ms", "20",
               "--join_timeout_ms", str(int(a.join_timeout * 1000)),
               "--heartbeat_timeout_ms", str(int(a.lighthouse_heartbeat_timeout * 1000))]
    with open(self.lighthouse_log, "a") as log:
      self.lighthouse.proc = subprocess.Popen(command, stdout=log, stderr=log)
    (pathlib.Path(a.out) / "lighthouse.pid").write_text(f"{self.lighthouse.proc.pid}\n")

  def _wait_for_lighthouse(self) -> None:
    """Waits until the Lighthouse accepts connections.

    Raises:
      RuntimeError: its process exited, or did not accept connections within
        ``LIGHTHOUSE_START_S`` seconds (e.g. the port is in use); the message has its log's end.
    """
    deadline = time.monotonic() + LIGHTHOUSE_START_S
    while self.lighthouse.proc.poll() is None and time.monotonic() < deadline:
      try:
        socket.create_connection((self.args.host, self.port), timeout=0.5).close()
        return
      except OSError:
        time.sleep(0.05)
    raise RuntimeError(f"the Lighthouse did not start on {self.url}: "
                       + " | ".join(self.lighthouse_log.read_text().strip().splitlines()[-3:]))

  def start(self, i: int) -> None:
    """Starts replica ``i``: its standby takes over if it has a live one, else a new process;
    with ``--standby``, then a new standby for ``i``. Writes ``OUT/replica_<i>.pid``."""
    slot = self.slots[i]
    if slot.standby is not None and slot.standby.poll() is None:
      slot.proc, slot.standby = slot.standby, None
      with contextlib.suppress(OSError):  # it may die meanwhile: then it is restarted
        slot.proc.stdin.write(b"take over\n")
        slot.proc.stdin.close()
    else:
      slot.proc = self._spawn(i, standby=False)
    slot.restart_at = None
    (pathlib.Path(self.args.out) / f"replica_{i}.pid").write_text(f"{slot.proc.pid}\n")
    if self.args.standby:
      slot.standby = self._spawn(i, standby=True)

  def _spawn(self, i: int, standby: bool) -> subprocess.Popen:
    """A process of replica ``i`` (its stdout and stderr appended to ``OUT/replica_<i>.log``)
    in its own process group, in its network namespace with ``--replica-netns`` (``ip netns
    exec`` runs it in its own process); a ``standby`` waits for a line on its stdin."""
    a = self.args
    netns = ["ip", "netns", "exec", a.replica_netns.format(i=i)] if a.replica_netns else []
    # the launcher's flags last: they win over the same flags in --replica-args
    command = [*netns, sys.executable, *self.command, *a.replica_args, "--lighthouse", self.url,
               "--replica-id", str(i), "--out", a.out, "--host",
               socket.gethostname() if netns else a.host, "--min-replicas",
               str(a.min_replicas), "--parent-death", *["--wait-for-takeover"] * standby]
    with open(pathlib.Path(a.out) / f"replica_{i}.log", "a") as log:
      return subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True,
                              stdin=subprocess.PIPE if standby else subprocess.DEVNULL)

  def run(self) -> int:
    """Runs the replicas to the end; returns the exit status."""
    for i in range(len(self.slots)):
      self.start(i)
    finish_by = None
    while any(s.proc is not None or s.restart_at is not None for s in self.slots):
      now = time.monotonic()
      self._tend_lighthouse()
      for i, slot in enumerate(self.slots):
        self._tend(i, slot, now, finish_by is None)
      if finish_by is None and any(s.finished for s in self.slots):
        finish_by = now + self.args.finish_grace
      if finish_by is not None and now > finish_by:
        self.stop()
      time.sleep(0.05)
    return 0 if sum(s.finished for s in self.slots) >= self.args.min_replicas else 1

  def _tend(self, i: int, slot: _Slot, now: float, may_restart: bool) -> None:
    """Notes replica ``i``'s exit, schedules its restart, or restarts it when due."""
    if slot.restart_at is not None:
      if not may_restart:
        slot.restart_at = None
      elif now >= slot.restart_at:
        self.start(i)
      return
    if slot.proc is None or slot.proc.poll() is None:
      return
    status, slot.proc = slot.proc.returncode, None
    slot.finished = status == 0
    refused = status == REFUSED
    if not (slot.finished or refused) and may_restart and slot.restarts < self.args.max_restarts:
      slot.restarts += 1
      slot.restart_at = now + self.args.restart_delay

  def _tend_lighthouse(self) -> None:
    """Starts the Lighthouse again on the same address if it exited, at most ``--max-restarts``
    times (then the replicas' quorum requests time out and they end). It does not wait for the
    new process: meanwhile the replicas go on retrying their quorum requests, and one that
    exits at once (its port taken) is started again at the next look."""
    slot = self.lighthouse
    if slot.proc is None or slot.proc.poll() is None:
      return
    status, slot.proc = slot.proc.returncode, None
    if slot.restarts < self.args.max_restarts:
      slot.restarts += 1
      sys.stderr.write(f"optax_dist launcher: the Lighthouse exited (status {status});"
                       f" restarting it on {self.url}\n")
      self.start_lighthouse()

  def stop(self) -> None:
    """Kills every replica and standby still running (its process group) and cancels pending
    restarts."""
    for slot in self.slots:
      slot.restart_at = None
      for proc in (slot.proc, slot.standby):
        if proc is not None:
          if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
          proc.wait()
      slot.proc = slot.standby = None

  def close(self) -> None:
    """Stops the replicas and the Lighthouse."""
    self.stop()
    if self.lighthouse.proc is not None:
      self.lighthouse.proc.kill()
      self.lighthouse.proc.wait()


def main(argv: list[str] | None = None) -> int:
  """Runs the launcher; returns the exit status."""
  args = build_parser().parse_args(argv)
  try:
    check_arguments(args)
    from optax_dist.fault_tolerance import torchft_engine  # noqa: F401 (the ft extra)
  except (ValueError, ModuleNotFoundError) as e:
    sys.stderr.write(f"optax_dist launcher: error: {e}\n")
    return 2
  try:
    launcher = Launcher(args)
  except RuntimeError as e:
    sys.stderr.write(f"optax_dist launcher: error: {e}\n")
    return 2
  print(f"lighthouse {launcher.url}", flush=True)  # where a replica started by hand joins
  try:
    return launcher.run()
  finally:
    launcher.close()


def _free_port(host: str) -> int:
  """A port free on ``host`` now (the OS's pick), for a Lighthouse that restarts on it."""
  with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


if __name__ == "__main__":
  sys.exit(main())
