"""The chaos study's accounting: pure functions of the runs' records (the package's docstring
defines each number)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from optax_dist.fault_tolerance.rundir import by_round

FAULTS = ("kill", "stop", "link", "lighthouse")
# The events after which a fault's replica can run again: a new process, SIGCONT, link up; in
# the synchronous arm its command's resume (a stop outlasting its heartbeat timeout ends it).
BACK = {"kill": ("start",), "stop": ("cont",), "link": ("up",)}
SYNC_BACK = {"kill": ("resume",), "stop": ("cont", "resume")}
UNPROVOKED_S = 20.0  # a heal without an event of its replica's in these seconds: a cascade's mark


def applied(events: list[list[Any]], span: float) -> dict[str, int]:
  """The applied faults with ``0 < t <= span``, by kind (:data:`FAULTS`), and ``unapplied``."""
  return {kind: sum(e[1] == kind and 0 < e[0] <= span for e in events)
          for kind in (*FAULTS, "unapplied")}


def returns(events: list[list[Any]], own: Callable[[int], Sequence[float]],
            commits: Sequence[float] | None,
            back: dict[str, tuple[str, ...]] = BACK) -> list[dict[str, Any]]:
  """Per applied fault with a return (``back``'s first event after it on its replica or on -1) and
  a commit after that (``own(replica)``): ``seconds`` between, ``rounds`` of ``commits`` between,
  and ``heal`` (seconds) and ``heal_rounds``: from the replica's ``ready`` mark between, split
  off as ``startup`` (a restart, or a stop or cut that fell in a restart's start-up), else from
  the return (none for a kill without a ready mark)."""
  out = []
  for at, kind, replica, _ in events:
    back_at = next((e[0] for e in events if e[1] in back.get(kind, ()) and e[2] in (replica, -1)
                    and e[0] >= at), math.inf)
    if (first := next((t for t in own(replica) if t > back_at), None)) is not None:
      ready = next((e[0] for e in events if e[1] == "ready" and e[2] == replica and
                    back_at <= e[0] <= first), None)
      start, split = (back_at, kind != "kill") if ready is None else (ready, True)
      out.append({"kind": kind, "seconds": first - back_at, "rounds": None if commits is None
                  else sum(back_at <= c < first for c in commits),
                  "startup": None if ready is None else ready - back_at,
                  "heal": first - start if split else None, "heal_rounds": None if commits is None
                  or not split else sum(start <= c < first for c in commits)})
  return out


def p95(returned: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
  """The 95th percentile of each of :func:`returns`' figures with values, and ``n``, by kind."""
  rows = {kind: [r for r in returned if r["kind"] == kind] for kind in BACK}
  return {kind: {"n": len(got)} | {key: float(np.percentile(values, 95)) for key in (
    "seconds", "rounds", "startup", "heal", "heal_rounds") if (values := [
      r[key] for r in got if r[key] is not None])} for kind, got in rows.items()}


def accounting(run: dict[str, Any], span: float) -> dict[str, Any]:
  """A fault-tolerant run's numbers over its first ``span`` seconds."""
  lines, t0, events = run["lines"], run["t0"], run["events"]
  rounds = by_round(lines)
  commits = sorted({max(x["time"] for x in group if x["committed"]) - t0
                    for group in rounds.values() if any(x["committed"] for x in group)})
  ends = {r: max(x["time"] for x in g) for r, g in rounds.items()}
  size = {r: sum(x["committed"] for x in g) for r, g in rounds.items()}
  full = [ends[r] - ends[r - 1] for r in ends if r - 1 in ends and size[r] == max(size.values())]
  own = {i: [x["time"] - t0 for x in lines if x["replica"] == i and x["committed"]]
         for i in {x["replica"] for x in lines}}
  return {
    # the weights of the committed lines after the first commit (the clock's origin)
    "committed_tokens": sum(x["weight"] for x in lines if x["committed"] and
                            t0 < x["time"] <= t0 + span),
    "rounds_committed": len(commits),
    "rounds_aborted": sum(not any(x["committed"] for x in g) for g in rounds.values()),
    "abort_lines": sum(not x["committed"] for x in lines),
    "rounds_retried": sum(any(x["committed"] and x.get("attempts", 1) > 1 for x in g)
                          for g in rounds.values()),
    "hash_mismatches": sum(len({x["state_hash"] for x in g if x["committed"]}) > 1
                           for g in rounds.values()),
    "longest_stall_s": float(max(np.diff(commits), default=0.0)),
    "heals": sum(x["healed"] for x in lines), "unprovoked_heals": sum(x["healed"] and not any(
      i in (x["replica"], -1) and kind != "unapplied" and
      0 <= x["time"] - t0 - at <= UNPROVOKED_S for at, kind, i, _ in events) for x in lines),
    # the pace of a round that every replica committed: a drift between the runs shows here
    "full_round_s": float(np.median(full)) if full else None,
    "returns": returns([e for e in events if e[0] <= span], lambda i: own.get(i, []), commits),
    "applied": applied(events, span), "timeline": _timeline(lines, t0),
    "standby_cpu_s": run.get("standby_cpu_s", 0.0),
    # each checkpoint's [seconds after t0, committed tokens up to its step, held-out metric]
    "curve": [[p["time"] - t0, sum(x["weight"] for x in lines if x["committed"] and x["step"] <=
                                   p["step"]), final_metric([p])] for p in run.get("curve", [])]}


def final_metric(final: list[dict[str, Any]]) -> float | None:
  """The mean of the ``test_`` values of ``final`` (the replicas' evaluations), or ``None``."""
  values = [v for line in final for k, v in line.items() if k.startswith("test_")]
  return float(np.mean(values)) if values else None


def second_half_gap(control: list[list[float]], faulted: list[list[float]]) -> float | None:
  """The median, over the second half of ``faulted``'s checkpoints, of its metric over the
  ``control`` curve's interpolated at equal tokens, minus 1; ``None`` without both."""
  if not (control and faulted):
    return None
  curve = np.array(control)
  return float(np.median([m / np.interp(tokens, curve[:, 1], curve[:, 2]) - 1
                          for _, tokens, m in faulted[len(faulted) // 2:]]))


def _timeline(lines: list[dict[str, Any]], t0: float, points: int = 400) -> list[list[float]]:
  """``[seconds after t0, committed tokens so far]`` at about ``points`` committed lines."""
  done = [(x["time"] - t0, x["weight"]) for x in lines if x["committed"] and x["time"] > t0]
  total = np.cumsum([w for _, w in done])
  keep = sorted(set(range(0, len(done), max(1, len(done) // points))) | {len(done) - 1})
  return [[done[i][0], float(total[i])] for i in keep if i >= 0]


def compare(control: dict[str, Any], faulted: dict[str, Any]) -> dict[str, Any]:
  """Both runs' accounting over the span both ran (to the last line), the second-half gap."""
  span = min(max(x["time"] for x in run["lines"]) - run["t0"] for run in (control, faulted))
  a, b = accounting(control, span), accounting(faulted, span)
  return {"span_s": span, "control": a, "faulted": b,
          "second_half_gap": second_half_gap(a["curve"], b["curve"])}


def figures(faulted: dict[str, Any], control: dict[str, Any], span: float) -> dict[str, Any]:
  """An arm's figures from its runs' accounting over ``span`` seconds: the goodput (committed
  tokens over the control's), the applied faults per minute, the work lost per applied fault
  (``(1 - goodput) * span / faults`` seconds), the returns' p95, the hash mismatches."""
  goodput = faulted["committed_tokens"] / control["committed_tokens"]
  faults = sum(faulted["applied"][k] for k in FAULTS)
  return {"goodput": goodput, "applied": faulted["applied"], "per_minute": faults / span * 60,
          "lost_per_fault_s": (1 - goodput) * span / faults if faults else None,
          "returns": p95(faulted["returns"]), "longest_stall_s": faulted["longest_stall_s"],
          "hash_mismatches": faulted.get("hash_mismatches")}


def sync_accounting(run: dict[str, Any], span: float, tokens_per_step: float) -> dict[str, Any]:
  """The synchronous arm's numbers over its first ``span`` seconds: its checkpoints' steps past
  the first (the clock's origin) times ``tokens_per_step``, the longest gap between checkpoints
  (the span's end included), a return to the next checkpoint."""
  saved = [(t - run["t0"], step) for t, step in run["saved"] if t - run["t0"] <= span]
  first, events = saved[0][1], [e for e in run["events"] if e[0] <= span]
  return {"committed_tokens": (saved[-1][1] - first) * tokens_per_step,
          "restarts": sum(e[1] == "exit" for e in events),
          "longest_stall_s": float(max(np.diff([t for t, _ in saved] + [span]))),
          "timeline": [[t, (step - first) * tokens_per_step] for t, step in saved],
          "applied": applied(events, span), "returns": returns(
            events, lambda _: [t for t, _ in saved], None, SYNC_BACK)}
