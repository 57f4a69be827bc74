"""What ``optax-dist`` shows and writes: the tables, the JSON files and the PNG plots.

Every table has the same style (:func:`table`): a header of words, a rule of dashes, the first
column left-aligned and the numbers right-aligned. :func:`report_training` prints and writes the
results of ``train`` and ``compare``: the run's exchange (:func:`exchange`) is in the line above
the table, in the plot's title and in the JSON's ``config``, and the table has the bytes each
replica sends across the replicas per step (:func:`sent_per_step`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from optax_dist.cli.algorithms import (ALGORITHMS, AXIS, EXCHANGE_OPTIONS, QUANTIZED_COMM_DTYPES,
                                       REPLICA)
from optax_dist.cli.config import DEFAULTS, Settings
from optax_dist.cli.progress import QUIET, Progress
from optax_dist.cli.runs import STEP_KINDS
from optax_dist.cli.tasks import Data, Task


def train_columns(label: str, metric: str, sent: str) -> tuple:
  """The columns of ``train`` and ``compare``: header, key of the result, format.

  ``label`` and ``metric`` are the task's ``metric_label`` and ``metric_key``; ``sent`` the
  header of the bytes sent across the replicas per step (:func:`sent_column`), whose cells are
  the rows' ``sent_per_step``, already in words.
  """
  return (
    ("algorithm", "algorithm", "{}"),
    ("steps", "steps", "{}"),
    ("comm. rounds", "communication_rounds", "{}"),
    (f"{label} (eval_params)", f"test_{metric}_eval_params", "{:.4f}"),
    (f"{label} (workers, mean)", f"test_{metric}_workers", "{:.4f}"),
    (sent, "sent_per_step", "{}"),
    ("wall time (s)", "wall_time_s", "{:.1f}"),
  )

ASYNC_COLUMNS = (
  ("protocol", "protocol", "{}"),
  ("test acc (server/center)", "test_accuracy", "{:.4f}"),
  ("commits", "commits", "{}"),
  ("dropped (fraction)", "dropped_fraction", "{:.3f}"),
  ("staleness (mean)", "mean_staleness", "{:.2f}"),
  ("staleness (max)", "max_staleness_seen", "{}"),
  ("simulated time", "simulated_time", "{:.1f}"),
  ("events", "events", "{}"),
  ("wall time (s)", "wall_time_s", "{:.1f}"),
)
"""The columns of ``async``: header, key of the row, format."""


def table(columns: Sequence[tuple[str, str, str]], rows: Sequence[dict[str, Any]]) -> str:
  """``rows`` as an aligned text table of ``columns`` (``(header, key, format)`` each)."""
  header = [title for title, _, _ in columns]
  body = [[fmt.format(row[key]) for _, key, fmt in columns] for row in rows]
  widths = [max(len(cells[i]) for cells in [header, *body]) for i in range(len(header))]

  def line(cells):
    return "  ".join([cells[0].ljust(widths[0])] + [
      cell.rjust(width) for cell, width in zip(cells[1:], widths[1:])])

  return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, body)])


def write_json(path: str, payload: dict[str, Any]) -> None:
  with open(path, "w") as f:
    json.dump(payload, f, indent=2)


def _figure(**kwargs: Any) -> Any:
  """A matplotlib ``Figure(**kwargs)`` drawn by Agg, outside ``pyplot``: no global figure to
  close, no interactive backend, and a lighter import."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(**kwargs)
  FigureCanvasAgg(fig)
  return fig


def rounds_axis(ax: Any, results: Sequence[dict[str, Any]]) -> None:
  """Scales ``ax``'s x axis (communication rounds) to the data, with plain numbers as ticks.

  Linear when the runs' final rounds are within a factor 5 of each other (short runs, or
  algorithms that all communicate as often); otherwise logarithmic, from 1 (step 0, with no
  round, is not shown), with ticks at 1, 2, 5, 10, 20, ...
  """
  from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

  finals = [r["communication_rounds"] for r in results] or [1]
  most = max(max(finals), 1)
  if most <= 5 * max(min(finals), 1):
    ax.set_xlim(left=0)
    return
  ax.set_xscale("log", nonpositive="mask")
  ax.set_xlim(0.8, most * 1.25)
  ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
  ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
  ax.xaxis.set_minor_formatter(NullFormatter())


