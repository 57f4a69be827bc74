"""The benchmarks of optax_dist: ``python -m benchmarks STUDY`` (see :mod:`benchmarks.__main__`),
the studies in :mod:`benchmarks.studies`, their shared kit in :mod:`benchmarks.kit`, the network
namespaces and probes in :mod:`benchmarks.network`, the results in ``benchmarks/results/``."""
