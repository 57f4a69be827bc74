r"""Block-quantized exchange formats: 8-bit and packed 4-bit codes with float32 block scales.

A floating array is flattened, padded with zeros to a whole number of blocks of ``block_size``
values, and each block :math:`b` is stored as one float32 scale :math:`s_b` and one code per
value. A value :math:`x` of block :math:`b` is sent as the point of the format's grid :math:`G`
nearest to :math:`x / s_b` and received as :math:`\hat x = s_b\, g`:

.. math::

  s_b = \operatorname{up}_p\!\left(\max_{i \in b} |x_i| \cdot
    \mathrm{fl}\!\left(\frac{1}{\max G}\right)\right), \qquad
  \hat x_i = s_b \cdot \operatorname*{round}_{g \in G}\!\left(x_i \cdot
    \mathrm{fl}\!\left(\frac{1}{s_b}\right)\right)
  \quad (\hat x_i = 0 \text{ where } s_b = 0)

in float32, where :math:`\mathrm{fl}(1/a)` is the float32 reciprocal and
:math:`\operatorname{up}_p` rounds up to :math:`p` significant bits: 17 for ``int8``, 22 for
``float4_e2m1fn``, 24 (no rounding) for ``e3m0``, a relative increase below :math:`2^{-16}`.
Two consequences hold on every backend. Decoding is exact: a grid value's odd part has at most
:math:`24 - p` bits, so :math:`s_b\, g` is a float32 without rounding (a compiler that fuses
the decoding multiply into an addition, an FMA, gives the same sums). Encoding is
reproducible: it multiplies by reciprocals instead of dividing, so no compiler rewrite of a
division changes a code. A block whose scale would be below :math:`2^{-126}` (float32's
smallest normal: :math:`\max |x| < 1.5 \cdot 10^{-36}` for ``int8``) is sent as zeros, as
XLA's CPU backend, which flushes subnormals, would do anyway.
Formats (``fmt``), their grids and codes:

* ``"int8"``: :math:`G = \{-127, \dots, 127\}`, rounded to nearest (ties to even, as
  ``jnp.round``); one ``int8`` code per value (-128 is never produced).
* ``"float4_e2m1fn"``: :math:`G = \pm\{0, 0.5, 1, 1.5, 2, 3, 4, 6\}` (the values of
  ``jnp.float4_e2m1fn``: 1 sign, 2 exponent, 1 mantissa bit, no infinity or NaN); the 4-bit code
  is that type's bit pattern ``sign << 3 | magnitude index`` (index 0-7 in the order above).
* ``"e3m0"``: the 4-bit format without mantissa used for outer gradients by Streaming DiLoCo
  (1 sign bit, 3 exponent bits): :math:`G = \pm\{0, 2^{-6}, 2^{-5}, 2^{-4}, 2^{-3}, 2^{-2},
  2^{-1}, 1\}`. Code ``sign << 3 | e`` with ``e = 0`` for zero and :math:`2^{e-7}` for
  ``e = 1..7``, so the block's largest magnitude is sent exactly (:math:`g = 1`) and values
  below :math:`2^{-7} s_b` are sent as zero.

For both 4-bit formats the rounding is to the nearest grid point with ties to the even
magnitude index (for ``float4_e2m1fn`` that is IEEE round-to-nearest-even, as ``ml_dtypes``
converts); a value rounded to zero keeps its sign (a negative zero). Two 4-bit codes are packed
per ``uint8``: value :math:`2k` of a block in the low nibble, value :math:`2k + 1` in the high
one, so what is sent is the packed bytes (XLA collectives cannot carry 4-bit types).

Bytes per value, the float32 scales included, for a block of :math:`B` values (padding aside):

=================== ======================= ================ =========================
format              bytes per value         :math:`B = 256`  vs float32 / bfloat16
=================== ======================= ================ =========================
``int8``            :math:`1 + 4/B`         1.015625         3.94× / 1.97× fewer
``float4_e2m1fn``   :math:`0.5 + 4/B`       0.515625         7.76× / 3.88× fewer
``e3m0``            :math:`0.5 + 4/B`       0.515625         7.76× / 3.88× fewer
=================== ======================= ================ =========================

Rounding error: :math:`|x - \hat x| \le \tfrac12 \Delta\, s_b` where :math:`\Delta` is the
spacing of the grid around :math:`x / s_b` (1 for ``int8``, 0.5 to 2 for ``float4_e2m1fn``,
:math:`2^{-7}` to :math:`2^{-1}` for ``e3m0``), up to float32 rounding of the division.
Values are quantized from float32 (a float64 leaf is first rounded to float32). A block holding
a NaN or an infinity gets a non-finite scale and decodes to non-finite values, so a sum over the
workers is non-finite too (``optax_dist.apply_if_finite`` then skips the step).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("int8", "float4_e2m1fn", "e3m0")
"""The exchange formats, by name."""

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_E3M0 = np.array([0.0] + [2.0**e for e in range(-6, 1)], np.float32)
_GRIDS = {"float4_e2m1fn": _E2M1, "e3m0": _E3M0}
"""Magnitudes of the 4-bit formats, in code order (code ``sign << 3 | index``)."""

_MAX = {"int8": 127.0, "float4_e2m1fn": 6.0, "e3m0": 1.0}
_CLEARED_BITS = {"int8": 7, "float4_e2m1fn": 2, "e3m0": 0}
"""Low mantissa bits a scale is rounded up to zero in: a grid value's odd part has at most 7
(127), 2 (3) and 1 (1) bits, so that many fewer significant bits in the scale keep every product
``grid value × scale`` within float32's 24."""
_TINY = np.float32(2.0**-126)  # float32's smallest normal


