r"""A fault-tolerant run on one host: a Lighthouse and R replicas (groups of P processes each),
dead ones restarted.

A :class:`Launcher` of a :class:`LaunchConfig` starts torchft's Lighthouse as a child process
(:mod:`optax_dist.fault_tolerance.lighthouse`) bound to ``host`` (:func:`bind_address`), its output
appended to ``OUT/lighthouse.log`` and its pid in ``OUT/lighthouse.pid``, and R replica
processes (``replica_command`` with ``replica_args``), ids 0 to R-1, each in its own process
group and with ``--parent-death``. The Lighthouse and the replicas die with the launcher (Linux
``prctl(PR_SET_PDEATHSIG)``).

With ``processes`` P > 1, a replica is a group of P ``jax.distributed`` processes (torchft's
replica group): at each start of replica ``i`` the launcher finds a free port for the group's
coordination service (a restarted process cannot rejoin the service of the group's last start)
and starts ranks 0 to P-1 with ``--processes P --process-id r --coordinator HOST:PORT``, rank
``r``'s output in ``OUT/replica_<i>.rank_<r>.log`` and its pid in ``OUT/replica_<i>.rank_<r>.pid``
(rank 0's in ``replica_<i>.log`` and ``replica_<i>.pid``). A group is one replica: it has
finished once all its ranks exited with 0, and the exit of one rank with another status is the
group's fault: the launcher kills the group's other ranks at once (``SIGKILL``; they cannot go
on without it, and JAX's coordination service would abort them within its heartbeat timeout)
and restarts the group as a unit, which heals.

A Lighthouse that exits (killed) is started again at once on the same address, at most
``max_restarts`` times; meanwhile the replicas' quorum requests time out and are retried
(:class:`~optax_dist.fault_tolerance.torchft_engine.Torchft`, up to their
``quorum_timeout``), so the run stalls for the Lighthouse's downtime plus at most one request's
timeout and goes on.

A replica that exits with a nonzero status (killed, or an error) while no replica has finished
is started again under the same id after ``restart_delay`` seconds, at most ``max_restarts``
times per id: it heals at its first quorum. Status 2 is a replica's refusal (a mistake in its
flags or settings, said in one line in its log): it would refuse again, so it is not restarted.
Once a replica has finished (its steps committed), the others have ``finish_grace`` seconds to
finish too; the ones still running then are stopped (they are behind: no quorum forms for them
any more). :meth:`Launcher.run` returns 0 if at least ``min_replicas`` replicas finished, else 1.

With ``standby``, each replica id also has a warm standby: a process of the same command with
``--wait-for-takeover``, started beside it, that imports and compiles, then waits. A restart is
then the standby's takeover (a line on its stdin): it reads the newest checkpoint and joins at
once, and a new standby for the id starts. A standby that died (or never started) is replaced by
a fresh start. The pid of replica ``i``'s process (a standby once it took over) is in
``OUT/replica_<i>.pid``.

With ``replica_netns``, each replica (and its standby) runs in a network namespace of its own
(made beforehand, e.g. by the chaos study), with ``--host`` its host name, which it resolves
there to that namespace's address. ``optax-dist train --fault-tolerant``
(:mod:`optax_dist.cli.ft_train`) runs a :class:`Launcher` of ``optax-dist replica`` processes on
the command's tasks; :class:`~optax_dist.fault_tolerance.rundir.RunDir` reads what the run
wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from optax_dist import _checks
from optax_dist.fault_tolerance.rundir import RunDir

REFUSED = 2
"""A replica's exit status when it refuses its flags or settings: it is not restarted."""

LIGHTHOUSE_START_S = 30.0
"""Seconds the Lighthouse's process has to accept connections after the launcher's start (it
imports torch: about 2 s on an idle machine, several times that on a loaded one)."""

JOIN_TIMEOUT_S = 60.0
"""``join_timeout``'s default: seconds the Lighthouse waits for a replica that heartbeats but
has not asked for the quorum (torchft's own default). It must be longer than a round (H inner
steps and the exchange). A replica left out of a quorum asks for the next one at once, and the
Lighthouse counts the join timeout from the earliest request it holds. With a shorter timeout,
the next quorum forms as soon as a majority has asked and leaves out the member that asks
last, and that member then waits through a round in its turn: one member left out in every
round (a heal cascade). A long timeout costs nothing in the usual rounds. A quorum forms at once
when every member of the last one has asked, or when every heartbeating replica has. A dead,
stopped or cut-off replica stops heartbeating and is no longer waited for after
``lighthouse_heartbeat_timeout``."""

