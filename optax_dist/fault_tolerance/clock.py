r"""The in-process engine's decoupled rounds on a simulated clock.

:class:`Clock` runs R user loops (threads) as :class:`~optax_dist.fault_tolerance.InProcess`
does, but replica :math:`i` takes an inner step every :math:`1/v_i` simulated seconds, so its
boundary at ``local_step`` :math:`b` comes at :math:`b / v_i`. What happens at the boundaries
is decided on that clock, never on the threads' timing: the engine processes the replicas'
events in the order (time, phase, replica id), a thread that has not reached its next event
holding back every later one. At one time the settles come first (in id order; a replica's
push follows its own), then the ends of loops that returned, then the pulls; a round closes (:func:`~optax_dist.fault_tolerance.
decoupled.close_time`) before the first event after its close time, or at once when every live
replica's payload is in. A loop that returned counts as live until the time of the boundary
it did not reach. With ``grace_window="auto"`` a round's window is fixed when it opens (its
first payload): :math:`\gamma` times the least slack of the live replicas, each's
:math:`n_i / v_i` (:func:`~optax_dist.fault_tolerance.decoupled.auto_window`), a function of
the speeds and the schedule alone.

Faults are scripted on that clock too: a ``"die_inner"`` fault of round :math:`r` kills its
replica at its first boundary once :math:`r` rounds have closed (its payload in flight and its
steps since its last payload dropped, their tokens lost: a :class:`~optax_dist.fault_tolerance.
decoupled.Death` line); a
``"join"`` fault of round :math:`r` starts its replica's loop again when round :math:`r - 1`
closes, its clock from that close time. A joiner is not waited for until it has healed: at its
first pull it takes the global state and the inner optimizer state of the first live replica
(the donor, :func:`~optax_dist.fault_tolerance.heal.encode_heal` and ``decode_heal``), and its
first payload enters no round (weight 0, a :class:`~optax_dist.fault_tolerance.decoupled.Heal`
line).

With ``replay``, the rounds close at their logged times with their logged payloads and commit
or abort as logged (the vote is not taken again); a run that diverges from its log raises. A
real run's boundaries come at their logged times, per incarnation of a replica's loop
(:func:`~optax_dist.fault_tolerance.decoupled.boundaries`): a restarted process's loop dies
after its last logged boundary and starts again at once, a joiner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from optax_dist import _exchange
from optax_dist.fault_tolerance import decoupled, heal
from optax_dist.fault_tolerance.decoupled import DecoupledReplica, MergeLine, Pull, Push, Revert
from optax_dist.fault_tolerance.engine import Killed, nan_like
from optax_dist.fault_tolerance.protocol import ReplicaState

_PHASE = {"run": 0, "settle": 0, "push": 1, "end": 2, "pull": 3}


@dataclasses.dataclass(frozen=True)
class _Entry:
  """A payload in the open round: its arrival time, its push, the tokens it carries, the
  payload of the round's fragment and the version of that fragment at its replica's pull before
  the push."""

  time: float
  push: Push
  tokens: int
  payload: Any
  received: int


class Clock:
  """The decoupled rounds of an :class:`~optax_dist.fault_tolerance.InProcess` engine (its
  settings; its ``log`` receives the :class:`MergeLine`, :class:`Revert`,
  :class:`~optax_dist.fault_tolerance.decoupled.Death` and :class:`~optax_dist.fault_tolerance.
  decoupled.Heal` lines)."""

  def __init__(self, engine: Any):
    self.engine, self.protocol = engine, engine.protocol
    self._cv = threading.Condition()
    self._at: dict[int, list] = {}  # replica -> [time, kind] of its next event
    self._pushes: dict[int, Push] = {}
    self._steps: dict[int, int] = {}  # replica -> the local_step of its last push
    self._open: dict[int, _Entry] = {}
    self._global: tuple[ReplicaState, Any] | None = None
    self._closed, self._seen = 0, {}
    self._landed: dict[int, Any] = {}  # replica -> (what it lands, the round's fragment)
    self._late: dict[int, tuple] = {}  # replica -> (its round merged after it left, fragment)
    self._settles: dict[int, Any] = {}  # replica -> (step, token) of its settle not processed
    self._skipped: dict[int, int] = {}  # replica -> the open round at its boundary it skipped
    self._reverts: dict[int, tuple] = {}  # replica -> (aborted round, its fragment)
    self._results: dict[int, Pull] = {}
    self._killed: set[int] = set()  # the pushes (ids) at which their loop died
    self._threads, self._errors, self._returned = [], [], {}
    self._t0: dict[int, float] = {}  # replica -> the simulated time its loop (re)started at
    self._live: dict[int, DecoupledReplica] = {}  # replica -> its loop's, a joiner's after a death
    self._joining: set[int] = set()  # joiners that have not healed yet
    self._died: set = set()  # the die_inner faults done
    self._last: dict[int, Push] = {}  # replica -> its last push that entered a round
    self._versions: dict = {}  # fragment -> its committed updates
    self._received: dict[int, dict] = {}  # replica -> the versions it last received
    self._sent: dict[int, dict] = {}  # replica -> fragment -> the step of its last payload of it
    self._base: dict[int, int] = {}  # replica -> the step it started or healed at
    self._incarnation: dict[int, int] = {}  # replica -> its loop's starts, less 1
    self._failure: BaseException | None = None  # an error of the clock's: every loop stops
    self._slacks: dict[int, float] = {}  # replica -> the slack of the round after its last push
    self._grace = 0.0  # the open round's grace window
    plan, fields = engine.replay, [f.name for f in dataclasses.fields(MergeLine)]
    self._plan = None if plan is None else [
      MergeLine(**{k: line[k] for k in fields if k in line}) if isinstance(line, dict) else line
      for line in plan
      if isinstance(line, MergeLine) or (isinstance(line, dict) and "committed" in line)]
    self._times = None if plan is None else decoupled.boundaries(plan)  # a real run's
    self._settled = None if plan is None else decoupled.boundaries(plan, "settled")

  def run(self, train: Callable[[Any], Any]) -> dict[int, Any]:
    """Runs ``train(replica)`` for every replica until each returns; returns their values.

    Raises:
      Exception: the first exception a replica's ``train`` raised, or the clock's own (the
        loops still running are stopped at their next boundary).
      RuntimeError: a replay that diverges from its log.
    """
    self._train = train
    with self._cv:
      for i in range(self.engine.num_replicas):
        self._start(i, 0.0)
    joined = 0
    while joined < len(self._threads):  # a join starts a thread
      self._threads[joined].join()
      joined += 1
    if self._failure is not None or self._errors:
      raise self._failure or self._errors[0]
    if self._global is not None:  # the last round closes after every loop returned
      self.engine.state = (decoupled.global_state(self._global[0]), self._global[1])
    return self._returned

  def _start(self, i: int, t0: float) -> None:
    if i in self._at:
      raise ValueError(f"`Fault(round={self._closed}, replica={i}, kind='join')`: replica {i}"
                       " is alive.")
    replica = DecoupledReplica(self.protocol, _Port(self, i), slot=i, seed=self.engine.seed,
                               tokens_per_step=self.engine.tokens_per_step)
    self._t0[i], self._seen[i], self._live[i] = t0, self._closed, replica
    self._incarnation[i] = self._incarnation.get(i, -1) + 1
    self._received[i], self._sent[i], self._base[i] = dict(self._versions), {}, 0
    self._slacks[i] = self._slack(i, 0)
    if self._closed:  # a join: it heals at its first pull
      self._joining.add(i)
    self._at[i] = [self._time(i, self.protocol.round_steps(0)), "run"]
    thread = threading.Thread(target=self._main, args=(i, replica), daemon=True)
    self._threads.append(thread)
    thread.start()

  def _main(self, i: int, replica: DecoupledReplica) -> None:
    try:
      self._returned[i] = self._train(replica)
    except (_Stopped, Killed):
      pass
    except Exception as e:  # noqa: BLE001 (re-raised by run)
      self._errors.append(e)
    finally:
      with self._cv:
        # A dead replica's left at its death; its thread may end after its slot's joiner
        # started (a loaded machine), whose events are not its to end.
        if i in self._at and self._live[i] is replica:
          self._at[i][1] = "end"
        with contextlib.suppress(Exception):  # kept as the clock's failure, raised by run
          self._pump()

  def _time(self, i: int, step: int, times: dict | None = None) -> float:
    """Replica ``i``'s boundary at ``step``: by its speed, or as a replayed real run logged it
    (:class:`~optax_dist.fault_tolerance.decoupled.Boundary` of its loop's incarnation, its
    push's ``times``, default :attr:`_times`, or its settle's; one it did not log, its loop's
    end, never comes; if its process was restarted, its death comes at its last logged
    boundary's time)."""
    times = self._times if times is None else times
    if times is None:
      return self._t0[i] + step / self.engine.speeds[i]
    k = self._incarnation[i]
    if (i, k, step) not in times and self._restarted(i):
      return max((t for (j, n, _), t in times.items() if (j, n) == (i, k)),
                 default=self._t0[i])
    return times.get((i, k, step), math.inf)

  def _restarted(self, i: int) -> bool:
    """In a replay, whether the log holds boundaries of a later incarnation of ``i``'s loop (a
    process restarted after this one died)."""
    k = self._incarnation[i] + 1
    return self._times is not None and any((j, n) == (i, k) for j, n, _ in self._times)

  def settle(self, i: int, step: int) -> Pull | None:
    """Replica ``i``'s boundary at ``step``, before its push (in the clock's order): what
    resolved since its last boundary, ``None`` if its payload is still in the open round."""
    token = object()
    with self._cv:
      self._settles[i] = (step, token)
      self._at[i] = [self._time(i, step, self._settled), "settle"]
      return self._wait(i, token)

  def exchange(self, i: int, push: Push) -> Pull:
    """Replica ``i``'s push at its boundary, then (in the clock's order) its pull."""
    with self._cv:
      self._pushes[i], self._steps[i] = push, push.header.step
      self._at[i] = [self._time(i, push.header.step), "push"]
      return self._wait(i, None)

  def _wait(self, i: int, token: Any) -> Any:
    """Processes the events, then waits for ``i``'s result (the lock held).

    Raises:
      Killed: ``i`` died at this settle (``token``; a result for ``i`` is its joiner's).
    """
    self._pump()
    self._cv.wait_for(lambda: id(token) in self._killed or i in self._results
                      or self._failure is not None)
    if id(token) in self._killed:
      self._killed.discard(id(token))
      raise Killed
    if i not in self._results:
      raise _Stopped
    return self._results.pop(i)

  # --------------------------------------------------------------------------------------------
  # The events, in the clock's order (the lock held).

  def _pump(self) -> None:
    """Processes every event that can be, then wakes the waiting loops; an error here stops
    every loop (:attr:`_failure`)."""
    if self._failure is not None:
      return
    try:
      self._process()
    except BaseException as e:
      self._failure = e
      raise
    finally:
      self._cv.notify_all()

  def _process(self) -> None:
    while self._at:
      t, phase, i = min((t, _PHASE[kind], i) for i, (t, kind) in self._at.items())
      kind = self._at[i][1]
      if kind == "run":
        break
      self._close_due(t, phase)
      if kind == "settle":
        self._settle(i, t)
      elif kind == "push":
        self._push(i, t)
      elif kind == "end":
        self._end(i)
      else:
        self._pull(i, t)
      if kind in ("push", "end"):
        self._close_if_complete(t)
    if not self._at and self._open:  # every loop returned: the last payloads' round
      self._close(max(e.time for e in self._open.values()))

  def _settle(self, i: int, t: float) -> None:
    """``i``'s settle: its death, if due; nothing while its payload is in the open round (its
    next boundary next); else what resolved since (a late landing, an abort, the global state
    if rounds closed), and its push next, at once; after an abort, no push: its next boundary.
    """
    step, token = self._settles.pop(i)
    self._steps[i] = step
    if self._dies(i, step, token):
      if self._restarted(i):  # the restarted process: its loop from its beginning, a joiner
        self._start(i, t)
      return
    if i in self._open:
      self._results[i], self._skipped[i] = None, self._closed
      self._next(i, received=False)
      return
    late, aborted = self._late.pop(i, None), self._reverts.pop(i, None)
    fresh = (self._closed > self._seen[i] or late is not None) and i not in self._joining
    received = (decoupled.global_state(self._global[0]), self._global[1]) if fresh else None
    f = late[1] if late is not None else aborted[1] if aborted is not None else None
    self._results[i] = Pull(None, received, aborted is not None, f, late=late is not None)
    if aborted is not None:  # the steps since its payload's push are lost
      lost = self._tokens(i, step, f)
      self.engine.log.append(Revert(aborted[0], i, step, lost))
      self._sent[i][f] = step
      self._next(i)
      return
    self._seen[i] = self._closed
    self._at[i] = [self._time(i, step), "run"]

  def _push(self, i: int, t: float) -> None:
    push = self._pushes.pop(i)
    if self._global is None:  # the initial global state (copies: the loop donates its own)
      self._global = (jax.tree.map(jnp.copy, push.replica), None)
    self._at[i][1] = "pull"
    self._slacks[i] = self._slack(i, push.header.step)
    if i in self._joining:  # its first payload enters no round: it heals at its pull
      self._pushes[i] = push
      return
    f = self._fragment()
    payload = push.payload[0]
    if f != self.protocol.fragment(push.header.step):  # the round's fragment, not its step's
      payload = self.protocol.send_half(push.replica.opt_state, push.replica.params, f)[0]
    tokens = self._tokens(i, push.header.step, f)
    if not self._open:  # a round opens: its window
      self._grace = self._window()
    self._open[i] = _Entry(t, push, tokens, payload, self._received[i].get(f, 0))
    self._sent[i][f] = push.header.step
    self._last[i] = push

  def _slack(self, i: int, step: int) -> float:
    """Replica ``i``'s slack from its boundary at ``step`` (:func:`~optax_dist.fault_tolerance.
    decoupled.slack`): its inner step's :math:`1 / v_i` simulated seconds times its steps to
    its next boundary, no transfer time on this clock."""
    return decoupled.slack(1 / self.engine.speeds[i], self.protocol.round_steps(step), 0.0)

  def _window(self) -> float:
    """The grace window of a round opening now: the engine's, or with ``"auto"``
    :func:`~optax_dist.fault_tolerance.decoupled.auto_window` of the slacks of the live
    replicas that are not joining, each of the round after its last push (or its start)."""
    e = self.engine
    if e.grace_window != decoupled.AUTO:
      return e.grace_window
    live = [self._slacks[i] for i in sorted(self._at) if i not in self._joining]
    return decoupled.auto_window(live, e.grace_gamma)

  def _fragment(self) -> int | None:
    """The open round's fragment: the schedule on the committed-round counter."""
    return decoupled.round_fragment(self.protocol, int(self._global[0].rounds))

  def _tokens(self, i: int, step: int, f: int | None) -> int:
    """The tokens of ``i``'s steps up to ``step`` for fragment ``f``: those since its last
    payload of ``f`` (or its start or heal). The whole tree's: those since its last payload."""
    since = self._sent[i].get(f, self._base[i])
    return (step - since) * self.engine.tokens_per_step

  def _dies(self, i: int, step: int, token: Any) -> bool:
    """Whether ``i`` dies at its boundary at ``step`` now (a ``"die_inner"`` fault of a round
    closed or open, not done yet; in a replay, a boundary its incarnation did not log while a
    later one logged boundaries); if so, drops its payload in flight and logs its
    :class:`Death` (the tokens of that payload and of its steps since)."""
    due = [f for f in self.engine.faults if f.kind == "die_inner" and f.replica == i
           and f.round <= self._closed and f not in self._died]
    replayed = self._restarted(i) and (
      (i, self._incarnation[i], step) not in self._times)
    if not (due or replayed):
      return False
    self._died.update(due[:1])
    pending = self._open.pop(i, None)
    lost = self._tokens(i, step, self._fragment()) + (pending.tokens if pending else 0)
    self.engine.log.append(decoupled.Death(self._closed, i, step, lost))
    del self._at[i]
    for pending_outcome in (self._landed, self._reverts, self._late):
      pending_outcome.pop(i, None)
    self._joining.discard(i)
    self._killed.add(id(token))
    return True

  def _pull(self, i: int, t: float) -> None:
    if i in self._joining:
      self._heal(i)
      return
    landed, aborted = self._landed.pop(i, None), self._reverts.pop(i, None)
    flight = i in self._open  # its payload in flight: it takes nothing until it resolves
    fresh = self._closed > self._seen[i] and landed is None and not flight
    received = (decoupled.global_state(self._global[0]), self._global[1]) if fresh else None
    f = landed[1] if landed is not None else aborted[1] if aborted is not None else None
    self._results[i] = Pull(landed and landed[0], received, aborted is not None, f)
    self._received[i] = dict(self._versions)
    self._next(i, received=not flight)

  def _end(self, i: int) -> None:
    """``i``'s loop returned: the steps up to its last boundary that no payload holds (it
    skipped that boundary, its payload in flight) are lost (an :class:`~optax_dist.
    fault_tolerance.decoupled.Unsent` line, of the round open at that boundary)."""
    del self._at[i]
    last = max(self._sent[i].values(), default=self._base[i])  # its last payload's step
    lost = (self._steps.get(i, last) - last) * self.engine.tokens_per_step
    if lost > 0:
      self.engine.log.append(decoupled.Unsent(self._skipped[i], i, self._steps[i], lost))

  def _next(self, i: int, received: bool = True) -> None:
    """``i``'s boundary done (``received``: it took the closes so far): its next event is its
    next boundary."""
    if received:
      self._seen[i] = self._closed
    step = self._steps[i]
    self._at[i] = [self._time(i, step + self.protocol.round_steps(step)), "run"]

  def _heal(self, i: int) -> None:
    """Joiner ``i``'s first pull: it heals from the first live replica that has pushed (the
    donor): the global state now and the donor's inner optimizer state, encoded and decoded as
    a synchronous heal's; its first payload's tokens are lost."""
    push = self._pushes.pop(i)
    donors = [j for j in sorted(self._at) if j not in self._joining and j in self._last]
    if not donors:
      raise RuntimeError(f"replica {i} joined with no live replica to heal from.")
    donor = donors[0]
    theirs = self._last[donor]
    given = heal.HealState(heal.global_state(self._global[0]), heal.inner_state(theirs.replica))
    collections = self._global[1] if self._global[1] is not None else theirs.payload[1]
    given = given if collections is None else (given, collections)
    expected = heal.heal_state(push.replica)
    expected = expected if push.payload[1] is None else (expected, push.payload[1])
    fingerprint = push.header.fingerprint
    healed = heal.decode_heal(heal.encode_heal(given, fingerprint=fingerprint), expected,
                              replica=str(donor), fingerprint=fingerprint)
    self.engine.log.append(decoupled.Heal(self._closed, i, donor, push.header.step,
                                          push.header.weight))
    self.engine.heals.append((self._closed, i, donor))
    self._joining.discard(i)
    self._sent[i], self._base[i] = {}, push.header.step
    self._received[i] = dict(self._versions)
    self._results[i] = Pull(None, None, False, healed=healed)
    self._next(i)

  # --------------------------------------------------------------------------------------------
  # The rounds.

  def _due(self) -> float:
    """The open round's close time by its window (by its log, in a replay)."""
    if self._plan is not None:
      return self._plan[self._closed].time if self._closed < len(self._plan) else math.inf
    return decoupled.close_time([e.time for e in self._open.values()], all_in=False,
                                min_quorum=self.engine.min_quorum,
                                grace_window=self._grace)

  def _close_due(self, t: float, phase: int) -> None:
    """Closes the open round if its time has come before event ``(t, phase)``."""
    due = self._due()
    if self._open and (due < t or (due <= t and phase >= _PHASE["end"])):
      self._close(due)

  def _close_if_complete(self, t: float) -> None:
    """Closes the open round at ``t`` if every live replica's payload is in (in a replay: if
    its logged payloads are in and its time has come)."""
    if not self._open:
      return
    if self._plan is not None:
      if self._closed < len(self._plan) and self._due() <= t and self._keys() == self._logged():
        self._close(self._due())
    elif all(i in self._open for i in self._at if i not in self._joining):
      self._close(t)

  def _keys(self) -> list:
    return [(i, e.push.header.step) for i, e in sorted(self._open.items())]

  def _logged(self) -> list:
    return [tuple(p[:2]) for p in self._plan[self._closed].payloads]

  def _close(self, t: float) -> None:
    """Decides the open round at time ``t``, applies it to the global state, logs it and
    leaves each contributor's outcome for its pull."""
    r, entries = self._closed, [self._open[i] for i in sorted(self._open)]
    if self._plan is not None and (r >= len(self._plan) or self._keys() != self._logged()):
      raise RuntimeError(f"replay diverges from its log at round {r}: payloads {self._keys()}"
                         f" at time {t}.")
    before, f = self._global[0], self._fragment()
    heads = [x.push.header._replace(weight=x.tokens) for x in entries]
    version = self._versions.get(f, 0)
    d, stale, weights = self._decide(r, entries, heads, version)
    if d.merged is not None:
      voted = [x.push.payload[1] for x in entries if x.push.header.slot in d.voters]
      merged_collections = None if voted[0] is None else _exchange.merge_payloads(voted)
      self._global = (self._commit(before, d.merged, f), merged_collections)
      self._versions[f] = version + 1
    rows = tuple((h.slot, h.step, h.weight, s, w, h.slot in d.voters)
                 for h, s, w in zip(heads, stale, weights, strict=True))
    lost = sum(h.weight for h in heads if h.slot not in d.voters)
    self.engine.log.append(MergeLine(r, t, d.merged is not None, d.reason, version, rows, lost,
                                     decoupled.global_hash(*self._global), f))
    for x in entries:  # an abort reverts every contributor; one at its pull now lands
      i = x.push.header.slot
      if d.merged is None:
        self._reverts[i] = (r, f)
      elif i in d.voters and self._at.get(i) == [x.time, "pull"]:
        self._landed[i] = ((decoupled.global_state(before), d.merged, self._global[1]), f)
      elif i in d.voters:  # it went on: it lands late at its next settle
        self._late[i] = (r, f)
    self._open, self._closed = {}, r + 1
    for i in sorted(self.engine._events(r + 1, "join")):
      self._start(i, t)

  def _decide(self, r: int, entries: list, heads: list, version: int) -> tuple:
    """:func:`~optax_dist.fault_tolerance.decoupled.decide_round` of round ``r`` (a scripted
    ``"nonfinite"`` payload replaced by NaNs); in a replay, the logged outcome."""
    e = self.engine
    payloads = [nan_like(x.payload) if x.push.header.slot in e._events(r, "nonfinite")
                else x.payload for x in entries]
    d, stale, weights = decoupled.decide_round(
      self.protocol, heads, payloads, [x.received for x in entries], version=version,
      min_replicas=e.min_replicas, rule=e.staleness_rule, max_staleness=e.max_staleness,
      num_replicas=e.num_replicas)
    if self._plan is not None and not self._plan[r].committed:
      d = d._replace(merged=None, voters=(), reason=self._plan[r].reason)
    elif self._plan is not None and d.merged is None:
      raise RuntimeError(f"replay diverges from its log at round {r}: it aborts ({d.reason}).")
    return d, stale, weights

  def _commit(self, before: ReplicaState, merged: Any, fragment: int | None) -> ReplicaState:
    """The global state after a commit (:func:`~optax_dist.fault_tolerance.decoupled.commit`)."""
    return decoupled.commit(self.protocol, before, merged, fragment)


class _Stopped(BaseException):
  """Raised in a loop at its boundary when the clock failed (a ``BaseException``: the user's
  ``except Exception`` does not catch it)."""


class _Port:
  """A replica's end of :class:`Clock`."""

  def __init__(self, clock: Clock, slot: int):
    self._clock, self._slot = clock, slot
    self.num_replicas = clock.engine.num_replicas  # the most payloads a merge holds

  def start(self, replica: Any) -> None:
    """Nothing to restore: a replica starts from the loop's initial state."""
    del replica

  def settle(self, step: int) -> Pull | None:
    return self._clock.settle(self._slot, step)

  def exchange(self, push: Push) -> Pull:
    return self._clock.exchange(self._slot, push)

  def record(self, line: Any) -> None:  # the clock writes the lines
    del line
