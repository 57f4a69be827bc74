"""DiLoCo against data parallel at equal tokens: the design of "Scaling Laws for DiLoCo".

Charles et al. (2025), Table 4, 35M params, H = 30: DiLoCo with M = 1 replica ends slightly
below data parallel's final evaluation loss, M = 2 at +0.7%, M = 4 at +2.0%, M = 8 at +3.9%.
Here the same comparison on the ``lm`` task of ``optax-dist`` (the byte-level transformer on the
Python standard library's sources) with the command's recipe for that task (AdamW 3e-3, b2 0.99,
weight decay 0.1, warm-up over 5% of the steps then cosine decay to 10%, gradients clipped to
norm 1), trained by :func:`optax_dist.cli.trainer.train` on emulated CPU devices.

Equal tokens: every run takes the same global batch, 64 windows of 64 bytes (4,096 tokens)
per step, for the same steps, and the same learning-rate schedule. Data parallel is
``--algorithm sync --devices 8 --batch-size 8`` (the gradients of 8 workers all-reduced every
step). DiLoCo with M replicas is ``--algorithm diloco --devices M --batch-size 64/M``: one device
per replica, each with 1/M of the global batch and its own 1/M of the training windows, the
outer Nesterov SGD (momentum 0.9) applied to the replicas' mean pseudo-gradient every H steps.
``--devices 8 --replicas M`` would keep 8 × 8 windows per step without changing the batch, but
it cannot express M = 1: ``--replicas 1`` runs DiLoCo across all 8 workers (M = 8). With one
device per replica, M = 1 is a real DiLoCo over a one-device axis (the outer optimizer steps on
the pseudo-gradient), and a replica's step is the one ``--replicas`` would take (the mean of equal
minibatches' mean gradients is the gradient of their union).

The grid, trimmed to fit about 90 minutes on 2 cores: the outer learning rate from {0.4, 0.6, 0.8,
1.0} swept at M = 2 and M = 8 on seed 0; M = 1 at 0.6 and M = 4 at 0.8 (the values Scaling Laws for
DiLoCo finds best for few replicas, 0.6 to 0.8, the larger with more replicas); every M, and data
parallel, on 3 seeds at its best (the swept M at the outer learning rate with the lowest seed-0
loss); H from {1, 5, 10, 30, 100} at M = 2 (seed 0); and M = 1, 2 and 8 with outer learning rate 0.7
and momentum 0.5 (seed 0), where the rest has the papers' momentum 0.9. Steps: the fewest multiple
of H = 30 with at least 20 tokens per parameter (the anchor then holds every inner step; at H = 100
the last sync is up to 99 steps before the end, and the workers' own params, which hold them, are
reported beside the anchor).

The metric is the final validation loss in bits per byte of :func:`optax_dist.eval_params` (the
anchor of DiLoCo, the global model the paper evaluates); a ratio of two losses is the same in
bits as in nats. The gap of M is the mean over seeds of its final loss over data parallel's of
the same seed, less 1. Targets: M = 1 at or below data parallel; the gap grows with M; M = 2
within 2% and M = 8 within 5% of data parallel.

Each run's result is kept in ``equal_tokens_runs/KEY.json`` beside the report: a stopped study
resumes where it stopped, and ``--report`` rewrites ``equal_tokens.md`` and ``equal_tokens.png``
from them; ``--plan`` prints the runs and the estimated time and trains nothing. ``make
bench-equal-tokens`` runs it (not part of ``make bench``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import statistics
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from benchmarks import kit
from optax_dist.cli import trainer
from optax_dist.cli.tasks import LM_CONTEXT, TASKS

GLOBAL_BATCH = 64
"""Windows per step, of every run: 8 workers × the ``lm`` task's batch of 8 (4,096 tokens)."""
EVAL_EVERY, OUTER_MOMENTUM, TOKENS_PER_PARAM, SWEEP_SEED = 100, 0.9, 20, 0
"""SWEEP_SEED: the outer-learning-rate and H sweeps' seed; the best setting is chosen on it."""
PAPER_GAP = {1: None, 2: 0.007, 4: 0.020, 8: 0.039}
"""Scaling Laws for DiLoCo, Table 4 (35M, H = 30): DiLoCo's final eval loss over data parallel's,
less 1 (``None``: slightly below 0, M = 1)."""
TOLERANCE = {2: 0.02, 8: 0.05}
"""The targets: the gap of M within this of data parallel."""
SECONDS_PER_STEP, SECONDS_PER_RUN = 0.14, 25.0
"""The estimate before any run is cached: a step, and a run's start-up and compilation."""


