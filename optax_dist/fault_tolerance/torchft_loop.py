r"""The torchft engine of a user's loop: one process, one replica, over torchft's Lighthouse.

The same training function the in-process engine runs R times in threads runs here once per
process: start one process per replica id with the Lighthouse's address (torchft's
``TORCHFT_LIGHTHOUSE``), its id (``REPLICA_GROUP_ID``, torchft's examples' name) and the run's
directory (``OPTAX_DIST_OUT``), or pass them to :class:`Torchft`. Per round (at the loop's
boundary, :meth:`~optax_dist.fault_tolerance.Replica.after_step`):

1. **quorum**: ``Manager.start_quorum`` (:class:`~optax_dist.fault_tolerance.torchft_session.
   Session`: retried after a timeout, a new ``Manager`` when the Lighthouse lost the request);
   a replica behind the quorum's most advanced (torchft's step: committed rounds) heals inside
   the call from a live peer (its donation as :func:`encode_heal` bytes over HTTP);
2. **exchange**: an all-gather of the members' :class:`~optax_dist.fault_tolerance.decision.
   Header`\ s; if :func:`~optax_dist.fault_tolerance.decision.check_headers` finds nothing, an
   all-gather of the members' ``(payload, collections)`` bytes (a healed member sends zeros of
   the round's size), then an acknowledgement;
3. **decision**: :func:`~optax_dist.fault_tolerance.decision.decide` on what was gathered (the
   same on every member), then torchft's vote (``should_commit``); the loop's driver commits
   or aborts, and writes one JSON line in ``OUT/replicas/replica_<i>.jsonl``.

A round whose exchange fails aborts (no retry in a new quorum yet: the command's replicas
retry, :class:`~optax_dist.fault_tolerance.torchft_engine.TorchftReplica`). Needs the ``ft``
extra.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from optax_dist import _checks, _exchange
from optax_dist.fault_tolerance import heal
from optax_dist.fault_tolerance.decision import Header, check_headers, decide, run_fingerprint
from optax_dist.fault_tolerance.engine import RoundLog
from optax_dist.fault_tolerance.loop import Received, Replica, Sent
from optax_dist.fault_tolerance.protocol import RoundProtocol
from optax_dist.fault_tolerance.torchft_engine import SettingsMismatch
from optax_dist.fault_tolerance.torchft_session import Session, _pack, _unpack, torch


class Torchft:
  r"""The torchft engine: runs the user's training function as this process's replica.

  Args:
    protocol: the run's :class:`RoundProtocol` (every replica's alike).
    lighthouse: the Lighthouse's URL, ``http://host:port``; default ``$TORCHFT_LIGHTHOUSE``.
    replica_id: this process's replica id and data slot; default ``$REPLICA_GROUP_ID``.
    out: the run's directory (the log goes to ``out/replicas/replica_<i>.jsonl``); default
      ``$OPTAX_DIST_OUT``, else ``runs/fault_tolerant``.
    host: the address this replica's servers bind and advertise.
    seed: the data seed.
    tokens_per_step: the tokens of one batch.
    min_replicas: the smallest quorum that commits (torchft's ``min_replica_size``).
    quorum_timeout: seconds to wait for a quorum before ``TimeoutError``.
    timeout: seconds for a collective, a heal and the vote.

  Raises:
    ValueError: no Lighthouse or replica id given nor in the environment; a lighthouse not an
      ``http://`` URL; a replica id not an int >= 0.
  """

  def __init__(self, protocol: RoundProtocol, *, lighthouse: str | None = None,
               replica_id: int | None = None, out: str | os.PathLike | None = None,
               host: str = "127.0.0.1", seed: int = 0, tokens_per_step: int = 1,
               min_replicas: int = 1, quorum_timeout: float = 60.0, timeout: float = 30.0):
    fn = "Torchft"
    lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not lighthouse.startswith("http://"):
      raise ValueError(f"`{fn}(lighthouse=...)` (or $TORCHFT_LIGHTHOUSE) must be an http:// URL,"
                       f" got {lighthouse!r}.")
    if replica_id is None:
      replica_id = int(os.environ.get("REPLICA_GROUP_ID", "-1"))
    _checks.check_non_negative_int(fn, "replica_id", replica_id)
    self.protocol, self.lighthouse, self.replica_id, self.host = (
      protocol, lighthouse, replica_id, host)
    self.out = pathlib.Path(out or os.environ.get("OPTAX_DIST_OUT", "runs/fault_tolerant"))
    self.seed, self.tokens_per_step, self.min_replicas = seed, tokens_per_step, min_replicas
    self.quorum_timeout, self.timeout = quorum_timeout, timeout

  def run(self, train: Callable[[Replica], Any]) -> dict[int, Any]:
    """Runs ``train(replica)`` as this process's replica; returns ``{replica_id: what it
    returns}``.

    Raises:
      SettingsMismatch: this replica's settings are not the run's.
      TimeoutError: no quorum formed within ``quorum_timeout`` seconds.
    """
    port = _Port(self)
    try:
      return {self.replica_id: train(port.replica)}
    finally:
      port.shutdown()


class _Port(Session):
  """A replica's end of the torchft engine: its session, the round's exchange, its log."""

  def __init__(self, engine: Torchft):
    self.engine, self.protocol, self.slot = engine, engine.protocol, engine.replica_id
    self.replica = Replica(engine.protocol, self, slot=self.slot, seed=engine.seed,
                           tokens_per_step=engine.tokens_per_step)
    path = engine.out / "replicas"
    path.mkdir(parents=True, exist_ok=True)
    self.log_path = path / f"replica_{self.slot}.jsonl"
    self.quorum_id, self._last_members, self._sent, self._healed = 0, None, None, None
    self._open(engine.lighthouse, engine.host, engine.min_replicas, engine.quorum_timeout,
               engine.timeout)

  # The state torchft moves on a heal.

  def _donation(self) -> Any:
    return self.replica.donation() if self._sent is None else self._sent.donation

  def _heal_bytes(self) -> bytes:
    return heal.encode_heal(self._donation())

  def _load(self, payload: bytes) -> None:
    self._healed = heal.decode_heal(payload, self._donation(), replica="donor")

  # The round.

  def exchange(self, sent: Sent) -> Received:
    self._sent, self._healed = sent, None
    self._quorum()
    head = sent.header._replace(ok=int(self._manager.errored() is None))
    if self._healed is not None:
      step = int(self._healed[0].global_state.opt_state.local_step)
      head = head._replace(weight=0, step=step)
    got = self._gather(sent, head)
    if got.merged is not None and not self._vote():
      got = dataclasses.replace(got, merged=None, reason="a member voted no")
    elif got.merged is None:
      self._manager.report_error(RuntimeError(got.reason))
      self._vote()
    self._sent = None
    if got.reason.startswith("foreign"):
      raise SettingsMismatch(f"replica {self.slot}: its settings differ from the run's")
    return got

  def _gather(self, sent: Sent, head: Header) -> Received:
    """The headers' all-gather, the payloads', the acknowledgement and the decision."""
    def failed(reason, members=(), step=head.step):
      return Received(members, self.quorum_id, self._healed, None, step, reason)

    outs = self._allgather(torch.from_numpy(np.asarray(head, np.int64)))
    if outs is None:
      return failed("the headers' all-gather failed")
    heads = [Header(*out.tolist()) for out in outs]
    members, step = tuple(h.slot for h in heads), max(h.step for h in heads)
    if members != self._last_members:
      self.quorum_id, self._last_members = self.quorum_id + 1, members
    if head.fingerprint != run_fingerprint([h.fingerprint for h in heads]):
      return failed("foreign settings", members, step)
    reason = check_headers(self.protocol, heads, min_replicas=self.engine.min_replicas)
    if reason:
      return failed(reason, members, step)
    mine = sent.payload if self._healed is None else self._zeros(sent, step)
    outs = self._allgather(_pack(mine))
    if outs is None or self._allgather(torch.ones(1, dtype=torch.int64)) is None:
      return failed("the payloads' all-gather failed", members, step)
    payloads = [_unpack(out, mine) for out in outs]
    d = decide(self.protocol, heads, [p[0] for p in payloads],
               min_replicas=self.engine.min_replicas)
    if d.merged is None:
      return failed(d.reason, members, step)
    collections = [payloads[members.index(i)][1] for i in d.voters]
    merged = (d.merged, None if collections[0] is None
              else _exchange.merge_payloads(collections))
    return Received(members, self.quorum_id, self._healed, merged, step)

  def _zeros(self, sent: Sent, step: int) -> Any:
    """A healed member's payload: :meth:`RoundProtocol.healed_payload` (of the round's size;
    its own may be of another fragment's), and its healed collections."""
    zeros = self.protocol.healed_payload(self.replica._params_like,
                                         sent.donation[0].global_state.opt_state, step)
    return zeros, self._healed[1]

  def record(self, line: RoundLog) -> None:
    row = dict(dataclasses.asdict(line), time=time.time(), pid=os.getpid())
    with open(self.log_path, "a") as f:
      f.write(json.dumps(row) + "\n")

  def shutdown(self) -> None:
    self._manager.shutdown(wait=False)
