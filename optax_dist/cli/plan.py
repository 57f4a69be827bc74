"""``optax-dist plan``: each method's utilization and wall-clock per step over a link.

Prints one row per method of :mod:`optax_dist.planner`: the bytes each replica sends per step, the
seconds of one exchange, the wall-clock seconds per step, the compute utilization at
``--bandwidth`` and the bandwidth that reaches ``--target-utilization``. Pure arithmetic: imports
neither JAX's backends nor the ``examples`` extra, and runs in a few seconds. Settings the library
refuses (``streaming_diloco``'s ``overlap < sync_period``) are refused with its own message, after
the flag.

``add_parser(subparsers)`` adds the subcommand to an ``argparse`` parser; ``run(args)`` runs it.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Any

from optax_dist import planner
from optax_dist.cli import reports
from optax_dist.cli.errors import PROG

_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BANDWIDTH = re.compile(r"^\s*(?P<number>[0-9.]+(?:[eE][+-]?[0-9]+)?)\s*(?P<prefix>[kKMGTP]?)"
                        r"(?P<unit>bit/s|bits/s|bit|bits|bps|b/s)?\s*$")
_PARAMS = re.compile(r"^\s*(?P<number>[0-9.]+(?:[eE][+-]?[0-9]+)?)\s*(?P<suffix>[kKMBT]?)\s*$")
_PARAMS_SUFFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
_TIME = re.compile(r"^\s*(?P<number>[0-9.]+(?:[eE][+-]?[0-9]+)?)\s*(?P<unit>s|ms|us|µs)?\s*$")
_SECONDS = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
_FLAGS = {"num_params": "--params", "step_time": "--step-time", "bandwidth": "--bandwidth",
          "latency": "--latency", "sync_period": "--sync-period",
          "num_fragments": "--num-fragments", "overlap": "--overlap", "bits": "--bits",
          "num_replicas": "--replicas", "backward_overlap": "--backward-overlap",
          "target_utilization": "--target-utilization"}
"""The flag of each argument of :func:`optax_dist.planner.plan` and ``required_bandwidth``."""
_PLANNER_ARGUMENT = re.compile(r"^`\w+\((?P<name>\w+)=\.\.\.\)`:? ")


def _parsed(pattern: re.Pattern, text: str, what: str) -> tuple[float, re.Match]:
  match = pattern.match(text)
  try:
    value = float(match["number"]) if match else math.nan
  except ValueError:
    value = math.nan
  if not math.isfinite(value):
    raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
  return value, match


def bandwidth(text: str) -> float:
  """``"10Mbit"``, ``"1Gbit"``, ``"222Gbit/s"``, ``"25Gbps"`` or ``"1e9"`` as bit/s (decimal)."""
  what = "a bandwidth in bit/s, e.g. 10Mbit, 1Gbit, 222Gbit/s, 25Gbps or 1e9"
  value, match = _parsed(_BANDWIDTH, text, what)
  value *= _DECIMAL[match["prefix"]]
  if not value > 0:
    raise argparse.ArgumentTypeError(f"must be {what} (positive), got {text!r}")
  return value


def params(text: str) -> float:
  """``"1B"``, ``"350M"``, ``"1.3B"`` or ``"1e9"`` as a number of values."""
  what = "a number of parameters, e.g. 1e9, 1B, 350M or 70B"
  value, match = _parsed(_PARAMS, text, what)
  value *= _PARAMS_SUFFIX[match["suffix"]]
  if not value > 0:
    raise argparse.ArgumentTypeError(f"must be {what} (positive), got {text!r}")
  return value


def _seconds(positive: bool):
  what = "a time in seconds, e.g. 0.1, 100ms or 50us" + (" (positive)" if positive else "")

  def parse(text: str) -> float:
    value, match = _parsed(_TIME, text, what)
    value *= _SECONDS[match["unit"]]
    if positive and not value > 0:
      raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value

  return parse


def _integer(minimum: int):
  what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < minimum:
      raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value

  return parse


def _fraction(low_open: bool):
  what = "a number in (0, 1]" if low_open else "a number in [0, 1]"

  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not ((0 < value if low_open else 0 <= value) and value <= 1):
      raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value

  return parse


def _bits(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"must be a positive number of bits per value, got {text!r}")
  return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
  """Adds ``plan`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns it."""
  parser = subparsers.add_parser(
    "plan", help="compute utilization and wall-clock per step of each method over a link",
    description="Estimate, from an analytic model (ring all-reduce, no measurement), each"
    " method's bytes per step, seconds per step and compute utilization over a link, and the"
    " bandwidth each needs for --target-utilization. Sizes are decimal (1 Gbit = 1e9 bits).",
  )
  parser.add_argument("--params", type=params, required=True,
                      help="parameters in the model, e.g. 1B, 350M or 1e9")
  parser.add_argument("--step-time", type=_seconds(positive=True), required=True,
                      help="compute seconds per step on each replica, e.g. 0.1 or 100ms")
  parser.add_argument("--bandwidth", type=bandwidth, required=True,
                      help="bit/s between replicas, e.g. 10Mbit, 1Gbit or 222Gbit")
  parser.add_argument("--latency", type=_seconds(positive=False), default=0.0,
                      help="seconds per message, e.g. 0.05 or 50ms (default: 0)")
  parser.add_argument("--sync-period", type=_integer(1), default=100,
                      help="inner steps H between syncs of the same params (default: 100)")
  parser.add_argument("--num-fragments", type=_integer(1), default=1,
                      help="streaming_diloco's fragments F, one synced every H/F steps"
                      " (default: 1)")
  parser.add_argument("--overlap", type=_integer(0), default=0,
                      help="steps tau that hide a streaming fragment's exchange (default: 0)")
  parser.add_argument("--bits", type=_bits, default=32.0,
                      help="bits per exchanged value: 32, 16, 8, 4 (default: 32)")
  parser.add_argument("--replicas", type=_integer(1), default=2,
                      help="replicas M in the ring all-reduce (default: 2)")
  parser.add_argument("--backward-overlap", type=_fraction(low_open=False), default=0.0,
                      help="fraction of a step, at its end, during which its exchange already"
                      " runs: 0.667 from the start of the backward pass (default: 0)")
  parser.add_argument("--target-utilization", type=_fraction(low_open=True), default=0.95,
                      help="compute utilization for the bandwidth column (default: 0.95)")
  return parser


def _bytes(n: float) -> str:
  for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if n >= size:
      return f"{n / size:.3g} {unit}"
  return f"{n:.3g} B"


def _rate(bits_per_second: float) -> str:
  if math.isinf(bits_per_second):
    return "unreachable"
  for unit, size in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
    if bits_per_second >= size:
      return f"{bits_per_second / size:.4g} {unit}"
  return f"{bits_per_second:.4g} bit/s"


def _flag_error(message: str) -> str:
  """The planner's error with its call site (`` `plan(overlap=...)` ``) as the flag's
  (``argument --overlap:``), as argparse says it; other messages unchanged."""
  match = _PLANNER_ARGUMENT.match(message)
  if match is None or match["name"] not in _FLAGS:
    return message
  return f"argument {_FLAGS[match['name']]}: {message[match.end():]}"


def run(args: argparse.Namespace) -> int:
  """Prints the table of ``optax-dist plan``; returns the exit status (2 for a bad combination)."""
  shared = dict(num_params=args.params, step_time=args.step_time, latency=args.latency,
                sync_period=args.sync_period, num_fragments=args.num_fragments,
                overlap=args.overlap, bits=args.bits, num_replicas=args.replicas,
                backward_overlap=args.backward_overlap)
  try:
    plans = planner.plan(bandwidth=args.bandwidth, **shared)
    needed = planner.required_bandwidth(target_utilization=args.target_utilization, **shared)
  except ValueError as e:
    sys.stderr.write(f"{PROG}: error: {_flag_error(str(e))}\n")
    return 2
  target = f"{100 * args.target_utilization:g}%"
  columns = (
    ("method", "method", "{}"),
    ("bytes/step", "bytes", "{}"),
    ("exchange (s)", "exchange", "{:.4g}"),
    ("s/step", "wall", "{:.4g}"),
    ("utilization", "utilization", "{:.1%}"),
    (f"bandwidth for {target}", "needed", "{}"),
  )
  rows = [dict(method=m, bytes=_bytes(p.bytes_per_step), exchange=p.exchange_time,
               wall=p.wall_time, utilization=p.utilization, needed=_rate(needed[m]))
          for m, p in plans.items()]
  print(f"{args.params:.4g} params, {args.step_time:g} s of compute per step, {args.replicas}"
        f" replicas over {_rate(args.bandwidth)} (latency {args.latency:g} s); H ="
        f" {args.sync_period}, F = {args.num_fragments}, tau = {args.overlap},"
        f" {args.bits:g} bits per value, backward overlap {args.backward_overlap:g}")
  print(reports.table(columns, rows))
  return 0