LIGHTHOUSE_PORT_TRIES = 3
"""Free ports tried for a Lighthouse started on any port (``LaunchConfig.port == 0``): another
process may take a port found free before the Lighthouse binds it."""

LIGHTHOUSE_COMMAND = (str(pathlib.Path(__file__).with_name("lighthouse.py")),)
"""What follows the Python interpreter in the Lighthouse's command line: the script's path (not
``-m``: torchft's program reads the process's arguments after the interpreter's first)."""


def bind_address(fn: str, host: str) -> str:
  """The address ``host`` gives, resolved once: the one the servers of a run bind and advertise.

  ``host`` is an IPv4 or IPv6 address (``::1`` or ``[::1]``) or a name, which ``getaddrinfo``
  resolves here to its first address. An unspecified address (``0.0.0.0``, ``::``) binds every
  interface, and so does a name that resolves to one (``0``): refused.

  Args:
    fn: the call site the error names (``LaunchConfig``, ``Torchft``, ``HealTransport``).
    host: the address or name given.

  Returns:
    The address, without brackets (:func:`url_host` puts them back in a URL).

  Raises:
    TypeError: ``host`` not a str.
    ValueError: ``host`` empty, a name that does not resolve, or an unspecified address or a
      name that resolves to one.
  """
  if not isinstance(host, str):
    raise TypeError(f"`{fn}(host=...)` must be a str, an address or a name, got {host!r}.")
  name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
  found: list[str] = []
  try:
    found = [info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)]
  except (OSError, UnicodeError) as e:
    if name:
      raise ValueError(f"`{fn}(host=...)` must be an address or a name that resolves, got"
                       f" {host!r} ({e}).") from None
  wildcard = next((a for a in found if _unspecified(a)), None) if found else ""
  if wildcard is not None:
    resolved = "" if wildcard in (name, "") else f" (it resolves to {wildcard}: every interface)"
    raise ValueError(f"`{fn}(host=...)` must be a specific address, got {host!r}{resolved}.")
  return found[0]


def _unspecified(address: str) -> bool:
  ip = ipaddress.ip_address(address)
  mapped = ip.ipv4_mapped if ip.version == 6 else None  # ::ffff:0.0.0.0 is 0.0.0.0 too
  return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)


def url_host(address: str) -> str:
  """``address`` as the host of a URL or of a ``host:port`` pair: an IPv6 one in brackets."""
  return f"[{address}]" if ":" in address else address