def _zoom(results: Sequence[dict[str, Any]], key: str, metric: str) -> tuple[float, float] | None:
  """The y range that zooms on the end of the curves, or ``None`` (matplotlib's, every point).

  An accuracy from at most 0.8 (0.05 below the worst final value, in steps of 0.05) to 1; a loss
  from 0.97 times the best final value to 1.25 times the worst. The zoom cuts off the early
  descent, so it is kept only when every run keeps at least three of its points, and half, inside
  it: a short run (``--steps 20``, measured at steps 0 and 20) shows its whole curve.
  """
  final = [r[key] for r in results]
  if metric == "accuracy":
    zoom = (max(0.0, min(0.8, math.floor((min(final) - 0.05) * 20) / 20)), 1.0)
  else:
    zoom = (min(final) * 0.97, max(final) * 1.25)
  for r in results:
    values = r["history"][key]
    if sum(zoom[0] <= v <= zoom[1] for v in values) < max(3, len(values) / 2):
      return None
  return zoom


def accuracy_figure(results: Sequence[dict[str, Any]], title: str = "",
                    label: str = "test accuracy") -> Any:
  """The figure of :func:`plot_accuracy`: test metric vs step and vs communication rounds."""
  metric = results[0].get("metric", "accuracy")
  key = f"test_{metric}_eval_params"
  fig = _figure(figsize=(11, 4.2))
  by_step, by_round = fig.subplots(1, 2, sharey=True)
  for result in results:
    h = result["history"]
    by_step.plot(h["step"], h[key], label=result["algorithm"])
    by_round.plot(h["communication_rounds"], h[key], marker=".", label=result["algorithm"])
  by_step.set_xlabel("step")
  by_step.set_xlim(left=0)
  by_round.set_xlabel("communication rounds")
  rounds_axis(by_round, results)
  by_step.set_ylabel(f"{label} (eval_params)")
  for ax in (by_step, by_round):
    ax.grid(True, alpha=0.3)
  zoom = _zoom(results, key, metric)
  if zoom is not None:
    by_step.set_ylim(*zoom)
  by_step.legend(loc="lower right" if metric == "accuracy" else "upper right")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  return fig


def plot_accuracy(results: Sequence[dict[str, Any]], path: str, title: str = "",
                  label: str = "test accuracy") -> None:
  """Writes a PNG of the test metric of ``eval_params`` vs step and vs communication rounds."""
  accuracy_figure(results, title, label).savefig(path, dpi=110)


def loss_figure(lines: Sequence[dict[str, Any]], restarts: Sequence[dict[str, Any]],
                start: float, title: str = "") -> Any:
  """The figure of :func:`plot_loss`: each replica's round losses (its lines' ``loss``, the
  mean over the round's inner steps) against the seconds since ``start`` (Unix time; an
  earlier line or restart, e.g. of a resumed run's first part, moves it back), one curve per
  replica; a vertical line in the replica's colour at each restart (dotted) and heal (dashed),
  one legend entry per replica and kind."""
  t0 = min([start, *(x["time"] for x in lines), *(r["time"] for r in restarts)])
  fig = _figure(figsize=(8, 4.2))
  ax = fig.subplots()
  curves: dict[int, list] = {}
  for x in lines:
    if x.get("loss") is not None:
      curves.setdefault(x["replica"], []).append((x["time"] - t0, x["loss"]))
  for i, points in sorted(curves.items()):
    ax.plot(*zip(*points, strict=True), marker=".", color=f"C{i}", label=f"replica {i}")
  marks = [(r["time"], r["replica"], "restarts", ":") for r in restarts]
  marks += [(x["time"], x["replica"], "heals", "--") for x in lines if x["healed"]]
  labelled = set()
  for when, i, kind, style in sorted(marks):
    label = f"replica {i} {kind}" if (i, kind) not in labelled else "_nolegend_"
    labelled.add((i, kind))
    ax.axvline(when - t0, color=f"C{i}", linestyle=style, linewidth=1.2, label=label)
  ax.set_xlabel("wall-clock seconds since the run's start")
  ax.set_ylabel("training loss (mean over a round's inner steps)")
  ax.grid(True, alpha=0.3)
  if curves or marks:
    ax.legend(loc="upper right", fontsize=8)
  if title:
    ax.set_title(title)
  fig.tight_layout()
  return fig


