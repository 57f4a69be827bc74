"""Decoupled rounds' staleness rules on the in-process engine, at the torchft benchmark's speeds.

Four replicas of speeds 1 : 0.976 : 0.475 : 0.231 (replica i's inner step takes 1 / v_i simulated
seconds: ``InProcess(speeds=...)``, a run deterministic per seed), the CPU shares the torchft
speeds benchmark measured under its caps for the ratio 1 : 1 : 0.5 : 0.25 (0.373, 0.364, 0.177,
0.086), train the ``lm`` task with ``diloco`` as that benchmark does (``--steps 200``, H = 20, the
task's AdamW recipe keyed to each replica's own inner steps, batch 8, outer Nesterov 0.7 and 0.9
or as ``--flags`` sets, for every arm). Each replica trains for the simulated time the fastest
needs for the command's steps, rounded down to whole sync periods (200, 180, 80, 40). Arms:

* K = 1 (``min_quorum``) with a grace window W = γ · H / max v, bounded by the slack H / max v,
  the fastest replica's time between two boundaries (the merge it pulls at its next boundary
  may take that long without anyone waiting; the clock has no transfer time and τ = 0); γ = 0
  (``--gamma``): W = 0, the benchmark's K = 1 arm. One arm per staleness rule: ``none``,
  ``dylu``, ``age_gate`` (``max_staleness`` 1), ``delayed_nesterov`` (the asynchronous
  emulator's outer optimizer, N = R = 4) and ``token_share`` (a merge over R times its tokens);
* the control: synchronous rounds (``InProcess`` without speeds, K = R: what K = R, an infinite
  window and equal speeds are bit for bit), 10 rounds of 4 × 20 steps.

The metric is the anchor's validation bits per byte, evaluated at every committed-round count a
replica reaches at a boundary and after the run, against the committed tokens (those of the
merged payloads, summed over the round lines), interpolated linearly at the common token count:
the most committed tokens every run reaches. Median and range over the seeds. The chosen rule is
the one of lowest median; when its range overlaps that of ``none``, the rules are not told apart
and the simplest, ``none``, is kept.

Exactly equal speeds are degenerate on this clock: two replicas of speed 1 push at the same
instants, so their payloads always merge together. At these speeds a round with W = 0 closes on
one payload, landed at its push: the outer optimizer steps once per payload.

Each run's lines go to ``PREFIX/ARM_seedS.jsonl`` (a run already there is not run again);
``--report`` computes every figure again from those files alone.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import threading
import time
from collections import Counter
from typing import Any

import jax
import numpy as np

import optax_dist
from benchmarks import kit
from optax_dist import fault_tolerance as ft
from optax_dist.cli import ft_task
from optax_dist.cli.tasks import TASKS
from optax_dist.fault_tolerance import decoupled

CONTROL, SIMPLEST = "synchronous", "none"


@dataclasses.dataclass(frozen=True)
class Config:
  seeds: tuple[int, ...] = kit.option((0, 1, 2), "the seeds")
  steps: int = kit.option(200, "the command's --steps: the fastest replica's inner steps")
  sync_period: int = kit.option(20, "H")
  speeds: tuple[float, ...] = kit.option((1.0, 0.976, 0.475, 0.231), "one speed per replica")
  gamma: float = kit.option(0.0, "the grace window over the slack H / max speed")
  max_staleness: int = kit.option(1, "age_gate's bound")
  rules: tuple[str, ...] = kit.option(decoupled.STALENESS_RULES, "the staleness rules")
  flags: str = kit.option("", "more train flags of every arm, e.g. '--outer-momentum 0'")


QUICK = {"seeds": (0,), "steps": 20, "sync_period": 4, "rules": ("none", "dylu")}


def replica_steps(c: Config) -> list[int]:
  """Each replica's inner steps: those of the fastest's time, in whole sync periods."""
  return [int(c.steps * v / max(c.speeds)) // c.sync_period * c.sync_period for v in c.speeds]


def measure(c: Config, prefix: str) -> dict[str, Any]:
  os.makedirs(prefix, exist_ok=True)
  for seed, arm in ((seed, arm) for seed in c.seeds for arm in (CONTROL, *c.rules)):
    path = os.path.join(prefix, f"{arm}_seed{seed}.jsonl")
    if not os.path.exists(path):  # a stopped study resumes
      kit.write_json(path, out := run(c, arm, seed), lines=True)
      print(f"[bench] {arm} seed {seed}: {out[0]['wall_s']:.0f} s", flush=True)
  return load(prefix, c)


def run(c: Config, arm: str, seed: int) -> list[dict[str, Any]]:
  """One run's lines: its record, its rounds (``MergeLine`` objects) and its evaluations."""
  r, task = len(c.speeds), TASKS["lm"]
  s = kit.settings(c.flags.split(), algorithm="diloco", devices=r, steps=c.steps,
                   sync_period=c.sync_period, seed=seed).resolved()
  params, loss_and_grad, batch_fn, tokens, evaluate = ft_task.task_engine(
    task, task.load(seed), s, r)
  protocol = ft_task.protocol(dataclasses.replace(s, replicas=r), arm)  # N = R: the command's
  rules = {} if arm == CONTROL else {
    "speeds": c.speeds, "min_quorum": 1, "grace_window": c.gamma * c.sync_period / max(c.speeds),
    "staleness_rule": arm, "max_staleness": c.max_staleness}
  engine = ft.InProcess(protocol, num_replicas=r, seed=seed, tokens_per_step=tokens, **rules)
  limits = [c.steps] * r if arm == CONTROL else replica_steps(c)
  evals, cpu = {0: evaluate(params)}, time.process_time()
  with kit.Timed() as timed:
    engine.run(loop(protocol, params, loss_and_grad, batch_fn, limits, evaluate, evals))
    if engine.state is not None:
      evals[int(engine.state[0].rounds)] = evaluate(
        optax_dist.eval_params(engine.state[0].opt_state, params))
  record = {"kind": "run", "arm": arm, "seed": seed, "replica_steps": limits, "replicas": r,
            "tokens_per_step": tokens, "settings": s.as_dict(), **rules, **timed.record(),
            "cpu_s": time.process_time() - cpu}
  rounds = engine.log if arm != CONTROL else control_lines(engine.log, c)
  return [record, *({"kind": "merge", **dataclasses.asdict(x)} for x in rounds),
          *({"kind": "eval", "rounds": k, "bits_per_byte": v} for k, v in sorted(evals.items()))]


