"""Step-time overhead and memory of each wrapper against the bare inner optimizer (adam).

One worker: every step is ``jax.shard_map``'ed over a one-device mesh with axis ``"w"``, so each
wrapper runs its own code path with the axis bound (its collectives over one device, its
``lax.cond`` a real conditional, not the ``select`` ``vmap`` would turn it into). A step is the
whole training step of a Flax MLP (forward, backward, optimizer update, ``apply_updates``), jitted
with the params and the optimizer state donated. The communicating wrappers are measured on their
communication and non-communication steps separately: before every call, the step counter is set
so that the call is the one wanted.

Timing: every round runs the bare-adam step, then one wrapper's step, then adam again, and so on
through every wrapper (in a random order each round, seeded), so that each wrapper call sits
between two adam calls; its ratio for the round is its time over the mean of those two. The
ratio reported is the median over the rounds; the times are medians too.

Memory: the optimizer state's bytes (the sum of its leaves' ``nbytes``) against the params'
bytes and against what the algorithm needs, and XLA's compiled memory analysis of the step, with
and without donation.
"""

from __future__ import annotations

import dataclasses
import re
import time
import warnings
from typing import Any

import _util
import numpy as np

AXIS = "w"
FEATURES = 784
CLASSES = 10
BATCH = 128
LEARNING_RATE = 1e-3
PERIOD = 10
EVERY_K = 4
SIZES = (("≈1M", (1024, 256)), ("≈10M", (2048, 2048, 2048)))
"""The MLPs: 784 inputs, these hidden widths (relu), 10 outputs."""

TARGET = 1.05


@dataclasses.dataclass
class Variant:
  """One wrapper and the steps of it to time."""

  name: str
  label: str
  make: Any  # adam -> transformation
  needed: float  # state bytes the algorithm needs, in params' bytes (adam: 2)
  need_note: str
  counter: str | None = None  # the state field that selects the kind of step
  phases: tuple[tuple[str, int | None, bool], ...] = (("every step", None, False),)
  grad_step: bool = False


def variants() -> list[Variant]:
  import optax_dist

  comm = (("non-communication step", 0, False), ("communication step", PERIOD - 1, True))
  return [
    Variant("moving_average", "moving_average(adam, 0.999)",
            lambda adam: optax_dist.moving_average(adam, 0.999), 3, "adam 2× + EMA 1×"),
    Variant("elastic_average", f"elastic_average(adam, τ={PERIOD})",
            lambda adam: optax_dist.elastic_average(
              adam, communication_period=PERIOD, axis_name=AXIS),
            3, "adam 2× + center 1×", counter="local_step", phases=comm),
    Variant("agn", f"agn(adam, τ={PERIOD})",
            lambda adam: optax_dist.agn(adam, communication_period=PERIOD, axis_name=AXIS),
            6, "adam 2× + center 1× + accumulator 1× + center's adam 2×",
            counter="local_step", phases=comm),
    Variant("drop_stale_gradients", "drop_stale_gradients(adam, 2)",
            lambda adam: optax_dist.drop_stale_gradients(adam, 2), 2, "adam 2×",
            phases=(("every step (accepted)", None, False),), grad_step=True),
    Variant("tower", "tower(adam)", lambda adam: optax_dist.tower(adam, AXIS), 2, "adam 2×",
            phases=(("every step (all-reduce)", None, True),)),
    Variant("apply_if_finite", "apply_if_finite(adam, 3)",
            lambda adam: optax_dist.apply_if_finite(adam, 3, axis_name=AXIS), 2, "adam 2×",
            phases=(("every step (pmax of a flag)", None, True),)),
    Variant("accumulate_then_reduce", f"accumulate_then_reduce(adam, k={EVERY_K})",
            lambda adam: optax_dist.accumulate_then_reduce(adam, EVERY_K, AXIS), 3,
            "adam 2× + accumulator 1×", counter="mini_step",
            phases=(("accumulating micro-step", 0, False),
                    ("reducing micro-step", EVERY_K - 1, True))),
  ]


_COPY = re.compile(r"=\s*([a-z][a-z0-9]*)\[([\d,]*)\]\S*\s+copy\(")


