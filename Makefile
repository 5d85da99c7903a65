# Two commands on a fresh machine:
#   make run    the integrated trainer's default job under `trainwatch launch`
#   make test   the whole test suite (real processes, py-spy, Prometheus)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test setup system-deps bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned: on CPU machines this is the local CPU wheel; a bare
	# `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0 numpy
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# A real Prometheus server for the dashboard/query tests (Debian package).
system-deps:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
	      || echo "warning: could not install prometheus; its tests will be skipped"; \
	  else echo "warning: prometheus not installed (needs root: apt-get install prometheus); its tests will be skipped"; fi; }

run: setup
	$(BIN)/trainwatch launch --nproc-per-node 2

test: setup system-deps
	$(BIN)/pytest -q -ra; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

bench: setup
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/detection.py
	$(BIN)/python benchmarks/recovery.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
