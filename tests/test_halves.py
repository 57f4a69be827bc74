"""The public halves of a DiLoCo-family round, merged outside the transformation.

Each test runs the transformation's ``update`` for several workers under
``jax.vmap(axis_name=...)`` and, in the same program, each worker's local half
(``*_payload``) from the same state; the payloads leave the program, are merged in rank order by
``merge_payloads`` and fed to the outer half (``*_outer_step``), whose results must be the
transformation's own: bit for bit for 2 workers and for the gathered and quantized formats
(summed in float32 in worker order), within one unit in the last place otherwise (the order of
a ``psum``'s additions).

The optimizers' products are exact (see ``_inner``), so the comparisons of the states are bit
for bit too: XLA fuses the outer step differently in different programs, and with inexact
products (``optax.sgd(0.7, momentum=0.9, nesterov=True)``) an FMA there moves the new anchor by
an ulp or so whatever the halves do.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist

AXIS = "w"
SHAPES = {"a": (4, 3), "b": (5,), "c": (2,)}  # b: 5 values, not a multiple of the blocks
BLOCK = 4
FORMATS = {
  "none": None, "bfloat16": jnp.bfloat16, "float8": jnp.float8_e4m3fn, "int8": "int8",
  "float4": "float4_e2m1fn",
}
QUANTIZED = ("int8", "float4")


def _wire(fmt: str) -> dict:
  """The exchange arguments of ``fmt``: a block size only with a block-quantized format."""
  return {"comm_dtype": FORMATS[fmt], "comm_block_size": BLOCK if fmt in QUANTIZED else None}
ROUNDS = 3  # the residual of error feedback is non-zero from the second round on


# Every product of these optimizers is exact (by powers of 2), so their results do not depend
# on how XLA fuses them (an FMA or a multiply then an add round alike) and the program that runs
# the transformation and the one that runs a half can be compared bit for bit.


def _inner():
  return optax.sgd(0.5, momentum=0.5)


def _inner_params(grads, state, params):
  """This worker's params after the inner step the transformation takes from ``state``."""
  inner_updates, _ = _inner().update(grads, state.inner_state, params)
  return optax.apply_updates(params, inner_updates)


def _outer():
  return optax.sgd(1.0, momentum=0.5, nesterov=True)


def _params(n: int) -> dict:
  keys = jax.random.split(jax.random.key(0), len(SHAPES))
  one = {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, SHAPES.items(), strict=True)}
  return jax.tree.map(lambda p: jnp.broadcast_to(p, (n, *p.shape)), one)


def _grads(n: int, step: int) -> dict:
  keys = jax.random.split(jax.random.key(100 + step), len(SHAPES))
  return {k: jax.random.normal(key, (n, *s)) for key, (k, s) in zip(keys, SHAPES.items())}


def _exact(fmt: str, n: int) -> bool:
  """Whether the in-program mean adds in the merge's order (the rule of merge_payloads)."""
  return n == 2 or fmt in QUANTIZED or fmt == "float8"


def _assert_close(got, want, exact: bool) -> None:
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype and g.shape == w.shape
    if exact:
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    else:
      np.testing.assert_array_max_ulp(np.asarray(g), np.asarray(w), maxulp=1)


def _worker(tree, i: int):
  return jax.tree.map(lambda x: x[i], tree)


def _rank_ordered(payloads, n: int) -> list:
  return [_worker(payloads, i) for i in range(n)]


def _rounds_together(cases, rounds):
  """``rounds`` rounds of each ``(tx, step, n)`` of ``cases`` from ``_params(n)``, ``step`` the
  unjitted per-worker ``(grads, state, params) -> (updates, new_state, ...)``: a round of every
  case is one jitted call (one program for all the cases instead of one each). Per case, per
  round: ``(params, state)`` before it and the step's outputs."""
  steps = [jax.vmap(step, axis_name=AXIS) for _, step, _ in cases]
  together = jax.jit(lambda args: [step(*a) for step, a in zip(steps, args, strict=True)])
  params = [_params(n) for _, _, n in cases]
  states = jax.jit(lambda ps: [jax.vmap(tx.init, axis_name=AXIS)(p)
                               for (tx, _, _), p in zip(cases, ps, strict=True)])(params)
  history = [[] for _ in cases]
  for t in range(rounds):
    outs = together([(_grads(n, t), s, p)
                     for (_, _, n), s, p in zip(cases, states, params, strict=True)])
    for seen, p, s, out in zip(history, params, states, outs, strict=True):
      seen.append(((p, s), out))
    params = [optax.apply_updates(p, out[0]) for p, out in zip(params, outs, strict=True)]
    states = [out[1] for out in outs]
  return history


