r"""The fault-tolerant halves of the DiLoCo family, one row per algorithm.

A :class:`~optax_dist.fault_tolerance.RoundProtocol` does the same round for every algorithm
(inner steps, the local half, the merge and the vote, then a commit or an abort) and asks its
row of :data:`HALVES` for everything that differs: the transformation it runs, the settings it
takes, the payload, the commit, where the params restart, and the schedule of its round
boundaries. The protocol and the engines never test an algorithm's name; a new algorithm of the
family is one more row.

Each row's functions take the protocol first (its settings: ``sync_period``,
``num_fragments``, ``mixing``, its ``exchange`` and ``outer_tx``) and are traced inside the
protocol's jitted halves where they compute on arrays, so a row computes what the in-program
transformation computes, bit for bit.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dist import _diloco, _fragments, _local_sgd, _streaming_diloco

if TYPE_CHECKING:
  from optax_dist.fault_tolerance.protocol import RoundProtocol


# ----------------------------------------------------------------------------------------------
# What most rows share: the whole tree every H steps.


def whole_tree(protocol: RoundProtocol, step: int) -> None:
  """No fragment: every round exchanges the whole tree (``step`` is not read)."""
  del protocol, step


def periodic_round_steps(protocol: RoundProtocol, local_step: int) -> int:
  r"""The inner steps from ``local_step`` to the next multiple of H: :math:`H - t \bmod H`."""
  return protocol.sync_period - local_step % protocol.sync_period


def periodic_rounds_until(protocol: RoundProtocol, steps: int) -> int:
  r"""The round boundaries in ``update`` calls 1 to ``steps`` every H steps:
  :math:`\lfloor \mathrm{steps} / H \rfloor`."""
  return steps // protocol.sync_period


def zero_payload(protocol: RoundProtocol, params: Any, opt_state: Any, step: int) -> Any:
  """Zeros of the payload of the round ending on ``update`` call ``step``: its fragment's
  (``protocol.fragment(step)``) tree, shapes and dtypes, as NumPy arrays (nothing is run; a
  packed payload's zero codes and scales: its size on a wire, decoded to zeros)."""
  fragment = protocol.fragment(step)
  shapes = jax.eval_shape(lambda o, p: protocol.send_half(o, p, fragment)[0], opt_state,
                          params)
  return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def anchor(opt_state: Any, average: Any) -> Any:
  r"""The restart point of the outer-optimizer rows: the anchor :math:`\theta`."""
  del average
  return opt_state.anchor


def no_average(params: Any) -> None:
  """No model average kept beside the optimizer state (``params`` is not read)."""
  del params


def land(params: Any, target: Any) -> Any:
  """``params + (target - params)`` in the params' dtypes: where the transformation's update
  lands a worker on a sync step (``target`` up to one rounding)."""
  return jax.tree.map(
    lambda p, t: optax.apply_updates(p, (t - p).astype(p.dtype)), params, target)


def leaf_fragments(protocol: RoundProtocol, params: Any) -> tuple[int, ...]:
  """Each leaf's fragment, in ``jax.tree.leaves`` order, as ``streaming_diloco``'s
  ``fragments=None`` assigns the protocol's ``num_fragments``."""
  return _fragments.streaming_diloco_fragments(params, protocol.num_fragments)


# ----------------------------------------------------------------------------------------------
# The table's row.


@dataclasses.dataclass(frozen=True)
class Halves:
  r"""One algorithm's fault-tolerant halves: what a :class:`RoundProtocol` does for it.

  With :math:`\theta` the anchor, :math:`x_i` replica i's params, :math:`x'_i` its params
  after the round's last inner step, :math:`p_i` its payload and :math:`\bar p` the members'
  merged payload (``RoundProtocol.merge``), a row gives the local half
  :math:`x'_i \mapsto (p_i, r'_i)` and the outer half
  :math:`\bar p \mapsto (\theta, \text{outer state})`, with the params landed from the origin
  :math:`x_i` as the transformation's sync step lands them.

  Attributes:
    build: ``(protocol) -> tx``: the transformation for one worker (``axis_name=None``) from
      the protocol's settings; its own checks raise on them.
    payload: ``(protocol, opt_state, new_params, fragment) -> (payload, residual)``: the local
      half, with no collective: :math:`p_i` of :math:`x'_i` (``new_params``; the state after
      the step) as ``protocol.exchange`` gives it (the wire format's dtypes; a block-quantized
      format's codes and scales), and the residual candidate :math:`r'_i`
      (``None`` without error feedback); ``fragment`` (a Python int or ``None``) is the
      round's.
    commit: ``(protocol, origin, new_params, opt_state, average, merged, residual, fragment)
      -> (params, opt_state, average)``: the outer half on ``merged``: the new anchor and
      outer state (or the new average), the residual taken, and the params landed from
      ``origin`` (:math:`x_i`, the params before the last inner step; ``new_params``:
      :math:`x'_i`, after it), bit for bit as the transformation's sync step lands them.
    restart_point: ``(opt_state, average) -> tree``: where the params restart on an abort or a
      heal (the anchor, or the last committed average).
    initial_average: ``(params) -> average``: ``ReplicaState.average`` at ``init`` (``None``
      for the rows that keep none).
    takes_outer: whether ``RoundProtocol(outer=...)`` may be given: the row keeps an anchor
      (and so takes ``anchor_dtype``).
    takes_fragments: whether ``RoundProtocol(num_fragments=...)`` may be given (default 4, at
      most ``sync_period``).
    takes_mixing: whether ``RoundProtocol(mixing=...)`` may be nonzero.
    takes_overlap: whether ``RoundProtocol(overlap=...)`` may be nonzero: the commit on the
      send step holds the merge in the state, and the transformation's own inner step
      :math:`\tau` steps later lands it.
    fragment: ``(protocol, step) -> int | None``: the fragment whose exchange is due on
      ``update`` call ``step`` (from 1); ``None`` for the whole tree (default
      :func:`whole_tree`).
    round_steps: ``(protocol, local_step) -> int``: the inner steps from ``local_step`` to the
      next round boundary (default :func:`periodic_round_steps`, :math:`H - t \bmod H`).
    rounds_until: ``(protocol, steps) -> int``: the round boundaries in ``update`` calls 1 to
      ``steps`` (default :func:`periodic_rounds_until`, :math:`\lfloor \mathrm{steps}/H
      \rfloor`).
    payload_size_varies: whether a payload's size depends on the round (one fragment's
      leaves): a member a round behind would then send one of another size, and a member
      healed in the round must send :attr:`healed_payload` instead of its own.
    healed_payload: ``(protocol, params, opt_state, step) -> payload``: what a member healed
      in the round ending on ``update`` call ``step`` sends (weight 0, left out of the merge;
      default :func:`zero_payload`, zeros of the round's payload).
  """

  build: Callable[[RoundProtocol], optax.GradientTransformationExtraArgs]
  payload: Callable[..., tuple[Any, Any]]
  commit: Callable[..., tuple[Any, Any, Any]]
  restart_point: Callable[[Any, Any], Any] = anchor
  initial_average: Callable[[Any], Any] = no_average
  takes_outer: bool = True
  takes_fragments: bool = False
  takes_mixing: bool = False
  takes_overlap: bool = False
  fragment: Callable[[RoundProtocol, int], int | None] = whole_tree
  round_steps: Callable[[RoundProtocol, int], int] = periodic_round_steps
  rounds_until: Callable[[RoundProtocol, int], int] = periodic_rounds_until
  payload_size_varies: bool = False
  healed_payload: Callable[..., Any] = zero_payload


# ----------------------------------------------------------------------------------------------
# diloco.


def _diloco_build(p: RoundProtocol) -> optax.GradientTransformationExtraArgs:
  return _diloco.diloco(
    p.inner, p.outer, sync_period=p.sync_period, error_feedback=p.error_feedback,
    comm_dtype=p.comm_dtype, comm_block_size=p.comm_block_size, anchor_dtype=p.anchor_dtype)


def _diloco_payload(p: RoundProtocol, opt_state: Any, new_params: Any, fragment: None):
  del fragment
  return _diloco.diloco_payload(p.exchange, opt_state.anchor, new_params, opt_state.error_feedback)


def _diloco_commit(p: RoundProtocol, origin, new_params, opt_state, average, merged, residual,
                   fragment):
  del new_params, fragment
  anchor, outer_state = _diloco.diloco_outer_step(
    p.outer_tx, opt_state.anchor, opt_state.outer_state, merged)
  opt_state = opt_state._replace(anchor=anchor, outer_state=outer_state, error_feedback=residual)
  return land(origin, anchor), opt_state, average


# ----------------------------------------------------------------------------------------------
# local_sgd.


def _local_sgd_build(p: RoundProtocol) -> optax.GradientTransformationExtraArgs:
  if p.anchor_dtype is not None:
    raise ValueError(
      "`RoundProtocol(anchor_dtype=...)` must be None for local_sgd (it keeps no anchor), got"
      f" {p.anchor_dtype!r}.")
  return _local_sgd.local_sgd(p.inner, sync_period=p.sync_period, comm_dtype=p.comm_dtype,
                              comm_block_size=p.comm_block_size)


def _local_sgd_payload(p: RoundProtocol, opt_state: Any, new_params: Any, fragment: None):
  del opt_state, fragment
  return _local_sgd.local_sgd_payload(p.exchange, new_params), None


def _local_sgd_commit(p: RoundProtocol, origin, new_params, opt_state, average, merged,
                      residual, fragment):
  del p, new_params, residual, fragment
  average = _local_sgd.local_sgd_outer_step(merged, origin)
  return land(origin, average), opt_state, average


def _last_average(opt_state: Any, average: Any) -> Any:
  """local_sgd's restart point: the last committed model average."""
  del opt_state
  return average


def _params(params: Any) -> Any:
  """local_sgd's average at ``init``: the initial params."""
  return params


# ----------------------------------------------------------------------------------------------
# streaming_diloco (overlap 0: each fragment's exchange lands on its send step; overlap tau:
# tau inner steps later).


def _streaming_build(p: RoundProtocol) -> optax.GradientTransformationExtraArgs:
  return _streaming_diloco.streaming_diloco(
    p.inner, p.outer, sync_period=p.sync_period, num_fragments=p.num_fragments,
    mixing=p.mixing, overlap=p.overlap, error_feedback=p.error_feedback,
    comm_dtype=p.comm_dtype, comm_block_size=p.comm_block_size, anchor_dtype=p.anchor_dtype)


def _streaming_payload(p: RoundProtocol, opt_state: Any, new_params: Any, fragment: int):
  return _streaming_diloco.streaming_diloco_payload(
    p.exchange, opt_state.anchor, new_params, opt_state.error_feedback,
    fragments=leaf_fragments(p, new_params), fragment=fragment)


def _streaming_commit(p: RoundProtocol, origin, new_params, opt_state, average, merged,
                      residual, fragment):
  """Fragment f's outer step, its outer state replaced in the tuple, and its leaves landed as
  :func:`optax_dist.streaming_diloco_land` lands them (the others keep ``new_params``); with
  overlap, :func:`_streaming_hold`."""
  if p.overlap:
    return new_params, _streaming_hold(p, opt_state, merged, residual, fragment), average
  f, ids = fragment, leaf_fragments(p, origin)
  anchor, outer_f = _streaming_diloco.streaming_diloco_outer_step(
    p.outer_tx, opt_state.anchor, opt_state.outer_state[f], merged, fragments=ids, fragment=f)
  outer_state = tuple(outer_f if g == f else o for g, o in enumerate(opt_state.outer_state))
  opt_state = opt_state._replace(anchor=anchor, outer_state=outer_state, error_feedback=residual)
  leaves, treedef = jax.tree.flatten(origin)
  params = [
    _streaming_land(a, x, x_new, p.mixing) if i == f else x_new
    for x, x_new, a, i in zip(leaves, jax.tree.leaves(new_params), jax.tree.leaves(anchor), ids,
                              strict=True)
  ]
  return treedef.unflatten(params), opt_state, average


def _streaming_hold(p: RoundProtocol, opt_state: Any, merged: Any, residual: Any,
                    fragment: int) -> Any:
  r"""With overlap :math:`\tau`, the commit on fragment f's send step s: the merged
  pseudo-gradient :math:`\Delta^f` (in the anchor's dtypes, as the in-program send's mean)
  held in flight, ``in_flight_step[f] = s``, and the residual taken; anchor, outer state and
  params unchanged. The transformation's inner step :math:`s + \tau` lands it (the outer step
  on :math:`\Delta^f`, the fragment's params mixed by :math:`\alpha`), as in the program."""
  anchor, treedef = jax.tree.flatten(opt_state.anchor)
  parts = _fragments.Fragments(leaf_fragments(p, opt_state.anchor), treedef)
  held = jax.tree.map(lambda a, d: jnp.asarray(d).astype(a.dtype),
                      parts.part(anchor, fragment), merged)
  in_flight = parts.put(jax.tree.leaves(opt_state.in_flight), held, fragment)
  return opt_state._replace(
    in_flight=treedef.unflatten(in_flight), error_feedback=residual,
    in_flight_step=opt_state.in_flight_step.at[fragment].set(opt_state.local_step))


def _streaming_land(target: Any, x: Any, x_new: Any, mixing: Any) -> Any:
  r"""A leaf of the landing fragment: :math:`x + (\tilde\theta - x)`, :math:`\tilde\theta =
  \alpha x' + (1 - \alpha) \theta` (:func:`optax_dist.streaming_diloco_land`'s arithmetic, with
  :math:`x'` given and the update in the params' dtype)."""
  if not (isinstance(mixing, numbers.Real) and mixing == 0):
    target = mixing * x_new.astype(target.dtype) + (1 - mixing) * target
  return optax.apply_updates(x, (target - x).astype(x.dtype))


def _streaming_fragment(p: RoundProtocol, step: int) -> int | None:
  """The first fragment due on ``update`` call ``step`` (:func:`optax_dist.streaming_diloco_syncs`),
  or ``None``."""
  due = [f for f in range(p.num_fragments) if _streaming_diloco.streaming_diloco_syncs(
    step, sync_period=p.sync_period, num_fragments=p.num_fragments, fragment=f)]
  return due[0] if due else None


def _streaming_round_steps(p: RoundProtocol, local_step: int) -> int:
  """The inner steps to the next step on which a fragment is due (about :math:`H/F`)."""
  return next(k for k in range(1, p.sync_period + 1) if p.fragment(local_step + k) is not None)


def _streaming_rounds_until(p: RoundProtocol, steps: int) -> int:
  """The ``update`` calls 1 to ``steps`` on which a fragment is due."""
  return sum(p.fragment(s) is not None for s in range(1, steps + 1))


# ----------------------------------------------------------------------------------------------
# The table.


HALVES: dict[str, Halves] = {
  "diloco": Halves(build=_diloco_build, payload=_diloco_payload, commit=_diloco_commit),
  "local_sgd": Halves(
    build=_local_sgd_build, payload=_local_sgd_payload, commit=_local_sgd_commit,
    restart_point=_last_average, initial_average=_params, takes_outer=False),
  "streaming_diloco": Halves(
    build=_streaming_build, payload=_streaming_payload, commit=_streaming_commit,
    takes_fragments=True, takes_mixing=True, takes_overlap=True, fragment=_streaming_fragment,
    round_steps=_streaming_round_steps, rounds_until=_streaming_rounds_until,
    payload_size_varies=True),
}
"""The rows by algorithm name (``RoundProtocol(algorithm=...)``), in the order
``SUPPORTED`` lists them."""


def row(algorithm: str, fn: str = "RoundProtocol") -> Halves:
  """``algorithm``'s row of :data:`HALVES`.

  Raises:
    ValueError: ``algorithm`` has no row (the message names ``fn``'s ``algorithm`` argument and
      the rows there are).
  """
  found = HALVES.get(algorithm)
  if found is None:
    raise ValueError(f"`{fn}(algorithm=...)` must be one of {tuple(HALVES)}, got {algorithm!r}.")
  return found
