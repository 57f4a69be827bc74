PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.examples: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[examples]"
	touch $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

demo: $(VENV)/.examples
	$(BIN)/optax-dist compare

test: $(VENV)/.test
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs build *.egg-info
