"""Test configuration: eight emulated CPU devices and a shared compilation cache, set before JAX
initialises."""

import os
import pathlib
import platform

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A persistent compilation cache shared by the tests and the subprocesses they start (which inherit
# these variables): a program compiled once (by another test, another process or an earlier run)
# is read back instead of compiled again. Its key is the program, the devices, the compile options
# and the versions, so a hit runs the same executable. Every program is cached, however small or
# quick to compile. Under .pytest_cache/ (git-ignored); set JAX_COMPILATION_CACHE_DIR to move it.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR",
  str(pathlib.Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax-compilation-cache"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# XLA CPU aborts the process when the threads of the emulated devices have not all joined a
# collective within 40 s; on a loaded 2-core machine one step can take longer. The subprocesses
# the tests start (the command, the docs' code) inherit this.
# XLA's CPU code generator uses the widest vector instructions the machine has (AVX-512 where
# present), which can change how a sum is rounded. Capped at AVX2 on x86-64, every x86-64 machine
# of the last decade compiles the same code, and the golden hashes (tests/golden/) hold there.
X86 = platform.machine().lower() in ("x86_64", "amd64")
os.environ["XLA_FLAGS"] = " ".join([
  os.environ.get("XLA_FLAGS", ""),
  "--xla_cpu_collective_call_terminate_timeout_seconds=600",
  "--xla_cpu_collective_timeout_seconds=600",
  *(["--xla_cpu_max_isa=AVX2"] if X86 else []),
]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from hypothesis import settings  # noqa: E402

# CI runs draw the same examples every time (a failure there is reproducible); set
# HYPOTHESIS_PROFILE=explore locally to draw new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The files whose tests start the command, torchft runs or notebooks in subprocesses, longest first
# (seconds of one file on a 2-core machine, `pytest --durations=0`: 270, 180, 120, 100, 65, 65, 55,
# 55, 50, 50, 45, 45, 40, 40, 40). `make test` gives each worker a whole file (`--dist loadfile`) in
# this order (`--no-loadscope-reorder`), so the long files start first and the short ones fill the
# workers' ends: run last, a 4-minute file keeps one worker busy while the other has finished.
LONG_FILES = ("test_multiprocess.py", "test_network.py", "test_exchange_device.py",
              "test_torchft.py", "test_replicas.py", "test_trainer_global_view.py",
              "test_user_loop.py", "test_ft_replica_groups.py", "test_ft_resume.py",
              "test_fault_tolerant_train.py", "test_notebooks.py", "test_docs.py",
              "test_properties.py", "test_chaos.py", "test_decoupled_torchft.py")


def pytest_collection_modifyitems(items):
  """Runs the :data:`LONG_FILES` first, longest first; the other files after, in their order."""
  rank = {name: i for i, name in enumerate(LONG_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))
