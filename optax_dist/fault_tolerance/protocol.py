"""The round of a fault-tolerant DiLoCo-family run: one replica's halves, the state split, the
state hash.

A replica runs its inner steps with the transformation built for one worker
(``axis_name=None``) and ``communicate=False``; at each round boundary the local half gives its
payload, an engine merges the members' payloads outside the program, and the members either
commit (the outer half) or abort. :class:`RoundProtocol` holds the jitted functions of one run,
compiled once and shared by every replica of a process.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dist import _checks, _diloco, _exchange, _local_sgd, _outer, _state

SUPPORTED = ("diloco", "local_sgd")


class ReplicaState(NamedTuple):
  """Everything one replica holds between rounds.

  Attributes:
    params: its params.
    opt_state: its state of :attr:`RoundProtocol.tx`.
    rounds: ``int32[]``, the committed rounds it has taken part in or healed to.
    average: ``local_sgd`` only: the last committed model average (the params' tree, shapes
      and dtypes); ``None`` for ``diloco``.
  """

  params: Any
  opt_state: Any
  rounds: jax.Array
  average: Any = None


class Sent(NamedTuple):
  """What a replica's round leaves for its commit.

  Attributes:
    origin: its params before the round's last inner step (where the commit lands from).
    payload: its payload :math:`p_i` (the params' tree; the wire format's dtypes).
    residual: its residual candidate :math:`r'_i` (``None`` without error feedback).
  """

  origin: Any
  payload: Any
  residual: Any


class GlobalState(NamedTuple):
  """What every committed replica holds identically after a round: what a joiner receives.

  Attributes:
    rounds: ``int32[]``, the run's committed rounds so far.
    opt_state: the replica's optimizer state with the fields :func:`optax_dist.resize_state`
      keeps (``RESIZE`` rule ``KEEP``: ``local_step``, ``anchor``, ``outer_state``) and
      ``None`` in place of the rest (the inner state, the error-feedback residual).
    average: ``local_sgd`` only: the last committed model average (the params' tree, shapes
      and dtypes), where the params restart; ``None`` for ``diloco`` (they restart from the
      anchor).
  """

  rounds: jax.Array
  opt_state: Any
  average: Any


@dataclasses.dataclass(frozen=True)
class RoundProtocol:
  r"""One run's round rules for ``diloco`` or ``local_sgd``, with the exchange outside the program.

  Each replica :math:`i` takes H inner steps with ``communicate=False`` (no exchange; its
  ``local_step`` advances), then at the round boundary (``local_step % H == 0``) the local half
  gives its payload :math:`p_i` (:func:`optax_dist.diloco_payload` or
  :func:`optax_dist.local_sgd_payload`) and a residual candidate :math:`r'_i`. The members
  merge the payloads in rank order (:meth:`merge`) and vote (:meth:`votes`). Then on every
  member either

  * **commit** (:meth:`commit`): :math:`\theta \leftarrow \theta + \mathrm{outer}(\bar p)`
    (:func:`optax_dist.diloco_outer_step`; ``local_sgd``: the average
    :math:`\bar x = \bar p`), the residual takes its candidate, ``rounds`` advances, and the
    params land on :math:`\theta` as the transformation's update lands them,
    :math:`x_i + (\theta - x_i)` (:math:`\theta` up to one rounding, so that without a fault the
    run is the in-program one bit for bit);
  * or **abort** (:meth:`abort`): anchor, outer state and residual unchanged, :math:`x_i
    \leftarrow \theta` exactly (``local_sgd``: the last committed average), the inner state
    kept; ``local_step`` (and so the data position) has advanced by H all the same.

  Attributes:
    algorithm: ``"diloco"`` or ``"local_sgd"`` (``streaming_diloco`` is not supported yet).
    inner: the inner optimizer.
    outer: ``diloco``'s outer optimizer (``None``: its default); must be ``None`` for
      ``local_sgd``.
    sync_period: H, inner steps (``update`` calls) per round.
    comm_dtype: the wire format, as the transformation takes it.
    comm_block_size: B of a block-quantized ``comm_dtype``.
    error_feedback: ``diloco``'s error feedback (needs a quantized ``comm_dtype``).

  Raises:
    ValueError: ``algorithm`` not one of ``SUPPORTED`` (``streaming_diloco`` named as not
      supported yet); ``outer`` given for ``local_sgd``; and whatever the transformation raises
      for its arguments.

  References:
    Douillard et al., `DiLoCo <https://arxiv.org/abs/2311.08105>`_, 2023 (Algorithm 1);
    torchft ``Manager.should_commit`` and ``torchft.local_sgd.DiLoCo`` (the vote, the restored
    anchor on a failed round); the contract's "Fault-tolerant rounds".
  """

  algorithm: str
  inner: optax.GradientTransformation
  outer: optax.GradientTransformation | None = None
  sync_period: int = 500
  comm_dtype: Any = None
  comm_block_size: int | None = None
  error_feedback: bool = False

  def __post_init__(self):
    fn = "RoundProtocol"
    if self.algorithm not in SUPPORTED:
      raise ValueError(
        f"`{fn}(algorithm=...)` must be one of {SUPPORTED}, got {self.algorithm!r}"
        " (streaming_diloco's per-fragment rounds are not supported yet)."
      )
    if self.algorithm == "local_sgd" and self.outer is not None:
      raise ValueError(f"`{fn}(outer=...)` must be None for local_sgd, got {self.outer!r}.")
    _checks.check_positive_int(fn, "sync_period", self.sync_period)
    self.tx  # builds the transformation: its own checks raise here

  # --------------------------------------------------------------------------------------------
  # What the replicas share: the transformation, the exchange, the compiled halves.

  @functools.cached_property
  def tx(self) -> optax.GradientTransformationExtraArgs:
    """The transformation for one worker (``axis_name=None``), run with ``communicate=False``."""
    wire = dict(comm_dtype=self.comm_dtype, comm_block_size=self.comm_block_size)
    if self.algorithm == "local_sgd":
      return _local_sgd.local_sgd(self.inner, sync_period=self.sync_period, **wire)
    return _diloco.diloco(
      self.inner, self.outer, sync_period=self.sync_period, error_feedback=self.error_feedback,
      **wire,
    )

  @functools.cached_property
  def exchange(self) -> _exchange.Exchange:
    """The wire format of the payloads (named axis ``"replicas"``: quantized as the in-program
    exchange quantizes; only :meth:`~optax_dist.Exchange.payload` is called, no collective)."""
    return _exchange.Exchange(
      "replicas", comm_dtype=self.comm_dtype, comm_block_size=self.comm_block_size,
      call=self.algorithm,
    )

  @functools.cached_property
  def outer_tx(self) -> optax.GradientTransformation:
    """``diloco``'s outer optimizer (``outer``, or the paper's default)."""
    return _outer.default_outer() if self.outer is None else self.outer

  def init(self, params: Any) -> ReplicaState:
    """A replica at step 0: ``tx.init(params)``, zero rounds (``local_sgd``: the average is
    ``params``)."""
    average = params if self.algorithm == "local_sgd" else None
    return ReplicaState(params, self.tx.init(params), jnp.zeros([], jnp.int32), average)

  @functools.cached_property
  def inner_step(self):
    """Jitted ``(params, opt_state, grads) -> (params, opt_state)``: one inner step."""

    def step(params, opt_state, grads):
      updates, opt_state = self.tx.update(grads, opt_state, params, communicate=False)
      return optax.apply_updates(params, updates), opt_state

    return jax.jit(step)

  @functools.cached_property
  def local_half(self):
    """Jitted ``(params, opt_state, grads) -> (params, opt_state, payload, residual)``: the
    round's last inner step (the H-th, ``local_step % H == 0``) and this replica's payload
    :math:`p_i` and residual candidate :math:`r'_i` (``None`` without error feedback)."""

    def half(params, opt_state, grads):
      updates, opt_state = self.tx.update(grads, opt_state, params, communicate=False)
      new_params = optax.apply_updates(params, updates)
      if self.algorithm == "local_sgd":
        return new_params, opt_state, _local_sgd.local_sgd_payload(self.exchange, new_params), None
      payload, residual = _diloco.diloco_payload(
        self.exchange, opt_state.anchor, new_params, opt_state.error_feedback)
      return new_params, opt_state, payload, residual

    return jax.jit(half)

  @functools.cached_property
  def outer_half(self):
    """Jitted ``(origin, opt_state, average, merged, residual) -> (params, opt_state,
    average)``: the commit's new anchor and outer state (``local_sgd``: the new average), and
    the params landed on it from ``origin``, the params before the round's last inner step
    (as the transformation's sync step lands them)."""

    def half(origin, opt_state, average, merged, residual):
      if self.algorithm == "local_sgd":
        average = _local_sgd.local_sgd_outer_step(merged, origin)
        return _land(origin, average), opt_state, average
      anchor, outer_state = _diloco.diloco_outer_step(
        self.outer_tx, opt_state.anchor, opt_state.outer_state, merged)
      opt_state = opt_state._replace(
        anchor=anchor, outer_state=outer_state, error_feedback=residual)
      return _land(origin, anchor), opt_state, average

    return jax.jit(half)

  # --------------------------------------------------------------------------------------------
  # The round's outcome.

  def restart(self, params_like: Any, opt_state: Any, average: Any) -> Any:
    """The params of an abort or a heal: the anchor (``local_sgd``: the last committed
    average) exactly, in ``params_like``'s dtypes."""
    point = average if self.algorithm == "local_sgd" else opt_state.anchor
    return jax.tree.map(lambda a, p: jnp.asarray(a, jnp.result_type(p)), point, params_like)

  def run_round(self, replica: ReplicaState, grads: Callable[[Any, int], Any]
                ) -> tuple[ReplicaState, Sent]:
    """The replica's H inner steps, the last with the local half.

    Args:
      replica: its state at the round's start.
      grads: ``(params, step) -> grads``, ``step`` its ``local_step`` before the step (its data
        position).

    Returns:
      ``(replica, sent)``: the state after the steps (``local_step`` advanced by H) and its
      :class:`Sent`.
    """
    params, opt_state = replica.params, replica.opt_state
    for _ in range(self.sync_period - 1):
      params, opt_state = self.inner_step(params, opt_state, grads(params, _step(opt_state)))
    origin = params
    params, opt_state, payload, residual = self.local_half(
      params, opt_state, grads(params, _step(opt_state)))
    return replica._replace(params=params, opt_state=opt_state), Sent(origin, payload, residual)

  def commit(self, replica: ReplicaState, merged: Any, sent: Sent | None = None
             ) -> ReplicaState:
    """The replica after a committed round: the outer half on ``merged``, the params landed
    from its round's origin (see :attr:`outer_half`), its residual candidate taken,
    ``rounds + 1``. ``sent=None`` (it healed or joined this round and sent nothing): from its
    params, its residual kept."""
    if sent is None:
      sent = Sent(replica.params, None, getattr(replica.opt_state, "error_feedback", None))
    params, opt_state, average = self.outer_half(
      sent.origin, replica.opt_state, replica.average, merged, sent.residual)
    return ReplicaState(params, opt_state, replica.rounds + 1, average)

  def abort(self, replica: ReplicaState) -> ReplicaState:
    """The replica after an aborted round: params back to the restart point, the state as it
    was (the residual candidate dropped; ``local_step`` has advanced by the round's H)."""
    params = self.restart(replica.params, replica.opt_state, replica.average)
    return replica._replace(params=params)

  @staticmethod
  def merge(payloads: list, weights: list) -> Any:
    """The members' payloads merged in rank order: :func:`optax_dist.merge_payloads` of them,
    unweighted when every weight is equal (:math:`\\sum_i p_i / n`), else token-weighted
    (:math:`\\sum_i w_i p_i / \\sum_i w_i`)."""
    if len(set(weights)) == 1:
      return _exchange.merge_payloads(payloads)
    return _exchange.merge_payloads(payloads, weights)

  @staticmethod
  def votes(payload: Any) -> bool:
    """A member's vote: yes iff every value of its payload is finite."""
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(payload))


