"""Streaming DiLoCo: DiLoCo's sync on one fragment of the params at a time, staggered over H."""

from __future__ import annotations

import functools
import numbers
import operator
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dist import _axis, _checks, _exchange, _fragments, _outer, _state


class StreamingDiLoCoState(NamedTuple):
  """State of :func:`streaming_diloco`.

  Attributes:
    local_step: ``int32[]``, the number of ``update`` calls of this worker so far.
    anchor: the global params :math:`\\theta`, each fragment's leaves as of that fragment's last
      landed sync (an exchange still in flight is not in it); the params' tree and shapes, in
      ``anchor_dtype`` (default: each param's dtype); identical on every worker.
    inner_state: the state of ``inner``, local to this worker, kept across syncs.
    outer_state: a tuple of ``num_fragments`` states of ``outer``; the f-th is ``outer.init``
      of the anchor with the leaves of the other fragments replaced by ``optax.MaskedNode()``
      (as ``optax.masked`` does), and advances only on fragment f's syncs; identical on every
      worker. ``optax.tree.map_params`` with a spec tree needs
      ``is_leaf=lambda x: isinstance(x, optax.MaskedNode)`` here, as for ``optax.masked``.
    in_flight: ``None`` when ``overlap=0``; else the anchor's tree, shapes and dtypes, each
      fragment's leaves holding the workers' mean pseudo-gradient :math:`\\Delta^f` it sent last
      and has not yet applied (meaningful while ``in_flight_step[f] > 0``); identical on every
      worker.
    in_flight_step: ``None`` when ``overlap=0``; else ``int32[F]``, the ``local_step`` at which
      fragment f sent the exchange now in flight, 0 when none is; identical on every worker.
    own_in_flight: ``None`` unless ``eager``; else the anchor's tree, shapes and dtypes, each
      fragment's leaves holding this worker's own pseudo-gradient :math:`\\Delta^f_i` of that
      send; local to this worker.
    error_feedback: ``None`` unless ``error_feedback=True``; else this worker's residual
      :math:`r_i`, what quantization has dropped from its pseudo-gradients so far (fragment f's
      leaves updated on f's sends), to be added to the next one; the params' tree and shapes,
      ``float32``, zeros at ``init``; local to this worker. On a resize it becomes the workers'
      mean (``MEAN``), as :class:`optax_dist.DiLoCoState`'s.
  """

  local_step: jax.Array
  anchor: optax.Params
  inner_state: optax.OptState
  outer_state: tuple[optax.OptState, ...]
  in_flight: optax.Params | None = None
  in_flight_step: jax.Array | None = None
  own_in_flight: optax.Params | None = None
  error_feedback: Any = None

  AVERAGE = "anchor"  # eval_params returns this field
  RESTART = "anchor"  # resize_state restarts the workers' params from this field
  # An exchange in flight lands after a resize as it would have without one; the new workers'
  # own pseudo-gradients (eager) are the old workers' mean, so their eager correction starts
  # from the averaged share.
  RESIZE = {
    "local_step": _state.KEEP, "anchor": _state.KEEP, "inner_state": _state.INNER,
    "outer_state": _state.KEEP, "in_flight": _state.KEEP, "in_flight_step": _state.KEEP,
    "own_in_flight": _state.MEAN, "error_feedback": _state.MEAN,
  }


