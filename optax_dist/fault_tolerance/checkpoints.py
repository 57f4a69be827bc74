"""Checkpoints of a fault-tolerant run: its global state, written by the quorum's rank 0, and
each member's local state of the same committed round.

A checkpoint is what a donor sends a joiner: one heal payload (:func:`encode_heal` of
:func:`heal_state`: the global state and the counters, a JSON manifest and raw bytes, never a
pickle) in ``DIR/step_<step>.heal``, and beside it ``DIR/step_<step>.json`` (``step``,
``rounds`` committed, ``time`` in Unix seconds, ``fingerprint`` of the run's settings), written
second: a payload without its JSON is unfinished and never read. Both are written to a
temporary name and renamed, so a reader sees a whole file or none.

Beside it, each member of the round writes its own :class:`~optax_dist.fault_tolerance.heal.
LocalState` (:func:`local_part`: params, inner optimizer state, error-feedback residual) of
the same committed round to ``DIR/step_<step>.replica_<slot>.local`` (:func:`local_path`; a heal
payload naming the run's fingerprint), atomically too; the JSON names the round's ``members``.
A replica keeps its newest :data:`LOCAL_KEPT` local files; the global ones are all kept.

A replica that starts (or is restarted) takes the newest checkpoint whose every member's local
file is there (:func:`resume_point`): with its own local file, it is rebuilt whole
(:func:`~optax_dist.fault_tolerance.heal.resumed_state`) and continues as if never stopped, so
a run whose replicas all resume from it equals the uninterrupted run bit for bit. Without one (it was not a member of that
round, or its file is missing, or no checkpoint has its members' files: then the newest), it
restores as a joiner heals (:func:`local_state`: the global state taken bit for bit, params =
the anchor, the inner state the writer's, the residual zero); a peer ahead of it (torchft's
step: a peer rebuilt whole, or one that went on living) is its donor at its first quorum, as
for any restarted replica.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from optax_dist import _checks
from optax_dist.fault_tolerance import heal
from optax_dist.fault_tolerance.heal import (
  LocalState,
  heal_state,
  local_part,
  local_state,
)
from optax_dist.fault_tolerance.protocol import ReplicaState, RoundProtocol

LOCAL_KEPT = 2
"""The local files a replica keeps (its newest); the previous one is where a resume goes when
it was killed between the writes of the newest's files."""


def local_path(directory: str | os.PathLike, step: int, slot: int) -> pathlib.Path:
  """Where replica ``slot`` writes its local state of the checkpoint at ``step``."""
  return pathlib.Path(directory) / f"step_{step}.replica_{slot}.local"


def _owned(tree: Any) -> Any:
  """``tree`` with each JAX array copied on its devices (dispatched, not waited for): the
  writer's thread reads the copies while the loop's next jitted step donates (deletes) the
  originals."""
  return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


def _write_atomically(path: pathlib.Path, data: bytes) -> None:
  partial = path.with_name(path.name + ".partial")
  partial.write_bytes(data)
  os.replace(partial, path)


class CheckpointWriter:
  """Writes a replica's committed state every ``every`` inner steps, in a thread of its own
  (off the quorum's path: the next round's inner steps run meanwhile).

  Args:
    directory: where the checkpoints go (made if missing).
    every: inner steps between checkpoints: a round whose steps cross a multiple of ``every``
      is written.
    fingerprint: the run's settings fingerprint (an int), recorded in each checkpoint's JSON.

  Raises:
    ValueError: ``every`` not a positive int.
  """

  def __init__(self, directory: str | os.PathLike, every: int, fingerprint: int):
    _checks.check_positive_int("CheckpointWriter", "every", every)
    self.directory, self.every, self.fingerprint = pathlib.Path(directory), every, fingerprint
    self.directory.mkdir(parents=True, exist_ok=True)
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    self._pending: list[concurrent.futures.Future] = []

  def due(self, step: int, round_steps: int, last: bool = False) -> bool:
    """Whether a round of ``round_steps`` inner steps ending at ``step`` is written: it crosses
    a multiple of ``every``, or it is the run's ``last``."""
    return last or step // self.every > (step - round_steps) // self.every

  def write(self, donation: Any, *, step: int, rounds: int, time: float,
            members: tuple = ()) -> None:
    """Queues the checkpoint of a replica's ``donation`` (what it sends a joiner:
    :meth:`Replica.donation <optax_dist.fault_tolerance.Replica.donation>`, or a
    :func:`heal_state`) after ``rounds`` committed rounds at ``step``, whose ``members`` (the
    round's slots) write their local files beside it. The thread reads copies of its arrays
    (:func:`_owned`), so the loop's next step may donate them."""
    meta = {"step": step, "rounds": rounds, "time": time, "fingerprint": self.fingerprint,
            "members": [int(i) for i in members]}
    self._pending.append(self._pool.submit(self._write, _owned(donation), meta))

  def write_local(self, replica: ReplicaState, *, step: int, slot: int) -> None:
    """Queues replica ``slot``'s local state (:func:`local_part` of ``replica``) of the
    checkpoint at ``step`` (:func:`local_path`), then drops its files older than its newest
    :data:`LOCAL_KEPT`."""
    self._pending.append(self._pool.submit(self._write_local, _owned(replica), step, slot))

  def _write_local(self, replica: ReplicaState, step: int, slot: int) -> None:
    payload = heal.encode_heal(local_part(replica), fingerprint=self.fingerprint)
    _write_atomically(local_path(self.directory, step, slot), payload)
    steps = sorted(int(p.name.split(".")[0][len("step_"):])
                   for p in self.directory.glob(f"step_*.replica_{slot}.local"))
    for old in steps[:-LOCAL_KEPT]:
      local_path(self.directory, old, slot).unlink(missing_ok=True)

  def _write(self, donation: Any, meta: dict) -> None:
    stem = self.directory / f"step_{meta['step']}"
    _write_atomically(stem.with_suffix(".heal"), heal.encode_heal(donation))
    _write_atomically(stem.with_suffix(".json"), json.dumps(meta).encode())

  def close(self) -> None:
    """Waits for the queued writes; raises the first one's error, if any."""
    self._pool.shutdown(wait=True)
    for future in self._pending:
      future.result()


