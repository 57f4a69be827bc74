r"""One replica of a fault-tolerant run over torchft, as a process.

``python -m optax_dist.fault_tolerance.replica --lighthouse http://HOST:PORT --replica-id I
--out DIR [...]`` joins the run the Lighthouse coordinates (a first start, or a restart under the
same id: it heals) and writes ``DIR/replicas/replica_<I>.jsonl``. The task is a synthetic
linear regression: :math:`y = X w^\star` with :math:`X` of shape ``[batch, dim]`` drawn from
``(seed, slot, step)``, :math:`w^\star_k = k / \mathrm{dim}`, loss
:math:`\lVert X w - y\rVert^2 / \mathrm{batch}`. DiLoCo (``--algorithm``) with inner SGD and
the outer Nesterov of the DiLoCo paper.

With ``--parent-death`` the process gets ``SIGKILL`` when its parent dies (Linux
``prctl(PR_SET_PDEATHSIG)``). With ``--wait-for-takeover`` it is a warm standby: at the lowest
CPU priority (``SCHED_IDLE``: it runs when nothing else on its CPUs, or in its cgroup, wants to),
it imports, compiles and runs its warm-up, then waits for a line on stdin
(:func:`wait_for_takeover`: the launcher's ``--standby``); then, at the usual priority, it reads
the newest checkpoint and joins. A mistake, a missing ``ft`` extra or a quorum that never forms
is one line on stderr, exit status 2. :func:`serve` runs a replica of any task: ``optax-dist
replica`` and ``optax-dist train --fault-tolerant`` (:mod:`optax_dist.cli.fault_tolerant`) run
the command's tasks with it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from optax_dist.fault_tolerance.lighthouse import die_with_parent


class ReplicaError(Exception):
  """A mistake or a failure of the run said in one line (exit status 2)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
  """Adds the replica's flags to ``p`` (this module's parser, or ``optax-dist replica``'s)."""
  p.add_argument("--lighthouse", required=True, help="the Lighthouse's URL, http://host:port")
  p.add_argument("--replica-id", type=int, required=True, help="id and data slot, from 0")
  p.add_argument("--out", required=True, help="the run's directory")
  p.add_argument("--host", default="127.0.0.1", help="the address this replica advertises")
  p.add_argument("--algorithm", default="diloco", choices=("diloco", "local_sgd"))
  p.add_argument("--steps", type=int, default=100, help="committed inner steps")
  p.add_argument("--sync-period", type=int, default=5, help="H, inner steps per round")
  p.add_argument("--min-replicas", type=int, default=1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dim", type=int, default=8)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--quorum-timeout", type=float, default=60.0, help="seconds")
  p.add_argument("--timeout", type=float, default=30.0,
                 help="seconds for a collective, a heal and the vote")
  p.add_argument("--exchange-retries", type=int, default=1, metavar="N",
                 help="times a round whose exchange failed is tried again in a new quorum")
  p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                 help="inner steps between checkpoints under OUT/replicas/checkpoints, where"
                 " the replica starts from the newest (default: none)")
  add_process_flags(p)


def add_process_flags(p: argparse.ArgumentParser) -> None:
  """Adds the flags a launcher gives a replica's process (``--parent-death``,
  ``--wait-for-takeover``) to ``p``."""
  p.add_argument("--parent-death", action="store_true",
                 help="die (SIGKILL) when the parent process dies")
  p.add_argument("--wait-for-takeover", action="store_true",
                 help="a warm standby: compile, then wait for a line on stdin before joining"
                 " under --replica-id (the launcher's --standby)")


def start_process(args: argparse.Namespace) -> None:
  """What the process flags ask of a replica's process, first thing: with ``--parent-death``,
  :func:`die_with_parent`; with ``--wait-for-takeover``, the lowest CPU priority
  (``SCHED_IDLE``) for its threads and those they start, until :func:`wait_for_takeover`."""
  if args.parent_death:
    die_with_parent()
  if args.wait_for_takeover:
    _schedule(os.SCHED_IDLE)


def _schedule(policy: int) -> None:
  """Sets every thread of this process to the scheduling ``policy``."""
  for tid in os.listdir("/proc/self/task"):
    with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
      os.sched_setscheduler(int(tid), policy, os.sched_param(0))


def wait_for_takeover() -> None:
  """A warm standby's wait (``TorchftReplica(standby=...)``): blocks until a line arrives on
  stdin, the launcher's word that this process takes over its replica id; then puts every
  thread of the process back at the usual priority (``SCHED_OTHER``, allowed without
  privileges).

  Raises:
    ReplicaError: stdin ended first (the launcher is gone).
  """
  if not sys.stdin.readline():
    raise ReplicaError("a standby's stdin ended before its takeover (the launcher is gone)")
  _schedule(os.SCHED_OTHER)


