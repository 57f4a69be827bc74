r"""The torchft engine's decoupled rounds: replicas of different speeds over one Lighthouse.

The rules are :mod:`~optax_dist.fault_tolerance.decoupled`'s (the close, the weights and
staleness, the one commit decision, the catch-up); this module is their transport over torchft
0.2.0, within what it allows (``tests/probes/decoupled_quorum.py``): a round cannot close on K
of R payloads in torchft's own terms (its Lighthouse counts askers, not payloads), so every
replica's **exchange thread** joins every quorum, at once (a member behind heals or catches up
there: 4.), and K and the window are a decision over the members' headers. Per **poll** (one quorum, then an all-gather of one
:class:`PollHeader` per member, sized by the process group: every member's):

1. a replica's push (its payload at its boundary, :class:`~optax_dist.fault_tolerance.
   decoupled.Push`) enters the open round at the first poll after it (its arrival: when its
   loop pushed it), with its tokens (since its last payload of the round's fragment that entered
   a round) and the version of that fragment at its pull before the push;
2. the round closes when every live member's payload is in (a member whose loop returned is
   not live), or when at least K are and the window :math:`W` has run out since the K-th
   arrival (:func:`~optax_dist.fault_tolerance.decoupled.close_time`, on the members' wall
   clocks as their headers carry them; the poll's time is its latest header's): then each
   member with a payload in the round broadcasts it (one broadcast per payload, in rank order;
   a member without one sends nothing), every member acknowledges, decides
   (:func:`~optax_dist.fault_tolerance.decoupled.decide_round`), votes (``should_commit``),
   applies a commit to its own copy of the global state and goes on to its next poll without
   waiting for the merge's and outer step's arrays (XLA computes them meanwhile): it writes the
   round's :class:`~optax_dist.fault_tolerance.decoupled.MergeLine`, with the hash of the state
   after, at the first poll that finds them computed (:meth:`DecoupledPort._write_rounds`; at
   the close if its loop waits for that round). A late member receives every merge in its own
   polls, so its **catch-up** costs no bytes;
3. the replica's loop, at its boundary, first **settles** (:meth:`DecoupledPort.settle`): while
   its payload is still in flight it pushes nothing (one payload in flight: a
   :class:`~optax_dist.fault_tolerance.decoupled.Boundary` line, its steps go into its next
   payload); else it takes what resolved since its last boundary (a late landing of its payload
   merged after it went on, an abort: a :class:`~optax_dist.fault_tolerance.decoupled.Revert`
   line and no push, the global state if rounds closed: :func:`~optax_dist.fault_tolerance.
   decoupled.rebased`). Then it pushes and goes on at once: the window is the round's (how long
   it stays open after its K-th payload), no replica waits in it; it lands its payload late, at
   a later settle. With :math:`W = \infty` it waits until the round holding its payload closes
   and lands it there, as a synchronous round lands (a barrier; a joiner waits until it has
   healed, whatever the window). Each boundary is a
   :class:`~optax_dist.fault_tolerance.decoupled.Boundary` line, at the time of the poll that
   closed its round or just after the last close it received (``settled``: its settle's), so
   ``InProcess(replay=lines)`` runs the same schedule and writes the same lines; a boundary its
   loop pushed at also has ``pushed`` (the Unix time of its push, its inner steps done) and
   ``waited`` (the seconds from its push to its pull), one it pushed nothing at ``at`` (the
   Unix time of its settle); a loop that returns after a skipped boundary writes an
   :class:`~optax_dist.fault_tolerance.decoupled.Unsent` line;
4. a member whose committed rounds are behind a member's (torchft's step, its ``max_step``)
   receives, within the quorum (torchft's heal over the session's
   :class:`~optax_dist.fault_tolerance.torchft_session.HealTransport`, the synchronous engine's),
   the donation of a member at that step: the global state, the donor's inner optimizer state
   (of its last push whose boundary it wrote: the in-process clock's donor's) and model
   collections, its closed rounds and fragment versions (one
   :func:`~optax_dist.fault_tolerance.heal.encode_heal` payload, checked against this replica's
   own tree and fingerprint). A replica whose process was restarted (its boundaries file,
   which each process makes at its start, exists) **heals**: its loop's next push enters no
   round (weight 0, its tokens lost: a :class:`~optax_dist.fault_tolerance.decoupled.Heal`
   line) and its pull rebuilds its params and inner state from it, its ``local_step`` and data
   position its own. A live one
   **catches up** (a :class:`~optax_dist.fault_tolerance.decoupled.CatchUp` line): it takes the
   global state alone; its loop, at its next settle, keeps its inner state and residual and
   moves its params onto the anchor it received with its own steps kept, its next payload
   measured from that anchor, with its token weight. Until a restarted
   replica has healed no member closes a round (on a Lighthouse quorum of 1 it could otherwise
   form quorums of its own and commit rounds that no other replica holds); a member that
   missed aborted rounds only takes their count. A restarted replica whose quorum (of more
   members than itself) has committed no round has nothing to heal from and closes rounds,
   unless an earlier process of it saw rounds committed: then every member restarted, the
   run's global state is lost (decoupled rounds keep no checkpoint), and it leaves with
   :class:`~optax_dist.fault_tolerance.torchft_session.StateLost` rather than train again from
   the initial state under round numbers the run already used.

**The auto window** (``grace_window="auto"``): each member measures its slack
(:func:`~optax_dist.fault_tolerance.decoupled.slack`) at its loop's push, in seconds of its
monotonic clock, :math:`\xi_i = c_i n_i - x_i`: :math:`c_i` its loop's seconds from its last
pull to this push over the inner steps between them (its inner step's time, the wait at its
boundary left out), :math:`n_i` its steps from this boundary to its next, and :math:`x_i` the
transport of the last round it closed (the seconds of that round's payloads' broadcasts and its
acknowledgement); none until it has both. Its header carries it (:attr:`PollHeader.slack`), and
every member takes the poll's window from the same headers: :math:`\gamma` times the least
slack of the members whose loops have not returned
(:func:`~optax_dist.fault_tolerance.decoupled.auto_window`; 0 before any member measured one).

With K = R and :math:`W = \infty` every replica waits for every payload: the synchronous round,
bit for bit. Members whose closed rounds differ skip their polls until the one behind has
caught up (or, after ``quorum_timeout`` seconds without, leaves the run:
:class:`~optax_dist.fault_tolerance.torchft_session.MissedRounds`); a member lost during a
round's payloads' broadcasts leaves the round open (each member acknowledges the payloads it
holds before it decides), and the next quorum closes it without that member (a member whose
collective failed votes no at once: the next quorum has a new id, on which torchft configures a
new process group, as a failed gloo collective leaves the old one unusable); a member whose
vote (torchft's ``should_commit``) fails on a round the decision commits catches up on it at
the next quorum (4.).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_dist import _exchange
from optax_dist.fault_tolerance import decoupled, heal
from optax_dist.fault_tolerance.decision import Header
from optax_dist.fault_tolerance.decoupled import Boundary, DecoupledReplica, MergeLine, Pull, Push
from optax_dist.fault_tolerance.lighthouse import name_thread
from optax_dist.fault_tolerance.loop import placed_as, split_donation
from optax_dist.fault_tolerance.rundir import RunDir
from optax_dist.fault_tolerance.torchft_session import (
  MissedRounds,
  Session,
  SettingsMismatch,
  StateLost,
  pack,
  torch,
  unpack,
)

_LOG = logging.getLogger(__name__)

POLL_S = 0.02
"""Seconds an idle exchange thread waits for its loop's push before its next poll."""

