"""The worker axis, written once: every transformation's collectives and conditionals.

Workers are the positions along a named mapped axis (``axis_name``: a name or a tuple of mesh
axis names), so one code path runs under ``jax.shard_map`` (full or partial-manual),
``jax.pmap``, ``jax.vmap(..., axis_name=...)`` and ``jax.jit`` of
``jax.vmap(..., spmd_axis_name=...)``. This module holds:

* binding: :func:`axis_names`, :func:`axis_size`, :func:`bound_axis_size`,
  :func:`resolve_num_workers`, :func:`workers_axis_size`;
* varying types: :func:`varying_axes`, :func:`cast_varying`, :func:`summed_axes`;
* collectives: :func:`psum`, :func:`all_gather`, :func:`worker_mean`, :func:`sliced` (an
  exchange of identical copies, 1/K per device), :func:`reduce_gradients`
  (the all-reduce core of ``tower``, ``all_reduce``, ``accumulate_then_reduce`` and local SGD's
  warm-up);
* the communication step: :func:`communication_hint` (the static ``communicate`` extra argument),
  :func:`agree`, :func:`communicate_if` and :func:`select` (the schedule and the hint together:
  :meth:`optax_dist.Exchange.due`);
* state: :func:`copy`, :func:`wrap_inner`, :func:`keep_dtypes`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dist import _checks, _quantize



def axis_names(axis_name: Hashable | tuple | None) -> tuple:
  """``axis_name`` as a tuple of mesh axis names (``()`` for ``None``)."""
  if axis_name is None:
    return ()
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def axis_size(axis_name: Hashable | tuple | None) -> int | None:
  """Size of the mapped axis ``axis_name`` (the product over a tuple), or ``None`` if it is
  ``None`` or not bound here."""
  if axis_name is None:
    return None
  try:
    return jax.lax.axis_size(axis_name)
  except NameError:
    return None


def bound_axis_size(fn: str, axis_name: Hashable | tuple | None) -> int | None:
  """``axis_size(axis_name)`` in ``update``: ``None`` for ``axis_name=None`` (one worker).

  Raises:
    ValueError: if ``axis_name`` names an axis that is not bound where ``update`` runs (a
      misspelled name, or ``update`` called outside the mapped function): the workers could
      not communicate, and each would silently train alone.
  """
  if axis_name is None:
    return None
  missing = [a for a in axis_names(axis_name) if axis_size(a) is None]
  if missing:
    raise ValueError(
      f"`{fn}(axis_name={axis_name!r})`: `update` was called where axis {missing[0]!r} is not"
      " bound, so the workers cannot communicate. Call it inside the jax.shard_map, jax.pmap"
      f" or jax.vmap that maps the workers over {missing[0]!r} (check the spelling), or pass"
      " axis_name=None for a single worker."
    )
  return jax.lax.axis_size(axis_name)


def resolve_num_workers(
  fn: str, num_workers: Any, axis_name: Hashable | tuple | None, *, in_update: bool = False
) -> int:
  """The number of workers: the axis size where the axis is bound, else ``num_workers`` or 1.

  ``init`` may run where the axis is unbound (``jax.eval_shape`` of the state); ``update``
  (``in_update=True``) may not, whatever ``num_workers``: see :func:`bound_axis_size`.

  Raises:
    ValueError: if ``axis_name`` is bound, ``num_workers`` is concrete and differs from the
      axis size, or the axis has size 0; or, in ``update``, a named ``axis_name`` is unbound.
  """
  size = bound_axis_size(fn, axis_name) if in_update else axis_size(axis_name)
  given = _checks.concrete(num_workers)
  if size is None:
    return 1 if given is None else int(given)
  if size < 1:
    raise ValueError(
      f"`{fn}` was called under axis {axis_name!r} of size {size}; a communicating"
      " transformation needs at least one worker."
    )
  if given is not None and int(given) != size:
    raise ValueError(
      f"`{fn}(num_workers=...)` must equal the size of axis {axis_name!r}, got"
      f" num_workers={int(given)} but the axis has {size} workers."
    )
  return size


def varying_axes(x: Any) -> frozenset:
  """The mapped axes over which ``x``'s type says it varies (empty where types are unchecked).

  ``x`` is a traced value or a ``jax.ShapeDtypeStruct`` from ``jax.eval_shape`` (read from its
  own ``manual_axis_type``: under a partial-manual ``shard_map(axis_names=...)`` such a shape
  has manual axes but no mesh, and ``jax.typeof`` of it fails). Needs JAX >= 0.10: without
  varying types every value would look invariant and ``tower`` would count gradients already
  summed by autodiff twice, so an older JAX fails here.
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    axis_type = x.manual_axis_type
    return frozenset() if axis_type is None else frozenset(axis_type.varying)
  return frozenset(jax.typeof(x).manual_axis_type.varying)


