"""The ``optax-dist`` command: data-parallel training on scikit-learn's ``digits``.

``optax-dist train --algorithm NAME`` trains with one algorithm; ``optax-dist compare`` trains with
``sync``, ``elastic_average``, ``agn`` and ``moving_average`` and compares them. Each run emulates
``--devices`` CPU devices, one worker each (see :mod:`optax_dist._digits`), prints a table, and
writes a JSON file of the results and a PNG of the test accuracy under ``--out``.

With ``--processes P`` the workers are the devices of ``P`` ``jax.distributed`` processes (see
:mod:`optax_dist._multiprocess`); with ``--checkpoint-every N`` the state is saved with Orbax and
``--resume`` continues an interrupted run exactly.

The arguments are checked before any training starts; JAX is told how many CPU devices to create
before it initialises its backends. Needs the ``examples`` extra.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import Any

PROG = "optax-dist"

_ALGORITHMS = ("sync", "elastic_average", "agn", "moving_average", "drop_stale_gradients")
_COMPARED = ("sync", "elastic_average", "agn", "moving_average")


class _Parser(argparse.ArgumentParser):
  """An ``ArgumentParser`` whose errors are one line, ``optax-dist: error: ...``, exit code 2."""

  def error(self, message: str):
    self.exit(2, f"{PROG}: error: {message}\n")


def _fail(message: str) -> None:
  sys.stderr.write(f"{PROG}: error: {message}\n")
  raise SystemExit(2)


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
  return value


def _int(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _positive_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
  if not (value > 0 and math.isfinite(value)):
    raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
  return value


def _unit_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
  if not 0.0 <= value <= 1.0:
    raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
  return value


def _restarts(text: str) -> tuple[tuple[int, float], ...]:
  """``"W@T,W@T"`` (worker W restarts at simulated time T) as ``((W, T), ...)``."""
  restarts = []
  for item in filter(None, text.split(",")):
    worker, sep, at = item.partition("@")
    try:
      restarts.append((int(worker), float(at)))
    except ValueError:
      sep = ""
    if not sep or restarts[-1][0] < 0 or not restarts[-1][1] >= 0:
      raise argparse.ArgumentTypeError(
        f"must be WORKER@TIME pairs separated by commas (e.g. 1@100,2@250), got {text!r}")
  return tuple(restarts)


def _address(text: str) -> str:
  from optax_dist._multiprocess import parse_address

  try:
    parse_address(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return text


_EPILOG = """\
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
  A run without --resume replaces those checkpoints.
