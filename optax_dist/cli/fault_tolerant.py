"""``optax-dist train --fault-tolerant``: the command's task trained by replica processes that
die, come back and heal while the run goes on (the ``ft`` extra: torch and torchft).

``--replicas R`` replica processes, each its own JAX program with ``--devices`` devices (its
minibatch split over them, the gradients reduced within it on every step), meet once per round
(every ``--sync-period`` H inner steps) through torchft: a quorum of at least
``--min-replicas``, a heal for a replica that is behind, the exchange, a vote, then a commit or
an abort on every member (:mod:`optax_dist.fault_tolerance.torchft_engine`). The launcher of
:mod:`optax_dist.fault_tolerance.launcher` runs the Lighthouse in this process and restarts a
replica that dies; each replica is ``optax-dist replica`` (:mod:`optax_dist.cli.replica`) with
this command's flags, so a replica started by hand with the same flags joins the same run.

The replicas train ``--task`` as ``optax-dist train --replicas R --devices R*D`` would
(:func:`task_engine`): the same model, initial params, loss, inner and outer optimizers, and
the same minibatches. Worker ``w`` of the ``R*D`` owns the ``w``-th shard of the training set,
and replica ``i`` holds workers ``i*D`` to ``i*D + D - 1``: its batch at step ``t`` is a
stateless function of ``(seed, i, t)`` (:func:`optax_dist.cli.pipeline.minibatch`), so a
replica restarted under its id continues its slot's stream from the healed step.

Each replica writes ``OUT/replicas/replica_<i>.jsonl`` (one line per round: ``round``, ``step``,
``quorum_id``, ``members``, ``committed``, ``weight``, ``healed``, ``state_hash``, ``tokens``,
``time``, ``pid``, ``quorum_seconds``, ``attempts``) and, once finished,
``OUT/replicas/final_<i>.json`` with the test metric of its final evaluated params (the anchor;
``local_sgd``: the last average).
The command then prints :func:`summary` and writes it to ``OUT/fault_tolerant_<algorithm>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from optax_dist.cli import algorithms, checks, errors, launcher, pipeline
from optax_dist.cli.arguments import (integer_at_least_0, non_negative_float, positive_float,
                                      positive_int)
from optax_dist.cli.config import Settings, settings_of
from optax_dist.cli.errors import PROG, CommandError
from optax_dist.cli.tasks import TASKS, Data, Task
from optax_dist.fault_tolerance import SUPPORTED, RoundProtocol
from optax_dist.fault_tolerance import checkpoints as ft_checkpoints
from optax_dist.fault_tolerance import launcher as ft_launcher
from optax_dist.fault_tolerance import replica as ft_replica

FT_HINT = 'needs the "ft" extra: pip install "optax-dist[ft]"'

DEFAULTS = {"min_replicas": None, "host": "127.0.0.1", "quorum_timeout": 60.0,
            "exchange_timeout": 30.0, "join_timeout": ft_launcher.JOIN_TIMEOUT_S,
            "lighthouse_heartbeat_timeout": 5.0,
            "max_restarts": 3, "restart_delay": 1.0, "finish_grace": 10.0, "replica_netns": None,
            "standby": False, "exchange_retries": 1}
"""The fault-tolerance flags' defaults (``min_replicas``: ``R // 2 + 1``); each flag's parser
default is ``None``, so that one given without ``--fault-tolerant`` is refused."""

REPLICA_COMMAND = ("-m", "optax_dist.cli", "replica")
"""A replica's command line after the Python interpreter: ``optax-dist replica``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the flags of ``--fault-tolerant`` (``train``'s and ``replica``'s) to ``parser``."""
  d = DEFAULTS
  group = parser.add_argument_group(
    "fault tolerance (--fault-tolerant; the ft extra: torch, torchft)")
  group.add_argument(
    "--fault-tolerant", action="store_true",
    help=f"train with {', '.join(SUPPORTED)} in --replicas R processes, each its own JAX"
    " program with --devices devices, that meet every sync period through torchft: a"
    " replica that dies is restarted and heals from a live one while the others go on; each"
    " writes OUT/replicas/replica_<i>.jsonl (default: off)")
  group.add_argument("--min-replicas", type=positive_int, default=None, metavar="M",
                     help="the smallest quorum that commits a round (default: R // 2 + 1)")
  group.add_argument("--host", default=None,
                     help=f"the address the Lighthouse and the replicas' servers bind and"
                     f" advertise, never a wildcard (default: {d['host']})")
  floats = (
    ("quorum_timeout", positive_float, "a replica waits for a quorum before it gives up"),
    ("exchange_timeout", positive_float, "for a collective, a heal and the vote"),
    ("join_timeout", non_negative_float,
     "the Lighthouse waits for a heartbeating replica that has not asked for the quorum;"
     " longer than a round, or one member is left out of every round"),
    ("lighthouse_heartbeat_timeout", positive_float,
     "without a heartbeat before the Lighthouse drops a replica (not --heartbeat-timeout,"
     " jax.distributed's)"),
    ("restart_delay", non_negative_float, "before a dead replica is started again"),
    ("finish_grace", non_negative_float,
     "the others have to finish once one replica has; then they are stopped"))
  for name, kind, what in floats:
    group.add_argument(algorithms.flag(name), type=kind, default=None, metavar="SECONDS",
                       help=f"seconds {what} (default: {d[name]:g})")
  group.add_argument("--replica-netns", default=None, metavar="PATTERN",
                     help="run replica I in the network namespace PATTERN with {i} replaced by I"
                     " (ip netns exec, as root; made beforehand), binding the address the host"
                     " name resolves to there; --host is then the Lighthouse's only"
                     " (default: none)")
  group.add_argument("--max-restarts", type=integer_at_least_0, default=None, metavar="N",
                     help=f"restarts of each replica id (default: {d['max_restarts']})")
  group.add_argument("--exchange-retries", type=integer_at_least_0, default=None, metavar="N",
                     help="times a round whose exchange failed (a member stopped, killed or cut"
                     " off in it) is tried again in a new quorum without that member before it"
                     f" aborts (default: {d['exchange_retries']})")
  group.add_argument("--standby", action="store_const", const=True, default=None,
                     help="keep a warm standby process per replica id (imported, compiled,"
                     " waiting), which takes over a dead replica's id after --restart-delay and"
                     " joins within a round; a process and its memory more per replica"
                     " (default: off)")


