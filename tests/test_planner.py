"""optax_dist.planner: the Streaming DiLoCo paper's bandwidth table, the model's analytic
properties, its errors, and the ``optax-dist plan`` subcommand run in-process."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest

from optax_dist import planner
from optax_dist.cli import plan as plan_cli
from optax_dist.planner import METHODS, plan, required_bandwidth

GBIT = 1e9

# Douillard et al. 2025 (arXiv 2501.18512), the table of the bandwidth (Gbit/s) each method needs
# for a 1B-parameter model at 95% compute utilization. The simulation's assumptions, as recovered
# (docs/planner.md): bf16 exchanges (16 bits), 4 bits for the quantized row; 2 replicas; a step of
# 0.1 s; H = 100; F = 8 fragments (3 of the 24 layers each); tau = 1; no latency; every reduction
# overlapped with the backward pass, 2/3 of the step.
PAPER_1B = dict(num_params=1e9, step_time=0.1, latency=0.0, sync_period=100, num_fragments=8,
                overlap=1, num_replicas=2, backward_overlap=2 / 3, target_utilization=0.95)
PAPER_GBITS = {
  ("sync", 16): 222.3,
  ("diloco", 16): 23.3,
  ("streaming_diloco", 16): 16.0,
  ("streaming_diloco_overlap", 16): 9.1,
  ("streaming_diloco_overlap", 4): 2.0,
}
MATCHED = [key for key in PAPER_GBITS if key != ("diloco", 16)]


def _needed(method: str, bits: float, **changes) -> float:
  kwargs = dict(PAPER_1B, bits=bits, methods=(method,)) | changes
  return required_bandwidth(**kwargs)[method] / GBIT


@pytest.mark.parametrize("method,bits", MATCHED, ids=lambda v: str(v))
def test_paper_table_within_ten_percent(method, bits):
  ours, paper = _needed(method, bits), PAPER_GBITS[method, bits]
  assert ours == pytest.approx(paper, rel=0.10), (method, bits, ours, paper)


def test_paper_diloco_figure_is_matched_only_with_one_step_of_overlap():
  """The documented gap: the paper's DiLoCo row (23.3 Gbit/s) needs 16% less than a blocking
  DiLoCo in this model (27.0). It is what one step of overlap gives (23.1): the paper's simulation
  seems to let DiLoCo's exchange run beside one more step, which blocking DiLoCo cannot do."""
  paper = PAPER_GBITS["diloco", 16]
  blocking = _needed("diloco", 16)
  assert 1.10 < blocking / paper < 1.20, blocking
  # DiLoCo with tau = 1: one fragment (F = 1) of streaming_diloco_overlap.
  overlapped = _needed("streaming_diloco_overlap", 16, num_fragments=1)
  assert overlapped == pytest.approx(paper, rel=0.02), overlapped


def test_paper_utilization_at_table_bandwidth():
  """At the paper's bandwidths each matched method runs at 95% give or take the 10%."""
  for (method, bits), gbits in PAPER_GBITS.items():
    if (method, bits) not in MATCHED:
      continue
    kwargs = {k: v for k, v in PAPER_1B.items() if k != "target_utilization"}
    p = plan(bandwidth=gbits * GBIT, bits=bits, methods=(method,), **kwargs)[method]
    assert 0.93 < p.utilization < 0.97, (method, bits, p.utilization)


# ------------------------------------------------------------------------------------------
# The model, line by line.

BASE = dict(num_params=1e9, step_time=0.5, sync_period=100, num_fragments=4, overlap=2, bits=32,
            num_replicas=4)


def test_infinite_bandwidth_gives_utilization_one():
  for p in plan(bandwidth=math.inf, **BASE).values():
    assert (p.exchange_time, p.stall_time, p.utilization, p.wall_time) == (0.0, 0.0, 1.0, 0.5)


def test_doubling_bandwidth_halves_the_exchange_time():
  slow, fast = plan(bandwidth=1e9, **BASE), plan(bandwidth=2e9, **BASE)
  for m in METHODS:
    assert fast[m].exchange_time == pytest.approx(slow[m].exchange_time / 2, rel=1e-12)