"""


class _Formatter(argparse.HelpFormatter):
  """Wraps the descriptions; keeps the line breaks of the notes (``_EPILOG``)."""

  def _fill_text(self, text, width, indent):
    if "\n" in text:
      return "".join(indent + line for line in text.splitlines(keepends=True))
    return super()._fill_text(text, width, indent)


def build_parser() -> argparse.ArgumentParser:
  """The argument parser of ``optax-dist``."""
  common = _Parser(add_help=False)
  common.add_argument("--devices", type=_positive_int, default=8,
                      help="number of emulated CPU devices per process, one worker each"
                      " (default: 8)")
  common.add_argument("--steps", type=_positive_int, default=200,
                      help="training steps per worker (default: 200)")
  common.add_argument("--batch-size", type=_positive_int, default=16,
                      help="minibatch size per worker (default: 16)")
  common.add_argument("--learning-rate", type=_positive_float, default=1e-2,
                      help="Adam learning rate (default: 0.01)")
  common.add_argument("--communication-period", type=_positive_int, default=10,
                      help="steps between exchanges of elastic_average and agn (default: 10)")
  common.add_argument("--moving-rate", type=_positive_float, default=None,
                      help="elastic_average's moving rate (default: 0.9 / workers)")
  common.add_argument("--decay", type=_unit_float, default=0.99,
                      help="moving_average's EMA decay (default: 0.99, with TF's num_updates cap)")
  common.add_argument("--max-staleness", type=_int, default=2,
                      help="drop_stale_gradients' largest accepted staleness (default: 2)")
  common.add_argument("--eval-every", type=_positive_int, default=10,
                      help="steps between test-accuracy evaluations (default: 10)")
  common.add_argument("--comm-dtype", choices=("float32", "bfloat16"), default="float32",
                      help="dtype of the exchanged gradients/center differences (default:"
                      " float32; bfloat16 halves the bytes on GPU/TPU)")
  common.add_argument("--seed", type=_int, default=0,
                      help="seed of the train/test split, init and minibatches (default: 0)")
  common.add_argument("--out", default="runs",
                      help="directory for the JSON results and the PNG plot (default: runs)")
  common.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  multi = common.add_argument_group("multi-process, checkpoints (see the notes below)")
  multi.add_argument("--processes", type=_positive_int, default=1, metavar="P",
                     help="number of JAX processes (default: 1); without --process-id, starts"
                     " them all locally")
  multi.add_argument("--process-id", type=_int, default=None, metavar="I",
                     help="run only process I of --processes, connecting to --coordinator")
  multi.add_argument("--coordinator", type=_address, default=None, metavar="HOST:PORT",
                     help="address of process 0's coordinator (default for local processes:"
                     " 127.0.0.1 and a free port)")
  multi.add_argument("--heartbeat-timeout", type=_positive_int, default=None, metavar="SECONDS",
                     help="seconds without a heartbeat after which a process is declared dead"
                     " and the others abort (default: 10)")
  multi.add_argument("--checkpoint-every", type=_positive_int, default=None, metavar="N",
                     help="save an Orbax checkpoint under OUT/checkpoints every N steps and at"
                     " the end (default: no checkpoints)")
  multi.add_argument("--resume", action="store_true",
                     help="continue from the last checkpoint under OUT/checkpoints")
  # For tests: write the final params and optimizer state (npz); exit process P-1 after a step.
  common.add_argument("--save-params", default=None, help=argparse.SUPPRESS)
  common.add_argument("--fail-at-step", type=_positive_int, default=None, help=argparse.SUPPRESS)

  parser = _Parser(
    prog=PROG,
    description="Data-parallel training of an MLP on scikit-learn's digits with the optax_dist"
    " transformations, over emulated CPU devices of one or more JAX processes.",
    epilog=_EPILOG, formatter_class=_Formatter,
  )
  commands = parser.add_subparsers(dest="command", required=True,
                                   metavar="{train,compare,async}")
  train = commands.add_parser(
    "train", parents=[common], help="train with one algorithm",
    description="Train with one algorithm; writes results_<algorithm>.json and"
    " accuracy_<algorithm>.png under --out.",
    epilog=_EPILOG, formatter_class=_Formatter,
  )
  train.add_argument("--algorithm", choices=_ALGORITHMS, default="sync",
                     help="the algorithm (default: sync)")
  commands.add_parser(
    "compare", parents=[common], help=f"compare {', '.join(_COMPARED)}",
    description=f"Train with {', '.join(_COMPARED)} and compare them; writes results.json and"
    " accuracy.png under --out.",
    epilog=_EPILOG, formatter_class=_Formatter,
  )
  _add_async_parser(commands)
  return parser


def _add_async_parser(commands: Any) -> None:
  """``optax-dist async``: the asynchronous protocols, emulated (:mod:`optax_dist._async_digits`)."""
  from optax_dist._async_digits import DEFAULTS, PROTOCOLS

  run = commands.add_parser(
    "async", help="compare asynchronous protocols, emulated",
    description=f"Emulate asynchronous parameter-server training of the digits MLP with"
    f" {', '.join(PROTOCOLS)} on one simulated cluster (per-worker compute times, stragglers,"
    " restarts) and compare them at the same simulated time; writes results_async.json and"
    " async.png under --out.",
  )
  run.add_argument("--workers", type=_positive_int, default=DEFAULTS["workers"],
                   help=f"number of asynchronous workers (default: {DEFAULTS['workers']})")
  run.add_argument("--max-staleness", type=_int, default=DEFAULTS["max_staleness"],
                   help="drop_stale_gradients' largest accepted staleness, in server steps"
                   f" (default: {DEFAULTS['max_staleness']})")
  run.add_argument("--stragglers", type=_int, default=DEFAULTS["stragglers"],
                   help=f"number of slow workers (default: {DEFAULTS['stragglers']})")
  run.add_argument("--slowdown", type=_positive_float, default=DEFAULTS["slowdown"],
                   help=f"how many times slower a straggler is (default: {DEFAULTS['slowdown']:g})")
  run.add_argument("--restarts", type=_restarts, default=DEFAULTS["restarts"],
                   metavar="W@T[,W@T...]",
                   help="restart worker W at simulated time T (default: none)")
  run.add_argument("--duration", type=_positive_float, default=DEFAULTS["duration"],
                   help="simulated time per protocol; one step takes about 1"
                   f" (default: {DEFAULTS['duration']:g})")
  run.add_argument("--batch-size", type=_positive_int, default=DEFAULTS["batch_size"],
                   help=f"minibatch size per worker (default: {DEFAULTS['batch_size']})")
  run.add_argument("--learning-rate", type=_positive_float, default=DEFAULTS["learning_rate"],
                   help=f"SGD learning rate (default: {DEFAULTS['learning_rate']:g})")
  run.add_argument("--communication-period", type=_positive_int,
                   default=DEFAULTS["communication_period"],
                   help="local steps between exchanges of elastic_average and agn"
                   f" (default: {DEFAULTS['communication_period']})")
  run.add_argument("--seed", type=_int, default=DEFAULTS["seed"],
                   help="seed of the data split, init, compute times and minibatches (default: 0)")
  run.add_argument("--out", default="runs",
                   help="directory for the JSON results and the PNG plot (default: runs)")


def _run_async(args: argparse.Namespace) -> int:
  """Runs ``optax-dist async``: prints the table, writes ``results_async.json``/``async.png``."""
  if not 0 <= args.stragglers <= args.workers:
    _fail(f"argument --stragglers: must be in 0..{args.workers} (--workers), got"
          f" {args.stragglers}")
  bad = [w for w, _ in args.restarts if w >= args.workers]
  if bad:
    _fail(f"argument --restarts: worker {bad[0]} does not exist (--workers {args.workers})")
  _check_out(args.out)
  from optax_dist import _async_digits

  png_path = os.path.join(args.out, "async.png")
  rows = _async_digits.run_async_digits(
    workers=args.workers, max_staleness=args.max_staleness, stragglers=args.stragglers,
    slowdown=args.slowdown, restarts=args.restarts, duration=args.duration,
    batch_size=args.batch_size, learning_rate=args.learning_rate,
    communication_period=args.communication_period, seed=args.seed, out=png_path,
  )
  json_path = os.path.join(args.out, "results_async.json")
  with open(json_path, "w") as f:
    json.dump({"command": "async", "config": {k: v for k, v in vars(args).items()
                                              if k != "command"},
               "protocols": {r["protocol"]: r for r in rows}}, f, indent=2)
  print(_async_digits.format_table(rows))
  print(f"wrote {json_path} and {png_path}")
  return 0


def _check_out(path: str) -> None:
  """Fails with one line unless ``path`` is (or can be made) a writable directory."""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    _fail(f"argument --out: cannot create directory {path!r}: {e.strerror or e}")
  if not os.path.isdir(path):
    _fail(f"argument --out: {path!r} is not a directory")
  try:
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    _fail(f"argument --out: directory {path!r} is not writable: {e.strerror or e}")


def _check_processes(args: argparse.Namespace) -> None:
  """Fails with one line unless the multi-process arguments fit together."""
  if args.process_id is not None:
    if args.coordinator is None:
      _fail("argument --process-id: needs --coordinator HOST:PORT, the address of process 0")
    if not 0 <= args.process_id < args.processes:
      _fail(f"argument --process-id: must be in 0..{args.processes - 1} (--processes"
            f" {args.processes}), got {args.process_id}")
  elif args.coordinator is not None and args.processes == 1:
    _fail("argument --coordinator: needs --processes > 1 or --process-id")


def _native_stdout_to_stderr() -> None:
  """Sends what native libraries write to stdout to stderr; Python's stdout stays stdout.

  gloo announces each connection on the C++ stdout, which would interleave with the table.
  """
  try:
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)
  except OSError:
    return
  sys.stdout = open(stdout, "w", buffering=1, encoding=sys.stdout.encoding)  # noqa: SIM115


def _init_jax(args: argparse.Namespace) -> None:
  """Asks JAX for ``--devices`` CPU devices and joins the other processes, if any.

  Must run before JAX initialises its backends.
  """
  import jax

  devices = args.devices
  try:
    if not os.environ.get("JAX_PLATFORMS"):
      jax.config.update("jax_platforms", "cpu")  # the workers are emulated CPU devices
    jax.config.update("jax_num_cpu_devices", devices)
  except RuntimeError:
    pass  # already initialised (called in-process); `_digits.train` checks the device count
  if args.process_id is not None:
    from optax_dist import _multiprocess

    _native_stdout_to_stderr()
    try:
      _multiprocess.initialize(
        args.coordinator, args.processes, args.process_id,
        heartbeat_timeout=args.heartbeat_timeout or _multiprocess.HEARTBEAT_TIMEOUT,
      )
    except Exception as e:  # noqa: BLE001  (JAX raises its runtime's errors)
      reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      _fail(f"argument --coordinator: process {args.process_id} of {args.processes} could not"
            f" join the others at {args.coordinator}: {reason}")
  if len(jax.local_devices(backend="cpu")) < devices:
    _fail(
      f"argument --devices: {devices} CPU devices were requested but JAX was initialised with"
      f" {len(jax.local_devices(backend='cpu'))}"
    )


def _save_params(path: str, states: dict[str, dict[str, Any]]) -> None:
  """Writes each algorithm's final params and optimizer state to ``path`` (npz)."""
  import jax
  import numpy as np

  arrays = {}
  for algorithm, state in states.items():
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      arrays[f"{algorithm}{jax.tree_util.keystr(key_path)}"] = np.asarray(leaf)
  with open(path, "wb") as f:
    np.savez(f, **arrays)


