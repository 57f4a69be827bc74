"""A training step compiled twice, with and without the exchange, called by the schedule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from optax_dist import _checks


class HintedStep:
  """The step function returned by :func:`hinted_step`.

  Attributes:
    step: the number of calls made so far (``start`` at creation); the next call is call
      ``step + 1`` of the schedule.
    steps: ``{True: jitted step, False: jitted step}``, the two compiled variants.
  """

  def __init__(self, step_fn: Callable[..., Any], communicates: Callable[[int], Any],
               start: int, jit_kwargs: dict):
    self.step = start
    self._communicates = communicates
    self.steps = {
      flag: jax.jit(_with_hint(step_fn, flag), **jit_kwargs) for flag in (True, False)
    }

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    self.step += 1
    return self.steps[bool(self._communicates(self.step))](*args, **kwargs)


def _with_hint(step_fn: Callable[..., Any], flag: bool) -> Callable[..., Any]:
  def step(*args, **kwargs):
    return step_fn(*args, communicate=flag, **kwargs)

  return step


def hinted_step(
  step_fn: Callable[..., Any],
  communicates: Callable[[int], Any],
  *,
  start: int = 0,
  **jit_kwargs: Any,
) -> HintedStep:
  r"""``step_fn`` jitted twice, with the exchange and without, each call picking by the schedule.

  A step that passes no ``communicate`` hint to ``update`` runs the transformation's counter
  rule inside a ``lax.cond`` on every step. This compiles ``step_fn(..., communicate=True)`` and
  ``step_fn(..., communicate=False)`` (``step_fn`` forwards its ``communicate`` keyword to
  ``tx.update(..., communicate=communicate)``) and calls, on call number :math:`t` (from
  ``start + 1``), the variant ``communicates(t)`` names: the non-communication steps are
  compiled with no conditional and no collective.

  Args:
    step_fn: the training step, taking a keyword argument ``communicate`` (a Python bool) that
      it passes to the optax_dist transformation's ``update``; jitted here.
    communicates: the transformation's schedule, a function of the 1-based call number, e.g.
      ``functools.partial(optax_dist.diloco_syncs, sync_period=H)``.
    start: the number of steps already taken (a restored run's step counter): the first call is
      call ``start + 1``.
    jit_kwargs: keyword arguments passed to both ``jax.jit`` calls (``donate_argnums``,
    ``in_shardings``, ...).

  Returns:
    A callable :class:`HintedStep` with the signature of ``step_fn`` without ``communicate``;
    its ``step`` attribute counts the calls.

  Collectives:
    Those of ``step_fn``: with ``communicate=False`` the transformation issues none.

  Raises:
    TypeError: ``step_fn`` or ``communicates`` not callable; ``start`` not an int.
    ValueError: ``start`` < 0.

  Examples:
    >>> import functools, jax, jax.numpy as jnp, optax, optax_dist
    >>> tx = optax_dist.diloco(optax.sgd(0.1), sync_period=2)
    >>> def train_step(params, state, communicate):
    ...   updates, state = tx.update(jnp.ones_like(params), state, params,
    ...                              communicate=communicate)
    ...   return optax.apply_updates(params, updates), state
    >>> step = optax_dist.hinted_step(
    ...     train_step, functools.partial(optax_dist.diloco_syncs, sync_period=2))
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> for _ in range(3):
    ...   params, state = step(params, state)
    >>> step.step, int(state.local_step)
    (3, 3)

  References:
    The static ``communicate`` hint of :func:`diloco`, :func:`streaming_diloco`,
    :func:`local_sgd`, :func:`elastic_average` and :func:`agn`.
  """
  for name, fn in (("step_fn", step_fn), ("communicates", communicates)):
    if not callable(fn):
      raise TypeError(f"`hinted_step({name}=...)` must be callable, got {type(fn).__name__}.")
  _checks.check_non_negative_int("hinted_step", "start", start)
  return HintedStep(step_fn, communicates, start, jit_kwargs)
