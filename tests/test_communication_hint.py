"""The static ``communicate`` extra argument of the transformations with a periodic exchange.

* A hint that agrees with the counter rule gives the same params and state as no hint (to float
  rounding), under ``vmap`` and under ``shard_map`` with params and state donated.
* A hinted step has no conditional (and a ``False`` step no collective); ``streaming_diloco``
  keeps its fragments' conditionals on a ``True`` step.
* A hint that disagrees with the rule adds or skips that one exchange; the counter still
  advances, so the rule's later exchanges stay where they were.
* The hint is consumed, not forwarded to ``inner``; a traced or non-bool hint raises.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

AXIS = "w"
N = 4
PERIOD = 3
STEPS = 2 * 3 * PERIOD


def nesterov():
  return optax.sgd(0.7, momentum=0.9, nesterov=True)


def transformations():
  adam = optax.adam(1e-2)
  return {
    "elastic_average": optax_dist.elastic_average(
      adam, communication_period=PERIOD, moving_rate=0.1, rho=0.1, axis_name=AXIS),
    "agn": optax_dist.agn(adam, communication_period=PERIOD, axis_name=AXIS),
    "agn_mean": optax_dist.agn(
      adam, communication_period=PERIOD, center_update="mean", axis_name=AXIS),
    "diloco": optax_dist.diloco(adam, nesterov(), sync_period=PERIOD, axis_name=AXIS),
    "local_sgd": optax_dist.local_sgd(adam, sync_period=PERIOD, warmup_steps=2, axis_name=AXIS),
    "streaming_diloco": optax_dist.streaming_diloco(
      adam, nesterov(), sync_period=2 * PERIOD, num_fragments=2, mixing=0.5,
      fragments={"w": 0, "b": 1}, axis_name=AXIS),
  }


NAMES = list(transformations())


def rule(name, step):
  """The counter rule of each transformation above, written out: does ``step`` (from 1) sync?"""
  if name == "local_sgd":
    return step > 2 and (step - 2) % PERIOD == 0
  if name == "streaming_diloco":  # fragment f at s_f = floor((f + 1) H / F) mod H: 3 and 0
    return step % (2 * PERIOD) in (PERIOD, 0)
  return step % PERIOD == 0


def worker_params():
  """The same initial params on every worker (stacked), as data-parallel training starts."""
  one = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2), "b": jnp.ones(2)}
  return jax.tree.map(lambda p: jnp.broadcast_to(p, (N,) + p.shape), one)


def grads_at(step, params, worker):
  """Gradients that differ between the workers (``worker``: the worker's index)."""
  return jax.tree.map(lambda p: jnp.sin(3.0 * p + step + worker), params)


WORKERS = jnp.arange(N, dtype=jnp.float32)

# The hinted and the rule's programs are fused differently by XLA, so they agree to float
# rounding, not bit for bit; a step on the wrong schedule moves the params by ~1e-2.
RTOL, ATOL = 1e-5, 1e-7


def vmapped_updates(tx):
  """``tx.update`` under ``vmap``, jitted once for each value of ``communicate`` (``None``: the
  rule's schedule)."""

  def jitted(hint):
    kwargs = {} if hint is None else {"communicate": hint}
    return jax.jit(jax.vmap(functools.partial(tx.update, **kwargs), axis_name=AXIS))

  return {hint: jitted(hint) for hint in (None, False, True)}


def run_vmap(tx, hints):
  """``len(hints)`` steps under ``vmap``, step ``t`` given ``communicate=hints[t - 1]``."""
  params = worker_params()
  state = jax.vmap(tx.init, axis_name=AXIS)(params)
  updates_of = vmapped_updates(tx)
  for t, hint in enumerate(hints, start=1):
    grads = jax.vmap(grads_at, in_axes=(None, 0, 0))(t, params, WORKERS)
    updates, state = updates_of[hint](grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def run_vmap_together(runs):
  """Several runs of :func:`run_vmap`'s steps, ``runs`` a list of ``(tx, hints, dtype)`` (the
  params in ``dtype``, the gradients in float32), ``STEPS`` steps. One jitted program for each
  value of the hint steps every run with that value; step ``t`` of a run is the result of the
  program of its ``hints[t - 1]`` (a program for each hint for all the runs instead of one per
  hint and transformation). Per run: its params and state, and the dtypes of its initial state
  and of its state after each step."""
  txs = [tx for tx, _, _ in runs]

  @functools.partial(jax.jit, static_argnums=0)
  def step(hint, t, carries):
    kwargs = {} if hint is None else {"communicate": hint}
    out = []
    for tx, (params, state) in zip(txs, carries, strict=True):
      grads = jax.vmap(grads_at, in_axes=(None, 0, 0))(
        t, jax.tree.map(lambda p: p.astype(jnp.float32), params), WORKERS)
      updates, state = jax.vmap(functools.partial(tx.update, **kwargs), axis_name=AXIS)(
        grads, state, params)
      out.append((optax.apply_updates(params, updates), state))
    return out

  carries = []
  for tx, _, dtype in runs:
    params = jax.tree.map(lambda p, dtype=dtype: p.astype(dtype), worker_params())
    carries.append((params, jax.vmap(tx.init, axis_name=AXIS)(params)))
  states = [[state] for _, state in carries]
  for t in range(STEPS):
    hints = [hints[t] for _, hints, _ in runs]
    stepped = {hint: step(hint, jnp.float32(t + 1), carries) for hint in set(hints)}
    carries = [stepped[hint][i] for i, hint in enumerate(hints)]
    for seen, (_, state) in zip(states, carries, strict=True):
      seen.append(state)
  dtypes = [[jax.tree.map(lambda x: x.dtype, state) for state in seen] for seen in states]
  return [(params, state, seen[0], seen[1:])
          for (params, state), seen in zip(carries, dtypes, strict=True)]


@pytest.fixture(scope="module")
def vmap_runs():
  """Every transformation on the counter rule's schedule and with the hints that agree with it,
  float32 and bfloat16 params: ``{(name, dtype): (ruled, hinted)}``, each as
  :func:`run_vmap_together` gives it (the ruled runs together, the hinted together)."""
  keys = [(name, dtype) for name in NAMES for dtype in (jnp.float32, jnp.bfloat16)]
  txs = transformations()
  ruled = run_vmap_together([(txs[name], [None] * STEPS, dtype) for name, dtype in keys])
  hinted = run_vmap_together([(txs[name], [rule(name, t) for t in range(1, STEPS + 1)], dtype)
                              for name, dtype in keys])
  return dict(zip(keys, zip(ruled, hinted, strict=True), strict=True))


@pytest.mark.parametrize("name", NAMES)
def test_hint_agreeing_with_the_rule_gives_the_rule_s_results_under_vmap(vmap_runs, name):
  (*expected, _, _), (*got, _, _) = vmap_runs[name, jnp.float32]
  chex.assert_trees_all_close(got, expected, rtol=RTOL, atol=ATOL)


def squeeze(tree):
  return jax.tree.map(lambda x: x[0], tree)


def unsqueeze(tree):
  return jax.tree.map(lambda x: x[None], tree)


def sharded_step(tx, mesh, communicate=None):
  """One training step of every worker under ``shard_map``, with ``communicate`` if given."""
  kwargs = {} if communicate is None else {"communicate": communicate}

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P()),
                     out_specs=(P(AXIS), P(AXIS)))
  def step(params, state, t):
    params, state = squeeze(params), squeeze(state)
    grads = grads_at(t, params, jax.lax.axis_index(AXIS))
    updates, state = tx.update(grads, state, params, **kwargs)
    return unsqueeze(optax.apply_updates(params, updates)), unsqueeze(state)

  return step


