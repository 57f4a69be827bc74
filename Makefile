PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-lowest docs bench bench-network bench-equal-tokens bench-lm-exchanges \
  bench-async-dylu bench-decoupled-staleness bench-chaos bench-decoupled bench-ft-link dist clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# .venv/.EXTRA: the package installed (editable) with its optional dependencies EXTRA.
$(VENV)/.%: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[$*]"
	touch $@

demo: $(VENV)/.examples
	$(BIN)/optax-dist compare

# One pytest worker per core (pytest-xdist), each file on one worker: a file's module fixtures
# (runs started together) run once. The files go out in the order tests/conftest.py gives them
# (the long end-to-end files first), not xdist's default (the files with the most tests first).
PYTEST_PARALLEL := -n auto --dist loadfile --no-loadscope-reorder

# With the ft extra (torch==2.13.0, torchft): OPTAX_DIST_REQUIRE_FT=1 makes a missing torchft
# fail tests/test_torchft.py instead of skipping it.
test: $(VENV)/.test,ft
	OPTAX_DIST_REQUIRE_FT=1 $(BIN)/python -m pytest -q $(PYTEST_PARALLEL)

# The tests run in-process, on the lowest versions pyproject.toml allows: uv resolves every direct
# dependency to its floor (jax, optax, flax, orbax-checkpoint, ...). The tests that drive
# subprocesses (command line, multi-process, notebooks, docs, README) run in `make test` only, and so
# do the torchft tests: the ft extra is left out here (uv would download a CUDA build of torch).
LOWEST := .venv-lowest
# fault_tolerance: its bitwise comparisons with the in-program route for 3 replicas hold on the
# JAX that `make test` installs; JAX 0.10.0 compiles the in-program sum or outer step otherwise
# (1 or 2 units in the last place apart).
# chaos: the study's runs are the command in subprocesses.
LOWEST_SKIP := chaos cli docs exchange_device fault_tolerance lm_task multiprocess notebooks \
  readme torchft

$(LOWEST)/.installed: pyproject.toml
	rm -rf $(LOWEST)
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install --quiet uv
	$(LOWEST)/bin/uv pip install --quiet --python $(LOWEST)/bin/python --resolution lowest-direct \
	  -e ".[test]"
	touch $@

test-lowest: $(LOWEST)/.installed
	$(LOWEST)/bin/uv pip freeze --python $(LOWEST)/bin/python \
	  | grep -iE '^(jax|jaxlib|optax|flax|orbax-checkpoint|scikit-learn)=='
	$(LOWEST)/bin/python -m pytest -q $(PYTEST_PARALLEL) $(LOWEST_SKIP:%=--ignore=tests/test_%.py)

docs: $(VENV)/.docs
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

bench: $(VENV)/.bench
	$(BIN)/python -m benchmarks bench $(BENCH_ARGS)

# Training over a veth pair between two network namespaces, shaped with tc's tbf: needs root
# (installs iproute2 if ip or tc is missing); says why and does nothing otherwise.
bench-network: $(VENV)/.bench
	@if [ "$$(id -u)" != 0 ]; then echo "bench-network: skipped: needs root"; exit 0; fi; \
	if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then \
	  apt-get install -y iproute2 || { apt-get update && apt-get install -y iproute2; }; \
	fi; \
	$(BIN)/python -m benchmarks network $(BENCH_NETWORK_ARGS)

# DiLoCo with M = 1, 2, 4, 8 replicas against data parallel at equal tokens (Scaling Laws for
# DiLoCo, Table 4): 25 runs, about 90 minutes on 2 idle cores; each run is cached under
# benchmarks/results/equal_tokens_runs/, so a stopped study resumes. E.g.
# BENCH_EQUAL_TOKENS_ARGS=--plan prints the runs and the estimated time, --quick checks the program.
bench-equal-tokens: $(VENV)/.bench
	$(BIN)/python -m benchmarks equal_tokens $(BENCH_EQUAL_TOKENS_ARGS)

# Validation bits per byte against the bytes sent, by exchange format, on the lm task (8 workers,
# diloco and streaming_diloco; about 30 min); BENCH_LM_EXCHANGES_ARGS=--quick checks the program.
bench-lm-exchanges: $(VENV)/.bench
	$(BIN)/python -m benchmarks lm_exchanges $(BENCH_LM_EXCHANGES_ARGS)

# Synchronous DiLoCo against asynchronous DiLoCo, delayed Nesterov and DyLU on four emulated
# workers of speeds 1 : 1 : 0.5 : 0.25, at equal inner steps, on the lm task;
# BENCH_ASYNC_DYLU_ARGS=--quick checks the program.
bench-async-dylu: $(VENV)/.bench
	$(BIN)/python -m benchmarks async_dylu $(BENCH_ASYNC_DYLU_ARGS)

