"""The torchft engine end to end: the launcher (a Lighthouse and 3 replica processes on
127.0.0.1), a `kill -9` and the restart under the same id (it heals), a `SIGSTOP`/`SIGCONT`, a
`kill -9` of the Lighthouse (restarted on its address), a `kill -9` of every replica at once
(restarted, they go on from the newest checkpoint), the launcher's death (its processes
follow); every committed round's global state hash is equal on
every replica that committed it. Then the heal transport and bad input.

Needs the ``ft`` extra; with ``OPTAX_DIST_REQUIRE_FT=1`` (``make test``) a missing extra fails
the run instead of skipping it.
"""

import ipaddress
import json
import os
import pathlib
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.error

import pytest
from _helpers import PicklePayload, alive, require_ft

require_ft()

from optax_dist.fault_tolerance import checkpoints  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINEAR = str(ROOT / "tests" / "_ft_linear.py")  # the toy run: its launcher and its replicas
HEARTBEAT_S = 1.0
TIMEOUT_S = 3.0  # a collective, a heal, the vote
STOP_S = 5.0  # longer than the collective's timeout and the Lighthouse's heartbeat timeout


class Run:
  """The launcher as a process of its own session: its Lighthouse and 3 replica processes
  (which die with it). A replica's pid is in its log lines."""

  def __init__(self, out: pathlib.Path, *, min_replicas: int, steps: int, standby=False):
    self.out = out
    self.env = env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFT_")}
    env["PYTHONPATH"] = str(ROOT)
    with open(out / "launcher.log", "w") as log:  # a file: a full pipe would stall the Lighthouse
      self.proc = subprocess.Popen(
        [sys.executable, LINEAR, "launch", "--replicas", "3",
         "--min-replicas", str(min_replicas), "--out", str(out), "--restart-delay", "0.5",
         "--lighthouse-heartbeat-timeout", str(HEARTBEAT_S), *["--standby"] * standby,
         "--exchange-timeout", str(TIMEOUT_S), "--quorum-timeout", "60",
         "--", "--steps", str(steps), "--sync-period", "5", "--checkpoint-every", "50"],
        env=env, stdout=log, stderr=log, start_new_session=True)

  def lines(self, i: int) -> list[dict]:
    path = self.out / "replicas" / f"replica_{i}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

  def pid(self, i: int) -> int:
    return self.lines(i)[-1]["pid"]

  def wait(self, what: str, predicate, timeout: float = 60.0) -> None:
    """Polls ``predicate()`` until true; fails naming ``what`` with the logs' tails if the
    launcher exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while not predicate():
      if self.proc.poll() is not None or time.monotonic() > deadline:
        tails = "\n".join(f"--- {path.name}:\n{path.read_text()[-2000:]}"
                          for path in sorted(self.out.glob("*.log")))
        pytest.fail(f"waiting for {what}: the launcher exited or the time ran out\n{tails}")
      time.sleep(0.02)

  def lighthouse(self) -> int:
    """The pid of the launcher's Lighthouse process (which it writes in OUT/lighthouse.pid),
    checked to be its child."""
    pid = int((self.out / "lighthouse.pid").read_text())
    children = pathlib.Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
    assert str(pid) in children.split(), (pid, children)
    return pid

  def close(self) -> None:
    """Kills the launcher; its replicas die with it (parent-death signal)."""
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
    self.proc.wait()


def _committed(lines: list[dict], after: float = 0.0, members=None) -> list[dict]:
  return [line for line in lines if line["committed"] and line["time"] > after
          and (members is None or sorted(line["members"]) == members)]


def _states_by_round(run: Run, keep=lambda line: True) -> dict[int, set]:
  """Round -> the ``(state_hash, step)`` pairs of its committed lines that ``keep``."""
  by_round: dict[int, set] = {}
  for i in range(3):
    for line in filter(keep, _committed(run.lines(i))):
      by_round.setdefault(line["round"], set()).add((line["state_hash"], line["step"]))
  return by_round


@pytest.mark.slow
def test_kill_restart_heal_and_stop_keep_committed_states_equal(tmp_path):
  run = Run(tmp_path, min_replicas=2, steps=10**7)  # runs until the test kills the launcher
  try:
    run.wait("3 committed rounds of all three", lambda: all(
      len(_committed(run.lines(i), members=[0, 1, 2])) >= 3 for i in range(3)), timeout=90)

    killed, first = time.time(), run.pid(2)
    os.kill(first, signal.SIGKILL)
    run.wait("a quorum without the killed replica", lambda: _committed(
      run.lines(0), killed, [0, 1]))
    dropped = _committed(run.lines(0), killed, [0, 1])[0]["time"] - killed
    run.wait("the restarted replica healed and committed 3 times", lambda: len(_committed(
      [line for line in run.lines(2) if line["pid"] != first], killed)) >= 3)
    heal = next(line for line in run.lines(2) if line["pid"] != first)

    stopped = time.time()
    os.kill(run.pid(1), signal.SIGSTOP)
    run.wait("a quorum without the stopped replica", lambda: _committed(
      run.lines(0), stopped, [0, 2]))
    time.sleep(max(0.0, stopped + STOP_S - time.time()))
    resumed = time.time()
    os.kill(run.pid(1), signal.SIGCONT)
    run.wait("the resumed replica committing again", lambda: len(_committed(
      run.lines(1), resumed, [0, 1, 2])) >= 2)

    # A foreign replica (another data seed) joins: the round aborts, it leaves, the run goes on.
    url = (tmp_path / "launcher.log").read_text().split("lighthouse ", 1)[1].split()[0]
    foreign = subprocess.run(
      [sys.executable, LINEAR, "replica", "--lighthouse", url,
       "--replica-id", "3", "--out", str(tmp_path), "--steps", str(10**7), "--sync-period", "5",
       "--seed", "1", "--exchange-timeout", str(TIMEOUT_S), "--parent-death"],
      env=run.env, capture_output=True, text=True, timeout=90, check=False)
    assert foreign.returncode == 2 and foreign.stderr.endswith(
      "differ from the run's: algorithm, sync period, wire format, params' shapes, seed and"
      " tokens per step must be every replica's\n"), foreign.stderr[-3000:]
    left = time.time()
    run.wait("a committed round of the three after the foreign replica left", lambda: _committed(
      run.lines(0), left, [0, 1, 2]))
    # Its one round with the run's members aborted on each of them, and it committed none.
    met = [line for i in range(3) for line in run.lines(i) if 3 in line["members"]]
    assert met and not any(line["committed"] for line in met)
    assert not any(line["committed"] for line in run.lines(3))
    said = re.search(r"replica 3 holds no round of its Lighthouse and met replicas \[([0-9, ]+)\]"
                     r" of another fingerprint", foreign.stderr)
    assert said and sorted(map(int, said[1].split(","))) in (
      sorted(set(line["members"]) - {3}) for line in met), foreign.stderr[-3000:]

    lighthouse, lost = run.lighthouse(), time.time()
    os.kill(lighthouse, signal.SIGKILL)
    run.wait("a committed round of the three after the Lighthouse's restart", lambda: _committed(
      run.lines(0), lost + 0.5, [0, 1, 2]))
    stall = _committed(run.lines(0), lost + 0.5, [0, 1, 2])[0]["time"] - lost
    assert f"restarting it on {url}" in (tmp_path / "launcher.log").read_text()
    assert run.lighthouse() != lighthouse

    # Every replica at once: restarted, they go on from the newest checkpoint.
    dead, all_dead = [run.pid(i) for i in range(3)], time.time()
    for pid in dead:
      os.kill(pid, signal.SIGKILL)
    run.wait("a committed round of the three after they all died", lambda: all(_committed(
      [line for line in run.lines(i) if line["pid"] != dead[i]], all_dead) for i in range(3)))
    restored = max(meta["step"] for meta in checkpoints.saved(tmp_path / "replicas/checkpoints")
                   if meta["time"] < all_dead)
    pids = [run.pid(i) for i in range(3)]
    firsts = [next(line for line in run.lines(i) if line["pid"] == pids[i]) for i in range(3)]

    processes = [run.pid(i) for i in range(3)] + [run.lighthouse()]
    os.kill(run.proc.pid, signal.SIGKILL)  # the launcher alone: its processes must follow
    deadline = time.monotonic() + 10
    while any(map(alive, processes)) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not any(map(alive, processes))
  finally:
    run.close()

  # One state per committed round before every replica died, and one after: the rounds after
  # the checkpoint are committed again, from it, by the quorums of then (other members, so
  # other states).
  # (By process: a replica killed last can still log a round after the first kill.)
  for restarted in (False, True):
    by_round = _states_by_round(run, lambda line: (line["pid"] in pids) == restarted)
    assert all(len(states) == 1 for states in by_round.values()), {
      r: s for r, s in by_round.items() if len(s) > 1}
  assert heal["healed"] and heal["weight"] == 0 and heal["committed"]
  assert heal["donor"] in (0, 1) and heal["donor"] in heal["members"]  # torchft's source rank
  assert all(0.0 <= line["loss"] < float("inf") for i in range(3) for line in run.lines(i))
  assert all(0.0 < line["quorum_seconds"] <= line["exchange_seconds"]  # the quorum in it
             for i in range(3) for line in run.lines(i))
  # Restored, a replica's first round ends H after the checkpoint (one that started late heals
  # from one restored).
  assert all(line["healed"] or line["step"] == restored + 5 for line in firsts), firsts
  assert not all(line["healed"] for line in firsts), firsts
  assert any(line["healed"] for line in run.lines(1) if line["time"] > resumed)
  print(f"quorum without the killed replica committed {dropped:.2f} s after the kill;"
        f" the restarted replica's quorum with its heal took {heal['quorum_seconds']:.3f} s;"
        f" a commit of the three {stall:.2f} s after the Lighthouse's kill")


def _standbys(out: pathlib.Path) -> dict[int, int]:
  """Replica id -> the pid of its waiting standby (``--wait-for-takeover``), of the run ``out``."""
  found = {}
  for entry in pathlib.Path("/proc").glob("[0-9]*"):
    try:
      args = (entry / "cmdline").read_bytes().decode().split("\0")
    except OSError:
      continue
    if "--wait-for-takeover" in args and str(out) in args:
      found[int(args[args.index("--replica-id") + 1])] = int(entry.name)
  return found


def _policies(pid: int) -> set[int]:
  """The scheduling policies of the threads of process ``pid``."""
  return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.slow
def test_launcher_s_standby_takes_over_a_killed_replica_which_heals_and_the_run_ends(tmp_path):
  # min_replicas = R: no quorum forms while a replica is dead, so the run waits for the
  # takeover whatever the machine's speed.
  rounds = 100
  run = Run(tmp_path, min_replicas=3, steps=5 * rounds, standby=True)
  try:
    run.wait("3 committed rounds of replica 2 and its standby",
             lambda: len(_committed(run.lines(2))) >= 3 and 2 in _standbys(tmp_path), timeout=90)
    first, standby = run.pid(2), _standbys(tmp_path)[2]
    assert int((tmp_path / "replica_2.pid").read_text()) == first
    assert _policies(standby) == {os.SCHED_IDLE}  # waiting, it takes only idle CPU
    killed = time.time()
    os.kill(first, signal.SIGKILL)
    run.wait("the standby's takeover", lambda: _committed(run.lines(2), killed))
    assert int((tmp_path / "replica_2.pid").read_text()) == standby
    assert _policies(standby) == {os.SCHED_OTHER}
    run.wait("a new standby for replica 2", lambda: _standbys(tmp_path).get(2, standby) != standby)
    standbys = _standbys(tmp_path).values()
    assert run.proc.wait(timeout=100) == 0
  finally:
    run.close()

  assert not any(map(alive, standbys))  # the launcher ends its standbys
  restarted = [line for line in run.lines(2) if line["pid"] != first]
  assert restarted and restarted[0]["pid"] == standby
  assert restarted[0]["healed"] and restarted[0]["committed"]
  print(f"the standby's first commit {restarted[0]['time'] - killed:.2f} s after the kill")
  by_round = _states_by_round(run)
  # The round indices count the aborted rounds (the one in flight at the kill) too.
  assert len(by_round) == rounds
  assert all(len(states) == 1 for states in by_round.values())
  assert len({(run.lines(i)[-1]["round"], run.lines(i)[-1]["state_hash"],
               run.lines(i)[-1]["committed"]) for i in range(3)}) == 1


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
  from optax_dist.fault_tolerance import torchft_session as te

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




def _ipv6_loopback() -> bool:
  try:
    with socket.socket(socket.AF_INET6) as s:
      s.bind(("::1", 0))
    return True
  except OSError:
    return False


IPV6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) here")


@IPV6
def test_heal_transport_on_an_ipv6_address_binds_it_and_brackets_its_url():
  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import torchft_session as te

  state = _heal_state()
  sent = {"user": {"default": ft.encode_heal(state)}, "torchft": {"step": 2}}
  transport = te.HealTransport("::1", timeout=2.0)
  try:
    assert transport._server.socket.getsockname()[0] == "::1"
    assert transport.metadata() == f"http://[::1]:{transport._server.server_address[1]}"
    transport.send_checkpoint([1], 2, sent, None)
    assert transport.recv_checkpoint(0, transport.metadata(), 2, None) == sent
  finally:
    transport.shutdown()


@pytest.mark.parametrize("host", ["0", "0.0.0.0", "::", "[::]", ""])
def test_an_unspecified_host_is_refused_by_the_engine_and_the_heal_server(tmp_path, host):
  import optax

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import torchft_engine as te
  from optax_dist.fault_tolerance import torchft_session as ts

  said = f"must be a specific address, got {host!r}"
  with pytest.raises(ValueError, match=rf"^`HealTransport\(host=\.\.\.\)` {re.escape(said)}"):
    ts.HealTransport(host, timeout=1.0)
  protocol = ft.RoundProtocol("diloco", optax.sgd(0.1), sync_period=2)
  with pytest.raises(ValueError, match=rf"^`Torchft\(host=\.\.\.\)` {re.escape(said)}"):
    te.Torchft(protocol, lighthouse="http://127.0.0.1:1", replica_id=0, out=tmp_path, host=host)


def _listening(pid: int) -> set[tuple[str, int]]:
  """The ``(address, port)`` pairs process ``pid`` listens on over TCP: the rows of
  ``/proc/net/tcp`` and ``tcp6`` in state LISTEN whose socket is one of its descriptors (gloo's
  and torchft's Rust servers' too, which no Python object shows)."""
  inodes = set()
  for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
    try:
      target = os.readlink(fd)
    except OSError:  # closed meanwhile
      continue
    if target.startswith("socket:["):
      inodes.add(target[len("socket:["):-1])
  found = set()
  for table in ("tcp", "tcp6"):
    for row in pathlib.Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
      fields = row.split()
      if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
        continue
      address, port = fields[1].split(":")
      # the address's 32-bit words, each printed as a number in the host's byte order
      words = [bytes.fromhex(address[i:i + 8]) for i in range(0, len(address), 8)]
      raw = b"".join(w[::-1] if sys.byteorder == "little" else w for w in words)
      found.add((str(ipaddress.ip_address(raw)), int(port, 16)))
  return found


def _port(url: str) -> int:
  return int(url.rsplit(":", 1)[1])


@pytest.mark.parametrize("host", ["127.0.0.1", pytest.param("::1", marks=IPV6)])
def test_a_replica_s_session_listens_on_its_address_but_torchft_s_manager_server(host):
  """Two replicas' sessions in this process, in an exchange over a Lighthouse on ``host``:
  every socket they listen on is on ``host`` (the Lighthouse, each store, heal server and gloo
  device), but torchft's manager servers' (``[::]``, the trust model says); replica 1, a step
  behind, heals from replica 0 over the heal server on ``host``."""
  import concurrent.futures

  import torch
  from torchft._torchft import LighthouseServer

  from optax_dist.fault_tolerance import torchft_session as ts
  from optax_dist.fault_tolerance.launcher import url_host

  class Member(ts.Session):
    def __init__(self, slot):
      self.slot, self.healed = slot, None

    def _heal_bytes(self):
      return f"state of {self.slot}".encode()

    def _load(self, payload):
      self.healed = payload

  before = _listening(os.getpid())
  lighthouse = LighthouseServer(bind=f"{url_host(host)}:0", min_replicas=2, join_timeout_ms=100,
                                quorum_tick_ms=10)
  members = []
  try:
    for slot in range(2):
      member = Member(slot)
      member._open(f"http://{url_host(host)}:{_port(lighthouse.address())}", host, 2,
                   quorum_timeout=10.0, timeout=5.0)
      members.append(member)
    members[0]._manager.load_state_dict({"step": 1, "batches_committed": 0})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      list(pool.map(lambda m: m._quorum(), members))
      gathered = list(pool.map(lambda m: m._allgather(torch.tensor([m.slot])), members))
      opened = _listening(os.getpid()) - before  # in the exchange: gathered, not voted yet
      votes = list(pool.map(lambda m: m._vote(), members))
  finally:
    for m in members:
      m._manager.shutdown(wait=False)
    lighthouse.shutdown()

  assert [[int(t) for t in outs] for outs in gathered] == [[0, 1]] * 2 and votes == [True] * 2
  assert [m.healed for m in members] == [None, b"state of 0"]
  on_host = {port for address, port in opened if address == host}
  assert {port for address, port in opened if address != host} == {
    _port(m._manager._manager.address()) for m in members}, opened
  assert {address for address, _ in opened} == {host, "::"}, opened
  for m in members:
    assert {m._store.port, _port(m.transport.metadata())} <= on_host, opened
  # the Lighthouse, and each member's store, heal server and gloo device (at least one)
  assert _port(lighthouse.address()) in on_host and len(on_host) >= 7, opened


def test_heal_frame_of_a_pickle_is_refused_and_runs_nothing():
  from optax_dist.fault_tolerance import torchft_session as te

  blob = pickle.dumps({"user": PicklePayload()})
  with pytest.raises(ValueError, match="does not start with"):
    te._unframe(blob, "rank 0")
  framed = te.FRAME_MAGIC + len(blob).to_bytes(8, "big") + blob  # a pickle as the counters
  with pytest.raises(ValueError, match="rank 0: the counters are not JSON"):
    te._unframe(framed, "rank 0")
  assert PicklePayload.RAN == []


# ------------------------------------------------------------------------------------------------
# The settings fingerprint.


def test_settings_fingerprint_tells_runs_apart():
  import jax.numpy as jnp
  import optax

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import decision as te

  def fingerprint(sync_period=2, shape=(2, 3), seed=0, tokens=8, comm_dtype=None):
    protocol = ft.RoundProtocol("diloco", optax.sgd(0.1), sync_period=sync_period,
                                comm_dtype=comm_dtype)
    return te.settings_fingerprint(protocol, {"w": jnp.zeros(shape)}, seed=seed,
                                   tokens_per_step=tokens)

  base = fingerprint()
  assert base == fingerprint()  # another protocol object, the same settings
  others = [fingerprint(sync_period=3), fingerprint(shape=(3, 2)), fingerprint(seed=1),
            fingerprint(tokens=16), fingerprint(comm_dtype=jnp.bfloat16)]
  assert len({base, *others}) == 1 + len(others)
  assert -2**63 <= base < 2**63
  # A quantized payload is sent as codes and scales: a replica of the version that sent float32
  # values (these fingerprints, that version's) must not meet this one's in a round; a run whose
  # payload's wire is unchanged keeps its fingerprint, and its checkpoints restore.
  assert base == 4266390775387968191 and fingerprint(comm_dtype="int8") != 4911211853231108295
  protocol = ft.RoundProtocol("diloco", optax.sgd(0.1), sync_period=2)
  runs = [te.settings_fingerprint(protocol, {"w": jnp.zeros((2, 3))}, seed=0, tokens_per_step=8,
                                  run_id=run) for run in (None, "a", "b")]
  assert runs[0] == base and len(set(runs)) == 3  # a run id tells runs of one setting apart
  heads = [te.Header(i, 1, 1, fp, 0) for i, fp in enumerate([5, 7, 7])]
  assert te.foreign(heads, 7) == [0] and te.foreign(heads, 5) == [1, 2]  # each its own: no vote


class GlooAbort(BaseException):
  """gloo's abort of the process on an all-gather of buffers of different sizes."""