def cast_varying(x: jax.Array, axes: frozenset) -> jax.Array:
  """``x`` typed varying over ``axes`` (``jax.lax.pcast``; no data moves)."""
  missing = tuple(sorted(axes - varying_axes(x), key=str))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def summed_axes(axis_name: Hashable | tuple, leaf: jax.Array) -> tuple:
  """The axes of ``axis_name`` over which autodiff has already summed ``leaf``.

  Per axis: varying types are checked there (``shard_map``'s default) iff the axis index varies
  over it, and a leaf typed invariant over a checked axis was summed over it by autodiff (the
  gradient of params replicated over that axis). Under ``vmap``, ``pmap`` and
  ``shard_map(check_vma=False)`` every value is typed invariant and no axis counts as summed.
  """
  return tuple(
    a for a in _checked_axes(axis_name) if a not in varying_axes(leaf)
  )


def _checked_axes(axis_name: Hashable | tuple) -> tuple:
  """The axes of ``axis_name`` whose varying types are checked (``shard_map``'s default)."""
  return tuple(a for a in axis_names(axis_name) if a in varying_axes(jax.lax.axis_index(a)))


# ----------------------------------------------------------------------------------------------
# Collectives.


def _to_dtype(tree: Any, dtype: Any) -> Any:
  if dtype is None:
    return tree
  return jax.tree.map(
    lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
  )


