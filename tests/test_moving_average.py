"""moving_average's timing, checked on moving params against a NumPy reference.

The contract: a ``decay`` schedule is called with the count *before* the increment (0 on the first
update); with ``use_num_updates`` the decay is capped at ``(1 + t) / (10 + t)`` with ``t`` the count
*after* the increment (1 on the first update); ``ema = d ema + (1 - d) p`` with ``p`` the params
after this update (``sequential_update=True``) or before it. Every case moves the params on every
step, so a wrong count, a wrong cap or the params of the wrong side of the update all show.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist

STEPS = 6
LR = 0.5


def grads(step):
  return np.array([1.0 + step, -2.0, 0.5 * step], np.float64)


def numpy_ema(decay, use_num_updates, sequential_update):
  """float64 reference: plain SGD params and the EMA after each of ``STEPS`` updates."""
  params = np.array([1.0, -1.0, 2.0])
  ema = params.copy()
  history = []
  for count in range(STEPS):  # count: updates before this one
    d = decay(count) if callable(decay) else decay
    if use_num_updates:
      d = min(d, (1.0 + (count + 1)) / (10.0 + (count + 1)))
    new_params = params - LR * grads(count)
    ema = d * ema + (1.0 - d) * (new_params if sequential_update else params)
    params = new_params
    history.append(ema.copy())
  return np.array(history)


def run(decay, use_num_updates, sequential_update):
  tx = optax_dist.moving_average(
    optax.sgd(LR), decay, use_num_updates=use_num_updates, sequential_update=sequential_update
  )
  params = jnp.array([1.0, -1.0, 2.0])
  state = tx.init(params)
  history = []
  for step in range(STEPS):
    updates, state = tx.update(jnp.asarray(grads(step), jnp.float32), state, params)
    params = optax.apply_updates(params, updates)
    history.append(optax_dist.eval_params(state, params))
  return np.array(history)


DECAYS = {
  "constant": 0.6,
  # Different on every count, so a schedule called one count late is visible.
  "schedule": optax.linear_schedule(0.2, 0.8, STEPS),
  # Above the cap (1 + t) / (10 + t) on every step: the cap decides; a max() would not cap.
  "capped": 0.95,
  # Below the cap from t = 3 on ((1 + 3) / 13 = 0.31 > 0.25): min() switches between the two.
  "crossing": 0.25,
}


@pytest.mark.parametrize("sequential_update", [True, False])
@pytest.mark.parametrize("use_num_updates", [False, True])
@pytest.mark.parametrize("decay", DECAYS)
def test_ema_matches_numpy_reference(decay, use_num_updates, sequential_update):
  got = run(DECAYS[decay], use_num_updates, sequential_update)
  want = numpy_ema(DECAYS[decay], use_num_updates, sequential_update)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_use_num_updates_changes_the_average():
  """The cap is not a no-op on these cases: with and without it the averages differ."""
  for decay in ("capped", "crossing"):
    assert not np.allclose(run(DECAYS[decay], True, True), run(DECAYS[decay], False, True))


def test_first_update_uses_count_one_in_the_cap():
  """First update, decay 0.95 capped: d = (1 + 1) / (10 + 1) = 2/11 (not 1/10 with count 0)."""
  tx = optax_dist.moving_average(optax.sgd(1.0), 0.95, use_num_updates=True)
  params = jnp.array([0.0])
  _, state = tx.update(jnp.array([-11.0]), tx.init(params), params)  # params move to 11
  np.testing.assert_allclose(state.ema, [(1 - 2 / 11) * 11.0], rtol=1e-6)
