"""The one driver of the benchmarks: ``python -m benchmarks STUDY [--quick] [--out PREFIX]
[--report] [the study's flags]``.

A study is a module of :mod:`benchmarks.studies`: a ``Config`` dataclass (each field a flag
``--field-name`` of its own, see :func:`benchmarks.kit.option`), ``QUICK`` (the fields
``--quick`` changes: a short run that checks the program, not a measurement),
``measure(config, prefix)`` (a JSON-able result, or ``None`` when it cannot run here, having said
why), ``markdown(result, figure)`` and ``plot(result, path)``; and optionally ``load(prefix,
config)``, how ``--report`` reads the result back (default: ``PREFIX.json``). The driver sets up
JAX (importing :mod:`benchmarks.kit`), measures, records the run (date, command, wall-clock,
load average before and after, machine, versions: the result's ``run``), writes
``PREFIX.json``, then draws ``PREFIX.png`` (``plot``) and writes ``PREFIX.md`` (``markdown``).
``--report`` measures nothing and renders the report again from the saved result. ``PREFIX``
defaults to ``benchmarks/results/STUDY`` (with ``--quick``, a temporary directory); a report
written under ``benchmarks/results/`` also rewrites ``benchmarks/RESULTS.md``, which gathers
the reports of :data:`SECTIONS`.

``bench`` runs the studies of :data:`BENCH` one after the other (``make bench``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import pathlib
import sys
import tempfile
import types
import typing
from collections.abc import Sequence

from benchmarks import kit

STUDIES = ("lm_quality", "lm_overhead", "mlp_overhead", "communication", "fsdp", "network",
           "equal_tokens", "lm_exchanges", "async_dylu", "chaos", "decoupled_staleness")
BENCH = ("lm_quality", "lm_overhead", "mlp_overhead", "communication")
"""The studies of ``make bench`` (``python -m benchmarks bench``)."""

STALENESS = ("python -m benchmarks decoupled_staleness --flags '--outer-learning-rate 1.4"
             " --outer-momentum 0'")
SECTIONS = (  # report, title (None: the report's own), how it is measured
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
  ("lm_exchanges", None, "make bench-lm-exchanges"), ("async_dylu", None, "make bench-async-dylu"),
  ("async_dylu_constant", "The same with a constant inner learning rate",
   "python -m benchmarks async_dylu --recipe '--lr-schedule constant' --out"
   " benchmarks/results/async_dylu_constant"),
  ("async_dylu_settings", "Asynchronous DiLoCo: the gap across settings",
   "python -m benchmarks async_dylu --seeds 0 --outer LR MOMENTUM ..."),
  ("decoupled_staleness_w0", None, "make bench-decoupled-staleness"),
  ("decoupled_staleness", "Staleness rules with a window of half the slack (W = 10 s)",
   f"{STALENESS} --gamma 0.5 --out benchmarks/results/decoupled_staleness"),
  ("decoupled_staleness_long", "Staleness rules at the torchft benchmark's length (W = 0)",
   f"{STALENESS} --steps 1120 --out benchmarks/results/decoupled_staleness_long"),
  ("decoupled_staleness_long_w10", "The same with a window of half the slack (W = 10 s)",
   f"{STALENESS} --steps 1120 --gamma 0.5 --out benchmarks/results/decoupled_staleness_long_w10"),
  *((name, None, f"python -m benchmarks {name}") for name in BENCH),
  ("chaos/chaos", "Training through failures: fault-tolerant DiLoCo under faults",
   "make bench-chaos"),
  ("chaos/speeds", "Decoupled rounds over torchft: replicas of different speeds",
   "make bench-decoupled"),
  ("chaos/speeds_age_gate", "Speeds with age_gate", "make bench-decoupled DECOUPLED_RULE=age_gate"),
  ("chaos/link", "Fault-tolerant rounds over torchft and a 10 Mbit/s link", "make bench-ft-link"))

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


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["bench"]:
    return max(main([name, *argv[1:]]) for name in BENCH)
  if not argv or argv[0] not in STUDIES:
    print(f"{__doc__}\nSTUDY: one of {', '.join(STUDIES + ('bench',))}; python -m benchmarks"
          " STUDY --help lists its flags.")
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2
  study = importlib.import_module(f"benchmarks.studies.{argv[0]}")
  config, args = parse(study, argv[1:])
  prefix = args.out or os.path.join(tempfile.mkdtemp() if args.quick else kit.RESULTS, argv[0])
  if args.report:
    result = getattr(study, "load", lambda p, _: kit.read_json(f"{p}.json"))(prefix, config)
  else:
    with kit.Timed() as timed:
      result = study.measure(config, prefix)
    if result is None:
      return 0
    result["run"] = {"date": kit.now(), "command": " ".join(["python -m benchmarks", *argv]),
                     "seconds": timed.seconds, "load_before": timed.load_before,
                     "load_after": timed.load_after, "machine": kit.machine(),
                     "versions": kit.versions()}
  kit.write_json(f"{prefix}.json", result)
  study.plot(result, f"{prefix}.png")
  text = study.markdown(result, os.path.basename(f"{prefix}.png"))
  pathlib.Path(f"{prefix}.md").write_text(text.rstrip("\n") + "\n")
  print(text)
  print(f"[benchmarks] wrote {prefix}.json, .md and .png", file=sys.stderr)
  if os.path.commonpath([os.path.abspath(prefix), kit.RESULTS]) == kit.RESULTS:
    write_results(os.path.join(kit.ROOT, "RESULTS.md"))
  return 0


def parse(study: types.ModuleType, argv: Sequence[str]) -> tuple[object, argparse.Namespace]:
  """The study's ``Config`` (its defaults, then ``QUICK``'s with ``--quick``, then the flags
  ``argv`` gives: one ``--field-name`` per field, a tuple taking several values, text ones also
  comma-separated, a bool ``--name`` or ``--no-name``) and the driver's own flags."""
  name = study.__name__.split(".")[-1]
  parser = argparse.ArgumentParser(prog=f"python -m benchmarks {name}",
                                   description=study.__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="a short run that checks the program, not a measurement")
  parser.add_argument("--out", metavar="PREFIX", help="writes PREFIX.json, PREFIX.md and PREFIX.png"
                      f" (default benchmarks/results/{name}; with --quick, a temporary directory)")
  parser.add_argument("--report", action="store_true", help="render PREFIX.md and PREFIX.png"
                      " again from the saved result; measures nothing")
  hints, fields = typing.get_type_hints(study.Config), dataclasses.fields(study.Config)
  for field in fields:
    kind, kwargs = hints[field.name], dict(field.metadata)
    if type(None) in typing.get_args(kind):  # X | None: X
      (kind,) = set(typing.get_args(kind)) - {type(None)}
    if kind is bool:
      kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is tuple:
      items = typing.get_args(kind)
      kwargs |= {"nargs": "+" if items[-1] is Ellipsis else len(items), "type": items[0]}
    else:
      kwargs["type"] = kind
    parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                        default=argparse.SUPPRESS, **kwargs)
  args = parser.parse_args(argv)
  given = {f.name: getattr(args, f.name) for f in fields if hasattr(args, f.name)}
  given |= {key: tuple(x for v in value for x in (v.split(",") if isinstance(v, str) else [v]))
            for key, value in given.items() if isinstance(value, list)}
  return dataclasses.replace(study.Config(), **(study.QUICK if args.quick else {}) | given), args