class Packed(NamedTuple):
  """One array in a block-quantized format (:func:`encode`), as it is sent.

  For :math:`n` values in blocks of :math:`B`, :math:`K = \\lceil n / B \\rceil` blocks:

  Attributes:
    codes: ``int8[K, B]`` for ``"int8"``; ``uint8[K, B // 2]`` for the 4-bit formats, two codes
      per byte (value :math:`2k` of a block in the low nibble, :math:`2k + 1` in the high one).
    scales: ``float32[K]``, each block's scale :math:`s_b \\approx \\max_b |x| / \\max G`
      (see the module's docstring).
  """

  codes: jax.Array
  scales: jax.Array


# ----------------------------------------------------------------------------------------------
# Validation.


def _format(fn: str, fmt: Any) -> str:
  """``fmt`` as a name of :data:`FORMATS`; a dtype (``jnp.int8``, ``jnp.float4_e2m1fn``) counts
  as its name."""
  name = fmt
  if not isinstance(fmt, str):
    try:
      name = np.dtype(fmt).name
    except TypeError:
      name = None
  if name not in FORMATS:
    raise ValueError(
      f"`{fn}(fmt=...)` must be one of {', '.join(map(repr, FORMATS))}, got {fmt!r}."
    )
  return name


def _block_size(fn: str, block_size: Any, fmt: str) -> int:
  if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
    raise TypeError(f"`{fn}(block_size=...)` must be a positive int, got {block_size!r}.")
  if block_size < 1:
    raise ValueError(f"`{fn}(block_size=...)` must be a positive int, got {block_size}.")
  if fmt in _GRIDS and block_size % 2:
    raise ValueError(
      f"`{fn}(block_size=...)` must be even for fmt={fmt!r}, which packs two 4-bit codes per"
      f" byte, got {block_size}. Use e.g. {block_size + 1}."
    )
  return int(block_size)


# ----------------------------------------------------------------------------------------------
# Encoding and decoding one array.


def _round_to_grid(magnitude: jax.Array, grid: np.ndarray) -> jax.Array:
  """The index of the point of ``grid`` (increasing, from 0) nearest to ``magnitude`` (>= 0).

  The index counts the midpoints between neighbours that ``magnitude`` passes; at a midpoint
  itself it moves up only to an even index (ties to even).
  """
  index = jnp.zeros(magnitude.shape, jnp.uint8)
  for k in range(len(grid) - 1):
    midpoint = np.float32((grid[k] + grid[k + 1]) / 2)  # exact: neighbours are within 2x
    passed = magnitude >= midpoint if k % 2 else magnitude > midpoint  # tie: up to k + 1 if even
    index = index + passed.astype(jnp.uint8)
  return index


