"""The round's decision, pure: the members' headers and payloads in, the merged payload or an
abort out.

Every engine (the in-process ones and the torchft one) gathers the same things from a round's
members, in rank order: a :class:`Header` each, then each member's payload; every member then
calls :func:`decide` on the same inputs and so reaches the same outcome with the same bits.
:func:`check_headers` is the part that needs the headers only: an engine whose transport
cannot gather payloads of different sizes calls it before the payloads' all-gather.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

HEADER = ("slot", "weight", "ok", "fingerprint", "step")
"""The fields of :class:`Header`, in the order an engine sends them as int64s."""


class Header(NamedTuple):
  """What a member says of itself before its payload (int64s on the wire).

  Attributes:
    slot: its replica id (its data slot).
    weight: its merge weight: the tokens it processed in the round from the current global
      state, 0 if it healed or joined in the round.
    ok: 1 unless its quorum or its heal failed (a member with ``ok == 0`` makes the round
      abort).
    fingerprint: its :func:`settings_fingerprint`.
    step: its ``local_step`` after the round's inner steps (its data position).
  """

  slot: int
  weight: int
  ok: int
  fingerprint: int
  step: int


class Decision(NamedTuple):
  """A round's outcome, the same on every member that decided on the same inputs.

  Attributes:
    merged: the merged payload (:meth:`RoundProtocol.merge` of the voters' payloads in rank
      order), or ``None``: the round aborts.
    voters: the slots whose payloads were merged, in rank order (``()`` on an abort).
    step: the round's step: the most advanced member's ``local_step``. A member behind it was
      left out of an aborted quorum; its round is void (it aborts and takes this step).
    reason: why the round aborts (``""`` when it commits).
  """

  merged: Any
  voters: tuple
  step: int
  reason: str


def settings_fingerprint(protocol: Any, params: Any, *, seed: int, tokens_per_step: int,
                         run_id: str | None = None) -> int:
  """A signed 64-bit int (the first 8 bytes of a sha256) of what every replica of a run must
  share: the protocol's algorithm, H, wire format, error feedback, fragments and mixing, and its
  anchor dtype and overlap when given; the params' tree, dtypes and shapes; the data seed; the tokens
  per step; the run's id when one is given (its launcher's: two runs of the same settings then
  differ too). Not covered: the optimizers' hyperparameters (optax transformations are
  closures).

  ``anchor_dtype=None``, ``overlap=0`` and ``run_id=None`` add nothing, so a run without them has the
  fingerprint it had before the fields existed (its checkpoints restore). A block-quantized
  payload (``protocol.packed_payload``) adds that it is sent as codes and scales: replicas of
  a version that sent float32 values are of another run (their all-gathers differ in size)."""
  fields = [protocol.algorithm, protocol.sync_period, str(protocol.comm_dtype),
            protocol.comm_block_size, protocol.error_feedback, protocol.num_fragments,
            protocol.mixing, seed, tokens_per_step]
  if getattr(protocol, "anchor_dtype", None) is not None:
    fields.append(["anchor_dtype", jnp.dtype(protocol.anchor_dtype).name])
  if getattr(protocol, "overlap", 0):
    fields.append(["overlap", int(protocol.overlap)])
  if run_id is not None:
    fields.append(["run_id", str(run_id)])
  if getattr(protocol, "packed_payload", False):  # its codes on the wire, not float32 values
    fields.append(["payload", "packed"])
  fields += [[jax.tree_util.keystr(path), str(np.asarray(x).dtype), list(np.shape(x))]
             for path, x in jax.tree_util.tree_leaves_with_path(params)]
  digest = hashlib.sha256(json.dumps(fields, default=str).encode()).digest()
  return int.from_bytes(digest[:8], "big", signed=True)


def foreign(heads: Sequence[Header], fingerprint: int) -> list[int]:
  """The slots of the members (rank order) whose fingerprint is not ``fingerprint``, the
  asking replica's own: replicas of another run, or of other settings. Membership is each
  replica's own fingerprint, never a count of the members': with two runs in a quorum, every
  member finds the other run's members foreign (and :func:`check_headers` aborts the round)."""
  return [h.slot for h in heads if h.fingerprint != fingerprint]