@dataclasses.dataclass(frozen=True)
class Grid:
  """The runs of a study; ``momentum_runs``, ``(M, outer lr, outer momentum)`` of the runs (seed
  :data:`SWEEP_SEED`, H = ``period``) not at :data:`OUTER_MOMENTUM`, are trained first."""

  replicas: tuple[int, ...]  # the M compared with data parallel, at H = period
  swept: tuple[int, ...]  # the M whose outer learning rate is swept over outer_lrs
  outer_lrs: tuple[float, ...]
  fixed_lr: Mapping[int, float]  # the outer learning rate of each M not swept
  period: int  # H of the comparison
  periods: tuple[int, ...]  # the H swept at M = period_replicas (one of swept)
  period_replicas: int = 2
  momentum_runs: tuple[tuple[int, float, float], ...] = ()


FULL = Grid(replicas=(1, 2, 4, 8), swept=(2, 8), outer_lrs=(0.4, 0.6, 0.8, 1.0),
            fixed_lr={1: 0.6, 4: 0.8}, period=30, periods=(1, 5, 10, 30, 100),
            momentum_runs=((1, 0.7, 0.5), (2, 0.7, 0.5), (8, 0.7, 0.5)))
"""The study; its momentum runs take the slow-link study's outer optimizer (the network study's
``OUTER``), the best with momentum there at 20 outer steps."""
QUICK_GRID = Grid(replicas=(1, 2), swept=(2,), outer_lrs=(0.6, 1.0), fixed_lr={1: 0.6},
                  period=10, periods=(5, 10))
"""``--quick``: 5 runs of 30 steps (``QUICK``'s) on one seed, to check the program only."""


