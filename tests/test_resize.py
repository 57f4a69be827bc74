"""resize_state: a run trained on N workers continues on M, its global state kept bit for bit.

Every transformation (and a chain of nested ones) trains 4 steps on N = 4 workers under
``jax.shard_map`` over emulated CPU devices, on a quadratic whose gradient differs per worker
(``g_i = c_i * x_i - d_i(t)``), so the workers' own params and inner states really differ. The
state and params are then resized to M = 2 and M = 8: the global parts must be worker 0's copy,
bitwise, on every new worker; the rebuilt ones what the docstring says (the center or anchor,
``tx.init`` of the new params, the workers' mean, computed here with NumPy). Then M workers
train 5 more steps, and their global parts must agree on every worker and have moved (they
communicated). Also: M = N returns everything unchanged; the ``inner_state`` modes; bad inputs;
and sklearn digits trained on 8 workers, resized to 4 halfway, against the spread of unresized
runs over seeds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist
from optax_dist import _state

AXIS = "workers"
N = 4
STEPS, MORE = 4, 5  # 4 steps: mid-period for every period below (3, or 4 with an offset)
SHAPES = {"a": (3,), "b": (2, 2)}

# ----------------------------------------------------------------------------------------------
# The cases: what each state keeps, resets, averages, and what the params restart from.


@dataclasses.dataclass(frozen=True)
class Case:
  make: Callable[[], optax.GradientTransformation]
  kept: tuple = ()  # accessors of the state: worker 0's copy, bitwise, on every new worker
  reset: tuple = ()  # inner states that differ between workers: tx.init of the new params
  kept_inner: tuple = ()  # inner states identical on every worker: kept bitwise under "reset"
  mean: tuple = ()  # the workers' mean
  restart: Callable | None = None  # the params restart from it (None: the workers' mean)
  synced: Callable | None = None  # (state, params) -> a global part, to check communication
  calls: Callable | None = None  # state -> the number of update calls its counters record
  stale: bool = False  # feed drop_stale_gradients a stale grad_step every third step
  nan: bool = False  # a NaN gradient on worker 1 at step 2


def _ea(inner):
  return optax_dist.elastic_average(inner, communication_period=3, axis_name=AXIS)


LOCAL_STEP = lambda s: s.local_step

CASES = {
  "elastic_average": Case(
    lambda: _ea(optax.adam(0.05)),
    kept=(lambda s: s.local_step, lambda s: s.center), reset=(lambda s: s.inner_state,),
    restart=lambda s: s.center, synced=lambda s, p: s.center, calls=LOCAL_STEP,
  ),
  "agn": Case(
    lambda: optax_dist.agn(optax.sgd(0.05, momentum=0.9), communication_period=3, axis_name=AXIS),
    kept=(lambda s: s.local_step, lambda s: s.center, lambda s: s.center_inner_state),
    reset=(lambda s: s.inner_state,), mean=(lambda s: s.grad_accum,),
    restart=lambda s: s.center, synced=lambda s, p: s.center, calls=LOCAL_STEP,
  ),
  "moving_average": Case(
    lambda: optax_dist.moving_average(optax.adam(0.05), 0.9),
    kept=(lambda s: s.count,), reset=(lambda s: s.inner_state,), mean=(lambda s: s.ema,),
    calls=lambda s: s.count,
  ),
  "drop_stale_gradients": Case(
    lambda: optax_dist.drop_stale_gradients(optax.adam(0.05), max_staleness=0),
    kept=(lambda s: s.global_step, lambda s: s.num_dropped), reset=(lambda s: s.inner_state,),
    stale=True, calls=lambda s: s.global_step + s.num_dropped,
  ),
  "tower": Case(
    lambda: optax_dist.tower(optax.adam(0.05), AXIS),
    kept_inner=(lambda s: s,), synced=lambda s, p: p, calls=lambda s: s[1][0].count,
  ),
  "accumulate_then_reduce": Case(
    lambda: optax_dist.accumulate_then_reduce(optax.adam(0.05), 3, AXIS),
    kept=(lambda s: s.mini_step, lambda s: s.gradient_step),
    kept_inner=(lambda s: s.inner_opt_state,), mean=(lambda s: s.acc_grads,),
    synced=lambda s, p: p, calls=lambda s: 3 * s.gradient_step + s.mini_step,
  ),
  "apply_if_finite": Case(
    lambda: optax_dist.apply_if_finite(optax_dist.tower(optax.adam(0.05), AXIS), 3, AXIS),
    kept=(lambda s: s.notfinite_count, lambda s: s.last_finite, lambda s: s.total_notfinite),
    kept_inner=(lambda s: s.inner_state,), synced=lambda s, p: p, nan=True,
    calls=lambda s: s.inner_state[1][0].count + s.total_notfinite,  # one step skipped
  ),
  "diloco": Case(
    lambda: optax_dist.diloco(optax.adam(0.05), sync_period=3, axis_name=AXIS),
    kept=(lambda s: s.local_step, lambda s: s.anchor, lambda s: s.outer_state),
    reset=(lambda s: s.inner_state,), restart=lambda s: s.anchor,
    synced=lambda s, p: s.anchor, calls=LOCAL_STEP,
  ),
  "local_sgd": Case(
    lambda: optax_dist.local_sgd(optax.adam(0.05), sync_period=3, axis_name=AXIS),
    kept=(lambda s: s.local_step,), reset=(lambda s: s.inner_state,), synced=lambda s, p: p,
    calls=LOCAL_STEP,
  ),
  "streaming_diloco": Case(
    lambda: optax_dist.streaming_diloco(
      optax.adam(0.05), sync_period=4, num_fragments=2, fragments={"a": 0, "b": 1},
      axis_name=AXIS),
    kept=(lambda s: s.local_step, lambda s: s.anchor, lambda s: s.outer_state),
    reset=(lambda s: s.inner_state,), restart=lambda s: s.anchor,
    synced=lambda s, p: s.anchor, calls=LOCAL_STEP,
  ),
  # A chain holding a nested pair: clip, then an EMA of EASGD's workers.
  "chain_moving_average_elastic_average": Case(
    lambda: optax.chain(
      optax.clip_by_global_norm(10.0),
      optax_dist.moving_average(_ea(optax.sgd(0.05, momentum=0.9)), 0.9),
    ),
    kept=(lambda s: s[1].count, lambda s: s[1].inner_state.local_step,
          lambda s: s[1].inner_state.center),
    reset=(lambda s: s[1].inner_state.inner_state,), mean=(lambda s: s[1].ema,),
    restart=lambda s: s[1].inner_state.center, synced=lambda s, p: s[1].inner_state.center,
    calls=lambda s: s[1].count,
  ),
}

# ----------------------------------------------------------------------------------------------
# Training under shard_map, n workers on n devices.


def _data(n, steps, seed, nan=False):
  rng = np.random.default_rng(seed)
  c = {k: rng.uniform(0.5, 2.0, (n, *s)).astype(np.float32) for k, s in SHAPES.items()}
  d = {k: rng.normal(size=(n, steps, *s)).astype(np.float32) for k, s in SHAPES.items()}
  if nan:
    d["a"][1, 1, 0] = np.nan
  return c, d


@functools.cache
def _programs(make, n, stale):
  """The jitted shard_map init and training loop of ``make()`` on ``n`` devices."""
  tx = make()
  mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])
  squeeze = lambda tree: jax.tree.map(lambda a: a[0], tree)
  expand = lambda tree: jax.tree.map(lambda a: a[None], tree)

  def worker_train(x, state, c, d):
    def body(carry, d_t):
      (x, s), t = carry, d_t[1]
      g = jax.tree.map(lambda x, c, d: c * x - d, x, c, d_t[0])
      extra = {}
      if stale:  # every third step computed against the previous global step: dropped
        extra["grad_step"] = s.global_step - (t % 3 == 2).astype(jnp.int32)
      u, s = tx.update(g, s, x, **extra)
      return (optax.apply_updates(x, u), s), None

    steps = jax.tree.leaves(d)[0].shape[0]
    (x, state), _ = jax.lax.scan(body, (x, state), (d, jnp.arange(steps)))
    return x, state

  def mapped(fn):
    return jax.jit(jax.shard_map(
      lambda *a: expand(fn(*squeeze(a))), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)
    ))

  put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P(AXIS)))
  return tx, mapped(tx.init), mapped(worker_train), put


def _initial_params():
  """The params every one of the ``N`` workers starts from, stacked."""
  return {k: np.broadcast_to(np.linspace(-1.0, 1.0, np.prod(s), dtype=np.float32).reshape(s),
                             (N, *s)) for k, s in SHAPES.items()}


def _together(calls):
  """Jitted functions called on their arguments, ``calls`` a list of ``(fn, args)``, compiled as
  one program (one compilation instead of one per function); their results in order."""
  fns = [fn for fn, _ in calls]
  return jax.jit(lambda args: [fn(*a) for fn, a in zip(fns, args, strict=True)])(
    [a for _, a in calls])


@functools.cache
def _trained_on_devices_all():
  """Every case's init and ``STEPS`` steps on ``N`` workers under shard_map, the cases compiled
  as one program: ``{name: (tx, params, state)}``, device arrays sharded ``P("workers")``."""
  calls, txs = [], []
  for name in sorted(CASES):
    case = CASES[name]
    tx, init, train, put = _programs(case.make, N, case.stale)
    c, d = _data(N, STEPS, 0, case.nan)
    calls.append((lambda p, c, d, init=init, train=train: train(p, init(p), c, d),
                  (put(_initial_params()), put(c), put(d))))
    txs.append(tx)
  return {name: (tx, *result)
          for name, tx, result in zip(sorted(CASES), txs, _together(calls), strict=True)}


@functools.cache
def _trained(name):
  """``name`` trained ``STEPS`` steps on ``N`` workers: (tx, params, state), as NumPy arrays."""
  tx, params, state = _trained_on_devices(name)
  return tx, jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, state)


def _trained_on_devices(name):
  """The same run's device arrays, sharded ``P("workers")`` over a mesh with explicit axes."""
  return _trained_on_devices_all()[name]


