"""``optax-dist train --fault-tolerant --decoupled``: decoupled rounds over torchft, end to end
(digits, 2 replicas, a launcher and its Lighthouse on 127.0.0.1), against the in-process
engines; then the command's one-line refusals (in process).

Two runs, each once per module, replica 1 stopped (``SIGSTOP``) for a second right after a
boundary in each: K = R with an infinite window (the synchronous round, bit for bit: replica 0
waits for it) and K = 1 with a window of 0.3 s (rounds close without it); a third, K = R,
replica 1 killed (``kill -9``) and restarted (it heals); the late run and the restarted one
are replayed in process (E3). The heal and the catch-up of the exchange thread are also
checked in process, on two ports without a session, and a failed collective's no vote on
two ports over a Lighthouse in this process. Every process a
run starts is killed at the end of the module, also after a failure.

Needs the ``ft`` extra; with ``OPTAX_DIST_REQUIRE_FT=1`` (``make test``) a missing extra fails
the module instead of skipping it.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from _helpers import one_line_error, require_ft

pytest.importorskip("sklearn")
require_ft()

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN = ["train", "--algorithm", "diloco", "--fault-tolerant", "--decoupled", "--replicas", "2",
       "--devices", "1", "--sync-period", "100", "--max-restarts", "0", "--no-progress"]
STOP_S = 1.0  # shorter than the Lighthouse's heartbeat timeout (5 s): replica 1 stays a member


class Run:
  """The command in a session of its own (its launcher's replicas die with it)."""

  def __init__(self, out: pathlib.Path, *flags: str):
    self.out, self.flags = out, [*RUN, *flags, "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFT_")}
    env["PYTHONPATH"] = str(ROOT)
    self.proc = subprocess.Popen([sys.executable, "-m", "optax_dist.cli", *self.flags], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)

  def jsonl(self, name: str) -> list[dict]:
    path = self.out / "replicas" / name
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

  def merges(self, i: int) -> list[dict]:
    return [x for x in self.jsonl(f"replica_{i}.jsonl") if "committed" in x]

  def boundaries(self, i: int) -> list[dict]:
    return self.jsonl(f"boundaries_{i}.jsonl")

  def finish(self, timeout: float = 240.0) -> None:
    self.stdout, self.stderr = self.proc.communicate(timeout=timeout)
    assert self.proc.returncode == 0, self.stderr[-3000:]

  def close(self) -> None:
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()


