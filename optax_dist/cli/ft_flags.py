"""The flags of ``--fault-tolerant`` (``train``'s and ``replica``'s): their parser group, their
defaults (:class:`~optax_dist.fault_tolerance.launcher.LaunchConfig`'s, written there once),
their resolution and the settings they refuse, and the launcher's configuration of a command
line (:func:`launch_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from optax_dist.cli import algorithms, checks, errors
from optax_dist.cli.arguments import (integer_at_least_0, non_negative_float, positive_float,
                                      positive_int)
from optax_dist.cli.errors import CommandError
from optax_dist.fault_tolerance import SUPPORTED, halves
from optax_dist.fault_tolerance.decoupled import (AUTO, DEFAULT_GRACE_GAMMA,
                                                  DEFAULT_STALENESS_RULE, STALENESS_RULES)
from optax_dist.fault_tolerance.launcher import LaunchConfig, majority

FT_HINT = 'needs the "ft" extra: pip install "optax-dist[ft]"'

_FIELDS = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}
DEFAULTS = {name: _FIELDS[name] for name in (
  "min_replicas", "host", "quorum_timeout", "exchange_timeout", "join_timeout",
  "lighthouse_heartbeat_timeout", "max_restarts", "restart_delay", "finish_grace",
  "replica_netns", "standby", "exchange_retries")}
"""The fault-tolerance flags' defaults, :class:`LaunchConfig`'s (``min_replicas``:
:func:`~optax_dist.fault_tolerance.launcher.majority` of R); each flag's parser default is
``None``, so that one given without ``--fault-tolerant`` is refused."""


DECOUPLED = {"decoupled": False, "min_quorum": None, "grace_window": math.inf,
             "staleness_rule": "delayed_nesterov", "grace_gamma": DEFAULT_GRACE_GAMMA}
"""The decoupled rounds' flags and their defaults (``min_quorum``: R; ``staleness_rule``: see
:func:`default_staleness_rule`); each flag's parser default is ``None``, so that one given
without ``--fault-tolerant`` (or, but ``--decoupled``, without ``--decoupled``) is refused.
``--staleness-rule age_gate``'s bound is ``train``'s ``--max-staleness``; ``--grace-gamma`` is
refused without ``--grace-window auto``."""


def default_staleness_rule(algorithm: str) -> str:
  """``--staleness-rule``'s default for ``algorithm``: ``delayed_nesterov``, with which the
  replicas' outer optimizer is delayed Nesterov (:func:`optax_dist.cli.ft_task.protocol`): with
  the default outer optimizer (Nesterov 0.7, momentum 0.9), K = 1 and W = 0 at the speeds the
  torchft benchmark measures (``diloco`` on ``lm``, seeds 0, 1, 2), 8.0% above synchronous
  rounds at equal committed tokens, where ``token_share`` is 29.3% above
  (``benchmarks/results/decoupled_staleness_nesterov.md``). With
  ``--outer-momentum 0`` use ``token_share`` (``docs/decoupled.md``). ``local_sgd`` has no outer
  optimizer: the library's ``decoupled.DEFAULT_STALENESS_RULE``."""
  takes_outer = algorithm in SUPPORTED and halves.row(algorithm).takes_outer
  return DECOUPLED["staleness_rule"] if takes_outer else DEFAULT_STALENESS_RULE


def _grace_window(text: str) -> float | str:
  """``--grace-window``'s type: seconds >= 0, ``inf``, or ``auto`` (kept as the string)."""
  if text == AUTO:
    return AUTO
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not value >= 0:
    raise argparse.ArgumentTypeError(f"must be seconds >= 0, inf or auto, got {text!r}")
  return value


def _add_decoupled(group: Any) -> None:
  """Adds the decoupled rounds' flags to the fault-tolerance flags' ``group``."""
  group.add_argument("--decoupled", action="store_const", const=True, default=None,
                     help="decoupled rounds: a replica does not wait for the slowest; a round"
                     " closes when every live replica's payload is in, or when --min-quorum K"
                     " are and --grace-window has run out since the K-th (docs/decoupled.md)"
                     " (default: off)")
  group.add_argument("--min-quorum", type=positive_int, default=None, metavar="K",
                     help="with --decoupled: the payloads that may close a round before every"
                     " live replica's is in (default: --replicas)")
  group.add_argument("--grace-window", type=_grace_window, default=None, metavar="SECONDS",
                     help="with --decoupled: seconds a round stays open after its K-th payload,"
                     " inf, or auto: --grace-gamma times the least slack the replicas measure"
                     " (a replica's inner-step time times its steps to its next boundary, less"
                     " its round's transport time; docs/decoupled.md) (default: inf)")
  group.add_argument("--grace-gamma", type=non_negative_float, default=None, metavar="GAMMA",
                     help="with --grace-window auto: the window over the slack (default:"
                     f" {DEFAULT_GRACE_GAMMA:g})")
  group.add_argument("--staleness-rule", choices=STALENESS_RULES, default=None,
                     help="with --decoupled: the weight of a stale payload; delayed_nesterov"
                     " also makes the outer optimizer delayed Nesterov of buffer size"
                     " --replicas (default: delayed_nesterov; with local_sgd, which has no"
                     f" outer optimizer, {DEFAULT_STALENESS_RULE})")


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
                     help="the address (IPv4 or IPv6) the Lighthouse and the replicas' servers"
                     " bind and advertise, or a name resolved to it once; never one that binds"
                     f" every interface (0, 0.0.0.0, ::) (default: {d['host']})")
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
  _add_decoupled(group)