# Decoupled rounds' staleness rules (none, dylu, age_gate, delayed_nesterov, token_share) on the
# in-process engine: 4 replicas at the speeds the torchft benchmark measures (1 : 0.976 : 0.475 :
# 0.231), diloco on the lm task with outer SGD at 1.4 without momentum, K = 1 and W = 0, seeds 0,
# 1, 2, and a synchronous control (about 11 min of CPU); each run's lines in
# benchmarks/results/decoupled_staleness_w0/ (a run there is not run again; --report recomputes
# from them). BENCH_DECOUPLED_STALENESS_ARGS=--quick checks the program.
DECOUPLED_STALENESS := benchmarks/results/decoupled_staleness_w0
bench-decoupled-staleness: $(VENV)/.bench
	$(BIN)/python -m benchmarks decoupled_staleness --flags "$(DECOUPLED_OUTER)" \
	  $(BENCH_DECOUPLED_STALENESS_ARGS) $(if $(findstring --quick,$(BENCH_DECOUPLED_STALENESS_ARGS)),,\
	  --out $(DECOUPLED_STALENESS))
DECOUPLED_OUTER := --outer-learning-rate 1.4 --outer-momentum 0

# Fault-tolerant DiLoCo (4 replica processes over torchft, the lm task) and synchronous data
# parallelism with checkpoint-restart, each under fixed-seed Poisson schedules of kill -9, SIGSTOP
# and link-down faults (seeds 0, 1, 2) against a control run at the same time, and an
# equal-tokens control: goodput, applied faults, work lost per fault, returns, validation (about
# 2 h in all); in benchmarks/results/chaos/, the runs' raw logs in chaos_raw.tar.xz.
# Needs root and the ft extra; says why and does nothing without root. BENCH_CHAOS_ARGS=--quick
# checks the program.
bench-chaos: $(VENV)/.bench,ft
	@if [ "$$(id -u)" != 0 ]; then echo "bench-chaos: skipped: needs root"; exit 0; fi; \
	mkdir -p benchmarks/results/chaos; \
	$(BIN)/python -m benchmarks chaos --out benchmarks/results/chaos/chaos $(BENCH_CHAOS_ARGS)

# Decoupled rounds over torchft (4 replica processes of speeds 1 : 1 : 0.5 : 0.25, each capped
# at its share of 1.6 CPUs a pair, the lm task, outer SGD at 1.4 without momentum, the decoupled
# runs' staleness rule DECOUPLED_RULE): synchronous rounds, K = 1 with W = 0 and with a window of
# 1 s, each control beside a run under the chaos schedule, seeds 0, 1 and 2 (about 1 h 15 min);
# in benchmarks/results/chaos/speeds (DECOUPLED_RULE=age_gate: speeds_age_gate, the age gate's
# bound 1), the raw logs in its _raw.tar.xz. The chaos study's speeds mode: needs root and the ft
# extra; BENCH_DECOUPLED_ARGS=--quick checks the program.
DECOUPLED_RULE := token_share
bench-decoupled: $(VENV)/.bench,ft
	@if [ "$$(id -u)" != 0 ]; then echo "bench-decoupled: skipped: needs root"; exit 0; fi; \
	mkdir -p benchmarks/results/chaos; \
	$(BIN)/python -m benchmarks chaos --speeds 1 1 0.5 0.25 --cpus 1.6 --seeds 0 1 2 \
	  --steps 200 --windows 0 1 --speed-faults --staleness-rule $(DECOUPLED_RULE) \
	  --flags "$(DECOUPLED_OUTER)$(if $(filter age_gate,$(DECOUPLED_RULE)), --max-staleness 1)" \
	  --out benchmarks/results/chaos/speeds$(if $(filter-out token_share,$(DECOUPLED_RULE)),_$(DECOUPLED_RULE)) \
	  $(BENCH_DECOUPLED_ARGS)

# Fault-tolerant streaming DiLoCo over a 10 Mbit/s link (2 replica processes over torchft, each
# of 4 devices in its own namespace, capped at 0.8 CPU; H = 20, F = 2): each run shaped and
# unshaped, one after the other, with overlap 8 and without, seeds 0, 1 and 2 (about 25 min); in
# benchmarks/results/chaos/, the raw logs in link_raw.tar.xz. The chaos study's link mode: needs
# root and the ft extra.
bench-ft-link: $(VENV)/.bench,ft
	@if [ "$$(id -u)" != 0 ]; then echo "bench-ft-link: skipped: needs root"; exit 0; fi; \
	mkdir -p benchmarks/results/chaos; \
	$(BIN)/python -m benchmarks chaos --rate 10mbit --replicas 2 --min-replicas 2 \
	  --algorithm streaming_diloco --steps 400 --seeds 0 1 2 --overlaps 8 0 --lighthouse-kill 0 \
	  --checkpoint-every 0 --cpus 1.6 --flags "--devices 4 --num-fragments 2 \
	  --outer-learning-rate 0.7 --outer-momentum 0.5" --out benchmarks/results/chaos/link

# The sdist and the wheel, in dist/, checked as PyPI would check them.
dist: $(VENV)/.dist
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/python -m twine check --strict dist/*

clean:
	rm -rf $(VENV) $(LOWEST) runs build dist *.egg-info docs/_build
