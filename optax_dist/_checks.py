"""Argument checks shared by every transformation, with messages that name the call site, the
argument, the value received and the constraint.

Hyperparameters that ``optax.inject_hyperparams`` may pass as arrays are checked only when
concrete (a traced value is skipped).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_dist import _quantize

NO_PARAMS_MSG = (
  "`{fn}` needs the current parameters: call `update(updates, state, params)` with"
  " `params` given (got `params=None`)."
)



def concrete(value: Any) -> Any:
  """``value`` as a Python/NumPy scalar, or ``None`` if it is ``None`` or a tracer."""
  if value is None or isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, (np.ndarray, jax.Array)):
    if np.ndim(value) != 0:
      return None
    return np.asarray(value).item()
  return value


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive_int(fn: str, name: str, value: Any) -> None:
  """Raise unless ``value`` is a positive int (skipped for traced values)."""
  if isinstance(value, jax.core.Tracer):
    return
  v = concrete(value)
  if isinstance(v, bool) or not isinstance(v, numbers.Integral):
    raise TypeError(f"`{fn}({name}=...)` must be a positive int, got {value!r}.")
  if v < 1:
    raise ValueError(f"`{fn}({name}=...)` must be a positive int, got {v}.")


def check_int(fn: str, name: str, value: Any) -> None:
  """Raise unless ``value`` is an int (skipped for traced values)."""
  if isinstance(value, jax.core.Tracer):
    return
  v = concrete(value)
  if isinstance(v, bool) or not isinstance(v, numbers.Integral):
    raise TypeError(f"`{fn}({name}=...)` must be an int, got {value!r}.")


def check_non_negative_int(fn: str, name: str, value: Any) -> None:
  """Raise unless ``value`` is an int >= 0 (skipped for traced values)."""
  check_int(fn, name, value)
  v = concrete(value)
  if v is not None and v < 0:
    raise ValueError(f"`{fn}({name}=...)` must be an int >= 0, got {v}.")


def check_number(
  fn: str,
  name: str,
  value: Any,
  *,
  lower: float,
  upper: float | None = None,
  lower_open: bool = False,
  constraint: str,
) -> None:
  """Raise unless ``value`` is a real number in the given range (skipped for traced values)."""
  if isinstance(value, jax.core.Tracer):
    return
  v = concrete(value)
  if not _is_number(v):
    raise TypeError(f"`{fn}({name}=...)` must be a real number {constraint}, got {value!r}.")
  too_low = v <= lower if lower_open else v < lower
  too_high = upper is not None and v > upper
  if too_low or too_high or math.isnan(v):
    raise ValueError(f"`{fn}({name}=...)` must be {constraint}, got {v}.")


def check_floating_dtype(fn: str, name: str, dtype: Any) -> np.dtype | None:
  """``dtype`` as a NumPy dtype (``None`` stays ``None``); ``TypeError`` unless a floating
  format with a sign and a zero (the rule of :func:`check_comm_dtype`'s cast formats)."""
  if dtype is None:
    return None
  try:
    resolved = jnp.dtype(dtype)
  except (TypeError, ValueError):
    resolved = None
  if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
    raise TypeError(
      f"`{fn}({name}=...)` must be None or a floating dtype such as jnp.bfloat16, got {dtype!r}."
    )
  _check_signed_with_zero(fn, name, resolved)
  return resolved


QUANTIZED_FORMATS = _quantize.FORMATS
"""The block-quantized exchange formats a ``comm_dtype`` may name."""


BLOCK_FORMAT_TAKERS = "diloco, streaming_diloco, local_sgd, elastic_average and agn"
"""The transformations that take a block-quantized ``comm_dtype`` (their exchange is periodic,
with error feedback available); ``tower``, ``all_reduce`` and ``accumulate_then_reduce`` do not."""


def _resolved_comm_dtype(comm_dtype: Any) -> np.dtype | str | None:
  """A quantized format's name, a NumPy dtype, or ``None`` if ``comm_dtype`` names no dtype."""
  if isinstance(comm_dtype, str) and comm_dtype in QUANTIZED_FORMATS:
    return comm_dtype
  if isinstance(comm_dtype, (jax.Array, np.ndarray)):
    comm_dtype = comm_dtype.dtype  # inject_hyperparams calls jnp.int8 as if it were a schedule
  try:
    resolved = jnp.dtype(comm_dtype)
  except (TypeError, ValueError):
    return None
  return resolved.name if resolved.name in QUANTIZED_FORMATS else resolved


def check_comm_dtype(
  fn: str, comm_dtype: Any, name: str = "comm_dtype", *, block_formats: bool = True
) -> np.dtype | str | None:
  """``comm_dtype`` resolved: ``None``, a floating NumPy dtype, or a quantized format's name.

  ``jnp.int8`` and ``jnp.float4_e2m1fn`` (or their names) and ``"e3m0"`` name the block-quantized
  formats of ``optax_dist._quantize``: they resolve to the format's name, which
  :func:`optax_dist._axis.psum` sends to ``quantized_sum`` (with ``block_formats=False``, for the
  exchanges of every step's gradients, they are refused). Other floating dtypes resolve to
  themselves (a cast before the collective); they must represent -1 and 0 (a sign and a zero:
  the values exchanged are differences of either sign), which e.g. ``jnp.float8_e8m0fnu`` cannot.
  An array stands for its dtype: ``optax.inject_hyperparams`` calls a callable hyperparameter
  such as ``jnp.int8`` and passes the result.

  Raises:
    TypeError: ``comm_dtype`` is none of these, naming the choices; a block-quantized format
      with ``block_formats=False``, naming the transformations that take it; a floating dtype
      without a sign or without a zero.
  """
  if comm_dtype is None:
    return None
  resolved = _resolved_comm_dtype(comm_dtype)
  if isinstance(resolved, str) and not block_formats:
    raise TypeError(
      f"`{fn}({name}=...)` must be None or a floating dtype such as jnp.bfloat16, got"
      f" {resolved!r}: a block-quantized format (jnp.int8, jnp.float4_e2m1fn or \"e3m0\") would"
      " round every step's gradients with no feedback of the error; it is taken by"
      f" {BLOCK_FORMAT_TAKERS} only."
    )
  if isinstance(resolved, str):
    return resolved
  if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
    choices = (
      "None, a floating dtype such as jnp.bfloat16, or a quantized format: jnp.int8 (or"
      " \"int8\"), jnp.float4_e2m1fn (or \"float4_e2m1fn\") or \"e3m0\";"
      if block_formats else "None or a floating dtype such as jnp.bfloat16,"
    )
    raise TypeError(f"`{fn}({name}=...)` must be {choices} got {comm_dtype!r}.")
  _check_signed_with_zero(fn, name, resolved)
  return resolved


def _check_signed_with_zero(fn: str, name: str, dtype: np.dtype) -> None:
  """Raise unless the floating ``dtype`` represents negative values and zero."""
  lacks = [what for what, ok in (("sign", float(jnp.finfo(dtype).min) < 0),
                                 ("zero", float(np.zeros((), dtype)) == 0)) if not ok]
  if lacks:
    raise TypeError(
      f"`{fn}({name}=...)` must be a format with a sign and a zero (the values it carries,"
      f" params and differences of them, take either sign), got {dtype.name}, which has no"
      f" {' and no '.join(lacks)}."
    )


def check_comm_block_size(fn: str, block_size: Any, comm_dtype: Any) -> int | None:
  """``comm_block_size`` for ``comm_dtype`` (resolved by :func:`check_comm_dtype`): ``None``
  unless the format is block-quantized; for a block-quantized one, an int (``None``: 256),
  positive, and even for a 4-bit format, whose codes are packed two per byte.

  The default is ``None`` rather than 256 so that ``optax.inject_hyperparams``, which turns every
  int argument into an array, leaves it alone: the block size fixes the shapes of the codes and
  cannot be traced.

  Raises:
    TypeError: not an int, or traced (with ``optax.inject_hyperparams``: pass
      ``static_args=("comm_block_size",)``).
    ValueError: given (not ``None``) with a ``comm_dtype`` that is not block-quantized; below 1,
      or odd with ``comm_dtype`` ``"float4_e2m1fn"`` or ``"e3m0"``.
  """
  if not isinstance(comm_dtype, str):
    if block_size is not None:
      raise ValueError(
        f"`{fn}(comm_block_size=...)` sets the blocks of a block-quantized comm_dtype (jnp.int8,"
        f" jnp.float4_e2m1fn or \"e3m0\") and must be None with comm_dtype={comm_dtype!r}, got"
        f" {block_size!r}."
      )
    return None
  if block_size is None:
    return 256
  if isinstance(block_size, jax.core.Tracer):
    raise TypeError(
      f"`{fn}(comm_block_size=...)` must be a Python int, fixed at trace time (it sets the"
      f" shapes of the codes), got a traced value {block_size!r}. With optax.inject_hyperparams,"
      " pass static_args=(\"comm_block_size\",)."
    )
  value = concrete(block_size)
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"`{fn}(comm_block_size=...)` must be a positive int, got {block_size!r}.")
  if value < 1:
    raise ValueError(f"`{fn}(comm_block_size=...)` must be a positive int, got {value}.")
  if comm_dtype in ("float4_e2m1fn", "e3m0") and value % 2:
    raise ValueError(
      f"`{fn}(comm_block_size=...)` must be even with comm_dtype={comm_dtype!r}, which packs two"
      f" 4-bit codes per byte; got {value}. Use e.g. {value + 1}."
    )
  return int(value)


