# Loom: every target creates .venv and installs the project when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: chromium slurm-deps demo test test-fast bench lint format up down status clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)  ## start the embedded stack, run the example workload, show progress and a summary
	$(BIN)/loom demo

test: $(STAMP) chromium slurm-deps  ## the whole suite: unit, integration (real NATS + PostgreSQL + local Slurm), end-to-end, browser; 4 processes, a file each
	@$(BIN)/python -m pytest -q -n 4 --dist loadfile -m "not timing"; parallel=$$?; \
	$(BIN)/python -m pytest -q -m timing; alone=$$?; \
	test $$parallel -eq 0 -a $$alone -eq 0

chromium:  ## the system Chromium the browser tests drive (Debian package; Playwright downloads nothing)
	@command -v chromium >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

slurm-deps:  ## Slurm (slurm-wlm 22.05) and munge for the Slurm tests and `loom up --slurm`, installed when missing
	@test -x /usr/sbin/slurmctld -a -x /usr/sbin/munged || DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge \
		|| (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge)

test-fast: $(STAMP)  ## unit tests only
	$(BIN)/python -m pytest -q tests/unit

bench: $(STAMP)  ## benchmarks, JSON into bench-results/
	@mkdir -p bench-results
	$(BIN)/loom bench e2e --jobs 2000 --json | tee bench-results/e2e.json

lint: $(STAMP)  ## ruff, mypy --strict on libs/ proto/ benchmarks/ services/, import-linter layering, stale generated contracts
	$(BIN)/ruff check libs proto services benchmarks tests tools
	$(BIN)/ruff format --check libs proto services benchmarks tests tools
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m loom_proto.asyncapi --check

format: $(STAMP)
	$(BIN)/ruff format libs proto services benchmarks tests tools
	$(BIN)/ruff check --fix libs proto services benchmarks tests tools

up: $(STAMP)
	$(BIN)/loom up
down: $(STAMP)
	$(BIN)/loom down
status: $(STAMP)
	$(BIN)/loom status

clean:
	-$(BIN)/loom down
	rm -rf .loom bench-results .pytest_cache .mypy_cache .ruff_cache
