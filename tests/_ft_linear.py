r"""A toy fault-tolerant run for the tests: a synthetic linear regression trained by torchft
replicas, as processes.

``python tests/_ft_linear.py replica --lighthouse http://HOST:PORT --replica-id I --out DIR
[...]`` joins the run the Lighthouse coordinates (a first start, or a restart under the same id:
it heals) and writes ``DIR/replicas/replica_<I>.jsonl``. The task: :math:`y = X w^\star` with
:math:`X` of shape ``[batch, dim]`` drawn from ``(seed, slot, step)``, :math:`w^\star_k = k /
\mathrm{dim}`, loss :math:`\lVert X w - y\rVert^2 / \mathrm{batch}`; DiLoCo (``--algorithm``)
with inner SGD and the outer Nesterov of the DiLoCo paper. A mistake, a missing ``ft`` extra or
a quorum that never forms is one line on stderr, exit status 2.

``python tests/_ft_linear.py launch --replicas R --out DIR [LaunchConfig's fields as flags] [--
replica flags]`` runs a :class:`~optax_dist.fault_tolerance.launcher.Launcher` of R such
replicas; its first line on stdout is ``lighthouse <URL>``, the address another replica joins.
A mistake (a value :class:`~optax_dist.fault_tolerance.launcher.LaunchConfig` refuses, the
Lighthouse not starting) is one line, status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys

SCRIPT = pathlib.Path(__file__).resolve()


def linear_task(dim: int, batch: int, leaves: int = 1):
  """``(params0, loss_and_grad, batch_fn)`` of the synthetic linear regression; with
  ``leaves`` > 1, :math:`w` is a tuple of that many consecutive parts (``streaming_diloco``'s
  fragments take whole leaves)."""
  import jax
  import jax.numpy as jnp

  target = jnp.arange(dim, dtype=jnp.float32) / dim

  @jax.jit
  def batch_fn(seed, slot, step):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), slot), step)
    x = jax.random.normal(key, (batch, dim))
    return x, x @ target

  def loss_and_grad(w, data):
    x, y = data
    whole = (lambda w: jnp.concatenate(w)) if leaves > 1 else (lambda w: w)
    return jax.value_and_grad(lambda w: jnp.sum((x @ whole(w) - y) ** 2) / batch)(w)

  w = jnp.zeros(dim, jnp.float32)
  return (tuple(jnp.array_split(w, leaves)) if leaves > 1 else w), loss_and_grad, batch_fn


def linear_protocol(algorithm: str, sync_period: int, **streaming):
  """The toy run's :class:`~optax_dist.fault_tolerance.RoundProtocol`: inner SGD, the DiLoCo
  paper's outer Nesterov (``local_sgd``: none), ``streaming`` (``num_fragments``, ``overlap``,
  ``mixing``) as given."""
  import optax

  from optax_dist.fault_tolerance import RoundProtocol

  outer = None if algorithm == "local_sgd" else optax.sgd(0.7, momentum=0.9, nesterov=True)
  return RoundProtocol(algorithm, optax.sgd(0.02), outer, sync_period=sync_period, **streaming)


def replica_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="_ft_linear.py replica")
  p.add_argument("--lighthouse", required=True)
  p.add_argument("--replica-id", type=int, required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--algorithm", default="diloco",
                 choices=("diloco", "local_sgd", "streaming_diloco"))
  p.add_argument("--num-fragments", type=int, default=None)
  p.add_argument("--overlap", type=int, default=0)
  p.add_argument("--mixing", type=float, default=0.0)
  p.add_argument("--meet", type=int, default=None,
                 help="a start barrier of this many replicas (files in OUT/replicas)")
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--sync-period", type=int, default=5)
  p.add_argument("--min-replicas", type=int, default=1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dim", type=int, default=8)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--quorum-timeout", type=float, default=60.0)
  p.add_argument("--exchange-timeout", type=float, default=30.0)
  p.add_argument("--exchange-retries", type=int, default=1)
  p.add_argument("--checkpoint-every", type=int, default=None)
  p.add_argument("--parent-death", action="store_true")
  p.add_argument("--wait-for-takeover", action="store_true")
  return p


def replica(argv: list[str]) -> int:
  from optax_dist.fault_tolerance import replica as ft_replica

  args = replica_parser().parse_args(argv)
  ft_replica.start_process(args.parent_death, args.wait_for_takeover)
  ft_replica.load_engine()
  params, loss_and_grad, batch_fn = linear_task(args.dim, args.batch, args.num_fragments or 1)
  try:
    protocol = linear_protocol(args.algorithm, args.sync_period, num_fragments=args.num_fragments,
                               overlap=args.overlap, mixing=args.mixing)
  except ValueError as e:
    raise ft_replica.ReplicaError(str(e)) from None
  on_ready = None
  if args.meet is not None:
    from optax_dist.cli.ft_replica import _meet
    from optax_dist.fault_tolerance.rundir import RunDir

    on_ready = functools.partial(_meet, RunDir(args.out), args.replica_id, args.meet,
                                 args.quorum_timeout)
  ft_replica.serve(
    protocol, params, loss_and_grad, batch_fn, steps=args.steps, seed=args.seed,
    tokens_per_step=args.batch, lighthouse=args.lighthouse, replica_id=args.replica_id,
    out=args.out, host=args.host, min_replicas=args.min_replicas,
    quorum_timeout=args.quorum_timeout, timeout=args.exchange_timeout,
    checkpoint_every=args.checkpoint_every, standby=args.wait_for_takeover,
    exchange_retries=args.exchange_retries, on_ready=on_ready)
  return 0


def launch_parser() -> argparse.ArgumentParser:
  """A flag per :class:`LaunchConfig` field (``--replicas``, ``--min-replicas``, ...), then
  ``--`` and the replicas' flags."""
  from optax_dist.fault_tolerance.launcher import LaunchConfig

  p = argparse.ArgumentParser(prog="_ft_linear.py launch")
  for field in dataclasses.fields(LaunchConfig):
    flag = "--" + field.name.replace("_", "-")
    if field.name in ("replica_command", "replica_args"):
      continue
    if field.default is dataclasses.MISSING:
      p.add_argument(flag, required=True, type=int if field.name == "replicas" else str)
    elif isinstance(field.default, bool):
      p.add_argument(flag, action="store_true")
    else:
      kind = {int: int, float: float}.get(type(field.default), str)
      p.add_argument(flag, type=int if field.name == "min_replicas" else kind,
                     default=field.default)
  p.add_argument("replica_args", nargs=argparse.REMAINDER)
  return p


def launch(argv: list[str]) -> int:
  from optax_dist.fault_tolerance.launcher import Launcher, LaunchConfig

  args = vars(launch_parser().parse_args(argv))
  replica_args = args.pop("replica_args")
  try:
    launcher = Launcher(LaunchConfig(
      **args, replica_command=(str(SCRIPT), "replica"),
      replica_args=replica_args[1:] if replica_args[:1] == ["--"] else replica_args))
  except (TypeError, ValueError, RuntimeError) as e:
    sys.stderr.write(f"optax_dist launcher: error: {e}\n")
    return 2
  print(f"lighthouse {launcher.url}", flush=True)  # where a replica started by hand joins
  try:
    return launcher.run()
  finally:
    launcher.close()


def main(argv: list[str]) -> int:
  from optax_dist.fault_tolerance.replica import ReplicaError

  command, rest = argv[0], argv[1:]
  try:
    return {"launch": launch, "replica": replica}[command](rest)
  except ReplicaError as e:
    sys.stderr.write(f"optax_dist replica: error: {e}\n")
    return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
