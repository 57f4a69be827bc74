"""Validation bits per byte against steps and against bytes communicated, 8 workers, the LM.

Every row of :data:`RUNS` trains the ``lm`` task with :func:`optax_dist.cli.trainer.train` over 8
emulated CPU devices for the same steps and seeds; ``diloco`` at H ≥ 50 is run again with model
averaging (:data:`EXTRA_OUTER`) where it misses the target. The bytes are the trainer's
``collective_bytes`` summed by :func:`benchmarks.kit.run_bytes`; the report says the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from benchmarks import kit
from optax_dist.cli import trainer
from optax_dist.cli.tasks import TASKS

EVAL_EVERY, TOLERANCE = 50, 0.02
"""The targets: within 2% of ``sync``'s final validation bits per byte."""

RUNS = (  # label, settings beyond the task's defaults
  ("sync", {"algorithm": "sync"}),
  ("elastic_average τ=10", {"algorithm": "elastic_average", "communication_period": 10}),
  ("agn τ=10", {"algorithm": "agn", "communication_period": 10}),
  ("local_sgd H=10", {"algorithm": "local_sgd", "sync_period": 10}),
  *((f"diloco H={h}", {"algorithm": "diloco", "sync_period": h}) for h in (10, 50, 100)),
  ("streaming_diloco H=50 F=4", {"algorithm": "streaming_diloco", "sync_period": 50,
                                 "num_fragments": 4}))
EXTRA_OUTER = {"outer_learning_rate": 1.0, "outer_momentum": 0.0}
"""The extra row's outer optimizer: plain SGD at 1.0, i.e. the workers' params averaged."""


@dataclasses.dataclass(frozen=True)
class Config:
  seeds: int = kit.option(3, "seeds 0..N-1 of every run")
  steps: int = kit.option(600, "training steps of every run")


QUICK = {"seeds": 1, "steps": 60}


def measure(config: Config, prefix: str) -> dict[str, Any]:
  task, seeds = TASKS["lm"], range(config.seeds)
  data, bytes_of, rows = {seed: task.load(seed) for seed in seeds}, {}, []

  def run(label: str, overrides: dict[str, Any], extra: bool = False) -> None:
    results = []
    for seed in seeds:
      s = kit.settings(devices=kit.DEVICES, steps=config.steps, eval_every=EVAL_EVERY, seed=seed,
                       **overrides).resolved()
      results.append(trainer.train(task, data[seed], s))
      print(f"[lm_quality] {label} seed {seed}: {results[-1]['test_bits_per_byte_eval_params']:.4f}"
            f" bits/byte, {results[-1]['wall_time_s']:.0f} s", flush=True)
    bytes_of.setdefault(overrides["algorithm"], exchange_bytes(results[0]))
    rows.append(_summarise(label, overrides, results, kit.run_bytes(results[0], s), extra))

  with kit.Timed() as timed:
    for label, overrides in RUNS:
      run(label, overrides)
    sync_final = rows[0]["final"]
    for (label, overrides), row in zip(RUNS, list(rows)):  # Nesterov missed: averaging too
      if (overrides["algorithm"] == "diloco" and overrides["sync_period"] >= 50
          and row["final"] > sync_final * (1 + TOLERANCE)):
        run(f"{label}, outer SGD 1.0, momentum 0 (extra)", {**overrides, **EXTRA_OUTER}, extra=True)
  for r in rows:  # the first evaluated step (and its bytes) where the mean curve reaches sync + 2%
    reached = [i for i, v in enumerate(r["curve"]) if v <= sync_final * (1 + TOLERANCE)]
    r["to_target_step"] = r["step"][reached[0]] if reached else None
    r["to_target_bytes"] = r["bytes"][reached[0]] if reached else None
  return {"seeds": list(seeds), "steps": config.steps, "eval_every": EVAL_EVERY, "rows": rows,
          "bytes": bytes_of, "dataset": task.dataset, "model": task.model_name,
          "defaults": dict(task.defaults), **timed.record()}


def exchange_bytes(result: dict[str, Any]) -> dict[str, Any]:
  """The bytes each worker sends on every step and in each exchange (``collective_bytes``)."""
  steps, params_bytes = result["collective_bytes"], result["bytes_per_device"]["params"]
  quiet = steps.get("every_step") or steps["non_communication_step"]
  loud = steps.get("every_step") or steps["communication_step"]
  exchanges = [sum(c.values()) for c in loud["conditional"]]
  return {"params_bytes": params_bytes, "num_params": params_bytes // 4,
          "every_step": sum(quiet["unconditional"].values()),
          "every_step_text": ", ".join(f"{k}: {v:,} B" for k, v in quiet["unconditional"].items()),
          "exchanges": exchanges, "per_round": float(np.mean(exchanges)) if exchanges else 0.0}