def copy_bytes(compiled) -> int:
  """Bytes written by the ``copy`` instructions of a compiled program (every computation)."""
  total = 0
  for dtype, dims in _COPY.findall(compiled.as_text()):
    size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    bits = 8 if dtype == "pred" else int(re.sub(r"[a-z]", "", dtype) or 32)
    total += size * bits // 8
  return total


def _tree_bytes(tree: Any) -> int:
  import jax

  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


class Problem:
  """The MLP of one size on a one-device mesh, its data, and step builders.

  Every array is placed with ``P("w")`` (scalars with ``P()``): on a one-device mesh each worker
  holds the whole array, typed varying over ``"w"`` as a worker's own params are. (Stacking a
  leading worker axis of size 1 instead makes XLA copy the donated params and adam's moments on
  every step.)
  """

  def __init__(self, hidden: tuple[int, ...], seed: int = 0):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from optax_dist.cli.models import MLP

    self.hidden = hidden
    self.model = MLP(hidden, CLASSES)
    self.mesh = Mesh(np.array(jax.devices()[:1]), (AXIS,))
    init = jax.jit(lambda key: self.model.init(key, jnp.zeros((1, FEATURES)))["params"])
    self.np_params = jax.device_get(init(jax.random.key(seed)))
    rng = np.random.default_rng(seed)
    self.x = self.put(rng.normal(size=(BATCH, FEATURES)).astype(np.float32))
    self.y = self.put(rng.integers(0, CLASSES, size=BATCH).astype(np.int32))
    self.num_params = sum(x.size for x in jax.tree.leaves(self.np_params))
    self.params_bytes = _tree_bytes(self.np_params)

  def spec(self, tree):
    import jax
    from jax.sharding import PartitionSpec as P

    return jax.tree.map(lambda x: P(AXIS) if np.ndim(x) else P(), tree)

  def put(self, tree):
    """``tree`` placed on the mesh (a fresh buffer per leaf)."""
    import jax
    from jax.sharding import NamedSharding

    return jax.tree.map(
      lambda a, s: jax.device_put(np.asarray(a), NamedSharding(self.mesh, s)),
      tree, self.spec(tree))

  def abstract(self, tree):
    import jax
    from jax.sharding import NamedSharding

    return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=NamedSharding(self.mesh, s)),
      tree, self.spec(tree))

  def state_shape(self, tx):
    import jax

    return jax.eval_shape(tx.init, self.np_params)

  def init(self, tx):
    """The optimizer state of ``tx`` for the initial params, as each worker initialises it."""
    import jax

    params = self.put(self.np_params)
    init = jax.shard_map(tx.init, mesh=self.mesh, in_specs=(self.spec(params),),
                         out_specs=self.spec(self.state_shape(tx)))
    return jax.jit(init)(params)

  def step(self, tx, *, grad_step: bool = False, donate: bool = True):
    """The jitted training step ``(params, opt_state, x, y) -> (params, opt_state, loss)``."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    model = self.model

    def loss_fn(params, x, y):
      logits = model.apply({"params": params}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step_fn(params, opt_state, x, y):
      loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
      kwargs = {"grad_step": opt_state.global_step} if grad_step else {}
      updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
      params = optax.apply_updates(params, updates)
      return params, opt_state, loss[None]

    params_spec = self.spec(self.np_params)
    state_spec = self.spec(self.state_shape(tx))
    mapped = jax.shard_map(
      step_fn, mesh=self.mesh,
      in_specs=(params_spec, state_spec, P(AXIS), P(AXIS)),
      out_specs=(params_spec, state_spec, P(AXIS)),
    )
    return jax.jit(mapped, donate_argnums=(0, 1) if donate else ())

  def compiled(self, tx, *, grad_step: bool = False, donate: bool = True):
    """``tx``'s step compiled ahead of time for this problem, and a fresh optimizer state."""
    state = self.init(tx)
    step = self.step(tx, grad_step=grad_step, donate=donate).lower(
      self.abstract(self.np_params), self.abstract(state), self.x, self.y).compile()
    return step, state


