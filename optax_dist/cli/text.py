"""The text of the ``lm`` task: the Python standard library's own source files, as bytes.

Real text written by people (code, comments and docstrings) that is present wherever Python is,
so nothing is downloaded. The corpus is the top-level ``*.py`` files of the running
interpreter's standard library (``sysconfig.get_paths()["stdlib"]``), in sorted order; it depends
on the Python version, which the results record with the byte counts (:func:`describe`).

The split is fixed, by file: every tenth file in sorted order (the 10th, 20th, ...) is validation,
the others are training. Examples are non-overlapping windows of ``context + 1`` bytes: the model
reads the first ``context`` and predicts each next byte.
"""

from __future__ import annotations

import functools
import pathlib
import platform
import sysconfig

import numpy as np

VALIDATION_EVERY = 10
"""Every ``VALIDATION_EVERY``-th file (in sorted order) is in the validation split."""


def corpus_files() -> list[pathlib.Path]:
  """The top-level ``*.py`` files of the standard library, sorted by name."""
  return sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def is_validation(index: int) -> bool:
  """Whether the file at ``index`` (0-based, sorted order) is in the validation split."""
  return index % VALIDATION_EVERY == VALIDATION_EVERY - 1


@functools.lru_cache(maxsize=1)
def splits() -> tuple[np.ndarray, np.ndarray]:
  """The training and validation bytes, ``uint8[n_train]`` and ``uint8[n_validation]``."""
  train, validation = [], []
  for index, path in enumerate(corpus_files()):
    (validation if is_validation(index) else train).append(path.read_bytes())
  return (np.frombuffer(b"".join(train), np.uint8), np.frombuffer(b"".join(validation), np.uint8))


def describe() -> str:
  """The corpus in words: the Python version, the file count and the bytes of each split."""
  train, validation = splits()
  return (
    f"Python {platform.python_version()} standard library, {len(corpus_files())} top-level .py"
    f" files; {train.size:,} training and {validation.size:,} validation bytes"
  )


def windows(data: np.ndarray, length: int, count: int | None = None) -> np.ndarray:
  """Non-overlapping windows of ``length`` bytes of ``data``, ``uint8[n, length]``.

  With ``count``, ``count`` windows evenly spread over ``data`` (a fixed subset).
  """
  n = data.size // length
  if n < 1:
    raise ValueError(f"the corpus has {data.size} bytes, fewer than one window of {length}.")
  rows = data[: n * length].reshape(n, length)
  if count is None or count >= n:
    return rows
  return rows[np.linspace(0, n - 1, count).astype(np.int64)]
