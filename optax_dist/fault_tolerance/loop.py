r"""Fault tolerance in your own training loop: the round at the boundary, driven by your loop.

Your loop keeps its jitted step (Flax Linen's ``TrainState``, an ``nnx.Optimizer`` with its
model, or plain optax ``(params, opt_state)``), its metrics and its logging. It builds its
optimizer as :attr:`RoundProtocol.tx <optax_dist.fault_tolerance.RoundProtocol.tx>` (the
inner steps only: the transformation never exchanges in the program), takes its batch and its
keys at :attr:`Replica.step` (the data position), and hands its state to
:meth:`Replica.after_step` after every step::

  state = replica.start(state)
  while replica.step < steps:
    batch = batch_fn(seed, replica.slot, replica.step)
    state, metrics = train_step(state, batch, ft.step_key(seed, replica.slot, replica.step))
    state = replica.after_step(state)

The library owns the round at the boundary (the step on which the transformation's schedule
syncs: :meth:`RoundProtocol.round_steps`). There the round has two points:

* **send**, after the round's last inner step: the local half gives this replica's payload
  :math:`p_i` from its params :math:`x'_i` (and its residual candidate), and the engine runs
  the quorum (a member behind heals from an up-to-date one), gathers the members' headers and
  payloads and decides (:func:`~optax_dist.fault_tolerance.decision.decide`: the merge and the
  vote, one pure function for every engine);
* **land**, :math:`\tau` inner steps later (:math:`\tau = 0` here: on the same call): a commit
  lands the params on the new anchor from the params before the round's last inner step (kept
  by the driver: a copy made after the step before it), exactly as the in-program update lands
  them, and an abort puts them back on the anchor.

:meth:`Replica.after_step` returns the state to continue from and says what changed
(:attr:`Replica.last`: the round's :class:`RoundResult`, whether this replica healed, and the
data position to continue at, :attr:`Replica.step`). Model collections that are not params
(BatchNorm statistics: a ``TrainState``'s ``batch_stats`` field, an NNX model's
``nnx.BatchStat`` variables) are averaged over the round's voters at commit, in rank order, and
are part of the global state (hashed, healed, checkpointed).

Randomness: take dropout and other keys from :func:`step_key` (``fold_in(seed, slot, step)``):
a key carried in the state cannot be healed, a key of ``(seed, slot, step)`` needs none.
Data: the batch of a step is a stateless function of ``(seed, slot, step)``, so a replica that
healed continues its slot's stream at :attr:`Replica.step`. A loader with state (an iterator)
must be able to start at a step: give :meth:`Replica.start` ``seek=`` (called with the new data
position whenever it jumps: after a heal or a void round).

Invariants of the user-loop path (the contract's "Fault-tolerant rounds"): E1 (one global-state
hash per committed round) and E2 (a healed joiner equals its donor) hold bit for bit; E3 (a run
equals the replay of its log) holds by ``InProcess(replay=lines)``: the run's lines replayed
write the same lines, hashes included; E4 (no fault: the in-program transformation) holds as
it does for the library's own loop: the payloads are computed from the same :math:`x'_i`,
merged in rank order, and the commit lands from the params before the last inner step, so
bitwise for gathered formats and two replicas, within one ulp otherwise.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_dist import _checks
from optax_dist.fault_tolerance import heal
from optax_dist.fault_tolerance.decision import Header, settings_fingerprint
from optax_dist.fault_tolerance.engine import RoundLog
from optax_dist.fault_tolerance.heal import (
  HealState,
  LocalState,
  advanced,
  global_state,
  heal_state,
  local_state,
  resumed_state,
  state_hash,
)
from optax_dist.fault_tolerance.lighthouse import name_thread
from optax_dist.fault_tolerance.protocol import ReplicaState, RoundProtocol


def step_key(seed: int, slot: int, step: int) -> jax.Array:
  """The random key of replica ``slot``'s inner step ``step`` in a run of ``seed``:
  ``fold_in(fold_in(key(seed), slot), step)``.

  Dropout and other randomness taken from it is a stateless function of (seed, slot, step),
  as the data is: a replica that heals to step ``t`` draws what it would have drawn there.
  Jittable (``seed``, ``slot``, ``step`` may be traced ints).
  """
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), slot), step)


# ----------------------------------------------------------------------------------------------
# The user's state: where its params, optimizer state and collections are.


class Parts(NamedTuple):
  """A user state's parts the round reads and writes.

  Attributes:
    params: the params (the optimizer's ``params`` tree).
    opt_state: the state of :attr:`RoundProtocol.tx`.
    collections: the model's collections that are not params (BatchNorm statistics), or
      ``None``.
  """

  params: Any
  opt_state: Any
  collections: Any = None


def _nnx():
  """``flax.nnx`` if it is imported, else ``None``: a state of NNX objects exists only once it
  is, and importing it (with IPython and treescope) would cost a replica's start a few tenths
  of a CPU-second for nothing."""
  return sys.modules.get("flax.nnx")


def _is_nnx(state: Any) -> bool:
  nnx = _nnx()
  return (nnx is not None and isinstance(state, tuple) and len(state) == 2
          and isinstance(state[0], nnx.Module) and isinstance(state[1], nnx.Optimizer))


def get_parts(state: Any) -> Parts:
  """The :class:`Parts` of a user state: a Linen ``TrainState`` (its ``batch_stats``, if it has
  that field, are the collections), a ``(model, optimizer)`` pair of NNX (the model's
  ``nnx.BatchStat`` variables are the collections), or a ``(params, opt_state)`` pair.

  Raises:
    TypeError: none of these.
  """
  if _is_nnx(state):
    nnx = _nnx()
    model, optimizer = state
    stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))
    return Parts(nnx.as_pure(nnx.state(model, optimizer.wrt)), nnx.as_pure(optimizer.opt_state),
                 stats if jax.tree.leaves(stats) else None)
  if hasattr(state, "params") and hasattr(state, "opt_state") and hasattr(state, "replace"):
    return Parts(state.params, state.opt_state, getattr(state, "batch_stats", None))
  if isinstance(state, tuple) and len(state) == 2:
    return Parts(*state)
  raise TypeError(
    "the loop's state must be a flax TrainState, a (model, nnx.Optimizer) pair or a (params,"
    f" opt_state) pair, got {type(state).__name__}.")


def put_parts(state: Any, parts: Parts, step: int | None = None) -> Any:
  """``state`` with ``parts`` in place (an NNX pair is updated in place and returned); with
  ``step``, its step counter (``TrainState.step``, ``nnx.Optimizer.step``) set to it."""
  if _is_nnx(state):
    nnx = _nnx()
    model, optimizer = state
    nnx.update(model, parts.params)
    nnx.update(optimizer.opt_state, nnx.state(parts.opt_state))
    if parts.collections is not None:
      nnx.update(model, parts.collections)
    if step is not None:
      optimizer.step[...] = _placed_like(step, optimizer.step[...])
    return state
  if hasattr(state, "params") and hasattr(state, "opt_state") and hasattr(state, "replace"):
    new = dict(params=parts.params, opt_state=parts.opt_state)
    if parts.collections is not None:
      new["batch_stats"] = parts.collections
    if step is not None:
      new["step"] = _placed_like(step, state.step)
    return state.replace(**new)
  return parts.params, parts.opt_state


def _placed_like(value: int, old: Any) -> Any:
  """``value`` as an array of ``old``'s dtype, committed to ``old``'s device only if ``old``
  was (a jitted program is compiled per placement of its arguments)."""
  new = jnp.asarray(value, jnp.result_type(old))
  old_committed = getattr(old, "committed", False)
  return jax.device_put(new, old.sharding) if old_committed else new


# ----------------------------------------------------------------------------------------------
# The round driver.


@dataclasses.dataclass(frozen=True)
class Sent:
  """What a member brings to its round's exchange (the engine's input).

  Attributes:
    header: its :class:`~optax_dist.fault_tolerance.decision.Header`.
    payload: ``(payload, collections)``: its payload and its model collections (``None``).
    rounds: its committed rounds (with ``header.step``, how far it is).
    donation: what it sends a member that heals from it (:meth:`Replica.donation` of its state
      before the round's outcome).
  """

  header: Header
  payload: Any
  rounds: int
  donation: Any


@dataclasses.dataclass(frozen=True)
class Received:
  """What an engine hands back to a member after its round's exchange.

  Attributes:
    members: the quorum's slots in rank order (``()``: left out of it).
    quorum_id: the engine's quorum counter.
    healed: the donor's decoded donation if this member healed, else ``None``.
    merged: ``(merged payload, merged collections)`` on a commit, ``None`` on an abort.
    step: the round's step (the most advanced member's ``local_step``).
    reason: why the round aborted (``""`` on a commit).
  """

  members: tuple
  quorum_id: int
  healed: Any
  merged: Any
  step: int
  reason: str = ""


@dataclasses.dataclass(frozen=True)
class Restored:
  """What an engine's start may hand back from a checkpoint: its decoded donation and this
  replica's own :class:`LocalState` of the same committed round (a resume: the replica is
  rebuilt whole, :meth:`Replica.receive`).

  Attributes:
    donation: the checkpoint's decoded donation (:func:`split_donation` reads it).
    local: this replica's :class:`LocalState`.
  """

  donation: Any
  local: LocalState


@dataclasses.dataclass(frozen=True)
class RoundResult:
  """What a round changed, as :meth:`Replica.after_step` reports it.

  Attributes:
    committed: whether the round committed on this replica.
    healed: whether this replica healed from a donor in the round (its inner state was
      rebuilt and :attr:`Replica.step` jumped to the donor's).
    step: the data position to continue at (:attr:`Replica.step`).
    line: the round's :class:`RoundLog` line.
  """

  committed: bool
  healed: bool
  step: int
  line: RoundLog


class _Exchange:
  """An engine's exchange of one round (``exchange(sent) -> Received``), run here or on a
  daemon thread of its own (a kill of the process ends it with the process, as a kill of a
  synchronous exchange does); :meth:`result` waits for it and raises what it raised."""

  def __init__(self, exchange: Callable[[Sent], Received], sent: Sent, *, thread: bool):
    self._got, self._error, self._thread = None, None, None
    if not thread:
      self._got = exchange(sent)
      return
    self._thread = threading.Thread(target=self._run, args=(exchange, sent), daemon=True,
                                    name="optax_dist-exchange")
    self._thread.start()

  def _run(self, exchange: Callable[[Sent], Received], sent: Sent) -> None:
    name_thread("optax_dist-exch")  # as Linux shows it, told apart from the loop's and XLA's
    try:
      self._got = exchange(sent)
    except BaseException as e:  # noqa: BLE001 (raised again at the join, on the loop's thread)
      self._error = e

  def result(self) -> Received:
    if self._thread is not None:
      self._thread.join()
    if self._error is not None:
      raise self._error
    return self._got


@dataclasses.dataclass(frozen=True)
class _Round:
  """A round between its send and its join: its send step (``local_step`` then), fragment,
  landing origin, residual candidate, tokens and losses, its exchange, and the step that
  joins it."""

  step: int
  fragment: int | None
  origin: Any
  residual: Any
  tokens: int
  losses: list
  exchange: _Exchange
  join_at: int


class Replica:
  r"""One replica of a fault-tolerant run, in the user's loop: the round driver.

  Made by an engine (:class:`~optax_dist.fault_tolerance.InProcess` or
  :class:`~optax_dist.fault_tolerance.Torchft`) and handed to the user's training function;
  see the module's docstring for the loop.

  Args:
    protocol: the run's :class:`RoundProtocol`.
    engine: the transport (an engine's per-replica end): ``start(replica)`` (joins the run;
      returns a decoded donation to start from, e.g. a checkpoint's, a :class:`Restored`, or
      ``None``),
      ``exchange(sent) -> Received``, ``record(line)``, and optionally ``num_replicas`` (the
      most payloads a merge holds: :meth:`start` compiles the merges up to it; else up to 2).
    slot: this replica's id and data slot.
    seed: the data seed.
    tokens_per_step: the tokens of one batch (a round's weight is its inner steps times it).

  Attributes:
    step: the data position: the inner steps this replica has taken (its ``local_step``).
    rounds: the committed rounds it holds.
    last: the last round's :class:`RoundResult` (``None`` before the first).
    fingerprint: its settings fingerprint (set by :meth:`start`).

  Raises:
    ValueError: ``slot`` not an int >= 0, ``tokens_per_step`` not a positive int.
  """

  def __init__(self, protocol: RoundProtocol, engine: Any, *, slot: int, seed: int,
               tokens_per_step: int):
    _checks.check_non_negative_int("Replica", "slot", slot)
    _checks.check_positive_int("Replica", "tokens_per_step", tokens_per_step)
    self.protocol, self.engine, self.slot, self.seed = protocol, engine, slot, seed
    self.tokens_per_step, self.fingerprint = tokens_per_step, None
    self.step, self.rounds, self.last = 0, 0, None
    self._replica: ReplicaState | None = None
    self._collections = self._origin = self._seek = self._params_like = None
    self._round_start = self._boundary = 0
    self._losses: list = []  # the losses reported since the last boundary, unread
    self._pending: _Round | None = None  # a round sent and not yet joined
    self._latest = None

  @property
  def healed(self) -> bool:
    """Whether this replica healed in its last round."""
    return self.last is not None and self.last.healed

  def start(self, state: Any, *, seek: Callable[[int], None] | None = None) -> Any:
    """Takes the loop's initial state (every replica's alike, ``tx.init``'s, ``local_step``
    0) and returns the state to start from: a checkpoint's, if the engine restores one (rebuilt
    whole from its local state too when the engine hands back a :class:`Restored`), else
    ``state``. ``seek(step)``, if given, is called whenever the data position jumps
    (:attr:`step`: after a restore, a heal or a void round).

    Before the engine's start (so before its peers know this replica), the round's programs
    are compiled on scratch copies (the payload, the vote, both merges, a commit, an abort, the
    copies, a heal's decoding and rebuild, the state hash): a round costs the same from the
    first, and they are a few programs per tree structure, not one per leaf.

    Raises:
      TypeError: ``state`` not a kind :func:`get_parts` reads.
      ValueError: ``state``'s optimizer state is not :attr:`RoundProtocol.tx`'s.
    """
    parts = get_parts(state)
    if not hasattr(parts.opt_state, "local_step"):
      raise ValueError(
        "`Replica.start(state=...)`: the optimizer state must be RoundProtocol.tx's (a state"
        f" with local_step), got {type(parts.opt_state).__name__}; build the loop's optimizer"
        " as protocol.tx.")
    self._params_like, self._seek = parts.params, seek
    self.fingerprint = settings_fingerprint(self.protocol, parts.params, seed=self.seed,
                                            tokens_per_step=self.tokens_per_step)
    self._replica = self.protocol.init(parts.params, parts.opt_state)
    self._collections = parts.collections
    self._warm_up(parts)
    restored = self.engine.start(self)
    if restored is not None:  # placed as the loop's own state is
      resumed = isinstance(restored, Restored)
      got = self.receive(restored.donation, restored.local) if resumed else self.receive(restored)
      replica, collections = placed_as(got, (self._replica, self._collections))
      state = self._take(state, replica, collections, jumped=True)
    self._keep_origin(state)
    return state

  def after_step(self, state: Any, *, loss: Any = None) -> Any:
    """Call after every inner step with the step's new state; returns the state to continue
    from (``state`` itself between round boundaries).

    On the round's boundary step it runs the round (send, exchange, decision, land) and sets
    :attr:`last`; on the step before, it keeps a copy of the params (the commit lands from
    them). Between boundaries it reads nothing from the device. With ``overlap`` :math:`\tau`
    over an engine that exchanges beside the steps (the torchft engine), the boundary step
    :math:`s` sends and starts the exchange on a thread, and step :math:`s + \tau - 1` (or the
    next boundary, if it comes first: one exchange in flight) joins it, blocking until the
    exchange has finished, and holds the commit's merge, reverts an abort's fragment or takes a
    heal there, and writes the round's line.

    Args:
      state: the loop's state after the step.
      loss: optional, the step's training loss (a scalar; a device array is kept as it is, not
        read). At the boundary the round's line (:attr:`RoundLog.loss`) gets the mean of the
        losses reported since the last boundary (the round's inner steps), in float64, read
        from the device in one transfer per round; ``None`` if none was.

    Raises:
      RuntimeError: called before :meth:`start`.
      Whatever the round's exchange raised on its thread (at the join).
    """
    if self._replica is None:
      raise RuntimeError("`Replica.after_step` before `Replica.start`: call start first.")
    self.step += 1
    if loss is not None:
      self._losses.append(loss)
    if self._pending is not None and self.step == self._boundary:  # one exchange in flight
      state = self._join(state)
    if self.step == self._boundary:
      state = self._round(state)
    if self._pending is not None:
      self._latest = state  # what finish() joins with if the loop ends first
      if self.step >= self._pending.join_at:
        state = self._join(state)
    self._keep_origin(state)
    return state

  def finish(self, state: Any = None) -> Any:
    r"""Joins a round whose exchange is still in flight when the loop ends (overlap
    :math:`\tau` over an engine that runs the exchange beside the steps, when the loop stops
    before step :math:`s + \tau - 1`) and returns the state with its outcome; returns ``state``
    when none is. ``state``: the loop's state after its last step (default: the one last handed
    to :meth:`after_step`). The torchft engine calls it once the training function returns.

    Raises:
      Whatever the round's exchange raised on its thread.
    """
    if self._pending is None:
      return state
    return self._join(self._latest if state is None else state)

  @property
  def replica_state(self) -> ReplicaState:
    """This replica's :class:`ReplicaState` after its last round (or its start)."""
    return self._replica

  def donation(self, replica: ReplicaState | None = None, collections: Any = None) -> Any:
    """What this replica sends a joiner (and writes in a checkpoint): the :func:`heal_state`
    of ``replica`` (default: its state after its last round), paired with its collections
    when it has any (:func:`split_donation` reads both)."""
    if replica is None:
      replica, collections = self._replica, self._collections
    state = heal_state(replica)
    return state if collections is None else (state, collections)

  def receive(self, donation: Any, own: LocalState | None = None) -> tuple[ReplicaState, Any]:
    """A received (decoded) donation as this replica's ``(ReplicaState, collections)``: the
    global state taken bit for bit, the params at the restart point, the inner state rebuilt
    with the donor's inner optimizer state (:func:`local_state`); with ``own`` (this replica's
    :class:`LocalState` of the donation's round, from a checkpoint), rebuilt whole from both
    instead (:func:`resumed_state`)."""
    state, collections = split_donation(donation)
    if own is not None:
      return resumed_state(state.global_state, own), collections
    replica = local_state(self.protocol, state.global_state, self._params_like, state.inner)
    return replica, collections

  # ---------------------------------------------------------------------------------------------

  def _warm_up(self, parts: Parts) -> None:
    """Runs the round's computations once on scratch copies of the initial state."""
    boundary = self.protocol.round_steps(0)
    fragment = self.protocol.fragment(boundary)
    payload, residual = self.protocol.send_half(parts.opt_state, parts.params, fragment)
    sent = (payload, parts.collections)
    payload, collections = heal.tree_from_bytes(heal.tree_bytes(sent), sent)  # as peers' arrive
    self.protocol.votes(payload)
    merged = self._warm_merges(payload)
    self.protocol.outer_half(parts.params, parts.params, parts.opt_state, self._replica.average,
                             merged, residual, fragment)
    copied(self.protocol.abort(self._replica).params)
    copied(parts.params)  # the landing's origin (_keep_origin)
    if collections is not None:  # the members' merged collections, copied
      copied(self._warm_merges(collections))
    donation = self.donation()
    if self._beside():  # the send's copy of what the exchange's thread reads
      copied(donation)
    healed, _ = self.receive(heal.decode_heal(heal.encode_heal(donation), donation,
                                              replica="self"))
    self.protocol.commit(healed._replace(opt_state=_at_step(healed.opt_state, boundary)), merged)
    self.state_hash()

  def _warm_merges(self, payload: Any) -> Any:
    """The merges of 1 to R copies of ``payload`` (R: the engine's ``num_replicas``, 2 if
    unknown), the mean and the weighted one (a round with a heal, token-weighted, or over a
    ``total``): each count and kind is a program of its own. Returns the merge of two."""
    for n in range(1, max(2, getattr(self.engine, "num_replicas", None) or 2) + 1):
      self.protocol.merge([payload] * n, [1] * n)
      self.protocol.merge([payload] * n, [1] * n, n + 1)
    return self.protocol.merge([payload] * 2, [1, 1])

  def _keep_origin(self, state: Any) -> None:
    """Sets the next round boundary; on the step before it, copies the params (the landing's
    origin: the loop's step may donate them)."""
    if self.step >= self._boundary:
      self._boundary = self.step + self.protocol.round_steps(self.step)
    if self.step == self._boundary - 1:
      self._origin = copied(get_parts(state).params)

  def _send(self, state: Any) -> tuple[Parts, Any, Any, Any, ReplicaState, Header]:
    """The round's send at the boundary, no collective: ``(parts, fragment, payload,
    residual, mine, header)``: the loop's parts, the round's fragment, this replica's payload
    and residual candidate (:attr:`RoundProtocol.send_half`), its state with the loop's params
    and optimizer state, and its header (its ``weight`` the round's tokens)."""
    parts = get_parts(state)
    fragment = self.protocol.fragment(self.step)
    payload, residual = self.protocol.send_half(parts.opt_state, parts.params, fragment)
    mine = self._replica._replace(params=parts.params, opt_state=parts.opt_state)
    tokens = (self.step - self._round_start) * self.tokens_per_step
    header = Header(self.slot, tokens, 1, self.fingerprint, self.step)
    return parts, fragment, payload, residual, mine, header

  def _round(self, state: Any) -> Any:
    """The round at the boundary: :meth:`_send`, then the engine's exchange, started on a
    thread beside the next steps (:meth:`_beside`: what it reads is copied first, as the
    loop's step may donate the state) or run here; its outcome is :meth:`_join`'s."""
    parts, fragment, payload, residual, mine, header = self._send(state)
    donation = self.donation(mine, parts.collections)
    beside = self._beside()
    if beside:
      donation = copied(donation)
    sent = Sent(header, (payload, copied(parts.collections) if beside else parts.collections),
                int(mine.rounds), donation)
    exchange = _Exchange(self.engine.exchange, sent, thread=beside)
    join_at = self.step + (self.protocol.overlap - 1 if beside else 0)
    self._pending = _Round(self.step, fragment, self._origin, residual, header.weight,
                           self._losses, exchange, join_at)
    self._losses, self._round_start = [], self.step
    return state

  def _beside(self) -> bool:
    """Whether the round's exchange runs on a thread beside the next steps: with ``overlap``
    over an engine that says so (``exchanges_beside_steps``); else on the send step."""
    return bool(self.protocol.overlap) and getattr(self.engine, "exchanges_beside_steps", False)

  def _join(self, state: Any) -> Any:
    """The round's outcome, on the loop's thread: waits for its exchange (its error raised
    here), then heal, commit or abort, the data position and the round's line.

    A commit holds or lands as on the send step (the round's fragment and send step are the
    ones its state's ``local_step`` had there); an abort puts the fragment's params back on the
    anchor at the join; a heal replaces the state with the donor's, whose ``local_step`` (its
    send step) the data position jumps to: the steps taken since the send are dropped."""
    p, self._pending, self._latest = self._pending, None, None
    got = p.exchange.result()
    parts = get_parts(state)
    mine = self._replica._replace(params=parts.params, opt_state=parts.opt_state)
    replica, collections = mine, parts.collections
    since = 0 if got.healed is not None else self.step - p.step  # own steps since the send
    later = since > 0
    if got.healed is not None:  # placed as the loop's own state is (e.g. sharded over a mesh)
      replica, collections = placed_as((self.receive(got.healed)), (mine, collections))
    elif later:
      replica = _with_step(replica, _placed_like(p.step, parts.opt_state.local_step))
    if got.merged is None:  # the params back on the anchor: copies (the loop donates them)
      replica = self.protocol.abort(replica)
      replica = replica._replace(params=copied(replica.params))
    elif got.healed is not None:  # it sent nothing of its own: it lands from the healed params
      replica, collections = self.protocol.commit(replica, got.merged[0]), got.merged[1]
    else:
      params, opt_state, average = self.protocol.outer_half(
        p.origin, replica.params, replica.opt_state, replica.average, got.merged[0],
        p.residual, p.fragment)
      replica = ReplicaState(params, opt_state, replica.rounds + 1, average)
      collections = got.merged[1]
    if later:
      replica = _with_step(replica, parts.opt_state.local_step)
    if got.merged is not None and collections is not None:  # the members' merged ones, copied
      collections = copied(collections)
    jumped = got.healed is not None or got.step > p.step
    if jumped and got.healed is None:  # a void round: it takes the round's step and counts
      replica = replica._replace(opt_state=advanced(replica.opt_state, got.step - p.step))
    kept = self._losses, self._round_start
    state = self._take(state, replica, collections, jumped)
    if not jumped:  # the steps since the send are the next round's
      self._losses, self._round_start = kept
    step = self.step - since  # the round's step (a heal's: the donor's send step)
    line = RoundLog(
      round=self.protocol.rounds_until(step) - 1, replica=self.slot, step=step,
      quorum_id=got.quorum_id, members=got.members, committed=got.merged is not None,
      weight=0 if jumped else p.tokens, healed=got.healed is not None,
      state_hash=self._round_hash(since), tokens=p.tokens, loss=mean_loss(p.losses))
    self.engine.record(line)
    self.last = RoundResult(line.committed, line.healed, self.step, line)
    return state

  def state_hash(self) -> str:
    """:func:`state_hash` of this replica's global state (with its collections, if any)."""
    tree = global_state(self._replica)
    return state_hash(tree if self._collections is None else (tree, self._collections))

  def _round_hash(self, since: int) -> str:
    """:meth:`state_hash` as of the round's step, ``since`` steps before this one (its
    ``local_step``, part of the global state, that many back): what a member that joined the
    round on its send step holds."""
    if not since:
      return self.state_hash()
    step = self._replica.opt_state.local_step
    tree = global_state(_with_step(self._replica, np.asarray(step) - since))
    return state_hash(tree if self._collections is None else (tree, self._collections))

  def _take(self, state: Any, replica: ReplicaState, collections: Any, jumped: bool) -> Any:
    """Keeps ``replica`` and ``collections`` as this replica's and puts them into the loop's
    ``state``; on a jump of the data position, sets :attr:`step` (and the state's step
    counter) and calls ``seek``."""
    self._replica, self._collections, self._losses = replica, collections, []
    self.rounds = int(replica.rounds)
    if jumped:
      self.step = int(replica.opt_state.local_step)
      self._boundary = 0
      if self._seek is not None:
        self._seek(self.step)
    self._round_start = self.step
    parts = Parts(replica.params, replica.opt_state, collections)
    return put_parts(state, parts, self.step if jumped else None)


