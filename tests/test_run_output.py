"""What ``optax-dist train`` and ``compare`` say about a run: the exchange in the header, the
plot's title and the results' ``config``; the bytes sent across replicas per step in the table;
each phase of the run (building the model, compiling, evaluating) on stderr as it runs."""

from __future__ import annotations

import json
import pathlib

import jax
import pytest

import optax_dist

pytest.importorskip("flax")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from optax_dist.cli import reports  # noqa: E402
from optax_dist.cli.algorithms import COMPARED  # noqa: E402
from optax_dist.cli.config import Settings, settings_of  # noqa: E402
from optax_dist.cli.main import build_parser, main  # noqa: E402
from optax_dist.cli.tasks import TASKS  # noqa: E402

EXCHANGES = {
  "diloco, 4-bit blocks of 64, error feedback": (
    ["train", "--algorithm", "diloco", "--comm-dtype", "float4_e2m1fn", "--comm-block-size", "64",
     "--error-feedback"],
    {"comm_dtype": "float4_e2m1fn", "comm_block_size": 64, "error_feedback": True},
    "exchange float4_e2m1fn in blocks of 64, error feedback"),
  "streaming_diloco, overlap, eager, mixing": (
    ["train", "--algorithm", "streaming_diloco", "--sync-period", "10", "--overlap", "2",
     "--eager", "--mixing", "0.5"],
    {"comm_dtype": "float32", "overlap": 2, "eager": True, "mixing": 0.5},
    "exchange float32, overlap 2, eager, mixing 0.5"),
  "local_sgd in int8, the default blocks": (
    ["train", "--algorithm", "local_sgd", "--comm-dtype", "int8"],
    {"comm_dtype": "int8", "comm_block_size": 256}, "exchange int8 in blocks of 256"),
  "compare in bfloat16": (["compare", "--comm-dtype", "bfloat16"], {"comm_dtype": "bfloat16"},
                          "exchange bfloat16"),
  "sync, the defaults": (["train"], {"comm_dtype": "float32"}, "exchange float32"),
}


@pytest.mark.parametrize("case", EXCHANGES)
def test_header_title_and_config_say_the_exchange(case):
  """Only the options that apply: the block size with a block-quantized format, the others when
  set; the same for ``train`` and ``compare``."""
  flags, described, words = EXCHANGES[case]
  args = build_parser().parse_args(flags)
  task = TASKS["digits"]
  settings = settings_of(args, task)
  algorithms = COMPARED if args.command == "compare" else (args.algorithm,)
  data = task.load(0)
  assert reports.training_config(args, task, data, settings, algorithms)["exchange"] == described
  assert f"; {words}; seed 0" in reports.training_summary(args, task, settings, algorithms)
  assert reports.training_title(task, settings, algorithms).splitlines()[1] == words


def _result(algorithm, collectives):
  return {"algorithm": algorithm, "collective_bytes": {
    kind: {"unconditional": unconditional, "conditional": conditional}
    for kind, (unconditional, conditional) in collectives.items()}}


def test_bytes_per_step_in_one_unit():
  """sync sends 1,500,000 bytes on every step; diloco 1,500,004 on its sync step (step 4) and
  4 (the loss' mean) on the others: per step 1.43 and 0.358 MiB."""
  settings = Settings(devices=4, steps=4, sync_period=4).resolved()
  results = [
    _result("sync", {"every_step": ({"workers": 1_500_000}, [])}),
    _result("diloco", {"communication_step": ({"workers": 1_500_004}, []),
                          "non_communication_step": ({"workers": 4}, [])}),
  ]
  assert reports.sent_column(results, settings) == ("sent per worker (MiB/step)",
                                                    ["1.43", "0.358"])
  small = [_result("sync", {"every_step": ({"workers": 12}, [])})]
  assert reports.sent_column(small, settings) == ("sent per worker (B/step)", ["12"])


def test_bytes_across_replicas_only():
  """streaming_diloco over 2 replicas of 2 devices, 2 fragments synced in turn (steps 2, 4, 6,
  8 of 8): each device sends its slice of one fragment across the replicas (100 or 300 bytes,
  the mean 200), so a replica sends 2 x 200 on each of 4 steps; the bytes within a replica
  ("data") are left out. With an exchange device the steps send nothing across and one
  exchange program per replica sends 1,000 or 3,000 bytes on each of those steps."""
  s = Settings(algorithm="streaming_diloco", devices=4, replicas=2, steps=8, sync_period=4,
               num_fragments=2).resolved()
  syncs = [t for t in range(1, 9) if optax_dist.streaming_diloco_syncs(
    t, sync_period=4, num_fragments=2)]
  assert len(syncs) == 4
  in_step = _result("streaming_diloco", {
    "communication_step": ({"data": 50}, [{"replica": 100, "data": 100},
                                          {"replica": 300, "data": 300}]),
    "non_communication_step": ({"data": 50}, [])})
  assert reports.sent_per_step(in_step, s) == 4 * 2 * 200 / 8
  on_device = _result("streaming_diloco", {
    "communication_step": ({"data": 50}, []), "non_communication_step": ({"data": 50}, []),
    "exchange": ({}, [{"replica": 1000}, {"replica": 3000}])})
  assert reports.sent_per_step(on_device, s) == 4 * 2000 / 8
  header, _ = reports.sent_column([in_step], s)
  assert header == "sent per replica (B/step)"