def _diloco_case(n, fmt, feedback):
  """diloco, and a step that runs its update and, from the same state, the local half."""
  kw = dict(axis_name=AXIS, **_wire(fmt))
  tx = optax_dist.diloco(_inner(), _outer(), sync_period=1, error_feedback=feedback, **kw)
  exchange = optax_dist.Exchange(**kw, call="diloco")

  def step(grads, state, params):
    updates, new_state = tx.update(grads, state, params)
    new_params = _inner_params(grads, state, params)
    payload, residual = optax_dist.diloco_payload(
      exchange, state.anchor, new_params, state.error_feedback)
    return updates, new_state, payload, residual

  return tx, step, n


DILOCO_CASES = [(n, fmt, feedback) for n in (2, 4)
                for fmt, feedback in [(f, False) for f in FORMATS] + [(f, True) for f in QUANTIZED]]


@pytest.fixture(scope="module")
def diloco_rounds():
  return dict(zip(DILOCO_CASES, _rounds_together(
    [_diloco_case(*case) for case in DILOCO_CASES], ROUNDS), strict=True))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
  "fmt, feedback", [(f, False) for f in FORMATS] + [(f, True) for f in QUANTIZED])
def test_diloco_halves_equal_update(diloco_rounds, n, fmt, feedback):
  outer_half = jax.jit(lambda *a: optax_dist.diloco_outer_step(_outer(), *a))
  for (params, state), (updates, new_state, payloads, residual) in diloco_rounds[n, fmt, feedback]:
    merged = optax_dist.merge_payloads(_rank_ordered(payloads, n))
    anchor, outer_state = outer_half(_worker(state.anchor, 0), _worker(state.outer_state, 0),
                                     merged)
    exact = _exact(fmt, n)
    _assert_close(anchor, _worker(new_state.anchor, 0), exact)
    _assert_close(outer_state, _worker(new_state.outer_state, 0), exact)
    for i in range(n):  # every worker restarts from the new anchor
      moved = jax.tree.map(jnp.subtract, anchor, _worker(params, i))
      _assert_close(_worker(updates, i), moved, exact)
      if feedback:  # the candidate residual is the state's, bit for bit
        _assert_close(_worker(residual, i), _worker(new_state.error_feedback, i), True)


def _mean_and_payloads(n, fmt):
  """Exchange.mean of the pseudo-gradients (with feedback: mean_with_feedback) and the
  payloads of the same workers, under vmap: ``(fn, args)``."""
  exchange = optax_dist.Exchange(AXIS, **_wire(fmt))
  anchor, new_params = _params(n), jax.tree.map(jnp.add, _params(n), _grads(n, 0))
  residual = jax.tree.map(lambda g: 0.01 * g, _grads(n, 1)) if fmt in QUANTIZED else None

  @functools.partial(jax.vmap, axis_name=AXIS)
  def both(anchor, new_params, residual):
    delta = jax.tree.map(jnp.subtract, anchor, new_params)
    mean = (exchange.mean(delta) if residual is None
            else exchange.mean_with_feedback(delta, residual)[0])
    return mean, optax_dist.diloco_payload(exchange, anchor, new_params, residual)[0]

  return both, (anchor, new_params, residual)


MEAN_CASES = [(n, fmt) for n in (2, 4) for fmt in FORMATS]


@pytest.fixture(scope="module")
def means_and_payloads():
  """Every case of the test below in one program."""
  fns, args = zip(*(_mean_and_payloads(*case) for case in MEAN_CASES), strict=True)
  results = jax.jit(lambda args: [fn(*a) for fn, a in zip(fns, args, strict=True)])(list(args))
  return dict(zip(MEAN_CASES, results, strict=True))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_merged_payloads_equal_in_program_mean(means_and_payloads, n, fmt):
  """With the paper's outer optimizer out of the way: merge_payloads of the payloads is
  Exchange.mean of the pseudo-gradients (with feedback: mean_with_feedback), cast alike."""
  mean, payloads = means_and_payloads[n, fmt]
  merged = optax_dist.merge_payloads(_rank_ordered(payloads, n))
  merged = jax.tree.map(lambda m, a: m.astype(a.dtype), merged, _worker(_params(n), 0))
  _assert_close(merged, _worker(mean, 0), _exact(fmt, n))