def split_donation(donation: Any) -> tuple[HealState, Any]:
  """``(heal_state, collections)`` of a :meth:`Replica.donation` (collections ``None`` for a
  model without any)."""
  return (donation, None) if isinstance(donation, HealState) else donation


def mean_loss(losses: list) -> float | None:
  """The mean of ``losses`` (device arrays fetched in one ``device_get``) in float64, or
  ``None`` for none."""
  return float(np.mean(np.asarray(jax.device_get(losses), np.float64))) if losses else None


@jax.jit
def copied(tree: Any) -> Any:
  """A copy of ``tree`` whose leaves share no buffer with its own, placed as they are: one
  program per tree structure (eager, a program per leaf)."""
  return jax.tree.map(jnp.copy, tree)


def placed_as(tree: Any, like: Any) -> Any:
  """``tree``'s arrays placed as ``like``'s (its shardings), where ``like``'s are committed to
  their devices; left as they are elsewhere."""
  def place(x, old):
    return jax.device_put(x, old.sharding) if getattr(old, "committed", False) else x
  return jax.tree.map(place, tree, like)


def _with_step(replica: ReplicaState, local_step: Any) -> ReplicaState:
  """``replica`` with its optimizer state's ``local_step`` replaced by ``local_step``."""
  return replica._replace(opt_state=replica.opt_state._replace(local_step=local_step))


def _at_step(opt_state: Any, step: int) -> Any:
  """``opt_state`` with its ``local_step`` at least ``step``, placed as before."""
  if int(opt_state.local_step) >= step:
    return opt_state
  return opt_state._replace(local_step=_placed_like(step, opt_state.local_step))