def loop(protocol: Any, params: Any, loss_and_grad: Any, batch_fn: Any, limits: list[int],
         evaluate: Any, evals: dict[int, float]) -> Any:
  """:func:`~optax_dist.fault_tolerance.replica.task_loop`'s inner steps, replica i's until
  its ``local_step`` is ``limits[i]``; the anchor evaluated once per committed-round count a
  replica holds after a boundary (into ``evals``)."""
  grads_of, lock = jax.jit(loss_and_grad), threading.Lock()

  def train(replica: Any) -> Any:
    state = replica.start((params, protocol.tx.init(params)))
    while replica.step < limits[replica.slot]:
      loss, grads = grads_of(state[0], batch_fn(replica.seed, replica.slot, replica.step))
      state = replica.after_step(protocol.inner_step(*state, grads), loss=loss)
      with lock:
        new = replica.rounds not in evals
        evals.setdefault(replica.rounds, math.nan)
      if new:
        evals[replica.rounds] = evaluate(ft_task.evaluated(replica.replica_state))
    return replica.replica_state

  return train


def control_lines(log: list[Any], c: Config) -> list[decoupled.MergeLine]:
  """The synchronous rounds as ``MergeLine`` objects (payloads by replica, staleness 0; the time
  of H steps of the slowest replica)."""
  rows = [tuple(sorted((x.replica, x.step, x.weight, 0, x.weight, x.committed)
                       for x in log if x.round == r and x.members))
          for r in sorted({x.round for x in log})]
  return [decoupled.MergeLine(r, (r + 1) * c.sync_period / min(c.speeds), any(x[5] for x in row),
                              "", r, row, 0, "") for r, row in enumerate(rows)]


