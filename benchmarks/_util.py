"""Helpers shared by the benchmark sections: the machine, timing, statistics and tables."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def machine() -> dict[str, str]:
  """The CPU model (``/proc/cpuinfo``), the core count and the memory (``/proc/meminfo``)."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  memory = "unknown"
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal"):
          memory = f"{int(line.split()[1]) / 2**20:.1f} GiB"
          break
  except OSError:
    pass
  return {"cpu": cpu, "cores": str(os.cpu_count()), "memory": memory}


def versions() -> dict[str, str]:
  """The versions of Python and of the libraries the measurements depend on."""
  import flax
  import jax
  import jaxlib
  import numpy
  import optax

  return {
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "optax": optax.__version__,
    "flax": flax.__version__,
    "numpy": numpy.__version__,
  }


def load_average() -> str:
  """The 1-, 5- and 15-minute load averages, as ``uptime`` prints them."""
  try:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())
  except OSError:
    return "unknown"


def now() -> str:
  """The UTC date and time to the minute, e.g. ``2026-11-25 08:52 UTC``."""
  return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def median(xs: Sequence[float]) -> float:
  return statistics.median(xs)


def time_call(fn: Callable[[], Any]) -> float:
  """Seconds of one call of ``fn``, waiting for its results to be ready."""
  import jax

  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
  """A Markdown table; ``align`` is one character per column, ``l`` or ``r`` (default: ``l`` then
  ``r``)."""
  align = align or "l" + "r" * (len(header) - 1)
  rule = ["---:" if a == "r" else "---" for a in align]
  lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def mib(nbytes: float) -> str:
  return f"{nbytes / 2**20:.1f}"


def human_bytes(nbytes: float) -> str:
  """``nbytes`` in B, KiB, MiB or GiB, one decimal."""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(nbytes) >= scale:
      return f"{nbytes / scale:,.1f} {unit}"
  return f"{nbytes:.0f} B"


def write_report(result: Any, prefix: str, plot: Callable[[Any, str], None],
                 markdown: Callable[[Any, str], str]) -> str:
  """Draws ``plot(result, PREFIX.png)``, writes ``markdown(result, "PREFIX.png")`` (the figure
  named relative to the Markdown) to ``PREFIX.md`` and returns that Markdown."""
  plot(result, f"{prefix}.png")
  text = markdown(result, os.path.basename(f"{prefix}.png"))
  with open(f"{prefix}.md", "w") as f:
    f.write(text + "\n")
  return text


def doc_markdown(doc: str, first: int, last: int | None = None) -> str:
  """Paragraphs ``first`` to ``last`` of a module docstring as Markdown (bullets kept)."""
  import re

  paragraphs = doc.strip().split("\n\n")[first:None if last is None else last + 1]
  out = []
  for p in paragraphs:
    items = re.split(r"\n\s*\* ", "\n" + p.strip()) if p.lstrip().startswith("* ") else [p]
    items = [" ".join(i.split()) for i in items if i.strip()]
    out.append("\n".join(f"- {i}" for i in items) if len(items) > 1 or p.lstrip().startswith(
      "* ") else items[0])
  text = "\n\n".join(out).replace("``", "`")
  return re.sub(r":(?:func|class|mod|data|meth):`~?([^`]+)`", r"`\1`", text)
