"""streaming_diloco's ``overlap`` and ``eager`` against a float64 NumPy reference, and their edges.

N workers (2 and 4) train a quadratic, ``g_i = c_i * x_i - d_i(t)``, with F = 2 fragments (one
leaf each) and H = 4: fragment 0 sends on steps 2, 6, 10, ..., fragment 1 on 4, 8, 12, ... An
exchange sent on step s lands on s + overlap. The outer optimizer is SGD with momentum, so the
step an exchange lands on changes the momentum trace and everything after it. The reference is a
loop over the workers written from the rules (stale mean, eager share, mixing), not from the
implementation; the tolerances are far below what one step early or late, the fresh mean for
the stale one, a missing 1/N or swapped mixing weights move the params by.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist

AXIS = "workers"
H, F = 4, 2
STEPS = 14  # three and a half periods: every fragment sends and lands three times
SHAPES = {"a": (3,), "b": (2, 2)}
FRAGMENTS = {"a": 0, "b": 1}  # fragment 0 at s_0 = 2, fragment 1 at s_1 = 4 mod 4 = 0
INNER_LR, OUTER_LR, MOMENTUM = 0.1, 0.7, 0.9
RTOL, ATOL = 1e-6, 1e-6


def make(overlap, eager=False, mixing=0.0, axis_name=AXIS):
  return optax_dist.streaming_diloco(
    optax.sgd(INNER_LR), optax.sgd(OUTER_LR, momentum=MOMENTUM), sync_period=H,
    num_fragments=F, fragments=FRAGMENTS, mixing=mixing, overlap=overlap, eager=eager,
    axis_name=axis_name,
  )


def problem(n, seed=0):
  rng = np.random.RandomState(seed)
  x0 = {k: rng.uniform(-1, 1, s) for k, s in SHAPES.items()}
  c = {k: rng.uniform(0.5, 1.5, (n, *s)) for k, s in SHAPES.items()}
  d = {k: rng.normal(size=(STEPS, n, *s)) for k, s in SHAPES.items()}
  return x0, c, d


# ----------------------------------------------------------------------------------------------
# The reference.


def outer_sgd(delta, trace):
  """optax.sgd(lr, momentum): ``trace = delta + mu trace``, step ``-lr trace``."""
  trace = delta + MOMENTUM * trace
  return -OUTER_LR * trace, trace


def initial(x0, n):
  return {
    "x": [dict(x0) for _ in range(n)],
    "anchor": dict(x0),
    "trace": {k: np.zeros_like(v) for k, v in x0.items()},
    "pending": {},  # leaf -> (send step, mean pseudo-gradient, each worker's own)
  }


def reference(c, d, state, *, overlap, eager, mixing, start=0, stop=STEPS):
  """Steps ``start + 1 .. stop`` from ``state``; the workers' params after each step."""
  n = len(state["x"])
  x, anchor, trace = state["x"], dict(state["anchor"]), dict(state["trace"])
  pending = dict(state["pending"])
  history = []
  for t in range(start, stop):
    step = t + 1
    new_x = [{k: x[i][k] - INNER_LR * (c[k][i] * x[i][k] - d[k][t, i]) for k in x[i]}
             for i in range(n)]
    for k, f in FRAGMENTS.items():
      if step % H == ((f + 1) * H // F) % H:  # send: Delta_i = theta - x'_i, Delta their mean
        own = [anchor[k] - new_x[i][k] for i in range(n)]
        pending[k] = (step, np.mean(own, axis=0), own)
      if k in pending and step == pending[k][0] + overlap:  # land: the stale mean
        _, delta, own = pending.pop(k)
        step_k, new_trace = outer_sgd(delta, trace[k])
        for i in range(n):
          target = anchor[k] + step_k
          if eager:  # this worker's stale share replaced by its fresh one
            fresh = anchor[k] - new_x[i][k]
            target = anchor[k] + outer_sgd(delta + (fresh - own[i]) / n, trace[k])[0]
          new_x[i][k] = mixing * new_x[i][k] + (1 - mixing) * target
        anchor[k], trace[k] = anchor[k] + step_k, new_trace
    x = new_x
    history.append(x)
  return history, {"x": x, "anchor": anchor, "trace": trace, "pending": pending}


# ----------------------------------------------------------------------------------------------
# The runs: a whole run in one compiled program, under vmap or shard_map.


def worker_run(tx, x, c, d, state):
  def body(carry, d_t):
    x, s = carry
    g = jax.tree.map(lambda ci, xi, di: ci * xi - di, c, x, d_t)
    u, s = tx.update(g, s, x)
    x = optax.apply_updates(x, u)
    return (x, s), x

  (_, state), history = jax.lax.scan(body, (x, state), d)
  return history, state


def as_inputs(tx, x, c, d, state=None):
  """float32 arrays, ``d`` workers first, and the workers' initial state if none is given."""
  x = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), x)
  c, d = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (c, d))
  d = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), d)
  if state is None:
    state = jax.vmap(tx.init, axis_name=AXIS)(x)
  return x, c, d, state


