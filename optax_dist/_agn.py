"""Accumulated gradient normalization (TF's ``AGNOptimizer``)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dist import _axis, _checks, _exchange, _state


class AGNState(NamedTuple):
  """State of :func:`agn`.

  Attributes:
    local_step: ``int32[]``, the number of ``update`` calls of this worker so far.
    center: the center variable; the params' tree, shapes and dtypes; identical on every worker.
    grad_accum: the sum of this worker's raw gradients since its last commit; the params' tree,
      shapes and dtypes.
    inner_state: the state of ``inner`` for this worker's local steps.
    center_inner_state: the state of ``inner`` for the center's updates; identical on every
      worker.
  """

  local_step: jax.Array
  center: optax.Params
  grad_accum: optax.Updates
  inner_state: optax.OptState
  center_inner_state: optax.OptState

  AVERAGE = "center"  # eval_params returns this field
  RESTART = "center"  # resize_state restarts the workers' params from this field
  RESIZE = {
    "local_step": _state.KEEP, "center": _state.KEEP, "grad_accum": _state.MEAN,
    "inner_state": _state.INNER, "center_inner_state": _state.KEEP,
  }


def agn_communicates(step: Any, *, communication_period: int) -> Any:
  """Whether ``update`` call number ``step`` (from 1) of :func:`agn` commits to the center.

  The rule ``update`` applies to its own ``local_step`` (after its increment): ``step %
  communication_period == 0``.

  Args:
    step: the 1-based number of the ``update`` call (a Python int or an integer array).
    communication_period: τ, as given to :func:`agn`.

  Returns:
    A bool (a bool array for an integer array ``step``).

  Collectives:
    None.

  Raises:
    TypeError, ValueError: a period or count not a positive int (checked when concrete).

  Examples:
    >>> import optax_dist
    >>> [t for t in range(1, 8) if optax_dist.agn_communicates(t, communication_period=3)]
    [3, 6]

  References:
    TensorFlow 1.x, ``tf.contrib.opt.AGNOptimizer`` (``communication_period``).
  """
  _checks.check_positive_int("agn_communicates", "communication_period", communication_period)
  return step % communication_period == 0


def agn(
  inner: optax.GradientTransformation,
  num_workers: int | None = None,
  *,
  communication_period: int = 10,
  center_update: str = "sequential",
  axis_name: Hashable | None = None,
  comm_dtype: Any = None,
  comm_block_size: int | None = None,
  slice_axis: Hashable | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Accumulated gradient normalization: workers commit their mean gradient to a center.

  Every worker :math:`i` trains its own params :math:`x_i` with ``inner`` and accumulates its raw
  gradients; every ``communication_period`` (τ) steps it commits their mean to the center, which
  takes an ``inner`` step on it, and every worker restarts from the new center:

  .. math::

    x_i &\leftarrow x_i + \mathrm{inner}(g_i), \qquad a_i \leftarrow a_i + g_i \\
    \text{if } \mathrm{local\_step} \bmod \tau = 0:\quad
      \tilde{x} &\leftarrow \tilde{x} + \mathrm{inner}_{\tilde{x}}(a_j / \tau)
      \quad \text{for } j = 0, \dots, N - 1 \text{ in axis order (``"sequential"``)} \\
      \text{or}\quad \tilde{x} &\leftarrow \tilde{x} + \mathrm{inner}_{\tilde{x}}\big(
      \tfrac{1}{N} \textstyle\sum_j a_j / \tau\big) \quad (\text{``"mean"``}) \\
      x_i &\leftarrow \tilde{x}, \qquad a_i \leftarrow 0

  where :math:`\mathrm{inner}_{\tilde{x}}` is ``inner`` called with ``params=center`` and the one
  shared ``center_inner_state`` (TF applies the same optimizer to the center, with slots on the
  parameter server). The accumulated gradient is divided by τ, the period, as in TF.

  Args:
    inner: the optimizer of the local steps and of the center.
    num_workers: number of workers; defaults to the size of ``axis_name`` (1 when it is
      ``None``). If given, it must equal that size (TF stores it and never uses it).
    communication_period: τ, a count of ``update`` calls; the first commit is on the τ-th call.
    center_update: ``"sequential"`` (TF's semantics: one ``inner`` step per worker's commit,
      in axis-index order) or ``"mean"`` (one ``inner`` step on the workers' mean).
    axis_name: the mapped axis (or tuple of mesh axes, e.g. ``("hosts", "gpus")``; the commit
      order is then the row-major order of the tuple's positions) whose positions are the
      workers; ``None`` for one worker.
    comm_dtype: the floating dtype in which the workers' mean gradients :math:`a_i / \tau` are
      exchanged (e.g. ``jnp.bfloat16``: half the bytes of ``float32``): cast to it before the
      ``all_gather`` or ``pmean`` and back to the params' dtypes after, so the center's ``inner``
      steps run in the params' dtypes. ``None`` (default) sends in the params' dtypes.
      ``jnp.int8`` (or ``"int8"``), ``jnp.float4_e2m1fn`` (or ``"float4_e2m1fn"``) and
      ``"e3m0"`` send block-quantized codes with one float32 scale per ``comm_block_size``
      values (``optax_dist._quantize``): ``"mean"`` sums the decoded commits in float32 in
      worker order; ``"sequential"`` decodes each worker's commit and applies it as above.
      There is no error feedback: a worker's accumulator restarts from zero after each commit.
    comm_block_size: B, the values per float32 scale of a quantized ``comm_dtype`` (``None``,
      the default, is 256; even for the 4-bit formats); ignored otherwise.
    slice_axis: a mapped axis inside each worker (not part of ``axis_name``), such as the
      devices of one replica with ``inner = tower(..., slice_axis)``, whose steps (the center's
      included) average over it: each of its K devices accumulates its own raw gradients, so the
      worker's commit is their mean over ``slice_axis``. A reduce-scatter over ``slice_axis``
      gives each device its 1/K slice of that mean, which alone crosses between the workers,
      and the slices are gathered back inside the worker (with ``"sequential"``, every worker's
      commit): the K devices together send the commit's bytes once instead of K times. The
      center takes the same steps as without it (the tower's mean of K equal commits), to float
      rounding. ``None`` (default): every device exchanges its whole accumulator.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Extra args are forwarded to ``inner``'s local
    update; the center's updates get none (they are not computed from this worker's batch).

  Shapes:
    ``updates`` and ``params`` share one tree; the returned updates, ``center`` and
    ``grad_accum`` have the params' tree, shapes and dtypes. Memory: two extra copies of the params
    (center, accumulator) plus the center's ``inner`` state, per worker.

  Collectives:
    On communication steps only, inside a ``lax.cond``; none on other steps.
    ``"sequential"`` issues one ``all_gather`` over ``axis_name`` of the accumulated gradients
    (params bytes sent, N × params bytes received per worker) and applies the N commits in
    order with a ``lax.scan`` (the program's size does not grow with N); ``"mean"`` issues one
    ``pmean`` of a params-sized tree (the params' bytes). With ``comm_dtype``, bytes are element
    counts times its itemsize. With a quantized format both are two ``all_gather`` (the codes
    and scales of every leaf): each worker sends ``wire_bytes``, :math:`n (c + 4/B)` bytes for
    :math:`n` values (:math:`c = 1` for ``int8``, :math:`\frac12` for 4-bit), and receives N
    times that; for ``"mean"``, counting what arrives from the other workers,
    :math:`(N - 1)(c + 4/B)` against a float32 ring all-reduce's :math:`8 (N - 1)/N` per value,
    ``int8`` receives fewer up to N = 7 workers and 4-bit up to N = 15 (:math:`B = 256`); for
    ``"sequential"`` it is 3.9 (``int8``) and 7.8 (4-bit) times fewer than float32 at any N.
    With ``slice_axis`` of size K every count across the workers is divided by K, and one
    ``all_gather`` over ``slice_axis`` inside the worker rebuilds the result (N × params
    elements received with ``"sequential"``, params elements with ``"mean"``).
    None when ``axis_name`` is ``None``.
    :func:`communication_report` measures them.

    Memory: ``"sequential"`` holds the gathered commits, N × params elements, on every worker
    during a communication step; beyond a few workers prefer ``center_update="mean"`` (one
    params-sized buffer, one ``inner`` step per commit round).

  Static hint:
    ``update(..., communicate=True)`` or ``communicate=False`` (a Python bool, fixed at trace
    time) replaces the counter rule for that call: the step commits to the center or not,
    compiled without the ``lax.cond`` (``False``: without the collective). ``local_step``
    advances either way. A hint that agrees with the rule gives the rule's results (to float
    rounding: XLA fuses the two programs differently); one that disagrees adds or skips that one
    commit, and the rule's later ones stay where they were. ``None`` (or leaving it out) is the
    rule. It is not forwarded to ``inner``.

  Raises:
    TypeError: ``inner`` is not a transformation; a hyperparameter has the wrong type;
      ``comm_dtype`` not ``None``, a floating dtype or a quantized format; a param leaf is not
      floating point (the message names its path); ``update``'s ``communicate`` not ``None`` or
      a bool.
    ValueError: ``communication_period``, ``num_workers`` or ``comm_block_size`` not a positive
      int; ``comm_block_size``
      given with a ``comm_dtype`` that is not block-quantized, or odd
      with a 4-bit one; ``center_update``
      not ``"sequential"`` or ``"mean"``; ``num_workers > 1`` with ``axis_name=None``;
      ``num_workers`` different from the axis size; ``update`` without ``params``, where a
      named ``axis_name`` is not bound, or with updates whose shapes differ from the params';
      ``slice_axis`` one of the workers' axes, or not bound in ``update``.

  Examples:
    One worker, committing every 2 steps with plain SGD:

    >>> import jax.numpy as jnp, optax, optax_dist
    >>> tx = optax_dist.agn(optax.sgd(0.1), communication_period=2)
    >>> params = jnp.array([0.0])
    >>> state = tx.init(params)
    >>> for g in (jnp.array([-1.0]), jnp.array([-3.0])):
    ...   updates, state = tx.update(g, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params, state.center  # the center took one step on the mean gradient, -2
    (Array([0.2], dtype=float32), Array([0.2], dtype=float32))

  References:
    TensorFlow 1.x, ``tf.contrib.opt.AGNOptimizer``.
    Hermans, Spanakis & Möckel, `Accumulated Gradient Normalization
    <https://arxiv.org/abs/1710.02368>`_, ACML 2017.
  """
  fn = "agn"
  _checks.check_transformation(fn, inner)
  inner = _axis.wrap_inner(inner)  # unknown extra args dropped, state dtypes kept
  _checks.check_positive_int(fn, "communication_period", communication_period)
  _checks.check_choice(fn, "center_update", center_update, ("sequential", "mean"))
  exchange = _exchange.Exchange(
    axis_name, num_workers, comm_dtype, comm_block_size, slice_axis, call=fn
  )

  def init_fn(params):
    _checks.check_floating(fn, params)
    exchange.size()
    return AGNState(
      local_step=jnp.zeros([], jnp.int32),
      center=_axis.copy(params),
      grad_accum=optax.tree.zeros_like(params),
      inner_state=inner.init(params),
      center_inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    _checks.require_params(fn, params)
    _checks.check_floating(fn, params)
    _checks.check_tree_matches(fn, updates, state.center, "params")
    hint = _axis.communication_hint(fn, extra_args)
    n = exchange.bind()

    # x_i <- x_i + inner(g_i); a_i <- a_i + g_i.
    local_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    grad_accum = jax.tree.map(lambda a, g: (a + g).astype(a.dtype), state.grad_accum, updates)
    local_step = optax.safe_increment(state.local_step)

    def center_step(carry, grads):
      center, center_inner_state = carry
      center_updates, new_inner_state = inner.update(grads, center_inner_state, center)
      return (optax.apply_updates(center, center_updates), new_inner_state), None

    # The conditional carries only the center and its inner state: on other steps it hands them
    # back unchanged (XLA then writes no copy of them). The updates and the accumulator's reset
    # are selected outside it.
    def commit(center, grad_accum, center_inner_state):
      mean_grad = jax.tree.map(lambda a: (a / communication_period).astype(a.dtype), grad_accum)
      carry = (center, center_inner_state)
      if axis_name is None or center_update == "mean":
        # Summed, then divided in the params' dtypes (one worker: its own).
        carry, _ = center_step(carry, exchange.mean(mean_grad, slice_mean=True))
      else:
        # The N commits in axis order, one scan step each: the program size does not grow
        # with N. The gathered tree holds N x params elements on every worker.
        gathered = exchange.gather(mean_grad, slice_mean=True)
        carry, _ = jax.lax.scan(center_step, carry, gathered, length=n)
      return carry

    def keep(center, grad_accum, center_inner_state):
      return center, center_inner_state

    communicate = exchange.due(
      agn_communicates(local_step, communication_period=communication_period), hint
    )
    center, center_inner_state = _axis.communicate_if(
      communicate, commit, keep, state.center, grad_accum, state.center_inner_state,
    )
    # x_i <- center, a_i <- 0 on a communication step.
    local_updates = jax.tree.map(
      lambda c, p, u: _axis.select(communicate, (c - p).astype(u.dtype), u),
      center, params, local_updates,
    )
    grad_accum = jax.tree.map(
      lambda a: _axis.select(communicate, jnp.zeros_like(a), a), grad_accum)
    return local_updates, AGNState(
      local_step=local_step,
      center=center,
      grad_accum=grad_accum,
      inner_state=inner_state,
      center_inner_state=center_inner_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
