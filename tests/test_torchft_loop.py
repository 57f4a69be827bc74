"""The user-loop examples over torchft: the Flax Linen `TrainState` example run as 2 processes
on 127.0.0.1 against a Lighthouse, a `kill -9` of replica 1 and its restart under the same id
(it heals at its first quorum); every committed round's state hash is equal on every replica
that committed it. The NNX example's loop in decoupled rounds (K = 1), its BatchNorm statistics
merged with the params: one hash per round on both replicas, and the in-process engine's replay
of the run's lines gives the same hashes.

Needs the ``ft`` extra; with ``OPTAX_DIST_REQUIRE_FT=1`` (``make test``) a missing extra fails
the run instead of skipping it.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from _helpers import kill_groups, require_ft

require_ft()

from torchft.coordination import LighthouseServer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "linen_fault_tolerant.py"
NNX_EXAMPLE = ROOT / "examples" / "nnx_fault_tolerant.py"
STEPS = 40  # 4 rounds of 10 steps; replica 1 is killed after round 0


def _lines(out: pathlib.Path, i: int) -> list[dict]:
  path = out / "replicas" / f"replica_{i}.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _env(lighthouse, out: pathlib.Path, steps: int) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFT_")}
  env.update(PYTHONPATH=str(ROOT), TORCHFT_LIGHTHOUSE=lighthouse.address(), STEPS=str(steps),
             OPTAX_DIST_OUT=str(out))
  return env


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
  """The 2 replicas of a run whose replica 1 is killed after its first round and started
  again: each process's exit status and every replica's log lines."""
  out = tmp_path_factory.mktemp("torchft_engine")
  # min_replicas 2: replica 0 waits in its quorum for the restarted replica, which heals
  lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=200,
                                heartbeat_timeout_ms=2000)
  env, procs = _env(lighthouse, out, STEPS), {}

  def start(i: int, name: str) -> None:
    with open(out / f"{name}.log", "w") as log:
      procs[name] = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "torchft"], env=dict(env, REPLICA_GROUP_ID=str(i)),
        stdout=log, stderr=log, start_new_session=True)

  try:
    for i in range(2):
      start(i, f"replica_{i}")
    deadline = time.monotonic() + 180
    while not _lines(out, 1) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert _lines(out, 1), (out / "replica_1.log").read_text()[-3000:]
    os.kill(procs["replica_1"].pid, signal.SIGKILL)
    procs["replica_1"].wait()
    start(1, "replica_1_restarted")
    status = {name: proc.wait(timeout=300) for name, proc in procs.items()}
    yield status, {i: _lines(out, i) for i in range(2)}, out
  finally:
    kill_groups(procs.values())
    lighthouse.shutdown()


def test_the_example_over_torchft_survives_a_kill_9_with_one_state_per_round(killed_run):
  status, lines, out = killed_run
  logs = {p.name: p.read_text()[-2000:] for p in out.glob("*.log")}
  assert status["replica_1"] == -signal.SIGKILL
  assert {name: s for name, s in status.items() if name != "replica_1"} == {
    "replica_0": 0, "replica_1_restarted": 0}, logs
  by_round: dict = {}
  for i, replica_lines in lines.items():
    for line in replica_lines:
      if line["committed"]:
        by_round.setdefault(line["round"], set()).add(line["state_hash"])
  # a round whose exchange the kill cut aborts on every member; the others commit
  assert max(by_round) == STEPS // 10 - 1 and len(by_round) >= STEPS // 10 - 2, by_round
  assert all(len(hashes) == 1 for hashes in by_round.values()), by_round
  restarted = [line for line in lines[1] if line["pid"] != lines[1][0]["pid"]]
  assert restarted and restarted[0]["healed"] and restarted[0]["weight"] == 0
  assert restarted[-1]["step"] == STEPS and restarted[-1]["committed"]


# The NNX example's own loop and protocol, its engine chosen as a user switches it to decoupled
# rounds (its script's main block not run).
DECOUPLED = dict(decoupled=True, min_quorum=1, grace_window=0.2)
DRIVER = ("import runpy, sys\nfrom optax_dist import fault_tolerance as ft\n"
          "example = runpy.run_path(sys.argv[1])\n"
          "ft.engine('torchft', example['PROTOCOL'], num_replicas=2, **{!r}).run(example['train'])")
DECOUPLED_STEPS = 60  # 6 rounds of 10 steps per replica


@pytest.fixture(scope="module")
def decoupled_run(tmp_path_factory):
  """The 2 replicas' exit statuses and their round and boundary lines."""
  out = tmp_path_factory.mktemp("torchft_decoupled")
  lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=200,
                                heartbeat_timeout_ms=2000)
  env, procs = _env(lighthouse, out, DECOUPLED_STEPS), []
  try:
    for i in range(2):
      with open(out / f"replica_{i}.log", "w") as log:
        procs.append(subprocess.Popen(
          [sys.executable, "-c", DRIVER.format(DECOUPLED), str(NNX_EXAMPLE)],
          env=dict(env, REPLICA_GROUP_ID=str(i)), stdout=log, stderr=log,
          start_new_session=True))
    status = [proc.wait(timeout=300) for proc in procs]
    bounds = [json.loads(x) for i in range(2)
              for x in (out / "replicas" / f"boundaries_{i}.jsonl").read_text().splitlines()]
    yield status, {i: _lines(out, i) for i in range(2)}, bounds, out
  finally:
    kill_groups(procs)
    lighthouse.shutdown()


def test_the_nnx_example_in_decoupled_rounds_commits_one_state_per_round(decoupled_run):
  """Both loops return; each replica wrote every round's line with the same state hash (the
  global state and the merged BatchNorm statistics), and every inner step's tokens are in a
  committed merge or counted lost."""
  from optax_dist.fault_tolerance import decoupled

  status, lines, bounds, out = decoupled_run
  assert status == [0, 0], {p.name: p.read_text()[-2000:] for p in out.glob("*.log")}
  assert lines[0] and len(lines[0]) == len(lines[1])
  for a, b in zip(lines[0], lines[1], strict=True):
    assert (a["round"], a["committed"], a["state_hash"]) == (
      b["round"], b["committed"], b["state_hash"])
  assert all(x["committed"] for x in lines[0])
  counts = decoupled.accounts(lines[0] + bounds)
  assert {i: sum(c.values()) for i, c in counts.items()} == {0: DECOUPLED_STEPS,
                                                             1: DECOUPLED_STEPS}


def test_the_nnx_example_s_torchft_lines_replay_in_process_with_the_same_hashes(decoupled_run,
                                                                              monkeypatch):
  """E3 across engines with model collections: replica 0's round lines and both replicas'
  boundary lines, replayed by the in-process engine on the example's loop, close the same
  rounds with the same payloads and state hashes."""
  import runpy

  from optax_dist import fault_tolerance as ft

  _, lines, bounds, _ = decoupled_run
  monkeypatch.setenv("STEPS", str(DECOUPLED_STEPS))  # the example reads it at its start
  example = runpy.run_path(str(NNX_EXAMPLE))
  options = {k: v for k, v in DECOUPLED.items() if k != "decoupled"}
  replay = ft.engine("in_process", example["PROTOCOL"], num_replicas=2, min_replicas=1,
                     speeds=[1.0, 1.0], replay=lines[0] + bounds, **options)
  replay.run(example["train"])
  got = [x for x in replay.log if hasattr(x, "committed")]
  assert [(x.round, x.state_hash, [list(p) for p in x.payloads]) for x in got] == [
    (x["round"], x["state_hash"], x["payloads"]) for x in lines[0]]
