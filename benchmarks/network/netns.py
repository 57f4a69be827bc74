"""Two Linux network namespaces joined by a veth pair, each direction shaped by a token bucket.

:class:`Link` creates namespaces ``PREFIX-a-PID`` and ``PREFIX-b-PID`` joined by a veth pair
(``10.213.X.1`` and ``.2``, a private /30), each with an ``/etc/netns/NAME/hosts`` of its address:
gloo binds to the address the host name resolves to, else 127.0.0.1, unreachable from the other
namespace. Each veth's egress is shaped with ``tc qdisc ... root tbf rate R burst B latency L``, or
left unshaped (:meth:`Link.shape` changes the rate in place). :class:`Star` joins a hub namespace to
leaf namespaces on a bridge, shaped as a :class:`Link` or not, and takes a leaf's link down and up:
the chaos study's replicas cut off. Leaving the ``with`` block, on any exit, kills what still runs
in the namespaces and removes them, their veths and ``/etc/netns``.

Needs root and iproute2 (``ip``, ``tc``); :func:`unavailable` says why not, before any change::

  with Link(rate="10mbit") as link:
    link.popen("a", ["python", "-m", "http.server"])  # runs in namespace a
    print(link.counters(), link.measure_rate())
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Self

PREFIX = "odist"
"""The first part of the namespaces' names (``odist-a-PID``)."""
LATENCY = "50ms"
"""tbf's latency: the longest a packet may wait in the bucket's queue before it is dropped."""
MIN_BURST = 32 * 1024
"""tbf's smallest bucket, in bytes (see :func:`burst`)."""
PORT = 5201
"""The TCP port of :meth:`Link.measure_rate`'s receiver."""
FRAME_OVERHEAD = 66
"""Bytes of headers per packet on the veth: Ethernet 14, IPv4 20, TCP 32 (with timestamps)."""
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The checkout, first on the ``PYTHONPATH`` of :meth:`Link.run_pair`'s processes."""

_RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))  # SO_REUSEADDR on POSIX
print("ready", flush=True)
conn, _ = server.accept()
total, first, last = 0, None, None
while chunk := conn.recv(1 << 20):
  last = time.perf_counter()
  first, total = first or last, total + len(chunk)
print(total, first and last - first, flush=True)
"""

_SENDER = """
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
block, left = bytes(1 << 20), int(sys.argv[3])
while left > 0:
  conn.sendall(block[:min(left, len(block))])
  left -= min(left, len(block))
conn.close()
"""


class Unavailable(RuntimeError):
  """Namespaces cannot be made here: not root, no ``ip``/``tc``, or no namespace support."""


def unavailable() -> str | None:
  """Why :class:`Link` cannot run here (not root, ``ip`` or ``tc`` missing), or ``None``."""
  if os.geteuid() != 0:
    return "network namespaces need root (run as root, e.g. sudo make bench-network)"
  if missing := [tool for tool in ("ip", "tc") if shutil.which(tool) is None]:
    return f"{' and '.join(missing)} not found; install iproute2 (apt-get install -y iproute2)"
  return None


def bits_per_second(rate: str | None) -> float | None:
  """``"10mbit"`` → 1e7; ``None`` or ``"unshaped"`` → ``None`` (units: kbit, mbit, gbit)."""
  if rate is None or rate == "unshaped":
    return None
  match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.lower())
  if match is None:
    raise ValueError(f"a rate must be like 10mbit, 1gbit or unshaped, got {rate!r}")
  return float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]]


def burst(rate: str) -> int:
  """tbf's bucket for ``rate``, in bytes: 4 ms at the rate, and at least :data:`MIN_BURST` (it
  must hold what the rate allows between two timer ticks, or the link falls short of its rate; a
  larger one lets longer bursts through at the link's full speed)."""
  return max(int(bits_per_second(rate) / 8 / 250), MIN_BURST)


def _run(*argv: str, check: bool = True) -> str:
  """``argv``'s stdout; raises ``RuntimeError`` (its stderr) if it fails, unless not ``check``."""
  done = subprocess.run(argv, capture_output=True, text=True)
  if check and done.returncode != 0:
    raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")
  return done.stdout


def shape(namespace: str, device: str, rate: str | None) -> None:
  """(Re)shapes ``device``'s egress in ``namespace`` by tbf at ``rate`` (``"unshaped"``: none)."""
  _run("ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root",
       check=False)  # none there: fails
  if bits_per_second(rate) is not None:
    _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
         "rate", rate, "burst", str(burst(rate)), "latency", LATENCY)


def namespaces() -> list[str]:
  return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


def remove_stale() -> None:
  """Removes the namespaces of :data:`PREFIX` whose creating process has exited, and their
  ``/etc/netns`` directories (also one left without its namespace)."""
  etc = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
  for name in set(namespaces()) | set(etc):
    match = re.fullmatch(rf"{PREFIX}-(?:[ab]|hub[a-z]?|[a-z]?\d+)-(\d+)", name)
    if match and not os.path.exists(f"/proc/{match[1]}"):
      _remove_namespace(name)


