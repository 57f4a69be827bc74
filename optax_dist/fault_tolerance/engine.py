"""A deterministic in-process exchange engine: R replicas in one process, a scripted fault
schedule, one log line per replica and round.

Each round runs in two parts: a :class:`RoundPlan` says who does what (from the fault schedule,
or from a log when replaying), and :meth:`InProcessEngine.execute` carries it out with the
round rules of :class:`~optax_dist.fault_tolerance.RoundProtocol`. An engine over a network
(torchft's Lighthouse and ``Manager``) keeps the same rules and replaces only the plan's
source and the transport of payloads and heals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from optax_dist import _checks
from optax_dist.fault_tolerance import heal
from optax_dist.fault_tolerance.decision import Header, decide
from optax_dist.fault_tolerance.heal import global_state, heal_state, state_hash
from optax_dist.fault_tolerance.protocol import ReplicaState, RoundProtocol, Sent

KINDS = ("die_inner", "die_exchange", "join", "straggle", "die_heal", "nonfinite")


@dataclasses.dataclass(frozen=True)
class Fault:
  """One scripted event: replica ``replica`` does ``kind`` in round ``round`` (from 0).

  Attributes:
    round: the round, an int >= 0.
    replica: the replica id (its data slot), an int in ``[0, R)``.
    kind: ``"die_inner"`` (dies during the round's inner steps: not in its quorum),
      ``"die_exchange"`` (in the quorum, dies during the exchange: the round aborts on every
      member, or with ``exchange_retries`` the others try it again in a new quorum),
      ``"join"`` (a dead replica restarts under the same id: it runs no inner step that round,
      joins the quorum and heals if behind; weight 0), ``"straggle"`` (misses the join timeout:
      left out of that quorum, it reverts as on an abort), ``"die_heal"`` (dies if asked to
      donate a heal that round: the joiner takes the next up-to-date member), ``"nonfinite"``
      (its payload holds a NaN: it votes no).

  Raises:
    ValueError: a ``round`` or ``replica`` not an int >= 0, or ``kind`` not one of ``KINDS``.
  """

  round: int
  replica: int
  kind: str

  def __post_init__(self):
    for name in ("round", "replica"):
      _checks.check_non_negative_int("Fault", name, getattr(self, name))
    _checks.check_choice("Fault", "kind", self.kind, KINDS)


@dataclasses.dataclass(frozen=True)
class RoundLog:
  """One replica's line for one round (``dataclasses.asdict`` gives its JSON object).

  Attributes:
    round: the round, from 0.
    replica: the replica id.
    step: its ``local_step`` after the round (inner steps, committed or not).
    quorum_id: the engine's quorum counter: it advances when the members change.
    members: the quorum's replica ids in rank order (``()`` when left out of it).
    committed: whether the round committed on this replica.
    weight: its weight in the merge: tokens processed in the round, 0 if it healed or joined.
    healed: whether it healed from a donor this round.
    state_hash: :func:`state_hash` of its :class:`GlobalState` after the round.
    tokens: tokens it processed in the round (its inner steps × its tokens per step, or 0).
    loss: the mean of the training losses its loop reported for the round's inner steps
      (:meth:`Replica.after_step`'s ``loss``), or ``None``: none reported (this engine's own
      loop reports none).
  """

  round: int
  replica: int
  step: int
  quorum_id: int
  members: tuple
  committed: bool
  weight: int
  healed: bool
  state_hash: str
  tokens: int
  loss: float | None = None


@dataclasses.dataclass
class RoundPlan:
  """Who does what in one round (see :class:`Fault` for the events).

  Attributes:
    round: the round.
    fresh: replicas that restart from ``init`` this round (joined).
    runners: replicas that run the round's inner steps.
    members: the quorum in rank order, before donors die.
    stragglers: live replicas left out of the quorum.
    lost: members that die during the exchange.
    die_heal: replicas that die if asked to donate a heal.
    nonfinite: members whose payload holds a NaN.
    force_abort: abort whatever the vote (a replayed aborted round).
  """

  round: int
  fresh: tuple = ()
  runners: tuple = ()
  members: tuple = ()
  stragglers: tuple = ()
  lost: tuple = ()
  die_heal: tuple = ()
  nonfinite: tuple = ()
  force_abort: bool = False


class InProcessEngine:
  r"""R replicas of a fault-tolerant round protocol in one process, faults injected by script.

  Each replica holds its own :class:`ReplicaState`; they share the protocol's compiled
  functions. Replica ``i`` uses data slot ``i``: the batch of its step ``t`` (its
  ``local_step`` before the step) is ``batch_fn(seed, i, t)``, so a replica restarted under the
  same id continues its slot's stream. Per round :math:`r`:

  1. joins restart from ``init``; replicas dying in the inner steps drop out;
  2. every other live replica takes its inner steps up to the round boundary (H, or about
     :math:`H/F` for ``streaming_diloco``; the last with the local half);
  3. the quorum is the live replicas that are not straggling, by id (rank order); a member
     behind the most advanced (by committed rounds, then ``local_step``) heals from the first
     up-to-date member (the heal payload's bytes, :func:`encode_heal` then
     :func:`decode_heal`); a donor that dies is dropped and the next is asked; with none left
     the joiner is left out;
  4. with ``exchange_retries`` > 0, the members that die in the exchange leave the quorum and the
     others exchange the same payloads again in a new quorum (one retry models the torchft
     engine's, which needs a new quorum from the Lighthouse per attempt);
  5. the members with weight > 0 (tokens processed from a current state) are merged in rank
     order (:meth:`RoundProtocol.merge`); the round commits iff the quorum has at least
     ``min_replicas`` members, none died in the exchange, there is a payload and every one
     votes yes;
  6. every surviving member commits or aborts; stragglers abort; each writes a
     :class:`RoundLog` line.

  Args:
    protocol: the :class:`RoundProtocol`.
    params: the initial params (every replica's at step 0).
    grad_fn: ``(params, batch) -> grads`` (jitted here).
    batch_fn: ``(seed, slot, step) -> batch``, a stateless function of its ints.
    num_replicas: R, a positive int.
    seed: the data seed.
    tokens_per_step: the tokens of one batch, a positive int, or one per replica (slots of
      unequal batches: the merge is then token-weighted); a round's weight is its inner steps
      times it.
    min_replicas: the smallest quorum that commits; default :math:`\lfloor R/2 \rfloor + 1`.
    faults: a sequence of :class:`Fault`.
    exchange_retries: as the torchft engine's: whether (> 0) a round whose members died in
      the exchange is tried again without them; an int >= 0.

  Raises:
    TypeError: ``protocol`` not a :class:`RoundProtocol`; a fault not a :class:`Fault`.
    ValueError: ``num_replicas``, ``tokens_per_step`` (each) or ``min_replicas`` not a positive
      int, or ``min_replicas > num_replicas``; ``exchange_retries`` not an int >= 0;
      ``tokens_per_step`` not of R ints; a fault's replica >= R. In :meth:`run`: a join of a
      live replica.

  References:
    torchft (``Lighthouse`` quorums, ``Manager.should_commit``, healing from a live peer;
    ``local_sgd_integ_test.py``'s failure injection); Douillard et al., `DiLoCo
    <https://arxiv.org/abs/2311.08105>`_, 2023; the contract's "Fault-tolerant rounds".
  """

  def __init__(
    self, protocol: RoundProtocol, params: Any, grad_fn: Callable, batch_fn: Callable,
    *, num_replicas: int, seed: int = 0, tokens_per_step: int | Sequence[int] = 1,
    min_replicas: int | None = None, faults: Sequence[Fault] = (), exchange_retries: int = 0,
  ):
    fn = "InProcessEngine"
    if not isinstance(protocol, RoundProtocol):
      raise TypeError(f"`{fn}(protocol=...)` must be a RoundProtocol, got {protocol!r}.")
    _checks.check_positive_int(fn, "num_replicas", num_replicas)
    per_slot = (list(tokens_per_step) if isinstance(tokens_per_step, (list, tuple))
                else [tokens_per_step] * num_replicas)
    if len(per_slot) != num_replicas:
      raise ValueError(
        f"`{fn}(tokens_per_step=...)` must be an int or {num_replicas} ints (one per replica),"
        f" got {tokens_per_step!r}.")
    for tokens in per_slot:
      _checks.check_positive_int(fn, "tokens_per_step", tokens)
    min_replicas = num_replicas // 2 + 1 if min_replicas is None else min_replicas
    _checks.check_positive_int(fn, "min_replicas", min_replicas)
    if min_replicas > num_replicas:
      raise ValueError(
        f"`{fn}(min_replicas=...)` must be at most num_replicas={num_replicas}, got"
        f" {min_replicas}.")
    _checks.check_non_negative_int(fn, "exchange_retries", exchange_retries)
    for fault in faults:
      if not isinstance(fault, Fault):
        raise TypeError(f"`{fn}(faults=...)` must hold Fault events, got {fault!r}.")
      if fault.replica >= num_replicas:
        raise ValueError(
          f"`{fn}(faults=...)`: {fault!r} names replica {fault.replica}, but there are"
          f" {num_replicas} (ids 0 to {num_replicas - 1}).")
    self.protocol, self.params0, self.seed = protocol, params, seed
    self.grad_fn, self.batch_fn = jax.jit(grad_fn), batch_fn
    self.num_replicas, self.min_replicas = num_replicas, min_replicas
    self.tokens_per_step = per_slot
    self.faults, self.exchange_retries = tuple(faults), exchange_retries
    self.replicas: dict[int, ReplicaState | None] = {
      i: protocol.init(params) for i in range(num_replicas)}
    self.log: list[RoundLog] = []
    self.heals: list[tuple] = []  # (round, joiner, donor, joiner's global, donor's global)
    self.quorum_id, self._last_members, self.rounds_run = 0, None, 0

  # --------------------------------------------------------------------------------------------
  # Planning from the schedule.

  def run(self, num_rounds: int) -> list[RoundLog]:
    """Runs ``num_rounds`` more rounds; returns their log lines (also appended to ``log``)."""
    _checks.check_positive_int("InProcessEngine.run", "num_rounds", num_rounds)
    start = len(self.log)
    for _ in range(num_rounds):
      self.execute(self.plan(self.rounds_run))
    return self.log[start:]

  def plan(self, r: int) -> RoundPlan:
    """Round ``r``'s plan from the fault schedule and the live replicas."""
    ev = {kind: {f.replica for f in self.faults if f.round == r and f.kind == kind}
          for kind in KINDS}
    for i in sorted(ev["join"]):
      if self.replicas[i] is not None:
        raise ValueError(f"`Fault(round={r}, replica={i}, kind='join')`: replica {i} is alive.")
    alive = [i for i in range(self.num_replicas)
             if (self.replicas[i] is not None or i in ev["join"]) and i not in ev["die_inner"]]
    members = tuple(i for i in alive if i not in ev["straggle"])
    return RoundPlan(
      round=r, fresh=tuple(sorted(ev["join"])),
      runners=tuple(i for i in alive if i not in ev["join"]), members=members,
      stragglers=tuple(i for i in alive if i in ev["straggle"]),
      lost=tuple(i for i in members if i in ev["die_exchange"]),
      die_heal=tuple(sorted(ev["die_heal"])),
      nonfinite=tuple(i for i in members if i in ev["nonfinite"]))

  # --------------------------------------------------------------------------------------------
  # Carrying a plan out.

  def execute(self, plan: RoundPlan) -> list[RoundLog]:
    """Carries out one round's plan; returns its log lines."""
    for i in range(self.num_replicas):
      if i not in plan.runners + plan.fresh:
        self.replicas[i] = None
    for i in plan.fresh:
      self.replicas[i] = self.protocol.init(self.params0)
    sent = {i: self._inner_steps(i) for i in plan.runners}
    members, stragglers = list(plan.members), list(plan.stragglers)
    healed = self._heal(plan, members, stragglers)
    if plan.lost and self.exchange_retries and not plan.force_abort:
      members = self._retry(plan, members)
    if tuple(members) != self._last_members:
      self.quorum_id, self._last_members = self.quorum_id + 1, tuple(members)
    tokens = {i: self.tokens_per_step[i] * sent[i].steps for i in sent}
    weights = {i: tokens[i] if i in sent and i not in healed else 0 for i in members}
    merged = self._vote(plan, members, sent, weights)
    self._settle(plan, members, stragglers, merged, {i: sent[i] for i in sent if weights.get(i)})
    lines = [self._line(plan.round, i, tuple(members), merged is not None and i in members,
                        weights.get(i, 0), i in healed, tokens.get(i, 0))
             for i in sorted(set(members) - set(plan.lost) | set(stragglers))]
    self.log.extend(lines)
    self.rounds_run = plan.round + 1
    return lines

  def _retry(self, plan: RoundPlan, members: list) -> list:
    """The members that did not die in the exchange, in the new quorum of its retry; the lost
    die now."""
    for i in plan.lost:
      self.replicas[i] = None
    return [i for i in members if i not in plan.lost]

  def _settle(self, plan: RoundPlan, members: list, stragglers: list, merged: Any, sent: dict
              ) -> None:
    """Members commit on ``merged`` (from their ``sent``, if any) or, if it is ``None``,
    abort; members lost in the exchange die; stragglers abort."""
    for i in members:
      if i in plan.lost:
        self.replicas[i] = None
      elif merged is not None:
        self.replicas[i] = self.protocol.commit(self.replicas[i], merged, sent.get(i))
      else:
        self.replicas[i] = self.protocol.abort(self.replicas[i])
    for i in stragglers:
      self.replicas[i] = self.protocol.abort(self.replicas[i])

  def _inner_steps(self, i: int) -> Sent:
    """Replica ``i``'s round on its slot's data: batch ``(seed, i, local_step)``."""
    self.replicas[i], sent = self.protocol.run_round(
      self.replicas[i],
      lambda params, step: self.grad_fn(params, self.batch_fn(self.seed, i, step)))
    return sent

  def _key(self, i: int) -> tuple[int, int]:
    state = self.replicas[i]
    return int(state.rounds), int(state.opt_state.local_step)

  def _heal(self, plan: RoundPlan, members: list, stragglers: list) -> set:
    """Heals the members behind the most advanced; returns who healed. Dead donors leave
    ``members``; a joiner without a donor moves to ``stragglers``. Members that die in the
    exchange neither heal nor donate."""
    staying = [i for i in members if i not in plan.lost]  # the lost take no part in a heal
    if not staying:
      return set()
    best = max(self._key(i) for i in staying)
    behind = [i for i in staying if self._key(i) < best]
    healed = set()
    for j in behind:
      for d in [i for i in staying if i not in behind and i in members]:
        if d in plan.die_heal:
          members.remove(d)
          self.replicas[d] = None
          continue
        self._heal_from(plan.round, j, d)
        healed.add(j)
        break
      else:
        members.remove(j)
        stragglers.append(j)
    return healed

  def _heal_from(self, r: int, joiner: int, donor: int) -> None:
    sent = heal_state(self.replicas[donor])
    self.replicas[joiner] = heal.heal_replica(self.protocol, heal.encode_heal(sent),
                                              self.replicas[joiner], self.params0,
                                              replica=str(donor))
    self.heals.append(
      (r, joiner, donor, global_state(self.replicas[joiner]), sent.global_state))

  def _vote(self, plan: RoundPlan, members: list, sent: dict, weights: dict) -> Any:
    """The merged payload if the round commits, else ``None``: :func:`decide` on the members'
    headers (a member that dies in the exchange, or every member of a replayed aborted round,
    reports a failure) and payloads, as every engine decides."""
    heads = [Header(i, weights[i], int(not (plan.force_abort or i in plan.lost)), 0,
                    0 if self.replicas[i] is None else self._key(i)[1]) for i in members]
    payloads = [self._payload(i, sent[i].payload, plan) if weights[i] else None for i in members]
    if not heads:
      return None
    return decide(self.protocol, heads, payloads, min_replicas=self.min_replicas).merged

  @staticmethod
  def _payload(i: int, payload: Any, plan: RoundPlan) -> Any:
    if i not in plan.nonfinite:
      return payload
    return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), payload)

  def _line(self, r, i, members, committed, weight, healed, tokens) -> RoundLog:
    state = self.replicas[i]
    return RoundLog(
      round=r, replica=i, step=int(state.opt_state.local_step), quorum_id=self.quorum_id,
      members=members if i in members else (), committed=committed, weight=weight,
      healed=healed, state_hash=state_hash(global_state(state)), tokens=tokens)


def replay(engine: InProcessEngine, log: Sequence[RoundLog]) -> list[RoundLog]:
  """Runs ``log``'s rounds again on ``engine`` (a fresh one of the same settings, no faults):
  each round's plan comes from its lines alone. Equal lines mean the log replays.

  From the lines of round :math:`r`: a replica with ``tokens == 0`` restarted; the others ran
  the inner steps; ``members`` is the quorum (members without a line died in the exchange);
  a line with no members is a straggler; ``committed`` false forces the abort.

  Args:
    engine: a fresh :class:`InProcessEngine` (same protocol, params, data, seed, R,
      ``min_replicas``).
    log: the lines of a run, round by round.

  Returns:
    The replayed lines.
  """
  rounds = sorted({line.round for line in log})
  out = []
  for r in rounds:
    lines = [line for line in log if line.round == r]
    members = next((line.members for line in lines if line.members), ())
    have = {line.replica for line in lines}
    out += engine.execute(RoundPlan(
      round=r, fresh=tuple(line.replica for line in lines if line.tokens == 0),
      runners=tuple(line.replica for line in lines if line.tokens > 0), members=members,
      stragglers=tuple(line.replica for line in lines if not line.members),
      lost=tuple(i for i in members if i not in have),
      force_abort=not any(line.committed for line in lines)))
  return out


class Killed(BaseException):
  """Raised in a replica's thread of an in-process engine at the boundary of the round it dies
  in (a ``BaseException``: the user's ``except Exception`` does not catch it)."""


def nan_like(tree: Any) -> Any:
  """``tree`` with every value NaN: a scripted ``"nonfinite"`` payload (both in-process
  engines)."""
  return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), tree)
