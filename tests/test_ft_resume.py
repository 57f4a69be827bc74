"""``optax-dist train --fault-tolerant --resume``: a run whose launcher was killed (and its
replicas with it) goes on from its checkpoints and ends as the uninterrupted run, bit for bit;
a new run refuses an ``--out`` that holds a run's checkpoints, and ``--resume`` refuses other
settings.

The end-to-end run needs the ``ft`` extra; with ``OPTAX_DIST_REQUIRE_FT=1`` (``make test``) a
missing extra fails it instead of skipping it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("flax")
pytest.importorskip("sklearn")

from _helpers import alive, one_line_error, require_ft

from optax_dist.cli import ft_task, ft_train
from optax_dist.cli.main import build_parser
from optax_dist.cli.tasks import TASKS
from optax_dist.fault_tolerance import checkpoints
from optax_dist.fault_tolerance.rundir import RunDir

ROOT = pathlib.Path(__file__).resolve().parent.parent
EVERY = 150
"""--checkpoint-every: 30 rounds of 5 steps between checkpoints (rounds take tens of ms): the
kill lands between two of them."""
RUN = ["train", "--algorithm", "diloco", "--fault-tolerant", "--replicas", "2", "--devices", "1",
       "--steps", "600", "--sync-period", "5", "--checkpoint-every", str(EVERY), "--comm-dtype",
       "int8", "--error-feedback", "--no-progress"]
"""Adam's moments and the error-feedback residual are each replica's own: a replica restored
without its local state (as a joiner heals) would end elsewhere."""


def _saved(out: pathlib.Path, fingerprint: int) -> None:
  """A finished checkpoint's JSON under ``out`` (its payload is not read before the launch)."""
  folder = RunDir(out).checkpoint_dir
  folder.mkdir(parents=True)
  (folder / "step_150.json").write_text(json.dumps(
    {"step": 150, "rounds": 30, "time": 0.0, "fingerprint": fingerprint, "members": [0, 1]}))


def test_a_new_run_refuses_an_out_with_checkpoints_and_resume_refuses_other_settings(
    tmp_path, capsys):
  require_ft()
  out = str(tmp_path)
  line = one_line_error(capsys, *RUN, "--resume", "--out", out)
  assert line == (f"optax-dist: error: argument --resume: no fault-tolerant checkpoint under"
                  f" {tmp_path}/replicas/checkpoints to continue from")
  _saved(tmp_path, 123)
  line = one_line_error(capsys, *RUN, "--out", out)
  assert line == (f"optax-dist: error: argument --out: {tmp_path}/replicas/checkpoints holds a"
                  " fault-tolerant run's checkpoints; continue that run with --resume, or give"
                  " another --out (or remove that directory)")
  line = one_line_error(capsys, *RUN, "--resume", "--out", out)
  assert line.startswith(
    f"optax-dist: error: argument --resume: {tmp_path}/replicas/checkpoints/step_150.heal was"
    " written with other settings (fingerprint 123, these settings' "), line
  assert (tmp_path / "replicas/checkpoints/step_150.json").exists()
  assert not list(tmp_path.glob("replica_*.log"))  # refused before any process started


def test_resume_keeps_the_lines_and_checkpoints_of_its_own_settings(tmp_path, monkeypatch):
  """``--resume`` with the checkpoint's fingerprint (:func:`ft_task.fingerprint`, which a
  replica's own params give too) keeps the lines and checkpoints and clears the start marks,
  pids and evaluations; another fingerprint is refused."""
  args = build_parser().parse_args([*RUN, "--resume", "--out", str(tmp_path)])
  task = TASKS[args.task]
  data = task.load(args.seed)
  s = ft_task.settings(args, task, lambda: data)
  mine = ft_task.fingerprint(task, data, s, args.replicas)
  params, _, _, tokens, _ = ft_task.task_engine(task, data, s, args.replicas)
  from optax_dist.fault_tolerance.decision import settings_fingerprint

  assert mine == settings_fingerprint(ft_task.protocol(s), params, seed=s.seed,
                                      tokens_per_step=tokens)
  _saved(tmp_path, mine)
  run = RunDir(tmp_path)
  for path in (run.lines_file(0), run.ready_file(0), run.final_file(0), run.pid_file(0)):
    path.write_text("{}\n")
  ft_train._take_out(args, run, lambda: mine)
  assert run.lines_file(0).exists() and run.checkpoints()
  assert not any(p.exists() for p in (run.ready_file(0), run.final_file(0), run.pid_file(0)))
  with pytest.raises(ft_train.CommandError, match="written with other settings"):
    ft_train._take_out(args, run, lambda: mine + 1)


# ------------------------------------------------------------------------------------------------
# End to end: run B killed (its launcher, SIGKILL) between two checkpoints, then resumed in the
# same --out; run A, uninterrupted, on the in-process engine (the processes' rounds are its
# rounds bit for bit: tests/test_ft_replica_groups.py, tests/test_fault_tolerant_train.py).


def _env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFT_")}
  env["PYTHONPATH"] = str(ROOT)
  return env


def _command(out: pathlib.Path, *extra: str) -> list[str]:
  return [sys.executable, "-m", "optax_dist.cli", *RUN, "--out", str(out), *extra]