class FakeGroup:
  """A process group of two members, this replica at rank 1: each all-gather hands back
  ``peer``'s next buffer at rank 0 and this replica's own at rank 1, or raises the next one if
  it is an exception."""

  def __init__(self, *peer):
    self.peer, self.sizes = list(peer), []

  def allgather(self, outs, mine, options):
    self.sizes.append(mine[0].numel() * mine[0].element_size())  # the bytes this member sends
    peer = self.peer.pop(0)
    if isinstance(peer, Exception):
      raise peer
    if peer.shape != mine[0].shape:  # gloo terminates the process: no exception to catch
      raise GlooAbort(f"buffers of {tuple(peer.shape)} and {tuple(mine[0].shape)}")
    outs[0][0].copy_(peer)
    outs[0][1].copy_(mine[0])
    return types.SimpleNamespace(wait=lambda: None)


class FakeManager:
  """torchft's ``Manager`` as a round uses it: a vote is yes unless an error was reported;
  ``step`` is torchft's (its committed rounds)."""

  def __init__(self):
    self.errors, self.step = [], 0

  def current_step(self):
    return self.step

  def state_dict(self):
    return {"step": self.step, "batches_committed": 0}

  def load_state_dict(self, steps):
    self.step = steps["step"]

  def errored(self):
    return None

  def num_participants(self):
    return 2

  def report_error(self, e):
    self.errors.append(e)

  def should_commit(self):
    return not self.errors


