r"""Decoupled rounds: replicas of different speeds, none waiting for the slowest.

The rules of the contract's "Decoupled rounds", pure and engine-agnostic (an engine supplies
the clock and the transport; :class:`~optax_dist.fault_tolerance.InProcess` runs them on a
simulated clock):

* **close** (:func:`close_time`): a round closes when every live replica's payload is in, or
  when at least K (``min_quorum``) are in and the grace window :math:`W`, counted from the
  K-th arrival, has run out;
* **fragments** (:func:`round_fragment`): a round is one fragment's exchange (the whole tree's
  for ``diloco`` and ``local_sgd``); the fragment schedule runs on the committed-round counter,
  and each fragment has its own version (its committed updates);
* **weight and staleness** (:func:`staleness`, :func:`weights`): payload :math:`i` of fragment
  :math:`f` carries :math:`T_i`, the tokens its replica processed since its last payload of
  :math:`f` (or its start or heal; the whole tree's: since its last payload), and
  :math:`s_i = v - v_i`, the committed updates of :math:`f` between the version :math:`v_i`
  it last received and the version :math:`v` it is merged into; the staleness rule gives its weight
  :math:`w_i`, and the merge is :math:`\sum_i w_i \Delta_i / \sum_i w_i` over the round's
  contributors in rank order (:func:`decide_round`, through the one commit decision
  :func:`~optax_dist.fault_tolerance.decision.decide`);
* **state split** (:func:`global_state`, :func:`catch_up`, :func:`rebased`): ``local_step``
  and the data position are each replica's own; the global state is the anchor, the outer
  state, the committed-round counter (a whole-tree round's version), the model average and the
  model collections. A catch-up takes the global state only: the replica keeps its inner state
  and residual and moves its params onto the new anchor with its own steps kept,
  :math:`\theta \leftarrow x_{\mathrm{new}} + (\theta - x_{\mathrm{old}})`, so its next
  payload :math:`\Delta_i = x_{\mathrm{new}} - \theta` holds its own steps and none of the
  others'; a **late landing** (its own payload merged after it went on) keeps only the steps
  since that payload's send, :math:`\theta \leftarrow x_{\mathrm{new}} + (\theta -
  \theta_b)`, so no step enters two merges.

:class:`DecoupledReplica` is the replica's side: at each of its round boundaries it settles what
resolved since its last one, then pushes its payload, one payload in flight (:class:`Push`,
:class:`Pull`). Each closed round is one :class:`MergeLine` (its JSON line); a member whose
payload's round aborted reverts and pushes nothing at that boundary (:class:`Revert`); a
replica that dies drops its payloads (:class:`Death`); a loop that returns with steps no payload
holds leaves them unsent (:class:`Unsent`); a joiner heals at its first boundary
(:class:`Heal`: the global state and a donor's inner optimizer state, as a synchronous heal
sends them; not a catch-up).

References:
  Decoupled DiLoCo, `arXiv:2604.21428 <https://arxiv.org/abs/2604.21428>`_ (minimum quorum
  K, a grace window, token-weighted contributions); Liu et al., `Asynchronous Local-SGD
  <https://arxiv.org/abs/2401.09135>`_, 2024 (delayed Nesterov, DyLU).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from optax_dist import _checks
from optax_dist._delayed_nesterov import DelayedNesterovState
from optax_dist.fault_tolerance import heal
from optax_dist.fault_tolerance.decision import Decision, Header, decide
from optax_dist.fault_tolerance.loop import (
  Replica,
  RoundResult,
  copied,
  get_parts,
  mean_loss,
  placed_as,
)
from optax_dist.fault_tolerance.protocol import ReplicaState, RoundProtocol

STALENESS_RULES = ("none", "dylu", "age_gate", "delayed_nesterov", "token_share")
r"""The staleness rules :func:`weights` applies (``T`` tokens, ``s`` staleness):
``"none"``: :math:`w = T`; ``"dylu"``: :math:`w = T / (1 + s)`; ``"age_gate"``:
:math:`w = T` if :math:`s \le` ``max_staleness`` else 0 (the payload is dropped, its tokens
lost); ``"delayed_nesterov"``: :math:`w = T`, the protocol's outer optimizer being
:func:`optax_dist.delayed_nesterov`; ``"token_share"``: :math:`w = T` and the merge divided by
the tokens of a full round, R payloads of the largest voter's tokens, instead of the voters'
sum, :math:`\sum_i T_i \Delta_i / (R \max_j T_j)`: a merge of fewer payloads moves the anchor
by its share of a round, as asynchronous Local-SGD's server steps by :math:`1/N` per worker's
update (Liu et al. 2024); with every payload in and equal tokens it is the mean, bit for bit."""

DEFAULT_STALENESS_RULE = "dylu"
"""The staleness rule when none is named (``InProcess``, ``Torchft``): one that takes any outer
optimizer and any engine (``"delayed_nesterov"`` refuses every protocol whose outer optimizer is
not :func:`optax_dist.delayed_nesterov`; ``"token_share"`` needs ``num_replicas``, which
``Torchft`` does not require). When rounds close on fewer than R payloads, use
``"token_share"`` with an outer optimizer without momentum: at the speeds the torchft benchmark
measures (1 : 0.976 : 0.475 : 0.231, ``diloco`` on ``lm``, K = 1, outer SGD at 1.4, seeds 0, 1,
2) it is 0.5% below synchronous rounds at equal committed tokens with W = 0 and 0.9% above them
with a window of half the slack, where ``"dylu"`` is 19.4% and 1.5% above
(``benchmarks/results/decoupled_staleness_w0.md``, ``decoupled_staleness.md``). At the torchft
benchmark's length (the fastest replica's 1,120 steps) it ends at most 1.8% above them with
W = 0 but 7.9% to 10.3% above with the window (``decoupled_staleness_long.md``,
``decoupled_staleness_long_w10.md``)."""


AUTO = "auto"
r"""``grace_window=AUTO``: the window of each round is :func:`auto_window`, :math:`\gamma` times
the measured slack (:func:`slack`)."""

DEFAULT_GRACE_GAMMA = 0.5
r""":math:`\gamma` when none is given: a window of half the slack, the windowed in-process
study's setting (``benchmarks/studies/decoupled_staleness.py --gamma 0.5``,
``benchmarks/results/decoupled_staleness.md``); Decoupled DiLoCo's Eq. 3 bounds the window by
:math:`\gamma` times the slack, and no value of its own is taken here."""


# ----------------------------------------------------------------------------------------------
# The settings.


def check_settings(fn: str, protocol: RoundProtocol, *, num_replicas: int | None, speeds: Any,
                   min_quorum: Any, grace_window: Any, staleness_rule: Any,
                   max_staleness: Any,
                   grace_gamma: Any = DEFAULT_GRACE_GAMMA) -> tuple[float, ...] | None:
  """Checks a decoupled run's settings; returns the speeds as floats (``None``: not checked, an
  engine of real replicas, whose ``num_replicas`` may be ``None``: K not bounded by it here).

  Raises:
    ValueError: ``speeds`` not one finite number > 0 per replica; ``min_quorum`` not an int
      in [1, R]; ``grace_window`` not a number >= 0 (``math.inf`` allowed) nor :data:`AUTO`;
      ``grace_gamma`` not a finite number >= 0; ``staleness_rule``
      not one of :data:`STALENESS_RULES`; ``"token_share"`` without ``num_replicas``;
      ``max_staleness`` not an int >= 0; a ``protocol``
      with ``overlap``;
      ``"delayed_nesterov"`` with an outer optimizer that is not
      :func:`optax_dist.delayed_nesterov`.
    TypeError: ``min_quorum`` or ``max_staleness`` not an int; ``grace_window`` or
      ``grace_gamma`` not a number (nor :data:`AUTO`).
  """
  values = () if isinstance(speeds, (str, bytes)) or not hasattr(speeds, "__iter__") else (
    tuple(speeds))
  if speeds is not None and (len(values) != num_replicas or not all(
      isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 < v < math.inf
      for v in values)):
    raise ValueError(f"`{fn}(speeds=...)` must be one finite number > 0 per replica"
                     f" ({num_replicas}), got {speeds!r}.")
  if protocol.overlap:
    raise ValueError(f"`{fn}(protocol=...)` must have overlap=0 for decoupled rounds (each"
                     " replica's local_step is its own there: no landing step is common), got"
                     f" overlap={protocol.overlap}.")
  _checks.check_positive_int(fn, "min_quorum", min_quorum)
  if num_replicas is not None and min_quorum > num_replicas:
    raise ValueError(f"`{fn}(min_quorum=...)` must be at most num_replicas={num_replicas},"
                     f" got {min_quorum}.")
  if not (isinstance(grace_window, str) and grace_window == AUTO):
    _checks.check_number(fn, "grace_window", grace_window, lower=0.0,
                         constraint=f"a number of seconds >= 0 (math.inf allowed) or {AUTO!r}")
  _checks.check_number(fn, "grace_gamma", grace_gamma, lower=0.0, upper=sys.float_info.max,
                       constraint="a finite number >= 0")
  _checks.check_choice(fn, "staleness_rule", staleness_rule, STALENESS_RULES)
  if staleness_rule == "token_share" and num_replicas is None:
    raise ValueError(f"`{fn}(staleness_rule='token_share')` needs num_replicas (R: its"
                     " divisor is R times the largest voter's tokens), got None.")
  _checks.check_non_negative_int(fn, "max_staleness", max_staleness)
  outer_state = (jax.eval_shape(protocol.outer_tx.init, jnp.zeros([1]))
                 if staleness_rule == "delayed_nesterov" else None)
  if outer_state is not None and not isinstance(outer_state, DelayedNesterovState):
    raise ValueError(
      f"`{fn}(staleness_rule='delayed_nesterov')` needs RoundProtocol(outer="
      f"optax_dist.delayed_nesterov(...)), got an outer optimizer whose state is"
      f" {jax.tree_util.tree_structure(outer_state)}.")
  return None if speeds is None else tuple(float(v) for v in values)


# ----------------------------------------------------------------------------------------------
# The rules.


def close_time(arrivals: Sequence[float], *, all_in: bool, min_quorum: int,
               grace_window: float) -> float:
  r"""When the open round closes, given what is known now.

  .. math::

    t_{\mathrm{close}} = \begin{cases}
      \max_i a_i & \text{every live replica's payload is in} \\
      a_{(K)} + W & \text{at least } K \text{ payloads are in} \\
      \infty & \text{otherwise}
    \end{cases}

  (the smaller of the first two when both hold), with :math:`a_{(K)}` the K-th smallest
  arrival time. In simulated seconds.

  Args:
    arrivals: the arrival times of the payloads in the open round (one per replica).
    all_in: whether every live replica has a payload in it.
    min_quorum: K.
    grace_window: W (``math.inf``: wait for every live replica).
  """
  if not arrivals:
    return math.inf
  times = sorted(arrivals)
  close = times[-1] if all_in else math.inf
  if len(times) >= min_quorum:
    close = min(close, times[min_quorum - 1] + grace_window)
  return close


def slack(step_seconds: float, steps: int, transport_seconds: float) -> float:
  r"""A replica's slack: the seconds its exchange leaves idle before its next boundary.

  .. math::

    \xi_i = c_i \, n_i - x_i

  with :math:`c_i` its inner step's seconds, :math:`n_i` its inner steps from its boundary to
  its next (:meth:`RoundProtocol.round_steps`) and :math:`x_i` the seconds of its round's
  exchange (its transport); negative when the exchange takes longer than the steps beside it.
  The in-process clock's: :math:`c_i = 1 / v_i`, :math:`x_i = 0`; the torchft engine's:
  measured (:mod:`~optax_dist.fault_tolerance.torchft_decoupled`). In seconds.
  """
  return step_seconds * steps - transport_seconds


def auto_window(slacks: Sequence[float], gamma: float) -> float:
  r"""The grace window of ``grace_window=AUTO``: :math:`\gamma` times the slack of the tightest
  member (Decoupled DiLoCo's Eq. 3, :math:`\xi_{\mathrm{grace}} \le \gamma \,
  \xi_{\mathrm{slack}}`).

  .. math::

    W = \gamma \max\bigl(0, \min_i \xi_i\bigr)

  over the members' slacks :math:`\xi_i` (:func:`slack`, in seconds); 0 without any: no
  slack is known, so no replica's idle time is there to wait in. The minimum is the fastest
  replica's slack at equal steps and transport: a wider window keeps it waiting. In seconds;
  a function of the list alone, so every member given the same list decides the same window.
  """
  return gamma * max(0.0, min(slacks)) if slacks else 0.0


def round_fragment(protocol: RoundProtocol, committed: int) -> int | None:
  """The fragment of the round after ``committed`` committed rounds: the fragment schedule
  (:meth:`RoundProtocol.fragment` at each round boundary from step 0) run on the committed-round
  counter, not on a replica's ``local_step`` (``None``: the whole tree)."""
  step = 0
  for _ in range(committed + 1):
    step += protocol.round_steps(step)
  return protocol.fragment(step)


def staleness(version: int, received: int) -> int:
  """A payload's staleness: the committed updates of its fragment between ``received`` (the
  version its replica last received) and ``version`` (the one it is merged into)."""
  return version - received


def weights(rule: str, tokens: Sequence[int], stale: Sequence[int], *,
            max_staleness: int) -> list[float]:
  """The contributors' merge weights under ``rule`` (:data:`STALENESS_RULES`), before the
  merge normalises them over the contributors."""
  if rule == "dylu":
    return [t / (1 + s) for t, s in zip(tokens, stale, strict=True)]
  if rule == "age_gate":
    return [t if s <= max_staleness else 0 for t, s in zip(tokens, stale, strict=True)]
  return list(tokens)


def decide_round(protocol: RoundProtocol, heads: Sequence[Header], payloads: Sequence[Any],
                 received: Sequence[int], *, version: int, min_replicas: int, rule: str,
                 max_staleness: int, num_replicas: int | None = None
                 ) -> tuple[Decision, list[int], list[float]]:
  """A closed round's outcome: the staleness rule's weights, then the one commit decision.

  Args:
    protocol: the run's :class:`RoundProtocol`.
    heads: the contributors' headers in rank order (``weight``: their tokens; ``step``:
      their own ``local_step``, not compared across replicas).
    payloads: their payloads, in the same order.
    received: the version each contributor's replica last received.
    version: the fragment's committed updates before this round.
    min_replicas: the fewest contributors with weight > 0 that commit.
    rule: the staleness rule, one of :data:`STALENESS_RULES`.
    max_staleness: the age gate's bound.
    num_replicas: R (``"token_share"``'s divisor is R times the largest voter's tokens).

  Returns:
    ``(decision, staleness, weights)``: :func:`~optax_dist.fault_tolerance.decision.decide`'s
    :class:`Decision` over the contributors with weight > 0 (``voters``), each contributor's
    staleness and weight.
  """
  stale = [staleness(version, v) for v in received]
  w = weights(rule, [h.weight for h in heads], stale, max_staleness=max_staleness)
  voting = [h._replace(weight=x, step=0) for h, x in zip(heads, w, strict=True)]
  kept = sum(x > 0 for x in w)
  if kept < min_replicas:  # the age gate left too few
    return Decision(None, (), 0, f"{kept} payloads of weight > 0, fewer than"
                    f" min_replicas={min_replicas}"), stale, w
  total = num_replicas * max(w) if rule == "token_share" else None
  return decide(protocol, voting, payloads, min_replicas=min_replicas, total=total), stale, w


def commit(protocol: RoundProtocol, before: ReplicaState, merged: Any,
           fragment: int | None) -> ReplicaState:
  """The global state after a commit: the outer half of ``fragment`` on ``merged`` applied to
  ``before`` (the same compiled program as a landing replica's, so the same bits); only its
  :func:`global_state` is read."""
  params, opt_state, average = protocol.outer_half(
    before.params, before.params, before.opt_state, before.average, merged,
    before.opt_state.error_feedback if protocol.error_feedback else None, fragment)
  return ReplicaState(params, opt_state, before.rounds + 1, average)


# ----------------------------------------------------------------------------------------------
# The state split.


def global_state(replica: ReplicaState) -> heal.GlobalState:
  """A decoupled run's global state: :func:`~optax_dist.fault_tolerance.heal.global_state`
  without ``local_step`` (each replica's own here)."""
  state = heal.global_state(replica)
  return state._replace(opt_state=state.opt_state._replace(local_step=None))


def global_hash(replica: ReplicaState, collections: Any = None) -> str:
  """:func:`~optax_dist.fault_tolerance.heal.state_hash` of :func:`global_state` (with the
  model collections, if any)."""
  tree = global_state(replica)
  return heal.state_hash(tree if collections is None else (tree, collections))


def catch_up(replica: ReplicaState, received: heal.GlobalState) -> ReplicaState:
  """``replica`` with a received :func:`global_state` taken bit for bit: anchor, outer state,
  committed rounds and average; its params, inner state, residual and ``local_step`` kept."""
  opt_state = jax.tree.map(lambda g, mine: mine if g is None else g, received.opt_state,
                           replica.opt_state, is_leaf=lambda x: x is None)
  return ReplicaState(replica.params, opt_state, received.rounds, received.average)


def rebased(protocol: RoundProtocol, replica: ReplicaState, received: heal.GlobalState,
            flight: tuple | None = None, fragment: int | None = None) -> ReplicaState:
  r"""``replica`` on a received global state, its own steps kept: the global state taken
  (:func:`catch_up`) and its params moved by the anchor's change,
  :math:`\theta \leftarrow x_{\mathrm{new}} + (\theta - x_{\mathrm{old}})`
  (:attr:`RoundProtocol.rebase`), so its next payload, measured from :math:`x_{\mathrm{new}}`,
  holds its own steps since :math:`x_{\mathrm{old}}` and none of the merged ones. With
  ``flight`` its payload in flight was merged into a committed round of ``fragment`` after it
  went on (a **late landing**): on that fragment's leaves the steps kept are those since the
  payload's send, :math:`\theta \leftarrow x_{\mathrm{new}} + (\theta - \theta_b)`, and
  its residual candidate is taken.

  Args:
    protocol: the run's :class:`RoundProtocol`.
    replica: its state now (params, inner state, residual; its anchor :math:`x_{\mathrm{old}}`).
    received: the global state now (:func:`global_state`).
    flight: ``(state, residual, fragment)`` of its push: its state at the send (the params
      :math:`\theta_b`), its residual candidate and the fragment it was measured for.
    fragment: the merged round's fragment (with ``flight``).
  """
  caught = catch_up(replica, received)
  sent = None if flight is None else flight[0].params
  params = protocol.rebase(replica.params, sent, (replica.opt_state, replica.average),
                           (caught.opt_state, caught.average), fragment)
  opt_state = caught.opt_state
  if flight is not None and protocol.error_feedback:
    state, residual, measured = flight
    if fragment != measured:  # the round's fragment: its residual candidate
      residual = protocol.send_half(state.opt_state, state.params, fragment)[1]
    opt_state = opt_state._replace(error_feedback=residual)
  return caught._replace(params=params, opt_state=opt_state)


# ----------------------------------------------------------------------------------------------
# The log.


@dataclasses.dataclass(frozen=True)
class MergeLine:
  """One closed round of a decoupled run (``dataclasses.asdict`` gives its JSON object).

  Attributes:
    round: the closed round, from 0 (committed or aborted).
    time: its close time, in simulated seconds.
    committed: whether it committed.
    reason: why it aborted (``""`` on a commit).
    version: its fragment's committed updates before it (the version its merge is applied
      to; the whole tree's: the committed rounds).
    payloads: one ``(replica, step, tokens, staleness, weight, merged)`` per contributor, in
      rank order: its replica, the ``local_step`` it was sent at, the tokens it carries, its
      staleness, its weight under the staleness rule (before normalisation) and whether it is
      in the merge.
    lost: the tokens of the payloads not merged (all of them on an abort; age-gated ones).
    state_hash: :func:`global_hash` of the global state after the round.
    fragment: the round's fragment (:func:`round_fragment`; ``None``: the whole tree).
  """

  round: int
  time: float
  committed: bool
  reason: str
  version: int
  payloads: tuple
  lost: int
  state_hash: str
  fragment: int | None = None


@dataclasses.dataclass(frozen=True)
class Boundary:
  """A replica's boundary on an engine of real replicas (:class:`~optax_dist.fault_tolerance.
  torchft_engine.Torchft`): the times, on its :class:`MergeLine`\\ s' clock, at which its
  settle, push and pull count; ``InProcess(replay=...)`` runs a boundary logged so at its times
  instead of the one its speed gives.

  Attributes:
    replica: the replica.
    step: its ``local_step`` at the boundary.
    time: the time its push and pull count at: the close of the round it landed in, else a
      time after the closes its pull received and before the next.
    landed: whether it landed a round.
    settled: the time its settle counts at, after the closes it received there and before the
      next (``None``: ``time``; a settle and its push are apart when rounds close between them).
  """

  replica: int
  step: int
  time: float
  landed: bool
  settled: float | None = None


def boundaries(lines: Sequence[Any], field: str = "time"
               ) -> dict[tuple[int, int, int], float] | None:
  """``(replica, incarnation, step) -> time`` of the :class:`Boundary` lines (or their JSON
  objects) among ``lines`` (``field="settled"``: their settles' times); ``None`` if there are
  none. A replica's incarnation is the number of
  its :class:`Heal` lines before the boundary's, in the order given (a restarted process heals
  at its first boundary, and its ``local_step`` starts again at 0).

  A process killed after a round's payloads were all-gathered and before it wrote its boundary
  line leaves a :class:`MergeLine` among ``lines`` (a survivor's) holding a payload of it whose
  boundary is not logged: the first such payload of an incarnation, past its last logged
  boundary, is at that round's close time (its loop was waiting for that round, so its boundary
  would have been written at that poll). The incarnation of a round's payload is the number of
  its replica's :class:`Heal` lines of an earlier or the same round (a restarted process's
  payloads enter rounds from its heal's round on, its predecessor's before it)."""
  found, healed, heal_rounds, rounds = {}, Counter(), {}, []
  for line in map(_parsed, lines):
    if isinstance(line, MergeLine):
      rounds.append(line)
    elif isinstance(line, Heal):
      healed[line.replica] += 1
      heal_rounds.setdefault(line.replica, []).append(line.round)
    elif isinstance(line, Boundary):
      at = getattr(line, field)
      found[line.replica, healed[line.replica], line.step] = line.time if at is None else at
  return _unwritten(found, rounds, heal_rounds) if found else None


def _parsed(line: Any) -> Any:
  """A JSON object of a :class:`MergeLine`, :class:`Boundary`, :class:`Heal` or :class:`Revert`
  as one (by its keys; a :class:`Death` line's, of the same keys, as a ``Revert``); any other
  line as given."""
  if not isinstance(line, dict):
    return line
  for kind in (MergeLine, Boundary, Heal, Revert):
    names = {f.name for f in dataclasses.fields(kind) if f.default is dataclasses.MISSING}
    if names <= set(line) and (kind is MergeLine) == ("committed" in line):
      return kind(**{f.name: line[f.name] for f in dataclasses.fields(kind) if f.name in line})
  return line


def _unwritten(found: dict, rounds: list, heal_rounds: dict) -> dict:
  """``found`` with the boundary a kill left unwritten, of each incarnation at most one
  (:func:`boundaries`)."""
  done = set()
  for line in sorted(rounds, key=lambda x: x.round):
    for replica, step, *_ in line.payloads:
      key = (replica, bisect.bisect_right(heal_rounds.get(replica, []), line.round))
      last = max((s for i, n, s in found if (i, n) == key), default=-1)
      if step > last and key not in done:
        found[(*key, step)] = line.time
        done.add(key)
  return found


@dataclasses.dataclass(frozen=True)
class Revert:
  """A member that learned at its settle that the round holding its payload aborted: its
  params of the round's fragment went back to the anchor, the tokens of its steps since that
  payload lost (it pushes nothing at that boundary).

  Attributes:
    round: the aborted round.
    replica: the member.
    step: its ``local_step`` at the revert.
    lost: the tokens of its steps since the aborted payload.
  """

  round: int
  replica: int
  step: int
  lost: int


@dataclasses.dataclass(frozen=True)
class Death:
  """A replica whose loop died at its boundary (a scripted ``"die_inner"``): its payload in
  flight and its steps since its last payload were dropped, their tokens lost.

  Attributes:
    round: the open round when it died.
    replica: the replica.
    step: its ``local_step`` at its death.
    lost: the dropped tokens.
  """

  round: int
  replica: int
  step: int
  lost: int


@dataclasses.dataclass(frozen=True)
class Unsent:
  """A replica whose loop returned after a boundary it skipped (its payload in flight then):
  its steps since its last payload entered no round, their tokens lost.

  Attributes:
    round: the open round at that boundary.
    replica: the replica.
    step: its ``local_step`` at that boundary.
    lost: the tokens of its steps since its last payload.
  """

  round: int
  replica: int
  step: int
  lost: int


@dataclasses.dataclass(frozen=True)
class Heal:
  """A joiner (a scripted ``"join"``: its loop started again with no usable state) healed at
  its first boundary: it took the global state and the donor's inner optimizer state, and its
  first payload has weight 0 (it enters no merge; its tokens are lost).

  Attributes:
    round: the open round when it healed.
    replica: the joiner.
    donor: the replica whose inner optimizer state it took.
    step: its ``local_step`` at the heal (its own: the data position is local).
    lost: its first payload's tokens.
  """

  round: int
  replica: int
  donor: int
  step: int
  lost: int


@dataclasses.dataclass(frozen=True)
class CatchUp:
  """A live replica of an engine of real replicas that closed fewer rounds than its quorum's
  members (left out of their quorums) took the global state from one of them (the donor):
  anchor, outer state, committed and closed rounds and the fragments' versions. Its params,
  inner state, residual and ``local_step`` are its own; its loop takes the global state at its
  next pull, as a late replica's (:func:`catch_up`).

  Attributes:
    round: the next round to close (the donor's closed rounds).
    replica: the replica.
    donor: the member it took the global state from (-1: unknown).
    missed: the rounds closed without it.
    rounds: the committed rounds it now holds.
  """

  round: int
  replica: int
  donor: int
  missed: int
  rounds: int



def accounts(lines: Sequence[Any]) -> dict[int, dict[str, int]]:
  """Each replica's tokens as a decoupled run's lines count them (:class:`MergeLine`,
  :class:`Revert`, :class:`Death`, :class:`Unsent` and :class:`Heal` lines, or their JSON
  objects; other lines are not read; the first line of each round, so every replica's copy of a
  round's line may be given): ``merged``, those of its payloads merged into a committed round,
  and ``lost``, those of its payloads in no merge (an aborted round's, an age-gated one's) and
  of its ``Revert``, ``Death``, ``Unsent`` and ``Heal`` lines.

  Every token a replica's loop processed up to its last boundary is in exactly one of the two:
  ``merged + lost`` is its inner steps (of all its loops, a joiner's too) times its tokens per
  step. A process killed outside its boundaries (``kill -9`` over torchft) writes no ``Death``
  line: its steps since its last boundary are left out, and its payload at that boundary too if
  no round line holds it; ``InProcess(replay=...)`` of its log writes that ``Death`` line.

  Returns:
    ``{replica: {"merged": tokens, "lost": tokens}}``, by replica id in order.
  """
  merged, lost, rounds = Counter(), Counter(), set()
  for line in lines:
    x = dataclasses.asdict(line) if dataclasses.is_dataclass(line) else line
    if "committed" in x and x["round"] not in rounds:
      rounds.add(x["round"])
      for replica, _, tokens, _, _, into in x["payloads"]:
        (merged if into else lost)[replica] += tokens
    elif "committed" not in x and "lost" in x:  # a Revert, Death, Unsent or Heal line
      lost[x["replica"]] += x["lost"]
  return {i: {"merged": merged[i], "lost": lost[i]} for i in sorted(merged.keys() | lost.keys())}


def unlogged(lines: Sequence[Any], protocol: RoundProtocol, tokens_per_step: int) -> dict[int, int]:
  r"""The tokens of each replica's killed processes that no line of an engine of real replicas
  counts (:func:`accounts` leaves them out), estimated: a process whose replica has a later
  :class:`Heal` line (its restarted process's) was killed; it ran from :math:`a`, its last
  payload in a round line or a :class:`Revert` line (else its start: 0, or its own heal's step),
  to its next boundary after its last one :math:`b` (:func:`boundaries`, one a kill left
  unwritten included), :math:`(b + n(b) - a)` steps times ``tokens_per_step``, :math:`n(b)`
  the protocol's inner steps from :math:`b` (:meth:`RoundProtocol.round_steps`). The steps
  ``InProcess(replay=lines)`` runs and counts in its :class:`Death` line: an upper bound, the
  kill may have come before that boundary. Whole-tree steps (a streaming run's per-fragment
  weights are not split). A process killed and not restarted is not counted.

  Returns:
    ``{replica: tokens}`` of the replicas with a restart, by replica id in order.
  """
  heals, counted, rounds = {}, {}, []  # counted: (replica, incarnation) -> payload steps
  for line in map(_parsed, lines):
    if isinstance(line, Heal):
      heals.setdefault(line.replica, []).append(line)
    elif isinstance(line, MergeLine):
      rounds.append(line)
    elif isinstance(line, Revert):  # in its process's order: its incarnation's
      counted.setdefault((line.replica, len(heals.get(line.replica, ()))), []).append(line.step)
  for line in rounds:
    for replica, step, *_ in line.payloads:
      at = bisect.bisect_right([h.round for h in heals.get(replica, ())], line.round)
      counted.setdefault((replica, at), []).append(step)
  times, out = boundaries(lines) or {}, {}
  for replica, healed in sorted(heals.items()):
    for k in range(len(healed)):  # each killed process: those before its replica's last heal
      start = healed[k - 1].step if k else 0
      a = max(counted.get((replica, k), []), default=start)
      b = max((s for i, n, s in times if (i, n) == (replica, k)), default=start)
      out[replica] = out.get(replica, 0) + (b + protocol.round_steps(b) - a) * tokens_per_step
  return out

# ----------------------------------------------------------------------------------------------
# The replica's side.


@dataclasses.dataclass(frozen=True)
class Push:
  """What a replica brings to its boundary (the engine's input).

  Attributes:
    header: its header: ``weight`` the tokens of its steps since its previous push (the
      engine counts a payload's own, per fragment), ``step`` its ``local_step``.
    payload: ``(payload, collections)`` (the payload of the fragment its ``local_step``
      names; the engine measures the round's own fragment from ``replica`` where it differs).
    replica: its :class:`ReplicaState` at the boundary (the engine's template of the global
      state's tree).
    loss: the mean of the losses its loop reported since its previous boundary (float64), or
      ``None`` (the torchft engine writes it in its round lines).
  """

  header: Header
  payload: Any
  replica: ReplicaState
  loss: float | None = None


@dataclasses.dataclass(frozen=True)
class Pull:
  """What the engine hands back at a replica's boundary.

  Attributes:
    landed: ``(before, merged, collections)`` when the round its payload entered closed at
      this boundary and committed: the :func:`global_state` the merge is applied to, the
      merged payload and the merged collections; else ``None``.
    received: ``(global state, collections)`` now (:func:`global_state`), when a round closed
      since its last pull (a catch-up), else ``None``. The engine's own arrays: a replica
      takes copies (its loop may donate them).
    revert: whether a round holding its payload aborted since its last pull (its params go
      back to the anchor).
    fragment: the fragment of the round that landed or aborted (``None``: the whole tree; a
      payload is of its round's fragment, which the replica's own ``local_step`` need not
      name).
    healed: a joiner's first pull: the decoded donation it heals from (the global state now
      and the donor's inner optimizer state, :func:`~optax_dist.fault_tolerance.heal.
      heal_state`), else ``None``.
    late: at a settle (:meth:`DecoupledReplica`'s boundary, before its push): its payload in
      flight was merged into a committed round after it went on (``received`` is the global
      state now, ``fragment`` the round's): it lands late (:func:`rebased`).
  """

  landed: Any
  received: Any
  revert: bool
  fragment: int | None = None
  healed: Any = None
  late: bool = False


class DecoupledReplica(Replica):
  """A :class:`~optax_dist.fault_tolerance.Replica` of a decoupled run: at each boundary it
  settles what resolved since its last one, then pushes its payload, with one payload in flight.

  At its boundary, once its inner steps are computed (not merely dispatched: a boundary that
  JAX's asynchronous dispatch reached early would settle before rounds that close while the
  steps run), it first **settles** (the engine's ``settle``): if its payload in flight is
  still in an open round it pushes nothing and goes on (its steps go into its next payload);
  if that payload's round aborted, its params of the round's fragment go back to the anchor and
  it pushes nothing (the steps since are lost: a :class:`Revert` line); if that round
  committed after it went on, it **lands late**; rounds that closed without its payload it
  catches up on, its own steps kept (both :func:`rebased`). Then it pushes its payload, measured
  from the anchor it now holds, and the engine hands back the outcome if its round closed at
  its boundary (within the window: it lands as a synchronous round lands it, from the params
  before its last inner step). ``local_step`` never jumps. :attr:`last` says whether it
  landed (``committed``); its ``line`` is ``None``: a decoupled round's line is the engine's
  :class:`MergeLine`.
  """

  def start(self, state: Any, **kwargs: Any) -> Any:
    """:meth:`Replica.start`, the model average (``local_sgd``'s: the initial params) copied:
    an engine reads it after the loop has donated its params."""
    state = super().start(state, **kwargs)
    self._replica = self._replica._replace(average=jax.tree.map(jnp.copy, self._replica.average))
    self._flight = None  # (its state at the push, residual candidate, fragment) in flight
    return state

  def _warm_up(self, parts: Any) -> None:
    """:meth:`Replica._warm_up`, the push's copy of the replica's state, and the rebases of
    a catch-up and of a late landing (:func:`rebased`), on scratch copies."""
    super()._warm_up(parts)
    fragment = self.protocol.fragment(self.protocol.round_steps(0))
    residual = self.protocol.send_half(parts.opt_state, parts.params, fragment)[1]
    mine = copied(self._replica)
    for flight in (None, (mine, residual, fragment)):
      copied(rebased(self.protocol, mine, global_state(mine), flight, fragment).params)

  def _round(self, state: Any) -> Any:
    # Its inner steps computed first: JAX dispatches them ahead of the device, and a settle
    # before they ran would find its payload still in flight where it lands while they run.
    jax.block_until_ready(get_parts(state).params)
    got = self.engine.settle(self.step)
    own = get_parts(state).collections  # as its steps left them: its payload's, not the global
    if got is not None and (got.late or got.received is not None):
      state = self._settle(state, got)
    if got is None or got.revert:  # in flight still, or its round aborted: nothing pushed
      if got is None:  # its state now (the loop's; its losses kept for its next payload)
        parts = get_parts(state)
        self._replica = self._replica._replace(params=parts.params, opt_state=parts.opt_state)
      else:
        state = self._revert(state, got.fragment)
      self.last = RoundResult(False, False, self.step, None)
      return state
    return self._push(state, own)

  def _settle(self, state: Any, got: Pull) -> Any:
    """The global state received (copies: the engine's) at a settle, or with its payload in no
    merge: :func:`rebased`, a late landing if ``got.late``."""
    received, collections = jax.tree.map(jnp.copy, got.received)
    parts = get_parts(state)
    mine = self._replica._replace(params=parts.params, opt_state=parts.opt_state)
    replica = rebased(self.protocol, mine, received, self._flight if got.late else None,
                      got.fragment)
    collections = parts.collections if collections is None else collections
    losses, start = self._losses, self._round_start  # those of the payload it pushes next
    state = self._take(state, replica, collections, False)
    self._losses, self._round_start = losses, start
    return state

  def _revert(self, state: Any, fragment: int | None) -> Any:
    """Its params of ``fragment`` back on the anchor (copies), after an aborted round."""
    parts = get_parts(state)
    params = self.protocol.restart(parts.params, parts.opt_state, self._replica.average,
                                   fragment)
    replica = self._replica._replace(params=jax.tree.map(jnp.copy, params),
                                     opt_state=parts.opt_state)
    return self._take(state, replica, parts.collections, False)

  def _push(self, state: Any, own: Any) -> Any:
    """Its payload with its collections ``own`` (those its steps since its last push left,
    before its settle took the global ones), then what the engine's pull gives."""
    parts, fragment, payload, residual, mine, header = self._send(state)
    kept = copied(mine)  # the engine and a late landing read it after the loop donated its own
    collections = jax.tree.map(jnp.copy, own)  # merged after the loop moves on
    self._flight = (kept, residual, fragment)
    got = self.engine.exchange(Push(header, (payload, collections), kept,
                                    mean_loss(self._losses)))
    replica, collections = mine, parts.collections
    if got.landed is not None:  # as a synchronous round lands it, on the state it merged into
      before, merged, collections = got.landed
      before = jax.tree.map(jnp.copy, before)  # the engine's: the loop may donate its state
      opt_state = catch_up(mine, before).opt_state
      if got.fragment != fragment:  # the round's fragment: its residual candidate
        _, residual = self.protocol.send_half(parts.opt_state, parts.params, got.fragment)
      params, opt_state, average = self.protocol.outer_half(
        self._origin, parts.params, opt_state, before.average, merged, residual, got.fragment)
      replica = ReplicaState(params, opt_state, before.rounds + 1, average)
      self._flight = None
    elif got.healed is not None:  # the local state rebuilt (params: a copy of the anchor, the
      replica, collections = placed_as(self.receive(got.healed), (mine, collections))
      replica = replica._replace(  # loop donates both), the data position its own
        params=jax.tree.map(jnp.copy, replica.params),
        opt_state=replica.opt_state._replace(local_step=mine.opt_state.local_step))
      self._flight = None
    elif got.received is not None:  # its payload in no merge; rounds closed: its steps kept
      received, received_collections = jax.tree.map(jnp.copy, got.received)
      replica = rebased(self.protocol, mine, received)
      collections = collections if received_collections is None else received_collections
    if got.revert:  # the round's fragment's params back on the anchor: copies
      params = self.protocol.restart(replica.params, replica.opt_state, replica.average,
                                     got.fragment)
      replica = replica._replace(params=jax.tree.map(jnp.copy, params))
      self._flight = None
    if got.landed is not None and collections is not None:
      collections = jax.tree.map(jnp.copy, collections)
    state = self._take(state, replica, collections, False)
    self.last = RoundResult(got.landed is not None, got.healed is not None, self.step, None)
    return state

  def state_hash(self) -> str:
    """:func:`global_hash` of this replica's global state (``local_step`` left out)."""
    return global_hash(self._replica, self._collections)

