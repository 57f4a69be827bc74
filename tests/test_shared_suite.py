"""One suite run over every transformation and several inner optimizers.

Each case is a transformation built once from an inner optimizer; mapped cases run as two workers
under ``jax.vmap(..., axis_name=AXIS)``. The checks are the ones optax runs over all its optimizers:
jit without recompilation, stable state dtypes and shapes (also behind a data-dependent
``lax.cond``), composition with ``optax.chain``, ``optax.inject_hyperparams`` and
``optax.MultiSteps``, extra arguments, bfloat16, abstract init, ``optax.tree.map_params``; and
``eval_params``. References are computed by running the same transformation on hand-transformed
inputs (e.g. clipped gradients, averaged gradients), never from stored outputs.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist

AXIS = "workers"
N = 2  # workers in the mapped cases
LR = 0.1
STEPS = 4  # with communication_period=2: two communication steps


# ----------------------------------------------------------------------------------------------
# Inner optimizers and cases.

INNERS: dict[str, Callable[[Any], optax.GradientTransformation]] = {
  "sgd": lambda lr: optax.sgd(lr),
  "momentum": lambda lr: optax.sgd(lr, momentum=0.9),
  "adam": lambda lr: optax.adam(lr),
}
INNER_PARAM_COPIES = {"sgd": 0, "momentum": 1, "adam": 2, "none": 0}  # param-shaped state trees


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  build: Callable[..., optax.GradientTransformation]  # build(inner, **hparams)
  hparams: dict  # numeric hyperparameters (injectable by optax.inject_hyperparams)
  mapped: bool  # runs per worker under vmap(axis_name=AXIS)
  own_param_copies: int  # param-shaped trees in the wrapper's own state
  inner_states: int  # how many states of `inner` the wrapper keeps
  has_inner: bool = True
  averages: str | None = None  # field returned by eval_params

  def __str__(self):
    return self.name


CASES = [
  Case(
    "moving_average",
    lambda inner, decay: optax_dist.moving_average(inner, decay),
    {"decay": 0.9},
    mapped=False,
    own_param_copies=1,
    inner_states=1,
    averages="ema",
  ),
  Case(
    "elastic_average",
    lambda inner, communication_period, moving_rate, rho: optax_dist.elastic_average(
      inner, communication_period=communication_period, moving_rate=moving_rate, rho=rho
    ),
    {"communication_period": 2, "moving_rate": 0.2, "rho": 0.1},
    mapped=False,
    own_param_copies=1,
    inner_states=1,
    averages="center",
  ),
  Case(
    "elastic_average_vmap",
    lambda inner, communication_period, moving_rate, rho: optax_dist.elastic_average(
      inner,
      communication_period=communication_period,
      moving_rate=moving_rate,
      rho=rho,
      axis_name=AXIS,
    ),
    {"communication_period": 2, "moving_rate": 0.2, "rho": 0.1},
    mapped=True,
    own_param_copies=1,
    inner_states=1,
    averages="center",
  ),
  Case(
    "agn_sequential_vmap",
    lambda inner, communication_period: optax_dist.agn(
      inner, communication_period=communication_period, axis_name=AXIS
    ),
    {"communication_period": 2},
    mapped=True,
    own_param_copies=2,
    inner_states=2,
    averages="center",
  ),
  Case(
    "agn_mean_vmap",
    lambda inner, communication_period: optax_dist.agn(
      inner, communication_period=communication_period, center_update="mean", axis_name=AXIS
    ),
    {"communication_period": 2},
    mapped=True,
    own_param_copies=2,
    inner_states=2,
    averages="center",
  ),
  Case(
    "drop_stale_gradients",
    lambda inner, max_staleness: optax_dist.drop_stale_gradients(inner, max_staleness),
    {"max_staleness": 1},
    mapped=False,
    own_param_copies=0,
    inner_states=1,
  ),
  Case(
    "tower_vmap",
    lambda inner: optax_dist.tower(inner, AXIS),
    {},
    mapped=True,
    own_param_copies=0,
    inner_states=1,
  ),
  Case(
    "all_reduce_vmap",
    lambda inner: optax_dist.all_reduce(AXIS),
    {},
    mapped=True,
    own_param_copies=0,
    inner_states=0,
    has_inner=False,
  ),
  Case(
    "diloco_vmap",
    lambda inner, outer_learning_rate: optax_dist.diloco(
      inner,
      optax.sgd(outer_learning_rate, momentum=0.9, nesterov=True),
      sync_period=2,
      axis_name=AXIS,
    ),
    {"outer_learning_rate": 0.7},
    mapped=True,
    own_param_copies=2,  # anchor, outer momentum
    inner_states=1,
    averages="anchor",
  ),
  Case(
    "streaming_diloco_vmap",
    lambda inner, outer_learning_rate, mixing: optax_dist.streaming_diloco(
      inner,
      optax.sgd(outer_learning_rate, momentum=0.9, nesterov=True),
      sync_period=2,
      num_fragments=2,
      fragments={"w": 0, "b": 1},
      mixing=mixing,
      axis_name=AXIS,
    ),
    {"outer_learning_rate": 0.7, "mixing": 0.5},
    mapped=True,
    own_param_copies=2,  # anchor, and the fragments' outer momenta (one copy together)
    inner_states=1,
    averages="anchor",
  ),
  Case(
    "local_sgd_vmap",
    lambda inner: optax_dist.local_sgd(inner, sync_period=2, warmup_steps=1, axis_name=AXIS),
    {},
    mapped=True,
    own_param_copies=0,
    inner_states=1,
  ),
]
CASE_IDS = [c.name for c in CASES]

CASE_INNER = [
  pytest.param(case, inner, id=f"{case.name}-{inner}")
  for case in CASES
  for inner in (INNERS if case.has_inner else ["none"])
]


def rotated(offset: int):
  """Each case once, with the inners assigned in rotation (shifted by ``offset``).

  The composition tests compile two programs each; running every case with one inner, rotated
  so that over the tests below every case meets every inner, keeps the suite fast.
  """
  names = list(INNERS)
  return [
    pytest.param(
      case,
      names[(i + offset) % len(names)] if case.has_inner else "none",
      id=f"{case.name}-{names[(i + offset) % len(names)] if case.has_inner else 'none'}",
    )
    for i, case in enumerate(CASES)
  ]


def make_inner(inner_name: str, lr=LR):
  return None if inner_name == "none" else INNERS[inner_name](lr)


def build(case: Case, inner_name: str) -> optax.GradientTransformation:
  return case.build(make_inner(inner_name), **case.hparams)


def build_injected(case: Case, inner_name: str) -> optax.GradientTransformation:
  """The same transformation with its numeric hyperparameters and the inner LR injected."""
  names = ["learning_rate", *case.hparams]

  def factory(**kwargs):
    learning_rate = kwargs.pop("learning_rate")
    return case.build(make_inner(inner_name, learning_rate), **kwargs)

  factory.__signature__ = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names]
  )
  return optax.inject_hyperparams(factory)(learning_rate=LR, **case.hparams)


# ----------------------------------------------------------------------------------------------
# Data and drivers.


def make_params(case: Case, dtype=jnp.float32):
  params = {
    "w": np.linspace(-1.0, 1.0, 6).reshape(2, 3),
    "b": np.array([0.5, -0.25, 2.0]),
  }
  if case.mapped:  # every worker starts from the same params
    params = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), params)
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def make_grads(case: Case, steps=STEPS, dtype=jnp.float32, seed=0):
  rng = np.random.RandomState(seed)
  lead = (steps, N) if case.mapped else (steps,)
  grads = {"w": 2.0 * rng.randn(*lead, 2, 3), "b": 2.0 * rng.randn(*lead, 3)}
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), grads)


def per_worker(case: Case, fn):
  return jax.vmap(fn, axis_name=AXIS) if case.mapped else fn


def step_at(grads, t):
  return jax.tree.map(lambda g: g[t], grads)


def make_run(case: Case, tx: optax.GradientTransformation, **extra_args):
  """A driver: init, then one update per leading entry of ``grads`` (a ``lax.scan``).

  Returns ``run(params, grads) -> (updates per step, final params, final state)``; unjitted,
  so that a test can compile it together with its reference in one program.
  """

  def update(g, s, p):
    return tx.update(g, s, p, **extra_args)

  def run(params, grads):
    state = per_worker(case, tx.init)(params)

    def step(carry, g):
      p, s = carry
      u, s = per_worker(case, update)(g, s, p)
      return (optax.apply_updates(p, u), s), u

    (params, state), updates = jax.lax.scan(step, (params, state), grads)
    return updates, params, state

  return run


def shapes_and_dtypes(tree):
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


def assert_trees_close(a, b, rtol=1e-6, atol=1e-6):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(
      np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol
    )


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def compiled_together(computations):
  """``{key: (fn, args)}`` -> ``{key: fn(*args)}``, every ``fn`` traced into one jitted program:
  one compilation for all the cases of a test instead of one per case."""
  keys = list(computations)
  fns = [computations[k][0] for k in keys]
  results = jax.jit(lambda args: [fn(*a) for fn, a in zip(fns, args, strict=True)])(
    [computations[k][1] for k in keys])
  return dict(zip(keys, results, strict=True))


def each_case(params):
  """``(case, inner)`` of each ``pytest.param`` of a parametrization above."""
  return [p.values for p in params]


# ----------------------------------------------------------------------------------------------
# jit, recompilation, dtype and shape stability.


@pytest.fixture(scope="module")
def jitted_steps():
  """Every case's step (one jitted function for all of them, built once), called ``STEPS``
  times from ``tx.init``: per case its initial state and each call's ``(params, state,
  updates)``; and the step's traces and compiled programs. A case whose state or updates came
  out with another shape or dtype than it went in with would trace the step a second time."""
  cases = each_case(CASE_INNER)
  txs = [build(case, inner) for case, inner in cases]  # constructed once, outside the step
  traces = []

  @jax.jit
  def step(carries, grads):
    traces.append(None)  # runs only while tracing
    out = []
    for (case, _), tx, (params, state), g in zip(cases, txs, carries, grads, strict=True):
      updates, state = per_worker(case, tx.update)(g, state, params)
      out.append((optax.apply_updates(params, updates), state, updates))
    return out

  params = [make_params(case) for case, _ in cases]
  state0 = [per_worker(case, tx.init)(p) for (case, _), tx, p in zip(cases, txs, params,
                                                                     strict=True)]
  grads = [make_grads(case) for case, _ in cases]
  carries, calls = list(zip(params, state0, strict=True)), []
  for t in range(STEPS):
    calls.append(step(carries, [step_at(g, t) for g in grads]))
    carries = [(p, s) for p, s, _ in calls[-1]]
  per_case = {(case.name, inner): (s0, [c[i] for c in calls])
              for i, ((case, inner), s0) in enumerate(zip(cases, state0, strict=True))}
  return per_case, len(traces), step._cache_size()


@pytest.mark.parametrize("case,inner", CASE_INNER)
def test_jit_no_recompilation_and_stable_state(jitted_steps, case, inner):
  per_case, traces, programs = jitted_steps
  state0, calls = per_case[case.name, inner]
  for params, _, updates in calls:
    assert shapes_and_dtypes(updates) == shapes_and_dtypes(params)
  assert traces == 1
  assert programs == 1
  params, state, _ = calls[-1]
  assert shapes_and_dtypes(state) == shapes_and_dtypes(state0)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


@pytest.mark.parametrize("case,inner", CASE_INNER)
def test_update_and_identity_branches_of_cond_typecheck(case, inner):
  tx = build(case, inner)
  params = make_params(case)
  grads = step_at(make_grads(case), 0)
  state0 = per_worker(case, tx.init)(params)

  def maybe_update(state, grads, threshold):
    pred = jnp.sum(grads["b"]) > threshold  # data dependent: a real cond, not a select
    return jax.lax.cond(
      pred,
      lambda s: per_worker(case, tx.update)(grads, s, params)[1],
      lambda s: s,
      state,
    )

  # lax.cond raises a TypeError while tracing unless both branches return identical types, so
  # tracing is the check (also after a few steps, when the state came out of `update`).
  state = state0
  for _ in range(2):
    out = jax.eval_shape(maybe_update, state, grads, jnp.float32(0.0))
    assert shapes_and_dtypes(out) == shapes_and_dtypes(state0)
    state = jax.eval_shape(per_worker(case, tx.update), grads, state, params)[1]


# ----------------------------------------------------------------------------------------------
# Composition with optax wrappers.


CLIP, WD_BEFORE, WD_AFTER = 0.5, 0.01, 0.02


def chained_and_reference(case, inner):
  """The transformation chained between clipping and weight decays, and its reference: the same
  transformation fed clipped, decayed gradients, then decayed once more (a lax.scan over the
  steps, as the chained run: one step in the compiled program each). ``(fn, args)``."""
  tx = build(case, inner)
  chained = optax.chain(
    optax.clip(CLIP),
    optax.add_decayed_weights(WD_BEFORE),
    tx,
    optax.add_decayed_weights(WD_AFTER),
  )

  def reference(params, grads):
    def step(carry, grads):
      params, state = carry
      g = jax.tree.map(lambda g, p: jnp.clip(g, -CLIP, CLIP) + WD_BEFORE * p, grads, params)
      u, state = per_worker(case, tx.update)(g, state, params)
      u = jax.tree.map(lambda u, p: u + WD_AFTER * p, u, params)
      return (optax.apply_updates(params, u), state), u

    return jax.lax.scan(step, (params, per_worker(case, tx.init)(params)), grads)[1]

  run = make_run(case, chained)
  return (lambda p, g: (run(p, g)[0], reference(p, g))), (make_params(case), make_grads(case))


@pytest.fixture(scope="module")
def chained():
  return compiled_together({(case.name, inner): chained_and_reference(case, inner)
                            for case, inner in each_case(rotated(0))})


@pytest.mark.parametrize("case,inner", rotated(0))
def test_chain_with_clipping_and_weight_decay(chained, case, inner):
  updates, expected = chained[case.name, inner]
  assert float(jnp.max(jnp.abs(make_grads(case)["w"]))) > CLIP  # the clipping matters
  assert_trees_close(updates, expected)


def plain_and_injected(case, inner):
  """The runs of the plain and the injected transformation: ``(fn, args)``."""
  run_plain = make_run(case, build(case, inner))
  run_injected = make_run(case, build_injected(case, inner))
  return (lambda p, g: (run_plain(p, g), run_injected(p, g))), (make_params(case),
                                                                make_grads(case))


@pytest.fixture(scope="module")
def injected():
  return compiled_together({(case.name, inner): plain_and_injected(case, inner)
                            for case, inner in each_case(rotated(1))})


@pytest.mark.parametrize("case,inner", rotated(1))
def test_inject_hyperparams_matches_plain_factory(injected, case, inner):
  (updates, new_params, _), (updates_inj, new_params_inj, state_inj) = injected[case.name, inner]
  assert_trees_close(updates_inj, updates)
  assert_trees_close(new_params_inj, new_params)
  hyperparams = state_inj.hyperparams
  assert set(hyperparams) == {"learning_rate", *case.hparams}
  for name, value in case.hparams.items():
    np.testing.assert_allclose(hyperparams[name], value, rtol=1e-6)


K = 2  # optax.MultiSteps' every_k_schedule


def multi_and_reference(case, inner):
  """The run inside ``optax.MultiSteps`` and its reference: one update every ``K`` steps on the
  mean of the ``K`` gradients. ``(fn, args)``."""
  tx = build(case, inner)
  grads = make_grads(case)
  mean_grads = jax.tree.map(lambda g: g.reshape(-1, K, *g.shape[1:]).mean(axis=1), grads)
  run_multi = make_run(case, optax.MultiSteps(tx, every_k_schedule=K))
  run_ref = make_run(case, tx)
  return (lambda p, g, m: (run_multi(p, g)[0], run_ref(p, m)[0])), (make_params(case), grads,
                                                                    mean_grads)


@pytest.fixture(scope="module")
def multi_steps():
  return compiled_together({(case.name, inner): multi_and_reference(case, inner)
                            for case, inner in each_case(rotated(2))})


@pytest.mark.parametrize("case,inner", rotated(2))
def test_inside_multi_steps_equals_updates_on_mean_gradients(multi_steps, case, inner):
  updates, ref_updates = multi_steps[case.name, inner]
  for t in range(STEPS):  # zeros in between
    u = step_at(updates, t)
    if (t + 1) % K:
      assert_trees_equal(u, optax.tree.zeros_like(u))
    else:
      assert_trees_close(u, step_at(ref_updates, t // K), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Extra arguments.


class RecordState(NamedTuple):
  scale: jax.Array


def scale_by_extra_arg() -> optax.GradientTransformationExtraArgs:
  """Multiplies the updates by the extra arg ``scale`` and records it in its state."""

  def init_fn(params):
    del params
    return RecordState(scale=jnp.ones([], jnp.float32))

  def update_fn(updates, state, params=None, *, scale=None, **extra_args):
    del params, extra_args
    s = state.scale if scale is None else jnp.asarray(scale, jnp.float32)
    return jax.tree.map(lambda u: u * s.astype(u.dtype), updates), RecordState(scale=s)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def recorded_scales(state) -> list[float]:
  found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, RecordState))
  return [float(np.ravel(r.scale)[0]) for r in found if isinstance(r, RecordState)]


def plain_and_extra(case):
  """One update without and with unknown extra args. optax.scale is a plain
  GradientTransformation: its update takes no extra args at all. ``(fn, args)``."""
  inner = optax.scale(-LR)
  tx = build(case, "none") if not case.has_inner else case.build(inner, **case.hparams)
  params, grads = make_params(case), step_at(make_grads(case), 0)
  state = per_worker(case, tx.init)(params)
  plain = per_worker(case, lambda g, s, p: tx.update(g, s, p))
  extra = per_worker(case, lambda g, s, p: tx.update(g, s, p, foo=1, bar="x"))
  return (lambda *a: (plain(*a), extra(*a))), (grads, state, params)


@pytest.fixture(scope="module")
def unknown_extra_args():
  return compiled_together({case.name: plain_and_extra(case) for case in CASES})


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_unknown_extra_args_are_ignored(unknown_extra_args, case):
  out_plain, out_extra = unknown_extra_args[case.name]
  assert_trees_equal(out_extra, out_plain)


def scaled_updates(case):
  """One update with the extra arg ``scale`` forwarded to the inner ``scale_by_extra_arg``:
  ``(fn, args)``, ``fn(scale)`` its updates and state."""
  tx = case.build(optax.chain(scale_by_extra_arg(), optax.sgd(LR)), **case.hparams)
  params, grads = make_params(case), step_at(make_grads(case), 0)
  state = per_worker(case, tx.init)(params)
  extra = {"grad_step": 0} if case.name == "drop_stale_gradients" else {}

  def update(scale, grads, state, params):
    return per_worker(case, lambda g, s, p: tx.update(g, s, p, scale=scale, **extra))(
      grads, state, params)

  return update, (grads, state, params)


@pytest.fixture(scope="module")
def scaled():
  """Every case's update with ``scale`` 1 and 3: one program, called with each."""
  computations = {case.name: scaled_updates(case) for case in CASES if case.has_inner}

  @jax.jit
  def update(scale):
    return {name: fn(scale, *args) for name, (fn, args) in computations.items()}

  return update(1.0), update(3.0)