def steps_first(history):
  return jax.tree.map(lambda a: np.swapaxes(np.asarray(a, np.float64), 0, 1), history)


def run_together(runs):
  """Several runs under vmap, ``runs`` a list of ``(tx, x, c, d)`` as :func:`run` takes them,
  compiled as one program (each run's a part of it: one compilation instead of one per run);
  a list of ``(history, state)``."""
  txs = [tx for tx, *_ in runs]
  inputs = [as_inputs(*run) for run in runs]

  def together(inputs):
    return [jax.vmap(functools.partial(worker_run, tx), axis_name=AXIS)(*args)
            for tx, args in zip(txs, inputs, strict=True)]

  return [(steps_first(history), state) for history, state in jax.jit(together)(inputs)]


def run(tx, x, c, d, state=None, mapping="vmap"):
  """``x`` and ``c`` stacked over the workers, ``d`` steps first; history steps first."""
  n = jax.tree.leaves(c)[0].shape[0]
  x, c, d, state = as_inputs(tx, x, c, d, state)
  fn = lambda *args: worker_run(tx, *args)  # noqa: E731
  if mapping == "vmap":
    history, state = jax.jit(jax.vmap(fn, axis_name=AXIS))(x, c, d, state)
  else:
    mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])
    squeeze = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
    expand = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
    mapped = jax.shard_map(
      lambda *args: expand(fn(*squeeze(args))), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)
    )
    put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P(AXIS)))  # noqa: E731
    history, state = jax.jit(mapped)(put(x), put(c), put(d), put(state))
  return steps_first(history), state


def stacked(x0, n):
  return {k: np.broadcast_to(v, (n, *v.shape)) for k, v in x0.items()}


def assert_history_close(history, reference_history, first_step=1):
  for t, workers in enumerate(reference_history):
    for i, x in enumerate(workers):
      for k in x:
        np.testing.assert_allclose(
          history[k][t, i], x[k], rtol=RTOL, atol=ATOL,
          err_msg=f"step {first_step + t} worker {i} leaf {k}",
        )


def assert_anchor_close(state, ref_state):
  for k, v in ref_state["anchor"].items():
    for row in np.asarray(state.anchor[k], np.float64):
      np.testing.assert_allclose(row, v, rtol=RTOL, atol=ATOL, err_msg=f"anchor {k}")


# ----------------------------------------------------------------------------------------------
# Against the reference.

CASES = [
  (n, overlap, eager, mixing)
  for n in (2, 4)
  for overlap in (0, 1, 2, 3)
  for eager in (False, True)
  for mixing in (0.0, 0.3)
  if overlap or not eager
]


@pytest.fixture(scope="module")
def vmap_runs():
  """Every case of :data:`CASES` run under vmap, all in one compiled program."""
  runs = []
  for n, overlap, eager, mixing in CASES:
    x0, c, d = problem(n)
    runs.append((make(overlap, eager, mixing), stacked(x0, n), c, d))
  return dict(zip(CASES, run_together(runs), strict=True))


@pytest.mark.parametrize("n,overlap,eager,mixing", CASES)
def test_matches_numpy_reference_under_vmap(vmap_runs, n, overlap, eager, mixing):
  """overlap 2 lands fragment 0 on fragment 1's send step; overlap 3 has both in flight."""
  x0, c, d = problem(n)
  history, state = vmap_runs[n, overlap, eager, mixing]
  ref_history, ref_state = reference(
    c, d, initial(x0, n), overlap=overlap, eager=eager, mixing=mixing
  )
  assert_history_close(history, ref_history)
  assert_anchor_close(state, ref_state)


