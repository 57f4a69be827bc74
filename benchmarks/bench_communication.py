"""Bytes communicated per step by each algorithm, from :func:`optax_dist.communication_report`.

The training step of the ≈1M-parameter MLP of the overhead benchmark (784-1024-256-10, adam),
``jax.shard_map``'ed over 8 emulated CPU devices with axis ``"w"``, each worker with its own
params, optimizer state and minibatch. Only compiled (and lowered), never run: the arguments are
``jax.ShapeDtypeStruct`` with their shardings.

Per device and per execution: ``bytes`` is what each device contributes to a collective (its
operands), ``received`` what each device gets back (for an ``all_gather`` over 8 devices, 8× the
operands). The per-1,000-step totals count the communication steps of 1,000 steps (every step for
``tower``, every 10th for ``elastic_average`` and ``agn``, every 4th micro-step for
``accumulate_then_reduce``) at the communication-step bytes and the others at the
non-communication-step bytes.
"""

from __future__ import annotations

from typing import Any

import _util
import bench_overhead
import numpy as np

AXIS = "w"
DEVICES = 8
BATCH = 32
PERIOD = 10
EVERY_K = 4
STEPS = 1000


def configs() -> list[tuple[str, str, int, Any]]:
  """(algorithm, comm dtype, steps per communication, adam -> transformation)."""
  import jax.numpy as jnp

  import optax_dist

  rows = []
  for dtype_name, dtype in (("float32", None), ("bfloat16", jnp.bfloat16)):
    rows += [
      ("tower", dtype_name, 1,
       lambda adam, d=dtype: optax_dist.tower(adam, AXIS, comm_dtype=d)),
      (f"elastic_average τ={PERIOD}", dtype_name, PERIOD,
       lambda adam, d=dtype: optax_dist.elastic_average(
         adam, communication_period=PERIOD, axis_name=AXIS, comm_dtype=d)),
      (f"agn τ={PERIOD} sequential", dtype_name, PERIOD,
       lambda adam, d=dtype: optax_dist.agn(
         adam, communication_period=PERIOD, axis_name=AXIS, comm_dtype=d)),
      (f"agn τ={PERIOD} mean", dtype_name, PERIOD,
       lambda adam, d=dtype: optax_dist.agn(
         adam, communication_period=PERIOD, center_update="mean", axis_name=AXIS,
         comm_dtype=d)),
      (f"accumulate_then_reduce k={EVERY_K}", dtype_name, EVERY_K,
       lambda adam, d=dtype: optax_dist.accumulate_then_reduce(adam, EVERY_K, AXIS,
                                                               comm_dtype=d)),
    ]
  order = [r[0] for r in rows[:5]]
  return sorted(rows, key=lambda r: (order.index(r[0]), r[1] != "float32"))


def measure(seed: int = 0) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_dist
  from optax_dist.cli.models import MLP

  hidden = bench_overhead.SIZES[0][1]
  model = MLP(hidden, bench_overhead.CLASSES)
  params = jax.eval_shape(
    lambda: model.init(jax.random.key(seed), jnp.zeros((1, bench_overhead.FEATURES)))["params"])
  num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  mesh = Mesh(np.array(jax.devices()[:DEVICES]), (AXIS,))
  split = NamedSharding(mesh, P(AXIS))

  def stacked(tree):
    return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((DEVICES,) + tuple(x.shape), x.dtype, sharding=split), tree)

  def unstack(tree):
    return jax.tree.map(lambda x: x[0], tree)

  def stack(tree):
    return jax.tree.map(lambda x: x[None], tree)

  def loss_fn(p, x, y):
    logits = model.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  x = jax.ShapeDtypeStruct((DEVICES, BATCH, bench_overhead.FEATURES), jnp.float32, sharding=split)
  y = jax.ShapeDtypeStruct((DEVICES, BATCH), jnp.int32, sharding=split)
  adam = optax.adam(bench_overhead.LEARNING_RATE)
  rows = []
  for algorithm, dtype_name, every, make in configs():
    tx = make(adam)

    def step_fn(p, s, x, y, tx=tx):
      p, s = unstack(p), unstack(s)
      grads = jax.grad(loss_fn)(p, x[0], y[0])
      updates, s = tx.update(grads, s, p)
      return stack(optax.apply_updates(p, updates)), stack(s)

    step = jax.jit(jax.shard_map(step_fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    args = (stacked(params), stacked(jax.eval_shape(tx.init, params)), x, y)
    compiled = optax_dist.communication_report(step, *args)
    lowered = optax_dist.communication_report(step, *args, stage="lowered")
    comm, quiet = compiled.communication_step, compiled.non_communication_step
    rounds = STEPS // every

    def per_steps(report, rounds=rounds):
      c, q = report.communication_step.bytes, report.non_communication_step.bytes
      return rounds * c + (STEPS - rounds) * q

    rows.append({
      "algorithm": algorithm,
      "comm_dtype": dtype_name,
      "every": every,
      "comm_step": str(comm),
      "comm_bytes": comm.bytes,
      "comm_received": comm.result_bytes,
      "quiet_bytes": quiet.bytes,
      "quiet_count": quiet.count,
      "lowered_comm_bytes": lowered.communication_step.bytes,
      "lowered_comm_step": str(lowered.communication_step),
      "rounds": rounds,
      "bytes_per_1000": per_steps(compiled),
      "lowered_bytes_per_1000": per_steps(lowered),
    })
  return {"num_params": num_params, "params_bytes": 4 * num_params, "rows": rows,
          "hidden": hidden}


def markdown(result: dict[str, Any]) -> str:
  rows = result["rows"]
  reference = next(r for r in rows if r["algorithm"] == "tower" and r["comm_dtype"] == "float32")
  header = ["algorithm", "comm dtype", "communication step (compiled)", "sent B",
            "received B", "non-comm. step B", f"rounds / {STEPS}", f"sent / {STEPS} steps",
            "vs tower f32", "lowered: sent B", f"lowered: sent / {STEPS} steps",
            "lowered: vs tower f32"]
  table_rows = []
  for r in rows:
    table_rows.append([
      r["algorithm"], r["comm_dtype"], r["comm_step"], f"{r['comm_bytes']:,}",
      f"{r['comm_received']:,}", f"{r['quiet_bytes']:,}", str(r["rounds"]),
      _util.human_bytes(r["bytes_per_1000"]),
      f"{r['bytes_per_1000'] / reference['bytes_per_1000']:.3f}",
      f"{r['lowered_comm_bytes']:,}", _util.human_bytes(r["lowered_bytes_per_1000"]),
      f"{r['lowered_bytes_per_1000'] / reference['lowered_bytes_per_1000']:.3f}",
    ])
  return _util.table(header, table_rows, "lllrrrrrrrrr")