def _round_up(scales: jax.Array, bits: int) -> jax.Array:
  """Non-negative ``scales`` rounded up to the nearest float32 whose ``bits`` lowest mantissa
  bits are zero (a carry moves into the exponent; infinities and NaN are kept)."""
  if bits == 0:
    return scales
  mask = np.uint32(2**bits - 1)
  pattern = jax.lax.bitcast_convert_type(scales, jnp.uint32)
  rounded = jax.lax.bitcast_convert_type((pattern + mask) & ~mask, jnp.float32)
  return jnp.where(jnp.isfinite(scales), rounded, scales)


def _pack(codes: jax.Array) -> jax.Array:
  """``uint8[K, B]`` codes below 16 -> ``uint8[K, B // 2]``, value ``2k`` in the low nibble."""
  pairs = codes.reshape(codes.shape[0], -1, 2)
  return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack(packed: jax.Array) -> jax.Array:
  """Inverse of :func:`_pack`: ``uint8[K, B // 2]`` -> ``uint8[K, B]``."""
  pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
  return pairs.reshape(packed.shape[0], -1)


def encode(x: jax.Array, fmt: Any = "int8", block_size: int = 256) -> Packed:
  r"""``x`` in the block-quantized format ``fmt`` (see the module's docstring for the grids).

  ``x`` is flattened (row-major) and padded with zeros at the end to :math:`K = \lceil n / B
  \rceil` blocks of :math:`B` = ``block_size`` values; zeros change no block's scale and are
  dropped by :func:`decode`. Each block gets :math:`s_b \approx \max_b |x| / \max G` and each
  value the code of :math:`\operatorname{round}_G(x / s_b)` (code 0 where :math:`s_b = 0`); the
  module's docstring gives the exact float32 computation.

  Args:
    x: a floating array, any shape (computed in float32).
    fmt: ``"int8"``, ``"float4_e2m1fn"`` or ``"e3m0"`` (or the dtypes ``jnp.int8``,
      ``jnp.float4_e2m1fn``).
    block_size: values per scale, :math:`B`; even for the 4-bit formats.

  Returns:
    A :class:`Packed`: ``codes`` ``int8[K, B]`` (``"int8"``) or ``uint8[K, B // 2]`` (4-bit),
    ``scales`` ``float32[K]``. Its bytes are :func:`wire_bytes` ``(x.size, fmt, block_size)``.

  Raises:
    ValueError: ``fmt`` not one of :data:`FORMATS`; ``block_size`` below 1, or odd for a
      4-bit format.
    TypeError: ``block_size`` not an int.
  """
  fmt = _format("encode", fmt)
  block_size = _block_size("encode", block_size, fmt)
  flat = jnp.ravel(x).astype(jnp.float32)
  num_blocks = -(-flat.size // block_size)
  blocks = jnp.pad(flat, (0, num_blocks * block_size - flat.size)).reshape(num_blocks, block_size)
  scales = _round_up(
    jnp.max(jnp.abs(blocks), axis=1, initial=0.0) * np.float32(1 / _MAX[fmt]), _CLEARED_BITS[fmt]
  )
  scales = jnp.where(scales >= _TINY, scales, jnp.where(jnp.isnan(scales), scales, 0.0))
  y = blocks * jnp.where(scales > 0, 1 / scales, 0.0)[:, None]
  if fmt == "int8":
    return Packed(jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8), scales)
  codes = _round_to_grid(jnp.abs(y), _GRIDS[fmt]) | (jnp.signbit(y).astype(jnp.uint8) << 3)
  return Packed(_pack(codes), scales)


def _decode_blocks(packed: Packed, fmt: str) -> jax.Array:
  """``float32[K, B]``: each value's grid point times its block's scale."""
  if fmt == "int8":
    values = packed.codes.astype(jnp.float32)
  else:
    grid = _GRIDS[fmt]
    values = jnp.asarray(np.concatenate([grid, -grid]))[_unpack(packed.codes)]
  return values * packed.scales[:, None]


