"""Probe: can one replica span several processes (a replica group, as in torchft's HSDP)?

``python tests/probes/replica_group.py`` (not ``test_*.py``: pytest does not collect it) runs
each step in subprocesses of its own, with timeouts, and kills them all at the end.

1. Two ``jax.distributed`` processes (1 CPU device each, gloo, heartbeat timeout 10 s as in
   ``optax_dist.cli.processes``) form one group: a jitted ``psum`` over both gives 3.0.
2. ``kill -9`` of one: the survivor's next ``psum`` raises at once (0.0-0.1 s, a catchable
   ``Gloo all-reduce failed: Connection closed by peer``), then JAX's coordination service
   aborts it (SIGABRT, "stopped sending heartbeats") 8.6-9.9 s after the kill of process 1
   (8.7-9.8 s if it runs no collective), 0.1-0.2 s after the kill of process 0 (the
   coordinator); 5 runs. With ``jax_enable_recoverability`` the survivor lives on (20 s) but all
   its 100-129 ``psum``s fail, and process 1 restarted exits 1 after 1.1-3.9 s: its gloo
   context's key ``ALREADY_EXISTS`` in the coordination service. The survivor cannot go on: a
   group restarts as a unit.
3. torchft 0.2.0, groups A and B of 2 ranks (``Manager(rank=r, world_size=2)``, the store at
   rank 0's ``TCPStore``; only rank 0's ``ManagerServer`` talks to the Lighthouse, asking once
   both ranks have asked it): all 4 ranks get the quorum (2 participants) and commit in
   0.0-0.3 s; rank r's ``ProcessGroupGloo`` (store prefix ``/torchft/<quorum>/<r>``) joins rank
   r of each group: its all-gather is ``[r, 10 + r]``. After ``kill -9`` of A/1, A/0 and both
   ranks of B time out (10 s): A's ManagerServer waits for A/1, and the Lighthouse wants more
   than half of the heartbeating groups (A/0 heartbeats for A). With A/0 killed too, B commits
   alone after 5.0-5.1 s (the Lighthouse's heartbeat timeout).

Measured with load average 7.5-9.2 on 2 cores (other work running; ``uptime``).
"""

import functools
import os
import queue
import socket
import subprocess
import sys
import threading
import time

HEARTBEAT_TIMEOUT = 10  # optax_dist.cli.processes.HEARTBEAT_TIMEOUT
say = functools.partial(print, flush=True)


def jax_worker(i, port, mode):
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  P = jax.sharding.PartitionSpec
  jax.config.update("jax_num_cpu_devices", 1)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_enable_recoverability", mode == "recover")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=i,
                             initialization_timeout=60, shutdown_timeout_seconds=10,
                             heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT)
  mesh = Mesh(np.array(jax.devices()), ("p",))
  psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "p"), mesh=mesh, in_specs=P("p"),
                               out_specs=P()))
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("p")), np.full((1,), i + 1.0))
  say("ready", float(psum(x)[0]))
  failed = 0
  while True:
    try:
      if mode != "idle":
        float(psum(x)[0])
        if failed:
          say("ok-again")
    except Exception as e:  # noqa: BLE001
      failed += 1
      say("error", time.time(), failed, str(e).splitlines()[0][:120])
    time.sleep(0.2)


def ft_worker(g, r, lighthouse, store_port):
  from datetime import timedelta

  import torch
  import torch.distributed as dist
  import torchft.manager as tm
  from torch.distributed.distributed_c10d import AllgatherOptions
  from torchft.process_group import ProcessGroupGloo

  from optax_dist.fault_tolerance.torchft_session import HealTransport
  server = tm.ManagerServer  # torchft binds [::]; this probe binds only 127.0.0.1
  tm.ManagerServer = lambda **kw: server(**{**kw, "bind": "127.0.0.1:0"})
  if r == 0:  # the group's store, held until the process ends
    store = dist.TCPStore("127.0.0.1", store_port, is_master=True,  # noqa: F841
                          wait_for_workers=False)
  pg, s10 = ProcessGroupGloo(timeout=timedelta(seconds=10)), timedelta(seconds=10)
  m = tm.Manager(pg=pg, load_state_dict=lambda _: None, state_dict=lambda: b"", min_replica_size=1,
                 use_async_quorum=False, init_sync=False, timeout=s10, quorum_timeout=s10,
                 connect_timeout=s10, rank=r, world_size=2, store_addr="127.0.0.1",
                 store_port=store_port, lighthouse_addr=lighthouse, replica_id=f"group_{g}",
                 hostname="127.0.0.1", checkpoint_transport=HealTransport("127.0.0.1", 10))
  say("manager")
  for _ in sys.stdin:
    t = time.time()
    try:
      m.start_quorum(timeout=s10)
      mine = torch.tensor([10.0 * g + r])
      outs = [torch.empty_like(mine) for _ in range(m.num_participants())]
      pg.allgather([outs], [mine], AllgatherOptions()).wait()
      ok = m.should_commit()
      say(f"participants={m.num_participants()} replica_rank={m.participating_rank()}"
          f" gathered={[float(o) for o in outs]} commit={ok} in {time.time() - t:.1f} s")
    except Exception as e:  # noqa: BLE001
      m._quorum_future = None  # else torchft 0.2.0 raises it again from every start_quorum
      say(f"{type(e).__name__} after {time.time() - t:.1f} s: {str(e).splitlines()[0][:100]}")


