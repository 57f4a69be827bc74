r"""Asynchronous parameter-server training, emulated deterministically on one device.

JAX collectives are synchronous: every worker of a mapped axis takes its step at the same time.
TF 1.x ran its distributed optimizers *asynchronously*: each worker read the parameter server,
computed, and committed later, while others committed in between. This module reproduces that
with a deterministic event simulation:

1. **Timing** (host, NumPy). A :class:`Cluster` draws every worker's compute times from a seeded
   distribution (constant, uniform jitter, or some workers ``slowdown`` × slower) plus an optional
   communication latency, and :meth:`Cluster.schedule` turns them into a :class:`Schedule`: which
   worker finishes a step when, in time order, with worker restarts, workers that leave for
   good and workers that join mid-run. :func:`explicit_schedule` builds one from a list instead
   (e.g. TF's unit tests' orders).
2. **Numerics** (device). :func:`emulate` runs the schedule as one ``jax.lax.scan`` over events
   inside ``jax.jit``: no Python work per event. Each worker holds one snapshot of the params
   (its read of the server, or its local params and, for DiLoCo, the anchor it read); no
   per-event copy is kept.

The protocols:

* :func:`downpour` (asynchronous SGD, "Downpour"): a worker reads the server params and the
  server's ``global_step``, computes gradients on its own minibatch at those params, and commits
  them later to the server transformation with ``grad_step=`` the step it read, then reads again.
  With ``optax_dist.drop_stale_gradients`` as the server transformation, stale commits are
  dropped exactly as TF's ``DropStaleGradientOptimizer`` drops them.
* :func:`elastic_average` (asynchronous EASGD, TF's ``ElasticAverageOptimizer``): each worker
  trains its own params with ``inner``; on every ``communication_period``-th local step it
  exchanges with the *current* center, one worker at a time in event order:
  :math:`d = \alpha (x' - \tilde{x})`, :math:`x \leftarrow x' - d`,
  :math:`\tilde{x} \leftarrow \tilde{x} + d`.
* :func:`agn` (TF's ``AGNOptimizer``): each worker trains locally and, every
  ``communication_period`` steps, commits its accumulated gradient divided by the period to the
  center (one ``inner`` step with the one shared center optimizer state), then pulls the center.
* :func:`diloco` (asynchronous DiLoCo, Liu et al. 2024): each worker takes ``sync_period`` (H)
  local steps from the anchor it read, commits its pseudo-gradient
  :math:`\hat\theta - x'` to the server's outer optimizer, which steps from the *current*
  anchor, one commit at a time, then reads the new anchor. :func:`optax_dist.delayed_nesterov`
  is the paper's outer optimizer for stale pseudo-gradients. ``dylu=True`` gives each worker
  its own number of local steps, proportional to its speed (the paper's dynamic local updates).

The per-worker numerics are the library's own transformations with ``axis_name=None``
(:func:`optax_dist.elastic_average`, :func:`optax_dist.agn`), called with the current center
swapped into their state; only the event order is the emulator's. DiLoCo's workers step with
``inner`` and the server with ``outer``, as :func:`optax_dist.diloco` does with one worker.

The subpackage's modules: :mod:`~optax_dist.async_emulator.timing` (:class:`Cluster`,
:class:`Schedule`, :func:`explicit_schedule`), :mod:`~optax_dist.async_emulator.protocols`
(:func:`downpour`, :func:`elastic_average`, :func:`agn`, :func:`diloco`,
:func:`dylu_sync_periods`),
:mod:`~optax_dist.async_emulator.emulation` (:func:`emulate`, :class:`AsyncResult`) and
:mod:`~optax_dist.async_emulator.simulators` (each protocol's event on the device). Import the
names from ``optax_dist.async_emulator``.

Example:

  >>> import jax.numpy as jnp, optax, optax_dist
  >>> from optax_dist import async_emulator as ae
  >>> def loss_fn(params, batch):  # least squares on each worker's shard
  ...   return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)
  >>> x = jnp.linspace(-1.0, 1.0, 64).reshape(4, 16, 1)  # 4 workers x 16 examples
  >>> data = {"x": x, "y": 3.0 * x[..., 0]}
  >>> cluster = ae.Cluster(num_workers=4, jitter=0.2, seed=0)
  >>> result = ae.emulate(
  ...     ae.downpour(optax_dist.drop_stale_gradients(optax.sgd(0.2), max_staleness=3)),
  ...     loss_fn, jnp.zeros(1), data, cluster.schedule(num_events=200), batch_size=8)
  >>> result.num_accepted + result.num_dropped
  200
  >>> bool(abs(result.params[0] - 3.0) < 1e-2)
  True
"""

import warnings

from optax_dist.async_emulator.emulation import AsyncResult, emulate
from optax_dist.async_emulator.protocols import (
  AGN,
  DiLoCo,
  Downpour,
  ElasticAverage,
  Protocol,
  agn,
  diloco,
  downpour,
  dylu_sync_periods,
  elastic_average,
)
from optax_dist.async_emulator.timing import Cluster, Schedule, explicit_schedule

__all__ = (
  "AGN",
  "AsyncResult",
  "Cluster",
  "DiLoCo",
  "Downpour",
  "ElasticAverage",
  "Protocol",
  "Schedule",
  "agn",
  "diloco",
  "downpour",
  "dylu_sync_periods",
  "elastic_average",
  "emulate",
  "explicit_schedule",
)

_MOVED = ("DelayedNesterovState", "delayed_nesterov")
"""Names that moved to :mod:`optax_dist`; still reachable here, with a ``DeprecationWarning``."""


def __getattr__(name):
  if name in _MOVED:
    import optax_dist

    warnings.warn(
      f"`optax_dist.async_emulator.{name}` is deprecated: use `optax_dist.{name}` (the same"
      " object).", DeprecationWarning, stacklevel=2)
    return getattr(optax_dist, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
