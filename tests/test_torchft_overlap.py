"""streaming_diloco with overlap tau over the torchft engine: each round's exchange runs on a
thread beside the replica's next tau - 1 inner steps and is joined at step s + tau - 1, where its
outcome is held (or the fragment reverts) before the update of step s + tau lands it.

In process, over an engine end that exchanges alone: the exchange runs on another thread while
the loop steps on (its state donated), its rounds equal the in-process engine's state hashes,
and an error raised on the thread is raised at the join. Over torchft: 2 replicas as processes
on 127.0.0.1 against a Lighthouse give the in-process engine's hash in every round both commit;
replica 1 is then killed (`kill -9`) while its rounds' exchanges run beside its steps, and
replica 0 commits on alone.

Needs the ``ft`` extra; with ``OPTAX_DIST_REQUIRE_FT=1`` (``make test``) a missing extra fails
the run instead of skipping it.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
from _ft_linear import linear_protocol, linear_task
from _helpers import kill_groups, require_ft

require_ft()

from torchft.coordination import LighthouseServer

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINEAR = str(ROOT / "tests" / "_ft_linear.py")
SYNC_PERIOD, FRAGMENTS, OVERLAP, MIXING = 4, 2, 2, 0.5  # a send every 2 steps, joined 1 later
STEPS, BATCH = 40, 16  # 20 rounds
KILL_AFTER = 10  # replica 1's round lines before its kill (of 20)


def _protocol(overlap=OVERLAP):
  return linear_protocol("streaming_diloco", SYNC_PERIOD, num_fragments=FRAGMENTS,
                         overlap=overlap, mixing=MIXING)


@pytest.fixture(scope="module")
def reference():
  """The in-process engine's lines of the toy run's 2 replicas, without a fault, by
  ``(round, replica)``."""
  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance.replica import task_loop

  protocol = _protocol()
  params, loss_and_grad, batch_fn = linear_task(8, BATCH, FRAGMENTS)
  engine = ft.InProcess(protocol, num_replicas=2, tokens_per_step=BATCH)
  engine.run(task_loop(protocol, params, loss_and_grad, batch_fn,
                       rounds=protocol.rounds_until(STEPS)))
  return {(line.round, line.replica): line for line in engine.log}


# ----------------------------------------------------------------------------------------------
# In process: the thread, the donated state, the join's error.


class _Alone:
  """An engine end whose exchange runs beside the steps (as the torchft engine's does) with
  this replica as the round's only member: it waits until the loop has taken a step after the
  send (``taken``), reads what it was sent (payload and donation bytes) and merges it alone."""

  exchanges_beside_steps = True

  def __init__(self, protocol, taken, fail=False):
    self.protocol, self.taken, self.fail = protocol, taken, fail
    self.lines, self.beside = [], []

  def start(self, replica):
    return None

  def exchange(self, sent):
    from optax_dist.fault_tolerance import decision, heal
    from optax_dist.fault_tolerance.loop import Received

    deadline = time.monotonic() + 10
    while self.taken[0] <= sent.header.step and time.monotonic() < deadline:
      time.sleep(0.001)
    self.beside.append((threading.current_thread() is not threading.main_thread(),
                        self.taken[0] > sent.header.step))
    if self.fail:
      raise ConnectionError("the exchange's all-gather failed")
    heal.encode_heal(sent.donation)  # reads every array of the donation
    d = decision.decide(self.protocol, [sent.header], [sent.payload[0]], min_replicas=1)
    return Received((sent.header.slot,), 1, None, (d.merged, None), d.step, d.reason)

  def record(self, line):
    self.lines.append(line)


def _donating_loop(protocol, steps, taken):
  """A loop whose jitted step donates its state (a read of it after the step raises)."""
  import jax
  import optax

  params, loss_and_grad, batch_fn = linear_task(8, BATCH, FRAGMENTS)

  @jax.jit(donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    updates, opt_state = protocol.tx.update(loss_and_grad(params, batch)[1], opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def train(replica):
    state = replica.start((params, protocol.tx_init(params)))
    while replica.step < steps:
      state = step(*state, batch_fn(replica.seed, replica.slot, replica.step))
      taken[0] += 1
      state = replica.after_step(state)
    return state

  return train


def test_the_exchange_runs_beside_the_next_steps_and_lands_as_the_in_process_round(tmp_path):
  """Each round's exchange runs on another thread once the loop has taken the step after the
  send (the loop's state donated by then), and the rounds hold the in-process engine's
  states; the loop ends on a send step, and the engine's finish joins that round."""
  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance.loop import Replica

  protocol, taken = _protocol(), [0]
  engine = _Alone(protocol, taken)
  train = _donating_loop(protocol, 12, taken)
  replica = Replica(protocol, engine, slot=0, seed=0, tokens_per_step=BATCH)
  train(replica)
  assert len(engine.lines) == protocol.rounds_until(12) - 1  # the last round still in flight
  taken[0] += 1  # lets the last exchange's wait end (no step follows it)
  replica.finish()
  reference = ft.InProcess(protocol, num_replicas=1, min_replicas=1, tokens_per_step=BATCH)
  reference.run(_donating_loop(protocol, 12, [0]))
  assert engine.beside == [(True, True)] * 6
  assert [(line.round, line.step, line.committed, line.state_hash) for line in engine.lines] == [
    (line.round, line.step, line.committed, line.state_hash) for line in reference.log]


def test_with_tau_above_the_gap_between_sends_a_round_is_joined_at_the_next_send():
  """tau = 3, a send every 2 steps: each round is joined before the next send (one exchange in
  flight), still before the step that lands it, so the loop ends on the in-process engine's
  state, bit for bit."""
  import jax
  import numpy as np

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance.loop import Replica

  protocol, taken = _protocol(overlap=3), [0]
  engine = _Alone(protocol, taken)
  replica = Replica(protocol, engine, slot=0, seed=0, tokens_per_step=BATCH)
  _donating_loop(protocol, 12, taken)(replica)
  taken[0] += 1  # lets the last exchange's wait end (no step follows it)
  final = replica.finish()
  reference = ft.InProcess(protocol, num_replicas=1, min_replicas=1, tokens_per_step=BATCH)
  expected = reference.run(_donating_loop(protocol, 12, [0]))[0]
  assert engine.beside == [(True, True)] * 6
  assert [(line.step, line.committed) for line in engine.lines] == [
    (line.step, line.committed) for line in reference.log]
  for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_error_on_the_exchange_s_thread_is_raised_at_the_join():
  from optax_dist.fault_tolerance.loop import Replica

  protocol, taken = _protocol(), [0]
  train = _donating_loop(protocol, 12, taken)
  replica = Replica(protocol, _Alone(protocol, taken, fail=True), slot=0, seed=0,
                    tokens_per_step=BATCH)
  with pytest.raises(ConnectionError, match="all-gather failed"):
    train(replica)
  assert replica.step == 2 + OVERLAP - 1 and replica.rounds == 0  # the first round's join


# ----------------------------------------------------------------------------------------------
# Over torchft: 2 replica processes, then a kill -9 of one.


def _lines(out: pathlib.Path, i: int) -> list[dict]:
  path = out / "replicas" / f"replica_{i}.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
  """2 replicas of the toy run with overlap, which meet in their first quorum; replica 1 is
  killed once it has written ``KILL_AFTER`` round lines. Each process's exit status and every
  replica's lines."""
  out = tmp_path_factory.mktemp("torchft_overlap")
  lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=5000,
                                heartbeat_timeout_ms=1000)
  env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFT_")}
  env["PYTHONPATH"] = str(ROOT)
  procs = {}
  try:
    for i in range(2):
      with open(out / f"replica_{i}.log", "w") as log:
        procs[i] = subprocess.Popen(
          [sys.executable, LINEAR, "replica", "--lighthouse", lighthouse.address(),
           "--replica-id", str(i), "--out", str(out), "--algorithm", "streaming_diloco",
           "--num-fragments", str(FRAGMENTS), "--overlap", str(OVERLAP), "--mixing",
           str(MIXING), "--sync-period", str(SYNC_PERIOD), "--steps", str(STEPS),
           "--batch", str(BATCH), "--meet", "2", "--exchange-timeout", "3"],
          env=env, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 180
    while len(_lines(out, 1)) < KILL_AFTER and procs[1].poll() is None:
      assert time.monotonic() < deadline, (out / "replica_1.log").read_text()[-3000:]
      time.sleep(0.01)
    os.kill(procs[1].pid, signal.SIGKILL)
    status = {i: proc.wait(timeout=300) for i, proc in procs.items()}
    yield status, {i: _lines(out, i) for i in range(2)}, out
  finally:
    kill_groups(procs.values())
    lighthouse.shutdown()


def test_two_replicas_over_torchft_hold_the_in_process_engine_s_state_in_each_round(
    killed_run, reference):
  status, lines, out = killed_run
  logs = {p.name: p.read_text()[-2000:] for p in out.glob("*.log")}
  assert status == {0: 0, 1: -signal.SIGKILL}, logs
  both = [line for i in range(2) for line in lines[i]
          if line["committed"] and line["members"] == [0, 1]]
  assert len([line for line in both if line["replica"] == 0]) >= KILL_AFTER - 1, lines
  for line in both:
    ref = reference[line["round"], line["replica"]]
    assert (line["step"], line["weight"], line["state_hash"]) == (
      ref.step, ref.weight, ref.state_hash), line


def test_the_survivor_of_a_kill_during_overlapped_exchanges_commits_on_alone(killed_run):
  _, lines, _ = killed_run
  survivor = lines[0]
  alone = [k for k, line in enumerate(survivor) if line["members"] == [0]]
  assert alone, survivor
  after = survivor[alone[0]:]
  assert all(line["committed"] and line["members"] == [0] for line in after), after
  # every round has its line; an abort (the kill's round, if it lost the acknowledgement) is
  # made up by one more round
  assert [line["round"] for line in survivor] == list(range(len(survivor)))
  committed = sum(line["committed"] for line in survivor)
  assert committed == _protocol().rounds_until(STEPS) >= len(survivor) - 1
