# The commands a newcomer needs: `make demo`, `make check` (a quick check of the install) and `make test`;
# `make docs` builds the documentation site. Each creates .venv on first use and installs from this repository's
# own files.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEV_STAMP := $(VENV)/.dev-installed
BENCH_STAMP := $(VENV)/.bench-installed
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: demo check test docs lint typecheck bench bench-deps mutate clean

$(DEV_STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# requirements-dev.txt as constraints: the docs' packages never move a pinned development package.
$(DOCS_STAMP): $(DEV_STAMP) requirements-docs.txt
	$(PY) -m pip install -q -r requirements-docs.txt -c requirements-dev.txt
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

# A quick check of an install (under 2 minutes on 2 cores once .venv exists): the README's code blocks as pasted,
# every contract check, and one 2-rank training world against the full batch (it exits 1 if it misses).
check: $(DEV_STAMP)
	@echo "== the README's code blocks (tests/test_docs_blocks.py)"
	$(PY) -m pytest -q -p no:cacheprovider tests/test_docs_blocks.py -k README.md
	@echo "== every contract check"
	$(VENV)/bin/gradagg verify > /dev/null && echo "verify: all checks passed"
	@echo "== 2 local gloo ranks, uneven microbatches and tokens, against the one-process full batch"
	GLOO_SOCKET_IFNAME=lo $(PY) examples/token_weighted.py

# Two pytest workers (pytest-xdist), each taking whole files: a file's shared worlds (module-scoped fixtures) stay
# in one worker, and a serial run leaves the second core idle between worlds.
test: $(DEV_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# The documentation site, into site/: warnings (a broken link or API reference) fail the build.
docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

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

# Mutation testing of the counting rules (mutmut; what and how in pyproject.toml's [tool.mutmut]): a fresh run of
# the whole scoped set, then its report into bench/MUTATION.md. It takes about an hour on 2 cores; CI runs a fixed
# sample of mutants instead (tests/mutation/test_sample.py, in make test).
mutate: $(DEV_STAMP)
	rm -rf mutants
	start=$$(date +%s); nice -n 10 $(VENV)/bin/mutmut run --max-children 2 && \
	  $(PY) -m tests.mutation.report $$(( $$(date +%s) - start )) > bench/MUTATION.md
	@echo "report: bench/MUTATION.md"

clean:
	rm -rf $(VENV) out site mutants .pytest_cache .mypy_cache .ruff_cache