def decode(
  packed: Packed, fmt: Any = "int8", shape: tuple[int, ...] | None = None,
  dtype: Any = jnp.float32,
) -> jax.Array:
  r"""The values :math:`\hat x = s_b\, g` of an :func:`encode`\ d array, in ``shape`` and ``dtype``.

  Args:
    packed: the :class:`Packed` codes and scales (the block size is read from their shapes).
    fmt: the format it was encoded in.
    shape: the original array's shape (default: all the values, padding included, flat).
    dtype: the result's dtype; the values are computed in float32 and cast.

  Returns:
    ``dtype[shape]``: the first ``prod(shape)`` decoded values, reshaped.

  Raises:
    ValueError: ``fmt`` not one of :data:`FORMATS`; ``shape`` holds more values than
      ``packed``.
  """
  fmt = _format("decode", fmt)
  flat = _decode_blocks(packed, fmt).reshape(-1)
  if shape is None:
    return flat.astype(dtype)
  size = math.prod(shape)
  if size > flat.size:
    raise ValueError(
      f"`decode(shape=...)`: {shape} holds {size} values but `packed` holds {flat.size}"
      f" ({packed.scales.shape[0]} blocks)."
    )
  return flat[:size].reshape(shape).astype(dtype)


def wire_bytes(num_values: int, fmt: Any = "int8", block_size: int = 256) -> int:
  r"""The bytes of :func:`encode` of ``num_values`` values: codes plus float32 scales.

  .. math::

    K = \lceil n / B \rceil, \qquad
    \text{bytes} = K B \cdot c + 4 K, \quad c = 1 \text{ (int8)}, \ \tfrac12 \text{ (4-bit)}

  about :math:`n\,(c + 4/B)`, the padding of the last block included. This is what one worker
  sends per array in :func:`quantized_sum`; it receives :math:`N` times as much.

  Raises:
    ValueError: ``fmt`` not one of :data:`FORMATS`; ``num_values`` negative; ``block_size``
      below 1, or odd for a 4-bit format.
    TypeError: ``num_values`` or ``block_size`` not an int.
  """
  fmt = _format("wire_bytes", fmt)
  block_size = _block_size("wire_bytes", block_size, fmt)
  if isinstance(num_values, bool) or not isinstance(num_values, numbers.Integral):
    raise TypeError(f"`wire_bytes(num_values=...)` must be an int, got {num_values!r}.")
  if num_values < 0:
    raise ValueError(f"`wire_bytes(num_values=...)` must be >= 0, got {num_values}.")
  num_blocks = -(-int(num_values) // block_size)
  code_bytes = num_blocks * block_size if fmt == "int8" else num_blocks * block_size // 2
  return code_bytes + 4 * num_blocks


# ----------------------------------------------------------------------------------------------
# Error feedback.


def quantize_with_feedback(
  x: jax.Array, residual: jax.Array, fmt: Any = "int8", block_size: int = 256
) -> tuple[Packed, jax.Array]:
  r"""Encodes ``x`` plus the error left over from the previous exchange; returns the new error.

  .. math::

    t = x + r, \qquad \text{packed} = \operatorname{encode}(t), \qquad
    r' = t - \operatorname{decode}(\text{packed})

  in float32. Over rounds :math:`k = 1..K` from :math:`r_0 = 0` the sum telescopes: what was
  sent plus what is still held equals what was given,

  .. math::

    \textstyle\sum_{k} \hat x_k + r_K = \sum_{k} x_k

  up to the float32 rounding of each :math:`x_k + r_{k-1}` (the subtraction giving :math:`r'`
  is exact: each grid's neighbours are within a factor of 2, so :math:`\hat t` is within a
  factor of 2 of :math:`t`, Sterbenz's lemma). No error is lost, only delayed; a worker keeps
  :math:`r` in its state, ``float32`` and of ``x``'s shape, starting from zeros.

  Args:
    x: a floating array, any shape.
    residual: ``float32``, ``x``'s shape: the previous call's ``new_residual`` (zeros at first).
    fmt: the format, see :func:`encode`.
    block_size: values per scale.

  Returns:
    ``(packed, new_residual)``: :func:`encode` of :math:`t` and ``float32[x.shape]``
    :math:`r'`.

  Raises:
    ValueError: as :func:`encode`; ``residual``'s shape differs from ``x``'s.
  """
  if jnp.shape(residual) != jnp.shape(x):
    raise ValueError(
      "`quantize_with_feedback(residual=...)` must have the shape of `x`,"
      f" {jnp.shape(x)}, got {jnp.shape(residual)}."
    )
  target = jnp.asarray(x, jnp.float32) + jnp.asarray(residual, jnp.float32)
  packed = encode(target, fmt, block_size)
  return packed, target - decode(packed, fmt, target.shape, jnp.float32)


# ----------------------------------------------------------------------------------------------
# The sum over the workers.


def _gathered_sum(packed: Packed, axis_name: Hashable | tuple, fmt: str, shape, dtype):
  """All-gathers ``packed`` and sums the workers' decoded values in float32, in worker order."""
  gathered = jax.lax.all_gather(packed, axis_name)  # [N, K, ...] on every worker

  def add(total, worker):
    return total + _decode_blocks(Packed(*worker), fmt), None  # exact products: FMA-proof

  first = _decode_blocks(Packed(gathered.codes[0], gathered.scales[0]), fmt)
  rest = jax.tree.map(lambda a: a[1:], tuple(gathered))
  total, _ = jax.lax.scan(add, first, rest)
  return total.reshape(-1)[: math.prod(shape)].reshape(shape).astype(dtype)


def _packable(x: jax.Array) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating) and x.size > 0