NO_SLACK = -(2**62)
""":attr:`PollHeader.slack` of a member that has not measured its slack yet."""


class PollHeader(NamedTuple):
  """What a member says at each poll (int64s on the wire; times in microseconds of its wall
  clock).

  Attributes:
    slot: its replica id.
    ok: 1 unless its quorum or its heal in this poll failed.
    fingerprint: its settings fingerprint.
    ready: 1 if its payload is in the open round.
    tokens: that payload's tokens.
    step: that payload's ``local_step``.
    received: the version of the round's fragment its replica last received.
    arrival: when that payload entered the round.
    now: when it sent this header.
    done: 1 once its loop has returned.
    closed: the rounds it has closed.
    rounds: the rounds it has committed (torchft's step).
    joining: 1 while it was restarted and has not healed (no member closes a round then).
    slack: its slack at its last push, in microseconds (:func:`~optax_dist.fault_tolerance.
      decoupled.slack`, the module docstring's auto window), or :data:`NO_SLACK`.
  """

  slot: int
  ok: int
  fingerprint: int
  ready: int
  tokens: int
  step: int
  received: int
  arrival: int
  now: int
  done: int
  closed: int
  rounds: int
  joining: int
  slack: int = NO_SLACK


@dataclasses.dataclass(frozen=True)
class _Entry:
  """This replica's payload in the open round (:class:`~optax_dist.fault_tolerance.clock`'s
  entry, its arrival in microseconds), of ``fragment``; ``since``: the step its tokens count
  from."""

  arrival: int
  push: Push
  tokens: int
  payload: Any
  received: int
  fragment: int | None
  since: int


