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
  """``dtype`` as a NumPy dtype (``None`` stays ``None``); ``TypeError`` unless floating."""
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
  return resolved


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