def sync_offset(fragment: int, sync_period: Any, num_fragments: int) -> Any:
  """:math:`s_f \\bmod H` with :math:`s_f = \\lfloor (f + 1) H / F \\rfloor`."""
  return ((fragment + 1) * sync_period // num_fragments) % sync_period


def streaming_diloco_syncs(
  step: Any, *, sync_period: int, num_fragments: int, fragment: int | None = None
) -> Any:
  """Whether ``update`` call number ``step`` (from 1) of :func:`streaming_diloco` syncs.

  The rule ``update`` applies to its own ``local_step`` (after its increment): fragment f
  syncs where ``step % H == s_f % H``, :math:`s_f = \\lfloor (f + 1) H / F
  \\rfloor`.

  Args:
    step: the 1-based number of the ``update`` call (a Python int or an integer array).
    sync_period: H, as given to :func:`streaming_diloco`.
    num_fragments: F, as given to :func:`streaming_diloco`.
    fragment: the fragment f in ``[0, F)``; ``None`` (default): whether any fragment syncs.

  Returns:
    A bool (a bool array for an integer array ``step``).

  Collectives:
    None.

  Raises:
    TypeError, ValueError: a period or count not a positive int (checked when concrete).

  Examples:
    >>> import optax_dist
    >>> [[f for f in range(2) if optax_dist.streaming_diloco_syncs(
    ...     t, sync_period=4, num_fragments=2, fragment=f)] for t in range(1, 9)]
    [[], [0], [], [1], [], [0], [], [1]]

  References:
    Douillard et al., `Streaming DiLoCo with overlapping communication
    <https://arxiv.org/abs/2501.18512>`_, 2025.
  """
  fn = "streaming_diloco_syncs"
  _checks.check_positive_int(fn, "sync_period", sync_period)
  _checks.check_positive_int(fn, "num_fragments", num_fragments)
  if fragment is not None:
    _checks.check_int(fn, "fragment", fragment)
    if not 0 <= fragment < num_fragments:
      raise ValueError(
        f"`{fn}(fragment=...)` must be in [0, num_fragments) = [0, {num_fragments}), got"
        f" {fragment}."
      )
  fragments = range(num_fragments) if fragment is None else (fragment,)
  due = [step % sync_period == sync_offset(f, sync_period, num_fragments) for f in fragments]
  return functools.reduce(operator.or_, due)


# ----------------------------------------------------------------------------------------------
# The halves of a fragment's sync.


def streaming_diloco_payload(
  exchange: _exchange.Exchange, anchor: Any, new_params: Any, residual: Any = None, *,
  fragments: Any, fragment: int,
) -> tuple[Any, Any]:
  r"""The local half of fragment f's sync in :func:`streaming_diloco`: this worker's term.

  :func:`diloco_payload` on fragment f's leaves only (their blocks cut from those leaves end
  to end, as the fragment's exchange cuts them):

  .. math::

    p^f_i = Q(\theta^f - x'^f_i + r^f_i), \qquad
    r'^f_i = \theta^f - x'^f_i + r^f_i - p^f_i

  :func:`merge_payloads` of the N workers' :math:`p^f_i` in rank order, then
  :func:`streaming_diloco_outer_step`, give the fragment's sync (with ``overlap``: the mean
  sent, ``in_flight``, and its landing).

  Args:
    exchange: the :class:`~optax_dist.Exchange` of the :func:`streaming_diloco` it stands in for.
    anchor: :math:`\theta`, ``StreamingDiLoCoState.anchor`` (the whole tree).
    new_params: :math:`x'_i`, this worker's params after its inner step (the anchor's tree).
    residual: ``StreamingDiLoCoState.error_feedback`` with error feedback, else ``None``.
    fragments: each leaf's fragment, in ``jax.tree.leaves`` order, as
      :func:`streaming_diloco_fragments` returns them.
    fragment: f, an int in ``[0, F)``.

  Returns:
    ``(payload, new_residual)``: the payload has the anchor's tree with the other fragments'
    leaves replaced by ``optax.MaskedNode()`` (the wire format's dtype, float32 for the 8-bit
    floats and the quantized formats); ``new_residual`` the whole residual with fragment f's
    leaves updated (``None`` without error feedback).

  Collectives:
    None across the workers (with ``slice_axis``, one ``all_gather`` inside the worker).

  Raises:
    TypeError: ``exchange`` not an :class:`~optax_dist.Exchange`; ``fragment`` not an int.
    ValueError: ``fragments`` not one id per leaf; ``fragment`` not one of them; a
      ``residual`` without a quantized ``comm_dtype`` or not of the anchor's shapes.

  Examples:
    >>> import jax.numpy as jnp, optax_dist
    >>> anchor = {"a": jnp.ones(2), "b": jnp.ones(2)}
    >>> fragments = optax_dist.streaming_diloco_fragments(anchor, 2)
    >>> exchange = optax_dist.Exchange("w", call="streaming_diloco")
    >>> new_params = {"a": jnp.zeros(2), "b": jnp.full(2, 0.5)}
    >>> payload, _ = optax_dist.streaming_diloco_payload(
    ...     exchange, anchor, new_params, fragments=fragments, fragment=1)
    >>> payload
    {'a': MaskedNode(), 'b': Array([0.5, 0.5], dtype=float32)}

  References:
    Douillard et al., `Streaming DiLoCo with overlapping communication
    <https://arxiv.org/abs/2501.18512>`_, 2025 (each fragment's outer gradient).
  """
  fn = "streaming_diloco_payload"
  _exchange.check_exchange(fn, exchange)
  parts, treedef = _split_fragments(fn, anchor, fragments, fragment)
  leaves = jax.tree.leaves
  payload_f, residual_f = _outer.payload(
    exchange, parts.part(leaves(anchor), fragment), parts.part(leaves(new_params), fragment),
    None if residual is None else parts.part(leaves(residual), fragment))
  if residual is None:
    return payload_f, None
  return payload_f, treedef.unflatten(parts.put(leaves(residual), residual_f, fragment))


def streaming_diloco_outer_step(
  outer: optax.GradientTransformation, anchor: Any, outer_state: optax.OptState, merged: Any, *,
  fragments: Any, fragment: int,
) -> tuple[Any, optax.OptState]:
  r"""The outer half of fragment f's sync in :func:`streaming_diloco`: its ``outer`` step.

  .. math::

    \Delta^f = \bar p^f \text{ cast to the anchor's dtypes}, \qquad
    \theta^f \leftarrow \theta^f + \mathrm{outer}_f(\Delta^f)

  with :math:`\bar p^f` the workers' mean of their :func:`streaming_diloco_payload`\ s of
  fragment f (:func:`merge_payloads`). The worker's leaves of f then land on
  :math:`\alpha\, x'^f_i + (1 - \alpha)\, \theta^f` (``mixing`` :math:`\alpha`). The
  other fragments' leaves are returned unchanged.

  Args:
    outer: :func:`streaming_diloco`'s ``outer``.
    anchor: :math:`\theta`, ``StreamingDiLoCoState.anchor`` (the whole tree).
    outer_state: fragment f's outer state, ``StreamingDiLoCoState.outer_state[f]``.
    merged: :math:`\bar p^f`, the payload's tree (``MaskedNode`` outside fragment f).
    fragments: each leaf's fragment, as :func:`streaming_diloco_fragments` returns them.
    fragment: f, an int in ``[0, F)``.

  Returns:
    ``(new_anchor, new_outer_state)``: the whole anchor with fragment f's leaves stepped, and
    fragment f's outer state, with the dtypes of the old ones.

  Collectives:
    None.

  Raises:
    TypeError: ``fragment`` not an int.
    ValueError: ``fragments`` not one id per leaf; ``fragment`` not one of them; ``merged``
      not of fragment f's part of the anchor (raised by ``jax.tree.map``).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_dist
    >>> outer, anchor = optax.sgd(1.0), {"a": jnp.ones(2), "b": jnp.ones(2)}
    >>> merged = {"a": optax.MaskedNode(), "b": jnp.full(2, 0.5)}
    >>> new_anchor, _ = optax_dist.streaming_diloco_outer_step(
    ...     outer, anchor, outer.init(merged), merged, fragments=(0, 1), fragment=1)
    >>> new_anchor
    {'a': Array([1., 1.], dtype=float32), 'b': Array([0.5, 0.5], dtype=float32)}

  References:
    Douillard et al., `Streaming DiLoCo with overlapping communication
    <https://arxiv.org/abs/2501.18512>`_, 2025 (the outer step of each fragment).
  """
  parts, treedef = _split_fragments("streaming_diloco_outer_step", anchor, fragments, fragment)
  leaves = jax.tree.leaves(anchor)
  anchor_f, outer_state = _outer.outer_step(
    outer, parts.part(leaves, fragment), outer_state, merged)
  return treedef.unflatten(parts.put(leaves, anchor_f, fragment)), outer_state


def streaming_diloco_land(
  due: Any, target: Any, params: Any, updates: Any, mixing: Any = 0.0
) -> Any:
  r"""The landing of a fragment's sync in :func:`streaming_diloco`: the worker's new updates.

  With :math:`x` the worker's params before its inner step (``params``), :math:`u` its inner
  updates and :math:`x' = x + u`, a landing moves the worker's leaves of the fragment from
  :math:`x` to the mix of :math:`x'` and the fragment's new anchor :math:`\theta` (``target``):

  .. math::

    \tilde\theta = \alpha\, x' + (1 - \alpha)\, \theta, \qquad
    \text{update} = \begin{cases} \tilde\theta - x & \text{if due} \\
      u & \text{otherwise} \end{cases}

  :math:`\tilde\theta` in ``target``'s dtypes and the update in ``updates``'; so
  ``optax.apply_updates(params, update)`` lands on :math:`\tilde\theta` up to one rounding.
  With :math:`\alpha` a Python 0 (the default) :math:`\tilde\theta = \theta` is taken as it
  is, with no arithmetic on it. This is the last step of :func:`streaming_diloco`'s ``update``
  on a fragment's landing (its sync step, or with ``overlap`` :math:`\tau` steps later), after
  :func:`streaming_diloco_outer_step` gave :math:`\theta`.

  Args:
    due: whether the fragment lands: a Python bool (the one branch is returned) or a bool
      array (``jnp.where``), one for every leaf given.
    target: :math:`\theta`, the fragment's new anchor (``params``' tree and shapes; the
      anchor's dtypes).
    params: :math:`x`, the worker's params before its inner step.
    updates: :math:`u`, its inner updates (``params``' tree and shapes).
    mixing: :math:`\alpha` in [0, 1], :func:`streaming_diloco`'s ``mixing``: the weight of
      the worker's own params.

  Returns:
    The worker's updates: ``updates``' tree, shapes and dtypes.

  Shapes:
    ``target``, ``params`` and ``updates`` of one tree and shapes (a fragment's leaves, or
    one leaf); ``due`` and ``mixing`` scalars.

  Collectives:
    None.

  Raises:
    ValueError: ``target``, ``params`` and ``updates`` not of one tree structure (raised by
      ``jax.tree.map``).

  Examples:
    >>> import jax.numpy as jnp, optax_dist
    >>> params, updates, anchor = jnp.zeros(2), jnp.array([0.5, 0.5]), jnp.ones(2)
    >>> optax_dist.streaming_diloco_land(True, anchor, params, updates, mixing=0.5)
    Array([0.75, 0.75], dtype=float32)
    >>> optax_dist.streaming_diloco_land(False, anchor, params, updates, mixing=0.5)
    Array([0.5, 0.5], dtype=float32)

  References:
    Douillard et al., `Streaming DiLoCo with overlapping communication
    <https://arxiv.org/abs/2501.18512>`_, 2025 (the merge of the local and the global
    params, their :math:`\alpha`).
  """
  mixed = not (isinstance(mixing, numbers.Real) and mixing == 0)

  def land(t, p, u):
    if mixed:
      x = optax.apply_updates(p, u)
      t = mixing * x.astype(t.dtype) + (1 - mixing) * t
    return _axis.select(due, (t - p).astype(u.dtype), u)

  return jax.tree.map(land, target, params, updates)


def _split_fragments(fn: str, anchor: Any, fragments: Any, fragment: Any):
  """The :class:`_fragments.Fragments` of ``anchor`` and its treedef, checking that
  ``fragments`` holds one id per leaf and ``fragment`` is one of them."""
  leaves, treedef = jax.tree.flatten(anchor)
  ids = tuple(int(_checks.concrete(f)) for f in fragments)
  if len(ids) != len(leaves):
    raise ValueError(
      f"`{fn}(fragments=...)` must hold one fragment id per leaf of the anchor ({len(leaves)}),"
      f" got {len(ids)}: pass streaming_diloco_fragments(params, num_fragments, strategy)."
    )
  _checks.check_int(fn, "fragment", fragment)
  if fragment not in ids:
    raise ValueError(
      f"`{fn}(fragment=...)` must be one of the fragments' ids {sorted(set(ids))}, got"
      f" {fragment}."
    )
  return _fragments.Fragments(ids, treedef), treedef


# ----------------------------------------------------------------------------------------------
# streaming_diloco.


def streaming_diloco(
  inner: optax.GradientTransformation,
  outer: optax.GradientTransformation | None = None,
  *,
  sync_period: int = 100,
  num_fragments: int = 4,
  fragments: Any = None,
  mixing: float = 0.0,
  overlap: int = 0,
  eager: bool = False,
  axis_name: Hashable | None = None,
  num_workers: int | None = None,
  comm_dtype: Any = None,
  comm_block_size: int | None = None,
  error_feedback: bool = False,
  anchor_dtype: Any = None,
  slice_axis: Hashable | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Streaming DiLoCo: :func:`diloco`'s sync on one fragment at a time, staggered over H steps.

  The params' leaves are split into F fragments. Fragment f syncs every H steps, on the steps
  with :math:`\mathrm{local\_step} \bmod H = s_f \bmod H`, :math:`s_f =
  \lfloor (f + 1) H / F \rfloor`, each sync being :func:`diloco`'s on that fragment's leaves
  only, with its own outer state; then the worker's leaves of the fragment mix its own and the
  new anchor (:math:`\alpha`, ``mixing``). With :math:`\theta^f, x^f` the fragment's leaves:

  .. math::

    u_i &= \mathrm{inner}(g_i), \qquad x'_i = x_i + u_i \\
    \text{if } \mathrm{local\_step} \bmod H = s_f \bmod H:\quad
      \Delta^f &= \tfrac{1}{N} \textstyle\sum_j (\theta^f - x'^f_j), \qquad
      \theta^f \leftarrow \theta^f + \mathrm{outer}_f(\Delta^f) \\
      x^f_i &\leftarrow \alpha\, x'^f_i + (1 - \alpha)\, \theta^f

  and :math:`x^f_i \leftarrow x'^f_i` for fragments that do not sync. F = 1 is :func:`diloco`.
  Fragment f first syncs at step :math:`s_f \bmod H` if that is > 0, else at H; when H < F
  several fragments share a step, each syncing independently. The returned updates are
  :math:`x_i^{\text{new}} - x_i`.

  **Overlap** (``overlap`` :math:`\tau \ge 1`, Douillard et al. 2025, streaming with
  overlapping communication, their :math:`\tau` and :math:`\alpha`): fragment f's
  pseudo-gradient is computed and all-reduced on its send step s (the step above), and applied
  :math:`\tau` steps later, on step :math:`s + \tau`, while the worker trains on. On the landing
  step, the outer optimizer steps the fragment's anchor with the averaged pseudo-gradient of
  step s, stale by :math:`\tau` steps, and the worker's leaves merge the params it has then with
  the new anchor (the paper's merge, :math:`\alpha` weighting the local params):

  .. math::

    \text{send, step } s:\quad \Delta^f_i &= \theta^f - x'^f_i(s), \qquad
      \Delta^f = \tfrac{1}{N} \textstyle\sum_j \Delta^f_j \quad \text{(the psum)} \\
    \text{land, step } s + \tau:\quad \theta^f_{\text{new}} &= \theta^f +
      \mathrm{outer}_f(\Delta^f), \qquad
      x^f_i \leftarrow \alpha\, x'^f_i(s + \tau) + (1 - \alpha)\, \tilde\theta^f_i

  with :math:`\tilde\theta^f_i = \theta^f_{\text{new}}`. :math:`\theta^f` does not change
  between the send and the landing (:math:`\tau < H`), so both see the anchor of the previous
  landing, as in the paper's ``OuterOpt`` step from :math:`\theta^{(t - \tau - H)}_p`.
  ``overlap=0`` (the default) lands on the send step: the equations above, bit for bit.

  **Eager** (``eager=True``, Kale et al. 2025, the eager update): on the landing step each
  worker replaces its own stale share :math:`\Delta^f_i(s)/N` of the mean by its fresh one,
  :math:`\Delta^f_i(s + \tau) = \theta^f - x'^f_i(s + \tau)`:

  .. math::

    \tilde\Delta^f_i = \Delta^f + \tfrac{1}{N}\big(\Delta^f_i(s + \tau) - \Delta^f_i(s)\big),
    \qquad \tilde\theta^f_i = \theta^f + \mathrm{outer}_f(\tilde\Delta^f_i)

  with ``outer``'s state before the step. The anchor and the outer state still advance with the
  stale mean :math:`\Delta^f` (identical on every worker: :func:`eval_params` and
  :func:`resize_state` read them); only the point the worker lands on is eager, and the
  difference :math:`\tilde\theta^f_i - \theta^f_{\text{new}}` comes back to the anchor
  through the worker's next pseudo-gradient. (The paper, with a delay of one whole outer round,
  keeps the outer params on each worker instead.)

  Edge cases. :math:`\tau` at least the gap between two fragments' send steps is allowed:
  several fragments are then in flight at once, each landing on its own step (with H = 4 and
  F = 2, sends on steps 2 and 4: :math:`\tau = 2` lands fragment 0 on fragment 1's send
  step; :math:`\tau = 3` has both in flight on step 4). :math:`\tau \ge H` would send a
  fragment again before its previous exchange landed, and raises. A send skipped by the hint
  (``communicate=False``) puts nothing in flight, so nothing lands :math:`\tau` steps later.
  :func:`resize_state` with an exchange in flight keeps it (``in_flight``, ``in_flight_step``):
  it lands on its step on the new workers, which restart from the anchor; with ``eager`` their
  own shares ``own_in_flight`` become the old workers' mean.

  ``fragments=None`` assigns the leaves, in ``jax.tree.leaves`` order, in contiguous runs of
  about equal element counts: leaf j goes to fragment :math:`\lfloor F c_j / C \rfloor`, with
  :math:`c_j` the number of elements in the leaves before j and C the total. The assignment
  needs the leaves' sizes, so ``init`` needs real or abstract (``jax.ShapeDtypeStruct``) arrays.

  Args:
    inner: the local optimizer of each worker.
    outer: the optimizer of each fragment of the anchor, fed its pseudo-gradient. Default:
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)``, DiLoCo's outer Nesterov momentum.
    sync_period: H, a count of ``update`` calls between two syncs of one fragment.
    num_fragments: F, a positive int, at most the number of param leaves.
    fragments: ``None`` (the contiguous runs above); ``"balanced"``: the largest leaf first
      to the fragment with the fewest elements so far, so that the syncs' bytes are as equal as
      the leaves allow (the contiguous runs can leave a fragment empty on a small MLP); or a tree
      with the params' structure holding each leaf's fragment id, an int in ``[0, F)``; every id
      must be used. :func:`streaming_diloco_fragments` returns the assignment.
    mixing: :math:`\alpha` in [0, 1], dimensionless: the weight of the worker's own params
      when a fragment lands (0, the default: replaced by the new anchor, as :func:`diloco`).
    overlap: :math:`\tau`, an int in ``[0, sync_period)``, a count of ``update`` calls between a
      fragment's send (its all-reduce) and the step that applies it; 0 (default): the same step.
    eager: with ``overlap >= 1``, land each worker on the outer step of its eager
      pseudo-gradient :math:`\tilde\Delta^f_i` (above); ``False`` (default): on the new anchor.
    axis_name: the mapped axis (or tuple of mesh axes) whose positions are the workers;
      ``None`` for one worker.
    num_workers: number of workers :math:`N`; defaults to the size of ``axis_name`` (1 when it
      is ``None``). If given, it must equal that size.
    comm_dtype: the floating dtype in which :math:`\theta^f - x'^f_i` is all-reduced (e.g.
      ``jnp.bfloat16``); ``None`` (default) sends in the anchor's dtypes. 8-bit floats
      are quantized, all-gathered and summed in float32. The block-quantized formats of
      :func:`diloco` (``jnp.int8``, ``jnp.float4_e2m1fn``, ``"e3m0"``) are sent as codes with
      one float32 scale per ``comm_block_size`` values, gathered and summed in float32.
    comm_block_size: B, the values per float32 scale of a quantized ``comm_dtype`` (``None``,
      the default, is 256; even for the 4-bit formats); ignored otherwise. Fixed at trace time.
    error_feedback: with a quantized ``comm_dtype``, each worker keeps what quantization
      dropped from each fragment's pseudo-gradient in ``state.error_feedback`` (float32) and
      adds it to that fragment's next one before quantizing, as :func:`diloco`:
      :math:`t^f_i = \theta^f - x'^f_i + r^f_i`, sent :math:`Q(t^f_i)`,
      :math:`r^f_i \leftarrow t^f_i - Q(t^f_i)` on f's send step. With ``eager`` the worker's
      own share :math:`\Delta^f_i` stays unquantized (it never crosses the link). Costs one
      float32 params-sized tree per worker. Default ``False``.
    slice_axis: a mapped axis inside each worker (not part of ``axis_name``) whose devices hold
      identical copies of the params, such as the devices of one replica after
      ``tower(inner, slice_axis)``: each of its K devices then exchanges only its 1/K slice
      across the workers and the slices are gathered back inside the worker, so the K devices
      together send the params' bytes once instead of K times. ``None`` (default): every
      device exchanges the whole tree.
    anchor_dtype: the floating dtype of the anchor, of the pseudo-gradients and of the outer
      states; ``None`` (default) keeps each param's dtype.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; extra args are forwarded to ``inner``.

  Shapes:
    ``updates`` and ``params`` share one tree (each worker's own); the returned updates have
    ``inner``'s dtypes, ``anchor`` the params' tree and shapes. Memory per worker: the anchor
    (one copy of the params) plus the F outer states, which together hold as much as one
    ``outer`` state of the whole params (one more copy for momentum). ``overlap >= 1`` adds
    ``in_flight`` (one more copy of the params, in the anchor's dtype) and ``in_flight_step``
    (F int32); ``eager`` adds ``own_in_flight`` (one more copy); ``error_feedback`` adds
    ``error_feedback`` (one float32 copy). ``overlap=0`` adds nothing.

  Collectives:
    One ``psum`` over ``axis_name`` of fragment f's leaves on each of its sync steps, inside
    that fragment's own ``lax.cond`` (F conditionals): per sync about :math:`1/F` of the
    params' bytes (element count times the itemsize of ``comm_dtype`` or of the anchor's
    dtype), and over H steps the params' bytes once, as :func:`diloco`. With an 8-bit
    ``comm_dtype``, an ``all_gather`` instead (N times the bytes received). None when
    ``axis_name`` is ``None``. :func:`communication_report` measures them, per conditional.
    With ``overlap >= 1`` the ``psum`` runs on the send step, as above; the landing step needs
    no collective (the mean is in the state): it runs in another conditional per fragment, on
    a predicate read from ``in_flight_step``, local to each worker (under ``vmap`` a select).

  Static hint:
    ``update(..., communicate=False)`` (a Python bool, fixed at trace time): no fragment syncs,
    and the step is compiled with no conditional and no collective; ``communicate=True`` keeps
    each fragment's conditional, and the rule picks the fragment(s) that sync. ``local_step``
    advances either way, so a ``False`` on a sync step skips that fragment's sync and the rule's
    later syncs stay where they were. ``None`` (or leaving it out) is the rule. It is not
    forwarded to ``inner``. With ``overlap >= 1`` the hint is about the send step: a ``False``
    step compiles with no collective but keeps the F landing conditionals, so a landing step
    hinted ``False`` lands as the rule's would.

  Raises:
    TypeError: ``inner`` or ``outer`` is not a transformation; ``sync_period``,
      ``num_fragments``, ``num_workers`` or a ``fragments`` id not an int; ``mixing`` not a real
      number; ``overlap`` not an int; ``eager`` or ``error_feedback`` not a bool; ``comm_dtype``
      not ``None``, a floating dtype or a quantized format (``jnp.int8``, ``jnp.float4_e2m1fn``,
      ``"e3m0"``); ``anchor_dtype`` not ``None`` or a floating dtype; ``comm_block_size`` not an
      int, or traced (with ``optax.inject_hyperparams``, name it in ``static_args``); a
      non-floating param leaf (in ``init``); ``update``'s ``communicate`` not ``None`` or a bool.
    ValueError: ``sync_period``, ``num_fragments``, ``num_workers`` or ``comm_block_size`` not
      positive; ``comm_block_size``
      given with a ``comm_dtype`` that is not block-quantized, or odd
      with a 4-bit one (``jnp.float4_e2m1fn``,
      ``"e3m0"``); ``mixing`` outside [0, 1]; ``overlap`` outside ``[0, sync_period)``
      (:math:`\tau < H`); ``eager=True`` with ``overlap=0``; ``error_feedback=True`` without a
      quantized ``comm_dtype``; ``fragments`` a string other than ``"contiguous"`` or
      ``"balanced"``; a ``fragments`` id outside ``[0, F)``; (in ``init``) ``fragments`` without
      the params' structure, or a fragment left empty; ``num_workers > 1`` with
      ``axis_name=None``; ``num_workers`` different from the axis size; (in ``update``) no
      ``params``, a named ``axis_name`` not bound, or ``slice_axis`` one of the workers' axes or
      not bound.

  Examples:
    One worker, two leaves in two fragments, H = 2: fragment 0 syncs on odd steps, fragment 1
    on even ones; outer SGD with learning rate 1 moves each anchor leaf to the worker's:

    >>> import jax.numpy as jnp, optax, optax_dist
    >>> tx = optax_dist.streaming_diloco(
    ...     optax.sgd(1.0), optax.sgd(1.0), sync_period=2, num_fragments=2)
    >>> params = {"a": jnp.zeros(1), "b": jnp.zeros(1)}
    >>> state = tx.init(params)
    >>> grads = {"a": -jnp.ones(1), "b": -jnp.ones(1)}
    >>> updates, state = tx.update(grads, state, params)
    >>> state.anchor  # step 1: fragment 0 ("a") synced
    {'a': Array([1.], dtype=float32), 'b': Array([0.], dtype=float32)}

    With ``overlap=1`` fragment 0 is sent on step 1 and lands on step 2:

    >>> tx = optax_dist.streaming_diloco(
    ...     optax.sgd(1.0), optax.sgd(1.0), sync_period=2, num_fragments=2, overlap=1)
    >>> state = tx.init(params)
    >>> _, state = tx.update(grads, state, params)
    >>> state.anchor["a"], state.in_flight["a"], state.in_flight_step
    (Array([0.], dtype=float32), Array([-1.], dtype=float32), Array([1, 0], dtype=int32))

  References:
    Douillard et al., `Streaming DiLoCo with overlapping communication
    <https://arxiv.org/abs/2501.18512>`_, 2025.
    Kale, Douillard and Donchev, `Eager Updates For Overlapped Communication and Computation in
    DiLoCo <https://arxiv.org/abs/2502.12996>`_, 2025.
    Douillard et al., `DiLoCo <https://arxiv.org/abs/2311.08105>`_, 2023.
    torchft ``torchft.local_sgd.DiLoCo`` (fragments, ``fragment_sync_delay``); MaxText
    ``diloco.py``.
  """
  fn = "streaming_diloco"
  _checks.check_transformation(fn, inner)
  inner = _axis.wrap_inner(inner)  # unknown extra args dropped, state dtypes kept
  outer = _outer.default_outer() if outer is None else outer
  _checks.check_transformation(fn, outer, "outer")
  _checks.check_positive_int(fn, "sync_period", sync_period)
  _checks.check_positive_int(fn, "num_fragments", num_fragments)
  _fragments.check_strategy(fn, fragments, num_fragments)
  _checks.check_number(fn, "mixing", mixing, lower=0.0, upper=1.0, constraint="in [0, 1]")
  exchange = _exchange.Exchange(
    axis_name, num_workers, comm_dtype, comm_block_size, slice_axis, call=fn
  )
  error_feedback = _checks.check_error_feedback(fn, error_feedback, exchange.comm_dtype)
  anchor_dtype = _checks.check_floating_dtype(fn, "anchor_dtype", anchor_dtype)
  eager = _check_overlap(fn, overlap, eager, sync_period)

  def init_fn(params):
    _checks.check_floating(fn, params)
    exchange.size()
    anchor = _axis.copy(params, anchor_dtype)
    if not jax.tree.leaves(params):  # optax.tree.map_params' placeholder: params-shaped states
      outer_state = tuple(outer.init(anchor) for _ in range(num_fragments))
    else:
      leaves, treedef = jax.tree.flatten(anchor)
      parts = _fragments.Fragments(
        _fragments.assign(fn, params, num_fragments, fragments), treedef)
      outer_state = tuple(outer.init(parts.part(leaves, f)) for f in range(num_fragments))
    zeros = functools.partial(jax.tree.map, jnp.zeros_like)
    return StreamingDiLoCoState(
      local_step=jnp.zeros([], jnp.int32),
      anchor=anchor,
      inner_state=inner.init(params),
      outer_state=outer_state,
      in_flight=zeros(anchor) if overlap else None,
      in_flight_step=jnp.zeros([num_fragments], jnp.int32) if overlap else None,
      own_in_flight=zeros(anchor) if eager else None,
      error_feedback=(
        jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        if error_feedback else None
      ),
    )

  def update_fn(updates, state, params=None, **extra_args):
    _checks.require_params(fn, params)
    _checks.check_tree_matches(fn, updates, state.anchor, "params")
    hint = _axis.communication_hint(fn, extra_args)
    n = exchange.bind()
    ids = _fragments.assign(fn, state.anchor, num_fragments, fragments)

    local_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    local_step = optax.safe_increment(state.local_step)
    anchor, treedef = jax.tree.flatten(state.anchor)
    r = _Round(exchange, outer, _fragments.Fragments(ids, treedef), jax.tree.leaves(params),
               jax.tree.leaves(local_updates), n, eager)
    # False: no fragment sends; True leaves the choice of fragment to the rule.
    sends = [
      False if hint is False else exchange.agree(streaming_diloco_syncs(
        local_step, sync_period=sync_period, num_fragments=num_fragments, fragment=f))
      for f in range(num_fragments)
    ]
    carry = _Carry(anchor, state.outer_state, _leaves(state.in_flight), state.in_flight_step,
                   _leaves(state.own_in_flight), _leaves(state.error_feedback))
    if overlap:
      carry, landings, targets = _overlapped(r, carry, sends, local_step, overlap)
    else:  # each fragment's exchange lands on its send step
      carry = _synced(r, carry, sends)
      landings, targets = sends, carry.anchor
    local_updates = treedef.unflatten([
      streaming_diloco_land(landings[f], t, p, u, mixing)
      for t, p, u, f in zip(targets, r.params, r.updates, ids, strict=True)
    ])
    tree = lambda leaves: None if leaves is None else treedef.unflatten(leaves)  # noqa: E731
    return local_updates, StreamingDiLoCoState(
      local_step=local_step,
      anchor=tree(carry.anchor),
      inner_state=inner_state,
      outer_state=tuple(carry.outer_state),
      in_flight=tree(carry.in_flight),
      in_flight_step=carry.in_flight_step,
      own_in_flight=tree(carry.own),
      error_feedback=tree(carry.residual),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_overlap(fn: str, overlap: Any, eager: Any, sync_period: int) -> bool:
  """Raise unless ``overlap`` is an int in ``[0, sync_period)`` and ``eager`` a bool, ``True``
  only with ``overlap >= 1``; returns ``eager`` as a bool."""
  _checks.check_int(fn, "overlap", overlap)
  if overlap < 0 or overlap >= sync_period:
    raise ValueError(
      f"`{fn}(overlap=...)` must be an int in [0, sync_period) = [0, {sync_period}) (overlap <"
      f" sync_period: a fragment's exchange must land before its next send), got {overlap}."
    )
  if not isinstance(eager, (bool, np.bool_)):
    raise TypeError(f"`{fn}(eager=...)` must be a bool, got {eager!r}.")
  if eager and overlap == 0:
    raise ValueError(
      f"`{fn}(eager=True)` needs overlap >= 1 (with overlap=0 every exchange lands on its send"
      " step and there is no stale share to replace), got overlap=0."
    )
  return bool(eager)


def _leaves(tree: Any) -> list | None:
  return None if tree is None else jax.tree.leaves(tree)


# ----------------------------------------------------------------------------------------------
# One update's steps, fragment by fragment.


class _Round(NamedTuple):
  """What each fragment's step of one ``update`` reads (the leaves in ``jax.tree.leaves``
  order): the exchange, ``outer``, the fragments, this worker's params :math:`x_i` and inner
  updates :math:`u_i`, N, and whether the landing is eager."""

  exchange: _exchange.Exchange
  outer: optax.GradientTransformation
  fragments: _fragments.Fragments
  params: list
  updates: list
  num_workers: int
  eager: bool

  def new_params(self, fragment: int, updates_f: Any) -> Any:
    """:math:`x'_i = x_i + u_i` on fragment ``fragment``'s part."""
    return optax.apply_updates(self.fragments.part(self.params, fragment), updates_f)


class _Carry(NamedTuple):
  """The state's fields as leaves, carried through the fragments' steps (``None``: absent)."""

  anchor: list
  outer_state: Any
  in_flight: list | None
  in_flight_step: jax.Array | None
  own: list | None
  residual: list | None


def _synced(r: _Round, c: _Carry, sends: list) -> _Carry:
  """``overlap=0``: each fragment due syncs (:func:`_sync`) and lands on the same step."""
  anchor, residual, outer_states = c.anchor, c.residual, []
  for f, due in enumerate(sends):
    anchor, outer_state_f, residual = _sync(r, f, due, anchor, c.outer_state[f], residual)
    outer_states.append(outer_state_f)
  return c._replace(anchor=anchor, outer_state=outer_states, residual=residual)


def _overlapped(r: _Round, c: _Carry, sends: list, local_step: jax.Array, overlap: int):
  """``overlap >= 1``: each fragment first lands what it sent ``overlap`` steps ago
  (:func:`_land`), then sends if due (:func:`_send`). A fragment sent at step s lands at
  s + overlap < s + H, its next send, so it never sends and lands on one step and has at most
  one exchange in flight. Returns the carry, each fragment's landing predicate, and the leaves
  the workers land on."""
  anchor, in_flight, own, residual = c.anchor, c.in_flight, c.own, c.residual
  targets, outer_states, landings, in_flight_step = list(anchor), [], [], []
  for f, due in enumerate(sends):
    sent = c.in_flight_step[f]
    landing = (sent > 0) & (local_step == sent + overlap)  # local: no collective, no agree
    anchor, outer_state_f, target_f = _land(r, f, landing, anchor, c.outer_state[f], in_flight,
                                            own)
    targets = r.fragments.put(targets, target_f, f)
    in_flight, own, residual = _send(r, f, due, anchor, in_flight, own, residual)
    outer_states.append(outer_state_f)
    landings.append(landing)
    in_flight_step.append(
      _axis.select(due, local_step, jnp.where(landing, 0, sent).astype(jnp.int32)))
  in_flight_step = jnp.stack(in_flight_step).astype(jnp.int32)
  return _Carry(anchor, outer_states, in_flight, in_flight_step, own, residual), landings, targets


def _sync(r: _Round, f: int, due: Any, anchor: list, outer_state_f: Any, residual: list | None):
  r"""Fragment f's DiLoCo sync in its own conditional, carrying only its leaves and state: the
  workers' mean pseudo-gradient :math:`\Delta^f` and the outer step. Returns the anchor's and
  residual's leaves and the fragment's outer state."""
  part = functools.partial(r.fragments.part, fragment=f)

  def synchronize(anchor_f, outer_state_f, residual_f, u_f):
    x_f = r.new_params(f, u_f)
    delta_f, residual_f = _outer.pseudo_gradient(r.exchange, anchor_f, x_f, residual_f)
    return (*_outer.outer_step(r.outer, anchor_f, outer_state_f, delta_f), residual_f)

  def keep(anchor_f, outer_state_f, residual_f, u_f):
    return anchor_f, outer_state_f, residual_f

  anchor_f, outer_state_f, residual_f = _axis.communicate_if(
    due, synchronize, keep, part(anchor), outer_state_f, part(residual), part(r.updates))
  put = r.fragments.put
  return put(anchor, anchor_f, f), outer_state_f, put(residual, residual_f, f)


def _send(r: _Round, f: int, due: Any, anchor: list, in_flight: list, own: list | None,
          residual: list | None):
  r"""Fragment f's send (``overlap >= 1``) in its own conditional: :math:`\Delta^f` averaged
  over the workers into ``in_flight``, and with ``eager`` this worker's own
  :math:`\Delta^f_i` into ``own``."""
  part = functools.partial(r.fragments.part, fragment=f)

  def send(anchor_f, u_f, in_flight_f, own_f, residual_f):
    x_f = r.new_params(f, u_f)
    mean_f, residual_f = _outer.pseudo_gradient(r.exchange, anchor_f, x_f, residual_f)
    own_f = _outer.local_pseudo_gradient(anchor_f, x_f) if r.eager else None  # Delta_i
    return mean_f, own_f, residual_f

  def keep(anchor_f, u_f, in_flight_f, own_f, residual_f):
    return in_flight_f, own_f, residual_f

  in_flight_f, own_f, residual_f = _axis.communicate_if(
    due, send, keep, part(anchor), part(r.updates), part(in_flight), part(own), part(residual))
  put = r.fragments.put
  return put(in_flight, in_flight_f, f), put(own, own_f, f), put(residual, residual_f, f)


def _land(r: _Round, f: int, landing: Any, anchor: list, outer_state_f: Any, in_flight: list,
          own: list | None):
  r"""Fragment f's landing (``overlap >= 1``): the outer step on the stale mean, no collective.

  Returns the anchor's leaves, the fragment's outer state and the part the worker lands on
  (the new anchor, or with ``eager`` the outer step on :math:`\tilde\Delta^f_i`)."""
  part = functools.partial(r.fragments.part, fragment=f)

  def apply(anchor_f, outer_state_f, delta_f, own_f, u_f):
    new_anchor_f, new_outer_state_f = _outer.outer_step(r.outer, anchor_f, outer_state_f, delta_f)
    target_f = new_anchor_f
    if r.eager:  # Delta~_i = Delta + (Delta_i(now) - Delta_i(sent)) / N, from the same state
      fresh_f = _outer.local_pseudo_gradient(anchor_f, r.new_params(f, u_f))
      eager_f = jax.tree.map(
        lambda d, now, sent: (d + (now - sent) / r.num_workers).astype(d.dtype), delta_f,
        fresh_f, own_f,
      )
      target_f, _ = _outer.outer_step(r.outer, anchor_f, outer_state_f, eager_f)
    return new_anchor_f, new_outer_state_f, target_f

  def stay(anchor_f, outer_state_f, delta_f, own_f, u_f):
    return anchor_f, outer_state_f, anchor_f

  anchor_f, outer_state_f, target_f = _axis.communicate_if(
    landing, apply, stay, part(anchor), outer_state_f, part(in_flight), part(own),
    part(r.updates))
  return r.fragments.put(anchor, anchor_f, f), outer_state_f, target_f
