# Two commands matter: `make run` and `make test`. Each builds .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
# uv installs in seconds what pip takes a minute and a half for. It reads neither pip's
# configuration nor its find-links, where this machine keeps the torch 2.13.0 CPU wheel:
# uv takes that wheel from there when it is there, and pip installs torch otherwise (uv
# would fetch a CUDA build of several GB from the index). uv writes no .pyc files (pip
# compiles all ~15,000 of torch's): the first process to import a module writes its cache,
# so PYTHONDONTWRITEBYTECODE (set on CI) must not reach the commands below, or every new
# process compiles torch's sources again (that doubled the suite's time).
unexport PYTHONDONTWRITEBYTECODE
WHEELS ?= $(or $(firstword $(PIP_FIND_LINKS)),/opt/wheels)
UV := $(VENV)/bin/uv pip install --python $(PY) --quiet --constraint constraints.txt

.PHONY: run test lint bench bench-check clean

# torch is pinned by constraints.txt: no installer ever resolves a newer torch.
$(VENV)/.base: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --constraint constraints.txt uv
	if ls $(WHEELS)/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then \
		$(UV) --find-links $(WHEELS) torch==2.13.0; \
	else \
		$(PY) -m pip install --quiet --constraint constraints.txt torch==2.13.0; \
	fi
	$(UV) -e .
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(UV) -e '.[dev,serve,ray,h5py,rl,hf]'
	touch $@

run: $(VENV)/.base
	$(VENV)/bin/partrain train

# Two pytest workers: the suite's processes spend much of their time waiting (process start,
# sockets, other processes' steps), so two at once keep both cores busy. Each worker takes a
# whole module when it gets free (loadscope: a module's fixtures are set up once), slowest
# modules first (tests/conftest.py's SLOWEST_FIRST), so neither waits on the other at the end.
TEST_JOBS ?= 2
test: $(VENV)/.dev
	$(VENV)/bin/python -m pytest -q -n $(TEST_JOBS) --dist loadscope --no-loadscope-reorder --durations=15 tests

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check src tests

bench: $(VENV)/.dev
	$(VENV)/bin/partrain bench core --quick

# Every benchmark's --quick pinned to one core: exit 0, no traceback, a goals block (issue 53).
# 10-20 minutes, so not part of `make test`.
bench-check: $(VENV)/.dev
	$(PY) tools/bench_quick_check.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