@dataclasses.dataclass(frozen=True)
class Spec:
  """One run: data parallel (``replicas`` ``None``), or DiLoCo with M = ``replicas``."""

  replicas: int | None
  seed: int
  sync_period: int | None = None
  outer_lr: float | None = None
  outer_momentum: float = OUTER_MOMENTUM

  @property
  def label(self) -> str:
    return "data parallel" if self.replicas is None else (
      f"diloco M={self.replicas} H={self.sync_period} lr={self.outer_lr:g}"
      + self._momentum(" momentum="))

  def _momentum(self, prefix: str) -> str:
    """The outer momentum after ``prefix``, or nothing for :data:`OUTER_MOMENTUM`."""
    return "" if self.outer_momentum == OUTER_MOMENTUM else f"{prefix}{self.outer_momentum:g}"

  def key(self, steps: int) -> str:
    """The name of the run's cached result."""
    return f"dp_s{self.seed}_t{steps}" if self.replicas is None else (
      f"diloco_m{self.replicas}_h{self.sync_period}_lr{self.outer_lr:g}"
      f"{self._momentum('_mom')}_s{self.seed}_t{steps}")

  def settings(self, steps: int) -> Any:
    m = self.replicas or kit.DEVICES
    algorithm = {"algorithm": "sync"} if self.replicas is None else {
      "algorithm": "diloco", "sync_period": self.sync_period, "outer_learning_rate": self.outer_lr,
      "outer_momentum": self.outer_momentum}
    return kit.settings(steps=steps, eval_every=min(EVAL_EVERY, steps), seed=self.seed, devices=m,
                        batch_size=GLOBAL_BATCH // m, **algorithm)


def first_runs(grid: Grid, seeds: Sequence[int]) -> list[Spec]:
  """The runs that depend on no other: momentum runs, data parallel, sweeps, the M not swept."""
  runs = [Spec(m, SWEEP_SEED, grid.period, lr, mom) for m, lr, mom in grid.momentum_runs]
  runs += [Spec(None, s) for s in seeds]
  for m in grid.replicas:
    runs += ([Spec(m, SWEEP_SEED, grid.period, lr) for lr in grid.outer_lrs] if m in grid.swept
             else [Spec(m, s, grid.period, grid.fixed_lr[m]) for s in seeds])
  return runs


def second_runs(grid: Grid, seeds: Sequence[int], best: Mapping[int, float]) -> list[Spec]:
  """The runs at the swept M's best outer learning rates ``best``: the other seeds, and H."""
  runs = [Spec(m, s, grid.period, best[m]) for m in grid.swept for s in seeds if s != SWEEP_SEED]
  m = grid.period_replicas
  return runs + [Spec(m, SWEEP_SEED, h, best[m]) for h in grid.periods if h != grid.period]


def run_count(grid: Grid, seeds: Sequence[int]) -> int:
  """The number of runs of ``grid`` on ``seeds`` (whatever the best outer learning rates)."""
  any_lrs = {**grid.fixed_lr, **{m: grid.outer_lrs[0] for m in grid.swept}}
  return len(first_runs(grid, seeds)) + len(second_runs(grid, seeds, any_lrs))


def best_lrs(grid: Grid, records: Sequence[dict[str, Any]]) -> dict[int, float | None]:
  """Each M's outer learning rate: the swept M's with the lowest final loss at :data:`SWEEP_SEED`
  and H = ``grid.period`` among ``records`` (``None`` if none was run); the others' fixed one."""
  best = dict(grid.fixed_lr)
  for m in grid.swept:
    sweep = [r for r in records if r["replicas"] == m and r["sync_period"] == grid.period
             and r["seed"] == SWEEP_SEED and r["outer_momentum"] == OUTER_MOMENTUM]
    best[m] = min(sweep, key=lambda r: r["final"])["outer_lr"] if sweep else None
  return best


def record(spec: Spec, load_before: str, result: dict[str, Any]) -> dict[str, Any]:
  """What the cache keeps of one run's ``result`` (the trainer's)."""
  history = result["history"]
  return {
    "label": spec.label, **dataclasses.asdict(spec), "steps": result["steps"],
    "devices": result["devices"], "batch_size": result["batch_size"],
    "final": result["test_bits_per_byte_eval_params"],
    "final_workers": result["test_bits_per_byte_workers"],
    "communication_rounds": result["communication_rounds"],
    "curve": {"step": history["step"], "bits_per_byte": history["test_bits_per_byte_eval_params"]},
    "wall_s": result["wall_time_s"], "train_s": sum(result["step_times"]),
    "step_s": statistics.median(result["step_times"]),
    "load_before": load_before, "load_after": kit.load_average(), "date": kit.now()}


def load_records(runs_dir: str) -> dict[str, dict[str, Any]]:
  """The cached results under ``runs_dir``, by key (files that do not parse are left out)."""
  out = {}
  for path in sorted(glob.glob(os.path.join(runs_dir, "*.json"))):
    with contextlib.suppress(OSError, ValueError):
      out[os.path.basename(path).removesuffix(".json")] = kit.read_json(path)
  return out


def plan_text(grid: Grid, seeds: Sequence[int], steps: int,
              records: Mapping[str, dict[str, Any]]) -> str:
  """The planned runs, how many are cached, and the estimated time of the others: the cached
  runs' median step and start-up (compilation, evaluations), or :data:`SECONDS_PER_STEP` and
  :data:`SECONDS_PER_RUN` before any is cached."""
  first = first_runs(grid, seeds)
  cached = [s for s in first if s.key(steps) in records]
  if len(cached) == len(first):  # the best outer learning rates are known
    second = second_runs(grid, seeds, best_lrs(grid, [records[s.key(steps)] for s in cached]))
    cached += [s for s in second if s.key(steps) in records]
  total, done = run_count(grid, seeds), records.values()
  step = statistics.median(r["step_s"] for r in done) if done else SECONDS_PER_STEP
  start = statistics.median(r["wall_s"] - r["train_s"] for r in done) if done else SECONDS_PER_RUN
  todo = total - len(cached)
  return (f"[equal-tokens] {total} runs planned ({len(first)} first, {total - len(first)} at the"
          f" swept M's best outer learning rate), {len(cached)} cached, {todo} to train: about"
          f" {todo * (start + steps * step) / 60:.0f} min at {steps} steps each")


def gaps(records: Sequence[dict[str, Any]], dp: Sequence[dict[str, Any]]) -> list[float]:
  """Each seed's final loss over data parallel's of the same seed, less 1 (seeds of both)."""
  base = {r["seed"]: r["final"] for r in dp}
  return [r["final"] / base[r["seed"]] - 1 for r in sorted(records, key=lambda r: r["seed"])
          if r["seed"] in base]


def _stats(xs: Sequence[float]) -> tuple[float, float] | None:
  """Mean and (population) standard deviation of ``xs`` (``None`` if empty)."""
  return (statistics.fmean(xs), statistics.pstdev(xs)) if xs else None


def summary(grid: Grid, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """The comparison of the cached ``records``: data parallel, each M at its best outer learning
  rate and H = ``grid.period``, the sweeps, and the targets."""
  dp, best = [r for r in records if r["replicas"] is None], best_lrs(grid, records)

  def runs(m: int, lr: float, h: int, momentum: float = OUTER_MOMENTUM) -> list[dict[str, Any]]:
    return [r for r in records if r["replicas"] == m and r["outer_lr"] == lr
            and r["sync_period"] == h and r["outer_momentum"] == momentum]

  rows = [{"replicas": m, "outer_lr": best[m], "swept": m in grid.swept,
           "seeds": sorted(r["seed"] for r in mine), "loss": _stats([r["final"] for r in mine]),
           "gap": _stats(gaps(mine, dp)), "paper": PAPER_GAP.get(m)}
          for m in grid.replicas for mine in [runs(m, best[m], grid.period)]]
  sweep = {m: {lr: _one(runs(m, lr, grid.period), dp) for lr in grid.outer_lrs} for m in grid.swept}
  m = grid.period_replicas
  periods = {h: _one(runs(m, best[m], h), dp) for h in grid.periods}
  momenta = [{"replicas": m, "outer_lr": lr, "outer_momentum": momentum,
              "run": _one(runs(m, lr, grid.period, momentum), dp),
              "default": _one(runs(m, best[m], grid.period), dp), "default_lr": best[m]}
             for m, lr, momentum in grid.momentum_runs]
  return {"dp": {"seeds": sorted(r["seed"] for r in dp), "loss": _stats([r["final"] for r in dp])},
          "rows": rows, "sweep": sweep, "periods": periods, "momenta": momenta,
          "targets": targets(rows)}


def _one(runs: Sequence[dict[str, Any]], dp: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
  """The :data:`SWEEP_SEED` run of ``runs``: final loss, gap, rounds, workers' loss; or ``None``."""
  if (run := next((r for r in runs if r["seed"] == SWEEP_SEED), None)) is None:
    return None
  return {"loss": run["final"], "gap": next(iter(gaps([run], dp)), None),
          "rounds": run["communication_rounds"], "workers": run["final_workers"]}


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Each target with ``met`` (``None``: not measured) and its numbers, from the rows' mean gaps."""
  gap = {r["replicas"]: r["gap"][0] for r in rows if r["gap"] is not None}
  ordered = sorted(gap.items())
  return [{"text": "M = 1 at or below data parallel", "met": gap[1] <= 0 if 1 in gap else None,
           "gaps": {1: gap.get(1)}},
          {"text": "the gap grows with M", "gaps": dict(ordered), "met": all(
            a < b for (_, a), (_, b) in zip(ordered, ordered[1:])) if len(ordered) > 1 else None},
          *({"text": f"M = {m} within {tolerance:.0%} of data parallel",
             "met": gap[m] <= tolerance if m in gap else None, "gaps": {m: gap.get(m)}}
            for m, tolerance in TOLERANCE.items())]


def _mean_sd(stats: tuple[float, float] | None, spec: str = ".4f") -> str:
  return "not run" if stats is None else f"{stats[0]:{spec}} ± {stats[1]:{spec.lstrip('+')}}"


def comparison_table(s: dict[str, Any]) -> str:
  dp = s["dp"]
  table = [["data parallel", "—", ", ".join(map(str, dp["seeds"])), _mean_sd(dp["loss"]), "—", "—"]]
  table += [[f"DiLoCo M = {r['replicas']}",
             kit.fmt(r["outer_lr"], "g") + (" (swept)" if r["swept"] else ""),
             ", ".join(map(str, r["seeds"])) or "—", _mean_sd(r["loss"]),
             _mean_sd(r["gap"], "+.2%"),
             "slightly below 0" if r["replicas"] == 1 else kit.fmt(r["paper"], "+.1%")]
            for r in s["rows"]]
  return kit.table(["", "outer lr", "seeds", "val bits/byte (mean ± sd)",
                    "vs data parallel (mean ± sd over seeds)", "paper, Table 4 (35M)"], table,
                   "llrrrr")


def target_lines(s: dict[str, Any]) -> list[str]:
  verdict = {None: "not measured", True: "met", False: "MISSED"}
  return [f"- {verdict[t['met']]}: {t['text']} ("
          + ", ".join(f"M = {m}: {kit.fmt(g, '+.1%')}" for m, g in t["gaps"].items()) + ")."
          for t in s["targets"]]


def _cell(p: dict[str, Any] | None) -> str:
  return "not run" if p is None else f"{p['loss']:.4f} ({kit.fmt(p['gap'], '+.1%')})"


def sweep_table(s: dict[str, Any]) -> str:
  sweep = s["sweep"]
  rows = [[f"{lr:g}", *(_cell(sweep[m][lr]) for m in sweep)] for lr in next(iter(sweep.values()))]
  return kit.table(["outer lr"] + [f"M = {m}" for m in sweep], rows)


def momentum_table(s: dict[str, Any]) -> str:
  rows = [[f"M = {r['replicas']}", f"{r['outer_lr']:g}, {r['outer_momentum']:g}", _cell(r["run"]),
           f"{kit.fmt(r['default_lr'], 'g')}, {OUTER_MOMENTUM:g}", _cell(r["default"])]
          for r in s["momenta"]]
  return kit.table(["", "outer lr, momentum", "val bits/byte (vs data parallel)",
                      "best lr, momentum", "val bits/byte (vs data parallel)"], rows, "llrlr")


def periods_table(s: dict[str, Any]) -> str:
  rows = [[str(h), "not run", "", "", ""] if p is None else
          [str(h), str(p["rounds"]), f"{p['loss']:.4f}", kit.fmt(p["gap"], "+.1%"),
           f"{p['workers']:.4f}"] for h, p in s["periods"].items()]
  return kit.table(["H", "outer steps", "val bits/byte (anchor)", "vs data parallel",
                      "workers' params"], rows)


def document(grid: Grid, records: Sequence[dict[str, Any]], meta: dict[str, Any],
             plot_name: str) -> str:
  s, m, best = summary(grid, records), grid.period_replicas, best_lrs(grid, records)
  return kit.blocks(
    "# DiLoCo against data parallel at equal tokens", kit.doc_markdown(__doc__, 1, 4),
    setup_text(grid, meta), f"## Final validation loss, H = {grid.period}", comparison_table(s),
    "Targets:", "\n".join(target_lines(s)),
    f"## Outer learning rate (seed {SWEEP_SEED}, H = {grid.period})", sweep_table(s),
    f"## Sync period H at M = {m} (outer lr {kit.fmt(best[m], 'g')}, seed {SWEEP_SEED})",
    periods_table(s), *([f"## Outer momentum (seed {SWEEP_SEED}, H = {grid.period})",
       (f"The papers' outer Nesterov momentum {OUTER_MOMENTUM:g} averages over about"
        f" {1 / (1 - OUTER_MOMENTUM):.0f} outer steps; these runs have"
        f" {meta['steps'] // grid.period}. Beside each M's best run above, the same M with"
        " another outer learning rate and momentum:"), momentum_table(s)]
      if grid.momentum_runs else []), "## Runs", runs_table(records),
    f"![final validation loss against M and against H]({plot_name})")


def setup_text(grid: Grid, meta: dict[str, Any]) -> str:
  """Params, tokens per step and per parameter, epochs, seeds, the machine and its load."""
  tokens = meta["steps"] * GLOBAL_BATCH * meta["context"]
  loads = "; ".join(f"{i['date']}: load average {i['load_start']} at the start,"
                    f" {i['load_end']} at the end, runs trained: {i['runs_trained']} in"
                    f" {i['wall_s'] / 60:.1f} min" for i in meta["invocations"])
  quick = " **`--quick`: a tiny grid that checks the program, not a measurement.**"
  return (f"{meta['num_params']:,} params; {GLOBAL_BATCH} × {meta['context']} ="
          f" {GLOBAL_BATCH * meta['context']:,} tokens per step for {meta['steps']:,} steps:"
          f" {tokens / 1e6:.2f}M tokens, {tokens / meta['num_params']:.1f} per parameter,"
          f" {tokens / meta['train_tokens']:.2f} epochs of the {meta['train_tokens'] / 1e6:.2f}M"
          f" training tokens. Seeds {', '.join(map(str, meta['seeds']))}."
          f" {meta['machine']['cores']} CPUs ({meta['machine']['cpu']}). {loads}."
          + (quick if grid is QUICK_GRID else ""))


def runs_table(records: Sequence[dict[str, Any]]) -> str:
  ordered = sorted(records, key=lambda r: (r["replicas"] or 0, r["sync_period"] or 0,
                                           r["outer_lr"] or 0, -r["outer_momentum"], r["seed"]))
  rows = [[r["label"], str(r["seed"]), f"{r['devices']} × {r['batch_size']}", f"{r['final']:.4f}",
           f"{r['wall_s']:.0f}", f"{r['step_s']:.3f}", kit.loads(r["load_before"], r["load_after"])]
          for r in ordered]
  return kit.table(["run", "seed", "devices × batch", "val bits/byte", "wall s",
                      "s / step (median)", "load (1 min)"], rows, "lrrrrrr")


def figure(grid: Grid, records: Sequence[dict[str, Any]], meta: dict[str, Any], path: str) -> None:
  """Final validation loss against M (beside Table 4's gaps over data parallel) and against H."""
  s = summary(grid, records)
  fig, (by_m, by_h) = kit.plt.subplots(1, 2, figsize=(11, 4.2))
  for ax in (by_m, by_h):
    if s["dp"]["loss"] is not None:
      mean, sd = s["dp"]["loss"]
      ax.axhline(mean, color="k", lw=1, label="data parallel")
      ax.axhspan(mean - sd, mean + sd, color="k", alpha=0.1)
    ax.set_xscale("log", base=2)
    ax.set_ylabel("final validation bits per byte")
  rows = [r for r in s["rows"] if r["loss"] is not None]
  by_m.errorbar([r["replicas"] for r in rows], [r["loss"][0] for r in rows],
                [r["loss"][1] for r in rows], marker="o", capsize=3, label="DiLoCo (mean ± sd)")
  if s["dp"]["loss"] is not None:
    paper = [(m, g) for m, g in PAPER_GAP.items() if g is not None and m in grid.replicas]
    by_m.plot([m for m, _ in paper], [s["dp"]["loss"][0] * (1 + g) for _, g in paper], "s",
              mfc="none", color="C3", label="Table 4's gap over data parallel")
  by_m.set_xticks(grid.replicas, [str(m) for m in grid.replicas])
  by_m.set_xlabel(f"replicas M (H = {grid.period})")
  points = [(h, p["loss"]) for h, p in s["periods"].items() if p is not None]
  by_h.plot([h for h, _ in points], [v for _, v in points], "o-", color="C1",
            label=f"DiLoCo M = {grid.period_replicas}")
  by_h.set(xscale="log", xlabel=f"sync period H (M = {grid.period_replicas}, seed {SWEEP_SEED})")
  by_h.set_xticks(grid.periods, [str(h) for h in grid.periods])
  for ax in (by_m, by_h):
    ax.minorticks_off()
    ax.legend(fontsize=8)
  loads = ", ".join(kit.loads(i["load_start"], i["load_end"]) for i in meta["invocations"])
  kit.save_figure(fig, path, f"lm task at equal tokens ({meta['steps']} steps of {GLOBAL_BATCH}"
                             f" windows): DiLoCo against data parallel; load average"
                             f" {loads or 'not recorded'}", grid=True)


def train_all(grid: Grid, seeds: Sequence[int], steps: int, runs_dir: str) -> int:
  """Trains and caches every planned run not cached under ``runs_dir``; the number trained."""
  os.makedirs(runs_dir, exist_ok=True)
  task, trained = TASKS["lm"], 0
  data = task.load(0)
  records = {k: r for k, r in load_records(runs_dir).items() if r["steps"] == steps}

  def planned() -> Iterator[Spec]:  # lazily: the second runs need the first ones' records
    yield from first_runs(grid, seeds)
    yield from second_runs(grid, seeds, best_lrs(grid, list(records.values())))

  with tqdm(total=run_count(grid, seeds), unit="run", desc="equal tokens") as bar:

    def on_step(step: int) -> None:
      if step % 100 == 0:
        bar.set_postfix_str(f"step {step}/{steps}")

    for spec in planned():
      if (key := spec.key(steps)) not in records:
        bar.set_description(f"{spec.label} seed {spec.seed}")
        records[key] = record(spec, kit.load_average(), trainer.train(
          task, data, spec.settings(steps), on_step=on_step))
        kit.write_json(os.path.join(runs_dir, key + ".json"), records[key])
        trained += 1
      bar.update(1)
  return trained


@dataclasses.dataclass(frozen=True)
class Config:
  grid: str = kit.option("full", "the runs: full, or quick (5 runs: checks the program only)",
                         choices=("full", "quick"))
  steps: int | None = kit.option(None, "steps of every run (default: the fewest multiple of H"
                                 f" with {TOKENS_PER_PARAM} tokens per parameter)")
  seeds: int = kit.option(3, "seeds 0..N-1 of data parallel and of each M's best")
  plan: bool = kit.option(False, "print the planned runs and the estimated time; train nothing")


QUICK = {"grid": "quick", "steps": 30, "seeds": 1}


def measure(config: Config, prefix: str) -> dict[str, Any] | None:
  """Trains every planned run not cached beside ``prefix`` (``equal_tokens_runs/``); by default
  the fewest steps with at least :data:`TOKENS_PER_PARAM` tokens per parameter that are a
  multiple of H (DiLoCo's anchor, which is evaluated, then holds every inner step)."""
  grid, seeds = (FULL if config.grid == "full" else QUICK_GRID), list(range(config.seeds))
  runs_dir, task = os.path.join(os.path.dirname(prefix), "equal_tokens_runs"), TASKS["lm"]
  train = task.load(0).train
  meta = {"invocations": [], "num_params": kit.num_params(kit.initial_params(task, train)),
          "train_tokens": int(train["y"].size), "context": LM_CONTEXT, "seeds": seeds,
          "machine": kit.machine()}
  with contextlib.suppress(OSError, ValueError, KeyError):  # the earlier invocations
    meta["invocations"] = kit.read_json(f"{prefix}.json")["meta"]["invocations"]
  per_step = GLOBAL_BATCH * LM_CONTEXT
  meta["steps"] = steps = config.steps or grid.period * -(
    -TOKENS_PER_PARAM * meta["num_params"] // (per_step * grid.period))
  print(f"[equal-tokens] {meta['num_params']:,} params, {per_step:,} tokens per step: {steps}"
        f" steps are {steps * per_step / meta['num_params']:.1f} tokens per parameter"
        f" (target ≥ {TOKENS_PER_PARAM})", flush=True)
  print(plan_text(grid, seeds, steps, load_records(runs_dir)), flush=True)
  if config.plan:
    return None
  with kit.Timed() as timed:
    trained = train_all(grid, seeds, steps, runs_dir)
  meta["invocations"].append({"date": kit.now(), "load_start": timed.load_before,
                              "load_end": timed.load_after, "runs_trained": trained,
                              "wall_s": timed.seconds})
  return result_of(grid, meta, runs_dir)


def load(prefix: str, config: Config) -> dict[str, Any]:
  """The saved result of ``prefix``, with the cached runs of its steps and seeds again."""
  saved = kit.read_json(f"{prefix}.json")
  runs_dir = os.path.join(os.path.dirname(prefix), "equal_tokens_runs")
  return result_of(_grid(saved), saved["meta"], runs_dir) | {
    k: saved[k] for k in ("run", "versions") if k in saved}


def result_of(grid: Grid, meta: dict[str, Any], runs_dir: str) -> dict[str, Any]:
  records = [r for r in load_records(runs_dir).values()
             if r["steps"] == meta["steps"] and r["seed"] in meta["seeds"]]
  s = summary(grid, records)
  print("\n".join(target_lines(s)))
  return {"meta": meta, "grid": dataclasses.asdict(grid), "versions": kit.versions(),
          "summary": s, "records": records}


def _grid(result: dict[str, Any]) -> Grid:
  return FULL if result["grid"]["period"] == FULL.period else QUICK_GRID


def markdown(result: dict[str, Any], figure_name: str) -> str:
  return document(_grid(result), result["records"], result["meta"], figure_name)


def plot(result: dict[str, Any], path: str) -> None:
  figure(_grid(result), result["records"], result["meta"], path)