@functools.cache
def _resized_and_trained_on(m):
  """Every case's run resized to ``m`` workers (``inner_state="reset"``, on the devices) and
  trained ``MORE`` steps on ``m`` devices, the cases' trainings compiled as one program:
  ``{name: (new_state, new_params, state2, params2)}`` as NumPy arrays."""
  resized, calls = {}, []
  for name in sorted(CASES):
    tx, params, state = _trained_on_devices(name)
    resized[name] = optax_dist.resize_state(tx, state, params, m, inner_state="reset")
    _, _, train, put = _programs(CASES[name].make, m, CASES[name].stale)
    c, d = _data(m, MORE, 1)
    new_state, new_params = resized[name]
    calls.append((train, (put(new_params), put(new_state), put(c), put(d))))
  return {name: jax.tree.map(np.asarray, (*resized[name], state2, params2))
          for name, (params2, state2) in zip(sorted(CASES), _together(calls), strict=True)}


# ----------------------------------------------------------------------------------------------
# NumPy references.


def agreed_mean(x):
  """The mean over axis 0 (float64, cast back), worker 0's value wherever all workers agree."""
  x = np.asarray(x)
  if not np.issubdtype(x.dtype, np.floating):
    return x[0]
  return np.where(np.all(x == x[0], axis=0), x[0], x.astype(np.float64).mean(0).astype(x.dtype))


