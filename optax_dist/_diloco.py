"""DiLoCo: local inner steps, an outer optimizer step on the workers' mean pseudo-gradient."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dist import _axis, _checks, _exchange, _outer, _state


class DiLoCoState(NamedTuple):
  """State of :func:`diloco`.

  Attributes:
    local_step: ``int32[]``, the number of ``update`` calls of this worker so far.
    anchor: the global params :math:`\\theta` of the last sync (the params given to ``init``
      before the first); the params' tree and shapes, in ``anchor_dtype`` (default: each
      param's dtype); identical on every worker.
    inner_state: the state of ``inner``, local to this worker, kept across syncs.
    outer_state: the state of ``outer``, ``outer.init(anchor)``; identical on every worker.
    error_feedback: with ``error_feedback=True``, this worker's residual :math:`r_i`: the part
      of its pseudo-gradients that quantization has dropped so far, to be added to the next one;
      the params' tree and shapes, ``float32``, zeros at ``init``; local to this worker. ``None``
      (no leaves) otherwise. On a resize it becomes the workers' mean on every worker
      (``MEAN``): the next sync's :math:`\\Delta` adds :math:`\\frac{1}{M}\\sum_i r_i`, and
      :math:`M` copies of the mean owe the mean pseudo-gradient exactly what the :math:`N` old
      residuals owed it (worker 0's, ``KEEP``, would owe :math:`r_0`; zeros would drop it).
  """

  local_step: jax.Array
  anchor: optax.Params
  inner_state: optax.OptState
  outer_state: optax.OptState
  error_feedback: Any = None

  AVERAGE = "anchor"  # eval_params returns this field
  RESTART = "anchor"  # resize_state restarts the workers' params from this field
  RESIZE = {
    "local_step": _state.KEEP, "anchor": _state.KEEP, "inner_state": _state.INNER,
    "outer_state": _state.KEEP, "error_feedback": _state.MEAN,
  }


def diloco_syncs(step: Any, *, sync_period: int) -> Any:
  """Whether ``update`` call number ``step`` (from 1) of :func:`diloco` syncs.

  The rule ``update`` applies to its own ``local_step`` (after its increment): ``step % sync_period
  == 0``.

  Args:
    step: the 1-based number of the ``update`` call (a Python int or an integer array).
    sync_period: H, as given to :func:`diloco`.

  Returns:
    A bool (a bool array for an integer array ``step``).

  Collectives:
    None.

  Raises:
    TypeError, ValueError: a period or count not a positive int (checked when concrete).

  Examples:
    >>> import optax_dist
    >>> [t for t in range(1, 11) if optax_dist.diloco_syncs(t, sync_period=4)]
    [4, 8]

  References:
    Douillard et al., `DiLoCo <https://arxiv.org/abs/2311.08105>`_, 2023 (Algorithm 1).
  """
  _checks.check_positive_int("diloco_syncs", "sync_period", sync_period)
  return step % sync_period == 0


# ----------------------------------------------------------------------------------------------
# The halves of a sync.


def diloco_payload(
  exchange: _exchange.Exchange, anchor: Any, new_params: Any, residual: Any = None
) -> tuple[Any, Any]:
  r"""The local half of :func:`diloco`'s sync: what this worker adds to the workers' mean.

  .. math::

    p_i = Q(\theta - x'_i + r_i), \qquad r'_i = \theta - x'_i + r_i - Q(\theta - x'_i + r_i)

  with :math:`\theta - x'_i` in the anchor's dtypes and :math:`Q` ``exchange``'s wire format
  (:meth:`Exchange.payload <optax_dist.Exchange.payload>`: the identity for ``comm_dtype=None``,
  a cast to a floating ``comm_dtype``, the float32 decoded block codes of a quantized one);
  :math:`r_i` only with error feedback. :func:`merge_payloads` of the N workers' payloads in
  rank order then :func:`diloco_outer_step` give what :func:`diloco`'s ``update`` computes on a
  sync step around its in-program mean (bit for bit for the gathered and quantized formats and
  for two workers, else within one unit in the last place of the sum: see
  :func:`merge_payloads`). The payload is arrays: it can leave the jitted step, to be merged
  by an exchange outside it (e.g. over torchft).

  Args:
    exchange: the :class:`~optax_dist.Exchange` of the :func:`diloco` it stands in for (its
      ``comm_dtype``, ``comm_block_size``, ``slice_axis``).
    anchor: :math:`\theta`, ``DiLoCoState.anchor``.
    new_params: :math:`x'_i`, this worker's params after its inner step (the anchor's tree and
      shapes).
    residual: ``DiLoCoState.error_feedback`` (float32, the anchor's shapes) with error feedback,
      else ``None``.

  Returns:
    ``(payload, new_residual)``: the anchor's tree and shapes, in the wire format's dtype
    (float32 for the 8-bit floats and the quantized formats); the residual for the next sync
    (``None`` without error feedback).

  Shapes:
    One worker's trees in, one worker's out; nothing has a workers' axis.

  Collectives:
    None across the workers (with ``slice_axis``, one ``all_gather`` inside the worker).

  Raises:
    TypeError: ``exchange`` not an :class:`~optax_dist.Exchange`.
    ValueError: a ``residual`` without a quantized ``comm_dtype``, or not of the anchor's
      shapes.

  Examples:
    A bfloat16 wire: the pseudo-gradient as the ``psum`` adds it.

    >>> import jax.numpy as jnp, optax_dist
    >>> exchange = optax_dist.Exchange("w", comm_dtype=jnp.bfloat16, call="diloco")
    >>> payload, _ = optax_dist.diloco_payload(exchange, jnp.ones(2), jnp.array([0.5, -0.1]))
    >>> payload
    Array([0.5, 1.10156], dtype=bfloat16)

  References:
    Douillard et al., `DiLoCo <https://arxiv.org/abs/2311.08105>`_, 2023 (Algorithm 1, the
    outer gradient of each worker).
  """
  _exchange.check_exchange("diloco_payload", exchange)
  return _outer.payload(exchange, anchor, new_params, residual)


def diloco_outer_step(
  outer: optax.GradientTransformation, anchor: Any, outer_state: optax.OptState, merged: Any
) -> tuple[Any, optax.OptState]:
  r"""The outer half of :func:`diloco`'s sync: one ``outer`` step on the merged pseudo-gradient.

  .. math::

    \Delta = \bar p \text{ cast to the anchor's dtypes}, \qquad
    \theta \leftarrow \theta + \mathrm{outer}(\Delta)

  with :math:`\bar p` the workers' mean of their :func:`diloco_payload`\ s
  (:func:`merge_payloads`). Every worker then restarts from the new :math:`\theta`: its
  update is :math:`\theta - x_i`. It is the step :func:`diloco`'s ``update`` takes after its
  in-program mean.

  Args:
    outer: :func:`diloco`'s ``outer`` (the default is
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)``).
    anchor: :math:`\theta`, ``DiLoCoState.anchor``.
    outer_state: ``DiLoCoState.outer_state``.
    merged: :math:`\bar p`, the anchor's tree and shapes, any floating dtypes.

  Returns:
    ``(new_anchor, new_outer_state)``, with the dtypes of the old ones.

  Collectives:
    None.

  Raises:
    ValueError: ``merged`` not of the anchor's tree (raised by ``jax.tree.map``).

  Examples:
    Two workers' payloads, outer SGD of learning rate 1:

    >>> import jax.numpy as jnp, optax, optax_dist
    >>> outer, anchor = optax.sgd(1.0), jnp.ones(2)
    >>> merged = optax_dist.merge_payloads([jnp.array([1.0, 2.0]), jnp.array([3.0, 0.0])])
    >>> new_anchor, _ = optax_dist.diloco_outer_step(outer, anchor, outer.init(anchor), merged)
    >>> new_anchor
    Array([-1.,  0.], dtype=float32)

  References:
    Douillard et al., `DiLoCo <https://arxiv.org/abs/2311.08105>`_, 2023 (Algorithm 1, the
    outer optimizer step).
  """
  return _outer.outer_step(outer, anchor, outer_state, merged)


def diloco_synchronize(
  outer: optax.GradientTransformation, exchange: _exchange.Exchange, anchor: Any,
  outer_state: optax.OptState, new_params: Any, residual: Any = None
) -> tuple[Any, optax.OptState, Any]:
  r""":func:`diloco`'s sync in the program: the workers' mean pseudo-gradient, an outer step.

  The mean is over ``exchange``'s axis, then ``outer`` takes one step from the anchor on it.

  .. math::

    \Delta = \tfrac{1}{N} \textstyle\sum_j Q(\theta - x'_j + r_j), \qquad
    \theta \leftarrow \theta + \mathrm{outer}(\Delta)

  (:math:`r_j` and the new residual :math:`r'_i` only with error feedback, as in
  :func:`diloco_payload`). It is what :func:`diloco`'s ``update`` computes on a sync step after
  its inner step, and it may run apart from that step: a trainer can compile its step once with
  ``communicate=False`` and, on a sync step, run this in a small program on the step's new params
  (and land every worker on the new anchor from its params before the step, ``params + (anchor -
  params)``, as ``update`` does).

  Args:
    outer: :func:`diloco`'s ``outer`` (the default is
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)``).
    exchange: the :class:`~optax_dist.Exchange` of that :func:`diloco` (its ``axis_name``,
      ``comm_dtype``, ``comm_block_size``, ``slice_axis``).
    anchor: :math:`\theta`, ``DiLoCoState.anchor``.
    outer_state: ``DiLoCoState.outer_state``.
    new_params: :math:`x'_i`, this worker's params after its inner step.
    residual: ``DiLoCoState.error_feedback`` with error feedback, else ``None``.

  Returns:
    ``(new_anchor, new_outer_state, new_residual)``, the new residual ``None`` without error
    feedback; the dtypes of the old ones.

  Collectives:
    :meth:`Exchange.mean <optax_dist.Exchange.mean>` (or ``mean_with_feedback``) of one
    params-sized tree over ``exchange``'s axis: the collectives :func:`diloco` issues on a sync
    step (see there).

  Raises:
    TypeError: ``exchange`` not an :class:`~optax_dist.Exchange`.
    ValueError: ``exchange``'s ``axis_name`` or ``slice_axis`` not bound where it runs.

  Examples:
    Two workers emulated with ``vmap``, outer SGD of learning rate 1 (model averaging):

    >>> import jax, jax.numpy as jnp, optax, optax_dist
    >>> outer, exchange = optax.sgd(1.0), optax_dist.Exchange("w")
    >>> def sync(anchor, new_params):
    ...   return optax_dist.diloco_synchronize(
    ...       outer, exchange, anchor, outer.init(anchor), new_params)[0]
    >>> jax.vmap(sync, axis_name="w")(jnp.zeros((2, 1)), jnp.array([[1.0], [3.0]]))[:, 0]
    Array([2., 2.], dtype=float32)

  References:
    Douillard et al., `DiLoCo <https://arxiv.org/abs/2311.08105>`_, 2023 (Algorithm 1, the
    outer step on the averaged outer gradient).
  """
  _exchange.check_exchange("diloco_synchronize", exchange)
  exchange.bind()
  delta, residual = _outer.pseudo_gradient(exchange, anchor, new_params, residual)
  return (*diloco_outer_step(outer, anchor, outer_state, delta), residual)


# ----------------------------------------------------------------------------------------------
# diloco.


def diloco(
  inner: optax.GradientTransformation,
  outer: optax.GradientTransformation | None = None,
  *,
  sync_period: int = 500,
  axis_name: Hashable | None = None,
  num_workers: int | None = None,
  comm_dtype: Any = None,
  comm_block_size: int | None = None,
  error_feedback: bool = False,
  anchor_dtype: Any = None,
  slice_axis: Hashable | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""DiLoCo: H local ``inner`` steps, then an ``outer`` step on the workers' mean pseudo-gradient.

  Every worker :math:`i` trains its own params :math:`x_i` with ``inner``. Every
  ``sync_period`` (H) steps the workers average their pseudo-gradients, the distance from the
  global params (the anchor :math:`\theta`) to where they got, the outer optimizer takes one step
  from :math:`\theta` on it, and every worker restarts from the new :math:`\theta`:

  .. math::

    u_i &= \mathrm{inner}(g_i), \qquad x'_i = x_i + u_i \\
    \text{if } \mathrm{local\_step} \bmod H = 0:\quad
      \Delta &= \tfrac{1}{N} \textstyle\sum_j (\theta - x'_j), \qquad
      \theta \leftarrow \theta + \mathrm{outer}(\Delta), \qquad x_i \leftarrow \theta \\
    \text{otherwise:}\quad x_i &\leftarrow x'_i

  The returned updates are :math:`\theta - x_i` on a sync step (every worker lands on the new
  anchor, up to float rounding) and :math:`u_i` otherwise. ``inner``'s state is kept across
  syncs (not reset), as the paper, torchft and MaxText do. With ``outer=optax.sgd(1.0)`` the
  sync is model averaging: :math:`\theta \leftarrow \frac{1}{N}\sum_j x'_j`.

  Args:
    inner: the local optimizer of each worker.
    outer: the optimizer of the anchor, fed the pseudo-gradient :math:`\Delta` (a descent
      direction, as a gradient). Default: ``optax.sgd(0.7, momentum=0.9, nesterov=True)``, the
      paper's outer Nesterov momentum, tuned for hundreds of outer steps. With only tens of
      syncs a lower momentum can end far ahead: on ``optax-dist train --task lm`` with 10 syncs
      (200 steps, H = 20, 2 replicas) momentum 0.9 ended at 3.354 validation bits per byte,
      0.5 at 3.150 (``benchmarks/results/network.md``).
    sync_period: H, a count of ``update`` calls; the first sync is on the H-th call.
    axis_name: the mapped axis (or tuple of mesh axes) whose positions are the workers;
      ``None`` for one worker.
    num_workers: number of workers :math:`N`; defaults to the size of ``axis_name`` (1 when it
      is ``None``). If given, it must equal that size.
    comm_dtype: the floating dtype in which :math:`\theta - x'_i` is all-reduced (e.g.
      ``jnp.bfloat16``: half the bytes of ``float32``); ``None`` (default) sends in the
      anchor's dtypes. 8-bit floats (``jnp.float8_e4m3fn``, ...) are quantized, all-gathered
      and summed in float32 (see Collectives). ``jnp.int8`` (or ``"int8"``),
      ``jnp.float4_e2m1fn`` (or ``"float4_e2m1fn"``) and ``"e3m0"`` send block-quantized codes
      with one float32 scale per ``comm_block_size`` values (the block's largest magnitude
      maps to the format's largest; ``optax_dist._quantize`` gives the grids and rounding),
      gathered and summed in float32 in worker order.
    comm_block_size: B, the values per float32 scale of a quantized ``comm_dtype`` (``None``,
      the default, is 256; even for the 4-bit formats); ignored otherwise. Smaller blocks track
      the local magnitude more closely at :math:`4/B` bytes per value. Fixed at trace time: with
      ``optax.inject_hyperparams``, name it in ``static_args``.
    slice_axis: a mapped axis inside each worker (not part of ``axis_name``) whose devices hold
      identical copies of the params, such as the devices of one replica after
      ``tower(inner, slice_axis)``: each of its K devices then exchanges only its 1/K slice
      across the workers and the slices are gathered back inside the worker, so the K devices
      together send the params' bytes once instead of K times. ``None`` (default): every
      device exchanges the whole tree.
    error_feedback: with a quantized ``comm_dtype``, each worker keeps what quantization
      dropped from its pseudo-gradient in ``state.error_feedback`` (float32) and adds it to the
      next one before quantizing: :math:`t_i = \theta - x'_i + r_i`, sent :math:`Q(t_i)`,
      :math:`r_i \leftarrow t_i - Q(t_i)`. Over K syncs the sent sum plus the residual equals
      the pseudo-gradients' sum (to float32 rounding): the error is delayed, not lost. Costs
      one float32 params-sized tree per worker. Default ``False``.
    anchor_dtype: the floating dtype of the anchor, of the pseudo-gradient and of ``outer``'s
      state (``jnp.float32`` is the usual choice for bfloat16 params); ``None`` (default) keeps
      each param's dtype.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; extra args are forwarded to ``inner``.

  Shapes:
    ``updates`` and ``params`` share one tree (each worker's own); the returned updates have
    ``inner``'s dtypes, ``anchor`` the params' tree and shapes. Memory per worker: one copy of
    the params (the anchor, in ``anchor_dtype``) plus ``outer``'s state (one more copy for
    momentum) beyond ``inner``'s.

  Collectives:
    One ``psum`` over ``axis_name`` of a params-sized tree (the params' element count times the
    itemsize of ``comm_dtype`` or of the anchor's dtype), on sync steps only
    (``local_step % sync_period == 0``), inside a ``lax.cond``; none on other steps: per step
    on average :math:`1/H` of the params' bytes. With an 8-bit float ``comm_dtype`` the
    ``psum`` is an ``all_gather`` instead: each worker sends the params' element count in bytes
    and receives N times that. With a quantized format it is two ``all_gather`` for all the
    leaves end to end, codes and scales: each worker sends ``wire_bytes``, :math:`n (c + 4/B)`
    bytes for :math:`n` values (:math:`c = 1` for ``int8``, :math:`\frac12` for the 4-bit
    formats, 1.016 and 0.516 bytes per value at :math:`B = 256`), and receives N times that.
    The bytes received grow with N where a float32 ring all-reduce receives about
    :math:`8 (N - 1)/N` per value: counting what arrives from the other workers,
    :math:`(N - 1)(c + 4/B)` against :math:`8 (N - 1)/N`, ``int8`` receives fewer up to N = 7
    and the 4-bit formats up to N = 15 (against bfloat16's ring, :math:`4 (N - 1)/N`: up to 3
    and 7). None when ``axis_name`` is ``None``. :func:`communication_report` measures them.

    To accumulate gradients, put the accumulation inside: ``diloco(optax.MultiSteps(inner, k),
    sync_period=H * k)`` is the same algorithm as ``optax.MultiSteps(diloco(inner,
    sync_period=H), k)`` and exchanges once per sync. The latter, under ``vmap`` (and the
    global view), runs this ``update`` on every micro-step (``MultiSteps``' predicate is
    batched, its conditional a select) and the sync predicate holds on all k micro-steps of a
    sync window: k exchanges per sync, k - 1 of them discarded.

  Static hint:
    ``update(..., communicate=True)`` or ``communicate=False`` (a Python bool, fixed at trace
    time) replaces the counter rule for that call: the step syncs or not, compiled without the
    ``lax.cond`` (``False``: without the ``psum``). ``local_step`` advances either way. A hint
    that agrees with the rule gives the rule's results (to float rounding: XLA fuses the two
    programs differently); one that disagrees adds or skips that one sync, and the rule's later
    ones stay where they were. ``None`` (or leaving it out) is the rule. It is not forwarded to
    ``inner``.

  Raises:
    TypeError: ``inner`` or ``outer`` is not a transformation; ``sync_period`` or
      ``num_workers`` not an int; ``comm_dtype`` not ``None``, a floating dtype or a quantized
      format; ``anchor_dtype`` not ``None`` or a floating dtype; ``comm_block_size`` not an int;
      ``error_feedback`` not a bool; a non-floating param leaf (in ``init``); ``update``'s
      ``communicate`` not ``None`` or a bool.
    ValueError: ``sync_period``, ``num_workers`` or ``comm_block_size`` not positive;
      ``comm_block_size``
      given with a ``comm_dtype`` that is not block-quantized, or odd
      with a 4-bit one; ``error_feedback=True`` without a
      quantized ``comm_dtype``; ``num_workers > 1`` with
      ``axis_name=None``; ``num_workers`` different from the axis size; ``update`` without
      ``params``, or where a named ``axis_name`` is not bound.

  Examples:
    Two workers emulated with ``vmap``, syncing every step, with outer SGD of learning rate 1
    (model averaging):

    >>> import jax, jax.numpy as jnp, optax, optax_dist
    >>> tx = optax_dist.diloco(optax.sgd(1.0), optax.sgd(1.0), sync_period=1, axis_name="w")
    >>> params = jnp.zeros((2, 1))
    >>> state = jax.vmap(tx.init, axis_name="w")(params)
    >>> grads = jnp.array([[-1.0], [-3.0]])
    >>> updates, state = jax.vmap(tx.update, axis_name="w")(grads, state, params)
    >>> optax.apply_updates(params, updates)[:, 0], state.anchor[:, 0]
    (Array([2., 2.], dtype=float32), Array([2., 2.], dtype=float32))

  References:
    Douillard et al., `DiLoCo: Distributed Low-Communication Training of Language Models
    <https://arxiv.org/abs/2311.08105>`_, 2023 (Algorithm 1).
    torchft ``torchft.local_sgd.DiLoCo``; MaxText ``diloco.py``.
  """
  fn = "diloco"
  _checks.check_transformation(fn, inner)
  inner = _axis.wrap_inner(inner)  # unknown extra args dropped, state dtypes kept
  outer = _outer.default_outer() if outer is None else outer
  _checks.check_transformation(fn, outer, "outer")
  _checks.check_positive_int(fn, "sync_period", sync_period)
  exchange = _exchange.Exchange(
    axis_name, num_workers, comm_dtype, comm_block_size, slice_axis, call=fn
  )
  error_feedback = _checks.check_error_feedback(fn, error_feedback, exchange.comm_dtype)
  anchor_dtype = _checks.check_floating_dtype(fn, "anchor_dtype", anchor_dtype)

  def init_fn(params):
    _checks.check_floating(fn, params)
    exchange.size()
    anchor = _axis.copy(params, anchor_dtype)
    return DiLoCoState(
      local_step=jnp.zeros([], jnp.int32),
      anchor=anchor,
      inner_state=inner.init(params),
      outer_state=outer.init(anchor),
      error_feedback=(
        jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        if error_feedback else None
      ),
    )

  def update_fn(updates, state, params=None, **extra_args):
    _checks.require_params(fn, params)
    _checks.check_tree_matches(fn, updates, state.anchor, "params")
    hint = _axis.communication_hint(fn, extra_args)
    exchange.bind()

    local_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    local_step = optax.safe_increment(state.local_step)
    sync = exchange.due(diloco_syncs(local_step, sync_period=sync_period), hint)

    # The conditional carries only what a sync changes: the anchor and the outer state. On
    # other steps it hands them back unchanged (XLA then writes no copy of them).
    # With error feedback it also carries this worker's residual r_i.
    def synchronize(anchor, outer_state, residual, u):
      new_params = optax.apply_updates(params, u)  # x'_i
      return diloco_synchronize(outer, exchange, anchor, outer_state, new_params, residual)

    def keep(anchor, outer_state, residual, u):
      return anchor, outer_state, residual

    anchor, outer_state, residual = _axis.communicate_if(
      sync, synchronize, keep, state.anchor, state.outer_state, state.error_feedback,
      local_updates,
    )
    # x_i <- theta on a sync step.
    local_updates = jax.tree.map(
      lambda a, p, u: _axis.select(sync, (a - p).astype(u.dtype), u), anchor, params,
      local_updates,
    )
    return local_updates, DiLoCoState(
      local_step=local_step, anchor=anchor, inner_state=inner_state, outer_state=outer_state,
      error_feedback=residual,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
