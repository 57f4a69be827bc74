"""Step-time overhead of each transformation on the LM step, and of the optimizer alone.

**The LM step**: forward, backward, ``tx.update`` and ``apply_updates`` of the ``lm`` task's
transformer (:class:`optax_dist.cli.models.Transformer`, 0.28M params) on minibatches of 8
windows of 64 bytes per worker, jitted, for each transformation around ``optax.adam(3e-3)``
against the same step with bare adam, in four configurations:

* *bound*: ``jax.shard_map`` over 8 emulated CPU devices with axis ``"w"`` (8 workers, each its
  own params: every leaf's first axis is the 8 workers' blocks concatenated, so nothing is
  reshaped), the collectives real; *unbound*: one device, ``axis_name=None``, no collectives;
* the params and optimizer state *donated* (``donate_argnums=(0, 1)``) or not.

The periodic transformations are timed on their non-communication and communication steps
apart: before each call the step counter (``local_step``) is set so that the call is the one
wanted (``k·τ − 1`` for a communication step; for ``streaming_diloco``, the step before
fragment 0's sync). Each of these steps is timed twice: compiled with the counter rule (one
step with a ``lax.cond``, the default) and compiled with the static hint
``update(..., communicate=False)`` or ``communicate=True`` (rows marked *hint*: a trainer that
knows its schedule compiles one step of each kind, without the conditional).

Timing: each round calls the bare-adam step, then each transformation's step followed by
bare adam again (in a seeded random order), so each call sits between two adam calls; its ratio
is its time over their mean. Reported: the median ratio over the rounds (after a warm-up call of
each) with its interquartile range, the median of the same ratio in process CPU time, the
median wall time. Also, for each compiled step, XLA's temp bytes
(``compile().memory_analysis()``) and the bytes written by ``copy`` instructions in its HLO.

**The optimizer alone**: ``update`` + ``apply_updates`` on a 4M-param float32 tree, jitted on
one device with params and state donated, against a bound from bytes: each transformation must
make a known number of params-sized passes over memory (adam: read g, p, μ, ν, write μ, ν, p:
7), timed against the measured bandwidth of a fused ``a + b`` (3 passes) on the same tree.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dist
from benchmarks import kit
from benchmarks.studies._steps import Problem, Variant, ratio_cell, ratio_plot, time_variants
from optax_dist.cli.tasks import TASKS

BATCH, LEARNING_RATE, TARGET, PERIOD, SYNC_PERIOD, FRAGMENTS = 8, 3e-3, 1.03, 10, 50, 4
OPTIMIZER_SHAPES = {"w1": (1024, 2048), "w2": (2048, 1024), "b1": (2048,), "b2": (1024,)}
"""The 4M-param float32 tree of the optimizer-alone timing (4,197,376 params, 16 MiB)."""
CONFIGS = (("bound", True), ("bound", False), ("unbound", True), ("unbound", False))
"""(axis, donated) of the four LM-step configurations."""
HINTED_WHY = (
  "with the state not donated, the center{what} is unchanged but must still be written to new"
  " output buffers: {n} params-sized `copy` (the copies column; bare adam writes new moments"
  " anyway). Donated, the compiled step has bare adam's temp and copy bytes and the rest is noise")


@dataclasses.dataclass(frozen=True)
class Config:
  rounds_bound: int = kit.option(20, "timing rounds of the LM step over 8 devices")
  rounds_unbound: int = kit.option(60, "timing rounds of the LM step on one device")
  rounds_optimizer: int = kit.option(40, "timing rounds of the optimizer alone")


QUICK = {"rounds_bound": 2, "rounds_unbound": 3, "rounds_optimizer": 3}


def variants() -> list[Variant]:
  offset = SYNC_PERIOD // FRAGMENTS  # fragment 0 syncs where (local_step + 1) % H == H // F

  def periodic(period, comm_passes, passes=7):
    return (("non-communication step", 0, False, passes),
            ("communication step", period - 1, True, comm_passes))

  return [
    Variant("tower", "tower(adam)", lambda adam, axis: optax_dist.tower(adam, axis),
            (("every step (all-reduce when bound)", None, True, 7),)),
    Variant("moving_average", "moving_average(adam, 0.999)",
            lambda adam, axis: optax_dist.moving_average(adam, 0.999),
            (("every step", None, False, 9),),
            why="reads and writes the EMA on every step: 2 passes more than adam's 7 (inherent"
                " to an EMA)"),
    Variant("drop_stale_gradients", "drop_stale_gradients(adam, 2)",
            lambda adam, axis: optax_dist.drop_stale_gradients(adam, 2),
            (("every step (accepted)", None, False, 7),), grad_step=True,
            why="adam's update and state are computed and then selected with `tree.where` against"
                " the old state: the old moments are read again (no extra temp or copies)"),
    Variant("elastic_average", f"elastic_average(adam, τ={PERIOD})",
            lambda adam, axis: optax_dist.elastic_average(
              adam, communication_period=PERIOD, axis_name=axis), periodic(PERIOD, 9),
            why="adam's updates are an operand of the `lax.cond`, so they are written to"
                " memory instead of fused into `apply_updates`; the branch that skips hands the"
                " center and the updates back through `copy` instructions; and the `where`"
                " after it reads the new params, d and the updates on every step",
            hinted_why=HINTED_WHY.format(what="", n="one")),
    Variant("agn", f"agn(adam, τ={PERIOD})",
            lambda adam, axis: optax_dist.agn(adam, communication_period=PERIOD,
                                                 axis_name=axis), periodic(PERIOD, None, 9),
            why="the gradient accumulator a += g is a read-modify-write of a params-sized"
                " buffer on every step (9 passes instead of 7: inherent to AGN), and the"
                " `lax.cond` takes the updates and the accumulator as operands",
            hinted_why="the gradient accumulator a += g, a read-modify-write of a params-sized"
                       " buffer on every step (9 passes instead of 7: inherent to AGN); not"
                       " donated, the unchanged center and its inner state are also copied to"
                       " new output buffers"),
    Variant("local_sgd", f"local_sgd(adam, H={PERIOD})",
            lambda adam, axis: optax_dist.local_sgd(adam, sync_period=PERIOD, axis_name=axis),
            periodic(PERIOD, 7),
            why="the new params pass through the `lax.cond` (averaged on a sync)", hinted_why=""),
    Variant("diloco", f"diloco(adam, H={SYNC_PERIOD})",
            lambda adam, axis: optax_dist.diloco(adam, sync_period=SYNC_PERIOD,
                                                    axis_name=axis), periodic(SYNC_PERIOD, 11),
            why="adam's updates are an operand of the `lax.cond` (written to memory instead"
                " of fused into `apply_updates`), the conditional returns the anchor and the"
                " outer momentum through a temp buffer, and the `where(sync, anchor − params,"
                " updates)` after it reads the anchor on every step",
            hinted_why=HINTED_WHY.format(what=" (the anchor and the outer momentum)", n="two")),
    Variant("streaming_diloco", f"streaming_diloco(adam, H={SYNC_PERIOD}, F={FRAGMENTS})",
            lambda adam, axis: optax_dist.streaming_diloco(
              adam, sync_period=SYNC_PERIOD, num_fragments=FRAGMENTS, axis_name=axis,
              fragments="balanced"), (("non-communication step", 0, False, 7),
                                      ("fragment 0's sync", offset - 1, True, None)),
            why=f"as `diloco`, once per fragment: {FRAGMENTS} conditionals, each taking its"
                " fragment's updates, anchor and outer momentum as operands",
            hinted_why=HINTED_WHY.format(what=" (the anchor and the outer momenta)", n="two"))]


def lm_problem(bound: bool, seed: int = 0) -> Problem:
  """The LM's params and :data:`BATCH` windows per worker, :data:`kit.DEVICES` workers or one."""
  n, task = kit.DEVICES if bound else 1, TASKS["lm"]
  data = task.load(seed).train
  params = kit.initial_params(task, data, seed)
  rows = np.random.default_rng(seed).choice(len(data["x"]), n * BATCH, replace=False)
  return Problem(params, task.loss_fn(task.model()), ({k: v[rows] for k, v in data.items()},), n)