def _summarise(label: str, overrides: dict[str, Any], results: list[dict[str, Any]],
               cumulative: list[float], extra: bool) -> dict[str, Any]:
  """Seed-averaged curves and finals of one row, with its bytes after every evaluated step."""
  h = results[0]["history"]
  curves = np.array([r["history"]["test_bits_per_byte_eval_params"] for r in results])
  workers = np.array([r["history"]["test_bits_per_byte_workers"] for r in results])
  steps, rounds = np.array(h["step"]), np.array(h["communication_rounds"])
  sent = np.array([0.0 if t == 0 else cumulative[t - 1] for t in steps])
  finals = curves[:, -1].tolist()
  return {
    "label": label, "settings": overrides, "step": steps.tolist(), "rounds": rounds.tolist(),
    "bytes": sent.tolist(), "curve": curves.mean(0).tolist(), "curve_sd": curves.std(0).tolist(),
    "workers_curve": workers.mean(0).tolist(), "finals": finals,
    "final": float(np.mean(finals)), "final_sd": float(np.std(finals)),
    "final_workers": float(workers[:, -1].mean()),
    "communication_rounds": int(rounds[-1]), "total_bytes": float(sent[-1]),
    "wall_s": float(np.mean([r["wall_time_s"] for r in results])), "extra": extra}


def sync_to(row: dict[str, Any], sync: dict[str, Any]) -> tuple[float, float] | None:
  """``(step, bytes)`` where sync's mean curve reaches ``row``'s final loss (:func:`kit.reach`)."""
  return kit.reach(sync["curve"], row["final"], sync["step"], sync["bytes"])


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
  """DiLoCo at H ≥ 50 and EASGD at τ = 10: each within 2% of sync's final validation loss."""
  rows = {r["label"]: r for r in result["rows"]}
  sync = rows["sync"]
  return [{"label": label, "gap": gap, "met": gap <= TOLERANCE, "per_seed": [
    a / b - 1 for a, b in zip(rows[label]["finals"], sync["finals"])]}
          for label in ("diloco H=50", "diloco H=100", "elastic_average τ=10")
          for gap in [rows[label]["final"] / sync["final"] - 1]]


def headline_table(result: dict[str, Any]) -> str:
  rows = result["rows"]
  sync, threshold = rows[0], rows[0]["final"] * (1 + TOLERANCE)
  header = ["algorithm", "val bits/byte (eval_params) ± sd", "vs sync", "workers' bits/byte",
            "comm. rounds", "sent per worker", "vs sync bytes",
            f"steps to ≤ {threshold:.3f} (sync + 2%)", "bytes to it",
            "sync reaches this loss at step", "sync's bytes to it / these", "wall s / run"]
  return kit.table(header, [[
    f"{r['label']}", f"{r['final']:.4f} ± {r['final_sd']:.4f}",
    f"{100 * (r['final'] / sync['final'] - 1):+.1f}%", f"{r['final_workers']:.4f}",
    str(r["communication_rounds"]), kit.human_bytes(r["total_bytes"]),
    f"{r['total_bytes'] / sync['total_bytes']:.3f}",
    "not reached" if r["to_target_step"] is None else str(r["to_target_step"]),
    "—" if r["to_target_bytes"] is None else kit.human_bytes(r["to_target_bytes"]),
    "—" if match is None else f"{match[0]:.0f}",
    "—" if match is None or r is sync else f"{match[1] / r['total_bytes']:.1f}×",
    f"{r['wall_s']:.0f}"] for r in rows for match in [sync_to(r, sync)]])


def markdown(result: dict[str, Any], plot_name: str) -> str:
  b, d = result["bytes"], result["defaults"]
  comm_rows = [[family, f"{c['every_step']:,}", c["every_step_text"],
                ", ".join(f"{x:,}" for x in c["exchanges"]) or "—",
                f"{c['per_round'] / c['params_bytes']:.3f}"] for family, c in b.items()]
  any_bytes = next(iter(b.values()))
  verdicts = [
    f"- {t['label']} within {100 * TOLERANCE:g}% of sync: **{'met' if t['met'] else 'missed'}**"
    f" ({100 * t['gap']:+.1f}%; per seed {', '.join(f'{100 * g:+.1f}%' for g in t['per_seed'])})."
    for t in targets(result)]
  extras = [r for r in result["rows"] if r["extra"]]
  extra_note = (
    "Extra rows (outer SGD 1.0 without momentum: the anchor moves to the workers' mean, model"
    " averaging) were run because the paper's outer optimizer missed the target at that H:"
    " " + "; ".join(f"{r['label']}: {r['final']:.4f}" for r in extras) + "." if extras else
    "No extra row: the paper's outer optimizer (Nesterov 0.7, momentum 0.9) met the target at"
    " every H ≥ 50, so model averaging (outer SGD 1.0, no momentum) was not run.")
  return kit.blocks(
    "## Language model: quality against communication",
    (f"`optax_dist.cli.trainer.train` on the `lm` task ({result['model']}; {result['dataset']})"
     f" over {kit.DEVICES} workers, one emulated CPU device each, each with its own 1/{kit.DEVICES}"
     f" of the training windows, minibatch {d['batch_size']} windows of 64 bytes per worker, adam"
     f" {d['learning_rate']:g}; `elastic_average` moving rate 0.9/8, `diloco` and"
     " `streaming_diloco` with the paper's outer Nesterov SGD (0.7, momentum 0.9), the streaming"
     " fragments balanced by size. Validation bits per byte of `optax_dist.eval_params` (center,"
     " anchor or params) and of the workers' own params (their mean); *sent per worker*: bytes"
     " each worker sends in the run, from the compiled step (table below); *steps to sync + 2%*:"
     " the first evaluated step where the seed-mean curve is within 2% of sync's final loss."),
    (f"{result['steps']} steps per run, evaluated every {result['eval_every']} steps; mean over"
    f" seeds {', '.join(map(str, result['seeds']))}. " + kit.load_text(result, cpu=False)),
    headline_table(result), "\n".join(verdicts), *_why(result), extra_note,
    (f"Bytes each worker sends ({any_bytes['num_params']:,} params, {any_bytes['params_bytes']:,} B"
     " in float32), from `communication_report` of each algorithm's compiled 8-device step: *every"
     " step* are the collectives outside any conditional, *per exchange* those of each"
     " conditional's communicating branch (per fragment for streaming_diloco), in params' bytes:"),
    kit.table(["algorithm", "every step B", "every step", "per exchange B", "exchange / params"],
              comm_rows, "lrlrr"),
    f"![validation bits per byte against steps and bytes sent]({plot_name})")


