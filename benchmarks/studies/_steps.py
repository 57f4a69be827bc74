"""The one hand-written training step of the benchmarks, and its interleaved timing.

``lm_overhead``, ``mlp_overhead`` and ``communication`` measure a transformation's *step* against
bare adam's with knobs the trainer (:func:`optax_dist.cli.trainer.train`: whole trainings of one
algorithm) does not expose: each call timed between two adam calls, the step counter set before
it (the communication step or not), the params and state donated or not, the axis bound
(``jax.shard_map``) or not, and the compiled program's memory analysis and collectives.
"""

from __future__ import annotations

import dataclasses
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import kit

AXIS = "w"

# XLA cannot use every buffer the steps donate, and JAX warns of it on every call.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


@dataclasses.dataclass
class Variant:
  """One transformation around adam, and its steps to time. ``phases``: ``(name, value of
  ``counter`` before the call or None, communicates, passes)``, ``passes`` the params-sized reads
  and writes the optimizer step must make (``None``: no bound given)."""

  name: str
  label: str
  make: Callable[[Any, str | None], Any]  # make(adam, axis_name)
  phases: tuple[tuple[str, int | None, bool, int | None], ...] = (
    ("every step", None, False, None),)
  counter: str = "local_step"
  grad_step: bool = False  # update takes the state's global_step
  why: str = ""  # why its step costs more than adam's
  hinted_why: str | None = None  # the same with the static communicate hint (None: not timed so)
  needed: float = 0.0  # the state bytes the algorithm needs, in params' bytes (need_note: which)
  need_note: str = ""

  def timed(self) -> Iterator[tuple[str, int | None, bool, int | None, bool | None]]:
    """``(phase, value, communicates, passes, hint)``: each phase with the counter rule, and
    (with ``hinted_why``) each again with the static hint."""
    for hinted in (False, True) if self.hinted_why is not None else (False,):
      for phase, value, communicates, passes in self.phases:
        yield (f"{phase}, hint" if hinted else phase), value, communicates, passes, (
          communicates if hinted else None)


class Problem:
  """One worker's ``params`` and ``loss_fn(params, *batch)`` (``None``: the batch is the gradients,
  the loss 0) over ``devices`` workers; ``batch``: the arrays of every worker, end to end. Every
  array is placed with ``P("w")`` (scalars with ``P()``): each leaf's first axis is the workers'
  blocks end to end, so nothing is reshaped; on one device each worker holds the whole array, typed
  varying over ``"w"`` as a worker's own params are (stacking a leading worker axis of size 1
  instead makes XLA copy the donated params and adam's moments on every step)."""

  def __init__(self, params: Any, loss_fn: Callable | None, batch: Sequence[np.ndarray],
               devices: int):
    self.params, self.loss_fn, self.n = params, loss_fn, devices
    self.mesh = Mesh(np.array(jax.devices()[:devices]), (AXIS,))
    self.batch = self.put(tuple(batch), tile=False)
    self.num_params, self.params_bytes = kit.num_params(params), kit.tree_bytes(params)

  def spec(self, tree: Any) -> Any:
    return jax.tree.map(lambda x: P(AXIS) if np.ndim(x) else P(), tree)

  def put(self, tree: Any, tile: bool = True) -> Any:
    """``tree`` on the devices; ``tile``: one worker's values repeated for every worker."""
    def one(x, s):
      x = np.concatenate([x] * self.n) if tile and np.ndim(x) else np.asarray(x)
      return jax.device_put(x, NamedSharding(self.mesh, s))

    return jax.tree.map(one, tree, self.spec(tree))

  def abstract(self, tree: Any, tile: bool = True) -> Any:
    k = self.n if tile else 1
    return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(((k * x.shape[0],) + x.shape[1:]) if x.ndim else (),
                                        x.dtype, sharding=NamedSharding(self.mesh, s)),
      tree, self.spec(tree))

  def init(self, tx: Any) -> Any:
    return self.put(jax.device_get(jax.jit(tx.init)(self.params)))

  def jitted(self, tx: Any, *, donate: bool = True, bound: bool = True, grad_step: bool = False,
             communicate: bool | None = None) -> Callable:
    """The jitted step ``(params, opt_state, *batch) -> (params, opt_state, loss)`` of ``tx``,
    ``shard_map``'ed over the mesh if ``bound`` (else one device, no axis)."""
    loss_fn = self.loss_fn

    def step(params, opt_state, *batch):
      loss, grads = ((jnp.zeros(()), batch[0]) if loss_fn is None
                     else jax.value_and_grad(loss_fn)(params, *batch))
      kwargs = {"grad_step": opt_state.global_step} if grad_step else {}
      kwargs |= {} if communicate is None else {"communicate": communicate}
      updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
      return optax.apply_updates(params, updates), opt_state, loss[None]

    if bound:
      specs = (self.spec(self.params), self.spec(jax.eval_shape(tx.init, self.params)))
      step = jax.shard_map(step, mesh=self.mesh, in_specs=(*specs, *[P(AXIS)] * len(self.batch)),
                           out_specs=(*specs, P(AXIS)))
    return jax.jit(step, donate_argnums=(0, 1) if donate else ())

  def arguments(self, tx: Any) -> tuple:
    """The step's arguments as ``jax.ShapeDtypeStruct``s."""
    return (self.abstract(self.params), self.abstract(jax.eval_shape(tx.init, self.params)),
            *self.abstract(self.batch, tile=False))

  def compiled(self, tx: Any, **kwargs: Any) -> Any:
    return self.jitted(tx, **kwargs).lower(*self.arguments(tx)).compile()


