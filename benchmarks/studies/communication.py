"""Bytes communicated per step by each algorithm, from :func:`optax_dist.communication_report`.

The ≈1M MLP's step of ``mlp_overhead`` over 8 emulated devices, compiled (and lowered) from
``jax.ShapeDtypeStruct``s, never run.

Bytes are per device and per execution: *sent* is what a device contributes (a collective's
operands), *received* its result (an ``all_gather`` over 8 devices returns 8× what each sends: AGN's
sequential center update gathers every worker's accumulated gradient). Per 1000 steps: communication
steps at the communication-step bytes, the others at the non-communication-step bytes (none for
every algorithm here). **bfloat16 on CPU**: XLA's CPU compiler widens bfloat16 collectives to
float32 after rounding the values to bfloat16, so the compiled stage reports float32 bytes for the
``comm_dtype=bfloat16`` rows; the *lowered* columns (``stage="lowered"``, the program as JAX emits
it, one collective per leaf) show the halved bytes that GPU and TPU backends send.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
import optax

import optax_dist
from benchmarks import kit
from benchmarks.studies import mlp_overhead
from benchmarks.studies._steps import AXIS

BATCH, PERIOD, EVERY_K, STEPS = 32, 10, 4, 1000


@dataclasses.dataclass(frozen=True)
class Config:
  seed: int = kit.option(0, "the params' seed (the shapes alone matter)")


QUICK = {}


def configs() -> list[tuple[str, str, int, Any]]:
  """(algorithm, comm dtype, steps per communication, adam -> transformation)."""
  makers = (
    ("tower", 1, lambda adam, d: optax_dist.tower(adam, AXIS, comm_dtype=d)),
    (f"elastic_average τ={PERIOD}", PERIOD, lambda adam, d: optax_dist.elastic_average(
      adam, communication_period=PERIOD, axis_name=AXIS, comm_dtype=d)),
    (f"agn τ={PERIOD} sequential", PERIOD, lambda adam, d: optax_dist.agn(
      adam, communication_period=PERIOD, axis_name=AXIS, comm_dtype=d)),
    (f"agn τ={PERIOD} mean", PERIOD, lambda adam, d: optax_dist.agn(
      adam, communication_period=PERIOD, center_update="mean", axis_name=AXIS, comm_dtype=d)),
    (f"accumulate_then_reduce k={EVERY_K}", EVERY_K,
     lambda adam, d: optax_dist.accumulate_then_reduce(adam, EVERY_K, AXIS, comm_dtype=d)))
  return [(name, dtype_name, every, functools.partial(make, d=dtype))
          for name, every, make in makers
          for dtype_name, dtype in (("float32", None), ("bfloat16", jnp.bfloat16))]


def measure(config: Config, prefix: str) -> dict[str, Any]:
  hidden = mlp_overhead.SIZES[0][1]
  problem = mlp_overhead.problem(hidden, config.seed, kit.DEVICES, BATCH)
  adam, rows = optax.adam(mlp_overhead.LEARNING_RATE), []
  for algorithm, dtype_name, every, make in configs():
    tx = make(adam)
    step, args = problem.jitted(tx), problem.arguments(tx)
    compiled = optax_dist.communication_report(step, *args)
    lowered = optax_dist.communication_report(step, *args, stage="lowered")
    comm, rounds = compiled.communication_step, STEPS // every
    per_compiled, per_lowered = (  # bytes per STEPS steps
      rounds * r.communication_step.bytes + (STEPS - rounds) * r.non_communication_step.bytes
      for r in (compiled, lowered))
    rows.append({
      "algorithm": algorithm, "comm_dtype": dtype_name, "every": every, "comm_step": str(comm),
      "comm_bytes": comm.bytes, "comm_received": comm.result_bytes,
      "quiet_bytes": compiled.non_communication_step.bytes,
      "quiet_count": compiled.non_communication_step.count,
      "lowered_comm_bytes": lowered.communication_step.bytes,
      "lowered_comm_step": str(lowered.communication_step), "rounds": rounds,
      "bytes_per_1000": per_compiled, "lowered_bytes_per_1000": per_lowered})
  return {"num_params": problem.num_params, "params_bytes": problem.params_bytes, "rows": rows,
          "hidden": hidden}


def markdown(result: dict[str, Any], figure: str) -> str:
  intro = (f"The training step of the ≈1M MLP ({result['num_params']:,} params,"
           f" {result['params_bytes']:,} B in float32, hidden"
           f" {'-'.join(map(str, result['hidden']))}) under `jax.shard_map` over {kit.DEVICES}"
           " emulated CPU devices, compiled (not run) from `jax.ShapeDtypeStruct`s, and read by"
           " `optax_dist.communication_report`. " + kit.doc_markdown(__doc__, 2, 2))
  return kit.blocks("## MLP: communication", intro, table(result),
                    f"![bytes sent per {STEPS} steps]({figure})")


def plot(result: dict[str, Any], path: str) -> None:
  rows = result["rows"]
  fig, ax = kit.plt.subplots(figsize=(9, 4))
  x = range(len(rows))
  ax.bar([i - 0.2 for i in x], [r["bytes_per_1000"] / 2**20 for r in rows], 0.4, label="compiled")
  ax.bar([i + 0.2 for i in x], [r["lowered_bytes_per_1000"] / 2**20 for r in rows], 0.4,
         label="lowered")
  ax.set_xticks(list(x), [f"{r['algorithm']}\n{r['comm_dtype']}" for r in rows], fontsize=6,
                rotation=90)
  ax.set(yscale="log", ylabel=f"MiB sent per device per {STEPS} steps")
  ax.legend(fontsize=8)
  kit.save_figure(fig, path)


def table(result: dict[str, Any]) -> str:
  rows = result["rows"]
  reference = next(r for r in rows if r["algorithm"] == "tower" and r["comm_dtype"] == "float32")
  header = ["algorithm", "comm dtype", "communication step (compiled)", "sent B",
            "received B", "non-comm. step B", f"rounds / {STEPS}", f"sent / {STEPS} steps",
            "vs tower f32", "lowered: sent B", f"lowered: sent / {STEPS} steps",
            "lowered: vs tower f32"]
  return kit.table(header, [[
    r["algorithm"], r["comm_dtype"], r["comm_step"], f"{r['comm_bytes']:,}",
    f"{r['comm_received']:,}", f"{r['quiet_bytes']:,}", str(r["rounds"]),
    kit.human_bytes(r["bytes_per_1000"]),
    f"{r['bytes_per_1000'] / reference['bytes_per_1000']:.3f}",
    f"{r['lowered_comm_bytes']:,}", kit.human_bytes(r["lowered_bytes_per_1000"]),
    f"{r['lowered_bytes_per_1000'] / reference['lowered_bytes_per_1000']:.3f}"] for r in rows],
    "lllrrrrrrrrr")
