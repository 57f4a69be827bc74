r"""Delayed Nesterov: an outer optimizer for stale pseudo-gradients (Liu et al. 2024).

An outer optimizer is an ordinary optax transformation fed pseudo-gradients: by
:func:`optax_dist.diloco` once per sync (the workers' mean), by the asynchronous emulator's
server once per commit (one worker's, in event order).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dist import _axis, _checks, _state

__all__ = ("DelayedNesterovState", "delayed_nesterov")


class DelayedNesterovState(NamedTuple):
  """State of :func:`delayed_nesterov`.

  Attributes:
    count: ``int32[]``, the number of ``update`` calls (pseudo-gradients received) so far.
    momentum: :math:`m`, the momentum; the params' tree, shapes and dtypes.
    buffer: :math:`\\Delta`, the sum of the pseudo-gradients received since the last momentum
      update; the params' tree, shapes and dtypes.
  """

  count: jax.Array
  momentum: optax.Updates
  buffer: optax.Updates

  AVERAGE = None  # eval_params: no averaged params here
  RESTART = None  # resize_state: no field the params restart from
  # As diloco's outer it sits in a KEEP field, kept whole; elsewhere (a worker's own optimizer)
  # the momentum and the buffer are averaged, exact where every worker holds the same.
  RESIZE = {"count": _state.KEEP, "momentum": _state.MEAN, "buffer": _state.MEAN}


def delayed_nesterov(
  learning_rate: optax.ScalarOrSchedule = 0.7,
  momentum: float = 0.9,
  *,
  buffer_size: int,
  activation: float = 0.0,
) -> optax.GradientTransformation:
  r"""Delayed Nesterov: the outer momentum moves once every N updates, plain steps in between.

  With :math:`g_t` the pseudo-gradient of the :math:`t`-th ``update`` call
  (:math:`t = 0, 1, \dots`), :math:`\varepsilon_t` the learning rate at that call,
  :math:`\beta` the momentum, :math:`N` the buffer size and :math:`c` the momentum activation,
  each ``update`` returns :math:`u_t` (the caller then sets
  :math:`\theta \leftarrow \theta + u_t`):

  .. math::

    \Delta &\leftarrow \Delta + g_t \\
    \text{if } (t + 1) \bmod N = 0:\quad
      m &\leftarrow \beta m + \Delta / N, \qquad
      u_t = -\varepsilon_t \big((1 - cN + c)\,\beta m + g_t / N\big), \qquad
      \Delta \leftarrow 0 \\
    \text{otherwise:}\quad u_t &= -\varepsilon_t \big(c \beta m + g_t / N\big)

  with :math:`m = \Delta = 0` at the start. The buffer :math:`\Delta` collects :math:`N`
  pseudo-gradients; the momentum moves only on every :math:`N`-th, with their mean; in between
  each update is a plain step of :math:`g_t / N` plus the activation term :math:`c \beta m`, a
  fraction of the current momentum. With :math:`c = 0` (and a constant :math:`\varepsilon`) the
  :math:`N` updates of a window move the params by :math:`-\varepsilon (\bar g + \beta m)`,
  :math:`\bar g` their mean and :math:`m` updated once with it: one Nesterov step on the mean
  pseudo-gradient, spread over the window, so a single stale pseudo-gradient never drives the
  momentum alone.

  .. note::
    With :math:`N = 1` (and so :math:`c = 0`) it is ``optax.sgd(ε, momentum=β, nesterov=True)``,
    the default outer optimizer of :func:`diloco`.

  Args:
    learning_rate: :math:`\varepsilon_t`, the outer learning rate (a multiplier of the
      pseudo-gradient, dimensionless), > 0; or an optax schedule, a callable of the count
      evaluated at :math:`t`, the outer steps taken (``update`` calls made) before this one, as
      ``optax.sgd`` evaluates its schedule (a float is :math:`\varepsilon_t = \varepsilon`).
    momentum: :math:`\beta`, the momentum decay per momentum update, in [0, 1).
    buffer_size: :math:`N`, in ``update`` calls (pseudo-gradients) per momentum update, a
      positive int. Liu et al. use the number of workers: in the asynchronous emulator each
      commit is one call; under :func:`diloco` each sync is one call, already averaged over the
      workers.
    activation: :math:`c`, the fraction of :math:`\beta m` applied at each update between
      momentum updates, in :math:`[0, 1/N]`; 0 (default) applies the momentum only on the
      momentum updates.

  Returns:
    An ``optax.GradientTransformation`` whose state is :class:`DelayedNesterovState`. ``params``
    is not used.

  Shapes:
    The state holds two copies of the params' tree (:math:`m` and :math:`\Delta`, in the params'
    dtypes) and an ``int32[]`` counter. The updates have the pseudo-gradients' shapes and dtypes.

  Collectives:
    None. Under :func:`diloco` it runs on the all-reduced pseudo-gradient, identically on every
    worker.

  Raises:
    TypeError, ValueError: ``learning_rate`` neither > 0 nor a callable (a schedule's values
      are not checked); ``momentum`` not in [0, 1);
      ``buffer_size`` not a positive int; ``activation`` not in :math:`[0, 1/N]`.

  Examples:
    Two pseudo-gradients of 1 with :math:`N = 2`: a plain step of :math:`\varepsilon / N`, then
    the momentum update (:math:`m = 1`) and :math:`-\varepsilon (\beta m + 1/2)`:

    >>> import jax.numpy as jnp, optax, optax_dist
    >>> tx = optax_dist.delayed_nesterov(1.0, momentum=0.5, buffer_size=2)
    >>> state = tx.init(jnp.zeros(1))
    >>> u0, state = tx.update(jnp.ones(1), state)
    >>> u1, state = tx.update(jnp.ones(1), state)
    >>> u0, u1, state.momentum
    (Array([-0.5], dtype=float32), Array([-1.], dtype=float32), Array([1.], dtype=float32))

    As DiLoCo's outer optimizer (here one worker, no axis):

    >>> tx = optax_dist.diloco(optax.sgd(0.1), optax_dist.delayed_nesterov(0.7, buffer_size=2),
    ...                        sync_period=4)
    >>> type(tx.init(jnp.zeros(3)).outer_state).__name__
    'DelayedNesterovState'

  References:
    Liu et al., `Asynchronous Local-SGD Training for Language Modeling
    <https://arxiv.org/abs/2401.09135>`_, 2024 (Algorithm 3, the Delayed Nesterov update).
  """
  fn = "delayed_nesterov"
  if not callable(learning_rate):
    _checks.check_number(fn, "learning_rate", learning_rate, lower=0.0, lower_open=True,
                         constraint="> 0 (or an optax schedule)")
  _checks.check_number(fn, "momentum", momentum, lower=0.0, constraint="in [0, 1)")
  if (_checks.concrete(momentum) or 0.0) >= 1.0:
    raise ValueError(f"`{fn}(momentum=...)` must be in [0, 1), got {momentum}.")
  _checks.check_positive_int(fn, "buffer_size", buffer_size)
  _checks.check_number(fn, "activation", activation, lower=0.0, upper=1.0 / buffer_size,
                       constraint=f"in [0, 1/buffer_size] = [0, {1.0 / buffer_size:g}]")

  def init_fn(params):
    return DelayedNesterovState(
      count=jnp.zeros([], jnp.int32),
      momentum=optax.tree.zeros_like(params),
      buffer=optax.tree.zeros_like(params),
    )

  def update_fn(updates, state, params=None):
    del params
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate  # ε_t
    count = optax.safe_increment(state.count)  # t + 1
    moves = count % buffer_size == 0  # (t + 1) mod N = 0: the momentum moves
    buffer = jax.tree.map(lambda d, g: d + g, state.buffer, updates)  # Δ + g_t
    mom = jax.tree.map(  # m <- β m + Δ / N on a momentum update, else unchanged
      lambda m, d: jnp.where(moves, momentum * m + d / buffer_size, m), state.momentum, buffer)
    share = jnp.where(moves, (1.0 - activation * buffer_size + activation) * momentum,
                      activation * momentum)  # (1 - cN + c) β, or c β
    steps = jax.tree.map(  # u_t = -ε_t (share · m + g_t / N)
      lambda m, g: (-lr * (share * m + g / buffer_size)).astype(g.dtype), mom, updates)
    buffer = jax.tree.map(lambda d: jnp.where(moves, jnp.zeros_like(d), d), buffer)  # Δ <- 0
    new_state = DelayedNesterovState(count=count, momentum=mom, buffer=buffer)
    return steps, _axis.keep_dtypes(new_state, state)

  return optax.GradientTransformation(init_fn, update_fn)
