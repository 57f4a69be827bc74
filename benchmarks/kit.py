"""What every study shares: JAX set up once, the run's record, timing, bytes, tables, reports.

Importing this module configures JAX before anything else imports it: CPU only, with
:data:`DEVICES` emulated devices, and collectives that wait up to 10 minutes for a descheduled
thread (on a loaded 2-core machine one step can take longer than XLA's default 40 s). The
driver (``python -m benchmarks``) imports it first, so every study imports JAX at its top.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = " ".join([
  os.environ.get("XLA_FLAGS", ""), "--xla_cpu_collective_call_terminate_timeout_seconds=600",
  "--xla_cpu_collective_timeout_seconds=600"]).strip()

import flax  # noqa: E402
import jax  # noqa: E402
import jaxlib  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from optax_dist.cli import runs  # noqa: E402
from optax_dist.cli.algorithms import ALGORITHMS  # noqa: E402
from optax_dist.cli.config import Settings  # noqa: E402
from optax_dist.cli.tasks import TASKS  # noqa: E402

DEVICES = 8
"""Emulated CPU devices of every study."""

with contextlib.suppress(RuntimeError):  # JAX already set up (e.g. by a test session's conftest)
  jax.config.update("jax_num_cpu_devices", DEVICES)

ROOT = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(ROOT, "results")
"""Where the reports, their figures and their JSON go by default."""


def settings(flags: Sequence[str] = (), **overrides: Any) -> Settings:
  """The trainer's settings of an ``lm`` run: the task's recipe (its defaults but ``steps``), then
  ``flags`` (``optax-dist train`` flags, e.g. ``("--lr-schedule", "constant", "--eager")``: ``--name
  VALUE`` sets ``name``, a flag without a value sets it to ``True``), then ``overrides``. As on the
  command line, a period the task sets and these do not is at most ``steps``."""
  task, given = TASKS[overrides.get("task", "lm")], flag_values(flags) | overrides
  values = {"task": task.name, **{k: v for k, v in task.defaults.items() if k != "steps"}, **given}
  for key in ("communication_period", "sync_period"):
    if key not in given and values.get(key) is not None and "steps" in values:
      values[key] = min(values[key], values["steps"])
  return Settings(**values)


def flag_values(flags: Sequence[str]) -> dict[str, Any]:
  """``{"lr_schedule": "constant", "eager": True}`` of ``["--lr-schedule", "constant",
  "--eager"]``; a value is read as JSON (numbers), else kept as text. Raises ``ValueError`` for a
  name that is no field of :class:`Settings`."""
  names, out, key = {f.name for f in dataclasses.fields(Settings)}, {}, None
  for flag in flags:
    if flag.startswith("--"):
      key = flag[2:].replace("-", "_")
      if key not in names:
        raise ValueError(f"settings(flags=...): {flag} is not a setting of the trainer; the"
                         f" settings are {', '.join(sorted(names))}")
      out[key] = True
    elif key is not None:
      try:
        out[key] = json.loads(flag)
      except ValueError:
        out[key] = flag
  return out


def total(by_axes: Mapping[str, float], operands: Mapping[str, int], exchange: bool) -> float:
  """The bytes a device sends into collectives of one execution: all of them, whatever axes."""
  return float(sum(by_axes.values()))


def step_bytes(steps: Mapping[str, Any], kind: str, cost: Callable = total,
               exchange: bool = False) -> float:
  """``cost`` of one execution of the step ``kind`` of a trainer's ``collective_bytes`` (or with
  ``exchange``, of ``--exchange-device``'s exchange program): its unconditional collectives plus
  the mean of its conditional exchanges (``streaming_diloco`` runs one fragment's per sync)."""
  step = steps[kind]
  exchanges = [cost(b, n, exchange) for b, n in zip(step["conditional"],
                                                    step["operands"]["conditional"], strict=True)]
  return (cost(step["unconditional"], step["operands"]["unconditional"], exchange)
          + (statistics.mean(exchanges) if exchanges else 0.0))


def run_bytes(result: Mapping[str, Any], s: Settings, cost: Callable = total) -> list[float]:
  """The bytes sent after each step of a trainer's run (``result``, with settings ``s``):
  :func:`step_bytes` of the step the algorithm's schedule runs at each step, plus with
  ``--exchange-device`` the mean exchange program's on each exchanging step. ``cost(by_axes,
  operands, exchange)``: the bytes of one execution (``exchange``: an exchange program's)."""
  steps, algorithm = result["collective_bytes"], ALGORITHMS[s.algorithm]
  program = step_bytes(steps, "exchange", cost, exchange=True) if "exchange" in steps else 0.0
  sent, cumulative = 0.0, []
  for t in range(1, s.steps + 1):
    flag = algorithm.communicates(s, t)
    kind = "communication_step" if flag else "non_communication_step"
    sent += step_bytes(steps, "every_step" if "every_step" in steps else kind, cost)
    sent += program if flag else 0.0
    cumulative.append(sent)
  return cumulative


def initial_params(task: Any, train: Mapping[str, Any], seed: int = 0) -> Any:
  """``task``'s initial params (one worker's, NumPy) for its training arrays ``train``."""
  example = tuple((k, (1,) + v.shape[1:], str(v.dtype)) for k, v in train.items())
  return runs.initial_params(task, seed, example)


def num_params(params: Any) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def tree_bytes(tree: Any) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def machine() -> dict[str, str]:
  """The CPU model (``/proc/cpuinfo``), the core count and the memory (``/proc/meminfo``)."""

  def read(path: str, key: str) -> str | None:
    with contextlib.suppress(OSError), open(path) as f:
      return next((x.split(":", 1)[1].strip() for x in f if x.startswith(key)), None)
    return None

  memory = read("/proc/meminfo", "MemTotal")
  return {"cpu": read("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
          "cores": str(os.cpu_count()),
          "memory": "unknown" if memory is None else f"{int(memory.split()[0]) / 2**20:.1f} GiB"}


def versions() -> dict[str, str]:
  return {"python": platform.python_version(), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "optax": optax.__version__, "flax": flax.__version__,
          "numpy": np.__version__}


def load_average() -> str:
  """The 1-, 5- and 15-minute load averages, as ``uptime`` prints them."""
  return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def load_text(result: Mapping[str, Any], cpu: bool = True) -> str:
  """``Load average B before, A after (N CPUs, MODEL); M min.`` of a result (``machine``: this
  one's if it has none; ``cpu``: the model named)."""
  m = result.get("machine") or machine()
  cpus = f"{m['cores']} CPUs" + (f", {m['cpu']}" if cpu else "")
  return (f"Load average {result['load_before']} before, {result['load_after']} after ({cpus});"
          f" {result['wall_s'] / 60:.1f} min.")


def now() -> str:
  """The UTC date and time to the minute, e.g. ``2026-11-25 08:52 UTC``."""
  return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


median = statistics.median


class Timed:
  """The wall-clock seconds and the load average around a ``with`` block (``record()``)."""

  def __enter__(self) -> Timed:
    self.start, self.load_before = time.perf_counter(), load_average()
    return self

  def __exit__(self, *exc: Any) -> None:
    self.seconds, self.load_after = time.perf_counter() - self.start, load_average()

  def record(self) -> dict[str, Any]:
    return {"load_before": self.load_before, "load_after": self.load_after, "wall_s": self.seconds}


def option(default: Any, help: str, **argparse_kwargs: Any) -> Any:
  """A field of a study's ``Config``: its default, and its flag's help and argparse keywords."""
  return dataclasses.field(default=default, metadata={"help": help, **argparse_kwargs})


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
  """A Markdown table; ``align``: ``l`` or ``r`` per column (default: ``l`` then ``r``)."""
  align = align or "l" + "r" * (len(header) - 1)
  rows = [header, ["---:" if a == "r" else "---" for a in align], *rows]
  return "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in rows)


def blocks(*parts: str) -> str:
  return "\n\n".join(parts)


def fmt(x: Any, spec: str = "", missing: str = "—") -> str:
  return missing if x is None else format(x, spec)


def spread(values: Sequence[Any], spec: str) -> str:
  """``median [min, max]`` of ``values`` in ``spec`` (alone if all agree; a dash: one missing)."""
  if not values or None in values:
    return "—"
  median, low, high = (format(v, spec) for v in (np.median(values), min(values), max(values)))
  return median if low == high else f"{median} [{low}, {high}]"


def reach(curve: Sequence[float], target: float, *xs: Sequence[float]) -> tuple[float, ...] | None:
  """Where ``curve`` first comes down to ``target``: each of ``xs`` (its abscissas, e.g. steps
  and bytes) there, linear between the two points around it; ``None`` if it never does."""
  for i, y in enumerate(curve):
    if y <= target:
      if i == 0:
        return tuple(x[0] for x in xs)
      f = (curve[i - 1] - target) / (curve[i - 1] - y)
      return tuple(x[i - 1] + f * (x[i] - x[i - 1]) for x in xs)
  return None


def loads(before: str, after: str) -> str:
  """``B → A``: the 1-minute load averages of ``before`` and ``after`` (``uptime``'s text)."""
  return f"{before.split(',')[0]} → {after.split(',')[0]}"


def run_line(result: Mapping[str, Any], load: bool = False) -> list[str]:
  """``[Run DATE: `COMMAND`, S s.]`` of the driver's record of the run (``load``: with its 1-minute
  load averages before → after); ``[]`` without one."""
  r = result.get("run")
  return [f"Run {r['date']}: `{r['command']}`, {r['seconds']:.0f} s" + (
    f", load {loads(r['load_before'], r['load_after'])}." if load else ".")] if r else []


def mib(nbytes: float) -> str:
  return f"{nbytes / 2**20:.1f}"


def human_bytes(nbytes: float) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(nbytes) >= scale:
      return f"{nbytes / scale:,.1f} {unit}"
  return f"{nbytes:.0f} B"


def doc_markdown(doc: str, first: int, last: int | None = None) -> str:
  """Paragraphs ``first`` to ``last`` of a module docstring as Markdown (bullets kept)."""
  paragraphs, out = doc.strip().split("\n\n")[first:None if last is None else last + 1], []
  for p in paragraphs:
    bulleted = p.lstrip().startswith("* ")
    items = re.split(r"\n\s*\* ", "\n" + p.strip()) if bulleted else [p]
    items = [" ".join(i.split()) for i in items if i.strip()]
    out.append("\n".join(f"- {i}" for i in items) if len(items) > 1 or bulleted else items[0])
  text = "\n\n".join(out).replace("``", "`")
  return re.sub(r":(?:func|class|mod|data|meth):`~?([^`]+)`", r"`\1`", text)


def read_json(path: str, lines: bool = False) -> Any:
  """The value of the JSON file ``path``; ``lines``: the values of a JSONL file, one a line."""
  with open(path) as f:
    return [json.loads(x) for x in f] if lines else json.load(f)


def write_json(path: str, value: Any, lines: bool = False) -> None:
  """Writes ``value`` to ``path`` whole or not at all (a stopped study leaves no half file);
  ``lines``: a list, as JSONL (one value a line)."""
  with open(path + ".tmp", "w") as f:
    f.write("".join(json.dumps(x, default=str) + "\n" for x in value) if lines
            else json.dumps(value, indent=1, default=str))
  os.replace(path + ".tmp", path)


def save_figure(fig: Any, path: str, title: str | None = None, grid: bool = False) -> None:
  """Saves ``fig`` (with its ``title`` above its plots, if given; ``grid``: a light grid on each
  of its plots) to ``path`` and closes it."""
  for ax in fig.axes if grid else ():
    ax.grid(True, alpha=0.3)
  if title is not None:
    fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
