"""Synchronous DiLoCo against asynchronous DiLoCo, delayed Nesterov and DyLU on heterogeneous
workers (Liu et al. 2024, Table 3's comparison), emulated on the language model.

Four workers of speeds 1 : 1 : 0.5 : 0.25 (a step of worker w takes 1 / v_w units of simulated time;
``--speeds`` sets others) train the ``lm`` task of ``optax-dist`` (the byte-level transformer on the
Python standard library's sources; ``--model`` sets its width and depth), each on its own quarter of
the training windows (whole files, in corpus order; ``--shards shuffled`` deals the windows at
random instead), with the command's recipe for the task as the inner optimizer (AdamW, warm-up then
cosine decay keyed to the worker's own inner steps, sized to R × H, clipping; batch 8 per worker),
sync period H, outer learning rate 0.7 and momentum 0.9 (``--outer`` sets both for every run):

* ``sync diloco``: :func:`optax_dist.diloco` under ``jax.vmap``, R rounds: every round all
  workers take H steps and wait for the slowest, so a round takes H / 0.25 time units; one
  Nesterov step on the mean pseudo-gradient;
* ``async diloco``: the emulator's :func:`~optax_dist.async_emulator.diloco`, one Nesterov step
  (``optax.sgd(0.7, 0.9, nesterov=True)``) per commit, nobody waiting;
* ``async + delayed nesterov``: ``outer=optax_dist.delayed_nesterov(0.7, 0.9, buffer_size=4)``
  (``--buffer-size`` and ``--activation`` set its N and c);
* ``async + delayed nesterov + dylu``: the same with ``dylu=True`` (H_w = ⌊v_w / max v · H⌋).

Equal inner steps: every run takes 4 R H inner steps in all (the asynchronous schedules stop
after that many steps, whoever took them), so the asynchronous runs end sooner in simulated time
(the fast workers take more of the steps). The metric is the validation bits per byte of the
anchor (the server's params), evaluated along the way. Targets (Liu et al.'s ordering): delayed
Nesterov + DyLU ends within 1% of synchronous DiLoCo; plain asynchronous DiLoCo ends measurably
worse (above synchronous DiLoCo on every seed).

Usage: ``python -m benchmarks async_dylu [--seeds 0 1 2] [--rounds R] [--sync-period H]
[--recipe FLAGS] [--outer LR MOMENTUM] [--speeds V ...] [--buffer-size N] [--activation C]
[--shards files|shuffled] [--model WIDTH DEPTH] [--quick] [--out PREFIX] [--report]`` writes
PREFIX.json, PREFIX.md and PREFIX.png (default ``benchmarks/results/async_dylu``; with
``--quick``, a few short runs into a temporary directory).

Synchronous DiLoCo is this module's own loop (:func:`sync_diloco`), not the trainer's: it draws
its minibatches from the emulator's shards (:func:`optax_dist.cli.async_run.setup`, shuffled or
not, with ``--model``'s transformer) and counts simulated time as the emulator does, so that the
four runs differ in the protocol alone.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dist
from benchmarks import kit
from optax_dist import async_emulator as ae
from optax_dist.cli import async_run, tasks
from optax_dist.cli.algorithms import inner_optimizer
from optax_dist.cli.models import Transformer

SPEEDS, OUTER_LR, OUTER_MOMENTUM = (1.0, 1.0, 0.5, 0.25), 0.7, 0.9
ROUNDS, PERIOD = 12, 30
"""R synchronous rounds of H inner steps: 4 × 12 × 30 = 1,440 inner steps per run."""
EVALS_PER_ROUND = 2
"""Evaluations per R × H × 4 / R inner steps (twice a synchronous round's worth)."""
TOLERANCE = 0.01
SHARDS = {
  "files": "the command's shards: worker i holds the i-th quarter of the training windows, in"
           " corpus order (whole files, so the shards differ in content)",
  "shuffled": "the training windows dealt to the workers at random (each shard a uniform"
              " sample, as Liu et al.'s workers each sample C4)"}
PROTOCOLS = ("async diloco", "async + delayed nesterov", "async + delayed nesterov + dylu")


@dataclasses.dataclass(frozen=True)
class Config:
  seeds: tuple[int, ...] = kit.option((0, 1, 2), "the seeds")
  rounds: int = kit.option(ROUNDS, "R, synchronous rounds")
  sync_period: int = kit.option(PERIOD, "H")
  task: str = kit.option("lm", "an optax-dist task")
  recipe: str = kit.option("", "flags of `optax-dist train` changing the inner recipe, e.g."
                           " '--lr-schedule constant' (default: none, the task's recipe)")
  outer: tuple[float, float] = kit.option((OUTER_LR, OUTER_MOMENTUM), "the outer learning rate"
                                          " and momentum of every run", metavar=("LR", "MOMENTUM"))
  speeds: tuple[float, ...] = kit.option(SPEEDS, "one relative speed per worker")
  shards: str = kit.option("files", "; ".join(f"{k}: {v}" for k, v in SHARDS.items()),
                           choices=tuple(SHARDS))
  buffer_size: int | None = kit.option(None, "delayed Nesterov's N (default: the workers)")
  activation: float = kit.option(0.0, "delayed Nesterov's momentum activation c")
  model: tuple[int, int] | None = kit.option(None, "lm only: the transformer's width and depth"
                                             " (default the task's, 96 and 2: 0.28M params)",
                                             metavar=("WIDTH", "DEPTH"))


QUICK = {"rounds": 2, "sync_period": 6, "seeds": (0,)}


def task_of(setting: Config) -> Any:
  """The ``optax-dist`` task of ``setting``, with its transformer's width and depth."""
  task = tasks.TASKS[setting.task]
  if setting.model is None:
    return task
  if setting.task != "lm":
    raise ValueError(f"--model WIDTH DEPTH is for the lm task, not {setting.task!r}.")
  width, depth = setting.model
  return dataclasses.replace(task, model=lambda: Transformer(
    context=tasks.LM_CONTEXT, width=width, depth=depth))


def sync_diloco(problem: dict[str, Any], inner: Any, *, h: int, rounds: int, batch: int,
                seed: int, outer: tuple[float, float]) -> np.ndarray:
  """The anchor's metric after each round of synchronous DiLoCo (round 0 first)."""
  data, loss_fn = problem["data"], problem["loss_fn"]
  n, m = jax.tree.leaves(data)[0].shape[:2]
  tx = optax_dist.diloco(inner, optax.sgd(*outer, nesterov=True), sync_period=h, axis_name="w")
  index = jnp.asarray(np.random.default_rng((seed, 7)).integers(0, m, size=(rounds, h, n, batch)))

  def worker(params, state, shard, idx):
    def step(carry, i):
      p, s = carry
      g = jax.grad(loss_fn)(p, jax.tree.map(lambda d: d[i], shard))
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    (params, state), _ = jax.lax.scan(step, (params, state), idx)
    return params, state

  one_round = jax.jit(jax.vmap(worker, axis_name="w", in_axes=(0, 0, 0, 1)))
  params = jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), problem["params"])
  state, metric = jax.vmap(tx.init)(params), jax.jit(problem["metric_fn"])
  values = [float(metric(problem["params"]))]
  for r in range(rounds):
    params, state = one_round(params, state, data, index[r])
    values.append(float(metric(jax.tree.map(lambda a: a[0], state.anchor))))
  return np.asarray(values)


