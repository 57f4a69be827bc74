"""``optax-dist train --fault-tolerant``: its one-line refusals (in process), the replicas' data
order against the trainer's, the run's summary, and the command end to end with a `kill -9`.

The end-to-end test needs the ``ft`` extra; with ``OPTAX_DIST_REQUIRE_FT=1`` (``make test``) a
missing extra fails it instead of skipping it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _helpers import one_line_error

pytest.importorskip("flax")
pytest.importorskip("sklearn")

from optax_dist.cli import ft_flags, ft_task, pipeline  # noqa: E402
from optax_dist.cli.main import build_parser  # noqa: E402
from optax_dist.fault_tolerance import checkpoints  # noqa: E402
from optax_dist.fault_tolerance.rundir import RunDir  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ["train", "--algorithm", "diloco", "--fault-tolerant", "--replicas", "3",
           "--min-replicas", "2", "--devices", "1", "--steps", "80", "--sync-period", "5"]
"""The example of docs/fault_tolerance.md, without its --out."""


def _without(example: list[str], flag: str) -> list[str]:
  i = example.index(flag)
  return example[:i] + example[i + 2:]


@pytest.mark.parametrize("args, said", [
  (_without(EXAMPLE, "--algorithm") + ["--algorithm", "sync"],
   "argument --algorithm: --fault-tolerant runs diloco, local_sgd, streaming_diloco only, got"
   " sync"),
  (EXAMPLE + ["--resume"], "argument --resume: with --fault-tolerant, needs --checkpoint-every N"
   " (the replicas restore from OUT/replicas/checkpoints and go on writing there)"),
  (EXAMPLE + ["--save-params", "x.npz"],
   "argument --save-params: not with --fault-tolerant, got --save-params x.npz; the final state"
   " is the last checkpoint's"),
  (EXAMPLE + ["--fail-at-step", "3"], "argument --fail-at-step: not with --fault-tolerant, got"
   " --fail-at-step 3; it scripts a process exit"),
  (EXAMPLE + ["--exchange-device"], "argument --exchange-device: not with --fault-tolerant, got"
   " --exchange-device; a round's exchange is torchft's"),
  (_without(EXAMPLE, "--algorithm") + ["--algorithm", "streaming_diloco", "--decoupled",
                                         "--overlap", "1"],
   "argument --overlap: not with --decoupled, got --overlap 1; decoupled rounds over torchft do"
   " not take it yet"),
  (EXAMPLE + ["--eager"], "argument --eager: not with --fault-tolerant, got --eager; the eager"
   " rule (Kale et al. 2025) applies the local pseudo-gradient"),
  (_without(EXAMPLE, "--algorithm") + ["--algorithm", "local_sgd", "--warmup-steps", "4"],
   "argument --warmup-steps: not with --fault-tolerant, got --warmup-steps 4; local_sgd's warm-up"
   " averages the gradients inside each step, before the inner update, and a round exchanges"
   " only after a step"),
  (_without(EXAMPLE, "--min-replicas") + ["--min-replicas", "4"],
   "argument --min-replicas: must be at most --replicas (3), got 4"),
  (["train", "--min-replicas", "2"], "argument --min-replicas: needs --fault-tolerant"),
  (["train", "--restart-delay", "0.5"], "argument --restart-delay: needs --fault-tolerant"),
  (["train", "--standby"], "argument --standby: needs --fault-tolerant"),
  (["train", "--exchange-retries", "2"], "argument --exchange-retries: needs --fault-tolerant"),
  (EXAMPLE + ["--exchange-retries", "-1"], "argument --exchange-retries: must be an integer >= 0"),
  (EXAMPLE + ["--join-timeout", "-1"], "argument --join-timeout: must be a number >= 0"),
  (["replica", "--lighthouse", "http://127.0.0.1:1", "--replica-id", "3", "--replicas", "3"],
   "argument --replica-id: must be in 0..2 (--replicas 3), got 3"),
  pytest.param(  # checked on the replicas' protocol, once the ft extra is in
    _without(EXAMPLE, "--algorithm") + ["--algorithm", "local_sgd", "--decoupled",
                                        "--staleness-rule", "delayed_nesterov"],
    "argument --staleness-rule: `train(staleness_rule='delayed_nesterov')` needs"
    " RoundProtocol(outer=optax_dist.delayed_nesterov(...))",
    marks=pytest.mark.skipif(importlib.util.find_spec("torch") is None and not os.environ.get(
      "OPTAX_DIST_REQUIRE_FT"), reason="needs the ft extra")),
])
def test_refusals_areone_line_error(args, said, tmp_path, capsys):
  line = one_line_error(capsys, *args, "--out", str(tmp_path))
  assert said in line, line
  assert not (tmp_path / "replicas").exists()


def test_without_the_ft_extra_one_line_names_it(tmp_path, capsys, monkeypatch):
  for module in ("torch", "torchft"):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
  line = one_line_error(capsys, *EXAMPLE, "--out", str(tmp_path))
  assert line == ("optax-dist: error: no module named 'torch'; --fault-tolerant needs the \"ft\""
                  ' extra: pip install "optax-dist[ft]"')


def test_a_protocol_refusal_is_one_line_before_any_replica_starts(tmp_path, capsys):
  """The digits MLP's 6 leaves leave a fragment of 4 empty (the protocol's assignment)."""
  _require_ft()
  line = one_line_error(capsys, "train", "--algorithm", "streaming_diloco", "--fault-tolerant",
                   "--replicas", "2", "--devices", "1", "--steps", "40", "--sync-period", "8",
                   "--out", str(tmp_path))
  assert line.startswith("optax-dist: error: argument --num-fragments: `streaming_diloco("
                         "num_fragments=...)` must leave no fragment empty"), line
  assert not (tmp_path / "replicas").exists() and not list(tmp_path.glob("replica_*.log"))


def test_a_launch_refusal_names_its_flag_inone_line_error(tmp_path, capsys):
  _require_ft()
  line = one_line_error(capsys, *EXAMPLE, "--host", "0.0.0.0", "--out", str(tmp_path))
  assert line == ("optax-dist: error: argument --host: `LaunchConfig(host=...)` must be a"
                  " specific address, got '0.0.0.0'."), line
  assert not list(tmp_path.glob("replica_*.log"))


NOT_BEFORE_READY = ("matplotlib", "orbax", "sklearn", "flax.nnx", "IPython", "treescope",
                    "optax_dist.async_emulator", "optax_dist.cli.train", "optax_dist.cli.compare",
                    "optax_dist.cli.plan", "optax_dist.cli.ft_train", "optax_dist.cli.reports")
"""What a replica's process does not import before its session is up (a restart's start-up
CPU): plotting, checkpoint libraries, NNX, the other subcommands."""


def test_a_replica_s_process_imports_nothing_it_does_not_use_before_it_is_ready():
  """A fresh process does what ``optax-dist replica`` does before its session on ``lm``: the
  command line's parse, the engine's import (torch, torchft), the task's model, a loop state's
  parts; none of :data:`NOT_BEFORE_READY` is imported."""
  _require_ft()
  code = ("import sys, contextlib, io\n"
          "from optax_dist.cli.main import main\n"
          "with contextlib.suppress(SystemExit), contextlib.redirect_stderr(io.StringIO()):\n"
          "  main(['replica'])  # its flags missing: the parse alone\n"
          "from optax_dist.cli import ft_task, meshes, runs\n"
          "from optax_dist.cli.tasks import TASKS\n"
          "from optax_dist.fault_tolerance import loop, replica\n"
          "replica.load_engine(), TASKS['lm'].model(), loop.get_parts(({}, ()))\n"
          f"print(sorted(m for m in {NOT_BEFORE_READY!r} if m in sys.modules))\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300, check=True)
  assert done.stdout.strip() == "[]", done.stdout


def test_timing_flags_are_float_seconds_beside_the_integer_heartbeat_timeout():
  args = build_parser().parse_args(
    [*EXAMPLE, "--quorum-timeout", "2.5", "--join-timeout", "0.25", "--restart-delay", "0.5",
     "--lighthouse-heartbeat-timeout", "1.5", "--heartbeat-timeout", "7", "--max-restarts", "2"])
  assert (args.quorum_timeout, args.join_timeout, args.restart_delay) == (2.5, 0.25, 0.5)
  assert (args.lighthouse_heartbeat_timeout, args.heartbeat_timeout) == (1.5, 7)
  assert args.max_restarts == 2


def test_min_replicas_defaults_to_a_majority(monkeypatch):
  monkeypatch.setattr(ft_flags.errors, "require", lambda *a, **k: None)  # no extra needed
  for replicas, majority in ((1, 1), (2, 2), (3, 2), (4, 3), (5, 3)):
    args = build_parser().parse_args(
      [*_without(_without(EXAMPLE, "--replicas"), "--min-replicas"), "--replicas", str(replicas)])
    ft_flags.resolve(args)
    assert args.min_replicas == majority
    assert args.quorum_timeout == ft_flags.DEFAULTS["quorum_timeout"]


def test_overlap_is_taken_and_built_into_the_replicas_protocol(monkeypatch):
  """``--fault-tolerant --overlap`` (each round's exchange beside the next steps) resolves, and
  the replicas' protocol has the run's overlap and mixing."""
  from optax_dist.cli.tasks import TASKS

  monkeypatch.setattr(ft_flags.errors, "require", lambda *a, **k: None)  # no extra needed
  args = build_parser().parse_args(
    [*_without(EXAMPLE, "--algorithm"), "--algorithm", "streaming_diloco", "--num-fragments",
     "2", "--overlap", "2", "--mixing", "0.5"])
  ft_flags.resolve(args)
  task = TASKS[args.task]
  rounds = ft_task.protocol(ft_task.settings(args, task, lambda: task.load(args.seed)))
  assert (rounds.algorithm, rounds.overlap, rounds.mixing, rounds.num_fragments) == (
    "streaming_diloco", 2, 0.5, 2)


def test_decoupled_rounds_default_to_delayed_nesterov_built_into_every_replica_s_protocol(
    monkeypatch, tmp_path):
  """``--decoupled`` defaults to ``--staleness-rule delayed_nesterov`` (``local_sgd``, which has
  no outer optimizer: ``dylu``), and with that rule the command's and each replica's protocol
  has delayed Nesterov of buffer size N = R = 3 at ``--outer-learning-rate`` 0.5 and
  ``--outer-momentum`` 0.8: on a pseudo-gradient of 1 every update, plain steps of -0.5 / 3 and
  on the third the momentum m = 1 moved, -0.5 (0.8 m + 1 / 3) (the equations of
  :func:`optax_dist.delayed_nesterov`); a replica's torchft engine's check takes it. Another
  rule, or no ``--decoupled``, keeps Nesterov SGD: -0.5 (1 + 0.8 · 1), then with the trace 1.8,
  -0.5 (1 + 0.8 · 1.8)."""
  import jax.numpy as jnp

  from optax_dist.cli import ft_train
  from optax_dist.cli.tasks import TASKS
  from optax_dist.fault_tolerance import decoupled

  monkeypatch.setattr(ft_flags.errors, "require", lambda *a, **k: None)  # no extra needed
  delayed, nesterov = [-0.5 / 3, -0.5 / 3, -0.5 * (0.8 + 1 / 3), -0.5 / 3], [-0.9, -1.22]

  def resolved(*flags, command="train"):
    args = build_parser().parse_args([command, *EXAMPLE[1:], "--outer-learning-rate", "0.5",
                                      "--outer-momentum", "0.8", *flags, "--out", str(tmp_path)])
    ft_flags.resolve(args)
    task = TASKS[args.task]
    s = ft_task.settings(args, task, lambda: task.load(args.seed))
    return args, s, ft_task.protocol(s, args.staleness_rule)

  def steps(protocol, n):
    state, out = protocol.outer_tx.init(jnp.zeros(())), []
    for _ in range(n):
      update, state = protocol.outer_tx.update(jnp.ones(()), state)
      out.append(float(update))
    return out

  args, s, protocol = resolved("--decoupled")
  assert args.staleness_rule == "delayed_nesterov" == ft_flags.DECOUPLED["staleness_rule"]
  ft_train._check_decoupled(args, s)  # the command's check before any replica starts
  assert steps(protocol, 4) == pytest.approx(delayed, rel=1e-6)
  replica, _, replica_protocol = resolved(
    "--decoupled", "--lighthouse", "http://127.0.0.1:1", "--replica-id", "1",
    command="replica")
  assert replica.staleness_rule == "delayed_nesterov"
  assert steps(replica_protocol, 4) == pytest.approx(delayed, rel=1e-6)
  options = {name: getattr(replica, name) for name in (*ft_flags.DECOUPLED, "max_staleness")}
  del options["decoupled"]
  decoupled.check_settings("Torchft", replica_protocol, num_replicas=None, speeds=None,
                           **options)  # what the replica's engine checks
  for flags in (("--decoupled", "--staleness-rule", "dylu"), ()):
    assert steps(resolved(*flags)[2], 2) == pytest.approx(nesterov, rel=1e-6)
  assert resolved("--decoupled", "--algorithm", "local_sgd")[0].staleness_rule == "dylu"


def test_replicas_draw_the_trainers_minibatches():
  """Replica i's batch at step t is the minibatches of workers i*D .. i*D+D-1 of the trainer
  with R*D workers (`pipeline.shard_examples`, `pipeline.minibatch`), stateless in (seed, i,
  t)."""
  import jax

  from optax_dist.cli.config import Settings
  from optax_dist.cli.tasks import TASKS

  task = TASKS["digits"]
  data = task.load(0)
  replicas, per_replica, batch = 3, 2, 4
  s = Settings(algorithm="diloco", devices=replicas * per_replica, batch_size=batch,
               steps=20, sync_period=5).resolved()
  params, loss_and_grad, batch_fn, tokens, evaluate = ft_task.task_engine(
    task, data, s, replicas)
  assert tokens == per_replica * batch  # a digit's label is its one target
  shards = pipeline.shard_examples(data.train, s.devices)
  n_local = len(shards["x"][0])
  for seed, slot, step in ((0, 0, 0), (0, 2, 7), (3, 1, 40)):
    idx = pipeline.minibatch(seed, s.devices, n_local, batch, step)
    got = jax.device_get(batch_fn(seed, slot, step))
    workers = range(slot * per_replica, (slot + 1) * per_replica)
    for key in ("x", "y"):
      want = np.concatenate([shards[key][w][idx[w]] for w in workers])
      np.testing.assert_array_equal(got[key], want)
    np.testing.assert_array_equal(jax.device_get(batch_fn(seed, slot, step))["x"], got["x"])
  assert 0.0 <= evaluate(params) <= 1.0
  loss, grads = jax.jit(loss_and_grad)(params, batch_fn(0, 0, 0))  # one program, not one per op
  assert np.shape(loss) == () and jax.tree.structure(grads) == jax.tree.structure(params)


def test_fsdp_shards_a_replicas_params_and_a_heals_state_is_placed_back():
  """With ``--fsdp 2`` a replica's params are sharded over its 2 devices as ``train --fsdp 2``
  shards one replica's (:func:`fsdp_spec`), and so are its gradients and inner optimizer state
  after a step. A heal's state arrives as host arrays (one device): the next step puts the
  params and the inner state back on that layout (the gradients are placed as the params), and
  a second heal compiles nothing the first did not."""
  import jax
  import jax.numpy as jnp

  from optax_dist.cli.config import Settings
  from optax_dist.cli.meshes import fsdp_spec
  from optax_dist.cli.tasks import TASKS

  task = TASKS["digits"]
  s = Settings(algorithm="diloco", devices=4, replicas=2, fsdp=2, batch_size=4, steps=8,
               sync_period=4).resolved()
  params, loss_and_grad, batch_fn, _, _ = ft_task.task_engine(task, task.load(0), s, 2)
  specs = jax.tree.map(lambda p: fsdp_spec(p.shape, 2), params)
  assert jax.tree.map(lambda p: p.sharding.spec, params) == specs
  assert all("fsdp" in spec for spec in jax.tree.leaves(specs))  # every leaf has an even dim
  protocol, grads = ft_task.protocol(s), jax.jit(lambda p, b: loss_and_grad(p, b)[1])

  def layout(tree):  # each leaf's sharded dims (a jitted step drops a spec's trailing Nones)
    return [[i for i, axis in enumerate(x.sharding.spec) if axis] for x in jax.tree.leaves(tree)]

  def steps(state, first, n):
    for t in range(first, first + n):
      state = protocol.inner_step(*state, grads(state[0], batch_fn(0, 0, t)))
    return state

  state = steps((params, protocol.tx.init(params)), 0, 2)
  want = layout(params), layout(state[1].inner_state)
  assert layout(state[0]) == want[0] and layout(grads(state[0], batch_fn(0, 0, 2))) == want[0]
  compiled = []
  for heal in range(2):
    state = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state)  # as decode_heal builds it
    state = steps(state, 2 + 3 * heal, 3)
    assert (layout(state[0]), layout(state[1].inner_state)) == want
    compiled.append((protocol.inner_step._cache_size(), grads._cache_size()))
  assert compiled[1] == compiled[0]


def test_an_lm_example_weighs_its_context_in_tokens():
  """A window of the ``lm`` task predicts the next byte at each of its positions."""
  from optax_dist.cli.tasks import LM_CONTEXT, load_lm

  assert ft_task.tokens_per_example(load_lm(seed=0)) == LM_CONTEXT


def _write_lines(out: pathlib.Path, i: int, lines: list[tuple]) -> None:
  folder = out / "replicas"
  folder.mkdir(parents=True, exist_ok=True)
  with open(folder / f"replica_{i}.jsonl", "w") as f:
    for round_, committed, healed, digest in lines:
      f.write(json.dumps({"round": round_, "committed": committed, "healed": healed,
                          "state_hash": digest, "quorum_seconds": 0.5 if healed else 0.01})
              + "\n")


def test_summary_counts_rounds_heals_and_hash_agreement(tmp_path):
  _write_lines(tmp_path, 0, [(0, True, False, "a"), (1, False, False, "a"), (2, True, False, "c")])
  _write_lines(tmp_path, 1, [(0, True, False, "a"), (1, False, False, "a"), (2, True, True, "c")])
  (tmp_path / "replicas" / "final_1.json").write_text('{"test_accuracy": 0.5}')
  result = RunDir(tmp_path).summary(3, restarts=1)
  assert (result["rounds_committed"], result["rounds_aborted"]) == (2, 1)
  assert (result["heals"], result["heal_seconds"], result["restarts"]) == (1, [0.5], 1)
  assert result["hashes_agree"] and result["finished"] == [1]
  _write_lines(tmp_path, 2, [(2, True, False, "d")])
  assert not RunDir(tmp_path).summary(3, restarts=1)["hashes_agree"]


def _progress_run(out: pathlib.Path, t0: float) -> RunDir:
  """Three replicas' lines over four rounds, written at ``t0`` + 0 to 6 s: replica 1 missing
  from round 1 (restarted after a kill, status -9), healed from replica 0 in round 2; round 3
  aborted."""
  rows = [(0, 0, 100, 2.0), (1, 0, 100, 2.2), (0, 1, 100, 1.5), (0, 2, 100, 0.9),
          (1, 2, 0, 5.0), (2, 2, 300, 0.5), (0, 3, 100, 0.7)]
  folder = out / "replicas"
  folder.mkdir(parents=True, exist_ok=True)
  for t, (i, r, weight, loss) in enumerate(rows):
    line = {"round": r, "replica": i, "committed": r < 3, "weight": weight, "loss": loss,
            "healed": weight == 0, "donor": 0 if weight == 0 else None, "time": t0 + t}
    with open(folder / f"replica_{i}.jsonl", "a") as f:
      f.write(json.dumps(line) + "\n")
  run = RunDir(out)
  run.add_restart(1, -9)
  return run


@pytest.mark.parametrize("terminal", [False, True])
def test_progress_shows_rounds_tokens_the_last_round_s_weighted_loss_restarts_and_heals(
    tmp_path, capsys, terminal):
  """The status: 3 of 4 rounds committed, 700 tokens (the committed weights), round 2's loss
  (0.9 * 100 + 0.5 * 300) / 400 = 0.6 (the healed member, weight 0, left out); each event once,
  as a line (on a terminal, above the bar); a restart from before the command started (a
  resumed run's) is not shown."""
  from optax_dist.cli import ft_progress

  RunDir(tmp_path).add_restart(0, 1)
  capsys.readouterr()
  with ft_progress.Watch(RunDir(tmp_path), 4, terminal=terminal) as watch:
    run = _progress_run(tmp_path, time.time())
  watch.poll(final=True)  # nothing new: nothing shown again
  err = capsys.readouterr().err
  assert err.count("optax-dist: replica 1 restarted (exit -9)\n") == 1, err
  assert err.count("optax-dist: replica 1 healed from replica 0 at round 2\n") == 1, err
  assert "replica 0 restarted" not in err, err
  if terminal:
    assert "3/4" in err and "700 tokens" in err and "loss 0.6000" in err, err
  else:
    assert re.search(r"optax-dist: 3/4 rounds committed, 700 tokens \([\d,]+/s\), loss 0.6000\n$",
                     err), err
  t0 = run.lines()[0]["time"]  # since t0 + 5: replica 2's 300 tokens in 2 s
  assert ft_progress.status(run.lines(), t0 + 5, t0 + 7)["tokens_per_second"] == 150.0
  with ft_progress.Watch(run, 4, enabled=False):
    pass
  assert capsys.readouterr().err == ""


def test_the_loss_plot_has_a_curve_per_replica_and_marks_restarts_and_heals(tmp_path):
  """Each replica's curve is its lines' losses at their seconds since the start; the restart
  (dotted) and the heal (dashed) are vertical lines at their seconds, in the legend."""
  pytest.importorskip("matplotlib")
  from optax_dist.cli import reports

  t0 = time.time()
  run = _progress_run(tmp_path, t0)
  restart = run.restarts()[0]["time"]
  fig = reports.loss_figure(run.lines(), run.restarts(), start=t0 - 5)
  [ax] = fig.axes
  curves = {x.get_label(): x for x in ax.get_lines() if x.get_linestyle() == "-"}
  assert sorted(curves) == ["replica 0", "replica 1", "replica 2"]
  np.testing.assert_allclose(curves["replica 0"].get_xdata(), [5.0, 7.0, 8.0, 11.0])
  np.testing.assert_allclose(curves["replica 0"].get_ydata(), [2.0, 1.5, 0.9, 0.7])
  marks = {(x.get_linestyle(), x.get_xdata()[0]): x.get_label() for x in ax.get_lines()
           if x.get_linestyle() != "-"}
  assert marks == {(":", restart - (t0 - 5)): "replica 1 restarts", ("--", 9.0): "replica 1 heals"}
  legend = [t.get_text() for t in ax.get_legend().get_texts()]
  assert {"replica 1 restarts", "replica 1 heals"} <= set(legend)
  reports.plot_loss(run.lines(), run.restarts(), t0 - 5, str(tmp_path / "loss.png"))
  assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------
# End to end.


def _require_ft() -> None:
  if importlib.util.find_spec("torchft") is None:
    if os.environ.get("OPTAX_DIST_REQUIRE_FT") == "1":
      pytest.fail("OPTAX_DIST_REQUIRE_FT=1 but torchft is missing: pip install 'optax-dist[ft]'")
    pytest.skip("needs the ft extra (torch, torchft)")


def _lines(out: pathlib.Path, i: int) -> list[dict]:
  return RunDir(out).lines(i)


@pytest.mark.slow
def test_the_example_survives_a_kill_and_the_killed_replica_heals(tmp_path):
  """The example with ``--min-replicas 3``: no quorum forms while replica 2 is dead, so the
  launcher's restart and the heal happen whatever the machine's speed (with 2, the other two
  may finish the short run before the restarted replica has imported JAX)."""
  _require_ft()
  # Without the tests' compilation cache: the run's own, under OUT, which the replicas share.
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("TORCHFT_") and k != "JAX_COMPILATION_CACHE_DIR"}
  env["PYTHONPATH"] = str(ROOT)
  command = [sys.executable, "-m", "optax_dist.cli", *_without(EXAMPLE, "--min-replicas"),
             "--min-replicas", "3", "--restart-delay", "0.2", "--checkpoint-every", "80",
             "--out", str(tmp_path)]
  proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True)
  try:
    deadline = time.monotonic() + 120
    while sum(line["committed"] for line in _lines(tmp_path, 2)) < 3:
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
      time.sleep(0.02)
    first = _lines(tmp_path, 2)[-1]["pid"]
    os.kill(first, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  assert proc.returncode == 0, stderr[-3000:]
  assert "1 restart," in stdout and "the state hashes agree on every committed round" in stdout
  # The progress on stderr (not a terminal: plain lines) names the restart and each heal that
  # the launcher's and the replicas' lines record; every line has its round's loss; the plot.
  assert [(r["replica"], r["status"]) for r in RunDir(tmp_path).restarts()] == [(2, -9)]
  assert "optax-dist: replica 2 restarted (exit -9)\n" in stderr, stderr[-3000:]
  heals = [line for i in range(3) for line in _lines(tmp_path, i) if line["healed"]]
  for line in heals:
    # A heal whose attempt then failed at the headers' all-gather (a loaded machine) knows
    # neither the round's members nor its donor; the progress line names a donor it has.
    if line["members"]:
      assert line["donor"] in set(line["members"]) - {line["replica"]}, line
    named = "" if line["donor"] is None else f" from replica {line['donor']}"
    assert (f"optax-dist: replica {line['replica']} healed{named} at round {line['round']}\n"
            in stderr), stderr[-3000:]
  assert all(np.isfinite(line["loss"]) for i in range(3) for line in _lines(tmp_path, i))
  plot = tmp_path / "fault_tolerant_loss_diloco.png"
  assert plot.stat().st_size > 0 and f" and {plot}\n" in stdout
  restarted = [line for line in _lines(tmp_path, 2) if line["pid"] != first]
  assert restarted[0]["healed"] and restarted[0]["weight"] == 0, restarted[0]
  assert any(line["committed"] for line in restarted)
  by_round: dict[int, set] = {}
  for i in range(3):
    for line in _lines(tmp_path, i):
      if line["committed"]:
        by_round.setdefault(line["round"], set()).add(line["state_hash"])
  # 16 committed rounds (--steps 80, H = 5); the round indices count the aborted ones too.
  assert len(by_round) == 16 and all(len(h) == 1 for h in by_round.values())
  finals = [json.loads((tmp_path / "replicas" / f"final_{i}.json").read_text())
            for i in range(3)]
  assert len({(f["test_accuracy"], f["step"]) for f in finals}) == 1
  summary = json.loads((tmp_path / "fault_tolerant_diloco.json").read_text())
  assert summary["restarts"] == 1 and summary["hashes_agree"] and summary["heals"] >= 1
  assert any((tmp_path / "compilation_cache").iterdir())  # the replicas' programs, shared
  saved = checkpoints.saved(tmp_path / "replicas" / "checkpoints")
  # every 80 steps (an aborted round's steps count) and at the end, after 16 committed rounds:
  # none before the kill, so the restarted replica heals (a local checkpoint of the round its
  # peers wait at would restore it whole instead: tests/test_ft_resume.py)
  assert saved and all(meta["step"] >= 80 for meta in saved)
  assert (saved[-1]["step"], saved[-1]["rounds"]) == (finals[0]["step"], 16)


def _committed_hashes(out: pathlib.Path, replicas: int) -> dict[int, set]:
  """Each committed round's state hashes over the replicas' lines."""
  by_round: dict[int, set] = {}
  for i in range(replicas):
    for line in _lines(out, i):
      if line["committed"]:
        by_round.setdefault(line["round"], set()).add(line["state_hash"])
  return by_round


@pytest.mark.slow
def test_fsdp_and_bfloat16_params_run_with_one_hash_per_round(tmp_path):
  """2 replicas of 2 devices, 3 rounds, ``--fsdp 2`` (each replica's params sharded over its
  devices) with ``--param-dtype bfloat16`` (the anchor in float32: its checkpoint restores with
  the run's fingerprint): every round commits with one state hash across the replicas."""
  flags = ("--fsdp", "2", "--param-dtype", "bfloat16")
  _require_ft()
  env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFT_")}
  env["PYTHONPATH"] = str(ROOT)
  args = ["train", "--algorithm", "diloco", "--fault-tolerant", "--replicas", "2", "--devices",
          "2", "--steps", "12", "--sync-period", "4", "--checkpoint-every", "12", *flags,
          "--out", str(tmp_path)]
  done = subprocess.run([sys.executable, "-m", "optax_dist.cli", *args, "--no-progress"],
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "3 rounds committed, 0 aborted" in done.stdout, done.stdout
  hashes = _committed_hashes(tmp_path, 2)
  assert sorted(hashes) == [0, 1, 2] and all(len(h) == 1 for h in hashes.values())
  # The checkpoint of the last round restores in this process (settings_fingerprint, tree and
  # dtypes) and its evaluated params (the anchor) score what the replicas' final lines say.
  [curve] = ft_task.checkpoint_metrics(build_parser().parse_args(args))
  finals = {json.loads((tmp_path / "replicas" / f"final_{i}.json").read_text())["test_accuracy"]
            for i in range(2)}
  assert curve["rounds"] == 3 and finals == {curve["test_accuracy"]}


def test_the_command_s_loop_without_a_fault_is_train_s_in_program_route():
  """E4 for the command's loop (:func:`~optax_dist.fault_tolerance.replica.task_loop`, the
  in-process engine, 2 replicas, no fault): each round's line has the mean of its replica's
  inner-step losses, so the replicas' mean of a round's lines is the in-program ``train``'s
  ``train_loss`` (the workers' mean, every step) averaged over the round's steps, and each
  replica's final params and anchor are its worker's bit for bit: the loss is measured on the
  params the step is taken from, on the step's own batch."""
  import jax

  from optax_dist import eval_params
  from optax_dist.cli import trainer
  from optax_dist.cli.config import Settings
  from optax_dist.cli.tasks import TASKS
  from optax_dist.fault_tolerance import engine
  from optax_dist.fault_tolerance.replica import task_loop

  task, h = TASKS["digits"], 5
  data = task.load(0)
  s = Settings(algorithm="diloco", devices=2, replicas=2, steps=3 * h, sync_period=h,
               eval_every=1).resolved()
  want = trainer.train(task, data, s, keep_state=True)
  params, loss_and_grad, batch_fn, tokens, _ = ft_task.task_engine(task, data, s, 2)
  protocol = ft_task.protocol(s)
  run = engine("in_process", protocol, num_replicas=2, tokens_per_step=tokens)
  final = run.run(task_loop(protocol, params, loss_and_grad, batch_fn, rounds=3))
  losses = np.zeros((2, 3))
  for line in run.log:
    losses[line.replica, line.round] = line.loss
  steps = np.asarray(want["history"]["train_loss"][1:], np.float64).reshape(3, h)
  np.testing.assert_allclose(losses.mean(axis=0), steps.mean(axis=1), rtol=1e-6)
  worker = want["final_state"]
  for i in (0, 1):
    got = jax.device_get((final[i].params, eval_params(final[i].opt_state, final[i].params)))
    mine = jax.tree.map(lambda x, i=i: x[i], (worker["params"], eval_params(
      worker["opt_state"], worker["params"])))
    jax.tree.map(np.testing.assert_array_equal, got, mine)
