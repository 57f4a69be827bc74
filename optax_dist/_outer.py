"""The outer step of the DiLoCo family: one optimizer step on the workers' mean pseudo-gradient."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_dist import _axis, _exchange


def default_outer() -> optax.GradientTransformation:
  """The DiLoCo paper's outer optimizer: Nesterov momentum SGD, learning rate 0.7, momentum 0.9."""
  return optax.sgd(0.7, momentum=0.9, nesterov=True)


def local_pseudo_gradient(anchor: Any, new_params: Any) -> Any:
  """This worker's pseudo-gradient :math:`\\theta - x'`, in the anchor's dtypes."""
  return jax.tree.map(lambda a, x: a - x.astype(a.dtype), anchor, new_params)


def payload(
  exchange: _exchange.Exchange, anchor: Any, new_params: Any, residual: Any = None
) -> tuple[Any, Any]:
  """This worker's term of :func:`pseudo_gradient`'s mean, :math:`Q(\\theta - x'_i + r_i)`, and
  its new residual (:meth:`~optax_dist.Exchange.payload`): no collective across the workers."""
  return exchange.payload(local_pseudo_gradient(anchor, new_params), residual)


def pseudo_gradient(
  exchange: _exchange.Exchange, anchor: Any, new_params: Any, residual: Any = None
) -> tuple[Any, Any]:
  r"""The workers' mean pseudo-gradient :math:`\Delta = \frac{1}{N}\sum_j (\theta - x'_j)`.

  Each :math:`\theta - x'_j` is computed in the anchor's dtype and averaged by ``exchange``
  (:meth:`~optax_dist.Exchange.mean`, in its wire format and slices). With error feedback
  (``residual``, float32, the anchor's tree and shapes; a quantized wire format) each worker
  sends :math:`\theta - x'_j + r_j` quantized and keeps what quantization dropped,
  :math:`r_j' = \theta - x'_j + r_j - Q(\theta - x'_j + r_j)`, for the next sync.
  One worker (``axis_name=None``): :math:`\Delta = \theta - x'`, nothing quantized.

  Returns:
    ``(delta, new_residual)``: :math:`\Delta` in the anchor's dtypes, and :math:`r'`
    (``residual`` itself when it is ``None`` or nothing is exchanged).
  """
  delta = local_pseudo_gradient(anchor, new_params)
  if residual is None:
    return exchange.mean(delta), None
  return exchange.mean_with_feedback(delta, residual)


def outer_step(
  outer: optax.GradientTransformation, anchor: Any, outer_state: optax.OptState, delta: Any
) -> tuple[Any, optax.OptState]:
  """One step of ``outer`` on the pseudo-gradient ``delta`` (cast to the anchor's dtypes) from
  ``anchor``.

  Returns:
    The new anchor and outer state, with the dtypes of the old ones.
  """
  delta = jax.tree.map(lambda a, d: jnp.asarray(d).astype(a.dtype), anchor, delta)
  steps, new_outer_state = outer.update(delta, outer_state, anchor)
  new_anchor = _axis.keep_dtypes(optax.apply_updates(anchor, steps), anchor)
  return new_anchor, _axis.keep_dtypes(new_outer_state, outer_state)
