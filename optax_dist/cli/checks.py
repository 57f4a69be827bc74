"""Every rule the settings of a run obey, checked by one function before anything loads.

:func:`check_settings` holds the rules of every run: :func:`optax_dist.cli.trainer.train` calls
it first. :func:`check_command`, which ``optax-dist train`` and ``compare`` call before the data,
the model or JAX's backends load, adds what only the command has: the processes, ``--out``,
``--resume``, and periods the run reaches. Each rule is written here once, with one message:
one line, ``argument --FLAG: ...``, naming the value and the constraint. The rules the library
itself enforces (a 4-bit format's even blocks, error feedback needing a quantized exchange, the
eager update needing an overlap, the overlap shorter than the sync period, ...) are not written
again: :func:`check_settings` builds each algorithm's transformation and names the flag of the
argument the library refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

from optax_dist.cli.algorithms import (ALGORITHMS, EXCHANGE_OPTIONS, FLOAT_COMM_DTYPES,
                                       QUANTIZED_COMM_DTYPES, flag, make_optimizer, quantizing,
                                       takers)
from optax_dist.cli.orbax_checkpoints import saved_steps
from optax_dist.cli.config import DEFAULTS, Settings
from optax_dist.cli.errors import CommandError

_LIBRARY_ARGUMENT = re.compile(r"^`\w+\((\w+)=")
"""The argument a library error names first: ``diloco`` in "`diloco(comm_block_size=...)` ..."."""


def library_flag(error: Exception) -> str | None:
  """The flag of the argument a library error names first (``--comm-block-size`` for
  "`diloco(comm_block_size=...)` ..."), or ``None`` when it names none."""
  match = _LIBRARY_ARGUMENT.match(str(error))
  return None if match is None else flag(match[1])


def num_examples(split: dict[str, Any]) -> int:
  """The number of examples of ``split`` (its leaves' leading axis)."""
  return len(next(iter(split.values())))


def check_settings(settings: Settings, algorithms: tuple[str, ...], *, processes: int,
                   train_examples: Callable[[], int]) -> None:
  """Raises ``ValueError`` unless resolved ``settings`` fit every one of ``algorithms``.

  The rules, in order: the replicas divide the workers; ``fsdp`` divides a replica's devices
  and every algorithm runs on the global view; the inner optimizer's settings fit together;
  each algorithm takes the exchange of
  ``settings`` (:func:`_check_exchange`) and the library builds it; ``exchange_device`` has one
  replica per each of the ``processes``; every worker gets a minibatch of the
  ``train_examples()`` training examples (called last: it may load the data set).

  Raises:
    ValueError: one line, ``argument --FLAG: ...``.
  """
  _check_replicas(settings)
  if settings.fsdp is not None:
    _check_fsdp(settings, algorithms)
  _check_inner_optimizer(settings)
  for algorithm in algorithms:
    _check_exchange(dataclasses.replace(settings, algorithm=algorithm), processes)
  _check_batch_size(settings, train_examples())


def _check_replicas(s: Settings) -> None:
  if s.devices % s.replicas:
    raise ValueError(
      f"argument --replicas: must divide the number of workers (--processes x --devices ="
      f" {s.devices}) into replicas of equal size, got {s.replicas}")


def _check_fsdp(s: Settings, algorithms: tuple[str, ...]) -> None:
  per_replica = s.devices // s.replicas
  if s.fsdp < 1 or per_replica % s.fsdp:
    raise ValueError(
      f"argument --fsdp: must divide the devices of a replica (--processes x --devices /"
      f" --replicas = {per_replica}), got {s.fsdp}")
  refused = [a for a in algorithms if ALGORITHMS[a].stale_gradients]
  if refused:
    raise ValueError(
      f"argument --fsdp: {', '.join(refused)} does not run on the global view, which keeps no"
      " params history to compute stale gradients at; run it without --fsdp")


def _check_inner_optimizer(s: Settings) -> None:
  if s.optimizer == "adam" and s.weight_decay:
    raise ValueError(
      f"argument --weight-decay: adam has no weight decay, got {s.weight_decay:g}; use"
      " --optimizer adamw (decoupled) or sgd")
  if s.lr_schedule == "warmup_cosine" and s.lr_warmup_steps >= s.steps:
    raise ValueError(
      f"argument --lr-warmup-steps: must be less than --steps ({s.steps}), got"
      f" {s.lr_warmup_steps}")


def _check_periods(s: Settings, algorithms: tuple[str, ...]) -> None:
  for name in ("communication_period", "sync_period"):
    users = [a for a in algorithms if ALGORITHMS[a].period_name == name]
    period = getattr(s, name)
    warmup = any(ALGORITHMS[a].warmup is not None for a in users)  # the first exchange after it
    room = s.steps - (s.warmup_steps if warmup else 0)
    if users and period > room:
      limit = (f"--steps ({s.steps}) minus --warmup-steps ({s.warmup_steps})"
               if warmup else f"--steps ({s.steps})")
      raise ValueError(
        f"argument {flag(name)}: must be at most {limit}, got {period}; {', '.join(users)} would"
        " never communicate (leave it out to use the default, which adapts to --steps)")


def _check_exchange(s: Settings, processes: int) -> None:
  """Raises ``ValueError`` unless ``s.algorithm`` takes ``s.comm_dtype`` and every one of
  :data:`~optax_dist.cli.algorithms.EXCHANGE_OPTIONS` away from its default, the options fit
  the format, the exchange device fits, and the library builds the transformation."""
  algorithm = ALGORITHMS[s.algorithm]
  comm = s.comm_dtype or "float32"
  if comm not in algorithm.comm_dtypes:
    raise ValueError(
      f"argument --comm-dtype: {algorithm.name} takes {', '.join(algorithm.comm_dtypes)} only,"
      f" got {comm}; the block-quantized formats ({', '.join(QUANTIZED_COMM_DTYPES)}) need"
      f" {', '.join(quantizing())}")
  for name in EXCHANGE_OPTIONS:
    value = getattr(s, name)
    if value != DEFAULTS[name] and name not in algorithm.settings:
      given = flag(name) if isinstance(value, bool) else f"{flag(name)} {value:g}"
      raise ValueError(
        f"argument {flag(name)}: {algorithm.name} does not take it (only"
        f" {', '.join(takers(name))}), got {given}")
  if s.comm_block_size != DEFAULTS["comm_block_size"] and comm not in QUANTIZED_COMM_DTYPES:
    raise ValueError(
      f"argument --comm-block-size: sets the blocks of a block-quantized --comm-dtype"
      f" ({', '.join(QUANTIZED_COMM_DTYPES)}), got --comm-dtype {comm}")
  if s.exchange_device:
    _check_exchange_device(s, comm, processes)
  _check_library(s)


def _check_exchange_device(s: Settings, comm: str, processes: int) -> None:
  if not s.overlap:
    raise ValueError(
      "argument --exchange-device: needs --overlap >= 1 (the exchange runs beside the steps"
      " between its send and its landing; with --overlap 0 it lands on its send step), got"
      " --overlap 0")
  if s.replicas < 2:
    raise ValueError(
      "argument --exchange-device: needs --replicas equal to --processes > 1 (one replica per"
      f" process, the exchange across them), got --replicas {s.replicas}")
  if s.fsdp is not None:
    raise ValueError(
      "argument --exchange-device: does not run on the global view, whose step exchanges inside"
      f" its one program; run without --fsdp, got --fsdp {s.fsdp}")
  if s.eager:
    raise ValueError(
      "argument --exchange-device: does not take --eager (the eager update needs the mean and"
      " the number of workers inside the landing step, which exchanges nothing here), got"
      " --exchange-device --eager")
  if comm in QUANTIZED_COMM_DTYPES:
    raise ValueError(
      f"argument --comm-dtype: --exchange-device sends each fragment as one float buffer:"
      f" {', '.join(FLOAT_COMM_DTYPES)} only, got {comm}")
  if s.replicas != processes:
    raise ValueError(
      "argument --exchange-device: needs one replica per process and more than one process"
      f" (--replicas equal to --processes > 1), got --replicas {s.replicas} with"
      f" --processes {processes}")


def _check_library(s: Settings) -> None:
  """Builds ``s.algorithm``'s transformation; a ``ValueError`` of the library's checks becomes
  ``argument --FLAG: <the library's message>``, the flag of the argument it names."""
  try:
    make_optimizer(s)
  except ValueError as e:
    named = library_flag(e)
    if named is None:
      raise
    raise ValueError(f"argument {named}: {e}") from None


def _check_batch_size(s: Settings, train_examples: int) -> None:
  if train_examples // s.devices < s.batch_size:
    raise ValueError(
      f"argument --batch-size: each worker needs at least batch-size examples, but the"
      f" {train_examples} training examples give {train_examples // s.devices} to each of"
      f" {s.devices} workers; lower --batch-size or --devices")


def check_command(args: argparse.Namespace, settings: Settings, algorithms: tuple[str, ...],
                  train_examples: Callable[[], int]) -> None:
  """Raises :class:`CommandError` unless the multi-process flags fit together, ``--out`` is
  (or can be made) a writable directory, ``--resume`` finds a checkpoint of one of
  ``algorithms``, each algorithm's period leaves it an exchange within ``--steps`` (a library
  caller may train without one), and ``settings`` pass :func:`check_settings`."""
  _check_processes(args)
  check_out(args.out)
  _check_resume(args, algorithms)
  try:
    _check_periods(settings, algorithms)
    check_settings(settings, algorithms, processes=args.processes, train_examples=train_examples)
  except ValueError as e:
    raise CommandError(str(e)) from None


def _check_processes(args: argparse.Namespace) -> None:
  if args.process_id is not None:
    if args.coordinator is None:
      raise CommandError("argument --process-id: needs --coordinator HOST:PORT, the address of"
                         " process 0")
    if not 0 <= args.process_id < args.processes:
      raise CommandError(f"argument --process-id: must be in 0..{args.processes - 1}"
                         f" (--processes {args.processes}), got {args.process_id}")
  elif args.coordinator is not None and args.processes == 1:
    raise CommandError("argument --coordinator: needs --processes > 1 or --process-id")


def check_out(path: str) -> None:
  """Raises :class:`CommandError` unless ``path`` is (or can be made) a writable directory."""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise CommandError(
      f"argument --out: cannot create directory {path!r}: {e.strerror or e}") from None
  if not os.path.isdir(path):
    raise CommandError(f"argument --out: {path!r} is not a directory")
  try:
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise CommandError(
      f"argument --out: directory {path!r} is not writable: {e.strerror or e}") from None


def _check_resume(args: argparse.Namespace, algorithms: tuple[str, ...]) -> None:
  """Orbax's checkpoints; a fault-tolerant run's are its replicas' (``ft_train`` checks them)."""
  root = os.path.join(args.out, "checkpoints")
  if (not args.resume or getattr(args, "fault_tolerant", False)
      or any(saved_steps(os.path.join(root, a)) for a in algorithms)):
    return
  raise CommandError(
    f"argument --resume: no checkpoint of {', '.join(algorithms)} under {root}; resume with the"
    " --out of a run started with --checkpoint-every N, or run without --resume to start over")
