"""The torchft session of a fault-tolerant replica: the only module that touches torchft's
internals.

:class:`Session` holds torchft's ``Manager`` with its ``TCPStore``, ``ProcessGroupGloo`` and
:class:`HealTransport`; it asks for quorums (again after a timeout, through a new ``Manager``
when the Lighthouse lost the request or was restarted, and before a request when the Lighthouse
is down), all-gathers buffers over the quorum's process group and casts the vote. The round
itself (what is gathered, the decision, commit or abort) is the engine's,
:class:`~optax_dist.fault_tolerance.torchft_engine.Torchft`. torchft 0.2.0's private
``Manager._quorum_future`` and ``Manager._quorum_id`` and the text of its Lighthouse's
``/status`` page are read here only.

What the session opens listens on the address given (``host``): the ``TCPStore`` (on a socket
bound here), the gloo process group's device (:class:`_GlooOnHost`) and the heal server.
torchft 0.2.0's ``Manager`` server binds ``[::]`` (its code, not an argument).

A replica of P processes (a replica group, torchft's HSDP layout) has one session per process:
rank ``r``'s ``Manager(rank=r, world_size=P)``, the store rank 0's (whose address the other
ranks get from the subclass's ``share``), the replica id the group's. Only rank 0's ``Manager``
server talks to the Lighthouse, once every rank has asked it for the quorum; rank ``r``'s
process group joins rank ``r`` of the other replicas (torchft's store prefix
``/torchft/<quorum>/<r>``), its heal comes from rank ``r`` of the donor, and its vote
(``should_commit``) is the group's: a commit needs every rank's yes.

Needs the ``ft`` extra (``torch`` and ``torchft``).
"""

from __future__ import annotations

import http.server
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import timedelta
from typing import Any

import numpy as np

from optax_dist.fault_tolerance.heal import tree_bytes, tree_from_bytes
from optax_dist.fault_tolerance.launcher import bind_address, url_host

INSTALL_HINT = 'the torchft engine needs the "ft" extra: pip install "optax-dist[ft]"'

try:
  import torch
  import torch.distributed as dist
  from torch.distributed.distributed_c10d import AllgatherOptions, BroadcastOptions
  from torchft.checkpointing.transport import CheckpointTransport
  from torchft.manager import Manager
  from torchft.process_group import ProcessGroupGloo
except ModuleNotFoundError as e:
  raise ModuleNotFoundError(f"no module named {e.name!r}; {INSTALL_HINT}", name=e.name) from None

FRAME_MAGIC = b"optax_dist-torchft-heal/1\n"
"""The first bytes of what :class:`HealTransport` sends: then the torchft counters as 8-byte
big-endian length and JSON, then one :func:`encode_heal` payload."""

_LENGTH = 8
QUORUM_ATTEMPT_S = 5.0
"""Seconds one quorum request waits for the Lighthouse's answer before it is sent again (at most
``quorum_timeout`` in all): longer than a quorum's usual wait (the Lighthouse's join timeout, a
stopped member's heartbeat timeout), shorter than a Lighthouse's restart plus this."""


class SettingsMismatch(RuntimeError):
  """A replica's settings differ from the run's: it leaves the run."""


class StateLost(RuntimeError):
  """Decoupled rounds: every live replica restarted after the run committed rounds, so no member
  holds its global state, and decoupled rounds keep no checkpoint: the run cannot go on (it does
  not start again from its initial state under the same round numbers)."""


class MissedRounds(RuntimeError):
  """Decoupled rounds: a replica cannot hold the run's global state, so it leaves the run: its
  quorum's members closed rounds it did not (a round its vote failed on, which the others
  commit, included) and no heal or catch-up reached it within the quorum timeout."""


def _frame(state_dict: dict) -> bytes:
  """torchft's heal state ``{"user": {"default": bytes}, "torchft": {str: int}}`` as bytes."""
  counters = state_dict["torchft"]
  head = json.dumps({k: int(v) for k, v in counters.items()}).encode()
  return b"".join([FRAME_MAGIC, len(head).to_bytes(_LENGTH, "big"), head,
                   state_dict["user"]["default"]])