def write_results(path: str) -> None:
  """``benchmarks/RESULTS.md``: every study's report of ``benchmarks/results/``, in one document;
  a report not written yet is a section saying how to measure it."""
  lines = ["# Benchmarks", "", INTRO, "", machine_table(), "", LOAD, ""]
  lines += [line for name, title, how in SECTIONS for line in section(name, title, how)]
  pathlib.Path(path).write_text("\n".join(lines))


def section(name: str, title: str | None, how: str) -> list[str]:
  """The report ``name`` as a section: a document's headings one level down, its first heading
  replaced by ``title`` if given; or a section saying how to measure it."""
  path = os.path.join(kit.RESULTS, f"{name}.md")
  if not os.path.exists(path):
    return [f"## {title or name}", "", f"Not measured yet (`{how}`).", ""]
  text = pathlib.Path(path).read_text()
  if title is not None:
    text = f"## {title}\n" + text.split("\n", 1)[1]
  down = "#" if text.startswith("# ") else ""  # a document's headings one level down
  lines = [down + x if x.startswith("#") else x for x in text.splitlines()]
  folder = os.path.join("results", os.path.dirname(name), "")
  return [line.replace("](", "](" + folder) if line.startswith("![") else line
          for line in lines] + [""]


def machine_table() -> str:
  """The machine and versions of the last run of :data:`SECTIONS`, and each run's record."""
  runs = {name: result["run"] for name, _, _ in SECTIONS
          if os.path.exists(path := os.path.join(kit.RESULTS, f"{name}.json"))
          and "run" in (result := kit.read_json(path))}
  last = max(runs.values(), key=lambda r: r["date"], default={})
  m, v = last.get("machine", {}), last.get("versions", {})
  rows = [["CPU", m.get("cpu", "")], ["cores", m.get("cores", "")], ["memory", m.get("memory", "")],
          ["versions", ", ".join(f"{k} {val}" for k, val in v.items())],
          ["JAX devices", f"{kit.DEVICES} emulated CPU devices (`jax_num_cpu_devices`)"]]
  rows += [[f"`{name}`", f"{r['date']}, `{r['command']}`: {r['seconds'] / 60:.1f} min; load"
                         f" average {r['load_before']} before, {r['load_after']} after"]
           for name, r in runs.items()]
  return kit.table(["", ""], rows, "ll")


if __name__ == "__main__":
  sys.exit(main())
