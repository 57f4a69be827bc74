"""Probe: what torchft 0.2.0 allows for decoupled rounds (late replicas keep their state).

``python tests/probes/decoupled_quorum.py`` (not ``test_*.py``: pytest does not collect it; about
3 minutes, 60 s of it one join timeout) runs torchft's Lighthouse in a process of its own with
the launcher's settings (``LaunchConfig``: join timeout 60 s, heartbeat timeout 5 s,
``min_replicas`` 2, the majority of 3) and R = 3 replicas A, B, C, one process each: a
``Manager`` (``init_sync=False``, ``use_async_quorum=False``, ``min_replica_size`` 2; its store,
gloo device, heal server and Manager server on 127.0.0.1) whose main thread plays a decoupled
engine's exchange thread: ``start_quorum(allow_heal=False)``, a header all-gather, a payload
all-gather, ``should_commit``. Each replica holds its own state (params, inner state, residual)
and counts the calls of its ``load_state_dict``, of ``Manager.load_state_dict`` and of its
checkpoint transport's send and receive. Every process is killed at the end. Numbers of 3 runs
(the steps set by hand in 1. in the last two), load average 5.5-13.6 on 2 cores (other work
running; ``uptime``).

1. **No heal with allow_heal=False; a member behind keeps its state.** C, left out of one quorum
   (step 4 against max_step 5), joins the next with ``allow_heal=False`` on all: torchft's quorum
   result still says ``heal=True`` for C and names C as A's ``recover_dst`` ([2]), but nothing is
   sent or received and neither ``load_state_dict`` is called (0 calls, 3 rounds); C's state's hash
   is unchanged (so are A's and B's, every round). ``current_step()`` reports C's own step (4),
   ``max_step`` 5. ``participating_rank()`` is None for C (A 0, B 1) and ``num_participants()`` is
   2 on all three: with ``allow_heal=False`` torchft counts only the members at max_step
   (``max_replica_rank``, ``max_world_size``), while the process group spans all 3 (its ``size()``
   3; ranks by replica id). An all-gather sized by ``num_participants()`` raises at once, before
   any traffic (``ProcessGroupGloo::allgather: invalid output tensor list``, expected length 3, got
   2); sized by ``pg.size()`` it gives every member's buffer, C's included ([1, 2, 3]).
   ``should_commit()`` is each replica's own (its replica group's) vote: True on all three, C's
   step goes 4 -> 5 and stays one behind (6 vs 7 the next round) until it is set:
   ``Manager.load_state_dict({"step": 7, ...})`` (public) and the next quorum counts it again (rank
   2, 3 participants). The vote's ``enough_replicas`` is
   ``num_participants() >= min_replica_size``: with A's step set 10 ahead (B, C behind),
   ``num_participants()`` is 1 and all three vote False (with ``min_replica_size`` 2). Contrast,
   ``allow_heal=True`` in that state: B and C heal inside ``start_quorum`` (quorum and heal in
   0.02-0.03 s): A stages once (``recover_dst`` [1, 2]), B and C each receive once and call both
   ``load_state_dict`` once, their state replaced and their step set to 21, ``num_participants()``
   3.
2. **A slow asker.** All asking at once: the first quorum in 0.01 s, the next ones (every member of
   the last quorum asked: torchft's fast quorum) in 0.00-0.04 s; ``quorum_id`` stays the same while
   the members do (1, 1, 1, ...) and the process group is reused. C asking 3 s late: A and B wait
   3.0 s (the quorum forms when C asks: C was in the last quorum). C asking 63 s late: A and B wait
   60.04-60.09 s, the join timeout counted from the earliest request, then a quorum of A and B
   forms (``quorum_id`` 2, 2 members) and commits (step 5); C's request is held. A and B's next
   request forms at once (their fast quorum) and includes C's held request: ``quorum_id`` 3, 3
   members, 0.01-0.04 s for A and B; C receives A's and B's payloads ([1, 2, 3]) and commits (its
   step one behind: 1.).
3. **A quorum while an all-gather is in flight.** Same members: A and B issue a 1 MiB all-gather,
   then ask for the next quorum; C asks 2 s late and issues its all-gather 1 s after the quorum. A
   and B's quorum returns after 2.0 s with their all-gather in flight; they issue the header and
   payload all-gathers on top of it (three in flight); all complete, in order, with every member's
   bytes, at 3.03-3.07 s, and the round commits. Members changed: A's all-gather issued on the
   quorum of A and B (B issues none) fails 0.03-0.05 s into the round, as the quorum of A, B and C
   forms (``RuntimeError ... Connection closed by peer``): a new ``quorum_id`` reconfigures the
   process group (torchft's ``configure`` aborts the old one). A mismatch of order is fatal: in a
   first version of this probe A's in-flight 1 MiB all-gather met B's 8-byte header all-gather on
   the same group; A's round died with ``Connection reset by peer`` and B's process ended (its
   stdin a broken pipe). So one exchange in flight per replica works, and several collectives in
   flight on one quorum do, when every member issues the same collectives in the same order and the
   members do not change. Two exchanges on two quorums at once do not: a ``Manager`` runs one
   quorum at a time (``start_quorum`` waits for the last one's future) over one process group,
   which each new ``quorum_id`` replaces; a second ``Manager`` would be a second replica id to the
   Lighthouse (counted in its majority).
4. **Carrying the catch-up.** For 2**20 float32 params (DiLoCo, adamw inner, Nesterov outer, int8
   wire format with error feedback): a payload as the engine gathers it 4,194,304 bytes (float32
   decoded: 4 B/param), the catch-up (``decoupled.global_state``: anchor, outer state, rounds)
   8,388,612 (8 B/param), a heal (``encode_heal(heal_state)``: the global and inner state)
   16,778,031 (16 B/param), the local part (params, inner state, residual) 16,777,224. Over the
   all-gather every member sends its own copy of the identical global state: 3 x 8 MiB per member,
   0.12-0.33 s; a gloo broadcast from one up-to-date member (rank 0 here): 8 MiB, 0.01-0.13 s; over
   the heal transport (``HealTransport``, HTTP GET of a staged frame): 8 MiB in 0.01-0.04 s, but
   torchft drives its transport only with ``allow_heal=True`` and only for a member whose torchft
   step is behind, calls one ``state_dict`` for every receiver (so the donor sends the heal, 16
   B/param, even to a member that needs the catch-up only), and assigns the donors itself (A for
   both B and C above).

CONCLUSION. torchft 0.2.0 behaves as its code reads; nothing above contradicts the expectations
(the Lighthouse's fast quorum, which also takes any other replica's held request; a majority of
the heartbeating replicas after the join timeout; a heal inside ``start_quorum`` unless
``allow_heal=False``). It allows: every replica in every quorum without a heal
(``allow_heal=False``), a member behind keeping its state and still gathering and voting;
quorums in 0.00-0.04 s while every member of the last one asks at once; one exchange in flight
per replica across the next quorum request. It does not: a round that closes on K of R payloads
(the Lighthouse counts askers, not payloads, and a member of the last quorum that does not ask
holds the others up to the join timeout, 60 s); a grace window; buffers of different sizes in
one all-gather; exchanges on two quorums at once; a catch-up (global state only) through its
heal path; with ``allow_heal=False``, ``num_participants()`` and the vote's
``min_replica_size`` count only the members at max_step. The decoupled engine on torchft follows:

* each replica's exchange thread joins every quorum at once (``allow_heal=False`` on all, so
  torchft never heals; a slow replica's compute thread is slow, never its exchange thread);
* K and the grace window are our rule over the members' headers (ready, tokens, version, the
  payload's arrival): every member gathers the headers, sized by ``pg.size()``, and the one
  decision closes the round when every live payload is in or when at least K are and the
  window since the K-th arrival has run out, or else asks for the next quorum (0.00-0.04 s)
  and gathers the headers again; the merge takes the payloads ready then, at least K (the
  others send zeros of the payload's size: one buffer size in the all-gather);
* a late member, in every quorum, receives every merge and applies it to its own copy of the
  global state: its catch-up costs no bytes, it keeps its params, inner state and residual,
  and its payload (from the current anchor) enters the next merge with its staleness;
* a member that missed quorums (left out after the join timeout, or restarted) shows an older
  version in its header: one up-to-date member (the lowest rank at the newest version) sends it
  the global state over a broadcast (8 B/param; a restarted one, no local state, the heal, 16
  B/param), and it sets its torchft step to the quorum's (``Manager.load_state_dict``, the
  headers' largest step) so that ``num_participants()`` and the vote count it again; or the
  Manager's ``min_replica_size`` is 1 and K is the decision's alone.
"""