def _apart(tree: Any, collective: Any) -> tuple[list[jax.Array], Any, list[Any]]:
  """``tree``'s leaves as arrays, its treedef, and ``collective`` of each leaf that is not sent
  in blocks (not floating, or empty; ``None`` in the places of the others)."""
  leaves, treedef = jax.tree.flatten(tree)
  leaves = [jnp.asarray(x) for x in leaves]
  return leaves, treedef, [None if _packable(x) else collective(x) for x in leaves]


def _concatenated(leaves: list[Any], values: list[Any] | None = None) -> jax.Array | None:
  """The floating, non-empty ``leaves`` (or the ``values`` in their places, e.g. their
  residuals), each flattened and cast to float32, end to end (``None`` if there are none)."""
  values = leaves if values is None else values
  parts = [jnp.ravel(v).astype(jnp.float32) for x, v in zip(leaves, values) if _packable(x)]
  return jnp.concatenate(parts) if parts else None


def _split(
  flat: jax.Array, leaves: list[jax.Array], others: list[Any], dtype: Any = None
) -> list[Any]:
  """Undoes :func:`_concatenated`: each floating, non-empty leaf's values of ``flat`` (float32,
  ``[..., total]``; leading dims kept) in that leaf's shape and dtype (or ``dtype``);
  ``others`` in the other leaves' places."""
  out, offset = [], 0
  for x, other in zip(leaves, others, strict=True):
    if not _packable(x):
      out.append(other)
      continue
    piece = flat[..., offset : offset + x.size]
    out.append(piece.reshape(*flat.shape[:-1], *x.shape).astype(dtype or x.dtype))
    offset += x.size
  return out


