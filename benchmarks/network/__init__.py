"""Linux network namespaces joined by a shaped veth pair (:mod:`benchmarks.network.netns`), and
the probes run over them: what gloo sends per collective (``probe_link_bytes``) and whether an
exchange runs beside the steps on XLA CPU (``probe_overlap``). Each probe is a script:
``python -m benchmarks.network.PROBE`` (root and iproute2); its results go to
``benchmarks/results/PROBE.json``."""