def measure_optimizer(rounds: int, seed: int = 0) -> dict[str, Any]:
  """``update`` + ``apply_updates`` on the 4M-param tree against its bytes-per-pass bound: the
  step of a problem whose batch is the gradients."""
  rng = np.random.default_rng(seed)
  host = {k: rng.normal(size=s).astype(np.float32) for k, s in OPTIMIZER_SHAPES.items()}
  p = Problem(host, None, (jax.tree.map(lambda x: 1e-3 * x, host),), 1)
  add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,))
  a, seconds = p.put(host), []
  with kit.Timed() as timed:
    for _ in range(max(rounds, 20) + 1):  # the first call, which compiles, left out
      start = time.perf_counter()
      a = jax.block_until_ready(add(a, p.batch[0]))  # 3 params-sized passes: read a, b; write a
      seconds.append(time.perf_counter() - start)
    bandwidth = 3 * p.params_bytes / kit.median(seconds[1:])
    t = time_variants(p, optax.adam(LEARNING_RATE), variants(), rounds, seed, bound=False)
  for r in t["rows"]:
    r["bound_ms"] = None if r["passes"] is None else 1e3 * r["passes"] * p.params_bytes / bandwidth
    r["bound_ratio"] = None if r["passes"] is None else r["passes"] / 7
  return {"num_params": p.num_params, "params_bytes": p.params_bytes, "bandwidth": bandwidth,
          "adam_ms": t["adam_ms"], "adam_bound_ms": 1e3 * 7 * p.params_bytes / bandwidth,
          "rows": t["rows"], "rounds": rounds, "adam_memory": t["adam_memory"], **timed.record()}


