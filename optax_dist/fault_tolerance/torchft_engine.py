r"""A fault-tolerant replica over torchft: one process, one replica, a round at a time.

Each replica is its own process and its own JAX program. Per round it runs the
:class:`~optax_dist.fault_tolerance.RoundProtocol`'s inner steps (jitted), then meets the other
replicas through torchft:

1. **Quorum**: ``Manager.start_quorum()`` with ``use_async_quorum=False``; the Lighthouse forms
   the quorum, and a replica behind the most advanced (torchft's step: committed rounds) heals
   inside the call from a live peer over :class:`HealTransport` (:func:`encode_heal` bytes over
   HTTP, checked by :func:`decode_heal`; never a pickle). A request that gets no answer within
   ``QUORUM_ATTEMPT_S`` seconds (a Lighthouse that died loses the requests it held) is sent
   again, until ``quorum_timeout`` seconds have passed: a Lighthouse restarted on the same
   address answers the next one. When the Lighthouse's status page (``/status``) does not
   answer, or shows a quorum id below the last one this replica joined, the request is sent
   again through a new ``Manager`` (its store fresh, torchft's step kept); otherwise through
   the same one, since a new one would close the store a quorum forming from the held request
   may name. A restarted Lighthouse counts its quorum ids from 0 again, and torchft keys a
   process group's rendezvous in the quorum's store by quorum id: in a store of before the
   restart, the new quorums would read the old ones' addresses (and wait for them up to the
   connect timeout). A replica whose request was answered by a restarted Lighthouse (a quorum
   id below the last one's) without timing out makes a new ``Manager`` before its next round.
2. **Exchange**: three all-gathers over torchft's ``ProcessGroupGloo``: every member's header
   (slot, weight, whether its quorum and heal went without error, the fingerprint of its
   settings: :func:`settings_fingerprint`), then, if every fingerprint is the run's, every
   member's payload bytes (uint8), then an acknowledgement (one int64 each: its payloads'
   all-gather completed). Every member merges the payloads of weight > 0 in rank
   order (:meth:`RoundProtocol.merge`), so every member gets the same bits. A member whose
   ``local_step`` is behind the most advanced member's was left out of a quorum that aborted
   (torchft's step unchanged, so it does not heal) while the others ran another round's inner
   steps: its payload is of an earlier round, so it has weight 0, and it aborts that round and
   takes the most advanced member's step before the vote, as the others' aborted round left
   them. For ``streaming_diloco`` its payload is of another fragment, which the others could
   not tell from theirs by its size: every member then votes no without the payloads'
   all-gather. A member that healed at this quorum (weight 0) holds the donor's step, and
   sends zeros of the round's fragment's payload: its own is of its step before the heal. A
   member whose fingerprint is not the run's (the one most members hold) leaves the run with
   :class:`SettingsMismatch`.
3. **Vote**: ``Manager.should_commit()``. A member reports an error, and so votes no, when its
   all-gather failed or when the gathered headers and payloads show a failed heal, no payload
   or a non-finite one. Every member reads the same gathered bytes, so every member whose
   all-gather completed decides alike; torchft's vote is within one replica group only, so a
   member whose all-gather failed while the others' completed aborts alone, is one committed
   round behind at the next quorum, and heals there.
4. **Retry** (``exchange_retries`` > 0): a member whose headers' or payloads' all-gather failed
   (a member stopped, killed or cut off in the exchange) does not abort yet: it asks for a new
   quorum, in which the Lighthouse leaves out a member it no longer hears, and exchanges the
   same payload again, up to ``exchange_retries`` more times. No member can have committed the
   round meanwhile: a commit needs every member's acknowledgement, which a member sends only
   after its payloads' all-gather completed. A member whose acknowledgement failed aborts (it
   heals at its next quorum, as before).
5. **Commit or abort** (:meth:`RoundProtocol.commit`, :meth:`RoundProtocol.abort`), then one
   JSON line in ``OUT/replicas/replica_<i>.jsonl`` (with ``attempts``: the round's quorums).

Needs the ``ft`` extra (``torch`` and ``torchft``); the rest of optax_dist does not import
torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import socket
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_dist import _checks
from optax_dist.fault_tolerance import checkpoints, heal
from optax_dist.fault_tolerance.checkpoints import CheckpointWriter
from optax_dist.fault_tolerance.decision import run_fingerprint, settings_fingerprint
from optax_dist.fault_tolerance.engine import RoundLog
from optax_dist.fault_tolerance.protocol import (
  ReplicaState,
  RoundProtocol,
  Sent,
  global_state,
  heal_state,
  state_hash,
)
from optax_dist.fault_tolerance.torchft_session import (  # noqa: F401 (re-exported)
  FRAME_MAGIC,
  INSTALL_HINT,
  QUORUM_ATTEMPT_S,
  HealTransport,
  Session,
  _pack,
  _unpack,
  torch,
)

_HEADER = ("slot", "weight", "ok", "fingerprint", "step")
"""The int64 header each member sends before its payload (``ok``: 1 unless its quorum or heal
failed; ``step``: its ``local_step`` after the round's inner steps)."""


# ----------------------------------------------------------------------------------------------
# The replica.


@dataclasses.dataclass
class _Round:
  """What one round left for its log line (``retryable``: its last attempt's exchange failed
  before the acknowledgement)."""

  members: tuple = ()
  weight: int = 0
  tokens: int = 0
  quorum_seconds: float = 0.0
  foreign: bool = False
  step: int = 0
  attempts: int = 0
  retryable: bool = False


class SettingsMismatch(RuntimeError):
  """A replica's settings differ from the run's: it leaves the run."""


class TorchftReplica(Session):
  r"""One replica of a fault-tolerant run over torchft (see the module's docstring).

  Replica ``i`` uses data slot ``i``: its batch at step :math:`t` (its ``local_step`` before
  the step) is ``batch_fn(seed, i, t)``, so a replica restarted under the same id continues its
  slot's stream from the healed ``local_step``. Every process runs its round's inner steps
  before its quorum; a replica that heals there sends weight 0 (its steps were not from the
  current state) and commits from the healed state.

  Args:
    protocol: the run's :class:`RoundProtocol` (every replica's alike).
    params: the initial params (every replica's alike).
    grad_fn: ``(params, batch) -> grads`` (jitted here).
    batch_fn: ``(seed, slot, step) -> batch``, a stateless function of its ints.
    lighthouse: the Lighthouse's URL, ``http://host:port``.
    replica_id: this replica's id and data slot, an int >= 0.
    out: the run's directory; the log goes to ``out/replicas/replica_<i>.jsonl`` (appended).
    host: the address this replica's servers bind and advertise, or a name resolved to it once
      here (its host name in a network namespace of its own: that namespace's address).
    seed: the data seed.
    tokens_per_step: the tokens of one batch: a round's weight is its inner steps times it.
    min_replicas: the smallest quorum that commits (torchft's ``min_replica_size``).
    quorum_timeout: seconds to wait for a quorum before ``TimeoutError``, over requests of at
      most ``QUORUM_ATTEMPT_S`` seconds each (a restarted Lighthouse answers the next one).
    timeout: seconds for a collective, a heal and the vote.
    on_ready: called once the replica has compiled its round (on a scratch copy of its state)
      and its manager heartbeats to the Lighthouse, before its first quorum: e.g. a barrier
      that lets R replicas starting together meet in their first quorum.
    checkpoint_every: inner steps between checkpoints in ``out/replicas/checkpoints``
      (:mod:`~optax_dist.fault_tolerance.checkpoints`), written by the quorum's rank 0 after a
      committed round that crosses a multiple of it and after the run's last; the replica
      starts from the newest one there. ``None``: no checkpoints, none read.
    standby: a warm standby's wait for its takeover (e.g.
      :func:`optax_dist.fault_tolerance.replica.wait_for_takeover`): called once the replica
      has compiled its round, before it reads the newest checkpoint and before its manager
      starts, so that it takes over a dead replica's id within a round instead of after its
      imports and compilations. ``None``: none (a replica starting or restarted).
    exchange_retries: how many times a round whose exchange failed before the acknowledgement
      is tried again in a new quorum (step 4 of the module's docstring) before it aborts, an
      int >= 0; 0: it aborts at once.

  Raises:
    ValueError: ``lighthouse`` not an ``http://`` URL; ``replica_id`` not an int >= 0;
      ``tokens_per_step`` or ``min_replicas`` not a positive int; ``exchange_retries`` not an
      int >= 0; a timeout not a positive number; the newest checkpoint written by other
      settings, or damaged.

  References:
    torchft 0.2.0 (``Manager``, ``LighthouseServer``, ``ProcessGroupGloo``,
    ``CheckpointTransport``); the contract's "Fault-tolerant rounds".
  """

  def __init__(
    self, protocol: RoundProtocol, params: Any, grad_fn: Callable, batch_fn: Callable, *,
    lighthouse: str, replica_id: int, out: str | os.PathLike, host: str = "127.0.0.1",
    seed: int = 0, tokens_per_step: int = 1, min_replicas: int = 1,
    quorum_timeout: float = 60.0, timeout: float = 30.0,
    on_ready: Callable[[], None] | None = None, checkpoint_every: int | None = None,
    standby: Callable[[], None] | None = None, exchange_retries: int = 0,
  ):
    fn = "TorchftReplica"
    if not str(lighthouse).startswith("http://"):
      raise ValueError(f"`{fn}(lighthouse=...)` must be an http:// URL, got {lighthouse!r}.")
    _checks.check_non_negative_int(fn, "replica_id", replica_id)
    _checks.check_positive_int(fn, "tokens_per_step", tokens_per_step)
    _checks.check_positive_int(fn, "min_replicas", min_replicas)
    _checks.check_non_negative_int(fn, "exchange_retries", exchange_retries)
    for name, value in (("quorum_timeout", quorum_timeout), ("timeout", timeout)):
      if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"`{fn}({name}=...)` must be a positive number of seconds, got {value!r}.")
    # a name is resolved once, here (in a network namespace, by its /etc/hosts): peers are sent
    # the address
    try:
      host = socket.getaddrinfo(host, None)[0][4][0]
    except OSError as e:
      raise ValueError(f"`{fn}(host=...)` must be an address or a name that resolves, got"
                       f" {host!r} ({e}).") from None
    self.protocol, self.params0, self.slot, self.seed = protocol, params, replica_id, seed
    self.grad_fn, self.batch_fn = jax.jit(grad_fn), batch_fn
    self.tokens_per_step, self.exchange_retries = tokens_per_step, exchange_retries
    self.fingerprint = settings_fingerprint(
      protocol, params, seed=seed, tokens_per_step=tokens_per_step)
    self.state: ReplicaState = protocol.init(params)
    self.healed = False
    self.quorum_id, self._last_members = 0, None
    path = pathlib.Path(out) / "replicas"
    path.mkdir(parents=True, exist_ok=True)
    self.log_path = path / f"replica_{replica_id}.jsonl"
    self.checkpointer = None
    if checkpoint_every is not None:
      self.checkpointer = CheckpointWriter(path / "checkpoints", checkpoint_every,
                                           self.fingerprint)
    if standby is None:
      self._restore()
    self._warm_up()
    if standby is not None:
      standby()
      if self._restore():  # the warm-up's first round started elsewhere
        self._first_round = None
    self.quorum_timeout = quorum_timeout
    self._target = None
    self._open(lighthouse, host, min_replicas, quorum_timeout, timeout)
    if on_ready is not None:
      on_ready()

  def _restore(self) -> bool:
    """Takes the newest checkpoint's state, if checkpoints are on and one is there; returns
    whether it did."""
    if self.checkpointer is None:
      return False
    restored = checkpoints.restore(self.checkpointer.directory, self.protocol, self.state,
                                   self.params0, self.fingerprint)
    if restored is not None:
      self.state = restored[0]
    return restored is not None

  def _warm_up(self) -> None:
    """Runs a round's computations once, before the manager starts (so before the Lighthouse
    knows this replica): the inner steps and the local half of its first round (kept: that
    round is then done), and on scratch copies the vote's check, both merges (of payloads
    placed as a peer's arrive), a commit, an abort, a heal's decoding and rebuild, a healer's
    commit and its next round. Their compilation then delays neither this replica's first
    quorum nor the round after a heal, and a round costs the same from the first. The data
    order is untouched (``batch_fn`` is stateless)."""
    state, sent = self._first_round = self.protocol.run_round(self.state, self._grads)
    payload = _unpack(_pack(sent.payload), sent.payload)  # placed as a peer's arrives
    self.protocol.votes(payload)
    self.protocol.merge([payload] * 2, [1, 2])  # the weighted merge of a round with a heal
    merged = self.protocol.merge([payload] * 2, [1, 1])
    self.protocol.commit(state, merged, sent)
    self.protocol.abort(state)
    payload = heal.encode_heal(heal_state(state))
    healed = self.protocol.commit(
      heal.heal_replica(self.protocol, payload, state, self.params0, replica="self"), merged)
    state_hash(global_state(healed))
    self.protocol.run_round(healed, self._grads)  # its arrays may be placed otherwise

  def _grads(self, params: Any, step: int) -> Any:
    """The gradient at ``params`` on this replica's batch of ``step``."""
    return self.grad_fn(params, self.batch_fn(self.seed, self.slot, step))

  # The state torchft moves on a heal.

  def _heal_bytes(self) -> bytes:
    return heal.encode_heal(heal_state(self.state))

  def _load(self, payload: bytes) -> None:
    self.state = heal.heal_replica(self.protocol, payload, self.state, self.params0,
                                   replica="donor")
    self.healed = True

  # The rounds.

  def run(self, steps: int) -> None:
    """Runs rounds until the run has committed ``steps`` inner steps' worth of rounds (the
    round boundaries up to step ``steps``), healing on the way if behind."""
    _checks.check_positive_int("TorchftReplica.run", "steps", steps)
    self._target = target = self.protocol.rounds_until(steps)
    while int(self.state.rounds) < target:
      self.round()

  def round(self) -> dict:
    """One round: inner steps; quorum (and heal), exchange and vote, again in a new quorum up
    to ``exchange_retries`` times while the exchange fails before its acknowledgement; commit
    or abort. Returns the log line written.

    Raises:
      SettingsMismatch: after the line (an abort), if this replica's settings fingerprint is
        not the run's.
    """
    if self._first_round is None:
      self.state, sent = self.protocol.run_round(self.state, self._grads)
    else:  # the warm-up ran it from this same state
      (self.state, sent), self._first_round = self._first_round, None
    self.healed = False
    info = _Round(tokens=sent.steps * self.tokens_per_step)
    merged, committed = self._attempt(sent, info)
    while not committed and info.retryable and info.attempts <= self.exchange_retries:
      merged, committed = self._attempt(sent, info)
    if committed:
      self.state = self.protocol.commit(self.state, merged, sent if info.weight else None)
    else:
      self.state = self.protocol.abort(self.state)
    line = self._write(info, committed)
    if (committed and self.checkpointer and info.members[:1] == (self.slot,)
        and self.checkpointer.due(line["step"], sent.steps,
                                  last=int(self.state.rounds) == self._target)):
      self.checkpointer.write(self.state, step=line["step"], time=line["time"])
    if info.foreign:
      raise SettingsMismatch(
        f"replica {self.slot}: its settings (fingerprint {self.fingerprint}) differ from the"
        " run's: algorithm, sync period, wire format, params' shapes, seed and tokens per step"
        " must be every replica's")
    return line

  def _attempt(self, sent: Sent, info: _Round) -> tuple[Any, bool]:
    """One attempt at the round: quorum (and heal), exchange, vote; returns the merged payload
    (``None`` on failure) and the vote."""
    start = time.monotonic()
    self._quorum()
    info.quorum_seconds += time.monotonic() - start
    info.attempts, info.retryable = info.attempts + 1, False
    info.members, info.step, info.foreign = (), 0, False
    info.weight = 0 if self.healed else info.tokens
    merged = self._exchange(sent, info)
    if info.step > int(self.state.opt_state.local_step):  # its round is void (see _exchange)
      info.weight, info.retryable = 0, False
      self.state = _at_step(self.protocol.abort(self.state), info.step)
    return merged, self._vote()

  def _exchange(self, sent: Sent, info: _Round) -> Any:
    """The headers' all-gather, the payloads', the acknowledgement's and the merge; on failure
    reports the error (a no vote) and returns ``None``, with ``info.retryable`` set if the
    headers' or the payloads' all-gather failed."""
    ok, step = int(self._manager.errored() is None), int(self.state.opt_state.local_step)
    header = np.asarray([self.slot, info.weight, ok, self.fingerprint, step], np.int64)
    outs = self._allgather(torch.from_numpy(header))
    if outs is None:
      info.retryable = True
      return None
    heads = [dict(zip(_HEADER, out.tolist(), strict=True)) for out in outs]
    info.members = tuple(head["slot"] for head in heads)
    info.step = max(head["step"] for head in heads)
    run = run_fingerprint([head["fingerprint"] for head in heads])
    info.foreign = self.fingerprint != run
    foreign = [head["slot"] for head in heads if head["fingerprint"] != run]
    if foreign:
      self._manager.report_error(ValueError(f"replicas {foreign}: settings differ from the run's"))
      return None
    behind = [head["slot"] for head in heads if head["step"] < info.step]
    if behind and self.protocol.payload_size_varies:
      self._manager.report_error(ValueError(f"replicas {behind}: a round behind (on another"
                                            " fragment)"))
      return None
    payload = self._payload(sent, info.step)
    outs = self._allgather(_pack(payload))
    if outs is None:
      info.retryable = True
      return None
    # The acknowledgement: a member's chunk of it says that its payloads' all-gather completed.
    # A member commits only once it holds every member's, so no member commits a round whose
    # exchange failed on another before the acknowledgement: that one may retry the round.
    if self._allgather(torch.ones(1, dtype=torch.int64)) is None:
      return None
    voters = [(head["weight"], _unpack(out, payload)) for head, out in zip(
      heads, outs, strict=True) if head["weight"] > 0 and head["step"] == info.step]
    if not (voters and all(head["ok"] for head in heads)
            and all(self.protocol.votes(p) for _, p in voters)):
      self._manager.report_error(ValueError("a member's heal failed, no payload, or a"
                                            " non-finite one"))
      return None
    return self.protocol.merge([p for _, p in voters], [w for w, _ in voters])

  def _payload(self, sent: Sent, step: int) -> Any:
    """What this replica sends in the round ending at ``step``: its payload; healed in this
    round (its weight 0: left out of the merge) when a payload's size varies with the round
    (``streaming_diloco``), :meth:`RoundProtocol.healed_payload`, zeros of the payload of the
    round's fragment. Its own payload is of the fragment of its step before the heal, of
    another size, and gloo aborts the process on an all-gather of buffers of different
    sizes."""
    if not self.healed or not self.protocol.payload_size_varies:
      return sent.payload
    return self.protocol.healed_payload(self.state.params, self.state.opt_state, step)

  def _write(self, info: _Round, committed: bool) -> dict:
    if info.members != self._last_members:
      self.quorum_id, self._last_members = self.quorum_id + 1, info.members
    step = int(self.state.opt_state.local_step)
    line = dataclasses.asdict(RoundLog(
      round=self.protocol.rounds_until(step) - 1, replica=self.slot, step=step,
      quorum_id=self.quorum_id, members=info.members, committed=committed, weight=info.weight,
      healed=self.healed, state_hash=state_hash(global_state(self.state)), tokens=info.tokens))
    line.update(time=time.time(), pid=os.getpid(), quorum_seconds=info.quorum_seconds,
                attempts=info.attempts)
    with open(self.log_path, "a") as f:
      f.write(json.dumps(line) + "\n")
    return line

  def shutdown(self) -> None:
    """Stops the manager, its servers and the heal server; waits for the checkpoints queued."""
    self._manager.shutdown(wait=False)
    if self.checkpointer is not None:
      self.checkpointer.close()


def _at_step(state: ReplicaState, step: int) -> ReplicaState:
  """``state`` with its ``local_step`` set to ``step`` (the round's most advanced member's),
  placed as before, committed to its device only if it was: a jitted program is compiled per
  placement of its arguments, so the next round runs the programs already compiled."""
  old = state.opt_state.local_step
  new = jnp.asarray(step, old.dtype)
  if old.committed:
    new = jax.device_put(new, old.sharding)
  return state._replace(opt_state=state.opt_state._replace(local_step=new))