def _step(opt_state: Any) -> int:
  return int(opt_state.local_step)


def _land(params: Any, target: Any) -> Any:
  """``params + (target - params)`` in the params' dtypes: where the transformation's update
  lands a worker on a sync step (``target`` up to one rounding)."""
  return jax.tree.map(
    lambda p, t: optax.apply_updates(p, (t - p).astype(p.dtype)), params, target)


# ----------------------------------------------------------------------------------------------
# The state split.


def _global_parts(node: Any) -> Any:
  """``node`` with the fields ``resize_state`` keeps (``KEEP``) and ``None`` elsewhere."""
  if _state.is_library_state(node):
    fields = {
      name: (getattr(node, name) if rule == _state.KEEP else _global_parts(getattr(node, name)))
      for name, rule in node.RESIZE.items()
    }
    return type(node)(**fields)
  if _state.is_leaf(node) or not _holds_state(node):
    return None
  children, treedef = _state.children(node)
  return treedef.unflatten([_global_parts(c) for c in children])


def _holds_state(node: Any) -> bool:
  if _state.is_library_state(node):
    return True
  return not _state.is_leaf(node) and any(_holds_state(c) for c in _state.children(node)[0])


def global_state(replica: ReplicaState) -> GlobalState:
  """A replica's global state: what every committed member holds identically after a round.

  The fields of the optimizer state that :func:`optax_dist.resize_state` keeps (its ``KEEP``
  rule: ``local_step``, ``anchor``, ``outer_state``), the run's committed-round counter and,
  for ``local_sgd``, the last committed average. The rest (inner state, residual, params) is
  local and rebuilt by :func:`local_state`.

  Args:
    replica: its :class:`ReplicaState`.

  Returns:
    A :class:`GlobalState` (arrays and ``None`` only).
  """
  return GlobalState(replica.rounds, _global_parts(replica.opt_state), replica.average)


