"""torchft's Lighthouse as a process that dies with its parent.

``python .../optax_dist/fault_tolerance/lighthouse.py [torchft_lighthouse flags]`` (the script's
path: torchft's program reads the process's arguments after the interpreter's first) asks Linux
to send it ``SIGKILL`` when its parent dies (:func:`die_with_parent`), then runs torchft's
``torchft_lighthouse`` program with the flags given (``--bind HOST:PORT``, ``--min_replicas``,
``--join_timeout_ms``, ``--heartbeat_timeout_ms``, ``--quorum_tick_ms``). The launcher
(:mod:`optax_dist.fault_tolerance.launcher`) starts it, and starts it again on the same address
when it dies. Needs the ``ft`` extra. As a script it imports neither JAX nor the rest of
optax_dist (its start after a kill is the run's stall): torch and torchft only, about 2 s.
A replica's process uses the module's two Linux calls too: :func:`die_with_parent`, and
:func:`name_thread` for its exchange threads (``optax_dist-exch``, ``optax_dist-poll``).
"""

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent() -> None:
  """Asks Linux to send this process ``SIGKILL`` when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``): the Lighthouse's and the replicas' tie to their launcher."""
  ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def name_thread(name: str) -> None:
  """Names the calling thread as Linux shows it (``/proc/PID/task/TID/comm``: ``top -H``,
  ``ps -L``, a cgroup's thread placement; its first 15 bytes): Python 3.11 names only its
  ``threading`` objects, and every thread it starts shows its process's name. Elsewhere than
  Linux, nothing."""
  if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15])


if __name__ == "__main__":
  die_with_parent()
  from torchft._torchft import lighthouse_main

  sys.argv[0] = "torchft_lighthouse"
  sys.exit(lighthouse_main())
