"""The accounting of ``benchmarks/studies/decoupled_staleness.py`` on hand-written run lines:
committed tokens per commit, the metric interpolated at the common token count, median and
range over seeds, the share of partial merges, the staleness histogram and the chosen rule,
against numbers computed by hand. Trains nothing."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from benchmarks import kit
from benchmarks.studies import decoupled_staleness as b


def payload(replica, tokens, stale=0, merged=True):
  return [replica, 0, tokens, stale, tokens / (1 + stale), merged]


CONTROL = [(True, [payload(i, 100) for i in range(4)])] * 2
"""Two synchronous rounds of 4 × 100 tokens: 400, then 800 committed."""
DECOUPLED = [(True, [payload(0, 100), payload(1, 100)]),
             (False, [payload(0, 50, 1, False)]),
             (True, [payload(0, 100, 1), payload(1, 100, 1), payload(2, 200, 2),
                     payload(3, 100, 3, False)])]
"""200 committed, an abort (50 lost), then 400 more (a payload of 100 tokens not merged)."""


def write(tmp_path, arm, seed, rounds, evals):
  record = {"kind": "run", "arm": arm, "seed": seed, "replicas": 4, "replica_steps": [3, 3, 2, 1],
            "tokens_per_step": 50, "settings": {"sync_period": 1, "outer_learning_rate": 1.4,
                                                  "outer_momentum": 0.0}, "load_before": "1.00",
            "load_after": "2.00", "wall_s": 60.0, "cpu_s": 30.0}
  if arm != b.CONTROL:
    record |= {"speeds": [1, 1, 0.5, 0.25], "min_quorum": 1, "grace_window": 0.5,
               "max_staleness": 1}
  merges = [{"kind": "merge", "round": r, "time": 10.0 * (r + 1), "committed": ok,
             "payloads": rows, "lost": sum(p[2] for p in rows if not p[5])}
            for r, (ok, rows) in enumerate(rounds)]
  lines = [record, *merges, *({"kind": "eval", "rounds": k, "bits_per_byte": v}
                              for k, v in evals.items())]
  (tmp_path / f"{arm}_seed{seed}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.mark.parametrize(("dylu_shift", "chosen"), [(-0.1, "dylu"), (-0.01, "none")])
def test_equal_token_metric_median_range_and_the_chosen_rule(tmp_path, dylu_shift, chosen):
  for seed, d in enumerate((0.0, 0.04, 0.02)):
    write(tmp_path, b.CONTROL, seed, CONTROL, {0: 8.0, 1: 6.0, 2: 5.0 + d})
    write(tmp_path, "none", seed, DECOUPLED, {0: 8.0, 1: 7.0, 2: 5.0 + d})
    write(tmp_path, "dylu", seed, DECOUPLED, {0: 8.0, 2: 5.0 + d + dylu_shift})
  revert = {"kind": "merge", "round": 1, "replica": 0, "step": 2, "lost": 25}  # after the abort
  with open(tmp_path / "none_seed0.jsonl", "a") as f:
    f.write(json.dumps(revert) + "\n")
  result = b.load(str(tmp_path), b.Config())
  assert result["common_tokens"] == 600  # the decoupled runs' 200 + 400
  control, none, dylu = (result["arms"][k] for k in (b.CONTROL, "none", "dylu"))
  # The control at 600 tokens: halfway from 6.0 (400) to 5.0 + d (800).
  assert control["by_seed"] == pytest.approx({0: 5.5, 1: 5.52, 2: 5.51})
  assert none["by_seed"] == pytest.approx({0: 5.0, 1: 5.04, 2: 5.02})
  assert (none["median"], none["min"], none["max"]) == pytest.approx((5.02, 5.0, 5.04))
  assert dylu["median"] == pytest.approx(5.02 + dylu_shift)
  assert result["chosen"] == chosen
  # Commits with fewer than R payloads merged: both of the decoupled runs', none of the control's.
  assert none["partial"] == [1.0] * 3 and control["partial"] == [0.0] * 3
  assert none["staleness"] == {0: 6, 1: 9, 2: 3, 3: 3}  # every closed payload, over 3 seeds
  assert none["lost"] == 3 * 150 + 25 and none["commits"] == [2] * 3  # seed 0's revert's 25
  text = b.markdown(result, "plot.png")
  assert f"Chosen: **`{chosen}`**" in text and "5.0200 [5.0000, 5.0400]" in text
  assert text.startswith("# Decoupled rounds: the staleness rule at speeds 1 : 1 : 0.5 : 0.25\n")


def test_spread():
  assert kit.spread([3.0, 1.0, 2.0], ".1f") == "2.0 [1.0, 3.0]"
  assert kit.spread([1.0, 1.0], ".1f") == "1.0"
  assert kit.spread([1.0, None], ".1f") == "—"


def test_the_default_schedule_is_the_torchft_benchmark_s():
  """The speeds are the CPU shares the torchft speeds benchmark measured under its caps (0.373,
  0.364, 0.177, 0.086) over the fastest's, to 3 decimals; H = 20 and 200 steps give each replica
  its whole sync periods of the fastest's simulated time (floor(200 v / 20) · 20), and ``--quick``
  leaves every replica a round."""
  shares = np.array([0.373, 0.364, 0.177, 0.086])
  c = b.Config()
  assert c.speeds == tuple(np.round(shares / shares[0], 3)) and c.gamma == 0
  assert b.replica_steps(c) == [200, 180, 80, 40]
  assert b.replica_steps(dataclasses.replace(c, **b.QUICK)) == [20, 16, 8, 4]
