"""The chaos study (``benchmarks/studies/chaos/``): its fault schedule and its redraw rule, its
accounting on hand-written replica logs, the report recomputed from an archive, its per-replica
CPU caps (cgroups, as root), and one small faulted run of ``optax-dist train --fault-tolerant``
(3 replicas, a scripted ``SIGSTOP``, ``kill -9``, link down and Lighthouse kill) whose numbers
are checked against a count of its own logs, with every process of the run gone afterwards.

The run needs the ``ft`` extra; with ``OPTAX_DIST_REQUIRE_FT=1`` (``make test``) a missing
extra fails it instead of skipping it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from benchmarks.network import faults as faults_
from benchmarks.network import netns
from benchmarks.studies import chaos
from benchmarks.studies.chaos import accounting, report, runs
from benchmarks.studies.chaos.schedule import TimedFault, redraw, redraw_rng, schedule


def test_schedule_is_fixed_by_its_seed_and_extends_with_the_horizon():
  a = schedule(3, 0.1, 300.0, 4)
  assert a == schedule(3, 0.1, 300.0, 4)
  assert a != schedule(4, 0.1, 300.0, 4)
  assert schedule(3, 0.1, 600.0, 4)[:len(a)] == a


def test_schedule_draws_a_poisson_process_of_its_rate():
  rate, horizon = 0.1, 100_000.0
  faults = schedule(0, rate, horizon, 4, (3.0, 10.0), (5.0, 15.0))
  expected = rate * horizon  # 10,000 faults; a Poisson count's standard deviation is 100
  assert abs(len(faults) - expected) < 4 * math.sqrt(expected)
  assert all(0 < f.at < horizon for f in faults)
  assert [f.at for f in faults] == sorted(f.at for f in faults)
  for kind in chaos.schedule.KINDS:  # binomial(n, 1/3): standard deviation sqrt(n * 2/9)
    count = sum(f.kind == kind for f in faults)
    assert abs(count - len(faults) / 3) < 4 * math.sqrt(len(faults) * 2 / 9)
  assert {f.replica for f in faults} == {0, 1, 2, 3}
  assert all(3.0 <= f.seconds <= 10.0 for f in faults if f.kind == "stop")
  assert all(5.0 <= f.seconds <= 15.0 for f in faults if f.kind == "link")
  assert all(f.seconds == 0.0 for f in faults if f.kind == "kill")


@pytest.mark.parametrize("kwargs", [{"rate": 0.0}, {"horizon": -1.0}, {"replicas": 0},
                                    {"stop_seconds": (5.0, 3.0)}, {"link_seconds": (0.0, 1.0)}])
def test_schedule_refuses_bad_input(kwargs):
  args = {"seed": 0, "rate": 0.1, "horizon": 10.0, "replicas": 2} | kwargs
  with pytest.raises(ValueError, match="chaos.schedule"):
    schedule(**args)


def test_a_fault_its_replica_cannot_take_is_redrawn_on_a_live_one_at_the_same_time():
  fault = TimedFault(12.5, "stop", 1, 4.0)
  assert redraw(fault, {0, 1, 3}, redraw_rng(0)) is fault  # its replica can: unchanged
  # replica 1 dead: the same stop at 12.5 s on sorted({0, 2, 3})[u], u the stream's first draw
  u = int(np.random.default_rng([0, 1]).integers(3))
  assert redraw(fault, {3, 0, 2}, redraw_rng(0)) == TimedFault(12.5, "stop", [0, 2, 3][u], 4.0)
  # every arm of a seed draws alike: the same live replicas, the same redraws in order
  one, other = redraw_rng(5), redraw_rng(5)
  picks = [redraw(fault, {0, 2, 3}, one).replica for _ in range(50)]
  assert picks == [redraw(fault, {0, 2, 3}, other).replica for _ in range(50)]
  assert set(picks) == {0, 2, 3}  # uniform over the live ones (50 draws miss one w.p. < 1e-8)
  assert redraw(fault, set(), redraw_rng(0)) is None  # none live: unapplied
  assert redraw(TimedFault(3.0, "lighthouse", -1), set(), redraw_rng(0)) is None


def line(round, replica, time, committed=True, weight=10, tokens=10, healed=False, pid=None,
         state_hash="h", quorum_seconds=0.01, attempts=1):
  return {"attempts": attempts, "round": round, "replica": replica, "time": time,
          "committed": committed, "step": 10 * (round + 1),
          "weight": weight, "tokens": tokens, "healed": healed, "pid": pid or 100 + replica,
          "state_hash": f"{state_hash}{round}", "quorum_seconds": quorum_seconds}


def write_logs(run: pathlib.Path, lines: list[dict]) -> None:
  """``lines`` as the replicas' JSONL files of the run directory ``run`` (``PREFIX_runs``'s)."""
  (run / "replicas").mkdir(parents=True)
  for i in sorted({x["replica"] for x in lines}):
    (run / "replicas" / f"replica_{i}.jsonl").write_text("".join(
      json.dumps(x) + "\n" for x in lines if x["replica"] == i))


RECORD = {"final": [{"test_x": 1.0}], "status": 0, "wall_s": 9.0, "load_before": "1.00, 1, 1",
          "load_after": "2.00, 2, 2", "curve": []}


def faulted_run():
  """Two replicas from t0 = 100 s: replica 1 is killed at 1.5 s, replica 0 aborts round 2
  alone, replica 1 restarts at 2.5 s (pid 201), is ready at 2.8 s and heals in round 3 (weight
  0); round 4 commits after a retried exchange."""
  lines = [line(0, 0, 100.0), line(0, 1, 100.0), line(1, 0, 101.0), line(1, 1, 101.0),
           line(2, 0, 102.0, committed=False),
           line(3, 0, 103.0), line(3, 1, 103.0, weight=0, healed=True, pid=201,
                                   quorum_seconds=0.2),
           line(4, 0, 104.0, attempts=2), line(4, 1, 104.0, pid=201, attempts=2)]
  events = [[0.0, "start", 0, 100], [0.0, "start", 1, 101], [1.5, "kill", 1, 101],
            [2.5, "start", 1, 201], [2.8, "ready", 1, 201]]
  return RECORD | {"t0": 100.0, "lines": lines, "events": events}


def control_run():
  return RECORD | {"t0": 50.0, "events": [],
                   "lines": [line(r, i, 50.0 + r) for r in range(6) for i in range(2)]}


def test_accounting_of_a_hand_written_log():
  got = accounting.accounting(faulted_run(), span=4.0)
  # rounds 1, 3, 4 after the first commit: 10 + 10, 10 + 0 (the healer), 10 + 10
  assert got["committed_tokens"] == 50
  assert accounting.accounting(faulted_run(), span=3.5)["committed_tokens"] == 30
  assert (got["rounds_committed"], got["rounds_aborted"], got["abort_lines"]) == (4, 1, 1)
  assert got["rounds_retried"] == 1
  assert got["longest_stall_s"] == pytest.approx(2.0)  # round 1 at 1 s, round 3 at 3 s
  # restarted at 2.5 s, ready at 2.8 s, first commit (round 3) at 3 s; no round in between
  assert got["returns"] == [{"kind": "kill", "seconds": pytest.approx(0.5), "rounds": 0,
                             "startup": pytest.approx(0.3), "heal": pytest.approx(0.2),
                             "heal_rounds": 0}]
  assert got["applied"] == {"kill": 1, "stop": 0, "link": 0, "lighthouse": 0, "unapplied": 0}
  assert got["full_round_s"] == pytest.approx(1.0)  # rounds 1, 3 and 4 (2 aborted, 3 after it)
  assert got["hash_mismatches"] == 0
  assert got["timeline"][-1] == [pytest.approx(4.0), 50.0]
  assert (got["heals"], got["unprovoked_heals"]) == (1, 0)  # killed 1.5 s before its heal


def test_goodput_and_the_work_lost_per_applied_fault_against_the_control():
  result = accounting.compare(control_run(), faulted_run())
  assert result["span_s"] == 4.0  # the faulted run's; the control ran 5 s
  assert result["control"]["committed_tokens"] == 80  # rounds 1 to 4, two replicas, 10 each
  figures = accounting.figures(result["faulted"], result["control"], result["span_s"])
  assert figures["goodput"] == pytest.approx(50 / 80)
  # 30 of the control's 80 tokens in 4 s lost: 1.5 s of its pace, to 1 applied fault
  assert figures["lost_per_fault_s"] == pytest.approx(30 / (80 / 4.0))
  assert figures["per_minute"] == pytest.approx(1 / 4.0 * 60)
  result["faulted"]["applied"]["kill"] = 0
  assert accounting.figures(result["faulted"], result["control"], 60.0)["lost_per_fault_s"] is None


def test_faults_counted_are_the_applied_ones_within_the_span():
  events = [[0.0, "start", 0, 1], [1.0, "kill", 0, 1], [2.0, "unapplied", -1, None],
            [3.0, "stop", 1, 2], [3.5, "stop", 2, 3], [6.0, "cont", 1, 2], [7.0, "link", 2, 3],
            [8.0, "lighthouse", -1, 9], [12.0, "kill", 1, 5]]
  assert accounting.applied(events, span=10.0) == {"kill": 1, "stop": 2, "link": 1,
                                                   "lighthouse": 1, "unapplied": 1}


def test_returns_per_kind_from_a_sigcont_a_link_up_and_a_restart():
  """Replica 0's commits at 1, 5, 6 and 9 s, the run's at every second: a stop ended by its
  SIGCONT at 2.5 s returns at 5 s (2 rounds, 3 and 4, between); a link down up at 5.5 s returns
  at 6 s; a kill restarted at 7 s with no ready mark has no split; a kill without a return is
  left out."""
  events = [[0.5, "stop", 0, 1], [2.5, "cont", 0, 1], [4.0, "link", 0, 1], [5.5, "up", 0, 1],
            [6.5, "kill", 0, 1], [7.0, "start", 0, 2], [9.5, "kill", 0, 2]]
  got = accounting.returns(events, lambda i: [1.0, 5.0, 6.0, 9.0], commits=range(1, 11))
  assert [(r["kind"], r["seconds"], r["rounds"]) for r in got] == [
    ("stop", 2.5, 2), ("link", 0.5, 0), ("kill", 2.0, 2)]
  assert got[2]["startup"] is None and got[2]["heal"] is None
  # no start-up: the heal is all of the return
  assert [(r["heal"], r["heal_rounds"]) for r in got[:2]] == [(2.5, 2), (0.5, 0)]
  p95 = accounting.p95(got + [{"kind": "stop", "seconds": 4.5, "rounds": 0, "startup": None,
                               "heal": 4.5, "heal_rounds": 0}])
  assert p95["stop"] == {"seconds": pytest.approx(np.percentile([2.5, 4.5], 95)),
                         "rounds": pytest.approx(np.percentile([2, 0], 95)),
                         "heal": pytest.approx(np.percentile([2.5, 4.5], 95)),
                         "heal_rounds": pytest.approx(np.percentile([2, 0], 95)), "n": 2}
  assert p95["kill"]["n"] == 1 and "startup" not in p95["kill"]


def test_a_stop_in_a_restarts_start_up_returns_from_its_ready_mark():
  """Restarted at 1 s, stopped at 2 s (still starting), SIGCONT at 3 s, ready at 9 s, first
  commit at 10 s: 7 s from SIGCONT (the run's rounds at 3 to 9 s: 7), of which 6 s the start-up
  left and 1 s the heal (the round at 9 s: 1)."""
  events = [[0.5, "kill", 0, 1], [1.0, "start", 0, 2], [2.0, "stop", 0, 2], [3.0, "cont", 0, 2],
            [9.0, "ready", 0, 2]]
  got = accounting.returns(events, lambda i: [10.0], commits=range(1, 11))
  assert [tuple(r.values()) for r in got] == [
    ("kill", 9.0, 9, 8.0, 1.0, 1), ("stop", 7.0, 7, 6.0, 1.0, 1)]


def test_the_validation_curve_and_the_median_gap_over_its_second_half_at_equal_tokens():
  run = faulted_run()
  run["curve"] = [{"step": 20, "rounds": 2, "time": 101.0, "test_x": 2.0},
                  {"step": 50, "rounds": 4, "time": 104.0, "test_x": 1.5}]
  # up to step 20: rounds 0 and 1 (40 tokens); up to 50: and round 3 (10, the healer 0) and 4
  faulted = accounting.accounting(run, span=4.0)["curve"]
  assert faulted == [[1.0, 40, 2.0], [4.0, 70, 1.5]]
  control = [[1.0, 40, 2.2], [3.0, 80, 1.6]]
  # the second half is the last checkpoint: the control at 70 tokens is
  # 2.2 + (70 - 40) / (80 - 40) * (1.6 - 2.2) = 1.75
  assert accounting.second_half_gap(control, faulted) == pytest.approx(1.5 / 1.75 - 1)
  # four checkpoints: the median of the last two's gaps (at 40 tokens 2.2, at 80 1.6)
  four = [[0, 10, 9.9], [0, 20, 9.9], [0, 40, 2.42], [0, 80, 1.6]]
  assert accounting.second_half_gap(control, four) == pytest.approx(np.median([0.1, 0.0]))
  assert accounting.second_half_gap([], faulted) is None


def test_a_heal_with_no_fault_of_its_own_within_20_s_is_unprovoked():
  run = faulted_run()
  run["events"].append([18.0, "lighthouse", -1, 7])  # a Lighthouse kill touches every replica
  run["lines"] += [line(5, 0, 125.0, weight=0, healed=True),  # 7 s after it
                   line(6, 1, 138.0, weight=0, healed=True),  # 20 s after it: the window's end
                   line(7, 1, 138.5, weight=0, healed=True)]  # 20.5 s
  got = accounting.accounting(run, span=40.0)
  assert (got["heals"], got["unprovoked_heals"]) == (4, 1)


def test_a_hash_mismatch_is_counted():
  run = faulted_run()
  run["lines"][-1] = line(4, 1, 104.0, pid=201, state_hash="other")
  assert accounting.accounting(run, span=4.0)["hash_mismatches"] == 1


def sync_run():
  """Checkpoints at 0, 10, 25 and 40 s after t0 = 100 s (steps 100 to 400); a kill at 11 s ends
  the command at 12 s, resumed at 14 s; a stop at 31 s continued at 33 s; another exit at 50 s."""
  return RECORD | {"t0": 100.0, "saved": [[100.0, 100], [110.0, 200], [125.0, 300], [140.0, 400]],
                   "events": [[0.0, "start", 0, 7], [11.0, "kill", 1, 8], [12.0, "exit", -1, 1],
                              [14.0, "resume", -1, 9], [31.0, "stop", 0, 10],
                              [33.0, "cont", 0, 10], [50.0, "exit", -1, 1]], "final": []}


def test_sync_accounting_counts_checkpointed_steps_and_returns_to_the_next_checkpoint():
  """Over 30 s, 200 steps are durable and one restart falls in the span; the kill returns at its
  resume (14 s) to the checkpoint at 25 s; over 40 s the stop returns at 33 s to the one at 40 s."""
  got = accounting.sync_accounting(sync_run(), span=30.0, tokens_per_step=64.0)
  assert got["committed_tokens"] == 200 * 64
  assert got["restarts"] == 1
  assert got["longest_stall_s"] == pytest.approx(15.0)  # from 10 s to 25 s
  assert got["timeline"] == [[0.0, 0.0], [10.0, 6400.0], [25.0, 12800.0]]
  assert got["applied"]["kill"] == 1 and got["applied"]["stop"] == 0
  assert got["returns"] == [{"kind": "kill", "seconds": 11.0, "rounds": None, "startup": None,
                             "heal": None, "heal_rounds": None}]
  longer = accounting.sync_accounting(sync_run(), span=40.0, tokens_per_step=64.0)
  assert [(r["kind"], r["seconds"]) for r in longer["returns"]] == [("kill", 11.0),
                                                                     ("stop", 7.0)]


def test_the_report_recomputed_from_its_archive_equals_the_one_computed_from_the_runs(tmp_path,
                                                                                       capsys):
  """A tiny synthetic study of one seed: the archive holds the records and the replicas' JSONL
  files of ``PREFIX_runs``; read back, every figure is the same as from the records in memory.
  The synchronous arm checkpoints every second, its faulted run killed at 1.5 s, resumed at
  2.5 s and checkpointed at 3.5 s: over the 4 s span, 200 of 400 steps."""
  prefix = str(tmp_path / "chaos")
  sync = {"saved": [[100.0 + t, 100 * (t + 1)] for t in range(5)], "events": []}
  found = {"control": control_run(), "faulted": faulted_run(), "equal_tokens": control_run(),
           "sync_control": sync_run() | sync, "sync_faulted": sync_run() | {
             "saved": [[100.0, 100], [101.0, 200], [103.5, 300]],
             "events": [[1.5, "kill", 1, 8], [2.0, "exit", -1, 1], [2.5, "resume", -1, 9]]}}
  found["equal_tokens"]["final"] = [{"test_x": 0.8}]
  for name in ("control", "faulted", "equal_tokens"):
    write_logs(tmp_path / "chaos_runs/seed0" / name, found[name]["lines"])
  study = {"config": dataclasses.asdict(runs.Config(seeds=(0,))),
           "seeds": {"0": {"steps": 50, "tokens_per_step": 64.0, "sync_checkpoint_every": 100}}}
  in_memory = report.result(study, {"0": found})
  report.write_archive(f"{prefix}_raw.tar.xz", study, {"0": found}, prefix)
  again = report.result(*report.read_archive(f"{prefix}_raw.tar.xz"))
  assert json.dumps(again, sort_keys=True) == json.dumps(in_memory, sort_keys=True)
  figures = in_memory["seeds"]["0"]["figures"]
  assert figures["goodput"] == pytest.approx(50 / 80)
  assert figures["equal_tokens_gap"] == pytest.approx(1.0 / 0.8 - 1)
  assert figures["sync"]["goodput"] == 0.5 and figures["sync"]["applied"]["kill"] == 1
  assert figures["sync"]["returns"]["kill"] == {"seconds": 1.0, "n": 1}  # resume to checkpoint
  assert ["goodput", "0.625", "0.500"] in in_memory["summary"]
  text = report.markdown(in_memory, "chaos.png")
  # (1 - 0.625) * 4 s / 1 fault and (1 - 0.5) * 4 s / 1 fault
  assert "| committed work lost per applied fault (s) | 1.5 | 2.0 |" in text
  report.plot(in_memory, str(tmp_path / "chaos.png"))
  report.main(["--recompute", f"{prefix}_raw.tar.xz"])  # the script prints the same report
  assert capsys.readouterr().out == text + "\n"


def speeds_sync_run():
  """Two replicas from t0 = 100 s, a round every 2 s (rounds 0 to 3), replica 0 1.1 s of each
  in its exchange, replica 1 0.1 s; round r's loss 4 - r on both."""
  return RECORD | {"t0": 100.0, "boundaries": [], "events": [], "lines": [
    {**line(r, i, 100.0 + 2 * r), "members": [0, 1], "exchange_seconds": 1.1 - i,
     "loss": 4.0 - r} for r in range(4) for i in (0, 1)]}


def speeds_decoupled_run():
  """K = 1 from t0 = 200 s: replica 0 pushes at 199.9 s + k and waits 0.1 s (rounds 0 to 3 at
  200 + k s), replica 1 pushes at 200.5 s and 202.5 s and waits 0.5 s and 0.3 s, its payloads
  stale by 1 in rounds 1 and 3 (a catch-up line between), then at 203 s skips its boundary (its
  payload in flight: no wait; a Revert line before it, as an aborted round's settle writes
  them, with its boundary's ``at``)."""
  mine = {1: [1, 10, 10, 1, 5.0, True], 3: [1, 20, 10, 1, 5.0, True]}
  losses = [3.0, 2.0, 1.0, 0.5]
  lines = [{"round": r, "replica": i, "time": 200.0 + r, "committed": True, "healed": False,
            "state_hash": f"h{r}",
            "payloads": [[0, 10 * (r + 1), 10, 0, 10.0, True]] + [mine.get(r)] * (r in mine),
            "weight": 10 if i == 0 or r in mine else 0,
            "loss": losses[r] if i == 0 or r in mine else None} for r in range(4) for i in (0, 1)]
  bounds = [{"replica": 0, "step": 10 * (k + 1), "time": 200.0 + k, "landed": True,
             "pushed": 199.9 + k, "waited": 0.1} for k in range(4)]
  bounds += [{"replica": 1, "step": 10 * k, "time": 198.5 + 2.2 * k, "landed": False,
              "pushed": 198.5 + 2 * k, "waited": 0.7 - 0.2 * k} for k in (1, 2)]
  bounds.insert(5, {"round": 2, "replica": 1, "donor": 0, "missed": 1, "rounds": 2})
  bounds.append({"round": 4, "replica": 1, "step": 30, "lost": 0, "at": 203.0})  # a Revert
  bounds.append({"replica": 1, "step": 30, "time": 202.0, "landed": False, "at": 203.0})
  return RECORD | {"t0": 200.0, "lines": lines, "boundaries": bounds, "events": []}


def test_speeds_figures_from_hand_written_logs_and_the_report_from_its_archive(tmp_path, capsys):
  """Inner steps of 0.05 s and 0.1 s alone, H = 10. Synchronous: rounds 1 to 3 in the 6 s span,
  utilization (30 * 0.05 + 30 * 0.1) / (6 * 2); decoupled: 3 and 3 boundaries in 3 s (one
  skipped), (30 * 0.05 + 30 * 0.1) / (3 * 2); the smoothed decoupled loss (means of the last 2 lines: 1.5 at 2 s, 0.75
  at 3 s) reaches the synchronous control's final 1.0 at 2 + 2/3 s, 0.444 of its span. Read
  back from the archive, the same figures and report. The faulted decoupled run's replica 1
  ends round 3 on another hash with weight 0: goodput 40 / 50 tokens, one mismatch."""
  from benchmarks.studies.chaos import speeds

  cfg = dataclasses.asdict(runs.Config(seeds=(0,), replicas=2, sync_period=10,
                                       speeds=(1.0, 0.5), windows=(2.0,), speed_faults=True))
  study = {"config": cfg, "seeds": {"0": {"order": ["sync", "k1_w2"]}}, "calibration": {
    "t_solo": [0.05, 0.1], "share": [2 / 3, 1 / 3], "expected": [2 / 3, 1 / 3],
    "caps": [0.67, 0.33], "within": [True, True]}}
  found = {"sync_control": speeds_sync_run(), "sync": speeds_sync_run(),
           "k1_w2_control": speeds_decoupled_run(), "k1_w2": speeds_decoupled_run()}
  found["k1_w2"]["lines"][-1] |= {"weight": 0, "state_hash": "x"}  # replica 1, round 3
  got = speeds.result(study, {"0": found})
  sync, late = (got["seeds"]["0"]["runs"][k] for k in ("sync_control", "k1_w2_control"))
  faulted = got["seeds"]["0"]["runs"]["k1_w2"]["faults"]
  assert (faulted["goodput"], faulted["hash_mismatches"]) == (pytest.approx(0.8), 1)
  assert got["seeds"]["0"]["runs"]["sync"]["faults"]["goodput"] == 1.0
  assert sync["utilization"] == pytest.approx(4.5 / 12) and sync["tokens_per_s"] == 10
  assert (sync["partial_share"], sync["staleness"]) == (0, {"0": 8})
  assert sync["wait_s"] == [pytest.approx([1.1] * 3), pytest.approx([0.1] * 3)]
  assert sync["inner_step_s"] == pytest.approx([0.09, 0.19])  # (2 s - its exchange) / H
  assert (sync["final_loss"], sync["final"], sync["reach"]) == (1.0, 1.0, 1.0)
  assert late["utilization"] == pytest.approx(4.5 / 6)
  assert late["steady_utilization"] == late["utilization"]  # both loops' last boundary at 203 s
  early = speeds_decoupled_run()
  early["boundaries"].pop()  # replica 1's loop returned at 202.8 s: 2 boundaries each until then
  assert speeds.accounting(early, [0.05, 0.1], 10)["steady_utilization"] == pytest.approx(
    (20 * 0.05 + 20 * 0.1) / (2.8 * 2))
  assert late["tokens_per_s"] == pytest.approx(50 / 3)  # rounds 1 to 3: 30 + 20 tokens
  assert (late["partial_share"], late["staleness"]) == (0.5, {"0": 4, "1": 2})
  assert late["wait_s"] == [pytest.approx([0.1] * 3), pytest.approx([0.3, 0.496, 0.5])]
  assert late["inner_step_s"] == pytest.approx([0.09, 0.085])  # of (202.5 - 201) and (203 - 202.8)
  assert late["reach"] == pytest.approx((2 + 2 / 3) / 6)
  text = report.markdown(got, "speeds.png")
  assert "- K = 1, W = 2 s: utilization ≥ 0.95 (sync's 0.375): 0.750, **missed**" in text
  assert "final loss within half its span: 0.444, **met**" in text
  assert "wait p99 (s) ≤ the window, 2 s: 0.496, **met**" in text
  assert "goodput under the chaos schedule ≥ 0.95: 0.800, **missed**" in text
  assert "hash mismatches = 0: 1, **missed**" in text
  assert "## Targets\n" in text  # a calibration off its check: the utilization is not judged
  off = dict(got, calibration=dict(got["calibration"], within=[True, False]))
  assert "## Targets (utilization not judged: a speed off ±10%)\n" in report.markdown(off, "s.png")
  prefix = str(tmp_path / "speeds")
  for name, run in found.items():
    write_logs(tmp_path / "speeds_runs/seed0" / name, run["lines"])
  report.write_archive(f"{prefix}_raw.tar.xz", study, {"0": found}, prefix)
  again = report.result(*report.read_archive(f"{prefix}_raw.tar.xz"))
  assert json.dumps(again, sort_keys=True) == json.dumps(got, sort_keys=True)
  report.plot(got, str(tmp_path / "speeds.png"))
  report.main(["--recompute", f"{prefix}_raw.tar.xz"])
  assert capsys.readouterr().out == text + "\n"


def test_speeds_arms_caps_and_their_commands():
  """The arms' commands parse and pass the command's checks (a decoupled run takes neither
  --exchange-retries nor --checkpoint-every); each replica's quota is its share of the CPUs."""
  from benchmarks.studies.chaos import speeds
  from optax_dist.cli import ft_flags
  from optax_dist.cli.main import build_parser

  config = runs.Config(speeds=(1.0, 1.0, 0.5, 0.25), steps=100, windows=(0.0, 2.0))
  got = speeds.arms(config)
  assert [name for name, _ in got] == ["sync", "k1_w0", "k1_w2"]
  for name, c in got:
    args = build_parser().parse_args(runs.command(c, "OUT")[3:])
    ft_flags.resolve(args)
    assert (args.decoupled, args.steps, args.checkpoint_every) == (
      name != "sync", 100 if name == "sync" else 400, None)
    assert args.decoupled is False or (args.min_quorum, args.grace_window) == (1, c.decoupled)
  shares = faults_.CpuShares(4, 1.6, speeds=config.speeds, period_us=20_000)
  assert shares.quotas == [11636, 11636, 5818, 2909]  # 20 ms * 1.6 * (1, 1, .5, .25) / 2.75
  assert faults_.CpuShares(4, 0.04).quotas == [1000] * 4  # the chaos study's equal shares
  with pytest.raises(ValueError, match="a quota of 181 us, under 1000 us"):
    faults_.CpuShares(4, 0.1, speeds=config.speeds, period_us=20_000)


def test_speeds_arms_run_in_turn_reversed_every_other_seed_each_beside_its_control(tmp_path,
                                                                                  monkeypatch):
  """``speeds.run_seed`` with stand-in runs: seed 1 runs the arms in reverse order, each pair a
  control without faults and a second run, faulted only with ``speed_faults`` (the seed's
  schedule); a decoupled arm runs R * steps. Then, for each K = 1 arm, an equal-speed
  synchronous run alone of its control's committed tokens (12 lines of 10 tokens, rounds of
  2 x 10: 6 rounds)."""
  from benchmarks.studies.chaos import speeds

  calls = []

  def together(made, timeout):
    calls.append([(r.config.decoupled, r.config.steps, len(r.pending), r.tag, r.config.speeds)
                  for r in made])
    for r in made:
      os.makedirs(r.out, exist_ok=True)
    return [control_run() for _ in made]

  monkeypatch.setattr(runs, "together", together)
  config = runs.Config(replicas=2, steps=100, speeds=(1.0, 0.5), windows=(0.0, 2.0))
  for seed, faulted in ((0, False), (1, True)):
    calls.clear()
    c = dataclasses.replace(config, speed_faults=faulted)
    meta, found = speeds.run_seed(c, seed, str(tmp_path / f"speeds{seed}"))
    order = ["sync", "k1_w0", "k1_w2"][::1 - 2 * seed]
    assert meta == {"order": order} and len(found) == 8 and f"{order[0]}_control" in found
    assert {"k1_w0_equal_tokens", "k1_w2_equal_tokens"} <= found.keys()
    windows = {"sync": None, "k1_w0": 0.0, "k1_w2": 2.0}
    faults = len(schedule(seed, c.fault_rate, c.timeout, 2)) if faulted else 0
    equal = [(None, 6 * c.sync_period, 0, "e", (1.0, 1.0))]
    assert calls == [[(windows[a], 100 if a == "sync" else 200, 0, "c", (1.0, 0.5)),
                      (windows[a], 100 if a == "sync" else 200, faults, "f", (1.0, 0.5))]
                     for a in order] + [equal, equal]
    assert faults > 0 or not faulted


def link_run(t0: float, every: float, seconds: float, tx: int) -> dict:
  """Two replicas from ``t0``, rounds 0 to 3 every ``every`` s, each exchange ``seconds`` long,
  each replica's veth having sent ``tx`` bytes (and received as many)."""
  return RECORD | {"t0": t0, "events": [], "link_bytes": [{"tx_bytes": tx, "rx_bytes": tx}] * 2,
                   "lines": [line(r, i, t0 + every * r) | {"exchange_seconds": seconds,
                                                           "loss": 1.0}
                             for r in range(4) for i in (0, 1)]}


def test_link_figures_from_hand_written_logs_and_the_report_from_its_archive(tmp_path, capsys):
  """Per seed and overlap, the shaped run's span over the unshaped one's: seed 0's shaped run
  takes 3 s per round (span 9 s) against 2 s (6 s), seed 1's 2 s against 2 s; median 1.25,
  missed; seed 1's shaped run ends on another hash. Read back from the archive, the same."""

  cfg = dataclasses.asdict(runs.Config(seeds=(0, 1), replicas=2, rate="10mbit", overlaps=(8,)))
  found = {"0": {"overlap8_shaped": link_run(10.0, 3.0, 1.0, 2_000_000),
                 "overlap8_unshaped": link_run(50.0, 2.0, 0.25, 1_000_000)},
           "1": {"overlap8_unshaped": link_run(10.0, 2.0, 0.5, 1_000_000),
                 "overlap8_shaped": link_run(90.0, 2.0, 1.5, 1_000_000)}}
  found["1"]["overlap8_shaped"]["lines"][-1]["state_hash"] = "other"
  for seed, runs_ in found.items():
    for name, record in runs_.items():
      write_logs(tmp_path / f"link_runs/seed{seed}" / name, record["lines"])
  study = {"config": cfg, "seeds": {"0": {}, "1": {}}}
  got = report.result(study, found)
  assert got["summary"][8] == {"span_s": [1.5, 1.0], "wall_s": [1.0, 1.0], "same_hash": False}
  shaped = got["seeds"]["0"]["overlap8_shaped"]
  assert (shaped["span_s"], shaped["rounds"], shaped["exchange_s"]) == (9.0, 4, 1.0)
  assert shaped["sent_mb"] == shaped["received_mb"] == [2.0, 2.0]
  text = report.markdown(got, "link.png")
  assert "| 8 | 1.250 [1.000, 1.500] | 1.000 | no |" in text and "8: 1.250 ≤ 1.05 missed" in text
  prefix = str(tmp_path / "link")
  report.write_archive(f"{prefix}_raw.tar.xz", study, found, prefix)
  again = report.result(*report.read_archive(f"{prefix}_raw.tar.xz"))
  assert json.dumps(again, sort_keys=True) == json.dumps(got, sort_keys=True)
  report.plot(got, str(tmp_path / "link.png"))


def test_link_pairs_alternate_which_run_goes_first(tmp_path, monkeypatch):
  """``link.run_seed`` with stand-in runs: per overlap a shaped run (its star at the rate) and
  an unshaped one, alone, at all the CPUs, the training seed the seed; the first of a pair
  alternates with the seed and the overlap."""
  from benchmarks.studies.chaos import link

  calls = []

  def together(made, timeout):
    calls.append([(r.rate, r.cpus, r.config.flags.split()[-4:]) for r in made])
    for r in made:
      os.makedirs(r.out, exist_ok=True)
    return [control_run() for _ in made]

  monkeypatch.setattr(runs, "together", together)
  config = runs.Config(replicas=2, cpus=1.6, rate="10mbit", overlaps=(8, 0))
  for seed in (0, 1):
    calls.clear()
    _, found = link.run_seed(config, seed, str(tmp_path / f"link{seed}"))
    assert len(found) == 4
    first = ["10mbit", None] if seed == 0 else [None, "10mbit"]
    assert calls == [[(rate, 1.6, ["--seed", str(seed), "--overlap", str(tau)])]
                     for tau, order in ((8, first), (0, first[::-1])) for rate in order]


def test_young_daly_s_interval_and_the_synchronous_arm_s_settings():
  # sqrt(2 * 2 s * 45 s) = 13.42 s, in steps of 0.1 s
  assert runs.young_daly(2.0, 45.0, 0.1) == 134
  assert runs.young_daly(1e-6, 1.0, 10.0) == 1
  line = runs.sync_command(runs.Config(exchange_timeout=1.5, sync_checkpoint_every=7), "o", True)
  assert line[line.index("--heartbeat-timeout") + 1] == "2"
  assert line[line.index("--checkpoint-every") + 1] == "7" and line[-1] == "--resume"
  assert "--standby" not in runs.command(runs.Config(), "o")  # no spare by default


def test_a_seed_with_too_few_applied_faults_runs_again_longer_then_its_controls(tmp_path,
                                                                               monkeypatch):
  """``run_seed`` with stand-in runs: the first pair's faulted run takes 1 applied fault of the 2
  asked, so the pair runs again with 1.1 * 2 / 1 = 2.2 times the steps (220, a multiple of H) on
  the same schedule drawn further; then the equal-tokens control: the faulted run's 70
  committed tokens at R * 10 / H = 1 token per step, 80 steps (3.5 rounds of H, rounded); then
  the synchronous pair at Young and Daly's interval: sqrt(2 * 2 s * 45 s) / (1 s / H) steps."""
  calls = []

  def together(made, timeout):
    calls.append([(type(r).__name__, r.config.steps, r.config.sync_checkpoint_every,
                   r.pending, timeout) for r in made])
    for r in made:  # as a run does
      os.makedirs(r.out, exist_ok=True)
    if isinstance(made[0], runs.SyncRun):
      return [sync_run(), sync_run()]
    faulted = faulted_run()
    faulted["events"] += [[2.0, "stop", 0, 100], [2.2, "cont", 0, 100]] * (len(calls) > 1)
    return [control_run(), faulted][:len(made)]

  monkeypatch.setattr(runs, "together", together)
  monkeypatch.setattr(runs, "checkpoint_cost", lambda task, cpus: 2.0)
  config = runs.Config(replicas=2, steps=100, min_faults=2, fault_rate=1 / 30, timeout=100.0)
  meta, found = chaos.run_seed(config, 3, str(tmp_path / "chaos"))
  assert [[(kind, steps, every) for kind, steps, every, _, _ in call] for call in calls] == [
    [("FaultTolerantRun", 100, None)] * 2, [("FaultTolerantRun", 220, None)] * 2,
    [("FaultTolerantRun", 80, None)], [("SyncRun", 220, 268)] * 2]
  first, again = calls[0][1][3], calls[1][1][3]
  assert set(first) < set(again) and calls[1][0][4] == pytest.approx(220.0)  # drawn further
  assert calls[0][0][3] == [] and all(f.kind != "link" for f in calls[3][1][3])
  assert meta == {"steps": 220, "tokens_per_step": 1.0, "checkpoint_cost_s": 2.0,
                  "mtbf_s": pytest.approx(45.0), "step_s": 0.05, "sync_checkpoint_every": 268}
  assert sorted(found) == ["control", "equal_tokens", "faulted", "sync_control", "sync_faulted"]


def test_records_are_saved_and_read_back_with_reuse_and_the_same_settings(tmp_path):
  calls = []

  def run(outs):
    for out in outs:  # as a run does
      os.makedirs(out, exist_ok=True)
    calls.append(outs)
    return [{"n": len(calls), "out": os.path.basename(out)} for out in outs]

  prefix, pair = str(tmp_path / "chaos"), ("seed0/control", "seed0/faulted")
  first = runs.records(runs.Config(), prefix, pair, run)
  assert first == [{"n": 1, "out": "control"}, {"n": 1, "out": "faulted"}]
  assert runs.records(runs.Config(timeout=5.0, reuse=True), prefix, pair, run) == first
  assert runs.records(runs.Config(steps=40, reuse=True), prefix, pair, run)[1]["n"] == 2
  # a setting of the faulted run only: the pair runs again, as it runs together
  again = runs.Config(steps=40, reuse=True, lighthouse_kill=9.0)
  assert runs.records(again, prefix, pair, run)[0]["n"] == 3
  # the Lighthouse is killed in the faulted run only: the synchronous pair's records stay valid
  sync = ("seed0/sync_control", "seed0/sync_faulted")
  assert runs.records(runs.Config(steps=40), prefix, sync, run)[0]["n"] == 4
  assert runs.records(again, prefix, sync, run)[1]["n"] == 4
  assert runs.records(runs.Config(steps=40), prefix, pair, run)[0]["n"] == 5  # no --reuse
  assert len(calls) == 5


def test_measure_says_it_needs_root_and_runs_nothing(monkeypatch, capsys, tmp_path):
  monkeypatch.setattr(chaos.os, "geteuid", lambda: 1000)
  assert chaos.measure(chaos.Config(), str(tmp_path / "chaos")) is None
  assert "needs root" in capsys.readouterr().err
  assert list(tmp_path.iterdir()) == []


class FakeRun:
  """A run of :func:`runs.together` that goes on for ``ticks`` looks."""

  def __init__(self, ticks: int):
    self.ticks, self.endings, self.out, self.left = ticks, [], f"fake{ticks}", False

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.left = True

  def tick(self, ending: bool) -> bool:
    self.endings.append(ending)
    return len(self.endings) < self.ticks

  def record(self):
    return {"endings": self.endings}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ip netns)")
