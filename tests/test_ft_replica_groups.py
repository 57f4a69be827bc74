"""``train --fault-tolerant --processes P``: replicas of P ``jax.distributed`` processes each
(torchft's replica groups). One run of 2 groups x 2 processes on the digits task serves the
end-to-end assertions: a ``kill -9`` of one process of group 1 mid-run has the launcher stop
the group's other process and restart the group as a unit, which heals; every rank of every
group that commits a round holds the same state hash; and the group's rounds before the kill are
those of one-process replicas of the same global batch (2 devices each). Then the refusals.

Needs the ``ft`` extra; with ``OPTAX_DIST_REQUIRE_FT=1`` (``make test``) a missing extra fails
it instead of skipping it.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from _helpers import alive, require_ft

pytest.importorskip("flax")
pytest.importorskip("sklearn")
require_ft()

from optax_dist.cli.main import main  # noqa: E402
from optax_dist.fault_tolerance.rundir import RunDir  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
GROUPS = ["train", "--algorithm", "diloco", "--fault-tolerant", "--replicas", "2",
          "--processes", "2", "--devices", "1", "--steps", "40", "--sync-period", "4"]
"""2 replica groups of 2 processes of 1 device; 10 rounds (min replicas: 2, both groups)."""


def _pids(run: RunDir, i: int, rank: int) -> list[int]:
  """The pids of replica ``i``'s process ``rank`` in the order of its lines."""
  return list(dict.fromkeys(line["pid"] for line in run.lines(i, rank)))


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
  """The run, with rank 1 of group 1 killed once both its ranks wrote a committed round: ``(run,
  status, stdout, stderr, victim's pid, whether rank 0 of its group was alive when the launcher
  started the group again)``."""
  out = tmp_path_factory.mktemp("groups")
  env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFT_")}
  env["PYTHONPATH"] = str(ROOT)
  proc = subprocess.Popen(
    [sys.executable, "-m", "optax_dist.cli", *GROUPS, "--restart-delay", "0.2", "--no-progress",
     "--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    start_new_session=True)
  run = RunDir(out)
  try:
    deadline = time.monotonic() + 180
    while not all(any(x["committed"] for x in run.lines(1, rank)) for rank in (0, 1)):
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
      time.sleep(0.02)
    victim, survivor = run.lines(1, rank=1)[-1]["pid"], run.replica_pid(1, rank=0)
    os.kill(victim, signal.SIGKILL)
    while run.replica_pid(1, rank=0) == survivor:  # the new group's rank 0
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
      time.sleep(0.01)
    survived = alive(survivor)
    stdout, stderr = proc.communicate(timeout=240)
  finally:
    if proc.poll() is None:  # the replicas die with the launcher (their parent-death signal)
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  return run, proc.returncode, stdout, stderr, victim, survived


@pytest.mark.slow
def test_a_killed_process_restarts_its_group_as_a_unit_which_heals(killed):
  run, status, stdout, stderr, victim, survived = killed
  assert status == 0, stderr[-3000:]
  assert "1 restart," in stdout and "the state hashes agree on every committed round" in stdout
  assert not survived  # stopped by the launcher, not left to JAX's abort (10 s later)
  assert "replica 1's process 1 exited (status -9); its group's other processes stopped" in stderr
  assert _pids(run, 1, 1)[0] == victim and len(_pids(run, 1, 1)) == 2
  assert len(_pids(run, 1, 0)) == 2 and len(_pids(run, 0, 0)) == len(_pids(run, 0, 1)) == 1
  for rank in (0, 1):  # both ranks of the new group heal in its first round, which commits
    first = next(x for x in run.lines(1, rank) if x["pid"] == _pids(run, 1, rank)[1])
    assert first["healed"] and first["committed"] and first["weight"] == 0, first
  assert sorted(run.final()) == [0, 1]


@pytest.mark.slow
def test_every_committing_rank_of_every_group_holds_one_state_per_round(killed):
  run = killed[0]
  by_round: dict[int, set] = {}
  for i in (0, 1):
    for rank in (0, 1):
      for line in run.lines(i, rank):
        if line["committed"]:
          by_round.setdefault(line["round"], set()).add((line["state_hash"], line["step"]))
  assert len(by_round) == 10 and all(len(s) == 1 for s in by_round.values()), by_round


@pytest.mark.slow
def test_a_group_s_first_round_is_that_of_one_process_replicas_of_its_global_batch(killed):
  """Bit for bit: the group's jitted step over its 2 processes' devices (gloo between them)
  and a one-process replica's over 2 devices of its own (the in-process engine) average the
  same two halves of the replica's batch."""
  import jax

  from optax_dist.cli import ft_flags, ft_task
  from optax_dist.cli.main import build_parser
  from optax_dist.cli.tasks import TASKS
  from optax_dist.fault_tolerance.in_process import InProcess

  single = [*GROUPS[:GROUPS.index("--processes")], "--devices", "2", *GROUPS[-4:]]
  args = build_parser().parse_args([*single, "--out", str(killed[0].out)])
  ft_flags.resolve(args)
  task = TASKS["digits"]
  data = task.load(0)
  s = ft_task.settings(args, task, lambda: data)
  params, loss_and_grad, batch_fn, tokens, _ = ft_task.task_engine(task, data, s, 2)
  protocol, grads = ft_task.protocol(s), jax.jit(lambda p, b: loss_and_grad(p, b)[1])
  engine = InProcess(protocol, num_replicas=2, tokens_per_step=tokens)

  def train(replica):
    state = replica.start((params, protocol.tx.init(params)))
    while replica.rounds < 1:
      batch = batch_fn(0, replica.slot, replica.step)
      state = replica.after_step(protocol.inner_step(*state, grads(state[0], batch)))

  engine.run(train)
  [want] = {line.state_hash for line in engine.log}
  assert {x["state_hash"] for i in (0, 1) for r in (0, 1) for x in killed[0].lines(i, r)
          if x["round"] == 0} == {want}


@pytest.mark.parametrize("args, said", [
  (GROUPS + ["--fsdp", "1"], "argument --fsdp: not with --fault-tolerant --processes 2, got"
   " --fsdp 1; a replica's processes each exchange its whole payload"),
  (GROUPS + ["--process-id", "0", "--coordinator", "127.0.0.1:1"], "argument --process-id: not"
   " with --fault-tolerant, whose launcher starts each replica's --processes P processes"),
  (GROUPS + ["--standby"], "argument --standby: `LaunchConfig(standby=...)` must be off with"
   " processes > 1 (replica groups), got True: a standby group is not built."),
  (["replica", "--lighthouse", "http://127.0.0.1:1", "--replica-id", "0", "--processes", "2"],
   "argument --process-id: needed with --processes 2 (this process's rank in its replica"
   " group)"),
])
def test_refusals_are_one_line(args, said, tmp_path, capsys):
  capsys.readouterr()
  assert main([*args, "--out", str(tmp_path)]) == 2
  stdout, stderr = capsys.readouterr()
  assert stdout == "" and len(stderr.strip().splitlines()) == 1 and said in stderr, stderr
  assert not list(tmp_path.glob("replica_*.log"))


def test_summary_reads_every_rank_s_hashes_and_rank_0_s_heals(tmp_path):
  import json

  run = RunDir(tmp_path)
  run.replicas.mkdir(parents=True)
  line = {"round": 0, "committed": True, "healed": True, "quorum_seconds": 0.5, "time": 1.0}
  for i, rank, digest in ((0, 0, "a"), (0, 1, "a"), (1, 0, "a"), (1, 1, "b")):
    run.lines_file(i, rank).write_text(json.dumps({**line, "state_hash": digest}) + "\n")
  assert run.lines_file(1, 1).name == "replica_1.rank_1.jsonl"
  assert [x["state_hash"] for x in run.lines()] == ["a", "a"]  # every replica's rank 0
  assert run.summary(2, restarts=0)["hashes_agree"]  # one process per replica: rank 0's only
  summary = run.summary(2, restarts=0, processes=2)
  assert not summary["hashes_agree"] and summary["heals"] == 2
