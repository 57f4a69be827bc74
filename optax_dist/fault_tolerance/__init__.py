r"""Training through failures: DiLoCo-family rounds with the exchange outside the program.

A fault-tolerant run is R replicas, each its own JAX program, that meet once per round (every
H inner steps) to merge their payloads. Each round has a quorum, a vote and then a commit on
every member or an abort on every member; a replica that is behind heals from a live one. Your
own training loop drives the round (:class:`Replica`: ``start``, then ``after_step`` after
each step); an engine, chosen by one argument (:func:`engine`), runs the loops. The
subpackage's modules:

* :mod:`~optax_dist.fault_tolerance.loop`: the round a loop drives (:class:`Replica`, its
  :class:`RoundResult`), :func:`step_key` for the loop's random keys;
* :mod:`~optax_dist.fault_tolerance.in_process`: :class:`InProcess`, R user loops in one
  process (threads) with scripted :class:`Fault`\ s, for tests and notebooks (no torch);
* :mod:`~optax_dist.fault_tolerance.torchft_engine` (the ``ft`` extra: torch and torchft; not
  imported here): ``Torchft``, one replica per process over torchft's Lighthouse;
  :mod:`~optax_dist.fault_tolerance.torchft_session` holds what touches torchft's internals;
* :mod:`~optax_dist.fault_tolerance.decision`: the round's decision, one pure function of the
  members' headers and payloads that every engine calls;
* :mod:`~optax_dist.fault_tolerance.decoupled`: decoupled rounds (replicas of different
  speeds, none waiting for the slowest): when a round closes, the token weights and staleness
  rules, the catch-up, the log lines; :mod:`~optax_dist.fault_tolerance.clock` runs them in
  :class:`InProcess` on a simulated clock (``speeds=...``),
  :mod:`~optax_dist.fault_tolerance.torchft_decoupled` over torchft
  (``Torchft(decoupled=True)``, the ``ft`` extra; not imported here);
* :mod:`~optax_dist.fault_tolerance.protocol`: the round rules of one replica
  (:class:`RoundProtocol`: the transformation, the send and land halves, the merge, the vote,
  commit and abort; :class:`ReplicaState`, :class:`Sent`);
  :mod:`~optax_dist.fault_tolerance.halves` is its table, one row per algorithm;
* :mod:`~optax_dist.fault_tolerance.heal`: the state split (:class:`GlobalState`,
  :func:`global_state`, :func:`counters`; what a donor sends: :class:`HealState`,
  :func:`heal_state` and :func:`inner_state`; :func:`local_state`), :func:`state_hash`, and the
  heal payload (:func:`encode_heal`, :func:`decode_heal`): a JSON manifest and raw bytes, never
  a pickle;
* :mod:`~optax_dist.fault_tolerance.checkpoints`: a run's checkpoints, donations written by the
  quorum's rank 0, from which a replica that starts restores as a joiner heals;
* :mod:`~optax_dist.fault_tolerance.engine`: :class:`InProcessEngine`, the library's own loop
  of R replicas with a scripted :class:`Fault` schedule, its :class:`RoundLog` lines, and
  :func:`replay` of a log (the reference the invariants are tested on);
* :mod:`~optax_dist.fault_tolerance.replica` runs the command's replica as a process, and
  :mod:`~optax_dist.fault_tolerance.launcher` runs a Lighthouse and R of them on one host,
  restarting the dead.

Import the names from ``optax_dist.fault_tolerance``. Supported: ``diloco``, ``local_sgd`` and
``streaming_diloco`` (a round is one fragment's exchange; with ``overlap`` :math:`\tau` its merge
lands :math:`\tau` inner steps after it, ``RoundProtocol(overlap=...)``).

Example: three DiLoCo replicas, replica 2 dies in round 1 and rejoins in round 2, healing from
replica 0.

  >>> import jax, jax.numpy as jnp, optax
  >>> from optax_dist import fault_tolerance as ft
  >>> proto = ft.RoundProtocol("diloco", optax.sgd(0.1), optax.sgd(1.0), sync_period=2)
  >>> def batch_fn(seed, slot, step):
  ...   return jax.random.normal(jax.random.key(seed * 1000 + slot * 100 + step), (3,))
  >>> engine = ft.InProcessEngine(
  ...     proto, jnp.zeros(3), lambda p, b: p - b, batch_fn, num_replicas=3,
  ...     faults=[ft.Fault(1, 2, "die_inner"), ft.Fault(2, 2, "join")])
  >>> log = engine.run(3)
  >>> [(line.round, line.replica, line.committed, line.healed) for line in log if line.replica == 2]
  [(0, 2, True, False), (2, 2, True, True)]
  >>> len({line.state_hash for line in log if line.round == 2})
  1
"""

from optax_dist.fault_tolerance.engine import (
  KINDS,
  Fault,
  InProcessEngine,
  RoundLog,
  RoundPlan,
  replay,
)
from optax_dist.fault_tolerance.in_process import ENGINES, LOOP_KINDS, InProcess, engine
from optax_dist.fault_tolerance.loop import Replica, RoundResult, step_key
from optax_dist.fault_tolerance.heal import (
  MAGIC,
  GlobalState,
  HealState,
  counters,
  decode_heal,
  encode_heal,
  global_state,
  heal_replica,
  heal_state,
  inner_state,
  local_state,
  state_hash,
)
from optax_dist.fault_tolerance.protocol import SUPPORTED, ReplicaState, RoundProtocol, Sent

__all__ = (
  "ENGINES",
  "KINDS",
  "LOOP_KINDS",
  "MAGIC",
  "SUPPORTED",
  "Fault",
  "GlobalState",
  "HealState",
  "InProcess",
  "InProcessEngine",
  "Replica",
  "ReplicaState",
  "RoundLog",
  "RoundPlan",
  "RoundProtocol",
  "RoundResult",
  "Sent",
  "counters",
  "decode_heal",
  "encode_heal",
  "engine",
  "global_state",
  "heal_replica",
  "heal_state",
  "inner_state",
  "local_state",
  "replay",
  "state_hash",
  "step_key",
)
