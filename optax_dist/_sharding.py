"""The shardings of a state stacked over replicas, from the shardings of one replica's params."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from optax_dist import _checks

_FN = "state_shardings"


def _spec_of(path: str, sharding: Any) -> tuple[PartitionSpec, Any]:
  """``(spec, mesh)`` of one params leaf's sharding (``mesh`` is ``None`` for a bare spec)."""
  if isinstance(sharding, NamedSharding):
    return sharding.spec, sharding.mesh
  if isinstance(sharding, PartitionSpec):
    return sharding, None
  raise TypeError(
    f"`{_FN}`: the sharding of params{path} must be a jax.sharding.NamedSharding or a"
    f" PartitionSpec, got {sharding!r}. Pass `shardings=` (a tree of either, like `params`), or"
    " params whose leaves carry a NamedSharding (`.sharding`)."
  )


def _mentions(spec: PartitionSpec, axis: Hashable) -> bool:
  for entry in spec:
    if entry == axis or (isinstance(entry, tuple) and axis in entry):
      return True
  return False


def _is_suffix(path: tuple, of: tuple) -> bool:
  return len(path) <= len(of) and tuple(of[len(of) - len(path):]) == tuple(path)


def state_shardings(
  tx: optax.GradientTransformation,
  params: optax.Params,
  shardings: Any = None,
  *,
  replica_axis: Hashable = "replica",
) -> Any:
  """The shardings of ``jax.vmap(tx.init)``'s state, stacked over replicas on ``replica_axis``.

  In the global view every replica's params and optimizer state are stacked on axis 0, which is
  sharded over the mesh axis ``replica_axis``; inside a replica each leaf is sharded as the
  model's own params are (FSDP, tensor parallelism). Given one replica's params and their
  shardings, this returns the state's: a leaf shaped like a param (a moment, DiLoCo's anchor,
  the outer optimizer's momentum, EASGD's center) gets that param's spec with ``replica_axis``
  prepended, :math:`P(\\mathrm{replica}, *\\mathrm{spec})`; every other leaf (step counters,
  scalars) gets :math:`P(\\mathrm{replica})`. A state leaf is matched to the param whose key path
  ends its own path (``.inner_state[0].mu['w']`` to ``['w']``; the longest such path when
  several do) and whose shape it has, else to the params of its shape if they all share one
  spec (a leaf whose shape params of several specs have gets :math:`P(\\mathrm{replica})`).
  ``optax.MaskedNode`` entries (``streaming_diloco``'s per-fragment outer states) hold no array
  and stay as they are.

  Pass the result as ``out_shardings`` of the jitted ``jax.vmap(tx.init)`` to build a state in
  place, or as the shardings of ``jax.eval_shape``'s abstract state to restore a checkpoint onto
  the mesh. The stacked params themselves are sharded ``P(replica_axis, *spec)``.

  Args:
    tx: the transformation whose state is placed (any optax transformation, this library's or
      not, nested in ``optax.chain`` or other wrappers).
    params: one replica's params, not stacked: arrays or ``jax.ShapeDtypeStruct`` (only shapes
      and dtypes are read; ``tx.init`` is evaluated abstractly).
    shardings: a tree like ``params`` of ``jax.sharding.NamedSharding`` (all on one mesh) or of
      ``PartitionSpec``, one replica's layout, without ``replica_axis``. Default: each leaf's
      ``.sharding`` (a ``NamedSharding``).
    replica_axis: the mesh axis over which the replicas are stacked (``vmap``'s
      ``spmd_axis_name``, usually also the transformations' ``axis_name``).

  Returns:
    A tree with the structure of ``jax.eval_shape(jax.vmap(tx.init), stacked_params)``, of
    ``NamedSharding`` on the params' mesh if ``shardings`` are ``NamedSharding``, else of
    ``PartitionSpec``.

  Shapes:
    A state leaf of shape ``(R, *s)`` for a param of shape ``s`` gets that param's spec after
    ``replica_axis``; a counter ``(R,)`` gets ``P(replica_axis)``, its R replicas' values on
    their own devices.

  Collectives:
    None: a function of shapes and specs, evaluated without running ``tx.init``.

  Raises:
    TypeError: ``tx`` is not a transformation; a sharding neither a ``NamedSharding`` nor a
      ``PartitionSpec``.
    ValueError: ``shardings`` not shaped like ``params``; a param's spec already naming
      ``replica_axis``; ``NamedSharding`` on several meshes or on a mesh without
      ``replica_axis``.

  Examples:
    Adam's moments sharded like the params within each of two replicas, its count over the
    replicas:

    >>> import jax, jax.numpy as jnp, optax, optax_dist
    >>> from jax.sharding import PartitionSpec as P
    >>> params = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    >>> specs = optax_dist.state_shardings(optax.adam(1e-3), params, {"w": P("fsdp", None)})
    >>> specs[0].count, specs[0].mu["w"]
    (P('replica',), P('replica', 'fsdp', None))

  References:
    MaxText ``diloco.py`` (the DiLoCo state stacked over a ``diloco`` mesh axis, sharded like
    the params inside each replica); JAX, ``jax.vmap``'s ``spmd_axis_name`` and
    ``jax.jit``'s ``out_shardings``.
  """
  _checks.check_transformation(_FN, tx)
  if shardings is None:
    shardings = jax.tree.map(lambda p: getattr(p, "sharding", None), params)
  param_leaves = jax.tree_util.tree_leaves_with_path(params)
  sharding_leaves = jax.tree_util.tree_leaves(
    shardings, is_leaf=lambda s: isinstance(s, (NamedSharding, PartitionSpec)) or s is None
  )
  if len(sharding_leaves) != len(param_leaves):
    raise ValueError(
      f"`{_FN}(shardings=...)` must hold one sharding per leaf of `params`, got"
      f" {len(sharding_leaves)} for {len(param_leaves)} leaves."
    )
  meshes, by_path = [], []
  for (path, leaf), sharding in zip(param_leaves, sharding_leaves, strict=True):
    name = jax.tree_util.keystr(path)
    spec, mesh = _spec_of(name, sharding)
    if _mentions(spec, replica_axis):
      raise ValueError(
        f"`{_FN}`: the spec of params{name}, {spec}, already names {replica_axis!r}; pass one"
        f" replica's shardings, without `replica_axis`, which is prepended here."
      )
    if mesh is not None and all(mesh is not m and mesh != m for m in meshes):
      meshes.append(mesh)
    by_path.append((path, np.shape(leaf), spec))
  if len(meshes) > 1:
    raise ValueError(f"`{_FN}`: the params' NamedShardings must share one mesh, got {meshes}.")
  mesh = meshes[0] if meshes else None
  if mesh is not None and replica_axis not in mesh.axis_names:
    raise ValueError(
      f"`{_FN}(replica_axis={replica_axis!r})` must name an axis of the params' mesh, whose axes"
      f" are {mesh.axis_names}."
    )

  def spec_for(path: tuple, shape: tuple) -> PartitionSpec:
    same_shape = [(p, s) for p, sh, s in by_path if sh == shape[1:]]
    ends = [(len(p), s) for p, s in same_shape if _is_suffix(p, path)]
    if ends:  # the longest: .mu['z']['a'] is params['z']['a']'s moment, not params['a']'s
      return PartitionSpec(replica_axis, *max(ends, key=lambda e: e[0])[1])
    if len(shape) > 1 and same_shape and all(s == same_shape[0][1] for _, s in same_shape):
      return PartitionSpec(replica_axis, *same_shape[0][1])
    return PartitionSpec(replica_axis)

  stacked = jax.tree.map(lambda p: jax.ShapeDtypeStruct((1,) + np.shape(p), p.dtype), params)
  state = jax.eval_shape(jax.vmap(tx.init), stacked)
  specs = jax.tree_util.tree_map_with_path(lambda path, x: spec_for(path, x.shape), state)
  if mesh is None:
    return specs
  return jax.tree.map(
    lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, PartitionSpec)
  )