def majority(replicas: int) -> int:
  """``min_replicas``' default, ``replicas // 2 + 1``: two quorums of a majority share a member,
  so they cannot commit the same round apart."""
  return replicas // 2 + 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchConfig:
  """Everything a :class:`Launcher` needs; the fault-tolerance defaults (the command's
  ``--fault-tolerant`` flags take theirs from here). Checked once, when made.

  Attributes:
    replicas: R, the replicas, ids 0 to R-1.
    processes: P, the ``jax.distributed`` processes of each replica (a replica group, ranks 0
      to P-1; see the module's docstring); 1: a replica is one process.
    out: the run's directory (:class:`~optax_dist.fault_tolerance.rundir.RunDir`).
    replica_command: what follows the Python interpreter in a replica's command line, before
      ``replica_args`` and the flags the launcher adds (``--lighthouse``, ``--replica-id``,
      ``--out``, ``--host``, ``--min-replicas``, ``--quorum-timeout``, ``--exchange-timeout``,
      ``--exchange-retries``, ``--parent-death``, a standby's ``--wait-for-takeover``, and with
      ``processes`` > 1 ``--processes``, ``--process-id`` and ``--coordinator``); the replica
      must take those flags.
    replica_args: the flags of every replica, before the launcher's (which win).
    min_replicas: the smallest quorum that commits (the Lighthouse's and each replica's);
      ``None``: :func:`majority` of ``replicas``.
    host: the address the Lighthouse binds and the replicas bind and advertise, or a name
      resolved to it once here (:func:`bind_address`; the field then holds the address).
    port: the Lighthouse's port; 0: a free one.
    quorum_timeout: seconds a replica waits for a quorum before it gives up.
    exchange_timeout: seconds for a collective, a heal and the vote.
    exchange_retries: times a round whose exchange failed is tried again in a new quorum.
    join_timeout: seconds the Lighthouse waits for a heartbeating replica that has not asked for
      the quorum; longer than a round (:data:`JOIN_TIMEOUT_S`).
    lighthouse_heartbeat_timeout: seconds without a heartbeat before the Lighthouse drops a
      replica.
    max_restarts: restarts of each replica id, and of the Lighthouse.
    restart_delay: seconds before a dead replica is started again.
    finish_grace: seconds the others have to finish once one replica has.
    standby: keep a warm standby process per replica id (``processes`` 1 only).
    replica_netns: run replica I in the network namespace this pattern names with ``{i}``
      replaced by I (made beforehand); ``None``: this namespace (``processes`` 1 only).

  Raises:
    TypeError: a count not an int, a timing not a number.
    ValueError: a value out of its range (naming the field, its constraint and the value), a
      ``host`` that is unspecified or does not resolve, a ``replica_netns`` without ``{i}`` or
      naming a missing namespace, ``standby`` or ``replica_netns`` with ``processes`` > 1.
  """

  replicas: int
  out: str
  processes: int = 1
  replica_command: tuple[str, ...]
  replica_args: tuple[str, ...] = ()
  min_replicas: int | None = None
  host: str = "127.0.0.1"
  port: int = 0
  quorum_timeout: float = 60.0
  exchange_timeout: float = 30.0
  exchange_retries: int = 1
  join_timeout: float = JOIN_TIMEOUT_S
  lighthouse_heartbeat_timeout: float = 5.0
  max_restarts: int = 3
  restart_delay: float = 1.0
  finish_grace: float = 10.0
  standby: bool = False
  replica_netns: str | None = None

  def __post_init__(self):
    fn = "LaunchConfig"
    _checks.check_positive_int(fn, "replicas", self.replicas)
    _checks.check_positive_int(fn, "processes", self.processes)
    for name, why in (("standby", "a standby group is not built"),
                      ("replica_netns", "a group's coordinator listens on the launcher's host")):
      if self.processes > 1 and getattr(self, name) not in (False, None):
        raise ValueError(f"`{fn}({name}=...)` must be off with processes > 1 (replica groups),"
                         f" got {getattr(self, name)!r}: {why}.")
    set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
    set_("out", os.fspath(self.out))
    set_("replica_command", tuple(self.replica_command))
    set_("replica_args", tuple(self.replica_args))
    if not self.replica_command:
      raise ValueError(f"`{fn}(replica_command=...)` must name what a replica runs, got ().")
    if self.min_replicas is None:
      set_("min_replicas", majority(self.replicas))
    _checks.check_int(fn, "min_replicas", self.min_replicas)
    if not 1 <= self.min_replicas <= self.replicas:
      raise ValueError(f"`{fn}(min_replicas=...)` must be in [1, replicas={self.replicas}], got"
                       f" {self.min_replicas}.")
    for name in ("quorum_timeout", "exchange_timeout", "lighthouse_heartbeat_timeout"):
      _checks.check_number(fn, name, getattr(self, name), lower=0.0, lower_open=True,
                           constraint="a positive number of seconds")
    for name in ("join_timeout", "restart_delay", "finish_grace"):
      _checks.check_number(fn, name, getattr(self, name), lower=0.0,
                           constraint="a number of seconds >= 0")
    for name in ("exchange_retries", "max_restarts"):
      _checks.check_non_negative_int(fn, name, getattr(self, name))
    _checks.check_non_negative_int(fn, "port", self.port)
    if self.port > 65535:
      raise ValueError(f"`{fn}(port=...)` must be in [0, 65535], got {self.port}.")
    set_("host", bind_address(fn, self.host))
    if self.replica_netns is not None:
      names = {self.replica_netns.format(i=i) for i in range(self.replicas)}
      if len(names) != self.replicas:
        raise ValueError(f"`{fn}(replica_netns=...)` must hold {{i}} (one namespace per"
                         f" replica), got {self.replica_netns!r}.")
      if missing := sorted(n for n in names if not os.path.exists(f"/run/netns/{n}")):
        raise ValueError(f"`{fn}(replica_netns=...)` must name existing network namespaces"
                         f" (ip netns list): no {missing[0]}, got {self.replica_netns!r}.")


@dataclasses.dataclass
class _Lighthouse:
  """The Lighthouse's process and its restarts."""

  proc: subprocess.Popen | None = None
  restarts: int = 0


@dataclasses.dataclass
class _Slot:
  """One replica id's processes (its group's ranks in order; ``[]``: none running) and its
  history."""

  procs: list[subprocess.Popen] = dataclasses.field(default_factory=list)
  standby: subprocess.Popen | None = None
  restarts: int = 0
  restart_at: float | None = None
  finished: bool = False