def _fake_replica(tmp_path, protocol, params, peer, exchange_retries=0, healed_from=None):
  """The torchft engine's end of replica 1 (fingerprint 7 forced, 8 tokens per step) over a
  ``FakeGroup`` of ``peer``'s buffers and a ``FakeManager`` whose errors a quorum clears, and
  its loop: ``run(grads)`` takes the inner steps of one round and returns its log line;
  ``quorums`` counts the quorums asked for. With ``healed_from`` (a donation), the first quorum
  heals the replica from it."""
  from optax_dist.fault_tolerance import heal
  from optax_dist.fault_tolerance import torchft_engine as te

  engine = te.Torchft(protocol, lighthouse="http://127.0.0.1:1", replica_id=1, out=tmp_path,
                      tokens_per_step=8, exchange_retries=exchange_retries, min_replicas=1)
  port = te._Port(engine)
  port.start = lambda replica: None  # no session: the fakes stand in for it
  port._manager, port._pg, port.quorums = FakeManager(), FakeGroup(*peer), []
  port.transport = types.SimpleNamespace(max_bytes=None)

  def quorum():
    port.quorums.append(1)
    port._manager.errors.clear()
    if healed_from is not None and len(port.quorums) == 1:
      port._load(heal.encode_heal(healed_from, fingerprint=port.replica.fingerprint))

  port._quorum = quorum
  replica = port.replica

  def run(grads):
    state = replica.start((params, protocol.tx.init(params)))
    replica.fingerprint = 7
    while replica.last is None:
      state = replica.after_step(protocol.inner_step(*state, grads(state[0], replica.step)))
    return json.loads(port.log_path.read_text().splitlines()[-1])

  return port, run