def resolve(args: argparse.Namespace) -> None:
  """Fills in the defaults of the fault-tolerance flags in ``args``.

  Raises:
    CommandError: a fault-tolerance flag without ``--fault-tolerant``; ``--processes`` with it;
      an algorithm the protocol does not run; a setting it does not take; ``--min-replicas``
      above ``--replicas``; ``--replica-id`` outside ``0..R-1``; the ``ft`` extra missing.
  """
  if not args.fault_tolerant:
    given = [name for name in DEFAULTS if getattr(args, name, None) is not None]
    if given:
      raise CommandError(f"argument {algorithms.flag(given[0])}: needs --fault-tolerant")
    return
  for name, value in DEFAULTS.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.min_replicas is None:
    args.min_replicas = args.replicas // 2 + 1
  _refuse(args)
  errors.require(("torch", "torchft"), f"--fault-tolerant {FT_HINT}")


def _refuse(args: argparse.Namespace) -> None:
  if args.processes != 1 or args.process_id is not None or args.coordinator is not None:
    raise CommandError(
      "argument --processes: not with --fault-tolerant, whose --replicas R are R processes of"
      " --devices devices each")
  if args.algorithm not in SUPPORTED:
    raise CommandError(
      f"argument --algorithm: --fault-tolerant runs {', '.join(SUPPORTED)} only, got"
      f" {args.algorithm}")
  refused = (("fsdp", args.fsdp is not None), ("resume", args.resume),
             ("exchange_device", args.exchange_device), ("overlap", args.overlap),
             ("eager", args.eager), ("warmup_steps", args.warmup_steps),
             ("param_dtype", args.param_dtype != "float32"))
  for name, given in refused:
    if given:
      raise CommandError(
        f"argument {algorithms.flag(name)}: not with --fault-tolerant, got"
        f" {getattr(args, name)}")
  if args.min_replicas > args.replicas:
    raise CommandError(
      f"argument --min-replicas: must be at most --replicas ({args.replicas}), got"
      f" {args.min_replicas}")
  replica_id = getattr(args, "replica_id", None)
  if replica_id is not None and not 0 <= replica_id < args.replicas:
    raise CommandError(
      f"argument --replica-id: must be in 0..{args.replicas - 1} (--replicas"
      f" {args.replicas}), got {replica_id}")