def _remove_namespace(name: str) -> None:
  """Kills the processes in namespace ``name``, deletes it and its ``/etc/netns`` directory."""
  for pid in _run("ip", "netns", "pids", name, check=False).split():
    with contextlib.suppress(ProcessLookupError):
      os.kill(int(pid), signal.SIGKILL)
  _run("ip", "netns", "del", name, check=False)
  shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)


class _Namespaces:
  """The namespaces a subclass's ``_create`` adds with :meth:`_add`. Leaving the ``with`` block,
  on any exit (``SIGTERM`` and ``SIGHUP`` leave it too), kills what runs in them and removes them
  with their veths and ``/etc/netns`` directories. Entering raises :class:`Unavailable` (see
  :func:`unavailable`, or ``ip netns add`` failed)."""

  def __init__(self):
    self._made, self._previous_handlers = [], {}  # names; signal -> its handler before

  def __enter__(self) -> Self:
    if (reason := unavailable()) is not None:
      raise Unavailable(reason)

    def leave(signum, frame):  # SIGTERM and SIGHUP leave the ``with`` block, which cleans up
      raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
      with contextlib.suppress(ValueError):  # not the main thread
        self._previous_handlers[signum] = signal.signal(signum, leave)
    try:
      self._create()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def _add(self, name: str, address: str) -> None:
    """Adds namespace ``name`` with ``lo`` up, and its ``/etc/netns/NAME/hosts`` mapping this
    machine's host name to ``address`` (``ip netns exec`` bind-mounts it over ``/etc/hosts``)."""
    try:
      _run("ip", "netns", "add", name)
    except RuntimeError as e:
      raise Unavailable(f"cannot create a network namespace: {e}") from None
    self._made.append(name)
    os.makedirs(os.path.join("/etc/netns", name), exist_ok=True)
    with open(os.path.join("/etc/netns", name, "hosts"), "w") as f:
      f.write(f"127.0.0.1\tlocalhost\n{address}\t{socket.gethostname()}\n")
    _run("ip", "-n", name, "link", "set", "lo", "up")

  def close(self) -> None:
    while self._made:
      _remove_namespace(self._made.pop())
    for signum, handler in self._previous_handlers.items():
      signal.signal(signum, handler)
    self._previous_handlers.clear()