def build_parser() -> argparse.ArgumentParser:
  """The replica's command line."""
  p = argparse.ArgumentParser(prog="python -m optax_dist.fault_tolerance.replica",
                              description=__doc__.split("\n\n")[0])
  add_arguments(p)
  return p


def linear_task(dim: int, batch: int):
  """``(params0, grad_fn, batch_fn)`` of the synthetic linear regression."""
  import jax
  import jax.numpy as jnp

  target = jnp.arange(dim, dtype=jnp.float32) / dim

  @jax.jit
  def batch_fn(seed, slot, step):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), slot), step)
    x = jax.random.normal(key, (batch, dim))
    return x, x @ target

  def grad_fn(w, data):
    x, y = data
    return jax.grad(lambda w: jnp.sum((x @ w - y) ** 2) / batch)(w)

  return jnp.zeros(dim, jnp.float32), grad_fn, batch_fn


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


def serve(protocol: Any, params: Any, grad_fn: Callable, batch_fn: Callable, *, steps: int,
          seed: int, tokens_per_step: int, lighthouse: str, replica_id: int, out: str,
          host: str, min_replicas: int, quorum_timeout: float, timeout: float,
          on_ready: Callable[[], None] | None = None, checkpoint_every: int | None = None,
          standby: bool = False, exchange_retries: int = 0) -> Any:
  """Runs one ``TorchftReplica`` of ``protocol`` on ``(params, grad_fn, batch_fn)`` until the
  run has committed ``steps`` inner steps; returns its final ``ReplicaState``.

  The arguments are ``TorchftReplica``'s and ``TorchftReplica.run``'s; ``standby``: the
  replica is a warm standby that waits in :func:`wait_for_takeover` once compiled.

  Raises:
    ReplicaError: the ``ft`` extra missing, a bad value, a replica whose settings are not the
      run's, or a quorum that never formed.
  """
  engine = load_engine()
  try:
    replica = engine.TorchftReplica(
      protocol, params, grad_fn, batch_fn, lighthouse=lighthouse, replica_id=replica_id,
      out=out, host=host, seed=seed, tokens_per_step=tokens_per_step,
      min_replicas=min_replicas, quorum_timeout=quorum_timeout, timeout=timeout,
      on_ready=on_ready, checkpoint_every=checkpoint_every,
      standby=wait_for_takeover if standby else None, exchange_retries=exchange_retries)
  except ValueError as e:
    raise ReplicaError(str(e)) from None
  try:
    replica.run(steps)
  except engine.SettingsMismatch as e:
    raise ReplicaError(str(e)) from None
  except TimeoutError as e:
    raise ReplicaError(
      f"replica {replica_id}: timed out ({e}); a quorum of at least {min_replicas} must form"
      f" within --quorum-timeout {quorum_timeout} s") from None
  finally:
    replica.shutdown()
  return replica.state


def run(args: argparse.Namespace) -> int:
  """Runs one replica of the synthetic task to the end of the run; returns 0.

  Raises:
    ReplicaError: the ``ft`` extra missing, a bad flag value, or a quorum that never formed.
  """
  start_process(args)
  load_engine()
  import optax

  from optax_dist.fault_tolerance import RoundProtocol

  params, grad_fn, batch_fn = linear_task(args.dim, args.batch)
  outer = None if args.algorithm == "local_sgd" else optax.sgd(0.7, momentum=0.9, nesterov=True)
  try:
    protocol = RoundProtocol(args.algorithm, optax.sgd(0.02), outer, sync_period=args.sync_period)
  except ValueError as e:
    raise ReplicaError(str(e)) from None
  serve(protocol, params, grad_fn, batch_fn, steps=args.steps, seed=args.seed,
        tokens_per_step=args.batch, lighthouse=args.lighthouse, replica_id=args.replica_id,
        out=args.out, host=args.host, min_replicas=args.min_replicas,
        quorum_timeout=args.quorum_timeout, timeout=args.timeout,
        checkpoint_every=args.checkpoint_every, standby=args.wait_for_takeover,
        exchange_retries=args.exchange_retries)
  return 0


def main(argv: list[str] | None = None) -> int:
  """Runs one replica; returns the exit status (2 for a :class:`ReplicaError`, said in one
  line)."""
  try:
    return run(build_parser().parse_args(argv))
  except ReplicaError as e:
    sys.stderr.write(f"optax_dist replica: error: {e}\n")
    return 2


if __name__ == "__main__":
  sys.exit(main())