def curve(lines: list[dict[str, Any]]) -> dict[str, list[float]]:
  """A run's evaluations against its committed tokens, with the time of its last commit."""
  commits = [x for x in lines if x["kind"] == "merge" and x.get("committed")]  # not a Revert's
  tokens = np.cumsum([0] + [sum(p[2] for p in x["payloads"] if p[5]) for x in commits])
  times, evals = [0.0] + [x["time"] for x in commits], [x for x in lines if x["kind"] == "eval"]
  return {"tokens": [float(tokens[x["rounds"]]) for x in evals],
          "time": [times[x["rounds"]] for x in evals],
          "bits_per_byte": [x["bits_per_byte"] for x in evals]}


def rounds_stats(lines: list[dict[str, Any]]) -> dict[str, Any]:
  """The commits, the share with fewer than R payloads merged, every closed payload's
  staleness (``{staleness: payloads}``) and the tokens of those not merged."""
  merges = [x for x in lines if x["kind"] == "merge" and "payloads" in x]  # a Revert's: "lost"
  merged = [sum(p[5] for p in x["payloads"]) for x in merges if x["committed"]]
  partial = sum(n < lines[0]["replicas"] for n in merged) / len(merged)
  return {"commits": len(merged), "partial": partial,
          "staleness": Counter(p[3] for x in merges for p in x["payloads"]),
          "lost": sum(x["lost"] for x in lines if x["kind"] == "merge")}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
  """Each arm's metric at the common token count (by seed) and rounds' figures; the chosen rule."""
  common, arms = min(r["curve"]["tokens"][-1] for r in runs), {}
  for r in runs:
    a = arms.setdefault(r["arm"], {"by_seed": {}, "staleness": Counter(), "lost": 0})
    a["by_seed"][r["seed"]] = float(np.interp(common, r["curve"]["tokens"],
                                              r["curve"]["bits_per_byte"]))
    a["staleness"].update(r["stats"]["staleness"])
    a["lost"] += r["stats"]["lost"]
    for key, value in (("commits", r["stats"]["commits"]), ("partial", r["stats"]["partial"]),
                       ("end", r["curve"]["time"][-1]), ("final", r["curve"]["bits_per_byte"][-1]),
                       ("tokens", r["curve"]["tokens"][-1])):
      a.setdefault(key, []).append(value)
  for a in arms.values():
    v = list(a["by_seed"].values())
    a |= {"median": kit.median(v), "min": min(v), "max": max(v),
          "staleness": dict(sorted(a["staleness"].items()))}
  return {"common_tokens": common, "arms": arms, "chosen": choose(arms)}


def choose(arms: dict[str, Any]) -> str:
  """The rule of lowest median; ``none`` when its range overlaps the best's."""
  rules = {k: a for k, a in arms.items() if k != CONTROL}
  best, plain = min(rules, key=lambda k: rules[k]["median"]), rules.get(SIMPLEST)
  return SIMPLEST if plain is not None and plain["min"] <= rules[best]["max"] else best


def load(prefix: str, config: Config) -> dict[str, Any]:
  """The result computed from ``PREFIX/*.jsonl`` alone."""
  files = [kit.read_json(path, lines=True) for path in sorted(glob.glob(f"{prefix}/*.jsonl"))]
  runs = [{**lines[0], "curve": curve(lines), "stats": rounds_stats(lines)} for lines in files]
  return {"runs": runs, **summarize(runs)}