def differs_between_workers(tree):
  return any(not np.array_equal(leaf, leaf[:1].repeat(len(leaf), 0)) for leaf in
             jax.tree.leaves(tree))


def assert_tree_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.asarray(g).dtype == np.asarray(w).dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def broadcast(tree, m):
  return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x)[0], (m, *np.shape(x)[1:])), tree)


def assert_identical_on_workers(tree):
  for leaf in jax.tree.leaves(tree):
    leaf = np.asarray(leaf)
    for i in range(1, len(leaf)):
      np.testing.assert_array_equal(leaf[i], leaf[0])


# ----------------------------------------------------------------------------------------------
# N = 4 -> M = 2 and 8 under shard_map, then M workers train on.


@pytest.mark.parametrize("m", [2, 8])
@pytest.mark.parametrize("name", sorted(CASES))
def test_resize_keeps_global_state_and_trains_on(name, m):
  case = CASES[name]
  tx, params, state = _trained(name)
  _, on_devices_params, _ = _trained_on_devices(name)
  assert jax.tree.leaves(on_devices_params)[0].sharding.spec[0] == AXIS
  new_state, new_params, state2, params2 = _resized_and_trained_on(m)[name]
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  for leaf in jax.tree.leaves((new_state, new_params)):
    assert np.shape(leaf)[0] == m

  for get in case.kept:  # global: worker 0's copy, bitwise
    assert_identical_on_workers(get(state))
    assert_tree_equal(get(new_state), broadcast(get(state), m))
  for get in case.kept_inner:  # an inner state identical on every worker is global too
    assert not differs_between_workers(get(state))
    assert_tree_equal(get(new_state), broadcast(get(state), m))
  for get in case.mean:
    assert differs_between_workers(get(state))  # else the check below proves nothing
    want = jax.tree.map(lambda x: np.broadcast_to(agreed_mean(x), (m, *x.shape[1:])), get(state))
    for g, w in zip(jax.tree.leaves(get(new_state)), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)

  if case.restart is not None:  # the params restart from the center or anchor, bitwise
    assert_tree_equal(new_params, broadcast(case.restart(state), m))
  elif not differs_between_workers(params):  # tower: the params, bitwise
    assert_tree_equal(new_params, broadcast(params, m))
  else:
    want = jax.tree.map(lambda x: np.broadcast_to(agreed_mean(x), (m, *x.shape[1:])), params)
    for g, w in zip(jax.tree.leaves(new_params), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
  fresh = jax.vmap(tx.init)(new_params)
  for get in case.reset:  # each worker's own inner state restarts from tx.init
    assert differs_between_workers(get(state))
    assert_tree_equal(get(new_state), get(fresh))

  if m == 2:  # the default, "mean": the same, but each worker's own inner state averaged
    mean_state, mean_params = optax_dist.resize_state(tx, state, params, m)
    assert_tree_equal(mean_params, new_params)
    for get in case.kept + case.kept_inner + case.mean:
      assert_tree_equal(get(mean_state), get(new_state))
    for get in case.reset:
      want = jax.tree.map(lambda x: np.broadcast_to(agreed_mean(x), (m, *x.shape[1:])), get(state))
      for g, w in zip(jax.tree.leaves(get(mean_state)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-12)

  # M workers on M devices trained on (the new state and params above), and communicated.
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params2))
  if case.calls is not None:  # the counters went on from where they were
    assert np.all(np.asarray(case.calls(state2)) == STEPS + MORE)
  if case.synced is not None:
    after = case.synced(state2, params2)  # params land on a mean up to float rounding
    for leaf in jax.tree.leaves(after):
      np.testing.assert_allclose(leaf, np.broadcast_to(leaf[0], leaf.shape), rtol=1e-6)
    assert differs_between_workers(jax.tree.map(
      lambda a, b: np.stack([a[0], b[0]]), after, case.synced(new_state, new_params)
    )), "the global part did not move: the M workers did not communicate"


