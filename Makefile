# The set-up contract: `make run` and `make test` work on a fresh machine with
# python3 >= 3.11 and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck pytest bench soak clean

$(STAMP): pyproject.toml client/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ./client -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/watchdogd $(ARGS)

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy --strict watchdogd client/watchdogd_client tests bench

pytest: $(STAMP)
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python bench/run.py

# The crash tests at full scale: 100 random kills under churn, a million timers.
soak: $(STAMP)
	WATCHDOGD_SOAK=1 $(BIN)/pytest -v tests/test_crash.py

clean:
	rm -rf $(VENV)
