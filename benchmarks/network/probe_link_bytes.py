"""What a cross-process all-reduce over gloo puts on the veth, byte for byte.

The network study compares each veth's bytes, less :data:`netns.FRAME_OVERHEAD` bytes of headers
per packet, with the bytes it predicts from the compiled collectives (a two-rank all-reduce sends
its operand's bytes once each way). This probe measures what that rests on, in isolation: two
``jax.distributed`` processes (gloo, :data:`DEVICES` emulated CPU devices each) over a
:class:`netns.Link`, process 0 and the coordinator in ``a``, process 1 in ``b``:

* ``tcp``: a TCP transfer of known bytes from ``b`` to ``a`` (:meth:`netns.Link.measure_rate`):
  the veth's bytes less that payload, over its packets, is the header overhead the counters show;
* ``pair``: ``--repeats`` all-reduces (``psum``) of ``S`` bytes of float32 per process over a
  2-device mesh, one device per process, each waited for;
* ``wide``: the same ``S`` bytes per process split over a 2 x :data:`DEVICES` mesh, each device
  all-reducing its ``S / DEVICES`` across the processes only (the trainer's ``replica`` axis);
* ``wide trainer``: one all-reduce over the replicas of the 38 operands per device XLA leaves in
  the lm task's exchange (:data:`TRAINER_OPERANDS`, 279424 bytes per device);
* ``pair small``: one all-reduce of 38 operands of 96 bytes on the 2-device mesh: what an
  operand costs beyond its bytes;
* ``idle``: nothing for about a second (the coordination service's background traffic).

Each all-reduce's results are checked against the sum of both processes' inputs; the number of
all-reduce instructions in its compiled program is recorded (XLA combines a tuple into one).

Around each measurement, between barriers, each process reads in its namespace its veth's
``tx_bytes``, ``tx_packets``, ``rx_bytes`` and ``rx_packets``; ``/proc/net/snmp``'s ``Tcp``
``OutSegs`` and ``RetransSegs``; and ``ss -tin``'s ``bytes_sent`` and ``data_segs_out`` of the
connections to the coordination service (:data:`PORT`) and of the others (gloo's). Reported per
all-reduce and direction, over ``S``: the veth's bytes, those less ``FRAME_OVERHEAD`` per packet
(the network study's payload) and gloo's TCP bytes; packets, mean bytes per packet, retransmitted
segments; and ``payload_per_S - 1`` explained by the headers (``packets * header``).

Measured (unshaped, ``benchmarks/results/probe_link_bytes.json``): 66.0 bytes of headers per
counted (GSO) packet, and gloo's :data:`benchmarks.studies.network.GLOO_OPERAND_BYTES` per operand.

Needs root and iproute2 (``python -m benchmarks.network.probe_link_bytes --help``); says why and
exits with 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import time
from typing import Any

import jax
import numpy as np
from jax.experimental.multihost_utils import sync_global_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.network import netns

DEVICES = 4
"""Emulated CPU devices per process (the ``wide`` mesh's second axis)."""
SIZES, REPEATS = (1_000_000, 4_000_000), 20
PORT = 7714
"""The coordination service's port."""
IDLE_SECONDS = 1.0
TRAINER_OPERANDS = (1536, 24, 24, 6144, 6144, 64, 2304, 24, 2304, 24, 2304, 24, 2304, 24, 24,
                    24, 24, 24, 9216, 24, 9216, 96, 2304, 24, 2304, 24, 2304, 24, 2304, 24, 24,
                    24, 24, 24, 9216, 24, 96, 9216)
"""float32 elements per device of the operands of the lm task's exchange (the network study's
trainer, 2 replicas of 4 devices): one ``all-reduce`` of 38 operands over the replicas, 279424
bytes per device (the compiled sync step's after-optimisation HLO)."""
SMALL_OPERANDS = (24,) * 38
"""As many operands as :data:`TRAINER_OPERANDS`, each of its smallest size (96 bytes)."""


def read_counters(device: str) -> dict[str, Any]:
  """This namespace's veth counters, ``Tcp`` counters, and TCP bytes sent per kind of connection
  (``coordination``: to or from :data:`PORT`; ``gloo``: the others)."""
  stats = pathlib.Path(f"/sys/class/net/{device}/statistics")
  return {key: int((stats / key).read_text())
          for key in ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")} | tcp_counters(
    pathlib.Path("/proc/net/snmp").read_text()) | {"connections": connections()}


def tcp_counters(snmp: str) -> dict[str, int]:
  """``Tcp`` ``OutSegs`` and ``RetransSegs`` of the text of ``/proc/net/snmp``."""
  names, values = (line.split()[1:] for line in snmp.splitlines() if line.startswith("Tcp:"))
  fields = dict(zip(names, values, strict=True))
  return {k: int(fields[k]) for k in ("OutSegs", "RetransSegs")}


def connections() -> dict[str, dict[str, int]]:
  """``{"local peer": {"bytes_sent", "data_segs_out", "retrans"}}`` of this namespace's TCP
  connections other than loopback ones, from ``ss -tin``."""
  text = subprocess.run(["ss", "-tinH"], capture_output=True, text=True, check=False).stdout
  out, key = {}, None
  for line in text.splitlines():
    if not line[:1].isspace():  # a connection: state, queues, local and peer addresses
      ends = line.split()[3:5]
      loopback = any(e.startswith("127.") for e in ends)
      key = " ".join(ends) if len(ends) == 2 and not loopback else None
    elif key is not None:  # its details: NAME:VALUE tokens
      info = dict(token.partition(":")[::2] for token in line.split())
      out[key] = {"bytes_sent": int(info.get("bytes_sent", 0)),
                  "data_segs_out": int(info.get("data_segs_out", 0)),
                  "retrans": int(info.get("retrans", "0").split("/")[-1])}  # retrans:NOW/TOTAL
  return out


def difference(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
  """``after - before``, with the connections' bytes summed per kind (a connection absent before
  counts from 0)."""
  out = {k: after[k] - before[k] for k in after if k != "connections"}
  out |= {f"{kind}_{field}": 0 for kind in ("coordination", "gloo")
          for field in ("bytes_sent", "data_segs_out", "retrans")}
  for key, info in after["connections"].items():
    kind = "coordination" if any(a.endswith(f":{PORT}") for a in key.split()) else "gloo"
    old = before["connections"].get(key, {})
    for field, value in info.items():
      out[f"{kind}_{field}"] += value - old.get(field, 0)
  return out


def worker(args: argparse.Namespace) -> dict[str, Any]:
  """Process ``--worker``'s counter differences per measurement."""
  process_id, device = args.worker, args.device
  both = netns.join(args, DEVICES)
  local = both[process_id]
  meshes = {"pair": Mesh(np.array([devs[0] for devs in both]), ("replica",)),
            "wide": Mesh(np.array(both), ("replica", "data"))}
  specs = {"pair": P("replica"), "wide": P("replica", "data")}

  def all_reduce(mesh, count):
    spec = specs[mesh]
    return jax.jit(jax.shard_map(lambda *v: jax.lax.psum(v, "replica"), mesh=meshes[mesh],
                                 in_specs=(spec,) * count, out_specs=(spec,) * count))

  def operand(mesh, elements):
    """``elements`` float32 per device of ``mesh`` in this process, and both processes' sum."""
    devices = local[:1] if mesh == "pair" else local
    base = np.arange(elements * len(devices), dtype=np.float32) % 7
    shards = [jax.device_put((process_id + 1) * base[None, i * elements:(i + 1) * elements], d)
              for i, d in enumerate(devices)]
    return (jax.make_array_from_single_device_arrays(
      (2, base.size), NamedSharding(meshes[mesh], specs[mesh]), shards), 3 * base)

  results = []

  def measured(name, kind, size, work):
    sync_global_devices(f"before {name}")
    before, start = read_counters(device), time.perf_counter()
    work()
    seconds, after = time.perf_counter() - start, read_counters(device)
    sync_global_devices(f"after {name}")
    results.append({"name": name, "kind": kind, "size": size, "operands": 0,
                    "seconds": seconds, **difference(before, after)})

  measured("idle", "idle", 0, lambda: time.sleep(IDLE_SECONDS))
  measurements = [(f"{mesh} {size}", mesh, (size // 4 // DEVICES * DEVICES // width,))
                  for mesh, width in (("pair", 1), ("wide", DEVICES)) for size in args.sizes]
  measurements += [("wide trainer", "wide", TRAINER_OPERANDS),
                   ("pair small", "pair", SMALL_OPERANDS)]
  for name, mesh, elements in measurements:
    fn, pairs = all_reduce(mesh, len(elements)), [operand(mesh, e) for e in elements]
    xs = [x for x, _ in pairs]
    outs = fn(*xs)  # compiles, and opens gloo's connections
    jax.block_until_ready(outs)
    ok = all(np.array_equal(np.asarray(s.data)[0], expected[s.index[1]])
             for out, (_, expected) in zip(outs, pairs, strict=True)
             for s in out.addressable_shards)

    def repeat(fn=fn, xs=xs):
      for _ in range(args.repeats):
        jax.block_until_ready(fn(*xs))

    hlo = fn.lower(*xs).compile().as_text()
    instructions = sum(" all-reduce(" in line or " all-reduce-start(" in line
                       for line in hlo.splitlines())
    nbytes = 4 * sum(elements) * (1 if mesh == "pair" else DEVICES)
    measured(name, mesh, nbytes, repeat)
    results[-1] |= {"name": name, "operands": len(elements), "instructions": instructions,
                    "correct": bool(ok)}
  measured("idle again", "idle", 0, lambda: time.sleep(IDLE_SECONDS))
  sync_global_devices("done")
  return {"process": process_id, "results": results}


def plain_tcp(link: netns.Link, nbytes: int) -> dict[str, Any]:
  """A TCP transfer of ``nbytes`` from ``b`` to ``a``: the sender's veth and ``Tcp`` counters,
  and the header bytes per packet they imply."""
  def snmp():
    return tcp_counters(link.run("b", ["cat", "/proc/net/snmp"]))

  before, segs = link.counters()["b"], snmp()
  link.measure_rate("b", nbytes)
  after, segs_after = link.counters()["b"], snmp()
  d = {k: after[k] - before[k] for k in ("tx_bytes", "tx_packets")}
  d |= {k: segs_after[k] - segs[k] for k in segs} | {"nbytes": nbytes}
  return d | {"header_per_packet": (d["tx_bytes"] - nbytes) / d["tx_packets"],
              "header_per_segment": (d["tx_bytes"] - nbytes) / d["OutSegs"]}


def rows(results: list[dict[str, Any]], repeats: int, header: float) -> list[dict[str, Any]]:
  """Per measurement and direction, the numbers per all-reduce."""
  out = []
  for proc in results:
    direction = "a->b" if proc["process"] == 0 else "b->a"
    for r in proc["results"]:
      count = repeats if r["kind"] != "idle" else 1
      row = {"name": r["name"], "operands": r["operands"], "size": r["size"],
             "direction": direction, "seconds": r["seconds"], "correct": r.get("correct"),
             "tx_bytes": r["tx_bytes"] / count, "tx_packets": r["tx_packets"] / count,
             "bytes_per_packet": r["tx_bytes"] / max(r["tx_packets"], 1),
             "out_segs": r["OutSegs"] / count, "retrans": r["RetransSegs"],
             "gloo_bytes": r["gloo_bytes_sent"] / count,
             "coordination_bytes": r["coordination_bytes_sent"] / count,
             "payload_66": (r["tx_bytes"] - netns.FRAME_OVERHEAD * r["tx_packets"]) / count,
             "payload_measured": (r["tx_bytes"] - header * r["tx_packets"]) / count}
      for k in ("tx_bytes", "gloo_bytes", "payload_66", "payload_measured"):
        row[f"{k}/S"] = row[k] / r["size"] if r["size"] else None
      out.append(row)
  return out


def report(tcp: dict[str, Any], table: list[dict[str, Any]], load: list[float]) -> str:
  keys = ("name", "operands", "size", "direction", "tx_bytes/S", "gloo_bytes/S", "payload_66/S",
          "payload_measured/S", "tx_packets", "bytes_per_packet", "out_segs", "retrans",
          "coordination_bytes", "correct")
  tcp_line = (f"plain TCP b->a of {tcp['nbytes']} B: veth {tcp['tx_bytes']} B in"
              f" {tcp['tx_packets']} packets ({tcp['OutSegs']} TCP segments, {tcp['RetransSegs']}"
              f" retransmitted): {tcp['header_per_packet']:.1f} B of headers per packet,"
              f" {tcp['header_per_segment']:.1f} per segment")
  return "\n".join([f"load average {load[0]:.2f} before, {load[1]:.2f} after", tcp_line, "",
                    f"per all-reduce and direction (idle: per measurement of {IDLE_SECONDS:.0f} s):",
                    netns.columns(list(keys), [[r[k] for k in keys] for r in table])])


def drive(args: argparse.Namespace, pair: Any) -> dict[str, Any]:
  """The plain TCP transfer and both processes' measurements over a link at ``--rate``."""
  with netns.Link(rate=args.rate) as link:
    before, tcp = os.getloadavg()[0], plain_tcp(link, args.repeats * max(args.sizes))
    results, (_, after) = pair(link)
  load, table = [before, after], rows(results, args.repeats, tcp["header_per_packet"])
  print(report(tcp, table, load))
  return {"rate": args.rate, "repeats": args.repeats, "load_average": load, "tcp": tcp,
          "rows": table, "raw": results}


def main(argv: list[str]) -> int:
  if shutil.which("ss") is None:
    print("skipped: ss not found; install iproute2 (apt-get install -y iproute2)")
    return 0
  return netns.probe_main(argv, "benchmarks.network.probe_link_bytes", __doc__, PORT, {
    "--sizes": {"type": int, "nargs": "+", "default": list(SIZES),
                "help": "bytes each process all-reduces"},
    "--repeats": {"type": int, "default": REPEATS},
    "--rate": {"default": "unshaped", "help": "the link's rate, e.g. 100mbit"}}, worker, drive)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