@pytest.mark.parametrize("overlap,eager", [(3, True), (2, False)])
def test_matches_numpy_reference_under_shard_map(overlap, eager):
  n = 4
  x0, c, d = problem(n, seed=1)
  history, state = run(make(overlap, eager, 0.3), stacked(x0, n), c, d, mapping="shard_map")
  ref_history, ref_state = reference(c, d, initial(x0, n), overlap=overlap, eager=eager,
                                     mixing=0.3)
  assert_history_close(history, ref_history)
  assert_anchor_close(state, ref_state)


def test_overlap_zero_is_the_default_bit_for_bit():
  """overlap=0 runs the code path of a streaming_diloco without it, with the same state leaves."""
  n = 2
  x0, c, d = problem(n)
  tx = optax_dist.streaming_diloco(
    optax.sgd(INNER_LR), optax.sgd(OUTER_LR, momentum=MOMENTUM), sync_period=H,
    num_fragments=F, fragments=FRAGMENTS, mixing=0.3, axis_name=AXIS,
  )
  (history, state), (history_0, state_0) = run_together(
    [(tx, stacked(x0, n), c, d), (make(0, mixing=0.3), stacked(x0, n), c, d)])
  for k in history:
    np.testing.assert_array_equal(history_0[k], history[k])
  jax.tree.map(np.testing.assert_array_equal, state_0, state)
  assert state.in_flight is None and state.in_flight_step is None and state.own_in_flight is None
  assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(state[:4]))


def test_state_fields_and_memory():
  """overlap >= 1 adds one params-sized field and F counters; eager one more params-sized."""
  x0, _, _ = problem(1)
  params = {k: jnp.asarray(v, jnp.float32) for k, v in x0.items()}
  plain = make(1, axis_name=None).init(params)
  eager = make(1, eager=True, axis_name=None).init(params)
  assert jax.tree.structure(plain.in_flight) == jax.tree.structure(params)
  assert plain.in_flight_step.shape == (F,) and plain.in_flight_step.dtype == jnp.int32
  assert plain.own_in_flight is None
  assert jax.tree.structure(eager.own_in_flight) == jax.tree.structure(params)
  size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
  assert size(plain) == size(make(0, axis_name=None).init(params)) + size(params) + F
  assert size(eager) == size(plain) + size(params)


# ----------------------------------------------------------------------------------------------
# The static hint, resize_state and eval_params with an exchange in flight.


def shard_map_step(tx, n, **hint):
  mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])
  squeeze = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
  expand = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731

  def worker_step(g, s, x):
    u, s = tx.update(g, s, x, **hint)
    return optax.apply_updates(x, u), s

  step = jax.jit(jax.shard_map(
    lambda *a: expand(worker_step(*squeeze(a))), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)
  ))
  put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P(AXIS)))  # noqa: E731
  return step, put


@pytest.mark.parametrize("eager", [False, True])
def test_hinted_landing_only_step_has_no_collective_and_lands(eager):
  """overlap=1: fragment 0 sends on step 2 and lands on step 3, where nothing is sent. Step 3
  hinted ``communicate=False`` compiles with no collective and gives the rule's result."""
  n = 4
  x0, c, d = problem(n)
  tx = make(1, eager, 0.3)
  x = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), stacked(x0, n))
  c32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), c)
  history, state = run(tx, x, c, {k: v[:2] for k, v in d.items()})  # steps 1 and 2
  assert np.all(np.asarray(state.in_flight_step) == [2, 0])  # fragment 0 in flight
  x2 = {k: jnp.asarray(history[k][-1], jnp.float32) for k in history}
  g = jax.tree.map(lambda ci, xi, di: ci * xi - di, c32, x2,
                   {k: jnp.asarray(v[2], jnp.float32) for k, v in d.items()})
  hinted, put = shard_map_step(tx, n, communicate=False)
  ruled, _ = shard_map_step(tx, n)
  args = (put(g), put(state), put(x2))
  report = optax_dist.communication_report(hinted, *args)
  assert not report.collectives, str(report)
  assert optax_dist.communication_report(ruled, *args).collectives  # the rule's send conds
  x_hinted, s_hinted = hinted(*args)
  x_ruled, s_ruled = ruled(*args)
  assert np.all(np.asarray(s_hinted.in_flight_step) == 0)
  for k in x_hinted:
    np.testing.assert_allclose(np.asarray(x_hinted[k]), np.asarray(x_ruled[k]), rtol=1e-6)
  ref_history, _ = reference(c, d, initial(x0, n), overlap=1, eager=eager, mixing=0.3, stop=3)
  for i in range(n):
    for k in x0:
      np.testing.assert_allclose(np.asarray(x_hinted[k])[i], ref_history[-1][i][k], rtol=RTOL,
                                 atol=ATOL)