def resolve(args: argparse.Namespace) -> None:
  """Fills in the defaults of the fault-tolerance flags in ``args``.

  Raises:
    CommandError: a fault-tolerance flag without ``--fault-tolerant``; ``train``'s
      ``--process-id`` or ``--coordinator`` with it (the launcher gives each replica group its
      own), a ``replica`` of ``--processes`` > 1 without them, ``--fsdp`` with ``--processes``
      > 1; an algorithm the protocol does not run; a setting it does not take (:data:`_REFUSED`,
      each with its reason); ``--min-replicas``
      above ``--replicas``; ``--replica-id`` outside ``0..R-1``; ``--resume`` without
      ``--checkpoint-every``; the ``ft`` extra missing.
  """
  if not args.fault_tolerant:
    given = [name for name in (*DEFAULTS, *DECOUPLED) if getattr(args, name, None) is not None]
    if given:
      raise CommandError(f"argument {algorithms.flag(given[0])}: needs --fault-tolerant")
    return
  _resolve_decoupled(args)
  for name, value in DEFAULTS.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.min_replicas is None:
    args.min_replicas = majority(args.replicas)
  _refuse(args)
  _check_resume(args)
  errors.require(("torch", "torchft"), f"--fault-tolerant {FT_HINT}")


def _resolve_decoupled(args: argparse.Namespace) -> None:
  """Fills in the decoupled rounds' flags; with ``--decoupled``, ``--exchange-retries`` defaults
  to 0. ``--min-replicas`` keeps its meaning and default, the Lighthouse's smallest quorum (a
  majority: two quorums share a member, so a restarted replica never forms one of its own);
  a decoupled round commits with one payload of weight > 0 and closes by K and the window.

  Raises:
    CommandError: a decoupled flag without ``--decoupled``; with it, a setting decoupled rounds
      over torchft do not take (``--processes`` > 1, ``--standby``, ``--checkpoint-every``,
      ``--resume``, ``--exchange-retries`` > 0, ``--overlap`` > 0), ``--min-quorum`` above
      ``--replicas``, a negative ``--max-staleness``, or ``--grace-gamma`` without
      ``--grace-window auto``.
  """
  if not args.decoupled:
    given = [name for name in DECOUPLED if getattr(args, name) is not None]
    if given:
      raise CommandError(f"argument {algorithms.flag(given[0])}: needs --decoupled")
    args.decoupled = False
    return
  if args.grace_gamma is not None and args.grace_window != AUTO:
    shown = "" if args.grace_window is None else f", got --grace-window {args.grace_window:g}"
    raise CommandError(f"argument --grace-gamma: needs --grace-window auto{shown}")
  refused = (("processes", args.processes > 1), ("standby", args.standby),
             ("checkpoint_every", args.checkpoint_every), ("resume", args.resume),
             ("exchange_retries", args.exchange_retries), ("overlap", args.overlap))
  for name, given in refused:
    if given:
      value, flag = getattr(args, name), algorithms.flag(name)
      shown = flag if isinstance(value, bool) else f"{flag} {value}"
      raise CommandError(f"argument {flag}: not with --decoupled, got {shown}; decoupled rounds"
                         " over torchft do not take it yet")
  defaults = DECOUPLED | {"min_quorum": args.replicas,
                         "staleness_rule": default_staleness_rule(args.algorithm)}
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  args.exchange_retries = 0
  if args.min_quorum > args.replicas:
    raise CommandError(f"argument --min-quorum: must be at most --replicas ({args.replicas}),"
                       f" got {args.min_quorum}")
  if args.max_staleness < 0:
    raise CommandError(f"argument --max-staleness: must be an integer >= 0 with --decoupled, got"
                       f" {args.max_staleness}")


