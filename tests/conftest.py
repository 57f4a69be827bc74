"""Test configuration: eight emulated CPU devices, set before JAX initialises."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA CPU aborts the process when the threads of the emulated devices have not all joined a
# collective within 40 s; on a loaded 2-core machine one step can take longer. The subprocesses
# the tests start (the command, the docs' code) inherit this.
os.environ["XLA_FLAGS"] = " ".join([
  os.environ.get("XLA_FLAGS", ""),
  "--xla_cpu_collective_call_terminate_timeout_seconds=600",
  "--xla_cpu_collective_timeout_seconds=600",
]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from hypothesis import settings  # noqa: E402

# CI runs draw the same examples every time (a failure there is reproducible); set
# HYPOTHESIS_PROFILE=explore locally to draw new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