def mesh_of_workers():
  return jax.make_mesh((N,), (AXIS,), devices=jax.devices()[:N])


@pytest.fixture(scope="module")
def shard_map_runs():
  """Every transformation's ``STEPS`` steps under ``shard_map``, params and state donated right
  after an eager ``init``, on the rule's schedule and with the hints that agree with it; a step
  of every transformation is one call of one jitted function (``communicate`` static: a program
  for each combination of the transformations' hints). ``{name: (ruled, hinted)}``."""
  txs = [transformations()[name] for name in NAMES]
  mesh = mesh_of_workers()
  split = NamedSharding(mesh, P(AXIS))
  jitted = jax.jit(lambda carries, t, communicate: [
    sharded_step(tx, mesh, hint)(*carry, t)
    for tx, hint, carry in zip(txs, communicate, carries, strict=True)
  ], static_argnames="communicate", donate_argnums=0)
  results = []
  for hinted in (False, True):
    carries = [(jax.device_put(worker_params(), split),
                jax.device_put(jax.vmap(tx.init, axis_name=AXIS)(worker_params()), split))
               for tx in txs]
    for t in range(1, STEPS + 1):
      hints = tuple(rule(name, t) if hinted else None for name in NAMES)
      carries = jitted(carries, jnp.float32(t), communicate=hints)
    results.append(jax.device_get(carries))
  return dict(zip(NAMES, zip(*results, strict=True), strict=True))


