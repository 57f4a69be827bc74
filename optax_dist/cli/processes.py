"""Running ``optax-dist`` over several ``jax.distributed`` processes, and stopping them on a fault.

``optax-dist train --processes P`` (without ``--process-id``) calls :func:`launch`: it starts
``P`` copies of the command as local subprocesses, process ``i`` with ``--process-id i
--coordinator 127.0.0.1:PORT`` (a free port), and watches them. Each copy calls
:func:`init_jax`, which connects it to the others with ``jax.distributed.initialize`` (process 0
runs the coordinator) and CPU collectives over gloo; the devices of all processes then form one
global mesh (see :mod:`optax_dist.cli.meshes`).

Faults. If a process exits with a non-zero code (or is killed), :func:`launch` kills the others at
once (``SIGKILL``: JAX catches ``SIGTERM`` for its preemption handling, and a process waiting in a
collective would not act on it; the Orbax checkpoints are written atomically, so a kill leaves the
last complete one) and reports which process failed and how: the command exits within about a
second of the fault. Processes started one by one (``--process-id I`` on a cluster) have no such
parent; there JAX's coordination service declares a process dead when it has sent no heartbeat
for ``heartbeat_timeout`` seconds and aborts the others, which exit within about
``heartbeat_timeout`` seconds (plus one heartbeat interval) with JAX's message naming the
unhealthy task, instead of waiting in a collective forever.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import jax

from optax_dist.cli.errors import PROG, CommandError

HEARTBEAT_TIMEOUT = 10
"""Default seconds without a heartbeat after which JAX declares a process dead."""

INITIALIZATION_TIMEOUT = 120
"""Seconds each process waits for all the others to connect to the coordinator."""

POLL_SECONDS = 0.05
"""How often :func:`launch` checks its processes."""

MISTAKE_STATUS = 2
"""The exit status of a process that has said its mistake in one line (:mod:`.errors`)."""

MISTAKE_GRACE_SECONDS = 10.0
"""How long :func:`launch` lets the other processes end by themselves after one exits with
:data:`MISTAKE_STATUS`: they find the same mistake, and process 0 says it."""


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port on ``host`` that is free now (picked by the OS by binding port 0)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def parse_address(text: str) -> tuple[str, int]:
  """``(host, port)`` of ``"HOST:PORT"``; raises ``ValueError`` naming the constraint."""
  host, sep, port = text.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"must be HOST:PORT with a port in 1..65535, got {text!r}")
  return host, int(port)


def _native_stdout_to_stderr() -> None:
  """Sends what native libraries write to stdout to stderr; Python's stdout stays stdout.

  gloo announces each connection on the C++ stdout, which would interleave with the table.
  """
  try:
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)
  except OSError:
    return
  sys.stdout = open(stdout, "w", buffering=1, encoding=sys.stdout.encoding)  # noqa: SIM115


def _join(coordinator: str, processes: int, process_id: int, heartbeat_timeout: int) -> None:
  """Connects this process to the others: ``jax.distributed.initialize`` with gloo collectives."""
  _native_stdout_to_stderr()
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(
      coordinator, num_processes=processes, process_id=process_id,
      initialization_timeout=INITIALIZATION_TIMEOUT,
      heartbeat_timeout_seconds=heartbeat_timeout,
      shutdown_timeout_seconds=INITIALIZATION_TIMEOUT,
    )
  except Exception as e:  # noqa: BLE001  (JAX raises its runtime's errors)
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise CommandError(
      f"argument --coordinator: process {process_id} of {processes} could not join the others"
      f" at {coordinator}: {reason}") from None


def init_jax(devices: int, processes: int = 1, process_id: int | None = None,
             coordinator: str | None = None, heartbeat_timeout: int | None = None) -> None:
  """Asks JAX for ``devices`` CPU devices and, with ``process_id``, joins the other processes.

  Must run before JAX initialises its backends. Process 0 also runs the coordination service at
  ``coordinator``.

  Raises:
    CommandError: the process could not join the others, or JAX has fewer devices.
  """
  try:
    if not os.environ.get("JAX_PLATFORMS"):
      jax.config.update("jax_platforms", "cpu")  # the workers are emulated CPU devices
    jax.config.update("jax_num_cpu_devices", devices)
  except RuntimeError:
    pass  # already initialised (called in-process); checked below
  if process_id is not None:
    _join(coordinator, processes, process_id, heartbeat_timeout or HEARTBEAT_TIMEOUT)
  available = len(jax.local_devices(backend="cpu"))
  if available < devices:
    raise CommandError(f"argument --devices: {devices} CPU devices were requested but JAX was"
                       f" initialised with {available}")


def _describe(code: int) -> str:
  if code < 0:
    try:
      return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with code {code}"


def _stop(procs: Sequence[subprocess.Popen]) -> None:
  """Kills the processes still running and waits for them."""
  for p in procs:
    if p.poll() is None:
      p.kill()
  for p in procs:
    p.wait()


def _wait(procs: Sequence[subprocess.Popen], seconds: float) -> None:
  """Waits until every process has ended, or ``seconds`` have passed."""
  deadline = time.monotonic() + seconds
  while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
    time.sleep(POLL_SECONDS)


def launch(argv: Sequence[str], processes: int, coordinator: str | None = None) -> int:
  """Runs ``optax-dist argv`` as ``processes`` local processes; returns the exit status.

  Process ``i`` runs ``python -m optax_dist.cli *argv --process-id i --coordinator ADDRESS``,
  with ``ADDRESS`` = ``coordinator`` or ``127.0.0.1`` and a free port. Their output goes to this
  process's stdout and stderr. Returns 0 when every process exits with 0. When one fails (checked
  every :data:`POLL_SECONDS`), kills the others, writes ``optax-dist: error: process i exited with
  code c; ...`` and returns 1; when it exits with :data:`MISTAKE_STATUS`, a mistake it has said
  (or process 0 says, :class:`~optax_dist.cli.errors.SaidByProcessZero`), lets the others end
  within :data:`MISTAKE_GRACE_SECONDS`, kills those left, adds no line and returns 2.
  """
  address = coordinator or f"127.0.0.1:{free_port()}"
  procs = [
    subprocess.Popen([sys.executable, "-m", "optax_dist.cli", *argv,
                      "--process-id", str(i), "--coordinator", address])
    for i in range(processes)
  ]
  try:
    return _watch(procs)
  except KeyboardInterrupt:
    _stop(procs)
    sys.stderr.write(f"{PROG}: interrupted\n")
    return 130


def _watch(procs: Sequence[subprocess.Popen]) -> int:
  """Waits for ``procs``; 0 if all succeed, 2 after a mistake (see :func:`launch`), else kills
  the others, reports and returns 1."""
  while True:
    codes = [p.poll() for p in procs]
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if failed and all(c == MISTAKE_STATUS for _, c in failed):
      _wait(procs, MISTAKE_GRACE_SECONDS)  # then a crash meanwhile is reported, not a mistake
      failed = [(i, p.poll()) for i, p in enumerate(procs) if p.poll() not in (None, 0)]
      if all(c == MISTAKE_STATUS for _, c in failed):
        _stop(procs)
        return MISTAKE_STATUS
    if failed:
      noticed = time.monotonic()
      _stop(procs)
      what = "; ".join(f"process {i} {_describe(c)}" for i, c in failed)
      sys.stderr.write(
        f"{PROG}: error: {what}; stopped the other processes in"
        f" {time.monotonic() - noticed:.1f} s. Rerun with --resume to continue from the last"
        f" checkpoint (--checkpoint-every).\n"
      )
      return 1
    if all(c == 0 for c in codes):
      return 0
    time.sleep(POLL_SECONDS)
