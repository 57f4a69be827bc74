"""What a run compiles before its first step, and what its evaluations compute.

:class:`optax_dist.cli.runs.Run` compiles the step of step 1's ``communicate`` hint before
training and the other in a background thread, once, to the program the main thread would
compile; :func:`optax_dist.cli.steps.evaluate_fn` scores the workers' params only where they
differ from ``eval_params``, with the metrics of computing both.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist
from optax_dist.cli import runs
from optax_dist.cli.config import Settings
from optax_dist.cli.steps import evaluate_fn, same_bits
from optax_dist.cli.tasks import TASKS

BACKGROUND = "optax-dist compile"


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
  """The thread name of each ahead-of-time compilation, in order (from now on)."""
  names = []
  compile_ = jax.stages.Lowered.compile

  def recorded(self, *args, **kwargs):
    names.append(threading.current_thread().name)
    return compile_(self, *args, **kwargs)

  monkeypatch.setattr(jax.stages.Lowered, "compile", recorded)
  return names


def diloco_run() -> runs.Run:
  task = TASKS["digits"]
  settings = Settings(algorithm="diloco", steps=8, sync_period=4, eval_every=8, batch_size=8,
                      devices=4)
  return runs.Run(task, task.load(0), settings.resolved())


def test_the_step_with_the_exchange_compiles_once_in_the_background(compiles):
  run = diloco_run()
  # step 1's step (without the exchange) and the evaluation, in this thread
  here = threading.current_thread().name
  assert [n for n in compiles if not n.startswith(BACKGROUND)] == [here, here]
  state = run.initial
  for t in range(1, 9):
    state, _ = run.step(state, t)
  assert run.compiled_step(True) is run.compiled_step(True)
  assert sorted(run.collectives) == ["communication_step", "non_communication_step"]
  assert len(compiles) == 3 and compiles[-1].startswith(BACKGROUND)


def test_the_step_compiled_in_the_background_is_the_main_threads(compiles, monkeypatch):
  background = diloco_run()
  monkeypatch.setattr(runs.Run, "first_hint", lambda run: True)
  main = diloco_run()
  for hint in (True, False):
    assert background.compiled_step(hint).as_text() == main.compiled_step(hint).as_text()
  assert sorted(n.startswith(BACKGROUND) for n in compiles) == [False] * 4 + [True] * 2


def test_a_sync_run_compiles_nothing_in_the_background(compiles):
  task = TASKS["digits"]
  runs.Run(task, task.load(0), Settings(algorithm="sync", devices=4, batch_size=8).resolved())
  assert len(compiles) == 2 and not any(n.startswith(BACKGROUND) for n in compiles)


def metric_fn(scored: list[int]):
  """A mean-square metric that appends to ``scored`` when it runs (once for the workers under
  ``vmap``)."""

  def metric(params, test):
    jax.debug.callback(lambda: scored.append(1))
    return jnp.mean((test @ params["w"]) ** 2)

  return metric


@pytest.mark.parametrize("move", [None, "one bit", 0.5])
def test_the_workers_params_are_scored_only_where_they_differ(move):
  workers, tx = 4, optax_dist.diloco(optax.sgd(0.1), sync_period=4, axis_name="w")
  params = {"w": jnp.tile(jnp.linspace(-1.0, 1.0, 6), (workers, 1))}
  opt_state = jax.vmap(tx.init, axis_name="w")(params)  # the anchor: a copy of the params
  if move is not None:  # one of one worker's params
    w = np.array(params["w"])
    w[2, 3] = np.nextafter(w[2, 3], np.float32(2.0)) if move == "one bit" else w[2, 3] + move
    params = {"w": jnp.asarray(w)}
  test = jnp.asarray(np.random.default_rng(0).normal(size=(5, 6)), jnp.float32)
  scored = []
  got = jax.jit(evaluate_fn(metric_fn(scored)))(params, opt_state, test)
  jax.effects_barrier()
  assert len(scored) == (1 if move is None else 2)  # one callback per vmap over the workers

  def mean_metric(p):
    return jax.jit(lambda p: jnp.mean(jax.vmap(lambda q: metric_fn([])(q, test))(p)))(p)

  want = (mean_metric(optax_dist.eval_params(opt_state, params)), mean_metric(params))
  np.testing.assert_array_equal(np.array(got), np.array(want))
  assert (want[0] == want[1]) == (move != 0.5)


def test_same_bits_tells_signed_zeros_apart_and_a_nan_from_itself():
  zero, nan = jnp.array([0.0, 1.0]), jnp.array([jnp.nan, 1.0])
  assert not same_bits({"a": zero}, {"a": -zero})
  assert same_bits({"a": nan}, {"a": nan})
  assert not same_bits((zero, nan), (zero, zero))
  assert same_bits((zero.astype(jnp.bfloat16),), (zero.astype(jnp.bfloat16),))
