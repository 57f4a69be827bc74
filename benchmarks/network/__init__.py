"""Network namespaces joined by a shaped veth pair (:mod:`benchmarks.network.netns`) and the
faults injected into them (:mod:`benchmarks.network.faults`). The two probes that calibrated the
network study (what gloo sends per collective, whether an exchange runs beside the steps on XLA
CPU) ran once; their results are in ``benchmarks/results/probe_*.json`` and their code at commit
b6772f7 (``benchmarks/network/probe_*.py``)."""