def _unframe(data: bytes, source: str) -> dict:
  """The inverse of :func:`_frame`, reading JSON integers and raw bytes only."""
  if not data.startswith(FRAME_MAGIC):
    raise ValueError(f"heal frame from {source} does not start with {FRAME_MAGIC!r}: refused.")
  start = len(FRAME_MAGIC) + _LENGTH
  length = int.from_bytes(data[len(FRAME_MAGIC):start], "big")
  try:
    counters = json.loads(data[start:start + length].decode())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"heal frame from {source}: the counters are not JSON ({e}).") from None
  if not (isinstance(counters, dict)
          and all(isinstance(v, int) and not isinstance(v, bool) for v in counters.values())):
    raise ValueError(f"heal frame from {source}: the counters must be a JSON object of ints.")
  return {"user": {"default": data[start + length:]}, "torchft": counters}


class HealTransport(CheckpointTransport):
  """torchft's ``CheckpointTransport`` carrying heal payloads over HTTP, never a pickle.

  A donor's ``send_checkpoint`` stages the frame (:data:`FRAME_MAGIC`, torchft's step counters
  as JSON, the user state: one :func:`encode_heal` payload); a joiner's ``recv_checkpoint`` GETs
  ``/heal/<step>`` from the donor's :meth:`metadata` address and returns the same dict, whose
  heal bytes the replica's ``load_state_dict`` passes to :func:`decode_heal`.

  Args:
    host: the address the server binds and advertises, IPv4 or IPv6, or a name resolved to it
      (:func:`~optax_dist.fault_tolerance.launcher.bind_address`).
    timeout: seconds the server holds a GET until its frame is staged (then a 404); a
      joiner's GET waits twice that.

  Attributes:
    source: the quorum rank of the donor of the last ``recv_checkpoint`` (torchft's
      ``src_rank``), or ``None``; a caller resets it before a quorum.

  Raises:
    ValueError: ``host`` empty, unresolvable or unspecified (``0``, ``0.0.0.0``, ``::``).
  """

  def __init__(self, host: str, timeout: float):
    host = bind_address("HealTransport", host)
    self.source: int | None = None
    self._staged = threading.Condition()
    self._step_bytes: tuple[int, bytes] | None = None
    self._timeout = timeout
    transport = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_GET(self):  # noqa: N802 (http.server's name)
        data = transport._wait_for(self.path)
        if data is None:
          self.send_error(404)
          return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def log_message(self, *args):
        pass

    server = _HTTPServer6 if ":" in host else http.server.ThreadingHTTPServer
    self._server = server((host, 0), Handler)
    self._server.daemon_threads = True
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
    self._thread.start()
    self.address = f"http://{url_host(host)}:{self._server.server_address[1]}"

  def metadata(self) -> str:
    return self.address

  def _wait_for(self, path: str) -> bytes | None:
    """The staged frame once ``path`` is ``/heal/<its step>`` (a joiner may ask before its donor
    stages), or ``None`` after the timeout."""
    with self._staged:
      self._staged.wait_for(
        lambda: self._step_bytes is not None and path == f"/heal/{self._step_bytes[0]}",
        self._timeout)
      staged = self._step_bytes
    return staged[1] if staged is not None and path == f"/heal/{staged[0]}" else None

  def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
    del dst_ranks, timeout
    with self._staged:
      self._step_bytes = (step, _frame(state_dict))
      self._staged.notify_all()

  def disallow_checkpoint(self) -> None:
    with self._staged:
      self._step_bytes = None

  max_bytes: int | None = None
  """The most bytes :meth:`recv_checkpoint` reads: the joiner's engine sets it before each
  quorum from its own donation's tree (its bytes, a manifest of its leaves and torchft's
  counters); ``None``: unbounded."""

  def recv_checkpoint(self, src_rank, metadata, step, timeout) -> dict:
    """The donor's frame, from ``GET /heal/<step>`` at the address it advertises (``metadata``),
    over plain HTTP only: ``metadata`` must be ``http://host:port`` (no other scheme, no path,
    query or credentials); no proxy; no redirect followed; at most :attr:`max_bytes` read.

    Raises:
      ValueError: ``metadata`` not ``http://host:port``; a redirect (a 3xx); more than
        :attr:`max_bytes` bytes, announced (``Content-Length``) or sent; a frame that
        :func:`_unframe` refuses.
      urllib.error.HTTPError: another status than 200 (404: nothing staged for ``step``).
      OSError: the donor unreachable, or too slow.
    """
    del timeout  # torchft's; the GET waits twice the server's wait, so a frame never staged
    # comes back as a 404
    self.source, source = src_rank, f"rank {src_rank} ({metadata})"
    parts = urllib.parse.urlsplit(metadata) if isinstance(metadata, str) else None
    try:
      port = None if parts is None else parts.port
    except ValueError:  # not a port number
      port = None
    if (port is None or parts.scheme != "http" or not parts.hostname or "@" in parts.netloc
        or parts.path or parts.query or parts.fragment):
      raise ValueError(f"heal from {source}: the donor's address must be http://host:port, got"
                       f" {metadata!r}: refused.")
    opener = urllib.request.OpenerDirector()  # HTTP alone: no redirect, proxy or other scheme
    for handler in (urllib.request.HTTPHandler(), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPErrorProcessor()):
      opener.add_handler(handler)
    try:
      response = opener.open(f"http://{parts.netloc}/heal/{int(step)}",
                             timeout=2 * self._timeout)
    except urllib.error.HTTPError as e:
      if not 300 <= e.code < 400:
        raise
      e.close()
      raise ValueError(f"heal from {source}: a redirect ({e.code}, to"
                       f" {e.headers.get('Location')!r}): refused.") from None
    limit, data = self.max_bytes, b""
    with response:
      announced = response.headers.get("Content-Length", "")
      size = int(announced) if announced.isdigit() else 0
      if limit is None or size <= limit:  # else refused unread
        data = response.read() if limit is None else response.read(limit + 1)
        size = max(size, len(data))
    if limit is not None and size > limit:
      raise ValueError(f"heal from {source}: {size} bytes or more, over the {limit} that this"
                       " replica's own donation takes: refused.")
    return _unframe(data, source)

  def shutdown(self, wait: bool = True) -> None:
    self._server.shutdown()
    self._server.server_close()


