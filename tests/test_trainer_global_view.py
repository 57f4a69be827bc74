"""``fsdp``: the trainer on the global view (one jitted ``jax.vmap`` step over the replicas, each
replica's params and optimizer state sharded over K devices) trains the model of the per-device
``shard_map`` step.

* The same examples, so the same losses, metrics and params to float rounding (2 replicas of 4
  devices, with and without ``fsdp=4``), for ``sync`` (``tower`` over the replicas), ``diloco``
  (two compiled steps by the ``communicate`` hint) and ``moving_average`` (evaluated on the
  EMA).
* A device holds 1/K of every param the K devices divide (its bytes counted from its shards and
  from the compiled step's ``memory_analysis``).
* The compiled step's outputs are sharded as its inputs, the params by :func:`fsdp_spec`, the
  state by :func:`optax_dist.state_shardings`.
* A resumed run restores its checkpoint onto the mesh and ends as an uninterrupted one.
* A bad ``fsdp`` and an algorithm the global view refuses raise, in the API and on the command
  line.
"""

from __future__ import annotations

import functools
import json
import shutil

import chex
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from optax_dist.cli import main, runs, trainer
from optax_dist.cli.config import Settings
from optax_dist.cli.tasks import TASKS

WORKERS, REPLICAS, K, STEPS, BATCH, PERIOD = 8, 2, 4, 6, 8, 3
# The global view sums a replica's gradients in another order than the per-device step's
# all-reduce: after six steps the losses differ by ~1e-7 relative (measured), the params by a
# few float32 ulps.
RTOL, ATOL = 1e-5, 1e-6


def settings(algorithm: str, fsdp: int | None, **changes) -> Settings:
  return Settings(algorithm=algorithm, devices=WORKERS, replicas=REPLICAS, fsdp=fsdp,
                  steps=STEPS, batch_size=BATCH, sync_period=PERIOD, eval_every=2, **changes)


@pytest.fixture(scope="module")
def digits():
  task = TASKS["digits"]
  return task, task.load(0)


def trained(digits, algorithm: str, fsdp: int | None) -> tuple[dict, dict]:
  result = trainer.train(*digits, settings(algorithm, fsdp), keep_state=True)
  return result, result.pop("final_state")


@pytest.fixture(scope="module")
def trainings(digits):
  """``trainings(algorithm, fsdp)``: ``trained(digits, algorithm, fsdp)``, trained once per module."""
  return functools.cache(lambda algorithm, fsdp: trained(digits, algorithm, fsdp))


@pytest.fixture(scope="module", params=["sync", "diloco", "moving_average"])
def pair(request, trainings):
  """``(per-device, global view)``: the result and final state of each."""
  return trainings(request.param, None), trainings(request.param, K)