def local_state(protocol: RoundProtocol, received: GlobalState, params_like: Any
                ) -> ReplicaState:
  r"""A joiner's ``(params, opt_state)`` rebuilt from a received :class:`GlobalState`.

  The global fields are taken bit for bit; the rest comes from ``tx.init`` at the restart
  point, as :func:`optax_dist.resize_state`'s ``"reset"`` rule restarts a worker's inner
  state: params = the anchor (``local_sgd``: the average) in ``params_like``'s dtypes, the
  inner optimizer state at its ``init`` (moments zero, counts 0: a schedule's count restarts
  too), the error-feedback residual zero.

  Args:
    protocol: the run's :class:`RoundProtocol`.
    received: the donor's global state (decoded by :func:`decode_heal`).
    params_like: params of the run's tree, shapes and dtypes (e.g. the initial params).

  Returns:
    A :class:`ReplicaState` whose :func:`global_state` is ``received``.
  """
  params = protocol.restart(params_like, received.opt_state, received.average)
  opt_state = jax.tree.map(
    lambda g, t: t if g is None else g, received.opt_state, protocol.tx.init(params),
    is_leaf=lambda x: x is None)
  return ReplicaState(params, opt_state, received.rounds, received.average)


def state_hash(tree: Any) -> str:
  """The sha256 (hex) of a tree: its structure, then each leaf's path, dtype, shape and bytes.

  Deterministic across processes and runs: the same tree of the same values gives the same
  hash; any change of a bit, a dtype, a shape or the structure changes it. Leaves are read in
  ``jax.tree`` order as C-contiguous host arrays.

  Args:
    tree: a pytree of arrays (e.g. a :class:`GlobalState`).

  Returns:
    64 lowercase hex digits.
  """
  digest = hashlib.sha256(str(jax.tree.structure(tree)).encode())
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    array = np.asarray(leaf, order="C")
    header = f"{jax.tree_util.keystr(path)}|{array.dtype}|{array.shape}|"
    digest.update(header.encode())
    digest.update(array.tobytes())
  return digest.hexdigest()