def leaves(heads: Sequence[Header], fingerprint: int, *, holds_rounds: bool) -> bool:
  """Whether the replica of ``fingerprint`` leaves the run (its engine raises; exit status 2)
  after a round with these members: it met a :func:`foreign` member and holds none of the
  rounds its Lighthouse committed (``holds_rounds``: it committed one there, or healed from a
  member of its own fingerprint that had).

  So the run whose rounds the Lighthouse holds keeps it, and a replica of another run that joins
  leaves after its first round with the run's members: that round aborts on every member (no
  payload merged, no state taken either way), the only one it costs the run. Not a count: a
  foreign replica at rank 0 of two, or most of a quorum, leaves the same.
  """
  return bool(foreign(heads, fingerprint)) and not holds_rounds


def check_headers(protocol: Any, heads: Sequence[Header], *, min_replicas: int) -> str:
  """Why the round aborts from its headers alone, or ``""``.

  In this order: fewer than ``min_replicas`` members; members of different fingerprints (each
  member finds some :func:`foreign`, so it aborts on every member and no payload is merged); a
  member that reported a failed quorum or heal (``ok == 0``); a member a round behind when the
  protocol's payloads differ in size from round to round (``streaming_diloco``'s fragments: a
  transport cannot gather them together); no member with weight > 0 at the round's step (no
  payload to merge).
  """
  if len(heads) < min_replicas:
    return f"{len(heads)} members, fewer than min_replicas={min_replicas}"
  runs: dict[int, list[int]] = {}
  for h in heads:
    runs.setdefault(h.fingerprint, []).append(h.slot)
  if len(runs) > 1:
    held = "; ".join(f"replicas {slots}: fingerprint {fp}" for fp, slots in runs.items())
    return f"members of different settings or runs ({held})"
  failed = [h.slot for h in heads if not h.ok]
  if failed:
    return f"replicas {failed}: quorum or heal failed"
  step = max(h.step for h in heads)
  behind = [h.slot for h in heads if h.step < step]
  if behind and protocol.payload_size_varies:
    return f"replicas {behind}: a round behind (a payload of another fragment)"
  if not any(h.weight > 0 and h.step == step for h in heads):
    return "no payload"
  return ""


def decide(protocol: Any, heads: Sequence[Header], payloads: Sequence[Any], *,
           min_replicas: int, total: float | None = None) -> Decision:
  """The round's outcome from its members' headers and payloads (rank order).

  The round commits iff :func:`check_headers` finds nothing and every voter's payload votes
  yes (:meth:`RoundProtocol.votes`: every value finite). The voters are the members with
  weight > 0 at the round's step; their payloads are merged in rank order, token-weighted when
  the weights differ (:meth:`RoundProtocol.merge`; over ``total`` in place of the voters'
  weights' sum if given).

  Args:
    protocol: the run's :class:`RoundProtocol`.
    heads: the members' :class:`Header`\\ s, in rank order (non-empty).
    payloads: one per member, in rank order; a non-voter's is not read (``None`` allowed).
    min_replicas: the smallest quorum that commits.
    total: the merge's divisor (``None``: the voters' weights' sum).

  Returns:
    A :class:`Decision`.
  """
  step = max(h.step for h in heads)
  reason = check_headers(protocol, heads, min_replicas=min_replicas)
  if reason:
    return Decision(None, (), step, reason)
  voters = [(h, p) for h, p in zip(heads, payloads, strict=True)
            if h.weight > 0 and h.step == step]
  bad = [h.slot for h, p in voters if not protocol.votes(p)]
  if bad:
    return Decision(None, (), step, f"replicas {bad}: a non-finite payload")
  merged = protocol.merge([p for _, p in voters], [h.weight for h, _ in voters], total)
  return Decision(merged, tuple(h.slot for h, _ in voters), step, "")