def test_ring_all_reduce_bytes_and_time():
  """Each replica sends 2 (M - 1) / M * B bytes; the time adds 2 (M - 1) latencies."""
  for m in (1, 2, 3, 8):
    got = plan(bandwidth=1e9, latency=0.01, **(BASE | dict(num_replicas=m)))
    payload = {"sync": 4e9, "diloco": 4e9, "streaming_diloco": 1e9,
               "streaming_diloco_overlap": 1e9}  # bytes: 32-bit values, F = 4
    for method, p in got.items():
      sent = 2 * (m - 1) / m * payload[method]
      assert p.exchange_bytes == pytest.approx(sent, rel=1e-12)
      assert p.exchange_time == pytest.approx(sent * 8 / 1e9 + 2 * (m - 1) * 0.01, rel=1e-12)


def test_one_replica_sends_nothing():
  for p in plan(bandwidth=1.0, latency=1.0, **(BASE | dict(num_replicas=1))).values():
    assert (p.exchange_bytes, p.utilization) == (0.0, 1.0)
  assert set(required_bandwidth(**(BASE | dict(num_replicas=1))).values()) == {0.0}


def test_bits_scale_the_bytes():
  full, quarter = plan(bandwidth=1e9, **BASE), plan(bandwidth=1e9, **(BASE | dict(bits=8)))
  for m in METHODS:
    assert quarter[m].exchange_bytes == pytest.approx(full[m].exchange_bytes / 4, rel=1e-12)


def test_periods_and_bytes_per_step():
  """sync every step; diloco every H; a streaming fragment (1/F) every H/F: the same bytes per
  step as diloco, F times smaller exchanges."""
  got = plan(bandwidth=1e9, **BASE)
  assert [got[m].period for m in METHODS] == [1.0, 100.0, 25.0, 25.0]
  assert got["sync"].bytes_per_step == got["sync"].exchange_bytes
  assert got["diloco"].bytes_per_step == pytest.approx(got["diloco"].exchange_bytes / 100)
  assert got["streaming_diloco"].exchange_bytes == pytest.approx(
    got["diloco"].exchange_bytes / 4)
  assert got["streaming_diloco"].bytes_per_step == pytest.approx(got["diloco"].bytes_per_step)


def test_blocking_methods_stall_for_the_whole_exchange():
  got = plan(bandwidth=1e9, **BASE)
  for m in ("sync", "diloco", "streaming_diloco"):
    p = got[m]
    assert p.stall_time == p.exchange_time
    assert p.wall_time == pytest.approx(0.5 + p.exchange_time / p.period, rel=1e-12)
    assert p.utilization == pytest.approx(0.5 / p.wall_time, rel=1e-12)


def test_overlap_hides_exactly_tau_steps():
  """Only the part of the exchange beyond tau * step_time stalls."""
  for tau in (0, 1, 2, 3):
    kwargs = BASE | dict(overlap=tau)
    p = plan(bandwidth=1e9, **kwargs)["streaming_diloco_overlap"]  # exchange: 12 s
    blocking = plan(bandwidth=1e9, **kwargs)["streaming_diloco"]
    assert p.exchange_time == blocking.exchange_time == pytest.approx(12.0)
    assert p.stall_time == pytest.approx(12.0 - tau * 0.5, rel=1e-12)
  fast = plan(bandwidth=1e11, **BASE)["streaming_diloco_overlap"]  # 0.12 s < 2 * 0.5 s
  assert fast.stall_time == 0.0 and fast.utilization == 1.0


def test_backward_overlap_hides_that_fraction_of_the_step():
  for beta in (0.0, 0.25, 2 / 3, 1.0):
    p = plan(bandwidth=1e11, backward_overlap=beta, **BASE)["sync"]  # exchange: 0.48 s
    assert p.exchange_time == pytest.approx(0.48)
    assert p.stall_time == pytest.approx(max(0.0, 0.48 - beta * 0.5), abs=1e-12)


def test_hidden_window_never_exceeds_the_period():
  """The link carries one exchange at a time: with tau beyond H/F, the period bounds what hides."""
  kwargs = BASE | dict(sync_period=8, num_fragments=4, overlap=5)  # period 2 steps = 1 s
  p = plan(bandwidth=1e9, **kwargs)["streaming_diloco_overlap"]  # exchange: 12 s
  assert p.stall_time == pytest.approx(12.0 - 2 * 0.5)