@pytest.mark.parametrize("fmt", ["none", "int8"])
@pytest.mark.parametrize("overlap", [0, 1])
def test_streaming_diloco_halves_per_fragment(fmt, overlap):
  n, num_fragments, sync_period = 2, 2, 2
  feedback = fmt in QUANTIZED
  kw = dict(axis_name=AXIS, **_wire(fmt))
  tx = optax_dist.streaming_diloco(
    _inner(), _outer(), sync_period=sync_period, num_fragments=num_fragments, overlap=overlap,
    error_feedback=feedback, **kw)
  exchange = optax_dist.Exchange(**kw, call="streaming_diloco")
  params = _params(n)
  fragments = optax_dist.streaming_diloco_fragments(_worker(params, 0), num_fragments)

  @jax.jit
  @functools.partial(jax.vmap, axis_name=AXIS)
  def step(grads, state, params):
    updates, new_state = tx.update(grads, state, params)
    new_params = _inner_params(grads, state, params)
    return updates, new_state, [
      optax_dist.streaming_diloco_payload(
        exchange, state.anchor, new_params, state.error_feedback, fragments=fragments,
        fragment=f)
      for f in range(num_fragments)
    ]

  state = jax.jit(jax.vmap(tx.init, axis_name=AXIS))(params)
  in_flight = {}  # fragment -> (the step it lands on, the merged payloads)
  last = 2 * sync_period + overlap  # the sends of the last `overlap` steps land after it
  for t in range(1, last + 1):
    updates, new_state, sent = step(_grads(n, t), state, params)
    anchor = _worker(state.anchor, 0)
    for f in range(num_fragments):
      if f in in_flight and in_flight[f][0] == t:  # the landing: the outer half
        _, merged = in_flight.pop(f)
        anchor, outer_state = optax_dist.streaming_diloco_outer_step(
          _outer(), anchor, _worker(state.outer_state[f], 0), merged, fragments=fragments,
          fragment=f)
        _assert_close(outer_state, _worker(new_state.outer_state[f], 0), True)
      if t + overlap <= last and optax_dist.streaming_diloco_syncs(
          t, sync_period=sync_period, num_fragments=num_fragments, fragment=f):
        payloads, residual = sent[f]
        in_flight[f] = (t + overlap, optax_dist.merge_payloads(_rank_ordered(payloads, n)))
        if feedback:
          _assert_close(residual, new_state.error_feedback, True)
        if overlap == 0:  # lands now
          _, merged = in_flight.pop(f)
          anchor, outer_state = optax_dist.streaming_diloco_outer_step(
            _outer(), anchor, _worker(state.outer_state[f], 0), merged, fragments=fragments,
            fragment=f)
          _assert_close(outer_state, _worker(new_state.outer_state[f], 0), True)
    _assert_close(anchor, _worker(new_state.anchor, 0), True)
    params, state = optax.apply_updates(params, updates), new_state
  assert not in_flight


def _local_sgd_case(n, fmt):
  """local_sgd, and a step that runs its update and, from the same state, the local half."""
  kw = dict(axis_name=AXIS, **_wire(fmt))
  tx = optax_dist.local_sgd(_inner(), sync_period=1, **kw)
  exchange = optax_dist.Exchange(**kw, call="local_sgd")

  def step(grads, state, params):
    updates, new_state = tx.update(grads, state, params)
    new_params = _inner_params(grads, state, params)
    return updates, new_state, optax_dist.local_sgd_payload(exchange, new_params)

  return tx, step, n


LOCAL_SGD_CASES = [(n, fmt) for n in (2, 4) for fmt in FORMATS]


@pytest.fixture(scope="module")
def local_sgd_rounds():
  return dict(zip(LOCAL_SGD_CASES, _rounds_together(
    [_local_sgd_case(*case) for case in LOCAL_SGD_CASES], 2), strict=True))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_local_sgd_halves_equal_update(local_sgd_rounds, n, fmt):
  for (params, _), (updates, _, payloads) in local_sgd_rounds[n, fmt]:
    merged = optax_dist.merge_payloads(_rank_ordered(payloads, n))
    for i in range(n):  # every worker lands on the average
      average = optax_dist.local_sgd_outer_step(merged, _worker(params, i))
      moved = jax.tree.map(jnp.subtract, average, _worker(params, i))
      _assert_close(_worker(updates, i), moved, _exact(fmt, n))


