"""Runs every benchmark section and writes ``benchmarks/RESULTS.md`` (and its plots).

Usage::

  python benchmarks/run.py [--quick] [--sections lm_quality,lm_overhead,...]

Sections, in this order: ``lm_quality`` (validation bits per byte of the ``lm`` task against
steps and bytes communicated, 8 workers), ``lm_overhead`` (the LM step of each transformation
against bare adam, bound and unbound, donated or not; and the optimizer alone against its
bytes bound), ``lm_multiprocess`` (2 processes × 2 devices over gloo, hierarchical against
synchronous), ``mlp_overhead`` (step time and memory of each wrapper on MLPs of ≈1M and ≈10M
params) and ``communication`` (bytes per step from :func:`optax_dist.communication_report`).
Each section's results are kept in ``results.json``; ``--sections`` reruns some and keeps the
others' earlier results, and RESULTS.md says when each was measured. These are measurements,
not tests: nothing fails when a target is missed; RESULTS.md says which are. ``--quick`` runs
every section small, to check the program, not to measure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICES = 8
SECTIONS = ("lm_quality", "lm_overhead", "lm_multiprocess", "mlp_overhead", "communication")

WHY = {
  "moving_average": (
    "every step also reads the new params and the EMA and writes the EMA: three more"
    " params-sized passes over memory on top of adam's seven (read g, m, v, p; write m, v, p),"
    " inherent to keeping an EMA (TF's `MovingAverageOptimizer` does the same work)"),
  "elastic_average": (
    "the conditional hands the center back in place (no copies), but it takes adam's updates"
    " as an operand, so XLA materialises them instead of fusing them into `apply_updates`, and"
    " the returned updates are selected with a `where` on every step: params-sized passes over"
    " memory that bare adam does not make (temp memory in the next section)"),
  "agn": (
    "the gradient accumulator a += g is one more read-modify-write of a params-sized buffer on"
    " every step (inherent to AGN), and the returned updates and the accumulator's reset are"
    " selected with a `where` on every step; the conditional itself copies nothing"),
  "drop_stale_gradients": (
    "the inner update is always computed and then selected with `optax.tree.where` on the"
    " updates and on adam's state (so that collectives inside run on every worker): one more"
    " pass reading the old and the new moments"),
  "accumulate_then_reduce": (
    "the accumulator a += g is one more read-modify-write of a params-sized buffer, and the"
    " `lax.cond` passes the accumulator and adam's state through"),
}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="few repetitions and short training: checks the program only")
  parser.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma-separated sections to run (default: all: {','.join(SECTIONS)})")
  parser.add_argument("--seeds", type=int, default=3, help="seeds of the LM runs (default: 3)")
  parser.add_argument("--lm-steps", type=int, default=600,
                      help="training steps of each LM quality run (default: 600)")
  parser.add_argument("--render", action="store_true",
                      help="only rewrite RESULTS.md (and the plots) from results.json")
  args = parser.parse_args()
  sections = [] if args.render else [x for x in args.sections.split(",") if x]
  unknown = [x for x in sections if x not in SECTIONS]
  if unknown:
    parser.error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")

  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  jax.config.update("jax_num_cpu_devices", DEVICES)
  sys.path.insert(0, HERE)
  import _util

  out_dir = os.path.dirname(os.path.abspath(args.out))
  os.makedirs(out_dir, exist_ok=True)
  json_path = os.path.join(out_dir, "results.json")
  store = _load(json_path)
  command = "python benchmarks/run.py" + (" --quick" if args.quick else "")
  if set(sections) != set(SECTIONS):
    command += f" --sections {','.join(sections)}"
  start = time.perf_counter()
  if args.render:
    _replot(store, out_dir)
    _render(store, args.out)
  for name in SECTIONS:
    if name not in sections:
      continue
    print(f"[bench] {name} ...", file=sys.stderr, flush=True)
    load_before, t = _util.load_average(), time.perf_counter()
    result = RUNNERS[name](args, out_dir)
    store["sections"][name] = {
      "result": result, "seconds": time.perf_counter() - t, "load_before": load_before,
      "load_after": _util.load_average(), "command": command, "date": _util.now()}
    print(f"[bench] {name}: {store['sections'][name]['seconds']:.0f} s", file=sys.stderr,
          flush=True)
    store |= {"machine": _util.machine(), "versions": _util.versions()}
    with open(json_path, "w") as f:  # after every section: a stopped run keeps what it had
      json.dump(store, f, indent=1, default=str)
    _render(store, args.out)
  print(f"[bench] wrote {args.out} in {(time.perf_counter() - start) / 60:.1f} min",
        file=sys.stderr)
  return 0


def _replot(store: dict, out_dir: str) -> None:
  """Redraws the plots of the stored LM sections."""
  import bench_lm_multiprocess
  import bench_lm_overhead
  import bench_lm_quality

  for name, module, png in (("lm_quality", bench_lm_quality, "lm_quality.png"),
                            ("lm_overhead", bench_lm_overhead, "lm_overhead.png"),
                            ("lm_multiprocess", bench_lm_multiprocess, "lm_multiprocess.png")):
    if name in store["sections"]:
      module.plot(store["sections"][name]["result"], os.path.join(out_dir, png))


def _load(path: str) -> dict:
  """The results of earlier runs (``{"sections": {}}`` if none, or in an older layout)."""
  try:
    with open(path) as f:
      store = json.load(f)
  except (OSError, ValueError):
    return {"sections": {}}
  return store if isinstance(store.get("sections"), dict) else {"sections": {}}


def _run_lm_quality(args, out_dir):
  import bench_lm_quality

  seeds = tuple(range(1 if args.quick else args.seeds))
  result = bench_lm_quality.measure(seeds, steps=60 if args.quick else args.lm_steps)
  bench_lm_quality.plot(result, os.path.join(out_dir, "lm_quality.png"))
  return result


def _run_lm_overhead(args, out_dir):
  import bench_lm_overhead

  rounds = (2, 3, 3) if args.quick else (20, 60, 40)
  result = bench_lm_overhead.measure(*rounds)
  bench_lm_overhead.plot(result, os.path.join(out_dir, "lm_overhead.png"))
  return result


def _run_lm_multiprocess(args, out_dir):
  import bench_lm_multiprocess

  result = bench_lm_multiprocess.measure(quick=args.quick)
  bench_lm_multiprocess.plot(result, os.path.join(out_dir, "lm_multiprocess.png"))
  return result


def _run_mlp_overhead(args, out_dir):
  import bench_overhead

  return bench_overhead.measure({"≈1M": 3, "≈10M": 2} if args.quick else {"≈1M": 60, "≈10M": 16})


def _run_communication(args, out_dir):
  import bench_communication

  return bench_communication.measure()


RUNNERS = {"lm_quality": _run_lm_quality, "lm_overhead": _run_lm_overhead,
           "lm_multiprocess": _run_lm_multiprocess, "mlp_overhead": _run_mlp_overhead,
           "communication": _run_communication}


def _overhead_intro(b) -> str:
  return (
    f"A jitted training step (forward, backward, optimizer update, `apply_updates`) of a Flax"
    f" MLP with {b.FEATURES} inputs and {b.CLASSES} outputs, minibatch {b.BATCH}, params and"
    f" optimizer state donated (`donate_argnums=(0, 1)`), for each wrapper around"
    f" `optax.adam({b.LEARNING_RATE:g})` against the same step with bare adam. One worker: the"
    f" step is `jax.shard_map`'ed over a one-device mesh, so the axis is bound (size 1) and every"
    f" wrapper runs its own code path, its `lax.cond` a real conditional (under `vmap` it would"
    f" become a `select` running both branches). The communicating wrappers' communication and"
    f" non-communication steps are timed separately: before each call the step counter"
    f" (`local_step`, `mini_step`) is set so that the call is the one wanted. In each round every"
    f" wrapper call sits between two bare-adam calls (wrappers in a seeded random order); its"
    f" ratio is its time over the mean of those two; the table gives the median ratio over the"
    f" rounds with its interquartile range, the median of the same ratio in process CPU time"
    f" (steadier on a loaded machine), and the median wall time. Target: ≤ {b.TARGET}× on"
    f" non-communication steps. *copies MiB*: bytes written by `copy` instructions in the"
    f" compiled ≈10M step (all branches), a deterministic hint of extra memory traffic."
  )


def _overhead_verdicts(result, target) -> str:
  missed = {}
  for s in result["sizes"]:
    for r in s["rows"]:
      if r["communicates"]:
        continue
      if r["ratio"] > target or r["cpu_ratio"] > target:
        missed.setdefault((r["wrapper"], r["label"], r["phase"]), []).append(
          f"{s['size']} {r['ratio']:.2f}× wall / {r['cpu_ratio']:.2f}× CPU")
  if not missed:
    return f"Every non-communication step is within {target}× of bare adam, wall and CPU."
  lines = [f"Targets missed (> {target}× on a non-communication step, wall or CPU), and why:", ""]
  for (wrapper, label, phase), where in missed.items():
    lines.append(f"- `{label}`, {phase} ({'; '.join(where)}): {WHY.get(wrapper, 'noise?')}.")
  lines.append("")
  lines.append(
    "A row missed on wall time only, with its CPU ratio within the target and an interquartile"
    " range spanning it, is within the noise of a shared machine; a row missed on both wall and"
    " CPU time shows the structural cost described. The ratio depends on how much of the step"
    " the optimizer is: the wrappers add memory"
    " passes over params-sized buffers, the forward and backward passes are matrix products"
    " whose cost grows with the batch; a larger minibatch than this one makes every ratio"
    " smaller, a smaller one larger. Ratios below 1 on a non-communication step are real for"
    " `accumulate_then_reduce` (no adam update on an accumulating micro-step) and noise"
    " elsewhere.")
  return "\n".join(lines)


def _memory_intro(result) -> str:
  mem = result["memory"]
  return (
    f"The {mem['size']} MLP ({mem['num_params']:,} params,"
    f" {mem['params_bytes'] / 2**20:.1f} MiB in float32). *state*: the sum of the optimizer"
    f" state's leaves' `nbytes`; *needed*: what the algorithm itself must store, in params'"
    f" bytes; *excess bytes*: state − needed (the scalar counters). *peak*: from"
    f" `jax.jit(step).lower(...).compile().memory_analysis()`, argument + output − alias +"
    f" temp bytes (alias: the outputs written into donated inputs, so counted once), with the"
    f" params and state donated and not; *arg + out + temp*: the same without subtracting the"
    f" aliased bytes; *temp*: XLA's temporary buffers."
  )


def _memory_notes(result) -> str:
  rows = {r["label"].split("(")[0]: r for r in result["memory"]["rows"]}
  base = rows["adam "]["donated"]["peak"]
  lines = ["Peak over bare adam's, donated: " + ", ".join(
    f"`{label.strip()}` {r['donated']['peak'] / base:.2f}×" for label, r in rows.items()
    if label != "adam ") + "."]
  return "\n".join(lines)


def _communication_intro(result, b) -> str:
  return (
    f"The training step of the ≈1M MLP ({result['num_params']:,} params,"
    f" {result['params_bytes']:,} B in float32, hidden"
    f" {'-'.join(map(str, result['hidden']))}) under `jax.shard_map` over {b.DEVICES} emulated"
    f" CPU devices, compiled (not run) from `jax.ShapeDtypeStruct`s, and read by"
    f" `optax_dist.communication_report`. Bytes are per device and per execution: *sent* is"
    f" what a device contributes (a collective's operands), *received* its result (an"
    f" `all_gather` over {b.DEVICES} devices returns {b.DEVICES}× what each sends: AGN's"
    f" sequential center update gathers every worker's accumulated gradient). Per {b.STEPS}"
    f" steps: communication steps at the communication-step bytes, the others at the"
    f" non-communication-step bytes (none for every algorithm here). **bfloat16 on CPU**:"
    f" XLA's CPU compiler widens bfloat16 collectives to float32 after rounding the values to"
    f" bfloat16, so the compiled stage reports float32 bytes for the `comm_dtype=bfloat16`"
    f" rows; the *lowered* columns (`stage=\"lowered\"`, the program as JAX emits it, one"
    f" collective per leaf) show the halved bytes that GPU and TPU backends send."
  )


def _render(store: dict, out: str) -> None:
  """Writes RESULTS.md from the stored sections (a section not yet measured says so)."""

  secs = store["sections"]
  lines = [
    "# Benchmarks",
    "",
    ("Written by `python benchmarks/run.py` (`make bench`). Measurements, not tests: a missed"
     " target is reported here, nothing fails. The headline is the language model (the `lm`"
     " task of `optax-dist`); the MLP sections below it measure the wrappers on larger"
     " params."),
    "",
    _machine_table(store, secs),
    "",
    ("When the load average exceeds the core count, the machine was shared with other jobs"
     " during the run: wall-clock times are then inflated and noisy, which is why every timing"
     " interleaves each measurement with its reference's and reports medians, with process CPU"
     " time beside wall time. The validation losses do not depend on the load."),
    "",
    *_network_md(),
    *_included("network_formats.md", "Quantized exchanges over the 10 Mbit/s link (H = 20)",
               "python benchmarks/bench_network.py --rates 10mbit --methods"
               " diloco,diloco_int8,diloco_e3m0_feedback --no-outer-sweep --output"
               " benchmarks/network_formats", heading=True),
    *_included("network_h10.md", "The slow link at H = 10, with overlap and exchange formats",
               "python benchmarks/bench_network.py --period 10 --methods sync,diloco,"
               "streaming_diloco,local_sgd,elastic_average,diloco_int8,diloco_e3m0_feedback,"
               "streaming_diloco_overlap,streaming_diloco_overlap_device --output"
               " benchmarks/network_h10", heading=True),
    *_included("equal_tokens.md", "DiLoCo against data parallel at equal tokens",
               "make bench-equal-tokens"),
    *_included("lm_exchanges.md", "Language model: quality against bytes, by exchange format",
               "make bench-lm-exchanges"),
    *_included("async_dylu.md", "Asynchronous DiLoCo on heterogeneous workers: delayed Nesterov"
               " and DyLU", "make bench-async-dylu"),
    *_included("async_dylu_constant.md", "The same with a constant inner learning rate",
               "python benchmarks/bench_async_dylu.py --recipe '--lr-schedule constant' --out"
               " benchmarks/async_dylu_constant", heading=True),
    *_included("async_dylu_settings.md", "Asynchronous DiLoCo: the gap across settings",
               "python benchmarks/bench_async_dylu.py --seeds 0 --outer LR MOMENTUM ...",
               heading=True),
  ]
  for title, name, body in (
      ("Language model: quality against communication", "lm_quality", _lm_quality_md),
      ("Language model: overhead on the step", "lm_overhead", _lm_overhead_md),
      ("Language model: two processes, hierarchical", "lm_multiprocess", _lm_multiprocess_md),
      ("MLP: overhead and memory", "mlp_overhead", _mlp_md),
      ("MLP: communication", "communication", _communication_md)):
    lines += [f"## {title}", ""]
    if name in secs:
      lines += [body(secs[name]["result"]), ""]
    else:
      lines += [f"Not measured yet (`python benchmarks/run.py --sections {name}`).", ""]
  with open(out, "w") as f:
    f.write("\n".join(lines))


def _network_md() -> list[str]:
  """The slow-link section, from ``network_results.json`` (``make bench-network``, which needs
  root and runs apart from this script), or a line saying how to measure it."""
  path = os.path.join(HERE, "network_results.json")
  title = "## Language model over a bandwidth-limited link (two network namespaces)"
  if not os.path.exists(path):
    return [title, "", "Not measured yet (`make bench-network`, as root).", ""]
  sys.path.insert(0, HERE)
  import bench_network

  with open(path) as f:
    result = json.load(f)
  when = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
  body = bench_network.markdown(result, "network.png").split("\n", 1)[1]
  return [title, "", f"Measured by `make bench-network` ({when:%Y-%m-%d %H:%M} UTC).", body, ""]


def _included(name: str, title: str, how: str, heading: bool = False) -> list[str]:
  """The report ``name`` of a study run apart from this script (``how``), as a section (a
  document's headings one level down; its first heading replaced by ``title`` if ``heading``),
  or a section ``title`` saying how to measure it."""
  path = os.path.join(HERE, name)
  if not os.path.exists(path):
    return [f"## {title}", "", f"Not measured yet (`{how}`).", ""]
  with open(path) as f:
    text = f.read()
  if heading:
    text = f"## {title}\n" + text.split("\n", 1)[1]
  if not text.startswith("# "):  # already a section
    return text.splitlines() + [""]
  return [("#" + line if line.startswith("#") else line) for line in text.splitlines()] + [""]


def _machine_table(store: dict, secs: dict) -> str:
  import _util

  m, v = store.get("machine", {}), store.get("versions", {})
  rows = [["CPU", m.get("cpu", "")], ["cores", m.get("cores", "")],
          ["memory", m.get("memory", "")],
          ["versions", ", ".join(f"{k} {val}" for k, val in v.items())],
          ["JAX devices", f"{DEVICES} emulated CPU devices (`jax_num_cpu_devices`)"]]
  for name in SECTIONS:
    if name in secs:
      s = secs[name]
      rows.append([f"`{name}`", (f"{s['date']}, `{s['command']}`: {s['seconds'] / 60:.1f} min;"
                                 f" load average {s['load_before']} before,"
                                 f" {s['load_after']} after")])
  total = sum(secs[n]["seconds"] for n in SECTIONS if n in secs)
  rows.append(["total", f"{total / 60:.1f} min over the sections above"])
  return _util.table(["", ""], rows, "ll")


def _lm_quality_md(result) -> str:
  import bench_lm_quality as b

  d = result["defaults"]
  intro = (
    f"`optax_dist.cli.trainer.train` on the `lm` task ({result['model']}; {result['dataset']})"
    f" over {b.DEVICES} workers, one emulated CPU device each, each with its own 1/{b.DEVICES}"
    f" of the training windows, minibatch {d['batch_size']} windows of 64 bytes per worker, adam"
    f" {d['learning_rate']:g}; `elastic_average` moving rate 0.9/8, `diloco` and"
    " `streaming_diloco` with the paper's outer Nesterov SGD (0.7, momentum 0.9), the"
    " streaming fragments balanced by size. Validation bits per byte of"
    " `optax_dist.eval_params` (center, anchor or params) and of the workers' own params"
    " (their mean); *sent per worker*: bytes each worker sends in the run, from the compiled"
    " step (table below); *steps to sync + 2%*: the first evaluated step where the seed-mean"
    " curve is within 2% of sync's final loss.")
  return "\n".join([intro, "", b.markdown(result, "lm_quality.png")])


def _lm_overhead_md(result) -> str:
  import _util
  import bench_lm_overhead as b

  return "\n".join([
    _util.doc_markdown(b.__doc__, 1, 4), "",
    b.matrix_markdown(result), "", b.missed_markdown(result), "",
    ("Temp bytes (`compile().memory_analysis()`) and bytes written by `copy` instructions in"
     " each compiled LM step:"), "", b.memory_markdown(result), "",
    "![LM step time over bare adam's](lm_overhead.png)", "",
    "### The optimizer alone", "", _util.doc_markdown(b.__doc__, 5, 5), "",
    b.optimizer_markdown(result)])


def _lm_multiprocess_md(result) -> str:
  import bench_lm_multiprocess as b

  return b.markdown(result, "lm_multiprocess.png")


def _mlp_md(result) -> str:
  import bench_overhead

  return "\n".join([
    _overhead_intro(bench_overhead), "", bench_overhead.overhead_markdown(result), "",
    _overhead_verdicts(result, bench_overhead.TARGET), "", "### Memory", "",
    _memory_intro(result), "", bench_overhead.memory_markdown(result), "",
    _memory_notes(result)])


def _communication_md(result) -> str:
  import bench_communication

  return "\n".join([_communication_intro(result, bench_communication), "",
                    bench_communication.markdown(result)])


if __name__ == "__main__":
  sys.exit(main())
