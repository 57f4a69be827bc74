"""The studies the driver runs (``python -m benchmarks STUDY``), one module each: a ``Config``,
``QUICK``, ``measure``, ``markdown`` and ``plot`` (see :mod:`benchmarks.__main__`)."""