def saved(directory: str | os.PathLike) -> list[dict]:
  """The finished checkpoints under ``directory``, oldest first: their JSON, with ``path`` (the
  payload's) added; ``[]`` if there is none."""
  found = []
  for meta_path in pathlib.Path(directory).glob("step_*.json"):
    meta = json.loads(meta_path.read_text())
    found.append({**meta, "path": str(meta_path.with_suffix(".heal"))})
  return sorted(found, key=lambda meta: meta["step"])


def read(directory: str | os.PathLike, expected: Any, fingerprint: int,
         meta: dict | None = None) -> tuple[Any, dict] | None:
  """A checkpoint's donation under ``directory`` (the newest, or the one ``meta`` names: an
  entry of :func:`saved`), decoded against ``expected`` (:func:`decode_heal`), and its JSON;
  ``None`` if there is none.

  Raises:
    ValueError: the checkpoint's fingerprint is not ``fingerprint`` (a run of other settings
      wrote it), or its payload fails :func:`decode_heal`'s checks (naming its path).
  """
  if meta is None:
    found = saved(directory)
    if not found:
      return None
    meta = found[-1]
  if meta["fingerprint"] != fingerprint:
    raise ValueError(
      f"checkpoint {meta['path']}: written by a run of other settings (fingerprint"
      f" {meta['fingerprint']}, this run's {fingerprint}); give another output directory.")
  payload = pathlib.Path(meta["path"]).read_bytes()
  return heal.decode_heal(payload, expected, replica=meta["path"]), meta


def restore(directory: str | os.PathLike, protocol: RoundProtocol, state: ReplicaState,
            params_like: Any, fingerprint: int, meta: dict | None = None
            ) -> tuple[ReplicaState, dict] | None:
  """The replica rebuilt from a checkpoint (:func:`read` of a :func:`heal_state`) as a joiner
  heals (:func:`local_state`), and that checkpoint's JSON; ``None`` if there is none.

  Args:
    directory: the checkpoints' directory.
    protocol: the run's :class:`RoundProtocol`.
    state: a state of the run's tree (e.g. ``protocol.init(params)``): the payload is checked
      against it.
    params_like: params of the run's tree, shapes and dtypes.
    fingerprint: the run's settings fingerprint.
    meta: which checkpoint; ``None``: the newest.

  Raises:
    ValueError: as :func:`read`.
  """
  found = read(directory, heal_state(state), fingerprint, meta)
  if found is None:
    return None
  received, meta = found
  return local_state(protocol, received.global_state, params_like, received.inner), meta


def resume_point(directory: str | os.PathLike) -> dict | None:
  """The newest finished checkpoint under ``directory`` (an entry of :func:`saved`) whose every
  member has its local file there; ``None`` if none has (e.g. checkpoints written before local
  files were)."""
  for meta in reversed(saved(directory)):
    members = meta.get("members")
    if members and all(local_path(directory, meta["step"], i).exists() for i in members):
      return meta
  return None


def read_local(directory: str | os.PathLike, meta: dict, slot: int, expected: ReplicaState,
               fingerprint: int) -> LocalState | None:
  """Replica ``slot``'s local state of the checkpoint ``meta`` names (an entry of
  :func:`saved`), decoded against ``expected``'s :func:`local_part` and checked to name
  ``fingerprint``; ``None`` if it has no file there.

  Raises:
    ValueError: a file of another run's fingerprint, or that fails :func:`decode_heal`'s
      checks (naming its path).
  """
  path = local_path(directory, meta["step"], slot)
  if not path.exists():
    return None
  return heal.decode_heal(path.read_bytes(), local_part(expected), replica=str(path),
                          fingerprint=fingerprint)


def resume(directory: str | os.PathLike, replica: ReplicaState, donation: Any, slot: int,
           fingerprint: int) -> tuple[Any, LocalState | None] | None:
  """What replica ``slot`` starts from: the donation of the checkpoint :func:`resume_point`
  names (else the newest), decoded against ``donation`` (:func:`read`), and its own local state
  of that checkpoint (:func:`read_local` against ``replica``), or ``None`` in its place;
  ``None`` if there is no checkpoint.

  Raises:
    ValueError: as :func:`read` and :func:`read_local`.
  """
  found = read(directory, donation, fingerprint, resume_point(directory))
  if found is None:
    return None
  received, meta = found
  return received, read_local(directory, meta, slot, replica, fingerprint)