def protocols(inner: Any, setting: Config) -> dict[str, Any]:
  h, outer, buffer = setting.sync_period, setting.outer, setting.buffer_size or len(setting.speeds)
  delayed = optax_dist.delayed_nesterov(*outer, buffer_size=buffer, activation=setting.activation)
  return dict(zip(PROTOCOLS, (ae.diloco(inner, optax.sgd(*outer, nesterov=True), sync_period=h),
                              ae.diloco(inner, delayed, sync_period=h),
                              ae.diloco(inner, delayed, sync_period=h, dylu=True)), strict=True))


def async_curve(problem: dict[str, Any], protocol: Any, *, speeds: tuple[float, ...],
                steps: int, batch: int, seed: int, eval_every: int) -> dict[str, Any]:
  """One asynchronous run of ``steps`` inner steps: its metric against simulated time and
  inner steps, and its commits and their staleness."""
  cluster = ae.Cluster(len(speeds), speeds=speeds, seed=seed)
  schedule = cluster.schedule(num_events=steps,
                              communication_period=protocol.sync_periods(cluster.worker_speeds))
  r = ae.emulate(protocol, problem["loss_fn"], problem["params"], problem["data"], schedule,
                 batch_size=batch, seed=seed, eval_fn=problem["metric_fn"], eval_every=eval_every)
  stale = r.staleness[r.committed]
  # Every event is an inner step: the evaluations follow every eval_every-th and the last.
  done = [0, *(min(k * eval_every, steps) for k in range(1, len(r.eval_time)))]
  return {"time": r.eval_time.tolist(), "steps": done,
          "metric": np.asarray(r.eval_metrics, np.float64).tolist(),
          "commits": int(r.committed.sum()),
          "mean_staleness": float(stale.mean()) if stale.size else 0.0}


