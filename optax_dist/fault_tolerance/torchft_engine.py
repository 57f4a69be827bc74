r"""The torchft engine: one process, one replica of a user's loop, over torchft's Lighthouse.

The training function the in-process engine runs R times in threads runs here once per
process: start one process per replica id with the Lighthouse's address (torchft's
``TORCHFT_LIGHTHOUSE``), its id (``REPLICA_GROUP_ID``, torchft's examples' name) and the run's
directory (``OPTAX_DIST_OUT``), or pass them to :class:`Torchft`. The command's replicas
(``optax-dist train --fault-tolerant``, :func:`optax_dist.fault_tolerance.replica.serve`) are
such a loop. A process of a ``jax.distributed`` program of P processes is rank
``jax.process_index()`` of a replica group (torchft's HSDP layout; the session's docstring):
the program's P processes are one replica, whose params every rank holds (replicated over the
program's global mesh), and every rank exchanges the whole payload with its own rank of the
other replicas (P times the bytes of a one-process replica; each rank sending a 1/P slice is not
built). Per round, at the loop's boundary
(:meth:`~optax_dist.fault_tolerance.Replica.after_step`):

1. **Quorum**: ``Manager.start_quorum`` (:class:`~optax_dist.fault_tolerance.torchft_session.
   Session`: requests of at most ``QUORUM_ATTEMPT_S`` seconds until ``quorum_timeout``, a new
   ``Manager`` when the Lighthouse lost the request or was restarted, or is down when a request
   is due). A replica behind the
   quorum's most advanced (torchft's step: committed rounds) heals inside the call from a live
   peer: the peer's donation (:meth:`~optax_dist.fault_tolerance.Replica.donation`) as
   :func:`encode_heal` bytes over HTTP (at most its own donation's size), checked by
   :func:`decode_heal` against its own tree and settings fingerprint, never a pickle. A refused
   heal (a donor of another run, or a payload that fails a check) is a no vote: the replica
   keeps its state and torchft's step, and heals at a later quorum.
2. **Exchange**: three all-gathers over torchft's ``ProcessGroupGloo``: every member's
   :class:`~optax_dist.fault_tolerance.decision.Header` (slot, weight, whether its quorum and
   heal went without error, its settings fingerprint, its step); then, if
   :func:`~optax_dist.fault_tolerance.decision.check_headers` finds nothing, every member's
   ``(payload, collections)`` bytes (a block-quantized payload as the member encoded it, its
   codes and scales: :func:`~optax_dist._quantize.wire_bytes` of its values, decoded at the
   merge; a member healed at this quorum has weight 0 and sends zeros of the round's payload:
   its own is of its step before the heal, perhaps of another fragment, and gloo aborts the
   process on buffers of different sizes); then an
   acknowledgement (one int64 each: its payloads' all-gather completed). A round with members
   of different fingerprints aborts on every member; a member that met one of another
   fingerprint and holds none of the Lighthouse's committed rounds (torchft's step 0:
   :func:`~optax_dist.fault_tolerance.decision.leaves`) leaves the run with
   :class:`SettingsMismatch`.
3. **Decision and vote**: :func:`~optax_dist.fault_tolerance.decision.decide` on what was
   gathered (the same bytes on every member, so the same outcome), then torchft's
   ``should_commit`` (a member reports an error, and so votes no, when its all-gather failed or
   the decision aborts). torchft's vote is within one replica group only, so a member whose
   all-gather failed while the others' completed aborts alone, is one committed round behind at
   the next quorum, and heals there. A member whose step is behind the round's was left out of
   an aborted quorum: its round is void (weight 0; it aborts and takes the round's step).
4. **Retry** (``exchange_retries`` > 0): a member whose headers' or payloads' all-gather failed
   (a member stopped, killed or cut off in the exchange) asks for a new quorum, in which the
   Lighthouse leaves out a member it no longer hears, and exchanges the same payload again. No
   member can have committed the round meanwhile: a commit needs every member's
   acknowledgement. A member whose acknowledgement failed aborts (it heals at its next quorum).
5. **Commit or abort** by the loop's driver, then one JSON line in
   ``OUT/replicas/replica_<i>.jsonl`` (rank ``r`` > 0 of a group: ``replica_<i>.rank_<r>.jsonl``;
   with ``attempts``: the round's quorums, ``quorum_seconds``, and ``exchange_seconds``: the
   seconds of the whole exchange, quorums to vote), and a checkpoint on the
   quorum's rank 0 (its group's rank 0) when one is due.

Needs the ``ft`` extra (``torch`` and ``torchft``); the rest of optax_dist does not import
torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from optax_dist import _checks, _exchange
from optax_dist.fault_tolerance import checkpoints, heal, torchft_decoupled
from optax_dist.fault_tolerance import decoupled as decoupled_rules
from optax_dist.fault_tolerance.checkpoints import CheckpointWriter
from optax_dist.fault_tolerance.decision import Header, check_headers, decide, foreign, leaves
from optax_dist.fault_tolerance.engine import RoundLog
from optax_dist.fault_tolerance.launcher import bind_address
from optax_dist.fault_tolerance.loop import Received, Replica, Restored, Sent, split_donation
from optax_dist.fault_tolerance.protocol import RoundProtocol
from optax_dist.fault_tolerance.rundir import RunDir
from optax_dist.fault_tolerance.torchft_session import (
  Session,
  SettingsMismatch,
  pack,
  torch,
  unpack,
)

_ADDRESS_BYTES = 128
"""The buffer that carries a store's ``host port`` from a group's rank 0 to its other ranks."""


class Torchft:
  r"""The torchft engine: runs the user's training function as this process's replica.

  Args:
    protocol: the run's :class:`RoundProtocol` (every replica's alike).
    lighthouse: the Lighthouse's URL, ``http://host:port``; default ``$TORCHFT_LIGHTHOUSE``.
    replica_id: this process's replica id and data slot; default ``$REPLICA_GROUP_ID``.
    out: the run's directory (the log goes to ``out/replicas/replica_<i>.jsonl``); default
      ``$OPTAX_DIST_OUT``, else ``runs/fault_tolerant``.
    host: the address this replica's servers bind and advertise, or a name resolved to it once
      here (its host name in a network namespace of its own: that namespace's address); never
      an unspecified address (:func:`~optax_dist.fault_tolerance.launcher.bind_address`).
    seed: the data seed.
    tokens_per_step: the tokens of one batch (a round's weight is its inner steps times it).
    min_replicas: the smallest quorum that commits (torchft's ``min_replica_size``).
    quorum_timeout: seconds to wait for a quorum before ``TimeoutError``, over requests of at
      most ``QUORUM_ATTEMPT_S`` seconds each (a restarted Lighthouse answers the next one).
    timeout: seconds for a collective, a heal and the vote.
    exchange_retries: how many times a round whose exchange failed before the
      acknowledgement (a member stopped, killed or cut off in it) is tried again in a new
      quorum, without that member, before it aborts; an int >= 0. No member can have
      committed the round meanwhile: a commit needs every member's acknowledgement.
    checkpoint_every: inner steps between checkpoints in ``out/replicas/checkpoints``
      (:mod:`~optax_dist.fault_tolerance.checkpoints`: the replica's donation, written by the
      quorum's rank 0, and every member's local state) after a committed round that crosses a
      multiple of it; a replica starts from the newest one every member of its round wrote
      its local state for (:func:`~optax_dist.fault_tolerance.checkpoints.resume`): rebuilt
      whole with its own, else as a joiner heals. ``None``: none written, none read.
    last_round: the run's last round (committed rounds), after which a checkpoint is written
      too; ``None``: none.
    on_ready: called once the replica's session heartbeats to the Lighthouse, before its first
      quorum (e.g. a barrier that lets replicas starting together meet in their first quorum).
    standby: a warm standby's wait for its takeover, called once the replica has compiled its
      round and before it reads the newest checkpoint and starts its session. ``None``: none.
    decoupled: decoupled rounds (:mod:`~optax_dist.fault_tolerance.torchft_decoupled`: the
      loop is a :class:`~optax_dist.fault_tolerance.decoupled.DecoupledReplica`, the lines
      :class:`~optax_dist.fault_tolerance.decoupled.MergeLine`\ s and, in
      ``out/replicas/boundaries_<i>.jsonl``, :class:`~optax_dist.fault_tolerance.decoupled.
      Boundary` lines); ``min_replicas`` is then the fewest payloads of weight > 0 that commit.
      Not with ``checkpoint_every``, ``standby``, ``exchange_retries`` or a replica group.
    min_quorum: K, the payloads that may close a decoupled round before every live replica's
      is in; a positive int, at least ``min_replicas`` (default: ``min_replicas``).
    grace_window: W, seconds of wall clock a decoupled round stays open after its K-th arrival
      (``math.inf``, the default: until every live replica's payload is in); >= 0, or
      ``"auto"``: ``grace_gamma`` times the least slack the members measured
      (:mod:`~optax_dist.fault_tolerance.torchft_decoupled`), decided at each poll.
    grace_gamma: :math:`\gamma` of ``grace_window="auto"``, a finite number >= 0 (default
      :data:`~optax_dist.fault_tolerance.decoupled.DEFAULT_GRACE_GAMMA`, 0.5).
    staleness_rule: one of :data:`~optax_dist.fault_tolerance.decoupled.STALENESS_RULES`
      (default: :data:`~optax_dist.fault_tolerance.decoupled.DEFAULT_STALENESS_RULE`, the
      in-process engine's).
    max_staleness: ``"age_gate"``'s bound, an int >= 0.
    num_replicas: the replicas the run is started with (the command's ``--replicas``), so the
      most payloads a merge holds: before the replica's first round its warm-up compiles the
      merges of 1 to this many payloads (each count is a program of its own); a positive int,
      or ``None``: of 1 and 2 (a larger merge compiles in the round that first holds one).

  Raises:
    ValueError: no Lighthouse or replica id given nor in the environment; a lighthouse not an
      ``http://`` URL; a replica id or ``exchange_retries`` not an int >= 0;
      ``tokens_per_step``, ``min_replicas``, ``checkpoint_every`` or ``num_replicas`` not a
      positive int; a timeout not a positive number; a host that does not resolve or is unspecified;
      the decoupled settings as :func:`~optax_dist.fault_tolerance.decoupled.check_settings` raises,
      ``min_replicas > min_quorum``, or ``decoupled`` with a setting it does not take.
  """

  def __init__(self, protocol: RoundProtocol, *, lighthouse: str | None = None,
               replica_id: int | None = None, out: str | os.PathLike | None = None,
               host: str = "127.0.0.1", seed: int = 0, tokens_per_step: int = 1,
               min_replicas: int = 1, quorum_timeout: float = 60.0, timeout: float = 30.0,
               exchange_retries: int = 0, checkpoint_every: int | None = None,
               last_round: int | None = None, on_ready: Callable[[], None] | None = None,
               standby: Callable[[], None] | None = None, decoupled: bool = False,
               min_quorum: int | None = None, grace_window: float | str = math.inf,
               staleness_rule: str | None = None, max_staleness: int = 1,
               grace_gamma: float = decoupled_rules.DEFAULT_GRACE_GAMMA,
               num_replicas: int | None = None):
    fn = "Torchft"
    lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not lighthouse.startswith("http://"):
      raise ValueError(f"`{fn}(lighthouse=...)` (or $TORCHFT_LIGHTHOUSE) must be an http:// URL,"
                       f" got {lighthouse!r}.")
    if replica_id is None:
      replica_id = int(os.environ.get("REPLICA_GROUP_ID", "-1"))
    _checks.check_non_negative_int(fn, "replica_id", replica_id)
    _checks.check_positive_int(fn, "tokens_per_step", tokens_per_step)
    _checks.check_positive_int(fn, "min_replicas", min_replicas)
    _checks.check_non_negative_int(fn, "exchange_retries", exchange_retries)
    for name, value in (("checkpoint_every", checkpoint_every), ("num_replicas", num_replicas)):
      if value is not None:
        _checks.check_positive_int(fn, name, value)
    for name, value in (("quorum_timeout", quorum_timeout), ("timeout", timeout)):
      if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"`{fn}({name}=...)` must be a positive number of seconds, got {value!r}.")
    # resolved once, here (in a network namespace, by its /etc/hosts): peers get the address
    host = bind_address(fn, host)
    self.protocol, self.lighthouse, self.replica_id, self.host = (
      protocol, lighthouse, replica_id, host)
    self.out = pathlib.Path(out or os.environ.get("OPTAX_DIST_OUT", "runs/fault_tolerant"))
    self.seed, self.tokens_per_step, self.min_replicas = seed, tokens_per_step, min_replicas
    self.quorum_timeout, self.timeout, self.exchange_retries = (
      quorum_timeout, timeout, exchange_retries)
    self.checkpoint_every, self.last_round = checkpoint_every, last_round
    self.on_ready, self.standby = on_ready, standby
    self.decoupled, self.min_quorum = decoupled, min_replicas if min_quorum is None else min_quorum
    self.grace_window, self.grace_gamma = grace_window, grace_gamma
    self.staleness_rule = staleness_rule or decoupled_rules.DEFAULT_STALENESS_RULE
    self.max_staleness, self.num_replicas = max_staleness, num_replicas
    if decoupled:
      self._check_decoupled()

  def _check_decoupled(self) -> None:
    torchft_decoupled.check(self, self.protocol)
    other = {"checkpoint_every": self.checkpoint_every, "standby": self.standby,
             "exchange_retries": self.exchange_retries or None,
             "processes": jax.process_count() if jax.process_count() > 1 else None}
    given = [k for k, v in other.items() if v is not None]
    if given:
      raise ValueError(f"`Torchft(decoupled=True)`: not with {given[0]}={other[given[0]]!r}"
                       " (decoupled rounds over torchft do not take it yet).")

  def run(self, train: Callable[[Replica], Any]) -> dict[int, Any]:
    """Runs ``train(replica)`` as this process's replica; returns ``{replica_id: what it
    returns}``.

    Raises:
      SettingsMismatch: this replica's settings are not the run's (after the round's line).
      TimeoutError: no quorum formed within ``quorum_timeout`` seconds.
      ValueError: the newest checkpoint written by other settings, or damaged.
    """
    port = torchft_decoupled.DecoupledPort(self) if self.decoupled else _Port(self)
    try:
      result = train(port.replica)
      if self.decoupled:  # its exchange polls on until every replica's loop has returned
        port.finish()
      else:  # a round whose exchange is still in flight (overlap): its outcome and line
        port.replica.finish()
      return {self.replica_id: result}
    finally:
      port.shutdown()


@dataclasses.dataclass
class _Attempts:
  """A round's attempts so far, for its log line (``donor``: the slot this replica healed
  from, or ``None``)."""

  count: int = 0
  quorum_seconds: float = 0.0
  donor: int | None = None
  start: float = 0.0  # time.monotonic() at the exchange's start
  seconds: float = 0.0  # the exchange's, once it returned


class _Port(Session):
  """A replica's end of the torchft engine: its session, the round's exchange, its
  checkpoints and its log. With overlap the exchange (quorum, heal, all-gathers, decision,
  vote) runs on a thread beside the replica's next steps (``exchanges_beside_steps``;
  :meth:`~optax_dist.fault_tolerance.Replica.after_step`); it reads only what the round's
  :class:`Sent` holds, copies the loop's steps do not donate."""

  exchanges_beside_steps = True

  def __init__(self, engine: Torchft):
    self.engine, self.protocol, self.slot = engine, engine.protocol, engine.replica_id
    self.group_rank, self.group_size = jax.process_index(), jax.process_count()
    self.replica = Replica(engine.protocol, self, slot=self.slot, seed=engine.seed,
                           tokens_per_step=engine.tokens_per_step)
    self.run_dir = engine.out / "replicas"
    self.run_dir.mkdir(parents=True, exist_ok=True)
    self.log_path = RunDir(engine.out).lines_file(self.slot, self.group_rank)
    self.checkpointer = None
    self.quorum_id, self._last_members, self._sent, self._healed = 0, None, None, None
    self._attempts, self._manager = _Attempts(), None

  def start(self, replica: Replica) -> Any:
    """After the replica compiled its round: the standby's wait, the newest checkpoint (a
    decoded donation, returned), then the session (and ``on_ready``)."""
    engine = self.engine
    if engine.standby is not None:
      engine.standby()
    restored = None
    if engine.checkpoint_every is not None:
      self.checkpointer = CheckpointWriter(self.run_dir / "checkpoints", engine.checkpoint_every,
                                           replica.fingerprint)
      restored = self._restored(replica)
    self._open(engine.lighthouse, engine.host, engine.min_replicas, engine.quorum_timeout,
               engine.timeout)
    if isinstance(restored, Restored):
      self._hold_rounds(int(restored.local.rounds))
    if engine.on_ready is not None:
      engine.on_ready()
    return restored

  def _restored(self, replica: Replica) -> Any:
    """The checkpoint this replica starts from (:func:`checkpoints.resume`): a
    :class:`Restored` with its own local state, else its donation alone; ``None``: none."""
    found = checkpoints.resume(self.checkpointer.directory, replica.replica_state,
                               replica.donation(), self.slot, replica.fingerprint)
    if found is None:
      return None
    donation, own = found
    return donation if own is None else Restored(donation, own)

  def _hold_rounds(self, rounds: int) -> None:
    """torchft's step (its committed rounds) set to a whole restore's ``rounds``: a replica
    that restored as a joiner (step 0) is behind it and heals from it, as from a live peer."""
    self._manager.load_state_dict({**self._manager.state_dict(), "step": rounds})

  # The state torchft moves on a heal: healed in this round, it gives what it received.

  def _donation(self) -> Any:
    if self._healed is not None:
      return self._healed
    return self.replica.donation() if self._sent is None else self._sent.donation

  def _heal_bytes(self) -> bytes:
    return heal.encode_heal(self._donation(), fingerprint=self.replica.fingerprint)

  def _load(self, payload: bytes) -> None:
    """A donor's heal, checked against this replica's own tree and fingerprint.

    torchft calls it inside ``start_quorum`` once it has set its step counters to the
    donor's, and would let an error escape ``start_quorum`` (and keep the heal pending). So a
    payload refused is reported to torchft instead (a no vote, ``ok == 0`` in the header: the
    round aborts) and torchft's counters go back to this replica's: it keeps its own state.
    """
    try:
      self._healed = heal.decode_heal(payload, self._donation(), replica="donor",
                                      fingerprint=self.replica.fingerprint)
    except (TypeError, ValueError) as e:
      self._manager.load_state_dict(self._steps)
      self._manager.report_error(e)

  # The round.

  def exchange(self, sent: Sent) -> Received:
    """Quorum (and heal), exchange and decision, again in a new quorum up to
    ``exchange_retries`` times while the exchange fails before its acknowledgement; then the
    vote."""
    self._sent, self._healed, self._attempts = sent, None, _Attempts(start=time.monotonic())
    bound = heal.heal_bound(sent.donation)  # what a heal may read: its own donation's size
    got, retryable = None, True
    while got is None or (got.merged is None and retryable
                          and self._attempts.count <= self.engine.exchange_retries):
      # torchft's counters before the quorum: where a refused heal puts them back (_load)
      self.transport.max_bytes, self._steps = bound, self._manager.state_dict()
      got, retryable = self._attempt(sent)
    if got.merged is not None and not self._vote():
      got = dataclasses.replace(got, merged=None, reason="a member voted no")
    elif got.merged is None:
      self._manager.report_error(RuntimeError(got.reason))
      self._vote()
    self._sent, self._attempts.seconds = None, time.monotonic() - self._attempts.start
    return got

  def _attempt(self, sent: Sent) -> tuple[Received, bool]:
    """One quorum (and heal) and exchange; returns the outcome and whether a failure may be
    retried (an all-gather failed before the acknowledgement)."""
    start = time.monotonic()
    self.transport.source = None
    self._quorum()
    self._attempts.quorum_seconds += time.monotonic() - start
    self._attempts.count += 1
    head = sent.header._replace(ok=int(self._manager.errored() is None))
    if self._healed is not None:
      step = int(split_donation(self._healed)[0].global_state.opt_state.local_step)
      head = head._replace(weight=0, step=step)
    return self._gather(sent, head)

  def _gather(self, sent: Sent, head: Header) -> tuple[Received, bool]:
    """The headers' all-gather, the payloads', the acknowledgement and the decision."""
    def failed(reason, retryable=False, members=(), step=head.step):
      return Received(members, self.quorum_id, self._healed, None, step, reason), retryable

    outs = self._allgather(torch.from_numpy(np.asarray(head, np.int64)))
    if outs is None:
      return failed("the headers' all-gather failed", True)
    heads = [Header(*out.tolist()) for out in outs]
    members, step = tuple(h.slot for h in heads), max(h.step for h in heads)
    self._note_donor(members)
    if members != self._last_members:
      self.quorum_id, self._last_members = self.quorum_id + 1, members
    if leaves(heads, head.fingerprint, holds_rounds=self._manager.current_step() > 0):
      raise SettingsMismatch(
        f"replica {self.slot} holds no round of its Lighthouse and met replicas"
        f" {foreign(heads, head.fingerprint)} of another fingerprint: its settings (fingerprint"
        f" {head.fingerprint}) differ from the run's: algorithm, sync period, wire format,"
        " params' shapes, seed and tokens per step must be every replica's")
    reason = check_headers(self.protocol, heads, min_replicas=self.engine.min_replicas)
    if reason:
      return failed(reason, members=members, step=step)
    mine = sent.payload if self._healed is None else self._zeros(step)
    outs = self._allgather(pack(mine))
    if outs is None:
      return failed("the payloads' all-gather failed", True, members, step)
    # The acknowledgement: a member's chunk of it says that its payloads' all-gather completed.
    # A member commits only once it holds every member's, so no member commits a round whose
    # exchange failed on another before the acknowledgement: that one may retry the round.
    if self._allgather(torch.ones(1, dtype=torch.int64)) is None:
      return failed("the acknowledgement's all-gather failed", False, members, step)
    payloads = [unpack(out, mine) for out in outs]
    d = decide(self.protocol, heads, [p[0] for p in payloads],
               min_replicas=self.engine.min_replicas)
    if d.merged is None:
      return failed(d.reason, members=members, step=step)
    collections = [payloads[members.index(i)][1] for i in d.voters]
    merged = (d.merged, None if collections[0] is None
              else _exchange.merge_payloads(collections))
    return Received(members, self.quorum_id, self._healed, merged, step), False

  def _note_donor(self, members: tuple) -> None:
    """Notes the slot of the member this replica healed from at this attempt's quorum (the
    heal's source rank in it) for the round's line."""
    rank = self.transport.source
    if rank is not None and rank < len(members):
      self._attempts.donor = members[rank]

  def _zeros(self, step: int) -> Any:
    """A healed member's payload: :meth:`RoundProtocol.healed_payload` (of the round's size;
    its own may be of another fragment's), and its healed collections."""
    state, collections = split_donation(self._healed)
    zeros = self.protocol.healed_payload(self.replica._params_like,
                                         state.global_state.opt_state, step)
    return zeros, collections

  def record(self, line: RoundLog) -> None:
    """Appends the round's line (with ``time``, ``pid``, ``quorum_seconds``, ``attempts``,
    ``donor`` and ``exchange_seconds``, :meth:`exchange`'s) and, on the quorum's rank 0 after a
    committed round that crosses a multiple of ``checkpoint_every``, queues a checkpoint; on
    every member, its local state of the round
    (:meth:`_write_local`)."""
    row = dict(dataclasses.asdict(line), time=time.time(), pid=os.getpid(),
               quorum_seconds=self._attempts.quorum_seconds, attempts=self._attempts.count,
               donor=self._attempts.donor, exchange_seconds=self._attempts.seconds)
    with open(self.log_path, "a") as f:
      f.write(json.dumps(row) + "\n")
    self._write_local(line)
    if (line.committed and self.checkpointer is not None and line.members[:1] == (self.slot,)
        and self.group_rank == 0
        and self.checkpointer.due(line.step, self._round_steps(line.step),
                                  last=self.replica.rounds == self.engine.last_round)):
      self.checkpointer.write(self.replica.donation(), step=line.step, rounds=self.replica.rounds,
                              time=row["time"], members=line.members)

  def _write_local(self, line: RoundLog) -> None:
    """After a committed round whose checkpoint is due, queues this replica's local state of
    it (a replica group's rank 0 only: its ranks hold the same state)."""
    w = self.checkpointer
    if (line.committed and w is not None and jax.process_index() == 0
        and w.due(line.step, self._round_steps(line.step),
                  last=self.replica.rounds == self.engine.last_round)):
      w.write_local(self.replica.replica_state, step=line.step, slot=self.slot)

  def _round_steps(self, step: int) -> int:
    """The inner steps of the round ending on ``update`` call ``step``, from the schedule's
    boundary before it (or 0): alike on every member, a healed one's (whose line carries no
    tokens) included, so each member writes its local file of the checkpoint rank 0 writes."""
    start = max(0, step - self.protocol.sync_period)
    while start + self.protocol.round_steps(start) < step:
      start += self.protocol.round_steps(start)
    return step - start

  @staticmethod
  def share(address: tuple[str, int] | None) -> tuple[str, int]:
    """Rank 0's ``(host, port)`` on every process of the replica group (the others pass
    ``None``): a broadcast over the program's ``jax.distributed`` processes."""
    from jax.experimental import multihost_utils

    text = b"" if address is None else f"{address[0]} {address[1]}".encode()
    buffer = np.frombuffer(text.ljust(_ADDRESS_BYTES, b"\0"), np.uint8)
    host, port = bytes(multihost_utils.broadcast_one_to_all(buffer)).rstrip(b"\0").split()
    return host.decode(), int(port)

  def shutdown(self) -> None:
    """Stops the session (its manager and servers); waits for the checkpoints queued."""
    if self._manager is not None:
      self._manager.shutdown(wait=False)
    if self.checkpointer is not None:
      self.checkpointer.close()
