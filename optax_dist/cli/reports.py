"""What ``optax-dist`` shows and writes: the tables, the JSON files and the PNG plots.

Every table has the same style (:func:`table`): a header of words, a rule of dashes, the first
column left-aligned and the numbers right-aligned.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def train_columns(label: str = "test acc", metric: str = "accuracy") -> tuple:
  """The columns of ``train`` and ``compare``: header, key of the result, format.

  ``label`` and ``metric`` are the task's ``metric_label`` and ``metric_key``.
  """
  return (
    ("algorithm", "algorithm", "{}"),
    ("steps", "steps", "{}"),
    ("comm. rounds", "communication_rounds", "{}"),
    (f"{label} (eval_params)", f"test_{metric}_eval_params", "{:.4f}"),
    (f"{label} (workers, mean)", f"test_{metric}_workers", "{:.4f}"),
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


def _pyplot():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


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
  plt = _pyplot()
  metric = results[0].get("metric", "accuracy")
  key = f"test_{metric}_eval_params"
  fig, (by_step, by_round) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
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
  fig = accuracy_figure(results, title, label)
  fig.savefig(path, dpi=110)
  _pyplot().close(fig)


def plot_async(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
  """Writes a PNG: test metric against simulated time, and the staleness of the commits."""
  plt = _pyplot()
  fig, (acc, hist) = plt.subplots(1, 2, figsize=(11, 4.2))
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
  plt.close(fig)
