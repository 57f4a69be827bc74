PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test docs bench dist clean

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

# The sdist and the wheel, in dist/, checked as PyPI would check them.
dist: $(VENV)/.dist
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/python -m twine check --strict dist/*

clean:
	rm -rf $(VENV) runs build dist *.egg-info docs/_build