@pytest.mark.parametrize("case", [c for c in CASES if c.has_inner], ids=str)
def test_extra_args_are_forwarded_to_inner(scaled, case):
  (updates_1, _), (updates_3, state_3) = (by_case[case.name] for by_case in scaled)
  assert_trees_close(updates_3, jax.tree.map(lambda u: 3.0 * u, updates_1), atol=0)
  assert float(jnp.max(jnp.abs(updates_1["w"]))) > 0
  assert 3.0 in recorded_scales(state_3)


# ----------------------------------------------------------------------------------------------
# dtypes.


@pytest.fixture(scope="module")
def bfloat16_runs():
  """Every case of the test below run on bfloat16 params and gradients, in one program."""
  return compiled_together({
    (case.name, inner): (jax.jit(make_run(case, build(case, inner))),
                         (make_params(case, jnp.bfloat16), make_grads(case, dtype=jnp.bfloat16)))
    for case, inner in each_case(rotated(1))
  })


@pytest.mark.parametrize("case,inner", rotated(1))
def test_bfloat16_params_keep_their_dtype(bfloat16_runs, case, inner):
  tx = build(case, inner)
  params = make_params(case, jnp.bfloat16)
  state0 = per_worker(case, tx.init)(params)
  updates, new_params, state = bfloat16_runs[case.name, inner]
  assert jax.tree.map(jnp.result_type, updates) == jax.tree.map(lambda _: jnp.bfloat16, params)
  assert jax.tree.map(jnp.result_type, new_params) == jax.tree.map(lambda _: jnp.bfloat16, params)
  assert shapes_and_dtypes(state) == shapes_and_dtypes(state0)
  if case.averages:
    average = getattr(state, case.averages)
    assert jax.tree.map(jnp.result_type, average) == jax.tree.map(lambda _: jnp.bfloat16, params)


