"""The heal room: the state split (what every committed member holds alike, what a donor sends
a joiner), the state hash, and the one tree codec that heal payloads, checkpoints and gathered
payloads use.

* :class:`GlobalState` (:func:`global_state`), :class:`HealState` (:func:`heal_state`: the
  global state and :func:`counters`), :func:`local_state` (a joiner rebuilt from them),
  :class:`LocalState` (:func:`local_part`: a replica's own, which its checkpoint holds) and
  :func:`resumed_state` (a replica rebuilt whole from both), and :func:`state_hash`;
* :func:`tree_bytes` and :func:`tree_from_bytes`: a tree's leaves as bytes, end to end, and
  back into a tree of the receiver's own structure, dtypes and shapes;
* the heal payload (:func:`encode_heal`, :func:`decode_heal`): a JSON manifest and those bytes,
  never a pickle; :func:`heal_bound`, the most bytes a receiver reads of one.

Layout of one heal payload (the exact bytes a transport sends and a checkpoint holds)::

  MAGIC (b"optax_dist-heal/1\\n") | manifest length (8 bytes, big-endian) | manifest (UTF-8 JSON)
  | the leaves' bytes, end to end, in the manifest's order

The manifest is ``{"fingerprint": <the donor run's settings fingerprint>, "hash": <sha256 hex
of the state>, "leaves": [[path, dtype, shape, nbytes], ...]}``: strings and integers only
(``fingerprint`` only when the sender names its run: a replica's heal does, a checkpoint's
payload does not, its JSON does). The receiver checks it against its own run's fingerprint and
the tree it expects (its own state's paths, dtypes and shapes) before reading a byte of data,
rebuilds the arrays with its own dtypes, and checks the hash of what it rebuilt. Nothing
received is unpickled or evaluated.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_dist import _state
from optax_dist.fault_tolerance.protocol import ReplicaState, RoundProtocol

MAGIC = b"optax_dist-heal/1\n"
_LENGTH = 8


def _leaves(tree: Any) -> list[tuple[str, np.ndarray]]:
  return [(jax.tree_util.keystr(path), np.asarray(leaf, order="C"))
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def tree_bytes(tree: Any) -> bytes:
  """The tree codec's data: every leaf's bytes (C order), end to end, in ``jax.tree`` order.
  A heal payload's data (:func:`encode_heal`), a checkpoint's, and a payload an engine gathers
  are these bytes."""
  return b"".join(a.tobytes() for _, a in _leaves(tree))


def tree_from_bytes(data: bytes, like: Any) -> Any:
  """The inverse of :func:`tree_bytes`: ``like``'s tree, dtypes and shapes (arrays or shape
  and dtype structs) rebuilt from ``data`` as ``jax.Array`` leaves (copies, put on the default
  device: no program).

  Raises:
    ValueError: ``data`` is not exactly the bytes ``like``'s leaves hold.
  """
  leaves = [np.empty(np.shape(x), np.dtype(x.dtype)) for x in jax.tree.leaves(like)]
  total = sum(x.nbytes for x in leaves)
  if len(data) != total:
    raise ValueError(f"{len(data)} bytes of data where the tree holds {total}.")
  arrays, offset = [], 0
  for x in leaves:
    array = np.frombuffer(data, x.dtype, x.size, offset).reshape(x.shape)
    arrays.append(jax.device_put(array, may_alias=False))
    offset += x.nbytes
  return jax.tree.unflatten(jax.tree.structure(like), arrays)


def encode_heal(state: HealState, *, fingerprint: int | None = None) -> bytes:
  """A state as one heal payload: the magic, the manifest and the leaves' raw bytes.

  Args:
    state: the donor's :class:`HealState` (:func:`heal_state`), or any tree of arrays (a
      :class:`GlobalState`).
    fingerprint: the donor run's settings fingerprint
      (:func:`~optax_dist.fault_tolerance.decision.settings_fingerprint`), named in the
      manifest; ``None``: none named (a checkpoint's payload: its JSON names it).

  Returns:
    ``bytes``: the payload, of ``len(MAGIC) + 8 + len(manifest) + Σ nbytes`` bytes.
  """
  leaves = _leaves(state)
  manifest = {} if fingerprint is None else {"fingerprint": int(fingerprint)}
  manifest.update(
    hash=state_hash(state),
    leaves=[[path, str(a.dtype), list(a.shape), a.nbytes] for path, a in leaves])
  head = json.dumps(manifest, separators=(",", ":")).encode()
  return b"".join([MAGIC, len(head).to_bytes(_LENGTH, "big"), head, tree_bytes(state)])


def heal_bound(tree: Any) -> int:
  """The most bytes a heal of ``tree`` (a receiver's own donation: the tree it expects) may
  take, as the contract's trust rule has the receiver compute it from its own tree: the leaves'
  bytes, per leaf its manifest entry (its path's JSON and 256 bytes for dtype, shape and size),
  and 64 KiB for the magic, the fingerprint, the hash and torchft's counters. A heal transport
  (:class:`~optax_dist.fault_tolerance.torchft_session.HealTransport`) refuses a frame of more.
  """
  return 65536 + sum(x.nbytes + len(json.dumps(jax.tree_util.keystr(path))) + 256
                     for path, x in jax.tree_util.tree_leaves_with_path(tree))


def decode_heal(payload: Any, expected: HealState, *, replica: str,
                fingerprint: int | None = None) -> HealState:
  """A received heal payload checked against the run's fingerprint and the expected tree, then
  rebuilt.

  The checks, in order, before any array is built: ``payload`` is ``bytes`` starting with
  ``MAGIC`` (a pickle or any other format is refused here, unread); the manifest is JSON;
  with ``fingerprint`` given, it names that fingerprint (a donor of another run, or a payload
  that names none, is refused before a byte of its data is read); it holds one ``[path, dtype,
  shape, nbytes]`` per leaf of ``expected``, equal to its path, dtype and shape; the data is
  exactly ``Σ nbytes`` long. After: the rebuilt state's :func:`state_hash` is the manifest's.

  Args:
    payload: the received bytes.
    expected: a state of the tree the payload must hold, the run's dtypes and shapes (e.g. the
      receiver's own :func:`heal_state`, or of its fresh ``init``); only its structure, paths,
      dtypes and shapes are read.
    replica: the sending replica's id, named in every error.
    fingerprint: the receiver's own settings fingerprint, which the manifest must name;
      ``None``: not checked (a checkpoint, whose JSON :mod:`~optax_dist.fault_tolerance.
      checkpoints` checks).

  Returns:
    ``expected``'s tree (a :class:`HealState`), leaves as ``jax.Array`` of its dtypes.

  Raises:
    TypeError: ``payload`` not ``bytes``.
    ValueError: no ``MAGIC`` (naming the replica); a manifest that is not the expected JSON; a
      manifest naming another fingerprint than ``fingerprint``, or none (naming both); a leaf
      whose path, dtype or shape differs (naming the replica and the leaf); data of the wrong
      length; a hash mismatch.
  """
  if not isinstance(payload, (bytes, bytearray)):
    raise TypeError(
      f"`decode_heal(payload=...)` from replica {replica!r} must be bytes, got"
      f" {type(payload).__name__}.")
  head, data = _split(bytes(payload), replica)
  named = head.get("fingerprint")
  if fingerprint is not None and (named != fingerprint or isinstance(named, bool)):
    what = "names no run" if named is None else f"is of another run (fingerprint {named!r})"
    raise ValueError(
      f"heal payload from replica {replica!r} {what}, this run's fingerprint is {fingerprint}:"
      " refused unread (a replica of another run on this Lighthouse?).")
  want = _leaves(expected)
  _check_manifest(head, want, replica)
  total = sum(a.nbytes for _, a in want)
  if len(data) != total:
    raise ValueError(
      f"heal payload from replica {replica!r} holds {len(data)} bytes of data, expected {total}.")
  state = tree_from_bytes(data, expected)
  if state_hash(state) != head["hash"]:
    raise ValueError(
      f"heal payload from replica {replica!r}: the rebuilt state's hash is not the manifest's"
      f" {head['hash']!r} (corrupted bytes).")
  return state


def heal_replica(round_protocol: RoundProtocol, payload: Any, joiner: ReplicaState,
                 params_like: Any, *, replica: str) -> ReplicaState:
  """A joiner rebuilt from a donor's payload (:func:`encode_heal` of its :func:`heal_state`):
  :func:`decode_heal` against the joiner's own :func:`heal_state`, then :func:`local_state`
  with the donor's inner state.

  Raises:
    TypeError, ValueError: as :func:`decode_heal`, naming ``replica`` (the donor).
  """
  received = decode_heal(payload, heal_state(joiner), replica=replica)
  return local_state(round_protocol, received.global_state, params_like, received.inner)


def _split(payload: bytes, replica: str) -> tuple[dict, bytes]:
  """The manifest (parsed JSON) and the data of a payload that starts with ``MAGIC``."""
  if not payload.startswith(MAGIC):
    raise ValueError(
      f"heal payload from replica {replica!r} does not start with {MAGIC!r} (a pickle or"
      " another format?): refused unread.")
  start = len(MAGIC) + _LENGTH
  length = int.from_bytes(payload[len(MAGIC):start], "big")
  try:
    head = json.loads(payload[start:start + length].decode())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(
      f"heal payload from replica {replica!r}: the manifest is not JSON ({e}).") from None
  if not (isinstance(head, dict) and isinstance(head.get("hash"), str)
          and isinstance(head.get("leaves"), list)):
    raise ValueError(
      f"heal payload from replica {replica!r}: the manifest must be {{'hash': str, 'leaves':"
      " list}}.")
  return head, payload[start + length:]


def _check_manifest(head: dict, want: list, replica: str) -> None:
  got = head["leaves"]
  if len(got) != len(want):
    raise ValueError(
      f"heal payload from replica {replica!r} has {len(got)} leaves, expected {len(want)}.")
  for entry, (path, a) in zip(got, want, strict=True):
    if not (isinstance(entry, list) and len(entry) == 4):
      raise ValueError(
        f"heal payload from replica {replica!r}: leaf {path}'s manifest entry must be [path,"
        f" dtype, shape, nbytes], got {entry!r}.")
    if entry[0] != path:
      raise ValueError(
        f"heal payload from replica {replica!r}: a leaf is at {entry[0]!r} where {path} is"
        " expected (another tree).")
    if entry[1:3] != [str(a.dtype), list(a.shape)]:
      raise ValueError(
        f"heal payload from replica {replica!r}: leaf {path} has dtype {entry[1]!r} and shape"
        f" {entry[2]!r}, expected {str(a.dtype)!r} and {list(a.shape)!r}.")
    if entry[3] != a.nbytes:
      raise ValueError(
        f"heal payload from replica {replica!r}: leaf {path} has {entry[3]!r} bytes, expected"
        f" {a.nbytes}.")


class GlobalState(NamedTuple):
  """What every committed replica holds identically after a round: what a joiner receives.

  Attributes:
    rounds: ``int32[]``, the run's committed rounds so far.
    opt_state: the replica's optimizer state with the fields :func:`optax_dist.resize_state`
      keeps (``RESIZE`` rule ``KEEP``: ``local_step``, ``anchor``, ``outer_state``; with
      ``streaming_diloco``'s overlap the fragments in flight, ``in_flight``,
      ``in_flight_step``) and
      ``None`` in place of the rest (the inner state, the error-feedback residual).
    average: ``local_sgd`` only: the last committed model average (the params' tree, shapes
      and dtypes), where the params restart; ``None`` for ``diloco`` (they restart from the
      anchor).
  """

  rounds: jax.Array
  opt_state: Any
  average: Any


class HealState(NamedTuple):
  """What a donor sends a joiner (:func:`heal_state`): its global state and its inner
  optimizer state.

  Attributes:
    global_state: the donor's :class:`GlobalState`.
    inner: the donor's optimizer state with its inner optimizer state kept (its moments at the
      same anchor, its counts) and ``None`` elsewhere (:func:`inner_state`).
  """

  global_state: GlobalState
  inner: Any


class LocalState(NamedTuple):
  """A replica's own state beside the global state (:func:`local_part`): what its checkpoint
  of a committed round holds besides the run's (:mod:`~optax_dist.fault_tolerance.checkpoints`).

  Attributes:
    rounds: ``int32[]``, its committed rounds (the round the global state must be of).
    params: its params.
    opt_state: its optimizer state with ``None`` in the fields :func:`global_state` holds
      (``KEEP``) and every other field kept: the inner optimizer state, the error-feedback
      residual.
  """

  rounds: jax.Array
  params: Any
  opt_state: Any


# ----------------------------------------------------------------------------------------------
# The state split: what every committed member holds alike, what a donor sends.


def _global_parts(node: Any) -> Any:
  """``node`` with the fields ``resize_state`` keeps (``KEEP``) and ``None`` elsewhere."""
  return _state.map_fields(
    lambda rule, value: value if rule == _state.KEEP else _global_parts(value),
    lambda _: None, node)


def _inner_parts(node: Any) -> Any:
  """``node`` with the fields ``resize_state`` walks as an inner state (``INNER``) kept whole,
  ``None`` in the others, and any other optimizer state (e.g. a chain's) kept."""
  return _state.map_fields(
    lambda rule, value: value if rule == _state.INNER else None, lambda other: other, node)


def _local_parts(node: Any) -> Any:
  """``node`` with ``None`` in the fields ``resize_state`` keeps (``KEEP``) and the rest kept:
  the complement of :func:`_global_parts`."""
  return _state.map_fields(
    lambda rule, value: None if rule == _state.KEEP else _local_parts(value),
    lambda other: other, node)


def _joined(global_parts: Any, local_parts: Any) -> Any:
  """One optimizer state from its :func:`_global_parts` and its :func:`_local_parts`."""
  return _state.map_fields(
    lambda rule, g, own: g if rule == _state.KEEP else _joined(g, own),
    lambda _, own: own, global_parts, local_parts)


def _counter_parts(node: Any) -> Any:
  """``node`` outside its ``KEEP`` fields with each counter kept and ``None`` elsewhere."""
  return _state.map_fields(
    lambda rule, value: None if rule == _state.KEEP else _counter_parts(value), _counters, node)


def _counters(node: Any) -> Any:
  """A subtree holding no library state with each counter kept and ``None`` elsewhere: a
  counter is one optax state (``ScaleByScheduleState``, ...) or loose leaf holding no floating
  array."""
  if _state.is_record(node) or _state.is_leaf(node):
    leaves = jax.tree.leaves(node)
    floating = any(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves)
    return None if floating or not leaves else node
  kids, treedef = _state.children(node)
  return treedef.unflatten([_counters(c) for c in kids])


def counters(replica: ReplicaState) -> Any:
  r"""A replica's counters: the parts of its inner optimizer state that hold no floating array
  (a learning-rate schedule's count, ``inject_hyperparams``' count), in its optimizer state's
  tree with ``None`` elsewhere (the global fields, moments, traces, the residual).

  Every member of a round takes the round's inner steps, so a counter that advances once per
  inner step is the same on every replica; :func:`optax_dist.resize_state`'s ``"reset"`` rule
  keeps such a state. A joiner takes its donor's (:func:`local_state`), so its learning-rate
  schedule goes on where the run's is. An optax state with a floating array restarts whole
  (adam's count with its moments). Not in :func:`global_state` nor its hash: a member that was
  left out of an aborted quorum takes the others' ``local_step`` but keeps its counters, a
  round's steps behind.
  """
  return _counter_parts(replica.opt_state)


def inner_state(replica: ReplicaState) -> Any:
  r"""A replica's inner optimizer state (the fields :func:`optax_dist.resize_state` walks as
  the inner state: its moments, traces and counts), in its optimizer state's tree with
  ``None`` elsewhere (the global fields, the error-feedback residual).

  Local: not in :func:`global_state` nor its hash. A donor sends it with a heal
  (:func:`heal_state`): its moments are at the same anchor as the joiner's restart point, so a
  joiner that takes them meets the run's learning rate with the run's moments, not with fresh
  ones.
  """
  return _inner_parts(replica.opt_state)


def heal_state(replica: ReplicaState) -> HealState:
  """What a donor sends a joiner: :func:`global_state` and :func:`inner_state`."""
  return HealState(global_state(replica), inner_state(replica))


def advanced(opt_state: Any, steps: int) -> Any:
  """``opt_state`` with its ``local_step`` and every integer counter of its inner state
  (:func:`inner_state`: a schedule's count, adam's count) moved on by ``steps``, each placed
  as before: a replica left out of an aborted quorum while the others took a round's inner
  steps takes their step and their counts (its moments stay its own)."""
  def move(x):
    return x + jnp.asarray(steps, x.dtype) if jnp.issubdtype(x.dtype, jnp.integer) else x

  moved = _state.map_fields(
    lambda rule, value: jax.tree.map(move, value) if rule == _state.INNER else value,
    lambda other: jax.tree.map(move, other), opt_state)
  return moved._replace(local_step=move(moved.local_step))


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


def local_state(protocol: RoundProtocol, received: GlobalState, params_like: Any,
                inner: Any = None) -> ReplicaState:
  r"""A joiner's ``(params, opt_state)`` rebuilt from a received :class:`GlobalState`.

  The global fields are taken bit for bit, and so is ``inner`` (the donor's
  :func:`inner_state`: its moments at the same anchor and its counts) where given; the rest
  comes from ``tx.init`` at the restart point: params = the anchor (``local_sgd``: the
  average) in ``params_like``'s dtypes, the error-feedback residual zero (and, without
  ``inner``, the inner optimizer state at its ``init``, as :func:`optax_dist.resize_state`'s
  ``"reset"`` rule restarts a worker's: moments zero, counts 0).

  Args:
    protocol: the run's :class:`RoundProtocol`.
    received: the donor's global state (decoded by :func:`decode_heal`).
    params_like: params of the run's tree, shapes and dtypes (e.g. the initial params).
    inner: the donor's :func:`inner_state`, or ``None``.

  Returns:
    A :class:`ReplicaState` whose :func:`global_state` is ``received`` (and whose
    :func:`inner_state` is ``inner``, if given).
  """
  params = protocol.restart(params_like, received.opt_state, received.average)
  init = protocol.tx_init(params)
  if inner is not None:
    init = jax.tree.map(_taken, inner, init, is_leaf=lambda x: x is None)
  opt_state = jax.tree.map(_taken, received.opt_state, init, is_leaf=lambda x: x is None)
  return ReplicaState(params, opt_state, received.rounds, received.average)


def local_part(replica: ReplicaState) -> LocalState:
  """A replica's :class:`LocalState`: its committed rounds, params and optimizer state outside
  :func:`global_state` (its inner optimizer state, its error-feedback residual)."""
  return LocalState(replica.rounds, replica.params, _local_parts(replica.opt_state))


def resumed_state(received: GlobalState, own: LocalState) -> ReplicaState:
  r"""A replica rebuilt whole from the global state and its own :class:`LocalState` of the same
  committed round, bit for bit: the :class:`ReplicaState` whose :func:`global_state` is
  ``received`` and whose :func:`local_part` is ``own`` (a resume; a heal rebuilds the local
  state instead, :func:`local_state`).

  Raises:
    ValueError: ``own`` is of another committed round than ``received``.
  """
  if int(own.rounds) != int(received.rounds):
    raise ValueError(f"a replica's local state is of round {int(own.rounds)}, the global state"
                     f" of round {int(received.rounds)}: not one checkpoint.")
  opt_state = _joined(received.opt_state, own.opt_state)
  return ReplicaState(own.params, opt_state, received.rounds, received.average)


def _taken(received: Any, init: Any) -> Any:
  """``received`` where it is not ``None``, else ``init``."""
  return init if received is None else received


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
