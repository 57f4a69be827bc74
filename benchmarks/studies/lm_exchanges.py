"""Validation bits per byte against the bytes each worker sends, by exchange format, on the LM.

Every run trains the ``lm`` task of ``optax-dist`` (the byte-level transformer, 2 layers, width
96, context 64, on the Python standard library's sources) with
:func:`optax_dist.cli.trainer.train` over 8 emulated CPU devices, one worker each, with the
command's default recipe for the task (AdamW, warm-up then cosine, clipping, batch 8 per worker):
the settings are those of ``optax-dist train --task lm`` with the run's flags, parsed by the
command itself. The runs, all at sync period H = 30 and seed 0:

* ``diloco`` with ``--comm-dtype`` float32, bfloat16, float8_e4m3fn, int8, float4_e2m1fn and
  e3m0, the block-quantized three (blocks of 256 values, one float32 scale each) also with
  ``--error-feedback``;
* ``streaming_diloco`` with F = 4 fragments and the same six formats, the block-quantized three
  also with ``--error-feedback``;
* ``streaming_diloco`` (float32, F = 4) with ``--overlap`` τ = 1 and 5, each with and without
  ``--eager`` (τ = 0 is the float32 run above; eager needs τ ≥ 1).

The metric is the final validation loss in bits per byte of :func:`optax_dist.eval_params` (the
anchor). The bytes are those each worker sends into the collectives of the compiled steps (the
trainer's ``collective_bytes``: the step that exchanges and the one that does not, the trainer's
4-byte loss mean included), summed over the steps of the run by the algorithm's schedule; a
``streaming_diloco`` exchange step sends one fragment, the mean of its per-fragment
conditionals. XLA's CPU compiler widens bfloat16 collectives to float32 (after rounding the
values to bfloat16), so on this machine the bfloat16 rows send float32's bytes; GPUs and TPUs
send bfloat16 (half). Each run records its wall time, the median of its step times (the first
left out) and the load average before and after.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax

from benchmarks import kit
from optax_dist._quantize import wire_bytes
from optax_dist.cli import trainer
from optax_dist.cli.tasks import TASKS

STEPS = 450
"""15 syncs at H = 30: the whole grid in about 30 minutes on 2 busy cores (see the report)."""
PERIOD, FRAGMENTS = 30, 4
"""H (PERIOD), the steps between two syncs (of each fragment for ``streaming_diloco``)."""
BLOCK = 256
"""The values per float32 scale of the block-quantized formats (the library's default)."""
FORMATS = ("float32", "bfloat16", "float8_e4m3fn", "int8", "float4_e2m1fn", "e3m0")
QUANTIZED = ("int8", "float4_e2m1fn", "e3m0")
CODE_BYTES = {"int8": 1.0, "float4_e2m1fn": 0.5, "e3m0": 0.5}
"""Bytes per value of each block-quantized format's codes (the scales come on top)."""
OVERLAPS, EF_TOLERANCE, OVERLAP_TOLERANCE = (1, 5), 0.01, 0.005
"""The targets: 4-bit with error feedback within 1% of float32 DiLoCo's final loss; overlap
τ = 1 within 0.5% of τ = 0."""


def _row(label: str, family: str, flags: list[str], fmt: str = "float32", *,
         error_feedback: bool = False, overlap: int = 0, eager: bool = False) -> dict[str, Any]:
  return {"label": label, "family": family, "flags": flags, "format": fmt,
          "error_feedback": error_feedback, "overlap": overlap, "eager": eager}


def grid() -> list[dict[str, Any]]:
  """Every run: its label, family, format, options and ``optax-dist train`` flags."""
  streaming, rows = ["--algorithm", "streaming_diloco", "--num-fragments", str(FRAGMENTS)], []
  for name, family, flags in (("diloco", "diloco", ["--algorithm", "diloco"]),
                              ("streaming", "streaming_diloco", streaming)):
    rows += [_row(f"{name} {fmt}", family, [*flags, "--comm-dtype", fmt], fmt) for fmt in FORMATS]
    rows += [_row(f"{name} {fmt} + EF", f"{family} + error feedback",
                  [*flags, "--comm-dtype", fmt, "--error-feedback"], fmt, error_feedback=True)
             for fmt in QUANTIZED]
  return rows + [_row(f"streaming τ={tau}{' eager' if eager else ''}", "streaming overlap",
                      [*streaming, "--overlap", str(tau), *(["--eager"] if eager else [])],
                      overlap=tau, eager=eager) for tau in OVERLAPS for eager in (False, True)]


@dataclasses.dataclass(frozen=True)
class Config:
  steps: int = kit.option(STEPS, "training steps of every run")
  period: int = kit.option(PERIOD, "H, the steps between two syncs")
  runs: tuple[str, ...] = kit.option((), "the runs of the grid to train (default: all)",
                                     metavar="LABEL")
  add: bool = kit.option(False, "train --runs at PREFIX.json's steps and H and put them into it,"
                         " in place of its runs of the same labels (the report says which were"
                         " added, and when)")


QUICK = {"steps": 36, "period": 12, "runs": (
  "diloco float32", "diloco int8", "diloco float4_e2m1fn", "diloco float4_e2m1fn + EF",
  "streaming float32", "streaming e3m0 + EF", "streaming τ=1", "streaming τ=1 eager")}
"""``--quick``: these runs, of a few dozen steps (the labels of :func:`grid`)."""


def run(row: dict[str, Any], data: Any, steps: int, period: int) -> dict[str, Any]:
  s = kit.settings(row["flags"], devices=kit.DEVICES, steps=steps, sync_period=period,
                   seed=0).resolved()
  with kit.Timed() as timed:
    result = trainer.train(TASKS["lm"], data, s)
  cumulative, history = kit.run_bytes(result, s), result["history"]
  exchange = (kit.step_bytes(result["collective_bytes"], "communication_step")
              - kit.step_bytes(result["collective_bytes"], "non_communication_step"))
  out = {
    **row, "steps": s.steps, "sync_period": s.sync_period,
    "final": result["test_bits_per_byte_eval_params"],
    "curve": {"step": history["step"], "bits_per_byte": history["test_bits_per_byte_eval_params"],
              "bytes": [0.0 if t == 0 else cumulative[t - 1] for t in history["step"]]},
    "communication_rounds": result["communication_rounds"], "total_bytes": cumulative[-1],
    "exchange_bytes": exchange, "collective_bytes": result["collective_bytes"],
    "wall_s": result["wall_time_s"], "median_step_s": kit.median(result["step_times"][1:]),
    "load_before": timed.load_before, "load_after": timed.load_after}
  print(f"[lm_exchanges] {row['label']}: {out['final']:.4f} bits/byte,"
        f" {kit.human_bytes(out['total_bytes'])} sent, {out['wall_s']:.0f} s", flush=True)
  return out


def measure(config: Config, prefix: str) -> dict[str, Any]:
  """Trains every row of :func:`grid` (or those of ``config.runs``), in order; with
  ``config.add``, into ``PREFIX.json``'s result."""
  if unknown := sorted(set(config.runs) - {r["label"] for r in grid()}):
    raise ValueError(f"--runs: no such run {', '.join(unknown)}; the runs are"
                     f" {', '.join(r['label'] for r in grid())}")
  if config.add:
    result = kit.read_json(f"{prefix}.json")
    config = dataclasses.replace(config, steps=result["steps"], period=result["period"])
  data = TASKS["lm"].load(0)
  with kit.Timed() as timed:
    trained = [run(r, data, config.steps, config.period) for r in grid()
               if not config.runs or r["label"] in config.runs]
  if not config.add:
    sizes = [int(x.size) for x in jax.tree.leaves(kit.initial_params(TASKS["lm"], data.train))]
    return {"steps": config.steps, "period": config.period, "fragments": FRAGMENTS,
            "block": BLOCK, "devices": kit.DEVICES, "runs": trained, "leaf_sizes": sizes,
            "defaults": dict(TASKS["lm"].defaults), "machine": kit.machine(), **timed.record()}
  by_label = {r["label"]: r for r in [*result["runs"], *trained]}
  order = [r["label"] for r in grid()]
  return {**result, "runs": sorted(by_label.values(), key=lambda r: order.index(r["label"])),
          "added": [*result.get("added", []), {
            "labels": list(config.runs), "date": kit.now(), **timed.record()}]}


def _gap(a: dict[str, Any], b: dict[str, Any]) -> float:
  return a["final"] / b["final"] - 1


def targets(result: dict[str, Any]) -> list[str]:
  """int8 at 1/4 and the 4-bit formats at 1/8 of float32's bytes per value, plus the scales;
  4-bit with error feedback within 1% of float32 DiLoCo (and streaming within 1% of float32
  streaming, reported), and what error feedback recovers, int8's reported too; overlap τ = 1
  within 0.5% of τ = 0; eager at τ = 1 (and 5) no worse than plain delay."""
  runs, sizes, lines = {r["label"]: r for r in result["runs"]}, result["leaf_sizes"], []
  base = runs.get("diloco float32")
  for fmt in (f for f in QUANTIZED if base is not None and f"diloco {f}" in runs):
    r = runs[f"diloco {fmt}"]
    expected = float(wire_bytes(sum(sizes), fmt, BLOCK))  # codes and scales, leaves end to end
    ideal, ratio = CODE_BYTES[fmt] / 4 + 1 / BLOCK, r["exchange_bytes"] / base["exchange_bytes"]
    lines.append(
      f"- {fmt}: {r['exchange_bytes']:,.0f} B per exchange against float32's"
      f" {base['exchange_bytes']:,.0f} B, {ratio:.4f} of float32's bytes per value (codes"
      f" {CODE_BYTES[fmt] / 4:g} + scales 1/{BLOCK} = {ideal:.4f}; the rest is the padding of the"
      f" last block); the codes and scales exactly ({expected:,.0f} B):"
      f" **{'met' if r['exchange_bytes'] == expected else 'missed'}**.")
  for family, fmt in itertools.product(("diloco", "streaming"), QUANTIZED):
    base = runs.get(f"{family} float32")
    plain, fed = runs.get(f"{family} {fmt}"), runs.get(f"{family} {fmt} + EF")
    if base is None or fed is None:
      continue
    gap = _gap(fed, base)
    kind = "target" if family == "diloco" and fmt != "int8" else "not a target, reported"
    text = (f"- {family} {fmt} with error feedback within {EF_TOLERANCE:.0%} of float32"
            f" {family}'s final loss ({base['final']:.4f}; {kind}): {fed['final']:.4f},"
            f" {gap:+.2%}: **{'met' if gap <= EF_TOLERANCE else 'missed'}**.")
    if plain is not None:
      lost, recovered = plain["final"] - base["final"], plain["final"] - fed["final"]
      share = (f", {recovered / lost:.0%} of what quantization lost" if lost > 0 and recovered > 0
               else "")
      effect = (f"recovers {recovered:.4f} bits/byte{share}" if recovered > 0
                else f"ends {-recovered:.4f} bits/byte higher")
      text += (f" Without it {plain['final']:.4f} ({_gap(plain, base):+.2%}); error feedback"
               f" {effect}.")
    lines.append(text)
  zero, one = runs.get("streaming float32"), runs.get("streaming τ=1")
  if zero is not None and one is not None:
    gap = _gap(one, zero)
    lines.append(f"- overlap τ=1 within {OVERLAP_TOLERANCE:.1%} of τ=0 ({zero['final']:.4f}):"
                 f" {one['final']:.4f}, {gap:+.2%}:"
                 f" **{'met' if abs(gap) <= OVERLAP_TOLERANCE else 'missed'}**.")
  for tau in (t for t in OVERLAPS if {f"streaming τ={t}", f"streaming τ={t} eager"} <= set(runs)):
    plain, eager = runs[f"streaming τ={tau}"], runs[f"streaming τ={tau} eager"]
    verdict = "met" if eager["final"] <= plain["final"] else "missed"
    target = "target" if tau == 1 else "not a target, reported"
    lines.append(f"- eager at τ={tau} no worse than plain delay ({target}): {eager['final']:.4f}"
                 f" against {plain['final']:.4f} ({_gap(eager, plain):+.2%}): **{verdict}**.")
  return lines


def runs_table(result: dict[str, Any]) -> str:
  base = next((r for r in result["runs"] if r["label"] == "diloco float32"), None)
  header = ["run", "format", "error feedback", "τ", "eager", "val bits/byte (eval_params)",
            "vs diloco float32", "exchanges", "B per exchange", "sent per worker",
            "median step s", "wall s", "load before → after"]
  rows = [[r["label"], r["format"], "yes" if r["error_feedback"] else "",
           str(r["overlap"]) if r["family"].startswith("streaming") else "—",
           "yes" if r["eager"] else "", f"{r['final']:.4f}",
           kit.fmt(base and _gap(r, base), "+.2%"), str(r["communication_rounds"]),
           f"{r['exchange_bytes']:,.0f}", kit.human_bytes(r["total_bytes"]),
           f"{r['median_step_s']:.3f}", f"{r['wall_s']:.0f}",
           kit.loads(r["load_before"], r["load_after"])] for r in result["runs"]]
  return kit.table(header, rows, "lllrlrrrrrrrl")


def markdown(result: dict[str, Any], plot_name: str) -> str:
  return kit.blocks(
    "## Exchange formats on the language model: quality against bytes",
    kit.doc_markdown(__doc__, 1, 3),
    (f"{result['steps']} steps per run, H = {result['period']}, F = {result['fragments']},"
     f" blocks of {result['block']}; {result['devices']} workers; one seed (0), so a"
     " difference of a few tenths of a percent is within the seed-to-seed spread. "
     + kit.load_text(result) + "".join(f" Added later ({a['date']}, `--add`), at the same settings:"
               f" {', '.join(a['labels'])}; load average {a['load_before']} before,"
               f" {a['load_after']} after; {a['wall_s'] / 60:.1f} min."
               for a in result.get("added", []))), runs_table(result), "Targets:",
    "\n".join(targets(result)),
    f"![validation bits per byte against MB sent per worker]({plot_name})")


MARKERS = dict(zip(FORMATS, "osD^vP"))
COLORS = {"diloco": "C0", "diloco + error feedback": "C1", "streaming_diloco": "C2",
          "streaming_diloco + error feedback": "C4", "streaming overlap": "C3"}


def plot(result: dict[str, Any], path: str) -> None:
  """Final bits per byte against MB sent per worker, a marker per format, a colour per family;
  and the overlap runs' curves against steps."""
  fig, (by_bytes, by_step) = kit.plt.subplots(1, 2, figsize=(13, 5))
  for r in result["runs"]:
    by_bytes.plot(r["total_bytes"] / 1e6, r["final"], MARKERS[r["format"]],
                  color=COLORS[r["family"]], markersize=8, alpha=0.85)
    if r["family"] == "streaming overlap":
      by_bytes.annotate(r["label"].removeprefix("streaming "), (r["total_bytes"] / 1e6,
                        r["final"]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    if r["family"] == "streaming overlap" or r["label"] == "streaming float32":
      by_step.plot(r["curve"]["step"], r["curve"]["bits_per_byte"], "--" if r["eager"] else "-",
                   marker=".", label=r["label"])
  for fmt, marker in MARKERS.items():  # the legend's entries
    by_bytes.plot([], [], marker, color="grey", label=fmt)
  for family, color in COLORS.items():
    by_bytes.plot([], [], "-", lw=5, color=color, label=family)
  by_bytes.set(xscale="log", xlabel="MB sent per worker over the run (log)",
               ylabel="final validation bits per byte (eval_params)")
  by_bytes.legend(fontsize=7, ncol=2)
  by_step.set(xlabel="step", ylabel="validation bits per byte (eval_params)")
  by_step.legend(fontsize=7)
  kit.save_figure(fig, path, f"lm, {result['devices']} workers, {result['steps']} steps, H ="
                             f" {result['period']}, seed 0; load average {result['load_before']}"
                             f" before, {result['load_after']} after", grid=True)
