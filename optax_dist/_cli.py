"""The ``optax-dist`` command: data-parallel training on scikit-learn's ``digits``.

``optax-dist train --algorithm NAME`` trains with one algorithm; ``optax-dist compare`` trains with
``sync``, ``elastic_average``, ``agn`` and ``moving_average`` and compares them. Each run emulates
``--devices`` CPU devices, one worker each (see :mod:`optax_dist._digits`), prints a table, and
writes a JSON file of the results and a PNG of the test accuracy under ``--out``.

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


def build_parser() -> argparse.ArgumentParser:
  """The argument parser of ``optax-dist``."""
  common = _Parser(add_help=False)
  common.add_argument("--devices", type=_positive_int, default=8,
                      help="number of emulated CPU devices, one worker each (default: 8)")
  common.add_argument("--steps", type=_positive_int, default=200,
                      help="training steps per worker (default: 200)")
  common.add_argument("--batch-size", type=_positive_int, default=16,
                      help="minibatch size per worker (default: 16)")
  common.add_argument("--learning-rate", type=_positive_float, default=1e-2,
                      help="Adam learning rate (default: 0.01)")
  common.add_argument("--communication-period", type=_positive_int, default=10,
                      help="steps between exchanges of elastic_average and agn (default: 10)")
  common.add_argument("--moving-rate", type=_positive_float, default=None,
                      help="elastic_average's moving rate (default: 0.9 / devices)")
  common.add_argument("--decay", type=_unit_float, default=0.99,
                      help="moving_average's EMA decay (default: 0.99, with TF's num_updates cap)")
  common.add_argument("--max-staleness", type=_int, default=2,
                      help="drop_stale_gradients' largest accepted staleness (default: 2)")
  common.add_argument("--eval-every", type=_positive_int, default=10,
                      help="steps between test-accuracy evaluations (default: 10)")
  common.add_argument("--seed", type=_int, default=0,
                      help="seed of the train/test split, init and minibatches (default: 0)")
  common.add_argument("--out", default="runs",
                      help="directory for the JSON results and the PNG plot (default: runs)")
  common.add_argument("--no-progress", action="store_true", help="hide the progress bars")

  parser = _Parser(
    prog=PROG,
    description="Data-parallel training of an MLP on scikit-learn's digits with the optax_dist"
    " transformations, over emulated CPU devices.",
  )
  commands = parser.add_subparsers(dest="command", required=True, metavar="{train,compare}")
  train = commands.add_parser(
    "train", parents=[common], help="train with one algorithm",
    description="Train with one algorithm; writes results_<algorithm>.json and"
    " accuracy_<algorithm>.png under --out.",
  )
  train.add_argument("--algorithm", choices=_ALGORITHMS, default="sync",
                     help="the algorithm (default: sync)")
  commands.add_parser(
    "compare", parents=[common], help=f"compare {', '.join(_COMPARED)}",
    description=f"Train with {', '.join(_COMPARED)} and compare them; writes results.json and"
    " accuracy.png under --out.",
  )
  return parser


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


def _init_jax(devices: int) -> None:
  """Asks JAX for ``devices`` CPU devices; must run before JAX initialises its backends."""
  import jax

  try:
    if not os.environ.get("JAX_PLATFORMS"):
      jax.config.update("jax_platforms", "cpu")  # the workers are emulated CPU devices
    jax.config.update("jax_num_cpu_devices", devices)
  except RuntimeError:
    pass  # already initialised (called in-process); `_digits.train` checks the device count
  if len(jax.devices("cpu")) < devices:
    _fail(
      f"argument --devices: {devices} CPU devices were requested but JAX was initialised with"
      f" {len(jax.devices('cpu'))}"
    )


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
  args = build_parser().parse_args(argv)
  _check_out(args.out)

  from optax_dist import _digits

  data = _digits.load_data(args.seed)
  n_train = len(data["x_train"])
  if n_train // args.devices < args.batch_size:
    _fail(
      f"argument --batch-size: each worker needs at least batch-size examples, but the"
      f" {n_train} training examples give {n_train // args.devices} to each of {args.devices}"
      f" workers; lower --batch-size or --devices"
    )
  _init_jax(args.devices)
  from tqdm.auto import tqdm

  algorithms = _COMPARED if args.command == "compare" else (args.algorithm,)
  config = {
    "devices": args.devices,
    "steps": args.steps,
    "batch_size": args.batch_size,
    "learning_rate": args.learning_rate,
    "communication_period": args.communication_period,
    "moving_rate": _digits.default_moving_rate(args.devices)
    if args.moving_rate is None else args.moving_rate,
    "decay": args.decay,
    "max_staleness": args.max_staleness,
    "eval_every": args.eval_every,
    "seed": args.seed,
    "dataset": {"name": "sklearn digits", "train": n_train, "test": len(data["x_test"])},
    "model": "flax.linen MLP 64-64-64-10 (relu)",
    "optimizer": "adam",
  }
  results = []
  try:
    for algorithm in algorithms:
      with tqdm(total=args.steps, desc=algorithm, unit="step", disable=args.no_progress,
                leave=False, file=sys.stderr) as bar:
        results.append(_digits.train(
          algorithm,
          data,
          devices=args.devices,
          steps=args.steps,
          batch_size=args.batch_size,
          learning_rate=args.learning_rate,
          communication_period=args.communication_period,
          moving_rate=config["moving_rate"],
          decay=args.decay,
          max_staleness=args.max_staleness,
          eval_every=args.eval_every,
          seed=args.seed,
          on_step=lambda _: bar.update(1),
        ))
  except KeyboardInterrupt:
    sys.stderr.write(f"{PROG}: interrupted\n")
    return 130

  suffix = "" if args.command == "compare" else f"_{args.algorithm}"
  json_path = os.path.join(args.out, f"results{suffix}.json")
  png_path = os.path.join(args.out, f"accuracy{suffix}.png")
  with open(json_path, "w") as f:
    json.dump({"command": args.command, "config": config,
               "algorithms": {r["algorithm"]: r for r in results}}, f, indent=2)
  _digits.plot(results, png_path)

  periodic = [a for a in algorithms if a in _digits.PERIODIC]
  period = (f", communication period {args.communication_period} ({', '.join(periodic)})"
            if periodic else "")
  print(
    f"digits, flax MLP, {args.devices} worker{'s' if args.devices > 1 else ''} x batch"
    f" {args.batch_size}, adam lr"
    f" {args.learning_rate:g}{period}, seed {args.seed}"
  )
  print(_table(results))
  for r in results:
    if "num_dropped" in r:
      print(f"{r['algorithm']}: {r['num_dropped']} of {r['steps']} steps dropped"
            f" (max staleness {r['max_staleness']})")
  print(f"wrote {json_path} and {png_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
