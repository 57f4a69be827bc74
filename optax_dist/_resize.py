"""Elastic resume: a run's optimizer state and params moved to another number of workers."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding

from optax_dist import _axis, _checks, _state

_FN = "resize_state"
_MODES = ("mean", "reset", "copy")

def _is_state(node: Any) -> bool:
  return _state.is_library_state(node)


# ----------------------------------------------------------------------------------------------
# Per-leaf rules on stacked arrays (axis 0: the workers).


def _broadcast(x: jax.Array, m: int) -> jax.Array:
  return jnp.broadcast_to(x, (m, *jnp.shape(x)))


def _agreed_mean(x: jax.Array) -> jax.Array:
  """The mean over axis 0, and exactly ``x[0]`` wherever every row agrees; non-floating: ``x[0]``.

  Floating leaves are averaged in at least float32 and cast back.
  """
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x[0]
  wide = jnp.promote_types(x.dtype, jnp.float32)
  mean = jnp.mean(x.astype(wide), axis=0).astype(x.dtype)
  return jnp.where(jnp.all(x == x[0], axis=0), x[0], mean)


def _same_on_every_worker(tree: Any) -> jax.Array:
  """``bool[]``: every leaf of ``tree`` is bitwise the same on every worker."""
  flags = [jnp.all(x == x[0]) for x in jax.tree.leaves(tree)]
  return functools.reduce(jnp.logical_and, flags, jnp.array(True))


# ----------------------------------------------------------------------------------------------
# The walk.


def _inner(old: Any, template: Any, m: int, mode: str) -> Any:
  """An inner state with no library state inside, carried by ``mode``."""
  if mode == "mean":
    return jax.tree.map(lambda x: _broadcast(_agreed_mean(x), m), old)
  if mode == "copy":
    return jax.tree.map(lambda x: _broadcast(x[0], m), old)
  # "reset", unless identical on every worker (global)
  if _state.is_record(old) or _state.is_leaf(old):
    same = _same_on_every_worker(old)
    return jax.tree.map(
      lambda x, t: jnp.where(same, _broadcast(x[0], m), t.astype(x.dtype)), old, template
    )
  children, treedef = _state.children(old)
  new = [_inner(c, t, m, mode) for c, t in zip(children, _state.children(template)[0], strict=True)]
  return treedef.unflatten(new)


def _walk(old: Any, template: Any, m: int, mode: str) -> Any:
  """The state for ``m`` workers: library states field by field, the rest as inner states."""

  def field(rule: str, value: Any, like: Any) -> Any:
    if rule == _state.KEEP:
      return jax.tree.map(lambda x: _broadcast(x[0], m), value)
    if rule == _state.MEAN:
      return jax.tree.map(lambda x: _broadcast(_agreed_mean(x), m), value)
    return _walk(value, like, m, mode)

  return _state.map_fields(field, lambda o, t: _inner(o, t, m, mode), old, template)


def _resize(tx: Any, m: int, mode: str, opt_state: Any, params: Any) -> tuple[Any, Any]:
  restart = _state.declared(opt_state, "RESTART")
  if restart is None:  # local SGD, tower, no distributed wrapper: the workers' mean
    one = jax.tree.map(_agreed_mean, params)
  else:  # the center or anchor, identical on every worker, in the params' dtypes
    one = jax.tree.map(lambda c, p: c[0].astype(p.dtype), restart, params)
  new_params = jax.tree.map(lambda x: _broadcast(x, m), one)
  template = jax.vmap(tx.init)(new_params)
  return _walk(opt_state, template, m, mode), new_params


# ----------------------------------------------------------------------------------------------
# Checks.


def _num_workers(opt_state: Any, params: Any) -> int:
  """The common leading size of every leaf of ``params`` and ``opt_state``."""
  fix = (
    " Pass the trees of every worker stacked on axis 0, as `jax.vmap(tx.init)` or a"
    " `jax.shard_map` with out_specs=P(axis) builds them."
  )
  size, ref = _axis.workers_axis_size(_FN, params, opt_state, fix)
  if ref is None:
    raise ValueError(f"`{_FN}`: `params` has no leaves; there is nothing to resize.")
  return size


def _check_from_tx(tx: Any, opt_state: Any, params: Any) -> None:
  """Raise unless ``opt_state`` has the tree, shapes and dtypes of ``vmap(tx.init)(params)``."""
  expected = jax.eval_shape(jax.vmap(tx.init), params)
  fix = (
    " Pass the transformation this state was built with (and, for a restored checkpoint,"
    " restore it into `jax.eval_shape` of the same mapped init)."
  )
  if jax.tree.structure(opt_state) != jax.tree.structure(expected):
    raise ValueError(
      f"`{_FN}`: `opt_state` is not a state of `tx` for these params: "
      + _first_difference(opt_state, expected) + fix
    )
  for (path, leaf), e in zip(
    jax.tree_util.tree_leaves_with_path(opt_state), jax.tree.leaves(expected), strict=True
  ):
    shape, dtype = np.shape(leaf), jnp.result_type(leaf)
    if shape != e.shape or dtype != e.dtype:
      raise ValueError(
        f"`{_FN}`: `opt_state` is not a state of `tx` for these params: the leaf at"
        f" opt_state{jax.tree_util.keystr(path)} has shape {shape} and dtype {dtype}, but"
        f" `jax.vmap(tx.init)(params)` gives {e.shape} and {e.dtype}." + fix
      )


def _first_difference(got: Any, want: Any, path: tuple = ()) -> str:
  """Where the trees ``got`` (``opt_state``) and ``want`` (``vmap(tx.init)``'s) first differ."""
  where = "opt_state" + jax.tree_util.keystr(path)
  got_leaf, want_leaf = _state.is_leaf(got), _state.is_leaf(want)
  if got_leaf or want_leaf:
    if got_leaf and want_leaf:
      return f"the trees differ at {where}."
    kind = "an array" if got_leaf else f"a node of type {type(got).__name__}"
    wanted = "an array" if want_leaf else f"a node of type {type(want).__name__}"
    return f"{where} is {kind}, where `jax.vmap(tx.init)(params)` has {wanted}."
  got_children = jax.tree_util.tree_flatten_with_path(got, is_leaf=lambda x: x is not got)[0]
  want_children = jax.tree_util.tree_flatten_with_path(want, is_leaf=lambda x: x is not want)[0]
  got_keys = [k for k, _ in got_children]
  want_keys = [k for k, _ in want_children]
  if type(got) is not type(want) or got_keys != want_keys:

    def describe(node, keys):
      return f"{type(node).__name__}({', '.join(jax.tree_util.keystr(k) for k in keys)})"

    return (
      f"{where} is {describe(got, got_keys)}, where `jax.vmap(tx.init)(params)` has"
      f" {describe(want, want_keys)}."
    )
  for (key, g), (_, w) in zip(got_children, want_children, strict=True):
    if jax.tree.structure(g) != jax.tree.structure(w):
      return _first_difference(g, w, path + key)
  return f"the trees differ at {where}."


# ----------------------------------------------------------------------------------------------
# The public function.


def resize_state(
  tx: optax.GradientTransformation,
  opt_state: optax.OptState,
  params: optax.Params,
  num_workers: int,
  *,
  inner_state: str = "mean",
) -> tuple[optax.OptState, optax.Params]:
  r"""Moves a run's state and params, stacked over N workers, to ``num_workers`` workers.

  Elastic resume: a run checkpointed on N workers continues on M. The global part of the state,
  identical on every worker, is kept exactly: worker 0's copy goes to every new worker. Each
  worker's own part is rebuilt from it, as a worker that rejoins a running job rebuilds its own.
  The walk recognises the library's states at any depth (in ``optax.chain``, nested wrappers)
  and reads the rule each declares beside its fields (``RESIZE`` and ``RESTART``):

  * ``ElasticAverageState`` and ``AGNState``: ``local_step`` and ``center`` kept (and AGN's
    ``center_inner_state``); the params restart from the center; AGN's ``grad_accum``, the
    current period's gradients, becomes the workers' mean (the next commit keeps them).
  * ``DiLoCoState`` and ``StreamingDiLoCoState``: ``local_step``, ``anchor`` and
    ``outer_state`` kept; the params restart from the anchor. Streaming DiLoCo's exchanges in
    flight (``in_flight``, ``in_flight_step``) are kept and land on their step; with eager
    updates each new worker's own share (``own_in_flight``) is the old workers' mean.
  * ``LocalSGDState``: ``local_step`` kept; the params restart from the workers' mean.
  * ``MovingAverageState``: ``count`` kept; ``ema`` becomes the workers' mean.
  * ``DropStaleGradientsState``: ``global_step`` and ``num_dropped`` kept.
  * ``ApplyIfFiniteState``: its three counters kept.
  * ``AccumulateThenReduceState``: ``mini_step`` and ``gradient_step`` kept; ``acc_grads``
    becomes the workers' mean.

  The params restart from the center or anchor of the first such state in a depth-first walk,
  else from the workers' mean (``local_sgd``, ``tower``, no distributed wrapper). "Workers' mean"
  is exact where every worker holds the same value: there it is worker 0's value, bit for bit
  (the params and EMA under ``tower``). The counters keep their values, so the communication
  schedule goes on where it was.

  Inner states (``inner_state`` of the wrappers, ``accumulate_then_reduce``'s
  ``inner_opt_state``, and every optax state outside the library's) follow ``inner_state``:

  * ``"mean"`` (default): floating leaves become the workers' mean, integer and boolean leaves
    (adam's count) worker 0's. An inner state identical on every worker (under ``tower`` and
    ``accumulate_then_reduce``, a learning-rate schedule's count) is thereby kept exactly.
  * ``"reset"``: one optax state at a time (``ScaleByAdamState``'s count with its moments), a
    state that differs between the workers restarts from ``tx.init`` of the new params (zero
    moments, count 0), as a restarted worker's local optimizer slots do in TF; a state
    identical on every worker is global and is kept (the same ones as above, and injected
    hyperparameters). Adam restarted at count 0 takes steps of the full learning rate in every
    coordinate: DiLoCo with an Adam inner optimizer lost accuracy with it on digits, where
    ``"mean"`` did not.
  * ``"copy"``: worker 0's on every new worker (a healing replica in torchft loads a healthy
    peer's state).

  With ``num_workers`` equal to N, ``opt_state`` and ``params`` are returned unchanged, whatever
  ``inner_state``: resuming on as many workers stays exact.

  Args:
    tx: the transformation the state was built with: its ``init`` gives the state's expected
      structure and the restarted inner states of ``"reset"``. That structure does not depend
      on the number of workers, so the transformation of the old run or of the new one.
    opt_state: the state of ``tx``, every leaf stacked over N workers on axis 0 (as
      ``jax.vmap(tx.init)`` or ``jax.shard_map`` with ``out_specs=P(axis)`` build it), the step
      counters included.
    params: the params of every worker, stacked the same way.
    num_workers: M, the new number of workers, a positive int.
    inner_state: ``"mean"``, ``"reset"`` or ``"copy"``: how the inner optimizer states that
      differ between workers are rebuilt (above).

  Returns:
    ``(opt_state, params)`` for M workers: every leaf with axis 0 of size M. Place them on the
    new mesh, e.g. ``jax.device_put(tree, NamedSharding(mesh, P(axis)))``, and train on with a
    transformation built for M workers.

  Shapes:
    Leaves ``(N, ...)`` in, ``(M, ...)`` out, the same dtypes. Memory: one new copy of the
    params and state, M times the per-worker size.

  Collectives:
    None: call it outside the mapped step, on the stacked arrays (it runs as one jitted
    program).

  Raises:
    TypeError: ``tx`` is not a transformation; ``num_workers`` not an int.
    ValueError: ``num_workers`` < 1; ``inner_state`` not ``"mean"``, ``"reset"`` or
      ``"copy"``; a leaf of ``params`` or ``opt_state`` that is not stacked on a common leading
      axis (a scalar, or another leading size; the message names it); ``opt_state`` whose tree,
      shapes or dtypes are not those of ``jax.vmap(tx.init)(params)`` (a state of another
      transformation).

  Examples:
    Four EASGD workers continue as two; the center and the step counter are kept, the workers
    restart from the center:

    >>> import jax, jax.numpy as jnp, optax, optax_dist
    >>> tx = optax_dist.elastic_average(
    ...     optax.sgd(1.0), communication_period=1, moving_rate=0.2, axis_name="w")
    >>> params = jnp.zeros((4, 1))
    >>> state = jax.vmap(tx.init, axis_name="w")(params)
    >>> grads = -jnp.arange(4.0).reshape(4, 1)
    >>> updates, state = jax.vmap(tx.update, axis_name="w")(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> state2, params2 = optax_dist.resize_state(tx, state, params, 2)
    >>> state2.center[:, 0], state2.local_step, params2[:, 0]
    (Array([1.2, 1.2], dtype=float32), Array([1, 1], dtype=int32), Array([1.2, 1.2], dtype=float32))

  References:
    TensorFlow 1.x, ``ElasticAverageOptimizer.get_init_op`` and ``AGNOptimizer.get_init_op``
    (a restarted worker copies the center into its local params).
    torchft, ``torchft.local_sgd.DiLoCo`` (a healing replica loads the anchor and outer
    optimizer state of a healthy one).
    Douillard et al., `DiLoCo <https://arxiv.org/abs/2311.08105>`_, 2023.
  """
  _check_tx(tx)
  _checks.check_positive_int(_FN, "num_workers", num_workers)
  _checks.check_choice(_FN, "inner_state", inner_state, _MODES)
  n = _num_workers(opt_state, params)
  if int(num_workers) == n:
    _check_from_tx(tx, opt_state, params)
    return opt_state, params
  opt_state, params = _auto_axes((opt_state, params))
  _check_from_tx(tx, opt_state, params)
  return _program(tx, int(num_workers), inner_state)(opt_state, params)


def _auto_axes(tree: Any) -> Any:
  """``tree`` with each leaf sharded over a mesh with explicit axes (``jax.make_mesh``'s default)
  relabelled onto the same devices and layout with automatic axes.

  Explicitly sharded types refuse ``x[0]`` on the workers' axis under ``jit``, and
  ``jax.vmap(tx.init)`` outside a mesh context; with automatic axes the compiler moves the data.
  """

  def relabel(x):
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      return x
    mesh = sharding.mesh
    if AxisType.Explicit not in tuple(getattr(mesh, "axis_types", ())):
      return x
    auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return jax.device_put(x, NamedSharding(auto, sharding.spec))

  return jax.tree.map(relabel, tree)


def _program(tx: Any, m: int, mode: str) -> Any:
  """The jitted resize, compiled once per transformation, M and mode (when ``tx`` hashes)."""
  try:
    return _cached_program(tx, m, mode)
  except TypeError:  # an unhashable transformation: compiled for this call
    return jax.jit(functools.partial(_resize, tx, m, mode))


@functools.lru_cache(maxsize=16)
def _cached_program(tx: Any, m: int, mode: str) -> Any:
  return jax.jit(functools.partial(_resize, tx, m, mode))


def _check_tx(tx: Any) -> None:
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(
      f"`{_FN}(tx=...)` must be the optax GradientTransformation the state was built with"
      f" (with `init` and `update`), got {type(tx).__name__}."
    )