@pytest.mark.parametrize("algorithm", ["diloco", "streaming_diloco"])
def test_a_member_left_out_of_an_aborted_quorum_sends_nothing_and_takes_the_round_s_step(
    tmp_path, algorithm):
  """Replica 1 was left out of a quorum whose members aborted (torchft's step unchanged: no
  heal) and went on to another round; in the next quorum replica 1 brings the earlier round's
  payload. It must leave that payload out and end the round with the same global state as
  replica 0, whose payload alone is merged; for streaming, whose payload is of the other
  fragment, both vote no without the payloads' all-gather, and replica 1 ends aborted at
  replica 0's step."""
  import jax
  import jax.numpy as jnp
  import optax
  import torch

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import torchft_session as ts

  kw = {"num_fragments": 2, "sync_period": 4} if algorithm == "streaming_diloco" else {
    "sync_period": 2}
  protocol = ft.RoundProtocol(algorithm, optax.sgd(0.1), optax.sgd(0.7, momentum=0.9), **kw)
  params = {"a": jnp.arange(4.0), "b": jnp.ones((2, 2))}

  def grads(p, step):  # the gradient of 0.5 |p - step|^2
    return jax.tree.map(lambda x: x - step, p)

  # replica 0: a round aborted without replica 1, then the next round's steps
  ahead, _ = protocol.run_round(protocol.init(params), grads)
  ahead, sent = protocol.run_round(protocol.abort(ahead), grads)
  streaming = algorithm == "streaming_diloco"
  end = protocol.abort(ahead) if streaming else protocol.commit(
    ahead, protocol.merge([sent.payload], [1]), sent)

  header = [0, 8 * sent.steps, 1, 7, int(ahead.opt_state.local_step)]
  peer = (torch.tensor(header, dtype=torch.int64), ts.pack((sent.payload, None)),
          torch.ones(1, dtype=torch.int64))
  port, run = _fake_replica(tmp_path, protocol, params, peer, exchange_retries=1)
  line = run(grads)
  assert line["committed"] != streaming and line["weight"] == 0 and line["members"] == [0, 1]
  assert line["step"] == header[-1] and line["attempts"] == 1  # a void round is not retried
  assert line["state_hash"] == ft.state_hash(ft.global_state(end))
  assert len(port._pg.peer) == 2 * streaming  # the payloads' and the ack's left out
  # The step taken is placed as the state's other leaves (uncommitted): the next round runs the
  # programs replica 0's rounds compiled, none compiled again.
  state = port.replica.replica_state
  assert not state.opt_state.local_step.committed
  compiled = protocol.inner_step._cache_size(), protocol.send_half._cache_size()
  protocol.run_round(state, grads)
  assert (protocol.inner_step._cache_size(), protocol.send_half._cache_size()) == compiled


def test_a_streaming_replica_healed_in_its_round_sends_the_round_s_fragment_s_size(tmp_path):
  """Replica 1, a round behind on the other fragment, heals at its quorum from replica 0: it
  sends zeros of the size of the round's fragment's payload (weight 0), not its own payload of
  the other fragment, and commits replica 0's round."""
  import jax
  import jax.numpy as jnp
  import optax
  import torch

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import torchft_session as ts

  protocol = ft.RoundProtocol("streaming_diloco", optax.sgd(0.1), optax.sgd(0.7, momentum=0.9),
                              num_fragments=2, sync_period=4)
  params = {"a": jnp.ones((3, 3)), "b": jnp.arange(4.0)}  # fragments of 36 and 16 bytes

  def grads(p, step):  # the gradient of 0.5 |p - step|^2
    return jax.tree.map(lambda x: x - step, p)

  donor, sent = protocol.run_round(protocol.init(params), grads)
  donor, sent = protocol.run_round(protocol.commit(donor, protocol.merge([sent.payload], [1]),
                                                   sent), grads)
  end = protocol.commit(donor, protocol.merge([sent.payload], [1]), sent)
  header = [0, 8 * sent.steps, 1, 7, int(donor.opt_state.local_step)]
  peer = (torch.tensor(header, dtype=torch.int64), ts.pack((sent.payload, None)),
          torch.ones(1, dtype=torch.int64))
  _, run = _fake_replica(tmp_path, protocol, params, peer, healed_from=ft.heal_state(donor))
  line = run(grads)
  assert line["committed"] and line["healed"] and line["weight"] == 0
  assert line["step"] == header[-1] and line["members"] == [0, 1]
  assert line["state_hash"] == ft.state_hash(ft.global_state(end))


@pytest.mark.parametrize("failed, retries, committed", [
  (0, 1, True),  # the headers' all-gather failed: a new quorum, the same payload, a commit
  (1, 2, True),  # the payloads'
  (0, 0, False),  # no retry asked for
  (2, 1, False),  # the acknowledgement's: a peer may have committed, so it aborts at once
])
def test_an_exchange_failed_before_the_acknowledgement_is_tried_again_in_a_new_quorum(
    tmp_path, failed, retries, committed):
  """Replica 1's exchange fails at the all-gather ``failed`` (a peer stopped in it): with
  retries it asks for a new quorum and exchanges the same payload with the peer that remains
  (committed as the merge of both), unless the failure was the acknowledgement's; then it
  aborts."""
  import jax
  import jax.numpy as jnp
  import optax
  import torch

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import torchft_session as ts

  protocol = ft.RoundProtocol("diloco", optax.sgd(0.1), optax.sgd(0.7, momentum=0.9),
                              sync_period=2)
  params = {"a": jnp.arange(4.0), "b": jnp.ones((2, 2))}

  def grads(p, step):  # the gradient of 0.5 |p - step|^2, every slot's alike
    return jax.tree.map(lambda x: x - step, p)

  state, sent = protocol.run_round(protocol.init(params), grads)
  weight = 8 * sent.steps
  ok = [torch.tensor([0, weight, 1, 7, sent.steps], dtype=torch.int64),
        ts.pack((sent.payload, None)), torch.ones(1, dtype=torch.int64)]
  first = [*ok[:failed], RuntimeError("Connection reset by peer")]
  port, run = _fake_replica(tmp_path, protocol, params, first + ok, retries)
  line = run(grads)
  end = protocol.commit(state, protocol.merge([sent.payload] * 2, [weight] * 2), sent)
  assert line["committed"] == committed
  assert line["attempts"] == len(port.quorums) == 1 + committed
  assert line["members"] == ([0, 1] if committed or failed == 2 else [])
  assert line["state_hash"] == ft.state_hash(ft.global_state(
    end if committed else protocol.abort(state)))
  assert line["weight"] == weight


class ScriptedManager:
  """torchft's ``Manager`` as a quorum request uses it: made unless the script's next entry
  is a ``RuntimeError`` (the Lighthouse unreachable), which it raises; ``start_quorum`` raises
  the script's next entry if it is an exception, else takes it as the quorum's id."""

  def __init__(self, script, made):
    if isinstance(script[0], RuntimeError):
      raise script.pop(0)
    self.script, self.steps, self.shut = script, None, False
    made.append(self)

  def start_quorum(self, timeout):
    entry = self.script.pop(0)
    if isinstance(entry, Exception):
      raise entry
    self._quorum_id = entry

  def state_dict(self):
    return {"step": 9}

  def load_state_dict(self, steps):
    self.steps = steps

  def shutdown(self, wait):
    self.shut = True


@pytest.mark.parametrize("script, restarted, managers, renew", [
  ([12], None, 1, False),  # the next quorum
  ([TimeoutError(), 12], False, 1, False),  # the Lighthouse holds the request: the same manager
  ([TimeoutError(), 12], True, 2, False),  # it lost it: sent again by a new manager
  ([TimeoutError(), 1], True, 2, False),  # ... to a restarted Lighthouse: the new store is empty
  ([TimeoutError(), RuntimeError("failed to connect"), 1], True, 2, False),  # ... not yet up
  ([1], None, 1, True),  # a restarted Lighthouse answered at once: a new manager for the next round
])
def test_a_request_lost_or_answered_by_a_restarted_lighthouse_gets_a_new_manager(
    script, restarted, managers, renew):
  """After a quorum of id 11, replica 1's next request meets ``script``. A request that timed
  out is sent again by a new manager (a fresh store, torchft's step kept) if the Lighthouse has
  lost it (``restarted``), else by the same one, whose store a quorum forming from the held
  request may name; a quorum whose id is below the last one's (a restarted Lighthouse's)
  through a manager of before has the next round's request sent by a new one. So no process
  group's rendezvous reads the addresses an earlier Lighthouse's quorum of the same id left in
  a store."""
  from optax_dist.fault_tolerance import torchft_session as te

  replica, made = object.__new__(te.Session), []
  replica._make_manager = lambda: ScriptedManager(script, made)
  replica._lighthouse_restarted, replica._lighthouse_down = lambda: restarted, lambda: False
  replica._manager_args, replica.quorum_timeout, replica._renew = (), 60.0, False
  replica._manager, replica._torchft_quorum_id = replica._make_manager(), 11
  replica._quorum()
  assert len(made) == managers and not script and replica._renew == renew
  assert [m.shut for m in made] == [True] * (managers - 1) + [False]
  assert [m.steps for m in made[1:]] == [{"step": 9}] * (managers - 1)
  script.append(made[-1]._quorum_id + 1)  # the next quorum
  replica._quorum()
  assert len(made) == managers + renew and not replica._renew
  assert [m.steps for m in made[1:]] == [{"step": 9}] * (managers + renew - 1)