@pytest.mark.parametrize("name", NAMES)
def test_hint_under_shard_map_with_donation(shard_map_runs, name):
  """Steps compiled from one function (``communicate`` static), params and state donated right
  after an eager ``init``: the same results as the rule's compiled step."""
  ruled, hinted = shard_map_runs[name]
  chex.assert_trees_all_close(hinted, ruled, rtol=RTOL, atol=ATOL)


def primitives(jaxpr):
  """The names of every primitive in ``jaxpr`` and in its sub-jaxprs."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else [value]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          names |= primitives(sub)
  return names


def update_primitives(tx, hint):
  """The primitives of one step under ``shard_map`` (under ``vmap`` a ``cond`` on a per-worker
  counter becomes a ``select`` and a ``psum`` a sum)."""
  mesh = mesh_of_workers()
  split = NamedSharding(mesh, P(AXIS))
  params = jax.device_put(worker_params(), split)
  state = jax.device_put(jax.vmap(tx.init, axis_name=AXIS)(worker_params()), split)
  step = sharded_step(tx, mesh, hint)
  return primitives(jax.make_jaxpr(step)(params, state, jnp.float32(1)).jaxpr)


COLLECTIVES = {"psum", "all_gather", "psum_invariant"}


@pytest.mark.parametrize("name", NAMES)
def test_hinted_steps_have_no_conditional(name):
  tx = transformations()[name]
  assert "cond" in update_primitives(tx, None)
  quiet = update_primitives(tx, False)
  warm_up = name == "local_sgd"  # its warm-up all-reduce follows the counter, hint or not
  assert ("cond" in quiet) == warm_up
  assert bool(quiet & COLLECTIVES) == warm_up
  loud = update_primitives(tx, True)
  assert ("cond" in loud) == (warm_up or name == "streaming_diloco")
  assert loud & COLLECTIVES


def test_without_warm_up_local_sgd_steps_have_no_conditional():
  tx = optax_dist.local_sgd(optax.sgd(0.1), sync_period=PERIOD, axis_name=AXIS)
  assert not {"cond"} & (update_primitives(tx, False) | update_primitives(tx, True))
  assert not update_primitives(tx, False) & COLLECTIVES


def test_false_on_a_due_step_skips_that_exchange_only():
  """diloco with outer sgd(1): a sync sets every worker to the mean of the x'_j. Skipping the
  sync of step 3 leaves the workers apart; the rule still syncs on step 6."""
  tx = optax_dist.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_period=PERIOD, axis_name=AXIS)
  hints = [None, None, False]
  params, state = run_vmap(tx, hints)
  unsynced, _ = run_vmap(optax_dist.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_period=100,
                                           axis_name=AXIS), [None] * 3)
  chex.assert_trees_all_close(params, unsynced)
  assert np.asarray(state.local_step).tolist() == [3] * N
  chex.assert_trees_all_equal(state.anchor, worker_params())  # never synced
  params, state = run_vmap(tx, hints + [None] * 3)
  for leaf in jax.tree.leaves(params):  # step 6: every worker on the anchor
    np.testing.assert_allclose(leaf, np.broadcast_to(leaf[:1], leaf.shape), rtol=1e-6)
  chex.assert_trees_all_close(params, state.anchor, rtol=1e-6)


def test_true_off_schedule_adds_one_exchange():
  """elastic_average with sgd(1), alpha = 1/4, rho = 0 and zero gradients: an exchange moves
  each worker a quarter of the way to the (initially zero) center and the center by the sum of
  those moves. ``True`` on step 1 of a period-3 schedule does that; steps 2 (no hint) and 3
  (the rule's) then follow."""
  tx = optax_dist.elastic_average(optax.sgd(1.0), communication_period=PERIOD,
                                  moving_rate=0.25, axis_name=AXIS)
  x = np.arange(1.0, N + 1.0)
  params = {"x": jnp.asarray(x)}
  state = jax.vmap(tx.init, axis_name=AXIS)({"x": jnp.zeros(N)})
  center = 0.0
  expected = x.copy()
  for t, hint in enumerate([True, None, None], start=1):
    kwargs = {} if hint is None else {"communicate": hint}
    update = jax.vmap(functools.partial(tx.update, **kwargs), axis_name=AXIS)
    updates, state = update({"x": jnp.zeros(N)}, state, params)
    params = optax.apply_updates(params, updates)
    if t in (1, 3):  # NumPy reference of the exchange
      d = 0.25 * (expected - center)
      expected, center = expected - d, center + d.sum()
    np.testing.assert_allclose(params["x"], expected, rtol=1e-6)
    np.testing.assert_allclose(state.center["x"], np.full(N, center), rtol=1e-6)
  assert np.asarray(state.local_step).tolist() == [3] * N


def test_streaming_true_lets_the_rule_choose_the_fragment():
  tx = transformations()["streaming_diloco"]
  hints = [True] * STEPS  # True on every step: only the rule's fragment syncs
  chex.assert_trees_all_equal(run_vmap(tx, hints), run_vmap(tx, [None] * STEPS))


class Recorder:
  """An inner transformation (sgd 1) that records the extra args it is given."""

  def __init__(self):
    self.seen = []

  def transformation(self):
    def update(updates, state, params=None, **extra_args):
      self.seen.append(sorted(extra_args))
      return jax.tree.map(jnp.negative, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("name", ["elastic_average", "agn", "diloco", "local_sgd",
                                  "streaming_diloco"])
def test_hint_is_not_forwarded_to_inner(name):
  recorder = Recorder()
  inner = recorder.transformation()
  tx = {
    "elastic_average": lambda: optax_dist.elastic_average(inner, axis_name=AXIS),
    "agn": lambda: optax_dist.agn(inner, axis_name=AXIS),
    "diloco": lambda: optax_dist.diloco(inner, nesterov(), axis_name=AXIS),
    "local_sgd": lambda: optax_dist.local_sgd(inner, sync_period=PERIOD, axis_name=AXIS),
    "streaming_diloco": lambda: optax_dist.streaming_diloco(
      inner, nesterov(), num_fragments=2, fragments={"w": 0, "b": 1}, axis_name=AXIS),
  }[name]()
  params = worker_params()
  state = jax.vmap(tx.init, axis_name=AXIS)(params)
  update = functools.partial(tx.update, communicate=False, grad_step=3)
  jax.vmap(update, axis_name=AXIS)(params, state, params)
  assert ["grad_step"] in recorder.seen
  assert not any("communicate" in seen for seen in recorder.seen)


@pytest.mark.parametrize("hint", [1, "yes", np.array(True), jnp.bool_(True)])
def test_a_hint_that_is_not_a_bool_raises(hint):
  tx = transformations()["diloco"]
  params = worker_params()
  state = jax.vmap(tx.init, axis_name=AXIS)(params)
  update = functools.partial(tx.update, communicate=hint)
  with pytest.raises(TypeError, match=r"`diloco`: the extra argument `communicate` must be"):
    jax.vmap(update, axis_name=AXIS)(params, state, params)


def test_a_traced_hint_raises():
  tx = transformations()["elastic_average"]
  params = worker_params()
  state = jax.vmap(tx.init, axis_name=AXIS)(params)

  @jax.jit
  def step(params, state, communicate):
    update = functools.partial(tx.update, communicate=communicate)
    return jax.vmap(update, axis_name=AXIS)(params, state, params)

  with pytest.raises(TypeError, match=r"fixed at trace time; got .*Tracer"):
    step(params, state, True)


def test_flax_train_state_on_a_2d_mesh_with_a_tuple_axis():
  """``TrainState.apply_gradients(grads=..., communicate=...)`` passes the hint to ``update``:
  diloco over the tuple axis ``("hosts", "gpus")`` of a 2x2 mesh, a jitted step donating the
  state, two steps compiled from one function; the same state as the counter rule's."""
  from optax_dist.flax import TrainState

  axes = ("hosts", "gpus")
  mesh = jax.make_mesh((2, 2), axes, devices=jax.devices()[:4])
  spec = P(axes)
  tx = optax_dist.diloco(optax.adam(1e-2), nesterov(), sync_period=PERIOD, axis_name=axes)

  def init(params):
    state = TrainState.create(apply_fn=None, params=squeeze(params), tx=tx)
    return unsqueeze(jax.tree.map(jnp.asarray, state))  # its step is a Python int

  def train_step(state, communicate=None):
    kwargs = {} if communicate is None else {"communicate": communicate}

    def per_worker(state):
      state = squeeze(state)
      worker = jax.lax.axis_index(axes).astype(jnp.float32)
      grads = grads_at(state.step.astype(jnp.float32), state.params, worker)
      return unsqueeze(state.apply_gradients(grads=grads, **kwargs))

    return jax.shard_map(per_worker, mesh=mesh, in_specs=spec, out_specs=spec)(state)

  step = jax.jit(train_step, static_argnames="communicate", donate_argnums=0)
  create = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=spec, out_specs=spec))
  finals = []
  for hinted in (False, True):
    state = create(jax.device_put(worker_params(), NamedSharding(mesh, spec)))
    for t in range(1, STEPS + 1):
      state = step(state, communicate=t % PERIOD == 0 if hinted else None)
    finals.append(jax.device_get((state.step, state.params, state.opt_state)))
  chex.assert_trees_all_close(finals[1], finals[0], rtol=RTOL, atol=ATOL)
  for leaf in jax.tree.leaves(finals[1][1]):  # step 18 synced: every worker on the anchor
    np.testing.assert_allclose(leaf, np.broadcast_to(leaf[:1], leaf.shape), rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_hint_with_gradients_in_another_dtype(vmap_runs, name):
  """bfloat16 params and float32 gradients: the hinted steps give the rule's params and state
  (to two bfloat16 roundings, 2**-7 relative: one on each side), in the params' and the state's
  own dtypes. A sync one step early or late moves the params by ~1e-2, far more."""
  (*ruled, ruled_init, ruled_steps), (*hinted, hinted_init, hinted_steps) = vmap_runs[
    name, jnp.bfloat16]
  assert all(dtypes == ruled_init for dtypes in ruled_steps)
  assert all(dtypes == hinted_init for dtypes in hinted_steps)
  chex.assert_trees_all_equal_dtypes(hinted, ruled)
  chex.assert_trees_all_close(
    jax.tree.map(lambda x: x.astype(jnp.float32), hinted),
    jax.tree.map(lambda x: x.astype(jnp.float32), ruled), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("hint", [False, True])
def test_hint_with_a_misspelled_axis_raises(name, hint):
  """A hinted step has no collective when ``False``, but an axis name that is not bound still
  raises: no worker silently trains alone."""
  tx = transformations()[name]
  params = worker_params()
  state = jax.vmap(tx.init, axis_name=AXIS)(params)
  update = functools.partial(tx.update, communicate=hint)
  with pytest.raises(ValueError, match=f"'{AXIS}'"):
    jax.vmap(update, axis_name="workers")(params, state, params)
