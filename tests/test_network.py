"""Two ``optax-dist train`` processes in two network namespaces, over a veth pair shaped by tbf.

Runs as root with iproute2 (``benchmarks/network/netns.py``); skipped with the reason otherwise.
Each run is the command as ``make bench-network`` starts it: process 0 and the coordinator in one
namespace, process 1 in the other, so every byte the processes exchange crosses the veth pair.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("flax")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from benchmarks.network import netns  # noqa: E402
from benchmarks.studies import network as bench_network  # noqa: E402

REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

RATE = "100mbit"
STEPS, PERIOD = 6, 3


def link(rate: str | None = RATE) -> netns.Link:
  """A :class:`netns.Link`, or the test skipped when namespaces cannot be made here."""
  try:
    return netns.Link(rate).__enter__()
  except netns.Unavailable as e:
    pytest.skip(str(e))


def gone(names) -> bool:
  left = set(netns.namespaces())
  return not left & set(names) and not any(os.path.exists(f"/etc/netns/{n}") for n in names)


@pytest.mark.slow
def test_diloco_and_sync_over_a_shaped_link(tmp_path):
  net = link()
  names = list(net.names.values())
  try:
    assert os.path.exists(f"/etc/netns/{names[0]}/hosts")
    rate = net.measure_rate("b", nbytes=1 << 20)
    runs = {algorithm: bench_network.run_once(
      net, algorithm, 12000 + k, str(tmp_path / algorithm), steps=STEPS, period=PERIOD,
      extra=["--replicas", "2"])
      for k, algorithm in enumerate(("diloco", "sync"))}
  finally:
    net.close()
  assert gone(names), netns.namespaces()
  # tbf holds the link to its rate (a burst of up to 32 KiB passes at full speed).
  assert 50e6 < rate < 150e6, rate
  params = bench_network.param_bytes()
  diloco, sync = runs["diloco"], runs["sync"]
  # Both processes finished (run_once raises otherwise) and process 0 wrote every step's time.
  for run in runs.values():
    assert run["steps"] == STEPS and len(run["step_times"]) == STEPS
    assert run["replicas"] == 2
    assert run["bits_per_byte"] < run["curve"]["bits_per_byte"][0]
  assert diloco["communication_rounds"] == STEPS // PERIOD and sync["communication_rounds"] == STEPS
  for run in runs.values():
    # One replica per process: an exchange (every sync step, DiLoCo's syncs) sends each device's
    # 1/4 slice across, the params' bytes once (padded to multiples of 4 values) each way...
    per_exchange = run["operand_bytes"] / run["communication_rounds"] / params
    assert 1.0 <= per_exchange < 1.002, (run["algorithm"], per_exchange)
    # ...and the veth carried that with gloo's framing (576 bytes per operand), plus the
    # start-up's, the evaluations' and the coordination service's traffic (under 1 MB).
    for side in "ab":
      sent = bench_network.payload(run, side)
      assert run["predicted_bytes"] <= sent <= 1.01 * run["predicted_bytes"] + (1 << 20), (
        run["algorithm"], side, sent, run["predicted_bytes"])
  # sync exchanges on each of the 6 steps, diloco on 2: about three times the bytes.
  ratio = sync["bytes_a_to_b"] / diloco["bytes_a_to_b"]
  assert 2 < ratio < 4, ratio
  assert diloco["exchange_step_s"] > diloco["local_step_s"]


def test_namespaces_removed_on_an_error():
  names = []
  with pytest.raises(ZeroDivisionError):
    try:
      with netns.Link() as net:
        names = list(net.names.values())
        assert set(names) <= set(netns.namespaces())
        1 / 0
    except netns.Unavailable as e:
      pytest.skip(str(e))
  assert names and gone(names), netns.namespaces()