class _HTTPServer6(http.server.ThreadingHTTPServer):
  """The heal server on an IPv6 address (``ThreadingHTTPServer`` is IPv4 only)."""

  address_family = socket.AF_INET6


# ----------------------------------------------------------------------------------------------
# The exchange.


def pack(payload: Any) -> torch.Tensor:
  """A member's payload as an all-gather buffer: :func:`tree_bytes` (uint8)."""
  # gloo writes into its buffers: a writable copy, never a view of a JAX array.
  return torch.from_numpy(np.frombuffer(tree_bytes(payload), np.uint8).copy())


def unpack(buffer: torch.Tensor, like: Any) -> Any:
  """A member's payload (``like``'s tree, dtypes and shapes) from its buffer."""
  return tree_from_bytes(buffer.numpy().tobytes(), like)


class _GlooOnHost(ProcessGroupGloo):
  """torchft's reconfigurable gloo process group with its device, whose socket listens for the
  other members, on ``host`` (torch's default device takes the address the machine's host name
  resolves to). ``_create_pg`` is torchft 0.2.0's with the device given, for the CPU."""

  def __init__(self, host: str, timeout: timedelta):
    super().__init__(timeout=timeout)
    self._host = host

  def _create_pg(self, store, rank: int, world_size: int) -> dist.ProcessGroup:
    pg = dist.ProcessGroup(store, rank, world_size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=self._host)]
    options._timeout = self._timeout
    backend = dist.ProcessGroupGloo(store, rank, world_size, options)
    backend._set_sequence_number_for_group()
    if self._global_ranks:
      backend.options.global_ranks_in_group = self._global_ranks
    if self._group_rank and self._group_world_size:
      backend.options.group_name = (
        f"torchft_quorum_{self._quorum_id}_rank_{self._group_rank % self._group_world_size}")
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def _store_on(host: str) -> dist.TCPStore:
  """A master ``TCPStore`` listening on ``host`` only (given ``host`` alone, torch's binds every
  interface): on a socket bound here, which the store then owns and closes."""
  listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
  try:
    listener.bind((host, 0))
    listener.listen()
    store = dist.TCPStore(host, listener.getsockname()[1], is_master=True,
                          wait_for_workers=False, master_listen_fd=listener.fileno())
  except BaseException:
    listener.close()
    raise
  listener.detach()
  return store