def test_moving_average_ema_dtype_float32_with_bfloat16_params():
  tx = optax_dist.moving_average(optax.sgd(LR), decay=0.5, ema_dtype=jnp.float32)
  case = CASES[0]
  params = make_params(case, jnp.bfloat16)
  grads = make_grads(case, dtype=jnp.bfloat16)
  updates, new_params, state = jax.jit(make_run(case, tx))(params, grads)
  assert jax.tree.map(jnp.result_type, state.ema) == {"w": jnp.float32, "b": jnp.float32}
  assert jax.tree.map(jnp.result_type, updates) == {"w": jnp.bfloat16, "b": jnp.bfloat16}
  assert jax.tree.map(jnp.result_type, new_params) == {"w": jnp.bfloat16, "b": jnp.bfloat16}
  # An independent float64 reference: the EMA of the bf16 params, kept in float32.
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  ema = dict(p)
  for t in range(STEPS):
    g = jax.tree.map(lambda x: np.asarray(x, np.float64), step_at(grads, t))
    p = {k: np.asarray(jnp.asarray(p[k] - LR * g[k], jnp.bfloat16), np.float64) for k in p}
    ema = {k: 0.5 * ema[k] + 0.5 * p[k] for k in p}
  assert_trees_close(state.ema, ema, rtol=2e-2, atol=2e-2)
  # The average lies between representable bf16 values: it is not bf16-rounded.
  ema_f32 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.ema)])
  assert np.any(ema_f32 != np.asarray(jnp.asarray(ema_f32, jnp.bfloat16), np.float32))