_REFUSED = (
  ("exchange_device", lambda a: a.exchange_device,
   "a round's exchange is torchft's, between the replica processes, outside their programs"),
  ("eager", lambda a: a.eager,
   ("the eager rule (Kale et al. 2025) applies the local pseudo-gradient while the exchange is in"
    " flight; fault-tolerant rounds do not implement it")),
  ("warmup_steps", lambda a: a.warmup_steps,
   ("local_sgd's warm-up averages the gradients inside each step, before the inner update, and"
    " a round exchanges only after a step")),
  ("save_params", lambda a: a.save_params is not None,
   "the final state is the last checkpoint's (--checkpoint-every, under OUT/replicas/checkpoints)"),
  ("fail_at_step", lambda a: a.fail_at_step is not None,
   ("it scripts a process exit for the multi-process watchdog; kill a replica instead (the"
    " launcher restarts it)")),
)
"""The settings ``--fault-tolerant`` refuses: ``(name, given(args), why)``, ``why`` the reason
said after the value, in one clause. Accepted: ``--fsdp`` (each replica's params and optimizer
state sharded over its devices) and ``--param-dtype`` (``diloco``'s and ``streaming_diloco``'s
anchor in float32 then, as ``train`` keeps it)."""


def _refuse_processes(args: argparse.Namespace) -> None:
  """The multi-process flags a fault-tolerant run refuses: each replica is a group of
  ``--processes`` processes, which the launcher starts with their coordinator."""
  replica = hasattr(args, "replica_id")  # optax-dist replica: one process of a group
  given = next((f for f in ("process_id", "coordinator") if getattr(args, f) is not None), None)
  if given and not replica:
    raise CommandError(
      f"argument {algorithms.flag(given)}: not with --fault-tolerant, whose launcher starts"
      " each replica's --processes P processes with a coordinator of their own")
  if replica and args.processes > 1 and args.process_id is None:
    raise CommandError(
      f"argument --process-id: needed with --processes {args.processes} (this process's rank"
      " in its replica group), with --coordinator HOST:PORT")
  if args.processes > 1 and args.fsdp:
    raise CommandError(
      f"argument --fsdp: not with --fault-tolerant --processes {args.processes}, got --fsdp"
      f" {args.fsdp}; a replica's processes each exchange its whole payload, read from params"
      " they all hold (sharded over them, each would hold a part only: not built)")


def _refuse(args: argparse.Namespace) -> None:
  _refuse_processes(args)
  try:
    halves.row(args.algorithm)
  except ValueError:
    raise CommandError(
      f"argument --algorithm: --fault-tolerant runs {', '.join(SUPPORTED)} only, got"
      f" {args.algorithm}") from None
  for name, given, why in _REFUSED:
    if given(args):
      value, flag = getattr(args, name), algorithms.flag(name)
      shown = flag if isinstance(value, bool) else f"{flag} {value}"
      raise CommandError(f"argument {flag}: not with --fault-tolerant, got {shown}; {why}")
  if args.min_replicas > args.replicas:
    raise CommandError(
      f"argument --min-replicas: must be at most --replicas ({args.replicas}), got"
      f" {args.min_replicas}")
  replica_id = getattr(args, "replica_id", None)
  if replica_id is not None and not 0 <= replica_id < args.replicas:
    raise CommandError(
      f"argument --replica-id: must be in 0..{args.replicas - 1} (--replicas"
      f" {args.replicas}), got {replica_id}")


def _check_resume(args: argparse.Namespace) -> None:
  """``--resume`` continues the run under ``OUT/replicas/checkpoints``, which its replicas
  restore from and go on writing: it needs ``--checkpoint-every``."""
  if args.resume and not args.checkpoint_every:
    raise CommandError(
      "argument --resume: with --fault-tolerant, needs --checkpoint-every N (the replicas"
      " restore from OUT/replicas/checkpoints and go on writing there)")


def launch_config(args: argparse.Namespace, replica_command: tuple[str, ...]) -> LaunchConfig:
  """The launcher's configuration of the resolved ``args``: their fault-tolerance flags, and
  every replica started as ``replica_command`` with the command line's flags (``args.argv``
  after the subcommand).

  Raises:
    CommandError: naming the flag of a value :class:`LaunchConfig` refuses (a ``--host``
      that is unspecified or does not resolve, a ``--replica-netns`` without ``{i}`` or naming
      a missing namespace).
  """
  try:
    return LaunchConfig(replicas=args.replicas, processes=args.processes, out=args.out,
                        replica_command=replica_command,
                        replica_args=tuple(args.argv[1:]),
                        **{name: getattr(args, name) for name in DEFAULTS})
  except (TypeError, ValueError) as e:
    raise CommandError(f"argument {checks.library_flag(e) or '--replicas'}: {e}") from None
