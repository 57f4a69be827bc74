"""The outer step of the DiLoCo family: one optimizer step on the workers' mean pseudo-gradient."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import optax

from optax_dist import _axis


def default_outer() -> optax.GradientTransformation:
  """The DiLoCo paper's outer optimizer: Nesterov momentum SGD, learning rate 0.7, momentum 0.9."""
  return optax.sgd(0.7, momentum=0.9, nesterov=True)


def local_pseudo_gradient(anchor: Any, new_params: Any) -> Any:
  """This worker's pseudo-gradient :math:`\\theta - x'`, in the anchor's dtypes."""
  return jax.tree.map(lambda a, x: a - x.astype(a.dtype), anchor, new_params)


def pseudo_gradient(
  anchor: Any,
  new_params: Any,
  *,
  axis_name: Hashable | None,
  num_workers: int,
  comm_dtype: Any = None,
  comm_block_size: int = 256,
  residual: Any = None,
  slice_axis: Hashable | None = None,
) -> tuple[Any, Any]:
  r"""The workers' mean pseudo-gradient :math:`\Delta = \frac{1}{N}\sum_j (\theta - x'_j)`.

  Each :math:`\theta - x'_j` is computed in the anchor's dtype and all-reduced in
  ``comm_dtype`` (a floating dtype, or a quantized format's name sent in blocks of
  ``comm_block_size`` values: :func:`optax_dist._axis.psum`). With error feedback
  (``residual``, float32, the anchor's tree and shapes; a quantized ``comm_dtype``) each worker
  sends :math:`\theta - x'_j + r_j` quantized and keeps what quantization dropped,
  :math:`r_j' = \theta - x'_j + r_j - Q(\theta - x'_j + r_j)`, for the next sync.
  ``axis_name=None`` means one worker: :math:`\Delta = \theta - x'`, nothing quantized.
  ``slice_axis``: each device of that axis exchanges only its slice (:func:`_axis.sliced`).

  Returns:
    ``(delta, new_residual)``: :math:`\Delta` in the anchor's dtypes, and :math:`r'`
    (``residual`` itself when it is ``None`` or nothing is exchanged).
  """
  delta = local_pseudo_gradient(anchor, new_params)
  if axis_name is None:
    return delta, residual
  if residual is None:
    mean = _axis.sliced(
      lambda d: _axis.worker_mean(d, axis_name, num_workers, comm_dtype, comm_block_size),
      delta, slice_axis,
    )
    return mean, None
  return _axis.sliced(
    lambda pair: _axis.worker_mean_with_feedback(
      *pair, axis_name, num_workers, comm_dtype, comm_block_size),
    (delta, residual), slice_axis,
  )


def outer_step(
  outer: optax.GradientTransformation, anchor: Any, outer_state: optax.OptState, delta: Any
) -> tuple[Any, optax.OptState]:
  """One step of ``outer`` on the pseudo-gradient ``delta`` from ``anchor``.

  Returns:
    The new anchor and outer state, with the dtypes of the old ones.
  """
  steps, new_outer_state = outer.update(delta, outer_state, anchor)
  new_anchor = _axis.keep_dtypes(optax.apply_updates(anchor, steps), anchor)
  return new_anchor, _axis.keep_dtypes(new_outer_state, outer_state)
