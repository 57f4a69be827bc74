"""The exchange between the workers, named once: who (the axis), how (the wire format, the
block size, the slices) and the collectives that move a tree between them."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_dist import _axis, _checks, _quantize


@dataclasses.dataclass(frozen=True)
class Exchange:
  r"""How the workers of one transformation exchange a tree: checked once, when it is built.

  The workers are the positions along the mapped axis ``axis_name`` (a name, or a tuple of mesh
  axes whose product is the workers). A transformation builds one ``Exchange`` from its own
  arguments and calls its collectives in ``update``. For a tree :math:`t_i` on worker
  :math:`i` of :math:`N`:

  .. math::

    \mathrm{sum}(t)_i = \textstyle\sum_{j=1}^N Q(t_j), \qquad
    \mathrm{mean}(t)_i = \tfrac{1}{N} \textstyle\sum_{j=1}^N Q(t_j), \qquad
    \mathrm{gather}(t)_i = [Q(t_1), \dots, Q(t_N)]

  with :math:`Q` the wire format ``comm_dtype``, one meaning wherever it is accepted: the
  identity for ``None``, a cast for a floating dtype (the sum is then rounded to it), block
  quantization for ``"int8"``, ``"float4_e2m1fn"`` and ``"e3m0"`` (``optax_dist._quantize``: one
  float32 scale per ``comm_block_size`` values, summed in float32 in worker order; never a raw
  cast to ``jnp.float4_e2m1fn``, which would send values below 0.25 as zeros). The mean is
  divided in each leaf's own dtype. :meth:`mean_with_feedback` adds each worker's residual before
  quantizing and returns what quantization dropped. :meth:`payload` is one worker's term
  :math:`Q(t_i)` of these sums, computed where it is (no collective), for an exchange outside the
  program (:func:`merge_payloads`). With ``axis_name=None`` (one worker) every collective returns
  its input (``gather`` is not defined then).

  Attributes:
    axis_name: the mapped axis (or tuple of mesh axes) whose positions are the workers; ``None``
      for one worker.
    num_workers: :math:`N`; defaults to the size of ``axis_name`` (1 when it is ``None``). If
      given, it must equal that size.
    comm_dtype: the wire format: ``None`` (each leaf's own dtype), a floating dtype with a sign
      and a zero (e.g. ``jnp.bfloat16``; 8-bit floats are all-gathered and summed in float32;
      ``jnp.float8_e8m0fnu`` and other unsigned formats are refused), or a block-quantized
      format: ``jnp.int8`` (or ``"int8"``), ``jnp.float4_e2m1fn`` (or ``"float4_e2m1fn"``),
      ``"e3m0"``. Stored resolved: ``None``, a NumPy dtype or the format's name.
      (``gradient_exchange``, for ``tower``, ``all_reduce`` and ``accumulate_then_reduce``,
      refuses the block-quantized formats.)
    comm_block_size: B, values per float32 scale of a block-quantized format; ``None`` is 256
      (even for the 4-bit formats), stored as an int. With any other format it must be
      ``None`` (and is stored as ``None``).
    slice_axis: a mapped axis inside each worker (not part of ``axis_name``) whose K devices
      hold identical copies of the tree: each sends only its 1/K slice across the workers and
      the slices are all-gathered back over ``slice_axis``. ``None``: each device sends all.
    hierarchical: with a tuple ``axis_name`` ``(*outer, inner)``, :meth:`reduce` reduce-scatters
      over ``inner``, all-reduces the slices over ``outer`` and all-gathers over ``inner``.
    packed_payload: :meth:`payload` of a block-quantized format returns what this worker
      sends, its block codes and scales (a :class:`~optax_dist._quantize.QuantizedTree`:
      :func:`~optax_dist._quantize.wire_bytes` of its values), instead of their decoded float32
      values; :func:`merge_payloads` decodes it (the same bits). For a transport outside the
      program that carries the payloads (the torchft engine). No effect with other formats.
    call: the public function the exchange belongs to; every error message names it.

  Shapes:
    A collective takes a tree of one worker's leaves and returns the same tree, shapes and
    dtypes (``gather``: each leaf with a leading axis of N).

  Collectives:
    Over ``axis_name``, per call of a method: ``sum``, ``mean`` and ``reduce`` issue one
    ``psum`` of the tree (the tree's element count times the itemsize of ``comm_dtype`` or of
    each leaf) or, for 8-bit floats, one ``all_gather`` (each worker receives N times what it
    sends); a quantized format issues two ``all_gather`` (codes and scales of every leaf): each
    worker sends :math:`n (c + 4/B)` bytes for :math:`n` values (:math:`c = 1` for ``int8``,
    :math:`\frac12` for the 4-bit formats) and receives N times that. ``gather`` is one
    ``all_gather``. With ``slice_axis`` of size K each device sends :math:`1/K` of these bytes
    and one ``all_gather`` over ``slice_axis`` (inside the worker) rebuilds the tree.

  Raises:
    TypeError: ``num_workers`` or ``comm_block_size`` not an int; ``comm_dtype`` none of the
      choices, or a floating dtype without a sign or a zero (``jnp.float8_e8m0fnu``);
      ``hierarchical`` or ``packed_payload`` not a bool.
    ValueError: ``num_workers`` or ``comm_block_size`` below 1; ``packed_payload`` with a
      ``slice_axis``; ``num_workers > 1`` with
      ``axis_name=None``; ``comm_block_size`` given (not ``None``) with a format that is not
      block-quantized; ``comm_block_size`` odd with a 4-bit format; ``hierarchical=True``
      with fewer than two axes. In ``update`` (:meth:`bind`): ``axis_name`` or ``slice_axis``
      not bound where it runs (a misspelled name, or ``update`` outside the mapped function),
      ``slice_axis`` one of the workers' axes, ``num_workers`` different from the axis size.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_dist
    >>> exchange = optax_dist.Exchange("w", comm_dtype=jnp.bfloat16, call="mine")
    >>> exchange.comm_dtype, exchange.comm_block_size
    (dtype(bfloat16), None)
    >>> jax.vmap(exchange.mean, axis_name="w")(jnp.array([1.0, 2.0, 6.0]))
    Array([3., 3., 3.], dtype=float32)

  References:
    TensorFlow 1.x ``tf.distribute`` cross-device ops (``all_reduce``); Douillard et al.,
    `Streaming DiLoCo with overlapping communication <https://arxiv.org/abs/2501.18512>`_, 2025
    (low-precision outer gradients).
  """

  axis_name: Hashable | tuple | None = None
  num_workers: int | None = None
  comm_dtype: Any = None
  comm_block_size: int | None = None
  slice_axis: Hashable | None = None
  hierarchical: bool = False
  call: str = "Exchange"
  packed_payload: bool = False

  def __post_init__(self):
    fn = self.call
    _checks.check_num_workers(fn, self.num_workers, self.axis_name)
    comm_dtype = _checks.check_comm_dtype(fn, self.comm_dtype)
    object.__setattr__(self, "comm_dtype", comm_dtype)
    block_size = _checks.check_comm_block_size(fn, self.comm_block_size, comm_dtype)
    object.__setattr__(self, "comm_block_size", block_size)
    if not isinstance(self.hierarchical, (bool, np.bool_)):
      raise TypeError(f"`{fn}(hierarchical=...)` must be a bool, got {self.hierarchical!r}.")
    if self.hierarchical and len(_axis.axis_names(self.axis_name)) < 2:
      raise ValueError(
        f"`{fn}(hierarchical=True)` needs a tuple `axis_name` of two or more mesh axes (the last"
        f" one inside each host), got axis_name={self.axis_name!r}."
      )
    object.__setattr__(self, "hierarchical", bool(self.hierarchical))
    if not isinstance(self.packed_payload, (bool, np.bool_)):
      raise TypeError(f"`{fn}(packed_payload=...)` must be a bool, got {self.packed_payload!r}.")
    if self.packed_payload and self.slice_axis is not None:
      raise ValueError(
        f"`{fn}(packed_payload=True)` sends one worker's codes whole: it takes no slice_axis, got"
        f" slice_axis={self.slice_axis!r}."
      )
    object.__setattr__(self, "packed_payload", bool(self.packed_payload))

  # --------------------------------------------------------------------------------------------
  # The workers.

  def size(self) -> int:
    """N where ``init`` runs: the axis size if bound, else ``num_workers`` or 1."""
    return _axis.resolve_num_workers(self.call, self.num_workers, self.axis_name)

  def bind(self) -> int:
    """N where ``update`` runs, checking that ``axis_name`` and ``slice_axis`` are bound there."""
    n = _axis.resolve_num_workers(self.call, self.num_workers, self.axis_name, in_update=True)
    _axis.check_slice_axis(self.call, self.slice_axis, self.axis_name)
    return n

  def agree(self, pred: jax.Array | bool) -> jax.Array | bool:
    """``pred``, equal on every worker, made one value for all of them (:func:`_axis.agree`)."""
    return _axis.agree(pred, self.axis_name)

  def due(self, rule: jax.Array | bool, hint: bool | None) -> jax.Array | bool:
    """Whether this ``update`` exchanges: the static ``hint`` if given, else the schedule's
    ``rule`` at the step counter, agreed by the workers."""
    return hint if hint is not None else self.agree(rule)

  # --------------------------------------------------------------------------------------------
  # The collectives.

  def sum(self, tree: Any, *, slice_mean: bool = False) -> Any:
    """:math:`\\sum_j Q(t_j)` in each leaf's dtype. ``slice_mean``: the devices of
    ``slice_axis`` hold different values, and the worker's term is their mean."""
    if self.axis_name is None:
      return tree
    return self._sliced(
      lambda t: _axis.psum(t, self.axis_name, self.comm_dtype, self.comm_block_size), tree,
      slice_mean,
    )

  def mean(self, tree: Any, *, slice_mean: bool = False) -> Any:
    """:math:`\\frac1N \\sum_j Q(t_j)`, divided in each leaf's dtype."""
    if self.axis_name is None:
      return tree
    return self._sliced(
      lambda t: _axis.worker_mean(
        t, self.axis_name, jax.lax.axis_size(self.axis_name), self.comm_dtype,
        self.comm_block_size),
      tree, slice_mean,
    )

  def mean_with_feedback(self, tree: Any, residual: Any) -> tuple[Any, Any]:
    """:meth:`mean` of :math:`t_j + r_j` in a quantized format, and this worker's new residual
    :math:`r_i' = t_i + r_i - Q(t_i + r_i)` (float32, ``tree``'s shapes)."""
    if self.axis_name is None:
      return tree, residual
    return self._sliced(
      lambda pair: _axis.worker_mean_with_feedback(
        *pair, self.axis_name, jax.lax.axis_size(self.axis_name), self.comm_dtype,
        self.comm_block_size),
      (tree, residual), False,
    )

  def payload(self, tree: Any, residual: Any = None) -> tuple[Any, Any]:
    r"""This worker's term of :meth:`mean` (or :meth:`mean_with_feedback`), where it is: what
    the workers' sum adds, no collective. :func:`merge_payloads` of the N workers' payloads,
    cast to the leaves' dtypes, is :meth:`mean`'s result (see there for the order).

    The term :math:`Q(t_i)` of a floating leaf: the leaf itself (``comm_dtype=None``); cast to
    ``comm_dtype`` for a floating dtype of more than 8 bits (the ``psum`` adds in it); cast to
    an 8-bit float and back to float32; for a quantized format the decoded values of the
    block codes this worker sends, in float32 (with ``residual``: of :math:`t_i + r_i`, and
    :math:`r_i' = t_i + r_i - Q(t_i + r_i)` is returned); with ``packed_payload``, those codes
    and scales themselves (:func:`~optax_dist._quantize.quantized_payload`). With ``slice_axis`` the blocks are
    cut from this device's slice, as :meth:`mean` cuts them, and the slices gathered back (one
    ``all_gather`` over ``slice_axis``, inside the worker). With ``axis_name=None`` the tree
    itself (nothing is quantized, as :meth:`mean`).

    Returns:
      ``(payload, new_residual)``: ``tree``'s structure and shapes; ``new_residual`` is
      ``residual`` when it is ``None`` or ``axis_name`` is ``None``.

    Raises:
      ValueError: a ``residual`` without a quantized ``comm_dtype``; a leaf of ``residual`` not
        of its leaf's shape.
    """
    if residual is not None and not isinstance(self.comm_dtype, str):
      raise ValueError(
        f"`Exchange.payload(residual=...)` (of `{self.call}`): a residual (error feedback)"
        " needs a quantized comm_dtype ('int8', 'float4_e2m1fn', 'e3m0'), got"
        f" comm_dtype={self.comm_dtype!r}."
      )
    if self.axis_name is None:
      return tree, residual
    if isinstance(self.comm_dtype, str):
      terms = _quantize.quantized_payload if self.packed_payload else _quantize.quantized_terms
      return self._sliced(
        lambda pair: terms(*pair, self.comm_dtype, self.comm_block_size), (tree, residual), False,
      )
    return jax.tree.map(self._term, tree), None

  def _term(self, x: jax.Array) -> jax.Array:
    """A leaf's term of the ``psum`` (or of the 8-bit floats' gathered float32 sum)."""
    if self.comm_dtype is None or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      return x
    cast = jnp.asarray(x).astype(self.comm_dtype)
    return cast.astype(jnp.float32) if jnp.finfo(self.comm_dtype).bits <= 8 else cast

  def gather(self, tree: Any, *, slice_mean: bool = False) -> Any:
    """:math:`[Q(t_1), \\dots, Q(t_N)]`: each leaf with a leading axis of the N workers."""
    return self._sliced(
      lambda t: _axis.all_gather(t, self.axis_name, self.comm_dtype, self.comm_block_size), tree,
      slice_mean,
    )

  def reduce(self, updates: Any, reduction: str) -> Any:
    """Gradients summed (``"sum"``) or averaged (``"mean"``) over the workers, leaves already
    summed by autodiff left alone, ``hierarchical`` if set (:func:`_axis.reduce_gradients`)."""
    return _axis.reduce_gradients(
      self.call, updates, self.axis_name, reduction, self.comm_dtype, self.comm_block_size,
      self.hierarchical,
    )

  def _sliced(self, collective, tree, slice_mean):
    return _axis.sliced(collective, tree, self.slice_axis, mean=slice_mean)


def gradient_exchange(
  fn: str, axis_name: Hashable | tuple | None, comm_dtype: Any, hierarchical: Any = False
) -> Exchange:
  """The :class:`Exchange` of ``tower``, ``all_reduce`` and ``accumulate_then_reduce``: every
  step's gradients, in their own dtypes or a floating ``comm_dtype`` (a block-quantized format,
  ``jnp.float4_e2m1fn`` included, is refused: each step's gradients would be rounded, with no
  feedback of the error).

  Raises:
    TypeError: ``comm_dtype`` not ``None`` or a floating dtype with a sign and a zero (a
      block-quantized format: naming the transformations that take it); ``hierarchical`` not a
      bool.
    ValueError: ``hierarchical=True`` with fewer than two axes.
  """
  comm_dtype = _checks.check_comm_dtype(fn, comm_dtype, block_formats=False)
  return Exchange(axis_name, comm_dtype=comm_dtype, hierarchical=hierarchical, call=fn)


def check_exchange(fn: str, exchange: Any) -> None:
  """Raises unless ``exchange`` is an :class:`Exchange` (the halves' ``exchange`` argument).

  Args:
    fn: the calling function's name, for the message.
    exchange: the value given as ``fn``'s ``exchange``.

  Raises:
    TypeError: ``exchange`` not an :class:`Exchange`.
  """
  if not isinstance(exchange, Exchange):
    raise TypeError(f"`{fn}(exchange=...)` must be an optax_dist.Exchange, got {exchange!r}.")


def merge_payloads(payloads: Sequence[Any], weights: Sequence[Any] | None = None, *,
                   total: float | None = None) -> Any:
  r"""The workers' mean of their :meth:`Exchange.payload`\ s, merged where they arrive.

  With :math:`N` payloads :math:`p_0, \dots, p_{N-1}` in the workers' (rank) order:

  .. math::

    \bar p = \frac{1}{N}\Big(\big((p_0 + p_1) + p_2\big) + \dots + p_{N-1}\Big),
    \qquad \text{or} \qquad
    \bar p = \frac{\sum_i w_i\, p_i}{\sum_i w_i}

  per leaf (with ``total``: :math:`\sum_i w_i p_i / \mathrm{total}`). Equal weights
  (``weights=None``): the sum in the payloads' dtype, term after term
  in rank order, then divided by N in float32 (or the payload's dtype if wider). This is
  :meth:`Exchange.mean`'s arithmetic: cast to the leaves' dtypes (as ``diloco_outer_step``
  does), it is bit for bit the in-program mean for the gathered formats (8-bit floats and the
  quantized ones, summed in float32 in worker order) and for two workers; with more workers a
  ``psum`` may add in another order, within one unit in the last place of the sum. (With
  leaves narrower than float32, e.g. a bfloat16 anchor and a gathered format, the in-program
  mean rounds the sum to them before dividing: the same bits when N is a power of 2.) With
  ``weights`` (e.g. each worker's tokens) the weighted sum is computed in float32 (or wider)
  in rank order; no in-program exchange weighs workers.

  Args:
    payloads: a non-empty sequence of trees of one structure and shapes, one per worker in
      rank order (e.g. ``diloco_payload``'s payloads, as arrays that left the jitted step;
      those of an ``Exchange(packed_payload=True)``, codes and scales, are decoded first:
      :func:`unpacked`).
    weights: ``None`` or one non-negative number per payload, not all zero.
    total: with ``weights``, the divisor in place of their sum (e.g. the tokens a round of
      every replica holds, where a merge of fewer payloads should move the anchor less:
      ``staleness_rule="token_share"`` of decoupled rounds); ``None``: their sum.

  Returns:
    The payloads' tree and shapes, each leaf in float32 (or its dtype if wider).

  Collectives:
    None.

  Raises:
    ValueError: ``payloads`` empty; ``weights`` not of ``len(payloads)``, negative or summing
      to zero; ``total`` given without ``weights`` or not a finite number > 0; the payloads'
      structures differ (raised by ``jax.tree.map``).

  Examples:
    >>> import jax.numpy as jnp, optax_dist
    >>> optax_dist.merge_payloads([jnp.array([1.0]), jnp.array([4.0])])
    Array([2.5], dtype=float32)
    >>> optax_dist.merge_payloads([jnp.array([1.0]), jnp.array([4.0])], weights=[3, 1])
    Array([1.75], dtype=float32)

  References:
    Douillard et al., `DiLoCo <https://arxiv.org/abs/2311.08105>`_, 2023 (Algorithm 1, the
    outer gradient averaged over the workers).
  """
  payloads = [unpacked(p) for p in payloads]
  if not payloads:
    raise ValueError("`merge_payloads(payloads=...)` must hold one payload per worker, got none.")
  if total is not None and (weights is None or not 0 < total < math.inf):
    raise ValueError(f"`merge_payloads(total=...)` must be a finite number > 0 given with"
                     f" weights, got total={total!r} and weights={weights!r}.")
  if weights is None:
    return _means(payloads, np.int32(len(payloads)))
  weights = np.asarray(weights, np.float64)
  if weights.shape != (len(payloads),) or np.any(weights < 0) or not weights.sum() > 0:
    raise ValueError(
      f"`merge_payloads(weights=...)` must be {len(payloads)} non-negative numbers (one per"
      f" payload) with a positive sum, got {weights.tolist()!r}."
    )
  return _weighted_sum(_weighted_terms(payloads, weights),
                       weights.sum() if total is None else np.float64(total))


def unpacked(payload: Any) -> Any:
  """A payload as :func:`merge_payloads` adds it: an ``Exchange(packed_payload=True)``'s codes
  and scales decoded (:meth:`~optax_dist._quantize.QuantizedTree.decode`, one program per tree
  structure: bit for bit the float32 payload of ``packed_payload=False``), any other payload as
  it is."""
  return _decoded(payload) if isinstance(payload, _quantize.QuantizedTree) else payload


# The merge runs as a few jitted programs per tree structure (not one eager operation per leaf
# and term), each operation rounded in its dtype, the same bits on every version of XLA:
# ``xla_allow_excess_precision`` off (else a bfloat16 sum stays in float32 between its
# additions); the division by N (or the weights' sum) written as the multiplication by its
# reciprocal, rounded (XLA's CPU backend computes a division of an array by a scalar so in some
# versions and exactly in others); a weighted merge's products a program of their own (XLA's CPU
# backend fuses a product and the sum it feeds into one fused multiply-add).
_EXACT = {"xla_allow_excess_precision": False}
_decoded = jax.jit(lambda payload: payload.decode(), compiler_options=_EXACT)


def _wide(x: jax.Array) -> Any:
  """float32, or ``x``'s dtype if wider: where :func:`merge_payloads` divides."""
  return jnp.promote_types(jnp.result_type(x), jnp.float32)


@functools.partial(jax.jit, compiler_options=_EXACT)
def _means(payloads: list, n: jax.Array) -> Any:
  """The mean's leaves: the sum in the payloads' dtype in rank order, divided by ``n``."""
  def mean(*xs):
    total = functools.reduce(operator.add, xs)  # rank order
    total = total.astype(_wide(total))
    return total * (1 / n.astype(total.dtype))

  return jax.tree.map(mean, *payloads)


@functools.partial(jax.jit, compiler_options=_EXACT)
def _weighted_terms(payloads: list, weights: jax.Array) -> list:
  """Each payload times its weight, in its first payload's :func:`_wide` dtype."""
  def term(i):
    return lambda x0, x: x.astype(_wide(x0)) * weights[i].astype(_wide(x0))

  return [jax.tree.map(term(i), payloads[0], p) for i, p in enumerate(payloads)]


@functools.partial(jax.jit, compiler_options=_EXACT)
def _weighted_sum(terms: list, total: jax.Array) -> Any:
  """The terms summed in rank order, divided by the weights' ``total``."""
  def mean(*ts):
    summed = functools.reduce(operator.add, ts)  # rank order
    return summed * (1 / total.astype(summed.dtype))

  return jax.tree.map(mean, *terms)