def check_error_feedback(fn: str, error_feedback: Any, comm_dtype: Any) -> bool:
  """``error_feedback`` as a bool; ``True`` needs a quantized ``comm_dtype`` (resolved by
  :func:`check_comm_dtype`).

  Raises:
    TypeError: not a bool.
    ValueError: ``True`` with ``comm_dtype`` not one of the quantized formats.
  """
  if not isinstance(error_feedback, (bool, np.bool_)):
    raise TypeError(f"`{fn}(error_feedback=...)` must be a bool, got {error_feedback!r}.")
  if error_feedback and comm_dtype not in QUANTIZED_FORMATS:
    raise ValueError(
      f"`{fn}(error_feedback=True)` needs a quantized comm_dtype (jnp.int8, jnp.float4_e2m1fn or"
      f" \"e3m0\"), got comm_dtype={comm_dtype!r}: only a quantized exchange drops a part worth"
      " feeding back. Pass one, or error_feedback=False."
    )
  return bool(error_feedback)


def check_choice(fn: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
  """Raise unless ``value`` is one of ``choices``."""
  if value not in choices:
    options = ", ".join(repr(c) for c in choices)
    raise ValueError(f"`{fn}({name}=...)` must be one of {options}, got {value!r}.")


def check_transformation(fn: str, value: Any, name: str = "inner") -> None:
  """Raise unless ``value`` (the argument ``name``) looks like an optax gradient transformation."""
  if not (callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))):
    example = ", e.g. optax.sgd(0.7, momentum=0.9, nesterov=True)" if name == "outer" else ""
    raise TypeError(
      f"`{fn}({name}=...)` must be an optax GradientTransformation (with `init` and"
      f" `update`){example}, got {type(value).__name__}."
    )


