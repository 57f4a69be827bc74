"""``optax-dist train --fault-tolerant --decoupled``: decoupled rounds over torchft, end to end
(digits, 2 replicas, a launcher and its Lighthouse on 127.0.0.1), against the in-process
engines; then the command's one-line refusals (in process).

Two runs, each once per module, replica 1 stopped (``SIGSTOP``) for a second right after a
boundary in each: K = R with an infinite window (the synchronous round, bit for bit: replica 0
waits for it) and K = 1 with a window of 0.3 s (rounds close without it). Every process a run starts is killed at the end of
the module, also after a failure.

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


def _stop_after_boundaries(run: Run, replica: int, tries: int = 4) -> list[float]:
  """Stops ``replica`` for :data:`STOP_S` right after one of its boundaries (it is computing
  then), until a round closes without it (at most ``tries`` times); returns the stops' ends."""
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
    time.sleep(STOP_S)
    os.kill(pid, signal.SIGCONT)
    ends.append(time.time())
  return ends


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The two runs, one after the other: ``"sync"`` (K = R, W = inf) and ``"late"`` (K = 1,
  W = 0.3 s), replica 1 stopped in each."""
  done = {}
  try:
    done["sync"] = Run(tmp_path_factory.mktemp("sync"), "--steps", "400")
    done["sync"].stops = _stop_after_boundaries(done["sync"], 1, tries=1)
    done["sync"].finish()
    done["late"] = Run(tmp_path_factory.mktemp("late"), "--steps", "1000", "--min-quorum", "1",
                       "--grace-window", "0.3")
    done["late"].stops = _stop_after_boundaries(done["late"], 1)
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
  protocol = ft_task.protocol(s)
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
def test_a_late_replica_s_rounds_close_without_it_and_its_payload_counts_once(runs):
  """K = 1, W = 0.3 s: a round closes without the stopped replica; it does not heal (there is
  no heal in decoupled rounds over torchft) and its next payload enters exactly one merge with
  the tokens of its steps since its last merged payload, stale by the rounds it missed, and
  weighs T / (1 + s) (the default rule, ``"dylu"``)."""
  run = runs["late"]
  assert run.stops, "the run ended before replica 1 was stopped"
  _one_hash_per_round(run, 2)
  merges = run.merges(0)
  assert all(x["committed"] for x in merges) and "0 heals" in run.stdout, run.stdout
  without = [x for x in merges if 1 not in [p[0] for p in x["payloads"]]]
  assert without, (run.stops, [(x["round"], x["time"], x["payloads"]) for x in merges],
                   run.boundaries(1))
  for x in merges:  # every payload of replica 1 in exactly one round, its tokens its steps'
    assert len([p for p in x["payloads"] if p[0] == 1]) <= 1
  ones = [(x["round"], p) for x in merges for p in x["payloads"] if p[0] == 1]
  steps = [p[1] for _, p in ones]
  assert steps == sorted(set(steps))
  previous = 0
  for _, (_, step, tokens, stale, weight, merged) in ones:
    assert merged and tokens == 16 * (step - previous) and weight == tokens / (1 + stale), ones
    previous = step
  late = next((r, p) for r, p in ones if r > without[0]["round"])
  missed = late[0] - max((r for r, _ in ones if r < without[0]["round"]), default=-1) - 1
  assert 1 <= late[1][3] <= missed, (late, without[0])
  assert not any(x.get("healed") for x in run.jsonl("replica_1.jsonl"))


@pytest.mark.slow
def test_the_torchft_run_s_lines_replay_in_process_with_the_same_hashes(runs):
  """E3 across engines: the late run's round lines (replica 0's) and both replicas' boundary
  lines, replayed by ``InProcess(replay=...)``, close the same rounds with the same payloads and
  the same state hashes; a boundary moved after the round it landed makes the replay diverge."""
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
  moved = [dict(b, time=b["time"] + 1e-3) if b["landed"] else b for b in bounds]
  with pytest.raises(RuntimeError, match="replay diverges from its log"):
    InProcess(protocol, tokens_per_step=tokens, replay=merges + moved,
              **_decoupled_options(args)).run(train)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
  """K = R, W = inf, the Lighthouse's quorum 2 (replica 0 waits while replica 1 is dead):
  replica 1 killed (``kill -9``) once it has written a committed round's line, and restarted
  by the launcher."""
  run = Run(tmp_path_factory.mktemp("killed"), "--steps", "300", "--min-replicas", "2",
            "--max-restarts", "1", "--restart-delay", "0.2")
  try:
    deadline = time.monotonic() + 120
    while not any(x["committed"] for x in run.merges(1)):
      assert run.proc.poll() is None and time.monotonic() < deadline, run.proc.communicate()
      time.sleep(0.005)
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


@pytest.mark.parametrize("flags, said", [
  (["--min-quorum", "1"], "argument --min-quorum: needs --decoupled"),
  (["--decoupled", "--min-quorum", "3"], ("argument --min-quorum: must be at most --replicas (2),"
   " got 3")),
  (["--decoupled", "--grace-window", "auto"], ("argument --grace-window: auto (the window bounded"
   " by the measured slack) is not built yet")),
  (["--decoupled", "--grace-window", "-1"], ("argument --grace-window: must be seconds >= 0 or"
   " inf, got '-1'")),
  (["--decoupled", "--standby"], ("argument --standby: not with --decoupled, got --standby;"
   " decoupled rounds over torchft do not take it yet")),
  (["--decoupled", "--processes", "2"], ("argument --processes: not with --decoupled, got"
   " --processes 2")),
  (["--decoupled", "--checkpoint-every", "5"], ("argument --checkpoint-every: not with"
   " --decoupled, got --checkpoint-every 5")),
  (["--decoupled", "--staleness-rule", "age_gate", "--max-staleness", "-1"],
   "argument --max-staleness: must be an integer >= 0 with --decoupled, got -1"),
  (["--decoupled", "--staleness-rule", "delayed_nesterov"], ("argument --staleness-rule:"
   " `train(staleness_rule='delayed_nesterov')` needs RoundProtocol(outer=")),
])
def test_refusals_are_one_line(flags, said, tmp_path, capsys):
  base = ["train", "--algorithm", "diloco", "--fault-tolerant", "--replicas", "2", "--devices",
          "1", "--steps", "20", "--sync-period", "5"]
  line = one_line_error(capsys, *base, *flags, "--out", str(tmp_path))
  assert said in line, line
  assert not (tmp_path / "replicas").exists()


def test_a_decoupled_flag_without_fault_tolerance_is_refused(tmp_path, capsys):
  line = one_line_error(capsys, "train", "--decoupled", "--out", str(tmp_path))
  assert line == "optax-dist: error: argument --decoupled: needs --fault-tolerant", line


@pytest.mark.parametrize("options, said", [
  ({"min_quorum": 0}, "`Torchft(min_quorum=...)` must be a positive int, got 0."),
  ({"grace_window": -1.0}, "`Torchft(grace_window=...)`"),
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