class Star(_Namespaces):
  """A hub namespace with a bridge, and ``leaves`` namespaces each joined to it by a veth pair:
  ``PREFIX-hubTAG-PID`` (:attr:`hub`) and ``PREFIX-TAGI-PID`` (:attr:`names`; :attr:`pattern`
  with ``{i}``), ``tag`` (one lower-case letter or none) telling apart the stars of one process.
  Addresses ``10.213.X.1`` for the hub's bridge (:attr:`address`), ``10.213.X.(I+2)`` for leaf
  ``I`` (:attr:`addresses`), one /24 with ``X`` = 128 + PID mod 128 (a :class:`Link`'s is PID mod
  128): each hub a network of its own, so the stars of one process share the addresses. With
  ``rate``, each leaf's link is shaped both ways (its ``eth0`` and its bridge port)."""

  def __init__(self, leaves: int, tag: str = "", rate: str | None = None):
    super().__init__()
    if not re.fullmatch("[a-z]?", tag):
      raise ValueError(f"Star(tag={tag!r}): a tag is one lower-case letter or empty")
    pid, self.rate = os.getpid(), rate
    self.hub, self.pattern = f"{PREFIX}-hub{tag}-{pid}", f"{PREFIX}-{tag}{{i}}-{pid}"
    self.names = [self.pattern.format(i=i) for i in range(leaves)]
    net = f"10.213.{128 + pid % 128}"
    self.address, self.addresses = f"{net}.1", [f"{net}.{i + 2}" for i in range(leaves)]
    self.ports = [f"os{pid}{tag}p{i}" for i in range(leaves)]  # the hub's ends, on the bridge

  def _create(self) -> None:
    self._add(self.hub, self.address)
    _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", self.hub, "addr", "add", f"{self.address}/24", "dev", "br0")
    _run("ip", "-n", self.hub, "link", "set", "br0", "up")
    for name, address, port in zip(self.names, self.addresses, self.ports, strict=True):
      self._add(name, address)
      _run("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
      _run("ip", "link", "set", port, "netns", self.hub)
      _run("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
      _run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
      _run("ip", "-n", name, "link", "set", "eth0", "up")
      shape(name, "eth0", self.rate)
      shape(self.hub, port, self.rate)

  def set_link(self, leaf: int, up: bool) -> None:
    """Takes leaf ``leaf``'s link down (its bridge port: nothing passes either way) or up."""
    _run("ip", "-n", self.hub, "link", "set", self.ports[leaf], "up" if up else "down")

  def counters(self) -> list[dict[str, int]]:
    """Each leaf's ``{"tx_bytes", "rx_bytes"}``: what its ``eth0`` sent and received."""
    return [{k: int(_run("ip", "netns", "exec", name, "cat", f"/sys/class/net/eth0/statistics/{k}"))
             for k in ("tx_bytes", "rx_bytes")} for name in self.names]

  def exec_prefix(self) -> list[str]:
    """The command line's start that runs a program in the hub."""
    return ["ip", "netns", "exec", self.hub]


class Link(_Namespaces):
  """Namespaces ``a`` and ``b`` and a veth pair between them shaped at ``rate`` (tc's, e.g.
  ``"10mbit"``; ``None`` or ``"unshaped"``: no qdisc) each way. ``names``, ``devices`` and
  ``addresses``: the namespaces, veths and addresses by side."""

  def __init__(self, rate: str | None = None):
    super().__init__()
    pid, self.rate = os.getpid(), rate
    self.names = {side: f"{PREFIX}-{side}-{pid}" for side in "ab"}
    self.devices = {side: f"od{pid}{side}" for side in "ab"}
    self.addresses = {"a": f"10.213.{pid % 128}.1", "b": f"10.213.{pid % 128}.2"}

  def _create(self) -> None:
    for side, name in self.names.items():
      self._add(name, self.addresses[side])
    _run("ip", "link", "add", self.devices["a"], "type", "veth", "peer", "name", self.devices["b"])
    for side in "ab":
      _run("ip", "link", "set", self.devices[side], "netns", self.names[side])
      self.run(side, ["ip", "addr", "add", f"{self.addresses[side]}/30", "dev", self.devices[side]])
      self.run(side, ["ip", "link", "set", self.devices[side], "up"])
    self.shape(self.rate)

  def shape(self, rate: str | None) -> None:
    """Shapes both directions at ``rate`` (``None``/``"unshaped"``: removes the shaping)."""
    self.rate = rate
    for side in "ab":
      shape(self.names[side], self.devices[side], rate)

  def run(self, side: str, argv: list[str], check: bool = True) -> str:
    """``argv``'s stdout, run in namespace ``side`` (:func:`_run`)."""
    return _run("ip", "netns", "exec", self.names[side], *argv, check=check)

  def popen(self, side: str, argv: list[str], **kwargs: Any) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", self.names[side], *argv], **kwargs)

  def run_pair(self, argvs: list[list[str]], logs: str, timeout: float, what: str = "") -> None:
    """Runs ``argvs[0]`` in namespace a and ``argvs[1]`` in b at once, from :data:`ROOT` (first
    on ``PYTHONPATH``, no ``XLA_FLAGS``), each writing ``LOGS/process{i}.log``, killed after
    ``timeout`` seconds; ``RuntimeError`` (with the last lines of each log) if one fails."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    paths = [os.path.join(logs, f"process{i}.log") for i in range(len(argvs))]
    procs, deadline = [], time.perf_counter() + timeout
    try:
      for side, argv, path in zip("ab", argvs, paths, strict=True):
        with open(path, "w") as log:  # the child keeps its own descriptor
          procs.append(self.popen(side, argv, env=env, cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT))
      with contextlib.suppress(subprocess.TimeoutExpired):
        for p in procs:
          p.wait(timeout=max(deadline - time.perf_counter(), 1))
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
    if [p.returncode for p in procs] != [0] * len(argvs):
      tails = [f"process {i} (exit {p.returncode}): "
               + " / ".join(pathlib.Path(path).read_text().strip().splitlines()[-3:])
               for i, (p, path) in enumerate(zip(procs, paths))]
      raise RuntimeError(f"{what} at {self.rate}: " + "; ".join(tails))

  def counters(self) -> dict[str, dict[str, int]]:
    """``{side: {"tx_bytes", "rx_bytes", "tx_packets"}}`` of each veth (``/sys/class/net``)."""
    keys, out = ("tx_bytes", "rx_bytes", "tx_packets"), {}
    for side in "ab":
      stats = f"/sys/class/net/{self.devices[side]}/statistics"
      values = self.run(side, ["cat", *(f"{stats}/{k}" for k in keys)]).split()
      out[side] = {k: int(v) for k, v in zip(keys, values, strict=True)}
    return out

  def measure_rate(self, sender: str = "b", nbytes: int | None = None) -> float:
    """The rate, in bits per second, of a TCP transfer of ``nbytes`` (default: about 1 s at the
    rate, 1 to 64 MiB) from ``sender``'s side. The receiver, in the other namespace, times from
    the first byte it receives to the last."""
    receiver, rate = "a" if sender == "b" else "b", bits_per_second(self.rate) or 8 * (64 << 20)
    nbytes, address = nbytes or int(min(max(rate / 8, 1 << 20), 64 << 20)), self.addresses[receiver]
    listen = self.popen(receiver, [sys.executable, "-c", _RECEIVER, address, str(PORT)],
                        stdout=subprocess.PIPE, text=True)
    try:
      if listen.stdout.readline().strip() != "ready":
        raise RuntimeError("the rate measurement's receiver did not start")
      self.run(sender, [sys.executable, "-c", _SENDER, address, str(PORT), str(nbytes)])
      out, _ = listen.communicate(timeout=120)
    finally:
      if listen.poll() is None:
        listen.kill()
        listen.wait()
    total, seconds = out.split()
    if int(total) != nbytes:
      raise RuntimeError(f"the receiver got {total} of {nbytes} bytes")
    return 8 * nbytes / float(seconds)
