# Two commands on a fresh machine:
#   make run    the integrated trainer's default job under `trainwatch launch`
#   make test   the whole test suite (real processes, py-spy, Prometheus)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-repeat setup system-deps bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned: on CPU machines this is the local CPU wheel; a bare
	# `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0 numpy
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Real servers and tools for the tests (Debian packages): Prometheus and
# promtool for the dashboard, scrape and alert tests; Chromium to render the
# job report page. Without root they are skipped with a warning.
system-deps:
	@missing=""; \
	command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing (Debian packages)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null) \
	      || echo "warning: could not install$$missing; their tests will be skipped"; \
	  else echo "warning:$$missing not installed (needs root: apt-get install$$missing); their tests will be skipped"; fi; \
	fi

run: setup
	$(BIN)/trainwatch launch --nproc-per-node 2

# Two workers, each test file on one of them (a file's module-scoped fixture, a
# real Prometheus or a finished run, is set up once). TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2

test: setup system-deps
	$(BIN)/pytest -q -ra --durations=20 -n $(TEST_WORKERS) --dist loadfile

# Flaky-test finder: the end-to-end tests N times (shuffled after the first
# run, the last beside a CPU hog); lists every test that did not always pass.
N ?= 3
test-repeat: setup system-deps
	$(BIN)/python tests/repeat.py --runs $(N)

bench: setup
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/detection.py
	$(BIN)/python benchmarks/recovery.py
	$(BIN)/python benchmarks/explain_accuracy.py

# On a GPU machine: every CUDA/NCCL/NVML path and the trainer's MFU, one JSON
# line per check, under 8 minutes on one H100 (benchmarks/gpu_check.py; README).
# Installs nothing beyond `setup`; fp8 needs the [gpu] extra installed already.
# GPU_PY=/path/to/python runs it in another environment that has trainwatch;
# GPU_CHECK_ARGS="--only nvml doctor --out-dir out" passes options.
GPU_PY ?= $(BIN)/python
gpu-check: $(if $(filter $(BIN)/python,$(GPU_PY)),setup)
	$(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
