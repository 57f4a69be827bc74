r"""The torchft engine's decoupled rounds: replicas of different speeds over one Lighthouse.

The rules are :mod:`~optax_dist.fault_tolerance.decoupled`'s (the close, the weights and
staleness, the one commit decision, the catch-up); this module is their transport over torchft
0.2.0, within what it allows (``tests/probes/decoupled_quorum.py``): a round cannot close on K
of R payloads in torchft's own terms (its Lighthouse counts askers, not payloads), so every
replica's **exchange thread** joins every quorum, at once, with ``allow_heal=False`` (torchft
never heals: a member behind keeps its params, inner state and residual), and K and the window
are a decision over the members' headers. Per **poll** (one quorum, then an all-gather of one
:class:`PollHeader` per member, sized by the process group: every member's):

1. a replica's push (its payload at its boundary, :class:`~optax_dist.fault_tolerance.
   decoupled.Push`) enters the open round at the first poll after it (its arrival: when its
   loop pushed it), with its tokens (since
   its last payload of the round's fragment that entered a round; a payload of it still open is
   replaced and its tokens carried) and the version of that fragment it last received;
2. the round closes when every live member's payload is in (a member whose loop returned is
   not live), or when at least K are and the window :math:`W` has run out since the K-th
   arrival (:func:`~optax_dist.fault_tolerance.decoupled.close_time`, on the members' wall
   clocks as their headers carry them; the poll's time is its latest header's): then every
   member all-gathers its payload (one not in the round sends zeros of its size), decides
   (:func:`~optax_dist.fault_tolerance.decoupled.decide_round`), votes (``should_commit``),
   applies a commit to its own copy of the global state and writes the round's
   :class:`~optax_dist.fault_tolerance.decoupled.MergeLine`: a late member receives every merge
   in its own polls, so its **catch-up** costs no bytes;
3. the replica's loop, at its boundary, waits until the round holding its payload closes (it
   lands it, as a synchronous round lands) or :math:`W` has passed since it pushed (it goes
   on, and catches up at a later boundary); each boundary is a
   :class:`~optax_dist.fault_tolerance.decoupled.Boundary` line at the time of the poll it
   stopped at (with a :class:`~optax_dist.fault_tolerance.decoupled.Revert` line, in the same
   file, for a payload withdrawn after an abort), so ``InProcess(replay=lines)`` runs the same
   schedule and writes the same lines.

With K = R and :math:`W = \infty` every replica waits for every payload: the synchronous round,
bit for bit. Not built: a replica that missed a round (left out of quorums after the Lighthouse's
join timeout, or restarted) needs the global state sent, or a heal: it leaves the run
(:class:`~optax_dist.fault_tolerance.torchft_session.MissedRounds`, naming the rounds) while the
others skip their polls until the Lighthouse has dropped it, then go on without it; a member
lost during a round's payload all-gather leaves the round open (each member acknowledges the
payloads it holds before it decides), and the next quorum closes it without that member; a
member whose vote (torchft's ``should_commit``) fails on a round the decision commits leaves
the run (:class:`~optax_dist.fault_tolerance.torchft_session.MissedRounds`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_dist import _exchange
from optax_dist.fault_tolerance import decoupled
from optax_dist.fault_tolerance.decision import Header
from optax_dist.fault_tolerance.decoupled import Boundary, DecoupledReplica, MergeLine, Pull, Push
from optax_dist.fault_tolerance.loop import split_donation
from optax_dist.fault_tolerance.rundir import RunDir
from optax_dist.fault_tolerance.torchft_session import (
  MissedRounds,
  Session,
  SettingsMismatch,
  pack,
  torch,
  unpack,
)

POLL_S = 0.02
"""Seconds an idle exchange thread waits for its loop's push before its next poll."""


