# The two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv on first use and install from this repository's own files.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEV_STAMP := $(VENV)/.dev-installed
BENCH_STAMP := $(VENV)/.bench-installed

.PHONY: demo test lint typecheck bench bench-deps clean

$(DEV_STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

$(BENCH_STAMP): $(DEV_STAMP) requirements-bench.txt
	$(PY) -m pip install -q -r requirements-bench.txt
	touch $@

demo: $(DEV_STAMP)
	@echo "== owner-only shard reduction: examples/owner_rows.json"
	$(VENV)/bin/gradagg owner-sum examples/owner_rows.json
	@echo "== microbatch mean: examples/microbatches.json"
	$(VENV)/bin/gradagg mean examples/microbatches.json
	@echo "== every contract check (JSON in out/verify.json)"
	@mkdir -p out
	$(VENV)/bin/gradagg verify > out/verify.json && echo "verify: all checks passed"
	@echo "== distributed training on 2 local processes against the full-batch gradient"
	$(VENV)/bin/gradagg demo

test: $(DEV_STAMP)
	$(PY) -m pytest -q

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests bench

typecheck: $(DEV_STAMP)
	$(VENV)/bin/mypy src

bench-deps: $(BENCH_STAMP)

# The benchmarks print tables of medians and ratios; bench/RESULTS.md records a run.
bench: $(BENCH_STAMP)
	$(PY) bench/bench_engines.py
	$(PY) bench/bench_cli.py
	$(PY) bench/bench_training.py

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache
