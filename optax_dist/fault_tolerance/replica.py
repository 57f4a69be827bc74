"""One replica of a fault-tolerant run over torchft, as a process.

:func:`serve` runs one replica of any task (:func:`task_loop`, the loop, over the torchft
engine) until the run has committed its steps;
:func:`start_process` does first what a launcher asks of a replica's process: with
``parent_death`` it gets ``SIGKILL`` when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``);
as a ``standby`` (the launcher's warm standby) it runs at the lowest CPU priority
(``SCHED_IDLE``: it runs when nothing else on its CPUs, or in its cgroup, wants to) while it
imports, compiles and runs its warm-up, then waits for a line on stdin
(:func:`wait_for_takeover`); then, at the usual priority, it reads the newest checkpoint and
joins. A mistake, a missing ``ft`` extra or a quorum that never forms is a
:class:`ReplicaError` of one line. ``optax-dist replica`` (:mod:`optax_dist.cli.ft_replica`)
runs the command's tasks with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from optax_dist.fault_tolerance.lighthouse import die_with_parent


class ReplicaError(Exception):
  """A mistake or a failure of the run said in one line (exit status 2)."""


def start_process(parent_death: bool, standby: bool) -> None:
  """What a launcher asks of a replica's process, first thing: with ``parent_death``,
  :func:`die_with_parent`; as a ``standby``, the lowest CPU priority (``SCHED_IDLE``) for its
  threads and those they start, until :func:`wait_for_takeover`."""
  if parent_death:
    die_with_parent()
  if standby:
    _schedule(os.SCHED_IDLE)


def _schedule(policy: int) -> None:
  """Sets every thread of this process to the scheduling ``policy``."""
  for tid in os.listdir("/proc/self/task"):
    with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
      os.sched_setscheduler(int(tid), policy, os.sched_param(0))


def wait_for_takeover() -> None:
  """A warm standby's wait (``Torchft(standby=...)``): blocks until a line arrives on
  stdin, the launcher's word that this process takes over its replica id; then puts every
  thread of the process back at the usual priority (``SCHED_OTHER``, allowed without
  privileges).

  Raises:
    ReplicaError: stdin ended first (the launcher is gone).
  """
  if not sys.stdin.readline():
    raise ReplicaError("a standby's stdin ended before its takeover (the launcher is gone)")
  _schedule(os.SCHED_OTHER)


def load_engine() -> Any:
  """The module :mod:`~optax_dist.fault_tolerance.torchft_engine`, with torchft's per-quorum
  warning about a missing NCCL flight recorder silenced (CPU only).

  Raises:
    ReplicaError: the ``ft`` extra is missing (the message names it).
  """
  try:
    from optax_dist.fault_tolerance import torchft_engine
  except ModuleNotFoundError as e:
    raise ReplicaError(str(e)) from None
  logging.getLogger("torchft.manager").setLevel(logging.ERROR)
  return torchft_engine


def task_loop(protocol: Any, params: Any, loss_and_grad: Callable, batch_fn: Callable, *,
              rounds: int) -> Callable[[Any], Any]:
  """The training function :func:`serve` hands its engine, for any engine's ``run``: replica
  :math:`i` starts from ``(params, protocol.tx.init(params))`` and, until it holds ``rounds``
  committed rounds, takes the protocol's jitted inner step on the gradient of
  ``loss_and_grad(x, batch_fn(replica.seed, i, replica.step))`` (``(loss, grads)``, as
  ``jax.value_and_grad`` gives them; :math:`x` the params before the step), then
  :meth:`~optax_dist.fault_tolerance.Replica.after_step` with the step's loss; it returns the
  replica's final :class:`~optax_dist.fault_tolerance.ReplicaState`. Its inner step is compiled
  before the replica joins, so its first round costs what the others do: on an optimizer state
  that ``tx.init`` builds in one program, whose arrays are committed to their devices as the
  step's outputs are (``tx.init``'s own scalar counters are not, and the step's second call
  would trace and compile it again, in the replica's first round)."""
  import jax

  loss_grads = jax.jit(loss_and_grad)

  def train(replica: Any) -> Any:
    state = params, protocol.tx_init(params)
    first = batch_fn(replica.seed, replica.slot, 0)
    protocol.inner_step(*state, loss_grads(params, first)[1])  # compiled before it joins
    state = replica.start(state)
    while replica.rounds < rounds:
      loss, grads = loss_grads(state[0], batch_fn(replica.seed, replica.slot, replica.step))
      state = replica.after_step(protocol.inner_step(*state, grads), loss=loss)
    return replica.replica_state

  return train


def serve(protocol: Any, params: Any, loss_and_grad: Callable, batch_fn: Callable, *, steps: int,
          seed: int, tokens_per_step: int, lighthouse: str, replica_id: int, out: str,
          host: str, min_replicas: int, quorum_timeout: float, timeout: float,
          on_ready: Callable[[], None] | None = None, checkpoint_every: int | None = None,
          standby: bool = False, exchange_retries: int = 0, num_replicas: int | None = None,
          **decoupled: Any) -> Any:
  """Trains one replica of ``protocol`` on ``(params, loss_and_grad, batch_fn)`` over torchft
  until the run has committed ``steps`` inner steps' worth of rounds; returns its final
  :class:`~optax_dist.fault_tolerance.ReplicaState`.

  The loop is a user's loop (:class:`~optax_dist.fault_tolerance.Replica`), :func:`task_loop`'s
  (each round's line has the mean of its steps' losses), over the
  :class:`~optax_dist.fault_tolerance.torchft_engine.Torchft` engine, whose arguments the others
  are; ``standby``: the replica is a warm standby that waits in :func:`wait_for_takeover` once
  compiled; ``decoupled``: the engine's decoupled rounds' arguments (``decoupled=True``,
  ``min_quorum``, ``grace_window``, ``staleness_rule``, ``max_staleness``).

  Raises:
    ReplicaError: the ``ft`` extra missing, a bad value, a replica whose settings are not the
      run's, or a quorum that never formed.
  """
  engine_module = load_engine()
  from optax_dist.fault_tolerance.torchft_session import MissedRounds, SettingsMismatch

  target = protocol.rounds_until(steps)
  try:
    engine = engine_module.Torchft(
      protocol, lighthouse=lighthouse, replica_id=replica_id, out=out, host=host, seed=seed,
      tokens_per_step=tokens_per_step, min_replicas=min_replicas,
      quorum_timeout=quorum_timeout, timeout=timeout, exchange_retries=exchange_retries,
      checkpoint_every=checkpoint_every, last_round=target, on_ready=on_ready,
      standby=wait_for_takeover if standby else None, num_replicas=num_replicas, **decoupled)
  except ValueError as e:
    raise ReplicaError(str(e)) from None
  try:
    return engine.run(task_loop(protocol, params, loss_and_grad, batch_fn, rounds=target))[
      replica_id]
  except (SettingsMismatch, MissedRounds) as e:
    raise ReplicaError(str(e)) from None
  except ValueError as e:  # a checkpoint of other settings, or damaged
    raise ReplicaError(str(e)) from None
  except TimeoutError as e:
    raise ReplicaError(
      f"replica {replica_id}: timed out ({e}); a quorum of at least {min_replicas} must form"
      f" within --quorum-timeout {quorum_timeout} s") from None