def psum(tree: Any, axis_name: Hashable, comm_dtype: Any = None, block_size: int = 256) -> Any:
  """``jax.lax.psum`` of ``tree``'s leaves, communicated in ``comm_dtype`` (if given).

  Floating leaves are cast to ``comm_dtype`` before the collective and back to their own dtype
  after, so the result has ``tree``'s dtypes and the bytes on the wire scale with
  ``comm_dtype``'s itemsize.

  A quantized format's name (``"int8"``, ``"float4_e2m1fn"``, ``"e3m0"``, as
  :func:`optax_dist._checks.check_comm_dtype` resolves ``jnp.int8`` and ``jnp.float4_e2m1fn``)
  sends the floating leaves in blocks of ``block_size`` values with float32 scales:
  :func:`optax_dist._quantize.quantized_sum` (each worker sends ``wire_bytes`` and receives N
  times that).

  8-bit floats are not summed in 8 bits: XLA CPU's ``psum`` of ``float8_e4m3fn`` rounds after
  every addition under ``vmap`` but only once under ``shard_map``, and a partial sum past
  ``float8_e4m3fn``'s range (±448, no infinity) is NaN. Their floating leaves are quantized to
  ``comm_dtype``, gathered from every worker (``all_gather``: each worker receives N times the
  bytes it sends) and summed in float32, in the same order on every worker.
  """
  if isinstance(comm_dtype, str):
    return _quantize.quantized_sum(tree, axis_name, comm_dtype, block_size)
  if comm_dtype is None or jnp.finfo(comm_dtype).bits > 8:
    return optax.tree.cast_like(jax.lax.psum(_to_dtype(tree, comm_dtype), axis_name), tree)

  def gather_sum(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return jax.lax.psum(x, axis_name)
    gathered = jax.lax.all_gather(x.astype(comm_dtype), axis_name)
    return jnp.sum(gathered.astype(jnp.float32), axis=0).astype(x.dtype)

  return jax.tree.map(gather_sum, tree)


def all_gather(
  tree: Any, axis_name: Hashable, comm_dtype: Any = None, block_size: int = 256
) -> Any:
  """``jax.lax.all_gather`` of ``tree``'s leaves, communicated in ``comm_dtype`` (if given; a
  quantized format's name sends block codes, :func:`optax_dist._quantize.quantized_all_gather`)."""
  if isinstance(comm_dtype, str):
    return _quantize.quantized_all_gather(tree, axis_name, comm_dtype, block_size)
  gathered = jax.lax.all_gather(_to_dtype(tree, comm_dtype), axis_name)
  return jax.tree.map(lambda g, x: g.astype(jnp.result_type(x)), gathered, tree)


def hierarchical_psum(
  x: jax.Array, axis_name: tuple, comm_dtype: Any = None, block_size: int = 256
) -> jax.Array:
  """:func:`psum` of one leaf over the tuple of axes ``axis_name``, the last one first.

  With ``axis_name = (*outer, inner)`` (``inner`` the fast axis, e.g. the devices of one host):
  the leaf, flattened and padded with zeros to a multiple of K (``inner``'s size), is
  reduce-scattered over ``inner`` (``psum_scatter``: each device keeps the sum of its 1/K
  slice), the slices are all-reduced over ``outer`` by :func:`psum` in ``comm_dtype``, and an
  ``all_gather`` over ``inner`` rebuilds the leaf. Across ``outer`` each device sends and
  receives the bytes of its 1/K slice, so the K devices of a host together send the leaf's
  bytes once, where a flat ``psum`` over all the axes crosses between hosts about twice
  (a ring over every device). The reduce-scatter and all-gather inside ``inner`` run in the
  leaf's own dtype. The sum's terms are added in another order than a flat ``psum``'s.
  """
  *outer, inner = axis_name
  part = jax.lax.psum_scatter(_padded(x, jax.lax.axis_size(inner)), inner, tiled=True)
  return _gathered(psum(part, tuple(outer), comm_dtype, block_size), inner, x)


def _padded(x: jax.Array, k: int) -> jax.Array:
  """``x`` flattened and padded with zeros to a multiple of ``k`` values."""
  flat = jnp.ravel(x)
  return jnp.pad(flat, (0, -flat.size % k))


def _gathered(part: jax.Array, axis_name: Hashable, x: jax.Array) -> jax.Array:
  """The slices ``part`` of :func:`_padded` ``x`` all-gathered over ``axis_name``, unpadded and
  reshaped like ``x``; leading dims of ``part`` (one slice per worker, say) are kept."""
  whole = jax.lax.all_gather(part, axis_name, axis=part.ndim - 1, tiled=True)
  return whole[..., : x.size].reshape(*part.shape[:-1], *x.shape)


def worker_mean(
  tree: Any, axis_name: Hashable, n: int, comm_dtype: Any = None, block_size: int = 256
) -> Any:
  """The mean over the ``n`` workers of ``tree``'s leaves, divided in each leaf's dtype."""
  total = psum(tree, axis_name, comm_dtype, block_size)
  return jax.tree.map(lambda t: (t / n).astype(t.dtype), total)


def worker_mean_with_feedback(
  tree: Any, residual: Any, axis_name: Hashable, n: int, comm_dtype: str, block_size: int = 256
) -> tuple[Any, Any]:
  """:func:`worker_mean` in a quantized format ``comm_dtype``, each worker adding its
  ``residual`` (float32, ``tree``'s shapes) before quantizing: returns the mean and the new
  residual (:func:`optax_dist._quantize.quantized_sum_with_feedback`)."""
  total, new_residual = _quantize.quantized_sum_with_feedback(
    tree, residual, axis_name, comm_dtype, block_size
  )
  return jax.tree.map(lambda t: (t / n).astype(t.dtype), total), new_residual


def sliced(
  exchange: Callable[[Any], Any], tree: Any, slice_axis: Hashable | None, *, mean: bool = False
) -> Any:
  """``exchange(tree)`` with each device of ``slice_axis`` sending only its 1/K slice.

  Where the K devices along ``slice_axis`` (inside one worker) hold identical copies of ``tree``
  (the devices of one replica after a ``tower`` over that axis), exchanging the whole tree from
  each of them would send the same bytes K times across the workers. Here each device flattens
  every leaf, pads it with zeros to a multiple of K, and passes only its slice ``k`` (its
  position along ``slice_axis``) to ``exchange`` (a collective across the workers that returns a
  tree of the same structure, e.g. the workers' mean, or with leading dims, e.g. every worker's
  slice from an ``all_gather``); an ``all_gather`` over ``slice_axis``, inside the worker, then
  rebuilds each leaf (keeping those leading dims). Across the workers each device sends
  :math:`1/K` of the bytes, and the K devices together send the tree's bytes once; inside the
  worker each device receives :math:`(K-1)/K` of them. An elementwise ``exchange`` gives the
  same values as without slicing (a quantized format's blocks are cut from the slices).
  ``slice_axis=None`` is ``exchange(tree)``.

  ``mean=True`` is for devices that hold different values of which the worker exchanges the mean
  over ``slice_axis`` (``agn``'s accumulators of raw gradients): each device's slice is then that
  mean's, from a ``psum_scatter`` over ``slice_axis`` (the bytes of one copy, inside the worker).
  """
  if slice_axis is None:
    return exchange(tree)
  k, index = jax.lax.axis_size(slice_axis), jax.lax.axis_index(slice_axis)
  leaves, treedef = jax.tree.flatten(tree)

  def cut(x):
    if mean:
      return (jax.lax.psum_scatter(_padded(x, k), slice_axis, tiled=True) / k).astype(x.dtype)
    m = -(-x.size // k)
    return jax.lax.dynamic_slice_in_dim(_padded(x, k), index * m, m)

  out = jax.tree.leaves(exchange(treedef.unflatten([cut(x) for x in leaves])))

  def join(part, x):
    return cast_varying(_gathered(part, slice_axis, x), varying_axes(x))

  return treedef.unflatten([join(part, x) for part, x in zip(out, leaves, strict=True)])


def check_slice_axis(
  fn: str, slice_axis: Hashable | None, axis_name: Hashable | tuple | None
) -> None:
  """Raise unless ``slice_axis`` is ``None``, or an axis bound here and not part of ``axis_name``.

  Raises:
    ValueError: ``slice_axis`` is one of the workers' axes, or (in ``update``) is not bound.
  """
  if slice_axis is None:
    return
  if slice_axis in axis_names(axis_name):
    raise ValueError(
      f"`{fn}(slice_axis={slice_axis!r})` must be an axis inside each worker, not one of the"
      f" workers' axes {axis_names(axis_name)!r}."
    )
  if axis_size(slice_axis) is None:
    raise ValueError(
      f"`{fn}(slice_axis={slice_axis!r})`: `update` was called where axis {slice_axis!r} is not"
      " bound; map the devices inside each worker over it (check the spelling), or pass"
      " slice_axis=None."
    )


def reduce_gradients(
  fn: str, updates: Any, axis_name: Hashable | tuple | None, reduction: str, comm_dtype: Any,
  block_size: int = 256, hierarchical: bool = False,
) -> Any:
  """The gradients summed (``"sum"``) or averaged (``"mean"``) over the workers.

  Per axis of ``axis_name``: a leaf already summed by autodiff (typed invariant over a checked
  axis, see :func:`summed_axes`) is not summed again; the others are ``psum``-ed in
  ``comm_dtype`` (with ``hierarchical``, over two or more axes, by :func:`hierarchical_psum`).
  The mean divides by N, the product of all the axes' sizes. ``axis_name=None`` returns
  ``updates`` unchanged. Errors name ``fn``, the public function the user called.
  """
  n = bound_axis_size(fn, axis_name)
  if n is None:
    return updates

  def reduce(g):
    summed = summed_axes(axis_name, g)
    others = tuple(a for a in axis_names(axis_name) if a not in summed)
    if hierarchical and len(others) > 1:
      total = hierarchical_psum(g, others, comm_dtype, block_size)
    else:
      total = psum(g, others, comm_dtype, block_size) if others else g
    return total if reduction == "sum" else (total / n).astype(g.dtype)

  return jax.tree.map(reduce, updates)


# ----------------------------------------------------------------------------------------------
# The communication step.


def communication_hint(fn: str, extra_args: dict) -> bool | None:
  """Removes the static ``communicate`` extra argument from ``extra_args`` and returns it.

  ``None`` (absent): the counter rule decides each step, inside a ``lax.cond``. ``True`` or
  ``False``: the caller states at trace time whether this ``update`` makes the exchange; the step
  is then compiled without the conditional. It is consumed here, never forwarded to ``inner``
  (an inner transformation with its own schedule keeps its own counter rule).

  Raises:
    TypeError: the value is not ``None`` or a Python/NumPy bool (a traced value cannot decide
      what is compiled: mark the argument static, e.g. ``jax.jit(..., static_argnames=...)``).
  """
  hint = extra_args.pop("communicate", None)
  if hint is None or isinstance(hint, (bool, np.bool_)):
    return None if hint is None else bool(hint)
  raise TypeError(
    f"`{fn}`: the extra argument `communicate` must be None, True or False, fixed at trace"
    f" time; got {hint!r} of type {type(hint).__name__}. A traced value cannot decide what is"
    " compiled: pass a Python bool (static under jit), or leave it out to let the step counter"
    " decide."
  )


def agree(pred: jax.Array | bool, axis_name: Hashable | tuple | None) -> jax.Array | bool:
  """``pred``, a predicate equal on every worker, made one value for all of them.

  Under ``vmap`` (also ``jax.jit`` of ``vmap(..., spmd_axis_name=...)``) a predicate computed
  from the stacked state is batched, and ``lax.cond`` on a batched predicate becomes a select
  that runs both branches, the collectives of the exchange included, on every step. Where the
  varying types of an axis of ``axis_name`` are not checked (``vmap``, ``pmap``,
  ``shard_map(check_vma=False)``) the predicate is therefore reduced over those axes with a
  ``pmax`` (one 4-byte all-reduce): its result is unbatched, and the conditional stays one.
  Under ``shard_map`` with checked types (the default) each worker evaluates its own conditional
  and nothing is reduced. A Python bool (a step known at trace time) is returned as it is.
  """
  if axis_name is None or isinstance(pred, bool):
    return pred
  checked = _checked_axes(axis_name)
  unchecked = tuple(a for a in axis_names(axis_name) if a not in checked)
  if not unchecked:
    return pred
  return jax.lax.pmax(jnp.asarray(pred, jnp.int32), unchecked) > 0


def communicate_if(
  pred: jax.Array | bool, communicate: Callable[..., Any], skip: Callable[..., Any],
  *operands: Any,
) -> Any:
  """``lax.cond(pred, communicate, skip, *operands)`` with the branches' types reconciled.

  Under ``shard_map`` a collective's result is typed invariant over the axis while the value it
  replaces in the other branch is varying; ``lax.cond`` requires equal types. Each output leaf is
  therefore cast (``jax.lax.pcast(..., to="varying")``) to the union of the axes both branches
  vary over. Where varying types are not checked (``vmap``, ``pmap``, ``check_vma=False``) this
  is a plain ``lax.cond``. ``pred`` must be identical on every worker (and unbatched under
  ``vmap``: see :func:`agree`), so that the collectives in ``communicate`` execute on all of them
  or on none. A Python bool ``pred`` (a step known at trace time) calls the one branch it names,
  with no conditional, and gives the same output types.
  """
  shapes = [jax.eval_shape(branch, *operands) for branch in (communicate, skip)]
  axes = jax.tree.map(lambda a, b: varying_axes(a) | varying_axes(b), *shapes)

  def reconciled(branch):
    return lambda *ops: jax.tree.map(cast_varying, branch(*ops), axes)

  if isinstance(pred, bool):
    return reconciled(communicate if pred else skip)(*operands)
  return jax.lax.cond(pred, reconciled(communicate), reconciled(skip), *operands)


def select(pred: jax.Array | bool, on_true: Any, on_false: Any) -> Any:
  """``jnp.where(pred, on_true, on_false)``, or the one operand a Python bool ``pred`` names."""
  if isinstance(pred, bool):
    return on_true if pred else on_false
  return jnp.where(pred, on_true, on_false)


# ----------------------------------------------------------------------------------------------
# State.


def copy(tree: Any, dtype: Any = None) -> Any:
  """A copy of ``tree`` (in ``dtype`` if given) that shares no buffer with it.

  State built from the params at ``init`` must not alias them: a jitted step that donates both
  the params and the state right after an eager ``init`` would donate one buffer twice.
  """
  return jax.tree.map(lambda x: jnp.array(x, dtype=dtype, copy=True), tree)


def wrap_inner(inner: Any) -> Any:
  """``inner`` as every wrapper calls it: unknown extra args dropped
  (``optax.with_extra_args_support``), and its state cast back to its dtypes after each update
  (:func:`keep_dtypes`)."""
  inner = optax.with_extra_args_support(inner)

  def update_fn(updates, state, params=None, **extra_args):
    updates, new_state = inner.update(updates, state, params, **extra_args)
    return updates, keep_dtypes(new_state, state)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def keep_dtypes(new: Any, old: Any) -> Any:
  """``new`` cast leaf by leaf to the dtypes of ``old`` (a state keeps its dtypes per step).

  With gradients of another dtype than the params (mixed precision), optax's inner states
  promote (e.g. momentum of bfloat16 params updated with float32 gradients becomes float32):
  a state that changes dtype retraces a jitted step, and the branches of a ``lax.cond`` would
  disagree.
  """
  return jax.tree.map(lambda n, o: n.astype(jnp.result_type(o)), new, old)



def workers_axis_size(
  call: str, params: Any, opt_state: Any, fix: str, num_workers: int | None = None
) -> tuple[int | None, tuple[str, tuple] | None]:
  """The common leading size of every leaf of ``params`` and ``opt_state``: the workers' axis.

  Trees stacked over workers (the outputs of ``vmap``, ``shard_map`` with ``P(axis)`` or
  ``pmap``) have axis 0 on every leaf, the scalar step counters of the state included. Returns
  the size (``num_workers`` if given, else the first leaf's) and ``(path, shape)`` of the first
  leaf (``None`` for trees without leaves).

  Raises:
    ValueError: naming ``call``, the leaf and its shape, then ``fix``: a leaf has no axis 0 (a
      tree not stacked over workers), or another leading size.
  """
  ref, size = None, num_workers
  for tree_name, tree in (("params", params), ("opt_state", opt_state)):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      name, shape = tree_name + jax.tree_util.keystr(path), np.shape(leaf)
      if not shape:
        raise ValueError(
          f"`{call}` needs every leaf of `params` and `opt_state` stacked over the workers on"
          f" axis 0, but {name} has shape (): it has no workers' axis." + fix
        )
      size = shape[0] if size is None else size
      if shape[0] != size:
        expected = f"num_workers={num_workers}" if ref is None else f"{ref[0]} has shape {ref[1]}"
        raise ValueError(
          f"`{call}` needs every leaf of `params` and `opt_state` stacked over the same number"
          f" of workers on axis 0, but {name} has shape {shape} while {expected}." + fix
        )
      ref = ref or (name, shape)
  return size, ref
