r"""R user loops in one process, one thread each, faults injected by script.

:class:`InProcess` is the engine for tests and notebooks (no torch): it runs the user's
training function once per replica, each in a thread of its own with its own
:class:`~optax_dist.fault_tolerance.Replica`, and stands in for the quorum and the transport.
A round forms when every live replica has reached its boundary; it is decided once, in rank
order, with the same function every engine uses
(:func:`~optax_dist.fault_tolerance.decision.decide`), so the outcome does not depend on how
the threads interleave.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from optax_dist import _checks, _exchange
from optax_dist.fault_tolerance import decoupled, heal
from optax_dist.fault_tolerance.clock import Clock
from optax_dist.fault_tolerance.decision import Decision, decide
from optax_dist.fault_tolerance.engine import Fault, Killed, RoundLog, nan_like
from optax_dist.fault_tolerance.loop import Received, Replica, Sent
from optax_dist.fault_tolerance.protocol import RoundProtocol

LOOP_KINDS = ("die_inner", "join", "straggle", "nonfinite")
"""The :class:`Fault` kinds :class:`InProcess` injects."""


class InProcess:
  r"""The in-process engine: R user loops in one process, faults injected by script.

  :meth:`run` calls ``train(replica)`` for each replica id :math:`i \in [0, R)` in a thread of
  its own, with a :class:`~optax_dist.fault_tolerance.Replica` of slot :math:`i`. Rounds are
  counted as they close (from 0). A round closes once every live replica has brought its
  :meth:`Replica.after_step` to its boundary; then, in rank order (by id):

  1. a replica with a ``"die_inner"`` fault in this round dies at its boundary (its round's
     steps are lost; its thread ends); one with ``"straggle"`` is left out of the quorum and
     aborts;
  2. the quorum is the others; a member behind the most advanced (by committed rounds, then
     ``local_step``) heals from the first up-to-date member (the heal's bytes:
     :func:`encode_heal` then :func:`decode_heal`) and its weight is 0;
  3. :func:`~optax_dist.fault_tolerance.decision.decide` merges the voters' payloads (a
     ``"nonfinite"`` member's payload is replaced by NaNs) and votes; the model collections
     are averaged over the voters in rank order;
  4. a ``"join"`` fault of the next round starts ``train`` again for its (dead) replica id,
     from the loop's own beginning: it runs its first round's inner steps, then heals at its
     first boundary.

  **Decoupled rounds** (``speeds`` given; :mod:`~optax_dist.fault_tolerance.decoupled`, run by
  :class:`~optax_dist.fault_tolerance.clock.Clock`): replica :math:`i` takes an inner step every
  :math:`1/v_i` simulated seconds and does not wait at its boundary: it settles what resolved
  since its last one (a late landing, an abort, the global state of the rounds it missed: the
  global state only, its inner state and residual kept, its params moved onto the new anchor
  with its own steps kept), then pushes its payload unless its last one is still in the open
  round (one payload in flight). A round closes when every live replica's payload is in, or
  when K (``min_quorum``) are in and ``grace_window`` has run out since the K-th arrival; a
  payload is weighted by its tokens under the staleness rule. The schedule is a function of
  the speeds and the settings, not of the threads' timing. ``log`` holds
  :class:`~optax_dist.fault_tolerance.decoupled.MergeLine`,
  :class:`~optax_dist.fault_tolerance.decoupled.Revert` and the other lines of
  :func:`~optax_dist.fault_tolerance.decoupled.accounts`. With K = R, an infinite window
  and equal speeds it is the synchronous engine bit for bit. Faults: ``"nonfinite"`` (its
  round is the closed round its payload enters), ``"die_inner"`` and ``"join"`` (a joiner
  heals at its first boundary; :mod:`~optax_dist.fault_tolerance.clock`).

  Args:
    protocol: the run's :class:`RoundProtocol`.
    num_replicas: R, a positive int.
    faults: :class:`Fault` events of the kinds in :data:`LOOP_KINDS`.
    min_replicas: the smallest quorum that commits; default :math:`\lfloor R/2 \rfloor + 1`
      (decoupled rounds: the fewest payloads of weight > 0 that commit, default 1).
    seed: the data seed the replicas are given (:attr:`Replica.seed`).
    tokens_per_step: the tokens of one batch (a round's weight is its steps times it).
    speeds: ``None`` (synchronous rounds), or one speed :math:`v_i > 0` per replica, in inner
      steps per simulated second: decoupled rounds.
    min_quorum: K, the payloads that may close a decoupled round before every live replica's
      is in (default R); an int in [1, R].
    grace_window: W, simulated seconds a decoupled round stays open after its K-th arrival
      (default ``math.inf``: until every live replica's payload is in); >= 0, or ``"auto"``
      (:data:`~optax_dist.fault_tolerance.decoupled.AUTO`): ``grace_gamma`` times the slack
      (:func:`~optax_dist.fault_tolerance.decoupled.auto_window`; on this clock replica
      :math:`i`'s slack is its round's :math:`n_i / v_i` seconds, no transfer time), fixed when
      a round opens (its first payload) over the replicas live then.
    grace_gamma: :math:`\gamma` of ``grace_window="auto"``, a finite number >= 0 (default
      :data:`~optax_dist.fault_tolerance.decoupled.DEFAULT_GRACE_GAMMA`, 0.5).
    staleness_rule: the weight of a payload of staleness :math:`s` and :math:`T` tokens, one of
      :data:`~optax_dist.fault_tolerance.decoupled.STALENESS_RULES` (default
      :data:`~optax_dist.fault_tolerance.decoupled.DEFAULT_STALENESS_RULE`, ``"dylu"``:
      :math:`T / (1 + s)`).
    max_staleness: ``"age_gate"``'s bound: a payload staler than it is dropped (default 1).
    replay: a decoupled run's log (its :class:`~optax_dist.fault_tolerance.decoupled.
      MergeLine`\ s, or their JSON objects): its rounds close as logged and commit or abort as
      logged; with a real run's :class:`~optax_dist.fault_tolerance.decoupled.Boundary` and
      :class:`~optax_dist.fault_tolerance.decoupled.Heal` lines, each replica's boundaries come
      at their logged times, and a loop whose process was restarted dies after its last logged
      boundary and starts again (:mod:`~optax_dist.fault_tolerance.clock`). A synchronous
      run's lines (its :class:`RoundLog`\ s, or their JSON objects; other keys, e.g. a run
      directory's ``time``, are not read), given without ``faults``: the log's deaths, joins
      and stragglers are this run's schedule (:attr:`faults`), each round commits or aborts as
      logged (an abort's vote is not taken again; a logged commit is decided), a member behind
      heals as in the run, and each line this run writes must be the logged one: the
      contract's E3, a run with faults equals a replay of its log.

  Attributes:
    log: every replica's :class:`RoundLog` lines, in the order they were written.
    faults: the scripted faults; in a synchronous replay, those the log shows: a replica
      without a line in round :math:`r` dies in it (``"die_inner"``), one whose line has no
      members straggles, one with a line in round :math:`r` and none in :math:`r - 1` joins.
    heals: ``(round, joiner, donor)`` of each heal.
    state: after a decoupled :meth:`run`, ``(global state, collections)`` after its last
      closed round (:func:`~optax_dist.fault_tolerance.decoupled.global_state`; the round
      holding the last payloads closes after every loop returned, so no replica's returned
      state has it); else ``None``.

  Raises:
    TypeError: ``protocol`` not a :class:`RoundProtocol`; a fault not a :class:`Fault`.
    ValueError: ``num_replicas`` or ``min_replicas`` not a positive int, or ``min_replicas >
      num_replicas``; a fault's kind not in :data:`LOOP_KINDS` or its replica >= R; the
      decoupled settings as :func:`~optax_dist.fault_tolerance.decoupled.check_settings`
      raises (a protocol with ``overlap`` among them), ``min_replicas > min_quorum``, a
      decoupled setting without ``speeds``, or a ``"straggle"`` fault with ``speeds``; a
      synchronous ``replay`` with ``faults``, a line that is not a :class:`RoundLog` or its
      JSON object, a replica >= R, or two lines of one round and replica.
  """

  def __init__(self, protocol: RoundProtocol, *, num_replicas: int, faults: Sequence[Fault] = (),
               min_replicas: int | None = None, seed: int = 0, tokens_per_step: int = 1,
               speeds: Sequence[float] | None = None, min_quorum: int | None = None,
               grace_window: float | str = math.inf,
               staleness_rule: str = decoupled.DEFAULT_STALENESS_RULE,
               max_staleness: int = 1, replay: Sequence[Any] | None = None,
               grace_gamma: float = decoupled.DEFAULT_GRACE_GAMMA):
    fn = "InProcess"
    if not isinstance(protocol, RoundProtocol):
      raise TypeError(f"`{fn}(protocol=...)` must be a RoundProtocol, got {protocol!r}.")
    _checks.check_positive_int(fn, "num_replicas", num_replicas)
    if min_replicas is None:  # decoupled: K decides when a round closes; any payload commits
      min_replicas = 1 if speeds is not None else num_replicas // 2 + 1
    _checks.check_positive_int(fn, "min_replicas", min_replicas)
    if min_replicas > num_replicas:
      raise ValueError(f"`{fn}(min_replicas=...)` must be at most num_replicas={num_replicas},"
                       f" got {min_replicas}.")
    _checks.check_positive_int(fn, "tokens_per_step", tokens_per_step)
    for fault in faults:
      if not isinstance(fault, Fault):
        raise TypeError(f"`{fn}(faults=...)` must hold Fault events, got {fault!r}.")
      if fault.kind not in LOOP_KINDS or fault.replica >= num_replicas:
        raise ValueError(
          f"`{fn}(faults=...)`: {fault!r} must be of a kind in {LOOP_KINDS} and name a replica"
          f" below {num_replicas}.")
    self.protocol, self.num_replicas, self.min_replicas = protocol, num_replicas, min_replicas
    self.seed, self.tokens_per_step, self.faults = seed, tokens_per_step, tuple(faults)
    self.log: list[RoundLog] = []
    self.heals: list[tuple[int, int, int]] = []
    self.state: tuple[Any, Any] | None = None
    self.grace_gamma = grace_gamma
    self._decoupled(fn, speeds, min_quorum, grace_window, staleness_rule, max_staleness, replay)
    self._replay_schedule(fn)

  def _decoupled(self, fn: str, speeds: Any, min_quorum: Any, grace_window: Any,
                 staleness_rule: Any, max_staleness: Any, replay: Any) -> None:
    """Checks and keeps the decoupled rounds' settings (``self.speeds`` ``None``: none)."""
    self.speeds, self.replay = speeds, replay
    if speeds is None:
      settings = {"min_quorum": (min_quorum, None), "grace_window": (grace_window, math.inf),
                  "staleness_rule": (staleness_rule, decoupled.DEFAULT_STALENESS_RULE),
                  "grace_gamma": (self.grace_gamma, decoupled.DEFAULT_GRACE_GAMMA)}
      given = {k: v for k, (v, default) in settings.items() if v != default}
      if given:
        raise ValueError(f"`{fn}(speeds=...)` must be given with decoupled rounds' settings, got"
                         f" {given} without speeds.")
      return
    min_quorum = self.num_replicas if min_quorum is None else min_quorum
    self.speeds = decoupled.check_settings(
      fn, self.protocol, num_replicas=self.num_replicas, speeds=speeds, min_quorum=min_quorum,
      grace_window=grace_window, staleness_rule=staleness_rule, max_staleness=max_staleness,
      grace_gamma=self.grace_gamma)
    if self.min_replicas > min_quorum:
      raise ValueError(f"`{fn}(min_replicas=...)` must be at most min_quorum={min_quorum}, got"
                       f" {self.min_replicas}.")
    other = [f for f in self.faults if f.kind == "straggle"]
    if other:
      raise ValueError(f"`{fn}(faults=...)`: decoupled rounds have no 'straggle' faults (a slow"
                       f" replica is a speed), got {other[0]!r}.")
    auto = isinstance(grace_window, str)  # decoupled.AUTO, checked
    self.min_quorum, self.grace_window = min_quorum, grace_window if auto else float(grace_window)
    self.staleness_rule, self.max_staleness = staleness_rule, max_staleness

  def _events(self, r: int, kind: str) -> set:
    return {f.replica for f in self.faults if f.round == r and f.kind == kind}

  # --------------------------------------------------------------------------------------------
  # A synchronous run's replay (E3).

  def _replay_schedule(self, fn: str) -> None:
    """Reads a synchronous ``replay``'s lines by (round, replica) into ``self._logged``
    (``None``: no replay) and the deaths, stragglers and joins they show into :attr:`faults`."""
    self._logged: dict[tuple[int, int], RoundLog] | None = None
    if self.replay is None or self.speeds is not None:
      return
    self._logged = {}
    if self.faults:
      raise ValueError(f"`{fn}(faults=...)` must be empty with replay= (the log's deaths, joins"
                       f" and stragglers are replayed), got {self.faults[0]!r}.")
    for line in map(functools.partial(_round_log, fn), self.replay):
      if line.replica >= self.num_replicas or (line.round, line.replica) in self._logged:
        raise ValueError(f"`{fn}(replay=...)`: {line!r} must name a replica below"
                         f" {self.num_replicas}, once per round.")
      self._logged[line.round, line.replica] = line
    rounds = [{i for q, i in self._logged if q == r}
              for r in range(1 + max((q for q, _ in self._logged), default=-1))]
    self.faults = tuple(
      [Fault(r, i, "die_inner") for r, here in enumerate(rounds)
       for i in range(self.num_replicas) if i not in here]
      + [Fault(r, i, "straggle") for (r, i), line in self._logged.items() if not line.members]
      + [Fault(r, i, "join") for r, here in enumerate(rounds) if r for i in here - rounds[r - 1]])

  def _logged_outcome(self, r: int, d: Decision) -> Decision:
    """In a replay, ``d`` unless round ``r`` aborted in the log: then its abort (the vote is
    not taken again)."""
    if self._logged is None or d.merged is None or any(
        line.committed for (q, _), line in self._logged.items() if q == r):
      return d
    return d._replace(merged=None, voters=(), reason=f"round {r} aborted in the replayed log")

  def _check_line(self, line: RoundLog) -> None:
    """In a replay, raises unless ``line`` is the logged line of its round and replica, field
    for field (the lock held)."""
    if self._logged is None:
      return
    want = self._unreplayed.pop((line.round, line.replica), None)
    if want is None:
      raise RuntimeError(f"replay diverges from its log at round {line.round}: replica"
                         f" {line.replica} wrote a line the log does not have.")
    a, b = dataclasses.asdict(want), dataclasses.asdict(line)  # JSON: a NaN loss equals a NaN
    differ = {k: (a[k], b[k]) for k in a if json.dumps(a[k]) != json.dumps(b[k])}
    if differ:
      raise RuntimeError(f"replay diverges from its log at round {line.round}: replica"
                         f" {line.replica}'s line differs, (logged, replayed): {differ}.")

  def _check_replayed(self) -> None:
    """In a replay, raises if a logged line was not written again."""
    if self._unreplayed:
      r, i = min(self._unreplayed)
      raise RuntimeError(f"replay diverges from its log at round {r}: replica {i}'s logged line"
                         " was not replayed.")

  # --------------------------------------------------------------------------------------------

  def run(self, train: Callable[[Replica], Any]) -> dict[int, Any]:
    """Runs ``train(replica)`` for every replica (and again for each join) until each returns
    or dies; returns each replica id's last return value (ids whose last run died are
    missing).

    Raises:
      Exception: the first exception a replica's ``train`` raised (the others are let finish).
      ValueError: a ``"join"`` of a live replica.
      RuntimeError: a replay that diverges from its log (a line this run writes that is not the
        logged one, or a logged line it does not write), naming the round.
    """
    if self.speeds is not None:
      return Clock(self).run(train)
    self._train, self._cv = train, threading.Condition()
    self._round, self._arrived, self._results = 0, {}, {}
    self._live, self._threads, self._errors, self._returned = set(), [], [], {}
    self._quorum_count, self._last_members = 0, None
    self._unreplayed = dict(self._logged or {})
    with self._cv:
      for i in range(self.num_replicas):
        self._start(i)
    while True:
      with self._cv:
        threads = list(self._threads)
      for t in threads:
        t.join()
      with self._cv:
        if len(self._threads) == len(threads):
          break
    if self._errors:
      raise self._errors[0]
    self._check_replayed()
    return self._returned

  def _start(self, i: int) -> None:
    """Starts replica ``i``'s thread (the lock held)."""
    if i in self._live:
      raise ValueError(f"`Fault(round={self._round}, replica={i}, kind='join')`: replica {i} is"
                       " alive.")
    self._live.add(i)
    replica = Replica(self.protocol, _Port(self, i), slot=i, seed=self.seed,
                      tokens_per_step=self.tokens_per_step)
    thread = threading.Thread(target=self._main, args=(i, replica), daemon=True)
    self._threads.append(thread)
    thread.start()

  def _main(self, i: int, replica: Replica) -> None:
    try:
      self._returned[i] = self._train(replica)
    except Killed:
      self._returned.pop(i, None)
    except Exception as e:  # noqa: BLE001 (re-raised by run, after the others)
      self._errors.append(e)
    finally:
      with self._cv:
        self._live.discard(i)
        self._arrived.pop(i, None)
        self._close_if_complete()

  # --------------------------------------------------------------------------------------------

  def exchange(self, i: int, sent: Sent) -> Received:
    """Replica ``i``'s round: waits until the round closes; returns its outcome.

    Raises:
      Killed: ``i`` dies in this round.
    """
    with self._cv:
      r = self._round
      if i in self._events(r, "die_inner"):
        raise Killed
      self._arrived[i] = sent
      self._close_if_complete()
      self._cv.wait_for(lambda: (r, i) in self._results)
      return self._results.pop((r, i))

  def _close_if_complete(self) -> None:
    """Closes the round once every live replica has arrived (the lock held)."""
    if not self._arrived or set(self._arrived) != self._live:
      return
    r, arrived = self._round, dict(sorted(self._arrived.items()))
    stragglers = [i for i in arrived if i in self._events(r, "straggle")]
    members = [i for i in arrived if i not in stragglers]
    results = self._decide(r, {i: arrived[i] for i in members})
    for i in stragglers:
      results[i] = Received((), self._quorum_count, None, None, arrived[i].header.step,
                            "left out of the quorum")
    self._results.update({(r, i): got for i, got in results.items()})
    self._round, self._arrived = r + 1, {}
    for i in sorted(self._events(r + 1, "join")):
      self._start(i)
    self._cv.notify_all()

  def _decide(self, r: int, members: dict[int, Sent]) -> dict[int, Received]:
    if not members:
      return {}
    if tuple(members) != self._last_members:
      self._quorum_count, self._last_members = self._quorum_count + 1, tuple(members)
    healed = self._heal(r, members)
    heads = [s.header._replace(weight=0) if i in healed else s.header for i, s in members.items()]
    payloads = [nan_like(s.payload[0]) if i in self._events(r, "nonfinite") else s.payload[0]
                for i, s in members.items()]
    d = self._logged_outcome(r, decide(self.protocol, heads, payloads,
                                       min_replicas=self.min_replicas))
    merged = None
    if d.merged is not None:
      collections = [members[i].payload[1] for i in d.voters]
      merged = (d.merged, None if collections[0] is None
                else _exchange.merge_payloads(collections))
    return {i: Received(tuple(members), self._quorum_count, healed.get(i), merged, d.step, d.reason)
            for i in members}

  def _heal(self, r: int, members: dict[int, Sent]) -> dict:
    """Each member behind the most advanced (by committed rounds, then step), healed from the
    first up-to-date member: its decoded donation, sent as bytes naming its fingerprint
    (:func:`encode_heal`). A member of another fingerprint than the donor's is not healed (it
    would refuse the payload); the round then aborts (:func:`decide`)."""
    key = {i: (s.rounds, s.header.step) for i, s in members.items()}
    best = max(key.values())
    donor = next(i for i in members if key[i] == best)
    fingerprint = members[donor].header.fingerprint
    healed = {}
    for j in (i for i in members if key[i] < best):
      if members[j].header.fingerprint != fingerprint:
        continue
      payload = heal.encode_heal(members[donor].donation, fingerprint=fingerprint)
      healed[j] = heal.decode_heal(payload, members[j].donation, replica=str(donor),
                                   fingerprint=members[j].header.fingerprint)
      self.heals.append((r, j, donor))
    return healed


class _Port:
  """A replica's end of :class:`InProcess` (the driver's engine)."""

  def __init__(self, engine: InProcess, slot: int):
    self._engine, self._slot = engine, slot
    self.num_replicas = engine.num_replicas  # the most payloads a merge holds

  def start(self, replica: Replica) -> None:
    """Nothing to restore: a replica starts from the loop's initial state."""
    del replica

  def exchange(self, sent: Sent) -> Received:
    return self._engine.exchange(self._slot, sent)

  def record(self, line: RoundLog) -> None:
    with self._engine._cv:
      self._engine.log.append(line)
      self._engine._check_line(line)


def _round_log(fn: str, line: Any) -> RoundLog:
  """A replayed line as a :class:`RoundLog` (from its JSON object: its fields only)."""
  if isinstance(line, RoundLog):
    return line
  if isinstance(line, dict):
    kept = {f.name: line[f.name] for f in dataclasses.fields(RoundLog) if f.name in line}
    with contextlib.suppress(TypeError):
      return RoundLog(**kept | {"members": tuple(kept.get("members", ()))})
  raise ValueError(f"`{fn}(replay=...)` must hold RoundLog lines or their JSON objects, got"
                   f" {line!r}.")


ENGINES = ("in_process", "torchft")
"""The engines :func:`engine` makes."""


def engine(kind: str, protocol: RoundProtocol, *, num_replicas: int,
           faults: Sequence[Fault] = (), **options: Any) -> Any:
  """The engine ``kind`` of a fault-tolerant run of ``protocol``: the one argument a script
  switches on.

  Args:
    kind: ``"in_process"`` (:class:`InProcess`: ``num_replicas`` loops in this process, the
      scripted ``faults`` injected) or ``"torchft"`` (:class:`~optax_dist.fault_tolerance.
      torchft_engine.Torchft`: this process is one replica; its id, the Lighthouse and the run's
      directory from the environment; faults are real, not scripted, so ``faults`` is not
      read; ``min_replicas`` defaults to ``num_replicas // 2 + 1``, or 1 with
      ``decoupled=True``: the fewest payloads that commit a decoupled round).
    protocol: the run's :class:`RoundProtocol`.
    num_replicas: R, the run's replicas.
    faults: the in-process engine's :class:`Fault` script.
    **options: the engine's other keyword arguments.

  Returns:
    An engine: ``engine.run(train)`` returns ``{replica_id: train's return value}``.

  Raises:
    ValueError: ``kind`` not one of :data:`ENGINES`; the engine's own errors.
    ModuleNotFoundError: ``"torchft"`` without the ``ft`` extra.
  """
  _checks.check_choice("engine", "kind", kind, ENGINES)
  if kind == "in_process":
    return InProcess(protocol, num_replicas=num_replicas, faults=faults, **options)
  from optax_dist.fault_tolerance.torchft_engine import Torchft

  options.setdefault("min_replicas", 1 if options.get("decoupled") else num_replicas // 2 + 1)
  return Torchft(protocol, **options)
