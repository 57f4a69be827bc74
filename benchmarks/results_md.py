"""``benchmarks/RESULTS.md``: every study's report of ``benchmarks/results/``, in one document.

Rewritten by the driver whenever it writes a report there. A report not written yet is a section
saying how to measure it.
"""

from __future__ import annotations

import os

from benchmarks import kit

SECTIONS = (
  # report, title (None: the report's own), how it is measured
  ("network", "Language model over a bandwidth-limited link (two network namespaces)",
   "make bench-network"),
  ("network_formats", "Quantized exchanges over the 10 Mbit/s link (H = 20)",
   "python -m benchmarks network --rates 10mbit --methods diloco,diloco_int8,"
   "diloco_e3m0_feedback --no-outer-sweep --out benchmarks/results/network_formats"),
  ("network_h10", "The slow link at H = 10, with overlap and exchange formats",
   "python -m benchmarks network --period 10 --methods sync,diloco,streaming_diloco,local_sgd,"
   "elastic_average,diloco_int8,diloco_e3m0_feedback,streaming_diloco_overlap,"
   "streaming_diloco_overlap_device --out benchmarks/results/network_h10"),
  ("equal_tokens", None, "make bench-equal-tokens"),
  ("lm_exchanges", None, "make bench-lm-exchanges"),
  ("async_dylu", None, "make bench-async-dylu"),
  ("async_dylu_constant", "The same with a constant inner learning rate",
   "python -m benchmarks async_dylu --recipe '--lr-schedule constant' --out"
   " benchmarks/results/async_dylu_constant"),
  ("async_dylu_settings", "Asynchronous DiLoCo: the gap across settings",
   "python -m benchmarks async_dylu --seeds 0 --outer LR MOMENTUM ..."),
  ("lm_quality", None, "python -m benchmarks lm_quality"),
  ("lm_overhead", None, "python -m benchmarks lm_overhead"),
  ("mlp_overhead", None, "python -m benchmarks mlp_overhead"),
  ("communication", None, "python -m benchmarks communication"),
)

INTRO = (
  "Written by `python -m benchmarks STUDY` (`make bench` and the `bench-*` targets), each study's"
  " report gathered from `benchmarks/results/`. Measurements, not tests: a missed target is"
  " reported here, nothing fails. The headline is the language model (the `lm` task of"
  " `optax-dist`); the MLP sections at the end measure the wrappers on larger params.")

LOAD = (
  "When the load average exceeds the core count, the machine was shared with other jobs during"
  " the run: wall-clock times are then inflated and noisy, which is why every timing interleaves"
  " each measurement with its reference's and reports medians, with process CPU time beside"
  " wall time. The validation losses do not depend on the load.")


def write(path: str) -> None:
  lines = ["# Benchmarks", "", INTRO, "", machine_table(), "", LOAD, ""]
  for name, title, how in SECTIONS:
    lines += section(name, title, how)
  with open(path, "w") as f:
    f.write("\n".join(lines))


def section(name: str, title: str | None, how: str) -> list[str]:
  """The report ``name`` as a section: a document's headings one level down, its first heading
  replaced by ``title`` if given; or a section saying how to measure it."""
  path = os.path.join(kit.RESULTS, f"{name}.md")
  if not os.path.exists(path):
    return [f"## {title or name}", "", f"Not measured yet (`{how}`).", ""]
  with open(path) as f:
    text = f.read()
  if title is not None:
    text = f"## {title}\n" + text.split("\n", 1)[1]
  lines = text.splitlines()
  if text.startswith("# "):
    lines = [("#" + line if line.startswith("#") else line) for line in lines]
  return [line.replace("](", "](results/") if line.startswith("![") else line
          for line in lines] + [""]


def machine_table() -> str:
  """The machine and versions of the last run of :data:`SECTIONS`, and each run's record."""
  runs = {}
  for name, _, _ in SECTIONS:
    path = os.path.join(kit.RESULTS, f"{name}.json")
    if os.path.exists(path) and "run" in (result := kit.read_json(path)):
      runs[name] = result["run"]
  last = max(runs.values(), key=lambda r: r["date"], default={})
  m, v = last.get("machine", {}), last.get("versions", {})
  rows = [["CPU", m.get("cpu", "")], ["cores", m.get("cores", "")],
          ["memory", m.get("memory", "")],
          ["versions", ", ".join(f"{k} {val}" for k, val in v.items())],
          ["JAX devices", f"{kit.DEVICES} emulated CPU devices (`jax_num_cpu_devices`)"]]
  rows += [[f"`{name}`", f"{r['date']}, `{r['command']}`: {r['seconds'] / 60:.1f} min; load"
                         f" average {r['load_before']} before, {r['load_after']} after"]
           for name, r in runs.items()]
  return kit.table(["", ""], rows, "ll")