def test_cases_step_counters_continue():
  """The counters keep their values: the schedule continues (the first sync after the resize
  is at the old period's end, not a period after the resize)."""
  tx, params, state = _trained("diloco")
  new_state, new_params = optax_dist.resize_state(tx, state, params, 2)
  assert np.all(np.asarray(new_state.local_step) == STEPS)
  _, _, train, put = _programs(CASES["diloco"].make, 2, False)
  (_, state2), (_, state1) = _together([  # steps 5 and 6, and step 5 alone
    (train, (put(new_params), put(new_state), *map(put, _data(2, steps, 1)))) for steps in (2, 1)
  ])
  # The sync at 6 = 2 * sync_period moves the anchor; step 5 alone does not sync.
  assert not np.array_equal(np.asarray(state2.anchor["a"]), np.asarray(new_state.anchor["a"]))
  np.testing.assert_array_equal(np.asarray(state1.anchor["a"]), np.asarray(new_state.anchor["a"]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_number_of_workers_returns_everything_unchanged(name):
  tx, params, state = _trained_on_devices(name)  # device arrays, sharded over the workers
  for mode in ("reset", "mean", "copy"):
    new_state, new_params = optax_dist.resize_state(tx, state, params, N, inner_state=mode)
    assert_tree_equal(new_state, state)
    assert_tree_equal(new_params, params)


# ----------------------------------------------------------------------------------------------
# The inner_state modes, and inner states nested in optax's own.


def test_inner_state_modes():
  tx, params, state = _trained("elastic_average")
  adam = state.inner_state[0]
  assert differs_between_workers(adam.mu)
  mean_state, _ = optax_dist.resize_state(tx, state, params, 3, inner_state="mean")
  got = mean_state.inner_state[0]
  np.testing.assert_array_equal(got.count, broadcast(adam.count, 3))  # an integer: worker 0's
  for k, shape in SHAPES.items():
    for field in ("mu", "nu"):
      want = np.broadcast_to(agreed_mean(getattr(adam, field)[k]), (3, *shape))
      np.testing.assert_allclose(getattr(got, field)[k], want, rtol=1e-6, atol=1e-12)
  default_state, _ = optax_dist.resize_state(tx, state, params, 3)  # "mean"
  assert_tree_equal(default_state, mean_state)
  copy_state, _ = optax_dist.resize_state(tx, state, params, 3, inner_state="copy")
  assert_tree_equal(copy_state.inner_state, broadcast(state.inner_state, 3))
  reset_state, new_params = optax_dist.resize_state(tx, state, params, 3, inner_state="reset")
  assert_tree_equal(reset_state.inner_state, jax.vmap(tx.init)(new_params).inner_state)
  assert np.all(np.asarray(reset_state.inner_state[0].count) == 0)
  for s in (mean_state, copy_state, reset_state):  # the global part, whatever the mode
    assert_tree_equal(s.center, broadcast(state.center, 3))


def test_reset_keeps_a_schedules_count_and_resets_the_moments():
  """One optax state at a time: the injected schedule's count and hyperparameters are the same
  on every worker (global, kept); adam's count and moments differ (reset together)."""
  schedule = optax.linear_schedule(0.1, 0.01, 20)
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
  tx = optax_dist.diloco(inner, sync_period=3, axis_name=AXIS)
  params = {"a": jnp.zeros((N, 3))}
  state = jax.vmap(tx.init, axis_name=AXIS)(params)
  update = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
  for t in range(4):
    grads = {"a": jnp.arange(12.0).reshape(N, 3) * (t + 1) - params["a"]}
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  new_state, new_params = optax_dist.resize_state(tx, state, params, 2, inner_state="reset")
  old, new = state.inner_state, new_state.inner_state
  assert_tree_equal(new.count, broadcast(old.count, 2))
  assert_tree_equal(new.hyperparams, broadcast(old.hyperparams, 2))
  assert np.all(np.asarray(old.count) == 4)
  assert_tree_equal(new.inner_state, jax.vmap(tx.init)(new_params).inner_state.inner_state)


def test_agn_grad_accum_is_the_workers_mean_mid_period():
  """The current period's gradients survive as their mean: the next commit still holds them."""
  tx, params, state = _trained("agn")
  assert STEPS % 3 != 0  # mid-period: the accumulator is not empty
  new_state, _ = optax_dist.resize_state(tx, state, params, 2)
  for k in SHAPES:
    assert np.any(np.asarray(state.grad_accum[k]) != 0)
    np.testing.assert_allclose(
      new_state.grad_accum[k][0], np.asarray(state.grad_accum[k], np.float64).mean(0),
      rtol=1e-6, atol=1e-7,
    )


def test_every_state_declares_its_rules():
  """Each library state declares, beside its fields, a resize rule per field and the fields
  eval_params and resize_state read."""
  states = [getattr(optax_dist, n) for n in optax_dist.__all__ if n.endswith("State")]
  assert len(states) == 10
  for cls in states:
    assert list(cls.RESIZE) == list(cls._fields), cls.__name__
    assert set(cls.RESIZE.values()) <= {_state.KEEP, _state.MEAN, _state.INNER}, cls.__name__
    for declared in (cls.AVERAGE, cls.RESTART):
      assert declared is None or declared in cls._fields, cls.__name__


def test_resized_state_can_be_donated():
  """The new params and state share no buffer: a step donating both runs."""
  tx, params, state = _trained("diloco")
  new_state, new_params = optax_dist.resize_state(tx, state, params, 2)
  step = jax.jit(jax.vmap(tx.update, axis_name=AXIS), donate_argnums=(1, 2))
  grads = jax.tree.map(jnp.ones_like, new_params)
  updates, _ = step(grads, new_state, new_params)
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("inner_state", ["mean", "reset"])
def test_bfloat16_params_and_float32_anchor_keep_their_dtypes(inner_state):
  """bfloat16 params, diloco's anchor (and outer state) in float32, inner momentum in bfloat16:
  four workers resized to two keep every leaf's dtype, the params stay bfloat16, and a jitted
  step compiled on a fresh two-worker state runs the resized one without compiling again."""
  tx = optax_dist.diloco(
    optax.sgd(0.1, momentum=0.9), sync_period=3, anchor_dtype=jnp.float32, axis_name=AXIS
  )
  params = {k: jnp.linspace(-1.0, 1.0, N * int(np.prod(s)), dtype=jnp.bfloat16).reshape(N, *s)
            for k, s in SHAPES.items()}
  state = jax.vmap(tx.init, axis_name=AXIS)(params)
  update = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
  for t in range(STEPS):  # past the sync on step 3: the anchor has moved, in float32
    grads = jax.tree.map(lambda p: jnp.cos(p.astype(jnp.float32) * (t + 1)), params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  dtypes = lambda tree: jax.tree.map(lambda x: (np.shape(x)[1:], jnp.result_type(x)), tree)
  assert {jnp.result_type(a) for a in jax.tree.leaves(state.anchor)} == {np.dtype(jnp.float32)}
  assert {jnp.result_type(x) for x in jax.tree.leaves(state.inner_state)} == {np.dtype(jnp.bfloat16)}

  new_state, new_params = optax_dist.resize_state(tx, state, params, 2, inner_state=inner_state)
  assert dtypes(new_state) == dtypes(state)
  assert dtypes(new_params) == dtypes(params)
  for k in params:  # the workers restart from the anchor, rounded to the params' dtype
    np.testing.assert_array_equal(
      new_params[k], jnp.broadcast_to(state.anchor[k][0].astype(jnp.bfloat16), new_params[k].shape)
    )

  traces = []

  def step(params, state):
    traces.append(None)
    grads = jax.tree.map(lambda p: jnp.cos(p.astype(jnp.float32)), params)
    updates, state = jax.vmap(tx.update, axis_name=AXIS)(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step)
  fresh = jax.tree.map(lambda p: p[:2], params)
  step(fresh, jax.vmap(tx.init, axis_name=AXIS)(fresh))
  params2, state2 = step(new_params, new_state)
  step(params2, state2)
  assert len(traces) == 1 and step._cache_size() == 1


# ----------------------------------------------------------------------------------------------
# Bad input.


def test_bad_num_workers_and_mode():
  tx, params, state = _trained("elastic_average")
  for bad, error in ((0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)):
    with pytest.raises(error, match=r"`resize_state\(num_workers=...\)` must be a positive int"):
      optax_dist.resize_state(tx, state, params, bad)
  with pytest.raises(ValueError, match=r"`resize_state\(inner_state=...\)` must be one of"):
    optax_dist.resize_state(tx, state, params, 2, inner_state="zero")
  with pytest.raises(TypeError, match=r"`resize_state\(tx=...\)` must be the optax"):
    optax_dist.resize_state(state, state, params, 2)


def test_not_stacked_raises():
  tx = optax_dist.elastic_average(optax.sgd(0.1), communication_period=2, axis_name=AXIS)
  params = {"a": jnp.zeros((N, 3))}
  one = tx.init({"a": jnp.zeros(3)})  # one worker's state: a scalar step counter
  with pytest.raises(ValueError, match=r"opt_state\.local_step has shape \(\): it has no"):
    optax_dist.resize_state(tx, one, params, 2)
  state = jax.vmap(tx.init)(params)
  with pytest.raises(ValueError, match=r"params\['b'\] has shape \(3, 2\) while params\['a'\]"):
    optax_dist.resize_state(tx, state, {"a": params["a"], "b": jnp.zeros((3, 2))}, 2)
  with pytest.raises(ValueError, match=r"opt_state\.local_step has shape \(2,\) while params"):
    optax_dist.resize_state(tx, jax.vmap(tx.init)({"a": jnp.zeros((2, 3))}), params, 2)


def test_state_of_another_transformation_raises():
  params = {"a": jnp.zeros((N, 3))}
  ea = optax_dist.elastic_average(optax.sgd(0.1), communication_period=2, axis_name=AXIS)
  dl = optax_dist.diloco(optax.sgd(0.1), sync_period=2, axis_name=AXIS)
  with pytest.raises(ValueError, match=r"`opt_state` is not a state of `tx` for these params"):
    optax_dist.resize_state(dl, jax.vmap(ea.init)(params), params, 2)
  momentum = optax_dist.elastic_average(optax.sgd(0.1, momentum=0.9), axis_name=AXIS)
  with pytest.raises(ValueError, match=r"`opt_state` is not a state of `tx`"):
    optax_dist.resize_state(momentum, jax.vmap(ea.init)(params), params, 2)
  wide = jax.vmap(ea.init)({"a": jnp.zeros((N, 4))})  # another param shape
  with pytest.raises(ValueError, match=r"the leaf at opt_state\.center\['a'\] has shape"):
    optax_dist.resize_state(ea, wide, params, 2)


def test_tree_mismatch_names_the_first_path_that_differs():
  params = {"a": jnp.zeros((N, 3)), "b": jnp.zeros((N, 2))}
  sgd = optax_dist.diloco(optax.sgd(0.1), sync_period=2, axis_name=AXIS)
  adam = optax_dist.diloco(optax.adam(0.1), sync_period=2, axis_name=AXIS)
  with pytest.raises(ValueError, match=(
    r"opt_state\.inner_state\[0\] is EmptyState\(\), where `jax\.vmap\(tx\.init\)\(params\)`"
    r" has ScaleByAdamState\(\.count, \.mu, \.nu\)\."
  )) as raised:
    optax_dist.resize_state(adam, jax.vmap(sgd.init)(params), params, 3)
  assert "PyTreeDef" not in str(raised.value)
  with pytest.raises(ValueError, match=(
    r"opt_state\.anchor is dict\(\['a'\]\), where .* has dict\(\['a'\], \['b'\]\)"
  )):
    optax_dist.resize_state(sgd, jax.vmap(sgd.init)({"a": params["a"]}), params, 3)
  ea = optax_dist.elastic_average(optax.sgd(0.1), communication_period=2, axis_name=AXIS)
  with pytest.raises(ValueError, match=r"opt_state is ElasticAverageState\(\.local_step, "):
    optax_dist.resize_state(sgd, jax.vmap(ea.init)(params), params, 3)


def test_mean_is_exact_where_the_workers_agree():
  """Three workers of tower: params and adam state identical on each. The mean of three equal
  float32 values is not always that value after rounding; here it is, bit for bit."""
  tx = optax_dist.tower(optax.adam(0.05), AXIS)
  row = np.random.default_rng(0).normal(size=1000).astype(np.float32)
  params = {"a": jnp.asarray(np.stack([row] * 3))}
  state = jax.vmap(tx.init, axis_name=AXIS)(params)
  grads = {"a": jnp.asarray(np.stack([row, 2 * row, 3 * row]))}
  updates, state = jax.vmap(tx.update, axis_name=AXIS)(grads, state, params)
  params = optax.apply_updates(params, updates)
  mean3 = np.mean(np.stack([row] * 3), axis=0, dtype=np.float32)
  assert not np.array_equal(mean3, row)  # the rounding the check below must not suffer
  new_state, new_params = optax_dist.resize_state(tx, state, params, 2, inner_state="mean")
  assert_tree_equal(new_params, broadcast(params, 2))
  assert_tree_equal(new_state, broadcast(state, 2))


# ----------------------------------------------------------------------------------------------
# Training: sklearn digits on 8 workers, resized to 4 halfway, against unresized runs.

DIGITS_WORKERS, DIGITS_STEPS, DIGITS_BATCH = 8, 600, 16
DIGITS_ALGORITHMS = {  # and the parts of their state resize_state must keep bitwise
  "elastic_average": (
    lambda: optax_dist.elastic_average(
      optax.sgd(0.1, momentum=0.9), communication_period=4, axis_name=AXIS),
    ("local_step", "center"),
  ),
  "agn": (
    lambda: optax_dist.agn(optax.sgd(0.1), communication_period=4, axis_name=AXIS),
    ("local_step", "center", "center_inner_state"),
  ),
  "diloco": (
    lambda: optax_dist.diloco(optax.sgd(0.1), sync_period=5, axis_name=AXIS),
    ("local_step", "anchor", "outer_state"),
  ),
}


@functools.cache
def _digits():
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  return (jnp.asarray(x[:1400]), jnp.asarray(y[:1400])), (x[1400:], y[1400:])


def _mlp_init(seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w1": jax.random.normal(k1, (64, 32)) / 8.0, "b1": jnp.zeros(32),
          "w2": jax.random.normal(k2, (32, 10)) / np.sqrt(32), "b2": jnp.zeros(10)}


def _mlp(p, x):
  return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _digits_run(tx):
  """The jitted training loop of every worker (vmap over the workers' axis)."""
  (x, y), _ = _digits()

  def loss(p, i):
    return optax.softmax_cross_entropy_with_integer_labels(_mlp(p, x[i]), y[i]).mean()

  def worker(params, state, idx):  # idx: (steps, batch) example indices
    def body(carry, i):
      p, s = carry
      updates, s = tx.update(jax.grad(loss)(p, i), s, p)
      return (optax.apply_updates(p, updates), s), None

    return jax.lax.scan(body, (params, state), idx)[0]

  return jax.jit(jax.vmap(worker, axis_name=AXIS))


def _digits_accuracy(state, params):
  _, (x, y) = _digits()
  p = jax.tree.map(lambda a: a[0], optax_dist.eval_params(state, params))
  return float(np.mean(np.argmax(np.asarray(_mlp(p, x)), -1) == y))


@functools.cache
def _digits_runs():
  """Every algorithm of :data:`DIGITS_ALGORITHMS` over seeds 0, 1, 2: 8 workers for 300 steps,
  then 300 more on 8 workers and, resized, on 4 (the global batch kept: 32 per worker, the same
  examples as the unresized run's second half, worker pairs merged). A phase of the three
  algorithms is one program. ``{name: [(state halfway, resized state, accuracy unresized,
  accuracy resized) per seed]}``."""
  names = sorted(DIGITS_ALGORITHMS)
  txs = [DIGITS_ALGORITHMS[name][0]() for name in names]
  runs = [_digits_run(tx) for tx in txs]
  together = jax.jit(lambda args: [run(*a) for run, a in zip(runs, args, strict=True)])
  w, half, b = DIGITS_WORKERS, DIGITS_STEPS // 2, DIGITS_BATCH
  results = {name: [] for name in names}
  for seed in range(3):
    idx = np.random.default_rng(seed).integers(0, 1400, size=(w, DIGITS_STEPS, b))
    params = jax.tree.map(lambda a: jnp.stack([a] * w), _mlp_init(seed))
    halfway = together([(params, jax.vmap(tx.init)(params), idx[:, :half]) for tx in txs])
    unresized = together([(p, s, idx[:, half:]) for p, s in halfway])
    resized = [optax_dist.resize_state(tx, s, p, w // 2)
               for tx, (p, s) in zip(txs, halfway, strict=True)]
    second = idx[:, half:].reshape(w // 2, 2, half, b).transpose(0, 2, 1, 3)
    ends = together([(p, s, second.reshape(w // 2, half, 2 * b)) for s, p in resized])
    for name, (_, state), (new_state, _), (p8, s8), (p4, s4) in zip(
        names, halfway, resized, unresized, ends, strict=True):
      results[name].append((state, new_state, _digits_accuracy(s8, p8),
                            _digits_accuracy(s4, p4)))
  return results


@pytest.mark.parametrize("name", sorted(DIGITS_ALGORITHMS))
def test_digits_resized_mid_run_trains_as_well_as_unresized(name):
  """8 workers for 300 steps, then 4 (the global batch kept: 32 per worker) for 300, against
  8 workers throughout; over seeds 0, 1, 2 the mean accuracies differ by less than the spread
  of the unresized runs' (the gap of seed noise)."""
  _, kept = DIGITS_ALGORITHMS[name]
  plain, resized = [], []
  for state, new_state, accuracy8, accuracy4 in _digits_runs()[name]:
    for field in kept:
      assert_tree_equal(getattr(new_state, field),
                        broadcast(getattr(state, field), DIGITS_WORKERS // 2))
    plain.append(accuracy8)
    resized.append(accuracy4)
  spread = max(plain) - min(plain)
  assert min(plain + resized) > 0.85, (plain, resized)  # both learned
  assert abs(np.mean(resized) - np.mean(plain)) <= spread, (plain, resized)
