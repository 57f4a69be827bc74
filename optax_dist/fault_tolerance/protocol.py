"""The round of a fault-tolerant DiLoCo-family run: one replica's halves, its commit and abort.

A replica runs its inner steps with the transformation built for one worker
(``axis_name=None``) and ``communicate=False``; at each round boundary the local half gives its
payload, an engine merges the members' payloads outside the program, and the members either
commit (the outer half) or abort. :class:`RoundProtocol` holds the jitted functions of one run,
compiled once and shared by every replica of a process. The state split (what a donor sends)
and the state hash are :mod:`~optax_dist.fault_tolerance.heal`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dist import _checks, _exchange, _outer
from optax_dist.fault_tolerance import halves as _halves

SUPPORTED = tuple(_halves.HALVES)
"""The algorithms :class:`RoundProtocol` runs: the rows of
:data:`~optax_dist.fault_tolerance.halves.HALVES`."""


class ReplicaState(NamedTuple):
  """Everything one replica holds between rounds.

  Attributes:
    params: its params.
    opt_state: its state of :attr:`RoundProtocol.tx`.
    rounds: ``int32[]``, the committed rounds it has taken part in or healed to.
    average: ``local_sgd`` only (its row's ``initial_average``): the last committed model
      average (the params' tree, shapes and dtypes); ``None`` for ``diloco``.
  """

  params: Any
  opt_state: Any
  rounds: jax.Array
  average: Any = None


class Sent(NamedTuple):
  """What a replica's round leaves for its commit.

  Attributes:
    origin: its params before the round's last inner step (where the commit lands from).
    payload: its payload :math:`p_i` as it is sent (the params' tree, ``MaskedNode`` outside
      the round's fragment for ``streaming_diloco``, in the wire format's dtypes; a
      block-quantized format's codes and scales: :attr:`RoundProtocol.exchange`).
    residual: its residual candidate :math:`r'_i` (``None`` without error feedback).
    steps: the round's inner steps (``update`` calls).
  """

  origin: Any
  payload: Any
  residual: Any
  steps: int


@dataclasses.dataclass(frozen=True)
class RoundProtocol:
  r"""One run's round rules for the DiLoCo family, with the exchange outside the program.

  Each replica :math:`i` takes inner steps with ``communicate=False`` (no exchange; its
  ``local_step`` advances) up to the round boundary, the step on which the transformation's
  schedule syncs (``local_step % H == 0``; for ``streaming_diloco`` one fragment's sync,
  every :math:`H/F` steps or so, :func:`optax_dist.streaming_diloco_syncs`). There the local
  half gives its payload :math:`p_i` (:func:`optax_dist.diloco_payload`,
  :func:`optax_dist.local_sgd_payload` or :func:`optax_dist.streaming_diloco_payload` of that
  fragment) and a residual candidate :math:`r'_i`. The members
  merge the payloads in rank order (:meth:`merge`) and vote (:meth:`votes`). Then on every
  member either

  * **commit** (:meth:`commit`): :math:`\theta \leftarrow \theta + \mathrm{outer}(\bar p)`
    (:func:`optax_dist.diloco_outer_step`; ``local_sgd``: the average
    :math:`\bar x = \bar p`), the residual takes its candidate, ``rounds`` advances, and the
    params land on :math:`\theta` as the transformation's update lands them,
    :math:`x_i + (\theta - x_i)` (:math:`\theta` up to one rounding, so that without a fault the
    run is the in-program one bit for bit; ``streaming_diloco``: the fragment's leaves, on
    :math:`\alpha x'_i + (1 - \alpha) \theta`);
  * or **abort** (:meth:`abort`): anchor, outer state and residual unchanged, :math:`x_i
    \leftarrow \theta` exactly (``local_sgd``: the last committed average;
    ``streaming_diloco``: the fragment's leaves only), the inner state kept; ``local_step``
    (and so the data position) has advanced by the round's steps all the same.

  What differs by algorithm is its row of :data:`~optax_dist.fault_tolerance.halves.HALVES`
  (:attr:`halves`): the transformation, the settings it takes, the payload, the commit, the
  restart point and the round boundaries.

  Attributes:
    algorithm: the name of a row of ``HALVES``: ``diloco``, ``local_sgd`` or
      ``streaming_diloco`` (a round is one fragment's exchange).
    inner: the inner optimizer.
    outer: the outer optimizer (``None``: the transformation's default); must be ``None`` for
      a row that takes none (``local_sgd``).
    sync_period: H, inner steps (``update`` calls) per round (``streaming_diloco``: per round
      of every fragment).
    comm_dtype: the wire format, as the transformation takes it.
    comm_block_size: B of a block-quantized ``comm_dtype``.
    error_feedback: error feedback (``diloco``, ``streaming_diloco``; needs a quantized
      ``comm_dtype``).
    num_fragments: F, ``streaming_diloco``'s fragments (``None``: 4), at most H; must be
      ``None`` for a row that takes none. The leaves are assigned as ``fragments=None`` assigns
      them.
    mixing: ``streaming_diloco``'s :math:`\alpha` in [0, 1]; must be 0 for a row that takes
      none.
    overlap: ``streaming_diloco``'s :math:`\tau`, inner steps in ``[0, sync_period)`` between a
      round's send (its exchange and vote, on the fragment's send step s) and its landing on
      step :math:`s + \tau`; must be 0 for a row that takes none. A commit holds the merged
      pseudo-gradient in the state (``in_flight``, ``in_flight_step``: global state, healed
      and hashed); the replica's own inner step :math:`s + \tau` applies the outer step and
      mixes its params by :math:`\alpha` (:func:`optax_dist.streaming_diloco`'s landing, the
      same program). An abort holds nothing: the fragment's params revert on the send step.
      Part of the settings fingerprint when not 0.
    anchor_dtype: the floating dtype of the anchor, of the pseudo-gradients and of the outer
      state, as the transformation takes it (``diloco``, ``streaming_diloco``); ``None`` (the
      default): each param's own dtype. ``jnp.float32`` with low-precision (``bfloat16``)
      params keeps the outer steps' small changes, as the in-program transformation does with
      it; the params restart from the anchor cast to their own dtypes. Must be ``None`` for
      ``local_sgd`` (no anchor). Part of the settings fingerprint when not ``None``.

  Raises:
    ValueError: ``algorithm`` not a row of ``HALVES``; ``outer``, ``num_fragments`` or
      ``mixing`` or ``overlap`` given for a row that takes none (``outer`` for ``local_sgd``;
      the others for all but ``streaming_diloco``); F > H; ``overlap`` outside
      ``[0, sync_period)`` (the transformation raises); ``anchor_dtype`` for ``local_sgd`` (its row's
      build raises); and whatever the transformation raises for its arguments.

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
  num_fragments: int | None = None
  mixing: float = 0.0
  anchor_dtype: Any = None
  overlap: int = 0

  def __post_init__(self):
    fn = "RoundProtocol"
    row = _halves.row(self.algorithm, fn)
    if not row.takes_outer and self.outer is not None:
      raise ValueError(
        f"`{fn}(outer=...)` must be None for {self.algorithm} (it takes no outer optimizer),"
        f" got {self.outer!r}.")
    _checks.check_positive_int(fn, "sync_period", self.sync_period)
    if row.takes_fragments:
      self._check_fragments(fn)
    if ((self.num_fragments is not None and not row.takes_fragments)
        or (self.mixing != 0 and not row.takes_mixing)
        or (self.overlap != 0 and not row.takes_overlap)):
      owners = " and ".join(name for name, r in _halves.HALVES.items()
                            if r.takes_fragments or r.takes_mixing or r.takes_overlap)
      raise ValueError(
        f"`{fn}(num_fragments=..., mixing=..., overlap=...)` are {owners}'s, got"
        f" num_fragments={self.num_fragments!r}, mixing={self.mixing!r},"
        f" overlap={self.overlap!r} for {self.algorithm}.")
    self.tx  # builds the transformation: its own checks raise here

  def _check_fragments(self, fn: str) -> None:
    if self.num_fragments is None:
      object.__setattr__(self, "num_fragments", 4)
    _checks.check_positive_int(fn, "num_fragments", self.num_fragments)
    if self.num_fragments > self.sync_period:
      raise ValueError(
        f"`{fn}(num_fragments=...)` must be at most sync_period={self.sync_period} (one"
        f" fragment's exchange per round), got {self.num_fragments}.")

  # --------------------------------------------------------------------------------------------
  # What the replicas share: the transformation, the exchange, the compiled halves.

  @functools.cached_property
  def tx(self) -> optax.GradientTransformationExtraArgs:
    """The transformation for one worker (``axis_name=None``) whose ``update`` always runs
    with ``communicate=False``: the inner steps only (``local_step`` advances; the round
    boundary's exchange is the engine's, outside the program). A user's loop builds its
    optimizer as this (``TrainState.create(..., tx=protocol.tx)``, ``nnx.Optimizer(model,
    protocol.tx, wrt=nnx.Param)``)."""
    return _inner_steps_only(self._tx)

  @functools.cached_property
  def _tx(self) -> optax.GradientTransformationExtraArgs:
    return self.halves.build(self)

  @functools.cached_property
  def halves(self) -> _halves.Halves:
    """The algorithm's row of :data:`~optax_dist.fault_tolerance.halves.HALVES`."""
    return _halves.row(self.algorithm)

  @functools.cached_property
  def exchange(self) -> _exchange.Exchange:
    """The wire format of the payloads (named axis ``"replicas"``: quantized as the in-program
    exchange quantizes; only :meth:`~optax_dist.Exchange.payload` is called, no collective).
    A block-quantized payload is its codes and scales as the replica encoded them
    (``packed_payload``: :func:`~optax_dist._quantize.wire_bytes` on a wire), decoded at the
    merge (:meth:`merge`, :meth:`votes`) to the float32 values the in-program exchange adds."""
    return _exchange.Exchange(
      "replicas", comm_dtype=self.comm_dtype, comm_block_size=self.comm_block_size,
      call=self.algorithm, packed_payload=True,
    )

  @property
  def packed_payload(self) -> bool:
    """Whether a payload is block codes and scales (a block-quantized ``comm_dtype``), not
    values: part of the settings fingerprint, since an engine's all-gather of it differs in
    size from that of a version that sent the decoded float32 values."""
    return isinstance(self.exchange.comm_dtype, str)

  @functools.cached_property
  def outer_tx(self) -> optax.GradientTransformation:
    """The outer optimizer (``outer``, or the paper's default)."""
    return _outer.default_outer() if self.outer is None else self.outer

  def fragment(self, step: int) -> int | None:
    """The fragment whose exchange is due on ``update`` call ``step`` (from 1), or ``None``
    (``diloco``, ``local_sgd``: the whole tree)."""
    return self.halves.fragment(self, step)

  def round_steps(self, local_step: int) -> int:
    """The inner steps from ``local_step`` to the next round boundary (H, or about
    :math:`H/F` for ``streaming_diloco``)."""
    return self.halves.round_steps(self, local_step)

  def rounds_until(self, steps: int) -> int:
    r"""The round boundaries in ``update`` calls 1 to ``steps``: the rounds a run of ``steps``
    inner steps commits (:math:`\lfloor \mathrm{steps}/H \rfloor`, or for
    ``streaming_diloco`` the calls on which a fragment is due)."""
    return self.halves.rounds_until(self, steps)

  @property
  def payload_size_varies(self) -> bool:
    """Whether a payload's size depends on its round (``streaming_diloco``: one fragment's
    leaves): a member a round behind would send a payload of another size than the others'."""
    return self.halves.payload_size_varies

  def healed_payload(self, params: Any, opt_state: Any, step: int) -> Any:
    """What a member healed in the round ending on ``update`` call ``step`` sends (its weight
    0: left out of the merge) in place of its own payload, which is of its step before the
    heal: zeros of the round's payload (its fragment's tree, shapes and dtypes), as NumPy
    arrays; ``params`` and ``opt_state`` are its state after the heal (only their shapes and
    dtypes are read)."""
    return self.halves.healed_payload(self, params, opt_state, step)

  def _ids(self, params: Any) -> tuple[int, ...]:
    return _halves.leaf_fragments(self, params)

  def init(self, params: Any, opt_state: Any = None) -> ReplicaState:
    """A replica at step 0: ``opt_state`` (default :attr:`tx_init` of ``params``: a loop that
    built its own gives it, and ``tx.init`` is not run again), zero rounds (``local_sgd``: the
    average is ``params``)."""
    average = self.halves.initial_average(params)
    opt_state = self.tx_init(params) if opt_state is None else opt_state
    return ReplicaState(params, opt_state, jnp.zeros([], jnp.int32), average)

  @functools.cached_property
  def tx_init(self):
    """Jitted ``tx.init``: ``params -> opt_state`` in one program per tree structure (eager,
    ``tx.init`` runs a program per leaf), its arrays placed as :attr:`inner_step`'s outputs are
    (eager, its scalar counters are on no device in particular), so that step is compiled
    once."""
    return jax.jit(self.tx.init)

  @functools.cached_property
  def inner_step(self):
    """Jitted ``(params, opt_state, grads) -> (params, opt_state)``: one inner step."""

    def step(params, opt_state, grads):
      updates, opt_state = self.tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return jax.jit(step)

  @functools.cached_property
  def send_half(self):
    """Jitted ``(opt_state, new_params, fragment) -> (payload, residual)``: the local half at
    the round boundary (**send**), no collective: this replica's payload :math:`p_i` of its
    params :math:`x'_i` after the round's last inner step, and its residual candidate
    :math:`r'_i` (``None`` without error feedback); ``fragment`` (static) is the round's, or
    ``None``."""

    def half(opt_state, new_params, fragment):
      return self.halves.payload(self, opt_state, new_params, fragment)

    return jax.jit(half, static_argnums=2)

  @functools.cached_property
  def local_half(self):
    """Jitted ``(params, opt_state, grads, fragment) -> (params, opt_state, payload,
    residual)``: the round's last inner step, then :attr:`send_half` on its params (in one
    program); ``fragment`` (static) is the round's, or ``None``."""

    def half(params, opt_state, grads, fragment):
      updates, opt_state = self.tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      payload, residual = self.halves.payload(self, opt_state, new_params, fragment)
      return new_params, opt_state, payload, residual

    return jax.jit(half, static_argnums=3)

  @functools.cached_property
  def outer_half(self):
    """Jitted ``(origin, new_params, opt_state, average, merged, residual, fragment) ->
    (params, opt_state, average)``: the commit (**land**): the new anchor and outer state
    (``local_sgd``: the new average), and the params landed on it from ``origin``, the params
    before the round's last inner step, as the transformation's sync step lands them
    (``streaming_diloco``: the fragment's leaves, mixed with ``new_params`` by
    :math:`\alpha`; the other leaves are ``new_params``, the params after that step)."""

    def half(origin, new_params, opt_state, average, merged, residual, fragment):
      return self.halves.commit(
        self, origin, new_params, opt_state, average, merged, residual, fragment)

    return jax.jit(half, static_argnums=6)

  # --------------------------------------------------------------------------------------------
  # The round's outcome.

  def restart(self, params_like: Any, opt_state: Any, average: Any, fragment: int | None = None
              ) -> Any:
    """The params of an abort or a heal: the anchor (``local_sgd``: the last committed
    average) exactly, in ``params_like``'s dtypes; with ``fragment``, that fragment's leaves
    only (the others are ``params_like``'s)."""
    point = self.halves.restart_point(opt_state, average)
    leaves, treedef = jax.tree.flatten(params_like)
    ids = self._ids(params_like) if fragment is not None else [None] * len(leaves)
    return treedef.unflatten([
      jnp.asarray(a, jnp.result_type(p)) if i == fragment else p
      for a, p, i in zip(jax.tree.leaves(point), leaves, ids, strict=True)])

  @functools.cached_property
  def rebase(self):
    r"""Jitted ``(params, sent, before, after, fragment) -> params``: a replica of decoupled
    rounds (:mod:`~optax_dist.fault_tolerance.decoupled`) moved onto a received anchor with
    its own steps kept, :math:`\theta \leftarrow x_{\mathrm{new}} + (\theta - \theta_0)`,
    every leaf: :math:`x_{\mathrm{new}}` the anchor of ``after`` and :math:`\theta_0` the
    anchor of ``before`` (each an ``(opt_state, average)`` pair; ``local_sgd``: the average),
    except on ``fragment``'s leaves (every leaf with ``None``) when ``sent`` is given: there
    :math:`\theta_0` is ``sent``, the params its merged payload was measured at (a late
    landing). In the wider of the anchor's and the leaf's dtypes, cast to the leaf's;
    ``fragment`` is static."""

    def rebased(params, sent, before, after, fragment):
      old = jax.tree.leaves(self.halves.restart_point(*before))
      new = jax.tree.leaves(self.halves.restart_point(*after))
      leaves, treedef = jax.tree.flatten(params)
      ids = self._ids(params) if fragment is not None else [None] * len(leaves)
      refs = [None] * len(leaves) if sent is None else jax.tree.leaves(sent)
      return treedef.unflatten([
        _moved(n, p, o if b is None or i != fragment else b)
        for n, o, p, b, i in zip(new, old, leaves, refs, ids, strict=True)])

    return jax.jit(rebased, static_argnums=4)

  def run_round(self, replica: ReplicaState, grads: Callable[[Any, int], Any]
                ) -> tuple[ReplicaState, Sent]:
    """The replica's inner steps up to the round boundary, the last with the local half.

    Args:
      replica: its state at the round's start.
      grads: ``(params, step) -> grads``, ``step`` its ``local_step`` before the step (its data
        position).

    Returns:
      ``(replica, sent)``: the state after the steps (``local_step`` advanced by
      ``sent.steps``) and its :class:`Sent`.
    """
    params, opt_state = replica.params, replica.opt_state
    steps = self.round_steps(_step(opt_state))
    for _ in range(steps - 1):
      params, opt_state = self.inner_step(params, opt_state, grads(params, _step(opt_state)))
    origin, fragment = params, self.fragment(_step(opt_state) + 1)
    params, opt_state, payload, residual = self.local_half(
      params, opt_state, grads(params, _step(opt_state)), fragment)
    sent = Sent(origin, payload, residual, steps)
    return replica._replace(params=params, opt_state=opt_state), sent

  def commit(self, replica: ReplicaState, merged: Any, sent: Sent | None = None
             ) -> ReplicaState:
    """The replica after a committed round: the outer half on ``merged`` (the round's
    fragment's, for ``streaming_diloco``), the params landed from its round's origin (see
    :attr:`outer_half`), its residual candidate taken, ``rounds + 1``. ``sent=None`` (it
    healed or joined this round and sent nothing): from its params, its residual kept."""
    if sent is None:
      sent = Sent(replica.params, None, getattr(replica.opt_state, "error_feedback", None), 0)
    params, opt_state, average = self.outer_half(
      sent.origin, replica.params, replica.opt_state, replica.average, merged, sent.residual,
      self.fragment(_step(replica.opt_state)))
    return ReplicaState(params, opt_state, replica.rounds + 1, average)

  def abort(self, replica: ReplicaState) -> ReplicaState:
    """The replica after an aborted round: params back to the restart point (the round's
    fragment's leaves only, for ``streaming_diloco``), the state as it was (the residual
    candidate dropped; ``local_step`` has advanced by the round's steps)."""
    params = self.restart(replica.params, replica.opt_state, replica.average,
                          self.fragment(_step(replica.opt_state)))
    return replica._replace(params=params)

  @staticmethod
  def merge(payloads: list, weights: list, total: float | None = None) -> Any:
    """The members' payloads merged in rank order: :func:`optax_dist.merge_payloads` of them
    (packed ones decoded first), unweighted when every weight is equal and ``total`` is
    ``None`` or their sum (:math:`\\sum_i p_i / n`), else token-weighted
    (:math:`\\sum_i w_i p_i / \\sum_i w_i`, or over ``total``)."""
    if len(set(weights)) == 1 and total in (None, sum(weights)):
      return _exchange.merge_payloads(payloads)
    return _exchange.merge_payloads(payloads, weights, total=total)

  @staticmethod
  def votes(payload: Any) -> bool:
    """A member's vote: yes iff every value of its payload is finite (a packed payload's
    decoded values, :func:`optax_dist._exchange.unpacked`), read on the host (NumPy: no
    program per leaf)."""
    return all(bool(np.isfinite(np.asarray(x)).all())
               for x in jax.tree.leaves(_exchange.unpacked(payload)))


def _inner_steps_only(tx: optax.GradientTransformationExtraArgs
                      ) -> optax.GradientTransformationExtraArgs:
  """``tx`` with ``communicate=False`` forced on every ``update`` call."""

  def update(updates, state, params=None, **extra_args):
    return tx.update(updates, state, params, **{**extra_args, "communicate": False})

  return optax.GradientTransformationExtraArgs(tx.init, update)


def _step(opt_state: Any) -> int:
  return int(opt_state.local_step)


def _moved(anchor: Any, params: Any, ref: Any) -> Any:
  """``anchor + (params - ref)`` in the wider of ``anchor``'s and ``params``' dtypes, cast to
  ``params``'."""
  wide = jnp.promote_types(anchor.dtype, params.dtype)
  return (anchor.astype(wide) + (params.astype(wide) - ref.astype(wide))).astype(params.dtype)