class PollHeader(NamedTuple):
  """What a member says at each poll (int64s on the wire; times in microseconds of its wall
  clock).

  Attributes:
    slot: its replica id.
    ok: 1 unless its quorum failed.
    fingerprint: its settings fingerprint.
    ready: 1 if its payload is in the open round.
    tokens: that payload's tokens.
    step: that payload's ``local_step``.
    received: the version of the round's fragment its replica last received.
    arrival: when that payload entered the round.
    now: when it sent this header.
    done: 1 once its loop has returned.
    closed: the rounds it has closed.
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


@dataclasses.dataclass(frozen=True)
class _Entry:
  """This replica's payload in the open round (:class:`~optax_dist.fault_tolerance.clock`'s
  entry, its arrival in microseconds)."""

  arrival: int
  push: Push
  tokens: int
  payload: Any
  received: int


class DecoupledPort(Session):
  """A replica's end of the torchft engine in decoupled rounds (see the module's docstring):
  the loop's :class:`~optax_dist.fault_tolerance.decoupled.DecoupledReplica` pushes and pulls
  here, and an exchange thread polls the quorum."""

  allow_heal = False

  def __init__(self, engine: Any):
    self.engine, self.protocol, self.slot = engine, engine.protocol, engine.replica_id
    self.replica = DecoupledReplica(engine.protocol, self, slot=self.slot, seed=engine.seed,
                                    tokens_per_step=engine.tokens_per_step)
    run_dir = RunDir(engine.out)
    run_dir.replicas.mkdir(parents=True, exist_ok=True)
    self.log_path = run_dir.lines_file(self.slot)
    self.boundary_path = run_dir.replicas / f"boundaries_{self.slot}.jsonl"
    self._cv = threading.Condition()
    self._push: Push | None = None  # deposited by the loop, not entered yet
    self._pushed_at = 0  # when (microseconds): its payload's arrival
    self._pull: Pull | None = None  # the loop's outcome, not taken yet
    self._entry: _Entry | None = None
    self._waiting: _Entry | None = None  # the entry whose loop waits at its boundary
    self._done, self._error, self._thread, self._manager = False, None, None, None
    self._global: tuple[Any, Any] | None = None
    self._closed = self._seen = self._base = 0
    self._versions: dict = {}  # fragment -> its committed updates
    self._received: dict = {}  # the versions this replica last received
    self._sent: dict = {}  # fragment -> the step of this replica's last payload of it
    self._landed = self._revert = None
    self._withdrawn: int | None = None  # the step of a push withdrawn, its line not written
    self._time = 0.0  # the last poll's time (seconds)

  # The loop's side.

  def start(self, replica: Any) -> None:
    """Joins the run (``min_replica_size`` 1: K is the decision's) and starts the exchange
    thread; nothing restored (checkpoints are not read in decoupled rounds)."""
    engine = self.engine
    self._global = (jax.tree.map(jnp.copy, replica.replica_state), None)
    self._blank_collections = jax.tree.map(np.zeros_like, split_donation(replica.donation())[1])
    self._open(engine.lighthouse, engine.host, 1, engine.quorum_timeout, engine.timeout)
    if engine.on_ready is not None:
      engine.on_ready()
    self._thread = threading.Thread(target=self._polls, daemon=True)
    self._thread.start()

  def exchange(self, push: Push) -> Pull:
    """The boundary: deposits ``push`` and waits for its outcome (module docstring, 3.).

    Raises:
      Exception: the exchange thread's error (e.g. ``TimeoutError``: no quorum in time;
        :class:`~optax_dist.fault_tolerance.torchft_session.MissedRounds`).
    """
    with self._cv:
      self._push, self._pushed_at = push, time.time_ns() // 1000
      self._cv.notify_all()
      self._cv.wait_for(lambda: self._pull is not None or self._error is not None)
      if self._pull is None:
        raise self._error
      got, self._pull = self._pull, None
      return got

  def record(self, line: Any) -> None:  # the exchange thread writes the lines
    del line

  def _heal_bytes(self) -> bytes:  # torchft's heal callbacks: never called (allow_heal=False)
    return b""

  def _load(self, payload: bytes) -> None:
    raise RuntimeError("decoupled rounds: torchft healed a member (allow_heal=False)")

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

  def shutdown(self) -> None:
    if self._manager is not None:
      self._manager.shutdown(wait=False)

  # The exchange thread.

  def _polls(self) -> None:
    try:
      while self._poll():
        pass
    except BaseException as e:  # noqa: BLE001 (handed to the loop, which raises it)
      with self._cv:
        self._error = e
        self._cv.notify_all()

  def _poll(self) -> bool:
    """One poll; returns whether to go on (not once every member is done, none ready)."""
    with self._cv:
      self._cv.wait_for(lambda: self._push is not None or self._done or self._waiting,
                        POLL_S)
      self._withdrawn = self._enter() if self._withdrawn is None else self._withdrawn
      head = self._header()
    heads = self._headers(head)
    if heads is None:  # a member lost, or one behind: the next quorums are without it
      return True
    now = max(h.now for h in heads) / 1e6
    if all(h.done and not h.ready for h in heads):
      return False
    if self._due(heads, now):
      self._close(heads, now)
    with self._cv:
      if self._withdrawn is not None:  # between the closes its pull received and the next
        self._write(self.boundary_path, Boundary(self.slot, self._withdrawn,
                                                 (self._time + now) / 2, False))
        self._withdrawn = None
      self._settle(now)
      self._time = now
    return True

  def _fragment(self) -> int | None:
    return decoupled.round_fragment(self.protocol, int(self._global[0].rounds))

  def _enter(self) -> int | None:
    """The loop's push into the open round (as the in-process clock's push); a push after an
    aborted round that held this replica's payload is withdrawn at once (its step returned)."""
    push = self._push
    if push is None or self._waiting is not None:
      return None
    self._push, f = None, self._fragment()
    payload = push.payload[0]
    if f != self.protocol.fragment(push.header.step):  # the round's fragment, not its step's
      payload = self.protocol.send_half(push.replica.opt_state, push.replica.params, f)[0]
    since = self._sent.get(f, self._base)
    tokens = ((push.header.step - since) * self.engine.tokens_per_step
              + (self._entry.tokens if self._entry else 0))
    entry = _Entry(self._pushed_at, push, tokens, payload, self._received.get(f, 0))
    self._sent[f] = push.header.step
    if self._revert is not None:
      self._write(self.boundary_path, decoupled.Revert(self._revert[0], self.slot,
                                                       push.header.step, tokens))
      self._give(None)
      return push.header.step
    self._entry = self._waiting = entry
    return None

  def _header(self) -> np.ndarray:
    e = self._entry
    fields = (self.slot, int(self._manager.errored() is None), self.replica.fingerprint,
              int(e is not None), e.tokens if e else 0, e.push.header.step if e else 0,
              e.received if e else 0, e.arrival if e else 0, time.time_ns() // 1000,
              int(self._done), self._closed)
    return np.asarray(fields, np.int64)

  def _headers(self, head: np.ndarray) -> list[PollHeader] | None:
    """The quorum (``allow_heal=False``) and every member's header, checked.

    Returns:
      The members' headers; ``None`` if the all-gather failed or a member closed fewer rounds
      (it leaves: :class:`~optax_dist.fault_tolerance.torchft_session.MissedRounds`).

    Raises:
      SettingsMismatch: members of other settings.
      MissedRounds: this replica closed fewer rounds than a member (not built).
    """
    self._quorum()
    outs = self._allgather(torch.from_numpy(head), everyone=True)
    if outs is None:
      return None
    heads = [PollHeader(*out.tolist()) for out in outs]
    foreign = [h.slot for h in heads if h.fingerprint != self.replica.fingerprint]
    if foreign:
      raise SettingsMismatch(f"replicas {foreign} are of other settings (fingerprint) than"
                             f" replica {self.slot}")
    closed = {h.slot: h.closed for h in heads}
    if self._closed < max(closed.values()):
      raise MissedRounds(
        f"decoupled rounds: the members have closed {closed} rounds (replica: rounds); replica"
        f" {self.slot} missed rounds: the global state sent to it, or a heal, is not built over"
        " torchft")
    if len(set(closed.values())) > 1:  # the poll is skipped until the replicas behind leave
      return None
    return heads

  def _due(self, heads: list[PollHeader], now: float) -> bool:
    """Whether the open round closes at this poll (the same on every member)."""
    ready = [h.arrival / 1e6 for h in heads if h.ready]
    all_in = all(h.ready or h.done for h in heads)
    return bool(ready) and decoupled.close_time(
      ready, all_in=all_in, min_quorum=self.engine.min_quorum,
      grace_window=self.engine.grace_window) <= now

  def _close(self, heads: list[PollHeader], now: float) -> None:
    """The open round's payloads, decision, vote and commit; its line. If the payloads' or the
    acknowledgement's all-gather fails (a member lost in it), the round stays open: the next
    poll's quorum is without that member.

    Raises:
      MissedRounds: this replica's vote failed on a round its decision commits (the others
        commit it: it leaves rather than hold another global state).
    """
    r, before, f = self._closed, self._global[0], self._fragment()
    version, e = self._versions.get(f, 0), self._entry
    mine = (e.payload, e.push.payload[1]) if e is not None else self._blank(f)
    outs = self._allgather(pack(mine), everyone=True)
    # The acknowledgement: a member decides only once it holds every member's, so no member
    # closes a round whose payloads' all-gather failed on another.
    if outs is None or self._allgather(torch.ones(1, dtype=torch.int64), everyone=True) is None:
      return
    ready = [(h, unpack(out, mine)) for h, out in zip(heads, outs, strict=True) if h.ready]
    hs = [Header(h.slot, h.tokens, h.ok, h.fingerprint, h.step) for h, _ in ready]
    d, stale, weights = decoupled.decide_round(
      self.protocol, hs, [p[0] for _, p in ready], [h.received for h, _ in ready],
      version=version, min_replicas=self.engine.min_replicas, rule=self.engine.staleness_rule,
      max_staleness=self.engine.max_staleness)
    if d.merged is not None and not self._vote():
      raise MissedRounds(f"replica {self.slot}'s vote on round {r} failed (torchft's"
                         " should_commit), which the others commit: it leaves the run")
    if d.merged is None:
      self._manager.report_error(RuntimeError(d.reason))
      self._vote()
    if d.merged is not None:
      voted = [p[1] for h, p in ready if h.slot in d.voters]
      collections = None if voted[0] is None else _exchange.merge_payloads(voted)
      self._global = (decoupled.commit(self.protocol, before, d.merged, f), collections)
      self._versions[f] = version + 1
    rows = tuple((h.slot, h.step, h.weight, s, w, h.slot in d.voters)
                 for h, s, w in zip(hs, stale, weights, strict=True))
    lost = sum(h.weight for h in hs if h.slot not in d.voters)
    line = MergeLine(r, now, d.merged is not None, d.reason, version, rows, lost,
                     decoupled.global_hash(*self._global), f)
    with self._cv:
      if e is not None:  # this replica's payload was in the round
        if d.merged is None:
          self._revert = (r, f)
        elif self.slot in d.voters and self._waiting is e:
          self._landed = ((decoupled.global_state(before), d.merged, self._global[1]), f)
        self._entry = None
      self._closed = r + 1
      merged = e is not None and self.slot in d.voters
      self._write(self.log_path, line, replica=self.slot, weight=e.tokens if merged else 0,
                  loss=e.push.loss if merged else None, healed=False, quorum_seconds=0.0,
                  pid=os.getpid())

  def _blank(self, fragment: int | None) -> Any:
    """What a member without a payload in the round sends: zeros of the round's payload and
    collections (one buffer size in the all-gather)."""
    g = self._global[0]
    payload = self.protocol.send_half(g.opt_state, g.params, fragment)[0]
    return jax.tree.map(np.zeros_like, payload), self._blank_collections

  def _settle(self, now: float) -> None:
    """The waiting loop's outcome, once its payload's round closed or the window ran out since
    it pushed (the lock held)."""
    e = self._waiting
    if e is None or (self._entry is e and now - e.arrival / 1e6 < self.engine.grace_window):
      return
    landed = self._landed
    self._write(self.boundary_path, Boundary(self.slot, e.push.header.step, now,
                                             landed is not None))
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
  def _write(path: Any, line: Any, **extra: Any) -> None:
    with open(path, "a") as f:
      f.write(json.dumps(dict(dataclasses.asdict(line), **extra)) + "\n")


def check(engine: Any, protocol: Any) -> None:
  """Checks a :class:`~optax_dist.fault_tolerance.torchft_engine.Torchft` engine's decoupled
  settings (:func:`~optax_dist.fault_tolerance.decoupled.check_settings`, K unbounded here: the
  launcher knows R), and ``min_replicas <= min_quorum``.

  Raises:
    ValueError: as :func:`~optax_dist.fault_tolerance.decoupled.check_settings`.
  """
  fn = "Torchft"
  decoupled.check_settings(fn, protocol, num_replicas=None, speeds=None,
                           min_quorum=engine.min_quorum, grace_window=engine.grace_window,
                           staleness_rule=engine.staleness_rule,
                           max_staleness=engine.max_staleness)
  if engine.min_replicas > engine.min_quorum:
    raise ValueError(f"`{fn}(min_replicas=...)` must be at most min_quorum={engine.min_quorum},"
                     f" got {engine.min_replicas}.")