@pytest.mark.parametrize("latency", [0.0, 0.003])
@pytest.mark.parametrize("target", [0.5, 0.9, 0.95, 0.99, 1.0])
@pytest.mark.parametrize("beta", [0.0, 2 / 3])
def test_required_bandwidth_reaches_the_target(latency, target, beta):
  kwargs = BASE | dict(latency=latency, backward_overlap=beta)
  needed = required_bandwidth(target_utilization=target, **kwargs)
  for method, w in needed.items():
    if math.isinf(w):  # no finite bandwidth reaches the target (latency, or 100% unhidden)
      free = plan(bandwidth=math.inf, methods=(method,), **kwargs)[method]
      fast = plan(bandwidth=1e15, methods=(method,), **kwargs)[method]
      assert free.utilization <= target and fast.utilization < target
      continue
    p = plan(bandwidth=w, methods=(method,), **kwargs)[method]
    assert p.utilization == pytest.approx(target, rel=1e-9), (method, w)
    if target < 1.0:  # and it is the smallest such bandwidth
      slower = plan(bandwidth=w * 0.99, methods=(method,), **kwargs)[method]
      assert slower.utilization < target


def test_required_bandwidth_is_infinite_when_latency_alone_stalls():
  kwargs = BASE | dict(latency=1.0)  # 6 latencies: 6 s, more than 5% of a 0.5 s step hides
  assert required_bandwidth(methods=("sync",), **kwargs) == {"sync": math.inf}


def test_method_plan_is_frozen():
  p = plan(bandwidth=1e9, methods=("sync",), **BASE)["sync"]
  with pytest.raises(dataclasses.FrozenInstanceError):
    p.utilization = 1.0


@pytest.mark.parametrize("change,message", [
  (dict(num_params=0), "`plan(num_params=...)` must be a positive finite number, got 0."),
  (dict(step_time=-1.0), "`plan(step_time=...)` must be a positive finite number, got -1.0."),
  (dict(bits=math.inf), "`plan(bits=...)` must be a positive finite number, got inf."),
  (dict(bandwidth=0.0), "`plan(bandwidth=...)` must be a positive number of bit/s (math.inf"
   " allowed), got 0.0."),
  (dict(bandwidth=math.nan), "`plan(bandwidth=...)` must be a positive number of bit/s"),
  (dict(latency=-0.1), "`plan(latency=...)` must be a finite number of seconds >= 0, got -0.1."),
  (dict(sync_period=0), "`plan(sync_period=...)` must be a positive int, got 0."),
  (dict(sync_period=2.5), "`plan(sync_period=...)` must be a positive int, got 2.5."),
  (dict(num_fragments=True), "`plan(num_fragments=...)` must be a positive int, got True."),
  (dict(num_replicas=0), "`plan(num_replicas=...)` must be a positive int, got 0."),
  (dict(overlap=-1), "`plan(overlap=...)` must be an int >= 0 (inner steps), got -1."),
  (dict(backward_overlap=1.5), "`plan(backward_overlap=...)` must be a fraction of the step in"
   " [0, 1], got 1.5."),
  (dict(methods=("sync", "dilocco")), "`plan(methods=...)` must be distinct names among sync,"
   " diloco, streaming_diloco, streaming_diloco_overlap, got ('sync', 'dilocco')."),
  (dict(methods=("sync", "sync")), "`plan(methods=...)` must be distinct names among"),
  (dict(methods=()), "`plan(methods=...)` must be distinct names among"),
])
def test_plan_errors(change, message):
  kwargs = BASE | dict(bandwidth=1e9) | change
  with pytest.raises(ValueError) as info:
    plan(**kwargs)
  assert str(info.value).startswith(message)


@pytest.mark.parametrize("target", [0.0, 1.5, math.nan, True])
def test_required_bandwidth_errors(target):
  with pytest.raises(ValueError, match=r"`required_bandwidth\(target_utilization=...\)` must be"
                     r" in \(0, 1\], got"):
    required_bandwidth(target_utilization=target, **BASE)
  with pytest.raises(ValueError, match=r"`required_bandwidth\(step_time=...\)`"):
    required_bandwidth(**(BASE | dict(step_time=0)))


def test_planner_is_not_in_the_package_namespace():
  import optax_dist

  assert "plan" not in optax_dist.__all__ and "planner" not in optax_dist.__all__
  assert planner.__all__ == ["METHODS", "MethodPlan", "plan", "required_bandwidth"]


# ------------------------------------------------------------------------------------------
# optax-dist plan, in-process.


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="optax-dist")
  plan_cli.add_parser(parser.add_subparsers(dest="command", required=True))
  return parser


@pytest.mark.parametrize("text,bits_per_second", [
  ("10Mbit", 1e7), ("1Gbit", 1e9), ("222Gbit", 222e9), ("222Gbit/s", 222e9), ("25Gbps", 25e9),
  ("1.5Tbit", 1.5e12), ("1e9", 1e9), ("800 kbit", 8e5),
])
def test_bandwidth_units(text, bits_per_second):
  assert plan_cli.bandwidth(text) == pytest.approx(bits_per_second)


