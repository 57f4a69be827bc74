"""Helpers shared by several test files: TF's assertion helpers and the validation regexes.

TF's tolerances, as its tests assert them:

* ``assertAllEqual``: exact;
* ``assertNear(a, b, err)``: ``a == b or |a - b| <= err``;
* ``assertNDArrayNear(a, b, err)``: ``||a - b||_2 < err``;
* ``assertAllCloseAccordingToType``: ``numpy.allclose`` with rtol = atol = 1e-6 for
  float32/float64 and 1e-3 for float16.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax


def assert_all_equal(expected, actual):
  np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))


def assert_near(expected, actual, err):
  expected, actual = float(expected), float(np.asarray(actual))
  assert expected == actual or abs(expected - actual) <= err, (expected, actual, err)


def assert_pulled(center, params):
  """``params`` were pulled to ``center``: TF asserts equality; a pull applied as the delta
  ``center - params`` is exact up to float rounding (ALGORITHMS.md), so allow 2 ulp."""
  np.testing.assert_array_max_ulp(np.asarray(params), np.asarray(center), maxulp=2)


def assert_ndarray_near(expected, actual, err):
  diff = np.asarray(actual, np.float64) - np.asarray(expected, np.float64)
  assert np.linalg.norm(diff) < err, (expected, actual, err)


_TOLERANCE_BY_DTYPE = {
  np.dtype(np.float16): 1e-3,
  np.dtype(np.float32): 1e-6,
  np.dtype(np.float64): 1e-6,
}


def assert_all_close_according_to_type(expected, actual):
  actual = np.asarray(actual)
  tol = _TOLERANCE_BY_DTYPE[actual.dtype]
  np.testing.assert_allclose(
    actual.astype(np.float64), np.asarray(expected, np.float64), rtol=tol, atol=tol
  )


def sgd_step(tx):
  """A jitted ``(params, state, grads, **kw) -> (params, state)`` for ``tx``."""

  @jax.jit
  def step(params, state, grads, **extra_args):
    updates, state = tx.update(grads, state, params, **extra_args)
    return optax.apply_updates(params, updates), state

  return step


def constant_grads(params, value):
  return jax.tree.map(lambda p: jnp.full_like(p, value), params)


def called(fn: str, arg: str) -> str:
  """Regex for the call site as the messages spell it: `` `fn(arg=...)` ``."""
  return re.escape(f"`{fn}({arg}=")


def error(fn: str, arg: str, constraint: str, value) -> str:
  """Regex: the call site, then the constraint, then the value received."""
  return f"{called(fn, arg)}.*{re.escape(constraint)}.*got {re.escape(repr(value))}\\.$"


def sgd():
  return optax.sgd(0.1)


class PicklePayload:
  """An object whose unpickling runs code: it appends ``"unpickled"`` to :attr:`RAN`. A heal
  payload that holds one must be refused without running it."""

  RAN: list = []

  def __reduce__(self):
    return _record_unpickling, ("unpickled",)


def _record_unpickling(what):
  PicklePayload.RAN.append(what)
  return what


def require_ft() -> None:
  """Skips the calling test module without the ``ft`` extra (torch, torchft), or, with
  ``OPTAX_DIST_REQUIRE_FT=1`` (``make test``), fails it."""
  import importlib.util
  import os

  import pytest

  missing = [m for m in ("torch", "torchft") if importlib.util.find_spec(m) is None]
  if not missing:
    return
  if os.environ.get("OPTAX_DIST_REQUIRE_FT") == "1":
    raise ModuleNotFoundError(
      f"OPTAX_DIST_REQUIRE_FT=1 but {missing[0]!r} is missing: pip install 'optax-dist[ft]'",
      name=missing[0])
  pytest.skip("needs the ft extra (torch, torchft)", allow_module_level=True)


def one_line_error(capsys, *args: str, contains=()) -> str:
  """Runs ``optax-dist args`` in process: exit status 2 (returned, or argparse's ``SystemExit``),
  nothing on stdout, one line ``optax-dist: error: ...`` on stderr containing each of
  ``contains``, no traceback. Returns the line."""
  from optax_dist.cli.main import main

  capsys.readouterr()  # what came before
  try:
    status = main(list(args))
  except SystemExit as e:
    status = e.code
  stdout, stderr = capsys.readouterr()
  assert status == 2, (args, stderr)
  assert "Traceback" not in stderr, (args, stderr)
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("optax-dist: error: "), (args, stderr)
  for text in contains:
    assert text in lines[0], (text, lines[0])
  assert stdout == "", args
  return lines[0]


def alive(pid: int) -> bool:
  """Whether process ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
  import pathlib

  try:
    state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
  except FileNotFoundError:
    return False
  return state not in ("Z", "X")


def kill_groups(procs) -> None:
  """Kills the process group of each of ``procs`` (started with ``start_new_session=True``)
  that still runs, and reaps it: a fixture's teardown, also after a failure."""
  import os
  import signal

  for proc in procs:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()


SHAPES = {"a": (4, 3), "b": (5,)}
"""The leaves of :func:`tree_params` and :func:`tree_batch`."""


def tree_params():
  """Params of :data:`SHAPES`, normal draws of key 0."""
  keys = jax.random.split(jax.random.key(0), len(SHAPES))
  return {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, SHAPES.items(), strict=True)}


@jax.jit
def tree_batch(seed, slot, step):
  """A batch of :data:`SHAPES` drawn from ``step_key(seed, slot, step)`` (stateless)."""
  from optax_dist.fault_tolerance import step_key

  keys = jax.random.split(step_key(seed, slot, step), len(SHAPES))
  return {k: jax.random.normal(kk, s) for kk, (k, s) in zip(keys, SHAPES.items(), strict=True)}