def _why(result: dict[str, Any]) -> list[str]:
  """A paragraph on why the targets were missed, from the measured curves (none if met)."""
  if all(t["met"] for t in targets(result)):
    return []
  rows = {r["label"]: r for r in result["rows"]}
  sync = rows["sync"]
  i = next(k for k, st in enumerate(sync["step"]) if st >= sync["step"][-1] - 100)
  drop = sync["curve"][i] - sync["curve"][-1]
  matches = [(r, m) for r in result["rows"] if r is not sync and (m := sync_to(r, sync))]
  steps, ratios = [m[0] for _, m in matches], [m[1] / r["total_bytes"] for r, m in matches]
  pairs = [(f"diloco H={h}", f"diloco H={h}, outer SGD 1.0, momentum 0 (extra)") for h in (50, 100)]
  compare = "; ".join(f"H={a.split('=')[1]}: {rows[a]['final']:.3f} with Nesterov,"
                      f" {rows[b]['final']:.3f} averaging" for a, b in pairs if b in rows)
  text = (
    "Why the targets are missed at this scale: with equal steps, each sync step averages the"
    f" gradients of {kit.DEVICES} workers (an effective minibatch {kit.DEVICES}× larger), while"
    f" each local step of the others uses one worker's minibatch; after {result['steps']} steps the"
    f" model is still improving (sync's loss fell {drop:.2f} bits per byte over its last 100"
    " steps), and in this early phase the larger batch is, apparently, worth more than what"
    " periodic averaging recovers. Every other algorithm ends where sync was at step"
    f" {min(steps):.0f}–{max(steps):.0f}, after sending {min(ratios):.0f}–{max(ratios):.0f}× fewer"
    " bytes than sync needed to get there (the last two columns).")
  if compare:
    text += (" The paper's outer Nesterov (0.7, momentum 0.9) does worse here than plain"
             f" averaging ({compare}): with only {result['steps'] // 100}–"
             f"{result['steps'] // 50} outer steps, plausibly because its momentum has little"
             " to accumulate while it amplifies each noisy pseudo-gradient. The paper's regime"
             " (H = 500 inner steps over thousands of outer steps, larger models) is far from"
             " this one; more steps would be needed to test the targets there.")
  return [text]


def plot(result: dict[str, Any], path: str) -> None:
  rows = result["rows"]
  fig, (by_step, by_bytes) = kit.plt.subplots(1, 2, figsize=(13, 5))
  for r in rows:
    style, mean, sd = "--" if r["extra"] else "-", np.array(r["curve"]), np.array(r["curve_sd"])
    by_step.plot(r["step"], mean, style, label=r["label"])
    by_step.fill_between(r["step"], mean - sd, mean + sd, alpha=0.15)
    sent = np.array(r["bytes"]) / 2**20
    by_bytes.plot(sent[sent > 0], mean[sent > 0], style, marker=".", label=r["label"])
  finals = [r["final"] for r in rows]
  for ax in (by_step, by_bytes):
    ax.axhline(rows[0]["final"] * (1 + TOLERANCE), color="grey", lw=0.8, ls=":")
    ax.set_ylim(min(finals) - 0.1, max(finals) + 0.8)
    ax.set_ylabel("validation bits per byte (eval_params)")
  by_step.set_xlabel("step")
  by_bytes.set(xlabel="MiB sent per worker (log; from the first exchange on)", xscale="log")
  by_step.legend(fontsize=7, loc="upper right")
  kit.save_figure(fig, path, f"LM, {kit.DEVICES} workers, mean ± sd over seeds"
                             f" {', '.join(map(str, result['seeds']))} (dotted: sync's final"
                             f" + 2%). {kit.machine()['cores']} CPUs; load average"
                             f" {result['load_before']} before, {result['load_after']} after",
                  grid=True)
