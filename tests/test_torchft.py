"""The torchft engine end to end: a Lighthouse and 3 replica processes on 127.0.0.1, a `kill -9`
and a restart under the same id (it heals), a `SIGSTOP`/`SIGCONT`; every committed round's
global state hash is equal on every replica that committed it.

Needs the ``ft`` extra; with ``OPTAX_DIST_REQUIRE_FT=1`` (``make test``) a missing extra fails
the run instead of skipping it.
"""

import json
import pickle
import re
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error

import pytest

try:
  from torchft.coordination import LighthouseServer
except ModuleNotFoundError as e:
  if os.environ.get("OPTAX_DIST_REQUIRE_FT") == "1":
    raise ModuleNotFoundError(
      f"OPTAX_DIST_REQUIRE_FT=1 but {e.name!r} is missing: pip install 'optax-dist[ft]'",
      name=e.name) from None
  pytest.skip("needs the ft extra (torch, torchft)", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEARTBEAT_S = 1.0
TIMEOUT_S = 3.0  # a collective, a heal, the vote
STOP_S = 5.0  # longer than the collective's timeout and the Lighthouse's heartbeat timeout


class Run:
  """A Lighthouse in this process and replica processes, each in its own process group."""

  def __init__(self, out: pathlib.Path):
    self.out = out
    self.lighthouse = LighthouseServer(
      bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=300, quorum_tick_ms=20,
      heartbeat_timeout_ms=int(HEARTBEAT_S * 1000))
    self.url = "http://127.0.0.1:" + self.lighthouse.address().rsplit(":", 1)[1]
    self.procs: dict[int, subprocess.Popen] = {}
    self.env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFT_")}
    self.env["PYTHONPATH"] = str(ROOT)

  def start(self, i: int) -> None:
    log = open(self.out / f"replica_{i}.stderr", "a")
    self.procs[i] = subprocess.Popen(
      [sys.executable, "-m", "optax_dist.fault_tolerance.replica", "--lighthouse", self.url,
       "--replica-id", str(i), "--out", str(self.out), "--steps", "1000000",
       "--sync-period", "5", "--min-replicas", "2", "--timeout", str(TIMEOUT_S),
       "--quorum-timeout", "60", "--parent-death"],
      env=self.env, stdout=log, stderr=log, start_new_session=True)
    log.close()

  def signal(self, i: int, sig: int) -> None:
    os.killpg(self.procs[i].pid, sig)

  def lines(self, i: int) -> list[dict]:
    path = self.out / "replicas" / f"replica_{i}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

  def wait(self, what: str, predicate, timeout: float = 60.0) -> None:
    """Polls ``predicate()`` until true; fails naming ``what`` and every replica's stderr
    tail if a replica exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while not predicate():
      dead = [i for i, p in self.procs.items() if p.poll() is not None]
      if dead or time.monotonic() > deadline:
        tails = "\n".join(
          f"--- replica {i}:\n" + (self.out / f"replica_{i}.stderr").read_text()[-2000:]
          for i in self.procs)
        pytest.fail(f"waiting for {what}: replicas {dead} exited or timed out\n{tails}")
      time.sleep(0.05)

  def close(self) -> None:
    for i, p in self.procs.items():
      if p.poll() is None:
        self.signal(i, signal.SIGKILL)
      p.wait()
    self.lighthouse.shutdown()


def _committed(lines: list[dict], after: float = 0.0, members=None) -> list[dict]:
  return [line for line in lines if line["committed"] and line["time"] > after
          and (members is None or sorted(line["members"]) == members)]


@pytest.mark.slow
def test_kill_restart_heal_and_stop_keep_committed_states_equal(tmp_path):
  run = Run(tmp_path)
  try:
    for i in range(3):
      run.start(i)
    run.wait("3 committed rounds of all three", lambda: all(
      len(_committed(run.lines(i), members=[0, 1, 2])) >= 3 for i in range(3)), timeout=90)

    killed = time.time()
    run.signal(2, signal.SIGKILL)
    run.procs.pop(2).wait()
    run.wait("a quorum without the killed replica", lambda: _committed(
      run.lines(0), killed, [0, 1]))
    dropped = _committed(run.lines(0), killed, [0, 1])[0]["time"] - killed

    run.start(2)
    run.wait("the restarted replica healed and committed twice", lambda: len(_committed(
      [line for line in run.lines(2) if line["pid"] == run.procs[2].pid], killed)) >= 3)
    heal = next(line for line in run.lines(2) if line["healed"] and line["time"] > killed)

    stopped = time.time()
    run.signal(1, signal.SIGSTOP)
    run.wait("a quorum without the stopped replica", lambda: _committed(
      run.lines(0), stopped, [0, 2]))
    time.sleep(max(0.0, stopped + STOP_S - time.time()))
    resumed = time.time()
    run.signal(1, signal.SIGCONT)
    run.wait("the resumed replica committing again", lambda: len(_committed(
      run.lines(1), resumed, [0, 1, 2])) >= 2)
  finally:
    run.close()

  by_round: dict[int, set] = {}
  for i in range(3):
    for line in _committed(run.lines(i)):
      by_round.setdefault(line["round"], set()).add((line["state_hash"], line["step"]))
  assert all(len(states) == 1 for states in by_round.values()), {
    r: s for r, s in by_round.items() if len(s) > 1}
  assert heal["replica"] == 2 and heal["weight"] == 0 and heal["committed"]
  assert any(line["healed"] for line in run.lines(1) if line["time"] > resumed)
  print(f"quorum without the killed replica committed {dropped:.2f} s after the kill;"
        f" the restarted replica's quorum with its heal took {heal['quorum_seconds']:.3f} s")


# ------------------------------------------------------------------------------------------------
# The heal transport.


def _heal_state():
  import jax.numpy as jnp
  import optax

  from optax_dist import fault_tolerance as ft

  protocol = ft.RoundProtocol("diloco", optax.sgd(0.1), sync_period=2)
  return ft.global_state(protocol.init({"w": jnp.arange(6.0).reshape(2, 3)}))


def test_heal_transport_sends_heal_bytes_over_http_on_the_address_given():
  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import torchft_engine as te

  state = _heal_state()
  sent = {"user": {"default": ft.encode_heal(state)},
          "torchft": {"step": 3, "batches_committed": 7}}
  transport = te.HealTransport("127.0.0.1", timeout=2.0)
  try:
    assert transport._server.socket.getsockname()[0] == "127.0.0.1"
    assert transport.metadata().startswith("http://127.0.0.1:")
    transport.send_checkpoint([1], 3, sent, None)
    got = transport.recv_checkpoint(0, transport.metadata(), 3, None)
    assert got == sent
    ft.decode_heal(got["user"]["default"], state, replica="0")
    transport.disallow_checkpoint()
    # Nothing staged: refused after the timeout.
    with pytest.raises(urllib.error.HTTPError, match="404"):
      transport.recv_checkpoint(0, transport.metadata(), 3, None)
  finally:
    transport.shutdown()
  with pytest.raises(ValueError, match=r"HealTransport\(host=...\)` must be a specific address"):
    te.HealTransport("0.0.0.0", timeout=1.0)


RAN = []


def _record(what):
  RAN.append(what)
  return what


class _Payload:
  def __reduce__(self):
    return _record, ("unpickled",)


def test_heal_frame_of_a_pickle_is_refused_and_runs_nothing():
  from optax_dist.fault_tolerance import torchft_engine as te

  blob = pickle.dumps({"user": _Payload()})
  with pytest.raises(ValueError, match="does not start with"):
    te._unframe(blob, "rank 0")
  framed = te.FRAME_MAGIC + len(blob).to_bytes(8, "big") + blob  # a pickle as the counters
  with pytest.raises(ValueError, match="rank 0: the counters are not JSON"):
    te._unframe(framed, "rank 0")
  assert RAN == []


# ------------------------------------------------------------------------------------------------
# The launcher.


def _tail(out: pathlib.Path) -> str:
  return "\n".join(f"--- {path.name}:\n{path.read_text()[-2000:]}"
                   for path in sorted(out.glob("*.log")))


@pytest.mark.slow
def test_launcher_restarts_a_killed_replica_which_heals_and_the_run_ends(tmp_path):
  # min_replicas = R: no quorum forms while a replica is dead, so the run waits for the
  # restart whatever the machine's speed.
  rounds = 100
  env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFT_")}
  env["PYTHONPATH"] = str(ROOT)
  log = open(tmp_path / "launcher.log", "w")
  launcher = subprocess.Popen(
    [sys.executable, "-m", "optax_dist.fault_tolerance.launcher", "--replicas", "3",
     "--min-replicas", "3", "--out", str(tmp_path), "--restart-delay", "0.2",
     "--lighthouse-heartbeat-timeout", str(HEARTBEAT_S), "--", "--steps", str(5 * rounds),
     "--sync-period", "5", "--timeout", str(TIMEOUT_S), "--quorum-timeout", "60"],
    env=env, stdout=log, stderr=log, start_new_session=True)
  log.close()  # a file, not a pipe: the Lighthouse's log would fill a pipe nobody reads

  def lines(i):
    path = tmp_path / "replicas" / f"replica_{i}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

  try:
    deadline = time.monotonic() + 90
    while len(_committed(lines(2))) < 3:
      assert launcher.poll() is None and time.monotonic() < deadline, _tail(tmp_path)
      time.sleep(0.02)
    first = lines(2)[0]["pid"]
    os.kill(first, signal.SIGKILL)
    assert launcher.wait(timeout=100) == 0, _tail(tmp_path)
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()

  restarted = [line for line in lines(2) if line["pid"] != first]
  assert restarted and restarted[0]["healed"] and restarted[0]["committed"]
  by_round: dict[int, set] = {}
  for i in range(3):
    for line in _committed(lines(i)):
      by_round.setdefault(line["round"], set()).add(line["state_hash"])
  # The round indices count the aborted rounds (the one in flight at the kill) too.
  assert len(by_round) == rounds
  assert all(len(hashes) == 1 for hashes in by_round.values())
  assert len({(lines(i)[-1]["round"], lines(i)[-1]["state_hash"], lines(i)[-1]["committed"])
              for i in range(3)}) == 1


# ------------------------------------------------------------------------------------------------
# Bad input.


def test_bad_input(tmp_path, capsys):
  import jax.numpy as jnp
  import optax

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import launcher
  from optax_dist.fault_tolerance import torchft_engine as te

  protocol = ft.RoundProtocol("diloco", optax.sgd(0.1), sync_period=2)
  args = (protocol, jnp.zeros(2), lambda p, b: p, lambda seed, slot, step: 0)
  kwargs = dict(lighthouse="http://127.0.0.1:1", replica_id=0, out=tmp_path)
  with pytest.raises(ValueError, match=r"TorchftReplica\(lighthouse=...\)` must be an http://"
                     r" URL, got '127.0.0.1:1'"):
    te.TorchftReplica(*args, **dict(kwargs, lighthouse="127.0.0.1:1"))
  with pytest.raises(ValueError, match=r"TorchftReplica\(replica_id=...\)` must be an int >= 0,"
                     r" got -1"):
    te.TorchftReplica(*args, **dict(kwargs, replica_id=-1))
  with pytest.raises(ValueError, match=r"TorchftReplica\(timeout=...\)` must be a positive"
                     r" number of seconds, got 0"):
    te.TorchftReplica(*args, **kwargs, timeout=0)
  for flags, said in ((["--replicas", "0"], "--replicas must be a positive int, got 0"),
                      (["--replicas", "2", "--min-replicas", "3"],
                       r"--min-replicas must be in \[1, --replicas=2\], got 3"),
                      (["--replicas", "2", "--host", "0.0.0.0"],
                       "--host must be a specific address, got '0.0.0.0'"),
                      (["--replicas", "2", "--restart-delay", "-1"],
                       "--restart-delay must be >= 0 seconds, got -1.0")):
    assert launcher.main([*flags, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(said, err), err