import functools
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time

say = functools.partial(print, flush=True)
QUORUM_S = 120.0  # each start_quorum's timeout: longer than the join timeout
COLLECTIVE_S = 10.0


def ft_worker(i, lighthouse, min_replicas):
  from datetime import timedelta

  import numpy as np
  import torch
  import torchft.manager as tm
  from torch.distributed.distributed_c10d import AllgatherOptions, BroadcastOptions

  from optax_dist.fault_tolerance.torchft_session import HealTransport, _GlooOnHost, _store_on
  server = tm.ManagerServer  # torchft binds [::]; this probe binds only 127.0.0.1
  tm.ManagerServer = lambda **kw: server(**{**kw, "bind": "127.0.0.1:0"})
  calls = {"load_state_dict": 0, "manager_load": 0, "send": 0, "recv": 0}
  # the replica's own state: params, inner optimizer state, residual (each replica's values)
  state = {k: np.full(1000, 10.0 * i + j, np.float32) for j, k in enumerate(("x", "mu", "r"))}

  def digest():
    return hashlib.sha256(b"".join(a.tobytes() for a in state.values())).hexdigest()[:12]

  def load(data):
    calls["load_state_dict"] += 1
    for k, a in zip(state, np.frombuffer(data, np.float32).reshape(3, -1), strict=True):
      state[k] = a.copy()

  class Transport(HealTransport):
    def send_checkpoint(self, *a, **kw):
      calls["send"] += 1
      return super().send_checkpoint(*a, **kw)

    def recv_checkpoint(self, *a, **kw):
      calls["recv"] += 1
      return super().recv_checkpoint(*a, **kw)

  class Recorder:  # keeps the Manager server's last QuorumResult
    def __init__(self, client):
      self.client, self.last = client, None

    def _quorum(self, **kw):
      self.last = self.client._quorum(**kw)
      return self.last

    def __getattr__(self, name):
      return getattr(self.client, name)

  store, s10 = _store_on("127.0.0.1"), timedelta(seconds=COLLECTIVE_S)
  pg, transport = _GlooOnHost("127.0.0.1", s10), Transport("127.0.0.1", COLLECTIVE_S)
  m = tm.Manager(pg=pg, load_state_dict=load, state_dict=lambda: b"".join(
                   a.tobytes() for a in state.values()),
                 min_replica_size=min_replicas, use_async_quorum=False, init_sync=False,
                 timeout=s10, quorum_timeout=s10, connect_timeout=s10, rank=0, world_size=1,
                 store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
                 replica_id=f"replica_{i}", hostname="127.0.0.1", checkpoint_transport=transport)
  manager_load = m.load_state_dict

  def counted(sd):
    calls["manager_load"] += 1
    manager_load(sd)

  m.load_state_dict, m._client = counted, Recorder(m._client)

  def gather(nbytes, fill, count=None):
    """All-gather of ``nbytes`` bytes of ``fill`` over ``count`` (default: the pg's size)."""
    mine = torch.full((nbytes,), fill, dtype=torch.uint8)
    outs = [torch.empty_like(mine) for _ in range(count or pg.size())]
    return outs, pg.allgather([outs], [mine], AllgatherOptions())

  def since(t):
    return round(time.time() - t, 2)

  def one_round(op):
    out, t0, inflight = {"replica": "ABC"[i]}, time.time(), None
    if op.get("inflight") == "before":  # an all-gather on the last quorum's pg, not waited for
      inflight = gather(1 << 20, 100 + i)
    time.sleep(op.get("sleep", 0))
    before, t = digest(), time.time()
    m.start_quorum(allow_heal=op.get("heal", False), timeout=timedelta(seconds=QUORUM_S))
    q = m._client.last
    out.update(quorum_s=since(t), asked_at=round(t - t0, 2), quorum_id=q.quorum_id,
               members=len(q.replica_ids), replica_rank=q.replica_rank,
               replica_world_size=q.replica_world_size, max_step=q.max_step,
               max_replica_rank=q.max_replica_rank, max_world_size=q.max_world_size,
               torchft_heal=q.heal, recover_dst=list(q.recover_dst_replica_ranks),
               participating_rank=m.participating_rank(), num_participants=m.num_participants(),
               step=m.current_step(), pg_size=pg.size())
    if m.num_participants() != pg.size():
      try:
        gather(8, 0, m.num_participants())
        out["gather_of_num_participants"] = "issued"
      except Exception as e:  # noqa: BLE001
        out["gather_of_num_participants"] = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
    if op.get("inflight") == "after":  # issued late: the others' is in flight meanwhile
      time.sleep(op["delay"])
      inflight = gather(1 << 20, 100 + i)
    t = time.time()
    _, head_work = gather(8, i + 1)  # the header: every member's (here: one byte of it)
    outs, work = gather(op.get("nbytes", 1 << 10), i + 1)
    if inflight is not None:
      try:
        inflight[1].wait()
        out["inflight"] = f"ok {sorted({int(x[0]) for x in inflight[0]})} at {since(t0)} s"
      except Exception as e:  # noqa: BLE001
        out["inflight"] = f"{type(e).__name__} at {since(t0)} s: {str(e).splitlines()[0][:90]}"
    head_work.wait()
    work.wait()
    out.update(gathered=[int(x[0]) for x in outs], gather_s=since(t),
               quorum_to_gathered_s=round(out["quorum_s"] + since(t), 2))
    if op.get("broadcast"):
      t, buf = time.time(), torch.full((op["broadcast"],), i + 1, dtype=torch.uint8)
      opts = BroadcastOptions()
      opts.rootRank = 0
      pg.broadcast([buf], opts).wait()
      out.update(broadcast_s=since(t), broadcast_from=int(buf[0]) - 1)
    out.update(commit=m.should_commit(), step_after=m.current_step(),
               state_kept=digest() == before, **calls)
    return out

  say("ready")
  for line in sys.stdin:
    op = json.loads(line)
    try:
      if op["do"] == "round":
        say(json.dumps(one_round(op)))
      elif op["do"] == "set_step":  # torchft's public Manager.load_state_dict, not counted
        step = op.get("step", m.current_step() + op.get("add", 0))
        manager_load({"step": step, "batches_committed": m.batches_committed()})
        say(json.dumps({"step": m.current_step()}))
      elif op["do"] == "stage":  # a catch-up frame staged on this replica's heal server
        frame = {"user": {"default": bytes(op["nbytes"])}, "torchft": {"step": 0}}
        HealTransport.send_checkpoint(transport, [], 10**6, frame, s10)
        say(json.dumps({"address": transport.address}))
      elif op["do"] == "fetch":
        t = time.time()
        got = HealTransport.recv_checkpoint(transport, 0, op["address"], 10**6, s10)
        say(json.dumps({"fetched": len(got["user"]["default"]), "fetch_s": since(t)}))
    except Exception as e:  # noqa: BLE001
      m._quorum_future = None  # else torchft 0.2.0 raises it again from every start_quorum
      say(json.dumps({"replica": "ABC"[i], "error": f"{type(e).__name__}: {str(e)[:160]}"}))