def quantized_sum(
  tree: Any, axis_name: Hashable | tuple, fmt: Any = "int8", block_size: int = 256
) -> Any:
  r"""The sum of ``tree`` over the workers of ``axis_name``, each worker sending block codes.

  The floating leaves of worker :math:`w` are flattened and concatenated, in ``tree``'s leaf
  order, into one float32 vector :math:`x^{(w)}` of :math:`n` values (the floating leaves'
  total), which is :func:`encode`\ d once: a block may hold the end of one leaf and the start
  of the next, and only the last block is padded. The codes and scales of every worker are
  gathered (``jax.lax.all_gather``), and each worker computes

  .. math::

    \textstyle S = \left(\left(\hat x^{(0)} + \hat x^{(1)}\right) + \dots\right)
      + \hat x^{(N-1)}

  in float32, adding the decoded workers one after another in axis order, so that the result
  is bit-identical on every worker; each leaf's part is then cast to that leaf's dtype. The
  quantization error is each worker's own: about :math:`\sqrt N` (independent errors) to
  :math:`N` times one worker's, see the module's docstring for one value's bound. Leaves that
  are not floating point, and empty leaves, are summed with ``jax.lax.psum``.

  Args:
    tree: a pytree of arrays, the same structure and shapes on every worker.
    axis_name: the mapped axis (or tuple of axes) of the workers, bound by ``jax.shard_map``,
      ``jax.pmap`` or ``jax.vmap(axis_name=...)``.
    fmt: ``"int8"``, ``"float4_e2m1fn"`` or ``"e3m0"``, see :func:`encode`.
    block_size: values per scale, :math:`B`.

  Returns:
    ``tree``'s structure, shapes and dtypes: the sums.

  Collectives:
    Two ``all_gather`` over ``axis_name`` for the whole tree (the codes and the scales): each
    worker sends :func:`wire_bytes` ``(n, fmt, block_size)`` and receives :math:`N` times that
    (its own included), so the bytes received grow linearly with the workers while a ring
    ``psum`` stays near :math:`2\,n\,\text{itemsize}`. Per value and worker, gathering
    :math:`N(c + 4/B)` bytes beats a float32 ring all-reduce (:math:`\approx 8` bytes) up to
    :math:`N = 7` workers for ``int8`` and :math:`N = 15` for the 4-bit formats
    (:math:`B = 256`), and a bfloat16 one (:math:`\approx 4`) up to 3 and 7. Two operands
    however many leaves: a transport that frames each operand apart (gloo) adds its framing
    twice per exchange. Memory: the gathered codes, :math:`N` times one worker's, and one
    float32 copy of the floating leaves.

  Raises:
    ValueError: ``fmt`` not one of :data:`FORMATS`; ``block_size`` below 1, or odd for a
      4-bit format; an axis of ``axis_name`` not bound here (raised by JAX as ``NameError``).
    TypeError: ``block_size`` not an int.
  """
  fmt = _format("quantized_sum", fmt)
  block_size = _block_size("quantized_sum", block_size, fmt)
  leaves, treedef, others = _apart(tree, lambda x: jax.lax.psum(x, axis_name))
  flat = _concatenated(leaves)
  if flat is None:
    return treedef.unflatten(others)
  total = _gathered_sum(encode(flat, fmt, block_size), axis_name, fmt, flat.shape, flat.dtype)
  return treedef.unflatten(_split(total, leaves, others))


def quantized_sum_with_feedback(
  tree: Any, residual: Any, axis_name: Hashable | tuple, fmt: Any = "int8",
  block_size: int = 256,
) -> tuple[Any, Any]:
  r""":func:`quantized_sum` of ``tree`` plus each worker's ``residual``; returns the new residual.

  The floating leaves and their residuals are concatenated as in :func:`quantized_sum`, and the
  vector is sent as :func:`quantize_with_feedback` ``(x, r)`` sends it, :math:`t = x + r`
  encoded; the sums are those of :func:`quantized_sum` of the :math:`t`, and each leaf's new
  residual is its part of :math:`r' = t - \hat t`. Leaves that are not floating point, and
  empty leaves, are summed with ``jax.lax.psum`` and keep their residual.

  Args:
    tree: a pytree of arrays, the same structure and shapes on every worker.
    residual: ``tree``'s structure and shapes, ``float32``: this worker's error left over from
      the previous exchange (zeros at first).
    axis_name, fmt, block_size: as :func:`quantized_sum`.

  Returns:
    ``(sums, new_residual)``: the sums in ``tree``'s dtypes, and this worker's
    :math:`r' = t - \hat t` (``float32``).

  Collectives:
    Those of :func:`quantized_sum`.

  Raises:
    As :func:`quantized_sum`; ValueError: a leaf of ``residual`` not of its leaf's shape.
  """
  fmt = _format("quantized_sum_with_feedback", fmt)
  block_size = _block_size("quantized_sum_with_feedback", block_size, fmt)
  leaves, treedef, sums = _apart(tree, lambda x: jax.lax.psum(x, axis_name))
  sent = _sent_with_feedback("quantized_sum_with_feedback", leaves, treedef, residual, fmt,
                             block_size)
  if sent is None:
    return treedef.unflatten(sums), residual
  flat, packed, residuals, new_residual = sent
  total = _gathered_sum(packed, axis_name, fmt, flat.shape, flat.dtype)
  return (
    treedef.unflatten(_split(total, leaves, sums)),
    treedef.unflatten(_split(new_residual, leaves, residuals, jnp.float32)),
  )


