"""The chaos study (``benchmarks/studies/chaos.py``): its fault schedule, its accounting on
hand-written replica logs, its per-replica CPU caps (cgroups, as root), and one small faulted
run of ``optax-dist train --fault-tolerant`` (3 replicas, a scripted ``SIGSTOP`` and ``kill -9``)
whose numbers are checked against a count of its own logs, with every process of the run gone
afterwards.

The run needs the ``ft`` extra; with ``OPTAX_DIST_REQUIRE_FT=1`` (``make test``) a missing
extra fails it instead of skipping it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

pytest.importorskip("matplotlib")

from benchmarks.network import netns  # noqa: E402
from benchmarks.studies import chaos  # noqa: E402


def test_schedule_is_fixed_by_its_seed_and_extends_with_the_horizon():
  a = chaos.schedule(3, 0.1, 300.0, 4)
  assert a == chaos.schedule(3, 0.1, 300.0, 4)
  assert a != chaos.schedule(4, 0.1, 300.0, 4)
  assert chaos.schedule(3, 0.1, 600.0, 4)[:len(a)] == a


def test_schedule_draws_a_poisson_process_of_its_rate():
  rate, horizon = 0.1, 100_000.0
  faults = chaos.schedule(0, rate, horizon, 4, (3.0, 10.0), (5.0, 15.0))
  expected = rate * horizon  # 10,000 faults; a Poisson count's standard deviation is 100
  assert abs(len(faults) - expected) < 4 * math.sqrt(expected)
  assert all(0 < f.at < horizon for f in faults)
  assert [f.at for f in faults] == sorted(f.at for f in faults)
  for kind in chaos.KINDS:  # binomial(n, 1/3): standard deviation sqrt(n * 2/9)
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
    chaos.schedule(**args)


def line(round, replica, time, committed=True, weight=10, tokens=10, healed=False, pid=None,
         state_hash="h", quorum_seconds=0.01, attempts=1):
  return {"attempts": attempts, "round": round, "replica": replica, "time": time,
          "committed": committed, "step": 10 * (round + 1),
          "weight": weight, "tokens": tokens, "healed": healed, "pid": pid or 100 + replica,
          "state_hash": f"{state_hash}{round}", "quorum_seconds": quorum_seconds}


def faulted_run():
  """Two replicas from t0 = 100 s: replica 1 is killed at 1.5 s, replica 0 aborts round 2
  alone, replica 1 restarts at 2.5 s (pid 201) and heals in round 3 (weight 0); round 4 commits
  after a retried exchange."""
  lines = [line(0, 0, 100.0), line(0, 1, 100.0), line(1, 0, 101.0), line(1, 1, 101.0),
           line(2, 0, 102.0, committed=False),
           line(3, 0, 103.0), line(3, 1, 103.0, weight=0, healed=True, pid=201,
                                   quorum_seconds=0.2),
           line(4, 0, 104.0, attempts=2), line(4, 1, 104.0, pid=201, attempts=2)]
  events = [[0.0, "start", 0, 100], [0.0, "start", 1, 101], [1.5, "kill", 1, 101],
            [2.5, "start", 1, 201]]
  return {"t0": 100.0, "lines": lines, "events": events}


def control_run():
  return {"t0": 50.0, "events": [],
          "lines": [line(r, i, 50.0 + r) for r in range(6) for i in range(2)]}


def test_accounting_of_a_hand_written_log():
  got = chaos.accounting(faulted_run(), span=4.0)
  # rounds 1, 3, 4 after the first commit: 10 + 10, 10 + 0 (the healer), 10 + 10
  assert got["committed_tokens"] == 50
  assert chaos.accounting(faulted_run(), span=3.5)["committed_tokens"] == 30
  assert got["useful_work"] == pytest.approx(70 / 90)  # round 0's 20 counted; 9 lines of 10
  assert (got["rounds_committed"], got["rounds_aborted"], got["abort_lines"]) == (4, 1, 1)
  assert got["rounds_retried"] == 1
  assert got["longest_stall_s"] == pytest.approx(2.0)  # round 1 at 1 s, round 3 at 3 s
  assert got["heal_s"] == [pytest.approx(0.5)]  # restarted at 2.5 s, first commit at 3 s
  assert got["first_quorum_s"] == [0.2]
  assert got["heal_rounds"] == [0]  # healed and committed in round 3, its first
  assert got["full_round_s"] == pytest.approx(1.0)  # rounds 1, 3 and 4 (2 aborted, 3 after it)
  assert got["hash_mismatches"] == 0
  assert got["timeline"][-1] == [pytest.approx(4.0), 50.0]
  assert (got["heals"], got["unprovoked_heals"]) == (1, 0)  # killed 1.5 s before its heal


def test_goodput_against_the_control():
  result = chaos.compare(control_run(), faulted_run())
  assert result["span_s"] == 4.0  # the faulted run's; the control ran 5 s
  assert result["control"]["committed_tokens"] == 80  # rounds 1 to 4, two replicas, 10 each
  assert result["goodput"] == pytest.approx(50 / 80)


def test_the_validation_curve_and_the_metric_at_equal_committed_tokens():
  run = faulted_run()
  run["curve"] = [{"step": 20, "rounds": 2, "time": 101.0, "test_x": 2.0},
                  {"step": 50, "rounds": 4, "time": 104.0, "test_x": 1.5}]
  # up to step 20: rounds 0 and 1 (40 tokens); up to 50: and round 3 (10, the healer 0) and 4
  faulted = chaos.validation_curve(run)
  assert faulted == [[1.0, 40, 2.0], [4.0, 70, 1.5]]
  control = [[1.0, 40, 2.2], [3.0, 80, 1.6]]
  at = chaos.equal_tokens(control, faulted)
  # the control at 70 tokens: 2.2 + (70 - 40) / (80 - 40) * (1.6 - 2.2) = 1.75
  assert at == {"tokens": 70, "faulted": 1.5, "control": pytest.approx(1.75),
                "gap": pytest.approx(1.5 / 1.75 - 1)}
  assert chaos.equal_tokens([], faulted) is None


def test_a_heal_with_no_fault_of_its_own_within_20_s_is_unprovoked():
  run = faulted_run()
  run["events"].append([18.0, "lighthouse", -1, 7])  # a Lighthouse kill touches every replica
  run["lines"] += [line(5, 0, 125.0, weight=0, healed=True),  # 7 s after it
                   line(6, 1, 138.0, weight=0, healed=True),  # 20 s after it: the window's end
                   line(7, 1, 138.5, weight=0, healed=True)]  # 20.5 s
  got = chaos.accounting(run, span=40.0)
  assert (got["heals"], got["unprovoked_heals"]) == (4, 1)


def test_heal_from_a_sigcont_and_a_hash_mismatch():
  run = faulted_run()
  run["events"] += [[3.2, "stop", 0, 100], [3.6, "cont", 0, 100]]
  run["lines"][-1] = line(4, 1, 104.0, pid=201, state_hash="other")
  got = chaos.accounting(run, span=4.0)
  assert got["heal_s"] == [pytest.approx(0.5), pytest.approx(0.4)]
  assert got["hash_mismatches"] == 1


def test_sync_accounting_counts_checkpointed_steps():
  """Checkpoints at 0, 10, 25 and 40 s after t0 = 100 s (steps 100 to 400), the command exiting
  at 12 s and 50 s: over 30 s, 200 steps are durable and one restart falls in the span."""
  run = {"t0": 100.0, "saved": [[100.0, 100], [110.0, 200], [125.0, 300], [140.0, 400]],
         "events": [[0.0, "start", 0, 7], [12.0, "exit", -1, 1], [50.0, "exit", -1, 1]]}
  got = chaos.sync_accounting(run, span=30.0, tokens_per_step=64.0)
  assert got["committed_tokens"] == 200 * 64
  assert got["restarts"] == 1
  assert got["longest_stall_s"] == pytest.approx(15.0)  # from 10 s to 25 s
  assert got["timeline"] == [[0.0, 0.0], [10.0, 6400.0], [25.0, 12800.0]]


def test_records_are_saved_and_read_back_with_reuse_and_the_same_settings(tmp_path):
  calls = []

  def run(outs):
    for out in outs:  # as a run does
      os.makedirs(out, exist_ok=True)
    calls.append(outs)
    return [{"n": len(calls), "out": os.path.basename(out)} for out in outs]

  prefix, pair = str(tmp_path / "chaos"), ("control", "faulted")
  first = chaos._records(chaos.Config(), prefix, pair, run)
  assert first == [{"n": 1, "out": "control"}, {"n": 1, "out": "faulted"}]
  assert chaos._records(chaos.Config(timeout=5.0, reuse=True), prefix, pair, run) == first
  assert chaos._records(chaos.Config(steps=40, reuse=True), prefix, pair, run)[1]["n"] == 2
  # a setting of the faulted run only: the pair runs again, as it runs together
  again = chaos.Config(steps=40, reuse=True, lighthouse_kill=9.0)
  assert chaos._records(again, prefix, pair, run)[0]["n"] == 3
  # the Lighthouse is killed in the faulted run only: the synchronous pair's records stay valid
  sync = ("sync_control", "sync_faulted")
  assert chaos._records(chaos.Config(steps=40), prefix, sync, run)[0]["n"] == 4
  assert chaos._records(again, prefix, sync, run)[1]["n"] == 4
  assert chaos._records(chaos.Config(steps=40), prefix, pair, run)[0]["n"] == 5  # no --reuse
  assert len(calls) == 5


def test_measure_says_it_needs_root_and_runs_nothing(monkeypatch, capsys, tmp_path):
  monkeypatch.setattr(chaos.os, "geteuid", lambda: 1000)
  assert chaos.measure(chaos.Config(), str(tmp_path / "chaos")) is None
  assert "needs root" in capsys.readouterr().err
  assert list(tmp_path.iterdir()) == []


class FakeRun:
  """A run of :func:`chaos.together` that goes on for ``ticks`` looks."""

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
  assert chaos.together([short, long], timeout=60.0) == [
    {"endings": [False, False]}, {"endings": [False, False, True, True]}]
  assert short.left and long.left
  endless = FakeRun(10**9)
  with pytest.raises(TimeoutError, match="fake1000000000"):
    chaos.together([FakeRun(1), endless], timeout=0.3)
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


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups)")
def test_cpu_shares_cap_each_replica_and_leave_no_group():
  """Replica 1's group allows 1 ms of CPU in each 100 ms (0.04 CPUs over 4 replicas: little
  enough that a loaded machine still lets the process reach it): a busy process moved there is
  throttled; on exit the groups are gone and the process, moved back, still runs."""
  assert chaos.CpuShares(4, 0).groups == []  # no caps
  busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
  try:
    with chaos.CpuShares(4, 0.04) as shares:
      group = shares.groups[1]
      quota = (group / ("cpu.max" if shares.v2 else "cpu.cfs_quota_us")).read_text()
      assert quota.split()[0] == "1000"
      shares.add(1, busy.pid)
      assert group.name in pathlib.Path(f"/proc/{busy.pid}/cgroup").read_text()
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
  config = chaos.Config(replicas=3, min_replicas=3, task="digits", steps=500, sync_period=5,
                        restart_delay=0.5, exchange_timeout=2.0, timeout=150.0, standby=False)
  faults = [chaos.TimedFault(1.0, "stop", 1, 2.0), chaos.TimedFault(4.0, "kill", 2),
            chaos.TimedFault(5.0, "lighthouse", -1), chaos.TimedFault(8.0, "link", 0, 3.0)]
  out = str(tmp_path / "run")
  faulted = chaos.FaultTolerantRun(config, out, faults, cpus=0, tag="x")
  (run,) = chaos.together([faulted], config.timeout)
  assert chaos.processes(out) == {}
  assert not [n for n in netns.namespaces() if n.endswith(f"-{os.getpid()}")]
  for _, _, _, pid in run["events"]:
    assert not os.path.exists(f"/proc/{pid}") or out not in pathlib.Path(
      f"/proc/{pid}/cmdline").read_text()
  kinds = [kind for _, kind, _, _ in run["events"]]
  assert kinds.count("stop") == kinds.count("cont") == kinds.count("kill") == 1
  assert kinds.count("link") == kinds.count("up") == 1
  assert kinds.count("lighthouse") == 1 and "the Lighthouse exited (status -9); restarting it" in (
    tmp_path / "run" / "command.log").read_text()
  assert run["status"] == 0 and len(run["final"]) >= 2
  # checkpoints every 200 steps and at the end: the last one is the final state
  assert [point["step"] for point in run["curve"]][:2] == [200, 400]
  assert run["curve"][-1]["test_accuracy"] == run["final"][0]["test_accuracy"]
  got = chaos.accounting(run, span=math.inf)
  assert got["hash_mismatches"] == 0
  committed = [x for x in run["lines"] if x["committed"]]
  # every committed line carries its round's tokens (5 steps x a batch of 16), a healer's none
  hand = sum(0 if x["healed"] else 5 * 16 for x in committed if x["time"] > run["t0"])
  assert got["committed_tokens"] == hand > 0
  restarted = [pid for _, kind, replica, pid in run["events"] if kind == "start" and replica == 2]
  # it healed (in a round that may then abort: replica 0 is cut off from 8 s to 11 s) and
  # committed after
  healed = [x["time"] for x in run["lines"] if x["healed"] and x["pid"] in restarted]
  assert healed and any(x["pid"] in restarted and x["time"] >= healed[0] for x in committed)
  # the stopped replica's, the restarted one's and the cut-off one's, which the others waited for
  assert len(got["heal_s"]) == 3
  up = next(at for at, kind, _, _ in run["events"] if kind == "up")
  assert any(x["replica"] == 0 and x["committed"] and x["time"] - run["t0"] > up for x in committed)


def test_a_waiting_standby_is_no_replica_until_the_launcher_names_it(tmp_path, monkeypatch):
  """``process_ids`` leaves out a standby (``--wait-for-takeover``) until the launcher's
  ``OUT/replica_<i>.pid`` names it: then it is replica i's process, to fault and to cap."""
  out = str(tmp_path)
  replica = f"python -m optax_dist.cli replica --out {out} --replica-id"
  procs = {10: f"{replica} 0", 11: f"{replica} 0 --wait-for-takeover",
           12: f"{replica} 1 --wait-for-takeover", 13: f"{replica} 1"}
  monkeypatch.setattr(chaos, "processes", lambda o: procs if o == out else {})
  (tmp_path / "replica_1.pid").write_text("13\n")
  assert chaos.process_ids(out, "--replica-id") == {0: 10, 1: 13}
  del procs[10]  # replica 0 killed; its standby takes over
  (tmp_path / "replica_0.pid").write_text("11\n")
  assert chaos.process_ids(out, "--replica-id") == {0: 11, 1: 13}


@pytest.mark.slow
def test_the_synchronous_arm_restarts_from_its_checkpoint_and_leaves_no_process(tmp_path):
  """2 processes checkpointing every 20 steps of 200; process 1 killed 1 s after the first
  checkpoint (about 30 steps in): the command ends, is started again with --resume, and its
  checkpoints go on past the ones saved before the kill, until it ends with its last step.
  No horizon: how long a restart takes depends on the machine's load."""
  config = chaos.Config(replicas=2, task="digits", steps=200, restart_delay=0.5, timeout=300.0,
                        sync_checkpoint_every=20)
  out = str(tmp_path / "sync")
  sync = chaos.SyncRun(config, out, [chaos.TimedFault(1.0, "kill", 1)], cpus=0, tag="",
                       horizon=math.inf)
  (run,) = chaos.together([sync], config.timeout)
  assert run["status"] == 0
  assert chaos.processes(out) == {}
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
