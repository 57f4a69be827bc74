"""Test configuration: eight emulated CPU devices, set before JAX initialises."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from hypothesis import settings  # noqa: E402

# CI runs draw the same examples every time (a failure there is reproducible); set
# HYPOTHESIS_PROFILE=explore locally to draw new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
