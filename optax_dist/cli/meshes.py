"""The devices of a run, its meshes, and how a param is sharded on the global view.

Every worker is one device: with one replica, of a 1-D mesh over :data:`AXIS`; with ``replicas``
R > 1, of a ``(R, devices / R)`` mesh over ``(REPLICA, DATA)`` (worker ``i`` in replica
``i // (devices / R)``); on the global view (``fsdp`` K), of a ``(R, devices / (R K), K)`` mesh
over ``(REPLICA, DATA, FSDP)``. With ``exchange_device``, the last device of each process is left
out of the workers and forms the exchanges' mesh. The settings' rules (replicas dividing the
devices, K dividing a replica's) are :func:`optax_dist.cli.checks.check_settings`'; this module
checks only what JAX provides.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from optax_dist.cli.algorithms import AXIS, DATA, FSDP, REPLICA
from optax_dist.cli.config import Settings


def to_host(tree: Any) -> Any:
  """``tree``'s global arrays as NumPy arrays on every process (an all-gather across processes)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def worker_mesh(settings: Settings) -> jax.sharding.Mesh:
  """The workers' mesh: 1-D over :data:`AXIS`, or with ``replicas`` R > 1, ``(R, devices / R)``
  over ``(REPLICA, DATA)``, each replica's workers on consecutive devices (of one process when
  every process holds a replica)."""
  s = settings
  devices = training_devices(s.devices, s.exchange_device)
  if s.replicas == 1:
    return jax.make_mesh((s.devices,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices)
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  return jax.sharding.Mesh(np.array(devices).reshape(s.replicas, s.devices // s.replicas),
                           (REPLICA, DATA), axis_types=(AxisType.Auto, AxisType.Auto))


def global_mesh(settings: Settings) -> jax.sharding.Mesh:
  """The global view's mesh: ``(R, D, K)`` over ``(REPLICA, DATA, FSDP)`` with ``R`` the
  replicas, ``K`` the ``fsdp`` devices a replica's params are sharded over and ``D = devices /
  (R K)``; the devices in order (by process, then id), so device ``i`` is
  :func:`worker_mesh`'s worker ``i``."""
  s = settings
  devices = sorted(training_devices(s.devices), key=lambda d: (d.process_index, d.id))
  shape = (s.replicas, s.devices // s.replicas // s.fsdp, s.fsdp)
  return jax.sharding.Mesh(np.array(devices).reshape(shape), (REPLICA, DATA, FSDP),
                           axis_types=(AxisType.Auto,) * 3)


def training_devices(devices: int, exchange_device: bool = False) -> list[Any]:
  """The first ``devices`` of ``jax.devices()``; raises ``ValueError`` if that is not all there.

  With ``exchange_device``, the first ``devices / processes`` of each process's devices (by id),
  the last one of each being left to the exchanges (:func:`exchange_mesh`).
  """
  if exchange_device:
    return [d for per_process in process_devices(devices) for d in per_process[:-1]]
  available = jax.devices()
  if devices > len(available):
    raise ValueError(
      f"train(settings.devices={devices}) needs {devices} devices but JAX has {len(available)};"
      f' set jax.config.update("jax_num_cpu_devices", {devices}) before JAX initialises.')
  if jax.process_count() > 1 and devices != len(available):
    raise ValueError(
      f"train(settings.devices={devices}): with {jax.process_count()} processes every device is"
      f" a worker; pass devices={len(available)}, the number of devices of all processes.")
  return available[:devices]


def process_devices(devices: int) -> list[list[Any]]:
  """Each process's devices by id, ``devices / processes`` training devices and one more for the
  exchanges: raises ``ValueError`` if a process has another number."""
  processes = jax.process_count()
  per_process = devices // processes
  grouped = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
             for p in range(processes)]
  for p, local in enumerate(grouped):
    if devices % processes or len(local) != per_process + 1:
      raise ValueError(
        f"train(settings.devices={devices}, settings.exchange_device=True) needs"
        f" devices / processes = {devices / processes:g} training devices and one for the"
        f" exchanges in each of the {processes} processes, but process {p} has {len(local)};"
        f' set jax.config.update("jax_num_cpu_devices", {per_process + 1}) before JAX'
        " initialises.")
  return grouped


def exchange_mesh(devices: int) -> jax.sharding.Mesh:
  """The exchanges' mesh over :data:`REPLICA`: the last device of each process (by id), in
  process order (replica ``r`` is process ``r``'s)."""
  extra = [local[-1] for local in process_devices(devices)]
  return jax.sharding.Mesh(np.array(extra), (REPLICA,), axis_types=(AxisType.Auto,))


def fsdp_spec(shape: tuple[int, ...], k: int, d: int = 1) -> P:
  """The spec of a param of ``shape`` inside one replica: :data:`FSDP` on its largest dimension
  divisible by ``k`` (the first of equal ones), ``P()`` (whole on every device) if none is.

  With ``d > 1`` (the optimizer state's layout over a replica of ``d`` data groups of ``k``
  devices): ``(FSDP, DATA)`` on its largest dimension divisible by ``k * d``, so that each of the
  replica's devices holds a distinct ``1 / (k d)`` of the leaf, inside the ``1 / k`` of the param
  it holds; the param's spec if no dimension is.
  """
  layouts = [(k * d, (FSDP, DATA))] if d > 1 else []
  for n, axes in [*layouts, (k, FSDP)]:
    divisible = [i for i, size in enumerate(shape) if size % n == 0]
    if divisible:
      axis = max(divisible, key=lambda i: (shape[i], -i))
      return P(*(axes if i == axis else None for i in range(len(shape))))
  return P()
