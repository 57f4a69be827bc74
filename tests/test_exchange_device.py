"""``--exchange-device``: streaming_diloco's exchanges across replicas on an extra device per
process, outside the step, give the in-step route's params; the combinations it does not take are
one-line errors.

The runs are small (``--task digits``, 12 steps, H = 4, F = 2: fragment 0 sends on steps 2, 6, 10,
fragment 1 on 4, 8, 12; τ = 2): two processes with ``--exchange-device`` and, meanwhile, the
exchange inside the step (the reference, in the test's process); then two processes interrupted
after a checkpoint taken with an exchange in flight, then resumed, which read the first run's
programs from the compilation cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")
pytest.importorskip("orbax.checkpoint")

from optax_dist.cli.checks import check_settings  # noqa: E402
from optax_dist.cli.config import settings_of  # noqa: E402
from optax_dist.cli.main import build_parser, main  # noqa: E402
from optax_dist.cli.tasks import TASKS  # noqa: E402

ARGS = ["train", "--task", "digits", "--algorithm", "streaming_diloco", "--steps", "12",
        "--sync-period", "4", "--num-fragments", "2", "--replicas", "2", "--eval-every", "12",
        "--no-progress"]
TWO_PROCESSES = ["--processes", "2", "--devices", "2", "--exchange-device"]
ONE_PROCESS = ["--devices", "4"]  # the in-step route: the same numbers as two processes
# Fragment 0 (sent on 2) lands on 4, fragment 1's send step, and fragment 1 (sent on 4) on 6,
# fragment 0's; at the end fragment 1's exchange of step 12 is still in flight.
OVERLAP = ["--overlap", "2"]
# The checkpoint of step 5 is written with fragment 1's exchange of step 4 in flight; process 1
# then fails at step 7, and the resumed run lands that exchange on step 6.
INTERRUPTED = ["--checkpoint-every", "5", "--fail-at-step", "7"]
RESUMED = ["--checkpoint-every", "5", "--resume"]


def _start(out, *args) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, "-m", "optax_dist.cli", *ARGS, *OVERLAP, *args, "--out", str(out),
     "--save-params", str(out) + ".npz"],
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, returncode: int = 0) -> None:
  _, stderr = proc.communicate(timeout=600)
  assert proc.returncode == returncode, stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("exchange_device")
  out = {name: str(root / name) for name in ("exchange", "in_step", "resumed")}
  started = [_start(out["exchange"], *TWO_PROCESSES)]
  try:
    # The reference runs in this process (its 8 devices, of which it takes 4) meanwhile.
    assert main([*ARGS, *OVERLAP, *ONE_PROCESS, "--out", out["in_step"],
                 "--save-params", out["in_step"] + ".npz"]) == 0
    _finish(started[0])
    # One after the other: the interrupted and resumed runs read the exchange run's programs
    # from the compilation cache instead of compiling them again beside it.
    for args, returncode in ((INTERRUPTED, 1), (RESUMED, 0)):
      started.append(_start(out["resumed"], *TWO_PROCESSES, *args))
      _finish(started[-1], returncode)
  finally:
    for proc in started:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return out


def _load(out: str) -> tuple[dict[str, np.ndarray], dict]:
  with np.load(out + ".npz") as f:
    arrays = {key: f[key] for key in f.files}
  with open(os.path.join(out, "results_streaming_diloco.json")) as f:
    return arrays, json.load(f)["algorithms"]["streaming_diloco"]


@pytest.mark.slow
@pytest.mark.parametrize("route", ["exchange", "resumed"])
def test_exchange_device_gives_the_in_step_route_s_params(runs, route):
  (exchanged, result), (in_step, reference) = _load(runs[route]), _load(runs["in_step"])
  assert set(exchanged) == set(in_step)
  assert any("in_flight" in key for key in exchanged)
  for key, value in in_step.items():  # params and the whole optimizer state, in_flight included
    np.testing.assert_allclose(exchanged[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
  assert result["test_accuracy_eval_params"] == pytest.approx(
    reference["test_accuracy_eval_params"], rel=1e-6)
  assert result["exchange_device"] is True and reference["exchange_device"] is False
  # The steps send nothing across the replicas; the exchange programs do, one per fragment.
  steps = result["collective_bytes"]
  for kind in ("communication_step", "non_communication_step"):
    spans = [*steps[kind]["unconditional"], *(a for c in steps[kind]["conditional"] for a in c)]
    assert not any("replica" in axes for axes in spans), (kind, spans)
  per_fragment = steps["exchange"]["conditional"]
  assert len(per_fragment) == 2 and all(c["replica"] > 0 for c in per_fragment)
  # As many bytes per replica as the in-step route's devices send together (each its slice).
  sliced = reference["collective_bytes"]["communication_step"]["conditional"]
  assert sum(c["replica"] for c in per_fragment) == 2 * sum(c["replica"] for c in sliced)


REFUSED = {
  "another algorithm": (["--algorithm", "diloco", "--processes", "2", "--replicas", "2"],
                        "argument --exchange-device: diloco does not take it (only"
                        " streaming_diloco), got --exchange-device"),
  "overlap 0": (["--processes", "2", "--replicas", "2"],
                "argument --exchange-device: needs --overlap >= 1"),
  "one replica": (["--processes", "2", "--overlap", "1"],
                  "argument --exchange-device: needs --replicas equal to --processes > 1 (one"
                  " replica per process, the exchange across them), got --replicas 1"),
  "fsdp": (["--processes", "2", "--devices", "4", "--replicas", "2", "--fsdp", "2",
            "--overlap", "1"],
           "argument --exchange-device: does not run on the global view"),
  "eager": (["--processes", "2", "--replicas", "2", "--overlap", "1", "--eager"],
            "argument --exchange-device: does not take --eager"),
  "quantized exchange": (["--processes", "2", "--replicas", "2", "--overlap", "1",
                          "--comm-dtype", "int8"],
                         "argument --comm-dtype: --exchange-device sends each fragment as one"
                         " float buffer"),
  # Checked with the processes: the command's, or train()'s jax.process_count().
  "replicas other than processes": (
    ["--processes", "2", "--devices", "4", "--replicas", "4", "--overlap", "1"],
    "argument --exchange-device: needs one replica per process and more than one process"
    " (--replicas equal to --processes > 1), got --replicas 4 with --processes 2"),
  "one process": (["--replicas", "2", "--overlap", "1"],
                  "argument --exchange-device: needs one replica per process and more than one"
                  " process (--replicas equal to --processes > 1), got --replicas 2 with"
                  " --processes 1"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_combinations_are_one_line_errors(case, tmp_path, capsys):
  flags, message = REFUSED[case]
  algorithm = [] if "--algorithm" in flags else ["--algorithm", "streaming_diloco"]
  argv = ["train", *algorithm, *flags, "--exchange-device"]
  assert main([*argv, "--out", str(tmp_path), "--no-progress"]) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  assert captured.err.startswith(f"optax-dist: error: {message}"), captured.err
  assert len(captured.err.strip().splitlines()) == 1
  if "--processes" in message:
    return
  with pytest.raises(ValueError, match="argument --"):  # train() refuses them too
    settings = settings_of(build_parser().parse_args(argv), TASKS["digits"])
    check_settings(settings, (settings.algorithm,), processes=2, train_examples=lambda: 1000)