def test_runs_together_get_no_fault_once_one_has_ended_and_are_all_left():
  short, long = FakeRun(2), FakeRun(4)
  assert runs.together([short, long], timeout=60.0) == [
    {"endings": [False, False]}, {"endings": [False, False, True, True]}]
  assert short.left and long.left
  endless = FakeRun(10**9)
  with pytest.raises(TimeoutError, match="fake1000000000"):
    runs.together([FakeRun(1), endless], timeout=0.3)
  assert endless.left


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (/etc/netns)")
def test_remove_stale_removes_an_etc_netns_directory_left_without_its_namespace():
  gone = int(pathlib.Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it
  stale = pathlib.Path(f"/etc/netns/odist-f3-{gone}")
  mine = pathlib.Path(f"/etc/netns/odist-f3-{os.getpid()}")
  for path in (stale, mine):
    path.mkdir(parents=True)
  try:
    netns.remove_stale()
    assert not stale.exists() and mine.exists()  # its process has exited; this one runs
  finally:
    for path in (stale, mine):
      shutil.rmtree(path, ignore_errors=True)


def test_a_star_s_tag_is_one_letter_and_names_its_namespaces():
  star = netns.Star(2, tag="f")
  assert star.hub == f"odist-hubf-{os.getpid()}" and star.names[1] == f"odist-f1-{os.getpid()}"
  assert netns.Star(2).names[0] == f"odist-0-{os.getpid()}"
  with pytest.raises(ValueError, match="Star.tag='F1'"):
    netns.Star(2, tag="F1")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ip netns, tc)")