def test_payload_dtypes_are_the_wire_formats():
  tree = {"x": jnp.linspace(-1.0, 1.0, 6)}
  for fmt, dtype in [("none", jnp.float32), ("bfloat16", jnp.bfloat16),
                     ("float8", jnp.float32), ("int8", jnp.float32)]:
    exchange = optax_dist.Exchange(AXIS, **_wire(fmt))
    payload = jax.eval_shape(jax.vmap(lambda t: exchange.payload(t)[0], axis_name=AXIS),
                             jax.tree.map(lambda x: jnp.stack([x, x]), tree))
    assert payload["x"].dtype == dtype, fmt


def test_merge_payloads_weighted_and_rank_order():
  a, b, c = (jnp.array([v], jnp.float32) for v in (1.0, 2.0, 6.0))
  np.testing.assert_array_equal(optax_dist.merge_payloads([a, b, c]), [3.0])
  np.testing.assert_array_equal(optax_dist.merge_payloads([a, b, c], [1, 1, 2]), [3.75])
  big, small = jnp.array([2.0**24], jnp.float32), jnp.array([1.0], jnp.float32)
  # rank order: (2**24 + 1) + 1 rounds twice to 2**24, 1 + 1 + 2**24 is exact
  np.testing.assert_array_equal(optax_dist.merge_payloads([big, small, small]) * 3, [2.0**24])
  np.testing.assert_array_equal(
    optax_dist.merge_payloads([small, small, big]) * 3, [2.0**24 + 2])


@pytest.mark.parametrize("payloads, weights, match", [
  ([], None, "got none"),
  ([jnp.ones(1)] * 2, [1.0], "2 non-negative"),
  ([jnp.ones(1)] * 2, [1.0, -1.0], "2 non-negative"),
  ([jnp.ones(1)] * 2, [0.0, 0.0], "positive sum"),
])
def test_merge_payloads_errors(payloads, weights, match):
  with pytest.raises(ValueError, match=match):
    optax_dist.merge_payloads(payloads, weights)


@pytest.mark.parametrize("weights, total", [(None, 2.0), ([1.0, 1.0], 0.0),
                                            ([1.0, 1.0], math.inf)])
def test_merge_payloads_total_errors(weights, total):
  with pytest.raises(ValueError, match=re.escape(
      f"`merge_payloads(total=...)` must be a finite number > 0 given with weights, got"
      f" total={total!r} and weights={weights!r}.")):
    optax_dist.merge_payloads([jnp.ones(1)] * 2, weights, total=total)


def test_halves_errors():
  exchange = optax_dist.Exchange(AXIS, comm_dtype=jnp.bfloat16)
  tree = {"x": jnp.ones(3)}
  with pytest.raises(TypeError, match=r"diloco_payload\(exchange=...\)"):
    optax_dist.diloco_payload("w", tree, tree)
  with pytest.raises(ValueError, match="needs a quantized comm_dtype"):
    jax.vmap(lambda t: exchange.payload(t, t), axis_name=AXIS)(jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="one fragment id per leaf"):
    optax_dist.streaming_diloco_payload(exchange, tree, tree, fragments=(0, 1), fragment=0)
  with pytest.raises(ValueError, match=r"streaming_diloco_outer_step\(fragment=...\)"):
    optax_dist.streaming_diloco_outer_step(
      _outer(), tree, None, tree, fragments=(0,), fragment=1)


def test_diloco_synchronize_refuses_a_misspelled_axis_and_a_non_exchange():
  outer, anchor = _outer(), jnp.zeros((2, 3))

  def sync(exchange):
    return jax.vmap(lambda a: optax_dist.diloco_synchronize(
      outer, exchange, a, outer.init(a), a + 1.0)[0], axis_name=AXIS)(anchor)

  with pytest.raises(ValueError, match=r"axis 'wrokers' is not bound"):
    sync(optax_dist.Exchange("wrokers"))
  with pytest.raises(TypeError, match=r"diloco_synchronize\(exchange=...\)"):
    sync(AXIS)
