"""The command's only uses of the library's private modules, one function each.

:class:`optax_dist.cli.exchange_device.ExchangeDeviceRun` exchanges ``streaming_diloco``'s
fragments outside the step, so it needs three pieces of the library's in-step exchange: how a
``comm_dtype`` resolves, the replicas' mean in that format, and the leaves of each fragment.
"""

from __future__ import annotations

from typing import Any

from optax_dist import _axis, _checks
from optax_dist._streaming_diloco import assign_fragments


def resolve_comm_dtype(comm_dtype: str | None) -> Any:
  """``comm_dtype`` as the library resolves it (``None``, a NumPy dtype or a quantized format)."""
  return _checks.check_comm_dtype("train", comm_dtype)


def replica_mean(x: Any, axis: str, size: int, comm_dtype: Any) -> Any:
  """The mean of ``x`` over the ``size`` members of the mesh axis ``axis``: the library's
  ``psum`` in ``comm_dtype`` (resolved by :func:`resolve_comm_dtype`), divided by ``size`` in
  ``x``'s dtype."""
  return _axis.worker_mean(x, axis, size, comm_dtype)


def fragment_ids(params: Any, num_fragments: int) -> tuple[int, ...]:
  """The fragment of each leaf of ``params`` (arrays or shapes) under ``streaming_diloco``'s
  ``fragments="balanced"``, in ``jax.tree.leaves`` order."""
  return assign_fragments("streaming_diloco", params, num_fragments, "balanced")