def test_hinted_false_on_a_send_step_sends_nothing_and_nothing_lands():
  """A skipped send leaves nothing in flight: overlap steps later the fragment does not land."""
  n = 2
  x0, c, d = problem(n)
  tx = make(1)
  x = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), stacked(x0, n))
  state = jax.vmap(tx.init, axis_name=AXIS)(x)
  step = jax.jit(jax.vmap(
    lambda g, s, p, hint: tx.update(g, s, p, communicate=hint), axis_name=AXIS,
    in_axes=(0, 0, 0, None)), static_argnums=3)
  anchor0 = state.anchor
  for t in range(3):  # step 2 (fragment 0's send) hinted False; step 3 would be its landing
    g = jax.tree.map(lambda a: jnp.ones_like(a) * (t + 1), x)
    u, state = step(g, state, x, False)
    x = optax.apply_updates(x, u)
  assert np.all(np.asarray(state.in_flight_step) == 0)
  jax.tree.map(np.testing.assert_array_equal, state.anchor, anchor0)


RESIZE_N, RESIZE_M, RESIZE_OVERLAP, RESIZE_MIXING = 4, 2, 3, 0.3


@pytest.fixture(scope="module")
def resized_runs():
  """Both eager settings of the test below: ``RESIZE_N`` workers for 4 steps, resized to
  ``RESIZE_M``, then the remaining steps; each phase of the two settings one program.
  ``{eager: (state after step 4, the resized state and params, history and state after)}``."""
  n, m = RESIZE_N, RESIZE_M
  x0, c, d = problem(n)
  txs = [make(RESIZE_OVERLAP, eager, RESIZE_MIXING) for eager in (False, True)]
  first = run_together([(tx, stacked(x0, n), c, {k: v[:4] for k, v in d.items()}) for tx in txs])
  resized = [optax_dist.resize_state(
    tx, state, {k: jnp.asarray(history[k][-1], jnp.float32) for k in history}, m)
    for tx, (history, state) in zip(txs, first, strict=True)]
  c_m, rest = {k: v[:m] for k, v in c.items()}, {k: v[4:, :m] for k, v in d.items()}
  after = run_together([(tx, new_params, c_m, rest, new_state)
                        for tx, (new_state, new_params) in zip(txs, resized, strict=True)])
  return {eager: (state, *new, *later)
          for eager, (_, state), new, later in zip((False, True), first, resized, after,
                                                    strict=True)}


@pytest.mark.parametrize("eager", [False, True])
def test_resize_with_exchanges_in_flight(resized_runs, eager):
  """overlap=3, after step 4: fragment 0 (sent on 2) and fragment 1 (sent on 4) in flight. Four
  workers become two: the exchanges in flight are kept and land on steps 5 and 7 as scheduled;
  the params restart from the anchor; each new worker's own share (eager) is the old mean."""
  n, m, overlap, mixing = RESIZE_N, RESIZE_M, RESIZE_OVERLAP, RESIZE_MIXING
  x0, c, d = problem(n)
  state, new_state, new_params, history, state2 = resized_runs[eager]
  _, ref = reference(c, d, initial(x0, n), overlap=overlap, eager=eager, mixing=mixing, stop=4)
  assert np.all(np.asarray(state.in_flight_step) == [2, 4])

  assert np.asarray(new_state.in_flight_step).shape == (m, F)
  assert np.all(np.asarray(new_state.in_flight_step) == [2, 4])
  for k in x0:
    for field in ("anchor", "in_flight"):
      np.testing.assert_array_equal(
        np.asarray(getattr(new_state, field)[k]),
        np.broadcast_to(np.asarray(getattr(state, field)[k])[0], (m, *x0[k].shape)))
    np.testing.assert_array_equal(np.asarray(new_params[k]), np.asarray(new_state.anchor[k]))
    if eager:
      np.testing.assert_allclose(
        np.asarray(new_state.own_in_flight[k])[0],
        np.mean(np.asarray(state.own_in_flight[k], np.float64), axis=0), rtol=1e-6, atol=1e-7)

  # The reference resized as the rule says, then run on: workers from the anchor, the pending
  # means and momentum kept, each new worker's own share the old workers' mean.
  resized = {
    "x": [dict(ref["anchor"]) for _ in range(m)], "anchor": ref["anchor"], "trace": ref["trace"],
    "pending": {k: (s, delta, [np.mean(own, axis=0)] * m)
                for k, (s, delta, own) in ref["pending"].items()},
  }
  c_m = {k: v[:m] for k, v in c.items()}
  d_m = {k: v[:, :m] for k, v in d.items()}
  ref_history, ref_state = reference(c_m, d_m, resized, overlap=overlap, eager=eager,
                                     mixing=mixing, start=4)
  assert_history_close(history, ref_history, first_step=5)
  assert_anchor_close(state2, ref_state)


