"""Local SGD: periodic model averaging, with an optional synchronous warm-up (post-local SGD)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dist import _axis, _checks, _exchange, _state


class LocalSGDState(NamedTuple):
  """State of :func:`local_sgd`.

  Attributes:
    local_step: ``int32[]``, the number of ``update`` calls of this worker so far.
    inner_state: the state of ``inner``, local to this worker, kept across model averages.
  """

  local_step: jax.Array
  inner_state: optax.OptState

  AVERAGE = None  # eval_params returns this field
  RESTART = None  # resize_state restarts the workers' params from this field
  RESIZE = {"local_step": _state.KEEP, "inner_state": _state.INNER}


def check_warmup_steps(fn: str, warmup_steps: Any) -> None:
  """Raise unless ``warmup_steps`` is an int >= 0."""
  _checks.check_non_negative_int(fn, "warmup_steps", warmup_steps)


def local_sgd_warming_up(step: Any, *, warmup_steps: int = 0) -> Any:
  """Whether ``update`` call number ``step`` (from 1) of :func:`local_sgd` is a warm-up step.

  The rule ``update`` applies to its own ``local_step`` (after its increment): ``step <=
  warmup_steps``; on these steps the gradients are all-reduced.

  Args:
    step: the 1-based number of the ``update`` call (a Python int or an integer array).
    warmup_steps: W, as given to :func:`local_sgd`.

  Returns:
    A bool (a bool array for an integer array ``step``).

  Collectives:
    None.

  Raises:
    TypeError, ValueError: a period or count not a positive int (checked when concrete).

  Examples:
    >>> import optax_dist
    >>> [t for t in range(1, 6) if optax_dist.local_sgd_warming_up(t, warmup_steps=2)]
    [1, 2]

  References:
    Lin, Stich, Patel & Jaggi, `Don't Use Large Mini-Batches, Use Local SGD
    <https://arxiv.org/abs/1808.07217>`_, ICLR 2020 (post-local SGD).
  """
  check_warmup_steps("local_sgd_warming_up", warmup_steps)
  return step <= warmup_steps


def local_sgd_syncs(step: Any, *, sync_period: int, warmup_steps: int = 0) -> Any:
  """Whether ``update`` call number ``step`` (from 1) of :func:`local_sgd` averages the models.

  The rule ``update`` applies to its own ``local_step`` (after its increment): ``step > W`` and
  ``(step - W) % H == 0``, the first average on step :math:`W + H`. The warm-up's all-reduces
  (:func:`local_sgd_warming_up`) are not model averages.

  Args:
    step: the 1-based number of the ``update`` call (a Python int or an integer array).
    sync_period: H, as given to :func:`local_sgd`.
    warmup_steps: W, as given to :func:`local_sgd`.

  Returns:
    A bool (a bool array for an integer array ``step``).

  Collectives:
    None.

  Raises:
    TypeError, ValueError: a period or count not a positive int (checked when concrete).

  Examples:
    >>> import optax_dist
    >>> [t for t in range(1, 12) if optax_dist.local_sgd_syncs(t, sync_period=3, warmup_steps=4)]
    [7, 10]

  References:
    Lin, Stich, Patel & Jaggi, `Don't Use Large Mini-Batches, Use Local SGD
    <https://arxiv.org/abs/1808.07217>`_, ICLR 2020 (post-local SGD).
  """
  _checks.check_positive_int("local_sgd_syncs", "sync_period", sync_period)
  check_warmup_steps("local_sgd_syncs", warmup_steps)
  since_warmup = step - warmup_steps
  return (since_warmup > 0) & (since_warmup % sync_period == 0)


def local_sgd_payload(exchange: _exchange.Exchange, new_params: Any) -> Any:
  r"""The local half of :func:`local_sgd`'s model average: this worker's term of the mean.

  :math:`p_i = Q(x'_i)`, with :math:`x'_i` this worker's params after its inner step and
  :math:`Q` ``exchange``'s wire format (:meth:`Exchange.payload
  <optax_dist.Exchange.payload>`). :func:`merge_payloads` of the N workers' payloads in rank
  order, then :func:`local_sgd_outer_step`, give the params every worker lands on (bit for bit
  as :func:`diloco_payload` describes).

  Args:
    exchange: the :class:`~optax_dist.Exchange` of the :func:`local_sgd` it stands in for.
    new_params: :math:`x'_i`.

  Returns:
    The params' tree and shapes, in the wire format's dtype (float32 for the 8-bit floats and
    the quantized formats).

  Collectives:
    None across the workers (with ``slice_axis``, one ``all_gather`` inside the worker).

  Raises:
    TypeError: ``exchange`` not an :class:`~optax_dist.Exchange`.

  Examples:
    An ``int8`` wire with blocks of 2: the values the other workers decode.

    >>> import jax.numpy as jnp, optax_dist
    >>> exchange = optax_dist.Exchange("w", comm_dtype="int8", comm_block_size=2)
    >>> optax_dist.local_sgd_payload(exchange, jnp.array([1.0, 0.3]))
    Array([1.0000147, 0.299217 ], dtype=float32)

  References:
    Lin, Stich, Patel & Jaggi, `Don't Use Large Mini-Batches, Use Local SGD
    <https://arxiv.org/abs/1808.07217>`_, ICLR 2020 (the model average).
  """
  _exchange.check_exchange("local_sgd_payload", exchange)
  return exchange.payload(new_params)[0]


def local_sgd_outer_step(merged: Any, params: Any) -> Any:
  r"""The outer half of :func:`local_sgd`'s model average: the average itself.

  :math:`x_i \leftarrow \bar p` cast to the params' dtypes, with :math:`\bar p` the
  workers' mean of their :func:`local_sgd_payload`\ s (:func:`merge_payloads`); the worker's
  update is then :math:`\bar p - x_i`, in its inner updates' dtypes.

  Args:
    merged: :math:`\bar p`, the params' tree and shapes.
    params: the params (only their dtypes are read).

  Returns:
    The new params, ``params``' tree, shapes and dtypes.

  Collectives:
    None.

  Raises:
    ValueError: ``merged`` not of the params' tree (raised by ``jax.tree.map``).

  Examples:
    >>> import jax.numpy as jnp, optax_dist
    >>> merged = optax_dist.merge_payloads([jnp.array([1.0, 0.3]), jnp.array([3.0, 0.7])])
    >>> optax_dist.local_sgd_outer_step(merged, jnp.zeros(2, jnp.bfloat16))
    Array([2, 0.5], dtype=bfloat16)

  References:
    Lin, Stich, Patel & Jaggi, `Don't Use Large Mini-Batches, Use Local SGD
    <https://arxiv.org/abs/1808.07217>`_, ICLR 2020 (the model average).
  """
  return jax.tree.map(lambda m, p: jnp.asarray(m).astype(jnp.result_type(p)), merged, params)


def local_sgd(
  inner: optax.GradientTransformation,
  *,
  sync_period: int,
  axis_name: Hashable | None = None,
  num_workers: int | None = None,
  warmup_steps: int = 0,
  comm_dtype: Any = None,
  comm_block_size: int | None = None,
  slice_axis: Hashable | None = None,
  error_feedback: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Local SGD: every worker trains alone for H steps, then all land on the mean of the params.

  Every worker :math:`i` trains its own params :math:`x_i` with ``inner``; every
  ``sync_period`` (H) steps the workers replace their params by the mean over the workers. The
  first ``warmup_steps`` (W) steps are synchronous data parallelism instead (post-local SGD):
  the gradients are averaged over the workers before ``inner``, exactly as
  :func:`all_reduce` ``(axis_name, "mean")`` averages them, and no model is averaged. With
  :math:`s` the step count after its increment:

  .. math::

    \text{if } s \le W:\quad u_i &= \mathrm{inner}\big(\tfrac{1}{N}\textstyle\sum_j g_j\big),
      \qquad x_i \leftarrow x_i + u_i \\
    \text{else}:\quad u_i &= \mathrm{inner}(g_i), \qquad x'_i = x_i + u_i \\
    \text{if } s > W \text{ and } (s - W) \bmod H = 0:\quad
      x_i &\leftarrow \tfrac{1}{N} \textstyle\sum_j x'_j \qquad
      (\text{otherwise } x_i \leftarrow x'_i)

  so the first model average is on step :math:`W + H`. ``inner``'s state stays each worker's
  own (Adam moments are not averaged). The returned updates are
  :math:`\bar{x}' - x_i` on a sync step and :math:`u_i` otherwise. There is no anchor: this is
  :func:`diloco` with ``outer=optax.sgd(1.0)`` without the anchor's copy of the params.

  Args:
    inner: the local optimizer of each worker.
    sync_period: H, a count of ``update`` calls between model averages (required: the
      literature's values range from 2 to hundreds).
    axis_name: the mapped axis (or tuple of mesh axes) whose positions are the workers;
      ``None`` for one worker (then nothing is averaged: ``local_sgd`` is ``inner``).
    num_workers: number of workers :math:`N`; defaults to the size of ``axis_name`` (1 when it
      is ``None``). If given, it must equal that size.
    warmup_steps: W, a count of ``update`` calls of synchronous data parallelism before local
      steps begin; 0 (default) starts local at once.
    comm_dtype: the floating dtype of the all-reduces (e.g. ``jnp.bfloat16``). For the model
      average it rounds the params themselves, :math:`x'_j` (there is no anchor to take
      differences from): prefer ``diloco(inner, optax.sgd(1.0), comm_dtype=...)`` for
      compressed averaging. 8-bit floats are quantized, all-gathered and summed in float32.
      ``jnp.int8`` (or ``"int8"``), ``jnp.float4_e2m1fn`` (or ``"float4_e2m1fn"``) and
      ``"e3m0"`` send block-quantized codes with one float32 scale per ``comm_block_size``
      values (``optax_dist._quantize``), gathered and summed in float32 in worker order; for
      the model average the error of a value is up to half a grid step of its block's largest
      param (:math:`\max|x| / 254` for ``int8``), whatever the change since the last average,
      so a change over H steps below that can be rounded away on every average. ``None``
      (default) sends in the params' dtypes.
    comm_block_size: B, the values per float32 scale of a quantized ``comm_dtype`` (``None``,
      the default, is 256; even for the 4-bit formats); ignored otherwise.
    slice_axis: a mapped axis inside each worker (not part of ``axis_name``) whose devices hold
      identical copies of the params, such as the devices of one replica after
      ``tower(inner, slice_axis)``: each of its K devices then exchanges only its 1/K slice of the
      model average
      across the workers and the slices are gathered back inside the worker, so the K devices
      together send the params' bytes once instead of K times. ``None`` (default): every
      device exchanges the whole tree.
    error_feedback: must be ``False`` (the default). Feeding the quantization error back would
      keep a params-sized float32 residual per worker, as much memory as an anchor, while
      still rounding the params themselves (an error proportional to :math:`|x|`, not to the
      change): ``diloco(inner, optax.sgd(1.0), comm_dtype=...)`` is the same model average for
      one params-sized copy (the anchor), exchanging the change since the last average, so
      its error is proportional to that change; ``error_feedback=True`` there feeds it back.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; extra args are forwarded to ``inner``.

  Shapes:
    ``updates`` and ``params`` share one tree (each worker's own); the returned updates have
    ``inner``'s dtypes. Memory: nothing params-sized beyond ``inner``'s state.

  Collectives:
    On sync steps only (:math:`s > W`, :math:`(s - W) \bmod H = 0`), inside a ``lax.cond``:
    one ``psum`` over ``axis_name`` of a params-sized tree (the params' bytes, or their element
    count times ``comm_dtype``'s itemsize; an ``all_gather`` for 8-bit floats, receiving N
    times that). With a quantized format, two ``all_gather`` (codes and scales of every leaf): each
    worker sends ``wire_bytes``, :math:`n (c + 4/B)` bytes for :math:`n` values (:math:`c = 1`
    for ``int8``, :math:`\frac12` for 4-bit), and receives N times that; counting what arrives
    from the other workers, :math:`(N - 1)(c + 4/B)` against a float32 ring all-reduce's
    :math:`8 (N - 1)/N` per value, ``int8`` receives fewer up to N = 7 workers and 4-bit up to
    N = 15 (:math:`B = 256`). During the warm-up (:math:`s \le W`), inside another
    ``lax.cond``: those of :func:`all_reduce`, one all-reduce of the gradients per step. None
    when ``axis_name`` is ``None``. :func:`communication_report` measures them.

  Static hint:
    ``update(..., communicate=True)`` or ``communicate=False`` (a Python bool, fixed at trace
    time) replaces the counter rule for that call: the step averages the models or not, compiled
    without the ``lax.cond`` (``False``: without the ``psum``). ``local_step`` advances either
    way. A hint that agrees with the rule gives the rule's results (to float rounding: XLA fuses
    the two programs differently); one that disagrees adds or skips that one average, and the
    rule's later ones stay where they were. ``None`` (or leaving it out) is the rule. It is not
    forwarded to ``inner``. The warm-up's all-reduce follows the counter whatever the hint.

  Raises:
    TypeError: ``inner`` is not a transformation; ``sync_period``, ``warmup_steps`` or
      ``num_workers`` not an int; ``comm_dtype`` not ``None``, a floating dtype or a quantized
      format; ``comm_block_size`` not an int; ``error_feedback`` not a bool; ``update``'s
      ``communicate`` not ``None`` or a bool.
    ValueError: ``sync_period``, ``num_workers`` or ``comm_block_size`` not positive;
      ``comm_block_size``
      given with a ``comm_dtype`` that is not block-quantized, or odd
      with a 4-bit one; ``error_feedback=True``;
      ``warmup_steps`` < 0;
      ``num_workers > 1`` with ``axis_name=None``; ``num_workers`` different from the axis
      size; ``update`` without ``params``, or where a named ``axis_name`` is not bound.

  Examples:
    Two workers emulated with ``vmap``, averaging every 2 steps:

    >>> import jax, jax.numpy as jnp, optax, optax_dist
    >>> tx = optax_dist.local_sgd(optax.sgd(1.0), sync_period=2, axis_name="w")
    >>> params = jnp.zeros((2, 1))
    >>> state = jax.vmap(tx.init, axis_name="w")(params)
    >>> update = jax.vmap(tx.update, axis_name="w")
    >>> for grads in (jnp.array([[-1.0], [-3.0]]), jnp.array([[-1.0], [-1.0]])):
    ...   updates, state = update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params[:, 0]  # workers at 2 and 4 before the average
    Array([3., 3.], dtype=float32)

  References:
    TensorFlow 1.x, ``tf.contrib.opt.ModelAverageOptimizer``.
    Lin, Stich, Patel & Jaggi, `Don't Use Large Mini-Batches, Use Local SGD
    <https://arxiv.org/abs/1808.07217>`_, ICLR 2020 (post-local SGD).
    PyTorch ``PostLocalSGDOptimizer``; torchft ``torchft.local_sgd.LocalSGD``.
  """
  fn = "local_sgd"
  _checks.check_transformation(fn, inner)
  inner = _axis.wrap_inner(inner)  # unknown extra args dropped, state dtypes kept
  _checks.check_positive_int(fn, "sync_period", sync_period)
  check_warmup_steps(fn, warmup_steps)
  exchange = _exchange.Exchange(
    axis_name, num_workers, comm_dtype, comm_block_size, slice_axis, call=fn
  )
  if _checks.check_error_feedback(fn, error_feedback, exchange.comm_dtype):
    raise ValueError(
      "`local_sgd(error_feedback=True)` is not supported: local SGD exchanges the params"
      " themselves, so a fed-back residual would cost a params-sized float32 copy per worker"
      " (as much as an anchor) while the rounding error stays proportional to the params, not"
      " to their change. Use diloco(inner, optax.sgd(1.0), comm_dtype=...): the same model"
      " average for one params-sized copy, exchanging the change since the last average (its"
      " error proportional to that change), with error_feedback=True there if wanted."
    )

  def init_fn(params):
    _checks.check_floating(fn, params)
    exchange.size()
    return LocalSGDState(local_step=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    _checks.require_params(fn, params)
    _checks.check_tree_matches(fn, updates, params, "params")
    hint = _axis.communication_hint(fn, extra_args)
    exchange.bind()
    local_step = optax.safe_increment(state.local_step)

    # Warm-up: synchronous data parallelism while local_step <= W, one all-reduce per step.
    if axis_name is not None and _checks.concrete(warmup_steps) != 0:
      warm = exchange.agree(local_sgd_warming_up(local_step, warmup_steps=warmup_steps))
      updates = _axis.communicate_if(
        warm, lambda g: exchange.reduce(g, "mean"), lambda g: g, updates
      )
    local_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    if axis_name is None:  # one worker: its own mean
      return local_updates, LocalSGDState(local_step=local_step, inner_state=inner_state)

    # Model average on steps W + H, W + 2H, ...: x_i <- mean_j x'_j.
    rule = local_sgd_syncs(local_step, sync_period=sync_period, warmup_steps=warmup_steps)
    sync = exchange.due(rule, hint)

    def average(u):
      new_params = optax.apply_updates(params, u)  # x'_i
      mean = local_sgd_outer_step(exchange.mean(new_params), params)
      return jax.tree.map(lambda m, p, u: (m - p).astype(u.dtype), mean, params, u)

    local_updates = _axis.communicate_if(sync, average, lambda u: u, local_updates)
    return local_updates, LocalSGDState(local_step=local_step, inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
