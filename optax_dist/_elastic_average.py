"""Elastic averaging SGD (TF's ``ElasticAverageOptimizer``)."""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dist import _axis, _checks, _exchange, _state

BETA = 0.9
"""TF's default for ``moving_rate * communication_period * num_workers`` (as in the paper)."""


class ElasticAverageState(NamedTuple):
  """State of :func:`elastic_average`.

  Attributes:
    local_step: ``int32[]``, the number of ``update`` calls of this worker so far.
    center: the center variable (the paper's :math:`\\tilde{x}`); the params' tree, shapes and
      dtypes; identical on every worker.
    inner_state: the state of the wrapped transformation, local to this worker.
  """

  local_step: jax.Array
  center: optax.Params
  inner_state: optax.OptState

  AVERAGE = "center"  # eval_params returns this field
  RESTART = "center"  # resize_state restarts the workers' params from this field
  RESIZE = {"local_step": _state.KEEP, "center": _state.KEEP, "inner_state": _state.INNER}


def elastic_average_communicates(step: Any, *, communication_period: int) -> Any:
  """Whether ``update`` call number ``step`` (from 1) of :func:`elastic_average` communicates.

  The rule ``update`` applies to its own ``local_step`` (after its increment): ``step %
  communication_period == 0``.

  Args:
    step: the 1-based number of the ``update`` call (a Python int or an integer array).
    communication_period: τ, as given to :func:`elastic_average`.

  Returns:
    A bool (a bool array for an integer array ``step``).

  Collectives:
    None.

  Raises:
    TypeError, ValueError: a period or count not a positive int (checked when concrete).

  Examples:
    >>> import optax_dist
    >>> [t for t in range(1, 8)
    ...  if optax_dist.elastic_average_communicates(t, communication_period=3)]
    [3, 6]

  References:
    TensorFlow 1.x, ``tf.contrib.opt.ElasticAverageOptimizer`` (``communication_period``).
  """
  _checks.check_positive_int(
    "elastic_average_communicates", "communication_period", communication_period)
  return step % communication_period == 0


