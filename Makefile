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
	@echo "== distributed training on 2 local processes against the full batch (token-weighted, then MoE)"
	$(VENV)/bin/gradagg demo
	@echo "== your own step against the full batch: a right one passes, a mean of per-rank means fails"
	$(VENV)/bin/gradagg parity examples/parity/token_mean_gradagg.py > out/parity_right.json && echo "parity: passed"
	$(VENV)/bin/gradagg parity examples/parity/mistake_mean_of_rank_means.py > out/parity_mistake.json; \
	  test $$? -eq 1 && echo "parity: the mistake was caught (exit 1, see out/parity_mistake.json)"

test: $(DEV_STAMP)
	$(PY) -m pytest -q

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests bench examples

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