@pytest.mark.parametrize("text", ["10GB", "fast", "0Gbit", "-1Gbit", "1Xbit", "nan", "inf"])
def test_bandwidth_units_refused(text):
  with pytest.raises(argparse.ArgumentTypeError, match="must be a bandwidth in bit/s"):
    plan_cli.bandwidth(text)


def test_params_and_latency_units():
  args = _parser().parse_args(["plan", "--params", "1.3B", "--step-time", "250ms",
                               "--bandwidth", "1Gbit", "--latency", "50ms"])
  assert (args.params, args.step_time, args.latency) == (pytest.approx(1.3e9), 0.25, 0.05)
  assert plan_cli.params("350M") == 350e6 and plan_cli.params("1e9") == 1e9


def test_run_prints_the_paper_setting(capsys):
  args = _parser().parse_args([
    "plan", "--params", "1B", "--step-time", "0.1", "--bandwidth", "222Gbit", "--bits", "16",
    "--replicas", "2", "--sync-period", "100", "--num-fragments", "8", "--overlap", "1",
    "--backward-overlap", str(2 / 3), "--target-utilization", "0.95",
  ])
  assert plan_cli.run(args) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[1].split()[:2] == ["method", "bytes/step"] and out[1].endswith("bandwidth for 95%")
  rows = {line.split()[0]: line.split() for line in out[3:]}
  assert list(rows) == list(METHODS)
  assert rows["sync"][1:3] == ["2", "GB"]  # bf16 gradients of 1B params, each step
  assert rows["sync"][-2:] == ["222.4", "Gbit/s"]
  assert rows["streaming_diloco_overlap"][-2:] == ["8.604", "Gbit/s"]
  expected = plan(bandwidth=222e9, bits=16, **{k: v for k, v in PAPER_1B.items()
                                                if k != "target_utilization"})
  assert rows["sync"][-3] == f"{expected['sync'].utilization:.1%}"


def test_run_reports_an_unreachable_target(capsys):
  args = _parser().parse_args(["plan", "--params", "1e9", "--step-time", "0.1", "--bandwidth",
                               "10Gbit", "--latency", "1", "--target-utilization", "1"])
  assert plan_cli.run(args) == 0
  rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[3:]}
  assert rows["sync"].endswith("unreachable")


@pytest.mark.parametrize("argv,message", [
  (["--bandwidth", "10GB"], "argument --bandwidth: must be a bandwidth in bit/s"),
  (["--overlap", "-1"], "argument --overlap: must be an integer >= 0, got -1"),
  (["--target-utilization", "0"], "argument --target-utilization: must be a number in (0, 1]"),
  (["--replicas", "0"], "argument --replicas: must be a positive integer, got 0"),
])
def test_parser_refuses_bad_values(argv, message, capsys):
  base = ["plan", "--params", "1B", "--step-time", "0.1", "--bandwidth", "1Gbit"]
  with pytest.raises(SystemExit) as info:
    _parser().parse_args(base + argv)
  assert info.value.code == 2
  assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# The library's own rules: the settings streaming_diloco refuses are refused here too.


def _library_error(**kwargs) -> str:
  import optax

  import optax_dist

  with pytest.raises(ValueError) as info:
    optax_dist.streaming_diloco(optax.sgd(0.1), **kwargs)
  return str(info.value)


@pytest.mark.parametrize("overlap", [100, 200])
def test_plan_refuses_an_overlap_the_library_refuses(overlap):
  library = _library_error(sync_period=100, num_fragments=4, overlap=overlap)
  for fn in (plan, required_bandwidth):
    extra = dict(bandwidth=1e9) if fn is plan else {}
    with pytest.raises(ValueError) as info:
      fn(**(BASE | dict(overlap=overlap) | extra))
    assert str(info.value) == f"`{fn.__name__}(overlap=...)`: {library}"
  assert plan(bandwidth=1e9, **(BASE | dict(overlap=99)))  # the largest overlap below H


def test_run_refuses_an_overlap_the_library_refuses_naming_the_flag(capsys):
  args = _parser().parse_args(["plan", "--params", "1B", "--step-time", "0.1", "--bandwidth",
                               "1Gbit", "--sync-period", "100", "--overlap", "200"])
  assert plan_cli.run(args) == 2
  out, err = capsys.readouterr()
  library = _library_error(sync_period=100, num_fragments=1, overlap=200)
  assert out == "" and err == f"optax-dist: error: argument --overlap: {library}\n"