def test_a_shaped_star_shapes_each_leaf_both_ways_and_counts_its_bytes():
  """``Star(rate=...)``: a tbf at the rate on each leaf's ``eth0`` and on its bridge port; a
  datagram from leaf 0 to leaf 1 shows in both leaves' byte counters."""
  with netns.Star(2, tag="s", rate="10mbit") as star:
    for name, dev in [(n, "eth0") for n in star.names] + [(star.hub, p) for p in star.ports]:
      shown = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "show", "dev", dev],
                             capture_output=True, text=True, check=True).stdout
      assert "tbf" in shown and "10Mbit" in shown, (name, dev, shown)
    before = star.counters()
    send = ("import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x' * 1000,"
            f" ({star.addresses[1]!r}, 9))")
    subprocess.run(["ip", "netns", "exec", star.names[0], sys.executable, "-c", send], check=True)
    time.sleep(0.2)  # the port-unreachable answer
    after = star.counters()
  assert all(a["tx_bytes"] > b["tx_bytes"] and a["rx_bytes"] > b["rx_bytes"]
             for a, b in zip(after, before, strict=True))
  assert not [n for n in netns.namespaces() if n.endswith(f"-{os.getpid()}")]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups)")
def test_cpu_shares_cap_each_replica_and_leave_no_group():
  """Replica 1's group allows 1 ms of CPU in each 100 ms (0.04 CPUs over 4 replicas: little
  enough that a loaded machine still lets the process reach it): a busy process moved there is
  throttled, its thread named as gloo's released from the cap and its main thread not; on exit
  the groups are gone and the process, moved back, still runs."""
  assert faults_.CpuShares(4, 0).groups == []  # no caps
  busy = subprocess.Popen([sys.executable, "-c", (
    "import threading, time\nfrom optax_dist.fault_tolerance.lighthouse import name_thread\n"
    "threading.Thread(target=lambda: (name_thread('gloo_tcp_loop'), time.sleep(60))).start()\n"
    "while True: pass")])
  tasks = pathlib.Path(f"/proc/{busy.pid}/task")
  try:
    while not [t for t in tasks.iterdir() if (t / "comm").read_text() == "gloo_tcp_loop\n"]:
      assert busy.poll() is None, "the busy process exited before naming its thread"
      time.sleep(0.05)  # named before the cap (1% of a CPU) slows its imports
    with faults_.CpuShares(4, 0.04) as shares:
      group = shares.groups[1]
      quota = (group / ("cpu.max" if shares.v2 else "cpu.cfs_quota_us")).read_text()
      assert quota.split()[0] == "1000"
      shares.add(1, busy.pid)
      assert group.name in pathlib.Path(f"/proc/{busy.pid}/cgroup").read_text()
      if shares.v2:
        with pytest.raises(RuntimeError, match="threaded subtree"):
          shares.release(busy.pid, runs.FREE_THREADS)
      else:
        shares.release(busy.pid, runs.FREE_THREADS)
        placed = {((t / "comm").read_text(), group.name in (t / "cgroup").read_text())
                  for t in tasks.iterdir()}
        assert placed == {("gloo_tcp_loop\n", False), ("python\n", True)}
      time.sleep(1.0)
      stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
      assert int(stat["nr_throttled"]) > 0
    assert not any(g.exists() for g in shares.groups)
    assert group.name not in pathlib.Path(f"/proc/{busy.pid}/cgroup").read_text()
    assert busy.poll() is None
  finally:
    busy.kill()
    busy.wait()