# ----------------------------------------------------------------------------------------------
# Abstract init and map_params.


@pytest.mark.parametrize("case,inner", CASE_INNER)
def test_abstract_init_on_shape_dtype_structs(case, inner):
  tx = build(case, inner)
  params = make_params(case)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  shapes = jax.eval_shape(per_worker(case, tx.init), abstract)
  assert shapes_and_dtypes(shapes) == shapes_and_dtypes(per_worker(case, tx.init)(params))
  if case.mapped:
    # The axis is named but unbound here (one worker): init must still work.
    worker = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), abstract)
    shapes = jax.eval_shape(tx.init, worker)
    assert shapes_and_dtypes(shapes) == shapes_and_dtypes(tx.init(step_at(params, 0)))


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax_dist.elastic_average(optax.adam(LR), 4, axis_name=AXIS),
    lambda: optax_dist.agn(optax.adam(LR), 4, axis_name=AXIS),
  ],
  ids=["elastic_average", "agn"],
)
def test_abstract_init_with_num_workers_and_unbound_axis(make):
  tx = make()
  abstract = {"w": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)}
  state = jax.eval_shape(tx.init, abstract)
  assert state.center["w"].shape == (2, 3)
  assert state.center["w"].dtype == jnp.bfloat16
  assert state.local_step.dtype == jnp.int32