def _past_a_checkpoint(run: RunDir) -> bool:
  """Whether both replicas committed a round past a checkpoint that both wrote."""
  start = checkpoints.resume_point(run.checkpoint_dir)
  return start is not None and all(
    any(x["committed"] and x["step"] > start["step"] for x in run.lines(i)) for i in (0, 1))


def _kill_between_checkpoints(out: pathlib.Path) -> dict:
  """Starts run B, SIGKILLs its launcher once both replicas are past a checkpoint, and waits
  for its replicas and Lighthouse to die with it; returns what its files said then."""
  run = RunDir(out)
  proc = subprocess.Popen(_command(out), env=_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  pids = []
  try:
    deadline = time.monotonic() + 300
    while not _past_a_checkpoint(run):
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
      time.sleep(0.01)
    pids = [run.replica_pid(0), run.replica_pid(1), run.lighthouse_pid()]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
      time.sleep(0.05)
    survivors = [pid for pid in pids if alive(pid)]
  finally:
    for pid in pids:  # the run's processes, should one have outlived the launcher
      if pid is not None and alive(pid):
        os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  return {"survivors": survivors, "lines": {i: run.lines(i) for i in (0, 1)},
          "start": checkpoints.resume_point(run.checkpoint_dir)}


def _uninterrupted(out: pathlib.Path) -> argparse.Namespace:
  """Run A: the command's replica loop (:func:`~optax_dist.fault_tolerance.replica.task_loop`)
  with ``RUN``'s settings on the in-process engine, no fault; its round lines and the final
  records ``optax-dist replica`` would write."""
  from optax_dist.cli import ft_flags
  from optax_dist.cli.ft_replica import final_record
  from optax_dist.fault_tolerance import engine
  from optax_dist.fault_tolerance.replica import task_loop

  args = build_parser().parse_args([*RUN, "--out", str(out)])
  ft_flags.resolve(args)
  task = TASKS[args.task]
  data = task.load(args.seed)
  s = ft_task.settings(args, task, lambda: data)
  params, loss_and_grad, batch_fn, tokens, evaluate = ft_task.task_engine(task, data, s, 2)
  protocol = ft_task.protocol(s)
  run = engine("in_process", protocol, num_replicas=2, seed=s.seed, tokens_per_step=tokens)
  finals = run.run(task_loop(protocol, params, loss_and_grad, batch_fn,
                             rounds=s.steps // s.sync_period))
  return argparse.Namespace(
    final={i: final_record(i, state, task, evaluate) for i, state in finals.items()},
    lines={i: [line for line in run.log if line.replica == i] for i in (0, 1)})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Run B (killed, then resumed) and run A (uninterrupted, in this process meanwhile)."""
  require_ft()
  a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
  started = time.monotonic()
  killed = _kill_between_checkpoints(b)
  resumed = subprocess.Popen(_command(b, "--resume"), env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    uninterrupted = _uninterrupted(a)
    stdout, stderr = resumed.communicate(timeout=300)
  finally:
    if resumed.poll() is None:
      os.killpg(resumed.pid, signal.SIGKILL)
      resumed.wait()
  assert resumed.returncode == 0, stderr[-3000:]
  return argparse.Namespace(a=uninterrupted, b=RunDir(b), killed=killed, stdout=stdout,
                            seconds=time.monotonic() - started)


@pytest.mark.slow
def test_the_launchers_kill_takes_its_replicas_and_lighthouse(runs):
  assert runs.killed["survivors"] == []


@pytest.mark.slow
def test_a_resumed_run_ends_as_the_uninterrupted_one_bit_for_bit(runs):
  final_a, final_b = runs.a.final, runs.b.final()
  assert sorted(final_a) == sorted(final_b) == [0, 1]
  # each replica's whole state (params, adam's moments, the residual, the global state)
  for i in (0, 1):
    assert final_b[i] == final_a[i]
  assert final_a[0]["replica_hash"] != final_a[1]["replica_hash"]  # their local states differ
  last = {i: runs.a.lines[i][-1].state_hash for i in (0, 1)}
  assert last[0] == last[1] == runs.b.lines(0)[-1]["state_hash"] == runs.b.lines(1)[-1][
    "state_hash"]
  assert "the state hashes agree on every committed round" in runs.stdout


@pytest.mark.slow
def test_a_resumed_run_appends_its_lines_from_the_checkpoints_round(runs):
  """The kill landed between two checkpoints (rounds past the resume point were lost); the
  lines written before it are kept, and the resumed replicas' lines go on from the round after
  the checkpoint's, committed by both, with no heal; from there on they are run A's."""
  start = runs.killed["start"]
  for i in (0, 1):
    before, lines = runs.killed["lines"][i], runs.b.lines(i)
    assert max(x["step"] for x in before) > start["step"]
    assert lines[:len(before)] == before
    after = lines[len(before):]
    assert {x["pid"] for x in after}.isdisjoint({x["pid"] for x in before})
    assert after[0]["round"] == start["rounds"] and after[0]["step"] == start["step"] + 5
    assert all(x["committed"] and not x["healed"] for x in after)
    hashes_a = {x.round: x.state_hash for x in runs.a.lines[i]}
    assert all(hashes_a[x["round"]] == x["state_hash"] for x in lines)
  print(f"\nrun B (killed, resumed) and run A: {runs.seconds:.1f} s")