def test_eval_params_returns_the_anchor_without_the_exchange_in_flight():
  n = 2
  x0, c, d = problem(n)
  tx = make(2)
  history, state = run(tx, stacked(x0, n), c, {k: v[:5] for k, v in d.items()})
  assert np.all(np.asarray(state.in_flight_step) == [0, 4])  # fragment 1 sent on 4, lands on 6
  params = {k: jnp.asarray(history[k][-1], jnp.float32) for k in history}
  evaluated = jax.vmap(optax_dist.eval_params)(state, params)
  for k in params:
    np.testing.assert_array_equal(np.asarray(evaluated[k]), np.asarray(state.anchor[k]))
  _, ref_state = reference(c, d, initial(x0, n), overlap=2, eager=False, mixing=0.0, stop=5)
  assert "b" in ref_state["pending"]
  for k, v in ref_state["anchor"].items():
    np.testing.assert_allclose(np.asarray(evaluated[k][0], np.float64), v, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------------------------
# Bad arguments.


@pytest.mark.parametrize("overlap", [4, 5, 100])
def test_overlap_of_a_period_or_more_raises(overlap):
  with pytest.raises(ValueError, match=rf"`streaming_diloco\(overlap=...\)` must be an int in "
                     rf"\[0, sync_period\) = \[0, 4\) .*got {overlap}\."):
    make(overlap)


def test_bad_overlap_and_eager_raise():
  with pytest.raises(ValueError, match=r"overlap=\.\.\.\)` must be an int in .*got -1\."):
    make(-1)
  with pytest.raises(TypeError, match=r"`streaming_diloco\(overlap=...\)` must be an int"):
    make(1.5)
  with pytest.raises(ValueError, match=r"`streaming_diloco\(eager=True\)` needs overlap >= 1"):
    make(0, eager=True)
  with pytest.raises(TypeError, match=r"`streaming_diloco\(eager=...\)` must be a bool"):
    make(1, eager="yes")


# ----------------------------------------------------------------------------------------------
# Checkpoints written before the overlap fields existed.


class FourFieldState(NamedTuple):
  """The state's fields before ``overlap``: what such a checkpoint holds."""

  local_step: jax.Array
  anchor: dict
  inner_state: tuple
  outer_state: tuple


def test_a_four_field_checkpoint_restores_with_the_guide_recipe(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  n = 2
  x0, c, d = problem(n)
  tx = make(0, mixing=0.3)
  history, state = run(tx, stacked(x0, n), c, {k: v[:5] for k, v in d.items()})
  params = {k: jnp.asarray(history[k][-1], jnp.float32) for k in history}
  path = str(tmp_path / "old")
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, {"params": params, "opt_state": FourFieldState(*state[:4])})

  init = jax.vmap(tx.init, axis_name=AXIS)
  abstract = jax.eval_shape(lambda p: {"params": p, "opt_state": init(p)}, params)
  with ocp.StandardCheckpointer() as ckpt, pytest.raises(ValueError, match="in_flight"):
    ckpt.restore(path, abstract)  # three more fields: Orbax refuses
  old = ("local_step", "anchor", "inner_state", "outer_state")
  abstract["opt_state"] = {k: getattr(abstract["opt_state"], k) for k in old}
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(path, abstract)
  opt_state = optax_dist.StreamingDiLoCoState(**restored["opt_state"])
  jax.tree.map(np.testing.assert_array_equal, opt_state, state)
  assert jax.tree.structure(opt_state) == jax.tree.structure(state)
