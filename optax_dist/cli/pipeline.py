"""The input pipeline: each worker's shard of the training set, its minibatches, the delays.

Everything here is a pure function of the seed and the step, computed on the host with NumPy:
the step is compiled once, a run is reproducible from its seed, and a run resumed at a step draws
what an uninterrupted run draws.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np


def shard_examples(split: dict[str, np.ndarray], workers: int) -> dict[str, np.ndarray]:
  """``split``'s leaves as ``[workers, M, ...]``: worker ``i`` owns the ``i``-th of equal shards.

  ``M`` is the number of examples divided by ``workers``; the remainder is left out.
  """
  n_local = len(next(iter(split.values()))) // workers
  return {key: value[: n_local * workers].reshape((workers, n_local) + value.shape[1:])
          for key, value in split.items()}


@functools.lru_cache(maxsize=2)
def _epoch_orders(seed: int, workers: int, n_local: int, epoch: int) -> np.ndarray:
  """The ``(workers, n_local)`` permutations of each worker's shard for ``epoch``."""
  return np.stack([
    np.random.default_rng([seed, 2, worker, epoch]).permutation(n_local)
    for worker in range(workers)
  ]).astype(np.int32)


def minibatch(seed: int, workers: int, n_local: int, batch_size: int, step: int) -> np.ndarray:
  """The ``(workers, batch_size)`` int32 indices into each worker's shard for step ``step + 1``.

  Every epoch, each worker takes a fresh permutation of its shard (drawn from
  ``(seed, worker, epoch)``) and walks through it ``batch_size`` at a time; the remainder of
  each permutation is skipped.
  """
  per_epoch = n_local // batch_size
  epoch, start = divmod(step, per_epoch)
  start *= batch_size
  return _epoch_orders(seed, workers, n_local, epoch)[:, start:start + batch_size]


def delays(seed: int, steps: int, depth: int) -> np.ndarray:
  """``drop_stale_gradients``' delay of each step, ``0`` to ``depth - 1``, drawn from ``seed``."""
  return np.random.default_rng([seed, 1]).integers(0, depth, size=steps, dtype=np.int32)


def put(x: Any, sharding: Any) -> Any:
  """The global array of ``sharding`` whose value is the host array ``x``.

  Every process passes the same ``x`` and contributes the shards on its own devices, so this
  works in one process and across ``jax.distributed`` processes alike.
  """
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