@pytest.mark.parametrize("case,inner", CASE_INNER)
def test_tree_map_params_maps_every_param_shaped_tree(case, inner):
  tx = build(case, inner)
  params = make_params(case)
  state = per_worker(case, tx.init)(params)
  spec = optax.tree.map_params(tx, lambda _: "P", state, transform_non_params=lambda _: None)
  leaves = jax.tree.leaves(spec)
  copies = case.own_param_copies + case.inner_states * INNER_PARAM_COPIES[inner]
  assert leaves.count("P") == copies * len(jax.tree.leaves(params))
  assert set(leaves) <= {"P"}  # every other field became None (not a leaf)

  # A shape-changing map touches exactly the param-shaped trees.
  doubled = optax.tree.map_params(tx, lambda v: jnp.concatenate([v, v]), state)
  grown = [
    after.shape != before.shape
    for before, after in zip(jax.tree.leaves(state), jax.tree.leaves(doubled), strict=True)
  ]
  assert sum(grown) == leaves.count("P")
  for before, after in zip(jax.tree.leaves(state), jax.tree.leaves(doubled), strict=True):
    if after.shape != before.shape:
      assert after.shape == (2 * before.shape[0], *before.shape[1:])


def is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


@pytest.mark.parametrize("case,inner", CASE_INNER)
def test_tree_map_params_maps_a_spec_tree_over_the_state(case, inner):
  """The form that builds a state's shardings from the params': ``f(leaf, spec)`` with the
  params' spec tree as ``*rest``. ``is_leaf=is_masked`` (as for ``optax.masked``) hands each
  ``optax.MaskedNode`` of ``streaming_diloco``'s per-fragment outer states to ``f``, which gives it
  the spec too: the result is a prefix of the state, each param-shaped array under its param's
  spec and every other field under ``None``."""
  tx = build(case, inner)
  params = make_params(case)
  state = per_worker(case, tx.init)(params)
  tags = {"w": "W", "b": "B"}  # stand-ins for PartitionSpecs
  spec = optax.tree.map_params(
    tx, lambda _, tag: tag, state, tags, transform_non_params=lambda _: None, is_leaf=is_masked
  )
  under = {"W": [], "B": [], None: []}
  jax.tree.map(lambda tag, sub: under[tag].extend(jax.tree.leaves(sub)), spec, state,
               is_leaf=lambda x: x is None)
  copies = case.own_param_copies + case.inner_states * INNER_PARAM_COPIES[inner]
  for tag, name in (("W", "w"), ("B", "b")):
    assert [x.shape for x in under[tag]] == [np.shape(params[name])] * copies, tag
  assert len(under[None]) == len(jax.tree.leaves(state)) - 2 * copies


def test_tree_map_params_needs_is_leaf_for_masked_nodes():
  """Without ``is_leaf``, a ``MaskedNode`` (a node with no leaves) meets the spec tree's leaf
  there: JAX refuses the two structures, as it does for ``optax.masked``'s states."""
  tx = optax_dist.streaming_diloco(optax.sgd(LR), sync_period=2, num_fragments=2,
                                   fragments={"w": 0, "b": 1})
  params = make_params(CASES[0])
  state = tx.init(params)
  # optax 0.2.8 names the key path; older optax fails in its own walker ("Expected named tuple").
  with pytest.raises(ValueError, match="different types at key path|Expected named tuple"):
    optax.tree.map_params(tx, lambda _, tag: tag, state, {"w": "W", "b": "B"})
