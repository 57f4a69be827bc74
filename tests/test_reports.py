"""optax_dist.cli.reports: the y range of the metric-vs-step panel, on synthetic histories (no
training): a short run shows its whole curve; a long one zooms on its end."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from optax_dist.cli import reports  # noqa: E402


def results(metric, curves, every):
  """``{algorithm: values}`` as the command's results, measured every ``every`` steps."""
  key = f"test_{metric}_eval_params"
  return [
    {"algorithm": name, "metric": metric, key: values[-1], "communication_rounds": 10,
     "history": {"step": [every * i for i in range(len(values))], key: values,
                 "communication_rounds": [i for i in range(len(values))]}}
    for name, values in curves.items()
  ]


def y_limits(runs):
  fig = reports.accuracy_figure(runs)
  fig.canvas.draw()
  return fig.axes[0].get_ylim()


def shown(runs, limits):
  key = f"test_{runs[0]['metric']}_eval_params"
  return [limits[0] <= v <= limits[1] for r in runs for v in r["history"][key]]


@pytest.mark.parametrize(("metric", "curves"), [
  # 20 steps of --task lm (measured at 0 and 20): bits per byte.
  ("bits_per_byte", {"sync": [9.36, 4.31], "diloco": [9.36, 4.36]}),
  # 20 steps measured every 5: most of each curve is above the end's window.
  ("bits_per_byte", {"sync": [9.36, 7.0, 5.8, 4.9, 4.3], "diloco": [9.36, 7.2, 6.0, 5.0, 4.4]}),
  ("accuracy", {"sync": [0.09, 0.62, 0.91], "diloco": [0.09, 0.55, 0.88]}),
])
def test_a_short_run_shows_its_whole_curve(metric, curves):
  runs = results(metric, curves, every=5)
  assert all(shown(runs, y_limits(runs)))


@pytest.mark.parametrize(("metric", "curves", "zoom"), [
  # 300 steps of --task lm measured every 50: the first two points above the window.
  ("bits_per_byte",
   {"sync": [9.36, 5.9, 4.4, 3.9, 3.6, 3.45, 3.4], "diloco": [9.36, 6.3, 4.6, 4.0, 3.7, 3.6, 3.5]},
   (3.4 * 0.97, 3.5 * 1.25)),
  # digits, 200 steps measured every 10: accuracy from 0.8 (the zoom's lowest bottom).
  ("accuracy",
   {"sync": [0.09, 0.7] + [0.9 + 0.003 * i for i in range(19)],
    "diloco": [0.09, 0.6] + [0.89 + 0.003 * i for i in range(19)]},
   (0.8, 1.0)),
])
def test_a_long_run_zooms_on_its_end(metric, curves, zoom):
  runs = results(metric, curves, every=10)
  limits = y_limits(runs)
  assert limits == pytest.approx(zoom)
  assert not all(shown(runs, limits))  # the early descent is cut off
