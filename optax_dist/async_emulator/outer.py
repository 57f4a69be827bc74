"""Deprecated: :func:`optax_dist.delayed_nesterov` and its state now live in :mod:`optax_dist`.

Importing ``delayed_nesterov`` or ``DelayedNesterovState`` from here still works and warns:

>>> import warnings, optax_dist
>>> from optax_dist.async_emulator import outer
>>> with warnings.catch_warnings(record=True) as caught:
...   warnings.simplefilter("always")
...   same = outer.delayed_nesterov is optax_dist.delayed_nesterov
>>> same, caught[0].category.__name__
(True, 'DeprecationWarning')
"""

from __future__ import annotations

import warnings

__all__ = ()

_MOVED = ("DelayedNesterovState", "delayed_nesterov")


def __getattr__(name):
  if name in _MOVED:
    import optax_dist

    warnings.warn(
      f"`optax_dist.async_emulator.outer.{name}` is deprecated: use `optax_dist.{name}` (the"
      " same object).", DeprecationWarning, stacklevel=2)
    return getattr(optax_dist, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