def settings(args: argparse.Namespace, task: Task, load: Callable[[], Data]) -> Settings:
  """The settings of the equivalent ``train --replicas R --devices R*D`` run, checked as that
  command checks them (:func:`optax_dist.cli.checks.check_command`; ``load()`` gives the data
  when the check needs it)."""
  s = settings_of(args, task)
  s = dataclasses.replace(s, devices=args.replicas * args.devices).resolved()
  checks.check_command(args, s, (args.algorithm,),
                       train_examples=lambda: checks.num_examples(load().train))
  return s


def protocol(s: Settings) -> RoundProtocol:
  """The :class:`~optax_dist.fault_tolerance.RoundProtocol` of ``s``: the command's inner
  optimizer (:func:`optax_dist.cli.algorithms.inner_optimizer`), outer optimizer and exchange."""
  streaming = s.algorithm == "streaming_diloco"
  outer = None if s.algorithm == "local_sgd" else algorithms.outer_optimizer(s)
  return RoundProtocol(
    s.algorithm, algorithms.inner_optimizer(s), outer, sync_period=s.sync_period,
    error_feedback=s.error_feedback, num_fragments=s.num_fragments if streaming else None,
    mixing=s.mixing, **algorithms.exchange_options(s))


def task_engine(task: Task, data: Data, s: Settings, replicas: int) -> tuple[Any, ...]:
  """``(params, grad_fn, batch_fn, tokens_per_step, evaluate)`` of ``task`` for one replica
  of ``replicas`` (``s.devices`` workers in all, ``K = s.devices // replicas`` per replica).

  * ``params``: :func:`optax_dist.cli.runs.initial_params` (``train``'s), replicated over the
    replica's K devices;
  * ``grad_fn(params, batch)``: the gradient of ``task``'s mean loss on the replica's batch of
    ``K * batch_size`` examples, split over its K devices: the mean of its workers' gradients;
  * ``batch_fn(seed, slot, step)``: the minibatches of workers ``slot * K`` to ``slot * K + K -
    1`` for step ``step + 1`` (:func:`optax_dist.cli.pipeline.minibatch`), stateless;
  * ``tokens_per_step``: the targets in the replica's batch of a step, ``K * batch_size`` times
    :func:`tokens_per_example` (a round's merge weight is its inner steps times this);
  * ``evaluate(params) -> float``: ``task``'s test metric.
  """
  import jax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from optax_dist.cli.runs import initial_params

  k = s.devices // replicas
  mesh = Mesh(np.array(jax.devices()[:k]), ("data",))
  shards = pipeline.shard_examples(data.train, s.devices)
  n_local = checks.num_examples(data.train) // s.devices
  example = tuple((key, (1,) + v.shape[1:], str(v.dtype)) for key, v in data.train.items())
  model = task.model()
  params = jax.tree.map(lambda p: p.astype(s.param_dtype), initial_params(task, s.seed, example))
  params = jax.device_put(params, NamedSharding(mesh, P()))

  def batch_fn(seed: int, slot: int, step: int) -> Any:
    workers = np.arange(slot * k, slot * k + k)[:, None]
    idx = pipeline.minibatch(seed, s.devices, n_local, s.batch_size, step)[workers[:, 0]]
    batch = {key: v[workers, idx].reshape((-1,) + v.shape[2:]) for key, v in shards.items()}
    return jax.device_put(batch, NamedSharding(mesh, P("data")))

  metric = jax.jit(task.metric_fn(model))
  return (params, jax.grad(task.loss_fn(model)), batch_fn,
          k * s.batch_size * tokens_per_example(data), lambda p: float(metric(p, data.test)))