@pytest.mark.parametrize("script", [[12], [RuntimeError("failed to connect"), 12]])
def test_a_request_due_while_the_lighthouse_is_down_goes_through_a_new_manager(script):
  """A request sent while the Lighthouse is down is lost, also once it is back (torchft
  0.2.0's manager server does not send it again), and waits out its attempt: with nothing
  accepting on the Lighthouse's address, replica 1 makes a new manager (torchft's step kept;
  made again while the Lighthouse is not up yet) before it sends its request, which is then
  answered: no request times out."""
  from optax_dist.fault_tolerance import torchft_session as te

  replica, made = object.__new__(te.Session), []
  replica._make_manager = lambda: ScriptedManager(script, made)
  replica._lighthouse_down = lambda: True
  replica._lighthouse_restarted = lambda: pytest.fail("a request timed out")
  replica._manager_args, replica.quorum_timeout, replica._renew = (), 60.0, False
  first = ScriptedManager([0], made)  # the manager of before (its request would be lost)
  replica._manager, replica._torchft_quorum_id = first, 11
  replica._quorum()
  assert len(made) == 2 and first.shut and made[1].steps == {"step": 9} and not script
  assert made[1]._quorum_id == 12 and replica._manager is made[1] and not replica._renew


def test_the_lighthouse_is_down_when_nothing_accepts_on_its_address():
  """``_lighthouse_down`` connects to the Lighthouse's address: a listener there is up, a
  port nothing listens on is down."""
  import socket

  from optax_dist.fault_tolerance import torchft_session as te

  listener = socket.create_server(("127.0.0.1", 0))
  replica = object.__new__(te.Session)
  replica._manager_args = (f"http://127.0.0.1:{listener.getsockname()[1]}",)
  try:
    assert not replica._lighthouse_down()
  finally:
    listener.close()
  assert replica._lighthouse_down()


@pytest.mark.parametrize("page, last, restarted", [
  (b"Current quorum_id: 5 <br>", 11, True),  # restarted: it counts from 0 again
  (b"Current quorum_id: 11 <br>", 11, False),
  (b"Current quorum_id: 12 <br>", 11, False),
  (b"another Lighthouse's page", 11, False),  # not understood: taken for the same one
  (None, 11, True),  # no answer: down, or being restarted
])
def test_a_restarted_lighthouse_is_told_by_its_status_page(page, last, restarted):
  """``_lighthouse_restarted`` reads torchft's ``/status`` page (here a server of the test's
  serving ``page``; ``None``: a port nothing listens on)."""
  import http.server
  import threading

  from optax_dist.fault_tolerance import torchft_engine as te

  class Status(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
      assert self.path == "/status"
      self.send_response(200)
      self.end_headers()
      self.wfile.write(page)

    def log_message(self, *args):
      pass

  server = http.server.HTTPServer(("127.0.0.1", 0), Status)
  port = server.server_address[1]
  if page is None:
    server.server_close()
  else:
    threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    replica = object.__new__(te.Session)
    replica._manager_args, replica._torchft_quorum_id = (f"http://127.0.0.1:{port}",), last
    assert replica._lighthouse_restarted() == restarted
  finally:
    if page is not None:
      server.shutdown()
      server.server_close()


# ------------------------------------------------------------------------------------------------
# Bad input.


def test_bad_input(tmp_path):
  import optax

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import launcher
  from optax_dist.fault_tolerance import torchft_engine as te

  protocol = ft.RoundProtocol("diloco", optax.sgd(0.1), sync_period=2)
  kwargs = dict(lighthouse="http://127.0.0.1:1", replica_id=0, out=tmp_path)
  with pytest.raises(ValueError, match=r"Torchft\(lighthouse=...\)` \(or \$TORCHFT_LIGHTHOUSE\)"
                     r" must be an http:// URL, got '127.0.0.1:1'"):
    te.Torchft(protocol, **dict(kwargs, lighthouse="127.0.0.1:1"))
  with pytest.raises(ValueError, match=r"Torchft\(replica_id=...\)` must be an int >= 0,"
                     r" got -1"):
    te.Torchft(protocol, **dict(kwargs, replica_id=-1))
  with pytest.raises(ValueError, match=r"Torchft\(timeout=...\)` must be a positive"
                     r" number of seconds, got 0"):
    te.Torchft(protocol, **kwargs, timeout=0)
  with pytest.raises(ValueError, match=r"Torchft\(host=...\)` must be an address or a"
                     r" name that resolves, got 'no-such-host.invalid'"):
    te.Torchft(protocol, **dict(kwargs, host="no-such-host.invalid"))
  with socket.socket() as taken:  # the Lighthouse's port in use: its own words, in one line
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    with pytest.raises(RuntimeError) as info:
      launcher.Launcher(launcher.LaunchConfig(replicas=1, port=port, out=str(tmp_path),
                                              replica_command=("-c", "")))
  said = str(info.value)
  assert "\n" not in said and said.startswith(
    f"the Lighthouse did not start on http://127.0.0.1:{port}: "
  ) and said.endswith("Address already in use (os error 98)"), said


STANDBY = """
import os, pathlib, sys
out, replica = sys.argv[sys.argv.index("--out") + 1], sys.argv[sys.argv.index("--replica-id") + 1]
if "--wait-for-takeover" in sys.argv:
  if replica == "1":
    sys.exit(3)  # replica 1's standbys die before any takeover
  sys.stdin.readline()
  pathlib.Path(out, f"took_over_{os.getpid()}").touch()
sys.exit(1)
"""


def test_launcher_restarts_through_a_live_standby_else_a_fresh_process(tmp_path):
  """With --standby, a restart is the standby's takeover (a line on its stdin) when it lives,
  else a fresh start; every restart counts, and no standby outlives the launcher."""
  from optax_dist.fault_tolerance import launcher

  run = launcher.Launcher(launcher.LaunchConfig(
    replicas=2, out=str(tmp_path), restart_delay=0.2, max_restarts=2, standby=True,
    replica_command=("-c", STANDBY)))
  try:
    assert run.run() == 1  # no replica finished
    standbys = [slot.standby for slot in run.slots]
  finally:
    run.close()
  took_over = {int(p.name.split("_")[-1]) for p in tmp_path.glob("took_over_*")}
  assert [slot.restarts for slot in run.slots] == [2, 2]
  assert len(took_over) == 2  # replica 0's two restarts; replica 1's were fresh starts
  assert int((tmp_path / "replica_0.pid").read_text()) in took_over
  assert all(p.poll() is not None for p in standbys)


@pytest.mark.parametrize("status,restarts", [(2, 0), (1, 2)])
def test_launcher_restarts_a_failed_replica_but_not_a_refusal(tmp_path, status, restarts):
  """A replica that exits with status 2 refused its flags and would refuse again: it is not
  restarted; another failure is, up to --max-restarts times."""
  from optax_dist.fault_tolerance import launcher

  run = launcher.Launcher(launcher.LaunchConfig(
    replicas=2, out=str(tmp_path), restart_delay=0, max_restarts=2,
    replica_command=("-c", f"import sys; sys.exit({status})")))
  try:
    assert run.run() == 1  # no replica finished
  finally:
    run.close()
  assert [slot.restarts for slot in run.slots] == [restarts, restarts]
  assert sorted((r["replica"], r["status"]) for r in run.dir.restarts()) == sorted(
    [(0, status), (1, status)] * restarts)  # one line per restart, with the exit status


@pytest.mark.parametrize("join_timeout,left_out", [(None, set()), (0.3, {"replica_2"})])
def test_the_join_timeout_against_a_replica_waiting_since_the_last_quorum(
    join_timeout, left_out):
  """torchft's Lighthouse counts the join timeout from the earliest request it holds. Replica 3,
  left out of a quorum of 0, 1 and 2, asks for the next one at once; the others ask a round
  (1 s) later, replica 2 last. With the launcher's default join timeout (longer than a round)
  the next quorum waits for replica 2 and holds all four; with a join timeout shorter than the
  round it forms as soon as a majority has asked, without replica 2: the heal cascade's step."""
  import concurrent.futures
  from datetime import timedelta

  from torchft._torchft import LighthouseClient, LighthouseServer

  from optax_dist.fault_tolerance import launcher

  timeout_s = launcher.JOIN_TIMEOUT_S if join_timeout is None else join_timeout
  server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, quorum_tick_ms=10,
                            join_timeout_ms=int(timeout_s * 1000), heartbeat_timeout_ms=30_000)
  ids = [f"replica_{i}" for i in range(4)]
  clients = {i: LighthouseClient(server.address(), timedelta(seconds=5)) for i in ids}

  def quorum(replica_id: str, wait: float = 0.0, timeout: float = 5.0) -> set:
    time.sleep(wait)
    got = clients[replica_id].quorum(replica_id, timedelta(seconds=timeout), step=0,
                                     world_size=1)
    return {member.replica_id for member in got.participants}

  try:
    for i in ids[:3]:
      clients[i].heartbeat(i)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      first = [pool.submit(quorum, i) for i in ids[:3]]
      assert [f.result() for f in first] == [set(ids[:3])] * 3
      straggler = pool.submit(quorum, ids[3])  # asks at once for the next quorum
      time.sleep(1.0)  # a round
      others = [pool.submit(quorum, i, wait, timeout) for i, wait, timeout in zip(
        ids[:3], (0.0, 0.0, 0.3), (5.0, 5.0, 1.0))]
      members = straggler.result()
      assert members == set(ids) - left_out
      for i, f in zip(ids[:3], others):
        if i in left_out:  # asked after the quorum formed: it waits for the next one, alone
          assert not f.done()
        else:
          assert f.result() == members
  finally:
    server.shutdown()


