# Two commands matter: `make run` and `make test`. Each builds .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --constraint constraints.txt
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt

.PHONY: run test lint bench clean

# torch is pinned by constraints.txt: pip takes the local 2.13.0 CPU wheel and never
# resolves a newer torch (which would pull several GB of CUDA packages).
$(VENV)/.base: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip setuptools wheel
	$(PIP) torch==2.13.0
	$(PIP) -e .
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) -e '.[dev,serve]'
	touch $@

run: $(VENV)/.base
	$(VENV)/bin/partrain train

test: $(VENV)/.dev
	$(VENV)/bin/python -m pytest -q --durations=15 tests

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check src tests

bench: $(VENV)/.dev
	$(VENV)/bin/partrain bench core --quick

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