def tokens_per_example(data: Data) -> int:
  """The targets an example of ``data`` holds: its label (1) for a classification task, one per
  position (the next byte) for the ``lm`` task's windows."""
  return int(np.prod(np.shape(data.train["y"])[1:], dtype=np.int64))


def run_replica(args: argparse.Namespace) -> int:
  """Runs one replica (``optax-dist replica``) of the run ``args`` describe; returns 0."""
  args.fault_tolerant = True
  task = TASKS[args.task]
  errors.require_task(task)
  resolve(args)
  ft_replica.start_process(args)
  launcher.init_jax(args.devices)
  data = task.load(args.seed)
  s = settings(args, task, lambda: data)
  params, grad_fn, batch_fn, tokens, evaluate = task_engine(task, data, s, args.replicas)
  try:
    state = ft_replica.serve(
      protocol(s), params, grad_fn, batch_fn, steps=s.steps, seed=s.seed,
      tokens_per_step=tokens, lighthouse=args.lighthouse, replica_id=args.replica_id,
      out=args.out, host=args.host, min_replicas=args.min_replicas,
      quorum_timeout=args.quorum_timeout, timeout=args.exchange_timeout,
      on_ready=lambda: _meet(pathlib.Path(args.out), args.replica_id, args.replicas,
                             args.quorum_timeout), checkpoint_every=args.checkpoint_every,
      standby=args.wait_for_takeover, exchange_retries=args.exchange_retries)
  except ft_replica.ReplicaError as e:
    raise CommandError(str(e)) from None
  final = {"replica": args.replica_id, "step": int(state.opt_state.local_step),
           f"test_{task.metric_key}": evaluate(_evaluated(state))}
  path = pathlib.Path(args.out) / "replicas" / f"final_{args.replica_id}.json"
  path.write_text(json.dumps(final) + "\n")
  return 0


def checkpoint_metrics(args: argparse.Namespace) -> list[dict[str, Any]]:
  """The task's held-out metric of each checkpoint the run ``args`` describe wrote (under
  ``OUT/replicas/checkpoints``, with ``--checkpoint-every``): one dict per checkpoint, oldest
  first, with its ``step``, ``rounds``, ``time`` and ``test_<metric>`` (of the params a replica
  restored from it evaluates: the anchor; ``local_sgd``: the last average). Run in this process,
  after the run (e.g. for a validation curve); JAX must have a device.

  Raises:
    CommandError: as the command's checks; the ``ft`` extra missing.
    ValueError: a checkpoint written with other settings, or damaged.
  """
  args.fault_tolerant = True
  resolve(args)
  task = TASKS[args.task]
  data = task.load(args.seed)
  s = settings(args, task, lambda: data)
  params, _, _, tokens, evaluate = task_engine(task, data, s, args.replicas)
  rounds = protocol(s)
  fingerprint = ft_replica.load_engine().settings_fingerprint(
    rounds, params, seed=s.seed, tokens_per_step=tokens)
  folder, start = pathlib.Path(args.out) / "replicas" / "checkpoints", rounds.init(params)
  metrics = []
  for meta in ft_checkpoints.saved(folder):
    state, _ = ft_checkpoints.restore(folder, rounds, start, params, fingerprint, meta)
    metrics.append({**{k: meta[k] for k in ("step", "rounds", "time")},
                    f"test_{task.metric_key}": evaluate(_evaluated(state))})
  return metrics