class DecoupledPort(Session):
  """A replica's end of the torchft engine in decoupled rounds (see the module's docstring):
  the loop's :class:`~optax_dist.fault_tolerance.decoupled.DecoupledReplica` pushes and pulls
  here, and an exchange thread polls the quorum."""

  def __init__(self, engine: Any):
    self.engine, self.protocol, self.slot = engine, engine.protocol, engine.replica_id
    self.replica = DecoupledReplica(engine.protocol, self, slot=self.slot, seed=engine.seed,
                                    tokens_per_step=engine.tokens_per_step)
    run_dir = RunDir(engine.out)
    run_dir.replicas.mkdir(parents=True, exist_ok=True)
    self.log_path = run_dir.lines_file(self.slot)
    self.boundary_path = run_dir.boundaries_file(self.slot)
    self._cv = threading.Condition()
    self._push: Push | None = None  # deposited by the loop, not entered yet
    self._pushed_at = 0  # when (microseconds): its payload's arrival
    self._pull: Pull | None = None  # the loop's outcome, not taken yet
    self._entry: _Entry | None = None
    self._waiting: _Entry | None = None  # the entry whose loop waits at its boundary
    self._waits = False  # whether the loop waits for its last push (not left at the window)
    self._done, self._error, self._thread, self._manager = False, None, None, None
    self._global: tuple[Any, Any] | None = None
    self._closed = self._seen = self._base = 0
    self._versions: dict = {}  # fragment -> its committed updates
    self._received: dict = {}  # the versions this replica last received
    self._prior: dict = {}  # those of its pull before its last push
    self._sent_step = 0  # the step of its last push
    self._queue: list = []  # (step, settled, extra, push) of boundaries whose lines wait
    self._sent: dict = {}  # fragment -> the step of this replica's last payload of it
    self._landed = self._revert = None
    self._late = None  # (round, fragment): its payload merged after its loop went on
    self._skipped = None  # (open round, step) of the boundary its loop last skipped
    self._stamped = 0.0  # the time of the last close applied (seconds)
    self._settled = 0.0  # the time its loop's last settle counts at (seconds)
    self._outvoted = False  # its vote failed on the round this poll closed, which commits
    self._time = 0.0  # the last poll's time (seconds)
    # Restarted: a process of this replica started before in this run (each start makes its
    # boundaries file, before its payloads can enter a round); it heals before it closes.
    self._joining = self.boundary_path.exists()
    self.boundary_path.touch()
    # whether an earlier process of this replica saw rounds committed (their global state is
    # lost if no live member holds it: _headers)
    self._committed_before = self._joining and any(
      x.get("committed") for x in run_dir.lines(self.slot))
    self._got = None  # a donation torchft received at this quorum, decoded
    self._healed = None  # (heal pull, donor, quorum seconds) until the loop's next push
    self._heal_mark = None  # (donor, quorum seconds) for this replica's next round line
    self._behind_since: float | None = None  # when its polls began to be skipped for it
    self._skip_reason = ""  # why its last poll was skipped, logged once per change
    self._pulled: tuple[int, float] | None = None  # (step, monotonic seconds) of its last pull
    self._transport: float | None = None  # seconds of the last round's payload exchange
    self._unhashed: list = []  # (line, global state after, extra) of closes not written yet
    self._slack, self._auto = NO_SLACK, 0.0  # its slack (microseconds), the auto window

  # The loop's side.

  def start(self, replica: Any) -> None:
    """Joins the run (``min_replica_size`` 1: K is the decision's) and starts the exchange
    thread; nothing restored (checkpoints are not read in decoupled rounds)."""
    engine = self.engine
    self._hold(replica)
    self._open(engine.lighthouse, engine.host, 1, engine.quorum_timeout, engine.timeout)
    self.transport.max_bytes = heal.heal_bound(self._donation_like)
    if engine.on_ready is not None:
      engine.on_ready()
    self._thread = threading.Thread(target=self._polls, daemon=True)
    self._thread.start()

  def _hold(self, replica: Any) -> None:
    """The exchange thread's copy of the global state (the replica's initial state), its
    inner state to donate, and the tree a received donation must hold."""
    self._global = (jax.tree.map(jnp.copy, replica.replica_state), None)
    # the global state's committed rounds, read without waiting for a commit's arrays (XLA runs
    # a program after those dispatched before it: ``rounds`` would wait for the outer step)
    self._rounds = int(replica.replica_state.rounds)
    # donated on a heal: the inner state of its last boundary's push (the in-process clock's)
    self._inner = heal.inner_state(self._global[0])
    self._collections = split_donation(replica.donation())[1]
    self._blank_collections = jax.tree.map(np.zeros_like, self._collections)
    self._blanks: dict = {}  # fragment -> _blank's
    self._keys = [None] if self.protocol.num_fragments is None else list(
      range(self.protocol.num_fragments))
    self._donation_like = (replica.donation(), np.zeros(2 + len(self._keys), np.int32))

  def settle(self, step: int) -> Pull | None:
    """The boundary at ``step``, before its push (module docstring, 3.): ``None`` while this
    replica's payload is in flight (its loop pushes nothing there); else what resolved since its
    last boundary (a late landing, an abort, the global state if rounds closed).

    Raises:
      Exception: the exchange thread's error.
      TimeoutError: its payload in flight for more than ``quorum_timeout`` seconds (no round
        closed: its loop would train on without end).
    """
    with self._cv:
      if self._error is not None:
        raise self._error
      if self._push is not None or self._entry is not None:  # one payload in flight
        flight = time.time() - self._pushed_at / 1e6
        if flight > self.quorum_timeout:
          raise TimeoutError(
            f"decoupled rounds: replica {self.slot}'s payload of step {self._sent_step} has been"
            f" in flight {flight:.0f} s, more than quorum_timeout={self.quorum_timeout} s: no"
            " round closed")
        self._skipped = (self._closed, step)
        self._queue.append((step, None, {"at": time.time()}, None))
        if self._push is None:  # entered: else its push's line comes first, at its entry
          self._flush()
        return None
      self._skipped, self._settled = None, self._stamp()
      if self._joining or self._healed is not None:  # it heals at its push
        return Pull(None, None, False)
      late, aborted, self._late, self._revert = self._late, self._revert, None, None
      fresh = self._closed > self._seen or late is not None
      received = (decoupled.global_state(self._global[0]), self._global[1]) if fresh else None
      f = late[1] if late is not None else aborted[1] if aborted is not None else None
      self._seen = self._closed
      if aborted is not None:  # its steps since the aborted payload are lost; no push
        tokens = (step - self._sent.get(f, self._base)) * self.engine.tokens_per_step
        self._sent[f] = step
        self._write(self.boundary_path, decoupled.Revert(aborted[0], self.slot, step, tokens),
                    Boundary(self.slot, step, self._stamp(), False), at=time.time())
      return Pull(None, received, aborted is not None, f, late=late is not None)

  def exchange(self, push: Push) -> Pull:
    """The boundary's push: deposits ``push``; with an infinite grace window (or a joiner, until
    it has healed) waits for its round to close, else goes on at once (module docstring, 3.).

    Raises:
      Exception: the exchange thread's error (e.g. ``TimeoutError``: no quorum in time;
        :class:`~optax_dist.fault_tolerance.torchft_session.MissedRounds`).
    """
    with self._cv:
      self._push, self._pushed_at, self._waits = push, time.time_ns() // 1000, True
      self._prior = dict(self._received)  # its payload's staleness counts from its last pull
      self._sent_step = push.header.step
      self._measure(push.header.step)
      self._cv.notify_all()
      barrier = (self._joining or self._healed is not None
                 or self.engine.grace_window == math.inf)
      self._cv.wait_for(lambda: self._pull is not None or self._error is not None,
                        None if barrier else 0.0)
      self._pulled = (push.header.step, time.monotonic())
      if self._pull is not None:
        got, self._pull = self._pull, None
        return got
      if self._error is not None:
        raise self._error
      self._leave(push)
      return Pull(None, None, False)

  def _leave(self, push: Push) -> None:
    """The loop goes on before the round holding ``push`` closed, its payload in flight (the
    lock held); its boundary line is written once the push has entered a round (its time after
    the closes before that round: :meth:`_flush`)."""
    self._waits = False
    if self._waiting is not None and self._waiting.push is push:
      self._waiting = None
    self._queue.append((push.header.step, self._settled, {
      "pushed": self._pushed_at / 1e6, "waited": time.time() - self._pushed_at / 1e6}, push))
    if self._push is not push:
      self._flush()

  def _flush(self) -> None:
    """Writes the boundary lines of the loop's boundaries that did not wait (one write, at
    :meth:`_stamp`); a push's is its pull, as a landing's (the lock held)."""
    stamp, lines = self._stamp(), self._queue
    self._queue = []
    self._write_each(self.boundary_path, [
      (Boundary(self.slot, step, stamp, False, settled), extra)
      for step, settled, extra, _ in lines])
    for *_, push in lines:
      if push is not None:
        self._received = dict(self._versions)
        self._inner = jax.tree.map(jnp.copy, heal.inner_state(push.replica))

  def _stamp(self) -> float:
    """A boundary's time between the closes its loop has received and the next: just after
    the last poll's and the last close's (every header of a later poll is later than every one
    of an earlier poll; the lock held)."""
    return max(self._time, self._stamped) + 1e-6

  def _measure(self, step: int) -> None:
    """This replica's slack at its push at ``step`` (the module docstring's auto window), once
    it has pulled and closed a round before (the lock held)."""
    if self._pulled is None or self._transport is None or step <= self._pulled[0]:
      return
    last, at = self._pulled
    step_seconds = (time.monotonic() - at) / (step - last)
    self._slack = round(1e6 * decoupled.slack(step_seconds, self.protocol.round_steps(step),
                                              self._transport))

  def record(self, line: Any) -> None:  # the exchange thread writes the lines
    del line

  def _failed(self, error: Exception) -> None:
    """A collective of a poll failed: reported, and a no vote cast at once. A gloo process group
    whose collective failed (timed out: a member slow to join it, stopped or cut off) is
    unusable, its connections closed, until torchft configures a new one, which it does only on
    a new quorum id; the Lighthouse gives one when the members change or one of them counts a
    failed vote. Without the vote a poll's failure among the same members would fail every
    later poll until a member leaves (``quorum_timeout``: no round closes meanwhile)."""
    super()._failed(error)
    self._vote()

  # torchft's heal callbacks (module docstring, 4.), on the exchange thread within its quorum.

  def _heal_bytes(self) -> bytes:
    """What this member donates: the global state, its inner optimizer state (of its last
    push whose boundary it wrote), the model collections, and its closed rounds and fragment
    versions."""
    state, collections = self._global
    given = heal.HealState(heal.global_state(state), self._inner)
    collections = self._collections if collections is None else collections
    counters = np.asarray([self._closed, int(self._global[1] is not None),
                           *(self._versions.get(f, 0) for f in self._keys)], np.int32)
    tree = given if collections is None else (given, collections)
    return heal.encode_heal((tree, counters), fingerprint=self.replica.fingerprint)

  def _load(self, payload: bytes) -> None:
    """A donor's donation, checked against this replica's own tree and fingerprint, its arrays
    placed as this replica's own (a jitted program is compiled per placement of its arguments:
    so the catch-up's and heal's programs are those its warm-up compiled, not compiled inside the
    run under the replica's CPU share); refused, it is reported to torchft (a no vote) and
    torchft's counters go back to this replica's."""
    try:
      got = heal.decode_heal(payload, self._donation_like, replica="donor",
                             fingerprint=self.replica.fingerprint)
      self._got = placed_as(got, self._donation_like)
    except (TypeError, ValueError) as e:
      self._manager.load_state_dict(self._steps)
      self._manager.report_error(e)

  def finish(self) -> None:
    """After the loop returned: polls on until every member's has and the last round closed.

    Raises:
      Exception: the exchange thread's error.
    """
    with self._cv:
      self._done = True
      self._cv.notify_all()
    self._thread.join()
    if self._error is not None:
      raise self._error
    if self._skipped is not None:  # its steps since its last payload entered no round
      last = max(self._sent.values(), default=self._base)
      round_, step = self._skipped
      self._write(self.boundary_path, decoupled.Unsent(
        round_, self.slot, step, (step - last) * self.engine.tokens_per_step))

  def shutdown(self) -> None:
    if self._manager is not None:
      self._manager.shutdown(wait=False)

  # The exchange thread.

  def _polls(self) -> None:
    name_thread("optax_dist-poll")  # the exchange thread, told apart from the loop's and XLA's
    try:
      try:
        while self._poll():
          pass
      finally:  # the rounds it closed are logged, also when it leaves on an error
        self._write_rounds(wait=True)
    except BaseException as e:  # noqa: BLE001 (handed to the loop, which raises it)
      with self._cv:
        self._error = e
        self._cv.notify_all()

  def _poll(self) -> bool:
    """One poll; returns whether to go on (not once every member is done, none ready)."""
    with self._cv:
      self._cv.wait_for(lambda: self._push is not None or self._done or self._waiting,
                        POLL_S)
      self._enter()
      head = self._header()
    heads = self._headers(head)
    if heads is None:  # a member lost, or one behind: the next quorums are without it
      return True
    now = max(h.now for h in heads) / 1e6
    if all(h.done and not h.ready for h in heads):
      return False
    self._take_window(heads)
    if self._due(heads, now):
      self._close(heads, now)
    with self._cv:
      self._settle(now)
      self._time, self._outvoted = now, False
    self._write_rounds(wait=False)
    return True

  def _write_rounds(self, wait: bool) -> None:
    """Writes the lines of the rounds closed and not written yet, in order, each with the hash
    of its global state after: those whose arrays are computed, or all of them (``wait``).

    A close dispatches its merge and outer step (XLA computes them asynchronously, on the
    replica's compute threads) and the poll goes on: the member asks for its next quorum at once,
    so no member's next poll waits for the slowest member's merge; the hash, which must wait for
    the arrays, is taken here. A loop that waits at its boundary for a round gets its line
    written at the close (its boundary line after it); every other line is written by the time
    the exchange thread ends, on an error too."""
    while self._unhashed:
      line, after, extra = self._unhashed[0]
      if not (wait or all(x.is_ready() for x in jax.tree.leaves(after)
                          if isinstance(x, jax.Array))):
        return
      self._unhashed.pop(0)
      line = dataclasses.replace(line, state_hash=decoupled.global_hash(*after))
      self._write(self.log_path, line, **extra)

  def _fragment(self) -> int | None:
    return decoupled.round_fragment(self.protocol, self._rounds)

  def _enter(self) -> None:
    """The loop's push into the open round (as the in-process clock's push)."""
    push = self._push
    if push is None or self._waiting is not None or self._joining:
      return
    if self._healed is not None:
      self._push = None
      self._heal_pull(push)
      return
    self._push, f = None, self._fragment()
    payload = push.payload[0]
    if f != self.protocol.fragment(push.header.step):  # the round's fragment, not its step's
      payload = self.protocol.send_half(push.replica.opt_state, push.replica.params, f)[0]
    since = self._sent.get(f, self._base)
    tokens = (push.header.step - since) * self.engine.tokens_per_step
    entry = _Entry(self._pushed_at, push, tokens, payload, self._prior.get(f, 0), f, since)
    self._sent[f] = push.header.step
    self._entry, self._waiting = entry, entry if self._waits else None
    if self._queue:
      self._flush()

  def _heal_pull(self, push: Push) -> None:
    """A restarted replica's first push after its heal enters no round (weight 0, its tokens
    lost): its loop heals from copies of the global state now and the donor's inner optimizer
    state, as the in-process clock's joiner (the lock held)."""
    (inner, collections, donor), self._healed = self._healed, None
    given = heal.HealState(heal.global_state(self._global[0]), inner)
    collections = collections if self._global[1] is None else self._global[1]
    given = jax.tree.map(jnp.copy, given if collections is None else (given, collections))
    step = push.header.step
    # one write: a Heal line without its boundary would start an incarnation no replay can run
    self._write(self.boundary_path,
                decoupled.Heal(self._closed, self.slot, donor, step, push.header.weight),
                Boundary(self.slot, step, self._time, False))
    self._sent, self._base = {}, step
    self._pull = Pull(None, None, False, healed=given)
    self._received, self._seen = dict(self._versions), self._closed
    self._cv.notify_all()

  def _header(self) -> np.ndarray:
    e = self._entry
    fields = (self.slot, 0, self.replica.fingerprint,  # ok: after the quorum (_headers)
              int(e is not None), e.tokens if e else 0, e.push.header.step if e else 0,
              e.received if e else 0, e.arrival if e else 0, time.time_ns() // 1000,
              int(self._done), self._closed, self._rounds, int(self._joining),
              self._slack)
    return np.asarray(fields, np.int64)

  def _headers(self, head: np.ndarray) -> list[PollHeader] | None:
    """The quorum (torchft heals a member behind its ``max_step`` within it: a heal or a
    catch-up, module docstring 4.) and every member's header, checked.

    Returns:
      The members' headers; ``None`` (the poll skipped on every member) if the all-gather
      failed, a member was restarted and has not healed, or the members closed unequal rounds.

    Raises:
      SettingsMismatch: members of other settings.
      StateLost: this replica restarted after the run committed rounds, and no member holds
        the run's global state.
      MissedRounds: this replica's polls were skipped for it (it could not heal or catch up)
        for ``quorum_timeout`` seconds.
    """
    self._steps, self.transport.source = self._manager.state_dict(), None
    start = time.monotonic()
    self._quorum()
    seconds = time.monotonic() - start
    head[1] = self._manager.errored() is None  # this quorum's (its heal's): torchft clears an
    # earlier poll's error at the quorum's start, so a failed collective aborts no later round
    outs = self._allgather(torch.from_numpy(head), everyone=True)
    if outs is None:
      return None
    heads = [PollHeader(*out.tolist()) for out in outs]
    foreign = [h.slot for h in heads if h.fingerprint != self.replica.fingerprint]
    if foreign:
      raise SettingsMismatch(f"replicas {foreign} are of other settings (fingerprint) than"
                             f" replica {self.slot}")
    if self._got is not None:
      self._take(heads, seconds)
    elif self._joining and len(heads) > 1 and {h.rounds for h in heads} == {0}:
      if self._committed_before:
        raise StateLost(
          f"decoupled rounds: replica {self.slot} restarted after the run committed rounds, and"
          f" no member of its quorum {sorted(h.slot for h in heads)} holds the run's global"
          " state (every one restarted; decoupled rounds keep no checkpoint): the run cannot go"
          " on; start a new one")
      self._joining = False  # no member committed a round: nothing to heal from (alone, it waits)
    closed = {h.slot: h.closed for h in heads}
    ahead = max(heads, key=lambda h: h.closed)
    if self._closed < ahead.closed and self._rounds == ahead.rounds:
      self._closed = ahead.closed  # it missed aborted rounds only: the global state is theirs
    if any(h.joining for h in heads) or len(set(closed.values())) > 1:
      self._log_skip(f"members' closed rounds {closed}, restarted and not healed"
                     f" {[h.slot for h in heads if h.joining]}")
      self._behind(closed, heads)
      return None
    self._behind_since = None
    self._log_skip("")
    return heads

  def _log_skip(self, reason: str) -> None:
    """Logs (a warning, on the process's stderr) why this replica's polls are skipped, once
    per change of the reason, and when they go on again (``reason`` empty)."""
    if reason != self._skip_reason:
      _LOG.warning("replica %d: %s", self.slot, f"polls skipped: {reason}" if reason else
                   "polls go on")
      self._skip_reason = reason

  def _behind(self, closed: dict, heads: list[PollHeader]) -> None:
    """A skipped poll: this replica, if it is the one behind (or restarted, not healed), leaves
    after ``quorum_timeout`` seconds of skipped polls.

    Raises:
      MissedRounds: so.
    """
    if not (self._joining or self._closed < max(closed.values())):
      return
    now = time.monotonic()
    self._behind_since = self._behind_since or now
    if now - self._behind_since > self.quorum_timeout:
      raise MissedRounds(
        f"decoupled rounds: replica {self.slot} (closed rounds {self._closed}, restarted:"
        f" {self._joining}) got no heal or catch-up from its quorum's members {closed} (replica:"
        f" closed rounds) within quorum_timeout={self.quorum_timeout} s; it leaves the run")

  def _take(self, heads: list[PollHeader], seconds: float) -> None:
    """The donation torchft received at this quorum: the global state, closed rounds and
    fragment versions taken on the exchange thread; a restarted replica's loop heals at its
    next push (:class:`~optax_dist.fault_tolerance.decoupled.Heal`), a live one's catches up at
    its next pull (a :class:`~optax_dist.fault_tolerance.decoupled.CatchUp` line now)."""
    (tree, counters), self._got = self._got, None
    source = self.transport.source
    donor = heads[source].slot if source is not None and source < len(heads) else -1
    state, collections = split_donation(tree)
    missed = int(counters[0]) - self._closed
    with self._cv:
      self._global = (decoupled.catch_up(self._global[0], state.global_state),
                      collections if counters[1] else None)
      self._closed, self._rounds = int(counters[0]), int(state.global_state.rounds)
      self._versions = {f: int(v) for f, v in zip(self._keys, counters[2:], strict=True) if v}
      if self._joining:  # its heal boundary comes after this poll, before the next's
        self._joining, self._healed = False, (state.inner, collections, donor)
        self._heal_mark, self._time = (donor, seconds), max(h.now for h in heads) / 1e6
      else:
        self._write(self.boundary_path, decoupled.CatchUp(
          self._closed, self.slot, donor, missed, self._rounds))
        self._refit()

  def _refit(self) -> None:
    """After a catch-up, this replica's payload still open leaves the round if it is of another
    fragment than the round's: entered again, for the round's fragment, if its loop still waits
    for it, else its tokens go to its next payload of its fragment (the lock held)."""
    e = self._entry
    if e is None or e.fragment == self._fragment():
      return
    self._sent[e.fragment], self._entry = e.since, None
    if self._waiting is e:
      self._waiting, self._push, self._pushed_at = None, e.push, e.arrival
      self._enter()

  def _due(self, heads: list[PollHeader], now: float) -> bool:
    """Whether the open round closes at this poll (the same on every member)."""
    ready = [h.arrival / 1e6 for h in heads if h.ready]
    all_in = all(h.ready or h.done for h in heads)
    return bool(ready) and decoupled.close_time(
      ready, all_in=all_in, min_quorum=self.engine.min_quorum,
      grace_window=self._window()) <= now

  def _take_window(self, heads: list[PollHeader]) -> None:
    r"""With ``"auto"``, this poll's window from its headers: :math:`\gamma` times the least
    slack of the members whose loops have not returned (the module docstring's auto window)."""
    if self.engine.grace_window == decoupled.AUTO:
      self._auto = decoupled.auto_window(
        [h.slack / 1e6 for h in heads if h.slack != NO_SLACK and not h.done],
        self.engine.grace_gamma)

  def _window(self) -> float:
    """The grace window of this poll, in seconds: the engine's, or with ``"auto"`` the one
    this poll's headers give (the module docstring's auto window)."""
    w = self.engine.grace_window
    return self._auto if w == decoupled.AUTO else w

  def _close(self, heads: list[PollHeader], now: float) -> None:
    """The open round's payloads, decision, vote and commit; its line. If the payloads'
    broadcasts or the acknowledgement's all-gather fail (a member lost in them), the round stays
    open: the next poll's quorum is without that member. If this replica's vote fails on a round its
    decision commits (torchft's step then stays behind the others'), it does not apply the commit
    nor count the round closed: torchft heals it at the next quorum, a catch-up (module docstring,
    4.); its payload is in the merge, its loop does not land it, and its line is the others'.
    """
    r, before, f = self._closed, self._global[0], self._fragment()
    version, e = self._versions.get(f, 0), self._entry
    mine = (e.payload, e.push.payload[1]) if e is not None else self._blank(f)
    start, roots = time.monotonic(), [i for i, h in enumerate(heads) if h.ready]
    rank = next(i for i, h in enumerate(heads) if h.slot == self.slot)
    outs = self._broadcasts(pack(mine), roots, rank)
    # The acknowledgement: a member decides only once it holds every member's, so no member
    # closes a round whose payloads' broadcasts failed on another.
    if outs is None or self._allgather(torch.ones(1, dtype=torch.int64), everyone=True) is None:
      _LOG.warning("replica %d: round %d stays open: its payloads' broadcasts or their"
                   " acknowledgement failed", self.slot, r)
      return
    transport = time.monotonic() - start
    ready = [(heads[i], unpack(out, mine)) for i, out in zip(roots, outs, strict=True)]
    hs = [Header(h.slot, h.tokens, h.ok, h.fingerprint, h.step) for h, _ in ready]
    d, stale, weights = decoupled.decide_round(
      self.protocol, hs, [p[0] for _, p in ready], [h.received for h, _ in ready],
      version=version, min_replicas=self.engine.min_replicas, rule=self.engine.staleness_rule,
      max_staleness=self.engine.max_staleness, num_replicas=self.engine.num_replicas)
    self._outvoted = d.merged is not None and not self._vote()
    if d.merged is None:
      self._manager.report_error(RuntimeError(d.reason))
      self._vote()
    after = self._global
    if d.merged is not None:
      voted = [p[1] for h, p in ready if h.slot in d.voters]
      collections = None if voted[0] is None else _exchange.merge_payloads(voted)
      after = (decoupled.commit(self.protocol, before, d.merged, f), collections)
    rows = tuple((h.slot, h.step, h.weight, s, w, h.slot in d.voters)
                 for h, s, w in zip(hs, stale, weights, strict=True))
    lost = sum(h.weight for h in hs if h.slot not in d.voters)
    line = MergeLine(r, now, d.merged is not None, d.reason, version, rows, lost, "", f)
    with self._cv:  # a settle receives this close with its time (_stamp)
      if d.merged is not None and not self._outvoted:
        self._global, self._versions[f], self._rounds = after, version + 1, self._rounds + 1
      self._stamped = now
      if e is not None:  # this replica's payload was in the round
        if d.merged is None:
          self._revert = (r, f)
        elif self.slot in d.voters and self._waiting is e and not self._outvoted:
          self._landed = ((decoupled.global_state(before), d.merged, self._global[1]), f)
        elif self.slot in d.voters:  # its loop went on (or its vote failed): it lands late
          self._late = (r, f)
        self._entry = None
      self._closed, self._transport = r if self._outvoted else r + 1, transport
      merged = e is not None and self.slot in d.voters
      mark, self._heal_mark = self._heal_mark, None  # its first line after a heal
      self._unhashed.append((line, after, dict(
        replica=self.slot, weight=e.tokens if merged else 0,
        loss=e.push.loss if merged else None, healed=mark is not None, donor=mark and mark[0],
        quorum_seconds=mark[1] if mark else 0.0, pid=os.getpid())))
      if self._waiting is not None:  # its loop lands here: the round's line before its boundary
        self._write_rounds(wait=True)
      self._settle(now)  # with the close, under one lock: a loop leaving at its window
      # either lands this round or never sees it as its own (then it lands late)

  def _blank(self, fragment: int | None) -> Any:
    """The size of the round's payload for a member without one in it: zeros of the round's
    payload and collections (made once per fragment)."""
    if fragment not in self._blanks:
      g = self._global[0]
      payload = self.protocol.send_half(g.opt_state, g.params, fragment)[0]
      self._blanks[fragment] = jax.tree.map(np.zeros_like, payload), self._blank_collections
    return self._blanks[fragment]

  def _settle(self, now: float) -> None:
    """The waiting loop's outcome, once its payload's round closed (the lock held; the loop
    leaves by itself when the window runs out first)."""
    e = self._waiting
    if e is None or self._entry is e:
      return
    landed = self._landed
    # outvoted: its boundary before the close (it did not land), after the last poll's
    t = (self._time + now) / 2 if self._outvoted else now
    self._write(self.boundary_path, Boundary(self.slot, e.push.header.step, t,
                                             landed is not None, self._settled),
                pushed=e.arrival / 1e6, waited=time.time() - e.arrival / 1e6)
    self._inner = jax.tree.map(jnp.copy, heal.inner_state(e.push.replica))
    self._give(landed)

  def _give(self, landed: Any) -> None:
    """The loop's :class:`Pull` (as the in-process clock's pull; the lock held)."""
    aborted, self._revert, self._landed, self._waiting = self._revert, None, None, None
    fresh = self._closed > self._seen and landed is None
    received = (decoupled.global_state(self._global[0]), self._global[1]) if fresh else None
    f = landed[1] if landed is not None else aborted[1] if aborted is not None else None
    self._pull = Pull(landed and landed[0], received, aborted is not None, f)
    self._received, self._seen = dict(self._versions), self._closed
    self._cv.notify_all()

  @staticmethod
  def _write(path: Any, *lines: Any, **extra: Any) -> None:
    """Appends ``lines`` (their JSON objects, ``extra`` in each) in one write: a ``kill -9``
    leaves all of them or none."""
    DecoupledPort._write_each(path, [(x, extra) for x in lines])

  @staticmethod
  def _write_each(path: Any, lines: list) -> None:
    """Appends ``(line, extra)`` pairs (each line's JSON object with its ``extra``) in one
    write."""
    text = "".join(json.dumps(dict(dataclasses.asdict(x), **extra)) + "\n" for x, extra in lines)
    with open(path, "a") as f:
      f.write(text)


def check(engine: Any, protocol: Any) -> None:
  """Checks a :class:`~optax_dist.fault_tolerance.torchft_engine.Torchft` engine's decoupled
  settings (:func:`~optax_dist.fault_tolerance.decoupled.check_settings`, K bounded by its
  ``num_replicas`` if given), and ``min_replicas <= min_quorum``.

  Raises:
    ValueError: as :func:`~optax_dist.fault_tolerance.decoupled.check_settings`.
  """
  fn = "Torchft"
  decoupled.check_settings(fn, protocol, num_replicas=engine.num_replicas, speeds=None,
                           min_quorum=engine.min_quorum, grace_window=engine.grace_window,
                           staleness_rule=engine.staleness_rule,
                           max_staleness=engine.max_staleness, grace_gamma=engine.grace_gamma)
  if engine.min_replicas > engine.min_quorum:
    raise ValueError(f"`{fn}(min_replicas=...)` must be at most min_quorum={engine.min_quorum},"
                     f" got {engine.min_replicas}.")