def test_the_two_engines_decide_alike_on_the_same_inputs(tmp_path, monkeypatch):
  """The in-process engine and the torchft engine's end both hand their round's gathered
  headers and payloads to `decision.decide`, the one commit decision: with the same two
  members (replica 0's payload and a NaN-free replica 1's) they call it with the same inputs and
  land on the same global state."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import torch

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import decision, in_process
  from optax_dist.fault_tolerance import torchft_engine as te
  from optax_dist.fault_tolerance import torchft_session as ts

  protocol = ft.RoundProtocol("diloco", optax.sgd(0.1), optax.sgd(0.7, momentum=0.9),
                              sync_period=2)
  params = {"a": jnp.arange(4.0), "b": jnp.ones((2, 2))}

  def grads(p, step, slot):  # the gradient of 0.5 |p - step - slot|^2
    return jax.tree.map(lambda x: x - step - slot, p)

  calls = []

  def spy(*args, **kwargs):
    calls.append((args[1], args[2], decision.decide(*args, **kwargs)))
    return calls[-1][2]

  monkeypatch.setattr(in_process, "decide", spy)
  monkeypatch.setattr(te, "decide", spy)

  def train(replica):
    state = replica.start((params, protocol.tx.init(params)))
    replica.fingerprint = 7
    while replica.last is None:
      g = grads(state[0], replica.step, replica.slot)
      state = replica.after_step(protocol.inner_step(*state, g))
    return replica.state_hash()

  hashes = ft.InProcess(protocol, num_replicas=2, tokens_per_step=8).run(train)
  (heads, payloads, outcome), = calls
  peer = (torch.tensor(list(heads[0]), dtype=torch.int64), ts.pack((payloads[0], None)),
          torch.ones(1, dtype=torch.int64))
  port, _ = _fake_replica(tmp_path, protocol, params, peer)
  replica = port.replica
  state = replica.start((params, protocol.tx.init(params)))
  replica.fingerprint = 7
  while replica.last is None:
    state = replica.after_step(protocol.inner_step(*state, grads(state[0], replica.step, 1)))
  assert len(calls) == 2 and calls[1][0] == heads and calls[1][2].voters == outcome.voters
  for a, b in zip(jax.tree.leaves(calls[1][1]), jax.tree.leaves(payloads), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert replica.state_hash() == hashes[1] == hashes[0]


@pytest.mark.parametrize("algorithm, fmt, error_feedback", [
  ("diloco", "int8", False), ("streaming_diloco", "e3m0", True)])
def test_a_quantized_payload_crosses_as_its_codes_and_lands_as_the_in_memory_round(
    tmp_path, algorithm, fmt, error_feedback):
  """Over the torchft engine's end a block-quantized payload's all-gather carries its codes
  and scales, ``wire_bytes`` of its values (as does a healed member's zeros), and the round
  lands replica 1 on the state the in-process engine's round, which passes the payloads in
  memory, lands it on, bit for bit: params, anchor, outer state and the residual, its own."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import torch

  from optax_dist import _exchange, _quantize
  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import decision, heal, in_process
  from optax_dist.fault_tolerance import torchft_session as ts

  kw = {"num_fragments": 2, "sync_period": 4} if algorithm == "streaming_diloco" else {
    "sync_period": 2}
  protocol = ft.RoundProtocol(algorithm, optax.sgd(0.1), optax.sgd(0.7, momentum=0.9),
                              comm_dtype=fmt, comm_block_size=8, error_feedback=error_feedback,
                              **kw)
  params = {"a": jnp.linspace(-1.0, 1.0, 24).reshape(4, 6), "b": jnp.arange(12.0)}

  def grads(p, step, slot):  # the gradient of 0.5 |p - step - slot / 3|^2
    return jax.tree.map(lambda x: x - step - slot / 3, p)

  def train(replica):
    state = replica.start((params, protocol.tx.init(params)))
    replica.fingerprint = 7
    while replica.last is None:
      state = replica.after_step(
        protocol.inner_step(*state, grads(state[0], replica.step, replica.slot)))
    return replica.replica_state

  calls = []

  def spy(*args, **kwargs):
    calls.append(args[1:3])
    return decision.decide(*args, **kwargs)

  with pytest.MonkeyPatch.context() as m:
    m.setattr(in_process, "decide", spy)
    in_memory = ft.InProcess(protocol, num_replicas=2, tokens_per_step=8).run(train)
  (heads, payloads), = calls
  peer = (torch.tensor(list(heads[0]), dtype=torch.int64), ts.pack((payloads[0], None)),
          torch.ones(1, dtype=torch.int64))
  port, _ = _fake_replica(tmp_path, protocol, params, peer)
  got = train(port.replica)
  values = sum(x.size for x in jax.tree.leaves(_exchange.unpacked(payloads[0])))
  sent = port._pg.sizes[1]  # the headers', the payloads', the acknowledgement's
  assert values == (36 if algorithm == "diloco" else 24) and port.replica.last.line.committed
  assert sent == _quantize.wire_bytes(values, fmt, 8) == peer[1].numel() < 4 * values
  healed = protocol.healed_payload(params, protocol.tx.init(params), heads[0].step)
  assert len(heal.tree_bytes(healed)) == sent
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(in_memory[1]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if error_feedback:  # the residual is the sender's own: the two replicas' differ
    assert not np.array_equal(*(np.asarray(jax.tree.leaves(s.opt_state.error_feedback)[0])
                                for s in in_memory.values()))


# ------------------------------------------------------------------------------------------------
# Another run's replicas on the Lighthouse, and a heal's donor that is not what it says.


class Torchft02Manager(FakeManager):
  """``FakeManager`` whose ``errored`` tells the error reported since the quorum, as torchft's
  does (a member that reported one sends ``ok == 0``)."""

  def errored(self):
    return self.errors[-1] if self.errors else None


def _another_run(tmp_path, protocol, params, grads, peer, *, fingerprint, step, heal_from=None):
  """Replica 1's end (``_fake_replica``) with settings ``fingerprint`` and torchft's ``step``
  (its committed rounds on the Lighthouse), and ``run()`` of one round. With ``heal_from``
  (``(donation, fingerprint, step)``), its quorum heals it from that donor as torchft 0.2.0
  does: torchft's counters set to the donor's, then ``load_state_dict`` (the port's
  ``_load``) of the donor's bytes."""
  from optax_dist.fault_tolerance import heal

  port, _ = _fake_replica(tmp_path, protocol, params, peer)
  port._manager = Torchft02Manager()

  def quorum():
    port.quorums.append(1)
    port._manager.errors.clear()
    if heal_from is not None:
      donation, donor_fingerprint, donor_step = heal_from
      port._manager.step = donor_step
      port._load(heal.encode_heal(donation, fingerprint=donor_fingerprint))

  port._quorum = quorum

  def run():
    replica = port.replica
    state = replica.start((params, protocol.tx.init(params)))
    replica.fingerprint, port._manager.step = fingerprint, step
    while replica.last is None:
      state = replica.after_step(protocol.inner_step(*state, grads(state[0], replica.step)))
    return json.loads(port.log_path.read_text().splitlines()[-1])

  return port, run


def _two_runs():
  """A protocol, params, this run's gradients, and the state of another run of the same
  settings' shapes after 3 committed rounds (other data: its own seed)."""
  import jax
  import jax.numpy as jnp
  import optax

  from optax_dist import fault_tolerance as ft

  protocol = ft.RoundProtocol("diloco", optax.sgd(0.1), optax.sgd(0.7, momentum=0.9),
                              sync_period=2)
  params = {"a": jnp.arange(4.0), "b": jnp.ones((2, 2))}

  def grads(p, step):  # the gradient of 0.5 |p - step|^2
    return jax.tree.map(lambda x: x - step, p)

  other = protocol.init(params)
  for _ in range(3):
    other, sent = protocol.run_round(other, lambda p, step: jax.tree.map(lambda x: x + 3, p))
    other = protocol.commit(other, protocol.merge([sent.payload], [1]), sent)
  return protocol, params, grads, other


def test_a_donor_of_another_run_is_refused_and_the_member_keeps_its_state(tmp_path):
  """Replica 1 (fingerprint 7, 4 rounds committed on the Lighthouse) meets replica 0 of
  another run (fingerprint 9, same shapes, 9 rounds): torchft heals replica 1 from it inside
  the quorum. It refuses the payload before using a byte of its state: the error reported to
  torchft (a no vote, ``ok == 0``), torchft's step back at its own 4, no heal; the round aborts
  without the payloads' all-gather, and replica 1 ends with its own aborted state and stays.
  The heal transport is bounded by its own donation's size meanwhile."""
  import torch

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import heal
  from optax_dist.fault_tolerance import torchft_session as ts

  protocol, params, grads, other = _two_runs()
  own, sent = protocol.run_round(protocol.init(params), grads)
  peer = (torch.tensor([0, 8 * sent.steps, 1, 9, sent.steps], dtype=torch.int64),
          ts.pack((sent.payload, None)), torch.ones(1, dtype=torch.int64))
  port, run = _another_run(tmp_path, protocol, params, grads, peer, fingerprint=7, step=4,
                           heal_from=(ft.heal_state(other), 9, 9))
  line = run()
  assert not line["committed"] and not line["healed"] and line["members"] == [0, 1]
  assert line["weight"] == 8 * sent.steps  # its own round, not a healed one
  assert line["state_hash"] == ft.state_hash(ft.global_state(protocol.abort(own)))
  assert port._healed is None and port._manager.step == 4
  refused, said = port._manager.errors
  assert "'donor' is of another run (fingerprint 9), this run's fingerprint is 7" in str(refused)
  assert "members of different settings or runs" in str(said)
  assert len(port._pg.peer) == 2  # the payloads' and the acknowledgement's: never gathered
  frame = ts._frame({"user": {"default": heal.encode_heal(port.replica.donation(), fingerprint=7)},
                     "torchft": {"step": 2**62, "batches_committed": 2**62}})
  assert len(frame) <= port.transport.max_bytes <= len(frame) + 65536 + 300 * 8


def test_a_tie_of_two_runs_aborts_on_both_and_the_one_without_the_lighthouse_s_rounds_leaves(
    tmp_path):
  """One member of each run, the other run's at rank 0: neither takes the other's state and
  the round aborts on both; the one that holds the Lighthouse's committed rounds (torchft's
  step 3) goes on, the other (step 0, a newcomer: its heal from the first refused) leaves with
  ``SettingsMismatch`` (status 2), whichever rank it has and whatever most members hold."""
  import torch

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import torchft_engine as te
  from optax_dist.fault_tolerance import torchft_session as ts

  protocol, params, grads, _ = _two_runs()
  own, sent = protocol.run_round(protocol.init(params), grads)

  def peer(fingerprint):
    return (torch.tensor([0, 8 * sent.steps, 1, fingerprint, sent.steps], dtype=torch.int64),
            ts.pack((sent.payload, None)), torch.ones(1, dtype=torch.int64))

  holder, run = _another_run(tmp_path / "holder", protocol, params, grads, peer(9),
                             fingerprint=7, step=3)
  line = run()
  assert not line["committed"] and not line["healed"] and line["members"] == [0, 1]
  assert line["state_hash"] == ft.state_hash(ft.global_state(protocol.abort(own)))
  assert holder._manager.step == 3 and len(holder._pg.peer) == 2

  donation = holder.replica.donation()
  newcomer, run = _another_run(tmp_path / "newcomer", protocol, params, grads, peer(7),
                               fingerprint=9, step=0, heal_from=(donation, 7, 3))
  with pytest.raises(te.SettingsMismatch, match=r"^replica 1 holds no round of its Lighthouse"
                     r" and met replicas \[0\] of another fingerprint: its settings \(fingerprint"
                     r" 9\) differ from the run's"):
    run()
  assert newcomer._healed is None and newcomer._manager.step == 0
  assert "is of another run (fingerprint 7)" in str(newcomer._manager.errors[0])
  assert newcomer.replica.state_hash() == ft.state_hash(ft.global_state(protocol.init(params)))
  assert newcomer.replica.state_hash() != ft.state_hash(donation.global_state)
  assert len(newcomer._pg.peer) == 2


class _Donor:
  """An HTTP server of the test's at 127.0.0.1 answering every GET with ``answer(handler)``."""

  def __init__(self, answer):
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_GET(self):  # noqa: N802 (http.server's name)
        answer(self)

      def log_message(self, *args):
        pass

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.address = f"http://127.0.0.1:{self.server.server_address[1]}"
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def close(self):
    self.server.shutdown()
    self.server.server_close()


@pytest.mark.parametrize("status", [301, 302, 307])
def test_a_redirecting_donor_is_refused(status):
  """A donor whose heal server redirects (here to a heal server serving a good frame) is
  refused: a 3xx is an error, nothing is fetched from where it points."""
  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import torchft_session as ts

  good = ts.HealTransport("127.0.0.1", timeout=2.0)
  good.send_checkpoint([1], 3, {"user": {"default": ft.encode_heal(_heal_state())},
                                "torchft": {"step": 3}}, None)
  asked = []

  def redirect(handler):
    asked.append(handler.path)
    handler.send_response(status)
    handler.send_header("Location", f"{good.metadata()}/heal/3")
    handler.send_header("Content-Length", "0")
    handler.end_headers()

  donor, joiner = _Donor(redirect), ts.HealTransport("127.0.0.1", timeout=2.0)
  try:
    with pytest.raises(ValueError, match=rf"rank 0 \({donor.address}\): a redirect \({status},"
                       rf" to '{good.metadata()}/heal/3'\): refused"):
      joiner.recv_checkpoint(0, donor.address, 3, None)
    assert asked == ["/heal/3"]
  finally:
    donor.close()
    good.shutdown()
    joiner.shutdown()


@pytest.mark.parametrize("announced", [True, False])
def test_an_oversized_donor_is_refused_at_the_size_of_the_joiner_s_own(announced):
  """The joiner reads at most ``max_bytes``: a frame of more is refused, whether its donor
  announces its length (refused unread) or streams it without one (refused after
  ``max_bytes + 1``); a frame of exactly ``max_bytes`` is taken."""
  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import torchft_session as ts

  frame = ts._frame({"user": {"default": ft.encode_heal(_heal_state(), fingerprint=7)},
                     "torchft": {"step": 3}})
  sent = []

  def serve(handler):
    handler.send_response(200)
    if announced:
      handler.send_header("Content-Length", str(len(frame)))
    handler.end_headers()
    try:
      handler.wfile.write(frame)
      sent.append(len(frame))
    except OSError:  # the joiner hung up
      pass

  donor, joiner = _Donor(serve), ts.HealTransport("127.0.0.1", timeout=2.0)
  try:
    joiner.max_bytes = len(frame) - 1
    with pytest.raises(ValueError, match=rf"rank 0 \({donor.address}\): {len(frame)} bytes or"
                       rf" more, over the {len(frame) - 1} that this replica's own donation takes"):
      joiner.recv_checkpoint(0, donor.address, 3, None)
    joiner.max_bytes = len(frame)
    got = joiner.recv_checkpoint(0, donor.address, 3, None)
    assert got["torchft"] == {"step": 3}
  finally:
    donor.close()
    joiner.shutdown()


@pytest.mark.parametrize("metadata", [
  "file:///etc/passwd", "ftp://127.0.0.1:21", "https://127.0.0.1:1", "http://127.0.0.1",
  "http://user:secret@127.0.0.1:1", "http://127.0.0.1:1/elsewhere", "http://127.0.0.1:1?x=1",
  "http://127.0.0.1:port", None])
def test_a_donor_address_other_than_http_host_port_is_refused_unasked(metadata):
  from optax_dist.fault_tolerance import torchft_session as ts

  joiner = ts.HealTransport("127.0.0.1", timeout=2.0)
  try:
    with pytest.raises(ValueError, match=r"the donor's address must be http://host:port, got"):
      joiner.recv_checkpoint(0, metadata, 3, None)
  finally:
    joiner.shutdown()


@pytest.mark.parametrize("members, writes, healed", [
  ([1, 0], True, False), ([0, 1], False, False), ([0, 1], False, True), ([1, 0], True, True)])
def test_only_the_quorum_s_rank_0_writes_a_checkpoint(tmp_path, members, writes, healed):
  """A committed round crossing a multiple of checkpoint_every is written by the member at the
  quorum's rank 0 only (the members write alike; one file is enough, and two writers of one
  file would race); every member writes its local file of it, one that healed in the round
  (its line carries no tokens) too, so the checkpoint can be resumed from."""
  import jax.numpy as jnp
  import optax

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import checkpoints
  from optax_dist.fault_tolerance import torchft_engine as te

  protocol = ft.RoundProtocol("diloco", optax.sgd(0.1), sync_period=2)
  engine = te.Torchft(protocol, lighthouse="http://127.0.0.1:1", replica_id=1, out=tmp_path,
                      checkpoint_every=2)
  port = te._Port(engine)
  params = jnp.zeros(3)
  port.checkpointer = checkpoints.CheckpointWriter(tmp_path / "checkpoints", 2, 7)
  port.replica._replica = protocol.init(params)
  line = ft.RoundLog(round=0, replica=1, step=2, quorum_id=1, members=tuple(members),
                     committed=True, weight=0 if healed else 2, healed=healed, state_hash="",
                     tokens=0 if healed else 2)
  port.record(line)
  port.checkpointer.close()
  assert bool(checkpoints.saved(tmp_path / "checkpoints")) == writes
  assert checkpoints.local_path(tmp_path / "checkpoints", 2, 1).exists()


def test_a_replica_s_start_takes_the_loop_s_optimizer_state_without_building_another():
  """``Replica.start`` keeps the loop's ``tx.init`` state and builds none of its own (its
  per-leaf programs, before a restarted replica is ready): ``tx.init`` runs for the loop and
  once in the warm-up's heal (:func:`~optax_dist.fault_tolerance.local_state` rebuilds the
  inner state), not a third time."""
  import jax.numpy as jnp
  import optax

  from optax_dist import fault_tolerance as ft

  inits = []
  sgd = optax.sgd(0.1)
  counted = optax.GradientTransformation(lambda p: inits.append(1) or sgd.init(p), sgd.update)
  protocol = ft.RoundProtocol("diloco", counted, sync_period=2)
  params = {"w": jnp.arange(3.0)}
  opt_state = protocol.tx.init(params)

  class Engine:  # starts with no checkpoint
    def start(self, replica):
      return None

  replica = ft.Replica(protocol, Engine(), slot=0, seed=0, tokens_per_step=1)
  state = replica.start((params, opt_state))
  assert len(inits) == 2 and state[1] is opt_state
  assert replica.replica_state.opt_state is opt_state


def test_a_replica_s_first_round_compiles_nothing_its_start_did_not(tmp_path, caplog):
  """The command's loop (``task_loop``): after ``Replica.start`` (its warm-up), the first
  round's inner steps, the copy of the landing's origin and the round itself (a commit with one
  peer) compile no program: a restarted replica pays for them before it is ready, not in its
  heal."""
  import logging

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import torch

  from optax_dist import fault_tolerance as ft
  from optax_dist.fault_tolerance import torchft_session as ts
  from optax_dist.fault_tolerance.replica import task_loop

  protocol = ft.RoundProtocol("diloco", optax.adam(0.1), optax.sgd(0.7), sync_period=2)
  # shapes of this test's own (JAX's programs of eager operations are the process's)
  params = jax.device_put({"a": jnp.arange(5.0), "b": jnp.ones((3, 7))}, jax.devices()[0])

  def loss_and_grad(x, batch):  # 0.5 |x - batch|^2
    return jax.value_and_grad(
      lambda y: 0.5 * sum(jnp.sum((v - batch) ** 2) for v in jax.tree.leaves(y)))(x)

  # the peer's payload at step 2 (no eager operation: the replica's own are the test's subject)
  payload = jax.tree.map(lambda x: np.full(x.shape, 0.5, np.float32), params)
  peer = (torch.tensor([0, 16, 1, 7, 2], dtype=torch.int64), ts.pack((payload, None)),
          torch.ones(1, dtype=torch.int64))
  port, _ = _fake_replica(tmp_path, protocol, params, peer)
  replica, start = port.replica, port.replica.start

  def started(state):  # the compilations up to here are the start's
    state = start(state)
    replica.fingerprint = 7
    caplog.clear()
    return state

  replica.start = started
  caplog.set_level(logging.WARNING, logger="jax")
  with jax.log_compiles():
    task_loop(protocol, params, loss_and_grad, lambda seed, slot, step: jnp.float32(step),
              rounds=1)(replica)
  assert replica.last.committed
  assert not [r.getMessage()[:60] for r in caplog.records if "Compiling" in r.getMessage()]


def test_a_replica_s_start_loads_a_few_programs_per_tree_not_one_per_leaf(caplog):
  """``Replica.start``'s warm-up (the round's programs: payload, vote, merges, commit, abort,
  copies, a heal's rebuild, the state hash) loads a few JAX programs for a model of 8 leaves,
  not one per leaf and operation: 10 here (the halves, the three merge programs, the copy, the
  heal's ``tx.init``, two scalar ones); with the vote, the merge and the copies run eagerly per
  leaf it loaded 79 (8 more for any one operation run per leaf)."""
  import logging

  import jax
  import jax.numpy as jnp
  import optax

  from optax_dist import fault_tolerance as ft

  # shapes of this test's own (JAX's programs of eager operations are the process's)
  params = jax.device_put({f"w{i}": jnp.full((3, 23 + i), 0.5, jnp.float32) for i in range(8)},
                          jax.devices()[0])
  protocol = ft.RoundProtocol("diloco", optax.adam(0.1), optax.sgd(0.7), sync_period=2)
  opt_state = protocol.tx_init(params)

  class Engine:  # starts with no checkpoint
    def start(self, replica):
      return None

  replica = ft.Replica(protocol, Engine(), slot=0, seed=0, tokens_per_step=1)
  caplog.set_level(logging.WARNING, logger="jax")
  with jax.log_compiles():
    replica.start((params, opt_state))
  compiled = [r.getMessage()[:60] for r in caplog.records if "Compiling" in r.getMessage()]
  assert len(compiled) <= 12, compiled