def _check_protocol(task: Task, data: Data, s: Settings) -> None:
  """Raises :class:`CommandError` naming the flag if :func:`protocol` refuses ``s`` or the
  task's params (e.g. more fragments than the params' leaves fill), on abstract values: before
  any replica starts, whose error would otherwise be restarted."""
  import jax

  model = task.model()
  example = {key: jax.ShapeDtypeStruct((1,) + v.shape[1:], v.dtype)
             for key, v in data.train.items()}
  try:
    params = jax.eval_shape(
      lambda batch: task.init_params(model, jax.random.key(s.seed), batch), example)
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, s.param_dtype), params)
    jax.eval_shape(protocol(s).init, params)
  except ValueError as e:
    raise CommandError(f"argument {checks.library_flag(e) or '--algorithm'}: {e}") from None


def _meet(out: pathlib.Path, replica_id: int, replicas: int, timeout: float) -> None:
  """A start barrier: writes ``out/replicas/ready_<replica_id>``, then waits until every
  replica's file exists, at most ``timeout`` seconds, so that replicas started together, whose
  imports and compilations end seconds apart, meet in their first quorum. A replica restarted
  later finds every file and goes on at once."""
  folder = out / "replicas"
  (folder / f"ready_{replica_id}").touch()
  deadline = time.monotonic() + timeout
  while (time.monotonic() < deadline
         and not all((folder / f"ready_{i}").exists() for i in range(replicas))):
    time.sleep(0.02)


def _evaluated(state: Any) -> Any:
  """The params to evaluate: ``local_sgd``'s last committed average, else
  :func:`optax_dist.eval_params` (the anchor)."""
  import optax_dist

  if state.average is not None:
    return state.average
  return optax_dist.eval_params(state.opt_state, state.params)


def run_train(args: argparse.Namespace) -> int:
  """Runs ``optax-dist train --fault-tolerant``: checks, then the launcher (the Lighthouse and
  ``--replicas`` processes of ``optax-dist replica`` with this command's flags); prints the
  :func:`summary`. Returns 0, or 1 if fewer than ``--min-replicas`` replicas finished or two
  replicas committed one round with different state hashes."""
  task = TASKS[args.task]
  errors.require_task(task)
  data = task.load(args.seed)
  _check_protocol(task, data, settings(args, task, lambda: data))
  spec = argparse.Namespace(
    replicas=args.replicas, min_replicas=args.min_replicas, out=args.out, host=args.host,
    port=0, replica_netns=args.replica_netns, join_timeout=args.join_timeout,
    lighthouse_heartbeat_timeout=args.lighthouse_heartbeat_timeout,
    max_restarts=args.max_restarts, restart_delay=args.restart_delay,
    finish_grace=args.finish_grace, standby=args.standby, replica_args=list(args.argv[1:]))
  try:
    ft_launcher.check_arguments(spec)
  except ValueError as e:
    raise CommandError(str(e)) from None
  _clear(pathlib.Path(args.out))
  # torchft's Rust logs (every quorum, in this process and the replicas'): errors only.
  os.environ.setdefault("RUST_LOG", "error")
  _share_compilations(pathlib.Path(args.out))
  try:
    run = ft_launcher.Launcher(spec, REPLICA_COMMAND)
  except RuntimeError as e:
    raise CommandError(str(e)) from None
  if not args.no_progress:
    sys.stderr.write(f"{PROG}: fault-tolerant {args.algorithm}: lighthouse {run.url},"
                     f" {args.replicas} replica processes (logs: {args.out}/replica_<i>.log)\n")
    sys.stderr.flush()
  try:
    status = run.run()
  finally:
    run.close()
  result = summary(pathlib.Path(args.out), args.replicas, sum(s.restarts for s in run.slots))
  result.update(algorithm=args.algorithm, task=task.name, replicas=args.replicas,
                min_replicas=args.min_replicas, launcher_status=status)
  (pathlib.Path(args.out) / f"fault_tolerant_{args.algorithm}.json").write_text(
    json.dumps(result, indent=1) + "\n")
  print(_describe(result, task))
  return 0 if status == 0 and result["hashes_agree"] else 1