def lighthouse_worker():
  from torchft.coordination import LighthouseServer
  lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=5000,
                                heartbeat_timeout_ms=5000)  # the launcher's; its join: 60 s
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
    self.lines, self.err, self.ended = queue.Queue(), [], None
    threading.Thread(target=lambda: (self.p.wait(), setattr(self, "ended", time.time())),
                     daemon=True).start()
    for pipe, put in ((self.p.stdout, self.lines.put), (self.p.stderr, self.err.append)):
      threading.Thread(target=lambda pipe=pipe, put=put: [put(x.strip()) for x in pipe],
                       daemon=True).start()

  def line(self, prefix="", timeout=60.0):
    """The next stdout line starting with ``prefix`` within ``timeout`` seconds, or None."""
    deadline = time.time() + timeout
    try:
      while not (x := self.lines.get(timeout=max(deadline - time.time(), 0.01))).startswith(prefix):
        pass
      return x
    except queue.Empty:
      return None

  def exit_after(self, t0, timeout):
    """The exit code and the seconds from ``t0`` to the exit, waiting until ``t0 + timeout``."""
    while self.ended is None and time.time() < t0 + timeout:
      time.sleep(0.05)
    return (None, timeout) if self.ended is None else (self.p.returncode, self.ended - t0)

  def said(self, text):
    return any(text in x for x in self.err)


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def jax_kill(procs, mode, victim):
  port, survivor = free_port(), 1 - victim
  group = [Proc("jax", i, port, mode) for i in range(2)]
  procs += group
  sums = [q.line("ready") for q in group]
  if mode == "busy" and victim == 1:
    say(f"1. jax group of 2 processes x 1 CPU device: jitted psum = {[s and s[6:] for s in sums]}")
  time.sleep(1)
  t0 = time.time()
  group[victim].p.kill()
  error = group[survivor].line("error", 5) if mode != "idle" else None
  if error:
    _, when, _, message = error.split(None, 3)
    raised = f"its psum raised after {float(when) - t0:.1f} s ({message})"
  else:
    raised = "it runs no collective" if mode == "idle" else "no psum error before its end"
  if mode == "recover":
    time.sleep(2)
    procs.append(Proc("jax", victim, port, mode))
    rc, dt = procs[-1].exit_after(time.time(), 40)
    code, after = group[survivor].exit_after(t0, 20)
    later = list(group[survivor].lines.queue)
    say(f"2. jax_enable_recoverability, kill -9 process {victim}: {raised}; survivor exit {code}"
        f" within {after:.0f} s, {sum(x.startswith('error') for x in later) + 1} psums failed,"
        f" {later.count('ok-again')} worked; process {victim} restarted: exit {rc} after"
        f" {dt:.1f} s (gloo key ALREADY_EXISTS: {procs[-1].said('ALREADY_EXISTS')})")
  else:
    code, after = group[survivor].exit_after(t0, 3 * HEARTBEAT_TIMEOUT)
    say(f"2. kill -9 process {victim} (survivor {mode}): {raised}; survivor exit {code} after"
        f" {after:.1f} s (stopped sending heartbeats: {group[survivor].said('stopped sending')})")
  for q in procs:
    q.p.kill()


def torchft_groups(procs):
  lighthouse = Proc("lighthouse")
  procs.append(lighthouse)
  address, ports = lighthouse.line("http", 60), [free_port(), free_port()]
  ranks = {(g, r): Proc("ft", g, r, address, ports[g]) for g in (0, 1) for r in (0, 1)}
  procs += ranks.values()
  made = [q.line("manager", 90) for q in ranks.values()].count("manager")
  say(f"3. torchft, 2 groups x 2 ranks: Manager(rank=r, world_size=2) made on {made}/4 ranks")

  def round_(what):
    for q in ranks.values():
      q.p.stdin.write("go\n")
      q.p.stdin.flush()
    for (g, r), q in ranks.items():
      say(f"3. {what}group {'AB'[g]} rank {r}: {q.line('', 60)}")

  round_("")
  ranks.pop((0, 1)).p.kill()
  round_("A/1 killed: ")
  status = [x.split("Quorum status: ")[1] for x in lighthouse.err if "Quorum status: " in x]
  say(f"3.   the Lighthouse then: {status[-1] if status else None}")
  ranks.pop((0, 0)).p.kill()
  round_("A/0 killed too: ")


def main():
  procs = []
  try:
    for mode, victim in (("busy", 1), ("busy", 0), ("idle", 1), ("recover", 1)):
      jax_kill(procs, mode, victim)
    torchft_groups(procs)
  finally:
    for q in procs:
      q.p.kill()
    for q in procs:
      q.p.wait()


if __name__ == "__main__":
  if len(sys.argv) == 1:
    main()
  else:  # a worker: its arguments are ints but for the address and the mode
    args = [int(a) if a.isdigit() else a for a in sys.argv[2:]]
    {"lighthouse": lighthouse_worker, "jax": jax_worker, "ft": ft_worker}[sys.argv[1]](*args)
