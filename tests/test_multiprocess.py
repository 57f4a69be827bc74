"""``optax-dist`` over several ``jax.distributed`` processes: same params, faults, exact resume.

Every run over several processes is a command in subprocesses, as a user would run it; the
one-process references run in the test's process, as do the arguments refused before any process
starts. The independent runs start together (module fixture) so that they overlap on a multi-core
machine.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")
pytest.importorskip("orbax.checkpoint")

from optax_dist.cli.main import main  # noqa: E402

STEPS, PERIOD, FAIL_AT, CHECKPOINT_EVERY = 20, 5, 10, 4
ARGS = ["--steps", str(STEPS), "--communication-period", str(PERIOD), "--seed", "1",
        "--no-progress"]
MULTI = ["--processes", "2", "--devices", "2"]
# The killed and resized runs: elastic_average (``fault``, resumed on 2 processes and on 1) and
# diloco (``grow``, resumed on 2).
EASGD = ["train", "--algorithm", "elastic_average", *ARGS, "--checkpoint-every",
         str(CHECKPOINT_EVERY)]
RESIZE = ["train", "--algorithm", "diloco", *ARGS, "--sync-period", str(PERIOD),
          "--checkpoint-every", str(CHECKPOINT_EVERY)]
COMPARED = ("sync", "elastic_average", "agn", "moving_average", "local_sgd", "diloco")
# With local processes the launcher polls every 0.05 s, kills the others at once, waits for them
# and reports: about a second; the bounds leave room for a loaded machine.
LOCAL_FAULT_BOUND_S = 10.0
LOCAL_EXIT_BOUND_S = 30.0
HEARTBEAT_S = 5
# Processes started one by one: JAX's coordination service declares the silent process dead
# after the heartbeat timeout and aborts the others.
CLUSTER_FAULT_BOUND_S = HEARTBEAT_S + 12.0


class Run:
  """A command started in the background; its output read and its end timed as they happen."""

  def __init__(self, *args: str):
    self.proc = subprocess.Popen(
      [sys.executable, "-m", "optax_dist.cli", *map(str, args)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    self.stdout = []
    self.stderr_lines: list[tuple[float, str]] = []  # (arrival time, line)
    self.ended = None
    self._threads = [threading.Thread(target=f, daemon=True)
                     for f in (self._read_stdout, self._read_stderr)]
    for thread in self._threads:
      thread.start()

  def _read_stdout(self):
    self.stdout.append(self.proc.stdout.read())

  def _read_stderr(self):
    for line in self.proc.stderr:
      self.stderr_lines.append((time.monotonic(), line))
    self.proc.wait()
    self.ended = time.monotonic()

  def result(self) -> tuple[int, str, str]:
    for thread in self._threads:
      thread.join(timeout=600)
    assert self.ended is not None, "the command did not end in 600 s"
    return self.proc.returncode, "".join(self.stdout), "".join(l for _, l in self.stderr_lines)

  def time_of(self, text: str) -> float:
    """When the first stderr line containing ``text`` arrived."""
    return next(t for t, line in self.stderr_lines if text in line)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  return tmp_path_factory.mktemp("multiprocess")


@pytest.fixture(scope="module")
def runs(root):
  port = free_port()
  cluster = ["train", *ARGS, *MULTI, "--out", root / "cluster", "--coordinator",
             f"127.0.0.1:{port}", "--heartbeat-timeout", str(HEARTBEAT_S),
             "--fail-at-step", "3"]
  started = {
    "multi": Run("compare", *ARGS, *MULTI, "--out", root / "multi",
                 "--save-params", root / "multi.npz"),
    "fault": Run(*EASGD, *MULTI, "--out", root / "fault", "--fail-at-step", str(FAIL_AT)),
    "grow": Run(*RESIZE, "--devices", "2", "--out", root / "grow", "--fail-at-step", str(FAIL_AT)),
    # Started one by one, as on a cluster: no parent watches them.
    "cluster0": Run(*cluster, "--process-id", "0"),
    "cluster1": Run(*cluster, "--process-id", "1"),
  }
  yield started
  for run_ in started.values():
    if run_.proc.poll() is None:
      run_.proc.kill()
      run_.proc.wait()


def load(path) -> dict[str, np.ndarray]:
  with np.load(path) as f:
    return {key: f[key] for key in f.files}


@pytest.fixture(scope="module")
def single(runs, root):
  """The reference, one process of 4 devices: in this process (4 of its 8), as the others run."""
  assert main(["compare", *ARGS, "--devices", "4", "--out", str(root / "single"),
               "--save-params", str(root / "single.npz")]) == 0
  return load(root / "single.npz")


@pytest.fixture(scope="module")
def multi(runs, root):
  returncode, stdout, stderr = runs["multi"].result()
  assert returncode == 0, stderr
  assert "4 workers (2 processes x 2 devices)" in stdout
  assert "[Gloo]" not in stdout  # native chatter goes to stderr, not into the table
  return load(root / "multi.npz")


def workers_params(arrays, algorithm):
  prefix = f"{algorithm}['params']"
  return {key: value for key, value in arrays.items() if key.startswith(prefix)}


@pytest.mark.slow
def test_two_processes_give_the_params_of_one(single, multi, root):
  assert set(single) == set(multi)
  for algorithm in COMPARED:
    params = workers_params(single, algorithm)
    assert len(params) == 6  # three Dense layers, kernel and bias
    for key in params:
      assert single[key].shape[0] == 4  # one row per worker
      np.testing.assert_allclose(multi[key], single[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for key in single:  # the optimizer states too
    np.testing.assert_allclose(multi[key], single[key], rtol=1e-5, atol=1e-6, err_msg=key)
  # Not vacuous: training moved the params; sync keeps the workers equal, EASGD does not.
  sync = workers_params(single, "sync")
  easgd = workers_params(single, "elastic_average")
  for key, value in sync.items():
    np.testing.assert_array_equal(value, np.broadcast_to(value[0], value.shape))
    other = key.replace("sync", "elastic_average", 1)
    assert np.max(np.abs(easgd[other] - value)) > 1e-3
  assert any(np.max(np.abs(v - v[0])) > 1e-3 for v in easgd.values())
  with open(root / "multi" / "results.json") as f:
    config = json.load(f)["config"]
  assert (config["processes"], config["devices"], config["workers"]) == (2, 2, 4)


@pytest.fixture(scope="module")
def fault(runs, root):
  """The ``fault`` run (2 processes, process 1 exits at step ``FAIL_AT``): its result, its output
  copied to ``shrink`` before any resume (resumed there on 1 process, on 2 in ``fault``)."""
  result = runs["fault"].result()
  shutil.copytree(root / "fault", root / "shrink")
  return result


@pytest.mark.slow
def test_killed_process_stops_the_run_and_resume_is_exact(runs, fault, multi, root):
  returncode, stdout, stderr = fault
  killed = runs["fault"]
  assert returncode == 1, stderr
  assert "optax-dist: error: process 1 exited with code 1" in stderr
  died = killed.time_of(f"exiting at step {FAIL_AT}")
  stopped = killed.time_of("exited with code") - died  # reported after the others were killed
  print(f"\nlocal processes stopped {stopped:.2f} s and the command exited"
        f" {killed.ended - died:.2f} s after process 1 died")
  assert stopped < LOCAL_FAULT_BOUND_S
  assert killed.ended - died < LOCAL_EXIT_BOUND_S
  assert not (root / "fault" / "results_elastic_average.json").exists()
  checkpoints = root / "fault" / "checkpoints" / "elastic_average"
  assert sorted(int(p) for p in os.listdir(checkpoints) if p.isdigit()) == [4, 8]

  # Resumes from step 8, in the middle of a communication period (5).
  resumed = Run(*EASGD, *MULTI, "--out", root / "fault", "--resume",
                "--save-params", root / "resumed.npz")
  returncode, stdout, stderr = resumed.result()
  assert returncode == 0, stderr
  assert "elastic_average: resumed from the checkpoint of step 8" in stdout
  params = load(root / "resumed.npz")
  uninterrupted = {k: v for k, v in multi.items() if k.startswith("elastic_average")}
  assert set(params) == set(uninterrupted)
  for key, value in uninterrupted.items():
    np.testing.assert_allclose(params[key], value, rtol=1e-6, atol=0, err_msg=key)
  with open(root / "fault" / "results_elastic_average.json") as f:
    history = json.load(f)["algorithms"]["elastic_average"]["history"]
  with open(root / "multi" / "results.json") as f:
    expected = json.load(f)["algorithms"]["elastic_average"]["history"]
  assert history["step"] == expected["step"] == [0, 10, 20]
  np.testing.assert_allclose(history["test_accuracy_eval_params"],
                             expected["test_accuracy_eval_params"], rtol=1e-6)


@pytest.mark.slow
def test_processes_started_one_by_one_abort_after_the_heartbeat_timeout(runs):
  returncode1, _, stderr1 = runs["cluster1"].result()
  assert returncode1 == 1, stderr1
  died = runs["cluster1"].time_of("exiting at step 3")
  returncode0, stdout0, stderr0 = runs["cluster0"].result()
  elapsed = runs["cluster0"].ended - died
  print(f"\nprocess 0 exited {elapsed:.2f} s after process 1 died (heartbeat timeout"
        f" {HEARTBEAT_S} s)")
  assert returncode0 != 0
  assert "results" not in stdout0
  assert "stopped sending heartbeats" in stderr0
  assert elapsed < CLUSTER_FAULT_BOUND_S


def test_bad_multiprocess_arguments_give_one_line_errors(tmp_path, capsys):
  """Checked before any process starts: in process."""

  cases = {
    "process id without coordinator": ["train", "--processes", "2", "--process-id", "0"],
    "process id out of range": ["train", "--processes", "2", "--process-id", "2",
                                "--coordinator", "127.0.0.1:1234"],
    "coordinator without port": ["train", "--processes", "2", "--coordinator", "localhost"],
    "coordinator for one process": ["train", "--coordinator", "127.0.0.1:1234"],
    "batch larger than a shard": ["compare", "--processes", "4", "--devices", "8",
                                  "--batch-size", "64"],
  }
  for name, args in cases.items():
    try:
      status = main([*args, "--out", str(tmp_path / "runs")])
    except SystemExit as e:  # argparse's own errors
      status = e.code
    stdout, stderr = capsys.readouterr()
    assert status == 2, (name, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("optax-dist: error: argument --"), (name, stderr)
    assert stdout == "", name


def _process(code: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-c", code])


def test_a_mistake_said_by_process_zero_is_its_one_line(capfd):
  """Process 1 exits with status 2 first, silently (the mistake is process 0's to say); the
  launcher lets process 0 say it and adds no line of its own."""
  from optax_dist.cli import processes

  said = "optax-dist: error: argument --resume: no intact checkpoint to resume from: ..."
  procs = [_process(f"import sys, time; time.sleep(1.0); print({said!r}, file=sys.stderr);"
                    " sys.exit(2)"),
           _process("import sys; sys.exit(2)")]
  assert processes._watch(procs) == 2
  assert capfd.readouterr().err.strip().splitlines() == [said]


def test_a_crash_after_a_mistake_is_reported(capfd, tmp_path):
  """Process 1 exits with status 2 (a mistake); process 0 crashes after it, within the grace."""
  from optax_dist.cli import processes

  said = tmp_path / "mistake"
  procs = [_process(f"import os, time\nwhile not os.path.exists({str(said)!r}): time.sleep(0.01)\n"
                    "time.sleep(0.2); os._exit(1)"),
           _process(f"import sys; open({str(said)!r}, 'w').close(); sys.exit(2)")]
  assert processes._watch(procs) == 1
  lines = capfd.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
    "optax-dist: error: process 0 exited with code 1; process 1 exited with code 2;"), lines


@pytest.mark.parametrize("every_process, process, said", [
  (True, 0, True), (True, 1, False), (False, 1, True)])
def test_only_process_zero_says_what_every_process_finds(monkeypatch, capsys, tmp_path,
                                                         every_process, process, said):
  from optax_dist.cli import orbax_checkpoints, train, trainer

  def refused(*args, **kwargs):
    raise orbax_checkpoints.CheckpointMismatchError("it was written with other settings",
                                              every_process=every_process)

  monkeypatch.setattr(trainer, "train", refused)
  monkeypatch.setattr(train.processes, "init_jax", lambda *args: None)
  argv = ["train", "--resume", "--processes", "2", "--process-id", str(process),
          "--coordinator", "127.0.0.1:1", "--out", str(tmp_path), "--no-progress"]
  (tmp_path / "checkpoints" / "sync" / "2").mkdir(parents=True)  # --resume finds a checkpoint
  assert main(argv) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  expected = ["optax-dist: error: argument --resume: it was written with other settings"]
  assert lines == (expected if said else []), lines


# name: (algorithm, the resumed run's arguments, workers before and after).
LAYOUTS = {"shrink": ("elastic_average", [*EASGD, "--devices", "2"], 4, 2),
           "grow": ("diloco", [*RESIZE, *MULTI], 2, 4)}


@pytest.fixture(scope="module")
def resized(runs, root, fault):
  """The ``fault`` run's copy (elastic_average, 2 processes and 4 workers, crashed at step
  ``FAIL_AT``) resumed on 1 process (2 workers; this process), ``shrink``; and the ``grow`` run
  (diloco, 1 process, crashed at the same step) resumed on 2: ``{name: (crashed, resumed)}``,
  each a ``(returncode, stdout, stderr)``."""
  crashed = {"shrink": fault, "grow": runs["grow"].result()}
  grown = Run(*LAYOUTS["grow"][1], "--out", root / "grow", "--resume")
  try:  # the resume on 1 process in this process (2 of its 8 devices) meanwhile
    with contextlib.redirect_stdout(io.StringIO()) as out, \
        contextlib.redirect_stderr(io.StringIO()) as err:
      status = main([*map(str, LAYOUTS["shrink"][1]), "--out", str(root / "shrink"), "--resume"])
  except BaseException:
    grown.proc.kill()
    raise
  resumed = {"shrink": (status, out.getvalue(), err.getvalue()), "grow": grown.result()}
  return {name: (crashed[name], resumed[name]) for name in LAYOUTS}


@pytest.mark.slow
def test_resume_on_another_number_of_processes_resizes(root, resized):
  """A 2-process run (4 workers) resumes on 1 process (2 workers), and a 1-process run on 2."""
  for name, ((returncode, _, stderr), _) in resized.items():
    assert returncode == 1 and f"exiting at step {FAIL_AT}" in stderr, (name, stderr)
  for name, (algorithm, _, before, after) in LAYOUTS.items():
    returncode, stdout, stderr = resized[name][1]
    assert returncode == 0, stderr
    line = f"{algorithm}: resized from {before} to {after} workers at step 8"
    assert line in stdout
    results = json.loads((root / name / f"results_{algorithm}.json").read_text())
    result = results["algorithms"][algorithm]
    assert result["resized"] == {"step": 8, "from_workers": before, "to_workers": after}
    assert result["devices"] == after
    assert result["history"]["step"] == [0, 10, 20]  # the evaluations of the checkpoint kept
    assert result["test_accuracy_eval_params"] > 0.8  # trains on after the resize


@pytest.mark.slow
def test_no_intact_checkpoint_over_two_processes_is_one_line(root, resized):
  """Every checkpoint of the run that ended on 2 processes (``grow``, copied) damaged: process 0
  names each and what is wrong with it, in one line; the other process and the launcher add
  none."""
  assert resized["grow"][1][0] == 0
  out = root / "damaged"
  shutil.copytree(root / "grow", out)
  checkpoints = out / "checkpoints" / "diloco"
  steps = sorted((int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()), reverse=True)
  assert len(steps) >= 2, steps
  for step in steps:
    (checkpoints / str(step) / "meta" / "metadata").write_bytes(b"\xff\xfe not json")
  returncode, stdout, stderr = Run(*RESIZE, *MULTI, "--out", out, "--resume").result()
  said = [line for line in stderr.splitlines() if line.startswith("optax-dist")]
  assert returncode == 2 and stdout == "", stderr
  assert len(said) == 1, stderr
  newest = checkpoints / str(steps[0])
  assert said[0].startswith("optax-dist: error: argument --resume: no intact checkpoint to resume"
                            f" from: {newest} is damaged (UnicodeDecodeError: ")
  for step in steps[1:]:
    assert f"; {checkpoints / str(step)} is damaged (UnicodeDecodeError: " in said[0]
  assert said[0].endswith("; rerun without --resume to start over")


@pytest.mark.slow
def test_the_global_view_over_two_processes_gives_the_params_of_one(root):
  """``--fsdp 2 --replicas 2`` over 2 processes of 2 devices (a replica each, its params sharded
  over its 2 devices) trains as one process of 4 devices."""
  args = ["train", "--algorithm", "diloco", "--replicas", "2", "--fsdp", "2", *ARGS]
  started = Run(*args, *MULTI, "--out", root / "fsdp_multi",
                "--save-params", root / "fsdp_multi.npz")
  try:  # the reference in this process (4 of its 8 devices) meanwhile
    assert main([*args, "--devices", "4", "--out", str(root / "fsdp_single"),
                 "--save-params", str(root / "fsdp_single.npz")]) == 0
  except BaseException:
    started.proc.kill()
    raise
  returncode, _, stderr = started.result()
  assert returncode == 0, stderr
  single, multi = load(root / "fsdp_single.npz"), load(root / "fsdp_multi.npz")
  assert set(single) == set(multi)
  assert all(value.shape[0] == 2 for value in single.values())  # one row per replica
  for key, value in single.items():
    np.testing.assert_allclose(multi[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
  with open(root / "fsdp_multi" / "results_diloco.json") as f:
    results = json.load(f)
  assert results["config"]["fsdp"] == results["algorithms"]["diloco"]["fsdp"] == 2
