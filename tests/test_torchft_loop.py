"""The user-loop example over torchft: the Flax Linen `TrainState` example run as 2 processes
on 127.0.0.1 against a Lighthouse, a `kill -9` of replica 1 and its restart under the same id
(it heals at its first quorum); every committed round's state hash is equal on every replica
that committed it.

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
STEPS = 40  # 4 rounds of 10 steps; replica 1 is killed after round 0


def _lines(out: pathlib.Path, i: int) -> list[dict]:
  path = out / "replicas" / f"replica_{i}.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
  """The 2 replicas of a run whose replica 1 is killed after its first round and started
  again: each process's exit status and every replica's log lines."""
  out = tmp_path_factory.mktemp("torchft_engine")
  # min_replicas 2: replica 0 waits in its quorum for the restarted replica, which heals
  lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=200,
                                heartbeat_timeout_ms=2000)
  env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFT_")}
  env.update(PYTHONPATH=str(ROOT), TORCHFT_LIGHTHOUSE=lighthouse.address(), STEPS=str(STEPS),
             OPTAX_DIST_OUT=str(out))
  procs: dict = {}

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