def plot_loss(lines: Sequence[dict[str, Any]], restarts: Sequence[dict[str, Any]],
              start: float, path: str, title: str = "") -> None:
  """Writes a PNG of a fault-tolerant run's training loss against wall-clock seconds, its
  restarts and heals marked (:func:`loss_figure`)."""
  loss_figure(lines, restarts, start, title).savefig(path, dpi=110)


def plot_async(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
  """Writes a PNG: test metric against simulated time, and the staleness of the commits."""
  fig = _figure(figsize=(11, 4.2))
  acc, hist = fig.subplots(1, 2)
  for k, row in enumerate(rows):
    h = row["history"]
    acc.plot(h["time"], h["test_accuracy"], color=f"C{k}", label=row["protocol"])
  acc.set_xlabel("simulated time (one step ≈ 1)")
  acc.set_ylabel("test accuracy (server / center params)")
  acc.set_ylim(0.0, 1.0)
  acc.grid(True, alpha=0.3)
  acc.legend(loc="lower right")
  top = max([max(r["staleness"], default=0) for r in rows], default=0)
  bins = np.arange(top + 2) - 0.5
  styles = ["-", "--", ":", "-."]
  for k, row in enumerate(rows):  # elastic_average and agn share a schedule: same histogram
    if row["staleness"]:
      hist.hist(row["staleness"], bins=bins, histtype="step", linewidth=1.5,
                linestyle=styles[k % len(styles)], color=f"C{k}", label=row["protocol"])
  if {"elastic_average", "agn"} <= {row["protocol"] for row in rows}:
    hist.set_title("elastic_average and agn exchange on the same schedule: one histogram",
                   fontsize=9)
  hist.set_xlabel("staleness of a commit (server steps since the worker's read)")
  hist.set_ylabel("commits")
  hist.set_yscale("log")
  hist.grid(True, alpha=0.3)
  hist.legend(loc="upper right")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def exchange(settings: Settings, algorithms: Sequence[str]) -> dict[str, Any]:
  """What a run of ``algorithms`` exchanges: ``comm_dtype``, the format (``--comm-dtype``;
  ``"float32"``: the params' own dtype), and each of
  :data:`~optax_dist.cli.algorithms.EXCHANGE_OPTIONS` that one of ``algorithms`` takes and that
  applies: ``comm_block_size`` with a block-quantized format, the others away from their
  defaults. E.g. ``{"comm_dtype": "float4_e2m1fn", "comm_block_size": 64, "error_feedback":
  True}``."""
  described = {"comm_dtype": settings.comm_dtype or "float32"}
  taken = {name for a in algorithms for name in ALGORITHMS[a].settings}
  for name in EXCHANGE_OPTIONS:
    value = getattr(settings, name)
    if name == "comm_block_size":
      applies = described["comm_dtype"] in QUANTIZED_COMM_DTYPES
    else:
      applies = value != DEFAULTS[name]
    if name in taken and applies:
      described[name] = value
  return described


EXCHANGE_WORDS = {"error_feedback": "error feedback", "overlap": "overlap {}", "eager": "eager",
                  "mixing": "mixing {:g}", "exchange_device": "on an exchange device"}
"""How :func:`exchange_text` says each option of :func:`exchange` after the format."""


def exchange_text(described: dict[str, Any]) -> str:
  """:func:`exchange`'s ``described`` in words, e.g. ``exchange float4_e2m1fn in blocks of 64,
  error feedback`` or ``exchange float32, overlap 2, eager, mixing 0.5``."""
  head = f"exchange {described['comm_dtype']}"
  if "comm_block_size" in described:
    head += f" in blocks of {described['comm_block_size']}"
  options = [EXCHANGE_WORDS[name].format(value) for name, value in described.items()
             if name in EXCHANGE_WORDS]
  return ", ".join([head, *options])


def training_config(args: argparse.Namespace, task: Task, data: Data, settings: Settings,
                    algorithms: Sequence[str]) -> dict[str, Any]:
  """The ``config`` of the results' JSON: every setting but ``algorithm`` (the results hold one
  entry per algorithm), ``devices`` per process and ``workers`` in all, the ``--comm-dtype`` as
  given, ``exchange``: what ``algorithms`` exchange (:func:`exchange`), the data set and the
  model."""
  return {
    **{key: value for key, value in settings.as_dict().items() if key != "algorithm"},
    "devices": args.devices, "processes": args.processes, "workers": settings.devices,
    "comm_dtype": args.comm_dtype, "exchange": exchange(settings, algorithms),
    "checkpoint_every": args.checkpoint_every,
    "dataset": {"name": task.dataset, "train": len(next(iter(data.train.values()))),
                "test": len(next(iter(data.test.values()))),
                "provenance": task.provenance() if task.provenance else None},
    "model": task.model_name,
  }


def training_summary(args: argparse.Namespace, task: Task, settings: Settings,
                     algorithms: Sequence[str]) -> str:
  """The run in one line (shown when it starts, and above the table): what is trained, on how
  many workers, with which optimizer and which exchange (:func:`exchange_text`)."""
  period = ""
  for name, words in (("communication_period", "communication period"),
                      ("sync_period", "sync period")):
    users = [a for a in algorithms if ALGORITHMS[a].period_name == name]
    if users:
      period += f", {words} {getattr(settings, name)} ({', '.join(users)}"
      if any("outer_learning_rate" in ALGORITHMS[a].settings for a in users):
        period += (f"; outer Nesterov lr {settings.outer_learning_rate:g}, momentum"
                   f" {settings.outer_momentum:g}")
      period += ")"
  layout = f" ({args.processes} processes x {args.devices} devices)" if args.processes > 1 else ""
  workers = settings.devices
  if settings.replicas > 1:
    layout += f" in {settings.replicas} replicas of {workers // settings.replicas}"
  if settings.fsdp is not None:
    layout += f", params sharded over {settings.fsdp} (global view)"
  return (f"{task.name}, {task.model_name}, {workers} worker{'s' if workers > 1 else ''}{layout}"
          f" x batch {settings.batch_size}, {recipe(settings)}{period};"
          f" {exchange_text(exchange(settings, algorithms))}; seed {settings.seed}")


def training_title(task: Task, settings: Settings, algorithms: Sequence[str]) -> str:
  """The plot's title: the task, the model and the workers, then the exchange
  (:func:`exchange_text`) on a second line."""
  return (f"{task.name}, {task.model_name}, {settings.devices} data-parallel workers\n"
          f"{exchange_text(exchange(settings, algorithms))}")


BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
"""The units of the bytes in the tables, each 1024 times the one before."""


def byte_unit(largest: float) -> tuple[str, int]:
  """The unit of :data:`BYTE_UNITS` (and its bytes) in which ``largest`` bytes shows as less
  than 1000 (to 3 significant digits), the largest unit if none."""
  for power, unit in enumerate(BYTE_UNITS):
    if largest < 999.5 * 1024**power:
      break
  return unit, 1024**power


def sent_per_step(result: dict[str, Any], settings: Settings) -> float:
  """The bytes each replica sends across the replicas per step of ``result``'s run, the mean
  over its steps; with one replica (``settings.replicas`` 1) every worker is one.

  From ``result["collective_bytes"]`` (per device, by the mesh axes each collective spans: see
  :func:`optax_dist.cli.trainer.train`): on each step, the compiled step the algorithm's
  schedule runs (:meth:`~optax_dist.cli.algorithms.Algorithm.communicates`), its collectives
  spanning :data:`~optax_dist.cli.algorithms.REPLICA` (or the workers'
  :data:`~optax_dist.cli.algorithms.AXIS`): the unconditional ones and the mean of the
  conditional exchanges (``streaming_diloco`` runs one fragment's per sync step), times the
  devices of a replica; with ``exchange_device``, each exchanging step adds the mean of the
  exchange programs, which run on one device per replica. Those within a replica are left out.
  """
  s = dataclasses.replace(settings, algorithm=result["algorithm"])
  programs, algorithm = result["collective_bytes"], ALGORITHMS[s.algorithm]

  def across(by_axes: dict[str, int]) -> int:
    return sum(b for axes, b in by_axes.items() if {REPLICA, AXIS} & set(axes.split(",")))

  def execution(kind: str) -> float:
    exchanges = [across(c) for c in programs[kind]["conditional"]]
    return across(programs[kind]["unconditional"]) + (np.mean(exchanges) if exchanges else 0.0)

  devices = s.devices // s.replicas if s.replicas > 1 else 1  # of a replica
  exchange_program = execution("exchange") if "exchange" in programs else 0.0
  total = 0.0
  for step in range(1, s.steps + 1):
    hint = algorithm.communicates(s, step)
    total += devices * execution(STEP_KINDS[hint])
    total += exchange_program if hint else 0.0
  return float(total / s.steps)


def sent_column(results: Sequence[dict[str, Any]], settings: Settings) -> tuple[str, list[str]]:
  """The header and the cells of the column of :func:`sent_per_step`, in one unit
  (:func:`byte_unit`) named in the header: ``("sent per worker (KiB/step)", ["4.96", ...])``
  (``replica`` with ``settings.replicas`` > 1)."""
  sent = [sent_per_step(r, settings) for r in results]
  unit, size = byte_unit(max(sent, default=0.0))
  who = "replica" if settings.replicas > 1 else "worker"
  return f"sent per {who} ({unit}/step)", [
    np.format_float_positional(b / size, precision=3, fractional=False, trim="-") for b in sent]


def recipe(settings: Settings) -> str:
  """The inner optimizer in words, e.g. ``adamw lr 0.003 (warmup_cosine, 15 warm-up steps),
  b2 0.99, weight decay 0.1, clip 1``."""
  s = settings
  text = f"{s.optimizer} lr {s.learning_rate:g}"
  if s.lr_schedule != "constant":
    text += (f" ({s.lr_schedule}, {s.lr_warmup_steps} warm-up"
             f" step{'' if s.lr_warmup_steps == 1 else 's'})")
  if s.optimizer != "sgd" and s.b2 != DEFAULTS["b2"]:
    text += f", b2 {s.b2:g}"
  if s.weight_decay:
    text += f", weight decay {s.weight_decay:g}"
  if s.clip_norm is not None:
    text += f", clip {s.clip_norm:g}"
  return text


def report_training(args: argparse.Namespace, task: Task, data: Data, settings: Settings,
                    results: list[dict], states: dict[str, dict], *,
                    progress: Progress = QUIET) -> None:
  """Writes the JSON, the plot and (``--save-params``) the ``states`` (a phase of
  ``progress``); prints the table."""
  suffix = "" if args.command == "compare" else f"_{args.algorithm}"
  json_path = os.path.join(args.out, f"results{suffix}.json")
  png_path = os.path.join(args.out, f"accuracy{suffix}.png")
  algorithms = [r["algorithm"] for r in results]
  with progress.phase("writing the results and the plot"):
    write_json(json_path, {"command": args.command,
                           "config": training_config(args, task, data, settings, algorithms),
                           "algorithms": {r["algorithm"]: r for r in results}})
    plot_accuracy(results, png_path, training_title(task, settings, algorithms),
                  label=task.metric_label)
    if args.save_params:
      save_params(args.save_params, states)
  header, sent = sent_column(results, settings)
  print(training_summary(args, task, settings, algorithms))
  print(table(train_columns(task.metric_label, task.metric_key, header),
              [{**r, "sent_per_step": b} for r, b in zip(results, sent, strict=True)]))
  for r in results:
    if "num_dropped" in r:
      print(f"{r['algorithm']}: {r['num_dropped']} of {r['steps']} steps dropped"
            f" (max staleness {r['max_staleness']})")
    if r.get("resumed_from_step"):
      print(f"{r['algorithm']}: resumed from the checkpoint of step {r['resumed_from_step']}")
    if r.get("resized"):
      z = r["resized"]
      how = ("optax_dist.resize_state: global state kept, workers rebuilt" if r["fsdp"] is None
             else f"the global view: the {r['replicas']} replicas' state restored onto the new"
             " mesh")
      print(f"{r['algorithm']}: resized from {z['from_workers']} to {z['to_workers']} workers at"
            f" step {z['step']} ({how})")
  print(f"wrote {json_path} and {png_path}")


def save_params(path: str, states: dict[str, dict[str, Any]]) -> None:
  """Writes each algorithm's final params and optimizer state to ``path`` (npz)."""
  arrays = {}
  for algorithm, state in states.items():
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      arrays[f"{algorithm}{jax.tree_util.keystr(key_path)}"] = np.asarray(leaf)
  with open(path, "wb") as f:
    np.savez(f, **arrays)