class Launcher:
  """The Lighthouse and the replica processes of one run (see the module's docstring).

  Args:
    config: the run's :class:`LaunchConfig`.

  Raises:
    RuntimeError: the Lighthouse did not start (its log's last lines said).
  """

  def __init__(self, config: LaunchConfig):
    self.config, self.dir = config, RunDir(config.out)
    self.dir.out.mkdir(parents=True, exist_ok=True)
    self.lighthouse = _Lighthouse()
    for attempt in range(LIGHTHOUSE_PORT_TRIES):
      # a port found free may be taken before the Lighthouse binds it: then another one
      self.port = config.port or _free_port(config.host)
      self.url = f"http://{url_host(config.host)}:{self.port}"
      self.start_lighthouse()
      try:
        self._wait_for_lighthouse()
        break
      except RuntimeError:
        self.lighthouse.proc.kill()
        self.lighthouse.proc.wait()
        if config.port or attempt == LIGHTHOUSE_PORT_TRIES - 1:
          raise
    self.slots = [_Slot() for _ in range(config.replicas)]

  def start_lighthouse(self) -> None:
    """Starts the Lighthouse's process on ``self.url`` (its output appended to
    ``OUT/lighthouse.log``, its pid written to ``OUT/lighthouse.pid``)."""
    c = self.config
    command = [sys.executable, *LIGHTHOUSE_COMMAND, "--bind",
               f"{url_host(c.host)}:{self.port}",
               "--min_replicas", str(c.min_replicas), "--quorum_tick_ms", "20",
               "--join_timeout_ms", str(int(c.join_timeout * 1000)),
               "--heartbeat_timeout_ms", str(int(c.lighthouse_heartbeat_timeout * 1000))]
    with open(self.dir.lighthouse_log, "a") as log:
      self.lighthouse.proc = subprocess.Popen(command, stdout=log, stderr=log)
    self.dir.lighthouse_pid_file.write_text(f"{self.lighthouse.proc.pid}\n")

  def _wait_for_lighthouse(self) -> None:
    """Waits until the Lighthouse accepts connections.

    Raises:
      RuntimeError: its process exited, or did not accept connections within
        ``LIGHTHOUSE_START_S`` seconds (e.g. the port is in use); the message has its log's end.
    """
    deadline = time.monotonic() + LIGHTHOUSE_START_S
    while self.lighthouse.proc.poll() is None and time.monotonic() < deadline:
      try:
        socket.create_connection((self.config.host, self.port), timeout=0.5).close()
      except OSError:
        time.sleep(0.05)
        continue
      if self.lighthouse.proc.poll() is None:  # its own socket, not another process's
        return
    raise RuntimeError(f"the Lighthouse did not start on {self.url}: "
                       + " | ".join(self.dir.lighthouse_log.read_text().strip().splitlines()[-3:]))

  def start(self, i: int) -> None:
    """Starts replica ``i``: its standby takes over if it has a live one, else new processes
    (a group of ``processes``, with a coordinator on a free port); with ``standby``, then a new
    standby for ``i``. Writes ``OUT/replica_<i>.pid`` (and each further rank's)."""
    slot, c = self.slots[i], self.config
    if slot.standby is not None and slot.standby.poll() is None:
      slot.procs, slot.standby = [slot.standby], None
      with contextlib.suppress(OSError):  # it may die meanwhile: then it is restarted
        slot.procs[0].stdin.write(b"take over\n")
        slot.procs[0].stdin.close()
    else:
      coordinator = f"{url_host(c.host)}:{_free_port(c.host)}" if c.processes > 1 else None
      slot.procs = [self._spawn(i, standby=False, rank=r, coordinator=coordinator)
                    for r in range(c.processes)]
    slot.restart_at = None
    for rank, proc in enumerate(slot.procs):
      self.dir.pid_file(i, rank).write_text(f"{proc.pid}\n")
    if c.standby:
      slot.standby = self._spawn(i, standby=True)

  def replica_command(self, i: int, standby: bool = False, rank: int = 0,
                      coordinator: str | None = None) -> list[str]:
    """The command line of replica ``i`` (a ``standby`` waits for a line on its stdin), in its
    network namespace with ``replica_netns`` (``ip netns exec`` runs it in its own process);
    with ``processes`` > 1, its process ``rank`` of the group whose coordination service
    listens on ``coordinator`` (``HOST:PORT``)."""
    c = self.config
    netns = ["ip", "netns", "exec", c.replica_netns.format(i=i)] if c.replica_netns else []
    group = (["--processes", str(c.processes), "--process-id", str(rank), "--coordinator",
              coordinator] if c.processes > 1 else [])
    # the launcher's flags last: they win over the same flags in replica_args
    return [*netns, sys.executable, *c.replica_command, *c.replica_args, "--lighthouse", self.url,
            "--replica-id", str(i), "--out", c.out, "--host",
            socket.gethostname() if netns else c.host, "--min-replicas", str(c.min_replicas),
            "--quorum-timeout", str(c.quorum_timeout), "--exchange-timeout",
            str(c.exchange_timeout), "--exchange-retries", str(c.exchange_retries),
            *group, "--parent-death", *["--wait-for-takeover"] * standby]

  def _spawn(self, i: int, standby: bool, rank: int = 0,
             coordinator: str | None = None) -> subprocess.Popen:
    """A process of replica ``i`` (:meth:`replica_command`; its stdout and stderr appended to
    ``OUT/replica_<i>.log``, a further rank's to its own) in its own process group."""
    with open(self.dir.replica_log(i, rank), "a") as log:
      return subprocess.Popen(self.replica_command(i, standby, rank, coordinator), stdout=log,
                              stderr=log, start_new_session=True,
                              stdin=subprocess.PIPE if standby else subprocess.DEVNULL)

  def run(self) -> int:
    """Runs the replicas to the end; returns the exit status."""
    for i in range(len(self.slots)):
      self.start(i)
    finish_by = None
    while any(s.procs or s.restart_at is not None for s in self.slots):
      now = time.monotonic()
      self._tend_lighthouse()
      for i, slot in enumerate(self.slots):
        self._tend(i, slot, now, finish_by is None)
      if finish_by is None and any(s.finished for s in self.slots):
        finish_by = now + self.config.finish_grace
      if finish_by is not None and now > finish_by:
        self.stop()
      time.sleep(0.05)
    return 0 if sum(s.finished for s in self.slots) >= self.config.min_replicas else 1

  def _tend(self, i: int, slot: _Slot, now: float, may_restart: bool) -> None:
    """Notes replica ``i``'s exit (all its processes with 0, or one with another status: then
    the group's others are killed), schedules its restart, or restarts it when due."""
    if slot.restart_at is not None:
      if not may_restart:
        slot.restart_at = None
      elif now >= slot.restart_at:
        self.start(i)
      return
    failed = [status for status in (p.poll() for p in slot.procs) if status not in (None, 0)]
    if not slot.procs or (not failed and any(p.returncode is None for p in slot.procs)):
      return  # running (a rank that finished waits for the others)
    if failed and len(slot.procs) > 1:
      ranks = [r for r, p in enumerate(slot.procs) if p.returncode not in (None, 0)]
      sys.stderr.write(f"optax_dist launcher: replica {i}'s process {ranks[0]} exited (status"
                       f" {failed[0]}); its group's other processes stopped\n")
    _kill(slot.procs)  # a group's fault: its other ranks cannot go on without the one lost
    slot.procs, slot.finished = [], not failed
    refused = REFUSED in failed
    if failed and not refused and may_restart and slot.restarts < self.config.max_restarts:
      slot.restarts += 1
      slot.restart_at = now + self.config.restart_delay
      self.dir.add_restart(i, failed[0])

  def _tend_lighthouse(self) -> None:
    """Starts the Lighthouse again on the same address if it exited, at most ``max_restarts``
    times (then the replicas' quorum requests time out and they end). It does not wait for the
    new process: meanwhile the replicas go on retrying their quorum requests, and one that
    exits at once (its port taken) is started again at the next look."""
    slot = self.lighthouse
    if slot.proc is None or slot.proc.poll() is None:
      return
    status, slot.proc = slot.proc.returncode, None
    if slot.restarts < self.config.max_restarts:
      slot.restarts += 1
      sys.stderr.write(f"optax_dist launcher: the Lighthouse exited (status {status});"
                       f" restarting it on {self.url}\n")
      self.start_lighthouse()

  def stop(self) -> None:
    """Kills every replica process and standby still running (its process group) and cancels
    pending restarts."""
    for slot in self.slots:
      slot.restart_at = None
      _kill([*slot.procs, *[slot.standby] * (slot.standby is not None)])
      slot.procs, slot.standby = [], None

  def close(self) -> None:
    """Stops the replicas and the Lighthouse."""
    self.stop()
    if self.lighthouse.proc is not None:
      self.lighthouse.proc.kill()
      self.lighthouse.proc.wait()


def _kill(procs: list[subprocess.Popen]) -> None:
  """Kills the process group of each of ``procs`` still running (``SIGKILL``) and waits for
  each."""
  for proc in procs:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  for proc in procs:
    proc.wait()


def _free_port(host: str) -> int:
  """A port free on ``host`` now (the OS's pick), for a Lighthouse that restarts on it."""
  with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
    s.bind((host, 0))
    return s.getsockname()[1]