def _stop_after_boundaries(run: Run, replica: int, tries: int = 4, seconds: float = STOP_S
                           ) -> list[float]:
  """Stops ``replica`` for ``seconds`` right after one of its boundaries (it is computing then),
  until a round closes without it (at most ``tries`` times); returns the stops' ends."""
  pid_file, ends = run.out / f"replica_{replica}.pid", []
  lines = run.out / "replicas" / f"boundaries_{replica}.jsonl"
  deadline = time.monotonic() + 120

  def size():
    return lines.stat().st_size if lines.exists() else 0

  while len(ends) < tries:
    seen = size()
    while size() == seen or not pid_file.exists():
      if run.proc.poll() is not None:  # the run ended first
        return ends
      assert time.monotonic() < deadline, f"no boundary of replica {replica} within 120 s"
      time.sleep(0.001)
    if ends and any(replica not in [p[0] for p in x["payloads"]] for x in run.merges(0)[1:]):
      break  # a round closed without it
    pid = int(pid_file.read_text())
    os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(pid, signal.SIGCONT)
    ends.append(time.time())
  return ends


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The two runs, one after the other: ``"sync"`` (K = R, W = inf) and ``"late"`` (K = 1,
  W = 0.3 s), replica 1 stopped in each (twice in the late run)."""
  done = {}
  try:
    done["sync"] = Run(tmp_path_factory.mktemp("sync"), "--steps", "400")
    done["sync"].stops = _stop_after_boundaries(done["sync"], 1, tries=1)
    done["sync"].finish()
    done["late"] = Run(tmp_path_factory.mktemp("late"), "--steps", "1000", "--min-quorum", "1",
                       "--grace-window", "0.3", "--staleness-rule", "dylu")
    done["late"].stops = _stop_after_boundaries(done["late"], 1, tries=2)
    done["late"].finish()
    yield done
  finally:
    for run in done.values():
      run.close()


def _engine_inputs(run: Run):
  """The run's protocol, task loop and tokens per step, built in this process as its replicas
  build them (``optax-dist replica``'s route)."""
  from optax_dist.cli import ft_flags, ft_task
  from optax_dist.cli.main import build_parser
  from optax_dist.cli.tasks import TASKS
  from optax_dist.fault_tolerance.replica import task_loop

  args = build_parser().parse_args(run.flags)
  ft_flags.resolve(args)
  task = TASKS[args.task]
  data = task.load(args.seed)
  s = ft_task.settings(args, task, lambda: data)
  params, loss_and_grad, batch_fn, tokens, _ = ft_task.task_engine(task, data, s, args.replicas)
  protocol = ft_task.protocol(s, args.staleness_rule)
  train = task_loop(protocol, params, loss_and_grad, batch_fn,
                    rounds=protocol.rounds_until(s.steps))
  return args, protocol, train, tokens


def _decoupled_options(args) -> dict:
  """The in-process engine's settings of the run's (a round commits with one payload)."""
  return {"num_replicas": args.replicas, "min_replicas": 1,
          "speeds": [1.0] * args.replicas, "min_quorum": args.min_quorum,
          "grace_window": args.grace_window, "staleness_rule": args.staleness_rule,
          "max_staleness": args.max_staleness}


def _one_hash_per_round(run: Run, replicas: int) -> list[str]:
  """E1: every replica wrote every round's line, with the same state hash; returns them."""
  lines = [run.merges(i) for i in range(replicas)]
  assert lines[0] and all(len(x) == len(lines[0]) for x in lines)
  for rows in zip(*lines, strict=True):
    assert len({(x["round"], x["state_hash"], x["committed"]) for x in rows}) == 1, rows
  assert [x["round"] for x in lines[0]] == list(range(len(lines[0])))
  return [x["state_hash"] for x in lines[0]]


@pytest.mark.slow
def test_k_equal_r_and_no_window_is_the_synchronous_round_bit_for_bit(runs):
  """K = R, W = inf, replica 1 stopped for a second after a boundary (replica 0 waits for it):
  every round merges both payloads (staleness 0, 1,600 tokens each) and every boundary lands; the
  round lines' hashes are the in-process decoupled engine's (equal speeds), and each replica's
  final state (params included) and each round's mean training loss are the in-process
  synchronous engine's bit for bit."""
  from optax_dist.fault_tolerance import InProcess, state_hash

  run = runs["sync"]
  assert run.stops, "the run ended before replica 1 was stopped"
  hashes = _one_hash_per_round(run, 2)
  assert "4 rounds committed, 0 aborted" in run.stdout, run.stdout
  for x in run.merges(0):
    step = 100 * (x["round"] + 1)
    assert x["committed"] and x["payloads"] == [[0, step, 1600, 0, 1600, True],
                                                [1, step, 1600, 0, 1600, True]], x
  assert all(b["landed"] for i in (0, 1) for b in run.boundaries(i))
  for b in run.boundaries(0) + run.boundaries(1):  # its push, its time, its pull in that order
    assert b["pushed"] <= b["time"] <= b["pushed"] + b["waited"] + 1e-3, b
  assert max(b["waited"] for b in run.boundaries(0)) > STOP_S / 2  # replica 1's stop waited out
  args, protocol, train, tokens = _engine_inputs(run)
  decoupled = InProcess(protocol, tokens_per_step=tokens, **_decoupled_options(args))
  decoupled.run(train)
  assert [x.state_hash for x in decoupled.log if hasattr(x, "committed")] == hashes
  synchronous = InProcess(protocol, num_replicas=2, min_replicas=2, tokens_per_step=tokens)
  final = synchronous.run(train)
  for i in (0, 1):
    got = json.loads((run.out / "replicas" / f"final_{i}.json").read_text())
    assert got["replica_hash"] == state_hash(final[i]) and got["step"] == 400
    losses = {x.round: x.loss for x in synchronous.log if x.replica == i}
    assert {x["round"]: x["loss"] for x in run.merges(i)} == losses  # each round's steps' mean


@pytest.mark.slow
def test_a_replica_never_waits_and_every_payload_counts_once(runs):
  """K = 1, W = 0.3 s, replica 1 stopped twice for a second (it holds the two-member quorum's
  polls, so no round closes then): replica 0 goes on at every boundary (no wait: its pushes
  leave at once) and pushes nothing while its payload is in flight (skipped boundaries); every
  payload of either replica enters exactly one merge with the tokens of its steps since its
  previous payload, and weighs T / (1 + s) (the rule the run names, ``"dylu"``), its line
  holding its steps' mean loss; no heal."""
  run = runs["late"]
  assert run.stops, "the run ended before replica 1 was stopped"
  _one_hash_per_round(run, 2)
  merges = run.merges(0)
  assert all(x["committed"] for x in merges) and "0 heals" in run.stdout, run.stdout
  pushed = [b for b in run.boundaries(0) if "waited" in b]
  assert pushed and max(b["waited"] for b in pushed) < 0.3, pushed
  skipped = [b for b in run.boundaries(0) if "at" in b]
  assert any(end - STOP_S < b["at"] < end for b in skipped for end in run.stops), skipped
  for i in (0, 1):
    mine = [p for x in merges for p in x["payloads"] if p[0] == i]
    steps = [p[1] for p in mine]
    assert steps == sorted(set(steps)) and all(p[5] for p in mine)
    for previous, (_, step, tokens, stale, weight, _) in zip([0, *steps], mine):
      assert tokens == 16 * (step - previous) and weight == tokens / (1 + stale), mine
  for i in (0, 1):  # a merged payload's line has its steps' mean loss, after a settle too
    assert all(x["loss"] is not None for x in run.merges(i) if x["weight"]), run.merges(i)
  assert not any(x.get("healed") for x in run.jsonl("replica_1.jsonl"))


@pytest.mark.slow
def test_the_torchft_run_s_lines_replay_in_process_with_the_same_hashes(runs):
  """E3 across engines: the late run's round lines (replica 0's) and both replicas' boundary
  lines, replayed by ``InProcess(replay=...)``, close the same rounds with the same payloads and
  the same state hashes; replica 1's boundaries a second later make the replay diverge."""
  from optax_dist.fault_tolerance import InProcess

  run = runs["late"]
  args, protocol, train, tokens = _engine_inputs(run)
  merges = run.merges(0)
  bounds = run.boundaries(0) + run.boundaries(1)
  replay = InProcess(protocol, tokens_per_step=tokens, replay=merges + bounds,
                     **_decoupled_options(args))
  replay.run(train)
  lines = [x for x in replay.log if hasattr(x, "committed")]
  assert [(x.round, x.state_hash, [list(p) for p in x.payloads]) for x in lines] == [
    (x["round"], x["state_hash"], x["payloads"]) for x in merges]
  moved = [dict(b, time=b["time"] + 1.0, settled=b.get("settled") and b["settled"] + 1.0)
           if b["replica"] == 1 and "step" in b else b for b in bounds]
  with pytest.raises(RuntimeError, match="replay diverges from its log"):
    InProcess(protocol, tokens_per_step=tokens, replay=merges + moved,
              **_decoupled_options(args)).run(train)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
  """K = R, W = inf, the Lighthouse's quorum 2 (replica 0 waits while replica 1 is dead):
  replica 1 killed (``kill -9``) as soon as it has written a committed round's line (before or
  after its boundary line of that round, which comes right after it: the replay takes either
  log), and restarted by the launcher."""
  run = Run(tmp_path_factory.mktemp("killed"), "--steps", "300", "--min-replicas", "2",
            "--max-restarts", "1", "--restart-delay", "0.2")
  try:
    deadline = time.monotonic() + 120
    while not any(x["committed"] for x in run.merges(1)):
      assert run.proc.poll() is None and time.monotonic() < deadline, run.proc.communicate()
      time.sleep(0.001)
    run.first = run.merges(1)[-1]["pid"]
    os.kill(run.first, signal.SIGKILL)
    run.finish()
    yield run
  finally:
    run.close()


@pytest.mark.slow
def test_a_restarted_replica_heals_then_commits_with_the_others(killed):
  """The restarted process heals from replica 0 (its first round line says so, a Heal line
  names the donor and its first payload's lost tokens), its first payload enters no round
  (weight 0), its later ones enter the merges with the tokens of their steps since the heal,
  and every round has one state hash across the replicas that wrote it (E1)."""
  run = killed
  assert "1 restart, 1 heal" in run.stdout, run.stdout
  again = [x for x in run.merges(1) if x["pid"] != run.first]
  assert again and again[0]["healed"] and again[0]["donor"] == 0, again
  heals = [x for x in run.boundaries(1) if "donor" in x]
  assert len(heals) == 1 and heals[0]["donor"] == 0 and heals[0]["lost"] == 16 * 100, heals
  assert heals[0]["round"] == again[0]["round"] and heals[0]["step"] == 100
  merged = [(x["round"], p) for x in again for p in x["payloads"] if p[0] == 1]
  assert [p[1] for _, p in merged] == list(range(200, 300 + 1, 100)), merged
  assert all(p[2] == 1600 and p[5] for _, p in merged), merged  # since the heal's step 100
  by_round: dict[int, set] = {}
  for i in (0, 1):
    for x in run.merges(i):
      by_round.setdefault(x["round"], set()).add((x["state_hash"], x["committed"]))
  assert sorted(by_round) == list(range(len(by_round))), by_round
  assert all(len(h) == 1 for h in by_round.values()), by_round
  assert all(c for (h, c), in by_round.values())
  assert "the state hashes agree on every committed round" in run.stdout
  # each replica's 300 steps, and the killed process's 100 to its first boundary and the 100
  # after it (estimated: to its next boundary), 16 tokens a step, merged or lost once
  tokens = json.loads((run.out / "fault_tolerant_diloco.json").read_text())["tokens"]
  assert tokens == {"0": {"merged": 16 * 300, "lost": 0, "unlogged": 0},
                    "1": {"merged": 16 * 300, "lost": 16 * 100, "unlogged": 16 * 100}}, tokens
  assert "tokens: 9,600 merged, 3,200 lost (1,600 of them killed processes'" in run.stdout


@pytest.mark.slow
def test_the_run_with_a_restart_replays_in_process_with_the_same_hashes(killed):
  """E3 with a restart: replica 0's round lines and both replicas' boundary lines, replayed by
  ``InProcess(replay=...)``: replica 1's boundaries after its Heal line are its restarted
  process's (its ``local_step`` from 0 again), so its first loop dies after its last logged
  boundary and starts again, heals from replica 0 at its logged heal boundary (the run's Heal
  line), and the replay closes the run's rounds with the same payloads and state hashes; each
  replica's final state (params included) is the run's bit for bit."""
  import dataclasses

  from optax_dist.fault_tolerance import InProcess, decoupled, state_hash

  run = killed
  args, protocol, train, tokens = _engine_inputs(run)
  merges = run.merges(0)
  replay = InProcess(protocol, tokens_per_step=tokens,
                     replay=merges + run.boundaries(0) + run.boundaries(1),
                     **_decoupled_options(args))
  final = replay.run(train)
  lines = [x for x in replay.log if hasattr(x, "committed")]
  assert [(x.round, x.state_hash, [list(p) for p in x.payloads]) for x in lines] == [
    (x["round"], x["state_hash"], x["payloads"]) for x in merges]
  heals = [dataclasses.asdict(x) for x in replay.log if isinstance(x, decoupled.Heal)]
  assert heals == [x for x in run.boundaries(1) if "donor" in x], heals
  # the replay's Death line counts what the run's summary estimates for the killed process
  tokens = json.loads((run.out / "fault_tolerant_diloco.json").read_text())["tokens"]
  assert {str(i): v["merged"] + v["lost"] for i, v in decoupled.accounts(replay.log).items()} == {
    i: sum(v.values()) for i, v in tokens.items()}
  for i in (0, 1):
    got = json.loads((run.out / "replicas" / f"final_{i}.json").read_text())
    assert state_hash(final[i]) == got["replica_hash"]


def _ports(tmp_path, behind_restarted: bool, protocol=None, committed=False):
  """Two exchange ends of replicas 0 and 1 (no torchft session: their thread is not started):
  replica 0 the donor, two rounds committed of three closed; replica 1 at the run's start,
  restarted (an earlier process of it made its boundaries file) or live. ``committed``: their
  params committed to the first device, as a command's are to its mesh."""
  import types

  import jax
  import jax.numpy as jnp
  import optax

  from optax_dist.fault_tolerance import RoundProtocol, decoupled, torchft_decoupled

  protocol = protocol or RoundProtocol("diloco", optax.adam(0.1), optax.sgd(0.7, momentum=0.9),
                                       sync_period=2)
  ports = []
  for slot in (0, 1):
    engine = types.SimpleNamespace(protocol=protocol, replica_id=slot, seed=0,
                                   tokens_per_step=4, out=tmp_path, num_replicas=2)
    if slot == 1 and behind_restarted:
      torchft_decoupled.DecoupledPort(engine)  # its last process, killed before any line
    port = torchft_decoupled.DecoupledPort(engine)
    port.start = port._hold  # the replica's start without a session
    params = {"w": jnp.arange(3.0) + slot, "b": jnp.ones(3), "c": jnp.full(3, -1.0)}
    if committed:
      params = jax.device_put(params, jax.devices()[0])
    port.replica.start((params, protocol.tx.init(params)))
    ports.append(port)
  donor = ports[0]
  for delta in (0.5, -0.25):
    g = donor._global[0]
    f = decoupled.round_fragment(protocol, int(g.rounds))
    merged = jax.tree.map(lambda x, d=delta: jnp.full_like(x, d),
                          protocol.send_half(g.opt_state, g.params, f)[0])
    donor._global = (decoupled.commit(protocol, g, merged, f), None)
    donor._versions[f] = donor._versions.get(f, 0) + 1
  donor._closed, donor._rounds = 3, 2
  donor._inner = jax.tree.map(lambda x: x + 1, donor._inner)  # its moments and counts moved on
  return donor, ports[1]


def _received(port, donation: bytes) -> None:
  """``donation`` received at a quorum of the two (the donor rank 0), as torchft hands it to
  the port, then taken as the poll takes it (the poll's headers sent at 2 s)."""
  import types

  port._steps, port.transport = {}, types.SimpleNamespace(source=0)
  port._load(donation)
  if port._got is not None:  # as the poll's headers take it
    port._take([types.SimpleNamespace(slot=i, now=2_000_000 - i) for i in (0, 1)], 0.25)


def test_a_live_replica_behind_catches_up_on_the_global_state_alone(tmp_path):
  """A live replica that missed rounds takes the donor's donation as a catch-up: its copy of the
  global state hashes as the donor's, with the donor's closed rounds and fragment versions (a
  CatchUp line names the donor and the 3 rounds missed); its next pull receives that global
  state, and the catch-up keeps its params and inner state and takes the anchor (the donor's
  ``local_step`` is not taken). The heal transport reads the donation's frame within the
  replica's own bound (:func:`~optax_dist.fault_tolerance.heal.heal_bound`)."""
  import jax
  import numpy as np

  from optax_dist.fault_tolerance import decoupled, heal
  from optax_dist.fault_tolerance import torchft_session as ts

  donor, late = _ports(tmp_path, behind_restarted=False)
  frame = ts._frame({"user": {"default": donor._heal_bytes()},
                     "torchft": {"step": 2**62, "batches_committed": 2**62}})
  slack = 65536 + 300 * len(jax.tree.leaves(late._donation_like))
  assert len(frame) <= heal.heal_bound(late._donation_like) <= len(frame) + slack
  _received(late, donor._heal_bytes())
  assert decoupled.global_hash(*late._global) == decoupled.global_hash(*donor._global)
  assert (late._closed, late._versions, late._healed) == (3, {None: 2}, None)
  lines = [json.loads(x) for x in late.boundary_path.read_text().splitlines()]
  assert lines == [{"round": 3, "replica": 1, "donor": 0, "missed": 3, "rounds": 2}]
  with late._cv:
    late._give(None)
  pull, mine = late._pull, late.replica.replica_state
  assert pull.healed is None and pull.received is not None
  caught = decoupled.catch_up(mine, pull.received[0])
  assert decoupled.global_hash(caught) == decoupled.global_hash(donor._global[0])
  for a, b in [(caught.params, mine.params), (heal.inner_state(caught), heal.inner_state(mine)),
               (caught.opt_state.local_step, mine.opt_state.local_step)]:
    jax.tree.map(np.testing.assert_array_equal, a, b)
  assert late._received == {None: 2}  # its next payload's staleness counts from version 2


def test_a_received_donation_is_placed_as_the_replica_s_own_arrays(tmp_path):
  """The arrays of a donation (built from bytes: on no device in particular) are placed as the
  receiver's own, committed to its device: the catch-up's programs are then those its warm-up
  compiled, where arrays of another placement compiled them again inside the run (a restarted
  replica compiled for about a minute under its CPU share in the speeds benchmark)."""
  import jax

  donor, late = _ports(tmp_path, behind_restarted=False, committed=True)
  _received(late, donor._heal_bytes())
  mine = jax.tree.leaves(late.replica.replica_state)
  caught = jax.tree.leaves(late._global[0])
  assert len(caught) == len(mine) and sum(x.committed for x in mine) >= 3  # the params
  assert [x.committed for x in caught] == [x.committed for x in mine]
  assert [x.sharding for x in caught] == [x.sharding for x in mine]


def test_a_restarted_replica_heals_at_its_next_push_and_a_refused_donation_is_a_no(tmp_path,
                                                                                    monkeypatch):
  """A restarted replica takes the donation as a heal: no CatchUp line; its next push enters no
  round (a Heal line: donor 0, its tokens lost; its boundary at the time of the poll it healed
  at, which no poll of its own had before, in the same write: a kill leaves both or neither)
  and its pull rebuilds it from the global state and the donor's inner optimizer state (E2: its
  global hash and inner state are the donor's). A donation of another run (fingerprint) is
  refused: reported to torchft, its counters put back, nothing taken."""
  import types

  from optax_dist.fault_tolerance import torchft_decoupled as td

  writes = []

  class Recorded:  # the port's file, each write recorded
    def __init__(self, path, mode):
      self.path, self.mode = path, mode

    def __enter__(self):
      return self

    def __exit__(self, *error):
      return False

    def write(self, text):
      writes.append(text)
      with open(self.path, self.mode) as f:
        f.write(text)

  import jax
  import numpy as np

  from optax_dist.fault_tolerance import decoupled, heal
  from optax_dist.fault_tolerance.decision import Header
  from optax_dist.fault_tolerance.decoupled import Push

  donor, joiner = _ports(tmp_path, behind_restarted=True)
  calls = []
  joiner._manager = types.SimpleNamespace(load_state_dict=lambda x: calls.append(("load", x)),
                                          report_error=lambda e: calls.append(("error", e)))
  joiner.replica.fingerprint += 1
  _received(joiner, donor._heal_bytes())
  assert [c[0] for c in calls] == ["load", "error"] and "another run" in str(calls[1][1])
  assert joiner._joining and joiner._closed == 0
  joiner.replica.fingerprint -= 1
  _received(joiner, donor._heal_bytes())
  assert not joiner._joining and joiner._closed == 3 and not joiner.boundary_path.read_text()
  mine = joiner.replica.replica_state
  joiner._push = Push(Header(1, 8, 1, joiner.replica.fingerprint, 2), None, mine)
  monkeypatch.setattr(td, "open", Recorded, raising=False)
  with joiner._cv:
    assert joiner._enter() is None and joiner._entry is None
  assert [text.count("\n") for text in writes] == [2]
  heals = [json.loads(x) for x in joiner.boundary_path.read_text().splitlines()]
  assert heals[0] == {"round": 3, "replica": 1, "donor": 0, "step": 2, "lost": 8}, heals
  assert heals[1]["time"] == 2.0  # its boundary at the poll it healed at, however soon it pushed
  healed, _ = joiner.replica.receive(joiner._pull.healed)
  assert decoupled.global_hash(healed) == decoupled.global_hash(donor._global[0])
  jax.tree.map(np.testing.assert_array_equal, heal.inner_state(healed), donor._inner)
  assert joiner._base == 2 and joiner._received == {None: 2}


def test_a_process_restarted_before_its_first_line_waits_for_a_heal_unless_none_committed(
    tmp_path):
  """A restarted process is known by its boundaries file, which its last process made at its
  start (here killed before it wrote any line); a first process is not. The restarted one waits
  for a heal (no member closes a round while its header says so) beside a member that committed
  a round (torchft heals it there) and alone (a member of another quorum may have); in a quorum
  of more than itself where no member committed a round there is nothing to heal from, and it
  goes on as a fresh process from its next poll."""
  import types

  import numpy as np

  from optax_dist.fault_tolerance import torchft_decoupled as td

  _, joiner = _ports(tmp_path, behind_restarted=True)
  assert joiner._joining and not joiner.log_path.exists()
  assert not _ports(tmp_path / "first", behind_restarted=False)[1]._joining
  joiner._manager = types.SimpleNamespace(state_dict=dict, errored=lambda: None)
  joiner.transport, joiner._quorum = types.SimpleNamespace(source=None), lambda: None
  joiner.quorum_timeout = 60.0

  def poll(rounds: dict):
    heads = [np.asarray(td.PollHeader(i, 1, joiner.replica.fingerprint, 0, 0, 0, 0, 0, 10**6,
                                      0, 0, r, int(i == 1 and joiner._joining)), np.int64)
             for i, r in rounds.items()]
    joiner._allgather = lambda head, everyone: heads
    return joiner._headers(heads[-1])

  for rounds in ({0: 1, 1: 0}, {1: 0}):
    assert poll(rounds) is None and joiner._joining
  assert poll({0: 0, 1: 0}) is None and not joiner._joining
  assert [h.joining for h in poll({0: 0, 1: 0})] == [0, 0]


def test_a_restarted_replica_refuses_to_start_the_run_again_when_its_rounds_are_lost(tmp_path):
  """Every replica restarted after the run committed rounds: no member holds its global state
  (decoupled rounds keep no checkpoint). A restarted replica whose earlier process logged a
  committed round leaves with :class:`StateLost` instead of training again from the initial
  state under round numbers the run already used; one whose did not starts as before."""
  import json
  import types

  import numpy as np

  from optax_dist.fault_tolerance import torchft_decoupled as td
  from optax_dist.fault_tolerance.torchft_session import StateLost

  _, fresh = _ports(tmp_path, behind_restarted=True)
  fresh.log_path.write_text(json.dumps({"round": 0, "replica": 1, "committed": True}) + "\n")
  lost = td.DecoupledPort(fresh.engine)  # its next process, after the line
  lost.start = lost._hold
  lost.replica.start((fresh.replica.replica_state.params, fresh.replica.replica_state.opt_state))
  for port in (fresh, lost):
    port._manager = types.SimpleNamespace(state_dict=dict, errored=lambda: None)
    port.transport, port._quorum = types.SimpleNamespace(source=None), lambda: None
    port.quorum_timeout = 60.0
    heads = [np.asarray(td.PollHeader(i, 1, port.replica.fingerprint, 0, 0, 0, 0, 0, 10**6, 0,
                                      0, 0, int(i == 1)), np.int64) for i in (0, 1)]
    port._allgather = lambda head, everyone, heads=heads: heads
  assert fresh._headers(heads[-1]) is None and not fresh._joining
  with pytest.raises(StateLost, match=r"^decoupled rounds: replica 1 restarted after the run"
                     r" committed rounds, and no member of its quorum \[0, 1\] holds"):
    lost._headers(heads[-1])


def _scheduled(boundary: dict) -> dict:
  """A boundary line without its wall-clock fields (``pushed``, ``waited``: the K = R run's
  test checks them), which these stubbed ports' clocks do not drive."""
  return {k: v for k, v in boundary.items() if k not in ("pushed", "waited")}


def test_a_member_donates_the_inner_state_of_its_last_boundary_s_push(tmp_path):
  """A heal's donor sends the inner optimizer state of its last push whose boundary it wrote,
  as the in-process clock's donor (whose pushes count at their boundaries' times, which a
  replay runs): a push still waiting in the open round does not change it; its boundary does."""
  import jax
  import numpy as np

  from optax_dist.fault_tolerance import heal
  from optax_dist.fault_tolerance.decision import Header
  from optax_dist.fault_tolerance.decoupled import Push

  _, port = _ports(tmp_path, behind_restarted=False)
  first = heal.inner_state(port.replica.replica_state)
  mine = port.replica.replica_state
  mine = mine._replace(opt_state=jax.tree.map(lambda x: x + 1, mine.opt_state))
  payload = port.protocol.send_half(mine.opt_state, mine.params, None)[0]
  port._push = Push(Header(1, 8, 1, port.replica.fingerprint, 2), (payload, None), mine)
  port._waits = True  # its loop waits at its boundary
  with port._cv:
    port._enter()
    jax.tree.map(np.testing.assert_array_equal, port._inner, first)
    port._entry = None  # its round closed without it: its boundary at the next poll
    port._settle(1.0)
  jax.tree.map(np.testing.assert_array_equal, port._inner, heal.inner_state(mine))
  assert _scheduled(json.loads(port.boundary_path.read_text())) == {
    "replica": 1, "step": 2, "time": 1.0, "landed": False, "settled": 0.0}


def _closed_by(tmp_path, vote: bool, waits: bool = True):
  """Replica 1's port, fresh, with its payload (step 2, 8 tokens) in the open round beside
  replica 0's same payload, closes it (the collectives stubbed: both hold its payload), its
  vote (torchft's ``should_commit``) ``vote``; its last poll at 1 s, this one at 3 s; its loop
  waits at its boundary, or went on (``waits=False``)."""
  import types

  from optax_dist.fault_tolerance import torchft_decoupled as td
  from optax_dist.fault_tolerance.decision import Header
  from optax_dist.fault_tolerance.decoupled import Push

  _, port = _ports(tmp_path, behind_restarted=False)
  port.engine.__dict__.update(min_replicas=1, staleness_rule="dylu", max_staleness=1,
                              grace_window=float("inf"))
  port._manager = types.SimpleNamespace(report_error=lambda e: None)
  port._allgather = lambda mine, everyone: [mine, mine]
  port._broadcasts = lambda mine, roots, rank: [mine] * len(roots)
  port._vote, port._time = lambda: vote, 1.0
  mine = port.replica.replica_state
  mine = mine._replace(params={k: v + 1 for k, v in mine.params.items()})
  payload = port.protocol.send_half(mine.opt_state, mine.params, None)[0]
  port._push = Push(Header(1, 8, 1, port.replica.fingerprint, 2), (payload, None), mine)
  port._waits = waits
  with port._cv:
    port._enter()
  heads = [td.PollHeader(i, 1, port.replica.fingerprint, 1, 8, 2, 0, 0, 3_000_000, 0, 0, 0, 0)
           for i in (0, 1)]
  port._close(heads, 3.0)
  with port._cv:
    port._settle(3.0)
  return port


def test_a_vote_that_fails_on_a_round_the_others_commit_is_caught_up_on(tmp_path):
  """A member whose vote fails on a round the decision commits (its torchft step stays behind
  the others') does not apply the commit nor count the round closed: its round line is the
  others' (the committed hash), its loop does not land its payload (its boundary before the
  close, at 2 s, received nothing; it lands it late at its next settle), and the next quorum's
  donation is a catch-up on that one round (a CatchUp line, missed 1) to the others' global
  state."""
  from optax_dist.fault_tolerance import decoupled

  voter, outvoted = _closed_by(tmp_path / "a", True), _closed_by(tmp_path / "b", False)
  start = decoupled.global_hash(*_ports(tmp_path / "c", behind_restarted=False)[1]._global)
  lines = [json.loads(port.log_path.read_text()) for port in (voter, outvoted)]
  assert lines[0]["committed"] and lines[0]["state_hash"] == lines[1]["state_hash"]
  assert decoupled.global_hash(*voter._global) == lines[0]["state_hash"] != start
  assert decoupled.global_hash(*outvoted._global) == start and outvoted._closed == 0
  bounds = _scheduled(json.loads(outvoted.boundary_path.read_text().splitlines()[-1]))
  assert bounds == {"replica": 1, "step": 2, "time": 2.0, "landed": False, "settled": 0.0}
  assert outvoted._pull.landed is None and outvoted._pull.received is None
  assert outvoted._late == (0, None)  # its payload is in the merge: it lands late
  assert voter._pull.landed is not None and voter._late is None
  _received(outvoted, voter._heal_bytes())
  assert decoupled.global_hash(*outvoted._global) == decoupled.global_hash(*voter._global)
  caught = json.loads(outvoted.boundary_path.read_text().splitlines()[-1])
  assert caught == {"round": 1, "replica": 1, "donor": 0, "missed": 1, "rounds": 1}, caught


def test_a_close_does_not_wait_for_its_merge_and_writes_its_line_once_computed(tmp_path):
  """A close whose loop went on counts the round closed and holds the global state after it
  at once (the next poll's header says so), but writes the round's line only when its poll
  finds the arrays computed (or the exchange thread ends): the member asks for its next quorum
  without waiting for its merge and outer step. The line is the one a close whose loop waits
  writes at once (the hash of the state after), and its loop lands the payload late."""
  from optax_dist.fault_tolerance import decoupled

  went_on = _closed_by(tmp_path / "a", True, waits=False)
  waited = _closed_by(tmp_path / "b", True)
  assert went_on._closed == 1 and not went_on.log_path.exists()
  assert went_on._late == (0, None) and went_on._pull is None
  went_on._write_rounds(wait=True)
  line, = (json.loads(x) for x in went_on.log_path.read_text().splitlines())
  assert line == json.loads(waited.log_path.read_text())
  assert line["committed"] and line["state_hash"] == decoupled.global_hash(*went_on._global)
  went_on._write_rounds(wait=True)  # written once
  assert len(went_on.log_path.read_text().splitlines()) == 1


def test_a_catch_up_enters_a_waiting_payload_again_for_the_round_s_fragment(tmp_path):
  """streaming_diloco, 3 fragments: a replica whose payload of fragment 0 waits in the open
  round catches up on two committed rounds (fragments 0 and 1): the round's fragment is now 2,
  so its payload is measured again for fragment 2 from its push, with the tokens of its steps
  since its start (none of fragment 2 sent yet) and the version of fragment 2 it received (0);
  fragment 0's tokens go to its next payload of fragment 0."""
  import jax
  import numpy as np
  import optax

  from optax_dist.fault_tolerance import RoundProtocol
  from optax_dist.fault_tolerance.decision import Header
  from optax_dist.fault_tolerance.decoupled import Push

  protocol = RoundProtocol("streaming_diloco", optax.sgd(0.1), optax.sgd(0.7), sync_period=3,
                           num_fragments=3)
  donor, late = _ports(tmp_path, behind_restarted=False, protocol=protocol)
  mine = late.replica.replica_state
  mine = mine._replace(params={"w": mine.params["w"] + 1, "b": mine.params["b"] + 2,
                               "c": mine.params["c"] + 3})  # its inner steps, off the anchor
  payload = protocol.send_half(mine.opt_state, mine.params, 0)[0]
  late._push = Push(Header(1, 4, 1, late.replica.fingerprint, 1), (payload, None), mine)
  late._waits = True  # its loop waits at its boundary
  with late._cv:
    late._enter()
  first = late._entry
  assert first.fragment == 0 and late._waiting is first
  _received(late, donor._heal_bytes())
  e = late._entry
  assert e.fragment == 2 and late._waiting is e and (e.tokens, e.received) == (4, 0)
  assert late._sent == {0: 0, 2: 1}
  want = protocol.send_half(mine.opt_state, mine.params, 2)[0]
  got = [np.asarray(x).tolist() for x in jax.tree.leaves(e.payload)]
  assert got == [np.asarray(x).tolist() for x in jax.tree.leaves(want)] != [
    np.asarray(x).tolist() for x in jax.tree.leaves(payload)]


@pytest.mark.parametrize("flags, said", [
  (["--min-quorum", "1"], "argument --min-quorum: needs --decoupled"),
  (["--decoupled", "--min-quorum", "3"], ("argument --min-quorum: must be at most --replicas (2),"
   " got 3")),
  (["--grace-window", "auto"], "argument --grace-window: needs --decoupled"),
  (["--decoupled", "--grace-window", "-1"], ("argument --grace-window: must be seconds >= 0, inf"
   " or auto, got '-1'")),
  (["--decoupled", "--grace-window", "auto", "--grace-gamma", "-1"],
   "argument --grace-gamma: must be a number >= 0, got -1"),
  (["--decoupled", "--grace-gamma", "2"], "argument --grace-gamma: needs --grace-window auto"),
  (["--decoupled", "--grace-window", "0.3", "--grace-gamma", "2"],
   "argument --grace-gamma: needs --grace-window auto, got --grace-window 0.3"),
  (["--decoupled", "--standby"], ("argument --standby: not with --decoupled, got --standby;"
   " decoupled rounds over torchft do not take it yet")),
  (["--decoupled", "--processes", "2"], ("argument --processes: not with --decoupled, got"
   " --processes 2")),
  (["--decoupled", "--checkpoint-every", "5"], ("argument --checkpoint-every: not with"
   " --decoupled, got --checkpoint-every 5")),
  (["--decoupled", "--staleness-rule", "age_gate", "--max-staleness", "-1"],
   "argument --max-staleness: must be an integer >= 0 with --decoupled, got -1"),
])
def test_refusals_are_one_line(flags, said, tmp_path, capsys):
  base = ["train", "--algorithm", "diloco", "--fault-tolerant", "--replicas", "2", "--devices",
          "1", "--steps", "20", "--sync-period", "5"]
  line = one_line_error(capsys, *base, *flags, "--out", str(tmp_path))
  assert said in line, line
  assert not (tmp_path / "replicas").exists()


def test_the_command_takes_grace_window_auto_to_the_replica_s_engine(tmp_path):
  """``--grace-window auto`` resolves (gamma 0.5 by default, or ``--grace-gamma``), the
  command's check of the protocol takes it, and a replica's engine is made with it as
  ``optax-dist replica`` makes it."""
  from optax_dist.cli import ft_flags, ft_task, ft_train
  from optax_dist.cli.main import build_parser
  from optax_dist.cli.tasks import TASKS
  from optax_dist.fault_tolerance import engine

  for extra, gamma in (([], 0.5), (["--grace-gamma", "2"], 2.0)):
    args = build_parser().parse_args([*RUN, "--steps", "200", "--grace-window", "auto", *extra,
                                      "--out", str(tmp_path)])
    ft_flags.resolve(args)
    assert (args.grace_window, args.grace_gamma) == ("auto", gamma)
  task = TASKS[args.task]
  s = ft_task.settings(args, task, lambda: task.load(args.seed))
  ft_train._check_decoupled(args, s)
  options = {name: getattr(args, name) for name in (*ft_flags.DECOUPLED, "max_staleness")}
  made = engine("torchft", ft_task.protocol(s, args.staleness_rule), num_replicas=2, lighthouse="http://127.0.0.1:1",
                replica_id=0, out=tmp_path, **options)
  assert (made.grace_window, made.grace_gamma) == ("auto", 2.0)


def test_the_auto_window_is_gamma_times_the_least_slack_in_the_members_headers(tmp_path):
  """With ``grace_window="auto"`` a poll's window is gamma times the least slack its headers
  carry of the members whose loops have not returned, 0 before any measured one: K = 1, a
  payload in at 1 s, slacks 0.4 s and 0.1 s (a returned member's 0.01 s not counted), gamma 0.5:
  W = 0.05 s, the round closes at a poll at 1.06 s, not at 1.04 s. A replica's slack at its push
  is its seconds since its last pull over the steps between, times its steps to its next
  boundary, less its last close's transport (the seconds of its payload all-gathers): 0.3 s
  over 2 steps, 2 steps, 0.05 s: 0.25 s. Its header carries it."""
  import types

  from optax_dist.fault_tolerance import torchft_decoupled as td

  _, port = _ports(tmp_path, behind_restarted=False)
  port.engine.__dict__.update(min_quorum=1, grace_window="auto", grace_gamma=0.5)
  fingerprint = port.replica.fingerprint

  def head(slot, ready, slack, done=0):
    return td.PollHeader(slot, 1, fingerprint, ready, 8, 2, 0, ready * 1_000_000, 1_000_000,
                         done, 0, 0, 0, slack)

  heads = [head(0, 1, 400_000), head(1, 0, 100_000), head(2, 0, 10_000, done=1)]
  port._take_window(heads)
  assert port._window() == 0.5 * 0.1
  assert not port._due(heads, 1.04) and port._due(heads, 1.06)
  port._take_window([head(0, 1, td.NO_SLACK), head(1, 0, td.NO_SLACK)])
  assert port._window() == 0.0
  port._pulled, port._transport = (2, time.monotonic() - 0.3), 0.05
  with port._cv:
    port._measure(4)
  assert port._slack == pytest.approx(0.3 / 2 * 2e6 - 0.05e6, abs=20_000)
  assert td.PollHeader(*port._header().tolist()).slack == port._slack
  assert 0 <= _closed_by(tmp_path / "closed", True)._transport < 1.0


def test_a_decoupled_flag_without_fault_tolerance_is_refused(tmp_path, capsys):
  line = one_line_error(capsys, "train", "--decoupled", "--out", str(tmp_path))
  assert line == "optax-dist: error: argument --decoupled: needs --fault-tolerant", line


@pytest.mark.parametrize("options, said", [
  ({"min_quorum": 0}, "`Torchft(min_quorum=...)` must be a positive int, got 0."),
  ({"grace_window": -1.0}, "`Torchft(grace_window=...)`"),
  ({"grace_window": "auto", "grace_gamma": -1.0},
   "`Torchft(grace_gamma=...)` must be a finite number >= 0, got -1.0."),
  ({"staleness_rule": "fifo"}, "`Torchft(staleness_rule=...)` must be one of 'none', 'dylu'"),
  ({"min_quorum": 1, "min_replicas": 2},
   "`Torchft(min_replicas=...)` must be at most min_quorum=1, got 2."),
  ({"checkpoint_every": 5}, "`Torchft(decoupled=True)`: not with checkpoint_every=5"),
  ({"exchange_retries": 1}, "`Torchft(decoupled=True)`: not with exchange_retries=1"),
])
def test_the_torchft_engine_checks_its_decoupled_settings(options, said, tmp_path):
  import optax

  from optax_dist.fault_tolerance import RoundProtocol, engine

  protocol = RoundProtocol("diloco", optax.sgd(0.1), optax.sgd(0.7), sync_period=2)
  with pytest.raises(ValueError) as info:
    engine("torchft", protocol, num_replicas=3, lighthouse="http://127.0.0.1:1", replica_id=0,
           out=tmp_path, decoupled=True, **options)
  assert str(info.value).startswith(said) and "\n" not in str(info.value), info.value


def test_a_payload_in_flight_longer_than_the_quorum_timeout_stops_the_loop(tmp_path):
  """No round closed for ``quorum_timeout`` seconds since its push: the next settle raises a
  ``TimeoutError`` naming the payload's step, instead of skipping on without end; before that
  it skips (``None``, a boundary line with ``at``)."""
  _, port = _ports(tmp_path, behind_restarted=False)
  port.quorum_timeout, port._sent_step = 30.0, 7
  port._entry = object()  # its payload in the open round
  port._pushed_at = int((time.time() - 10) * 1e6)
  assert port.settle(8) is None
  assert "at" in json.loads(port.boundary_path.read_text().splitlines()[-1])
  port._pushed_at = int((time.time() - 31) * 1e6)
  with pytest.raises(TimeoutError, match="payload of step 7 has been in flight 31 s"):
    port.settle(9)


def test_a_round_s_payloads_are_broadcast_by_their_members_only(tmp_path):
  """A closing round moves each payload in it once, from its member (a broadcast rooted at its
  process-group rank, in rank order); a member without one sends nothing, and receives each
  into a buffer of its own payload's size."""
  import types

  import torch

  _, port = _ports(tmp_path, behind_restarted=False)
  sent = []

  def broadcast(buffers, opts):
    sent.append((opts.rootRank, buffers[0].numel()))
    buffers[0].fill_(opts.rootRank)
    return types.SimpleNamespace(wait=lambda: None)

  port._pg = types.SimpleNamespace(broadcast=broadcast)
  mine = torch.full((5,), 9, dtype=torch.uint8)
  outs = port._broadcasts(mine, [0, 2], rank=1)
  assert sent == [(0, 5), (2, 5)] and [x.tolist() for x in outs] == [[0] * 5, [2] * 5]
  sent.clear()
  assert port._broadcasts(mine, [1], rank=1)[0] is mine and sent == [(1, 5)]


def test_a_process_group_whose_configuration_failed_is_a_failed_all_gather(tmp_path):
  """torchft leaves no process group when its configuration fails in the quorum (a member
  killed while the others connected), and its ``size()`` then raises: the poll's all-gather
  fails, reported to torchft with a no vote (the next quorum configures a new one), and the
  exchange thread goes on."""
  import types

  import torch

  def unconfigured():
    raise AssertionError("process group not initialized")  # torchft 0.2.0's

  _, port = _ports(tmp_path, behind_restarted=False)
  errors, votes = [], []
  port._pg = types.SimpleNamespace(size=unconfigured)
  port._manager = types.SimpleNamespace(report_error=errors.append,
                                        should_commit=lambda: votes.append(errors[:]) or False)
  assert port._allgather(torch.ones(1), everyone=True) is None
  assert [str(e) for e in errors] == ["process group not initialized"] and len(votes) == 1
  assert votes[0] == errors  # the vote after the report: a no


def test_after_a_failed_collective_the_next_poll_goes_through_and_says_ok(tmp_path):
  """A poll's collective that times out (here: a member alone in an all-gather) closes the gloo
  group's connections, and torchft configures a new group only on a new quorum id: the
  failing member votes no at once, so the Lighthouse gives the next quorum of the same members
  a new id and the next poll's headers' all-gather goes through (without the vote it failed
  again, and every later poll, until a member left). Each header's ``ok`` is its own quorum's:
  the failure of the poll before does not abort the round the next poll closes (it did when
  the header was made before the quorum cleared torchft's error)."""
  import concurrent.futures

  import torch
  from torchft._torchft import LighthouseServer

  lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100,
                                quorum_tick_ms=10)
  ports = _ports(tmp_path, behind_restarted=False)
  try:
    for port in ports:
      port._open(f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}", "127.0.0.1", 2,
                 quorum_timeout=10.0, timeout=1.0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      def poll():
        list(pool.map(lambda p: p._quorum(), ports))
        ids = {p._manager._quorum_id for p in ports}
        return ids, list(pool.map(lambda p: p._allgather(torch.tensor([p.slot])), ports))

      first, _ = poll()
      assert ports[0]._allgather(torch.tensor([0])) is None  # alone: it times out
      ports[0]._closed = ports[1]._closed  # the two closed the same rounds
      heads = list(pool.map(lambda p: p._headers(p._header()), ports))
      second = {p._manager._quorum_id for p in ports}
  finally:
    for port in ports:
      port.shutdown()
    lighthouse.shutdown()
  assert len(first) == len(second) == 1 and second != first
  assert [[(h.slot, h.ok) for h in got] for got in heads] == [[(0, 1), (1, 1)]] * 2