def _sent_with_feedback(fn: str, leaves: list, treedef: Any, residual: Any, fmt: str,
                        block_size: int):
  """What one worker sends of ``leaves`` plus their ``residual`` (checked against the leaves'
  shapes): the concatenated float32 values, their :class:`Packed` codes, the residual's leaves
  and the new residual (flat, float32); ``None`` when no leaf is sent in blocks."""
  residuals = treedef.flatten_up_to(residual)
  for x, r in zip(leaves, residuals, strict=True):
    if jnp.shape(r) != x.shape:
      raise ValueError(
        f"`{fn}(residual=...)` must have the shapes of `tree`: a leaf of shape {x.shape} has a"
        f" residual of shape {jnp.shape(r)}."
      )
  flat = _concatenated(leaves)
  if flat is None:
    return None
  packed, new_residual = quantize_with_feedback(
    flat, _concatenated(leaves, residuals), fmt, block_size)
  return flat, packed, residuals, new_residual


@functools.partial(jax.tree_util.register_dataclass, data_fields=("packed", "others"),
                   meta_fields=("fmt", "treedef", "leaves"))
@dataclasses.dataclass(frozen=True)
class QuantizedTree:
  """One worker's tree as :func:`quantized_sum` sends it: its floating, non-empty leaves as one
  :class:`Packed` (codes and scales), the other leaves as they are, and (static) what
  :meth:`decode` needs to rebuild the tree. A pytree whose leaves are what crosses a wire:
  :func:`wire_bytes` of the floating leaves' total, plus the other leaves' bytes.

  Attributes:
    packed: the :class:`Packed` codes and scales of the floating, non-empty leaves,
      concatenated in leaf order; ``None`` when there are none.
    others: the other leaves, in their places (``None`` in the places of the packed ones).
    fmt: the format's name.
    treedef: the tree's structure.
    leaves: every leaf's shape and dtype (``jax.ShapeDtypeStruct``), in leaf order.
  """

  packed: Packed | None
  others: tuple
  fmt: str
  treedef: Any
  leaves: tuple

  def decode(self) -> Any:
    """The tree of :func:`quantized_terms`: the packed leaves' decoded values in ``float32``
    (the same bits: decoding is exact), the others as they are."""
    others = list(self.others)
    if self.packed is None:
      return self.treedef.unflatten(others)
    size = sum(x.size for x in self.leaves if _packable(x))
    flat = decode(self.packed, self.fmt, (size,), jnp.float32)
    return self.treedef.unflatten(_split(flat, list(self.leaves), others, jnp.float32))


def _quantized_tree(fn: str, tree: Any, residual: Any, fmt: Any, block_size: int
                    ) -> tuple[QuantizedTree, Any]:
  """:func:`quantized_payload`'s work, its errors naming ``fn``."""
  fmt = _format(fn, fmt)
  block_size = _block_size(fn, block_size, fmt)
  leaves, treedef, others = _apart(tree, lambda x: x)
  if residual is None:
    flat, new_residual = _concatenated(leaves), None
    packed = None if flat is None else encode(flat, fmt, block_size)
  else:
    sent = _sent_with_feedback(fn, leaves, treedef, residual, fmt, block_size)
    packed, new_residual = None, residual
    if sent is not None:
      _, packed, residuals, new = sent
      new_residual = treedef.unflatten(_split(new, leaves, residuals, jnp.float32))
  shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
  return QuantizedTree(packed, tuple(others), fmt, treedef, shapes), new_residual


