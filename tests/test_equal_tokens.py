"""The report of ``benchmarks/studies/equal_tokens.py`` on synthetic cached runs: the best outer
learning rates, the gaps to data parallel and each target met or missed, against numbers
computed by hand. Trains nothing."""

from __future__ import annotations

import pytest

from benchmarks.studies import equal_tokens as b

DP = {0: 2.0, 1: 2.1, 2: 2.2}
"""Data parallel's final validation loss by seed."""
META = {"num_params": 279_424, "train_tokens": 4_218_880, "context": 64, "steps": 1380,
        "seeds": [0, 1, 2], "machine": {"cpu": "Test CPU", "cores": "3", "memory": "1.0 GiB"},
        "invocations": [
          {"date": "d", "load_start": "1.00, 1.00, 1.00", "load_end": "2.00, 1.00, 1.00",
           "runs_trained": 25, "wall_s": 5000.0}]}


def run(replicas, seed, final, sync_period=30, outer_lr=None, outer_momentum=0.9):
  """A cached record as :func:`benchmarks.studies.equal_tokens.record` writes it (the fields read)."""
  spec = b.Spec(replicas, seed, None if replicas is None else sync_period, outer_lr,
                outer_momentum)
  return {"label": spec.label, "replicas": replicas, "seed": seed, "sync_period": spec.sync_period,
          "outer_lr": outer_lr, "outer_momentum": outer_momentum, "steps": 1380, "devices": replicas or 8,
          "batch_size": 64 // (replicas or 8), "final": final, "final_workers": final,
          "communication_rounds": 1380 // sync_period, "wall_s": 200.0, "train_s": 180.0,
          "step_s": 0.13, "load_before": "1.00, 1.00, 1.00", "load_after": "2.00, 1.50, 1.00"}


def records(gap4=0.03, gaps1=(-0.01, 0, 0)):
  """The full grid: M = 1 gaps ``gaps1`` (mean -1/3%); M = 2 best at 0.8 with 1%, 1.5%, 2.5%
  (mean 5/3%); M = 4 ``gap4`` on every seed; M = 8 best at 1.0 with 6%, 5%, 7% (mean 6%)."""
  out = [run(None, s, f) for s, f in DP.items()]
  out += [run(1, s, DP[s] * (1 + g), outer_lr=0.6) for s, g in zip(DP, gaps1)]
  out += [run(2, 0, 2.0 * (1 + g), outer_lr=lr)
          for lr, g in zip(b.FULL.outer_lrs, (0.04, 0.03, 0.01, 0.05))]
  out += [run(2, s, DP[s] * (1 + g), outer_lr=0.8) for s, g in ((1, 0.015), (2, 0.025))]
  out += [run(4, s, DP[s] * (1 + gap4), outer_lr=0.8) for s in DP]
  out += [run(8, 0, 2.0 * (1 + g), outer_lr=lr)
          for lr, g in zip(b.FULL.outer_lrs, (0.09, 0.08, 0.07, 0.06))]
  out += [run(8, s, DP[s] * (1 + g), outer_lr=1.0) for s, g in ((1, 0.05), (2, 0.07))]
  out += [run(2, 0, 2.0 * (1 + g), sync_period=h, outer_lr=0.8)
          for h, g in ((1, 0.0), (5, 0.005), (10, 0.008), (100, 0.03))]
  # Other momenta at M = 2, better than the sweep's best: kept apart from it and from the rows.
  out += [run(2, 0, 2.0 * (1 - g), outer_lr=lr, outer_momentum=0.5)
          for lr, g in ((0.8, 0.02), (0.7, 0.03))]
  return out


def verdicts(summary):
  return {t["text"]: t["met"] for t in summary["targets"]}


def test_plan_and_best_learning_rates():
  assert b.run_count(b.FULL, [0, 1, 2]) == 25 + len(b.FULL.momentum_runs)
  best = b.best_lrs(b.FULL, records())
  assert best == {1: 0.6, 2: 0.8, 4: 0.8, 8: 1.0}
  second = b.second_runs(b.FULL, [0, 1, 2], best)
  assert {(s.replicas, s.seed, s.sync_period, s.outer_lr) for s in second} == {
    (2, 1, 30, 0.8), (2, 2, 30, 0.8), (8, 1, 30, 1.0), (8, 2, 30, 1.0),
    (2, 0, 1, 0.8), (2, 0, 5, 0.8), (2, 0, 10, 0.8), (2, 0, 100, 0.8)}


def test_gaps_and_targets():
  s = b.summary(b.FULL, records())
  gap = {r["replicas"]: r["gap"][0] for r in s["rows"]}
  assert gap == pytest.approx({1: -0.01 / 3, 2: 0.05 / 3, 4: 0.03, 8: 0.06})
  assert s["rows"][1]["gap"][1] == pytest.approx((7 / 18) ** 0.5 * 0.01)  # sd of 1, 1.5, 2.5%
  assert verdicts(s) == {"M = 1 at or below data parallel": True, "the gap grows with M": True,
                         "M = 2 within 2% of data parallel": True,
                         "M = 8 within 5% of data parallel": False}
  assert s["periods"][100]["gap"] == pytest.approx(0.03)
  assert b.best_lrs(b.FULL, records())[2] == 0.8
  grid = b.dataclasses.replace(b.FULL, momentum_runs=((2, 0.8, 0.5), (8, 0.7, 0.5)))
  momenta = b.summary(grid, records())["momenta"]
  assert momenta[0]["run"]["gap"] == pytest.approx(-0.02)
  assert momenta[0]["default"]["gap"] == pytest.approx(0.01)  # seed 0 at 0.8, momentum 0.9
  assert momenta[1]["run"] is None and momenta[1]["default_lr"] == 1.0
  assert "| M = 2 | 0.8, 0.5 | 1.9600 (-2.0%) | 0.8, 0.9 | 2.0200 (+1.0%) |" in b.document(
    grid, records(), META, "p.png")


def test_targets_missed_and_not_measured(tmp_path):
  assert verdicts(b.summary(b.FULL, records(gap4=0.01)))["the gap grows with M"] is False
  above = verdicts(b.summary(b.FULL, records(gaps1=(0.002, 0.002, 0.002))))
  assert above["M = 1 at or below data parallel"] is False
  partial = [r for r in records() if r["replicas"] != 8]
  assert verdicts(b.summary(b.FULL, partial))["M = 8 within 5% of data parallel"] is None
  text = b.document(b.FULL, partial, META, "p.png")
  assert "| DiLoCo M = 8 | — (swept) | — | not run |" in text
  pytest.importorskip("matplotlib")
  b.figure(b.FULL, partial, META, str(tmp_path / "p.png"))
  assert (tmp_path / "p.png").stat().st_size > 0


def test_markdown():
  text = b.document(b.FULL, records(), META, "equal_tokens.png")
  assert "| DiLoCo M = 8 | 1 (swept) | 0, 1, 2 |" in text
  assert "- MISSED: M = 8 within 5% of data parallel (M = 8: +6.0%)." in text
  assert "- met: M = 1 at or below data parallel (M = 1: -0.3%)." in text
  assert "20.2 per parameter" in text
  assert "3 CPUs (Test CPU)" in text  # the machine of the runs, not the one rendering
