"""The command line of ``optax-dist``: the flags' types, the flags of ``train`` and ``compare``
(:func:`training_parser`) and the help's notes.

Each subcommand's module adds its parser (``add_parser(subparsers)``); the parser is
:class:`Parser`. Parsing imports nothing of the ``examples`` extra; a bad value is one line,
``optax-dist: error: ...``, with exit status 2.
"""

from __future__ import annotations

import argparse
import math

from optax_dist.cli import algorithms, config
from optax_dist.cli.algorithms import ALGORITHMS
from optax_dist.cli.errors import PROG
from optax_dist.cli.processes import parse_address
from optax_dist.cli.tasks import TASKS


class Parser(argparse.ArgumentParser):
  """An ``ArgumentParser`` whose errors are one line, ``optax-dist: error: ...``, exit code 2."""

  def error(self, message: str):
    self.exit(2, f"{PROG}: error: {message}\n")


def _number(cast, what: str, ok=lambda value: True):
  """An argparse type: ``cast(text)``, refused with ``must be {what}`` unless ``ok(value)``."""

  def parse(text: str):
    try:
      value = cast(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not ok(value):
      raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value

  return parse


positive_int = _number(int, "a positive integer", lambda v: v >= 1)
integer = _number(int, "an integer")
positive_float = _number(float, "a positive number", lambda v: v > 0 and math.isfinite(v))
unit_float = _number(float, "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0)
non_negative_float = _number(float, "a number >= 0", lambda v: v >= 0 and math.isfinite(v))
integer_at_least_0 = _number(int, "an integer >= 0", lambda v: v >= 0)


def worker_times(text: str) -> tuple[tuple[int, float], ...]:
  """``"W@T,W@T"`` (worker W at simulated time T: a restart, leave or join) as ``((W, T), ...)``."""
  pairs = []
  for item in filter(None, text.split(",")):
    worker, sep, at = item.partition("@")
    try:
      pairs.append((int(worker), float(at)))
    except ValueError:
      sep = ""
    if not sep or pairs[-1][0] < 0 or not pairs[-1][1] >= 0:
      raise argparse.ArgumentTypeError(
        f"must be WORKER@TIME pairs separated by commas (e.g. 1@100,2@250), got {text!r}")
  return tuple(pairs)


def address(text: str) -> str:
  try:
    parse_address(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return text


EPILOG = """\
multi-process:
  --processes P starts P local processes (subprocesses of this command), each with --devices CPU
  devices, connected by jax.distributed on a loopback coordinator with gloo collectives: P x
  devices workers on one global mesh. Only process 0 prints and writes results. On a cluster, run
  on every host the same command with --processes P --process-id I --coordinator HOST:PORT
  (HOST:PORT: an address of the host of process 0, where the coordinator listens); --out must
  then be on a shared file system for the checkpoints.

faults and resuming:
  With local processes, if one process exits with an error or is killed, the others are stopped
  within about a second and the command exits with status 1, naming the process and its exit
  code. Processes started one by one with --process-id abort (SIGABRT, with JAX's message naming
  the unhealthy process) within about --heartbeat-timeout seconds of the death of another, and
  at once if process 0, which runs the coordinator, dies.
  --checkpoint-every N saves the state (params, optimizer state, step and record; the
  minibatches and delays are functions of --seed and the step) with Orbax under
  OUT/checkpoints/ALGORITHM every N steps and at the end; rerunning the same command with
  --resume continues from the last checkpoint and ends with the params of an uninterrupted run.
  A run without --resume replaces those checkpoints. With --fault-tolerant, --checkpoint-every
  N has the quorum's rank 0 write the global state (a heal payload), and every member its own
  local state, under OUT/replicas/checkpoints after each committed round that crosses a
  multiple of N steps, and a replica that starts or is restarted begins from the newest one,
  so the run survives the death of every replica at once; --resume starts a run whose launcher
  died again, as if never stopped, and a new run refuses an OUT that holds its checkpoints.
"""


class Formatter(argparse.HelpFormatter):
  """Wraps the descriptions; keeps the line breaks of the notes (:data:`EPILOG`)."""

  def _fill_text(self, text, width, indent):
    if "\n" in text:
      return "".join(indent + line for line in text.splitlines(keepends=True))
    return super()._fill_text(text, width, indent)


def task_argument(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--task", choices=tuple(TASKS), default="digits",
                      help="what to train on: " + "; ".join(
                        f"{t.name}: {t.dataset}, {t.model_name}" for t in TASKS.values())
                      + " (default: digits)")


def _training_arguments(common: argparse.ArgumentParser) -> None:
  """The flags of ``train`` and ``compare`` that set :class:`optax_dist.cli.config.Settings`."""
  d, lm = config.DEFAULTS, TASKS["lm"].defaults
  task_argument(common)
  common.add_argument("--devices", type=positive_int, default=d["devices"],
                      help="number of emulated CPU devices per process, one worker each"
                      f" (default: {d['devices']})")
  across = ", ".join(a.name for a in ALGORITHMS.values() if a.across_replicas)
  common.add_argument("--replicas", type=positive_int, default=d["replicas"], metavar="R",
                      help="split the workers into R replicas of equal size: every step reduces"
                      " the gradients within each replica (tower), and the algorithm"
                      f" ({across}) runs across the replicas; the other algorithms reduce over"
                      " every worker. With --processes P --replicas P each process holds one"
                      " replica; with train --fault-tolerant, R replicas of --processes x --devices"
                      f" devices each (default: {d['replicas']}: the algorithm runs across the"
                      " workers)")
  refused = ", ".join(a.name for a in ALGORITHMS.values() if a.stale_gradients)
  common.add_argument("--fsdp", type=positive_int, default=None, metavar="K",
                      help="train on the global view: one jitted jax.vmap step over the"
                      " replicas, each replica's params and optimizer state sharded over K of"
                      " its devices (FSDP; the state over all of the replica's devices where"
                      " they divide it), its minibatch over all of them; the compiler reduces"
                      " the gradients within a replica and the algorithm runs across the"
                      " replicas (sync: tower over the replicas). K must divide the devices of a"
                      " replica; the same examples as without --fsdp, so the same losses to float"
                      " rounding."
                      f" {refused} does not run there (default: one shard_map step, every"
                      " device holding whole params)")
  common.add_argument("--steps", type=positive_int, default=None,
                      help=f"training steps per worker (default: {d['steps']})")
  common.add_argument("--batch-size", type=positive_int, default=None,
                      help=f"minibatch size per worker (default: {d['batch_size']})")
  common.add_argument("--learning-rate", type=positive_float, default=None,
                      help="the inner optimizer's (peak) learning rate (default:"
                      f" {d['learning_rate']:g}; the lm task: {lm['learning_rate']:g})")
  recipe = common.add_argument_group(
    "the inner optimizer (every algorithm's; the DiLoCo family's inner step)")
  recipe.add_argument("--optimizer", choices=algorithms.OPTIMIZERS, default=None,
                      help=f"the inner optimizer (default: {d['optimizer']}; the lm task:"
                      f" {lm['optimizer']})")
  recipe.add_argument("--b2", type=unit_float, default=None,
                      help="adam's and adamw's second-moment decay (default:"
                      f" {d['b2']:g}; the lm task: {lm['b2']:g})")
  recipe.add_argument("--weight-decay", type=non_negative_float, default=None,
                      help="adamw's decoupled weight decay, or sgd's (added to the gradient);"
                      f" adam has none (default: {d['weight_decay']:g}; the lm task:"
                      f" {lm['weight_decay']:g})")
  recipe.add_argument("--lr-schedule", choices=algorithms.LR_SCHEDULES, default=None,
                      help="constant, or warmup_cosine: a linear warm-up from 0 over"
                      " --lr-warmup-steps, then cosine decay to"
                      f" {algorithms.LR_END_FRACTION * 100:g}%% of --learning-rate at --steps"
                      f" (default: {d['lr_schedule']}; the lm task: {lm['lr_schedule']})")
  recipe.add_argument("--lr-warmup-steps", type=integer_at_least_0, default=None,
                      help="warmup_cosine's warm-up steps (default:"
                      f" {config.LR_WARMUP_FRACTION * 100:g}%% of --steps with warmup_cosine)")
  recipe.add_argument("--clip-norm", type=positive_float, default=None,
                      help="clip the gradients to this global norm before the optimizer"
                      f" (default: no clipping; the lm task: {lm['clip_norm']:g})")
  common.add_argument("--communication-period", type=positive_int, default=None,
                      help="steps between exchanges of elastic_average and agn (default:"
                      f" {config.COMMUNICATION_PERIOD}, or --steps if fewer)")
  common.add_argument("--sync-period", type=positive_int, default=None,
                      help="steps between syncs of local_sgd, diloco and streaming_diloco"
                      f" (default: {config.COMMUNICATION_PERIOD}, or --steps if fewer; the lm"
                      " task: 50)")
  common.add_argument("--outer-learning-rate", type=positive_float,
                      default=d["outer_learning_rate"],
                      help="DiLoCo's outer Nesterov SGD learning rate (default:"
                      f" {d['outer_learning_rate']:g}, the paper's)")
  common.add_argument("--outer-momentum", type=unit_float, default=d["outer_momentum"],
                      help="DiLoCo's outer Nesterov momentum, 0 for plain SGD (default:"
                      f" {d['outer_momentum']:g})")
  common.add_argument("--num-fragments", type=positive_int, default=d["num_fragments"],
                      help="streaming_diloco's number of fragments, synced in turn (default:"
                      f" {d['num_fragments']})")
  common.add_argument("--warmup-steps", type=integer, default=d["warmup_steps"],
                      help="local_sgd's synchronous steps before model averaging starts"
                      f" (default: {d['warmup_steps']})")
  common.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                      help="dtype of the params (bfloat16: the EMA and the DiLoCo anchor stay"
                      " float32; default: float32)")
  common.add_argument("--moving-rate", type=positive_float, default=None,
                      help="elastic_average's moving rate (default: 0.9 / workers)")
  common.add_argument("--decay", type=unit_float, default=d["decay"],
                      help=f"moving_average's EMA decay (default: {d['decay']:g}, with TF's"
                      " num_updates cap)")
  common.add_argument("--max-staleness", type=integer, default=d["max_staleness"],
                      help="drop_stale_gradients' largest accepted staleness (default:"
                      f" {d['max_staleness']})")
  common.add_argument("--eval-every", type=positive_int, default=None,
                      help=f"steps between test-accuracy evaluations (default: {d['eval_every']})")
  common.add_argument("--seed", type=integer, default=d["seed"],
                      help="seed of the train/test split, init and minibatches (default: 0)")
  _exchange_arguments(common)


def _exchange_arguments(common: argparse.ArgumentParser) -> None:
  """The flags of the exchange: its format, and the options some algorithms take (the
  algorithms named in each help are those of the table that read the setting)."""
  d, takers = config.DEFAULTS, algorithms.takers
  exchange = common.add_argument_group("the exchange (what the workers send each other)")
  exchange.add_argument(
    "--comm-dtype", choices=algorithms.COMM_DTYPES, default="float32",
    help="format of the exchanged values (gradients, center differences, pseudo-gradients or"
    f" params): {', '.join(algorithms.FLOAT_COMM_DTYPES)}, a cast (8-bit floats are gathered and"
    f" summed in float32); or {', '.join(algorithms.QUANTIZED_COMM_DTYPES)}, block-quantized:"
    " codes of 8 or 4 bits with one float32 scale per --comm-block-size values, taken by"
    f" {', '.join(algorithms.quantizing())}; with --replicas, the format of the exchange across"
    " replicas, the reduction within a replica staying float32 (default: float32)")
  exchange.add_argument(
    "--comm-block-size", type=positive_int, default=d["comm_block_size"], metavar="N",
    help="values per float32 scale of a block-quantized --comm-dtype, even for the 4-bit ones"
    f" (default: {d['comm_block_size']})")
  exchange.add_argument(
    "--error-feedback", action="store_true",
    help=f"{', '.join(takers('error_feedback'))}: each worker keeps what quantization dropped"
    " from its pseudo-gradient and adds it to the next one; needs a block-quantized"
    " --comm-dtype (default: off)")
  exchange.add_argument(
    "--overlap", type=integer_at_least_0, default=d["overlap"], metavar="TAU",
    help=f"{', '.join(takers('overlap'))}: steps between a fragment's send and the step that"
    " applies it, the workers training on meanwhile; less than --sync-period (default:"
    f" {d['overlap']}: the same step)")
  exchange.add_argument(
    "--eager", action="store_true",
    help=f"{', '.join(takers('eager'))} with --overlap >= 1: on the landing step each worker"
    " replaces its own stale share of the mean by its fresh one (the eager update; default:"
    " off)")
  exchange.add_argument(
    "--exchange-device", action="store_true",
    help=f"{', '.join(takers('exchange_device'))} with --overlap >= 1 and --replicas equal to"
    " --processes > 1: each exchange across the replicas runs as its own computation on one"
    " extra emulated CPU device per process, beside the next --overlap steps, instead of inside"
    " its send step (XLA CPU runs a process's multi-device computations one at a time, so an"
    " exchange on the training devices would wait for the steps); costs one more device per"
    " process and a copy of the fragment there and back (default: off)")
  exchange.add_argument(
    "--mixing", type=unit_float, default=d["mixing"], metavar="ALPHA",
    help=f"{', '.join(takers('mixing'))}: the weight of a worker's own params when a fragment"
    f" lands, the new anchor's being 1 - ALPHA (default: {d['mixing']:g}: the anchor)")


def output_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--out", default="runs",
                      help="directory for the JSON results and the PNG plot (default: runs)")
  parser.add_argument("--no-progress", action="store_true",
                      help="hide what a run shows on stderr as it goes: the run in one line, its"
                      " phases (building the model, compiling, evaluating) and the progress bars")


def _multiprocess_arguments(common: argparse.ArgumentParser) -> None:
  multi = common.add_argument_group("multi-process, checkpoints (see the notes below)")
  multi.add_argument("--processes", type=positive_int, default=1, metavar="P",
                     help="number of JAX processes (default: 1); without --process-id, starts"
                     " them all locally. With --fault-tolerant, the processes of each replica"
                     " (a replica group: the launcher starts them, with a coordinator of their"
                     " own, and restarts them together when one dies)")
  multi.add_argument("--process-id", type=integer, default=None, metavar="I",
                     help="run only process I of --processes, connecting to --coordinator")
  multi.add_argument("--coordinator", type=address, default=None, metavar="HOST:PORT",
                     help="address of process 0's coordinator (default for local processes:"
                     " 127.0.0.1 and a free port)")
  multi.add_argument("--heartbeat-timeout", type=positive_int, default=None, metavar="SECONDS",
                     help="seconds without a heartbeat after which a process is declared dead"
                     " and the others abort (default: 10)")
  multi.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="N",
                     help="save an Orbax checkpoint under OUT/checkpoints every N steps and at"
                     " the end; with --fault-tolerant, the global state under"
                     " OUT/replicas/checkpoints (default: no checkpoints)")
  multi.add_argument("--resume", action="store_true",
                     help="continue from the last checkpoint under OUT/checkpoints; with"
                     " --fault-tolerant (and --checkpoint-every), the run in OUT: the Lighthouse"
                     " and every replica start again, each from the newest checkpoint all the"
                     " replicas of its round wrote their local state for (one without it heals"
                     " from a peer), with the same settings (checked), appending to the lines")
  multi.add_argument("--fail-at-step", type=positive_int, default=None, metavar="N",
                     help="a scripted fault: process P-1 exits with status 1 after step N, to"
                     " try the watchdog and --resume (default: none)")
  common.add_argument("--save-params", default=None, metavar="PATH",
                      help="also write each algorithm's final params and optimizer state to PATH"
                      " (npz: one array per leaf, keyed by the algorithm and the leaf's path;"
                      " default: none)")


def training_parser() -> argparse.ArgumentParser:
  """The parent parser of ``train`` and ``compare``: the settings, the output, the processes."""
  common = Parser(add_help=False)
  _training_arguments(common)
  output_arguments(common)
  _multiprocess_arguments(common)
  return common