def require_params(fn: str, params: Any) -> None:
  """Raise ``ValueError`` if ``params`` is ``None``."""
  if params is None:
    raise ValueError(NO_PARAMS_MSG.format(fn=fn))


def check_tree_matches(fn: str, updates: Any, reference: Any, what: str) -> None:
  """Raise ``ValueError`` unless ``updates`` has the tree structure and leaf shapes of
  ``reference``, naming the first leaf whose shape differs and both shapes."""
  got, want = jax.tree.structure(updates), jax.tree.structure(reference)
  if got != want:
    raise ValueError(
      f"`{fn}`: `updates` must have the tree structure of the {what}; got {got}, expected {want}."
    )
  for (path, u), r in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(reference)):
    if np.shape(u) != np.shape(r):
      raise ValueError(
        f"`{fn}`: the update at {jax.tree_util.keystr(path) or '<root>'} has shape"
        f" {np.shape(u)} but the {what} leaf there has shape {np.shape(r)}; updates and params"
        " must have the same shapes (inside a mapped step, the per-worker shapes)."
      )


def check_floating(fn: str, params: Any) -> None:
  """Raise ``TypeError`` naming the path of the first non-floating leaf of ``params``."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise TypeError(
        f"`{fn}` averages parameters and needs floating-point leaves; the leaf at"
        f" {jax.tree_util.keystr(path) or '<root>'} has dtype {jnp.result_type(leaf)}."
      )



def check_num_workers(fn: str, num_workers: Any, axis_name: Hashable | tuple | None) -> None:
  """Raise unless ``num_workers`` is ``None`` or a positive int usable with ``axis_name``."""
  if num_workers is None:
    return
  check_positive_int(fn, "num_workers", num_workers)
  given = concrete(num_workers)
  if axis_name is None and given is not None and given > 1:
    raise ValueError(
      f"`{fn}(num_workers={given})` needs `axis_name`: without a mapped axis the workers"
      " cannot communicate. Pass the name of the axis your step is mapped over."
    )
