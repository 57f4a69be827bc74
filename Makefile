PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# .venv/.EXTRA: the package installed (editable) with its optional dependencies EXTRA.
$(VENV)/.%: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[$*]"
	touch $@

demo: $(VENV)/.examples
	$(BIN)/optax-dist compare

test: $(VENV)/.test
	$(BIN)/python -m pytest -q

docs: $(VENV)/.docs
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

bench: $(VENV)/.bench
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) runs build *.egg-info docs/_build