def markdown(result: dict[str, Any], plot_name: str) -> str:
  arms, runs, rule = result["arms"], result["runs"], result["chosen"]
  one = next(r for r in runs if r["arm"] != CONTROL)
  speeds = " : ".join(f"{v:g}" for v in one["speeds"])
  rows = [[f"`{name}`" + " (chosen)" * (name == rule), kit.spread([*a["by_seed"].values()], ".4f"),
           "—" if name == CONTROL else f"{a['median'] / arms[CONTROL]['median'] - 1:+.2%}",
           kit.spread(a["final"], ".4f"), kit.spread([t / 1e6 for t in a["tokens"]], ".3f"),
           kit.spread(a["commits"], ".0f"), kit.spread(a["partial"], ".0%"),
           ", ".join(f"{k}: {v}" for k, v in a["staleness"].items()), f"{a['lost']:,}",
           kit.spread(a["end"], ".0f")] for name, a in arms.items()]
  header = ["arm", "val bits/byte at equal tokens, median [min, max]", "vs synchronous",
            "val bits/byte at the end", "committed tokens at the end (M)", "commits",
            "commits with < R payloads merged", "staleness: payloads (all seeds)",
            "tokens not merged (all seeds)", "last commit (simulated s)"]
  load = [float(r[k].split(",")[0]) for r in runs for k in ("load_before", "load_after")]
  why = (f"`{rule}` has the lowest median, and its range does not overlap that of `none`"
         if rule != SIMPLEST else "the range of `none` overlaps that of the lowest median (or"
         " `none` has it): the rules are not told apart, and `none` is the simplest")
  return kit.blocks(
    f"# Decoupled rounds: the staleness rule at speeds {speeds}",
    kit.doc_markdown(__doc__, 1, 4),
    (f"As run: speeds {speeds}; replica steps {', '.join(map(str, one['replica_steps']))}; H ="
     f" {one['settings']['sync_period']}; outer learning rate"
     f" {one['settings']['outer_learning_rate']:g}, momentum {one['settings']['outer_momentum']:g};"
     f" K = {one['min_quorum']}, W = {one['grace_window']:g} simulated s; max_staleness"
     f" {one['max_staleness']}; {one['tokens_per_step']} tokens per step; seeds"
     f" {', '.join(map(str, sorted({r['seed'] for r in runs})))}. Equal tokens:"
     f" {result['common_tokens']:,.0f} committed tokens. The 1-minute load average from"
     f" {min(load):.2f} to {max(load):.2f} before and after the runs; in all"
     f" {sum(r['cpu_s'] for r in runs) / 60:.1f} min of CPU,"
     f" {sum(r['wall_s'] for r in runs) / 60:.1f} min of wall clock."),
    kit.table(header, rows, "lrrrrrrlrr"), f"Chosen: **`{rule}`**: {why}.",
    "Targets:\n\n" + "\n".join(targets(result)),
    f"![validation bits per byte against committed tokens, median seed]({plot_name})")


def targets(result: dict[str, Any]) -> list[str]:
  arms, rule = result["arms"], result["chosen"]
  seeds, met = len(arms[rule]["by_seed"]), {True: "met", False: "missed"}
  gap = arms[rule]["median"] / arms[CONTROL]["median"] - 1
  return [(f"- the rule chosen by the median of {seeds} seeds at equal tokens, every rule's"
           f" result reported: **{met[seeds >= 3]}**."),
          (f"- the chosen rule within 1% of the synchronous control at equal committed tokens:"
           f" {gap:+.2%}: **{met[gap <= 0.01]}**.")]


def plot(result: dict[str, Any], path: str) -> None:
  fig, ax = kit.plt.subplots(figsize=(8, 4.5))
  for name, a in result["arms"].items():
    seed = sorted(a["by_seed"], key=a["by_seed"].get)[(len(a["by_seed"]) - 1) // 2]
    (r,) = [x for x in result["runs"] if x["arm"] == name and x["seed"] == seed]
    ax.plot(np.asarray(r["curve"]["tokens"]) / 1e6, r["curve"]["bits_per_byte"], marker=".",
            label=f"{name} (seed {seed})", linestyle="--" if name == CONTROL else "-")
  ax.axvline(result["common_tokens"] / 1e6, color="grey", linewidth=0.8)
  ax.set(xlabel="committed tokens (millions)", ylabel="validation bits per byte (anchor)")
  ax.legend(fontsize=8)
  one = next(r for r in result["runs"] if r["arm"] != CONTROL)
  kit.save_figure(fig, path, f"decoupled rounds, K = {one['min_quorum']}, W ="
                             f" {one['grace_window']:g} s: each arm's median seed; the line:"
                             " equal tokens", grid=True)