def elastic_average(
  inner: optax.GradientTransformation,
  num_workers: int | None = None,
  *,
  communication_period: int = 10,
  moving_rate: float | None = None,
  rho: float | None = None,
  learning_rate: float | None = None,
  axis_name: Hashable | None = None,
  comm_dtype: Any = None,
  comm_block_size: int | None = None,
  slice_axis: Hashable | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Elastic averaging SGD (EASGD): local training, elastic exchange with a center every τ steps.

  Every worker :math:`i` keeps its own params :math:`x_i` (they are *not* kept identical) and
  trains them with ``inner``, pulled towards a shared center :math:`\tilde{x}` by an elastic
  force. Every ``communication_period`` (τ) steps the workers and the center move towards each
  other. With :math:`g_i` the incoming updates (gradients), α the ``moving_rate`` and ρ ``rho``:

  .. math::

    u_i &= \mathrm{inner}\big(g_i + \rho\,(x_i - \tilde{x})\big) \\
    \text{if } \mathrm{local\_step} \bmod \tau = 0:\quad
      x'_i &= x_i + u_i, \qquad d_i = \alpha\,(x'_i - \tilde{x}) \\
      x_i &\leftarrow x'_i - d_i, \qquad \tilde{x} \leftarrow \tilde{x} + \textstyle\sum_j d_j

  and :math:`x_i \leftarrow x_i + u_i` on other steps. Every worker exchanges against the same
  center (the paper's synchronous EASGD); the returned updates are
  :math:`x_i^{\text{new}} - x_i`, so ``optax.apply_updates`` lands on :math:`x_i^{\text{new}}` up
  to float rounding.

  Args:
    inner: the local optimizer of each worker.
    num_workers: number of workers :math:`N`; defaults to the size of ``axis_name`` (1 when it
      is ``None``). If given, it must equal that size.
    communication_period: τ, a count of ``update`` calls; the first exchange is on the τ-th call.
    moving_rate: α, dimensionless; default :math:`0.9 / (\tau N)` (TF's ``BETA = 0.9``).
    rho: ρ, the elastic force's strength on the local gradient (units of 1/learning rate).
      Default: :math:`\alpha / \mathrm{learning\_rate}` if ``learning_rate`` is given (TF's
      default), else 0 (the paper's Algorithm 1).
    learning_rate: the inner optimizer's learning rate, used only for the default ``rho``.
    axis_name: the mapped axis (or tuple of mesh axes, e.g. ``("hosts", "gpus")``) whose
      positions are the workers; ``None`` for one worker.
    comm_dtype: the floating dtype in which the :math:`d_j` are summed over the axis (e.g.
      ``jnp.bfloat16``: half the bytes of ``float32``): each :math:`d_i` is cast to it before the
      ``psum`` and the sum back to the center's dtype after. ``None`` (default) sends in
      the params' dtypes. ``jnp.int8`` (or ``"int8"``), ``jnp.float4_e2m1fn`` (or
      ``"float4_e2m1fn"``) and ``"e3m0"`` send block-quantized codes of the :math:`d_j` with
      one float32 scale per ``comm_block_size`` values (``optax_dist._quantize``), gathered and
      summed in float32 in worker order. Each worker still subtracts its own exact
      :math:`d_i`, so the center receives :math:`\sum_j Q(d_j)`: the rounding error moves the
      center and is not fed back (there is no ``error_feedback`` here).
    comm_block_size: B, the values per float32 scale of a quantized ``comm_dtype`` (``None``,
      the default, is 256; even for the 4-bit formats); ignored otherwise.
    slice_axis: a mapped axis inside each worker (not part of ``axis_name``) whose devices hold
      identical copies of the params, such as the devices of one replica after
      ``tower(inner, slice_axis)``: each of its K devices then exchanges only its 1/K slice
      across the workers and the slices are gathered back inside the worker, so the K devices
      together send the params' bytes once instead of K times. ``None`` (default): every
      device exchanges the whole tree.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; extra args are forwarded to ``inner``.

  Shapes:
    ``updates`` and ``params`` share one tree (each worker's own, e.g. ``[...]`` per worker
    under ``shard_map``); the returned updates and ``center`` have the params' tree, shapes and
    dtypes. Memory: one extra copy of the params (the center) per worker.

  Collectives:
    One ``psum`` over ``axis_name`` of a params-sized tree (the params' bytes, or their element
    count times ``comm_dtype``'s itemsize), on communication steps only
    (``local_step % communication_period == 0``), inside a ``lax.cond``; none on other steps.
    With a quantized format it is two ``all_gather`` (every leaf's codes, scales): each worker
    sends ``wire_bytes``, :math:`n (c + 4/B)` bytes for :math:`n` values (:math:`c = 1` for
    ``int8``, :math:`\frac12` for 4-bit), and receives N times that; counting what arrives
    from the other workers, :math:`(N - 1)(c + 4/B)` against a float32 ring all-reduce's
    :math:`8 (N - 1)/N` per value, ``int8`` receives fewer up to N = 7 workers and 4-bit up to
    N = 15 (:math:`B = 256`).
    None when ``axis_name`` is ``None``. :func:`communication_report` measures them.

  Static hint:
    ``update(..., communicate=True)`` or ``communicate=False`` (a Python bool, fixed at trace
    time) replaces the counter rule for that call: the step makes the exchange or not, compiled
    without the ``lax.cond`` (``False``: without the ``psum``). ``local_step`` advances either
    way. A hint that agrees with the rule gives the rule's results (to float rounding: XLA fuses
    the two programs differently); one that disagrees adds or skips that one exchange, and the
    rule's later ones stay where they were. ``None`` (or leaving it out) is the rule. It is not
    forwarded to ``inner``.

  Raises:
    TypeError: ``inner`` is not a transformation; a hyperparameter has the wrong type;
      ``comm_dtype`` not ``None``, a floating dtype or a quantized format; a param leaf is not
      floating point (the message names its path); ``update``'s ``communicate`` not ``None`` or
      a bool.
    ValueError: ``communication_period``, ``num_workers`` or ``comm_block_size`` not a positive
      int; ``comm_block_size``
      given with a ``comm_dtype`` that is not block-quantized, or odd
      with a 4-bit one; ``moving_rate``
      ≤ 0; ``rho`` < 0; ``learning_rate`` ≤ 0; ``num_workers > 1`` with ``axis_name=None``;
      ``num_workers`` different from the axis size; ``update`` without ``params``, where a
      named ``axis_name`` is not bound, or with updates whose shapes differ from the params'.

  Warns:
    UserWarning: :math:`\alpha N > 1` (when both are known at trace time). The exchange is
      stable for :math:`0 < \alpha N < 1`: beyond 1 the center overshoots the workers' mean, and
      from 2 on it diverges.

  Examples:
    Two workers emulated with ``vmap``, exchanging every step:

    >>> import jax, jax.numpy as jnp, optax, optax_dist
    >>> tx = optax_dist.elastic_average(
    ...     optax.sgd(1.0), communication_period=1, moving_rate=0.5, axis_name="workers")
    >>> params = jnp.zeros((2, 1))
    >>> state = jax.vmap(tx.init, axis_name="workers")(params)
    >>> grads = jnp.array([[-1.0], [-3.0]])
    >>> updates, state = jax.vmap(tx.update, axis_name="workers")(grads, state, params)
    >>> optax.apply_updates(params, updates)[:, 0], state.center[:, 0]
    (Array([0.5, 1.5], dtype=float32), Array([2., 2.], dtype=float32))

  References:
    TensorFlow 1.x, ``tf.contrib.opt.ElasticAverageOptimizer``.
    Zhang, Choromanska & LeCun, `Deep learning with Elastic Averaging SGD
    <https://arxiv.org/abs/1412.6651>`_, NeurIPS 2015.
  """
  fn = "elastic_average"
  _checks.check_transformation(fn, inner)
  inner = _axis.wrap_inner(inner)  # unknown extra args dropped, state dtypes kept
  _checks.check_positive_int(fn, "communication_period", communication_period)
  exchange = _exchange.Exchange(
    axis_name, num_workers, comm_dtype, comm_block_size, slice_axis, call=fn
  )
  if moving_rate is not None:
    _checks.check_number(fn, "moving_rate", moving_rate, lower=0.0, lower_open=True,
                         constraint="> 0")
  if rho is not None:
    _checks.check_number(fn, "rho", rho, lower=0.0, constraint=">= 0")
  if learning_rate is not None:
    _checks.check_number(fn, "learning_rate", learning_rate, lower=0.0, lower_open=True,
                         constraint="> 0")

  def init_fn(params):
    _checks.check_floating(fn, params)
    exchange.size()
    return ElasticAverageState(
      local_step=jnp.zeros([], jnp.int32),
      center=_axis.copy(params),
      inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    _checks.require_params(fn, params)
    _checks.check_floating(fn, params)
    _checks.check_tree_matches(fn, updates, state.center, "params")
    hint = _axis.communication_hint(fn, extra_args)
    n = exchange.bind()
    alpha = BETA / communication_period / n if moving_rate is None else moving_rate
    _warn_if_unstable(alpha, n)
    if rho is not None:
      rho_ = rho
    elif learning_rate is not None:
      rho_ = alpha / learning_rate
    else:
      rho_ = 0.0
    center = state.center

    # g_i = updates_i + rho (x_i - center); u_i = inner(g_i). With rho exactly 0 (the paper's
    # Algorithm 1, the default) the term is left out: g_i is then the gradient itself, with no
    # two extra params-sized reads on every step.
    if isinstance(rho_, (int, float)) and rho_ == 0:
      grads = updates
    else:
      elastic = optax.tree.sub(params, center)
      grads = jax.tree.map(lambda g, e: (g + rho_ * e).astype(g.dtype), updates, elastic)
    local_updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
    local_step = optax.safe_increment(state.local_step)

    communicate = exchange.due(
      elastic_average_communicates(local_step, communication_period=communication_period), hint
    )

    # The conditional carries only what a communication step changes: the center, and d_i for
    # the returned updates. On other steps it hands the center and u_i back unchanged (XLA then
    # writes no copy of them) and the updates are u_i.
    def pull(u, center):
      new_params = optax.apply_updates(params, u)  # x'_i
      d = jax.tree.map(lambda x, c: (alpha * (x - c)).astype(c.dtype), new_params, center)
      return optax.tree.add(center, exchange.sum(d)), d  # center <- center + sum_j d_j

    def keep(u, center):
      # The second result is unused on these steps; u_i has d_i's shapes (dtypes cast).
      return center, jax.tree.map(lambda x, c: x.astype(c.dtype), u, center)

    center, d = _axis.communicate_if(communicate, pull, keep, local_updates, center)
    # x_i <- x'_i - d_i on a communication step.
    local_updates = jax.tree.map(
      lambda x, d, p, u: _axis.select(communicate, ((x - d) - p).astype(u.dtype), u),
      optax.apply_updates(params, local_updates), d, params, local_updates,
    )
    return local_updates, ElasticAverageState(
      local_step=local_step, center=center, inner_state=inner_state
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _warn_if_unstable(alpha: Any, num_workers: int) -> None:
  """Warn if ``moving_rate * num_workers > 1`` (both concrete): the center would overshoot."""
  rate = _checks.concrete(alpha)
  if rate is not None and rate * num_workers > 1:
    warnings.warn(
      f"`elastic_average`: moving_rate * num_workers = {rate} * {num_workers} ="
      f" {rate * num_workers:g} > 1. The exchange is stable for 0 < moving_rate * num_workers"
      " < 1: beyond 1 the center overshoots the workers' mean, and from 2 on it diverges."
      f" Use moving_rate < {1 / num_workers:g} (the default is 0.9 / (communication_period *"
      " num_workers)).",
      UserWarning,
      stacklevel=3,
    )
