"""The heal payload: a donor's :class:`~optax_dist.fault_tolerance.HealState` (its global state
and counters) as a JSON manifest and raw bytes, never a pickle.

Layout of one payload (the exact bytes a transport sends)::

  MAGIC (b"optax_dist-heal/1\\n") | manifest length (8 bytes, big-endian) | manifest (UTF-8 JSON)
  | the leaves' bytes, end to end, in the manifest's order

The manifest is ``{"hash": <sha256 hex of the state>, "leaves": [[path, dtype, shape,
nbytes], ...]}``: strings and integers only. The receiver checks it against the tree it
expects (its own state's paths, dtypes and shapes) before reading a byte of data, rebuilds the
arrays with its own dtypes, and checks the hash of what it rebuilt. Nothing received is
unpickled or evaluated.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_dist.fault_tolerance import protocol

MAGIC = b"optax_dist-heal/1\n"
_LENGTH = 8


def _leaves(tree: Any) -> list[tuple[str, np.ndarray]]:
  return [(jax.tree_util.keystr(path), np.asarray(leaf, order="C"))
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def encode_heal(state: protocol.HealState) -> bytes:
  """A state as one heal payload: the magic, the manifest and the leaves' raw bytes.

  Args:
    state: the donor's :class:`HealState` (:func:`heal_state`), or any tree of arrays (a
      :class:`GlobalState`).

  Returns:
    ``bytes``: the payload, of ``len(MAGIC) + 8 + len(manifest) + Σ nbytes`` bytes.
  """
  leaves = _leaves(state)
  manifest = {
    "hash": protocol.state_hash(state),
    "leaves": [[path, str(a.dtype), list(a.shape), a.nbytes] for path, a in leaves],
  }
  head = json.dumps(manifest, separators=(",", ":")).encode()
  data = (a.tobytes() for _, a in leaves)
  return b"".join([MAGIC, len(head).to_bytes(_LENGTH, "big"), head, *data])


def decode_heal(payload: Any, expected: protocol.HealState, *, replica: str
                ) -> protocol.HealState:
  """A received heal payload checked against the expected tree, then rebuilt.

  The checks, in order, before any array is built: ``payload`` is ``bytes`` starting with
  ``MAGIC`` (a pickle or any other format is refused here, unread); the manifest is JSON
  holding one ``[path, dtype, shape, nbytes]`` per leaf of ``expected``, equal to its path,
  dtype and shape; the data is exactly ``Σ nbytes`` long. After: the rebuilt state's
  :func:`state_hash` is the manifest's.

  Args:
    payload: the received bytes.
    expected: a state of the tree the payload must hold, the run's dtypes and shapes (e.g. the
      receiver's own :func:`heal_state`, or of its fresh ``init``); only its structure, paths,
      dtypes and shapes are read.
    replica: the sending replica's id, named in every error.

  Returns:
    ``expected``'s tree (a :class:`HealState`), leaves as ``jax.Array`` of its dtypes.

  Raises:
    TypeError: ``payload`` not ``bytes``.
    ValueError: no ``MAGIC`` (naming the replica); a manifest that is not the expected JSON; a
      leaf whose path, dtype or shape differs (naming the replica and the leaf); data of the
      wrong length; a hash mismatch.
  """
  if not isinstance(payload, (bytes, bytearray)):
    raise TypeError(
      f"`decode_heal(payload=...)` from replica {replica!r} must be bytes, got"
      f" {type(payload).__name__}.")
  head, data = _split(bytes(payload), replica)
  want = _leaves(expected)
  _check_manifest(head, want, replica)
  total = sum(a.nbytes for _, a in want)
  if len(data) != total:
    raise ValueError(
      f"heal payload from replica {replica!r} holds {len(data)} bytes of data, expected {total}.")
  arrays, offset = [], 0
  for _, a in want:
    arrays.append(jnp.asarray(np.frombuffer(data, a.dtype, a.size, offset).reshape(a.shape)))
    offset += a.nbytes
  state = jax.tree.unflatten(jax.tree.structure(expected), arrays)
  if protocol.state_hash(state) != head["hash"]:
    raise ValueError(
      f"heal payload from replica {replica!r}: the rebuilt state's hash is not the manifest's"
      f" {head['hash']!r} (corrupted bytes).")
  return state


def heal_replica(round_protocol: protocol.RoundProtocol, payload: Any,
                 joiner: protocol.ReplicaState, params_like: Any, *, replica: str
                 ) -> protocol.ReplicaState:
  """A joiner rebuilt from a donor's payload (:func:`encode_heal` of its :func:`heal_state`):
  :func:`decode_heal` against the joiner's own :func:`heal_state`, then :func:`local_state`
  with the donor's counters.

  Raises:
    TypeError, ValueError: as :func:`decode_heal`, naming ``replica`` (the donor).
  """
  received = decode_heal(payload, protocol.heal_state(joiner), replica=replica)
  return protocol.local_state(round_protocol, received.global_state, params_like,
                              received.counters)


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