def test_fsdp_trains_the_model_of_the_per_device_step(pair, digits):
  (per_device, per_device_final), (global_view, global_final) = pair
  assert global_view["fsdp"] == K and per_device["fsdp"] is None
  history, expected = global_view["history"], per_device["history"]
  assert history["step"] == expected["step"] == [0, 2, 4, 6]
  np.testing.assert_allclose(history["train_loss"][1:], expected["train_loss"][1:], rtol=RTOL)
  for key in trainer.metric_keys(digits[0]):
    np.testing.assert_allclose(history[key], expected[key], rtol=RTOL)
  # Not vacuous: the loss went down.
  assert history["train_loss"][-1] < 0.8 * history["train_loss"][1]
  # Worker 0 of each replica (every worker of a replica holds its params) against the replica.
  first = jax.tree.map(lambda x: x[::WORKERS // REPLICAS], per_device_final["params"])
  chex.assert_trees_all_close(global_final["params"], first, rtol=RTOL, atol=ATOL)


def test_a_device_holds_a_kth_of_the_params(pair, digits):
  (per_device, _), (global_view, _) = pair
  task, data = digits
  example = tuple((k, (1,) + v.shape[1:], str(v.dtype)) for k, v in data.train.items())
  params = jax.tree.leaves(runs.initial_params(task, 0, example))
  whole = sum(p.nbytes for p in params)
  # The (10,) bias of the last layer is not divisible by 4: whole on every device.
  sharded = sum(p.nbytes // (K if any(n % K == 0 for n in p.shape) else 1) for p in params)
  held, global_held = per_device["bytes_per_device"], global_view["bytes_per_device"]
  assert held["params"] == whole
  assert global_held["params"] == sharded < whole / 3
  assert global_held["opt_state"] < held["opt_state"] / 3

  # memory_analysis: beside the params and the state, both steps take the same data.
  def others(result):
    b = result["bytes_per_device"]
    return b["step_arguments"] - b["params"] - b["opt_state"]

  assert others(global_view) == others(per_device) > 0


def test_the_step_keeps_the_shardings(digits):
  task, data = digits
  run = trainer.GlobalRun(task, data, settings("diloco", K).resolved())
  params = run.initial.params
  assert params["Dense_0"]["kernel"].sharding.spec == P("replica", "fsdp", None)
  assert params["Dense_2"]["kernel"].sharding.spec == P("replica", "fsdp", None)
  assert params["Dense_2"]["bias"].sharding.spec == P("replica")  # 10 % 4 != 0
  anchor = run.initial.opt_state.anchor
  assert anchor["Dense_0"]["kernel"].sharding.spec == P("replica", "fsdp", None)
  before = [x.sharding for x in jax.tree.leaves((params, run.initial.opt_state))]
  for hint, compiled in run._steps.items():
    inputs = jax.tree.leaves(compiled.input_shardings[0][:2])
    outputs = jax.tree.leaves(compiled.output_shardings[:2])
    assert [o.spec for o in outputs] == [i.spec for i in inputs] == [b.spec for b in before], hint
  state, _ = run.step(run.initial, 1)
  after = [x.sharding for x in jax.tree.leaves((state.params, state.opt_state))]
  assert after == before


def test_with_data_groups_the_state_is_split_over_them_and_crosses_once_per_replica(
    trainings, digits):
  """``fsdp=2`` over a replica's 4 devices (2 data groups): the state's param-shaped leaves are
  split over all 4 devices where a dimension divides, so DiLoCo's sync sends each device's
  quarter across the replicas (each byte once per replica; with the state on the params' layout
  each data group sent the same half); the run trains the per-device step's model."""
  per_device, per_device_final = trainings("diloco", None)
  global_view, global_final = trainings("diloco", 2)
  first = jax.tree.map(lambda x: x[::WORKERS // REPLICAS], per_device_final["params"])
  chex.assert_trees_all_close(global_final["params"], first, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(global_view["history"]["train_loss"][1:],
                             per_device["history"]["train_loss"][1:], rtol=RTOL)
  task, data = digits
  example = tuple((k, (1,) + v.shape[1:], str(v.dtype)) for k, v in data.train.items())
  devices = WORKERS // REPLICAS  # a replica's: fsdp 2 x 2 data groups
  # Each leaf's bytes over the most of a replica's devices (4, the 2 of fsdp, 1) that divide one
  # of its dimensions: the (10,) bias of the last layer is split over 2.
  split = sum(p.nbytes // next(n for n in (devices, 2, 1) if any(d % n == 0 for d in p.shape))
              for p in jax.tree.leaves(runs.initial_params(task, 0, example)))
  steps = {kind: step["unconditional"]["replica"]
           for kind, step in global_view["collective_bytes"].items()}
  assert steps["communication_step"] - steps["non_communication_step"] == split


def test_resume_restores_onto_the_mesh(digits, trainings, tmp_path):
  task, data = digits
  _, uninterrupted = trainings("diloco", K)  # the uninterrupted run of test_fsdp_trains_...[diloco]

  class Stopped(Exception):
    pass

  def stop(step):
    if step == 4:
      raise Stopped

  with pytest.raises(Stopped):
    trainer.train(task, data, settings("diloco", K), on_step=stop, checkpoint_dir=str(tmp_path),
                  checkpoint_every=3)
  result = trainer.train(task, data, settings("diloco", K), checkpoint_dir=str(tmp_path),
                         checkpoint_every=3, resume=True, keep_state=True)
  assert result["resumed_from_step"] == 3
  chex.assert_trees_all_close(result["final_state"], uninterrupted, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fsdp, match", [
  (3, r"argument --fsdp: must divide the devices of a replica \(.* = 4\), got 3"),
  (8, r"argument --fsdp: must divide the devices of a replica \(.* = 4\), got 8"),
  (0, r"argument --fsdp: must divide the devices of a replica \(.* = 4\), got 0"),
])
def test_a_bad_fsdp_raises(digits, fsdp, match):
  with pytest.raises(ValueError, match=match):
    trainer.train(*digits, settings("sync", fsdp))


def test_stale_gradients_are_refused_on_the_global_view(digits):
  with pytest.raises(ValueError, match=r"argument --fsdp: drop_stale_gradients does not run on"
                     r" the global view"):
    trainer.train(*digits, settings("drop_stale_gradients", K))


@pytest.mark.parametrize("args, message", [
  (["--fsdp", "3"], "argument --fsdp: must divide the devices of a replica (--processes x"
   " --devices / --replicas = 4), got 3"),
  (["--fsdp", "0"], "argument --fsdp: must be a positive integer, got 0"),
  (["--fsdp", "2", "--algorithm", "drop_stale_gradients"],
   "argument --fsdp: drop_stale_gradients does not run on the global view"),
])
def test_bad_fsdp_on_the_command_line(args, message, tmp_path, capsys):
  argv = ["train", "--devices", "8", "--replicas", "2", "--out", str(tmp_path), *args]
  try:
    status = main.main(argv)
  except SystemExit as e:  # argparse's own checks
    status = e.code
  assert status == 2
  assert message in capsys.readouterr().err


def test_resume_onto_another_number_of_devices_says_it_resized(tmp_path, capsys):
  """The global view's state is per replica: 2 replicas of 2 devices resume as 2 replicas of 4
  (two data groups each), restored onto the new mesh as it is, and the command says so."""
  out = tmp_path / "out"
  # On 8 devices the run of trainings("diloco", 2): its programs are in the compilation cache.
  argv = ["train", "--algorithm", "diloco", "--replicas", "2", "--fsdp", "2", "--steps", "6",
          "--sync-period", "3", "--batch-size", str(BATCH), "--checkpoint-every", "3",
          "--no-progress", "--out", str(out)]
  assert len(jax.devices()) == 8  # the backend started: the command's --devices leave it be
  assert main.main([*argv, "--devices", "4"]) == 0
  checkpoints = out / "checkpoints" / "diloco"
  shutil.rmtree(checkpoints / "6")  # resume from step 3
  capsys.readouterr()
  assert main.main([*argv, "--devices", "8", "--resume"]) == 0
  stdout = capsys.readouterr().out
  assert "diloco: resumed from the checkpoint of step 3" in stdout
  assert ("diloco: resized from 4 to 8 workers at step 3 (the global view: the 2 replicas' state"
          " restored onto the new mesh)") in stdout
  result = json.loads((out / "results_diloco.json").read_text())["algorithms"]["diloco"]
  assert result["resized"] == {"step": 3, "from_workers": 4, "to_workers": 8}
  assert result["devices"] == 8 and result["history"]["step"][-1] == 6
