"""Network namespaces joined by a shaped veth pair (:mod:`benchmarks.network.netns`) and the probes
run over them, each ``python -m benchmarks.network.PROBE`` (root and iproute2): what gloo sends per
collective (``probe_link_bytes``), whether an exchange runs beside the steps on XLA CPU
(``probe_overlap``); results in ``benchmarks/results/PROBE.json``."""