def shuffled(data: Any, seed: int) -> Any:
  """``data`` (every leaf ``[N, M, ...]``, worker ``i``'s shard at ``i``) with its examples
  dealt again at random: every shard a uniform sample of the whole training set."""
  n, m = jax.tree.leaves(data)[0].shape[:2]
  order = jnp.asarray(np.random.default_rng((seed, 11)).permutation(n * m))
  return jax.tree.map(lambda a: a.reshape((n * m, *a.shape[2:]))[order].reshape(a.shape), data)


def measure(st: Config, prefix: str) -> dict[str, Any]:
  n, h, rounds, runs = len(st.speeds), st.sync_period, st.rounds, []
  total = n * rounds * h
  s = kit.settings(shlex.split(st.recipe), task=st.task, steps=rounds * h).resolved()
  inner, batch = inner_optimizer(s), s.batch_size  # those of optax-dist train with the recipe
  with kit.Timed() as timed:
    for seed in st.seeds:
      problem = async_run.setup(task_of(st), n, seed)
      if st.shards == "shuffled":
        problem["data"] = shuffled(problem["data"], seed)
      with kit.Timed() as one:
        values = sync_diloco(problem, inner, h=h, rounds=rounds, batch=batch, seed=seed,
                             outer=st.outer)
      runs.append({"name": "sync diloco", "seed": seed, "metric": values.tolist(),
                   "time": [r * h / min(st.speeds) for r in range(rounds + 1)],
                   "steps": [r * n * h for r in range(rounds + 1)], "commits": rounds,
                   "mean_staleness": 0.0, "wall_s": one.seconds})
      for name, protocol in protocols(inner, st).items():
        with kit.Timed() as one:
          curve = async_curve(problem, protocol, speeds=st.speeds, steps=total, batch=batch,
                              seed=seed, eval_every=total // (rounds * EVALS_PER_ROUND))
        runs.append({"name": name, "seed": seed, **curve, "wall_s": one.seconds})
      for r in runs[-4:]:
        print(f"[bench] seed {seed} {r['name']}: {r['metric'][-1]:.4f} at t ="
              f" {r['time'][-1]:.0f}, {r['commits']} commits, {r['wall_s']:.0f} s", flush=True)
      jax.clear_caches()
  return {**dataclasses.asdict(st), "recipe_flags": shlex.split(st.recipe),
          "buffer_size": st.buffer_size or n, "dylu_periods": ae.dylu_sync_periods(st.speeds, h),
          "inner_steps": total, "batch_size": batch, "runs": runs, "machine": kit.machine(),
          **timed.record()}


def finals(result: dict[str, Any]) -> dict[str, dict[int, float]]:
  names = dict.fromkeys(r["name"] for r in result["runs"])
  return {n: {r["seed"]: r["metric"][-1] for r in result["runs"] if r["name"] == n} for n in names}


def sync_at(result: dict[str, Any], seed: int, t: float) -> float:
  """Synchronous DiLoCo's metric of ``seed`` at simulated time ``t`` (its last round by then)."""
  (run,) = [r for r in result["runs"] if r["name"] == "sync diloco" and r["seed"] == seed]
  return run["metric"][int(np.searchsorted(run["time"], t, side="right")) - 1]


def summary(result: dict[str, Any]) -> str:
  """The table of final metrics and their gaps to synchronous DiLoCo (at equal inner steps and at
  the run's end time), with the targets."""
  by_name, sync, rows = finals(result), finals(result)["sync diloco"], []
  for name, values in by_name.items():
    v = np.asarray([values[s] for s in sorted(values)])
    gaps = np.asarray([values[s] / sync[s] - 1 for s in sorted(values)])
    runs = [r for r in result["runs"] if r["name"] == name]
    then = np.mean([sync_at(result, r["seed"], r["time"][-1]) for r in runs])
    rows.append([name, f"{v.mean():.4f} ± {v.std():.4f}",
                 "—" if name == "sync diloco" else f"{gaps.mean():+.2%} ± {gaps.std():.2%}",
                 f"{np.mean([r['time'][-1] for r in runs]):.0f}", f"{then:.4f}",
                 f"{np.mean([r['commits'] for r in runs]):.0f}",
                 f"{np.mean([r['mean_staleness'] for r in runs]):.2f}"])
  header = ["", "val bits/byte (mean ± sd)", "vs sync diloco (mean ± sd over seeds)",
            "simulated time", "sync diloco at that time", "outer steps", "mean staleness"]
  return kit.blocks(kit.table(header, rows, "lrrrrrr"), "Targets:", "\n".join(targets(result)))


def targets(result: dict[str, Any]) -> list[str]:
  sync, dylu, plain = (finals(result).get(k, {}) for k in (
    "sync diloco", "async + delayed nesterov + dylu", "async diloco"))
  seeds = sorted(set(sync) & set(dylu) & set(plain))
  if not seeds:
    return ["- not measured"]
  gap, plain_gap = (float(np.mean([x[s] / sync[s] - 1 for s in seeds])) for x in (dylu, plain))
  worse = [plain[s] > sync[s] for s in seeds]
  return [
    f"- delayed Nesterov + DyLU within {TOLERANCE:.0%} of synchronous DiLoCo at equal inner"
    f" steps: {gap:+.2%}: **{'met' if gap <= TOLERANCE else 'missed'}**.",
    f"- plain asynchronous DiLoCo measurably worse (above synchronous DiLoCo on every seed):"
    f" {plain_gap:+.2%}, above on {sum(worse)} of {len(seeds)} seeds:"
    f" **{'met' if all(worse) else 'missed'}**."]


def markdown(result: dict[str, Any], plot_name: str) -> str:
  return kit.blocks(
    "# Asynchronous DiLoCo on heterogeneous workers: delayed Nesterov and DyLU",
    kit.doc_markdown(__doc__, 1, 4),
    (f"Task `{result['task']}`; speeds {' : '.join(f'{v:g}' for v in result['speeds'])};"
     f" H = {result['sync_period']} (DyLU: H_w = {', '.join(map(str, result['dylu_periods']))});"
     f" R = {result['rounds']} rounds: {result['inner_steps']:,} inner steps per run; batch"
     f" {result['batch_size']} per worker"
     + (f" (recipe changed by `{' '.join(result['recipe_flags'])}`)" if result["recipe"] else "")
     + (f"; transformer width {result['model'][0]}, depth {result['model'][1]}"
        if result["model"] else "")
     + f"; outer {result['outer'][0]:g}, momentum {result['outer'][1]:g}; delayed Nesterov"
     f" N = {result['buffer_size']}, c = {result['activation']:g}; shards:"
     f" {SHARDS[result['shards']]}; seeds {', '.join(map(str, result['seeds']))}. Simulated"
     " time: one step of the fastest worker takes 1. Liu et al. (2024), Table 3 (20M params, 4"
     " workers, perplexity): DiLoCo 41.35, async DiLoCo 44.27, delayed Nesterov + DyLU 41.13. "
     + kit.load_text(result)), summary(result),
    f"![validation bits per byte against simulated time and inner steps]({plot_name})")


COLORS = dict(zip(("sync diloco", *PROTOCOLS), ("C0", "C3", "C1", "C2"), strict=True))


def plot(result: dict[str, Any], path: str) -> None:
  fig, axes = kit.plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  for r in result["runs"]:
    label = r["name"] if r["seed"] == result["seeds"][0] else None
    for ax, x in zip(axes, ("time", "steps"), strict=True):
      ax.plot(r[x], r["metric"], color=COLORS[r["name"]], alpha=0.8, label=label)
  # Runs that end above where they started (diverged) go off the top: the others are close.
  if kept := [r["metric"][-1] for r in result["runs"] if r["metric"][-1] < r["metric"][0]]:
    axes[0].set_ylim(min(kept) - 0.2, max(kept) + 1.0)
  axes[0].set_xlabel("simulated time (a step of the fastest worker = 1)")
  axes[1].set_xlabel("inner steps, all workers")
  axes[0].set_ylabel("validation bits per byte (anchor; diverged runs off the top)")
  axes[0].legend(fontsize=8)
  kit.save_figure(fig, path, f"{result['task']}, speeds {result['speeds']}, H ="
                             f" {result['sync_period']}, seeds {result['seeds']}; load"
                             f" {result['load_before']} → {result['load_after']}", grid=True)