needs_ft = pytest.mark.skipif(
  importlib.util.find_spec("torchft") is None and os.environ.get("OPTAX_DIST_REQUIRE_FT") != "1",
  reason="needs the ft extra (torch, torchft)")


@pytest.mark.slow
@needs_ft
def test_a_faulted_run_is_accounted_and_leaves_no_process(tmp_path):
  # A quorum of all 3: the others wait for the killed replica's restart, which then must heal
  # (with a smaller quorum the others may finish first on a loaded machine).
  # Uncapped (cpus=0): capped at 2/3 of a CPU on a loaded machine, a replica could miss the 2 s
  # exchange timeout; the caps are tested above.
  # Without standbys (3 more processes compiling beside the run): the launcher's takeover is
  # tested in test_torchft.py, and the study's view of a waiting standby below.
  # The second stop falls on replica 1, stopped already: it is redrawn on replica 0 or 2.
  config = runs.Config(replicas=3, min_replicas=3, task="digits", steps=500, sync_period=5,
                       restart_delay=0.5, exchange_timeout=2.0, timeout=150.0)
  faults = [TimedFault(1.0, "stop", 1, 2.0), TimedFault(1.5, "stop", 1, 1.0),
            TimedFault(4.0, "kill", 2), TimedFault(5.0, "lighthouse", -1),
            TimedFault(8.0, "link", 0, 3.0)]
  out = str(tmp_path / "chaos_runs" / "seed0" / "faulted")
  faulted = runs.FaultTolerantRun(config, out, faults, cpus=0, tag="x", seed=0)
  (run,) = runs.together([faulted], config.timeout)
  assert faults_.processes(out) == {}
  assert not [n for n in netns.namespaces() if n.endswith(f"-{os.getpid()}")]
  for _, _, _, pid in run["events"]:
    assert not os.path.exists(f"/proc/{pid}") or out not in pathlib.Path(
      f"/proc/{pid}/cmdline").read_text()
  kinds = [kind for _, kind, _, _ in run["events"]]
  stops = [(replica, pid) for _, kind, replica, pid in run["events"] if kind == "stop"]
  redrawn = [0, 2][int(np.random.default_rng([0, 1]).integers(2))]
  assert [replica for replica, _ in stops] == [1, redrawn] and kinds.count("cont") == 2
  assert kinds.count("kill") == kinds.count("link") == kinds.count("up") == 1
  assert kinds.count("lighthouse") == 1 and "the Lighthouse exited (status -9); restarting it" in (
    pathlib.Path(out) / "command.log").read_text()
  assert run["status"] == 0 and len(run["final"]) >= 2
  # checkpoints every 200 steps and at the end: the last one is the final state
  assert [point["step"] for point in run["curve"]][:2] == [200, 400]
  assert run["curve"][-1]["test_accuracy"] == run["final"][0]["test_accuracy"]
  got = accounting.accounting(run, span=math.inf)
  assert got["hash_mismatches"] == 0
  assert got["applied"] == {"kill": 1, "stop": 2, "link": 1, "lighthouse": 1, "unapplied": 0}
  committed = [x for x in run["lines"] if x["committed"]]
  # every committed line carries its round's tokens (5 steps x a batch of 16); a healer's none,
  # and a void round's none: a stopped replica whose round the others aborted meanwhile meets
  # them at their next round, its step behind theirs (its line a round past its process's last),
  # as does a restarted one that resumed from a checkpoint the others have gone past (its first
  # line a round past the checkpoint's step)
  def void(x):
    steps = [y["step"] for y in run["lines"] if y["pid"] == x["pid"] and y["time"] < x["time"]]
    start = max([p["step"] for p in run["curve"] if p["step"] < x["step"]], default=0)
    return x["step"] - max(steps, default=start) > 5

  hand = sum(0 if x["healed"] or void(x) else 5 * 16 for x in committed if x["time"] > run["t0"])
  assert got["committed_tokens"] == hand > 0
  restarted = [pid for _, kind, replica, pid in run["events"] if kind == "start" and replica == 2]
  # it healed (in a round that may then abort: replica 0 is cut off from 8 s to 11 s), or
  # resumed from the newest checkpoint (its first round void if the others had gone past it),
  # and committed after
  back_lines = sorted((x for x in run["lines"] if x["pid"] in restarted), key=lambda x: x["time"])
  assert back_lines[0]["healed"] or void(back_lines[0]) or back_lines[0]["weight"] > 0
  assert any(x["pid"] in restarted and x["time"] > back_lines[0]["time"] for x in committed)
  # the stopped replicas', the restarted one's and the cut-off one's, which the others waited
  # for; the restart's split at its ready mark (its session up), after its start
  assert sorted(r["kind"] for r in got["returns"]) == ["kill", "link", "stop", "stop"]
  (back,) = [r for r in got["returns"] if r["kind"] == "kill"]
  assert back["startup"] > 0 and back["heal"] > 0
  assert back["startup"] + back["heal"] == pytest.approx(back["seconds"])
  up = next(at for at, kind, _, _ in run["events"] if kind == "up")
  assert any(x["replica"] == 0 and x["committed"] and x["time"] - run["t0"] > up for x in committed)
  # the archive keeps the raw JSONL files: the lines read back are the run's
  study = {"config": {}, "seeds": {"0": {}}}
  report.write_archive(str(tmp_path / "a.tar.xz"), study, {"0": {"faulted": run}},
                       str(tmp_path / "chaos"))
  assert report.read_archive(str(tmp_path / "a.tar.xz"))[1]["0"]["faulted"]["lines"] == run["lines"]