class Runner:
  """Calls one compiled step on its own params and state, as a training loop would."""

  def __init__(self, problem: Problem, step, state, counter=None, value=None):
    self.problem, self.step, self.state = problem, step, state
    self.params = problem.put(problem.np_params)
    self.counter, self.value = counter, value

  def __call__(self) -> tuple[float, float]:
    """Runs one step; returns its wall-clock and process CPU seconds."""
    import jax

    state = self.state
    if self.counter is not None:  # the step counter that makes this call the one wanted
      fresh = self.problem.put(np.int32(self.value))
      state = state._replace(**{self.counter: jax.block_until_ready(fresh)})
    start, cpu = time.perf_counter(), time.process_time()
    params, state, _ = self.step(self.params, state, self.problem.x, self.problem.y)
    jax.block_until_ready((params, state))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    self.params, self.state = params, state
    return elapsed, cpu


def measure(rounds: dict[str, int], seed: int = 0) -> dict[str, Any]:
  """Times every wrapper's steps against adam's and analyses their memory, for every size."""
  import optax

  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  adam = optax.adam(LEARNING_RATE)
  out = {"sizes": [], "memory": {}, "rounds": rounds}
  for size_name, hidden in SIZES:
    problem = Problem(hidden, seed)
    with_memory = size_name == SIZES[-1][0]
    compile_start = time.perf_counter()
    baseline = Runner(problem, *problem.compiled(adam))
    runners = []  # (variant, phase, communicates, runner)
    memory_rows = []
    if with_memory:
      memory_rows.append(_memory_row("adam (bare)", 2, "adam 2×", problem, adam, False,
                                     baseline.step))
    for v in variants():
      tx = v.make(adam)
      step, state = problem.compiled(tx, grad_step=v.grad_step)
      copies = copy_bytes(step)
      for k, (phase, value, communicates) in enumerate(v.phases):
        state = state if k == 0 else problem.init(tx)
        runner = Runner(problem, step, state, v.counter, value)
        runner.copy_bytes = copies
        runners.append((v, phase, communicates, runner))
      if with_memory:
        memory_rows.append(_memory_row(v.label, v.needed, v.need_note, problem, tx, v.grad_step,
                                       step))
    baseline()  # warm up
    for *_, runner in runners:
      runner()
    compile_s = time.perf_counter() - compile_start

    rng = np.random.default_rng([seed, len(hidden)])
    n = len(runners)
    base_times = []
    times = [[] for _ in range(n)]  # (wall, cpu) per round
    ratios = [[] for _ in range(n)]  # (wall, cpu) per round
    load_before = _util.load_average()
    timing_start = time.perf_counter()
    for _ in range(rounds[size_name]):
      order = rng.permutation(n)
      previous = baseline()
      base_times.append(previous)
      for i in order:
        t = runners[i][3]()
        after = baseline()
        base_times.append(after)
        times[i].append(t)
        ratios[i].append(tuple(t[j] / (0.5 * (previous[j] + after[j])) for j in (0, 1)))
        previous = after
    rows = []
    for i, (v, phase, communicates, runner) in enumerate(runners):
      rows.append({
        "copy_bytes": runner.copy_bytes,
        "wrapper": v.name,
        "label": v.label,
        "phase": phase,
        "communicates": communicates,
        "wrapper_ms": 1e3 * _util.median([t[0] for t in times[i]]),
        "wrapper_cpu_ms": 1e3 * _util.median([t[1] for t in times[i]]),
        "ratio": _util.median([r[0] for r in ratios[i]]),
        "ratio_q1": float(np.percentile([r[0] for r in ratios[i]], 25)),
        "ratio_q3": float(np.percentile([r[0] for r in ratios[i]], 75)),
        "cpu_ratio": _util.median([r[1] for r in ratios[i]]),
      })
    out["sizes"].append({
      "size": size_name,
      "hidden": hidden,
      "num_params": problem.num_params,
      "params_bytes": problem.params_bytes,
      "adam_ms": 1e3 * _util.median([t[0] for t in base_times]),
      "adam_cpu_ms": 1e3 * _util.median([t[1] for t in base_times]),
      "adam_copy_bytes": copy_bytes(baseline.step),
      "rows": rows,
      "compile_s": compile_s,
      "timing_s": time.perf_counter() - timing_start,
      "load_before": load_before,
      "load_after": _util.load_average(),
    })
    if with_memory:
      out["memory"] = {"size": size_name, "num_params": problem.num_params,
                       "params_bytes": problem.params_bytes, "rows": memory_rows}
    del baseline, runners
  return out


