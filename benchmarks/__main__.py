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
``PREFIX.json`` and, with :func:`benchmarks.kit.write_report`, ``PREFIX.png`` and ``PREFIX.md``.
``--report`` measures nothing and renders the report again from the saved result. ``PREFIX``
defaults to ``benchmarks/results/STUDY`` (with ``--quick``, a temporary directory); a report
written there also rewrites ``benchmarks/RESULTS.md``, which gathers every report.

``bench`` runs the studies of :data:`BENCH` one after the other (``make bench``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import tempfile
import types
import typing
from collections.abc import Sequence

from benchmarks import kit, results_md

STUDIES = ("lm_quality", "lm_overhead", "mlp_overhead", "communication", "fsdp", "network",
           "equal_tokens", "lm_exchanges", "async_dylu", "chaos")
BENCH = ("lm_quality", "lm_overhead", "mlp_overhead", "communication")
"""The studies of ``make bench`` (``python -m benchmarks bench``)."""


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
  print(kit.write_report(result, prefix, study.plot, study.markdown))
  print(f"[benchmarks] wrote {prefix}.json, .md and .png", file=sys.stderr)
  if os.path.dirname(os.path.abspath(prefix)) == kit.RESULTS:
    results_md.write(os.path.join(kit.ROOT, "RESULTS.md"))
  return 0


def parse(study: types.ModuleType, argv: Sequence[str]) -> tuple[object, argparse.Namespace]:
  """The study's ``Config`` (its defaults, then ``QUICK``'s with ``--quick``, then the flags
  ``argv`` gives: one ``--field-name`` per field, a tuple taking several values, text ones also
  comma-separated, a bool a switch) and the driver's own flags."""
  name = study.__name__.split(".")[-1]
  parser = argparse.ArgumentParser(prog=f"python -m benchmarks {name}",
                                   description=study.__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="a short run that checks the program, not a measurement")
  parser.add_argument("--out", default=None, metavar="PREFIX",
                      help=f"writes PREFIX.json, PREFIX.md and PREFIX.png (default"
                           f" benchmarks/results/{name}; with --quick, a temporary directory)")
  parser.add_argument("--report", action="store_true",
                      help="render PREFIX.md and PREFIX.png again from the saved result;"
                           " measures nothing")
  hints, fields = typing.get_type_hints(study.Config), dataclasses.fields(study.Config)
  for field in fields:
    kind, kwargs = _unwrap(hints[field.name]), dict(field.metadata)
    if kind is bool:
      kwargs["action"] = "store_true"
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
  config = dataclasses.replace(study.Config(), **(study.QUICK if args.quick else {}) | given)
  return config, args


def _unwrap(kind: object) -> object:
  """``X`` of ``X | None``."""
  if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
    (kind,) = [k for k in typing.get_args(kind) if k is not type(None)]
  return kind


if __name__ == "__main__":
  sys.exit(main())