def test_a_phase_shows_while_it_runs(capsys):
  from optax_dist.cli.progress import Progress

  with Progress("diloco", enabled=True).phase("compiling the step"):
    pass
  assert "diloco: compiling the step… 00:00" in capsys.readouterr().err
  with Progress("diloco", enabled=False).phase("compiling the step"):
    pass
  assert capsys.readouterr().err == ""


def test_a_run_says_what_it_exchanges_and_each_phase(tmp_path, capsys, monkeypatch):
  """A 2-step digits run of diloco over 2 workers in 4-bit blocks of 64 with error feedback,
  in process: stderr starts with the header, then each phase; stdout's table has the bytes
  per step that the results' collective_bytes give."""
  jax.devices()  # JAX starts with conftest's 8 devices, not the 2 the command asks for
  titles = []
  plot = reports.plot_accuracy
  monkeypatch.setattr(reports, "plot_accuracy",
                      lambda results, path, title, **kw: (titles.append(title),
                                                          plot(results, path, title, **kw)))
  flags = ["--algorithm", "diloco", "--comm-dtype", "float4_e2m1fn", "--comm-block-size", "64",
           "--error-feedback", "--steps", "2", "--sync-period", "2", "--eval-every", "2",
           "--devices", "2", "--batch-size", "8", "--out", str(tmp_path)]
  capsys.readouterr()
  assert main(["train", *flags]) == 0
  out, err = capsys.readouterr()
  words = "exchange float4_e2m1fn in blocks of 64, error feedback"
  assert err.startswith("digits, ") and f"; {words}; seed 0\n" in err.splitlines(True)[0]
  for phase in ("diloco: building the model…", "diloco: compiling the step and the exchange…",
                "diloco: compiling the evaluation…",
                "diloco: evaluating at step 0…", "diloco, final evaluation:",
                "optax-dist: writing the results and the plot…"):
    assert phase in err, phase
  assert titles[0].splitlines()[1] == words
  results = json.loads((tmp_path / "results_diloco.json").read_text())
  assert results["config"]["exchange"] == {"comm_dtype": "float4_e2m1fn", "comm_block_size": 64,
                                           "error_feedback": True}
  steps = results["algorithms"]["diloco"]["collective_bytes"]
  sent = (steps["communication_step"]["unconditional"]["workers"]
          + steps["non_communication_step"]["unconditional"]["workers"]) / 2  # steps 2 and 1
  lines = out.splitlines()
  assert lines[0] == err.splitlines()[0]  # the header again, above the table
  header = lines[1].split("  ")
  row = dict(zip([h.strip() for h in header if h], lines[3].split(), strict=True))
  assert 1000 < sent < 1000 * 1024  # shown in KiB, 3 significant digits
  assert row["sent per worker (KiB/step)"] == f"{sent / 1024:.3g}"


README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_first_screen_says_where_the_methods_pay():
  """The first 30 lines quote the Results section's 10 Mbit/s rows: DiLoCo's and streaming
  DiLoCo's speed-up over sync to the target loss, and the seconds it took each."""
  lines = README.read_text().splitlines()
  header = next(line for line in lines if line.startswith("| link | method |"))
  columns = [c.strip() for c in header.strip("|").split("|")]
  rows = {}
  for line in lines:
    if line.startswith("| 10 Mbit/s |"):
      cells = dict(zip(columns, (c.strip() for c in line.strip("|").split("|")), strict=True))
      rows[cells["method"].split()[0]] = cells
  seconds = next(c for c in columns if c.startswith("s to "))
  target = seconds.removeprefix("s to ")
  first = " ".join(lines[:30])
  diloco, streaming, sync = rows["diloco"], rows["streaming_diloco"], rows["sync"]
  assert (f"reach the target loss ({target} bits/byte) {diloco['vs sync']}× and"
          f" {streaming['vs sync']}× sooner than synchronous data parallelism") in first
  assert (f"({diloco[seconds]} s and {streaming[seconds]} s of training against {sync[seconds]}"
          " s; [Results](#results))") in first
  assert "## Results" in lines