def test_a_waiting_standby_is_no_replica_until_the_launcher_names_it(tmp_path, monkeypatch):
  """``process_ids`` leaves out a standby (``--wait-for-takeover``) until the launcher's
  ``OUT/replica_<i>.pid`` names it: then it is replica i's process, to fault and to cap."""
  out = str(tmp_path)
  replica = f"python -m optax_dist.cli replica --out {out} --replica-id"
  procs = {10: f"{replica} 0", 11: f"{replica} 0 --wait-for-takeover",
           12: f"{replica} 1 --wait-for-takeover", 13: f"{replica} 1"}
  monkeypatch.setattr(faults_, "processes", lambda o: procs if o == out else {})
  (tmp_path / "replica_1.pid").write_text("13\n")
  assert faults_.process_ids(out, "--replica-id") == {0: 10, 1: 13}
  assert faults_.process_ids(out, "--replica-id", standbys=True) == {0: 11, 1: 12}
  del procs[10]  # replica 0 killed; its standby takes over
  (tmp_path / "replica_0.pid").write_text("11\n")
  assert faults_.process_ids(out, "--replica-id") == {0: 11, 1: 13}
  assert faults_.process_ids(out, "--replica-id", standbys=True) == {1: 12}


@pytest.mark.slow
def test_the_synchronous_arm_restarts_from_its_checkpoint_and_leaves_no_process(tmp_path):
  """2 processes checkpointing every 20 steps of 200; process 1 killed 1 s after the first
  checkpoint (about 30 steps in): the command ends, is started again with --resume, and its
  checkpoints go on past the ones saved before the kill, until it ends with its last step.
  No horizon: how long a restart takes depends on the machine's load."""
  config = runs.Config(replicas=2, task="digits", steps=200, restart_delay=0.5, timeout=300.0,
                       sync_checkpoint_every=20)
  out = str(tmp_path / "sync")
  sync = runs.SyncRun(config, out, [TimedFault(1.0, "kill", 1)], cpus=0, tag="",
                      horizon=math.inf)
  (run,) = runs.together([sync], config.timeout)
  assert run["status"] == 0
  assert faults_.processes(out) == {}
  kinds = [kind for _, kind, _, _ in run["events"]]
  assert kinds.count("kill") == 1 and kinds.count("exit") == kinds.count("resume") >= 1
  kill = next(at for at, kind, _, _ in run["events"] if kind == "kill")
  before = [step for t, step in run["saved"] if t - run["t0"] <= kill]
  after = [step for t, step in run["saved"] if t - run["t0"] > kill]
  assert after and after[0] > before[-1]
  result = json.loads((tmp_path / "sync" / "results_sync.json").read_text())
  assert result["algorithms"]["sync"]["resumed_from_step"] >= before[-1]  # not started over
  starts = [pid for _, kind, i, pid in run["events"] if kind == "start" and i == 1]
  assert len(set(starts)) >= 2  # process 1 ran again
  # its return: from the resume to the first checkpoint after it
  (back,) = accounting.sync_accounting(run, math.inf, 1.0)["returns"]
  resume = next(at for at, kind, _, _ in run["events"] if kind == "resume")
  assert back["seconds"] == pytest.approx(min(
    t - run["t0"] for t, _ in run["saved"] if t - run["t0"] > resume) - resume)