def _table(results: list[dict[str, Any]]) -> str:
  header = ("algorithm", "steps", "comm. rounds", "test acc (eval_params)",
            "test acc (workers, mean)", "wall time (s)")
  rows = [
    (
      r["algorithm"],
      str(r["steps"]),
      str(r["communication_rounds"]),
      f"{r['test_accuracy_eval_params']:.4f}",
      f"{r['test_accuracy_workers']:.4f}",
      f"{r['wall_time_s']:.1f}",
    )
    for r in results
  ]
  widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

  def line(row):
    cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
    return "  ".join(cells)

  return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def main(argv: list[str] | None = None) -> int:
  """Runs ``optax-dist``; returns the exit status (errors exit with status 2)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  if args.command == "async":
    return _run_async(args)
  _check_processes(args)
  _check_out(args.out)

  from optax_dist import _digits

  data = _digits.load_data(args.seed)
  n_train = len(data["x_train"])
  workers = args.processes * args.devices
  if n_train // workers < args.batch_size:
    _fail(
      f"argument --batch-size: each worker needs at least batch-size examples, but the"
      f" {n_train} training examples give {n_train // workers} to each of {workers}"
      f" workers; lower --batch-size or --devices"
    )
  if args.communication_period > args.steps and (
    args.command == "compare" or args.algorithm in _digits.PERIODIC
  ):
    _fail(
      f"argument --communication-period: must be at most --steps ({args.steps}), got"
      f" {args.communication_period}; elastic_average and agn would never communicate"
    )
  if args.processes > 1 and args.process_id is None:
    from optax_dist import _multiprocess

    return _multiprocess.launch(argv, args.processes, args.coordinator)
  _init_jax(args)
  from tqdm.auto import tqdm

  process = args.process_id or 0
  leader = process == 0  # prints and writes the results
  algorithms = _COMPARED if args.command == "compare" else (args.algorithm,)
  config = {
    "devices": args.devices,
    "processes": args.processes,
    "workers": workers,
    "steps": args.steps,
    "batch_size": args.batch_size,
    "learning_rate": args.learning_rate,
    "communication_period": args.communication_period,
    "moving_rate": _digits.default_moving_rate(workers)
    if args.moving_rate is None else args.moving_rate,
    "decay": args.decay,
    "max_staleness": args.max_staleness,
    "comm_dtype": args.comm_dtype,
    "eval_every": args.eval_every,
    "seed": args.seed,
    "checkpoint_every": args.checkpoint_every,
    "dataset": {"name": "sklearn digits", "train": n_train, "test": len(data["x_test"])},
    "model": "flax.linen MLP 64-64-64-10 (relu)",
    "optimizer": "adam",
  }

  def on_step(s: int, bar) -> None:
    bar.update(s - bar.n)
    if args.fail_at_step == s and process == args.processes - 1:
      bar.close()
      sys.stderr.write(f"{PROG}: process {process}: exiting at step {s} (--fail-at-step)\n")
      sys.stderr.flush()
      os._exit(1)

  results, states = [], {}
  try:
    for algorithm in algorithms:
      states[algorithm] = {}
      with tqdm(total=args.steps, desc=algorithm, unit="step",
                disable=args.no_progress or not leader, leave=False, file=sys.stderr) as bar:
        try:
          results.append(_digits.train(
            algorithm,
            data,
            devices=workers,
            steps=args.steps,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            communication_period=args.communication_period,
            moving_rate=config["moving_rate"],
            decay=args.decay,
            max_staleness=args.max_staleness,
            comm_dtype=None if args.comm_dtype == "float32" else args.comm_dtype,
            eval_every=args.eval_every,
            seed=args.seed,
            on_step=lambda s, bar=bar: on_step(s, bar),
            checkpoint_dir=os.path.join(args.out, "checkpoints", algorithm),
            checkpoint_every=args.checkpoint_every or 0,
            resume=args.resume,
            final_state=states[algorithm] if args.save_params else None,
          ))
        except _digits.CheckpointMismatchError as e:
          _fail(f"argument --resume: {e}")
  except KeyboardInterrupt:
    sys.stderr.write(f"{PROG}: interrupted\n")
    return 130
  if not leader:
    return 0

  suffix = "" if args.command == "compare" else f"_{args.algorithm}"
  json_path = os.path.join(args.out, f"results{suffix}.json")
  png_path = os.path.join(args.out, f"accuracy{suffix}.png")
  with open(json_path, "w") as f:
    json.dump({"command": args.command, "config": config,
               "algorithms": {r["algorithm"]: r for r in results}}, f, indent=2)
  _digits.plot(results, png_path)
  if args.save_params:
    _save_params(args.save_params, states)

  periodic = [a for a in algorithms if a in _digits.PERIODIC]
  period = (f", communication period {args.communication_period} ({', '.join(periodic)})"
            if periodic else "")
  layout = f" ({args.processes} processes x {args.devices} devices)" if args.processes > 1 else ""
  print(
    f"digits, flax MLP, {workers} worker{'s' if workers > 1 else ''}{layout} x batch"
    f" {args.batch_size}, adam lr"
    f" {args.learning_rate:g}{period}, seed {args.seed}"
  )
  print(_table(results))
  for r in results:
    if "num_dropped" in r:
      print(f"{r['algorithm']}: {r['num_dropped']} of {r['steps']} steps dropped"
            f" (max staleness {r['max_staleness']})")
    if r.get("resumed_from_step"):
      print(f"{r['algorithm']}: resumed from the checkpoint of step {r['resumed_from_step']}")
  print(f"wrote {json_path} and {png_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