class Runner:
  """Calls one compiled step on its own params and state, ``counter`` set to ``value`` first."""

  def __init__(self, problem: Problem, step: Any, state: Any, counter: str | None = None,
               value: int | None = None):
    self.problem, self.step, self.state = problem, step, state
    self.params = problem.put(problem.params)
    self.counter, self.value = counter, value

  def __call__(self) -> tuple[float, float]:
    """Runs one step; returns its wall-clock and process CPU seconds."""
    if self.counter is not None:
      fresh = jax.block_until_ready(self.problem.put(np.int32(self.value)))
      self.state = self.state._replace(**{self.counter: fresh})
    start, cpu = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(self.step(self.params, self.state, *self.problem.batch))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    self.params, self.state = out[0], out[1]
    return elapsed, cpu


def interleaved(baseline: Runner, runners: Sequence[Runner], rounds: int,
                seed: Any) -> dict[str, Any]:
  """Times ``runners`` against ``baseline``: after a warm-up call of each, every round calls the
  baseline, then each runner (in a seeded random order) followed by the baseline again, so each
  call sits between two baseline calls; its ratio is its time over their mean. The medians over
  the rounds, in wall-clock and in process CPU time, with the interquartile range of the ratio."""
  for r in (baseline, *runners):
    r()
  rng = np.random.default_rng(seed)
  base, times, ratios = [], [[] for _ in runners], [[] for _ in runners]
  for _ in range(rounds):
    base.append(previous := baseline())
    for i in rng.permutation(len(runners)):
      t, after = runners[i](), baseline()
      base.append(after)
      times[i].append(t)
      ratios[i].append(tuple(t[j] / (0.5 * (previous[j] + after[j])) for j in (0, 1)))
      previous = after
  def ms(ts, j):
    return 1e3 * kit.median([t[j] for t in ts])

  return {"base_ms": ms(base, 0), "base_cpu_ms": ms(base, 1), "rows": [
    {"ms": ms(ts, 0), "cpu_ms": ms(ts, 1), "ratio": kit.median([r[0] for r in rs]),
     "q1": float(np.percentile([r[0] for r in rs], 25)),
     "q3": float(np.percentile([r[0] for r in rs], 75)),
     "cpu_ratio": kit.median([r[1] for r in rs])} for ts, rs in zip(times, ratios)]}