class Session:
  """A replica's torchft session (see the module's docstring). A subclass provides the heal
  callbacks ``_heal_bytes() -> bytes`` (what it donates) and ``_load(payload)`` (a received
  heal), ``slot`` (its replica id), ``group_rank`` and ``group_size`` (this process's rank in
  its replica group, and the group's processes), and with ``group_size`` > 1
  ``share(address)`` (rank 0's ``(host, port)`` given to every rank; the others pass ``None``);
  :meth:`_open` starts the session.

  Attributes:
    quorum_timeout: seconds a quorum may take in all, over requests of at most
      :data:`QUORUM_ATTEMPT_S` each.
  """

  group_rank: int = 0
  group_size: int = 1

  @property
  def num_replicas(self) -> int | None:
    """The engine's ``num_replicas``: the most payloads a merge holds, if known."""
    return self.engine.num_replicas

  def _open(self, lighthouse: str, host: str, min_replicas: int, quorum_timeout: float,
            timeout: float) -> None:
    """Starts the session: a ``Manager`` that heartbeats to ``lighthouse``."""
    self.quorum_timeout = quorum_timeout
    self._manager_args = (lighthouse, host, min_replicas, quorum_timeout, timeout)
    self._manager = self._make_manager(*self._manager_args)
    self._torchft_quorum_id, self._renew = -1, False

  def _make_manager(self, lighthouse, host, min_replicas, quorum_timeout, timeout) -> Manager:
    """A ``Manager`` over a new process group and :class:`HealTransport`, each listening on
    ``host``, and the replica group's new ``TCPStore`` (rank 0's, on its ``host``)."""
    store = None
    if self.group_rank == 0:
      self._store = _store_on(host)
      store = host, self._store.port
    store_host, store_port = store if self.group_size == 1 else self.share(store)
    self._pg = _GlooOnHost(host, timedelta(seconds=timeout))
    bound = getattr(getattr(self, "transport", None), "max_bytes", None)
    self.transport = HealTransport(host, timeout)
    self.transport.max_bytes = bound  # a renewed manager's heal reads no more than the last
    try:  # torchft advertises http://{hostname}:port (an IPv6 address in brackets), and takes
      # store_addr as the store's address (without them)
      return Manager(
        pg=self._pg, load_state_dict=self._load, state_dict=self._heal_bytes,
        min_replica_size=min_replicas, use_async_quorum=False, init_sync=False,
        timeout=timedelta(seconds=timeout), quorum_timeout=timedelta(seconds=quorum_timeout),
        connect_timeout=timedelta(seconds=timeout), rank=self.group_rank,
        world_size=self.group_size, store_addr=store_host, store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{self.slot}", hostname=url_host(host),
        checkpoint_transport=self.transport)
    except BaseException:
      self.transport.shutdown()
      raise

  def _quorum(self) -> None:
    """``start_quorum`` in requests of at most ``QUORUM_ATTEMPT_S`` seconds, until one is
    answered or ``quorum_timeout`` seconds have passed; through a new manager first when the
    Lighthouse is down (:meth:`_lighthouse_down`).

    Raises:
      TimeoutError: no request answered within ``quorum_timeout`` seconds.
    """
    deadline = time.monotonic() + self.quorum_timeout
    if self._renew or self._lighthouse_down():
      self._renew_manager(deadline)
    while True:
      attempt = min(QUORUM_ATTEMPT_S, deadline - time.monotonic())
      try:
        self._manager.start_quorum(timeout=timedelta(seconds=max(attempt, 0.001)))
        break
      except TimeoutError:
        if time.monotonic() >= deadline:
          raise
        if self._lighthouse_restarted():
          self._renew_manager(deadline)
        else:  # the Lighthouse holds the request: torchft 0.2.0 raises a failed request's
          # error again from every later start_quorum unless the request is forgotten
          self._manager._quorum_future = None
    # torchft 0.2.0 has no public getter for the quorum id.
    quorum_id = self._manager._quorum_id
    self._renew = quorum_id < self._torchft_quorum_id
    self._torchft_quorum_id = quorum_id

  def _lighthouse_down(self) -> bool:
    """Whether nothing accepts a TCP connection on the Lighthouse's address within 1 s (it is
    down or being restarted, or this replica is cut off from it). A request sent then is lost,
    also once the Lighthouse is back: torchft 0.2.0's manager server does not send it again, and
    it waits out its whole attempt (``QUORUM_ATTEMPT_S``); a new manager connects to the
    Lighthouse once it is back."""
    address = urllib.parse.urlsplit(self._manager_args[0])
    try:
      socket.create_connection((address.hostname, address.port), timeout=1.0).close()
    except OSError:
      return True
    return False

  def _lighthouse_restarted(self) -> bool:
    """Whether the Lighthouse may have lost this replica's request: it does not answer (it is
    down, or being restarted), or its current quorum id is below the last one this replica
    joined (it was restarted)."""
    try:
      with urllib.request.urlopen(f"{self._manager_args[0]}/status", timeout=1.0) as response:
        status = response.read().decode(errors="replace")
    except OSError:
      return True
    # torchft 0.2.0's status page; another's, not understood, is taken for the same Lighthouse
    found = re.search(r"Current quorum_id: (\d+)", status)
    return found is not None and int(found.group(1)) < self._torchft_quorum_id

  def _renew_manager(self, deadline: float) -> None:
    """Replaces the manager (and its store, process group and heal server) by a new one with
    torchft's step kept (step 1 of the module's docstring), trying again until ``deadline``
    (``time.monotonic()``) while the Lighthouse cannot be reached (it is being restarted).

    Raises:
      RuntimeError: torchft's, the Lighthouse still unreachable at ``deadline``; a replica
        group's (``group_size`` > 1), whose ranks cannot renew theirs together: the process
        exits and the launcher restarts the group, which heals.
    """
    if self.group_size > 1:
      raise RuntimeError(f"replica {self.slot} (a group of {self.group_size} processes): the"
                         " Lighthouse lost its quorum request; a group renews no manager")
    self._renew, self._torchft_quorum_id = False, -1
    steps = self._manager.state_dict()
    self._manager.shutdown(wait=False)
    while True:
      try:
        self._manager = self._make_manager(*self._manager_args)
        break
      except RuntimeError:  # torchft's: no connection to the Lighthouse within the timeout
        if time.monotonic() >= deadline:
          raise
    self._manager.load_state_dict(steps)

  def _vote(self) -> bool:
    """``should_commit()``; a vote that cannot be cast in time (the process was stopped while
    the request was in flight) is a no."""
    try:
      return self._manager.should_commit()
    except TimeoutError as e:
      self._manager.report_error(e)
      return False

  def _failed(self, error: Exception) -> None:
    """A collective of this member failed with ``error``: reported to torchft (its next vote is
    a no)."""
    self._manager.report_error(error)

  def _broadcasts(self, mine: torch.Tensor, roots: list[int], rank: int
                  ) -> list[torch.Tensor] | None:
    """The buffers of the members at process-group ranks ``roots``, in that order, each
    broadcast by its member (this member, at ``rank``, sends ``mine``; each is ``mine``'s
    size), or ``None`` (the error reported: a no vote). A member outside ``roots`` sends
    nothing, where an all-gather sends every member's buffer."""
    outs = [mine if root == rank else torch.empty_like(mine) for root in roots]
    try:
      for root, buffer in zip(roots, outs, strict=True):
        opts = BroadcastOptions()
        opts.rootRank = root
        self._pg.broadcast([buffer], opts).wait()
    except Exception as e:  # noqa: BLE001 (any failure of the collective is a no vote)
      self._failed(e)
      return None
    return outs

  def _allgather(self, mine: torch.Tensor, everyone: bool = False) -> list[torch.Tensor] | None:
    """Every member's ``mine`` in rank order, or ``None`` (the error reported: a no vote).
    ``everyone``: over the process group's size, every member of the quorum
    (``num_participants()`` counts only the members at its ``max_step``, not one it heals).
    A process group whose configuration failed in the quorum (a member lost while it connected:
    torchft then has none, and its ``size()`` raises) is a failed collective too."""
    try:
      count = self._pg.size() if everyone else self._manager.num_participants()
      outs = [torch.empty_like(mine) for _ in range(count)]
      self._pg.allgather([outs], [mine], AllgatherOptions()).wait()
    except Exception as e:  # noqa: BLE001 (any failure of the collective is a no vote)
      self._failed(e)
      return None
    return outs