def measure(config: Config, prefix: str) -> dict[str, Any]:
  configs = []
  for axis, donated in CONFIGS:
    rounds = config.rounds_bound if (bound := axis == "bound") else config.rounds_unbound
    print(f"[lm_overhead] LM step, {axis}, donated={donated}", flush=True)
    p = lm_problem(bound)
    timed = time_variants(p, optax.adam(LEARNING_RATE), variants(), rounds, 0, bound=bound,
                          donate=donated)
    for row in timed["rows"]:
      row["communicates"] = row["communicates"] and bound
    configs.append({"axis": axis, "donated": donated, "rounds": rounds, "devices": p.n,
                    "num_params": p.num_params, **timed})
  print("[lm_overhead] optimizer alone", flush=True)
  return {"configs": configs, "optimizer": measure_optimizer(config.rounds_optimizer)}


def markdown(result: dict[str, Any], figure: str) -> str:
  return kit.blocks(
    "## Language model: overhead on the step", kit.doc_markdown(__doc__, 1, 4),
    matrix_markdown(result), missed_markdown(result),
    ("Temp bytes (`compile().memory_analysis()`) and bytes written by `copy` instructions in"
     " each compiled LM step:"), memory_markdown(result),
    f"![LM step time over bare adam's]({figure})",
    "### The optimizer alone", kit.doc_markdown(__doc__, 5, 5), optimizer_markdown(result))


def _config_name(c: dict[str, Any]) -> str:
  where = f"bound, {c['devices']} devices" if c["axis"] == "bound" else "unbound, 1 device"
  return f"{where}, {'donated' if c['donated'] else 'not donated'}"


def _applies(row: dict[str, Any]) -> bool:
  """Whether the 1.03× target applies: a step without collectives that is not a sync."""
  return not row["communicates"] and not row["sync_phase"]


def matrix_markdown(result: dict[str, Any]) -> str:
  configs = result["configs"]
  header = ["transformation", "step",
            *[x for c in configs for x in (f"{_config_name(c)}: ratio (IQR)", "CPU")],
            f"≤ {TARGET}× (wall)"]
  rows = [["bare adam", "every step", *[x for c in configs for x in (
    f"{c['adam_ms']:.1f} ms", f"{c['adam_cpu_ms']:.1f} ms")], ""]]
  rows += [[f"`{rs[0]['label']}`", rs[0]["phase"],
            *[x for r in rs for x in (ratio_cell(r), f"{r['cpu_ratio']:.3f}")], ", ".join(
              ("met" if r["ratio"] <= TARGET else "missed") if _applies(r) else "n/a" for r in rs)]
           for rs in zip(*(c["rows"] for c in configs))]
  return kit.blocks(kit.table(header, rows, "ll" + "rr" * len(configs) + "l"), "\n".join(
    f"- {_config_name(c)}: bare adam {c['adam_ms']:.1f} ms wall, {c['adam_cpu_ms']:.1f} ms"
    f" CPU per step; {c['rounds']} rounds; compile {c['compile_s']:.0f} s, timing"
    f" {c['timing_s']:.0f} s; load average {c['load_before']} before, {c['load_after']} after."
    for c in configs))


def memory_markdown(result: dict[str, Any]) -> str:
  configs = result["configs"]
  header = ["transformation"] + [f"{_config_name(c)}: temp / copies KiB" for c in configs]

  def kib(m: dict[str, Any]) -> str:
    return f"{m['temp'] / 1024:.0f} / {m['copies'] / 1024:.0f}"

  rows = [["bare adam"] + [kib(c["adam_memory"]) for c in configs]]
  keys = [(row["label"], row["hint"]) for row in configs[0]["rows"]]
  first = {key: keys.index(key) for key in keys}  # each compiled step once: its first row
  rows += [[f"`{label}`" + ("" if hint is None else f", `communicate={hint}`")]
           + [kib(c["rows"][j]) for c in configs] for (label, hint), j in first.items()]
  return kit.table(header, rows, "l" + "r" * len(configs))