def _share_compilations(out: pathlib.Path) -> None:
  """Gives the replicas (through the environment they inherit) a persistent JAX compilation
  cache under ``OUT/compilation_cache``, unless ``JAX_COMPILATION_CACHE_DIR`` is set already,
  every program cached: a restarted replica reads its programs back instead of compiling them
  again, which is most of its time to heal. A hit runs the executable the miss compiled: the
  results do not change."""
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(out.resolve() / "compilation_cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _clear(out: pathlib.Path) -> None:
  """Removes an earlier run's Lighthouse log and replica files under ``out`` (their logs, lines,
  evaluations, start marks and checkpoints): a new run starts them afresh, and its processes
  append to them."""
  for pattern in ("lighthouse.log", "replica_*.log", "replica_*.pid", "replicas/replica_*.jsonl",
                  "replicas/final_*.json", "replicas/ready_*", "replicas/checkpoints/step_*"):
    for path in out.glob(pattern):
      path.unlink()


def summary(out: pathlib.Path, replicas: int, restarts: int) -> dict[str, Any]:
  """What the replicas' files under ``out/replicas`` say about the run.

  Returns:
    ``rounds_committed`` (round indices some replica committed), ``rounds_aborted`` (those
    none committed), ``restarts``, ``heals`` (lines of a healed replica) and ``heal_seconds``
    (their ``quorum_seconds``: the quorum with the heal), ``hashes_agree`` (every committed
    round has one ``state_hash``), ``finished`` (the replicas that wrote their final
    evaluation) and ``final`` (those evaluations, by replica).
  """
  lines = []
  for i in range(replicas):
    path = out / "replicas" / f"replica_{i}.jsonl"
    if path.exists():
      lines += [json.loads(line) for line in path.read_text().splitlines()]
  hashes: dict[int, set] = {}
  for line in lines:
    if line["committed"]:
      hashes.setdefault(line["round"], set()).add(line["state_hash"])
  final = {}
  for i in range(replicas):
    path = out / "replicas" / f"final_{i}.json"
    if path.exists():
      final[i] = json.loads(path.read_text())
  heals = [line["quorum_seconds"] for line in lines if line["healed"]]
  return {"rounds_committed": len(hashes),
          "rounds_aborted": len({line["round"] for line in lines} - hashes.keys()),
          "restarts": restarts, "heals": len(heals), "heal_seconds": heals,
          "hashes_agree": all(len(h) == 1 for h in hashes.values()),
          "finished": sorted(final), "final": final}


def _count(n: int, thing: str) -> str:
  return f"{n} {thing}{'s' * (n != 1)}"


def _describe(result: dict[str, Any], task: Task) -> str:
  """Two lines: the rounds, restarts, heals and hashes; the final test metric."""
  heals = result["heal_seconds"]
  healed = f" ({max(heals):.2f} s at most)" if heals else ""
  agree = ("the state hashes agree on every committed round" if result["hashes_agree"]
           else "STATE HASHES DIFFER on a committed round")
  first = (f"fault-tolerant {result['algorithm']} on {task.name}, {result['replicas']} replicas"
           f" (quorum >= {result['min_replicas']}): {result['rounds_committed']} rounds"
           f" committed, {result['rounds_aborted']} aborted,"
           f" {_count(result['restarts'], 'restart')}, {_count(len(heals), 'heal')}{healed};"
           f" {agree}")
  if not result["final"]:
    return first + "\nno replica finished"
  values = {f"{v[f'test_{task.metric_key}']:.4f}" for v in result["final"].values()}
  second = (f"final {task.metric_label} of the evaluated params: {', '.join(sorted(values))}"
            f" (replicas {', '.join(map(str, result['finished']))} finished)")
  return first + "\n" + second