def lighthouse_worker(min_replicas, join_ms, heartbeat_ms):
  from torchft.coordination import LighthouseServer
  lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas,
                                join_timeout_ms=join_ms, heartbeat_timeout_ms=heartbeat_ms)
  say(lighthouse.address())
  sys.stdin.read()
  lighthouse.shutdown()


class Proc:
  """A subprocess of this script; its stdout lines arrive in a queue, its stderr in a list."""

  def __init__(self, *args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "GLOO_SOCKET_IFNAME": "lo"}
    self.p = subprocess.Popen([sys.executable, __file__, *map(str, args)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    self.lines, self.err = queue.Queue(), []
    for pipe, put in ((self.p.stdout, self.lines.put), (self.p.stderr, self.err.append)):
      threading.Thread(target=lambda pipe=pipe, put=put: [put(x.strip()) for x in pipe],
                       daemon=True).start()

  def send(self, **op):
    self.p.stdin.write(json.dumps(op) + "\n")
    self.p.stdin.flush()

  def line(self, timeout=QUORUM_S + 30):
    """The next stdout line within ``timeout`` seconds (JSON decoded if it is), or None."""
    try:
      x = self.lines.get(timeout=timeout)
    except queue.Empty:
      return None
    return json.loads(x) if x.startswith("{") else x


def show(label, results, keys):
  for r in results:
    say(f"{label} " + (r and " ".join(f"{k}={r[k]}" for k in ("replica", *keys) if k in r)
                       if r and "error" not in r else str(r)))


QUORUM_KEYS = ("asked_at", "quorum_s", "quorum_id", "members", "replica_rank", "max_step", "step",
               "max_replica_rank", "max_world_size", "torchft_heal", "recover_dst",
               "participating_rank",
               "num_participants", "pg_size", "gathered", "commit", "step_after")
KEPT_KEYS = ("state_kept", "load_state_dict", "manager_load", "send", "recv")


def sizes():
  """Bytes of a DiLoCo replica's parts for 2**20 float32 params (adamw inner, Nesterov outer,
  int8 wire format with error feedback): payload, catch-up (global state), heal, local."""
  import jax
  import jax.numpy as jnp
  import optax

  from optax_dist.fault_tolerance import RoundProtocol, decoupled, heal
  protocol = RoundProtocol("diloco", optax.adamw(1e-3), optax.sgd(0.7, momentum=0.9,
                           nesterov=True), sync_period=4, comm_dtype="int8", error_feedback=True)
  params = {"w": jnp.zeros((1024, 768), jnp.float32), "v": jnp.zeros((256, 1024), jnp.float32)}
  replica = protocol.init(params)
  payload, _ = protocol.send_half(replica.opt_state, params, None)
  n = sum(x.size for x in jax.tree.leaves(params))
  return {"params": n, "payload": len(heal.tree_bytes(payload)),
          "catch_up": len(heal.tree_bytes(decoupled.global_state(replica))),
          "heal": len(heal.encode_heal(heal.heal_state(replica))),
          "local": len(heal.tree_bytes(heal.local_part(replica)))}


def probe(procs):
  from optax_dist.fault_tolerance.launcher import LaunchConfig, majority
  c = LaunchConfig(replicas=3, out="-", replica_command=("-",))
  min_replicas = majority(3)
  say(f"launcher's Lighthouse: join_timeout {c.join_timeout} s, heartbeat timeout"
      f" {c.lighthouse_heartbeat_timeout} s, min_replicas {min_replicas} (majority of 3);"
      f" load {os.getloadavg()[0]:.1f}")
  lighthouse = Proc("lighthouse", min_replicas, int(c.join_timeout * 1000),
                    int(c.lighthouse_heartbeat_timeout * 1000))
  procs.append(lighthouse)
  address = lighthouse.line(60)
  reps = [Proc("ft", i, address, min_replicas) for i in range(3)]
  procs += reps
  say(f"replicas ready: {[q.line(90) for q in reps]}")
  size = sizes()
  say(f"sizes (bytes) of a DiLoCo replica of {size['params']} float32 params: {size}")

  def set_step(k, **step):
    reps[k].send(do="set_step", **step)
    say(f"{'ABC'[k]}'s torchft step set (Manager.load_state_dict): {reps[k].line(30)}")

  def round_(label, ops, keys=QUORUM_KEYS, wait=range(3)):
    for q, op in zip(reps, ops, strict=True):
      if op is not None:
        q.send(do="round", **op)
    results = [reps[k].line() for k in wait]
    show(label, results, keys)
    return results

  for n in range(3):
    round_(f"[0] all ask at once, round {n}:", [{}] * 3)
  round_("[2] C asks 3 s late:", [{}, {}, {"sleep": 3}])
  late = c.join_timeout + 3
  round_(f"[2] C asks {late:.0f} s late:", [{}, {}, {"sleep": late}], wait=(0, 1))
  time.sleep(late + 1 - c.join_timeout)  # C's request is now pending at the Lighthouse
  round_("[1,2,3] C's pending request; A has an all-gather in flight on the last quorum's"
              " pg:", [{"inflight": "before"}, {}, None],
              keys=(*QUORUM_KEYS, "inflight", "gather_of_num_participants", *KEPT_KEYS))
  rs = round_("[1] all ask, C behind:", [{}] * 3, keys=(*QUORUM_KEYS, *KEPT_KEYS))
  set_step(2, step=rs[0]["step_after"])
  round_("[1] C's step set to the quorum's max_step:", [{}] * 3, keys=(*QUORUM_KEYS, *KEPT_KEYS))
  round_("[3] same members; A, B with an all-gather in flight; C asks 2 s late, issues its own"
         " 1 s after the quorum:", [{"inflight": "before"}] * 2
         + [{"sleep": 2, "inflight": "after", "delay": 1}],
         keys=("asked_at", "quorum_s", "quorum_id", "inflight", "gathered", "gather_s",
               "quorum_to_gathered_s", "commit"))
  for kind in ("payload", "catch_up"):
    round_(f"[4] all-gather of a {kind} ({size[kind]} bytes each) and a broadcast of a catch-up"
           " from rank 0:", [{"nbytes": size[kind], "broadcast": size["catch_up"]}] * 3,
           keys=("quorum_s", "gather_s", "broadcast_s", "broadcast_from"))
  reps[0].send(do="stage", nbytes=size["catch_up"])
  staged = reps[0].line(30)
  reps[2].send(do="fetch", address=staged["address"])
  say(f"[4] C fetches A's staged catch-up over the heal transport (HTTP): {reps[2].line(60)}")
  set_step(0, add=10)
  round_("[1] A's step set 10 ahead, B and C behind:", [{}] * 3,
              keys=("max_step", "step", "max_world_size", "participating_rank",
                    "num_participants", "gathered", "commit", "step_after"))
  round_("[contrast] allow_heal=True, B and C behind:", [{"heal": True}] * 3,
         keys=("quorum_s", "max_step", "step", "torchft_heal", "recover_dst",
               "participating_rank", "num_participants", "commit", "step_after", *KEPT_KEYS))
  say(f"load average {os.getloadavg()}")


def main():
  procs = []
  try:
    probe(procs)
  finally:
    for q in procs:
      if q.p.poll() is not None:
        say(f"exited {q.p.returncode}: {' | '.join(q.err[-3:])}")
      q.p.kill()
    for q in procs:
      q.p.wait()


if __name__ == "__main__":
  if len(sys.argv) == 1:
    main()
  else:  # a worker: its arguments are ints but for the address
    args = [int(a) if a.isdigit() else a for a in sys.argv[2:]]
    {"lighthouse": lighthouse_worker, "ft": ft_worker}[sys.argv[1]](*args)