def _memory_row(label, needed, need_note, problem, tx, grad_step, donated_step):
  """State bytes and the compiled step's memory analysis, with and without donation."""

  state_shape = problem.state_shape(tx)
  state_bytes = _tree_bytes(state_shape)
  row = {"label": label, "state_bytes": state_bytes, "needed": needed, "need_note": need_note,
         "excess_bytes": state_bytes - needed * problem.params_bytes}
  undonated_step = problem.step(tx, grad_step=grad_step, donate=False).lower(
    problem.abstract(problem.np_params), problem.abstract(state_shape), problem.x,
    problem.y).compile()
  for key, compiled in (("donated", donated_step), ("not_donated", undonated_step)):
    m = compiled.memory_analysis()
    row[key] = {
      "argument": m.argument_size_in_bytes,
      "output": m.output_size_in_bytes,
      "alias": m.alias_size_in_bytes,
      "temp": m.temp_size_in_bytes,
      "peak": m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
      + m.temp_size_in_bytes,
    }
  return row


def _verdict(ratios: list[float]) -> str:
  ok = [r <= TARGET for r in ratios]
  return "met" if all(ok) else "missed" if not any(ok) else "mixed"


def overhead_markdown(result: dict[str, Any]) -> str:
  sizes = result["sizes"]
  last = sizes[-1]
  header = ["wrapper", "step"]
  for s in sizes:
    header += [f"{s['size']} ms", f"{s['size']} wall ratio (IQR)", f"{s['size']} CPU ratio"]
  header += [f"{last['size']} copies MiB", f"≤ {TARGET}× (wall / CPU)"]
  base = ["bare adam", "every step"]
  for s in sizes:
    base += [f"{s['adam_ms']:.1f}", "1", "1"]
  base += [_util.mib(last["adam_copy_bytes"]), ""]
  rows = [base]
  for j, row in enumerate(sizes[0]["rows"]):
    cells = [f"`{row['label']}`", row["phase"]]
    for s in sizes:
      r = s["rows"][j]
      cells += [f"{r['wrapper_ms']:.1f}",
                f"**{r['ratio']:.3f}** ({r['ratio_q1']:.2f}–{r['ratio_q3']:.2f})",
                f"{r['cpu_ratio']:.3f}"]
    cells.append(_util.mib(last["rows"][j]["copy_bytes"]))
    if row["communicates"]:
      cells.append("n/a: communication step")
    else:
      wall = _verdict([s["rows"][j]["ratio"] for s in sizes])
      cpu = _verdict([s["rows"][j]["cpu_ratio"] for s in sizes])
      cells.append(f"{wall} / {cpu}")
    rows.append(cells)
  lines = [_util.table(header, rows, "ll" + "rrr" * len(sizes) + "rl"), ""]
  for s in sizes:
    lines.append(
      f"- {s['size']}: {s['num_params']:,} params ({_util.human_bytes(s['params_bytes'])}),"
      f" hidden {'-'.join(map(str, s['hidden']))}; bare adam {s['adam_ms']:.1f} ms wall,"
      f" {s['adam_cpu_ms']:.1f} ms CPU per step; {result['rounds'][s['size']]} rounds;"
      f" compile + warm-up {s['compile_s']:.0f} s, timing {s['timing_s']:.0f} s;"
      f" load average {s['load_before']} before, {s['load_after']} after."
    )
  return "\n".join(lines)


def memory_markdown(result: dict[str, Any]) -> str:
  mem = result["memory"]
  pb = mem["params_bytes"]
  header = ["optimizer", "state MiB", "state / params", "needed / params", "needed",
            "excess bytes", "peak MiB donated", "peak MiB not donated",
            "arg + out + temp MiB donated",
            "temp MiB donated", "temp MiB not donated"]
  rows = []
  for r in mem["rows"]:
    rows.append([
      f"`{r['label']}`", _util.mib(r["state_bytes"]), f"{r['state_bytes'] / pb:.4f}",
      f"{r['needed']}", r["need_note"], f"{r['excess_bytes']:,}",
      _util.mib(r["donated"]["peak"]), _util.mib(r["not_donated"]["peak"]),
      _util.mib(r["donated"]["peak"] + r["donated"]["alias"]),
      _util.mib(r["donated"]["temp"]), _util.mib(r["not_donated"]["temp"]),
    ])
  return _util.table(header, rows, "lrrrlrrrrrr")