_COPY = re.compile(r"=\s*([a-z][a-z0-9]*)\[([\d,]*)\]\S*\s+copy\(")


def memory(compiled: Any) -> dict[str, int]:
  """XLA's temp bytes of ``compiled`` and the bytes written by ``copy`` in all its computations."""
  copies = 0
  for dtype, dims in _COPY.findall(compiled.as_text()):
    size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    bits = 8 if dtype == "pred" else int(re.sub(r"[a-z]", "", dtype) or 32)
    copies += size * bits // 8
  return {"temp": int(compiled.memory_analysis().temp_size_in_bytes), "copies": copies}


def time_variants(problem: Problem, adam: Any, variants: Sequence[Variant], rounds: int,
                  seed: Any, *, bound: bool = True, donate: bool = True) -> dict[str, Any]:
  """Compiles adam's step and each variant's (once per hint), times each phase against adam's
  (:func:`interleaved`); adam's times and memory, and a row per phase (``name``, ``label``,
  ``phase``, ``hint``, ``communicates``, ``sync_phase``, ``passes``, :func:`memory`, the timing)."""
  with kit.Timed() as compiling:
    base_step = problem.compiled(adam, donate=donate, bound=bound)
    baseline, runners, meta = Runner(problem, base_step, problem.init(adam)), [], []
    for v in variants:
      tx, steps = v.make(adam, AXIS if bound else None), {}  # one compiled step per hint value
      for phase, value, communicates, passes, hint in v.timed():
        if hint not in steps:
          steps[hint] = problem.compiled(tx, donate=donate, bound=bound, grad_step=v.grad_step,
                                         communicate=hint)
        runners.append(Runner(problem, steps[hint], problem.init(tx),
                              None if value is None else v.counter, value))
        meta.append({"name": v.name, "label": v.label, "phase": phase, "hint": hint,
                     "communicates": communicates, "sync_phase": communicates and value is not None,
                     "passes": passes, **memory(steps[hint])})
  with kit.Timed() as timing:
    t = interleaved(baseline, runners, rounds, seed)
  return {"adam_ms": t["base_ms"], "adam_cpu_ms": t["base_cpu_ms"],
          "adam_memory": memory(base_step), "rows": [m | r for m, r in zip(meta, t["rows"])],
          "compile_s": compiling.seconds, "timing_s": timing.seconds,
          "load_before": compiling.load_before, "load_after": timing.load_after}


def ratio_cell(row: dict[str, Any]) -> str:
  return f"**{row['ratio']:.3f}** ({row['q1']:.2f}–{row['q3']:.2f})"


def ratio_plot(groups: Sequence[tuple[str, Sequence[dict[str, Any]]]], target: float,
               xlabel: str, title: str, path: str) -> None:
  labels = [f"{r['label']}\n{r['phase']}" for r in groups[0][1]]
  y, height = np.arange(len(labels)), 0.8 / len(groups)
  fig, ax = kit.plt.subplots(figsize=(10, 0.45 * len(labels) + 1.5))
  for k, (name, rows) in enumerate(groups):
    err = [[r["ratio"] - r["q1"] for r in rows], [r["q3"] - r["ratio"] for r in rows]]
    ax.barh(y + k * height, [r["ratio"] for r in rows], height, xerr=err, label=name, alpha=0.8)
  ax.axvline(1.0, color="black", lw=0.8)
  ax.axvline(target, color="grey", lw=0.8, ls="--")
  ax.set_yticks(y + 0.4 - height / 2, labels, fontsize=7)
  ax.invert_yaxis()
  ax.set(xlim=(0.8, None), xlabel=xlabel)
  ax.legend(fontsize=7)
  ax.set_title(title, fontsize=9)
  kit.save_figure(fig, path)