def quantized_payload(
  tree: Any, residual: Any = None, fmt: Any = "int8", block_size: int = 256
) -> tuple[QuantizedTree, Any]:
  r"""What this worker sends of :func:`quantized_sum` (or of
  :func:`quantized_sum_with_feedback`), as it is sent: the :class:`Packed` codes and scales of
  its floating leaves, no collective. Its :meth:`QuantizedTree.decode` is
  :func:`quantized_terms`'s tree, bit for bit. The codes come from this worker's own encoding:
  encoding the decoded values again may give other scales (a block's largest code can fall
  below the grid's maximum), so a transport outside the program sends these.

  Args:
    tree, residual, fmt, block_size: as :func:`quantized_terms`.

  Returns:
    ``(wire, new_residual)``: a :class:`QuantizedTree`, and :math:`r' = t - \hat t` as
    :func:`quantized_terms` returns it.

  Collectives:
    None.

  Raises:
    As :func:`quantized_sum_with_feedback`.
  """
  return _quantized_tree("quantized_payload", tree, residual, fmt, block_size)


def quantized_terms(
  tree: Any, residual: Any = None, fmt: Any = "int8", block_size: int = 256
) -> tuple[Any, Any]:
  r"""This worker's term of :func:`quantized_sum` (or of :func:`quantized_sum_with_feedback`):
  the values the other workers decode from what it sends, computed where it is, no collective.

  The floating, non-empty leaves are concatenated and encoded as :func:`quantized_sum` does
  (plus ``residual`` as :func:`quantized_sum_with_feedback` does) and decoded here, in float32:
  :math:`\hat x^{(w)}`. The workers' terms added in float32 in axis order,
  :math:`((\hat x^{(0)} + \hat x^{(1)}) + \dots) + \hat x^{(N-1)}`, are bit for bit the
  sums those functions compute before casting to the leaves' dtypes. The other leaves are
  returned as they are (those functions ``psum`` them).

  Args:
    tree: a pytree of arrays.
    residual: ``None``, or ``tree``'s structure and shapes, ``float32``: this worker's error left
      over from the previous exchange.
    fmt, block_size: as :func:`quantized_sum`.

  Returns:
    ``(terms, new_residual)``: ``tree``'s structure and shapes, the sent leaves in ``float32``;
    and :math:`r' = t - \hat t` (``float32``; ``None`` when ``residual`` is ``None``).

  Collectives:
    None.

  Raises:
    As :func:`quantized_sum_with_feedback`.
  """
  wire, new_residual = _quantized_tree("quantized_terms", tree, residual, fmt, block_size)
  return wire.decode(), new_residual


def quantized_all_gather(
  tree: Any, axis_name: Hashable | tuple, fmt: Any = "int8", block_size: int = 256
) -> Any:
  r"""``jax.lax.all_gather`` of ``tree``'s leaves, each worker sending :func:`encode`\ d codes.

  Returns ``tree``'s structure with a new leading axis of the :math:`N` workers (axis order),
  each worker's leaf decoded to its dtype. The floating leaves are concatenated and encoded
  together as in :func:`quantized_sum`; leaves that are not floating point, and empty leaves,
  are gathered as they are.

  Collectives:
    Those of :func:`quantized_sum`: two ``all_gather`` for the floating leaves, each worker
    sending :func:`wire_bytes` of their total and receiving :math:`N` times that.
  """
  fmt = _format("quantized_all_gather", fmt)
  block_size = _block_size("quantized_all_gather", block_size, fmt)
  leaves, treedef, others = _apart(tree, lambda x: jax.lax.all_gather(x, axis_name))
  flat = _concatenated(leaves)
  if flat is None:
    return treedef.unflatten(others)
  gathered = jax.lax.all_gather(encode(flat, fmt, block_size), axis_name)
  values = jax.vmap(lambda c, s: _decode_blocks(Packed(c, s), fmt))(*gathered)
  values = values.reshape(values.shape[0], -1)[:, : flat.size]
  return treedef.unflatten(_split(values, leaves, others))