def missed_markdown(result: dict[str, Any]) -> str:
  whys = {(v.label, hinted): v.hinted_why if hinted else v.why
          for v in variants() for hinted in (False, True)}
  params_kib, missed = result["configs"][0]["num_params"] * 4 / 1024, {}
  for c in result["configs"]:
    for r in c["rows"]:
      if _applies(r) and r["ratio"] > TARGET:
        missed.setdefault((r["label"], r["phase"], r.get("hint") is not None), []).append(
          f"{_config_name(c)} {r['ratio']:.3f}× (CPU {r['cpu_ratio']:.3f}×; temp"
          f" {(r['temp'] - c['adam_memory']['temp']) / 1024:+.0f} KiB, copies"
          f" {(r['copies'] - c['adam_memory']['copies']) / 1024:+.0f} KiB vs adam)")
  if not missed:
    return (f"Every non-communication LM step is within {TARGET}× of bare adam in every"
            " configuration.")
  return kit.blocks(
    (f"Missed (> {TARGET}× wall on a non-communication step), and why (params:"
     f" {params_kib:.0f} KiB per worker):"), "\n".join(
      f"- `{label}`, {phase}: {'; '.join(where)}. Why:"
      f" {whys.get((label, hinted)) or 'no structural cost expected: noise'}."
      for (label, phase, hinted), where in missed.items()))


def optimizer_markdown(result: dict[str, Any]) -> str:
  o = result["optimizer"]
  header = ["transformation", "step", "ms", "vs adam", "CPU vs adam", "passes", "bound ms",
            "bound vs adam", "ms / bound", "temp / copies MiB"]
  base = o["adam_memory"]
  rows = [["bare adam", "every step", f"{o['adam_ms']:.2f}", "1", "1", "7",
           f"{o['adam_bound_ms']:.2f}", "1", f"{o['adam_ms'] / o['adam_bound_ms']:.2f}",
           f"{kit.mib(base['temp'])} / {kit.mib(base['copies'])}"]]
  rows += [[f"`{r['label']}`", r["phase"], f"{r['ms']:.2f}", ratio_cell(r), f"{r['cpu_ratio']:.3f}",
            kit.fmt(r["passes"]), kit.fmt(r["bound_ms"], ".2f"), kit.fmt(r["bound_ratio"], ".3f"),
            kit.fmt(r["bound_ms"] and r["ms"] / r["bound_ms"], ".2f"),
            f"{kit.mib(r['temp'])} / {kit.mib(r['copies'])}"] for r in o["rows"]]
  slow = [r for r in o["rows"] if r["bound_ms"] and r["ratio"] > 1.25 * r["bound_ratio"]]
  notes = []
  if ruled := [r for r in slow if r.get("hint") is None]:
    notes.append(
      "Beyond their bound (time over bare adam's more than 1.25× the bound's ratio), with the"
      " counter rule: " + _slow_list(ruled) + ". Each of these steps has a `lax.cond` whose"
      " operands include params-sized trees (adam's updates, the center, the anchor): XLA"
      " writes them to temp buffers (and, for `elastic_average`, copies them back in the branch"
      " that skips), and the time exceeds what those bytes cost at the measured bandwidth, so"
      " the conditional itself runs slowly on XLA's CPU backend. Compiled with the hint, the"
      " non-communication steps have no conditional and bare adam's temp and copy bytes. On"
      " the LM step, where forward and backward dominate, the same cost is the few percent of"
      " the table above.")
  if hinted := [r for r in slow if r.get("hint") is not None]:
    notes.append(
      "Beyond their bound with the hint: " + _slow_list(hinted) + ". The exchange runs"
      " unconditionally there, but XLA does not fuse it into one pass over the params (the"
      " temp and copy bytes); it runs once per period.")
  return kit.blocks(
    (f"{o['num_params']:,} params ({kit.human_bytes(o['params_bytes'])}), one device,"
    f" `axis_name=None`, donated; measured bandwidth {o['bandwidth'] / 1e9:.1f} GB/s (a fused"
    f" `a + b` over the tree, 3 passes); {o['rounds']} rounds; load average {o['load_before']}"
    f" before, {o['load_after']} after. *passes*: the params-sized reads and writes the step"
    " must make (adam 7: read g, p, μ, ν, write μ, ν, p; an EMA +2; an accumulator +2; a"
    " DiLoCo sync +4: read anchor and outer momentum, write both; —: not counted); *bound*:"
    " passes × params bytes / bandwidth."), kit.table(header, rows, "llrrrrrrrr"), *notes)


def _slow_list(rows: list[dict[str, Any]]) -> str:
  return "; ".join(f"`{r['label']}` {r['phase']} {r['ratio']:.1f}× adam (bound"
                   f" {r['bound_ratio']:.2f}×; temp {kit.mib(r['temp'])} MiB, copies"
                   f" {kit.mib(r['copies'])} MiB)" for r in rows)


def plot(result: dict[str, Any], path: str) -> None:
  configs = result["configs"]
  ratio_plot([(_config_name(c), c["rows"]) for c in configs], TARGET,
             "LM step time / bare adam's (median, IQR)", f"Overhead on the LM step (dashed:"
             f" {TARGET}×). {kit.machine()['cores']} CPUs; load average {configs[0]['load_before']}"
             f" before, {configs[-1]['load_after']} after", path)
